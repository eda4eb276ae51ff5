//! Streaming line reading and line-oriented search over any `Read`, shared by every
//! store backend.

use std::io::{self, BufRead, BufReader, Read};
use std::ops::ControlFlow;

use memchr::{memchr, memchr_iter, memrchr};

use crate::store::{Line, LineRange, Lines, Pattern};

/// Bytes read per `read` call while searching.
const CHUNK: usize = 2 << 20;
/// A line longer than this is searched in windows of this size (see [`grep`]).
pub(crate) const MAX_WINDOW: usize = 16 << 20;

/// `bytes` (a line without its `\n`) as display text: a trailing `\r` dropped, cut to
/// `max` bytes at a character boundary, invalid UTF-8 replaced. The flag says whether
/// it was cut.
pub(crate) fn display_line(bytes: &[u8], max: usize) -> (String, bool) {
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    cut_text(bytes, max)
}

/// Like [`display_line`], but a line longer than `max` is cut around byte `at` (a
/// match) rather than from its start: an eighth of `max` before it (so a reader
/// that shows a quarter of `max` in characters, as the `grep` tool does, shows the
/// match), the rest after. Returns the text, whether it stops before the line's end,
/// and the byte of the line it starts at.
pub(crate) fn display_line_at(bytes: &[u8], max: usize, at: usize) -> (String, bool, usize) {
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    // A match early enough to show within the quarter a reader shows stays in place.
    if bytes.len() <= max || at < max * 3 / 16 {
        let (text, cut) = cut_text(bytes, max);
        return (text, cut, 0);
    }
    let mut from = at.saturating_sub(max / 8).min(bytes.len());
    // Start on a character: skip continuation bytes.
    while from < bytes.len() && (bytes[from] & 0b1100_0000) == 0b1000_0000 {
        from += 1;
    }
    let (text, cut) = cut_text(&bytes[from..], max);
    (text, cut, from)
}

fn cut_text(bytes: &[u8], max: usize) -> (String, bool) {
    if bytes.len() <= max {
        return (String::from_utf8_lossy(bytes).into_owned(), false);
    }
    let mut cut = &bytes[..max];
    // Do not split a multi-byte character: drop an incomplete sequence at the end.
    if let Err(e) = std::str::from_utf8(cut)
        && e.error_len().is_none()
    {
        cut = &cut[..e.valid_up_to()];
    }
    (String::from_utf8_lossy(cut).into_owned(), true)
}

/// Calls `f(offset, line, complete)` for each line of `reader` in order: its byte
/// offset, its bytes without the `\n`, and whether it had one (only the last may not).
/// Reads `buffer` bytes at a time; returns the bytes read.
pub(crate) fn each_line<R: Read>(
    reader: R,
    buffer: usize,
    mut f: impl FnMut(u64, &[u8], bool),
) -> io::Result<u64> {
    let mut reader = BufReader::with_capacity(buffer, reader);
    let mut line = Vec::new();
    let mut offset = 0u64;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(offset);
        }
        let complete = line.last() == Some(&b'\n');
        f(offset, &line[..n - usize::from(complete)], complete);
        offset += n as u64;
    }
}

