//! The replay driver and its report.

use std::fmt;
use std::sync::Arc;

use keel_message::{Message, Role};
use keel_offload::{Archive, EvictLargeResults, Key, MemoryStore, OffloadStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{Encoding, ModelProfile, TokenCounter};

use super::load::Trajectory;
use super::score::Scorer;
use crate::compactor::Compactor;
use crate::config::{CompactionConfig, Strategy};
use crate::error::CompactionError;
use crate::event::CompactionEvent;
use crate::goal::GoalAnchor;
use crate::state::{ContextState, OBSERVATION_METADATA_KEY};

/// Price of a prompt token served from the provider's cache, relative to an uncached
/// one, in [`Report::from_runs`] (a replay's own [`Report::from_config`] prices them at
/// its [`CompactionConfig::cached_input_price`], 0.1 by default too).
pub const CACHED_TOKEN_PRICE: f64 = 0.1;

/// Price of an output token relative to an uncached prompt token (GPT-4o's ratio), for
/// the summarizer's replies in the replay's cost.
pub const OUTPUT_TOKEN_PRICE: f64 = 4.0;

/// How to replay.
#[derive(Clone)]
#[non_exhaustive]
pub struct ReplayConfig {
    /// The model window to enforce (a profile override, as Deep Agents' evals do).
    pub window: usize,
    /// Tokens reserved for the reply (the profile's maximum output).
    pub reserve_output: usize,
    /// How tokens are counted.
    pub encoding: Encoding,
    /// The compaction settings under test.
    pub compaction: CompactionConfig,
    /// Tool results over this many tokens are offloaded on arrival (`None`: the
    /// default, the smaller of 20,000 and a quarter of the input budget).
    pub evict_threshold: Option<usize>,
    /// Needles planted per run (in the first tool results).
    pub needles: usize,
    /// Summarize with this model through the agent's cached prefix
    /// ([`crate::PrefixSummarizer`]) instead of the extractive summarizer; its calls are
    /// part of the reported cost.
    pub summary_model: Option<Arc<dyn keel_model::ChatModel>>,
    /// Keep every prompt keel assembled in [`RunReport::prompts`] (off by default: a
    /// long run's prompts take memory).
    pub record_prompts: bool,
}

impl fmt::Debug for ReplayConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayConfig")
            .field("window", &self.window)
            .field("reserve_output", &self.reserve_output)
            .field("encoding", &self.encoding)
            .field("compaction", &self.compaction)
            .field("evict_threshold", &self.evict_threshold)
            .field("needles", &self.needles)
            .field("record_prompts", &self.record_prompts)
            .field(
                "summary_model",
                &self.summary_model.as_ref().map(|m| m.model_name()),
            )
            .finish()
    }
}

impl ReplayConfig {
    /// A replay at `window` tokens with `strategy` and keel's defaults otherwise; a
    /// tenth of the window is reserved for the reply.
    pub fn new(window: usize, strategy: Strategy) -> Self {
        ReplayConfig {
            window,
            reserve_output: window / 10,
            encoding: Encoding::O200kBase,
            compaction: CompactionConfig::default().with_strategy(strategy),
            evict_threshold: None,
            needles: 2,
            summary_model: None,
            record_prompts: false,
        }
    }

    /// The prompt size at which this replay's token trigger fires
    /// ([`CompactionConfig::token_threshold`] at this window, less the reply's reserve).
    ///
    /// ```
    /// use keel_compaction::replay::ReplayConfig;
    /// use keel_compaction::Strategy;
    ///
    /// let config = ReplayConfig::new(10_000, Strategy::Hierarchical);
    /// // 0.85 of the 9,000 tokens left after a tenth is kept for the reply.
    /// assert_eq!(config.token_threshold(), 7_650);
    /// ```
    pub fn token_threshold(&self) -> usize {
        self.compaction
            .token_threshold(self.profile().input_budget())
    }

