#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! What is stored: growth per step (invariant 6), what prune frees, and that waiting for
//! the database never blocks the async runtime.

mod common;

use std::time::Duration;

use common::{fold, items, put_log_step, step};
use keel_checkpoint::{ChannelDelta, ChannelVersion, Checkpointer, ThreadKey};
use keel_checkpoint_sqlite::rusqlite::Connection;
use keel_checkpoint_sqlite::{SqliteOptions, SqliteSaver};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_grows_with_each_steps_writes_not_with_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("growth.db"))
        .await
        .unwrap();
    let thread = ThreadKey::new("t");
    let mut parent = None;
    let mut sizes = Vec::new();
    for i in 0..600 {
        // One 1 KB item per step; the channel's value grows to 600 KB.
        put_log_step(
            &saver,
            &thread,
            &mut parent,
            items(&format!("{i:04}"), 1, 1000),
        )
        .await;
        if i % 200 == 199 {
            saver.wal_checkpoint().await.unwrap();
            sizes.push(saver.stats().await.unwrap());
        }
    }
    // The stored JSON grows by the same amount every step.
    let per_step: Vec<u64> = sizes
        .windows(2)
        .map(|w| w[1].delta_bytes - w[0].delta_bytes)
        .collect();
    assert_eq!(per_step[0], per_step[1], "{sizes:?}");
    assert_eq!(
        per_step[0], sizes[0].delta_bytes,
        "the first 200 steps stored as much"
    );
    assert_eq!(sizes[2].deltas, 600);
    // The file too, about linearly (a state-sized write per step would triple the second
    // interval's growth over the first's).
    let growth: Vec<u64> = sizes
        .windows(2)
        .map(|w| w[1].database_bytes - w[0].database_bytes)
        .collect();
    assert!(
        growth[1] < growth[0] * 3 / 2,
        "file growth per 200 steps: {growth:?}"
    );
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(fold(&tuple.channels["log"]).len(), 600);
}

