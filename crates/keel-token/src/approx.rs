use crate::{Framing, TokenCounter};

/// An estimate for vocabularies keel cannot load, plus the usual chat [`Framing`].
///
/// By default each character is weighed by its class, after what modern BPE
/// vocabularies (o200k, cl100k, Llama 3's) make of it, and the sum is rounded up:
///
/// | characters | tokens each |
/// |---|---|
/// | ASCII letters and whitespace | 1/4 (four characters a token, the usual rule for English) |
/// | ASCII digits | 1/3 (numbers split into groups of up to three) |
/// | ASCII punctuation and symbols | 1 (JSON and code are mostly these) |
/// | Chinese, Japanese and Korean scripts, full-width forms | 3/4 |
/// | other characters of the Basic Multilingual Plane (Cyrillic, Greek, Arabic, Devanagari, accented Latin ...) | 1/2 |
/// | characters beyond it (emoji, rare ideographs) | 1 |
///
/// A flat four characters a token counts English prose the same, but undercounts a
/// JSON tool result by about half and Chinese or Japanese text two to three times, so
/// a prompt it says fits can overflow the model's window. The weights lean high
/// instead: English prose comes out some 40% over o200k's count, JSON and CJK text
/// close to it. Tokenizers differ, so pair the estimate with a
/// [`CalibratedCounter`](crate::CalibratedCounter) fed with provider-reported usage.
/// [`with_chars_per_token`](Self::with_chars_per_token) gives the flat ratio instead.
///
/// ```
/// use keel_token::{ApproxCounter, TokenCounter};
///
/// let approx = ApproxCounter::new();
/// assert_eq!(approx.count_text(""), 0);
/// assert_eq!(approx.count_text("abcd"), 1);
/// assert_eq!(approx.count_text("abcde"), 2);
/// assert_eq!(approx.count_text("日本語"), 3); // 3 × 3/4, rounded up
/// assert_eq!(approx.count_text(r#"{"a":1}"#), 6); // 5 symbols, a letter, a digit
/// // Four characters a token, whatever they are:
/// assert_eq!(approx.with_chars_per_token(4).count_text("日本語"), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxCounter {
    /// `None`: characters weighed by class (the default); `Some(n)`: every character
    /// alike, `n` a token.
    flat: Option<usize>,
    framing: Framing,
}

/// The weights, in twelfths of a token.
mod weight {
    pub const LETTER: u64 = 3;
    pub const DIGIT: u64 = 4;
    pub const SYMBOL: u64 = 12;
    pub const CJK: u64 = 9;
    pub const OTHER: u64 = 6;
    pub const ASTRAL: u64 = 12;
}

/// Chinese, Japanese and Korean scripts and the full-width forms: Hangul Jamo, the CJK
/// radicals, symbols, kana, Bopomofo, ideographs and Yi, Hangul syllables, the
/// compatibility ideographs and forms, and the half- and full-width forms.
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x1100..=0x11FF
        | 0x2E80..=0xA4CF
        | 0xAC00..=0xD7AF
        | 0xF900..=0xFAFF
        | 0xFE30..=0xFE4F
        | 0xFF00..=0xFFEF)
}

fn weight_of(c: char) -> u64 {
    if c.is_ascii() {
        if c.is_ascii_alphabetic() || c.is_ascii_whitespace() {
            weight::LETTER
        } else if c.is_ascii_digit() {
            weight::DIGIT
        } else {
            weight::SYMBOL
        }
    } else if is_cjk(c) {
        weight::CJK
    } else if (c as u32) < 0x1_0000 {
        weight::OTHER
    } else {
        weight::ASTRAL
    }
}

impl ApproxCounter {
    /// Characters weighed by class, [`Framing::OPENAI`].
    pub fn new() -> Self {
        ApproxCounter {
            flat: None,
            framing: Framing::OPENAI,
        }
    }

    /// Counts every character alike, `chars_per_token` characters a token (a ratio of
    /// 0 is taken as 1), instead of weighing them by class.
    ///
    /// ```
    /// use keel_token::{ApproxCounter, TokenCounter};
    /// assert_eq!(ApproxCounter::new().with_chars_per_token(3).count_text("abcdefg"), 3);
    /// ```
    #[must_use]
    pub fn with_chars_per_token(mut self, chars_per_token: usize) -> Self {
        self.flat = Some(chars_per_token.max(1));
        self
    }

    /// Uses `framing` for messages and prompts.
    #[must_use]
    pub fn with_framing(mut self, framing: Framing) -> Self {
        self.framing = framing;
        self
    }

    /// The characters-per-token ratio: of ASCII letters when characters are weighed by
    /// class, of every character after
    /// [`with_chars_per_token`](Self::with_chars_per_token).
    pub fn chars_per_token(&self) -> usize {
        self.flat.unwrap_or(4)
    }
}

impl Default for ApproxCounter {
    fn default() -> Self {
        Self::new()
    }
}

impl TokenCounter for ApproxCounter {
    fn count_text(&self, text: &str) -> usize {
        match self.flat {
            Some(n) => text.chars().count().div_ceil(n),
            None => {
                let twelfths: u64 = text.chars().map(weight_of).sum();
                usize::try_from(twelfths.div_ceil(12)).unwrap_or(usize::MAX)
            }
        }
    }

    /// A text has no more characters than bytes, and no character weighs more than a
    /// token a byte (an ASCII symbol).
    fn max_tokens(&self, text: &str) -> Option<usize> {
        Some(match self.flat {
            Some(n) => text.len().div_ceil(n),
            None => text.len(),
        })
    }

    fn framing(&self) -> Framing {
        self.framing
    }
}
