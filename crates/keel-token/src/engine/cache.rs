//! A small per-thread cache of the token counts of short pieces.
//!
//! The vocabulary's table is megabytes large, so a lookup in a text that arrives cold
//! (a fresh tool result between model calls, say) costs a few cache misses per piece.
//! Real texts repeat their short pieces (words, indentation, punctuation runs), so a
//! direct-mapped table of recent pieces, small enough to stay in the CPU's cache,
//! answers most pieces without touching the vocabulary.
//!
//! Each slot holds the piece's bytes in full (up to [`MAX_PIECE`]) and which engine
//! counted it, so a hit is exact: the cache can only return what the merge computed
//! for the same bytes under the same vocabulary. It is bounded: [`SLOTS`] slots per
//! thread that counts, allocated on the first count.

use std::cell::RefCell;

/// The longest piece kept, in bytes (a piece of at most 16 bytes has at most 16 tokens).
pub(crate) const MAX_PIECE: usize = 16;
/// Slots per thread (a power of two): 2,048 slots of 24 bytes, 48 KiB.
const SLOTS: usize = 2048;

#[derive(Clone, Copy, Default)]
struct Slot {
    key: [u8; MAX_PIECE],
    len: u8,
    /// Which engine counted this piece; `0` is an empty slot.
    engine: u8,
    count: u8,
}

thread_local! {
    static CACHE: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
}

/// A borrowed view of this thread's cache for one engine.
pub(crate) struct PieceCache<'c> {
    slots: &'c mut [Slot],
    engine: u8,
}

impl PieceCache<'_> {
    /// The count of `piece` (at most [`MAX_PIECE`] bytes), from the cache or from
    /// `count` (whose answer is kept).
    #[inline(always)]
    pub(crate) fn get_or(&mut self, piece: &[u8], count: impl FnOnce(&[u8]) -> usize) -> usize {
        let mut key = [0u8; MAX_PIECE];
        let Some(dst) = key.get_mut(..piece.len()) else {
            return count(piece);
        };
        dst.copy_from_slice(piece);
        let i = index(&key, piece.len());
        let Some(slot) = self.slots.get_mut(i) else {
            return count(piece);
        };
        if slot.engine == self.engine && usize::from(slot.len) == piece.len() && slot.key == key {
            return usize::from(slot.count);
        }
        let n = count(piece);
        // Pieces of at most 16 bytes have at most 16 tokens; anything else is not kept.
        if let (Ok(len), Ok(c)) = (u8::try_from(piece.len()), u8::try_from(n)) {
            *slot = Slot {
                key,
                len,
                engine: self.engine,
                count: c,
            };
        }
        n
    }
}

/// Runs `f` with this thread's cache for `engine` (a nonzero id), or with `None` when
/// the cache is in use further up this thread's stack (or its thread-local storage is
/// being torn down): counting is then done without it.
pub(crate) fn with<R>(engine: u8, mut f: impl FnMut(Option<PieceCache<'_>>) -> R) -> R {
    let mut out = None;
    // An error here means the thread is exiting: `out` stays empty and `f` runs alone.
    let _ = CACHE.try_with(|cell| {
        if let Ok(mut slots) = cell.try_borrow_mut() {
            if slots.is_empty() {
                slots.resize(SLOTS, Slot::default());
            }
            out = Some(f(Some(PieceCache {
                slots: &mut slots,
                engine,
            })));
        }
    });
    match out {
        Some(r) => r,
        None => f(None),
    }
}

/// The slot of a zero-padded key.
#[inline(always)]
fn index(key: &[u8; MAX_PIECE], len: usize) -> usize {
    let (a, b) = key.split_at(8);
    let a = u64::from_le_bytes(a.try_into().unwrap_or([0; 8]));
    let b = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    let h = (a ^ b.rotate_left(29) ^ len as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h >> (64 - SLOTS.trailing_zeros())) as usize
}
