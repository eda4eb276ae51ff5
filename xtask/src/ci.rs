//! `cargo xtask ci` and `cargo xtask test`.

use anyhow::{Context, Result, bail};

use crate::pg::{self, Database};
use crate::util::{cargo, has_program, run};

/// The test suite: every crate, every feature, doc tests included.
///
/// Libraries, binaries, integration tests and examples (examples are built, not run);
/// benchmarks are left to `cargo xtask bench` (clippy in `cargo xtask ci` still
/// compiles them), since some prepare large inputs.
///
/// The Postgres tests get `DATABASE_URL` if it is set, else a throwaway cluster started
/// here (see [`crate::pg`]) and removed afterwards, pass or fail. With neither, they
/// report "skipped" locally; under `CI=true` the run fails instead.
pub fn test(extra: &[String]) -> Result<()> {
    // fsync off: a throwaway cluster need not survive a power cut, and tests run faster.
    let db = Database::get(&["fsync = off", "full_page_writes = off"]);
    eprintln!("Postgres tests: {}", db.describe());
    if let Database::Unavailable(reason) = &db {
        if pg::in_ci() {
            bail!("CI=true and no PostgreSQL for the Postgres tests: {reason}");
        }
        eprintln!("skipped: Postgres tests ({reason})");
    }
    let env = db.env();
    // The crash test runs this example as its child process; `--examples` below builds
    // examples as test harnesses, so build the plain binary first.
    run(cargo()
        .args([
            "build",
            "--workspace",
            "--all-features",
            "--example",
            "crash_child",
        ])
        .envs(env.iter().cloned()))?;
    run(cargo()
        .args([
            "test",
            "--workspace",
            "--all-features",
            "--lib",
            "--bins",
            "--tests",
            "--examples",
        ])
        .args(extra)
        .envs(env.iter().cloned()))?;
    // Target selection skips doc tests; run them on their own.
    run(cargo()
        .args(["test", "--workspace", "--all-features", "--doc"])
        .envs(env.iter().cloned()))?;
    drop(db);
    Ok(())
}

/// Everything CI checks.
pub fn ci() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]))?;
    test(&[])?;
    if has_program("cargo-deny") {
        run(cargo().args(["deny", "check", "bans", "licenses", "sources"]))?;
        advisories()?;
    } else {
        eprintln!("skipped cargo-deny: not installed (cargo install cargo-deny)");
    }
    Ok(())
}

/// The advisory check needs the RustSec database from GitHub: when it cannot be
/// fetched (no network), say so instead of failing; any advisory found fails.
fn advisories() -> Result<()> {
    let out = cargo()
        .args(["deny", "check", "advisories"])
        .output()
        .context("could not start cargo deny")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        return Ok(());
    }
    if stderr.contains("failed to fetch advisory database") {
        eprintln!(
            "skipped cargo-deny advisories: the advisory database could not be fetched (no network)"
        );
        return Ok(());
    }
    eprintln!("{stderr}");
    bail!("cargo deny check advisories failed")
}
