use std::fmt;
use std::io;

/// Why an offload operation failed.
///
/// Every failure is reported, never swallowed: a policy that cannot store what it
/// meant to offload leaves the message in context and returns this error beside it
/// (see [`PolicyOutcome::failures`](crate::PolicyOutcome::failures)).
///
/// ```
/// use keel_offload::{KeyProblem, OffloadError, StorePath};
///
/// let err = StorePath::new("../../etc/passwd").unwrap_err();
/// assert!(matches!(err, OffloadError::InvalidKey { problem: KeyProblem::ParentDir, .. }));
/// assert_eq!(
///     err.to_string(),
///     r#"invalid path "../../etc/passwd": a `..` component is not allowed"#
/// );
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// A thread id or a path was refused before touching any storage.
    #[error("invalid {kind} {key}: {problem}")]
    InvalidKey {
        /// Whether the thread id or the path was refused.
        kind: KeyKind,
        /// The refused text, quoted, escaped and shortened for display.
        key: Shown,
        /// What is wrong with it.
        problem: KeyProblem,
    },
    /// Nothing is stored under this path.
    #[error("{key}: no such file")]
    NotFound {
        /// `thread/path` of the missing entry.
        key: String,
    },
    /// A symbolic link was found where the store would have had to follow it.
    /// [`FsStore`](crate::FsStore) never follows links, inside the root or out of it.
    #[error("{key}: refusing to follow the symbolic link at `{at}`")]
    Symlink {
        /// `thread/path` being accessed.
        key: String,
        /// The part of the path that is a link, relative to the store root.
        at: String,
    },
    /// The operating system refused or failed an operation.
    #[error("{key}: could not {op}: {source}")]
    Io {
        /// What the store was doing (`write`, `rename`, `create directory`, ...).
        op: &'static str,
        /// `thread/path` being accessed (or the store root).
        key: String,
        /// The underlying error; see [`OffloadError::is_storage_full`] and
        /// [`OffloadError::is_permission_denied`].
        #[source]
        source: io::Error,
    },
    /// A policy found its name for a value and every numbered variant of it taken
    /// (a tool-call id used over and over): it stores nothing rather than overwrite.
    #[error(
        "{key}: this name and {tried} numbered variants of it already hold other values; nothing was overwritten"
    )]
    Occupied {
        /// `thread/path` of the first name tried.
        key: String,
        /// How many variants were tried.
        tried: u32,
    },
    /// A search pattern is not a valid regular expression (or is too large).
    #[error("invalid pattern {pattern}: {reason}")]
    Pattern {
        /// The pattern, quoted and shortened for display.
        pattern: Shown,
        /// The regex parser's explanation.
        reason: String,
    },
    /// The stored bytes are not UTF-8 text.
    #[error("{key}: stored content is not valid UTF-8")]
    NotUtf8 {
        /// `thread/path` being read.
        key: String,
    },
    /// A database backend ([`SqliteStore`](crate::SqliteStore),
    /// [`PostgresStore`](crate::PostgresStore)) failed: the connection, a statement, a
    /// transaction. The source is the driver's error (`rusqlite::Error`,
    /// `tokio_postgres::Error`, `deadpool_postgres::PoolError`) or an `io::Error` for
    /// the store's own failures (its connection thread gone, a value that changed
    /// while it was streamed).
    #[error("{key}: the database could not {op}: {}", Chain(source.as_ref()))]
    Database {
        /// What the store was doing (`write`, `read`, `migrate the schema`, ...).
        op: &'static str,
        /// `thread/path` being accessed (or the database).
        key: String,
        /// The driver's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The database holds an offload schema newer than this build knows: a newer keel
    /// wrote it. Nothing was changed; upgrade this program (or point it at another
    /// schema or file).
    #[error(
        "{store}: the offload schema is version {found}, newer than version {supported} this build knows: a newer keel upgraded it, and this one leaves it alone; run a keel that knows version {found}"
    )]
    SchemaTooNew {
        /// The database file or schema.
        store: String,
        /// The version found.
        found: i64,
        /// The newest version this build knows.
        supported: i64,
    },
    /// A [`LineageStore`](crate::LineageStore) refused a call, or found the store
    /// disagreeing with the lineage it reads: a key of another thread, a reserved
    /// path, a file written both with `put` and `append`, a stored file shorter than
    /// the lineage has seen, a lineage that does not parse.
    #[error("{key}: {reason}")]
    Lineage {
        /// `thread/path` being accessed (or the thread).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// An archive record could not be read back.
    #[error("{key}: archive record {seq} is damaged: {reason}")]
    Corrupt {
        /// `thread/path` of the archive.
        key: String,
        /// The record's position in the archive.
        seq: u64,
        /// What failed.
        reason: String,
    },
}

