//! The compaction contract: invariants 1–4 and 8 of DESIGN.md, over hand-made and
//! random conversations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use keel_compaction::{
    CompactionConfig, CompactionError, Compactor, ContextState, EventKind, GoalAnchor,
    LAYER_METADATA_KEY, Strategy, Trigger,
};
use keel_message::{Message, Role, ToolCall, answered_calls};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::{
    ExtractiveSummarizer, Level, SummarizeError, Summarizer, Summary, SummaryRequest, is_goal,
};
use keel_token::{ApproxCounter, Encoding, ModelProfile, TokenCounter};
use proptest::prelude::*;
use serde_json::json;

/// Records every request, then delegates to the extractive summarizer (or fails).
#[derive(Default)]
struct Recording {
    requests: Mutex<Vec<(Level, Vec<Message>)>>,
    fail: bool,
}

#[async_trait]
impl Summarizer for Recording {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        self.requests
            .lock()
            .unwrap()
            .push((request.level, request.messages.to_vec()));
        if self.fail {
            // A summarizer whose server is down: the kind of failure retried.
            return Err(SummarizeError::Model(keel_model::ModelError::Connection(
                "connection refused".into(),
            )));
        }
        ExtractiveSummarizer::new().summarize(request).await
    }
}

struct Rig {
    compactor: Compactor,
    archive: Arc<Archive>,
    thread: ThreadId,
    summarizer: Arc<Recording>,
}

fn rig(config: CompactionConfig, window: usize, fail: bool) -> Rig {
    let archive = Arc::new(Archive::new(Arc::new(MemoryStore::new())));
    let thread = ThreadId::new("t").unwrap();
    let summarizer = Arc::new(Recording {
        fail,
        ..Default::default()
    });
    let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::new());
    let compactor = Compactor::new(
        summarizer.clone(),
        archive.clone(),
        thread.clone(),
        counter,
        ModelProfile::new("test", window, window / 10, Encoding::Approximate),
    )
    .with_config(config);
    Rig {
        compactor,
        archive,
        thread,
        summarizer,
    }
}

fn goal() -> GoalAnchor {
    GoalAnchor::new("Fix the failing build in crates/app without touching the public API.")
        .with_constraints(["Do not push to main."])
}

/// Step `i`: an assistant turn with `calls` tool calls and their results.
/// Step `i`; its call ids are `c{i}-{k}`, or with `reuse` `call_{k}` in every step (as
/// servers that number the calls of each reply give them).
fn step(i: usize, calls: usize, result_len: usize, reuse: bool) -> (Message, Vec<Message>) {
    let id = |k: usize| {
        if reuse {
            format!("call_{k}")
        } else {
            format!("c{i}-{k}")
        }
    };
    let tool_calls: Vec<ToolCall> = (0..calls)
        .map(|k| ToolCall::new(id(k), "sh", json!({"cmd": format!("make {i}")})))
        .collect();
    let reply = Message::assistant(format!("step {i}: trying make"))
        .with_id(format!("a{i}"))
        .with_tool_calls(tool_calls);
    let results = (0..calls)
        .map(|k| {
            Message::tool(id(k), format!("exit {k}: {}", "x".repeat(result_len)))
                .with_id(format!("r{i}-{k}"))
        })
        .collect();
    (reply, results)
}

/// Every prompt property the engine promises, checked on one assembled prompt.
fn check_prompt(prompt: &[Message], anchor: &GoalAnchor) {
    // Invariant 1: the goal is the first message, byte-identical.
    assert_eq!(&prompt[0], anchor.message());
    assert_eq!(prompt[0].text(), anchor.text());
    // Invariant 3: no orphans: every result answers a call before it (the latest with
    // its id), and every call has its result.
    let answers = answered_calls(prompt);
    let mut answered = HashSet::new();
    for (j, m) in prompt.iter().enumerate() {
        if m.role == Role::Tool {
            let id = m.tool_call_id.clone().unwrap();
            let call = answers[j].unwrap_or_else(|| panic!("orphaned result {id}"));
            answered.insert((call, id));
        }
    }
    for (i, m) in prompt.iter().enumerate() {
        for c in &m.tool_calls {
            assert!(
                answered.contains(&(i, c.id.clone())),
                "call {} lost its result",
                c.id
            );
        }
    }
}

