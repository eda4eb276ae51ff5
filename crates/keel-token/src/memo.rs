use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use keel_message::{Content, ContentPart, Message, ToolArguments, ToolSpec};
use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

use crate::{Framing, TokenCounter};

/// The default number of messages a [`MemoCounter`] remembers.
pub const DEFAULT_MEMO_CAPACITY: usize = 1 << 18;

/// A counter that remembers the count of every message it has seen, so recounting a
/// conversation after appending one message tokenizes only that message.
///
/// Each message is keyed by its `id` plus a 128-bit XXH3 hash of everything
/// [`TokenCounter::count_message`] reads (role, content, name, tool calls,
/// `tool_call_id`); a message without an id is keyed by the hash alone. Change a
/// message's content and keep its id, and it is counted afresh. Recounting a known
/// message costs one hash of its bytes (gigabytes per second) and one map lookup,
/// instead of tokenizing it. `metadata` is not part of the key, so an inner counter
/// whose `count_message` reads metadata should not be memoized.
///
/// Memory is bounded: at most [`capacity`](Self::capacity) entries (about 60 bytes
/// each) are kept. When the map outgrows it, entries not used during the last
/// `capacity / 2` lookups are evicted, in one sweep; so keep the capacity above twice
/// the number of messages you recount together, or the sweeps will evict live ones
/// (counts stay correct either way, only slower). The map is a sharded `DashMap`, so
/// many threads can count at once.
///
/// Put calibration outside the memo (`CalibratedCounter<MemoCounter<C>>`), so the
/// memo holds raw counts that stay valid when the factor moves.
///
/// ```
/// use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
/// use keel_message::Message;
///
/// let counter = MemoCounter::new(TiktokenCounter::o200k_base()?);
/// let mut history = vec![
///     Message::system("You are terse.").with_id("m0"),
///     Message::user("Summarize the log.").with_id("m1"),
/// ];
/// let before = counter.count_messages(&history);
/// history.push(Message::assistant("All green.").with_id("m2"));
/// let after = counter.count_messages(&history); // only m2 is tokenized
/// assert_eq!(after - before, counter.count_message(&history[2]));
/// assert_eq!(counter.stats().misses, 3);
///
/// // Same id, new content: recounted, not served stale.
/// history[2] = Message::assistant("One test failed: see the log for details.").with_id("m2");
/// assert!(counter.count_messages(&history) > after);
/// # Ok::<(), keel_token::TokenError>(())
/// ```
pub struct MemoCounter<C> {
    inner: C,
    map: DashMap<u128, Entry, BuildHasherDefault<KeyHasher>>,
    capacity: usize,
    entries: AtomicUsize,
    clock: AtomicU64,
    sweeping: AtomicBool,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Entry {
    tokens: usize,
    last_used: AtomicU64,
}

/// Hit and miss counts of a [`MemoCounter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoStats {
    /// Messages answered from the memo.
    pub hits: u64,
    /// Messages counted by the inner counter.
    pub misses: u64,
    /// Entries currently held.
    pub entries: usize,
}

impl<C: TokenCounter> MemoCounter<C> {
    /// Wraps `inner`, remembering up to [`DEFAULT_MEMO_CAPACITY`] messages.
    pub fn new(inner: C) -> Self {
        Self::with_capacity(inner, DEFAULT_MEMO_CAPACITY)
    }

    /// Wraps `inner`, remembering up to `capacity` messages (at least 2).
    pub fn with_capacity(inner: C, capacity: usize) -> Self {
        MemoCounter {
            inner,
            map: DashMap::default(),
            capacity: capacity.max(2),
            entries: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            sweeping: AtomicBool::new(false),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The most entries kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Hits, misses and current size.
    pub fn stats(&self) -> MemoStats {
        MemoStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.map.len(),
        }
    }

    /// Forgets every remembered count.
    pub fn clear(&self) {
        self.map.clear();
        self.entries.store(0, Ordering::Relaxed);
    }

    /// The wrapped counter.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Evicts entries unused during the last `capacity / 2` lookups, if the map is over
    /// capacity and no other thread is already sweeping.
    fn maybe_evict(&self) {
        if self.entries.load(Ordering::Relaxed) <= self.capacity
            || self.sweeping.swap(true, Ordering::Acquire)
        {
            return;
        }
        let now = self.clock.load(Ordering::Relaxed);
        let keep_after = now.saturating_sub((self.capacity / 2) as u64);
        self.map
            .retain(|_, e| e.last_used.load(Ordering::Relaxed) > keep_after);
        self.entries.store(self.map.len(), Ordering::Relaxed);
        self.sweeping.store(false, Ordering::Release);
    }
}

impl<C: TokenCounter> TokenCounter for MemoCounter<C> {
    fn count_text(&self, text: &str) -> usize {
        self.inner.count_text(text)
    }

    fn framing(&self) -> Framing {
        self.inner.framing()
    }

