use std::fmt;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::db::{self, CHUNK, ChunkReader, FETCH};
use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::{Entry, OffloadStore};

/// The offload schema version this build writes (`keel_offload_schema.version`).
pub const SQLITE_SCHEMA_VERSION: i64 = SQLITE_MIGRATIONS.len() as i64;

/// Migration `i` brings the schema from version `i` to `i + 1`.
const SQLITE_MIGRATIONS: &[&str] = &[r#"
    -- One row per file: its current generation and size in bytes.
    CREATE TABLE keel_offload_files (
        thread_id TEXT    NOT NULL,
        path      TEXT    NOT NULL,
        generation       INTEGER NOT NULL,
        size      INTEGER NOT NULL,
        PRIMARY KEY (thread_id, path)
    ) WITHOUT ROWID;
    -- The bytes of each generation, in chunks of at most 1 MiB, keyed by offset.
    CREATE TABLE keel_offload_chunks (
        thread_id TEXT    NOT NULL,
        generation       INTEGER NOT NULL,
        off       INTEGER NOT NULL,
        data      BLOB    NOT NULL,
        PRIMARY KEY (thread_id, generation, off)
    );
"#];

/// Most idle reader connections kept open.
const MAX_IDLE_READERS: usize = 4;

/// How [`SqliteStore::open_with`] opens its file.
///
/// ```
/// use std::time::Duration;
/// use keel_offload::SqliteStoreOptions;
///
/// let options = SqliteStoreOptions::new().busy_timeout(Duration::from_secs(30)).full_sync(true);
/// assert_eq!(options.get_busy_timeout(), Duration::from_secs(30));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteStoreOptions {
    busy_timeout: Duration,
    full_sync: bool,
    max_size: Option<u64>,
}

impl Default for SqliteStoreOptions {
    fn default() -> Self {
        SqliteStoreOptions {
            busy_timeout: Duration::from_secs(5),
            full_sync: false,
            max_size: None,
        }
    }
}

impl SqliteStoreOptions {
    /// A 5 second busy timeout and `synchronous=NORMAL`.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a write waits for another connection (a checkpointer on the same
    /// file, another process) to release the write lock before failing.
    #[must_use]
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// `synchronous=FULL`: every commit is flushed to the disk before a write returns,
    /// so it survives a power cut. Off (`NORMAL`, WAL mode) a commit survives a killed
    /// process, and the last commits may be lost if the machine goes down.
    #[must_use]
    pub fn full_sync(mut self, full: bool) -> Self {
        self.full_sync = full;
        self
    }

    /// The most bytes the database may grow to (whole pages; `None`, the default: no
    /// limit). A write past it fails as a full disk would
    /// ([`OffloadError::is_storage_full`]) and changes nothing; in memory it is the
    /// bound on what the store holds.
    ///
    /// ```
    /// use keel_offload::{Key, OffloadStore, SqliteStoreOptions, SqliteStore};
    ///
    /// let store = SqliteStore::in_memory_with(SqliteStoreOptions::new().max_size(Some(256 * 1024)))?;
    /// let err = store.put(&Key::new("t1", "big")?, &"x".repeat(1 << 20)).unwrap_err();
    /// assert!(err.is_storage_full());
    /// store.put(&Key::new("t1", "small")?, "fits")?;
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    #[must_use]
    pub fn max_size(mut self, bytes: Option<u64>) -> Self {
        self.max_size = bytes;
        self
    }

    /// The size limit.
    pub fn get_max_size(&self) -> Option<u64> {
        self.max_size
    }

    /// The busy timeout.
    pub fn get_busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// Whether commits are flushed to the disk (`synchronous=FULL`).
    pub fn get_full_sync(&self) -> bool {
        self.full_sync
    }
}

