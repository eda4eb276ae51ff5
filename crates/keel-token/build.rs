//! Extracts the BPE vocabularies from `tiktoken-rs` at build time.
//!
//! `tiktoken-rs` ships OpenAI's vocabulary files, but building its `CoreBPE` (parsing
//! the base64 file, filling three hash maps, compiling a backtracking regex) takes
//! longer than everything keel's engine needs to start. So the build script builds it
//! once and writes each encoding's tokens, rank by rank, in the form the engine loads
//! without parsing: `<encoding>.tokens` holds every token's bytes back to back and
//! `<encoding>.ends` the little-endian `u32` offset where each ends.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "tiktoken")]
    vocabularies::write_all()
        .map_err(|e| format!("keel-token: cannot extract the BPE vocabularies: {e}"))?;
    Ok(())
}

#[cfg(feature = "tiktoken")]
mod vocabularies {
    use std::path::PathBuf;

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    pub(crate) fn write_all() -> Result<()> {
        let out = PathBuf::from(std::env::var("OUT_DIR")?);
        write(&out, "o200k_base", tiktoken_rs::o200k_base()?)?;
        write(&out, "cl100k_base", tiktoken_rs::cl100k_base()?)?;
        Ok(())
    }

    fn write(out: &std::path::Path, name: &str, core: tiktoken_rs::CoreBPE) -> Result<()> {
        // Mergeable ranks are 0..n with no gap; special tokens come after a gap, so
        // decoding stops before them.
        let mut tokens = Vec::new();
        let mut ends = Vec::new();
        let mut rank: u32 = 0;
        while let Ok(bytes) = core.decode_bytes(&[rank]) {
            tokens.extend_from_slice(&bytes);
            let end = u32::try_from(tokens.len())?;
            ends.extend_from_slice(&end.to_le_bytes());
            rank += 1;
        }
        std::fs::write(out.join(format!("{name}.tokens")), tokens)?;
        std::fs::write(out.join(format!("{name}.ends")), ends)?;
        Ok(())
    }
}
