//! Pieces of the [`Checkpointer`](crate::Checkpointer) contract that every backend
//! needs, written once so backends agree: request validation, chain rebuilding,
//! pending-write keys, the idle cutoff of a TTL sweep, the head versions a saver
//! need not look up again ([`HeadVersions`]), and the delta links a prune need not
//! read back ([`DeltaLinks`], [`walk_chains`]).

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::CheckpointError;
use crate::id::{CheckpointId, ThreadKey};
use crate::types::{
    ChannelChain, ChannelDelta, ChannelVersion, CheckpointMetadata, PendingWrite, PutRequest,
};

/// Checks what can be checked in a [`PutRequest`] without looking at storage:
///
/// * every delta's `version.writer` is the checkpoint's id, and its `version` is the
///   one `checkpoint.channel_versions` holds for its channel;
/// * at most one delta per channel;
/// * every channel version written by this checkpoint has its delta;
/// * a delta's base, if any, has a smaller `seq` than its version;
/// * the metadata's extra keys do not reuse a typed field's name
///   ([`CheckpointMetadata::RESERVED_KEYS`](crate::CheckpointMetadata::RESERVED_KEYS):
///   stored as one flat JSON object, they would clash).
///
/// ```
/// use keel_checkpoint::support::validate_put;
/// use keel_checkpoint::*;
///
/// let checkpoint = Checkpoint::new(None);
/// let version = ChannelVersion::new(1, checkpoint.id.clone());
/// let mut request = PutRequest {
///     thread: ThreadKey::new("t"),
///     checkpoint,
///     metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
///     deltas: vec![],
///     expected_head: None,
/// };
/// request.checkpoint.channel_versions.insert("x".into(), version);
/// // channel "x" is written by this checkpoint but has no delta
/// assert!(matches!(validate_put(&request), Err(CheckpointError::Invalid { .. })));
/// ```
pub fn validate_put(request: &PutRequest) -> Result<(), CheckpointError> {
    let checkpoint = &request.checkpoint;
    let invalid = |reason: String| Err(CheckpointError::Invalid { reason });
    if let Some(key) = CheckpointMetadata::RESERVED_KEYS
        .iter()
        .find(|k| request.metadata.extra.contains_key(**k))
    {
        return invalid(format!(
            "metadata extra key {key:?} is reserved for the typed field of that name"
        ));
    }
    let mut written = BTreeSet::new();
    for delta in &request.deltas {
        if delta.version.writer != checkpoint.id {
            return invalid(format!(
                "delta for channel {:?} has writer {}, not the checkpoint being put ({})",
                delta.channel, delta.version.writer, checkpoint.id
            ));
        }
        match checkpoint.channel_versions.get(&delta.channel) {
            Some(version) if *version == delta.version => {}
            Some(version) => {
                return invalid(format!(
                    "delta for channel {:?} has version {}, but the checkpoint holds {}",
                    delta.channel, delta.version.seq, version.seq
                ));
            }
            None => {
                return invalid(format!(
                    "delta for channel {:?}, which the checkpoint has no version of",
                    delta.channel
                ));
            }
        }
        if let Some(base) = &delta.base
            && base.seq >= delta.version.seq
        {
            return invalid(format!(
                "delta for channel {:?}: base seq {} is not below version seq {}",
                delta.channel, base.seq, delta.version.seq
            ));
        }
        if !written.insert(delta.channel.as_str()) {
            return invalid(format!("two deltas for channel {:?}", delta.channel));
        }
    }
    for (channel, version) in &checkpoint.channel_versions {
        if version.writer == checkpoint.id && !written.contains(channel.as_str()) {
            return invalid(format!(
                "channel {channel:?} is written by this checkpoint but has no delta"
            ));
        }
    }
    Ok(())
}

/// The channel versions a [`PutRequest`] refers to that must already be stored, as
/// `(channel, version)`: each delta's base, and each channel version the checkpoint
/// carries over unchanged (written by an earlier checkpoint). A backend refuses the put
/// with [`CheckpointError::Invalid`] if the delta of any of them is not stored (under
/// `(thread, ns, channel, version.writer)`, with the same `seq`).
pub fn referenced_versions(request: &PutRequest) -> Vec<(&str, &ChannelVersion)> {
    let bases = request
        .deltas
        .iter()
        .filter_map(|d| d.base.as_ref().map(|base| (d.channel.as_str(), base)));
    let carried = request
        .checkpoint
        .channel_versions
        .iter()
        .filter(|(_, v)| v.writer != request.checkpoint.id)
        .map(|(channel, v)| (channel.as_str(), v));
    bases.chain(carried).collect()
}

