//! `cargo xtask bench <target>`: each target runs keel's benchmark and its peer in one go
//! and prints medians side by side with their ratio.

use anyhow::{Result, bail};

mod graph;
mod model;
mod offload;
mod sqlite;
mod token;

/// Runs one benchmark group, or all of them.
pub fn bench(target: &str) -> Result<()> {
    match target {
        "token" => token::run(),
        "graph" => graph::run(),
        "sqlite" => sqlite::run(),
        "offload" => offload::run(),
        "model" => model::run(),
        "all" => {
            token::run()?;
            graph::run()
        }
        other => bail!("unknown bench target `{other}` (expected token, graph or all)"),
    }
}
