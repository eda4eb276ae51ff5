//! What the compaction engine keeps: the layers of an agent's memory.

use keel_message::Message;
use keel_offload::Lineage;
use serde::{Deserialize, Serialize};

use crate::event::CompactionEvent;
use crate::goal::GoalAnchor;

/// The metadata key on summary messages naming their layer (`"milestone"` or `"epoch"`).
pub const LAYER_METADATA_KEY: &str = "keel.layer";
/// The metadata key on a masked tool result: the archive position of the original.
pub const MASKED_METADATA_KEY: &str = "keel.masked";
/// The metadata key that marks a user message as an observation (a tool result that
/// arrived as a user turn, as in SWE-agent), so masking treats it like a tool result.
pub const OBSERVATION_METADATA_KEY: &str = "keel.observation";

/// Which summary layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerLevel {
    /// Level 1: a summary of raw steps.
    Milestone,
    /// Level 2: a summary of milestones (with only two tiers, of the previous epoch
    /// too).
    Epoch,
    /// Level 3 and up: a summary of the older summaries of the level below and of the
    /// previous one of its own level (its number).
    Era(u8),
}

impl LayerLevel {
    /// The level as a number: 1 for milestones, 2 for epochs, 3 and up for eras.
    ///
    /// ```
    /// use keel_compaction::LayerLevel;
    /// assert_eq!(LayerLevel::Milestone.tier(), 1);
    /// assert_eq!(LayerLevel::Era(3).tier(), 3);
    /// ```
    pub fn tier(self) -> u8 {
        match self {
            LayerLevel::Milestone => 1,
            LayerLevel::Epoch => 2,
            LayerLevel::Era(t) => t,
        }
    }
}

/// One summary in the context, with the exact message it renders to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// Milestone or epoch.
    pub level: LayerLevel,
    /// The summary text.
    pub text: String,
    /// The message placed in the prompt (rendered once, so its bytes never change).
    pub message: Message,
    /// First step covered.
    pub first_step: u64,
    /// Last step covered.
    pub last_step: u64,
    /// The summarizer's prompt version.
    pub prompt_version: String,
    /// The summarizer's model.
    pub model: String,
    /// Tokens of `message`.
    pub tokens: usize,
}

/// An agent's memory as keel-compaction keeps it: the system prompt, the goal anchor
/// (level ∞), the top summary of everything older (`epoch`: an era at level 3 with the
/// default three tiers), the kept summaries of the tiers between (`epochs`: the last
/// epoch summaries), the milestones since (level 1) and the raw buffer (level 0), plus
/// the latest compaction events.
///
/// It is plain data (serde), so a graph can keep it as a state channel and a
/// checkpointer stores it with the thread.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextState {
    /// The system prompt, if any.
    pub system: Option<Message>,
    /// The goal anchor.
    pub goal: GoalAnchor,
    /// The top summary: everything older than the kept summaries, folded into one
    /// (the era with three tiers, the epoch summary with two).
    pub epoch: Option<Layer>,
    /// The kept summaries of the tiers between the top and the milestones (with three
    /// tiers: up to `keep_summaries` epoch summaries), higher tiers first, each oldest
    /// first.
    #[serde(default)]
    pub epochs: Vec<Layer>,
    /// Milestones since the last epoch summary, oldest first.
    pub milestones: Vec<Layer>,
    /// Recent messages in full.
    pub raw: Vec<Message>,
    /// Model calls so far.
    pub step: u64,
    /// `step` at the last milestone (or masking move).
    pub step_at_compaction: u64,
    /// Turns (model calls) of the raw buffer whose tool results are masked, counted from
    /// the start of the run.
    pub masked_turns: u64,
    /// The latest compaction events, successful or not, oldest first: at most
    /// [`ContextState::EVENTS_KEPT`], so a state kept for a long run (and stored with
    /// each save) does not grow with it. Every call that makes an event also returns
    /// it ([`Compactor::after_step`](crate::Compactor::after_step),
    /// [`Compactor::compact`](crate::Compactor::compact)); a caller that wants them
    /// all keeps those, or drains this list after each step. Numbering uses the
    /// counters below, not this list.
    pub events: Vec<CompactionEvent>,
    /// Milestones made so far (numbers them).
    #[serde(default)]
    pub milestones_made: u64,
    /// Epoch summaries (tier 2) made so far (numbers them).
    #[serde(default)]
    pub epochs_made: u64,
    /// Which branch of the thread's history this state is on: how much of the archive
    /// and the offloaded results it has seen. The compactor reads and writes the
    /// offload store through it, so a state restored from an older checkpoint (a
    /// fork) sees the archive as it was there plus its own records, never what the
    /// other branch archived after it. A state stored before lineages reads back
    /// [`Lineage::unscoped`] (everything of the thread, as before).
    #[serde(default)]
    pub lineage: Lineage,
    /// Compactions in a row at which the summarizer failed, whether they failed or the
    /// fallback wrote their summary (one that found nothing to compact, or a result no
    /// smaller, does not count; one the summarizer wrote resets it). From
    /// [`CompactionConfig::fallback_after_failures`](crate::CompactionConfig::fallback_after_failures)
    /// of them on, a summary the summarizer fails at is written by the fallback.
    #[serde(default)]
    pub failures_in_a_row: u32,
    /// Token counts of what the compactor has seen (recounted lazily after a load).
    #[serde(skip)]
    pub(crate) ledger: Ledger,
}

