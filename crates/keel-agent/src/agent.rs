//! The agent: a builder over the nodes, and the run API.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_checkpoint::{CheckpointId, Checkpointer, ListOptions, ThreadKey};
use keel_compaction::{CompactionConfig, Compactor, GoalAnchor};
use keel_graph::reducer::{AddMessagesUpdate, MessageOp};
use keel_graph::{
    Command, CompiledGraph, Durability, END, Event, GraphError, Interrupt, NodeContext, NodeError,
    RunConfig, START, StateGraph, StopSignal, StreamMode,
};
use keel_message::{Message, Tool};
use keel_model::{ChatModel, ChatOptions};
use keel_offload::{
    Archive, EvictLargeResults, Lineage, MemoryStore, OffloadStore, ThreadId, ToolLimits,
};
use keel_summarize::{ExtractiveSummarizer, Summarizer};
use keel_token::{CalibratedCounter, MemoCounter, ModelProfile, ModelProfiles, TokenCounter};
use serde_json::Value;

use crate::error::{AgentError, BuildError, CleanupError};
use crate::event::AgentEvent;
use crate::nodes::{
    AGENT, AgentNodes, COMPACT, EPOCH, NO_THREAD, Parts, TOKENS_PER_TOOL_CALL, TOOLS,
    collect_after_prune,
};
use crate::state::{AgentState, AgentStateUpdate, Stop};
use crate::tools::{Toolbox, retrieval_tools};

/// Checkpoints kept after each compaction by default.
pub const DEFAULT_KEEP_CHECKPOINTS: usize = 5;

/// The weight of each model call's report in the calibrated token counts
/// ([`AgentBuilder::calibrate`]).
pub const CALIBRATION_SMOOTHING: f64 = 0.3;

/// The range the calibration factor is kept in ([`AgentBuilder::calibrate`]): keel's
/// counts are never taken for less than half, nor more than four times, what its
/// estimate says.
pub const CALIBRATION_BOUNDS: (f64, f64) = (0.5, 4.0);

/// Replies in a row that may call one tool with the same arguments before the call is
/// no longer run ([`AgentBuilder::max_repeated_calls`]).
pub const DEFAULT_MAX_REPEATED_CALLS: usize = 5;

type BoxedNode = Arc<
    dyn Fn(
            Arc<AgentState>,
            NodeContext,
        ) -> futures::future::BoxFuture<'static, Result<Command<AgentState>, NodeError>>
        + Send
        + Sync,
>;

type Customize = Box<dyn FnOnce(StateGraph<AgentState>) -> StateGraph<AgentState> + Send>;

type Wrapper = Arc<dyn Fn(BoxedNode) -> BoxedNode + Send + Sync>;

/// The node a wrapper of [`AgentBuilder::wrap`] wraps: the built-in one, or the one
/// [`AgentBuilder::node`] gave under that name.
#[derive(Clone)]
pub struct Next {
    node: BoxedNode,
}

impl Next {
    /// Runs the wrapped node on `state`. Call it once to go on as the agent would,
    /// not at all to skip the node, or again to retry it.
    pub fn run(
        &self,
        state: Arc<AgentState>,
        ctx: NodeContext,
    ) -> futures::future::BoxFuture<'static, Result<Command<AgentState>, NodeError>> {
        (self.node)(state, ctx)
    }
}

impl std::fmt::Debug for Next {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Next").finish_non_exhaustive()
    }
}

/// A durable agent that keeps its context small: the compacting agent graph
/// (`agent` ⇄ `tools`, with `compact` and `epoch` when the triggers fire) over a
/// checkpointer.
///
/// ```
/// use std::sync::Arc;
/// use keel_agent::{Agent, AgentInput};
/// use keel_checkpoint::MemorySaver;
/// use keel_message::ToolCall;
/// use keel_model::{ScriptedModel, Turn};
/// use serde_json::json;
///
/// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
/// // A scripted model: it greps the archive once, then answers.
/// let model = ScriptedModel::new([
///     Turn::tool_calls("Looking.", vec![ToolCall::new("c1", "grep", json!({"pattern": "x", "path": "archive"}))]),
///     Turn::text("Nothing archived yet."),
/// ]);
/// let agent = Agent::builder()
///     .model(Arc::new(model))
///     .goal("Say what the archive holds.")
///     .checkpointer(Arc::new(MemorySaver::new()))
///     .build()?;
/// let run = agent.run("thread-1", AgentInput::new()).await?;
/// assert_eq!(run.answer.as_deref(), Some("Nothing archived yet."));
/// assert_eq!(run.state.step, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Agent {
    running: crate::running::Running,
    graph: CompiledGraph<AgentState>,
    nodes: AgentNodes,
    goal: Option<GoalAnchor>,
    system: Option<Message>,
    checkpointer: Option<Arc<dyn Checkpointer>>,
    durability: Durability,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("nodes", &self.nodes)
            .field("durability", &self.durability)
            .finish_non_exhaustive()
    }
}

/// What a run adds to a thread.
///
/// ```
/// use keel_agent::AgentInput;
/// let input = AgentInput::new().goal("Fix the failing test.").user("It is in tests/io.rs.");
/// assert!(input.has_goal());
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct AgentInput {
    goal: Option<GoalAnchor>,
    system: Option<Message>,
    messages: Vec<Message>,
    resume: Option<Value>,
    metadata: serde_json::Map<String, Value>,
    max_steps: Option<u64>,
    stop: Option<StopSignal>,
}

impl AgentInput {
    /// Nothing new: start the thread with the builder's goal, or continue it.
    pub fn new() -> Self {
        Self::default()
    }

    /// The goal of a new thread. A thread's goal is written once: running a thread
    /// that has one with any goal here, even the same text, fails with
    /// [`AgentError::GoalAlreadySet`]; continue it without a goal.
    #[must_use]
    pub fn goal(mut self, goal: impl Into<GoalAnchor>) -> Self {
        self.goal = Some(goal.into());
        self
    }

    /// The system prompt of a new thread (overrides the builder's).
    #[must_use]
    pub fn system(mut self, system: impl Into<String>) -> Self {
        self.system = Some(Message::system(system.into()));
        self
    }

    /// A message to append before the model is called (a user's follow-up).
    ///
    /// A message without an id gets one made of where it enters the thread and its
    /// content: a run that failed after storing its input (a node's error, such as the
    /// model's server being down) can be run again with the same input, and the
    /// message replaces the one the failed run stored instead of coming twice.
    /// [`AgentInput::new`] continues such a thread too.
    #[must_use]
    pub fn message(mut self, message: Message) -> Self {
        self.messages.push(message);
        self
    }

    /// A user message to append before the model is called: the same as
    /// `.message(Message::user(content))`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_model::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Two files.", "The second is b.rs."])))
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .goal("Count the files.")
    ///     .build()?;
    /// agent.run("t", AgentInput::new()).await?;
    /// let run = agent.run("t", AgentInput::new().user("And the second file?")).await?;
    /// assert_eq!(run.answer.as_deref(), Some("The second is b.rs."));
    /// assert!(run.state.messages.iter().any(|m| m.text() == "And the second file?"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn user(self, content: impl Into<keel_message::Content>) -> Self {
        self.message(Message::user(content))
    }

    /// The answer to a pending interrupt (tool approval; see
    /// [`AgentBuilder::approve`] for the answers it takes). A resume carries nothing
    /// else: with a message, goal or system prompt beside it the run fails with
    /// [`AgentError::ResumeWithInput`]. To tell the model why a call was denied, give
    /// the reason in the answer; to add a message, send it in a run after the resume.
    #[must_use]
    pub fn resume(mut self, answer: impl Into<Value>) -> Self {
        self.resume = Some(answer.into());
        self
    }

    /// One key of metadata stored with every checkpoint this run writes (as
    /// LangGraph's `config["metadata"]`): who started the run, with which settings.
    /// The newest checkpoint's metadata is what [`Agent::metadata`] returns, so a
    /// caller that resumes a thread can read back what it ran with. The keys `source`,
    /// `step` and `writes` belong to keel: a run given one of them fails with a typed
    /// error before it writes anything.
    ///
    /// ```
    /// use keel_agent::AgentInput;
    /// use serde_json::json;
    ///
    /// let input = AgentInput::new().metadata("cli", json!({"dir": "../project"}));
    /// # let _ = input;
    /// ```
    #[must_use]
    pub fn metadata(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// This run's budget of model calls: the run stops with [`Stop::RunBudget`] before
    /// its `n + 1`-th call, wherever the thread is (the builder's
    /// [`CompactionConfig::max_steps`](keel_compaction::CompactionConfig::max_steps)
    /// caps the whole thread). Run the thread again to continue: each run has its own
    /// budget. `0` makes no call.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput, Stop};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_message::{Message, ToolCall, ToolSpec, tool_fn};
    /// use keel_model::PolicyModel;
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// // A model that calls a tool forever.
    /// let model = PolicyModel::new("loop", |_, _| {
    ///     Ok(keel_model::ChatResponse::new(
    ///         Message::assistant("Again.").with_tool_calls(vec![ToolCall::new("c", "noop", json!({}))]),
    ///         "loop",
    ///     ))
    /// });
    /// let noop = tool_fn(ToolSpec::new("noop", "Does nothing.", json!({"type": "object"})), |_, _| async { Ok("ok".to_owned()) });
    /// let agent = Agent::builder()
    ///     .model(Arc::new(model))
    ///     .tool(Arc::new(noop))
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .goal("Loop.")
    ///     .build()?;
    /// let run = agent.run("t", AgentInput::new().max_steps(3)).await?;
    /// assert_eq!(run.stop, Some(Stop::RunBudget { steps: 3, max: 3 }));
    /// // The next run has a budget of its own.
    /// let run = agent.run("t", AgentInput::new().max_steps(2)).await?;
    /// assert_eq!(run.stop, Some(Stop::RunBudget { steps: 2, max: 2 }));
    /// assert_eq!(run.state.step, 5);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn max_steps(mut self, n: u64) -> Self {
        self.max_steps = Some(n);
        self
    }

    /// Stops the run gracefully when `signal` is raised: the superstep in flight (a
    /// model call, a step's tool calls, a compaction) finishes and is stored, and the
    /// run ends before the next one with [`Stop::Requested`], every checkpoint stored
    /// whatever the durability. Run the thread again to continue from there: nothing
    /// finished runs twice.
    ///
    /// This is the way to stop for a shutdown (a `SIGTERM`, a deploy) or a user's
    /// "stop after this step". Dropping the run's future or stream stops it at once
    /// instead, and the step in flight runs again on the next run (tool calls are
    /// at least once: see [`ToolContext::idempotency_key`](keel_message::ToolContext::idempotency_key)).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput, Stop, StopSignal};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_message::{Message, ToolCall, ToolSpec, tool_fn};
    /// use keel_model::PolicyModel;
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let stop = StopSignal::new();
    /// // A tool that asks the run to stop while it works (a shutdown arriving mid-step).
    /// let signal = stop.clone();
    /// let work = tool_fn(ToolSpec::new("work", "Works.", json!({"type": "object"})), move |_, _| {
    ///     signal.raise();
    ///     async { Ok("worked".to_owned()) }
    /// });
    /// let model = PolicyModel::new("m", |messages, _| {
    ///     let done = messages.iter().any(|m| m.text() == "worked");
    ///     let reply = if done {
    ///         Message::assistant("All done.")
    ///     } else {
    ///         Message::assistant("").with_tool_calls(vec![ToolCall::new("c1", "work", json!({}))])
    ///     };
    ///     Ok(keel_model::ChatResponse::new(reply, "m"))
    /// });
    /// let agent = Agent::builder()
    ///     .model(Arc::new(model))
    ///     .tool(Arc::new(work))
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .goal("Work once.")
    ///     .build()?;
    /// let run = agent.run("t", AgentInput::new().stop_signal(stop)).await?;
    /// assert_eq!(run.stop, Some(Stop::Requested));
    /// assert!(run.state.messages.iter().any(|m| m.text() == "worked"), "the step finished");
    /// // The next run goes on from there.
    /// let run = agent.run("t", AgentInput::new()).await?;
    /// assert_eq!(run.answer.as_deref(), Some("All done."));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn stop_signal(mut self, signal: StopSignal) -> Self {
        self.stop = Some(signal);
        self
    }

    /// Whether a goal is set.
    pub fn has_goal(&self) -> bool {
        self.goal.is_some()
    }
}

