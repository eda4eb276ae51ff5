//! keel's side of `cargo xtask bench agent`: the compacting agent loop on keel's own
//! runtime, the same workload as the LangGraph.js peer
//! (`xtask/peers/langgraphjs-agent/agent.mjs`, whose header spells it out: the graph, the
//! fake model's answers, the tools' output, compaction every 10 agent steps, an epoch
//! every 5 milestones, pruning to the newest 5 checkpoints after each compaction).
//!
//! [`run`] is called once per [`Config`] and returns one [`Measurement`] per repetition;
//! `bench agent` takes the medians and prints them beside the peer's.

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail};

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

/// Runs keel's compacting agent loop for `config`, `config.reps` times, in a release
/// build of `crates/keel-agent/examples/bench_agent.rs` (one process per
/// configuration, so its peak memory is its own).
pub fn run(config: &Config) -> Result<Vec<Measurement>> {
    let mut cmd = crate::util::cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "keel-agent",
        "--example",
        "bench_agent",
        "--",
    ])
    .arg(&config.backend)
    .arg(&config.durability)
    .arg(config.steps.to_string())
    .arg(config.reps.to_string())
    .arg(&config.repo)
    .arg(&config.scratch);
    if let Some(url) = &config.database_url {
        cmd.env("DATABASE_URL", url);
    }
    let out = cmd.output().context("running the keel agent benchmark")?;
    if !out.status.success() {
        bail!(
            "the keel agent benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout)?;
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).context("bench output is not JSON")?;
            let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            Ok(Measurement {
                backend: v["backend"].as_str().unwrap_or_default().to_owned(),
                durability: v["durability"].as_str().unwrap_or_default().to_owned(),
                steps: v["steps"].as_u64().unwrap_or(0),
                wall_s: f("wall_s"),
                steps_per_s: f("steps_per_s"),
                overhead_us_per_step: f("overhead_us_per_step"),
                bytes_per_step: v["bytes_per_step"].as_f64(),
                peak_rss_bytes: v["peak_rss_bytes"].as_u64(),
                supersteps: v["supersteps"].as_u64().unwrap_or(0),
            })
        })
        .collect()
}
