use std::io::Read;
use std::ops::ControlFlow;
use std::sync::Arc;

use regex::bytes::{Regex, RegexBuilder};
use regex_syntax::hir::Look;

use crate::error::{OffloadError, Shown};
use crate::key::{Key, StorePath, ThreadId};
use crate::scan;

/// Where offloaded text lives: a namespace of UTF-8 files per thread.
///
/// Four backends ship with the crate: [`FsStore`](crate::FsStore) (a directory on
/// disk, atomic writes, optional fsync), [`MemoryStore`](crate::MemoryStore) (for
/// tests and short-lived agents), [`SqliteStore`](crate::SqliteStore) (feature
/// `sqlite`) and [`PostgresStore`](crate::PostgresStore) (feature `postgres`). All pass
/// the same conformance suite ([`conformance`](crate::conformance), feature
/// `conformance`), which other backends can run too.
///
/// # Blocking
///
/// Every method blocks the calling thread until the work is done (plain `std::fs`
/// for [`FsStore`](crate::FsStore)); none of them is `async`. Stores are
/// `Send + Sync`, so async code shares one behind an `Arc` and runs calls on a
/// blocking thread — with tokio, `tokio::task::spawn_blocking(move || store.put(&key,
/// &text))`. The policies and tools of this crate call the store directly and are
/// blocking too.
///
/// # Paths and directories
///
/// A [`Key`] is a [`ThreadId`] plus a [`StorePath`]; both are validated when they are
/// built, so a store never sees `..`, absolute paths or NUL bytes. Directories exist
/// only implicitly: `put` creates the parents of a path, and a path cannot be both a
/// file and the parent of another file.
///
/// ```
/// use keel_offload::{Key, LineRange, MemoryStore, OffloadStore, Pattern, GrepOptions};
///
/// let store = MemoryStore::new();
/// let key = Key::new("t1", "notes/build.log")?;
/// store.put(&key, "compiling\nerror: missing semicolon\n")?;
/// store.append(&key, "1 error\n")?;
///
/// let lines = store.read_lines(&key, &LineRange::new(1, 10))?;
/// assert_eq!(lines.lines[0].number, 2);
/// assert_eq!(lines.lines[0].text, "error: missing semicolon");
/// assert_eq!(lines.total_lines, Some(3));
///
/// let found = store.grep(key.thread(), None, &Pattern::new("^error:")?, &GrepOptions::default())?;
/// assert_eq!(found.matches.len(), 1);
/// assert_eq!(found.matches[0].path.as_str(), "notes/build.log");
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
pub trait OffloadStore: Send + Sync {
    /// Stores `text` under `key`, replacing what was there. Readers see either the old
    /// content or the new, never a mix. Returns the number of bytes stored.
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError>;

    /// Appends `text` to `key` (creating it if needed) without rewriting what is
    /// already stored. Returns the byte offset at which `text` begins.
    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError>;

    /// The whole content of `key`.
    fn get(&self, key: &Key) -> Result<String, OffloadError>;

    /// A reader over the content of `key`, for streaming large entries.
    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError>;

    /// Up to `len` bytes of `key` starting at byte `offset` (fewer at the end).
    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError>;

    /// The size of `key` in bytes, or `None` when nothing is stored there.
    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError>;

    /// Every file of `thread` (under `under`, a directory or one file, when given),
    /// sorted by path. An unknown thread has no files; an unknown `under` is
    /// [`OffloadError::NotFound`].
    fn list(
        &self,
        thread: &ThreadId,
        under: Option<&StorePath>,
    ) -> Result<Vec<Entry>, OffloadError>;

    /// Removes `key`. Returns whether there was something to remove.
    fn delete(&self, key: &Key) -> Result<bool, OffloadError>;

