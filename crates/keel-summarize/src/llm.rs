use std::collections::HashSet;
use std::sync::{Arc, LazyLock};

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
///   non-empty, not cut off, within the budget (the fewer of the tokens the model
///   reports for its reply and this summarizer's counter's count), in the requested
///   shape (bullet count, or all four sections), and about
///   the input: it must share at least one distinctive term (a name, path, number or
///   uncommon word) with the span it summarizes, and a reply of ten or more such terms
///   must find at least one in ten of them in it ([`Rejection::Unrelated`]), and one
///   that reads like a provider's error ("rate limit exceeded", "internal server
///   error", "upstream", "quota", ...) must share at least two
///   ([`Rejection::ProviderError`]): some proxies answer 200 with their error as the
///   content. A reply that fails is retried once with the reason; a second failure is
///   [`SummarizeError::Rejected`]. Model errors are [`SummarizeError::Model`]. No error
///   text ever becomes a summary.
/// * A budget smaller than the shortest reply the checks accept (every heading with
///   `- none`, or one short bullet), or a window too small for the prompt and the
///   budget, is [`SummarizeError::BudgetTooSmall`] before any model call.
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
    /// window the client runs the model with ([`ChatModel::context_window`]: an
    /// `OllamaModel`'s `num_ctx`), else that of the model's [`ModelProfiles`] entry
    /// (8,192 tokens when unknown). Set it with
    /// [`with_window_tokens`](Self::with_window_tokens) when the server runs the model
    /// with a smaller one: a server may drop the start of a prompt over its window.
    pub fn new(model: Arc<dyn ChatModel>) -> Self {
        let window_tokens = model.context_window().unwrap_or_else(|| {
            ModelProfiles::new()
                .lookup(model.model_name())
                .context_window
        });
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

    /// Base options for every call (a timeout, a seed, ...). `temperature` is always
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
        self.prompt(request).map(|(messages, _)| messages)
    }

    /// The shortest reply [`Self::check_reply`]'s shape check accepts: every heading
    /// with `- none` (structured), or one short bullet.
    fn smallest_reply(&self) -> String {
        match self.format {
            SummaryFormat::Structured => render_sections(&SECTIONS.map(|title| Section {
                title: title.to_owned(),
                items: Vec::new(),
            })),
            SummaryFormat::Bullets => "- done\n".to_owned(),
        }
    }

    /// The prompt, and the terms of the input it shows the model (the previous summary
    /// and the fitted messages), which a reply must be about.
    fn prompt(
        &self,
        request: &SummaryRequest<'_>,
    ) -> Result<(Vec<Message>, Terms), SummarizeError> {
        request.check()?;
        // A budget no acceptable reply fits is refused before any model call: the
        // reply would be rejected as over budget, twice.
        let needed = self.counter.count_text(&self.smallest_reply());
        if request.budget_tokens < needed {
            return Err(SummarizeError::BudgetTooSmall {
                budget: request.budget_tokens,
                needed,
            });
        }
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
        let mut input = Terms::of(&body);
        if let Some(previous) = request.previous {
            input.add(previous);
        }
        Ok((
            vec![
                Message::system(template.system),
                Message::user(format!("{head}{body}{tail}")),
            ],
            input,
        ))
    }

    fn check_reply(
        &self,
        level: Level,
        budget: usize,
        input: &Terms,
        reply: &ChatResponse,
    ) -> Result<(String, Vec<Section>), Rejection> {
        let (text, sections) = self.check_shape(level, budget, reply)?;
        check_grounded(input, &sections)?;
        Ok((text, sections))
    }

    fn check_shape(
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
        let tokens = reply_tokens(&*self.counter, text, reply.usage.as_ref());
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

/// Phrases of provider and gateway errors (matched lowercase, anywhere in the reply).
const PROVIDER_ERROR_PHRASES: &[&str] = &[
    "rate limit",
    "ratelimit",
    "too many requests",
    "quota",
    "internal server error",
    "server error",
    "service unavailable",
    "temporarily unavailable",
    "bad gateway",
    "gateway timeout",
    "upstream",
    "overloaded",
    "try again later",
    "an error occurred",
    "invalid api key",
    "incorrect api key",
    "unauthorized",
];

/// Words that say nothing about what a span is about: common English, the labels of
/// the rendered input and the templates, and the vocabulary of provider errors (so an
/// error text does not count as being about a span that merely mentions an error).
const NOT_DISTINCTIVE: [&str; 3] = [
    "the and for with that this these those from into onto was were are been being has \
     have had not but all any can could will would should may might must then than its \
     also only when which what who how why where there their they them now our out one \
     two some more most each other such very just yet still did does done you your about \
     after before here over under per via nor both new use used using get got set see",
    "user assistant system tool result call calls message messages omitted characters \
     summary milestone epoch note notes step steps none session intent artifacts next \
     previous",
    "error errors rate limit limits exceed exceeded reach reached too many request \
     requests response internal server service unavailable temporarily bad gateway \
     timeout upstream quota overloaded please try again later retry occurred invalid api \
     key unauthorized authentication insufficient status code model provider failed \
     failure",
];

/// [`NOT_DISTINCTIVE`] as a set, built once.
fn not_distinctive(word: &str) -> bool {
    static WORDS: LazyLock<HashSet<&'static str>> = LazyLock::new(|| {
        NOT_DISTINCTIVE
            .iter()
            .flat_map(|list| list.split_whitespace())
            .collect()
    });
    WORDS.contains(word)
}