    /// The prompt budget: the window less the tokens reserved for the reply. A prompt
    /// over it leaves the reply less than its reserve (a provider given that maximum
    /// output refuses it).
    ///
    /// ```
    /// use keel_compaction::replay::ReplayConfig;
    /// use keel_compaction::Strategy;
    ///
    /// assert_eq!(ReplayConfig::new(10_000, Strategy::Hierarchical).input_budget(), 9_000);
    /// ```
    pub fn input_budget(&self) -> usize {
        self.profile().input_budget()
    }

    fn profile(&self) -> ModelProfile {
        ModelProfile::new(
            format!("replay-{}", self.window),
            self.window,
            self.reserve_output,
            self.encoding,
        )
    }
}

/// One model call of a replayed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnRecord {
    /// Prompt tokens with the full history.
    pub full_tokens: usize,
    /// Prompt tokens with the strategy under test.
    pub tokens: usize,
    /// Tokens of the longest run of leading messages shared with the previous prompt.
    pub shared_prefix: usize,
    /// The same for the full history: every message of the previous prompt.
    pub full_shared_prefix: usize,
    /// The previous prompt is a prefix of this one (a provider cache hits all of it).
    pub extends_previous: bool,
    /// The goal message is in the prompt byte for byte (as a user message).
    pub goal_intact: bool,
    /// Needed facts were checked on this turn: this prompt or an earlier one of the
    /// run lacked a user or tool message of the history (compared by role and text),
    /// so the context manager had dropped, summarized, masked or offloaded something
    /// the agent was told. Before that every needed fact is in the prompt by
    /// construction.
    pub checked: bool,
    /// Facts this turn needed ([`super::needed_facts`]); counted only on checked
    /// turns.
    pub needed: usize,
    /// Of those, present in the prompt keel assembled for this turn.
    pub needed_in_prompt: usize,
    /// Of those not in the prompt, found in the archive or the offload store (the
    /// agent could read them back).
    pub needed_in_archive: usize,
}

/// One needed fact of one turn, and where it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FactCheck {
    /// The turn (0-based model call) that passed it on.
    pub turn: usize,
    /// The identifier.
    pub fact: String,
    /// It was in the prompt of that turn.
    pub in_prompt: bool,
    /// It was not in the prompt but the archive or the offload store had it.
    pub in_archive: bool,
}

/// A fact planted in an early tool result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Needle {
    /// The planted text.
    pub text: String,
    /// It was compacted out of the prompt by the end of the run.
    pub left_context: bool,
    /// A search of the archive finds it.
    pub found_in_archive: bool,
}

/// The replay of one trajectory.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Dataset.
    pub dataset: String,
    /// Run id.
    pub id: String,
    /// One record per model call.
    pub turns: Vec<TurnRecord>,
    /// Compaction events.
    pub events: Vec<CompactionEvent>,
    /// Planted needles.
    pub needles: Vec<Needle>,
    /// Every needed fact checked ([`TurnRecord::checked`] turns), in turn order.
    pub facts: Vec<FactCheck>,
    /// The prompt of each model call, when [`ReplayConfig::record_prompts`] is set
    /// (else empty). [`super::score_prompts`] scores them as [`replay_trajectory`]
    /// did.
    pub prompts: Vec<Vec<Message>>,
}

impl RunReport {
    /// Share of needed facts present in the prompt (1.0 when none were needed).
    pub fn recall(&self) -> f64 {
        let needed = self.facts.len();
        let kept = self.facts.iter().filter(|f| f.in_prompt).count();
        share_or_one(kept, needed)
    }

    /// Share of needed facts in the prompt or retrievable from the archive.
    pub fn reachable(&self) -> f64 {
        let needed = self.facts.len();
        let found = self
            .facts
            .iter()
            .filter(|f| f.in_prompt || f.in_archive)
            .count();
        share_or_one(found, needed)
    }
}

fn share_or_one(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        1.0
    } else {
        part as f64 / whole as f64
    }
}

