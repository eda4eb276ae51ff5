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
        /// Wall time of the call, in milliseconds.
        duration_ms: u64,
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
        /// The error, when it failed: its first 1,000 characters (the tool message
        /// the model reads has it whole). The name keeps its first 64 and the call id
        /// its first 256, as the model may send any.
        error: Option<String>,
        /// Characters of the result as the tool returned it.
        result_chars: usize,
        /// Wall time, in milliseconds.
        duration_ms: u64,
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
    /// The model name has no profile: the window and output limits of the default
    /// profile are used.
    #[non_exhaustive]
    ProfileFallback {
        /// The model asked for.
        model: String,
        /// The window assumed.
        window: u64,
    },
}
