//! Needed-fact recall in the replay report, on hand-made transcripts: a fact the prompt
//! kept, one compaction dropped (and the archive has), and ones that do not count.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::Strategy;
use keel_compaction::replay::{
    FactCheck, ReplayConfig, Report, Trajectory, needed_facts, replay_trajectory,
};
use keel_message::{Message, ToolCall};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

fn counter() -> Arc<dyn TokenCounter> {
    Arc::new(MemoCounter::new(TiktokenCounter::o200k_base().unwrap()))
}

fn call(id: &str, name: &str, args: serde_json::Value) -> Message {
    Message::assistant("").with_tool_calls(vec![ToolCall::new(id, name, args)])
}

fn filler(n: usize) -> String {
    (0..n)
        .map(|i| format!("row {i}: nothing of interest here, carry on\n"))
        .collect()
}

/// A support run: the order's details arrive in a tool result, the user gives an email,
/// then filler steps push the details out of a small window, and the last call passes
/// them all on.
fn transcript() -> Trajectory {
    let mut m = vec![
        Message::system("You are a support agent. Quote policy POL-9000 when refusing."),
        Message::user("Find the order of alice_77 and refund it."),
        call("c1", "find_orders", json!({"user": "alice_77"})),
        Message::tool("c1", "orders: ORD-4411 (delivered)"),
        call("c2", "get_order", json!({"order_id": "ORD-4411"})),
        Message::tool(
            "c2",
            format!(
                "ORD-4411: item SKU-31337, paid 1299 with card_8812\n{}",
                filler(20)
            ),
        ),
        Message::assistant("Which email should the refund receipt go to?"),
        Message::user("alice@example.com please"),
    ];
    for k in 0..6 {
        let id = format!("f{k}");
        m.push(call(&id, "scan_logs", json!({"page": k})));
        m.push(Message::tool(&id, filler(30)));
    }
    m.push(call(
        "c9",
        "refund",
        json!({
            "order_id": "ORD-4411",
            "amount": 1299,
            "card": "card_8812",
            "receipt_to": "alice@example.com",
            "policy": "POL-9000",
            "ticket": "NEW-0001",
        }),
    ));
    m.push(Message::tool("c9", "refunded"));
    for (i, msg) in m.iter_mut().enumerate() {
        msg.id = Some(format!("m{i}"));
    }
    Trajectory::new("hand-made", "support", m).unwrap()
}

fn last_turn_facts(facts: &[FactCheck]) -> Vec<(&str, bool, bool)> {
    let last = facts.iter().map(|f| f.turn).max().unwrap();
    facts
        .iter()
        .filter(|f| f.turn == last)
        .map(|f| (f.fact.as_str(), f.in_prompt, f.in_archive))
        .collect()
}

#[tokio::test]
async fn recall_counts_kept_dropped_and_archived_facts() {
    let t = transcript();
    // Masking keeps only the last turn's results once the prompt passes the threshold:
    // the order details are masked (out of the prompt, in the archive); the user's
    // message and the assistant's own earlier call stay.
    let mut config = ReplayConfig::new(
        2_000,
        Strategy::Masking {
            keep_turns: 1,
            block: 1,
        },
    );
    config.needles = 0;
    let run = replay_trajectory(&t, &config, counter()).await.unwrap();
    assert!(
        run.events.iter().any(|e| e.messages_archived > 0),
        "{run:?}"
    );
    assert_eq!(
        last_turn_facts(&run.facts),
        [
            // Kept: the assistant's get_order call is still in the prompt.
            ("ORD-4411", true, false),
            // Dropped: only in the masked tool result, which the archive holds.
            ("1299", false, true),
            ("card_8812", false, true),
            // Kept: a user message is never masked.
            ("alice@example.com", true, false),
            // POL-9000 is in the system prompt, alice_77 in the goal, NEW-0001 was
            // never seen: none of them is a needed fact.
        ]
    );
    let report = Report::from_runs("hand-made", "masking", 2_000, std::slice::from_ref(&run));
    assert_eq!(report.needed_facts, run.facts.len());
    assert_eq!(
        report.facts_in_prompt,
        run.facts.iter().filter(|f| f.in_prompt).count()
    );
    assert_eq!(
        report.facts_in_archive,
        run.facts.iter().filter(|f| f.in_archive).count()
    );
    assert!(report.recall() < 1.0);
    assert!((report.recall() + report.archive_recall() - 1.0).abs() < 1e-9);
    assert!((run.recall() - report.recall()).abs() < 1e-9);
    assert!(report.recall_turns > 0);
}

#[tokio::test]
async fn without_a_compaction_nothing_is_checked_and_recall_is_full() {
    let t = transcript();
    let mut config = ReplayConfig::new(200_000, Strategy::Hierarchical);
    config.compaction.every_steps = None;
    let run = replay_trajectory(&t, &config, counter()).await.unwrap();
    assert!(run.events.is_empty());
    assert!(run.facts.is_empty());
    let report = Report::from_runs("hand-made", "hierarchical", 200_000, &[run]);
    assert_eq!(report.recall_turns, 0);
    assert_eq!(report.recall(), 1.0);
}

#[test]
fn needed_facts_come_from_what_the_agent_was_told() {
    let turn = Message::assistant("Refunding `card_8812` now for ORD-4411 (ref 777).")
        .with_tool_calls(vec![ToolCall::new(
            "c1",
            "refund",
            json!({"path": "/var/log/app.log", "cabin": "economy", "to": "JFK"}),
        )]);
    let told = "ORD-4411 paid with card_8812; see /var/log/app.log; from JFK";
    let known = "Never refund more than 777 dollars.";
    assert_eq!(
        needed_facts(&turn, told, known),
        ["card_8812", "ORD-4411", "/var/log/app.log", "JFK"]
    );
    // Nothing told, nothing needed.
    assert!(needed_facts(&turn, "", known).is_empty());
}
