//! The Pregel superstep engine.
//!
//! One invocation loads the thread's checkpoint, applies the input, then runs
//! supersteps until no task is scheduled: every scheduled task runs concurrently, their
//! updates are folded into the state in task-path order once all have finished, the
//! next tasks are computed from edges, joins, routers, `goto`s and `SendTo`s, and the step
//! is checkpointed as per-channel deltas.
//!
//! This module holds [`CompiledGraph`] and its reads and edits of stored threads
//! (`get_state`, `last_checkpoint_by`, `update_state`); the rest is one module per
//! concern:
//!
//! - `index`: the compiled graph's structure ([`NodeIx`], edges, routers, joins);
//! - `superstep`: the run loop, tasks, running them, folding and routing;
//! - `persist`: checkpoint writes (deltas, snapshots, task writes, durability writers);
//! - `resume`: loading a thread (rebuilding state, scheduled tasks, stored writes);
//! - `history`: `state_history` as a stream;
//! - `streaming`: `stream` and its events.

// The names below are shared with the submodules, which each `use super::*`.
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
use crate::config::{Durability, Interrupt, Run, RunConfig, StateSnapshot, TaskError};
use crate::graph::{BuildError, Join, NodeSpec, RouterSpec};
use crate::state::{self as st, channel_name};
use crate::stream::{Event, StreamMode};
use crate::{END, GraphError, START, State, StateError, channel_index};

// Special channels of stored task writes, and the key prefix of a join's progress.
const INTERRUPT: &str = "__interrupt__";
const RESUME: &str = "__resume__";
const ERROR: &str = "__error__";
const GOTO: &str = "__goto__";
const JOIN_PREFIX: &str = "__join__:";

mod history;
mod index;
mod persist;
mod resume;
mod streaming;
mod superstep;

pub(crate) use self::index::Inner;
use self::index::{NodeIx, Target};
use self::persist::{ChannelBook, Writer, book_mut, group_by_channel, json_size};
use self::resume::{decode_tasks, pending_interrupts, rebuild, task_errors, task_names};
pub(crate) use self::streaming::Emitter;
use self::streaming::EventSink;
use self::superstep::{Outcome, RunState, Task, TaskSpec, task_path};

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
    ///
    /// A new run starts from `START` whatever the thread was waiting for, as in
    /// LangGraph: a pending interrupt is abandoned, and the nodes that were due run only
    /// if `START` leads to them. To go on where the thread stopped, answer with `Command::resume`, or edit
    /// it with [`update_state`](Self::update_state) (as `None`) and continue with
    /// `Command::none()`.
    pub async fn invoke(
        &self,
        input: impl Into<Command<S>>,
        config: &RunConfig,
    ) -> Result<Run<S>, GraphError> {
        self.run(input.into(), config, None).await
    }
}

impl<S: State> CompiledGraph<S> {
    /// The state of a thread at its latest checkpoint (or at `config.checkpoint_id`).
    /// `Ok(None)` when the thread has no checkpoint; a `checkpoint_id` the thread does
    /// not hold (pruned, or another thread's) is [`GraphError::CheckpointNotFound`], as
    /// a run from it is.
    pub async fn get_state(
        &self,
        config: &RunConfig,
    ) -> Result<Option<StateSnapshot<S>>, GraphError> {
        let (cp, thread) = self.require_checkpointer(config, "get_state")?;
        match cp.get(&thread, config.checkpoint_id.as_ref()).await? {
            None => match &config.checkpoint_id {
                Some(id) => Err(GraphError::CheckpointNotFound {
                    thread_id: thread.thread_id.clone(),
                    id: id.clone(),
                }),
                None => Ok(None),
            },
            Some(tuple) => self.snapshot_of(tuple).map(Some),
        }
    }
}

