//! Eval 2, `needle`: a fact from the first tool result, long compacted away, answers
//! the final question — from the archive, in at most two extra tool calls.
//!
//! The reader walks 30 records; the first holds `vault code is VAULT-4471-QX`. Then the
//! final question asks for the value after "vault code is". The reader answers from its
//! prompt if the fact is there, else greps the archive and, when the grep line does
//! not show the value, reads the record back. It passes when the answer is right, the
//! record's raw result had left the prompt, and the answer took at most two tool calls.
//!
//! It fails if compaction drops the result without archiving it (the grep finds
//! nothing and the reader says it cannot answer), if the retrieval tools cannot read
//! the archive, or if the answer takes more than two calls.
//!
//! With a live model ([`crate::live`]), the final question goes to the model instead
//! of the reader, with the same tools; it passes when the model's answer holds the
//! value within two extra tool calls.

use std::sync::Arc;

use keel_agent::AgentInput;
use keel_checkpoint::MemorySaver;
use keel_message::Message;
use keel_model::ChatModel;

use crate::live::{Live, Switch};
use crate::world::{self, Recorder, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "needle";
/// Records in the chain.
pub const LEN: usize = 30;
/// The fact.
pub const VALUE: &str = "VAULT-4471-QX";
const GOAL: &str = "Walk the chain of records to its end; you will be asked about what the records said. Start at key K-0000.";

fn visit() -> VisitTool {
    VisitTool::new(|k| match world::index(k) {
        Some(0) => Ok(world::record(0, LEN).replacen(
            "  log 0:",
            &format!("  note: the vault code is {VALUE} for this chain\n  log 0:"),
            1,
        )),
        Some(i) if i < LEN => Ok(world::record(i, LEN)),
        _ => Err(format!("no record named {k}")),
    })
}

/// The final question.
pub fn question() -> String {
    format!(
        "{} what came after \"vault code is\" in the record of {}? Answer with the value.",
        world::FINAL_QUESTION,
        world::key(0)
    )
}

/// Runs the eval; with `live`, the final question goes to that model.
pub async fn run(live: Option<&Live>) -> Result<Outcome, EvalError> {
    let recorder = Recorder::default();
    let reader: Arc<dyn ChatModel> = Arc::new(world::reader_model(recorder.clone()));
    let switch = live.map(|l| Switch::new(reader.clone(), l, recorder.clone()));
    let model: Arc<dyn ChatModel> = match &switch {
        Some(s) => Arc::new(s.clone()),
        None => reader,
    };
    let agent = world::builder(model, visit())
        .goal(GOAL)
        .compaction(world::forced())
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()?;
    agent.run("needle", AgentInput::new()).await?;
    if let Some(s) = &switch {
        s.go_live();
    }
    let run = agent
        .run(
            "needle",
            AgentInput::new().message(Message::user(question())),
        )
        .await?;
    let turns = recorder.turns();
    let extra = world::calls_after_question(&turns);
    let asked = turns.iter().find(|t| {
        t.prompt
            .last()
            .and_then(|m| m[1].as_str())
            .is_some_and(|s| s.starts_with(world::FINAL_QUESTION))
    });
    let raw_left = asked.is_some_and(|t| {
        !t.prompt
            .iter()
            .any(|m| m[2].as_str() == Some("visit-K-0000"))
    });
    let in_summary = asked.is_some_and(|t| t.layer_texts().iter().any(|(_, s)| s.contains(VALUE)));
    let answer = run.answer.unwrap_or_default();
    let right = if live.is_some() {
        answer.contains(VALUE)
    } else {
        answer.starts_with(world::ANSWER) && answer.contains(VALUE)
    };
    let passed = right && raw_left && extra <= 2;
    let detail = format!(
        "{}answer {answer:?}; the raw result {} the prompt{}; {} milestones",
        if live.is_some() { "live model: " } else { "" },
        if raw_left { "had left" } else { "was still in" },
        if in_summary {
            // Offline, the scripted reader reads back from the store whatever the
            // prompt holds: the eval proves the way back works, not that it was needed.
            if live.is_some() {
                " (a summary kept the value too)"
            } else {
                " (a summary kept the value too; the scripted reader reads the store whatever the prompt holds)"
            }
        } else {
            ", no summary kept the value"
        },
        run.state.milestones_made
    );
    Ok(Outcome::new(
        NAME,
        passed,
        extra as f64,
        "extra tool calls (at most 2)",
        detail,
    )
    .with_transcript(&turns))
}
