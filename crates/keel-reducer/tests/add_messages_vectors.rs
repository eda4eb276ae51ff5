//! Differential conformance: replays LangGraph's own `add_messages` results
//! (`tests/vectors/add_messages.json`, made by `cargo xtask gen-vectors`) through keel's
//! `AddMessages` and requires the same result: order, ids, content, types, tool calls,
//! or the same error.
//!
//! Ids LangGraph made up at random are recorded as `generated_id` with the input
//! message they belong to; keel's output must carry, at that position, the id keel gave
//! the same input message, and generated ids must be non-empty and unique.
//!
//! Cases where keel deliberately differs are listed in [`KEEL_DIFFERS`] and checked
//! against keel's documented behaviour instead (see the crate docs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;

use keel_message::{Message, langchain};
use keel_reducer::{AddMessages, AddMessagesUpdate, MessageOp, Messages, ReduceError, Reducer};
use serde_json::Value;

const VECTORS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/vectors/add_messages.json"
);
const MIN_CASES: usize = 200;

/// Cases where keel does not do what LangGraph does, on purpose, with what keel does
/// instead. Every case named `divergent-*` must be here, and nothing else.
const KEEL_DIFFERS: &[(&str, KeelResult)] = &[
    // LangGraph keeps both messages with id `b` after a remove-all; keel's ids are
    // unique, so the second replaces the first in place.
    (
        "divergent-duplicate-ids-after-remove-all",
        KeelResult::Texts(&[("b", "two")]),
    ),
    // LangGraph stores the RemoveMessage itself in the state; keel applies it.
    (
        "divergent-remove-after-remove-all-added",
        KeelResult::Texts(&[]),
    ),
    // LangGraph stores the RemoveMessage in the state; for keel, `1` is gone after the
    // remove-all, so removing it is an unknown id.
    (
        "divergent-remove-after-remove-all-unknown",
        KeelResult::UnknownId("1"),
    ),
];

#[derive(Debug, Clone, Copy)]
enum KeelResult {
    /// The history as (id, text) pairs.
    Texts(&'static [(&'static str, &'static str)]),
    /// `ReduceError::UnknownMessageId`.
    UnknownId(&'static str),
}

struct Case {
    name: String,
    left: Vec<Value>,
    right: Vec<Value>,
    expected: Value,
}

fn load() -> (Value, Vec<Case>) {
    let text = std::fs::read_to_string(VECTORS).unwrap_or_else(|e| {
        panic!("cannot read {VECTORS} ({e}); regenerate it with `cargo xtask gen-vectors`")
    });
    let file: Value = serde_json::from_str(&text).expect("vector file is JSON");
    let cases = file["cases"]
        .as_array()
        .expect("`cases` is a list")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("case name").to_owned(),
            left: c["left"].as_array().expect("left").clone(),
            right: c["right"].as_array().expect("right").clone(),
            expected: c["expected"].clone(),
        })
        .collect();
    (file, cases)
}

/// What keel did with one case, and the ids it gave each input message.
struct Run {
    result: Result<Messages, ReduceError>,
    before: Messages,
    left_ids: Vec<String>,
    right_ids: Vec<Option<String>>,
}

fn run(case: &Case) -> Run {
    let left = langchain::from_values(&case.left)
        .unwrap_or_else(|e| panic!("{}: importing left: {e}", case.name));
    let state = AddMessages
        .apply(Messages::new(), AddMessagesUpdate::append(left))
        .unwrap_or_else(|e| panic!("{}: building the state: {e}", case.name));
    assert_eq!(
        state.len(),
        case.left.len(),
        "{}: left ids are unique",
        case.name
    );
    let left_ids = state.iter().map(|m| m.id.clone().unwrap()).collect();
    let update = AddMessagesUpdate::from_langchain(&case.right)
        .unwrap_or_else(|e| panic!("{}: importing right: {e}", case.name));
    let right_ids = update
        .ops()
        .iter()
        .map(|op| match op {
            MessageOp::Upsert(m) => m.id.clone(),
            _ => None,
        })
        .collect();
    let mut after = state.clone();
    let result = AddMessages.reduce(&mut after, vec![update]).map(|()| after);
    Run {
        result,
        before: state,
        left_ids,
        right_ids,
    }
}

/// The output LangGraph recorded, with the ids it generated replaced by the ids keel
/// gave the same input messages.
fn expected_messages(case: &Case, run: &Run, entries: &[Value]) -> Vec<Message> {
    entries
        .iter()
        .map(|e| {
            let mut m = langchain::from_value(&e["message"])
                .unwrap_or_else(|err| panic!("{}: importing expected: {err}", case.name));
            if e["generated_id"].as_bool().unwrap() {
                let i = e["index"].as_u64().unwrap() as usize;
                let id = match e["from"].as_str().unwrap() {
                    "left" => run.left_ids[i].clone(),
                    "right" => run.right_ids[i].clone().unwrap(),
                    other => panic!("{}: bad `from` {other}", case.name),
                };
                assert!(m.id.is_none(), "{}: generated id recorded", case.name);
                m.id = Some(id);
            }
            m
        })
        .collect()
}

