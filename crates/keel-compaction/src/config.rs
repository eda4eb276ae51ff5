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
    /// the middle of the prompt makes a provider re-read everything after it). When
    /// the boundary has not moved but the prompt must shrink, the results of all but
    /// the last turn are masked; so near the budget, a turn whose results are large
    /// can be masked a step after it arrives. If masking cannot bring the prompt under
    /// the budget, a milestone summary is the safety net.
    ///
    /// Between the token threshold and the budget, masking waits until it pays for
    /// the cache it resets ([`crate::Compactor::mask_estimate`], with the horizon of
    /// [`StepTrigger::WhenItPays`]); at the budget it masks whatever it costs. On a
    /// run whose history fits the window, masking each time the threshold is crossed
    /// cost up to 23% more than no compaction on the recorded runs. Set
    /// [`StepTrigger::Always`] to mask at the threshold regardless: on the recorded
    /// runs at a 4,000-token window, runs that outgrow the window saved more that way
    /// (17% against 15%, cache-weighted), at the price of runs that fit costing more.
    Masking {
        /// Turns whose tool results stay in full.
        keep_turns: usize,
        /// Turns the boundary moves at once.
        block: usize,
    },
    /// Masking first, and a milestone summary only when masking does not bring the
    /// prompt back under the token threshold: rare summaries. Never on the step count.
    /// Below the budget it waits until masking pays, as [`Strategy::Masking`] does, and
    /// its milestone waits with it (with nothing to mask yet, it waits for the budget).
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

/// The smallest milestone budget: room for the section headings and a few items. The
/// smallest epoch and era budgets too, when a small window scales them down
/// ([`CompactionConfig::summary_share`]).
pub const MIN_MILESTONE_TOKENS: usize = 80;

/// A milestone's budget for a span of `span` tokens: `summary_ratio` of the span,
/// at least [`MIN_MILESTONE_TOKENS`] and at most `cap`.
fn span_budget(config: &CompactionConfig, span: usize, cap: usize) -> usize {
    let share = (span as f64 * config.summary_ratio.clamp(0.0, 1.0)) as usize;
    share.clamp(MIN_MILESTONE_TOKENS.min(cap), cap)
}

/// The token budgets of the summary layers for one prompt budget and fixed part
/// ([`CompactionConfig::summary_budgets`]).
///
/// ```
/// use keel_compaction::CompactionConfig;
///
/// let c = CompactionConfig::default();
/// // A 128k window: the fixed part is a sliver of the room; the defaults stand.
/// let large = c.summary_budgets(119_808, 834);
/// assert_eq!((large.milestone, large.epoch, large.era), (2_000, 800, 1_200));
/// // A 4k window with an 834-token system prompt, goal and tool specs: the layers
/// // are held to 40% of what is left, so a compaction frees room that lasts.
/// let small = c.summary_budgets(3_072, 834);
/// assert!(small.milestone < 300 && small.epoch < 150 && small.era < 200);
/// assert!(small.worst_case(&c) as f64 <= 0.4 * c.summary_room(3_072, 834) as f64);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SummaryBudgets {
    /// The most a milestone may take (its span's share may give it less:
    /// [`SummaryBudgets::milestone_for`]).
    pub milestone: usize,
    /// An epoch summary's budget (tier 2).
    pub epoch: usize,
    /// An era summary's budget (tiers 3 and up).
    pub era: usize,
}

impl SummaryBudgets {
    /// The budget of a summary at `tier` (2: epoch, 3 and up: era).
    pub fn tier(&self, tier: u8) -> usize {
        if tier <= 2 { self.epoch } else { self.era }
    }

    /// The budget of a milestone replacing `span` tokens:
    /// [`CompactionConfig::summary_ratio`] of the span, between [`MIN_MILESTONE_TOKENS`]
    /// and [`SummaryBudgets::milestone`].
    pub fn milestone_for(&self, config: &CompactionConfig, span: usize) -> usize {
        span_budget(config, span, self.milestone)
    }