/// The result of a run.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AgentRun {
    /// The thread's state when the run stopped.
    pub state: AgentState,
    /// The model's final answer, if it gave one.
    pub answer: Option<String>,
    /// Why the run stopped early (a step ceiling, empty replies), if it did. Run the
    /// thread again to continue.
    pub stop: Option<Stop>,
    /// Pending interrupts (tools awaiting approval): answer with [`AgentInput::resume`].
    pub interrupts: Vec<Interrupt>,
    /// The last checkpoint stored.
    pub checkpoint_id: Option<CheckpointId>,
    /// Supersteps this run made.
    pub supersteps: usize,
}

/// One item of [`Agent::stream`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AgentUpdate {
    /// Something happened (a model call, a tool call, an offload, a compaction).
    Event(AgentEvent),
    /// A message the run's model or tools added to the raw buffer (the input's own
    /// messages are not repeated: they are the caller's).
    Message(Message),
    /// The run ended, paused at an interrupt, or stopped: the last item of a run
    /// that did not fail (a failed run's last item is its `Err`).
    #[non_exhaustive]
    Done {
        /// The model's final answer, if the run ended with one.
        answer: Option<String>,
        /// Why the run stopped early, if it did: the thread can go on from where it
        /// stopped (run it again, after raising the limit or fixing the cause).
        stop: Option<Stop>,
        /// Nodes that would run next: set when the run paused at an interrupt or was
        /// stopped by its [`StopSignal`] ([`Stop::Requested`]), empty when it ended
        /// otherwise, with an answer or with a `stop` alike. Unlike LangGraph's `next`,
        /// an empty list does not mean the thread is finished: check `stop`.
        next: Vec<String>,
        /// Pending interrupts.
        interrupts: Vec<Interrupt>,
    },
}

impl Agent {
    /// A builder.
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// The compiled graph (for `get_state`, `state_history`, time travel).
    pub fn graph(&self) -> &CompiledGraph<AgentState> {
        &self.graph
    }

    /// The nodes and routers, to build a graph of your own.
    pub fn nodes(&self) -> &AgentNodes {
        &self.nodes
    }

    /// The factor token counts are scaled by, learned from the provider's reports
    /// ([`AgentBuilder::calibrate`]); `None` when counts are not calibrated.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::Agent;
    /// use keel_model::ScriptedModel;
    ///
    /// // A model keel has no tokenizer for: its counts are estimates, calibrated.
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Done."]).with_name("my-local-model")))
    ///     .goal("Say done.")
    ///     .build()?;
    /// assert_eq!(agent.count_factor(), Some(1.0)); // no call reported usage yet
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn count_factor(&self) -> Option<f64> {
        self.nodes.parts.calibration.as_ref().map(|c| c.factor())
    }

    fn config(
        &self,
        thread_id: &str,
        metadata: &serde_json::Map<String, Value>,
        budget: Option<RunBudget>,
        stop: Option<StopSignal>,
    ) -> RunConfig {
        // Four supersteps per model call at most (agent, tools, compact, epoch).
        let calls = budget.map_or(self.nodes.compaction().max_steps, |b| {
            b.max.min(self.nodes.compaction().max_steps)
        });
        let limit = usize::try_from(calls)
            .unwrap_or(usize::MAX / 8)
            .saturating_mul(4)
            .saturating_add(16);
        let mut config = RunConfig::thread(thread_id)
            .with_durability(self.durability)
            .with_recursion_limit(limit);
        if let Some(budget) = budget {
            config = config.with_configurable(RUN_BUDGET_KEY, budget.to_value());
        }
        for (key, value) in metadata {
            config = config.with_metadata(key.clone(), value.clone());
        }
        if let Some(stop) = stop {
            config = config.with_stop(stop);
        }
        config
    }

    /// The metadata the thread's newest checkpoint was stored with (what the last run
    /// gave [`AgentInput::metadata`], beside keel's own `source`, `step` and
    /// `writes`); `None` for a thread without checkpoints.
    pub async fn metadata(
        &self,
        thread_id: &str,
    ) -> Result<Option<serde_json::Map<String, Value>>, AgentError> {
        Ok(self.snapshot(thread_id).await?.map(|s| s.metadata.extra))
    }

    /// The thread's newest snapshot, as LangGraph's `get_state`: its state, the nodes
    /// due next, the questions it waits on, the errors its last run stopped on, and the
    /// checkpoint's id and metadata. `None` without a checkpointer or checkpoints; an
    /// id no run would accept (`"user/123"`) is [`AgentError::BadThreadId`], as for
    /// [`Agent::run`]. Reads only: nothing is run or written.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_model::{ModelError, PolicyModel};
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// // A model whose server is down: the run fails, and the thread keeps why.
    /// let down = PolicyModel::new("gpt-4o", |_, _| {
    ///     Err(ModelError::Connection("connection refused".into()))
    /// });
    /// let agent = Agent::builder()
    ///     .model(Arc::new(down))
    ///     .goal("Say done.")
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .build()?;
    /// assert!(agent.run("t", AgentInput::default()).await.is_err());
    /// let snapshot = agent.snapshot("t").await?.expect("the thread has a checkpoint");
    /// assert_eq!(snapshot.next, ["agent"]);
    /// assert_eq!(snapshot.errors[0].node, "agent");
    /// assert!(snapshot.errors[0].message.contains("connection refused"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn snapshot(
        &self,
        thread_id: &str,
    ) -> Result<Option<keel_graph::StateSnapshot<AgentState>>, AgentError> {
        // An id no run accepts is said so, as `run` says it, not read as no thread.
        ThreadId::new(thread_id).map_err(|e| bad_thread_id(thread_id, e))?;
        if self.checkpointer.is_none() {
            return Ok(None);
        }
        Ok(self.graph.get_state(&RunConfig::thread(thread_id)).await?)
    }

    /// Runs a thread until the model answers without calling a tool, a tool awaits
    /// approval, or the run stops early ([`AgentRun::stop`]).
    ///
    /// A new thread starts from its goal (the input's or the builder's). A thread that
    /// was interrupted mid-step (a crash, a cancelled run) continues from its last
    /// checkpoint. A thread that stopped early ([`AgentRun::stop`]: a step ceiling,
    /// empty replies) runs on; one that finished with an answer runs again only when
    /// the input brings messages (a follow-up), and otherwise returns as it is.
    ///
    /// # Where it runs
    ///
    /// Like [`stream`](Agent::stream), the run is driven by a Tokio task of its own, so
    /// the tasks it starts (each tool call, background checkpoint writes) are picked up
    /// by the same worker thread as it waits for them, instead of waking another thread
    /// each time, as they would from `block_on`'s thread. Dropping the returned future
    /// aborts that task at its next `.await`, which is where an inline run would have
    /// stopped; a panic in it resumes in the caller.
    ///
    /// # Thread ids
    ///
    /// A thread id also names the thread's folder in the offload store, so it is 1 to
    /// 255 bytes without `/`, `\`, NUL or control characters, and does not start with
    /// `.`; anything else is refused with [`AgentError::BadThreadId`] before anything
    /// runs. Map ids of your own that break these rules (`user/123`) to ones that keep
    /// them (`user-123`, or a hash).
    ///
    /// # One run of a thread at a time
    ///
    /// A second run of a thread while one is going in this agent (or a clone of it:
    /// clones share what runs) fails at once with [`AgentError::ThreadBusy`], before
    /// it reads anything: both would start from the same checkpoint, and the second
    /// would run the first one's tool calls again. A run whose caller has stopped
    /// waiting for it (its future or stream dropped) is waited for instead, as it
    /// stops at its next await.
    ///
    /// Runs in other processes, or in agents built apart over the same saver, are
    /// kept apart by the saver: the second to write a checkpoint fails with its
    /// stale-writer error ([`AgentError::is_conflict`] is true for it), and nothing of
    /// that run is stored, though tool calls it made before have run. Give each
    /// thread's runs to one worker (keel-fleet's queue runs them in turn), or keep
    /// them apart in your own code (a lock per thread id).
    pub async fn run(&self, thread_id: &str, input: AgentInput) -> Result<AgentRun, AgentError> {
        let (agent, thread) = (self.clone(), thread_id.to_owned());
        let (guard, _stop) = self.running.begin_watched(thread_id).await?;
        on_own_task(async move {
            let _guard = guard;
            let (metadata, stop) = (input.metadata.clone(), input.stop.clone());
            let (command, budget, _) = agent.command(&thread, None, input).await?;
            let run = agent
                .graph
                .invoke(command, &agent.config(&thread, &metadata, budget, stop))
                .await;
            agent.settle(&thread).await;
            Ok(AgentRun::of(run?))
        })
        .await
    }

    /// Waits for the thread's background prune and removes what only the pruned
    /// checkpoints saw ([`AgentNodes::settle`]), as a run ends; a failure is logged:
    /// the run's checkpoints are stored, and the next compaction step retries.
    async fn settle(&self, thread_id: &str) {
        if let Err(e) = self.nodes.settle(thread_id).await {
            tracing::warn!(error = %e, "removing what pruned checkpoints saw failed");
        }
    }

    /// Runs a thread from one of its past checkpoints: a fork, as LangGraph's `invoke`
    /// with a `checkpoint_id`. The run starts from the state stored at `checkpoint`
    /// (with `input`'s messages appended), and what it writes becomes the thread's
    /// newest checkpoints, children of `checkpoint`; the branch it left stays in the
    /// history ([`CompiledGraph::state_history`], [`Agent::prune`] removes it with
    /// what only it saw). Files the fork writes (archive records, offloaded results) are
    /// its own: neither branch reads what the other wrote after the fork point.
    ///
    /// Without a checkpointer, or with a checkpoint the thread does not have, the run
    /// fails before it writes anything.
    ///
    /// A checkpoint where the thread paused for approval holds the answer it was
    /// resumed with (stored with the step's writes, as LangGraph stores them): a run
    /// from it replays that answer, and runs the approved calls again, without asking.
    /// To be asked again, fork with an edit instead
    /// (`agent.graph().update_state(&RunConfig::thread(t).at(id), AgentStateUpdate::default(), None)`),
    /// then run the thread.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_graph::RunConfig;
    /// use keel_message::Message;
    /// use keel_model::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Paris.", "Rome.", "Madrid."])))
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .goal("Name a capital.")
    ///     .build()?;
    /// let first = agent.run("t", AgentInput::new()).await?;
    /// let second = agent
    ///     .run("t", AgentInput::new().message(Message::user("Another one.")))
    ///     .await?;
    /// assert_eq!(second.answer.as_deref(), Some("Rome."));
    /// // Back to where the first run ended, asking something else.
    /// let at = first.checkpoint_id.expect("stored");
    /// let fork = agent
    ///     .run_from("t", &at, AgentInput::new().message(Message::user("One in Spain.")))
    ///     .await?;
    /// assert_eq!(fork.answer.as_deref(), Some("Madrid."));
    /// let now = agent.state("t").await?.expect("a thread");
    /// assert!(now.messages.iter().all(|m| m.text() != "Rome."), "the fork does not hold the other branch");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn run_from(
        &self,
        thread_id: &str,
        checkpoint: &CheckpointId,
        input: AgentInput,
    ) -> Result<AgentRun, AgentError> {
        if self.checkpointer.is_none() {
            return Err(AgentError::NoCheckpointer {
                thread_id: thread_id.to_owned(),
            });
        }
        let (agent, thread, checkpoint) = (self.clone(), thread_id.to_owned(), checkpoint.clone());
        let (guard, _stop) = self.running.begin_watched(thread_id).await?;
        on_own_task(async move {
            let _guard = guard;
            let (metadata, stop) = (input.metadata.clone(), input.stop.clone());
            let (command, budget, _) = agent.command(&thread, Some(&checkpoint), input).await?;
            let config = agent
                .config(&thread, &metadata, budget, stop)
                .at(checkpoint);
            let run = agent.graph.invoke(command, &config).await;
            agent.settle(&thread).await;
            Ok(AgentRun::of(run?))
        })
        .await
    }
}

