use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use keel_message::Message;
use serde_json::{Map, Value};

use crate::ModelError;

/// Per-call settings that mean the same to every provider. Every field is optional; a
/// provider sends only what is set, so the server's defaults apply otherwise.
///
/// Settings only one server knows live on that provider's config instead (Ollama's
/// `num_ctx` and `keep_alive` on `OllamaConfig`); anything else a server accepts can
/// go in [`extra`](Self::extra).
///
/// ```
/// use keel_model::{ChatOptions, ResponseFormat};
///
/// let options = ChatOptions::new()
///     .temperature(0.0)
///     .max_tokens(256)
///     .format(ResponseFormat::Json);
/// assert_eq!(options.temperature, Some(0.0));
/// assert_eq!(options.max_tokens, Some(256));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ChatOptions {
    /// Use this model instead of the one the client was configured with.
    pub model: Option<String>,
    /// Sampling temperature (0 for the most deterministic reply).
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// The most tokens the reply may have (OpenAI `max_tokens`, Ollama
    /// `options.num_predict`).
    pub max_tokens: Option<u32>,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Sampling seed, where the server supports it.
    pub seed: Option<u64>,
    /// Constrain the reply to JSON (OpenAI `response_format`, Ollama `format`).
    pub format: Option<ResponseFormat>,
    /// A deadline for this call instead of the client's request timeout.
    pub timeout: Option<Duration>,
    /// Extra top-level fields merged into the request body as they are (they override
    /// fields keel sets).
    pub extra: Map<String, Value>,
}

impl ChatOptions {
    /// No options set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`ChatOptions::model`].
    #[must_use]
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Sets [`ChatOptions::temperature`].
    #[must_use]
    pub fn temperature(mut self, t: f64) -> Self {
        self.temperature = Some(t);
        self
    }

    /// Sets [`ChatOptions::top_p`].
    #[must_use]
    pub fn top_p(mut self, p: f64) -> Self {
        self.top_p = Some(p);
        self
    }

    /// Sets [`ChatOptions::max_tokens`].
    #[must_use]
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = Some(n);
        self
    }

    /// Adds a stop sequence.
    #[must_use]
    pub fn stop(mut self, s: impl Into<String>) -> Self {
        self.stop.push(s.into());
        self
    }

    /// Sets [`ChatOptions::seed`].
    #[must_use]
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Sets [`ChatOptions::format`].
    #[must_use]
    pub fn format(mut self, format: ResponseFormat) -> Self {
        self.format = Some(format);
        self
    }

    /// Sets [`ChatOptions::timeout`].
    #[must_use]
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// Adds an extra top-level body field.
    #[must_use]
    pub fn extra(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }
}

/// A constraint on the reply's shape.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Any valid JSON (OpenAI `{"type": "json_object"}`, Ollama `"json"`).
    Json,
    /// JSON matching a schema (OpenAI `json_schema`, Ollama a schema object).
    JsonSchema {
        /// A name for the schema (OpenAI requires one).
        name: String,
        /// The JSON schema.
        schema: Value,
    },
}

/// How long Ollama keeps a model loaded after a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepAlive {
    /// This long (sent as whole seconds).
    For(Duration),
    /// Until the server stops (`-1`).
    Forever,
    /// Unload right after the reply (`0`).
    UnloadNow,
}

impl KeepAlive {
    #[cfg(feature = "ollama")]
    pub(crate) fn to_value(self) -> Value {
        match self {
            KeepAlive::For(d) => Value::from(d.as_secs()),
            KeepAlive::Forever => Value::from(-1),
            KeepAlive::UnloadNow => Value::from(0),
        }
    }
}

/// Tokens as the provider billed them.
///
/// ```
/// let u = keel_model::Usage::new(120, 30);
/// assert_eq!(u.total(), 150);
/// assert_eq!(u + u, keel_model::Usage::new(240, 60));
/// let cached = u.with_cached_tokens(100);
/// assert_eq!(cached.cached_tokens, Some(100));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Usage {
    /// Tokens of the prompt (OpenAI `prompt_tokens`, Ollama `prompt_eval_count`).
    pub prompt_tokens: u64,
    /// Tokens of the reply (OpenAI `completion_tokens`, Ollama `eval_count`).
    pub completion_tokens: u64,
    /// Of the prompt tokens, those the provider served from its prompt cache, when it
    /// reports them (OpenAI `prompt_tokens_details.cached_tokens`; Ollama
    /// `prompt_eval_cached_count`, which only newer Ollama servers send: from older ones
    /// this stays `None`).
    pub cached_tokens: Option<u64>,
}

