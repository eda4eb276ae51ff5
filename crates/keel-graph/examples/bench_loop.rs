//! The graph benchmark workload: one node in a self-loop for N steps, each step
//! appending one ~220-byte message through `AddMessages` and bumping a `LastValue`
//! counter. Prints one JSON line per (saver, N) with the median steps/s over the
//! repetitions, for `cargo xtask bench graph` to set beside LangGraph's figures.
//!
//! Usage: `cargo run --release -p keel-graph --example bench_loop -- [reps] [N...]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use keel_checkpoint::MemorySaver;
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Messages};
use keel_graph::{END, RunConfig, START, State, StateGraph};
use keel_message::Message;

#[derive(Clone, State)]
struct Loop {
    #[reducer(AddMessages)]
    messages: Messages,
    count: u64,
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

fn graph(n: u64, saver: Option<Arc<MemorySaver>>) -> keel_graph::CompiledGraph<Loop> {
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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let reps: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(5);
    let sizes: Vec<u64> = if args.len() > 1 {
        args[1..].iter().map(|a| a.parse().unwrap()).collect()
    } else {
        vec![200, 2_000, 20_000]
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    for saver in ["none", "memory"] {
        for &n in &sizes {
            let mut rates = Vec::new();
            let mut stats = (0, 0);
            for rep in 0..reps {
                let cp = (saver == "memory").then(|| Arc::new(MemorySaver::new()));
                let g = graph(n, cp.clone());
                let config = if cp.is_some() {
                    RunConfig::thread(format!("bench-{rep}")).with_recursion_limit(usize::MAX)
                } else {
                    RunConfig::default().with_recursion_limit(usize::MAX)
                };
                let start = Instant::now();
                let run = rt
                    .block_on(g.invoke(LoopUpdate::default(), &config))
                    .unwrap();
                let secs = start.elapsed().as_secs_f64();
                assert_eq!(run.state.count, n);
                rates.push(n as f64 / secs);
                if let Some(cp) = cp {
                    let st = cp.stats();
                    stats = (st.update_values, st.snapshots);
                }
            }
            rates.sort_by(f64::total_cmp);
            let median = rates[rates.len() / 2];
            println!(
                "{{\"impl\":\"keel\",\"saver\":\"{saver}\",\"n\":{n},\"steps_per_s\":{median:.0},\"us_per_step\":{:.3},\"stored_update_values\":{},\"stored_snapshots\":{}}}",
                1e6 / median,
                stats.0,
                stats.1
            );
        }
    }
}