impl AgentRun {
    fn of(run: keel_graph::Run<AgentState>) -> AgentRun {
        AgentRun {
            answer: if run.next.is_empty() && run.state.stop.is_none() {
                run.state.answer()
            } else {
                None
            },
            stop: run
                .state
                .stop
                .clone()
                .or_else(|| run.stopped.then_some(Stop::Requested)),
            interrupts: run.interrupts,
            checkpoint_id: run.checkpoint_id,
            supersteps: run.steps,
            state: run.state,
        }
    }
}

impl Agent {
    /// Runs a thread like [`Agent::run`], yielding its events and the messages the model
    /// and the tools add as they happen (within a step, its events come before its
    /// messages; the input's messages are not yielded), and last
    /// [`AgentUpdate::Done`] with the answer. Dropping the stream cancels the run: the
    /// thread continues from its last checkpoint on the next run. The stream is
    /// `Unpin`, so `StreamExt::next` works on it directly.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use futures::StreamExt;
    /// use keel_agent::{Agent, AgentInput, AgentUpdate};
    /// use keel_model::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Hello."])))
    ///     .goal("Say hello.")
    ///     .build()?;
    /// let mut updates = agent.stream("t", AgentInput::new());
    /// let mut answer = None;
    /// while let Some(update) = updates.next().await {
    ///     if let AgentUpdate::Done { answer: a, .. } = update? {
    ///         answer = a;
    ///     }
    /// }
    /// assert_eq!(answer.as_deref(), Some("Hello."));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stream(
        &self,
        thread_id: &str,
        input: AgentInput,
    ) -> futures::stream::BoxStream<'static, Result<AgentUpdate, AgentError>> {
        let agent = self.clone();
        let thread = thread_id.to_owned();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Box::pin(futures::stream::once(async { Err(AgentError::NoRuntime) }));
        };
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<AgentUpdate, AgentError>>(64);
        // The run is driven by its own task; dropping the receiver ends it (the graph's
        // stream is dropped with it, which cancels the run).
        let stop = crate::running::StopOnDrop::default();
        let watch = stop.watcher();
        runtime.spawn(async move {
            let _guard = match agent.running.begin(&thread).await {
                Ok(guard) => {
                    watch.watch(&guard);
                    guard
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let (metadata, stop) = (input.metadata.clone(), input.stop.clone());
            let (command, budget, mut ending) = match agent.command(&thread, None, input).await {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            let mut events = Box::pin(agent.graph.stream(
                command,
                agent.config(&thread, &metadata, budget, stop),
                StreamMode::updates(),
            ));
            let mut settled = false;
            loop {
                // A dropped receiver cancels the run at once, mid-step: the graph's
                // stream is dropped with this task's loop, and the step's model call
                // or tools with it (the thread continues from its last checkpoint).
                let closed = std::pin::pin!(tx.closed());
                let e = match futures::future::select(events.next(), closed).await {
                    futures::future::Either::Left((e, _)) => e,
                    futures::future::Either::Right(((), _)) => return,
                };
                let Some(e) = e else { break };
                let items = match e {
                    Ok(e) => ending.updates_of(e).into_iter().map(Ok).collect::<Vec<_>>(),
                    Err(e) => vec![Err(AgentError::from(e))],
                };
                for item in items {
                    // The run is over: its thread is pruned before the caller hears so.
                    if !settled && matches!(item, Ok(AgentUpdate::Done { .. }) | Err(_)) {
                        settled = true;
                        agent.settle(&thread).await;
                    }
                    if tx.send(item).await.is_err() {
                        return;
                    }
                }
            }
            if !settled {
                agent.settle(&thread).await;
            }
        });
        // The stream holds `stop`: dropped before the run ends, it marks the run as
        // stopping, so the thread's next run waits for it rather than being refused.
        futures::stream::unfold((rx, stop), |(mut rx, stop)| async move {
            rx.recv().await.map(|item| (item, (rx, stop)))
        })
        .boxed()
    }

    /// The thread's latest state, if it has one.
    pub async fn state(&self, thread_id: &str) -> Result<Option<AgentState>, AgentError> {
        Ok(self.snapshot(thread_id).await?.map(|s| s.values))
    }

    /// The questions the thread waits on (tool approvals, with the value
    /// [`AgentBuilder::approve`] describes), as the run that paused returned them in
    /// [`AgentRun::interrupts`]; empty when none waits. Reads only: nothing is run or
    /// written.
    pub async fn interrupts(&self, thread_id: &str) -> Result<Vec<Interrupt>, AgentError> {
        Ok(self
            .snapshot(thread_id)
            .await?
            .map(|s| s.interrupts)
            .unwrap_or_default())
    }

    /// The thread's checkpoints, newest first, as a stream of snapshots (each with its
    /// state, metadata and the nodes due next); `options` pages and filters them
    /// (`limit`, `before`, `written_by`). Empty without a checkpointer. Read it with
    /// `futures`' `TryStreamExt` (the facade re-exports it as `keel::futures`).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use futures::TryStreamExt;
    /// use keel_agent::{Agent, AgentInput, COMPACT};
    /// use keel_checkpoint::{ListOptions, MemorySaver};
    /// use keel_compaction::CompactionConfig;
    /// use keel_message::ToolCall;
    /// use keel_model::{ScriptedModel, Turn};
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let mut turns: Vec<Turn> = (0..6)
    ///     .map(|i| Turn::tool_calls("", vec![ToolCall::new(format!("c{i}"), "ls", json!({}))]))
    ///     .collect();
    /// turns.push(Turn::text("done"));
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::new(turns)))
    ///     .goal("List the archive.")
    ///     .compaction(CompactionConfig::default().with_every_steps(Some(3)))
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .build()?;
    /// agent.run("t", AgentInput::new()).await?;
    /// let newest: Vec<_> = agent.history("t", ListOptions::default().limit(3)).try_collect().await?;
    /// assert_eq!(newest.len(), 3);
    /// assert_eq!(newest[0].values.answer().as_deref(), Some("done"));
    /// let compactions = agent.history("t", ListOptions::default().written_by(COMPACT));
    /// assert!(!compactions.try_collect::<Vec<_>>().await?.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn history(
        &self,
        thread_id: &str,
        options: ListOptions,
    ) -> futures::stream::BoxStream<
        'static,
        Result<keel_graph::StateSnapshot<AgentState>, AgentError>,
    > {
        if self.checkpointer.is_none() {
            return futures::stream::empty().boxed();
        }
        self.graph
            .state_history(&RunConfig::thread(thread_id), options)
            .map(|item| item.map_err(AgentError::from))
            .boxed()
    }

    /// Keeps the newest `keep` checkpoints of a thread and removes the offloaded files
    /// (archive records, large results) only the removed checkpoints saw — an
    /// abandoned fork's, say — never what a kept one reads; returns how many
    /// checkpoints were removed. The agent does this itself after each compaction
    /// ([`AgentBuilder::keep_checkpoints`]). `keep` is at least 1
    /// ([`AgentError::PruneToNothing`]): [`Agent::delete_thread`] removes a whole thread.
    pub async fn prune(&self, thread_id: &str, keep: usize) -> Result<usize, AgentError> {
        if keep == 0 {
            return Err(AgentError::PruneToNothing {
                thread_id: thread_id.to_owned(),
            });
        }
        let Some(cp) = &self.checkpointer else {
            return Ok(0);
        };
        let key = ThreadKey::new(thread_id.to_owned());
        let removed = cp
            .prune(&key, keep)
            .await
            .map_err(keel_graph::GraphError::from)?;
        collect_after_prune(&self.nodes.parts, cp.as_ref(), &key, None)
            .await
            .map_err(|source| AgentError::Offload {
                thread_id: thread_id.to_owned(),
                source,
            })?;
        Ok(removed)
    }

    /// Lets a thread go on without the offloaded files its offload store lost, when a
    /// run is refused with [`AgentError::ArchiveUnavailable`]: the store holds less
    /// than the thread's newest checkpoint has seen (it ran with an in-memory store,
    /// as keel once allowed beside a durable checkpointer, or its files were deleted
    /// or restored from an older backup). Writes one checkpoint whose view of the
    /// store is the store as it is now, keeping everything else (messages, summaries,
    /// the nodes due), and returns its id; `None`, writing nothing, when the store
    /// holds all the thread has seen or the thread has no checkpoint.
    ///
    /// What was lost stays lost: archived messages and stored tool results the
    /// context points at read as missing, and the milestones and epoch summaries
    /// still hold what they said of them. A warning in the log names what the store
    /// lacked. Refused with [`AgentError::ThreadBusy`] while the thread runs here.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentError, AgentInput};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_compaction::CompactionConfig;
    /// use keel_message::ToolCall;
    /// use keel_model::{ScriptedModel, Turn};
    /// use keel_offload::MemoryStore;
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let saver = Arc::new(MemorySaver::new());
    /// let agent = |turns: Vec<Turn>| {
    ///     Agent::builder()
    ///         .model(Arc::new(ScriptedModel::new(turns)))
    ///         .goal("List the directory.")
    ///         .compaction(CompactionConfig::default().with_every_steps(Some(3)))
    ///         .checkpointer(saver.clone())
    ///         .offload_store(Arc::new(MemoryStore::new()))
    ///         .build()
    /// };
    /// let mut turns: Vec<Turn> = (0..6)
    ///     .map(|i| Turn::tool_calls("", vec![ToolCall::new(format!("c{i}"), "ls", json!({}))]))
    ///     .collect();
    /// turns.push(Turn::text("Listed."));
    /// agent(turns)?.run("t", AgentInput::new()).await?; // compactions archive old steps
    ///
    /// // The same thread in a new process whose store lost the archive.
    /// let second = agent(vec![Turn::text("Still listed.")])?;
    /// let refused = second.run("t", AgentInput::new().user("And now?")).await;
    /// assert!(matches!(refused, Err(AgentError::ArchiveUnavailable { .. })));
    /// assert!(second.accept_offload_loss("t").await?.is_some());
    /// let run = second.run("t", AgentInput::new().user("And now?")).await?;
    /// assert_eq!(run.answer.as_deref(), Some("Still listed."));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn accept_offload_loss(
        &self,
        thread_id: &str,
    ) -> Result<Option<CheckpointId>, AgentError> {
        if self.checkpointer.is_none() {
            return Err(AgentError::NoCheckpointer {
                thread_id: thread_id.to_owned(),
            });
        }
        let thread = ThreadId::new(thread_id).map_err(|e| bad_thread_id(thread_id, e))?;
        let _guard = self.running.begin(thread_id).await?;
        let config = RunConfig::thread(thread_id);
        let Some(snap) = self.graph.get_state(&config).await? else {
            return Ok(None);
        };
        let lost = match self.check_archive(thread, &snap.values.lineage).await {
            Ok(()) => return Ok(None),
            Err(AgentError::ArchiveUnavailable { source, .. }) => source,
            Err(other) => return Err(other),
        };
        tracing::warn!(
            thread = thread_id,
            lost = %lost,
            "the thread goes on without the offloaded files its store lost"
        );
        // The unscoped view sees whatever the store holds, and scopes itself at the
        // thread's next write, as a checkpoint from before lineages does.
        let update = AgentStateUpdate::default().lineage(Lineage::unscoped());
        Ok(Some(self.graph.update_state(&config, update, None).await?))
    }

    /// Deletes a thread: its checkpoints (every namespace) and every offloaded file of
    /// it, on every branch (the store's `delete_thread`: one transaction on the
    /// databases). Deleting a thread that does not exist does nothing.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentInput};
    /// use keel_checkpoint::MemorySaver;
    /// use keel_model::ScriptedModel;
    /// use keel_offload::{MemoryStore, OffloadStore, ThreadId};
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let store = Arc::new(MemoryStore::new());
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Done."])))
    ///     .goal("Say done.")
    ///     .checkpointer(Arc::new(MemorySaver::new()))
    ///     .offload_store(store.clone())
    ///     .build()?;
    /// agent.run("t", AgentInput::new()).await?;
    /// agent.delete_thread("t").await?;
    /// assert!(agent.state("t").await?.is_none());
    /// assert!(store.list(&ThreadId::new("t")?, None)?.is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn delete_thread(&self, thread_id: &str) -> Result<(), AgentError> {
        let id = ThreadId::new(thread_id).map_err(|e| bad_thread_id(thread_id, e))?;
        // Not under a run of this agent: its next write would fail, and its step be lost.
        let _guard = self.running.begin(thread_id).await?;
        if let Some(cp) = &self.checkpointer {
            cp.delete_thread(thread_id)
                .await
                .map_err(keel_graph::GraphError::from)?;
        }
        let store = self.nodes.parts.store.clone();
        let deleted = match tokio::task::spawn_blocking(move || store.delete_thread(&id)).await {
            Ok(r) => r.map_err(CleanupError::from),
            Err(e) => Err(CleanupError::from(e)),
        };
        deleted.map_err(|source| AgentError::Offload {
            thread_id: thread_id.to_owned(),
            source,
        })?;
        Ok(())
    }

    /// Deletes threads idle for longer than `idle_for` (no checkpoint since), at most
    /// `limit` of them per call, with their offloaded results and archive on every
    /// branch (the store's `delete_thread`); returns their ids. Call it again while it
    /// returns `limit` ids to sweep everything. Without a checkpointer there is nothing
    /// to sweep; a checkpointer without a sweep is an error saying so.
    ///
    /// A thread is idle by its checkpoints alone. One with a run going in this agent
    /// (or its clones), in a long model call or tool call, is kept; one whose run
    /// waits in a fleet's queue, or goes in another process, may look idle and is
    /// deleted all the same. With a fleet, sweep with
    /// `keel_fleet::Queue::sweep_idle`, which keeps the threads with a run queued or
    /// running. [`Agent::delete_thread`] refuses a thread that runs here
    /// ([`AgentError::ThreadBusy`]).
    pub async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, AgentError> {
        let Some(cp) = &self.checkpointer else {
            return Ok(Vec::new());
        };
        let running = self.running.count();
        let swept = if running > 0 {
            // Thread by thread, each held against a run of this agent while it goes,
            // passing over those that run (so as many more are read).
            let mut swept = Vec::new();
            let idle = keel_checkpoint::support::idle_threads(
                cp.as_ref(),
                idle_for,
                limit.saturating_add(running),
            )
            .await
            .map_err(keel_graph::GraphError::from)?;
            for thread in idle {
                if swept.len() == limit {
                    break;
                }
                let Ok(_guard) = self.running.begin(&thread).await else {
                    continue;
                };
                cp.delete_thread(&thread)
                    .await
                    .map_err(keel_graph::GraphError::from)?;
                swept.push(thread);
            }
            swept
        } else {
            cp.sweep_idle(idle_for, limit)
                .await
                .map_err(keel_graph::GraphError::from)?
        };
        let store = self.nodes.parts.store.clone();
        let threads = swept.clone();
        // The offload store is synchronous (files): its deletes go to the blocking pool.
        let cleaned = tokio::task::spawn_blocking(move || {
            for thread in &threads {
                let Ok(id) = ThreadId::new(thread.as_str()) else {
                    continue;
                };
                if let Err(e) = store.delete_thread(&id) {
                    tracing::warn!(thread = %thread, error = %e, "deleting a swept thread's offload files failed");
                }
            }
        })
        .await;
        if let Err(e) = cleaned {
            tracing::warn!(error = %e, "cleaning the offload store after a sweep did not finish");
        }
        Ok(swept)
    }

    /// The threads [`Agent::sweep_idle`] would delete now, without deleting them: those
    /// idle for longer than `idle_for`, at most `limit`, in id order. Without a
    /// checkpointer there are none.
    pub async fn idle_threads(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, AgentError> {
        let Some(cp) = &self.checkpointer else {
            return Ok(Vec::new());
        };
        Ok(
            keel_checkpoint::support::idle_threads(cp.as_ref(), idle_for, limit)
                .await
                .map_err(keel_graph::GraphError::from)?,
        )
    }

    /// The newest checkpoint of a thread written by `node` (e.g. [`crate::COMPACT`]):
    /// a lookup by checkpoint metadata, which records the nodes that wrote each step.
    /// With `before`, only checkpoints older than it count, so each call steps one
    /// compaction further back.
    ///
    /// To find compaction N counted from the thread's start, and the checkpoint
    /// before it (to fork from with [`Agent::run_from`]), read the `compact`
    /// checkpoints' states: each holds the milestones made so far.
    ///
    /// ```no_run
    /// # async fn f(agent: keel_agent::Agent) -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::TryStreamExt;
    /// use keel_agent::{AgentInput, COMPACT};
    /// use keel_checkpoint::ListOptions;
    ///
    /// let n = 3;
    /// // Newest first; a `compact` step whose compaction failed keeps the count of the
    /// // one before it, so the oldest with count n is the one that made milestone n.
    /// let third = agent
    ///     .history("t", ListOptions::default().written_by(COMPACT))
    ///     .try_filter(|snap| std::future::ready(snap.values.milestones_made == n))
    ///     .try_collect::<Vec<_>>()
    ///     .await?
    ///     .pop();
    /// if let Some(before) = third.and_then(|snap| snap.parent_id) {
    ///     agent.run_from("t", &before, AgentInput::new()).await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Pruning ([`AgentBuilder::keep_checkpoints`], 5 by default) leaves only the
    /// newest checkpoints: keep more, or `None`, to go back further.
    pub async fn last_checkpoint_by(
        &self,
        thread_id: &str,
        node: &str,
        before: Option<CheckpointId>,
    ) -> Result<Option<CheckpointId>, AgentError> {
        let Some(cp) = &self.checkpointer else {
            return Ok(None);
        };
        let thread = ThreadKey::new(thread_id.to_owned());
        let mut options = ListOptions::default().written_by(node).limit(1);
        if let Some(id) = before {
            options = options.before(id);
        }
        let mut list = cp.list(&thread, options);
        match list.next().await {
            Some(s) => Ok(Some(s.map_err(keel_graph::GraphError::from)?.checkpoint.id)),
            None => Ok(None),
        }
    }

    /// The command that starts a run of `thread_id` from its newest checkpoint, or from
    /// `at`, and the run's budget.
    async fn command(
        &self,
        thread_id: &str,
        at: Option<&CheckpointId>,
        input: AgentInput,
    ) -> Result<(Command<AgentState>, Option<RunBudget>, AgentUpdates), AgentError> {
        let thread = ThreadId::new(thread_id).map_err(|e| bad_thread_id(thread_id, e))?;
        if let Some(key) = input
            .metadata
            .keys()
            .find(|k| matches!(k.as_str(), "source" | "step" | "writes"))
        {
            return Err(AgentError::ReservedMetadata { key: key.clone() });
        }
        let existing = match (&self.checkpointer, at) {
            // A checkpoint the thread does not hold is `CheckpointNotFound` from the graph.
            (Some(_), Some(id)) => {
                let config = RunConfig::thread(thread_id).at(id.clone());
                self.graph.get_state(&config).await?
            }
            (Some(_), None) => self.graph.get_state(&RunConfig::thread(thread_id)).await?,
            _ => None,
        };
        if let Some(snap) = &existing {
            self.check_archive(thread, &snap.values.lineage).await?;
        }
        // The budget counts from the calls the thread has made when this run starts.
        let budget = input.max_steps.map(|max| RunBudget {
            start: existing.as_ref().map_or(0, |s| s.values.step),
            max,
        });
        let command = self.command_for(thread_id, input, existing.as_ref())?;
        // Nothing to run on a thread at rest: the stream's end is what it stored.
        let ending = match &existing {
            Some(snap)
                if snap.next.is_empty()
                    && command.update.is_none()
                    && command.goto.is_empty()
                    && command.resume.is_none() =>
            {
                AgentUpdates {
                    answer: snap.values.answer(),
                    stop: snap.values.stop.clone(),
                }
            }
            _ => AgentUpdates::default(),
        };
        Ok((command, budget, ending))
    }

    /// Fails with [`AgentError::ArchiveUnavailable`] when the offload store lacks what
    /// `lineage` (a stored checkpoint's) has seen: a few size queries, off the runtime.
    async fn check_archive(&self, thread: ThreadId, lineage: &Lineage) -> Result<(), AgentError> {
        if !lineage.is_scoped() {
            return Ok(());
        }
        let thread_id = thread.as_str().to_owned();
        let unavailable = |source| AgentError::ArchiveUnavailable {
            thread_id: thread_id.clone(),
            source,
        };
        let store = self.nodes.parts.store.clone();
        let lineage = lineage.clone();
        let checked =
            tokio::task::spawn_blocking(move || lineage.check_stored(&*store, &thread)).await;
        match checked {
            Ok(result) => result.map_err(unavailable),
            Err(e) => Err(unavailable(keel_offload::OffloadError::Io {
                op: "check what the thread archived",
                key: thread_id.clone(),
                source: std::io::Error::other(e),
            })),
        }
    }

    /// Tokens of the part of every prompt no compaction shrinks: the system prompt and
    /// the goal (the builder's, unless given here) and the specs of the tools the model
    /// is offered. A thread whose part exceeds the prompt budget (a new one, or one
    /// resumed with a smaller window than it ran with) is refused with
    /// [`AgentError::PromptTooLarge`]; a caller can hold it to a stricter share.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::Agent;
    /// use keel_model::ScriptedModel;
    ///
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::new(Vec::new())))
    ///     .system("You are careful.")
    ///     .goal("Summarize the README.")
    ///     .build()?;
    /// let fixed = agent.fixed_prompt_tokens(None, None);
    /// // A run's own goal replaces the builder's.
    /// let longer = agent.fixed_prompt_tokens(Some(&"word ".repeat(100).into()), None);
    /// assert!(longer > fixed);
    /// # Ok::<(), keel_agent::BuildError>(())
    /// ```
    pub fn fixed_prompt_tokens(
        &self,
        goal: Option<&GoalAnchor>,
        system: Option<&Message>,
    ) -> usize {
        let parts = &self.nodes.parts;
        fixed_tokens(
            parts.counter.as_ref(),
            system.or(self.system.as_ref()),
            goal.or(self.goal.as_ref()),
            parts.tools.specs(),
        )
    }

    /// Fails with [`AgentError::PromptTooLarge`] when a thread's goal, system prompt
    /// and tool specs alone exceed the prompt budget.
    fn check_fixed_part(
        &self,
        thread_id: &str,
        goal: &GoalAnchor,
        system: Option<&Message>,
    ) -> Result<(), AgentError> {
        let tokens = self.fixed_prompt_tokens(Some(goal), system);
        let budget = self.nodes.parts.compactor.prompt_budget();
        if tokens > budget {
            return Err(AgentError::PromptTooLarge {
                thread_id: thread_id.to_owned(),
                tokens,
                budget,
            });
        }
        Ok(())
    }

    /// Fails with [`AgentError::MessageTooLarge`] when `messages`, given to a thread
    /// that has run, do not fit beside its fixed part: they join the newest step, which
    /// compaction keeps whole. (A new thread's first messages can be compacted.)
    fn check_message_fits(
        &self,
        thread_id: &str,
        snap: &keel_graph::StateSnapshot<AgentState>,
        messages: &[Message],
    ) -> Result<(), AgentError> {
        let fixed =
            self.fixed_prompt_tokens(snap.values.goal.as_ref(), snap.values.system.as_ref());
        let budget = self.nodes.parts.compactor.prompt_budget();
        let room = budget.saturating_sub(fixed);
        let tokens = self.nodes.parts.counter.count_messages(messages);
        if tokens > room {
            return Err(AgentError::MessageTooLarge {
                thread_id: thread_id.to_owned(),
                tokens,
                room,
                budget,
            });
        }
        Ok(())
    }

    fn command_for(
        &self,
        thread_id: &str,
        input: AgentInput,
        existing: Option<&keel_graph::StateSnapshot<AgentState>>,
    ) -> Result<Command<AgentState>, AgentError> {
        if let Some(snap) = existing {
            self.check_approvals_asked(thread_id, snap)?;
        }
        if let Some((snap, goal)) = existing.and_then(|s| Some((s, s.values.goal.as_ref()?))) {
            // Resumed with a smaller window than it ran with: no prompt could fit.
            self.check_fixed_part(thread_id, goal, snap.values.system.as_ref())?;
            if self.goal.as_ref().is_some_and(|g| g != goal) {
                tracing::warn!(
                    thread = thread_id,
                    "the builder's goal is not used: the thread keeps the goal it was started with"
                );
            }
        }
        if let Some(answer) = input.resume {
            // A resume only answers the pending question: a message, goal or system
            // prompt beside it would be lost, so it is refused.
            if !input.messages.is_empty() || input.goal.is_some() || input.system.is_some() {
                return Err(AgentError::ResumeWithInput {
                    thread_id: thread_id.to_owned(),
                });
            }
            if let Some(snap) = existing {
                check_question_current(thread_id, snap)?;
            }
            return Ok(Command::resume(answer));
        }
        let mut update = AgentStateUpdate::default();
        match existing {
            Some(snap) if snap.values.goal.is_some() => {
                if input.goal.is_some() {
                    return Err(AgentError::GoalAlreadySet {
                        thread_id: thread_id.to_owned(),
                    });
                }
                if !input.messages.is_empty() && !snap.interrupts.is_empty() {
                    return Err(AgentError::AwaitingAnswer {
                        thread_id: thread_id.to_owned(),
                        count: snap.interrupts.len(),
                    });
                }
                if input.messages.is_empty()
                    && (!snap.next.is_empty() || snap.values.stop.is_none())
                {
                    // Interrupted mid-run: continue where it stopped. Finished with an
                    // answer and given nothing new: there is nothing to do.
                    return Ok(Command::none());
                }
                if !input.messages.is_empty() {
                    self.check_message_fits(thread_id, snap, &input.messages)?;
                }
                let ceiling = self.nodes.compaction().max_steps;
                if input.messages.is_empty()
                    && matches!(snap.values.stop, Some(Stop::StepCeiling { max, .. }) if max == ceiling)
                {
                    // Stopped at the ceiling it still has: a run would only store the
                    // same stop again, one checkpoint more each time.
                    return Ok(Command::none());
                }
            }
            _ => {
                let goal =
                    input
                        .goal
                        .or_else(|| self.goal.clone())
                        .ok_or_else(|| AgentError::NoGoal {
                            thread_id: thread_id.to_owned(),
                        })?;
                if is_blank(&goal.message().content) {
                    return Err(AgentError::EmptyGoal {
                        thread_id: thread_id.to_owned(),
                    });
                }
                let system = input.system.or_else(|| self.system.clone());
                self.check_fixed_part(thread_id, &goal, system.as_ref())?;
                // A new thread's files are scoped to its branches from the start.
                update = update.goal(goal).lineage(Lineage::new());
                if let Some(system) = system {
                    update = update.system(Some(system));
                }
            }
        }
        if !input.messages.is_empty() {
            let step = existing.map_or(0, |s| s.values.step);
            update = update.messages(AddMessagesUpdate::append(input_ids(input.messages, step)));
        }
        Ok(update.stop(None).into())
    }
}

