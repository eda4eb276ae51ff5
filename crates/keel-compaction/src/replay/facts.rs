//! Needed facts: the identifiers a recorded agent passed on, and whether keel's prompt
//! still held them when it did.
//!
//! An agent's next call mostly passes on things it was told: a reservation code from a
//! tool result, a user id the user typed, the path of a file it listed, a line number.
//! When a compaction drops such a value the agent has to ask again, search the archive,
//! or guess. [`identifiers`] finds the identifier-like strings of a text (ids and codes,
//! emails, file paths, numbers of three or more digits, quoted strings);
//! [`needed_facts`] keeps those of an assistant turn that came from earlier user or
//! tool messages and not from the system prompt or the goal, which keel never drops.
//! The replay then checks each against the prompt keel assembled for that turn.

use keel_message::{Message, Role};
use serde_json::Value;

/// The most characters an identifier may have (longer strings are prose or code).
const MAX_FACT_CHARS: usize = 80;

/// Identifier-like strings of `text`, in order of appearance, without repeats: tokens
/// with three or more digits (numbers, dates, ids such as `sofia_kim_7287`), tokens that
/// mix letters and digits (`HAT136`, `E0425`), emails, file paths (`src/lib.rs`,
/// `/tmp/out`, `setup.py`), upper-case codes of five or more characters (`AQLBTL`), and
/// the contents of quoted strings (`"…"`, `'…'`, `` `…` ``, 3 to 80 characters, on one
/// line).
///
/// ```
/// use keel_compaction::replay::identifiers;
///
/// let found = identifiers("Booked HAT136 for sofia.kim@example.com; see `cancel policy` in docs/policy.md (ref 20240515).");
/// assert_eq!(found, ["HAT136", "sofia.kim@example.com", "cancel policy", "docs/policy.md", "20240515"]);
/// assert!(identifiers("I will look it up now.").is_empty());
/// ```
pub fn identifiers(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |s: &str| {
        if !out.iter().any(|o| o == s) {
            out.push(s.to_owned());
        }
    };
    let mut quoted: Vec<(usize, &str)> = quoted_strings(text);
    let mut tokens: Vec<(usize, &str)> = tokens(text).filter(|(_, t)| is_identifier(t)).collect();
    tokens.append(&mut quoted);
    tokens.sort_by_key(|(at, _)| *at);
    for (_, t) in tokens {
        push(t);
    }
    out
}

/// The identifiers an assistant turn passes on: in its text and in its tool calls'
/// arguments (every string value that is one identifier-like token, upper-case codes
/// of three or more letters such as `JFK` included, numbers of three or more digits,
/// and the identifiers inside longer string values).
pub fn turn_identifiers(turn: &Message) -> Vec<String> {
    let mut out = identifiers(&turn.text());
    for call in &turn.tool_calls {
        match call.arguments.as_json() {
            Some(v) => argument_identifiers(v, &mut out),
            None => {
                for f in identifiers(&call.arguments.to_json_string()) {
                    push_new(&mut out, f);
                }
            }
        }
    }
    out
}

fn push_new(out: &mut Vec<String>, s: String) {
    if !out.contains(&s) {
        out.push(s);
    }
}

fn argument_identifiers(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => {
            let t = s.trim();
            let one_token =
                !t.is_empty() && t.len() <= MAX_FACT_CHARS && !t.contains(char::is_whitespace);
            if one_token && (is_identifier(t) || is_short_code(t)) {
                push_new(out, t.to_owned());
            } else {
                for f in identifiers(s) {
                    push_new(out, f);
                }
            }
        }
        Value::Number(n) => {
            let s = match n.as_i64() {
                Some(i) => i.to_string(),
                None => n.to_string(),
            };
            if s.bytes().filter(u8::is_ascii_digit).count() >= 3 {
                push_new(out, s);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| argument_identifiers(i, out)),
        Value::Object(map) => map.values().for_each(|i| argument_identifiers(i, out)),
        Value::Bool(_) | Value::Null => {}
    }
}

