use std::fmt;
use std::future::Future;
use std::io::{self, Read};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use deadpool_postgres::{
    GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime, Transaction,
};
use tokio::sync::mpsc;
use tokio_postgres::types::ToSql;
use tokio_postgres::{IsolationLevel, Row};

use crate::db::{self, CHUNK, ChunkReader, FETCH};
use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::{Entry, OffloadStore};

/// The offload schema version this build writes (the newest row of
/// `keel_offload_schema`).
pub const POSTGRES_SCHEMA_VERSION: i64 = PG_MIGRATIONS.len() as i64;

/// One schema migration: its name, its SQL (`{s}` is the quoted schema name), and
/// whether it needs lz4 (PostgreSQL 14 or newer, built with it); without it the
/// migration is recorded and changes nothing.
struct PgMigration {
    name: &'static str,
    sql: &'static str,
    needs_lz4: bool,
}

/// Migration `i` brings the schema from version `i` to `i + 1`.
const PG_MIGRATIONS: &[PgMigration] = &[
    PgMigration {
        name: "files and chunks",
        sql: r#"
    -- One row per file: its current generation and size in bytes. Paths compare
    -- byte-wise (COLLATE "C"), so listing order and directory ranges match the other
    -- stores whatever the database's locale.
    CREATE TABLE {s}.keel_offload_files (
        thread_id  text   NOT NULL,
        path       text   COLLATE "C" NOT NULL,
        generation bigint NOT NULL,
        size       bigint NOT NULL,
        PRIMARY KEY (thread_id, path)
    );
    -- The bytes of each generation in chunks of at most 1 MiB, keyed by offset.
    CREATE TABLE {s}.keel_offload_chunks (
        thread_id  text   NOT NULL,
        generation bigint NOT NULL,
        off        bigint NOT NULL,
        data       bytea  NOT NULL,
        PRIMARY KEY (thread_id, generation, off)
    );
    "#,
        needs_lz4: false,
    },
    PgMigration {
        name: "chunks compressed with lz4 where the server has it",
        sql: r#"
    -- Chunks over about 2 kB are compressed when stored; lz4 writes a 1 MiB chunk of
    -- JSON about 3.5 times faster than pglz, the default, for about 15% more bytes.
    -- Chunks written before stay as they are and read the same. Only the catalog
    -- changes, under a brief exclusive lock on the table.
    ALTER TABLE {s}.keel_offload_chunks ALTER COLUMN data SET COMPRESSION lz4;
    "#,
        needs_lz4: true,
    },
];

/// Pieces of a write a caller may have queued for the connection thread: the memory
/// a write holds is about this many chunks, whatever the size of the value.
const WINDOW: usize = 2;

/// The default number of pooled connections of a store that makes its own pool.
pub const DEFAULT_POSTGRES_POOL_SIZE: usize = 8;

/// How [`PostgresStore`] reaches its tables: the schema they live in, the pool size
/// and the statement timeout of the connections it opens.
///
/// ```
/// use std::time::Duration;
/// use keel_offload::PostgresStoreOptions;
///
/// let options = PostgresStoreOptions::new()
///     .schema("agents")?
///     .pool_size(4)
///     .statement_timeout(Some(Duration::from_secs(10)));
/// assert_eq!(options.get_schema(), "agents");
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresStoreOptions {
    schema: String,
    pool_size: usize,
    statement_timeout: Option<Duration>,
}

impl Default for PostgresStoreOptions {
    fn default() -> Self {
        PostgresStoreOptions {
            schema: "public".to_owned(),
            pool_size: DEFAULT_POSTGRES_POOL_SIZE,
            statement_timeout: Some(Duration::from_secs(30)),
        }
    }
}

impl PostgresStoreOptions {
    /// Schema `public`, [`DEFAULT_POSTGRES_POOL_SIZE`] connections, a 30 second
    /// statement timeout.
    pub fn new() -> Self {
        Self::default()
    }

    /// The schema of the `keel_offload_*` tables (created when missing): the
    /// checkpointer's schema, so checkpoints and archive sit side by side. Any name
    /// PostgreSQL accepts (it is quoted, never spliced raw): 1 to 63 bytes, no NUL.
    pub fn schema(mut self, schema: impl Into<String>) -> Result<Self, OffloadError> {
        let schema = schema.into();
        if schema.is_empty() || schema.len() > 63 || schema.contains('\0') {
            return Err(OffloadError::database(
                "use the schema",
                crate::Shown::new(&schema),
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a schema name is 1 to 63 bytes without NUL",
                ),
            ));
        }
        self.schema = schema;
        Ok(self)
    }

    /// Connections the store's own pool opens at most (at least 1). Unused with
    /// [`PostgresStore::from_pool`].
    #[must_use]
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The session's `statement_timeout` on the connections the store opens (`None`:
    /// the server's). Unused with [`PostgresStore::from_pool`].
    #[must_use]
    pub fn statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The schema.
    pub fn get_schema(&self) -> &str {
        &self.schema
    }

    /// The pool size.
    pub fn get_pool_size(&self) -> usize {
        self.pool_size
    }

    /// The statement timeout.
    pub fn get_statement_timeout(&self) -> Option<Duration> {
        self.statement_timeout
    }
}

