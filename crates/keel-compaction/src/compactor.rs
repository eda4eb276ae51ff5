//! The compaction engine: triggers, assembly, milestones, epochs and masking.

use std::sync::Arc;
use std::time::Instant;

use keel_message::{Message, Role, ToolSpec};
use keel_model::{ChatModel, ChatOptions, ChatResponse};
use keel_offload::{
    Appended, Archive, EvictLargeResults, Lineage, LineageStore, OffloadError, PolicyEnv, ThreadId,
    TruncateArguments,
};
use keel_summarize::{ExtractiveSummarizer, Summarizer, SummaryRequest};
use keel_token::{ModelProfile, TokenCounter};

use crate::config::{CompactionConfig, StepTrigger, Strategy, SummaryBudgets};
use crate::cut::safe_cut_at_or_before;
use crate::error::{CallError, CompactionError};
use crate::event::{CompactionEvent, EventKind, Trigger};
use crate::goal::GoalAnchor;
use crate::prefix::PrefixSummarizer;
use crate::state::{
    ContextParts, ContextState, LAYER_METADATA_KEY, Layer, LayerLevel, MASKED_METADATA_KEY,
    OBSERVATION_METADATA_KEY,
};

/// A tool list and its tokens.
type ToolsTokens = (Arc<[ToolSpec]>, usize);

/// Whether `a` and `b` are the same memory: a slice of a live, immutable `Arc<[T]>`
/// cannot share its address with a different list, so equal means the same specs.
fn same_slice<T>(a: &[T], b: &[T]) -> bool {
    std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len()
}

/// Tokens of each layer of an assembled prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerTokens {
    /// The system prompt.
    pub system: usize,
    /// The goal anchor.
    pub goal: usize,
    /// The summaries above the milestones (the top summary and the kept ones).
    pub epoch: usize,
    /// All milestones.
    pub milestones: usize,
    /// The raw buffer.
    pub raw: usize,
    /// Tool specs.
    pub tools: usize,
    /// The whole prompt, including the reply priming.
    pub total: usize,
}

/// What compacting now would cost and save, by the step trigger's cost model
/// ([`StepTrigger::WhenItPays`]); see [`Compactor::step_estimate`] for a milestone
/// and [`Compactor::mask_estimate`] for masking (where `summary` is the placeholders).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepEstimate {
    /// Raw tokens that would leave the prompt (`R`).
    pub leaving: usize,
    /// Raw tokens kept as the recent tail (`T`).
    pub tail: usize,
    /// Tokens of the summary replacing them (`S`, estimated at the milestone budget).
    pub summary: usize,
    /// What the next model call pays extra: the summary and the tail sent uncached
    /// instead of read from the cache, plus the summarizer's own call when its last
    /// call reported usage.
    pub reset_cost: f64,
    /// What each later call saves: `R - S` fewer cached tokens.
    pub saving_per_call: f64,
    /// Calls the saving is counted over (the reset call included).
    pub payback_steps: u32,
}

impl StepEstimate {
    /// The cost model for `R = leaving` tokens replaced by `S = summary` with `T =
    /// tail` after them, a cached token at `p`, and `extra` paid once (a summarizer's
    /// call): the next call sends `S + T` uncached instead of reading `R + T` from the
    /// cache, and every later one reads `R - S` fewer cached tokens.
    fn priced(
        (leaving, tail, summary): (usize, usize, usize),
        p: f64,
        extra: f64,
        payback_steps: u32,
    ) -> Self {
        StepEstimate {
            leaving,
            tail,
            summary,
            reset_cost: (summary + tail) as f64 - p * (leaving + tail) as f64 + extra,
            saving_per_call: p * leaving.saturating_sub(summary) as f64,
            payback_steps,
        }
    }

    /// What compacting saves over `payback_steps` calls (negative: it costs more).
    pub fn net_saving(&self) -> f64 {
        f64::from(self.payback_steps.saturating_sub(1)) * self.saving_per_call - self.reset_cost
    }

    /// Whether compacting pays within `payback_steps` calls.
    pub fn pays(&self) -> bool {
        self.leaving > 0 && self.net_saving() > 0.0
    }
}

/// The summarizer's last reported call, for the cost model: (prompt, cached, output).
type LastCall = Arc<std::sync::Mutex<Option<(u64, u64, u64)>>>;

/// Keeps one agent's context within its model's window: decides when to compact,
/// assembles the prompt, and compacts.
///
/// ```
/// use std::sync::Arc;
/// use keel_compaction::message::{Message, ToolCall};
/// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
/// use keel_compaction::summarize::ExtractiveSummarizer;
/// use keel_compaction::token::{ApproxCounter, Encoding, ModelProfile};
/// use keel_compaction::{CompactionConfig, Compactor, ContextState, GoalAnchor};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let compactor = Compactor::new(
///     Arc::new(ExtractiveSummarizer::new()),
///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
///     ThreadId::new("t1")?,
///     Arc::new(ApproxCounter::new()),
///     ModelProfile::new("small", 8_000, 1_000, Encoding::Approximate),
/// )
/// .with_config(CompactionConfig::default().with_every_steps(Some(3)).with_keep_recent_tokens(50));
///
/// let mut state = ContextState::new(GoalAnchor::new("Find why the build fails."));
/// for i in 0..7 {
///     let call = ToolCall::new(format!("c{i}"), "sh", serde_json::json!({"cmd": "cargo build"}));
///     let log: String = (0..20).map(|k| format!("   Compiling dep-{k} v0.1.{i}\n")).collect();
///     compactor.push_step(
///         &mut state,
///         Message::assistant(format!("Attempt {i}.")).with_tool_calls(vec![call]),
///         vec![Message::tool(format!("c{i}"), format!("{log}error[E0{i}]: something broke in src/lib.rs"))],
///     );
///     compactor.after_step(&mut state, &[]).await?;
/// }
/// // The goal still heads the prompt; older steps became milestones.
/// let prompt = compactor.assemble(&mut state);
/// assert_eq!(prompt[0].text(), "Find why the build fails.");
/// assert_eq!(state.milestones.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Compactor {
    summarizer: Arc<dyn Summarizer>,
    fallback: Arc<dyn Summarizer>,
    archive: Arc<Archive>,
    thread: ThreadId,
    counter: Arc<dyn TokenCounter>,
    profile: ModelProfile,
    config: CompactionConfig,
    truncate: Option<TruncateArguments>,
    evict: Option<EvictLargeResults>,
    /// The last tool list counted and its tokens (tool specs rarely change between
    /// steps, and counting their schemas costs more than comparing them; a list given
    /// with [`Compactor::with_tools`] is not even compared). Shared by the clones
    /// [`Compactor::for_thread`] makes.
    tools_tokens: Arc<std::sync::Mutex<Option<ToolsTokens>>>,
    /// The summarizer's last reported usage (shared by the clones).
    last_call: LastCall,
    /// A summarizer that reuses the agent's cached prefix, used instead of
    /// `summarizer` when set.
    prefix_summarizer: Option<Arc<PrefixSummarizer>>,
    /// The provider's counts over this compactor's counter's
    /// ([`Compactor::with_count_factor`]); 1 unless set.
    count_factor: f64,
}