/// Gives each input message without an id one made of where it enters the thread (the
/// model calls made so far, its place in the input) and a hash of its role and content.
/// A run that failed after storing its input (the model's server was down) and is run
/// again with the same input then replaces the messages its first try stored instead
/// of adding them twice; the same text sent after the model has answered is a new
/// message.
fn input_ids(messages: Vec<Message>, step: u64) -> Vec<Message> {
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if m.id.is_some() {
                return m;
            }
            let content = serde_json::to_vec(&(&m.role, &m.content)).unwrap_or_default();
            let hash = xxhash_rust::xxh3::xxh3_64(&content);
            let id = format!("input-{step}-{i}-{hash:016x}");
            m.with_id(id)
        })
        .collect()
}

/// Whether `content` says nothing: no parts, or only whitespace text.
fn is_blank(content: &keel_message::Content) -> bool {
    match content {
        keel_message::Content::Text(t) => t.trim().is_empty(),
        keel_message::Content::Parts(parts) => parts
            .iter()
            .all(|p| p.as_text().is_some_and(|t| t.trim().is_empty())),
    }
}

/// Where a run's model calls are counted in its [`RunConfig::configurable`]: the
/// thread's calls when the run started and the run's budget ([`AgentInput::max_steps`]).
pub(crate) const RUN_BUDGET_KEY: &str = "keel.run_budget";

