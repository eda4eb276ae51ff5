//! Scoring prompts against the full history: one scorer for keel's replay and for the
//! prompts of any other context manager.

use std::collections::HashSet;
use std::convert::Infallible;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use keel_message::{Message, Role};
use keel_token::TokenCounter;

use super::facts::{contains_token, is_told, needed_facts, searchable};
use super::load::{Trajectory, goal_index};
use super::run::{FactCheck, RunReport, TurnRecord};
use crate::event::{CompactionEvent, EventKind, Trigger};

/// Why a list of prompts could not be scored against a trajectory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScoreError {
    /// There must be one prompt per recorded model call.
    #[error("run {run}: {prompts} prompts for {turns} recorded model calls")]
    TurnCount {
        /// The run.
        run: String,
        /// Prompts given.
        prompts: usize,
        /// Assistant turns the trajectory records.
        turns: usize,
    },
}

/// Scores the prompts an external context manager sent for a recorded run: one prompt
/// per recorded model call, in order (`prompts[k]` is what the model saw before the
/// trajectory's `k`-th assistant message).
///
/// Each turn is measured exactly as [`super::replay_trajectory`] measures keel's
/// prompts, by the same code: input tokens against the full history, the leading
/// messages shared with the previous prompt (what a provider's prompt cache reuses;
/// [`super::Report`] weighs them at [`super::CACHED_TOKEN_PRICE`]), whether the
/// previous prompt is a prefix of this one, whether the goal is there byte for byte,
/// and needed-fact recall ([`super::needed_facts`]). Facts are checked from the first
/// turn whose prompt lacks a user or tool message of the history (by role and text):
/// the first turn at which the manager dropped, summarized, masked or offloaded
/// something the agent was told. Before it every needed fact is in the prompt by
/// construction. There is no archive to search, so `in_archive` is always false, and
/// there are no needles or events; add the manager's summarizer calls with
/// [`external_summary_event`].
///
/// ```
/// use std::sync::Arc;
/// use keel_compaction::replay::{Report, Trajectory, score_prompts};
/// use keel_compaction::message::Message;
/// use keel_compaction::token::{ApproxCounter, TokenCounter};
///
/// let messages = vec![
///     Message::system("You are a travel agent."),
///     Message::user("Cancel my booking, please."),
///     Message::assistant("Your reservation code?"),
///     Message::user("It is OI5L9G."),
///     Message::assistant("Cancelling OI5L9G now."),
/// ];
/// let run = Trajectory::new("hand-made", "r1", messages)?;
/// let messages = &run.messages;
/// // A manager that dropped the second user message before the second call.
/// let prompts = vec![messages[..2].to_vec(), messages[..3].to_vec()];
/// let counter: Arc<dyn TokenCounter> = Arc::new(ApproxCounter::default());
/// let scored = score_prompts(&run, &prompts, counter).unwrap();
/// assert_eq!(scored.turns.len(), 2);
/// assert!(scored.turns[1].tokens < scored.turns[1].full_tokens);
/// assert!(scored.turns[1].extends_previous);
/// // The reply passes on OI5L9G, which the prompt no longer held.
/// assert_eq!(scored.recall(), 0.0);
/// let report = Report::from_runs("hand-made", "drop", 8_000, &[scored]);
/// assert_eq!((report.recall_turns, report.needed_facts, report.facts_in_prompt), (1, 1, 0));
///
/// // One prompt per recorded model call, or a typed error.
/// assert!(score_prompts(&run, &prompts[..1], Arc::new(ApproxCounter::default())).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn score_prompts(
    trajectory: &Trajectory,
    prompts: &[Vec<Message>],
    counter: Arc<dyn TokenCounter>,
) -> Result<RunReport, ScoreError> {
    let calls: Vec<usize> = trajectory
        .messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::Assistant)
        .map(|(i, _)| i)
        .collect();
    if calls.len() != prompts.len() {
        return Err(ScoreError::TurnCount {
            run: trajectory.id.clone(),
            prompts: prompts.len(),
            turns: calls.len(),
        });
    }
    let mut scorer = Scorer::new(&trajectory.messages, counter);
    for (&at, prompt) in calls.iter().zip(prompts) {
        // No archive: a fact is in the prompt or missing.
        let scored: Result<(), Infallible> = scorer.turn(at, prompt, &mut |_| Ok(false));
        if let Err(never) = scored {
            match never {}
        }
    }
    let (turns, facts) = scorer.finish();
    Ok(RunReport {
        dataset: trajectory.dataset.clone(),
        id: trajectory.id.clone(),
        turns,
        events: Vec::new(),
        needles: Vec::new(),
        facts,
        prompts: Vec::new(),
    })
}

