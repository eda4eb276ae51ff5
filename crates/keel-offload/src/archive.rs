use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use keel_message::Message;
use serde::Deserialize;

use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::lineage::{Lineage, LineageStore};
use crate::policy::{Failure, PolicyOutcome, Stored, StoredWhat};
use crate::scan;
use crate::store::{GrepOptions, OffloadStore, Pattern};

/// Each thread's history of messages that left the context: JSON Lines in the store,
/// appended to and never rewritten.
///
/// Every line is one record, `{"seq":N,"id":"<message id>","hash":"<xxh3>","message":{...}}`,
/// where `message` is the message in keel's own JSON (lossless) and `seq` its
/// position in the archive. The position is the line's place in the file: should two
/// writers append to one thread at once, a line's `seq` field may repeat another's,
/// but positions (what `append` returns and `get`, `range` and `grep` use) do not. The file lives in the thread's namespace
/// (`archive/messages.jsonl` by default), so the agent's retrieval tools can read and
/// grep it like any offloaded file.
///
/// # Costs
///
/// * `append` is one store append of the new records: O(size of the new messages),
///   whatever the archive's size.
/// * The archive keeps, per thread, an index in memory: each record's offset, length
///   and content hash, and a seeded 64-bit hash of each message id (about 40 bytes per
///   record). It is built on first use of a thread by reading the archive once,
///   O(archive size) — a few seconds for 1 GB, see the offload benchmark; after that
///   `get` by id is one hash lookup plus one read of that record, and `range` one read
///   of the span. Each call first asks the store for the archive's size (a `stat`, or
///   one query on a database): if another writer — a worker on the same database, a
///   deleted thread — changed it, the index is read again, so a thread can move
///   between workers. At most [`Archive::CACHED_THREADS`] idle indexes are kept.
/// * `grep` streams the archive through the store's chunked search (hundreds of MB/s,
///   see the offload benchmark) and reads back only the matching records. It
///   searches the JSON text, so quotes and newlines inside messages appear escaped
///   (`\"`, `\n`).
///
/// # Duplicates and damage
///
/// Appending a message whose id is already archived with identical content writes
/// nothing and returns the existing position, so retrying a compaction after a failure
/// does not duplicate history. A message with a known id but changed content is
/// appended as a new record, and `get` returns the newest. A record cut short by a
/// crash is skipped when the index is built, and the next append starts on a new line.
///
/// ```
/// use std::sync::Arc;
/// use keel_offload::message::Message;
/// use keel_offload::{Archive, MemoryStore, Pattern, ThreadId};
///
/// let archive = Archive::new(Arc::new(MemoryStore::new()));
/// let thread = ThreadId::new("t1")?;
/// let history = vec![
///     Message::user("Deploy the service to staging").with_id("m1"),
///     Message::assistant("Deployed; health checks pass.").with_id("m2"),
/// ];
/// let appended = archive.append(&thread, &history)?;
/// assert_eq!(appended.seqs, [0, 1]);
///
/// assert_eq!(archive.get(&thread, "m2")?.unwrap().message, history[1]);
/// assert_eq!(archive.range(&thread, 0..2)?.len(), 2);
/// let found = archive.grep(&thread, &Pattern::new("staging")?, 10)?;
/// assert_eq!(found.messages[0].message.id.as_deref(), Some("m1"));
///
/// // A retry appends nothing.
/// assert_eq!(archive.append(&thread, &history)?.written, 0);
/// assert_eq!(archive.len(&thread)?, 2);
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
pub struct Archive {
    store: Arc<dyn OffloadStore>,
    path: StorePath,
    /// Seed of the id hashes in the index (random per archive, so ids cannot be
    /// chosen to collide).
    seed: u64,
    /// Index by thread and lineage fingerprint (0: the thread's own paths).
    threads: Mutex<HashMap<IndexKey, Arc<Mutex<ThreadIndex>>>>,
}

/// A thread and the fingerprint of the lineage its index was read through.
type IndexKey = (ThreadId, u64);

impl std::fmt::Debug for Archive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Archive")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// What [`Archive::append`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Appended {
    /// The archive position of each message given, in order (the existing position for
    /// a message that was already archived).
    pub seqs: Vec<u64>,
    /// The size in bytes of each message's record, in order.
    pub bytes: Vec<u64>,
    /// How many records were written (the others were already archived).
    pub written: usize,
}

