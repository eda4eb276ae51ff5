#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! SqliteSaver passes keel_checkpoint's conformance suite: on a file (fresh per check, and
//! shared by every check), with writes run in place, in memory, with no reader
//! connections, and through `Arc<dyn Checkpointer>`.

use std::sync::Arc;

use keel_checkpoint::{Checkpointer, conformance};
use keel_checkpoint_sqlite::{SqliteOptions, SqliteSaver, Synchronous};

/// The suite with a fresh file opened with `options` for each check.
async fn conformance_on_fresh_files_with(options: SqliteOptions) {
    let dir = tempfile::tempdir().unwrap();
    let counter = std::sync::atomic::AtomicUsize::new(0);
    conformance::run_all(|| {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let path = dir.path().join(format!("check-{n}.db"));
        let options = options.clone();
        async move { SqliteSaver::open_with(path, options).await.unwrap() }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_fresh_files() {
    conformance_on_fresh_files_with(SqliteOptions::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_with_writes_run_in_place() {
    conformance_on_fresh_files_with(SqliteOptions::default().block_in_place(true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_checks_share_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("shared.db"))
        .await
        .unwrap();
    conformance::run_all(|| {
        let saver = saver.clone();
        async move { saver }
    })
    .await;
    assert!(saver.stats().await.unwrap().threads > 10);
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_in_memory() {
    conformance::run_all(|| async { SqliteSaver::open_in_memory().await.unwrap() }).await;
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_with_full_sync_and_no_readers() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions::default()
        .synchronous(Synchronous::Full)
        .readers(0);
    let saver = options.open(dir.path().join("full.db")).await.unwrap();
    conformance::run_all(|| {
        let saver = saver.clone();
        async move { saver }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_arc_dyn() {
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("dyn.db")).await.unwrap();
    conformance::run_all(|| {
        let saver = Arc::new(saver.clone()) as Arc<dyn Checkpointer>;
        async move { saver }
    })
    .await;
}
