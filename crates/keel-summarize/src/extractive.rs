use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};
use async_trait::async_trait;
use keel_message::{Message, Role};
use keel_token::{ApproxCounter, TokenCounter};

use crate::llm::render_sections;
use crate::summary::{bullet_text, heading_of, parse_bullets, parse_sections};
use crate::{
    ARTIFACTS, Level, NEXT_STEPS, SECTIONS, SESSION_INTENT, SUMMARY, Section, SummarizeError,
    Summarizer, Summary, SummaryRequest,
};

/// The version recorded on extractive summaries.
pub const EXTRACTIVE_VERSION: &str = "extractive-v1";

/// The model name recorded on extractive summaries.
pub const EXTRACTIVE_MODEL: &str = "extractive";

/// What a keyword says about its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Error,
    Exit,
    Decision,
    Next,
    Success,
    /// A file extension: the token around it is a path.
    Ext,
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
    ("unable to", Kind::Error),
    ("refused", Kind::Error),
    ("timed out", Kind::Error),
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
    (".py", Kind::Ext),
    (".rs", Kind::Ext),
    (".js", Kind::Ext),
    (".ts", Kind::Ext),
    (".go", Kind::Ext),
    (".java", Kind::Ext),
    (".cpp", Kind::Ext),
    (".json", Kind::Ext),
    (".toml", Kind::Ext),
    (".yaml", Kind::Ext),
    (".yml", Kind::Ext),
    (".md", Kind::Ext),
    (".txt", Kind::Ext),
    (".cfg", Kind::Ext),
    (".ini", Kind::Ext),
    (".sh", Kind::Ext),
    (".lock", Kind::Ext),
    (".html", Kind::Ext),
    (".sql", Kind::Ext),
    (".csv", Kind::Ext),
    (".log", Kind::Ext),
];

