//! Pre-tokenization: splitting text into the pieces BPE encodes one by one.
//!
//! tiktoken splits text with a regular expression that needs a backtracking engine
//! (`fancy-regex`) because of one look-ahead, `\s+(?!\S)`. Here each encoding's
//! expression is instead written out as a hand-made matcher that tries the same
//! alternatives in the same order with the same greedy/backtracking outcome, so the
//! pieces are identical (the tests compare them with tiktoken's on generated and
//! exhaustive Unicode input) while scanning each byte about once.
//!
//! Notation below: `U` = `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`, `W` =
//! `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`, `L` = `\p{L}`, `N` = `\p{N}`, `S` = `\s`,
//! `P` = `[^\r\n\p{L}\p{N}]` (the optional prefix), `Q` = `[^\s\p{L}\p{N}]`.

use super::classes::{Classes, LETTER, LOWER, NUMBER, SPACE, UPPER, decode, is_nl};

/// A pre-tokenization pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// o200k_base:
    /// `P?U*W+C?|P?U+W*C?|N{1,3}| ?Q+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// where `C` = `(?i:'s|'t|'re|'ve|'m|'ll|'d)`.
    O200k,
    /// cl100k_base:
    /// `'(?i:[sdmt]|ll|ve|re)|P?+L++|N{1,3}+| ?Q++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s`
    Cl100k,
}

impl Pattern {
    /// Calls `f` with every piece of `text`, in order. The pieces tile the text.
    #[inline]
    pub(crate) fn for_each_piece(self, c: &Classes, text: &str, mut f: impl FnMut(&[u8])) {
        let b = text.as_bytes();
        let mut p = 0;
        while p < b.len() {
            let end = match self {
                Pattern::O200k => o200k(c, b, p),
                Pattern::Cl100k => cl100k(c, b, p),
            };
            // Every alternative consumes at least one char; guard anyway so a bug can
            // never loop forever.
            let end = if end > p { end.min(b.len()) } else { p + 1 };
            f(&b[p..end]);
            p = end;
        }
    }
}

/// Class bits of the char at `i`, with its codepoint and length; `None` at the end.
#[inline(always)]
fn at(c: &Classes, b: &[u8], i: usize) -> Option<(u32, usize, u8)> {
    if i >= b.len() {
        return None;
    }
    let (cp, len) = decode(b, i);
    Some((cp, len, c.of(cp)))
}

/// End of the longest run of chars starting at `i` whose class has a bit of `mask`.
#[inline(always)]
fn run(c: &Classes, b: &[u8], mut i: usize, mask: u8) -> usize {
    while let Some((_, len, k)) = at(c, b, i) {
        if k & mask == 0 {
            break;
        }
        i += len;
    }
    i
}

/// End of the longest run of `Q` chars (not space, letter or number) from `i`.
#[inline(always)]
fn q_run(c: &Classes, b: &[u8], mut i: usize) -> usize {
    while let Some((_, len, k)) = at(c, b, i) {
        if k & (SPACE | LETTER | NUMBER) != 0 {
            break;
        }
        i += len;
    }
    i
}

/// End of up to three `N` chars from `i` (`\p{N}{1,3}`, the first known to match).
#[inline(always)]
fn digits(c: &Classes, b: &[u8], mut i: usize) -> usize {
    for _ in 0..3 {
        match at(c, b, i) {
            Some((_, len, k)) if k & NUMBER != 0 => i += len,
            _ => break,
        }
    }
    i
}

/// End of the run of bytes in `set` from `i` (all ASCII).
#[inline(always)]
fn byte_run(b: &[u8], mut i: usize, set: &[u8]) -> usize {
    while b.get(i).is_some_and(|x| set.contains(x)) {
        i += 1;
    }
    i
}

/// True if `x` is the ASCII letter `lower` in either case.
#[inline(always)]
fn ci(x: Option<&u8>, lower: u8) -> bool {
    x.is_some_and(|&x| x | 0x20 == lower)
}

/// `(?i:s)` at `i`: `s`, `S`, or `ſ` (U+017F, which Unicode case folding maps to `s`).
/// Returns the end of the match.
#[inline(always)]
fn fold_s(b: &[u8], i: usize) -> Option<usize> {
    if ci(b.get(i), b's') {
        Some(i + 1)
    } else if b.get(i) == Some(&0xC5) && b.get(i + 1) == Some(&0xBF) {
        Some(i + 2)
    } else {
        None
    }
}

