//! What triggers compaction and how much it keeps.

use keel_message::RetryPolicy;

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

/// The smallest milestone budget: room for the section headings and a few items.
pub const MIN_MILESTONE_TOKENS: usize = 80;

/// When the step trigger ([`CompactionConfig::every_steps`]) fires.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum StepTrigger {
    /// Every `every_steps` steps, whatever it costs: each milestone resets the
    /// provider's prompt cache for everything after it, so on a roomy window this can
    /// cost more than sending the full history.
    Always,
    /// Once `every_steps` steps have passed, only when compacting pays for the cache it
    /// resets within `payback_steps` model calls (the default, with 5).
    ///
    /// The cost model prices a prompt token at 1 and a cached one at
    /// [`CompactionConfig::cached_input_price`] (`p`). Compacting turns `R` raw tokens
    /// into a summary of `S` (estimated at the milestone budget) and keeps a tail of `T`:
    /// the next call sends `S + T` uncached where it would have read `R + T` from the
    /// cache, and every later call reads `R - S` fewer cached tokens. Over `H =
    /// payback_steps` calls it pays when `(H - 1)·p·(R - S) > S + T - p·(R + T)` (plus
    /// the summarizer's own call, when it reported usage before). With `p = 0.1`
    /// and `H = 5` that is `R > 2.8·S + 1.8·T`: the span leaving must be about three
    /// times the summary plus twice the tail.
    ///
    /// `H` is how many more calls the run is trusted to make. A compaction just before
    /// the run ends never pays, so the default horizon is short: on the recorded
    /// tau-bench and SWE-agent runs, 10 was still dearer than the full history at a
    /// 128,000 window on SWE-agent, 5 is cheaper at every window.
    WhenItPays {
        /// Model calls the saving has to pay the reset back in.
        payback_steps: u32,
    },
}

impl Default for StepTrigger {
    fn default() -> Self {
        StepTrigger::WhenItPays { payback_steps: 5 }
    }
}

