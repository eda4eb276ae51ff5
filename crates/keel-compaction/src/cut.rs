//! Where the raw buffer may be cut without separating a tool call from its results.

use keel_message::{Message, answered_calls};

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
///
/// // An id a server uses again in a later turn pairs with that turn's call.
/// let mut again = history.clone();
/// again.extend_from_slice(&history[1..3]);
/// assert!(is_safe_cut(&again, 4));
/// assert!(!is_safe_cut(&again, 5));
/// ```
pub fn is_safe_cut(messages: &[Message], cut: usize) -> bool {
    cut == 0 || cut >= messages.len() || !unsafe_cuts(messages)[cut]
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
/// its results: each result spans from the message of the call it answers (the latest
/// earlier call with its id, see [`answered_calls`]) to itself, and no cut may fall
/// inside a span.
fn unsafe_cuts(messages: &[Message]) -> Vec<bool> {
    // Difference array over cut positions call+1 ..= result.
    let mut delta = vec![0i64; messages.len() + 2];
    for (result, call) in answered_calls(messages).into_iter().enumerate() {
        if let Some(call) = call {
            delta[call + 1] += 1;
            delta[result + 1] -= 1;
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
