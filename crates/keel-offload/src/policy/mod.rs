//! The policies: pure steps from a list of messages to an edited list plus a record
//! of what was stored.

mod evict;
mod minify;
mod truncate;

pub use evict::EvictLargeResults;
pub use minify::{MAX_MINIFY_BYTES, minify_json, minify_json_results};
pub use truncate::TruncateArguments;

use std::io::Read as _;

use keel_message::{Message, Metadata};
use keel_token::TokenCounter;
use serde_json::Value;

use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::OffloadStore;

/// The metadata key under which policies record their edits on a message.
///
/// [`EvictLargeResults`] writes `{"evicted": {...}}` on the stub, [`TruncateArguments`]
/// `{"truncated_arguments": [...]}` on the assistant message; a message carrying the
/// record is not processed again by the same policy.
pub const METADATA_KEY: &str = "keel_offload";

/// What a policy works with: the store, the thread whose namespace it writes to, and
/// the token counter that prices text.
///
/// ```
/// use keel_offload::{MemoryStore, PolicyEnv, ThreadId};
/// use keel_offload::token::ApproxCounter;
///
/// let store = MemoryStore::new();
/// let thread = ThreadId::new("t1")?;
/// let counter = ApproxCounter::new();
/// let env = PolicyEnv::new(&store, &thread, &counter);
/// assert_eq!(env.thread.as_str(), "t1");
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Clone, Copy)]
pub struct PolicyEnv<'a> {
    /// Where offloaded text goes.
    pub store: &'a dyn OffloadStore,
    /// The thread whose namespace receives it.
    pub thread: &'a ThreadId,
    /// Prices text in tokens.
    pub counter: &'a dyn TokenCounter,
}

impl<'a> PolicyEnv<'a> {
    /// Bundles the three.
    pub fn new(
        store: &'a dyn OffloadStore,
        thread: &'a ThreadId,
        counter: &'a dyn TokenCounter,
    ) -> Self {
        PolicyEnv {
            store,
            thread,
            counter,
        }
    }
}

impl std::fmt::Debug for PolicyEnv<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEnv")
            .field("thread", &self.thread)
            .finish_non_exhaustive()
    }
}

/// How many places [`PolicyEnv::put_new`] tries before it gives up.
const MAX_PLACES: u32 = 1_000;

impl PolicyEnv<'_> {
    /// Stores `text` at the first of `place(1)`, `place(2)`, … that holds nothing yet or
    /// holds `text` already, and returns that path and the bytes stored. A policy names
    /// its paths after tool-call ids, and a model (or a server that numbers calls per
    /// reply) may use one id twice in a thread: the second value then goes beside the
    /// first instead of over it, so an offload never destroys one stored before.
    pub(crate) fn put_new(
        &self,
        text: &str,
        place: impl Fn(u32) -> Result<StorePath, OffloadError>,
    ) -> Result<(StorePath, u64), OffloadError> {
        for n in 1..=MAX_PLACES {
            let path = place(n)?;
            let key = Key::from_parts(self.thread.clone(), path.clone());
            match self.store.size(&key)? {
                None => {
                    let bytes = self.store.put(&key, text)?;
                    return Ok((path, bytes));
                }
                Some(len) if len == text.len() as u64 && self.holds(&key, text)? => {
                    // The same result stored again (a step run twice after a crash).
                    return Ok((path, len));
                }
                Some(_) => {}
            }
        }
        Err(OffloadError::Occupied {
            key: Key::from_parts(self.thread.clone(), place(1)?).to_string(),
            tried: MAX_PLACES,
        })
    }

    /// True if `key` holds exactly `text`, read in bounded chunks.
    fn holds(&self, key: &Key, text: &str) -> Result<bool, OffloadError> {
        let mut reader = self.store.open(key)?;
        let mut want = text.as_bytes();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = reader.read(&mut buf).map_err(|source| OffloadError::Io {
                op: "read",
                key: key.to_string(),
                source,
            })?;
            if n == 0 {
                return Ok(want.is_empty());
            }
            let Some(head) = want.get(..n) else {
                return Ok(false);
            };
            if head != &buf[..n] {
                return Ok(false);
            }
            want = &want[n..];
        }
    }
}

/// The `n`th place for a value named `component` under `dir`: `dir/component`, then
/// `dir/component~2`, `dir/component~3`, ….
pub(crate) fn nth_place(
    dir: &StorePath,
    component: &str,
    n: u32,
) -> Result<StorePath, OffloadError> {
    if n <= 1 {
        dir.join(component)
    } else {
        dir.join(&format!("{component}~{n}"))
    }
}

