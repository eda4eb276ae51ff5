use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::borrow::Cow;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};
use async_trait::async_trait;
use keel_message::{Message, Role, ToolCall, answered_calls, answered_tool_calls};
use keel_token::{ApproxCounter, TokenCounter};

use crate::summary::{bullet_text, heading_of, parse_bullets, parse_sections};
use crate::{
    ARTIFACTS, Level, NEXT_STEPS, SECTIONS, SESSION_INTENT, SUMMARY, Section, SummarizeError,
    Summarizer, Summary, SummaryRequest,
};

/// The version recorded on extractive summaries.
pub const EXTRACTIVE_VERSION: &str = "extractive-v1";

/// The model name recorded on extractive summaries.
pub const EXTRACTIVE_MODEL: &str = "extractive";

/// The metadata key marking a user message as an observation (a tool's output relayed
/// as a user turn, as SWE-agent does); keel-compaction sets it under the same name.
const OBSERVATION_KEY: &str = "keel.observation";

/// Plain, low-priority lines are added only while the summary is under this share of
/// its budget (percent).
const PLAIN_SHARE_PERCENT: usize = 60;

/// The longest line of a user's ask kept, in characters.
const MAX_ASK_CHARS: usize = 160;

/// How an open error names the call whose output reported it.
const IN_MARK: &str = "[in ";

/// How an error that a later call got past is marked.
const RESOLVED_MARK: &str = "[resolved: ";

/// The longest facts item, in characters.
const MAX_FACTS_CHARS: usize = 720;

/// What a keyword says about its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Error,
    Exit,
    Decision,
    Next,
    Success,
}

impl Kind {
    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// Keywords, matched case-insensitively anywhere in a line.
const KEYWORDS: &[(&str, Kind)] = &[
    ("error", Kind::Error),
    ("exception", Kind::Error),
    ("traceback", Kind::Error),
    ("failed", Kind::Error),
    ("failure", Kind::Error),
    ("fatal", Kind::Error),
    ("panic", Kind::Error),
    ("denied", Kind::Error),
    ("not found", Kind::Error),
    ("no such file", Kind::Error),
    ("cannot ", Kind::Error),
    ("can't ", Kind::Error),
    ("could not", Kind::Error),
    ("couldn't", Kind::Error),
    ("unable to", Kind::Error),
    ("refused", Kind::Error),
    ("rejected", Kind::Error),
    ("timed out", Kind::Error),
    ("timeout", Kind::Error),
    ("unavailable", Kind::Error),
    ("forbidden", Kind::Error),
    ("unauthorized", Kind::Error),
    ("invalid", Kind::Error),
    ("does not exist", Kind::Error),
    ("doesn't exist", Kind::Error),
    ("not enough", Kind::Error),
    ("insufficient", Kind::Error),
    ("exceeded", Kind::Error),
    ("expired", Kind::Error),
    ("declined", Kind::Error),
    ("http 4", Kind::Error),
    ("http 5", Kind::Error),
    ("status 4", Kind::Error),
    ("status 5", Kind::Error),
    ("segmentation fault", Kind::Error),
    ("exit code", Kind::Exit),
    ("exit status", Kind::Exit),
    ("exited with", Kind::Exit),
    ("return code", Kind::Exit),
    ("returncode", Kind::Exit),
    ("decided", Kind::Decision),
    ("decide to", Kind::Decision),
    ("i will ", Kind::Decision),
    ("i'll ", Kind::Decision),
    ("we will ", Kind::Decision),
    ("we'll ", Kind::Decision),
    ("instead", Kind::Decision),
    ("because", Kind::Decision),
    ("root cause", Kind::Decision),
    ("the fix", Kind::Decision),
    ("the issue is", Kind::Decision),
    ("the problem is", Kind::Decision),
    ("must ", Kind::Decision),
    ("never ", Kind::Decision),
    ("constraint", Kind::Decision),
    ("next step", Kind::Next),
    ("next, ", Kind::Next),
    ("todo", Kind::Next),
    ("remaining", Kind::Next),
    ("still need", Kind::Next),
    ("pending", Kind::Next),
    ("passed", Kind::Success),
    ("succeeded", Kind::Success),
    ("successfully", Kind::Success),
    ("fixed", Kind::Success),
    ("resolved", Kind::Success),
    ("confirmed", Kind::Success),
    ("has been ", Kind::Success),
    ("have been ", Kind::Success),
    ("completed", Kind::Success),
];

/// Words of a reason, a choice or a constraint, not only an intention: such lines hold
/// for the rest of the run, and keep a high priority when carried into epochs.
const STRONG_DECISIONS: &[&str] = &[
    "decided",
    "decide to",
    "instead",
    "because",
    "root cause",
    "the fix",
    "the issue is",
    "the problem is",
    "must ",
    "never ",
    "always ",
    "do not ",
    "don't ",
    "constraint",
    "decision",
    "required",
];

/// Words that mark the sentence where an agent says what it does next.
const NEXT_MARKERS: &[&str] = &[
    "next",
    "let's",
    "let me",
    "i will",
    "i'll",
    "we will",
    "we'll",
    "going to",
    "now ",
    "then ",
    "need to",
    "still need",
    "todo",
    "pending",
    "remaining",
    "plan ",
    "waiting",
];

/// Candidate priorities: higher is kept first when the budget is short.
/// What a failed call's artifact item says instead of the names in its error.
const FAILED_MARK: &str = " → failed";

mod prio {
    /// Items below this priority wait for the second selection pass.
    pub const FIRST_PASS: u16 = 70;
    pub const PENDING: u16 = 100;
    pub const FIRST_ASK: u16 = 95;
    pub const NEXT_STATED: u16 = 92;
    pub const LAST_ASK: u16 = 90;
    pub const OPEN_ERROR: u16 = 88;
    pub const FACTS: u16 = 85;
    pub const ERROR: u16 = 80;
    pub const CARRIED_NEXT: u16 = 79;
    pub const CARRIED_ERROR: u16 = 78;
    pub const CARRIED_DURABLE: u16 = 77;
    pub const ACCOMPLISHED: u16 = 75;
    pub const CARRIED_INTENT: u16 = 74;
    pub const RESOLVED_ERROR: u16 = 73;
    pub const FILES: u16 = 72;
    pub const REASON: u16 = 71;
    pub const CARRIED_FACTS: u16 = 70;
    pub const LOG_FACTS: u16 = 68;
    pub const OTHER_ASK: u16 = 66;
    pub const EXIT: u16 = 62;
    pub const COMMAND: u16 = 60;
    pub const NOTE: u16 = 58;
    pub const DECISION: u16 = 55;
    pub const SUCCESS: u16 = 50;
    pub const CARRIED: u16 = 35;
    pub const STALE_NEXT: u16 = 30;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Sec {
    Intent = 0,
    Summary = 1,
    Artifacts = 2,
    Next = 3,
}

/// Where a candidate's text comes from: a slice of a message's text (cut around
/// `focus` when too long), an owned string, or a facts item (a head and the
/// identifiers after it, cut to the room left).
#[derive(Debug, Clone, Copy)]
enum Src {
    Slice {
        msg: u32,
        start: u32,
        end: u32,
        focus: u32,
    },
    Owned(u32),
    Facts(u32),
}

#[derive(Debug, Clone, Copy)]
struct Cand {
    prio: u16,
    sec: Sec,
    /// Position in the input, for output order: message index, then offset.
    order: (u32, u32),
    src: Src,
}

/// A head (`tool(args)`, a command) and the identifiers its output introduced.
#[derive(Debug, Clone, Default)]
struct FactsItem {
    head: String,
    facts: Vec<String>,
}

/// What [`ExtractiveSummarizer::collect`] builds: owned texts, facts items and the
/// candidates pointing into them.
#[derive(Default)]
struct Pool {
    owned: Vec<String>,
    facts: Vec<FactsItem>,
    cands: Vec<Cand>,
}

impl Pool {
    fn owned(&mut self, text: String) -> Src {
        self.owned.push(text);
        Src::Owned((self.owned.len() - 1) as u32)
    }

    fn facts(&mut self, item: FactsItem) -> Src {
        self.facts.push(item);
        Src::Facts((self.facts.len() - 1) as u32)
    }

    fn push(&mut self, prio: u16, sec: Sec, order: (u32, u32), src: Src) {
        self.cands.push(Cand {
            prio,
            sec,
            order,
            src,
        });
    }
}

/// Candidates kept for selection at most (the highest priorities).
const MAX_CANDIDATES: usize = 4096;

/// The embedded, offline summarizer: deterministic, no model, fast.
///
/// It keeps what a milestone is for, verbatim, in the four [`SECTIONS`]:
///
/// * SESSION INTENT: the user's requests (the first lines of each user message that is
///   the user talking: not a tool's output relayed as a user turn, which is flagged
///   `keel.observation` or follows a command the agent ran);
/// * SUMMARY: unresolved errors with their message (a header line such as `ERROR:`
///   takes the line after it; plain failures such as `HTTP 503 …` or `not enough
///   seats` count, a file name containing "error" does not); an error that a later
///   call of the same tool with the same arguments got past (its output reports no
///   error) is kept marked `[resolved: a later tool(args) succeeded]`, below the open
///   ones, and carried into epochs with a low priority; the last open error of a tool
///   output names its call (`… [in tool(args)]`), so an epoch marks it resolved when a
///   later milestone shows that call succeeding; what was accomplished,
///   decisions ("because", "instead", "the fix", ...);
/// * ARTIFACTS: each tool call with the identifiers its result introduced (ids,
///   codes, emails, paths, dates, numbers of three or more digits: `get_order(id=A1)
///   → SKU-9 card_77 price=1299`), the files read and changed (any extension), exit
///   status lines;
/// * NEXT STEPS: tool calls still waiting for their result, and the next step as the
///   agent last stated it ("Let me…", "Next, …", a question it is waiting on).
///
/// Lines of source code and numbered listings (`cat -n`, `12:` prefixes) in tool
/// output are code: they are never taken for errors or prose, however often they say
/// `Error`.
///
/// When the budget is short, higher-priority items win and later ones beat earlier
/// ones. Each section is first limited to a share of the budget (so error lines cannot
/// crowd out the facts), and an item over its section's share is not displaced by
/// lower-priority ones: it keeps first claim on the room left. Facts items are cut to
/// the room they get, and an identifier already kept elsewhere is not repeated. The
/// kept items appear in input order, each once, and an item a summary that stays in
/// the prompt has word for word ([`SummaryRequest::known`]) is left out. The previous summary's items (and, at
/// the epoch level, the items of milestone summaries given as messages) are carried
/// over with lower priority than new facts, except their errors, facts and the latest
/// next steps. System messages are skipped; goal-anchor messages are refused
/// ([`SummarizeError::GoalInInput`]).
///
/// Scanning is one Aho-Corasick pass (ASCII case-insensitive DFA) over each message's
/// text; only lines with a match are looked at further.
///
/// ```
/// use keel_message::{Message, ToolCall};
/// use keel_summarize::{ExtractiveSummarizer, SummaryRequest, ARTIFACTS, SUMMARY};
/// use serde_json::json;
///
/// let steps = [
///     Message::user("The CI is red, please fix it."),
///     Message::assistant("Running the tests.").with_tool_calls(vec![
///         ToolCall::new("c1", "sh", json!({"cmd": "pytest -q"})),
///     ]),
///     Message::tool("c1", "collected 12 items\nFAILED tests/test_api.py::test_login - KeyError: 'token'\nexit code 1"),
/// ];
/// let summary = ExtractiveSummarizer::new().summarize_sync(&SummaryRequest::milestone(&steps, 150))?;
/// assert!(summary.section(SUMMARY).unwrap_or_default().iter().any(|l| l.contains("KeyError: 'token'")));
/// assert!(summary.section(ARTIFACTS).unwrap_or_default().iter().any(|l| l.contains("exit code 1")));
/// assert!(summary.text.starts_with("SESSION INTENT:\n- The CI is red, please fix it.\n"));
/// # Ok::<(), keel_summarize::SummarizeError>(())
/// ```
#[derive(Clone)]
pub struct ExtractiveSummarizer {
    counter: Arc<dyn TokenCounter>,
    max_item_chars: usize,
    matcher: Option<Arc<AhoCorasick>>,
}

impl std::fmt::Debug for ExtractiveSummarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtractiveSummarizer")
            .field("max_item_chars", &self.max_item_chars)
            .finish_non_exhaustive()
    }
}