/// The channel versions of the newest checkpoint a saver put in each namespace, so a
/// put that carries them over need not have storage look each of them up again.
///
/// A put may refer only to stored deltas ([`referenced_versions`]). Most refer to the
/// versions of the head they extend, and those are stored: they were checked (or
/// inserted) when that head was put, and nothing deletes a delta the head reaches
/// while it is the head (`prune` keeps the newest checkpoints' chains; deleting a
/// thread removes its head). So a reference equal to the remembered head's version of
/// its channel needs no lookup, **provided the backend confirms, in the put's own
/// transaction, that the thread's head is `expected_head`** (as the fencing check
/// does). Anything else (another writer moved the head, a fork from an older
/// checkpoint) is checked as usual.
///
/// Bounded: past `capacity` namespaces it starts over (a miss only costs the lookups
/// it would have saved).
///
/// ```
/// use keel_checkpoint::support::{HeadVersions, referenced_versions};
/// use keel_checkpoint::*;
/// use serde_json::json;
///
/// // A step writing `channel`, after `parent`.
/// let step = |parent: Option<&Checkpoint>, channel: &str| {
///     let mut checkpoint = match parent {
///         Some(p) => p.successor(),
///         None => Checkpoint::new(None),
///     };
///     let version = ChannelVersion::new(1, checkpoint.id.clone());
///     checkpoint.channel_versions.insert(channel.into(), version.clone());
///     let delta = ChannelDelta {
///         channel: channel.into(),
///         version,
///         base: None,
///         updates: vec![json!(1)],
///         snapshot: None,
///     };
///     PutRequest {
///         thread: ThreadKey::new("t"),
///         checkpoint,
///         metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
///         deltas: vec![delta],
///         expected_head: parent.map(|p| p.id.clone()),
///     }
/// };
/// let mut heads = HeadVersions::new(1024);
/// let first = step(None, "a");
/// heads.remember(&first); // once it committed
/// let second = step(Some(&first.checkpoint), "b");
/// assert_eq!(referenced_versions(&second).len(), 1, "`a` is carried over");
/// assert!(heads.to_check(&second).is_empty(), "and known to be stored");
/// ```
#[derive(Debug, Clone)]
pub struct HeadVersions {
    heads: HashMap<ThreadKey, (CheckpointId, BTreeMap<String, ChannelVersion>)>,
    capacity: usize,
}

impl HeadVersions {
    /// Remembers the heads of up to `capacity` namespaces.
    pub fn new(capacity: usize) -> Self {
        HeadVersions {
            heads: HashMap::new(),
            capacity,
        }
    }

    /// The references of `request` ([`referenced_versions`]) storage must still
    /// check: all but those equal to the remembered versions of its `expected_head`.
    pub fn to_check<'r>(&self, request: &'r PutRequest) -> Vec<(&'r str, &'r ChannelVersion)> {
        let known = request.expected_head.as_ref().and_then(|head| {
            self.heads
                .get(&request.thread)
                .filter(|(id, _)| id == head)
                .map(|(_, versions)| versions)
        });
        let mut refs = referenced_versions(request);
        if let Some(known) = known {
            refs.retain(|(channel, version)| known.get(*channel) != Some(*version));
        }
        refs
    }

    /// Forgets every namespace (say, after a transaction that remembered puts rolled
    /// back): their references are looked up again.
    pub fn clear(&mut self) {
        self.heads.clear();
    }

    /// Records `request`'s checkpoint as its namespace's head. Call it only after the
    /// put committed.
    pub fn remember(&mut self, request: &PutRequest) {
        let checkpoint = &request.checkpoint;
        // A namespace already remembered is updated in place: a step changes the
        // versions of the few channels it wrote, so most entries stay as they are.
        if let Some((id, known)) = self.heads.get_mut(&request.thread) {
            id.clone_from(&checkpoint.id);
            for (channel, version) in &checkpoint.channel_versions {
                match known.get_mut(channel) {
                    Some(old) => old.clone_from(version),
                    None => {
                        known.insert(channel.clone(), version.clone());
                    }
                }
            }
            // Every channel of the checkpoint is known now: more means some are gone.
            if known.len() > checkpoint.channel_versions.len() {
                known.retain(|channel, _| checkpoint.channel_versions.contains_key(channel));
            }
            return;
        }
        if self.heads.len() >= self.capacity {
            self.heads.clear();
        }
        if self.capacity > 0 {
            self.heads.insert(
                request.thread.clone(),
                (checkpoint.id.clone(), checkpoint.channel_versions.clone()),
            );
        }
    }
}

