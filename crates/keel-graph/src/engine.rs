//! The Pregel superstep engine.
//!
//! One invocation loads the thread's checkpoint, applies the input, then runs
//! supersteps until no task is scheduled: every scheduled task runs concurrently, their
//! updates are folded into the state in task-path order once all have finished, the
//! next tasks are computed from edges, joins, routers, `goto`s and `SendTo`s, and the step
//! is checkpointed as per-channel deltas.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use futures::{FutureExt, Stream};
use keel_checkpoint::{
    ChannelChain, ChannelDelta, ChannelVersion, Checkpoint, CheckpointId, CheckpointMetadata,
    CheckpointSource, CheckpointSummary, CheckpointTuple, Checkpointer, ListOptions, PendingWrite,
    PutRequest, ThreadKey,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::command::{Command, Goto, InvocationInfo, NodeContext, NodeError};
use crate::config::{Durability, Interrupt, Run, RunConfig, StateSnapshot};
use crate::graph::{BuildError, Join, NodeSpec, RouterSpec};
use crate::state::{self as st, channel_name};
use crate::stream::{Event, StreamMode};
use crate::{END, GraphError, START, State, StateError, channel_index};

const INTERRUPT: &str = "__interrupt__";
const RESUME: &str = "__resume__";
const ERROR: &str = "__error__";
const GOTO: &str = "__goto__";
const JOIN_PREFIX: &str = "__join__:";
/// A channel is snapshotted once the deltas since its last snapshot weigh this many
/// times the snapshot.
const SNAPSHOT_RATIO: usize = 2;
/// Capacity of the async writer's queue.
const ASYNC_QUEUE: usize = 64;

/// A node of a compiled graph, by position. Made only by [`Inner::new`] from positions
/// in its `nodes` (and looked up by name in `index`, which holds the same positions);
/// `nodes` never changes afterwards, so a `NodeIx` is always in range for its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct NodeIx(usize);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Node(NodeIx),
    End,
}

struct JoinIdx {
    sources: Vec<NodeIx>,
    target: Target,
}

/// Where a node (or `START`) leads: its static edges and its routers.
struct Outgoing<S: State> {
    edges: Vec<Target>,
    routers: Vec<RouterSpec<S>>,
}

impl<S: State> Default for Outgoing<S> {
    fn default() -> Self {
        Outgoing {
            edges: Vec::new(),
            routers: Vec::new(),
        }
    }
}

/// A node with everything the engine looks up for it.
struct Node<S: State> {
    spec: NodeSpec<S>,
    out: Outgoing<S>,
    interrupt_before: bool,
    interrupt_after: bool,
}

pub(crate) struct Inner<S: State> {
    nodes: Vec<Node<S>>,
    index: HashMap<String, NodeIx>,
    start: Outgoing<S>,
    joins: Vec<JoinIdx>,
    checkpointer: Option<Arc<dyn Checkpointer>>,
}

impl<S: State> Inner<S> {
    /// Indexes a graph `compile` has checked (an unknown name is still a typed error).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        nodes: Vec<NodeSpec<S>>,
        edges: Vec<(String, String)>,
        joins: Vec<Join>,
        routers: Vec<(String, RouterSpec<S>)>,
        checkpointer: Option<Arc<dyn Checkpointer>>,
        interrupt_before: Vec<String>,
        interrupt_after: Vec<String>,
    ) -> Result<Self, BuildError> {
        let index: HashMap<String, NodeIx> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.to_string(), NodeIx(i)))
            .collect();
        let lookup = |n: &str| {
            index
                .get(n)
                .copied()
                .ok_or_else(|| BuildError::UnknownNode { name: n.to_owned() })
        };
        let target = |n: &str| {
            if n == END {
                Ok(Target::End)
            } else {
                lookup(n).map(Target::Node)
            }
        };
        let mut entries: Vec<Node<S>> = nodes
            .into_iter()
            .map(|spec| Node {
                spec,
                out: Outgoing::default(),
                interrupt_before: false,
                interrupt_after: false,
            })
            .collect();
        let mut start = Outgoing::default();
        let unknown = |n: &str| BuildError::UnknownNode { name: n.to_owned() };
        for (f, t) in &edges {
            let t = target(t)?;
            let out = if f == START {
                &mut start
            } else {
                &mut entries.get_mut(lookup(f)?.0).ok_or_else(|| unknown(f))?.out
            };
            if !out.edges.contains(&t) {
                out.edges.push(t);
            }
        }
        for (f, r) in routers {
            let out = if f == START {
                &mut start
            } else {
                &mut entries
                    .get_mut(lookup(&f)?.0)
                    .ok_or_else(|| unknown(&f))?
                    .out
            };
            out.routers.push(r);
        }
        let joins = joins
            .iter()
            .map(|j| {
                Ok(JoinIdx {
                    sources: j
                        .sources
                        .iter()
                        .map(|s| lookup(s))
                        .collect::<Result<_, BuildError>>()?,
                    target: target(&j.target)?,
                })
            })
            .collect::<Result<_, BuildError>>()?;
        for n in &interrupt_before {
            entries
                .get_mut(lookup(n)?.0)
                .ok_or_else(|| unknown(n))?
                .interrupt_before = true;
        }
        for n in &interrupt_after {
            entries
                .get_mut(lookup(n)?.0)
                .ok_or_else(|| unknown(n))?
                .interrupt_after = true;
        }
        Ok(Inner {
            nodes: entries,
            index,
            start,
            joins,
            checkpointer,
        })
    }

    /// The node at `n`.
    // In range: a `NodeIx` is a position in `nodes` (see `NodeIx`).
    #[allow(clippy::indexing_slicing)]
    fn node(&self, n: NodeIx) -> &Node<S> {
        &self.nodes[n.0]
    }

    /// The name of the node at `n`.
    fn name(&self, n: NodeIx) -> &Arc<str> {
        &self.node(n).spec.name
    }

    /// Where `from` leads (`None` = `START`), and its name.
    fn outgoing(&self, from: Option<NodeIx>) -> (&Outgoing<S>, &str) {
        match from {
            None => (&self.start, START),
            Some(n) => {
                let node = self.node(n);
                (&node.out, &node.spec.name)
            }
        }
    }
}

/// A compiled graph: run it with [`CompiledGraph::invoke`] or
/// [`CompiledGraph::stream`]. Cheap to clone and shareable across tasks.
pub struct CompiledGraph<S: State> {
    inner: Arc<Inner<S>>,
}

