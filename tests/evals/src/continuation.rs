//! Eval 1, `continue-after-compaction`: compaction in the middle of a task changes
//! none of the agent's later actions.
//!
//! The reader walks a chain of 40 records; each record names the next key, so every
//! action follows from the newest tool result in the prompt. The walk runs twice:
//! with compaction forced often and with compaction off (a window it never
//! approaches). It passes when the compacted run compacts at least twice, reaches the
//! end of the chain, and makes exactly the uncompacted run's tool calls.
//!
//! It fails if a compaction drops or reorders the newest step, separates a call from
//! its result, or leaves a prompt the reader cannot continue from: the reader then
//! says it cannot continue and the call sequences differ.

use std::sync::Arc;

use keel_agent::AgentInput;
use keel_checkpoint::MemorySaver;
use keel_token::{Encoding, ModelProfile};

use crate::world::{self, Recorder, Turn, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "continue-after-compaction";
/// Records in the chain.
pub const LEN: usize = 40;
const GOAL: &str =
    "Walk the chain of records to its end and say where it ends. Start at key K-0000.";

async fn walk(compact: bool) -> Result<(Vec<Turn>, Option<String>, u64), EvalError> {
    let recorder = Recorder::default();
    let mut builder = world::builder(
        Arc::new(world::reader_model(recorder.clone())),
        VisitTool::chain(LEN),
    )
    .goal(GOAL)
    .checkpointer(Arc::new(MemorySaver::new()));
    builder = if compact {
        builder.compaction(world::forced())
    } else {
        builder.compaction(world::off()).profile(ModelProfile::new(
            "keel-eval-reader",
            1_000_000,
            1_000,
            Encoding::Approximate,
        ))
    };
    let run = builder.build()?.run("walk", AgentInput::new()).await?;
    Ok((recorder.turns(), run.answer, run.state.milestones_made))
}

/// Runs the eval.
pub async fn run() -> Result<Outcome, EvalError> {
    let (with, answer, milestones) = walk(true).await?;
    let (without, plain_answer, plain_milestones) = walk(false).await?;
    let calls = |turns: &[Turn]| turns.iter().flat_map(Turn::calls).collect::<Vec<_>>();
    let (a, b) = (calls(&with), calls(&without));
    // Calls made from a prompt that held a summary: after the first compaction.
    let first = with.iter().position(|t| t.layers > 0);
    let after: Vec<String> = first
        .map(|f| with[f..].iter().flat_map(Turn::calls).collect())
        .unwrap_or_default();
    let offset: usize = first.map_or(0, |f| with[..f].iter().map(|t| t.calls().len()).sum());
    let equal_after = after
        .iter()
        .enumerate()
        .filter(|(k, c)| b.get(offset + k) == Some(*c))
        .count();
    let end = format!("Reached the end of the chain at {}.", world::key(LEN - 1));
    let passed = a == b
        && milestones >= 2
        && plain_milestones == 0
        && answer.as_deref() == Some(end.as_str())
        && plain_answer == answer
        && !after.is_empty();
    let detail = format!(
        "{milestones} milestones, first before call {}; {} calls with compaction, {} without; answer {:?}",
        offset + 1,
        a.len(),
        b.len(),
        answer.unwrap_or_default()
    );
    Ok(Outcome::new(
        NAME,
        passed,
        equal_after as f64,
        format!(
            "of {} calls after the first compaction equal to the uncompacted run's",
            after.len()
        ),
        detail,
    )
    .with_transcript(&with))
}