/// What [`Compactor::may_trigger`](crate::Compactor::may_trigger) reads of a context,
/// borrowed: for a runtime that keeps the context's parts in its own state and would
/// otherwise copy them into a [`ContextState`] only to learn that nothing fires.
///
/// ```
/// use keel_compaction::{ContextParts, GoalAnchor};
/// use keel_compaction::message::Message;
///
/// let goal = GoalAnchor::new("Summarize the logs.");
/// let raw = vec![Message::user("start")];
/// let parts = ContextParts::new(&goal, &raw).with_steps(1, 0);
/// assert_eq!(parts.raw.len(), 1);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ContextParts<'a> {
    /// The system prompt, if any.
    pub system: Option<&'a Message>,
    /// The goal anchor.
    pub goal: &'a GoalAnchor,
    /// The top summary.
    pub epoch: Option<&'a Layer>,
    /// The kept summaries between the top and the milestones.
    pub epochs: &'a [Layer],
    /// Milestones since the last epoch summary.
    pub milestones: &'a [Layer],
    /// The raw buffer.
    pub raw: &'a [Message],
    /// Model calls so far.
    pub step: u64,
    /// `step` at the last milestone (or masking move).
    pub step_at_compaction: u64,
}

impl<'a> ContextParts<'a> {
    /// The parts of a context with `goal` and `raw` and nothing else, at step 0.
    pub fn new(goal: &'a GoalAnchor, raw: &'a [Message]) -> Self {
        Self {
            system: None,
            goal,
            epoch: None,
            epochs: &[],
            milestones: &[],
            raw,
            step: 0,
            step_at_compaction: 0,
        }
    }

    /// Sets the system prompt.
    #[must_use]
    pub fn with_system(mut self, system: Option<&'a Message>) -> Self {
        self.system = system;
        self
    }

    /// Sets the summary layers: the top one, the kept ones, the milestones.
    #[must_use]
    pub fn with_layers(
        mut self,
        epoch: Option<&'a Layer>,
        epochs: &'a [Layer],
        milestones: &'a [Layer],
    ) -> Self {
        self.epoch = epoch;
        self.epochs = epochs;
        self.milestones = milestones;
        self
    }

    /// Sets the model calls so far and the step of the last compaction.
    #[must_use]
    pub fn with_steps(mut self, step: u64, step_at_compaction: u64) -> Self {
        self.step = step;
        self.step_at_compaction = step_at_compaction;
        self
    }

    /// The summary layers in prompt order, as [`ContextState::layers`].
    pub fn layers(&self) -> impl Iterator<Item = &'a Layer> + use<'a> {
        self.epoch
            .into_iter()
            .chain(self.epochs)
            .chain(self.milestones)
    }
}

/// Token counts kept beside the state so a step costs O(new messages). A cache: two
/// states are equal whatever their ledgers hold (a state read back from JSON, whose
/// ledger is empty until it is counted again, equals the state it was written from).
#[derive(Debug, Clone, Default)]
pub(crate) struct Ledger {
    /// (system, goal, reply priming).
    pub(crate) fixed: Option<(usize, usize, usize)>,
    /// One count per raw message counted so far.
    pub(crate) raw: Vec<usize>,
    pub(crate) raw_total: usize,
}

impl PartialEq for Ledger {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl ContextState {
    /// How many of the latest compaction events [`ContextState::events`] keeps.
    pub const EVENTS_KEPT: usize = 64;