/// Replays one trajectory. `counter` should be a memoizing counter shared across runs.
pub async fn replay_trajectory(
    trajectory: &Trajectory,
    config: &ReplayConfig,
    counter: Arc<dyn TokenCounter>,
) -> Result<RunReport, CompactionError> {
    let mut messages = trajectory.messages.clone();
    let planted = plant_needles(&mut messages, config.needles);

    let system_at = messages.iter().position(|m| m.role == Role::System);
    let Some(goal_at) = super::load::goal_index(&messages) else {
        return Ok(RunReport {
            dataset: trajectory.dataset.clone(),
            id: trajectory.id.clone(),
            turns: Vec::new(),
            events: Vec::new(),
            needles: Vec::new(),
            facts: Vec::new(),
            prompts: Vec::new(),
        });
    };
    let goal = GoalAnchor::from_message(&messages[goal_at]);
    let mut state = ContextState::new(goal.clone());
    if let Some(s) = system_at {
        state = state.with_system(messages[s].clone());
    }
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let archive = Arc::new(Archive::new(Arc::clone(&store)));
    let thread = ThreadId::new(keel_offload::safe_component(&trajectory.id))
        .map_err(CompactionError::Archive)?;
    let summarizer = ExtractiveSummarizer::new().with_counter(Arc::clone(&counter));
    let compactor = Compactor::new(
        Arc::new(summarizer),
        archive.clone(),
        thread.clone(),
        Arc::clone(&counter),
        config.profile(),
    )
    // A recorded run already happened: its length is measured, not stopped at the
    // live agent's step ceiling (which would fail the replay of any run past it).
    .with_config(config.compaction.clone().with_max_steps(u64::MAX));
    let compactor = match &config.summary_model {
        Some(model) => compactor.with_prefix_summarizer(crate::PrefixSummarizer::new(
            Arc::clone(model),
            Arc::clone(&counter),
        )),
        None => compactor,
    };
    let compactor = match config.evict_threshold {
        Some(t) => compactor.with_evict(Some(EvictLargeResults::new().with_threshold(t))),
        None => compactor,
    };

    // The scorer walks the same messages: the full history, what the agent was told,
    // and each prompt keel assembles.
    let mut scorer = Scorer::new(&messages, Arc::clone(&counter));
    let mut stored = StoredText::default();
    let mut prompts = Vec::new();
    let mut events = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        if m.role != Role::Assistant {
            // Before the first model call: the system prompt and goal have their
            // places; anything else goes to the raw buffer.
            if Some(i) != system_at && i != goal_at {
                compactor.push(&mut state, vec![m.clone()]);
            }
            i += 1;
            continue;
        }
        // The model is called here.
        let prompt = compactor.assemble(&mut state);
        scorer.turn(i, &prompt, &mut |fact| {
            Ok::<_, CompactionError>(stored.refresh(&store, &thread)?.contains(fact))
        })?;
        if config.record_prompts {
            prompts.push(prompt);
        }

        // The step: this reply and everything up to the next model call.
        let end = messages[i + 1..]
            .iter()
            .position(|m| m.role == Role::Assistant)
            .map_or(messages.len(), |p| i + 1 + p);
        let results = messages[i + 1..end].to_vec();
        compactor.push_step(&mut state, messages[i].clone(), results);
        match compactor.after_step(&mut state, &[]).await {
            Ok(_) => {}
            // A summary the model wrote but the checks refused changes nothing and is
            // counted as a failed compaction; the next one falls back to the
            // extractive summary (`CompactionConfig::fallback_after_failures`), as a
            // live agent's would. A model that cannot be reached fails the replay.
            Err(CompactionError::Summarize(keel_summarize::SummarizeError::Rejected {
                ..
            })) => {}
            Err(e) => return Err(e),
        }
        // The state keeps only the latest events; the report keeps them all.
        events.append(&mut state.events);
        i = end;
    }
    let (turns, facts) = scorer.finish();

    let final_prompt = compactor.assemble(&mut state);
    let mut needles = Vec::new();
    for text in planted {
        let in_context = final_prompt.iter().any(|m| m.text().contains(&text));
        // A search of everything the store holds: the archive and offloaded files.
        let found = !in_context && stored.refresh(&store, &thread)?.contains(&text);
        needles.push(Needle {
            text,
            left_context: !in_context,
            found_in_archive: found,
        });
    }
    Ok(RunReport {
        dataset: trajectory.dataset.clone(),
        id: trajectory.id.clone(),
        turns,
        events,
        needles,
        facts,
        prompts,
    })
}

