//! The trajectory loaders over any bytes: keel-compaction's tau-bench and SWE-agent
//! loaders (properties: fuzz/props/trajectory.rs), and `keel replay`'s format
//! detection and loading, built in from crates/keel-cli/src/formats.rs (a binary
//! crate's module; properties: its `fuzzing` module).
#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;

#[path = "../props/trajectory.rs"]
mod props;

#[allow(dead_code)]
#[path = "../../crates/keel-cli/src/formats.rs"]
mod formats;

/// Where this process writes each input (the loaders read files).
static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
    let dir = std::env::temp_dir()
        .join("keel-fuzz-trajectory")
        .join(std::process::id().to_string());
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
});

fuzz_target!(|data: &[u8]| {
    if let Err(e) = props::check_trajectory(&DIR, data) {
        panic!("{e}");
    }
    if let Err(e) = formats::fuzzing::check_load(&DIR, data) {
        panic!("{e}");
    }
});
