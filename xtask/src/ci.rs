//! `cargo xtask ci` and `cargo xtask test`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::pg::{self, Database};
use crate::util::{cargo, has_program, run, run_capture};

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
    // TLS on: the tests of each `sslmode` need a server that takes it.
    let db = Database::get(&["fsync = off", "full_page_writes = off"], true);
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

/// Everything CI checks: formatting, dependency bounds (what a crate must not pull
/// in), clippy, the feature combinations, the tests, cargo-deny.
pub fn ci() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    dependency_bounds()?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]))?;
    feature_builds()?;
    // Doc warnings (broken intra-doc links, missing docs in examples) fail the build.
    run(cargo()
        .args([
            "doc",
            "--workspace",
            "--all-features",
            "--no-deps",
            "--quiet",
        ])
        .env("RUSTDOCFLAGS", "-D warnings"))?;
    test(&[])?;
    match cargo_deny() {
        Some(deny) => {
            run(Command::new(&deny).args(["check", "bans", "licenses", "sources"]))?;
            advisories(&deny)?;
        }
        None if pg::in_ci() => bail!("CI=true and cargo-deny could not be installed"),
        None => eprintln!("skipped cargo-deny: not installed and `cargo install` failed"),
    }
    Ok(())
}

/// The pinned cargo-deny CI uses.
const CARGO_DENY: &str = "0.20.2";

/// `cargo-deny` from PATH, or installed once into `target/tools` (about two minutes).
fn cargo_deny() -> Option<PathBuf> {
    if has_program("cargo-deny") {
        return Some(PathBuf::from("cargo-deny"));
    }
    let root = crate::util::root().join("target/tools");
    let bin = root.join("bin/cargo-deny");
    if bin.exists() {
        return Some(bin);
    }
    eprintln!("installing cargo-deny {CARGO_DENY} into {}", root.display());
    let installed = run(cargo()
        .args([
            "install",
            "cargo-deny",
            "--locked",
            "--version",
            CARGO_DENY,
            "--root",
        ])
        .arg(&root));
    match installed {
        Ok(()) => Some(bin),
        Err(e) => {
            eprintln!("cargo install cargo-deny failed: {e:#}");
            None
        }
    }
}

