use std::sync::Arc;

use async_trait::async_trait;
use keel_message::Message;
use keel_model::{ChatModel, ChatOptions, ChatResponse, FinishReason, Usage};
use keel_token::{ApproxCounter, ModelProfiles, TokenCounter};

use crate::input::{fit, render};
use crate::prompts::{EPOCH_V1, MILESTONE_V1, STRUCTURED_V1, Template, max_bullets};
use crate::summary::{parse_bullets, parse_sections};
use crate::{
    Level, Rejection, SECTIONS, SUMMARY, Section, SummarizeError, Summarizer, Summary,
    SummaryRequest,
};

/// The default cap on each message's characters in summarizer input.
pub const DEFAULT_MAX_MESSAGE_CHARS: usize = 1_500;

/// The shape an [`LlmSummarizer`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SummaryFormat {
    /// Bullet points: at most 5 for a milestone ([`MILESTONE_V1`]), at most 6 for an
    /// epoch ([`EPOCH_V1`]).
    #[default]
    Bullets,
    /// The four [`SECTIONS`] ([`STRUCTURED_V1`]) at either level.
    Structured,
}

/// A summarizer over any [`ChatModel`], at temperature 0, with versioned prompts.
///
/// * The prompt is one of the [`Template`]s ([`MILESTONE_V1`], [`EPOCH_V1`],
///   [`STRUCTURED_V1`]); its version is recorded on every [`Summary`].
/// * Input is bounded: each message is capped at
///   [`DEFAULT_MAX_MESSAGE_CHARS`] characters (head and tail kept), and the whole is
///   fitted to the summarizer model's own window (less the summary budget and the
///   prompt) by keeping the head and the tail of the span with the omitted middle
///   marked, never by keeping only the latest messages.
/// * The reply is asked for with `max_tokens` = the budget and checked: it must be
///   non-empty, not cut off, within the budget (counted with this summarizer's
///   counter), and in the requested shape (bullet count, or all four sections). A reply
///   that fails is retried once with the reason; a second failure is
///   [`SummarizeError::Rejected`]. Model errors are [`SummarizeError::Model`]. No error
///   text ever becomes a summary.
/// * The goal is never part of the input: callers pass no goal, and messages marked with
///   [`GOAL_METADATA_KEY`](crate::GOAL_METADATA_KEY) are refused.
///
/// ```
/// use std::sync::Arc;
/// use keel_message::Message;
/// use keel_model::ScriptedModel;
/// use keel_summarize::{LlmSummarizer, Summarizer, SummaryRequest};
///
/// let model = Arc::new(ScriptedModel::from_texts([
///     "- Ran `cargo test`: 2 failures in tests/api.rs\n- Decided to fix the parser first",
/// ]));
/// let summarizer = LlmSummarizer::new(model.clone());
/// let steps = [Message::user("make the tests pass"), Message::tool("c1", "2 failed")];
/// let summary = futures::executor::block_on(summarizer.summarize(&SummaryRequest::milestone(&steps, 200)))?;
/// assert_eq!(summary.prompt_version, "milestone-v1");
/// assert_eq!(summary.sections[0].items.len(), 2);
/// // Temperature 0, and the budget as the reply limit.
/// let sent = &model.requests()[0].options;
/// assert_eq!((sent.temperature, sent.max_tokens), (Some(0.0), Some(200)));
/// # Ok::<(), keel_summarize::SummarizeError>(())
/// ```
#[derive(Clone)]
pub struct LlmSummarizer {
    model: Arc<dyn ChatModel>,
    counter: Arc<dyn TokenCounter>,
    format: SummaryFormat,
    max_message_chars: usize,
    window_tokens: usize,
    options: ChatOptions,
}

impl std::fmt::Debug for LlmSummarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmSummarizer")
            .field("model", &self.model.model_name())
            .field("format", &self.format)
            .field("max_message_chars", &self.max_message_chars)
            .field("window_tokens", &self.window_tokens)
            .finish_non_exhaustive()
    }
}

