//! Versioned migrations.
//!
//! Every table is keyed by `thread_id` first and no statement joins rows of two
//! threads, so a distributed PostgreSQL that shards by `thread_id` (Citus) takes the
//! schema unchanged.

use tokio_postgres::GenericClient;

use crate::config::{check_schema, quote_ident};
use crate::error::PostgresError;

/// One schema migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Its version; migrations apply in increasing order, each once.
    pub version: i32,
    /// A short description.
    pub name: &'static str,
    /// The SQL, with `{s}` standing for the quoted schema name.
    sql: &'static str,
    /// What the server must have for the SQL to apply; without it the migration is
    /// recorded as applied and changes nothing.
    needs: Option<Needs>,
}

/// A server capability a migration depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// LZ4 compression of TOAST values: PostgreSQL 14 or newer, built with lz4.
    Lz4,
}

impl Needs {
    /// Whether the server `client` talks to has it.
    async fn met<C: GenericClient>(self, client: &C) -> Result<bool, tokio_postgres::Error> {
        match self {
            // `default_toast_compression` exists from PostgreSQL 14 on, and lists lz4
            // among its values only when the server was built with it.
            Needs::Lz4 => Ok(client
                .query_opt(
                    "SELECT 1 FROM pg_catalog.pg_settings \
                     WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)",
                    &[],
                )
                .await?
                .is_some()),
        }
    }
}

impl Migration {
    /// The migration's SQL for `schema`.
    pub fn sql(&self, schema: &str) -> String {
        self.sql.replace("{s}", &quote_ident(schema))
    }
}

/// Every migration this build knows, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "checkpoints, channel deltas, pending writes, heads, keel_put",
        sql: MIGRATION_1,
        needs: None,
    },
    Migration {
        version: 2,
        name: "keel_heads indexed by head, for the TTL sweep",
        sql: MIGRATION_2,
        needs: None,
    },
    Migration {
        version: 3,
        name: "keel_put moves the head with the UPDATE that checks it",
        sql: MIGRATION_3,
        needs: None,
    },
    Migration {
        version: 4,
        name: "channel values compressed with lz4 where the server has it",
        sql: MIGRATION_4,
        needs: Some(Needs::Lz4),
    },
];

/// `keel_put`'s signature and its first step, the same in every version: a thread's
/// first put (no expected head) makes its head row.
macro_rules! keel_put_signature {
    () => {
        r#"{s}.keel_put(
    p_thread text, p_ns text, p_id uuid, p_parent uuid, p_created_at bigint,
    p_metadata jsonb, p_versions json, p_versions_seen json, p_pending_sends json,
    p_expected uuid,
    d_channel text[], d_seq bigint[], d_base_writer uuid[], d_base_seq bigint[],
    d_updates json[], d_snapshot json[],
    r_channel text[], r_writer uuid[], r_seq bigint[]
) RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    v_head uuid;
BEGIN
    IF p_expected IS NULL THEN
        INSERT INTO {s}.keel_heads (thread_id, ns, head) VALUES (p_thread, p_ns, NULL)
        ON CONFLICT (thread_id, ns) DO NOTHING;
    END IF;
"#
    };
}

/// `keel_put`'s checks of the versions the request refers to, and its inserts: the same
/// in every version.
macro_rules! keel_put_inserts {
    () => {
        r#"    -- One primary-key lookup per referenced version (a join could be planned as a
    -- scan of the whole thread's deltas).
    FOR i IN 1 .. coalesce(cardinality(r_channel), 0) LOOP
        PERFORM 1 FROM {s}.keel_deltas d
        WHERE d.thread_id = p_thread AND d.ns = p_ns
          AND d.channel = r_channel[i] AND d.writer = r_writer[i] AND d.seq = r_seq[i];
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'KL422',
                MESSAGE = format('channel %s: version %s by %s is not stored',
                                 to_json(r_channel[i]), r_seq[i], r_writer[i]);
        END IF;
    END LOOP;
    INSERT INTO {s}.keel_deltas
        (thread_id, ns, channel, writer, seq, base_writer, base_seq, updates, snapshot)
    SELECT p_thread, p_ns, d.channel, p_id, d.seq, d.base_writer, d.base_seq, d.updates, d.snapshot
    FROM unnest(d_channel, d_seq, d_base_writer, d_base_seq, d_updates, d_snapshot)
        AS d(channel, seq, base_writer, base_seq, updates, snapshot);
    INSERT INTO {s}.keel_checkpoints
        (thread_id, ns, checkpoint_id, parent, created_at, metadata, versions,
         versions_seen, pending_sends)
    VALUES (p_thread, p_ns, p_id, p_parent, p_created_at, p_metadata, p_versions,
            p_versions_seen, p_pending_sends);
"#
    };
}

