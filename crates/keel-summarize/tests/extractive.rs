//! ExtractiveSummarizer: what it keeps, budgets, determinism, goal refusal, real data.

use std::path::PathBuf;

use keel_message::{Message, ToolCall, openai};
use keel_summarize::{
    ARTIFACTS, ExtractiveSummarizer, GOAL_METADATA_KEY, NEXT_STEPS, SECTIONS, SESSION_INTENT,
    SUMMARY, SummarizeError, Summarizer, Summary, SummaryRequest, parse_sections,
};
use keel_token::{ApproxCounter, TokenCounter};
use serde_json::{Value, json};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data")
}

/// Every trajectory in the shared data folder as messages, or `None` when absent.
fn trajectories() -> Option<Vec<Vec<Message>>> {
    let dir = data_dir();
    let tau = std::fs::read(dir.join("tau-bench/gpt-4o-airline.json")).ok()?;
    let runs: Vec<Value> = serde_json::from_slice(&tau).ok()?;
    let mut out: Vec<Vec<Message>> = runs
        .iter()
        .filter_map(|r| openai::from_values(r["traj"].as_array()?).ok())
        .collect();
    let mut swe: Vec<PathBuf> = std::fs::read_dir(dir.join("swe-agent"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "traj"))
        .collect();
    swe.sort();
    for path in swe {
        let v: Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        let history = v["history"].as_array()?;
        out.push(
            history
                .iter()
                .filter_map(|m| openai::from_value(m).ok())
                .collect(),
        );
    }
    Some(out)
}

#[allow(clippy::unwrap_used)]
fn run(messages: &[Message], budget: usize) -> Summary {
    ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::milestone(messages, budget))
        .unwrap()
}

fn debugging_session() -> Vec<Message> {
    vec![
        Message::system("You are a coding agent. SECRET-SYSTEM-TEXT"),
        Message::user("Tests in the auth module fail since yesterday.\nPlease fix them."),
        Message::assistant("I will run the test suite first.").with_tool_calls(vec![
            ToolCall::new(
                "c1",
                "bash",
                json!({"command": "pytest tests/test_auth.py -q"}),
            ),
        ]),
        Message::tool(
            "c1",
            "..F.\n=== FAILURES ===\nE   AssertionError: expected 200, got 401\ntests/test_auth.py:42: AssertionError\n1 failed, 3 passed in 0.12s\nexit code 1",
        ),
        Message::assistant(
            "The token check uses the wrong header because the middleware was renamed.\nLet me look at it.\n```\nopen src/auth/middleware.py\n```",
        ),
        Message::user(
            "[file src/auth/middleware.py, 120 lines]\n40: def check(request):\n41:     token = request.headers.get('X-Token')",
        ),
        Message::assistant(
            "I'll change the header name to Authorization.\nNext step: rerun the tests.",
        )
        .with_tool_calls(vec![ToolCall::new(
            "c2",
            "edit",
            json!({"path": "src/auth/middleware.py", "line": 41}),
        )]),
    ]
}

#[test]
fn a_call_id_used_again_in_a_later_turn_is_its_own_call() {
    // Servers that number each reply's calls give both calls the id `call_0`: the
    // first one's result does not answer the second, which is still pending.
    let mut session = debugging_session();
    for m in &mut session {
        for c in &mut m.tool_calls {
            c.id = "call_0".to_owned();
        }
        if m.tool_call_id.is_some() {
            m.tool_call_id = Some("call_0".to_owned());
        }
    }
    let s = run(&session, 400);
    let next = s.section(NEXT_STEPS).unwrap();
    assert!(
        next.iter().any(|l| l.starts_with("edit(")),
        "the unanswered call is pending: {next:?}"
    );
    let artifacts = s.section(ARTIFACTS).unwrap();
    assert!(
        artifacts
            .iter()
            .any(|l| l.contains("pytest tests/test_auth.py -q")),
        "the answered call heads its output: {artifacts:?}"
    );
}

