//! The in-memory checkpointer.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
// Keys are thread ids, channel names and checkpoint ids: foldhash (randomly seeded)
// hashes them several times faster than std's SipHash.
use foldhash::{HashMap, HashMapExt, HashSet};
use futures::StreamExt;
use futures::stream::{self, BoxStream};

use crate::error::CheckpointError;
use crate::id::{CheckpointId, ThreadKey};
use crate::saver::Checkpointer;
use crate::support::{self, WriteKey};
use crate::types::{
    ChannelDelta, Checkpoint, CheckpointMetadata, CheckpointSummary, CheckpointTuple, ListOptions,
    PendingWrite, PutRequest, ThreadInfo,
};

/// A [`Checkpointer`] that keeps everything in memory, for tests, examples and
/// short-lived runs.
///
/// Cloning is cheap and clones share storage. Each delta is stored once, under
/// `(thread, ns, channel, writer)`, however many checkpoints hold its version, so
/// storage grows with what each step writes, not with the size of the state
/// (invariant 6); [`stats`](Self::stats) counts what is stored. Locks are never held
/// across an `await`.
///
/// ```
/// use keel_checkpoint::*;
/// use serde_json::json;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), CheckpointError> {
/// let saver = MemorySaver::new();
/// let thread = ThreadKey::new("t1");
/// let mut checkpoint = Checkpoint::new(None);
/// let version = ChannelVersion::new(1, checkpoint.id.clone());
/// checkpoint.channel_versions.insert("log".into(), version.clone());
/// saver
///     .put(PutRequest {
///         thread: thread.clone(),
///         checkpoint: checkpoint.clone(),
///         metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
///         deltas: vec![ChannelDelta {
///             channel: "log".into(),
///             version,
///             base: None,
///             updates: vec![json!("hello")],
///             snapshot: None,
///         }],
///         expected_head: None,
///     })
///     .await?;
/// let stored = saver.get(&thread, None).await?.unwrap();
/// assert_eq!(stored.checkpoint, checkpoint);
/// assert_eq!(stored.channels["log"].deltas, vec![vec![json!("hello")]]);
/// assert_eq!(saver.stats().update_values, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemorySaver {
    threads: Arc<RwLock<HashMap<String, HashMap<String, Space>>>>,
}

/// What a [`MemorySaver`] holds, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Threads with at least one namespace.
    pub threads: usize,
    /// `(thread, ns)` histories.
    pub namespaces: usize,
    /// Checkpoints.
    pub checkpoints: usize,
    /// Stored channel deltas.
    pub deltas: usize,
    /// Update values across all stored deltas.
    pub update_values: usize,
    /// Deltas that carry a snapshot.
    pub snapshots: usize,
    /// Pending writes across all checkpoints.
    pub pending_writes: usize,
}

/// One `(thread, ns)` history.
#[derive(Debug, Default)]
struct Space {
    /// By id, so the last entry is the head.
    checkpoints: BTreeMap<CheckpointId, Stored>,
    /// channel → writer → delta.
    deltas: HashMap<String, HashMap<CheckpointId, ChannelDelta>>,
}

#[derive(Debug)]
struct Stored {
    checkpoint: Checkpoint,
    metadata: CheckpointMetadata,
    writes: Vec<(WriteKey, PendingWrite)>,
}

impl Space {
    fn head(&self) -> Option<&CheckpointId> {
        self.checkpoints.last_key_value().map(|(id, _)| id)
    }

    fn delta(&self, channel: &str, writer: &CheckpointId) -> Option<&ChannelDelta> {
        self.deltas.get(channel).and_then(|m| m.get(writer))
    }

    fn tuple(
        &self,
        thread: &ThreadKey,
        stored: &Stored,
    ) -> Result<CheckpointTuple, CheckpointError> {
        let mut channels = BTreeMap::new();
        for (channel, version) in &stored.checkpoint.channel_versions {
            let chain =
                support::build_chain(channel, version, |writer| Ok(self.delta(channel, writer)))?;
            channels.insert(channel.clone(), chain);
        }
        Ok(CheckpointTuple {
            thread: thread.clone(),
            checkpoint: stored.checkpoint.clone(),
            metadata: stored.metadata.clone(),
            channels,
            pending_writes: stored.writes.iter().map(|(_, w)| w.clone()).collect(),
        })
    }

