//! The SQLite checkpointer.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use keel_checkpoint::{
    CheckpointError, CheckpointId, CheckpointSummary, CheckpointTuple, Checkpointer, ListOptions,
    PendingWrite, PutRequest, ThreadInfo, ThreadKey, support,
};

use crate::error::SqliteError;
use crate::options::SqliteOptions;
use crate::schema;
use crate::store::{self, ListQuery};
use crate::wal::{self, Checkpoints, Trigger};
use crate::worker::{AfterJob, Lane};

/// How many checkpoints one `list` query reads at most.
const LIST_PAGE: usize = 128;

/// A [`Checkpointer`] that stores checkpoints in one SQLite file (or in memory).
///
/// Cloning is cheap; clones share the connections. Dropping the last clone closes the
/// connections, after waiting for statements already queued to finish (a put that was
/// sent commits, or not, as a whole). See the [crate docs](crate) for the layout,
/// fencing and durability.
///
/// ```
/// use keel_checkpoint::{Checkpointer, ThreadKey};
/// use keel_checkpoint_sqlite::SqliteSaver;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = tempfile::tempdir()?;
/// let saver = SqliteSaver::open(dir.path().join("keel.db")).await?;
/// assert!(saver.get(&ThreadKey::new("new thread"), None).await?.is_none());
/// assert_eq!(saver.path(), Some(dir.path().join("keel.db").as_path()));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SqliteSaver {
    inner: Arc<Inner>,
}

/// Namespaces whose head versions a saver remembers ([`support::HeadVersions`]).
const HEAD_VERSIONS: usize = 4096;

struct Inner {
    path: Option<PathBuf>,
    /// Reader connections; `None` when the writer does everything (memory, `readers(0)`).
    /// Declared first so readers close before the writer, which then cleans up the WAL.
    readers: Option<Lane>,
    /// Copies the write-ahead log into the file in the background (`None` in memory,
    /// or with `checkpoint_pages(0)`). Stops before the writer closes, so the writer is
    /// the last connection and removes the log. Held only to be dropped there.
    _checkpoints: Option<Checkpoints>,
    /// The writer's side of the background checkpoints (`None` in memory).
    trigger: Option<Trigger>,
    writer: Lane,
    /// The versions of the newest checkpoint this saver put in each namespace, so a
    /// put that carries them over need not read their deltas back, and the links of
    /// the deltas it put, so a prune need not either.
    memo: Arc<Mutex<store::Memo>>,
}

impl std::fmt::Debug for SqliteSaver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteSaver")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// What a [`SqliteSaver`]'s database holds, counted ([`SqliteSaver::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteStats {
    /// Threads with at least one checkpoint.
    pub threads: u64,
    /// Checkpoints.
    pub checkpoints: u64,
    /// Stored channel deltas.
    pub deltas: u64,
    /// Deltas that carry a snapshot.
    pub snapshots: u64,
    /// Pending writes.
    pub pending_writes: u64,
    /// JSON bytes of every delta's updates and snapshot.
    pub delta_bytes: u64,
    /// Size of the database (pages × page size), not counting the write-ahead log.
    pub database_bytes: u64,
    /// Of which free pages, reused before the file grows.
    pub free_bytes: u64,
}