#[test]
fn an_item_a_known_summary_has_word_for_word_is_not_said_again() {
    let alone = run(&debugging_session(), 400);
    let summary = alone.section(SUMMARY).unwrap();
    let banner = "=== FAILURES === E   AssertionError: expected 200, got 401";
    assert!(summary.iter().any(|l| l == banner), "{summary:?}");
    // An earlier summary that stays in the prompt already says it.
    let earlier = format!("SUMMARY:\n- {banner}\n");
    let known = [earlier.as_str()];
    let s = ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::milestone(&debugging_session(), 400).known(&known))
        .unwrap();
    assert!(!s.text.contains(banner), "{}", s.text);
    // Everything else is still there.
    let next = s.section(NEXT_STEPS).unwrap();
    assert!(next.iter().any(|l| l.starts_with("edit(")), "{next:?}");
}

#[test]
fn keeps_the_lines_that_carry_signal_in_four_sections() {
    let s = run(&debugging_session(), 400);
    assert_eq!(
        s.sections
            .iter()
            .map(|s| s.title.as_str())
            .collect::<Vec<_>>(),
        SECTIONS
    );
    let intent = s.section(SESSION_INTENT).unwrap();
    assert_eq!(intent[0], "Tests in the auth module fail since yesterday.");
    let summary = s.section(SUMMARY).unwrap();
    assert!(
        summary
            .iter()
            .any(|l| l == "=== FAILURES === E   AssertionError: expected 200, got 401"),
        "the banner takes the failure after it: {summary:?}"
    );
    assert!(
        summary
            .iter()
            .any(|l| l.contains("because the middleware was renamed"))
    );
    let artifacts = s.section(ARTIFACTS).unwrap();
    assert!(
        artifacts
            .iter()
            .any(|l| l.contains("pytest tests/test_auth.py -q")),
        "{artifacts:?}"
    );
    assert!(artifacts.iter().any(|l| l == "exit code 1"));
    assert!(
        artifacts
            .iter()
            .any(|l| l.starts_with("open src/auth/middleware.py")),
        "fenced command: {artifacts:?}"
    );
    assert!(
        artifacts
            .iter()
            .any(|l| l == "files read: tests/test_auth.py, src/auth/middleware.py"),
        "files: {artifacts:?}"
    );
    let next = s.section(NEXT_STEPS).unwrap();
    assert!(
        next.iter().any(|l| l.starts_with("edit(")),
        "the unanswered call is pending: {next:?}"
    );
    assert!(next.iter().any(|l| l == "Next step: rerun the tests."));
    assert!(
        !s.text.contains("SECRET-SYSTEM-TEXT"),
        "system messages are skipped"
    );
    assert_eq!(s.prompt_version, "extractive-v1");
    assert_eq!(s.model, "extractive");
    assert_eq!(s.usage, None);
    // The text parses back into the same sections.
    assert_eq!(parse_sections(&s.text).len(), 4);
}

#[test]
fn short_budgets_keep_the_most_important_lines_and_always_fit() {
    let counter = ApproxCounter::new();
    let msgs = debugging_session();
    let mut previous_len = 0;
    for budget in [40, 60, 80, 120, 200, 400, 1000] {
        let s = run(&msgs, budget);
        assert!(
            counter.count_text(&s.text) <= budget,
            "budget {budget}: {}",
            s.text
        );
        assert!(
            s.text.len() >= previous_len,
            "a larger budget never keeps less"
        );
        previous_len = s.text.len();
    }
    // Pending work survives the tightest budgets.
    let tight = run(&msgs, 60);
    assert!(
        !tight.section(NEXT_STEPS).unwrap().is_empty(),
        "{}",
        tight.text
    );
    assert!(matches!(
        ExtractiveSummarizer::new().summarize_sync(&SummaryRequest::milestone(&msgs, 5)),
        Err(SummarizeError::BudgetTooSmall { .. })
    ));
}

