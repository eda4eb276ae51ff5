//! Chat models for keel: one trait, two HTTP providers, and three offline models.
//!
//! The one abstraction is [`ChatModel`]: messages ([`keel_message::Message`]), tool
//! specs and [`ChatOptions`] in; a [`ChatResponse`] out, holding the assistant message
//! (text and tool calls), the provider's [`Usage`] and the [`FinishReason`]. Its
//! streaming variant yields [`ChatEvent`] deltas and ends with the assembled response.
//! The trait is object safe, so the runtime holds an `Arc<dyn ChatModel>`; the agent
//! and the summarizer each get their own client, so a slow or rate-limited summarizer
//! never starves the agent.
//!
//! Implementations:
//!
//! * [`OpenAiModel`] (feature `openai`): `/v1/chat/completions` (OpenAI, vLLM,
//!   llama.cpp's server, LM Studio), SSE streaming, tools, usage.
//! * [`OllamaModel`] (feature `ollama`): Ollama's `/api/chat`, NDJSON streaming, tools,
//!   `options` (`temperature`, ...), `format`, and the config's `num_ctx` and `keep_alive`.
//! * [`ScriptedModel`]: answers from a script of turns and records requests (tests,
//!   demos, examples like the one below).
//! * [`ReplayModel`]: answers with the assistant turns of a recorded trajectory.
//! * [`PolicyModel`]: answers with a function of the request (messages and tools), for
//!   fakes that react to what they are sent: stop after N steps, read a tool result.
//! * [`Retrying`] (feature `retry`, on with either provider): retries around any
//!   `ChatModel`, with keel's one [`RetryPolicy`] (shared with graph nodes and the
//!   compactor).
//!
//! Both HTTP providers share [`HttpConfig`]: timeouts, retries with exponential backoff
//! and jitter on 429, 5xx and connection errors honouring `Retry-After`
//! ([`RetryPolicy`]), and per-client isolation: a concurrency limit and a token-bucket
//! [`RateLimit`]. Failures are typed ([`ModelError`]); a provider's "context length
//! exceeded" reply is always [`ModelError::ContextOverflow`], so the runtime can match
//! on it, compact the history and try again.
//!
//! Everything a server sends is bounded, so no server can grow the process without
//! limit, keep a call alive forever or panic it: a non-streamed body
//! ([`HttpConfig::max_body_bytes`], 32 MiB), an error body (its first 64 KiB), a stream
//! line or event ([`HttpConfig::max_line_bytes`], 4 MiB), a streamed answer
//! ([`HttpConfig::max_answer_bytes`], 16 MiB), a whole streamed call
//! ([`HttpConfig::stream_timeout`], 10 min), and header values such as `Retry-After`.
//! Replies that are not in the API's shape are [`ModelError::Malformed`] for both
//! providers, streamed or not, never an empty answer.
//!
//! # Features
//!
//! `openai` and `ollama` (both on by default) each bring the shared HTTP layer
//! (reqwest with rustls, tokio timers) and `retry`. With `default-features = false` the
//! crate is the contract alone (the trait, its types, [`ModelError`], [`ScriptedModel`],
//! [`ReplayModel`], [`RetryPolicy`]) and pulls in no HTTP client: what a summarizer or a
//! compactor written against `dyn ChatModel` needs. `retry` alone adds [`Retrying`]
//! with tokio's timer and no HTTP client.
//!
//! # Example
//!
//! A loop that compacts on overflow, shown with a scripted model (swap in
//! `OpenAiModel::new(OpenAiConfig::from_env("gpt-4.1-mini"))?` for a real one):
//!
//! ```
//! use std::sync::Arc;
//! use keel_model::message::Message;
//! use keel_model::{ChatModel, ChatOptions, ModelError, ScriptedModel, Turn, Usage};
//!
//! let model: Arc<dyn ChatModel> = Arc::new(ScriptedModel::new([
//!     Turn::fail(ModelError::ContextOverflow { message: "8192 tokens max".into() }),
//!     Turn::text("Done: 3 tests fixed.").with_usage(Usage::new(1_200, 9)),
//! ]));
//!
//! let mut history = vec![Message::user("Fix the failing tests."); 40];
//! let reply = futures::executor::block_on(async {
//!     loop {
//!         match model.chat(&history, &[], &ChatOptions::new().temperature(0.0)).await {
//!             Err(e) if e.is_context_overflow() => {
//!                 // A real runtime compacts here; this one keeps the last ten messages.
//!                 history.drain(..history.len() - 10);
//!             }
//!             other => return other,
//!         }
//!     }
//! })?;
//! assert_eq!(reply.text(), "Done: 3 tests fixed.");
//! assert_eq!(reply.usage.map(|u| u.total()), Some(1_209));
//! assert_eq!(history.len(), 10);
//! # Ok::<(), ModelError>(())
//! ```

// Without a provider the docs above still name them; their links resolve only when the
// provider's feature is on.
#![cfg_attr(
    not(all(feature = "openai", feature = "ollama")),
    allow(rustdoc::broken_intra_doc_links)
)]
// Nothing a server sends may panic the process: no indexing or slicing that can fail
// (use `get`), in library code and its unit tests alike.
#![deny(clippy::indexing_slicing, clippy::string_slice)]

mod error;
#[cfg(all(any(fuzzing, test), feature = "openai", feature = "ollama"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(any(feature = "openai", feature = "ollama"))]
mod http;
mod model;
#[cfg(feature = "ollama")]
mod ollama;
#[cfg(feature = "openai")]
mod openai;
mod policy;
mod replay;
#[cfg(feature = "retry")]
mod retry;
mod scripted;
mod types;

/// The attribute [`ChatModel`] is written with: put `#[keel_model::async_trait]` on your
/// `impl ChatModel for ...` (no `async-trait` dependency of your own needed).
pub use async_trait::async_trait;
pub use error::ModelError;
#[cfg(any(feature = "openai", feature = "ollama"))]
pub use http::{HttpConfig, RateLimit, redact_url};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use keel_message::RetryPolicy;
pub use model::ChatModel;
#[cfg(feature = "ollama")]
pub use ollama::{OllamaConfig, OllamaModel};
#[cfg(feature = "openai")]
pub use openai::{OpenAiConfig, OpenAiModel};
pub use policy::PolicyModel;
pub use replay::ReplayModel;
/// The HTTP client crate the providers use, for building the `reqwest::Client` given to
/// `OpenAiModel::with_client` / `OllamaModel::with_client` at the matching version.
#[cfg(any(feature = "openai", feature = "ollama"))]
pub use reqwest;
#[cfg(feature = "retry")]
pub use retry::Retrying;
pub use scripted::{RecordedRequest, ScriptedModel, Turn};
pub use types::{
    ChatEvent, ChatOptions, ChatResponse, ChatStream, FinishReason, KeepAlive, ResponseFormat,
    ToolCallDelta, Usage, collect_stream,
};