/// Rebuilds the chain of `channel` at version `head`.
///
/// `lookup(writer)` returns the stored delta of `channel` written by checkpoint
/// `writer`, if any. Starting from `head`, follows `base` links back to the newest
/// delta that has a snapshot (or to a delta with no base); the chain is that snapshot
/// (or none) plus the updates of every later delta, oldest first.
///
/// Fails with [`CheckpointError::Corrupt`] if a delta is missing or its `seq` is not
/// the one referred to (which also rules out cycles: `seq` strictly decreases).
///
/// ```
/// use keel_checkpoint::support::build_chain;
/// use keel_checkpoint::{ChannelDelta, ChannelVersion, CheckpointId};
/// use serde_json::json;
///
/// let (a, b) = (CheckpointId::new(), CheckpointId::new());
/// let first = ChannelDelta {
///     channel: "log".into(),
///     version: ChannelVersion::new(1, a.clone()),
///     base: None,
///     updates: vec![json!("x")],
///     snapshot: None,
/// };
/// let second = ChannelDelta {
///     channel: "log".into(),
///     version: ChannelVersion::new(2, b.clone()),
///     base: Some(first.version.clone()),
///     updates: vec![json!("y")],
///     snapshot: None,
/// };
/// let chain = build_chain("log", &second.version, |writer| {
///     Ok([&first, &second].into_iter().find(|d| d.version.writer == *writer))
/// })?;
/// assert_eq!(chain.snapshot, None);
/// assert_eq!(chain.deltas, vec![vec![json!("x")], vec![json!("y")]]);
/// # Ok::<(), keel_checkpoint::CheckpointError>(())
/// ```
pub fn build_chain<D, F>(
    channel: &str,
    head: &ChannelVersion,
    mut lookup: F,
) -> Result<ChannelChain, CheckpointError>
where
    D: Borrow<ChannelDelta>,
    F: FnMut(&CheckpointId) -> Result<Option<D>, CheckpointError>,
{
    let mut newest_first: Vec<Vec<serde_json::Value>> = Vec::new();
    let mut want = head.clone();
    let snapshot = loop {
        let Some(found) = lookup(&want.writer)? else {
            return Err(CheckpointError::Corrupt {
                what: format!(
                    "channel {channel:?}: delta of version {} by {} is missing",
                    want.seq, want.writer
                ),
            });
        };
        let delta: &ChannelDelta = found.borrow();
        if delta.version != want {
            return Err(CheckpointError::Corrupt {
                what: format!(
                    "channel {channel:?}: delta by {} has seq {}, expected {}",
                    want.writer, delta.version.seq, want.seq
                ),
            });
        }
        if let Some(snapshot) = &delta.snapshot {
            break Some(snapshot.clone());
        }
        newest_first.push(delta.updates.clone());
        match &delta.base {
            None => break None,
            Some(base) if base.seq < want.seq => want = base.clone(),
            Some(base) => {
                return Err(CheckpointError::Corrupt {
                    what: format!(
                        "channel {channel:?}: delta by {} has base seq {} not below {}",
                        want.writer, base.seq, want.seq
                    ),
                });
            }
        }
    };
    newest_first.reverse();
    Ok(ChannelChain {
        snapshot,
        deltas: newest_first,
    })
}

/// The key of one pending write: `(task_id, channel, index)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriteKey {
    /// The task that wrote.
    pub task_id: String,
    /// The channel written.
    pub channel: String,
    /// Which of that task's writes to that channel within one `put_writes` call
    /// (0 for the first).
    pub index: usize,
}

/// The key of each write in one `put_writes` call, in order.
///
/// ```
/// use keel_checkpoint::PendingWrite;
/// use keel_checkpoint::support::write_keys;
/// use serde_json::json;
///
/// let writes = vec![
///     PendingWrite::new("t1", "0", "messages", json!("a")),
///     PendingWrite::new("t1", "0", "messages", json!("b")),
///     PendingWrite::new("t1", "0", "count", json!(1)),
/// ];
/// let indices: Vec<usize> = write_keys(&writes).into_iter().map(|k| k.index).collect();
/// assert_eq!(indices, vec![0, 1, 0]);
/// ```
pub fn write_keys(writes: &[PendingWrite]) -> Vec<WriteKey> {
    let mut counts: std::collections::HashMap<(&str, &str), usize> = Default::default();
    writes
        .iter()
        .map(|w| {
            let count = counts
                .entry((w.task_id.as_str(), w.channel.as_str()))
                .or_insert(0);
            let key = WriteKey {
                task_id: w.task_id.clone(),
                channel: w.channel.clone(),
                index: *count,
            };
            *count += 1;
            key
        })
        .collect()
}

/// Merges `writes` (one `put_writes` call) into `stored` (the keyed writes of one
/// checkpoint, in stored order) by the rules of
/// [`Checkpointer::put_writes`](crate::Checkpointer::put_writes): a new key is
/// appended; a repeated key keeps the stored write, unless its channel is special, in
/// which case the new write replaces it in place.
pub fn merge_writes(stored: &mut Vec<(WriteKey, PendingWrite)>, writes: Vec<PendingWrite>) {
    let keys = write_keys(&writes);
    for (key, write) in keys.into_iter().zip(writes) {
        match stored.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => {
                if write.is_special() {
                    *existing = write;
                }
            }
            None => stored.push((key, write)),
        }
    }
}