/// Compaction settings. The defaults suit production agents; tests and replays lower
/// the thresholds (or set [`CompactionConfig::force`]) so compaction happens often.
///
/// ```
/// use keel_compaction::{CompactionConfig, StepTrigger, Strategy};
///
/// let config = CompactionConfig::default();
/// assert_eq!(config.every_steps, Some(4));
/// // ... but only when compacting pays for the prompt cache it resets:
/// assert_eq!(config.step_trigger, StepTrigger::WhenItPays { payback_steps: 5 });
/// assert_eq!(config.cached_input_price, 0.1);
/// assert_eq!(config.max_prompt_tokens, None);
/// assert_eq!(config.window_fraction, 0.85);
/// assert_eq!(config.epoch_every, 5);
/// assert_eq!(config.max_steps, 500);
/// assert_eq!(config.strategy, Strategy::Hierarchical);
/// assert!(config.minify_json);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CompactionConfig {
    /// How the context is kept small.
    pub strategy: Strategy,
    /// Compact after this many steps (a step is one model call and its tool results).
    /// `None` turns the step trigger off. Only [`Strategy::Hierarchical`] uses it.
    ///
    /// The default, 4, is short because the default trigger also asks the cost model
    /// ([`StepTrigger::WhenItPays`]): on a roomy window it waits until compacting
    /// pays, on a tight one it keeps the prompt small between token-triggered
    /// compactions.
    ///
    /// A compaction keeps the most recent [`keep_recent`](Self::keep_recent) tokens
    /// (and always the newest step), so when the raw buffer holds no more than that,
    /// nothing can leave and the trigger waits: with small steps the first milestone
    /// comes later than `every_steps` (`Compactor::would_compact` tells). Lower
    /// `keep_recent_tokens` for a milestone every N steps exactly.
    ///
    /// By default the trigger also waits until compacting pays for the prompt cache it
    /// resets ([`StepTrigger::WhenItPays`]); [`CompactionConfig::with_every_steps`]
    /// asks for every N steps unconditionally ([`StepTrigger::Always`]).
    pub every_steps: Option<usize>,
    /// Whether the step trigger waits until compacting pays.
    pub step_trigger: StepTrigger,
    /// The price of a prompt token the provider serves from its cache, relative to an
    /// uncached one (0.1 for OpenAI's and Anthropic's cache reads). The step trigger's
    /// cost model uses it.
    pub cached_input_price: f64,
    /// The price of an output token relative to an uncached prompt token (4 for
    /// GPT-4o, 5 for Claude): what a summary written by a model costs, in the step
    /// trigger's cost model.
    pub output_price: f64,
    /// A ceiling on the prompt, below the model's input budget: when set, the token
    /// trigger fires at `window_fraction` of the smaller of the two, and recent-tail
    /// and summary sizes follow it. It keeps prompts small (and focused) on huge
    /// windows. `None` (the default): the model's input budget alone.
    pub max_prompt_tokens: Option<usize>,
    /// Compact when the assembled prompt reaches this fraction of the model's input
    /// budget (its window minus its maximum output).
    pub window_fraction: f64,
    /// Fold the milestones into an epoch summary once there are this many.
    pub epoch_every: usize,
    /// Summary tiers above the raw buffer (at least 2). With 2, the milestones fold
    /// into one epoch summary that folds the previous one in every time, so a long
    /// run's summary becomes a summary of a summary many deep. With 3 (the default),
    /// the last [`keep_summaries`](Self::keep_summaries) epoch summaries stay as their
    /// own layer and older ones fold, `keep_summaries` at a time, into an era summary;
    /// more tiers repeat that. Each tier has its own budget, so the summary layers stay
    /// within a bound that does not grow with the run.
    pub summary_tiers: usize,
    /// Summaries kept per middle tier before the oldest fold into the tier above.
    pub keep_summaries: usize,
    /// Token budget of an era summary (tiers 3 and up; `None`: 4% of the input budget,
    /// between 200 and 1,200).
    pub era_budget_tokens: Option<usize>,
    /// Fold milestones into the epoch within the compaction that made the last one
    /// (the default). A runtime with its own epoch step (keel-agent's `epoch` node)
    /// turns this off and calls [`crate::Compactor::fold_epoch`] itself.
    pub epoch_inline: bool,
    /// Tokens of the most recent raw history kept in full at a compaction (`None`:
    /// 2.5% of the input budget, at most 2,000). The cut never separates a tool call
    /// from its results, so the tail may be longer.
    pub keep_recent_tokens: Option<usize>,
    /// Token budget of one milestone summary (`None`: 2.5% of the input budget, between
    /// 300 and 2,000).
    pub milestone_budget_tokens: Option<usize>,
    /// The most of its span a milestone may take: its budget is this fraction of the
    /// tokens it replaces, at least [`MIN_MILESTONE_TOKENS`] and at most the milestone
    /// budget. A short span gets a short milestone, so a compaction pays for the cache
    /// it resets sooner (0.3).
    pub summary_ratio: f64,
    /// Token budget of the epoch summary (`None`: 3% of the input budget, between 150
    /// and 800).
    pub epoch_budget_tokens: Option<usize>,
    /// Compact at every check (for tests).
    pub force: bool,
    /// The hard step ceiling: [`crate::Compactor::check`] reports
    /// [`crate::Trigger::StepCeiling`] once the run has made this many model calls.
    pub max_steps: u64,
    /// How a summary whose model call failed ([`keel_summarize::SummarizeError::Model`])
    /// is retried before the compaction gives up (or falls back to the extractive
    /// summary, see [`CompactionConfig::fallback_after_failures`]): keel's one
    /// [`RetryPolicy`], the type graph nodes and model clients use (default 2 attempts
    /// in all, 500 ms apart, with jitter). A rejected reply or a refused request is not
    /// retried: the same request would get the same answer.
    pub summary_retry: RetryPolicy,
    /// Drop the whitespace between the tokens of JSON tool results as they arrive
    /// ([`keel_offload::minify_json`]; default `true`). Strings, numbers and key order
    /// stay byte for byte, so the model sees the same data in fewer tokens: about a
    /// fifth fewer for `", "`-separated JSON, more for indented JSON. The length before
    /// is recorded in the message's metadata. Turn it off to keep results byte-exact.
    pub minify_json: bool,
    /// When a summary that keeps failing is written by the fallback summarizer (the
    /// extractive one unless replaced) instead of failing the compaction: always when
    /// the context would overflow, and also once this many compactions in a row have
    /// failed ([`ContextState::failures_in_a_row`](crate::ContextState::failures_in_a_row)).
    /// Default `Some(1)`: a summarizer that fails once (its server is down, its replies
    /// are rejected) costs one missed compaction, not a context that can no longer
    /// shrink. `Some(0)` falls back at once; `None` only when the context would
    /// overflow.
    pub fallback_after_failures: Option<u32>,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            strategy: Strategy::Hierarchical,
            every_steps: Some(4),
            step_trigger: StepTrigger::default(),
            cached_input_price: 0.1,
            output_price: 4.0,
            max_prompt_tokens: None,
            window_fraction: 0.85,
            epoch_every: 5,
            summary_tiers: 3,
            keep_summaries: 3,
            era_budget_tokens: None,
            epoch_inline: true,
            keep_recent_tokens: None,
            milestone_budget_tokens: None,
            summary_ratio: 0.3,
            epoch_budget_tokens: None,
            force: false,
            max_steps: 500,
            summary_retry: RetryPolicy::default().max_attempts(2),
            minify_json: true,
            fallback_after_failures: Some(1),
        }
    }
}

