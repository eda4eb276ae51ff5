//! Why a queue or worker call failed.

use crate::queue::RunId;

/// Why a queue or worker call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetError {
    /// The connection string, schema name or an option is not usable.
    #[error("invalid fleet configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// The connection string cannot be used (it does not parse, names a root
    /// certificate file that cannot be read, or asks for TLS this build leaves out):
    /// nothing has connected.
    #[error(transparent)]
    ConnectionString(#[from] keel_postgres_tls::ConnectError),
    /// No pooled connection could be had (the server is down, refused the login, or
    /// every connection stayed busy past the wait timeout).
    #[error("no Postgres connection: {}", chain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A query failed.
    #[error("Postgres query failed: {}", chain(.0))]
    Query(#[from] tokio_postgres::Error),
    /// The queue's tables are not in the schema: call
    /// [`Queue::setup`](crate::Queue::setup) first.
    #[error(
        "the run queue's tables are missing in schema {schema:?}: call Queue::setup() (or `keel submit`, which sets them up) first"
    )]
    NotSetUp {
        /// The schema looked in.
        schema: String,
    },
    /// The schema is at an older version than this build: run
    /// [`Queue::setup`](crate::Queue::setup) to upgrade it (workers never migrate).
    #[error(
        "schema {schema:?} holds run queue version {found}, older than this keel-fleet's version {expected}: upgrade it with Queue::setup()"
    )]
    SchemaTooOld {
        /// The schema.
        schema: String,
        /// The version recorded in it.
        found: i32,
        /// The version this build needs.
        expected: i32,
    },
    /// The schema is at a newer version than this build knows: an older worker must not
    /// run against it.
    #[error(
        "schema {schema:?} holds run queue version {found}, newer than this keel-fleet knows ({supported}): a newer keel upgraded it, and this one leaves it alone; run a keel that knows version {found}"
    )]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// The version recorded in it.
        found: i32,
        /// The newest version this build has.
        supported: i32,
    },
    /// A migration failed; it was rolled back.
    #[error("run queue migration {version} ({name}) failed: {}", chain(source))]
    Migration {
        /// The migration's version.
        version: i32,
        /// The migration's name.
        name: &'static str,
        /// The error Postgres gave.
        source: tokio_postgres::Error,
    },
    /// The thread id cannot name a thread.
    #[error("thread id {thread:?} is not valid: {reason}")]
    BadThreadId {
        /// The id.
        thread: String,
        /// Why.
        reason: String,
    },
    /// [`Policy::Reject`](crate::Policy::Reject): the thread already has a run that is
    /// queued or running.
    #[error(
        "thread {thread:?} is busy: run {run} is {status}{}; submit with Policy::Enqueue to run after it or Policy::Interrupt to cancel it",
        queued_after(*more)
    )]
    ThreadBusy {
        /// The thread.
        thread: String,
        /// The run in the way: the thread's first run queued or running.
        run: RunId,
        /// Its status (`queued` or `running`).
        status: &'static str,
        /// How many more of the thread's runs are queued after it.
        more: usize,
    },
    /// A run with a goal for a thread that has one, or will before this run starts (a
    /// goal is written once): the run named is the one that brought it. Continue the
    /// thread with a run without a goal (a message), or start another thread.
    #[error(
        "thread {thread:?} already has a goal, from run {run} (a goal is written once): submit a run without a goal (a message) to continue it, or use another thread"
    )]
    GoalTaken {
        /// The thread.
        thread: String,
        /// The run whose goal the thread has or will have.
        run: RunId,
    },
    /// [`Queue::forget_thread`](crate::Queue::forget_thread) while the thread has a
    /// run that is queued or running.
    #[error(
        "thread {thread:?} has run {run} {status}: cancel it and let it end before removing the thread's runs"
    )]
    ThreadActive {
        /// The thread.
        thread: String,
        /// The run still in flight.
        run: RunId,
        /// Its status (`queued` or `running`).
        status: &'static str,
    },
    /// No run has this id.
    #[error("no run {run} in the queue")]
    UnknownRun {
        /// The id asked for.
        run: RunId,
    },
    /// A run's input could not be encoded for storage.
    #[error("the run input cannot be stored: {0}")]
    Encode(#[source] serde_json::Error),
    /// A stored row is not what this build wrote (a status or column it does not know).
    #[error("corrupt run row {run}: {what}")]
    Corrupt {
        /// The run.
        run: RunId,
        /// What is wrong.
        what: String,
    },
    /// The worker's agent could not be built.
    #[error("cannot build the worker's agent: {0}")]
    Build(#[from] keel_agent::BuildError),
    /// The agent failed at what the queue asked of it (deleting a thread in
    /// [`Queue::sweep_idle`](crate::Queue::sweep_idle)).
    #[error(transparent)]
    Agent(#[from] keel_agent::AgentError),
    /// A worker was built without an agent.
    #[error("a worker needs an agent: call `.agent(Agent::builder()...)` on the worker builder")]
    NoAgent,
}

/// An error and its sources, joined: tokio-postgres says only "db error" at the top and
/// keeps the server's message in the source.
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = inner.source();
    }
    text
}

/// `" (and N more queued after it)"`, or nothing for none: the tail of
/// [`FleetError::ThreadBusy`]'s message.
pub fn queued_after(more: usize) -> String {
    match more {
        0 => String::new(),
        1 => " (and 1 more run queued after it)".to_owned(),
        n => format!(" (and {n} more runs queued after it)"),
    }
}