/// A message read back from the archive.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchivedMessage {
    /// Its position in the archive.
    pub seq: u64,
    /// The message, as it was archived.
    pub message: Message,
}

/// The answer of [`Archive::grep`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArchiveGrep {
    /// Matching messages, in archive order.
    pub messages: Vec<ArchivedMessage>,
    /// The search stopped at the requested maximum: more messages match.
    pub truncated: bool,
}

#[derive(Default)]
struct ThreadIndex {
    loaded: bool,
    records: Vec<Pos>,
    /// Seeded hash of a message id → position of its newest record. Hashes rather
    /// than strings keep the index at 16 bytes per id; `get` checks the id it reads.
    by_id: HashMap<u64, usize, BuildHasherDefault<PreHashed>>,
    /// Where the next append lands, as far as this index knows.
    end: u64,
    /// The archive does not end with a newline (a torn last write).
    needs_newline: bool,
}

#[derive(Clone, Copy)]
struct Pos {
    offset: u64,
    len: u64,
    hash: u64,
}

#[derive(Deserialize)]
struct RecordHead {
    #[serde(default)]
    id: Option<String>,
    hash: String,
}

#[derive(Deserialize)]
struct Record {
    message: Message,
}

/// The hasher of keys that are hashes already.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl Archive {
    /// The default archive path inside each thread.
    pub const DEFAULT_PATH: &'static str = "archive/messages.jsonl";

    /// Threads whose index is kept in memory; past it, indexes not in use are dropped
    /// (and read again from the store when needed), so an archive serving many
    /// threads does not grow for every thread it ever touched.
    pub const CACHED_THREADS: usize = 1_024;

    /// An archive in `store`, at [`Archive::DEFAULT_PATH`].
    pub fn new(store: Arc<dyn OffloadStore>) -> Self {
        Archive {
            store,
            path: StorePath::known(Self::DEFAULT_PATH),
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
            threads: Mutex::default(),
        }
    }

    /// Uses another path inside each thread.
    #[must_use]
    pub fn with_path(mut self, path: StorePath) -> Self {
        self.path = path;
        self
    }

    /// The archive's path inside each thread.
    pub fn path(&self) -> &StorePath {
        &self.path
    }

    /// The store the archive writes to.
    pub fn store(&self) -> &Arc<dyn OffloadStore> {
        &self.store
    }

    /// How many threads' indexes are in memory now (at most
    /// [`Archive::CACHED_THREADS`] beyond those in use).
    pub fn cached_threads(&self) -> usize {
        self.threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The store as `lineage` of `thread` sees it.
    fn view(&self, lineage: &Lineage, thread: &ThreadId) -> LineageStore {
        LineageStore::new(self.store.clone(), thread.clone(), lineage.clone())
    }

    fn key(&self, thread: &ThreadId) -> Key {
        Key::from_parts(thread.clone(), self.path.clone())
    }

    fn index(&self, thread: &ThreadId, fingerprint: u64) -> Arc<Mutex<ThreadIndex>> {
        let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
        let key = (thread.clone(), fingerprint);
        if threads.len() >= Self::CACHED_THREADS && !threads.contains_key(&key) {
            // Bounded: drop the indexes nobody is using; they reload from the store.
            threads.retain(|_, index| Arc::strong_count(index) > 1);
        }
        threads.entry(key).or_default().clone()
    }

    /// Runs `f` on the index of the thread's archive as `store` shows it, loading it
    /// first if needed.
    fn with_index<T>(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
        fingerprint: u64,
        f: impl FnOnce(&mut ThreadIndex, &Key) -> Result<T, OffloadError>,
    ) -> Result<T, OffloadError> {
        let index = self.index(thread, fingerprint);
        let mut idx = index.lock().unwrap_or_else(PoisonError::into_inner);
        let key = self.key(thread);
        if idx.loaded && store.size(&key)?.unwrap_or(0) != idx.end {
            // Another writer (a worker on the same database, a deleted thread, another
            // lineage of the thread) changed the archive since this index read it:
            // read it again.
            idx.loaded = false;
        }
        if !idx.loaded {
            *idx = self.load(store, &key)?;
        }
        f(&mut idx, &key)
    }

    /// Builds a thread's index by reading its archive once.
    fn load(&self, store: &dyn OffloadStore, key: &Key) -> Result<ThreadIndex, OffloadError> {
        let mut idx = ThreadIndex {
            loaded: true,
            ..ThreadIndex::default()
        };
        if store.size(key)?.is_none() {
            return Ok(idx);
        }
        let seed = self.seed;
        // Whole lines that are not records: damage (a torn last line is a crash's, and
        // expected). Skipped either way, and said in the log, as nothing else would.
        let mut damaged: u64 = 0;
        let mut first_damaged = None;
        let end = scan::each_line(store.open(key)?, 1 << 20, |offset, body, complete| {
            if let Some((id, hash)) = read_head(body, seed) {
                let seq = idx.records.len();
                idx.records.push(Pos {
                    offset,
                    len: body.len() as u64,
                    hash,
                });
                if let Some(id) = id {
                    idx.by_id.insert(id, seq);
                }
            } else if complete && !body.is_empty() {
                damaged += 1;
                first_damaged.get_or_insert(offset);
            }
            idx.needs_newline = !complete;
        })
        .map_err(|e| OffloadError::io("read the archive", key, e))?;
        idx.end = end;
        if let Some(offset) = first_damaged {
            tracing::warn!(
                archive = %key,
                lines = damaged,
                first_at_byte = offset,
                "archive lines that are not records were skipped (the file was damaged or edited)"
            );
        }
        if idx.needs_newline {
            tracing::debug!(archive = %key, "the archive's last line was torn (a write cut short) and is skipped");
        }
        Ok(idx)
    }

    /// Appends `messages` to the thread's archive in one store append (see the type's
    /// docs for duplicates). When it returns `Ok`, the records are in the store — and on
    /// disk, with an [`FsStore`](crate::FsStore) using [`Fsync::Always`](crate::Fsync).
    pub fn append(
        &self,
        thread: &ThreadId,
        messages: &[Message],
    ) -> Result<Appended, OffloadError> {
        self.append_to(&*self.store, thread, 0, messages)
    }

    /// Appends `messages` to the thread's archive as `lineage` writes it, and moves
    /// `lineage` on past them (only when the append succeeded): store it with the
    /// checkpoint the records belong to. Records another branch of the thread stored
    /// are not seen, so they are neither duplicates nor visible (see [`Lineage`]).
    pub fn append_in(
        &self,
        lineage: &mut Lineage,
        thread: &ThreadId,
        messages: &[Message],
    ) -> Result<Appended, OffloadError> {
        let view = self.view(lineage, thread);
        let before = lineage.fingerprint();
        let out = self.append_to(&view, thread, before, messages)?;
        let moved = view.lineage();
        let after = moved.fingerprint();
        if after != before {
            // The lineage wrote apart: the index it just extended is its own now.
            let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(index) = threads.remove(&(thread.clone(), before)) {
                threads.insert((thread.clone(), after), index);
            }
        }
        *lineage = moved;
        Ok(out)
    }

    fn append_to(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
        fingerprint: u64,
        messages: &[Message],
    ) -> Result<Appended, OffloadError> {
        self.with_index(store, thread, fingerprint, |idx, key| {
            let mut batch = String::new();
            if idx.needs_newline {
                batch.push('\n');
            }
            let mut out = Appended::default();
            // (message index, offset in batch, len, hash) of each new record.
            let mut new: Vec<(usize, usize, u64, u64)> = Vec::new();
            // (seq, len, hash) of the ids written earlier in this batch.
            let mut batch_ids: HashMap<&str, (u64, u64, u64)> = HashMap::new();
            let mut next_seq = idx.records.len() as u64;
            for (i, m) in messages.iter().enumerate() {
                let json = serde_json::to_string(m).map_err(|e| OffloadError::Corrupt {
                    key: key.to_string(),
                    seq: next_seq,
                    reason: format!("cannot serialize the message: {e}"),
                })?;
                let hash = xxhash_rust::xxh3::xxh3_64(json.as_bytes());
                if let Some(id) = m.id.as_deref() {
                    let existing = batch_ids.get(id).copied().or_else(|| {
                        idx.by_id.get(&self.id_hash(id)).map(|&s| {
                            let p = idx.records[s];
                            (s as u64, p.len, p.hash)
                        })
                    });
                    if let Some((seq, bytes, h)) = existing
                        && h == hash
                    {
                        out.seqs.push(seq);
                        out.bytes.push(bytes);
                        continue;
                    }
                }
                let start = batch.len();
                batch.push_str("{\"seq\":");
                batch.push_str(&next_seq.to_string());
                batch.push_str(",\"id\":");
                batch.push_str(&serde_json::to_string(&m.id).unwrap_or_else(|_| "null".into()));
                batch.push_str(&format!(",\"hash\":\"{hash:016x}\",\"message\":"));
                batch.push_str(&json);
                batch.push('}');
                let len = (batch.len() - start) as u64;
                batch.push('\n');
                new.push((i, start, len, hash));
                if let Some(id) = m.id.as_deref() {
                    batch_ids.insert(id, (next_seq, len, hash));
                }
                out.seqs.push(next_seq);
                out.bytes.push(len);
                next_seq += 1;
            }
            if new.is_empty() {
                return Ok(out);
            }
            let offset = match store.append(key, &batch) {
                Ok(offset) => offset,
                Err(e) => {
                    // Part of the batch may have been written: re-read the archive next time.
                    idx.loaded = false;
                    return Err(e);
                }
            };
            if offset != idx.end {
                // Another writer (another `Archive` over the store, another worker)
                // appended between this index's look at the archive and the append: the
                // positions given above are stale. The archive is read again, and each
                // new record's position is where the store put it.
                let first_new = idx.records.len() as u64;
                *idx = self.load(store, key)?;
                let at: HashMap<u64, u64> = idx
                    .records
                    .iter()
                    .enumerate()
                    .map(|(seq, p)| (p.offset, seq as u64))
                    .collect();
                for seq in &mut out.seqs {
                    let Some(&(_, start, _, _)) = seq
                        .checked_sub(first_new)
                        .and_then(|k| new.get(usize::try_from(k).ok()?))
                    else {
                        continue;
                    };
                    if let Some(&true_seq) = at.get(&(offset + start as u64)) {
                        *seq = true_seq;
                    }
                }
                out.written = new.len();
                return Ok(out);
            }
            for &(i, start, len, hash) in &new {
                let seq = idx.records.len();
                idx.records.push(Pos {
                    offset: offset + start as u64,
                    len,
                    hash,
                });
                if let Some(id) = &messages[i].id {
                    idx.by_id.insert(self.id_hash(id), seq);
                }
            }
            idx.end = offset + batch.len() as u64;
            idx.needs_newline = false;
            out.written = new.len();
            Ok(out)
        })
    }

    /// Number of records in the thread's archive.
    pub fn len(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        self.with_index(&*self.store, thread, 0, |idx, _| {
            Ok(idx.records.len() as u64)
        })
    }

    /// Number of records of the thread's archive `lineage` sees.
    pub fn len_in(&self, lineage: &Lineage, thread: &ThreadId) -> Result<u64, OffloadError> {
        let view = self.view(lineage, thread);
        self.with_index(&view, thread, lineage.fingerprint(), |idx, _| {
            Ok(idx.records.len() as u64)
        })
    }

    /// True when the thread's archive has no records.
    pub fn is_empty(&self, thread: &ThreadId) -> Result<bool, OffloadError> {
        Ok(self.len(thread)? == 0)
    }

    /// The newest archived message with this id.
    pub fn get(
        &self,
        thread: &ThreadId,
        id: &str,
    ) -> Result<Option<ArchivedMessage>, OffloadError> {
        self.get_from(&*self.store, thread, 0, id)
    }

    /// The newest archived message with this id that `lineage` sees.
    pub fn get_in(
        &self,
        lineage: &Lineage,
        thread: &ThreadId,
        id: &str,
    ) -> Result<Option<ArchivedMessage>, OffloadError> {
        let view = self.view(lineage, thread);
        self.get_from(&view, thread, lineage.fingerprint(), id)
    }

    fn get_from(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
        fingerprint: u64,
        id: &str,
    ) -> Result<Option<ArchivedMessage>, OffloadError> {
        self.with_index(store, thread, fingerprint, |idx, key| {
            let Some(&seq) = idx.by_id.get(&self.id_hash(id)) else {
                return Ok(None);
            };
            let found = self.read_record(store, idx, key, seq)?;
            if found.message.id.as_deref() == Some(id) {
                return Ok(Some(found));
            }
            // Two ids share a 64-bit hash (about one chance in 2^64 per pair): look
            // for the newest record of this id the slow way.
            for seq in (0..idx.records.len()).rev() {
                let candidate = self.read_record(store, idx, key, seq)?;
                if candidate.message.id.as_deref() == Some(id) {
                    return Ok(Some(candidate));
                }
            }
            Ok(None)
        })
    }

    fn id_hash(&self, id: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), self.seed)
    }

    fn read_record(
        &self,
        store: &dyn OffloadStore,
        idx: &ThreadIndex,
        key: &Key,
        seq: usize,
    ) -> Result<ArchivedMessage, OffloadError> {
        let pos = idx.records[seq];
        let bytes = store.read_at(key, pos.offset, pos.len as usize)?;
        parse(key, seq as u64, &bytes)
    }

    /// The archived messages at positions `seqs` (clamped to what exists), in order.
    pub fn range(
        &self,
        thread: &ThreadId,
        seqs: Range<u64>,
    ) -> Result<Vec<ArchivedMessage>, OffloadError> {
        self.range_from(&*self.store, thread, 0, seqs)
    }

    /// The archived messages `lineage` sees at positions `seqs` (clamped), in order.
    pub fn range_in(
        &self,
        lineage: &Lineage,
        thread: &ThreadId,
        seqs: Range<u64>,
    ) -> Result<Vec<ArchivedMessage>, OffloadError> {
        let view = self.view(lineage, thread);
        self.range_from(&view, thread, lineage.fingerprint(), seqs)
    }

    fn range_from(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
        fingerprint: u64,
        seqs: Range<u64>,
    ) -> Result<Vec<ArchivedMessage>, OffloadError> {
        self.with_index(store, thread, fingerprint, |idx, key| {
            let n = idx.records.len() as u64;
            let (lo, hi) = (seqs.start.min(n) as usize, seqs.end.min(n) as usize);
            if lo >= hi {
                return Ok(Vec::new());
            }
            let first = idx.records[lo];
            let last = idx.records[hi - 1];
            let span = (last.offset + last.len - first.offset) as usize;
            let bytes = store.read_at(key, first.offset, span)?;
            idx.records[lo..hi]
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let at = (p.offset - first.offset) as usize;
                    let record = bytes.get(at..at + p.len as usize).unwrap_or_default();
                    parse(key, (lo + i) as u64, record)
                })
                .collect()
        })
    }

    /// Archived messages whose record matches `pattern`, at most `max_results`, in
    /// archive order.
    pub fn grep(
        &self,
        thread: &ThreadId,
        pattern: &Pattern,
        max_results: usize,
    ) -> Result<ArchiveGrep, OffloadError> {
        self.grep_from(&*self.store, thread, 0, pattern, max_results)
    }

    /// Archived messages `lineage` sees whose record matches `pattern`, at most
    /// `max_results`, in archive order.
    pub fn grep_in(
        &self,
        lineage: &Lineage,
        thread: &ThreadId,
        pattern: &Pattern,
        max_results: usize,
    ) -> Result<ArchiveGrep, OffloadError> {
        let view = self.view(lineage, thread);
        self.grep_from(&view, thread, lineage.fingerprint(), pattern, max_results)
    }

    fn grep_from(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
        fingerprint: u64,
        pattern: &Pattern,
        max_results: usize,
    ) -> Result<ArchiveGrep, OffloadError> {
        self.with_index(store, thread, fingerprint, |idx, key| {
            if idx.records.is_empty() {
                return Ok(ArchiveGrep::default());
            }
            let options = GrepOptions {
                max_results,
                max_line_bytes: 0,
            };
            let found = store.grep(thread, Some(&self.path), pattern, &options)?;
            let mut out = ArchiveGrep {
                messages: Vec::with_capacity(found.matches.len()),
                truncated: found.truncated,
            };
            for m in found.matches {
                // Lines that are not records (a torn write) are not in the index.
                let Ok(seq) = idx
                    .records
                    .binary_search_by_key(&m.byte_offset, |p| p.offset)
                else {
                    continue;
                };
                out.messages.push(self.read_record(store, idx, key, seq)?);
            }
            Ok(out)
        })
    }

    /// The archive policy: appends `messages[leaving]` to the thread's archive and, only
    /// once that succeeded, removes them from the list.
    ///
    /// On failure every message stays and the error is the outcome's one failure:
    /// nothing leaves the context unless it is archived (invariant 2 of `docs/architecture.md`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_offload::message::Message;
    /// use keel_offload::{Archive, MemoryStore, ThreadId};
    ///
    /// let archive = Archive::new(Arc::new(MemoryStore::new()));
    /// let thread = ThreadId::new("t1")?;
    /// let history: Vec<Message> = (0..5).map(|i| Message::user(format!("step {i}")).with_id(format!("m{i}"))).collect();
    ///
    /// let out = archive.archive_and_remove(history, 0..3, &thread);
    /// assert!(out.is_complete());
    /// assert_eq!(out.messages.len(), 2);
    /// assert_eq!(out.stored.len(), 3);
    /// assert_eq!(archive.get(&thread, "m0")?.unwrap().message.text(), "step 0");
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn archive_and_remove(
        &self,
        mut messages: Vec<Message>,
        leaving: Range<usize>,
        thread: &ThreadId,
    ) -> PolicyOutcome {
        let end = leaving.end.min(messages.len());
        let start = leaving.start.min(end);
        if start == end {
            return PolicyOutcome::unchanged(messages);
        }
        match self.append(thread, &messages[start..end]) {
            Ok(appended) => {
                let stored = messages[start..end]
                    .iter()
                    .zip(appended.seqs.iter().zip(&appended.bytes))
                    .enumerate()
                    .map(|(i, (m, (&seq, &bytes)))| Stored {
                        index: start + i,
                        message_id: m.id.clone(),
                        path: self.path.clone(),
                        bytes,
                        what: StoredWhat::Archived { seq },
                    })
                    .collect();
                messages.drain(start..end);
                PolicyOutcome {
                    messages,
                    stored,
                    failures: Vec::new(),
                }
            }
            Err(error) => {
                let message_id = messages[start].id.clone();
                PolicyOutcome {
                    messages,
                    stored: Vec::new(),
                    failures: vec![Failure {
                        index: start,
                        message_id,
                        error,
                    }],
                }
            }
        }
    }
}