/// The cutoff of [`Checkpointer::sweep_idle`](crate::Checkpointer::sweep_idle): the
/// smallest checkpoint id made `idle_for` ago by this machine's clock (millisecond
/// resolution). A checkpoint is older than `idle_for` exactly when its id sorts below
/// the cutoff, so a thread is idle when the head of every one of its namespaces does;
/// backends compare stored ids with it (a range scan on an index of heads) instead of
/// decoding timestamps.
///
/// An `idle_for` longer than the time since 1970 gives the smallest v7 id, below which
/// nothing sorts: nothing is idle.
///
/// ```
/// use std::time::Duration;
/// use keel_checkpoint::CheckpointId;
/// use keel_checkpoint::support::idle_cutoff;
///
/// let cutoff = idle_cutoff(Duration::from_secs(3600));
/// let old: CheckpointId = "01890a5d-ac96-774b-bcce-b302099a8057".parse()?; // June 2023
/// assert!(old < cutoff);
/// assert!(CheckpointId::new() > cutoff);
/// assert!(idle_cutoff(Duration::MAX) <= old);
/// # Ok::<(), keel_checkpoint::ParseCheckpointIdError>(())
/// ```
pub fn idle_cutoff(idle_for: Duration) -> CheckpointId {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let millis = now.saturating_sub(idle_for.as_millis());
    CheckpointId::floor_at(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// The ids of threads idle for longer than `idle_for` (no checkpoint since, over
/// every namespace), at most `limit`, in byte order of their ids: the threads
/// [`Checkpointer::sweep_idle`](crate::Checkpointer::sweep_idle) would delete now, read
/// without deleting them (for a sweep that must first ask someone else, as a fleet's
/// queue, whether a thread is in use). Pages through
/// [`Checkpointer::list_threads`](crate::Checkpointer::list_threads).
///
/// ```
/// use std::time::Duration;
/// use keel_checkpoint::support::idle_threads;
/// use keel_checkpoint::MemorySaver;
///
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// let saver = MemorySaver::new();
/// assert!(idle_threads(&saver, Duration::from_secs(60), 100).await?.is_empty());
/// # Ok::<(), keel_checkpoint::CheckpointError>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub async fn idle_threads<C: crate::Checkpointer + ?Sized>(
    saver: &C,
    idle_for: Duration,
    limit: usize,
) -> Result<Vec<String>, CheckpointError> {
    const PAGE: usize = 500;
    let cutoff = idle_cutoff(idle_for);
    // The `limit` smallest ids in byte order, as a sweep's list is sorted (a
    // database's collation may order the pages otherwise), never more held.
    let mut idle = BTreeSet::new();
    let mut after: Option<String> = None;
    loop {
        let page = saver.list_threads(after.as_deref(), PAGE).await?;
        let done = page.len() < PAGE;
        after = page.last().map(|t| t.thread_id.clone());
        for t in page.into_iter().filter(|t| t.head < cutoff) {
            idle.insert(t.thread_id);
            if idle.len() > limit {
                idle.pop_last();
            }
        }
        if done || after.is_none() {
            return Ok(idle.into_iter().collect());
        }
    }
}

/// Where a stored delta's chain goes next: its version's `seq`, whether it holds a
/// snapshot (its chain starts there), and the version it applies to (writer id and
/// `seq`).
///
/// A delta's link never changes once it is stored, and its key (namespace, channel,
/// writer id) is never reused, since checkpoint ids are fresh. So a remembered link is
/// either right or about a delta that is gone; see [`DeltaLinks`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeltaLink {
    /// The delta's version `seq`.
    pub seq: u64,
    /// Whether the delta holds a snapshot.
    pub snapshot: bool,
    /// The version it applies to: writer id and `seq`.
    pub base: Option<(String, u64)>,
}

impl DeltaLink {
    /// A link.
    pub fn new(seq: u64, snapshot: bool, base: Option<(String, u64)>) -> Self {
        DeltaLink {
            seq,
            snapshot,
            base,
        }
    }

    /// The link of `delta`.
    pub fn of(delta: &ChannelDelta) -> Self {
        DeltaLink {
            seq: delta.version.seq,
            snapshot: delta.snapshot.is_some(),
            base: delta
                .base
                .as_ref()
                .map(|b| (b.writer.as_str().to_owned(), b.seq)),
        }
    }
}

