use std::borrow::Cow;
use std::collections::{BTreeSet, VecDeque};
use std::fmt::Write as _;

use keel_message::{Content, Message, Role, answered_tool_calls};
use serde_json::json;

use super::{
    Failure, PolicyEnv, PolicyOutcome, Stored, StoredWhat, cap_chars, nth_place, record,
    set_record, thousands,
};
use crate::error::OffloadError;
use crate::key::{StorePath, safe_component};
use crate::tools::{GREP, LS, READ_FILE};

const RECORD: &str = "evicted";

/// Evicts large tool results: each tool result over a token threshold is written to
/// `large_tool_results/<tool_call_id>` and replaced in context by a stub.
///
/// The size is counted with the environment's [`TokenCounter`](keel_token::TokenCounter)
/// (the result's text alone, without chat framing). The stub gives the path, the size
/// in tokens, lines and bytes, the first and last lines (5 + 5 by default, numbered as
/// [`read_file`](crate::RetrievalTools) numbers them, each cut to 1,000 characters) and
/// how to read more. Results of exempt tools (the retrieval tools `ls`, `read_file` and
/// `grep` by default: evicting what the agent just read back would loop) and results
/// already evicted are left alone; so are results with non-text parts (images) and
/// results without a `tool_call_id`. Multi-part text results are stored joined (which
/// copies them; plain-text results are not copied).
///
/// The text is written straight from the message and the stub is built in one pass
/// over its lines, borrowing them; the policy takes the messages by value, so the
/// original text is freed as soon as its stub replaces it. A 200 MB result costs one
/// copy of itself, never two (see the `large_result` test).
///
/// A result whose stub would not be smaller (a threshold of a few hundred tokens, a
/// result of few long lines) stays in context as it is: evicting it would cost tokens.
///
/// If the store fails (disk full, permission denied), the result stays in context as
/// it was and the error is in [`PolicyOutcome::failures`].
///
/// ```
/// use keel_offload::message::Message;
/// use keel_offload::{EvictLargeResults, Key, MemoryStore, OffloadStore, PolicyEnv, ThreadId};
/// use keel_offload::token::ApproxCounter;
///
/// let store = MemoryStore::new();
/// let thread = ThreadId::new("t1")?;
/// let counter = ApproxCounter::new(); // 4 characters per token
/// let env = PolicyEnv::new(&store, &thread, &counter);
///
/// let log: String = (1..=1000).map(|i| format!("line {i}: ok\n")).collect();
/// let messages = vec![Message::tool("call_1", log.clone()), Message::tool("call_2", "small")];
///
/// let policy = EvictLargeResults::new().with_threshold(1_000);
/// let out = policy.apply(messages, &env);
/// assert!(out.is_complete());
/// assert_eq!(out.stored.len(), 1);
///
/// let stub = out.messages[0].text();
/// assert!(stub.contains("large_tool_results/call_1"));
/// assert!(stub.contains("     1\tline 1: ok"));
/// assert!(stub.contains("  1000\tline 1000: ok"));
/// assert_eq!(out.messages[1].text(), "small");
/// assert_eq!(store.get(&Key::new("t1", "large_tool_results/call_1")?)?, log);
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EvictLargeResults {
    /// Results of more tokens than this are evicted (default 20,000).
    pub threshold_tokens: usize,
    /// Lines shown from the start (default 5).
    pub head_lines: usize,
    /// Lines shown from the end (default 5).
    pub tail_lines: usize,
    /// Each shown line is cut to this many characters (default 1,000).
    pub max_line_chars: usize,
    /// Tools whose results are never evicted (default: `ls`, `read_file`, `grep`).
    pub exempt_tools: BTreeSet<String>,
    /// The directory results go to (default `large_tool_results`).
    pub dir: StorePath,
    /// Characters the preview's lines may take together, shared among them, each
    /// still at most `max_line_chars` (default: no limit beyond that).
    pub preview_chars: usize,
    /// The `limit` the stub suggests for reading on with `read_file` (default 100
    /// lines). On a small window 100 lines may not fit: [`EvictLargeResults::for_budget`]
    /// sizes it.
    pub read_lines: usize,
}

impl Default for EvictLargeResults {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictLargeResults {
    /// The default threshold: 20,000 tokens.
    pub const DEFAULT_THRESHOLD: usize = 20_000;