#[test]
fn output_is_deterministic_and_in_input_order() {
    let msgs = debugging_session();
    let a = run(&msgs, 300);
    let b = run(&msgs, 300);
    assert_eq!(a, b);
    let summary = a.section(SUMMARY).unwrap();
    let pos = |needle: &str| summary.iter().position(|l| l.contains(needle));
    let (first, second) = (
        pos("AssertionError: expected"),
        pos("middleware was renamed"),
    );
    assert!(first.is_some() && second.is_some(), "{}", a.text);
    assert!(first < second, "{}", a.text);
}

#[test]
fn the_goal_anchor_is_refused() {
    let mut msgs = debugging_session();
    msgs.push(Message::user("GOAL: fix auth").with_metadata(GOAL_METADATA_KEY, json!("anchor")));
    let err = ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::milestone(&msgs, 200))
        .unwrap_err();
    assert!(
        matches!(err, SummarizeError::GoalInInput { index: 7 }),
        "{err:?}"
    );
    assert!(matches!(
        ExtractiveSummarizer::new().summarize_sync(&SummaryRequest::milestone(&[], 200)),
        Err(SummarizeError::EmptyInput)
    ));
}

#[test]
fn epoch_merges_milestones_and_the_previous_epoch() {
    let m1 = run(&debugging_session(), 400).text;
    let m2 = "SESSION INTENT:\n- none\nSUMMARY:\n- All 4 tests passed after the header fix\nARTIFACTS:\n- src/auth/middleware.py\nNEXT STEPS:\n- open a pull request\n";
    let previous =
        "SUMMARY:\n- Cloned the repository\n- error: flaky network in CI remains unresolved\n";
    let notes = [Message::assistant(m1), Message::assistant(m2)];
    let s = ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::epoch(&notes, 400).previous(previous))
        .unwrap();
    let summary = s.section(SUMMARY).unwrap();
    assert!(
        summary
            .iter()
            .any(|l| l == "All 4 tests passed after the header fix")
    );
    assert!(
        summary
            .iter()
            .any(|l| l == "error: flaky network in CI remains unresolved")
    );
    assert!(
        s.section(NEXT_STEPS)
            .unwrap()
            .iter()
            .any(|l| l == "open a pull request")
    );
    assert_eq!(
        s.section(ARTIFACTS)
            .unwrap()
            .iter()
            .filter(|l| *l == "src/auth/middleware.py")
            .count(),
        1,
        "duplicates are kept once"
    );
    // Under a tight budget, errors (newest first) outrank old plain facts.
    let tight = ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::epoch(&notes, 70).previous(previous))
        .unwrap();
    assert!(
        !tight.text.contains("Cloned the repository"),
        "{}",
        tight.text
    );
    assert!(
        tight
            .section(SUMMARY)
            .unwrap()
            .iter()
            .any(|l| l.contains("AssertionError")),
        "{}",
        tight.text
    );
    // With a little more room the older unresolved error is kept too, still not the
    // old plain fact.
    let roomier = ExtractiveSummarizer::new()
        .summarize_sync(&SummaryRequest::epoch(&notes, 160).previous(previous))
        .unwrap();
    assert!(roomier.text.contains("flaky network"), "{}", roomier.text);
}

#[test]
fn long_lines_are_cut_around_their_keyword() {
    let line = format!(
        "{{\"log\": \"{}\", \"status\": \"Error: quota exceeded for project 7\", \"tail\": \"{}\"}}",
        "a".repeat(2_000),
        "b".repeat(2_000)
    );
    let s = run(
        &[Message::user("check the job"), Message::tool("c1", line)],
        300,
    );
    let hit = s
        .section(SUMMARY)
        .unwrap()
        .iter()
        .find(|l| l.contains("Error: quota exceeded"))
        .cloned()
        .unwrap();
    assert!(hit.chars().count() <= 240, "{hit}");
}

