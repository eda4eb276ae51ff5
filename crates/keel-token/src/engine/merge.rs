//! Byte-pair merging, counting the tokens of one piece without building them.
//!
//! BPE as tiktoken applies it: start from single bytes, and repeatedly merge the
//! adjacent pair whose concatenation has the lowest rank (the leftmost such pair on a
//! tie) until no adjacent pair is a token. Short pieces use a flat array (cache
//! friendly, `O(n²)` worst case on tiny `n`); long pieces use a linked list and a heap
//! (`O(n log n)`). Both pick the same pair at every step, so they agree.
//!
//! Pieces longer than [`WINDOW`] (a megabyte run of one character, a file of NUL
//! bytes) are counted window by window in bounded memory, and exactly: see
//! [`count_windowed`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

const NONE: u32 = u32::MAX;

/// Pieces at least this long use the heap-based merge.
pub(crate) const LARGE: usize = 128;

/// Pieces longer than this are counted window by window ([`count_windowed`]): the heap
/// merge keeps about 20 bytes of state a byte, so a 100 MB piece would take 2 GB.
pub(crate) const WINDOW: usize = 1 << 14;

/// The number of tokens of one pre-tokenized piece.
#[inline]
pub(crate) fn count_piece(vocab: &Vocab, piece: &[u8]) -> usize {
    match piece.len() {
        0 => 0,
        // Every single byte is a token of a byte-level BPE vocabulary.
        1 => 1,
        n => {
            if vocab.rank(piece).is_some() {
                1
            } else if n < LARGE {
                merge_small(vocab, piece).parts
            } else if n <= WINDOW {
                count_large::<u32>(vocab, piece)
            } else {
                count_windowed(vocab, piece, WINDOW)
            }
        }
    }
}

/// The ranks of the tokens of a piece, in order (for tests and diagnostics).
#[cfg(test)]
pub(crate) fn encode_piece(vocab: &Vocab, piece: &[u8]) -> Vec<u32> {
    if piece.is_empty() {
        return Vec::new();
    }
    if let Some(r) = vocab.rank(piece) {
        return vec![r];
    }
    let starts: Vec<usize> = if piece.len() < LARGE {
        merge_small(vocab, piece).starts(piece.len())
    } else {
        parts_large(vocab, piece)
    };
    starts
        .windows(2)
        .map(|w| vocab.rank(&piece[w[0]..w[1]]).unwrap_or(NONE))
        .collect()
}

/// The merge state of a short piece: parts as a linked list over byte offsets, in
/// fixed arrays on the stack.
struct Small {
    /// `next[s]`: where the part starting at `s` ends.
    next: [u8; LARGE],
    parts: usize,
}

impl Small {
    #[cfg(test)]
    fn starts(&self, n: usize) -> Vec<usize> {
        let mut out = vec![0];
        let mut s = 0;
        while s < n {
            s = usize::from(self.next[s]);
            out.push(s);
        }
        out
    }
}

/// Merges a piece with `2 <= len < LARGE`.
///
/// `ranks[s]` is the rank of the part at `s` merged with its successor (`NONE` when
/// there is none, or when `s` no longer starts a part). Each step scans for the lowest
/// rank, leftmost first, and merges that pair.
#[inline]
fn merge_small(vocab: &Vocab, piece: &[u8]) -> Small {
    let n = piece.len().min(LARGE - 1);
    let mut st = Small {
        next: [0; LARGE],
        parts: n,
    };
    let mut prev = [0u8; LARGE];
    let mut ranks = [NONE; LARGE];
    for (i, (next, prev)) in st.next.iter_mut().zip(prev.iter_mut()).take(n).enumerate() {
        *next = (i + 1) as u8;
        *prev = i.saturating_sub(1) as u8;
    }
    for i in 0..n - 1 {
        ranks[i] = vocab.pair(piece[i], piece[i + 1]);
    }
    let rank = |a: usize, b: usize| vocab.rank(&piece[a..b]).unwrap_or(NONE);
    loop {
        let mut best = NONE;
        let mut s = 0;
        for (i, &r) in ranks[..n - 1].iter().enumerate() {
            if r < best {
                best = r;
                s = i;
            }
        }
        if best == NONE {
            break;
        }
        let right = usize::from(st.next[s]);
        let after = usize::from(st.next[right]);
        st.next[s] = after as u8;
        if after < n {
            prev[after] = s as u8;
        }
        ranks[right] = NONE;
        st.parts -= 1;
        ranks[s] = if after < n {
            rank(s, usize::from(st.next[after]))
        } else {
            NONE
        };
        if s > 0 {
            let q = usize::from(prev[s]);
            ranks[q] = rank(q, after);
        }
    }
    st
}

