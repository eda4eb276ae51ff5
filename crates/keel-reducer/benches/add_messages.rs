//! `AddMessages` cost per operation on a history of 100, 100,000 and 1,000,000
//! messages.
//!
//! Appending must not copy the history, so the cost per append must not grow with the
//! history. (The id index outgrows the CPU caches in long histories; new ids enter it
//! in batches so those cache misses overlap.) Each measurement applies a chunk of 64 prepared single-message updates
//! through `Reducer::reduce` (building the updates, with their UUIDs, is not timed),
//! then truncates the history back to its size (not timed), so the history stays within
//! 64 messages of the size named.
//!
//! Run: `cargo bench -p keel-reducer --bench add_messages`; medians are in
//! `target/criterion/add_messages_*/*/new/estimates.json`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use keel_message::{Message, ToolCall};
use keel_reducer::{AddMessages, AddMessagesUpdate, Messages, Reducer};
use serde_json::json;

const SIZES: [usize; 3] = [100, 100_000, 1_000_000];
const CHUNK: u64 = 64;

/// A tool-using agent turn: assistant with a call, or a tool result, ~200 bytes of text.
fn message(i: u64) -> Message {
    if i.is_multiple_of(2) {
        Message::assistant(format!(
            "Step {i}: I will list the directory to find the config file before editing it."
        ))
        .with_tool_calls(vec![ToolCall::new(
            format!("call_{i}"),
            "ls",
            json!({"path": "./src", "all": true}),
        )])
    } else {
        Message::tool(
            format!("call_{}", i - 1),
            "Cargo.toml\nsrc/main.rs\nsrc/lib.rs\nsrc/config.rs\nREADME.md\ntests/integration.rs\n",
        )
    }
}

fn history(size: usize) -> Messages {
    AddMessages
        .apply(
            Messages::new(),
            AddMessagesUpdate::append((0..size as u64).map(message)),
        )
        .unwrap()
}

fn append(c: &mut Criterion) {
    let mut group = c.benchmark_group("add_messages_append");
    for size in SIZES {
        let mut state = history(size);
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(CHUNK);
                    let updates: Vec<Vec<AddMessagesUpdate>> = (0..n)
                        .map(|i| vec![AddMessagesUpdate::append([message(i)])])
                        .collect();
                    let start = Instant::now();
                    for u in updates {
                        AddMessages.reduce(black_box(&mut state), u).unwrap();
                    }
                    timed += start.elapsed();
                    state.truncate(size);
                    left -= n;
                }
                timed
            });
        });
    }
    group.finish();
}

fn replace(c: &mut Criterion) {
    let mut group = c.benchmark_group("add_messages_replace");
    for size in SIZES {
        let mut state = history(size);
        let target = state[size / 2].id.clone().unwrap();
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let n = left.min(CHUNK);
                    let updates: Vec<Vec<AddMessagesUpdate>> = (0..n)
                        .map(|i| {
                            vec![AddMessagesUpdate::append([
                                message(i).with_id(target.clone())
                            ])]
                        })
                        .collect();
                    let start = Instant::now();
                    for u in updates {
                        AddMessages.reduce(black_box(&mut state), u).unwrap();
                    }
                    timed += start.elapsed();
                    left -= n;
                }
                assert_eq!(state.len(), size);
                timed
            });
        });
    }
    group.finish();
}

criterion_group!(benches, append, replace);
criterion_main!(benches);
