//! `cargo xtask bench <target>`: each target runs keel's benchmark and its peer in one go
//! and prints medians side by side with their ratio.

use anyhow::{Result, bail};

mod agent;
mod agent_keel;
mod cli;
mod compaction;
mod graph;
mod model;
mod offload;
mod postgres;
mod reducer;
mod sqlite;
mod token;

/// Runs one benchmark group, or all of them.
pub fn bench(target: &str) -> Result<()> {
    match target {
        "token" => token::run(),
        "graph" => graph::run(),
        "postgres" => postgres::run(),
        "sqlite" => sqlite::run(),
        "offload" => offload::run(),
        "model" => model::run(),
        "compaction" => compaction::run_bench(),
        "reducer" => reducer::run_bench(),
        "agent" => agent::run(),
        "cli" => cli::run_bench(),
        "all" => {
            token::run()?;
            reducer::run_bench()?;
            graph::run()?;
            sqlite::run()?;
            postgres::run()?;
            offload::run()?;
            model::run()?;
            compaction::run_bench()?;
            agent::run()?;
            cli::run_bench()
        }
        other => bail!(
            "unknown bench target `{other}` (expected token, reducer, graph, sqlite, postgres, offload, model, compaction, agent, cli or all)"
        ),
    }
}
