//! Reading lines with bounded memory, and showing text to the model.

use std::io::{self, BufRead};

/// Bytes looked at to tell a binary file from text (as git and ripgrep do: a NUL byte
/// in the first 8 KiB means binary).
pub(super) const SNIFF_BYTES: usize = 8 * 1024;

/// What [`LineReader::next_line`] saw of one line.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LineInfo {
    /// The line was longer than the kept prefix.
    pub truncated: bool,
    /// The line holds a NUL byte (binary data), in the kept part or after it.
    pub nul: bool,
}

/// Splits a reader into lines at `\n` (a `\r` before it is dropped), keeping at most
/// a given number of bytes of each line: a line of any length costs that much memory
/// plus the reader's buffer.
pub(super) struct LineReader<R> {
    inner: R,
    consumed: u64,
}

impl<R: BufRead> LineReader<R> {
    pub(super) fn new(inner: R) -> Self {
        LineReader { inner, consumed: 0 }
    }

    /// Bytes read so far.
    pub(super) fn consumed(&self) -> u64 {
        self.consumed
    }

    /// True when the first bytes of what is left look binary (hold a NUL byte).
    pub(super) fn looks_binary(&mut self) -> io::Result<bool> {
        let buf = self.inner.fill_buf()?;
        let head = buf.get(..SNIFF_BYTES).unwrap_or(buf);
        Ok(memchr::memchr(0, head).is_some())
    }

    /// True when nothing is left to read.
    pub(super) fn at_end(&mut self) -> io::Result<bool> {
        Ok(self.inner.fill_buf()?.is_empty())
    }

    /// The next line into `line` (cleared first), without its line ending and cut to
    /// `max_keep` bytes; `None` at the end of the input.
    pub(super) fn next_line(
        &mut self,
        line: &mut Vec<u8>,
        max_keep: usize,
    ) -> io::Result<Option<LineInfo>> {
        line.clear();
        let mut info = LineInfo::default();
        let mut any = false;
        loop {
            let buf = match self.inner.fill_buf() {
                Ok(buf) => buf,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                break;
            }
            any = true;
            let (chunk, used, done) = match memchr::memchr(b'\n', buf) {
                Some(i) => (buf.get(..i).unwrap_or(buf), i + 1, true),
                None => (buf, buf.len(), false),
            };
            if memchr::memchr(0, chunk).is_some() {
                info.nul = true;
            }
            let room = max_keep.saturating_sub(line.len());
            if chunk.len() > room {
                info.truncated = true;
            }
            line.extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or(chunk));
            self.inner.consume(used);
            self.consumed = self.consumed.saturating_add(used as u64);
            if done {
                break;
            }
        }
        if !any {
            return Ok(None);
        }
        if !info.truncated && line.last() == Some(&b'\r') {
            line.pop();
        }
        Ok(Some(info))
    }
}

/// `n` with thousands separators: `1234567` → `1,234,567`.
pub(super) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A line's bytes as text for the model, cut to `max_chars` characters. `cut_before`
/// says the reader already dropped the line's tail (its full length is unknown).
pub(super) fn show_line(bytes: &[u8], cut_before: bool, max_chars: usize) -> String {
    // No more bytes than `max_chars`: no more characters either, nothing to count.
    if bytes.len() <= max_chars && !cut_before {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    let text = String::from_utf8_lossy(bytes);
    match text.char_indices().nth(max_chars) {
        Some((cut, _)) => {
            let kept = text.get(..cut).unwrap_or_default();
            if cut_before {
                format!("{kept}… [line cut]")
            } else {
                let rest = text.get(cut..).unwrap_or_default().chars().count();
                format!("{kept}… [{} more characters]", thousands(rest as u64))
            }
        }
        None if cut_before => format!("{text}… [line cut]"),
        None => text.into_owned(),
    }
}

/// Like [`show_line`], for a line `grep` matched at byte `at`: a line too long to show
/// whole is shown from a little before the match, so the match is in what the model
/// reads.
pub(super) fn show_match(bytes: &[u8], cut_before: bool, max_chars: usize, at: usize) -> String {
    // A match that starts within the first three quarters shows from the start.
    let near = max_chars - max_chars / 4;
    if at < near {
        // Fewer bytes than that before the match: fewer characters too.
        return show_line(bytes, cut_before, max_chars);
    }
    let text = String::from_utf8_lossy(bytes);
    let at_char = text.get(..at).map_or(0, |t| t.chars().count());
    if at_char < near {
        return show_line(bytes, cut_before, max_chars);
    }
    let from = at_char - max_chars / 4;
    let from_byte = text.char_indices().nth(from).map_or(0, |(i, _)| i);
    let shown = show_line(&text.as_bytes()[from_byte..], cut_before, max_chars);
    format!(
        "[from character {} of the line] …{shown}",
        thousands(from as u64)
    )
}

/// A value from outside (a path, a pattern) quoted in backticks for a message, cut
/// to 200 characters so an enormous argument is not echoed whole.
pub(super) fn quoted(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("`{}…`", text.get(..cut).unwrap_or_default()),
        None => format!("`{text}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], keep: usize) -> Vec<(String, bool, bool)> {
        let mut reader = LineReader::new(io::BufReader::with_capacity(4, input));
        let mut line = Vec::new();
        let mut out = Vec::new();
        while let Ok(Some(info)) = reader.next_line(&mut line, keep) {
            out.push((
                String::from_utf8_lossy(&line).into_owned(),
                info.truncated,
                info.nul,
            ));
        }
        out
    }

    #[test]
    fn splits_lines_across_buffer_refills() {
        let got = lines(b"alpha\r\nbeta\n\ngamma", 100);
        let texts: Vec<&str> = got.iter().map(|l| l.0.as_str()).collect();
        assert_eq!(texts, ["alpha", "beta", "", "gamma"]);
        assert!(lines(b"", 100).is_empty());
        assert_eq!(lines(b"\n", 100).len(), 1);
    }

    #[test]
    fn long_lines_keep_a_bounded_prefix_and_nul_is_seen_past_it() {
        let got = lines(b"0123456789abc\0def\nshort\n", 5);
        assert_eq!(got[0], ("01234".to_owned(), true, true));
        assert_eq!(got[1], ("short".to_owned(), false, false));
    }

    #[test]
    fn thousands_and_line_cuts() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(show_line(b"abcdef", false, 3), "abc… [3 more characters]");
        assert_eq!(show_line(b"abc", true, 3), "abc… [line cut]");
        assert_eq!(show_line("héllo".as_bytes(), false, 10), "héllo");
        // A match near the start: as `show_line`. Far in: from a little before it.
        assert_eq!(
            show_match(b"abcdef", false, 3, 1),
            "abc… [3 more characters]"
        );
        let long = format!("{}NEEDLE{}", "x".repeat(5_000), "y".repeat(5_000));
        let shown = show_match(long.as_bytes(), false, 100, 5_000);
        assert!(
            shown.starts_with("[from character 4,975 of the line] …"),
            "{shown}"
        );
        assert!(shown.contains("NEEDLE"), "{shown}");
        assert!(shown.ends_with("… [4,931 more characters]"), "{shown}");
        assert_eq!(quoted("a"), "`a`");
        assert!(quoted(&"x".repeat(500)).ends_with("…`"));
    }
}