#[tokio::test(flavor = "current_thread")]
async fn prune_frees_deltas_behind_a_snapshot() {
    let saver = SqliteSaver::open_in_memory().await.unwrap();
    let thread = ThreadKey::new("t");
    let mut parent = None;
    let mut value: Vec<Value> = Vec::new();
    for i in 0..50 {
        let item = json!(i);
        value.push(item.clone());
        let mut request = step(&thread, parent.as_ref(), "log", vec![item]);
        if i == 40 {
            request.deltas[0].snapshot = Some(Value::Array(value.clone()));
        }
        // A second channel written once, at the first step, and carried ever after.
        if i == 0 {
            let version = ChannelVersion::new(1, request.checkpoint.id.clone());
            request
                .checkpoint
                .channel_versions
                .insert("goal".into(), version.clone());
            request.deltas.push(ChannelDelta {
                channel: "goal".into(),
                version,
                base: None,
                updates: vec![json!("ship it")],
                snapshot: None,
            });
        }
        saver.put(request.clone()).await.unwrap();
        parent = Some(request.checkpoint);
    }
    assert_eq!(saver.stats().await.unwrap().deltas, 51);
    assert_eq!(saver.prune(&thread, 5).await.unwrap(), 45);
    let stats = saver.stats().await.unwrap();
    // Kept: the log deltas of steps 40 (the snapshot) to 49, and the goal's delta.
    assert_eq!(
        (stats.checkpoints, stats.deltas, stats.snapshots),
        (5, 11, 1)
    );
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(fold(&tuple.channels["log"]), value);
    assert_eq!(fold(&tuple.channels["goal"]), vec![json!("ship it")]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_put_waiting_for_the_disk_does_not_block_the_runtime() {
    // A single-threaded runtime: if `put` blocked its thread while waiting for the write
    // lock, the `get` below could not run until the put gave up.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("async.db");
    let saver = SqliteOptions::default()
        .busy_timeout(Duration::from_secs(60))
        .open(&path)
        .await
        .unwrap();
    let thread = ThreadKey::new("t");
    let first = step(&thread, None, "log", vec![json!(1)]);
    saver.put(first.clone()).await.unwrap();

    let blocker = Connection::open(&path).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let next = step(&thread, Some(&first.checkpoint), "log", vec![json!(2)]);
    let pending = tokio::spawn({
        let (saver, next) = (saver.clone(), next.clone());
        async move { saver.put(next).await }
    });
    tokio::task::yield_now().await;
    let head = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(head.checkpoint, first.checkpoint);
    assert!(
        !pending.is_finished(),
        "the put cannot finish while the lock is held"
    );
    blocker.execute_batch("ROLLBACK").unwrap();
    pending.await.unwrap().unwrap();
    let head = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(head.checkpoint, next.checkpoint);
}

/// Puts `steps` one-item steps of `size` bytes with `options` into a new file and
/// returns (the largest size the log file had after a put, the database file's size
/// before the saver closes); the history reads back whole.
async fn log_sizes(options: SqliteOptions, steps: usize, size: usize) -> (u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wal.db");
    let wal = dir.path().join("wal.db-wal");
    let saver = options.open(&path).await.unwrap();
    let thread = ThreadKey::new("t");
    let mut parent = None;
    let mut largest_log = 0;
    for i in 0..steps {
        put_log_step(
            &saver,
            &thread,
            &mut parent,
            items(&format!("{i:04}"), 1, size),
        )
        .await;
        largest_log = largest_log.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
    }
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(fold(&tuple.channels["log"]).len(), steps);
    let database = std::fs::metadata(&path).unwrap().len();
    (largest_log, database)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_copied_into_the_file_as_it_grows_and_stays_bounded() {
    // A log frame is a 4 KiB page and a 24-byte header; the log file has a 32-byte one.
    let frames = |bytes: u64| bytes.saturating_sub(32) / (4096 + 24);
    // 400 steps of 3 KB write well over a thousand pages to the log.
    let (steps, size) = (400, 3000);

    // Checkpoints after 16 pages: the background thread, or the writer itself at 64
    // pages, copies the log into the file, and the log starts over.
    let (log, database) =
        log_sizes(SqliteOptions::default().checkpoint_pages(16), steps, size).await;
    assert!(
        frames(log) <= 64 + 16,
        "the log grew to {} frames with checkpoints every 16 pages",
        frames(log)
    );
    assert!(
        database > (steps * size) as u64,
        "the history ({} bytes of items) reached the file: it has {database} bytes",
        steps * size
    );

    // Without automatic checkpoints the log holds everything until the saver closes.
    let (log, database) =
        log_sizes(SqliteOptions::default().checkpoint_pages(0), steps, size).await;
    assert!(
        frames(log) > 4 * (64 + 16),
        "the log has {} frames without checkpoints",
        frames(log)
    );
    assert!(
        database < (steps * size) as u64 / 4,
        "without checkpoints the file keeps only the schema: it has {database} bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_checkpoint_call_is_not_kept_from_finishing_by_a_background_pass() {
    // Checkpoints every 4 pages: a background pass runs after almost every put.
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteOptions::default()
        .checkpoint_pages(4)
        .open(dir.path().join("truncate.db"))
        .await
        .unwrap();
    let thread = ThreadKey::new("t");
    let mut parent = None;
    for i in 0..200 {
        put_log_step(
            &saver,
            &thread,
            &mut parent,
            items(&format!("{i}"), 1, 3000),
        )
        .await;
        assert!(
            saver.wal_checkpoint().await.unwrap(),
            "wal_checkpoint after put {i} did not finish"
        );
        let log = std::fs::metadata(dir.path().join("truncate.db-wal")).map_or(0, |m| m.len());
        assert_eq!(log, 0, "the log is truncated after put {i}");
    }
}
