//! The agent's nodes and routers, usable in a graph of your own.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use keel_checkpoint::{CheckpointTuple, Checkpointer, ListOptions, ThreadKey};
use keel_compaction::{
    CompactionConfig, CompactionError, Compactor, ContextState, EventKind, Trigger,
};
use keel_graph::reducer::{AddMessagesUpdate, MessageOp};
use keel_graph::{Durability, END, NodeContext, NodeError};
use keel_message::{Message, Role, ToolCall, ToolContext};
use keel_model::{ChatModel, ChatOptions, ModelError};
use keel_offload::{
    Collected, EvictLargeResults, LINEAGE_KEY, Lineage, LineageStore, OffloadStore, PolicyEnv,
    StoredWhat, ThreadId, collect_garbage,
};
use keel_token::{CalibratedCounter, ModelProfile, TokenCounter};
use serde_json::{Value, json};
use tracing::Instrument;

use crate::agent::RunBudget;
use crate::error::CleanupError;
use crate::event::AgentEvent;
use crate::state::{AgentState, AgentStateUpdate, MAX_FAILED_COMPACTIONS, MilestoneOp, Stop};
use crate::tools::Toolbox;

/// The agent's counter when it learns from the provider's counts: only its factor is
/// read.
pub(crate) type Calibrated = CalibratedCounter<Arc<dyn TokenCounter>>;

/// The agent node's name.
pub const AGENT: &str = "agent";
/// The tools node's name.
pub const TOOLS: &str = "tools";
/// The milestone compaction node's name.
pub const COMPACT: &str = "compact";
/// The epoch node's name.
pub const EPOCH: &str = "epoch";

/// The metadata key of the reminder the agent adds after an empty model reply.
pub const NUDGE_METADATA_KEY: &str = "keel.nudge";

/// The metadata key on a reply whose tool calls were refused (more than
/// [`AgentBuilder::max_tool_calls`](crate::AgentBuilder::max_tool_calls)): how many it
/// asked for. The reply is kept without them when it has text.
pub const CALLS_REFUSED_METADATA_KEY: &str = "keel.calls_refused";

/// The prompt tokens a tool call is assumed to take at the least, its result included,
/// for the default of [`AgentBuilder::max_tool_calls`](crate::AgentBuilder::max_tool_calls):
/// a call with short arguments and a one-line result takes about 40.
pub const TOKENS_PER_TOOL_CALL: usize = 64;

/// The thread used for the offload namespace when a graph runs without a thread.
pub(crate) const NO_THREAD: &str = "no-thread";

/// What every node of the agent shares: the model, the tools, and how to compact.
pub(crate) struct Parts {
    pub(crate) model: Arc<dyn ChatModel>,
    pub(crate) options: ChatOptions,
    pub(crate) tools: Toolbox,
    pub(crate) store: Arc<dyn OffloadStore>,
    pub(crate) counter: Arc<dyn TokenCounter>,
    /// The factor of the provider's counts over `counter`'s, when the agent learns
    /// it ([`AgentBuilder::calibrate`](crate::AgentBuilder::calibrate)). Only its
    /// factor is read: `counter` counts.
    pub(crate) calibration: Option<Arc<Calibrated>>,
    pub(crate) profile: ModelProfile,
    pub(crate) profile_fallback: bool,
    pub(crate) compaction: CompactionConfig,
    pub(crate) evict: EvictLargeResults,
    pub(crate) keep_checkpoints: Option<usize>,
    pub(crate) checkpointer: Option<Arc<dyn Checkpointer>>,
    pub(crate) approve: BTreeSet<String>,
    /// The most tool calls one reply may ask for
    /// ([`AgentBuilder::max_tool_calls`](crate::AgentBuilder::max_tool_calls)).
    pub(crate) max_tool_calls: usize,
    /// Replies in a row after which the same call is not run again
    /// ([`AgentBuilder::max_repeated_calls`](crate::AgentBuilder::max_repeated_calls)).
    pub(crate) max_repeats: Option<usize>,
    /// The compactor every node's is made from (for the thread of the call).
    pub(crate) compactor: Compactor,
    /// The checkpoint prunes compaction steps started in the background.
    pub(crate) prunes: Prunes,
}

/// Checkpoint prunes running in the background, one per thread and namespace. With
/// asynchronous (or exit) durability and a durable saver, a compaction step starts one
/// and does not wait for it: steps do not wait for their writes, and a prune waits for
/// every write the saver queued before it. The thread's next compaction step, or the
/// end of the run ([`AgentNodes::settle`]), waits for it.
#[derive(Default)]
pub(crate) struct Prunes {
    running: std::sync::Mutex<HashMap<ThreadKey, tokio::task::JoinHandle<bool>>>,
}

/// Prunes `key` to its newest `keep` stored checkpoints; whether it did (a failure is
/// logged: the next compaction step prunes again).
async fn prune(cp: Arc<dyn Checkpointer>, key: ThreadKey, keep: usize) -> bool {
    match cp.prune(&key, keep).await {
        Ok(n) => {
            tracing::debug!(removed = n, keep, "pruned checkpoints in a compaction step");
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "pruning checkpoints in a compaction step failed");
            false
        }
    }
}

/// Past this many threads with a prune not waited for (graphs of your own that never
/// call [`AgentNodes::settle`]), the finished ones are forgotten: their threads' next
/// compaction step removes what their prune left to remove.
const MAX_UNSETTLED_PRUNES: usize = 1024;

impl Prunes {
    fn running(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<ThreadKey, tokio::task::JoinHandle<bool>>> {
        self.running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts pruning `key` to its newest `keep` stored checkpoints.
    fn start(&self, cp: Arc<dyn Checkpointer>, key: ThreadKey, keep: usize) {
        let handle = tokio::spawn(prune(cp, key.clone(), keep));
        let mut running = self.running();
        if running.len() >= MAX_UNSETTLED_PRUNES {
            running.retain(|_, h| !h.is_finished());
        }
        // A prune of the same key still in the map was waited for by the step that
        // started this one, unless two runs share the thread: it goes on unwatched.
        running.insert(key, handle);
    }

    /// Waits for the prunes started for `thread` (every namespace, or only `ns`);
    /// whether one of them pruned.
    async fn wait(&self, thread: &str, ns: Option<&str>) -> bool {
        let handles: Vec<_> = {
            let mut running = self.running();
            let keys: Vec<ThreadKey> = running
                .keys()
                .filter(|k| k.thread_id == thread && ns.is_none_or(|ns| k.ns == ns))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| running.remove(k)).collect()
        };
        let mut pruned = false;
        for h in handles {
            // A prune that panicked or was cancelled pruned nothing to collect after.
            pruned |= h.await.unwrap_or(false);
        }
        pruned
    }
}

/// Whether this agent step's `compact` step made a milestone (and so pruned, when
/// pruning is on): true in the `epoch` step that follows it.
fn milestone_pruned_this_step(s: &AgentState) -> bool {
    s.compactions
        .back()
        .is_some_and(|e| e.kind == EventKind::Milestone && e.error.is_none() && e.step == s.step)
}

/// The agent's nodes (`agent`, `tools`, `compact`, `epoch`) and its routers, for a
/// graph of your own over [`AgentState`]: replace one, add your own between them, or
/// reuse the compaction nodes in a loop that is not an agent at all.
///
/// Get them from a built agent with [`crate::Agent::nodes`] or from
/// [`AgentBuilder::build_nodes`](crate::AgentBuilder::build_nodes); each method returns
/// a closure to pass to `StateGraph::add_node` or `add_conditional_edges`.
///
/// - **Give the builder your graph's saver and a lasting offload store.** The nodes
///   prune through the builder's [`checkpointer`](crate::AgentBuilder::checkpointer)
///   and archive into its [`offload_store`](crate::AgentBuilder::offload_store); a
///   saver given only to `StateGraph::with_checkpointer` is unknown to them, so
///   compaction steps prune nothing and the archive lives in memory, gone with the
///   process.
/// - **The routers name the agent graph's nodes** (`agent`, `tools`, `compact`,
///   `epoch`, `END`). In a graph with other names, write your router from
///   [`AgentNodes::trigger`] (when to compact; [`AgentNodes::route_after_tools`] reads
///   it, and a router of yours may map its `compact` to your own node as the
///   `custom_graph` example of the `keel` crate does) and [`AgentNodes::wants_epoch`]
///   (when to fold an epoch).
/// - **Your graph's input writes the goal, and your node counts the steps.** The
///   builder's [`goal`](crate::AgentBuilder::goal) is for [`Agent`](crate::Agent) runs:
///   in a graph of your own, the first run's input writes it
///   (`AgentStateUpdate::default().goal(..)`), and the node that makes a step
///   advances `step` (`.step(state.step + 1)`), which the step trigger counts. A state
///   with messages but no goal makes [`AgentNodes::trigger`] report
///   [`Trigger::Force`], so the `compact` node runs and fails saying so, instead of
///   never compacting.
/// - **The nodes work on [`AgentState`].** To compact a state of your own, call
///   keel-compaction's `Compactor` from a node of yours (the `compaction` example).
#[derive(Clone)]
pub struct AgentNodes {
    pub(crate) parts: Arc<Parts>,
}

impl std::fmt::Debug for AgentNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentNodes")
            .field("model", &self.parts.model.model_name())
            .field("tools", &self.parts.tools)
            .field("profile", &self.parts.profile)
            .finish_non_exhaustive()
    }
}