impl<S: State> Clone for CompiledGraph<S> {
    fn clone(&self) -> Self {
        CompiledGraph {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// A task scheduled for the next step, as stored in `Checkpoint::pending_sends`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TaskSpec {
    node: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    payload: Option<Value>,
}

/// A task of the current step.
struct Task {
    node: NodeIx,
    path: String,
    id: String,
    payload: Option<Value>,
}

/// What one finished task produced.
enum Outcome<S: State> {
    Done(Command<S>),
    Interrupted(Value),
}

/// Per-channel bookkeeping for the snapshot policy.
#[derive(Clone, Default)]
struct ChannelBook {
    version: Option<ChannelVersion>,
    delta_bytes: usize,
    snapshot_bytes: usize,
}

impl<S: State> CompiledGraph<S> {
    pub(crate) fn new(inner: Inner<S>) -> Self {
        CompiledGraph {
            inner: Arc::new(inner),
        }
    }

    /// Runs the graph to `END` (or to an interrupt) and returns the final state.
    ///
    /// `input` is a state update (a new run on the thread), [`Command::resume`] (answer
    /// a pending interrupt) or [`Command::none`] (continue the thread from its last
    /// checkpoint, e.g. after a crash or a breakpoint).
    pub async fn invoke(
        &self,
        input: impl Into<Command<S>>,
        config: &RunConfig,
    ) -> Result<Run<S>, GraphError> {
        self.run(input.into(), config, None).await
    }

    /// Runs the graph like [`CompiledGraph::invoke`], yielding events as it goes.
    /// Dropping the stream cancels the run (tasks in flight are dropped).
    pub fn stream(
        &self,
        input: impl Into<Command<S>>,
        config: RunConfig,
        mode: StreamMode,
    ) -> impl Stream<Item = Result<Event<S>, GraphError>> + Send + 'static {
        let (tx, rx) = mpsc::channel(16);
        let graph = self.clone();
        let input = input.into();
        let handle = tokio::spawn(async move {
            let sink = EventSink {
                tx: tx.clone(),
                mode,
            };
            match graph.run(input, &config, Some(sink)).await {
                Ok(run) => {
                    let _ = tx
                        .send(Ok(Event::Done {
                            next: run.next,
                            interrupts: run.interrupts,
                        }))
                        .await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                }
            }
        });
        let guard = AbortOnDrop(handle);
        futures::stream::unfold((rx, guard), |(mut rx, guard)| async move {
            rx.recv().await.map(|item| (item, (rx, guard)))
        })
    }

    /// The state of a thread at its latest checkpoint (or at `config.checkpoint_id`).
    pub async fn get_state(
        &self,
        config: &RunConfig,
    ) -> Result<Option<StateSnapshot<S>>, GraphError> {
        let (cp, thread) = self.require_checkpointer(config, "get_state")?;
        match cp.get(&thread, config.checkpoint_id.as_ref()).await? {
            None => Ok(None),
            Some(tuple) => self.snapshot_of(tuple).map(Some),
        }
    }

    /// A thread's checkpoints, newest first (id order, every branch included), each
    /// with its state, filtered like [`Checkpointer::list`]: `options.before` (only
    /// checkpoints older than that id: the next page after the last one seen),
    /// `options.limit` and `options.metadata` (every key equal; `writes` contained,
    /// see [`ListOptions::written_by`]). `config.checkpoint_id` is not used.
    ///
    /// A stream: each state is rebuilt when the stream reaches its checkpoint, from that
    /// checkpoint's stored channels, and summaries are read a page at a time, so memory
    /// holds one state (and the page), however long the history. A checkpoint pruned
    /// while the stream runs is left out. Without a checkpointer or a thread id the
    /// stream's one item is [`GraphError::CheckpointerRequired`]. To find one
    /// checkpoint by the node that wrote it, use
    /// [`last_checkpoint_by`](Self::last_checkpoint_by).
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use futures::TryStreamExt;
    /// use keel_checkpoint::{ListOptions, MemorySaver};
    /// use keel_graph::reducer::Append;
    /// use keel_graph::{END, RunConfig, START, State, StateGraph};
    ///
    /// #[derive(Clone, State)]
    /// struct Log {
    ///     #[reducer(Append<String>)]
    ///     lines: Vec<String>,
    /// }
    /// let line = |s: &str| LogUpdate::default().lines(vec![s.to_owned()]);
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Log>::new()
    ///     .add_node("draft", move |_s, _c| async move { Ok(line("draft")) })
    ///     .add_edge(START, "draft")
    ///     .add_edge("draft", END)
    ///     .with_checkpointer(Arc::new(MemorySaver::new()))
    ///     .compile()?;
    /// let config = RunConfig::thread("doc-1");
    /// graph.invoke(line("brief"), &config).await?;
    ///
    /// // Newest first: after `draft`, then the input.
    /// let all: Vec<_> = graph.state_history(&config, ListOptions::default()).try_collect().await?;
    /// assert_eq!(all.len(), 2);
    /// assert_eq!(all[0].values.lines, ["brief", "draft"]);
    /// // The page after the newest one, and a metadata filter.
    /// let older = ListOptions::default().before(all[0].checkpoint_id.clone()).limit(10);
    /// let page: Vec<_> = graph.state_history(&config, older).try_collect().await?;
    /// assert_eq!(page[0].values.lines, ["brief"]);
    /// let by_draft = ListOptions::default().written_by("draft");
    /// assert_eq!(graph.state_history(&config, by_draft).try_collect::<Vec<_>>().await?.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn state_history(
        &self,
        config: &RunConfig,
        options: ListOptions,
    ) -> BoxStream<'static, Result<StateSnapshot<S>, GraphError>> {
        let (cp, thread) = match self.require_checkpointer(config, "state_history") {
            Ok(found) => found,
            Err(e) => return futures::stream::once(async move { Err(e) }).boxed(),
        };
        let cursor = HistoryCursor {
            graph: self.clone(),
            cp,
            thread,
            before: options.before,
            remaining: options.limit.unwrap_or(usize::MAX),
            metadata: options.metadata,
            page: VecDeque::new(),
            listed_all: false,
        };
        futures::stream::try_unfold(cursor, |mut cursor| async move {
            let item = cursor.next().await?;
            Ok(item.map(|snapshot| (snapshot, cursor)))
        })
        .boxed()
    }

    /// The newest checkpoint of a thread whose step node `node` wrote (its
    /// [`CheckpointMetadata::writes`](keel_checkpoint::CheckpointMetadata::writes)
    /// names the node), with its state; `Ok(None)` if there is none.
    ///
    /// With `config.checkpoint_id` set, the newest at or before that checkpoint (an
    /// unknown id is [`GraphError::CheckpointNotFound`]). "Newest" is id order over the
    /// whole thread, every branch included, as [`state_history`](Self::state_history)
    /// lists it. `START` (`"__start__"`) finds the last input.
    ///
    /// The checkpoint is found from metadata alone
    /// ([`ListOptions::written_by`](keel_checkpoint::ListOptions::written_by), limit 1),
    /// and only its state is rebuilt, so the cost does not grow with the number of
    /// checkpoints rebuilt, unlike filtering `state_history`.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use keel_checkpoint::MemorySaver;
    /// use keel_graph::reducer::Append;
    /// use keel_graph::{END, RunConfig, START, State, StateGraph};
    ///
    /// #[derive(Clone, State)]
    /// struct Log {
    ///     #[reducer(Append<String>)]
    ///     lines: Vec<String>,
    /// }
    /// let line = |s: &str| LogUpdate::default().lines(vec![s.to_owned()]);
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Log>::new()
    ///     .add_node("draft", move |_s, _c| async move { Ok(line("draft")) })
    ///     .add_node("review", move |_s, _c| async move { Ok(line("review")) })
    ///     .add_edge(START, "draft")
    ///     .add_edge("draft", "review")
    ///     .add_edge("review", END)
    ///     .with_checkpointer(Arc::new(MemorySaver::new()))
    ///     .compile()?;
    /// let config = RunConfig::thread("doc-1");
    /// graph.invoke(line("brief"), &config).await?;
    ///
    /// let drafted = graph.last_checkpoint_by(&config, "draft").await?.expect("draft ran");
    /// assert_eq!(drafted.values.lines, ["brief", "draft"]);
    /// assert_eq!(drafted.metadata.writes, ["draft"]);
    /// assert_eq!(drafted.next, ["review"]);
    /// assert!(graph.last_checkpoint_by(&config, "publish").await?.is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn last_checkpoint_by(
        &self,
        config: &RunConfig,
        node: &str,
    ) -> Result<Option<StateSnapshot<S>>, GraphError> {
        let (cp, thread) = self.require_checkpointer(config, "last_checkpoint_by")?;
        let mut options = ListOptions::default().written_by(node).limit(1);
        if let Some(at) = &config.checkpoint_id {
            let tuple =
                cp.get(&thread, Some(at))
                    .await?
                    .ok_or_else(|| GraphError::CheckpointNotFound {
                        thread_id: thread.thread_id.clone(),
                        id: at.clone(),
                    })?;
            if tuple.metadata.written_by(node) {
                return self.snapshot_of(tuple).map(Some);
            }
            options = options.before(at.clone());
        }
        let Some(found) = cp.list(&thread, options).next().await.transpose()? else {
            return Ok(None);
        };
        // Absent only if pruned since it was listed: then there is no such checkpoint.
        match cp.get(&thread, Some(&found.checkpoint.id)).await? {
            Some(tuple) => self.snapshot_of(tuple).map(Some),
            None => Ok(None),
        }
    }

    /// Writes `update` into the thread as if node `as_node` had returned it (or, with
    /// `None`, as an edit that keeps the scheduled tasks), creating a new checkpoint with
    /// source `update`. With `config.checkpoint_id` set, the update forks from that past
    /// checkpoint. Returns the new checkpoint's id. The checkpoint's metadata `writes`
    /// is `[as_node]` (empty without one).
    pub async fn update_state(
        &self,
        config: &RunConfig,
        update: S::Update,
        as_node: Option<&str>,
    ) -> Result<CheckpointId, GraphError> {
        let (cp, thread) = self.require_checkpointer(config, "update_state")?;
        let mut run = RunState::load(self, config, None).await?;
        let as_node = match as_node {
            None => None,
            Some(n) => Some(
                *self
                    .inner
                    .index
                    .get(n)
                    .ok_or_else(|| GraphError::UnknownTarget {
                        from: "update_state".into(),
                        to: n.to_owned(),
                    })?,
            ),
        };
        let encoded = st::encode_update::<S>(&update)?;
        let written = st::apply(Arc::make_mut(&mut run.state), vec![update])?;
        if let Some(node) = as_node {
            let mut next = Vec::new();
            let mut sends = Vec::new();
            let state = Arc::clone(&run.state);
            run.route_from(Some(node), &state, &mut next, &mut sends)?;
            run.tasks = run.specs(next, sends);
            run.writers.insert(self.inner.name(node).to_string());
        }
        let per_channel = group_by_channel(&written, vec![encoded]);
        run.step += 1;
        let id = run
            .commit(CheckpointSource::Update, per_channel, Some(&cp), &thread)
            .await?;
        Ok(id)
    }

    fn require_checkpointer(
        &self,
        config: &RunConfig,
        what: &'static str,
    ) -> Result<(Arc<dyn Checkpointer>, ThreadKey), GraphError> {
        match (&self.inner.checkpointer, config.thread_key()) {
            (Some(cp), Some(t)) => Ok((Arc::clone(cp), t)),
            _ => Err(GraphError::CheckpointerRequired { what }),
        }
    }

    fn snapshot_of(&self, tuple: CheckpointTuple) -> Result<StateSnapshot<S>, GraphError> {
        let CheckpointTuple {
            checkpoint,
            metadata,
            channels,
            pending_writes,
            ..
        } = tuple;
        let (state, _) = rebuild::<S>(channels, &checkpoint)?;
        let tasks = decode_tasks(&checkpoint)?;
        Ok(StateSnapshot {
            values: state,
            next: tasks.iter().map(|t| t.node.clone()).collect(),
            // Shown even when this graph lacks a scheduled node: running it is what
            // fails (`GraphError::UnknownNode`), not looking at it.
            interrupts: pending_interrupts(&pending_writes, &task_names(&tasks, &checkpoint.id)),
            checkpoint_id: checkpoint.id,
            parent_id: checkpoint.parent,
            metadata,
        })
    }

    async fn run(
        &self,
        input: Command<S>,
        config: &RunConfig,
        events: Option<EventSink<S>>,
    ) -> Result<Run<S>, GraphError> {
        let g = &*self.inner;
        let mut run = RunState::load(self, config, events).await?;
        let writer = Writer::new(g.checkpointer.clone(), config);
        let mut writer = writer;
        let mut skip_breakpoint = false;

        if let Some(answer) = input.resume {
            let thread = run
                .thread
                .clone()
                .ok_or(GraphError::CheckpointerRequired { what: "resume" })?;
            let tasks = tasks_with_ids(g, &run.tasks, &run.checkpoint.id)?;
            // Before anything is written: a thread this graph cannot run stays as it was.
            run.check_stored_writes()?;
            let interrupted =
                pending_interrupts(&run.pending, &task_names(&run.tasks, &run.checkpoint.id));
            if interrupted.is_empty() {
                return Err(GraphError::NoPendingInterrupt {
                    thread_id: thread.thread_id,
                });
            }
            let mut writes = Vec::new();
            for i in interrupted {
                let path = tasks
                    .iter()
                    .find(|t| t.id == i.task_id)
                    .map(|t| t.path.clone())
                    .unwrap_or_default();
                writes.push(PendingWrite::new(
                    i.task_id.clone(),
                    path,
                    RESUME,
                    answer.clone(),
                ));
            }
            writer
                .put_writes(&thread, &run.checkpoint.id, writes.clone())
                .await?;
            run.pending.extend(writes);
            skip_breakpoint = true;
        } else if input.update.is_some() || !input.goto.is_empty() {
            // A new run on this thread: apply the input, then start from START.
            let mut per_channel = BTreeMap::new();
            if let Some(update) = input.update {
                let encoded = if writer.stores() {
                    st::encode_update::<S>(&update)?
                } else {
                    Vec::new()
                };
                let written = st::apply(Arc::make_mut(&mut run.state), vec![update])?;
                per_channel = group_by_channel(&written, vec![encoded]);
            }
            let mut next = Vec::new();
            let mut sends = Vec::new();
            let state = Arc::clone(&run.state);
            run.route_from(None, &state, &mut next, &mut sends)?;
            run.goto(START, input.goto, &mut next, &mut sends)?;
            run.tasks = run.specs(next, sends);
            run.pending.clear();
            run.step += 1;
            if writer.stores() {
                run.writers.insert(START.to_owned());
            }
            run.persist(&mut writer, CheckpointSource::Input, per_channel)
                .await?;
        } else {
            run.check_stored_writes()?;
            skip_breakpoint = true;
        }

        let first_step = run.step;
        let mut steps = 0usize;
        while !run.tasks.is_empty() {
            let tasks = tasks_with_ids(g, &run.tasks, &run.checkpoint.id)?;
            if !skip_breakpoint && tasks.iter().any(|t| g.node(t.node).interrupt_before) {
                writer.flush(&mut run).await?;
                return Ok(run.finish(Vec::new(), steps));
            }
            skip_breakpoint = false;
            if run.step - first_step >= i64::try_from(config.recursion_limit).unwrap_or(i64::MAX) {
                return Err(GraphError::RecursionLimit {
                    limit: config.recursion_limit,
                    step: run.step + 1,
                });
            }

            let outcomes = run.execute(&tasks, &mut writer).await?;
            let interrupts: Vec<Interrupt> = tasks
                .iter()
                .zip(&outcomes)
                .filter_map(|(t, o)| match o {
                    Outcome::Interrupted(v) => Some(Interrupt {
                        node: g.name(t.node).to_string(),
                        task_id: t.id.clone(),
                        value: v.clone(),
                    }),
                    Outcome::Done(_) => None,
                })
                .collect();
            if !interrupts.is_empty() {
                if run.thread.is_none() || g.checkpointer.is_none() {
                    return Err(GraphError::CheckpointerRequired { what: "interrupt" });
                }
                writer.flush(&mut run).await?;
                return Ok(run.finish(interrupts, steps));
            }
            run.step += 1;
            steps += 1;
            let commands: Vec<Command<S>> = outcomes
                .into_iter()
                .filter_map(|o| match o {
                    Outcome::Done(c) => Some(c),
                    Outcome::Interrupted(_) => None,
                })
                .collect();
            run.advance(&tasks, commands, &mut writer).await?;
            if tasks.iter().any(|t| g.node(t.node).interrupt_after) && !run.tasks.is_empty() {
                writer.flush(&mut run).await?;
                return Ok(run.finish(Vec::new(), steps));
            }
        }
        writer.flush(&mut run).await?;
        Ok(run.finish(Vec::new(), steps))
    }
}

