//! `grep` on the disk: ripgrep's walker (the `ignore` crate), and a regex that decides
//! line by line, run over a small file's whole text to find the lines worth deciding on.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use ignore::gitignore::Gitignore;
use ignore::overrides::OverrideBuilder;
use ignore::{DirEntry, Match, WalkBuilder};
use keel_message::ToolError;
use regex::bytes::{Regex, RegexBuilder};
use serde_json::{Map, Value};

use super::args;
use super::ops::{READ_BUFFER, count};
use super::path::Root;
use super::text::{LineReader, SNIFF_BYTES, quoted, show_match, thousands};
use super::{FileTools, OFFLOAD_DIRS};

/// Bytes of each line matched against the pattern: a match further into a longer
/// line is not found.
pub(super) const GREP_LINE_BYTES: usize = 64 * 1024;

/// Most bytes of compiled regex a pattern may take.
const REGEX_SIZE_LIMIT: usize = 16 * 1024 * 1024;

/// Most bytes of compiled regex a pattern [`GrepCache`] keeps may take: a larger one
/// (`\w{300}` compiles to megabytes) is compiled for its call and not kept, so the
/// cache holds tens of megabytes at most, not gigabytes.
const CACHED_REGEX_SIZE: usize = 512 * 1024;

/// Compiled patterns [`GrepCache`] keeps at most (it starts over past that).
const CACHED_PATTERNS: usize = 64;

/// Parsed .gitignore files [`GrepCache`] keeps at most (it starts over past that).
const CACHED_IGNORES: usize = 256;

/// What `grep` keeps between calls of one [`FileTools`]: the compiled regex of recent
/// patterns (an agent greps the same few again and again; compiling one costs more than
/// searching a small tree), and the .gitignore files above the search path, parsed,
/// each used again only while its modification time and length are unchanged.
#[derive(Debug, Default)]
pub(super) struct GrepCache {
    patterns: Mutex<HashMap<String, Pattern>>,
    ignores: Mutex<HashMap<PathBuf, (Stamp, Arc<Gitignore>)>>,
}

/// When a file was last changed, as far as the cache can tell.
type Stamp = (Option<SystemTime>, u64);

impl GrepCache {
    fn regex(&self, pattern: &str) -> Result<Pattern, ToolError> {
        let mut patterns = self.patterns.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(compiled) = patterns.get(pattern) {
            return Ok(compiled.clone());
        }
        // Compiled small enough to keep, or else at the full limit, for this call only.
        let small = RegexBuilder::new(pattern)
            .size_limit(CACHED_REGEX_SIZE)
            .build()
            .is_ok();
        let limit = if small {
            CACHED_REGEX_SIZE
        } else {
            REGEX_SIZE_LIMIT
        };
        let build = |multi_line| {
            RegexBuilder::new(pattern)
                .size_limit(limit)
                .multi_line(multi_line)
                .build()
        };
        let line = build(false).map_err(|e| {
            ToolError::bad_arguments(format!("`pattern` is not a valid regular expression: {e}"))
        })?;
        // Inline flags could turn multi-line mode back off, and `\A` / `\z` anchor
        // at the ends of the whole text: such patterns keep to the line-by-line search.
        let whole = ["(?", "\\A", "\\z"]
            .iter()
            .all(|s| !pattern.contains(s))
            .then(|| build(true).ok())
            .flatten();
        let compiled = Pattern { line, whole };
        if !small {
            return Ok(compiled);
        }
        if patterns.len() >= CACHED_PATTERNS {
            patterns.clear();
        }
        patterns.insert(pattern.to_owned(), compiled.clone());
        Ok(compiled)
    }

    /// The parsed .gitignore at `file`, if it is a regular file of at most
    /// [`MAX_IGNORE_FILE_BYTES`] (a link, a FIFO or a device is not read).
    fn gitignore(&self, file: PathBuf) -> Option<Arc<Gitignore>> {
        let meta = std::fs::symlink_metadata(&file)
            .ok()
            .filter(|m| m.file_type().is_file() && m.len() <= MAX_IGNORE_FILE_BYTES)?;
        let stamp: Stamp = (meta.modified().ok(), meta.len());
        let mut ignores = self.ignores.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((seen, gitignore)) = ignores.get(&file)
            && seen.0.is_some()
            && *seen == stamp
        {
            return Some(Arc::clone(gitignore));
        }
        // Parsed under the lock: two calls do not parse the same file twice.
        let (gitignore, _partial_errors) = Gitignore::new(&file);
        let gitignore = Arc::new(gitignore);
        if ignores.len() >= CACHED_IGNORES {
            ignores.clear();
        }
        ignores.insert(file, (stamp, Arc::clone(&gitignore)));
        Some(gitignore)
    }
}

