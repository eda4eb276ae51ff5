//! Targeted context evals: does keel's context management keep what a long-running
//! agent needs?
//!
//! Every eval drives the real [`keel_agent::Agent`] (graph, tools node, compaction,
//! offload store, checkpointer) with compaction forced often — the token trigger at
//! 15% of an 8,000-token window ([`world::forced`]) — and a scripted *reader* as the
//! model ([`world::reply`]): a deterministic policy that decides each action from what
//! its prompt actually contains. It answers a question only when the fact is in its
//! prompt, otherwise it greps the store, otherwise it says it cannot. So an eval fails
//! when context management hides something, not when a script runs out.
//!
//! | eval | module | what it checks | the number it measures |
//! |---|---|---|---|
//! | `continue-after-compaction` | [`continuation`] | a 40-record walk, compacted several times, makes the same tool calls as the same walk with compaction off, and reaches the end | tool calls after the first compaction equal to the uncompacted run's |
//! | `needle` | [`needle`] | a fact in the first tool result, compacted away, answers the final question from the archive in at most two extra tool calls | extra tool calls |
//! | `intent-and-next-steps` | [`intent`] | the user's ask and the stated next step are in the SESSION INTENT and NEXT STEPS sections of the milestone and epoch that cover them, with the extractive summarizer and with the LLM summarizer's structured prompt | checks passed |
//! | `goal-fidelity` | [`goal`] | after 10+ compactions and 2+ epochs the goal in every prompt is the original byte for byte, no summarizer was given it, and no summary holds a run of 5 or more of its words | the longest run of goal words in a summary |
//! | `adversarial-errors` | [`adversarial`] | noisy, contradictory and failing tool outputs: every unresolved error is in the milestone that covers it, errors fixed by a retry are marked resolved | error checks passed |
//! | `large-result` | [`large`] | a 5 MB tool result is offloaded; the stub plus one targeted read answers the question | tool calls after the question |
//! | `resume-after-kill` | [`resume`] | a child process killed with SIGKILL right after a compaction resumes, and every later prompt equals the uninterrupted run's | later prompts equal |
//!
//! Each eval returns an [`Outcome`]: its name, whether it passed, the number it
//! measured with its unit, and a detail line; the `keel-evals` binary prints one line
//! per eval and exits with 1 if any failed (`cargo xtask eval`). With `--live`, the
//! model-facing evals ([`intent`] with the LLM summarizer, [`needle`] with the final
//! question put to the model) run against a real server ([`live`]); the others say
//! they are not model-facing.
//!
//! Each eval's docs say what breaking makes it fail.

pub mod adversarial;
pub mod continuation;
pub mod goal;
pub mod intent;
pub mod large;
pub mod live;
pub mod needle;
pub mod resume;
pub mod world;

use std::fmt;

/// How an eval ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It passed.
    Pass,
    /// It failed.
    Fail,
    /// It did not run (the detail says why).
    Skipped,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Skipped => "skipped",
        })
    }
}

/// What an eval found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The eval's name.
    pub name: &'static str,
    /// Pass, fail or skipped.
    pub status: Status,
    /// The number it measured.
    pub measured: f64,
    /// The unit of `measured`, with what passing needs.
    pub unit: String,
    /// One line on what happened.
    pub detail: String,
    /// The model calls of the eval's runs, one JSON line each, for `target/evals/`.
    pub transcript: Vec<String>,
}

impl Outcome {
    /// An outcome that passed when `passed`.
    pub fn new(
        name: &'static str,
        passed: bool,
        measured: f64,
        unit: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Outcome {
            name,
            status: if passed { Status::Pass } else { Status::Fail },
            measured,
            unit: unit.into(),
            detail: detail.into(),
            transcript: Vec::new(),
        }
    }

    /// An eval that did not run.
    pub fn skipped(name: &'static str, why: impl Into<String>) -> Self {
        Outcome {
            name,
            status: Status::Skipped,
            measured: 0.0,
            unit: String::new(),
            detail: why.into(),
            transcript: Vec::new(),
        }
    }

    /// Attaches the transcript of model calls.
    #[must_use]
    pub fn with_transcript(mut self, turns: &[world::Turn]) -> Self {
        self.transcript = turns.iter().map(|t| t.to_json().to_string()).collect();
        self
    }

    /// True unless it failed.
    pub fn ok(&self) -> bool {
        self.status != Status::Fail
    }

    /// True when it passed.
    pub fn passed(&self) -> bool {
        self.status == Status::Pass
    }
}

impl fmt::Display for Outcome {
    /// `name  pass  3 unit  — detail`, on one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.status == Status::Skipped {
            return write!(f, "{:<26} {:<7} — {}", self.name, self.status, self.detail);
        }
        let number = if self.measured.fract() == 0.0 {
            format!("{}", self.measured as i64)
        } else {
            format!("{:.2}", self.measured)
        };
        write!(
            f,
            "{:<26} {:<7} {number} {} — {}",
            self.name, self.status, self.unit, self.detail
        )
    }
}

/// Why an eval could not run to an outcome.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvalError {
    /// The agent could not be built.
    #[error("building the agent: {0}")]
    Build(#[from] keel_agent::BuildError),
    /// An agent run failed.
    #[error("the agent run failed: {0}")]
    Agent(#[from] keel_agent::AgentError),
    /// The offload store failed.
    #[error("the offload store: {0}")]
    Offload(#[from] keel_offload::OffloadError),
    /// The SQLite checkpointer failed.
    #[error("the SQLite checkpointer: {0}")]
    Sqlite(#[from] keel_checkpoint_sqlite::SqliteError),
    /// A model client could not be made or listed.
    #[error("the model: {0}")]
    Model(#[from] keel_model::ModelError),
    /// A file or process.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The child process of an eval misbehaved.
    #[error("the child process: {0}")]
    Child(String),
}

impl EvalError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| EvalError::Io { what, source }
    }
}
