use keel_graph::{BuildError as GraphBuildError, GraphError};

/// Why an agent could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No model was given.
    #[error("an agent needs a model: call `.model(..)` on the builder")]
    NoModel,
    /// Two tools have the same name.
    #[error("two tools are named `{name}`: tool names must be unique")]
    DuplicateTool {
        /// The name.
        name: String,
    },
    /// The model's token counter could not be made.
    #[error("no token counter for model `{model}`: {reason}")]
    Counter {
        /// The model.
        model: String,
        /// Why.
        reason: String,
    },
    /// The checkpointer outlives the process but the offload store, left at its
    /// in-memory default, would not: a thread resumed in another process would find
    /// its checkpoints but not the archive they point into, and could never compact
    /// again. Give [`AgentBuilder::offload_store`](crate::AgentBuilder::offload_store)
    /// a durable store, or a `MemoryStore` explicitly if the archive may be lost.
    #[error(
        "the checkpointer is durable but the offload store is the in-memory default, which would lose the thread's archive when the process ends: give `.offload_store(..)` a durable store (SqliteStore in the saver's file, FsStore, PostgresStore), or `MemoryStore` explicitly if losing it is fine"
    )]
    EphemeralOffloadStore,
    /// [`AgentBuilder::approve`](crate::AgentBuilder::approve) names a tool the agent
    /// does not have: a misspelt name would let that tool run without asking.
    #[error("`approve` names `{name}`, which is not one of the agent's tools ({tools})")]
    UnknownApprovalTool {
        /// The name given.
        name: String,
        /// The agent's tools, comma-separated.
        tools: String,
    },
    /// Tools need approval but there is no checkpointer to keep the paused run in
    /// until the answer comes.
    #[error(
        "tools that need approval pause the run until an answer comes, which needs a checkpointer: call `.checkpointer(..)` on the builder"
    )]
    ApprovalNeedsCheckpointer,
    /// The system prompt, the builder's goal and the tools' specs alone take more
    /// tokens than the prompt budget (the model's input budget, or
    /// `CompactionConfig::max_prompt_tokens` when smaller): no thread could ever call
    /// the model, whatever compaction does. A goal given per run is checked when the
    /// run starts ([`AgentError::PromptTooLarge`]).
    #[error(
        "the system prompt, goal and tool specs take {tokens} tokens, over the prompt budget of {budget} for model `{model}`: give the builder a profile with a larger window or a smaller maximum output, fewer tools, or a shorter system prompt or goal"
    )]
    PromptTooLarge {
        /// The model the budget is for.
        model: String,
        /// Tokens of the system prompt, goal and tool specs.
        tokens: usize,
        /// The prompt budget.
        budget: usize,
    },
    /// [`AgentBuilder::keep_checkpoints`](crate::AgentBuilder::keep_checkpoints) was
    /// given `Some(0)`: a thread keeps at least its newest checkpoint, and `None`
    /// keeps them all.
    #[error(
        "`keep_checkpoints(Some(0))` would prune a thread to nothing: a thread keeps at least its newest checkpoint; give `Some(n)` with n of at least 1, or `None` to keep every checkpoint"
    )]
    KeepNoCheckpoints,
    /// The reply cap of [`AgentBuilder::options`](crate::AgentBuilder::options)
    /// (`max_tokens`) is over a quarter of the model's window, the most keel keeps free
    /// for the reply: such a reply beside a prompt at its budget would overflow the
    /// server's context.
    #[error(
        "max_tokens {max_tokens} is over a quarter of the {window}-token window of model `{model}`, the most keel keeps free for the reply: give a smaller max_tokens, or a profile with a larger window"
    )]
    ReplyCapTooLarge {
        /// The model the profile is for.
        model: String,
        /// The reply cap asked for.
        max_tokens: usize,
        /// The profile's window.
        window: usize,
    },
    /// A node given to [`AgentBuilder::node`](crate::AgentBuilder::node) under a name
    /// that is none of the agent's nodes was added, and no edge leads from it toward
    /// END.
    #[error(
        "`node(\"{name}\", ..)` added a node `{name}` that cannot reach END: the agent's nodes, which `node` replaces, are agent, tools, compact and epoch; a node of your own needs edges toward END, from `customize`"
    )]
    UnconnectedNode {
        /// The name given.
        name: String,
    },
    /// [`AgentBuilder::wrap`](crate::AgentBuilder::wrap) names no node: none of the
    /// agent's (agent, tools, compact, epoch) nor one given with
    /// [`AgentBuilder::node`](crate::AgentBuilder::node).
    #[error(
        "`wrap(\"{name}\", ..)` names no node: the agent's nodes are agent, tools, compact and epoch; a node of your own is given with `node` first"
    )]
    UnknownNode {
        /// The name given.
        name: String,
    },
    /// [`AgentBuilder::reroute`](crate::AgentBuilder::reroute) names a route the
    /// agent does not have.
    #[error(
        "`reroute(\"{from}\", \"{to}\", ..)`: the agent has no route from `{from}` to `{to}`{}",
        if routes.is_empty() { "; routes leave agent, tools, compact and epoch".to_owned() } else { format!("; `{from}` leads to {routes}") }
    )]
    NoSuchRoute {
        /// The node the route leaves.
        from: String,
        /// Where it was said to lead.
        to: String,
        /// Where routes from `from` lead (empty when `from` is none of the agent's).
        routes: String,
    },
    /// [`AgentBuilder::customize`](crate::AgentBuilder::customize) added a route out of
    /// one of the agent's nodes: it would run its target beside the agent's own route
    /// each time the node finishes (the model called twice a step, or tool calls left
    /// without results).
    #[error(
        "`customize` added a route out of `{node}`, which already routes on its own: both would run after it (the model called twice a step, or tool calls left without results); put a node of your own on the agent's route with `reroute`, or replace `{node}` with `node`"
    )]
    RouteAdded {
        /// The agent's node the route leaves.
        node: String,
    },
    /// A builder setting is out of its range (`max_tool_calls(0)`, a zero
    /// `tool_timeout`).
    #[error("`{setting}`: {reason}")]
    BadSetting {
        /// The builder method.
        setting: &'static str,
        /// What is wrong, and what to give.
        reason: String,
    },
    /// A compaction setting is out of its range
    /// ([`CompactionConfig::validate`](keel_compaction::CompactionConfig::validate)).
    #[error(transparent)]
    Compaction(keel_compaction::CompactionError),
    /// A tool's spec would be refused by the providers: its name is empty or not made
    /// of letters, digits, `_` and `-` (at most 64), or its parameters are not a JSON
    /// object schema.
    #[error("tool `{name}`: {reason}")]
    BadToolSpec {
        /// The tool's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The graph did not compile (a replaced node or a custom edge is wrong).
    #[error(transparent)]
    Graph(#[from] GraphBuildError),
}

/// Why an agent run failed. The thread stays at its last checkpoint and can be run
/// again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// [`Agent::prune`](crate::Agent::prune) was asked to keep no checkpoint, which
    /// would delete the thread; nothing was removed.
    #[error(
        "pruning thread `{thread_id}` to 0 checkpoints would delete it: a thread keeps at least its newest checkpoint; `Agent::delete_thread` removes a whole thread"
    )]
    PruneToNothing {
        /// The thread.
        thread_id: String,
    },
    /// A new thread needs a goal: none was given to the builder or the run.
    #[error(
        "thread `{thread_id}` has no goal: give one with `.goal(..)` on the builder or `AgentInput::goal`"
    )]
    NoGoal {
        /// The thread.
        thread_id: String,
    },
    /// The goal given for a new thread is empty (or only whitespace): there is nothing
    /// to anchor the prompts on.
    #[error(
        "the goal given for thread `{thread_id}` is empty: give the task itself, with `.goal(..)` on the builder or `AgentInput::goal`"
    )]
    EmptyGoal {
        /// The thread.
        thread_id: String,
    },
    /// The thread already has a goal, and the goal is written once.
    #[error(
        "thread `{thread_id}` already has a goal and a goal is written once; run it without a goal to continue it, or start a new thread for another goal"
    )]
    GoalAlreadySet {
        /// The thread.
        thread_id: String,
    },
    /// A message for a thread that waits for an answer to an interrupt (tools awaiting
    /// approval): the model's pending tool calls would be left without results.
    /// Answer first with [`AgentInput::resume`](crate::AgentInput::resume).
    #[error(
        "thread `{thread_id}` is waiting for an answer to {count} pending question(s) (e.g. tools awaiting approval): answer with AgentInput::resume first, then send the message"
    )]
    AwaitingAnswer {
        /// The thread.
        thread_id: String,
        /// How many interrupts wait.
        count: usize,
    },
    /// [`AgentInput::resume`](crate::AgentInput::resume) with a message, goal or system
    /// prompt beside the answer: a resume only answers the pending question, and what
    /// came with it would be lost.
    #[error(
        "thread `{thread_id}` was resumed with an answer and a message, goal or system prompt: a resume carries only the answer; give a denial's reason in the answer ({{\"approved\": false, \"reason\": \"...\"}}) and send a message in a run after it"
    )]
    ResumeWithInput {
        /// The thread.
        thread_id: String,
    },
    /// [`AgentInput::resume`](crate::AgentInput::resume) of an approval whose call
    /// changed after the question was asked (its reply edited): the answer was given to
    /// the call as it was shown. Run the thread with `AgentInput::new()` to be asked
    /// about the calls as they are now.
    #[error(
        "thread `{thread_id}`: call `{call_id}` changed after its approval was asked (or is gone), so the answer would run what was not shown; run the thread with AgentInput::new() to be asked again"
    )]
    StaleQuestion {
        /// The thread.
        thread_id: String,
        /// The call that changed.
        call_id: String,
    },
    /// The thread waits for a human's approval of calls to tools this agent runs
    /// without asking: it was built without [`AgentBuilder::approve`](crate::AgentBuilder::approve)
    /// naming them (another worker's settings, a forgotten flag). Running the thread
    /// would run the calls whatever the answer, so nothing ran. Build the agent with
    /// the approve list of the agent that asked.
    #[error(
        "thread `{thread_id}` waits for a human's approval of calls to {}, which this agent runs without asking: build it with `.approve([..])` naming them, as the agent that asked was; run as it is, it would run the calls whatever the answer",
        tools.join(", ")
    )]
    ApprovalNotAsked {
        /// The thread.
        thread_id: String,
        /// The tools asked about that this agent does not ask about.
        tools: Vec<String>,
    },
    /// A run of the thread is going in this agent (or a clone of it): a second run at
    /// once would load the same checkpoint and run the first one's tool calls again
    /// before its write was refused. Nothing was read or run. Run the thread again
    /// once the first run has ended; a run whose caller stopped waiting (a dropped
    /// future or stream) is waited for instead, as it stops at its next await.
    #[error(
        "thread `{thread_id}` has a run going in this agent: a second run at once would run the first one's tool calls again; run it once the first has ended (keel-fleet's queue runs each thread's runs in turn)"
    )]
    ThreadBusy {
        /// The thread.
        thread_id: String,
    },
    /// [`AgentInput::resume`](crate::AgentInput::resume) on a thread with no pending
    /// question (none was asked, it was answered already, or the thread is new).
    #[error(
        "thread `{thread_id}` has no pending question to answer: run it with AgentInput::new() to continue it, or with a message"
    )]
    NothingToResume {
        /// The thread.
        thread_id: String,
    },
    /// The thread id is not usable as an offload namespace.
    #[error("thread id `{thread_id}` is not valid: {reason}")]
    BadThreadId {
        /// The id.
        thread_id: String,
        /// Why.
        reason: String,
    },
    /// [`AgentInput::metadata`](crate::AgentInput::metadata) used a key keel's
    /// checkpoints own (`source`, `step`, `writes`).
    #[error("metadata key `{key}` is reserved for keel's checkpoint metadata; choose another key")]
    ReservedMetadata {
        /// The key.
        key: String,
    },
    /// [`Agent::run_from`](crate::Agent::run_from) needs the thread's checkpoints: the
    /// agent was built without a checkpointer.
    #[error(
        "thread `{thread_id}` cannot run from a past checkpoint: the agent has no checkpointer"
    )]
    NoCheckpointer {
        /// The thread.
        thread_id: String,
    },
    /// The offload store failed while the thread's files were cleaned up (after a
    /// prune, a sweep or a delete). The checkpoints are as the call left them; what
    /// was not removed is removed by the next prune, or by deleting the thread again.
    #[error("cleaning the offloaded files of thread `{thread_id}` failed: {source}")]
    Offload {
        /// The thread.
        thread_id: String,
        /// What failed.
        #[source]
        source: CleanupError,
    },
    /// The offload store does not give back what the thread's checkpoint archived
    /// into it, so the run did not start (its compactions could not read the archive).
    /// Usually the thread is resumed with another store than the one it wrote to, such
    /// as the in-memory default in a new process: give every run of the thread the same
    /// durable store (`AgentBuilder::offload_store`). Nothing was written. When the
    /// files are gone for good, [`Agent::accept_offload_loss`](crate::Agent::accept_offload_loss)
    /// lets the thread go on without them.
    #[error(
        "thread `{thread_id}` cannot continue: {source} (if those files are gone for good, `Agent::accept_offload_loss` lets the thread go on without them)"
    )]
    ArchiveUnavailable {
        /// The thread.
        thread_id: String,
        /// What the store is missing, or how it failed.
        #[source]
        source: keel_offload::OffloadError,
    },
    /// A thread's goal, with the system prompt and the tool specs, is larger than the
    /// prompt budget: they head every prompt and are never compacted, so every model
    /// call of the thread would overflow the window. For a new thread, shorten the goal
    /// (put long material in a file the agent can read) or use a model with a larger
    /// window; for a thread resumed with a smaller window than it ran with, give it a
    /// window its goal fits. Nothing was written.
    #[error(
        "thread `{thread_id}`: the goal, system prompt and tool specs take {tokens} tokens, more than the {budget}-token prompt budget; no compaction can make the prompt fit"
    )]
    PromptTooLarge {
        /// The thread.
        thread_id: String,
        /// Tokens of the goal, the system prompt and the tool specs.
        tokens: usize,
        /// The prompt budget ([`Compactor::prompt_budget`](keel_compaction::Compactor::prompt_budget)).
        budget: usize,
    },
    /// A message to a thread that has run is larger than what the prompt budget leaves
    /// beside the goal, system prompt and tool specs. It would join the thread's newest
    /// step, which compaction keeps whole, so no model call of the thread could fit
    /// again. Nothing was written: shorten the message, or put its long material in a
    /// file the agent can read and say where.
    #[error(
        "thread `{thread_id}`: the message takes {tokens} tokens, more than the {room} the {budget}-token prompt budget leaves beside the goal, system prompt and tool specs; nothing was stored: shorten it, or put the long part in a file the agent can read and say where"
    )]
    MessageTooLarge {
        /// The thread.
        thread_id: String,
        /// Tokens of the message (of all the run's messages together).
        tokens: usize,
        /// What the budget leaves beside the fixed part.
        room: usize,
        /// The prompt budget.
        budget: usize,
    },
    /// The agent was run outside a Tokio runtime (under `futures::executor::block_on`,
    /// say): its tool calls, timeouts and checkpoint writes are Tokio tasks. Nothing was
    /// written.
    #[error(
        "the agent needs a Tokio runtime: run it under `#[tokio::main]`, or a runtime's `block_on`, not another executor"
    )]
    NoRuntime,
    /// The graph run failed (a node, the checkpointer, a changed graph shape, ...).
    #[error(transparent)]
    Graph(GraphError),
}

