//! The graph benchmark's workload (keel-graph's `bench_loop` example), shared by the
//! crash child, the tests and the Postgres benchmark: one node in a self-loop, each
//! step appending one ~220-byte message through `AddMessages` and bumping a counter.
//!
//! With `fan_out`, every step also runs a second node, `note`, beside `step`, so each
//! step has two tasks and their writes are saved with `put_writes` as they finish.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use keel_checkpoint::Checkpointer;
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Messages};
use keel_graph::{CompiledGraph, END, Route, START, State, StateGraph};
use keel_message::Message;

#[derive(Clone, State)]
pub struct Loop {
    #[reducer(AddMessages)]
    pub messages: Messages,
    pub count: u64,
}

/// About 220 bytes of text, varying per step.
pub fn text(step: u64) -> String {
    let mut s = format!("step {step}: ");
    while s.len() < 220 {
        s.push_str("the agent read the file, ran the tests and noted the result; ");
    }
    s.truncate(220);
    s
}

/// How a loop graph is built.
#[derive(Clone, Copy, Default)]
pub struct Options {
    /// Give messages ids derived from the step (deterministic across re-runs).
    pub stable_ids: bool,
    /// Run a second node beside the loop node in every step.
    pub fan_out: bool,
}

/// The loop graph for `n` steps; `on_step(count)` is called as each `step` task starts.
pub fn graph(
    n: u64,
    saver: Option<Arc<dyn Checkpointer>>,
    options: Options,
    on_step: Arc<dyn Fn(u64) + Send + Sync>,
) -> CompiledGraph<Loop> {
    let mut g = StateGraph::<Loop>::new()
        .add_node("step", move |s: Arc<Loop>, _c| {
            let on_step = Arc::clone(&on_step);
            async move {
                on_step(s.count);
                let mut message = Message::assistant(text(s.count));
                if options.stable_ids {
                    message = message.with_id(format!("step-{}", s.count));
                }
                Ok(LoopUpdate::default()
                    .messages(AddMessagesUpdate::append([message]))
                    .count(s.count + 1))
            }
        })
        .add_edge(START, "step");
    if options.fan_out {
        g = g
            .add_node("note", |s: Arc<Loop>, _c| async move {
                // Runs beside `step`, on the state before it: count is already bumped.
                let step = s.count.saturating_sub(1);
                let message =
                    Message::user(format!("note on step {step}")).with_id(format!("note-{step}"));
                Ok(LoopUpdate::default().messages(AddMessagesUpdate::append([message])))
            })
            .add_edge("note", END);
    }
    let fan_out = options.fan_out;
    g = g.add_conditional_edges(
        "step",
        move |s: &Loop| -> Route {
            match (s.count < n, fan_out) {
                (true, true) => vec!["step", "note"].into(),
                (true, false) => "step".into(),
                (false, _) => END.into(),
            }
        },
        None,
    );
    if let Some(saver) = saver {
        g = g.with_checkpointer(saver);
    }
    g.compile().unwrap()
}

/// The `(id, text)` of every message, for comparing runs.
pub fn transcript(state: &Loop) -> Vec<(Option<String>, String)> {
    state
        .messages
        .iter()
        .map(|m| (m.id.clone(), serde_json::to_string(&m.content).unwrap()))
        .collect()
}
