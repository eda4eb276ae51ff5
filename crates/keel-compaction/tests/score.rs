//! `score_prompts`, the scorer for another context manager's prompts: the full
//! history scores as the baseline, keel's own prompts score exactly as its replay
//! reported them, and a manager that drops what the agent was told loses recall.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
use common::data;

use std::sync::Arc;

use keel_compaction::Strategy;
use keel_compaction::replay::{
    ReplayConfig, Report, RunReport, ScoreError, Trajectory, TurnRecord, external_summary_event,
    load_swe_agent_dir, load_tau_bench, replay_trajectory, score_prompts,
};
use keel_message::{Message, Role, ToolCall};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

fn counter() -> Arc<dyn TokenCounter> {
    Arc::new(MemoCounter::new(TiktokenCounter::o200k_base().unwrap()))
}

fn call(id: &str, name: &str, args: serde_json::Value) -> Message {
    Message::assistant("").with_tool_calls(vec![ToolCall::new(id, name, args)])
}

fn filler(k: usize, n: usize) -> String {
    (0..n)
        .map(|i| format!("page {k} row {i}: nothing of interest here, carry on\n"))
        .collect()
}

/// A support run long enough to be compacted at a 2,000-token window: facts arrive in
/// tool results and from the user, filler pushes them out, later calls pass them on.
fn transcript() -> Trajectory {
    let mut m = vec![
        Message::system("You are a support agent. Quote policy POL-9000 when refusing."),
        Message::user("Find the order of alice_77 and refund it."),
        call("c1", "find_orders", json!({"user": "alice_77"})),
        Message::tool("c1", "orders: ORD-4411 (delivered), ORD-5522 (open)"),
        call("c2", "get_order", json!({"order_id": "ORD-4411"})),
        Message::tool(
            "c2",
            format!(
                "ORD-4411: SKU-31337, paid 1299 with card_8812\n{}",
                filler(0, 12)
            ),
        ),
        Message::assistant("Which email should the receipt go to?"),
        Message::user("alice@example.com please"),
    ];
    for k in 1..9 {
        let id = format!("f{k}");
        m.push(call(
            &id,
            "scan_logs",
            json!({"order_id": "ORD-4411", "page": k}),
        ));
        m.push(Message::tool(&id, filler(k, 20)));
    }
    m.push(call(
        "c9",
        "refund",
        json!({"order_id": "ORD-4411", "amount": 1299, "card": "card_8812", "receipt_to": "alice@example.com"}),
    ));
    m.push(Message::tool("c9", "refunded"));
    m.push(Message::assistant(
        "Refunded ORD-4411; the receipt goes to alice@example.com.",
    ));
    for (i, msg) in m.iter_mut().enumerate() {
        msg.id = Some(format!("m{i}"));
    }
    Trajectory::new("hand-made", "support", m).unwrap()
}

/// The full history before each recorded assistant message.
fn full_history(t: &Trajectory) -> Vec<Vec<Message>> {
    t.messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::Assistant)
        .map(|(i, _)| t.messages[..i].to_vec())
        .collect()
}

#[test]
fn the_full_history_saves_nothing_and_recalls_everything() {
    let t = transcript();
    let run = score_prompts(&t, &full_history(&t), counter()).unwrap();
    let r = Report::from_runs("hand-made", "full", 2_000, std::slice::from_ref(&run));
    assert_eq!(r.turns, t.turns());
    assert_eq!(r.tokens, r.full_tokens);
    assert_eq!(r.token_reduction(), 0.0);
    assert!((r.cost - r.full_cost).abs() < 1e-9, "{r:?}");
    assert_eq!(r.cacheable_share(), 1.0);
    assert_eq!(r.goal_share(), 1.0);
    // Nothing the agent was told ever left the prompt: no turn is checked.
    assert!(run.turns.iter().all(|t| !t.checked));
    assert_eq!((r.recall_turns, r.needed_facts), (0, 0));
    assert_eq!(r.recall(), 1.0);
    assert!(
        r.full_over_window > 0,
        "the window must be under the run's size"
    );
}

/// keel's replay with its prompts recorded, and the same prompts scored from outside.
async fn both_ways(t: &Trajectory, config: &ReplayConfig) -> (RunReport, RunReport) {
    let mut config = config.clone();
    config.record_prompts = true;
    // The scorer sees the recording as it is: no needles planted on keel's side either.
    config.needles = 0;
    let keel = replay_trajectory(t, &config, counter()).await.unwrap();
    assert_eq!(keel.prompts.len(), t.turns());
    let scored = score_prompts(t, &keel.prompts, counter()).unwrap();
    (keel, scored)
}

fn assert_same(keel: &RunReport, scored: &RunReport, window: usize) {
    assert_eq!(keel.turns.len(), scored.turns.len(), "{}", keel.id);
    for (k, (a, b)) in keel.turns.iter().zip(&scored.turns).enumerate() {
        // No archive outside keel: a fact missing from the prompt is just missing.
        let a = TurnRecord {
            needed_in_archive: 0,
            ..*a
        };
        assert_eq!(&a, b, "{} turn {k}", keel.id);
    }
    let strip = |r: &RunReport| {
        r.facts
            .iter()
            .map(|f| (f.turn, f.fact.clone(), f.in_prompt))
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(keel), strip(scored), "{}", keel.id);
    let mut a = Report::from_runs("d", "s", window, std::slice::from_ref(keel));
    let b = Report::from_runs("d", "s", window, std::slice::from_ref(scored));
    // What only keel's replay knows: its events, needles and archive.
    a.compactions = 0;
    a.failed_compactions = 0;
    a.needles = 0;
    a.needles_left = 0;
    a.needles_found = 0;
    a.facts_in_archive = 0;
    assert_eq!(a, b, "{}", keel.id);
}

