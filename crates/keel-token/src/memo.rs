use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use dashmap::DashMap;
use keel_message::{Content, ContentPart, Message, ToolArguments, ToolSpec};
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

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
/// each) are kept. A clock ticks on every insertion and each entry is stamped with the
/// clock (in epochs of `capacity / 16` ticks) when it is used; when the map outgrows its
/// capacity, one sweep evicts the entries not used during the last `capacity / 2`
/// insertions, and if more entries than that are all in use, it clears the map. Keep
/// the capacity above twice the number of messages you recount together, or live
/// entries get evicted (counts stay correct either way, only slower). The map is a sharded `DashMap`, so
/// many threads can count at once.
///
/// Put calibration outside the memo (`CalibratedCounter<MemoCounter<C>>`), so the
/// memo holds raw counts that stay valid when the factor moves.
///
/// ```
/// # #[cfg(feature = "tiktoken")] {
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
/// # }
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
    /// The keys and counts of the last list passed to `count_messages`, in order: a
    /// recount of the same conversation reads this array front to back instead of
    /// probing the map at random.
    last: Mutex<Sequence>,
}

/// The last counted list of messages.
#[derive(Default)]
struct Sequence {
    /// The recency epoch its entries were stamped with in the map.
    epoch: u64,
    /// `(key, tokens)` per message, in order.
    keys: Vec<(u128, usize)>,
    /// A spare buffer, reused to build the next sequence without allocating.
    spare: Vec<(u128, usize)>,
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
            last: Mutex::new(Sequence::default()),
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
        self.last_sequence().keys.clear();
        self.map.clear();
        self.entries.store(0, Ordering::Relaxed);
    }

    /// The wrapped counter.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// How many insertions make one recency epoch: stamps are written only when the
    /// epoch changes, so a warm recount reads entries without dirtying them.
    fn epoch_len(&self) -> u64 {
        (self.capacity as u64 / 16).max(1)
    }

    /// The current recency epoch.
    fn epoch(&self) -> u64 {
        self.clock.load(Ordering::Relaxed) / self.epoch_len()
    }

    fn last_sequence(&self) -> std::sync::MutexGuard<'_, Sequence> {
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The remembered count of `message`, or its count from the inner counter (then
    /// remembered). The flag is true for a hit.
    fn lookup(&self, message: &Message, epoch: u64) -> (usize, bool) {
        self.lookup_key(message, message_key(message), epoch)
    }

    fn lookup_key(&self, message: &Message, key: u128, epoch: u64) -> (usize, bool) {
        if let Some(entry) = self.map.get(&key) {
            if entry.last_used.load(Ordering::Relaxed) != epoch {
                entry.last_used.store(epoch, Ordering::Relaxed);
            }
            return (entry.tokens, true);
        }
        let tokens = self.inner.count_message(message);
        let tick = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let entry = Entry {
            tokens,
            last_used: AtomicU64::new(tick / self.epoch_len()),
        };
        if self.map.insert(key, entry).is_none() {
            self.entries.fetch_add(1, Ordering::Relaxed);
            self.maybe_evict();
        }
        (tokens, false)
    }

    /// If the map is over capacity (and no other thread is sweeping): evicts the
    /// entries not used during the last `capacity / 2` insertions; if that is not
    /// enough (more live entries than the capacity), clears the map.
    fn maybe_evict(&self) {
        if self.entries.load(Ordering::Relaxed) <= self.capacity
            || self.sweeping.swap(true, Ordering::Acquire)
        {
            return;
        }
        let now = self.clock.load(Ordering::Relaxed);
        let keep_from = now.saturating_sub((self.capacity / 2) as u64) / self.epoch_len();
        self.map
            .retain(|_, e| e.last_used.load(Ordering::Relaxed) >= keep_from);
        if self.map.len() > self.capacity {
            self.map.clear();
        }
        self.entries.store(self.map.len(), Ordering::Relaxed);
        self.sweeping.store(false, Ordering::Release);
    }
}

impl<C: TokenCounter> TokenCounter for MemoCounter<C> {
    fn count_text(&self, text: &str) -> usize {
        self.inner.count_text(text)
    }

    fn max_tokens(&self, text: &str) -> Option<usize> {
        self.inner.max_tokens(text)
    }

    fn framing(&self) -> Framing {
        self.inner.framing()
    }

    fn count_message(&self, message: &Message) -> usize {
        let (tokens, hit) = self.lookup(message, self.epoch());
        let stat = if hit { &self.hits } else { &self.misses };
        stat.fetch_add(1, Ordering::Relaxed);
        tokens
    }