#[tokio::test]
async fn works_through_the_trait_object() {
    let summarizer: Box<dyn Summarizer> = Box::new(ExtractiveSummarizer::new());
    let msgs = debugging_session();
    let s = summarizer
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap();
    assert_eq!(s, run(&msgs, 200));
}

#[test]
fn real_trajectories_fit_their_budgets_and_keep_the_users_ask() {
    let Some(runs) = trajectories() else {
        eprintln!("skipped: ../shared/data not found (it is present in CI only)");
        return;
    };
    let counter = ApproxCounter::new();
    let summarizer = ExtractiveSummarizer::new();
    assert!(runs.len() > 200, "{} trajectories", runs.len());
    for (i, run) in runs.iter().enumerate() {
        if run.is_empty() {
            continue;
        }
        for budget in [150, 600] {
            let s = summarizer
                .summarize_sync(&SummaryRequest::milestone(run, budget))
                .unwrap();
            assert!(
                counter.count_text(&s.text) <= budget,
                "run {i} budget {budget}"
            );
            let has_user = run
                .iter()
                .any(|m| m.role == keel_message::Role::User && !m.text().trim().is_empty());
            if has_user && budget == 600 {
                assert!(!s.section(SESSION_INTENT).unwrap().is_empty(), "run {i}");
            }
        }
    }
}

fn items<'s>(s: &'s Summary, title: &str) -> &'s [String] {
    s.section(title).unwrap_or_default()
}

#[test]
fn errors_keep_their_message_and_plain_failures_count() {
    let msgs = [
        Message::user("Deploy the service."),
        Message::assistant("").with_tool_calls(vec![
            ToolCall::new("c1", "deploy", json!({"env": "prod"})),
            ToolCall::new("c2", "sh", json!({"cmd": "ls -l logs"})),
        ]),
        Message::tool(
            "c1",
            "step 1 ok\nERROR:\nconnection refused by db-7 on port 5432\nrolled back",
        ),
        Message::tool(
            "c2",
            "-rw-r--r-- 1 app app 120 Jan 1 12:00 error_report.txt\n-rw-r--r-- 1 app app 80 Jan 1 12:01 access.log",
        ),
        Message::assistant("").with_tool_calls(vec![ToolCall::new("c3", "status", json!({}))]),
        Message::tool(
            "c3",
            "HTTP 503 Service Unavailable from api.internal (incident INC-77341)",
        ),
    ];
    let s = run(&msgs, 400);
    let summary = items(&s, SUMMARY);
    assert!(
        summary
            .iter()
            .any(|l| l.starts_with("ERROR: connection refused by db-7 on port 5432")),
        "the header takes its message: {summary:?}"
    );
    assert!(
        summary
            .iter()
            .any(|l| l.contains("HTTP 503") && l.contains("INC-77341")),
        "a plain failure is an error: {summary:?}"
    );
    assert!(
        !summary.iter().any(|l| l.contains("error_report.txt")),
        "a file named error is not an error: {summary:?}"
    );
}