impl Default for ExtractiveSummarizer {
    fn default() -> Self {
        Self::new()
    }
}

impl ExtractiveSummarizer {
    /// A summarizer counting with [`ApproxCounter`], items cut at 240 characters.
    pub fn new() -> Self {
        // The keyword automaton is the same for every summarizer: build it once.
        static MATCHER: std::sync::OnceLock<Option<Arc<AhoCorasick>>> = std::sync::OnceLock::new();
        let matcher = MATCHER
            .get_or_init(|| {
                AhoCorasick::builder()
                    .ascii_case_insensitive(true)
                    .match_kind(MatchKind::LeftmostFirst)
                    .kind(Some(AhoCorasickKind::DFA))
                    .build(KEYWORDS.iter().map(|(k, _)| k))
                    .map_err(|e| tracing::error!(error = %e, "keyword automaton failed to build; using the slow scan"))
                    .ok()
                    .map(Arc::new)
            })
            .clone();
        ExtractiveSummarizer {
            counter: Arc::new(ApproxCounter::new()),
            max_item_chars: 240,
            matcher,
        }
    }

    /// Counts the budget with `counter`.
    #[must_use]
    pub fn with_counter(mut self, counter: Arc<dyn TokenCounter>) -> Self {
        self.counter = counter;
        self
    }

    /// Cuts items to at most `chars` characters (at least 40).
    #[must_use]
    pub fn with_max_item_chars(mut self, chars: usize) -> Self {
        self.max_item_chars = chars.max(40);
        self
    }

    /// The summary, computed on the calling thread (the [`Summarizer`] impl calls
    /// this).
    pub fn summarize_sync(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        request.check()?;
        let texts: Vec<Cow<'_, str>> = request.messages.iter().map(Message::text).collect();
        let mut pool = Pool::default();
        self.collect(request, &texts, &mut pool);
        let sections = self.select(request.budget_tokens, &texts, pool, request.known)?;
        Ok(Summary {
            level: request.level,
            text: render(&sections),
            sections,
            prompt_version: EXTRACTIVE_VERSION.to_owned(),
            model: EXTRACTIVE_MODEL.to_owned(),
            usage: None,
        })
    }

