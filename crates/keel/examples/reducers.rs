//! Reducers alone, in your own loop: no graph, no runtime, no checkpointer.
//!
//! A reducer is a pure function held in a value: the channel's current value and the
//! writes of one step in, the next value out. This program keeps three channels in a
//! plain `for` loop while it counts the lines of every crate's `src/lib.rs` in this
//! repository:
//!
//! * `messages` with [`AddMessages`]: the conversation. Each step appends a tool call
//!   and its result, and rewrites one "progress" message in place (same id: replaced,
//!   not appended). At the end the older tool exchanges are removed by id.
//! * `recent_files` with [`KeepLast`]: the last three files read, never more.
//! * `total_lines` with [`Sum`]: lines counted so far (overflow is an error, not a wrap).
//!
//! ```sh
//! cargo run -p keel --example reducers
//! ```

use std::collections::VecDeque;
use std::error::Error;
use std::path::{Path, PathBuf};

use keel::message::{Message, ToolCall};
use keel::reducer::{AddMessages, AddMessagesUpdate, KeepLast, Messages, Reducer, Sum};
use serde_json::json;

fn main() -> Result<(), Box<dyn Error>> {
    // The repository this example lives in (crates/keel/../..).
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()?;
    let files = lib_files(&repo)?;
    println!(
        "{} crates with a src/lib.rs under {}",
        files.len(),
        repo.display()
    );

    // One reducer per channel, and each channel's value before any write.
    let history = AddMessages;
    let recent = KeepLast::<String>::new(3);
    let lines = Sum::<u64>::new();
    let mut messages: Messages = history.empty();
    let mut recent_files: VecDeque<String> = recent.empty();
    let mut total_lines: u64 = lines.empty();

    history.reduce(
        &mut messages,
        vec![AddMessagesUpdate::append([Message::user(
            "How many lines do the crates' lib.rs files have?",
        )
        .with_id("ask")])],
    )?;

    for (i, file) in files.iter().enumerate() {
        let rel = file.strip_prefix(&repo)?.display().to_string();
        // The "model" asks for one file; the "tool" reads it for real.
        let call_id = format!("call_{i}");
        let call = ToolCall::new(call_id.clone(), "count_lines", json!({ "path": rel }));
        let n = std::fs::read_to_string(file)?.lines().count() as u64;

        // Two writes to the messages channel in one step, folded in the order given:
        // the exchange is appended; the progress note has a fixed id, so from the
        // second step on it replaces the earlier note where it stands.
        let exchange = AddMessagesUpdate::append([
            Message::assistant("")
                .with_id(format!("a{i}"))
                .with_tool_calls(vec![call]),
            Message::tool(call_id, format!("{n} lines")).with_id(format!("r{i}")),
        ]);
        let progress = AddMessagesUpdate::append([Message::assistant(format!(
            "Progress: {} of {} files read, {} lines so far.",
            i + 1,
            files.len(),
            total_lines + n
        ))
        .with_id("progress")]);
        history.reduce(&mut messages, vec![exchange, progress])?;
        recent.reduce(&mut recent_files, vec![vec![rel]])?;
        lines.reduce(&mut total_lines, vec![n])?;
    }

    println!(
        "\nafter {} steps: {} messages; the progress note is still at position {:?}",
        files.len(),
        messages.len(),
        messages.position("progress")
    );
    println!("recent_files (KeepLast 3): {recent_files:?}");
    println!("total_lines (Sum): {total_lines}");

    // Forget all but the last two exchanges: remove a call and its result together, by
    // id, so no tool result is left without the call it answers.
    let old = files.len().saturating_sub(2);
    let ids: Vec<String> = (0..old)
        .flat_map(|i| [format!("a{i}"), format!("r{i}")])
        .collect();
    history.reduce(
        &mut messages,
        vec![
            AddMessagesUpdate::remove(ids.clone()).then(AddMessagesUpdate::append([
                Message::assistant(format!(
                    "The {} lib.rs files have {total_lines} lines in all.",
                    files.len()
                ))
                .with_id("answer"),
            ])),
        ],
    )?;
    println!(
        "\nremoved {} messages by id and appended the answer:",
        ids.len()
    );
    show(&messages);

    // A write that cannot apply is refused as a whole and changes nothing: the ids are
    // gone already.
    let before = messages.len();
    if let Err(e) = history.reduce(&mut messages, vec![AddMessagesUpdate::remove(["a0"])]) {
        println!("\nremoving a0 again: {e} (still {before} messages)");
    }

    // Updates are plain data: this is what a checkpointer stores for a step.
    let update = AddMessagesUpdate::remove(["answer"]);
    println!(
        "an update as stored: {}",
        serde_json::to_string(&update.ops())?
    );
    Ok(())
}

/// `crates/*/src/lib.rs` of the repository, sorted.
fn lib_files(repo: &Path) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(repo.join("crates"))? {
        let lib = entry?.path().join("src/lib.rs");
        if lib.is_file() {
            files.push(lib);
        }
    }
    files.sort();
    Ok(files)
}

fn show(messages: &Messages) {
    for (i, m) in messages.iter().enumerate() {
        let calls: Vec<String> = m
            .tool_calls
            .iter()
            .map(|c| format!("{}({})", c.name, c.arguments.to_json_string()))
            .collect();
        println!(
            "  [{i}] {:<9} {:<9} {}{}",
            m.role.to_string(),
            m.id.as_deref().unwrap_or("-"),
            m.text(),
            calls.join(", ")
        );
    }
}
