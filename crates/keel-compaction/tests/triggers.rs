//! Cost-aware triggers: the step trigger fires only when compacting pays for the cache
//! it resets, a result that is not smaller is not applied, and the prompt ceiling.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::{
    CompactionConfig, CompactionError, Compactor, ContextState, GoalAnchor, MASKED_METADATA_KEY,
    StepTrigger, Strategy, Trigger,
};
use keel_message::{Message, ToolCall, ToolSpec};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{ApproxCounter, Encoding, ModelProfile};
use serde_json::json;

fn compactor(config: CompactionConfig, window: usize) -> (Compactor, Arc<Archive>, ThreadId) {
    let archive = Arc::new(Archive::new(Arc::new(MemoryStore::new())));
    let thread = ThreadId::new("t").unwrap();
    let c = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        archive.clone(),
        thread.clone(),
        Arc::new(ApproxCounter::new()),
        ModelProfile::new("test", window, window / 10, Encoding::Approximate),
    )
    .with_config(config);
    (c, archive, thread)
}

/// A step whose tool result has `lines` lines of log.
fn step(i: usize, lines: usize) -> (Message, Vec<Message>) {
    let reply = Message::assistant(format!("Step {i}: reading the log."))
        .with_id(format!("a{i}"))
        .with_tool_calls(vec![ToolCall::new(
            format!("c{i}"),
            "sh",
            json!({"cmd": format!("tail -n {lines} build-{i}.log")}),
        )]);
    let log: String = (0..lines)
        .map(|k| format!("[{i}:{k}] compiling module number {k} of the build, all fine\n"))
        .collect();
    (
        reply,
        vec![Message::tool(format!("c{i}"), log).with_id(format!("r{i}"))],
    )
}

#[tokio::test]
async fn the_step_trigger_waits_until_compacting_pays() {
    // A roomy window: no pressure, only the step trigger.
    let config = CompactionConfig::default().with_cost_aware_steps(3, 5);
    let (c, archive, thread) = compactor(config, 200_000);
    let mut state = ContextState::new(GoalAnchor::new("Find why the build is slow."));
    // Small steps: after 3 of them the span that would leave is smaller than the
    // summary and tail the next call would send uncached.
    for i in 0..3 {
        let (reply, results) = step(i, 2);
        c.push_step(&mut state, reply, results);
    }
    let estimate = c.step_estimate(&mut state, &[]);
    assert!(!estimate.pays(), "{estimate:?}");
    assert_eq!(c.check(&mut state, &[]), None);
    assert!(c.after_step(&mut state, &[]).await.unwrap().is_empty());
    assert_eq!(archive.len(&thread).unwrap(), 0);
    // Large steps: the span leaving dwarfs the reset, so the milestone pays.
    for i in 3..8 {
        let (reply, results) = step(i, 200);
        c.push_step(&mut state, reply, results);
    }
    let estimate = c.step_estimate(&mut state, &[]);
    assert!(estimate.pays(), "{estimate:?}");
    assert!(estimate.net_saving() > 0.0);
    assert_eq!(c.check(&mut state, &[]), Some(Trigger::Steps));
    let events = c.after_step(&mut state, &[]).await.unwrap();
    assert_eq!(events.len(), 1);
    assert!(events[0].tokens_after < events[0].tokens_before);
}

#[tokio::test]
async fn every_n_steps_stays_available_unconditionally() {
    let config = CompactionConfig::default().with_every_steps(Some(3));
    assert_eq!(config.step_trigger, StepTrigger::Always);
    let (c, _, _) = compactor(config, 200_000);
    let mut state = ContextState::new(GoalAnchor::new("Find why the build is slow."));
    for i in 0..3 {
        let (reply, results) = step(i, 2);
        c.push_step(&mut state, reply, results);
    }
    // It would not pay, and fires anyway.
    assert!(!c.step_estimate(&mut state, &[]).pays());
    assert_eq!(c.check(&mut state, &[]), Some(Trigger::Steps));
}

#[tokio::test]
async fn a_milestone_not_smaller_than_its_span_is_not_applied() {
    let config = CompactionConfig::default()
        .with_every_steps(Some(1))
        .with_keep_recent_tokens(0);
    let (c, archive, thread) = compactor(config, 200_000);
    let mut state = ContextState::new(GoalAnchor::new("Say hi."));
    // Two tiny steps: any summary with its heading is longer than they are.
    for i in 0..2 {
        c.push_step(
            &mut state,
            Message::assistant("hi").with_id(format!("a{i}")),
            vec![Message::user("ok").with_id(format!("u{i}"))],
        );
    }
    let before = state.clone();
    let err = c
        .compact(&mut state, Trigger::Steps, &[])
        .await
        .unwrap_err();
    assert!(matches!(err, CompactionError::NotSmaller { .. }), "{err}");
    assert_eq!(state.raw, before.raw);
    assert!(state.milestones.is_empty());
    assert_eq!(state.step_at_compaction, before.step_at_compaction);
    // Nothing archived (so a later milestone archives it exactly once), no event.
    assert_eq!(archive.len(&thread).unwrap(), 0);
    assert!(state.events.is_empty());
    // after_step treats it as nothing to do.
    assert!(c.after_step(&mut state, &[]).await.unwrap().is_empty());
}

