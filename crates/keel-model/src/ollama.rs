//! The Ollama provider: `POST {base_url}/api/chat`.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use async_trait::async_trait;
use keel_message::{ContentPart, Message, Role, ToolArguments, ToolCall, ToolSpec, openai};
use serde_json::{Map, Value, json};

use crate::error::snippet;
use crate::http::{self, Decoder, Http, HttpConfig, env};
use crate::{
    ChatEvent, ChatModel, ChatOptions, ChatResponse, ChatStream, FinishReason, KeepAlive,
    ModelError, ResponseFormat, ToolCallDelta, Usage,
};

/// Where and how to reach an Ollama server.
///
/// Besides the address and model, it holds the settings only Ollama knows, sent with
/// every call: the context window to run the model with (`num_ctx`, which Ollama
/// otherwise keeps small whatever the model supports) and how long the server keeps the
/// model loaded (`keep_alive`).
///
/// ```
/// use keel_model::{KeepAlive, OllamaConfig};
///
/// let config = OllamaConfig::new("llama3.1:8b")
///     .num_ctx(16_384)
///     .keep_alive(KeepAlive::Forever);
/// assert_eq!(config.base_url, "http://127.0.0.1:11434");
/// assert_eq!(config.num_ctx, Some(16_384));
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct OllamaConfig {
    /// The server root, without `/api`.
    pub base_url: String,
    /// The model to call.
    pub model: String,
    /// Timeouts, retries and limits.
    pub http: HttpConfig,
    /// The context window the server runs the model with (`options.num_ctx`; default
    /// unset: the server's own default).
    pub num_ctx: Option<u32>,
    /// How long the server keeps the model loaded after each call (default unset).
    pub keep_alive: Option<KeepAlive>,
}

impl OllamaConfig {
    /// Ollama's default address.
    pub const DEFAULT_BASE_URL: &'static str = "http://127.0.0.1:11434";

    /// A config for `model` at [`DEFAULT_BASE_URL`](Self::DEFAULT_BASE_URL). Reads no
    /// environment.
    pub fn new(model: impl Into<String>) -> Self {
        OllamaConfig {
            base_url: Self::DEFAULT_BASE_URL.to_owned(),
            model: model.into(),
            http: HttpConfig::default(),
            num_ctx: None,
            keep_alive: None,
        }
    }

    /// Like [`new`](Self::new), with the base URL from `OLLAMA_BASE_URL` when it is
    /// set. Builder calls after this override it.
    pub fn from_env(model: impl Into<String>) -> Self {
        let mut config = Self::new(model);
        if let Some(url) = env("OLLAMA_BASE_URL") {
            config.base_url = url;
        }
        config
    }

    /// Sets the base URL.
    #[must_use]
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = url.into();
        self
    }

    /// Sets the transport settings.
    #[must_use]
    pub fn http(mut self, http: HttpConfig) -> Self {
        self.http = http;
        self
    }

    /// Sets [`OllamaConfig::num_ctx`].
    #[must_use]
    pub fn num_ctx(mut self, tokens: u32) -> Self {
        self.num_ctx = Some(tokens);
        self
    }

    /// Sets [`OllamaConfig::keep_alive`].
    #[must_use]
    pub fn keep_alive(mut self, keep: KeepAlive) -> Self {
        self.keep_alive = Some(keep);
        self
    }
}

/// A client for Ollama's native `/api/chat`.
///
/// * Messages go in Ollama's shape: text `content`, base64 `images` (from `data:`
///   image parts; image URLs are not fetched and are left out), tool calls with JSON
///   object `arguments`, and tool results with `tool_name` (looked up from the call
///   they answer). Arguments that are not a JSON object are sent as
///   `{"arguments": <value or raw text>}`, since Ollama accepts only objects.
/// * Options: `temperature`, `top_p`, `seed`, `stop`, the config's `num_ctx`, and
///   `max_tokens` as `num_predict` go in `options`; `format` and the config's
///   `keep_alive` at the top level.
/// * Streaming reads newline-delimited JSON; the final `"done": true` line carries
///   `prompt_eval_count` and `eval_count`, reported as [`Usage`] (Ollama leaves out
///   `prompt_eval_count` when the whole prompt came from its cache: that is reported
///   as 0 prompt tokens). Servers that send `prompt_eval_cached_count` (the prompt
///   tokens read from the KV cache, newer Ollama versions) have it reported as
///   [`Usage::cached_tokens`]; older ones send nothing comparable and it stays `None`.
/// * A reply that is not in `/api/chat`'s shape (no `message` object in a non-streamed
///   reply; a `message` that is not an object, text that is not a string, tool calls
///   that are not a list; a stream line with neither a message nor `"done": true`) is
///   [`ModelError::Malformed`], as the OpenAI provider treats the same shapes.
/// * Tool calls without an id get a fresh one, so results can answer them.
///
/// ```
/// use keel_message::Message;
/// use keel_model::{ChatOptions, KeepAlive, OllamaConfig, OllamaModel};
///
/// let config = OllamaConfig::new("qwen2.5-coder:7b")
///     .num_ctx(16_384)
///     .keep_alive(KeepAlive::Forever);
/// let model = OllamaModel::new(config)?;
/// let body = model.request_body(&[Message::user("hi")], &[], &ChatOptions::new(), false);
/// assert_eq!(body["options"]["num_ctx"], 16_384);
/// assert_eq!(body["keep_alive"], -1);
/// assert_eq!(body["stream"], false);
/// # Ok::<(), keel_model::ModelError>(())
/// ```
#[derive(Debug, Clone)]
pub struct OllamaModel {
    config: OllamaConfig,
    http: Http,
    chat_url: String,
}