/// After `'` at `i - 1`, two-letter contractions: `(?i:re|ve|ll)`.
#[inline(always)]
fn two_letter(b: &[u8], i: usize) -> Option<usize> {
    let first = b.get(i);
    let second = b.get(i + 1);
    if (ci(first, b'r') || ci(first, b'v')) && ci(second, b'e') {
        return Some(i + 2);
    }
    if ci(first, b'l') && ci(second, b'l') {
        return Some(i + 2);
    }
    None
}

// ---------------------------------------------------------------------------------
// o200k_base
// ---------------------------------------------------------------------------------

/// The optional o200k suffix `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` after a letter run ending
/// at `e`. The alternatives differ in their first letter, so at most one applies.
#[inline(always)]
fn o200k_suffix(b: &[u8], e: usize) -> usize {
    if b.get(e) != Some(&b'\'') {
        return e;
    }
    let i = e + 1;
    if let Some(end) = fold_s(b, i) {
        return end;
    }
    let x = b.get(i);
    if ci(x, b't') || ci(x, b'm') || ci(x, b'd') {
        return i + 1;
    }
    two_letter(b, i).unwrap_or(e)
}

/// `U*W+` from `s` with backtracking: the end of the match, if any.
///
/// Greedy `U*` takes the whole `U` run `s..e`. If the char at `e` is `W`, `W+` takes the
/// `W` run from there. Otherwise `U*` gives back chars one at a time; the first (i.e.
/// last-in-run) char that is also `W` (`Lm`, `Lo`, `M`) lets `W+` match that one char
/// (the next char, inside the run or at `e`, is not `W`).
#[inline(always)]
fn upper_star_lower_plus(c: &Classes, b: &[u8], s: usize) -> Option<usize> {
    let mut i = s;
    let mut last_lower_end = None;
    while let Some((_, len, k)) = at(c, b, i) {
        if k & UPPER == 0 {
            if k & LOWER != 0 {
                return Some(run(c, b, i + len, LOWER));
            }
            break;
        }
        if k & LOWER != 0 {
            last_lower_end = Some(i + len);
        }
        i += len;
    }
    last_lower_end
}

/// `U+W*` from `s`: the end of the match, if any.
#[inline(always)]
fn upper_plus_lower_star(c: &Classes, b: &[u8], s: usize) -> Option<usize> {
    let e = run(c, b, s, UPPER);
    if e == s {
        return None;
    }
    Some(run(c, b, e, LOWER))
}

/// End of the o200k piece starting at `p` (`p < b.len()`).
fn o200k(c: &Classes, b: &[u8], p: usize) -> usize {
    let Some((c0, l0, k0)) = at(c, b, p) else {
        return b.len();
    };
    // Fast path: a lowercase-like char has no prefix and starts `U*W+` with empty `U*`.
    if k0 & (LOWER | UPPER) == LOWER {
        return o200k_suffix(b, run(c, b, p + l0, LOWER));
    }
    let prefix = k0 & (LETTER | NUMBER) == 0 && !is_nl(c0);

    // Alternative 1: P?U*W+C?  (with the prefix first, then without)
    if prefix && let Some(e) = upper_star_lower_plus(c, b, p + l0) {
        return o200k_suffix(b, e);
    }
    if let Some(e) = upper_star_lower_plus(c, b, p) {
        return o200k_suffix(b, e);
    }
    // Alternative 2: P?U+W*C?
    if prefix && let Some(e) = upper_plus_lower_star(c, b, p + l0) {
        return o200k_suffix(b, e);
    }
    if let Some(e) = upper_plus_lower_star(c, b, p) {
        return o200k_suffix(b, e);
    }
    // Alternative 3: \p{N}{1,3}
    if k0 & NUMBER != 0 {
        return digits(c, b, p);
    }
    // Alternative 4: ` ?Q+[\r\n/]*`
    if c0 == u32::from(b' ')
        && let Some((_, l1, k1)) = at(c, b, p + 1)
        && k1 & (SPACE | LETTER | NUMBER) == 0
    {
        return byte_run(b, q_run(c, b, p + 1 + l1), b"\r\n/");
    }
    if k0 & (SPACE | LETTER | NUMBER) == 0 {
        return byte_run(b, q_run(c, b, p + l0), b"\r\n/");
    }
    // Only whitespace is left (letters and numbers matched above).
    whitespace_o200k(c, b, p)
}

/// Alternatives 5-7 of o200k at a whitespace char: `\s*[\r\n]+|\s+(?!\S)|\s+`.
fn whitespace_o200k(c: &Classes, b: &[u8], p: usize) -> usize {
    let ws = scan_whitespace(c, b, p);
    // \s*[\r\n]+ : greedy \s* backs off to the last newline of the run.
    if let Some(e) = ws.last_newline_end {
        return e;
    }
    // \s+(?!\S) : the whole run at the end of the text, else the run minus its last
    // char (whose successor is then whitespace) when that leaves at least one char.
    if ws.end == b.len() || ws.chars == 1 {
        // \s+ (or the whole run at the end).
        return ws.end;
    }
    ws.last_start
}