/// The result of applying a policy: the messages to keep in context, what was stored,
/// and what could not be.
///
/// A message whose offload failed is in `messages` exactly as it came in, and its
/// error is in `failures`: nothing is lost, the context is only less compact.
#[derive(Debug, Default)]
pub struct PolicyOutcome {
    /// The messages after the policy, in order.
    pub messages: Vec<Message>,
    /// One record per stored piece, in message order.
    pub stored: Vec<Stored>,
    /// Messages left unchanged because storing failed.
    pub failures: Vec<Failure>,
}

impl PolicyOutcome {
    /// Nothing changed (and nothing failed).
    pub fn unchanged(messages: Vec<Message>) -> Self {
        PolicyOutcome {
            messages,
            stored: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// True when nothing failed.
    pub fn is_complete(&self) -> bool {
        self.failures.is_empty()
    }
}

/// One piece of text a policy stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Index of the message in the policy's input.
    pub index: usize,
    /// Its id, if it had one.
    pub message_id: Option<String>,
    /// Where the text went (inside the thread's namespace).
    pub path: StorePath,
    /// Bytes written.
    pub bytes: u64,
    /// What it was.
    pub what: StoredWhat,
}

/// What kind of text was stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoredWhat {
    /// A large tool result, replaced by a stub.
    ToolResult {
        /// The call it answered.
        tool_call_id: String,
        /// Its size in tokens.
        tokens: usize,
        /// Its number of lines.
        lines: usize,
    },
    /// A long tool-call argument, replaced by a pointer.
    Argument {
        /// The call it belonged to.
        tool_call_id: String,
        /// The argument's name; `None` for arguments that were not valid JSON, stored
        /// whole.
        argument: Option<String>,
        /// Its length in characters.
        chars: usize,
    },
    /// A message appended to the thread's archive.
    Archived {
        /// Its position in the archive.
        seq: u64,
    },
}

/// A message a policy could not offload; it stays in context unchanged.
///
/// It displays as one line naming the message and why, to log as it is:
///
/// ```
/// use keel_offload::message::Message;
/// use keel_offload::token::ApproxCounter;
/// use keel_offload::{EvictLargeResults, MemoryStore, PolicyEnv, ThreadId};
///
/// let store = MemoryStore::with_limit(100); // too small for the result
/// let thread = ThreadId::new("t1")?;
/// let counter = ApproxCounter::new();
/// let env = PolicyEnv::new(&store, &thread, &counter);
/// let log: String = (1..=1000).map(|i| format!("line {i}: ok\n")).collect();
/// let out = EvictLargeResults::new()
///     .with_threshold(1_000)
///     .apply(vec![Message::tool("call_1", log).with_id("m3")], &env);
/// assert!(!out.is_complete());
/// assert_eq!(
///     out.failures[0].to_string(),
///     "message 0 (id m3) not offloaded: t1/large_tool_results/call_1: could not write: \
///      the memory store's limit of 100 bytes is reached",
/// );
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug)]
pub struct Failure {
    /// Index of the message in the policy's input.
    pub index: usize,
    /// Its id, if it had one.
    pub message_id: Option<String>,
    /// Why.
    pub error: OffloadError,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "message {}", self.index)?;
        if let Some(id) = &self.message_id {
            write!(f, " (id {id})")?;
        }
        write!(f, " not offloaded: {}", self.error)
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The policy record `key` on a message, if any.
pub(crate) fn record<'m>(m: &'m Message, key: &str) -> Option<&'m Value> {
    m.metadata.get(METADATA_KEY)?.get(key)
}

/// Sets the policy record `key` on a message's metadata.
pub(crate) fn set_record(metadata: &mut Metadata, key: &str, value: Value) {
    let slot = metadata
        .entry(METADATA_KEY)
        .or_insert_with(|| Value::Object(Default::default()));
    if !slot.is_object() {
        *slot = Value::Object(Default::default());
    }
    if let Value::Object(map) = slot {
        map.insert(key.to_owned(), value);
    }
}

/// `1234567` as `1,234,567`.
pub(crate) fn thousands(n: usize) -> String {
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

/// `line` cut to `max` characters, with a note of how much was cut.
pub(crate) fn cap_chars(line: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if line.len() <= max {
        return line.into();
    }
    match line.char_indices().nth(max) {
        None => line.into(),
        Some((cut, _)) => {
            let rest = line[cut..].chars().count();
            format!("{}… [{} more characters]", &line[..cut], thousands(rest)).into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        for (n, s) in [
            (0, "0"),
            (999, "999"),
            (1000, "1,000"),
            (20_000, "20,000"),
            (1_234_567, "1,234,567"),
        ] {
            assert_eq!(thousands(n), s);
        }
    }

    #[test]
    fn capping_counts_characters() {
        assert_eq!(cap_chars("héllo", 5), "héllo");
        assert_eq!(cap_chars("héllo wörld", 5), "héllo… [6 more characters]");
    }
}
