//! What the evals share: the key chain the agent walks, the scripted *reader* that
//! decides from its prompt alone, a recorder of every prompt it was sent, and the
//! agent settings that force compaction often.
//!
//! The reader keeps no state between calls. Each reply is a function of the prompt:
//!
//! 1. A `Final question:` naming a marker in double quotes (`after "vault code is"`)
//!    is answered from the prompt when some message shows the marker; otherwise the
//!    reader greps for it: in the offloaded result a stub in the prompt points to, or
//!    else in the archive.
//! 2. A grep hit that shows the marker and its value answers; a hit that does not
//!    (an archive record cut at the line limit) is read back with `read_file` at that
//!    line, and the record's message answers. No hit: it says it cannot answer.
//! 3. A tool result saying `retry the same call` is retried (the call is found in the
//!    prompt by its id).
//! 4. A tool result naming `next key: K` makes it visit `K`; `next key: none` ends the
//!    walk with an answer naming the last key.
//! 5. A prompt with no tool result yet starts at the key the goal or the newest user
//!    message names (`Start at key K`).
//! 6. Anything else: it says it cannot continue (so a prompt that lost what the reader
//!    needs shows as a different action, never as a silent guess).

use std::sync::{Arc, Mutex, PoisonError};

use keel_agent::AgentBuilder;
use keel_compaction::{CompactionConfig, GOAL_ID, LAYER_METADATA_KEY};
use keel_message::{Message, Role, Tool, ToolCall, ToolContext, ToolFuture, ToolSpec};
use keel_model::{ChatResponse, PolicyModel};
use keel_token::{Encoding, ModelProfile};
use serde_json::{Value, json};

/// How a final question starts.
pub const FINAL_QUESTION: &str = "Final question:";
/// The call id of the reader's grep for a final question.
pub const ASK_GREP: &str = "ask-grep";
/// The call id of the reader's read-back of a grep hit.
pub const ASK_READ: &str = "ask-read";
/// How an answer to a final question starts.
pub const ANSWER: &str = "ANSWER:";

/// The context window of the evals' model profile, in tokens.
pub const WINDOW: usize = 8_000;
/// The reply reserve of the profile.
pub const MAX_OUTPUT: usize = 1_000;
/// The token trigger's fraction of the input budget: compaction forced often.
pub const WINDOW_FRACTION: f64 = 0.15;

/// The model profile every eval uses (approximate counts, so runs are exact repeats).
pub fn profile() -> ModelProfile {
    ModelProfile::new(
        "keel-eval-reader",
        WINDOW,
        MAX_OUTPUT,
        Encoding::Approximate,
    )
}

/// Compaction forced often: at 15% of the input budget, no step trigger, an epoch
/// every 3 milestones.
pub fn forced() -> CompactionConfig {
    CompactionConfig::default()
        .with_every_steps(None)
        .with_window_fraction(WINDOW_FRACTION)
        .with_epoch_every(3)
}

/// Compaction off: no step trigger and a token trigger the prompt never reaches.
pub fn off() -> CompactionConfig {
    CompactionConfig::default()
        .with_every_steps(None)
        .with_window_fraction(1.0)
        .with_max_steps(10_000)
}

/// The key of position `i` in the chain.
pub fn key(i: usize) -> String {
    format!("K-{i:04}")
}

/// What the chain's `visit` tool answers for a key: a record with a few facts and
/// filler lines (so steps have weight and compaction comes often), then the next key.
pub fn record(i: usize, len: usize) -> String {
    let mut out = format!(
        "record {} (shard S-{:02}, owner team-{}, checksum 0x{:08x})\n",
        key(i),
        i % 17,
        i % 9,
        (i as u64).wrapping_mul(2_654_435_761) & 0xffff_ffff
    );
    for line in 0..6 {
        out.push_str(&format!(
            "  log {line}: replica r{line} of {} answered in {} ms, status ok\n",
            key(i),
            10 + (i * 7 + line * 3) % 90
        ));
    }
    out.push_str(&next_line(i, len));
    out
}

/// The last line of a record: the next key, or the end.
pub fn next_line(i: usize, len: usize) -> String {
    if i + 1 < len {
        format!("next key: {}", key(i + 1))
    } else {
        "next key: none (end of chain)".to_owned()
    }
}

type Visit = dyn Fn(&str) -> Result<String, String> + Send + Sync;

/// The chain's tool, `visit(key)`, answering with `answer(key)` (an `Err` becomes a
/// failed tool call, which the agent turns into a tool message).
pub struct VisitTool {
    answer: Box<Visit>,
}

