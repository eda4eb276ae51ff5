//! ScriptedModel and ReplayModel, the latter over real recorded trajectories.

use std::path::PathBuf;
use std::sync::Arc;

use futures::StreamExt;
use keel_message::{Message, Role, ToolCall, openai};
use keel_model::{
    ChatEvent, ChatModel, ChatOptions, ModelError, ReplayModel, ScriptedModel, Turn, Usage,
    collect_stream,
};
use serde_json::{Value, json};

/// `../shared/data` from the workspace root.
fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data")
}

#[tokio::test]
async fn scripted_stream_splits_text_and_ends_with_the_whole_reply() {
    let model = ScriptedModel::new([Turn::tool_calls(
        "I will list the files now.",
        vec![ToolCall::new("c1", "ls", json!({}))],
    )
    .with_usage(Usage::new(10, 8))]);
    let events: Vec<ChatEvent> = model
        .chat_stream(&[Message::user("go")], &[], &ChatOptions::new())
        .await
        .unwrap()
        .map(Result::unwrap)
        .collect()
        .await;
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            ChatEvent::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "I will list the files now.");
    assert!(
        events
            .iter()
            .filter(|e| matches!(e, ChatEvent::Text(_)))
            .count()
            > 1
    );
    assert!(
        matches!(&events[events.len() - 2], ChatEvent::ToolCall(d) if d.name.as_deref() == Some("ls"))
    );
    let ChatEvent::Done(reply) = events.last().unwrap() else {
        panic!()
    };
    assert_eq!(reply.usage, Some(Usage::new(10, 8)));
    assert_eq!(reply.model, "scripted");
}

#[tokio::test]
async fn scripted_errors_and_pushes_and_recorded_requests() {
    let model: Arc<ScriptedModel> = Arc::new(
        ScriptedModel::new([Turn::fail(ModelError::ContextOverflow {
            message: "too long".into(),
        })])
        .with_name("fake-7b"),
    );
    model.push("second");
    let dyn_model: Arc<dyn ChatModel> = model.clone();
    assert_eq!(dyn_model.model_name(), "fake-7b");
    let err = dyn_model
        .chat(&[Message::user("a")], &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(err.is_context_overflow());
    let ok = collect_stream(
        dyn_model
            .chat_stream(&[Message::user("b")], &[], &ChatOptions::new().seed(1))
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(ok.text(), "second");
    assert_eq!(model.remaining(), 0);
    let requests = model.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].messages[0].text(), "b");
    assert_eq!(requests[1].options.seed, Some(1));
}

/// Replays every tau-bench trajectory strictly: feeding back the recorded history
/// before each assistant turn must give exactly that turn.
#[tokio::test]
async fn replay_reproduces_recorded_tau_bench_runs() {
    let file = data_dir().join("tau-bench/gpt-4o-airline.json");
    let Ok(bytes) = std::fs::read(&file) else {
        eprintln!(
            "skipped: {} not found (the shared data folder is only present in CI)",
            file.display()
        );
        return;
    };
    let runs: Vec<Value> = serde_json::from_slice(&bytes).unwrap();
    let mut turns = 0;
    for run in &runs {
        let history = openai::from_values(run["traj"].as_array().unwrap()).unwrap();
        let model = ReplayModel::new(history.clone()).strict(true);
        for (i, m) in history.iter().enumerate() {
            if m.role != Role::Assistant {
                continue;
            }
            let reply = model
                .chat(&history[..i], &[], &ChatOptions::new())
                .await
                .unwrap();
            assert_eq!(reply.message.text(), m.text());
            assert_eq!(reply.message.tool_calls, m.tool_calls);
            turns += 1;
        }
        assert!(matches!(
            model.chat(&history, &[], &ChatOptions::new()).await,
            Err(ModelError::Exhausted { .. })
        ));
    }
    assert!(turns > 1000, "replayed {turns} turns");
}

#[test]
fn usage_sums_saturate_instead_of_overflowing() {
    // Counts come from a server: absurd ones must not panic a caller that sums them.
    let absurd = Usage::new(u64::MAX, u64::MAX).with_cached_tokens(u64::MAX);
    let sum = absurd + Usage::new(1, 1).with_cached_tokens(1);
    assert_eq!(sum, absurd);
    assert_eq!(absurd.total(), u64::MAX);
}