    fn collect(&self, request: &SummaryRequest<'_>, texts: &[Cow<'_, str>], pool: &mut Pool) {
        let messages = request.messages;

        // The summaries given (the previous one, then those among the messages), and
        // for each the tagged errors a later one shows the same call get past.
        let notes: Vec<(Option<usize>, &str)> = request
            .previous
            .map(|p| (None, p))
            .into_iter()
            .chain(
                messages
                    .iter()
                    .zip(texts)
                    .enumerate()
                    .filter(|(_, (m, t))| {
                        m.role != Role::Tool && m.role != Role::System && is_summary(t)
                    })
                    .map(|(i, (_, t))| (Some(i), t.as_ref())),
            )
            .collect();
        let fixed = fixed_later(&notes);
        let no_fix = HashSet::new();
        let fixed_in = |note: Option<usize>| {
            notes
                .iter()
                .position(|(n, _)| *n == note)
                .and_then(|k| fixed.get(k))
                .unwrap_or(&no_fix)
        };

        // Carried over from the previous summary of this level.
        if let Some(previous) = request.previous {
            self.carry(previous, (0, 0), false, true, fixed_in(None), pool);
        }

        let observation: Vec<bool> = (0..messages.len())
            .map(|i| is_observation(messages, i))
            .collect();
        // The user talking: the first user message that is not an observation, and
        // later ones that read like a person (short, not a relayed tool output).
        let mut asks: Vec<usize> = Vec::new();
        for i in 0..messages.len() {
            let user = messages[i].role == Role::User && !observation[i] && !is_summary(&texts[i]);
            if user && (asks.is_empty() || reads_like_ask(&texts[i])) {
                asks.push(i);
            }
        }
        let last_assistant = messages.iter().rposition(|m| m.role == Role::Assistant);
        let last_caller = messages
            .iter()
            .rposition(|m| m.role == Role::Assistant && !m.tool_calls.is_empty());
        // Calls with a result, as (index of the call's message, call id): a result
        // answers the latest earlier call with its id.
        // Calls whose result says they failed: their paths were not read or changed.
        let mut answered: HashSet<(usize, &str)> = HashSet::new();
        let mut failed: HashSet<(usize, &str)> = HashSet::new();
        for (j, call) in answered_calls(messages).into_iter().enumerate() {
            if let (Some(call), Some(id)) = (call, messages[j].tool_call_id.as_deref()) {
                answered.insert((call, id));
                if reads_as_failure(&texts[j]) {
                    failed.insert((call, id));
                }
            }
        }
        // Errors a later call of the same tool with the same arguments got past: the
        // output's index, and the call that succeeded.
        // Each tool output's keyword lines, found once for both uses below.
        let mut tool_hits: Vec<Option<Vec<Hit>>> = messages
            .iter()
            .zip(texts)
            .map(|(m, t)| (m.role == Role::Tool).then(|| self.hits(t)))
            .collect();
        let resolved = self.resolved_errors(messages, texts, &tool_hits);
        let last_summary = (0..messages.len())
            .rev()
            .find(|&i| messages[i].role != Role::Tool && is_summary(&texts[i]));
        let mut files = Files::default();
        // The call (or command) each observation answers.
        let mut heads: HashMap<&str, (String, &ToolCall)> = Default::default();
        let mut last_command: Option<String> = None;
        // Identifiers already given as facts in this span (kept once, first place).
        let mut seen_facts: HashSet<String> = HashSet::new();

        for (i, (m, text)) in messages.iter().zip(texts).enumerate() {
            let order = (i as u32) + 1;
            if m.role == Role::System {
                continue;
            }
            // Summaries given as input (epoch level): keep their items.
            if m.role != Role::Tool && is_summary(text) {
                self.carry(
                    text,
                    (order, 0),
                    Some(i) == last_summary,
                    false,
                    fixed_in(Some(i)),
                    pool,
                );
                continue;
            }
            if request.level == Level::Epoch && m.role != Role::Tool {
                for item in parse_bullets(text).0 {
                    let prio = if self.has_error(&item) {
                        prio::CARRIED_ERROR
                    } else {
                        prio::NOTE
                    };
                    let src = pool.owned(item);
                    pool.push(prio, Sec::Summary, (order, 0), src);
                }
            }

            // The user's asks.
            if let Some(k) = asks.iter().position(|&a| a == i) {
                let p = if k == 0 {
                    prio::FIRST_ASK
                } else if k + 1 == asks.len() {
                    prio::LAST_ASK
                } else {
                    prio::OTHER_ASK
                };
                self.ask_lines(i, text, order, p, pool);
                let facts = new_facts(facts_of(text), &mut seen_facts);
                if !facts.is_empty() {
                    let src = pool.facts(FactsItem {
                        head: "user".to_owned(),
                        facts,
                    });
                    pool.push(prio::FACTS, Sec::Intent, (order, u32::MAX), src);
                }
            }

            if m.role == Role::Assistant {
                for call in &m.tool_calls {
                    let head = call_head(call);
                    if answered.contains(&(i, call.id.as_str())) {
                        if !failed.contains(&(i, call.id.as_str())) {
                            files.note_call(call);
                        }
                        heads.insert(call.id.as_str(), (head, call));
                    } else {
                        let src = pool.owned(cut(&head, 0, self.max_item_chars).into_owned());
                        pool.push(prio::PENDING, Sec::Next, (order, u32::MAX), src);
                    }
                }
                for command in fenced_commands(text) {
                    last_command = Some(command.to_owned());
                    if m.tool_calls.is_empty() {
                        // Answered by the next (user) message when it is an observation.
                        let answered_next = observation.get(i + 1).copied().unwrap_or(false);
                        if answered_next {
                            files.note_command(command);
                        }
                        let p = if answered_next {
                            prio::COMMAND
                        } else {
                            prio::PENDING
                        };
                        let sec = if answered_next {
                            Sec::Artifacts
                        } else {
                            Sec::Next
                        };
                        if !answered_next {
                            let src = pool.owned(cut(command, 0, self.max_item_chars).into_owned());
                            pool.push(p, sec, (order, 0), src);
                        }
                    }
                }
            }

            let is_output = m.role == Role::Tool || observation[i];
            if is_output {
                files.note_output(text);
                // The call or command this answers, and what its output introduced.
                let head = match m.tool_call_id.as_deref().and_then(|id| heads.get(id)) {
                    Some((head, _)) => head.clone(),
                    None => last_command
                        .take()
                        .unwrap_or_else(|| m.name.clone().unwrap_or_else(|| "output".to_owned())),
                };
                let structured = looks_structured(text);
                // A failed call (its result opens with `Error`, as keel's tool runner
                // writes one): the names in its message (a file that does not exist)
                // are no findings, and listed as such they read as files it found.
                let failed = m.role == Role::Tool && reads_as_failure(text);
                let exclude: Vec<String> = facts_of(&head);
                let (head, facts) = if failed {
                    (format!("{head}{FAILED_MARK}"), Vec::new())
                } else {
                    let facts = facts_of(text)
                        .into_iter()
                        .filter(|f| !exclude.contains(f))
                        .collect();
                    (head, new_facts(facts, &mut seen_facts))
                };
                let p = if facts.is_empty() {
                    prio::COMMAND
                } else if structured {
                    prio::FACTS
                } else {
                    prio::LOG_FACTS
                };
                let head = cut(&head, 0, self.max_item_chars).into_owned();
                if !facts.is_empty() || head.ends_with(')') || head.contains(' ') {
                    let src = pool.facts(FactsItem { head, facts });
                    pool.push(p, Sec::Artifacts, (order, 0), src);
                }
            }

            // The call a tool output answers, named on its open errors (` [in get(A)]`),
            // so a later summary can tell when a later call got past them.
            let tag = (m.role == Role::Tool)
                .then(|| m.tool_call_id.as_deref().and_then(|id| heads.get(id)))
                .flatten()
                .map(|(head, _)| format!(" {IN_MARK}{}]", cut(head, 0, 80)));
            let open = last_caller.is_some_and(|c| i > c);
            let tail_start = tail_offset(text, 5);
            let mut skip_until = 0usize;
            let mut last_error: Option<usize> = None;
            let hits = match tool_hits.get_mut(i).and_then(Option::take) {
                Some(hits) => hits,
                None => self.hits(text),
            };
            for (line_start, line_end, kinds, focus) in hits {
                if line_start < skip_until {
                    continue;
                }
                let slice = |focus: usize| Src::Slice {
                    msg: i as u32,
                    start: line_start as u32,
                    end: line_end as u32,
                    focus: focus as u32,
                };
                let at = (order, line_start as u32);
                let has = |k: Kind| kinds & k.bit() != 0;
                let line = &text[line_start..line_end];
                if is_output && (looks_like_code(line) || looks_like_listing(line)) {
                    // Source listings mention errors without reporting one.
                } else if has(Kind::Error) {
                    let p = if !is_output {
                        prio::DECISION
                    } else if open && m.role == Role::Tool {
                        prio::OPEN_ERROR
                    } else if line_start >= tail_start {
                        prio::ERROR + 3
                    } else {
                        prio::ERROR
                    };
                    // A header (`ERROR:`, `Error`) takes its message from the next line.
                    let joined = is_output
                        .then(|| error_with_message(text, line_start, line_end))
                        .flatten();
                    let fixed_by = resolved.get(&i).filter(|_| is_output);
                    match (joined, fixed_by) {
                        (joined, Some(head)) => {
                            // Marked, kept below the open errors.
                            let line = match joined {
                                Some((joined, end)) => {
                                    skip_until = end;
                                    joined
                                }
                                None => line.trim().to_owned(),
                            };
                            let mark = format!(" {RESOLVED_MARK}a later {head} succeeded]");
                            let room = self
                                .max_item_chars
                                .saturating_sub(mark.chars().count())
                                .max(40);
                            let text = format!("{}{mark}", cut(&line, 0, room));
                            let src = pool.owned(text);
                            pool.push(prio::RESOLVED_ERROR, Sec::Summary, at, src);
                        }
                        (Some((joined, end)), None) => {
                            skip_until = end;
                            let src = pool.owned(cut(&joined, 0, self.max_item_chars).into_owned());
                            pool.push(p, Sec::Summary, at, src);
                        }
                        (None, None) => pool.push(p, Sec::Summary, at, slice(focus)),
                    }
                    if fixed_by.is_none() {
                        last_error = Some(pool.cands.len() - 1);
                    }
                } else if has(Kind::Exit) {
                    pool.push(prio::EXIT, Sec::Artifacts, at, slice(focus));
                } else if m.role == Role::Assistant && has(Kind::Decision) {
                    // A reason or a decision ("because", "instead", "the fix") matters
                    // more than a plain intention ("I'll", "we will").
                    let lower = line.to_ascii_lowercase();
                    let strong = STRONG_DECISIONS.iter().any(|k| lower.contains(k));
                    // The last message's intentions are the next step, kept there.
                    if strong || Some(i) != last_assistant {
                        let p = if strong { prio::REASON } else { prio::DECISION };
                        pool.push(p, Sec::Summary, at, slice(focus));
                    }
                } else if has(Kind::Success) && !line.trim_end().ends_with('?') {
                    let p = if is_output {
                        prio::SUCCESS
                    } else {
                        prio::ACCOMPLISHED
                    };
                    pool.push(p, Sec::Summary, at, slice(focus));
                }
            }
            // The output's last open error names its call.
            if let (Some(tag), Some(k)) = (&tag, last_error)
                && let Some(c) = pool.cands.get(k).copied()
            {
                let line = self.resolve(c.src, texts, &pool.owned).into_owned();
                let room = self
                    .max_item_chars
                    .saturating_sub(tag.chars().count())
                    .max(40);
                let src = pool.owned(format!("{}{tag}", cut(&line, 0, room)));
                if let Some(c) = pool.cands.get_mut(k) {
                    c.src = src;
                }
            }
        }

        // The next step as the agent last stated it.
        if let Some((i, start, end)) = last_stated_next(messages, texts) {
            pool.push(
                prio::NEXT_STATED,
                Sec::Next,
                ((i as u32) + 1, start as u32),
                Src::Slice {
                    msg: i as u32,
                    start: start as u32,
                    end: end as u32,
                    focus: start as u32,
                },
            );
        }
        if let Some(item) = files.item(self.max_item_chars) {
            let src = pool.owned(item);
            pool.push(prio::FILES, Sec::Artifacts, (u32::MAX, 0), src);
        }
    }

    /// The first two lines of a user's ask (cut at 160 characters each).
    fn ask_lines(&self, i: usize, text: &str, order: u32, prio: u16, pool: &mut Pool) {
        let mut offset = 0;
        let mut taken = 0;
        for line in text.split_inclusive('\n') {
            let trimmed = line.trim();
            if !trimmed.is_empty() {
                let start = offset + (line.len() - line.trim_start().len());
                let src = if trimmed.chars().count() > MAX_ASK_CHARS {
                    pool.owned(cut(trimmed, 0, MAX_ASK_CHARS).into_owned())
                } else {
                    Src::Slice {
                        msg: i as u32,
                        start: start as u32,
                        end: (start + trimmed.len()) as u32,
                        focus: start as u32,
                    }
                };
                pool.push(prio, Sec::Intent, (order, start as u32), src);
                taken += 1;
                if taken == 2 {
                    break;
                }
            }
            offset += line.len();
        }
    }

    /// Carries the items of an earlier summary: errors, facts items and (from the
    /// latest summary) next steps keep a high priority, the rest a low one.
    fn carry(
        &self,
        text: &str,
        order: (u32, u32),
        latest: bool,
        previous: bool,
        fixed: &HashSet<String>,
        pool: &mut Pool,
    ) {
        for (k, (sec, item)) in structured_items(text).into_iter().enumerate() {
            let order = (order.0, order.1 + k as u32);
            // An open error whose call a later summary shows getting past it.
            let item = match tagged_call(&item) {
                Some((line, head)) if fixed.contains(head) => {
                    format!("{line} {RESOLVED_MARK}a later {head} succeeded]")
                }
                _ => item,
            };
            if item.contains(" → ") {
                let p = if previous {
                    prio::CARRIED_FACTS - 10
                } else {
                    prio::CARRIED_FACTS
                };
                for (head, facts) in facts_items(&item) {
                    let src = pool.facts(FactsItem { head, facts });
                    pool.push(p, sec, order, src);
                }
                continue;
            }
            let lower = item.to_ascii_lowercase();
            let p = if item.contains(RESOLVED_MARK) {
                // An error since fixed: kept while there is room, marked.
                prio::NOTE
            } else if self.has_error(&item) && sec == Sec::Summary {
                prio::CARRIED_ERROR
            } else if sec != Sec::Next && STRONG_DECISIONS.iter().any(|k| lower.contains(k)) {
                // Constraints and decisions hold for the rest of the run.
                prio::CARRIED_DURABLE
            } else if sec == Sec::Next {
                if latest {
                    prio::CARRIED_NEXT
                } else {
                    prio::STALE_NEXT
                }
            } else if sec == Sec::Intent {
                // What the user asked holds until it is done: it outlives the fold.
                prio::CARRIED_INTENT
            } else if previous {
                prio::CARRIED
            } else {
                prio::NOTE
            };
            let src = pool.owned(item);
            pool.push(p, sec, order, src);
        }
    }

    /// Tool outputs reporting an error that a later call of the same tool with the
    /// same arguments got past (its output reports none), with that call's head.
    fn resolved_errors(
        &self,
        messages: &[Message],
        texts: &[Cow<'_, str>],
        hits: &[Option<Vec<Hit>>],
    ) -> HashMap<usize, String> {
        let calls = answered_tool_calls(messages);
        // (output index, head, whether it reports an error)
        // Only tool results answer a call.
        let outputs: Vec<(usize, String, bool)> = calls
            .iter()
            .enumerate()
            .filter_map(|(i, call)| {
                let call = (*call)?;
                // Every tool output's lines were scanned (`hits`).
                let failed = reports_error(texts.get(i)?, hits.get(i)?.as_deref()?);
                Some((i, call_head(call), failed))
            })
            .collect();
        let mut resolved = HashMap::new();
        for (k, (i, head, failed)) in outputs.iter().enumerate() {
            if *failed
                && outputs[k + 1..]
                    .iter()
                    .any(|(_, later, later_failed)| later == head && !later_failed)
            {
                resolved.insert(*i, head.clone());
            }
        }
        resolved
    }

    /// The lines of `text` with keywords, as [`scan`](Self::scan) reports them.
    fn hits(&self, text: &str) -> Vec<Hit> {
        let mut hits = Vec::new();
        self.scan(text, |start, end, kinds, focus| {
            hits.push((start, end, kinds, focus))
        });
        hits
    }

    fn has_error(&self, text: &str) -> bool {
        let mut found = false;
        self.scan(text, |_, _, kinds, _| {
            found |= kinds & Kind::Error.bit() != 0;
        });
        found
    }

    /// Calls `f(line_start, line_end, kinds, focus)` for every line of `text` with at
    /// least one keyword; `focus` is the first match. An error word inside a file name
    /// (`error_handler.py`, `errors/`) does not count.
    fn scan(&self, text: &str, mut f: impl FnMut(usize, usize, u8, usize)) {
        let bytes = text.as_bytes();
        let mut current: Option<(usize, usize, u8, usize)> = None;
        let mut flush = |current: &mut Option<(usize, usize, u8, usize)>| {
            if let Some((s, e, kinds, focus)) = current.take()
                && kinds != 0
            {
                f(s, e, kinds, if focus == usize::MAX { s } else { focus });
            }
        };
        let mut on_match = |start: usize, end: usize, kind: Kind| {
            if kind == Kind::Error && inside_file_name(text, start, end) {
                return;
            }
            if current.is_none_or(|(_, e, _, _)| start >= e) {
                flush(&mut current);
                let s = memchr::memrchr(b'\n', &bytes[..start]).map_or(0, |p| p + 1);
                let e = memchr::memchr(b'\n', &bytes[start..]).map_or(bytes.len(), |p| start + p);
                current = Some((s, e, 0, usize::MAX));
            }
            if let Some(cur) = current.as_mut() {
                cur.2 |= kind.bit();
                cur.3 = cur.3.min(start);
            }
        };
        match &self.matcher {
            Some(ac) => {
                for m in ac.find_iter(bytes) {
                    on_match(m.start(), m.end(), KEYWORDS[m.pattern().as_usize()].1);
                }
            }
            None => {
                // Slow path, only if the automaton failed to build.
                let lower = text.to_ascii_lowercase();
                let mut hits: Vec<(usize, usize, Kind)> = KEYWORDS
                    .iter()
                    .flat_map(|(k, kind)| {
                        lower.match_indices(k).map(|(p, _)| (p, p + k.len(), *kind))
                    })
                    .collect();
                hits.sort_by_key(|h| h.0);
                for (p, e, kind) in hits {
                    on_match(p, e, kind);
                }
            }
        }
        flush(&mut current);
    }

    fn resolve<'t>(
        &self,
        src: Src,
        texts: &'t [Cow<'_, str>],
        owned: &'t [String],
    ) -> Cow<'t, str> {
        match src {
            Src::Owned(i) => owned
                .get(i as usize)
                .map_or(Cow::Borrowed(""), |s| tidy(cut(s, 0, self.max_item_chars))),
            Src::Slice {
                msg,
                start,
                end,
                focus,
            } => {
                let text: &str = texts.get(msg as usize).map_or("", |t| t.as_ref());
                let line = text.get(start as usize..end as usize).unwrap_or("");
                let focus = (focus.saturating_sub(start)) as usize;
                tidy(cut(line.trim_end(), focus, self.max_item_chars))
            }
            // Facts items are rendered by `select`, which knows the room left.
            Src::Facts(_) => Cow::Borrowed(""),
        }
    }

    fn select(
        &self,
        budget: usize,
        texts: &[Cow<'_, str>],
        pool: Pool,
        known: &[&str],
    ) -> Result<Vec<Section>, SummarizeError> {
        let Pool {
            owned,
            facts,
            mut cands,
        } = pool;
        let empty: Vec<Section> = SECTIONS
            .iter()
            .map(|t| Section {
                title: (*t).to_owned(),
                items: Vec::new(),
            })
            .collect();
        let skeleton = self.counter.count_text(&render_all(&empty));
        if budget < skeleton {
            return Err(SummarizeError::BudgetTooSmall {
                budget,
                needed: skeleton,
            });
        }
        let key = |c: &Cand| {
            (
                std::cmp::Reverse(c.prio),
                std::cmp::Reverse(c.order.0),
                c.order.1,
            )
        };
        if cands.len() > MAX_CANDIDATES {
            cands.select_nth_unstable_by_key(MAX_CANDIDATES, key);
            cands.truncate(MAX_CANDIDATES);
        }
        cands.sort_by_key(key);
        let (fact_cands, mut cands): (Vec<Cand>, Vec<Cand>) = cands.into_iter().partition(|c| {
            matches!(c.src, Src::Facts(k) if facts.get(k as usize).is_some_and(|f| !f.facts.is_empty()))
        });

        // Headings are paid for when a section gets its first item.
        let heading_cost: Vec<usize> = SECTIONS
            .iter()
            .map(|t| self.counter.count_text(&format!("{t}:\n")))
            .collect();
        let mut sel = Selection {
            budget,
            used: self.counter.count_text("SUMMARY:\n- none\n").min(budget),
            opened: [false; 4],
            heading_cost,
            // Items a summary that stays in the prompt already has, word for word.
            seen: known
                .iter()
                .flat_map(|k| k.lines())
                .filter_map(bullet_text)
                .map(str::to_owned)
                .collect(),
            kept: String::new(),
            chosen: Vec::new(),
        };
        // Three rounds. First, what matters most (asks, pending work, the stated next
        // step, errors, what was accomplished, files), each section within its share of
        // the room, so one kind of item cannot crowd out the others; once an item is
        // over its section's share the section takes nothing more in this round, so
        // the item keeps first claim on the room left. Then the facts, shared across
        // all the span's calls by how identifying they are. Last, everything left, by
        // priority.
        let room = budget.saturating_sub(sel.used);
        let caps = [
            room * 15 / 100,
            room * 25 / 100,
            room * 15 / 100,
            room * 15 / 100,
        ];
        let mut spent = [0usize; 4];
        let mut closed = [false; 4];
        let mut deferred: Vec<Cand> = Vec::new();
        for c in std::mem::take(&mut cands) {
            let sec = c.sec as usize;
            if closed[sec] || c.prio < prio::FIRST_PASS {
                deferred.push(c);
                continue;
            }
            let text = self.text_of(c.src, texts, &owned, &facts);
            if text.is_empty() || sel.seen.contains(text.as_ref()) {
                continue;
            }
            let cost = sel.cost_of(c.sec, self.counter.count_text(&text) + 1);
            if spent[sec] + cost > caps[sec] {
                closed[sec] = true;
                deferred.push(c);
                continue;
            }
            if sel.take(c, text.into_owned(), cost) {
                spent[sec] += cost;
            }
        }
        // What outranks the facts and was over its share goes first, then the facts,
        // then the rest (with calls whose facts were all kept elsewhere, as calls).
        let (before, mut after): (Vec<Cand>, Vec<Cand>) =
            deferred.into_iter().partition(|c| c.prio > prio::FACTS);
        let rest = |sel: &mut Selection, list: Vec<Cand>| {
            for c in list {
                if sel.budget.saturating_sub(sel.used) < 3 {
                    break;
                }
                let text = self.text_of(c.src, texts, &owned, &facts);
                if text.is_empty() || sel.seen.contains(text.as_ref()) {
                    continue;
                }
                let cost = sel.cost_of(c.sec, self.counter.count_text(&text) + 1);
                sel.take(c, text.into_owned(), cost);
            }
        };
        rest(&mut sel, before);
        let unopened = self.allocate_facts(&mut sel, &fact_cands, &facts);
        after.extend(unopened.into_iter().map(|mut c| {
            c.prio = prio::COMMAND;
            c
        }));
        after.sort_by_key(key);
        // A summary need not fill its budget: plain lines (other asks, decisions,
        // successes in output, old notes) stop at a share of it, so a span that is
        // mostly facts gives a short, dense summary.
        let (plain, important): (Vec<Cand>, Vec<Cand>) =
            after.into_iter().partition(|c| c.prio < prio::FIRST_PASS);
        rest(&mut sel, important);
        let full_budget = sel.budget;
        sel.budget = sel
            .budget
            .min(full_budget * PLAIN_SHARE_PERCENT / 100)
            .max(sel.used);
        rest(&mut sel, plain);
        sel.budget = full_budget;

        // Exact check on the rendered text; drop the least important until it fits.
        let mut chosen = sel.chosen;
        loop {
            let sections = assemble(&chosen);
            if self.counter.count_text(&render(&sections)) <= budget || chosen.is_empty() {
                return Ok(sections);
            }
            chosen.pop();
        }
    }

    /// The text of a candidate that is not a facts item with facts (a facts item
    /// without any is its head, when that is a call or command).
    fn text_of<'t>(
        &self,
        src: Src,
        texts: &'t [Cow<'_, str>],
        owned: &'t [String],
        facts: &'t [FactsItem],
    ) -> Cow<'t, str> {
        match src {
            Src::Facts(k) => facts
                .get(k as usize)
                .map_or(Cow::Borrowed(""), |f| tidy(Cow::Borrowed(f.head.as_str()))),
            src => self.resolve(src, texts, owned),
        }
    }

    /// Shares the room left among the facts of every facts item: the most identifying
    /// facts first (ids, then codes, dates, numbers; structured results before logs,
    /// later calls before earlier ones), each item's head paid with its first fact.
    /// Facts already kept elsewhere are skipped. Returns the items that got no fact.
    fn allocate_facts(
        &self,
        sel: &mut Selection,
        cands: &[Cand],
        facts: &[FactsItem],
    ) -> Vec<Cand> {
        struct Slot<'f> {
            cand: Cand,
            head: Cow<'f, str>,
            head_cost: usize,
            facts: Vec<(&'f str, usize)>,
            picked: Vec<bool>,
            open: bool,
        }
        let mut slots: Vec<Slot<'_>> = Vec::new();
        let mut entries: Vec<(FactKey, usize)> = Vec::new();
        let mut unique: HashSet<&str> = HashSet::new();
        for c in cands {
            let Src::Facts(k) = c.src else { continue };
            let Some(item) = facts.get(k as usize) else {
                continue;
            };
            let head = tidy(Cow::Borrowed(item.head.as_str()));
            let head_cost = self.counter.count_text(&head) + 2;
            let s = slots.len();
            let fresh: Vec<(&str, usize)> = item
                .facts
                .iter()
                .map(String::as_str)
                .filter(|f| !contains_token(&sel.kept, f) && unique.insert(f))
                .map(|f| (f, self.counter.count_text(f) + 1))
                .collect();
            for (k, (f, _)) in fresh.iter().enumerate() {
                let log = u8::from(c.prio == prio::LOG_FACTS);
                entries.push((
                    (
                        fact_rank(f) * 2 + log,
                        std::cmp::Reverse(c.prio),
                        std::cmp::Reverse(c.order.0),
                        k,
                    ),
                    s,
                ));
            }
            slots.push(Slot {
                cand: *c,
                head,
                head_cost,
                picked: vec![false; fresh.len()],
                facts: fresh,
                open: false,
            });
        }
        // Calls of the same tool in a row share one item: `get(A) → x y; (B) → z`.
        let mut in_order: Vec<usize> = (0..slots.len()).collect();
        in_order.sort_by_key(|&i| (slots[i].cand.sec, slots[i].cand.order));
        // Where a call's arguments start (`name(` … `)`).
        let tool_of = |head: &str| -> Option<(usize, ())> {
            let open = head.find('(')?;
            head.ends_with(')').then_some((open, ()))
        };
        let mut follows: Vec<Option<usize>> = vec![None; slots.len()];
        let mut short_cost: Vec<usize> = vec![0; slots.len()];
        for w in in_order.windows(2) {
            let (a, b) = (w[0], w[1]);
            let same = slots[a].cand.sec == slots[b].cand.sec
                && match (tool_of(&slots[a].head), tool_of(&slots[b].head)) {
                    (Some((i, _)), Some((j, _))) => slots[a].head[..i] == slots[b].head[..j],
                    _ => false,
                };
            if same {
                follows[b] = Some(a);
                let args = tool_of(&slots[b].head).map_or("", |(j, _)| &slots[b].head[j..]);
                short_cost[b] = self.counter.count_text(&format!("; {args} →"));
            }
        }
        entries.sort();
        for ((_, _, _, k), s) in entries {
            let shared = follows[s].is_some_and(|p| slots[p].open);
            let slot = &mut slots[s];
            let (_, cost) = slot.facts[k];
            let extra = if slot.open {
                cost
            } else if shared {
                cost + short_cost[s]
            } else {
                cost + slot.head_cost
            };
            let total = sel.cost_of(slot.cand.sec, extra);
            if sel.used + total > sel.budget {
                continue;
            }
            sel.used += total;
            sel.opened[slot.cand.sec as usize] = true;
            slot.open = true;
            slot.picked[k] = true;
        }
        let mut unopened = Vec::new();
        let mut items: Vec<(Cand, String)> = Vec::new();
        let mut last_open: Option<usize> = None;
        for &i in &in_order {
            let slot = &slots[i];
            if !slot.open {
                // Without facts, a call or command still says what was done.
                if slot.head.ends_with(')') || slot.head.contains(' ') {
                    unopened.push(slot.cand);
                }
                last_open = None;
                continue;
            }
            let joined = follows[i].is_some() && follows[i] == last_open;
            let (cand, mut text) = match (joined, items.pop()) {
                (true, Some((cand, mut text))) => {
                    let args = tool_of(&slot.head).map_or("", |(j, _)| &slot.head[j..]);
                    text.push_str("; ");
                    text.push_str(args);
                    text.push_str(" →");
                    (cand, text)
                }
                (_, popped) => {
                    items.extend(popped);
                    (slot.cand, format!("{} →", slot.head))
                }
            };
            for ((f, _), picked) in slot.facts.iter().zip(&slot.picked) {
                if *picked && text.len() + f.len() < MAX_FACTS_CHARS * 2 {
                    text.push(' ');
                    text.push_str(f);
                }
            }
            items.push((cand, text));
            last_open = Some(i);
        }
        for (cand, text) in items {
            sel.kept.push_str(&text);
            sel.kept.push('\n');
            sel.seen.insert(text.clone());
            sel.chosen.push((cand, text));
        }
        unopened
    }
}

