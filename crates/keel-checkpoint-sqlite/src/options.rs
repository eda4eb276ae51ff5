//! How a saver opens its database.

use std::path::Path;
use std::time::Duration;

use crate::error::SqliteError;
use crate::saver::SqliteSaver;

/// When a committed checkpoint reaches the disk: SQLite's `synchronous` setting, in WAL
/// mode.
///
/// Both settings keep the file consistent and both survive the process being killed:
/// a commit is in the operating system's hands when `put` returns. They differ on
/// power loss or an operating-system crash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=NORMAL` (the default): commits are not flushed to the disk one by
    /// one; the write-ahead log is flushed when it is checkpointed into the database.
    /// On power loss the newest steps may be lost (the thread resumes from an earlier
    /// checkpoint and reruns them); the file is never corrupted and fencing still
    /// holds. Typically an order of magnitude faster per step than
    /// [`Full`](Self::Full), whose every commit waits for an `fsync`.
    #[default]
    Normal,
    /// `synchronous=FULL`: every commit is flushed to the disk (an `fsync`) before
    /// `put` returns, so a stored checkpoint survives power loss too.
    Full,
}

impl Synchronous {
    /// The pragma value (`"NORMAL"` or `"FULL"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "NORMAL",
            Self::Full => "FULL",
        }
    }
}

/// Settings for [`SqliteSaver::open_with`].
///
/// ```
/// use std::time::Duration;
/// use keel_checkpoint_sqlite::{SqliteOptions, Synchronous};
///
/// let options = SqliteOptions::default()
///     .synchronous(Synchronous::Full)
///     .busy_timeout(Duration::from_secs(30))
///     .readers(4);
/// assert_eq!(options.synchronous, Synchronous::Full);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// When commits reach the disk (default [`Synchronous::Normal`]).
    pub synchronous: Synchronous,
    /// How long a write waits for another connection (another process on the same
    /// file) to release the write lock before failing with a busy error
    /// (default 5 s).
    pub busy_timeout: Duration,
    /// Reader connections for `get` and `list` beside the one writer (default 2;
    /// `0` runs everything on the writer). WAL mode lets readers run while the writer
    /// commits. Ignored in memory, where there is one connection.
    pub readers: usize,
    /// The most bytes the database may grow to; a write that would go past it fails
    /// with SQLite's "database or disk is full" and writes nothing (default: no limit
    /// beyond the disk's).
    pub max_size: Option<u64>,
    /// Write-ahead log pages (4 KiB each in a file keel made) after which the log is
    /// copied into the database file (a checkpoint; default 1,000, SQLite's own
    /// default). The copy runs on a thread and connection of its own, so no put waits
    /// for it; should commits keep it from ever catching up, the writer does it itself
    /// at four times this many pages, so the log stays bounded. `0` turns automatic
    /// checkpoints off: the log then grows until [`SqliteSaver::wal_checkpoint`] or the
    /// last connection closing copies it. Ignored in memory. A copy cannot pass a
    /// page a reader still reads, so under reads that never pause (a busy service's
    /// `get` and `list`) the log can outgrow this bound for a while, and its file
    /// keeps the size it reached (SQLite reuses it from the start): call
    /// [`SqliteSaver::wal_checkpoint`] at a quiet moment to copy it all and truncate it.
    pub checkpoint_pages: u32,
    /// Run a write its caller awaits on the caller's thread, inside
    /// [`tokio::task::block_in_place`], when the caller is a worker of tokio's
    /// multi-thread runtime, nothing is queued for the writer and its connection is
    /// free (default `false`). It saves the two thread hand-offs of a write, to the
    /// writer thread and back: about 70 µs of a 150 µs put on the benchmark machine,
    /// and an agent step with `Durability::Sync` went from 688 to 609 µs. `put_many`
    /// (the batches of a background writer) still runs on the writer thread, beside
    /// the caller's next work. Off tokio's multi-thread runtime (its current-thread
    /// one, another executor) writes go to the writer thread as always.
    ///
    /// Off by default because `block_in_place` panics inside a tokio `LocalSet`, which
    /// the saver cannot detect: turn it on when no `LocalSet` awaits the saver (as in
    /// an ordinary `#[tokio::main]` program). Ignored in memory.
    pub block_in_place: bool,
    /// Delta links the saver remembers (default 65,536, a few hundred bytes each), so
    /// that a prune walks the chains of the checkpoints it keeps without reading them
    /// back. An agent thread that prunes after each compaction keeps up to a couple of
    /// hundred (33 to 97 right after each prune in keel-agent's long-run test); past
    /// the room, the threads put to least recently are forgotten first, and their
    /// next prune reads what it needs from the file. A service running a thousand
    /// agent threads at once wants about 200,000.
    pub delta_links: usize,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            synchronous: Synchronous::default(),
            busy_timeout: Duration::from_secs(5),
            readers: 2,
            max_size: None,
            checkpoint_pages: 1_000,
            block_in_place: false,
            delta_links: 65_536,
        }
    }
}

impl SqliteOptions {
    /// Sets when commits reach the disk.
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Sets how long a write waits for another connection's write lock.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets the number of reader connections.
    pub fn readers(mut self, readers: usize) -> Self {
        self.readers = readers;
        self
    }

    /// Caps the database size in bytes.
    pub fn max_size(mut self, bytes: u64) -> Self {
        self.max_size = Some(bytes);
        self
    }

    /// Sets the write-ahead log pages after which a checkpoint runs in the background
    /// (`0`: never on its own).
    pub fn checkpoint_pages(mut self, pages: u32) -> Self {
        self.checkpoint_pages = pages;
        self
    }

    /// Sets whether awaited writes may run on the caller's thread (see
    /// [`block_in_place`](Self::block_in_place); not inside a tokio `LocalSet`).
    pub fn block_in_place(mut self, on: bool) -> Self {
        self.block_in_place = on;
        self
    }

    /// Sets how many delta links the saver remembers ([`SqliteOptions::delta_links`]).
    pub fn delta_links(mut self, links: usize) -> Self {
        self.delta_links = links;
        self
    }

    /// Opens (or creates) the database file at `path` with these settings; the same as
    /// [`SqliteSaver::open_with`].
    pub async fn open(self, path: impl AsRef<Path>) -> Result<SqliteSaver, SqliteError> {
        SqliteSaver::open_with(path, self).await
    }
}
