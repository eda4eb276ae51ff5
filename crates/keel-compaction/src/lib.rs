//! Hierarchical context compaction: keeps a long-running agent's prompt small without
//! losing the goal or anything it saw.
//!
//! An agent's memory ([`ContextState`]) has these layers (with the default three
//! summary tiers):
//!
//! | level | layer | what it is |
//! |---|---|---|
//! | ∞ | [`GoalAnchor`] | the original request and hard constraints; never compacted, byte-identical at the top of every prompt |
//! | 3 | era summary | older epochs folded, a few at a time, with the previous era |
//! | 2 | epoch summaries | the last few, each the milestones it folded |
//! | 1 | milestones | summaries of raw steps since the last epoch |
//! | 0 | raw buffer | recent messages in full, the newest step always |
//!
//! Each tier has its own budget, so the summaries stay within a bound however long the
//! run ([`CompactionConfig::summary_tiers`]).
//!
//! A [`Compactor`] decides when to compact ([`Compactor::check`]: every N steps, or
//! when the prompt reaches a fraction of the model's input budget, or on a provider's
//! context-overflow error), assembles the prompt ([`Compactor::assemble`]: system,
//! goal, epoch, milestones, raw), and compacts ([`Compactor::compact`]): old string
//! arguments are truncated to pointers, the older part of the raw buffer is archived
//! (keel-offload) and summarized (keel-summarize) into a milestone, the buffer is
//! flushed down to a recent tail that never separates a tool call from its results,
//! and every M milestones become an epoch. Observation masking and a hybrid are the
//! other [`Strategy`]s. Every compaction is a [`CompactionEvent`].
//!
//! It needs no graph: an agent loop of your own calls [`Compactor::after_step`] after
//! each model call and sends [`Compactor::assemble`] to the model.
//!
//! The [`replay`] module feeds recorded trajectories through each strategy and reports
//! what the model would have been sent.
//!
//! See the [`Compactor`] example.

mod compactor;
pub mod config;
pub mod cut;
mod error;
mod event;
mod goal;
mod prefix;
pub mod replay;
mod state;

pub use compactor::{Compactor, LayerTokens};
pub use config::{CompactionConfig, StepTrigger, Strategy};
pub use error::{CallError, CompactionError};
pub use event::{CompactionEvent, EventKind, Trigger};
pub use goal::{GOAL_ID, GoalAnchor};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use prefix::{PREFIX_VERSION, PrefixSummarizer};
pub use state::{
    ContextParts, ContextState, LAYER_METADATA_KEY, Layer, LayerLevel, MASKED_METADATA_KEY,
    OBSERVATION_METADATA_KEY,
};
