use std::collections::BTreeSet;

use keel_message::{Message, Role, ToolArguments};
use serde_json::{Value, json};

use super::{
    Failure, PolicyEnv, PolicyOutcome, Stored, StoredWhat, nth_place, record, set_record, thousands,
};
use crate::error::OffloadError;
use crate::key::{StorePath, safe_component};
use crate::tools::READ_FILE;

const RECORD: &str = "truncated_arguments";
/// The file name used for arguments that were not valid JSON (stored whole). `@` never
/// appears in a name made by [`safe_component`], so no argument name can clash.
const RAW: &str = "@raw";

/// Truncates long arguments of old write/edit-style tool calls once the context is
/// nearly full.
///
/// When the context reaches `trigger_fraction` of the window (default 0.85), every
/// string argument longer than `max_chars` characters (default 2,000) of a call to one
/// of `tools` (default `write_file`, `edit_file`), in assistant messages outside the
/// `keep_recent` most recent messages (default 20), is stored at
/// `truncated_arguments/<tool_call_id>/<argument>` and replaced by its first
/// `preview_chars` characters and a pointer to the stored text. Only top-level string
/// arguments are considered; arguments that are not valid JSON and are longer than
/// `max_chars` are stored whole (at `.../<tool_call_id>/@raw`).
///
/// # Prompt caches
///
/// An edit is made once. The edited message carries a record in its metadata (under
/// [`METADATA_KEY`](super::METADATA_KEY)) and is never processed again, and the edit
/// depends only on the message and the settings, so re-running the policy — on the
/// next turn, or after a crash — changes nothing that was already changed. Every
/// eligible message is edited in the same pass, so the prompt prefix changes once,
/// when the trigger fires, and then stays stable for provider prompt caches until the
/// next trigger (DESIGN.md, invariant 8).
///
/// If storing an argument fails, its message stays exactly as it was and the error is
/// in [`PolicyOutcome::failures`].
///
/// ```
/// use keel_offload::message::{Message, ToolCall};
/// use keel_offload::{Key, MemoryStore, OffloadStore, PolicyEnv, ThreadId, TruncateArguments};
/// use keel_offload::token::ApproxCounter;
/// use serde_json::json;
///
/// let store = MemoryStore::new();
/// let thread = ThreadId::new("t1")?;
/// let counter = ApproxCounter::new();
/// let env = PolicyEnv::new(&store, &thread, &counter);
///
/// let big = "fn main() {}\n".repeat(500); // 6,500 characters
/// let mut messages = vec![Message::assistant("").with_tool_calls(vec![ToolCall::new(
///     "call_1",
///     "write_file",
///     json!({"path": "src/main.rs", "content": big}),
/// )])];
/// messages.extend((0..20).map(|i| Message::user(format!("turn {i}"))));
///
/// let policy = TruncateArguments::new();
/// // 90% of the window is used: the trigger (85%) fires.
/// let out = policy.apply_with_usage(messages, &env, 9_000, 10_000);
/// assert_eq!(out.stored.len(), 1);
/// let args = out.messages[0].tool_calls[0].arguments.as_json().unwrap();
/// assert_eq!(args["path"], "src/main.rs");
/// assert!(args["content"].as_str().unwrap().contains("truncated_arguments/call_1/content"));
/// assert_eq!(store.get(&Key::new("t1", "truncated_arguments/call_1/content")?)?, big);
///
/// // Applying it again changes nothing: the prefix stays byte-identical.
/// let again = policy.apply_with_usage(out.messages.clone(), &env, 9_000, 10_000);
/// assert!(again.stored.is_empty());
/// assert_eq!(again.messages, out.messages);
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct TruncateArguments {
    /// Fraction of the context window that triggers the policy (default 0.85).
    pub trigger_fraction: f64,
    /// String arguments longer than this many characters are truncated (default
    /// 2,000).
    pub max_chars: usize,
    /// The most recent messages are never edited (default 20).
    pub keep_recent: usize,
    /// Characters of the original kept before the pointer (default 100).
    pub preview_chars: usize,
    /// Tools whose calls are truncated (default `write_file`, `edit_file`).
    pub tools: BTreeSet<String>,
    /// The directory arguments go to (default `truncated_arguments`).
    pub dir: StorePath,
}

impl Default for TruncateArguments {
    fn default() -> Self {
        Self::new()
    }
}

/// One planned edit of one call.
struct Edit {
    call: usize,
    argument: Option<String>,
    path: StorePath,
    chars: usize,
    bytes: u64,
    replacement: String,
}

impl TruncateArguments {
    /// The defaults listed on each field.
    pub fn new() -> Self {
        TruncateArguments {
            trigger_fraction: 0.85,
            max_chars: 2_000,
            keep_recent: 20,
            preview_chars: 100,
            tools: ["write_file", "edit_file"]
                .into_iter()
                .map(str::to_owned)
                .collect(),
            dir: StorePath::known("truncated_arguments"),
        }
    }