/// Everything the thread's offload store holds (the archive, offloaded results,
/// truncated arguments), read again only when it grew: what a search of the archive
/// would find.
#[derive(Default)]
struct StoredText {
    sizes: Vec<u64>,
    text: String,
}

impl StoredText {
    fn refresh(
        &mut self,
        store: &Arc<dyn OffloadStore>,
        thread: &ThreadId,
    ) -> Result<&Self, CompactionError> {
        // keel's own bookkeeping (the lineage records) is not something to search.
        let entries: Vec<_> = store
            .list(thread, None)
            .map_err(CompactionError::Archive)?
            .into_iter()
            .filter(|e| e.path.components().next() != Some(keel_offload::LINEAGE_DIR))
            .collect();
        let sizes: Vec<u64> = entries.iter().map(|e| e.bytes).collect();
        if sizes != self.sizes {
            self.text.clear();
            for e in &entries {
                let key =
                    Key::new(thread.as_str(), e.path.as_str()).map_err(CompactionError::Archive)?;
                self.text
                    .push_str(&store.get(&key).map_err(CompactionError::Archive)?);
                self.text.push('\n');
            }
            self.sizes = sizes;
        }
        Ok(self)
    }

    /// Whether `fact` is there as text, or JSON-escaped as the archive stores it.
    fn contains(&self, fact: &str) -> bool {
        if self.text.contains(fact) {
            return true;
        }
        let escaped = serde_json::to_string(fact).unwrap_or_default();
        escaped
            .strip_prefix('"')
            .and_then(|e| e.strip_suffix('"'))
            .is_some_and(|e| e != fact && self.text.contains(e))
    }
}

/// Plants `n` needles in the first tool results (or observations) of a run and
/// returns their texts.
fn plant_needles(messages: &mut [Message], n: usize) -> Vec<String> {
    let observation = |m: &Message| {
        m.role == Role::Tool
            || m.metadata
                .get(OBSERVATION_METADATA_KEY)
                .is_some_and(|v| v.as_bool() == Some(true))
    };
    let is_json = |m: &Message| serde_json::from_str::<serde_json::Value>(&m.text()).is_ok();
    // The first observations that are not JSON carry the needles, so that every JSON
    // result is minified as it would be without them; JSON ones only when too few are
    // text, with the needle as a field of their own.
    let mut chosen: Vec<usize> = (0..messages.len())
        .filter(|&i| observation(&messages[i]) && !is_json(&messages[i]))
        .take(n)
        .collect();
    if chosen.len() < n {
        let more: Vec<usize> = (0..messages.len())
            .filter(|&i| observation(&messages[i]) && !chosen.contains(&i))
            .take(n - chosen.len())
            .collect();
        chosen.extend(more);
        chosen.sort_unstable();
    }
    let mut planted = Vec::new();
    for i in chosen {
        let m = &mut messages[i];
        // From the message itself, not the run's name: a run replays to the same
        // counts whatever its file is called.
        let text = m.text().into_owned();
        let code = needle_hash(&text, planted.len());
        let needle = format!("NEEDLE-{code:016x}");
        m.content = with_note(&text, &format!("verification code {needle}")).into();
        planted.push(needle);
    }
    planted
}

