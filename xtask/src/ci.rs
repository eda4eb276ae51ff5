//! `cargo xtask ci` and `cargo xtask test`.

use anyhow::Result;

use crate::util::{cargo, has_program, run};

/// The test suite: every crate, every feature, doc tests included.
pub fn test(extra: &[String]) -> Result<()> {
    run(cargo()
        .args(["test", "--workspace", "--all-features", "--all-targets"])
        .args(extra))?;
    // `--all-targets` skips doc tests; run them on their own.
    run(cargo().args(["test", "--workspace", "--all-features", "--doc"]))?;
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
        run(cargo().args(["deny", "check"]))?;
    } else {
        eprintln!("skipped cargo-deny: not installed (cargo install cargo-deny)");
    }
    Ok(())
}