impl std::fmt::Debug for Compactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compactor")
            .field("thread", &self.thread)
            .field("profile", &self.profile)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Compactor {
    /// A compactor with default settings and the extractive summarizer as fallback.
    /// Tool results over the smaller of 20,000 tokens and a quarter of the input budget
    /// are offloaded on arrival ([`EvictLargeResults::for_budget`] of the profile's
    /// input budget).
    ///
    /// `profile` is what the compactor plans with: its input budget is the window
    /// less the room it keeps for the reply ([`ModelProfile::reserved_output`], at most
    /// a quarter of the window). Ask the model for replies of at most that
    /// (`ChatOptions::max_tokens`): [`Compactor::call`] refuses a larger cap, since a
    /// prompt at the budget beside it would overflow the window.
    pub fn new(
        summarizer: Arc<dyn Summarizer>,
        archive: Arc<Archive>,
        thread: ThreadId,
        counter: Arc<dyn TokenCounter>,
        profile: ModelProfile,
    ) -> Self {
        Compactor {
            summarizer,
            fallback: Arc::new(ExtractiveSummarizer::new()),
            archive,
            thread,
            counter,
            config: CompactionConfig::default(),
            truncate: Some(TruncateArguments::new()),
            evict: Some(EvictLargeResults::for_budget(profile.input_budget())),
            profile,
            tools_tokens: Arc::default(),
            last_call: Arc::default(),
            prefix_summarizer: None,
            count_factor: 1.0,
        }
    }

    /// The same compactor for another thread (archive namespace): shares the
    /// summarizers, archive, counter and caches, so making one per call is cheap.
    #[must_use]
    pub fn for_thread(&self, thread: ThreadId) -> Self {
        Compactor {
            thread,
            ..self.clone()
        }
    }

    /// Tokens of `tools`, counted once per distinct list.
    fn count_tools(&self, tools: &[ToolSpec]) -> usize {
        if tools.is_empty() {
            return 0;
        }
        let mut cache = self
            .tools_tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((specs, n)) = cache.as_ref()
            && (same_slice(specs, tools) || **specs == *tools)
        {
            return *n;
        }
        let n = self.counter.count_tools(tools);
        *cache = Some((Arc::from(tools), n));
        n
    }

    /// Counts `tools` now. A later call given a slice of this very list (the caller
    /// keeps a clone of the `Arc`, as keel-agent does for its toolbox) uses the count
    /// without comparing the specs; any other list is compared, and counted if it
    /// differs. The count is this compactor's and its clones' from here on.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_compaction::{Compactor, ContextState, GoalAnchor};
    /// use keel_compaction::message::ToolSpec;
    /// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
    /// use keel_compaction::summarize::ExtractiveSummarizer;
    /// use keel_compaction::token::{ApproxCounter, ModelProfile};
    ///
    /// let tools: Arc<[ToolSpec]> = Arc::from(vec![ToolSpec::new(
    ///     "ls",
    ///     "Lists a directory.",
    ///     serde_json::json!({"type": "object"}),
    /// )]);
    /// let compactor = Compactor::new(
    ///     Arc::new(ExtractiveSummarizer::new()),
    ///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
    ///     ThreadId::new("t1")?,
    ///     Arc::new(ApproxCounter::new()),
    ///     ModelProfile::new("m", 8_000, 1_000, keel_compaction::token::Encoding::Approximate),
    /// )
    /// .with_tools(tools.clone());
    /// let mut state = ContextState::new(GoalAnchor::new("Find the bug."));
    /// assert!(compactor.tokens(&mut state, &tools).tools > 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn with_tools(mut self, tools: Arc<[ToolSpec]>) -> Self {
        let n = if tools.is_empty() {
            0
        } else {
            self.counter.count_tools(&tools)
        };
        self.tools_tokens = Arc::new(std::sync::Mutex::new(Some((tools, n))));
        self
    }

    /// Replaces the settings.
    #[must_use]
    pub fn with_config(mut self, config: CompactionConfig) -> Self {
        self.config = config;
        self
    }

    /// Summarizes with a model through the agent's cached prompt prefix: each request
    /// sends the system prompt, goal, summaries and tools first, as the agent's prompt
    /// had them, then the span, then the instruction, so the provider reads the prefix
    /// from its cache. Used instead of the summarizer given to [`Compactor::new`]
    /// (which stays for nothing; the fallback still applies). Its calls' usage is on
    /// each [`CompactionEvent`] and in the replay's cost.
    #[must_use]
    pub fn with_prefix_summarizer(mut self, summarizer: PrefixSummarizer) -> Self {
        self.prefix_summarizer = Some(Arc::new(summarizer));
        self
    }

    /// Replaces the summarizer used when the primary keeps failing and the context
    /// would overflow, or compactions have failed in a row
    /// ([`CompactionConfig::fallback_after_failures`]).
    #[must_use]
    pub fn with_fallback(mut self, fallback: Arc<dyn Summarizer>) -> Self {
        self.fallback = fallback;
        self
    }

    /// Replaces (or, with `None`, turns off) the truncate-old-arguments policy run at
    /// each milestone.
    #[must_use]
    pub fn with_truncate_arguments(mut self, policy: Option<TruncateArguments>) -> Self {
        self.truncate = policy;
        self
    }

    /// Replaces (or, with `None`, turns off) the evict-large-results policy that
    /// [`Compactor::push_step`] applies to tool results as they arrive. To change one
    /// setting of the default, start from it:
    /// `EvictLargeResults::for_budget(profile.input_budget()).exempt("read_source")`
    /// (`EvictLargeResults::new()` has the 20,000-token threshold of a large window).
    #[must_use]
    pub fn with_evict(mut self, policy: Option<EvictLargeResults>) -> Self {
        self.evict = policy;
        self
    }

    /// Appends one step to the raw buffer: the model's `reply` and the messages that
    /// followed it, each with an id (`keel-<step>-<k>` when it has none, so the
    /// archive can find it again). Tool results over the eviction threshold are
    /// written to the offload store first and enter the context as a stub (path, size,
    /// head and tail lines); a result whose write fails enters in full, so nothing is
    /// lost. JSON results that stay are minified ([`CompactionConfig::minify_json`]).
    /// This is the one way into the raw buffer, with [`Compactor::push`].
    ///
    /// It is synchronous and counts and stores what it is given: with exact counts, a
    /// result of megabytes takes a while (about a third of a second a megabyte for a
    /// run of one repeated character, in time and memory linear in the text, and far
    /// less for prose), and a file store writes to disk. In
    /// async code, call it inside `tokio::task::spawn_blocking` (or `block_in_place`)
    /// when tool results can be that large; keel-agent does its eviction off the
    /// runtime.
    ///
    /// The goal anchor is the state's own ([`ContextState::goal`]) and heads every
    /// prompt. A message pushed with the goal flag (say, a copy of the anchor pushed as
    /// the first user turn) enters as an ordinary turn: its flag is removed, so it
    /// compacts like any other message instead of making every summary request fail.
    pub fn push_step(&self, state: &mut ContextState, mut reply: Message, results: Vec<Message>) {
        let step = state.step + u64::from(reply.role == Role::Assistant);
        crate::state::ensure_id(&mut reply, || format!("keel-{step}-0"));
        let mut results = results;
        for (k, m) in results.iter_mut().enumerate() {
            crate::state::ensure_id(m, || format!("keel-{step}-{}", k + 1));
        }
        let mut results = match &self.evict {
            Some(policy) if results.iter().any(is_observation) => {
                self.evict(policy, &reply, results, &mut state.lineage)
            }
            _ => results,
        };
        if self.config.minify_json {
            keel_offload::minify_json_results(&mut results);
        }
        state.push_step(reply, results);
    }

    /// Appends messages that are not a step (a user's turn between model calls), each
    /// with an id (`keel-<step>-p<n>` when it has none); observations among them are
    /// offloaded as [`Compactor::push_step`] offloads results.
    pub fn push(&self, state: &mut ContextState, messages: Vec<Message>) {
        let mut messages = messages;
        state.assign_push_ids(&mut messages);
        let mut messages = match &self.evict {
            Some(policy) if messages.iter().any(is_observation) => self.evict(
                policy,
                &Message::assistant(""),
                messages,
                &mut state.lineage,
            ),
            _ => messages,
        };
        if self.config.minify_json {
            keel_offload::minify_json_results(&mut messages);
        }
        state.push(messages);
    }

    /// Runs the evict policy over `results`, storing in `lineage`'s branch of the
    /// thread (and moving it on). Observations that arrived as user messages are
    /// offloaded like tool results (under their message id).
    fn evict(
        &self,
        policy: &EvictLargeResults,
        reply: &Message,
        results: Vec<Message>,
        lineage: &mut Lineage,
    ) -> Vec<Message> {
        // The reply goes along so the policy can name each result's tool.
        let mut batch = Vec::with_capacity(results.len() + 1);
        batch.push(reply.clone());
        let mut as_tool = Vec::with_capacity(results.len());
        for (k, mut m) in results.into_iter().enumerate() {
            let observation = m.role == Role::User && is_observation(&m);
            if observation {
                m.role = Role::Tool;
                m.tool_call_id = Some(m.id.clone().unwrap_or_else(|| {
                    format!(
                        "observation-{}-{k}",
                        reply.id.as_deref().unwrap_or_default()
                    )
                }));
            }
            as_tool.push(observation);
            batch.push(m);
        }
        let view = self.view(lineage);
        let env = PolicyEnv::new(&view, &self.thread, &*self.counter);
        let outcome = policy.apply(batch, &env);
        *lineage = view.lineage();
        for f in &outcome.failures {
            tracing::warn!(error = %f.error, "offloading a large tool result failed; kept in full");
        }
        outcome
            .messages
            .into_iter()
            .skip(1)
            .zip(as_tool)
            .map(|(mut m, observation)| {
                if observation {
                    m.role = Role::User;
                    m.tool_call_id = None;
                }
                m
            })
            .collect()
    }

    /// Archives `messages` in the state's lineage (off the async runtime) and moves the
    /// lineage on past them; on failure the state is as it was.
    async fn archive_in(
        &self,
        state: &mut ContextState,
        messages: Vec<Message>,
    ) -> Result<Appended, CompactionError> {
        let (appended, lineage) =
            append_off_runtime(&self.archive, &self.thread, state.lineage.clone(), messages)
                .await
                .map_err(CompactionError::Archive)?;
        state.lineage = lineage;
        Ok(appended)
    }

    /// The offload store as `lineage` of this thread sees it.
    fn view(&self, lineage: &Lineage) -> LineageStore {
        LineageStore::new(
            Arc::clone(self.archive.store()),
            self.thread.clone(),
            lineage.clone(),
        )
    }

    /// The settings.
    pub fn config(&self) -> &CompactionConfig {
        &self.config
    }

    /// The model's input budget: its window minus its maximum output.
    pub fn budget(&self) -> usize {
        let budget = self.profile.input_budget();
        if self.count_factor == 1.0 {
            return budget;
        }
        // `as` saturates: a huge budget stays finite.
        (budget as f64 / self.count_factor).floor() as usize
    }

    /// Plans with counts that are `factor` times what the provider counts (its
    /// `prompt_tokens` over this compactor's count of the same prompt, as
    /// [`keel_token::CalibratedCounter`] learns it): the input budget, in the
    /// counter's tokens, is the profile's divided by `factor`, and the token trigger,
    /// the recent tail and the summary budgets follow it. For a counter that runs
    /// high (an estimate for a model keel has no tokenizer for) it is below 1, and
    /// more of the window is used. The counts themselves, stored and reported, stay
    /// the counter's. Not finite or not positive: ignored (1).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_compaction::Compactor;
    /// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
    /// use keel_compaction::summarize::ExtractiveSummarizer;
    /// use keel_compaction::token::{ApproxCounter, Encoding, ModelProfile};
    ///
    /// let compactor = Compactor::new(
    ///     Arc::new(ExtractiveSummarizer::new()),
    ///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
    ///     ThreadId::new("t1")?,
    ///     Arc::new(ApproxCounter::new()),
    ///     ModelProfile::new("local", 8_192, 2_048, Encoding::Approximate),
    /// );
    /// assert_eq!(compactor.budget(), 6_144);
    /// // The server counts 0.6 of what the estimate says.
    /// assert_eq!(compactor.with_count_factor(0.6).budget(), 10_240);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn with_count_factor(mut self, factor: f64) -> Self {
        self.count_factor = if factor.is_finite() && factor > 0.0 {
            factor
        } else {
            1.0
        };
        self
    }

    /// The budget the prompt is kept within: the model's input budget, or
    /// [`CompactionConfig::max_prompt_tokens`] when that is smaller. The token trigger,
    /// the recent tail and the summary budgets follow it.
    pub fn prompt_budget(&self) -> usize {
        self.config.prompt_budget(self.budget())
    }

    /// The token threshold of the token trigger
    /// ([`CompactionConfig::token_threshold`] for this model).
    pub fn threshold(&self) -> usize {
        self.config.token_threshold(self.budget())
    }

    /// The model input, in order: system prompt, goal, epoch summary, milestones, raw
    /// buffer. Between compaction events each call returns the previous prompt plus new
    /// messages at its end (invariant 8).
    pub fn assemble(&self, state: &mut ContextState) -> Vec<Message> {
        self.prompt(state).cloned().collect()
    }

    /// The model input as references (no copies).
    pub fn prompt<'a>(&self, state: &'a ContextState) -> impl Iterator<Item = &'a Message> {
        state
            .system
            .iter()
            .chain(std::iter::once(state.goal.message()))
            .chain(state.layers().map(|l| &l.message))
            .chain(&state.raw)
    }

    /// Tokens of each layer of the prompt (and of `tools`). Counts only messages it has
    /// not counted before, so a step costs O(new messages).
    pub fn tokens(&self, state: &mut ContextState, tools: &[ToolSpec]) -> LayerTokens {
        let c = &*self.counter;
        let ledger = &mut state.ledger;
        if ledger.fixed.is_none() {
            ledger.fixed = Some(self.fixed_tokens(state.system.as_ref(), &state.goal));
        }
        while ledger.raw.len() < state.raw.len() {
            let n = c.count_message(&state.raw[ledger.raw.len()]);
            ledger.raw.push(n);
            ledger.raw_total += n;
        }
        if ledger.raw.len() > state.raw.len() {
            // Messages were removed behind the ledger's back: recount.
            ledger.raw.clear();
            ledger.raw_total = 0;
            return self.tokens(state, tools);
        }
        let fixed = ledger.fixed.unwrap_or_default();
        let raw = ledger.raw_total;
        self.layer_tokens(fixed, state.parts(), raw, tools)
    }

    /// The counts of [`LayerTokens`] from the fixed parts' (system, goal, reply
    /// priming), the summary layers of `parts`, and the raw buffer's total.
    fn layer_tokens(
        &self,
        (system, goal, priming): (usize, usize, usize),
        parts: ContextParts<'_>,
        raw: usize,
        tools: &[ToolSpec],
    ) -> LayerTokens {
        let epoch = parts.epoch.map_or(0, |l| l.tokens)
            + parts.epochs.iter().map(|l| l.tokens).sum::<usize>();
        let milestones = parts.milestones.iter().map(|l| l.tokens).sum();
        let tools = self.count_tools(tools);
        LayerTokens {
            system,
            goal,
            epoch,
            milestones,
            raw,
            tools,
            total: system + goal + epoch + milestones + raw + tools + priming,
        }
    }

    /// Whether [`check`](Self::check) could fire for a context with these parts, without
    /// a [`ContextState`]: `false` means `check` would answer `None`; `true` means call
    /// it. The cheap tests come first; the token count goes through the counter (a
    /// profile's counter remembers each message it counted, so only new messages cost
    /// a count). Keep it in step with `check`: every trigger `check` can report must
    /// make this `true`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_compaction::{CompactionConfig, Compactor, ContextParts, GoalAnchor};
    /// use keel_compaction::message::Message;
    /// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
    /// use keel_compaction::summarize::ExtractiveSummarizer;
    /// use keel_compaction::token::{ApproxCounter, Encoding, ModelProfile};
    ///
    /// let compactor = Compactor::new(
    ///     Arc::new(ExtractiveSummarizer::new()),
    ///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
    ///     ThreadId::new("t1")?,
    ///     Arc::new(ApproxCounter::new()),
    ///     ModelProfile::new("large", 128_000, 16_000, Encoding::Approximate),
    /// )
    /// .with_config(CompactionConfig::default().with_every_steps(Some(10)));
    /// let goal = GoalAnchor::new("Fix the build.");
    /// let raw = vec![Message::user("go"), Message::assistant("on it")];
    /// let quiet = ContextParts::new(&goal, &raw).with_steps(3, 0);
    /// assert!(!compactor.may_trigger(quiet, &[]));
    /// let due = ContextParts::new(&goal, &raw).with_steps(10, 0);
    /// assert!(compactor.may_trigger(due, &[]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn may_trigger(&self, parts: ContextParts<'_>, tools: &[ToolSpec]) -> bool {
        self.unconditional_trigger(parts).is_some()
            || self.steps_due(parts)
            || self.over_threshold(parts, || self.tokens_of(parts, tools).total)
    }

    /// The triggers that need no count: the step ceiling, then a forced compaction.
    fn unconditional_trigger(&self, parts: ContextParts<'_>) -> Option<Trigger> {
        if parts.step >= self.config.max_steps {
            Some(Trigger::StepCeiling)
        } else if self.config.force && !parts.raw.is_empty() {
            Some(Trigger::Force)
        } else {
            None
        }
    }

    /// Whether the step trigger is due (whether compacting pays is decided apart).
    fn steps_due(&self, parts: ContextParts<'_>) -> bool {
        self.config.strategy == Strategy::Hierarchical
            && self
                .config
                .every_steps
                .is_some_and(|n| parts.step.saturating_sub(parts.step_at_compaction) >= n as u64)
    }

    /// Whether the token trigger fires, given the prompt's total (counted only when
    /// the raw buffer holds more than one message).
    fn over_threshold(&self, parts: ContextParts<'_>, total: impl FnOnce() -> usize) -> bool {
        parts.raw.len() > 1 && total() >= self.threshold()
    }

    /// The tokens of each layer of a prompt with these parts: as
    /// [`tokens`](Self::tokens), with every message through the counter (no ledger).
    pub fn tokens_of(&self, parts: ContextParts<'_>, tools: &[ToolSpec]) -> LayerTokens {
        let fixed = self.fixed_tokens(parts.system, parts.goal);
        let raw = parts
            .raw
            .iter()
            .map(|m| self.counter.count_message(m))
            .sum();
        self.layer_tokens(fixed, parts, raw, tools)
    }

    /// The tokens of the system prompt, the goal, and the reply's priming.
    fn fixed_tokens(&self, system: Option<&Message>, goal: &GoalAnchor) -> (usize, usize, usize) {
        let c = &*self.counter;
        (
            system.map_or(0, |m| c.count_message(m)),
            c.count_message(goal.message()),
            c.count_messages(&[]),
        )
    }

    /// Whether to compact now, and why.
    pub fn check(&self, state: &mut ContextState, tools: &[ToolSpec]) -> Option<Trigger> {
        if let Some(t) = self.unconditional_trigger(state.parts()) {
            return Some(t);
        }
        let total = self.tokens(state, tools).total;
        // Past the threshold a milestone that would free little waits, while the
        // prompt still fits the budget (`CompactionConfig::min_token_gain`).
        if self.over_threshold(state.parts(), || total)
            && !self.token_milestone_waits(state, tools, total)
            && !self.masking_waits(state, tools, total)
        {
            return Some(Trigger::Tokens);
        }
        if self.steps_due(state.parts()) {
            match self.config.step_trigger {
                StepTrigger::Always => return Some(Trigger::Steps),
                StepTrigger::WhenItPays { .. } => {
                    let estimate = self.step_estimate(state, tools);
                    if estimate.pays() {
                        return Some(Trigger::Steps);
                    }
                    tracing::debug!(
                        step = state.step,
                        leaving = estimate.leaving,
                        tail = estimate.tail,
                        summary = estimate.summary,
                        net_saving = estimate.net_saving(),
                        "step trigger waits: compacting would not pay for the cache it resets"
                    );
                }
            }
        }
        None
    }

    /// Whether a milestone the token trigger asks for waits: the prompt (`total`
    /// tokens) still fits the budget and the milestone would free less than
    /// [`CompactionConfig::min_token_gain`] of the room. Only the hierarchical
    /// strategy waits (masking frees without a summarizer call).
    fn token_milestone_waits(
        &self,
        state: &mut ContextState,
        tools: &[ToolSpec],
        total: usize,
    ) -> bool {
        if self.config.strategy != Strategy::Hierarchical || total >= self.prompt_budget() {
            return false;
        }
        let fixed = self.fixed_of(state, tools);
        let floor = self
            .config
            .min_token_gain_tokens(self.prompt_budget(), fixed);
        if floor == 0 {
            return false;
        }
        let gain = self.gain_given(state, tools, fixed);
        if gain < floor {
            tracing::debug!(
                step = state.step,
                total,
                gain,
                floor,
                "token trigger waits: the milestone would free too little"
            );
            return true;
        }
        false
    }

    /// Whether masking the token trigger asks for waits: the prompt (`total` tokens)
    /// still fits the budget and masking would not pay for the prompt cache it resets
    /// within the step trigger's horizon ([`Compactor::mask_estimate`]). Only the
    /// masking strategies wait, and only with [`StepTrigger::WhenItPays`]; at the
    /// budget they mask whatever it costs.
    fn masking_waits(&self, state: &mut ContextState, tools: &[ToolSpec], total: usize) -> bool {
        if self.config.strategy.mask_params().is_none()
            || total >= self.prompt_budget()
            || !matches!(self.config.step_trigger, StepTrigger::WhenItPays { .. })
        {
            return false;
        }
        let estimate = self.mask_estimate(state, tools);
        if estimate.pays() {
            return false;
        }
        tracing::debug!(
            step = state.step,
            total,
            masked = estimate.leaving,
            placeholders = estimate.summary,
            after = estimate.tail,
            net_saving = estimate.net_saving(),
            "token trigger waits: masking would not pay for the cache it resets"
        );
        true
    }

    /// What masking now would cost and save, by the cost model of
    /// [`StepTrigger::WhenItPays`] (the payback horizon is its `payback_steps`; with
    /// [`StepTrigger::Always`], 1: masking is never said to pay). `leaving` is the tool
    /// results masking would replace, `summary` their placeholders, and `tail` the rest
    /// of the raw buffer from the first of them on: masking changes the prompt there,
    /// so the next call reads none of it from the provider's cache. For
    /// [`Strategy::Hierarchical`], nothing leaves.
    ///
    /// Below the budget the masking strategies mask only when this pays: on a run whose
    /// history fits the window, masking each time the token threshold is crossed
    /// re-sends most of the prompt uncached, and cost up to 23% more than no
    /// compaction on the recorded SWE-agent runs at an 8,000-token window.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_compaction::{CompactionConfig, Compactor, ContextState, GoalAnchor, Strategy};
    /// use keel_compaction::message::{Message, ToolCall};
    /// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
    /// use keel_compaction::summarize::ExtractiveSummarizer;
    /// use keel_compaction::token::{ApproxCounter, Encoding, ModelProfile};
    ///
    /// let masking = Strategy::Masking { keep_turns: 1, block: 1 };
    /// let compactor = Compactor::new(
    ///     Arc::new(ExtractiveSummarizer::new()),
    ///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
    ///     ThreadId::new("t1")?,
    ///     Arc::new(ApproxCounter::new()),
    ///     ModelProfile::new("small", 8_192, 1_024, Encoding::Approximate),
    /// )
    /// .with_config(CompactionConfig::default().with_strategy(masking));
    /// let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    /// // A large result, then a short one: masking the first frees far more than the
    /// // little after it costs to send again.
    /// for (i, lines) in [(0, 100), (1, 2)] {
    ///     let call = ToolCall::new(format!("c{i}"), "sh", serde_json::json!({"cmd": "cat log"}));
    ///     let log = format!("line {i} of the build log, nothing to see\n").repeat(lines);
    ///     compactor.push_step(
    ///         &mut state,
    ///         Message::assistant("Reading.").with_tool_calls(vec![call]),
    ///         vec![Message::tool(format!("c{i}"), log)],
    ///     );
    /// }
    /// let estimate = compactor.mask_estimate(&mut state, &[]);
    /// assert!(estimate.leaving > 500 && estimate.pays(), "{estimate:?}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mask_estimate(&self, state: &mut ContextState, tools: &[ToolSpec]) -> StepEstimate {
        // The ledger counts every raw message.
        self.tokens(state, tools);
        let payback_steps = match self.config.step_trigger {
            StepTrigger::WhenItPays { payback_steps } => payback_steps,
            StepTrigger::Always => 1,
        };
        let mut targets = self
            .mask_targets(state, None)
            .map(|(_, t)| t)
            .unwrap_or_default();
        if targets.is_empty() && matches!(self.config.strategy, Strategy::Masking { .. }) {
            // What `relieve` masks next: all but the last turn.
            targets = self
                .mask_targets(state, Some(1))
                .map(|(_, t)| t)
                .unwrap_or_default();
        }
        let leaving: usize = targets
            .iter()
            .map(|&(i, _)| self.raw_tokens(state, i))
            .sum();
        let summary: usize = targets.iter().map(|&(_, placeholder)| placeholder).sum();
        let after: usize = targets
            .first()
            .map_or(0, |&(first, _)| state.ledger.raw.iter().skip(first).sum());
        let tail = after.saturating_sub(leaving);
        let p = self.config.cached_input_price.clamp(0.0, 1.0);
        StepEstimate::priced((leaving, tail, summary), p, 0.0, payback_steps)
    }

    /// What a milestone for the token trigger would free now: the raw tokens leaving
    /// less the summary replacing them (estimated at its budget). Below the budget the
    /// token trigger waits while this is under
    /// [`CompactionConfig::min_token_gain`] of the room.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_compaction::{Compactor, ContextState, GoalAnchor};
    /// use keel_compaction::message::{Message, ToolCall};
    /// use keel_compaction::offload::{Archive, MemoryStore, ThreadId};
    /// use keel_compaction::summarize::ExtractiveSummarizer;
    /// use keel_compaction::token::{ApproxCounter, Encoding, ModelProfile};
    ///
    /// let compactor = Compactor::new(
    ///     Arc::new(ExtractiveSummarizer::new()),
    ///     Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
    ///     ThreadId::new("t1")?,
    ///     Arc::new(ApproxCounter::new()),
    ///     ModelProfile::new("small", 4_096, 1_024, Encoding::Approximate),
    /// );
    /// let mut state = ContextState::new(GoalAnchor::new("Read the logs."));
    /// // One step: nothing can leave (the newest step always stays).
    /// let step = |i: usize| {
    ///     let call = ToolCall::new(format!("c{i}"), "sh", serde_json::json!({"cmd": "cat log"}));
    ///     let log = format!("line {i} of the build log, nothing to see\n").repeat(40);
    ///     (
    ///         Message::assistant("Reading.").with_tool_calls(vec![call]),
    ///         vec![Message::tool(format!("c{i}"), log)],
    ///     )
    /// };
    /// let (reply, results) = step(0);
    /// compactor.push_step(&mut state, reply, results);
    /// assert_eq!(compactor.token_gain(&mut state, &[]), 0);
    /// // A second: the first (half the raw buffer) would leave, less its summary.
    /// let (reply, results) = step(1);
    /// compactor.push_step(&mut state, reply, results);
    /// let gain = compactor.token_gain(&mut state, &[]);
    /// assert!(gain > 0 && gain < compactor.tokens(&mut state, &[]).raw / 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn token_gain(&self, state: &mut ContextState, tools: &[ToolSpec]) -> usize {
        let fixed = self.fixed_of(state, tools);
        self.gain_given(state, tools, fixed)
    }

    /// [`token_gain`](Self::token_gain) with the fixed part already counted.
    fn gain_given(&self, state: &mut ContextState, tools: &[ToolSpec], fixed: usize) -> usize {
        let cut = self.cut_for(state, Trigger::Tokens, tools).unwrap_or(0);
        let leaving: usize = state.ledger.raw.iter().take(cut).sum();
        let summary = self
            .config
            .summary_budgets(self.prompt_budget(), fixed)
            .milestone_for(&self.config, leaving)
            .min(leaving);
        leaving - summary
    }

    /// The tokens of the prompt's fixed part: system prompt, goal, tool specs and the
    /// reply's priming, which every prompt holds and no compaction shrinks.
    fn fixed_of(&self, state: &mut ContextState, tools: &[ToolSpec]) -> usize {
        let t = self.tokens(state, tools);
        t.total.saturating_sub(t.epoch + t.milestones + t.raw)
    }

    /// The summary budgets for this context: the configured ones, scaled down on a
    /// window whose fixed part (system prompt, goal, tool specs) leaves little room
    /// ([`CompactionConfig::summary_budgets`]).
    pub fn summary_budgets(&self, state: &mut ContextState, tools: &[ToolSpec]) -> SummaryBudgets {
        let fixed = self.fixed_of(state, tools);
        self.config.summary_budgets(self.prompt_budget(), fixed)
    }

    /// What a step-triggered milestone now would cost and save (the cost model of
    /// [`StepTrigger::WhenItPays`]; with [`StepTrigger::Always`] the payback horizon is
    /// `every_steps`).
    pub fn step_estimate(&self, state: &mut ContextState, tools: &[ToolSpec]) -> StepEstimate {
        let payback_steps = match self.config.step_trigger {
            StepTrigger::WhenItPays { payback_steps } => payback_steps,
            StepTrigger::Always => self
                .config
                .every_steps
                .map_or(1, |n| u32::try_from(n).unwrap_or(u32::MAX)),
        };
        let cut = self.cut_for(state, Trigger::Steps, tools).unwrap_or(0);
        let leaving: usize = state.ledger.raw.iter().take(cut).sum();
        let tail = state.ledger.raw_total.saturating_sub(leaving);
        let summary = self
            .summary_budgets(state, tools)
            .milestone_for(&self.config, leaving)
            .min(leaving);
        let p = self.config.cached_input_price.clamp(0.0, 1.0);
        let call = self
            .last_call
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map_or(0.0, |(input, cached, output)| {
                let cached = cached.min(input);
                (input - cached) as f64
                    + p * cached as f64
                    + self.config.output_price * output as f64
            });
        StepEstimate::priced((leaving, tail, summary), p, call, payback_steps)
    }

    /// Checks and compacts until no trigger fires (at most a few rounds). Call it after
    /// every step. Returns the events of this call.
    ///
    /// A compaction that fails (the summarizer's model cannot be reached, the archive
    /// cannot be written) returns its error: the context is unchanged, the failed event
    /// is recorded in [`ContextState::events`] and counted in
    /// [`ContextState::failures_in_a_row`], and the next call tries again (with the
    /// extractive summary after
    /// [`fallback_after_failures`](CompactionConfig::fallback_after_failures) failures).
    /// A loop can log it and go on, as keel-agent does until too many fail in a row.
    /// At the step ceiling ([`CompactionConfig::max_steps`], 500 model calls by
    /// default) it returns [`CompactionError::StepCeiling`] every time: stop the loop,
    /// or raise the ceiling with [`CompactionConfig::with_max_steps`].
    ///
    /// A compaction with nothing
    /// to move, or whose result would be no smaller than what it replaces, changes
    /// nothing and records no event (it is logged), so the prompt can stay over the
    /// budget: when the goal, system prompt and tool specs alone exceed it, or the raw
    /// buffer holds nothing a milestone can replace. Compare
    /// [`Compactor::tokens`] with the profile's input budget to tell.
    pub async fn after_step(
        &self,
        state: &mut ContextState,
        tools: &[ToolSpec],
    ) -> Result<Vec<CompactionEvent>, CompactionError> {
        let mut events = Vec::new();
        for _ in 0..4 {
            let Some(trigger) = self.check(state, tools) else {
                break;
            };
            if trigger == Trigger::StepCeiling {
                return Err(CompactionError::StepCeiling {
                    steps: state.step,
                    max: self.config.max_steps,
                });
            }
            match self.compact(state, trigger, tools).await {
                Ok(e) => events.push(e),
                Err(CompactionError::NothingToCompact) if trigger == Trigger::Tokens => {
                    // Over the threshold with no step the raw buffer can give up: the
                    // prompt keeps growing until the provider refuses it.
                    tracing::warn!(
                        step = state.step,
                        raw_messages = state.raw.len(),
                        "over the compaction threshold, but no older step can be compacted"
                    );
                    break;
                }
                Err(CompactionError::NothingToCompact | CompactionError::NotSmaller { .. }) => {
                    break;
                }
                Err(e) => return Err(e),
            }
            if matches!(trigger, Trigger::Force) {
                break;
            }
        }
        Ok(events)
    }

    /// Compacts for `trigger`: masks old observations, or summarizes the raw buffer
    /// into a milestone (and folds milestones into an epoch). On failure the context is
    /// unchanged: the failed event is recorded and
    /// [`ContextState::failures_in_a_row`] counts it.
    ///
    /// The newest step always stays, but it is made to fit: for
    /// [`Trigger::Overflow`], or when the prompt is still over the budget, the newest
    /// step's largest tool results (of any tool, `read_file` included) are stored
    /// whole in the offload store and left as short stubs (path, size, three head and
    /// three tail lines), largest first, until the prompt is within the budget (for a
    /// provider's overflow of a prompt already within it, three quarters of the
    /// prompt); if stubs are still too many, each shrinks to where its result is and
    /// how to read it, and then the reply's own long string arguments (a whole file
    /// given to a tool, of any tool) are stored and left as pointers, as
    /// [`TruncateArguments`] leaves old ones. Done alone, that is an [`EventKind::Fit`] event. If the prompt
    /// is still over the budget, the milestones are folded into the epoch summary
    /// before they are due (an [`EventKind::Epoch`] event).
    pub async fn compact(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Result<CompactionEvent, CompactionError> {
        let started = Instant::now();
        let before = self.tokens(state, tools).total;
        let mut result = match self.config.strategy {
            Strategy::Hierarchical => self.milestone(state, trigger, tools).await,
            Strategy::Masking { .. } | Strategy::Hybrid { .. } => {
                self.relieve(state, trigger, tools).await
            }
        };
        let budget = self.prompt_budget();
        if (trigger == Trigger::Overflow || self.tokens(state, tools).total > budget)
            && matches!(
                result,
                Ok(_) | Err(CompactionError::NothingToCompact | CompactionError::NotSmaller { .. })
            )
        {
            // Over the budget: down to it. Under it, the provider still refused (its
            // window is smaller than the profile's): down by a quarter.
            let target = if trigger != Trigger::Overflow || before > budget {
                budget
            } else {
                before - before / 4
            };
            match self.fit_newest(state, tools, target).await {
                Ok(0) => {}
                Ok(_) if result.is_ok() => {}
                Ok(_) => result = Ok(Done::fit()),
                Err(e) => {
                    tracing::warn!(error = %e, "cutting the newest step's results to fit failed");
                }
            }
            // Still over the budget, with milestones: they go into the epoch summary
            // before they are due (a failed fold keeps them, and what was done
            // stands). Not for a provider's overflow of a prompt within the budget:
            // there the target is a guess, and the next overflow compacts again.
            if self.tokens(state, tools).total > budget && !state.milestones.is_empty() {
                let fall_back = self.falls_back(state, true);
                match self.epoch(state, fall_back, tools).await {
                    Ok((usage, fell_back)) => {
                        let mut done = result.unwrap_or_else(|_| Done::fit());
                        done.kind = EventKind::Epoch;
                        done.usage = add_usage(done.usage, usage);
                        done.fallback |= fell_back;
                        result = Ok(done);
                    }
                    Err(e) => tracing::warn!(error = %e, "folding milestones early to fit failed"),
                }
            }
        }
        let kind = match &result {
            Ok(d) => d.kind,
            Err(_) => EventKind::Milestone,
        };
        let after = self.tokens(state, tools).total;
        let usage = result.as_ref().map_or((0, 0, 0), |d| d.usage);
        let event = CompactionEvent {
            step: state.step,
            trigger,
            kind,
            tokens_before: before,
            tokens_after: after,
            messages_archived: result.as_ref().map_or(0, |d| d.archived),
            prompt_version: result
                .as_ref()
                .map(|d| d.prompt_version.clone())
                .unwrap_or_default(),
            summarizer_model: result.as_ref().map(|d| d.model.clone()).unwrap_or_default(),
            fallback: result.as_ref().is_ok_and(|d| d.fallback),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            error: result.as_ref().err().map(ToString::to_string),
            summary_input_tokens: usage.0,
            summary_cached_tokens: usage.1,
            summary_output_tokens: usage.2,
            budget: self.prompt_budget(),
        };
        match &result {
            // Nothing happened: no event (a result that was not smaller is logged).
            Err(CompactionError::NothingToCompact) => {}
            Err(e @ CompactionError::NotSmaller { .. }) => {
                tracing::info!(step = state.step, error = %e, "compaction not applied");
            }
            _ => {
                event.emit();
                state.record(event.clone());
            }
        }
        count_failure(state, &result.as_ref().map(|d| d.fallback));
        result.map(|_| event)
    }

    /// Calls `model` with the assembled prompt. If the provider answers that the
    /// context is too long, compacts at once ([`Trigger::Overflow`]) and retries, up to
    /// twice. The reply is not added to the state: push it with
    /// [`Compactor::push_step`] once its tool calls have run.
    pub async fn call(
        &self,
        model: &dyn ChatModel,
        state: &mut ContextState,
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, CallError> {
        let reserved = self.profile.reserved_output();
        if let Some(cap) = options.max_tokens.map(|n| n as usize)
            && cap > reserved
        {
            return Err(CallError::ReplyCapTooLarge {
                max_tokens: cap,
                reserved,
                window: self.profile.context_window,
            });
        }
        let mut retries = 0;
        loop {
            let prompt = self.assemble(state);
            match model.chat(&prompt, tools, options).await {
                Err(e) if e.is_context_overflow() && retries < 2 => {
                    retries += 1;
                    tracing::warn!(error = %e, "provider reports context overflow; compacting");
                    match self.compact(state, Trigger::Overflow, tools).await {
                        Ok(_) => {}
                        // Nothing could be compacted: the overflow is the error, and
                        // what a caller matches on (`ModelError::is_context_overflow`).
                        Err(
                            CompactionError::NothingToCompact | CompactionError::NotSmaller { .. },
                        ) => {
                            return Err(CallError::Model(e));
                        }
                        Err(c) => return Err(CallError::Compaction(c)),
                    }
                }
                Err(e) => return Err(CallError::Model(e)),
                Ok(r) => return Ok(r),
            }
        }
    }

    /// When the prompt is still over `target` tokens after compacting (for an
    /// overflow, or over the budget), the newest step, which compaction never moves
    /// (the model must see what it just asked for), is made to fit. Its largest tool
    /// results, those of every tool (`read_file` included), are stored whole in the
    /// offload store as [`EvictLargeResults`] stores them and left as stubs of three
    /// head and three tail lines, largest first, until the estimate fits. A short
    /// result of long lines, which such a stub would not make smaller, gets a stub
    /// without preview lines; a `read_file` or `grep` of a stored result is not stored
    /// again but cut where it stands, with a note to read less at a time. If the
    /// prompt is still over, each stub of the step shrinks to its first line and how
    /// to read it ([`EvictLargeResults::brief`]); if still, the reply's long arguments
    /// are stored and left as pointers. Every call keeps its answer, and each result
    /// and argument can be read back. Returns how many messages changed.
    async fn fit_newest(
        &self,
        state: &mut ContextState,
        tools: &[ToolSpec],
        target: usize,
    ) -> Result<usize, OffloadError> {
        /// What a stub of three and three lines of at most 160 characters costs, about
        /// (less for a short result: one whose stub would not be smaller stays).
        const STUB_TOKENS: usize = 150;
        /// Results this small are not worth a stub's header.
        const SMALL: usize = 80;
        let total = self.tokens(state, tools).total;
        if total <= target {
            return Ok(0);
        }
        let newest = state
            .raw
            .iter()
            .rposition(|m| m.role == Role::Assistant)
            .unwrap_or(0);
        // The thread's own policy (its directory), evicting every tool's results, with
        // small stubs and reads sized to the budget.
        let sized = EvictLargeResults::for_budget(self.prompt_budget());
        let mut policy = self.evict.clone().unwrap_or_else(|| sized.clone());
        policy.threshold_tokens = 0;
        policy.exempt_tools.clear();
        policy.head_lines = 3;
        policy.tail_lines = 3;
        policy.max_line_chars = policy.max_line_chars.min(160);
        policy.preview_chars = policy.preview_chars.min(sized.preview_chars);
        policy.read_lines = policy.read_lines.min(sized.read_lines);
        let mut candidates: Vec<(usize, usize)> = (newest..state.raw.len())
            .filter(|&i| {
                let m = &state.raw[i];
                is_observation(m)
                    && !m.metadata.contains_key(MASKED_METADATA_KEY)
                    && !m.metadata.contains_key(CUT_METADATA_KEY)
                    && policy.brief(m).is_none()
            })
            .map(|i| (i, state.ledger.raw.get(i).copied().unwrap_or_default()))
            .filter(|&(_, tokens)| tokens > SMALL)
            .collect();
        candidates.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut excess = total - target;
        let mut chosen = Vec::new();
        for (i, tokens) in candidates {
            if excess == 0 {
                break;
            }
            chosen.push(i);
            excess = excess.saturating_sub(tokens.saturating_sub(STUB_TOKENS));
        }
        chosen.sort_unstable();
        let mut changed = 0;
        // A read of what the store already holds (the model following a stub) is cut
        // where it stands: stored again, its stub would point to a copy of the read,
        // and reading that would nest line numbers without ever showing more.
        let (rereads, chosen): (Vec<usize>, Vec<usize>) = chosen
            .into_iter()
            .partition(|&i| reads_the_store(&state.raw, newest, i, &policy));
        for i in rereads {
            let total = self.tokens(state, tools).total;
            if total <= target {
                break;
            }
            let original = state.raw[i].clone();
            let tokens = self.ledger_tokens(state, i);
            let rest = total - tokens;
            // Cut to what the prompt has room for, checked by counting: the note and
            // the text's own density make the first guess a little off.
            let mut keep = (target.saturating_sub(rest)).max(tokens / 8);
            while let Some(m) = cut_reread(&original, tokens, keep) {
                let fits = rest + self.counter.count_message(&m) <= target;
                if fits || keep <= tokens / 8 {
                    changed += 1;
                    self.replace_raw(state, i, m);
                    break;
                }
                keep = (keep * 4 / 5).max(tokens / 8);
            }
        }
        // Stubs with a preview first; a result whose stub with a preview would not be
        // smaller (a short result of long lines) then gets one without.
        let mut left = chosen;
        for preview in [3, 0] {
            if left.is_empty() || self.tokens(state, tools).total <= target {
                break;
            }
            let mut stubs = policy.clone();
            stubs.head_lines = preview;
            stubs.tail_lines = preview;
            let (n, unchanged) = self.evict_in_place(state, newest, left, stubs).await?;
            changed += n;
            left = unchanged;
        }
        if self.tokens(state, tools).total > target {
            for i in newest..state.raw.len() {
                if let Some(brief) = policy.brief(&state.raw[i]) {
                    let mut m = state.raw[i].clone();
                    if m.text() != brief {
                        m.content = brief.into();
                        changed += 1;
                        self.replace_raw(state, i, m);
                    }
                }
            }
        }
        // Still over: the reply's own long arguments (a whole file given to a tool)
        // are stored and left as pointers, as old ones are. The calls have run.
        if self.tokens(state, tools).total > target {
            changed += self.truncate_newest_arguments(state, newest).await?;
        }
        Ok(changed)
    }

    /// Stores the long string arguments of every call of the reply at `newest` (of any
    /// tool, however recent) and leaves pointers, off the runtime. Returns 1 when the
    /// reply changed.
    async fn truncate_newest_arguments(
        &self,
        state: &mut ContextState,
        newest: usize,
    ) -> Result<usize, OffloadError> {
        let Some(reply) = state
            .raw
            .get(newest)
            .filter(|m| m.role == Role::Assistant && !m.tool_calls.is_empty())
            .cloned()
        else {
            return Ok(0);
        };
        let mut policy = self.truncate.clone().unwrap_or_default();
        policy.trigger_fraction = 0.0;
        policy.keep_recent = 0;
        policy.tools = reply.tool_calls.iter().map(|c| c.name.clone()).collect();
        let this = self.clone();
        let lineage = state.lineage.clone();
        let truncate = move || {
            let view = this.view(&lineage);
            let env = PolicyEnv::new(&view, &this.thread, &*this.counter);
            let outcome = policy.apply_with_usage(vec![reply], &env, 1, 1);
            (outcome, view.lineage())
        };
        let (outcome, lineage) =
            off_runtime(&self.thread, "store the newest reply's arguments", truncate).await?;
        if let Some(f) = outcome.failures.into_iter().next() {
            return Err(f.error);
        }
        if outcome.stored.is_empty() {
            return Ok(0);
        }
        state.lineage = lineage;
        match outcome.messages.into_iter().next() {
            Some(m) => {
                self.replace_raw(state, newest, m);
                Ok(1)
            }
            None => Ok(0),
        }
    }

    /// Runs `policy` over the raw messages at `indices` (results of the step whose
    /// reply is at `newest`) off the runtime, and puts back those it changed. Returns
    /// how many changed, and the indices it left as they were.
    async fn evict_in_place(
        &self,
        state: &mut ContextState,
        newest: usize,
        indices: Vec<usize>,
        policy: EvictLargeResults,
    ) -> Result<(usize, Vec<usize>), OffloadError> {
        let reply = match state.raw.get(newest) {
            Some(m) if m.role == Role::Assistant => m.clone(),
            _ => Message::assistant(""),
        };
        let results: Vec<Message> = indices.iter().map(|&i| state.raw[i].clone()).collect();
        let this = self.clone();
        let mut lineage = state.lineage.clone();
        let evict = move || {
            let out = this.evict(&policy, &reply, results, &mut lineage);
            (out, lineage)
        };
        let (out, lineage) =
            off_runtime(&self.thread, "store the newest step's results", evict).await?;
        state.lineage = lineage;
        let (mut changed, mut unchanged) = (0, Vec::new());
        for (i, m) in indices.into_iter().zip(out) {
            if m == state.raw[i] {
                unchanged.push(i);
            } else {
                changed += 1;
                self.replace_raw(state, i, m);
            }
        }
        Ok((changed, unchanged))
    }

    /// The ledger's count of raw message `i`.
    fn ledger_tokens(&self, state: &ContextState, i: usize) -> usize {
        state.ledger.raw.get(i).copied().unwrap_or_default()
    }

    /// Puts `m` at `i` of the raw buffer, counting it into the ledger.
    fn replace_raw(&self, state: &mut ContextState, i: usize, m: Message) {
        let n = self.counter.count_message(&m);
        if let Some(slot) = state.ledger.raw.get_mut(i) {
            state.ledger.raw_total = state.ledger.raw_total - *slot + n;
            *slot = n;
        }
        state.raw[i] = m;
    }

    /// Masking strategies under pressure: mask old tool results first (for
    /// [`Strategy::Masking`], all but the last turn's when the boundary has not moved);
    /// summarize only if that is not enough (for [`Strategy::Hybrid`], back under the
    /// threshold; for [`Strategy::Masking`], under the budget).
    async fn relieve(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Result<Done, CompactionError> {
        let hybrid = matches!(self.config.strategy, Strategy::Hybrid { .. });
        let mut masked = self.mask(state, None).await?;
        if !hybrid && masked.archived == 0 {
            masked = self.mask(state, Some(1)).await?;
        }
        let tokens = self.tokens(state, tools).total;
        let enough = if hybrid {
            tokens < self.threshold()
        } else {
            tokens < self.budget()
        };
        if masked.archived > 0 && enough {
            return Ok(masked);
        }
        if !hybrid && enough && trigger != Trigger::Overflow && trigger != Trigger::Force {
            return Err(CompactionError::NothingToCompact);
        }
        match self.milestone(state, trigger, tools).await {
            Ok(mut done) => {
                done.archived += masked.archived;
                Ok(done)
            }
            // The masking happened (its originals are archived): that is what this
            // compaction did; the milestone is tried again at the next check.
            Err(e) if masked.archived > 0 => {
                tracing::warn!(error = %e, "milestone after masking failed; masking kept");
                Ok(masked)
            }
            Err(e) => Err(e),
        }
    }

    /// Where the masking boundary should be: turns whose results are masked.
    fn mask_boundary(&self, state: &ContextState, keep: usize, block: usize) -> u64 {
        let eligible = state.step.saturating_sub(keep as u64);
        eligible - eligible % block as u64
    }

    /// The raw messages masking would replace (tool results of turns up to the
    /// boundary, or with `keep_override` all but the last `keep_override` turns, whose
    /// placeholder is smaller), each with its placeholder's tokens, and the boundary.
    /// `None` when the boundary has not moved.
    fn mask_targets(
        &self,
        state: &ContextState,
        keep_override: Option<usize>,
    ) -> Option<(u64, Vec<(usize, usize)>)> {
        let (keep, block) = self.config.strategy.mask_params().unwrap_or((1, 1));
        let boundary = match keep_override {
            Some(k) => state.step.saturating_sub(k as u64),
            None => self.mask_boundary(state, keep, block),
        };
        if boundary <= state.masked_turns && keep_override.is_none() {
            return None;
        }
        // The turn of each raw message: the raw buffer ends at turn `state.step`.
        let assistants = state
            .raw
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count() as u64;
        let mut turn = state.step.saturating_sub(assistants);
        let mut targets = Vec::new();
        for (i, m) in state.raw.iter().enumerate() {
            if m.role == Role::Assistant {
                turn += 1;
            }
            if turn <= boundary
                && is_observation(m)
                && !m.metadata.contains_key(MASKED_METADATA_KEY)
            {
                targets.push(i);
            }
        }
        // A result is masked only when its placeholder is smaller (the seq is not
        // known before the append: counted with a long one).
        let targets = targets
            .into_iter()
            .map(|i| (i, self.placeholder_tokens(state, i)))
            .filter(|&(i, placeholder)| placeholder < self.raw_tokens(state, i))
            .collect();
        Some((boundary, targets))
    }

    /// The ledger's count of raw message `i`.
    fn raw_tokens(&self, state: &ContextState, i: usize) -> usize {
        state.ledger.raw.get(i).copied().unwrap_or_default()
    }

    /// The tokens of raw message `i` masked (with the longest archive seq).
    fn placeholder_tokens(&self, state: &ContextState, i: usize) -> usize {
        // Built beside the message, not from a clone of it: a result can be large.
        let m = &state.raw[i];
        let placeholder = mask_placeholder(
            self.raw_tokens(state, i),
            m.tool_call_id.as_deref(),
            u64::MAX,
        );
        let mut stub = Message::new(m.role, placeholder);
        stub.id.clone_from(&m.id);
        stub.tool_call_id.clone_from(&m.tool_call_id);
        stub.name.clone_from(&m.name);
        stub.tool_calls.clone_from(&m.tool_calls);
        stub.metadata.clone_from(&m.metadata);
        self.counter.count_message(&stub)
    }

    /// Masks tool results of turns up to the boundary (or, with `keep_override`, all
    /// but the last `keep_override` turns). Returns how many messages were masked.
    async fn mask(
        &self,
        state: &mut ContextState,
        keep_override: Option<usize>,
    ) -> Result<Done, CompactionError> {
        let Some((boundary, targets)) = self.mask_targets(state, keep_override) else {
            return Ok(Done::masked(0));
        };
        if targets.is_empty() {
            state.masked_turns = state.masked_turns.max(boundary);
            return Ok(Done::masked(0));
        }
        let originals: Vec<Message> = targets.iter().map(|&(i, _)| state.raw[i].clone()).collect();
        let appended = self.archive_in(state, originals).await?;
        for (k, &(i, _)) in targets.iter().enumerate() {
            let seq = appended.seqs.get(k).copied().unwrap_or_default();
            let tokens = state.ledger.raw.get(i).copied().unwrap_or_default();
            let m = &mut state.raw[i];
            m.content = mask_placeholder(tokens, m.tool_call_id.as_deref(), seq).into();
            m.metadata
                .insert(MASKED_METADATA_KEY.to_owned(), seq.into());
            if let Some(slot) = state.ledger.raw.get_mut(i) {
                let n = self.counter.count_message(m);
                state.ledger.raw_total = state.ledger.raw_total - *slot + n;
                *slot = n;
            }
        }
        state.masked_turns = state.masked_turns.max(boundary);
        Ok(Done::masked(appended.written))
    }

    /// Whether compacting for `trigger` would move anything out of the raw buffer (a
    /// cheap check on the token ledger; [`Compactor::compact`] would otherwise fail
    /// with [`CompactionError::NothingToCompact`]). A runtime asks it before it
    /// schedules a compaction step.
    pub fn would_compact(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> bool {
        if self.config.strategy != Strategy::Hierarchical {
            return true;
        }
        self.cut_for(state, trigger, tools)
            .is_some_and(|cut| cut > 0)
    }

    /// Where a milestone for `trigger` would cut the raw buffer.
    fn cut_for(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Option<usize> {
        let keep = match trigger {
            Trigger::Overflow => self.config.keep_recent(self.prompt_budget()) / 4,
            _ => self.config.keep_recent(self.prompt_budget()),
        };
        let overflowing =
            trigger == Trigger::Overflow || self.tokens(state, tools).total >= self.budget();
        let mut tail = 0usize;
        let mut target = state.raw.len();
        while target > 0 {
            let n = state
                .ledger
                .raw
                .get(target - 1)
                .copied()
                .unwrap_or_default();
            if tail + n > keep {
                break;
            }
            tail += n;
            target -= 1;
        }
        // The newest step (the last model reply and what followed it) always stays, so
        // the model never acts without the result it just asked for, however large it
        // is: a result too large for the window is the eviction policy's to offload.
        let newest = state
            .raw
            .iter()
            .rposition(|m| m.role == Role::Assistant)
            .unwrap_or(state.raw.len());
        // When the tail would keep everything, everything older than the newest step
        // goes if the prompt is over the budget, or if the step trigger was asked to
        // fire every N steps unconditionally (a milestone at step N, not later).
        let every_n = trigger == Trigger::Steps && self.config.step_trigger == StepTrigger::Always;
        let target = if target == 0 && (overflowing || every_n) {
            newest
        } else {
            target.min(newest)
        };
        safe_cut_at_or_before(&state.raw, target)
    }

    /// Summarizes the older part of the raw buffer into a milestone, archives it and
    /// flushes it, then folds milestones into an epoch when there are enough. The state
    /// changes only once everything that can fail has succeeded (invariant 4), and not
    /// at all when the milestone would not be smaller than its span.
    async fn milestone(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Result<Done, CompactionError> {
        // Truncating old arguments rewrites the raw buffer: undone if the milestone is
        // not made (invariant 4: a failed compaction changes nothing).
        let before = self.truncate_arguments(state, tools);
        let result = self.milestone_after_truncation(state, trigger, tools).await;
        if result.is_err()
            && let Some((raw, ledger, lineage)) = before
        {
            state.raw = raw;
            state.ledger = ledger;
            state.lineage = lineage;
        }
        result
    }

    async fn milestone_after_truncation(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Result<Done, CompactionError> {
        // Keep a recent tail of about `keep_recent_tokens` (a quarter of it after a
        // provider's overflow: the window is smaller than the profile says), cut where
        // no tool call is separated from its results.
        let overflowing =
            trigger == Trigger::Overflow || self.tokens(state, tools).total >= self.budget();
        let fall_back = self.falls_back(state, overflowing);
        let cut = self
            .cut_for(state, trigger, tools)
            .ok_or(CompactionError::NothingToCompact)?;
        let leaving_tokens: usize = state.ledger.raw.iter().take(cut).sum();
        let budget = self
            .summary_budgets(state, tools)
            .milestone_for(&self.config, leaving_tokens);
        let leaving = &state.raw[..cut];

        // What the agent's prompt had before the span: a prefix-reusing summarizer
        // sends it first.
        let prefix: Vec<Message> = if self.prefix_summarizer.is_some() {
            state
                .system
                .iter()
                .chain(std::iter::once(state.goal.message()))
                .chain(state.layers().map(|l| &l.message))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        // The layers stay in the prompt: what they say need not be said again.
        let known = texts(state.layers());
        let summary = self
            .summarize(
                SummaryRequest::milestone(leaving, budget).known(&known),
                fall_back,
                (&prefix, tools),
            )
            .await?;
        let (first_step, last_step) = steps_of(state, cut);
        let number = state.milestones_made + 1;
        let layer = self.layer(
            LayerLevel::Milestone,
            format!(
                "[Milestone {number}: {}]",
                steps_label(first_step, last_step)
            ),
            (summary.0, summary.1.clone()),
            first_step,
            last_step,
            format!("keel-milestone-{number}"),
        );
        if layer.tokens >= leaving_tokens {
            return Err(CompactionError::NotSmaller {
                before: leaving_tokens,
                after: layer.tokens,
            });
        }

        // Invariant 2: archive before anything leaves. Masked stubs are not archived:
        // their originals already are.
        let to_archive: Vec<Message> = leaving
            .iter()
            .filter(|m| !m.metadata.contains_key(MASKED_METADATA_KEY))
            .cloned()
            .collect();
        let appended = self.archive_in(state, to_archive).await?;

        // From here nothing can fail: flush.
        state.raw.drain(..cut);
        let removed: usize = state
            .ledger
            .raw
            .drain(..cut.min(state.ledger.raw.len()))
            .sum();
        state.ledger.raw_total -= removed;
        state.milestones.push(layer);
        state.milestones_made = number;
        state.step_at_compaction = state.step;
        let mut done = Done {
            kind: EventKind::Milestone,
            archived: appended.written,
            prompt_version: summary.1.prompt_version.clone(),
            model: summary.1.model.clone(),
            fallback: summary.2,
            usage: usage_of(&summary.1),
        };

        if self.config.epoch_inline && self.epoch_due(state) {
            // A failed epoch keeps the milestones; it is retried at the next milestone.
            match self.epoch(state, fall_back, tools).await {
                Ok((usage, fell_back)) => {
                    done.kind = EventKind::Epoch;
                    done.usage = add_usage(done.usage, usage);
                    done.fallback |= fell_back;
                }
                Err(e) => tracing::warn!(error = %e, "epoch summary failed; milestones kept"),
            }
        }
        Ok(done)
    }

    /// Whether there are enough milestones to fold into an epoch summary.
    pub fn epoch_due(&self, state: &ContextState) -> bool {
        state.milestones.len() >= self.config.epoch_every.max(1)
    }

    /// Folds the milestones (and the previous epoch summary) into a new epoch summary,
    /// for runtimes that run epochs as their own step
    /// ([`CompactionConfig::epoch_inline`] off). On failure the state is unchanged
    /// except for the failed event it records.
    pub async fn fold_epoch(
        &self,
        state: &mut ContextState,
        trigger: Trigger,
        tools: &[ToolSpec],
    ) -> Result<CompactionEvent, CompactionError> {
        if state.milestones.is_empty() {
            return Err(CompactionError::NothingToCompact);
        }
        let started = Instant::now();
        let before = self.tokens(state, tools).total;
        let fall_back = self.falls_back(
            state,
            trigger == Trigger::Overflow || before >= self.budget(),
        );
        let result = self.epoch(state, fall_back, tools).await;
        let after = self.tokens(state, tools).total;
        let (usage, fell_back) = result.as_ref().map_or(((0, 0, 0), false), |u| *u);
        let newest = state.epochs.last().or(state.epoch.as_ref());
        let (prompt_version, model) = match (&result, newest) {
            (Ok(_), Some(l)) => (l.prompt_version.clone(), l.model.clone()),
            _ => (String::new(), String::new()),
        };
        let event = CompactionEvent {
            step: state.step,
            trigger,
            kind: EventKind::Epoch,
            tokens_before: before,
            tokens_after: after,
            messages_archived: 0,
            prompt_version,
            summarizer_model: model,
            fallback: fell_back,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            error: result.as_ref().err().map(ToString::to_string),
            summary_input_tokens: usage.0,
            summary_cached_tokens: usage.1,
            summary_output_tokens: usage.2,
            budget: self.prompt_budget(),
        };
        if let Err(e @ CompactionError::NotSmaller { .. }) = &result {
            tracing::info!(step = state.step, error = %e, "epoch not applied");
        } else {
            event.emit();
            state.record(event.clone());
        }
        count_failure(state, &result.as_ref().map(|&(_, f)| f));
        result.map(|_| event)
    }

    /// Folds the milestones into an epoch summary and, where a middle tier then holds
    /// more than `keep_summaries`, its oldest `keep_summaries` into the tier above (the
    /// top one folds its previous summary in). All or nothing: on an error the state is
    /// unchanged; a fold of a higher tier that would not be smaller is left for later.
    /// Returns the summarizer's usage, and whether the fallback wrote a summary.
    async fn epoch(
        &self,
        state: &mut ContextState,
        fall_back: bool,
        tools: &[ToolSpec],
    ) -> Result<((u64, u64, u64), bool), CompactionError> {
        // The prompt before the layers being folded (system, goal and the summaries
        // above them), for a prefix-reusing summarizer.
        let fixed: Vec<Message> = if self.prefix_summarizer.is_some() {
            state
                .system
                .iter()
                .chain(std::iter::once(state.goal.message()))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let above_milestones: Vec<Message> = if self.prefix_summarizer.is_some() {
            fixed
                .iter()
                .cloned()
                .chain(
                    state
                        .epoch
                        .iter()
                        .chain(&state.epochs)
                        .map(|l| l.message.clone()),
                )
                .collect()
        } else {
            Vec::new()
        };
        let budgets = self.summary_budgets(state, tools);
        let depth = u8::try_from(self.config.summary_tiers.clamp(2, 16)).unwrap_or(3);
        let keep = self.config.keep_summaries.max(1);
        let mut top = state.epoch.clone();
        let mut kept = state.epochs.clone();
        let mut made = state.epochs_made;
        let usage;
        let mut fell_back;
        if depth == 2 {
            // Two tiers: one epoch summary that takes the previous one in.
            let (layer, u, f) = self
                .fold_layers(
                    (&state.milestones, top.as_ref()),
                    &texts(&kept),
                    2,
                    Some(made + 1),
                    fall_back,
                    (&fixed, tools),
                    budgets,
                )
                .await?;
            made += 1;
            usage = u;
            fell_back = f;
            top = Some(layer);
        } else {
            let known = texts(top.iter().chain(&kept));
            let (layer, u, f) = self
                .fold_layers(
                    (&state.milestones, None),
                    &known,
                    2,
                    Some(made + 1),
                    fall_back,
                    (&above_milestones, tools),
                    budgets,
                )
                .await?;
            made += 1;
            let mut total = u;
            fell_back = f;
            kept.push(layer);
            for tier in 2..depth {
                let of_tier: Vec<usize> = (0..kept.len())
                    .filter(|&i| kept[i].level.tier() == tier)
                    .collect();
                if of_tier.len() <= keep {
                    break;
                }
                let leaving: Vec<Layer> =
                    of_tier[..keep].iter().map(|&i| kept[i].clone()).collect();
                let upper = tier + 1;
                let previous = if upper == depth { top.as_ref() } else { None };
                // The layers that stay beside the new one.
                let known = texts(
                    top.iter().filter(|_| previous.is_none()).chain(
                        (0..kept.len())
                            .filter(|i| !of_tier[..keep].contains(i))
                            .map(|i| &kept[i]),
                    ),
                );
                let folded = self
                    .fold_layers(
                        (&leaving, previous),
                        &known,
                        upper,
                        None,
                        fall_back,
                        (&fixed, tools),
                        budgets,
                    )
                    .await;
                let (layer, u, f) = match folded {
                    Ok(f) => f,
                    Err(e @ CompactionError::NotSmaller { .. }) => {
                        tracing::info!(tier = upper, error = %e, "higher tier not folded yet");
                        break;
                    }
                    Err(e) => return Err(e),
                };
                total = add_usage(total, u);
                fell_back |= f;
                let first = of_tier[0];
                kept.drain(first..first + keep);
                if upper == depth {
                    top = Some(layer);
                } else {
                    // After the other layers of its tier, before the lower tiers.
                    let at = kept
                        .iter()
                        .position(|l| l.level.tier() < upper)
                        .unwrap_or(kept.len());
                    kept.insert(at, layer);
                }
            }
            usage = total;
        }
        state.epoch = top;
        state.epochs = kept;
        state.epochs_made = made;
        state.milestones.clear();
        Ok((usage, fell_back))
    }

    /// One summary of `inputs` (and `previous`, folded in) at `tier`, unless it would
    /// not be smaller than what it replaces. Epochs are numbered (`epochs_made`), higher
    /// tiers by the last step they cover.
    #[allow(clippy::too_many_arguments)]
    async fn fold_layers(
        &self,
        (inputs, previous): (&[Layer], Option<&Layer>),
        known: &[&str],
        tier: u8,
        number: Option<u64>,
        fall_back: bool,
        context: (&[Message], &[ToolSpec]),
        budgets: SummaryBudgets,
    ) -> Result<(Layer, (u64, u64, u64), bool), CompactionError> {
        let messages: Vec<Message> = inputs.iter().map(|l| l.message.clone()).collect();
        let budget = budgets.tier(tier);
        let mut request = SummaryRequest::epoch(&messages, budget).known(known);
        if let Some(p) = previous {
            request = request.previous(&p.text);
        }
        let (text, summary, fell_back) = self.summarize(request, fall_back, context).await?;
        let usage = usage_of(&summary);
        let replaced: usize =
            inputs.iter().map(|l| l.tokens).sum::<usize>() + previous.map_or(0, |l| l.tokens);
        let first = previous
            .into_iter()
            .chain(inputs)
            .map(|l| l.first_step)
            .min()
            .unwrap_or(1);
        let last = inputs
            .iter()
            .chain(previous)
            .map(|l| l.last_step)
            .max()
            .unwrap_or(first);
        let number = number.unwrap_or(last);
        let top = usize::from(tier) >= self.config.summary_tiers.max(2);
        let level = if tier == 2 {
            LayerLevel::Epoch
        } else {
            LayerLevel::Era(tier)
        };
        let (heading, id) = if top {
            (
                format!("[Progress summary: {}]", steps_label(first, last)),
                format!("keel-summary-{tier}-{number}"),
            )
        } else if tier == 2 {
            (
                format!("[Epoch {number}: {}]", steps_label(first, last)),
                format!("keel-epoch-{number}"),
            )
        } else {
            (
                format!("[Era: {}]", steps_label(first, last)),
                format!("keel-era-{tier}-{number}"),
            )
        };
        let layer = self.layer(level, heading, (text, summary), first, last, id);
        if layer.tokens >= replaced {
            return Err(CompactionError::NotSmaller {
                before: replaced,
                after: layer.tokens,
            });
        }
        Ok((layer, usage, fell_back))
    }

    fn layer(
        &self,
        level: LayerLevel,
        heading: String,
        (text, summary): (String, keel_summarize::Summary),
        first_step: u64,
        last_step: u64,
        id: String,
    ) -> Layer {
        let mut message = Message::user(format!("{heading}\n{text}")).with_id(id);
        let name = match level {
            LayerLevel::Milestone => "milestone",
            LayerLevel::Epoch => "epoch",
            LayerLevel::Era(_) => "era",
        };
        message
            .metadata
            .insert(LAYER_METADATA_KEY.to_owned(), name.into());
        let tokens = self.counter.count_message(&message);
        Layer {
            level,
            text,
            message,
            first_step,
            last_step,
            prompt_version: summary.prompt_version,
            model: summary.model,
            tokens,
        }
    }

    /// Runs the summarizer with retries; when it keeps failing and `fall_back` (see
    /// [`Self::falls_back`]), the fallback writes the summary. Returns (text, summary,
    /// fallback used).
    async fn summarize(
        &self,
        request: SummaryRequest<'_>,
        fall_back: bool,
        (prefix, tools): (&[Message], &[ToolSpec]),
    ) -> Result<(String, keel_summarize::Summary, bool), CompactionError> {
        let retry = &self.config.summary_retry;
        let attempts = retry.max_attempts.max(1);
        let mut last_error = None;
        for attempt in 1..=attempts {
            let result = match &self.prefix_summarizer {
                Some(p) => p.summarize(prefix, tools, &request).await,
                None => self.summarizer.summarize(&request).await,
            };
            match result {
                Ok(s) if !s.text.trim().is_empty() => {
                    self.remember_call(&s);
                    return Ok((s.text.clone(), s, false));
                }
                Ok(_) => last_error = Some(keel_summarize::SummarizeError::EmptyInput),
                Err(e) => {
                    // Only a failed model call can pass: the same request again gets
                    // the same rejection (an LLM summarizer at temperature 0 has
                    // already retried with the reason) or the same refusal.
                    let again = matches!(e, keel_summarize::SummarizeError::Model(_));
                    last_error = Some(e);
                    if !again {
                        break;
                    }
                }
            }
            if attempt < attempts {
                tokio::time::sleep(retry.delay(attempt - 1)).await;
            }
        }
        if fall_back {
            let s = self
                .fallback
                .summarize(&request)
                .await
                .map_err(CompactionError::Summarize)?;
            return Ok((s.text.clone(), s, true));
        }
        Err(CompactionError::Summarize(
            last_error.unwrap_or(keel_summarize::SummarizeError::EmptyInput),
        ))
    }

    /// Whether a summary that keeps failing is written by the fallback: when the
    /// context would overflow, or after
    /// [`CompactionConfig::fallback_after_failures`] failed compactions in a row.
    fn falls_back(&self, state: &ContextState, overflowing: bool) -> bool {
        overflowing
            || self
                .config
                .fallback_after_failures
                .is_some_and(|n| state.failures_in_a_row >= n)
    }

    /// Keeps the summarizer's reported usage for the cost model.
    fn remember_call(&self, summary: &keel_summarize::Summary) {
        let mut last = self
            .last_call
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *last = summary.usage.map(|u| {
            (
                u.prompt_tokens,
                u.cached_tokens.unwrap_or(0),
                u.completion_tokens,
            )
        });
    }

    /// Replaces long string arguments of old write/edit calls with pointers (stored
    /// once), when the context passes the policy's fraction of the window. Returns the
    /// raw buffer, ledger and lineage as they were when it changed something.
    fn truncate_arguments(
        &self,
        state: &mut ContextState,
        tools: &[ToolSpec],
    ) -> Option<(Vec<Message>, crate::state::Ledger, Lineage)> {
        let policy = self.truncate.as_ref()?;
        let used = self.tokens(state, tools).total;
        if !policy.triggered(used, self.budget()) {
            return None;
        }
        let view = self.view(&state.lineage);
        let env = PolicyEnv::new(&view, &self.thread, &*self.counter);
        let raw = state.raw.clone();
        let outcome = policy.apply_with_usage(raw, &env, used, self.budget());
        for f in &outcome.failures {
            tracing::warn!(error = %f.error, "truncating old arguments failed; message kept");
        }
        if outcome.stored.is_empty() {
            return None;
        }
        let before = (
            std::mem::replace(&mut state.raw, outcome.messages),
            state.ledger.clone(),
            std::mem::replace(&mut state.lineage, view.lineage()),
        );
        let changed: Vec<usize> = outcome.stored.iter().map(|s| s.index).collect();
        for i in changed {
            if let (Some(slot), Some(m)) = (state.ledger.raw.get_mut(i), state.raw.get(i)) {
                let n = self.counter.count_message(m);
                state.ledger.raw_total = state.ledger.raw_total - *slot + n;
                *slot = n;
            }
        }
        Some(before)
    }
}

/// The steps (model calls, counted from 1) the first `cut` raw messages belong to: a
/// message belongs to the step of the model reply before it; messages before the
/// run's first reply count as step 1.
fn steps_of(state: &ContextState, cut: usize) -> (u64, u64) {
    let assistants = state
        .raw
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .count() as u64;
    let mut turn = state.step.saturating_sub(assistants);
    let mut first = None;
    let mut last = turn;
    for m in state.raw.iter().take(cut) {
        if m.role == Role::Assistant {
            turn += 1;
        }
        first.get_or_insert(turn);
        last = turn;
    }
    let first = first.unwrap_or(turn).max(1);
    (first, last.max(first))
}

/// `steps 3–7`, or `step 3`.
fn steps_label(first: u64, last: u64) -> String {
    if first == last {
        format!("step {first}")
    } else {
        format!("steps {first}–{last}")
    }
}

/// Whether raw message `i` answers a `read_file` or `grep` call of the reply at
/// `newest` on a path under `policy`'s directory: a read of a result already stored.
fn reads_the_store(raw: &[Message], newest: usize, i: usize, policy: &EvictLargeResults) -> bool {
    let (Some(reply), Some(id)) = (raw.get(newest), raw[i].tool_call_id.as_deref()) else {
        return false;
    };
    let dir = policy.dir.as_str();
    reply.tool_calls.iter().any(|c| {
        c.id == id
            && (c.name == keel_offload::READ_FILE || c.name == keel_offload::GREP)
            && c.arguments
                .as_json()
                .and_then(|a| a.get("path"))
                .and_then(serde_json::Value::as_str)
                .is_some_and(|p| {
                    p.strip_prefix(dir)
                        .is_some_and(|r| r.is_empty() || r.starts_with('/'))
                })
    })
}

/// A read of a stored result, `tokens` long, cut to about `keep_tokens` of text and a
/// note saying so; `None` when that would cut nothing, or leave nothing.
fn cut_reread(m: &Message, tokens: usize, keep_tokens: usize) -> Option<Message> {
    let text = m.text();
    // The note takes about 50 tokens of what is kept.
    let keep_tokens = keep_tokens.saturating_sub(50);
    if keep_tokens == 0 || keep_tokens >= tokens {
        return None;
    }
    let keep_bytes = text.len() * keep_tokens / tokens;
    let cut = (0..=keep_bytes).rev().find(|&b| text.is_char_boundary(b))?;
    let mut out = m.clone();
    out.content = format!(
        "{}\n[This read was cut to fit the context: {} of its {} characters are shown. \
         What it read is stored whole: read fewer lines at a time (a smaller `limit`), \
         or grep it.]",
        &text[..cut],
        text[..cut].chars().count(),
        text.chars().count()
    )
    .into();
    out.metadata
        .insert(CUT_METADATA_KEY.to_owned(), serde_json::Value::Bool(true));
    Some(out)
}

/// The metadata key on a read of a stored result that was cut to fit the context.
const CUT_METADATA_KEY: &str = "keel.cut_to_fit";

/// The text a masked tool result is replaced by. It names the tool call (the model's
/// own id, which the archived record carries, so a grep of the archive finds it) and
/// the archive position, never the message's id: that is random when a reducer gave
/// it, and a random text would make identical runs count different tokens.
fn mask_placeholder(tokens: usize, call: Option<&str>, seq: u64) -> String {
    match call {
        Some(call) => format!("[masked: {tokens}-token result of call {call}, archive seq {seq}]"),
        None => format!("[masked: {tokens}-token result, archive seq {seq}]"),
    }
}

/// A tool result, or a user message flagged as an observation.
fn is_observation(m: &Message) -> bool {
    m.role == Role::Tool
        || (m.role == Role::User
            && m.metadata
                .get(OBSERVATION_METADATA_KEY)
                .is_some_and(|v| v.as_bool() == Some(true)))
}

struct Done {
    kind: EventKind,
    archived: usize,
    prompt_version: String,
    model: String,
    fallback: bool,
    /// The summarizer's usage: (prompt, cached, output) tokens.
    usage: (u64, u64, u64),
}

impl Done {
    fn fit() -> Self {
        Done {
            kind: EventKind::Fit,
            ..Done::masked(0)
        }
    }

    fn masked(archived: usize) -> Self {
        Done {
            kind: EventKind::Mask,
            archived,
            prompt_version: String::new(),
            model: String::new(),
            fallback: false,
            usage: (0, 0, 0),
        }
    }
}

fn usage_of(summary: &keel_summarize::Summary) -> (u64, u64, u64) {
    summary.usage.map_or((0, 0, 0), |u| {
        (
            u.prompt_tokens,
            u.cached_tokens.unwrap_or(0),
            u.completion_tokens,
        )
    })
}

fn add_usage(a: (u64, u64, u64), b: (u64, u64, u64)) -> (u64, u64, u64) {
    (a.0 + b.0, a.1 + b.1, a.2 + b.2)
}

/// Appends to the archive as `lineage` writes it, off the async runtime; returns the
/// lineage moved on past the records. An append writes to the store and, with the file
/// store's default, fsyncs: on a Tokio runtime it runs on the blocking pool so the
/// runtime's threads keep serving other tasks (a current-thread runtime included);
/// without one it runs inline.
async fn append_off_runtime(
    archive: &Arc<Archive>,
    thread: &ThreadId,
    mut lineage: Lineage,
    messages: Vec<Message>,
) -> Result<(Appended, Lineage), OffloadError> {
    let (archive, owned) = (Arc::clone(archive), thread.clone());
    off_runtime(thread, "append to the archive", move || {
        let appended = archive.append_in(&mut lineage, &owned, &messages)?;
        Ok((appended, lineage))
    })
    .await?
}

/// Runs `work` (the offload store's I/O) on Tokio's blocking pool, so the runtime's
/// threads keep serving other tasks (a current-thread runtime included); without a
/// runtime, here. A blocking task that did not finish is an I/O error of `op`.
async fn off_runtime<T: Send + 'static>(
    thread: &ThreadId,
    op: &'static str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, OffloadError> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(work());
    };
    handle
        .spawn_blocking(work)
        .await
        .map_err(|e| OffloadError::Io {
            op,
            key: thread.to_string(),
            source: std::io::Error::other(format!("the blocking task ended: {e}")),
        })
}

/// Keeps [`ContextState::failures_in_a_row`] after a compaction (`Ok(fell_back)` when it
/// happened): one the summarizer wrote resets it; one that failed, or that the fallback
/// wrote because the summarizer failed, adds one; one that had nothing to do (nothing
/// to compact, or a result no smaller) leaves it.
fn count_failure(state: &mut ContextState, result: &Result<bool, &CompactionError>) {
    match result {
        Ok(false) => state.failures_in_a_row = 0,
        Err(CompactionError::NothingToCompact | CompactionError::NotSmaller { .. }) => {}
        Ok(true) | Err(_) => state.failures_in_a_row = state.failures_in_a_row.saturating_add(1),
    }
}

/// The texts of `layers`.
fn texts<'l>(layers: impl IntoIterator<Item = &'l Layer>) -> Vec<&'l str> {
    layers.into_iter().map(|l| l.text.as_str()).collect()
}
