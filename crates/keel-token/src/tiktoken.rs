use std::fmt;

use crate::engine::{self, Engine};
use crate::{Encoding, Framing, TokenCounter, TokenError};

/// Exact token counts for OpenAI's `o200k_base` and `cl100k_base` encodings.
///
/// The count is exactly the length of tiktoken's `encode_ordinary(text)`: special-token
/// strings such as `<|endoftext|>` in the text count as ordinary text. The vocabulary
/// comes from `tiktoken-rs` (which ships OpenAI's files): the build script extracts it
/// into the library, which links no tiktoken-rs. It is loaded once per process on first
/// use (about 20 ms for `o200k_base`, where building tiktoken-rs's own encoder takes
/// about 120); every `TiktokenCounter` of an encoding shares it, so a counter is cheap
/// to create and to clone.
///
/// Counting does not run tiktoken's own encoder: a dedicated engine splits the text with
/// hand-written matchers equivalent to tiktoken's regular expressions and counts merged
/// parts without building token vectors. Each thread that counts keeps the counts of
/// its recent short pieces (up to 16 bytes, 2,048 of them: 48 KiB per thread), so a
/// fresh text rarely has to reach the megabytes of vocabulary. It gives the same
/// numbers (the crate's tests compare it with tiktoken piece by piece and token by
/// token, and the cached counts with uncached ones) several times faster.
///
/// Time and memory stay linear in the text whatever it holds. A piece the splitter
/// cannot cut (a megabyte run of `=`, a file of NUL bytes, where tiktoken's merge is
/// quadratic) is merged in overlapping windows of 16 KiB joined at a token both give,
/// which is exact: about a third of a second a megabyte, in a few hundred KiB.
///
/// ```
/// use keel_token::{TiktokenCounter, TokenCounter};
///
/// let counter = TiktokenCounter::o200k_base()?;
/// assert_eq!(counter.count_text("Hello, world!"), 4);
/// assert_eq!(counter.count_text(""), 0);
/// // Special tokens are just text.
/// assert_eq!(counter.count_text("<|endoftext|>"), 7);
/// # Ok::<(), keel_token::TokenError>(())
/// ```
#[derive(Clone)]
pub struct TiktokenCounter {
    encoding: Encoding,
    engine: &'static Engine,
    framing: Framing,
    threads: usize,
}

impl TiktokenCounter {
    /// A counter for a BPE encoding. Fails with [`TokenError::NotBpe`] for
    /// [`Encoding::Approximate`].
    ///
    /// ```
    /// use keel_token::{Encoding, TiktokenCounter, TokenCounter};
    ///
    /// let counter = TiktokenCounter::new(Encoding::Cl100kBase)?;
    /// assert_eq!(counter.encoding(), Encoding::Cl100kBase);
    /// assert_eq!(counter.count_text("tiktoken is great!"), 6);
    /// # Ok::<(), keel_token::TokenError>(())
    /// ```
    pub fn new(encoding: Encoding) -> Result<Self, TokenError> {
        Ok(TiktokenCounter {
            encoding,
            engine: engine::engine(encoding)?,
            framing: Framing::OPENAI,
            threads: 1,
        })
    }

    /// A counter for `o200k_base` (GPT-4o, GPT-4.1, o-series, GPT-5).
    pub fn o200k_base() -> Result<Self, TokenError> {
        Self::new(Encoding::O200kBase)
    }

    /// A counter for `cl100k_base` (GPT-4, GPT-3.5-turbo).
    pub fn cl100k_base() -> Result<Self, TokenError> {
        Self::new(Encoding::Cl100kBase)
    }

    /// The encoding counted.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// Uses `framing` for messages and prompts instead of [`Framing::OPENAI`].
    #[must_use]
    pub fn with_framing(mut self, framing: Framing) -> Self {
        self.framing = framing;
        self
    }

    /// Counts texts of 256 KiB or more on up to `threads` threads (default 1: always the
    /// calling thread). The text is cut only right after a newline that is followed by
    /// neither whitespace nor `/`, where both encodings always end a piece, so the count
    /// is identical to a single-threaded one.
    ///
    /// ```
    /// use keel_token::{TiktokenCounter, TokenCounter};
    ///
    /// let one = TiktokenCounter::o200k_base()?;
    /// let two = one.clone().with_threads(2);
    /// let text = "fn main() {}\n// a comment\n".repeat(20_000);
    /// assert_eq!(two.count_text(&text), one.count_text(&text));
    /// # Ok::<(), keel_token::TokenError>(())
    /// ```
    #[must_use]
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }
}

impl TokenCounter for TiktokenCounter {
    fn count_text(&self, text: &str) -> usize {
        self.engine.count_parallel(text, self.threads)
    }

    /// Every token of a byte-level BPE covers at least one byte.
    fn max_tokens(&self, text: &str) -> Option<usize> {
        Some(text.len())
    }

    fn framing(&self) -> Framing {
        self.framing
    }
}

impl fmt::Debug for TiktokenCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TiktokenCounter")
            .field("encoding", &self.encoding)
            .field("framing", &self.framing)
            .field("threads", &self.threads)
            .finish()
    }
}
