use std::fmt;

use async_trait::async_trait;
use keel_message::Message;
use keel_model::Usage;

use crate::SummarizeError;

/// The metadata key that marks the goal anchor. A message carrying it is refused by
/// every summarizer in this crate with [`SummarizeError::GoalInInput`]: the goal is
/// re-asserted verbatim by the compaction engine and never rewritten.
pub const GOAL_METADATA_KEY: &str = "keel.goal";

/// The heading of the section with what the user asked for in the summarized span.
pub const SESSION_INTENT: &str = "SESSION INTENT";
/// The heading of the section with what was done, found, decided, and what failed.
pub const SUMMARY: &str = "SUMMARY";
/// The heading of the section with files, commands and their exit status.
pub const ARTIFACTS: &str = "ARTIFACTS";
/// The heading of the section with pending actions and blockers.
pub const NEXT_STEPS: &str = "NEXT STEPS";
/// The sections of a structured summary, in order.
pub const SECTIONS: [&str; 4] = [SESSION_INTENT, SUMMARY, ARTIFACTS, NEXT_STEPS];

/// Which layer of the compaction hierarchy a summary belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// A summary of raw steps (messages).
    Milestone,
    /// A summary of milestones (and the previous epoch summary).
    Epoch,
}

impl Level {
    /// `milestone` or `epoch`.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Milestone => "milestone",
            Level::Epoch => "epoch",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to summarize.
///
/// Callers pass the span to compress and the previous summary of the same level; they
/// never pass the goal. Messages flagged with [`GOAL_METADATA_KEY`] are refused.
///
/// ```
/// use keel_message::Message;
/// use keel_summarize::{Level, SummaryRequest};
///
/// let steps = [Message::user("run the tests"), Message::assistant("2 failed")];
/// let request = SummaryRequest::milestone(&steps, 300).previous("- set up the repo");
/// assert_eq!(request.level, Level::Milestone);
/// assert_eq!(request.previous, Some("- set up the repo"));
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SummaryRequest<'a> {
    /// Milestone or epoch.
    pub level: Level,
    /// The span to summarize: raw messages for a milestone, milestone summaries (as
    /// messages) for an epoch.
    pub messages: &'a [Message],
    /// The previous summary of this level, merged into the new one.
    pub previous: Option<&'a str>,
    /// The most tokens the summary may have.
    pub budget_tokens: usize,
    /// Summaries that stay in the prompt beside the new one (the other milestones and
    /// epochs): what they say need not be said again. The extractive summarizer leaves
    /// out an item one of them has word for word; a model summarizer may ignore them.
    pub known: &'a [&'a str],
}

impl<'a> SummaryRequest<'a> {
    /// A request at `level`.
    pub fn new(level: Level, messages: &'a [Message], budget_tokens: usize) -> Self {
        SummaryRequest {
            level,
            messages,
            previous: None,
            budget_tokens,
            known: &[],
        }
    }

    /// A milestone request.
    pub fn milestone(messages: &'a [Message], budget_tokens: usize) -> Self {
        Self::new(Level::Milestone, messages, budget_tokens)
    }

    /// An epoch request.
    pub fn epoch(messages: &'a [Message], budget_tokens: usize) -> Self {
        Self::new(Level::Epoch, messages, budget_tokens)
    }

    /// Sets the previous summary of this level.
    #[must_use]
    pub fn previous(mut self, summary: &'a str) -> Self {
        self.previous = Some(summary);
        self
    }

    /// Sets the summaries that stay in the prompt beside the new one.
    #[must_use]
    pub fn known(mut self, summaries: &'a [&'a str]) -> Self {
        self.known = summaries;
        self
    }

    /// Fails with [`SummarizeError::GoalInInput`] if a message is the goal anchor, and
    /// with [`SummarizeError::EmptyInput`] if there is nothing to summarize.
    pub fn check(&self) -> Result<(), SummarizeError> {
        if let Some(index) = self.messages.iter().position(is_goal) {
            return Err(SummarizeError::GoalInInput { index });
        }
        if self.messages.is_empty() && self.previous.is_none_or(|p| p.trim().is_empty()) {
            return Err(SummarizeError::EmptyInput);
        }
        Ok(())
    }
}

