//! Streaming events of a run.

use keel_checkpoint::CheckpointId;
use serde_json::Value;

use crate::config::Interrupt;
use crate::{State, StateError, channel_index};

/// Which events [`crate::CompiledGraph::stream`] yields.
///
/// ```
/// let mode = keel_graph::StreamMode::values().with_updates();
/// assert!(mode.values && mode.updates && !mode.debug && !mode.custom);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamMode {
    /// The whole state after each step, and first (for a run given a new input) the
    /// state with the input applied, as LangGraph's `values` mode.
    pub values: bool,
    /// Each node's update, per step.
    pub updates: bool,
    /// Each stored checkpoint.
    pub debug: bool,
    /// What nodes send with [`NodeContext::emit`](crate::NodeContext::emit) (progress,
    /// a model's tokens, anything a caller should see before the node returns), as
    /// LangGraph's `custom` mode.
    pub custom: bool,
}

impl StreamMode {
    /// Only state values.
    pub fn values() -> Self {
        StreamMode {
            values: true,
            ..Self::default()
        }
    }

    /// Only node updates.
    pub fn updates() -> Self {
        StreamMode {
            updates: true,
            ..Self::default()
        }
    }

    /// Only what nodes emit ([`NodeContext::emit`](crate::NodeContext::emit)).
    pub fn custom() -> Self {
        StreamMode {
            custom: true,
            ..Self::default()
        }
    }

    /// Everything.
    pub fn all() -> Self {
        StreamMode {
            values: true,
            updates: true,
            debug: true,
            custom: true,
        }
    }

    /// Adds node updates.
    #[must_use]
    pub fn with_updates(mut self) -> Self {
        self.updates = true;
        self
    }

    /// Adds checkpoint events.
    #[must_use]
    pub fn with_debug(mut self) -> Self {
        self.debug = true;
        self
    }

    /// Adds what nodes emit.
    #[must_use]
    pub fn with_custom(mut self) -> Self {
        self.custom = true;
        self
    }
}

/// One event of a streamed run. More kinds may come: match with a `_` arm.
///
/// Order: a step's [`Updates`](Event::Updates) (one per task, in task order) and then
/// its [`Values`](Event::Values) are sent once the step is stored, so a reader never
/// sees a step the thread does not have. A [`Checkpoint`](Event::Checkpoint) is sent
/// when a checkpoint is stored (handed to the writer, with `Async`): with `Sync` and
/// `Async` each step's checkpoint comes just before that step's updates and values;
/// with `Exit` the run's one checkpoint comes after the last step's, as the run ends.
/// Match a checkpoint to its step by `step`, not by arrival. [`Done`](Event::Done)
/// comes last.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Event<S> {
    /// The state after a step (or after the input, first).
    Values {
        /// The step.
        step: i64,
        /// The state.
        state: S,
    },
    /// What one node wrote in a step, per channel (encoded as JSON).
    Updates {
        /// The step.
        step: i64,
        /// The node.
        node: String,
        /// `(channel, update)` pairs.
        update: Vec<(&'static str, Value)>,
    },
    /// A checkpoint was stored (handed to the writer, for async durability).
    Checkpoint {
        /// The step.
        step: i64,
        /// Its id.
        id: CheckpointId,
        /// Nodes scheduled next.
        next: Vec<String>,
    },
    /// A value a node sent with [`NodeContext::emit`](crate::NodeContext::emit) while
    /// it ran (with [`StreamMode::custom`]), in the order it sent them.
    Custom {
        /// The step the node runs in.
        step: i64,
        /// The node.
        node: String,
        /// What it sent.
        value: Value,
    },
    /// The run ended: at `END` (empty `next`), at an interrupt, at a breakpoint, or
    /// when its [`StopSignal`](crate::StopSignal) was raised.
    #[non_exhaustive]
    Done {
        /// Nodes that would run next.
        next: Vec<String>,
        /// Pending interrupts.
        interrupts: Vec<Interrupt>,
        /// Whether the run ended because its stop signal was raised.
        stopped: bool,
    },
}

impl<S: State> Event<S> {
    /// An [`Updates`](Event::Updates) event's update as the state's typed update (the
    /// node's return value, as the state's reducers took it); `None` for other events.
    /// A channel this state does not have is [`StateError::UnknownChannel`].
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use futures::StreamExt;
    /// # use keel_graph::{END, START, StateGraph, RunConfig, StreamMode, Event, State};
    /// # use keel_graph::reducer::Append;
    /// #[derive(Clone, Debug, State)]
    /// struct Log {
    ///     #[reducer(Append<String>)]
    ///     lines: Vec<String>,
    /// }
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Log>::new()
    ///     .add_node("greet", |_s: Arc<Log>, _c| async {
    ///         Ok(LogUpdate::default().lines(vec!["hello".to_owned()]))
    ///     })
    ///     .add_edge(START, "greet")
    ///     .add_edge("greet", END)
    ///     .compile()?;
    /// let mut events = graph.stream(LogUpdate::default(), RunConfig::default(), StreamMode::updates());
    /// let mut updates = Vec::new();
    /// while let Some(event) = events.next().await {
    ///     if let Some(update) = event?.typed_update() {
    ///         updates.push(update?.lines);
    ///     }
    /// }
    /// assert_eq!(updates, [Some(vec!["hello".to_owned()])]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn typed_update(&self) -> Option<Result<S::Update, StateError>> {
        let Event::Updates { update, .. } = self else {
            return None;
        };
        let indexed: Result<Vec<(usize, Value)>, StateError> = update
            .iter()
            .map(|(channel, value)| {
                channel_index::<S>(channel)
                    .map(|i| (i, value.clone()))
                    .ok_or_else(|| StateError::UnknownChannel {
                        channel: (*channel).to_owned(),
                    })
            })
            .collect();
        Some(indexed.and_then(|values| S::decode_update(&values)))
    }
}