/// `text` with `note` added: as a last `"note"` field of a JSON object (so the result
/// stays JSON, and is minified like the others), else on a line of its own.
fn with_note(text: &str, note: &str) -> String {
    let body = text.trim_end();
    if body.starts_with('{')
        && body.ends_with('}')
        && let Ok(serde_json::Value::Object(map)) = serde_json::from_str(body)
    {
        let open = &body[..body.len() - 1];
        let comma = if map.is_empty() { "" } else { "," };
        let field = serde_json::Value::from(note);
        return format!("{}{comma} \"note\": {field}}}", open.trim_end());
    }
    format!("{text}\n(note: {note})")
}

fn needle_hash(text: &str, k: usize) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (text, k).hash(&mut h);
    h.finish()
}

/// Totals over many runs of one dataset, window and strategy.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Dataset.
    pub dataset: String,
    /// Strategy name.
    pub strategy: String,
    /// Window.
    pub window: usize,
    /// The prompt budget: the window less the reply's reserve ([`Report::from_runs`]:
    /// the window).
    pub budget: usize,
    /// The price of a cached prompt token the costs were weighed with, relative to an
    /// uncached one.
    pub cached_price: f64,
    /// Runs replayed.
    pub runs: usize,
    /// Model calls.
    pub turns: usize,
    /// Input tokens with the full history.
    pub full_tokens: usize,
    /// Input tokens with the strategy.
    pub tokens: usize,
    /// Cache-weighted cost of the full history (shared-prefix tokens at
    /// [`cached_price`](Self::cached_price)).
    pub full_cost: f64,
    /// Cache-weighted cost with the strategy, the summarizer's calls included
    /// ([`Report::summary_cost`]).
    pub cost: f64,
    /// Turns whose prompt extends the previous turn's, among turns with a previous one.
    pub cacheable_turns: usize,
    /// Turns with a previous turn in the same run.
    pub followup_turns: usize,
    /// Largest prompt with the full history.
    pub full_peak: usize,
    /// Largest prompt with the strategy.
    pub peak: usize,
    /// Turns whose full-history prompt exceeds the window.
    pub full_over_window: usize,
    /// Turns whose prompt exceeds the window with the strategy.
    pub over_window: usize,
    /// Turns whose full-history prompt exceeds the budget.
    pub full_over_budget: usize,
    /// Turns whose prompt exceeds the budget with the strategy.
    pub over_budget: usize,
    /// Prompts with the goal byte-identical.
    pub goal_intact: usize,
    /// Successful compactions.
    pub compactions: usize,
    /// Failed compactions.
    pub failed_compactions: usize,
    /// Needles planted.
    pub needles: usize,
    /// Needles compacted out of the prompt.
    pub needles_left: usize,
    /// Of those, found in the archive.
    pub needles_found: usize,
    /// Turns checked for needed facts ([`TurnRecord::checked`]): from the first turn
    /// of each run whose prompt lacked something the agent was told.
    pub recall_turns: usize,
    /// Facts those turns needed: identifiers in the recorded reply that came from
    /// earlier user or tool messages, not from the system prompt or the goal
    /// ([`super::needed_facts`]).
    pub needed_facts: usize,
    /// Of those, present in the prompt keel assembled for the turn.
    pub facts_in_prompt: usize,
    /// Of those not in the prompt, found by a search of the archive or the offload
    /// store.
    pub facts_in_archive: usize,
    /// Prompt tokens of the summarizer's calls (0 for the extractive summarizer).
    pub summary_input_tokens: u64,
    /// Of those, tokens its provider served from the cache.
    pub summary_cached_tokens: u64,
    /// Tokens the summarizer's model wrote.
    pub summary_output_tokens: u64,
}

impl Report {
    /// Summarizes run reports made at `window`: the budget is the window, and cached
    /// tokens are priced at [`CACHED_TOKEN_PRICE`]. For a replay's own runs,
    /// [`Report::from_config`] knows its budget and price.
    pub fn from_runs(dataset: &str, strategy: &str, window: usize, runs: &[RunReport]) -> Self {
        Self::tally(
            dataset,
            strategy,
            (window, window),
            CACHED_TOKEN_PRICE,
            runs,
        )
    }