/// True when a message carries [`GOAL_METADATA_KEY`] (with any value but `false` or
/// `null`).
pub fn is_goal(message: &Message) -> bool {
    message
        .metadata
        .get(GOAL_METADATA_KEY)
        .is_some_and(|v| !(v.is_null() || v.as_bool() == Some(false)))
}

/// One section of a summary: a heading and its bullet items.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The heading (one of [`SECTIONS`] for structured summaries, [`SUMMARY`] for
    /// bullet summaries).
    pub title: String,
    /// The bullet items, without their markers.
    pub items: Vec<String>,
}

/// A finished summary. A summarizer of your own builds one with [`Summary::new`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Summary {
    /// Milestone or epoch.
    pub level: Level,
    /// The summary text as it goes into the prompt.
    pub text: String,
    /// The text parsed into sections.
    pub sections: Vec<Section>,
    /// The version of the prompt template (or algorithm) that produced it.
    pub prompt_version: String,
    /// The model that wrote it (`extractive` for the extractive summarizer).
    pub model: String,
    /// Tokens the model was billed, summed over attempts (`None` when it reported none
    /// or no model was used).
    pub usage: Option<Usage>,
}

impl Summary {
    /// A summary at `level`: the text that goes into the prompt, the sections it
    /// parses into, the version of the prompt template (or algorithm) and the model
    /// that wrote it, with no usage ([`Summary::with_usage`] adds it).
    ///
    /// ```
    /// use keel_summarize::{Level, SUMMARY, Section, Summary};
    ///
    /// let items = vec!["the build fails at net.c:88".to_owned()];
    /// let summary = Summary::new(
    ///     Level::Milestone,
    ///     "- the build fails at net.c:88\n",
    ///     vec![Section { title: SUMMARY.to_owned(), items }],
    ///     "my-notes-v1",
    ///     "my-summarizer",
    /// );
    /// assert_eq!(summary.section(SUMMARY).map(<[String]>::len), Some(1));
    /// assert_eq!(summary.usage, None);
    /// ```
    pub fn new(
        level: Level,
        text: impl Into<String>,
        sections: Vec<Section>,
        prompt_version: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        Self {
            level,
            text: text.into(),
            sections,
            prompt_version: prompt_version.into(),
            model: model.into(),
            usage: None,
        }
    }

    /// Sets the tokens the model was billed.
    #[must_use]
    pub fn with_usage(mut self, usage: Option<Usage>) -> Self {
        self.usage = usage;
        self
    }

    /// The items of the section titled `title` (case-insensitive).
    pub fn section(&self, title: &str) -> Option<&[String]> {
        self.sections
            .iter()
            .find(|s| s.title.eq_ignore_ascii_case(title))
            .map(|s| s.items.as_slice())
    }
}

/// Summarizes a span of an agent's history at a level, within a token budget.
///
/// Object safe: compaction holds an `Arc<dyn Summarizer>`. A failed summary (the
/// provider is down, the reply is empty, malformed or over budget) is an error, never a
/// summary that contains error text.
///
/// ```
/// use keel_message::Message;
/// use keel_summarize::{ExtractiveSummarizer, Summarizer, SummaryRequest, NEXT_STEPS};
///
/// let summarizer: Box<dyn Summarizer> = Box::new(ExtractiveSummarizer::new());
/// let steps = [
///     Message::user("Please make the build pass."),
///     Message::tool("c1", "error[E0425]: cannot find value `x` in src/main.rs"),
/// ];
/// let summary = futures::executor::block_on(summarizer.summarize(&SummaryRequest::milestone(&steps, 200)))?;
/// assert!(summary.text.contains("src/main.rs"));
/// assert!(summary.section(NEXT_STEPS).is_some());
/// # Ok::<(), keel_summarize::SummarizeError>(())
/// ```
#[async_trait]
pub trait Summarizer: Send + Sync {
    /// Summarizes `request.messages` (merging `request.previous`) within
    /// `request.budget_tokens`.
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError>;
}

#[async_trait]
impl<T: Summarizer + ?Sized> Summarizer for std::sync::Arc<T> {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        (**self).summarize(request).await
    }
}

#[async_trait]
impl<T: Summarizer + ?Sized> Summarizer for Box<T> {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        (**self).summarize(request).await
    }
}

