use std::time::Duration;

use keel_message::FormatError;

/// Why a chat call failed.
///
/// The variants the runtime acts on are distinct:
///
/// * [`ModelError::ContextOverflow`]: the provider said the prompt is longer than the
///   model's window. Compaction matches on it, compacts and retries.
/// * [`ModelError::RateLimited`]: still rate limited after the client's retries, or the
///   provider asked to wait longer than the client is allowed to.
/// * everything else is a failure to report.
///
/// ```
/// use keel_model::ModelError;
///
/// let err = ModelError::ContextOverflow { message: "prompt too long".into() };
/// assert!(err.is_context_overflow());
/// assert!(!err.is_retryable());
/// assert_eq!(err.to_string(), "context length exceeded: prompt too long");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The prompt does not fit the model's context window (OpenAI's
    /// `context_length_exceeded`, Ollama's "input length exceeds the context length",
    /// llama.cpp's `exceed_context_size_error`, and similar).
    #[error("context length exceeded: {message}")]
    ContextOverflow {
        /// The provider's message.
        message: String,
    },
    /// HTTP 429 after all retries, or a `Retry-After` longer than the client may wait.
    #[error("rate limited{}: {message}", RetryAfter(*retry_after))]
    RateLimited {
        /// How long the provider asked to wait, if it said.
        retry_after: Option<Duration>,
        /// The provider's message.
        message: String,
    },
    /// Any other error status from the provider.
    #[error("HTTP {status}: {message}")]
    Api {
        /// The HTTP status code.
        status: u16,
        /// The provider's message (or the start of the body when it had none).
        message: String,
        /// The provider's error code or type, when it gave one.
        code: Option<String>,
    },
    /// No complete answer within the configured time.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The server could not be reached, or the connection failed before the reply
    /// started.
    #[error("connection failed: {0}")]
    Connection(String),
    /// A reply stopped before its end (a streamed one's connection dropped) or carried
    /// an error object instead of an answer (an error chunk, or an HTTP 200 whose body
    /// is `{"error": ..}`).
    #[error("reply interrupted: {0}")]
    StreamInterrupted(String),
    /// The reply is not what the API promises (malformed JSON, missing fields).
    #[error("malformed response: {0}")]
    Malformed(String),
    /// A reply body is longer than
    /// [`HttpConfig::max_body_bytes`](crate::HttpConfig::max_body_bytes); the rest of it
    /// was not read.
    #[error("response body larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// A line (or one server-sent event) of a streamed reply is longer than
    /// [`HttpConfig::max_line_bytes`](crate::HttpConfig::max_line_bytes).
    #[error("stream line longer than {limit} bytes")]
    LineTooLong {
        /// The limit, in bytes.
        limit: usize,
    },
    /// A streamed reply's text and tool calls together are longer than
    /// [`HttpConfig::max_answer_bytes`](crate::HttpConfig::max_answer_bytes).
    #[error("streamed answer larger than {limit} bytes")]
    AnswerTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The client was configured wrongly (bad URL, bad header value).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A [`ScriptedModel`](crate::ScriptedModel) or [`ReplayModel`](crate::ReplayModel)
    /// was asked for more turns than it has.
    #[error("no turns left: all {served} scripted turns were served")]
    Exhausted {
        /// How many turns were served before this call.
        served: usize,
    },
    /// A strict [`ReplayModel`](crate::ReplayModel) was called with a history that
    /// differs from the recording.
    #[error("replay diverged at turn {turn}: expected {expected:?}, got {found:?}")]
    ReplayDiverged {
        /// The assistant turn (0-based) being replayed.
        turn: usize,
        /// The text of the message that preceded this turn in the recording.
        expected: String,
        /// The text of the last message of the request.
        found: String,
    },
    /// A recorded trajectory could not be imported.
    #[error("invalid trajectory: {0}")]
    Format(#[from] FormatError),
}

struct RetryAfter(Option<Duration>);

impl std::fmt::Display for RetryAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, " (retry after {:.3}s)", d.as_secs_f64()),
            None => Ok(()),
        }
    }
}