    /// Summarizes the run reports of a replay with `config`: prompts over its
    /// [`input_budget`](ReplayConfig::input_budget) are counted, and cached tokens are
    /// priced at its compaction's [`CompactionConfig::cached_input_price`] (the price
    /// its step trigger's cost model assumed).
    ///
    /// ```
    /// use keel_compaction::replay::{ReplayConfig, Report};
    /// use keel_compaction::{CompactionConfig, Strategy};
    ///
    /// let mut config = ReplayConfig::new(8_000, Strategy::Hierarchical);
    /// config.compaction = config.compaction.with_cached_input_price(0.5);
    /// let report = Report::from_config("none", &config, &[]);
    /// assert_eq!((report.budget, report.cached_price), (7_200, 0.5));
    /// ```
    pub fn from_config(dataset: &str, config: &ReplayConfig, runs: &[RunReport]) -> Self {
        Self::tally(
            dataset,
            config.compaction.strategy.name(),
            (config.window, config.input_budget()),
            config.compaction.cached_input_price.clamp(0.0, 1.0),
            runs,
        )
    }

    fn tally(
        dataset: &str,
        strategy: &str,
        (window, budget): (usize, usize),
        cached_price: f64,
        runs: &[RunReport],
    ) -> Self {
        let mut r = Report {
            dataset: dataset.to_owned(),
            strategy: strategy.to_owned(),
            window,
            budget,
            cached_price,
            runs: runs.len(),
            turns: 0,
            full_tokens: 0,
            tokens: 0,
            full_cost: 0.0,
            cost: 0.0,
            cacheable_turns: 0,
            followup_turns: 0,
            full_peak: 0,
            peak: 0,
            full_over_window: 0,
            over_window: 0,
            full_over_budget: 0,
            over_budget: 0,
            goal_intact: 0,
            compactions: 0,
            failed_compactions: 0,
            needles: 0,
            needles_left: 0,
            needles_found: 0,
            recall_turns: 0,
            needed_facts: 0,
            facts_in_prompt: 0,
            facts_in_archive: 0,
            summary_input_tokens: 0,
            summary_cached_tokens: 0,
            summary_output_tokens: 0,
        };
        for run in runs {
            for (k, t) in run.turns.iter().enumerate() {
                r.turns += 1;
                r.full_tokens += t.full_tokens;
                r.tokens += t.tokens;
                r.full_cost += weighted(t.full_tokens, t.full_shared_prefix, cached_price);
                r.cost += weighted(t.tokens, t.shared_prefix, cached_price);
                if k > 0 {
                    r.followup_turns += 1;
                    r.cacheable_turns += usize::from(t.extends_previous);
                }
                r.full_peak = r.full_peak.max(t.full_tokens);
                r.peak = r.peak.max(t.tokens);
                r.full_over_window += usize::from(t.full_tokens > window);
                r.over_window += usize::from(t.tokens > window);
                r.full_over_budget += usize::from(t.full_tokens > budget);
                r.over_budget += usize::from(t.tokens > budget);
                r.goal_intact += usize::from(t.goal_intact);
                r.recall_turns += usize::from(t.checked);
                r.needed_facts += t.needed;
                r.facts_in_prompt += t.needed_in_prompt;
                r.facts_in_archive += t.needed_in_archive;
            }
            for e in &run.events {
                r.summary_input_tokens += e.summary_input_tokens;
                r.summary_cached_tokens += e.summary_cached_tokens.min(e.summary_input_tokens);
                r.summary_output_tokens += e.summary_output_tokens;
            }
            r.compactions += run.events.iter().filter(|e| e.error.is_none()).count();
            r.failed_compactions += run.events.iter().filter(|e| e.error.is_some()).count();
            r.needles += run.needles.len();
            r.needles_left += run.needles.iter().filter(|n| n.left_context).count();
            r.needles_found += run
                .needles
                .iter()
                .filter(|n| n.left_context && n.found_in_archive)
                .count();
        }
        // The summarizer's calls are part of what the strategy costs.
        r.cost += r.summary_cost();
        r
    }