type NodeResult = Result<AgentStateUpdate, NodeError>;

fn thread_of(ctx: &NodeContext) -> String {
    ctx.thread_id().unwrap_or(NO_THREAD).to_owned()
}

fn ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl AgentNodes {
    /// The compactor for `thread` (cheap: it shares everything with the agent's).
    pub fn compactor(&self, thread: &str) -> Result<Compactor, NodeError> {
        let thread = ThreadId::new(thread).map_err(NodeError::new)?;
        let compactor = self.parts.compactor.for_thread(thread);
        Ok(match &self.parts.calibration {
            Some(c) => compactor.with_count_factor(c.factor()),
            None => compactor,
        })
    }

    /// The compaction settings (with `epoch_inline` off: epochs are the `epoch` node's).
    pub fn compaction(&self) -> &CompactionConfig {
        &self.parts.compaction
    }

    /// The model profile in use (window and output limits).
    pub fn profile(&self) -> &ModelProfile {
        &self.parts.profile
    }

    /// The tools the model is offered.
    pub fn toolbox(&self) -> &Toolbox {
        &self.parts.tools
    }

    /// A node function that runs `run` on (a clone of) these nodes.
    fn node<F, Fut>(
        &self,
        run: F,
    ) -> impl Fn(Arc<AgentState>, NodeContext) -> futures::future::BoxFuture<'static, NodeResult>
    + Send
    + Sync
    + 'static
    where
        F: Fn(AgentNodes, Arc<AgentState>, NodeContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = NodeResult> + Send + 'static,
    {
        let nodes = self.clone();
        move |s, ctx| Box::pin(run(nodes.clone(), s, ctx))
    }

    /// The `agent` node: sends the assembled prompt (system, goal, epoch, milestones,
    /// raw tail) to the model and appends its reply. On a provider context overflow it
    /// compacts once and retries. At the step ceiling it stops the run with
    /// [`Stop::StepCeiling`] instead of calling the model.
    pub fn agent(
        &self,
    ) -> impl Fn(Arc<AgentState>, NodeContext) -> futures::future::BoxFuture<'static, NodeResult>
    + Send
    + Sync
    + 'static {
        self.node(|nodes, s, ctx| async move { nodes.run_agent(s, ctx).await })
    }

    /// The `tools` node: runs the last reply's tool calls concurrently, each with the
    /// toolbox's timeout; passes every result through the offload policy; appends the
    /// results. Tools named in the approval list are asked about first (an interrupt).
    pub fn tools(
        &self,
    ) -> impl Fn(Arc<AgentState>, NodeContext) -> futures::future::BoxFuture<'static, NodeResult>
    + Send
    + Sync
    + 'static {
        self.node(|nodes, s, ctx| async move { nodes.run_tools(s, ctx).await })
    }

    /// The `compact` node: archives the older raw steps and summarizes them into a
    /// milestone, keeping a recent tail; prunes old checkpoints meanwhile.
    pub fn compact(
        &self,
    ) -> impl Fn(Arc<AgentState>, NodeContext) -> futures::future::BoxFuture<'static, NodeResult>
    + Send
    + Sync
    + 'static {
        self.node(|nodes, s, ctx| async move { nodes.run_compact(s, ctx).await })
    }

    /// The `epoch` node: folds the milestones and the previous epoch into a new epoch
    /// summary. Unlike `compact` it prunes no checkpoints when it runs right after the
    /// milestone step of the same agent step (as in [`crate::Agent`]'s graph), which
    /// just pruned; otherwise it prunes old checkpoints meanwhile.
    pub fn epoch(
        &self,
    ) -> impl Fn(Arc<AgentState>, NodeContext) -> futures::future::BoxFuture<'static, NodeResult>
    + Send
    + Sync
    + 'static {
        self.node(|nodes, s, ctx| async move { nodes.run_epoch(s, ctx).await })
    }

    /// After `agent`: to `tools` when the reply calls tools, back to `agent` after an
    /// empty reply (once), else to `END`.
    pub fn route_after_agent(
        &self,
    ) -> impl Fn(&AgentState) -> &'static str + Send + Sync + 'static {
        |s| {
            if s.stop.is_some() {
                return END;
            }
            match s.last_message() {
                Some(m) if m.role == Role::Assistant && !m.tool_calls.is_empty() => TOOLS,
                Some(m) if m.metadata.contains_key(NUDGE_METADATA_KEY) => AGENT,
                _ => END,
            }
        }
    }

    /// After `tools`: to `compact` when a trigger fires (step count, token fraction of
    /// the window, forced), else to `agent` (which stops at the step ceiling).
    pub fn route_after_tools(
        &self,
    ) -> impl Fn(&AgentState) -> &'static str + Send + Sync + 'static {
        let nodes = self.clone();
        move |s| match nodes.trigger(s) {
            Some(Trigger::StepCeiling) | None => AGENT,
            Some(_) => COMPACT,
        }
    }

    /// After `compact`: to `epoch` when enough milestones wait
    /// ([`AgentNodes::wants_epoch`]), else to `agent`.
    pub fn route_after_compact(
        &self,
    ) -> impl Fn(&AgentState) -> &'static str + Send + Sync + 'static {
        let nodes = self.clone();
        move |s| if nodes.wants_epoch(s) { EPOCH } else { AGENT }
    }

    /// Whether `state` holds enough milestones for the `epoch` node to fold
    /// ([`CompactionConfig::epoch_every`](keel_compaction::CompactionConfig::epoch_every)).
    pub fn wants_epoch(&self, state: &AgentState) -> bool {
        state.milestones.len() >= self.parts.compaction.epoch_every.max(1)
    }

    /// Which compaction trigger fires for `state`, if any. A trigger is reported only
    /// when compacting would move something out of the raw buffer (or it is the step
    /// ceiling), so a compaction step is never scheduled for nothing. A state with
    /// messages but no goal (a graph of your own whose input did not write one) gets
    /// [`Trigger::Force`]: the `compact` node then fails saying the goal is missing,
    /// where no trigger would leave the raw buffer growing without a word.
    pub fn trigger(&self, state: &AgentState) -> Option<Trigger> {
        // Planned with the budget the nodes compact to: scaled when counts are
        // calibrated (a cheap clone of `Arc`s then).
        let scaled;
        let factor = self.parts.calibration.as_ref().map_or(1.0, |c| c.factor());
        let compactor = if factor == 1.0 {
            &self.parts.compactor
        } else {
            scaled = self.parts.compactor.clone().with_count_factor(factor);
            &scaled
        };
        let specs = self.parts.tools.specs();
        let Some(parts) = state.context_parts() else {
            return (!state.messages.is_empty()).then_some(Trigger::Force);
        };
        // Most steps fire nothing: learn that from the state's parts as they are,
        // before copying them into a context.
        if !compactor.may_trigger(parts, specs) {
            return None;
        }
        let mut c = state.context()?;
        match compactor.check(&mut c, specs)? {
            Trigger::StepCeiling => Some(Trigger::StepCeiling),
            t if compactor.would_compact(&mut c, t, specs) => Some(t),
            _ => None,
        }
    }

    async fn run_agent(&self, s: Arc<AgentState>, ctx: NodeContext) -> NodeResult {
        /// A model call that failed (after the client's retries): a warning, and the
        /// error on the node's span, so a trace counts and times failed calls too.
        fn model_call_failed(e: &dyn std::error::Error, prompt_tokens: u64, started: Instant) {
            let duration_ms = ms(started);
            tracing::warn!(error = %e, prompt_tokens, duration_ms, "model call failed");
            let span = tracing::Span::current();
            span.record("error", tracing::field::display(e));
            span.record("duration_ms", duration_ms);
        }
        let thread = thread_of(&ctx);
        // At WARN level, so a subscriber that shows only warnings still has it, and
        // every warning of the node says which thread and step it is about.
        let span = tracing::warn_span!(
            "keel.agent",
            node = AGENT,
            thread = %thread,
            step = s.step + 1,
            model = tracing::field::Empty,
            prompt_tokens = tracing::field::Empty,
            provider_prompt_tokens = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            tool_calls = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
            retries = tracing::field::Empty,
            overflow_retries = tracing::field::Empty,
            cut_off = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        async move {
            if s.stop.is_some() {
                // A compaction step stopped the run (`route_after_agent` ends it).
                return Ok(AgentStateUpdate::default());
            }
            let p = &self.parts;
            let parts = s.context_parts().ok_or_else(no_goal)?;
            let mut events = Vec::new();
            if p.profile_fallback && s.step == 0 {
                events.push(AgentEvent::ProfileFallback {
                    model: p.model.model_name().to_owned(),
                    window: p.profile.context_window as u64,
                });
            }
            let max = p.compaction.max_steps;
            if s.step >= max {
                tracing::warn!(steps = s.step, max, "step ceiling reached; the run stops");
                events.push(AgentEvent::StepCeiling { steps: s.step, max });
                return Ok(AgentStateUpdate::default()
                    .stop(Some(Stop::StepCeiling { steps: s.step, max }))
                    .events(events));
            }
            if let Some(budget) = RunBudget::of(ctx.config()) {
                let steps = s.step.saturating_sub(budget.start);
                if steps >= budget.max {
                    let max = budget.max;
                    tracing::info!(steps, max, "the run's budget of model calls is used; the run stops");
                    events.push(AgentEvent::RunBudget { steps, max });
                    return Ok(AgentStateUpdate::default()
                        .stop(Some(Stop::RunBudget { steps, max }))
                        .events(events));
                }
            }
            let compactor = self.compactor(&thread)?;
            let specs = p.tools.specs();
            // The prompt is read from the state as it is; a context of its own is made
            // only when a provider overflow makes the node compact before retrying.
            let mut compacted: Option<ContextState> = None;
            let (response, prompt_tokens, started) = loop {
                let now = compacted.as_ref().map_or(parts, ContextState::parts);
                let prompt_tokens = compactor.tokens_of(now, specs).total as u64;
                let started = Instant::now();
                let reply = if let Some(overflow) = over_budget(&p.profile, compactor.budget(), prompt_tokens) {
                    // Not sent: a provider would refuse it, or (Ollama) silently cut it.
                    Err(overflow)
                } else {
                    let prompt: Vec<Message> = now
                        .system
                        .into_iter()
                        .chain(std::iter::once(now.goal.message()))
                        .chain(now.layers().map(|l| &l.message))
                        .chain(now.raw)
                        .cloned()
                        .collect();
                    let prompt = answer_unanswered_calls(prompt);
                    p.model.chat(&prompt, specs, &p.options).await
                };
                match reply {
                    Err(e) if e.is_context_overflow() && compacted.is_none() => {
                        tracing::warn!(error = %e, "context overflow; compacting and retrying once");
                        let mut c = context(&s)?;
                        let compaction = compactor.compact(&mut c, Trigger::Overflow, specs).await;
                        let over = compactor.tokens(&mut c, specs).total > compactor.prompt_budget();
                        let mut folded = false;
                        if compactor.epoch_due(&c) || over {
                            // Still over the budget: the milestones go into the epoch
                            // summary before they are due. A failed epoch keeps them
                            // (recorded as an event).
                            folded = compactor
                                .fold_epoch(&mut c, Trigger::Overflow, specs)
                                .await
                                .is_ok();
                        }
                        if let (Err(ce), false) = (compaction, folded) {
                            let e = crate::error::OverflowUnresolved {
                                model: e,
                                compaction: ce,
                            };
                            model_call_failed(&e, prompt_tokens, started);
                            return Err(NodeError::new(e));
                        }
                        compacted = Some(c);
                    }
                    Err(e) => {
                        model_call_failed(&e, prompt_tokens, started);
                        return Err(NodeError::new(e));
                    }
                    Ok(r) => break (r, prompt_tokens, started),
                }
            };
            let retries = u32::from(compacted.is_some());
            let mut update = match &mut compacted {
                Some(c) => {
                    let mut update = diff(&s, c);
                    for e in std::mem::take(&mut c.events) {
                        events.push(AgentEvent::Compaction(e.clone()));
                        update.compactions.get_or_insert_with(Vec::new).push(e);
                    }
                    update
                }
                None => AgentStateUpdate::default(),
            };
            let mut reply = response.message;
            reply.role = Role::Assistant;
            let usage = response.usage;
            let step = s.step + 1;
            unique_call_ids(&mut reply.tool_calls, step);
            let model = if response.model.is_empty() {
                p.model.model_name().to_owned()
            } else {
                response.model
            };
            let (duration_ms, cut_off) = (
                ms(started),
                response.finish_reason == Some(keel_model::FinishReason::Length),
            );
            // The same numbers as the event, so a trace alone can be summed.
            let span = tracing::Span::current();
            span.record("model", model.as_str());
            span.record("prompt_tokens", prompt_tokens);
            span.record("tool_calls", reply.tool_calls.len());
            span.record("duration_ms", duration_ms);
            span.record("retries", response.retries);
            span.record("overflow_retries", retries);
            span.record("cut_off", cut_off);
            if let Some(u) = usage {
                span.record("provider_prompt_tokens", u.prompt_tokens);
                span.record("completion_tokens", u.completion_tokens);
                if let Some(c) = u.cached_tokens {
                    span.record("cached_tokens", c);
                }
            }
            if let (Some(calibration), Some(u)) = (&p.calibration, usage) {
                // A tenth kept in hand: the factor aims a little above the server's
                // count, so a prompt that grows unlike the last one still fits. What
                // the calibrated counter would have said is keel's count scaled.
                let reported = usize::try_from(u.prompt_tokens).unwrap_or(usize::MAX);
                let scaled = (prompt_tokens as f64 * calibration.factor()).round() as usize;
                calibration.observe(scaled, reported.saturating_add(reported / 10));
            }
            events.push(AgentEvent::ModelCall {
                step,
                model,
                prompt_tokens,
                provider_prompt_tokens: usage.map(|u| u.prompt_tokens),
                completion_tokens: usage.map(|u| u.completion_tokens),
                cached_tokens: usage.and_then(|u| u.cached_tokens),
                tool_calls: reply.tool_calls.len(),
                duration_ms,
                retries: response.retries,
                overflow_retries: retries,
                cut_off,
            });
            let mut new = vec![];
            let nudged = s
                .last_message()
                .is_some_and(|m| m.metadata.contains_key(NUDGE_METADATA_KEY));
            let mut stop = None;
            let calls = reply.tool_calls.len();
            let max = p.max_tool_calls;
            let empty = calls == 0 && reply.text().trim().is_empty();
            if calls > max {
                // Not run: its calls and their results could leave a step no prompt
                // holds. Its text stays, without them; the model is told once to call
                // fewer.
                tracing::warn!(calls, max, "a reply asked for too many tool calls; none was run");
                events.push(AgentEvent::CallsRefused { step, calls, max });
                reply.tool_calls.clear();
                reply
                    .metadata
                    .insert(CALLS_REFUSED_METADATA_KEY.to_owned(), calls.into());
                if !reply.text().trim().is_empty() {
                    new.push(reply);
                }
                if nudged {
                    stop = Some(Stop::TooManyToolCalls { steps: step, calls, max });
                } else {
                    let mut nudge = Message::user(format!(
                        "Your last reply asked for {calls} tool calls at once, and none was run: \
                         this context holds the calls and results of at most {max}. Call at most \
                         {max} tools in one reply; call the rest in later replies."
                    ));
                    nudge.metadata.insert(NUDGE_METADATA_KEY.to_owned(), Value::Bool(true));
                    new.push(nudge);
                }
            } else {
                new.push(reply);
            }
            if empty {
                if nudged {
                    stop = Some(Stop::EmptyReply { steps: step });
                } else {
                    let mut nudge = Message::user(
                        "Your last reply was empty. Continue with the task: call a tool, or give your final answer.",
                    );
                    nudge.metadata.insert(NUDGE_METADATA_KEY.to_owned(), Value::Bool(true));
                    new.push(nudge);
                }
            }
            let append = AddMessagesUpdate::append(new);
            update.messages = Some(match update.messages.take() {
                Some(d) => d.then(append),
                None => append,
            });
            update.step = Some(step);
            if stop.is_some() {
                update.stop = Some(stop);
            }
            update.events = Some(events);
            Ok(update)
        }
        .instrument(span)
        .await
    }

    async fn run_tools(&self, s: Arc<AgentState>, ctx: NodeContext) -> NodeResult {
        let thread = thread_of(&ctx);
        // At WARN level, so a subscriber that shows only warnings still has it, and
        // every warning of the node says which thread and step it is about.
        let span = tracing::warn_span!(
            "keel.agent",
            node = TOOLS,
            thread = %thread,
            step = s.step,
            calls = tracing::field::Empty,
            failed = tracing::field::Empty,
            offloaded = tracing::field::Empty,
        );
        async move {
            let p = &self.parts;
            let Some(reply) = s
                .last_message()
                .filter(|m| m.role == Role::Assistant && !m.tool_calls.is_empty())
                .cloned()
            else {
                return Ok(AgentStateUpdate::default());
            };
            let calls = &reply.tool_calls;
            let denied = self.approval(calls, &ctx)?;
            let denied = &denied;
            // Every call reads the offload store as this checkpoint's lineage sees it.
            let lineage = s.lineage.to_value();
            let runs = calls.iter().map(|c| {
                let denied = denied.get(&c.id);
                let repeats = p
                    .max_repeats
                    .map(|max| (repeated_in_a_row(&s, c), max))
                    .filter(|&(n, max)| n >= max);
                let call_ctx = ToolContext::new(c.id.clone())
                    .with_thread_id(thread.clone())
                    .with_step(s.step)
                    .with_configurable(LINEAGE_KEY, lineage.clone());
                async move {
                    if let Some(reason) = denied {
                        let text = match reason {
                            Some(reason) => format!(
                                "The user did not approve this call; it was not run. Their reason: {reason}"
                            ),
                            None => "The user did not approve this call; it was not run. Ask them or try another way.".to_owned(),
                        };
                        not_run(c, text, "not approved".to_owned(), crate::ToolFailure::NotApproved)
                    } else if let Some((n, _)) = repeats {
                        let text = format!(
                            "Not run: each of your last {n} replies called `{}` with these same arguments, and its result is in this conversation. Use it, or do something else.",
                            crate::tools::clip(&c.name, 64)
                        );
                        not_run(c, text, format!("repeated {n} times in a row"), crate::ToolFailure::Repeated)
                    } else {
                        p.tools.run_in(c, call_ctx).await
                    }
                }
            });
            let outcomes = futures::future::join_all(runs).await;
            let mut events = Vec::with_capacity(outcomes.len());
            let mut failed = 0;
            for (c, o) in calls.iter().zip(&outcomes) {
                failed += usize::from(o.error.is_some());
                // The event log is stored in every checkpoint's delta: a name or an
                // error of any size (a tool's 10 MB error text) is kept short there;
                // the tool message holds it whole.
                let duration_ms = u64::try_from(o.duration.as_millis()).unwrap_or(u64::MAX);
                let failure = o.failure.map(|f| f.as_str());
                if o.failure.is_some_and(|f| f.is_fault()) {
                    // A timeout or a panic is the tool's (or its host's) fault, not the
                    // model's: worth a warning where a bad call is not.
                    tracing::warn!(
                        tool = %crate::tools::clip(&c.name, 64),
                        call_id = %crate::tools::clip(&c.id, 256),
                        failure,
                        duration_ms,
                        error = o.error.as_deref().map(|e| crate::tools::clip(e, 200)).as_deref(),
                        "tool call failed"
                    );
                } else {
                    tracing::debug!(
                        tool = %crate::tools::clip(&c.name, 64),
                        ok = o.error.is_none(),
                        failure,
                        result_chars = o.result_chars,
                        duration_ms,
                        "tool call"
                    );
                }
                events.push(AgentEvent::ToolCall {
                    step: s.step,
                    call_id: crate::tools::clip(&c.id, 256).into_owned(),
                    name: crate::tools::clip(&c.name, 64).into_owned(),
                    ok: o.error.is_none(),
                    failure: o.failure,
                    error: o
                        .error
                        .as_deref()
                        .map(|e| crate::tools::clip(e, MAX_EVENT_ERROR_CHARS).into_owned()),
                    result_chars: o.result_chars,
                    duration_ms,
                    fingerprint: crate::call_fingerprint(c),
                });
            }
            let results: Vec<Message> = outcomes.into_iter().map(|o| o.message).collect();
            let (results, offloads, moved) = self
                .offload(&thread, &s.lineage, reply.clone(), results)
                .await;
            let span = tracing::Span::current();
            span.record("calls", calls.len());
            span.record("failed", failed);
            span.record("offloaded", offloads.len());
            for (call_id, path, tokens) in offloads {
                events.push(AgentEvent::Offload {
                    step: s.step,
                    call_id,
                    path,
                    tokens,
                });
            }
            let mut update = AgentStateUpdate::default()
                .messages(AddMessagesUpdate::append(results))
                .events(events);
            if let Some(lineage) = moved.filter(|l| *l != s.lineage) {
                update = update.lineage(lineage);
            }
            Ok(update)
        }
        .instrument(span)
        .await
    }

    /// Asks about calls to tools that need approval; returns the ids of denied calls,
    /// each with the reason the answer gave, if any.
    fn approval(
        &self,
        calls: &[ToolCall],
        ctx: &NodeContext,
    ) -> Result<BTreeMap<String, Option<String>>, NodeError> {
        // A call whose arguments are not JSON never runs (its result says why), so
        // nobody is asked to approve it.
        let asked: Vec<&ToolCall> = calls
            .iter()
            .filter(|c| self.parts.approve.contains(&c.name))
            .filter(|c| !matches!(c.arguments, keel_message::ToolArguments::Invalid(_)))
            .collect();
        if asked.is_empty() {
            return Ok(BTreeMap::new());
        }
        let ids: BTreeSet<&str> = asked.iter().map(|c| c.id.as_str()).collect();
        let question = json!({
            "approve": asked.iter().map(|c| json!({
                "id": c.id,
                "name": c.name,
                "arguments": c.arguments.to_json_string(),
            })).collect::<Vec<_>>(),
        });
        let mut answer = ctx.interrupt(question.clone())?;
        // An answer that is neither yes nor no is asked again (another interrupt of
        // this node, so the thread stays paused and resumable), never read as a no.
        // So is a map that names a call not asked about (a typo) or leaves one out.
        while !understood(&answer, &ids) {
            let mut again = question.clone();
            again["not_understood"] = answer;
            answer = ctx.interrupt(again)?;
        }
        Ok(asked
            .iter()
            .filter_map(|c| match decision(&answer, &c.id) {
                Decision::Yes => None,
                Decision::No(reason) => Some((c.id.clone(), reason)),
            })
            .collect())
    }

    /// Runs the evict policy over fresh results on the blocking pool, storing in
    /// `lineage`'s branch of the thread. Returns the results (large ones as stubs),
    /// `(call id, path, tokens)` per offload, and the lineage moved on when it stored.
    async fn offload(
        &self,
        thread: &str,
        lineage: &Lineage,
        reply: Message,
        results: Vec<Message>,
    ) -> (Vec<Message>, Vec<(String, String, u64)>, Option<Lineage>) {
        let minify = self.parts.compaction.minify_json;
        let policy = self.parts.evict.clone();
        // Results the counter's cheap bound puts under the threshold stay as they
        // are, with no trip to the blocking pool.
        let counter = &self.parts.counter;
        if results.iter().all(|m| {
            counter
                .max_tokens(&m.content.text())
                .is_some_and(|bound| bound <= policy.threshold_tokens)
        }) {
            return (minified(results, minify).await, Vec::new(), None);
        }
        let Ok(thread_id) = ThreadId::new(thread) else {
            return (minified(results, minify).await, Vec::new(), None);
        };
        let store = self.parts.store.clone();
        let lineage = lineage.clone();
        let counter = self.parts.counter.clone();
        let fallback = results.clone();
        let job = tokio::task::spawn_blocking(move || {
            let mut batch = Vec::with_capacity(results.len() + 1);
            batch.push(reply);
            batch.extend(results);
            let view = LineageStore::new(store, thread_id.clone(), lineage);
            let env = PolicyEnv::new(&view, &thread_id, &*counter);
            let outcome = policy.apply(batch, &env);
            for f in &outcome.failures {
                tracing::warn!(error = %f.error, "offloading a large tool result failed; kept in full");
            }
            let offloads = outcome
                .stored
                .iter()
                .filter_map(|s| match &s.what {
                    StoredWhat::ToolResult {
                        tool_call_id,
                        tokens,
                        ..
                    } => Some((tool_call_id.clone(), s.path.to_string(), *tokens as u64)),
                    _ => None,
                })
                .collect::<Vec<_>>();
            let mut messages: Vec<Message> = outcome.messages.into_iter().skip(1).collect();
            if minify {
                keel_offload::minify_json_results(&mut messages);
            }
            (messages, offloads, Some(view.lineage()))
        });
        match job.await {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(error = %e, "the offload policy did not finish; results kept in full");
                (fallback, Vec::new(), None)
            }
        }
    }

    async fn run_compact(&self, s: Arc<AgentState>, ctx: NodeContext) -> NodeResult {
        self.compaction_step(COMPACT, s, ctx).await
    }

    async fn run_epoch(&self, s: Arc<AgentState>, ctx: NodeContext) -> NodeResult {
        self.compaction_step(EPOCH, s, ctx).await
    }

    /// The `compact` (a milestone) or `epoch` (a fold) step, in its tracing span.
    async fn compaction_step(
        &self,
        node: &'static str,
        s: Arc<AgentState>,
        ctx: NodeContext,
    ) -> NodeResult {
        let thread = thread_of(&ctx);
        // At WARN level, so a subscriber that shows only warnings still has it, and
        // every warning of the node says which thread and step it is about.
        let span = tracing::warn_span!(
            "keel.agent",
            node,
            thread = %thread,
            step = s.step,
            tokens_before = tracing::field::Empty,
            tokens_after = tracing::field::Empty,
            prompt_version = tracing::field::Empty,
        );
        async move {
            let mut c = context(&s)?;
            let compactor = self.compactor(&thread)?;
            let specs = self.parts.tools.specs();
            let compaction = async {
                if node == EPOCH {
                    let trigger = s.compactions.back().map_or(Trigger::Steps, |e| e.trigger);
                    compactor.fold_epoch(&mut c, trigger, specs).await
                } else {
                    let trigger = match compactor.check(&mut c, specs) {
                        Some(Trigger::StepCeiling) | None => Trigger::Force,
                        Some(t) => t,
                    };
                    compactor.compact(&mut c, trigger, specs).await
                }
            };
            // The prune the thread's last compaction step started (finished by now, as
            // a rule): what only the checkpoints it removed saw is removed below, once
            // this step's compaction succeeded.
            let mut pruned = None;
            let result = match self.prune_key(&ctx) {
                Some((k, cp, keep)) => {
                    if self.parts.prunes.wait(&k.thread_id, Some(&k.ns)).await {
                        pruned = Some(k.clone());
                    }
                    if node == EPOCH && milestone_pruned_this_step(&s) {
                        // The milestone step just before pruned: a prune now would
                        // remove that step's predecessor alone. The next compaction
                        // step prunes.
                        compaction.await
                    } else if ctx.durability() == Durability::Sync || !cp.is_durable() {
                        // The prune goes to the saver while the summary is written: it
                        // only removes stored checkpoints, none of which this step or
                        // the next ones read. The step running now is not stored yet,
                        // so the newest `keep` stored include the one it continues from.
                        // Each step waits for its writes, and this one for its prune:
                        // the next step's write would wait for the prune anyway. An
                        // in-memory saver's prune is work under its lock, done at once.
                        let (result, done) =
                            futures::future::join(compaction, prune(cp, k.clone(), keep)).await;
                        if done {
                            pruned = Some(k);
                        }
                        result
                    } else {
                        // Steps do not wait for their writes, nor for this prune (which
                        // the saver may queue behind them).
                        self.parts.prunes.start(cp, k, keep);
                        compaction.await
                    }
                }
                None => compaction.await,
            };
            self.finish(&s, c, result, pruned).await
        }
        .instrument(span)
        .await
    }

    /// Waits for the checkpoint prune the thread's last compaction step started in the
    /// background, then removes the offloaded files only the pruned checkpoints saw.
    /// [`crate::Agent`]'s runs call it as they end, so a finished run's thread holds
    /// the newest [`keep_checkpoints`](crate::AgentBuilder::keep_checkpoints)
    /// checkpoints its last compaction step found stored, and those written since. The
    /// prune does not wait for writes still queued in the run's background writer: the
    /// checkpoints of the few steps before that compaction step whose writes reached
    /// the saver after it stay as well, until the thread's next compaction step. A
    /// graph of your own that reuses the compaction nodes can call it after a run;
    /// otherwise the thread's next compaction step does it. Returns what was removed
    /// from the offload store.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::Agent;
    /// use keel_model::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(async {
    /// let agent = Agent::builder()
    ///     .model(Arc::new(ScriptedModel::from_texts(["Done."])))
    ///     .goal("Say done.")
    ///     .build()?;
    /// // Nothing was started for this thread: nothing to wait for or remove.
    /// let removed = agent.nodes().settle("t").await?;
    /// assert_eq!(removed.files, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn settle(&self, thread_id: &str) -> Result<Collected, CleanupError> {
        if !self.parts.prunes.wait(thread_id, None).await {
            return Ok(Collected::default());
        }
        let Some(cp) = self.parts.checkpointer.as_ref() else {
            return Ok(Collected::default());
        };
        let key = ThreadKey::new(thread_id.to_owned());
        collect_after_prune(&self.parts, cp.as_ref(), &key, None).await
    }

    /// Turns a compaction's outcome into the state update; after a successful one, when
    /// a prune finished (`pruned`: the thread's key; this step's, or with a prune in the
    /// background the last one's), removes what only pruned checkpoints saw.
    async fn finish(
        &self,
        s: &AgentState,
        mut c: ContextState,
        result: Result<keel_compaction::CompactionEvent, CompactionError>,
        pruned: Option<ThreadKey>,
    ) -> NodeResult {
        let mut update = match &result {
            Ok(_) => diff(s, &c),
            // Nothing changed (invariant 4); only the failed event is recorded.
            Err(_) => AgentStateUpdate::default(),
        };
        let events: Vec<_> = std::mem::take(&mut c.events);
        if let Ok(e) = &result {
            let span = tracing::Span::current();
            span.record("tokens_before", e.tokens_before);
            span.record("tokens_after", e.tokens_after);
            span.record("prompt_version", e.prompt_version.as_str());
        }
        if !events.is_empty() {
            update.events = Some(events.iter().cloned().map(AgentEvent::Compaction).collect());
            update.compactions = Some(events);
        }
        if let Err(e) = &result {
            let failures = s.failed_in_a_row().saturating_add(1);
            if failures >= MAX_FAILED_COMPACTIONS {
                tracing::warn!(failures, error = %e, "compactions keep failing; the run stops");
                update.stop = Some(Some(Stop::CompactionFailing {
                    failures,
                    error: e.to_string(),
                }));
            }
        }
        if let (Ok(_), Some(key)) = (&result, pruned) {
            self.collect_after_compaction(&key, &c.lineage).await;
        }
        Ok(update)
    }

    /// What a compaction step prunes: the thread's key, the checkpointer and how many
    /// checkpoints to keep (none without a checkpointer, a thread, or
    /// `keep_checkpoints`).
    fn prune_key(&self, ctx: &NodeContext) -> Option<(ThreadKey, Arc<dyn Checkpointer>, usize)> {
        let (Some(keep), Some(cp), Some(thread)) = (
            self.parts.keep_checkpoints,
            self.parts.checkpointer.as_ref(),
            ctx.thread_id(),
        ) else {
            return None;
        };
        let key = ThreadKey::new(thread.to_owned()).with_ns(ctx.checkpoint_ns().to_owned());
        Some((key, Arc::clone(cp), keep.max(1)))
    }

    /// After a prune and a successful compaction: removes the offloaded files only
    /// pruned checkpoints saw (`running`: the lineage this step will store).
    async fn collect_after_compaction(&self, key: &ThreadKey, running: &Lineage) {
        let Some(cp) = self.parts.checkpointer.as_ref() else {
            return;
        };
        match collect_after_prune(&self.parts, cp.as_ref(), key, Some(running)).await {
            Ok(c) if c.files > 0 || c.bytes > 0 => tracing::debug!(
                files = c.files,
                bytes = c.bytes,
                "removed offloaded files only pruned checkpoints saw"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "removing what pruned checkpoints saw failed"),
        }
    }
}