/// An error item tagged with its call (`msg [in get(A)]`): the message and the call.
fn tagged_call(item: &str) -> Option<(&str, &str)> {
    let body = item.strip_suffix(']')?;
    let at = body.rfind(IN_MARK)?;
    Some((body[..at].trim_end(), &body[at + IN_MARK.len()..]))
}

/// For each summary of `notes` (in order), the calls its open errors are tagged with
/// that a later summary shows succeeding: a facts item of that call, and no open error
/// of it in the same later summary.
fn fixed_later(notes: &[(Option<usize>, &str)]) -> Vec<HashSet<String>> {
    let parsed: Vec<(HashSet<String>, HashSet<String>)> = notes
        .iter()
        .map(|(_, text)| {
            let mut open = HashSet::new();
            let mut ran = HashSet::new();
            for (sec, item) in structured_items(text) {
                if item.contains(" → ") {
                    ran.extend(facts_items(&item).into_iter().map(|(head, _)| head));
                } else if sec == Sec::Summary
                    && !item.contains(RESOLVED_MARK)
                    && let Some((_, head)) = tagged_call(&item)
                {
                    open.insert(head.to_owned());
                }
            }
            let succeeded = ran.difference(&open).cloned().collect();
            (open, succeeded)
        })
        .collect();
    parsed
        .iter()
        .enumerate()
        .map(|(k, (open, _))| {
            open.iter()
                .filter(|head| parsed[k + 1..].iter().any(|(_, ok)| ok.contains(*head)))
                .cloned()
                .collect()
        })
        .collect()
}