    /// The cache-weighted cost of the summarizer's calls (included in `cost`): prompt
    /// tokens at 1, cached ones at [`cached_price`](Self::cached_price), output at
    /// [`OUTPUT_TOKEN_PRICE`].
    pub fn summary_cost(&self) -> f64 {
        let cached = self.summary_cached_tokens.min(self.summary_input_tokens);
        (self.summary_input_tokens - cached) as f64
            + self.cached_price * cached as f64
            + OUTPUT_TOKEN_PRICE * self.summary_output_tokens as f64
    }

    /// Fewer input tokens than the full history, as a fraction (0.35 = 35% fewer).
    pub fn token_reduction(&self) -> f64 {
        1.0 - ratio(self.tokens as f64, self.full_tokens as f64)
    }

    /// Lower cache-weighted cost than the full history, as a fraction.
    pub fn cost_reduction(&self) -> f64 {
        1.0 - ratio(self.cost, self.full_cost)
    }

    /// Share of follow-up turns whose prompt extends the previous one.
    pub fn cacheable_share(&self) -> f64 {
        ratio(self.cacheable_turns as f64, self.followup_turns as f64)
    }

    /// Share of prompts with the goal byte-identical.
    pub fn goal_share(&self) -> f64 {
        ratio(self.goal_intact as f64, self.turns as f64)
    }

    /// Share of compacted-away needles found in the archive (1.0 when none left).
    pub fn needle_share(&self) -> f64 {
        if self.needles_left == 0 {
            1.0
        } else {
            ratio(self.needles_found as f64, self.needles_left as f64)
        }
    }

    /// Needed-fact recall: the share of the facts the recorded agent passed on (on
    /// [`TurnRecord::checked`] turns) that were in the prompt. 1.0 when none were needed;
    /// the full history has 1.0 by construction.
    pub fn recall(&self) -> f64 {
        share_or_one(self.facts_in_prompt, self.needed_facts)
    }

    /// The share of needed facts not in the prompt but retrievable from the archive
    /// or the offload store (`recall() + archive_recall()` is what the agent could
    /// reach at all).
    pub fn archive_recall(&self) -> f64 {
        if self.needed_facts == 0 {
            0.0
        } else {
            self.facts_in_archive as f64 / self.needed_facts as f64
        }
    }

    /// The share of needed facts the agent could reach at all: in the prompt or in
    /// the archive (`recall() + archive_recall()`; 1.0 when none were needed).
    pub fn reachable(&self) -> f64 {
        share_or_one(
            self.facts_in_prompt + self.facts_in_archive,
            self.needed_facts,
        )
    }

    /// The column headings of [`Report`]'s `Display` rows (`over`: prompts over the
    /// budget).
    pub const HEADER: &'static str = "dataset    window strategy      runs turns  tokens(full→keel)      saved  cache-weighted(full→keel)  saved  cacheable  peak(full→keel) over(full→keel) goal  needles       recall(+archive) facts";
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<10} {:>6} {:<12} {:>5} {:>5} {:>9}→{:<9} {:>6.1}% {:>11.0}→{:<11.0} {:>6.1}% {:>8.1}% {:>6}→{:<6} {:>5}→{:<5} {:>4.0}% {:<13} {:>6.1}% (+{:>4.1}%) {:>5}",
            self.dataset,
            self.window,
            self.strategy,
            self.runs,
            self.turns,
            self.full_tokens,
            self.tokens,
            100.0 * self.token_reduction(),
            self.full_cost,
            self.cost,
            100.0 * self.cost_reduction(),
            100.0 * self.cacheable_share(),
            self.full_peak,
            self.peak,
            self.full_over_budget,
            self.over_budget,
            100.0 * self.goal_share(),
            format!("{}/{} left", self.needles_found, self.needles_left),
            100.0 * self.recall(),
            100.0 * self.archive_recall(),
            self.needed_facts,
        )
    }
}