#[tokio::test]
async fn keel_prompts_score_as_keel_replay_reported_them() {
    let t = transcript();
    for strategy in [
        Strategy::Hierarchical,
        Strategy::masking(),
        Strategy::hybrid(),
    ] {
        let config = ReplayConfig::new(2_000, strategy);
        let (keel, scored) = both_ways(&t, &config).await;
        assert!(
            keel.events.iter().any(|e| e.error.is_none()),
            "{strategy:?} must compact at this window"
        );
        assert!(keel.facts.iter().any(|f| f.turn > 0), "{strategy:?}");
        assert_same(&keel, &scored, 2_000);
    }
}

#[test]
fn a_manager_that_drops_what_it_was_told_loses_recall() {
    let t = transcript();
    // Keep the system prompt, the goal and the newest 4 messages.
    let prompts: Vec<Vec<Message>> = full_history(&t)
        .into_iter()
        .map(|p| {
            let mut kept = p[..2].to_vec();
            kept.extend(p[2.max(p.len().saturating_sub(4))..].iter().cloned());
            kept
        })
        .collect();
    let run = score_prompts(&t, &prompts, counter()).unwrap();
    let r = Report::from_runs("hand-made", "drop", 2_000, std::slice::from_ref(&run));
    assert!(r.token_reduction() > 0.3, "{r:?}");
    assert!(r.recall_turns > 0);
    assert!(r.recall() < 1.0, "{r:?}");
    // The final refund passes on card_8812, told only in an early tool result.
    assert!(
        run.facts
            .iter()
            .any(|f| f.fact == "card_8812" && !f.in_prompt && !f.in_archive)
    );
    // A cut at every turn: the prompt never extends the previous one once it slides.
    assert!(r.cacheable_share() < 1.0);
    assert_eq!(r.goal_share(), 1.0);
}

#[test]
fn summarizer_calls_count_as_compactions_with_their_cost() {
    let t = transcript();
    let mut run = score_prompts(&t, &full_history(&t), counter()).unwrap();
    let before = Report::from_runs("hand-made", "peer", 2_000, std::slice::from_ref(&run));
    let prompt = vec![Message::user(format!("Summarize:\n{}", filler(0, 10)))];
    let c = counter();
    run.events.push(external_summary_event(
        3,
        &prompt,
        "A summary.",
        5,
        "peer",
        &*c,
    ));
    let after = Report::from_runs("hand-made", "peer", 2_000, &[run]);
    assert_eq!(after.compactions, 1);
    assert_eq!(
        after.summary_input_tokens as usize,
        c.count_messages(&prompt)
    );
    assert_eq!(after.summary_cached_tokens, 0);
    assert_eq!(
        after.summary_output_tokens as usize,
        c.count_text("A summary.")
    );
    assert!((after.cost - before.cost - after.summary_cost()).abs() < 1e-6);
}

#[test]
fn one_prompt_per_recorded_model_call() {
    let t = transcript();
    let mut prompts = full_history(&t);
    prompts.pop();
    let err = score_prompts(&t, &prompts, counter()).unwrap_err();
    assert!(matches!(
        err,
        ScoreError::TurnCount { prompts: p, turns, .. } if p + 1 == turns
    ));
    assert!(err.to_string().contains("prompts for"), "{err}");
    // A run without a user message scores too (no goal to find in the prompts).
    let bare = Trajectory::new(
        "d",
        "bare",
        vec![Message::system("s"), Message::assistant("hi")],
    )
    .unwrap();
    let run = score_prompts(&bare, &[vec![Message::system("s")]], counter()).unwrap();
    assert!(!run.turns[0].goal_intact);
}

#[tokio::test]
async fn keel_prompts_score_as_replayed_on_real_runs() {
    let Some(dir) = data() else { return };
    let tau = load_tau_bench(&dir.join("tau-bench/gpt-4o-airline.json")).unwrap();
    let swe = load_swe_agent_dir(&dir.join("swe-agent")).unwrap();
    let runs = tau
        .into_iter()
        .filter(|t| t.messages.len() >= 40)
        .take(6)
        .chain(swe.into_iter().take(6));
    for t in runs {
        for strategy in [Strategy::Hierarchical, Strategy::masking()] {
            let (keel, scored) = both_ways(&t, &ReplayConfig::new(8_000, strategy)).await;
            assert_same(&keel, &scored, 8_000);
            let full = score_prompts(&t, &full_history(&t), counter()).unwrap();
            let r = Report::from_runs("d", "full", 8_000, &[full]);
            assert_eq!((r.token_reduction(), r.recall()), (0.0, 1.0), "{}", t.id);
        }
    }
}
