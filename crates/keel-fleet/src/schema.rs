//! The queue's tables, versioned.
//!
//! Every table is keyed by `thread_id` first and the per-run statements name the
//! thread, so a distributed PostgreSQL sharding by `thread_id` (Citus) keeps each
//! thread's rows, and every statement about one run, on one shard.

use tokio_postgres::GenericClient;

use crate::error::FleetError;

/// One schema migration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    /// The SQL, with `{s}` standing for the quoted schema name.
    sql: &'static str,
}

/// Every migration this build knows, oldest first.
pub(crate) const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "threads, runs, one running run per thread",
    sql: MIGRATION_1,
}];

/// The queue schema version this build reads and writes.
pub const SCHEMA_VERSION: i32 = 1;

const MIGRATION_1: &str = r#"
-- One row per thread that ever had a run: submit locks it, so submits to one thread
-- are serialized (the busy check and the insert see the same runs) and numbered.
CREATE TABLE {s}.keel_fleet_threads (
    thread_id text   PRIMARY KEY,
    next_seq  bigint NOT NULL
);

-- One row per run. `seq` orders a thread's runs; the lease columns are written by
-- the database clock only (now()), never by a worker's.
CREATE TABLE {s}.keel_fleet_runs (
    thread_id        text        NOT NULL,
    run_id           uuid        NOT NULL,
    seq              bigint      NOT NULL,
    status           text        NOT NULL
        CHECK (status IN ('queued', 'running', 'done', 'failed', 'cancelled')),
    policy           text        NOT NULL,
    input            jsonb       NOT NULL,
    submitted_at     timestamptz NOT NULL DEFAULT now(),
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL,
    worker_id        text,
    lease_token      uuid,
    claimed_at       timestamptz,
    lease_until      timestamptz,
    input_applied    boolean     NOT NULL DEFAULT false,
    cancel_requested boolean     NOT NULL DEFAULT false,
    cancel_reason    text,
    result           jsonb,
    error            text,
    finished_at      timestamptz,
    PRIMARY KEY (thread_id, run_id),
    UNIQUE (thread_id, seq)
);

-- At most one running run per thread, enforced by the database.
CREATE UNIQUE INDEX keel_fleet_one_running ON {s}.keel_fleet_runs (thread_id)
    WHERE status = 'running';
-- The claim's scan: queued runs, oldest first.
CREATE INDEX keel_fleet_queued ON {s}.keel_fleet_runs (submitted_at, seq)
    WHERE status = 'queued';
-- Queue::status(run_id).
CREATE INDEX keel_fleet_run_id ON {s}.keel_fleet_runs (run_id);
"#;

/// `name` as a quoted SQL identifier.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Refuses schema names PostgreSQL would truncate or cannot store.
pub(crate) fn check_schema(schema: &str) -> Result<(), FleetError> {
    if schema.is_empty() || schema.len() > 63 || schema.contains('\0') {
        return Err(FleetError::Config {
            reason: format!(
                "schema name {schema:?} must be 1 to 63 bytes without NUL (PostgreSQL truncates longer names)"
            ),
        });
    }
    Ok(())
}

/// The advisory lock key that serializes migrations of one schema across processes.
fn lock_key(schema: &str) -> i64 {
    // FNV-1a: stable across builds and processes, unlike std's hasher.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in "keel-fleet/migrations/".bytes().chain(schema.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// Applies the migrations `schema` lacks under an advisory lock; returns the versions
/// applied.
pub(crate) async fn migrate<C: GenericClient>(
    client: &mut C,
    schema: &str,
) -> Result<Vec<i32>, FleetError> {
    let s = quote_ident(schema);
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock_key(schema)])
        .await?;
    let exists = tx
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1",
            &[&schema],
        )
        .await?
        .is_some();
    if !exists {
        tx.batch_execute(&format!("CREATE SCHEMA {s}")).await?;
    }
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {s}.keel_fleet_schema (
            version    integer     PRIMARY KEY,
            name       text        NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now()
        )"
    ))
    .await?;
    let found: Option<i32> = tx
        .query_one(
            &format!("SELECT max(version) FROM {s}.keel_fleet_schema"),
            &[],
        )
        .await?
        .get(0);
    if let Some(found) = found
        && found > SCHEMA_VERSION
    {
        return Err(FleetError::SchemaTooNew {
            schema: schema.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS {
        if found.is_some_and(|f| m.version <= f) {
            continue;
        }
        let sql = m.sql.replace("{s}", &s);
        tx.batch_execute(&sql)
            .await
            .map_err(|source| FleetError::Migration {
                version: m.version,
                name: m.name,
                source,
            })?;
        tx.execute(
            &format!("INSERT INTO {s}.keel_fleet_schema (version, name) VALUES ($1, $2)"),
            &[&m.version, &m.name],
        )
        .await?;
        applied.push(m.version);
    }
    tx.commit().await?;
    Ok(applied)
}

/// Checks that `schema` holds exactly this build's version, without changing it.
pub(crate) async fn check<C: GenericClient>(client: &C, schema: &str) -> Result<(), FleetError> {
    let s = quote_ident(schema);
    let table = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{s}.keel_fleet_schema")],
        )
        .await?
        .get::<_, bool>(0);
    if !table {
        return Err(FleetError::NotSetUp {
            schema: schema.to_owned(),
        });
    }
    let found: Option<i32> = client
        .query_one(
            &format!("SELECT max(version) FROM {s}.keel_fleet_schema"),
            &[],
        )
        .await?
        .get(0);
    match found {
        None => Err(FleetError::NotSetUp {
            schema: schema.to_owned(),
        }),
        Some(v) if v < SCHEMA_VERSION => Err(FleetError::SchemaTooOld {
            schema: schema.to_owned(),
            found: v,
            expected: SCHEMA_VERSION,
        }),
        Some(v) if v > SCHEMA_VERSION => Err(FleetError::SchemaTooNew {
            schema: schema.to_owned(),
            found: v,
            supported: SCHEMA_VERSION,
        }),
        Some(_) => Ok(()),
    }
}