    /// The defaults listed on each field.
    pub fn new() -> Self {
        EvictLargeResults {
            threshold_tokens: Self::DEFAULT_THRESHOLD,
            head_lines: 5,
            tail_lines: 5,
            max_line_chars: 1_000,
            exempt_tools: [LS, READ_FILE, GREP]
                .into_iter()
                .map(str::to_owned)
                .collect(),
            dir: StorePath::known("large_tool_results"),
            preview_chars: usize::MAX,
            read_lines: 100,
        }
    }

    /// The defaults sized for a prompt budget of `budget_tokens` (a model's window less
    /// its reply): results over a quarter of it, at most 20,000 tokens, are evicted,
    /// and a stub costs about half the threshold at most. The preview's lines share
    /// the characters that leaves (about three a token, after some 150 tokens of
    /// header, numbers and notes), where 5 and 5 lines of up to 1,000 characters each
    /// could cost more than a small window's whole threshold; below a threshold of
    /// 1,000 tokens it shows 3 and 3 lines. The stub suggests reading on a line per 80
    /// tokens of budget at a time (5 to 100), so the read fits. keel-compaction's
    /// `Compactor` and keel-agent use it by default; start from it to change one thing
    /// without losing the rest.
    ///
    /// ```
    /// use keel_offload::EvictLargeResults;
    ///
    /// let large = EvictLargeResults::for_budget(200_000);
    /// assert_eq!(large.threshold_tokens, 20_000);
    /// assert_eq!((large.head_lines, large.read_lines, large.preview_chars), (5, 100, 29_550));
    ///
    /// // A 2,048-token window keeping 512 for the reply.
    /// let small = EvictLargeResults::for_budget(1_536).exempt("read_source");
    /// assert_eq!(small.threshold_tokens, 384);
    /// assert_eq!((small.head_lines, small.tail_lines, small.read_lines), (3, 3, 19));
    /// assert_eq!(small.preview_chars, 240);
    /// assert!(small.exempt_tools.contains("read_source"));
    /// ```
    pub fn for_budget(budget_tokens: usize) -> Self {
        let threshold = (budget_tokens / 4).clamp(1, Self::DEFAULT_THRESHOLD);
        let mut policy = Self::new().with_threshold(threshold);
        if threshold < 1_000 {
            policy = policy.with_preview(3, 3);
        }
        // The header, the how-to-read line, the line numbers and the notes of cut
        // lines take about 150 tokens; the preview about three characters a token.
        policy.preview_chars = ((threshold / 2).saturating_sub(150) * 3).max(240);
        policy.read_lines = (budget_tokens / 80).clamp(5, 100);
        policy
    }

    /// Sets the token threshold.
    #[must_use]
    pub fn with_threshold(mut self, tokens: usize) -> Self {
        self.threshold_tokens = tokens;
        self
    }

    /// Sets how many lines the stub shows from the start and from the end.
    #[must_use]
    pub fn with_preview(mut self, head_lines: usize, tail_lines: usize) -> Self {
        self.head_lines = head_lines;
        self.tail_lines = tail_lines;
        self
    }

    /// Adds a tool whose results are never evicted.
    #[must_use]
    pub fn exempt(mut self, tool: impl Into<String>) -> Self {
        self.exempt_tools.insert(tool.into());
        self
    }

    /// Where the result of `tool_call_id` is stored:
    /// `large_tool_results/<tool_call_id>`, the id made safe by [`safe_component`].
    /// If that path already holds another value (the id was used before in the thread),
    /// the result goes to `<path>~2`, `<path>~3`, … instead: nothing stored is overwritten,
    /// and the stub names the path used.
    pub fn path_for(&self, tool_call_id: &str) -> Result<StorePath, OffloadError> {
        self.dir.join(&safe_component(tool_call_id))
    }