/// A run's budget of model calls, counted from `start` (the thread's calls before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunBudget {
    pub(crate) start: u64,
    pub(crate) max: u64,
}

impl RunBudget {
    fn to_value(self) -> Value {
        serde_json::json!({"start": self.start, "max": self.max})
    }

    /// The budget a node finds in its run's configuration, if the run has one.
    pub(crate) fn of(config: &serde_json::Map<String, Value>) -> Option<RunBudget> {
        let v = config.get(RUN_BUDGET_KEY)?;
        Some(RunBudget {
            start: v.get("start")?.as_u64()?,
            max: v.get("max")?.as_u64()?,
        })
    }
}

/// Reads the events of a graph's stream as [`Agent::stream`] yields them: for a graph
/// of your own over [`AgentState`] (built from [`AgentNodes`]), streamed with
/// [`StreamMode::updates`](keel_graph::StreamMode::updates). It keeps what it has seen
/// of the run's end (the last answer and stop written) for the final
/// [`AgentUpdate::Done`].
///
/// ```no_run
/// # async fn f(graph: keel_graph::CompiledGraph<keel_agent::AgentState>) -> Result<(), Box<dyn std::error::Error>> {
/// use futures::StreamExt;
/// use keel_agent::{AgentStateUpdate, AgentUpdate, AgentUpdates};
/// use keel_graph::{Command, RunConfig, StreamMode};
///
/// let mut updates = AgentUpdates::new();
/// let mut stream = graph.stream(
///     Command::update(AgentStateUpdate::default()),
///     RunConfig::thread("t1"),
///     StreamMode::updates(),
/// );
/// while let Some(event) = stream.next().await {
///     for update in updates.updates_of(event?) {
///         if let AgentUpdate::Event(e) = update {
///             println!("{e:?}");
///         }
///     }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Default)]
pub struct AgentUpdates {
    answer: Option<String>,
    stop: Option<Stop>,
}

impl AgentUpdates {
    /// A reader that has seen nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The items of one graph event: the agent's events (model and tool calls,
    /// offloads, compactions) of a step, then the messages it wrote; for the run's end,
    /// [`AgentUpdate::Done`]. Other events (values, checkpoints, what nodes emit) give
    /// none.
    pub fn updates_of(&mut self, e: Event<AgentState>) -> Vec<AgentUpdate> {
        match e {
            Event::Updates { update, .. } => {
                let mut events = Vec::new();
                let mut messages = Vec::new();
                for (channel, value) in update {
                    match channel {
                        "events" => {
                            if let Ok(list) = serde_json::from_value::<Vec<AgentEvent>>(value) {
                                events.extend(list.into_iter().map(AgentUpdate::Event));
                            }
                        }
                        "messages" => {
                            if let Ok(u) = serde_json::from_value::<AddMessagesUpdate>(value) {
                                for op in u.into_ops() {
                                    if let MessageOp::Upsert(m) = op {
                                        // The answer is the latest reply without tool calls.
                                        if m.role == keel_message::Role::Assistant {
                                            self.answer = m
                                                .tool_calls
                                                .is_empty()
                                                .then(|| m.text().into_owned());
                                        }
                                        messages.push(AgentUpdate::Message(m));
                                    }
                                }
                            }
                        }
                        "stop" => {
                            if let Ok(stop) = serde_json::from_value::<Option<Stop>>(value) {
                                self.stop = stop;
                            }
                        }
                        _ => {}
                    }
                }
                events.extend(messages);
                events
            }
            Event::Done {
                next,
                interrupts,
                stopped,
                ..
            } => {
                let finished = next.is_empty() && self.stop.is_none();
                vec![AgentUpdate::Done {
                    answer: if finished { self.answer.take() } else { None },
                    stop: self
                        .stop
                        .take()
                        .or_else(|| stopped.then_some(Stop::Requested)),
                    next,
                    interrupts,
                }]
            }
            _ => Vec::new(),
        }
    }
}

/// Builds an [`Agent`]. Only the model is required; everything else has a default
/// that suits a production agent.
#[must_use]
pub struct AgentBuilder {
    model: Option<Arc<dyn ChatModel>>,
    options: ChatOptions,
    tools: Vec<Arc<dyn Tool>>,
    retrieval: bool,
    #[cfg(feature = "fs")]
    file: Option<crate::tools::FileTools>,
    goal: Option<GoalAnchor>,
    system: Option<Message>,
    compaction: CompactionConfig,
    profile: Option<ModelProfile>,
    counter: Option<Arc<dyn TokenCounter>>,
    calibrate: Option<bool>,
    summarizer: Option<Arc<dyn Summarizer>>,
    store: Option<Arc<dyn OffloadStore>>,
    checkpointer: Option<Arc<dyn Checkpointer>>,
    keep_checkpoints: Option<usize>,
    tool_timeout: Option<Duration>,
    max_tool_calls: Option<usize>,
    max_repeats: Option<usize>,
    evict: Option<Option<EvictLargeResults>>,
    limits: ToolLimits,
    approve: BTreeSet<String>,
    durability: Durability,
    replaced: BTreeMap<String, BoxedNode>,
    wrapped: Vec<(String, Wrapper)>,
    reroutes: Vec<Reroute>,
    customize: Vec<Customize>,
}

/// One [`AgentBuilder::reroute`]: where the route out of `from` would go to `to`, it
/// goes to `via`.
struct Reroute {
    from: String,
    to: String,
    via: String,
}

impl Default for AgentBuilder {
    fn default() -> Self {
        AgentBuilder {
            model: None,
            options: ChatOptions::default(),
            tools: Vec::new(),
            retrieval: true,
            #[cfg(feature = "fs")]
            file: None,
            goal: None,
            system: None,
            compaction: CompactionConfig::default(),
            profile: None,
            counter: None,
            calibrate: None,
            summarizer: None,
            store: None,
            checkpointer: None,
            keep_checkpoints: Some(DEFAULT_KEEP_CHECKPOINTS),
            tool_timeout: None,
            max_tool_calls: None,
            max_repeats: Some(DEFAULT_MAX_REPEATED_CALLS),
            evict: None,
            limits: ToolLimits::default(),
            approve: BTreeSet::new(),
            durability: Durability::Sync,
            replaced: BTreeMap::new(),
            wrapped: Vec::new(),
            reroutes: Vec::new(),
            customize: Vec::new(),
        }
    }
}

impl std::fmt::Debug for AgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBuilder")
            .field(
                "model",
                &self.model.as_ref().map(|m| m.model_name().to_owned()),
            )
            .field("tools", &self.tools.len())
            .field("compaction", &self.compaction)
            .finish_non_exhaustive()
    }
}

impl AgentBuilder {
    /// The chat model (required). Its name picks the model profile (window, output
    /// limit, tokenizer) from the builtin profiles; a model whose name is not a known
    /// one (a local model, a test double) should get one with [`AgentBuilder::profile`].
    pub fn model(mut self, model: Arc<dyn ChatModel>) -> Self {
        self.model = Some(model);
        self
    }

    /// Options of every model call (model name, temperature, max tokens, timeout). The
    /// profile keeps `max_tokens` free for the reply; more than a quarter of the window
    /// is refused at build ([`BuildError::ReplyCapTooLarge`]). Left unset, `max_tokens`
    /// is the profile's reply reserve (at most a quarter of the window): a reply the
    /// prompt budget did not keep room for would overflow the next call's context.
    pub fn options(mut self, options: ChatOptions) -> Self {
        self.options = options;
        self
    }

    /// Adds tools. Names are unique: a name given twice, here or by the
    /// [file tools](Self::file_tools), fails [`build`](Self::build) with
    /// [`BuildError::DuplicateTool`]. Only the default retrieval tools yield: a tool of
    /// yours named `ls`, `read_file` or `grep` takes the place of that one.
    pub fn tools(mut self, tools: impl IntoIterator<Item = Arc<dyn Tool>>) -> Self {
        self.tools.extend(tools);
        self
    }