/// A `grep` pattern, compiled twice.
#[derive(Debug, Clone)]
struct Pattern {
    /// Matched against one line at a time: what decides whether a line matches.
    line: Regex,
    /// The same pattern in multi-line mode, run over a whole file to find the lines
    /// worth trying `line` on; `None` when the pattern cannot be run so (see
    /// [`scan_buffer`]).
    whole: Option<Regex>,
}

/// Where [`scan_file`] puts the lines that match.
struct Sink<'a> {
    regex: &'a Pattern,
    path: &'a str,
    found: &'a mut Vec<Found>,
    max_results: usize,
    line_chars: usize,
}

impl Sink<'_> {
    /// Records line `number` if it matches; true once `max_results` lines are found.
    fn offer(&mut self, text: &[u8], number: u64, truncated: bool) -> bool {
        if let Some(m) = self.regex.line.find(text) {
            self.found.push(Found {
                path: self.path.to_owned(),
                line: number,
                text: show_match(text, truncated, self.line_chars, m.start()),
            });
        }
        self.found.len() >= self.max_results
    }
}

/// How the search of one file ended.
enum ScanEnd {
    /// Searched to its end (or to the byte budget).
    Done,
    /// `max_results` lines were found.
    Full,
    /// Binary: a NUL byte at the start, or on a line (lines before it were searched).
    Binary,
    /// A read failed (lines before it were searched).
    Unreadable,
}

/// What [`scan_file`] did with one file.
struct Scan {
    end: ScanEnd,
    /// Bytes read up to the end of the last line searched.
    consumed: u64,
}

/// Files up to this size are read whole and searched in one pass over the buffer.
const WHOLE_FILE_BYTES: usize = 1024 * 1024;

/// Searches `file`, at most `budget` bytes of it, line by line: each line (without its
/// `\n` or `\r\n`, cut to [`GREP_LINE_BYTES`]) is offered to `sink` in order.
///
/// A file up to [`WHOLE_FILE_BYTES`] is first read whole into `buffer` and, when
/// [`scan_buffer`] can, searched in one pass; otherwise, and for a larger file, the
/// lines are read one at a time into `line`. Both ways find the same lines.
fn scan_file(
    mut file: File,
    budget: u64,
    sink: &mut Sink<'_>,
    buffer: &mut Vec<u8>,
    line: &mut Vec<u8>,
) -> Scan {
    let cap = budget.min(WHOLE_FILE_BYTES as u64 + 1);
    buffer.clear();
    let read = (&mut file).take(cap).read_to_end(buffer);
    let head = buffer.get(..SNIFF_BYTES).unwrap_or(buffer);
    if memchr::memchr(0, head).is_some() {
        return Scan {
            end: ScanEnd::Binary,
            consumed: 0,
        };
    }
    let whole = read.is_ok() && (buffer.len() as u64) < cap || buffer.len() as u64 == budget;
    if whole && let Some(scan) = scan_buffer(buffer, sink) {
        return scan;
    }
    // The bytes already read, then the rest of the file (a failed read is met again).
    let rest = file.take(budget.saturating_sub(buffer.len() as u64));
    let reader = BufReader::with_capacity(READ_BUFFER, Cursor::new(&buffer[..]).chain(rest));
    scan_lines(LineReader::new(reader), sink, line)
}

/// The line-by-line search of [`scan_file`].
fn scan_lines<R: BufRead>(
    mut reader: LineReader<R>,
    sink: &mut Sink<'_>,
    line: &mut Vec<u8>,
) -> Scan {
    let mut number: u64 = 0;
    let end = loop {
        match reader.next_line(line, GREP_LINE_BYTES) {
            Ok(Some(info)) => {
                number += 1;
                if super::cancelled() {
                    break ScanEnd::Done;
                }
                if info.nul {
                    // Binary from here on, as ripgrep treats it.
                    break ScanEnd::Binary;
                }
                if sink.offer(line, number, info.truncated) {
                    break ScanEnd::Full;
                }
            }
            Ok(None) => break ScanEnd::Done,
            Err(_) => break ScanEnd::Unreadable,
        }
    };
    Scan {
        end,
        consumed: reader.consumed(),
    }
}