/// The advisory check needs the RustSec database from GitHub: when it cannot be
/// fetched (no network), say so instead of failing; any advisory found fails.
fn advisories(deny: &Path) -> Result<()> {
    let out = Command::new(deny)
        .args(["check", "advisories"])
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

/// The facade crate, whose features are checked one at a time.
const FACADE: &str = "keel";

/// Crates that must stay out of a package's normal dependency tree: (package, extra
/// `cargo tree` arguments, forbidden crate, why). "Picking one crate must not drag in
/// the rest" (DESIGN.md, Layers).
const FORBIDDEN: &[(&str, &[&str], &str, &str)] = &[
    (
        "keel-compaction",
        &[],
        "reqwest",
        "compaction with the extractive summarizer needs no HTTP client",
    ),
    (
        "keel-compaction",
        &["--no-default-features"],
        "reqwest",
        "compaction with the extractive summarizer needs no HTTP client",
    ),
    (
        "keel-summarize",
        &[],
        "reqwest",
        "the summarizers need only the ChatModel contract",
    ),
    (
        "keel-summarize",
        &["--no-default-features"],
        "reqwest",
        "the summarizers need only the ChatModel contract",
    ),
    (
        "keel-model",
        &["--no-default-features"],
        "reqwest",
        "without `openai` / `ollama` keel-model is the contract alone",
    ),
    (
        "keel-model",
        &["--no-default-features", "--features", "retry"],
        "reqwest",
        "the `Retrying` wrapper needs a timer, not an HTTP client",
    ),
    (
        "keel-offload",
        &[],
        "tiktoken-rs",
        "offload counts with whatever TokenCounter it is given",
    ),
    (
        "keel-offload",
        &["--no-default-features"],
        "tiktoken-rs",
        "offload counts with whatever TokenCounter it is given",
    ),
    (
        "keel-token",
        &[],
        "tiktoken-rs",
        "the build script extracts the vocabularies, so the library links no tiktoken-rs",
    ),
    (
        "keel-token",
        &["--no-default-features", "-e", "build"],
        "tiktoken-rs",
        "exact BPE counts come only with the `tiktoken` feature",
    ),
    (
        "keel-checkpoint-postgres",
        &[],
        "rustls",
        "TLS for PostgreSQL is the `tls` feature",
    ),
    (
        "keel-fleet",
        &[],
        "rustls",
        "TLS for PostgreSQL is the `tls` feature",
    ),
];

/// `cargo check` of the feature combinations users can pick (features only add, so
/// each must build on its own):
///
/// * every library crate with `--no-default-features` (all its targets; tests that need
///   a feature say so with `required-features`);
/// * the facade with `--no-default-features` alone, with each one of its features, with
///   its defaults, and with `--all-features`.
///
/// Warnings are errors here too (a helper only one feature uses is dead code without
/// it). Crates and features come from `cargo metadata`, so new ones are checked
/// without editing this list.
fn feature_builds() -> Result<()> {
    let meta = workspace_metadata()?;
    for lib in library_crates(&meta) {
        check(&["-p", &lib, "--no-default-features", "--all-targets"])?;
    }
    check(&["-p", FACADE, "--no-default-features"])?;
    for feature in features_of(&meta, FACADE)? {
        check(&[
            "-p",
            FACADE,
            "--no-default-features",
            "--features",
            &feature,
        ])?;
    }
    check(&["-p", FACADE])?;
    check(&["-p", FACADE, "--all-features"])?;
    Ok(())
}

/// `cargo check` with `-D warnings` added to whatever `RUSTFLAGS` says.
fn check(args: &[&str]) -> Result<()> {
    let flags = match std::env::var("RUSTFLAGS") {
        Ok(f) if !f.trim().is_empty() => format!("{f} -Dwarnings"),
        _ => "-Dwarnings".to_owned(),
    };
    run(cargo().arg("check").args(args).env("RUSTFLAGS", flags))
}

/// Fails when a forbidden crate is in a package's normal dependency tree (see
/// [`FORBIDDEN`]).
fn dependency_bounds() -> Result<()> {
    let mut failures = Vec::new();
    for &(package, extra, forbidden, why) in FORBIDDEN {
        let tree = run_capture(
            cargo()
                .args(["tree", "-p", package, "-e", "normal", "--prefix", "none"])
                .args(extra),
        )?;
        if tree
            .lines()
            .any(|line| line.split_whitespace().next() == Some(forbidden))
        {
            let how = if extra.is_empty() {
                "with its default features".to_owned()
            } else {
                extra.join(" ")
            };
            let args: String = extra.iter().map(|a| format!(" {a}")).collect();
            failures.push(format!(
                "{package} ({how}) depends on {forbidden}: {why}; see `cargo tree -p {package} -e normal{args} -i {forbidden}`"
            ));
        }
    }
    if failures.is_empty() {
        eprintln!("dependency bounds: ok ({} checks)", FORBIDDEN.len());
        return Ok(());
    }
    for f in &failures {
        eprintln!("error: {f}");
    }
    bail!(
        "{} dependency bound(s) broken: a crate pulls in what it does not need",
        failures.len()
    )
}

/// `cargo metadata` for the workspace's own packages.
fn workspace_metadata() -> Result<Value> {
    let out = run_capture(cargo().args(["metadata", "--no-deps", "--format-version", "1"]))?;
    serde_json::from_str(&out).context("cargo metadata printed something that is not JSON")
}

/// The workspace packages that have a library (or proc-macro) target: every crate but
/// xtask and binaries.
fn library_crates(meta: &Value) -> Vec<String> {
    let mut libs: Vec<String> = packages(meta)
        .filter(|p| {
            p["targets"].as_array().is_some_and(|targets| {
                targets.iter().any(|t| {
                    t["kind"].as_array().is_some_and(|kinds| {
                        kinds
                            .iter()
                            .any(|k| k == "lib" || k == "proc-macro" || k == "rlib")
                    })
                })
            })
        })
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();
    libs.sort();
    libs
}

/// A package's features, `default` left out, sorted.
fn features_of(meta: &Value, package: &str) -> Result<Vec<String>> {
    let pkg = packages(meta)
        .find(|p| p["name"] == package)
        .with_context(|| format!("no package {package} in the workspace"))?;
    let mut features: Vec<String> = pkg["features"]
        .as_object()
        .map(|f| f.keys().filter(|k| *k != "default").cloned().collect())
        .unwrap_or_default();
    features.sort();
    Ok(features)
}

fn packages(meta: &Value) -> impl Iterator<Item = &Value> {
    meta["packages"].as_array().into_iter().flatten()
}