/// A position type for the large merge: `u32` halves its memory.
trait Pos: Copy + Ord {
    fn from_usize(x: usize) -> Self;
    fn to_usize(self) -> usize;
}

impl Pos for u32 {
    #[inline(always)]
    fn from_usize(x: usize) -> Self {
        x as u32
    }
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as usize
    }
}

impl Pos for usize {
    #[inline(always)]
    fn from_usize(x: usize) -> Self {
        x
    }
    #[inline(always)]
    fn to_usize(self) -> usize {
        self
    }
}

/// The merge state of a long piece: parts as a doubly linked list over byte offsets.
struct Large<P> {
    /// `next[s]`: where the part starting at `s` ends (the next part's start).
    next: Vec<P>,
    /// `prev[s]`: the start of the part before the one starting at `s`.
    prev: Vec<P>,
    /// `pair[s]`: rank of the part at `s` merged with its successor; `NONE` if none or
    /// if `s` no longer starts a part.
    pair: Vec<u32>,
    parts: usize,
}

fn merge_large<P: Pos>(vocab: &Vocab, piece: &[u8]) -> Large<P> {
    let n = piece.len();
    let rank = |a: usize, b: usize| vocab.rank(&piece[a..b]).unwrap_or(NONE);
    let mut st = Large {
        next: (1..=n).map(P::from_usize).collect(),
        prev: (0..n).map(|i| P::from_usize(i.saturating_sub(1))).collect(),
        pair: (0..n)
            .map(|i| if i + 2 <= n { rank(i, i + 2) } else { NONE })
            .collect(),
        parts: n,
    };
    let mut heap: BinaryHeap<Reverse<(u32, P)>> = st
        .pair
        .iter()
        .enumerate()
        .filter(|&(_, &r)| r != NONE)
        .map(|(i, &r)| Reverse((r, P::from_usize(i))))
        .collect();
    while let Some(Reverse((r, s))) = heap.pop() {
        let si = s.to_usize();
        if st.pair[si] != r {
            continue; // stale: the part changed or was absorbed since this was pushed
        }
        let right = st.next[si].to_usize();
        let after = st.next[right].to_usize();
        st.next[si] = P::from_usize(after);
        if after < n {
            st.prev[after] = s;
        }
        st.pair[right] = NONE;
        st.parts -= 1;
        st.pair[si] = if after < n {
            rank(si, st.next[after].to_usize())
        } else {
            NONE
        };
        if st.pair[si] != NONE {
            heap.push(Reverse((st.pair[si], s)));
        }
        if si > 0 {
            let q = st.prev[si].to_usize();
            st.pair[q] = rank(q, after);
            if st.pair[q] != NONE {
                heap.push(Reverse((st.pair[q], P::from_usize(q))));
            }
        }
    }
    st
}

fn count_large<P: Pos>(vocab: &Vocab, piece: &[u8]) -> usize {
    merge_large::<P>(vocab, piece).parts
}

/// The heap merge of a piece of any length, in one go (memory grows with the piece).
pub(crate) fn count_whole(vocab: &Vocab, piece: &[u8]) -> usize {
    if piece.len() < u32::MAX as usize {
        count_large::<u32>(vocab, piece)
    } else {
        count_large::<usize>(vocab, piece)
    }
}

/// Where the tokens of `text` start, as the heap merge splits it, offset by `at`, with
/// `at + text.len()` last.
fn bounds(vocab: &Vocab, text: &[u8], at: usize) -> Vec<usize> {
    let st = merge_large::<u32>(vocab, text);
    let mut out = Vec::with_capacity(st.parts + 1);
    let mut s = 0;
    out.push(at);
    while s < text.len() {
        s = st.next[s].to_usize();
        out.push(at + s);
    }
    out
}

/// Counts a long piece exactly, holding the merge state of at most two windows of
/// `window` bytes at a time.
///
/// BPE's tokenization of a text is the only token sequence that BPE would give back
/// for its own bytes (call such a sequence valid), and it has two properties (laid out
/// in the README of GitHub's `bpe` crate):
///
/// * a contiguous run of a valid sequence is the valid sequence of its bytes (no merge
///   crossed its ends);
/// * two valid sequences that overlap in one whole token, the same bytes at the same
///   place, join at that token into the valid sequence of their union.
///
/// So: merge the first window; merge the next window, which starts at a token start of
/// the current one at least half a window in; find a token both give, at the same
/// place; keep the current window's tokens up to it and the next window's from it on.
/// Each join is exact, so the sum is the piece's count, whatever the window size. Every
/// byte is merged about twice. Should two windows share no token (no text seen does
/// this: windows that start at a token boundary fall into the same tokens within a few
/// tokens), the piece is merged whole, with memory that grows with it.
pub(crate) fn count_windowed(vocab: &Vocab, piece: &[u8], window: usize) -> usize {
    try_count_windowed(vocab, piece, window).unwrap_or_else(|| count_whole(vocab, piece))
}

