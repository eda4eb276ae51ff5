//! Connection settings and the versioned schema.
//!
//! The schema version lives in SQLite's `user_version`; `application_id` marks the
//! file as keel's. Migrations run in order, each once, inside one `BEGIN IMMEDIATE`
//! transaction on open, so two processes opening a new file at once migrate it once.
//!
//! Every table is keyed by `thread_id` first and nothing joins across threads (a
//! sharded store can take the same layout). The one secondary index, `heads_by_head`,
//! serves the TTL sweep, which looks for threads by age rather than by id.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::error::SqliteError;
use crate::options::SqliteOptions;

/// `application_id` of keel checkpoint files: "keel" in ASCII.
const APPLICATION_ID: i64 = 0x6b65_656c;

/// The schema version this build writes (SQLite's `user_version` in a keel file).
///
/// Opening an older file migrates it to this version; a newer one is refused with
/// [`SqliteError::NewerSchema`].
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Migration `i` brings the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 1: checkpoints, channel deltas stored once, pending writes.
    r#"
    CREATE TABLE checkpoints (
        thread_id     TEXT    NOT NULL,
        ns            TEXT    NOT NULL,
        checkpoint_id TEXT    NOT NULL,
        parent_id     TEXT,
        created_at    INTEGER NOT NULL,
        source        TEXT    NOT NULL,
        step          INTEGER NOT NULL,
        -- JSON: {"channels": channel versions, "seen": versions seen, "sends": pending sends}
        versions      TEXT    NOT NULL,
        -- JSON object: the metadata's extra keys (source and step are columns)
        extra         TEXT    NOT NULL,
        PRIMARY KEY (thread_id, ns, checkpoint_id)
    ) WITHOUT ROWID;

    -- One row per (writer checkpoint, channel), shared by every later checkpoint that
    -- still holds that version. Keyed by writer before channel: a step's deltas sit
    -- together and, as ids grow with time, are appended at the end of the tree, so a
    -- commit touches few pages.
    CREATE TABLE deltas (
        thread_id   TEXT    NOT NULL,
        ns          TEXT    NOT NULL,
        writer      TEXT    NOT NULL,
        channel     TEXT    NOT NULL,
        seq         INTEGER NOT NULL,
        base_writer TEXT,
        base_seq    INTEGER,
        updates     TEXT    NOT NULL, -- JSON array
        snapshot    TEXT,             -- JSON value, or NULL
        PRIMARY KEY (thread_id, ns, writer, channel)
    ) WITHOUT ROWID;

    CREATE TABLE writes (
        thread_id     TEXT    NOT NULL,
        ns            TEXT    NOT NULL,
        checkpoint_id TEXT    NOT NULL,
        task_id       TEXT    NOT NULL,
        channel       TEXT    NOT NULL,
        idx           INTEGER NOT NULL, -- the write's index among its task's writes to its channel in one call
        ord           INTEGER NOT NULL, -- stored order within the checkpoint
        task_path     TEXT    NOT NULL,
        value         TEXT    NOT NULL, -- JSON
        PRIMARY KEY (thread_id, ns, checkpoint_id, task_id, channel, idx)
    ) WITHOUT ROWID;
    "#,
    // 2: each namespace's head, indexed by id, so the TTL sweep (`sweep_idle`) finds
    // idle threads with a range scan instead of reading every thread's checkpoints.
    r#"
    CREATE TABLE heads (
        thread_id TEXT NOT NULL,
        ns        TEXT NOT NULL,
        head      TEXT NOT NULL, -- the newest checkpoint_id of (thread_id, ns)
        PRIMARY KEY (thread_id, ns)
    ) WITHOUT ROWID;
    INSERT INTO heads (thread_id, ns, head)
        SELECT thread_id, ns, max(checkpoint_id) FROM checkpoints GROUP BY thread_id, ns;
    CREATE INDEX heads_by_head ON heads (head);
    "#,
    // 3: checkpoints' `versions` list each writer once (see `store::VersionsRef`).
    // Nothing to change in the tables: rows written before stay readable as they are,
    // and the version number keeps an older build, which cannot read the new rows,
    // from opening the file (`SqliteError::NewerSchema`).
    r#"
    -- no table changes
    "#,
];