impl SqliteSaver {
    /// Opens (or creates) the checkpoint database at `path` with default
    /// [`SqliteOptions`]: WAL mode, `synchronous=NORMAL`, a 5 s busy timeout, two reader
    /// connections.
    ///
    /// Creates the schema in a new file and migrates an older one; refuses a file from
    /// a newer version ([`SqliteError::NewerSchema`]) or another application
    /// ([`SqliteError::ForeignDatabase`]).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        Self::open_with(path, SqliteOptions::default()).await
    }

    /// Opens (or creates) the checkpoint database at `path` with `options`.
    pub async fn open_with(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<Self, SqliteError> {
        let path = path.as_ref().to_owned();
        let links = options.delta_links;
        let trigger = Trigger::new(options.checkpoint_pages);
        let in_place = options.block_in_place;
        let writer = {
            let (path, options) = (path.clone(), options.clone());
            let after: AfterJob = {
                let trigger = trigger.clone();
                Arc::new(move |conn| trigger.after_job(conn))
            };
            let open = move || {
                let conn = schema::open_writer(&path, &options)?;
                wal::watch_log(&conn);
                Ok(conn)
            };
            Lane::start_with("keel-sqlite-writer", 1, open, Some(after), in_place).await?
        };
        let checkpoints = match options.checkpoint_pages {
            0 => None,
            _ => {
                let (path, options) = (path.clone(), options.clone());
                Some(
                    Checkpoints::start(&trigger, move || {
                        schema::open_checkpointer(&path, &options)
                    })
                    .await?,
                )
            }
        };
        let readers = match options.readers {
            0 => None,
            n => {
                let (path, options) = (path.clone(), options.clone());
                Some(
                    Lane::start("keel-sqlite-reader", n, move || {
                        schema::open_reader(&path, &options)
                    })
                    .await?,
                )
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                path: Some(path),
                readers,
                _checkpoints: checkpoints,
                trigger: Some(trigger),
                writer,
                memo: Arc::new(Mutex::new(store::Memo::new(HEAD_VERSIONS, links))),
            }),
        })
    }

    /// A private in-memory database (gone when the last clone is dropped), with default
    /// options.
    pub async fn open_in_memory() -> Result<Self, SqliteError> {
        Self::open_in_memory_with(SqliteOptions::default()).await
    }

    /// A private in-memory database with `options` (`readers` is ignored: one
    /// connection does everything).
    pub async fn open_in_memory_with(options: SqliteOptions) -> Result<Self, SqliteError> {
        let links = options.delta_links;
        let writer = Lane::start("keel-sqlite-memory", 1, move || {
            schema::open_memory(&options)
        })
        .await?;
        Ok(Self {
            inner: Arc::new(Inner {
                path: None,
                readers: None,
                _checkpoints: None,
                trigger: None,
                writer,
                memo: Arc::new(Mutex::new(store::Memo::new(HEAD_VERSIONS, links))),
            }),
        })
    }

    /// The database file (`None` in memory).
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }

    /// Counts what the database holds.
    pub async fn stats(&self) -> Result<SqliteStats, CheckpointError> {
        self.read(|conn| store::stats(conn)).await
    }

    /// Copies the write-ahead log into the database file and truncates it
    /// (`PRAGMA wal_checkpoint(TRUNCATE)`), so the file alone holds everything. The
    /// saver also copies the log on its own as it grows (in the background, see
    /// [`SqliteOptions::checkpoint_pages`]), and SQLite does when the last connection
    /// closes.
    /// Returns `false` if a reader (possibly another process) kept it from finishing.
    pub async fn wal_checkpoint(&self) -> Result<bool, CheckpointError> {
        let trigger = self.inner.trigger.clone();
        self.write(move |conn| {
            // A background pass holding the checkpoint lock would make this one busy.
            if let Some(trigger) = &trigger {
                trigger.wait_idle();
            }
            store::wal_checkpoint(conn).map(|busy| !busy)
        })
        .await
    }

    async fn read<T, F>(&self, f: F) -> Result<T, CheckpointError>
    where
        T: Send + 'static,
        F: FnOnce(&mut rusqlite::Connection) -> crate::error::OpResult<T> + Send + 'static,
    {
        let lane = self.inner.readers.as_ref().unwrap_or(&self.inner.writer);
        lane.run(move |conn| f(conn).map_err(CheckpointError::from))
            .await
    }

    /// A write its caller waits on: on the caller's thread when that saves the two
    /// hand-offs to the writer thread and back and the options allow it
    /// ([`Lane::run_on_caller`]).
    async fn write<T, F>(&self, f: F) -> Result<T, CheckpointError>
    where
        T: Send + 'static,
        F: FnOnce(&mut rusqlite::Connection) -> crate::error::OpResult<T> + Send + 'static,
    {
        self.inner
            .writer
            .run_on_caller(move |conn| f(conn).map_err(CheckpointError::from))
            .await
    }

    /// A write on the writer thread, always: for batches, which a background writer
    /// (`Durability::Async`) sends while its run goes on.
    async fn write_queued<T, F>(&self, f: F) -> Result<T, CheckpointError>
    where
        T: Send + 'static,
        F: FnOnce(&mut rusqlite::Connection) -> crate::error::OpResult<T> + Send + 'static,
    {
        self.inner
            .writer
            .run(move |conn| f(conn).map_err(CheckpointError::from))
            .await
    }
}