#[tokio::test]
async fn masking_leaves_results_shorter_than_their_placeholder() {
    let config = CompactionConfig::default()
        .with_strategy(Strategy::Masking {
            keep_turns: 1,
            block: 1,
        })
        .with_window_fraction(0.3);
    let (c, _, _) = compactor(config, 4_000);
    let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    for i in 0..12 {
        // Every other result is one short line.
        let (reply, mut results) = step(i, if i % 2 == 0 { 30 } else { 0 });
        if i % 2 == 1 {
            results[0].content = "ok".into();
        }
        c.push_step(&mut state, reply, results);
        c.after_step(&mut state, &[]).await.unwrap();
    }
    let masked: Vec<&Message> = state
        .raw
        .iter()
        .filter(|m| m.metadata.contains_key(MASKED_METADATA_KEY))
        .collect();
    assert!(!masked.is_empty());
    assert!(masked.iter().all(|m| m.text().starts_with("[masked: ")));
    // The short results stayed as they were.
    let short = state.raw.iter().filter(|m| m.text() == "ok").count();
    assert_eq!(short, 6);
}

/// `strategy` on a 4,000-token window whose token threshold is low (30% of the
/// budget), so there is a long stretch under the budget.
fn masking_rig(strategy: Strategy, trigger: StepTrigger) -> Compactor {
    let config = CompactionConfig::default()
        .with_strategy(strategy)
        .with_window_fraction(0.3)
        .with_step_trigger(trigger);
    compactor(config, 4_000).0
}

#[tokio::test]
async fn masking_waits_below_the_budget_until_it_pays() {
    // The hybrid: no masking of all but the last turn before a summary.
    let strategy = Strategy::Hybrid {
        keep_turns: 6,
        block: 1,
    };
    let c = masking_rig(strategy, StepTrigger::default());
    let eager = masking_rig(strategy, StepTrigger::Always);
    let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    // Steps of even size, the last 6 kept: masking the few older results would
    // re-send the 6 after them uncached, for a saving of a few cached tokens a call.
    let mut waited = 0;
    for i in 0.. {
        let (reply, results) = step(i, 12);
        c.push_step(&mut state, reply, results);
        let total = c.tokens(&mut state, &[]).total;
        if total >= c.budget() {
            // At the budget it masks whatever it costs.
            assert!(!c.mask_estimate(&mut state, &[]).pays());
            assert_eq!(c.check(&mut state, &[]), Some(Trigger::Tokens));
            let events = c.after_step(&mut state, &[]).await.unwrap();
            assert!(!events.is_empty());
            assert!(events.iter().all(|e| e.trigger == Trigger::Tokens));
            // The events say it was due, not chosen.
            assert!(events.iter().all(|e| e.at_budget()), "{events:?}");
            assert!(c.tokens(&mut state, &[]).total < c.budget());
            break;
        }
        if total >= c.threshold() {
            let estimate = c.mask_estimate(&mut state, &[]);
            assert!(!estimate.pays(), "{estimate:?}");
            assert_eq!(c.check(&mut state, &[]), None, "step {i}");
            // Masking at the threshold regardless is still there for those who want it.
            assert_eq!(eager.check(&mut state, &[]), Some(Trigger::Tokens));
            // Waiting with something to mask (before the boundary reached a result,
            // the hybrid waited too, where it used to summarize).
            waited += usize::from(estimate.leaving > 0);
        }
        assert!(c.after_step(&mut state, &[]).await.unwrap().is_empty());
    }
    assert!(waited >= 3, "{waited}");
}

#[tokio::test]
async fn masking_below_the_budget_goes_ahead_when_it_pays() {
    let strategy = Strategy::Masking {
        keep_turns: 1,
        block: 1,
    };
    let c = masking_rig(strategy, StepTrigger::default());
    let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    // One large result, then small steps: masking it frees far more than the little
    // after it costs to re-send.
    let (reply, results) = step(0, 40);
    c.push_step(&mut state, reply, results);
    for i in 1..3 {
        let (reply, results) = step(i, 1);
        c.push_step(&mut state, reply, results);
    }
    let total = c.tokens(&mut state, &[]).total;
    assert!(total >= c.threshold() && total < c.budget(), "{total}");
    let estimate = c.mask_estimate(&mut state, &[]);
    assert!(estimate.pays(), "{estimate:?}");
    assert!(estimate.leaving > 5 * estimate.tail, "{estimate:?}");
    assert_eq!(c.check(&mut state, &[]), Some(Trigger::Tokens));
    let events = c.after_step(&mut state, &[]).await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, keel_compaction::EventKind::Mask);
    // Chosen because it paid, below the budget.
    assert_eq!(events[0].budget, c.prompt_budget());
    assert!(!events[0].at_budget());
    assert!(state.raw[1].metadata.contains_key(MASKED_METADATA_KEY));
}

