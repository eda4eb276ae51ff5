//! Per-invocation configuration and results.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_checkpoint::{CheckpointId, CheckpointMetadata, ThreadKey};
use serde_json::{Map, Value};

/// The default recursion limit: the most supersteps one invocation may run.
///
/// LangGraph's default is 25, which a long-running agent (two supersteps a model call,
/// hundreds of calls a run) would hit at once; keel's bounds a runaway loop instead. A
/// graph that should stop sooner sets [`RunConfig::with_recursion_limit`].
pub const DEFAULT_RECURSION_LIMIT: usize = 10_000;

/// When checkpoints are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Durability {
    /// Each step's checkpoint (and each task's writes) is stored before the next step
    /// starts. A crash loses at most the step in flight, and finished tasks of that step
    /// are not run again.
    #[default]
    Sync,
    /// Checkpoints are stored by a background writer while the next step runs, through
    /// a bounded queue (the run waits when the queue is full). `invoke` returns only
    /// after every write is stored, and also when a step fails. A run cancelled before
    /// it returns (its future or stream dropped) is a crash to the queue: writes still
    /// queued are lost, and the thread resumes from the last one stored, running the
    /// steps after it again. A checkpointer that is not durable
    /// ([`Checkpointer::is_durable`](keel_checkpoint::Checkpointer::is_durable), as the
    /// in-memory one) stores each at once instead, as with `Sync`: its put costs less
    /// than the hand-off.
    Async,
    /// Only the final state (or the state at an interrupt) is stored; when a step
    /// fails, the state after the last finished step is, so a retry continues there
    /// (as LangGraph's exit mode).
    Exit,
}

/// How one invocation runs. Made with [`RunConfig::thread`] (or `default()`) and the
/// `with_*` setters; it gains fields as the engine grows, so it is not built with a
/// struct literal outside this crate.
///
/// ```
/// use keel_graph::{Durability, RunConfig};
/// use serde_json::json;
///
/// let config = RunConfig::thread("t-1")
///     .with_durability(Durability::Async)
///     .with_checkpoint_ns("sub")
///     .with_metadata("run", json!("r-7"));
/// assert_eq!(config.thread_id.as_deref(), Some("t-1"));
/// assert_eq!(config.checkpoint_ns, "sub");
/// assert_eq!(config.metadata["run"], json!("r-7"));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RunConfig {
    /// The thread to load and checkpoint (needs a checkpointer).
    pub thread_id: Option<String>,
    /// Checkpoint namespace (`""` for a root graph).
    pub checkpoint_ns: String,
    /// Start from this past checkpoint instead of the latest (time travel: the run
    /// forks from it). What was stored against that checkpoint is replayed, not run
    /// again: a task that finished, and the answer given to an interrupt there (a
    /// `Command::resume` at it is refused, since nothing is pending). To be asked
    /// again, or to change what a step did, fork with
    /// [`update_state`](crate::CompiledGraph::update_state) at that checkpoint and
    /// run from the fork.
    pub checkpoint_id: Option<CheckpointId>,
    /// The most supersteps this invocation may run.
    pub recursion_limit: usize,
    /// When checkpoints are written.
    pub durability: Durability,
    /// Extra metadata stored with every checkpoint of this invocation. The keys
    /// `source`, `step` and `writes` are the checkpoint's own (a put with one of them
    /// here is refused with `CheckpointError::Invalid`).
    pub metadata: Map<String, Value>,
    /// User configuration for the nodes (LangGraph's `config["configurable"]`), read
    /// with [`NodeContext::config`](crate::NodeContext::config). Unlike
    /// [`metadata`](Self::metadata) it is not stored: give it again on every
    /// invocation that needs it.
    pub configurable: Map<String, Value>,
    /// Ends the run at the next superstep boundary once raised: see [`StopSignal`].
    pub stop: Option<StopSignal>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            thread_id: None,
            checkpoint_ns: String::new(),
            checkpoint_id: None,
            recursion_limit: DEFAULT_RECURSION_LIMIT,
            durability: Durability::Sync,
            metadata: Map::new(),
            configurable: Map::new(),
            stop: None,
        }
    }
}

impl RunConfig {
    /// A config for one thread.
    pub fn thread(thread_id: impl Into<String>) -> Self {
        RunConfig {
            thread_id: Some(thread_id.into()),
            ..Self::default()
        }
    }

    /// Starts from a past checkpoint: see [`checkpoint_id`](Self::checkpoint_id) for
    /// what is replayed from it.
    #[must_use]
    pub fn at(mut self, checkpoint_id: CheckpointId) -> Self {
        self.checkpoint_id = Some(checkpoint_id);
        self
    }

    /// Sets the recursion limit (default [`DEFAULT_RECURSION_LIMIT`]): past it the run
    /// fails with [`GraphError::RecursionLimit`](crate::GraphError::RecursionLimit) and
    /// the thread keeps its last checkpoint.
    #[must_use]
    pub fn with_recursion_limit(mut self, limit: usize) -> Self {
        self.recursion_limit = limit;
        self
    }

    /// Sets the durability mode.
    #[must_use]
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Sets the checkpoint namespace ([`checkpoint_ns`](Self::checkpoint_ns)).
    #[must_use]
    pub fn with_checkpoint_ns(mut self, ns: impl Into<String>) -> Self {
        self.checkpoint_ns = ns.into();
        self
    }