impl<S: State> CompiledGraph<S> {
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
    /// source `update`. An edit (`None`) of the thread's latest checkpoint also keeps what
    /// those tasks stored: a thread waiting on an interrupt still waits on it (answer it
    /// with [`Command::resume`]), and a task of the step that had finished is not run
    /// again. Task ids name their checkpoint, so the waiting interrupt's task id is
    /// a new one: read it again ([`get_state`](Self::get_state)) before answering with
    /// [`Command::resume_each`]. With `as_node` the update is that node's result and the tasks are
    /// scheduled anew from its edges; with [`START`] it is an input, and the tasks are
    /// the entry nodes (so a thread can be seeded by hand and then run with
    /// `Command::none()`). With `config.checkpoint_id` set to an older
    /// checkpoint, the update forks from it, and its tasks run anew. Returns the new checkpoint's id. The checkpoint's metadata `writes`
    /// is `[as_node]` (empty without one).
    pub async fn update_state(
        &self,
        config: &RunConfig,
        update: S::Update,
        as_node: Option<&str>,
    ) -> Result<CheckpointId, GraphError> {
        let (cp, thread) = self.require_checkpointer(config, "update_state")?;
        let mut run = RunState::load(self, config, None).await?;
        // `Some(None)`: as the input (START); `Some(Some(n))`: as node `n`.
        let as_node = match as_node {
            None => None,
            Some(START) => Some(None),
            Some(n) => Some(Some(*self.inner.index.get(n).ok_or_else(|| {
                GraphError::UnknownAsNode {
                    name: n.to_owned(),
                    nodes: self
                        .inner
                        .nodes
                        .iter()
                        .map(|e| e.spec.name.to_string())
                        .collect(),
                }
            })?)),
        };
        let encoded = st::encode_update::<S>(&update)?;
        let written = st::apply(Arc::make_mut(&mut run.state), vec![update])?;
        if let Some(node) = as_node {
            let mut next = Vec::new();
            let mut sends = Vec::new();
            let state = Arc::clone(&run.state);
            run.route_from(node, &state, &mut next, &mut sends)?;
            run.tasks = run.specs(next, sends);
            run.writers
                .insert(node.map_or(START, |n| &**self.inner.name(n)).to_string());
        }
        // An edit of the thread's latest checkpoint keeps the scheduled tasks, and with
        // them what they stored: a pending interrupt (and the answers a task got) and the
        // results of tasks that finished, moved to the same task paths under the new
        // checkpoint. So an edit made while the thread waits on an interrupt keeps it
        // waiting: `Command::resume` answers it, and a finished task does not run again.
        // A fork from an older checkpoint runs its tasks anew.
        let at_head = run.head.as_ref() == Some(&run.checkpoint.id);
        let carried: Vec<PendingWrite> = match as_node {
            None if at_head => std::mem::take(&mut run.pending)
                .into_iter()
                .filter(|w| w.channel != PendingWrite::ERROR)
                .collect(),
            _ => Vec::new(),
        };
        let per_channel = group_by_channel(&written, vec![encoded]);
        run.step += 1;
        let id = run
            .commit(CheckpointSource::Update, per_channel, Some(&cp), &thread)
            .await?;
        if !carried.is_empty() {
            let moved = carried
                .into_iter()
                .map(|w| {
                    PendingWrite::new(
                        format!("{id}:{}", w.task_path),
                        w.task_path,
                        w.channel,
                        w.value,
                    )
                })
                .collect();
            cp.put_writes(&thread, &id, moved).await?;
        }
        Ok(id)
    }

    fn require_checkpointer(
        &self,
        config: &RunConfig,
        what: &'static str,
    ) -> Result<(Arc<dyn Checkpointer>, ThreadKey), GraphError> {
        match (&self.inner.checkpointer, config.thread_key()?) {
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
        let names = task_names(&tasks, &checkpoint.id);
        Ok(StateSnapshot {
            values: state,
            next: tasks.iter().map(|t| t.node.clone()).collect(),
            // Shown even when this graph lacks a scheduled node: running it is what
            // fails (`GraphError::UnknownNode`), not looking at it.
            interrupts: pending_interrupts(&pending_writes, &names),
            errors: task_errors(&pending_writes, &names),
            checkpoint_id: checkpoint.id,
            parent_id: checkpoint.parent,
            metadata,
        })
    }
}
