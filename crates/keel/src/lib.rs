//! keel keeps long-running LLM agents on course.
//!
//! This is the facade: every keel crate, re-exported under one name and chosen with
//! features, as sqlx does for its drivers. Depend on `keel` for a whole runtime, or on
//! one crate (`keel-compaction`, `keel-token`, `keel-reducer`, ...) for one concept.
//!
//! | module | crate | what it is |
//! |---|---|---|
//! | [`message`] | keel-message | `Message`, `ToolCall`, `ToolSpec`, the `Tool` contract |
//! | [`reducer`] | keel-reducer | the `Reducer` trait and the standard reducers |
//! | [`token`] | keel-token | `TokenCounter`, model profiles |
//! | [`checkpoint`] | keel-checkpoint | the `Checkpointer` contract, `MemorySaver` |
//! | [`graph`] | keel-graph | `StateGraph`, `#[derive(State)]`, the superstep engine |
//! | [`model`] | keel-model | `ChatModel`; providers behind `openai` / `ollama` |
//! | [`summarize`] | keel-summarize | `Summarizer`: extractive and LLM summaries |
//! | [`offload`] | keel-offload | `OffloadStore`, the archive, retrieval tools |
//! | [`compaction`] | keel-compaction | `Compactor`: goal anchor, milestones, epochs |
//! | `agent` | keel-agent | the prebuilt compacting agent (feature `agent`) |
//! | `sqlite` | keel-checkpoint-sqlite | the embedded checkpointer (feature `sqlite`) |
//! | `postgres` | keel-checkpoint-postgres | the production checkpointer (feature `postgres`); `postgres::tls` is keel-postgres-tls, connection strings as libpq reads them |
//! | `fleet` | keel-fleet | the run queue and workers on one PostgreSQL (feature `fleet`) |
//!
//! Each module is its crate, whole: the examples in a crate's own docs name it by its
//! crate name, so with the facade read `keel_agent::Agent` as `keel::agent::Agent`,
//! `keel_model::ScriptedModel` as `keel::model::ScriptedModel`, and `futures::StreamExt`
//! as `keel::futures::StreamExt`. The examples of this crate
//! (`examples/agent_sqlite.rs`, `examples/agent_postgres.rs`, ...) use the facade's
//! names throughout.
//!
//! # Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `sqlite` | yes | `sqlite::SqliteSaver`: checkpoints in one SQLite file, and `offload::SqliteStore` (the archive in the same file) |
//! | `tiktoken` | yes | exact token counts (o200k_base, cl100k_base); without it a profile's counter estimates, leaning high (`ApproxCounter`) |
//! | `fs` | yes | the filesystem offload store and the agent's file tools |
//! | `agent` | yes | `agent`: the compacting agent graph |
//! | `postgres` | no | `postgres::PostgresSaver`, and `offload::PostgresStore` (the archive in the same database); call `PostgresSaver::setup()` once to create or migrate its tables before the first run (`examples/agent_postgres.rs`). Connections follow the connection string's `sslmode` as `psql`'s do, over rustls (`postgres::tls`, keel-postgres-tls) |
//! | `fleet` | no | `fleet::{Queue, Worker}`: runs submitted to PostgreSQL, taken by any number of workers (turns on `postgres` and `agent`) |
//! | `openai` | no | `model::OpenAiModel`, any OpenAI-compatible server |
//! | `ollama` | no | `model::OllamaModel` |
//! | `retry` | no | `model::Retrying`, retries around any `ChatModel` (on with either provider) |
//! | `proptest` | no | reducer law checks and the checkpointer conformance suite |
//!
//! `default-features = false` with any one feature builds; features only add.
//!
//! # Example
//!
//! A graph with a messages channel, on the facade alone:
//!
//! ```
//! use keel::graph::{END, RunConfig, START, State, StateGraph};
//! use keel::message::Message;
//! use keel::reducer::{AddMessages, AddMessagesUpdate, Messages};
//!
//! // `keel::graph::State` derives code that names `keel::graph`: no `keel-graph`
//! // dependency of your own, no `#[state(crate = ..)]`.
//! #[derive(Clone, State)]
//! struct Chat {
//!     #[reducer(AddMessages)]
//!     messages: Messages,
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
//! let graph = StateGraph::<Chat>::new()
//!     .add_node("greet", |_state, _ctx| async move {
//!         Ok(ChatUpdate::default().messages(AddMessagesUpdate::append([Message::assistant("hello")])))
//!     })
//!     .add_edge(START, "greet")
//!     .add_edge("greet", END)
//!     .compile()?;
//! let run = graph.invoke(ChatUpdate::default(), &RunConfig::default()).await?;
//! assert_eq!(run.state.messages.len(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// The `futures` crate keel's streams come from (`Checkpointer::list`,
/// `CompiledGraph::state_history`, `Agent::history`, `Agent::stream`): read them with
/// `use keel::futures::{StreamExt, TryStreamExt};`, no dependency of your own needed.
pub use futures;
pub use keel_checkpoint as checkpoint;
pub use keel_compaction as compaction;
/// keel-graph: `StateGraph`, `#[derive(State)]`, the superstep engine. Everything of
/// [`keel_graph`], with one difference: the `State` derive here names `keel::graph` in
/// the code it writes, so a crate that depends on `keel` alone can use it.
pub mod graph {
    #[doc(inline)]
    pub use keel_graph::*;
    // The derive: the one of keel-graph with `::keel::graph` as its default path.
    #[doc(inline)]
    pub use keel_graph_macros::FacadeState as State;
}
pub use keel_message as message;
pub use keel_model as model;
pub use keel_offload as offload;
pub use keel_reducer as reducer;
pub use keel_summarize as summarize;
pub use keel_token as token;

#[cfg(feature = "agent")]
pub use keel_agent as agent;
#[cfg(feature = "postgres")]
pub use keel_checkpoint_postgres as postgres;
#[cfg(feature = "sqlite")]
pub use keel_checkpoint_sqlite as sqlite;
#[cfg(feature = "fleet")]
pub use keel_fleet as fleet;