/// The lineage a stored checkpoint of an agent thread has (unscoped when the thread was
/// stored before lineages, or its channel was never written).
pub(crate) fn lineage_of(tuple: &CheckpointTuple) -> Result<Lineage, serde_json::Error> {
    let Some(chain) = tuple.channels.get("lineage") else {
        return Ok(Lineage::unscoped());
    };
    match chain.updates().last().or(chain.snapshot.as_ref()) {
        Some(v) => serde_json::from_value(v.clone()),
        None => Ok(Lineage::unscoped()),
    }
}

/// After `key` was pruned: removes from the offload store what no checkpoint left (nor
/// `running`, a step not stored yet) sees. When the newest lineage sees everything the
/// store holds of the thread (a thread never forked: a few size queries), nothing is
/// loaded; otherwise the lineage of every checkpoint left is read. Only the root
/// namespace is an agent's.
pub(crate) async fn collect_after_prune(
    parts: &Parts,
    cp: &dyn Checkpointer,
    key: &ThreadKey,
    running: Option<&Lineage>,
) -> Result<Collected, CleanupError> {
    if !key.ns.is_empty() {
        return Ok(Collected::default());
    }
    let thread = ThreadId::new(key.thread_id.as_str())?;
    let newest = match running {
        Some(l) => Some(l.clone()),
        None => match cp.get(key, None).await? {
            Some(t) => Some(lineage_of(&t)?),
            None => None,
        },
    };
    let store = parts.store.clone();
    if let Some(l) = newest.clone() {
        let (store, thread) = (store.clone(), thread.clone());
        if tokio::task::spawn_blocking(move || l.sees_all(&*store, &thread)).await?? {
            return Ok(Collected::default());
        }
    }
    let mut live: Vec<Lineage> = running.into_iter().cloned().collect();
    let ids: Vec<_> = {
        use futures::StreamExt;
        cp.list(key, ListOptions::default())
            .map(|s| s.map(|s| s.checkpoint.id))
            .collect::<Vec<_>>()
            .await
    };
    for id in ids {
        // Pruned by someone else since it was listed: it sees nothing any more.
        if let Some(t) = cp.get(key, Some(&id?)).await? {
            live.push(lineage_of(&t)?);
        }
    }
    Ok(tokio::task::spawn_blocking(move || collect_garbage(&*store, &thread, &live)).await??)
}