impl LlmSummarizer {
    /// A bullet summarizer over `model`, counting with [`ApproxCounter`], with the
    /// window of the model's [`ModelProfiles`] entry (8,192 tokens when unknown).
    pub fn new(model: Arc<dyn ChatModel>) -> Self {
        let window_tokens = ModelProfiles::new()
            .lookup(model.model_name())
            .context_window;
        LlmSummarizer {
            model,
            counter: Arc::new(ApproxCounter::new()),
            format: SummaryFormat::Bullets,
            max_message_chars: DEFAULT_MAX_MESSAGE_CHARS,
            window_tokens,
            options: ChatOptions::new(),
        }
    }

    /// Counts tokens with `counter` (input fitting and the budget check).
    #[must_use]
    pub fn with_counter(mut self, counter: Arc<dyn TokenCounter>) -> Self {
        self.counter = counter;
        self
    }

    /// Asks for `format`.
    #[must_use]
    pub fn with_format(mut self, format: SummaryFormat) -> Self {
        self.format = format;
        self
    }

    /// Caps each input message at `chars` characters (at least 64).
    #[must_use]
    pub fn with_max_message_chars(mut self, chars: usize) -> Self {
        self.max_message_chars = chars.max(64);
        self
    }

    /// The summarizer model's context window, in tokens.
    #[must_use]
    pub fn with_window_tokens(mut self, tokens: usize) -> Self {
        self.window_tokens = tokens;
        self
    }

    /// Base options for every call (a timeout, `num_ctx`, ...). `temperature` is always
    /// 0 and `max_tokens` always the budget.
    #[must_use]
    pub fn with_options(mut self, options: ChatOptions) -> Self {
        self.options = options;
        self
    }

    /// The template used at `level`.
    pub fn template(&self, level: Level) -> Template {
        match (self.format, level) {
            (SummaryFormat::Structured, _) => STRUCTURED_V1,
            (SummaryFormat::Bullets, Level::Milestone) => MILESTONE_V1,
            (SummaryFormat::Bullets, Level::Epoch) => EPOCH_V1,
        }
    }

    /// The messages sent for `request`: the template as the system message, then one
    /// user message with the previous summary and the bounded input.
    pub fn build_prompt(
        &self,
        request: &SummaryRequest<'_>,
    ) -> Result<Vec<Message>, SummarizeError> {
        request.check()?;
        let template = self.template(request.level);
        let level = request.level;
        let mut head = String::new();
        if let Some(previous) = request.previous.filter(|p| !p.trim().is_empty()) {
            head.push_str(&format!(
                "Previous {level} summary:\n{}\n\n",
                previous.trim()
            ));
        }
        let what = match level {
            Level::Milestone => "Messages",
            Level::Epoch => "Milestone notes",
        };
        head.push_str(&format!(
            "{what} to summarize ({}, oldest first):\n",
            request.messages.len()
        ));
        let tail = format!(
            "\n\nWrite the {level} summary now, in at most {} tokens.",
            request.budget_tokens
        );
        let fixed = self.counter.count_text(template.system)
            + self.counter.count_text(&head)
            + self.counter.count_text(&tail)
            + 16;
        let needed = fixed + request.budget_tokens + 32;
        if self.window_tokens < needed {
            return Err(SummarizeError::BudgetTooSmall {
                budget: self.window_tokens,
                needed,
            });
        }
        let available = self.window_tokens - fixed - request.budget_tokens;
        let entries = render(request.messages, self.max_message_chars);
        let (body, omitted) = fit(&entries, self.counter.as_ref(), available)?;
        if omitted > 0 {
            tracing::debug!(omitted, "summarizer input fitted to the window");
        }
        Ok(vec![
            Message::system(template.system),
            Message::user(format!("{head}{body}{tail}")),
        ])
    }