const MIGRATION_1: &str = concat!(
    r#"
-- One row per (thread, namespace): its newest checkpoint. `put` locks this row and
-- compares `head` with the writer's expected head (fencing).
CREATE TABLE {s}.keel_heads (
    thread_id  text        NOT NULL,
    ns         text        NOT NULL,
    head       uuid,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (thread_id, ns)
);

-- Checkpoints without channel values. `versions` maps each channel to its version:
-- a bare seq when this checkpoint wrote it, else [seq, "writer id"].
CREATE TABLE {s}.keel_checkpoints (
    created_at    bigint NOT NULL,
    checkpoint_id uuid   NOT NULL,
    parent        uuid,
    thread_id     text   NOT NULL,
    ns            text   NOT NULL,
    metadata      jsonb  NOT NULL,
    versions      json   NOT NULL,
    versions_seen json,
    pending_sends json,
    PRIMARY KEY (thread_id, ns, checkpoint_id)
);

-- What each step wrote to each channel, stored once and shared by later checkpoints.
CREATE TABLE {s}.keel_deltas (
    seq         bigint NOT NULL,
    base_seq    bigint,
    writer      uuid   NOT NULL,
    base_writer uuid,
    thread_id   text   NOT NULL,
    ns          text   NOT NULL,
    channel     text   NOT NULL,
    updates     json   NOT NULL,
    snapshot    json,
    -- Keyed by (thread, ns, channel, writer); the writer (a UUID v7, increasing) comes
    -- before the channel so a thread's new deltas append at the end of the index.
    PRIMARY KEY (thread_id, ns, writer, channel)
);

-- Tasks' writes saved before their step's checkpoint; `ord` keeps stored order.
CREATE TABLE {s}.keel_writes (
    ord           bigint  GENERATED ALWAYS AS IDENTITY,
    checkpoint_id uuid    NOT NULL,
    idx           integer NOT NULL,
    thread_id     text    NOT NULL,
    ns            text    NOT NULL,
    task_id       text    NOT NULL,
    channel       text    NOT NULL,
    task_path     text    NOT NULL,
    value         json    NOT NULL,
    PRIMARY KEY (thread_id, ns, checkpoint_id, task_id, channel, idx)
);

-- Stores one checkpoint and its deltas if the thread's head is still p_expected.
-- Runs as one statement: everything or nothing. Each query inside sees a fresh
-- snapshot, taken after the head row is locked.
CREATE FUNCTION "#,
    keel_put_signature!(),
    r#"    SELECT h.head INTO v_head FROM {s}.keel_heads h
    WHERE h.thread_id = p_thread AND h.ns = p_ns
    FOR UPDATE;
    IF v_head IS DISTINCT FROM p_expected THEN
        RAISE EXCEPTION USING ERRCODE = 'KL409',
            MESSAGE = 'stale writer: the thread''s head is not the expected one',
            DETAIL = coalesce(v_head::text, '');
    END IF;
    IF v_head IS NOT NULL AND p_id <= v_head THEN
        RAISE EXCEPTION USING ERRCODE = 'KL422',
            MESSAGE = format('checkpoint id %s does not sort after the head %s', p_id, v_head);
    END IF;
"#,
    keel_put_inserts!(),
    r#"    UPDATE {s}.keel_heads SET head = p_id, updated_at = now()
    WHERE thread_id = p_thread AND ns = p_ns;
END
$fn$;
"#
);