    /// Refusals that depend on what is stored; `Ok` means the put may go ahead.
    fn check_put(&self, request: &PutRequest) -> Result<(), CheckpointError> {
        let head = self.head();
        if head != request.expected_head.as_ref() {
            return Err(CheckpointError::Conflict {
                expected: request.expected_head.clone(),
                actual: head.cloned(),
            });
        }
        if let Some(head) = head
            && request.checkpoint.id <= *head
        {
            return Err(CheckpointError::Invalid {
                reason: format!(
                    "checkpoint id {} does not sort after the head {head}",
                    request.checkpoint.id
                ),
            });
        }
        for (channel, version) in support::referenced_versions(request) {
            match self.delta(channel, &version.writer) {
                Some(delta) if delta.version.seq == version.seq => {}
                _ => {
                    return Err(CheckpointError::Invalid {
                        reason: format!(
                            "channel {channel:?}: version {} by {} is not stored",
                            version.seq, version.writer
                        ),
                    });
                }
            }
        }
        for delta in &request.deltas {
            if self.delta(&delta.channel, &delta.version.writer).is_some() {
                return Err(CheckpointError::Invalid {
                    reason: format!(
                        "channel {:?}: a delta by {} is already stored",
                        delta.channel, delta.version.writer
                    ),
                });
            }
        }
        Ok(())
    }

    /// Drops every delta no remaining checkpoint's chain reaches.
    fn collect_garbage(&mut self) {
        let mut needed: HashMap<&str, HashSet<&CheckpointId>> = HashMap::new();
        for stored in self.checkpoints.values() {
            for (channel, version) in &stored.checkpoint.channel_versions {
                let mut writer = &version.writer;
                // Follows the same path as `build_chain`: to the newest snapshot or a
                // delta without base. A missing delta ends the walk (get reports it).
                while let Some(delta) = self.delta(channel, writer) {
                    if !needed.entry(channel).or_default().insert(writer) {
                        break; // already walked from here
                    }
                    match (&delta.snapshot, &delta.base) {
                        (None, Some(base)) if base.seq < delta.version.seq => writer = &base.writer,
                        _ => break,
                    }
                }
            }
        }
        let mut keep: HashMap<String, HashSet<CheckpointId>> = needed
            .into_iter()
            .map(|(channel, writers)| (channel.to_owned(), writers.into_iter().cloned().collect()))
            .collect();
        self.deltas.retain(|channel, by_writer| {
            let wanted = keep.remove(channel).unwrap_or_default();
            by_writer.retain(|writer, _| wanted.contains(writer));
            !by_writer.is_empty()
        });
    }
}

impl MemorySaver {
    /// An empty saver.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts what is stored.
    pub fn stats(&self) -> MemoryStats {
        let threads = self.threads.read().unwrap_or_else(PoisonError::into_inner);
        let mut stats = MemoryStats {
            threads: threads.len(),
            ..MemoryStats::default()
        };
        for space in threads.values().flat_map(HashMap::values) {
            stats.namespaces += 1;
            stats.checkpoints += space.checkpoints.len();
            stats.pending_writes += space
                .checkpoints
                .values()
                .map(|s| s.writes.len())
                .sum::<usize>();
            for delta in space.deltas.values().flat_map(HashMap::values) {
                stats.deltas += 1;
                stats.update_values += delta.updates.len();
                stats.snapshots += usize::from(delta.snapshot.is_some());
            }
        }
        stats
    }

    fn read<T>(&self, f: impl FnOnce(&HashMap<String, HashMap<String, Space>>) -> T) -> T {
        f(&self.threads.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn write<T>(&self, f: impl FnOnce(&mut HashMap<String, HashMap<String, Space>>) -> T) -> T {
        f(&mut self.threads.write().unwrap_or_else(PoisonError::into_inner))
    }
}

fn space<'m>(
    threads: &'m HashMap<String, HashMap<String, Space>>,
    thread: &ThreadKey,
) -> Option<&'m Space> {
    threads
        .get(&thread.thread_id)
        .and_then(|t| t.get(&thread.ns))
}