async fn run_steps(
    rig: &Rig,
    state: &mut ContextState,
    steps: &[(usize, usize)],
    reuse: bool,
) -> Vec<Vec<Message>> {
    let mut prompts = Vec::new();
    for (i, &(calls, len)) in steps.iter().enumerate() {
        prompts.push(rig.compactor.assemble(state));
        let (reply, results) = step(i, calls, len, reuse);
        rig.compactor.push_step(state, reply, results);
        rig.compactor.after_step(state, &[]).await.unwrap();
    }
    prompts.push(rig.compactor.assemble(state));
    prompts
}

#[tokio::test]
async fn goal_heads_every_prompt_and_is_never_summarized() {
    let rig = rig(
        CompactionConfig::default()
            .with_every_steps(Some(3))
            .with_keep_recent_tokens(40),
        8_000,
        false,
    );
    let anchor = goal();
    let mut state = ContextState::new(anchor.clone());
    let prompts = run_steps(&rig, &mut state, &[(1, 50); 40], false).await;
    for p in &prompts {
        check_prompt(p, &anchor);
    }
    let requests = rig.summarizer.requests.lock().unwrap();
    assert!(requests.len() > 10);
    for (_, msgs) in requests.iter() {
        assert!(
            msgs.iter().all(|m| !is_goal(m)),
            "the goal reached a summarizer"
        );
    }
    // Epochs are summaries of summaries: their input is summary layers only
    // (milestones for an epoch, epochs for an era).
    let epochs: Vec<_> = requests
        .iter()
        .filter(|(l, _)| *l == Level::Epoch)
        .collect();
    assert!(!epochs.is_empty());
    for (_, msgs) in epochs {
        assert!(
            msgs.iter()
                .all(|m| m.metadata.get(LAYER_METADATA_KEY).is_some())
        );
    }
    assert!(!state.epochs.is_empty());
    assert!(state.milestones.len() < 5);
}

#[tokio::test]
async fn everything_that_leaves_is_archived_exactly_once() {
    let rig = rig(
        CompactionConfig::default()
            .with_every_steps(Some(4))
            .with_keep_recent_tokens(60),
        8_000,
        false,
    );
    let mut state = ContextState::new(goal());
    let steps: Vec<(usize, usize)> = (0..30).map(|i| (i % 3, 20 + i)).collect();
    run_steps(&rig, &mut state, &steps, false).await;
    let pushed: Vec<String> = (0..30)
        .flat_map(|i| {
            let (reply, results) = step(i, i % 3, 0, false);
            std::iter::once(reply).chain(results).map(|m| m.id.unwrap())
        })
        .collect();
    let in_context: HashSet<String> = state.raw.iter().filter_map(|m| m.id.clone()).collect();
    let left: Vec<&String> = pushed
        .iter()
        .filter(|id| !in_context.contains(*id))
        .collect();
    assert!(left.len() > 40, "{}", left.len());
    assert_eq!(rig.archive.len(&rig.thread).unwrap(), left.len() as u64);
    for id in left {
        assert!(
            rig.archive.get(&rig.thread, id).unwrap().is_some(),
            "{id} not archived"
        );
    }
}

