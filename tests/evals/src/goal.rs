//! Eval 4, `goal-fidelity`: after many compactions and epochs the goal is the
//! original, byte for byte, and no summary restates it.
//!
//! The reader walks 90 records with compaction forced often (10+ milestones, 2+
//! epochs). Every summarizer request is checked on the way in. It passes when:
//!
//! * the goal message of every prompt is the original text, byte for byte;
//! * no summarizer request held the goal text (keel never asks for it to be rewritten);
//! * no summary in any prompt holds a run of [`MAX_RUN`]` + 1` or more consecutive
//!   words of the goal (words: lowercase runs of letters and digits). The goal is
//!   written in words the tool results never use in that order, so a run that long in
//!   a summary can only come from the goal.
//!
//! The number is the longest run of goal words found in a summary. It fails if the
//! goal is dropped, rewritten or moved out of its message, if a summarizer is given
//! the goal (the extractive summarizer would copy it into SESSION INTENT), or if fewer
//! than 10 compactions or 2 epochs happen.

use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use keel_agent::AgentInput;
use keel_checkpoint::MemorySaver;
use keel_summarize::{ExtractiveSummarizer, SummarizeError, Summarizer, Summary, SummaryRequest};

use crate::world::{self, Recorder, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "goal-fidelity";
/// Records in the chain.
pub const LEN: usize = 90;
/// The longest run of goal words a summary may hold.
pub const MAX_RUN: usize = 4;
/// The goal.
pub const GOAL: &str = "Audit every record along the chain for the quarterly compliance review, \
    confirm that each replica answered, and finally report which key closes the chain. \
    Start at key K-0000.";

/// Wraps a summarizer and counts the requests whose input holds `needle`.
struct Watch {
    inner: ExtractiveSummarizer,
    needle: String,
    seen: Arc<Mutex<(usize, usize)>>,
}

#[async_trait]
impl Summarizer for Watch {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        let holds = request
            .messages
            .iter()
            .any(|m| m.text().contains(&self.needle))
            || request.previous.is_some_and(|p| p.contains(&self.needle));
        {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            seen.0 += 1;
            seen.1 += usize::from(holds);
        }
        self.inner.summarize(request).await
    }
}

/// Lowercase words of letters and digits.
pub fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// The longest run of consecutive `goal` words found in `text`.
pub fn longest_run(goal: &[String], text: &[String]) -> usize {
    let mut best = 0;
    for i in 0..text.len() {
        for j in 0..goal.len() {
            let mut n = 0;
            while i + n < text.len() && j + n < goal.len() && text[i + n] == goal[j + n] {
                n += 1;
            }
            best = best.max(n);
        }
    }
    best
}

/// Runs the eval.
pub async fn run() -> Result<Outcome, EvalError> {
    let recorder = Recorder::default();
    let seen = Arc::new(Mutex::new((0, 0)));
    let watch = Watch {
        inner: ExtractiveSummarizer::new(),
        // The goal's request, without the start instruction the user also types.
        needle: "quarterly compliance review".to_owned(),
        seen: seen.clone(),
    };
    let agent = world::builder(
        Arc::new(world::reader_model(recorder.clone())),
        VisitTool::chain(LEN),
    )
    .goal(GOAL)
    .compaction(world::forced())
    .summarizer(Arc::new(watch))
    .checkpointer(Arc::new(MemorySaver::new()))
    .build()?;
    let run = agent.run("goal", AgentInput::new()).await?;
    let turns = recorder.turns();
    let exact = turns
        .iter()
        .filter(|t| t.goal.as_deref() == Some(GOAL))
        .count();
    let goal_words = words(GOAL);
    let mut summaries: Vec<String> = turns
        .iter()
        .flat_map(|t| t.layer_texts().into_iter().map(|(_, s)| s))
        .collect();
    summaries.sort();
    summaries.dedup();
    let (run_len, worst) = summaries
        .iter()
        .map(|s| (longest_run(&goal_words, &words(s)), s))
        .max_by_key(|(n, _)| *n)
        .map_or((0, String::new()), |(n, s)| (n, s.clone()));
    let (requests, with_goal) = *seen.lock().unwrap_or_else(PoisonError::into_inner);
    let (milestones, epochs) = (run.state.milestones_made, run.state.epochs_made);
    let passed = exact == turns.len()
        && !turns.is_empty()
        && with_goal == 0
        && run_len <= MAX_RUN
        && milestones >= 10
        && epochs >= 2;
    let mut detail = format!(
        "goal byte-identical in {exact}/{} prompts; {milestones} milestones, {epochs} epochs; {with_goal}/{requests} summarizer requests held the goal; {} distinct summaries",
        turns.len(),
        summaries.len()
    );
    if run_len > MAX_RUN {
        detail.push_str(&format!(
            "; worst summary: {:?}",
            worst.chars().take(200).collect::<String>()
        ));
    }
    Ok(Outcome::new(
        NAME,
        passed,
        run_len as f64,
        format!("goal words in a row in a summary (at most {MAX_RUN})"),
        detail,
    )
    .with_transcript(&turns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_goal_words_are_counted() {
        let goal = words("Audit every record along the chain");
        assert_eq!(
            longest_run(&goal, &words("we audit every record, along it")),
            4
        );
        assert_eq!(longest_run(&goal, &words("nothing here")), 0);
    }
}