impl From<GraphError> for AgentError {
    fn from(e: GraphError) -> Self {
        match e {
            // The graph's advice names graph calls; an agent's caller gets the agent's.
            GraphError::NoPendingInterrupt { thread_id, .. } => {
                AgentError::NothingToResume { thread_id }
            }
            e => AgentError::Graph(e),
        }
    }
}

impl AgentError {
    /// The model's error, when a model call failed the run (the provider refused, timed
    /// out, or overflowed even after compacting): found through the error's sources,
    /// for matching on [`ModelError`](keel_model::ModelError)'s variants.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput};
    /// use keel_model::{ModelError, ScriptedModel};
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// // A script with no turns left fails its first call.
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::new(Vec::new())))
    ///     .goal("Say hello.")
    ///     .build()?;
    /// let err = agent.run("t", AgentInput::new()).await.unwrap_err();
    /// assert!(matches!(err.model_error(), Some(ModelError::Exhausted { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn model_error(&self) -> Option<&keel_model::ModelError> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = next {
            if let Some(m) = e.downcast_ref::<keel_model::ModelError>() {
                return Some(m);
            }
            next = e.source();
        }
        None
    }

    /// Whether running the thread again later, unchanged, may succeed: a conflict
    /// ([`is_conflict`](Self::is_conflict): once the other run has ended), or a model
    /// call that failed for a passing reason
    /// ([`ModelError::is_transient`](keel_model::ModelError::is_transient): a rate
    /// limit, a server error, a lost connection, a timeout, a reply cut short). A
    /// failed run leaves the thread at its last checkpoint, so a retry goes on from
    /// there; other errors need a change first (a setting, the input, a tool, the
    /// server's model) and are the ones to alert on.
    ///
    /// ```
    /// use keel_agent::AgentError;
    ///
    /// let busy = AgentError::ThreadBusy { thread_id: "t".into() };
    /// assert!(busy.is_transient());
    /// let no_goal = AgentError::NoGoal { thread_id: "t".into() };
    /// assert!(!no_goal.is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        self.is_conflict()
            || self
                .model_error()
                .is_some_and(keel_model::ModelError::is_transient)
    }

    /// Whether another run of the thread got there first: a run going in this agent
    /// ([`AgentError::ThreadBusy`]), or one elsewhere that wrote a checkpoint first
    /// (the saver's stale-writer error,
    /// [`CheckpointError::is_conflict`](keel_checkpoint::CheckpointError::is_conflict),
    /// found through the error's sources). Such a run stored nothing: run the thread
    /// again once the other has ended.
    ///
    /// ```
    /// let busy = keel_agent::AgentError::ThreadBusy { thread_id: "t".into() };
    /// assert!(busy.is_conflict());
    /// ```
    pub fn is_conflict(&self) -> bool {
        if matches!(self, AgentError::ThreadBusy { .. }) {
            return true;
        }
        if let AgentError::Graph(GraphError::Checkpoint(c)) = self {
            return c.is_conflict();
        }
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = next {
            if let Some(c) = e.downcast_ref::<keel_checkpoint::CheckpointError>() {
                return c.is_conflict();
            }
            next = e.source();
        }
        false
    }
}

/// The provider reported a context overflow and the compaction that should have made
/// room failed; the model's error is the source.
#[derive(Debug, thiserror::Error)]
#[error("the model's context overflowed ({model}) and compacting failed ({compaction})")]
pub(crate) struct OverflowUnresolved {
    #[source]
    pub(crate) model: keel_model::ModelError,
    pub(crate) compaction: keel_compaction::CompactionError,
}

/// What failed while a thread's offloaded files were cleaned up
/// ([`AgentError::Offload`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CleanupError {
    /// The offload store failed.
    #[error(transparent)]
    Store(#[from] keel_offload::OffloadError),
    /// The checkpointer failed while the kept checkpoints were read.
    #[error(transparent)]
    Checkpointer(#[from] keel_checkpoint::CheckpointError),
    /// A kept checkpoint's `lineage` channel does not decode, so what it sees is
    /// unknown and nothing was removed.
    #[error("a checkpoint's lineage does not decode: {0}")]
    Lineage(#[from] serde_json::Error),
    /// The blocking task that touched the store panicked or was cancelled.
    #[error("the store task did not finish: {0}")]
    Task(#[from] tokio::task::JoinError),
}