#[tokio::test]
async fn between_compactions_the_prompt_only_grows_at_its_end() {
    let rig = rig(
        CompactionConfig::default().with_every_steps(Some(5)),
        8_000,
        false,
    );
    let mut state = ContextState::new(goal());
    let mut previous: Option<Vec<Message>> = None;
    let mut events = 0;
    for i in 0..30 {
        let prompt = rig.compactor.assemble(&mut state);
        if let Some(prev) = &previous
            && state.events.len() == events
        {
            assert!(
                prompt.starts_with(prev),
                "prefix changed without a compaction at step {i}"
            );
        }
        events = state.events.len();
        previous = Some(prompt);
        let (reply, results) = step(i, 1, 30, false);
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    assert!(events >= 5);
}

#[tokio::test]
async fn a_failed_compaction_changes_nothing() {
    let rig = rig(
        CompactionConfig::default()
            .with_every_steps(Some(2))
            .with_keep_recent_tokens(0),
        100_000,
        true,
    );
    let mut state = ContextState::new(goal());
    for i in 0..2 {
        let (reply, results) = step(i, 1, 10, false);
        rig.compactor.push_step(&mut state, reply, results);
    }
    let before = state.clone();
    let err = rig
        .compactor
        .compact(&mut state, Trigger::Steps, &[])
        .await
        .unwrap_err();
    assert!(matches!(err, CompactionError::Summarize(_)), "{err}");
    assert_eq!(state.raw, before.raw);
    assert!(state.milestones.is_empty());
    assert_eq!(state.events.len(), 1);
    let event = &state.events[0];
    assert!(event.error.is_some());
    assert_eq!(event.tokens_before, event.tokens_after);
    // A failed model call is tried again before the compaction gives up.
    assert_eq!(rig.summarizer.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn when_the_context_would_overflow_the_fallback_summarizer_steps_in() {
    let rig = rig(
        CompactionConfig::default().with_every_steps(None),
        4_000,
        true,
    );
    let mut state = ContextState::new(goal());
    for i in 0..12 {
        let (reply, results) = step(i, 1, 1_000, false);
        rig.compactor.push_step(&mut state, reply, results);
    }
    let event = rig
        .compactor
        .compact(&mut state, Trigger::Overflow, &[])
        .await
        .unwrap();
    assert!(event.fallback);
    assert_eq!(event.kind, EventKind::Milestone);
    assert!(event.tokens_after < event.tokens_before);
    assert!(
        !state.milestones[0]
            .text
            .to_lowercase()
            .contains("error: nothing")
    );
}

#[tokio::test]
async fn token_trigger_fires_at_the_fraction_and_compaction_fits_the_budget() {
    let rig = rig(
        CompactionConfig::default()
            .with_every_steps(None)
            .with_window_fraction(0.5),
        4_000,
        false,
    );
    let anchor = goal();
    let mut state = ContextState::new(anchor.clone());
    let budget = rig.compactor.budget();
    for i in 0..60 {
        let (reply, results) = step(i, 1, 400, false);
        rig.compactor.push_step(&mut state, reply, results);
        let events = rig.compactor.after_step(&mut state, &[]).await.unwrap();
        let tokens = rig.compactor.tokens(&mut state, &[]).total;
        assert!(tokens <= budget, "step {i}: {tokens} > {budget}");
        for e in events {
            assert_eq!(e.trigger, Trigger::Tokens);
        }
        check_prompt(&rig.compactor.assemble(&mut state), &anchor);
    }
    assert!(state.events.len() >= 3);
}

#[tokio::test]
async fn a_long_run_keeps_only_the_latest_events_in_the_state() {
    let rig = rig(
        CompactionConfig::default()
            .with_every_steps(Some(2))
            .with_max_steps(10_000),
        8_000,
        false,
    );
    let mut state = ContextState::new(goal());
    let mut returned = Vec::new();
    for i in 0..400 {
        let (reply, results) = step(i, 1, 30, false);
        rig.compactor.push_step(&mut state, reply, results);
        returned.extend(rig.compactor.after_step(&mut state, &[]).await.unwrap());
    }
    assert!(
        returned.len() > ContextState::EVENTS_KEPT,
        "{}",
        returned.len()
    );
    assert_eq!(state.events.len(), ContextState::EVENTS_KEPT);
    assert_eq!(
        state.events[..],
        returned[returned.len() - ContextState::EVENTS_KEPT..]
    );
}

#[tokio::test]
async fn the_step_ceiling_stops_the_run() {
    let config = CompactionConfig::default().with_max_steps(3);
    let rig = rig(config, 100_000, false);
    let mut state = ContextState::new(goal());
    for i in 0..3 {
        let (reply, results) = step(i, 1, 1, false);
        rig.compactor.push_step(&mut state, reply, results);
    }
    assert_eq!(
        rig.compactor.check(&mut state, &[]),
        Some(Trigger::StepCeiling)
    );
    let err = rig.compactor.after_step(&mut state, &[]).await.unwrap_err();
    assert!(matches!(
        err,
        CompactionError::StepCeiling { steps: 3, max: 3 }
    ));
}

/// Masking 2 turns at a time behind the last 2, at the threshold (30% of a
/// 4,000-token window) whatever it costs, so masking comes early.
fn masking_rig() -> Rig {
    rig(
        CompactionConfig::default()
            .with_strategy(Strategy::Masking {
                keep_turns: 2,
                block: 2,
            })
            // At the threshold whatever it costs, so masking comes early.
            .with_step_trigger(keel_compaction::StepTrigger::Always)
            .with_window_fraction(0.3),
        4_000,
        false,
    )
}

/// Two identical runs whose messages got different ids (as a reducer gives random
/// ones) mask to the same texts at the same steps: nothing random reaches the prompt.
#[tokio::test]
async fn masking_is_the_same_whatever_the_message_ids() {
    let mut runs = Vec::new();
    for run in 0..2 {
        let rig = masking_rig();
        let mut state = ContextState::new(goal());
        for i in 0..16 {
            let (reply, results) = step(i, 1, 400, false);
            // Ids of different lengths and digits in each run.
            let suffix = "7".repeat(1 + run * 13 + i % 5);
            let reply = reply.with_id(format!("a{i}-{suffix}"));
            let results = results
                .into_iter()
                .map(|r| r.with_id(format!("r{i}-{suffix}")))
                .collect();
            rig.compactor.push_step(&mut state, reply, results);
            rig.compactor.after_step(&mut state, &[]).await.unwrap();
        }
        let texts: Vec<String> = state.raw.iter().map(|m| m.text().into_owned()).collect();
        let events: Vec<(usize, usize)> = state
            .events
            .iter()
            .map(|e| (e.tokens_before, e.tokens_after))
            .collect();
        assert!(texts.iter().any(|t| t.starts_with("[masked: ")));
        runs.push((texts, events));
    }
    assert_eq!(runs[0], runs[1]);
}

#[tokio::test]
async fn masking_replaces_old_results_with_pointers_to_the_archive() {
    let rig = masking_rig();
    let mut state = ContextState::new(goal());
    for i in 0..16 {
        let (reply, results) = step(i, 1, 400, false);
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    let masked: Vec<&Message> = state
        .raw
        .iter()
        .filter(|m| {
            m.metadata
                .contains_key(keel_compaction::MASKED_METADATA_KEY)
        })
        .collect();
    assert!(!masked.is_empty());
    for m in masked {
        // The placeholder names the model's call id and the archive position, not the
        // message's own id (random when a reducer gave it).
        let call = m.tool_call_id.clone().unwrap();
        let seq = m.metadata[keel_compaction::MASKED_METADATA_KEY]
            .as_u64()
            .unwrap();
        assert!(
            m.text()
                .contains(&format!("call {call}, archive seq {seq}]"))
        );
        let id = m.id.clone().unwrap();
        assert!(!m.text().contains(&id));
        let original = rig.archive.get(&rig.thread, &id).unwrap().unwrap();
        assert!(original.message.text().len() > 200);
        assert_eq!(original.seq, seq);
        assert_eq!(
            original.message.tool_call_id.as_deref(),
            Some(call.as_str())
        );
    }
    // The last turns keep their results in full.
    let last = state.raw.last().unwrap();
    assert!(
        !last
            .metadata
            .contains_key(keel_compaction::MASKED_METADATA_KEY)
    );
    assert!(state.events.iter().any(|e| e.kind == EventKind::Mask));
}

#[tokio::test]
async fn large_results_are_offloaded_on_arrival() {
    // The default threshold is the smaller of 20,000 tokens and a quarter of the budget.
    let rig = rig(CompactionConfig::default(), 8_000, false);
    let mut state = ContextState::new(goal());
    let (reply, mut results) = step(0, 1, 0, false);
    results[0].content = (0..2_000)
        .map(|i| format!("line {i}\n"))
        .collect::<String>()
        .into();
    rig.compactor.push_step(&mut state, reply, results);
    let stub = state.raw[1].text();
    assert!(stub.len() < 2_000, "{}", stub.len());
    assert!(stub.contains("line 0") && stub.contains("line 1999"));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// Random step sequences (their call ids unique, or the same in every step): the goal is byte-identical in every prompt, nothing is
    /// orphaned, whatever left the context is in the archive exactly once, and two runs
    /// with the same input give the same state.
    #[test]
    fn random_runs_keep_every_invariant(
        steps in prop::collection::vec((0usize..4, 0usize..300), 1..60),
        every in prop::option::of(1usize..8),
        keep in 0usize..300,
        masking in any::<bool>(),
        reuse in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let config = CompactionConfig::default()
            .with_every_steps(every)
            .with_keep_recent_tokens(keep)
            .with_window_fraction(0.4)
            .with_strategy(if masking { Strategy::Hybrid { keep_turns: 2, block: 1 } } else { Strategy::Hierarchical });
        let anchor = goal();
        let run = || {
            let rig = rig(config.clone(), 6_000, false);
            let mut state = ContextState::new(anchor.clone());
            let prompts = rt.block_on(run_steps(&rig, &mut state, &steps, reuse));
            (rig, state, prompts)
        };
        let (rig, state, prompts) = run();
        for p in &prompts {
            check_prompt(p, &anchor);
        }
        // A masked result left the context too: only its pointer stayed.
        let in_context: HashSet<String> = state
            .raw
            .iter()
            .filter(|m| !m.metadata.contains_key(keel_compaction::MASKED_METADATA_KEY))
            .filter_map(|m| m.id.clone())
            .collect();
        let left: usize = steps
            .iter()
            .enumerate()
            .flat_map(|(i, &(calls, _))| {
                std::iter::once(format!("a{i}")).chain((0..calls).map(move |k| format!("r{i}-{k}")))
            })
            .filter(|id| !in_context.contains(id))
            .count();
        prop_assert_eq!(rig.archive.len(&rig.thread).unwrap(), left as u64);
        let (_, again, _) = run();
        prop_assert_eq!(again.raw, state.raw);
        prop_assert_eq!(
            again.milestones.iter().map(|l| &l.text).collect::<Vec<_>>(),
            state.milestones.iter().map(|l| &l.text).collect::<Vec<_>>()
        );
        prop_assert_eq!(again.epoch.map(|l| l.text), state.epoch.map(|l| l.text));
    }
}

/// A model whose provider refuses prompts over `limit` tokens, as OpenAI's
/// `context_length_exceeded` does.
struct Limited {
    limit: usize,
    calls: Mutex<Vec<usize>>,
}

#[async_trait]
impl keel_model::ChatModel for Limited {
    fn model_name(&self) -> &str {
        "limited"
    }

    async fn chat(
        &self,
        messages: &[Message],
        _tools: &[keel_message::ToolSpec],
        _options: &keel_model::ChatOptions,
    ) -> Result<keel_model::ChatResponse, keel_model::ModelError> {
        let tokens = ApproxCounter::new().count_messages(messages);
        self.calls.lock().unwrap().push(tokens);
        if tokens > self.limit {
            return Err(keel_model::ModelError::ContextOverflow {
                message: format!("{tokens} tokens > {}", self.limit),
            });
        }
        Ok(keel_model::ChatResponse::new(
            Message::assistant("ok"),
            "limited",
        ))
    }
}

/// Twenty steps of 400 tokens, and a model that refuses prompts over `limit`.
fn overflowing(limit: usize) -> (Rig, ContextState, Limited) {
    let rig = rig(
        CompactionConfig::default().with_every_steps(None),
        100_000,
        false,
    );
    let mut state = ContextState::new(goal());
    for i in 0..20 {
        let (reply, results) = step(i, 1, 400, false);
        rig.compactor.push_step(&mut state, reply, results);
    }
    let model = Limited {
        limit,
        calls: Mutex::default(),
    };
    (rig, state, model)
}

#[tokio::test]
async fn a_context_overflow_compacts_at_once_and_retries_the_call() {
    let (rig, mut state, model) = overflowing(1_500);
    let reply = rig
        .compactor
        .call(&model, &mut state, &[], &Default::default())
        .await
        .unwrap();
    assert_eq!(reply.message.text(), "ok");
    let calls = model.calls.lock().unwrap();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[1] <= 1_500);
    assert_eq!(state.events.last().unwrap().trigger, Trigger::Overflow);
}

#[tokio::test]
async fn an_overflow_nothing_can_cure_is_the_model_s_error() {
    // Even the goal and the last step are over this model's limit.
    let (rig, mut state, model) = overflowing(10);
    let err = rig
        .compactor
        .call(&model, &mut state, &[], &Default::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, keel_compaction::CallError::Model(e) if e.is_context_overflow()),
        "the overflow, not `nothing to compact`: {err}"
    );
}
