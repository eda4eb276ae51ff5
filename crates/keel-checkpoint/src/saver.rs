//! The `Checkpointer` trait.

use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::CheckpointError;
use crate::id::{CheckpointId, ThreadKey};
use crate::types::{CheckpointSummary, CheckpointTuple, ListOptions, PendingWrite, PutRequest};

/// Stores checkpoints, their channel deltas and pending writes, per thread and namespace.
///
/// Every backend (memory, SQLite, Postgres) implements this contract and passes the
/// conformance suite (`keel_checkpoint::conformance`, feature `conformance`). The
/// methods in brief:
///
/// * [`put`](Self::put) stores a checkpoint and the deltas its step wrote, atomically,
///   if and only if the writer's `expected_head` is still the thread's newest checkpoint;
/// * [`get`](Self::get) returns a checkpoint with one [`ChannelChain`](crate::ChannelChain)
///   per channel and the writes stored against it;
/// * [`put_writes`](Self::put_writes) saves a task's writes before the step's checkpoint;
/// * [`list`](Self::list), [`delete_thread`](Self::delete_thread) and
///   [`prune`](Self::prune) manage history.
///
/// "Newest" means greatest [`CheckpointId`]; `put` refuses an id that does not sort
/// after the current head, so id order and put order agree.
#[async_trait]
pub trait Checkpointer: Send + Sync + 'static {
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
}
