//! Unicode character classes used by the pre-tokenizers, as a two-level lookup table.
//!
//! The classes come from `regex-syntax`, the same Unicode tables `fancy-regex` (and so
//! tiktoken) uses for `\p{..}` and `\s`, so a character is classified exactly as
//! tiktoken's regular expressions classify it.

use std::collections::HashMap;

use regex_syntax::hir::{Class, HirKind};

/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`: "upper-like" letters and marks (o200k).
pub(crate) const UPPER: u8 = 1;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`: "lower-like" letters and marks (o200k).
pub(crate) const LOWER: u8 = 2;
/// `\p{L}`.
pub(crate) const LETTER: u8 = 4;
/// `\p{N}`.
pub(crate) const NUMBER: u8 = 8;
/// `\s` (Unicode `White_Space`).
pub(crate) const SPACE: u8 = 16;

const BLOCK_BITS: u32 = 8;
const BLOCK: usize = 1 << BLOCK_BITS;
const CODEPOINTS: usize = 0x11_0000;

/// Class bits for every Unicode scalar value.
pub(crate) struct Classes {
    ascii: [u8; 128],
    /// For each 256-codepoint block, the index of its (deduplicated) class block.
    index: Vec<u16>,
    blocks: Vec<[u8; BLOCK]>,
}

impl Classes {
    /// Builds the table from `regex-syntax`'s Unicode data.
    pub(crate) fn build() -> Result<Classes, String> {
        let mut flat = vec![0u8; CODEPOINTS];
        let sets: [(&str, u8); 5] = [
            (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", UPPER),
            (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", LOWER),
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
        ];
        for (pattern, bit) in sets {
            for (start, end) in ranges(pattern)? {
                for cp in start..=end {
                    if let Some(slot) = flat.get_mut(cp as usize) {
                        *slot |= bit;
                    }
                }
            }
        }
        let mut ascii = [0u8; 128];
        ascii.copy_from_slice(&flat[..128]);

        let mut seen: HashMap<[u8; BLOCK], u16> = HashMap::new();
        let mut blocks = Vec::new();
        let mut index = Vec::with_capacity(CODEPOINTS / BLOCK);
        for chunk in flat.chunks_exact(BLOCK) {
            let mut block = [0u8; BLOCK];
            block.copy_from_slice(chunk);
            let next = u16::try_from(blocks.len()).map_err(|_| "too many class blocks")?;
            let id = *seen.entry(block).or_insert_with(|| {
                blocks.push(block);
                next
            });
            index.push(id);
        }
        Ok(Classes {
            ascii,
            index,
            blocks,
        })
    }

    /// The class bits of a codepoint (0 for anything out of range).
    #[inline(always)]
    pub(crate) fn of(&self, cp: u32) -> u8 {
        if cp < 128 {
            return self.ascii[cp as usize];
        }
        self.of_non_ascii(cp)
    }

    #[inline]
    fn of_non_ascii(&self, cp: u32) -> u8 {
        let Some(&block) = self.index.get((cp >> BLOCK_BITS) as usize) else {
            return 0;
        };
        self.blocks
            .get(block as usize)
            .map_or(0, |b| b[(cp as usize) & (BLOCK - 1)])
    }
}

/// The codepoint ranges of a regex character class.
fn ranges(pattern: &str) -> Result<Vec<(u32, u32)>, String> {
    let hir = regex_syntax::ParserBuilder::new()
        .unicode(true)
        .build()
        .parse(pattern)
        .map_err(|e| e.to_string())?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => Ok(class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect()),
        _ => Err(format!("`{pattern}` is not a Unicode class")),
    }
}

/// True for `\r` and `\n`.
#[inline(always)]
pub(crate) fn is_nl(cp: u32) -> bool {
    cp == u32::from(b'\n') || cp == u32::from(b'\r')
}

/// Decodes the char starting at byte `i` of valid UTF-8 `b`: `(codepoint, byte length)`.
///
/// Never panics: out-of-range reads yield 0 (impossible for `&str` input).
#[inline(always)]
pub(crate) fn decode(b: &[u8], i: usize) -> (u32, usize) {
    let b0 = match b.get(i) {
        Some(&x) => x,
        None => return (0, 1),
    };
    if b0 < 0x80 {
        return (u32::from(b0), 1);
    }
    let at = |k: usize| u32::from(b.get(i + k).copied().unwrap_or(0x80) & 0x3F);
    if b0 < 0xE0 {
        ((u32::from(b0 & 0x1F) << 6) | at(1), 2)
    } else if b0 < 0xF0 {
        ((u32::from(b0 & 0x0F) << 12) | (at(1) << 6) | at(2), 3)
    } else {
        (
            (u32::from(b0 & 0x07) << 18) | (at(1) << 12) | (at(2) << 6) | at(3),
            4,
        )
    }
}
