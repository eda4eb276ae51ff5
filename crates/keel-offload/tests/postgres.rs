//! `PostgresStore` against a real server: the conformance suite, rows after
//! `delete_thread`, a newer schema refused, concurrent setups, one pool shared with
//! the checkpointer, and calls from every kind of thread (a plain thread, tokio's
//! blocking pool, straight from async code on a multi-thread and a current-thread
//! runtime).
//!
//! Each test works in a fresh schema it drops afterwards. Without `DATABASE_URL` a
//! test prints why it is skipped, except under `CI=true`, where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_offload::{
    Archive, Key, OffloadError, OffloadStore, PostgresStore, PostgresStoreOptions, ThreadId,
    conformance,
};

fn database_url(test: &str) -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("{test}: CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("{test}: skipped: {reason}");
            None
        }
    }
}

static SCHEMAS: AtomicU64 = AtomicU64::new(0);

/// A schema name no other test (in this process or another) uses.
fn fresh_schema(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let n = SCHEMAS.fetch_add(1, Ordering::Relaxed);
    format!(
        "keel_offload_test_{}_{:x}_{}_{n}",
        test.chars().take(16).collect::<String>(),
        nanos & 0xffff_ffff,
        std::process::id()
    )
}

/// A test's database: its URL and fresh schema, dropped at the end.
struct Db {
    url: String,
    schema: String,
}

impl Db {
    fn new(test: &str) -> Option<Db> {
        Some(Db {
            url: database_url(test)?,
            schema: fresh_schema(test),
        })
    }

    fn store(&self) -> PostgresStore {
        PostgresStore::connect_with(
            &self.url,
            PostgresStoreOptions::new()
                .schema(self.schema.clone())
                .unwrap()
                .pool_size(4),
        )
        .unwrap()
    }

    /// Runs SQL on a plain connection (its own small runtime).
    fn query_i64(&self, sql: &str, params: &[&str]) -> i64 {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (client, conn) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                .iter()
                .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            let sql = sql.replace("{s}", &format!("\"{}\"", self.schema));
            match client.query_opt(sql.as_str(), &params).await.unwrap() {
                Some(row) => row.try_get::<_, i64>(0).unwrap_or(0),
                None => 0,
            }
        })
    }

    fn execute(&self, sql: &str) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (client, conn) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = conn.await;
            });
            let sql = sql.replace("{s}", &format!("\"{}\"", self.schema));
            client.batch_execute(&sql).await.unwrap();
        });
    }

    fn rows(&self, thread: &str) -> (i64, i64) {
        (
            self.query_i64(
                "SELECT count(*) FROM {s}.keel_offload_files WHERE thread_id = $1",
                &[thread],
            ),
            self.query_i64(
                "SELECT count(*) FROM {s}.keel_offload_chunks WHERE thread_id = $1",
                &[thread],
            ),
        )
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.execute("DROP SCHEMA IF EXISTS {s} CASCADE");
        }
    }
}

#[test]
fn postgres_keeps_the_contract() {
    let Some(db) = Db::new("contract") else {
        return;
    };
    conformance::run_all(&Arc::new(db.store()));
}

#[test]
fn delete_thread_leaves_no_rows() {
    let Some(db) = Db::new("delete_thread") else {
        return;
    };
    let store = db.store();
    let big: String = (0..100_000)
        .map(|i| format!("line {i} of a long result\n"))
        .collect();
    assert!(big.len() > 2 << 20);
    store
        .put(
            &Key::new("doomed", "large_tool_results/call_1").unwrap(),
            &big,
        )
        .unwrap();
    for i in 0..10 {
        store
            .append(
                &Key::new("doomed", "archive/messages.jsonl").unwrap(),
                &format!("{{\"seq\":{i}}}\n"),
            )
            .unwrap();
    }
    store
        .put(&Key::new("other", "notes").unwrap(), "kept")
        .unwrap();
    assert_eq!(
        db.rows("doomed"),
        (2, 3 + 10),
        "a 2+ MB value in 1 MiB chunks plus one row per append"
    );
    // A put that replaces a value drops the old chunks.
    store
        .put(
            &Key::new("doomed", "large_tool_results/call_1").unwrap(),
            "short",
        )
        .unwrap();
    assert_eq!(db.rows("doomed"), (2, 11));
    // A failed write leaves nothing behind: a file under a file is refused.
    assert!(
        store
            .put(&Key::new("other", "notes/inner").unwrap(), &big)
            .is_err()
    );
    assert_eq!(db.rows("other"), (1, 1));

    assert_eq!(
        store
            .delete_thread(&ThreadId::new("doomed").unwrap())
            .unwrap(),
        2
    );
    assert_eq!(db.rows("doomed"), (0, 0));
    assert_eq!(db.rows("other"), (1, 1));
}