    /// Sets one key of the metadata stored with every checkpoint of this invocation
    /// ([`metadata`](Self::metadata)), replacing an earlier value for the key.
    #[must_use]
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Sets one key of the user configuration ([`configurable`](Self::configurable)),
    /// replacing an earlier value for the key.
    ///
    /// ```
    /// use keel_graph::RunConfig;
    /// use serde_json::json;
    ///
    /// let config = RunConfig::thread("t-1")
    ///     .with_configurable("model", json!("small"))
    ///     .with_configurable("user_id", json!(42));
    /// assert_eq!(config.configurable["model"], json!("small"));
    /// assert!(config.metadata.is_empty(), "configuration is not checkpoint metadata");
    /// ```
    #[must_use]
    pub fn with_configurable(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.configurable.insert(key.into(), value.into());
        self
    }

    /// Ends the run at the next superstep boundary once `signal` is raised
    /// ([`StopSignal`]).
    #[must_use]
    pub fn with_stop(mut self, signal: StopSignal) -> Self {
        self.stop = Some(signal);
        self
    }

    /// Whether the run was asked to stop.
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(StopSignal::is_raised)
    }

    /// The thread to load and store, refused when its id is not one every saver
    /// stores alike ([`ThreadKey::portability_problem`]).
    pub(crate) fn thread_key(&self) -> Result<Option<ThreadKey>, crate::GraphError> {
        let Some(t) = &self.thread_id else {
            return Ok(None);
        };
        let key = ThreadKey::new(t.clone()).with_ns(self.checkpoint_ns.clone());
        match key.portability_problem() {
            None => Ok(Some(key)),
            Some(reason) => Err(crate::GraphError::BadThreadId {
                thread_id: t.chars().take(64).collect(),
                reason,
            }),
        }
    }
}

/// A request to end a run between supersteps: a graceful stop, for a shutdown or a
/// user's "stop after this step".
///
/// Dropping a run's future or stream also stops it, but mid-step: the step in flight
/// is lost (its nodes run again on the next run), and with [`Durability::Async`] so
/// are the checkpoints still queued. A raised signal instead lets the superstep in
/// flight finish and be stored, then ends the run before the next one starts, with
/// every checkpoint stored whatever the durability. The run returns as at a
/// breakpoint: [`Run::stopped`] is true and [`Run::next`] names the nodes due, which
/// the thread's next run (with [`Command::none`](crate::Command::none) or new input)
/// starts with. Without a checkpointer nothing is stored, so nothing can continue the
/// run. A signal raised before the run starts ends it before its first superstep
/// (after storing its input).
///
/// Clones share one flag: keep one, give one to [`RunConfig::with_stop`], raise it
/// from anywhere (a signal handler's task, another thread). A raised signal stays
/// raised: give each run a new one.
///
/// ```
/// use keel_graph::{RunConfig, StopSignal};
///
/// let stop = StopSignal::new();
/// let config = RunConfig::thread("t-1").with_stop(stop.clone());
/// assert!(!stop.is_raised());
/// stop.raise(); // e.g. on SIGTERM: the run ends after its current superstep
/// assert!(config.stop.as_ref().is_some_and(StopSignal::is_raised));
/// ```
#[derive(Debug, Clone, Default)]
pub struct StopSignal(Arc<AtomicBool>);

impl StopSignal {
    /// A signal not raised yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks every run holding this signal (or a clone) to stop at its next superstep
    /// boundary.
    pub fn raise(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether [`raise`](Self::raise) was called.
    pub fn is_raised(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A task that failed the last time it ran: what a failed run leaves stored with the
/// checkpoint it ran from. Running the thread again runs the task again; once its step
/// succeeds, the new checkpoint has no errors.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct TaskError {
    /// The node whose task failed.
    pub node: String,
    /// Its task.
    pub task_id: String,
    /// The error, as it displays ([`GraphError`](crate::GraphError)'s message, which
    /// names the node).
    pub message: String,
}

/// A pending interrupt: a node asked for input.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Interrupt {
    /// The node that asked.
    pub node: String,
    /// Its task.
    pub task_id: String,
    /// What it asked (the value given to `interrupt`).
    pub value: Value,
}

/// The result of an invocation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Run<S> {
    /// The state when the run stopped.
    pub state: S,
    /// Interrupts that paused the run (empty if it finished or stopped at a static
    /// breakpoint).
    pub interrupts: Vec<Interrupt>,
    /// Nodes that would run next; empty when the run reached `END`.
    pub next: Vec<String>,
    /// The last checkpoint stored, if any.
    pub checkpoint_id: Option<CheckpointId>,
    /// Supersteps run by this invocation.
    pub steps: usize,
    /// Whether the run ended early because its [`StopSignal`] was raised (`next` names
    /// the nodes due).
    pub stopped: bool,
}

impl<S> Run<S> {
    /// True if the run stopped before `END` (an interrupt, a breakpoint or a raised
    /// [`StopSignal`]).
    pub fn is_paused(&self) -> bool {
        !self.next.is_empty()
    }
}

/// A thread's state at one checkpoint.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StateSnapshot<S> {
    /// The state.
    pub values: S,
    /// Nodes scheduled to run next.
    pub next: Vec<String>,
    /// Interrupts pending at this checkpoint.
    pub interrupts: Vec<Interrupt>,
    /// The tasks of the step due next that failed when it last ran (a failed run's
    /// error, kept with the checkpoint it ran from), in task order; empty when none did.
    pub errors: Vec<TaskError>,
    /// The checkpoint.
    pub checkpoint_id: CheckpointId,
    /// Its parent.
    pub parent_id: Option<CheckpointId>,
    /// Its metadata.
    pub metadata: CheckpointMetadata,
}
