#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]
//! Recounting a 100,000-message conversation after appending one message, with
//! `MemoCounter`, against counting it cold.
//!
//! `cargo bench -p keel-token --bench memo`

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use keel_message::{Message, ToolCall};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

const MESSAGES: usize = 100_000;

/// A deterministic agent-like conversation: a user turn, an assistant tool call, a
/// tool result (code and log text of varying length), repeated. About 50 MB.
fn conversation() -> Vec<Message> {
    let words = [
        "the",
        "build",
        "failed",
        "because",
        "config",
        "value",
        "missing",
        "error:",
        "warning",
        "fn",
        "let",
        "mut",
        "Result<(), Error>",
        "self.inner",
        "=>",
        "{",
        "}",
        "();",
        "0x1f",
        "12345",
        "path/to/file.rs:42:7",
        "Überprüfung",
        "東京",
        "retrying",
        "ok",
        "\n",
        "\n    ",
    ];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut text = |n: usize| -> String {
        let mut s = String::new();
        for _ in 0..n {
            s.push_str(words[(next() % words.len() as u64) as usize]);
            s.push(' ');
        }
        s
    };
    (0..MESSAGES)
        .map(|i| {
            let id = format!("msg-{i:06}");
            match i % 3 {
                0 => Message::user(text(20)).with_id(id),
                1 => Message::assistant(text(8))
                    .with_id(id)
                    .with_tool_calls(vec![ToolCall::new(
                        format!("call_{i}"),
                        "run_command",
                        json!({"cmd": text(6), "timeout": i % 120}),
                    )]),
                _ => {
                    Message::tool(format!("call_{}", i - 1), text(50 + (i * 37) % 400)).with_id(id)
                }
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let history = conversation();
    let bytes: usize = history.iter().map(|m| m.text().len()).sum();
    eprintln!(
        "conversation: {MESSAGES} messages, {:.1} MB of content",
        bytes as f64 / 1e6
    );
    let tiktoken = TiktokenCounter::o200k_base().unwrap();

    let mut group = c.benchmark_group("memo_100k_messages");
    group.sample_size(10);

    group.bench_function("cold_tiktoken", |b| {
        b.iter(|| black_box(tiktoken.count_messages(black_box(&history))))
    });

    group.bench_function("cold_memo_empty_cache", |b| {
        b.iter_batched(
            || MemoCounter::new(tiktoken.clone()),
            |memo| black_box(memo.count_messages(&history)),
            BatchSize::PerIteration,
        )
    });

    // Warm memo; every iteration appends a new message, recounts, and removes it.
    let memo = MemoCounter::new(tiktoken.clone());
    let want = memo.count_messages(&history);
    assert_eq!(want, tiktoken.count_messages(&history));
    let mut grown = history.clone();
    let step = AtomicU64::new(0);
    group.bench_function("append_one_then_recount", |b| {
        b.iter(|| {
            let n = step.fetch_add(1, Ordering::Relaxed);
            grown.push(
                Message::assistant(format!("step {n}: all checks passed, moving on"))
                    .with_id(format!("new-{n}")),
            );
            let total = memo.count_messages(black_box(&grown));
            grown.pop();
            black_box(total)
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