/// Candidate priorities: higher is kept first when the budget is short.
mod prio {
    pub const PENDING: u16 = 100;
    pub const FIRST_ASK: u16 = 95;
    pub const LAST_ASK: u16 = 90;
    pub const OPEN_ERROR: u16 = 80;
    pub const CARRIED_ERROR: u16 = 72;
    pub const ERROR: u16 = 70;
    pub const EXIT: u16 = 62;
    pub const COMMAND: u16 = 60;
    pub const NOTE: u16 = 58;
    pub const DECISION: u16 = 55;
    pub const SUCCESS: u16 = 50;
    pub const PATH: u16 = 40;
    pub const CARRIED: u16 = 35;
    pub const OTHER_ASK: u16 = 30;
    pub const NUMBER: u16 = 20;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Sec {
    Intent = 0,
    Summary = 1,
    Artifacts = 2,
    Next = 3,
}

/// Where a candidate's text comes from: a slice of a message's text (cut around
/// `focus` when too long), or an owned string.
#[derive(Debug, Clone, Copy)]
enum Src {
    Slice {
        msg: u32,
        start: u32,
        end: u32,
        focus: u32,
    },
    Owned(u32),
}

#[derive(Debug, Clone, Copy)]
struct Cand {
    prio: u16,
    sec: Sec,
    /// Position in the input, for output order: message index, then offset.
    order: (u32, u32),
    src: Src,
}

/// Candidates kept for selection at most (the highest priorities).
const MAX_CANDIDATES: usize = 4096;

/// The embedded, offline summarizer: deterministic, no model, fast.
///
/// It keeps the lines that carry signal, verbatim, in the four [`SECTIONS`]:
///
/// * SESSION INTENT: the user's asks (the first two lines of the first user message,
///   and of later user messages that read like a person talking: short, not a tool's
///   output relayed as a user turn);
/// * SUMMARY: error lines (the latest, unanswered ones first), decisions ("because",
///   "instead", "the fix", ...), successes, and lines with numbers from the assistant;
///   lines of source code and numbered file listings in tool output are not taken as
///   errors, however often they say `Error`;
/// * ARTIFACTS: tool calls and fenced commands, exit status lines, file paths;
/// * NEXT STEPS: tool calls still waiting for their result, and the last assistant
///   message's "next"/"todo"/"pending" lines.
///
/// When the budget is short, higher-priority lines win and later ones beat earlier
/// ones, with each section first limited to a share of the budget (so error lines
/// cannot crowd out the commands and paths) and the rest filled by priority; the kept
/// lines appear in input order, each once. Long lines are cut to a window around
/// their keyword. The previous summary's items (and, at the epoch level, the items of
/// milestone summaries given as messages) are carried over with lower priority than
/// new facts, except their error lines, which stay until the budget forces them out.
/// System messages are skipped; goal-anchor messages are refused
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
        let mut owned: Vec<String> = Vec::new();
        let mut cands: Vec<Cand> = Vec::new();
        self.collect(request, &texts, &mut owned, &mut cands);
        let sections = self.select(request.budget_tokens, &texts, &owned, cands)?;
        Ok(Summary {
            level: request.level,
            text: render_sections(&sections),
            sections,
            prompt_version: EXTRACTIVE_VERSION.to_owned(),
            model: EXTRACTIVE_MODEL.to_owned(),
            usage: None,
        })
    }

    fn collect(
        &self,
        request: &SummaryRequest<'_>,
        texts: &[Cow<'_, str>],
        owned: &mut Vec<String>,
        cands: &mut Vec<Cand>,
    ) {
        let messages = request.messages;

        // Carried over from the previous summary of this level.
        if let Some(previous) = request.previous {
            for (sec, item) in structured_items(previous) {
                let prio = if self.has_error(&item) {
                    prio::CARRIED_ERROR
                } else {
                    prio::CARRIED
                };
                let src = push_owned(owned, item);
                cands.push(Cand {
                    prio,
                    sec,
                    order: (0, 0),
                    src,
                });
            }
        }

        let first_user = messages.iter().position(|m| m.role == Role::User);
        let last_user = messages.iter().rposition(|m| m.role == Role::User);
        let last_assistant = messages.iter().rposition(|m| m.role == Role::Assistant);
        let last_caller = messages
            .iter()
            .rposition(|m| m.role == Role::Assistant && !m.tool_calls.is_empty());
        let answered: HashSet<&str> = messages
            .iter()
            .filter_map(|m| m.tool_call_id.as_deref())
            .collect();

        for (i, (m, text)) in messages.iter().zip(texts).enumerate() {
            let order = (i as u32) + 1;
            if m.role == Role::System {
                continue;
            }
            // Summaries given as input (epoch level): keep their items.
            if m.role != Role::Tool && text.lines().any(|l| heading_of(l).is_some()) {
                for (sec, item) in structured_items(text) {
                    let prio = if self.has_error(&item) {
                        prio::CARRIED_ERROR
                    } else {
                        prio::NOTE
                    };
                    let src = push_owned(owned, item);
                    cands.push(Cand {
                        prio,
                        sec,
                        order: (order, 0),
                        src,
                    });
                }
                continue;
            }
            if request.level == Level::Epoch && m.role != Role::Tool {
                let (bullets, _) = parse_bullets(text);
                for item in bullets {
                    let prio = if self.has_error(&item) {
                        prio::CARRIED_ERROR
                    } else {
                        prio::NOTE
                    };
                    let src = push_owned(owned, item);
                    cands.push(Cand {
                        prio,
                        sec: Sec::Summary,
                        order: (order, 0),
                        src,
                    });
                }
            }

            // The user's asks: the first user message, and later ones that read like
            // a person talking rather than a tool's output relayed as a user turn.
            let ask = if Some(i) == first_user {
                Some(prio::FIRST_ASK)
            } else if m.role == Role::User && reads_like_ask(text) {
                Some(if Some(i) == last_user {
                    prio::LAST_ASK
                } else {
                    prio::OTHER_ASK
                })
            } else {
                None
            };
            if let Some(ask) = ask {
                let mut offset = 0;
                let mut taken = 0;
                for line in text.split_inclusive('\n') {
                    let trimmed = line.trim();
                    if !trimmed.is_empty() && taken < 2 {
                        let start = offset + (line.len() - line.trim_start().len());
                        cands.push(Cand {
                            prio: ask,
                            sec: Sec::Intent,
                            order: (order, start as u32),
                            src: Src::Slice {
                                msg: i as u32,
                                start: start as u32,
                                end: (start + trimmed.len()) as u32,
                                focus: start as u32,
                            },
                        });
                        taken += 1;
                    }
                    offset += line.len();
                    if taken == 2 {
                        break;
                    }
                }
            }

            if m.role == Role::Assistant {
                for call in &m.tool_calls {
                    let line = format!("{}({})", call.name, call.arguments.to_json_string());
                    let pending = !answered.contains(call.id.as_str());
                    let src = push_owned(owned, cut(&line, 0, self.max_item_chars).into_owned());
                    cands.push(Cand {
                        prio: if pending {
                            prio::PENDING
                        } else {
                            prio::COMMAND
                        },
                        sec: if pending { Sec::Next } else { Sec::Artifacts },
                        order: (order, u32::MAX),
                        src,
                    });
                }
                self.fenced_commands(i, text, cands);
            }

            let is_output = matches!(m.role, Role::Tool | Role::User);
            let open = last_caller.is_some_and(|c| i > c);
            let tail_start = tail_offset(text, 5);
            self.scan(text, |line_start, line_end, kinds, focus, exts| {
                let slice = |focus: usize| Src::Slice {
                    msg: i as u32,
                    start: line_start as u32,
                    end: line_end as u32,
                    focus: focus as u32,
                };
                let at = (order, line_start as u32);
                let has = |k: Kind| kinds & k.bit() != 0;
                let code = is_output && looks_like_code(&text[line_start..line_end]);
                if code {
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
                    cands.push(Cand {
                        prio: p,
                        sec: Sec::Summary,
                        order: at,
                        src: slice(focus),
                    });
                } else if has(Kind::Exit) {
                    cands.push(Cand {
                        prio: prio::EXIT,
                        sec: Sec::Artifacts,
                        order: at,
                        src: slice(focus),
                    });
                } else if m.role == Role::Assistant && has(Kind::Next) && Some(i) == last_assistant
                {
                    cands.push(Cand {
                        prio: prio::PENDING,
                        sec: Sec::Next,
                        order: at,
                        src: slice(focus),
                    });
                } else if m.role == Role::Assistant && has(Kind::Decision) {
                    cands.push(Cand {
                        prio: prio::DECISION,
                        sec: Sec::Summary,
                        order: at,
                        src: slice(focus),
                    });
                } else if has(Kind::Success) {
                    cands.push(Cand {
                        prio: if is_output {
                            prio::SUCCESS - 5
                        } else {
                            prio::SUCCESS
                        },
                        sec: Sec::Summary,
                        order: at,
                        src: slice(focus),
                    });
                }
                for &e in exts {
                    if let Some((s, t)) = path_around(text, e) {
                        cands.push(Cand {
                            prio: prio::PATH,
                            sec: Sec::Artifacts,
                            order: (order, s as u32),
                            src: Src::Slice {
                                msg: i as u32,
                                start: s as u32,
                                end: t as u32,
                                focus: s as u32,
                            },
                        });
                    }
                }
            });

            // Numbers the assistant states.
            if m.role == Role::Assistant {
                let mut offset = 0;
                for line in text.split_inclusive('\n') {
                    let t = line.trim();
                    if t.len() > 8 && t.bytes().any(|b| b.is_ascii_digit()) && bullet_or_plain(t) {
                        let start = offset + (line.len() - line.trim_start().len());
                        cands.push(Cand {
                            prio: prio::NUMBER,
                            sec: Sec::Summary,
                            order: (order, start as u32),
                            src: Src::Slice {
                                msg: i as u32,
                                start: start as u32,
                                end: (start + t.len()) as u32,
                                focus: start as u32,
                            },
                        });
                    }
                    offset += line.len();
                }
            }
        }
    }

    /// The first line of each fenced block in an assistant message: the command it ran.
    fn fenced_commands(&self, i: usize, text: &str, cands: &mut Vec<Cand>) {
        let mut offset = 0;
        let mut inside = false;
        let mut first = false;
        for line in text.split_inclusive('\n') {
            let t = line.trim();
            if t.starts_with("```") {
                inside = !inside;
                first = inside;
            } else if inside && first && !t.is_empty() {
                first = false;
                let start = offset + (line.len() - line.trim_start().len());
                cands.push(Cand {
                    prio: prio::COMMAND,
                    sec: Sec::Artifacts,
                    order: ((i as u32) + 1, start as u32),
                    src: Src::Slice {
                        msg: i as u32,
                        start: start as u32,
                        end: (start + t.len()) as u32,
                        focus: start as u32,
                    },
                });
            }
            offset += line.len();
        }
    }

    fn has_error(&self, text: &str) -> bool {
        let mut found = false;
        self.scan(text, |_, _, kinds, _, _| {
            found |= kinds & Kind::Error.bit() != 0;
        });
        found
    }

    /// Calls `f(line_start, line_end, kinds, focus, ext_offsets)` for every line of
    /// `text` with at least one keyword; `focus` is the first non-extension match.
    fn scan(&self, text: &str, mut f: impl FnMut(usize, usize, u8, usize, &[usize])) {
        let bytes = text.as_bytes();
        let mut exts: Vec<usize> = Vec::new();
        let mut current: Option<(usize, usize, u8, usize)> = None;
        let mut flush = |current: &mut Option<(usize, usize, u8, usize)>, exts: &mut Vec<usize>| {
            if let Some((s, e, kinds, focus)) = current.take() {
                f(
                    s,
                    e,
                    kinds,
                    if focus == usize::MAX { s } else { focus },
                    exts,
                );
            }
            exts.clear();
        };
        let mut on_match = |start: usize, kind: Kind| {
            if current.is_none_or(|(_, e, _, _)| start >= e) {
                flush(&mut current, &mut exts);
                let s = memchr::memrchr(b'\n', &bytes[..start]).map_or(0, |p| p + 1);
                let e = memchr::memchr(b'\n', &bytes[start..]).map_or(bytes.len(), |p| start + p);
                current = Some((s, e, 0, usize::MAX));
            }
            if let Some(cur) = current.as_mut() {
                if kind == Kind::Ext {
                    exts.push(start);
                } else {
                    cur.2 |= kind.bit();
                    cur.3 = cur.3.min(start);
                }
            }
        };
        match &self.matcher {
            Some(ac) => {
                for m in ac.find_iter(bytes) {
                    on_match(m.start(), KEYWORDS[m.pattern().as_usize()].1);
                }
            }
            None => {
                // Slow path, only if the automaton failed to build.
                let lower = text.to_ascii_lowercase();
                let mut hits: Vec<(usize, Kind)> = KEYWORDS
                    .iter()
                    .flat_map(|(k, kind)| lower.match_indices(k).map(|(p, _)| (p, *kind)))
                    .collect();
                hits.sort_by_key(|h| h.0);
                for (p, kind) in hits {
                    on_match(p, kind);
                }
            }
        }
        flush(&mut current, &mut exts);
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
        }
    }

    fn select(
        &self,
        budget: usize,
        texts: &[Cow<'_, str>],
        owned: &[String],
        mut cands: Vec<Cand>,
    ) -> Result<Vec<Section>, SummarizeError> {
        let empty: Vec<Section> = SECTIONS
            .iter()
            .map(|t| Section {
                title: (*t).to_owned(),
                items: Vec::new(),
            })
            .collect();
        let base = self.counter.count_text(&render_sections(&empty));
        if budget < base {
            return Err(SummarizeError::BudgetTooSmall {
                budget,
                needed: base,
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

        // First pass: each section gets at most its share of the room, so one kind of
        // line cannot crowd out the others. Second pass: what is left, by priority.
        let room = budget - base;
        let caps = [room * 15 / 100, room / 2, room / 4, room / 5];
        let mut spent = [0usize; 4];
        let mut used = base;
        let mut seen: HashSet<Cow<'_, str>> = HashSet::new();
        let mut chosen: Vec<(Cand, Cow<'_, str>, usize)> = Vec::new();
        let mut deferred: Vec<Cand> = Vec::new();
        for pass in 0..2 {
            let list = if pass == 0 {
                std::mem::take(&mut cands)
            } else {
                std::mem::take(&mut deferred)
            };
            for c in list {
                if budget - used < 3 {
                    break;
                }
                let text = self.resolve(c.src, texts, owned);
                if text.is_empty() || seen.contains(&text) {
                    continue;
                }
                let cost = self.counter.count_text(&text) + 1;
                if used + cost > budget {
                    continue;
                }
                let sec = c.sec as usize;
                if pass == 0 && spent[sec] + cost > caps[sec] {
                    deferred.push(c);
                    continue;
                }
                spent[sec] += cost;
                used += cost;
                seen.insert(text.clone());
                chosen.push((c, text, cost));
            }
        }

        // Exact check on the rendered text; drop the least important until it fits.
        loop {
            let sections = assemble(&chosen);
            if self.counter.count_text(&render_sections(&sections)) <= budget || chosen.is_empty() {
                return Ok(sections);
            }
            chosen.pop();
        }
    }
}

fn assemble(chosen: &[(Cand, Cow<'_, str>, usize)]) -> Vec<Section> {
    let mut sorted: Vec<&(Cand, Cow<'_, str>, usize)> = chosen.iter().collect();
    sorted.sort_by_key(|(c, _, _)| (c.sec, c.order));
    let titles = [SESSION_INTENT, SUMMARY, ARTIFACTS, NEXT_STEPS];
    let mut sections: Vec<Section> = titles
        .iter()
        .map(|t| Section {
            title: (*t).to_owned(),
            items: Vec::new(),
        })
        .collect();
    for (c, text, _) in sorted {
        if let Some(s) = sections.get_mut(c.sec as usize) {
            s.items.push(text.to_string());
        }
    }
    sections
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

/// A line of source code or of a numbered file listing, rather than a message.
fn looks_like_code(line: &str) -> bool {
    let t = line.trim_start();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits > 0 && t[digits..].starts_with(':') {
        return true;
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
        "Traceback (most recent",
    ];
    STARTS.iter().any(|p| t.starts_with(p))
}

/// Short text that does not look like a tool's output relayed as a user turn.
fn reads_like_ask(text: &str) -> bool {
    let t = text.trim_start();
    t.len() <= 400 && !t.starts_with(['(', '[', '{', '<']) && !t.is_empty()
}

fn bullet_or_plain(line: &str) -> bool {
    bullet_text(line).is_some() || !line.starts_with(['{', '[', '<', '|'])
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

fn is_path_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/' | b'~')
}

/// The path token around an extension match at `at`: `(start, end)` byte offsets.
fn path_around(text: &str, at: usize) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut start = at;
    while start > 0 && is_path_byte(bytes[start - 1]) {
        start -= 1;
    }
    let mut end = at + 1;
    while end < bytes.len() && bytes[end].is_ascii_alphanumeric() {
        end += 1;
    }
    let stem = &text[start..at];
    let stem = stem.trim_start_matches(['.', '/', '-']);
    if stem.is_empty() || !stem.bytes().any(|b| b.is_ascii_alphabetic()) {
        return None;
    }
    // Not part of a URL (`https://host/x.py`) or a dotted identifier (`os.path.join`).
    if start >= 1 && bytes[start - 1] == b':' && text[start..].starts_with("//") {
        return None;
    }
    let ext = &text[at + 1..end];
    let known = KEYWORDS
        .iter()
        .any(|(k, kind)| *kind == Kind::Ext && k[1..].eq_ignore_ascii_case(ext));
    known.then_some((start, end))
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

fn push_owned(owned: &mut Vec<String>, text: String) -> Src {
    owned.push(text);
    Src::Owned((owned.len() - 1) as u32)
}

#[async_trait]
impl Summarizer for ExtractiveSummarizer {
    async fn summarize(&self, request: &SummaryRequest<'_>) -> Result<Summary, SummarizeError> {
        self.summarize_sync(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_found_and_urls_skipped() {
        let text = "edit src/lib/fields.py then see https://x.io/a.py and os.path.join; notes.md.";
        let at = |needle: &str| text.find(needle).unwrap_or(0);
        assert_eq!(
            path_around(text, at(".py then")).map(|(s, e)| &text[s..e]),
            Some("src/lib/fields.py")
        );
        assert_eq!(path_around(text, at(".py and")), None);
        assert_eq!(
            path_around(text, at(".md.")).map(|(s, e)| &text[s..e]),
            Some("notes.md")
        );
        assert_eq!(path_around("v1.2.rs", 4).map(|_| ()), Some(()));
        assert_eq!(path_around("1.2.rs", 3), None);
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
        let text = "all good\nFatal ERROR: disk\nsaved to out.log\n";
        let mut lines = Vec::new();
        s.scan(text, |a, b, kinds, _, exts| {
            lines.push((&text[a..b], kinds, exts.len()));
        });
        assert_eq!(
            lines,
            [
                ("Fatal ERROR: disk", Kind::Error.bit(), 0),
                ("saved to out.log", 0, 1)
            ]
        );
    }
}
