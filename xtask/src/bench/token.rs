//! Token counting throughput: keel-token vs Python tiktoken on the same text.

use anyhow::{Result, bail};

/// Runs the token benchmark.
pub fn run() -> Result<()> {
    bail!("the token benchmark is not written yet")
}
