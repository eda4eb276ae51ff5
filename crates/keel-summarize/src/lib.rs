//! Summarizers for keel's hierarchical context compaction.
//!
//! The one abstraction is [`Summarizer`]: given a [`SummaryRequest`] — a span of
//! messages, the previous summary of the same [`Level`] (milestone or epoch), and a
//! token budget — it returns a [`Summary`]: the text, its [`Section`]s, the version of
//! the prompt that wrote it, the model, and the model's usage. Compaction calls it to
//! turn raw steps into milestones and milestones into epochs.
//!
//! Two implementations:
//!
//! * [`ExtractiveSummarizer`], the embedded default: deterministic, offline, no model.
//!   It keeps the lines that carry signal (errors, file paths, commands and their exit
//!   status, decisions, numbers, the user's asks) verbatim, in the four [`SECTIONS`]:
//!   SESSION INTENT, SUMMARY, ARTIFACTS, NEXT STEPS.
//! * [`LlmSummarizer`], over any [`keel_model::ChatModel`] at temperature 0, with
//!   versioned prompt templates ([`MILESTONE_V1`], [`EPOCH_V1`], [`STRUCTURED_V1`]),
//!   bounded input (each message capped, the whole fitted to the summarizer's window by
//!   keeping head and tail), and checked replies (non-empty, not cut off, within budget,
//!   in shape; one retry, then [`SummarizeError::Rejected`]).
//!
//! Give the summarizer its own model client, not the agent's: a slow or rate-limited
//! summarizer then never takes the agent's connection slots.
//!
//! **The goal anchor is never summarizer input.** Callers pass the span and the
//! previous summary, never the goal; a message marked with [`GOAL_METADATA_KEY`] is
//! refused with [`SummarizeError::GoalInInput`]. A failed summary is always an error,
//! never a summary containing error text.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use keel_summarize::message::{Message, ToolCall};
//! use keel_summarize::model::{ModelError, ScriptedModel, Turn};
//! use keel_summarize::{
//!     ExtractiveSummarizer, LlmSummarizer, SummarizeError, Summarizer, SummaryRequest,
//!     GOAL_METADATA_KEY, SUMMARY,
//! };
//! use serde_json::json;
//!
//! let steps = vec![
//!     Message::user("Why does `make` fail?"),
//!     Message::assistant("").with_tool_calls(vec![ToolCall::new("c1", "sh", json!({"cmd": "make"}))]),
//!     Message::tool("c1", "cc -o app main.c\nmain.c:3:10: fatal error: zlib.h: No such file or directory\nexit status 2"),
//! ];
//! let request = SummaryRequest::milestone(&steps, 120);
//!
//! // The offline default.
//! let extractive = ExtractiveSummarizer::new();
//! let summary = futures::executor::block_on(extractive.summarize(&request))?;
//! assert!(summary.section(SUMMARY).unwrap_or_default()[0].contains("zlib.h: No such file"));
//! assert_eq!(summary.prompt_version, "extractive-v1");
//!
//! // An LLM summarizer whose provider is down: an error, not a summary.
//! let down = Arc::new(ScriptedModel::new([Turn::fail(ModelError::Connection("refused".into()))]));
//! let llm = LlmSummarizer::new(down);
//! let failed = futures::executor::block_on(llm.summarize(&request));
//! assert!(matches!(failed, Err(SummarizeError::Model(_))));
//!
//! // The goal is refused.
//! let goal = Message::system("Ship v2").with_metadata(GOAL_METADATA_KEY, json!(true));
//! let with_goal = [goal, Message::user("hi")];
//! let refused = extractive.summarize_sync(&SummaryRequest::milestone(&with_goal, 120));
//! assert!(matches!(refused, Err(SummarizeError::GoalInInput { index: 0 })));
//! # Ok::<(), SummarizeError>(())
//! ```

mod error;
mod extractive;
mod input;
mod llm;
mod prompts;
mod summary;

/// The attribute [`Summarizer`] is written with: put `#[keel_summarize::async_trait]` on
/// your `impl Summarizer for ...` (no `async-trait` dependency of your own needed).
pub use async_trait::async_trait;
pub use error::{Rejection, SummarizeError};
pub use extractive::{
    BLOCKING_POOL_BYTES, EXTRACTIVE_MODEL, EXTRACTIVE_VERSION, ExtractiveSummarizer,
};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
/// The model contract (keel-model) that [`LlmSummarizer`] calls, re-exported so a user
/// of this crate alone needs no second dependency and no matching version. Built
/// without providers: this crate's `openai` and `ollama` features bring
/// `model::OpenAiModel` and `model::OllamaModel`; the extractive summarizer needs
/// neither (and no HTTP client).
pub use keel_model as model;
pub use llm::{DEFAULT_MAX_MESSAGE_CHARS, LlmSummarizer, SummaryFormat, reply_tokens};
pub use prompts::{EPOCH_V1, MILESTONE_V1, STRUCTURED_V1, Template};
pub use summary::{
    ARTIFACTS, GOAL_METADATA_KEY, Level, NEXT_STEPS, SECTIONS, SESSION_INTENT, SUMMARY, Section,
    Summarizer, Summary, SummaryRequest, is_goal, parse_sections,
};
