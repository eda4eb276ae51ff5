//! Very long runs: more than two summary tiers keep old constraints and decisions in
//! the prompt and the summary layers within a bound that does not grow with the run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::{CompactionConfig, Compactor, ContextState, GoalAnchor, LayerLevel};
use keel_message::{Message, ToolCall};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{ApproxCounter, Encoding, ModelProfile};
use serde_json::json;

fn compactor(config: CompactionConfig) -> (Compactor, Arc<Archive>, ThreadId) {
    let archive = Arc::new(Archive::new(Arc::new(MemoryStore::new())));
    let thread = ThreadId::new("long").unwrap();
    let c = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        archive.clone(),
        thread.clone(),
        Arc::new(ApproxCounter::new()),
        ModelProfile::new("small", 16_000, 2_000, Encoding::Approximate),
    )
    .with_config(config);
    (c, archive, thread)
}

/// A plain step: a call and a log that says nothing lasting.
fn step(i: usize) -> (Message, Vec<Message>) {
    let reply =
        Message::assistant(format!("Reading chunk {i}.")).with_tool_calls(vec![ToolCall::new(
            format!("c{i}"),
            "read_chunk",
            json!({"chunk": i}),
        )]);
    let log: String = (0..6)
        .map(|k| format!("chunk {i} row {k}: value ok\n"))
        .collect();
    (reply, vec![Message::tool(format!("c{i}"), log)])
}

/// The summary layers' tokens.
fn layer_tokens(state: &ContextState) -> usize {
    state.layers().map(|l| l.tokens).sum()
}

#[tokio::test]
async fn a_thousand_steps_keep_early_constraints_in_the_prompt_within_a_flat_bound() {
    let config = CompactionConfig::default()
        .with_every_steps(Some(4))
        .with_keep_recent_tokens(100)
        .with_max_steps(2_000);
    assert_eq!((config.summary_tiers, config.keep_summaries), (3, 3));
    let (c, archive, thread) = compactor(config);
    let mut state = ContextState::new(GoalAnchor::new("Process every chunk of the dataset."));
    let planted = [
        (
            5,
            Message::user("Constraint: never write to the production database; use replica-db-7."),
        ),
        (
            100,
            Message::assistant(
                "Decided to switch the parser to streaming mode because chunks exceed 2 GB.",
            ),
        ),
        (
            500,
            Message::user("From now on every report must be written in French."),
        ),
    ];
    let kept = ["replica-db-7", "streaming mode", "written in French"];
    let mut at_300 = 0;
    for i in 1..=1_000 {
        let (reply, results) = step(i);
        c.push_step(&mut state, reply, results);
        for (at, m) in &planted {
            if *at == i {
                c.push(&mut state, vec![m.clone()]);
            }
        }
        c.after_step(&mut state, &[]).await.unwrap();
        if i == 300 {
            at_300 = layer_tokens(&state);
        }
    }
    // Still in the prompt (not only in the archive).
    let prompt: String = c
        .assemble(&mut state)
        .iter()
        .map(|m| m.text().into_owned())
        .collect::<Vec<_>>()
        .join("\n");
    for k in kept {
        assert!(prompt.contains(k), "{k} left the prompt:\n{prompt}");
    }
    // Three tiers: an era at the top, at most three kept epochs, a few milestones.
    assert!(matches!(
        state.epoch.as_ref().map(|l| l.level),
        Some(LayerLevel::Era(3))
    ));
    assert!(state.epochs.len() <= 3);
    assert!(state.epochs.iter().all(|l| l.level == LayerLevel::Epoch));
    assert!(state.milestones.len() < 5);
    // The layers cover every step before the raw buffer, in order.
    let mut next = 1;
    for l in state.layers() {
        assert_eq!(
            l.first_step,
            next,
            "{}",
            l.message.text().lines().next().unwrap()
        );
        next = l.last_step + 1;
    }
    // The summary layers stay within a bound that does not grow with the run.
    let at_1000 = layer_tokens(&state);
    assert!(at_300 > 0);
    assert!(
        at_1000 * 10 <= at_300 * 12,
        "layers at 1,000 steps: {at_1000} tokens, at 300: {at_300}"
    );
    assert!(archive.len(&thread).unwrap() > 2_000);
}

#[tokio::test]
async fn two_tiers_keep_the_old_rolling_epoch() {
    let config = CompactionConfig::default()
        .with_every_steps(Some(4))
        .with_keep_recent_tokens(100)
        .with_summary_tiers(2, 3);
    let (c, _, _) = compactor(config);
    let mut state = ContextState::new(GoalAnchor::new("Process every chunk of the dataset."));
    for i in 1..=120 {
        let (reply, results) = step(i);
        c.push_step(&mut state, reply, results);
        c.after_step(&mut state, &[]).await.unwrap();
    }
    assert!(state.epochs.is_empty());
    assert_eq!(
        state.epoch.as_ref().map(|l| l.level),
        Some(LayerLevel::Epoch)
    );
    assert_eq!(state.epoch.as_ref().map(|l| l.first_step), Some(1));
}
