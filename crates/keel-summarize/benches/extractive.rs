//! The extractive summarizer on the spans an agent's compaction hands it: a milestone
//! of 10 and of 40 steps whose tool calls list a directory, read a numbered file and
//! grep for definitions (the outputs `cargo xtask bench agent`'s agent sees), and an
//! epoch folding 5 such milestones.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use keel_message::{Message, ToolCall};
use keel_summarize::{ExtractiveSummarizer, SummaryRequest};
use serde_json::json;

/// One agent step: the assistant's call and the tool's output.
fn step(i: usize) -> [Message; 2] {
    let id = format!("call_{i}");
    let (call, output) = match i % 3 {
        0 => (
            ToolCall::new(&id, "ls", json!({"path": "crates"})),
            [
                "keel/", "keel-agent/", "keel-checkpoint/", "keel-checkpoint-postgres/",
                "keel-checkpoint-sqlite/", "keel-cli/", "keel-compaction/", "keel-fleet/",
                "keel-graph/", "keel-graph-macros/", "keel-message/", "keel-model/",
                "keel-offload/", "keel-reducer/", "keel-summarize/", "keel-token/",
            ]
            .join("\n"),
        ),
        1 => (
            ToolCall::new(&id, "read_file", json!({"path": "Cargo.toml", "limit": 50})),
            (1..=50)
                .map(|l| match l % 5 {
                    0 => format!("{l:>6}\t[workspace.dependencies.crate_{l}]"),
                    1 => format!("{l:>6}\tversion = \"=0.{l}.{}\"", l * 7),
                    2 => format!("{l:>6}\tfeatures = [\"rt\", \"macros\", \"sync_{l}\"]"),
                    3 => format!("{l:>6}\t# pinned for reproducible builds (see deny.toml)"),
                    _ => format!("{l:>6}\tdefault-features = false"),
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => (
            ToolCall::new(
                &id,
                "grep",
                json!({"pattern": "fn ", "path": "crates/keel-message", "max_results": 50}),
            ),
            (1..=50)
                .map(|l| {
                    format!(
                        "crates/keel-message/src/m{}.rs:{}:    pub fn item_{l}(&self, index: usize) -> Option<&Message> {{",
                        l % 7,
                        l * 13
                    )
                })
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    };
    [
        Message::assistant(format!("step {i}: {} messages in the prompt", 2 * i + 2))
            .with_tool_calls(vec![call]),
        Message::tool(id, output),
    ]
}

fn span(steps: usize) -> Vec<Message> {
    (0..steps).flat_map(step).collect()
}

fn bench(c: &mut Criterion) {
    let summarizer = ExtractiveSummarizer::new();
    let mut group = c.benchmark_group("extractive");
    for steps in [10, 40] {
        let messages = span(steps);
        group.bench_with_input(BenchmarkId::new("milestone", steps), &messages, |b, m| {
            b.iter(|| {
                summarizer
                    .summarize_sync(&SummaryRequest::milestone(m, 400))
                    .unwrap()
            });
        });
    }
    // An epoch folds milestone summaries (given as messages).
    let milestones: Vec<Message> = (0..5)
        .map(|k| {
            let m = span(10 * (k + 1)).split_off(20 * k);
            let s = summarizer
                .summarize_sync(&SummaryRequest::milestone(&m, 400))
                .unwrap();
            Message::user(s.text)
        })
        .collect();
    group.bench_function("epoch/5", |b| {
        b.iter(|| {
            summarizer
                .summarize_sync(&SummaryRequest::epoch(&milestones, 800))
                .unwrap()
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