/// The one-pass search of a whole file in `buf`, or `None` when the file holds what
/// only the line-by-line search handles as it must: a NUL byte, a `\r`, or a line
/// longer than [`GREP_LINE_BYTES`] (or the pattern has no multi-line form).
///
/// The multi-line regex finds every line the line regex matches, and maybe more: a
/// match of the line regex within a line is a match of the multi-line one at the same
/// place of the buffer, since `^` and `$` then match at the line's ends, and a word
/// boundary sees a `\n` beside the line as it sees nothing. So the line where the
/// earliest-ending multi-line match ends is the first that may match (a line before it
/// holding a match would hold an earlier end), and the line regex decides on it; the
/// search goes on from the line after it. Asking only where the earliest match ends
/// stops each search there: a pattern whose matches run far (`a[^z]*z`) costs one
/// pass over the file, not one per line.
fn scan_buffer(buf: &[u8], sink: &mut Sink<'_>) -> Option<Scan> {
    let whole = sink.regex.whole.as_ref()?;
    if memchr::memchr2(0, b'\r', buf).is_some() {
        return None;
    }
    if buf.len() > GREP_LINE_BYTES {
        let mut start = 0;
        for end in memchr::memchr_iter(b'\n', buf).chain([buf.len()]) {
            if end - start > GREP_LINE_BYTES {
                return None;
            }
            start = end + 1;
        }
    }
    // The text past the last `\n` is a line only if it is not empty.
    let lines_end = match buf.last() {
        Some(b'\n') => buf.len() - 1,
        _ => buf.len(),
    };
    let (mut at, mut number, mut counted) = (0, 1u64, 0);
    while at <= lines_end && !buf.is_empty() {
        let Some(hit) = whole.shortest_match_at(buf, at) else {
            break;
        };
        if hit > lines_end {
            break;
        }
        let start = memchr::memrchr(b'\n', &buf[..hit]).map_or(0, |i| i + 1);
        let end = memchr::memchr(b'\n', &buf[hit..]).map_or(buf.len(), |i| hit + i);
        number += newlines(&buf[counted..start]);
        counted = start;
        if sink.offer(&buf[start..end], number, false) {
            return Some(Scan {
                end: ScanEnd::Full,
                consumed: (end + 1).min(buf.len()) as u64,
            });
        }
        at = end + 1;
    }
    Some(Scan {
        end: ScanEnd::Done,
        consumed: buf.len() as u64,
    })
}

/// The `\n` bytes in `bytes`.
fn newlines(bytes: &[u8]) -> u64 {
    memchr::memchr_iter(b'\n', bytes).count() as u64
}

/// Why the walk stopped early.
enum Stop {
    Results,
    Files,
    Entries,
    Bytes,
}

struct Found {
    path: String,
    line: u64,
    text: String,
}

