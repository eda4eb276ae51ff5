//! keel's graph runtime: LangGraph's model in Rust.
//!
//! A graph runs over a typed [`State`] whose fields are *channels*, each merged by a
//! [`reducer::Reducer`]. Nodes are async functions that read the state and return a
//! partial update (or a [`Command`] that also routes). Execution is bulk-synchronous
//! (Pregel): each superstep runs its scheduled tasks concurrently, then folds their
//! updates in a fixed order (by task path), so a result never depends on which task
//! finished first. With a [`keel_checkpoint::Checkpointer`] every superstep is stored as
//! per-channel deltas, which gives interrupts, resume after a crash, and time travel.
//!
//! ```
//! use keel_graph::reducer::{AddMessages, Messages};
//! use keel_graph::{END, RunConfig, START, State, StateGraph};
//! use keel_graph::message::Message;
//!
//! #[derive(Clone, State)]
//! struct Chat {
//!     #[reducer(AddMessages)]
//!     messages: Messages,
//!     turns: u32,
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! let graph = StateGraph::<Chat>::new()
//!     .add_node("echo", |state, _ctx| async move {
//!         let last = state.messages.iter().last().map(|m| m.text().into_owned()).unwrap_or_default();
//!         Ok(ChatUpdate::default()
//!             .messages(keel_graph::reducer::AddMessagesUpdate::append(vec![Message::assistant(last)]))
//!             .turns(state.turns + 1))
//!     })
//!     .add_edge(START, "echo")
//!     .add_edge("echo", END)
//!     .compile()?;
//!
//! let input = ChatUpdate::default()
//!     .messages(keel_graph::reducer::AddMessagesUpdate::append(vec![Message::user("hi")]));
//! let run = graph.invoke(input, &RunConfig::default()).await?;
//! assert_eq!(run.state.messages.len(), 2);
//! assert_eq!(run.state.turns, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Coming from LangGraph
//!
//! The model is LangGraph's: channels with reducers, supersteps, `Send` ([`SendTo`]),
//! [`Command`] with goto, update and resume, `interrupt` inside a node and
//! breakpoints before one, `get_state`, `get_state_history` ([`CompiledGraph::state_history`]),
//! `update_state` and forks from an older checkpoint ([`RunConfig::at`]). Where keel
//! differs:
//!
//! - **Types first.** A node returns the state's generated update type; writing a
//!   channel the state lacks, or a value of the wrong type, does not compile. A stored
//!   thread whose state has lost a field, or changed a field's type, fails to load
//!   with a typed error naming the channel ([`StateError`]) rather than dropping it:
//!   keep a retired field (unused, with its type) while such threads live, and add new
//!   fields freely (a thread that never wrote one reads it as empty).
//! - **Stream modes:** `values`, `updates`, `debug` and `custom` ([`StreamMode`]; a
//!   node's stream writer is [`NodeContext::emit`]). There is no `messages` mode: a
//!   node that calls a model emits its tokens as custom events. Interrupts arrive in
//!   [`Event::Done`], not as an `__interrupt__` update.
//! - **No subgraphs:** a compiled graph is not a node; call one from a node's function.
//! - **Routing is declared.** A node that routes only with [`Command::goto`] lists where
//!   it may go ([`NodeOptions::destinations`]), so the graph is checked when compiled.
//! - **`recursion_limit`** defaults to [`DEFAULT_RECURSION_LIMIT`] (10,000 supersteps),
//!   not 25: agents here run hundreds of steps.
//! - **`Command::resume` is its own input:** it cannot carry an update or a goto
//!   ([`GraphError::ResumeWithUpdate`]); edit with `update_state` first.
//! - **`update_state` on a new thread** schedules nothing unless `as_node` is
//!   [`START`], which makes the update the thread's input.
//! - **JSON is the stored form:** a map whose keys are not strings, or a NaN or
//!   infinite float, is refused when a checkpointer stores it ([`StateError::Encode`]).

// Nothing a caller or a hand-written `State` passes in may panic the engine (invariant
// 9): no indexing that can go out of range (the few proven indexes carry a narrow,
// commented allow), and no float-to-duration conversion that panics (clippy.toml
// disallows them; `Duration::try_from_secs_f64` instead).
#![deny(clippy::indexing_slicing, clippy::disallowed_methods)]

mod command;
mod config;
mod engine;
mod error;
mod graph;
pub mod state;
mod stream;

pub use command::{Command, Goto, NodeContext, NodeError, NodeOptions, Route, SendTo};
pub use config::{
    DEFAULT_RECURSION_LIMIT, Durability, Interrupt, Run, RunConfig, StateSnapshot, StopSignal,
    TaskError,
};
pub use engine::CompiledGraph;
pub use error::GraphError;
pub use graph::{BuildError, StateGraph};
pub use keel_checkpoint as checkpoint;
pub use keel_graph_macros::State;
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use keel_message::RetryPolicy;
pub use keel_reducer as reducer;
pub use state::{State, StateError, channel_index};

#[doc(hidden)]
pub use state::support as __private;
pub use stream::{Event, StreamMode};

/// The virtual node a run starts from.
pub const START: &str = "__start__";
/// The virtual node a run ends at.
pub const END: &str = "__end__";
