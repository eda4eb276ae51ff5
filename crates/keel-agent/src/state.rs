//! The agent's graph state, designed for delta checkpoints.

use std::collections::VecDeque;

use keel_compaction::{CompactionEvent, ContextParts, ContextState, GoalAnchor, Layer};
use keel_graph::State;
use keel_graph::reducer::{AddMessages, KeepLast, Messages, ReduceError, Reducer};
use keel_message::Message;
use keel_offload::Lineage;
use serde::{Deserialize, Serialize};

use crate::event::AgentEvent;

/// Agent events kept in the state (the newest; older ones were streamed and traced).
pub const RECENT_EVENTS: usize = 64;
/// Compaction events kept in the state.
pub const RECENT_COMPACTIONS: usize = 16;

/// The compacting agent's state. Every field is a channel chosen so that a checkpoint
/// stores what the step added, not the whole context again (invariant 6):
///
/// | channel | reducer | a step writes |
/// |---|---|---|
/// | `goal` | [`WriteOnce`] | once, at the start; a second write is an error |
/// | `system` | last value | once, at the start |
/// | `messages` | [`AddMessages`] | the new messages; a compaction removes the flushed ones |
/// | `milestones` | [`Milestones`] | a new milestone; an epoch clears them |
/// | `epoch` | last value | the new top summary |
/// | `epochs` | last value | the kept epoch summaries, when an epoch is folded |
/// | `step`, `step_at_compaction`, `masked_turns`, `milestones_made`, `epochs_made` | last value | small counters |
/// | `compactions` | keep last 16 | the compaction's event |
/// | `events` | keep last 64 | the step's [`AgentEvent`]s |
/// | `stop` | last value | why the run stopped, if it did |
/// | `lineage` | last value | how much of the thread's archive and offloaded results this branch has seen, when it stored some |
///
/// The raw buffer (`messages`) is what the model sees after the summaries: the goal,
/// epoch and milestones are kept in their own channels and assembled in front of it.
#[derive(Clone, Debug, State)]
pub struct AgentState {
    /// The goal anchor (written once).
    #[reducer(WriteOnce<GoalAnchor>)]
    pub goal: Option<GoalAnchor>,
    /// The system prompt.
    pub system: Option<Message>,
    /// The raw buffer: recent messages in full.
    #[reducer(AddMessages)]
    pub messages: Messages,
    /// Milestones since the epoch summary, oldest first.
    #[reducer(Milestones)]
    pub milestones: Vec<Layer>,
    /// The top summary: everything older than the kept summaries, folded into one.
    /// With keel-compaction's default three tiers this is the era, made only once
    /// more epoch summaries exist than `keep_summaries`; until then it is `None` and
    /// the epoch summaries are in [`epochs`](Self::epochs).
    pub epoch: Option<Layer>,
    /// The kept summaries between the top and the milestones: with three tiers, the
    /// latest epoch summaries (each folds `epoch_every` milestones), oldest first.
    pub epochs: Vec<Layer>,
    /// Model calls so far.
    pub step: u64,
    /// `step` at the last milestone (or masking move).
    pub step_at_compaction: u64,
    /// Turns whose tool results are masked.
    pub masked_turns: u64,
    /// Milestones made so far.
    pub milestones_made: u64,
    /// Epoch summaries made so far.
    pub epochs_made: u64,
    /// The latest compaction events.
    #[reducer(KeepLast<CompactionEvent>, with = KeepLast::new(RECENT_COMPACTIONS))]
    pub compactions: VecDeque<CompactionEvent>,
    /// The latest agent events.
    #[reducer(KeepLast<AgentEvent>, with = KeepLast::new(RECENT_EVENTS))]
    pub events: VecDeque<AgentEvent>,
    /// Why the run stopped early, if it did (cleared when it continues).
    pub stop: Option<Stop>,
    /// Which branch of the thread's history this state is on, for the offload store:
    /// the archive and offloaded results as of this checkpoint. A run forked from an
    /// older checkpoint reads (with the retrieval and file tools) what was stored up to
    /// there plus its own, never what another branch stored after it. A thread stored
    /// before lineages reads [`Lineage::unscoped`] back (everything, as before).
    pub lineage: Lineage,
}

impl AgentState {
    /// The goal, if set.
    pub fn goal(&self) -> Option<&GoalAnchor> {
        self.goal.as_ref()
    }

    /// The last message of the raw buffer.
    pub fn last_message(&self) -> Option<&Message> {
        self.messages.last()
    }

