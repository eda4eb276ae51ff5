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

mod common;

/// The corpus holds no SWE-agent run (the shared data's are the real ones): the same
/// check over the first of `../shared/data/swe-agent/*.traj`, skipped with a message
/// when the shared data is absent.
#[test]
fn the_shared_swe_agent_runs_pass_the_import_check() {
    let Some(data) = common::data() else { return };
    let mut runs: Vec<_> = std::fs::read_dir(data.join("swe-agent"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "traj"))
        .collect();
    runs.sort();
    assert!(!runs.is_empty(), "no .traj files in the shared data");
    let dir = tempfile::tempdir().unwrap();
    for run in runs.iter().take(5) {
        let loaded = keel_compaction::replay::load_swe_agent(run);
        assert!(loaded.is_ok(), "{}: {loaded:?}", run.display());
        let bytes = std::fs::read(run).unwrap();
        if let Err(e) = props::check_trajectory(dir.path(), &bytes) {
            panic!("{}: {e}", run.display());
        }
    }
}
