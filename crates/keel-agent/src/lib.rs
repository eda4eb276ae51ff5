//! The compacting agent, ready to use: keel's graph runtime, context compaction,
//! offload store and model contract composed into one durable agent.
//!
//! An [`Agent`] is a graph over [`AgentState`] with four nodes:
//!
//! ```text
//! START → agent ─(tool calls)→ tools ─(trigger fires)→ compact ─(M milestones)→ epoch
//!           ▲  └─(answer)→ END     │                     │                        │
//!           └──────────────────────┴─────────────────────┴────────────────────────┘
//! ```
//!
//! - `agent` sends the assembled prompt — system, goal, epoch summary, milestones, raw
//!   tail — to the [`keel_model::ChatModel`]; on a provider context overflow, or a
//!   prompt counted over the input budget (the window less the reply's `max_tokens`,
//!   which is then not sent), it compacts and retries once, storing the newest step's
//!   largest results away to stubs when nothing older is left to compact; at the step
//!   ceiling it stops with a resumable [`Stop`].
//! - `tools` runs the reply's tool calls concurrently, each with a timeout; an unknown
//!   tool, bad arguments, a tool error, a panic or a timeout becomes a tool message the
//!   model can act on (a panic still passes through Rust's panic hook, which prints it
//!   on stderr as it would any caught panic; `std::panic::set_hook` sends it elsewhere). Large results go to the offload store, a stub stays; JSON
//!   results enter without the whitespace between their tokens, the same values in
//!   fewer tokens (`CompactionConfig::with_minify_json(false)` keeps them byte-exact).
//! - `compact` turns older raw steps into a milestone (archived first, so nothing is
//!   lost) when a trigger fires: the step count, the token fraction of the model's
//!   window, or an overflow. `epoch` folds milestones into an epoch summary. Each
//!   compaction step prunes old checkpoints to the last few while it summarizes.
//!
//! Any node can be replaced ([`AgentBuilder::node`]) or wrapped
//! ([`AgentBuilder::wrap`]), a node of your own put on one of the routes
//! ([`AgentBuilder::reroute`]), and the nodes and routers reused in a graph of your
//! own ([`AgentNodes`], [`AgentUpdates`] for its stream).
//!
//! Every step is checkpointed as deltas ([`AgentState`] is designed for it), so a
//! thread resumes after a crash from its last checkpoint. Another worker can resume
//! it when it shares the checkpointer and the offload store (the default store is in
//! memory, for one process: a durable agent needs a durable store, `SqliteStore` in
//! the saver's file, an `FsStore` for one machine, a `PostgresStore` for a fleet).
//! With a durable checkpointer and no store, [`AgentBuilder::build`] fails with
//! [`BuildError::EphemeralOffloadStore`]. A run of a stored thread first checks that
//! the store still holds what the thread's checkpoint archived, and fails with
//! [`AgentError::ArchiveUnavailable`] if not.
//!
//! Tool calls run **at least once**. A crash while the `tools` step runs loses that
//! step's results (a step is stored whole or not at all), and the resumed run runs
//! its tool calls again, with the same call ids; the model is not asked again. A tool
//! with effects outside keel (a payment, an email) should make a repeat harmless:
//! [`ToolContext::idempotency_key`](keel_message::ToolContext::idempotency_key) (the
//! thread, the step and the call id) is the same on the repeat and names no other
//! call. The call id alone is unique only within one reply: some servers number each
//! reply's calls from `call_0` again.
//!
//! A run stops with a resumable [`Stop`] at its own budget ([`AgentInput::max_steps`])
//! or at the thread's step ceiling:
//! [`CompactionConfig::max_steps`](keel_compaction::CompactionConfig::max_steps), 500
//! model calls by default, counted over every run of the thread. A long-running agent
//! raises the ceiling with `CompactionConfig::with_max_steps` on the builder, and a
//! thread stopped there goes on once an agent built with a higher ceiling runs it
//! again. After such a stop [`AgentUpdate::Done`]'s `next` is empty, as after an
//! answer: its `stop` says the thread can go on. A run also stops
//! after [`MAX_FAILED_COMPACTIONS`] compactions fail in a row (nothing is removed from
//! a context whose compaction fails, so it would only grow). A failing summarizer
//! alone does not get there: from the second compaction in a row on, a summary it
//! fails at is written by the extractive fallback
//! ([`CompactionConfig::fallback_after_failures`](keel_compaction::CompactionConfig::fallback_after_failures)).
//! [`Agent::run_from`] forks a thread from a past checkpoint; [`Agent::prune`],
//! [`Agent::delete_thread`] and [`Agent::sweep_idle`] remove checkpoints with the
//! offloaded files only they saw.
//!
//! An agent runs on Tokio: [`Agent::run`], [`Agent::run_from`] and [`Agent::stream`]
//! drive the graph on a task of their own and each tool call gets one, so call them
//! inside a Tokio runtime (a multi-threaded one runs tool calls and file work in
//! parallel); outside one they fail with [`AgentError::NoRuntime`].
//!
//! The token trigger needs the model's context window. A model keel-token's profiles
//! do not know by name (the test models, `scripted` and `policy`, among them) is
//! counted with a conservative 8,192-token window and an
//! [`AgentEvent::ProfileFallback`] event: its token trigger can fire before the step
//! count does. Give the real window with [`AgentBuilder::profile`].
//!
//! The tools follow the [`keel_message::Tool`] contract. The offload retrieval tools
//! (`ls`, `read_file`, `grep` over what left the context) are registered by default;
//! with the `fs` feature, [`tools::FileTools`] adds file tools rooted in one directory
//! that read the offload store too.
//!
//! ```
//! use std::sync::Arc;
//! use keel_agent::{Agent, AgentInput};
//! use keel_compaction::CompactionConfig;
//! use keel_agent::message::ToolCall;
//! use keel_model::{ScriptedModel, Turn};
//! use serde_json::json;
//!
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
//! // 30 tool calls, then an answer; a milestone every 10 steps.
//! let mut turns: Vec<Turn> = (0..30)
//!     .map(|i| Turn::tool_calls(format!("step {i}"), vec![ToolCall::new(format!("c{i}"), "ls", json!({}))]))
//!     .collect();
//! turns.push(Turn::text("done"));
//! let agent = Agent::builder()
//!     .model(Arc::new(ScriptedModel::new(turns)))
//!     .goal("List the store thirty times.")
//!     .compaction(CompactionConfig::default().with_every_steps(Some(10)))
//!     .build()?;
//! let run = agent.run("t", AgentInput::new()).await?;
//! assert_eq!(run.answer.as_deref(), Some("done"));
//! assert_eq!(run.state.milestones_made, 3);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod agent;
mod error;
mod event;
mod nodes;
mod running;
mod state;
pub mod tools;

pub use agent::{
    Agent, AgentBuilder, AgentInput, AgentRun, AgentUpdate, AgentUpdates, CALIBRATION_BOUNDS,
    CALIBRATION_SMOOTHING, DEFAULT_KEEP_CHECKPOINTS, DEFAULT_MAX_REPEATED_CALLS, Next,
};
pub use error::{AgentError, BuildError, CleanupError};
pub use event::{AgentEvent, ToolFailure, call_fingerprint};
pub use keel_graph::StopSignal;
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use nodes::{
    AGENT, AgentNodes, CALLS_REFUSED_METADATA_KEY, COMPACT, EPOCH, NUDGE_METADATA_KEY,
    TOKENS_PER_TOOL_CALL, TOOLS, refused_before_sending,
};
pub use state::{
    AgentState, AgentStateUpdate, MAX_FAILED_COMPACTIONS, MilestoneOp, Milestones,
    RECENT_COMPACTIONS, RECENT_EVENTS, Stop, WriteOnce,
};