/// An [`OffloadStore`] in a SQLite file: the embedded default, with no server. It may
/// be the very file a `keel_checkpoint_sqlite::SqliteSaver` keeps checkpoints in, so
/// one file holds a thread's checkpoints, its archive and its offloaded results.
///
/// * **Tables**: `keel_offload_files (thread_id, path) → generation, size` and
///   `keel_offload_chunks (thread_id, generation, off) → data`, both keyed by thread first;
///   the schema version is in `keel_offload_schema` (SQLite's `user_version` belongs to
///   the checkpointer). Opening creates or migrates them in one `BEGIN IMMEDIATE`
///   transaction; a file written by a newer keel is refused with
///   [`OffloadError::SchemaTooNew`].
/// * **Chunks**: a value is stored in chunks of at most 1 MiB, so a 200 MB result is
///   written straight from the caller's `&str`, and read back (`open`, `read_lines`,
///   `grep`) a chunk at a time. `append` adds chunk rows and never rewrites what is
///   stored; `put` writes a new generation and drops the old one in one transaction,
///   so readers see the old value or the new.
/// * **Connections**: one writer behind a lock, and up to four idle reader connections
///   (WAL mode), so reads do not wait for writes. A private in-memory database
///   ([`SqliteStore::in_memory`]) has one connection for both.
/// * **Sharing a file with the checkpointer**: the store's tables (`keel_offload_*`)
///   and keel-checkpoint-sqlite's `SqliteSaver` live side by side in one file, opened
///   in either order; each migrates only its own tables.
///
/// Every method blocks the calling thread; async code calls it from a blocking thread
/// (see [`OffloadStore`]).
///
/// ```
/// use keel_offload::{Key, OffloadStore, SqliteStore, ThreadId};
///
/// let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("agent.db"))?;
/// let key = Key::new("t1", "large_tool_results/call_1")?;
/// store.put(&key, "line 1\nline 2\n")?;
/// store.append(&key, "line 3\n")?;
/// assert_eq!(store.get(&key)?, "line 1\nline 2\nline 3\n");
/// assert_eq!(store.delete_thread(&ThreadId::new("t1")?)?, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    writer: Mutex<Connection>,
    /// `None`: in memory, every read goes to the writer.
    path: Option<PathBuf>,
    readers: Mutex<Vec<Connection>>,
    options: SqliteStoreOptions,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

fn sql_error(
    op: &'static str,
    key: impl fmt::Display,
) -> impl FnOnce(rusqlite::Error) -> OffloadError {
    move |e| OffloadError::database(op, key, e)
}

