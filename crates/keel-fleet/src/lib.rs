//! A fleet of keel agents on one PostgreSQL: a durable run queue that any number of
//! stateless workers, on any number of machines, take runs from.
//!
//! The one abstraction is the **run**: "run this thread with this input" (a goal for
//! a new thread, a user's follow-up message, the answer to a pending approval),
//! stored by [`Queue::submit`] before it returns. A [`Worker`] claims runs with
//! `FOR UPDATE SKIP LOCKED`, holds each under a lease it renews (the lease expires by
//! the database's clock, `now()`, never a worker's), and runs the run's thread from
//! its last checkpoint with a keel [`Agent`](keel_agent::Agent). Everything a thread
//! has — checkpoints (keel-checkpoint-postgres), archive and offloaded results
//! (keel-offload's `PostgresStore`), runs — is in the one database, so any worker can
//! pick up any thread:
//!
//! * a worker that dies loses its leases; another takes the runs over and continues
//!   each thread from its last checkpoint. The checkpointer's fencing refuses a late
//!   write of the worker that lost the lease, and that worker stops without marking
//!   the run;
//! * at most one run per thread is running, enforced by the database (a partial unique
//!   index on `thread_id` where `status = 'running'`);
//! * a second run on a busy thread follows a [`Policy`]: [`Policy::Reject`],
//!   [`Policy::Enqueue`] or [`Policy::Interrupt`] (LangGraph's double-texting options);
//!   [`Queue::cancel`] stops a run at its next step boundary;
//! * [`Queue::status`] and [`Queue::runs`] say where a run is: queued, running (by
//!   which worker, since when, lease until when), done, failed (with the error) or
//!   cancelled; [`WorkerBuilder::on_run_end`] tells the worker's host as each of its
//!   runs ends, with the agent's error itself when one failed, and
//!   [`WorkerBuilder::on_claim_trouble`] when its claims start failing (the database
//!   went away) and when they work again;
//! * [`Queue::forget_thread`] removes a thread's runs once none is in flight (delete
//!   its checkpoints with the checkpointer), [`Queue::sweep_idle`] deletes idle
//!   threads whole but those with a run in flight (the TTL sweep for a fleet), and
//!   [`Queue::thread_ids`] pages through the threads the queue knows;
//! * the tables carry a schema version: a worker pointed at an older or newer schema
//!   gets [`FleetError::SchemaTooOld`] / [`FleetError::SchemaTooNew`] naming it. A run
//!   whose stored input does not decode is failed with the reason; a run whose workers
//!   keep dying is failed after [`QueueOptions::max_attempts`] claims.
//!
//! Every table is keyed by thread id first and the statements about one run name its
//! thread, so a distributed PostgreSQL sharded by thread id takes the schema.
//!
//! [`Queue::connect`] reads its connection string as libpq does (keel-postgres-tls).
//! With the `tls` feature (which the `keel` crate's `fleet` feature turns on), TLS
//! follows the string's `sslmode`: `?sslmode=verify-full&sslrootcert=ca.pem` for a
//! managed database. Without it, connections go without TLS, and a string that
//! requires TLS is refused with [`FleetError::ConnectionString`].
//!
//! # Example
//!
//! A worker and a submitted run on one database (the doctest needs a server, so it is
//! only compiled; `cargo run -p keel --features fleet --example fleet` runs one):
//!
//! ```no_run
//! use std::sync::Arc;
//! use keel_agent::Agent;
//! use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
//! use keel_fleet::{Queue, RunInput, RunStatus, Worker};
//! use keel_model::ScriptedModel;
//! use keel_offload::{PostgresStore, PostgresStoreOptions};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let url = "postgres://postgres@127.0.0.1:5432/app";
//! let queue = Queue::connect(url)?;
//! queue.setup().await?;
//! let saver = PostgresSaver::connect(&PostgresConfig::new(url)?)?;
//! saver.setup().await?;
//! // The archive and offloaded results, in the same database: every worker reads what
//! // any other compacted away.
//! let store = PostgresStore::connect_with_async(url, PostgresStoreOptions::new()).await?;
//!
//! // Anyone, anywhere: submit a run. It is stored when `submit` returns.
//! let run = queue
//!     .submit("ticket-42", RunInput::new().goal("Say hello."))
//!     .await?;
//!
//! // A worker (usually another process): runs threads until the queue is empty.
//! let worker = Worker::builder(queue.clone(), Arc::new(saver))
//!     .agent(
//!         Agent::builder()
//!             .model(Arc::new(ScriptedModel::from_texts(["Hello."])))
//!             .offload_store(Arc::new(store)),
//!     )
//!     .concurrency(4)
//!     .build()?;
//! worker.run_until_idle().await?;
//!
//! match queue.status(run).await?.status {
//!     RunStatus::Done { result, .. } => assert_eq!(result.answer.as_deref(), Some("Hello.")),
//!     other => panic!("{other:?}"),
//! }
//! # Ok(())
//! # }
//! ```

mod error;
mod fence;
mod input;
mod queue;
mod schema;
mod worker;

pub use error::{FleetError, queued_after};
pub use input::{INPUT_FORMAT, RunInput};
/// The message types of this crate's API ([keel-message](keel_message)), re-exported so
/// a user of this crate alone needs no second dependency and no matching version.
pub use keel_message as message;
pub use queue::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_POOL_SIZE, DEFAULT_SCHEMA, InFlight, ParseRunIdError, Policy,
    Queue, QueueOptions, RunId, RunInfo, RunResult, RunStatus, Swept,
};
pub use schema::SCHEMA_VERSION;
pub use worker::{
    ClaimTrouble, DEFAULT_HEARTBEAT, DEFAULT_LEASE, DEFAULT_POLL_INTERVAL, MAX_LEASE, RunEnd,
    RunOutcome, Worker, WorkerBuilder, WorkerReport,
};