    /// Evicts every tool result over the threshold (see the type's docs).
    ///
    /// Tool names come from each result's `name`, or else from the assistant tool call
    /// it answers among `messages` (the latest earlier one with its `tool_call_id`).
    pub fn apply(&self, messages: Vec<Message>, env: &PolicyEnv<'_>) -> PolicyOutcome {
        // Each result's tool, from the call it answers (the latest earlier one with
        // its id).
        let tool_names: Vec<Option<String>> = answered_tool_calls(&messages)
            .into_iter()
            .map(|call| call.map(|c| c.name.clone()))
            .collect();
        let mut out = PolicyOutcome {
            messages: Vec::with_capacity(messages.len()),
            ..PolicyOutcome::default()
        };
        for (index, mut message) in messages.into_iter().enumerate() {
            match self.evict_one(&mut message, env, tool_names[index].as_deref()) {
                Ok(None) => {}
                Ok(Some((path, bytes, what))) => out.stored.push(Stored {
                    index,
                    message_id: message.id.clone(),
                    path,
                    bytes,
                    what,
                }),
                Err(error) => out.failures.push(Failure {
                    index,
                    message_id: message.id.clone(),
                    error,
                }),
            }
            out.messages.push(message);
        }
        out
    }

    /// Evicts one message in place. `Ok(None)`: nothing to do. On error the message is
    /// untouched.
    fn evict_one(
        &self,
        message: &mut Message,
        env: &PolicyEnv<'_>,
        tool_name: Option<&str>,
    ) -> Result<Option<(StorePath, u64, StoredWhat)>, OffloadError> {
        if message.role != Role::Tool || record(message, RECORD).is_some() {
            return Ok(None);
        }
        let Some(call_id) = message.tool_call_id.clone() else {
            return Ok(None);
        };
        let tool = message.name.as_deref().or(tool_name);
        if tool.is_some_and(|t| self.exempt_tools.contains(t)) {
            return Ok(None);
        }
        let text: Cow<'_, str> = match &message.content {
            Content::Text(t) => Cow::Borrowed(t),
            Content::Parts(parts) if parts.iter().all(|p| p.as_text().is_some()) => {
                message.content.text()
            }
            Content::Parts(_) => return Ok(None),
        };
        // Most results are far under the threshold: skip counting those that cannot
        // be over it (the compactor counts every message once anyway).
        if env
            .counter
            .max_tokens(&text)
            .is_some_and(|bound| bound <= self.threshold_tokens)
        {
            return Ok(None);
        }
        let tokens = env.counter.count_text(&text);
        if tokens <= self.threshold_tokens {
            return Ok(None);
        }
        let name = safe_component(&call_id);
        // On a threshold near the stub's own size, the stub of a result just over it
        // can be the larger: the result then stays as it is.
        let (draft, _) = self.stub(&text, tokens, &nth_place(&self.dir, &name, 1)?);
        if env.counter.count_text(&draft) >= tokens {
            return Ok(None);
        }
        drop(draft);
        let (path, bytes) = env.put_new(&text, |n| nth_place(&self.dir, &name, n))?;
        let (stub, lines) = self.stub(&text, tokens, &path);
        drop(text);
        message.content = Content::Text(stub);
        set_record(
            &mut message.metadata,
            RECORD,
            json!({"path": path.as_str(), "tokens": tokens, "lines": lines, "bytes": bytes}),
        );
        Ok(Some((
            path,
            bytes,
            StoredWhat::ToolResult {
                tool_call_id: call_id,
                tokens,
                lines,
            },
        )))
    }

    /// The stub for `text`, and its number of lines. One pass over the lines, keeping
    /// only borrowed slices of the first and last ones.
    fn stub(&self, text: &str, tokens: usize, path: &StorePath) -> (String, usize) {
        let mut head: Vec<&str> = Vec::with_capacity(self.head_lines);
        let mut tail: VecDeque<(usize, &str)> = VecDeque::with_capacity(self.tail_lines);
        let mut total = 0;
        for line in text.lines() {
            total += 1;
            if head.len() < self.head_lines {
                head.push(line);
            } else if self.tail_lines > 0 {
                if tail.len() == self.tail_lines {
                    tail.pop_front();
                }
                tail.push_back((total, line));
            }
        }
        let omitted = total - head.len() - tail.len();
        let mut s = header(path.as_str(), tokens, total, text.len());
        s.push('\n');
        // Each shown line gets its share of the preview's characters.
        let shown = (head.len() + tail.len()).max(1);
        let per_line = self.max_line_chars.min(self.preview_chars / shown).max(1);
        let show = |s: &mut String, number: usize, line: &str| {
            let _ = writeln!(s, "{number:>6}\t{}", cap_chars(line, per_line));
        };
        if omitted == 0 {
            if total == 1 {
                let _ = writeln!(s, "Its one line:");
            } else {
                let _ = writeln!(s, "All {} lines:", thousands(total));
            }
        } else if !head.is_empty() {
            let _ = writeln!(s, "First {} lines:", head.len());
        }
        for (i, line) in head.iter().enumerate() {
            show(&mut s, i + 1, line);
        }
        if omitted > 0 {
            let _ = writeln!(s, "… {} lines omitted …", thousands(omitted));
            if !tail.is_empty() {
                let _ = writeln!(s, "Last {} lines:", tail.len());
            }
        }
        for (number, line) in &tail {
            show(&mut s, *number, line);
        }
        s.push_str(&hint(path.as_str(), head.len(), total, self.read_lines));
        (s, total)
    }