const MIGRATION_2: &str = r#"
-- `sweep_idle` reads the heads older than its cutoff as a range of this index (head
-- ids are UUID v7, so id order is time order) instead of scanning every head. Built
-- under the migration's transaction: puts wait while it builds (one row per thread
-- and namespace).
CREATE INDEX keel_heads_head ON {s}.keel_heads (head);
"#;

const MIGRATION_3: &str = concat!(
    r#"
-- keel_put moves the head with the UPDATE that checks it, instead of locking the row
-- with SELECT ... FOR UPDATE first and updating it last: one statement and one
-- row-lock WAL record less per put. The UPDATE locks the row as the SELECT did, a
-- concurrent put waits for it and then finds the head moved, and an error later in the
-- function undoes the UPDATE with everything else.
CREATE OR REPLACE FUNCTION "#,
    keel_put_signature!(),
    r#"    UPDATE {s}.keel_heads h SET head = p_id, updated_at = now()
    WHERE h.thread_id = p_thread AND h.ns = p_ns
      AND h.head IS NOT DISTINCT FROM p_expected
      AND (p_expected IS NULL OR p_id > p_expected);
    IF NOT FOUND THEN
        SELECT h.head INTO v_head FROM {s}.keel_heads h
        WHERE h.thread_id = p_thread AND h.ns = p_ns;
        IF v_head IS DISTINCT FROM p_expected THEN
            RAISE EXCEPTION USING ERRCODE = 'KL409',
                MESSAGE = 'stale writer: the thread''s head is not the expected one',
                DETAIL = coalesce(v_head::text, '');
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'KL422',
            MESSAGE = format('checkpoint id %s does not sort after the head %s', p_id, v_head);
    END IF;
"#,
    keel_put_inserts!(),
    r#"END
$fn$;
"#
);

const MIGRATION_4: &str = r#"
-- Values over about 2 kB are compressed when stored. lz4 compresses them several times
-- faster than pglz, PostgreSQL's default, and `keel_put` spent about a fifth of its
-- time in pglz; the price is slightly larger values. This changes how new values are
-- stored: rows written before stay as they are and read the same. Only the catalog
-- changes, under a brief exclusive lock on the two tables (puts and reads wait for
-- it). Skipped (recorded, nothing changed) on a server without lz4.
ALTER TABLE {s}.keel_deltas
    ALTER COLUMN updates SET COMPRESSION lz4,
    ALTER COLUMN snapshot SET COMPRESSION lz4;
ALTER TABLE {s}.keel_writes ALTER COLUMN value SET COMPRESSION lz4;
"#;

/// The advisory lock key that serializes migrations of one schema across processes.
fn lock_key(schema: &str) -> i64 {
    let hash = fnv1a(
        "keel-checkpoint-postgres/migrations/"
            .bytes()
            .chain(schema.bytes()),
    );
    i64::from_ne_bytes(hash.to_ne_bytes())
}

/// FNV-1a: stable across builds and processes, unlike std's hasher.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The newest migration recorded in `schema` (`None` without keel's tables), or
/// [`PostgresError::SchemaTooNew`] past what this build knows. Reads only.
pub(crate) async fn applied_version<C: GenericClient>(
    client: &C,
    schema: &str,
) -> Result<Option<i32>, PostgresError> {
    check_schema(schema)?;
    let table = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = 'keel_migrations'",
            &[&schema],
        )
        .await?;
    if table.is_none() {
        return Ok(None);
    }
    let s = quote_ident(schema);
    let found: Option<i32> = client
        .query_one(
            &format!("SELECT max(version) FROM {s}.keel_migrations"),
            &[],
        )
        .await?
        .get(0);
    let known = MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0);
    match found {
        Some(found) if found > known => Err(PostgresError::SchemaTooNew {
            schema: schema.to_owned(),
            found,
            known,
        }),
        found => Ok(found),
    }
}