/// The bullet text of a line (`- x`, `* x`, `• x`, `1. x`, `1) x`), if it is a bullet.
pub(crate) fn bullet_text(line: &str) -> Option<&str> {
    let t = line.trim_start();
    for marker in ["- ", "* ", "• ", "– "] {
        if let Some(rest) = t.strip_prefix(marker) {
            return Some(rest.trim());
        }
    }
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits > 0 && digits < 4 {
        let rest = &t[digits..];
        if let Some(r) = rest.strip_prefix(". ").or_else(|| rest.strip_prefix(") ")) {
            return Some(r.trim());
        }
    }
    None
}

/// The section title a line names, if it is a heading of one of [`SECTIONS`]
/// (`SUMMARY:`, `## Summary`, `**NEXT STEPS:**`, ...).
pub(crate) fn heading_of(line: &str) -> Option<&'static str> {
    let t = line
        .trim()
        .trim_start_matches('#')
        .trim_matches(|c: char| c == '*' || c == '_' || c.is_whitespace());
    let t = t
        .strip_suffix(':')
        .unwrap_or(t)
        .trim_end_matches(['*', '_']);
    let t = t.strip_suffix(':').unwrap_or(t).trim();
    SECTIONS.into_iter().find(|s| s.eq_ignore_ascii_case(t))
}

/// Parses text into [`SECTIONS`]: items are bullets (or plain lines) under a heading.
/// Lines before the first heading are ignored. Returns the sections found, in the
/// order they appear.
///
/// ```
/// let sections = keel_summarize::parse_sections("SUMMARY:\n- fixed a bug\nNEXT STEPS:\n- none\n");
/// assert_eq!(sections.len(), 2);
/// assert_eq!(sections[0].items, ["fixed a bug"]);
/// ```
pub fn parse_sections(text: &str) -> Vec<Section> {
    let mut sections: Vec<Section> = Vec::new();
    for line in text.lines() {
        if let Some(title) = heading_of(line) {
            sections.push(Section {
                title: title.to_owned(),
                items: Vec::new(),
            });
            continue;
        }
        let Some(current) = sections.last_mut() else {
            continue;
        };
        if let Some(item) = bullet_text(line) {
            if !item.is_empty() {
                current.items.push(item.to_owned());
            }
        } else if !line.trim().is_empty() {
            match current.items.last_mut() {
                Some(last) if line.starts_with([' ', '\t']) => {
                    last.push(' ');
                    last.push_str(line.trim());
                }
                _ => current.items.push(line.trim().to_owned()),
            }
        }
    }
    sections
}

/// The bullet items of a bullet-list reply; continuation lines join their bullet.
/// Text that is not part of a bullet is returned in the second value.
pub(crate) fn parse_bullets(text: &str) -> (Vec<String>, Vec<String>) {
    let mut bullets: Vec<String> = Vec::new();
    let mut stray = Vec::new();
    for line in text.lines() {
        if let Some(item) = bullet_text(line) {
            bullets.push(item.to_owned());
        } else if !line.trim().is_empty() {
            match bullets.last_mut() {
                Some(last) if line.starts_with([' ', '\t']) => {
                    last.push(' ');
                    last.push_str(line.trim());
                }
                _ => stray.push(line.trim().to_owned()),
            }
        }
    }
    (bullets, stray)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_in_several_styles() {
        for line in [
            "SUMMARY:",
            "## Summary",
            "**NEXT STEPS:**",
            "**Next steps**:",
            "Session Intent",
        ] {
            assert!(heading_of(line).is_some(), "{line}");
        }
        assert_eq!(heading_of("Summary of the run"), None);
    }

    #[test]
    fn bullets_and_continuations() {
        let (bullets, stray) =
            parse_bullets("Here you go:\n- one\n  continued\n2. two\n* three\nthe end");
        assert_eq!(bullets, ["one continued", "two", "three"]);
        assert_eq!(stray, ["Here you go:", "the end"]);
    }

    #[test]
    fn goal_flag() {
        let goal = Message::system("Ship v2").with_metadata(GOAL_METADATA_KEY, true.into());
        let not_goal = Message::system("Ship v2").with_metadata(GOAL_METADATA_KEY, false.into());
        assert!(is_goal(&goal));
        assert!(!is_goal(&not_goal));
        assert!(!is_goal(&Message::user("hi")));
    }
}