    /// The shortest form of an evicted result's stub: its first line (path and size)
    /// and how to read it, without the preview lines. For a runtime that must make
    /// an evicted result smaller still (a window too small for the preview). `None`
    /// for a message this policy did not evict.
    ///
    /// ```
    /// use keel_offload::message::Message;
    /// use keel_offload::{EvictLargeResults, MemoryStore, PolicyEnv, ThreadId};
    /// use keel_offload::token::ApproxCounter;
    ///
    /// let (store, counter) = (MemoryStore::new(), ApproxCounter::new());
    /// let thread = ThreadId::new("t1")?;
    /// let env = PolicyEnv::new(&store, &thread, &counter);
    /// let log: String = (1..=1000).map(|i| format!("line {i}: ok\n")).collect();
    /// let policy = EvictLargeResults::new().with_threshold(100);
    /// let out = policy.apply(vec![Message::tool("call_1", log)], &env);
    ///
    /// let brief = policy.brief(&out.messages[0]).unwrap();
    /// assert!(brief.starts_with("[Tool result too large for the context; stored in full at large_tool_results/call_1"));
    /// assert!(brief.contains("offset=0"));
    /// assert!(brief.len() < out.messages[0].text().len());
    /// assert_eq!(policy.brief(&Message::tool("call_2", "small")), None);
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn brief(&self, message: &Message) -> Option<String> {
        let r = record(message, RECORD)?;
        let path = r.get("path")?.as_str()?;
        let number = |k: &str| {
            r.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or_default()
        };
        let mut s = header(path, number("tokens"), number("lines"), number("bytes"));
        s.push('\n');
        s.push_str(&hint(path, 0, number("lines"), self.read_lines));
        Some(s)
    }
}

/// A stub's first line: where the result is stored and how large it is.
fn header(path: &str, tokens: usize, lines: usize, bytes: usize) -> String {
    format!(
        "[Tool result too large for the context; stored in full at {path}: {} tokens, {} lines, {} bytes.]",
        thousands(tokens),
        thousands(lines),
        thousands(bytes),
    )
}