/// The facts items of a summary line: `get(A) → x y; (B) → z` is `get(A)` with
/// `x y` and `get(B)` with `z`.
fn facts_items(item: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut tool = "";
    for (k, part) in item.split("; (").enumerate() {
        let Some((head, facts)) = part.split_once(" → ") else {
            continue;
        };
        let head = if k == 0 {
            tool = head.split_once('(').map_or("", |(t, _)| t);
            head.to_owned()
        } else {
            format!("{tool}({head}")
        };
        let facts = facts
            .split(' ')
            .filter(|f| !f.is_empty())
            .map(str::to_owned)
            .collect();
        out.push((head, facts));
    }
    out
}

/// How a fact is ranked for the room: (kind rank, priority, recency, position).
type FactKey = (u8, std::cmp::Reverse<u16>, std::cmp::Reverse<u32>, usize);

/// The items chosen so far and the room they use.
struct Selection {
    budget: usize,
    used: usize,
    opened: [bool; 4],
    heading_cost: Vec<usize>,
    seen: HashSet<String>,
    kept: String,
    chosen: Vec<(Cand, String)>,
}

impl Selection {
    /// `cost` plus the section's heading if it has no item yet.
    fn cost_of(&self, sec: Sec, cost: usize) -> usize {
        let s = sec as usize;
        if self.opened[s] {
            cost
        } else {
            cost + self.heading_cost.get(s).copied().unwrap_or(0)
        }
    }

    /// Keeps an item if it fits.
    fn take(&mut self, c: Cand, text: String, cost: usize) -> bool {
        if self.used + cost > self.budget {
            return false;
        }
        self.used += cost;
        self.opened[c.sec as usize] = true;
        self.kept.push_str(&text);
        self.kept.push('\n');
        self.seen.insert(text.clone());
        self.chosen.push((c, text));
        true
    }
}

/// The sections as text: each heading with items on its line, its items as `- `
/// bullets; empty sections are left out (`SUMMARY:` / `- none` when all are).
fn render(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections.iter().filter(|s| !s.items.is_empty()) {
        out.push_str(&s.title);
        out.push_str(":\n");
        for item in &s.items {
            out.push_str("- ");
            out.push_str(item);
            out.push('\n');
        }
    }
    if out.is_empty() {
        out.push_str(SUMMARY);
        out.push_str(":\n- none\n");
    }
    out
}

/// Every section, `- none` under an empty one (the skeleton's size).
fn render_all(sections: &[Section]) -> String {
    let mut out = String::new();
    for s in sections {
        out.push_str(&s.title);
        out.push_str(":\n");
        if s.items.is_empty() {
            out.push_str("- none\n");
        }
        for item in &s.items {
            out.push_str("- ");
            out.push_str(item);
            out.push('\n');
        }
    }
    out
}

fn assemble(chosen: &[(Cand, String)]) -> Vec<Section> {
    let mut sorted: Vec<&(Cand, String)> = chosen.iter().collect();
    sorted.sort_by_key(|(c, _)| (c.sec, c.order));
    let titles = [SESSION_INTENT, SUMMARY, ARTIFACTS, NEXT_STEPS];
    let mut sections: Vec<Section> = titles
        .iter()
        .map(|t| Section {
            title: (*t).to_owned(),
            items: Vec::new(),
        })
        .collect();
    for (c, text) in sorted {
        if let Some(s) = sections.get_mut(c.sec as usize) {
            s.items.push(text.clone());
        }
    }
    sections
}

/// Whether `text` is a structured summary (it has one of the [`SECTIONS`] headings).
fn is_summary(text: &str) -> bool {
    text.lines().any(|l| heading_of(l).is_some())
}

/// Whether message `i` is an observation: a tool result, a user message flagged
/// `keel.observation`, or a user message right after an assistant message that ran a
/// command in a fenced block and called no tool (a tool's output relayed as a user
/// turn, as in SWE-agent).
fn is_observation(messages: &[Message], i: usize) -> bool {
    let m = &messages[i];
    match m.role {
        Role::Tool => true,
        Role::User => {
            m.metadata
                .get(OBSERVATION_KEY)
                .is_some_and(|v| v.as_bool() == Some(true))
                || (i > 0 && {
                    let prev = &messages[i - 1];
                    prev.role == Role::Assistant
                        && prev.tool_calls.is_empty()
                        && fenced_commands(&prev.text()).next().is_some()
                })
        }
        _ => false,
    }
}

/// `name(value, ...)`: a tool call with its argument values, compact.
fn call_head(call: &ToolCall) -> String {
    let args = match call.arguments.as_json() {
        Some(v) => match v.as_object() {
            Some(map) => map
                .values()
                .map(|v| match v.as_str() {
                    Some(s) => one_line(s),
                    None => v.to_string(),
                })
                .collect::<Vec<_>>()
                .join(", "),
            None => v.to_string(),
        },
        None => one_line(&call.arguments.to_json_string()),
    };
    format!("{}({args})", call.name)
}

fn one_line(s: &str) -> String {
    let t = s.trim();
    if t.contains('\n') {
        t.split_whitespace().collect::<Vec<_>>().join(" ")
    } else {
        t.to_owned()
    }
}

/// The first line of each fenced block of `text`: the command it runs.
fn fenced_commands(text: &str) -> impl Iterator<Item = &str> {
    let mut inside = false;
    let mut first = false;
    text.lines().filter_map(move |line| {
        let t = line.trim();
        if t.starts_with("```") {
            inside = !inside;
            first = inside;
            None
        } else if inside && first && !t.is_empty() {
            first = false;
            Some(t)
        } else {
            None
        }
    })
}

/// Files the span's calls and commands read and changed, in first-seen order.
/// Whether a tool result reports that its call failed or did not run: it opens with
/// `Error` (as keel's tool runner writes a failed call's result) or says the call was
/// not approved.
fn reads_as_failure(text: &str) -> bool {
    let head: String = text.trim_start().chars().take(40).collect();
    let head = head.to_ascii_lowercase();
    head.starts_with("error") || head.starts_with("the user did not approve")
}

#[derive(Default)]
struct Files {
    read: Vec<String>,
    changed: Vec<String>,
    /// The file an editor command without a path applies to (the last one opened).
    open: Option<String>,
}

/// Words in a tool name or command that change files.
const CHANGING: &[&str] = &[
    "write",
    "edit",
    "create",
    "replace",
    "insert",
    "patch",
    "apply",
    "delete",
    "remove",
    "move",
    "rename",
    "append",
    "save",
    "touch",
    "mkdir",
    "rm",
    "mv",
    "cp",
    "str_replace",
];

impl Files {
    fn add(&mut self, path: &str, changed: bool) {
        let path = path.trim_end_matches([',', ';', ':', ')', '.']).to_owned();
        if changed {
            self.read.retain(|p| *p != path);
            if !self.changed.contains(&path) {
                self.changed.push(path);
            }
        } else if !self.read.contains(&path) && !self.changed.contains(&path) {
            self.read.push(path);
        }
    }

    fn note_call(&mut self, call: &ToolCall) {
        let name = call.name.to_ascii_lowercase();
        let mut changed = CHANGING.iter().any(|w| name.contains(w));
        let mut values = Vec::new();
        collect_strings(&call.arguments, &mut values);
        for v in values {
            if v.contains(char::is_whitespace) {
                // A shell command in an argument.
                self.note_command(v);
            } else if is_path(v) {
                self.add(v, changed);
                changed = changed && !name.contains("mv") && !name.contains("cp");
            }
        }
    }

    fn note_command(&mut self, command: &str) {
        let mut words = command.split_whitespace();
        let Some(verb) = words.next() else {
            return;
        };
        let verb = verb.rsplit('/').next().unwrap_or(verb).to_ascii_lowercase();
        let rest: Vec<&str> = words.collect();
        let in_place = rest.iter().any(|w| *w == "-i" || w.starts_with("-i."));
        let redirect = rest
            .iter()
            .position(|w| *w == ">" || *w == ">>" || *w == "tee");
        let changing = CHANGING.iter().any(|w| verb == *w) || (verb == "sed" && in_place);
        let mut any = false;
        for (k, w) in rest.iter().enumerate() {
            let w = w.trim_matches(['"', '\'', '`']);
            if is_path(w) {
                let changed = changing || redirect.is_some_and(|r| k > r);
                self.add(w, changed);
                any = true;
                if verb == "open" || verb == "create" {
                    self.open = Some(w.to_owned());
                }
            }
        }
        if !any
            && (verb == "edit" || verb == "insert" || verb == "append")
            && let Some(open) = self.open.clone()
        {
            self.add(&open, true);
        }
    }

    /// Notes the file an editor's output names (`[File: /repo/x.py (94 lines total)]`).
    fn note_output(&mut self, text: &str) {
        let head = text.trim_start();
        if let Some(rest) = head.strip_prefix("[File: ")
            && let Some(path) = rest.split([' ', ']']).next()
            && is_path(path)
        {
            self.open = Some(path.to_owned());
        }
    }

    fn item(&self, max: usize) -> Option<String> {
        let mut parts = Vec::new();
        if !self.read.is_empty() {
            parts.push(format!("files read: {}", self.read.join(", ")));
        }
        if !self.changed.is_empty() {
            parts.push(format!("files changed: {}", self.changed.join(", ")));
        }
        (!parts.is_empty()).then(|| cut(&parts.join("; "), 0, max * 2).into_owned())
    }
}

/// The string values of tool arguments, depth first (an explicit stack: the JSON value
/// type is only reachable through `ToolArguments`).
fn collect_strings<'v>(args: &'v keel_message::ToolArguments, out: &mut Vec<&'v str>) {
    let Some(value) = args.as_json() else {
        return;
    };
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        if let Some(s) = v.as_str() {
            out.push(s);
        } else if let Some(items) = v.as_array() {
            stack.extend(items.iter().rev());
        } else if let Some(map) = v.as_object() {
            let mut values: Vec<_> = map.values().collect();
            values.reverse();
            stack.extend(values);
        }
    }
}

/// Items of summary text: section items where it has headings, else its bullets (as
/// SUMMARY items).
fn structured_items(text: &str) -> Vec<(Sec, String)> {
    let sections = parse_sections(text);
    if sections.is_empty() {
        return parse_bullets(text)
            .0
            .into_iter()
            .map(|b| (Sec::Summary, b))
            .collect();
    }
    sections
        .into_iter()
        .flat_map(|s| {
            let sec = match s.title.as_str() {
                SESSION_INTENT => Sec::Intent,
                ARTIFACTS => Sec::Artifacts,
                NEXT_STEPS => Sec::Next,
                _ => Sec::Summary,
            };
            s.items
                .into_iter()
                .filter(|i| !i.eq_ignore_ascii_case("none"))
                .map(move |i| (sec, i))
        })
        .collect()
}

