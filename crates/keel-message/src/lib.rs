//! The message model every keel crate speaks.
//!
//! An agent's history is a list of [`Message`]s: a system prompt, the user's asks,
//! assistant turns that may carry [`ToolCall`]s, and tool results that answer them by
//! `tool_call_id`. Tools an agent may call are described by [`ToolSpec`]s. Reducers
//! merge messages into state, token counters price them, compaction summarizes and
//! archives them; all of them use these types and nothing else.
//!
//! Three serialized forms are supported:
//!
//! * keel's own JSON (plain `serde`), lossless for every field;
//! * OpenAI chat-completions messages, in [`openai`] (tool-call `arguments` are JSON
//!   *strings* on the wire);
//! * LangChain message dicts, in [`langchain`] (`type` human/ai/system/tool, tool-call
//!   `args` as JSON objects).
//!
//! Importers never guess: malformed input is a [`FormatError`] that names the message
//! index and the field. Tool-call arguments that are not valid JSON are kept verbatim as
//! [`ToolArguments::Invalid`] rather than dropped.
//!
//! Two small contracts live here too, because every layer shares them: the [`Tool`]
//! trait (the offload retrieval tools and the agent runtime both implement and call
//! it), and [`RetryPolicy`], the one retry policy of graph nodes, model calls and
//! summaries.
//!
//! # Example
//!
//! ```
//! use keel_message::{openai, Message, Role, ToolCall};
//! use serde_json::json;
//!
//! let history = vec![
//!     Message::system("You are a careful assistant."),
//!     Message::user("What is the weather in Paris?"),
//!     Message::assistant("").with_tool_calls(vec![ToolCall::new(
//!         "call_1",
//!         "get_weather",
//!         json!({"city": "Paris"}),
//!     )]),
//!     Message::tool("call_1", "18°C, light rain"),
//! ];
//!
//! // Export to the OpenAI wire format and back: nothing the format can hold is lost.
//! let wire = openai::to_values(&history);
//! assert_eq!(wire[2]["tool_calls"][0]["function"]["arguments"], r#"{"city":"Paris"}"#);
//! let back = openai::from_values(&wire)?;
//! assert_eq!(back, history);
//! assert_eq!(back[3].role, Role::Tool);
//! # Ok::<(), keel_message::FormatError>(())
//! ```

mod callable;
mod content;
mod error;
pub mod langchain;
mod message;
pub mod openai;
mod retry;
mod tool;
mod value;

pub use callable::{FnTool, Tool, ToolContext, ToolError, ToolFuture, tool_fn};
pub use content::{Content, ContentPart};
pub use error::{FormatError, Problem};
pub use message::{Message, Role, answered_calls, answered_tool_calls};
pub use retry::{RetryPolicy, RetryPolicyError};
pub use tool::{ToolArguments, ToolCall, ToolSpec};

/// Free-form metadata attached to a [`Message`] (a JSON object, insertion-ordered).
pub type Metadata = serde_json::Map<String, serde_json::Value>;
