//! A PostgreSQL [`Checkpointer`](keel_checkpoint::Checkpointer) for keel: many stateless
//! workers on many machines share one database, and fencing makes any worker safe to
//! pick up any thread.
//!
//! The one abstraction is [`PostgresSaver`]: the `keel_checkpoint` contract (fenced
//! puts, channel deltas, pending writes, history) on tokio-postgres with a deadpool
//! connection pool. Configure it with a [`PostgresConfig`] (a connection string or
//! `DATABASE_URL`; pool size, statement timeout, schema; TLS by `sslmode` with the
//! `tls` feature), create or upgrade the tables with [`PostgresSaver::setup`], and
//! hand it to a graph as its checkpointer.
//!
//! # Schema
//!
//! Four tables, every primary key led by `thread_id`, and no statement joins rows of
//! two threads, so a distributed PostgreSQL sharding by `thread_id` (Citus) takes the
//! same schema unchanged:
//!
//! | table | key | holds |
//! |---|---|---|
//! | `keel_heads` | `(thread_id, ns)` | the newest checkpoint id (`head`, also indexed for the TTL sweep) and when it was put |
//! | `keel_checkpoints` | `(thread_id, ns, checkpoint_id)` | parent, `metadata jsonb`, channel versions, versions seen, pending sends |
//! | `keel_deltas` | `(thread_id, ns, writer, channel)` | `seq`, `base` version, `updates`, optional `snapshot` |
//! | `keel_writes` | `(thread_id, ns, checkpoint_id, task_id, channel, idx)` | tasks' pending writes, in stored order |
//!
//! Channel values are stored once per step as deltas (invariant 6): `get` follows each
//! channel's `base` links back to the newest snapshot in one recursive query.
//! Values over about 2 kB are TOAST-compressed with lz4 where the server has it
//! (PostgreSQL 14 or newer built with lz4; pglz, the default, otherwise).
//! Migrations are versioned and recorded in `keel_migrations` ([`migrate`],
//! [`MIGRATIONS`]).
//!
//! # Fencing
//!
//! `put` runs one statement, the `keel_put` function: it moves the thread's head row to
//! the new checkpoint only if the head is still the writer's expected one (the `UPDATE`
//! locks the row until the put commits), checks that every version the request refers
//! to is stored, then inserts the deltas and the checkpoint. A writer whose expected head is stale gets
//! [`CheckpointError::Conflict`](keel_checkpoint::CheckpointError::Conflict) and nothing
//! of its step is written (invariant 7). Only that row is locked, only for the put:
//! there is no saver-wide lock, so throughput scales with the pool.
//!
//! # What PostgreSQL cannot store
//!
//! Text and `jsonb` cannot hold NUL (U+0000): a thread id, namespace, channel name, task
//! id or path, or a metadata key or string containing NUL is refused with
//! [`CheckpointError::Invalid`](keel_checkpoint::CheckpointError::Invalid) before anything
//! is sent. Channel values, pending writes and pending sends are stored as `json` text,
//! where NUL is an escape like any other, so they are kept verbatim. Thread ids longer
//! than [`MAX_THREAD_ID_BYTES`] and names longer than [`MAX_NAME_BYTES`] are refused
//! too (they are index keys). Every value travels as a bound parameter of a prepared
//! statement, never as SQL text.
//!
//! # Cost per step
//!
//! A step's `put` is one prepared statement, so one round trip and one commit; every
//! lookup it makes is by primary key, and `get` follows a chain link by link through
//! the primary key too, so the cost of a step does not grow with the thread's length.
//! With the server's default `synchronous_commit = on`, each commit waits for a WAL
//! flush and the disk's fsync latency bounds one thread's steps per second (many
//! threads share flushes). `synchronous_commit = off` for the session (see
//! [`PostgresConfig`]) removes that wait at the price of losing the last few commits if
//! the *database server* crashes; a crashed worker loses nothing either way.
//! `cargo xtask bench postgres` measures both, beside LangGraph's `PostgresSaver`.
//!
//! # Retention
//!
//! [`prune`](keel_checkpoint::Checkpointer::prune) keeps a thread's newest checkpoints
//! and the deltas and snapshots they need. The saver walks the kept delta chains in
//! what it remembers of its own puts (up to 65,536 links by default, a few hundred bytes each), so a
//! prune of a thread it wrote is two round trips in one transaction; chains it did not
//! write cost one more, a recursive query that reads their links back. A prune's commit
//! does not wait for the server's WAL flush (`synchronous_commit` off for that
//! transaction only): a crash can undo it, which loses nothing, as the next prune
//! deletes the same rows;
//! [`delete_thread`](keel_checkpoint::Checkpointer::delete_thread) removes a thread;
//! [`sweep_idle`](keel_checkpoint::Checkpointer::sweep_idle) deletes up to `limit`
//! threads whose newest checkpoint (by its id's time) is older than an age, found by a
//! range scan of the heads' `head` index and each deleted by thread id in its own
//! transaction, after its heads are locked and checked again.
//! [`PostgresSaver::sweep_idle`] sweeps in batches until no idle thread is left (it
//! shadows the trait's method on a `PostgresSaver`: call that one as
//! `Checkpointer::sweep_idle(&saver, ..)`).
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use keel_checkpoint::{Checkpointer, ThreadKey};
//! use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // DATABASE_URL=postgres://keel@localhost:5432/app
//! let config = PostgresConfig::from_env()?
//!     .pool_size(16)
//!     .statement_timeout(Some(Duration::from_secs(10)));
//! let saver = PostgresSaver::connect(&config)?;
//! saver.setup().await?; // idempotent; safe from many processes at once
//!
//! // Give it to a graph (`StateGraph::with_checkpointer(Arc::new(saver.clone()))`), or
//! // use it directly:
//! let thread = ThreadKey::new("ticket-42");
//! if let Some(head) = saver.get(&thread, None).await? {
//!     println!("ticket-42 is at step {}", head.metadata.step);
//! }
//! saver.prune(&thread, 10).await?;
//! // Threads idle for 30 days: 500 per call, or all of them in batches.
//! let ttl = Duration::from_secs(30 * 24 * 3600);
//! let swept: Vec<String> = Checkpointer::sweep_idle(&saver, ttl, 500).await?;
//! let more: usize = saver.sweep_idle(ttl).await?;
//! # Ok(())
//! # }
//! ```

mod codec;
mod config;
mod error;
mod saver;
mod schema;
mod sql;

pub use codec::{MAX_NAME_BYTES, MAX_THREAD_ID_BYTES};
pub use config::{DEFAULT_POOL_SIZE, DEFAULT_SCHEMA, DEFAULT_STATEMENT_TIMEOUT, PostgresConfig};
pub use error::PostgresError;
pub use saver::{PostgresSaver, ThreadStorage};
pub use schema::{MIGRATIONS, Migration, migrate};

/// The pool crate, for a pool of your own (a connector with client certificates, say)
/// at the version this crate takes.
pub use deadpool_postgres;
/// The connection pool type [`PostgresSaver::from_pool`] takes.
pub use deadpool_postgres::Pool;
/// Connection strings read as libpq reads them, and the TLS connector they ask for.
pub use keel_postgres_tls as tls;
/// The driver, at the version this crate takes.
pub use tokio_postgres;
