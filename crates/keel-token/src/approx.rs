use crate::{Framing, TokenCounter};

/// An estimate for vocabularies keel cannot load, plus the usual chat [`Framing`].
///
/// By default the text is cut into the pieces modern BPE vocabularies (o200k, cl100k,
/// Llama 3's) cut it into before merging: words (with the one space or symbol before
/// them), numbers in groups of up to three digits, runs of symbols, runs of
/// whitespace. Each piece weighs what such vocabularies make of it, and the sum is
/// raised by a quarter for safety and rounded up:
///
/// | piece | tokens |
/// |---|---|
/// | an ASCII word (a case change starts a new one) | 1 a word, 1 more each 8 letters |
/// | a run of letters and digits that looks encoded (hashes, hex, base64, ids: at least 8 characters, switching between letters and digits or lower and upper case three times or more, every 3.5 characters or sooner) | 3/4 a character |
/// | digits | 1 each group of up to 3 |
/// | a run of ASCII symbols | 2/3 a symbol, at least 1 (1 each 16 of one repeated symbol) |
/// | whitespace | 1 each run of up to 64 (the space before a word or symbol is part of it) |
/// | Chinese, Japanese and Korean scripts (Hangul syllables 5/4), Greek, Hebrew, Arabic, Indic, Thai, combining marks, general punctuation, arrows and box drawing | 1 a character |
/// | accented Latin | 1/2 a character; Cyrillic: 7/12 |
/// | characters of rarer scripts; beyond the Basic Multilingual Plane (emoji) | 3 a character; 4 (a token a byte) |
///
/// A flat four characters a token counts English prose the same, but undercounts a
/// JSON tool result by about half, a hash or base64 two to three times, and most
/// scripts other than Latin more, so a prompt it says fits can overflow the model's
/// window. This estimate is at or above both o200k's and cl100k's counts on prose,
/// JSON, code, logs, paths, hashes, base64, numbers, symbols, emoji and the scripts
/// above, and within about twice them for English, JSON and code (English prose comes
/// out some 30% over). Strings of random lower-case letters, which no vocabulary has
/// words for, can come out under.
/// Tokenizers differ, so pair the estimate with a
/// [`CalibratedCounter`](crate::CalibratedCounter) fed with provider-reported usage.
/// [`with_chars_per_token`](Self::with_chars_per_token) gives a flat ratio instead.
///
/// ```
/// use keel_token::{ApproxCounter, TokenCounter};
///
/// let approx = ApproxCounter::new();
/// assert_eq!(approx.count_text(""), 0);
/// assert_eq!(approx.count_text("hello"), 2); // one word, a quarter more, rounded up
/// assert_eq!(approx.count_text("hello world again"), 4); // 3 words
/// // A hash is counted by its characters, not as one word:
/// let sha = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
/// assert!(approx.count_text(sha) >= 50);
/// // Four characters a token, whatever they are:
/// assert_eq!(approx.with_chars_per_token(4).count_text("日本語"), 1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxCounter {
    /// `None`: the text is weighed by pieces (the default); `Some(n)`: every
    /// character alike, `n` a token.
    flat: Option<usize>,
    framing: Framing,
}

/// Twelfths of a token.
const TOKEN: u64 = 12;

/// The estimate of `text`, in twelfths of a token, before the safety margin.
fn weigh(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let mut total = 0u64;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b.is_ascii_alphanumeric() {
            let start = i;
            while bytes.get(i).is_some_and(u8::is_ascii_alphanumeric) {
                i += 1;
            }
            total += segment(bytes.get(start..i).unwrap_or_default());
        } else if b.is_ascii_whitespace() {
            let start = i;
            while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
                i += 1;
            }
            let run = (i - start) as u64;
            // A single space before a word or a symbol is part of that piece.
            let attached = bytes.get(i - 1) == Some(&b' ')
                && bytes.get(i).is_some_and(|&n| !n.is_ascii_digit());
            let rest = run - u64::from(attached);
            if rest > 0 {
                total += TOKEN * rest.div_ceil(64);
            }
        } else if b.is_ascii() {
            let start = i;
            let mut repeated = true;
            while let Some(&n) = bytes.get(i) {
                if !(n.is_ascii_punctuation() || n.is_ascii_control()) || n.is_ascii_whitespace() {
                    break;
                }
                repeated &= n == b;
                i += 1;
            }
            let run = (i - start) as u64;
            total += if repeated {
                TOKEN * run.div_ceil(16)
            } else {
                (TOKEN * 2 / 3 * run).max(TOKEN)
            };
        } else {
            let c = text
                .get(i..)
                .and_then(|t| t.chars().next())
                .unwrap_or('\u{FFFD}');
            i += c.len_utf8().max(1);
            total += non_ascii(c);
        }
    }
    total
}