/// An [`OffloadStore`] in PostgreSQL: the archive and offloaded results of a fleet of
/// workers, in the same database (and schema) as `keel_checkpoint_postgres`'s
/// checkpoints, so any worker can read back what any other offloaded.
///
/// # Tables
///
/// `keel_offload_files (thread_id, path) → generation, size` and
/// `keel_offload_chunks (thread_id, generation, off) → data bytea`: every key is led
/// by the thread id and no statement touches two threads, so a PostgreSQL sharded by
/// thread id (Citus) takes the tables unchanged. Values are stored in chunks of at
/// most 1 MiB: a 200 MB result is sent a chunk at a time (never a second copy in
/// memory) and read back a chunk at a time by `open`, `read_lines` and `grep`;
/// `append` inserts rows at the end and never rewrites what is stored; `put` writes a
/// new generation and drops the old one in one transaction, and `get` reads in one
/// repeatable-read snapshot, so readers see the old value or the new. Applied schema
/// versions are rows of `keel_offload_schema`; setup runs under an advisory lock, so
/// many workers may start at once, and a schema written by a newer keel is refused
/// with [`OffloadError::SchemaTooNew`].
///
/// # Blocking, and why a connection thread
///
/// The trait is synchronous. keel calls it from async code on tokio's blocking pool
/// (the agent's offload policy, the compactor's archive appends); other callers may
/// call it from anywhere, a runtime's worker included. The synchronous `postgres`
/// crate and `Handle::block_on` both panic when called from inside a runtime, and
/// `block_in_place` panics on a current-thread runtime. So the store owns one thread
/// with its own current-thread runtime: every call sends its work there over a
/// channel and waits for the answer on a plain `std` channel, which blocks the
/// calling thread and panics nowhere — a plain thread, a `spawn_blocking` closure, a
/// worker of a multi-thread runtime, a current-thread runtime's only thread. The
/// calls run concurrently on that thread over the pool's connections.
///
/// The connections of the store's pool are opened and driven on that thread too. So
/// [`PostgresStore::pool`] can be handed to a `keel_checkpoint_postgres::PostgresSaver`
/// (`PostgresSaver::from_pool`), and one pool serves checkpoints and archive without a
/// caller that blocks its runtime ever starving a connection. A pool given to
/// [`PostgresStore::from_pool`] keeps its connections where they were opened: call
/// such a store only from threads that do not drive that pool's runtime (a blocking
/// pool thread or a plain thread).
///
/// ```no_run
/// use keel_offload::{Archive, Key, OffloadStore, PostgresStoreOptions, PostgresStore};
///
/// // DATABASE_URL=postgres://keel@localhost:5432/app
/// let url = std::env::var("DATABASE_URL")?;
/// let store = PostgresStore::connect_with(&url, PostgresStoreOptions::new().schema("agents")?)?;
/// store.put(&Key::new("ticket-42", "large_tool_results/call_1")?, "30,000 lines…")?;
/// let archive = Archive::new(std::sync::Arc::new(store.clone()));
/// // The same pool for the checkpointer:
/// // PostgresSaver::from_pool(store.pool().clone(), "agents")?
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    bridge: Arc<Bridge>,
    pool: Pool,
    sql: Arc<Sql>,
    schema: String,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// The connection thread: a current-thread runtime running the jobs it is sent.
struct Bridge {
    jobs: mpsc::UnboundedSender<Job>,
    handle: tokio::runtime::Handle,
}

impl Bridge {
    fn start() -> Result<Bridge, OffloadError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| OffloadError::database("start the connection thread", "postgres", e))?;
        let handle = rt.handle().clone();
        // Unbounded, yet bounded in practice: each caller waits for its answer, so at
        // most one job per calling thread is queued.
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        std::thread::Builder::new()
            .name("keel-offload-postgres".to_owned())
            .spawn(move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    while let Some(job) = rx.recv().await {
                        tokio::task::spawn_local(job());
                    }
                });
            })
            .map_err(|e| OffloadError::database("start the connection thread", "postgres", e))?;
        Ok(Bridge { jobs, handle })
    }

    /// Runs `work` on the connection thread and waits for its answer.
    fn run<T, F, Fut>(&self, what: &str, work: F) -> Result<T, OffloadError>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, OffloadError>> + 'static,
    {
        let (tx, rx) = std_mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let _ = tx.send(work().await);
            })
        });
        self.jobs.send(job).map_err(|_| gone(what))?;
        rx.recv().map_err(|_| gone(what))?
    }
}

fn gone(what: &str) -> OffloadError {
    OffloadError::database(
        "reach the connection thread",
        what,
        io::Error::other("the store's connection thread stopped"),
    )
}

/// Opens the pool's connections on the connection thread, whoever asks for one.
struct BridgeConnect {
    handle: tokio::runtime::Handle,
    /// The connector the connection string's `sslmode` asks for.
    tls: keel_postgres_tls::Tls,
    /// Keeps the connection thread running while the pool lives.
    _keep: mpsc::UnboundedSender<Job>,
}