/// A compaction event for a call an external context manager made to its own
/// summarizer before model call `turn` (0-based), so that [`super::Report`] counts it
/// as a compaction and its cost the way it counts keel's summarizer calls: `prompt`'s
/// tokens at full price (nothing of it cached) and `summary`'s at
/// [`super::OUTPUT_TOKEN_PRICE`]. `archived` is the number of messages the summary
/// replaced.
///
/// ```
/// use keel_compaction::replay::external_summary_event;
/// use keel_compaction::message::Message;
/// use keel_compaction::token::{ApproxCounter, TokenCounter};
///
/// let prompt = [Message::user("Summarize: the user wants to cancel OI5L9G.")];
/// let event = external_summary_event(3, &prompt, "Cancel OI5L9G.", 4, "peer", &ApproxCounter::default());
/// assert_eq!(event.step, 3);
/// assert_eq!(event.summary_input_tokens as usize, ApproxCounter::default().count_messages(&prompt));
/// assert!(event.error.is_none());
/// ```
pub fn external_summary_event(
    turn: usize,
    prompt: &[Message],
    summary: &str,
    archived: usize,
    summarizer: &str,
    counter: &dyn TokenCounter,
) -> CompactionEvent {
    let input = counter.count_messages(prompt);
    let output = counter.count_text(summary);
    CompactionEvent {
        step: turn as u64,
        trigger: Trigger::Tokens,
        kind: EventKind::Milestone,
        tokens_before: input,
        tokens_after: output,
        messages_archived: archived,
        prompt_version: "external".into(),
        summarizer_model: summarizer.to_owned(),
        fallback: false,
        duration_ms: 0,
        error: None,
        summary_input_tokens: input as u64,
        summary_cached_tokens: 0,
        summary_output_tokens: output as u64,
        budget: 0,
    }
}

/// Walks a trajectory's messages alongside the prompts some context manager sent and
/// measures each prompt against the full history ([`score_prompts`] and
/// [`super::replay_trajectory`] both use it).
pub(crate) struct Scorer<'a> {
    messages: &'a [Message],
    counter: Arc<dyn TokenCounter>,
    system_at: Option<usize>,
    goal_at: Option<usize>,
    /// The system prompt and the goal: what every prompt carries.
    known: String,
    /// What the agent was told so far (user and tool messages but the goal).
    told: String,
    /// The same messages by role and a hash of their text.
    told_messages: Vec<(Role, u64)>,
    /// Messages of `messages` taken into the full history so far.
    cursor: usize,
    priming: usize,
    full_running: usize,
    full_previous: usize,
    previous: Vec<Message>,
    previous_counts: Vec<usize>,
    /// A prompt has lacked a told message: facts are checked from then on.
    checking: bool,
    turns: Vec<TurnRecord>,
    facts: Vec<FactCheck>,
}

impl<'a> Scorer<'a> {
    pub(crate) fn new(messages: &'a [Message], counter: Arc<dyn TokenCounter>) -> Self {
        let system_at = messages.iter().position(|m| m.role == Role::System);
        let goal_at = goal_index(messages);
        let mut known = String::new();
        for at in [system_at, goal_at].into_iter().flatten() {
            searchable(&messages[at], &mut known);
        }
        let priming = counter.count_messages(&[]);
        Scorer {
            messages,
            counter,
            system_at,
            goal_at,
            known,
            told: String::new(),
            told_messages: Vec::new(),
            cursor: 0,
            priming,
            full_running: priming,
            full_previous: 0,
            previous: Vec::new(),
            previous_counts: Vec::new(),
            checking: false,
            turns: Vec::new(),
            facts: Vec::new(),
        }
    }