impl OffloadError {
    /// True when the device is full (`ENOSPC`, or a quota: `EDQUOT`), or a
    /// [`MemoryStore`](crate::MemoryStore) reached its byte limit.
    ///
    /// ```
    /// use keel_offload::{Key, MemoryStore, OffloadStore};
    ///
    /// let store = MemoryStore::with_limit(4);
    /// let err = store.put(&Key::new("t1", "a.txt")?, "too long").unwrap_err();
    /// assert!(err.is_storage_full());
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn is_storage_full(&self) -> bool {
        match self {
            OffloadError::Io { source, .. } => {
                source.kind() == io::ErrorKind::StorageFull
                    || source.kind() == io::ErrorKind::QuotaExceeded
                    || is_errno(source, &[ENOSPC, EDQUOT])
            }
            OffloadError::Database { source, .. } => database_full(source.as_ref()),
            _ => false,
        }
    }

    /// True when the operating system denied access (`EACCES`, `EPERM`) or the file
    /// system is read-only (`EROFS`).
    pub fn is_permission_denied(&self) -> bool {
        match self {
            OffloadError::Io { source, .. } => {
                source.kind() == io::ErrorKind::PermissionDenied
                    || source.kind() == io::ErrorKind::ReadOnlyFilesystem
                    || is_errno(source, &[EACCES, EPERM, EROFS])
            }
            _ => false,
        }
    }

    /// True for [`OffloadError::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, OffloadError::NotFound { .. })
    }

    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub(crate) fn database(
        op: &'static str,
        key: impl fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        OffloadError::Database {
            op,
            key: key.to_string(),
            source: Box::new(source),
        }
    }

    /// The same error with `thread/` taken off the front of its key: what a tool
    /// tells the model, which names paths within its own thread.
    pub(crate) fn within(mut self, thread: &str) -> Self {
        let key = match &mut self {
            OffloadError::NotFound { key }
            | OffloadError::Symlink { key, .. }
            | OffloadError::Io { key, .. }
            | OffloadError::Occupied { key, .. }
            | OffloadError::NotUtf8 { key }
            | OffloadError::Database { key, .. }
            | OffloadError::Lineage { key, .. }
            | OffloadError::Corrupt { key, .. } => key,
            _ => return self,
        };
        if let Some(rest) = key.strip_prefix(thread).and_then(|r| r.strip_prefix('/')) {
            *key = rest.to_owned();
        }
        self
    }

    pub(crate) fn io(op: &'static str, key: impl fmt::Display, source: io::Error) -> Self {
        OffloadError::Io {
            op,
            key: key.to_string(),
            source,
        }
    }
}

// The raw codes back up the `io::ErrorKind` checks (std already maps these codes to
// those kinds). libc comes with the `fs` feature; without it only the kinds are checked.
#[cfg(all(unix, feature = "fs"))]
const ENOSPC: i32 = libc::ENOSPC;
#[cfg(all(unix, feature = "fs"))]
const EDQUOT: i32 = libc::EDQUOT;
#[cfg(all(unix, feature = "fs"))]
const EACCES: i32 = libc::EACCES;
#[cfg(all(unix, feature = "fs"))]
const EPERM: i32 = libc::EPERM;
#[cfg(all(unix, feature = "fs"))]
const EROFS: i32 = libc::EROFS;
#[cfg(not(all(unix, feature = "fs")))]
const ENOSPC: i32 = -1;
#[cfg(not(all(unix, feature = "fs")))]
const EDQUOT: i32 = -1;
#[cfg(not(all(unix, feature = "fs")))]
const EACCES: i32 = -1;
#[cfg(not(all(unix, feature = "fs")))]
const EPERM: i32 = -1;
#[cfg(not(all(unix, feature = "fs")))]
const EROFS: i32 = -1;