impl VisitTool {
    /// A `visit` tool over a plain chain of `len` records.
    pub fn chain(len: usize) -> Self {
        Self::new(move |k| match index(k) {
            Some(i) if i < len => Ok(record(i, len)),
            _ => Err(format!("no record named {k}")),
        })
    }

    /// A `visit` tool answering with `answer`.
    pub fn new(answer: impl Fn(&str) -> Result<String, String> + Send + Sync + 'static) -> Self {
        VisitTool {
            answer: Box::new(answer),
        }
    }
}

/// The position a key names.
pub fn index(key: &str) -> Option<usize> {
    key.strip_prefix("K-")?.parse().ok()
}

impl Tool for VisitTool {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "visit",
            "Reads the record stored under a key.",
            json!({"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
        )
    }

    fn call(&self, arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let key = arguments["key"].as_str().unwrap_or_default().to_owned();
            (self.answer)(&key).map_err(keel_message::ToolError::failed)
        })
    }
}

/// One model call as the reader saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The prompt, message by message: `[role, text, tool_call_id, tool calls, layer]`
    /// (no message ids: they are not the model's business).
    pub prompt: Vec<Value>,
    /// The reply: `[text, tool calls]`.
    pub reply: Value,
    /// Summary layers (milestones, epochs, eras) in the prompt.
    pub layers: usize,
    /// The goal message's text, if the prompt had one.
    pub goal: Option<String>,
}

