//! Compaction alone, in your own agent loop: no graph, no checkpointer.
//!
//! The loop is the one every agent has: send the prompt, run the tool the reply asks
//! for, append both, repeat. keel-compaction adds two calls to it:
//! [`Compactor::after_step`] after each step (it decides whether to compact and does
//! it) and [`Compactor::call`] / [`Compactor::assemble`] to build what the model is
//! sent (system prompt, goal, epoch summary, milestones, recent raw steps).
//!
//! The "model" is deterministic ([`PolicyModel`]): it reads this repository's source
//! files one by one, then answers. The tool output is real: the first 100 numbered
//! lines of each file. Tokens are exact o200k_base counts (the `gpt-4o` profile),
//! compared at every step with what the full history would cost. Whatever leaves the
//! context goes first to an archive on disk ([`FsStore`] in a temporary directory),
//! and at the end a fact from a file read at step 1 is found again there.
//!
//! ```sh
//! cargo run -p keel --example compaction
//! ```

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel::compaction::{CompactionConfig, Compactor, ContextState, EventKind, GoalAnchor};
use keel::message::{Message, ToolCall, ToolSpec};
use keel::model::{ChatOptions, ChatResponse, PolicyModel};
use keel::offload::{Archive, FsStore, Pattern, RetrievalTools, ThreadId};
use keel::summarize::ExtractiveSummarizer;
use keel::token::{MemoCounter, ModelProfiles, TokenCounter};
use serde_json::json;

/// Lines of a file the `read_file` tool returns (as an agent's file tool would).
const READ_LINES: usize = 100;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()?;
    let files = source_files(&repo)?;
    let steps = files.len().min(64);
    println!(
        "reading {steps} of the {} source files under {}/crates",
        files.len(),
        repo.display()
    );

    // Where compacted-away history goes: an append-only archive in a store on disk.
    let dir = tempfile::tempdir()?;
    let store = Arc::new(FsStore::new(dir.path())?);
    let archive = Arc::new(Archive::new(store.clone()));
    let thread = ThreadId::new("compaction-example")?;

    // The model's profile gives its window and an exact counter for its encoding.
    let profiles = ModelProfiles::new();
    let profile = profiles.lookup("gpt-4o").clone();
    let counter = profile.counter()?;
    println!(
        "model profile {}: window {}, input budget {}, encoding {}",
        profile.name,
        profile.context_window,
        profile.input_budget(),
        profile.encoding
    );

    // A milestone every 10 steps (the default), an epoch summary every 5 milestones
    // (the default), written by the offline extractive summarizer.
    let compactor = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        archive.clone(),
        thread.clone(),
        counter.clone(),
        profile.clone(),
    )
    .with_config(CompactionConfig::default().with_every_steps(Some(10)));

    let goal =
        GoalAnchor::new("Read the source files of the keel workspace and say how many you read.")
            .with_constraints(["Only read files; never write."]);
    let system = Message::system("You are a careful coding agent.").with_id("system");
    let mut state = ContextState::new(goal.clone()).with_system(system.clone());
    let tools = [ToolSpec::new(
        "read_file",
        "Read the first lines of a file of the repository.",
        json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    )];

    // The whole history, for comparison: what an agent without compaction would send.
    let mut full = vec![system, goal.message().clone()];
    let memo = MemoCounter::new(counter.clone());

    let model = scripted_reader(&repo, &files[..steps]);
    // Per step: the tokens of the prompt the next call sends, compacted and in full.
    println!("\nstep      compacted  full history  what happened");
    loop {
        // 1. Call the model with the assembled prompt (compacts and retries if the
        //    provider reports a context overflow).
        let response = compactor
            .call(&model, &mut state, &tools, &ChatOptions::default())
            .await?;
        let reply = response.message;
        let step = state.step + 1;

        // 2. Run the tool calls it asked for (here: read a real file).
        let results: Vec<Message> = reply
            .tool_calls
            .iter()
            .map(|call| {
                let path = call
                    .arguments
                    .as_json()
                    .and_then(|a| a["path"].as_str())
                    .unwrap_or_default();
                Message::tool(call.id.clone(), read_file(&repo, path))
                    .with_id(format!("result-{step}"))
            })
            .collect();
        let done = reply.tool_calls.is_empty();
        full.push(reply.clone());
        full.extend(results.iter().cloned());

        // 3. Append the step and let the compactor decide.
        compactor.push_step(&mut state, reply, results);
        let events = compactor.after_step(&mut state, &tools).await?;

        let sent = compactor.tokens(&mut state, &tools).total;
        let whole = memo.count_prompt(&full, &tools);
        let what: Vec<String> = events
            .iter()
            .map(|e| {
                let kind = match e.kind {
                    EventKind::Milestone => format!("milestone {}", state.milestones_made),
                    EventKind::Epoch => format!(
                        "epoch {} (milestone {})",
                        state.epochs_made, state.milestones_made
                    ),
                    EventKind::Mask => "masking".to_owned(),
                    EventKind::Fit => "newest results cut to fit".to_owned(),
                };
                format!(
                    "{kind}: {:?} trigger, {} messages archived, {} -> {} tokens",
                    e.trigger, e.messages_archived, e.tokens_before, e.tokens_after
                )
            })
            .collect();
        println!("{step:>4}  {sent:>13}  {whole:>12}  {}", what.join("; "));
        if done {
            let answer = state
                .raw
                .last()
                .map(|m| m.text().into_owned())
                .unwrap_or_default();
            println!("\nanswer: {answer}");
            break;
        }
    }

    // What the model is sent now, layer by layer; the goal still heads it, byte for byte.
    let prompt = compactor.assemble(&mut state);
    let layers = compactor.tokens(&mut state, &tools);
    println!(
        "\nfinal prompt: {} messages, {} tokens (system {}, goal {}, epoch {}, milestones {}, raw {}, tools {}); full history: {} messages, {} tokens",
        prompt.len(),
        layers.total,
        layers.system,
        layers.goal,
        layers.epoch,
        layers.milestones,
        layers.raw,
        layers.tools,
        full.len(),
        memo.count_prompt(&full, &tools)
    );
    println!(
        "recounted from scratch: {} tokens; goal at the head of the prompt unchanged: {}",
        counter.count_prompt(&prompt, &tools),
        prompt.get(1) == Some(goal.message())
    );
    if let Some(epoch) = &state.epoch {
        println!(
            "epoch summary (steps {}–{}, {} tokens), first lines:\n{}",
            epoch.first_step,
            epoch.last_step,
            epoch.tokens,
            indent(&epoch.text, 4)
        );
    }

    // A fact from a file read in the first steps is no longer in the prompt, but it
    // was archived before it left: find it by search.
    let (read_at, needle) = files[..steps]
        .iter()
        .enumerate()
        .find_map(|(i, f)| fact_from(&read_file(&repo, &rel(&repo, f))).map(|fact| (i + 1, fact)))
        .ok_or("no `pub` item in the files read")?;
    let in_prompt = prompt.iter().any(|m| m.text().contains(&needle));
    println!("\nlooking for `{needle}` (read at step {read_at}); in the prompt: {in_prompt}");
    let found = archive.grep(&thread, &Pattern::literal(&needle)?, 5)?;
    for m in &found.messages {
        let text = m.message.text();
        let line = text
            .lines()
            .find(|l| l.contains(&needle))
            .unwrap_or_default();
        println!(
            "  Archive::grep: seq {}, {} message {} ({} chars), line `{}`",
            m.seq,
            m.message.role,
            m.message.id.as_deref().unwrap_or("-"),
            text.len(),
            line.trim()
        );
    }
    println!(
        "archive: {} messages in {}",
        archive.len(&thread)?,
        dir.path()
            .join(thread.as_str())
            .join(Archive::DEFAULT_PATH)
            .display()
    );

    // The agent's own way back: the retrieval tools' `grep` over the archive, as the
    // model would call it. It answers with the matching archive record (one JSON line,
    // cut to the tool's line limit), which names the archived message.
    let retrieval = RetrievalTools::new(store, thread);
    let call = ToolCall::new(
        "retrieve-1",
        "grep",
        json!({"pattern": regex_escape(&needle), "path": "archive", "max_results": 2}),
    );
    println!(
        "grep tool output:\n{}",
        indent(&retrieval.execute(&call)?, 2)
    );
    Ok(())
}

