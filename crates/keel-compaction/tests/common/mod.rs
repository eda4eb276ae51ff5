//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// `../shared/data` beside the repository, or `None` (with the reason on stderr) when
/// it is absent.
pub fn data() -> Option<PathBuf> {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data"));
    if dir.join("tau-bench/gpt-4o-airline.json").exists() {
        Some(dir)
    } else {
        eprintln!(
            "skipped: {} is absent (the shared trajectories exist only in CI)",
            dir.display()
        );
        None
    }
}
