//! Reducers: `AddMessages` append cost at 100, 100,000 and 1,000,000 messages
//! (criterion medians).

use anyhow::Result;

use crate::util::{cargo, run};

/// Runs the reducer benchmark.
pub fn run_bench() -> Result<()> {
    run(cargo().args(["bench", "-p", "keel-reducer", "--bench", "add_messages"]))
}
