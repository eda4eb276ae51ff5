//! A graph of your own over the agent's state, reusing keel-agent's compaction nodes.
//!
//! The loop here is not an LLM agent at all: a `research` node reads
//! `docs/architecture.md` one section per step and appends each read as a tool call
//! and its result, the shape the compaction engine works on. keel-agent's `compact`
//! and `epoch` nodes and its routers ([`AgentNodes`]) turn the older steps into
//! milestones and fold milestones into an epoch summary, archiving what leaves first.
//!
//! ```text
//! START → research ─(trigger fires)→ compact ─(3 milestones)→ epoch
//!            ▲  └─(all read)→ END       │                       │
//!            └──────────────────────────┴───────────────────────┘
//! ```
//!
//! ```sh
//! cargo run -p keel --example custom_graph
//! ```

use std::error::Error;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;
use keel::agent::{Agent, AgentNodes, AgentState, AgentStateUpdate, COMPACT, EPOCH};
use keel::checkpoint::MemorySaver;
use keel::compaction::{CompactionConfig, GoalAnchor};
use keel::graph::reducer::AddMessagesUpdate;
use keel::graph::{END, Event, NodeError, RunConfig, START, StateGraph, StreamMode};
use keel::message::{Message, ToolCall};
use keel::offload::{Archive, MemoryStore, Pattern, ThreadId};
use serde_json::json;