/// The seeded id hash and the content hash of a record line. Records this crate wrote
/// start with `{"seq":N,"id":...,"hash":"...","message":` and their message hashes to
/// the hash, which is checked without parsing the message; anything else goes through
/// the full JSON parser.
fn read_head(line: &[u8], seed: u64) -> Option<(Option<u64>, u64)> {
    let id_hash = |id: &str| xxhash_rust::xxh3::xxh3_64_with_seed(id.as_bytes(), seed);
    if let Some((id, hash)) = fast_head(line) {
        return Some((id.map(|id| id_hash(&id)), hash));
    }
    let head = serde_json::from_slice::<RecordHead>(line).ok()?;
    let hash = u64::from_str_radix(&head.hash, 16).ok()?;
    Some((head.id.as_deref().map(id_hash), hash))
}

fn fast_head(line: &[u8]) -> Option<(Option<std::borrow::Cow<'_, str>>, u64)> {
    let rest = line.strip_prefix(b"{\"seq\":")?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let rest = rest[digits..].strip_prefix(b",\"id\":")?;
    // Borrow the id when it has no escapes; allocate only when it does.
    let mut borrowed = serde_json::Deserializer::from_slice(rest).into_iter::<Option<&str>>();
    let (id, used) = match borrowed.next() {
        Some(Ok(id)) => (id.map(std::borrow::Cow::Borrowed), borrowed.byte_offset()),
        _ => {
            let mut owned =
                serde_json::Deserializer::from_slice(rest).into_iter::<Option<String>>();
            let id = owned.next()?.ok()?;
            (id.map(std::borrow::Cow::Owned), owned.byte_offset())
        }
    };
    let rest = rest.get(used..)?.strip_prefix(b",\"hash\":\"")?;
    let hash = std::str::from_utf8(rest.get(..16)?).ok()?;
    let hash = u64::from_str_radix(hash, 16).ok()?;
    let rest = rest[16..].strip_prefix(b"\",\"message\":")?;
    // The message is what was hashed when the record was written: a record cut short
    // (or otherwise damaged) fails the check and goes to the full parser.
    let message = rest.strip_suffix(b"}")?;
    if digits == 0 || hash != xxhash_rust::xxh3::xxh3_64(message) {
        return None;
    }
    Some((id, hash))
}

fn parse(key: &Key, seq: u64, bytes: &[u8]) -> Result<ArchivedMessage, OffloadError> {
    serde_json::from_slice::<Record>(bytes)
        .map(|r| ArchivedMessage {
            seq,
            message: r.message,
        })
        .map_err(|e| OffloadError::Corrupt {
            key: key.to_string(),
            seq,
            reason: e.to_string(),
        })
}
