//! `cargo xtask gen-vectors`: differential test vectors from LangGraph's `add_messages`.

use anyhow::{Result, bail};

/// Regenerates the vectors.
pub fn gen_vectors() -> Result<()> {
    bail!("gen-vectors is not written yet")
}