type ConnectFuture<'a> = Pin<
    Box<
        dyn Future<
                Output = Result<
                    (tokio_postgres::Client, tokio::task::JoinHandle<()>),
                    tokio_postgres::Error,
                >,
            > + Send
            + 'a,
    >,
>;

impl deadpool_postgres::Connect for BridgeConnect {
    fn connect(&self, pg_config: &tokio_postgres::Config) -> ConnectFuture<'_> {
        let config = pg_config.clone();
        let handle = self.handle.clone();
        let (tls, fallback_tls) = (self.tls.clone(), self.tls.clone());
        Box::pin(async move {
            let there = config.clone();
            let opened = handle.spawn(async move {
                let (client, connection) = there.connect(tls).await?;
                let task = tokio::spawn(async move {
                    let _ = connection.await;
                });
                Ok((client, task))
            });
            match opened.await {
                Ok(result) => result,
                // The connection thread is gone: open the connection here instead.
                Err(_) => {
                    let (client, connection) = config.connect(fallback_tls).await?;
                    let task = tokio::spawn(async move {
                        let _ = connection.await;
                    });
                    Ok((client, task))
                }
            }
        })
    }
}

/// The statements, with the schema filled in.
struct Sql {
    stat: String,
    list_path: String,
    is_dir: String,
    ancestor: String,
    put_insert: String,
    lock: String,
    drop_generation: String,
    set_generation: String,
    append_upsert: String,
    append_small: String,
    insert_chunk: String,
    chunks_whole: String,
    chunks_cut: String,
    chunk_start: String,
    list_all: String,
    delete_file: String,
    delete_thread_chunks: String,
    delete_thread_files: String,
    lock_size: String,
    drop_chunks_from: String,
    cut_chunk: String,
    byte_at: String,
    set_size: String,
}

