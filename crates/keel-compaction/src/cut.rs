//! Where the raw buffer may be cut without separating a tool call from its results.

use std::collections::HashSet;

use keel_message::{Message, Role};

/// True if cutting `messages` before index `cut` keeps every tool call on the same side
/// as all of its results (invariant 3).
///
/// ```
/// use keel_compaction::cut::is_safe_cut;
/// use keel_compaction::message::{Message, ToolCall};
///
/// let history = vec![
///     Message::user("go"),
///     Message::assistant("").with_tool_calls(vec![ToolCall::new("c1", "ls", serde_json::json!({}))]),
///     Message::tool("c1", "a.txt"),
///     Message::assistant("done"),
/// ];
/// assert!(is_safe_cut(&history, 1));
/// assert!(!is_safe_cut(&history, 2)); // would separate c1 from its result
/// assert!(is_safe_cut(&history, 3));
/// ```
pub fn is_safe_cut(messages: &[Message], cut: usize) -> bool {
    if cut == 0 || cut >= messages.len() {
        return true;
    }
    let (before, after) = messages.split_at(cut);
    let calls_before: HashSet<&str> = before
        .iter()
        .flat_map(|m| m.tool_calls.iter().map(|c| c.id.as_str()))
        .collect();
    let calls_after: HashSet<&str> = after
        .iter()
        .flat_map(|m| m.tool_calls.iter().map(|c| c.id.as_str()))
        .collect();
    fn result_id(m: &Message) -> Option<&str> {
        (m.role == Role::Tool)
            .then_some(m.tool_call_id.as_deref())
            .flatten()
    }
    before
        .iter()
        .filter_map(result_id)
        .all(|id| !calls_after.contains(id))
        && after
            .iter()
            .filter_map(result_id)
            .all(|id| !calls_before.contains(id))
}

/// The latest safe cut at or before `target` that leaves at least one message before
/// it, or `None`. Linear in the number of messages.
pub fn safe_cut_at_or_before(messages: &[Message], target: usize) -> Option<usize> {
    let unsafe_at = unsafe_cuts(messages);
    (1..=target.min(messages.len()))
        .rev()
        .find(|&c| c == messages.len() || !unsafe_at[c])
}

/// `unsafe_at[c]` is true when cutting before `c` would split a tool call from one of
/// its results: each call id spans from its first to its last appearance (as a call or
/// as a result), and no cut may fall inside a span.
fn unsafe_cuts(messages: &[Message]) -> Vec<bool> {
    let mut spans: std::collections::HashMap<&str, (usize, usize)> = Default::default();
    for (i, m) in messages.iter().enumerate() {
        let ids = m.tool_calls.iter().map(|c| c.id.as_str()).chain(
            (m.role == Role::Tool)
                .then_some(m.tool_call_id.as_deref())
                .flatten(),
        );
        for id in ids {
            let span = spans.entry(id).or_insert((i, i));
            span.0 = span.0.min(i);
            span.1 = span.1.max(i);
        }
    }
    // Difference array over cut positions lo+1 ..= hi.
    let mut delta = vec![0i64; messages.len() + 2];
    for (lo, hi) in spans.into_values() {
        if hi > lo {
            delta[lo + 1] += 1;
            delta[hi + 1] -= 1;
        }
    }
    let mut open = 0;
    delta
        .iter()
        .take(messages.len() + 1)
        .map(|d| {
            open += d;
            open > 0
        })
        .collect()
}