/// A context overflow found before sending: the counted prompt is over the model's
/// input budget, its window less what is kept free for the reply (`max_tokens`), so
/// prompt and reply fit the window together as the servers that check it (OpenAI,
/// vLLM) require. The agent then compacts and retries once, as for a provider's
/// overflow; an approximate count can refuse a prompt that would have fit, which costs
/// a compaction, where sending it could cost a refusal or (Ollama) a prompt cut
/// silently.
/// `budget`: the compactor's ([`Compactor::budget`]), the profile's input budget in
/// keel's counts (scaled when they are calibrated).
fn over_budget(profile: &ModelProfile, budget: usize, prompt_tokens: u64) -> Option<ModelError> {
    let budget = budget as u64;
    let scaled = if budget == profile.input_budget() as u64 {
        String::new()
    } else {
        format!(
            ": {} as the provider counts, {budget} in keel's estimate calibrated to its counts",
            profile.input_budget()
        )
    };
    (prompt_tokens > budget).then(|| ModelError::ContextOverflow {
        message: format!(
            "the prompt counts {prompt_tokens} tokens, over the input budget of {budget} \
             (the model's {}-token window less {} kept for the reply{scaled}){NOT_SENT}",
            profile.context_window,
            profile.reserved_output()
        ),
    })
}

