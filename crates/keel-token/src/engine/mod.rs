//! The counting engine behind [`TiktokenCounter`](crate::TiktokenCounter).
//!
//! tiktoken encodes text in two steps: a regular expression splits it into pieces,
//! then byte-pair merging turns each piece into tokens. This engine does the same two
//! steps with the same vocabulary (taken from `tiktoken-rs`, which ships OpenAI's
//! files, by the build script, so that loading it parses nothing) and the same
//! splitting rules, but
//!
//! * splits with hand-written matchers instead of a backtracking regex ([`split`]),
//! * looks tokens up in a compact open-addressing table ([`vocab`]),
//! * counts merged parts instead of building token vectors ([`merge`]),
//! * remembers the counts of recent short pieces per thread ([`cache`]), so a text that
//!   arrives cold rarely reaches the megabytes of vocabulary,
//! * and can count a long text on several threads by cutting it only where a piece
//!   boundary is certain ([`split::is_safe_boundary`]).
//!
//! The result is exactly tiktoken's `encode_ordinary(text).len()`; the tests check it
//! against `tiktoken-rs` token for token.

use std::borrow::Cow;
use std::sync::OnceLock;

use crate::{Encoding, TokenError};

mod cache;
mod classes;
mod merge;
mod split;
mod vocab;

use classes::Classes;
use merge::count_piece;
use split::Pattern;
use vocab::Vocab;

/// Below this many bytes a text is always counted on the calling thread.
pub(crate) const PARALLEL_MIN_BYTES: usize = 256 * 1024;

/// One loaded encoding: its splitting pattern and vocabulary.
pub(crate) struct Engine {
    /// This encoding's id in the piece cache (nonzero, one per encoding).
    id: u8,
    pattern: Pattern,
    classes: &'static Classes,
    vocab: Vocab,
}

static CLASSES: OnceLock<Result<Classes, String>> = OnceLock::new();
static O200K: OnceLock<Result<Engine, TokenError>> = OnceLock::new();
static CL100K: OnceLock<Result<Engine, TokenError>> = OnceLock::new();

/// The process-wide engine for a BPE encoding, built on first use.
pub(crate) fn engine(encoding: Encoding) -> Result<&'static Engine, TokenError> {
    let cell = match encoding {
        Encoding::O200kBase => &O200K,
        Encoding::Cl100kBase => &CL100K,
        Encoding::Approximate => return Err(TokenError::NotBpe { encoding }),
    };
    cell.get_or_init(|| Engine::load(encoding))
        .as_ref()
        .map_err(Clone::clone)
}

impl Engine {
    fn load(encoding: Encoding) -> Result<Engine, TokenError> {
        let fail = |reason: String| TokenError::Vocabulary { encoding, reason };
        let classes = CLASSES
            .get_or_init(Classes::build)
            .as_ref()
            .map_err(|e| fail(format!("Unicode tables: {e}")))?;
        // The build script wrote each vocabulary's tokens back to back, rank by rank,
        // and where each one ends (see build.rs).
        let (id, tokens, ends, pattern, expected): (_, &[u8], &[u8], _, _) = match encoding {
            Encoding::O200kBase => (
                1,
                include_bytes!(concat!(env!("OUT_DIR"), "/o200k_base.tokens")),
                include_bytes!(concat!(env!("OUT_DIR"), "/o200k_base.ends")),
                Pattern::O200k,
                199_998,
            ),
            Encoding::Cl100kBase => (
                2,
                include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_base.tokens")),
                include_bytes!(concat!(env!("OUT_DIR"), "/cl100k_base.ends")),
                Pattern::Cl100k,
                100_256,
            ),
            Encoding::Approximate => return Err(TokenError::NotBpe { encoding }),
        };
        let mut offsets = Vec::with_capacity(expected + 1);
        offsets.push(0);
        for end in ends.chunks_exact(4) {
            offsets.push(u32::from_le_bytes([end[0], end[1], end[2], end[3]]));
        }
        if offsets.len() != expected + 1 || ends.len() % 4 != 0 {
            return Err(fail(format!(
                "expected {expected} mergeable tokens, found {}",
                offsets.len() - 1
            )));
        }
        let vocab = Vocab::new(Cow::Borrowed(tokens), offsets).map_err(fail)?;
        if let Some(byte) = (0..=255u8).find(|b| vocab.rank(&[*b]).is_none()) {
            return Err(fail(format!("byte {byte} is not a token")));
        }
        Ok(Engine {
            id,
            pattern,
            classes,
            vocab,
        })
    }