/// Summaries read per `list` call by [`CompiledGraph::state_history`].
const HISTORY_PAGE: usize = 32;

/// Where a [`CompiledGraph::state_history`] stream is: the next checkpoints to show,
/// and the id to list the page after them from.
struct HistoryCursor<S: State> {
    graph: CompiledGraph<S>,
    cp: Arc<dyn Checkpointer>,
    thread: ThreadKey,
    /// List checkpoints older than this (the last one listed).
    before: Option<CheckpointId>,
    /// How many more the caller wants.
    remaining: usize,
    metadata: serde_json::Map<String, Value>,
    page: VecDeque<CheckpointSummary>,
    /// The last `list` returned less than a page: nothing older matches.
    listed_all: bool,
}

impl<S: State> HistoryCursor<S> {
    /// The next checkpoint's snapshot, or `None` at the end.
    async fn next(&mut self) -> Result<Option<StateSnapshot<S>>, GraphError> {
        while self.remaining > 0 {
            let Some(summary) = self.page.pop_front() else {
                if self.listed_all {
                    return Ok(None);
                }
                self.list_page().await?;
                continue;
            };
            // Absent only if pruned since it was listed: then it is no longer history.
            if let Some(tuple) = self
                .cp
                .get(&self.thread, Some(&summary.checkpoint.id))
                .await?
            {
                self.remaining -= 1;
                return self.graph.snapshot_of(tuple).map(Some);
            }
        }
        Ok(None)
    }