/// A deterministic stand-in for an LLM: call `i` reads `files[i]`, and the call after
/// the last file answers. It keeps a call counter and nothing else.
fn scripted_reader(repo: &Path, files: &[PathBuf]) -> PolicyModel {
    let paths: Vec<String> = files.iter().map(|f| rel(repo, f)).collect();
    let calls = AtomicUsize::new(0);
    PolicyModel::new("gpt-4o", move |_prompt, _tools| {
        let i = calls.fetch_add(1, Ordering::Relaxed);
        let message = match paths.get(i) {
            Some(path) => Message::assistant(format!("Reading {path}."))
                .with_id(format!("reply-{}", i + 1))
                .with_tool_calls(vec![ToolCall::new(
                    format!("call_{}", i + 1),
                    "read_file",
                    json!({ "path": path }),
                )]),
            None => Message::assistant(format!("I read {} source files.", paths.len()))
                .with_id(format!("reply-{}", i + 1)),
        };
        Ok(ChatResponse::new(message, "gpt-4o"))
    })
}

/// The tool: the first [`READ_LINES`] lines of a file, numbered like `cat -n`.
fn read_file(repo: &Path, path: &str) -> String {
    match std::fs::read_to_string(repo.join(path)) {
        Ok(text) => text
            .lines()
            .take(READ_LINES)
            .enumerate()
            .map(|(n, line)| format!("{:>6}\t{line}\n", n + 1))
            .collect(),
        Err(e) => format!("Error: cannot read {path}: {e}"),
    }
}

/// Every `.rs` file under `crates/*/src`, sorted.
fn source_files(repo: &Path) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let mut out = Vec::new();
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(repo.join("crates"))? {
        dirs.push(entry?.path().join("src"));
    }
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn rel(repo: &Path, file: &Path) -> String {
    file.strip_prefix(repo)
        .unwrap_or(file)
        .display()
        .to_string()
}

/// A line declaring a public item (`pub const`, `pub fn`, `pub struct`, ...), without
/// quotes or backslashes (the archive is JSON Lines: those would be escaped in it).
fn fact_from(tool_output: &str) -> Option<String> {
    tool_output
        .lines()
        .filter_map(|l| l.split_once('\t').map(|(_, code)| code.trim()))
        .find(|code| {
            code.starts_with("pub ")
                && !code.starts_with("pub use")
                && !code.starts_with("pub mod")
                && !code.contains(['"', '\\'])
        })
        .map(str::to_owned)
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~".contains(c);
            special
                .then_some('\\')
                .into_iter()
                .chain(std::iter::once(c))
        })
        .collect()
}

fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.lines()
        .take(8)
        .map(|l| format!("{pad}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