    /// Adds one tool (see [`tools`](Self::tools) for names given twice).
    pub fn tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.push(tool);
        self
    }

    /// Adds the file tools (`ls`, `read_file`, `grep`, `write_file`, `edit_file`) rooted
    /// in `tools`' directory (one set: a second call replaces the first). They also
    /// read the offload store (`large_tool_results/`, `archive/`), so they replace the
    /// default retrieval tools. Their results are capped
    /// by their limits (30,000 characters by default) and are never offloaded (the
    /// offload policy exempts reads, so reading an offloaded file back cannot loop).
    /// [`FileTools`](crate::tools::FileTools) lists the arguments each one takes.
    #[cfg(feature = "fs")]
    pub fn file_tools(mut self, tools: crate::tools::FileTools) -> Self {
        self.retrieval = false;
        self.file = Some(tools);
        self
    }

    /// Whether `ls`, `read_file` and `grep` over the offload store are registered
    /// (default on; off when file tools are added, which read the store themselves).
    pub fn retrieval_tools(mut self, on: bool) -> Self {
        self.retrieval = on;
        self
    }

    /// The goal of new threads (a run's [`AgentInput::goal`] takes precedence). A thread
    /// keeps the goal it was started with: on a thread that has one, this goal is not
    /// used (a `tracing` warning is logged when it differs; the run's
    /// [`AgentRun::state`] holds the goal the thread runs with), while
    /// [`AgentInput::goal`] there is an error ([`AgentError::GoalAlreadySet`]).
    pub fn goal(mut self, goal: impl Into<GoalAnchor>) -> Self {
        self.goal = Some(goal.into());
        self
    }

    /// The system prompt of new threads.
    pub fn system(mut self, system: impl Into<String>) -> Self {
        self.system = Some(Message::system(system.into()));
        self
    }

    /// Compaction settings: triggers, strategy, budgets, step ceiling.
    ///
    /// A run stops after [`MAX_FAILED_COMPACTIONS`](crate::MAX_FAILED_COMPACTIONS) (3)
    /// compactions fail in a row, so a
    /// [`fallback_after_failures`](CompactionConfig::fallback_after_failures) of 3 or
    /// more never comes into play in an agent: it acts as `None` (the fallback only
    /// when the context would overflow).
    pub fn compaction(mut self, config: CompactionConfig) -> Self {
        self.compaction = config;
        self
    }

    /// The model's window and output limits (default: the builtin profile for the
    /// model's name; an unknown name gets the conservative default, reported by an
    /// [`AgentEvent::ProfileFallback`] at the first step). Without a profile given, a
    /// model client that runs the model with a smaller window of its own
    /// ([`ChatModel::context_window`]: an `OllamaModel`'s `num_ctx`) narrows the
    /// builtin profile to it; a profile given is used as it is (with a warning then).
    pub fn profile(mut self, profile: ModelProfile) -> Self {
        self.profile = Some(profile);
        self
    }

    /// How tokens are counted (default: the profile's counter, memoized per message).
    /// A counter given here is used as it is, each step counting the whole context
    /// again; wrap a costly one in [`keel_token::MemoCounter`] (a counter whose counts
    /// change over time, as a calibrated one, must not be memoized).
    pub fn counter(mut self, counter: Arc<dyn TokenCounter>) -> Self {
        self.counter = Some(counter);
        self
    }

    /// Whether token counts learn from the prompt sizes the provider reports. Default:
    /// on when the counts are estimates (a model keel has no tokenizer for, whose
    /// profile [`counts_exactly`](ModelProfile::counts_exactly) is false) and no
    /// [`counter`](Self::counter) was given; off otherwise.
    ///
    /// keel's estimate for such a model is meant to be at or above any tokenizer's
    /// count, so it is often well above the server's (1.3x to 2.3x was measured
    /// against a llama.cpp server), and compaction would start with much of the window
    /// unused. Calibrated, the agent learns a factor that follows the ratio of the
    /// server's `prompt_tokens` to keel's count after each model call
    /// ([`keel_token::CalibratedCounter`], a moving average of weight
    /// [`CALIBRATION_SMOOTHING`]), with a tenth kept in hand, kept within
    /// [`CALIBRATION_BOUNDS`], and plans with the input budget divided by it
    /// ([`Compactor::with_count_factor`](keel_compaction::Compactor::with_count_factor)):
    /// the counts themselves (events, summaries, stored states) stay keel's. The factor
    /// starts at 1 in each process, is shared by the agent's threads (it measures the
    /// model's tokenizer, not a thread), and only moves on calls whose provider
    /// reported usage. A prompt the server still finds too long is a context overflow,
    /// which compacts and retries once, as always. [`Agent::count_factor`] reads it.
    /// [`CompactionConfig::max_prompt_tokens`](keel_compaction::CompactionConfig::max_prompt_tokens)
    /// is in keel's counts and is not scaled.
    pub fn calibrate(mut self, on: bool) -> Self {
        self.calibrate = Some(on);
        self
    }

    /// Who writes milestones and epochs (default: the offline extractive summarizer).
    pub fn summarizer(mut self, summarizer: Arc<dyn Summarizer>) -> Self {
        self.summarizer = Some(summarizer);
        self
    }

    /// Where large results and the archive go (default: in memory, for this process
    /// only; with a durable [`checkpointer`](Self::checkpointer) there is no default and
    /// [`build`](Self::build) fails with [`BuildError::EphemeralOffloadStore`]). A
    /// durable agent needs a durable store, shared by every run of a thread:
    /// `keel_offload::SqliteStore` (it can share the `SqliteSaver`'s file),
    /// `keel_offload::FsStore` or `keel_offload::PostgresStore`. A thread resumed
    /// without the store its checkpoints archived into cannot compact any more, so
    /// [`Agent::run`] checks first (a few size queries) and fails with
    /// [`AgentError::ArchiveUnavailable`], leaving the thread as it was.
    pub fn offload_store(mut self, store: Arc<dyn OffloadStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// The checkpointer (default: none; each run is then a fresh, unsaved thread).
    pub fn checkpointer(mut self, checkpointer: Arc<dyn Checkpointer>) -> Self {
        self.checkpointer = Some(checkpointer);
        self
    }

    /// Checkpoints kept by each compaction step (default 5; `None` keeps all; `Some(0)`
    /// is refused at build, [`BuildError::KeepNoCheckpoints`]): the step
    /// prunes the thread to the newest `keep` stored checkpoints while its summary is
    /// written, and once the compaction succeeded removes the offloaded files only the
    /// pruned checkpoints saw. With [`Durability::Sync`] (or an in-memory saver) the
    /// step waits for the prune; with `Async` or `Exit` the prune goes on in the
    /// background, as the step's writes do, and the thread's next compaction step, or
    /// the end of the run, waits for it
    /// ([`AgentNodes::settle`](crate::AgentNodes::settle)). Pruning goes through the builder's
    /// [`AgentBuilder::checkpointer`] (also when the nodes are reused in a graph of your
    /// own: give the builder the same one).
    pub fn keep_checkpoints(mut self, keep: Option<usize>) -> Self {
        self.keep_checkpoints = keep;
        self
    }

    /// The time one tool call may take (default 120 s). Past it the model is told the
    /// call timed out and the call's task is dropped at its next `.await`. Work a tool
    /// runs on other threads (`spawn_blocking`, a child process) is not stopped by
    /// that: give such a tool a deadline of its own. A tool that blocks its thread
    /// inside its future (`std::thread::sleep`, blocking I/O) holds a runtime worker
    /// the timeout needs, so the step waits for it: put such work on
    /// `tokio::task::spawn_blocking`. Zero is refused at build
    /// ([`BuildError::BadSetting`]).
    pub fn tool_timeout(mut self, timeout: Duration) -> Self {
        self.tool_timeout = Some(timeout);
        self
    }

    /// The most tool calls one reply may ask for (default: the prompt budget, the
    /// window less the reply's reserve, over [`TOKENS_PER_TOOL_CALL`], at least 1: 48
    /// for a 4,096-token window with 1,024 kept for the reply, 1,984 for 128,000;
    /// 0 is refused at build, [`BuildError::BadSetting`]). None of the calls of a
    /// reply that asks for more is run or stored, since they and their results could
    /// leave a step no prompt can hold, and a thread whose newest step cannot fit can
    /// never go on (120 one-line calls at a 4,096-token window did that). The reply's
    /// text is kept, and the model is told once to call fewer tools at a time; a second
    /// such reply in a row stops the run with
    /// [`Stop::TooManyToolCalls`](crate::Stop::TooManyToolCalls), which running the
    /// thread again resumes.
    ///
    /// ```
    /// # use keel_agent::Agent;
    /// let builder = Agent::builder().max_tool_calls(8);
    /// ```
    pub fn max_tool_calls(mut self, max: usize) -> Self {
        self.max_tool_calls = Some(max);
        self
    }

    /// After how many replies in a row calling one tool with the same arguments the
    /// call is not run again (default [`DEFAULT_MAX_REPEATED_CALLS`], 5: the sixth is
    /// answered "not run" with [`ToolFailure::Repeated`](crate::ToolFailure::Repeated);
    /// `None` runs every call). Small models loop on one call (the same file read 30
    /// times in a row was seen), and each result fills the context again. Arguments
    /// compare as JSON values (spacing and key order do not matter). The count reads
    /// the replies in the context and, before them, the recent tool calls of the
    /// event log (their [`call_fingerprint`](crate::call_fingerprint)), so a milestone
    /// does not start it over; any other reply does, and so does a message from the
    /// user still in the context. A tool meant to be polled with the same arguments
    /// needs `None` or a higher limit; 0 is refused at build
    /// ([`BuildError::BadSetting`]).
    ///
    /// ```
    /// # use keel_agent::Agent;
    /// let builder = Agent::builder().max_repeated_calls(Some(3));
    /// ```
    pub fn max_repeated_calls(mut self, max: Option<usize>) -> Self {
        self.max_repeats = max;
        self
    }

    /// The policy for large tool results (default:
    /// [`EvictLargeResults::for_budget`] of the input budget: results over the smaller
    /// of 20,000 tokens and a quarter of the budget go to the offload store, with stubs
    /// sized to fit a small window; start from it to change one thing). `None` keeps
    /// in full every result a prompt could hold: one over half the input budget, which
    /// would overflow every later model call of the thread, is offloaded all the same.
    pub fn evict(mut self, policy: Option<EvictLargeResults>) -> Self {
        self.evict = Some(policy);
        self
    }

    /// Output limits of the retrieval tools. Left at their defaults, the retrieval and
    /// file tools' limits are [`ToolLimits::for_budget`] of the model's input budget
    /// (output cut to the budget in characters, about a quarter of it in tokens, and
    /// fewer lines a read on a small window), so one result cannot fill a small
    /// window; set limits here (or on `FileTools`) to choose them yourself.
    pub fn tool_limits(mut self, limits: ToolLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Asks before running these tools: the run pauses with an interrupt whose value
    /// lists the calls, `{"approve": [{"id", "name", "arguments"}, ..]}` (`arguments`
    /// as the model wrote them, a JSON string). The reply's other calls, those needing
    /// no approval among them, wait for the answer too. Answer with
    /// [`AgentInput::resume`]:
    ///
    /// - `true` or `"yes"` (`"ok"`, `"approve"`) approves every call, `false` or `"no"`
    ///   (`"deny"`, `"reject"`) denies every one;
    /// - `{"approved": false, "reason": "use staging"}` denies every call and tells the
    ///   model why (the reason is what its tool results say);
    /// - `{"<call id>": <one of the above>, ..}` decides per call, and must name every
    ///   call asked about;
    /// - `["<call id>", ..]` approves the calls listed and denies the rest.
    ///
    /// Any other answer, a map naming a call not asked about (a typo) or leaving one
    /// out among them, is asked again, with the question's `not_understood` field
    /// holding it: it is never read as a no. Each name must be one of the agent's tools
    /// ([`BuildError::UnknownApprovalTool`]), and the pause needs a checkpointer
    /// ([`BuildError::ApprovalNeedsCheckpointer`]).
    ///
    /// The question is asked of the calls as the thread holds them when the node
    /// runs. A resume after a call was edited under the pending question (the stored
    /// reply changed with `update_state`) is refused with [`AgentError::StaleQuestion`]:
    /// run the thread with `AgentInput::new()` to be asked about the calls as they are.
    /// To have the model change a call, deny it with a reason.
    pub fn approve(mut self, tools: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.approve.extend(tools.into_iter().map(Into::into));
        self
    }

    /// When checkpoints are written (default [`Durability::Sync`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Replaces one of the nodes (`agent`, `tools`, `compact`, `epoch`) with your own;
    /// the others and the routing stay. To wrap a node rather than replace it (an
    /// audit log, a policy check before the tools run), use [`AgentBuilder::wrap`].
    /// Another name adds a node of that name, to be put between two of the agent's
    /// with [`AgentBuilder::reroute`], or connected with [`AgentBuilder::customize`];
    /// one left unconnected fails the build with [`BuildError::UnconnectedNode`] (a
    /// misspelt name of a node to replace does).
    pub fn node<F, Fut, R>(mut self, name: &str, node: F) -> Self
    where
        F: Fn(Arc<AgentState>, NodeContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, NodeError>> + Send + 'static,
        R: Into<Command<AgentState>>,
    {
        let node = Arc::new(node);
        let boxed: BoxedNode = Arc::new(move |s, ctx| {
            let fut = node(s, ctx);
            Box::pin(async move { fut.await.map(Into::into) })
        });
        self.replaced.insert(name.to_owned(), boxed);
        self
    }

    /// Wraps the node `name` (one of `agent`, `tools`, `compact`, `epoch`, or one given
    /// with [`AgentBuilder::node`]): `wrapper` gets the state, the node's context and
    /// [`Next`], the node it wraps, and decides whether and when to run it. Wrappers of
    /// one node nest, the last given outermost. A name that is no node fails the build
    /// with [`BuildError::UnknownNode`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use keel_agent::{Agent, AgentInput, TOOLS};
    /// use keel_message::ToolCall;
    /// use keel_model::{ScriptedModel, Turn};
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let model = ScriptedModel::new([
    ///     Turn::tool_calls("Looking.", vec![ToolCall::new("c1", "grep", json!({"pattern": "x", "path": "archive"}))]),
    ///     Turn::text("done"),
    /// ]);
    /// let calls = Arc::new(AtomicUsize::new(0));
    /// let seen = calls.clone();
    /// let agent = Agent::builder()
    ///     .model(Arc::new(model))
    ///     .goal("Say what the archive holds.")
    ///     .wrap(TOOLS, move |state, ctx, next| {
    ///         // An audit log, a policy check, a timer: then the node it wraps.
    ///         seen.fetch_add(1, Ordering::Relaxed);
    ///         next.run(state, ctx)
    ///     })
    ///     .build()?;
    /// let run = agent.run("t1", AgentInput::new()).await?;
    /// assert_eq!(run.answer.as_deref(), Some("done"));
    /// assert_eq!(calls.load(Ordering::Relaxed), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wrap<F, Fut, R>(mut self, name: &str, wrapper: F) -> Self
    where
        F: Fn(Arc<AgentState>, NodeContext, Next) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, NodeError>> + Send + 'static,
        R: Into<Command<AgentState>>,
    {
        let wrapper = Arc::new(wrapper);
        let wrap: Wrapper = Arc::new(move |inner: BoxedNode| -> BoxedNode {
            let wrapper = wrapper.clone();
            Arc::new(move |s, ctx| {
                let fut = wrapper(
                    s,
                    ctx,
                    Next {
                        node: inner.clone(),
                    },
                );
                Box::pin(async move { fut.await.map(Into::into) })
            })
        });
        self.wrapped.push((name.to_owned(), wrap));
        self
    }

    /// Puts a node of your own on one of the agent's routes: where the route out of
    /// `from` (`agent`, `tools`, `compact` or `epoch`) would go to `to`, it goes to
    /// `via` instead. Give `via` with [`AgentBuilder::node`] and lead it on with
    /// [`AgentBuilder::customize`] (usually an edge to `to`). A route `from` does not
    /// have fails the build with [`BuildError::NoSuchRoute`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::{Agent, AgentState, AgentStateUpdate, AGENT, TOOLS};
    /// use keel_model::{ScriptedModel, Turn};
    ///
    /// // A critic between the model's reply and the tools.
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::new(Vec::<Turn>::new())))
    ///     .node("critic", |_state: Arc<AgentState>, _ctx| async { Ok(AgentStateUpdate::default()) })
    ///     .reroute(AGENT, TOOLS, "critic")
    ///     .customize(|g| g.add_edge("critic", TOOLS))
    ///     .build()?;
    /// # Ok::<(), keel_agent::BuildError>(())
    /// ```
    pub fn reroute(mut self, from: &str, to: &str, via: &str) -> Self {
        self.reroutes.push(Reroute {
            from: from.to_owned(),
            to: to.to_owned(),
            via: via.to_owned(),
        });
        self
    }

    /// Changes the graph before it is compiled: add nodes and edges of your own. The
    /// agent's routes are its own: a route added out of `agent`, `tools`, `compact` or
    /// `epoch` would run its target beside the agent's (the model called twice a step,
    /// or tool calls left without results), so it fails the build with
    /// [`BuildError::RouteAdded`]; put a node on a route with [`AgentBuilder::reroute`].
    pub fn customize(
        mut self,
        f: impl FnOnce(StateGraph<AgentState>) -> StateGraph<AgentState> + Send + 'static,
    ) -> Self {
        self.customize.push(Box::new(f));
        self
    }

    /// Builds only the nodes and routers ([`AgentNodes`]), for a graph of your own: no
    /// model is needed when the graph uses only the compaction nodes (without one, the
    /// `agent` node fails with a model error saying so). Give this builder the saver
    /// your graph stores its checkpoints in and a lasting offload store: the nodes
    /// prune and archive through them, and without them prune nothing and archive in
    /// memory (see [`AgentNodes`]).
    pub fn build_nodes(mut self) -> Result<AgentNodes, BuildError> {
        if self.model.is_none() {
            self.model = Some(Arc::new(NoModel));
        }
        Ok(self.build()?.nodes)
    }

    /// Builds the agent.
    pub fn build(self) -> Result<Agent, BuildError> {
        let model = self.model.ok_or(BuildError::NoModel)?;
        self.compaction.validate().map_err(BuildError::Compaction)?;
        let explicit_profile = self.profile.is_some();
        let (profile, profile_fallback) = match self.profile {
            Some(p) => (p, false),
            None => {
                let profiles = ModelProfiles::new();
                let name = self.options.model.as_deref().unwrap_or(model.model_name());
                match profiles.get(name) {
                    Some(p) => (p.clone(), false),
                    None => (profiles.default_profile().clone(), true),
                }
            }
        };
        // A client that runs the model with a window of its own (Ollama's `num_ctx`)
        // bounds the prompt: a server drops what does not fit, silently.
        let mut profile = profile;
        if let Some(window) = model.context_window()
            && window < profile.context_window
        {
            if explicit_profile {
                tracing::warn!(
                    model = %profile.name,
                    profile_window = profile.context_window,
                    client_window = window,
                    "the profile's window is larger than the one the model client runs with; prompts may be cut by the server"
                );
            } else {
                profile.context_window = window;
                profile.max_output_tokens = profile.max_output_tokens.min(window / 4);
            }
        }
        // The reply cap asked of every call must fit what the profile keeps free for
        // the reply (at most a quarter of the window): a longer reply beside a prompt
        // at its budget would overflow the server's context.
        if let Some(cap) = self.options.max_tokens.map(|n| n as usize) {
            let quarter = profile.context_window / 4;
            if cap > quarter {
                return Err(BuildError::ReplyCapTooLarge {
                    model: profile.name.clone(),
                    max_tokens: cap,
                    window: profile.context_window,
                });
            }
            profile.max_output_tokens = profile.max_output_tokens.max(cap);
        }
        let mut options = self.options;
        if options.max_tokens.is_none() {
            // Ask for no more than the room kept free for the reply: a longer one,
            // kept in the raw tail beside a full prompt, would overflow every later
            // call of the thread with nothing left to compact.
            let reserve = profile
                .max_output_tokens
                .min(profile.context_window / 4)
                .max(1);
            options.max_tokens = Some(u32::try_from(reserve).unwrap_or(u32::MAX));
        }
        let calibrate = self
            .calibrate
            .unwrap_or(self.counter.is_none() && !profile.counts_exactly());
        let counter: Arc<dyn TokenCounter> = match self.counter {
            Some(c) => c,
            None => Arc::new(MemoCounter::new(profile.counter().map_err(|e| {
                BuildError::Counter {
                    model: profile.name.clone(),
                    reason: e.to_string(),
                }
            })?)),
        };
        let calibration = if calibrate {
            let calibrated = CalibratedCounter::new(counter.clone())
                .with_smoothing(CALIBRATION_SMOOTHING)
                .and_then(|c| c.with_bounds(CALIBRATION_BOUNDS.0, CALIBRATION_BOUNDS.1))
                .map_err(|e| BuildError::Counter {
                    model: profile.name.clone(),
                    reason: e.to_string(),
                })?;
            Some(Arc::new(calibrated))
        } else {
            None
        };

        if self.store.is_none() && self.checkpointer.as_ref().is_some_and(|c| c.is_durable()) {
            return Err(BuildError::EphemeralOffloadStore);
        }
        let store: Arc<dyn OffloadStore> =
            self.store.unwrap_or_else(|| Arc::new(MemoryStore::new()));
        let mut toolbox = Toolbox::new();
        if let Some(t) = self.tool_timeout {
            toolbox.set_timeout(t);
        }
        // Tool limits left at their defaults (30,000 characters, about 7,500 tokens;
        // 100 lines a read) are sized to the model's input budget
        // (`ToolLimits::for_budget`), so one read cannot fill a small window.
        let fit = |l: ToolLimits| {
            if l == ToolLimits::default() {
                ToolLimits::for_budget(profile.input_budget())
            } else {
                l
            }
        };
        let limits = fit(self.limits);
        #[allow(unused_mut)]
        let mut tools = self.tools;
        #[cfg(feature = "fs")]
        if let Some(mut file) = self.file {
            let file_limits = fit(*file.limits());
            if file.brief_specs().is_none() {
                let brief = profile.input_budget() < crate::tools::BRIEF_SPECS_BELOW;
                file = file.with_brief_specs(brief);
            }
            tools.extend(
                file.with_limits(file_limits)
                    .with_offload(store.clone())
                    .tools(),
            );
        }
        for t in tools {
            check_spec(&t.spec())?;
            toolbox
                .add(t)
                .map_err(|name| BuildError::DuplicateTool { name })?;
        }
        if self.retrieval {
            for t in retrieval_tools(store.clone(), limits) {
                let name = t.spec().name;
                if !toolbox.contains(&name) {
                    toolbox
                        .add(t)
                        .map_err(|name| BuildError::DuplicateTool { name })?;
                }
            }
        }
        if let Some(name) = self.approve.iter().find(|n| !toolbox.contains(n)) {
            let specs = toolbox.specs();
            return Err(BuildError::UnknownApprovalTool {
                name: name.clone(),
                tools: specs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if self.keep_checkpoints == Some(0) {
            return Err(BuildError::KeepNoCheckpoints);
        }
        if self.max_tool_calls == Some(0) {
            return Err(BuildError::BadSetting {
                setting: "max_tool_calls",
                reason: "0 would refuse every reply that calls a tool; give at least 1".into(),
            });
        }
        if self.max_repeats == Some(0) {
            return Err(BuildError::BadSetting {
                setting: "max_repeated_calls",
                reason: "Some(0) would run no call at all; give Some(n) with n of at least 1, or None to run every call".into(),
            });
        }
        if self.tool_timeout == Some(Duration::ZERO) {
            return Err(BuildError::BadSetting {
                setting: "tool_timeout",
                reason: "a zero timeout would time out every tool call that has to wait; give a positive duration".into(),
            });
        }
        if !self.approve.is_empty() && self.checkpointer.is_none() {
            return Err(BuildError::ApprovalNeedsCheckpointer);
        }
        let evict = match self.evict {
            None => EvictLargeResults::for_budget(profile.input_budget()),
            Some(Some(policy)) => policy,
            // Kept in full, unless no prompt could hold it beside the rest: such a
            // result would overflow every model call of the thread from then on.
            Some(None) => {
                EvictLargeResults::new().with_threshold((profile.input_budget() / 2).max(1))
            }
        };
        let compaction = self.compaction.with_epoch_inline(false);
        // The default summarizer measures its budget in the model's tokens, as the
        // compactor that sets it does.
        let summarizer = self
            .summarizer
            .unwrap_or_else(|| Arc::new(ExtractiveSummarizer::new().with_counter(counter.clone())));
        let archive = Arc::new(Archive::new(store.clone()));
        let compactor = Compactor::new(
            summarizer,
            archive,
            ThreadId::new(NO_THREAD).map_err(|e| BuildError::Counter {
                model: profile.name.clone(),
                reason: e.to_string(),
            })?,
            counter.clone(),
            profile.clone(),
        )
        .with_config(compaction.clone())
        .with_evict(None)
        .with_tools(toolbox.shared_specs());
        // The part of every prompt no compaction shrinks must fit the prompt budget,
        // or no thread could ever call the model: said now rather than at each run.
        let tokens = fixed_tokens(
            counter.as_ref(),
            self.system.as_ref(),
            self.goal.as_ref(),
            toolbox.specs(),
        );
        let budget = compactor.prompt_budget();
        if tokens > budget {
            return Err(BuildError::PromptTooLarge {
                model: profile.name.clone(),
                tokens,
                budget,
            });
        }
        if tokens > budget / 2 {
            // It can run, but every prompt starts more than half full: compaction
            // fires almost every step and each milestone frees little.
            tracing::warn!(
                model = %profile.name,
                tokens,
                budget,
                "the system prompt, goal and tool specs take over half the prompt budget; give a larger window, fewer tools or a shorter system prompt, or compaction will run at almost every step"
            );
        }
        let keep = compaction.keep_recent(budget);
        if keep > budget / 2 {
            // Each milestone keeps that much raw history: a prompt near the budget
            // frees little, and compaction runs again at almost every step.
            tracing::warn!(
                model = %profile.name,
                keep_recent_tokens = keep,
                budget,
                "keep_recent_tokens is over half the prompt budget: each milestone would free little; give a smaller keep_recent_tokens or a larger window"
            );
        }
        let parts = Parts {
            model,
            options,
            tools: toolbox,
            store,
            counter,
            calibration,
            profile,
            profile_fallback,
            compaction,
            evict,
            keep_checkpoints: self.keep_checkpoints,
            checkpointer: self.checkpointer.clone(),
            approve: self.approve,
            max_repeats: self.max_repeats,
            max_tool_calls: self
                .max_tool_calls
                .unwrap_or((budget / TOKENS_PER_TOOL_CALL).max(1)),
            compactor,
            prunes: Default::default(),
        };
        let nodes = AgentNodes {
            parts: Arc::new(parts),
        };
        let mut all: Vec<(String, BoxedNode)> = Vec::new();
        let mut replaced = self.replaced;
        for (name, standard) in [
            (AGENT, boxed(nodes.agent())),
            (TOOLS, boxed(nodes.tools())),
            (COMPACT, boxed(nodes.compact())),
            (EPOCH, boxed(nodes.epoch())),
        ] {
            all.push((name.to_owned(), replaced.remove(name).unwrap_or(standard)));
        }
        let added: Vec<String> = replaced.keys().cloned().collect();
        all.extend(replaced);
        for (name, wrap) in &self.wrapped {
            let Some((_, node)) = all.iter_mut().find(|(n, _)| n == name) else {
                return Err(BuildError::UnknownNode { name: name.clone() });
            };
            *node = wrap(node.clone());
        }
        let mut graph = StateGraph::<AgentState>::new();
        for (name, node) in all {
            graph = graph.add_node(name, move |s, ctx| node(s, ctx));
        }
        let reroutes = self.reroutes;
        let route = |from: &str, targets: &[&str]| -> Result<Vec<(String, String)>, BuildError> {
            let mut map: Vec<(String, String)> = targets
                .iter()
                .map(|t| ((*t).to_owned(), (*t).to_owned()))
                .collect();
            for r in reroutes.iter().filter(|r| r.from == from) {
                let Some(slot) = map.iter_mut().find(|(to, _)| *to == r.to) else {
                    return Err(BuildError::NoSuchRoute {
                        from: r.from.clone(),
                        to: r.to.clone(),
                        routes: targets.join(", "),
                    });
                };
                slot.1.clone_from(&r.via);
            }
            Ok(map)
        };
        if let Some(r) = reroutes
            .iter()
            .find(|r| ![AGENT, TOOLS, COMPACT, EPOCH].contains(&r.from.as_str()))
        {
            return Err(BuildError::NoSuchRoute {
                from: r.from.clone(),
                to: r.to.clone(),
                routes: String::new(),
            });
        }
        graph = graph.add_edge(START, AGENT);
        graph = routed(
            graph,
            AGENT,
            nodes.route_after_agent(),
            route(AGENT, &[TOOLS, AGENT, END])?,
        );
        graph = routed(
            graph,
            TOOLS,
            nodes.route_after_tools(),
            route(TOOLS, &[COMPACT, AGENT])?,
        );
        graph = routed(
            graph,
            COMPACT,
            nodes.route_after_compact(),
            route(COMPACT, &[EPOCH, AGENT])?,
        );
        if let [(_, to)] = route(EPOCH, &[AGENT])?.as_slice() {
            graph = graph.add_edge(EPOCH, to.as_str());
        }
        if let Some(cp) = &self.checkpointer {
            graph = graph.with_checkpointer(cp.clone());
        }
        let own_routes = [AGENT, TOOLS, COMPACT, EPOCH].map(|n| graph.routes_from(n));
        for f in self.customize {
            graph = f(graph);
        }
        for (name, before) in [AGENT, TOOLS, COMPACT, EPOCH].iter().zip(own_routes) {
            if graph.routes_from(name) != before {
                return Err(BuildError::RouteAdded {
                    node: (*name).to_owned(),
                });
            }
        }
        let graph = graph.compile().map_err(|e| match e {
            // A node `node` added that leads nowhere: most likely a misspelt name of a
            // node to replace.
            keel_graph::BuildError::CannotReachEnd { node } if added.contains(&node) => {
                BuildError::UnconnectedNode { name: node }
            }
            e => BuildError::Graph(e),
        })?;
        Ok(Agent {
            running: Default::default(),
            graph,
            nodes,
            goal: self.goal,
            system: self.system,
            checkpointer: self.checkpointer,
            durability: self.durability,
        })
    }
}

/// Adds `from`'s route: `router`'s choice, sent on as `map` says (each target with
/// where it now leads, after [`AgentBuilder::reroute`]).
fn routed(
    graph: StateGraph<AgentState>,
    from: &str,
    router: impl Fn(&AgentState) -> &'static str + Send + Sync + 'static,
    map: Vec<(String, String)>,
) -> StateGraph<AgentState> {
    let targets: Vec<String> = map.iter().map(|(_, to)| to.clone()).collect();
    let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
    if map.iter().all(|(to, via)| to == via) {
        // Not rerouted: the router as it is, with no lookup on the step's path.
        return graph.add_conditional_edges(from, router, Some(&targets));
    }
    graph.add_conditional_edges(
        from,
        move |s: &AgentState| {
            let choice = router(s);
            map.iter()
                .find(|(to, _)| to == choice)
                .map_or_else(|| choice.to_owned(), |(_, via)| via.clone())
        },
        Some(&targets),
    )
}

/// Tokens of the part of every prompt no compaction shrinks: the system prompt, the
/// goal and the tools' specs.
fn fixed_tokens(
    counter: &dyn TokenCounter,
    system: Option<&Message>,
    goal: Option<&GoalAnchor>,
    specs: &[keel_message::ToolSpec],
) -> usize {
    let fixed: Vec<Message> = system
        .into_iter()
        .cloned()
        .chain(goal.map(|g| g.message().clone()))
        .collect();
    counter.count_prompt(&fixed, specs)
}

fn boxed<F>(f: F) -> BoxedNode
where
    F: Fn(
            Arc<AgentState>,
            NodeContext,
        ) -> futures::future::BoxFuture<'static, Result<AgentStateUpdate, NodeError>>
        + Send
        + Sync
        + 'static,
{
    Arc::new(move |s, ctx| {
        let fut = f(s, ctx);
        Box::pin(async move { fut.await.map(Into::into) })
    })
}

impl Agent {
    /// Refuses a thread that waits for the approval of calls to tools this agent runs
    /// without asking (built without `approve`, or with another list): running it
    /// would run the calls a human was asked about, whatever they answer.
    fn check_approvals_asked(
        &self,
        thread_id: &str,
        snap: &keel_graph::StateSnapshot<AgentState>,
    ) -> Result<(), AgentError> {
        let mut tools: Vec<String> = asked_calls(snap)
            .filter_map(|asked| asked.get("name").and_then(Value::as_str))
            .filter(|name| !self.nodes.parts.approve.contains(*name))
            .map(str::to_owned)
            .collect();
        tools.sort_unstable();
        tools.dedup();
        if tools.is_empty() {
            return Ok(());
        }
        Err(AgentError::ApprovalNotAsked {
            thread_id: thread_id.to_owned(),
            tools,
        })
    }
}

/// The calls the thread's pending approval questions list (`{"id", "name",
/// "arguments"}` each).
fn asked_calls(snap: &keel_graph::StateSnapshot<AgentState>) -> impl Iterator<Item = &Value> {
    snap.interrupts
        .iter()
        .filter_map(|i| i.value.get("approve").and_then(Value::as_array))
        .flatten()
}

/// Refuses to resume an approval whose calls changed after it was asked (the stored
/// reply edited with `update_state`): the answer was given to calls the human saw,
/// and would run others.
fn check_question_current(
    thread_id: &str,
    snap: &keel_graph::StateSnapshot<AgentState>,
) -> Result<(), AgentError> {
    let calls = snap
        .values
        .last_message()
        .filter(|m| m.role == keel_message::Role::Assistant)
        .map(|m| m.tool_calls.as_slice())
        .unwrap_or_default();
    for asked in asked_calls(snap) {
        let id = asked.get("id").and_then(Value::as_str).unwrap_or_default();
        let shown = asked.get("arguments").and_then(Value::as_str);
        let now = calls.iter().find(|c| c.id == id);
        if now.map(|c| c.arguments.to_json_string()).as_deref() != shown {
            return Err(AgentError::StaleQuestion {
                thread_id: thread_id.to_owned(),
                call_id: id.to_owned(),
            });
        }
    }
    Ok(())
}

/// Refuses a tool spec the providers would refuse at every call: OpenAI takes names
/// of letters, digits, `_` and `-`, at most 64, and parameters that are a JSON object
/// schema.
fn check_spec(spec: &keel_message::ToolSpec) -> Result<(), BuildError> {
    let bad = |reason: &str| {
        Err(BuildError::BadToolSpec {
            name: spec.name.clone(),
            reason: reason.to_owned(),
        })
    };
    if spec.name.is_empty()
        || spec.name.len() > 64
        || !spec
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return bad("a tool name is 1 to 64 letters, digits, `_` or `-`");
    }
    if !spec.parameters.is_object() {
        return bad("its parameters must be a JSON schema object, such as {\"type\": \"object\"}");
    }
    Ok(())
}

/// The model of nodes built without one.
struct NoModel;

#[async_trait::async_trait]
impl ChatModel for NoModel {
    fn model_name(&self) -> &str {
        "no-model"
    }

    async fn chat(
        &self,
        _messages: &[Message],
        _tools: &[keel_message::ToolSpec],
        _options: &ChatOptions,
    ) -> Result<keel_model::ChatResponse, keel_model::ModelError> {
        Err(keel_model::ModelError::Config(
            "these agent nodes were built without a model (AgentBuilder::build_nodes); give the builder one with .model(..)".to_owned(),
        ))
    }
}

/// Drives `run` on a Tokio task of its own (see [`Agent::run`]): aborted when the
/// returned future is dropped, its panic resumed in the caller.
async fn on_own_task<F>(run: F) -> Result<AgentRun, AgentError>
where
    F: Future<Output = Result<AgentRun, AgentError>> + Send + 'static,
{
    /// Aborts the task when the caller stops waiting for it.
    struct AbortOnDrop(tokio::task::AbortHandle);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| AgentError::NoRuntime)?;
    let task = runtime.spawn(run);
    let _abort = AbortOnDrop(task.abort_handle());
    match task.await {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Err(AgentError::Graph(GraphError::Cancelled)),
    }
}

/// [`AgentError::BadThreadId`] with the offload store's reason alone (its message
/// names the id again).
fn bad_thread_id(thread_id: &str, e: keel_offload::OffloadError) -> AgentError {
    let reason = match e {
        keel_offload::OffloadError::InvalidKey { problem, .. } => problem.to_string(),
        other => other.to_string(),
    };
    AgentError::BadThreadId {
        thread_id: thread_id.to_owned(),
        reason,
    }
}
