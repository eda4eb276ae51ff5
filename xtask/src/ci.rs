//! `cargo xtask ci` and `cargo xtask test`.

use anyhow::Result;

use crate::util::{cargo, has_program, run};

/// The test suite: every crate, every feature, doc tests included.
///
/// Libraries, binaries, integration tests and examples (examples are built, not run);
/// benchmarks are left to `cargo xtask bench` (clippy in `cargo xtask ci` still
/// compiles them), since some prepare large inputs.
pub fn test(extra: &[String]) -> Result<()> {
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
        .args(extra))?;
    // Target selection skips doc tests; run them on their own.
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