impl OllamaModel {
    /// A client with its own connection pool and limits.
    pub fn new(config: OllamaConfig) -> Result<Self, ModelError> {
        Self::build(config, None)
    }

    /// A client sending its requests through `client`, the caller's own
    /// `reqwest::Client` (a proxy, custom root certificates, tracing middleware). The
    /// config's limits, timeouts and retries still apply, except
    /// `HttpConfig::connect_timeout`, which is the given client's own.
    ///
    /// ```
    /// use keel_model::{OllamaConfig, OllamaModel};
    ///
    /// let client = keel_model::reqwest::Client::builder().no_proxy().build()?;
    /// let model = OllamaModel::with_client(OllamaConfig::new("llama3.1:8b"), client)?;
    /// # let _ = model;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_client(config: OllamaConfig, client: reqwest::Client) -> Result<Self, ModelError> {
        Self::build(config, Some(client))
    }

    fn build(config: OllamaConfig, client: Option<reqwest::Client>) -> Result<Self, ModelError> {
        let http = Http::new(config.http.clone(), &[], classify, client)?;
        let chat_url = crate::http::endpoint(&config.base_url, "api/chat")?;
        Ok(OllamaModel {
            config,
            http,
            chat_url,
        })
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &OllamaConfig {
        &self.config
    }

    /// The JSON body sent for a call.
    pub fn request_body(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
        stream: bool,
    ) -> Value {
        let mut body = Map::new();
        let model = options.model.as_deref().unwrap_or(&self.config.model);
        body.insert("model".into(), Value::from(model));
        body.insert("messages".into(), Value::Array(to_wire(messages)));
        if !tools.is_empty() {
            let tools = tools.iter().map(openai::tool_to_value).collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        body.insert("stream".into(), Value::Bool(stream));
        match &options.format {
            Some(ResponseFormat::Json) => {
                body.insert("format".into(), Value::from("json"));
            }
            Some(ResponseFormat::JsonSchema { schema, .. }) => {
                body.insert("format".into(), schema.clone());
            }
            None => {}
        }
        let mut opts = Map::new();
        if let Some(t) = options.temperature {
            opts.insert("temperature".into(), json!(t));
        }
        if let Some(p) = options.top_p {
            opts.insert("top_p".into(), json!(p));
        }
        if let Some(n) = self.config.num_ctx {
            opts.insert("num_ctx".into(), json!(n));
        }
        if let Some(n) = options.max_tokens {
            opts.insert("num_predict".into(), json!(n));
        }
        if let Some(seed) = options.seed {
            opts.insert("seed".into(), json!(seed));
        }
        if !options.stop.is_empty() {
            opts.insert("stop".into(), json!(options.stop));
        }
        if !opts.is_empty() {
            body.insert("options".into(), Value::Object(opts));
        }
        if let Some(keep) = self.config.keep_alive {
            body.insert("keep_alive".into(), keep.to_value());
        }
        for (k, v) in &options.extra {
            body.insert(k.clone(), v.clone());
        }
        Value::Object(body)
    }

    /// The models the server has, from `GET {base_url}/api/tags`.
    pub async fn list_models(&self) -> Result<Vec<String>, ModelError> {
        let url = crate::http::endpoint(&self.config.base_url, "api/tags")?;
        let body = http::parse_body(&self.http.call(&url, None, None).await?)?;
        let models = body
            .get("models")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                ModelError::Malformed(format!(
                    "/api/tags reply has no `models` list: {}",
                    snippet(&body.to_string(), 200)
                ))
            })?;
        Ok(models
            .iter()
            .filter_map(|m| {
                m.get("name")
                    .or_else(|| m.get("model"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .collect())
    }

    fn encode(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        http::encode_body(&self.request_body(messages, tools, options, stream))
    }
}

#[async_trait]
impl ChatModel for OllamaModel {
    fn model_name(&self) -> &str {
        &self.config.model
    }

    /// The config's [`num_ctx`](OllamaConfig::num_ctx), when set.
    fn context_window(&self) -> Option<usize> {
        self.config.num_ctx.map(|n| n as usize)
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let body = self.encode(messages, tools, options, false)?;
        let (reply, retries) = self
            .http
            .call_counted(&self.chat_url, Some(&body), options.timeout)
            .await?;
        let v = http::parse_body(&reply)?;
        let mut acc = Accumulator::new(options.model.as_deref().unwrap_or(&self.config.model));
        acc.absorb(&v, &mut VecDeque::new())?;
        if v.get("message").is_none() {
            return Err(ModelError::Malformed(format!(
                "reply has no message: {}",
                snippet(&v.to_string(), 200)
            )));
        }
        if !v.get("done").and_then(Value::as_bool).unwrap_or(true) {
            return Err(ModelError::Malformed(
                "non-streamed reply is not marked done".into(),
            ));
        }
        Ok(acc.finish().with_retries(retries))
    }

    async fn chat_stream(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatStream, ModelError> {
        let body = self.encode(messages, tools, options, true)?;
        let decoder = Accumulator::new(options.model.as_deref().unwrap_or(&self.config.model));
        self.http
            .stream(&self.chat_url, &body, options.timeout, decoder)
            .await
    }
}

/// keel messages in `/api/chat`'s shape.
fn to_wire(messages: &[Message]) -> Vec<Value> {
    let mut tool_names: HashMap<&str, &str> = HashMap::new();
    messages
        .iter()
        .map(|m| {
            let mut out = Map::new();
            out.insert("role".into(), Value::from(m.role.as_str()));
            out.insert("content".into(), Value::from(m.text().into_owned()));
            let images = images_of(m);
            if !images.is_empty() {
                out.insert("images".into(), Value::Array(images));
            }
            if !m.tool_calls.is_empty() {
                let calls = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        tool_names.insert(&c.id, &c.name);
                        json!({"id": c.id, "function": {"name": c.name, "arguments": arguments_object(&c.arguments)}})
                    })
                    .collect();
                out.insert("tool_calls".into(), Value::Array(calls));
            }
            if m.role == Role::Tool {
                let name = m
                    .tool_call_id
                    .as_deref()
                    .and_then(|id| tool_names.get(id).copied())
                    .or(m.name.as_deref());
                if let Some(name) = name {
                    out.insert("tool_name".into(), Value::from(name));
                }
                if let Some(id) = &m.tool_call_id {
                    out.insert("tool_call_id".into(), Value::from(id.as_str()));
                }
            }
            Value::Object(out)
        })
        .collect()
}

fn images_of(m: &Message) -> Vec<Value> {
    let keel_message::Content::Parts(parts) = &m.content else {
        return Vec::new();
    };
    parts
        .iter()
        .filter_map(|p| match p {
            ContentPart::Image { url, .. } => match url.split_once(";base64,") {
                Some((prefix, data)) if prefix.starts_with("data:") => Some(Value::from(data)),
                _ => {
                    tracing::warn!(url = %snippet(url, 80), "Ollama takes only base64 images; image URL left out");
                    None
                }
            },
            _ => None,
        })
        .collect()
}

fn arguments_object(args: &ToolArguments) -> Value {
    match args {
        ToolArguments::Invalid(raw) => json!({ "arguments": raw }),
        valid => match valid.as_json() {
            Some(v @ Value::Object(_)) => v.clone(),
            Some(other) => json!({ "arguments": other }),
            None => json!({}),
        },
    }
}

fn error_message(v: &Value) -> Option<String> {
    match v.get("error")? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(
            other
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| other.to_string(), str::to_owned),
        ),
    }
}