/// Trimmed, without a leading bullet marker.
fn tidy(text: Cow<'_, str>) -> Cow<'_, str> {
    fn clean(s: &str) -> &str {
        let t = s.trim();
        bullet_text(t).unwrap_or(t)
    }
    match text {
        Cow::Borrowed(s) => Cow::Borrowed(clean(s)),
        Cow::Owned(s) => {
            let c = clean(&s);
            if c.len() == s.len() {
                Cow::Owned(s)
            } else {
                Cow::Owned(c.to_owned())
            }
        }
    }
}

/// A keyword line: its start and end in the text, the kinds of its keywords (bits),
/// and where the first one starts.
type Hit = (usize, usize, u8, usize);

/// Whether a keyword line of `text` (`hits`) that is not code nor a listing reports an
/// error; the lines as `str::lines` gives them.
fn reports_error(text: &str, hits: &[Hit]) -> bool {
    hits.iter().any(|&(start, end, kinds, _)| {
        if kinds & Kind::Error.bit() == 0 {
            return false;
        }
        let mut line = &text[start..end];
        // `lines` drops the `\r` of a `\r\n` ending.
        if end < text.len() {
            line = line.strip_suffix('\r').unwrap_or(line);
        }
        !looks_like_code(line) && !looks_like_listing(line)
    })
}

/// A line of source code or of a numbered file listing (`12:`, `cat -n`'s `   12\t`,
/// `12 |`, `12    code`), rather than a message.
fn looks_like_code(line: &str) -> bool {
    let t = line.trim_start();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits > 0 {
        let rest = &t[digits..];
        if rest.starts_with([':', '\t', '|']) || rest.starts_with(" |") || rest.starts_with("  ") {
            return true;
        }
    }
    const STARTS: &[&str] = &[
        "raise ",
        "except",
        "#",
        "def ",
        "class ",
        "import ",
        "from ",
        "//",
        "/*",
        "* ",
        "assert ",
        "if ",
        "elif ",
        "return ",
        "catch",
        "throw ",
        "fn ",
        "let ",
        "pub ",
        "Traceback (most recent",
    ];
    STARTS.iter().any(|p| t.starts_with(p))
}

/// A line of `ls -l` output (`-rw-r--r-- 1 user group 120 Jan 1 12:00 name`).
fn looks_like_listing(line: &str) -> bool {
    let b = line.trim_start().as_bytes();
    b.len() > 10
        && matches!(b[0], b'-' | b'd' | b'l' | b'c' | b'b' | b'p' | b's')
        && b[1..10]
            .iter()
            .all(|c| matches!(c, b'r' | b'w' | b'x' | b'-' | b's' | b'S' | b't' | b'T'))
}

/// Whether the match at `start..end` is part of a file name or path token
/// (`error_handler.py`, `src/errors/`, `--error-log=x.txt`).
fn inside_file_name(text: &str, start: usize, end: usize) -> bool {
    let bytes = text.as_bytes();
    let is_tok = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/');
    let mut s = start;
    while s > 0 && is_tok(bytes[s - 1]) {
        s -= 1;
    }
    let mut e = end;
    while e < bytes.len() && is_tok(bytes[e]) {
        e += 1;
    }
    let token = text[s..e].trim_end_matches('.');
    token.len() > end - start
        && (token.contains('/') || token.contains('_') || has_extension(token))
}

/// An error header and the line after it that says what failed: for a short header
/// (`ERROR:`, `Error`, `FAILED:`) the next non-empty line, unless it is code, joined.
/// Returns the joined text and where it ends.
fn error_with_message(text: &str, start: usize, end: usize) -> Option<(String, usize)> {
    let line = text[start..end].trim();
    let short = line.chars().count() < 24 || line.ends_with(':');
    if !short || end >= text.len() {
        return None;
    }
    let mut at = end + 1;
    for next in text[at..].split_inclusive('\n').take(3) {
        let t = next.trim();
        let line_end = at + next.trim_end_matches('\n').len();
        if !t.is_empty() {
            if looks_like_code(t) {
                return None;
            }
            return Some((format!("{line} {t}"), line_end));
        }
        at += next.len();
    }
    None
}

/// Short text that does not look like a tool's output relayed as a user turn.
fn reads_like_ask(text: &str) -> bool {
    let t = text.trim_start();
    t.len() <= 400 && !t.starts_with(['(', '[', '{', '<']) && !t.is_empty()
}

/// Byte offset where the last `n` lines of `text` start.
fn tail_offset(text: &str, n: usize) -> usize {
    let bytes = text.as_bytes();
    let mut end = bytes.len();
    if bytes.last() == Some(&b'\n') {
        end -= 1;
    }
    for _ in 0..n {
        match memchr::memrchr(b'\n', &bytes[..end]) {
            Some(p) => end = p,
            None => return 0,
        }
    }
    end + 1
}

/// The sentence in which the agent last said what it does next: in the span's last
/// assistant message, the last sentence with a marker ("Let me", "Next", "I'll", ...),
/// else its last question when no answer followed (the agent waits for it). Returns
/// (message, start, end).
fn last_stated_next(messages: &[Message], texts: &[Cow<'_, str>]) -> Option<(usize, usize, usize)> {
    let i = messages.iter().rposition(|m| m.role == Role::Assistant)?;
    if texts[i].trim().is_empty() || is_summary(&texts[i]) {
        return None;
    }
    // A question the user already answered is not pending.
    let answered = messages[i + 1..]
        .iter()
        .enumerate()
        .any(|(k, m)| m.role == Role::User && !is_observation(messages, i + 1 + k));
    let text: &str = &texts[i];
    let mut marked = None;
    let mut question = None;
    for (s, e) in sentences(text) {
        let sentence = &text[s..e];
        let lower = sentence.to_ascii_lowercase();
        if NEXT_MARKERS.iter().any(|k| lower.contains(k)) {
            marked = Some((s, e));
        }
        if sentence.ends_with('?') {
            question = Some((s, e));
        }
    }
    marked
        .or(question.filter(|_| !answered))
        .map(|(s, e)| (i, s, e))
}

/// Sentences of prose: split at `.`, `!`, `?` followed by a space or a line end, and
/// at line ends; fenced blocks are skipped. (start, end) byte offsets.
fn sentences(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut offset = 0;
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if t.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && !t.is_empty() {
            let base = offset + (line.len() - line.trim_start().len());
            let b = t.as_bytes();
            let mut s = 0;
            for k in 0..b.len() {
                let end_mark =
                    matches!(b[k], b'.' | b'!' | b'?') && (k + 1 == b.len() || b[k + 1] == b' ');
                if end_mark {
                    if k + 1 > s {
                        out.push((base + s, base + k + 1));
                    }
                    s = k + 1;
                    while s < b.len() && b[s] == b' ' {
                        s += 1;
                    }
                }
            }
            if s < b.len() {
                out.push((base + s, base + b.len()));
            }
        }
        offset += line.len();
    }
    out
}

/// Cuts `line` to at most `max` characters around byte offset `focus`, marking cuts
/// with `…`.
fn cut(line: &str, focus: usize, max: usize) -> Cow<'_, str> {
    if line.len() <= max || line.chars().count() <= max {
        return Cow::Borrowed(line);
    }
    let mut start = focus.saturating_sub(max / 4).min(line.len());
    while !line.is_char_boundary(start) {
        start -= 1;
    }
    let window = &line[start..];
    let end = window
        .char_indices()
        .nth(max - 2)
        .map_or(window.len(), |(i, _)| i);
    let mut out = String::with_capacity(end + 8);
    if start > 0 {
        out.push('…');
    }
    out.push_str(window[..end].trim());
    if end < window.len() {
        out.push('…');
    }
    Cow::Owned(out)
}

// ---------------------------------------------------------------------------------
// Facts: the identifiers a span introduced.

/// The most characters an identifier may have.
const MAX_FACT_CHARS: usize = 80;

/// How identifying a fact is (lower first): ids mixing letters and digits (`HAT136`,
/// `gift_card_7480005`), emails and paths; upper-case codes (`AQLBTL`, `JFK`); dates and
/// other digit strings; keyed numbers (`price=523`).
fn fact_rank(f: &str) -> u8 {
    let letters = f.bytes().any(|b| b.is_ascii_alphabetic());
    let digits = f.bytes().any(|b| b.is_ascii_digit());
    if f.starts_with('\'') {
        4
    } else if f.contains('=') {
        3
    } else if letters && digits || f.contains('@') || f.contains('/') {
        0
    } else if letters {
        1
    } else {
        2
    }
}

/// Keeps the facts not seen before in the span (and remembers them).
fn new_facts(facts: Vec<String>, seen: &mut HashSet<String>) -> Vec<String> {
    facts
        .into_iter()
        .filter(|f| seen.insert(f.clone()))
        .collect()
}

/// Whether a tool output is a structured record (JSON, a Python dict or list).
fn looks_structured(text: &str) -> bool {
    text.trim_start().starts_with(['{', '['])
}

/// The identifiers of a text, in order, each once: for structured output (JSON or a
/// Python dict) every string value that is an identifier or a short upper-case code
/// (`HAT136`, `JFK`, `2024-05-15`, `sofia_kim_7287`) and every number of three or more
/// digits with its key (`price=523`); for other text the identifier-like tokens
/// (three or more digits, letters mixed with digits, emails, paths, upper-case codes of
/// five or more characters). Clock times and the line numbers and code of listings are
/// left out.
fn facts_of<'t>(text: &'t str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    // First occurrences in order; the set makes a long listing linear, not quadratic.
    // Keyed by the text's own slices: a repeated token costs a lookup, no copy.
    let mut seen: HashSet<Cow<'t, str>> = HashSet::new();
    let mut push = |s: Cow<'t, str>| {
        if !seen.contains(s.as_ref()) {
            out.push(s.as_ref().to_owned());
            seen.insert(s);
        }
    };
    if looks_structured(text) {
        structured_facts(text, &mut push);
    } else {
        let mut literals: Vec<&str> = Vec::new();
        let mut literal_set: HashSet<&str> = HashSet::new();
        for line in text.lines() {
            if looks_like_listing(line) {
                continue;
            }
            if looks_like_code(line) {
                // Code: only its string literals, which edits and searches quote.
                for lit in string_literals(line) {
                    if literal_set.insert(lit) {
                        literals.push(lit);
                    }
                }
                continue;
            }
            for t in tokens(line) {
                if is_identifier(t) && !is_clock_time(t) {
                    push(Cow::Borrowed(t));
                }
            }
        }
        for lit in literals {
            push(Cow::Owned(format!("'{lit}'")));
        }
    }
    out
}

/// The string literals of a line of code: quoted, 3 to 40 characters, one word.
fn string_literals(line: &str) -> impl Iterator<Item = &str> {
    let b = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let q = b[i];
        if (q == b'"' || q == b'\'')
            && (i == 0 || !b[i - 1].is_ascii_alphanumeric())
            && let Some(len) = b[i + 1..].iter().position(|&c| c == q)
        {
            {
                let lit = &line[i + 1..i + 1 + len];
                if (3..=40).contains(&lit.len())
                    && lit
                        .bytes()
                        .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
                {
                    out.push(lit);
                }
                i += len + 2;
                continue;
            }
        }
        i += 1;
    }
    out.into_iter()
}

/// Walks JSON-like text: quoted strings followed by `:` are keys, other quoted strings
/// and bare numbers are values.
fn structured_facts<'t>(text: &'t str, push: &mut impl FnMut(Cow<'t, str>)) {
    let b = text.as_bytes();
    let mut key: &str = "";
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'"' || c == b'\'' {
            let start = i + 1;
            let mut j = start;
            while j < b.len() && b[j] != c {
                if b[j] == b'\\' {
                    j += 1;
                }
                j += 1;
            }
            let end = j.min(b.len());
            let s = text.get(start..end).unwrap_or("");
            let mut k = end + 1;
            while k < b.len() && b[k] == b' ' {
                k += 1;
            }
            if k < b.len() && b[k] == b':' {
                key = s;
            } else {
                let t = s.trim();
                if !t.contains(char::is_whitespace) {
                    if (is_identifier(t) || is_short_code(t)) && !is_clock_time(t) {
                        push(Cow::Borrowed(t));
                    }
                } else {
                    for tok in tokens(t) {
                        if is_identifier(tok) && !is_clock_time(tok) {
                            push(Cow::Borrowed(tok));
                        }
                    }
                }
            }
            i = end + 1;
        } else if c.is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
            let start = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                i += 1;
            }
            let num = text[start..i].trim_end_matches('.');
            if num.bytes().filter(u8::is_ascii_digit).count() >= 3 {
                if key.is_empty() || key.len() > 24 {
                    push(Cow::Borrowed(num));
                } else {
                    push(Cow::Owned(format!("{key}={num}")));
                }
            }
        } else {
            i += 1;
        }
    }
}