/// How the agent's own refusal of a prompt over the input budget ends.
const NOT_SENT: &str = "; it was not sent";

/// Whether `error` is the agent's own refusal of a prompt counted over the input
/// budget, which it did not send, rather than a provider's answer that the prompt does
/// not fit: the advice differs (the provider's window may be smaller than the
/// profile's; the agent's refusal means the prompt could not be made to fit the
/// profile's window).
///
/// ```
/// use keel_agent::refused_before_sending;
/// use keel_model::ModelError;
///
/// let provider = ModelError::ContextOverflow { message: "maximum context length is 2048 tokens".into() };
/// assert!(!refused_before_sending(&provider));
/// ```
pub fn refused_before_sending(error: &ModelError) -> bool {
    matches!(error, ModelError::ContextOverflow { message } if message.ends_with(NOT_SENT))
}

fn context(s: &AgentState) -> Result<ContextState, NodeError> {
    s.context().ok_or_else(no_goal)
}

fn no_goal() -> NodeError {
    NodeError::msg(
        "the thread has no goal: write one in its first run's input \
         (`AgentStateUpdate::default().goal(..)`); the builder's `.goal(..)` is for `Agent` runs",
    )
}

/// What the prompt says for a tool call the thread holds no result for.
pub(crate) const NO_RESULT: &str = "No result: this call was not run (the thread went on without running it). Call it again if it is still needed.";

