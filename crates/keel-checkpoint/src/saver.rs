//! The `Checkpointer` trait.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::CheckpointError;
use crate::id::{CheckpointId, ThreadKey};
use crate::types::{
    CheckpointSummary, CheckpointTuple, ListOptions, PendingWrite, PutRequest, ThreadInfo,
};

/// Stores checkpoints, their channel deltas and pending writes, per thread and namespace.
///
/// Every backend (memory, SQLite, Postgres) implements this contract and passes the
/// conformance suite (`keel_checkpoint::conformance`, feature `conformance`). The
/// methods in brief:
///
/// * [`put`](Self::put) stores a checkpoint and the deltas its step wrote, atomically,
///   if and only if the writer's `expected_head` is still the thread's newest checkpoint;
/// * [`put_many`](Self::put_many) stores several in order (one transaction where
///   the backend can);
/// * [`get`](Self::get) returns a checkpoint with one [`ChannelChain`](crate::ChannelChain)
///   per channel and the writes stored against it;
/// * [`put_writes`](Self::put_writes) saves a task's writes before the step's checkpoint;
/// * [`list`](Self::list), [`delete_thread`](Self::delete_thread),
///   [`prune`](Self::prune) and [`sweep_idle`](Self::sweep_idle) (a TTL sweep of idle
///   threads) manage history.
///
/// "Newest" means greatest [`CheckpointId`]; `put` refuses an id that does not sort
/// after the current head, so id order and put order agree.
///
/// An implementation puts [`#[async_trait]`](crate::async_trait) (re-exported here) on
/// its `impl` block; a wrapper that forwards to another checkpointer should forward
/// [`is_durable`](Self::is_durable) too.
#[async_trait]
pub trait Checkpointer: Send + Sync + 'static {
    /// Whether what this checkpointer stores outlives the process: true for a file or
    /// a database server, false for [`MemorySaver`](crate::MemorySaver) and an
    /// in-memory SQLite database. The default is true.
    ///
    /// keel-agent reads it to refuse a durable agent whose offload store is the
    /// in-memory default: a thread resumed in another process would find its
    /// checkpoints but not what they archived.
    ///
    /// ```
    /// use keel_checkpoint::{Checkpointer, MemorySaver};
    ///
    /// assert!(!MemorySaver::new().is_durable());
    /// ```
    fn is_durable(&self) -> bool {
        true
    }

    /// The newest checkpoint of `thread` (`id` = `None`) or exactly checkpoint `id`,
    /// with its channel chains and pending writes; `Ok(None)` if absent.
    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError>;

    /// The checkpoints of `thread` (one namespace), newest first, filtered by `options`.
    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>>;

    /// Stores a checkpoint and its channel deltas atomically.
    ///
    /// Fencing (invariant 7): `request.expected_head` must equal the thread's current
    /// newest checkpoint id (`None` = the thread has none), or the put fails with
    /// [`CheckpointError::Conflict`] and nothing is written. A fork from an old
    /// checkpoint sets `checkpoint.parent` to the old one but `expected_head` to the
    /// current head.
    ///
    /// Also refused with [`CheckpointError::Invalid`], writing nothing: a request that
    /// fails [`support::validate_put`](crate::support::validate_put); a checkpoint id
    /// that does not sort after the current head; a base version, or an unchanged
    /// channel version, whose delta is not stored.
    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError>;

    /// Stores `requests` in order, each as [`put`](Self::put) would (same fencing, same
    /// checks), so a request may build on the one before it in the batch.
    ///
    /// On the first request that fails, returns its error: the requests before it are
    /// stored, it and those after it are not. An empty batch does nothing.
    ///
    /// A backend may commit the whole batch at once (keel's SQLite backend does: one
    /// transaction instead of one per checkpoint), so a crash during the call stores a
    /// prefix of the batch, possibly none of it. Graphs run with
    /// `Durability::Async` hand their queued checkpoints to this method. The default
    /// implementation calls `put` for each request.
    ///
    /// ```
    /// use keel_checkpoint::*;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), CheckpointError> {
    /// let saver = MemorySaver::new();
    /// let thread = ThreadKey::new("t");
    /// let first = Checkpoint::new(None);
    /// let second = first.successor();
    /// let put = |checkpoint: &Checkpoint, expected_head: Option<CheckpointId>| PutRequest {
    ///     thread: thread.clone(),
    ///     checkpoint: checkpoint.clone(),
    ///     metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
    ///     deltas: vec![],
    ///     expected_head,
    /// };
    /// saver
    ///     .put_many(vec![put(&first, None), put(&second, Some(first.id.clone()))])
    ///     .await?;
    /// let head = saver.get(&thread, None).await?.expect("stored");
    /// assert_eq!(head.checkpoint.id, second.id);
    /// # Ok(())
    /// # }
    /// ```
    async fn put_many(&self, requests: Vec<PutRequest>) -> Result<(), CheckpointError> {
        for request in requests {
            self.put(request).await?;
        }
        Ok(())
    }

    /// Stores writes that tasks made during the step after `checkpoint`.
    ///
    /// Idempotent per key `(task_id, channel, index)`, where `index` counts the writes
    /// of the same task to the same channel within this call (see
    /// [`support::write_keys`](crate::support::write_keys)). Putting a key again keeps
    /// the stored write, except on the special channels
    /// ([`PendingWrite::is_special`]), where the new value replaces it in place.
    /// Fails with [`CheckpointError::NotFound`] if the checkpoint is not stored.
    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError>;

    /// Deletes every namespace of thread `thread_id`: checkpoints, deltas and writes.
    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError>;

    /// Keeps the newest `keep_last` checkpoints of `thread` (one namespace) and every
    /// delta and snapshot they need to rebuild; deletes the other checkpoints, their
    /// writes, and deltas no kept checkpoint needs. Returns how many checkpoints were
    /// removed. `keep_last = 0` empties the namespace.
    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError>;

    /// A TTL sweep: deletes up to `limit` idle threads and returns their ids. A thread
    /// is idle when its newest checkpoint, over all its namespaces, is older than
    /// `idle_for`; it goes as [`delete_thread`](Self::delete_thread) takes it, every
    /// namespace with its checkpoints, deltas and writes.
    ///
    /// **Age** is read from checkpoint ids (UUID v7: the millisecond the writer made the
    /// id, see [`CheckpointId::timestamp_millis`]), in every backend alike, against this
    /// machine's clock: a thread is idle when the head of each of its namespaces sorts
    /// below [`support::idle_cutoff(idle_for)`](crate::support::idle_cutoff). Only
    /// checkpoints count: [`put_writes`](Self::put_writes) during a long step does
    /// not, so `idle_for` should be well above the longest step. A head whose id is
    /// ahead of this clock (a writer's clock running fast) keeps its thread until the
    /// clock passes it by `idle_for`.
    ///
    /// **Bounded**: one call deletes at most `limit` threads, so sweeping millions is a
    /// loop of calls, each a bounded amount of work (SQLite: one write transaction;
    /// Postgres: one short transaction per thread). A call that returns fewer than
    /// `limit` ids found no other idle thread; `limit = 0` deletes nothing. Which idle
    /// threads a call takes when there are more, and the order of the ids, are up to
    /// the backend.
    ///
    /// **Concurrency**: a thread that gets a new checkpoint before the sweep reaches it
    /// is kept (each thread is checked again as it is deleted). A writer that read a
    /// swept thread's head before it was deleted gets [`CheckpointError::Conflict`] on
    /// its next put, as after `delete_thread`.
    ///
    /// **Checkpoints only**: what else a thread has (an agent's archive and offloaded
    /// results, a fleet's runs) stays. keel-agent's `Agent::sweep_idle` deletes the
    /// offloaded files of the threads it sweeps, and keel-fleet's `Queue::sweep_idle`
    /// also keeps the threads with a run queued or running.
    ///
    /// The default implementation fails with [`CheckpointError::Unsupported`] and
    /// deletes nothing, so backends written before this method existed still compile;
    /// keel's backends (memory, SQLite, Postgres) all implement it and pass the
    /// conformance check `sweep_idle`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_checkpoint::*;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), CheckpointError> {
    /// let saver = MemorySaver::new();
    /// // A thread last written in June 2023, and one written now.
    /// let old: CheckpointId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().expect("a v7 id");
    /// for (thread, id) in [("old", old), ("new", CheckpointId::new())] {
    ///     let mut checkpoint = Checkpoint::new(None);
    ///     checkpoint.id = id;
    ///     saver
    ///         .put(PutRequest {
    ///             thread: ThreadKey::new(thread),
    ///             checkpoint,
    ///             metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
    ///             deltas: vec![],
    ///             expected_head: None,
    ///         })
    ///         .await?;
    /// }
    ///
    /// // Delete the threads idle for 30 days, in batches of 500.
    /// let ttl = Duration::from_secs(30 * 24 * 3600);
    /// let mut swept = Vec::new();
    /// loop {
    ///     let batch = saver.sweep_idle(ttl, 500).await?;
    ///     let done = batch.len() < 500;
    ///     swept.extend(batch);
    ///     if done {
    ///         break;
    ///     }
    /// }
    /// assert_eq!(swept, ["old"]);
    /// assert!(saver.get(&ThreadKey::new("old"), None).await?.is_none());
    /// assert!(saver.get(&ThreadKey::new("new"), None).await?.is_some());
    /// # Ok(())
    /// # }
    /// ```
    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        let _ = (idle_for, limit);
        Err(CheckpointError::Unsupported {
            operation: "sweep_idle",
        })
    }

    /// The stored threads, a page at a time: up to `limit` threads whose ids sort after
    /// `after` (byte order; `None` = from the first), ascending, each with its newest
    /// checkpoint over every namespace. Page with the last id of the previous page.
    ///
    /// Bounded: one call reads at most `limit` threads' heads (SQLite and Postgres: a
    /// range of the heads table's primary key), whatever the number of threads.
    ///
    /// The default implementation fails with [`CheckpointError::Unsupported`]; keel's
    /// backends implement it and pass the conformance check `list_threads`.
    ///
    /// ```
    /// use keel_checkpoint::*;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), CheckpointError> {
    /// let saver = MemorySaver::new();
    /// for thread in ["b", "a", "c"] {
    ///     saver
    ///         .put(PutRequest {
    ///             thread: ThreadKey::new(thread),
    ///             checkpoint: Checkpoint::new(None),
    ///             metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
    ///             deltas: vec![],
    ///             expected_head: None,
    ///         })
    ///         .await?;
    /// }
    /// let first = saver.list_threads(None, 2).await?;
    /// let ids: Vec<_> = first.iter().map(|t| t.thread_id.as_str()).collect();
    /// assert_eq!(ids, ["a", "b"]);
    /// let rest = saver.list_threads(Some("b"), 2).await?;
    /// assert_eq!(rest[0].thread_id, "c");
    /// # Ok(())
    /// # }
    /// ```
    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        let _ = (after, limit);
        Err(CheckpointError::Unsupported {
            operation: "list_threads",
        })
    }
}

#[async_trait]
impl<T: Checkpointer + ?Sized> Checkpointer for Arc<T> {
    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        (**self).get(thread, id).await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        (**self).list(thread, options)
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        (**self).put(request).await
    }

    async fn put_many(&self, requests: Vec<PutRequest>) -> Result<(), CheckpointError> {
        (**self).put_many(requests).await
    }

    fn is_durable(&self) -> bool {
        (**self).is_durable()
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        (**self).put_writes(thread, checkpoint, writes).await
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        (**self).delete_thread(thread_id).await
    }

    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        (**self).prune(thread, keep_last).await
    }

    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        (**self).sweep_idle(idle_for, limit).await
    }

    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        (**self).list_threads(after, limit).await
    }
}
