//! The compacting agent end to end: compaction, events, bad input, stops, storage.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keel_agent::{
    Agent, AgentError, AgentEvent, AgentInput, AgentState, AgentStateUpdate, AgentUpdate,
    BuildError, COMPACT, Stop,
};
use keel_checkpoint::{Checkpointer, ListOptions, MemorySaver, ThreadKey};
use keel_checkpoint_sqlite::SqliteSaver;
use keel_compaction::{CompactionConfig, GOAL_ID};
use keel_graph::{GraphError, RunConfig};
use keel_message::{Message, Role, Tool, ToolCall, ToolContext, ToolError, ToolFuture, ToolSpec};
use keel_model::{ChatResponse, ModelError, PolicyModel};
use keel_token::{Encoding, ModelProfile, TokenCounter};
use serde_json::{Value, json};

const GOAL: &str = "Count to the end and report the last number.";

/// A tool that answers with a line of text about its argument.
struct Echo;

impl Tool for Echo {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "echo",
            "Echoes a number.",
            json!({"type": "object", "properties": {"i": {"type": "integer"}}}),
        )
    }

    fn call(&self, arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let i = arguments["i"]
                .as_u64()
                .ok_or_else(|| ToolError::bad_arguments("`i` must be a number"))?;
            Ok(format!(
                "number {i} is {}; the service replied with status 200 for request REQ-{i:05}",
                if i % 2 == 0 { "even" } else { "odd" }
            ))
        })
    }
}

/// A model that calls `echo` `steps` times, then answers; it checks the goal heads
/// every prompt (after the system prompt) byte for byte.
fn counting_model(steps: u64, goal_seen: Arc<Mutex<Vec<bool>>>) -> PolicyModel {
    let calls = AtomicU64::new(0);
    PolicyModel::new("counting", move |messages, _tools| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        let goal = messages
            .iter()
            .find(|m| m.id.as_deref() == Some(GOAL_ID))
            .is_some_and(|m| m.text() == GOAL);
        goal_seen
            .lock()
            .unwrap()
            .push(goal && messages[0].role == Role::System);
        let reply = if n < steps {
            Message::assistant(format!("Next I will echo {n}.")).with_tool_calls(vec![
                ToolCall::new(format!("call-{n}"), "echo", json!({"i": n})),
            ])
        } else {
            Message::assistant(format!("The last number was {}.", steps - 1))
        };
        Ok(ChatResponse::new(reply, "counting"))
    })
}

fn profile() -> ModelProfile {
    ModelProfile::new("test-model", 32_000, 2_000, Encoding::Approximate)
}

fn builder(model: PolicyModel) -> keel_agent::AgentBuilder {
    Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .system("You count.")
        .goal(GOAL)
        .tool(Arc::new(Echo))
}

/// Every compaction event the state keeps reports success.
fn assert_compactions_succeeded(state: &keel_agent::AgentState) {
    assert!(
        state.compactions.iter().all(|e| e.error.is_none()),
        "{:?}",
        state.compactions
    );
}

async fn checkpoints(cp: &dyn Checkpointer, thread: &str) -> usize {
    cp.list(&ThreadKey::new(thread.to_owned()), ListOptions::default())
        .count()
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_run_compacts_into_milestones_and_epochs_and_prunes_on_sqlite() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let saver = Arc::new(SqliteSaver::open_in_memory().await.unwrap());
    let agent = builder(counting_model(60, seen.clone()))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_epoch_every(3)
                .with_keep_recent_tokens(50),
        )
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let run = agent.run("long", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("The last number was 59."));
    assert_eq!(run.state.step, 61);
    // 60 tool steps, a milestone every 5 steps, an epoch every 3 milestones.
    assert_eq!(run.state.milestones_made, 12);
    assert_eq!(run.state.epochs_made, 4);
    assert!(
        run.state.messages.len() < 20,
        "{} raw messages",
        run.state.messages.len()
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 61);
    assert!(seen.iter().all(|ok| *ok), "the goal must head every prompt");
    // Pruned after the last compaction: the 5 kept plus the steps since.
    let n = checkpoints(saver.as_ref(), "long").await;
    assert!(n <= 5 + 4, "{n} checkpoints after pruning");
    // Every compacted message is in the archive: the last milestone points at steps.
    let compactions = run
        .state
        .compactions
        .iter()
        .filter(|e| e.error.is_none())
        .count();
    assert_eq!(compactions, 16);
}

/// One token per character: four times what the approximate counter says of English.
struct PerChar;

impl TokenCounter for PerChar {
    fn count_text(&self, text: &str) -> usize {
        text.chars().count()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_default_summarizer_keeps_its_budget_in_the_agent_s_tokens() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(40, seen))
        .counter(Arc::new(PerChar))
        .profile(ModelProfile::new(
            "test-model",
            200_000,
            2_000,
            Encoding::Approximate,
        ))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                .with_epoch_every(100)
                .with_summary_budgets(150, 300),
        )
        .build()
        .unwrap();
    let run = agent.run("per-char", AgentInput::new()).await.unwrap();
    assert_compactions_succeeded(&run.state);
    assert!(
        run.state.milestones.len() >= 3,
        "{:?}",
        run.state.milestones
    );
    for m in &run.state.milestones {
        // The budget is the summary's text; the layer adds its message framing.
        assert!(
            PerChar.count_text(&m.text) <= 150,
            "{} characters: {}",
            m.text.chars().count(),
            m.text
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_stream_reports_model_calls_tool_calls_and_compactions() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(12, seen))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(50),
        )
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let items: Vec<AgentUpdate> = agent
        .stream("s", AgentInput::new())
        .map(|r| r.unwrap())
        .collect()
        .await;
    let count = |f: &dyn Fn(&AgentEvent) -> bool| {
        items
            .iter()
            .filter(|i| matches!(i, AgentUpdate::Event(e) if f(e)))
            .count()
    };
    assert_eq!(count(&|e| matches!(e, AgentEvent::ModelCall { .. })), 13);
    assert_eq!(
        count(&|e| matches!(e, AgentEvent::ToolCall { ok: true, .. })),
        12
    );
    assert_eq!(
        count(&|e| matches!(e, AgentEvent::Compaction(c) if c.error.is_none())),
        2
    );
    let model_call = items.iter().find_map(|i| match i {
        AgentUpdate::Event(AgentEvent::ModelCall { prompt_tokens, .. }) => Some(*prompt_tokens),
        _ => None,
    });
    assert!(model_call.unwrap() > 0);
    assert!(matches!(
        items.last(),
        Some(AgentUpdate::Done { next, answer: Some(a), stop: None, .. })
            if next.is_empty() && a == "The last number was 11."
    ));
    // Within a step, the model-call event comes before the reply it reports.
    let first_call = items
        .iter()
        .position(|i| matches!(i, AgentUpdate::Event(AgentEvent::ModelCall { .. })))
        .unwrap();
    let first_reply = items
        .iter()
        .position(|i| matches!(i, AgentUpdate::Message(m) if m.role == Role::Assistant))
        .unwrap();
    assert!(first_call < first_reply);
    assert!(
        items
            .iter()
            .any(|i| matches!(i, AgentUpdate::Message(m) if m.text() == "The last number was 11."))
    );
    // Streamed again with nothing new: the stored answer, and nothing run.
    let again: Vec<AgentUpdate> = agent
        .stream("s", AgentInput::new())
        .map(|r| r.unwrap())
        .collect()
        .await;
    assert!(matches!(
        again.as_slice(),
        [AgentUpdate::Done { answer: Some(a), stop: None, .. }] if a == "The last number was 11."
    ));
}

struct Panics;
impl Tool for Panics {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("panics", "Always panics.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move { panic!("the disk is on fire") })
    }
}

struct Hangs;
impl Tool for Hangs {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("hangs", "Never finishes.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(String::new())
        })
    }
}

struct Huge;
impl Tool for Huge {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("huge", "Returns 100 MB.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        // Heavy work goes to the blocking pool, as a well-behaved tool's should.
        Box::pin(async move {
            tokio::task::spawn_blocking(|| {
                let line = "0123456789abcdefghijklmnopqrstuvwxyz ".repeat(27) + "\n";
                line.repeat((100 << 20) / line.len() + 1)
            })
            .await
            .map_err(ToolError::failed)
        })
    }
}

struct Fails;
impl Tool for Fails {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("fails", "Fails.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            Err(ToolError::failed(
                "HTTP 503 from the billing service (INC-77341)",
            ))
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_tool_calls_become_tool_messages_and_the_run_goes_on() {
    let calls = AtomicU64::new(0);
    let model = PolicyModel::new("bad", move |_m, _t| {
        let reply = match calls.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("Trying everything.").with_tool_calls(vec![
                ToolCall::new("p", "panics", json!({})),
                ToolCall::new("h", "hangs", json!({})),
                ToolCall::new("u", "no_such_tool", json!({})),
                ToolCall::from_raw_arguments("j", "echo", "{\"i\": 4"),
                ToolCall::new("a", "echo", json!({"i": "four"})),
                ToolCall::new("f", "fails", json!({})),
                ToolCall::new("g", "huge", json!({})),
            ]),
            _ => Message::assistant("Done despite it all."),
        };
        Ok(ChatResponse::new(reply, "bad"))
    });
    let saver = Arc::new(MemorySaver::new());
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tools([
            Arc::new(Echo) as Arc<dyn Tool>,
            Arc::new(Panics),
            Arc::new(Hangs),
            Arc::new(Huge),
            Arc::new(Fails),
        ])
        .tool_timeout(Duration::from_secs(5)) // generous: on a loaded machine the other tools must finish first
        .checkpointer(saver)
        .build()
        .unwrap();
    let run = agent.run("bad", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done despite it all."));
    let result = |id: &str| -> String {
        run.state
            .messages
            .iter()
            .find(|m| m.role == Role::Tool && m.tool_call_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no result for {id}"))
            .text()
            .into_owned()
    };
    assert!(
        result("p").contains("panicked: the disk is on fire"),
        "{}",
        result("p")
    );
    assert!(
        result("h").contains("did not finish within 5 s"),
        "{}",
        result("h")
    );
    assert!(
        result("u").contains("no tool named `no_such_tool`"),
        "{}",
        result("u")
    );
    assert!(result("u").contains("echo"), "the message lists the tools");
    assert!(result("j").contains("not valid JSON"), "{}", result("j"));
    assert!(
        result("a").contains("bad arguments for `echo`: `i` must be a number"),
        "{}",
        result("a")
    );
    assert!(result("f").contains("INC-77341"), "{}", result("f"));
    // 100 MB went to the offload store; a stub with its path stays.
    let huge = result("g");
    assert!(
        huge.len() < 20_000,
        "a stub, not the result: {} bytes",
        huge.len()
    );
    assert!(huge.contains("large_tool_results/g"), "{huge}");
    let offloads: Vec<_> = run
        .state
        .events
        .iter()
        .filter(|e| matches!(e, AgentEvent::Offload { call_id, .. } if call_id == "g"))
        .collect();
    assert_eq!(offloads.len(), 1);
    let failed = run
        .state
        .events
        .iter()
        .filter(|e| matches!(e, AgentEvent::ToolCall { ok: false, .. }))
        .count();
    assert_eq!(failed, 6);
    // Each failure says what kind it is, without reading its text.
    let failure = |id: &str| {
        run.state.events.iter().find_map(|e| match e {
            AgentEvent::ToolCall {
                call_id, failure, ..
            } if call_id == id => Some(*failure),
            _ => None,
        })
    };
    use keel_agent::ToolFailure;
    assert_eq!(failure("p"), Some(Some(ToolFailure::Panicked)));
    assert_eq!(failure("h"), Some(Some(ToolFailure::TimedOut)));
    assert_eq!(failure("u"), Some(Some(ToolFailure::UnknownTool)));
    assert_eq!(failure("j"), Some(Some(ToolFailure::BadArguments)));
    assert_eq!(failure("a"), Some(Some(ToolFailure::BadArguments)));
    assert_eq!(failure("f"), Some(Some(ToolFailure::Failed)));
    assert_eq!(failure("g"), Some(None));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_reply_is_nudged_once_then_stops_resumably() {
    let model = PolicyModel::new("mute", |_m, _t| {
        Ok(ChatResponse::new(Message::assistant(""), "mute"))
    });
    let agent = builder(model)
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("mute", AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, Some(Stop::EmptyReply { steps: 2 }));
    assert_eq!(run.answer, None);
    let nudges = run
        .state
        .messages
        .iter()
        .filter(|m| m.metadata.contains_key(keel_agent::NUDGE_METADATA_KEY))
        .count();
    assert_eq!(nudges, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_goal_larger_than_the_prompt_budget_is_refused_before_anything_is_written() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let saver = Arc::new(MemorySaver::new());
    let agent = builder(counting_model(1, seen.clone()))
        .profile(ModelProfile::new("small", 2_000, 500, Encoding::O200kBase))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let huge = "word ".repeat(3_000);
    let refused = agent.run("big", AgentInput::new().goal(huge)).await;
    match refused {
        Err(AgentError::PromptTooLarge {
            ref thread_id,
            tokens,
            budget,
        }) => {
            assert_eq!(thread_id, "big");
            assert_eq!(budget, 1_500);
            assert!(tokens > 3_000, "{tokens}");
            let text = refused.unwrap_err().to_string();
            assert!(text.contains("prompt budget"), "{text}");
        }
        other => panic!("expected PromptTooLarge, got {other:?}"),
    }
    assert!(seen.lock().unwrap().is_empty(), "the model was not called");
    assert!(
        agent.state("big").await.unwrap().is_none(),
        "nothing was written"
    );
    // A goal that fits runs on the same agent.
    let run = agent
        .run("small", AgentInput::new().goal("Answer briefly."))
        .await
        .unwrap();
    assert!(run.answer.is_some());
}

#[test]
fn a_builder_whose_fixed_prompt_cannot_fit_is_refused_at_build() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let small = ModelProfile::new("small", 2_000, 500, Encoding::O200kBase);
    let built = builder(counting_model(1, seen.clone()))
        .profile(small.clone())
        .system("word ".repeat(2_000))
        .build();
    match built {
        Err(BuildError::PromptTooLarge {
            ref model,
            tokens,
            budget,
        }) => {
            assert_eq!(model, "small");
            assert_eq!(budget, 1_500);
            assert!(tokens > 2_000, "{tokens}");
            assert!(built.unwrap_err().to_string().contains("prompt budget"));
        }
        other => panic!("expected BuildError::PromptTooLarge, got {other:?}"),
    }
    // `max_prompt_tokens` is the budget when smaller than the model's.
    let ceiling = builder(counting_model(1, seen.clone()))
        .profile(small.clone())
        .compaction(CompactionConfig::default().with_max_prompt_tokens(Some(20)))
        .build();
    assert!(
        matches!(ceiling, Err(BuildError::PromptTooLarge { budget: 20, .. })),
        "{ceiling:?}"
    );
    // The same builder with a prompt that fits builds.
    assert!(
        builder(counting_model(1, seen))
            .profile(small)
            .build()
            .is_ok()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_resumed_with_a_window_its_goal_cannot_fit_in_is_refused() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let saver = Arc::new(MemorySaver::new());
    let goal = "word ".repeat(1_000);
    let wide = builder(counting_model(1, seen.clone()))
        .profile(ModelProfile::new(
            "wide",
            32_000,
            1_000,
            Encoding::O200kBase,
        ))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    wide.run("t", AgentInput::new().goal(goal.as_str()))
        .await
        .unwrap();
    let calls = seen.lock().unwrap().len();
    let before = wide.state("t").await.unwrap().unwrap();
    let narrow = builder(counting_model(1, seen.clone()))
        .profile(ModelProfile::new("narrow", 1_000, 200, Encoding::O200kBase))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let refused = narrow
        .run("t", AgentInput::new().message(Message::user("Go on.")))
        .await;
    assert!(
        matches!(refused, Err(AgentError::PromptTooLarge { ref thread_id, budget: 800, .. }) if thread_id == "t"),
        "{refused:?}"
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        calls,
        "the model was not called"
    );
    let after = wide.state("t").await.unwrap().unwrap();
    assert_eq!(after.messages, before.messages, "nothing was written");
    // The window it ran with still continues it.
    wide.run("t", AgentInput::new().message(Message::user("Go on.")))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_id_the_offload_store_cannot_name_is_refused_with_one_reason() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(1, seen.clone()))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    for id in ["user/123", ".hidden", ""] {
        let err = agent.run(id, AgentInput::new()).await.unwrap_err();
        assert!(matches!(err, AgentError::BadThreadId { ref thread_id, .. } if thread_id == id));
        let text = err.to_string();
        // The reason alone, not the offload store's whole message naming the id again.
        assert_eq!(text.matches(&format!("`{id}`")).count(), 1, "{text}");
        assert!(!text.contains("invalid thread id"), "{text}");
    }
    assert!(seen.lock().unwrap().is_empty());
}

#[test]
fn outside_a_tokio_runtime_run_and_stream_fail_with_a_typed_error() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(1, seen.clone())).build().unwrap();
    let run = futures::executor::block_on(agent.run("t", AgentInput::new()));
    assert!(matches!(run, Err(AgentError::NoRuntime)), "{run:?}");
    assert!(run.unwrap_err().to_string().contains("#[tokio::main]"));
    let items: Vec<_> =
        futures::executor::block_on(agent.stream("t", AgentInput::new()).collect::<Vec<_>>());
    assert!(
        matches!(items[..], [Err(AgentError::NoRuntime)]),
        "{items:?}"
    );
    assert!(seen.lock().unwrap().is_empty(), "the model was not called");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_goal_is_written_once() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(1, seen))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    agent.run("g", AgentInput::new()).await.unwrap();
    let again = agent
        .run("g", AgentInput::new().goal("Something else."))
        .await;
    assert!(matches!(again, Err(AgentError::GoalAlreadySet { ref thread_id }) if thread_id == "g"));
    // Written behind the agent's back, the channel refuses it with a typed error.
    let direct = agent
        .graph()
        .update_state(
            &RunConfig::thread("g"),
            AgentStateUpdate::default().goal("Sneaky.".into()),
            None,
        )
        .await;
    let err = direct
        .expect_err("a second goal write must fail")
        .to_string();
    assert!(err.contains("written once"), "{err}");
    // The thread is intact.
    let state = agent.state("g").await.unwrap().unwrap();
    assert_eq!(state.goal.unwrap().text(), GOAL);
    // A new thread without a goal is refused up front.
    let no_goal = Agent::builder()
        .model(Arc::new(counting_model(1, Arc::default())))
        .build()
        .unwrap()
        .run("fresh", AgentInput::new())
        .await;
    assert!(matches!(no_goal, Err(AgentError::NoGoal { .. })));
    // An empty goal, from the builder or the input, is refused before anything is
    // written.
    let saver = Arc::new(MemorySaver::new());
    let blank = Agent::builder()
        .model(Arc::new(counting_model(1, Arc::default())))
        .goal(" \n ")
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let refused = blank.run("blank", AgentInput::new()).await;
    assert!(
        matches!(refused, Err(AgentError::EmptyGoal { ref thread_id }) if thread_id == "blank"),
        "{refused:?}"
    );
    let refused = blank.run("blank", AgentInput::new().goal("")).await;
    assert!(
        matches!(refused, Err(AgentError::EmptyGoal { .. })),
        "{refused:?}"
    );
    assert!(blank.state("blank").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_step_ceiling_stops_the_run_and_a_higher_one_continues_it() {
    let saver = Arc::new(MemorySaver::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let model = Arc::new(counting_model(1_000, seen));
    let first = Agent::builder()
        .model(model.clone())
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Echo))
        .compaction(CompactionConfig::default().with_max_steps(5))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let run = first.run("ceiling", AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, Some(Stop::StepCeiling { steps: 5, max: 5 }));
    assert!(
        run.state
            .events
            .iter()
            .any(|e| matches!(e, AgentEvent::StepCeiling { .. }))
    );
    // Run again under the same ceiling: the same stop, and nothing run or stored.
    let again = first.run("ceiling", AgentInput::new()).await.unwrap();
    assert_eq!(again.stop, Some(Stop::StepCeiling { steps: 5, max: 5 }));
    assert_eq!(again.supersteps, 0);
    assert_eq!(again.checkpoint_id, run.checkpoint_id);
    let streamed: Vec<AgentUpdate> = first
        .stream("ceiling", AgentInput::new())
        .map(|r| r.unwrap())
        .collect()
        .await;
    assert!(matches!(
        streamed.as_slice(),
        [AgentUpdate::Done {
            answer: None,
            stop: Some(Stop::StepCeiling { steps: 5, max: 5 }),
            ..
        }]
    ));
    let second = Agent::builder()
        .model(model)
        .profile(profile())
        .tool(Arc::new(Echo))
        .compaction(CompactionConfig::default().with_max_steps(8))
        .checkpointer(saver)
        .build()
        .unwrap();
    let run = second.run("ceiling", AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, Some(Stop::StepCeiling { steps: 8, max: 8 }));
    let echoes = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .count();
    assert_eq!(echoes, 8, "every step's result kept, none repeated");
}