#[async_trait]
impl Checkpointer for SqliteSaver {
    /// A file is; an in-memory database is not.
    fn is_durable(&self) -> bool {
        self.inner.path.is_some()
    }

    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        let (thread, id) = (thread.clone(), id.cloned());
        self.read(move |conn| store::get(conn, &thread, id.as_ref()))
            .await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        if options.limit == Some(0) || !store::filter_can_match(&options.metadata) {
            return stream::empty().boxed();
        }
        let exact = store::filter_is_exact(&options.metadata);
        let cursor = Cursor {
            remaining: options.limit.unwrap_or(usize::MAX),
            query: ListQuery {
                thread: thread.clone(),
                below: options.before.clone(),
                options,
            },
            buffer: VecDeque::new(),
            done: false,
        };
        stream::unfold(cursor, move |mut cursor| async move {
            loop {
                if cursor.remaining == 0 {
                    return None;
                }
                if let Some(item) = cursor.buffer.pop_front() {
                    cursor.remaining -= 1;
                    return Some((Ok(item), cursor));
                }
                if cursor.done {
                    return None;
                }
                // With only exact filters a page need not read past the caller's limit.
                let page = if exact {
                    cursor.remaining.min(LIST_PAGE)
                } else {
                    LIST_PAGE
                };
                let query = cursor.query.clone();
                match self
                    .read(move |conn| store::list_page(conn, &query, page))
                    .await
                {
                    Ok(found) => {
                        cursor.done = found.done;
                        if found.last.is_some() {
                            cursor.query.below = found.last;
                        }
                        cursor.buffer.extend(found.items);
                    }
                    Err(err) => {
                        cursor.done = true;
                        cursor.buffer.clear();
                        return Some((Err(err), cursor));
                    }
                }
            }
        })
        .boxed()
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        support::validate_put(&request)?;
        let memo = Arc::clone(&self.inner.memo);
        self.write(move |conn| {
            let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
            store::put(conn, &request, &mut memo)
        })
        .await
    }

    /// The batch in one write transaction (one commit for all of it).
    async fn put_many(&self, mut requests: Vec<PutRequest>) -> Result<(), CheckpointError> {
        // The requests before an invalid one are stored, as one by one.
        let invalid = requests
            .iter()
            .enumerate()
            .find_map(|(i, r)| support::validate_put(r).err().map(|e| (i, e)));
        if let Some((i, _)) = &invalid {
            requests.truncate(*i);
        }
        if !requests.is_empty() {
            let memo = Arc::clone(&self.inner.memo);
            self.write_queued(move |conn| {
                let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
                store::put_many(conn, &requests, &mut memo)
            })
            .await?;
        }
        invalid.map_or(Ok(()), |(_, e)| Err(e))
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        let (thread, checkpoint) = (thread.clone(), checkpoint.clone());
        self.write(move |conn| store::put_writes(conn, &thread, &checkpoint, &writes))
            .await
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        let thread_id = thread_id.to_owned();
        let memo = Arc::clone(&self.inner.memo);
        self.write(move |conn| {
            store::delete_thread(conn, &thread_id)?;
            let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
            memo.links.forget_thread(&thread_id);
            Ok(())
        })
        .await
    }

    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        let thread = thread.clone();
        let memo = Arc::clone(&self.inner.memo);
        self.write(move |conn| {
            let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
            store::prune(conn, &thread, keep_last, &mut memo.links)
        })
        .await
    }

    /// One write transaction on the writer thread: a range scan of the heads index
    /// below the cutoff, then the deletes. `limit` bounds how long it holds the write
    /// lock.
    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let cutoff = support::idle_cutoff(idle_for);
        let memo = Arc::clone(&self.inner.memo);
        self.write(move |conn| {
            let swept = store::sweep_idle(conn, &cutoff, limit)?;
            let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
            for thread_id in &swept {
                memo.links.forget_thread(thread_id);
            }
            Ok(swept)
        })
        .await
    }

    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        let after = after.map(str::to_owned);
        self.read(move |conn| store::list_threads(conn, after.as_deref(), limit))
            .await
    }
}

/// Where a `list` stream stands.
struct Cursor {
    query: ListQuery,
    remaining: usize,
    buffer: VecDeque<CheckpointSummary>,
    done: bool,
}