/// `JFK`, `USD`: a whole argument value of three or more upper-case letters.
fn is_short_code(t: &str) -> bool {
    t.len() >= 3
        && t.bytes().any(|b| b.is_ascii_uppercase())
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Characters that end a token.
fn is_separator(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '"' | '\''
                | '`'
                | '('
                | ')'
                | '['
                | ']'
                | '{'
                | '}'
                | '<'
                | '>'
                | ','
                | ';'
                | '='
                | '|'
                | ':'
                | '*'
                | '!'
                | '?'
                | '$'
                | '#'
                | '&'
                | '\\'
        )
}

/// The tokens of `text` with their byte offsets, trailing dots trimmed.
fn tokens(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut start = None;
    let mut spans = Vec::new();
    for (i, c) in text.char_indices() {
        // `https://…` stays one token.
        let url = c == ':' && text[i + 1..].starts_with("//");
        if is_separator(c) && !url {
            if let Some(s) = start.take() {
                spans.push((s, i));
            }
        } else if start.is_none() {
            start = Some(i);
        }
    }
    if let Some(s) = start {
        spans.push((s, text.len()));
    }
    spans.into_iter().filter_map(move |(s, e)| {
        let t = text[s..e].trim_end_matches(['.', '-', '_', '/']);
        let t = t.trim_start_matches(['-', '_']);
        let skip = text[s..e].len() - text[s..e].trim_start_matches(['-', '_']).len();
        (!t.is_empty()).then_some((s + skip, t))
    })
}

/// Whether one token is an identifier (see [`identifiers`]).
fn is_identifier(t: &str) -> bool {
    if t.len() < 3 || t.len() > MAX_FACT_CHARS {
        return false;
    }
    let digits = t.bytes().filter(u8::is_ascii_digit).count();
    let letters = t.bytes().filter(u8::is_ascii_alphabetic).count();
    if digits >= 3 {
        return true;
    }
    if digits > 0 && letters > 0 && t.len() >= 4 {
        return true;
    }
    if let Some(at) = t.find('@')
        && at > 0
        && t[at + 1..].contains('.')
    {
        return true;
    }
    if is_path(t) {
        return true;
    }
    t.len() >= 5
        && letters >= 3
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// `src/lib.rs`, `/tmp/out`, `./run.sh`, `a/b/c`, `setup.py`.
fn is_path(t: &str) -> bool {
    if !t.bytes().any(|b| b.is_ascii_alphabetic()) {
        return false;
    }
    if t.contains("//") && !t.starts_with("//") {
        // A URL: keep it when it has a path part.
        return t.matches('/').count() >= 3;
    }
    let slashes = t.matches('/').count();
    let last = t.rsplit('/').next().unwrap_or(t);
    let has_ext = last.rsplit_once('.').is_some_and(|(stem, ext)| {
        stem.len() >= 2
            && stem.bytes().any(|b| b.is_ascii_alphanumeric())
            && (1..=5).contains(&ext.len())
            && ext.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
            && ext.bytes().all(|b| b.is_ascii_alphanumeric())
    });
    if slashes == 0 {
        return has_ext;
    }
    t.starts_with('/') || t.starts_with("./") || t.starts_with("~/") || slashes >= 2 || has_ext
}

/// Contents of quoted strings on one line, with their byte offsets. An opening quote
/// follows the start of the text, a space or an opening bracket; a closing quote is
/// followed by the end, a space or punctuation (so apostrophes do not pair up).
fn quoted_strings(text: &str) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let q = bytes[i];
        if !matches!(q, b'"' | b'\'' | b'`') {
            i += 1;
            continue;
        }
        let opens = i == 0
            || matches!(
                bytes[i - 1],
                b' ' | b'\t' | b'\n' | b'(' | b'[' | b'{' | b'=' | b':' | b','
            );
        if !opens {
            i += 1;
            continue;
        }
        let rest = &bytes[i + 1..];
        let close = rest
            .iter()
            .position(|&b| b == q || b == b'\n')
            .filter(|&p| rest[p] == q);
        let Some(p) = close else {
            i += 1;
            continue;
        };
        let after = rest.get(p + 1).copied();
        let closes = after.is_none_or(|b| !b.is_ascii_alphanumeric());
        let inner = &text[i + 1..i + 1 + p];
        let trimmed = inner.trim();
        if closes && trimmed.chars().count() >= 3 && trimmed.len() <= MAX_FACT_CHARS {
            out.push((i + 1, trimmed));
            i += p + 2;
        } else {
            i += 1;
        }
    }
    out
}

