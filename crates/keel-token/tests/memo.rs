#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! MemoCounter: same counts as its inner counter, recounts what changed, bounded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel_message::{ContentPart, Message, ToolCall};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

/// Counts chars and how many times it was asked to count a message.
#[derive(Default)]
struct Spy {
    messages: AtomicUsize,
}

impl TokenCounter for Spy {
    fn count_text(&self, text: &str) -> usize {
        text.chars().count()
    }
    fn count_message(&self, m: &Message) -> usize {
        self.messages.fetch_add(1, Ordering::Relaxed);
        3 + self.count_text(m.role.as_str()) + self.count_text(&m.text())
    }
}

fn conversation(n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| match i % 3 {
            0 => Message::user(format!("question {i}")).with_id(format!("m{i}")),
            1 => Message::assistant("")
                .with_id(format!("m{i}"))
                .with_tool_calls(vec![ToolCall::new(
                    format!("c{i}"),
                    "grep",
                    json!({"q": i}),
                )]),
            _ => {
                Message::tool(format!("c{}", i - 1), format!("result {i}")).with_id(format!("m{i}"))
            }
        })
        .collect()
}

#[test]
fn same_counts_as_the_inner_counter() {
    let inner = TiktokenCounter::o200k_base().unwrap();
    let memo = MemoCounter::new(inner.clone());
    let history = conversation(30);
    assert_eq!(
        memo.count_messages(&history),
        inner.count_messages(&history)
    );
    // Second time all hits, same number.
    assert_eq!(
        memo.count_messages(&history),
        inner.count_messages(&history)
    );
    assert_eq!(memo.stats().misses, 30);
    assert_eq!(memo.stats().hits, 30);
    assert_eq!(memo.count_text("Hello, world!"), 4);
    assert_eq!(memo.framing(), inner.framing());
}

#[test]
fn appending_counts_only_the_new_message() {
    let memo = MemoCounter::new(Spy::default());
    let mut history = conversation(100);
    memo.count_messages(&history);
    assert_eq!(memo.inner().messages.load(Ordering::Relaxed), 100);
    history.push(Message::user("one more").with_id("m100"));
    memo.count_messages(&history);
    assert_eq!(memo.inner().messages.load(Ordering::Relaxed), 101);
}

#[test]
fn changed_content_with_the_same_id_is_recounted() {
    let memo = MemoCounter::new(Spy::default());
    let a = Message::user("short").with_id("m1");
    let b = Message::user("a much longer text").with_id("m1");
    assert_eq!(memo.count_message(&a), 3 + 4 + 5);
    assert_eq!(memo.count_message(&b), 3 + 4 + 18);
    assert_eq!(memo.count_message(&a), 3 + 4 + 5);
    assert_eq!(memo.inner().messages.load(Ordering::Relaxed), 2);

    // Every field that counting reads is part of the key.
    let base = Message::assistant("x")
        .with_id("m2")
        .with_tool_calls(vec![ToolCall::new("c", "f", json!({"a": 1}))]);
    let variants = [
        base.clone(),
        base.clone().with_name("bob"),
        base.clone()
            .with_tool_calls(vec![ToolCall::new("c", "f", json!({"a": 2}))]),
        base.clone()
            .with_tool_calls(vec![ToolCall::new("c", "g", json!({"a": 1}))]),
        base.clone()
            .with_tool_calls(vec![ToolCall::from_raw_arguments("c", "f", "{\"a\": 1}")]),
        base.clone()
            .with_tool_calls(vec![ToolCall::from_raw_arguments("c", "f", "{a: 1}")]),
        Message::user("x").with_id("m2"),
        Message::assistant(vec![ContentPart::text("x")]).with_id("m2"),
        Message::assistant("x").with_id("m3"),
        Message::assistant("x"),
    ];
    let memo = MemoCounter::new(Spy::default());
    for v in &variants {
        memo.count_message(v);
    }
    assert_eq!(memo.stats().misses as usize, variants.len());
    assert_eq!(memo.stats().entries, variants.len());
}

#[test]
fn messages_without_ids_are_keyed_by_content() {
    let memo = MemoCounter::new(Spy::default());
    memo.count_message(&Message::user("same"));
    memo.count_message(&Message::user("same"));
    memo.count_message(&Message::user("other"));
    assert_eq!(memo.stats().misses, 2);
    assert_eq!(memo.stats().hits, 1);
}

#[test]
fn memory_is_bounded_by_capacity() {
    let memo = MemoCounter::with_capacity(Spy::default(), 100);
    assert_eq!(memo.capacity(), 100);
    for i in 0..10_000 {
        memo.count_message(&Message::user(format!("message {i}")));
        assert!(memo.stats().entries <= 101, "{}", memo.stats().entries);
    }
    // Recently used entries survive a sweep; counts stay right either way.
    let recent = Message::user("message 9999");
    let misses = memo.stats().misses;
    assert_eq!(memo.count_message(&recent), 3 + 4 + 12);
    assert_eq!(memo.stats().misses, misses);
    memo.clear();
    assert_eq!(memo.stats().entries, 0);
    assert_eq!(memo.count_message(&recent), 3 + 4 + 12);
}

#[test]
fn shared_across_threads() {
    let memo = Arc::new(MemoCounter::new(TiktokenCounter::o200k_base().unwrap()));
    let history = Arc::new(conversation(300));
    let want = TiktokenCounter::o200k_base()
        .unwrap()
        .count_messages(&history);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (memo, history) = (Arc::clone(&memo), Arc::clone(&history));
            std::thread::spawn(move || memo.count_messages(&history))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), want);
    }
    assert_eq!(memo.stats().entries, 300);
}

#[test]
fn recounts_after_edits_in_place_match_the_inner_counter() {
    let inner = TiktokenCounter::o200k_base().unwrap();
    let memo = MemoCounter::new(inner.clone());
    let mut history = conversation(200);
    let check = |h: &[Message]| assert_eq!(memo.count_messages(h), inner.count_messages(h));
    check(&history);
    check(&history);
    // Same id, new content, in the middle of an otherwise identical list.
    history[100] =
        Message::user("a different question entirely, much longer than before").with_id("m100");
    check(&history);
    // A tool call's arguments change.
    history[4] = Message::assistant("")
        .with_id("m4")
        .with_tool_calls(vec![ToolCall::new("c4", "grep", json!({"q": "changed"}))]);
    check(&history);
    // Compaction drops a prefix, then a summary is put in front.
    history.drain(..50);
    check(&history);
    history.insert(
        0,
        Message::system("summary of the first fifty").with_id("s0"),
    );
    check(&history);
    // A message inserted in the middle, one removed, and the list counted twice.
    history.insert(70, Message::user("interjection").with_id("x"));
    history.remove(10);
    check(&history);
    check(&history);
    check(&[]);
    check(&history[..3]);
}
