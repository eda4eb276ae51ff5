//! Per-step cost of the compaction engine outside the summarizer: counting the new
//! step, the trigger check, and assembling the prompt, at contexts of 1k, 10k and 100k
//! tokens (it should be flat).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use keel_compaction::{CompactionConfig, Compactor, ContextState, GoalAnchor};
use keel_message::{Message, ToolCall};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{Encoding, ModelProfile, TiktokenCounter, TokenCounter};
use serde_json::json;

fn step(i: usize) -> (Message, Vec<Message>) {
    let call = ToolCall::new(
        format!("c{i}"),
        "read_file",
        json!({"path": format!("src/m{i}.rs")}),
    );
    let reply = Message::assistant(format!("Reading module {i}."))
        .with_id(format!("a{i}"))
        .with_tool_calls(vec![call]);
    let body: String = (0..12)
        .map(|l| format!("fn item_{i}_{l}(x: u32) -> u32 {{ x * {l} + {i} }}\n"))
        .collect();
    (
        reply,
        vec![Message::tool(format!("c{i}"), body).with_id(format!("r{i}"))],
    )
}

fn setup(context_tokens: usize) -> (Compactor, ContextState) {
    let counter: Arc<dyn TokenCounter> = Arc::new(TiktokenCounter::o200k_base().unwrap());
    let compactor = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
        ThreadId::new("bench").unwrap(),
        Arc::clone(&counter),
        ModelProfile::new("big", 1_000_000, 10_000, Encoding::O200kBase),
    )
    .with_config(CompactionConfig::default().with_every_steps(None));
    let mut state = ContextState::new(GoalAnchor::new(
        "Refactor the parser without changing its output.",
    ));
    let mut i = 0;
    while compactor.tokens(&mut state, &[]).total < context_tokens {
        let (reply, results) = step(i);
        compactor.push_step(&mut state, reply, results);
        i += 1;
    }
    (compactor, state)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("per_step");
    for tokens in [1_000, 10_000, 100_000] {
        let (compactor, mut state) = setup(tokens);
        group.bench_with_input(BenchmarkId::new("check+prompt", tokens), &tokens, |b, _| {
            b.iter(|| {
                let trigger = compactor.check(&mut state, &[]);
                let n = compactor.prompt(&state).count();
                (trigger, n)
            });
        });
        group.bench_with_input(
            BenchmarkId::new("check+assemble_owned", tokens),
            &tokens,
            |b, _| {
                b.iter(|| {
                    let trigger = compactor.check(&mut state, &[]);
                    (trigger, compactor.assemble(&mut state).len())
                });
            },
        );
        // One new step counted into the ledger, then the check: what a step costs.
        group.bench_with_input(
            BenchmarkId::new("push+check+prompt", tokens),
            &tokens,
            |b, _| {
                let (compactor, state) = setup(tokens);
                let (reply, results) = step(1_000_000);
                b.iter_batched(
                    // A clone's buffer is exactly full; a running agent's has the spare
                    // room of amortized growth, so the push does not copy it all.
                    || {
                        let mut s = state.clone();
                        s.raw.reserve(16);
                        s
                    },
                    |mut s| {
                        compactor.push_step(&mut s, reply.clone(), results.clone());
                        let trigger = compactor.check(&mut s, &[]);
                        let n = compactor.prompt(&s).count();
                        // Returned, so criterion drops the state outside the timing.
                        (s, trigger, n)
                    },
                    criterion::BatchSize::LargeInput,
                );
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