    /// Records an event, dropping the oldest past [`ContextState::EVENTS_KEPT`].
    pub(crate) fn record(&mut self, event: CompactionEvent) {
        if self.events.len() >= Self::EVENTS_KEPT {
            let extra = self.events.len() + 1 - Self::EVENTS_KEPT;
            self.events.drain(..extra);
        }
        self.events.push(event);
    }

    /// A fresh context for `goal`.
    pub fn new(goal: GoalAnchor) -> Self {
        ContextState {
            system: None,
            goal,
            epoch: None,
            epochs: Vec::new(),
            milestones: Vec::new(),
            raw: Vec::new(),
            step: 0,
            step_at_compaction: 0,
            masked_turns: 0,
            events: Vec::new(),
            milestones_made: 0,
            epochs_made: 0,
            lineage: Lineage::new(),
            failures_in_a_row: 0,
            ledger: Ledger::default(),
        }
    }

    /// Sets the system prompt.
    #[must_use]
    pub fn with_system(mut self, system: Message) -> Self {
        self.system = Some(system);
        self.ledger.fixed = None;
        self
    }

    /// Appends one step: the model's reply and what followed it (tool results, the
    /// user's answer), each with an id (`keel-<step>-<k>` when it had none). Counts one
    /// model call if `reply` is an assistant message. The way in is
    /// [`crate::Compactor::push_step`], which also offloads large results.
    pub(crate) fn push_step(&mut self, mut reply: Message, results: Vec<Message>) {
        if reply.role == keel_message::Role::Assistant {
            self.step += 1;
        }
        let step = self.step;
        ensure_id(&mut reply, || format!("keel-{step}-0"));
        unflag_goal(&mut reply);
        self.raw.push(reply);
        for (k, mut m) in results.into_iter().enumerate() {
            ensure_id(&mut m, || format!("keel-{step}-{}", k + 1));
            unflag_goal(&mut m);
            self.raw.push(m);
        }
    }

    /// Appends messages without counting a step (user turns between model calls),
    /// each with an id (`keel-<step>-p<n>` when it had none). The way in is
    /// [`crate::Compactor::push`].
    pub(crate) fn push(&mut self, mut messages: Vec<Message>) {
        self.assign_push_ids(&mut messages);
        messages.iter_mut().for_each(unflag_goal);
        self.raw.extend(messages);
    }

    /// Gives messages pushed between model calls the ids they lack: `keel-<step>-p<n>`,
    /// numbered on from the messages that followed the last reply, skipping ids the raw
    /// buffer already has.
    pub(crate) fn assign_push_ids(&self, messages: &mut [Message]) {
        let mut n = self
            .raw
            .iter()
            .rev()
            .take_while(|m| m.role != keel_message::Role::Assistant)
            .count();
        for m in messages.iter_mut().filter(|m| m.id.is_none()) {
            loop {
                let id = format!("keel-{}-p{n}", self.step);
                n += 1;
                if !self
                    .raw
                    .iter()
                    .any(|r| r.id.as_deref() == Some(id.as_str()))
                {
                    m.id = Some(id);
                    break;
                }
            }
        }
    }

    /// This context's parts, borrowed (see [`ContextParts`]).
    pub fn parts(&self) -> ContextParts<'_> {
        ContextParts::new(&self.goal, &self.raw)
            .with_system(self.system.as_ref())
            .with_layers(self.epoch.as_ref(), &self.epochs, &self.milestones)
            .with_steps(self.step, self.step_at_compaction)
    }

    /// Steps since the last compaction.
    pub fn steps_since_compaction(&self) -> u64 {
        self.step.saturating_sub(self.step_at_compaction)
    }

    /// The summary layers in prompt order: the top summary, the kept summaries, then
    /// the milestones.
    pub fn layers(&self) -> impl Iterator<Item = &Layer> {
        self.epoch
            .iter()
            .chain(&self.epochs)
            .chain(&self.milestones)
    }
}

/// Removes the goal flag ([`keel_summarize::GOAL_METADATA_KEY`]) from a message entering
/// the raw buffer. The anchor is [`ContextState::goal`], never compacted; a flagged
/// message in the raw buffer (a copy of the anchor pushed as the first user turn, say)
/// is an ordinary turn, and with its flag every summary request holding it would be
/// refused, so no compaction could ever happen.
fn unflag_goal(m: &mut Message) {
    m.metadata.remove(keel_summarize::GOAL_METADATA_KEY);
}

/// Gives `m` the id `make` returns, unless it has one.
pub(crate) fn ensure_id(m: &mut Message, make: impl FnOnce() -> String) {
    if m.id.is_none() {
        m.id = Some(make());
    }
}
