//! Eval 3, `intent-and-next-steps`: the user's ask and the agent's stated next step
//! survive a structured summary — the LLM summarizer's four sections (SESSION INTENT,
//! SUMMARY, ARTIFACTS, NEXT STEPS) and the extractive summarizer's equivalent.
//!
//! A user asks, mid-thread, for an audit of a chain ("Please audit the key chain of
//! the billing-eu service ..."); the reader walks it, saying before each call which
//! key it will visit next. Compaction is forced often. For each summarizer, four
//! checks on the summaries the agent's prompts held:
//!
//! 1. the first milestone's SESSION INTENT holds the ask;
//! 2. its NEXT STEPS names the key the agent last said it would visit in that span (or
//!    the one after it, which its result named);
//! 3. the first epoch's SESSION INTENT still holds the ask;
//! 4. the first epoch's NEXT STEPS names a key to visit.
//!
//! Offline, the LLM summarizer (structured prompt `structured-v1`) runs over a
//! scripted summarizer model that can only copy from the prompt it is sent: if the
//! summarizer's input fitting dropped the ask or the last stated step, the copy cannot
//! hold it. With `--live`, a real model writes those summaries; a summary it cannot
//! write in shape fails the compaction and so the checks.
//!
//! It fails if a summarizer leaves out the ask or the next step, if the sections do
//! not parse, or if the epoch fold drops what the milestone kept.

use std::sync::Arc;

use keel_agent::AgentInput;
use keel_checkpoint::MemorySaver;
use keel_message::Message;
use keel_model::{ChatModel, ChatResponse, PolicyModel};
use keel_summarize::{
    LlmSummarizer, NEXT_STEPS, SESSION_INTENT, Summarizer, SummaryFormat, parse_sections,
};