/// The distinctive terms of a text: its words and numbers, lowercased and lightly
/// stemmed (`fails`, `failed`, `failing` are one term), less [`NOT_DISTINCTIVE`].
#[derive(Debug, Default)]
struct Terms(HashSet<String>);

impl Terms {
    fn of(text: &str) -> Self {
        let mut terms = Terms::default();
        terms.add(text);
        terms
    }

    fn add(&mut self, text: &str) {
        for word in text.split(|c: char| !c.is_alphanumeric()) {
            if word.chars().any(is_cjk) {
                self.add_cjk(word);
            } else if let Some(term) = term(word) {
                self.0.insert(term);
            }
        }
    }

    /// Chinese, Japanese and Korean text has no spaces between words: each pair of
    /// neighbouring characters is a term, and the rest of the word as usual.
    fn add_cjk(&mut self, word: &str) {
        let mut previous = None;
        let mut other = String::new();
        for c in word.chars() {
            if is_cjk(c) {
                if let Some(p) = previous {
                    self.0.insert(format!("{p}{c}"));
                }
                previous = Some(c);
                if let Some(term) = term(&std::mem::take(&mut other)) {
                    self.0.insert(term);
                }
            } else {
                previous = None;
                other.push(c);
            }
        }
        if let Some(term) = term(&other) {
            self.0.insert(term);
        }
    }

    /// How many of `other`'s terms are also ours.
    fn shared(&self, other: &Terms) -> usize {
        other.0.iter().filter(|t| self.0.contains(*t)).count()
    }
}

/// Han, kana and Hangul: scripts written without spaces between words.
fn is_cjk(c: char) -> bool {
    matches!(
        c,
        '\u{3040}'..='\u{30ff}'
            | '\u{3400}'..='\u{4dbf}'
            | '\u{4e00}'..='\u{9fff}'
            | '\u{ac00}'..='\u{d7af}'
            | '\u{f900}'..='\u{faff}'
    )
}

/// A word as a term, or `None` when it carries nothing: shorter than three
/// characters (two for numbers), or [`NOT_DISTINCTIVE`].
fn term(word: &str) -> Option<String> {
    let lower = word.to_lowercase();
    let chars = lower.chars().count();
    let numeric = lower.chars().any(char::is_numeric);
    if chars < 2 || (chars < 3 && !numeric) || not_distinctive(&lower) {
        return None;
    }
    Some(stem(&lower))
}

/// Drops one common English ending, then a final `e`, keeping at least three
/// characters: `files` and `file`, `passes` and `pass`, `failing` and `fails` meet.
fn stem(word: &str) -> String {
    let mut stem = word;
    for suffix in ["ing", "ed", "es", "s"] {
        if let Some(rest) = stem.strip_suffix(suffix)
            && rest.chars().count() >= 3
            && !(suffix == "s" && rest.ends_with('s'))
        {
            stem = rest;
            break;
        }
    }
    if let Some(rest) = stem.strip_suffix('e')
        && rest.chars().count() >= 3
    {
        stem = rest;
    }
    stem.to_owned()
}

/// Whether a reply is about its input: see [`LlmSummarizer`]. An input with no
/// distinctive term at all cannot be checked and passes.
fn check_grounded(input: &Terms, sections: &[Section]) -> Result<(), Rejection> {
    if input.0.is_empty() {
        return Ok(());
    }
    let mut reply = Terms::default();
    let mut text = String::new();
    for item in sections.iter().flat_map(|s| &s.items) {
        reply.add(item);
        text.push_str(&item.to_lowercase());
        text.push('\n');
    }
    let shared = input.shared(&reply);
    if shared < 2
        && let Some(phrase) = PROVIDER_ERROR_PHRASES.iter().find(|p| text.contains(**p))
    {
        return Err(Rejection::ProviderError((*phrase).to_owned()));
    }
    // None shared, or one in ten at most from a reply long enough to judge: it is
    // about something else (a small model's invention sharing a word by chance).
    let terms = reply.0.len();
    if shared == 0 || (terms >= MIN_TERMS_TO_JUDGE && shared * 10 < terms) {
        return Err(Rejection::Unrelated);
    }
    Ok(())
}

