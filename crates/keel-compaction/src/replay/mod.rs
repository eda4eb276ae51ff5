//! Replay: feed a recorded trajectory through a compaction strategy, turn by turn, and
//! measure what the model would have been sent.
//!
//! Each recorded assistant turn is taken as the model's answer. Before it, the replay
//! records the prompt a model would have received: the full history (the baseline)
//! and the assembled prompt of the strategy under test. For each turn it records the
//! input tokens, the prefix the prompt shares with the previous turn's prompt (what a
//! provider's prompt cache would reuse), whether the goal was byte-identical, and the
//! compaction events. Needles — facts planted in early tool results — must be found in
//! the archive after they were compacted away. Needed facts — the identifiers the
//! recorded agent passed on in each reply, which it had been told earlier
//! ([`needed_facts`]) — must be in the prompt (recall), or at least in the archive;
//! they are checked from the first turn whose prompt lacks a message the agent was
//! told ([`TurnRecord::checked`]).
//!
//! The prompts of another context manager (a peer's, recorded while it ran the same
//! trajectory) are measured by the same code with [`score_prompts`], so keel and the
//! peer are compared on one metric.
//!
//! Loaders read the two formats users bring: OpenAI chat messages
//! ([`load_tau_bench`]) and SWE-agent `.traj` files ([`load_swe_agent`]).

mod facts;
mod load;
mod run;
mod score;

pub use facts::{identifiers, needed_facts, turn_identifiers};
pub use load::{
    DuplicateId, LoadError, Trajectory, load_swe_agent, load_swe_agent_dir, load_tau_bench,
};
pub use run::{
    CACHED_TOKEN_PRICE, FactCheck, Needle, OUTPUT_TOKEN_PRICE, ReplayConfig, Report, RunReport,
    TurnRecord, replay_all, replay_trajectory,
};
pub use score::{ScoreError, external_summary_event, score_prompts};