#[tokio::test(flavor = "multi_thread")]
async fn each_run_has_its_own_budget_of_model_calls_and_the_thread_ceiling_still_holds() {
    let saver = Arc::new(MemorySaver::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let model = Arc::new(counting_model(1_000, seen.clone()));
    let agent = Agent::builder()
        .model(model)
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Echo))
        .compaction(CompactionConfig::default().with_max_steps(10))
        .checkpointer(saver)
        .build()
        .unwrap();
    let run = agent
        .run("budget", AgentInput::new().max_steps(4))
        .await
        .unwrap();
    assert_eq!(run.stop, Some(Stop::RunBudget { steps: 4, max: 4 }));
    assert_eq!(run.state.step, 4);
    assert!(run.state.events.iter().any(|e| matches!(
        e,
        AgentEvent::RunBudget {
            steps: 4,
            max: 4,
            ..
        }
    )));
    assert_eq!(seen.lock().unwrap().len(), 4, "four model calls");
    // A budget of 0 makes no call and changes nothing but the stop.
    let run = agent
        .run("budget", AgentInput::new().max_steps(0))
        .await
        .unwrap();
    assert_eq!(run.stop, Some(Stop::RunBudget { steps: 0, max: 0 }));
    assert_eq!(seen.lock().unwrap().len(), 4);
    // Streaming counts the same way, from where the thread is.
    let mut updates = agent.stream("budget", AgentInput::new().max_steps(3));
    let mut stop = None;
    while let Some(update) = updates.next().await {
        if let AgentUpdate::Done { stop: s, .. } = update.unwrap() {
            stop = s;
        }
    }
    assert_eq!(stop, Some(Stop::RunBudget { steps: 3, max: 3 }));
    assert_eq!(agent.state("budget").await.unwrap().unwrap().step, 7);
    // The thread's ceiling (10) comes first when it is nearer than the budget.
    let run = agent
        .run("budget", AgentInput::new().max_steps(50))
        .await
        .unwrap();
    assert_eq!(run.stop, Some(Stop::StepCeiling { steps: 10, max: 10 }));
    let echoes = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .count();
    assert_eq!(echoes, 10, "every step's result kept, none repeated");
}

#[tokio::test(flavor = "multi_thread")]
async fn run_metadata_is_stored_with_the_checkpoints_and_read_back() {
    let saver = Arc::new(MemorySaver::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(3, seen))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    assert_eq!(agent.metadata("meta").await.unwrap(), None);
    let settings = json!({"dir": "../project", "window": 8_192});
    let run = agent
        .run("meta", AgentInput::new().metadata("cli", settings.clone()))
        .await
        .unwrap();
    assert!(run.answer.is_some());
    let metadata = agent.metadata("meta").await.unwrap().unwrap();
    assert_eq!(metadata.get("cli"), Some(&settings));
    assert!(
        !metadata.contains_key("step"),
        "keel's own keys are not in the extra map"
    );
    // Every checkpoint of the run carries it, so pruning keeps it.
    let key = ThreadKey::new("meta".to_owned());
    let mut all = saver.list(&key, ListOptions::default());
    let mut stored = 0;
    while let Some(summary) = all.next().await {
        let summary = summary.unwrap();
        assert_eq!(summary.metadata.extra.get("cli"), Some(&settings));
        stored += 1;
    }
    assert!(stored > 1, "{stored} checkpoints");

    let err = agent
        .run("meta-2", AgentInput::new().metadata("step", json!(1)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::ReservedMetadata { key } if key == "step"),
        "{err}"
    );
    assert_eq!(agent.state("meta-2").await.unwrap().map(|s| s.step), None);
}

/// A tool that raises a stop signal on its `at`-th call, counting its calls.
struct StopsAt {
    at: usize,
    calls: Arc<AtomicUsize>,
    stop: keel_agent::StopSignal,
}

impl Tool for StopsAt {
    fn spec(&self) -> ToolSpec {
        Echo.spec()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        if self.calls.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            self.stop.raise();
        }
        Echo.call(arguments, ctx)
    }
}

/// A stop signal raised mid-step (a shutdown) ends a streamed run once the step is
/// stored, with asynchronous durability on SQLite too: `Done` says so, and the next
/// run goes on without running a tool call or asking the model again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_stop_signal_ends_a_streamed_run_after_its_step_and_nothing_runs_twice() {
    let dir = tempfile::tempdir().unwrap();
    let cp = Arc::new(
        SqliteSaver::open(dir.path().join("k.sqlite"))
            .await
            .unwrap(),
    );
    let stop = keel_agent::StopSignal::new();
    let tool_calls = Arc::new(AtomicUsize::new(0));
    let model_calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&model_calls);
    let model = PolicyModel::new("counted", move |_messages, _tools| {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        let reply = if n < 6 {
            Message::assistant(format!("Next I will echo {n}.")).with_tool_calls(vec![
                ToolCall::new(format!("call-{n}"), "echo", json!({"i": n})),
            ])
        } else {
            Message::assistant("The last number was 5.")
        };
        Ok(ChatResponse::new(reply, "counted"))
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(StopsAt {
            at: 3,
            calls: Arc::clone(&tool_calls),
            stop: stop.clone(),
        }))
        .checkpointer(cp)
        .offload_store(Arc::new(
            keel_offload::SqliteStore::open(dir.path().join("k.sqlite")).unwrap(),
        ))
        .durability(keel_graph::Durability::Async)
        .build()
        .unwrap();
    let mut updates = agent.stream("graceful", AgentInput::new().stop_signal(stop));
    let mut done = None;
    while let Some(u) = updates.next().await {
        if let AgentUpdate::Done { stop, next, .. } = u.unwrap() {
            done = Some((stop, next));
        }
    }
    let (stop, next) = done.expect("a Done");
    assert_eq!(stop, Some(Stop::Requested));
    assert!(!next.is_empty(), "the nodes due are named");
    assert_eq!(tool_calls.load(Ordering::SeqCst), 3);
    assert_eq!(model_calls.load(Ordering::SeqCst), 3);
    drop(updates);

    let run = agent.run("graceful", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("The last number was 5."));
    assert_eq!(tool_calls.load(Ordering::SeqCst), 6, "each call ran once");
    assert_eq!(
        model_calls.load(Ordering::SeqCst),
        7,
        "each reply was asked for once"
    );
}

