use crate::{Framing, TokenCounter};

/// An estimate for vocabularies keel cannot load: characters divided by four, rounded
/// up, plus the usual chat [`Framing`].
///
/// Four characters per token is the usual rule of thumb for English with modern BPE
/// vocabularies; code, other languages and other tokenizers differ, so pair it with a
/// [`CalibratedCounter`](crate::CalibratedCounter) fed with provider-reported usage.
/// Characters are Unicode scalar values, not bytes, so non-Latin text is not
/// over-counted fourfold.
///
/// ```
/// use keel_token::{ApproxCounter, TokenCounter};
///
/// let approx = ApproxCounter::new();
/// assert_eq!(approx.count_text(""), 0);
/// assert_eq!(approx.count_text("abcd"), 1);
/// assert_eq!(approx.count_text("abcde"), 2);
/// assert_eq!(approx.count_text("日本語"), 1); // 3 chars, 9 bytes
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxCounter {
    chars_per_token: usize,
    framing: Framing,
}

impl ApproxCounter {
    /// Four characters per token, [`Framing::OPENAI`].
    pub fn new() -> Self {
        ApproxCounter {
            chars_per_token: 4,
            framing: Framing::OPENAI,
        }
    }

    /// Uses another ratio (a ratio of 0 is taken as 1).
    ///
    /// ```
    /// use keel_token::{ApproxCounter, TokenCounter};
    /// assert_eq!(ApproxCounter::new().with_chars_per_token(3).count_text("abcdefg"), 3);
    /// ```
    #[must_use]
    pub fn with_chars_per_token(mut self, chars_per_token: usize) -> Self {
        self.chars_per_token = chars_per_token.max(1);
        self
    }

    /// Uses `framing` for messages and prompts.
    #[must_use]
    pub fn with_framing(mut self, framing: Framing) -> Self {
        self.framing = framing;
        self
    }

    /// The characters-per-token ratio.
    pub fn chars_per_token(&self) -> usize {
        self.chars_per_token
    }
}

impl Default for ApproxCounter {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenCounter for ApproxCounter {
    fn count_text(&self, text: &str) -> usize {
        text.chars().count().div_ceil(self.chars_per_token)
    }

    /// A text has no more characters than bytes.
    fn max_tokens(&self, text: &str) -> Option<usize> {
        Some(text.len().div_ceil(self.chars_per_token))
    }

    fn framing(&self) -> Framing {
        self.framing
    }
}
