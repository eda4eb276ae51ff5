//! The fleet on PostgreSQL: aggregate steps/s at 1, 2 and 3 workers with the queue and
//! the database archive, beside the same threads run without them and with the archive
//! alone (the archive's share of the cost); claim latency; and
//! bytes per archived message in PostgreSQL and in the file store
//! (`crates/keel-fleet/examples/fleet_bench.rs` says what each column means).

use anyhow::{Result, bail};

use crate::pg::Database;
use crate::util::{self, release_example};

/// Runs the fleet benchmark against `DATABASE_URL` or a throwaway cluster and prints
/// its table (`--quick`: 50 threads x 40 steps, one repetition).
pub fn run() -> Result<()> {
    let db = Database::get(&[], false);
    eprintln!("fleet bench: {}", db.describe());
    if db.url().is_none() {
        bail!("no PostgreSQL for the benchmark: {}", db.describe());
    }
    let (threads, steps) = if super::quick() {
        ("50", "40")
    } else {
        ("200", "100")
    };
    let reps = super::reps("3");
    util::run(
        release_example("keel-fleet", "fleet_bench")
            .args(["--threads", threads, "--steps", steps, "--reps", &reps])
            .envs(db.env()),
    )
}
