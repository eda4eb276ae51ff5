//! Eval 5, `adversarial-errors`: noisy, contradictory and failing tool outputs, and
//! what the milestones say about the errors.
//!
//! The reader walks 20 records through a tool whose outputs are hostile: a multi-line
//! Python traceback, an error inside a JSON body, a burst of debug noise, two settings
//! that contradict each other, a permission error that is never fixed, and two
//! transient failures (an HTTP 503, a timeout) that the reader retries and that then
//! succeed. For each error, the milestone that covers it (the newest milestone in the
//! first prompt after its result left the raw context) must:
//!
//! * for an error never fixed: quote its message, not marked resolved;
//! * for an error fixed by a retry in the same span: quote it marked `[resolved`.
//!
//! The number is the errors that pass. It fails if a summarizer drops an unresolved
//! error (or keeps only its header line without the message), or presents a fixed
//! error as if it were still open — the gap this eval found in the extractive
//! summarizer, which marked nothing resolved.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use keel_agent::AgentInput;
use keel_checkpoint::MemorySaver;

use crate::world::{self, Recorder, Turn, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "adversarial-errors";
/// Records in the chain.
pub const LEN: usize = 20;
const GOAL: &str =
    "Walk the chain of records to its end, retrying what fails transiently. Start at key K-0000.";

/// An error the transcript holds: the call whose result carries it, the words the
/// milestone must quote, and whether a later call fixed it.
#[derive(Debug, Clone, Copy)]
pub struct Planted {
    /// The call id of the failing result.
    pub call: &'static str,
    /// What the milestone must quote.
    pub quote: &'static str,
    /// The call id of the retry that succeeded, if any.
    pub fixed_by: Option<&'static str>,
}

/// The errors of the transcript.
pub const PLANTED: [Planted; 5] = [
    Planted {
        call: "visit-K-0002",
        quote: "invalid literal for int() with base 10",
        fixed_by: None,
    },
    Planted {
        call: "visit-K-0004",
        quote: "quota exceeded for project P-88",
        fixed_by: None,
    },
    Planted {
        call: "visit-K-0007",
        quote: "HTTP 503 from replica service rs-7",
        fixed_by: Some("visit-K-0007-retry"),
    },
    Planted {
        call: "visit-K-0011",
        quote: "permission denied for relation orders_v2",
        fixed_by: None,
    },
    Planted {
        call: "visit-K-0014",
        quote: "connection to db-14 timed out after 30 s",
        fixed_by: Some("visit-K-0014-retry"),
    },
];

fn output(i: usize, failed_once: &Mutex<HashSet<usize>>) -> Result<String, String> {
    let next = world::next_line(i, LEN);
    let key = world::key(i);
    let first_time = || {
        failed_once
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(i)
    };
    match i {
        2 => Ok(format!(
            "$ python sync.py --key {key}\nTraceback (most recent call last):\n  File \"sync.py\", line 88, in load\n    qty = int(row['qty'])\nValueError: invalid literal for int() with base 10: 'N/A'\nexit status 1\n{next}"
        )),
        4 => Ok(format!(
            "{{\"status\": \"error\", \"error\": {{\"code\": \"E_QUOTA\", \"message\": \"quota exceeded for project P-88\"}}, \"key\": \"{key}\"}}\n{next}"
        )),
        5 => {
            let noise: String = (0..40)
                .map(|n| {
                    format!(
                        "DEBUG gc pause {}ms heap {}MB tick {n}\n",
                        1 + n % 7,
                        200 + n
                    )
                })
                .collect();
            Ok(format!(
                "record {key}: setting listen_port=8080\n{noise}{next}"
            ))
        }
        7 if first_time() => Err(format!(
            "HTTP 503 from replica service rs-7 for {key} (transient): retry the same call"
        )),
        9 => Ok(format!(
            "record {key}: setting listen_port=9090 (this contradicts the 8080 of K-0005; the later value wins)\n{next}"
        )),
        11 => Ok(format!(
            "psql: ERROR:  permission denied for relation orders_v2\nDETAIL: role eval_reader lacks SELECT on {key}\n{next}"
        )),
        14 if first_time() => Err(format!(
            "connection to db-14 timed out after 30 s while reading {key} (transient): retry the same call"
        )),
        i if i < LEN => Ok(world::record(i, LEN)),
        _ => Err(format!("no record named {key}")),
    }
}

fn present(turn: &Turn, call: &str) -> bool {
    turn.prompt.iter().any(|m| m[2].as_str() == Some(call))
}

/// The step whose call `call` answers: its result first shows in prompt `p`, the
/// prompt of model call `p + 1`, so the call was made by model call `p`.
fn step_of(turns: &[Turn], call: &str) -> Option<u64> {
    turns
        .iter()
        .position(|t| present(t, call))
        .map(|p| p as u64)
}

/// The steps a summary's heading names (`[Milestone 4: steps 7–9]`, `[Epoch 1: step 3]`).
fn range_of(summary: &str) -> Option<(u64, u64)> {
    let heading = summary.lines().next()?;
    let (_, steps) = heading.split_once(": step")?;
    let steps = steps.trim_start_matches('s').trim().trim_end_matches(']');
    match steps.split_once('–') {
        Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
        None => {
            let s = steps.trim().parse().ok()?;
            Some((s, s))
        }
    }
}

/// The summary covering `step` in the first prompt after `call`'s result left the raw
/// context (the lowest tier that covers it: a milestone when one does).
fn covering(turns: &[Turn], call: &str, step: u64) -> Option<String> {
    let seen = turns.iter().position(|t| present(t, call))?;
    let left = turns[seen..].iter().find(|t| !present(t, call))?;
    left.layer_texts()
        .into_iter()
        .map(|(_, text)| text)
        .rfind(|text| range_of(text).is_some_and(|(a, b)| a <= step && step <= b))
}

/// The first summary in any prompt that covers both steps.
fn covering_both(turns: &[Turn], a: u64, b: u64) -> Option<String> {
    turns.iter().find_map(|t| {
        t.layer_texts()
            .into_iter()
            .map(|(_, text)| text)
            .find(|text| range_of(text).is_some_and(|(x, y)| x <= a.min(b) && a.max(b) <= y))
    })
}

fn quoted<'s>(summary: &'s str, quote: &str) -> Vec<&'s str> {
    summary.lines().filter(|l| l.contains(quote)).collect()
}