const RESEARCH: &str = "research";
const THREAD: &str = "architecture-notes";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/architecture.md");
    let sections = Arc::new(sections(&std::fs::read_to_string(&doc)?));
    println!("{} sections in {}", sections.len(), doc.display());

    // The nodes hold the compaction settings, the model profile (window, token
    // counter), the summarizer and the offload store; no model is needed for them.
    let store = Arc::new(MemoryStore::new());
    let saver = Arc::new(MemorySaver::new());
    let nodes: AgentNodes = Agent::builder()
        // Where the archive of compacted history goes (kept here to read it back).
        .offload_store(store.clone())
        // The nodes prune old checkpoints after each compaction through the builder's
        // checkpointer: give it the one the graph below uses.
        .checkpointer(saver.clone())
        .retrieval_tools(false)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(4))
                .with_keep_recent_tokens(300)
                .with_epoch_every(3),
        )
        .build_nodes()?;

    let graph = StateGraph::<AgentState>::new()
        // The research node: reads the next section as a tool call and its result. It
        // calls no model; it counts its reads in `step`, as the compaction triggers do.
        .add_node(RESEARCH, {
            let sections = sections.clone();
            move |state: Arc<AgentState>, _ctx| {
                let sections = sections.clone();
                async move {
                    let i = usize::try_from(state.step).map_err(NodeError::new)?;
                    let (title, body) = sections
                        .get(i)
                        .ok_or_else(|| NodeError::msg("no section left to read"))?;
                    let id = format!("read_{}", i + 1);
                    let call = ToolCall::new(id.clone(), "read_section", json!({ "title": title }));
                    Ok(AgentStateUpdate::default()
                        .messages(AddMessagesUpdate::append([
                            Message::assistant(format!("Reading \"{title}\"."))
                                .with_tool_calls(vec![call]),
                            Message::tool(id, body.clone()).with_name("read_section"),
                        ]))
                        .step(state.step + 1))
                }
            }
        })
        .add_node(COMPACT, nodes.compact())
        .add_node(EPOCH, nodes.epoch())
        .add_edge(START, RESEARCH)
        .add_conditional_edges(
            RESEARCH,
            after_research(&nodes, sections.len()),
            Some(&[RESEARCH, COMPACT, END]),
        )
        .add_conditional_edges(COMPACT, after_compact(&nodes), Some(&[RESEARCH, EPOCH]))
        .add_edge(EPOCH, RESEARCH)
        .with_checkpointer(saver)
        .compile()?;

    // The first write of a thread sets its goal (a write-once channel).
    let input = AgentStateUpdate::default().goal(GoalAnchor::new(
        "Take notes on keel's architecture, one section at a time.",
    ));
    // The whole state after each step, and which node wrote it.
    let mut events = graph.stream(
        input,
        RunConfig::thread(THREAD),
        StreamMode::values().with_updates(),
    );
    let compactor = nodes.compactor(THREAD)?;
    let specs = nodes.toolbox().specs().to_vec();
    // The first state is the input's (only the goal so far).
    let mut node = String::from("input");
    let mut milestones_seen = 0;
    while let Some(event) = events.next().await {
        match event? {
            Event::Updates { node: n, .. } => node = n,
            Event::Values { state, .. } => {
                let Some(mut context) = state.context() else {
                    continue;
                };
                let tokens = compactor.tokens(&mut context, &specs).total;
                println!(
                    "{node:>9}: step {:>2}, {:>2} raw messages, {} milestones, {} epoch summaries, prompt {tokens} tokens",
                    state.step,
                    state.messages.len(),
                    state.milestones.len(),
                    // The kept epoch summaries; `state.epoch` is the tier above them
                    // (the era), made once more epochs exist than are kept.
                    state.epochs.len(),
                );
                if state.milestones_made > milestones_seen {
                    milestones_seen = state.milestones_made;
                    if let Some(m) = state.milestones.last() {
                        println!(
                            "           milestone {} covers steps {}–{} in {} tokens; it begins:\n{}",
                            state.milestones_made,
                            m.first_step,
                            m.last_step,
                            m.tokens,
                            head(&m.text, 4)
                        );
                    }
                }
                if node == EPOCH
                    && let Some(e) = state.epochs.last()
                {
                    println!(
                        "           epoch {} covers steps {}–{} in {} tokens",
                        state.epochs_made, e.first_step, e.last_step, e.tokens
                    );
                }
            }
            Event::Done { .. } => println!("done"),
            _ => {}
        }
    }
    // With asynchronous durability and a durable saver the compaction nodes prune in
    // the background; `settle` waits for that and removes what only pruned checkpoints
    // saw, as `Agent::run` does when a run ends (here, in memory, there is nothing left).
    nodes.settle(THREAD).await?;

    let state = graph
        .get_state(&RunConfig::thread(THREAD))
        .await?
        .ok_or("no state")?
        .values;
    println!(
        "\n{} research steps, {} milestones and {} epoch made, {} messages still raw",
        state.step,
        state.milestones_made,
        state.epochs_made,
        state.messages.len()
    );

    // Everything that left the raw buffer went to the archive first, in the thread's
    // namespace of the offload store: find the first section's opening line there.
    let archive = Archive::new(store);
    let thread = ThreadId::new(THREAD)?;
    let line = sections
        .iter()
        .flat_map(|(_, body)| body.lines())
        .find(|l| l.len() > 20 && !l.contains(['"', '\\']))
        .ok_or("no line to look for")?;
    let found = archive.grep(&thread, &Pattern::literal(line)?, 1)?;
    let hit = found.messages.first().ok_or("not archived")?;
    println!(
        "archive: {} messages; `{line}` is in archive seq {}, the result of call {}",
        archive.len(&thread)?,
        hit.seq,
        hit.message.tool_call_id.as_deref().unwrap_or("-")
    );
    Ok(())
}

/// After `research`: stop when every section is read; else compact when keel-agent's
/// router says so (it names its own `agent` node otherwise: go back to `research`).
fn after_research(
    nodes: &AgentNodes,
    sections: usize,
) -> impl Fn(&AgentState) -> &'static str + Send + Sync + 'static {
    let route = nodes.route_after_tools();
    move |state| {
        if state.step as usize >= sections {
            END
        } else if route(state) == COMPACT {
            COMPACT
        } else {
            RESEARCH
        }
    }
}

/// After `compact`: to `epoch` when enough milestones wait, else back to `research`.
fn after_compact(
    nodes: &AgentNodes,
) -> impl Fn(&AgentState) -> &'static str + Send + Sync + 'static {
    let nodes = nodes.clone();
    move |state| {
        if nodes.wants_epoch(state) {
            EPOCH
        } else {
            RESEARCH
        }
    }
}

/// `(heading, text)` of each section of a Markdown document.
fn sections(markdown: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in markdown.lines() {
        if let Some(title) = line.strip_prefix('#') {
            out.push((
                title.trim_start_matches('#').trim().to_owned(),
                String::new(),
            ));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

fn head(text: &str, lines: usize) -> String {
    text.lines()
        .take(lines)
        .map(|l| format!("             {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