/// Reads `range` of the lines of `reader` (see [`OffloadStore::read_lines`]).
///
/// [`OffloadStore::read_lines`]: crate::OffloadStore::read_lines
pub(crate) fn read_lines<R: Read>(reader: R, range: &LineRange) -> io::Result<Lines> {
    let mut r = BufReader::with_capacity(64 * 1024, reader);
    let mut out = Lines::default();
    // Index of the line being read (0-based) and whether some of its bytes were
    // consumed already.
    let mut line_no = 0usize;
    let mut in_line = false;
    let mut current: Vec<u8> = Vec::new();
    let mut cut = false;
    let keep = range.max_line_bytes.saturating_add(1);
    loop {
        let buf = fill(&mut r)?;
        if buf.is_empty() {
            if in_line {
                if line_no >= range.offset && out.lines.len() < range.limit {
                    push_line(
                        &mut out,
                        line_no,
                        &current,
                        false,
                        cut,
                        range.max_line_bytes,
                    );
                }
                line_no += 1;
            }
            out.total_lines = Some(line_no);
            return Ok(out);
        }
        if line_no < range.offset {
            // Skip whole lines quickly: find the newline that ends line `offset - 1`.
            let need = range.offset - line_no;
            let mut seen = 0;
            let mut at = None;
            for i in memchr_iter(b'\n', buf) {
                seen += 1;
                if seen == need {
                    at = Some(i);
                    break;
                }
            }
            line_no += seen;
            let used = match at {
                Some(i) => {
                    in_line = false;
                    i + 1
                }
                None => {
                    in_line = buf.last() != Some(&b'\n');
                    buf.len()
                }
            };
            r.consume(used);
            continue;
        }
        if out.lines.len() >= range.limit {
            // At a line boundary with bytes left: more lines follow.
            out.more = true;
            return Ok(out);
        }
        let (segment, ends_line) = match memchr(b'\n', buf) {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        if current.len() < keep {
            let room = keep - current.len();
            current.extend_from_slice(&segment[..segment.len().min(room)]);
        }
        if current.len() >= keep {
            cut = true;
        }
        let used = segment.len() + usize::from(ends_line);
        r.consume(used);
        if ends_line {
            push_line(&mut out, line_no, &current, true, cut, range.max_line_bytes);
            current.clear();
            cut = false;
            line_no += 1;
            in_line = false;
        } else {
            in_line = true;
        }
    }
}

fn fill<R: Read>(r: &mut BufReader<R>) -> io::Result<&[u8]> {
    loop {
        match r.fill_buf() {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    r.fill_buf()
}

/// Adds a line; like [`str::lines`], a `\r` is dropped only before a `\n`.
fn push_line(
    out: &mut Lines,
    line_no: usize,
    bytes: &[u8],
    terminated: bool,
    cut: bool,
    max: usize,
) {
    let (text, truncated) = if terminated && !cut {
        display_line(bytes, max)
    } else {
        cut_text(bytes, max)
    };
    out.lines.push(Line {
        number: line_no + 1,
        text,
        truncated: truncated || cut,
    });
}

/// One matching line found by [`grep`].
pub(crate) struct Found<'a> {
    /// 1-based line number.
    pub line_number: usize,
    /// Offset of the start of the line.
    pub byte_offset: u64,
    /// The line without its `\n` (for a line longer than [`MAX_WINDOW`], the window
    /// the match was found in).
    pub line: &'a [u8],
    /// Where in `line` the first match starts.
    pub match_at: usize,
    /// Where in the whole line `line` starts: 0, unless the line is longer than
    /// [`MAX_WINDOW`] and `line` is a later window of it.
    pub window_at: u64,
}

/// Calls `on_match` for each line of `reader` matching `pattern`, in order, until it
/// returns `Break` or the input ends. Returns the number of bytes read.
///
/// The input is read in chunks and searched a chunk of whole lines at a time: the
/// regex runs over the chunk (so literal prefilters skip most bytes) and a match that
/// would span a newline is re-checked on its line alone, so results are exactly those
/// of matching each line separately. Memory is bounded by the longest line up to
/// [`MAX_WINDOW`]; a longer line is searched window by window, and a match straddling
/// two windows of such a line can be missed.
pub(crate) fn grep<R: Read>(
    mut reader: R,
    pattern: &Pattern,
    mut on_match: impl FnMut(Found<'_>) -> ControlFlow<()>,
) -> io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut len = 0usize;
    let mut state = State {
        base_offset: 0,
        line_number: 1,
        line_start: 0,
        last_reported: 0,
    };
    let mut total = 0u64;
    loop {
        if len == buf.len() && buf.len() < MAX_WINDOW {
            buf.resize(buf.len() * 2, 0);
        }
        let n = loop {
            match reader.read(&mut buf[len..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        total += n as u64;
        let eof = n == 0;
        let scanned_from = len;
        len += n;
        let end = if eof {
            len
        } else {
            match memrchr(b'\n', &buf[scanned_from..len]) {
                Some(i) => scanned_from + i + 1,
                None => match memrchr(b'\n', &buf[..scanned_from]) {
                    Some(i) => i + 1,
                    None if len == buf.len() && buf.len() >= MAX_WINDOW => len,
                    None => continue,
                },
            }
        };
        let flow = search_region(&buf[..end], pattern, &mut state, &mut on_match);
        buf.copy_within(end..len, 0);
        len -= end;
        if flow.is_break() {
            return Ok(total);
        }
        if eof && len == 0 {
            return Ok(total);
        }
    }
}

struct State {
    /// File offset of the first byte of the region.
    base_offset: u64,
    /// Line number of the first byte of the region.
    line_number: usize,
    /// File offset where that line starts (earlier than `base_offset` inside a line
    /// longer than a window).
    line_start: u64,
    /// The last line reported (0: none), so a long line is reported once.
    last_reported: usize,
}

fn search_region(
    hay: &[u8],
    pattern: &Pattern,
    st: &mut State,
    on_match: &mut impl FnMut(Found<'_>) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let re = pattern.regex();
    let mut pos = 0;
    let mut counted = 0;
    let mut line_no = st.line_number;
    let mut flow = ControlFlow::Continue(());
    while pos < hay.len() {
        let (start, end, matched) = if pattern.line_by_line {
            let end = memchr(b'\n', &hay[pos..]).map_or(hay.len(), |i| pos + i);
            (pos, end, re.is_match(&hay[pos..end]))
        } else {
            let Some(m) = re.find_at(hay, pos) else {
                break;
            };
            let start = memrchr(b'\n', &hay[pos..m.start()]).map_or(pos, |i| pos + i + 1);
            if start >= hay.len() {
                break;
            }
            let end = memchr(b'\n', &hay[m.start()..]).map_or(hay.len(), |i| m.start() + i);
            let matched = m.end() <= end || re.is_match(&hay[start..end]);
            (start, end, matched)
        };
        if matched {
            line_no += memchr_iter(b'\n', &hay[counted..start]).count();
            counted = start;
            if line_no != st.last_reported {
                st.last_reported = line_no;
                let byte_offset = if start == 0 {
                    st.line_start
                } else {
                    st.base_offset + start as u64
                };
                let line = &hay[start..end];
                flow = on_match(Found {
                    line_number: line_no,
                    byte_offset,
                    line,
                    match_at: re.find(line).map_or(0, |m| m.start()),
                    window_at: (st.base_offset + start as u64).saturating_sub(byte_offset),
                });
                if flow.is_break() {
                    break;
                }
            }
        }
        pos = end + 1;
    }
    let newlines = line_no - st.line_number + memchr_iter(b'\n', &hay[counted..]).count();
    if let Some(i) = memrchr(b'\n', hay) {
        st.line_start = st.base_offset + i as u64 + 1;
    }
    st.line_number += newlines;
    st.base_offset += hay.len() as u64;
    flow
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(text: &str, offset: usize, limit: usize) -> Lines {
        read_lines(text.as_bytes(), &LineRange::new(offset, limit)).unwrap()
    }

    fn grep_all(text: &[u8], pattern: &str) -> Vec<(usize, u64, String)> {
        let p = Pattern::new(pattern).unwrap();
        let mut out = Vec::new();
        grep(text, &p, |f| {
            out.push((
                f.line_number,
                f.byte_offset,
                String::from_utf8_lossy(f.line).into_owned(),
            ));
            ControlFlow::Continue(())
        })
        .unwrap();
        out
    }

    /// The reference: each line on its own.
    fn grep_naive(text: &[u8], pattern: &str) -> Vec<(usize, u64, String)> {
        let p = Pattern::new(pattern).unwrap();
        let mut out = Vec::new();
        let mut offset = 0u64;
        let s = String::from_utf8_lossy(text);
        for (i, line) in s.split_inclusive('\n').enumerate() {
            let body = line.strip_suffix('\n').unwrap_or(line);
            if p.is_match_line(body.as_bytes()) {
                out.push((i + 1, offset, body.to_owned()));
            }
            offset += line.len() as u64;
        }
        out
    }

    #[test]
    fn line_semantics_match_str_lines() {
        for text in [
            "",
            "\n",
            "a",
            "a\n",
            "a\nb",
            "a\nb\n",
            "\n\n",
            "a\r\nb\r\n",
            "x\n\ny",
        ] {
            let want: Vec<&str> = text.lines().collect();
            let got = lines_of(text, 0, 100);
            let texts: Vec<&str> = got.lines.iter().map(|l| l.text.as_str()).collect();
            assert_eq!(texts, want, "{text:?}");
            assert_eq!(got.total_lines, Some(want.len()), "{text:?}");
            assert!(!got.more);
        }
    }

    #[test]
    fn offsets_limits_and_more() {
        let text: String = (1..=10).map(|i| format!("line {i}\n")).collect();
        let got = lines_of(&text, 3, 2);
        assert_eq!(got.lines.len(), 2);
        assert_eq!(
            (got.lines[0].number, got.lines[0].text.as_str()),
            (4, "line 4")
        );
        assert_eq!(got.lines[1].number, 5);
        assert!(got.more);
        assert_eq!(got.total_lines, None);

        let tail = lines_of(&text, 8, 5);
        assert_eq!(tail.lines.len(), 2);
        assert!(!tail.more);
        assert_eq!(tail.total_lines, Some(10));

        let past = lines_of(&text, 50, 5);
        assert!(past.lines.is_empty());
        assert_eq!(past.total_lines, Some(10));

        let exact = lines_of(&text, 0, 10);
        assert_eq!(exact.lines.len(), 10);
        assert!(!exact.more);
        assert_eq!(exact.total_lines, Some(10));
    }

    #[test]
    fn skipping_across_small_buffers() {
        // Lines longer than the reader's buffer, skipped and read.
        let long = "x".repeat(200_000);
        let text = format!("{long}\n{long}\nthird\n{long}");
        let got = lines_of(&text, 2, 2);
        assert_eq!(got.lines[0].text, "third");
        assert_eq!(got.lines[1].number, 4);
        assert!(got.lines[1].truncated);
        assert_eq!(got.lines[1].text.len(), 8 * 1024);
        assert_eq!(got.total_lines, Some(4));
        let skip_all = lines_of(&text, 3, 1);
        assert_eq!(skip_all.lines[0].number, 4);
    }

    #[test]
    fn long_lines_are_cut_at_char_boundaries() {
        let (s, cut) = display_line("ééé".as_bytes(), 3);
        assert_eq!((s.as_str(), cut), ("é", true));
        let (s, cut) = display_line(b"abc\r", 10);
        assert_eq!((s.as_str(), cut), ("abc", false));
    }

    #[test]
    fn grep_matches_each_line_alone() {
        let text = b"alpha beta\ngamma\n\nbeta\nalpha\nlast line no newline";
        for pattern in [
            "beta",
            "^alpha",
            "a$",
            "^$",
            "",
            r"a\sb",
            r"(?s)alpha.*beta",
            r"\n",
            r"\Aalpha",
            r"line\z",
            r"\bno\b",
            "nothing",
            "x*",
        ] {
            assert_eq!(
                grep_all(text, pattern),
                grep_naive(text, pattern),
                "{pattern:?}"
            );
        }
    }

    #[test]
    fn grep_across_chunks_counts_lines_and_offsets() {
        // Enough text to need several chunks, with matches near chunk edges.
        let mut text = Vec::new();
        let mut i = 0;
        while text.len() < 3 * CHUNK + 1000 {
            let line = if i % 997 == 0 {
                format!("{i} needle here\n")
            } else {
                format!("{i} {}\n", "filler ".repeat(i % 13))
            };
            text.extend_from_slice(line.as_bytes());
            i += 1;
        }
        assert_eq!(grep_all(&text, "needle"), grep_naive(&text, "needle"));
        assert_eq!(grep_all(&text, "^[0-9]+7 "), grep_naive(&text, "^[0-9]+7 "));
    }

    #[test]
    fn grep_stops_when_asked() {
        let text = b"x\nx\nx\n";
        let p = Pattern::new("x").unwrap();
        let mut n = 0;
        grep(&text[..], &p, |_| {
            n += 1;
            if n == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
        assert_eq!(n, 2);
    }

    #[test]
    fn grep_a_line_longer_than_a_window() {
        let mut text = b"first\n".to_vec();
        text.extend(std::iter::repeat_n(b'a', MAX_WINDOW + 10));
        text.extend_from_slice(b"needle\nafter needle\n");
        let got = grep_all(&text, "needle");
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].0, got[0].1), (2, 6));
        assert_eq!(got[1].0, 3);
    }

    proptest::proptest! {
        #[test]
        fn grep_agrees_with_the_naive_search(
            lines in proptest::collection::vec("[ab\\n]{0,12}", 0..40),
            pattern in proptest::sample::select(vec!["a", "^a", "b$", "ab|ba", "^$", r"a\nb", "(?s)a.b", "b*"]),
        ) {
            let text = lines.join("\n");
            proptest::prop_assert_eq!(grep_all(text.as_bytes(), pattern), grep_naive(text.as_bytes(), pattern));
        }

        #[test]
        fn read_lines_agrees_with_str_lines(text in "[ab\\r\\n]{0,60}", offset in 0usize..8, limit in 0usize..8) {
            let all: Vec<&str> = text.lines().collect();
            let got = lines_of(&text, offset, limit);
            let want: Vec<String> = all.iter().skip(offset).take(limit).map(|s| (*s).to_owned()).collect();
            let texts: Vec<String> = got.lines.iter().map(|l| l.text.clone()).collect();
            proptest::prop_assert_eq!(texts, want);
            proptest::prop_assert_eq!(got.more, offset + limit < all.len());
            if !got.more {
                proptest::prop_assert_eq!(got.total_lines, Some(all.len()));
            }
        }
    }
}
