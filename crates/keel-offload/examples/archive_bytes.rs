//! Bytes stored per archived message: the file store, SQLite and PostgreSQL.
//!
//! Archives real agent runs (the 200 tau-bench airline trajectories from
//! `../shared/data` when that folder is there, else generated tool-using runs), one
//! thread per run, in batches of 8 messages as compactions cut them, into each store,
//! and prints what each store takes on disk per message beside the JSON Lines bytes
//! of the records themselves. PostgreSQL runs when `DATABASE_URL` is set (in a
//! throwaway schema, after a `VACUUM` so the sizes count live rows); it is skipped
//! with the reason otherwise. Sizes are printed, not checked.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run -p keel-offload --release --features sqlite,postgres --example archive_bytes
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_message::{Message, ToolCall};
use keel_offload::{
    Archive, FsStore, Fsync, OffloadStore, PostgresStore, PostgresStoreOptions, SqliteStore,
    ThreadId,
};
use serde_json::{Value, json};

const BATCH: usize = 8;

/// The runs to archive, and where they came from.
fn runs() -> (Vec<Vec<Message>>, String) {
    let data = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/tau-bench/gpt-4o-airline.json");
    if let Ok(bytes) = std::fs::read(&data) {
        let all: Vec<Value> = serde_json::from_slice(&bytes).unwrap();
        let runs = all
            .iter()
            .map(|run| {
                let traj = run["traj"].as_array().cloned().unwrap_or_default();
                keel_message::openai::from_values(&traj)
                    .unwrap()
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| m.with_id(format!("m{i}")))
                    .collect()
            })
            .collect();
        return (runs, "tau-bench gpt-4o-airline (200 real runs)".to_owned());
    }
    eprintln!("../shared/data is not here: archiving generated runs instead");
    let runs = (0..200)
        .map(|r| {
            (0..40)
                .map(|i| match i % 3 {
                    0 => Message::assistant(format!("Step {i} of run {r}: checking the booking."))
                        .with_id(format!("m{i}"))
                        .with_tool_calls(vec![ToolCall::new(
                            format!("call_{i}"),
                            "get_reservation_details",
                            json!({"reservation_id": format!("R{r:04}{i:02}")}),
                        )]),
                    1 => Message::tool(
                        format!("call_{}", i - 1),
                        json!({"reservation_id": format!("R{r:04}{i:02}"), "flights": [{"origin": "SFO", "destination": "JFK", "date": "2024-05-20", "price": 412 + i}], "passengers": 2, "status": "confirmed"}).to_string(),
                    )
                    .with_id(format!("m{i}")),
                    _ => Message::user(format!("Please change the date of flight {i} to the next day."))
                        .with_id(format!("m{i}")),
                })
                .collect()
        })
        .collect();
    (runs, "generated runs (200 × 40 messages)".to_owned())
}

/// Archives every run into `store`; returns (messages, JSON Lines bytes).
fn archive_all(store: Arc<dyn OffloadStore>, runs: &[Vec<Message>], tag: &str) -> (u64, u64) {
    let archive = Archive::new(store);
    let (mut messages, mut bytes) = (0u64, 0u64);
    for (r, run) in runs.iter().enumerate() {
        let thread = ThreadId::new(format!("{tag}-run-{r}")).unwrap();
        for batch in run.chunks(BATCH) {
            let out = archive.append(&thread, batch).unwrap();
            messages += out.written as u64;
            bytes += out.bytes.iter().map(|b| b + 1).sum::<u64>();
        }
    }
    (messages, bytes)
}

/// Bytes the files under `dir` take: their lengths, and their allocated blocks.
fn dir_bytes(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut len, mut blocks) = (0, 0);
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                len += m.len();
                blocks += m.blocks() * 512;
            }
        }
    }
    (len, blocks)
}

fn sqlite_bytes(path: &PathBuf) -> u64 {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let pages: i64 = conn
        .query_row("PRAGMA page_count", [], |r| r.get(0))
        .unwrap();
    let free: i64 = conn
        .query_row("PRAGMA freelist_count", [], |r| r.get(0))
        .unwrap();
    let size: i64 = conn
        .query_row("PRAGMA page_size", [], |r| r.get(0))
        .unwrap();
    ((pages - free) * size) as u64
}

fn per(bytes: u64, n: u64) -> f64 {
    bytes as f64 / n.max(1) as f64
}

fn main() {
    let (runs, source) = runs();
    println!("archiving {source}, in batches of {BATCH} messages");

    let dir = tempfile::tempdir().unwrap();
    let fs = Arc::new(
        FsStore::new(dir.path().join("fs"))
            .unwrap()
            .with_fsync(Fsync::Never),
    );
    let (n, json) = archive_all(fs, &runs, "fs");
    println!(
        "{n} messages, {:.0} bytes of JSON Lines per message",
        per(json, n)
    );
    let (len, blocks) = dir_bytes(&dir.path().join("fs"));
    println!(
        "file store:  {:>8.0} bytes/message in file lengths, {:>8.0} in allocated blocks (one file per thread)",
        per(len, n),
        per(blocks, n)
    );

    let db = dir.path().join("offload.db");
    let empty = {
        drop(SqliteStore::open(&db).unwrap());
        sqlite_bytes(&db)
    };
    let sqlite = Arc::new(SqliteStore::open(&db).unwrap());
    archive_all(sqlite.clone(), &runs, "sqlite");
    drop(sqlite);
    println!(
        "sqlite:      {:>8.0} bytes/message (used pages, after a WAL checkpoint)",
        per(sqlite_bytes(&db) - empty, n)
    );

    let Some(url) = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    else {
        println!("postgres:    skipped: DATABASE_URL is not set");
        return;
    };
    let schema = format!("keel_offload_bytes_{}", std::process::id());
    let store = PostgresStore::connect_with(
        &url,
        PostgresStoreOptions::new().schema(schema.clone()).unwrap(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    });
    let sizes = |what: &str| -> (i64, i64) {
        rt.block_on(async {
            for table in ["keel_offload_files", "keel_offload_chunks"] {
                client
                    .batch_execute(&format!("VACUUM (ANALYZE) \"{schema}\".{table}"))
                    .await
                    .unwrap();
            }
            let row = client
                .query_one(
                    &format!(
                        "SELECT pg_total_relation_size('\"{schema}\".keel_offload_files'),
                                pg_total_relation_size('\"{schema}\".keel_offload_chunks')"
                    ),
                    &[],
                )
                .await
                .unwrap();
            let sizes = (row.get(0), row.get(1));
            eprintln!("{what}: files {} B, chunks {} B", sizes.0, sizes.1);
            sizes
        })
    };
    let before = sizes("empty tables");
    archive_all(Arc::new(store.clone()), &runs, "pg");
    let after = sizes("archived");
    let total = (after.0 - before.0 + after.1 - before.1) as u64;
    println!(
        "postgres:    {:>8.0} bytes/message (pg_total_relation_size of both tables, indexes and TOAST included)",
        per(total, n)
    );
    drop(store);
    rt.block_on(async {
        client
            .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await
            .unwrap();
    });
}