impl Sql {
    fn new(schema: &str) -> Sql {
        let s = quote_ident(schema);
        let files = format!("{s}.keel_offload_files");
        let chunks = format!("{s}.keel_offload_chunks");
        Sql {
            // One row: the file's generation and size, or NULLs and whether a directory
            // is there.
            stat: format!(
                "SELECT f.generation, f.size,
                        f.generation IS NULL AND EXISTS (
                            SELECT 1 FROM {files}
                            WHERE thread_id = $1 AND path >= $3 AND path < $4)
                 FROM (VALUES (1)) AS one (x)
                 LEFT JOIN {files} f ON f.thread_id = $1 AND f.path = $2"
            ),
            // The file at $2, or the files under the directory $2 (never both).
            list_path: format!(
                "SELECT path, size FROM {files}
                 WHERE thread_id = $1 AND (path = $2 OR (path >= $3 AND path < $4)) ORDER BY path"
            ),
            is_dir: format!(
                "SELECT EXISTS (SELECT 1 FROM {files} WHERE thread_id = $1 AND path >= $2 AND path < $3)"
            ),
            ancestor: format!(
                "SELECT path FROM {files} WHERE thread_id = $1 AND path = ANY($2) LIMIT 1"
            ),
            put_insert: format!(
                "INSERT INTO {files} (thread_id, path, generation, size) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (thread_id, path) DO NOTHING RETURNING generation"
            ),
            lock: format!(
                "SELECT generation FROM {files} WHERE thread_id = $1 AND path = $2 FOR UPDATE"
            ),
            drop_generation: format!("DELETE FROM {chunks} WHERE thread_id = $1 AND generation = $2"),
            set_generation: format!(
                "UPDATE {files} SET generation = $3, size = $4 WHERE thread_id = $1 AND path = $2"
            ),
            append_upsert: format!(
                "INSERT INTO {files} AS f (thread_id, path, generation, size) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (thread_id, path) DO UPDATE SET size = f.size + EXCLUDED.size
                 RETURNING generation, size"
            ),
            // A whole append of at most one chunk in one statement: the file's row
            // (created when the path may hold a file: no file among its ancestors,
            // none under it) and the chunk at its old end. No row: the path cannot
            // hold a file.
            append_small: format!(
                "WITH shape AS (
                     SELECT NOT EXISTS (SELECT 1 FROM {files} WHERE thread_id = $1 AND path = ANY($6))
                        AND NOT EXISTS (SELECT 1 FROM {files}
                                        WHERE thread_id = $1 AND path >= $7 AND path < $8) AS ok
                 ), file AS (
                     INSERT INTO {files} AS f (thread_id, path, generation, size)
                     SELECT $1, $2, $3, $4 FROM shape WHERE shape.ok
                     ON CONFLICT (thread_id, path) DO UPDATE SET size = f.size + EXCLUDED.size
                     RETURNING generation, size
                 ), chunk AS (
                     INSERT INTO {chunks} (thread_id, generation, off, data)
                     SELECT $1, generation, size - $4, $5 FROM file WHERE $4 > 0
                 )
                 SELECT generation, size FROM file"
            ),
            insert_chunk: format!(
                "INSERT INTO {chunks} (thread_id, generation, off, data) VALUES ($1, $2, $3, $4)"
            ),
            chunks_whole: format!(
                "SELECT off, data FROM {chunks}
                 WHERE thread_id = $1 AND generation = $2 AND off >= $3 AND off < $4 ORDER BY off"
            ),
            chunks_cut: format!(
                "SELECT off, substring(data FROM (greatest($5 - off, 0) + 1)::int
                                           FOR least($6 - greatest($5, off), {CHUNK})::int)
                 FROM {chunks}
                 WHERE thread_id = $1 AND generation = $2 AND off >= $3 AND off < $4 ORDER BY off"
            ),
            chunk_start: format!(
                "SELECT coalesce(max(off), 0) FROM {chunks}
                 WHERE thread_id = $1 AND generation = $2 AND off <= $3"
            ),
            list_all: format!(
                "SELECT path, size FROM {files} WHERE thread_id = $1 ORDER BY path"
            ),
            delete_file: format!(
                "DELETE FROM {files} WHERE thread_id = $1 AND path = $2 RETURNING generation"
            ),
            delete_thread_chunks: format!("DELETE FROM {chunks} WHERE thread_id = $1"),
            delete_thread_files: format!("DELETE FROM {files} WHERE thread_id = $1"),
            lock_size: format!(
                "SELECT generation, size FROM {files} WHERE thread_id = $1 AND path = $2 FOR UPDATE"
            ),
            drop_chunks_from: format!(
                "DELETE FROM {chunks} WHERE thread_id = $1 AND generation = $2 AND off >= $3"
            ),
            cut_chunk: format!(
                "UPDATE {chunks} SET data = substring(data FROM 1 FOR ($3 - off)::int)
                 WHERE thread_id = $1 AND generation = $2 AND off + length(data) > $3
                   AND off = (SELECT max(off) FROM {chunks}
                              WHERE thread_id = $1 AND generation = $2 AND off < $3)"
            ),
            byte_at: format!(
                "SELECT substring(data FROM ($3 - off + 1)::int FOR 1) FROM {chunks}
                 WHERE thread_id = $1 AND generation = $2 AND off <= $3 AND off + length(data) > $3"
            ),
            set_size: format!("UPDATE {files} SET size = $3 WHERE thread_id = $1 AND path = $2"),
        }
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The advisory lock key that serializes setups of one schema.
fn lock_key(schema: &str) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in "keel-offload/migrations/".bytes().chain(schema.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

fn pg<E: std::error::Error + Send + Sync + 'static>(
    op: &'static str,
    key: impl fmt::Display,
) -> impl FnOnce(E) -> OffloadError {
    move |e| OffloadError::database(op, key, e)
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn uint(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// Creates the schema and tables, or upgrades them; refuses a newer schema.
async fn migrate(pool: &Pool, schema: &str) -> Result<(), OffloadError> {
    let err = |e: tokio_postgres::Error| OffloadError::database("migrate the schema", schema, e);
    let mut client = pool
        .get()
        .await
        .map_err(pg("connect", format!("offload schema {schema}")))?;
    let tx = client.transaction().await.map_err(err)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(schema)])
        .await
        .map_err(err)?;
    let s = quote_ident(schema);
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.keel_offload_schema (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .await
    .map_err(err)?;
    let found: i64 = tx
        .query_one(
            format!("SELECT coalesce(max(version), 0)::bigint FROM {s}.keel_offload_schema")
                .as_str(),
            &[],
        )
        .await
        .and_then(|r| r.try_get(0))
        .map_err(err)?;
    if found > POSTGRES_SCHEMA_VERSION {
        return Err(OffloadError::SchemaTooNew {
            store: format!("schema {s}"),
            found,
            supported: POSTGRES_SCHEMA_VERSION,
        });
    }
    for (i, migration) in PG_MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(found).unwrap_or(0))
    {
        // `default_toast_compression` exists from PostgreSQL 14 on, and lists lz4 among
        // its values only when the server was built with it.
        let applies = !migration.needs_lz4
            || tx
                .query_opt(
                    "SELECT 1 FROM pg_catalog.pg_settings \
                     WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)",
                    &[],
                )
                .await
                .map_err(err)?
                .is_some();
        if applies {
            tx.batch_execute(&migration.sql.replace("{s}", &s))
                .await
                .map_err(err)?;
        }
        let version = i32::try_from(i + 1).unwrap_or(i32::MAX);
        tx.execute(
            format!("INSERT INTO {s}.keel_offload_schema (version, name) VALUES ($1, $2)").as_str(),
            &[&version, &migration.name],
        )
        .await
        .map_err(err)?;
    }
    tx.commit().await.map_err(err)
}

/// Runs a statement through the connection's statement cache: prepared once per
/// connection, then one round trip per call (a statement sent as text would be
/// parsed, planned and answered in two).
async fn query<C: GenericClient>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    client
        .query(&client.prepare_cached(sql).await?, params)
        .await
}

async fn query_opt<C: GenericClient>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, tokio_postgres::Error> {
    client
        .query_opt(&client.prepare_cached(sql).await?, params)
        .await
}

async fn query_one<C: GenericClient>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Row, tokio_postgres::Error> {
    client
        .query_one(&client.prepare_cached(sql).await?, params)
        .await
}

