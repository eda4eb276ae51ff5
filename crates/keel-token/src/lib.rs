//! Token counting for keel: how many tokens a text, a message or a whole prompt costs.
//!
//! The one abstraction is [`TokenCounter`]. An implementor writes
//! [`count_text`](TokenCounter::count_text); the trait adds the chat [`Framing`] on top
//! (OpenAI's documented overhead: 3 tokens per message, 1 per name, 3 to prime the
//! reply, tool calls and tool specs counted from their JSON), so every counter prices
//! [`Message`](keel_message::Message)s and [`ToolSpec`](keel_message::ToolSpec)s the
//! same way. Compaction asks it whether the assembled prompt still fits the model's
//! window; the offload policy asks it whether a tool result is too large to keep.
//!
//! The counters:
//!
//! * [`TiktokenCounter`] (feature `tiktoken`, on by default): exact counts for OpenAI's
//!   `o200k_base` and `cl100k_base`, identical to tiktoken's `encode_ordinary(..).len()`
//!   and several times faster (see the `engine` notes on [`TiktokenCounter`]).
//! * [`ApproxCounter`]: characters / 4, for vocabularies keel cannot load.
//! * [`CalibratedCounter`]: wraps any counter and scales it by a factor learned from
//!   the usage the provider reports, so estimates converge on the real bill.
//! * [`MemoCounter`]: wraps any counter and remembers each message's count by id and
//!   content hash, so recounting a growing conversation costs only the new messages.
//!
//! [`ModelProfiles`] maps model names to their window, output limit and encoding, and
//! [`ModelProfile::counter`] picks the right counter for a model.
//!
//! With `default-features = false` (no `tiktoken`) the crate has no vocabulary and no
//! `tiktoken-rs`: every counter is an estimate, and [`ModelProfile::counter`] gives an
//! [`ApproxCounter`] for OpenAI models too (logging a warning once).
//!
//! # Example
//!
//! ```
//! use keel_token::message::{Message, ToolCall, ToolSpec};
//! use keel_token::{CalibratedCounter, MemoCounter, ModelProfiles, TokenCounter};
//! use serde_json::json;
//!
//! let profiles = ModelProfiles::new();
//! let profile = profiles.lookup("gpt-4.1-2025-04-14");
//! assert_eq!(profile.context_window, 1_047_576);
//!
//! // Remember message counts, and learn from the provider's usage reports.
//! let counter = CalibratedCounter::new(MemoCounter::new(profile.counter()?));
//!
//! let history = vec![
//!     Message::system("You are a careful assistant.").with_id("m0"),
//!     Message::user("What is the weather in Paris?").with_id("m1"),
//!     Message::assistant("")
//!         .with_id("m2")
//!         .with_tool_calls(vec![ToolCall::new("c1", "get_weather", json!({"city": "Paris"}))]),
//!     Message::tool("c1", "18°C, light rain").with_id("m3"),
//! ];
//! let tools = [ToolSpec::new("get_weather", "Current weather for a city.", json!({
//!     "type": "object",
//!     "properties": {"city": {"type": "string"}},
//! }))];
//!
//! let estimate = counter.count_prompt(&history, &tools);
//! assert!(estimate < profile.input_budget());
//!
//! // After the call, feed back what the provider billed for the prompt.
//! counter.observe(estimate, estimate + 5);
//! assert!(counter.factor() > 1.0);
//! # Ok::<(), keel_token::TokenError>(())
//! ```

// Without `tiktoken` the docs still name `TiktokenCounter`; the links resolve with it.
#![cfg_attr(not(feature = "tiktoken"), allow(rustdoc::broken_intra_doc_links))]

mod approx;
mod calibrated;
mod counter;
mod encoding;
#[cfg(feature = "tiktoken")]
mod engine;
mod error;
mod memo;
mod profile;
#[cfg(feature = "tiktoken")]
mod tiktoken;

pub use approx::ApproxCounter;
pub use calibrated::CalibratedCounter;
pub use counter::{Framing, TokenCounter};
pub use encoding::Encoding;
pub use error::TokenError;
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use memo::{DEFAULT_MEMO_CAPACITY, MemoCounter, MemoStats};
pub use profile::{ModelProfile, ModelProfiles, builtin_profiles};
#[cfg(feature = "tiktoken")]
pub use tiktoken::TiktokenCounter;