fn weighted(tokens: usize, shared: usize, cached_price: f64) -> f64 {
    let shared = shared.min(tokens);
    cached_price * shared as f64 + (tokens - shared) as f64
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

/// Replays every trajectory with one config and sums the result.
pub async fn replay_all(
    trajectories: &[Trajectory],
    config: &ReplayConfig,
    counter: Arc<dyn TokenCounter>,
) -> Result<(Report, Vec<RunReport>), CompactionError> {
    let mut runs = Vec::with_capacity(trajectories.len());
    for t in trajectories {
        runs.push(replay_trajectory(t, config, Arc::clone(&counter)).await?);
    }
    let dataset = trajectories.first().map_or("", |t| t.dataset.as_str());
    let report = Report::from_config(dataset, config, &runs);
    Ok((report, runs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_token::ApproxCounter;

    fn turn(full_tokens: usize, tokens: usize, shared_prefix: usize) -> TurnRecord {
        TurnRecord {
            full_tokens,
            tokens,
            shared_prefix,
            full_shared_prefix: shared_prefix,
            extends_previous: shared_prefix > 0,
            goal_intact: true,
            checked: false,
            needed: 0,
            needed_in_prompt: 0,
            needed_in_archive: 0,
        }
    }

    /// A replay's report counts prompts over its budget (the window less the reply's
    /// reserve), not only over the window, and prices cached tokens as configured.
    #[test]
    fn a_replays_report_counts_the_budget_and_its_price() {
        let run = RunReport {
            dataset: "d".into(),
            id: "r".into(),
            turns: vec![
                turn(850, 850, 0),
                turn(950, 920, 850),
                turn(1_050, 990, 900),
            ],
            events: Vec::new(),
            needles: Vec::new(),
            facts: Vec::new(),
            prompts: Vec::new(),
        };
        let mut config = ReplayConfig::new(1_000, Strategy::Hierarchical);
        assert_eq!(config.input_budget(), 900);
        let r = Report::from_config("d", &config, std::slice::from_ref(&run));
        assert_eq!((r.full_over_window, r.over_window), (1, 0));
        assert_eq!((r.full_over_budget, r.over_budget), (2, 2));
        // 850 + (100 + 0.1 * 850) + (150 + 0.1 * 900) for the full history.
        assert!((r.full_cost - 1_275.0).abs() < 1e-9, "{}", r.full_cost);
        config.compaction = config.compaction.with_cached_input_price(1.0);
        let r = Report::from_config("d", &config, std::slice::from_ref(&run));
        assert!((r.full_cost - 2_850.0).abs() < 1e-9, "{}", r.full_cost);
        assert!((r.cost - 2_760.0).abs() < 1e-9, "{}", r.cost);
        // Without a config: the window is the budget, and the price 0.1.
        let r = Report::from_runs("d", "s", 1_000, &[run]);
        assert_eq!(
            (r.full_over_budget, r.budget, r.cached_price),
            (1, 1_000, 0.1)
        );
    }

    /// A recorded run longer than the live agent's step ceiling (500 model calls)
    /// replays to its end instead of failing at the ceiling.
    #[tokio::test]
    async fn a_run_past_the_step_ceiling_replays_to_its_end() {
        let mut messages = vec![Message::system("be brief"), Message::user("count")];
        for k in 0..510 {
            messages.push(Message::assistant(format!("{k}")));
            messages.push(Message::user("next"));
        }
        let run = Trajectory::new("hand-made", "long", messages).unwrap();
        let config = ReplayConfig::new(8_000, Strategy::Hierarchical);
        assert_eq!(config.compaction.max_steps, 500);
        let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::default());
        let report = replay_trajectory(&run, &config, counter).await.unwrap();
        assert_eq!(report.turns.len(), 510);
    }
}
