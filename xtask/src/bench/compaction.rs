//! Compaction: per-step engine cost (criterion) and trajectory replay (speed and the
//! token / cache-weighted report against the full history).

use anyhow::Result;

use crate::util::{cargo, run};

/// Runs the compaction benchmarks.
pub fn run_bench() -> Result<()> {
    run(cargo().args([
        "bench",
        "-p",
        "keel-compaction",
        "--bench",
        "step",
        "--",
        "--warm-up-time",
        "1",
        "--measurement-time",
        "3",
    ]))?;
    let data = crate::util::root().join("../shared/data");
    if data.exists() {
        run(cargo().args([
            "run",
            "--release",
            "-q",
            "-p",
            "keel-compaction",
            "--example",
            "replay",
        ]))?;
    } else {
        eprintln!("skipped the replay: {} is absent", data.display());
    }
    Ok(())
}
