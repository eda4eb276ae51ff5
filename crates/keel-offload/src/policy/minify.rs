//! Compact JSON tool results: the whitespace between JSON tokens carries nothing the
//! model needs, and it is a fifth or more of a typical API result's tokens.

use keel_message::{Content, Message, Role};
use serde_json::json;

use super::{record, set_record};

/// The policy record written on a minified message: `{"minified_json": {"bytes": N}}`,
/// `N` being the result's length before.
const RECORD: &str = "minified_json";

/// Results longer than this are left alone: they are the evict policy's business, and
/// parsing them on the way in would cost more than the prompt saves.
pub const MAX_MINIFY_BYTES: usize = 1024 * 1024;

/// `text` without the whitespace between its JSON tokens, when `text` is one JSON
/// object or array (surrounding whitespace allowed) and no longer than
/// [`MAX_MINIFY_BYTES`]; `None` when it is not JSON, is a bare scalar, is too long, or
/// has no whitespace to drop.
///
/// Only whitespace outside strings goes: strings (escapes included), numbers and the
/// order of keys stay byte for byte, so the result parses to the same value.
///
/// ```
/// use keel_offload::minify_json;
///
/// let result = "{\n  \"reservation_id\": \"OBUT9V\",\n  \"price\": 1.50,\n  \"note\": \"two  spaces\"\n}";
/// assert_eq!(
///     minify_json(result).as_deref(),
///     Some(r#"{"reservation_id":"OBUT9V","price":1.50,"note":"two  spaces"}"#)
/// );
/// assert_eq!(minify_json("Error: not found"), None); // not JSON
/// assert_eq!(minify_json("{\"a\": 1"), None);        // not valid JSON either
/// assert_eq!(minify_json(r#"{"a":1}"#), None);       // nothing to drop
/// ```
pub fn minify_json(text: &str) -> Option<String> {
    if text.len() > MAX_MINIFY_BYTES {
        return None;
    }
    let body = text.trim_matches(is_json_whitespace);
    if !(body.starts_with('{') || body.starts_with('[')) {
        return None;
    }
    if !text.bytes().any(|b| is_json_whitespace(char::from(b))) {
        return None;
    }
    serde_json::from_str::<serde::de::IgnoredAny>(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    let (mut in_string, mut escaped) = (false, false);
    for &b in body.as_bytes() {
        if in_string {
            out.push(b);
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
            out.push(b);
        } else if !is_json_whitespace(char::from(b)) {
            out.push(b);
        }
    }
    // Only ASCII bytes were dropped from valid UTF-8, so this never fails.
    let out = String::from_utf8(out).ok()?;
    (out.len() < text.len()).then_some(out)
}

/// JSON's four whitespace characters (RFC 8259): other Unicode spaces are not.
fn is_json_whitespace(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// Minifies, in place, every tool result in `messages` that [`minify_json`] shortens,
/// recording the length before under [`crate::METADATA_KEY`] (`"minified_json"`).
/// Returns how many changed. A result already minified, or not plain text, is left
/// as it is.
///
/// ```
/// use keel_offload::message::Message;
/// use keel_offload::minify_json_results;
///
/// let mut results = vec![
///     Message::tool("c1", "[ 1, 2, 3 ]"),
///     Message::tool("c2", "no JSON here"),
/// ];
/// assert_eq!(minify_json_results(&mut results), 1);
/// assert_eq!(results[0].text(), "[1,2,3]");
/// assert_eq!(results[0].metadata["keel_offload"]["minified_json"]["bytes"], 11);
/// assert_eq!(results[1].text(), "no JSON here");
/// ```
pub fn minify_json_results(messages: &mut [Message]) -> usize {
    let mut changed = 0;
    for m in messages {
        if m.role != Role::Tool || record(m, RECORD).is_some() {
            continue;
        }
        let Content::Text(text) = &m.content else {
            continue;
        };
        if let Some(short) = minify_json(text) {
            let before = text.len();
            m.content = Content::Text(short);
            set_record(&mut m.metadata, RECORD, json!({ "bytes": before }));
            changed += 1;
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_escapes_and_nesting_survive() {
        let text = "  [ {\"k\" : \"a \\\" b\\\\\" , \"n\" : [ 1 , -2.0e3 , true , null ] } ]\n";
        let short = minify_json(text).unwrap();
        assert_eq!(short, r#"[{"k":"a \" b\\","n":[1,-2.0e3,true,null]}]"#);
        let a: serde_json::Value = serde_json::from_str(text).unwrap();
        let b: serde_json::Value = serde_json::from_str(&short).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn non_json_scalars_and_huge_texts_are_left_alone() {
        assert_eq!(minify_json(""), None);
        assert_eq!(minify_json("   "), None);
        assert_eq!(minify_json("\"a string\""), None);
        assert_eq!(minify_json("42"), None);
        assert_eq!(minify_json("{} trailing"), None);
        assert_eq!(minify_json("{\u{a0}}"), None); // a no-break space is not JSON whitespace
        let huge = format!("[{}1]", "1, ".repeat(MAX_MINIFY_BYTES / 3));
        assert_eq!(minify_json(&huge), None);
    }

    #[test]
    fn only_tool_results_change_and_only_once() {
        let mut messages = vec![
            Message::user("{ \"a\": 1 }"),
            Message::tool("c1", "{ \"a\": 1 }"),
        ];
        assert_eq!(minify_json_results(&mut messages), 1);
        assert_eq!(messages[0].text(), "{ \"a\": 1 }");
        assert_eq!(messages[1].text(), "{\"a\":1}");
        assert_eq!(minify_json_results(&mut messages), 0);
    }
}