#[test]
fn forks_and_their_collection_leave_only_the_rows_a_live_lineage_reads() {
    let Some(db) = Db::new("lineage_rows") else {
        return;
    };
    let store = Arc::new(db.store());
    conformance::lineage_rows(&store, &|thread| {
        let count = |sql: &str| db.query_i64(sql, &[thread.as_str()]);
        conformance::Rows {
            files: count("SELECT count(*) FROM {s}.keel_offload_files WHERE thread_id = $1"),
            orphan_chunks: count(
                "SELECT count(*) FROM {s}.keel_offload_chunks c WHERE c.thread_id = $1 AND NOT EXISTS
                 (SELECT 1 FROM {s}.keel_offload_files f
                  WHERE f.thread_id = c.thread_id AND f.generation = c.generation)",
            ),
            chunk_bytes: count(
                "SELECT coalesce(sum(length(data)), 0)::bigint FROM {s}.keel_offload_chunks WHERE thread_id = $1",
            ),
        }
    });
}

#[test]
fn a_newer_schema_is_refused_with_its_version() {
    let Some(db) = Db::new("newer") else {
        return;
    };
    drop(db.store());
    // Setting up again is a no-op.
    drop(db.store());
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {s}.keel_offload_schema", &[]),
        2
    );
    db.execute("INSERT INTO {s}.keel_offload_schema (version, name) VALUES (7, 'from the future')");
    let err = PostgresStore::connect_with(
        &db.url,
        PostgresStoreOptions::new()
            .schema(db.schema.clone())
            .unwrap(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            OffloadError::SchemaTooNew {
                found: 7,
                supported: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("version 7"), "{err}");
}

#[test]
fn many_workers_set_up_one_schema_at_once() {
    let Some(db) = Db::new("setup") else {
        return;
    };
    let db = Arc::new(db);
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let db = Arc::clone(&db);
            std::thread::spawn(move || db.store())
        })
        .collect();
    let stores: Vec<PostgresStore> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {s}.keel_offload_schema", &[]),
        2
    );
    // Every worker sees what another wrote.
    let k = Key::new("shared", "archive/messages.jsonl").unwrap();
    for (i, s) in stores.iter().enumerate() {
        s.append(&k, &format!("worker {i}\n")).unwrap();
    }
    assert_eq!(stores[0].get(&k).unwrap().lines().count(), 6);
}

/// The work every call site does: archive, read back, offload a result and grep it.
fn exercise(store: &PostgresStore, thread: &str) {
    let t = ThreadId::new(thread).unwrap();
    let archive = Archive::new(Arc::new(store.clone()));
    let messages: Vec<keel_message::Message> = (0..20)
        .map(|i| keel_message::Message::user(format!("message {i}")).with_id(format!("m{i}")))
        .collect();
    archive.append(&t, &messages).unwrap();
    assert_eq!(
        archive.get(&t, "m7").unwrap().unwrap().message.text(),
        "message 7"
    );
    let k = Key::new(thread, "large_tool_results/call_1").unwrap();
    store.put(&k, "alpha\nbeta\n").unwrap();
    let found = store
        .grep(
            &t,
            None,
            &keel_offload::Pattern::new("^beta").unwrap(),
            &keel_offload::GrepOptions::default(),
        )
        .unwrap();
    assert_eq!(found.matches.len(), 1);
    assert_eq!(store.delete_thread(&t).unwrap(), 2);
}

#[test]
fn works_from_a_plain_thread() {
    let Some(db) = Db::new("plain") else {
        return;
    };
    let store = db.store();
    std::thread::spawn(move || exercise(&store, "plain"))
        .join()
        .unwrap();
}

#[test]
fn works_from_spawn_blocking_in_a_multi_thread_runtime() {
    let Some(db) = Db::new("blocking") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = db.store();
    rt.block_on(async move {
        let jobs: Vec<_> = (0..8)
            .map(|i| {
                let store = store.clone();
                tokio::task::spawn_blocking(move || exercise(&store, &format!("blocking-{i}")))
            })
            .collect();
        for j in jobs {
            j.await.unwrap();
        }
    });
}

