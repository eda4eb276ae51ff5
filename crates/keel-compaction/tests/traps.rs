//! Traps of the compaction engine: the newest step is never flushed, milestone headers
//! name the steps they hold, every-N fires at step N, every message gets an id on the
//! way in, and a failed compaction leaves the whole state as it was.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use async_trait::async_trait;
use keel_compaction::{
    CompactionConfig, CompactionError, CompactionEvent, Compactor, ContextState, EventKind,
    GoalAnchor, Trigger,
};
use keel_message::{Message, Role, ToolCall};
use keel_offload::{Archive, MemoryStore, OffloadStore, ThreadId};
use keel_summarize::{ExtractiveSummarizer, SummarizeError, Summarizer, Summary, SummaryRequest};
use keel_token::{ApproxCounter, Encoding, ModelProfile};
use serde_json::json;

struct Failing;

#[async_trait]
impl Summarizer for Failing {
    async fn summarize(&self, _: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        Err(SummarizeError::EmptyInput)
    }
}

struct Rig {
    compactor: Compactor,
    archive: Arc<Archive>,
    store: Arc<dyn OffloadStore>,
    thread: ThreadId,
}

fn rig(config: CompactionConfig, window: usize, summarizer: Arc<dyn Summarizer>) -> Rig {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let archive = Arc::new(Archive::new(Arc::clone(&store)));
    let thread = ThreadId::new("t").unwrap();
    let compactor = Compactor::new(
        summarizer,
        archive.clone(),
        thread.clone(),
        Arc::new(ApproxCounter::new()),
        ModelProfile::new("test", window, window / 10, Encoding::Approximate),
    )
    .with_config(config.with_summary_budgets(400, 600));
    Rig {
        compactor,
        archive,
        store,
        thread,
    }
}

fn extractive() -> Arc<dyn Summarizer> {
    Arc::new(ExtractiveSummarizer::new())
}

/// Step `i` with a result of `lines` log lines; ids `a{i}` and `r{i}`.
fn step(i: usize, lines: usize) -> (Message, Vec<Message>) {
    let reply = Message::assistant(format!("Step {i}."))
        .with_id(format!("a{i}"))
        .with_tool_calls(vec![ToolCall::new(
            format!("c{i}"),
            "sh",
            json!({"cmd": format!("cat part-{i}.log")}),
        )]);
    let log: String = (0..lines)
        .map(|k| format!("part {i} line {k}: nothing unusual here\n"))
        .collect();
    (
        reply,
        vec![Message::tool(format!("c{i}"), log).with_id(format!("r{i}"))],
    )
}