pub(super) fn grep(tools: &FileTools, args: &Map<String, Value>) -> Result<String, ToolError> {
    let pattern = args::required_string(args, "pattern")?;
    let regex = tools.grep_cache.regex(pattern)?;
    let rel = args::optional_path(args)?;
    let glob = args::string(args, "glob")?;
    let l = &tools.limits;
    let f = &tools.file_limits;
    let max_results = args::integer(args, "max_results", 1)?
        .unwrap_or(l.default_grep_results)
        .min(l.max_grep_results)
        .max(1);
    let target = tools.root.existing(&rel).map_err(ToolError::failed)?;
    let what = rel.describe();

    // Ignore files are read by name, so one that is a link (to /dev/zero, a file
    // outside the root) or a FIFO would hang the search or exhaust memory: such a file
    // in the search path turns ignore files off for the call, and a directory below
    // with one is not searched (each said in a note).
    let own_ignores = if target.is_dir() {
        ignore_files_ok(&target)
    } else {
        Ok(())
    };
    let skipped: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut walk = WalkBuilder::new(&target);
    // .gitignore files are read as the walker's custom ignore files, not with its git
    // options: those make it canonicalize the search path and read the ignore files of
    // every directory up to `/` before the first entry (a third of a small search's
    // time), all of which `parents(false)` then leaves unused. The ones between the root
    // and the search path are `above`.
    walk.standard_filters(true)
        .hidden(true)
        .parents(false)
        .git_ignore(false)
        .git_exclude(false)
        .git_global(false)
        .require_git(false)
        .follow_links(false)
        .sort_by_file_name(|a, b| a.cmp(b));
    if own_ignores.is_ok() {
        walk.add_custom_ignore_filename(".gitignore");
    } else {
        walk.ignore(false);
    }
    if let Some(glob) = glob {
        let mut globs = OverrideBuilder::new(&target);
        globs
            .add(glob)
            .map_err(|e| ToolError::bad_arguments(format!("`glob` is not a valid glob: {e}")))?;
        let globs = globs
            .build()
            .map_err(|e| ToolError::bad_arguments(format!("`glob` is not a valid glob: {e}")))?;
        walk.overrides(globs);
    }
    let above = ancestor_ignores(&tools.grep_cache, &tools.root, &target);
    let skip_offload_dirs = tools.offload.is_some() && target == tools.root.dir();
    let check_ignores = own_ignores.is_ok();
    let skips = Arc::clone(&skipped);
    let root = tools.root.clone();
    walk.filter_entry(move |entry| {
        if check_ignores
            && entry.depth() > 0
            && entry.file_type().is_some_and(|t| t.is_dir())
            && let Err(bad) = ignore_files_ok(entry.path())
        {
            let mut skips = skips.lock().unwrap_or_else(PoisonError::into_inner);
            if skips.len() < 3 {
                skips.push(ignore_file_note(&root, entry.path(), &bad));
            }
            return false;
        }
        keep_entry(entry, &above, skip_offload_dirs)
    });

    let mut found: Vec<Found> = Vec::new();
    let mut files: u64 = 0;
    let mut visited: u64 = 0;
    let max_visited = (f.max_grep_files as u64).saturating_mul(10);
    let mut bytes: u64 = 0;
    let mut binary: u64 = 0;
    let mut unreadable: u64 = 0;
    let mut stop: Option<Stop> = None;
    let mut line = Vec::new();
    let mut buffer = Vec::new();
    'walk: for entry in walk.build() {
        if super::cancelled() {
            // Nobody waits for the answer any more.
            break;
        }
        let Ok(entry) = entry else {
            unreadable += 1;
            continue;
        };
        visited += 1;
        if visited > max_visited {
            stop = Some(Stop::Entries);
            break;
        }
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        if files >= f.max_grep_files as u64 {
            stop = Some(Stop::Files);
            break;
        }
        let budget = f.max_grep_bytes.saturating_sub(bytes);
        if budget == 0 {
            stop = Some(Stop::Bytes);
            break;
        }
        files += 1;
        let Ok(file) = File::open(entry.path()) else {
            unreadable += 1;
            continue;
        };
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let shown = tools.root.relative_display(entry.path());
        let mut sink = Sink {
            regex: &regex,
            path: &shown,
            found: &mut found,
            max_results,
            line_chars: l.grep_line_chars,
        };
        let scan = scan_file(file, budget, &mut sink, &mut buffer, &mut line);
        bytes = bytes.saturating_add(scan.consumed);
        match scan.end {
            ScanEnd::Binary => binary += 1,
            ScanEnd::Unreadable => unreadable += 1,
            ScanEnd::Full => {
                stop = Some(Stop::Results);
                break 'walk;
            }
            ScanEnd::Done => {}
        }
        if scan.consumed >= budget && size > budget {
            stop = Some(Stop::Bytes);
            break;
        }
    }

    let mut notes = String::new();
    match stop {
        Some(Stop::Results) => {
            let _ = write!(
                notes,
                "\n[stopped at {max_results} matches: narrow the pattern or the path]"
            );
        }
        Some(Stop::Files) => {
            let _ = write!(
                notes,
                "\n[stopped after searching {}, the most one call searches: narrow the \
                 path or add a glob to search the rest]",
                count(files, "file", "files")
            );
        }
        Some(Stop::Entries) => {
            let _ = write!(
                notes,
                "\n[stopped after visiting {}, the most one call visits: narrow the path \
                 or add a glob to search the rest]",
                count(max_visited, "path", "paths")
            );
        }
        Some(Stop::Bytes) => {
            let _ = write!(
                notes,
                "\n[stopped after reading {}, the most one call reads: narrow the path or \
                 add a glob to search the rest]",
                count(bytes, "byte", "bytes")
            );
        }
        None => {}
    }
    if binary > 0 {
        let _ = write!(
            notes,
            "\n[{} skipped as binary]",
            count(binary, "file", "files")
        );
    }
    if unreadable > 0 {
        let _ = write!(
            notes,
            "\n[{} could not be read]",
            count(unreadable, "path", "paths")
        );
    }
    if let Err(bad) = &own_ignores {
        let _ = write!(
            notes,
            "\n[no ignore file was applied: {}, which grep does not read]",
            ignore_file_note(&tools.root, &target, bad)
        );
    }
    for note in skipped
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
    {
        let _ = write!(
            notes,
            "\n[a directory not searched: {note}, which grep does not read]"
        );
    }

    if found.is_empty() {
        let place = if target.is_dir() {
            format!("{} under {what}", count(files, "file", "files"))
        } else {
            what
        };
        return Ok(format!(
            "No lines match {} in {place}.{notes}",
            quoted(pattern)
        ));
    }
    let mut out = String::new();
    let mut chars = 0;
    for m in &found {
        let row = format!("{}:{}: {}\n", m.path, m.line, m.text);
        let n = row.chars().count();
        if chars + n > keel_offload::output_room(l.max_output_chars) && !out.is_empty() {
            let _ = write!(
                out,
                "[output capped at {} characters: narrow the pattern or the path]",
                thousands(l.max_output_chars as u64)
            );
            return Ok(out);
        }
        chars += n;
        out.push_str(&row);
    }
    let text = out.trim_end().to_owned();
    Ok(format!("{text}{notes}"))
}