    fn count_message(&self, message: &Message) -> usize {
        let key = message_key(message);
        let tick = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(entry) = self.map.get(&key) {
            entry.last_used.store(tick, Ordering::Relaxed);
            self.hits.fetch_add(1, Ordering::Relaxed);
            return entry.tokens;
        }
        let tokens = self.inner.count_message(message);
        self.misses.fetch_add(1, Ordering::Relaxed);
        let entry = Entry {
            tokens,
            last_used: AtomicU64::new(tick),
        };
        if self.map.insert(key, entry).is_none() {
            self.entries.fetch_add(1, Ordering::Relaxed);
            self.maybe_evict();
        }
        tokens
    }

    fn count_tool(&self, tool: &ToolSpec) -> usize {
        self.inner.count_tool(tool)
    }
}

impl<C: std::fmt::Debug> std::fmt::Debug for MemoCounter<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoCounter")
            .field("inner", &self.inner)
            .field("capacity", &self.capacity)
            .field("entries", &self.entries.load(Ordering::Relaxed))
            .finish()
    }
}

/// Keys are already uniformly distributed hashes: the map's hasher just takes bits.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only used for u128 keys (via write_u128); fold anything else in.
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0 ^ u64::from_le_bytes(buf)).rotate_left(23);
        }
    }

    fn write_u128(&mut self, n: u128) {
        self.0 = (n as u64) ^ ((n >> 64) as u64);
    }
}

/// The memo key of a message: XXH3-128 over its id and every field counting reads,
/// each length-prefixed and tagged so distinct messages cannot collide by
/// concatenation.
pub(crate) fn message_key(m: &Message) -> u128 {
    let mut h = Xxh3::new();
    match &m.id {
        Some(id) => {
            h.update(b"I");
            str_field(&mut h, id);
        }
        None => h.update(b"-"),
    }
    h.update(m.role.as_str().as_bytes());
    match &m.content {
        Content::Text(t) => {
            h.update(b"T");
            str_field(&mut h, t);
        }
        Content::Parts(parts) => {
            h.update(b"P");
            h.update(&(parts.len() as u64).to_le_bytes());
            for part in parts {
                match part {
                    ContentPart::Text { text } => {
                        h.update(b"t");
                        str_field(&mut h, text);
                    }
                    ContentPart::Image { url, detail } => {
                        h.update(b"i");
                        str_field(&mut h, url);
                        opt_field(&mut h, detail.as_deref());
                    }
                    ContentPart::Other(v) => {
                        h.update(b"o");
                        value_field(&mut h, v);
                    }
                }
            }
        }
    }
    opt_field(&mut h, m.name.as_deref());
    h.update(&(m.tool_calls.len() as u64).to_le_bytes());
    for call in &m.tool_calls {
        str_field(&mut h, &call.id);
        str_field(&mut h, &call.name);
        match &call.arguments {
            ToolArguments::Json(v) => {
                h.update(b"j");
                value_field(&mut h, v);
            }
            // Counted as their text, so keyed by it.
            ToolArguments::JsonText { raw, .. } => {
                h.update(b"x");
                str_field(&mut h, raw);
            }
            ToolArguments::Invalid(raw) => {
                h.update(b"r");
                str_field(&mut h, raw);
            }
        }
    }
    opt_field(&mut h, m.tool_call_id.as_deref());
    h.digest128()
}

fn str_field(h: &mut Xxh3, s: &str) {
    h.update(&(s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

fn opt_field(h: &mut Xxh3, s: Option<&str>) {
    match s {
        Some(s) => {
            h.update(b"S");
            str_field(h, s);
        }
        None => h.update(b"N"),
    }
}

/// Hashes a JSON value structurally (pre-order, with tags and lengths), iteratively so
/// deep values cannot overflow the stack. Object keys are hashed in their order, which
/// is also the order they are serialized and counted in.
fn value_field(h: &mut Xxh3, v: &Value) {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Null => h.update(b"n"),
            Value::Bool(b) => h.update(if *b { b"T" } else { b"F" }),
            Value::Number(n) => {
                h.update(b"#");
                if let Some(u) = n.as_u64() {
                    h.update(b"u");
                    h.update(&u.to_le_bytes());
                } else if let Some(i) = n.as_i64() {
                    h.update(b"i");
                    h.update(&i.to_le_bytes());
                } else {
                    h.update(b"f");
                    h.update(&n.as_f64().unwrap_or(f64::NAN).to_bits().to_le_bytes());
                }
            }
            Value::String(s) => {
                h.update(b"s");
                str_field(h, s);
            }
            Value::Array(items) => {
                h.update(b"[");
                h.update(&(items.len() as u64).to_le_bytes());
                stack.extend(items.iter().rev());
            }
            Value::Object(map) => {
                h.update(b"{");
                h.update(&(map.len() as u64).to_le_bytes());
                // Keys are hashed now, in order; their values are pushed so they are
                // visited in the same order afterwards. Distinct objects still differ:
                // the key list and the value sequence are both part of the stream.
                for k in map.keys() {
                    str_field(h, k);
                }
                stack.extend(map.values().rev());
            }
        }
    }
}