/// Opens the writer connection: creates the file if needed, switches it to WAL mode,
/// and migrates the schema.
///
/// Several processes may open a new file at once. Switching the journal mode can fail
/// at once with "database is locked" while another connection holds the file (SQLite
/// does not always wait on its busy handler there, to avoid a deadlock), so the whole
/// opening is retried until the busy timeout has passed.
pub(crate) fn open_writer(path: &Path, options: &SqliteOptions) -> Result<Connection, SqliteError> {
    let deadline = std::time::Instant::now() + options.busy_timeout;
    loop {
        match try_open_writer(path, options) {
            Err(e) if e.is_busy() && std::time::Instant::now() < deadline => {
                // A dedicated database thread: sleeping blocks no async task.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            result => return result,
        }
    }
}

fn try_open_writer(path: &Path, options: &SqliteOptions) -> Result<Connection, SqliteError> {
    let conn = Connection::open(path)?;
    configure(&conn, options)?;
    let mode: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SqliteError::NoWal {
            path: path.to_owned(),
            mode,
        });
    }
    if let Some(bytes) = options.max_size {
        limit_size(&conn, bytes)?;
    }
    let mut conn = conn;
    migrate(&mut conn, path)?;
    Ok(conn)
}

/// Opens a reader connection on a file the writer has opened.
pub(crate) fn open_reader(path: &Path, options: &SqliteOptions) -> Result<Connection, SqliteError> {
    let conn = open_checkpointer(path, options)?;
    conn.pragma_update(None, "query_only", true)?;
    Ok(conn)
}

/// Opens the connection that copies the write-ahead log into the file in the background
/// (`crate::wal`), on a file the writer has opened: a reader's, writes allowed.
pub(crate) fn open_checkpointer(
    path: &Path,
    options: &SqliteOptions,
) -> Result<Connection, SqliteError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    configure(&conn, options)?;
    Ok(conn)
}

/// Opens a private in-memory database (no WAL: one connection does everything).
pub(crate) fn open_memory(options: &SqliteOptions) -> Result<Connection, SqliteError> {
    let mut conn = Connection::open_in_memory()?;
    configure(&conn, options)?;
    if let Some(bytes) = options.max_size {
        limit_size(&conn, bytes)?;
    }
    migrate(&mut conn, Path::new(":memory:"))?;
    Ok(conn)
}

fn configure(conn: &Connection, options: &SqliteOptions) -> Result<(), SqliteError> {
    conn.busy_timeout(options.busy_timeout)?;
    conn.pragma_update(None, "synchronous", options.synchronous.as_str())?;
    conn.pragma_update(None, "foreign_keys", false)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(())
}

fn limit_size(conn: &Connection, bytes: u64) -> Result<(), SqliteError> {
    let page_size: i64 = conn.pragma_query_value(None, "page_size", |r| r.get(0))?;
    let pages = bytes / u64::try_from(page_size.max(1)).unwrap_or(4096);
    let pages = i64::try_from(pages.max(1)).unwrap_or(i64::MAX);
    let _: i64 = conn.pragma_update_and_check(None, "max_page_count", pages, |r| r.get(0))?;
    Ok(())
}

/// Brings the schema to [`SCHEMA_VERSION`]; a no-op when it is there already.
fn migrate(conn: &mut Connection, path: &Path) -> Result<(), SqliteError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let app: i64 = tx.pragma_query_value(None, "application_id", |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(SqliteError::NewerSchema {
            path: path.to_owned(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if app != 0 && app != APPLICATION_ID {
        return Err(SqliteError::ForeignDatabase {
            path: path.to_owned(),
            reason: format!("its application_id is {app:#x}"),
        });
    }
    if version == 0 {
        // keel-offload's `SqliteStore` may have made its own tables in this file first
        // (`keel_offload_*`, with their own version table): those are keel's too.
        let tables: i64 = tx.query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'keel\\_offload\\_%' ESCAPE '\\'",
            [],
            |r| r.get(0),
        )?;
        if tables > 0 {
            return Err(SqliteError::ForeignDatabase {
                path: path.to_owned(),
                reason: format!("it has {tables} tables but no keel schema version"),
            });
        }
        tx.pragma_update(None, "application_id", APPLICATION_ID)?;
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    let from = usize::try_from(version).unwrap_or(0);
    for sql in MIGRATIONS.iter().skip(from) {
        tx.execute_batch(sql)?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()?;
    Ok(())
}