    /// The final answer: the text of the last assistant message without tool calls
    /// (not one whose calls were refused, [`CALLS_REFUSED_METADATA_KEY`](crate::CALLS_REFUSED_METADATA_KEY)).
    pub fn answer(&self) -> Option<String> {
        self.messages
            .iter()
            .rev()
            .find(|m| {
                m.role == keel_message::Role::Assistant
                    && m.tool_calls.is_empty()
                    && !m.metadata.contains_key(crate::CALLS_REFUSED_METADATA_KEY)
            })
            .map(|m| m.text().into_owned())
    }

    /// The compaction engine's view of this state, borrowed: what
    /// [`Compactor::may_trigger`](keel_compaction::Compactor::may_trigger) reads.
    pub fn context_parts(&self) -> Option<ContextParts<'_>> {
        let goal = self.goal.as_ref()?;
        Some(
            ContextParts::new(goal, self.messages.as_slice())
                .with_system(self.system.as_ref())
                .with_layers(self.epoch.as_ref(), &self.epochs, &self.milestones)
                .with_steps(self.step, self.step_at_compaction),
        )
    }

    /// Compactions that failed since the last one that succeeded, as the latest
    /// compaction events show.
    pub(crate) fn failed_in_a_row(&self) -> u32 {
        self.latest_compactions_where(|e| e.error.is_some())
    }

    /// Compactions in a row at which the summarizer failed (failed, or written by the
    /// fallback), as the latest compaction events show:
    /// [`ContextState::failures_in_a_row`].
    fn summarizer_failures_in_a_row(&self) -> u32 {
        self.latest_compactions_where(|e| e.error.is_some() || e.fallback)
    }

    /// How many of the newest compaction events in a row match `pred`. The state keeps
    /// the newest [`RECENT_COMPACTIONS`], so the count stops there, far above
    /// [`MAX_FAILED_COMPACTIONS`], where a run stops.
    fn latest_compactions_where(&self, pred: impl Fn(&CompactionEvent) -> bool) -> u32 {
        let n = self
            .compactions
            .iter()
            .rev()
            .take_while(|e| pred(e))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The compaction engine's view of this state (a copy; token counts are taken
    /// afresh by the compactor, memoized per message).
    pub fn context(&self) -> Option<ContextState> {
        let goal = self.goal.clone()?;
        let mut c = ContextState::new(goal);
        c.system = self.system.clone();
        c.epoch = self.epoch.clone();
        c.epochs = self.epochs.clone();
        c.milestones = self.milestones.clone();
        c.raw = self.messages.to_vec();
        c.step = self.step;
        c.step_at_compaction = self.step_at_compaction;
        c.masked_turns = self.masked_turns;
        c.milestones_made = self.milestones_made;
        c.epochs_made = self.epochs_made;
        c.lineage = self.lineage.clone();
        c.failures_in_a_row = self.summarizer_failures_in_a_row();
        Some(c)
    }
}

/// Why a run stopped before the model gave a final answer. The thread keeps its
/// checkpoint: raise the limit (or fix the cause) and run the thread again to continue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum Stop {
    /// The thread reached the hard step ceiling
    /// ([`CompactionConfig::max_steps`](keel_compaction::CompactionConfig::max_steps),
    /// 500 model calls by default, counted over every run of the thread). Running the
    /// thread again with the same ceiling stops here again at once; run it with an agent
    /// built with a higher one (`CompactionConfig::with_max_steps`) to go on.
    StepCeiling {
        /// Model calls made.
        steps: u64,
        /// The ceiling.
        max: u64,
    },
    /// The model answered with nothing twice in a row (no text, no tool call).
    EmptyReply {
        /// Model calls made.
        steps: u64,
    },
    /// The model asked for more tool calls in one reply than
    /// [`AgentBuilder::max_tool_calls`](crate::AgentBuilder::max_tool_calls) allows twice
    /// in a row (told the first time). None was run. Running the thread again asks
    /// the model again.
    TooManyToolCalls {
        /// Model calls made.
        steps: u64,
        /// Tool calls the last reply asked for.
        calls: usize,
        /// The most one reply may ask for.
        max: usize,
    },
    /// The run used its budget of model calls ([`AgentInput::max_steps`](crate::AgentInput::max_steps)).
    RunBudget {
        /// Model calls this run made.
        steps: u64,
        /// The run's budget.
        max: u64,
    },
    /// [`MAX_FAILED_COMPACTIONS`] compactions failed in a row, so the context could no
    /// longer shrink. Nothing was removed from it; fix the cause (the summarizer's
    /// server, the offload store) and run the thread again.
    CompactionFailing {
        /// Failed compactions in a row.
        failures: u32,
        /// The last one's error.
        error: String,
    },
    /// The run's [`StopSignal`](keel_graph::StopSignal) was raised
    /// ([`AgentInput::stop_signal`](crate::AgentInput::stop_signal)): the run ended
    /// after its step in flight was stored. Never stored in the thread's state.
    Requested,
}