/// The .gitignore files of the directories from the root down to `target`'s parent:
/// the walker reads those at `target` and below, but none above it (it would climb
/// past the root).
fn ancestor_ignores(cache: &GrepCache, root: &Root, target: &Path) -> Vec<Arc<Gitignore>> {
    let mut out = Vec::new();
    let Ok(rel) = target.strip_prefix(root.dir()) else {
        return out;
    };
    if rel.as_os_str().is_empty() {
        // `target` is the root: the walker reads its .gitignore.
        return out;
    }
    let mut dir = root.dir().to_path_buf();
    let mut parts = rel.components().peekable();
    loop {
        if let Some(gitignore) = cache.gitignore(dir.join(".gitignore")) {
            out.push(gitignore);
        }
        match parts.next() {
            // Stop before `target` itself: its own .gitignore is the walker's.
            Some(part) if parts.peek().is_some() => dir.push(part),
            _ => break,
        }
    }
    out
}

/// The most an ignore file may hold to be read (a real one is a few kilobytes).
const MAX_IGNORE_FILE_BYTES: u64 = 1 << 20;

/// Whether `dir`'s ignore files (`.gitignore`, `.ignore`), those it has, are regular
/// files of at most [`MAX_IGNORE_FILE_BYTES`]: not links, FIFOs or devices, which the
/// walker would read by name whatever they are. The error is the file's name and what
/// it is instead.
fn ignore_files_ok(dir: &Path) -> Result<(), (&'static str, String)> {
    for name in [".gitignore", ".ignore"] {
        let Ok(meta) = std::fs::symlink_metadata(dir.join(name)) else {
            continue;
        };
        let kind = meta.file_type();
        let what = if kind.is_symlink() {
            "a symbolic link".to_owned()
        } else if !kind.is_file() {
            "not a regular file".to_owned()
        } else if meta.len() > MAX_IGNORE_FILE_BYTES {
            format!("{} bytes", thousands(meta.len()))
        } else {
            continue;
        };
        return Err((name, what));
    }
    Ok(())
}

/// `dir/name is what` with `dir` shown from the root (nothing for the root).
fn ignore_file_note(root: &Root, dir: &Path, (name, what): &(&str, String)) -> String {
    let shown = root.relative_display(dir);
    if shown.is_empty() {
        format!("`{name}` is {what}")
    } else {
        format!("`{shown}/{name}` is {what}")
    }
}