    /// The number of tokens of `text`, as tiktoken's `encode_ordinary` would give.
    pub(crate) fn count(&self, text: &str) -> usize {
        cache::with(self.id, |cache| self.count_with(text, cache))
    }

    /// [`Engine::count`] without the piece cache (tests compare the two).
    #[cfg(test)]
    pub(crate) fn count_uncached(&self, text: &str) -> usize {
        self.count_with(text, None)
    }

    /// Counts `text`, asking `cache` (when there is one) for pieces of 2 to
    /// [`cache::MAX_PIECE`] bytes; shorter pieces are counted at once, longer ones merged.
    fn count_with(&self, text: &str, mut cache: Option<cache::PieceCache<'_>>) -> usize {
        let mut total = 0;
        self.pattern.for_each_piece(self.classes, text, |piece| {
            total += match &mut cache {
                Some(c) if (2..=cache::MAX_PIECE).contains(&piece.len()) => {
                    c.get_or(piece, |p| count_piece(&self.vocab, p))
                }
                _ => count_piece(&self.vocab, piece),
            };
        });
        total
    }

    /// Like [`Engine::count`], on up to `threads` threads for long texts. The text is cut
    /// only at safe piece boundaries, so the result is the same.
    pub(crate) fn count_parallel(&self, text: &str, threads: usize) -> usize {
        if threads <= 1 || text.len() < PARALLEL_MIN_BYTES {
            return self.count(text);
        }
        let chunks = self.safe_split(text, threads);
        if chunks.len() <= 1 {
            return self.count(text);
        }
        std::thread::scope(|scope| {
            // A thread that cannot be started (resource limits) leaves its chunk to this
            // one: `Builder::spawn_scoped` reports the failure instead of panicking.
            let handles: Vec<_> = chunks[1..]
                .iter()
                .map(|&chunk| {
                    let handle = std::thread::Builder::new()
                        .name("keel-token-count".into())
                        .spawn_scoped(scope, move || self.count(chunk))
                        .ok();
                    (chunk, handle)
                })
                .collect();
            let mut sum = self.count(chunks[0]);
            for (chunk, handle) in handles {
                // Counting never panics; if a worker somehow did, count its chunk here
                // rather than propagate the panic or lose its tokens.
                sum += match handle.map(|h| h.join()) {
                    Some(Ok(n)) => n,
                    _ => self.count(chunk),
                };
            }
            sum
        })
    }

    /// Cuts `text` into at most `parts` chunks, each ending at a safe boundary near an
    /// equal share of the bytes.
    pub(crate) fn safe_split<'t>(&self, text: &'t str, parts: usize) -> Vec<&'t str> {
        let b = text.as_bytes();
        let mut cuts = vec![0];
        for k in 1..parts {
            let target = b.len() * k / parts;
            let from = target.max(cuts.last().copied().unwrap_or(0) + 1);
            let found = (from..b.len()).find(|&i| split::is_safe_boundary(self.classes, b, i));
            match found {
                Some(i) => cuts.push(i),
                None => break,
            }
        }
        cuts.push(b.len());
        cuts.dedup();
        cuts.windows(2)
            .filter_map(|w| text.get(w[0]..w[1]))
            .collect()
    }

    /// Token ranks of `text` (tests compare them with tiktoken's).
    #[cfg(test)]
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.pattern.for_each_piece(self.classes, text, |piece| {
            out.extend(merge::encode_piece(&self.vocab, piece));
        });
        out
    }

    /// The pieces of `text` (tests compare them with tiktoken's regex).
    #[cfg(test)]
    pub(crate) fn pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        let mut at = 0;
        self.pattern.for_each_piece(self.classes, text, |piece| {
            out.push(&text[at..at + piece.len()]);
            at += piece.len();
        });
        out
    }

    /// The vocabulary size.
    #[cfg(test)]
    pub(crate) fn vocab_len(&self) -> usize {
        self.vocab.len()
    }
}

#[cfg(test)]
mod tests;