/// Gives every tool call of `prompt` a result: a call with none before the next
/// message that is not a tool result (a graph of one's own that went on without
/// running it, a `tools` node replaced by one that does not answer) gets [`NO_RESULT`]
/// in the prompt, as the providers refuse a prompt with a call left unanswered. The
/// state is not changed: the same thread gives the same prompt.
fn answer_unanswered_calls(prompt: Vec<Message>) -> Vec<Message> {
    // Where results are missing: before which message, and for which calls.
    let mut missing: Vec<(usize, Vec<String>)> = Vec::new();
    let mut pending: Vec<&str> = Vec::new();
    for (i, m) in prompt.iter().enumerate() {
        match (m.role, m.tool_call_id.as_deref()) {
            (Role::Tool, Some(id)) => pending.retain(|p| *p != id),
            (Role::Tool, None) => {}
            _ if !pending.is_empty() => {
                missing.push((i, pending.drain(..).map(str::to_owned).collect()));
            }
            _ => {}
        }
        if !m.tool_calls.is_empty() {
            pending = m.tool_calls.iter().map(|c| c.id.as_str()).collect();
        }
    }
    if !pending.is_empty() {
        missing.push((
            prompt.len(),
            pending.into_iter().map(str::to_owned).collect(),
        ));
    }
    if missing.is_empty() {
        return prompt;
    }
    let mut out = Vec::with_capacity(prompt.len() + missing.len());
    let mut missing = missing.into_iter().peekable();
    for (i, m) in prompt.into_iter().enumerate() {
        while let Some((_, ids)) = missing.next_if(|(at, _)| *at == i) {
            out.extend(ids.into_iter().map(|id| Message::tool(id, NO_RESULT)));
        }
        out.push(m);
    }
    for (_, ids) in missing {
        out.extend(ids.into_iter().map(|id| Message::tool(id, NO_RESULT)));
    }
    out
}