/// A run of ASCII letters and digits: its words and digit groups, or, when it looks
/// encoded (a hash, hex, base64), three quarters of a token a character.
fn segment(run: &[u8]) -> u64 {
    let mut pieces = 0u64;
    let mut switches = 0u32;
    let mut word = 0u64;
    let mut digits = 0u64;
    let mut prev: Option<u8> = None;
    let close_word = |word: &mut u64, pieces: &mut u64| {
        if *word > 0 {
            *pieces += TOKEN * (1 + (*word - 1) / 8);
            *word = 0;
        }
    };
    for &b in run {
        if b.is_ascii_digit() {
            if prev.is_some_and(|p| p.is_ascii_alphabetic()) {
                switches += 1;
            }
            close_word(&mut word, &mut pieces);
            digits += 1;
        } else {
            if prev.is_some_and(|p| p.is_ascii_digit()) {
                switches += 1;
            }
            if digits > 0 {
                pieces += TOKEN * digits.div_ceil(3);
                digits = 0;
            }
            // An upper-case letter after a lower-case one starts a new word.
            if b.is_ascii_uppercase() && prev.is_some_and(|p| p.is_ascii_lowercase()) {
                switches += 1;
                close_word(&mut word, &mut pieces);
            }
            word += 1;
        }
        prev = Some(b);
    }
    close_word(&mut word, &mut pieces);
    pieces += TOKEN * digits.div_ceil(3);
    let len = run.len() as u64;
    // Encoded text switches every few characters; camelCase words run longer.
    if len >= 8 && switches >= 3 && len * 2 < 7 * (u64::from(switches) + 1) {
        pieces.max(len * TOKEN * 3 / 4)
    } else {
        pieces
    }
}

/// One character beyond ASCII, in twelfths of a token.
fn non_ascii(c: char) -> u64 {
    match c as u32 {
        // Accented Latin (Latin-1 Supplement, Latin Extended-A and -B).
        0x0080..=0x024F => TOKEN / 2,
        // Cyrillic and its supplement.
        0x0400..=0x052F => 7,
        // Combining marks, Greek, Armenian, Hebrew, Arabic, Syriac, Thaana, the Indic
        // scripts, Thai, Lao.
        0x0250..=0x03FF | 0x0530..=0x0EFF => TOKEN,
        // Hangul Jamo; general punctuation, super- and subscripts, currency, letter-like
        // symbols, number forms, arrows, mathematical operators, technical symbols,
        // box drawing, shapes; the CJK scripts, kana, Bopomofo, Yi; Hangul syllables;
        // compatibility ideographs, vertical and small forms, half- and full-width forms.
        0x1100..=0x11FF
        | 0x2000..=0x25FF
        | 0x2E80..=0xA4CF
        | 0xF900..=0xFAFF
        | 0xFE30..=0xFE4F
        | 0xFF00..=0xFFEF => TOKEN,
        // Hangul syllables: cl100k takes more than a token for some.
        0xAC00..=0xD7AF => TOKEN * 5 / 4,
        // Everything beyond the BMP (emoji, rare ideographs): BPE vocabularies often
        // fall back to a token a byte, four bytes each.
        0x1_0000.. => 4 * TOKEN,
        // Rarer scripts and symbols of the BMP: a token a byte, three bytes each.
        _ => 3 * TOKEN,
    }
}

impl ApproxCounter {
    /// The text weighed by pieces, [`Framing::OPENAI`].
    pub fn new() -> Self {
        ApproxCounter {
            flat: None,
            framing: Framing::OPENAI,
        }
    }

    /// Counts every character alike, `chars_per_token` characters a token (a ratio of
    /// 0 is taken as 1), instead of weighing the text by pieces.
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

    /// The characters-per-token ratio: about that of English words when the text is
    /// weighed by pieces, of every character after
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
                // A quarter more, for safety.
                let twelfths = weigh(text).saturating_mul(5) / 4;
                usize::try_from(twelfths.div_ceil(TOKEN)).unwrap_or(usize::MAX)
            }
        }
    }

    /// A text has no more characters than bytes, and no piece weighs more than a token
    /// a byte before the quarter added for safety.
    fn max_tokens(&self, text: &str) -> Option<usize> {
        Some(match self.flat {
            Some(n) => text.len().div_ceil(n),
            None => text.len().saturating_mul(5).div_ceil(4),
        })
    }

    fn framing(&self) -> Framing {
        self.framing
    }
}