/// Applies every migration `schema` lacks, in order, and records each in
/// `<schema>.keel_migrations`; returns the versions applied (empty when up to date).
///
/// Safe to call from several processes at once: a transaction-scoped advisory lock
/// (per schema) lets one migrate while the others wait and then find nothing to do.
/// Safe inside or outside a transaction: given a plain client it runs in its own
/// transaction; given a [`tokio_postgres::Transaction`] it runs in a savepoint of it,
/// and the lock is held until that outer transaction ends. Fails with
/// [`PostgresError::SchemaTooNew`] if the schema has migrations this build does not
/// know.
///
/// A migration that needs something of the server (migration 4 needs lz4, PostgreSQL
/// 14 or newer built with it) changes nothing on a server without it, and is recorded
/// all the same: it only tunes storage.
///
/// ```no_run
/// # async fn demo(client: &mut tokio_postgres::Client) -> Result<(), keel_checkpoint_postgres::PostgresError> {
/// // Inside the application's own transaction:
/// let mut tx = client.transaction().await?;
/// keel_checkpoint_postgres::migrate(&mut tx, "public").await?;
/// tx.commit().await?;
/// # Ok(())
/// # }
/// ```
pub async fn migrate<C: GenericClient>(
    client: &mut C,
    schema: &str,
) -> Result<Vec<i32>, PostgresError> {
    check_schema(schema)?;
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
        "CREATE TABLE IF NOT EXISTS {s}.keel_migrations (
            version    integer     PRIMARY KEY,
            name       text        NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now()
        )"
    ))
    .await?;
    let applied: Vec<i32> = tx
        .query(&format!("SELECT version FROM {s}.keel_migrations"), &[])
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let known = MIGRATIONS.iter().map(|m| m.version).max().unwrap_or(0);
    if let Some(&found) = applied.iter().max()
        && found > known
    {
        return Err(PostgresError::SchemaTooNew {
            schema: schema.to_owned(),
            found,
            known,
        });
    }
    let mut done = Vec::new();
    for migration in MIGRATIONS {
        if applied.contains(&migration.version) {
            continue;
        }
        let failed = |source| PostgresError::Migration {
            version: migration.version,
            name: migration.name,
            source,
        };
        let applies = match migration.needs {
            Some(needs) => needs.met(&tx).await.map_err(failed)?,
            None => true,
        };
        if applies {
            tx.batch_execute(&migration.sql(schema))
                .await
                .map_err(failed)?;
        }
        tx.execute(
            &format!("INSERT INTO {s}.keel_migrations (version, name) VALUES ($1, $2)"),
            &[&migration.version, &migration.name],
        )
        .await
        .map_err(failed)?;
        done.push(migration.version);
    }
    tx.commit().await?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_ordered_and_schema_qualified() {
        let versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
        let mut sorted = versions.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(versions, sorted);
        let sql = MIGRATIONS[0].sql(r#"odd"name"#);
        assert!(sql.contains(r#""odd""name".keel_checkpoints"#));
        assert!(!sql.contains("{s}"));
    }

    /// A schema that applied a migration never runs it again, so a migration's text is
    /// history: a change belongs in a new migration. Checksums of each migration's SQL
    /// for the schema `public`.
    #[test]
    fn applied_migrations_never_change() {
        let sums: Vec<(i32, u64)> = MIGRATIONS
            .iter()
            .map(|m| (m.version, fnv1a(m.sql("public").bytes())))
            .collect();
        assert_eq!(
            sums,
            [
                (1, 0x5b36_ff98_b03f_908a),
                (2, 0xdf5c_0ce5_02ec_8f88),
                (3, 0x808d_1b94_97f6_ef4a),
                (4, 0x14dd_dca4_ec32_3e53),
            ]
        );
    }

    #[test]
    fn lock_keys_differ_per_schema_and_are_stable() {
        assert_eq!(lock_key("public"), lock_key("public"));
        assert_ne!(lock_key("public"), lock_key("other"));
    }
}