#[test]
fn facts_files_and_the_next_step_are_kept() {
    let msgs = [
        Message::user("Refund order ORD-4411 to the card on file."),
        Message::assistant("Looking the order up.").with_tool_calls(vec![ToolCall::new(
            "c1",
            "get_order",
            json!({"order_id": "ORD-4411"}),
        )]),
        Message::tool(
            "c1",
            r#"{"order_id": "ORD-4411", "status": "delivered", "items": [{"sku": "SKU-31337", "price": 1299}], "payment": "card_8812", "email": "alice@example.com", "placed": "2024-05-02T10:11:12"}"#,
        ),
        Message::assistant("").with_tool_calls(vec![
            ToolCall::new("c2", "read_file", json!({"path": "config/refunds.yaml"})),
            ToolCall::new(
                "c3",
                "write_file",
                json!({"path": "out/refund.parquet", "data": "x"}),
            ),
        ]),
        Message::tool("c2", "limit: 5000"),
        Message::tool("c3", "written"),
        Message::assistant(
            "The refund is within the limit. Next, I'll issue the refund to card_8812.",
        ),
    ];
    let s = run(&msgs, 300);
    let artifacts = items(&s, ARTIFACTS);
    let facts = artifacts
        .iter()
        .find(|l| l.starts_with("get_order(ORD-4411) →"))
        .unwrap_or_else(|| panic!("a facts line: {artifacts:?}"));
    for id in ["SKU-31337", "price=1299", "alice@example.com"] {
        assert!(facts.contains(id), "{id} in {facts}");
    }
    // Kept once: the next step already names the card.
    assert!(!facts.contains("card_8812"), "{facts}");
    assert_eq!(s.text.matches("card_8812").count(), 1, "{}", s.text);
    assert!(
        !facts.contains("2024-05-02T10"),
        "timestamps are left out: {facts}"
    );
    assert!(
        artifacts
            .iter()
            .any(|l| l == "files read: config/refunds.yaml; files changed: out/refund.parquet"),
        "paths of any extension: {artifacts:?}"
    );
    assert_eq!(
        items(&s, NEXT_STEPS),
        ["Next, I'll issue the refund to card_8812."]
    );
}

#[test]
fn numbered_listings_are_code_and_observations_are_not_intent() {
    let mut observation = Message::user(
        "[File: /repo/app/errors.py (3 lines total)]\n1:class ValidationError(Exception):\n2:    raise ValueError('bad input')\n3:    # error handling\n     4\tlog.error('failed')\n",
    );
    observation
        .metadata
        .insert("keel.observation".into(), json!(true));
    let msgs = [
        Message::user("Make validation errors readable."),
        Message::assistant("Let me open the module.\n```\nopen app/errors.py\n```"),
        observation,
        Message::assistant("Now let's edit line 2.\n```\nedit 2:2\n```"),
    ];
    let s = run(&msgs, 300);
    assert_eq!(
        items(&s, SESSION_INTENT),
        ["Make validation errors readable."]
    );
    assert!(
        items(&s, SUMMARY).is_empty(),
        "code is not prose or errors: {}",
        s.text
    );
    assert!(
        items(&s, ARTIFACTS)
            .iter()
            .any(|l| l.contains("open app/errors.py") && !l.contains("'bad input'")),
        "{}",
        s.text
    );
    assert_eq!(items(&s, NEXT_STEPS)[0], "edit 2:2");
}

#[test]
fn a_high_priority_item_over_its_share_is_not_displaced() {
    // A long first request against many small reservation codes: at a small budget the
    // request (over the intent share on its own) still wins over the codes.
    let ask = "I need to change my flight back from Denver to Houston to the quickest one on May 27, keeping my seat and bags";
    let mut msgs = vec![Message::user(ask)];
    for k in 0..12 {
        let id = format!("c{k}");
        msgs.push(Message::assistant("").with_tool_calls(vec![ToolCall::new(
            &id,
            "get_reservation_details",
            json!({"reservation_id": format!("R{k:05}")}),
        )]));
        msgs.push(Message::tool(&id, format!("{{\"flight\": \"HAT{k:03}\"}}")));
    }
    let s = run(&msgs, 80);
    assert_eq!(items(&s, SESSION_INTENT), [ask], "{}", s.text);
}