#[async_trait]
impl Checkpointer for MemorySaver {
    /// In memory: gone with the process.
    fn is_durable(&self) -> bool {
        false
    }

    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        self.read(|threads| {
            let Some(space) = space(threads, thread) else {
                return Ok(None);
            };
            let stored = match id {
                Some(id) => space.checkpoints.get(id),
                None => space.checkpoints.last_key_value().map(|(_, s)| s),
            };
            stored.map(|s| space.tuple(thread, s)).transpose()
        })
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        let summaries: Vec<CheckpointSummary> = self.read(|threads| {
            let Some(space) = space(threads, thread) else {
                return Vec::new();
            };
            let older = match &options.before {
                Some(before) => space.checkpoints.range(..before),
                None => space.checkpoints.range(..),
            };
            older
                .rev()
                .map(|(_, s)| s)
                .filter(|s| s.metadata.matches(&options.metadata))
                .take(options.limit.unwrap_or(usize::MAX))
                .map(|s| CheckpointSummary {
                    thread: thread.clone(),
                    checkpoint: s.checkpoint.clone(),
                    metadata: s.metadata.clone(),
                })
                .collect()
        });
        stream::iter(summaries.into_iter().map(Ok)).boxed()
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        support::validate_put(&request)?;
        self.write(|threads| {
            let existing = space(threads, &request.thread);
            match existing {
                Some(space) => space.check_put(&request)?,
                None => Space::default().check_put(&request)?,
            }
            // Every check passed: from here on nothing can fail, so the put is atomic.
            let PutRequest {
                thread,
                checkpoint,
                metadata,
                deltas,
                expected_head: _,
            } = request;
            let space = threads
                .entry(thread.thread_id)
                .or_default()
                .entry(thread.ns)
                .or_default();
            for delta in deltas {
                space
                    .deltas
                    .entry(delta.channel.clone())
                    .or_default()
                    .insert(delta.version.writer.clone(), delta);
            }
            space.checkpoints.insert(
                checkpoint.id.clone(),
                Stored {
                    checkpoint,
                    metadata,
                    writes: Vec::new(),
                },
            );
            Ok(())
        })
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        self.write(|threads| {
            let stored = threads
                .get_mut(&thread.thread_id)
                .and_then(|t| t.get_mut(&thread.ns))
                .and_then(|space| space.checkpoints.get_mut(checkpoint))
                .ok_or_else(|| CheckpointError::NotFound {
                    what: format!("checkpoint {checkpoint} of thread {thread}"),
                })?;
            support::merge_writes(&mut stored.writes, writes);
            Ok(())
        })
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        self.write(|threads| threads.remove(thread_id));
        Ok(())
    }

    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        Ok(self.write(|threads| {
            let Some(namespaces) = threads.get_mut(&thread.thread_id) else {
                return 0;
            };
            let Some(space) = namespaces.get_mut(&thread.ns) else {
                return 0;
            };
            let total = space.checkpoints.len();
            if total <= keep_last {
                return 0;
            }
            let removed = total - keep_last;
            let doomed: Vec<CheckpointId> =
                space.checkpoints.keys().take(removed).cloned().collect();
            for id in &doomed {
                space.checkpoints.remove(id);
            }
            space.collect_garbage();
            if space.checkpoints.is_empty() {
                namespaces.remove(&thread.ns);
                if namespaces.is_empty() {
                    threads.remove(&thread.thread_id);
                }
            }
            removed
        }))
    }

    /// Looks at every thread under the write lock (memory has no index to scan a
    /// range of), deleting the idle ones oldest first.
    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let cutoff = support::idle_cutoff(idle_for);
        Ok(self.write(|threads| {
            // (newest head over the namespaces, thread id) of every idle thread.
            let mut idle: Vec<(&CheckpointId, &String)> = threads
                .iter()
                .filter_map(|(thread_id, namespaces)| {
                    let newest = namespaces.values().filter_map(Space::head).max()?;
                    (*newest < cutoff).then_some((newest, thread_id))
                })
                .collect();
            if idle.len() > limit {
                idle.select_nth_unstable(limit - 1);
                idle.truncate(limit);
            }
            idle.sort_unstable();
            let doomed: Vec<String> = idle.into_iter().map(|(_, id)| id.clone()).collect();
            for thread_id in &doomed {
                threads.remove(thread_id);
            }
            doomed
        }))
    }

    /// Reads every thread under the read lock and keeps the `limit` smallest ids
    /// after `after` (memory has no ordered index).
    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        Ok(self.read(|threads| {
            let mut found: Vec<ThreadInfo> = threads
                .iter()
                .filter(|(id, _)| after.is_none_or(|a| id.as_str() > a))
                .filter_map(|(id, namespaces)| {
                    let heads: Vec<&CheckpointId> =
                        namespaces.values().filter_map(Space::head).collect();
                    let newest = heads.iter().max()?;
                    Some(ThreadInfo::new(id.clone(), (*newest).clone(), heads.len()))
                })
                .collect();
            found.sort_unstable_by(|a, b| a.thread_id.cmp(&b.thread_id));
            found.truncate(limit);
            found
        }))
    }
}