async fn execute<C: GenericClient>(
    client: &C,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(&client.prepare_cached(sql).await?, params)
        .await
}

/// `(generation, size)` of the file at `key`; `NotFound`, or an error when it is a
/// directory.
async fn meta<C: GenericClient>(
    client: &C,
    sql: &Sql,
    key: &Key,
) -> Result<(i64, u64), OffloadError> {
    let (thread, path) = (key.thread().as_str(), key.path().as_str());
    let (lo, hi) = db::dir_bounds(path);
    let row = query_one(client, &sql.stat, &[&thread, &path, &lo, &hi])
        .await
        .map_err(pg("read", key))?;
    let generation: Option<i64> = row.try_get(0).map_err(pg("read", key))?;
    let size: Option<i64> = row.try_get(1).map_err(pg("read", key))?;
    let dir: bool = row.try_get(2).map_err(pg("read", key))?;
    match (generation, size) {
        (Some(generation), Some(size)) => Ok((generation, uint(size))),
        _ if dir => Err(db::is_a_directory(key)),
        _ => Err(db::not_found(key)),
    }
}

async fn is_dir<C: GenericClient>(
    client: &C,
    sql: &Sql,
    thread: &str,
    dir: &str,
) -> Result<bool, tokio_postgres::Error> {
    let (lo, hi) = db::dir_bounds(dir);
    query_one(client, &sql.is_dir, &[&thread, &lo, &hi])
        .await?
        .try_get(0)
}

/// A new file at `key` needs no file among its ancestors and no file under it.
async fn check_shape(tx: &Transaction<'_>, sql: &Sql, key: &Key) -> Result<(), OffloadError> {
    let (thread, path) = (key.thread().as_str(), key.path().as_str());
    let ancestors = db::ancestors(path);
    if !ancestors.is_empty() {
        let found = query_opt(tx, &sql.ancestor, &[&thread, &ancestors])
            .await
            .map_err(pg("read", key))?;
        if let Some(row) = found {
            let at: String = row.try_get(0).map_err(pg("read", key))?;
            return Err(db::not_a_directory(key, &at));
        }
    }
    if is_dir(tx, sql, thread, path)
        .await
        .map_err(pg("read", key))?
    {
        return Err(db::is_a_directory(key));
    }
    Ok(())
}

/// Chunks of `generation` starting in `[from, until)`, whole, or cut to
/// `[start, end)` of the value.
#[allow(clippy::too_many_arguments)]
async fn chunk_rows<C: GenericClient>(
    client: &C,
    sql: &Sql,
    thread: &str,
    generation: i64,
    from: u64,
    until: u64,
    cut: Option<(u64, u64)>,
) -> Result<Vec<(u64, Vec<u8>)>, tokio_postgres::Error> {
    let rows = match cut {
        None => {
            query(
                client,
                &sql.chunks_whole,
                &[&thread, &generation, &int(from), &int(until)],
            )
            .await?
        }
        Some((start, end)) => {
            query(
                client,
                &sql.chunks_cut,
                &[
                    &thread,
                    &generation,
                    &int(from),
                    &int(until),
                    &int(start),
                    &int(end),
                ],
            )
            .await?
        }
    };
    rows.into_iter()
        .map(|r| Ok((uint(r.try_get(0)?), r.try_get(1)?)))
        .collect()
}

enum Ack {
    Piece,
    Done(Result<u64, OffloadError>),
}

impl PostgresStore {
    /// Connects to `url` (a URL or `key=value` pairs) with default
    /// [`PostgresStoreOptions`], and creates or upgrades the tables. TLS follows the
    /// string's `sslmode` as libpq does with the `tls` feature; without it, connections
    /// go without TLS even where the server offers it (unlike `psql`), and a string
    /// that requires TLS is refused (see `keel_postgres_tls`).
    pub fn connect(url: &str) -> Result<Self, OffloadError> {
        Self::connect_with(url, PostgresStoreOptions::default())
    }

    /// [`connect`](Self::connect) for async code: connecting waits on the database (a
    /// connection opened, the tables checked or created), so it runs on tokio's
    /// blocking pool and the caller's runtime thread stays free.
    pub async fn connect_async(url: &str) -> Result<Self, OffloadError> {
        Self::connect_with_async(url, PostgresStoreOptions::default()).await
    }