/// [`count_windowed`], or `None` where two windows share no token.
pub(crate) fn try_count_windowed(vocab: &Vocab, piece: &[u8], window: usize) -> Option<usize> {
    let n = piece.len();
    let half = (window / 2).max(1);
    // The tokens so far: `counted` of them, then those of `cur` from index `from` on.
    let mut counted = 0;
    let mut start = 0;
    let mut cur = bounds(vocab, &piece[..window.min(n)], 0);
    let mut from = 0;
    loop {
        let end = cur.last().copied().unwrap_or(n);
        if end >= n {
            return Some(counted + (cur.len() - 1 - from));
        }
        // The next window starts at a token start of this one, past its middle.
        let at = cur
            .partition_point(|&p| p < start + half)
            .max(from)
            .min(cur.len() - 1);
        let b = cur[at];
        if b >= end {
            return None;
        }
        let next = bounds(vocab, &piece[b..(b + window).min(n)], b);
        // A token both give: equal start and end, within the current window.
        let (mut i, mut j) = (at, 0);
        let shared = loop {
            if i + 1 >= cur.len() || j + 1 >= next.len() {
                break None;
            }
            match cur[i].cmp(&next[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal if cur[i + 1] == next[j + 1] => break Some((i, j)),
                std::cmp::Ordering::Equal => {
                    i += 1;
                    j += 1;
                }
            }
        };
        let (i, j) = shared?;
        counted += i - from;
        cur = next;
        from = j;
        start = b;
    }
}

#[cfg(test)]
fn parts_large(vocab: &Vocab, piece: &[u8]) -> Vec<usize> {
    let st = merge_large::<u32>(vocab, piece);
    let mut out = vec![0];
    let mut s = 0;
    while s < piece.len() {
        s = st.next[s].to_usize();
        out.push(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Vocab {
        // Ranks: all single bytes a..e, then merges.
        let mut tokens: Vec<Vec<u8>> = (b'a'..=b'e').map(|b| vec![b]).collect();
        for t in ["ab", "cd", "abcd", "bc", "de", "aa", "aaaa"] {
            tokens.push(t.as_bytes().to_vec());
        }
        Vocab::from_tokens(&tokens).unwrap()
    }

    fn both(v: &Vocab, piece: &[u8]) -> (Vec<usize>, Vec<usize>) {
        (
            merge_small(v, piece).starts(piece.len()),
            parts_large(v, piece),
        )
    }

    #[test]
    fn lowest_rank_first_then_leftmost() {
        let v = toy();
        // "abcd": ab (5) beats bc (8) and cd (6); then ab+cd = abcd (7).
        assert_eq!(both(&v, b"abcd"), (vec![0, 4], vec![0, 4]));
        // "bcd": bc (8) vs cd (6): cd first, then b+cd is not a token.
        assert_eq!(both(&v, b"bcd"), (vec![0, 1, 3], vec![0, 1, 3]));
        // "aaaaa": aa at 0 (leftmost tie), aa at 2, then aa+aa = aaaa, then a.
        assert_eq!(both(&v, b"aaaaa"), (vec![0, 4, 5], vec![0, 4, 5]));
        // Unknown bytes stay single parts.
        assert_eq!(both(&v, b"zz"), (vec![0, 1, 2], vec![0, 1, 2]));
    }

    #[test]
    fn small_and_large_agree_on_long_pieces() {
        let v = toy();
        let mut seed = 7u64;
        for len in [2usize, 3, 17, 99, 127] {
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    b'a' + ((seed >> 33) % 5) as u8
                })
                .collect();
            let (small, large) = both(&v, &piece);
            assert_eq!(small, large, "len {len}");
        }
    }

    #[test]
    fn windowed_counts_equal_whole_counts_on_the_toy_vocabulary() {
        let v = toy();
        let mut seed = 11u64;
        for len in [300usize, 1_000, 4_000] {
            for alphabet in [1u64, 2, 3, 5] {
                let piece: Vec<u8> = (0..len)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        b'a' + ((seed >> 33) % alphabet) as u8
                    })
                    .collect();
                for window in [16usize, 33, 64, 129, 1_000] {
                    assert_eq!(
                        try_count_windowed(&v, &piece, window),
                        Some(count_whole(&v, &piece)),
                        "len {len}, alphabet {alphabet}, window {window}"
                    );
                }
            }
        }
    }
}