impl SqliteStore {
    /// Opens (or creates) the store in the SQLite file at `path`, with default
    /// [`SqliteStoreOptions`]: WAL mode, `synchronous=NORMAL`, a 5 second busy timeout.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OffloadError> {
        Self::open_with(path, SqliteStoreOptions::default())
    }

    /// Opens (or creates) the store at `path` with `options`.
    pub fn open_with(
        path: impl AsRef<Path>,
        options: SqliteStoreOptions,
    ) -> Result<Self, OffloadError> {
        let path = path.as_ref().to_owned();
        let shown = path.display().to_string();
        let mut conn = Connection::open(&path).map_err(sql_error("open the database", &shown))?;
        configure(&conn, &options, &shown)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(sql_error("switch to WAL mode", &shown))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(OffloadError::database(
                "switch to WAL mode",
                &shown,
                io::Error::other(format!("journal_mode is {mode}")),
            ));
        }
        migrate(&mut conn, &shown)?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                writer: Mutex::new(conn),
                path: Some(path),
                readers: Mutex::default(),
                options,
            }),
        })
    }

    /// A private in-memory database: for tests, and agents whose offloaded data may
    /// die with the process. Without a [`SqliteStoreOptions::max_size`] it grows without
    /// bound, as [`MemoryStore::new`](crate::MemoryStore::new) does.
    #[doc(alias = "open_in_memory")]
    pub fn in_memory() -> Result<Self, OffloadError> {
        Self::in_memory_with(SqliteStoreOptions::default())
    }

    /// A private in-memory database with `options` (the busy timeout and sync
    /// setting do not apply).
    pub fn in_memory_with(options: SqliteStoreOptions) -> Result<Self, OffloadError> {
        let mut conn =
            Connection::open_in_memory().map_err(sql_error("open the database", ":memory:"))?;
        configure(&conn, &options, ":memory:")?;
        migrate(&mut conn, ":memory:")?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                writer: Mutex::new(conn),
                path: None,
                readers: Mutex::default(),
                options,
            }),
        })
    }

    /// The database file (`None` in memory).
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }

    fn writer(&self) -> MutexGuard<'_, Connection> {
        self.inner
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on a reader connection: an idle one, or a new one (returned to the
    /// idle list afterwards, up to four). In memory, on the writer.
    fn with_reader<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, OffloadError>,
    ) -> Result<T, OffloadError> {
        let Some(path) = &self.inner.path else {
            return f(&mut self.writer());
        };
        let idle = self
            .inner
            .readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut conn = match idle {
            Some(c) => c,
            None => {
                let shown = path.display().to_string();
                let c = Connection::open(path).map_err(sql_error("open the database", &shown))?;
                configure(&c, &self.inner.options, &shown)?;
                c
            }
        };
        let out = f(&mut conn);
        let mut idle = self
            .inner
            .readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE_READERS {
            idle.push(conn);
        }
        out
    }

    /// Writes `text` to `key`: replacing it (`put`) or at its end. Returns where the
    /// text starts.
    fn write(&self, key: &Key, text: &str, replace: bool) -> Result<u64, OffloadError> {
        let mut conn = self.writer();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error("begin a write", key))?;
        let thread = key.thread().as_str();
        let path = key.path().as_str();
        let err = |op| sql_error(op, key);
        let existing: Option<(i64, i64)> = tx
            .prepare_cached(
                "SELECT generation, size FROM keel_offload_files WHERE thread_id = ?1 AND path = ?2",
            )
            .and_then(|mut s| {
                s.query_row(params![thread, path], |r| Ok((r.get(0)?, r.get(1)?)))
                    .optional()
            })
            .map_err(err("read"))?;
        let len = i64::try_from(text.len()).unwrap_or(i64::MAX);
        let (generation, start) = match existing {
            Some((old, _)) if replace => {
                tx.prepare_cached(
                    "DELETE FROM keel_offload_chunks WHERE thread_id = ?1 AND generation = ?2",
                )
                .and_then(|mut s| s.execute(params![thread, old]))
                .map_err(err("write"))?;
                let generation = db::new_gen();
                tx.prepare_cached(
                    "UPDATE keel_offload_files SET generation = ?3, size = ?4 WHERE thread_id = ?1 AND path = ?2",
                )
                .and_then(|mut s| s.execute(params![thread, path, generation, len]))
                .map_err(err("write"))?;
                (generation, 0)
            }
            Some((generation, size)) => {
                tx.prepare_cached(
                    "UPDATE keel_offload_files SET size = size + ?3 WHERE thread_id = ?1 AND path = ?2",
                )
                .and_then(|mut s| s.execute(params![thread, path, len]))
                .map_err(err("write"))?;
                (generation, size)
            }
            None => {
                check_shape(&tx, key)?;
                let generation = db::new_gen();
                tx.prepare_cached(
                    "INSERT INTO keel_offload_files (thread_id, path, generation, size) VALUES (?1, ?2, ?3, ?4)",
                )
                .and_then(|mut s| s.execute(params![thread, path, generation, len]))
                .map_err(err("write"))?;
                (generation, 0)
            }
        };
        {
            let mut insert = tx
                .prepare_cached(
                    "INSERT INTO keel_offload_chunks (thread_id, generation, off, data) VALUES (?1, ?2, ?3, ?4)",
                )
                .map_err(err("write"))?;
            let mut off = start;
            for piece in text.as_bytes().chunks(CHUNK) {
                insert
                    .execute(params![thread, generation, off, piece])
                    .map_err(err("write"))?;
                off += piece.len() as i64;
            }
        }
        tx.commit().map_err(err("commit a write"))?;
        Ok(u64::try_from(start).unwrap_or(0))
    }

    /// `(generation, size)` of the file at `key`; `NotFound`, or an error when it is a
    /// directory.
    fn meta(conn: &Connection, key: &Key) -> Result<(i64, u64), OffloadError> {
        match file_meta(conn, key)? {
            Some(m) => Ok(m),
            None if is_dir(conn, key.thread(), key.path().as_str())
                .map_err(sql_error("read", key))? =>
            {
                Err(db::is_a_directory(key))
            }
            None => Err(db::not_found(key)),
        }
    }
}

fn configure(
    conn: &Connection,
    options: &SqliteStoreOptions,
    shown: &str,
) -> Result<(), OffloadError> {
    let err = sql_error("configure the connection", shown);
    conn.busy_timeout(options.busy_timeout).map_err(err)?;
    let sync = if options.full_sync { "FULL" } else { "NORMAL" };
    conn.pragma_update(None, "synchronous", sync)
        .map_err(sql_error("configure the connection", shown))?;
    conn.set_prepared_statement_cache_capacity(32);
    if let Some(bytes) = options.max_size {
        let page: i64 = conn
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .map_err(sql_error("configure the connection", shown))?;
        let pages = i64::try_from(bytes / u64::try_from(page.max(1)).unwrap_or(4096))
            .unwrap_or(i64::MAX)
            .max(1);
        let _: i64 = conn
            .pragma_update_and_check(None, "max_page_count", pages, |r| r.get(0))
            .map_err(sql_error("configure the connection", shown))?;
    }
    Ok(())
}