impl Turn {
    /// The tool calls of the reply, as `name(arguments)`.
    pub fn calls(&self) -> Vec<String> {
        self.reply[1]
            .as_array()
            .map(|calls| {
                calls
                    .iter()
                    .filter_map(|c| c.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The reply's text.
    pub fn text(&self) -> &str {
        self.reply[0].as_str().unwrap_or_default()
    }

    /// The prompt's size in characters of text.
    pub fn chars(&self) -> usize {
        self.prompt
            .iter()
            .map(|m| m[1].as_str().map_or(0, str::len))
            .sum()
    }

    /// The texts of the summary layers in the prompt.
    pub fn layer_texts(&self) -> Vec<(String, String)> {
        self.prompt
            .iter()
            .filter_map(|m| {
                let layer = m[4].as_str()?;
                Some((layer.to_owned(), m[1].as_str()?.to_owned()))
            })
            .collect()
    }

    /// One JSON line for a transcript.
    pub fn to_json(&self) -> Value {
        json!({"prompt": self.prompt, "reply": self.reply})
    }
}

/// A message as the recorder keeps it.
pub fn comparable(m: &Message) -> Value {
    json!([
        m.role.to_string(),
        m.text(),
        m.tool_call_id,
        calls_of(m),
        m.metadata.get(LAYER_METADATA_KEY).and_then(Value::as_str),
    ])
}

fn calls_of(m: &Message) -> Vec<String> {
    m.tool_calls
        .iter()
        .map(|c| format!("{}({})", c.name, c.arguments.to_json_string()))
        .collect()
}

/// Every prompt a model was sent, with its reply.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    turns: Arc<Mutex<Vec<Turn>>>,
}

impl Recorder {
    /// Records a call.
    pub fn record(&self, prompt: &[Message], reply: &Message) {
        let turn = Turn {
            prompt: prompt.iter().map(comparable).collect(),
            reply: json!([reply.text(), calls_of(reply)]),
            layers: prompt
                .iter()
                .filter(|m| m.metadata.contains_key(LAYER_METADATA_KEY))
                .count(),
            goal: prompt
                .iter()
                .find(|m| m.id.as_deref() == Some(GOAL_ID))
                .map(|m| m.text().into_owned()),
        };
        self.turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(turn);
    }

    /// The turns so far.
    pub fn turns(&self) -> Vec<Turn> {
        self.turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The scripted reader as a model, recording every call.
pub fn reader_model(recorder: Recorder) -> PolicyModel {
    PolicyModel::new("keel-eval-reader", move |prompt, _tools| {
        let reply = reply(prompt);
        recorder.record(prompt, &reply);
        Ok(ChatResponse::new(reply, "keel-eval-reader"))
    })
}

/// The evals' counter: four characters a token, whatever they are. The evals' window
/// and trigger fraction were chosen for it, so a change to keel-token's default
/// estimate does not change what they test.
pub fn counter() -> keel_token::ApproxCounter {
    keel_token::ApproxCounter::new().with_chars_per_token(4)
}

/// An agent builder with the reader, the eval profile and the `visit` tool.
pub fn builder(model: Arc<dyn keel_model::ChatModel>, visit: VisitTool) -> AgentBuilder {
    keel_agent::Agent::builder()
        .model(model)
        .profile(profile())
        .counter(Arc::new(keel_token::MemoCounter::new(counter())))
        .summarizer(Arc::new(
            keel_summarize::ExtractiveSummarizer::new().with_counter(Arc::new(counter())),
        ))
        .system(
            "You walk a chain of records with `visit`. History that leaves your context is \
             archived: `grep` and `read_file` under archive/ read it back; large results are \
             under large_tool_results/.",
        )
        .tool(Arc::new(visit))
}

/// The reader's reply to a prompt (see the module docs for its rules).
pub fn reply(prompt: &[Message]) -> Message {
    let Some(last) = prompt.last() else {
        return Message::assistant("I cannot continue: my prompt is empty.");
    };
    let text = last.text();
    if last.role == Role::User && text.starts_with(FINAL_QUESTION) {
        return ask(prompt, &text);
    }
    if last.role == Role::Tool {
        match last.tool_call_id.as_deref() {
            Some(ASK_GREP) => return after_grep(prompt, &text),
            Some(ASK_READ) => return after_read(prompt, &text),
            _ => {}
        }
        if text.contains("retry the same call") {
            return retry(prompt, last);
        }
        if let Some(next) = after(&text, "next key: ") {
            return if next == "none" {
                let current = last
                    .tool_call_id
                    .as_deref()
                    .and_then(|id| id.strip_prefix("visit-"))
                    .unwrap_or("?");
                Message::assistant(format!("Reached the end of the chain at {current}."))
            } else {
                visit(&next, "")
            };
        }
        return Message::assistant(
            "I cannot continue: the last tool result names no next key and asks for no retry.",
        );
    }
    if !prompt.iter().any(|m| m.role == Role::Tool) || last.role == Role::User {
        let start = prompt
            .iter()
            .rev()
            .filter(|m| m.role == Role::User || m.id.as_deref() == Some(GOAL_ID))
            .find_map(|m| after(&m.text(), "Start at key "));
        if let Some(start) = start {
            return visit(&start, "");
        }
    }
    Message::assistant("I cannot continue: my prompt does not say what to do next.")
}

fn visit(key: &str, suffix: &str) -> Message {
    Message::assistant(format!("Next I will visit {key}.")).with_tool_calls(vec![ToolCall::new(
        format!("visit-{key}{suffix}"),
        "visit",
        json!({ "key": key }),
    )])
}

fn retry(prompt: &[Message], last: &Message) -> Message {
    let id = last.tool_call_id.as_deref().unwrap_or_default();
    let call = prompt
        .iter()
        .flat_map(|m| &m.tool_calls)
        .find(|c| c.id == id);
    match call {
        Some(call) => {
            let args = call.arguments.as_json().cloned().unwrap_or(Value::Null);
            let key = args["key"].as_str().unwrap_or_default().to_owned();
            Message::assistant(format!("The call failed transiently; retrying {key}."))
                .with_tool_calls(vec![ToolCall::new(
                    format!("{id}-retry"),
                    call.name.clone(),
                    args,
                )])
        }
        None => Message::assistant(
            "I cannot retry: the failed call is no longer in my prompt.".to_owned(),
        ),
    }
}

/// The word after `marker` in `text` (letters, digits, `-`, `_`, `.` inside).
pub fn after(text: &str, marker: &str) -> Option<String> {
    let start = text.find(marker)? + marker.len();
    let word: String = text[start..]
        .chars()
        .take_while(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    let word = word.trim_end_matches('.').to_owned();
    (!word.is_empty()).then_some(word)
}

/// The marker a final question asks about: the text between its first two `"`.
fn marker_of(question: &str) -> Option<&str> {
    let start = question.find('"')? + 1;
    let len = question[start..].find('"')?;
    Some(&question[start..start + len])
}

fn question_in(prompt: &[Message]) -> Option<String> {
    prompt
        .iter()
        .rev()
        .filter(|m| m.role == Role::User)
        .map(|m| m.text().into_owned())
        .find(|t| t.starts_with(FINAL_QUESTION))
}

fn ask(prompt: &[Message], question: &str) -> Message {
    let Some(marker) = marker_of(question) else {
        return Message::assistant("I cannot answer: the question names no marker.");
    };
    let marker_spaced = format!("{marker} ");
    let from_context = prompt[..prompt.len().saturating_sub(1)]
        .iter()
        .find_map(|m| after(&m.text(), &marker_spaced));
    if let Some(value) = from_context {
        return Message::assistant(format!("{ANSWER} {value} (from my context)"));
    }
    // Where to look: the offloaded result a stub points to, else the archive.
    let path = prompt
        .iter()
        .filter(|m| m.role == Role::Tool)
        .find_map(|m| {
            let t = m.text();
            let start = t.find("large_tool_results/")?;
            let path: String = t[start..]
                .chars()
                .take_while(|c| !c.is_whitespace() && !matches!(c, '`' | ')' | ',' | '"'))
                .collect();
            Some(path.trim_end_matches([':', '.', ';']).to_owned())
        })
        .unwrap_or_else(|| "archive".to_owned());
    Message::assistant(format!(
        "The fact is not in my context; searching {path} for it."
    ))
    .with_tool_calls(vec![ToolCall::new(
        ASK_GREP,
        "grep",
        json!({"pattern": regex_escape(marker), "path": path, "max_results": 5}),
    )])
}

fn regex_escape(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn after_grep(prompt: &[Message], output: &str) -> Message {
    let question = question_in(prompt).unwrap_or_default();
    let Some(marker) = marker_of(&question) else {
        return Message::assistant("I cannot answer: the question is no longer in my prompt.");
    };
    let marker_spaced = format!("{marker} ");
    // The hit shows the value: answer from it.
    if let Some(value) = output.lines().find_map(|l| after(l, &marker_spaced)) {
        return Message::assistant(format!("{ANSWER} {value} (from the store, by grep)"));
    }
    match grep_hit(output) {
        Some((path, line)) => Message::assistant(format!(
            "Found it at {path}:{line}; reading that line back."
        ))
        .with_tool_calls(vec![ToolCall::new(
            ASK_READ,
            "read_file",
            json!({"path": path, "offset": line.saturating_sub(1), "limit": 1}),
        )]),
        None => Message::assistant(
            "I cannot answer: the fact is neither in my context nor in the store.",
        ),
    }
}

fn after_read(prompt: &[Message], output: &str) -> Message {
    let question = question_in(prompt).unwrap_or_default();
    let Some(marker) = marker_of(&question) else {
        return Message::assistant("I cannot answer: the question is no longer in my prompt.");
    };
    let marker_spaced = format!("{marker} ");
    let value = output.lines().find_map(|row| {
        let start = row.find('{')?;
        let record: Value = serde_json::from_str(&row[start..]).ok()?;
        let text = match &record["message"]["content"] {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .join(""),
            _ => return None,
        };
        after(&text, &marker_spaced)
    });
    match value {
        Some(value) => {
            Message::assistant(format!("{ANSWER} {value} (from the archive, read back)"))
        }
        None => Message::assistant("I cannot answer: the record read back does not hold it."),
    }
}

/// The first `path:line:` of a grep result.
fn grep_hit(output: &str) -> Option<(String, usize)> {
    output.lines().find_map(|l| {
        let (path, rest) = l.split_once(':')?;
        let (line, _) = rest.split_once(':')?;
        Some((path.to_owned(), line.trim().parse().ok()?))
    })
}

/// Tool calls the reader made after the turn whose prompt ends with the final
/// question (the question's own reply included).
pub fn calls_after_question(turns: &[Turn]) -> usize {
    let start = turns.iter().position(|t| {
        t.prompt
            .last()
            .and_then(|m| m[1].as_str())
            .is_some_and(|s| s.starts_with(FINAL_QUESTION))
    });
    start.map_or(0, |s| turns[s..].iter().map(|t| t.calls().len()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_follows_next_keys_retries_and_asks() {
        let goal = Message::user("Walk it. Start at key K-0000.").with_id(GOAL_ID);
        let first = reply(std::slice::from_ref(&goal));
        assert_eq!(first.tool_calls[0].id, "visit-K-0000");
        let result = Message::tool("visit-K-0000", record(0, 2));
        let second = reply(&[goal.clone(), first.clone(), result.clone()]);
        assert_eq!(second.tool_calls[0].id, "visit-K-0001");
        let end = Message::tool("visit-K-0001", record(1, 2));
        let done = reply(&[goal.clone(), second, end]);
        assert!(done.tool_calls.is_empty());
        assert!(done.text().contains("K-0001"), "{}", done.text());
        let failed = Message::tool("visit-K-0000", "HTTP 503 (transient): retry the same call");
        let again = reply(&[goal.clone(), first, failed]);
        assert_eq!(again.tool_calls[0].id, "visit-K-0000-retry");
        let q = Message::user(format!("{FINAL_QUESTION} what came after \"code is\"?"));
        let known = Message::tool("x", "the code is ZX-1.");
        let answer = reply(&[goal.clone(), known, q.clone()]);
        assert_eq!(answer.text(), format!("{ANSWER} ZX-1 (from my context)"));
        let search = reply(&[goal, q]);
        assert_eq!(search.tool_calls[0].id, ASK_GREP);
    }
}
