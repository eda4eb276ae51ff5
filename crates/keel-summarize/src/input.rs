//! Bounding summarizer input: each message capped, the whole fitted to a token budget by
//! keeping its head and tail.

use std::borrow::Cow;
use std::collections::HashMap;

use keel_message::{Message, Role};
use keel_token::TokenCounter;

use crate::SummarizeError;

/// `text` if it has at most `max` characters; otherwise its first two thirds and last
/// third of `max` characters around a marker saying how many were left out.
pub(crate) fn cap_chars(text: &str, max: usize) -> Cow<'_, str> {
    let total = text.chars().count();
    if total <= max {
        return Cow::Borrowed(text);
    }
    let head = max * 2 / 3;
    let tail = max - head;
    let head_end = text.char_indices().nth(head).map_or(text.len(), |(i, _)| i);
    let tail_start = text
        .char_indices()
        .nth(total - tail)
        .map_or(text.len(), |(i, _)| i);
    Cow::Owned(format!(
        "{} […{} characters omitted…] {}",
        &text[..head_end],
        total - head - tail,
        &text[tail_start..]
    ))
}

/// One line per message (continuation lines indented), tool calls and results named.
pub(crate) fn render(messages: &[Message], max_chars: usize) -> Vec<String> {
    let mut call_names: HashMap<&str, &str> = HashMap::new();
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let text = m.text();
            let text = cap_chars(text.trim(), max_chars);
            let mut out = match m.role {
                Role::Tool => {
                    let id = m.tool_call_id.as_deref().unwrap_or("?");
                    let name = call_names.get(id).copied().or(m.name.as_deref());
                    match name {
                        Some(name) => format!("[{}] tool result ({name}, {id}): ", i + 1),
                        None => format!("[{}] tool result ({id}): ", i + 1),
                    }
                }
                role => format!("[{}] {role}: ", i + 1),
            };
            out.push_str(&text.replace('\n', "\n    "));
            for call in &m.tool_calls {
                call_names.insert(&call.id, &call.name);
                let args = call.arguments.to_json_string();
                out.push_str(&format!(
                    "\n    -> calls {}({}) [id {}]",
                    call.name,
                    cap_chars(&args, max_chars),
                    call.id
                ));
            }
            out
        })
        .collect()
}

/// Joins rendered messages within `available` tokens. When they do not fit, keeps a
/// head (up to a third of the budget) and a tail (the rest), with the middle replaced
/// by a marker. Returns the text and how many messages were left out.
pub(crate) fn fit(
    entries: &[String],
    counter: &dyn TokenCounter,
    available: usize,
) -> Result<(String, usize), SummarizeError> {
    // Each entry costs its text and the line break joining it to the next.
    let newline = counter.count_text("\n").max(1);
    let costs: Vec<usize> = entries
        .iter()
        .map(|e| counter.count_text(e) + newline)
        .collect();
    let total: usize = costs.iter().sum();
    if total <= available {
        return Ok((entries.join("\n"), 0));
    }
    let marker_cost = counter.count_text("[… 0000000 messages omitted …]") + newline;
    let room = available.saturating_sub(marker_cost);
    let mut head = 0;
    let mut used = 0;
    while head < entries.len() && used + costs[head] <= room / 3 {
        used += costs[head];
        head += 1;
    }
    let mut tail = 0;
    while tail < entries.len() - head && used + costs[entries.len() - 1 - tail] <= room {
        used += costs[entries.len() - 1 - tail];
        tail += 1;
    }
    if head + tail == 0 {
        return Err(SummarizeError::BudgetTooSmall {
            budget: available,
            needed: costs.iter().copied().min().unwrap_or(0) + marker_cost,
        });
    }
    let omitted = entries.len() - head - tail;
    let mut parts: Vec<&str> = entries[..head].iter().map(String::as_str).collect();
    let marker = format!("[… {omitted} messages omitted …]");
    parts.push(&marker);
    parts.extend(entries[entries.len() - tail..].iter().map(String::as_str));
    Ok((parts.join("\n"), omitted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_message::ToolCall;
    use keel_token::ApproxCounter;

    #[test]
    fn cap_keeps_head_and_tail() {
        let text = "a".repeat(100) + &"z".repeat(100);
        let capped = cap_chars(&text, 30);
        assert!(capped.starts_with(&"a".repeat(20)));
        assert!(capped.ends_with(&"z".repeat(10)));
        assert!(capped.contains("[…170 characters omitted…]"));
        assert_eq!(cap_chars("short", 30), "short");
        // Multi-byte characters are cut on boundaries.
        assert!(cap_chars(&"é".repeat(50), 9).contains("[…41 characters omitted…]"));
    }

    #[test]
    fn render_names_tool_results() {
        let msgs = [
            Message::assistant("checking").with_tool_calls(vec![ToolCall::new(
                "c1",
                "sh",
                serde_json::json!({"cmd": "ls"}),
            )]),
            Message::tool("c1", "a.txt\nb.txt"),
        ];
        let lines = render(&msgs, 1500);
        assert_eq!(
            lines[0],
            "[1] assistant: checking\n    -> calls sh({\"cmd\":\"ls\"}) [id c1]"
        );
        assert_eq!(lines[1], "[2] tool result (sh, c1): a.txt\n    b.txt");
    }

    #[test]
    fn fit_keeps_head_and_tail_and_marks_the_middle() {
        let entries: Vec<String> = (0..100).map(|i| format!("message number {i:03}")).collect();
        let counter = ApproxCounter::new();
        let Ok((all, 0)) = fit(&entries, &counter, 10_000) else {
            unreachable!("fits")
        };
        assert_eq!(all.lines().count(), 100);
        let Ok((text, omitted)) = fit(&entries, &counter, 200) else {
            unreachable!("fits partly")
        };
        assert!(omitted > 0);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "message number 000");
        assert_eq!(lines.last().copied(), Some("message number 099"));
        assert!(text.contains(&format!("[… {omitted} messages omitted …]")));
        assert!(counter.count_text(&text) <= 200);
        // The tail gets more room than the head.
        let head = lines.iter().take_while(|l| !l.starts_with("[…")).count();
        assert!(lines.len() - 1 - head > head);
        assert!(matches!(
            fit(&entries, &counter, 5),
            Err(SummarizeError::BudgetTooSmall { .. })
        ));
    }
}
