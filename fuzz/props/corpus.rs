//! Replays a fuzz target's corpus (fuzz/corpus/<target>/) through its check, for the
//! owning crates' tests.

use std::path::{Path, PathBuf};

/// Every file of `fuzz/corpus/<target>/`, sorted; fails when there is none.
pub fn files(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path()
        })
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no inputs", dir.display());
    files
}

/// Runs `check` on every file of the corpus of `target`, failing on the first error.
#[allow(dead_code)]
pub fn replay(target: &str, check: impl Fn(&[u8]) -> Result<(), String>) {
    for file in files(target) {
        let data = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        if let Err(e) = check(&data) {
            panic!("{}: {e}", file.display());
        }
    }
}
