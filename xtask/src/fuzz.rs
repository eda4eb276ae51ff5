//! `cargo xtask fuzz`: runs the cargo-fuzz targets of `fuzz/` for a while each.
//!
//! Each target runs with nightly, debug assertions on (so arithmetic overflow is a
//! crash too), for `--seconds` of libFuzzer time. What a run adds to a corpus goes to
//! `fuzz/target/corpus/<target>/` (gitignored, kept between runs); the committed seeds
//! in `fuzz/corpus/<target>/` are read, not written. A crash is left by libFuzzer in
//! `fuzz/artifacts/<target>/`, and the command fails naming each target that crashed
//! with its new artifacts. CI does not fuzz: it replays the committed corpora through
//! the owning crates' tests.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util::{cmd, has_program, root, run};

/// The targets of `fuzz/Cargo.toml`, in the order they run.
pub const TARGETS: [&str; 7] = [
    "openai_import",
    "langchain_import",
    "trajectory_import",
    "sse_stream",
    "ndjson_stream",
    "retry_after",
    "offload_key",
];

/// Runs `targets` (names from [`TARGETS`]; all when empty) for `seconds` each.
pub fn fuzz(seconds: u64, targets: &[String]) -> Result<()> {
    let chosen: Vec<&str> = if targets.is_empty() {
        TARGETS.to_vec()
    } else {
        targets.iter().map(String::as_str).collect()
    };
    if !has_program("cargo-fuzz") {
        eprintln!("cargo-fuzz is not installed; installing it");
        run(cmd("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    let fuzz_dir = root().join("fuzz");
    let mut crashed = Vec::new();
    for target in chosen {
        let work = fuzz_dir.join("target/corpus").join(target);
        std::fs::create_dir_all(&work)
            .with_context(|| format!("cannot create {}", work.display()))?;
        let artifacts = fuzz_dir.join("artifacts").join(target);
        let before = listing(&artifacts);
        // `cargo +nightly` goes through rustup's proxy, not the cargo running xtask.
        let mut c = cmd("cargo");
        c.current_dir(&fuzz_dir)
            .args(["+nightly", "fuzz", "run", "--debug-assertions", target])
            .arg(&work)
            .arg(Path::new("corpus").join(target))
            .arg("--")
            .arg(format!("-max_total_time={seconds}"));
        let result = run(&mut c);
        let new: Vec<PathBuf> = listing(&artifacts).difference(&before).cloned().collect();
        match (result, new.is_empty()) {
            (Ok(()), true) => {}
            (Ok(()), false) | (Err(_), false) => crashed.push((target, new)),
            (Err(e), true) => {
                crashed.push((target, vec![PathBuf::from(format!("(no artifact: {e:#})"))]))
            }
        }
    }
    if crashed.is_empty() {
        eprintln!("fuzz: no crash in {seconds} s per target");
        return Ok(());
    }
    let mut report = String::from("fuzz targets crashed:");
    for (target, files) in &crashed {
        for f in files {
            report.push_str(&format!("\n  {target}: {}", f.display()));
        }
    }
    report.push_str(
        "\nreproduce with `cargo +nightly fuzz run <target> <artifact>` in fuzz/; once fixed, \
         minimize (`cargo +nightly fuzz tmin <target> <artifact>`) and add the input to \
         fuzz/corpus/<target>/, which the owning crate's tests replay",
    );
    bail!(report)
}

/// The files in `dir` (none if it does not exist).
fn listing(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default()
}
