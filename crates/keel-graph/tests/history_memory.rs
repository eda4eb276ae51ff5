//! `state_history` is a stream: reading a long thread's history holds one state at a
//! time, not every checkpoint's state at once (which took 1.9 GB at 4,001 checkpoints
//! and was killed at 21 GB on a 20,001-step thread).
//!
//! Peaks are measured with a counting global allocator (peak_alloc) above what is
//! allocated before the history is read (the thread itself, in a `MemorySaver`). The
//! tests of this file take a lock, so they never measure each other.
//!
//! `history_of_20001_steps_stays_under_100_mb` is ignored by default (it rebuilds
//! 20,001 states of up to 20,001 messages); run it with
//! `cargo test --release -p keel-graph --test history_memory -- --ignored --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use futures::StreamExt;
use keel_checkpoint::{ListOptions, MemorySaver};
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Messages};
use keel_graph::{CompiledGraph, END, RunConfig, START, State, StateGraph};
use keel_message::Message;
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const MB: f64 = 1024.0 * 1024.0;

/// The `bench_loop` workload: one ~220-byte message and a counter per step.
#[derive(Clone, State)]
struct Loop {
    #[reducer(AddMessages)]
    messages: Messages,
    count: u64,
}

fn text(step: u64) -> String {
    let mut s = format!("step {step}: ");
    while s.len() < 220 {
        s.push_str("the agent read the file, ran the tests and noted the result; ");
    }
    s.truncate(220);
    s
}

/// A thread of `steps` steps (`steps + 1` checkpoints with the input).
async fn thread(steps: u64) -> (CompiledGraph<Loop>, RunConfig) {
    let g = StateGraph::<Loop>::new()
        .add_node("step", |s: Arc<Loop>, _c| async move {
            Ok(LoopUpdate::default()
                .messages(AddMessagesUpdate::append([Message::assistant(text(
                    s.count,
                ))]))
                .count(s.count + 1))
        })
        .add_edge(START, "step")
        .add_conditional_edges(
            "step",
            move |s: &Loop| if s.count < steps { "step" } else { END },
            None,
        )
        .with_checkpointer(Arc::new(MemorySaver::new()))
        .compile()
        .unwrap();
    let config = RunConfig::thread("long").with_recursion_limit(usize::MAX);
    let run = g.invoke(LoopUpdate::default(), &config).await.unwrap();
    assert_eq!(run.state.count, steps);
    (g, config)
}

/// Reads the whole history one item at a time, checking each; returns how many
/// there were and the peak above the start, in MB.
#[allow(dead_code)]
async fn stream_peak(g: &CompiledGraph<Loop>, config: &RunConfig) -> (u64, f64) {
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let mut history = g.state_history(config, ListOptions::default());
    let mut seen = 0u64;
    let mut expect = None;
    while let Some(snapshot) = history.next().await {
        let snapshot = snapshot.unwrap();
        // Newest first: each state is one step short of the one before.
        let count = snapshot.values.count;
        assert_eq!(snapshot.values.messages.len() as u64, count);
        if let Some(expect) = expect {
            assert_eq!(count, expect);
        }
        expect = count.checked_sub(1);
        seen += 1;
    }
    let peak = ALLOC.peak_usage().saturating_sub(base) as f64 / MB;
    (seen, peak)
}

/// A lighter state for the test that runs everywhere: one ~220-byte line per step.
#[derive(Clone, State)]
struct Lines {
    #[reducer(keel_graph::reducer::Append<String>)]
    lines: Vec<String>,
}

#[tokio::test]
async fn history_of_2000_steps_streams_in_bounded_memory() {
    let _one = ONE_AT_A_TIME.lock().await;
    const STEPS: usize = 2_000;
    let g = StateGraph::<Lines>::new()
        .add_node("step", |s: Arc<Lines>, _c| async move {
            Ok(LinesUpdate::default().lines(vec![text(s.lines.len() as u64)]))
        })
        .add_edge(START, "step")
        .add_conditional_edges(
            "step",
            |s: &Lines| if s.lines.len() < STEPS { "step" } else { END },
            None,
        )
        .with_checkpointer(Arc::new(MemorySaver::new()))
        .compile()
        .unwrap();
    let config = RunConfig::thread("lines");
    g.invoke(LinesUpdate::default(), &config).await.unwrap();

    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let mut history = g.state_history(&config, ListOptions::default());
    let mut expect = STEPS;
    while let Some(snapshot) = history.next().await {
        let lines = snapshot.unwrap().values.lines;
        assert_eq!(lines.len(), expect, "newest first, one step apart");
        expect = expect.wrapping_sub(1);
    }
    assert_eq!(expect, usize::MAX, "every checkpoint, the input's included");
    let streamed = ALLOC.peak_usage().saturating_sub(base) as f64 / MB;

    // Holding every state at once, as the history used to, takes at least the lines
    // of them all: 0 + 1 + ... + 2,000 lines of 220 bytes, 420 MB.
    let held_at_least = (STEPS * (STEPS + 1) / 2 * 220) as f64 / MB;
    println!(
        "2,000 steps: history peak {streamed:.1} MB; every state at once >= {held_at_least:.0} MB"
    );
    assert!(
        streamed < 8.0 && streamed * 50.0 < held_at_least,
        "history peaked at {streamed:.1} MB"
    );
}

#[tokio::test]
#[ignore = "rebuilds 20,001 states of up to 20,001 messages: run in release with --ignored"]
async fn history_of_20001_steps_stays_under_100_mb() {
    let _one = ONE_AT_A_TIME.lock().await;
    let start = std::time::Instant::now();
    let (g, config) = thread(20_001).await;
    let stored = ALLOC.current_usage() as f64 / MB;
    let (seen, peak) = stream_peak(&g, &config).await;
    assert_eq!(seen, 20_002);
    println!(
        "20,001 steps ({stored:.0} MB stored in memory): history peak {peak:.1} MB above that, {:.0} s in all",
        start.elapsed().as_secs_f64()
    );
    assert!(peak < 100.0, "history peaked at {peak:.1} MB");
}