/// A stub's last line: how to read on from line `offset` of `lines`, `limit` lines at
/// a time, or search.
fn hint(path: &str, offset: usize, lines: usize, limit: usize) -> String {
    if offset >= lines && lines > 0 {
        // Every line is in the stub already (a result of one long line, say): reading
        // on from `offset` would be past the end.
        return format!(
            "Every line is shown above, long lines cut: call {GREP}(pattern=\"...\", \
             path=\"{path}\") to see the text around a match in them."
        );
    }
    format!(
        "To see more, call {READ_FILE}(path=\"{path}\", offset={offset}, limit={limit}) \
         (offset counts lines from 0), or {GREP}(pattern=\"...\", path=\"{path}\") to search it."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stub_of(text: &str, head: usize, tail: usize) -> (String, usize) {
        let policy = EvictLargeResults::new().with_preview(head, tail);
        let path = policy.path_for("call_1").unwrap();
        policy.stub(text, 42, &path)
    }

    #[test]
    fn a_small_budget_s_stub_is_short_and_asks_for_a_read_that_fits() {
        let text: String = (1..=400)
            .map(|i| format!("{i:>4} {}\n", "request served with status 200; ".repeat(6)))
            .collect();
        let policy = EvictLargeResults::for_budget(1_536);
        let path = policy.path_for("call_1").unwrap();
        let (stub, _) = policy.stub(&text, 9_000, &path);
        assert!(stub.contains("First 3 lines:"), "{stub}");
        assert!(stub.contains("offset=3, limit=19)"), "{stub}");
        // Six lines share 240 characters: 40 each, and the note of what each hides.
        assert!(
            stub.contains("     1\t   1 request served with status 200; req… ["),
            "{stub}"
        );
        let large = EvictLargeResults::for_budget(200_000);
        let (stub, _) = large.stub(&text, 9_000, &path);
        assert!(stub.contains("offset=5, limit=100)"), "{stub}");
    }

    #[test]
    fn a_stub_that_shows_every_line_points_to_grep_not_past_the_end() {
        // One long line: reading on from line 1 would be past the end.
        let text = "x".repeat(5_000);
        let (stub, lines) = stub_of(&text, 5, 5);
        assert_eq!(lines, 1);
        assert!(stub.contains("Its one line:"), "{stub}");
        assert!(!stub.contains("offset=1"), "{stub}");
        assert!(
            stub.ends_with(
                "Every line is shown above, long lines cut: call grep(pattern=\"...\", \
                 path=\"large_tool_results/call_1\") to see the text around a match in them."
            ),
            "{stub}"
        );
    }

    #[test]
    fn stub_shows_head_tail_and_counts() {
        let text: String = (1..=100).map(|i| format!("row {i}\n")).collect();
        let (stub, lines) = stub_of(&text, 5, 5);
        assert_eq!(lines, 100);
        let expected = "\
[Tool result too large for the context; stored in full at large_tool_results/call_1: 42 tokens, 100 lines, 692 bytes.]
First 5 lines:
     1\trow 1
     2\trow 2
     3\trow 3
     4\trow 4
     5\trow 5
… 90 lines omitted …
Last 5 lines:
    96\trow 96
    97\trow 97
    98\trow 98
    99\trow 99
   100\trow 100
To see more, call read_file(path=\"large_tool_results/call_1\", offset=5, limit=100) (offset counts lines from 0), or grep(pattern=\"...\", path=\"large_tool_results/call_1\") to search it.";
        assert_eq!(stub, expected);
    }

    #[test]
    fn short_results_are_shown_once() {
        let (stub, lines) = stub_of("a\nb\nc", 2, 2);
        assert_eq!(lines, 3);
        assert!(
            stub.contains("All 3 lines:\n     1\ta\n     2\tb\n     3\tc\n"),
            "{stub}"
        );
        assert!(!stub.contains("omitted"));
        let (stub, lines) = stub_of("", 5, 5);
        assert_eq!(lines, 0);
        assert!(stub.contains("All 0 lines:"), "{stub}");
    }

    #[test]
    fn a_result_whose_stub_is_not_smaller_stays() {
        use keel_token::TokenCounter as _;
        let store = crate::MemoryStore::new();
        let thread = crate::ThreadId::new("t").unwrap();
        let counter = keel_token::ApproxCounter::new();
        let env = PolicyEnv::new(&store, &thread, &counter);
        // Ten lines of 100 characters: about 250 tokens, over a threshold of 200, but
        // a stub showing 5 + 5 lines is as large.
        let text: String = (0..10)
            .map(|i| format!("{i}{}\n", "x".repeat(99)))
            .collect();
        let policy = EvictLargeResults::new().with_threshold(200);
        let out = policy.apply(vec![Message::tool("call_1", text.clone())], &env);
        assert!(out.is_complete());
        assert!(out.stored.is_empty(), "{:?}", out.stored);
        assert_eq!(out.messages[0].text(), text);
        // Fifty such lines: the stub is far smaller, so it is evicted.
        let long: String = (0..50)
            .map(|i| format!("{i}{}\n", "x".repeat(99)))
            .collect();
        let out = policy.apply(vec![Message::tool("call_2", long.clone())], &env);
        assert_eq!(out.stored.len(), 1);
        assert!(counter.count_text(&out.messages[0].text()) < counter.count_text(&long));
    }

    #[test]
    fn stub_lines_are_capped() {
        let text = format!("{}\nshort", "x".repeat(5000));
        let (stub, _) = stub_of(&text, 1, 1);
        assert!(stub.contains("… [4,000 more characters]"), "{stub}");
        assert!(stub.len() < 1_500);
    }
}