/// Creates or upgrades the offload tables; refuses a newer schema.
fn migrate(conn: &mut Connection, shown: &str) -> Result<(), OffloadError> {
    let err = |op| sql_error(op, shown);
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(err("migrate the schema"))?;
    tx.execute_batch("CREATE TABLE IF NOT EXISTS keel_offload_schema (version INTEGER NOT NULL)")
        .map_err(err("migrate the schema"))?;
    let found: i64 = tx
        .query_row(
            "SELECT coalesce(max(version), 0) FROM keel_offload_schema",
            [],
            |r| r.get(0),
        )
        .map_err(err("migrate the schema"))?;
    if found > SQLITE_SCHEMA_VERSION {
        return Err(OffloadError::SchemaTooNew {
            store: shown.to_owned(),
            found,
            supported: SQLITE_SCHEMA_VERSION,
        });
    }
    if found == SQLITE_SCHEMA_VERSION {
        return Ok(());
    }
    for sql in SQLITE_MIGRATIONS
        .iter()
        .skip(usize::try_from(found).unwrap_or(0))
    {
        tx.execute_batch(sql).map_err(err("migrate the schema"))?;
    }
    tx.execute("DELETE FROM keel_offload_schema", [])
        .map_err(err("migrate the schema"))?;
    tx.execute(
        "INSERT INTO keel_offload_schema (version) VALUES (?1)",
        [SQLITE_SCHEMA_VERSION],
    )
    .map_err(err("migrate the schema"))?;
    tx.commit().map_err(err("migrate the schema"))
}

fn file_meta(conn: &Connection, key: &Key) -> Result<Option<(i64, u64)>, OffloadError> {
    conn.prepare_cached(
        "SELECT generation, size FROM keel_offload_files WHERE thread_id = ?1 AND path = ?2",
    )
    .and_then(|mut s| {
        s.query_row(params![key.thread().as_str(), key.path().as_str()], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })
        .optional()
    })
    .map(|m| m.map(|(g, s)| (g, u64::try_from(s).unwrap_or(0))))
    .map_err(sql_error("read", key))
}

/// Whether files of `thread` lie under the directory `dir`.
fn is_dir(conn: &Connection, thread: &ThreadId, dir: &str) -> rusqlite::Result<bool> {
    let (lo, hi) = db::dir_bounds(dir);
    conn.prepare_cached(
        "SELECT EXISTS (SELECT 1 FROM keel_offload_files WHERE thread_id = ?1 AND path >= ?2 AND path < ?3)",
    )?
    .query_row(params![thread.as_str(), lo, hi], |r| r.get(0))
}

/// A new file at `key` needs no file among its ancestors and no file under it.
fn check_shape(conn: &Connection, key: &Key) -> Result<(), OffloadError> {
    let mut probe = conn
        .prepare_cached("SELECT 1 FROM keel_offload_files WHERE thread_id = ?1 AND path = ?2")
        .map_err(sql_error("read", key))?;
    for ancestor in db::ancestors(key.path().as_str()) {
        let found = probe
            .query_row(params![key.thread().as_str(), ancestor], |_| Ok(()))
            .optional()
            .map_err(sql_error("read", key))?;
        if found.is_some() {
            return Err(db::not_a_directory(key, &ancestor));
        }
    }
    if is_dir(conn, key.thread(), key.path().as_str()).map_err(sql_error("read", key))? {
        return Err(db::is_a_directory(key));
    }
    Ok(())
}

/// Chunks of `generation` starting in `[from, until)`, each cut to `[start, end)` of the value.
fn chunk_rows(
    conn: &Connection,
    thread: &str,
    generation: i64,
    from: u64,
    until: u64,
    start: u64,
    end: u64,
) -> rusqlite::Result<Vec<(u64, Vec<u8>)>> {
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut s = conn.prepare_cached(
        "SELECT off, substr(data, max(?5 - off, 0) + 1, ?6 - max(?5, off)) FROM keel_offload_chunks
         WHERE thread_id = ?1 AND generation = ?2 AND off >= ?3 AND off < ?4 ORDER BY off",
    )?;
    let rows = s.query_map(
        params![
            thread,
            generation,
            int(from),
            int(until),
            int(start),
            int(end)
        ],
        |r| {
            Ok((
                u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
                r.get::<_, Vec<u8>>(1)?,
            ))
        },
    )?;
    rows.collect()
}