/// Whether the walk goes into / searches `entry`: not `target/` directories, not
/// top-level offload directories (shadowed), not what the .gitignore files above the
/// search path exclude. The search path itself (depth 0) is always kept.
fn keep_entry(entry: &DirEntry, above: &[Arc<Gitignore>], skip_offload_dirs: bool) -> bool {
    if entry.depth() == 0 {
        return true;
    }
    let is_dir = entry.file_type().is_some_and(|t| t.is_dir());
    let name = entry.file_name();
    if is_dir && name == "target" {
        return false;
    }
    if skip_offload_dirs
        && is_dir
        && entry.depth() == 1
        && name.to_str().is_some_and(|n| OFFLOAD_DIRS.contains(&n))
    {
        return false;
    }
    // The deepest .gitignore with an opinion decides.
    for gitignore in above.iter().rev() {
        match gitignore.matched(entry.path(), is_dir) {
            Match::Ignore(_) => return false,
            Match::Whitelist(_) => return true,
            Match::None => {}
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_pattern_that_compiles_large_is_used_but_not_kept() {
        // Sixty-four of these kept (each compiled twice) held 2.2 GB.
        let cache = GrepCache::default();
        cache.regex(r"\w{300}|x1").unwrap();
        assert!(cache.patterns.lock().unwrap().is_empty());
        cache.regex("fn main").unwrap();
        assert_eq!(cache.patterns.lock().unwrap().len(), 1);
    }

    /// (line number, text) of the lines `pattern` matches in `text`, found line by
    /// line, and found in one pass when [`scan_buffer`] takes the text (`None` if not).
    #[allow(clippy::type_complexity)]
    fn both(pattern: &str, text: &[u8]) -> (Vec<(u64, String)>, Option<Vec<(u64, String)>>) {
        let cache = GrepCache::default();
        let regex = cache.regex(pattern).unwrap();
        let run = |one_pass: bool| {
            let mut found = Vec::new();
            let mut sink = Sink {
                regex: &regex,
                path: "f",
                found: &mut found,
                max_results: usize::MAX,
                line_chars: usize::MAX,
            };
            let done = if one_pass {
                scan_buffer(text, &mut sink).is_some()
            } else {
                let reader = LineReader::new(BufReader::with_capacity(7, text));
                scan_lines(reader, &mut sink, &mut Vec::new());
                true
            };
            done.then(|| found.into_iter().map(|f| (f.line, f.text)).collect())
        };
        (run(false).unwrap(), run(true))
    }

    const PATTERNS: &[&str] = &[
        "a",
        "^a",
        "a$",
        "^$",
        "",
        "^",
        "$",
        r"\bab\b",
        r"\Bb",
        "a.b",
        "[^a]",
        r"\s",
        r"b\s*$",
        "^a|b$",
        "x*",
        r"a\s+b",
        ".",
        "^.{3}$",
        "é",
        r"\w+$",
        "(?m)^b",
        r"\Aa",
        r"a\z",
        r"(?s)a.b",
        "(?-m)^a",
        "a[^x]*x",
        r"\n",
        r"b\n^a",
        r"\bb",
        r"a$\n",
        r"(a|\n)+b",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The one-pass search finds exactly the lines the line-by-line one does.
        #[test]
        fn one_pass_finds_the_lines_the_line_search_finds(
            text in proptest::collection::vec(
                prop::sample::select(&b"ab \n\n\tx"[..]), 0..40),
            unicode in any::<bool>(),
            p in 0..PATTERNS.len(),
        ) {
            let mut text = text;
            if unicode {
                text.extend_from_slice("é\nb".as_bytes());
            }
            let pattern = PATTERNS[p];
            let (lines, one_pass) = both(pattern, &text);
            let plain = !["(?", r"\A", r"\z"].iter().any(|s| pattern.contains(s));
            prop_assert_eq!(one_pass.is_some(), plain);
            if let Some(one_pass) = one_pass {
                prop_assert_eq!(one_pass, lines);
            }
        }
    }

    #[test]
    fn the_one_pass_search_takes_plain_text_and_leaves_the_rest() {
        let (lines, one_pass) = both("^b", b"a\nb\nab\nb");
        assert_eq!(lines, [(2, "b".to_owned()), (4, "b".to_owned())]);
        assert_eq!(one_pass.as_deref(), Some(&lines[..]));
        // An empty line after the last `\n` is no line; an empty one before it is.
        let (lines, one_pass) = both("^$", b"a\n\nb\n");
        assert_eq!(lines, [(2, String::new())]);
        assert_eq!(one_pass.as_deref(), Some(&lines[..]));
        // `\r`, NUL, a line too long to match whole, or a pattern with inline flags or
        // whole-text anchors: line by line only.
        assert_eq!(both("a", b"a\r\nb").1, None);
        assert_eq!(both("a", b"a\nb\0").1, None);
        let long = [vec![b'a'; GREP_LINE_BYTES + 1], b"\nb".to_vec()].concat();
        assert_eq!(both("b", &long).1, None);
        let fine = [vec![b'a'; GREP_LINE_BYTES], b"\nb".to_vec()].concat();
        assert_eq!(
            both("b$", &fine),
            (vec![(2, "b".to_owned())], Some(vec![(2, "b".to_owned())]))
        );
        for pattern in ["(?i)A", r"\Aa", r"a\z"] {
            assert_eq!(both(pattern, b"a").1, None, "{pattern}");
        }
    }
}