#[test]
fn works_straight_from_async_code_on_either_runtime() {
    // The compactor appends to the archive from an async fn, on a runtime worker:
    // the call blocks that worker until the answer comes, and must not panic.
    let Some(db) = Db::new("async") else {
        return;
    };
    let store = db.store();
    let multi = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let s = store.clone();
    multi.block_on(async move {
        let task = tokio::spawn(async move { exercise(&s, "multi-worker") });
        task.await.unwrap();
    });
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = store.clone();
    current.block_on(async move { exercise(&s, "current-thread") });
    // A store made inside a runtime, used and dropped there.
    let url = db.url.clone();
    let schema = db.schema.clone();
    current.block_on(async move {
        let inner =
            PostgresStore::connect_with(&url, PostgresStoreOptions::new().schema(schema).unwrap())
                .unwrap();
        exercise(&inner, "made-inside");
        drop(inner);
    });
}

#[test]
fn connect_async_connects_off_the_runtime() {
    let Some(db) = Db::new("connect_async") else {
        return;
    };
    let current = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let options = PostgresStoreOptions::new()
        .schema(db.schema.clone())
        .unwrap();
    let store = current
        .block_on(PostgresStore::connect_with_async(&db.url, options))
        .unwrap();
    exercise(&store, "connect-async");
    let bad = current.block_on(PostgresStore::connect_with_async(
        "not a connection string",
        PostgresStoreOptions::new(),
    ));
    assert!(matches!(bad, Err(OffloadError::Database { .. })), "{bad:?}");
}

#[test]
fn one_pool_serves_the_checkpointer_and_the_archive() {
    let Some(db) = Db::new("shared_pool") else {
        return;
    };
    let store = Arc::new(db.store());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let saver =
        keel_checkpoint_postgres::PostgresSaver::from_pool(store.pool().clone(), &db.schema)
            .unwrap();
    rt.block_on(async {
        saver.setup().await.unwrap();
        keel_checkpoint::conformance::round_trip(&saver).await;
        // The saver's connections live on the store's connection thread: this
        // runtime's only thread may block in a store call without starving them.
        conformance::archive(&store);
        keel_checkpoint::conformance::delete_thread(&saver).await;
    });
    let tables = db.query_i64(
        "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'keel_%'",
        &[&db.schema],
    );
    assert!(
        tables >= 7,
        "checkpoint and offload tables side by side: {tables}"
    );
}

/// A version-1 schema gets migration 2: new chunks compress with lz4 when the server
/// has it (PostgreSQL 14 or newer built with it) and as before when it has not, the
/// migration recorded either way; chunks read back the same.
#[test]
fn a_version_1_schema_compresses_new_chunks_with_lz4_where_the_server_can() {
    let Some(db) = Db::new("lz4") else {
        return;
    };
    drop(db.store());
    // The schema as version 1 left it.
    db.execute(
        "ALTER TABLE {s}.keel_offload_chunks ALTER COLUMN data SET COMPRESSION DEFAULT;
         DELETE FROM {s}.keel_offload_schema WHERE version > 1",
    );
    let column_is_lz4 = || {
        db.query_i64(
            "SELECT (a.attcompression = 'l')::int::bigint FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = 'keel_offload_chunks' AND a.attname = 'data'",
            &[&db.schema],
        )
    };
    assert_eq!(column_is_lz4(), 0);
    let store = db.store();
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {s}.keel_offload_schema", &[]),
        2
    );
    let lz4 = db.query_i64(
        "SELECT count(*) FROM pg_settings \
         WHERE name = 'default_toast_compression' AND 'lz4' = ANY (enumvals)",
        &[],
    );
    assert_eq!(column_is_lz4(), lz4);
    let k = Key::new("compressed", "results/big.json").unwrap();
    let text: String = (0..20_000)
        .map(|i| format!("{{\"id\": {i}, \"path\": \"src/file_{}.rs\"}}\n", i % 97))
        .collect();
    store.put(&k, &text).unwrap();
    assert_eq!(store.get(&k).unwrap(), text);
    let method = if lz4 == 1 { "lz4" } else { "pglz" };
    assert!(
        db.query_i64(
            "SELECT count(*) FROM {s}.keel_offload_chunks WHERE thread_id = 'compressed'",
            &[],
        ) > 0
    );
    assert_eq!(
        db.query_i64(
            "SELECT count(*) FROM {s}.keel_offload_chunks \
             WHERE thread_id = 'compressed' AND pg_column_compression(data) IS DISTINCT FROM $1",
            &[method],
        ),
        0,
        "every chunk is stored with {method}"
    );
}

#[test]
fn a_server_that_cannot_be_reached_is_named_with_its_cause() {
    // No server needs to run: nothing listens on port 1.
    let err = PostgresStore::connect("postgres://keel@127.0.0.1:1/app").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OffloadError::Database { .. }), "{err:?}");
    assert!(
        text.starts_with("offload schema public: the database could not connect:"),
        "{text}"
    );
    // The cause under the pool's and the driver's errors is on the same line.
    assert!(text.to_lowercase().contains("refused"), "{text}");
}
