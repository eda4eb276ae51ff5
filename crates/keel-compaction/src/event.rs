//! Compaction events: what happened, when, and what it cost.

use serde::{Deserialize, Serialize};

/// Why a compaction ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// `every_steps` steps since the last compaction.
    Steps,
    /// The prompt reached `window_fraction` of the input budget. An event at the
    /// budget ([`CompactionEvent::at_budget`]) was due whatever it cost; below it, the strategy judged it worth it (a
    /// milestone freeing at least `min_token_gain` of the room; masking that pays for
    /// the cache it resets, [`Compactor::mask_estimate`](crate::Compactor::mask_estimate),
    /// or any masking with [`StepTrigger::Always`](crate::StepTrigger::Always)).
    Tokens,
    /// The provider answered that the context is too long.
    Overflow,
    /// `force` is set.
    Force,
    /// The run reached `max_steps`: the caller should stop.
    StepCeiling,
}

impl Trigger {
    /// `steps`, `tokens`, `overflow`, `force` or `step_ceiling` (the serialized name).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Steps => "steps",
            Self::Tokens => "tokens",
            Self::Overflow => "overflow",
            Self::Force => "force",
            Self::StepCeiling => "step_ceiling",
        }
    }
}

impl std::fmt::Display for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a compaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Raw steps became a milestone.
    Milestone,
    /// Milestones (and the previous epoch) became an epoch summary. From
    /// [`Compactor::compact`](crate::Compactor::compact) (and so `after_step`), this
    /// event also covers the milestone made just before the fold: one call, one event,
    /// its tokens before and after spanning both. keel-agent's graph makes them in two
    /// steps (`compact`, then `epoch`) and records two events.
    Epoch,
    /// Old tool results were masked.
    Mask,
    /// With the prompt over the budget after compacting (whatever the trigger), or
    /// refused by the provider, and nothing older left to compact, the newest step's
    /// largest tool results were stored whole in the offload store and left as short
    /// stubs, so the prompt fits (see [`Compactor::compact`](crate::Compactor::compact)).
    Fit,
}

impl EventKind {
    /// `milestone`, `epoch`, `mask` or `fit` (the serialized name).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Milestone => "milestone",
            Self::Epoch => "epoch",
            Self::Mask => "mask",
            Self::Fit => "fit",
        }
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One compaction, successful or not. Emitted through `tracing` and kept in
/// [`crate::ContextState::events`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CompactionEvent {
    /// The steps pushed when it ran ([`crate::ContextState::step`]): a compaction
    /// after step N's push says N, and so does one inside [`crate::Compactor::call`]
    /// for the call that makes step N + 1, which is not pushed yet.
    pub step: u64,
    /// Why it ran.
    pub trigger: Trigger,
    /// What it did (or tried to do).
    pub kind: EventKind,
    /// Prompt tokens before.
    pub tokens_before: usize,
    /// Prompt tokens after (equal to `tokens_before` on failure).
    pub tokens_after: usize,
    /// Messages written to the archive.
    pub messages_archived: usize,
    /// The summarizer's prompt version (empty for masking).
    pub prompt_version: String,
    /// The summarizer's model (empty for masking).
    pub summarizer_model: String,
    /// Whether the fallback summarizer wrote the summary.
    pub fallback: bool,
    /// Wall time in milliseconds.
    pub duration_ms: u64,
    /// The error, if it failed (nothing was changed then).
    pub error: Option<String>,
    /// Prompt tokens the summarizer's model was billed (0 for the extractive
    /// summarizer and for masking).
    #[serde(default)]
    pub summary_input_tokens: u64,
    /// Of those, tokens its provider served from the prompt cache.
    #[serde(default)]
    pub summary_cached_tokens: u64,
    /// Tokens the summarizer's model wrote.
    #[serde(default)]
    pub summary_output_tokens: u64,
    /// The prompt budget when it ran ([`Compactor::prompt_budget`](crate::Compactor::prompt_budget));
    /// 0 in events stored before keel recorded it. See [`CompactionEvent::at_budget`].
    #[serde(default)]
    pub budget: usize,
}

impl CompactionEvent {
    /// Whether the prompt was at or over the budget when this ran, so it was due
    /// whatever it cost; false when the strategy chose it below the budget (a
    /// milestone worth its summary, masking that pays for the cache it resets) and for
    /// events stored before keel recorded the budget.
    ///
    /// ```
    /// # use keel_compaction::CompactionEvent;
    /// let event: CompactionEvent = serde_json::from_str(
    ///     r#"{"step": 12, "trigger": "tokens", "kind": "mask", "tokens_before": 7100,
    ///         "tokens_after": 3900, "messages_archived": 4, "prompt_version": "",
    ///         "summarizer_model": "", "fallback": false, "duration_ms": 0,
    ///         "error": null, "budget": 7000}"#,
    /// )?;
    /// assert!(event.at_budget());
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    pub fn at_budget(&self) -> bool {
        self.budget > 0 && self.tokens_before >= self.budget
    }

    pub(crate) fn emit(&self) {
        match &self.error {
            None => tracing::info!(
                step = self.step,
                trigger = %self.trigger,
                kind = %self.kind,
                tokens_before = self.tokens_before,
                tokens_after = self.tokens_after,
                archived = self.messages_archived,
                prompt_version = %self.prompt_version,
                model = %self.summarizer_model,
                fallback = self.fallback,
                duration_ms = self.duration_ms,
                summary_input_tokens = self.summary_input_tokens,
                summary_cached_tokens = self.summary_cached_tokens,
                summary_output_tokens = self.summary_output_tokens,
                budget = self.budget,
                "compaction"
            ),
            Some(error) => tracing::warn!(
                step = self.step,
                trigger = %self.trigger,
                kind = %self.kind,
                tokens = self.tokens_before,
                duration_ms = self.duration_ms,
                %error,
                "compaction failed; context unchanged"
            ),
        }
    }
}