    /// Removes every file of `thread`; returns how many there were. Other threads are
    /// untouched. The default lists the thread and deletes file by file; database
    /// backends remove the thread's rows in one transaction.
    ///
    /// ```
    /// use keel_offload::{Key, MemoryStore, OffloadStore, ThreadId};
    ///
    /// let store = MemoryStore::new();
    /// store.put(&Key::new("t1", "large_tool_results/call_1")?, "big")?;
    /// store.append(&Key::new("t1", "archive/messages.jsonl")?, "{}\n")?;
    /// store.put(&Key::new("t2", "notes")?, "kept")?;
    /// assert_eq!(store.delete_thread(&ThreadId::new("t1")?)?, 2);
    /// assert!(store.list(&ThreadId::new("t1")?, None)?.is_empty());
    /// assert_eq!(store.list(&ThreadId::new("t2")?, None)?.len(), 1);
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        let mut removed = 0;
        for entry in self.list(thread, None)? {
            if self.delete(&Key::from_parts(thread.clone(), entry.path))? {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Cuts `key` to its first `len` bytes without rewriting them; returns whether
    /// anything was cut (`false` when the value is `len` bytes or shorter). Nothing
    /// stored is [`OffloadError::NotFound`]. [`collect_garbage`](crate::collect_garbage)
    /// uses it to drop what only an abandoned branch of a thread appended to a file
    /// the surviving branches share.
    ///
    /// keel's backends cut in place (a file's length; the chunk rows past `len`); the
    /// default reads the whole value and puts its first `len` bytes back. Every one
    /// refuses a `len` inside a character (values are text), changing nothing.
    ///
    /// ```
    /// use keel_offload::{Key, MemoryStore, OffloadStore};
    ///
    /// let store = MemoryStore::new();
    /// let key = Key::new("t1", "archive/messages.jsonl")?;
    /// store.append(&key, "one\ntwo\n")?;
    /// assert!(store.truncate(&key, 4)?);
    /// assert_eq!(store.get(&key)?, "one\n");
    /// assert!(!store.truncate(&key, 100)?);
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
        let text = self.get(key)?;
        let Ok(len) = usize::try_from(len) else {
            return Ok(false);
        };
        if len >= text.len() {
            return Ok(false);
        }
        let kept = text.get(..len).ok_or_else(|| cut_inside_char(key))?;
        self.put(key, kept)?;
        Ok(true)
    }

    /// Lines `range.offset ..` of `key`, at most `range.limit` of them, each cut to
    /// `range.max_line_bytes`. Streams: the entry is never loaded whole.
    ///
    /// Lines are separated by `\n` (a `\r` before it is dropped); a last line without
    /// `\n` counts; an empty entry has no lines — the same rule as [`str::lines`].
    fn read_lines(&self, key: &Key, range: &LineRange) -> Result<Lines, OffloadError> {
        let reader = self.open(key)?;
        scan::read_lines(reader, range).map_err(|e| OffloadError::io("read", key, e))
    }

    /// Lines matching `pattern` in the files of `thread` (under `under` when given),
    /// in path order, at most `options.max_results`. Streams each file in chunks.
    fn grep(
        &self,
        thread: &ThreadId,
        under: Option<&StorePath>,
        pattern: &Pattern,
        options: &GrepOptions,
    ) -> Result<GrepOutcome, OffloadError> {
        let mut out = GrepOutcome::default();
        for entry in self.list(thread, under)? {
            let key = Key::from_parts(thread.clone(), entry.path.clone());
            let reader = match self.open(&key) {
                Ok(r) => r,
                // Deleted between list and open: nothing to search.
                Err(OffloadError::NotFound { .. }) => continue,
                Err(e) => return Err(e),
            };
            out.files_searched += 1;
            let matches = &mut out.matches;
            let mut truncated = false;
            let searched = scan::grep(reader, pattern, |m| {
                if matches.len() >= options.max_results {
                    truncated = true;
                    return ControlFlow::Break(());
                }
                let (line, line_truncated, from_byte) =
                    scan::display_line_at(m.line, options.max_line_bytes, m.match_at);
                matches.push(GrepMatch {
                    path: entry.path.clone(),
                    line_number: m.line_number,
                    byte_offset: m.byte_offset,
                    line,
                    truncated: line_truncated,
                    from_byte: usize::try_from(m.window_at)
                        .unwrap_or(usize::MAX)
                        .saturating_add(from_byte),
                });
                ControlFlow::Continue(())
            })
            .map_err(|e| OffloadError::io("read", &key, e))?;
            out.bytes_searched += searched;
            if truncated {
                out.truncated = true;
                break;
            }
        }
        Ok(out)
    }
}

macro_rules! forward {
    ($($ptr:ty),*) => {$(
        impl<S: OffloadStore + ?Sized> OffloadStore for $ptr {
            fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
                (**self).put(key, text)
            }
            fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
                (**self).append(key, text)
            }
            fn get(&self, key: &Key) -> Result<String, OffloadError> {
                (**self).get(key)
            }
            fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
                (**self).open(key)
            }
            fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
                (**self).read_at(key, offset, len)
            }
            fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
                (**self).size(key)
            }
            fn list(&self, thread: &ThreadId, under: Option<&StorePath>) -> Result<Vec<Entry>, OffloadError> {
                (**self).list(thread, under)
            }
            fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
                (**self).delete(key)
            }
            fn read_lines(&self, key: &Key, range: &LineRange) -> Result<Lines, OffloadError> {
                (**self).read_lines(key, range)
            }
            fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
                (**self).delete_thread(thread)
            }
            fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
                (**self).truncate(key, len)
            }
            fn grep(
                &self,
                thread: &ThreadId,
                under: Option<&StorePath>,
                pattern: &Pattern,
                options: &GrepOptions,
            ) -> Result<GrepOutcome, OffloadError> {
                (**self).grep(thread, under, pattern, options)
            }
        }
    )*};
}

forward!(&S, Box<S>, Arc<S>);

