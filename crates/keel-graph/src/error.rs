use std::time::Duration;

use keel_checkpoint::{CheckpointError, CheckpointId};

use crate::StateError;

/// Why an invocation failed. The thread stays at its last stored checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// The run needed more supersteps than the recursion limit allows.
    #[error("recursion limit of {limit} supersteps reached at step {step} without reaching END")]
    RecursionLimit {
        /// The limit.
        limit: usize,
        /// The step at which it was reached.
        step: i64,
    },
    /// A node returned an error (after its retries).
    #[error("node `{node}` failed: {source}")]
    Node {
        /// The node.
        node: String,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A node panicked.
    #[error("node `{node}` panicked: {message}")]
    NodePanicked {
        /// The node.
        node: String,
        /// The panic message.
        message: String,
    },
    /// The run's thread id is not one every saver stores alike (empty or only
    /// whitespace, a NUL, over [`keel_checkpoint::MAX_THREAD_ID_BYTES`]): refused before
    /// anything runs or is stored.
    #[error("thread id {thread_id:?} cannot be used: {reason}")]
    BadThreadId {
        /// The id (its first 64 characters).
        thread_id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A router ([`StateGraph::add_conditional_edges`](crate::StateGraph::add_conditional_edges))
    /// panicked. The step's writes are not stored: the thread resumes from the step
    /// before, and runs the node again.
    #[error("the router after `{from}` panicked: {message}")]
    RouterPanicked {
        /// The node the router follows (`__start__` for `START`).
        from: String,
        /// The panic message.
        message: String,
    },
    /// A node took longer than its timeout (on its last attempt).
    #[error("node `{node}` timed out after {after:?}")]
    NodeTimeout {
        /// The node.
        node: String,
        /// The timeout.
        after: Duration,
    },
    /// [`update_state`](crate::CompiledGraph::update_state) was asked to write as a node
    /// the graph does not have.
    #[error(
        "update_state as `{name}`: the graph has no such node; write as one of {nodes:?}, as START (an input), or as None (an edit that keeps the nodes due)"
    )]
    UnknownAsNode {
        /// The name given.
        name: String,
        /// The graph's nodes, in the order added.
        nodes: Vec<String>,
    },
    /// A router or `goto` named a node that does not exist.
    #[error("`{from}` routed to unknown node `{to}`")]
    UnknownTarget {
        /// Who routed.
        from: String,
        /// Where to.
        to: String,
    },
    /// A router returned a target missing from the `targets` it was declared with
    /// ([`StateGraph::add_conditional_edges`](crate::StateGraph::add_conditional_edges)),
    /// which `compile` relied on.
    #[error(
        "the router after `{from}` returned `{to}`, which is not among its declared targets {declared:?}: add it to the targets given to add_conditional_edges (or pass None)"
    )]
    UndeclaredTarget {
        /// The node the router follows (`__start__` for `START`).
        from: String,
        /// Where it routed.
        to: String,
        /// The targets it was declared with.
        declared: Vec<String>,
    },
    /// [`Command::resume`](crate::Command::resume) given with an update or a `goto`:
    /// a resume answers the pending interrupt and carries nothing else.
    #[error(
        "a resume answers the pending interrupt and carries no update or goto: apply the update with update_state (or in the resumed node) instead"
    )]
    ResumeWithUpdate,
    /// A channel could not be updated, encoded or decoded.
    #[error(transparent)]
    State(#[from] StateError),
    /// The checkpointer failed (including a stale-writer conflict).
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Something needing a checkpointer and a thread id ran without one.
    #[error("{what} needs a checkpointer and a thread_id")]
    CheckpointerRequired {
        /// What was attempted.
        what: &'static str,
    },
    /// A graph with a checkpointer was run without a thread id: it would store
    /// nothing, and no later run could continue it.
    #[error(
        "this graph has a checkpointer, so each run needs a thread id: RunConfig::thread(\"...\")"
    )]
    NoThreadId,
    /// `Command::resume` (or `resume_each`) on a thread with no pending interrupt. A
    /// thread that still has nodes to run (`next`: paused at a breakpoint, or stopped by
    /// a failure or a crash) continues with [`Command::none`](crate::Command::none); one
    /// with nothing to run (finished, or never run) takes a new input.
    #[error("thread `{thread_id}` has no pending interrupt to resume{}", no_interrupt_hint(.next))]
    NoPendingInterrupt {
        /// The thread.
        thread_id: String,
        /// The nodes the thread would run next (empty when it has finished or never
        /// ran).
        next: Vec<String>,
    },
    /// [`Command::resume_each`](crate::Command::resume_each) named a task with no
    /// pending interrupt (nothing was stored).
    #[error(
        "thread `{thread_id}` has no pending interrupt from task `{task_id}`; the pending ones are from tasks {pending:?} (see Run::interrupts or StateSnapshot::interrupts)"
    )]
    UnknownInterrupt {
        /// The thread.
        thread_id: String,
        /// The task named.
        task_id: String,
        /// The tasks whose interrupts are pending.
        pending: Vec<String>,
    },
    /// The requested checkpoint does not exist.
    #[error("checkpoint {id} not found in thread `{thread_id}`")]
    CheckpointNotFound {
        /// The thread.
        thread_id: String,
        /// The checkpoint.
        id: CheckpointId,
    },
    /// A stored checkpoint schedules a task for a node this graph does not have (or a
    /// task's stored result routes to one): the thread was written by a graph of
    /// another shape (a node removed or renamed). Resuming or continuing it is refused
    /// before anything is written; [`get_state`](crate::CompiledGraph::get_state)
    /// still shows it (the node is in `next`), and
    /// [`update_state`](crate::CompiledGraph::update_state) with an `as_node` of this
    /// graph schedules new tasks in its place. (A stored channel this state does not
    /// have is [`StateError::UnknownChannel`].)
    #[error(
        "checkpoint {checkpoint} schedules node `{node}`, which this graph does not have \
         (was the thread written by another version of the graph?)"
    )]
    UnknownNode {
        /// The node named by the stored task.
        node: String,
        /// The checkpoint holding the task.
        checkpoint: CheckpointId,
    },
    /// Stored engine data (scheduled tasks) is unreadable.
    #[error("checkpoint {id}: corrupt task list: {reason}")]
    CorruptTasks {
        /// The checkpoint.
        id: CheckpointId,
        /// What is wrong.
        reason: String,
    },
    /// The background checkpoint writer stopped.
    #[error("the background checkpoint writer stopped")]
    WriterStopped,
    /// The run was cancelled: its event stream was dropped, or a task was aborted.
    #[error("the run was cancelled")]
    Cancelled,
    /// `invoke` or `stream` was called outside a Tokio runtime: the graph runs its
    /// parallel tasks and background checkpoint writes on Tokio.
    #[error(
        "the graph runs on Tokio: call it inside a Tokio runtime (#[tokio::main], #[tokio::test] or Runtime::block_on)"
    )]
    NoRuntime,
}

/// What to do instead of resuming a thread that waits on no interrupt.
fn no_interrupt_hint(next: &[String]) -> String {
    if next.is_empty() {
        "; it has nothing to run (it finished, or never ran): start a run with a new input"
            .to_owned()
    } else {
        format!(
            "; it waits to run {next:?} (paused at a breakpoint, or stopped before they ran): \
             continue it with Command::none()"
        )
    }
}
