//! The `trajectory_import` fuzz corpus (fuzz/corpus/), replayed with the fuzz target's
//! own check of the tau-bench and SWE-agent loaders (fuzz/props/trajectory.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../../fuzz/props/trajectory.rs"]
mod props;

#[path = "../../../fuzz/props/corpus.rs"]
mod corpus;

#[test]
fn trajectory_import_corpus_replays() {
    let dir = tempfile::tempdir().unwrap();
    corpus::replay("trajectory_import", |data| {
        props::check_trajectory(dir.path(), data)
    });
}