    /// The tokens the summary layers hold at their fullest: the top summary, the kept
    /// epoch summaries and the milestones that wait for the next fold, each at its
    /// budget (with two tiers, one epoch summary and the milestones).
    pub fn worst_case(&self, config: &CompactionConfig) -> usize {
        let waiting = config.epoch_every.max(1) - 1;
        let kept = if config.summary_tiers <= 2 {
            0
        } else {
            config.keep_summaries.max(1) * self.epoch
        };
        let top = if config.summary_tiers <= 2 {
            self.epoch
        } else {
            self.era
        };
        top + kept + waiting * self.milestone
    }
}

/// When the step trigger ([`CompactionConfig::every_steps`]) fires, and whether the
/// masking strategies mask below the budget only when it pays.
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
    /// Whether the step trigger waits until compacting pays; for the masking
    /// strategies, whether masking below the budget does.
    pub step_trigger: StepTrigger,
    /// The price of a prompt token the provider serves from its cache, relative to an
    /// uncached one: 0.1 by default, as Anthropic's cache reads and OpenAI's GPT-5
    /// models; OpenAI bills 0.25 for GPT-4.1 and 0.5 for GPT-4o. The step trigger's
    /// cost model uses it: set it to what your provider bills. A price set higher than
    /// the bill makes compaction look cheaper than it is (with 0.5 set and 0.1 billed,
    /// keel was up to 10% dearer than no compaction on the recorded runs), and one set
    /// lower only compacts less often. Cache writes billed above a plain prompt token
    /// (Anthropic's 1.25) are not modelled.
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
    /// budget (its window minus its maximum output). A milestone that would free
    /// little there waits until the budget ([`min_token_gain`](Self::min_token_gain)).
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
    /// between 200 and 1,200, scaled down on a small window:
    /// [`summary_share`](Self::summary_share)).
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
    /// 300 and 2,000, scaled down on a small window:
    /// [`summary_share`](Self::summary_share)).
    pub milestone_budget_tokens: Option<usize>,
    /// The most of its span a milestone may take: its budget is this fraction of the
    /// tokens it replaces, at least [`MIN_MILESTONE_TOKENS`] and at most the milestone
    /// budget. A short span gets a short milestone, so a compaction pays for the cache
    /// it resets sooner (0.3).
    pub summary_ratio: f64,
    /// Token budget of the epoch summary (`None`: 3% of the input budget, between 150
    /// and 800, scaled down on a small window: [`summary_share`](Self::summary_share)).
    pub epoch_budget_tokens: Option<usize>,
    /// The most of the prompt's room the summary layers may hold at their fullest
    /// (0.4: most of it stays for raw steps). That room is what the prompt budget
    /// leaves after the system prompt, goal and tool specs, which head every prompt and
    /// never shrink ([`summary_room`](Self::summary_room)); it depends on the window,
    /// not on where the token trigger is set, so a low
    /// [`window_fraction`](Self::window_fraction) chosen to compact early does not
    /// starve the summaries. On a small window the fixed part is a large part of the budget, and
    /// summary budgets sized from the budget alone (300 tokens a milestone, 150 an
    /// epoch, 200 an era at the least) would fill most of the rest: each compaction
    /// would free room for one step, and that step would trigger the next. The budgets
    /// left at their defaults (`None` above) are scaled down together until the layers
    /// at their fullest ([`SummaryBudgets::worst_case`]) fit this share, none below
    /// [`MIN_MILESTONE_TOKENS`]; budgets set explicitly stay. With a fixed part of
    /// about 800 tokens the defaults fit from a window of about 8,000 tokens up, and
    /// nothing changes there. (At the default `window_fraction` of 0.85, 40% of the
    /// prompt's room is about half of what the token threshold leaves.)
    ///
    /// ```
    /// use keel_compaction::CompactionConfig;
    ///
    /// let c = CompactionConfig::default();
    /// assert_eq!(c.summary_share, 0.4);
    /// // A 4k window (3,072-token budget) with an 834-token fixed part:
    /// assert!(c.summary_budgets(3_072, 834).milestone < 300);
    /// // 1.0 lets the summaries take the whole room: the budgets of before.
    /// let unscaled = c.clone().with_summary_share(1.0).summary_budgets(3_072, 0);
    /// assert_eq!(unscaled.milestone, 300);
    /// // An 8k window: the defaults already fit.
    /// assert_eq!(c.summary_budgets(6_000, 834).milestone, 300);
    /// // A trigger set low to compact early leaves the summaries as they are.
    /// let early = c.clone().with_window_fraction(0.15);
    /// assert_eq!(early.summary_budgets(7_000, 600).milestone, 300);
    /// ```
    pub summary_share: f64,
    /// The least a milestone the token trigger asks for must free while the prompt
    /// still fits the budget, as a fraction of the room ([`room`](Self::room): what the
    /// token threshold leaves after the fixed part; 0.5). Past the token threshold
    /// ([`window_fraction`](Self::window_fraction)) a milestone that would free less
    /// (the raw tokens leaving less the summary replacing them) waits: the prompt is
    /// sent as it is, and the milestone comes once it frees enough, or once the prompt
    /// reaches the budget, whatever it frees then, so the prompt never overflows. A
    /// milestone that frees one step's worth costs a summarizer call and a reset of the
    /// provider's prompt cache only to be due again a step later; on a roomy window the
    /// raw tokens leaving at the threshold dwarf this floor and it never holds a
    /// milestone back. `0.0` compacts at the threshold whatever it frees. Only
    /// [`Strategy::Hierarchical`] uses it.
    ///
    /// ```
    /// use keel_compaction::CompactionConfig;
    ///
    /// let c = CompactionConfig::default();
    /// assert_eq!(c.min_token_gain, 0.5);
    /// // The room of a 4k window with an 834-token fixed part: 2,611 - 834.
    /// assert_eq!(c.room(3_072, 834), 1_777);
    /// assert_eq!(c.min_token_gain_tokens(3_072, 834), 888);
    /// assert_eq!(c.with_min_token_gain(0.0).min_token_gain_tokens(3_072, 834), 0);
    /// ```
    pub min_token_gain: f64,
    /// Compact at every check (for tests).
    pub force: bool,
    /// The hard step ceiling (default 500): [`crate::Compactor::check`] reports
    /// [`crate::Trigger::StepCeiling`] once the context has counted this many steps,
    /// over every run of a thread, not per run. keel-agent stops there with a
    /// resumable stop; raise it with [`CompactionConfig::with_max_steps`] on the
    /// agent's builder and run the thread again to go on.
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
            summary_share: 0.4,
            min_token_gain: 0.5,
            force: false,
            max_steps: 500,
            summary_retry: RetryPolicy::default().max_attempts(2),
            minify_json: true,
            fallback_after_failures: Some(1),
        }
    }
}