    async fn list_page(&mut self) -> Result<(), GraphError> {
        let want = self.remaining.min(HISTORY_PAGE);
        let mut options = ListOptions::default().limit(want);
        options.before = self.before.clone();
        options.metadata = self.metadata.clone();
        let page: VecDeque<CheckpointSummary> =
            self.cp.list(&self.thread, options).try_collect().await?;
        self.listed_all = page.len() < want;
        if let Some(last) = page.back() {
            self.before = Some(last.checkpoint.id.clone());
        }
        self.page = page;
        Ok(())
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) struct EventSink<S: State> {
    tx: mpsc::Sender<Result<Event<S>, GraphError>>,
    mode: StreamMode,
}

/// The mutable state of one invocation.
struct RunState<S: State> {
    graph: Arc<Inner<S>>,
    state: Arc<S>,
    /// The latest checkpoint of this run (stored, or in memory when not storing).
    checkpoint: Checkpoint,
    step: i64,
    thread: Option<ThreadKey>,
    /// The thread's newest stored checkpoint (for fencing).
    head: Option<CheckpointId>,
    /// The newest checkpoint this run stored.
    stored: Option<CheckpointId>,
    tasks: Vec<TaskSpec>,
    pending: Vec<PendingWrite>,
    books: Vec<ChannelBook>,
    /// Channels written since the last stored checkpoint (exit durability).
    dirty: BTreeSet<usize>,
    /// Steps run since the last stored checkpoint (exit durability).
    steps_since_store: usize,
    /// The nodes that wrote the steps since the last stored checkpoint: the next
    /// checkpoint's `writes` metadata.
    writers: BTreeSet<String>,
    joins_seen: Vec<BTreeSet<NodeIx>>,
    metadata: serde_json::Map<String, Value>,
    /// What every task's [`NodeContext`] shares about this invocation.
    invocation: Arc<InvocationInfo>,
    events: Option<EventSink<S>>,
}

impl<S: State> RunState<S> {
    async fn load(
        graph: &CompiledGraph<S>,
        config: &RunConfig,
        events: Option<EventSink<S>>,
    ) -> Result<Self, GraphError> {
        let g = Arc::clone(&graph.inner);
        let thread = match (&g.checkpointer, config.thread_key()) {
            (Some(_), Some(t)) => Some(t),
            _ => None,
        };
        let mut run = RunState {
            state: Arc::new(S::empty()),
            checkpoint: Checkpoint::new(None),
            step: -2,
            thread: thread.clone(),
            head: None,
            stored: None,
            tasks: Vec::new(),
            pending: Vec::new(),
            books: vec![ChannelBook::default(); S::CHANNELS.len()],
            dirty: BTreeSet::new(),
            steps_since_store: 0,
            writers: BTreeSet::new(),
            joins_seen: vec![BTreeSet::new(); g.joins.len()],
            metadata: config.metadata.clone(),
            invocation: Arc::new(InvocationInfo::of(config)),
            events,
            graph: g,
        };
        let (Some(cp), Some(thread)) = (run.graph.checkpointer.clone(), thread) else {
            return Ok(run);
        };
        let latest = cp.get(&thread, None).await?;
        run.head = latest.as_ref().map(|t| t.checkpoint.id.clone());
        let tuple = match &config.checkpoint_id {
            None => latest,
            Some(id) => Some(cp.get(&thread, Some(id)).await?.ok_or_else(|| {
                GraphError::CheckpointNotFound {
                    thread_id: thread.thread_id.clone(),
                    id: id.clone(),
                }
            })?),
        };
        let Some(tuple) = tuple else {
            return Ok(run);
        };
        let CheckpointTuple {
            checkpoint,
            metadata,
            channels,
            pending_writes,
            ..
        } = tuple;
        let (state, books) = rebuild::<S>(channels, &checkpoint)?;
        run.state = Arc::new(state);
        run.books = books;
        run.tasks = decode_tasks(&checkpoint)?;
        for (i, seen) in run.joins_seen.iter_mut().enumerate() {
            if let Some(m) = checkpoint.versions_seen.get(&format!("{JOIN_PREFIX}{i}")) {
                *seen = m
                    .keys()
                    .filter_map(|n| run.graph.index.get(n).copied())
                    .collect();
            }
        }
        run.step = metadata.step;
        run.pending = pending_writes;
        run.stored = Some(checkpoint.id.clone());
        run.checkpoint = checkpoint;
        Ok(run)
    }

    fn specs(&self, next: Vec<NodeIx>, sends: Vec<TaskSpec>) -> Vec<TaskSpec> {
        next.into_iter()
            .map(|n| TaskSpec {
                node: self.graph.name(n).to_string(),
                payload: None,
            })
            .chain(sends)
            .collect()
    }

    /// Adds the targets of `source`'s static edges and routers (evaluated on `state`);
    /// `None` is `START`.
    fn route_from(
        &mut self,
        source: Option<NodeIx>,
        state: &S,
        next: &mut Vec<NodeIx>,
        sends: &mut Vec<TaskSpec>,
    ) -> Result<(), GraphError> {
        let g = Arc::clone(&self.graph);
        let (out, from) = g.outgoing(source);
        for t in &out.edges {
            if let Target::Node(n) = t {
                push_unique(next, *n);
            }
        }
        for r in &out.routers {
            let route = (r.route)(state);
            self.goto(from, route.0, next, sends)?;
        }
        Ok(())
    }

