//! `cargo xtask llm-live`: the provider and summarizer tests against a real model server.
//!
//! Runs the `#[ignore]`d `live` tests of keel-model and keel-summarize when
//! `OPENAI_BASE_URL` (an OpenAI-compatible server, e.g. llama.cpp's at
//! `http://127.0.0.1:8089/v1`) or `OLLAMA_BASE_URL` is set; `OPENAI_MODEL` /
//! `OLLAMA_MODEL` choose the model (default: the first one the server lists). With
//! neither set it says it skipped and succeeds. The server must pass tools to the
//! model (llama-cpp-python: `--chat_format chatml-function-calling`; llama.cpp:
//! `--jinja`): a reply that answers in prose where it was asked to call a tool fails.

use anyhow::Result;

use crate::util::{cargo, run};

fn set(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Runs the live tests, or reports that they were skipped.
pub fn live() -> Result<()> {
    let openai = set("OPENAI_BASE_URL");
    let ollama = set("OLLAMA_BASE_URL");
    if openai.is_none() && ollama.is_none() {
        println!(
            "llm-live: skipped: neither OPENAI_BASE_URL nor OLLAMA_BASE_URL is set \
             (e.g. OPENAI_BASE_URL=http://127.0.0.1:8089/v1 for a local llama.cpp server)"
        );
        return Ok(());
    }
    for (name, url) in [("OPENAI_BASE_URL", &openai), ("OLLAMA_BASE_URL", &ollama)] {
        match url {
            Some(u) => eprintln!("llm-live: {name}={u}"),
            None => eprintln!("llm-live: {name} not set; its tests will say they skipped"),
        }
    }
    run(cargo().args([
        "test",
        "-p",
        "keel-model",
        "-p",
        "keel-summarize",
        "--test",
        "live",
        "--",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]))
}