/// A span over `BLOCKING_POOL_BYTES` is summarized off the runtime: on a current-thread
/// runtime another task keeps running while it is; a small span is summarized inline
/// (nothing else runs, and nothing is copied).
#[test]
fn a_large_span_is_summarized_while_a_current_thread_runtime_serves_other_tasks() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let big: Vec<Message> = (0..12)
        .map(|i| {
            let line = format!("row {i}: the build step compiled module m{i} with warnings\n");
            Message::tool(format!("call_{i}"), line.repeat(25_000 / line.len() * 4))
        })
        .collect();
    let bytes: usize = big.iter().map(|m| m.text().len()).sum();
    assert!(bytes > keel_summarize::BLOCKING_POOL_BYTES, "{bytes}");
    let small = vec![
        Message::user("Summarize the build."),
        Message::assistant("Done."),
    ];
    for (span, expect_others) in [(&big, true), (&small, false)] {
        let ticks = Arc::new(AtomicU64::new(0));
        let summary = runtime.block_on(async {
            let t = ticks.clone();
            let ticker = tokio::spawn(async move {
                loop {
                    t.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                }
            });
            let request = SummaryRequest::milestone(span, 400);
            let summary = ExtractiveSummarizer::new().summarize(&request).await;
            let during = ticks.load(Ordering::Relaxed);
            ticker.abort();
            summary.map(|s| (s, during))
        });
        let (summary, during) = summary.unwrap();
        assert!(!summary.text.is_empty());
        assert_eq!(
            during > 0,
            expect_others,
            "ticks while summarizing: {during}"
        );
    }
}

#[test]
fn paths_of_failed_calls_are_not_files_read_or_changed() {
    let call = |id: &str, name: &str, path: &str| {
        Message::assistant("").with_tool_calls(vec![ToolCall::new(id, name, json!({"path": path}))])
    };
    let messages = vec![
        Message::user("Survey src/ and fix the config."),
        call("c1", "read_file", "src/missing.rs"),
        Message::tool("c1", "Error: src/missing.rs does not exist"),
        call("c2", "read_file", "src/lib.rs"),
        Message::tool("c2", "pub fn run() {}"),
        call("c3", "write_file", "config/app.toml"),
        Message::tool("c3", "error: permission denied"),
        call("c4", "write_file", "config/new.toml"),
        Message::tool("c4", "wrote 12 bytes"),
    ];
    let s = run(&messages, 400);
    let artifacts = s.section(ARTIFACTS).unwrap();
    assert!(
        artifacts
            .iter()
            .any(|l| l == "files read: src/lib.rs; files changed: config/new.toml"),
        "{artifacts:?}"
    );
}

#[test]
fn a_failed_call_is_listed_as_failed_not_with_the_names_in_its_error() {
    let call = |id: &str, path: &str| {
        Message::assistant("").with_tool_calls(vec![ToolCall::new(
            id,
            "read_file",
            json!({"path": path}),
        )])
    };
    let session = vec![
        Message::user("Find where StateGraph is defined."),
        call("c1", "state_graph.txt"),
        Message::tool(
            "c1",
            "Error: state_graph.txt does not exist; use ls to see what is there.",
        ),
        call("c2", "src/graph.rs"),
        Message::tool(
            "c2",
            "     1\tpub struct StateGraph {\n     2\t    nodes: Vec<Node>,\n[end of file: 2 lines]",
        ),
        call("c3", "src/grep_me.rs"),
        // Matches that mention errors are no failure.
        Message::tool(
            "c3",
            "src/lib.rs:12: return Err(Error::NotFound)\nsrc/lib.rs:40: fn failed()",
        ),
    ];
    let s = run(&session, 400);
    let artifacts = s.section(ARTIFACTS).unwrap();
    let item = |arg: &str| {
        artifacts
            .iter()
            .find(|l| l.contains(arg))
            .unwrap_or_else(|| panic!("{arg}: {artifacts:?}"))
            .clone()
    };
    let failed = item("state_graph.txt");
    assert!(failed.ends_with("→ failed"), "{artifacts:?}");
    assert!(!item("src/graph.rs").contains("failed"), "{artifacts:?}");
    assert!(!item("grep_me").ends_with("→ failed"), "{artifacts:?}");
}