    fn goto(
        &self,
        from: &str,
        targets: Vec<Goto>,
        next: &mut Vec<NodeIx>,
        sends: &mut Vec<TaskSpec>,
    ) -> Result<(), GraphError> {
        for t in targets {
            let (name, payload) = match t {
                Goto::Node(n) => (n, None),
                Goto::Send(s) => (s.node, Some(s.payload)),
            };
            if name == END {
                continue;
            }
            let Some(&n) = self.graph.index.get(&name) else {
                return Err(GraphError::UnknownTarget {
                    from: from.to_owned(),
                    to: name,
                });
            };
            match payload {
                None => push_unique(next, n),
                Some(p) => sends.push(TaskSpec {
                    node: name,
                    payload: Some(p),
                }),
            }
        }
        Ok(())
    }

    /// Runs the step's tasks concurrently. Tasks whose writes are already stored (from
    /// an earlier attempt at this step) are not run again.
    async fn execute(
        &mut self,
        tasks: &[Task],
        writer: &mut Writer,
    ) -> Result<Vec<Outcome<S>>, GraphError> {
        let mut outcomes: Vec<Option<Outcome<S>>> = Vec::with_capacity(tasks.len());
        let mut to_run: Vec<(usize, &Task)> = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            let stored = self.stored_outcome(t)?;
            if stored.is_none() {
                to_run.push((i, t));
            }
            outcomes.push(stored);
        }
        let g = Arc::clone(&self.graph);
        let make = |i: usize, t: &Task| {
            let resume: Vec<Value> = self
                .pending
                .iter()
                .filter(|w| w.task_id == t.id && w.channel == RESUME)
                .map(|w| w.value.clone())
                .collect();
            let ctx = NodeContext {
                node: Arc::clone(g.name(t.node)),
                step: self.step + 1,
                task_id: t.id.as_str().into(),
                payload: t.payload.clone(),
                resume: Arc::new(resume),
                interrupts: Arc::new(AtomicUsize::new(0)),
                invocation: Arc::clone(&self.invocation),
            };
            let g = Arc::clone(&g);
            let state = Arc::clone(&self.state);
            let node = t.node;
            async move { (i, run_task(&g.node(node).spec, state, ctx).await) }
        };

        let single = to_run.len() == 1;
        let results: Vec<(usize, Result<Outcome<S>, GraphError>)> = match to_run.as_slice() {
            [(i, t)] => vec![make(*i, t).await],
            _ => {
                let mut set = tokio::task::JoinSet::new();
                for (i, t) in &to_run {
                    set.spawn(make(*i, t));
                }
                let mut results = Vec::with_capacity(to_run.len());
                while let Some(joined) = set.join_next().await {
                    match joined {
                        Ok((i, r)) => {
                            // Store finished work at once: a crash later in the step
                            // does not lose it.
                            let writes = match (&r, &self.thread, tasks.get(i)) {
                                (Ok(o), Some(_), Some(t)) => Some(self.task_writes(t, o)?),
                                _ => None,
                            };
                            if let (Some(writes), Some(thread)) = (writes, self.thread.clone()) {
                                writer
                                    .put_writes(&thread, &self.checkpoint.id, writes.clone())
                                    .await?;
                                self.pending.extend(writes);
                            }
                            results.push((i, r));
                        }
                        // Panics are caught inside the task; a join error means the
                        // task was aborted.
                        Err(_) => results.push((usize::MAX, Err(GraphError::Cancelled))),
                    }
                }
                results
            }
        };
        let mut first_error = None;
        for (i, r) in results {
            match r {
                Ok(o) => {
                    // A lone task's writes go with the step's checkpoint right after;
                    // only an interrupt must be stored on its own.
                    let writes = match (&o, &self.thread, tasks.get(i)) {
                        (Outcome::Interrupted(_), Some(_), Some(t)) if single => {
                            Some(self.task_writes(t, &o)?)
                        }
                        _ => None,
                    };
                    if let (Some(writes), Some(thread)) = (writes, self.thread.clone()) {
                        writer
                            .put_writes(&thread, &self.checkpoint.id, writes.clone())
                            .await?;
                        self.pending.extend(writes);
                    }
                    if let Some(slot) = outcomes.get_mut(i) {
                        *slot = Some(o);
                    }
                }
                Err(e) => {
                    if let (Some(thread), Some(t)) = (self.thread.clone(), tasks.get(i)) {
                        let w = PendingWrite::new(
                            t.id.clone(),
                            t.path.clone(),
                            ERROR,
                            Value::String(e.to_string()),
                        );
                        writer
                            .put_writes(&thread, &self.checkpoint.id, vec![w])
                            .await?;
                    }
                    if first_error.as_ref().is_none_or(|(j, _)| i < *j) {
                        first_error = Some((i, e));
                    }
                }
            }
        }
        if let Some((_, e)) = first_error {
            return Err(e);
        }
        Ok(outcomes.into_iter().flatten().collect())
    }