/// Characters that end a token.
fn is_separator(c: char) -> bool {
    if c.is_ascii() {
        // Lossless: `c` is ASCII.
        ASCII_SEPARATORS[c as usize]
    } else {
        c.is_whitespace()
    }
}

/// [`is_separator`] for each ASCII character: whitespace (as `char::is_whitespace`,
/// which counts the vertical tab) and the punctuation that ends a token.
const ASCII_SEPARATORS: [bool; 128] = {
    let mut table = [false; 128];
    let seps = b" \t\n\x0B\x0C\r\"'`()[]{}<>,;=|:*!?$#&\\";
    let mut i = 0;
    while i < seps.len() {
        table[seps[i] as usize] = true;
        i += 1;
    }
    table
};

/// Whether the comma at `i` groups the thousands of a number (`1,830`, `12,000,000`):
/// a digit before it, and exactly three after it.
fn thousands_comma(bytes: &[u8], i: usize) -> bool {
    let digit = |j: usize| bytes.get(j).is_some_and(u8::is_ascii_digit);
    i > 0 && digit(i - 1) && digit(i + 1) && digit(i + 2) && digit(i + 3) && !digit(i + 4)
}

/// The tokens of a line, trailing dots trimmed.
fn tokens(text: &str) -> impl Iterator<Item = &str> {
    Spans { text, pos: 0 }.filter_map(|t| {
        let t = t
            .trim_end_matches(['.', '-', '_', '/'])
            .trim_start_matches(['-', '_']);
        (!t.is_empty()).then_some(t)
    })
}

/// The runs of `text` between separators (a `:` before `//` is not one), untrimmed.
/// Walks bytes: every separator but non-ASCII whitespace is ASCII, and a multi-byte
/// character is decoded only to ask whether it is whitespace.
struct Spans<'t> {
    text: &'t str,
    pos: usize,
}

impl<'t> Iterator for Spans<'t> {
    type Item = &'t str;

    fn next(&mut self) -> Option<&'t str> {
        let text = self.text;
        let bytes = text.as_bytes();
        let mut start = None;
        let mut i = self.pos;
        while let Some(&b) = bytes.get(i) {
            let (sep, len) = if b.is_ascii() {
                let url = b == b':' && bytes.get(i + 1..i + 3) == Some(b"//".as_slice());
                let group = b == b',' && thousands_comma(bytes, i);
                (ASCII_SEPARATORS[usize::from(b)] && !url && !group, 1)
            } else {
                // `i` is at a character boundary: only whole characters are skipped.
                let c = text.get(i..).and_then(|r| r.chars().next());
                c.map_or((false, 1), |c| (is_separator(c), c.len_utf8()))
            };
            if sep {
                if let Some(s) = start {
                    self.pos = i + len;
                    return text.get(s..i);
                }
            } else if start.is_none() {
                start = Some(i);
            }
            i += len;
        }
        self.pos = bytes.len();
        start.and_then(|s| text.get(s..))
    }
}

/// An identifier token: three or more digits, letters mixed with digits (4+ chars),
/// an email, a path, or an upper-case code of five or more characters.
fn is_identifier(t: &str) -> bool {
    if t.len() < 3 || t.len() > MAX_FACT_CHARS {
        return false;
    }
    // One pass: most tokens are plain words, settled by their letters alone.
    let (mut digits, mut letters, mut lower, mut marks) = (0usize, 0usize, false, false);
    for b in t.bytes() {
        if b.is_ascii_digit() {
            digits += 1;
        } else if b.is_ascii_alphabetic() {
            letters += 1;
            lower |= b.is_ascii_lowercase();
        } else if matches!(b, b'@' | b'/' | b'.') {
            marks = true;
        }
    }
    if digits >= 3 || (digits > 0 && letters > 0 && t.len() >= 4) {
        return true;
    }
    // An email needs `@`, a path `/` or an extension's `.`.
    if marks {
        if let Some(at) = t.find('@')
            && at > 0
            && t[at + 1..].contains('.')
        {
            return true;
        }
        if is_path(t) {
            return true;
        }
    }
    !lower
        && t.len() >= 5
        && letters >= 3
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// `JFK`, `USD`: a whole value of three or more upper-case letters.
fn is_short_code(t: &str) -> bool {
    t.len() >= 3
        && t.len() <= MAX_FACT_CHARS
        && t.bytes().any(|b| b.is_ascii_uppercase())
        && t.bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// `08:00`, `14:30:00`, and timestamps (`2024-05-01T09:08:54`): when something
/// happened, rarely what an agent passes on.
fn is_clock_time(t: &str) -> bool {
    // Both forms below need a `:`; most tokens have none.
    if !t.as_bytes().contains(&b':') {
        return false;
    }
    if let Some((date, time)) = t.split_once('T')
        && date.len() == 10
        && date.bytes().filter(|b| *b == b'-').count() == 2
        && time.contains(':')
    {
        return true;
    }
    // `01:00:00+1`: the next day.
    let t = t.split_once('+').map_or(t, |(time, _)| time);
    let mut parts = 0;
    for p in t.split(':') {
        parts += 1;
        if parts > 3 || p.len() != 2 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
    }
    parts >= 2
}

/// Whether the last segment of `t` has a file extension (`name.ext`, the extension 1
/// to 8 letters or digits starting with a lower-case letter).
fn has_extension(t: &str) -> bool {
    let last = t.rsplit('/').next().unwrap_or(t);
    last.rsplit_once('.').is_some_and(|(stem, ext)| {
        stem.len() >= 2
            && stem.bytes().any(|b| b.is_ascii_alphanumeric())
            && (1..=8).contains(&ext.len())
            && ext.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
            && ext.bytes().all(|b| b.is_ascii_alphanumeric())
    })
}

/// A file path: `src/lib.rs`, `/tmp/out`, `./run.sh`, `a/b/c`, `setup.py` (any
/// extension).
fn is_path(t: &str) -> bool {
    if t.is_empty() || t.len() > 200 {
        return false;
    }
    // One pass: whether there is a letter, how many slashes, and what rules a path
    // out (whitespace, a URL's `://`). Whitespace beyond ASCII is looked for only in
    // a token that has non-ASCII bytes.
    let b = t.as_bytes();
    let (mut letter, mut slashes, mut non_ascii) = (false, 0usize, false);
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'/' => slashes += 1,
            b':' if b[i + 1..].starts_with(b"//") => return false,
            // `char::is_whitespace` in ASCII.
            b' ' | b'\t' | b'\n' | b'\x0B' | b'\x0C' | b'\r' => return false,
            c if c.is_ascii_alphabetic() => letter = true,
            c if !c.is_ascii() => non_ascii = true,
            _ => {}
        }
    }
    letter && !(non_ascii && t.contains(char::is_whitespace)) && path_shaped(t, slashes)
}

/// Whether a token with `slashes` slashes, no whitespace and a letter reads as a path:
/// rooted (`/`, `./`, `~/`), two or more slashes, or a file extension.
fn path_shaped(t: &str, slashes: usize) -> bool {
    if slashes == 0 {
        return has_extension(t);
    }
    t.starts_with('/')
        || t.starts_with("./")
        || t.starts_with("~/")
        || slashes >= 2
        || has_extension(t)
}

/// Whether `needle` occurs in `hay` as a whole token.
fn contains_token(hay: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    let h = hay.as_bytes();
    let n = needle.as_bytes();
    let edge_start = n[0].is_ascii_alphanumeric();
    let edge_end = n[n.len() - 1].is_ascii_alphanumeric();
    memchr::memmem::find_iter(h, n).any(|at| {
        let before = !edge_start || at == 0 || !h[at - 1].is_ascii_alphanumeric();
        let end = at + n.len();
        let after = !edge_end || end >= h.len() || !h[end].is_ascii_alphanumeric();
        before && after
    })
}

/// Spans with more text than this (in bytes) are summarized on Tokio's blocking pool
/// when a runtime is current, so a huge span never stalls the runtime's other tasks;
/// smaller ones (the common case: a few steps, well under a millisecond of work) are
/// summarized inline, without copying the span.
pub const BLOCKING_POOL_BYTES: usize = 256 * 1024;

#[async_trait]
impl Summarizer for ExtractiveSummarizer {
    /// [`summarize_sync`](ExtractiveSummarizer::summarize_sync), moved to Tokio's
    /// blocking pool for spans over [`BLOCKING_POOL_BYTES`] (the span is copied for it).
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        let bytes: usize = request
            .messages
            .iter()
            .map(|m| m.text().len())
            .fold(request.previous.map_or(0, str::len), usize::saturating_add);
        if bytes <= BLOCKING_POOL_BYTES || tokio::runtime::Handle::try_current().is_err() {
            return self.summarize_sync(request);
        }
        let summarizer = self.clone();
        let (level, budget) = (request.level, request.budget_tokens);
        let messages = request.messages.to_vec();
        let previous = request.previous.map(str::to_owned);
        tokio::task::spawn_blocking(move || {
            let mut owned = SummaryRequest::new(level, &messages, budget);
            if let Some(p) = &previous {
                owned = owned.previous(p);
            }
            summarizer.summarize_sync(&owned)
        })
        .await
        .map_err(|e| SummarizeError::Interrupted(e.to_string()))?
    }
}

#[cfg(test)]
mod tests {

    /// The first versions of the tokenizer and the identifier and clock-time tests,
    /// kept as the reference the faster ones must agree with.
    mod reference {
        use super::super::{MAX_FACT_CHARS, path_shaped};

        /// The separators as first written: whitespace and a list of punctuation.
        pub(super) fn is_separator(c: char) -> bool {
            c.is_whitespace() || "\"'`()[]{}<>,;=|:*!?$#&\\".contains(c)
        }

        pub(super) fn tokens(text: &str) -> Vec<&str> {
            let mut spans = Vec::new();
            let mut start = None;
            for (i, c) in text.char_indices() {
                let url = c == ':' && text[i + 1..].starts_with("//");
                let digits = |r: std::ops::Range<usize>| {
                    text.get(r)
                        .is_some_and(|d| d.bytes().all(|b| b.is_ascii_digit()))
                };
                let group = c == ','
                    && i > 0
                    && digits(i - 1..i)
                    && digits(i + 1..i + 4)
                    && !digits(i + 4..i + 5);
                if is_separator(c) && !url && !group {
                    if let Some(s) = start.take() {
                        spans.push((s, i));
                    }
                } else if start.is_none() {
                    start = Some(i);
                }
            }
            if let Some(s) = start {
                spans.push((s, text.len()));
            }
            spans
                .into_iter()
                .filter_map(|(s, e)| {
                    let t = text[s..e]
                        .trim_end_matches(['.', '-', '_', '/'])
                        .trim_start_matches(['-', '_']);
                    (!t.is_empty()).then_some(t)
                })
                .collect()
        }

        pub(super) fn is_identifier(t: &str) -> bool {
            if t.len() < 3 || t.len() > MAX_FACT_CHARS {
                return false;
            }
            let digits = t.bytes().filter(u8::is_ascii_digit).count();
            let letters = t.bytes().filter(u8::is_ascii_alphabetic).count();
            if digits >= 3 || (digits > 0 && letters > 0 && t.len() >= 4) {
                return true;
            }
            if let Some(at) = t.find('@')
                && at > 0
                && t[at + 1..].contains('.')
            {
                return true;
            }
            if is_path(t) {
                return true;
            }
            t.len() >= 5
                && letters >= 3
                && t.bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        }