    /// Scores `prompt`, sent for the recorded reply `messages[at]` (an assistant
    /// message after every one scored before). `in_archive` says whether a fact
    /// missing from the prompt can be read back from the manager's archive.
    pub(crate) fn turn<E>(
        &mut self,
        at: usize,
        prompt: &[Message],
        in_archive: &mut dyn FnMut(&str) -> Result<bool, E>,
    ) -> Result<(), E> {
        let messages = self.messages;
        let upto = at.min(messages.len());
        for (i, m) in messages.iter().enumerate().take(upto).skip(self.cursor) {
            self.full_running += self.counter.count_message(m);
            if is_told(m) && Some(i) != self.system_at && Some(i) != self.goal_at {
                searchable(m, &mut self.told);
                self.told_messages.push((m.role, text_hash(m)));
            }
        }
        self.cursor = self.cursor.max(upto);

        let common = prompt
            .iter()
            .zip(&self.previous)
            .take_while(|(a, b)| a == b)
            .count();
        // The shared prefix keeps the previous prompt's counts; only new messages are
        // counted.
        let counts: Vec<usize> = prompt
            .iter()
            .enumerate()
            .map(|(k, m)| match self.previous_counts.get(k) {
                Some(&n) if k < common => n,
                _ => self.counter.count_message(m),
            })
            .collect();
        let tokens = self.priming + counts.iter().sum::<usize>();
        let shared_prefix = counts[..common].iter().sum();

        if !self.checking {
            let held: HashSet<(Role, u64)> =
                prompt.iter().map(|m| (m.role, text_hash(m))).collect();
            self.checking = self.told_messages.iter().any(|t| !held.contains(t));
        }
        let turn = self.turns.len();
        let (mut needed, mut in_prompt, mut archived) = (0, 0, 0);
        if self.checking
            && let Some(reply) = messages.get(at)
        {
            let facts = needed_facts(reply, &self.told, &self.known);
            if !facts.is_empty() {
                let mut text = String::new();
                for m in prompt {
                    searchable(m, &mut text);
                }
                for fact in facts {
                    let here = contains_token(&text, &fact);
                    let there = !here && in_archive(&fact)?;
                    needed += 1;
                    in_prompt += usize::from(here);
                    archived += usize::from(there);
                    self.facts.push(FactCheck {
                        turn,
                        fact,
                        in_prompt: here,
                        in_archive: there,
                    });
                }
            }
        }
        let goal = self.goal_at.and_then(|g| messages.get(g));
        self.turns.push(TurnRecord {
            full_tokens: self.full_running,
            tokens,
            shared_prefix,
            full_shared_prefix: self.full_previous,
            extends_previous: !self.previous.is_empty() && common == self.previous.len(),
            goal_intact: goal.is_some_and(|g| {
                let text = g.text();
                prompt
                    .iter()
                    .any(|m| m.role == Role::User && m.text() == text)
            }),
            checked: self.checking,
            needed,
            needed_in_prompt: in_prompt,
            needed_in_archive: archived,
        });
        self.previous = prompt.to_vec();
        self.previous_counts = counts;
        self.full_previous = self.full_running - self.priming;
        Ok(())
    }

    pub(crate) fn finish(self) -> (Vec<TurnRecord>, Vec<FactCheck>) {
        (self.turns, self.facts)
    }
}

/// The hash of a message's text, JSON whitespace aside: a result keel minified
/// ([`keel_offload::minify_json`]) still holds everything the agent was told.
fn text_hash(m: &Message) -> u64 {
    let mut h = DefaultHasher::new();
    let text = m.text();
    match keel_offload::minify_json(&text) {
        Some(short) => short.hash(&mut h),
        None => text.hash(&mut h),
    }
    h.finish()
}