/// Runs the eval.
pub async fn run() -> Result<Outcome, EvalError> {
    let recorder = Recorder::default();
    let failed_once = Arc::new(Mutex::new(HashSet::new()));
    let visit = VisitTool::new(move |k| match world::index(k) {
        Some(i) => output(i, &failed_once),
        None => Err(format!("no record named {k}")),
    });
    let agent = world::builder(Arc::new(world::reader_model(recorder.clone())), visit)
        .goal(GOAL)
        .compaction(world::forced())
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()?;
    let run = agent.run("adversarial", AgentInput::new()).await?;
    let turns = recorder.turns();
    let mut passed = 0;
    let mut notes = Vec::new();
    for p in PLANTED {
        let Some(step) = step_of(&turns, p.call) else {
            notes.push(format!("{}: never made", p.call));
            continue;
        };
        let Some(summary) = covering(&turns, p.call, step) else {
            notes.push(format!(
                "{}: no summary covers step {step} once its result left",
                p.call
            ));
            continue;
        };
        let lines = quoted(&summary, p.quote);
        let open = !lines.is_empty() && lines.iter().all(|l| !l.contains("[resolved"));
        let good = match p.fixed_by.and_then(|f| step_of(&turns, f).map(|s| (f, s))) {
            None if p.fixed_by.is_some() => {
                notes.push(format!("{}: its retry was never made", p.call));
                false
            }
            None => {
                if !open {
                    notes.push(format!("{}: the summary covering step {step} does not quote {:?} as open: {lines:?}", p.call, p.quote));
                }
                open
            }
            Some((fix, fix_step)) => {
                // Where the fix is in the same span, that summary marks it; where it is
                // not, the first summary over both does.
                let both =
                    if range_of(&summary).is_some_and(|(a, b)| a <= fix_step && fix_step <= b) {
                        Some(summary.clone())
                    } else {
                        covering_both(&turns, step, fix_step)
                    };
                match both {
                    Some(both) => {
                        let lines = quoted(&both, p.quote);
                        let marked = lines.iter().all(|l| l.contains("[resolved"));
                        if !marked {
                            notes.push(format!("{}: fixed by {fix} (step {fix_step}) but the summary over both does not mark it resolved: {lines:?}", p.call));
                        }
                        marked
                    }
                    None => {
                        notes.push(format!(
                            "{}: no summary covers it and its fix {fix}",
                            p.call
                        ));
                        false
                    }
                }
            }
        };
        passed += usize::from(good);
    }
    let end = format!("Reached the end of the chain at {}.", world::key(LEN - 1));
    let finished = run.answer.as_deref() == Some(end.as_str());
    if !finished {
        notes.push(format!("the walk did not finish: {:?}", run.answer));
    }
    if notes.is_empty() {
        notes.push(format!(
            "{} milestones; 3 open errors quoted, 2 retried ones marked resolved",
            run.state.milestones_made
        ));
    }
    Ok(Outcome::new(
        NAME,
        passed == PLANTED.len() && finished,
        passed as f64,
        format!("of {} errors reported right", PLANTED.len()),
        notes.join("; "),
    )
    .with_transcript(&turns))
}