#[tokio::test]
async fn the_prompt_ceiling_compacts_below_a_huge_window() {
    let config = CompactionConfig::default()
        .with_every_steps(None)
        .with_max_prompt_tokens(Some(3_000));
    let (c, _, _) = compactor(config, 1_000_000);
    assert_eq!(c.prompt_budget(), 3_000);
    let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    for i in 0..40 {
        let (reply, results) = step(i, 20);
        c.push_step(&mut state, reply, results);
        c.after_step(&mut state, &[]).await.unwrap();
        let tokens = c.tokens(&mut state, &[]).total;
        assert!(tokens <= 3_000, "step {i}: {tokens}");
    }
    assert!(!state.events.is_empty());
    assert!(
        state
            .events
            .iter()
            .all(|e| e.trigger == Trigger::Tokens && e.error.is_none())
    );
}

/// keel-summarize's extractive summarizer knows an observation by the same metadata key
/// keel-compaction sets: a tool's output relayed as a user turn is never the intent.
#[tokio::test]
async fn observations_relayed_as_user_turns_are_not_the_intent() {
    use keel_compaction::OBSERVATION_METADATA_KEY;
    use keel_summarize::{SESSION_INTENT, Summarizer, SummaryRequest};
    let mut observation = Message::user("total 8\nREADME.md\nsetup.py\n");
    observation
        .metadata
        .insert(OBSERVATION_METADATA_KEY.to_owned(), json!(true));
    let span = [
        Message::assistant("Listing the files.").with_id("a1"),
        observation,
        Message::user("Please also check the tests.").with_id("u2"),
    ];
    let s = ExtractiveSummarizer::new()
        .summarize(&SummaryRequest::milestone(&span, 200))
        .await
        .unwrap();
    assert_eq!(
        s.section(SESSION_INTENT).unwrap(),
        ["Please also check the tests."]
    );
}

/// A memory store whose `append` (the archive's write) blocks its thread until another
/// task answers on a channel, for at most five seconds.
struct WaitingStore {
    inner: keel_offload::MemoryStore,
    answer: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    answered: std::sync::atomic::AtomicBool,
}