impl CompactionConfig {
    /// Checks the settings a builder cannot: a fraction outside its range (or not a
    /// number), a step trigger of 0, an epoch of 0 milestones, a ceiling of 0 steps.
    /// keel-agent's builder calls it; a loop of your own can call it once before the
    /// first step.
    ///
    /// ```
    /// use keel_compaction::CompactionConfig;
    /// assert!(CompactionConfig::default().validate().is_ok());
    /// let err = CompactionConfig::default().with_window_fraction(1.5).validate().unwrap_err();
    /// assert!(err.to_string().contains("window_fraction"));
    /// ```
    pub fn validate(&self) -> Result<(), crate::CompactionError> {
        let bad = |field: &'static str, reason: String| {
            Err(crate::CompactionError::BadConfig { field, reason })
        };
        if self.every_steps == Some(0) {
            return bad(
                "every_steps",
                "0 steps would compact at every step; give None to turn the step trigger off"
                    .into(),
            );
        }
        // (field, value, whether 0 is refused, what it is)
        let fractions = [
            (
                "window_fraction",
                self.window_fraction,
                true,
                "a fraction of the budget",
            ),
            (
                "summary_share",
                self.summary_share,
                true,
                "a share of the room",
            ),
            ("min_token_gain", self.min_token_gain, false, "a fraction"),
            (
                "cached_input_price",
                self.cached_input_price,
                false,
                "a relative price",
            ),
        ];
        for (field, v, above_zero, what) in fractions {
            let low_ok = if above_zero { v > 0.0 } else { v >= 0.0 };
            if !(v.is_finite() && low_ok && v <= 1.0) {
                let low = if above_zero { "above 0" } else { "from 0" };
                return bad(field, format!("{v} is not {what} {low} and at most 1"));
            }
        }
        if self.epoch_every == 0 {
            return bad(
                "epoch_every",
                "an epoch of 0 milestones; give at least 1".into(),
            );
        }
        if self.max_steps == 0 {
            return bad(
                "max_steps",
                "a ceiling of 0 steps allows no model call".into(),
            );
        }
        Ok(())
    }

    /// The budget the prompt is kept within for a model whose input budget is
    /// `input_budget` ([`ModelProfile::input_budget`](keel_token::ModelProfile::input_budget)):
    /// that budget, or [`max_prompt_tokens`](Self::max_prompt_tokens) when smaller.
    pub fn prompt_budget(&self, input_budget: usize) -> usize {
        self.max_prompt_tokens
            .map_or(input_budget, |ceiling| ceiling.min(input_budget))
    }

    /// The prompt size at which the token trigger fires for a model whose input budget
    /// is `input_budget`: [`window_fraction`](Self::window_fraction) of the
    /// [`prompt_budget`](Self::prompt_budget).
    ///
    /// ```
    /// use keel_compaction::CompactionConfig;
    ///
    /// let config = CompactionConfig::default();
    /// assert_eq!(config.token_threshold(100_000), 85_000);
    /// let capped = config.with_max_prompt_tokens(Some(40_000));
    /// assert_eq!(capped.token_threshold(100_000), 34_000);
    /// ```
    pub fn token_threshold(&self, input_budget: usize) -> usize {
        let budget = self.prompt_budget(input_budget) as f64;
        (budget * self.window_fraction.clamp(0.0, 1.0)) as usize
    }

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

    /// Sets whether the step trigger, and the masking strategies between the token
    /// threshold and the budget, wait until compacting pays
    /// ([`StepTrigger::WhenItPays`]) or not ([`StepTrigger::Always`]), leaving
    /// [`every_steps`](Self::every_steps) as it is. Masking never acts below the
    /// token threshold ([`window_fraction`](Self::window_fraction)) either way.
    ///
    /// ```
    /// use keel_compaction::{CompactionConfig, StepTrigger, Strategy};
    ///
    /// // Masking each time the token threshold is crossed, whatever it costs:
    /// let config = CompactionConfig::default()
    ///     .with_strategy(Strategy::masking())
    ///     .with_step_trigger(StepTrigger::Always);
    /// assert_eq!(config.step_trigger, StepTrigger::Always);
    /// ```
    #[must_use]
    pub fn with_step_trigger(mut self, trigger: StepTrigger) -> Self {
        self.step_trigger = trigger;
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

    /// Sets the hard step ceiling ([`CompactionConfig::max_steps`]), counted over the
    /// thread's every run.
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
    /// use keel_compaction::message::RetryPolicy;
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
        span_budget(self, span, self.milestone_budget(budget))
    }

    /// Sets the most of the room the summary layers may hold
    /// ([`CompactionConfig::summary_share`]).
    #[must_use]
    pub fn with_summary_share(mut self, share: f64) -> Self {
        self.summary_share = share;
        self
    }

    /// Sets the least a token-triggered milestone must free below the budget, as a
    /// fraction of the room ([`CompactionConfig::min_token_gain`]).
    #[must_use]
    pub fn with_min_token_gain(mut self, fraction: f64) -> Self {
        self.min_token_gain = fraction;
        self
    }

    /// The room for an input budget of `budget` tokens and a fixed part (system
    /// prompt, goal, tool specs) of `fixed`: what the token threshold leaves after the
    /// fixed part, which compaction cannot shrink. [`min_token_gain`](Self::min_token_gain)
    /// is a share of it.
    pub fn room(&self, budget: usize, fixed: usize) -> usize {
        let threshold = (budget as f64 * self.window_fraction.clamp(0.0, 1.0)) as usize;
        threshold.saturating_sub(fixed)
    }

    /// The prompt's room for an input budget of `budget` tokens and a fixed part of
    /// `fixed`: what the budget leaves after the fixed part, whatever the token
    /// threshold. [`summary_share`](Self::summary_share) is a share of it.
    pub fn summary_room(&self, budget: usize, fixed: usize) -> usize {
        budget.saturating_sub(fixed)
    }

    /// The least a token-triggered milestone must free while the prompt fits the
    /// budget ([`CompactionConfig::min_token_gain`] of the room), in tokens.
    pub fn min_token_gain_tokens(&self, budget: usize, fixed: usize) -> usize {
        let fraction = self.min_token_gain.clamp(0.0, 1.0);
        (self.room(budget, fixed) as f64 * fraction) as usize
    }

    /// The summary budgets for an input budget of `budget` tokens and a fixed part of
    /// `fixed`: [`milestone_budget`](Self::milestone_budget),
    /// [`epoch_budget`](Self::epoch_budget) and the era's
    /// [`tier_budget`](Self::tier_budget), with those left at their defaults scaled
    /// down together so the layers at their fullest fit
    /// [`summary_share`](Self::summary_share) of the room (none below
    /// [`MIN_MILESTONE_TOKENS`]). See [`SummaryBudgets`] for an example.
    pub fn summary_budgets(&self, budget: usize, fixed: usize) -> SummaryBudgets {
        let full = SummaryBudgets {
            milestone: self.milestone_budget(budget),
            epoch: self.epoch_budget(budget),
            era: self.tier_budget(budget, 3),
        };
        let cap = self.summary_room(budget, fixed) as f64 * self.summary_share.clamp(0.0, 1.0);
        if full.worst_case(self) as f64 <= cap {
            return full;
        }
        let at = |scale: f64| {
            let scaled = |n: usize, explicit: bool| {
                if explicit || n <= MIN_MILESTONE_TOKENS {
                    n
                } else {
                    ((n as f64 * scale) as usize).max(MIN_MILESTONE_TOKENS)
                }
            };
            SummaryBudgets {
                milestone: scaled(full.milestone, self.milestone_budget_tokens.is_some()),
                epoch: scaled(full.epoch, self.epoch_budget_tokens.is_some()),
                era: scaled(full.era, self.era_budget_tokens.is_some()),
            }
        };
        // The largest common scale that fits (the floors make it no simple ratio).
        let (mut fits, mut over) = (0.0, 1.0);
        for _ in 0..24 {
            let mid = (fits + over) / 2.0;
            if at(mid).worst_case(self) as f64 <= cap {
                fits = mid;
            } else {
                over = mid;
            }
        }
        at(fits)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_budgets_fit_their_share_of_the_room_on_small_windows_only() {
        let c = CompactionConfig::default();
        // (input budget, fixed part): 3,331 / 4,096 / 8,000 / 16,000 / 128,000 windows
        // with the demo's fixed part.
        for (budget, fixed) in [(2_499, 834), (3_072, 834), (6_000, 834), (12_000, 834)] {
            let b = c.summary_budgets(budget, fixed);
            let cap = c.summary_room(budget, fixed) as f64 * 0.4;
            assert!(b.worst_case(&c) as f64 <= cap, "{budget}: {b:?} over {cap}");
            assert!(b.milestone >= MIN_MILESTONE_TOKENS && b.epoch >= MIN_MILESTONE_TOKENS);
        }
        // Where the defaults fit, they stand.
        for (budget, fixed) in [
            (6_000, 834),
            (12_000, 834),
            (119_808, 834),
            (119_808, 5_000),
        ] {
            let b = c.summary_budgets(budget, fixed);
            assert_eq!(
                (b.milestone, b.epoch, b.era),
                (
                    c.milestone_budget(budget),
                    c.epoch_budget(budget),
                    c.tier_budget(budget, 3)
                ),
                "{budget}"
            );
        }
        // A smaller window scales each default budget down, none below the floor.
        let small = c.summary_budgets(3_072, 834);
        assert!(small.milestone < c.milestone_budget(3_072));
        assert!(small.era < c.tier_budget(3_072, 3));
        assert_eq!(small.epoch, MIN_MILESTONE_TOKENS);
        // A token trigger set low to compact early (the evals' 15%) leaves the
        // summaries their size: their share is of the budget, not the threshold.
        let early = c.clone().with_window_fraction(0.15);
        let b = early.summary_budgets(7_000, 600);
        assert_eq!(
            (b.milestone, b.epoch, b.era),
            (
                c.milestone_budget(7_000),
                c.epoch_budget(7_000),
                c.tier_budget(7_000, 3)
            )
        );
        // A fixed part that leaves no room: every budget at the floor.
        let none = c.summary_budgets(3_072, 3_000);
        assert_eq!(
            (none.milestone, none.epoch, none.era),
            (
                MIN_MILESTONE_TOKENS,
                MIN_MILESTONE_TOKENS,
                MIN_MILESTONE_TOKENS
            )
        );
    }

    #[test]
    fn explicit_summary_budgets_are_kept_and_the_rest_scale_around_them() {
        let c = CompactionConfig::default().with_summary_budgets(250, 120);
        let b = c.summary_budgets(3_072, 834);
        assert_eq!((b.milestone, b.epoch), (250, 120));
        assert!(b.era < c.tier_budget(3_072, 3));
        // A share of 1.0 with no fixed part: the budgets of before at 4k.
        let whole = CompactionConfig::default()
            .with_summary_share(1.0)
            .summary_budgets(3_072, 0);
        assert_eq!((whole.milestone, whole.epoch, whole.era), (300, 150, 200));
    }

    #[test]
    fn a_milestone_budget_follows_its_span_within_the_scaled_cap() {
        let c = CompactionConfig::default();
        let b = c.summary_budgets(3_072, 834);
        assert_eq!(b.milestone_for(&c, 100), MIN_MILESTONE_TOKENS);
        assert_eq!(b.milestone_for(&c, 400), 120);
        assert_eq!(b.milestone_for(&c, 10_000), b.milestone);
        assert_eq!(b.tier(2), b.epoch);
        assert_eq!(b.tier(3), b.era);
        assert_eq!(b.tier(4), b.era);
    }

    #[test]
    fn the_token_gain_floor_is_a_share_of_the_room() {
        let c = CompactionConfig::default();
        assert_eq!(c.room(3_072, 834), 2_611 - 834);
        assert_eq!(c.min_token_gain_tokens(3_072, 834), 888);
        // No room, no floor; a fixed part past the threshold leaves none.
        assert_eq!(c.room(3_072, 3_000), 0);
        assert_eq!(c.min_token_gain_tokens(3_072, 3_000), 0);
        assert_eq!(
            c.clone()
                .with_min_token_gain(0.0)
                .min_token_gain_tokens(3_072, 834),
            0
        );
        // Out-of-range fractions are clamped.
        assert_eq!(
            c.with_min_token_gain(2.0).min_token_gain_tokens(3_072, 834),
            1_777
        );
    }

    #[test]
    fn worst_case_counts_the_layers_each_tier_setting_keeps() {
        let b = SummaryBudgets {
            milestone: 100,
            epoch: 50,
            era: 70,
        };
        let three = CompactionConfig::default(); // 3 tiers, keep 3, epoch every 5
        assert_eq!(b.worst_case(&three), 70 + 3 * 50 + 4 * 100);
        let two = CompactionConfig::default().with_summary_tiers(2, 3);
        assert_eq!(b.worst_case(&two), 50 + 4 * 100);
    }
}