impl Usage {
    /// A usage report.
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens: None,
        }
    }

    /// Sets the cached prompt tokens.
    #[must_use]
    pub fn with_cached_tokens(mut self, cached: u64) -> Self {
        self.cached_tokens = Some(cached);
        self
    }

    /// Prompt plus completion (saturating: counts come from the provider).
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// Adds field by field, saturating at `u64::MAX` (counts come from the provider, and
/// a server reporting absurd numbers must not panic a summing caller).
impl std::ops::Add for Usage {
    type Output = Usage;
    fn add(self, other: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.saturating_add(other.prompt_tokens),
            completion_tokens: self
                .completion_tokens
                .saturating_add(other.completion_tokens),
            cached_tokens: match (self.cached_tokens, other.cached_tokens) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
            },
        }
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It finished its reply or hit a stop sequence.
    Stop,
    /// It hit `max_tokens` (or the window): the reply is cut off.
    Length,
    /// It asked for tool calls.
    ToolCalls,
    /// The provider withheld content.
    ContentFilter,
    /// Anything else, as the provider said it.
    Other(String),
}

impl FinishReason {
    /// Maps a provider's finish/done reason.
    ///
    /// ```
    /// use keel_model::FinishReason;
    /// assert_eq!(FinishReason::parse("tool_calls"), FinishReason::ToolCalls);
    /// assert_eq!(FinishReason::parse("load"), FinishReason::Other("load".into()));
    /// ```
    pub fn parse(s: &str) -> Self {
        match s {
            "stop" | "end_turn" | "eos" => FinishReason::Stop,
            "length" | "max_tokens" => FinishReason::Length,
            "tool_calls" | "function_call" | "tool_use" => FinishReason::ToolCalls,
            "content_filter" => FinishReason::ContentFilter,
            other => FinishReason::Other(other.to_owned()),
        }
    }
}

/// A model's reply.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ChatResponse {
    /// The assistant message: text and tool calls.
    pub message: Message,
    /// Token usage as the provider reported it (`None` when it reported none).
    pub usage: Option<Usage>,
    /// Why the model stopped, when the provider said.
    pub finish_reason: Option<FinishReason>,
    /// The model that answered, as the provider named it.
    pub model: String,
    /// Failed attempts retried before this reply (a rate limit, a server error, a
    /// dropped connection): 0 when the first attempt answered. Their waits are part
    /// of the call's wall time.
    pub retries: u32,
}

impl ChatResponse {
    /// A reply with this message and nothing else known.
    pub fn new(message: Message, model: impl Into<String>) -> Self {
        ChatResponse {
            message,
            usage: None,
            finish_reason: None,
            model: model.into(),
            retries: 0,
        }
    }

    /// With the failed attempts retried before it.
    #[must_use]
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// With the provider's token usage.
    #[must_use]
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = Some(usage);
        self
    }

    /// With why the provider stopped generating.
    #[must_use]
    pub fn with_finish_reason(mut self, reason: FinishReason) -> Self {
        self.finish_reason = Some(reason);
        self
    }

    /// The reply's text.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        self.message.text()
    }
}

/// A piece of a tool call as it streams in. OpenAI sends the id and name first and the
/// arguments in fragments, all with the same `index`; Ollama sends whole calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    /// Which call of the reply this fragment belongs to.
    pub index: usize,
    /// The call id, on the first fragment.
    pub id: Option<String>,
    /// The tool name, on the first fragment.
    pub name: Option<String>,
    /// The next fragment of the arguments' JSON text.
    pub arguments: String,
}

/// One item of a streamed reply.
// The final event carries the whole response; the stream yields one of it per reply, so
// boxing it would cost an allocation for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ChatEvent {
    /// The next fragment of the reply's text.
    Text(String),
    /// The next fragment of a tool call.
    ToolCall(ToolCallDelta),
    /// The end: the assembled reply, with usage. Always the last item of a stream that
    /// did not fail.
    Done(ChatResponse),
}

/// A streamed reply: deltas, then [`ChatEvent::Done`]; or an error, after which the
/// stream ends.
pub type ChatStream = Pin<Box<dyn Stream<Item = Result<ChatEvent, ModelError>> + Send>>;

/// Drains a stream and returns its final response.
///
/// ```
/// use futures::executor::block_on;
/// use keel_message::Message;
/// use keel_model::{ChatModel, ChatOptions, ScriptedModel, collect_stream};
///
/// let model = ScriptedModel::from_texts(["all done"]);
/// let reply = block_on(async {
///     let stream = model.chat_stream(&[Message::user("go")], &[], &ChatOptions::new()).await?;
///     collect_stream(stream).await
/// })?;
/// assert_eq!(reply.text(), "all done");
/// # Ok::<(), keel_model::ModelError>(())
/// ```
pub async fn collect_stream(mut stream: ChatStream) -> Result<ChatResponse, ModelError> {
    while let Some(event) = stream.next().await {
        if let ChatEvent::Done(response) = event? {
            return Ok(response);
        }
    }
    Err(ModelError::StreamInterrupted(
        "the stream ended without a final response".into(),
    ))
}
