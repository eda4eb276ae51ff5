//! keel's embedded checkpointer: a [`Checkpointer`](keel_checkpoint::Checkpointer) that
//! keeps a graph run's checkpoints in one SQLite file, with no server.
//!
//! [`SqliteSaver`] stores what [`keel_checkpoint`] describes: per step one checkpoint row
//! (channel versions, versions seen, pending sends, metadata) and, per channel the step
//! wrote, one delta row holding the step's updates and, when the engine includes one, a
//! snapshot. A delta is stored once under `(thread_id, ns, writer, channel)` and shared by
//! every later checkpoint, so the file grows with what each step writes, not with the
//! size of the state (invariant 6). Pending writes have their own table, and a `heads`
//! table holds each namespace's newest checkpoint id, indexed by id, so
//! [`sweep_idle`](keel_checkpoint::Checkpointer::sweep_idle) (the TTL sweep) finds idle
//! threads with a range scan. Every table is keyed by thread id first. The schema is
//! versioned ([`SCHEMA_VERSION`]) and migrated when a file is opened.
//!
//! **Fencing** (invariant 7): a put runs in one `BEGIN IMMEDIATE` transaction that
//! checks the writer's expected head, checks every delta it refers to, and inserts
//! everything or nothing. A stale writer, in this process or another one on the same
//! file, gets [`CheckpointError::Conflict`](keel_checkpoint::CheckpointError::Conflict)
//! and leaves no trace.
//!
//! **Threads**: SQLite calls block, so each connection lives on a thread of its own and
//! the async methods only wait for the answer; the async runtime's threads never block on
//! the disk. There is one writer connection and, for a file, a few reader connections
//! (WAL mode lets `get` and `list` run while a put commits). Statements are prepared
//! once per connection and cached. A program on tokio's multi-thread runtime that
//! awaits the saver in no `LocalSet` can save each awaited write the two thread
//! hand-offs with [`SqliteOptions::block_in_place`]: the write then runs on the
//! caller's worker inside [`tokio::task::block_in_place`], which first hands the
//! worker's other tasks to another thread (an agent step on SQLite with
//! `Durability::Sync`: 688 → 609 µs).
//!
//! **Durability**: WAL mode with `synchronous=NORMAL` by default: a stored checkpoint
//! survives the process being killed; on power loss the newest steps may be lost (the
//! thread resumes from an earlier checkpoint), never the file's consistency.
//! [`Synchronous::Full`] flushes every commit to the disk instead; each step then waits
//! for an `fsync`, which is typically an order of magnitude slower (`cargo xtask bench
//! sqlite` measures both). The log is copied back into the file (a WAL checkpoint) on a
//! thread of its own as it grows, so no put waits for that either
//! ([`SqliteOptions::checkpoint_pages`]). See [`SqliteOptions`].
//!
//! Input is always bound as parameters, never spliced into SQL: thread ids, namespaces,
//! channel names and metadata are stored verbatim, whatever quotes, Unicode or NUL bytes
//! they hold. Storage failures (disk full, I/O errors, a file locked past the busy
//! timeout) come back as [`CheckpointError::Backend`](keel_checkpoint::CheckpointError)
//! holding a [`SqliteError`].
//!
//! The crate passes `keel_checkpoint`'s conformance suite.
//!
//! # Example
//!
//! Two steps on an "append" channel in a file, a stale writer refused, and the file
//! opened again.
//!
//! ```
//! use keel_checkpoint::*;
//! use keel_checkpoint_sqlite::SqliteSaver;
//! use serde_json::json;
//!
//! // One step on top of `parent`: append `item` to the "log" channel.
//! fn step(parent: Option<&Checkpoint>, item: &str, expected_head: Option<CheckpointId>) -> PutRequest {
//!     let mut checkpoint = parent.map_or_else(|| Checkpoint::new(None), Checkpoint::successor);
//!     let base = checkpoint.channel_versions.get("log").cloned();
//!     let version = ChannelVersion::new(base.as_ref().map_or(1, |v| v.seq + 1), checkpoint.id.clone());
//!     checkpoint.channel_versions.insert("log".into(), version.clone());
//!     let delta = ChannelDelta { channel: "log".into(), version, base, updates: vec![json!(item)], snapshot: None };
//!     let source = if parent.is_some() { CheckpointSource::Loop } else { CheckpointSource::Input };
//!     PutRequest {
//!         thread: ThreadKey::new("ticket-42"),
//!         checkpoint,
//!         metadata: CheckpointMetadata::new(source, 0),
//!         deltas: vec![delta],
//!         expected_head,
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("keel.db");
//! let saver = SqliteSaver::open(&path).await?;
//! let thread = ThreadKey::new("ticket-42");
//!
//! let first = step(None, "plan", None);
//! saver.put(first.clone()).await?;
//! let second = step(Some(&first.checkpoint), "search", Some(first.checkpoint.id.clone()));
//! saver.put(second.clone()).await?;
//!
//! // A writer that did not see `second` is refused, and nothing of it is stored.
//! let stale = step(Some(&first.checkpoint), "oops", Some(first.checkpoint.id.clone()));
//! assert!(saver.put(stale.clone()).await.unwrap_err().is_conflict());
//! assert!(saver.get(&thread, Some(&stale.checkpoint.id)).await?.is_none());
//!
//! // The head rebuilds from the deltas: no snapshot, one delta per step.
//! let head = saver.get(&thread, None).await?.expect("stored");
//! assert_eq!(head.checkpoint.id, second.checkpoint.id);
//! let log: Vec<_> = head.channels["log"].updates().cloned().collect();
//! assert_eq!(log, vec![json!("plan"), json!("search")]);
//!
//! // Closed and opened again, the file has the same state.
//! drop(saver);
//! let saver = SqliteSaver::open(&path).await?;
//! assert_eq!(saver.get(&thread, None).await?, Some(head));
//! # Ok(())
//! # }
//! ```
//!
//! With the graph engine, hand the saver to `StateGraph::with_checkpointer` (as an
//! `Arc`); every superstep of a run with a thread id is then stored in the file.

mod error;
mod options;
mod saver;
mod schema;
mod store;
mod wal;
mod worker;

pub use error::SqliteError;
pub use options::{SqliteOptions, Synchronous};
pub use saver::{SqliteSaver, SqliteStats};
pub use schema::SCHEMA_VERSION;

/// The `rusqlite` version this crate is built on (for matching
/// [`SqliteError::code`]s against [`rusqlite::ErrorCode`]).
pub use rusqlite;