/// The most of a tool's error an [`AgentEvent::ToolCall`] keeps (its tool message keeps
/// it whole).
pub(crate) const MAX_EVENT_ERROR_CHARS: usize = 1_000;

/// Words that approve a call, and words that deny it (compared trimmed, in lower case).
const YES: [&str; 5] = ["y", "yes", "approve", "approved", "ok"];
const NO: [&str; 5] = ["n", "no", "deny", "denied", "reject"];

/// Gives every call of one reply an id of its own: an empty id becomes
/// `call-<step>-<index>`, and an id an earlier call of the reply has becomes
/// `<id>-<index>`. A tool's result is matched to its call by id, an approval answer
/// names calls by id, and tools use it as an idempotency key: two calls of one reply
/// sharing one (some servers and hand-written models send `""` or repeat one) would be
/// taken for one call.
fn unique_call_ids(calls: &mut [ToolCall], step: u64) {
    // The usual reply: one call with an id of its own.
    if let [only] = calls {
        if only.id.trim().is_empty() {
            only.id = format!("call-{step}-0");
        }
        return;
    }
    let mut seen = HashSet::with_capacity(calls.len());
    for (i, c) in calls.iter_mut().enumerate() {
        if c.id.trim().is_empty() {
            c.id = format!("call-{step}-{i}");
        }
        while !seen.insert(c.id.clone()) {
            c.id = format!("{}-{i}", c.id);
        }
    }
}

/// What an approval answer says of one call.
enum Decision {
    Yes,
    /// No, with the reason given, if any.
    No(Option<String>),
}