impl keel_offload::OffloadStore for WaitingStore {
    fn put(&self, key: &keel_offload::Key, text: &str) -> Result<u64, keel_offload::OffloadError> {
        self.inner.put(key, text)
    }
    fn append(
        &self,
        key: &keel_offload::Key,
        text: &str,
    ) -> Result<u64, keel_offload::OffloadError> {
        let got = self
            .answer
            .lock()
            .unwrap()
            .recv_timeout(std::time::Duration::from_secs(5));
        if got.is_ok() {
            self.answered
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.append(key, text)
    }
    fn get(&self, key: &keel_offload::Key) -> Result<String, keel_offload::OffloadError> {
        self.inner.get(key)
    }
    fn open(
        &self,
        key: &keel_offload::Key,
    ) -> Result<Box<dyn std::io::Read + Send + '_>, keel_offload::OffloadError> {
        self.inner.open(key)
    }
    fn read_at(
        &self,
        key: &keel_offload::Key,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, keel_offload::OffloadError> {
        self.inner.read_at(key, offset, len)
    }
    fn size(&self, key: &keel_offload::Key) -> Result<Option<u64>, keel_offload::OffloadError> {
        self.inner.size(key)
    }
    fn list(
        &self,
        thread: &ThreadId,
        under: Option<&keel_offload::StorePath>,
    ) -> Result<Vec<keel_offload::Entry>, keel_offload::OffloadError> {
        self.inner.list(thread, under)
    }
    fn delete(&self, key: &keel_offload::Key) -> Result<bool, keel_offload::OffloadError> {
        self.inner.delete(key)
    }
}

/// The archive append runs off the runtime: on a current-thread runtime, another task
/// runs while the append blocks (inline, the append would wait its five seconds out
/// with the only runtime thread, and the other task could not answer).
#[test]
fn a_current_thread_runtime_keeps_serving_tasks_while_the_archive_writes() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let store = Arc::new(WaitingStore {
        inner: MemoryStore::new(),
        answer: std::sync::Mutex::new(rx),
        answered: std::sync::atomic::AtomicBool::new(false),
    });
    let archive = Arc::new(Archive::new(store.clone()));
    let thread = ThreadId::new("t").unwrap();
    let c = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        archive.clone(),
        thread.clone(),
        Arc::new(ApproxCounter::new()),
        ModelProfile::new("test", 200_000, 20_000, Encoding::Approximate),
    )
    .with_config(CompactionConfig::default().with_every_steps(Some(3)));
    let mut state = ContextState::new(GoalAnchor::new("Find why the build is slow."));
    for i in 0..6 {
        let (reply, results) = step(i, 200);
        c.push_step(&mut state, reply, results);
    }
    runtime.block_on(async {
        let answerer = tokio::spawn(async move {
            // Runs only if the runtime's one thread is free while the append blocks.
            let _ = tx.send(());
        });
        let event = c.compact(&mut state, Trigger::Steps, &[]).await.unwrap();
        assert!(event.error.is_none(), "{event:?}");
        assert!(event.messages_archived > 0, "{event:?}");
        answerer.await.unwrap();
    });
    assert!(
        store.answered.load(std::sync::atomic::Ordering::SeqCst),
        "the other task answered while the archive append was blocked"
    );
    assert!(archive.len(&thread).unwrap() > 0);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// `may_trigger` on a state's parts answers `false` only when `check` on the state
    /// fires nothing, and `tokens_of` counts what `tokens` does, over windows from tiny
    /// to large, every strategy, forced or not, with and without a step trigger.
    #[test]
    fn may_trigger_is_false_only_when_check_fires_nothing(
        window in proptest::sample::select(vec![600usize, 2_000, 8_000, 200_000]),
        strategy in proptest::sample::select(vec![Strategy::Hierarchical, Strategy::masking(), Strategy::hybrid()]),
        every in proptest::option::of(1usize..6),
        force in proptest::bool::ANY,
        max_steps in 1u64..12,
        steps in proptest::collection::vec(0usize..40, 0..10),
        compacted_at in 0u64..4,
    ) {
        let mut config = CompactionConfig::default()
            .with_strategy(strategy)
            .with_every_steps(every)
            .with_max_steps(max_steps);
        if force {
            config = config.forced();
        }
        let (c, _, _) = compactor(config, window);
        let mut state = ContextState::new(GoalAnchor::new("Keep the build green."))
            .with_system(Message::system("You fix builds."));
        for (i, lines) in steps.iter().enumerate() {
            let (reply, results) = step(i, *lines);
            c.push_step(&mut state, reply, results);
        }
        state.step_at_compaction = compacted_at.min(state.step);
        let parts = state.parts();
        let may = c.may_trigger(parts, &[]);
        let of = c.tokens_of(parts, &[]);
        let fired = c.check(&mut state, &[]);
        proptest::prop_assert_eq!(of, c.tokens(&mut state, &[]));
        proptest::prop_assert!(may || fired.is_none(), "may_trigger said no, check fired {:?}", fired);
    }
}

#[test]
fn a_shared_tool_list_counts_as_its_copies_and_another_list_is_counted_anew() {
    let spec = |name: &str| {
        ToolSpec::new(
            name,
            "Reads a file of the repository.",
            json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        )
    };
    let shared: Arc<[ToolSpec]> = Arc::from(vec![spec("read_file"), spec("grep")]);
    let fewer = vec![spec("grep")];
    let fresh = || ContextState::new(GoalAnchor::new("Read the code."));
    let (plain, ..) = compactor(CompactionConfig::default(), 100_000);
    let all = plain.tokens(&mut fresh(), &shared).tools;
    let one = plain.tokens(&mut fresh(), &fewer).tools;
    assert!(all > one && one > 0, "{all} {one}");

    let (c, ..) = compactor(CompactionConfig::default(), 100_000);
    let first = plain.tokens(&mut fresh(), &shared[..1]).tools;
    assert!(first > 0 && first < all, "{first} {all}");
    for (list, expected) in [
        (&shared[..], all),
        // A prefix of the shared list starts at its address: counted as itself.
        (&shared[..1], first),
        (&shared[..], all),
        // The same specs elsewhere in memory, another list, the shared one again.
        (&shared.to_vec()[..], all),
        (&fewer[..], one),
        (&shared[..], all),
    ] {
        let c = c.clone().with_tools(shared.clone());
        assert_eq!(c.tokens(&mut fresh(), list).tools, expected);
    }
    let c = c.with_tools(shared.clone());
    for (list, expected) in [(&shared[..1], first), (&fewer[..], one), (&shared[..], all)] {
        assert_eq!(c.tokens(&mut fresh(), list).tools, expected);
    }
}