    /// Sets the tools whose calls are truncated.
    #[must_use]
    pub fn with_tools<I: IntoIterator<Item = S>, S: Into<String>>(mut self, tools: I) -> Self {
        self.tools = tools.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the number of recent messages never edited.
    #[must_use]
    pub fn keep_recent(mut self, messages: usize) -> Self {
        self.keep_recent = messages;
        self
    }

    /// True when `used_tokens` of a `context_window` reach the trigger fraction.
    ///
    /// ```
    /// let p = keel_offload::TruncateArguments::new();
    /// assert!(!p.triggered(8_499, 10_000));
    /// assert!(p.triggered(8_500, 10_000));
    /// ```
    pub fn triggered(&self, used_tokens: usize, context_window: usize) -> bool {
        used_tokens as f64 >= self.trigger_fraction * context_window as f64
    }

    /// Counts `messages` with the environment's counter and applies the policy if the
    /// trigger fires (see [`TruncateArguments::apply_with_usage`]).
    pub fn apply(
        &self,
        messages: Vec<Message>,
        env: &PolicyEnv<'_>,
        context_window: usize,
    ) -> PolicyOutcome {
        let used = env.counter.count_messages(&messages);
        self.apply_with_usage(messages, env, used, context_window)
    }

    /// Applies the policy when `used_tokens` (what the caller knows the context costs,
    /// e.g. from the provider's last usage report) reach the trigger; otherwise returns
    /// the messages unchanged.
    pub fn apply_with_usage(
        &self,
        messages: Vec<Message>,
        env: &PolicyEnv<'_>,
        used_tokens: usize,
        context_window: usize,
    ) -> PolicyOutcome {
        if !self.triggered(used_tokens, context_window) {
            return PolicyOutcome::unchanged(messages);
        }
        let protected_from = messages.len().saturating_sub(self.keep_recent);
        let mut out = PolicyOutcome {
            messages: Vec::with_capacity(messages.len()),
            ..PolicyOutcome::default()
        };
        for (index, mut message) in messages.into_iter().enumerate() {
            if index < protected_from
                && message.role == Role::Assistant
                && record(&message, RECORD).is_none()
            {
                match self.plan(&message, env) {
                    Ok(edits) if edits.is_empty() => {}
                    Ok(edits) => {
                        for e in &edits {
                            out.stored.push(Stored {
                                index,
                                message_id: message.id.clone(),
                                path: e.path.clone(),
                                bytes: e.bytes,
                                what: StoredWhat::Argument {
                                    tool_call_id: message.tool_calls[e.call].id.clone(),
                                    argument: e.argument.clone(),
                                    chars: e.chars,
                                },
                            });
                        }
                        apply_edits(&mut message, edits);
                    }
                    Err(error) => out.failures.push(Failure {
                        index,
                        message_id: message.id.clone(),
                        error,
                    }),
                }
            }
            out.messages.push(message);
        }
        out
    }

    /// Stores every long argument of `message` and returns the edits to make. Nothing
    /// is edited here, so a failure leaves the message as it was.
    fn plan(&self, message: &Message, env: &PolicyEnv<'_>) -> Result<Vec<Edit>, OffloadError> {
        let mut edits = Vec::new();
        for (call_index, call) in message.tool_calls.iter().enumerate() {
            if !self.tools.contains(&call.name) {
                continue;
            }
            let call_name = safe_component(&call.id);
            let mut long: Vec<(Option<String>, &str)> = Vec::new();
            match &call.arguments {
                ToolArguments::Invalid(raw) => long.push((None, raw)),
                other => {
                    if let Some(Value::Object(map)) = other.as_json() {
                        for (name, value) in map {
                            if let Value::String(s) = value {
                                long.push((Some(name.clone()), s));
                            }
                        }
                    }
                }
            }
            for (argument, text) in long {
                let chars = text.chars().count();
                if chars <= self.max_chars {
                    continue;
                }
                let leaf = match &argument {
                    Some(name) => safe_component(name),
                    None => RAW.to_owned(),
                };
                // A call id used twice in the thread gets `<id>~2/…`: nothing is overwritten.
                let (path, bytes) =
                    env.put_new(text, |n| nth_place(&self.dir, &call_name, n)?.join(&leaf))?;
                let replacement = self.pointer(text, chars, &path);
                edits.push(Edit {
                    call: call_index,
                    argument,
                    path,
                    chars,
                    bytes,
                    replacement,
                });
            }
        }
        Ok(edits)
    }

    fn pointer(&self, text: &str, chars: usize, path: &StorePath) -> String {
        let preview: String = text.chars().take(self.preview_chars).collect();
        let note = format!(
            "[argument truncated: {} characters; the full text is stored at {path}, read it with {READ_FILE}]",
            thousands(chars)
        );
        if preview.is_empty() {
            note
        } else {
            format!("{preview}… {note}")
        }
    }
}

fn apply_edits(message: &mut Message, edits: Vec<Edit>) {
    let mut records = Vec::with_capacity(edits.len());
    for e in edits {
        let call = &mut message.tool_calls[e.call];
        records.push(json!({
            "tool_call_id": call.id,
            "argument": e.argument,
            "path": e.path.as_str(),
            "chars": e.chars,
        }));
        match e.argument {
            None => call.arguments = ToolArguments::Invalid(e.replacement),
            Some(name) => {
                let taken =
                    std::mem::replace(&mut call.arguments, ToolArguments::Json(Value::Null));
                call.arguments = match taken {
                    ToolArguments::Json(mut value) | ToolArguments::JsonText { mut value, .. } => {
                        if let Value::Object(map) = &mut value {
                            map.insert(name, Value::String(e.replacement));
                        }
                        ToolArguments::Json(value)
                    }
                    // `plan` names arguments of JSON objects only.
                    invalid @ ToolArguments::Invalid(_) => invalid,
                };
            }
        }
    }
    set_record(&mut message.metadata, RECORD, Value::Array(records));
}
