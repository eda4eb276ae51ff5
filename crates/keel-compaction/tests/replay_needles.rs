//! What the replay plants to check the archive (a verification code in the first
//! observations) changes neither with the run's name nor what is minified.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::Strategy;
use keel_compaction::replay::{ReplayConfig, Trajectory, replay_trajectory};
use keel_message::{Message, ToolCall};
use keel_token::{TiktokenCounter, TokenCounter};
use serde_json::json;

fn run(id: &str) -> Trajectory {
    let mut messages = vec![
        Message::system("You are a support agent."),
        Message::user("Look up the orders ORD-1 to ORD-4."),
    ];
    for i in 1..=4 {
        let call = format!("call_{i}");
        messages.push(Message::assistant("").with_tool_calls(vec![ToolCall::new(
            call.clone(),
            "get_order",
            json!({"order_id": format!("ORD-{i}")}),
        )]));
        let result = serde_json::to_string_pretty(&json!({
            "order_id": format!("ORD-{i}"),
            "status": "shipped",
            "items": [{"sku": format!("SKU-{i}-1"), "qty": 1}, {"sku": format!("SKU-{i}-2"), "qty": 2}],
        }))
        .unwrap();
        messages.push(Message::tool(call, result).with_name("get_order"));
    }
    messages.push(Message::assistant("All four are shipped."));
    Trajectory::new("openai", id, messages).unwrap()
}

#[tokio::test]
async fn a_run_replays_alike_under_any_name_and_every_json_result_is_minified() {
    let counter: Arc<dyn TokenCounter> = Arc::new(TiktokenCounter::o200k_base().unwrap());
    let mut config = ReplayConfig::new(128_000, Strategy::Hierarchical);
    config.record_prompts = true;
    let mut tokens = Vec::new();
    for id in ["a", "b", "run-2024-05-01", "a much longer name with words"] {
        let report = replay_trajectory(&run(id), &config, counter.clone())
            .await
            .unwrap();
        let per_turn: Vec<(usize, usize)> = report
            .turns
            .iter()
            .map(|t| (t.full_tokens, t.tokens))
            .collect();
        tokens.push(per_turn);
        // The needles were planted, and no tool result reaches the model pretty-printed.
        assert_eq!(report.needles.len(), 2, "{:?}", report.needles);
        let last = report.prompts.last().unwrap();
        let results: Vec<String> = last
            .iter()
            .filter(|m| m.role == keel_message::Role::Tool)
            .map(|m| m.text().into_owned())
            .collect();
        assert_eq!(results.len(), 4);
        for r in &results {
            assert!(!r.contains('\n'), "not minified: {r}");
            serde_json::from_str::<serde_json::Value>(r).unwrap();
        }
    }
    assert!(tokens.windows(2).all(|w| w[0] == w[1]), "{tokens:?}");
}
