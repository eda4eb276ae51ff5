//! `cargo xtask eval [--live]`: the targeted context evals (`tests/evals`, package
//! `keel-evals`), one line per eval, model transcripts under `target/evals/`.
//!
//! Offline, every eval runs deterministically with a scripted reader. With `--live`,
//! the model-facing evals run against `OPENAI_BASE_URL` or `OLLAMA_BASE_URL`
//! (`OPENAI_MODEL` / `OLLAMA_MODEL` pick the model); with neither set it says it
//! skipped and why.

use anyhow::Result;

use crate::util::{cargo, root, run};

/// Runs the evals.
pub fn eval(live: bool) -> Result<()> {
    let out = root().join("target").join("evals");
    let mut c = cargo();
    c.args(["run", "-q", "-p", "keel-evals", "--bin", "keel-evals", "--"]);
    if live {
        c.arg("--live");
    }
    c.arg("--out").arg(&out);
    run(&mut c)
}
