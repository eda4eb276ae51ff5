//! What an agent run reports as it goes.

use keel_compaction::CompactionEvent;
use serde::{Deserialize, Serialize};

/// One thing that happened in an agent step. The run's stream yields them as they are
/// made ([`crate::Agent::stream`]), tracing spans carry the same numbers, and the state
/// keeps the latest ones ([`crate::AgentState::events`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
#[non_exhaustive]
pub enum AgentEvent {
    /// The model was called.
    #[non_exhaustive]
    ModelCall {
        /// The agent step (model calls so far, this one included).
        step: u64,
        /// The model that answered.
        model: String,
        /// Prompt tokens as keel counted them (tools included).
        prompt_tokens: u64,
        /// Prompt tokens the provider reported, when it did.
        provider_prompt_tokens: Option<u64>,
        /// Completion tokens the provider reported, when it did.
        completion_tokens: Option<u64>,
        /// Prompt tokens the provider served from its cache, when it reports them.
        cached_tokens: Option<u64>,
        /// Tool calls in the reply.
        tool_calls: usize,
        /// Wall time of the call, in milliseconds, retries and their waits included.
        duration_ms: u64,
        /// Failed attempts the model client retried before it answered (a rate
        /// limit, a server error, a dropped connection), as its reply reports them
        /// ([`ChatResponse::retries`](keel_model::ChatResponse::retries)): 0 when the
        /// first attempt answered.
        #[serde(default)]
        retries: u32,
        /// Context overflows the provider reported before this call succeeded (each
        /// one compacted the context once).
        overflow_retries: u32,
        /// The reply stopped at the token limit of the call (`max_tokens`), not where
        /// the model ended it: its text, or a tool call's arguments, may be cut off.
        /// An answer cut off ends the run like any other; raise the limit and send
        /// the thread a message to go on.
        #[serde(default)]
        cut_off: bool,
    },
    /// A tool call finished (successfully or not).
    #[non_exhaustive]
    ToolCall {
        /// The agent step.
        step: u64,
        /// The call's id.
        call_id: String,
        /// The tool called.
        name: String,
        /// Whether it produced a result (an error is sent to the model as the result).
        ok: bool,
        /// Why it produced none, when it failed: a timeout or a panic, say, told apart
        /// from the tool's own error without reading the text.
        #[serde(default)]
        failure: Option<ToolFailure>,
        /// The error, when it failed: its first 1,000 characters (the tool message
        /// the model reads has it whole). The name keeps its first 64 and the call id
        /// its first 256, as the model may send any.
        error: Option<String>,
        /// Characters of the result as the tool returned it.
        result_chars: usize,
        /// Wall time, in milliseconds.
        duration_ms: u64,
        /// A hash of the tool's name and its arguments, keys in any order: equal for
        /// calls that ask the same thing ([`call_fingerprint`](crate::call_fingerprint);
        /// 0 in events stored before keel recorded it). The agent reads it to tell a
        /// call repeated across a milestone
        /// ([`AgentBuilder::max_repeated_calls`](crate::AgentBuilder::max_repeated_calls)).
        #[serde(default)]
        fingerprint: u64,
    },
    /// A large tool result was written to the offload store; a stub stays in context.
    #[non_exhaustive]
    Offload {
        /// The agent step.
        step: u64,
        /// The tool call whose result was offloaded.
        call_id: String,
        /// Where it is stored (readable with `read_file`).
        path: String,
        /// Tokens of the full result.
        tokens: u64,
    },
    /// A compaction ran (successfully or not).
    Compaction(CompactionEvent),
    /// The run reached the hard step ceiling and stopped; the thread can continue.
    #[non_exhaustive]
    StepCeiling {
        /// Model calls made.
        steps: u64,
        /// The ceiling.
        max: u64,
    },
    /// The run used its budget of model calls
    /// ([`AgentInput::max_steps`](crate::AgentInput::max_steps)) and stopped; the thread
    /// can continue.
    #[non_exhaustive]
    RunBudget {
        /// Model calls this run made.
        steps: u64,
        /// The run's budget.
        max: u64,
    },
    /// A reply asked for more tool calls than
    /// [`AgentBuilder::max_tool_calls`](crate::AgentBuilder::max_tool_calls) allows: none
    /// was run, and the model was told to call fewer (or, the second time in a row, the
    /// run stopped with [`Stop::TooManyToolCalls`](crate::Stop::TooManyToolCalls)).
    #[non_exhaustive]
    CallsRefused {
        /// The model call whose reply it was.
        step: u64,
        /// Tool calls the reply asked for.
        calls: usize,
        /// The most one reply may ask for.
        max: usize,
    },
    /// The model name has no profile: the window and output limits of the default
    /// profile are used.
    #[non_exhaustive]
    ProfileFallback {
        /// The model asked for.
        model: String,
        /// The window assumed.
        window: u64,
    },
    /// An event of a kind this build does not know, read from a log or a state that a
    /// newer keel wrote: it reads as this, so the rest still reads. keel never makes
    /// it.
    ///
    /// ```
    /// use keel_agent::AgentEvent;
    ///
    /// let e: AgentEvent = serde_json::from_str(r#"{"event": "from_the_future", "n": 1}"#)?;
    /// assert_eq!(e, AgentEvent::Unknown);
    /// # Ok::<(), serde_json::Error>(())
    /// ```
    #[serde(other)]
    Unknown,
}