impl ModelError {
    /// True for [`ModelError::ContextOverflow`].
    pub fn is_context_overflow(&self) -> bool {
        matches!(self, ModelError::ContextOverflow { .. })
    }

    /// True when trying the same request again may succeed: rate limits, server errors
    /// (5xx) and connection failures. The HTTP clients already retry these according
    /// to their [`RetryPolicy`](crate::RetryPolicy) before giving up.
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelError::RateLimited { .. } | ModelError::Connection(_) => true,
            ModelError::Api { status, .. } => *status >= 500,
            _ => false,
        }
    }

    /// True when the same request may succeed later, unchanged: what
    /// [`is_retryable`](Self::is_retryable) covers (and the clients retry by
    /// themselves), plus a [`Timeout`](ModelError::Timeout) and a reply cut short
    /// ([`StreamInterrupted`](ModelError::StreamInterrupted)), which the clients do not
    /// retry since the call may have cost its full price. Everything else (a refusal,
    /// a malformed reply, a bad setting, an overflow) needs a change first.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_model::ModelError;
    ///
    /// assert!(ModelError::Timeout(Duration::from_secs(60)).is_transient());
    /// assert!(!ModelError::Timeout(Duration::from_secs(60)).is_retryable());
    /// assert!(!ModelError::Malformed("not JSON".into()).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        self.is_retryable()
            || matches!(
                self,
                ModelError::Timeout(_) | ModelError::StreamInterrupted(_)
            )
    }

    /// The wait the provider asked for, for [`ModelError::RateLimited`].
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ModelError::RateLimited { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// Phrases providers use when a prompt is longer than the context window. Matched
/// case-insensitively against error messages that carry no machine-readable code.
#[cfg(any(feature = "openai", feature = "ollama"))]
const OVERFLOW_PHRASES: &[&str] = &[
    "context_length_exceeded",
    "context length exceeded",
    "exceeds the context length",
    "exceeds the available context",
    "exceed context window",
    "exceeds context window",
    "maximum context length",
    "context window exceeded",
    "exceed_context_size",
    "prompt is too long",
    "too many tokens",
    "input is too long",
];

/// True when an error message says the context window was exceeded.
#[cfg(any(feature = "openai", feature = "ollama"))]
pub(crate) fn looks_like_overflow(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    OVERFLOW_PHRASES.iter().any(|p| lower.contains(p))
}

/// At most `max` characters of `s`, for error messages built from response bodies.
#[cfg(any(feature = "openai", feature = "ollama"))]
pub(crate) fn snippet(s: &str, max: usize) -> String {
    match s.char_indices().nth(max).and_then(|(i, _)| s.get(..i)) {
        Some(head) => format!("{head}…"),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "openai", feature = "ollama"))]
    fn overflow_phrases_are_recognized() {
        for msg in [
            "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "the input length exceeds the context length",
            "the request exceeds the available context size, try increasing it",
            "Requested tokens (9000) exceed context window of 8192",
        ] {
            assert!(looks_like_overflow(msg), "{msg}");
        }
        assert!(!looks_like_overflow("model not found"));
    }

    #[test]
    fn retryable_classification() {
        assert!(
            ModelError::Api {
                status: 503,
                message: String::new(),
                code: None
            }
            .is_retryable()
        );
        assert!(
            !ModelError::Api {
                status: 400,
                message: String::new(),
                code: None
            }
            .is_retryable()
        );
        assert!(ModelError::Connection("refused".into()).is_retryable());
        assert!(!ModelError::Malformed("x".into()).is_retryable());
        let limited = ModelError::RateLimited {
            retry_after: Some(Duration::from_secs(2)),
            message: "slow down".into(),
        };
        assert_eq!(limited.retry_after(), Some(Duration::from_secs(2)));
        assert_eq!(
            limited.to_string(),
            "rate limited (retry after 2.000s): slow down"
        );
    }

    #[test]
    #[cfg(any(feature = "openai", feature = "ollama"))]
    fn snippet_cuts_on_char_boundaries() {
        assert_eq!(snippet("héllo", 2), "hé…");
        assert_eq!(snippet("hi", 5), "hi");
    }
}
