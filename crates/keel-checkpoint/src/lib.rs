//! Checkpoints: the durable history of a graph run, stored as deltas.
//!
//! A graph run advances in steps. After each step the engine saves a [`Checkpoint`]:
//! which version of each channel is current ([`ChannelVersion`]s), which versions
//! each node has seen, and the `Send` packets queued for the next step. A
//! [`Checkpointer`] stores checkpoints per thread and namespace ([`ThreadKey`]) and
//! gives them back, so a run can resume, be inspected, or fork from any point.
//!
//! Channel values are **not** stored whole each step. A step stores, per channel it
//! wrote, one [`ChannelDelta`]: the reducer updates it applied and the version they
//! apply to, plus a full snapshot when the engine chooses to include one. Deltas are
//! stored once, keyed by `(thread, ns, channel, writer checkpoint)`, and shared by
//! every later checkpoint, so storage grows with what each step writes, not with the
//! size of the state (invariant 6). Reading a checkpoint returns one [`ChannelChain`]
//! per channel: the newest snapshot on the way back (or nothing, meaning the empty
//! value) and the updates to fold onto it, oldest first. This crate never interprets
//! values: it stores JSON, and the engine's reducers do the folding.
//!
//! One writer per thread (invariant 7): every [`PutRequest`] names the head it
//! expects, and a put against any other head fails with [`CheckpointError::Conflict`]
//! having written nothing. A stale worker cannot fork a thread's history by accident.
//! [`Checkpointer::put_many`] stores several checkpoints in order, as one commit where
//! the backend can (SQLite and Postgres do); a graph run with async durability hands it
//! the checkpoints that queued up while the last write ran.
//!
//! Tasks' writes during a step are saved as they finish with
//! [`Checkpointer::put_writes`] against the checkpoint the step started from, and come
//! back in [`CheckpointTuple::pending_writes`], so a step interrupted by a crash
//! resumes without rerunning finished tasks.
//!
//! [`MemorySaver`] is the in-memory implementation. Backends (SQLite, Postgres) live in
//! their own crates and prove themselves against the same contract with the
//! `conformance` feature's suite (`keel_checkpoint::conformance::run_all`).
//!
//! # Example
//!
//! Two steps on an "append" channel, then a fork from the first one.
//!
//! ```
//! use keel_checkpoint::*;
//! use serde_json::{json, Value};
//!
//! // The engine's side: fold a chain with the channel's reducer (here: append).
//! fn value(tuple: &CheckpointTuple, channel: &str) -> Value {
//!     let chain = &tuple.channels[channel];
//!     let mut items = chain.snapshot.clone().unwrap_or(json!([]));
//!     for update in chain.updates() {
//!         items.as_array_mut().unwrap().push(update.clone());
//!     }
//!     items
//! }
//!
//! // One step: append `updates` to "log" on top of `parent`.
//! fn step(parent: Option<&Checkpoint>, updates: Vec<Value>) -> (Checkpoint, ChannelDelta) {
//!     let mut checkpoint = match parent {
//!         Some(parent) => parent.successor(),
//!         None => Checkpoint::new(None),
//!     };
//!     let base = checkpoint.channel_versions.get("log").cloned();
//!     let seq = base.as_ref().map_or(1, |v| v.seq + 1);
//!     let version = ChannelVersion::new(seq, checkpoint.id.clone());
//!     checkpoint.channel_versions.insert("log".into(), version.clone());
//!     let delta = ChannelDelta { channel: "log".into(), version, base, updates, snapshot: None };
//!     (checkpoint, delta)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), CheckpointError> {
//! let saver = MemorySaver::new();
//! let thread = ThreadKey::new("ticket-42");
//! let put = |checkpoint: Checkpoint, delta, step, expected_head| PutRequest {
//!     thread: thread.clone(),
//!     checkpoint,
//!     metadata: CheckpointMetadata::new(CheckpointSource::Loop, step),
//!     deltas: vec![delta],
//!     expected_head,
//! };
//!
//! let (first, delta) = step(None, vec![json!("plan")]);
//! saver.put(put(first.clone(), delta, 0, None)).await?;
//! let (second, delta) = step(Some(&first), vec![json!("search")]);
//! saver.put(put(second.clone(), delta, 1, Some(first.id.clone()))).await?;
//!
//! let head = saver.get(&thread, None).await?.expect("stored");
//! assert_eq!(head.checkpoint.id, second.id);
//! assert_eq!(value(&head, "log"), json!(["plan", "search"]));
//!
//! // A writer that did not see `second` is refused, and nothing is written.
//! let (stale, delta) = step(Some(&first), vec![json!("oops")]);
//! let err = saver.put(put(stale.clone(), delta, 1, Some(first.id.clone()))).await.unwrap_err();
//! assert!(err.is_conflict());
//! assert!(saver.get(&thread, Some(&stale.id)).await?.is_none());
//!
//! // A fork from `first`: parent is `first`, but the expected head is the current one.
//! // Its "log" version has the same seq (2) as `second`'s but another writer.
//! let (fork, delta) = step(Some(&first), vec![json!("ask")]);
//! saver.put(put(fork.clone(), delta, 1, Some(second.id.clone()))).await?;
//!
//! let forked = saver.get(&thread, Some(&fork.id)).await?.expect("stored");
//! assert_eq!(value(&forked, "log"), json!(["plan", "ask"]));
//! let old = saver.get(&thread, Some(&second.id)).await?.expect("stored");
//! assert_eq!(value(&old, "log"), json!(["plan", "search"]));
//! # Ok(())
//! # }
//! ```

mod error;
mod id;
mod memory;
mod saver;
pub mod support;
mod types;

#[cfg(feature = "conformance")]
pub mod conformance;

/// The attribute [`Checkpointer`] implementations put on their `impl` block.
pub use async_trait::async_trait;
pub use error::CheckpointError;
pub use id::{CheckpointId, MAX_THREAD_ID_BYTES, ParseCheckpointIdError, ThreadKey};
pub use memory::{MemorySaver, MemoryStats};
pub use saver::Checkpointer;
pub use types::{
    ChannelChain, ChannelDelta, ChannelVersion, Checkpoint, CheckpointMetadata, CheckpointSource,
    CheckpointSummary, CheckpointTuple, ListOptions, PendingWrite, PutRequest, ThreadInfo,
};