impl CompactionConfig {
    /// Sets when a failing summary falls back to the fallback summarizer
    /// ([`CompactionConfig::fallback_after_failures`]).
    ///
    /// ```
    /// use keel_compaction::CompactionConfig;
    ///
    /// // Only when the context would overflow: a failing summarizer shows as failures.
    /// let config = CompactionConfig::default().with_fallback_after_failures(None);
    /// assert_eq!(config.fallback_after_failures, None);
    /// assert_eq!(CompactionConfig::default().fallback_after_failures, Some(1));
    /// ```
    #[must_use]
    pub fn with_fallback_after_failures(mut self, failures: Option<u32>) -> Self {
        self.fallback_after_failures = failures;
        self
    }

    /// Sets the strategy.
    #[must_use]
    pub fn with_strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Compacts every `steps` steps, unconditionally ([`StepTrigger::Always`]; `None`
    /// turns the step trigger off). For a step trigger that waits until compacting
    /// pays, see [`CompactionConfig::with_cost_aware_steps`].
    #[must_use]
    pub fn with_every_steps(mut self, steps: Option<usize>) -> Self {
        self.every_steps = steps;
        self.step_trigger = StepTrigger::Always;
        self
    }

    /// A step trigger every `steps` steps that fires only when compacting pays for the
    /// cache it resets within `payback_steps` model calls ([`StepTrigger::WhenItPays`]).
    #[must_use]
    pub fn with_cost_aware_steps(mut self, steps: usize, payback_steps: u32) -> Self {
        self.every_steps = Some(steps);
        self.step_trigger = StepTrigger::WhenItPays { payback_steps };
        self
    }

    /// Sets the relative price of a cached prompt token.
    #[must_use]
    pub fn with_cached_input_price(mut self, ratio: f64) -> Self {
        self.cached_input_price = ratio;
        self
    }

    /// Sets (or, with `None`, removes) the prompt ceiling below the model's budget.
    #[must_use]
    pub fn with_max_prompt_tokens(mut self, tokens: Option<usize>) -> Self {
        self.max_prompt_tokens = tokens;
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

    /// Sets how failed summaries are retried ([`CompactionConfig::summary_retry`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_compaction::CompactionConfig;
    /// use keel_message::RetryPolicy;
    ///
    /// let config = CompactionConfig::default()
    ///     .with_summary_retry(RetryPolicy::default().max_attempts(4).initial_backoff(Duration::from_secs(1)));
    /// assert_eq!(config.summary_retry.max_attempts, 4);
    /// ```
    #[must_use]
    pub fn with_summary_retry(mut self, retry: RetryPolicy) -> Self {
        self.summary_retry = retry;
        self
    }

    /// Sets whether epochs are folded within the compaction that made the last
    /// milestone ([`CompactionConfig::epoch_inline`]).
    #[must_use]
    pub fn with_epoch_inline(mut self, inline: bool) -> Self {
        self.epoch_inline = inline;
        self
    }

    /// Sets whether JSON tool results are minified as they arrive
    /// ([`CompactionConfig::minify_json`]).
    #[must_use]
    pub fn with_minify_json(mut self, on: bool) -> Self {
        self.minify_json = on;
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
            .unwrap_or((budget / 40).clamp(300, 2_000))
    }

    /// The budget of a milestone replacing `span` tokens, for an input budget of
    /// `budget`: [`CompactionConfig::summary_ratio`] of the span, between
    /// [`MIN_MILESTONE_TOKENS`] and [`CompactionConfig::milestone_budget`].
    ///
    /// ```
    /// let c = keel_compaction::CompactionConfig::default();
    /// assert_eq!(c.milestone_budget_for(7_200, 500), 150);
    /// assert_eq!(c.milestone_budget_for(7_200, 100), keel_compaction::config::MIN_MILESTONE_TOKENS);
    /// assert_eq!(c.milestone_budget_for(7_200, 100_000), c.milestone_budget(7_200));
    /// ```
    pub fn milestone_budget_for(&self, budget: usize, span: usize) -> usize {
        let cap = self.milestone_budget(budget);
        let share = (span as f64 * self.summary_ratio.clamp(0.0, 1.0)) as usize;
        share.clamp(MIN_MILESTONE_TOKENS.min(cap), cap)
    }

    /// The epoch summary budget for an input budget of `budget` tokens.
    pub fn epoch_budget(&self, budget: usize) -> usize {
        self.epoch_budget_tokens
            .unwrap_or((budget * 3 / 100).clamp(150, 800))
    }

    /// The budget of a summary at `tier` (2: epoch, 3 and up: era) for an input
    /// budget of `budget` tokens.
    pub fn tier_budget(&self, budget: usize, tier: u8) -> usize {
        if tier <= 2 {
            self.epoch_budget(budget)
        } else {
            self.era_budget_tokens
                .unwrap_or((budget / 25).clamp(200, 1_200))
        }
    }

    /// Sets the summary tiers and how many summaries a middle tier keeps.
    #[must_use]
    pub fn with_summary_tiers(mut self, tiers: usize, keep: usize) -> Self {
        self.summary_tiers = tiers;
        self.keep_summaries = keep;
        self
    }

    /// Compacts at every check.
    #[must_use]
    pub fn forced(mut self) -> Self {
        self.force = true;
        self
    }
}