/// One file listed by [`OffloadStore::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its path inside the thread.
    pub path: StorePath,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Which lines [`OffloadStore::read_lines`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineRange {
    /// Lines to skip from the start (0-based index of the first line returned).
    pub offset: usize,
    /// At most this many lines are returned.
    pub limit: usize,
    /// Each line is cut to this many bytes (at a character boundary).
    pub max_line_bytes: usize,
}

impl LineRange {
    /// `limit` lines from `offset`, each cut to 8 KiB.
    pub fn new(offset: usize, limit: usize) -> Self {
        LineRange {
            offset,
            limit,
            max_line_bytes: 8 * 1024,
        }
    }

    /// Sets the per-line cut.
    #[must_use]
    pub fn with_max_line_bytes(mut self, max_line_bytes: usize) -> Self {
        self.max_line_bytes = max_line_bytes;
        self
    }
}

/// The answer of [`OffloadStore::read_lines`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lines {
    /// The lines read, in order.
    pub lines: Vec<Line>,
    /// More lines follow the last one returned.
    pub more: bool,
    /// The number of lines in the entry, known when the read reached its end.
    pub total_lines: Option<usize>,
}

/// One line of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// 1-based line number.
    pub number: usize,
    /// The text (invalid UTF-8 replaced), cut to the requested length.
    pub text: String,
    /// The line was longer than the requested length.
    pub truncated: bool,
}

/// Limits of one [`OffloadStore::grep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrepOptions {
    /// Stop after this many matching lines.
    pub max_results: usize,
    /// Each matching line is cut to this many bytes in the result.
    pub max_line_bytes: usize,
}

impl Default for GrepOptions {
    /// 100 results, lines cut to 1 KiB.
    fn default() -> Self {
        GrepOptions {
            max_results: 100,
            max_line_bytes: 1024,
        }
    }
}

/// The answer of [`OffloadStore::grep`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrepOutcome {
    /// Matching lines, by path then line.
    pub matches: Vec<GrepMatch>,
    /// The search stopped at `max_results`: more matching lines exist.
    pub truncated: bool,
    /// Files opened.
    pub files_searched: usize,
    /// Bytes read (the whole of each file unless the search stopped early).
    pub bytes_searched: u64,
}

/// One matching line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrepMatch {
    /// The file.
    pub path: StorePath,
    /// 1-based line number.
    pub line_number: usize,
    /// Byte offset of the start of the line in the file.
    pub byte_offset: u64,
    /// The line, cut to the requested length: from its start, or, when the match lies
    /// past what that would show, from a little before the match ([`from_byte`]).
    ///
    /// [`from_byte`]: GrepMatch::from_byte
    pub line: String,
    /// `line` stops before the line's end.
    pub truncated: bool,
    /// The byte of the line `line` starts at: 0, or more when a long line was cut
    /// around its match.
    pub from_byte: usize,
}

/// A regular expression matched line by line (the `regex` crate's syntax).
///
/// `^` and `$` match at the start and end of each line (before a `\r\n` too); a match
/// never spans lines.
/// Patterns are compiled with a size limit, so a hostile pattern is an error rather
/// than a memory blow-up.
///
/// ```
/// use keel_offload::Pattern;
///
/// let p = Pattern::new(r"^error: \w+$")?;
/// assert!(p.is_match_line(b"error: timeout"));
/// assert!(!p.is_match_line(b"warning: error: timeout"));
/// assert!(Pattern::new("(unclosed").is_err());
/// assert!(Pattern::literal("a.b")?.is_match_line(b"xa.by"));
/// assert!(!Pattern::literal("a.b")?.is_match_line(b"axb"));
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    regex: Regex,
    /// The pattern uses `\A` / `\z` (absolute anchors), whose meaning depends on the
    /// haystack: such patterns are run on each line alone rather than on whole chunks.
    pub(crate) line_by_line: bool,
}

impl Pattern {
    /// Largest compiled program accepted, in bytes.
    pub const SIZE_LIMIT: usize = 4 << 20;

    /// Compiles a regular expression.
    pub fn new(pattern: &str) -> Result<Self, OffloadError> {
        let bad = |reason: String| OffloadError::Pattern {
            pattern: Shown::new(pattern),
            reason,
        };
        let regex = RegexBuilder::new(pattern)
            .multi_line(true)
            .crlf(true)
            .size_limit(Self::SIZE_LIMIT)
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let hir = regex_syntax::ParserBuilder::new()
            .multi_line(true)
            .crlf(true)
            .utf8(false)
            .build()
            .parse(pattern)
            .map_err(|e| bad(e.to_string()))?;
        let looks = hir.properties().look_set();
        Ok(Pattern {
            source: pattern.to_owned(),
            regex,
            line_by_line: looks.contains(Look::Start) || looks.contains(Look::End),
        })
    }

    /// A pattern matching `text` literally.
    pub fn literal(text: &str) -> Result<Self, OffloadError> {
        Self::new(&regex::escape(text))
    }

    /// The pattern as given.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True if `line` (one line, without its `\n`) matches.
    pub fn is_match_line(&self, line: &[u8]) -> bool {
        self.regex.is_match(line)
    }

    pub(crate) fn regex(&self) -> &Regex {
        &self.regex
    }
}

/// Whether `byte` continues a UTF-8 character (so a cut before it splits one).
pub(crate) fn continues_char(byte: u8) -> bool {
    byte & 0xC0 == 0x80
}

/// The error of a truncation whose cut falls inside a character.
pub(crate) fn cut_inside_char(key: &Key) -> OffloadError {
    OffloadError::io(
        "truncate",
        key,
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the cut falls inside a character",
        ),
    )
}
