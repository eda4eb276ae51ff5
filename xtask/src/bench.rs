//! `cargo xtask bench <target>`: each target runs keel's benchmark and its peer in one go
//! and prints medians side by side with their ratio. `cargo xtask bench` (or `all`) runs
//! the groups the comparison needs and writes their rows as one table to
//! `docs/benchmarks.md` (see `report`).

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Result, bail};

mod agent;
mod agent_keel;
mod cli;
mod compaction;
mod fleet;
mod graph;
mod model;
mod offload;
mod postgres;
mod reducer;
mod report;
mod sqlite;
mod token;

static QUICK: AtomicBool = AtomicBool::new(false);

/// Whether `--quick` was given: one repetition, smaller agent sizes.
pub fn quick() -> bool {
    QUICK.load(Ordering::Relaxed)
}

/// Repetitions: `KEEL_BENCH_REPS`, else 1 under `--quick`, else `default`.
pub fn reps(default: &str) -> String {
    std::env::var("KEEL_BENCH_REPS")
        .unwrap_or_else(|_| if quick() { "1".into() } else { default.into() })
}

/// The peers' pinned versions, as the groups install them.
const PEERS: &[(&str, &str)] = &[
    (
        "LangGraph (Python)",
        "langgraph 1.2.24, langgraph-checkpoint-postgres 3.2.0, psycopg 3.3.9, langgraph-checkpoint-sqlite 3.1.2",
    ),
    (
        "LangGraph.js",
        "@langchain/langgraph 1.7.3, @langchain/langgraph-checkpoint-postgres 1.0.5, @langchain/langgraph-checkpoint-sqlite 1.0.4, better-sqlite3 12.11.1, @langchain/core 1.4.0, pg 8.23.1 (xtask/peers/langgraphjs-agent/package-lock.json)",
    ),
    ("Python tiktoken", "tiktoken 0.14.0"),
    (
        "Deep Agents",
        "deepagents 0.7.32, langchain 1.5.2, langchain-core 1.8.3",
    ),
];

/// Runs every group the table needs; a group that fails becomes a row saying why.
fn all() -> Result<()> {
    let start = std::time::Instant::now();
    let mut rows = Vec::new();
    let mut group = |peer: &'static str, section: &'static str, r: Result<Vec<report::Row>>| match r
    {
        Ok(r) => rows.extend(r),
        Err(e) => {
            eprintln!("{section}: {e:#}");
            rows.push(report::failed(section, peer, &e));
        }
    };
    group("LangGraph", "graph loop", graph::run());
    group("-", "graph loop", sqlite::run());
    group("LangGraph", "graph loop", postgres::run());
    group("LangGraph.js", "agent loop", agent::run());
    group(
        "Python tiktoken",
        "token counting (o200k_base)",
        token::run(),
    );
    group("Deep Agents", "compaction replay", compaction::rows());
    report::write(&rows, quick(), PEERS, start.elapsed().as_secs_f64())
}

/// Runs one benchmark group, or all of them (`quick`: fewer repetitions and sizes).
pub fn bench(target: &str, quick: bool) -> Result<()> {
    QUICK.store(quick, Ordering::Relaxed);
    match target {
        "token" => token::run().map(drop),
        "graph" => graph::run().map(drop),
        "postgres" => postgres::run().map(drop),
        "sqlite" => sqlite::run().map(drop),
        "offload" => offload::run(),
        "model" => model::run(),
        "compaction" => compaction::run_bench(),
        "reducer" => reducer::run_bench(),
        "agent" => agent::run().map(drop),
        "cli" => cli::run_bench(),
        "fleet" => fleet::run(),
        "all" => all(),
        other => bail!(
            "unknown bench target `{other}` (expected token, reducer, graph, sqlite, postgres, offload, model, compaction, agent, cli, fleet or all)"
        ),
    }
}