/// What a saver remembers of the delta chains it stored, so that a prune can walk the
/// chains of the checkpoints it keeps ([`walk_chains`]) without reading each delta's
/// base back from storage.
///
/// Per namespace, channel and writer id: the [`DeltaLink`] of each delta this saver
/// put, at most `capacity` in all. Past that, the links of the namespaces put to
/// least recently are forgotten until a quarter of the room is free (a prune of such
/// a namespace then reads what it needs from storage, as without this memory), so the
/// threads that are running keep theirs however many others came before them. A prune follows links
/// only from the checkpoints it keeps, whose deltas are stored, so links of deltas
/// that another process deleted are never reached. Drop the links of the deltas a
/// prune deletes ([`retain`](Self::retain)) and of deleted threads
/// ([`forget_thread`](Self::forget_thread)) to keep the memory to what is stored.
///
/// ```
/// use keel_checkpoint::support::{DeltaLinks, walk_chains};
/// use keel_checkpoint::*;
/// use serde_json::json;
///
/// let thread = ThreadKey::new("t");
/// let first = Checkpoint::new(None);
/// let second = Checkpoint::successor(&first);
/// let v1 = ChannelVersion::new(1, first.id.clone());
/// let v2 = ChannelVersion::new(2, second.id.clone());
/// let put = |checkpoint: &Checkpoint, version: &ChannelVersion, base: Option<ChannelVersion>| {
///     let mut checkpoint = checkpoint.clone();
///     checkpoint.channel_versions.insert("log".into(), version.clone());
///     PutRequest {
///         thread: thread.clone(),
///         checkpoint,
///         metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
///         deltas: vec![ChannelDelta {
///             channel: "log".into(),
///             version: version.clone(),
///             base,
///             updates: vec![json!("x")],
///             snapshot: None,
///         }],
///         expected_head: None,
///     }
/// };
/// let mut links = DeltaLinks::new(65_536);
/// links.remember(&put(&first, &v1, None)); // once each put committed
/// links.remember(&put(&second, &v2, Some(v1.clone())));
///
/// // The newest checkpoint's chain of `log` reaches both deltas.
/// let tips = [("log".to_owned(), second.id.as_str().to_owned())];
/// let reached = walk_chains(tips, |channel, writer| {
///     links.get(&thread, channel, writer).cloned().map(Some).ok_or("not remembered")
/// })?;
/// assert_eq!(reached["log"].len(), 2);
/// # Ok::<(), &str>(())
/// ```
#[derive(Debug, Clone)]
pub struct DeltaLinks {
    threads: HashMap<ThreadKey, ThreadLinks>,
    len: usize,
    capacity: usize,
    /// Counts puts; each namespace keeps the count of its latest.
    clock: u64,
}

/// One namespace's links, and when it was last put to.
#[derive(Debug, Clone, Default)]
struct ThreadLinks {
    used: u64,
    channels: HashMap<String, HashMap<String, DeltaLink>>,
}

impl ThreadLinks {
    fn len(&self) -> usize {
        self.channels.values().map(HashMap::len).sum()
    }
}

impl DeltaLinks {
    /// Remembers up to `capacity` links.
    pub fn new(capacity: usize) -> Self {
        DeltaLinks {
            threads: HashMap::new(),
            len: 0,
            capacity,
            clock: 0,
        }
    }

    /// Makes room for `more` links: when they would not fit, forgets the namespaces
    /// put to least recently (never `keep`) until a quarter of the room is free.
    fn make_room(&mut self, keep: &ThreadKey, more: usize) {
        if self.len + more <= self.capacity {
            return;
        }
        let target = (self.capacity - self.capacity / 4).saturating_sub(more);
        let mut by_age: Vec<(u64, ThreadKey)> = self
            .threads
            .iter()
            .filter(|(k, _)| *k != keep)
            .map(|(k, t)| (t.used, k.clone()))
            .collect();
        by_age.sort_unstable_by_key(|(used, _)| *used);
        for (_, key) in by_age {
            if self.len <= target {
                break;
            }
            if let Some(gone) = self.threads.remove(&key) {
                self.len -= gone.len();
            }
        }
        if self.len + more > self.capacity {
            // Only `keep`'s own links are left, and too many: start it afresh.
            if let Some(gone) = self.threads.remove(keep) {
                self.len -= gone.len();
            }
        }
    }

    /// Records the links of `request`'s deltas, once it is stored or being stored in a
    /// transaction. Links of a put that then rolls back are harmless: no stored delta's
    /// base names a delta that was never stored, so no walk reaches them.
    pub fn remember(&mut self, request: &PutRequest) {
        if request.deltas.len() > self.capacity {
            return;
        }
        self.make_room(&request.thread, request.deltas.len());
        self.clock += 1;
        let thread = self.threads.entry(request.thread.clone()).or_default();
        thread.used = self.clock;
        for delta in &request.deltas {
            let writers = thread.channels.entry(delta.channel.clone()).or_default();
            if writers
                .insert(
                    delta.version.writer.as_str().to_owned(),
                    DeltaLink::of(delta),
                )
                .is_none()
            {
                self.len += 1;
            }
        }
    }

    /// Records the link of one stored delta, say one read back from storage.
    pub fn learn(&mut self, thread: &ThreadKey, channel: String, writer: String, link: DeltaLink) {
        if self.capacity == 0 {
            return;
        }
        self.make_room(thread, 1);
        let known = self
            .threads
            .entry(thread.clone())
            .or_default()
            .channels
            .entry(channel)
            .or_default()
            .insert(writer, link);
        if known.is_none() {
            self.len += 1;
        }
    }

    /// The link of the delta of `channel` written by `writer` in `thread`, if known.
    pub fn get(&self, thread: &ThreadKey, channel: &str, writer: &str) -> Option<&DeltaLink> {
        self.threads.get(thread)?.channels.get(channel)?.get(writer)
    }

