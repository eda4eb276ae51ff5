//! A read-only map from token bytes to rank, built for fast lookups of short keys.
//!
//! All token bytes live in one arena; an open-addressing table (load factor at most
//! one half, linear probing) holds, per slot, 32 bits of the key's hash and the rank.
//! A lookup is usually one table read, one offsets read and one short compare.

use std::borrow::Cow;

/// The mergeable ranks of a BPE vocabulary.
pub(crate) struct Vocab {
    /// Every token's bytes, back to back; the built-in vocabularies borrow them from
    /// the binary.
    arena: Cow<'static, [u8]>,
    /// `offsets[r]..offsets[r + 1]` are the bytes of rank `r`.
    offsets: Vec<u32>,
    /// `0` is empty; otherwise `(hash >> 32) << 32 | (rank + 1)`.
    slots: Vec<u64>,
    mask: usize,
    /// `pairs[a << 8 | b]`: the rank of the two bytes `[a, b]`, or `u32::MAX`.
    pairs: Vec<u32>,
}

impl Vocab {
    /// Builds the map over `arena`, where rank `r` is `arena[offsets[r]..offsets[r + 1]]`.
    pub(crate) fn new(arena: Cow<'static, [u8]>, offsets: Vec<u32>) -> Result<Vocab, String> {
        let Some(count) = offsets.len().checked_sub(1) else {
            return Err("no token offsets".into());
        };
        if count >= u32::MAX as usize {
            return Err("vocabulary too large".into());
        }
        if offsets[0] != 0
            || offsets[count] as usize != arena.len()
            || offsets.windows(2).any(|w| w[0] >= w[1])
        {
            return Err("token offsets out of order or out of the arena".into());
        }
        let size = (count * 2).next_power_of_two().max(16);
        let mut vocab = Vocab {
            arena,
            offsets,
            slots: vec![0; size],
            mask: size - 1,
            pairs: vec![u32::MAX; 1 << 16],
        };
        for rank in 0..count {
            let (start, end) = (
                vocab.offsets[rank] as usize,
                vocab.offsets[rank + 1] as usize,
            );
            let t = &vocab.arena[start..end];
            if vocab.rank(t).is_some() {
                return Err(format!("duplicate token bytes at rank {rank}"));
            }
            let h = hash(t);
            if let [a, b] = *t {
                vocab.pairs[usize::from(a) << 8 | usize::from(b)] = rank as u32;
            }
            let mut i = (h as usize) & vocab.mask;
            while vocab.slots[i] != 0 {
                i = (i + 1) & vocab.mask;
            }
            vocab.slots[i] = (h & 0xFFFF_FFFF_0000_0000) | (rank as u64 + 1);
        }
        Ok(vocab)
    }

    /// [`Vocab::new`] from each rank's bytes.
    #[cfg(test)]
    pub(crate) fn from_tokens(tokens: &[Vec<u8>]) -> Result<Vocab, String> {
        let mut offsets = vec![0];
        for t in tokens {
            let end = offsets[offsets.len() - 1] as usize + t.len();
            offsets.push(u32::try_from(end).map_err(|_| "arena too large")?);
        }
        Vocab::new(Cow::Owned(tokens.concat()), offsets)
    }

    /// Number of tokens.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The bytes of a rank.
    #[inline(always)]
    pub(crate) fn bytes(&self, rank: u32) -> &[u8] {
        let r = rank as usize;
        match (self.offsets.get(r), self.offsets.get(r + 1)) {
            (Some(&a), Some(&b)) => self.arena.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    /// The rank of `key`, if it is a token.
    #[inline(always)]
    pub(crate) fn rank(&self, key: &[u8]) -> Option<u32> {
        let h = hash(key);
        let tag = h & 0xFFFF_FFFF_0000_0000;
        let mut i = (h as usize) & self.mask;
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                return None;
            }
            if slot & 0xFFFF_FFFF_0000_0000 == tag {
                let rank = (slot as u32).wrapping_sub(1);
                if same(self.bytes(rank), key) {
                    return Some(rank);
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The rank of the two bytes `[a, b]`, if they are a token.
    #[inline(always)]
    pub(crate) fn pair(&self, a: u8, b: u8) -> u32 {
        self.pairs[usize::from(a) << 8 | usize::from(b)]
    }
}

/// Byte-string equality without a library call for the short keys that dominate.
#[inline(always)]
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    if a.len() <= 8 {
        return load(a) == load(b);
    }
    a == b
}

/// Up to 8 bytes as a zero-padded little-endian word.
#[inline(always)]
fn load(x: &[u8]) -> u64 {
    let mut buf = [0u8; 8];
    let n = x.len().min(8);
    buf[..n].copy_from_slice(&x[..n]);
    u64::from_le_bytes(buf)
}

/// A fast 64-bit hash of a short byte string (word-at-a-time multiply-rotate, then a
/// full-avalanche finalizer so both the low bits (slot) and high bits (tag) are good).
#[inline(always)]
fn hash(key: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = (key.len() as u64).wrapping_mul(K);
    let mut chunks = key.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(K).rotate_left(31);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut buf = [0u8; 8];
        buf[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(buf)).wrapping_mul(K);
    }
    // fmix64 from MurmurHash3.
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^ (h >> 33)
}
