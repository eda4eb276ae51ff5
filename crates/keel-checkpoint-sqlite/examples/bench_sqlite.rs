//! The graph benchmark's workload (keel-graph's `bench_loop`: one node in a self-loop for
//! N steps, each appending one ~220-byte message through `AddMessages` and bumping a
//! counter) with a `SqliteSaver` on a file and sync durability: every step's checkpoint
//! is committed before the next step starts.
//!
//! Prints one JSON line per (saver, synchronous, N): the median steps/s over the
//! repetitions, and for the file the database size after the run once the write-ahead
//! log is checkpointed into it. `MemorySaver` runs the same loop for comparison.
//! `cargo xtask bench sqlite` runs it and prints a table.
//!
//! Usage: `cargo run --release -p keel-checkpoint-sqlite --example bench_sqlite --
//! [reps] [N...] [--full-up-to N]` (`synchronous=FULL` runs only for N up to that,
//! default 2,000: each of its steps waits for the disk).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use keel_checkpoint::{Checkpointer, MemorySaver};
use keel_checkpoint_sqlite::{SqliteOptions, SqliteSaver, Synchronous};
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

fn graph(n: u64, saver: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<Loop> {
    StateGraph::<Loop>::new()
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
        )
        .with_checkpointer(saver)
        .compile()
        .unwrap()
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// One run of `n` steps; returns steps/s and the JSON fields describing storage.
fn run_once(
    rt: &tokio::runtime::Runtime,
    saver: &str,
    sync: Synchronous,
    n: u64,
    rep: usize,
) -> (f64, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.db");
    let (cp, sqlite): (Arc<dyn Checkpointer>, Option<SqliteSaver>) = if saver == "sqlite" {
        let s = rt
            .block_on(SqliteOptions::default().synchronous(sync).open(&path))
            .unwrap();
        (Arc::new(s.clone()), Some(s))
    } else {
        (Arc::new(MemorySaver::new()), None)
    };
    let g = graph(n, cp);
    let config = RunConfig::thread(format!("bench-{rep}")).with_recursion_limit(usize::MAX);
    let start = Instant::now();
    let run = rt
        .block_on(g.invoke(LoopUpdate::default(), &config))
        .unwrap();
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(run.state.count, n);
    let mut fields = String::new();
    if let Some(s) = sqlite {
        let wal = path.with_extension("db-wal");
        let wal_before = file_len(&wal);
        let clean = rt.block_on(s.wal_checkpoint()).unwrap();
        let stats = rt.block_on(s.stats()).unwrap();
        fields = format!(
            ",\"file_bytes\":{},\"wal_bytes_before_checkpoint\":{wal_before},\"wal_bytes_after\":{},\"wal_checkpoint_complete\":{clean},\"checkpoints\":{},\"deltas\":{},\"snapshots\":{},\"delta_json_bytes\":{}",
            file_len(&path),
            file_len(&wal),
            stats.checkpoints,
            stats.deltas,
            stats.snapshots,
            stats.delta_bytes
        );
    }
    (n as f64 / secs, fields)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut full_up_to = 2_000u64;
    if let Some(i) = args.iter().position(|a| a == "--full-up-to") {
        full_up_to = args[i + 1].parse().unwrap();
        args.drain(i..=i + 1);
    }
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
    let variants = [
        ("memory", Synchronous::Normal),
        ("sqlite", Synchronous::Normal),
        ("sqlite", Synchronous::Full),
    ];
    for (saver, sync) in variants {
        for &n in &sizes {
            if saver == "sqlite" && sync == Synchronous::Full && n > full_up_to {
                continue;
            }
            let mut runs: Vec<(f64, String)> = (0..reps)
                .map(|rep| run_once(&rt, saver, sync, n, rep))
                .collect();
            runs.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (median, fields) = &runs[runs.len() / 2];
            let sync_name = if saver == "sqlite" {
                sync.as_str().to_lowercase()
            } else {
                "-".to_owned()
            };
            println!(
                "{{\"impl\":\"keel\",\"saver\":\"{saver}\",\"synchronous\":\"{sync_name}\",\"n\":{n},\"reps\":{reps},\"steps_per_s\":{median:.0},\"us_per_step\":{:.3}{fields}}}",
                1e6 / median
            );
        }
    }
}
