//! Small helpers for running commands from the workspace root.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A command to run from the workspace root.
pub fn cmd(program: &str) -> Command {
    let mut c = Command::new(program);
    c.current_dir(root());
    c
}

/// `cargo` as invoked by this xtask.
pub fn cargo() -> Command {
    cmd(&std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
}

/// `cargo run --release --quiet -p <package> --example <example> --`: add the
/// example's own arguments.
pub fn release_example(package: &str, example: &str) -> Command {
    let mut c = cargo();
    c.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        package,
        "--example",
        example,
        "--",
    ]);
    c
}

/// Runs a command, failing with its description if it exits non-zero.
pub fn run(c: &mut Command) -> Result<()> {
    eprintln!("$ {}", describe(c));
    let status = c
        .status()
        .with_context(|| format!("could not start `{}`", describe(c)))?;
    if !status.success() {
        bail!("`{}` failed with {status}", describe(c));
    }
    Ok(())
}

/// True when a program is on PATH (or a cargo subcommand is installed, for `cargo-x`).
pub fn has_program(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn describe(c: &Command) -> String {
    let mut s = c.get_program().to_string_lossy().into_owned();
    for a in c.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs a command and returns its standard output (standard error passes through).
pub fn run_capture(c: &mut Command) -> Result<String> {
    eprintln!("$ {}", describe(c));
    let out = c
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("could not start `{}`", describe(c)))?;
    if !out.status.success() {
        bail!("`{}` failed with {}", describe(c), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