/// A database's own "disk full" (SQLite `SQLITE_FULL`, PostgreSQL `53100`), or an I/O
/// error that says so.
#[allow(unused_variables)]
fn database_full(e: &(dyn std::error::Error + 'static)) -> bool {
    #[cfg(feature = "sqlite")]
    if let Some(rusqlite::Error::SqliteFailure(f, _)) = e.downcast_ref::<rusqlite::Error>()
        && f.code == rusqlite::ErrorCode::DiskFull
    {
        return true;
    }
    #[cfg(feature = "postgres")]
    {
        let pg =
            e.downcast_ref::<tokio_postgres::Error>().or_else(|| match e
                .downcast_ref::<deadpool_postgres::PoolError>()
            {
                Some(deadpool_postgres::PoolError::Backend(b)) => Some(b),
                _ => None,
            });
        if pg.and_then(|e| e.code()) == Some(&tokio_postgres::error::SqlState::DISK_FULL) {
            return true;
        }
    }
    e.downcast_ref::<io::Error>()
        .is_some_and(|e| e.kind() == io::ErrorKind::StorageFull)
}

/// An error and its causes on one line, `error: cause: cause`, leaving out a cause
/// whose text the error already says (a pool error that wraps a connection error,
/// which wraps `Connection refused`, would otherwise show only the first).
struct Chain<'e>(&'e (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !said.contains(&text) {
                write!(f, ": {text}")?;
                said = text;
            }
            next = cause.source();
        }
        Ok(())
    }
}

fn is_errno(e: &io::Error, codes: &[i32]) -> bool {
    e.raw_os_error().is_some_and(|c| codes.contains(&c))
}

/// Which kind of key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// A [`ThreadId`](crate::ThreadId).
    Thread,
    /// A [`StorePath`](crate::StorePath).
    Path,
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyKind::Thread => "thread id",
            KeyKind::Path => "path",
        })
    }
}

/// What is wrong with a refused thread id or path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyProblem {
    /// Nothing was given.
    #[error("it is empty")]
    Empty,
    /// Only whitespace was given.
    #[error("it is only whitespace")]
    Blank,
    /// Longer than allowed in total.
    #[error("it is {len} bytes long (at most {max} allowed)")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// One `/`-separated component is longer than a file name may be.
    #[error("a component is {len} bytes long (at most {max} allowed)")]
    ComponentTooLong {
        /// The component's length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Starts with `/`: paths are relative to the thread's directory.
    #[error(
        "absolute paths are not allowed (paths are relative, e.g. `large_tool_results/call_1`)"
    )]
    Absolute,
    /// Contains a `..` component.
    #[error("a `..` component is not allowed")]
    ParentDir,
    /// Contains a `.` component, an empty component (`a//b`) or a trailing `/`.
    #[error("empty and `.` components are not allowed")]
    EmptyComponent,
    /// Contains a NUL byte.
    #[error("it contains a NUL byte")]
    Nul,
    /// Contains a control character (newline, tab, escape, ...).
    #[error("it contains the control or text-direction character U+{0:04X}")]
    ControlChar(u32),
    /// Contains a backslash (refused so that paths mean the same on every platform).
    #[error("it contains a backslash")]
    Backslash,
    /// A thread id contains `/`: it must be one path component.
    #[error("a thread id cannot contain `/`")]
    Separator,
    /// A thread id starts with `.` (reserved for the store's own files).
    #[error("a thread id cannot start with `.`")]
    LeadingDot,
}

/// A user-supplied string shown in an error: quoted, escaped, and cut to 80 characters
/// so that a 4 KB name or a NUL byte cannot garble a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown(String);

impl Shown {
    /// Quotes and shortens `text`.
    pub fn new(text: &str) -> Self {
        const MAX: usize = 80;
        let cut: String = text.chars().take(MAX).collect();
        let total = text.chars().count();
        if total > MAX {
            Shown(format!("{cut:?}… ({total} characters)"))
        } else {
            Shown(format!("{cut:?}"))
        }
    }

    /// The display form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