/// Compares keel with LangGraph on one case; `Err` describes the difference.
fn compare(case: &Case, run: &Run) -> Result<(), String> {
    if let Some(err) = case.expected.get("error") {
        assert_eq!(err["kind"], "unknown_message_id", "{}", case.name);
        let want = ReduceError::UnknownMessageId {
            id: err["id"].as_str().unwrap().to_owned(),
        };
        return match &run.result {
            Err(e) if *e == want => Ok(()),
            other => Err(format!("LangGraph: {want:?}; keel: {other:?}")),
        };
    }
    let entries = case.expected["ok"].as_array().unwrap();
    if entries.iter().any(|e| e["message"]["type"] == "remove") {
        return Err("LangGraph stored a RemoveMessage in the state".into());
    }
    let want = expected_messages(case, run, entries);
    match &run.result {
        Ok(got) if got.as_slice() == want.as_slice() => Ok(()),
        Ok(got) => Err(format!("LangGraph: {want:#?}\nkeel: {got:#?}")),
        Err(e) => Err(format!("LangGraph: {want:#?}\nkeel failed: {e}")),
    }
}

fn check_keel_behaviour(case: &Case, run: &Run, keel: KeelResult) {
    match (keel, &run.result) {
        (KeelResult::Texts(want), Ok(got)) => {
            let got: Vec<(String, String)> = got
                .iter()
                .map(|m| (m.id.clone().unwrap(), m.text().into_owned()))
                .collect();
            let want: Vec<(String, String)> = want
                .iter()
                .map(|(id, t)| ((*id).to_owned(), (*t).to_owned()))
                .collect();
            assert_eq!(got, want, "{}", case.name);
        }
        (KeelResult::UnknownId(id), Err(e)) => {
            assert_eq!(
                *e,
                ReduceError::UnknownMessageId { id: id.to_owned() },
                "{}",
                case.name
            );
        }
        (want, got) => panic!("{}: keel should give {want:?}, gave {got:?}", case.name),
    }
}

#[test]
fn keel_matches_langgraph_add_messages() {
    let (file, cases) = load();
    assert!(
        cases.len() >= MIN_CASES,
        "{VECTORS} has {} cases, fewer than {MIN_CASES}; regenerate with `cargo xtask gen-vectors`",
        cases.len()
    );
    assert!(
        file["langgraph"].is_string(),
        "the file names its LangGraph version"
    );

    let names: HashSet<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    for (name, _) in KEEL_DIFFERS {
        assert!(
            names.contains(name),
            "listed difference `{name}` has no case"
        );
    }

    let mut failures = Vec::new();
    let (mut errors, mut generated) = (0, 0);
    for case in &cases {
        let run = run(case);
        let differs = KEEL_DIFFERS.iter().find(|(n, _)| *n == case.name);
        assert_eq!(
            differs.is_some(),
            case.name.starts_with("divergent-"),
            "{}: every divergent-* case, and only those, is listed in KEEL_DIFFERS",
            case.name
        );
        let outcome = compare(case, &run);
        if let Some((_, keel)) = differs {
            assert!(
                outcome.is_err(),
                "{}: listed as a difference but keel matches LangGraph",
                case.name
            );
            check_keel_behaviour(case, &run, *keel);
        } else if let Err(diff) = outcome {
            failures.push(format!("case `{}`:\n{diff}", case.name));
        }

        match &run.result {
            Err(_) => errors += 1,
            Ok(out) => {
                let ids: Vec<&str> = out.iter().map(|m| m.id.as_deref().unwrap()).collect();
                assert!(
                    ids.iter().all(|id| !id.is_empty()),
                    "{}: empty id",
                    case.name
                );
                let unique: HashSet<&&str> = ids.iter().collect();
                assert_eq!(unique.len(), ids.len(), "{}: ids are unique", case.name);
                generated += out
                    .iter()
                    .filter(|m| {
                        let id = m.id.as_deref().unwrap();
                        !case.left.iter().chain(&case.right).any(|d| d["id"] == id)
                    })
                    .count();
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from LangGraph:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
    // The vectors exercise both outcomes and generated ids, not only the easy path.
    assert!(errors >= 10, "only {errors} error cases");
    assert!(generated >= 50, "only {generated} generated ids checked");
}

/// On an error, keel leaves the state untouched (LangGraph's caller gets no result).
#[test]
fn failing_cases_leave_the_state_unchanged() {
    let (_, cases) = load();
    let mut checked = 0;
    for case in cases.iter().filter(|c| c.expected.get("error").is_some()) {
        let run = run(case);
        let mut state = run.before.clone();
        let update = AddMessagesUpdate::from_langchain(&case.right).unwrap();
        assert!(AddMessages.reduce(&mut state, vec![update]).is_err());
        assert_eq!(state, run.before, "{}", case.name);
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} error cases");
}