/// Why a tool call produced no result ([`AgentEvent::ToolCall`]'s `failure`). Whatever
/// it is, the model reads the error as the call's result and the run goes on.
///
/// ```
/// use keel_agent::ToolFailure;
///
/// assert_eq!(ToolFailure::TimedOut.as_str(), "timed_out");
/// assert_eq!(serde_json::to_string(&ToolFailure::TimedOut)?, "\"timed_out\"");
/// assert!(ToolFailure::Panicked.is_fault() && !ToolFailure::BadArguments.is_fault());
/// // A kind a newer keel wrote still reads.
/// assert_eq!(serde_json::from_str::<ToolFailure>("\"out_of_coffee\"")?, ToolFailure::Unknown);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ToolFailure {
    /// The model called a tool that is not registered.
    UnknownTool,
    /// The arguments were not valid JSON, or the tool refused them
    /// ([`ToolError::BadArguments`](keel_message::ToolError::BadArguments)).
    BadArguments,
    /// The tool returned an error of its own.
    Failed,
    /// The call did not finish within the tool timeout
    /// ([`AgentBuilder::tool_timeout`](crate::AgentBuilder::tool_timeout)); its
    /// result is discarded.
    TimedOut,
    /// The tool panicked.
    Panicked,
    /// The call's task was cancelled before it finished.
    Cancelled,
    /// The user did not approve the call, so it was not run.
    NotApproved,
    /// The same tool with the same arguments was called in each of the last
    /// [`AgentBuilder::max_repeated_calls`](crate::AgentBuilder::max_repeated_calls)
    /// replies, so it was not run again.
    Repeated,
    /// A failure this build does not know, read from an event a newer keel wrote.
    #[serde(other)]
    Unknown,
}

impl ToolFailure {
    /// The name used in events and logs: `unknown_tool`, `bad_arguments`, `failed`,
    /// `timed_out`, `panicked`, `cancelled`, `not_approved`, `repeated` (or `unknown`).
    pub fn as_str(&self) -> &'static str {
        match self {
            ToolFailure::UnknownTool => "unknown_tool",
            ToolFailure::BadArguments => "bad_arguments",
            ToolFailure::Failed => "failed",
            ToolFailure::TimedOut => "timed_out",
            ToolFailure::Panicked => "panicked",
            ToolFailure::Cancelled => "cancelled",
            ToolFailure::NotApproved => "not_approved",
            ToolFailure::Repeated => "repeated",
            ToolFailure::Unknown => "unknown",
        }
    }

    /// Whether the failure is the tool's or its host's fault rather than the model's
    /// or the user's: a timeout, a panic or a cancelled task, worth an alert where an
    /// unknown tool or bad arguments are the model's to correct.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            ToolFailure::TimedOut | ToolFailure::Panicked | ToolFailure::Cancelled
        )
    }
}

impl std::fmt::Display for ToolFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The hash [`AgentEvent::ToolCall`] records of a call: xxh3 of its tool's name and its
/// arguments as canonical JSON (object keys sorted), so two calls that ask the same
/// thing have the same one whatever their spacing and key order. Arguments that are
/// not JSON are hashed as their text.
///
/// ```
/// use keel_agent::call_fingerprint;
/// use keel_message::ToolCall;
/// use serde_json::json;
///
/// let a = ToolCall::new("c1", "read_file", json!({"path": "a.rs", "limit": 5}));
/// let b = ToolCall::new("c2", "read_file", json!({"limit": 5, "path": "a.rs"}));
/// let c = ToolCall::new("c3", "read_file", json!({"path": "b.rs", "limit": 5}));
/// assert_eq!(call_fingerprint(&a), call_fingerprint(&b));
/// assert_ne!(call_fingerprint(&a), call_fingerprint(&c));
/// ```
pub fn call_fingerprint(call: &keel_message::ToolCall) -> u64 {
    let mut text = String::with_capacity(64);
    text.push_str(&call.name);
    text.push('\0');
    match call.arguments.as_json() {
        Some(v) => canonical(v, &mut text),
        None => text.push_str(&call.arguments.to_json_string()),
    }
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

/// `v` as JSON with object keys sorted, without an explicit recursion (arguments can
/// nest as deep as a caller built them).
fn canonical(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    enum Item<'a> {
        Value(&'a Value),
        Text(&'static str),
        Key(&'a str),
    }
    let mut stack = vec![Item::Value(v)];
    while let Some(item) = stack.pop() {
        match item {
            Item::Text(t) => out.push_str(t),
            Item::Key(k) => {
                out.push_str(&Value::String(k.to_owned()).to_string());
                out.push(':');
            }
            Item::Value(Value::Array(a)) => {
                out.push('[');
                stack.push(Item::Text("]"));
                for (i, x) in a.iter().enumerate().rev() {
                    stack.push(Item::Value(x));
                    if i > 0 {
                        stack.push(Item::Text(","));
                    }
                }
            }
            Item::Value(Value::Object(m)) => {
                out.push('{');
                stack.push(Item::Text("}"));
                let mut keys: Vec<(&String, &Value)> = m.iter().collect();
                keys.sort_by(|a, b| a.0.cmp(b.0));
                for (i, (k, x)) in keys.into_iter().enumerate().rev() {
                    stack.push(Item::Value(x));
                    stack.push(Item::Key(k));
                    if i > 0 {
                        stack.push(Item::Text(","));
                    }
                }
            }
            Item::Value(other) => out.push_str(&other.to_string()),
        }
    }
}
