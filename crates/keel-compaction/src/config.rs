//! What triggers compaction and how much it keeps.

use std::time::Duration;

/// How the context is kept small.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strategy {
    /// Raw steps become milestones, milestones become epoch summaries (the default).
    Hierarchical,
    /// When the prompt reaches the token threshold, tool results older than the last
    /// `keep_turns` turns are replaced by a one-line placeholder naming where the full
    /// text is archived. The boundary moves in multiples of `block` turns, and only
    /// under pressure, so the prompt prefix stays cacheable between moves (a move in
    /// the middle of the prompt makes a provider re-read everything after it). If
    /// masking cannot bring the prompt under the budget, even keeping only the last
    /// turn, a milestone summary is the safety net.
    Masking {
        /// Turns whose tool results stay in full.
        keep_turns: usize,
        /// Turns the boundary moves at once.
        block: usize,
    },
    /// Masking first, and a milestone summary only when masking does not bring the
    /// prompt back under the token threshold: rare summaries. Never on the step count.
    Hybrid {
        /// Turns whose tool results stay in full.
        keep_turns: usize,
        /// Turns the boundary moves at once.
        block: usize,
    },
}

impl Strategy {
    /// Masking with keel's defaults: results of the last 3 turns stay, the boundary
    /// moves 2 turns at a time.
    pub fn masking() -> Self {
        Strategy::Masking {
            keep_turns: 3,
            block: 2,
        }
    }

    /// The hybrid with keel's defaults (as [`Strategy::masking`]).
    pub fn hybrid() -> Self {
        Strategy::Hybrid {
            keep_turns: 3,
            block: 2,
        }
    }

    /// `hierarchical`, `masking` or `hybrid`.
    pub fn name(&self) -> &'static str {
        match self {
            Strategy::Hierarchical => "hierarchical",
            Strategy::Masking { .. } => "masking",
            Strategy::Hybrid { .. } => "hybrid",
        }
    }

    pub(crate) fn mask_params(&self) -> Option<(usize, usize)> {
        match *self {
            Strategy::Hierarchical => None,
            Strategy::Masking { keep_turns, block } | Strategy::Hybrid { keep_turns, block } => {
                Some((keep_turns, block.max(1)))
            }
        }
    }
}

/// Compaction settings. The defaults suit production agents; tests and replays lower
/// the thresholds (or set [`CompactionConfig::force`]) so compaction happens often.
///
/// ```
/// use keel_compaction::{CompactionConfig, Strategy};
///
/// let config = CompactionConfig::default();
/// assert_eq!(config.every_steps, Some(10));
/// assert_eq!(config.window_fraction, 0.85);
/// assert_eq!(config.epoch_every, 5);
/// assert_eq!(config.max_steps, 500);
/// assert_eq!(config.strategy, Strategy::Hierarchical);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CompactionConfig {
    /// How the context is kept small.
    pub strategy: Strategy,
    /// Compact after this many steps (a step is one model call and its tool results).
    /// `None` turns the step trigger off. Only [`Strategy::Hierarchical`] uses it.
    ///
    /// A compaction keeps the most recent [`keep_recent`](Self::keep_recent) tokens
    /// (and always the newest step), so when the raw buffer holds no more than that,
    /// nothing can leave and the trigger waits: with small steps the first milestone
    /// comes later than `every_steps` (`Compactor::would_compact` tells). Lower
    /// `keep_recent_tokens` for a milestone every N steps exactly.
    pub every_steps: Option<usize>,
    /// Compact when the assembled prompt reaches this fraction of the model's input
    /// budget (its window minus its maximum output).
    pub window_fraction: f64,
    /// Fold the milestones into an epoch summary once there are this many.
    pub epoch_every: usize,
    /// Fold milestones into the epoch within the compaction that made the last one
    /// (the default). A runtime with its own epoch step (keel-agent's `epoch` node)
    /// turns this off and calls [`crate::Compactor::fold_epoch`] itself.
    pub epoch_inline: bool,
    /// Tokens of the most recent raw history kept in full at a compaction (`None`:
    /// 2.5% of the input budget, at most 2,000). The cut never separates a tool call
    /// from its results, so the tail may be longer.
    pub keep_recent_tokens: Option<usize>,
    /// Token budget of one milestone summary (`None`: 2% of the input budget, between
    /// 100 and 500).
    pub milestone_budget_tokens: Option<usize>,
    /// Token budget of the epoch summary (`None`: 3% of the input budget, between 150
    /// and 800).
    pub epoch_budget_tokens: Option<usize>,
    /// Compact at every check (for tests).
    pub force: bool,
    /// The hard step ceiling: [`crate::Compactor::check`] reports
    /// [`crate::Trigger::StepCeiling`] once the run has made this many model calls.
    pub max_steps: u64,
    /// Summarizer attempts per compaction before giving up (or falling back).
    pub summarize_attempts: u32,
    /// Wait before the second summarizer attempt; doubled for each further one.
    pub retry_backoff: Duration,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            strategy: Strategy::Hierarchical,
            every_steps: Some(10),
            window_fraction: 0.85,
            epoch_every: 5,
            epoch_inline: true,
            keep_recent_tokens: None,
            milestone_budget_tokens: None,
            epoch_budget_tokens: None,
            force: false,
            max_steps: 500,
            summarize_attempts: 2,
            retry_backoff: Duration::from_millis(500),
        }
    }
}