#[tokio::test]
async fn the_newest_step_stays_even_when_larger_than_the_tail_and_over_budget() {
    let config = CompactionConfig::default()
        .with_every_steps(None)
        .with_keep_recent_tokens(50);
    let rig = rig(config, 4_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    for i in 0..12 {
        let (reply, results) = step(i, 25);
        rig.compactor.push_step(&mut state, reply, results);
    }
    // The newest step alone is far larger than the 50-token tail (and below the
    // eviction threshold), and the prompt is over the budget.
    let (reply, results) = step(12, 50);
    rig.compactor.push_step(&mut state, reply, results);
    assert!(
        !state
            .raw
            .last()
            .unwrap()
            .text()
            .contains("large_tool_results")
    );
    assert!(rig.compactor.tokens(&mut state, &[]).total > rig.compactor.budget());
    rig.compactor
        .compact(&mut state, Trigger::Overflow, &[])
        .await
        .unwrap();
    let ids: Vec<&str> = state.raw.iter().filter_map(|m| m.id.as_deref()).collect();
    assert_eq!(ids, ["a12", "r12"], "the newest step, whole");
    assert!(rig.archive.get(&rig.thread, "r11").unwrap().is_some());
}

/// Compacts `state`, whose prompt is over the budget with only its newest step left to
/// give, for an overflow: the event must be a fit that brings it within the budget.
async fn fit_over_budget(rig: &Rig, state: &mut ContextState) -> CompactionEvent {
    let budget = rig.compactor.prompt_budget();
    assert!(rig.compactor.tokens(state, &[]).total > budget);
    let event = rig
        .compactor
        .compact(state, Trigger::Overflow, &[])
        .await
        .unwrap();
    assert_eq!(event.kind, EventKind::Fit, "{event:?}");
    assert!(event.tokens_after <= budget, "{event:?}");
    event
}

#[tokio::test]
async fn an_overflow_with_only_the_newest_step_left_stores_its_results_and_fits() {
    // Two reads in one step, both exempt from eviction (`read_file`) and together over
    // the budget, with nothing older to compact: the overflow stores each whole and
    // leaves stubs, so the prompt fits and every call keeps its answer.
    let rig = rig(CompactionConfig::default(), 4_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    let file = |i: usize| -> String {
        (0..120)
            .map(|k| {
                format!("{k:>6}\tlet value_{k} = compute_{i}_{k}(&input, Options::default())?;\n")
            })
            .collect()
    };
    let reply = Message::assistant("Reading two files.")
        .with_id("a1")
        .with_tool_calls(vec![
            ToolCall::new("c1", "read_file", json!({"path": "a.rs"})),
            ToolCall::new("c2", "read_file", json!({"path": "b.rs"})),
        ]);
    let results = vec![
        Message::tool("c1", file(1))
            .with_id("r1")
            .with_name("read_file"),
        Message::tool("c2", file(2))
            .with_id("r2")
            .with_name("read_file"),
    ];
    // Exempt from eviction: kept whole, and over the budget.
    rig.compactor.push_step(&mut state, reply, results);
    let event = fit_over_budget(&rig, &mut state).await;
    assert_eq!(
        rig.compactor.tokens(&mut state, &[]).total,
        event.tokens_after
    );
    let ids: Vec<&str> = state.raw.iter().filter_map(|m| m.id.as_deref()).collect();
    assert_eq!(
        ids,
        ["a1", "r1", "r2"],
        "the newest step stays, each call answered"
    );
    for (id, i) in [("r1", 1), ("r2", 2)] {
        let m = state
            .raw
            .iter()
            .find(|m| m.id.as_deref() == Some(id))
            .unwrap();
        let stub = m.text();
        if let Some(rest) =
            stub.strip_prefix("[Tool result too large for the context; stored in full at ")
        {
            let path = rest.split(':').next().unwrap();
            let stored = rig
                .store
                .get(&keel_offload::Key::new("t", path).unwrap())
                .unwrap();
            assert_eq!(stored, file(i), "{id} stored whole at {path}");
        } else {
            // Cutting the larger one was enough.
            assert_eq!(stub, file(i));
        }
    }
    // The provider refuses the prompt all the same (its window is smaller than the
    // profile's): a second overflow cuts further.
    let again = rig
        .compactor
        .compact(&mut state, Trigger::Overflow, &[])
        .await
        .unwrap();
    assert!(again.tokens_after < event.tokens_after, "{again:?}");
}

#[tokio::test]
async fn stubs_shrink_to_their_first_line_when_the_preview_does_not_fit() {
    // Forty results in one step on a small window: even stubs with a preview are too
    // many, so each is cut to where it is stored and how to read it.
    let rig = rig(CompactionConfig::default(), 12_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    let calls: Vec<ToolCall> = (0..40)
        .map(|i| {
            ToolCall::new(
                format!("c{i}"),
                "read_file",
                json!({"path": format!("{i}.rs")}),
            )
        })
        .collect();
    let reply = Message::assistant("Reading.")
        .with_id("a")
        .with_tool_calls(calls);
    let results: Vec<Message> = (0..40)
        .map(|i| {
            let text: String = (0..60)
                .map(|k| {
                    format!("part {i} line {k}: a line of source long enough to matter here\n")
                })
                .collect();
            Message::tool(format!("c{i}"), text).with_name("read_file")
        })
        .collect();
    rig.compactor.push_step(&mut state, reply, results);
    let budget = rig.compactor.prompt_budget();
    let event = rig
        .compactor
        .compact(&mut state, Trigger::Overflow, &[])
        .await
        .unwrap();
    assert!(event.tokens_after <= budget, "{event:?}");
    let briefs = state
        .raw
        .iter()
        .filter(|m| m.text().contains("stored in full at") && !m.text().contains("First 3 lines"))
        .count();
    assert!(briefs > 0, "some stubs are briefs");
    assert_eq!(state.raw.len(), 41, "every call keeps its answer");
}

#[tokio::test]
async fn a_short_result_of_long_lines_is_stored_with_a_stub_without_preview() {
    // A dozen lines of 60 characters: a stub showing three and three of them (with
    // its header and how-to-read line) would be no smaller than the result, so the
    // fit stores it with a stub of the header and how to read it alone.
    let result: String = (0..12)
        .map(|k| format!("{k:>3} the build step {k} finished without any warning at all\n"))
        .collect();
    let push = |rig: &Rig, state: &mut ContextState| {
        let reply = Message::assistant("Reading.")
            .with_id("a")
            .with_tool_calls(vec![ToolCall::new(
                "c1",
                "read_file",
                json!({"path": "log"}),
            )]);
        let results = vec![
            Message::tool("c1", result.clone())
                .with_id("r")
                .with_name("read_file"),
        ];
        rig.compactor.push_step(state, reply, results);
    };
    // The window whose budget is 10 tokens under this prompt.
    let probe = rig(CompactionConfig::default(), 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read the log."));
    push(&probe, &mut state);
    let total = probe.compactor.tokens(&mut state, &[]).total;
    let rig = rig(
        CompactionConfig::default(),
        (total - 10) * 10 / 9 + 1,
        extractive(),
    );
    let mut state = ContextState::new(GoalAnchor::new("Read the log."));
    push(&rig, &mut state);
    fit_over_budget(&rig, &mut state).await;
    let stub = state.raw.last().unwrap().text();
    assert!(
        stub.starts_with("[Tool result too large for the context; stored in full at"),
        "{stub}"
    );
    assert!(!stub.contains("First 3 lines"), "{stub}");
}

#[tokio::test]
async fn a_read_of_a_stored_result_is_cut_where_it_stands_not_stored_again() {
    // The model follows a stub and reads back more than the window holds. Storing the
    // read would leave a stub pointing to a copy of it, and reading that would only
    // nest line numbers: the read is cut in place, with a note to read less.
    let rig = rig(CompactionConfig::default(), 4_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read the log."));
    let read: String = (0..300)
        .map(|k| {
            format!(
                "{:>6}\tpart {k}: the request was served and logged\n",
                k + 1
            )
        })
        .collect();
    let reply = Message::assistant("Reading it back.")
        .with_id("a")
        .with_tool_calls(vec![ToolCall::new(
            "c9",
            "read_file",
            json!({"path": "large_tool_results/c1", "offset": 0, "limit": 300}),
        )]);
    rig.compactor.push_step(
        &mut state,
        reply,
        vec![
            Message::tool("c9", read.clone())
                .with_id("r")
                .with_name("read_file"),
        ],
    );
    fit_over_budget(&rig, &mut state).await;
    let cut = state.raw.last().unwrap().text();
    assert!(
        cut.starts_with("     1\tpart 0: the request"),
        "{}",
        &cut[..80]
    );
    assert!(
        cut.contains("[This read was cut to fit the context:"),
        "{cut}"
    );
    assert!(
        rig.store.list(&rig.thread, None).unwrap().is_empty(),
        "nothing stored again"
    );
}

#[tokio::test]
async fn call_refuses_a_reply_cap_the_profile_keeps_no_room_for() {
    // A 2,048-token window whose profile keeps 204 tokens for the reply, and a call
    // asking for 1,024: a prompt at the budget beside such a reply overflows a server
    // that checks both, and no compaction could make room. Refused before sending.
    let rig = rig(CompactionConfig::default(), 2_048, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    let model = keel_model::ScriptedModel::from_texts(["never"]);
    let options = keel_model::ChatOptions::new().max_tokens(1_024);
    let err = rig
        .compactor
        .call(&model, &mut state, &[], &options)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            keel_compaction::CallError::ReplyCapTooLarge {
                max_tokens: 1_024,
                reserved: 204,
                window: 2_048
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("ask for at most 204"), "{err}");
    assert!(model.requests().is_empty(), "nothing was sent");
    // Within the room kept, the call goes through.
    let options = keel_model::ChatOptions::new().max_tokens(204);
    let reply = rig
        .compactor
        .call(&model, &mut state, &[], &options)
        .await
        .unwrap();
    assert_eq!(reply.message.text(), "never");
}

#[tokio::test]
async fn over_the_budget_with_milestones_they_fold_before_they_are_due() {
    // Three milestones (an epoch is due at five), then a reply nothing can cut that
    // puts the prompt over the budget: the overflow's compaction folds the milestones
    // into the epoch summary rather than leave the prompt as it was.
    let rig = rig(CompactionConfig::default(), 4_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    for i in 0..9 {
        let (reply, results) = step(i, 25);
        rig.compactor.push_step(&mut state, reply, results);
        if i % 3 == 2 {
            rig.compactor
                .compact(&mut state, Trigger::Force, &[])
                .await
                .unwrap();
        }
    }
    assert!(!state.milestones.is_empty(), "{}", state.milestones.len());
    let long = "the plan is to read every part once more, carefully. ".repeat(240);
    rig.compactor
        .push_step(&mut state, Message::assistant(long).with_id("big"), vec![]);
    assert!(rig.compactor.tokens(&mut state, &[]).total > rig.compactor.prompt_budget());
    let event = rig
        .compactor
        .compact(&mut state, Trigger::Overflow, &[])
        .await
        .unwrap();
    assert_eq!(event.kind, EventKind::Epoch, "{event:?}");
    assert!(state.milestones.is_empty(), "folded");
    assert!(
        state.epoch.is_some() || !state.epochs.is_empty(),
        "an epoch summary"
    );
    assert_eq!(
        state.raw.last().unwrap().id.as_deref(),
        Some("big"),
        "the newest step stays"
    );
}

#[tokio::test]
async fn milestone_headers_name_the_steps_they_hold() {
    // Every 3 steps, a tail that holds about one step: milestone 1 holds steps 1-2
    // (step 3 is the tail), milestone 2 steps 3-5, and so on.
    let config = CompactionConfig::default()
        .with_every_steps(Some(3))
        .with_keep_recent_tokens(150);
    let rig = rig(config, 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    for i in 1..=12 {
        let (reply, results) = step(i, 8);
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    let layers: Vec<_> = state.layers().collect();
    assert!(layers.len() >= 3, "{}", layers.len());
    let mut next = 1;
    for l in &layers {
        // The range is the steps whose messages the archive got for this milestone.
        assert_eq!(l.first_step, next, "{}", l.message.text());
        for s in l.first_step..=l.last_step {
            assert!(
                rig.archive
                    .get(&rig.thread, &format!("a{s}"))
                    .unwrap()
                    .is_some(),
                "step {s} of {} is archived",
                l.message.text()
            );
        }
        let label = if l.first_step == l.last_step {
            format!("step {}]", l.first_step)
        } else {
            format!("steps {}–{}]", l.first_step, l.last_step)
        };
        assert!(
            l.message.text().lines().next().unwrap().ends_with(&label),
            "{}",
            l.message.text()
        );
        next = l.last_step + 1;
    }
    // The raw buffer starts with the step after the last milestone.
    assert_eq!(
        state.raw[0].id.as_deref(),
        Some(format!("a{next}").as_str())
    );
}

#[tokio::test]
async fn every_n_steps_fires_at_step_n_even_when_the_tail_would_keep_everything() {
    // A tail of 2,000 tokens would keep all ten small steps; asked for every 10, the
    // milestone still comes at step 10, with everything but the newest step.
    let config = CompactionConfig::default()
        .with_every_steps(Some(10))
        .with_keep_recent_tokens(2_000);
    let rig = rig(config, 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    for i in 1..=10 {
        let (reply, results) = step(i, 6);
        rig.compactor.push_step(&mut state, reply, results);
        let events = rig.compactor.after_step(&mut state, &[]).await.unwrap();
        assert_eq!(events.is_empty(), i < 10, "step {i}: {events:?}");
    }
    assert_eq!(state.events[0].step, 10);
    assert_eq!(state.raw[0].id.as_deref(), Some("a10"));
}

#[tokio::test]
async fn every_message_gets_an_id_on_the_way_in() {
    let config = CompactionConfig::default()
        .with_every_steps(Some(2))
        .with_keep_recent_tokens(0);
    let rig = rig(config, 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    rig.compactor
        .push(&mut state, vec![Message::user("also the old logs, please")]);
    for i in 1..=6 {
        let (mut reply, mut results) = step(i, 8);
        reply.id = None;
        results[0].id = None;
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor
            .push(&mut state, vec![Message::user(format!("thanks {i}"))]);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    assert!(state.raw.iter().all(|m| m.id.is_some()));
    let archived = rig.archive.range(&rig.thread, 0..1_000).unwrap();
    assert!(archived.len() > 5);
    for entry in &archived {
        let id = entry.message.id.as_deref().expect("archived with an id");
        let found = rig.archive.get(&rig.thread, id).unwrap().unwrap();
        assert_eq!(found.message, entry.message);
    }
    let ids: std::collections::HashSet<_> = archived.iter().map(|e| e.message.id.clone()).collect();
    assert_eq!(ids.len(), archived.len(), "ids are unique");
    assert_eq!(archived[0].message.id.as_deref(), Some("keel-0-p0"));
    assert_eq!(archived[1].message.id.as_deref(), Some("keel-1-0"));
    assert_eq!(archived[2].message.id.as_deref(), Some("keel-1-1"));
    // Numbered on after the step's own messages.
    assert_eq!(archived[3].message.id.as_deref(), Some("keel-1-p1"));
}

/// A step that writes a large file: the `write_file` argument is what the truncation
/// policy rewrites once the context passes 85% of the window.
fn write_step(i: usize) -> (Message, Vec<Message>) {
    let content: String = (0..120)
        .map(|k| format!("line {k} of generated file {i}\n"))
        .collect();
    let reply = Message::assistant(format!("Writing file {i}."))
        .with_id(format!("a{i}"))
        .with_tool_calls(vec![ToolCall::new(
            format!("c{i}"),
            "write_file",
            json!({"path": format!("gen/f{i}.txt"), "content": content}),
        )]);
    (
        reply,
        vec![Message::tool(format!("c{i}"), "written").with_id(format!("r{i}"))],
    )
}

#[tokio::test]
async fn a_failed_compaction_leaves_the_whole_state_as_it_was_even_when_truncation_fires() {
    let config = CompactionConfig::default()
        .with_every_steps(None)
        .with_keep_recent_tokens(100);
    let window = 40_000;
    let failing = rig(config.clone(), window, Arc::new(Failing));
    let mut state = ContextState::new(GoalAnchor::new("Generate the files."));
    let mut i = 0;
    // Fill the context past the truncation policy's 85% of the budget (below the
    // budget itself, so no fallback summarizer steps in).
    while failing.compactor.tokens(&mut state, &[]).total < failing.compactor.budget() * 88 / 100 {
        let (reply, results) = write_step(i);
        failing.compactor.push_step(&mut state, reply, results);
        i += 1;
    }
    assert!(state.raw.len() > 20, "old enough messages to truncate");
    failing.compactor.tokens(&mut state, &[]);
    let before = state.clone();
    let err = failing
        .compactor
        .compact(&mut state, Trigger::Tokens, &[])
        .await
        .unwrap_err();
    assert!(matches!(err, CompactionError::Summarize(_)), "{err}");
    // Truncation fired: its pointers were stored...
    let stored = failing
        .store
        .list(
            &failing.thread,
            Some(&keel_offload::StorePath::new("truncated_arguments").unwrap()),
        )
        .unwrap();
    assert!(!stored.is_empty(), "the truncation policy ran");
    // ...and the state is exactly as it was, but for the failed event and the count of
    // failures in a row.
    assert_eq!(state.events.len(), before.events.len() + 1);
    assert!(state.events.last().unwrap().error.is_some());
    state.events.pop();
    assert_eq!(state.failures_in_a_row, before.failures_in_a_row + 1);
    state.failures_in_a_row = before.failures_in_a_row;
    assert_eq!(state, before);
    // The same compaction with a working summarizer does rewrite the arguments.
    let working = rig(config, window, extractive());
    let mut state = before.clone();
    working
        .compactor
        .compact(&mut state, Trigger::Tokens, &[])
        .await
        .unwrap();
    assert_ne!(state.raw, before.raw);
    assert!(state.raw.iter().all(|m| m.role != Role::System));
}

/// JSON tool results enter minified (the same values, fewer tokens) unless
/// `minify_json` is off; other results and other roles enter as they came.
#[test]
fn json_results_enter_minified_unless_turned_off() {
    let pretty =
        "{\n  \"reservation_id\": \"OBUT9V\",\n  \"flights\": [ \"HAT078\", \"HAT118\" ]\n}";
    let reply = Message::assistant("").with_tool_calls(vec![ToolCall::new(
        "c1",
        "get_reservation_details",
        json!({}),
    )]);
    for on in [true, false] {
        let r = rig(
            CompactionConfig::default().with_minify_json(on),
            100_000,
            extractive(),
        );
        let mut state = ContextState::new(GoalAnchor::new("Change my flight."));
        r.compactor.push(&mut state, vec![Message::user(pretty)]);
        r.compactor.push_step(
            &mut state,
            reply.clone(),
            vec![
                Message::tool("c1", pretty),
                Message::tool("c1", "Error: no seats"),
            ],
        );
        let texts: Vec<String> = state.raw.iter().map(|m| m.text().into_owned()).collect();
        assert_eq!(texts[0], pretty, "a user message is never rewritten");
        assert_eq!(texts[3], "Error: no seats");
        if on {
            assert_eq!(
                texts[2],
                r#"{"reservation_id":"OBUT9V","flights":["HAT078","HAT118"]}"#
            );
            assert_eq!(
                state.raw[2].metadata["keel_offload"]["minified_json"]["bytes"],
                pretty.len()
            );
        } else {
            assert_eq!(texts[2], pretty);
            assert!(state.raw[2].metadata.is_empty());
        }
    }
}

#[tokio::test]
async fn a_copy_of_the_goal_pushed_as_a_turn_does_not_stop_compaction() {
    // A user who pushes the anchor's message as the first user turn: with its goal
    // flag kept, every milestone's summary request held it and was refused.
    let config = CompactionConfig::default()
        .with_every_steps(Some(4))
        .with_keep_recent_tokens(100);
    let rig = rig(config, 100_000, extractive());
    let goal = GoalAnchor::new("Read every part.");
    let mut state = ContextState::new(goal.clone());
    rig.compactor
        .push(&mut state, vec![goal.message().clone().with_id("g")]);
    let mut made = 0;
    for i in 1..=8 {
        let (reply, results) = step(i, 8);
        rig.compactor.push_step(&mut state, reply, results);
        made += rig
            .compactor
            .after_step(&mut state, &[])
            .await
            .unwrap()
            .len();
    }
    assert!(made > 0, "no compaction happened");
    assert!(state.layers().count() > 0);
    assert!(state.raw.iter().all(|m| m.id.as_deref() != Some("g")));
    // The turn left the context through the archive, unflagged; the anchor is intact.
    let archived = rig.archive.get(&rig.thread, "g").unwrap().unwrap().message;
    assert_eq!(archived.text(), "Read every part.");
    assert!(!keel_summarize::is_goal(&archived));
    assert!(keel_summarize::is_goal(state.goal.message()));
}

#[tokio::test]
async fn a_failing_summarizer_falls_back_from_the_second_compaction_in_a_row() {
    for (setting, fallbacks) in [(Some(1), true), (None, false)] {
        let config = CompactionConfig::default()
            .with_every_steps(Some(3))
            .with_keep_recent_tokens(60)
            .with_fallback_after_failures(setting);
        let rig = rig(config, 100_000, Arc::new(Failing));
        let mut state = ContextState::new(GoalAnchor::new("Read every part."));
        let mut outcomes = Vec::new();
        for i in 1..=9 {
            let (reply, results) = step(i, 8);
            rig.compactor.push_step(&mut state, reply, results);
            if let Some(trigger) = rig.compactor.check(&mut state, &[]) {
                let result = rig.compactor.compact(&mut state, trigger, &[]).await;
                outcomes.push(result.map(|e| e.fallback).map_err(|e| e.to_string()));
            }
        }
        assert!(outcomes.len() >= 3, "{outcomes:?}");
        // The first compaction fails and changes nothing, whatever the setting.
        assert!(outcomes[0].is_err(), "{outcomes:?}");
        if fallbacks {
            // From the second on, the extractive fallback writes every summary, and
            // the streak counts them all: the summarizer failed at each.
            assert!(outcomes[1..].iter().all(|o| *o == Ok(true)), "{outcomes:?}");
            assert_eq!(state.failures_in_a_row as usize, outcomes.len());
            assert!(!state.milestones.is_empty());
        } else {
            assert!(outcomes.iter().all(Result::is_err), "{outcomes:?}");
            assert!(state.milestones.is_empty());
        }
    }
}

/// Fails every call with `error()`, counting the calls.
struct Counting<F> {
    calls: std::sync::atomic::AtomicUsize,
    error: F,
}

#[async_trait]
impl<F: Fn() -> SummarizeError + Send + Sync> Summarizer for Counting<F> {
    async fn summarize(&self, _: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err((self.error)())
    }
}

#[tokio::test]
async fn only_a_failed_model_call_is_summarized_again() {
    let rejected = || SummarizeError::Rejected {
        reason: keel_summarize::Rejection::Truncated,
        attempts: 2,
    };
    let down = || {
        SummarizeError::Model(keel_model::ModelError::Connection(
            "connection refused".into(),
        ))
    };
    let retry = keel_model::RetryPolicy::default()
        .max_attempts(3)
        .initial_backoff(std::time::Duration::from_millis(1));
    for (error, calls) in [
        (
            Box::new(rejected) as Box<dyn Fn() -> SummarizeError + Send + Sync>,
            1,
        ),
        (Box::new(down), 3),
    ] {
        let summarizer = Arc::new(Counting {
            calls: std::sync::atomic::AtomicUsize::new(0),
            error,
        });
        let config = CompactionConfig::default()
            .with_every_steps(None)
            .with_keep_recent_tokens(50)
            .with_summary_retry(retry.clone())
            .with_fallback_after_failures(None);
        let rig = rig(config, 100_000, summarizer.clone());
        let mut state = ContextState::new(GoalAnchor::new("Read every part."));
        for i in 0..6 {
            let (reply, results) = step(i, 8);
            rig.compactor.push_step(&mut state, reply, results);
        }
        let err = rig
            .compactor
            .compact(&mut state, Trigger::Force, &[])
            .await
            .unwrap_err();
        assert!(matches!(err, CompactionError::Summarize(_)), "{err}");
        assert_eq!(
            summarizer.calls.load(std::sync::atomic::Ordering::SeqCst),
            calls,
            "{err}"
        );
    }
}

#[tokio::test]
async fn a_tool_call_id_reused_every_turn_still_compacts() {
    // Some servers number tool calls per reply (`call_0` every turn). Each result
    // answers the latest call with its id, so the turns can still be cut apart.
    let config = CompactionConfig::default()
        .with_every_steps(Some(5))
        .with_keep_recent_tokens(0);
    let rig = rig(config, 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    for i in 1..=12 {
        let (mut reply, mut results) = step(i, 4);
        reply.tool_calls[0].id = "call_0".to_owned();
        results[0].tool_call_id = Some("call_0".to_owned());
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    assert_eq!(state.milestones.len(), 2, "{:?}", state.events);
    // The second milestone (step 10) kept its newest turn whole, call and result.
    let ids: Vec<_> = state.raw.iter().filter_map(|m| m.id.as_deref()).collect();
    assert_eq!(ids, ["a10", "r10", "a11", "r11", "a12", "r12"]);
}

#[tokio::test]
async fn a_milestone_does_not_repeat_what_an_earlier_layer_says_word_for_word() {
    // The same call gets the same error in every step; the first milestone keeps it,
    // and the next, beside it in the prompt, leaves it out.
    let config = CompactionConfig::default()
        .with_every_steps(Some(3))
        .with_keep_recent_tokens(0);
    let rig = rig(config, 100_000, extractive());
    let mut state = ContextState::new(GoalAnchor::new("Read every part."));
    let error = "ERROR: the cache at /var/cache/app is full";
    for i in 1..=7 {
        let (mut reply, mut results) = step(i, 3);
        reply.tool_calls[0] = ToolCall::new(format!("c{i}"), "sh", json!({"cmd": "make cache"}));
        results[0].content = format!("{error}\npart {i} read").into();
        rig.compactor.push_step(&mut state, reply, results);
        rig.compactor.after_step(&mut state, &[]).await.unwrap();
    }
    assert_eq!(state.milestones.len(), 2, "{:?}", state.events);
    assert!(
        state.milestones[0].text.contains(error),
        "{}",
        state.milestones[0].text
    );
    assert!(
        !state.milestones[1].text.contains(error),
        "{}",
        state.milestones[1].text
    );
    assert!(
        state.milestones[1].text.contains("sh(make cache)"),
        "{}",
        state.milestones[1].text
    );
}
