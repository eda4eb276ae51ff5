//! The SQLite saver's own errors.

use std::path::PathBuf;

use keel_checkpoint::CheckpointError;

/// Why opening or using a [`SqliteSaver`](crate::SqliteSaver) failed at the storage
/// level.
///
/// [`Checkpointer`](keel_checkpoint::Checkpointer) methods report these inside
/// [`CheckpointError::Backend`]; [`SqliteError::of`] finds them there again. Contract
/// failures (fencing conflicts, invalid requests, missing checkpoints, corrupt data) are
/// the [`CheckpointError`] variants of the same name, never a `SqliteError`.
///
/// ```
/// use keel_checkpoint_sqlite::{SqliteError, SqliteSaver, rusqlite};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // A directory that does not exist: SQLite cannot create the file.
/// let dir = tempfile::tempdir().unwrap();
/// let err = SqliteSaver::open(dir.path().join("missing/dir/keel.db")).await.unwrap_err();
/// assert!(matches!(err, SqliteError::Sqlite(_)));
/// assert_eq!(err.code(), Some(rusqlite::ErrorCode::CannotOpen));
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// SQLite reported an error: I/O failure, disk full, a busy database after the busy
    /// timeout, a file that is not a database, and so on ([`SqliteError::code`] tells
    /// which).
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The file's schema was written by a newer version of this crate.
    #[error(
        "{path}: checkpoint schema version {found} is newer than this build supports ({supported})"
    )]
    NewerSchema {
        /// The database file.
        path: PathBuf,
        /// The schema version in the file.
        found: i64,
        /// The newest schema version this build knows.
        supported: i64,
    },
    /// The file is an SQLite database that belongs to something else (it has tables,
    /// but not keel's).
    #[error("{path}: not a keel checkpoint database ({reason})")]
    ForeignDatabase {
        /// The database file.
        path: PathBuf,
        /// What gave it away.
        reason: String,
    },
    /// The file could not be switched to write-ahead-log mode (e.g. it is on a file
    /// system without shared memory support).
    #[error("{path}: could not switch to WAL mode (journal_mode is {mode})")]
    NoWal {
        /// The database file.
        path: PathBuf,
        /// The journal mode SQLite kept.
        mode: String,
    },
    /// A database thread could not be started.
    #[error("could not start a database thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The request did not finish: the database thread is gone, or the request
    /// panicked (a bug; its transaction was rolled back).
    #[error("the database thread stopped")]
    WorkerStopped,
}

impl SqliteError {
    /// SQLite's primary error code, when SQLite reported the error (e.g.
    /// [`DiskFull`](rusqlite::ErrorCode::DiskFull),
    /// [`DatabaseBusy`](rusqlite::ErrorCode::DatabaseBusy),
    /// [`SystemIoFailure`](rusqlite::ErrorCode::SystemIoFailure)).
    pub fn code(&self) -> Option<rusqlite::ErrorCode> {
        match self {
            Self::Sqlite(e) => e.sqlite_error_code(),
            _ => None,
        }
    }

    /// Whether the database stayed locked by another connection for longer than the
    /// busy timeout.
    pub fn is_busy(&self) -> bool {
        matches!(
            self.code(),
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    }

    /// The `SqliteError` inside a [`CheckpointError::Backend`], if that is what it holds.
    ///
    /// ```
    /// use keel_checkpoint::CheckpointError;
    /// use keel_checkpoint_sqlite::SqliteError;
    ///
    /// let err = CheckpointError::from(SqliteError::WorkerStopped);
    /// assert!(matches!(SqliteError::of(&err), Some(SqliteError::WorkerStopped)));
    /// ```
    pub fn of(error: &CheckpointError) -> Option<&SqliteError> {
        match error {
            CheckpointError::Backend(inner) => inner.downcast_ref::<SqliteError>(),
            _ => None,
        }
    }
}

impl From<SqliteError> for CheckpointError {
    fn from(error: SqliteError) -> Self {
        CheckpointError::backend(error)
    }
}

/// An operation's failure: a contract error, or a storage error.
#[derive(Debug)]
pub(crate) enum OpError {
    Checkpoint(CheckpointError),
    Storage(SqliteError),
}

pub(crate) type OpResult<T> = Result<T, OpError>;

impl From<CheckpointError> for OpError {
    fn from(error: CheckpointError) -> Self {
        Self::Checkpoint(error)
    }
}

impl From<SqliteError> for OpError {
    fn from(error: SqliteError) -> Self {
        Self::Storage(error)
    }
}

impl From<rusqlite::Error> for OpError {
    fn from(error: rusqlite::Error) -> Self {
        Self::Storage(SqliteError::Sqlite(error))
    }
}

impl From<OpError> for CheckpointError {
    fn from(error: OpError) -> Self {
        match error {
            OpError::Checkpoint(e) => e,
            OpError::Storage(e) => e.into(),
        }
    }
}

/// A `Corrupt` error about stored data.
pub(crate) fn corrupt(what: impl Into<String>) -> OpError {
    OpError::Checkpoint(CheckpointError::Corrupt { what: what.into() })
}

/// An `Invalid` error about a request.
pub(crate) fn invalid(reason: impl Into<String>) -> OpError {
    OpError::Checkpoint(CheckpointError::Invalid {
        reason: reason.into(),
    })
}