    /// Like the default (each message plus the reply priming), but a list that starts
    /// like the previous one is matched position by position against the previous
    /// list's keys, which keeps a recount of a long conversation sequential in memory.
    /// Every message is still hashed, so a changed one is still recounted. Once per
    /// recency epoch the recount goes through the map instead, refreshing the entries'
    /// stamps so eviction sees them as used.
    fn count_messages(&self, messages: &[Message]) -> usize {
        let epoch = self.epoch();
        let (mut total, mut hits) = (0, 0u64);
        let mut last = self.last_sequence();
        let Sequence {
            epoch: last_epoch,
            keys: mut previous,
            spare: mut sequence,
        } = std::mem::take(&mut *last);
        if last_epoch != epoch {
            previous.clear();
        }
        sequence.clear();
        sequence.reserve(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let key = message_key(m);
            let (tokens, hit) = match previous.get(i) {
                Some(&(k, tokens)) if k == key => (tokens, true),
                _ => self.lookup_key(m, key, epoch),
            };
            sequence.push((key, tokens));
            total += tokens;
            hits += u64::from(hit);
        }
        previous.clear();
        *last = Sequence {
            epoch,
            keys: sequence,
            spare: previous,
        };
        drop(last);
        self.hits.fetch_add(hits, Ordering::Relaxed);
        self.misses
            .fetch_add(messages.len() as u64 - hits, Ordering::Relaxed);
        total + self.framing().reply_priming
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

/// The memo key of a message: a 128-bit XXH3 over a small block of per-field 64-bit
/// XXH3 hashes (each field in its own slot, so no seeds are needed) (id, role, content, name, tool calls, `tool_call_id`) and a bitmask of
/// which optional fields are present, so `None` and `Some("")` differ and fields cannot
/// bleed into each other. Each field is hashed in one shot, which is what makes a
/// recount cheap: the content bytes are read once, at memory speed.
pub(crate) fn message_key(m: &Message) -> u128 {
    let mut present = 0u64;
    let mut w = [0u64; 8];
    if let Some(id) = &m.id {
        present |= 1;
        w[0] = xxh3_64(id.as_bytes());
    }
    w[1] = m.role as u64 + 1;
    w[2] = match &m.content {
        Content::Text(t) => xxh3_64(t.as_bytes()),
        Content::Parts(parts) => {
            present |= 2;
            let mut acc = fold(0x5eed, parts.len() as u64);
            for part in parts {
                acc = match part {
                    ContentPart::Text { text } => fold(fold(acc, 1), xxh3_64(text.as_bytes())),
                    ContentPart::Image { url, detail } => {
                        let acc = fold(fold(acc, 2), xxh3_64(url.as_bytes()));
                        match detail {
                            Some(d) => fold(fold(acc, 1), xxh3_64(d.as_bytes())),
                            None => fold(acc, 0),
                        }
                    }
                    ContentPart::Other(v) => fold(fold(acc, 3), value_hash(v)),
                };
            }
            acc
        }
    };
    if let Some(name) = &m.name {
        present |= 4;
        w[3] = xxh3_64(name.as_bytes());
    }
    let mut calls = fold(0xca11, m.tool_calls.len() as u64);
    for call in &m.tool_calls {
        calls = fold(calls, xxh3_64(call.id.as_bytes()));
        calls = fold(calls, xxh3_64(call.name.as_bytes()));
        calls = match &call.arguments {
            ToolArguments::Json(v) => fold(fold(calls, 1), value_hash(v)),
            // Counted as their text, so keyed by it.
            ToolArguments::JsonText { raw, .. } => fold(fold(calls, 2), xxh3_64(raw.as_bytes())),
            ToolArguments::Invalid(raw) => fold(fold(calls, 3), xxh3_64(raw.as_bytes())),
        };
    }
    w[4] = calls;
    if let Some(id) = &m.tool_call_id {
        present |= 8;
        w[5] = xxh3_64(id.as_bytes());
    }
    w[6] = m.tool_calls.len() as u64;
    w[7] = present;
    let mut block = [0u8; 64];
    for (chunk, word) in block.chunks_exact_mut(8).zip(w) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    xxh3_128(&block)
}

/// Mixes `x` into `acc`, order-sensitively.
#[inline]
fn fold(acc: u64, x: u64) -> u64 {
    (acc ^ x)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
        ^ (acc >> 17)
}

/// A structural 64-bit hash of a JSON value (pre-order with tags and lengths; object
/// keys in their order, which is also the order they are serialized and counted in).
/// Recursive up to a depth of 64, iterative beyond, so deep values cannot overflow the
/// stack and shallow ones (tool arguments) allocate nothing.
fn value_hash(v: &Value) -> u64 {
    value_hash_at(0x7a1e, v, 0)
}

fn value_hash_at(acc: u64, v: &Value, depth: usize) -> u64 {
    match v {
        Value::Null => fold(acc, 1),
        Value::Bool(b) => fold(acc, 2 + u64::from(*b)),
        Value::Number(n) => {
            let (tag, bits) = if let Some(u) = n.as_u64() {
                (4, u)
            } else if let Some(i) = n.as_i64() {
                (5, i as u64)
            } else {
                (6, n.as_f64().unwrap_or(f64::NAN).to_bits())
            };
            fold(fold(acc, tag), bits)
        }
        Value::String(s) => fold(fold(acc, 7), xxh3_64(s.as_bytes())),
        _ if depth >= 64 => value_hash_deep(acc, v),
        Value::Array(items) => items
            .iter()
            .fold(fold(fold(acc, 8), items.len() as u64), |a, x| {
                value_hash_at(a, x, depth + 1)
            }),
        Value::Object(map) => map
            .iter()
            .fold(fold(fold(acc, 9), map.len() as u64), |a, (k, x)| {
                value_hash_at(fold(a, xxh3_64(k.as_bytes())), x, depth + 1)
            }),
    }
}

/// The same hash as [`value_hash_at`], with an explicit stack.
fn value_hash_deep(acc: u64, v: &Value) -> u64 {
    enum Step<'a> {
        Value(&'a Value),
        Key(&'a str),
    }
    let mut acc = acc;
    let mut stack = vec![Step::Value(v)];
    while let Some(step) = stack.pop() {
        let v = match step {
            Step::Key(k) => {
                acc = fold(acc, xxh3_64(k.as_bytes()));
                continue;
            }
            Step::Value(v) => v,
        };
        acc = match v {
            Value::Array(items) => {
                stack.extend(items.iter().rev().map(Step::Value));
                fold(fold(acc, 8), items.len() as u64)
            }
            Value::Object(map) => {
                for (k, x) in map.iter().rev() {
                    stack.push(Step::Value(x));
                    stack.push(Step::Key(k));
                }
                fold(fold(acc, 9), map.len() as u64)
            }
            scalar => value_hash_at(acc, scalar, 0),
        };
    }
    acc
}
