//! A durable agent loop on embedded defaults: no model server, no database server.
//!
//! The "model" answers from a script (the shape of a real tool-calling agent), the
//! tools run locally, and every superstep is checkpointed. Run it with
//!
//! ```sh
//! cargo run -p keel-graph --example quickstart
//! ```
//!
//! It prints each step as it streams, stops at a human-approval interrupt, resumes
//! with the answer, and then shows the thread's checkpoint history, all stored in a
//! SQLite file (in a temporary directory, removed at the end).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use keel_checkpoint_sqlite::SqliteSaver;
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, MessageOp, Messages};
use keel_graph::{
    Command, END, Event, NodeContext, RunConfig, START, State, StateGraph, StreamMode,
};
use keel_message::{Message, Role, ToolCall};
use serde_json::json;

#[derive(Clone, State)]
struct Agent {
    #[reducer(AddMessages)]
    messages: Messages,
    #[reducer(keel_graph::reducer::Sum<u32>)]
    model_calls: u32,
}

/// What the scripted model says on its n-th call.
fn scripted_model(call: u32) -> Message {
    match call {
        0 => Message::assistant("Let me look at the project first.")
            .with_tool_calls(vec![ToolCall::new("c1", "ls", json!({"path": "."}))]),
        1 => Message::assistant("I will count the lines of the manifest.").with_tool_calls(vec![
            ToolCall::new("c2", "wc", json!({"file": "Cargo.toml"})),
        ]),
        _ => Message::assistant("Done: the workspace has a manifest of 42 lines."),
    }
}

fn run_tool(call: &ToolCall) -> String {
    match call.name.as_str() {
        "ls" => "Cargo.toml\ncrates/\ndocs/\nREADME.md".to_owned(),
        "wc" => "42 Cargo.toml".to_owned(),
        other => format!("error: unknown tool {other}"),
    }
}

fn last_has_tool_calls(s: &Agent) -> bool {
    s.messages
        .iter()
        .last()
        .is_some_and(|m| m.role == Role::Assistant && !m.tool_calls.is_empty())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The embedded default: one SQLite file, no server.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("keel.sqlite");
    let saver = Arc::new(SqliteSaver::open(&path).await?);
    let graph = StateGraph::<Agent>::new()
        .add_node("agent", |s: Arc<Agent>, _ctx| async move {
            Ok(AgentUpdate::default()
                .messages(AddMessagesUpdate::append([scripted_model(s.model_calls)]))
                .model_calls(1))
        })
        .add_node("tools", |s: Arc<Agent>, ctx: NodeContext| async move {
            let calls = s
                .messages
                .iter()
                .last()
                .map(|m| m.tool_calls.clone())
                .unwrap_or_default();
            // A human approves each batch of tool calls.
            let answer = ctx
                .interrupt(json!({"approve": calls.iter().map(|c| &c.name).collect::<Vec<_>>()}))?;
            let results = calls.iter().map(|c| {
                let text = if answer == json!("yes") {
                    run_tool(c)
                } else {
                    "denied".to_owned()
                };
                Message::tool(c.id.clone(), text)
            });
            Ok(AgentUpdate::default().messages(AddMessagesUpdate::append(results)))
        })
        .add_edge(START, "agent")
        .add_conditional_edges(
            "agent",
            |s: &Agent| if last_has_tool_calls(s) { "tools" } else { END },
            Some(&["tools", END]),
        )
        .add_edge("tools", "agent")
        .with_checkpointer(saver)
        .compile()?;

    let config = RunConfig::thread("quickstart");
    let ask = Message::user("How long is the manifest?");
    println!("input          {}", describe(&ask));
    let mut input: Command<Agent> = AgentUpdate::default()
        .messages(AddMessagesUpdate::append([ask]))
        .into();
    loop {
        let mut events = graph.stream(input, config.clone(), StreamMode::updates());
        let mut paused = false;
        while let Some(event) = events.next().await {
            let event = event?;
            // The node's update as it returned it (typed, not JSON).
            let update = event.typed_update().transpose()?;
            match event {
                Event::Updates { step, node, .. } => {
                    let ops = update.and_then(|u| u.messages).into_iter();
                    for op in ops.flat_map(AddMessagesUpdate::into_ops) {
                        if let MessageOp::Upsert(m) = op {
                            println!("step {step:>2} {node:>6}: {}", describe(&m));
                        }
                    }
                }
                Event::Done { interrupts, .. } if !interrupts.is_empty() => {
                    println!("  paused: {} — answering \"yes\"", interrupts[0].value);
                    paused = true;
                }
                _ => {}
            }
        }
        if !paused {
            break;
        }
        input = Command::resume("yes");
    }

    let history: Vec<_> = graph
        .state_history(&config, keel_checkpoint::ListOptions::default())
        .try_collect()
        .await?;
    let latest = &history[0].values;
    println!(
        "\n{} messages, {} model calls, {} checkpoints stored in {}; final answer: {}",
        latest.messages.len(),
        latest.model_calls,
        history.len(),
        path.display(),
        latest
            .messages
            .iter()
            .last()
            .map(|m| m.text().into_owned())
            .unwrap_or_default()
    );
    Ok(())
}

/// One line per message: role, text, and any tool calls.
fn describe(m: &Message) -> String {
    let mut line = format!("{:<9} {}", m.role.as_str(), m.text().replace('\n', " | "));
    for c in &m.tool_calls {
        line.push_str(&format!(" -> {}({})", c.name, c.arguments.to_json_string()));
    }
    line
}
