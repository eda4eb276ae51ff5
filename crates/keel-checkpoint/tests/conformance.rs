#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! MemorySaver passes the backend conformance suite (needs the `conformance` feature).

use std::sync::Arc;

use keel_checkpoint::{Checkpointer, MemorySaver, conformance};

#[tokio::test]
async fn conformance_suite() {
    conformance::run_all(|| async { MemorySaver::new() }).await;
}

#[tokio::test]
async fn conformance_checks_share_one_saver() {
    // Checks use fresh thread ids, so they also pass side by side on one saver.
    let saver = MemorySaver::new();
    conformance::run_all(|| {
        let saver = saver.clone();
        async move { saver }
    })
    .await;
    assert!(saver.stats().threads > 10);
}

#[tokio::test]
async fn conformance_through_arc_dyn() {
    conformance::run_all(|| async { Arc::new(MemorySaver::new()) as Arc<dyn Checkpointer> }).await;
}