/// The fewest distinct terms a reply needs before the share of them found in the
/// input is judged (below it, one shared term is enough).
const MIN_TERMS_TO_JUDGE: usize = 10;

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
        let (mut messages, input) = self.prompt(request)?;
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
            match self.check_reply(request.level, budget, &input, &reply) {
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

/// The tokens of a summary reply, for the budget check: the fewer of what the model
/// reports for its reply (`usage.completion_tokens`, when it reports any) and what
/// `counter` counts in `text`. The model's own count is the truth its `max_tokens` of
/// the budget held it to; an estimate that leans high (as `ApproxCounter` does, on
/// purpose) would refuse replies the model kept within it.
pub fn reply_tokens(
    counter: &dyn keel_token::TokenCounter,
    text: &str,
    usage: Option<&keel_model::Usage>,
) -> usize {
    let estimate = counter.count_text(text);
    usage
        .and_then(|u| usize::try_from(u.completion_tokens).ok())
        .filter(|&reported| reported > 0)
        .map_or(estimate, |reported| reported.min(estimate))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grounded(input: &str, reply: &[&str]) -> Result<(), Rejection> {
        let sections = [Section {
            title: SUMMARY.to_owned(),
            items: reply.iter().map(|s| (*s).to_owned()).collect(),
        }];
        check_grounded(&Terms::of(input), &sections)
    }

    #[test]
    fn endings_meet_and_common_words_are_no_terms() {
        for (a, b) in [
            ("fails", "failing"),
            ("file", "files"),
            ("passes", "pass"),
            ("tests", "testing"),
        ] {
            assert_eq!(term(a), term(b), "{a} {b}");
        }
        for word in ["the", "Error", "upstream", "a", "x", "ok"] {
            assert_eq!(term(word), None, "{word}");
        }
        assert_eq!(term("88").as_deref(), Some("88"));
        assert_eq!(term("MSG").as_deref(), Some("msg"));
    }

    #[test]
    fn a_reply_must_name_something_of_its_input() {
        let input = "gcc -c net.c\nnet.c:88: error: 'MSG_NOSIGNAL' undeclared";
        assert_eq!(grounded(input, &["net.c:88 does not compile"]), Ok(()));
        assert_eq!(grounded(input, &["MSG_NOSIGNAL is undeclared"]), Ok(()));
        assert_eq!(
            grounded(input, &["Everything went well"]),
            Err(Rejection::Unrelated)
        );
        // One shared term is not enough for a reply that reads like a provider error.
        assert_eq!(
            grounded(input, &["upstream error compiling net.c, try again later"]),
            Err(Rejection::ProviderError("upstream".into()))
        );
        // An input with nothing distinctive cannot be checked.
        assert_eq!(grounded("ok", &["Everything went well"]), Ok(()));
    }

    #[test]
    fn a_long_reply_must_find_one_in_ten_of_its_terms_in_the_input() {
        let input = "cargo test -p keel-agent\ntest tools::timeout ... FAILED\n\
                     thread panicked at crates/keel-agent/src/tools.rs:88: deadline elapsed";
        // An invention that shares one word by chance (`cargo`) among a dozen others.
        let invented = [
            "Booked a flight to Lisbon for the cargo shipment",
            "Hotel reservation confirmed with breakfast included",
            "Customer asked about refund policy details",
        ];
        assert_eq!(grounded(input, &invented), Err(Rejection::Unrelated));
        // A paraphrase in words of its own, naming a few things of the input.
        let paraphrase = [
            "The keel-agent suite has one failing check: tools timeout",
            "It panicked in tools.rs line 88 because the deadline elapsed",
            "Next: investigate why the scheduled work overruns its allowance",
        ];
        assert_eq!(grounded(input, &paraphrase), Ok(()));
        // Short replies are judged by one shared term, as before.
        assert_eq!(grounded(input, &["Flight to Lisbon, cargo"]), Ok(()));
    }

    #[test]
    fn text_without_spaces_is_compared_by_character_pairs() {
        let input = "构建失败：net.c 第88行 未声明 MSG_NOSIGNAL";
        assert_eq!(grounded(input, &["构建失败，原因未知"]), Ok(()));
        assert_eq!(grounded(input, &["一切顺利"]), Err(Rejection::Unrelated));
        assert_eq!(grounded("ビルドが失敗した", &["ビルドの失敗"]), Ok(()));
    }
}
