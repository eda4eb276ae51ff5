//! A context restored from an older state (a fork of the thread, as time travel makes
//! one) archives and offloads apart: what it reads back is what was stored up to the
//! fork point plus its own, never what the other branch stored after it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::{CompactionConfig, Compactor, ContextState, GoalAnchor, Trigger};
use keel_message::{Message, ToolCall};
use keel_offload::{
    Archive, EvictLargeResults, MemoryStore, OffloadStore, RetrievalTools, ThreadId,
    collect_garbage,
};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{ApproxCounter, Encoding, ModelProfile, TokenCounter};
use serde_json::json;

fn compactor(store: Arc<dyn OffloadStore>) -> (Compactor, Arc<Archive>, ThreadId) {
    let archive = Arc::new(Archive::new(store));
    let thread = ThreadId::new("t").unwrap();
    let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::new());
    let compactor = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        archive.clone(),
        thread.clone(),
        counter,
        ModelProfile::new("test", 32_000, 2_000, Encoding::Approximate),
    )
    .with_config(CompactionConfig::default().with_keep_recent_tokens(40))
    .with_evict(Some(EvictLargeResults::new().with_threshold(2_000)));
    (compactor, archive, thread)
}

/// Steps `range` of a branch: each calls `sh` and gets `<tag> fact <tag>-<i>`; step 5
/// gets a large result (offloaded) under the same call id on every branch.
fn push(compactor: &Compactor, state: &mut ContextState, tag: &str, range: std::ops::Range<u64>) {
    for i in range {
        let call = format!("c{i}");
        let reply = Message::assistant(format!("step {i}")).with_tool_calls(vec![ToolCall::new(
            call.clone(),
            "sh",
            json!({"i": i}),
        )]);
        let text = if i == 5 {
            format!("{tag} large result\n").repeat(2_000)
        } else {
            format!("{tag} fact {}-{i:03}", tag.to_uppercase())
        };
        compactor.push_step(state, reply, vec![Message::tool(call, text)]);
    }
}

fn grep(store: &Arc<dyn OffloadStore>, state: &ContextState, pattern: &str) -> String {
    RetrievalTools::new(store.clone(), ThreadId::new("t").unwrap())
        .with_lineage(state.lineage.clone())
        .execute(&ToolCall::new("g", "grep", json!({"pattern": pattern})))
        .unwrap()
}

#[tokio::test]
async fn a_forked_context_reads_back_what_was_stored_up_to_the_fork_point_plus_its_own() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let (compactor, archive, thread) = compactor(store.clone());
    let mut main = ContextState::new(GoalAnchor::new("Collect the facts."));
    push(&compactor, &mut main, "base", 0..4);
    compactor
        .compact(&mut main, Trigger::Force, &[])
        .await
        .unwrap();
    let fork_point = main.clone();

    // The main branch goes on: its facts, a large result, a compaction.
    push(&compactor, &mut main, "main", 4..8);
    compactor
        .compact(&mut main, Trigger::Force, &[])
        .await
        .unwrap();
    // The fork, from the state at the fork point: the same step numbers and message ids,
    // other content.
    let mut fork = fork_point.clone();
    push(&compactor, &mut fork, "fork", 4..8);
    compactor
        .compact(&mut fork, Trigger::Force, &[])
        .await
        .unwrap();
    assert_eq!(fork.lineage.forks().count(), 1, "the fork writes apart");
    assert_eq!(main.lineage.forks().count(), 0);

    for (state, own, other) in [(&main, "MAIN-", "FORK-"), (&fork, "FORK-", "MAIN-")] {
        assert!(grep(&store, state, "BASE-000").contains("archive/messages.jsonl:"));
        assert!(grep(&store, state, own).contains("archive/messages.jsonl:"));
        let leak = grep(&store, state, other);
        assert!(leak.starts_with("No lines match"), "{leak}");
    }
    // Each branch's large result, under the same call id, is its own.
    let big = |s: &ContextState| grep(&store, s, "large result");
    assert!(big(&main).contains("main large result") && !big(&main).contains("fork large"));
    assert!(big(&fork).contains("fork large result") && !big(&fork).contains("main large"));
    assert!(grep(&store, &fork_point, "large result").starts_with("No lines match"));
    // Both archive the same ids: each finds its own.
    let text = |s: &ContextState, id: &str| {
        archive
            .get_in(&s.lineage, &thread, id)
            .unwrap()
            .map(|a| a.message.text().into_owned())
    };
    assert_eq!(
        text(&main, "keel-5-1").as_deref(),
        Some("main fact MAIN-004")
    );
    assert_eq!(
        text(&fork, "keel-5-1").as_deref(),
        Some("fork fact FORK-004")
    );
    assert_eq!(text(&fork_point, "keel-5-1"), None);
    let n = |s: &ContextState| archive.len_in(&s.lineage, &thread).unwrap();
    assert!(
        n(&fork_point) < n(&fork) && n(&fork) == n(&main),
        "{} {} {}",
        n(&fork_point),
        n(&fork),
        n(&main)
    );

    // The main branch abandoned: only the fork's lineage lives, and the main branch's
    // records and result go; the fork reads everything it did.
    let before = grep(&store, &fork, ".");
    let removed = collect_garbage(&*store, &thread, &[fork.lineage.clone()]).unwrap();
    assert!(removed.files >= 1 && removed.bytes > 0, "{removed:?}");
    assert_eq!(grep(&store, &fork, "."), before);
    assert!(fork.lineage.sees_all(&*store, &thread).unwrap());
}

#[test]
fn a_state_equals_its_own_json_copy_after_steps() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let (compactor, _, _) = compactor(store);
    let mut state = ContextState::new(GoalAnchor::new("Count."));
    push(&compactor, &mut state, "a", 0..3);
    // Counted once pushed: its token cache is full, the copy's empty.
    compactor.tokens(&mut state, &[]);
    let copy: ContextState = serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
    assert_eq!(copy, state);
}