/// Compactions that may fail in a row before the run stops with
/// [`Stop::CompactionFailing`]: past a passing outage, a run that cannot compact only
/// grows its prompt.
pub const MAX_FAILED_COMPACTIONS: u32 = 3;

/// A sentence for people: `the step ceiling of 100 model calls was reached`.
impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::StepCeiling { steps, max } => write!(
                f,
                "the step ceiling of {max} model calls was reached ({steps} made)"
            ),
            Self::EmptyReply { steps } => write!(
                f,
                "the model replied with nothing twice in a row (after {steps} model calls)"
            ),
            Self::TooManyToolCalls { steps, calls, max } => write!(
                f,
                "the model asked for {calls} tool calls in one reply twice in a row, over the \
                 {max} a reply may ask for; none was run (after {steps} model calls)"
            ),
            Self::RunBudget { steps, max } => write!(
                f,
                "this run's budget of {max} model calls was used ({steps} made)"
            ),
            Self::Requested => f.write_str("the run was asked to stop after its current step"),
            Self::CompactionFailing { failures, error } => write!(
                f,
                "{failures} compactions failed in a row, so the context could not shrink; \
                 the last one: {error}"
            ),
        }
    }
}

/// A channel that takes one write in its whole life: a second write (even of the same
/// value) is refused, so a goal can never be replaced by accident.
///
/// ```
/// use keel_agent::WriteOnce;
/// use keel_graph::reducer::Reducer;
///
/// let r = WriteOnce::<String>::new();
/// let mut v = r.empty();
/// r.reduce(&mut v, vec!["ship it".into()])?;
/// assert!(r.reduce(&mut v, vec!["something else".into()]).is_err());
/// assert_eq!(v.as_deref(), Some("ship it"));
/// # Ok::<(), keel_graph::reducer::ReduceError>(())
/// ```
pub struct WriteOnce<T>(std::marker::PhantomData<fn() -> T>);

impl<T> WriteOnce<T> {
    /// The reducer.
    pub const fn new() -> Self {
        WriteOnce(std::marker::PhantomData)
    }
}

impl<T> Default for WriteOnce<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone + Send + Sync + 'static> Reducer for WriteOnce<T> {
    type Value = Option<T>;
    type Update = T;

    fn empty(&self) -> Option<T> {
        None
    }

    fn reduce(&self, current: &mut Option<T>, mut updates: Vec<T>) -> Result<(), ReduceError> {
        if updates.is_empty() {
            return Ok(());
        }
        if current.is_some() || updates.len() > 1 {
            return Err(ReduceError::Custom(
                "this channel is written once: it already holds a value (the goal of a thread \
                 cannot be replaced; continue the thread without a goal, or start a new thread for another goal)"
                    .to_owned(),
            ));
        }
        *current = updates.pop();
        Ok(())
    }
}

/// One write to the [`Milestones`] channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MilestoneOp {
    /// Append a milestone.
    Push(Box<Layer>),
    /// Remove every milestone (they were folded into the epoch summary).
    Clear,
}

/// The milestones channel: pushes append, a clear empties it (when an epoch folds them).
/// A step's delta is the new milestone only.
#[derive(Debug, Clone, Copy, Default)]
pub struct Milestones;

impl Reducer for Milestones {
    type Value = Vec<Layer>;
    type Update = Vec<MilestoneOp>;

    fn empty(&self) -> Vec<Layer> {
        Vec::new()
    }

    fn reduce(
        &self,
        current: &mut Vec<Layer>,
        updates: Vec<Vec<MilestoneOp>>,
    ) -> Result<(), ReduceError> {
        for op in updates.into_iter().flatten() {
            match op {
                MilestoneOp::Push(l) => current.push(*l),
                MilestoneOp::Clear => current.clear(),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milestones_push_and_clear_in_order() {
        let layer = |n: u64| Layer {
            level: keel_compaction::LayerLevel::Milestone,
            text: format!("m{n}"),
            message: Message::user(format!("m{n}")),
            first_step: n,
            last_step: n,
            prompt_version: String::new(),
            model: String::new(),
            tokens: 1,
        };
        let mut v = Vec::new();
        Milestones
            .reduce(
                &mut v,
                vec![
                    vec![MilestoneOp::Push(Box::new(layer(1)))],
                    vec![MilestoneOp::Clear, MilestoneOp::Push(Box::new(layer(2)))],
                ],
            )
            .unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].text, "m2");
    }

    #[test]
    fn write_once_refuses_two_writes_in_one_step() {
        let r = WriteOnce::<u8>::new();
        let mut v = None;
        assert!(r.reduce(&mut v, vec![1, 2]).is_err());
        assert_eq!(v, None);
    }
}