fn classify(status: u16, body: &[u8], retry_after: Option<Duration>) -> ModelError {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| error_message(&v))
        .unwrap_or_else(|| http::body_text(body));
    http::classify_status(status, message, None, retry_after)
}

/// Assembles a reply from `/api/chat` objects: the one object of a non-streamed reply,
/// or the lines of a stream.
pub(crate) struct Accumulator {
    text: String,
    calls: Vec<ToolCall>,
    usage: Option<Usage>,
    finish: Option<FinishReason>,
    model: String,
}

impl Accumulator {
    pub(crate) fn new(model: &str) -> Self {
        Accumulator {
            text: String::new(),
            calls: Vec::new(),
            usage: None,
            finish: None,
            model: model.to_owned(),
        }
    }

    /// Takes in one object; returns true when it is the last (`done`).
    fn absorb(
        &mut self,
        v: &Value,
        out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<bool, ModelError> {
        if !v.is_object() {
            return Err(ModelError::Malformed(format!(
                "expected a JSON object, got {}",
                snippet(&v.to_string(), 200)
            )));
        }
        if let Some(message) = error_message(v) {
            let err = http::classify_status(400, message.clone(), None, None);
            return Err(if err.is_context_overflow() {
                err
            } else {
                ModelError::StreamInterrupted(format!(
                    "the server answered with an error: {message}"
                ))
            });
        }
        check_shape(v)?;
        if let Some(model) = v.get("model").and_then(Value::as_str) {
            model.clone_into(&mut self.model);
        }
        if let Some(message) = v.get("message") {
            if let Some(text) = message.get("content").and_then(Value::as_str)
                && !text.is_empty()
            {
                self.text.push_str(text);
                out.push_back(Ok(ChatEvent::Text(text.to_owned())));
            }
            let calls = message.get("tool_calls").and_then(Value::as_array);
            for call in calls.into_iter().flatten() {
                let call = tool_call_from(call)?;
                out.push_back(Ok(ChatEvent::ToolCall(ToolCallDelta {
                    index: self.calls.len(),
                    id: Some(call.id.clone()),
                    name: Some(call.name.clone()),
                    arguments: call.arguments.to_json_string(),
                })));
                self.calls.push(call);
            }
        }
        let done = v.get("done").and_then(Value::as_bool).unwrap_or(false);
        if done {
            let prompt = v.get("prompt_eval_count").and_then(Value::as_u64);
            let completion = v.get("eval_count").and_then(Value::as_u64);
            let cached = v.get("prompt_eval_cached_count").and_then(Value::as_u64);
            if prompt.is_some() || completion.is_some() {
                let usage = Usage::new(prompt.unwrap_or(0), completion.unwrap_or(0));
                self.usage = Some(match cached {
                    Some(c) => usage.with_cached_tokens(c),
                    None => usage,
                });
            }
            self.finish = v
                .get("done_reason")
                .and_then(Value::as_str)
                .map(FinishReason::parse);
        }
        Ok(done)
    }

    fn finish(&mut self) -> ChatResponse {
        let message = Message::assistant(std::mem::take(&mut self.text))
            .with_tool_calls(std::mem::take(&mut self.calls));
        ChatResponse {
            message,
            usage: self.usage,
            finish_reason: self.finish.take(),
            model: std::mem::take(&mut self.model),
            retries: 0,
        }
    }
}

/// Checks an `/api/chat` object's shape, as the OpenAI provider checks its replies: a
/// `message` (when there is one) is an object whose `content` is text (or null) and
/// whose `tool_calls` are a list of objects (or null); `done` (when there is one) is a
/// boolean; and an object with neither a message nor `"done": true` says nothing.
/// Anything else is [`ModelError::Malformed`], never an empty answer.
fn check_shape(v: &Value) -> Result<(), ModelError> {
    let malformed = |what: &str| {
        Err(ModelError::Malformed(format!(
            "reply object {what}: {}",
            snippet(&v.to_string(), 200)
        )))
    };
    let done = match v.get("done") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(done)) => *done,
        Some(_) => return malformed("has `done` that is not a boolean"),
    };
    match v.get("message") {
        None | Some(Value::Null) if done => Ok(()),
        None | Some(Value::Null) => malformed("has no message and is not done"),
        Some(Value::Object(message)) => {
            if !message
                .get("content")
                .is_none_or(|c| c.is_string() || c.is_null())
            {
                return malformed("has `message.content` that is not text");
            }
            match message.get("tool_calls") {
                None | Some(Value::Null) => Ok(()),
                Some(Value::Array(calls)) if calls.iter().all(Value::is_object) => Ok(()),
                Some(_) => malformed("has `message.tool_calls` that is not a list of objects"),
            }
        }
        Some(_) => malformed("has a `message` that is not an object"),
    }
}

fn tool_call_from(call: &Value) -> Result<ToolCall, ModelError> {
    let function = call
        .get("function")
        .ok_or_else(|| ModelError::Malformed("tool call without `function`".into()))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ModelError::Malformed("tool call without a function name".into()))?;
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map_or_else(http::new_call_id, str::to_owned);
    Ok(match function.get("arguments") {
        Some(Value::String(raw)) => ToolCall::from_raw_arguments(id, name, raw.clone()),
        Some(v) => ToolCall::new(id, name, v.clone()),
        None => ToolCall::new(id, name, json!({})),
    })
}

impl Decoder for Accumulator {
    fn line(
        &mut self,
        line: &str,
        out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<bool, ModelError> {
        if line.trim().is_empty() {
            return Ok(false);
        }
        let v = http::parse_body(line.as_bytes())?;
        if self.absorb(&v, out)? {
            let response = self.finish();
            out.push_back(Ok(ChatEvent::Done(response)));
            return Ok(true);
        }
        Ok(false)
    }

    fn eof(
        &mut self,
        _out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<(), ModelError> {
        Err(ModelError::StreamInterrupted(
            "the connection closed before the `done` line".into(),
        ))
    }
}
