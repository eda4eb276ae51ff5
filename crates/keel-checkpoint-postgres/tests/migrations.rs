//! Migrations: idempotent, safe from many processes at once, safe inside or outside a
//! transaction, refuse a newer schema, and a saver without them says what to do.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use keel_checkpoint::{CheckpointError, Checkpointer, ThreadKey};
use keel_checkpoint_postgres::{MIGRATIONS, PostgresConfig, PostgresError, PostgresSaver, migrate};

fn all() -> Vec<i32> {
    MIGRATIONS.iter().map(|m| m.version).collect()
}

async fn versions(client: &tokio_postgres::Client, schema: &str) -> Vec<i32> {
    client
        .query(
            &format!("SELECT version FROM \"{schema}\".keel_migrations ORDER BY version"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_setup_applies_each_migration_once() {
    let Some(url) = common::database_url("concurrent_setup") else {
        return;
    };
    let schema = common::fresh_schema("concurrent_setup");
    let config = PostgresConfig::new(&url)
        .unwrap()
        .schema(schema.clone())
        .unwrap();
    // Eight "processes", each with its own pool, racing to set up one empty schema.
    let savers: Vec<PostgresSaver> = (0..8)
        .map(|_| PostgresSaver::connect(&config).unwrap())
        .collect();
    let results = futures::future::join_all(savers.iter().map(|s| s.setup())).await;
    let applied: Vec<Vec<i32>> = results.into_iter().map(Result::unwrap).collect();
    let all: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(
        applied.iter().filter(|a| **a == all).count(),
        1,
        "{applied:?}"
    );
    assert_eq!(
        applied.iter().filter(|a| a.is_empty()).count(),
        7,
        "{applied:?}"
    );
    // Idempotent afterwards.
    assert!(savers[0].setup().await.unwrap().is_empty());
    let db = common::TestDb {
        url,
        schema,
        config,
        saver: savers[0].clone(),
    };
    assert_eq!(versions(&db.client().await, &db.schema).await, all);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_inside_a_transaction_follows_it() {
    let Some(url) = common::database_url("migrate_in_tx") else {
        return;
    };
    let schema = common::fresh_schema("migrate_in_tx");
    let config = PostgresConfig::new(&url)
        .unwrap()
        .schema(schema.clone())
        .unwrap();
    let saver = PostgresSaver::connect(&config).unwrap();
    let db = common::TestDb {
        url,
        schema: schema.clone(),
        config,
        saver,
    };
    let mut client = db.client().await;

    // Rolled back with the caller's transaction: nothing remains.
    let mut tx = client.transaction().await.unwrap();
    assert_eq!(migrate(&mut tx, &schema).await.unwrap(), all());
    tx.rollback().await.unwrap();
    let exists: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!exists, "a rolled-back migration left the schema behind");

    // Committed with it: the tables are there and usable.
    let mut tx = client.transaction().await.unwrap();
    tx.batch_execute("CREATE TEMP TABLE caller_work (x int)")
        .await
        .unwrap();
    assert_eq!(migrate(&mut tx, &schema).await.unwrap(), all());
    tx.commit().await.unwrap();
    assert_eq!(versions(&client, &schema).await, all());
    // Outside a transaction, up to date: nothing to do.
    assert!(migrate(&mut client, &schema).await.unwrap().is_empty());
    assert!(
        db.saver
            .get(&ThreadKey::new("t"), None)
            .await
            .unwrap()
            .is_none()
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_schema_is_refused_and_missing_tables_are_explained() {
    let Some(db) = common::saver("schema_versions").await else {
        return;
    };
    let client = db.client().await;
    client
        .execute(
            &format!(
                "INSERT INTO \"{}\".keel_migrations (version, name) VALUES (9999, 'future')",
                db.schema
            ),
            &[],
        )
        .await
        .unwrap();
    match db.saver.setup().await {
        Err(PostgresError::SchemaTooNew { found: 9999, .. }) => {}
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }

    // A saver on a schema nobody set up.
    let config = PostgresConfig::new(&db.url)
        .unwrap()
        .schema("keel_never_set_up")
        .unwrap();
    let bare = PostgresSaver::connect(&config).unwrap();
    match bare.get(&ThreadKey::new("t"), None).await {
        Err(CheckpointError::Backend(e)) => {
            let text = e.to_string();
            assert!(text.contains("call PostgresSaver::setup() first"), "{text}");
            assert!(matches!(
                e.downcast_ref::<PostgresError>(),
                Some(PostgresError::NotSetUp { .. })
            ));
        }
        other => panic!("expected a NotSetUp backend error, got {other:?}"),
    }
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_clear_backend_error() {
    // No server listens on port 1; nothing here needs DATABASE_URL.
    let config = PostgresConfig::new("postgres://keel@127.0.0.1:1/none").unwrap();
    let saver = PostgresSaver::connect(&config).unwrap();
    match saver.get(&ThreadKey::new("t"), None).await {
        Err(CheckpointError::Backend(e)) => {
            let text = e.to_string();
            assert!(text.contains("no Postgres connection"), "{text}");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert!(matches!(saver.setup().await, Err(PostgresError::Pool(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_schema_gets_the_heads_index() {
    let Some(db) = common::saver("migrate_v1").await else {
        return;
    };
    let client = db.client().await;
    let s = format!("\"{}\"", db.schema);
    // The schema as version 1 left it.
    client
        .batch_execute(&format!(
            "DROP INDEX {s}.keel_heads_head; DELETE FROM {s}.keel_migrations WHERE version > 1"
        ))
        .await
        .unwrap();
    assert_eq!(db.saver.setup().await.unwrap(), vec![2, 3, 4]);
    assert_eq!(versions(&client, &db.schema).await, all());
    let index: Option<String> = client
        .query_opt(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'keel_heads_head'",
            &[&db.schema],
        )
        .await
        .unwrap()
        .map(|r| r.get(0));
    assert!(
        index.as_deref().is_some_and(|d| d.ends_with("(head)")),
        "{index:?}"
    );
    db.drop_schema().await;
}

/// The definition of the schema's `keel_put`.
async fn keel_put_definition(client: &tokio_postgres::Client, schema: &str) -> String {
    client
        .query_one(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p \
             JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = $1 AND p.proname = 'keel_put'",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0)
}

/// A schema with version 1's `keel_put` (the head row locked with `SELECT ... FOR
/// UPDATE` and moved last) gets migration 3's, and the whole conformance suite
/// (fencing, racing writers, invalid puts, batches) passes on the upgraded schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_schema_gets_the_new_keel_put_and_passes_the_suite() {
    let Some(db) = common::saver("migrate_v2").await else {
        return;
    };
    let client = db.client().await;
    let v1 = MIGRATIONS[0].sql(&db.schema);
    let function = v1
        .find("CREATE FUNCTION")
        .map(|at| v1[at..].replacen("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
        .unwrap();
    client
        .batch_execute(&format!(
            "{function}\nDELETE FROM \"{}\".keel_migrations WHERE version > 2",
            db.schema
        ))
        .await
        .unwrap();
    assert!(
        keel_put_definition(&client, &db.schema)
            .await
            .contains("FOR UPDATE")
    );
    assert_eq!(db.saver.setup().await.unwrap(), vec![3, 4]);
    assert_eq!(versions(&client, &db.schema).await, all());
    let upgraded = keel_put_definition(&client, &db.schema).await;
    assert!(!upgraded.contains("FOR UPDATE"), "{upgraded}");
    assert!(upgraded.contains("IF NOT FOUND"), "{upgraded}");
    let shared: std::sync::Arc<dyn Checkpointer> = std::sync::Arc::new(db.saver.clone());
    keel_checkpoint::conformance::run_all(|| {
        let shared = std::sync::Arc::clone(&shared);
        async move { shared }
    })
    .await;
    db.drop_schema().await;
}

/// Whether the server can compress TOAST values with lz4 (PostgreSQL 14 or newer,
/// built with it).
async fn server_has_lz4(client: &tokio_postgres::Client) -> bool {
    client
        .query_opt(
            "SELECT 1 FROM pg_settings \
             WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)",
            &[],
        )
        .await
        .unwrap()
        .is_some()
}

/// The compression set on each large value column, as `pg_attribute` spells it
/// (`l` for lz4, empty for the server's default).
async fn column_compression(client: &tokio_postgres::Client, schema: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (table, column) in [
        ("keel_deltas", "updates"),
        ("keel_deltas", "snapshot"),
        ("keel_writes", "value"),
    ] {
        let row = client
            .query_one(
                "SELECT a.attcompression::text FROM pg_attribute a \
                 JOIN pg_class c ON c.oid = a.attrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3",
                &[&schema, &table, &column],
            )
            .await
            .unwrap();
        out.push(row.get(0));
    }
    out
}

/// A version-3 schema gets migration 4: its large value columns compress with lz4 when
/// the server has it (new values are stored so), and stay as they were when it has not,
/// the migration recorded either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_3_schema_compresses_new_values_with_lz4_where_the_server_can() {
    let Some(db) = common::saver("migrate_v3").await else {
        return;
    };
    let client = db.client().await;
    let s = format!("\"{}\"", db.schema);
    // The schema as version 3 left it.
    client
        .batch_execute(&format!(
            "ALTER TABLE {s}.keel_deltas
                 ALTER COLUMN updates SET COMPRESSION DEFAULT,
                 ALTER COLUMN snapshot SET COMPRESSION DEFAULT;
             ALTER TABLE {s}.keel_writes ALTER COLUMN value SET COMPRESSION DEFAULT;
             DELETE FROM {s}.keel_migrations WHERE version > 3"
        ))
        .await
        .unwrap();
    assert_eq!(column_compression(&client, &db.schema).await, ["", "", ""]);
    assert_eq!(db.saver.setup().await.unwrap(), vec![4]);
    assert_eq!(versions(&client, &db.schema).await, all());
    let lz4 = server_has_lz4(&client).await;
    let expected = if lz4 { "l" } else { "" };
    assert_eq!(
        column_compression(&client, &db.schema).await,
        [expected; 3],
        "server has lz4: {lz4}"
    );
    // A large value written now is stored compressed with the column's method.
    let big = serde_json::to_string(&"the same words again ".repeat(500)).unwrap();
    client
        .execute(
            &format!(
                "INSERT INTO {s}.keel_writes \
                 (checkpoint_id, idx, thread_id, ns, task_id, channel, task_path, value) \
                 VALUES (gen_random_uuid(), 0, 't', '', 'task', 'c', 'p', $1::text::json)"
            ),
            &[&big],
        )
        .await
        .unwrap();
    let method: Option<String> = client
        .query_one(
            &format!(
                "SELECT pg_column_compression(value) FROM {s}.keel_writes WHERE thread_id = 't'"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(method.as_deref(), Some(if lz4 { "lz4" } else { "pglz" }));
    db.drop_schema().await;
}