    /// [`connect_with`](Self::connect_with) for async code, as
    /// [`connect_async`](Self::connect_async).
    ///
    /// ```no_run
    /// use keel_offload::{PostgresStoreOptions, PostgresStore};
    ///
    /// # async fn demo() -> Result<(), keel_offload::OffloadError> {
    /// let options = PostgresStoreOptions::new().schema("agents")?;
    /// let store = PostgresStore::connect_with_async("postgres://keel@localhost/app", options).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_with_async(
        url: &str,
        options: PostgresStoreOptions,
    ) -> Result<Self, OffloadError> {
        let url = url.to_owned();
        tokio::task::spawn_blocking(move || Self::connect_with(&url, options))
            .await
            .unwrap_or_else(|e| {
                Err(OffloadError::database(
                    "connect",
                    "postgres",
                    io::Error::other(format!("the connecting task ended: {e}")),
                ))
            })
    }

    /// Connects to `url` with `options`, and creates or upgrades the tables.
    pub fn connect_with(url: &str, options: PostgresStoreOptions) -> Result<Self, OffloadError> {
        let (mut config, tls) = keel_postgres_tls::ConnectionString::parse(url)
            .map_err(|e| OffloadError::database("connect", "postgres", e))?
            .into_parts();
        if config.get_application_name().is_none() {
            config.application_name("keel-offload");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        if let Some(timeout) = options.statement_timeout {
            let millis = timeout.as_millis().max(1);
            let session = match config.get_options() {
                Some(existing) if !existing.trim().is_empty() => {
                    format!("{existing} -c statement_timeout={millis}")
                }
                _ => format!("-c statement_timeout={millis}"),
            };
            config.options(&session);
        }
        let bridge = Bridge::start()?;
        let connect = BridgeConnect {
            handle: bridge.handle.clone(),
            tls,
            _keep: bridge.jobs.clone(),
        };
        let manager = Manager::from_connect(
            config,
            connect,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(options.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(60)))
            .create_timeout(Some(Duration::from_secs(15)))
            .build()
            .map_err(pg("build the connection pool", "postgres"))?;
        Self::setup(Arc::new(bridge), pool, options.schema)
    }

    /// A store over an existing pool (the checkpointer's, say, or one with a connector of your own), with
    /// the schema of `options`; creates or upgrades the tables. See the type's docs for
    /// where such a pool's connections run.
    pub fn from_pool(pool: Pool, options: PostgresStoreOptions) -> Result<Self, OffloadError> {
        Self::setup(Arc::new(Bridge::start()?), pool, options.schema)
    }

    fn setup(bridge: Arc<Bridge>, pool: Pool, schema: String) -> Result<Self, OffloadError> {
        let (p, s) = (pool.clone(), schema.clone());
        bridge.run(&schema, move || async move { migrate(&p, &s).await })?;
        Ok(PostgresStore {
            bridge,
            pool,
            sql: Arc::new(Sql::new(&schema)),
            schema,
        })
    }

    /// The connection pool: hand it to the checkpointer
    /// (`keel_checkpoint_postgres::PostgresSaver::from_pool`) to share connections.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The schema of the tables.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// Runs `work` with a pooled connection on the connection thread.
    fn with_client<T, F, Fut>(&self, what: String, work: F) -> Result<T, OffloadError>
    where
        T: Send + 'static,
        F: FnOnce(deadpool_postgres::Object, Arc<Sql>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, OffloadError>> + 'static,
    {
        let (pool, sql) = (self.pool.clone(), Arc::clone(&self.sql));
        let shown = what.clone();
        self.bridge.run(&what, move || async move {
            let client = pool
                .get()
                .await
                .map_err(pg("connect to the database", shown))?;
            work(client, sql).await
        })
    }

    /// Writes `text` to `key` (replacing it, or at its end) in one transaction, sent
    /// to the connection thread a chunk at a time. Returns where the text starts.
    fn write(&self, key: &Key, text: &str, replace: bool) -> Result<u64, OffloadError> {
        if !replace
            && text.len() <= CHUNK
            && let Some(start) = self.append_small(key, text)?
        {
            return Ok(start);
        }
        let (pieces_tx, mut pieces) = mpsc::unbounded_channel::<Vec<u8>>();
        let (acks_tx, acks) = std_mpsc::channel::<Ack>();
        let (pool, sql, key2) = (self.pool.clone(), Arc::clone(&self.sql), key.clone());
        let len = int(text.len() as u64);
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let progress = acks_tx.clone();
                let result = async {
                    let key = &key2;
                    let (thread, path) = (key.thread().as_str(), key.path().as_str());
                    let mut client = pool
                        .get()
                        .await
                        .map_err(pg("connect to the database", key))?;
                    let tx = client
                        .transaction()
                        .await
                        .map_err(pg("begin a write", key))?;
                    let fresh = db::new_gen();
                    let (generation, start) = if replace {
                        let inserted =
                            query_opt(&tx, &sql.put_insert, &[&thread, &path, &fresh, &len])
                                .await
                                .map_err(pg("write", key))?;
                        if inserted.is_some() {
                            check_shape(&tx, &sql, key).await?;
                        } else {
                            let row = query_opt(&tx, &sql.lock, &[&thread, &path])
                                .await
                                .map_err(pg("write", key))?
                                .ok_or_else(|| OffloadError::io("write", key, db::changed()))?;
                            let old: i64 = row.try_get(0).map_err(pg("write", key))?;
                            execute(&tx, &sql.drop_generation, &[&thread, &old])
                                .await
                                .map_err(pg("write", key))?;
                            execute(&tx, &sql.set_generation, &[&thread, &path, &fresh, &len])
                                .await
                                .map_err(pg("write", key))?;
                        }
                        (fresh, 0)
                    } else {
                        let row =
                            query_one(&tx, &sql.append_upsert, &[&thread, &path, &fresh, &len])
                                .await
                                .map_err(pg("write", key))?;
                        let generation: i64 = row.try_get(0).map_err(pg("write", key))?;
                        let size: i64 = row.try_get(1).map_err(pg("write", key))?;
                        if generation == fresh {
                            check_shape(&tx, &sql, key).await?;
                        }
                        (generation, size - len)
                    };
                    let insert = tx
                        .prepare_cached(&sql.insert_chunk)
                        .await
                        .map_err(pg("write", key))?;
                    let mut off = start;
                    while let Some(piece) = pieces.recv().await {
                        if piece.is_empty() {
                            tx.commit().await.map_err(pg("commit a write", key))?;
                            return Ok(uint(start));
                        }
                        tx.execute(&insert, &[&thread, &generation, &off, &piece])
                            .await
                            .map_err(pg("write", key))?;
                        off += int(piece.len() as u64);
                        let _ = progress.send(Ack::Piece);
                    }
                    // The caller went away before the end: roll back.
                    Err(gone("write"))
                }
                .await;
                let _ = acks_tx.send(Ack::Done(result));
            })
        });
        self.bridge.jobs.send(job).map_err(|_| gone("write"))?;
        let wait = |acks: &std_mpsc::Receiver<Ack>| acks.recv().map_err(|_| gone("write"));
        let mut queued = 0usize;
        for piece in text.as_bytes().chunks(CHUNK) {
            if pieces_tx.send(piece.to_vec()).is_err() {
                break; // the job ended early: its answer says why
            }
            queued += 1;
            while queued > WINDOW {
                match wait(&acks)? {
                    Ack::Piece => queued -= 1,
                    Ack::Done(result) => return result.and(Err(gone("write"))),
                }
            }
        }
        let _ = pieces_tx.send(Vec::new());
        loop {
            if let Ack::Done(result) = wait(&acks)? {
                return result;
            }
        }
    }

    /// Appends `text` (at most one chunk) in one statement. `None`: the path cannot
    /// hold a file; the transaction of [`write`](Self::write) says why.
    fn append_small(&self, key: &Key, text: &str) -> Result<Option<u64>, OffloadError> {
        let (k, data) = (key.clone(), text.as_bytes().to_vec());
        self.with_client(key.to_string(), move |client, sql| async move {
            let key = &k;
            let (thread, path) = (key.thread().as_str(), key.path().as_str());
            let (len, ancestors, (lo, hi)) = (
                int(data.len() as u64),
                db::ancestors(path),
                db::dir_bounds(path),
            );
            let row = query_opt(
                &client,
                &sql.append_small,
                &[
                    &thread,
                    &path,
                    &db::new_gen(),
                    &len,
                    &data,
                    &ancestors,
                    &lo,
                    &hi,
                ],
            )
            .await
            .map_err(pg("write", key))?;
            let Some(row) = row else { return Ok(None) };
            let size: i64 = row.try_get(1).map_err(pg("write", key))?;
            Ok(Some(uint(size - len)))
        })
    }
}

