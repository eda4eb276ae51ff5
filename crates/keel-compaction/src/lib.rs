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
//! run ([`CompactionConfig::summary_tiers`]). On a small window, where the system
//! prompt, goal and tool specs take much of the budget, the default budgets shrink so
//! the summaries hold at most 40% of what is left
//! ([`CompactionConfig::summary_share`]), and a milestone the token trigger asks for
//! waits until it frees a good part of the room under the trigger, or the prompt reaches the budget
//! ([`CompactionConfig::min_token_gain`]): compaction frees room that lasts instead of
//! one step's worth at every step.
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
//! # In your own loop, with this crate alone
//!
//! [`Compactor::new`] takes a summarizer, an archive, a thread id, a token counter and
//! a model profile, which come from keel-summarize, keel-offload and keel-token; this
//! crate re-exports them as [`summarize`], [`offload`] and [`token`] (and keel-model,
//! for [`Compactor::call`], as [`model`]), so `keel-compaction` is the one keel crate
//! to add (with its `fs` feature for `offload::FsStore`, an archive on disk).
//! [`Compactor::after_step`] is async and runs on tokio (a current-thread runtime is
//! enough); your loop needs one. The example below also uses `serde_json` (for a tool
//! call's arguments) and `tokio`: `cargo add keel-compaction serde_json` and
//! `cargo add tokio --features rt,macros`. It stops a loop at the step ceiling,
//! [`CompactionConfig::max_steps`] (500 model calls unless raised, as in the example
//! below), with [`CompactionError::StepCeiling`]; a compaction that failed returns
//! its error with the context unchanged, and the next call tries again.
//!
//! Token counts are estimates that lean high (keel-token's `ApproxCounter`) unless keel-token's
//! `tiktoken` feature is on: turn on this crate's `tiktoken` feature for exact counts
//! of OpenAI models, and check [`ModelProfile::counts_exactly`](token::ModelProfile::counts_exactly)
//! where an estimate would not do (a small window). A profile for a model keel does not
//! know is [`ModelProfile::new`](token::ModelProfile::new) with its window and output
//! limit.
//!
//! ```
//! use std::sync::Arc;
//! use keel_compaction::message::{Message, ToolCall};
//! use keel_compaction::offload::{Archive, MemoryStore, Pattern, ThreadId};
//! use keel_compaction::summarize::ExtractiveSummarizer;
//! use keel_compaction::token::{Encoding, ModelProfile, TokenCounter};
//! use keel_compaction::{CompactionConfig, CompactionError, Compactor, ContextState, GoalAnchor};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! // A model with a 4,096-token window, 1,024 of them kept for the reply.
//! let profile = ModelProfile::new("my-model", 4_096, 1_024, Encoding::Approximate);
//! let counter = profile.counter()?;
//! let archive = Arc::new(Archive::new(Arc::new(MemoryStore::new())));
//! let thread = ThreadId::new("run-1")?;
//! let compactor = Compactor::new(
//!     Arc::new(ExtractiveSummarizer::new()), // offline, no model call
//!     archive.clone(),
//!     thread.clone(),
//!     counter.clone(),
//!     profile.clone(),
//! )
//! .with_config(
//!     CompactionConfig::default()
//!         .with_every_steps(Some(10))
//!         .with_max_steps(1_000), // the default ceiling, 500, would stop this loop
//! );
//!
//! let goal = GoalAnchor::new("Find why the build fails.").with_constraints(["Never push."]);
//! let mut state = ContextState::new(goal).with_system(Message::system("You are an agent."));
//! for i in 0..600 {
//!     // Your model call: send the assembled prompt (system, goal, summaries, recent steps).
//!     let prompt = compactor.assemble(&mut state);
//!     assert_eq!(&prompt[1], state.goal.message()); // the goal, byte for byte, every time
//!     assert!(counter.count_prompt(&prompt, &[]) <= profile.input_budget());
//!     let reply = Message::assistant(format!("Checking step {i}."))
//!         .with_tool_calls(vec![ToolCall::new(format!("c{i}"), "sh", serde_json::json!({"cmd": "make"}))]);
//!     // Your tool: its result joins the step.
//!     let result = Message::tool(format!("c{i}"), format!("build {i}: exit code {}", 100 + i));
//!     compactor.push_step(&mut state, reply, vec![result]);
//!     // Compacts when it is due. A failed compaction (a summarizer's model out of
//!     // reach) leaves the context as it was; log it and go on.
//!     if let Err(e) = compactor.after_step(&mut state, &[]).await {
//!         if matches!(e, CompactionError::StepCeiling { .. }) {
//!             break;
//!         }
//!         eprintln!("compaction failed, the next step tries again: {e}");
//!     }
//! }
//! // Step 3's result left the prompt long ago, and is in the archive.
//! let prompt = compactor.assemble(&mut state);
//! assert!(!prompt.iter().any(|m| m.text().contains("exit code 103")));
//! let found = archive.grep(&thread, &Pattern::literal("exit code 103")?, 1)?;
//! assert_eq!(found.messages.len(), 1);
//! assert!(state.epochs_made > 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! See also the [`Compactor`] example.
//!
//! Three things the example leaves out, which a loop with real tools needs:
//!
//! - Give [`Compactor::after_step`] (and [`Compactor::call`]) the tool specs you send
//!   the model: they are part of every prompt, and a compactor told of none plans as
//!   if they cost nothing.
//! - Ask the model for replies of at most [`ModelProfile::reserved_output`] tokens
//!   (`ChatOptions::max_tokens`): prompts are kept within the window less that, and
//!   [`Compactor::call`] refuses a larger cap
//!   ([`CallError::ReplyCapTooLarge`]).
//! - Stubs of stored results tell the model to call `read_file` and `grep` on paths
//!   such as `large_tool_results/<call id>`: give it
//!   [`RetrievalTools`](keel_offload::RetrievalTools) (over the archive's store and
//!   thread, sized with `ToolLimits::for_budget`), or, if tools of yours already have
//!   those names, send calls on those paths to it.
//!
//! [`ModelProfile::reserved_output`]: keel_token::ModelProfile::reserved_output

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
pub use config::{CompactionConfig, StepTrigger, Strategy, SummaryBudgets};
pub use error::{CallError, CompactionError};
pub use event::{CompactionEvent, EventKind, Trigger};
pub use goal::{GOAL_ID, GoalAnchor};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
/// The model contract (keel-model) that [`Compactor::call`] calls, re-exported so a user
/// of this crate alone needs no second dependency. Built without providers: this
/// crate's `openai` and `ollama` features bring `OpenAiModel` and `OllamaModel`.
pub use keel_model as model;
/// The offload store and archive (keel-offload) that [`Compactor::new`] takes, re-exported
/// so a user of this crate alone needs no second dependency. `MemoryStore` is always
/// there; `FsStore` (an archive on disk) needs this crate's `fs` feature.
pub use keel_offload as offload;
/// The summarizers (keel-summarize) that [`Compactor::new`] takes, re-exported so a user
/// of this crate alone needs no second dependency.
pub use keel_summarize as summarize;
/// The token counters and model profiles (keel-token) that [`Compactor::new`] takes,
/// re-exported so a user of this crate alone needs no second dependency. Exact counts
/// need this crate's `tiktoken` feature.
pub use keel_token as token;
pub use prefix::{PREFIX_VERSION, PrefixSummarizer};
pub use state::{
    ContextParts, ContextState, LAYER_METADATA_KEY, Layer, LayerLevel, MASKED_METADATA_KEY,
    OBSERVATION_METADATA_KEY,
};