    fn check_reply(
        &self,
        level: Level,
        budget: usize,
        reply: &ChatResponse,
    ) -> Result<(String, Vec<Section>), Rejection> {
        let raw = reply.text();
        let text = raw.trim();
        if text.is_empty() {
            return Err(Rejection::Empty);
        }
        if reply.finish_reason == Some(FinishReason::Length) {
            return Err(Rejection::Truncated);
        }
        let tokens = self.counter.count_text(text);
        if tokens > budget {
            return Err(Rejection::OverBudget { tokens, budget });
        }
        match self.format {
            SummaryFormat::Bullets => {
                let (bullets, _preamble) = parse_bullets(text);
                let max = max_bullets(level);
                if bullets.is_empty() {
                    return Err(Rejection::NoBullets);
                }
                if bullets.len() > max {
                    return Err(Rejection::TooManyBullets {
                        found: bullets.len(),
                        max,
                    });
                }
                let text = bullets.iter().map(|b| format!("- {b}\n")).collect();
                Ok((
                    text,
                    vec![Section {
                        title: SUMMARY.to_owned(),
                        items: bullets,
                    }],
                ))
            }
            SummaryFormat::Structured => {
                let found = parse_sections(text);
                let missing: Vec<String> = SECTIONS
                    .iter()
                    .filter(|t| !found.iter().any(|s| s.title == **t))
                    .map(|t| (*t).to_owned())
                    .collect();
                if !missing.is_empty() {
                    return Err(Rejection::MissingSections(missing));
                }
                // Canonical order; a repeated heading's items are merged.
                let sections: Vec<Section> = SECTIONS
                    .iter()
                    .map(|t| Section {
                        title: (*t).to_owned(),
                        items: found
                            .iter()
                            .filter(|s| s.title == *t)
                            .flat_map(|s| s.items.iter().cloned())
                            .filter(|i| !is_none_item(i))
                            .collect(),
                    })
                    .collect();
                Ok((render_sections(&sections), sections))
            }
        }
    }
}

fn is_none_item(item: &str) -> bool {
    let t = item.trim().trim_end_matches('.');
    t.eq_ignore_ascii_case("none")
        || t.eq_ignore_ascii_case("(none)")
        || t.eq_ignore_ascii_case("n/a")
}

/// Sections as text: each heading with a colon, then its items as bullets (`- none`
/// when empty).
pub(crate) fn render_sections(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections {
        out.push_str(&s.title);
        out.push_str(":\n");
        if s.items.is_empty() {
            out.push_str("- none\n");
        }
        for item in &s.items {
            out.push_str("- ");
            out.push_str(item);
            out.push('\n');
        }
    }
    out
}

fn add(total: Option<Usage>, more: Option<Usage>) -> Option<Usage> {
    match (total, more) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    }
}

#[async_trait]
impl Summarizer for LlmSummarizer {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        let mut messages = self.build_prompt(request)?;
        let budget = request.budget_tokens;
        let options = self
            .options
            .clone()
            .temperature(0.0)
            .max_tokens(u32::try_from(budget).unwrap_or(u32::MAX));
        let template = self.template(request.level);
        let mut usage = None;
        let mut attempts = 0;
        loop {
            let reply = self.model.chat(&messages, &[], &options).await?;
            attempts += 1;
            usage = add(usage, reply.usage);
            match self.check_reply(request.level, budget, &reply) {
                Ok((text, sections)) => {
                    return Ok(Summary {
                        level: request.level,
                        text,
                        sections,
                        prompt_version: template.version.to_owned(),
                        model: reply.model.clone(),
                        usage,
                    });
                }
                Err(reason) if attempts >= 2 => {
                    return Err(SummarizeError::Rejected { reason, attempts });
                }
                Err(reason) => {
                    tracing::warn!(%reason, "summary reply rejected; asking once more");
                    messages.push(Message::assistant(reply.text().into_owned()));
                    messages.push(Message::user(format!(
                        "That reply was rejected: {reason}. Write the summary again, following \
                         the instructions exactly."
                    )));
                }
            }
        }
    }
}