    /// Keeps, of `thread`'s links, those for which `keep(channel, writer)` holds.
    pub fn retain(&mut self, thread: &ThreadKey, keep: impl Fn(&str, &str) -> bool) {
        let Some(channels) = self.threads.get_mut(thread).map(|t| &mut t.channels) else {
            return;
        };
        let mut removed = 0;
        for (channel, writers) in channels.iter_mut() {
            let before = writers.len();
            writers.retain(|writer, _| keep(channel, writer));
            removed += before - writers.len();
        }
        channels.retain(|_, writers| !writers.is_empty());
        if channels.is_empty() {
            self.threads.remove(thread);
        }
        self.len -= removed;
    }

    /// After a prune of `thread` committed: forgets the links of the deltas it deleted,
    /// those written before `cutoff` (the oldest kept checkpoint's id; `None` when
    /// none is kept, and every link goes) that no kept chain reached ([`walk_chains`]).
    pub fn forget_pruned(
        &mut self,
        thread: &ThreadKey,
        cutoff: Option<&str>,
        reached: &HashMap<String, HashSet<String>>,
    ) {
        match cutoff {
            None => self.forget(thread),
            Some(cutoff) => self.retain(thread, |channel, writer| {
                writer >= cutoff || reached.get(channel).is_some_and(|w| w.contains(writer))
            }),
        }
    }

    /// Forgets one namespace's links.
    pub fn forget(&mut self, thread: &ThreadKey) {
        self.retain(thread, |_, _| false);
    }

    /// Forgets the links of every namespace of `thread_id`.
    pub fn forget_thread(&mut self, thread_id: &str) {
        let keys: Vec<ThreadKey> = self
            .threads
            .keys()
            .filter(|k| k.thread_id == thread_id)
            .cloned()
            .collect();
        for key in keys {
            self.forget(&key);
        }
    }