use crate::live::{Live, Recorded};
use crate::world::{self, Recorder, Turn, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "intent-and-next-steps";
/// Records in the chain (offline).
pub const LEN: usize = 24;
/// Records in the chain with a live summarizer (each summary is a slow model call).
pub const LIVE_LEN: usize = 10;
/// The distinctive part of the user's ask.
pub const ASK_CORE: &str = "audit the key chain of the billing-eu service";
const GOAL: &str = "Work through the user's requests one at a time.";

fn ask() -> String {
    "Please audit the key chain of the billing-eu service and note each record's owner. Start at key K-0000.".to_owned()
}

/// A summarizer model that writes the four sections by copying from its prompt: the
/// user's asks (or, for notes, their SESSION INTENT items), the keys it saw, and the
/// last stated next step (or the notes' last NEXT STEPS items).
pub fn copying_summarizer() -> PolicyModel {
    PolicyModel::new("copying-summarizer", |prompt, _tools| {
        let input = prompt
            .last()
            .map(|m| m.text().into_owned())
            .unwrap_or_default();
        let notes = input.contains("Milestone notes to summarize");
        let mut intent: Vec<String> = Vec::new();
        let mut next: Vec<String> = Vec::new();
        let mut keys: Vec<String> = Vec::new();
        let mut section = "";
        for line in input.lines() {
            let t = line.trim();
            for word in t.split(|c: char| !(c.is_alphanumeric() || c == '-')) {
                if word.len() == 6
                    && world::index(word).is_some()
                    && !keys.iter().any(|k| k == word)
                {
                    keys.push(word.to_owned());
                }
            }
            if notes {
                if let Some(h) = t
                    .strip_suffix(':')
                    .filter(|h| h.chars().all(|c| c.is_ascii_uppercase() || c == ' '))
                {
                    section = if h == SESSION_INTENT || h == NEXT_STEPS {
                        h
                    } else {
                        ""
                    };
                    if h == NEXT_STEPS {
                        next.clear();
                    }
                    continue;
                }
                if let Some(item) = t.strip_prefix("- ") {
                    let list = match section {
                        SESSION_INTENT => &mut intent,
                        NEXT_STEPS => &mut next,
                        _ => continue,
                    };
                    if !list.iter().any(|i| i == item) {
                        list.push(item.to_owned());
                    }
                }
            } else if let Some((_, rest)) = t.split_once("] user: ") {
                if !rest.starts_with("[Milestone") && !intent.iter().any(|i| i == rest) {
                    intent.push(rest.to_owned());
                }
            } else if let Some((_, rest)) = t.split_once("] assistant: ")
                && rest.starts_with("Next ")
            {
                next = vec![rest.to_owned()];
            }
        }
        let list = |items: &[String]| {
            if items.is_empty() {
                "- none\n".to_owned()
            } else {
                items.iter().map(|i| format!("- {i}\n")).collect()
            }
        };
        let visited = match (keys.first(), keys.last()) {
            (Some(a), Some(b)) => vec![format!("visited records {a} to {b}")],
            _ => Vec::new(),
        };
        let text = format!(
            "SESSION INTENT:\n{}SUMMARY:\n{}ARTIFACTS:\n- none\nNEXT STEPS:\n{}",
            list(&intent),
            list(&visited),
            list(&next)
        );
        Ok(ChatResponse::new(
            Message::assistant(text),
            "copying-summarizer",
        ))
    })
}

/// The first summary of `layer` kind in any prompt, with the turn it first appeared in.
fn first_layer(turns: &[Turn], layer: &str) -> Option<(usize, String)> {
    turns.iter().enumerate().find_map(|(i, t)| {
        t.layer_texts()
            .into_iter()
            .find(|(kind, _)| kind == layer)
            .map(|(_, text)| (i, text))
    })
}

fn section(text: &str, title: &str) -> Vec<String> {
    parse_sections(text)
        .into_iter()
        .filter(|s| s.title == title)
        .flat_map(|s| s.items)
        .collect()
}

/// The key of the first visit in the raw tail of turn `i`'s prompt.
fn first_raw_visit(turn: &Turn) -> Option<usize> {
    turn.prompt.iter().find_map(|m| {
        let calls = m[3].as_array()?;
        let call = calls.first()?.as_str()?;
        let start = call.find("K-")?;
        world::index(call.get(start..start + 6)?)
    })
}

struct Checks {
    passed: usize,
    notes: Vec<String>,
}

fn check(turns: &[Turn], who: &str) -> Checks {
    let mut c = Checks {
        passed: 0,
        notes: Vec::new(),
    };
    let mut ok = |good: bool, what: &str| {
        if good {
            c.passed += 1;
        } else {
            c.notes.push(format!("{who}: {what}"));
        }
    };
    match first_layer(turns, "milestone") {
        Some((i, text)) => {
            let intent = section(&text, SESSION_INTENT);
            ok(
                intent.iter().any(|s| s.contains(ASK_CORE)),
                "the first milestone's SESSION INTENT lacks the ask",
            );
            let next = section(&text, NEXT_STEPS);
            let wanted: Vec<String> = first_raw_visit(&turns[i])
                .map(|t| vec![world::key(t.saturating_sub(1)), world::key(t)])
                .unwrap_or_default();
            ok(
                next.iter()
                    .any(|s| s.contains("visit") && wanted.iter().any(|k| s.contains(k.as_str()))),
                &format!("the first milestone's NEXT STEPS {next:?} names neither of {wanted:?}"),
            );
        }
        None => {
            ok(false, "no milestone was made");
            ok(false, "no milestone, no next step");
        }
    }
    match first_layer(turns, "epoch") {
        Some((_, text)) => {
            let intent = section(&text, SESSION_INTENT);
            ok(
                intent.iter().any(|s| s.contains(ASK_CORE)),
                "the first epoch's SESSION INTENT lacks the ask",
            );
            let next = section(&text, NEXT_STEPS);
            ok(
                next.iter().any(|s| s.contains("visit K-")),
                &format!("the first epoch's NEXT STEPS {next:?} names no key to visit"),
            );
        }
        None => {
            ok(false, "no epoch was made");
            ok(false, "no epoch, no next step");
        }
    }
    c
}

async fn walk(
    summarizer: Option<Arc<dyn Summarizer>>,
    len: usize,
    attempts: u32,
) -> Result<Vec<Turn>, EvalError> {
    let recorder = Recorder::default();
    let mut config = world::forced();
    config.summary_retry = config.summary_retry.max_attempts(attempts);
    let mut builder = world::builder(
        Arc::new(world::reader_model(recorder.clone())),
        VisitTool::chain(len),
    )
    .goal(GOAL)
    .compaction(config)
    .checkpointer(Arc::new(MemorySaver::new()));
    if let Some(s) = summarizer {
        builder = builder.summarizer(s);
    }
    let agent = builder.build()?;
    agent
        .run("intent", AgentInput::new().message(Message::user(ask())))
        .await?;
    Ok(recorder.turns())
}

/// Runs the eval; with `live`, the LLM summarizer's model is the live one.
pub async fn run(live: Option<&Live>) -> Result<Outcome, EvalError> {
    let extractive = walk(None, LEN, 2).await?;
    let summary_calls = Recorder::default();
    let (model, len, attempts, who): (Arc<dyn ChatModel>, usize, u32, String) = match live {
        Some(l) => (
            Arc::new(Recorded::new(l, summary_calls.clone())),
            LIVE_LEN,
            1,
            format!("llm ({})", l.name),
        ),
        None => (
            Arc::new(copying_summarizer()),
            LEN,
            2,
            "llm (copying model)".to_owned(),
        ),
    };
    let llm = LlmSummarizer::new(model).with_format(SummaryFormat::Structured);
    let structured = walk(Some(Arc::new(llm)), len, attempts).await?;
    let a = check(&extractive, "extractive");
    let b = check(&structured, &who);
    let passed = a.passed + b.passed;
    let mut notes: Vec<String> = a.notes.into_iter().chain(b.notes).collect();
    if notes.is_empty() {
        notes.push(format!("extractive 4/4, {who} 4/4"));
    }
    let mut transcript = extractive;
    transcript.extend(structured);
    transcript.extend(summary_calls.turns());
    Ok(Outcome::new(
        NAME,
        passed == 8,
        passed as f64,
        "of 8 checks",
        notes.join("; "),
    )
    .with_transcript(&transcript))
}
