//! An LLM summarizer whose requests reuse the agent's cached prompt prefix.
//!
//! A provider caches a prompt's prefix. The agent's last prompt was `[system, goal,
//! summaries, raw...]`; a summary request that starts with the same system prompt,
//! goal, summaries and tools, then the span to summarize verbatim (which is how the
//! agent's prompt continued), and puts the instruction last, is read almost entirely
//! from the cache. A summarizer given only the span, under its own system prompt,
//! pays for all of it again.
//!
//! The goal is in the prefix as context, exactly as the agent saw it; it is not part
//! of the span, and the instruction says not to restate it (invariant 1: it is never
//! text for the summarizer to rewrite).

use std::sync::Arc;

use keel_message::{Message, ToolSpec};
use keel_model::{ChatModel, ChatOptions, FinishReason};
use keel_summarize::{
    Level, Rejection, STRUCTURED_V1, SummarizeError, Summary, SummaryRequest, parse_sections,
};
use keel_token::TokenCounter;

/// Summarizes with a [`ChatModel`] through the agent's cached prefix; set it with
/// [`crate::Compactor::with_prefix_summarizer`].
///
/// ```
/// use std::sync::Arc;
/// use keel_compaction::PrefixSummarizer;
/// use keel_compaction::message::Message;
/// use keel_compaction::summarize::SummaryRequest;
/// use keel_compaction::token::ApproxCounter;
///
/// let s = PrefixSummarizer::new(Arc::new(keel_compaction::model::ScriptedModel::new([])), Arc::new(ApproxCounter::new()));
/// let prefix = [Message::system("You are a travel agent."), Message::user("Book me to Lisbon.")];
/// let span = [Message::assistant("Searching."), Message::tool("c1", "TP123 at 08:00")];
/// let request = s.request(&prefix, &SummaryRequest::milestone(&span, 200));
/// assert_eq!(&request[..2], &prefix);        // the cached prefix, as the agent sent it
/// assert_eq!(&request[2..4], &span);         // the span, verbatim
/// assert!(request[4].text().contains("SESSION INTENT")); // the instruction, last
/// ```
#[derive(Clone)]
pub struct PrefixSummarizer {
    model: Arc<dyn ChatModel>,
    counter: Arc<dyn TokenCounter>,
    options: ChatOptions,
}

impl std::fmt::Debug for PrefixSummarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixSummarizer")
            .field("model", &self.model.model_name())
            .finish_non_exhaustive()
    }
}

/// The prompt version recorded on its summaries.
pub const PREFIX_VERSION: &str = "prefix-structured-v1";

impl PrefixSummarizer {
    /// A summarizer calling `model` at temperature 0, counting budgets with `counter`.
    pub fn new(model: Arc<dyn ChatModel>, counter: Arc<dyn TokenCounter>) -> Self {
        PrefixSummarizer {
            model,
            counter,
            options: ChatOptions::default().temperature(0.0),
        }
    }

    /// Replaces the call options (the reply limit is set from the budget).
    #[must_use]
    pub fn with_options(mut self, options: ChatOptions) -> Self {
        self.options = options;
        self
    }

    /// The messages sent: `prefix` (the agent's prompt before the span), the span, and
    /// the instruction as the last user message.
    pub fn request(&self, prefix: &[Message], request: &SummaryRequest<'_>) -> Vec<Message> {
        let what = match request.level {
            Level::Milestone => "messages",
            Level::Epoch => "summary notes",
        };
        let mut instruction = format!(
            "{}\n\nThe input is the last {} {what} above (everything before them is context \
             you must not summarize, and the goal is kept elsewhere). Write at most {} tokens.",
            STRUCTURED_V1.system,
            request.messages.len(),
            request.budget_tokens,
        );
        if let Some(previous) = request.previous {
            instruction.push_str("\n\nMerge in this earlier note:\n");
            instruction.push_str(previous);
        }
        let mut out = Vec::with_capacity(prefix.len() + request.messages.len() + 1);
        out.extend_from_slice(prefix);
        out.extend_from_slice(request.messages);
        out.push(Message::user(instruction));
        out
    }

    /// Summarizes `request.messages`, sending `prefix` and `tools` first as the agent
    /// did. A reply that is empty, cut off, without sections or over the budget is an
    /// error, never a summary.
    pub async fn summarize(
        &self,
        prefix: &[Message],
        tools: &[ToolSpec],
        request: &SummaryRequest<'_>,
    ) -> Result<Summary, SummarizeError> {
        request.check()?;
        let messages = self.request(prefix, request);
        let mut options = self.options.clone();
        options.max_tokens = Some(u32::try_from(request.budget_tokens).unwrap_or(u32::MAX));
        let response = self
            .model
            .chat(&messages, tools, &options)
            .await
            .map_err(SummarizeError::Model)?;
        let reject = |reason| SummarizeError::Rejected {
            reason,
            attempts: 1,
        };
        let text = response.message.text().trim().to_owned();
        if text.is_empty() {
            return Err(reject(Rejection::Empty));
        }
        if response.finish_reason == Some(FinishReason::Length) {
            return Err(reject(Rejection::Truncated));
        }
        let sections = parse_sections(&text);
        if sections.is_empty() {
            return Err(reject(Rejection::MissingSections(vec![
                keel_summarize::SUMMARY.to_owned(),
            ])));
        }
        let tokens = keel_summarize::reply_tokens(&*self.counter, &text, response.usage.as_ref());
        if tokens > request.budget_tokens + request.budget_tokens / 4 {
            return Err(reject(Rejection::OverBudget {
                tokens,
                budget: request.budget_tokens,
            }));
        }
        Ok(Summary::new(
            request.level,
            text,
            sections,
            PREFIX_VERSION,
            response.model,
        )
        .with_usage(response.usage))
    }
}