/// A yes or no on its own: a bool or a word of [`YES`] or [`NO`].
fn yes_or_no(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => {
            let s = s.trim().to_ascii_lowercase();
            if YES.contains(&s.as_str()) {
                Some(true)
            } else if NO.contains(&s.as_str()) {
                Some(false)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// `{"approved": <yes or no>, "reason": "..."}` (the reason optional): a decision with
/// a reason the model is told.
fn with_reason(v: &Value) -> Option<Decision> {
    let m = v.as_object()?;
    let yes = yes_or_no(m.get("approved")?)?;
    let reason = match m.get("reason") {
        None | Some(Value::Null) => None,
        Some(Value::String(r)) => Some(r.trim().to_owned()).filter(|r| !r.is_empty()),
        Some(_) => return None,
    };
    if m.keys().any(|k| k != "approved" && k != "reason") {
        return None;
    }
    Some(if yes {
        Decision::Yes
    } else {
        Decision::No(reason)
    })
}

/// One call's decision: the answer for every call, its entry in a map of call ids,
/// or whether a list of approved ids holds it. Only for answers [`understood`].
fn decision(answer: &Value, id: &str) -> Decision {
    let of = |v: &Value| match yes_or_no(v) {
        Some(true) => Decision::Yes,
        Some(false) => Decision::No(None),
        None => with_reason(v).unwrap_or(Decision::No(None)),
    };
    match answer {
        Value::Object(m) if !m.contains_key(id) && with_reason(answer).is_some() => of(answer),
        Value::Object(m) => m.get(id).map_or(Decision::No(None), of),
        Value::Array(ids) if ids.iter().any(|v| v.as_str() == Some(id)) => Decision::Yes,
        Value::Array(_) => Decision::No(None),
        other => of(other),
    }
}

/// Whether `answer` is an approval answer for the calls `ids`: a yes or no (a bool, a
/// word, or `{"approved": .., "reason": ..}`) for every call, a map of every call id
/// to one, or a list of approved call ids (each one of `ids`).
fn understood(answer: &Value, ids: &BTreeSet<&str>) -> bool {
    let one = |v: &Value| yes_or_no(v).is_some() || with_reason(v).is_some();
    match answer {
        Value::Object(m) if m.keys().all(|k| !ids.contains(k.as_str())) => one(answer),
        Value::Object(m) => {
            m.len() == ids.len() && m.iter().all(|(k, v)| ids.contains(k.as_str()) && one(v))
        }
        Value::Array(list) => list
            .iter()
            .all(|v| v.as_str().is_some_and(|id| ids.contains(id))),
        other => one(other),
    }
}

/// The update that turns `before` into the compaction engine's `after`: the flushed
/// messages removed, rewritten ones (masked, truncated) replaced in place, new
/// milestones pushed (or all replaced after an epoch), and the changed counters.
pub(crate) fn diff(before: &AgentState, after: &ContextState) -> AgentStateUpdate {
    let mut u = AgentStateUpdate::default();
    let kept: HashMap<&str, &Message> = after
        .raw
        .iter()
        .filter_map(|m| m.id.as_deref().map(|id| (id, m)))
        .collect();
    let mut ops = Vec::new();
    for m in before.messages.iter() {
        if let Some(id) = m.id.as_deref()
            && !kept.contains_key(id)
        {
            ops.push(MessageOp::Remove(id.to_owned()));
        }
    }
    for m in &after.raw {
        let same =
            m.id.as_deref()
                .and_then(|id| before.messages.get(id))
                .is_some_and(|old| old == m);
        if !same {
            ops.push(MessageOp::Upsert(m.clone()));
        }
    }
    if !ops.is_empty() {
        u.messages = Some(AddMessagesUpdate::from_ops(ops));
    }
    let old = &before.milestones;
    if after.milestones.len() >= old.len()
        && after.milestones.get(..old.len()) == Some(old.as_slice())
    {
        let pushed: Vec<MilestoneOp> = after
            .milestones
            .iter()
            .skip(old.len())
            .map(|l| MilestoneOp::Push(Box::new(l.clone())))
            .collect();
        if !pushed.is_empty() {
            u.milestones = Some(pushed);
        }
    } else {
        let mut all = vec![MilestoneOp::Clear];
        all.extend(
            after
                .milestones
                .iter()
                .map(|l| MilestoneOp::Push(Box::new(l.clone()))),
        );
        u.milestones = Some(all);
    }
    if after.epoch != before.epoch {
        u.epoch = Some(after.epoch.clone());
    }
    if after.epochs != before.epochs {
        u.epochs = Some(after.epochs.clone());
    }
    if after.step_at_compaction != before.step_at_compaction {
        u.step_at_compaction = Some(after.step_at_compaction);
    }
    if after.masked_turns != before.masked_turns {
        u.masked_turns = Some(after.masked_turns);
    }
    if after.milestones_made != before.milestones_made {
        u.milestones_made = Some(after.milestones_made);
    }
    if after.epochs_made != before.epochs_made {
        u.epochs_made = Some(after.epochs_made);
    }
    if after.lineage != before.lineage {
        u.lineage = Some(after.lineage.clone());
    }
    u
}

/// A message's text when its content is plain text (only that is minified).
fn plain_text(m: &Message) -> &str {
    match &m.content {
        keel_message::Content::Text(text) => text,
        _ => "",
    }
}

/// `results` with their JSON minified ([`keel_offload::minify_json_results`]) when
/// `on`: inline for a few kilobytes; beyond that the candidates' texts (at most
/// [`keel_offload::MAX_MINIFY_BYTES`] each) are copied to the blocking pool, so a large
/// result never holds up the runtime and a failed task leaves the results as they came.
async fn minified(mut results: Vec<Message>, on: bool) -> Vec<Message> {
    const INLINE_BYTES: usize = 64 * 1024;
    if !on {
        return results;
    }
    let candidates: Vec<usize> = (0..results.len())
        .filter(|&i| {
            let m = &results[i];
            let text = plain_text(m);
            m.role == Role::Tool
                && text.len() <= keel_offload::MAX_MINIFY_BYTES
                && text.trim_start().starts_with(['{', '['])
        })
        .collect();
    let bytes: usize = candidates
        .iter()
        .map(|&i| plain_text(&results[i]).len())
        .sum();
    if bytes <= INLINE_BYTES {
        keel_offload::minify_json_results(&mut results);
        return results;
    }
    let texts: Vec<Message> = candidates.iter().map(|&i| results[i].clone()).collect();
    let done = tokio::task::spawn_blocking(move || {
        let mut texts = texts;
        keel_offload::minify_json_results(&mut texts);
        texts
    })
    .await;
    match done {
        Ok(minified) => {
            for (i, m) in candidates.into_iter().zip(minified) {
                results[i] = m;
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "minifying JSON results did not finish; kept as they came")
        }
    }
    results
}

/// The outcome of a call that was not run: `text` is its tool message.
fn not_run(
    c: &ToolCall,
    text: String,
    error: String,
    failure: crate::ToolFailure,
) -> crate::tools::ToolOutcome {
    let mut m = Message::tool(c.id.clone(), text);
    m.name = Some(c.name.clone());
    crate::tools::ToolOutcome {
        message: m,
        error: Some(error),
        failure: Some(failure),
        result_chars: 0,
        duration: std::time::Duration::ZERO,
    }
}

/// How many replies in a row before the newest (back to the last message a person
/// wrote) called `call`'s tool with the same arguments: read from the replies in the
/// context, then, when they all did and a milestone took the ones before them, from
/// the event log's tool calls of the steps before.
fn repeated_in_a_row(s: &AgentState, call: &ToolCall) -> usize {
    // One notion of "the same call" for both: the fingerprint the event log records.
    let fingerprint = crate::call_fingerprint(call);
    let same = |c: &ToolCall| c.name == call.name && crate::call_fingerprint(c) == fingerprint;
    let mut n = 0u64;
    for m in s.messages.iter().rev().skip(1) {
        match m.role {
            Role::Assistant if m.tool_calls.iter().any(same) => n += 1,
            Role::Assistant => return n as usize,
            Role::User if !m.metadata.contains_key(NUDGE_METADATA_KEY) => return n as usize,
            _ => {}
        }
    }
    // The context holds no earlier reply: the steps before the ones counted are in
    // the event log, if it goes back that far.
    while let Some(step) = s.step.checked_sub(n + 1).filter(|&t| t > 0) {
        let repeated = s.events.iter().any(|e| {
            matches!(e, AgentEvent::ToolCall { step: t, fingerprint: f, .. }
                if *t == step && *f == fingerprint)
        });
        if !repeated {
            break;
        }
        n += 1;
    }
    n as usize
}

#[cfg(test)]
mod tests {
    use keel_message::{Message, Role, ToolCall};
    use serde_json::json;

    use super::{NO_RESULT, answer_unanswered_calls};

    fn calls(ids: &[&str]) -> Message {
        Message::assistant("").with_tool_calls(
            ids.iter()
                .map(|id| ToolCall::new(*id, "ls", json!({})))
                .collect(),
        )
    }

    #[test]
    fn a_call_left_without_a_result_mid_prompt_is_answered_before_what_follows() {
        let prompt = vec![
            Message::user("go"),
            calls(&["a", "b"]),
            Message::tool("b", "b's result"),
            Message::user("and now?"),
            calls(&["c"]),
            Message::tool("c", "c's result"),
        ];
        let out = answer_unanswered_calls(prompt.clone());
        let shape: Vec<(Role, Option<&str>)> = out
            .iter()
            .map(|m| (m.role, m.tool_call_id.as_deref()))
            .collect();
        assert_eq!(
            shape,
            [
                (Role::User, None),
                (Role::Assistant, None),
                (Role::Tool, Some("b")),
                (Role::Tool, Some("a")),
                (Role::User, None),
                (Role::Assistant, None),
                (Role::Tool, Some("c")),
            ]
        );
        assert_eq!(out[3].text(), NO_RESULT);
        // A prompt with every call answered is given back as it was.
        let whole: Vec<Message> = prompt
            .into_iter()
            .filter(|m| m.role != Role::User)
            .collect();
        let mut answered = whole.clone();
        answered.insert(2, Message::tool("a", "a's result"));
        assert_eq!(answer_unanswered_calls(answered.clone()), answered);
    }
}
