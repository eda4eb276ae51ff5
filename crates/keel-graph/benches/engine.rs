//! The engine's hot paths, each on a prepared thread or graph (setup is not timed):
//!
//! - `loop_steps/<saver>`: a 200-step self-loop, one ~220-byte message and a counter
//!   per step (the `bench_loop` example's workload), without a saver and on
//!   `MemorySaver`: scheduling, folding and checkpoint writes.
//! - `resume/<n>`: continuing a finished thread of `n` steps (`Command::none()`):
//!   loading the checkpoint and rebuilding its state, nothing to run.
//! - `fan_out_routers/<n>`: one step of 8 parallel nodes, each with its own router,
//!   over a state holding `n` messages: every router sees the state with its own
//!   node's writes.
//! - `history/<n>`: reading the whole history of an `n`-step thread.
//!
//! Run: `cargo bench -p keel-graph --bench engine`; medians are in
//! `target/criterion/<group>/<name>/new/estimates.json`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use futures::StreamExt;
use keel_checkpoint::{ListOptions, MemorySaver};
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Append, Messages};
use keel_graph::{Command, CompiledGraph, END, RunConfig, START, State, StateGraph};
use keel_message::Message;

#[derive(Clone, State)]
struct Loop {
    #[reducer(AddMessages)]
    messages: Messages,
    count: u64,
}

#[derive(Clone, State)]
struct Fan {
    #[reducer(AddMessages)]
    messages: Messages,
    #[reducer(Append<String>)]
    seen: Vec<String>,
}

/// About 220 bytes of text, varying per step.
fn text(step: u64) -> String {
    let mut s = format!("step {step}: ");
    while s.len() < 220 {
        s.push_str("the agent read the file, ran the tests and noted the result; ");
    }
    s.truncate(220);
    s
}

fn loop_graph(n: u64, saver: Option<Arc<MemorySaver>>) -> CompiledGraph<Loop> {
    let mut g = StateGraph::<Loop>::new()
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
            move |s: &Loop| if s.count < n { "step" } else { END },
            None,
        );
    if let Some(saver) = saver {
        g = g.with_checkpointer(saver);
    }
    g.compile().unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn loop_steps(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("loop_steps");
    group.sample_size(20);
    for saver in ["none", "memory"] {
        let mut rep = 0u64;
        group.bench_function(BenchmarkId::from_parameter(saver), |b| {
            b.iter_batched(
                || {
                    rep += 1;
                    let cp = (saver == "memory").then(|| Arc::new(MemorySaver::new()));
                    let config = if cp.is_some() {
                        RunConfig::thread(format!("t-{rep}"))
                    } else {
                        RunConfig::default()
                    };
                    (loop_graph(200, cp), config)
                },
                |(g, config)| {
                    let run = rt
                        .block_on(g.invoke(LoopUpdate::default(), &config))
                        .unwrap();
                    black_box(run.state.count)
                },
                criterion::BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

/// A finished thread of `n` steps on a memory saver.
fn stored_thread(rt: &tokio::runtime::Runtime, n: u64) -> (CompiledGraph<Loop>, RunConfig) {
    let g = loop_graph(n, Some(Arc::new(MemorySaver::new())));
    let config = RunConfig::thread("stored");
    rt.block_on(g.invoke(LoopUpdate::default(), &config))
        .unwrap();
    (g, config)
}

fn resume(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("resume");
    group.sample_size(30);
    for n in [200u64, 2_000] {
        let (g, config) = stored_thread(&rt, n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let run = rt.block_on(g.invoke(Command::none(), &config)).unwrap();
                black_box(run.state.count)
            });
        });
    }
    group.finish();
}

fn fan_out_routers(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("fan_out_routers");
    group.sample_size(30);
    for n in [100u64, 2_000] {
        let names: Vec<String> = (0..8).map(|i| format!("n{i}")).collect();
        let mut g = StateGraph::<Fan>::new();
        for name in &names {
            let me = name.clone();
            g = g
                .add_node(name.clone(), move |_s, _c| {
                    let me = me.clone();
                    async move { Ok(FanUpdate::default().seen(vec![me])) }
                })
                .add_edge(START, name.clone())
                .add_conditional_edges(
                    name.clone(),
                    |s: &Fan| if s.seen.is_empty() { "n0" } else { END },
                    None,
                );
        }
        let g = g.compile().unwrap();
        let history = AddMessagesUpdate::append((0..n).map(|i| Message::assistant(text(i))));
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_batched(
                || FanUpdate::default().messages(history.clone()),
                |input| {
                    let run = rt.block_on(g.invoke(input, &RunConfig::default())).unwrap();
                    black_box(run.state.seen.len())
                },
                criterion::BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

fn history(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("history");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    {
        let n = 200u64;
        let (g, config) = stored_thread(&rt, n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let count = rt.block_on(async {
                    let mut history = g.state_history(&config, ListOptions::default());
                    let mut count = 0;
                    while let Some(snapshot) = history.next().await {
                        count += snapshot.unwrap().values.messages.len();
                    }
                    count
                });
                black_box(count)
            });
        });
    }
    group.finish();
}

criterion_group!(benches, loop_steps, resume, fan_out_routers, history);
criterion_main!(benches);