        /// A file path: `src/lib.rs`, `/tmp/out`, `./run.sh`, `a/b/c`, `setup.py` (any
        /// extension).
        pub(super) fn is_path(t: &str) -> bool {
            if t.is_empty() || t.len() > 200 || !t.bytes().any(|b| b.is_ascii_alphabetic()) {
                return false;
            }
            if t.contains(char::is_whitespace) {
                return false;
            }
            if t.contains("://") {
                return false;
            }
            path_shaped(t, t.matches('/').count())
        }

        pub(super) fn is_clock_time(t: &str) -> bool {
            if let Some((date, time)) = t.split_once('T')
                && date.len() == 10
                && date.bytes().filter(|b| *b == b'-').count() == 2
                && time.contains(':')
            {
                return true;
            }
            let t = t.split_once('+').map_or(t, |(time, _)| time);
            let parts: Vec<&str> = t.split(':').collect();
            (2..=3).contains(&parts.len())
                && parts
                    .iter()
                    .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_digit()))
        }
    }

    #[test]
    fn the_separator_table_agrees_with_the_reference() {
        for c in (0..=0x3100u32).filter_map(char::from_u32) {
            assert_eq!(is_separator(c), reference::is_separator(c), "{c:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn one_scan_finds_the_errors_the_line_by_line_scan_finds(
            text in "(error|Failed|cannot |not found|error_log.txt|src/errors/|12:|   7\t|def |# |-rw-r--r--|-rw-r--r-- 1 a b 3 x|[a-z ]{1,8}|\r|\r\n|\n){0,24}"
        ) {
            let s = ExtractiveSummarizer::new();
            let by_line = text
                .lines()
                .any(|l| !looks_like_code(l) && !looks_like_listing(l) && s.has_error(l));
            proptest::prop_assert_eq!(reports_error(&text, &s.hits(&text)), by_line);
        }

        #[test]
        fn tokens_and_identifiers_agree_with_the_reference(
            text in "([a-zA-Z0-9]{1,12}|[0-9],[0-9]{2,4}|[ .:/@_+T\\-]|://|:/|[\"'(){}<>,;=`|*!?$#&\\[\\]\\\\]|[\t\r\x0B\x0C]|é|日|\u{a0}|\u{3000}|\u{2028}|\n){0,40}"
        ) {
            let fast: Vec<&str> = super::tokens(&text).collect();
            proptest::prop_assert_eq!(&fast, &reference::tokens(&text));
            for t in fast {
                proptest::prop_assert_eq!(super::is_identifier(t), reference::is_identifier(t), "{:?}", t);
                proptest::prop_assert_eq!(super::is_clock_time(t), reference::is_clock_time(t), "{:?}", t);
            }
        }

        #[test]
        fn paths_agree_with_the_reference(
            text in "(/|\\.|[a-z]{1,3}|[0-9_~:@-]|[ \t\r\n\x0B\x0C]|é|\u{a0}|\u{85}|\u{3000}){0,10}"
        ) {
            proptest::prop_assert_eq!(super::is_path(&text), reference::is_path(&text), "{:?}", text);
        }
    }
    use super::*;

    #[test]
    fn an_error_a_retry_got_past_is_marked_resolved_and_an_open_one_is_not() {
        let call = |id: &str, key: &str| {
            Message::assistant(format!("Reading {key}.")).with_tool_calls(vec![ToolCall::new(
                id,
                "fetch",
                serde_json::json!({"key": key}),
            )])
        };
        let steps = [
            Message::user("Fetch the records A-1 and B-2."),
            call("c1", "A-1"),
            Message::tool("c1", "HTTP 503 from the records service (transient)"),
            call("c2", "A-1"),
            Message::tool("c2", "record A-1: owner team-4"),
            call("c3", "B-2"),
            Message::tool("c3", "ERROR: permission denied for record B-2"),
            call("c4", "B-2"),
            Message::tool("c4", "ERROR: permission denied for record B-2 again"),
        ];
        let summary = ExtractiveSummarizer::new()
            .summarize_sync(&SummaryRequest::milestone(&steps, 300))
            .unwrap();
        let items = summary.section(SUMMARY).unwrap_or_default();
        let fixed: Vec<&String> = items.iter().filter(|l| l.contains("HTTP 503")).collect();
        assert_eq!(fixed.len(), 1, "{items:?}");
        assert!(
            fixed[0].ends_with("[resolved: a later fetch(A-1) succeeded]"),
            "{}",
            fixed[0]
        );
        // Retried and failing again: still open, twice.
        let open: Vec<&String> = items
            .iter()
            .filter(|l| l.contains("permission denied"))
            .collect();
        assert!(!open.is_empty(), "{items:?}");
        assert!(open.iter().all(|l| !l.contains("[resolved")), "{open:?}");

        // Carried into an epoch, the resolved one ranks below the open ones.
        let mut pool = Pool::default();
        ExtractiveSummarizer::new().carry(
            &summary.text,
            (1, 0),
            true,
            false,
            &HashSet::new(),
            &mut pool,
        );
        let prio_of = |needle: &str| {
            pool.cands
                .iter()
                .find(|c| matches!(c.src, Src::Owned(k) if pool.owned[k as usize].contains(needle)))
                .map(|c| c.prio)
        };
        assert!(prio_of("HTTP 503") < prio_of("permission denied"));
    }

    #[test]
    fn an_error_fixed_in_a_later_milestone_is_marked_resolved_in_the_epoch() {
        let call = |id: &str| {
            Message::assistant("Reading A-1.").with_tool_calls(vec![ToolCall::new(
                id,
                "fetch",
                serde_json::json!({"key": "A-1"}),
            )])
        };
        let s = ExtractiveSummarizer::new();
        let first = [
            call("c1"),
            Message::tool("c1", "connection to db-3 timed out after 30 s"),
        ];
        let second = [
            call("c2"),
            Message::tool("c2", "record A-1: owner team-4, id R-77"),
        ];
        let m1 = s
            .summarize_sync(&SummaryRequest::milestone(&first, 200))
            .unwrap();
        let open = m1.section(SUMMARY).unwrap_or_default();
        assert!(
            open.iter()
                .any(|l| l.contains("timed out") && l.ends_with("[in fetch(A-1)]")),
            "{open:?}"
        );
        let m2 = s
            .summarize_sync(&SummaryRequest::milestone(&second, 200))
            .unwrap();
        let notes = [
            Message::user(format!("[Milestone 1: step 1]\n{}", m1.text)),
            Message::user(format!("[Milestone 2: step 2]\n{}", m2.text)),
        ];
        let epoch = s
            .summarize_sync(&SummaryRequest::epoch(&notes, 300))
            .unwrap();
        let items = epoch.section(SUMMARY).unwrap_or_default();
        let line: Vec<&String> = items.iter().filter(|l| l.contains("timed out")).collect();
        assert!(
            line.iter()
                .all(|l| l.ends_with("[resolved: a later fetch(A-1) succeeded]")),
            "{items:?}"
        );
        // Without the later success it stays open.
        let alone = s
            .summarize_sync(&SummaryRequest::epoch(&notes[..1], 300))
            .unwrap();
        let items = alone.section(SUMMARY).unwrap_or_default();
        assert!(
            items
                .iter()
                .any(|l| l.contains("timed out") && !l.contains("[resolved")),
            "{items:?}"
        );
    }

    #[test]
    fn a_number_with_thousands_separators_is_one_token() {
        let t: Vec<&str> =
            tokens("file1.txt\t1,830 bytes; 12,000,000 rows, 3,14 and 1,2345").collect();
        assert_eq!(
            t,
            [
                "file1.txt",
                "1,830",
                "bytes",
                "12,000,000",
                "rows",
                "3",
                "14",
                "and",
                "1",
                "2345"
            ]
        );
        assert!(is_identifier("1,830"));
        let steps = [
            Message::user("List the directory."),
            Message::assistant("Listing.").with_tool_calls(vec![ToolCall::new(
                "c1",
                "ls",
                serde_json::json!({}),
            )]),
            Message::tool(
                "c1",
                "file1.txt\t1,830 bytes\nfile2.txt\t22,104 bytes\nfile3.txt\t950 bytes",
            ),
        ];
        let summary = ExtractiveSummarizer::new()
            .summarize_sync(&SummaryRequest::milestone(&steps, 300))
            .unwrap();
        assert!(
            summary.text.contains("1,830") && !summary.text.contains(" 830"),
            "{}",
            summary.text
        );
    }

    #[test]
    fn paths_of_any_extension() {
        for p in [
            "src/lib/fields.py",
            "notes.md",
            "/etc/hosts",
            "./run.sh",
            "Cargo.lock",
            "a/b/c",
            "data.parquet",
            "docs/é/x",
        ] {
            assert!(is_path(p), "{p}");
        }
        for p in [
            "https://x.io/a.py",
            "and/or",
            "e.g",
            "1.2.3",
            "hello",
            // Whitespace, ASCII or not, rules a path out.
            "a/b/c\u{0B}",
            "src/ lib.rs",
            "a/b/c\u{a0}",
            "a/b\u{3000}/c",
            "x/y/z\u{85}",
        ] {
            assert!(!is_path(p), "{p}");
        }
    }

    #[test]
    fn cut_windows_around_the_focus() {
        let line = format!("{}ERROR here{}", "x".repeat(300), "y".repeat(300));
        let focus = line.find("ERROR").unwrap_or(0);
        let c = cut(&line, focus, 100);
        assert!(c.contains("ERROR here"));
        assert!(c.starts_with('…') && c.ends_with('…'));
        assert!(c.chars().count() <= 100);
        assert_eq!(cut("short", 0, 100), "short");
        assert!(cut(&"é".repeat(200), 7, 50).chars().count() <= 50);
    }

    #[test]
    fn tail_offset_counts_lines() {
        assert_eq!(tail_offset("a\nb\nc\n", 2), 2);
        assert_eq!(tail_offset("a\nb\nc", 5), 0);
    }

    #[test]
    fn scan_reports_lines_with_keywords() {
        let s = ExtractiveSummarizer::new();
        let text =
            "all good\nFatal ERROR: disk\nsaved to out.log\n-rw-r--r-- 1 u g 10 error_log.txt\n";
        let mut lines = Vec::new();
        s.scan(text, |a, b, kinds, _| lines.push((&text[a..b], kinds)));
        assert_eq!(lines, [("Fatal ERROR: disk", Kind::Error.bit())]);
    }

    #[test]
    fn facts_of_records_and_text() {
        let record = r#"{"reservation_id": "OI5L9G", "origin": "MCO", "cabin": "business", "flights": [{"flight_number": "HAT017", "date": "2024-05-25", "departure": "08:00:00", "price": 523, "seats": 9}]}"#;
        assert_eq!(
            facts_of(record),
            ["OI5L9G", "MCO", "HAT017", "2024-05-25", "price=523"]
        );
        let text = "HTTP 503 from api.internal, incident INC-77341 (see /var/log/api.log)\n  12:    x = 1234\n";
        assert_eq!(
            facts_of(text),
            ["503", "api.internal", "INC-77341", "/var/log/api.log"]
        );
    }

    #[test]
    fn merged_facts_items_split_back_per_call() {
        assert_eq!(
            facts_items("get(A1) → x y; (B2) → z"),
            [
                ("get(A1)".to_owned(), vec!["x".to_owned(), "y".to_owned()]),
                ("get(B2)".to_owned(), vec!["z".to_owned()]),
            ]
        );
    }

    #[test]
    fn sentences_and_the_stated_next_step() {
        let msgs = [
            Message::assistant("I checked the file. Now let's run the tests.\n```\npytest\n```"),
            Message::user("3 passed"),
        ];
        let texts: Vec<Cow<'_, str>> = msgs.iter().map(Message::text).collect();
        let (i, s, e) = last_stated_next(&msgs, &texts).unwrap_or_default();
        assert_eq!((i, &texts[0][s..e]), (0, "Now let's run the tests."));
    }
}