// ---------------------------------------------------------------------------------
// cl100k_base
// ---------------------------------------------------------------------------------

/// End of the cl100k piece starting at `p` (`p < b.len()`).
fn cl100k(c: &Classes, b: &[u8], p: usize) -> usize {
    let Some((c0, l0, k0)) = at(c, b, p) else {
        return b.len();
    };
    // Alternative 1: '(?i:[sdmt]|ll|ve|re)
    if c0 == u32::from(b'\'') {
        let i = p + 1;
        if let Some(end) = fold_s(b, i) {
            return end;
        }
        let x = b.get(i);
        if ci(x, b'd') || ci(x, b'm') || ci(x, b't') {
            return i + 1;
        }
        if let Some(end) = two_letter(b, i) {
            return end;
        }
    }
    // Alternative 2: P?+L++ (a letter cannot be the prefix, so the possessive `?+`
    // gives the same result as `?`).
    if k0 & LETTER != 0 {
        return run(c, b, p + l0, LETTER);
    }
    if k0 & NUMBER == 0
        && !is_nl(c0)
        && let Some((_, l1, k1)) = at(c, b, p + l0)
        && k1 & LETTER != 0
    {
        return run(c, b, p + l0 + l1, LETTER);
    }
    // Alternative 3: \p{N}{1,3}+
    if k0 & NUMBER != 0 {
        return digits(c, b, p);
    }
    // Alternative 4: ` ?Q++[\r\n]*+`
    if c0 == u32::from(b' ')
        && let Some((_, l1, k1)) = at(c, b, p + 1)
        && k1 & (SPACE | LETTER | NUMBER) == 0
    {
        return byte_run(b, q_run(c, b, p + 1 + l1), b"\r\n");
    }
    if k0 & (SPACE | LETTER | NUMBER) == 0 {
        return byte_run(b, q_run(c, b, p + l0), b"\r\n");
    }
    // Whitespace: \s++$ | \s*[\r\n] | \s+(?!\S) | \s
    let ws = scan_whitespace(c, b, p);
    if ws.end == b.len() {
        return ws.end;
    }
    if let Some(e) = ws.last_newline_end {
        return e;
    }
    if ws.chars >= 2 {
        return ws.last_start;
    }
    p + l0
}

/// A maximal whitespace run.
struct Whitespace {
    /// Where the run ends (exclusive).
    end: usize,
    /// The end of its last `\r` or `\n`, if any.
    last_newline_end: Option<usize>,
    /// Where its last char starts.
    last_start: usize,
    /// How many chars it has.
    chars: usize,
}

#[inline(always)]
fn scan_whitespace(c: &Classes, b: &[u8], p: usize) -> Whitespace {
    let mut ws = Whitespace {
        end: p,
        last_newline_end: None,
        last_start: p,
        chars: 0,
    };
    while let Some((cp, len, k)) = at(c, b, ws.end) {
        if k & SPACE == 0 {
            break;
        }
        if is_nl(cp) {
            ws.last_newline_end = Some(ws.end + len);
        }
        ws.last_start = ws.end;
        ws.chars += 1;
        ws.end += len;
    }
    ws
}

/// Byte offsets in `text` where both patterns are guaranteed to end a piece no matter
/// what precedes: right after a `\r` or `\n` that is followed by a char that is neither
/// whitespace nor `/`. Counting the text split there gives the same pieces (see
/// `engine::safe_split` and its tests).
///
/// Why: the char before the boundary is a newline, so no letter, number or `Q` run can
/// cross it; `[\r\n/]*` / `[\r\n]*` tails stop at it because the next char is not a
/// newline or `/`; a whitespace run stops at it because the next char is not
/// whitespace, and any whitespace run that contains the newline ends with a match up
/// to that newline (`\s*[\r\n]+`, or `\s++$`/`\s*[\r\n]` for cl100k, both of which
/// give the same end when the text is cut there). Matching only looks forward, so the
/// text after the boundary splits the same way on its own.
pub(crate) fn is_safe_boundary(c: &Classes, b: &[u8], i: usize) -> bool {
    if i == 0 || i >= b.len() {
        return false;
    }
    let before = b[i - 1];
    if before != b'\n' && before != b'\r' {
        return false;
    }
    match at(c, b, i) {
        Some((cp, _, k)) => k & SPACE == 0 && cp != u32::from(b'/'),
        None => false,
    }
}
