//! keel's side of `cargo xtask bench agent`: the compacting agent loop on keel's own
//! runtime, the same workload as the LangGraph.js peer
//! (`xtask/peers/langgraphjs-agent/agent.mjs`, whose header spells it out: the graph, the
//! fake model's answers, the tools' output, compaction every 10 agent steps, an epoch
//! every 5 milestones, pruning to the newest 5 checkpoints after each compaction).
//!
//! [`run`] is called once per [`Config`] and returns one [`Measurement`] per repetition;
//! `bench agent` takes the medians and prints them beside the peer's.

use std::path::PathBuf;

use anyhow::{Result, bail};

/// One configuration of the benchmark.
#[derive(Debug, Clone)]
pub struct Config {
    /// The checkpoint backend: `"memory"`, `"sqlite"` or `"postgres"`.
    pub backend: String,
    /// `"sync"` (a step's checkpoint is durable before the next step starts) or
    /// `"async"` (it is saved while the next step runs).
    pub durability: String,
    /// Agent steps (model calls) in one run; the model ends the run at this step.
    pub steps: u64,
    /// How many times to run it; [`run`] returns one [`Measurement`] each.
    pub reps: u32,
    /// The repository directory the file tools (`ls`, `read_file`, `grep`) work in.
    pub repo: PathBuf,
    /// The PostgreSQL connection string, for `"postgres"` (else `None`).
    pub database_url: Option<String>,
    /// A scratch directory this run may use (e.g. for the SQLite file); it exists.
    pub scratch: PathBuf,
}

/// One run's numbers.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// As in [`Config::backend`].
    pub backend: String,
    /// As in [`Config::durability`].
    pub durability: String,
    /// Agent steps run (model calls).
    pub steps: u64,
    /// Seconds the run took, from the first step to the last durable checkpoint.
    pub wall_s: f64,
    /// `steps / wall_s`.
    pub steps_per_s: f64,
    /// The runtime's own cost per step in µs: wall time less the time spent in the fake
    /// model, the fake summarizer and the tools' bodies, divided by `steps`.
    pub overhead_us_per_step: f64,
    /// Bytes the thread occupies in the backend at the end, divided by `steps` (`None`
    /// for memory, or when not measured).
    pub bytes_per_step: Option<f64>,
    /// Peak resident memory of the process in bytes (`None` when not measured).
    pub peak_rss_bytes: Option<u64>,
    /// Supersteps run (nodes executed: agent, tools, compact, epoch), each one
    /// checkpoint commit; `bench agent` derives commits per step from it.
    pub supersteps: u64,
}

/// Runs keel's compacting agent loop for `config`, `config.reps` times.
pub fn run(config: &Config) -> Result<Vec<Measurement>> {
    let Config {
        backend,
        durability,
        steps,
        reps,
        repo,
        database_url,
        scratch,
    } = config;
    let _ = (
        backend,
        durability,
        steps,
        reps,
        repo,
        database_url,
        scratch,
    );
    bail!("keel side not written yet")
}