#[test]
fn stops_read_as_sentences() {
    assert_eq!(
        Stop::StepCeiling { steps: 5, max: 5 }.to_string(),
        "the step ceiling of 5 model calls was reached (5 made)"
    );
    assert_eq!(
        Stop::RunBudget { steps: 2, max: 2 }.to_string(),
        "this run's budget of 2 model calls was used (2 made)"
    );
    assert!(
        Stop::EmptyReply { steps: 3 }
            .to_string()
            .contains("after 3 model calls")
    );
    assert_eq!(
        Stop::Requested.to_string(),
        "the run was asked to stop after its current step"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_context_overflow_compacts_and_retries_once() {
    let calls = AtomicU64::new(0);
    let overflowed = Arc::new(AtomicU64::new(0));
    let o = overflowed.clone();
    let model = PolicyModel::new("small", move |messages, _t| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        // The provider's real window is smaller than the profile says.
        if messages.len() > 16 {
            o.fetch_add(1, Ordering::SeqCst);
            return Err(ModelError::ContextOverflow {
                message: "maximum context length exceeded".into(),
            });
        }
        let reply = if n < 30 {
            Message::assistant("more").with_tool_calls(vec![ToolCall::new(
                format!("c{n}"),
                "echo",
                json!({"i": n}),
            )])
        } else {
            Message::assistant("finished")
        };
        Ok(ChatResponse::new(reply, "small"))
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Echo))
        .compaction(CompactionConfig::default().with_every_steps(None))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("overflow", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("finished"));
    assert!(overflowed.load(Ordering::SeqCst) >= 2);
    let overflow_compactions = run
        .state
        .compactions
        .iter()
        .filter(|e| {
            e.trigger == keel_compaction::Trigger::Overflow
                && e.kind == keel_compaction::EventKind::Milestone
                && e.error.is_none()
        })
        .count() as u64;
    assert_eq!(overflow_compactions, overflowed.load(Ordering::SeqCst));
    assert!(run.state.events.iter().any(|e| matches!(
        e,
        AgentEvent::ModelCall {
            overflow_retries: 1,
            ..
        }
    )));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_overflow_compaction_cannot_cure_fails_with_the_model_s_typed_error() {
    let model = PolicyModel::new("tiny", |_m, _t| {
        Err(ModelError::ContextOverflow {
            message: "maximum context length exceeded".into(),
        })
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let err = agent.run("full", AgentInput::new()).await.unwrap_err();
    assert!(
        matches!(err.model_error(), Some(ModelError::ContextOverflow { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("agent"), "names the node: {err}");
    // The thread stays resumable from its last checkpoint.
    assert!(agent.state("full").await.unwrap().is_some());
}

/// What a scripted model was sent: the number of calls and the largest prompt, in
/// characters.
#[derive(Clone, Default)]
struct PromptWatch {
    calls: Arc<AtomicU64>,
    largest: Arc<AtomicU64>,
}

impl PromptWatch {
    /// Records a call's prompt; the call's number, from 0.
    fn call(&self, messages: &[Message]) -> u64 {
        let chars: usize = messages.iter().map(|m| m.text().len()).sum();
        self.largest.fetch_max(chars as u64, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst)
    }

    fn largest(&self) -> u64 {
        self.largest.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_result_over_the_window_is_stored_and_cut_to_a_stub_before_it_is_sent() {
    // No result is evicted when it arrives (a threshold no result reaches), and the
    // tool's result is far over the window: the prompt counted with it is not sent
    // (Ollama would cut it silently); the overflow's compaction stores it whole and
    // leaves a short stub, and the run goes on from there.
    let watch = PromptWatch::default();
    let seen = watch.clone();
    let prompts = Arc::new(Mutex::new(Vec::<String>::new()));
    let kept = prompts.clone();
    let model = PolicyModel::new("small", move |messages, _t| {
        let n = seen.call(messages);
        kept.lock().unwrap().push(
            messages
                .iter()
                .map(|m| m.text())
                .collect::<Vec<_>>()
                .join("\n"),
        );
        let reply = if n == 0 {
            Message::assistant("look").with_tool_calls(vec![ToolCall::new("c0", "huge", json!({}))])
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "small"))
    });
    let result = "all work and no play\n".repeat(20_000);
    let full = result.clone();
    let huge = keel_message::tool_fn(
        ToolSpec::new("huge", "Returns a lot.", json!({"type": "object"})),
        move |_, _| {
            let r = full.clone();
            async move { Ok(r) }
        },
    );
    let store = Arc::new(keel_offload::MemoryStore::new());
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new(
            "small",
            8_192,
            1_024,
            Encoding::O200kBase,
        ))
        .goal(GOAL)
        .tool(Arc::new(huge))
        .evict(Some(
            keel_offload::EvictLargeResults::new().with_threshold(usize::MAX),
        ))
        .checkpointer(Arc::new(MemorySaver::new()))
        .offload_store(store.clone())
        .build()
        .unwrap();
    let run = agent.run("big", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done."));
    // The model never saw the 420,000 characters: the stub is about a thousand.
    assert!(watch.largest() < 10_000, "{}", watch.largest());
    let second = prompts.lock().unwrap()[1].clone();
    let path = second
        .split("stored in full at ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .expect("a stub in the second prompt")
        .to_owned();
    assert!(
        second.contains("all work and no play"),
        "the stub shows the first lines"
    );
    // Stored whole, where the stub says.
    assert_eq!(
        keel_offload::OffloadStore::get(&*store, &keel_offload::Key::new("big", &path).unwrap())
            .unwrap(),
        result
    );
    let state = agent.state("big").await.unwrap().unwrap();
    assert!(
        state
            .compactions
            .iter()
            .any(|e| e.trigger == keel_compaction::Trigger::Overflow),
        "{:?}",
        state.compactions
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn on_a_small_window_a_stub_costs_at_most_two_thirds_of_the_eviction_threshold() {
    // A 2,048-token window: results over 384 tokens are stored. With the default
    // preview (5 and 5 lines of up to 1,000 characters) the stub of this result of
    // long lines cost 669 tokens, far over the threshold itself; now 213.
    let stubs = Arc::new(Mutex::new(Vec::<Message>::new()));
    let kept = stubs.clone();
    let model = PolicyModel::new("small", move |messages, _t| {
        let calls = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        kept.lock()
            .unwrap()
            .extend(messages.iter().filter(|m| m.role == Role::Tool).cloned());
        let reply = if calls == 0 {
            Message::assistant("look").with_tool_calls(vec![ToolCall::new("c0", "blob", json!({}))])
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "small"))
    });
    let blob = keel_message::tool_fn(
        ToolSpec::new("blob", "Returns a log.", json!({"type": "object"})),
        |_, _| async {
            Ok((0..100)
                .map(|i| {
                    format!(
                        "{i:>4} {}\n",
                        "request served with status 200 and no error; ".repeat(5)
                    )
                })
                .collect::<String>())
        },
    );
    let counter = keel_token::TiktokenCounter::o200k_base().unwrap();
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new("small", 2_048, 512, Encoding::O200kBase))
        .goal(GOAL)
        .tool(Arc::new(blob))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("small", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done."));
    let stubs = stubs.lock().unwrap();
    let stub = stubs.first().expect("the second call saw the result");
    assert!(stub.text().contains("stored in full at"), "{}", stub.text());
    let tokens = counter.count_text(&stub.text());
    assert!(
        tokens <= 1_536 / 4 * 2 / 3,
        "{tokens} tokens: {}",
        stub.text()
    );
}

/// An agent on an 8,192-token window (1,024 kept for the reply) with the echo tool
/// and an in-memory saver.
fn small_echo_agent(model: PolicyModel, encoding: Encoding) -> Agent {
    echo_agent(model, ModelProfile::new("small", 8_192, 1_024, encoding))
}

/// `model` with the echo tool and an in-memory saver, for `profile`.
fn echo_agent(model: PolicyModel, profile: ModelProfile) -> Agent {
    Agent::builder()
        .model(Arc::new(model))
        .profile(profile)
        .goal(GOAL)
        .tool(Arc::new(Echo))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_that_cannot_fit_is_never_sent() {
    // The model's own reply is far over the window. The newest step always stays (the
    // model must see what it asked for) and a reply is no tool result to store away,
    // so nothing can make the next prompt fit: the model must not receive it.
    let watch = PromptWatch::default();
    let seen = watch.clone();
    let model = PolicyModel::new("small", move |messages, _t| {
        let n = seen.call(messages);
        let reply = if n == 0 {
            Message::assistant("all work and no play ".repeat(20_000))
                .with_tool_calls(vec![ToolCall::new("c0", "echo", json!({"i": 0}))])
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "small"))
    });
    let agent = small_echo_agent(model, Encoding::O200kBase);
    let err = agent.run("big", AgentInput::new()).await.unwrap_err();
    assert!(
        matches!(err.model_error(), Some(ModelError::ContextOverflow { message }) if message.contains("not sent")),
        "{err:?}"
    );
    assert_eq!(watch.calls.load(Ordering::SeqCst), 1);
    assert!(keel_agent::refused_before_sending(
        err.model_error().unwrap()
    ));
    // The thread stays resumable from its last checkpoint.
    assert!(agent.state("big").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_too_large_for_a_thread_that_has_run_is_refused_before_it_is_stored() {
    // It would join the newest step, which compaction keeps whole: every later call
    // of the thread would be over the budget. Refused, and nothing stored.
    let model = PolicyModel::new("small", |_m, _t| {
        Ok(ChatResponse::new(Message::assistant("Done."), "small"))
    });
    let agent = small_echo_agent(model, Encoding::O200kBase);
    agent.run("t", AgentInput::new()).await.unwrap();
    let before = agent.state("t").await.unwrap().unwrap();
    let huge = AgentInput::new().user("all work and no play ".repeat(2_000));
    let err = agent.run("t", huge).await.unwrap_err();
    assert!(
        matches!(&err, AgentError::MessageTooLarge { thread_id, tokens, room, budget: 7_168 }
            if thread_id == "t" && *tokens > *room),
        "{err:?}"
    );
    assert!(err.to_string().contains("nothing was stored"), "{err}");
    assert_eq!(
        agent.state("t").await.unwrap().unwrap().messages,
        before.messages
    );
    // A message that fits goes through.
    let run = agent
        .run("t", AgentInput::new().user("One more thing."))
        .await
        .unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done."));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_that_gives_every_tool_call_the_same_id_still_compacts() {
    // Some servers number the calls of each reply, so `call_0` comes back every turn.
    // Each result answers its own turn's call, and a small window still compacts.
    let watch = PromptWatch::default();
    let seen = watch.clone();
    let model = PolicyModel::new("renumbering", move |messages, _t| {
        let n = seen.call(messages);
        let reply = if n < 150 {
            Message::assistant(format!("Next I will echo {n}."))
                .with_tool_calls(vec![ToolCall::new("call_0", "echo", json!({"i": n}))])
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "renumbering"))
    });
    let agent = small_echo_agent(model, Encoding::Approximate);
    let run = agent.run("renumbered", AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, None, "{:?}", run.stop);
    assert_eq!(run.state.step, 151);
    assert!(
        run.state.compactions.len() >= 4,
        "{:?}",
        run.state.compactions
    );
    assert_compactions_succeeded(&run.state);
    // The prompt stayed well inside the window (about 4 characters a token).
    assert!(watch.largest() < 4 * 8_192, "{}", watch.largest());
}

#[tokio::test(flavor = "multi_thread")]
async fn bytes_stored_per_step_stay_flat_over_1000_steps() {
    let saver = Arc::new(SqliteSaver::open_in_memory().await.unwrap());
    // One model and one offload store (the archive) drive the whole run; the ceiling
    // is raised 100 steps at a time.
    let model = Arc::new(counting_model(1_000, Arc::default()));
    let store = Arc::new(keel_offload::MemoryStore::new());
    let mut per_block = Vec::new();
    let mut last = saver.stats().await.unwrap().delta_bytes;
    for ceiling in (100..=1_000).step_by(100) {
        let agent = Agent::builder()
            .model(model.clone())
            .profile(profile())
            .system("You count.")
            .goal(GOAL)
            .tool(Arc::new(Echo))
            .compaction(
                CompactionConfig::default()
                    .with_every_steps(Some(10))
                    .with_max_steps(ceiling),
            )
            .keep_checkpoints(None)
            .checkpointer(saver.clone())
            .offload_store(store.clone())
            .build()
            .unwrap();
        let run = agent.run("flat", AgentInput::new()).await.unwrap();
        assert_eq!(run.state.step, ceiling);
        assert_compactions_succeeded(&run.state);
        let now = saver.stats().await.unwrap().delta_bytes;
        per_block.push((now - last) as f64 / 100.0);
        last = now;
    }
    let early = per_block[1];
    let late = per_block[9];
    assert!(
        late < early * 1.3,
        "bytes per step grew from {early:.0} (steps 100-200) to {late:.0} (steps 900-1000): {per_block:?}"
    );
    // And they are small: about the step's own messages, not the context.
    assert!(late < 4_000.0, "{late:.0} bytes per step");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_last_checkpoint_of_a_compaction_is_a_metadata_lookup() {
    let saver = Arc::new(MemorySaver::new());
    let agent = builder(counting_model(12, Arc::default()))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(50),
        )
        .keep_checkpoints(None)
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    agent.run("meta", AgentInput::new()).await.unwrap();
    let second = agent
        .last_checkpoint_by("meta", COMPACT, None)
        .await
        .unwrap()
        .unwrap();
    let first = agent
        .last_checkpoint_by("meta", COMPACT, Some(second.clone()))
        .await
        .unwrap()
        .unwrap();
    assert!(first < second);
    let snap = agent
        .graph()
        .get_state(&RunConfig::thread("meta").at(first))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(snap.values.milestones_made, 1);
    assert!(snap.metadata.writes.iter().any(|w| w == COMPACT));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_whose_arguments_are_not_json_is_not_put_to_approval() {
    let calls = AtomicUsize::new(0);
    let model = PolicyModel::new("bad-args", move |_m, _t| {
        let reply = if calls.fetch_add(1, Ordering::SeqCst) == 0 {
            Message::assistant("").with_tool_calls(vec![ToolCall::from_raw_arguments(
                "c1",
                "echo",
                "{\"text\": \"unterminated",
            )])
        } else {
            Message::assistant("done")
        };
        Ok(ChatResponse::new(reply, "bad-args"))
    });
    let agent = builder(model)
        .approve(["echo"])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("bad", AgentInput::new()).await.unwrap();
    assert!(run.interrupts.is_empty(), "{:?}", run.interrupts);
    assert_eq!(run.answer.as_deref(), Some("done"));
    let result = run
        .state
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .unwrap();
    assert!(result.text().contains("JSON"), "{}", result.text());
}

/// An agent counting to 3 that asks before each `echo`, over `saver`, with `thread`
/// run up to its first question.
async fn paused_for_approval(saver: &Arc<MemorySaver>, thread: &str) -> Agent {
    let agent = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let run = agent.run(thread, AgentInput::new()).await.unwrap();
    assert_eq!(run.interrupts.len(), 1, "paused for approval");
    agent
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_resumed_with_a_different_graph_is_a_typed_error() {
    let saver = Arc::new(MemorySaver::new());
    paused_for_approval(&saver, "shape").await;
    // Another graph over the same saver has no `tools` node.
    let other = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .checkpointer(saver.clone())
        .customize(|g| g)
        .node("tools", |_s: Arc<AgentState>, _ctx| async move {
            Ok(AgentStateUpdate::default())
        })
        .build()
        .unwrap();
    // The same shape resumes fine ...
    let resumed = other.run("shape", AgentInput::new().resume(true)).await;
    assert!(resumed.is_ok(), "{resumed:?}");
    // ... and a graph without the pending node names it.
    #[derive(Clone, Debug, keel_graph::State)]
    struct Bare {
        step: u64,
    }
    let bare = keel_graph::StateGraph::<Bare>::new()
        .add_node("only", |_s, _c| async move { Ok(BareUpdate::default()) })
        .add_edge(keel_graph::START, "only")
        .add_edge("only", keel_graph::END)
        .with_checkpointer(saver.clone())
        .compile()
        .unwrap();
    let agent2 = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .checkpointer(saver)
        .build()
        .unwrap();
    agent2.run("shape2", AgentInput::new()).await.unwrap();
    let err = bare
        .invoke(
            keel_graph::Command::resume(true),
            &RunConfig::thread("shape2"),
        )
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, GraphError::State(_)) || text.contains("tools") || text.contains("channel"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn approvals_are_checked_when_built_and_a_message_waits_for_the_answer() {
    // A misspelt name would let the tool run without asking.
    let err = builder(counting_model(3, Arc::default()))
        .approve(["ecko"])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, keel_agent::BuildError::UnknownApprovalTool { name, tools }
            if name == "ecko" && tools.contains("echo")),
        "{err}"
    );
    let err = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .build()
        .unwrap_err();
    assert!(
        matches!(err, keel_agent::BuildError::ApprovalNeedsCheckpointer),
        "{err}"
    );

    let agent = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("wait", AgentInput::new()).await.unwrap();
    assert_eq!(run.interrupts.len(), 1);
    // A message now would leave the pending tool call without a result.
    let err = agent
        .run("wait", AgentInput::new().message(Message::user("stop")))
        .await
        .unwrap_err();
    assert!(
        matches!(err, AgentError::AwaitingAnswer { count: 1, .. }),
        "{err}"
    );
    // An answer that is neither yes nor no is asked about again, not read as a no.
    let run = agent
        .run("wait", AgentInput::new().resume("maybe"))
        .await
        .unwrap();
    assert_eq!(run.interrupts.len(), 1);
    assert_eq!(run.interrupts[0].value["not_understood"], json!("maybe"));
    // Nothing else was stored: a yes now resumes the paused call.
    let run = agent
        .run("wait", AgentInput::new().resume(true))
        .await
        .unwrap();
    let echoed = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .count();
    assert_eq!(echoed, 1, "the approved call ran");
    assert!(
        !run.state.messages.iter().any(|m| m.text() == "stop"),
        "the refused message was not stored"
    );
}

/// Records the reply cap each call asked for; `window` is the window it says it runs
/// its model with, `name` the model it calls.
struct CapSeen {
    seen: Arc<Mutex<Vec<Option<u32>>>>,
    name: &'static str,
    window: Option<usize>,
}

#[async_trait::async_trait]
impl keel_model::ChatModel for CapSeen {
    fn model_name(&self) -> &str {
        self.name
    }
    fn context_window(&self) -> Option<usize> {
        self.window
    }
    async fn chat(
        &self,
        _messages: &[Message],
        _tools: &[ToolSpec],
        options: &keel_model::ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        self.seen.lock().unwrap().push(options.max_tokens);
        Ok(ChatResponse::new(Message::assistant("Done."), self.name))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_call_asks_for_no_more_than_the_room_kept_for_the_reply() {
    for (profile, given, asked) in [
        // The profile's reply reserve, when no cap is given.
        (
            ModelProfile::new("small", 2_048, 256, Encoding::Approximate),
            None,
            256,
        ),
        // At most a quarter of the window, whatever the profile reserves.
        (
            ModelProfile::new("odd", 4_000, 3_000, Encoding::Approximate),
            None,
            1_000,
        ),
        // A cap given is sent as it is.
        (
            ModelProfile::new("small", 8_192, 1_024, Encoding::Approximate),
            Some(512),
            512,
        ),
    ] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut options = keel_model::ChatOptions::new();
        options.max_tokens = given;
        let agent = Agent::builder()
            .model(Arc::new(CapSeen {
                seen: seen.clone(),
                name: "cap-seen",
                window: None,
            }))
            .profile(profile.clone())
            .options(options)
            .goal(GOAL)
            .build()
            .unwrap();
        agent.run("cap", AgentInput::new()).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), [Some(asked)], "{profile:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn approval_answers_name_every_call_and_a_denial_can_say_why() {
    let agent = builder(counting_model(3, Arc::default()))
        .approve(["echo"])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("why", AgentInput::new()).await.unwrap();
    assert_eq!(run.interrupts[0].value["approve"][0]["id"], json!("call-0"));
    // The pending question reads back without running anything.
    let pending = agent.interrupts("why").await.unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].value, run.interrupts[0].value);
    assert!(agent.interrupts("no-such-thread").await.unwrap().is_empty());
    // A resume carries only the answer: a message beside it would be lost.
    let err = agent
        .run("why", AgentInput::new().resume(true).user("and this"))
        .await
        .unwrap_err();
    assert!(matches!(err, AgentError::ResumeWithInput { .. }), "{err}");
    // A typo'd call id, or a map that leaves a call out, is asked again.
    for answer in [
        json!({"call-9": true}),
        json!({}),
        json!(["call-9"]),
        json!({"call-0": "maybe"}),
    ] {
        let run = agent
            .run("why", AgentInput::new().resume(answer.clone()))
            .await
            .unwrap();
        assert_eq!(run.interrupts.len(), 1, "{answer}");
        assert_eq!(run.interrupts[0].value["not_understood"], answer);
    }
    // A denial with a reason: the model reads it in the call's result.
    let run = agent
        .run(
            "why",
            AgentInput::new()
                .resume(json!({"call-0": {"approved": false, "reason": "use staging"}})),
        )
        .await
        .unwrap();
    let result = run
        .state
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .unwrap();
    assert!(
        result.text().contains("not approve")
            && result.text().ends_with("Their reason: use staging"),
        "{}",
        result.text()
    );
    // The next call is asked about; the whole-answer form with a reason denies it too.
    assert_eq!(run.interrupts[0].value["approve"][0]["id"], json!("call-1"));
    let run = agent
        .run(
            "why",
            AgentInput::new().resume(json!({"approved": false, "reason": "enough"})),
        )
        .await
        .unwrap();
    assert!(
        run.state
            .messages
            .iter()
            .any(|m| m.role == Role::Tool && m.text().ends_with("Their reason: enough")),
    );
    // With nothing pending, a resume says so in the agent's terms.
    let other = builder(counting_model(1, Arc::default()))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    other.run("done", AgentInput::new()).await.unwrap();
    let err = other
        .run("done", AgentInput::new().resume(true))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::NothingToResume { thread_id } if thread_id == "done"),
        "{err}"
    );
    assert!(err.to_string().contains("AgentInput::new()"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_threads_are_swept_with_their_offloaded_files() {
    let saver = Arc::new(SqliteSaver::open_in_memory().await.unwrap());
    let store = Arc::new(keel_offload::MemoryStore::new());
    let calls = AtomicU64::new(0);
    let model = PolicyModel::new("sweep", move |_m, _t| {
        let reply = match calls.fetch_add(1, Ordering::SeqCst) % 2 {
            0 => Message::assistant("big").with_tool_calls(vec![ToolCall::new(
                format!("big-{}", calls.load(Ordering::SeqCst)),
                "huge",
                json!({}),
            )]),
            _ => Message::assistant("done"),
        };
        Ok(ChatResponse::new(reply, "sweep"))
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Huge))
        .offload_store(store.clone())
        .checkpointer(saver)
        .build()
        .unwrap();
    agent.run("old", AgentInput::new()).await.unwrap();
    let thread = keel_offload::ThreadId::new("old").unwrap();
    use keel_offload::OffloadStore as _;
    assert!(
        !store.list(&thread, None).unwrap().is_empty(),
        "the 100 MB result was offloaded"
    );
    // Nothing is idle for an hour yet.
    assert!(
        agent
            .sweep_idle(Duration::from_secs(3600), 10)
            .await
            .unwrap()
            .is_empty()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let swept = agent
        .sweep_idle(Duration::from_millis(10), 10)
        .await
        .unwrap();
    assert_eq!(swept, ["old"]);
    assert!(agent.state("old").await.unwrap().is_none());
    assert!(
        store.list(&thread, None).unwrap().is_empty(),
        "its offloaded files went too"
    );
}

/// A model whose server counts half what keel's estimate says (as a llama.cpp server
/// did, at 1.3x to 2.3x): calibrated, keel learns it and compacts later, and every
/// prompt still fits the window by the server's count.
#[tokio::test(flavor = "multi_thread")]
async fn estimated_counts_learn_the_servers_and_compact_later() {
    async fn run(calibrate: bool) -> (AgentState, Option<f64>, u64) {
        let calls = AtomicU64::new(0);
        let most = Arc::new(AtomicU64::new(0));
        let seen = most.clone();
        let model = PolicyModel::new("my-local-model", move |messages, tools| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let served = keel_token::ApproxCounter::new().count_prompt(messages, tools) as u64 / 2;
            seen.fetch_max(served, Ordering::SeqCst);
            let reply = if n < 80 {
                Message::assistant(format!("Next I will echo {n}.")).with_tool_calls(vec![
                    ToolCall::new(format!("call-{n}"), "echo", json!({"i": n})),
                ])
            } else {
                Message::assistant("The last number was 79.")
            };
            Ok(ChatResponse::new(reply, "my-local-model")
                .with_usage(keel_model::Usage::new(served, 10)))
        });
        let agent = builder(model)
            .profile(ModelProfile::new(
                "my-local-model",
                3_000,
                500,
                Encoding::Approximate,
            ))
            .compaction(CompactionConfig::default().with_every_steps(None))
            .calibrate(calibrate)
            .build()
            .unwrap();
        let run = agent.run("t", AgentInput::new()).await.unwrap();
        assert_eq!(run.answer.as_deref(), Some("The last number was 79."));
        (run.state, agent.count_factor(), most.load(Ordering::SeqCst))
    }
    let (plain, none, plain_most) = run(false).await;
    let (calibrated, factor, most) = run(true).await;
    assert_eq!(none, None);
    // The server's count over keel's (a half) with a tenth kept in hand: 0.55.
    let factor = factor.unwrap();
    assert!((0.53..0.57).contains(&factor), "{factor}");
    assert_compactions_succeeded(&plain);
    assert_compactions_succeeded(&calibrated);
    assert!(
        calibrated.milestones_made < plain.milestones_made,
        "{} milestones calibrated against {}",
        calibrated.milestones_made,
        plain.milestones_made
    );
    // The prompts were bigger, and still within the window's budget as the server
    // counts them.
    assert!(most > plain_most, "{most} against {plain_most}");
    assert!(most <= 2_500, "{most}");
}

#[tokio::test(flavor = "multi_thread")]
async fn model_call_events_carry_the_providers_cached_tokens() {
    let model = PolicyModel::new("cached", |_m, _t| {
        let mut r = ChatResponse::new(Message::assistant("ok"), "cached");
        r.usage = Some(keel_model::Usage::new(900, 12).with_cached_tokens(640));
        Ok(r)
    });
    let agent = builder(model).build().unwrap();
    let run = agent.run("c", AgentInput::new()).await.unwrap();
    let call = run
        .state
        .events
        .iter()
        .find(|e| matches!(e, AgentEvent::ModelCall { .. }))
        .unwrap();
    let AgentEvent::ModelCall {
        cached_tokens,
        provider_prompt_tokens,
        completion_tokens,
        ..
    } = call
    else {
        unreachable!()
    };
    assert_eq!(*cached_tokens, Some(640));
    assert_eq!(*provider_prompt_tokens, Some(900));
    assert_eq!(*completion_tokens, Some(12));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_answer_stopped_at_the_token_limit_says_so() {
    for (finish, cut) in [
        (Some(keel_model::FinishReason::Length), true),
        (Some(keel_model::FinishReason::Stop), false),
        (None, false),
    ] {
        let reason = finish.clone();
        let model = PolicyModel::new("limited", move |_m, _t| {
            let mut r = ChatResponse::new(Message::assistant("The answer is that the"), "m");
            r.finish_reason = reason.clone();
            Ok(r)
        });
        let agent = builder(model).build().unwrap();
        let run = agent.run("c", AgentInput::new()).await.unwrap();
        let cut_off = run.state.events.iter().find_map(|e| match e {
            AgentEvent::ModelCall { cut_off, .. } => Some(*cut_off),
            _ => None,
        });
        assert_eq!(cut_off, Some(cut), "{finish:?}");
    }
}

/// A tool answering indented JSON.
struct Pretty;

impl Tool for Pretty {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("lookup", "Looks a booking up.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            Ok(serde_json::to_string_pretty(
                &json!({"reservation_id": "OBUT9V", "flights": ["HAT078", "HAT118"]}),
            )
            .unwrap())
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn json_tool_results_reach_the_model_minified_unless_turned_off() {
    for on in [true, false] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let calls = AtomicU64::new(0);
        let model = PolicyModel::new("lookup", move |messages, _t| {
            if let Some(m) = messages.iter().find(|m| m.role == Role::Tool) {
                log.lock().unwrap().push(m.text().into_owned());
            }
            let reply = match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Message::assistant("").with_tool_calls(vec![ToolCall::new(
                    "c1",
                    "lookup",
                    json!({}),
                )]),
                _ => Message::assistant("Booked."),
            };
            Ok(ChatResponse::new(reply, "lookup"))
        });
        let agent = Agent::builder()
            .model(Arc::new(model))
            .profile(profile())
            .goal(GOAL)
            .tool(Arc::new(Pretty))
            .compaction(CompactionConfig::default().with_minify_json(on))
            .build()
            .unwrap();
        let run = agent.run("json", AgentInput::new()).await.unwrap();
        assert_eq!(run.answer.as_deref(), Some("Booked."));
        let seen = seen.lock().unwrap().clone();
        let want = if on {
            r#"{"reservation_id":"OBUT9V","flights":["HAT078","HAT118"]}"#.to_owned()
        } else {
            serde_json::to_string_pretty(
                &json!({"reservation_id": "OBUT9V", "flights": ["HAT078", "HAT118"]}),
            )
            .unwrap()
        };
        assert_eq!(seen, [want], "minify_json = {on}");
    }
}

/// A tool answering about 200 KB of indented JSON: past the inline limit, so it is
/// minified on the blocking pool.
struct BigPretty;

impl Tool for BigPretty {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("list", "Lists every booking.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let rows: Vec<Value> = (0..2_000)
                .map(|i| json!({"id": format!("R{i:05}"), "seats": [i, i + 1]}))
                .collect();
            Ok(serde_json::to_string_pretty(&rows).unwrap())
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_json_result_kept_in_full_is_minified_off_the_runtime() {
    let calls = AtomicU64::new(0);
    let model = PolicyModel::new("list", move |_m, _t| {
        let reply = match calls.fetch_add(1, Ordering::SeqCst) {
            0 => {
                Message::assistant("").with_tool_calls(vec![ToolCall::new("c1", "list", json!({}))])
            }
            _ => Message::assistant("Listed."),
        };
        Ok(ChatResponse::new(reply, "list"))
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new(
            "roomy",
            1_000_000,
            10_000,
            Encoding::Approximate,
        ))
        .goal(GOAL)
        .tool(Arc::new(BigPretty))
        .evict(None)
        .build()
        .unwrap();
    let run = agent.run("big-json", AgentInput::new()).await.unwrap();
    let result = run
        .state
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .unwrap();
    let text = result.text();
    let original = BigPretty
        .call(json!({}), ToolContext::new("c1"))
        .await
        .unwrap();
    assert!(original.len() > 128 * 1024, "{}", original.len());
    assert!(
        !text.contains('\n') && text.len() < original.len() * 3 / 4,
        "{}",
        text.len()
    );
    let a: Value = serde_json::from_str(&text).unwrap();
    let b: Value = serde_json::from_str(&original).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        result.metadata["keel_offload"]["minified_json"]["bytes"],
        original.len()
    );
}

/// A tool that answers after a pause.
#[tokio::test(flavor = "multi_thread")]
async fn dropping_a_run_stops_it_although_it_runs_on_a_task_of_its_own() {
    let calls = Arc::new(AtomicU64::new(0));
    let counted = calls.clone();
    let model = PolicyModel::new("slow", move |_m, _t| {
        let reply = match counted.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("Waiting.").with_tool_calls(vec![ToolCall::new(
                "s",
                "slow",
                json!({}),
            )]),
            _ => Message::assistant("The slow tool answered."),
        };
        Ok(ChatResponse::new(reply, "slow"))
    });
    let saver = Arc::new(MemorySaver::new());
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tools([Arc::new(SlowCounted(Arc::default())) as Arc<dyn Tool>])
        .checkpointer(saver)
        .build()
        .unwrap();
    // The caller gives up while the tool runs: the run's task must stop with it, not
    // go on to ask the model again once the tool answers.
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        agent.run("dropped", AgentInput::new()),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the run should still be waiting on the tool"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the dropped run called the model again"
    );
    // The thread stays resumable from its last checkpoint.
    let run = agent.run("dropped", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("The slow tool answered."));
}

/// Counts the calls that ran to their end.
struct SlowCounted(Arc<AtomicU64>);
impl Tool for SlowCounted {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("slow", "Answers after a while.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok("finally".to_owned())
        })
    }
}

/// A model that asks for `calls` until a tool result is in its prompt, then answers.
fn calls_then_answer(
    name: &'static str,
    calls: Vec<ToolCall>,
    answer: &'static str,
) -> PolicyModel {
    PolicyModel::new(name, move |messages, _t| {
        let reply = if messages.iter().any(|m| m.role == Role::Tool) {
            Message::assistant(answer)
        } else {
            Message::assistant("Working.").with_tool_calls(calls.clone())
        };
        Ok(ChatResponse::new(reply, name))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn dropping_an_agent_stream_stops_its_run_mid_step() {
    let model = calls_then_answer(
        "slow",
        vec![ToolCall::new("s", "slow", json!({}))],
        "The slow tool answered.",
    );
    let finished = Arc::new(AtomicU64::new(0));
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tools([Arc::new(SlowCounted(finished.clone())) as Arc<dyn Tool>])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    {
        let mut updates = agent.stream("dropped", AgentInput::new());
        // The model's call arrives; the slow tool is then running.
        let first = updates.next().await.unwrap().unwrap();
        assert!(
            matches!(first, AgentUpdate::Event(AgentEvent::ModelCall { .. })),
            "{first:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the dropped stream's tool call ran on"
    );
    let state = agent.state("dropped").await.unwrap().unwrap();
    assert!(
        !state.messages.iter().any(|m| m.role == Role::Tool),
        "the dropped step stored its result"
    );
    // The thread continues from its last checkpoint, with no conflict.
    let run = agent.run("dropped", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("The slow tool answered."));
    assert_eq!(finished.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_resumed_without_its_archive_says_the_store_lost_it() {
    // The checkpoints survive a restart; an in-memory offload store does not.
    let saver = Arc::new(MemorySaver::new());
    let store = Arc::new(keel_offload::MemoryStore::new());
    let config = || {
        CompactionConfig::default()
            .with_every_steps(Some(4))
            .with_keep_recent_tokens(20)
    };
    let seen = Arc::new(Mutex::new(Vec::new()));
    // An agent over the shared checkpoints, with `store` or the default one.
    let agent = |store: Option<Arc<keel_offload::MemoryStore>>| {
        let b = builder(counting_model(30, seen.clone()))
            .compaction(config())
            .checkpointer(saver.clone());
        match store {
            Some(s) => b.offload_store(s),
            None => b,
        }
        .build()
        .unwrap()
    };
    let first = agent(Some(store.clone()));
    let run = first
        .run("restarted", AgentInput::new().max_steps(10))
        .await
        .unwrap();
    assert!(
        run.state.milestones_made >= 1,
        "{:?}",
        run.state.compactions
    );
    let head = first.state("restarted").await.unwrap().unwrap();
    let key = ThreadKey::new("restarted");
    let head_id = saver.get(&key, None).await.unwrap().unwrap().checkpoint.id;
    drop(first);

    // "Restarted" with the default store, which holds nothing: the run does not start.
    let second = agent(None);
    let err = second
        .run("restarted", AgentInput::new().max_steps(10))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, AgentError::ArchiveUnavailable { thread_id, .. } if thread_id == "restarted"),
        "{err:?}"
    );
    assert!(
        text.contains("keeps nothing past its process") && text.contains("the same durable store"),
        "{text}"
    );
    let after = saver.get(&key, None).await.unwrap().unwrap().checkpoint.id;
    assert_eq!(after, head_id, "nothing was written");

    // With the store the thread wrote to, it continues and compacts.
    let third = agent(Some(store));
    let run = third
        .run("restarted", AgentInput::new().max_steps(10))
        .await
        .unwrap();
    assert!(run.state.milestones_made > head.milestones_made);
    assert_compactions_succeeded(&run.state);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_graph_of_your_own_whose_input_writes_no_goal_fails_at_compact_saying_so() {
    // The builder's goal is for `Agent` runs; a graph of your own writes the goal in
    // its input. Forgetting it must not leave the raw buffer growing in silence.
    let nodes = Agent::builder()
        .goal(GOAL)
        .compaction(CompactionConfig::default().with_every_steps(Some(3)))
        .build_nodes()
        .unwrap();
    let router = nodes.clone();
    let graph = keel_graph::StateGraph::<AgentState>::new()
        .add_node("work", |state: Arc<AgentState>, _ctx| async move {
            let id = format!("c{}", state.step);
            Ok(AgentStateUpdate::default()
                .messages(keel_reducer::AddMessagesUpdate::append([
                    Message::assistant("Reading.").with_tool_calls(vec![ToolCall::new(
                        id.clone(),
                        "read",
                        json!({}),
                    )]),
                    Message::tool(id, "a line"),
                ]))
                .step(state.step + 1))
        })
        .add_node(COMPACT, nodes.compact())
        .add_edge(keel_graph::START, "work")
        .add_conditional_edges(
            "work",
            move |s: &AgentState| match router.trigger(s) {
                Some(_) => COMPACT,
                None if s.step >= 10 => keel_graph::END,
                None => "work",
            },
            Some(&["work", COMPACT, keel_graph::END]),
        )
        .add_edge(COMPACT, "work")
        .compile()
        .unwrap();
    let err = graph
        .invoke(AgentStateUpdate::default(), &RunConfig::thread("no-goal"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(COMPACT) && err.contains("has no goal"),
        "{err}"
    );
    // With the goal in the input, the same graph compacts.
    let run = graph
        .invoke(
            AgentStateUpdate::default().goal(GOAL.into()),
            &RunConfig::thread("goal"),
        )
        .await
        .unwrap();
    assert!(run.state.milestones_made > 0, "{:?}", run.state.compactions);
}

#[tokio::test]
async fn a_durable_checkpointer_without_an_offload_store_is_refused_at_build() {
    let dir = tempfile::tempdir().unwrap();
    let file = Arc::new(
        SqliteSaver::open(dir.path().join("a.sqlite"))
            .await
            .unwrap(),
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let model = || counting_model(3, seen.clone());

    let err = builder(model())
        .checkpointer(file.clone())
        .build()
        .unwrap_err();
    assert!(
        matches!(err, keel_agent::BuildError::EphemeralOffloadStore),
        "{err:?}"
    );
    assert!(err.to_string().contains(".offload_store(..)"), "{err}");
    // The same for the nodes of a custom graph.
    assert!(matches!(
        builder(model()).checkpointer(file.clone()).build_nodes(),
        Err(keel_agent::BuildError::EphemeralOffloadStore)
    ));

    // A durable store, or the in-memory one chosen explicitly, is accepted; so is the
    // default store with checkpointers that do not outlive the process either.
    let store = Arc::new(keel_offload::SqliteStore::open(dir.path().join("a.sqlite")).unwrap());
    assert!(
        builder(model())
            .checkpointer(file.clone())
            .offload_store(store)
            .build()
            .is_ok()
    );
    let memory_store = Arc::new(keel_offload::MemoryStore::new());
    assert!(
        builder(model())
            .checkpointer(file)
            .offload_store(memory_store)
            .build()
            .is_ok()
    );
    assert!(
        builder(model())
            .checkpointer(Arc::new(MemorySaver::new()))
            .build()
            .is_ok()
    );
    let in_memory = Arc::new(SqliteSaver::open_in_memory().await.unwrap());
    assert!(!in_memory.is_durable());
    assert!(builder(model()).checkpointer(in_memory).build().is_ok());
    assert!(builder(model()).build().is_ok());
}

/// The extractive summarizer, failing like a server that is down while `down` is set.
struct Flaky {
    down: std::sync::atomic::AtomicBool,
    inner: keel_summarize::ExtractiveSummarizer,
}

#[async_trait::async_trait]
impl keel_summarize::Summarizer for Flaky {
    async fn summarize(
        &self,
        request: &keel_summarize::SummaryRequest<'_>,
    ) -> Result<keel_summarize::Summary, keel_summarize::SummarizeError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(ModelError::Connection("connection refused".to_owned()).into());
        }
        self.inner.summarize(request).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn compactions_failing_in_a_row_stop_the_run_resumably_with_nothing_lost() {
    // No fallback unless the context would overflow (`None`), or a fallback threshold
    // the stop comes first to (as `compaction`'s docs say): the failures show.
    for fallback in [None, Some(keel_agent::MAX_FAILED_COMPACTIONS)] {
        failing_compactions_stop_the_run(fallback).await;
    }
}

async fn failing_compactions_stop_the_run(fallback: Option<u32>) {
    let thread = format!("flaky-{fallback:?}");
    let summarizer = Arc::new(Flaky {
        down: std::sync::atomic::AtomicBool::new(true),
        inner: keel_summarize::ExtractiveSummarizer::new(),
    });
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(counting_model(40, seen))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(4))
                .with_keep_recent_tokens(20)
                .with_fallback_after_failures(fallback),
        )
        .summarizer(summarizer.clone())
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run(&thread, AgentInput::new()).await.unwrap();
    let Some(Stop::CompactionFailing { failures, error }) = &run.stop else {
        panic!("{:?}", run.stop);
    };
    assert_eq!(*failures, keel_agent::MAX_FAILED_COMPACTIONS);
    assert!(error.contains("connection refused"), "{error}");
    assert!(
        run.stop
            .as_ref()
            .unwrap()
            .to_string()
            .contains("3 compactions failed in a row"),
        "{:?}",
        run.stop
    );
    // Nothing left the context: every tool result so far is still in the raw buffer.
    assert_eq!(run.state.milestones_made, 0);
    let results = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .count();
    assert_eq!(u64::try_from(results).unwrap(), run.state.step);

    // The summarizer is back: the thread continues, compacts and finishes.
    summarizer.down.store(false, Ordering::SeqCst);
    let run = agent.run(&thread, AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, None);
    assert_eq!(run.answer.as_deref(), Some("The last number was 39."));
    assert!(
        run.state.milestones_made >= 2,
        "{}",
        run.state.milestones_made
    );
}

#[tokio::test]
async fn a_summarizer_that_keeps_failing_costs_one_missed_compaction() {
    // The summarizer's server is down for the whole run: with the default
    // `fallback_after_failures` (1), the first compaction fails and every later one is
    // written by the extractive fallback, so the run is not stopped and the context
    // keeps shrinking.
    let summarizer = Arc::new(Flaky {
        down: std::sync::atomic::AtomicBool::new(true),
        inner: keel_summarize::ExtractiveSummarizer::new(),
    });
    let agent = builder(counting_model(40, Arc::new(Mutex::new(Vec::new()))))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(4))
                .with_keep_recent_tokens(20),
        )
        .summarizer(summarizer)
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("flaky", AgentInput::new()).await.unwrap();
    assert_eq!(run.stop, None);
    assert_eq!(run.answer.as_deref(), Some("The last number was 39."));
    let events: Vec<_> = run.state.compactions.iter().collect();
    assert!(
        run.state.milestones_made >= 5,
        "{}",
        run.state.milestones_made
    );
    assert!(
        events.iter().all(|e| e.error.is_some() || e.fallback),
        "{events:?}"
    );
    let failed = events.iter().filter(|e| e.error.is_some()).count();
    assert!(failed <= 1, "{events:?}");
    assert!(
        events
            .last()
            .is_some_and(|e| e.fallback && e.error.is_none())
    );
}

/// A summarizer that writes nothing until the saver pruned (or 5 s passed, then fails).
struct AfterPrune {
    saver: Arc<ObservedPrunes>,
    inner: keel_summarize::ExtractiveSummarizer,
}

#[async_trait::async_trait]
impl keel_summarize::Summarizer for AfterPrune {
    async fn summarize(
        &self,
        request: &keel_summarize::SummaryRequest<'_>,
    ) -> Result<keel_summarize::Summary, keel_summarize::SummarizeError> {
        if tokio::time::timeout(Duration::from_secs(5), self.saver.pruned.notified())
            .await
            .is_err()
        {
            return Err(ModelError::Connection("no prune while summarizing".to_owned()).into());
        }
        self.inner.summarize(request).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compaction_step_prunes_while_its_summary_is_written() {
    let saver = Arc::new(ObservedPrunes::new(false));
    let agent = builder(counting_model(12, Arc::default()))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(50),
        )
        .summarizer(Arc::new(AfterPrune {
            saver: saver.clone(),
            inner: keel_summarize::ExtractiveSummarizer::new(),
        }))
        .keep_checkpoints(Some(3))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let run = agent.run("overlap", AgentInput::new()).await.unwrap();
    // Each summary waited for its step's prune, so the prune did not wait for it.
    assert_eq!(run.state.milestones_made, 2);
    assert_compactions_succeeded(&run.state);
    assert_eq!(saver.prunes.load(Ordering::SeqCst), 2);
    // And the prune kept the newest 3 stored before that step, plus the steps since.
    let n = checkpoints(saver.as_ref(), "overlap").await;
    assert!(n <= 3 + 2 * 6, "{n} checkpoints");
}

/// An epoch step runs right after the milestone step that pruned: it prunes nothing
/// more (that prune would remove one checkpoint), and the next milestone step prunes.
#[tokio::test(flavor = "multi_thread")]
async fn an_epoch_step_right_after_a_pruning_milestone_step_does_not_prune_again() {
    let saver = Arc::new(ObservedPrunes::new(false));
    let agent = builder(counting_model(24, Arc::default()))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(4))
                .with_epoch_every(2)
                .with_keep_recent_tokens(50),
        )
        .keep_checkpoints(Some(3))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let run = agent.run("epochs", AgentInput::new()).await.unwrap();
    assert!(run.state.epochs_made >= 2, "{}", run.state.epochs_made);
    assert_compactions_succeeded(&run.state);
    // One prune per milestone step, none for the epoch steps.
    assert_eq!(
        saver.prunes.load(Ordering::SeqCst),
        run.state.milestones_made
    );
    // The newest 3 stored before the last milestone step, plus the steps since.
    let n = checkpoints(saver.as_ref(), "epochs").await;
    assert!(n <= 3 + 2 * 5 + 1, "{n} checkpoints");
}

/// A MemorySaver that counts its prunes and tells a waiting summarizer of each. Gated,
/// it poses as a durable saver whose prunes wait for a gate (at most 10 s, then fail,
/// counted) and then take a while.
struct ObservedPrunes {
    inner: MemorySaver,
    gated: bool,
    gate: tokio::sync::Semaphore,
    pruned: tokio::sync::Notify,
    gate_timeouts: AtomicU64,
    prunes: AtomicU64,
}

impl ObservedPrunes {
    fn new(gated: bool) -> Self {
        ObservedPrunes {
            inner: MemorySaver::new(),
            gated,
            gate: tokio::sync::Semaphore::new(0),
            pruned: tokio::sync::Notify::new(),
            gate_timeouts: AtomicU64::new(0),
            prunes: AtomicU64::new(0),
        }
    }
}

#[async_trait::async_trait]
impl Checkpointer for ObservedPrunes {
    /// Gated, it stands for a durable saver (whose prunes wait on I/O).
    fn is_durable(&self) -> bool {
        self.gated
    }

    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&keel_checkpoint::CheckpointId>,
    ) -> Result<Option<keel_checkpoint::CheckpointTuple>, keel_checkpoint::CheckpointError> {
        self.inner.get(thread, id).await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> futures::stream::BoxStream<
        'a,
        Result<keel_checkpoint::CheckpointSummary, keel_checkpoint::CheckpointError>,
    > {
        self.inner.list(thread, options)
    }

    async fn put(
        &self,
        request: keel_checkpoint::PutRequest,
    ) -> Result<(), keel_checkpoint::CheckpointError> {
        self.inner.put(request).await
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &keel_checkpoint::CheckpointId,
        writes: Vec<keel_checkpoint::PendingWrite>,
    ) -> Result<(), keel_checkpoint::CheckpointError> {
        self.inner.put_writes(thread, checkpoint, writes).await
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), keel_checkpoint::CheckpointError> {
        self.inner.delete_thread(thread_id).await
    }

    async fn prune(
        &self,
        thread: &ThreadKey,
        keep_last: usize,
    ) -> Result<usize, keel_checkpoint::CheckpointError> {
        if self.gated {
            let opened = tokio::time::timeout(Duration::from_secs(10), self.gate.acquire()).await;
            if opened.is_err() {
                self.gate_timeouts.fetch_add(1, Ordering::SeqCst);
                return Err(keel_checkpoint::CheckpointError::Backend(
                    "the gate stayed shut".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let n = self.inner.prune(thread, keep_last).await;
        self.prunes.fetch_add(1, Ordering::SeqCst);
        self.pruned.notify_one();
        n
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn with_async_durability_a_compaction_step_prunes_in_the_background_and_the_run_waits_for_it()
{
    let saver = Arc::new(ObservedPrunes::new(true));
    let gate = saver.clone();
    let calls = AtomicU64::new(0);
    // Counts to 11 with the echo tool. The gate opens at the 9th model call, three
    // steps after the first compaction (step 5): only a run that went on while that
    // prune waited gets there, however late the prune's task starts.
    let model = PolicyModel::new("gated", move |_messages, _tools| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        if n == 8 {
            gate.gate.add_permits(100);
        }
        let reply = if n < 12 {
            Message::assistant(format!("Next I will echo {n}.")).with_tool_calls(vec![
                ToolCall::new(format!("call-{n}"), "echo", json!({"i": n})),
            ])
        } else {
            Message::assistant("The last number was 11.")
        };
        Ok(ChatResponse::new(reply, "gated"))
    });
    let agent = builder(model)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(50),
        )
        .keep_checkpoints(Some(3))
        .checkpointer(saver.clone())
        .offload_store(Arc::new(keel_offload::MemoryStore::new()))
        .durability(keel_graph::Durability::Async)
        .build()
        .unwrap();
    let run = agent.run("overlap", AgentInput::new()).await.unwrap();
    assert_eq!(run.state.milestones_made, 2);
    assert_compactions_succeeded(&run.state);
    // The first prune waited for the 9th model call: a step that waited for its
    // prune would have made it time out.
    assert_eq!(
        saver.gate_timeouts.load(Ordering::SeqCst),
        0,
        "the steps after a compaction waited for its prune"
    );
    // Both prunes finished before the run returned (each takes 200 ms after the gate).
    assert_eq!(saver.prunes.load(Ordering::SeqCst), 2);
    // The last kept the newest 3 stored when it ran, plus the steps since.
    let n = checkpoints(saver.as_ref(), "overlap").await;
    assert!(n <= 3 + 2 * 6, "{n} checkpoints");
}

#[tokio::test(flavor = "multi_thread")]
async fn keeping_no_checkpoint_is_refused_rather_than_deleting_the_thread() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let refused = builder(counting_model(3, seen.clone()))
        .keep_checkpoints(Some(0))
        .build();
    assert!(
        matches!(refused, Err(BuildError::KeepNoCheckpoints)),
        "{:?}",
        refused.err()
    );
    let saver = Arc::new(MemorySaver::new());
    let agent = builder(counting_model(3, seen))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    agent.run("kept", AgentInput::new()).await.unwrap();
    let before = checkpoints(saver.as_ref(), "kept").await;
    let err = agent.prune("kept", 0).await.unwrap_err();
    assert!(
        matches!(&err, AgentError::PruneToNothing { thread_id } if thread_id == "kept"),
        "{err:?}"
    );
    assert!(err.to_string().contains("delete_thread"), "{err}");
    assert_eq!(checkpoints(saver.as_ref(), "kept").await, before);
    assert_eq!(agent.prune("kept", 1).await.unwrap(), before - 1);
    assert_eq!(agent.state("kept").await.unwrap().unwrap().step, 4);
}

#[test]
fn a_misspelt_node_to_replace_is_named_with_the_agent_s_nodes() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let built = builder(counting_model(1, seen))
        .node("tool", |_s, _ctx| async { Ok(AgentStateUpdate::default()) })
        .build();
    let err = built.err().unwrap();
    assert!(
        matches!(&err, BuildError::UnconnectedNode { name } if name == "tool"),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("are agent, tools, compact and epoch"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn with_eviction_off_a_result_no_prompt_could_hold_is_offloaded_all_the_same() {
    let calls = AtomicU64::new(0);
    let model = PolicyModel::new("big", move |_m, _t| {
        let reply = match calls.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("big").with_tool_calls(vec![ToolCall::new(
                "big-1",
                "huge",
                json!({}),
            )]),
            _ => Message::assistant("done"),
        };
        Ok(ChatResponse::new(reply, "big"))
    });
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Huge))
        .evict(None)
        .build()
        .unwrap();
    let run = agent.run("off", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("done"));
    assert!(
        run.state
            .events
            .iter()
            .any(|e| matches!(e, AgentEvent::Offload { .. })),
        "{:?}",
        run.state.events
    );
}

#[test]
fn a_reply_cap_over_a_quarter_of_the_window_is_refused_at_build() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let refused = builder(counting_model(1, seen.clone()))
        .options(keel_model::ChatOptions::new().max_tokens(8_001))
        .build();
    assert!(
        matches!(
            &refused,
            Err(BuildError::ReplyCapTooLarge {
                max_tokens: 8_001,
                window: 32_000,
                ..
            })
        ),
        "{:?}",
        refused.err()
    );
    // A quarter of the window is kept free for it; the profile's 2,000 grows to it.
    let agent = builder(counting_model(1, seen))
        .options(keel_model::ChatOptions::new().max_tokens(8_000))
        .build()
        .unwrap();
    assert_eq!(agent.nodes().profile().reserved_output(), 8_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_s_own_window_narrows_the_builtin_profile() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = Agent::builder()
        // A client that runs llama3.1 with a 4,096-token window.
        .model(Arc::new(CapSeen {
            seen: seen.clone(),
            name: "llama3.1:8b",
            window: Some(4_096),
        }))
        .goal(GOAL)
        .build()
        .unwrap();
    // The builtin llama3.1 profile has a 131,072-token window; the server runs 4,096.
    assert_eq!(agent.nodes().profile().context_window, 4_096);
    assert!(agent.nodes().profile().input_budget() < 4_096);
    agent.run("small", AgentInput::new()).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [Some(1_024)],
        "a quarter of the window"
    );
}

/// A tool with any spec, for the build's checks.
struct Named(ToolSpec);
impl Tool for Named {
    fn spec(&self) -> ToolSpec {
        self.0.clone()
    }
    fn call(&self, _a: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async { Ok(String::new()) })
    }
}

#[test]
fn settings_and_tool_specs_every_call_would_trip_on_are_refused_at_build() {
    for (config, field) in [
        (
            CompactionConfig::default().with_every_steps(Some(0)),
            "every_steps",
        ),
        (
            CompactionConfig::default().with_window_fraction(0.0),
            "window_fraction",
        ),
        (
            CompactionConfig::default().with_window_fraction(f64::NAN),
            "window_fraction",
        ),
        (
            CompactionConfig::default().with_summary_share(5.0),
            "summary_share",
        ),
        (
            CompactionConfig::default().with_epoch_every(0),
            "epoch_every",
        ),
        (CompactionConfig::default().with_max_steps(0), "max_steps"),
    ] {
        let err = builder(counting_model(1, Arc::default()))
            .compaction(config)
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, BuildError::Compaction(keel_compaction::CompactionError::BadConfig { field: f, .. }) if *f == field),
            "{field}: {err}"
        );
    }
    for (name, parameters) in [
        ("", json!({"type": "object"})),
        ("my tool", json!({"type": "object"})),
        ("ok_name", json!("nope")),
    ] {
        let err = builder(counting_model(1, Arc::default()))
            .tools([Arc::new(Named(ToolSpec::new(name, "x", parameters))) as Arc<dyn Tool>])
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, BuildError::BadToolSpec { name: n, .. } if n == name),
            "{name:?}: {err}"
        );
    }
}

/// Records the call id each call ran with.
struct Ids(Arc<Mutex<Vec<String>>>);
impl Tool for Ids {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("note", "Notes.", json!({"type": "object"}))
    }
    fn call(&self, _a: Value, ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            self.0.lock().unwrap().push(ctx.call_id().to_owned());
            Ok("noted".to_owned())
        })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_of_one_reply_sharing_an_id_or_without_one_get_ids_of_their_own() {
    let model = calls_then_answer(
        "ids",
        vec![
            ToolCall::new("x", "note", json!({})),
            ToolCall::new("x", "note", json!({})),
            ToolCall::new("", "note", json!({})),
            ToolCall::new("", "note", json!({})),
        ],
        "Done.",
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let agent = Agent::builder()
        .model(Arc::new(model))
        .profile(profile())
        .goal(GOAL)
        .tool(Arc::new(Ids(seen.clone())))
        .build()
        .unwrap();
    let run = agent.run("ids", AgentInput::new()).await.unwrap();
    let mut ids = seen.lock().unwrap().clone();
    ids.sort();
    assert_eq!(ids, ["call-1-2", "call-1-3", "x", "x-1"]);
    // Each result answers its own call.
    let calls: Vec<&str> = run
        .state
        .messages
        .iter()
        .flat_map(|m| m.tool_calls.iter().map(|c| c.id.as_str()))
        .collect();
    let results: Vec<&str> = run
        .state
        .messages
        .iter()
        .filter_map(|m| m.tool_call_id.as_deref())
        .collect();
    assert_eq!(calls, ["x", "x-1", "call-1-2", "call-1-3"]);
    assert_eq!(results, calls);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approval_of_a_call_edited_after_it_was_asked_is_refused_and_asked_again() {
    let agent = builder(counting_model(2, Arc::default()))
        .approve(["echo"])
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    let run = agent.run("edit", AgentInput::new()).await.unwrap();
    assert_eq!(
        run.interrupts[0].value["approve"][0]["arguments"],
        json!(r#"{"i":0}"#)
    );
    // The stored reply's call is edited under the pending question.
    let mut reply = run.state.messages.last().unwrap().clone();
    reply.tool_calls[0] = ToolCall::new("call-0", "echo", json!({"i": 41}));
    agent
        .graph()
        .update_state(
            &RunConfig::thread("edit"),
            AgentStateUpdate::default()
                .messages(keel_graph::reducer::AddMessagesUpdate::append([reply])),
            None,
        )
        .await
        .unwrap();
    // A yes to the question shown would run a call nobody saw.
    let err = agent
        .run("edit", AgentInput::new().resume(true))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AgentError::StaleQuestion { call_id, .. } if call_id == "call-0"),
        "{err}"
    );
    // Run again: the question shows the call as it is now, and a yes runs it.
    let run = agent.run("edit", AgentInput::new()).await.unwrap();
    assert_eq!(run.interrupts.len(), 1, "{:?}", run.stop);
    assert_eq!(
        run.interrupts[0].value["approve"][0]["arguments"],
        json!(r#"{"i":41}"#)
    );
    let run = agent
        .run("edit", AgentInput::new().resume(true))
        .await
        .unwrap();
    let result = run
        .state
        .messages
        .iter()
        .find(|m| m.role == Role::Tool)
        .unwrap();
    assert!(result.text().contains("41"), "{}", result.text());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_rerouted_onto_the_agent_s_route_runs_once_a_step() {
    // A critic between the model's reply and the tools: each step runs the model once,
    // the critic once and the tools once, and every call gets its result.
    let critic_runs = Arc::new(AtomicUsize::new(0));
    let runs = critic_runs.clone();
    let saver = Arc::new(MemorySaver::new());
    let agent = builder(counting_model(12, Arc::default()))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(50),
        )
        .checkpointer(saver)
        .node("critic", move |_s: Arc<AgentState>, _ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok(AgentStateUpdate::default()) }
        })
        .reroute(keel_agent::AGENT, keel_agent::TOOLS, "critic")
        .customize(|g| g.add_edge("critic", keel_agent::TOOLS))
        .build()
        .unwrap();
    let run = agent.run("critic", AgentInput::new()).await.unwrap();
    assert_eq!(run.state.step, 13, "12 tool steps and the answer");
    assert_eq!(critic_runs.load(Ordering::SeqCst), 12);
    assert!(run.answer.is_some(), "{:?}", run.state.stop);
    assert_eq!(run.state.milestones_made, 2, "compaction still runs");
}

#[test]
fn a_route_added_out_of_an_agent_node_fails_the_build() {
    // Before `reroute`, a critic was wired with a second route out of `agent`: the
    // tools then ran twice a step and replies lost their results. It is refused.
    for node in ["agent", "tools", "compact", "epoch"] {
        let built = builder(counting_model(1, Arc::default()))
            .node("critic", |_s, _ctx| async {
                Ok(AgentStateUpdate::default())
            })
            .customize(move |g| {
                g.add_edge(node, "critic")
                    .add_edge("critic", keel_graph::END)
            })
            .build();
        let err = built.err().unwrap();
        assert!(
            matches!(&err, BuildError::RouteAdded { node: n } if n == node),
            "{err:?}"
        );
        assert!(err.to_string().contains("reroute"), "{err}");
    }
}

#[test]
fn a_reroute_of_a_route_the_agent_lacks_names_its_routes() {
    let err = builder(counting_model(1, Arc::default()))
        .node("critic", |_s, _ctx| async {
            Ok(AgentStateUpdate::default())
        })
        .reroute("tools", "epoch", "critic")
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(&err, BuildError::NoSuchRoute { from, to, .. } if from == "tools" && to == "epoch"),
        "{err:?}"
    );
    assert!(err.to_string().contains("leads to compact, agent"), "{err}");
    let err = builder(counting_model(1, Arc::default()))
        .reroute("critic", "tools", "x")
        .build()
        .err()
        .unwrap();
    assert!(matches!(&err, BuildError::NoSuchRoute { .. }), "{err:?}");
    let err = builder(counting_model(1, Arc::default()))
        .wrap("tool", |s, ctx, next| next.run(s, ctx))
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(&err, BuildError::UnknownNode { name } if name == "tool"),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn wrappers_nest_around_the_node_they_wrap_and_may_skip_it() {
    let order = Arc::new(Mutex::new(Vec::new()));
    let (inner, outer) = (order.clone(), order.clone());
    let agent = builder(counting_model(3, Arc::default()))
        .checkpointer(Arc::new(MemorySaver::new()))
        .wrap(keel_agent::TOOLS, move |s, ctx, next| {
            inner.lock().unwrap().push("inner");
            next.run(s, ctx)
        })
        .wrap(keel_agent::TOOLS, move |s, ctx, next| {
            outer.lock().unwrap().push("outer");
            next.run(s, ctx)
        })
        .build()
        .unwrap();
    let run = agent.run("wrapped", AgentInput::new()).await.unwrap();
    assert!(run.answer.is_some());
    assert_eq!(
        *order.lock().unwrap(),
        ["outer", "inner"].repeat(3),
        "the last wrapper given is outermost"
    );
    // A wrapper that does not call `next` skips the node: its own update stands.
    let agent = builder(counting_model(3, Arc::default()))
        .checkpointer(Arc::new(MemorySaver::new()))
        .wrap(keel_agent::AGENT, |_s, _ctx, _next| async {
            Ok(
                AgentStateUpdate::default().messages(keel_graph::reducer::AddMessagesUpdate::from(
                    Message::assistant("from the wrapper"),
                )),
            )
        })
        .build()
        .unwrap();
    let run = agent.run("skipped", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("from the wrapper"));
    assert_eq!(run.state.step, 0, "the model was never called");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_awaiting_approval_is_refused_by_an_agent_that_would_not_ask() {
    // A worker built without the approve list of the agent that asked would run the
    // calls a human was asked about, whatever they answer.
    let saver = Arc::new(MemorySaver::new());
    let asked = paused_for_approval(&saver, "waits").await;
    let careless = builder(counting_model(3, Arc::default()))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    for input in [
        AgentInput::new(),
        AgentInput::new().resume(false),
        AgentInput::new().user("go on"),
    ] {
        let err = careless.run("waits", input).await.unwrap_err();
        assert!(
            matches!(&err, AgentError::ApprovalNotAsked { tools, .. } if tools == &["echo"]),
            "{err:?}"
        );
        assert!(err.to_string().contains(".approve("), "{err}");
    }
    // Nothing ran: the question still waits, and the agent that asks answers it.
    let snap = asked
        .graph()
        .get_state(&RunConfig::thread("waits"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(snap.interrupts.len(), 1);
    assert!(!snap.values.messages.iter().any(|m| m.role == Role::Tool));
    let run = asked
        .run("waits", AgentInput::new().resume(false))
        .await
        .unwrap();
    assert!(
        run.state
            .messages
            .iter()
            .any(|m| m.role == Role::Tool && m.text().contains("did not approve"))
    );
    assert!(run.state.events.iter().any(|e| matches!(
        e,
        AgentEvent::ToolCall {
            failure: Some(keel_agent::ToolFailure::NotApproved),
            ok: false,
            ..
        }
    )));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_run_run_again_with_the_same_message_stores_it_once() {
    // The server is down for two calls: each failed run stored its input before the
    // model was called. Running again with the same input must not add it again.
    let down = Arc::new(AtomicUsize::new(0));
    let (calls, sent) = (down.clone(), Arc::new(Mutex::new(Vec::new())));
    let seen = sent.clone();
    let model = PolicyModel::new("flaky", move |messages, _tools| {
        seen.lock().unwrap().push(messages.to_vec());
        match calls.fetch_add(1, Ordering::SeqCst) {
            0 => Ok(ChatResponse::new(
                Message::assistant("first answer"),
                "flaky",
            )),
            1 | 2 => Err(ModelError::Connection("reset".to_owned())),
            _ => Ok(ChatResponse::new(
                Message::assistant("second answer"),
                "flaky",
            )),
        }
    });
    let agent = builder(model)
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    agent.run("retry", AgentInput::new()).await.unwrap();
    for _ in 0..2 {
        let err = agent
            .run("retry", AgentInput::new().user("follow-up question"))
            .await
            .unwrap_err();
        assert!(err.model_error().is_some(), "{err:?}");
    }
    let run = agent
        .run("retry", AgentInput::new().user("follow-up question"))
        .await
        .unwrap();
    assert_eq!(run.answer.as_deref(), Some("second answer"));
    let count = |ms: &[Message]| {
        ms.iter()
            .filter(|m| m.text() == "follow-up question")
            .count()
    };
    assert_eq!(count(&run.state.messages), 1, "{:?}", run.state.messages);
    assert_eq!(count(sent.lock().unwrap().last().unwrap()), 1);
    // The same text after the model answered is a new message.
    let run = agent
        .run("retry", AgentInput::new().user("follow-up question"))
        .await
        .unwrap();
    assert_eq!(count(&run.state.messages), 2);
}

/// Records the idempotency key of each call.
struct Keys(Arc<Mutex<Vec<String>>>);

impl Tool for Keys {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("pay", "Pays.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        self.0.lock().unwrap().push(ctx.idempotency_key());
        Box::pin(async { Ok("paid".to_owned()) })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_of_a_server_that_reuses_ids_each_reply_get_keys_of_their_own() {
    let n = AtomicU64::new(0);
    let model = PolicyModel::new("reuses-ids", move |_messages, _tools| {
        let i = n.fetch_add(1, Ordering::SeqCst);
        let reply = if i < 3 {
            Message::assistant("").with_tool_calls(vec![ToolCall::new(
                "call_0",
                "pay",
                json!({"i": i}),
            )])
        } else {
            Message::assistant("paid three times")
        };
        Ok(ChatResponse::new(reply, "reuses-ids"))
    });
    let keys = Arc::new(Mutex::new(Vec::new()));
    let agent = builder(model)
        .tool(Arc::new(Keys(keys.clone())))
        .build()
        .unwrap();
    agent.run("pays", AgentInput::new()).await.unwrap();
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys, ["pays/1/call_0", "pays/2/call_0", "pays/3/call_0"]);
}

/// Fails with an error of 20,000 characters.
struct Loud;

impl Tool for Loud {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("loud", "Fails loudly.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async { Err(ToolError::failed("e".repeat(20_000))) })
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_event_log_keeps_long_errors_and_names_short_and_messages_repeat_no_long_name() {
    let n = AtomicU64::new(0);
    let long_name = "n".repeat(10_000);
    let name = long_name.clone();
    let model = PolicyModel::new("odd", move |_messages, _tools| {
        let reply = match n.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("").with_tool_calls(vec![
                ToolCall::new("a", "loud", json!({})),
                ToolCall::new("b", name.clone(), json!({})),
            ]),
            _ => Message::assistant("done"),
        };
        Ok(ChatResponse::new(reply, "odd"))
    });
    let agent = builder(model)
        .tool(Arc::new(Loud))
        .evict(None)
        .build()
        .unwrap();
    let run = agent.run("odd", AgentInput::new()).await.unwrap();
    let calls: Vec<_> = run
        .state
        .events
        .iter()
        .filter_map(|e| match e {
            AgentEvent::ToolCall { name, error, .. } => Some((name.clone(), error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 2);
    for (name, error) in &calls {
        assert!(name.chars().count() <= 65, "{}", name.len());
        let error = error.as_deref().unwrap();
        assert!(error.chars().count() <= 1_001, "{}", error.len());
    }
    let tool_texts: Vec<String> = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.text().into_owned())
        .collect();
    assert!(
        tool_texts[0].contains(&"e".repeat(20_000)),
        "the model reads it whole: {} chars: {}",
        tool_texts[0].len(),
        &tool_texts[0][..300.min(tool_texts[0].len())]
    );
    assert!(
        tool_texts[1].starts_with("Error: there is no tool named"),
        "{}",
        &tool_texts[1][..80]
    );
    assert!(tool_texts[1].len() < 400, "{}", tool_texts[1].len());
    assert!(!tool_texts[1].contains(&long_name));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_whose_own_arguments_are_over_the_budget_is_made_to_fit() {
    // The model gives a tool 1 MB in one argument: the newest step, which compaction
    // never moves, was over the budget with nothing to compact, at every resume.
    let n = AtomicU64::new(0);
    let blob = "y".repeat(1 << 20);
    let arg = blob.clone();
    let model = PolicyModel::new("big-args", move |messages, _tools| {
        let reply = match n.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("").with_tool_calls(vec![ToolCall::new(
                "c1",
                "echo",
                json!({"i": 1, "blob": arg.clone()}),
            )]),
            _ => {
                let sent: usize = messages.iter().map(|m| m.text().len()).sum();
                assert!(sent < 200_000, "the prompt sent holds {sent} bytes");
                Message::assistant("done")
            }
        };
        Ok(ChatResponse::new(reply, "big-args"))
    });
    let store = Arc::new(keel_offload::MemoryStore::new());
    let agent = builder(model)
        .checkpointer(Arc::new(MemorySaver::new()))
        .offload_store(store.clone())
        .build()
        .unwrap();
    let run = agent.run("big", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("done"));
    let reply = run
        .state
        .messages
        .iter()
        .find(|m| !m.tool_calls.is_empty())
        .unwrap();
    let pointer = reply.tool_calls[0].arguments.as_json().unwrap()["blob"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(pointer.contains("truncated_arguments/c1/blob"), "{pointer}");
    use keel_offload::OffloadStore as _;
    let key = keel_offload::Key::new("big", "truncated_arguments/c1/blob").unwrap();
    assert_eq!(store.get(&key).unwrap(), blob, "stored whole, readable");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_the_thread_holds_no_result_for_is_answered_in_the_prompt() {
    // A `tools` node replaced by one that runs nothing: the next prompt would hold a
    // call without a result, which the providers refuse.
    let n = AtomicU64::new(0);
    let prompts = Arc::new(Mutex::new(Vec::new()));
    let seen = prompts.clone();
    let model = PolicyModel::new("dangling", move |messages, _tools| {
        seen.lock().unwrap().push(messages.to_vec());
        let reply = match n.fetch_add(1, Ordering::SeqCst) {
            0 => Message::assistant("").with_tool_calls(vec![
                ToolCall::new("a", "echo", json!({"i": 1})),
                ToolCall::new("b", "echo", json!({"i": 2})),
            ]),
            _ => Message::assistant("done"),
        };
        Ok(ChatResponse::new(reply, "dangling"))
    });
    let agent = builder(model)
        .node("tools", |_s, _ctx| async {
            Ok(AgentStateUpdate::default())
        })
        .build()
        .unwrap();
    let run = agent.run("dangling", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("done"));
    let prompts = prompts.lock().unwrap();
    let second = &prompts[1];
    let results: Vec<(&str, String)> = second
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| (m.tool_call_id.as_deref().unwrap(), m.text().into_owned()))
        .collect();
    assert_eq!(results.len(), 2, "{second:?}");
    assert_eq!((results[0].0, results[1].0), ("a", "b"));
    assert!(results[0].1.contains("was not run"), "{}", results[0].1);
    // The state is as the graph left it: the prompt alone says so.
    assert!(!run.state.messages.iter().any(|m| m.role == Role::Tool));
}

/// A tool that takes 300 ms and counts the calls that finished.
struct Slow(Arc<AtomicUsize>);

impl Tool for Slow {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new("slow", "Takes a while.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        let done = self.0.clone();
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            done.fetch_add(1, Ordering::SeqCst);
            Ok("slow done".to_owned())
        })
    }
}

/// A model that calls `slow` `steps` times, then answers.
fn slow_model(steps: u64) -> PolicyModel {
    PolicyModel::new("slow", move |messages, _tools| {
        let done = messages.iter().filter(|m| m.role == Role::Tool).count() as u64;
        let reply = if done < steps {
            Message::assistant("").with_tool_calls(vec![ToolCall::new(
                format!("s{done}"),
                "slow",
                json!({}),
            )])
        } else {
            Message::assistant("all done")
        };
        Ok(ChatResponse::new(reply, "slow"))
    })
}

fn slow_agent(steps: u64, finished: Arc<AtomicUsize>) -> Agent {
    builder(slow_model(steps))
        .tool(Arc::new(Slow(finished)))
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_thread_that_runs_here_is_neither_deleted_nor_swept() {
    // Both deleted it under the run, whose next write then failed and lost its step.
    let finished = Arc::new(AtomicUsize::new(0));
    let agent = slow_agent(3, finished.clone());
    agent
        .run("idle", AgentInput::new().max_steps(1))
        .await
        .unwrap();
    let going = tokio::spawn({
        let agent = agent.clone();
        async move { agent.run("going", AgentInput::new()).await }
    });
    // In its first tool call (300 ms), with a checkpoint stored.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let err = agent.delete_thread("going").await.unwrap_err();
    assert!(
        matches!(&err, AgentError::ThreadBusy { thread_id } if thread_id == "going"),
        "{err:?}"
    );
    let swept = agent
        .sweep_idle(Duration::from_millis(50), 10)
        .await
        .unwrap();
    assert_eq!(swept, ["idle"]);
    let run = going.await.unwrap().unwrap();
    assert_eq!(run.answer.as_deref(), Some("all done"));
    // Once it has ended, both work.
    agent.delete_thread("going").await.unwrap();
    assert!(agent.state("going").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_run_of_a_thread_while_one_goes_is_refused_before_it_runs_anything() {
    // A double-click: both runs would start from one checkpoint and the second would
    // run the first one's tool call again.
    let finished = Arc::new(AtomicUsize::new(0));
    let agent = slow_agent(2, finished.clone());
    let first = tokio::spawn({
        let agent = agent.clone();
        async move { agent.run("dbl", AgentInput::new()).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let err = agent.run("dbl", AgentInput::new()).await.unwrap_err();
    assert!(
        matches!(&err, AgentError::ThreadBusy { thread_id } if thread_id == "dbl"),
        "{err:?}"
    );
    assert!(err.is_conflict());
    let err = agent
        .stream("dbl", AgentInput::new().user("again"))
        .next()
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, AgentError::ThreadBusy { .. }), "{err:?}");
    // Another thread runs beside it.
    let other = slow_agent(0, Arc::default());
    other.run("other", AgentInput::new()).await.unwrap();
    let run = first.await.unwrap().unwrap();
    assert_eq!(run.answer.as_deref(), Some("all done"));
    assert_eq!(finished.load(Ordering::SeqCst), 2, "each call ran once");
    // Once it has ended, the thread is free.
    let run = agent
        .run("dbl", AgentInput::new().user("and now?"))
        .await
        .unwrap();
    assert_eq!(run.answer.as_deref(), Some("all done"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_caller_went_away_is_waited_for_not_refused() {
    let finished = Arc::new(AtomicUsize::new(0));
    let agent = slow_agent(2, finished.clone());
    // A timeout drops the run mid tool call; running again at once waits for it to
    // stop, then goes on from its last checkpoint.
    let timed_out = tokio::time::timeout(
        Duration::from_millis(100),
        agent.run("gone", AgentInput::new()),
    )
    .await;
    assert!(timed_out.is_err());
    let run = agent.run("gone", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("all done"));
    // A stream dropped after its first item: the same.
    let mut stream = agent.stream("gone2", AgentInput::new());
    stream.next().await.unwrap().unwrap();
    drop(stream);
    let run = agent.run("gone2", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("all done"));
}

/// What a tracing subscriber writes, shared with the test.
#[derive(Clone, Default)]
struct Logged(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `run` on a current-thread runtime (so the subscriber, this thread's, sees
/// every task) under a `fmt` subscriber at `level` that writes span `events`, and
/// returns its output and what the subscriber wrote.
fn logged<T>(
    level: tracing::Level,
    events: tracing_subscriber::fmt::format::FmtSpan,
    run: impl std::future::Future<Output = T>,
) -> (T, String) {
    let logged = Logged::default();
    let writer = logged.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(level)
        .with_span_events(events)
        .finish();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let out = tracing::subscriber::with_default(subscriber, || runtime.block_on(run));
    let log = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
    (out, log)
}

/// A subscriber that shows only warnings still says which thread, step and call a
/// tool's fault is about, and what it was.
#[test]
fn a_tool_s_fault_is_a_warning_that_names_its_thread_and_call() {
    let none = tracing_subscriber::fmt::format::FmtSpan::NONE;
    let ((), log) = logged(tracing::Level::WARN, none, async {
        let calls = AtomicU64::new(0);
        let model = PolicyModel::new("faulty", move |_m, _t| {
            let reply = match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Message::assistant("Trying.").with_tool_calls(vec![
                    ToolCall::new("boom", "panics", json!({})),
                    ToolCall::new("nope", "no_such_tool", json!({})),
                ]),
                _ => Message::assistant("Done."),
            };
            Ok(ChatResponse::new(reply, "faulty"))
        });
        let agent = builder(model)
            .tools([Arc::new(Panics) as Arc<dyn Tool>])
            .checkpointer(Arc::new(MemorySaver::new()))
            .build()
            .unwrap();
        agent.run("warned", AgentInput::new()).await.unwrap();
    });
    let line = log
        .lines()
        .find(|l| l.contains("tool call failed"))
        .unwrap_or_else(|| panic!("{log}"));
    for field in [
        "WARN",
        "thread=warned",
        "step=1",
        "call_id=boom",
        "failure=\"panicked\"",
        "the disk is on fire",
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
    // The model's own mistake (an unknown tool) is not a warning.
    assert!(!log.contains("call_id=nope"), "{log}");
}

/// The `agent` span carries the model call's numbers as its event does (the
/// provider's counts and the model among them), and a failed call is a warning with
/// the error on the span: a trace alone counts and times every call.
#[test]
fn the_agent_span_carries_the_call_s_numbers_and_a_failed_call_is_logged() {
    let close = tracing_subscriber::fmt::format::FmtSpan::CLOSE;
    let (failed, log) = logged(tracing::Level::TRACE, close, async {
        let calls = AtomicUsize::new(0);
        let model = PolicyModel::new("usage", move |_m, _t| {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                Ok(
                    ChatResponse::new(Message::assistant("Done."), "usage-model")
                        .with_usage(keel_model::Usage::new(321, 12).with_cached_tokens(300))
                        .with_retries(2),
                )
            } else {
                Err(ModelError::Connection("the server went away".into()))
            }
        });
        let agent = builder(model)
            .checkpointer(Arc::new(MemorySaver::new()))
            .build()
            .unwrap();
        let run = agent.run("spans", AgentInput::new()).await.unwrap();
        // The event says the reply came after two retried attempts.
        assert!(
            run.state
                .events
                .iter()
                .any(|e| matches!(e, AgentEvent::ModelCall { retries: 2, .. }))
        );
        agent
            .run("spans", AgentInput::new().user("Again."))
            .await
            .unwrap_err()
    });
    assert!(failed.model_error().is_some(), "{failed}");
    let closed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("keel.agent{") && l.contains("close"))
        .collect();
    assert_eq!(closed.len(), 2, "{log}");
    for field in [
        "model=\"usage-model\"",
        "provider_prompt_tokens=321",
        "completion_tokens=12",
        "cached_tokens=300",
        " retries=2",
        "overflow_retries=0",
        "cut_off=false",
    ] {
        assert!(closed[0].contains(field), "{field} in {}", closed[0]);
    }
    assert!(
        closed[1].contains("error=") && closed[1].contains("the server went away"),
        "{}",
        closed[1]
    );
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("model call failed")),
        "{log}"
    );
}

/// A model that answers its first `bursts` calls with a reply of `calls` echo calls
/// (with a line of text), then "Done."; it counts its calls.
fn bursty_model(bursts: u64, calls: u64, seen: Arc<AtomicU64>) -> PolicyModel {
    PolicyModel::new("small", move |_m, _t| {
        let k = seen.fetch_add(1, Ordering::SeqCst);
        let reply = if k < bursts {
            Message::assistant(format!("Checking all {calls} at once.")).with_tool_calls(
                (0..calls)
                    .map(|i| ToolCall::new(format!("c{k}-{i}"), "echo", json!({"i": i})))
                    .collect(),
            )
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "small"))
    })
}

fn four_k_agent(model: PolicyModel) -> Agent {
    echo_agent(
        model,
        ModelProfile::new("small", 4_096, 512, Encoding::O200kBase),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_with_more_tool_calls_than_the_context_holds_is_refused_and_the_thread_goes_on() {
    // 120 calls and their one-line results take about 4,800 tokens: over a 4,096-token
    // window's budget with nothing older to compact. Run, they left a thread whose every
    // later call failed with a context overflow.
    let seen = Arc::new(AtomicU64::new(0));
    let agent = four_k_agent(bursty_model(1, 120, seen.clone()));
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done."));
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    // None was run; the reply's text is kept without its calls, and the model was told.
    let m = &run.state.messages;
    assert!(m.iter().all(|m| m.role != Role::Tool));
    let kept = m
        .iter()
        .find(|m| {
            m.metadata
                .contains_key(keel_agent::CALLS_REFUSED_METADATA_KEY)
        })
        .unwrap();
    assert_eq!(kept.text(), "Checking all 120 at once.");
    assert!(kept.tool_calls.is_empty());
    assert_eq!(kept.metadata[keel_agent::CALLS_REFUSED_METADATA_KEY], 120);
    let nudge = m
        .iter()
        .find(|m| m.metadata.contains_key(keel_agent::NUDGE_METADATA_KEY))
        .unwrap();
    // 3,584 tokens of budget at 64 a call.
    assert!(nudge.text().contains("120 tool calls") && nudge.text().contains("at most 56"));

    // A burst the context holds runs as before.
    let seen = Arc::new(AtomicU64::new(0));
    let agent = four_k_agent(bursty_model(1, 40, seen));
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    let results = run
        .state
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .count();
    assert_eq!(results, 40);
}

#[tokio::test(flavor = "multi_thread")]
async fn too_many_tool_calls_twice_in_a_row_stop_the_run_resumably() {
    let seen = Arc::new(AtomicU64::new(0));
    let agent = four_k_agent(bursty_model(2, 300, seen.clone()));
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    let stop = Some(Stop::TooManyToolCalls {
        steps: 2,
        calls: 300,
        max: 56,
    });
    assert_eq!(run.stop, stop);
    assert!(run.stop.unwrap().to_string().contains("300 tool calls"));
    // The refused reply's text is kept, and is no answer.
    assert_eq!(run.answer, None);
    assert_eq!(run.state.answer(), None);
    assert_eq!(
        run.state.last_message().unwrap().text(),
        "Checking all 300 at once."
    );
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    // Running the thread again asks the model again, and this time it answers.
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done."));
    assert_eq!(run.stop, None);

    // The limit is the builder's to set.
    let seen = Arc::new(AtomicU64::new(0));
    let agent = Agent::builder()
        .model(Arc::new(bursty_model(1, 3, seen)))
        .goal(GOAL)
        .tool(Arc::new(Echo))
        .max_tool_calls(2)
        .build()
        .unwrap();
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert!(run.state.messages.iter().all(|m| m.role != Role::Tool));
    assert_eq!(run.answer.as_deref(), Some("Done."));
    // None is no limit a reply could meet, and a zero timeout none a call could.
    let refused = |b: keel_agent::AgentBuilder| {
        b.model(Arc::new(counting_model(1, Arc::default())))
            .goal(GOAL)
            .build()
            .unwrap_err()
    };
    let err = refused(Agent::builder().max_tool_calls(0));
    assert!(
        matches!(
            err,
            BuildError::BadSetting {
                setting: "max_tool_calls",
                ..
            }
        ),
        "{err:?}"
    );
    let err = refused(Agent::builder().tool_timeout(Duration::ZERO));
    assert!(err.to_string().starts_with("`tool_timeout`: "), "{err}");
}

#[test]
fn a_recent_tail_over_half_the_budget_is_a_warning_at_build() {
    let build = |keep: usize| {
        logged(
            tracing::Level::WARN,
            tracing_subscriber::fmt::format::FmtSpan::NONE,
            async move {
                Agent::builder()
                    .model(Arc::new(counting_model(1, Arc::default())))
                    .profile(ModelProfile::new(
                        "small",
                        4_096,
                        1_024,
                        Encoding::O200kBase,
                    ))
                    .goal(GOAL)
                    .compaction(CompactionConfig::default().with_keep_recent_tokens(keep))
                    .build()
                    .map(|_| ())
            },
        )
    };
    let (built, log) = build(100_000);
    built.unwrap();
    assert!(
        log.contains("keep_recent_tokens is over half the prompt budget")
            && log.contains("keep_recent_tokens=100000")
            && log.contains("budget=3072"),
        "{log}"
    );
    let (built, log) = build(1_000);
    built.unwrap();
    assert!(!log.contains("keep_recent_tokens"), "{log}");
}

#[cfg(feature = "fs")]
#[test]
fn file_tools_describe_themselves_briefly_on_a_small_budget_unless_told() {
    use keel_agent::tools::FileTools;
    let fixed = |window: usize, files: FileTools| {
        Agent::builder()
            .model(Arc::new(counting_model(1, Arc::default())))
            .profile(ModelProfile::new("m", window, 1_024, Encoding::O200kBase))
            .goal(GOAL)
            .file_tools(files)
            .build()
            .unwrap()
            .fixed_prompt_tokens(None, None)
    };
    let files = || {
        FileTools::new(env!("CARGO_MANIFEST_DIR"))
            .unwrap()
            .read_only()
    };
    // A 3,072-token budget is under `BRIEF_SPECS_BELOW`, 7,168 is not.
    let small = fixed(4_096, files());
    let large = fixed(8_192, files());
    assert!(small + 250 < large, "{small} against {large}");
    assert_eq!(fixed(4_096, files().with_brief_specs(false)), large);
    assert_eq!(fixed(8_192, files().with_brief_specs(true)), small);
}

/// A model that calls `echo` with `{"i": 7}` in each of its first `times` replies,
/// then answers.
fn looping_model(times: u64) -> PolicyModel {
    let n = AtomicU64::new(0);
    PolicyModel::new("small", move |_m, _t| {
        let k = n.fetch_add(1, Ordering::SeqCst);
        let reply = if k < times {
            Message::assistant("").with_tool_calls(vec![ToolCall::new(
                format!("c{k}"),
                "echo",
                json!({"i": 7}),
            )])
        } else {
            Message::assistant("Done.")
        };
        Ok(ChatResponse::new(reply, "small"))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_call_in_too_many_replies_in_a_row_is_not_run_again() {
    let refused = |state: &AgentState| {
        state
            .messages
            .iter()
            .filter(|m| m.role == Role::Tool && m.text().starts_with("Not run: each of your last"))
            .count()
    };
    // 8 replies in a row: the first 5 run, the next 3 are answered without running.
    let saver = Arc::new(MemorySaver::new());
    let agent = builder(looping_model(8))
        .checkpointer(saver.clone())
        .build()
        .unwrap();
    let mut stream = agent.stream("t", AgentInput::new());
    let mut failures = Vec::new();
    while let Some(update) = stream.next().await {
        if let AgentUpdate::Event(AgentEvent::ToolCall { failure, .. }) = update.unwrap() {
            failures.push(failure);
        }
    }
    let repeated = Some(keel_agent::ToolFailure::Repeated);
    assert_eq!(failures[..5], [None; 5]);
    assert_eq!(failures[5..], [repeated; 3]);
    let state = agent.state("t").await.unwrap().unwrap();
    assert_eq!(refused(&state), 3);
    assert_eq!(state.answer().as_deref(), Some("Done."));

    // A message from the user starts the count over: the call runs again.
    let results = |state: &AgentState| {
        state
            .messages
            .iter()
            .filter(|m| m.role == Role::Tool)
            .count()
    };
    let before = results(&state);
    let agent = builder(looping_model(1))
        .checkpointer(saver)
        .build()
        .unwrap();
    let run = agent
        .run("t", AgentInput::new().user("Read it once more."))
        .await
        .unwrap();
    assert_eq!(results(&run.state), before + 1);
    assert_eq!(refused(&run.state), 3);

    // Milestones every 2 steps take the earlier replies out of the context: the
    // event log still tells the repeats.
    let agent = builder(looping_model(8))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(2))
                .with_keep_recent_tokens(1),
        )
        .build()
        .unwrap();
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert!(
        run.state.milestones_made >= 3,
        "{}",
        run.state.milestones_made
    );
    let not_run = run
        .state
        .events
        .iter()
        .filter(|e| {
            matches!(
                e,
                AgentEvent::ToolCall {
                    failure: Some(keel_agent::ToolFailure::Repeated),
                    ..
                }
            )
        })
        .count();
    assert_eq!(not_run, 3);

    // Off, every call runs.
    let agent = builder(looping_model(8))
        .max_repeated_calls(None)
        .build()
        .unwrap();
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert_eq!(refused(&run.state), 0);
    let err = builder(looping_model(1))
        .max_repeated_calls(Some(0))
        .build()
        .unwrap_err();
    assert!(
        err.to_string().starts_with("`max_repeated_calls`: "),
        "{err}"
    );
}