    /// Checks that this graph can replay the writes stored against the checkpoint
    /// (see [`Self::stored_outcome`]): each is to a channel of the state or a special
    /// channel, and each stored route names a node of the graph (or `END`).
    fn check_stored_writes(&self) -> Result<(), GraphError> {
        for w in &self.pending {
            if w.channel == GOTO {
                let specs: Vec<TaskSpec> =
                    serde_json::from_value(w.value.clone()).map_err(|e| {
                        GraphError::CorruptTasks {
                            id: self.checkpoint.id.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                if let Some(s) = specs
                    .iter()
                    .find(|s| s.node != END && !self.graph.index.contains_key(&s.node))
                {
                    return Err(GraphError::UnknownNode {
                        node: s.node.clone(),
                        checkpoint: self.checkpoint.id.clone(),
                    });
                }
            } else if !w.channel.starts_with("__") && channel_index::<S>(&w.channel).is_none() {
                return Err(StateError::UnknownChannel {
                    channel: w.channel.clone(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// A task's outcome rebuilt from writes stored by an earlier attempt at this step.
    fn stored_outcome(&self, t: &Task) -> Result<Option<Outcome<S>>, GraphError> {
        let mine: Vec<&PendingWrite> = self.pending.iter().filter(|w| w.task_id == t.id).collect();
        let done = mine
            .iter()
            .any(|w| !w.channel.starts_with("__") || w.channel == GOTO);
        if !done {
            return Ok(None);
        }
        let mut values = Vec::new();
        let mut goto = Vec::new();
        for w in mine {
            if w.channel == GOTO {
                let specs: Vec<TaskSpec> =
                    serde_json::from_value(w.value.clone()).map_err(|e| {
                        GraphError::CorruptTasks {
                            id: self.checkpoint.id.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                goto.extend(specs.into_iter().map(|s| match s.payload {
                    None => Goto::Node(s.node),
                    Some(p) => Goto::Send(crate::SendTo {
                        node: s.node,
                        payload: p,
                    }),
                }));
            } else if let Some(c) = channel_index::<S>(&w.channel) {
                values.push((c, w.value.clone()));
            } else if !w.channel.starts_with("__") {
                return Err(StateError::UnknownChannel {
                    channel: w.channel.clone(),
                }
                .into());
            }
        }
        let update = if values.is_empty() {
            None
        } else {
            Some(S::decode_update(&values)?)
        };
        Ok(Some(Outcome::Done(Command {
            update,
            goto,
            resume: None,
        })))
    }

    fn task_writes(&self, t: &Task, o: &Outcome<S>) -> Result<Vec<PendingWrite>, GraphError> {
        let mut writes = Vec::new();
        match o {
            Outcome::Interrupted(v) => writes.push(PendingWrite::new(
                t.id.clone(),
                t.path.clone(),
                INTERRUPT,
                v.clone(),
            )),
            Outcome::Done(c) => {
                if let Some(u) = &c.update {
                    for (ch, v) in st::encode_update::<S>(u)? {
                        writes.push(PendingWrite::new(
                            t.id.clone(),
                            t.path.clone(),
                            channel_name::<S>(ch, "State::encode_update")?,
                            v,
                        ));
                    }
                }
                let specs: Vec<TaskSpec> = c
                    .goto
                    .iter()
                    .map(|g| match g {
                        Goto::Node(n) => TaskSpec {
                            node: n.clone(),
                            payload: None,
                        },
                        Goto::Send(s) => TaskSpec {
                            node: s.node.clone(),
                            payload: Some(s.payload.clone()),
                        },
                    })
                    .collect();
                // Always written, so a finished task with no update is still recognised.
                writes.push(PendingWrite::new(
                    t.id.clone(),
                    t.path.clone(),
                    GOTO,
                    serde_json::to_value(specs).unwrap_or(Value::Null),
                ));
            }
        }
        Ok(writes)
    }

    /// Applies the step's updates in task-path order, schedules the next tasks and
    /// checkpoints the step.
    async fn advance(
        &mut self,
        tasks: &[Task],
        commands: Vec<Command<S>>,
        writer: &mut Writer,
    ) -> Result<(), GraphError> {
        let g = Arc::clone(&self.graph);
        let multi = tasks.len() > 1;
        let needs_local = multi && tasks.iter().any(|t| !g.node(t.node).out.routers.is_empty());
        let before = if needs_local {
            Some((*self.state).clone())
        } else {
            None
        };

        let encode =
            writer.stores() || needs_local || self.events.as_ref().is_some_and(|e| e.mode.updates);
        let mut encoded = Vec::with_capacity(commands.len());
        let mut updates = Vec::with_capacity(commands.len());
        let mut gotos = Vec::with_capacity(commands.len());
        for c in commands {
            let u = c.update.unwrap_or_default();
            encoded.push(if encode {
                st::encode_update::<S>(&u)?
            } else {
                Vec::new()
            });
            updates.push(u);
            gotos.push(c.goto);
        }
        let written = st::apply(Arc::make_mut(&mut self.state), updates)?;

        let mut next = Vec::new();
        let mut sends = Vec::new();
        let state = Arc::clone(&self.state);
        for ((t, goto), enc) in tasks.iter().zip(gotos).zip(&encoded) {
            let node = g.node(t.node);
            if !node.out.routers.is_empty() {
                match &before {
                    Some(before) => {
                        let mut local = before.clone();
                        st::apply(&mut local, vec![S::decode_update(enc)?])?;
                        self.route_from(Some(t.node), &local, &mut next, &mut sends)?;
                    }
                    None => self.route_from(Some(t.node), &state, &mut next, &mut sends)?,
                }
            } else {
                self.route_from(Some(t.node), &state, &mut next, &mut sends)?;
            }
            self.goto(&node.spec.name, goto, &mut next, &mut sends)?;
            for (join, seen) in g.joins.iter().zip(self.joins_seen.iter_mut()) {
                if join.sources.contains(&t.node) {
                    seen.insert(t.node);
                }
            }
        }
        for (join, seen) in g.joins.iter().zip(self.joins_seen.iter_mut()) {
            if join.sources.iter().all(|s| seen.contains(s)) {
                seen.clear();
                if let Target::Node(n) = join.target {
                    push_unique(&mut next, n);
                }
            }
        }
        self.tasks = self.specs(next, sends);
        self.pending.clear();

        if let Some(sink) = &self.events {
            if sink.mode.updates {
                for (t, enc) in tasks.iter().zip(&encoded) {
                    let update = enc
                        .iter()
                        .map(|(c, v)| {
                            Ok((channel_name::<S>(*c, "State::encode_update")?, v.clone()))
                        })
                        .collect::<Result<_, StateError>>()?;
                    sink.send(Event::Updates {
                        step: self.step,
                        node: g.name(t.node).to_string(),
                        update,
                    })
                    .await?;
                }
            }
            if sink.mode.values {
                sink.send(Event::Values {
                    step: self.step,
                    state: (*self.state).clone(),
                })
                .await?;
            }
        }
        if writer.stores() {
            self.writers
                .extend(tasks.iter().map(|t| g.name(t.node).to_string()));
        }
        let per_channel = group_by_channel(&written, encoded);
        self.persist(writer, CheckpointSource::Loop, per_channel)
            .await
    }

    /// Makes the step's checkpoint and hands it to the writer.
    async fn persist(
        &mut self,
        writer: &mut Writer,
        source: CheckpointSource,
        per_channel: BTreeMap<usize, Vec<Value>>,
    ) -> Result<(), GraphError> {
        match writer {
            // Nothing stored: no checkpoint ids or versions to keep.
            Writer::None => Ok(()),
            Writer::Exit(_) => {
                self.dirty.extend(per_channel.keys());
                self.steps_since_store += 1;
                Ok(())
            }
            Writer::Sync(cp) => {
                let cp = Arc::clone(cp);
                let thread = self
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                self.commit(source, per_channel, Some(&cp), &thread)
                    .await
                    .map(|_| ())
            }
            Writer::Async { .. } => {
                let thread = self
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                let request = self.build_put(source, per_channel, &thread)?;
                writer.enqueue(request).await?;
                self.after_put().await
            }
        }
    }

    /// Builds and stores a checkpoint now.
    async fn commit(
        &mut self,
        source: CheckpointSource,
        per_channel: BTreeMap<usize, Vec<Value>>,
        cp: Option<&Arc<dyn Checkpointer>>,
        thread: &ThreadKey,
    ) -> Result<CheckpointId, GraphError> {
        let request = self.build_put(source, per_channel, thread)?;
        let id = request.checkpoint.id.clone();
        if let Some(cp) = cp {
            cp.put(request).await?;
        }
        self.after_put().await?;
        Ok(id)
    }

    async fn after_put(&mut self) -> Result<(), GraphError> {
        self.steps_since_store = 0;
        self.head = Some(self.checkpoint.id.clone());
        self.stored = Some(self.checkpoint.id.clone());
        if let Some(sink) = &self.events
            && sink.mode.debug
        {
            sink.send(Event::Checkpoint {
                step: self.step,
                id: self.checkpoint.id.clone(),
                next: self.tasks.iter().map(|t| t.node.clone()).collect(),
            })
            .await?;
        }
        Ok(())
    }

    /// Advances `self.checkpoint` to a successor with new versions for `channels`.
    fn next_checkpoint(
        &mut self,
        channels: &BTreeMap<usize, Vec<Value>>,
    ) -> Result<Vec<(usize, Option<ChannelVersion>, ChannelVersion)>, StateError> {
        // Every index is checked before anything changes.
        let names = channels
            .keys()
            .map(|&c| Ok((c, channel_name::<S>(c, "State::apply")?)))
            .collect::<Result<Vec<_>, StateError>>()?;
        let mut next = self.checkpoint.successor();
        // Ids order a thread's history: a new one must sort after the thread's head,
        // even when that head was written by another machine or this run forked.
        if let Some(head) = &self.head
            && next.id <= *head
        {
            next.id = CheckpointId::new_after(head);
        }
        next.pending_sends = self
            .tasks
            .iter()
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect();
        for (j, seen) in self.joins_seen.iter().enumerate() {
            let key = format!("{JOIN_PREFIX}{j}");
            if seen.is_empty() {
                next.versions_seen.remove(&key);
            } else {
                next.versions_seen.insert(
                    key,
                    seen.iter()
                        .map(|n| (self.graph.name(*n).to_string(), 1))
                        .collect(),
                );
            }
        }
        let mut versions = Vec::new();
        for (c, name) in names {
            let book = book_mut::<S>(&mut self.books, c)?;
            let base = book.version.clone();
            let version =
                ChannelVersion::new(base.as_ref().map_or(1, |v| v.seq + 1), next.id.clone());
            next.channel_versions
                .insert(name.to_owned(), version.clone());
            book.version = Some(version.clone());
            versions.push((c, base, version));
        }
        self.checkpoint = next;
        Ok(versions)
    }

    fn build_put(
        &mut self,
        source: CheckpointSource,
        mut per_channel: BTreeMap<usize, Vec<Value>>,
        thread: &ThreadKey,
    ) -> Result<PutRequest, GraphError> {
        // Channels written while not storing (exit durability) go as snapshots.
        let dirty = std::mem::take(&mut self.dirty);
        let snapshot_only: BTreeSet<usize> = dirty
            .iter()
            .copied()
            .filter(|c| !per_channel.contains_key(c))
            .collect();
        for c in &dirty {
            per_channel.entry(*c).or_default();
        }
        let versions = self.next_checkpoint(&per_channel)?;
        let mut deltas = Vec::with_capacity(versions.len());
        for (c, base, version) in versions {
            let updates = per_channel.remove(&c).unwrap_or_default();
            let book = book_mut::<S>(&mut self.books, c)?;
            let bytes: usize = updates.iter().map(json_size).sum();
            book.delta_bytes += bytes;
            // Snapshot when the deltas since the last snapshot outweigh it
            // SNAPSHOT_RATIO times: snapshots of a growing value then add up to at most
            // about 1.5x its final size (storage stays linear in
            // the data written), and rebuilding folds at most twice the value's size in
            // deltas.
            let snapshot = if snapshot_only.contains(&c)
                || dirty.contains(&c)
                || base.is_none()
                || book.delta_bytes >= SNAPSHOT_RATIO * book.snapshot_bytes
            {
                let v = self.state.encode_channel(c)?;
                book.snapshot_bytes = json_size(&v);
                book.delta_bytes = 0;
                Some(v)
            } else {
                None
            };
            // A snapshot already holds this step's updates, and a chain starts at its
            // newest snapshot: storing the updates too would only repeat them.
            let updates = if snapshot.is_some() {
                Vec::new()
            } else {
                updates
            };
            deltas.push(ChannelDelta {
                channel: channel_name::<S>(c, "State::apply")?.to_owned(),
                version,
                base: if snapshot_only.contains(&c) {
                    None
                } else {
                    base
                },
                updates,
                snapshot,
            });
        }
        let mut metadata = CheckpointMetadata::new(source, self.step);
        // A BTreeSet: sorted and without repeats, as `writes` promises.
        metadata.writes = std::mem::take(&mut self.writers).into_iter().collect();
        for (k, v) in &self.metadata {
            metadata = metadata.with_extra(k.clone(), v.clone());
        }
        let mut checkpoint = self.checkpoint.clone();
        // Parent is the last stored checkpoint (not an unstored in-memory one).
        checkpoint.parent = self.stored.clone();
        Ok(PutRequest {
            thread: thread.clone(),
            checkpoint,
            metadata,
            deltas,
            expected_head: self.head.clone(),
        })
    }

    fn finish(self, interrupts: Vec<Interrupt>, steps: usize) -> Run<S> {
        let state = Arc::try_unwrap(self.state).unwrap_or_else(|a| (*a).clone());
        Run {
            state,
            interrupts,
            next: self.tasks.iter().map(|t| t.node.clone()).collect(),
            checkpoint_id: self.stored,
            steps,
        }
    }
}

impl<S: State> EventSink<S> {
    async fn send(&self, e: Event<S>) -> Result<(), GraphError> {
        // A dropped receiver cancels the run.
        self.tx.send(Ok(e)).await.map_err(|_| GraphError::Cancelled)
    }
}

/// Runs one task with its timeout and retry policy.
async fn run_task<S: State>(
    node: &NodeSpec<S>,
    state: Arc<S>,
    ctx: NodeContext,
) -> Result<Outcome<S>, GraphError> {
    let policy = node.options.retry.clone().unwrap_or(crate::RetryPolicy {
        max_attempts: 1,
        ..Default::default()
    });
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let mut ctx = ctx.clone();
        ctx.interrupts = Arc::new(AtomicUsize::new(0));
        let fut = AssertUnwindSafe((node.run)(Arc::clone(&state), ctx)).catch_unwind();
        let result = match node.options.timeout {
            None => Some(fut.await),
            Some(d) => tokio::time::timeout(d, fut).await.ok(),
        };
        let error = match result {
            Some(Ok(Ok(c))) => return Ok(Outcome::Done(c)),
            Some(Ok(Err(NodeError::Interrupt(v)))) => return Ok(Outcome::Interrupted(v)),
            Some(Ok(Err(NodeError::Failed(e)))) => GraphError::Node {
                node: node.name.to_string(),
                source: e,
            },
            Some(Err(panic)) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".to_owned());
                return Err(GraphError::NodePanicked {
                    node: node.name.to_string(),
                    message,
                });
            }
            None => GraphError::NodeTimeout {
                node: node.name.to_string(),
                after: node.options.timeout.unwrap_or_default(),
            },
        };
        if attempt >= policy.max_attempts.max(1) {
            return Err(error);
        }
        tracing::warn!(node = %node.name, attempt, error = %error, "node failed; retrying");
        tokio::time::sleep(policy.backoff(attempt - 1)).await;
    }
}

/// Where checkpoints go.
enum Writer {
    None,
    Sync(Arc<dyn Checkpointer>),
    Async {
        tx: Option<mpsc::Sender<WriteOp>>,
        handle: Option<tokio::task::JoinHandle<Result<(), GraphError>>>,
    },
    Exit(Arc<dyn Checkpointer>),
}

enum WriteOp {
    Put(Box<PutRequest>),
    Writes(ThreadKey, CheckpointId, Vec<PendingWrite>),
}

impl Writer {
    fn new(cp: Option<Arc<dyn Checkpointer>>, config: &RunConfig) -> Self {
        let Some(cp) = cp.filter(|_| config.thread_id.is_some()) else {
            return Writer::None;
        };
        match config.durability {
            Durability::Sync => Writer::Sync(cp),
            Durability::Exit => Writer::Exit(cp),
            Durability::Async => {
                let (tx, mut rx) = mpsc::channel::<WriteOp>(ASYNC_QUEUE);
                let handle = tokio::spawn(async move {
                    while let Some(op) = rx.recv().await {
                        match op {
                            WriteOp::Put(r) => cp.put(*r).await?,
                            WriteOp::Writes(t, id, w) => cp.put_writes(&t, &id, w).await?,
                        }
                    }
                    Ok(())
                });
                Writer::Async {
                    tx: Some(tx),
                    handle: Some(handle),
                }
            }
        }
    }

    /// True when checkpoints are stored at all.
    fn stores(&self) -> bool {
        !matches!(self, Writer::None)
    }

    async fn put_writes(
        &mut self,
        thread: &ThreadKey,
        id: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), GraphError> {
        match self {
            Writer::None | Writer::Exit(_) => Ok(()),
            Writer::Sync(cp) => Ok(cp.put_writes(thread, id, writes).await?),
            Writer::Async { .. } => {
                self.send(WriteOp::Writes(thread.clone(), id.clone(), writes))
                    .await
            }
        }
    }

    async fn enqueue(&mut self, r: PutRequest) -> Result<(), GraphError> {
        self.send(WriteOp::Put(Box::new(r))).await
    }

    async fn send(&mut self, op: WriteOp) -> Result<(), GraphError> {
        if let Writer::Async { tx: Some(tx), .. } = self
            && tx.send(op).await.is_ok()
        {
            return Ok(());
        }
        // The writer stopped: report its error.
        self.join().await?;
        Err(GraphError::WriterStopped)
    }

    async fn join(&mut self) -> Result<(), GraphError> {
        if let Writer::Async { tx, handle } = self {
            tx.take();
            if let Some(h) = handle.take() {
                return h.await.map_err(|_| GraphError::WriterStopped)?;
            }
        }
        Ok(())
    }

    /// Stores whatever is not stored yet and waits for background writes.
    async fn flush<S: State>(&mut self, run: &mut RunState<S>) -> Result<(), GraphError> {
        match self {
            Writer::Exit(cp) => {
                let cp = Arc::clone(cp);
                let thread = run
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                let old = run.checkpoint.id.clone();
                if run.stored.as_ref() != Some(&old)
                    || !run.dirty.is_empty()
                    || run.steps_since_store > 0
                {
                    run.commit(CheckpointSource::Loop, BTreeMap::new(), Some(&cp), &thread)
                        .await?;
                }
                // Writes made during the run (interrupts) belong to the new checkpoint:
                // task ids are derived from it.
                let new = run.checkpoint.id.clone();
                if new != old && !run.pending.is_empty() {
                    let prefix = format!("{old}:");
                    let rekeyed: Vec<PendingWrite> = run
                        .pending
                        .iter()
                        .map(|w| {
                            let mut w = w.clone();
                            if let Some(path) = w.task_id.strip_prefix(&prefix) {
                                w.task_id = format!("{new}:{path}");
                            }
                            w
                        })
                        .collect();
                    cp.put_writes(&thread, &new, rekeyed.clone()).await?;
                    run.pending = rekeyed;
                }
                Ok(())
            }
            Writer::Async { .. } => self.join().await,
            Writer::None | Writer::Sync(_) => Ok(()),
        }
    }
}

fn push_unique(v: &mut Vec<NodeIx>, n: NodeIx) {
    if !v.contains(&n) {
        v.push(n);
    }
}

/// A scheduled task's path: `pull:<node>`, or `push:<n>:<node>` for the `n`-th
/// scheduled task when it comes from a `SendTo`.
fn task_path(i: usize, spec: &TaskSpec) -> String {
    match &spec.payload {
        None => format!("pull:{}", spec.node),
        Some(_) => format!("push:{i:08}:{}", spec.node),
    }
}

/// Gives each scheduled task its node, path and id, sorted by path. Pull tasks
/// (`pull:<node>`) sort by node name before push tasks (`push:<n>:<node>`, one per
/// `SendTo`, in the order sent). The id is derived from the checkpoint and the path, so it
/// is the same when a crashed step is run again. A task for a node this graph does not
/// have is [`GraphError::UnknownNode`].
fn tasks_with_ids<S: State>(
    g: &Inner<S>,
    specs: &[TaskSpec],
    checkpoint: &CheckpointId,
) -> Result<Vec<Task>, GraphError> {
    let mut tasks = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let node = *g
                .index
                .get(&s.node)
                .ok_or_else(|| GraphError::UnknownNode {
                    node: s.node.clone(),
                    checkpoint: checkpoint.clone(),
                })?;
            let path = task_path(i, s);
            Ok(Task {
                node,
                id: format!("{checkpoint}:{path}"),
                path,
                payload: s.payload.clone(),
            })
        })
        .collect::<Result<Vec<_>, GraphError>>()?;
    tasks.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(tasks)
}

/// The id and node name of each scheduled task, whether or not this graph has the
/// node (for showing a stored checkpoint).
fn task_names(specs: &[TaskSpec], checkpoint: &CheckpointId) -> Vec<(String, String)> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("{checkpoint}:{}", task_path(i, s)), s.node.clone()))
        .collect()
}

/// The interrupts not answered yet; `tasks` gives each task id's node name.
fn pending_interrupts(pending: &[PendingWrite], tasks: &[(String, String)]) -> Vec<Interrupt> {
    pending
        .iter()
        .filter(|w| w.channel == INTERRUPT)
        .filter(|w| {
            !pending
                .iter()
                .any(|r| r.task_id == w.task_id && r.channel == RESUME)
        })
        .map(|w| Interrupt {
            node: tasks
                .iter()
                .find(|(id, _)| *id == w.task_id)
                .map(|(_, node)| node.clone())
                .unwrap_or_default(),
            task_id: w.task_id.clone(),
            value: w.value.clone(),
        })
        .collect()
}

fn decode_tasks(checkpoint: &Checkpoint) -> Result<Vec<TaskSpec>, GraphError> {
    checkpoint
        .pending_sends
        .iter()
        .map(|v| {
            serde_json::from_value(v.clone()).map_err(|e| GraphError::CorruptTasks {
                id: checkpoint.id.clone(),
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Rebuilds the state from a checkpoint's channel chains, which it consumes: each
/// stored snapshot and delta is moved into the state, not copied.
fn rebuild<S: State>(
    channels: BTreeMap<String, ChannelChain>,
    checkpoint: &Checkpoint,
) -> Result<(S, Vec<ChannelBook>), GraphError> {
    let mut state = S::empty();
    let mut books = vec![ChannelBook::default(); S::CHANNELS.len()];
    for (name, chain) in channels {
        let c = channel_index::<S>(&name).ok_or_else(|| StateError::UnknownChannel {
            channel: name.clone(),
        })?;
        let book = book_mut::<S>(&mut books, c)?;
        if let Some(s) = chain.snapshot {
            book.snapshot_bytes = json_size(&s);
            state.restore_channel(c, s)?;
        }
        for d in chain.deltas {
            book.delta_bytes += d.iter().map(json_size).sum::<usize>();
            state.fold_channel(c, d)?;
        }
        book.version = checkpoint.channel_versions.get(&name).cloned();
    }
    Ok((state, books))
}

/// The book of channel `c` (`books` has one per channel of `S`).
fn book_mut<S: State>(books: &mut [ChannelBook], c: usize) -> Result<&mut ChannelBook, StateError> {
    match books.get_mut(c) {
        Some(book) => Ok(book),
        None => Err(channel_name::<S>(c, "State::apply")
            .err()
            .unwrap_or_else(|| StateError::unknown_index(c))),
    }
}

/// Groups encoded task updates by channel, keeping task order within each channel.
fn group_by_channel(
    written: &[usize],
    encoded: Vec<Vec<(usize, Value)>>,
) -> BTreeMap<usize, Vec<Value>> {
    let mut out: BTreeMap<usize, Vec<Value>> = written.iter().map(|c| (*c, Vec::new())).collect();
    for task in encoded {
        for (c, v) in task {
            if let Some(list) = out.get_mut(&c) {
                list.push(v);
            }
        }
    }
    out
}

/// The length of a value's compact JSON, without building the string.
fn json_size(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}
