//! `cargo xtask gen-vectors`: differential test vectors from LangGraph's `add_messages`.
//!
//! Installs the pinned LangGraph in the peer virtualenv, runs
//! `xtask/peers/add_messages_vectors.py`, and writes
//! `crates/keel-reducer/tests/vectors/add_messages.json`, which is committed: the Rust
//! test that replays it (`cargo test -p keel-reducer --test add_messages_vectors`)
//! needs no Python.

use anyhow::{Context, Result};

use crate::python::Venv;
use crate::util::{root, run};

/// The LangGraph the vectors come from, and the langchain-core it was tested with.
const PEERS: &[&str] = &["langgraph==1.2.24", "langchain-core==1.8.3"];

const SCRIPT: &str = "xtask/peers/add_messages_vectors.py";
const OUT: &str = "crates/keel-reducer/tests/vectors/add_messages.json";

/// Regenerates the vectors.
pub fn gen_vectors() -> Result<()> {
    let venv = Venv::ensure(PEERS)?;
    let out = root().join(OUT);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    run(venv.python().arg(SCRIPT).arg(&out))
        .context("generating the add_messages vectors with LangGraph")?;
    eprintln!("now run: cargo test -p keel-reducer --test add_messages_vectors");
    Ok(())
}