/// The offset of the chunk of `generation` holding byte `at`.
fn chunk_start(conn: &Connection, thread: &str, generation: i64, at: u64) -> rusqlite::Result<u64> {
    let at = i64::try_from(at).unwrap_or(i64::MAX);
    conn.prepare_cached(
        "SELECT coalesce(max(off), 0) FROM keel_offload_chunks WHERE thread_id = ?1 AND generation = ?2 AND off <= ?3",
    )?
    .query_row(params![thread, generation, at], |r| r.get::<_, i64>(0))
    .map(|o| u64::try_from(o).unwrap_or(0))
}

impl OffloadStore for SqliteStore {
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        self.write(key, text, true)?;
        Ok(text.len() as u64)
    }

    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        self.write(key, text, false)
    }

    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        let out = self.with_reader(|conn| {
            // One read transaction: the value as of one moment, even across chunks.
            let tx = conn.transaction().map_err(sql_error("read", key))?;
            let (generation, size) = Self::meta(&tx, key)?;
            let thread = key.thread().as_str();
            let mut out = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            let mut pos = 0u64;
            while pos < size {
                let rows = chunk_rows(&tx, thread, generation, pos, pos + FETCH, 0, u64::MAX)
                    .map_err(sql_error("read", key))?;
                if rows.is_empty() {
                    return Err(OffloadError::io("read", key, db::changed()));
                }
                db::follow(&mut pos, &rows).map_err(|e| OffloadError::io("read", key, e))?;
                for (_, data) in rows {
                    out.extend_from_slice(&data);
                }
            }
            Ok(out)
        })?;
        String::from_utf8(out).map_err(|_| OffloadError::NotUtf8 {
            key: key.to_string(),
        })
    }

    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        let (generation, size) = self.with_reader(|conn| Self::meta(conn, key))?;
        let thread = key.thread().as_str().to_owned();
        let store = self.clone();
        Ok(Box::new(ChunkReader::new(size, move |pos| {
            store
                .with_reader(|conn| {
                    chunk_rows(conn, &thread, generation, pos, pos + FETCH, 0, u64::MAX)
                        .map_err(sql_error("read", &thread))
                })
                .map_err(io::Error::other)
        })))
    }

    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
        self.with_reader(|conn| {
            let tx = conn.transaction().map_err(sql_error("read", key))?;
            let (generation, size) = Self::meta(&tx, key)?;
            let start = offset.min(size);
            let end = start.saturating_add(len as u64).min(size);
            if start == end {
                return Ok(Vec::new());
            }
            let thread = key.thread().as_str();
            let first =
                chunk_start(&tx, thread, generation, start).map_err(sql_error("read", key))?;
            let rows = chunk_rows(&tx, thread, generation, first, end, start, end)
                .map_err(sql_error("read", key))?;
            db::join_slices(start, end - start, rows).map_err(|e| OffloadError::io("read", key, e))
        })
    }

    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
        match self.with_reader(|conn| Self::meta(conn, key)) {
            Ok((_, size)) => Ok(Some(size)),
            Err(OffloadError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn list(
        &self,
        thread: &ThreadId,
        under: Option<&StorePath>,
    ) -> Result<Vec<Entry>, OffloadError> {
        let shown = match under {
            Some(p) => format!("{thread}/{p}"),
            None => thread.to_string(),
        };
        let entry = |r: &rusqlite::Row<'_>| -> rusqlite::Result<(String, i64)> {
            Ok((r.get(0)?, r.get(1)?))
        };
        let rows: Vec<(String, i64)> =
            self.with_reader(|conn| {
                match under {
            None => conn
                .prepare_cached(
                    "SELECT path, size FROM keel_offload_files WHERE thread_id = ?1 ORDER BY path",
                )
                .and_then(|mut s| s.query_map([thread.as_str()], entry)?.collect())
                .map_err(sql_error("list", &shown)),
            Some(p) => {
                let key = Key::from_parts(thread.clone(), p.clone());
                if let Some((_, size)) = file_meta(conn, &key)? {
                    return Ok(vec![(p.as_str().to_owned(), i64::try_from(size).unwrap_or(0))]);
                }
                let (lo, hi) = db::dir_bounds(p.as_str());
                conn.prepare_cached(
                    "SELECT path, size FROM keel_offload_files
                     WHERE thread_id = ?1 AND path >= ?2 AND path < ?3 ORDER BY path",
                )
                .and_then(|mut s| s.query_map(params![thread.as_str(), lo, hi], entry)?.collect())
                .map_err(sql_error("list", &shown))
            }
        }
            })?;
        if under.is_some() && rows.is_empty() {
            return Err(OffloadError::NotFound { key: shown });
        }
        rows.into_iter()
            .map(|(path, size)| {
                Ok(Entry {
                    path: StorePath::new(path)?,
                    bytes: u64::try_from(size).unwrap_or(0),
                })
            })
            .collect()
    }

    fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
        let mut conn = self.writer();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error("begin a write", key))?;
        let Some((generation, _)) = file_meta(&tx, key)? else {
            return Ok(false);
        };
        let thread = key.thread().as_str();
        tx.prepare_cached(
            "DELETE FROM keel_offload_chunks WHERE thread_id = ?1 AND generation = ?2",
        )
        .and_then(|mut s| s.execute(params![thread, generation]))
        .map_err(sql_error("delete", key))?;
        tx.prepare_cached("DELETE FROM keel_offload_files WHERE thread_id = ?1 AND path = ?2")
            .and_then(|mut s| s.execute(params![thread, key.path().as_str()]))
            .map_err(sql_error("delete", key))?;
        tx.commit().map_err(sql_error("commit a delete", key))?;
        Ok(true)
    }

    /// Deletes the chunk rows past `len` and shortens the one across it, in one
    /// transaction.
    fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
        let mut conn = self.writer();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql_error("begin a write", key))?;
        let (generation, size) = Self::meta(&tx, key)?;
        if len >= size {
            return Ok(false);
        }
        let (thread, cut) = (
            key.thread().as_str(),
            i64::try_from(len).unwrap_or(i64::MAX),
        );
        let err = |op| sql_error(op, key);
        let at: Option<Vec<u8>> = tx
            .prepare_cached(
                "SELECT substr(data, ?3 - off + 1, 1) FROM keel_offload_chunks
                 WHERE thread_id = ?1 AND generation = ?2 AND off <= ?3 AND off + length(data) > ?3",
            )
            .and_then(|mut s| {
                s.query_row(params![thread, generation, cut], |r| r.get(0))
                    .optional()
            })
            .map_err(err("truncate"))?;
        if at
            .and_then(|b| b.first().copied())
            .is_some_and(crate::store::continues_char)
        {
            return Err(crate::store::cut_inside_char(key));
        }
        tx.prepare_cached(
            "DELETE FROM keel_offload_chunks WHERE thread_id = ?1 AND generation = ?2 AND off >= ?3",
        )
        .and_then(|mut s| s.execute(params![thread, generation, cut]))
        .map_err(err("truncate"))?;
        tx.prepare_cached(
            "UPDATE keel_offload_chunks SET data = substr(data, 1, ?3 - off)
             WHERE thread_id = ?1 AND generation = ?2 AND off + length(data) > ?3
               AND off = (SELECT max(off) FROM keel_offload_chunks
                          WHERE thread_id = ?1 AND generation = ?2 AND off < ?3)",
        )
        .and_then(|mut s| s.execute(params![thread, generation, cut]))
        .map_err(err("truncate"))?;
        tx.prepare_cached(
            "UPDATE keel_offload_files SET size = ?3 WHERE thread_id = ?1 AND path = ?2",
        )
        .and_then(|mut s| s.execute(params![thread, key.path().as_str(), cut]))
        .map_err(err("truncate"))?;
        tx.commit().map_err(err("commit a truncation"))?;
        Ok(true)
    }

    /// Deletes the thread's rows of both tables in one transaction.
    fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        let mut conn = self.writer();
        let err = |op| sql_error(op, thread);
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err("begin a write"))?;
        tx.prepare_cached("DELETE FROM keel_offload_chunks WHERE thread_id = ?1")
            .and_then(|mut s| s.execute([thread.as_str()]))
            .map_err(err("delete"))?;
        let files = tx
            .prepare_cached("DELETE FROM keel_offload_files WHERE thread_id = ?1")
            .and_then(|mut s| s.execute([thread.as_str()]))
            .map_err(err("delete"))?;
        tx.commit().map_err(err("commit a delete"))?;
        Ok(files as u64)
    }
}