/// Whether `needle` occurs in `hay` as a whole token: not directly preceded or
/// followed by a letter or digit.
pub(crate) fn contains_token(hay: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    let h = hay.as_bytes();
    let alnum_edge_start = needle.as_bytes()[0].is_ascii_alphanumeric();
    let alnum_edge_end = needle.as_bytes()[needle.len() - 1].is_ascii_alphanumeric();
    memchr::memmem::find_iter(h, needle.as_bytes()).any(|at| {
        let before_ok = !alnum_edge_start || at == 0 || !h[at - 1].is_ascii_alphanumeric();
        let end = at + needle.len();
        let after_ok = !alnum_edge_end || end >= h.len() || !h[end].is_ascii_alphanumeric();
        before_ok && after_ok
    })
}

/// The text of a message as the recall check searches it: its content, then each tool
/// call's name and arguments.
pub(crate) fn searchable(m: &Message, out: &mut String) {
    out.push_str(&m.text());
    out.push('\n');
    for call in &m.tool_calls {
        out.push_str(&call.name);
        out.push(' ');
        out.push_str(&call.arguments.to_json_string());
        if let Some(v) = call.arguments.as_json() {
            // String values unescaped, so facts with quotes or backslashes match.
            strings_of(v, out);
        }
        out.push('\n');
    }
}

fn strings_of(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => {
            out.push(' ');
            out.push_str(s);
        }
        Value::Array(items) => items.iter().for_each(|i| strings_of(i, out)),
        Value::Object(map) => map.values().for_each(|i| strings_of(i, out)),
        _ => {}
    }
}

/// The facts `turn` needed: its identifiers ([`turn_identifiers`]) that occur in
/// `earlier` (the text of the user and tool messages before it) and not in `known` (the
/// system prompt and the goal, which every prompt carries).
///
/// ```
/// use keel_compaction::replay::needed_facts;
/// use keel_compaction::message::{Message, ToolCall};
///
/// let turn = Message::assistant("").with_tool_calls(vec![ToolCall::new(
///     "c1",
///     "get_reservation_details",
///     serde_json::json!({"reservation_id": "OI5L9G", "user_id": "sofia_kim_7287"}),
/// )]);
/// let earlier = "{\"reservations\": [\"OI5L9G\", \"AQLBTL\"]}";
/// let known = "Help sofia_kim_7287 with her booking.";
/// assert_eq!(needed_facts(&turn, earlier, known), ["OI5L9G"]);
/// ```
pub fn needed_facts(turn: &Message, earlier: &str, known: &str) -> Vec<String> {
    turn_identifiers(turn)
        .into_iter()
        .filter(|f| contains_token(earlier, f) && !contains_token(known, f))
        .collect()
}

/// Whether `m` is a user or tool message (what the agent was told).
pub(crate) fn is_told(m: &Message) -> bool {
    matches!(m.role, Role::User | Role::Tool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_kinds() {
        let t = "edit 1474:1474 in /repo/src/fields.py, user mia_li_3668 and code E0425; v2 ok, e.g. fine";
        assert_eq!(
            identifiers(t),
            ["1474", "/repo/src/fields.py", "mia_li_3668", "E0425"]
        );
        assert_eq!(
            identifiers("it's the user's 'gold card' now"),
            ["gold card"]
        );
        assert_eq!(identifiers("AQLBTL and ERR"), ["AQLBTL"]);
        assert_eq!(
            identifiers("see https://x.io and https://x.io/a/b"),
            ["https://x.io/a/b"]
        );
        assert!(identifiers("and/or the obj").is_empty());
    }

    #[test]
    fn whole_tokens_only() {
        assert!(contains_token("price 523 USD", "523"));
        assert!(!contains_token("price 15234 USD", "523"));
        assert!(contains_token("\"HAT136\"", "HAT136"));
        assert!(!contains_token("HAT1367", "HAT136"));
        assert!(contains_token("path=/a/b.py:3", "/a/b.py"));
    }
}