impl OffloadStore for PostgresStore {
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        self.write(key, text, true)?;
        Ok(text.len() as u64)
    }

    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        self.write(key, text, false)
    }

    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        let k = key.clone();
        let bytes = self.with_client(key.to_string(), move |mut client, sql| async move {
            let key = &k;
            // One repeatable-read snapshot: the value as of one moment, even across
            // many chunk reads.
            let tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(pg("read", key))?;
            let (generation, size) = meta(&tx, &sql, key).await?;
            let thread = key.thread().as_str();
            let mut out = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            let mut pos = 0u64;
            while pos < size {
                let rows = chunk_rows(&tx, &sql, thread, generation, pos, pos + FETCH, None)
                    .await
                    .map_err(pg("read", key))?;
                if rows.is_empty() {
                    return Err(OffloadError::io("read", key, db::changed()));
                }
                db::follow(&mut pos, &rows).map_err(|e| OffloadError::io("read", key, e))?;
                for (_, data) in rows {
                    out.extend_from_slice(&data);
                }
            }
            tx.commit().await.map_err(pg("read", key))?;
            Ok(out)
        })?;
        String::from_utf8(bytes).map_err(|_| OffloadError::NotUtf8 {
            key: key.to_string(),
        })
    }

    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        let k = key.clone();
        let (generation, size) = self
            .with_client(key.to_string(), move |client, sql| async move {
                meta(&client, &sql, &k).await
            })?;
        let store = self.clone();
        let key = key.clone();
        Ok(Box::new(ChunkReader::new(size, move |pos| {
            let k = key.clone();
            store
                .with_client(key.to_string(), move |client, sql| async move {
                    chunk_rows(
                        &client,
                        &sql,
                        k.thread().as_str(),
                        generation,
                        pos,
                        pos + FETCH,
                        None,
                    )
                    .await
                    .map_err(pg("read", &k))
                })
                .map_err(io::Error::other)
        })))
    }

    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
        let k = key.clone();
        self.with_client(key.to_string(), move |mut client, sql| async move {
            let key = &k;
            let tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(pg("read", key))?;
            let (generation, size) = meta(&tx, &sql, key).await?;
            let start = offset.min(size);
            let end = start.saturating_add(len as u64).min(size);
            if start == end {
                return Ok(Vec::new());
            }
            let thread = key.thread().as_str();
            let first: i64 = query_one(&tx, &sql.chunk_start, &[&thread, &generation, &int(start)])
                .await
                .and_then(|r| r.try_get(0))
                .map_err(pg("read", key))?;
            let rows = chunk_rows(
                &tx,
                &sql,
                thread,
                generation,
                uint(first),
                end,
                Some((start, end)),
            )
            .await
            .map_err(pg("read", key))?;
            tx.commit().await.map_err(pg("read", key))?;
            db::join_slices(start, end - start, rows).map_err(|e| OffloadError::io("read", key, e))
        })
    }

    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
        let k = key.clone();
        let found = self.with_client(key.to_string(), move |client, sql| async move {
            meta(&client, &sql, &k).await
        });
        match found {
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
        let (t, u, s) = (thread.clone(), under.cloned(), shown.clone());
        let rows: Vec<(String, i64)> =
            self.with_client(shown.clone(), move |client, sql| async move {
                let thread = t.as_str();
                let rows = match &u {
                    None => query(&client, &sql.list_all, &[&thread]).await,
                    Some(p) => {
                        let (lo, hi) = db::dir_bounds(p.as_str());
                        query(&client, &sql.list_path, &[&thread, &p.as_str(), &lo, &hi]).await
                    }
                }
                .map_err(pg("list", &s))?;
                rows.into_iter()
                    .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                    .collect::<Result<_, tokio_postgres::Error>>()
                    .map_err(pg("list", &s))
            })?;
        if under.is_some() && rows.is_empty() {
            return Err(OffloadError::NotFound { key: shown });
        }
        rows.into_iter()
            .map(|(path, size)| {
                Ok(Entry {
                    path: StorePath::new(path)?,
                    bytes: uint(size),
                })
            })
            .collect()
    }

    fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
        let k = key.clone();
        self.with_client(key.to_string(), move |mut client, sql| async move {
            let key = &k;
            let thread = key.thread().as_str();
            let tx = client
                .transaction()
                .await
                .map_err(pg("begin a delete", key))?;
            let Some(row) = query_opt(&tx, &sql.delete_file, &[&thread, &key.path().as_str()])
                .await
                .map_err(pg("delete", key))?
            else {
                return Ok(false);
            };
            let generation: i64 = row.try_get(0).map_err(pg("delete", key))?;
            execute(&tx, &sql.drop_generation, &[&thread, &generation])
                .await
                .map_err(pg("delete", key))?;
            tx.commit().await.map_err(pg("commit a delete", key))?;
            Ok(true)
        })
    }

    /// Deletes the chunk rows past `len` and shortens the one across it, in one
    /// transaction holding the file's row.
    fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
        let k = key.clone();
        self.with_client(key.to_string(), move |mut client, sql| async move {
            let key = &k;
            let (thread, path) = (key.thread().as_str(), key.path().as_str());
            let tx = client
                .transaction()
                .await
                .map_err(pg("begin a write", key))?;
            let Some(row) = query_opt(&tx, &sql.lock_size, &[&thread, &path])
                .await
                .map_err(pg("truncate", key))?
            else {
                // Not a file: a directory or nothing (`meta` says which).
                return meta(&tx, &sql, key).await.map(|_| false);
            };
            let generation: i64 = row.try_get(0).map_err(pg("truncate", key))?;
            let size: i64 = row.try_get(1).map_err(pg("truncate", key))?;
            if len >= uint(size) {
                return Ok(false);
            }
            let cut = int(len);
            let at = query_opt(&tx, &sql.byte_at, &[&thread, &generation, &cut])
                .await
                .map_err(pg("truncate", key))?
                .map(|r| r.try_get::<_, Vec<u8>>(0))
                .transpose()
                .map_err(pg("truncate", key))?;
            if at
                .and_then(|b| b.first().copied())
                .is_some_and(crate::store::continues_char)
            {
                return Err(crate::store::cut_inside_char(key));
            }
            execute(&tx, &sql.drop_chunks_from, &[&thread, &generation, &cut])
                .await
                .map_err(pg("truncate", key))?;
            execute(&tx, &sql.cut_chunk, &[&thread, &generation, &cut])
                .await
                .map_err(pg("truncate", key))?;
            execute(&tx, &sql.set_size, &[&thread, &path, &cut])
                .await
                .map_err(pg("truncate", key))?;
            tx.commit().await.map_err(pg("commit a truncation", key))?;
            Ok(true)
        })
    }

    /// Deletes the thread's rows of both tables in one transaction.
    fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        let t = thread.clone();
        self.with_client(thread.to_string(), move |mut client, sql| async move {
            let thread = t.as_str();
            let tx = client
                .transaction()
                .await
                .map_err(pg("begin a delete", &t))?;
            execute(&tx, &sql.delete_thread_chunks, &[&thread])
                .await
                .map_err(pg("delete", &t))?;
            let files = execute(&tx, &sql.delete_thread_files, &[&thread])
                .await
                .map_err(pg("delete", &t))?;
            tx.commit().await.map_err(pg("commit a delete", &t))?;
            Ok(files)
        })
    }
}
