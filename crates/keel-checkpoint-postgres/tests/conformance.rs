//! The `keel_checkpoint` conformance suite against a real PostgreSQL, one check per test
//! (each on its own schema, so they run in parallel).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use keel_checkpoint::{Checkpointer, conformance};

macro_rules! checks {
    ($($check:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $check() {
            let Some(db) = common::saver(stringify!($check)).await else { return };
            conformance::$check(&db.saver).await;
            db.drop_schema().await;
        }
    )*};
}

checks!(
    round_trip,
    list_order_and_filters,
    chains_without_snapshots,
    chains_with_snapshots,
    chains_across_fork,
    pending_writes,
    resume_after_crash_mid_step,
    delete_thread,
    prune,
    sweep_idle,
    stale_writes_refused,
    racing_writers,
    invalid_puts_refused,
    put_many_in_order,
    namespaces_isolated,
);

/// The whole suite on one saver, through `Arc<dyn Checkpointer>` (checks use fresh
/// thread ids, so they share the schema).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_through_arc_dyn() {
    let Some(db) = common::saver("run_all").await else {
        return;
    };
    let shared: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    conformance::run_all(|| {
        let shared = Arc::clone(&shared);
        async move { shared }
    })
    .await;
    db.drop_schema().await;
}