impl CompactionConfig {
    /// Sets the strategy.
    #[must_use]
    pub fn with_strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Sets the step trigger.
    #[must_use]
    pub fn with_every_steps(mut self, steps: Option<usize>) -> Self {
        self.every_steps = steps;
        self
    }

    /// Sets the token trigger's fraction of the input budget.
    #[must_use]
    pub fn with_window_fraction(mut self, fraction: f64) -> Self {
        self.window_fraction = fraction;
        self
    }

    /// Sets how many milestones are folded into an epoch summary.
    #[must_use]
    pub fn with_epoch_every(mut self, milestones: usize) -> Self {
        self.epoch_every = milestones;
        self
    }

    /// Sets the hard step ceiling.
    #[must_use]
    pub fn with_max_steps(mut self, steps: u64) -> Self {
        self.max_steps = steps;
        self
    }

    /// Sets whether epochs are folded within the compaction that made the last
    /// milestone ([`CompactionConfig::epoch_inline`]).
    #[must_use]
    pub fn with_epoch_inline(mut self, inline: bool) -> Self {
        self.epoch_inline = inline;
        self
    }

    /// Sets the tokens of recent history kept at a compaction.
    #[must_use]
    pub fn with_keep_recent_tokens(mut self, tokens: usize) -> Self {
        self.keep_recent_tokens = Some(tokens);
        self
    }

    /// Sets the milestone and epoch summary budgets.
    #[must_use]
    pub fn with_summary_budgets(mut self, milestone: usize, epoch: usize) -> Self {
        self.milestone_budget_tokens = Some(milestone);
        self.epoch_budget_tokens = Some(epoch);
        self
    }

    /// The recent tail kept for an input budget of `budget` tokens.
    ///
    /// ```
    /// let c = keel_compaction::CompactionConfig::default();
    /// assert_eq!(c.keep_recent(7_200), 180);
    /// assert_eq!(c.keep_recent(1_000_000), 2_000);
    /// ```
    pub fn keep_recent(&self, budget: usize) -> usize {
        self.keep_recent_tokens.unwrap_or((budget / 40).min(2_000))
    }

    /// The milestone summary budget for an input budget of `budget` tokens.
    pub fn milestone_budget(&self, budget: usize) -> usize {
        self.milestone_budget_tokens
            .unwrap_or((budget / 50).clamp(100, 500))
    }

    /// The epoch summary budget for an input budget of `budget` tokens.
    pub fn epoch_budget(&self, budget: usize) -> usize {
        self.epoch_budget_tokens
            .unwrap_or((budget * 3 / 100).clamp(150, 800))
    }

    /// Compacts at every check.
    #[must_use]
    pub fn forced(mut self) -> Self {
        self.force = true;
        self
    }
}
