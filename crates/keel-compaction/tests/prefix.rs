//! A model summarizer's request reuses the agent's cached prefix (same system, goal,
//! summaries and tools first, the span, the instruction last), and its calls are part
//! of the cost the replay reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::replay::{ReplayConfig, Report, Trajectory, replay_trajectory};
use keel_compaction::{
    CompactionConfig, Compactor, ContextState, GoalAnchor, PREFIX_VERSION, PrefixSummarizer,
    Strategy, Trigger,
};
use keel_message::{Message, ToolCall, ToolSpec};
use keel_model::{ScriptedModel, Turn, Usage};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{ApproxCounter, Encoding, ModelProfile, TokenCounter};
use serde_json::json;

const REPLY: &str = "SESSION INTENT:\n- none\nSUMMARY:\n- read the logs of ORD-4411\nARTIFACTS:\n- sh\nNEXT STEPS:\n- none\n";

fn reply() -> Turn {
    Turn::text(REPLY).with_usage(Usage::new(900, 40).with_cached_tokens(850))
}

fn step(i: usize) -> (Message, Vec<Message>) {
    let reply = Message::assistant(format!("Step {i}."))
        .with_id(format!("a{i}"))
        .with_tool_calls(vec![ToolCall::new(
            format!("c{i}"),
            "sh",
            json!({"cmd": format!("cat {i}.log")}),
        )]);
    let log: String = (0..30)
        .map(|k| format!("log {i} line {k}: order ORD-4411 ok\n"))
        .collect();
    (
        reply,
        vec![Message::tool(format!("c{i}"), log).with_id(format!("r{i}"))],
    )
}

#[tokio::test]
async fn the_summary_request_starts_with_the_agents_prompt_and_ends_with_the_instruction() {
    let model = Arc::new(ScriptedModel::new([reply()]));
    let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::new());
    let compactor = Compactor::new(
        Arc::new(ExtractiveSummarizer::new()),
        Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
        ThreadId::new("t").unwrap(),
        Arc::clone(&counter),
        ModelProfile::new("test", 100_000, 10_000, Encoding::Approximate),
    )
    .with_config(
        CompactionConfig::default()
            .with_every_steps(Some(4))
            .with_keep_recent_tokens(50),
    )
    .with_prefix_summarizer(PrefixSummarizer::new(model.clone(), counter));
    let tools = [ToolSpec::new(
        "sh",
        "Runs a command.",
        json!({"type": "object"}),
    )];
    let mut state = ContextState::new(GoalAnchor::new("Check every order."))
        .with_system(Message::system("You are an operations agent."));
    for i in 0..4 {
        let (reply, results) = step(i);
        compactor.push_step(&mut state, reply, results);
    }
    let agent_prompt = compactor.assemble(&mut state);
    let event = compactor
        .compact(&mut state, Trigger::Steps, &tools)
        .await
        .unwrap();
    let requests = model.requests();
    assert_eq!(requests.len(), 1);
    let sent = &requests[0];
    // The cached prefix and the span are the agent's prompt, message for message...
    let span = agent_prompt.len() - state.raw.len();
    assert_eq!(sent.messages[..span], agent_prompt[..span]);
    assert_eq!(sent.messages[0].text(), "You are an operations agent.");
    assert_eq!(sent.messages[1].text(), "Check every order.");
    // ...the instruction comes last, and the tools are the agent's.
    assert_eq!(sent.messages.len(), span + 1);
    assert!(sent.messages[span].text().contains("NEXT STEPS"));
    assert_eq!(sent.tools, tools);
    // The milestone is the model's, and its usage is on the event.
    assert_eq!(state.milestones[0].prompt_version, PREFIX_VERSION);
    assert!(state.milestones[0].text.contains("ORD-4411"));
    assert_eq!(
        (
            event.summary_input_tokens,
            event.summary_cached_tokens,
            event.summary_output_tokens
        ),
        (900, 850, 40)
    );
}

#[tokio::test]
async fn the_replay_counts_the_summarizers_calls_in_the_cost() {
    let mut messages = vec![
        Message::system("You are an operations agent."),
        Message::user("Check every order."),
    ];
    for i in 0..24 {
        let (reply, results) = step(i);
        messages.push(reply);
        messages.extend(results);
    }
    let t = Trajectory::new("hand-made", "orders", messages).unwrap();
    let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::new());
    let mut config = ReplayConfig::new(4_000, Strategy::Hierarchical);
    config.encoding = Encoding::Approximate;
    config.summary_model = Some(Arc::new(ScriptedModel::new(
        std::iter::repeat_with(reply).take(40),
    )));
    let run = replay_trajectory(&t, &config, Arc::clone(&counter))
        .await
        .unwrap();
    let calls = run
        .events
        .iter()
        .filter(|e| e.summary_input_tokens > 0)
        .count();
    assert!(calls > 0, "{:?}", run.events);
    let r = Report::from_runs(
        "hand-made",
        "hierarchical",
        4_000,
        std::slice::from_ref(&run),
    );
    // An event may hold more than one call (a milestone and the epoch it completes).
    let input: u64 = run.events.iter().map(|e| e.summary_input_tokens).sum();
    assert_eq!(input % 900, 0, "{input}");
    let calls = input / 900;
    assert_eq!(r.summary_input_tokens, 900 * calls);
    assert_eq!(r.summary_output_tokens, 40 * calls);
    let per_call = 50.0 + 0.1 * 850.0 + 4.0 * 40.0;
    assert!((r.summary_cost() - per_call * calls as f64).abs() < 1e-6);
    // The cost is the prompts' cache-weighted tokens plus the summarizer's calls.
    let prompts: f64 = run
        .turns
        .iter()
        .map(|t| 0.1 * t.shared_prefix as f64 + (t.tokens - t.shared_prefix) as f64)
        .sum();
    assert!((r.cost - prompts - r.summary_cost()).abs() < 1e-6, "{r}");
}