    /// Links remembered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no link is remembered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The deltas the chains starting at `tips` reach, as writer ids per channel: the
/// walk of [`build_chain`], back along base links to the newest snapshot or a delta
/// without a base, each `(channel, writer)` visited once however many tips share it.
///
/// `tips` are `(channel, writer id)` pairs, say every channel version of the
/// checkpoints a prune keeps. `link(channel, writer)` gives a delta's link; `None`
/// (a missing delta) ends that chain, and an error ends the walk. A base whose `seq`
/// is not below its delta's ends the chain too ([`build_chain`] reports both as
/// corrupt).
pub fn walk_chains<E>(
    tips: impl IntoIterator<Item = (String, String)>,
    mut link: impl FnMut(&str, &str) -> Result<Option<DeltaLink>, E>,
) -> Result<HashMap<String, HashSet<String>>, E> {
    let mut reached: HashMap<String, HashSet<String>> = HashMap::new();
    for (channel, mut writer) in tips {
        let seen = reached.entry(channel.clone()).or_default();
        while !seen.contains(&writer) {
            let Some(found) = link(&channel, &writer)? else {
                break; // a missing delta ends the chain
            };
            seen.insert(writer);
            match found {
                DeltaLink {
                    snapshot: false,
                    base: Some((base, base_seq)),
                    seq,
                } if base_seq < seq => writer = base,
                _ => break,
            }
        }
    }
    Ok(reached)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use serde_json::json;

    use super::*;
    use crate::types::{Checkpoint, CheckpointSource};

    fn delta(
        writer: &CheckpointId,
        seq: u64,
        base: Option<&ChannelDelta>,
        updates: Vec<serde_json::Value>,
        snapshot: Option<serde_json::Value>,
    ) -> ChannelDelta {
        ChannelDelta {
            channel: "c".into(),
            version: ChannelVersion::new(seq, writer.clone()),
            base: base.map(|b| b.version.clone()),
            updates,
            snapshot,
        }
    }

    fn chain_of(
        deltas: &[ChannelDelta],
        head: &ChannelDelta,
    ) -> Result<ChannelChain, CheckpointError> {
        build_chain("c", &head.version, |w| {
            Ok(deltas.iter().find(|d| d.version.writer == *w))
        })
    }

    #[test]
    fn chain_stops_at_newest_snapshot() {
        let ids: Vec<CheckpointId> = (0..4).map(|_| CheckpointId::new()).collect();
        let d0 = delta(&ids[0], 1, None, vec![json!(1)], Some(json!([1])));
        let d1 = delta(&ids[1], 2, Some(&d0), vec![json!(2)], None);
        let d2 = delta(
            &ids[2],
            3,
            Some(&d1),
            vec![json!(3)],
            Some(json!([1, 2, 3])),
        );
        let d3 = delta(&ids[3], 4, Some(&d2), vec![json!(4), json!(5)], None);
        let all = [d0.clone(), d1.clone(), d2.clone(), d3.clone()];
        let chain = chain_of(&all, &d3).unwrap();
        assert_eq!(chain.snapshot, Some(json!([1, 2, 3])));
        assert_eq!(chain.deltas, vec![vec![json!(4), json!(5)]]);
        let chain = chain_of(&all, &d2).unwrap();
        assert_eq!(chain.snapshot, Some(json!([1, 2, 3])));
        assert!(chain.deltas.is_empty());
        let chain = chain_of(&all, &d1).unwrap();
        assert_eq!(chain.snapshot, Some(json!([1])));
        assert_eq!(chain.deltas, vec![vec![json!(2)]]);
    }

    #[test]
    fn missing_or_mismatched_delta_is_corrupt() {
        let a = CheckpointId::new();
        let b = CheckpointId::new();
        let d0 = delta(&a, 1, None, vec![], None);
        let d1 = delta(&b, 2, Some(&d0), vec![], None);
        let err = chain_of(std::slice::from_ref(&d1), &d1).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        let mut wrong = d0.clone();
        wrong.version.seq = 7;
        let err = chain_of(&[wrong, d1.clone()], &d1).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn merge_keeps_ordinary_and_replaces_special() {
        let mut stored = Vec::new();
        merge_writes(
            &mut stored,
            vec![
                PendingWrite::new("t", "p", "a", json!(1)),
                PendingWrite::new("t", "p", PendingWrite::ERROR, json!("boom")),
            ],
        );
        merge_writes(
            &mut stored,
            vec![
                PendingWrite::new("t", "p", "a", json!(99)),
                PendingWrite::new("t", "p", PendingWrite::ERROR, json!("boom again")),
                PendingWrite::new("u", "q", "a", json!(2)),
            ],
        );
        let values: Vec<_> = stored.iter().map(|(_, w)| w.value.clone()).collect();
        assert_eq!(values, vec![json!(1), json!("boom again"), json!(2)]);
    }

    fn links_request(
        thread: &ThreadKey,
        parent: Option<&Checkpoint>,
        channels: &[&str],
    ) -> PutRequest {
        let mut checkpoint = parent.map_or_else(|| Checkpoint::new(None), Checkpoint::successor);
        let mut deltas = Vec::new();
        for channel in channels {
            let base = checkpoint.channel_versions.get(*channel).cloned();
            let version = ChannelVersion::new(
                base.as_ref().map_or(1, |b| b.seq + 1),
                checkpoint.id.clone(),
            );
            checkpoint
                .channel_versions
                .insert((*channel).to_owned(), version.clone());
            deltas.push(ChannelDelta {
                channel: (*channel).to_owned(),
                version,
                base,
                updates: vec![json!(1)],
                snapshot: None,
            });
        }
        PutRequest {
            thread: thread.clone(),
            checkpoint,
            metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
            deltas,
            expected_head: parent.map(|p| p.id.clone()),
        }
    }

    #[test]
    fn head_versions_follow_each_put_of_a_namespace_and_start_over_past_capacity() {
        let t = ThreadKey::new("t");
        let mut heads = HeadVersions::new(1);
        let first = links_request(&t, None, &["a", "b"]);
        heads.remember(&first);
        // The second put rewrites `a` and carries `b` over: only `b` is vouched for.
        let second = links_request(&t, Some(&first.checkpoint), &["a"]);
        assert!(heads.to_check(&second).is_empty());
        heads.remember(&second);
        // A put after the second: its versions are the second's, updated in place.
        let mut third = links_request(&t, Some(&second.checkpoint), &["c"]);
        assert!(heads.to_check(&third).is_empty());
        // A version the head never had is checked, as is everything once the head
        // is not the expected one.
        third.checkpoint.channel_versions.insert(
            "b".into(),
            ChannelVersion::new(7, first.checkpoint.id.clone()),
        );
        assert_eq!(heads.to_check(&third).len(), 1);
        let stale = links_request(&t, Some(&first.checkpoint), &["c"]);
        assert_eq!(heads.to_check(&stale).len(), 2);
        // A second namespace past the capacity of one: the first is forgotten.
        let other = ThreadKey::new("u");
        heads.remember(&links_request(&other, None, &["a"]));
        let fourth = links_request(&t, Some(&second.checkpoint), &["c"]);
        assert_eq!(heads.to_check(&fourth).len(), 2);
    }

    #[test]
    fn links_follow_bases_and_are_forgotten_with_their_deltas() {
        let t = ThreadKey::new("t");
        let mut links = DeltaLinks::new(100);
        let first = links_request(&t, None, &["a", "b"]);
        let second = links_request(&t, Some(&first.checkpoint), &["a"]);
        links.remember(&first);
        links.remember(&second);
        assert_eq!(links.len(), 3);
        let a2 = links
            .get(&t, "a", second.checkpoint.id.as_str())
            .unwrap()
            .clone();
        assert_eq!(
            a2,
            DeltaLink {
                seq: 2,
                snapshot: false,
                base: Some((first.checkpoint.id.as_str().to_owned(), 1)),
            }
        );
        assert!(links.get(&t, "b", second.checkpoint.id.as_str()).is_none());
        assert!(
            links
                .get(
                    &ThreadKey::new("t").with_ns("sub"),
                    "a",
                    second.checkpoint.id.as_str()
                )
                .is_none()
        );

        let keep = second.checkpoint.id.as_str().to_owned();
        links.retain(&t, |_, writer| writer == keep);
        assert_eq!(links.len(), 1);
        assert!(links.get(&t, "a", first.checkpoint.id.as_str()).is_none());
        links.forget_thread("t");
        assert_eq!(links.len(), 0);
        assert!(links.threads.is_empty());
    }

    #[test]
    fn over_capacity_one_namespace_past_it_starts_afresh() {
        let mut links = DeltaLinks::new(3);
        let t = ThreadKey::new("t");
        let first = links_request(&t, None, &["a", "b"]);
        links.remember(&first);
        let second = links_request(&t, Some(&first.checkpoint), &["a", "b"]);
        links.remember(&second);
        assert_eq!(links.len(), 2, "the first two were dropped to make room");
        assert!(links.get(&t, "a", first.checkpoint.id.as_str()).is_none());
        assert!(links.get(&t, "a", second.checkpoint.id.as_str()).is_some());
        let mut none = DeltaLinks::new(0);
        none.remember(&second);
        assert_eq!(none.len(), 0);
    }

    #[test]
    fn over_capacity_the_namespaces_put_to_least_recently_are_forgotten() {
        // Room for 8 links; each put remembers 2.
        let mut links = DeltaLinks::new(8);
        let keys: Vec<ThreadKey> = ["a", "b", "c", "d"].map(ThreadKey::new).to_vec();
        let mut last = Vec::new();
        for k in &keys {
            let r = links_request(k, None, &["x", "y"]);
            links.remember(&r);
            last.push(r);
        }
        assert_eq!(links.len(), 8);
        // `a` is put to again, past the room: `b` and `c`, put to least recently, are
        // forgotten until a quarter of it is free; a fifth namespace then fits.
        let again = links_request(&keys[0], Some(&last[0].checkpoint), &["x"]);
        links.remember(&again);
        let e = ThreadKey::new("e");
        links.remember(&links_request(&e, None, &["x", "y"]));
        let has =
            |k: &ThreadKey, r: &PutRequest| links.get(k, "x", r.checkpoint.id.as_str()).is_some();
        assert!(
            has(&keys[0], &again) && has(&keys[0], &last[0]),
            "a is kept"
        );
        assert!(
            !has(&keys[1], &last[1]),
            "b, the least recent, is forgotten"
        );
        assert!(!has(&keys[2], &last[2]), "c too, to free a quarter");
        assert!(has(&keys[3], &last[3]), "d is kept");
        assert_eq!(links.len(), 3 + 2 + 2);
        assert!(links.len() <= 8);
    }

    #[test]
    fn a_walk_stops_at_snapshots_missing_deltas_and_bad_seqs_and_visits_each_delta_once() {
        let link = |seq, snapshot, base: Option<(&str, u64)>| {
            DeltaLink::new(seq, snapshot, base.map(|(w, s)| (w.to_owned(), s)))
        };
        // log: d <- c <- b(snapshot) <- a; x: q <- p (missing); y: r claims base s at seq 9.
        let stored: HashMap<(&str, &str), DeltaLink> = [
            (("log", "a"), link(1, false, None)),
            (("log", "b"), link(2, true, Some(("a", 1)))),
            (("log", "c"), link(3, false, Some(("b", 2)))),
            (("log", "d"), link(4, false, Some(("c", 3)))),
            (("x", "q"), link(2, false, Some(("p", 1)))),
            (("y", "r"), link(5, false, Some(("s", 9)))),
            (("y", "s"), link(9, false, None)),
        ]
        .into_iter()
        .collect();
        let mut lookups = Vec::new();
        let tips = [("log", "d"), ("log", "c"), ("x", "q"), ("y", "r")]
            .map(|(c, w)| (c.to_owned(), w.to_owned()));
        let reached = walk_chains(tips, |channel, writer| {
            lookups.push(format!("{channel}/{writer}"));
            Ok::<_, ()>(stored.get(&(channel, writer)).cloned())
        })
        .unwrap();
        let names = |c: &str| {
            let mut w: Vec<&str> = reached[c].iter().map(String::as_str).collect();
            w.sort_unstable();
            w
        };
        assert_eq!(names("log"), ["b", "c", "d"], "the snapshot ends the chain");
        assert_eq!(names("x"), ["q"], "a missing base ends the chain");
        assert_eq!(names("y"), ["r"], "a base seq not below ends the chain");
        assert_eq!(
            lookups,
            ["log/d", "log/c", "log/b", "x/q", "x/p", "y/r"],
            "the second tip of `log` was walked already"
        );
        let failed = walk_chains([("log".to_owned(), "d".to_owned())], |_, _| Err("gone"));
        assert_eq!(failed, Err("gone"));
    }
}
