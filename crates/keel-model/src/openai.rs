//! The OpenAI-compatible provider: `POST {base_url}/chat/completions`.

use std::collections::VecDeque;
use std::time::Duration;

use async_trait::async_trait;
use keel_message::{Message, ToolCall, ToolSpec, openai};
use serde_json::{Map, Value, json};

use crate::error::snippet;
use crate::http::{self, Decoder, Http, HttpConfig, env};
use crate::{
    ChatEvent, ChatModel, ChatOptions, ChatResponse, ChatStream, FinishReason, ModelError,
    ResponseFormat, ToolCallDelta, Usage,
};

/// Where and how to reach an OpenAI-compatible server.
///
/// The base URL includes the API version path (`https://api.openai.com/v1`,
/// `http://127.0.0.1:8080/v1` for llama.cpp's server, `http://localhost:8000/v1` for
/// vLLM, `http://localhost:1234/v1` for LM Studio).
///
/// ```
/// use keel_model::OpenAiConfig;
///
/// let config = OpenAiConfig::new("gpt-4.1-mini")
///     .base_url("http://127.0.0.1:8080/v1")
///     .api_key("sk-local");
/// assert_eq!(config.base_url, "http://127.0.0.1:8080/v1");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiConfig {
    /// The API root, including `/v1`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer ...` when set.
    pub api_key: Option<String>,
    /// The model to call.
    pub model: String,
    /// Timeouts, retries and limits.
    pub http: HttpConfig,
    /// Ask for usage at the end of a stream (`stream_options.include_usage`,
    /// default true). Turn off for servers that reject the field.
    pub stream_usage: bool,
    /// Send the reply limit as `max_completion_tokens` (OpenAI's reasoning models)
    /// rather than `max_tokens` (default false: every compatible server knows
    /// `max_tokens`).
    pub max_completion_tokens: bool,
}

impl OpenAiConfig {
    /// OpenAI's own endpoint.
    pub const DEFAULT_BASE_URL: &'static str = "https://api.openai.com/v1";

    /// A config for `model` at [`DEFAULT_BASE_URL`](Self::DEFAULT_BASE_URL), no key,
    /// default transport settings. Reads no environment.
    pub fn new(model: impl Into<String>) -> Self {
        OpenAiConfig {
            base_url: Self::DEFAULT_BASE_URL.to_owned(),
            api_key: None,
            model: model.into(),
            http: HttpConfig::default(),
            stream_usage: true,
            max_completion_tokens: false,
        }
    }

    /// Like [`new`](Self::new), with the base URL from `OPENAI_BASE_URL` and the key
    /// from `OPENAI_API_KEY` when they are set. Builder calls after this override them.
    pub fn from_env(model: impl Into<String>) -> Self {
        let mut config = Self::new(model);
        if let Some(url) = env("OPENAI_BASE_URL") {
            config.base_url = url;
        }
        config.api_key = env("OPENAI_API_KEY");
        config
    }

    /// Sets the base URL.
    #[must_use]
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = url.into();
        self
    }

    /// Sets the API key.
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// Sets the transport settings.
    #[must_use]
    pub fn http(mut self, http: HttpConfig) -> Self {
        self.http = http;
        self
    }

    /// Sets [`stream_usage`](Self::stream_usage).
    #[must_use]
    pub fn stream_usage(mut self, on: bool) -> Self {
        self.stream_usage = on;
        self
    }

    /// Sets [`max_completion_tokens`](Self::max_completion_tokens).
    #[must_use]
    pub fn max_completion_tokens(mut self, on: bool) -> Self {
        self.max_completion_tokens = on;
        self
    }
}

/// A client for an OpenAI-compatible `/chat/completions` endpoint (OpenAI, vLLM,
/// llama.cpp's server, LM Studio, ...).
///
/// Messages and tools are converted with [`keel_message::openai`]. Non-streamed calls
/// send `"stream": false`; [`chat_stream`](ChatModel::chat_stream) reads server-sent
/// events, assembles tool calls from their fragments, and takes usage from the final
/// chunk. Error replies become typed [`ModelError`]s; `context_length_exceeded` (and
/// the equivalents of compatible servers) becomes [`ModelError::ContextOverflow`].
///
/// ```
/// use keel_message::Message;
/// use keel_model::{ChatOptions, OpenAiConfig, OpenAiModel};
///
/// let model = OpenAiModel::new(OpenAiConfig::new("gpt-4.1-mini"))?;
/// let body = model.request_body(&[Message::user("hi")], &[], &ChatOptions::new().max_tokens(5), true);
/// assert_eq!(body["model"], "gpt-4.1-mini");
/// assert_eq!(body["messages"][0]["content"], "hi");
/// assert_eq!(body["stream_options"]["include_usage"], true);
/// # Ok::<(), keel_model::ModelError>(())
/// ```
#[derive(Debug, Clone)]
pub struct OpenAiModel {
    config: OpenAiConfig,
    http: Http,
    chat_url: String,
}

impl OpenAiModel {
    /// A client with its own connection pool and limits.
    pub fn new(config: OpenAiConfig) -> Result<Self, ModelError> {
        Self::build(config, None)
    }

    /// A client sending its requests through `client`, the caller's own
    /// `reqwest::Client` (a proxy, custom root certificates, tracing middleware). The
    /// API key is still sent with every request, and the config's limits, timeouts and
    /// retries still apply, except `HttpConfig::connect_timeout`, which is the given
    /// client's own.
    ///
    /// ```
    /// use keel_model::{OpenAiConfig, OpenAiModel};
    ///
    /// let client = keel_model::reqwest::Client::builder().no_proxy().build()?;
    /// let model = OpenAiModel::with_client(OpenAiConfig::new("gpt-4.1-mini"), client)?;
    /// # let _ = model;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_client(config: OpenAiConfig, client: reqwest::Client) -> Result<Self, ModelError> {
        Self::build(config, Some(client))
    }

    fn build(config: OpenAiConfig, client: Option<reqwest::Client>) -> Result<Self, ModelError> {
        let mut headers = Vec::new();
        if let Some(key) = &config.api_key {
            headers.push(("authorization", format!("Bearer {key}")));
        }
        let http = Http::new(config.http.clone(), &headers, classify, client)?;
        let chat_url = crate::http::endpoint(&config.base_url, "chat/completions")?;
        Ok(OpenAiModel {
            config,
            http,
            chat_url,
        })
    }

    /// The configuration this client was built with.
    pub fn config(&self) -> &OpenAiConfig {
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
        let mut wire = openai::to_values(messages);
        // An assistant turn of tool calls alone goes out with `"content": ""`, not the
        // `null` OpenAI writes: OpenAI takes both, and several compatible servers
        // (llama-cpp-python, SGLang, older llama.cpp) refuse `null`.
        for m in &mut wire {
            if let Some(content @ Value::Null) = m.get_mut("content") {
                *content = Value::String(String::new());
            }
        }
        body.insert("messages".into(), Value::Array(wire));
        if !tools.is_empty() {
            let tools = tools.iter().map(openai::tool_to_value).collect();
            body.insert("tools".into(), Value::Array(tools));
            // OpenAI's default when tools are given, said outright: some compatible
            // servers (llama-cpp-python's function-calling handlers) take a missing
            // `tool_choice` as "none" and drop the tools from the prompt.
            body.insert("tool_choice".into(), Value::from("auto"));
        }
        if let Some(t) = options.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = options.top_p {
            body.insert("top_p".into(), json!(p));
        }
        if let Some(n) = options.max_tokens {
            let key = if self.config.max_completion_tokens {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            body.insert(key.into(), json!(n));
        }
        if !options.stop.is_empty() {
            body.insert("stop".into(), json!(options.stop));
        }
        if let Some(seed) = options.seed {
            body.insert("seed".into(), json!(seed));
        }
        match &options.format {
            Some(ResponseFormat::Json) => {
                body.insert("response_format".into(), json!({"type": "json_object"}));
            }
            Some(ResponseFormat::JsonSchema { name, schema }) => {
                body.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema}}),
                );
            }
            None => {}
        }
        body.insert("stream".into(), Value::Bool(stream));
        if stream && self.config.stream_usage {
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        for (k, v) in &options.extra {
            body.insert(k.clone(), v.clone());
        }
        Value::Object(body)
    }

    /// The model ids the server lists at `GET {base_url}/models`.
    pub async fn list_models(&self) -> Result<Vec<String>, ModelError> {
        let url = crate::http::endpoint(&self.config.base_url, "models")?;
        let body = http::parse_body(&self.http.call(&url, None, None).await?)?;
        let data = body.get("data").and_then(Value::as_array).ok_or_else(|| {
            ModelError::Malformed(format!(
                "/models reply has no `data` list: {}",
                snippet(&body.to_string(), 200)
            ))
        })?;
        Ok(data
            .iter()
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_owned))
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
impl ChatModel for OpenAiModel {
    fn model_name(&self) -> &str {
        &self.config.model
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
        parse_response(&http::parse_body(&reply)?, &self.config.model)
            .map(|r| r.with_retries(retries))
    }

    async fn chat_stream(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatStream, ModelError> {
        let body = self.encode(messages, tools, options, true)?;
        let decoder = SseDecoder::new(
            options.model.as_deref().unwrap_or(&self.config.model),
            self.config.http.max_line_bytes,
        );
        self.http
            .stream(&self.chat_url, &body, options.timeout, decoder)
            .await
    }
}

/// `{"error": {"message", "type", "code"}}`, `{"error": "..."}`, or FastAPI's
/// `{"detail": ...}`.
fn error_fields(v: &Value) -> Option<(String, Option<String>)> {
    match v.get("error") {
        Some(Value::Object(e)) => {
            let message = e
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| Value::Object(e.clone()).to_string(), str::to_owned);
            let code = e
                .get("code")
                .and_then(Value::as_str)
                .or_else(|| e.get("type").and_then(Value::as_str))
                .map(str::to_owned);
            Some((message, code))
        }
        Some(Value::String(s)) => Some((s.clone(), None)),
        _ => match v.get("detail").or_else(|| v.get("message")) {
            Some(Value::String(s)) => Some((s.clone(), None)),
            Some(other) => Some((other.to_string(), None)),
            None => None,
        },
    }
}

fn classify(status: u16, body: &[u8], retry_after: Option<Duration>) -> ModelError {
    let (message, code) = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| error_fields(&v))
        .unwrap_or_else(|| (http::body_text(body), None));
    http::classify_status(status, message, code, retry_after)
}

/// An error object inside a successful (200) reply or stream.
fn embedded_error(v: &Value) -> Option<ModelError> {
    let (message, code) = error_fields(v).filter(|_| v.get("error").is_some())?;
    let err = http::classify_status(400, message.clone(), code, None);
    Some(if err.is_context_overflow() {
        err
    } else {
        ModelError::StreamInterrupted(format!("the server answered with an error: {message}"))
    })
}

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let usage = Usage::new(n("prompt_tokens"), n("completion_tokens"));
    // OpenAI (and vLLM, llama.cpp's server) report the cached prefix here.
    let cached = u
        .get("prompt_tokens_details")
        .and_then(|d| d.get("cached_tokens"))
        .and_then(Value::as_u64);
    Some(match cached {
        Some(c) => usage.with_cached_tokens(c),
        None => usage,
    })
}

fn parse_response(v: &Value, default_model: &str) -> Result<ChatResponse, ModelError> {
    if let Some(err) = embedded_error(v) {
        return Err(err);
    }
    let choice = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| {
            ModelError::Malformed(format!(
                "reply has no choices: {}",
                snippet(&v.to_string(), 200)
            ))
        })?;
    let mut wire = choice
        .get("message")
        .cloned()
        .ok_or_else(|| ModelError::Malformed("choices[0] has no message".into()))?;
    if let Some(calls) = wire.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for call in calls.iter_mut().filter_map(Value::as_object_mut) {
            if !call.get("id").is_some_and(Value::is_string) {
                call.insert("id".into(), Value::from(http::new_call_id()));
            }
        }
    }
    let mut message = openai::from_value(&wire)
        .map_err(|e| ModelError::Malformed(format!("choices[0].message: {e}")))?;
    // Provider-specific reply fields are not sent back to the provider.
    message.metadata.remove("openai");
    Ok(ChatResponse {
        message,
        usage: usage_of(v),
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(FinishReason::parse),
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(default_model)
            .to_owned(),
        retries: 0,
    })
}

/// Checks a stream chunk's shape: an object with a `choices` list (empty in a final
/// usage chunk) or a `usage` object; each choice an object, its `delta` (when there is
/// one) an object whose `content` is text (or null) and whose `tool_calls` are a list
/// (or null). Anything
/// else is [`ModelError::Malformed`], as the same shape is in a non-streamed reply.
fn check_chunk(chunk: &Value) -> Result<(), ModelError> {
    let malformed = |what: &str| {
        Err(ModelError::Malformed(format!(
            "stream chunk {what}: {}",
            snippet(&chunk.to_string(), 200)
        )))
    };
    if !chunk.is_object() {
        return malformed("is not a JSON object");
    }
    let choices = match chunk.get("choices") {
        Some(Value::Array(choices)) => choices,
        None | Some(Value::Null) if chunk.get("usage").is_some_and(Value::is_object) => {
            return Ok(());
        }
        None | Some(Value::Null) => return malformed("has neither `choices` nor `usage`"),
        Some(_) => return malformed("has `choices` that is not a list"),
    };
    for choice in choices {
        if !choice.is_object() {
            return malformed("has a choice that is not an object");
        }
        // A choice without a delta carries nothing (Azure's content-filter chunks).
        let Some(delta) = choice.get("delta") else {
            continue;
        };
        if !delta.is_object() {
            return malformed("has a `delta` that is not an object");
        }
        if !delta
            .get("content")
            .is_none_or(|c| c.is_string() || c.is_null())
        {
            return malformed("has `content` that is not text");
        }
        match delta.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) if calls.iter().all(Value::is_object) => {}
            Some(_) => return malformed("has `tool_calls` that is not a list of objects"),
        }
    }
    Ok(())
}

#[derive(Default)]
struct PartialCall {
    id: Option<String>,
    name: String,
    arguments: String,
}

/// Server-sent events of `chat.completion.chunk` objects, ended by `data: [DONE]`.
pub(crate) struct SseDecoder {
    data: String,
    has_data: bool,
    /// The longest event (its `data:` lines together), in bytes.
    max_event: usize,
    text: String,
    calls: Vec<PartialCall>,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    model: String,
}

impl SseDecoder {
    pub(crate) fn new(model: &str, max_event: usize) -> Self {
        SseDecoder {
            data: String::new(),
            has_data: false,
            max_event,
            text: String::new(),
            calls: Vec::new(),
            finish: None,
            usage: None,
            model: model.to_owned(),
        }
    }

    fn finish(&mut self) -> ChatEvent {
        let calls = std::mem::take(&mut self.calls)
            .into_iter()
            .map(|c| {
                let args = if c.arguments.trim().is_empty() {
                    "{}".to_owned()
                } else {
                    c.arguments
                };
                ToolCall::from_raw_arguments(c.id.unwrap_or_else(http::new_call_id), c.name, args)
            })
            .collect();
        let message = Message::assistant(std::mem::take(&mut self.text)).with_tool_calls(calls);
        ChatEvent::Done(ChatResponse {
            message,
            usage: self.usage,
            finish_reason: self.finish.take(),
            model: std::mem::take(&mut self.model),
            retries: 0,
        })
    }

    /// Handles one complete event's data. Returns true at `[DONE]`.
    fn dispatch(
        &mut self,
        out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<bool, ModelError> {
        let data = std::mem::take(&mut self.data);
        self.has_data = false;
        if data.trim() == "[DONE]" {
            out.push_back(Ok(self.finish()));
            return Ok(true);
        }
        let chunk = http::parse_body(data.as_bytes())?;
        if let Some(err) = embedded_error(&chunk) {
            return Err(err);
        }
        check_chunk(&chunk)?;
        if let Some(model) = chunk.get("model").and_then(Value::as_str) {
            model.clone_into(&mut self.model);
        }
        if let Some(usage) = usage_of(&chunk) {
            self.usage = Some(usage);
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish = Some(FinishReason::parse(reason));
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            if let Some(text) = delta.get("content").and_then(Value::as_str)
                && !text.is_empty()
            {
                self.text.push_str(text);
                out.push_back(Ok(ChatEvent::Text(text.to_owned())));
            }
            let calls = delta.get("tool_calls").and_then(Value::as_array);
            for (position, call) in calls.into_iter().flatten().enumerate() {
                let index = call
                    .get("index")
                    .and_then(Value::as_u64)
                    .map_or(position, |i| i as usize);
                if index > self.calls.len() + 1024 {
                    return Err(ModelError::Malformed(format!(
                        "tool call index {index} out of range"
                    )));
                }
                if self.calls.len() <= index {
                    self.calls.resize_with(index + 1, PartialCall::default);
                }
                let Some(slot) = self.calls.get_mut(index) else {
                    return Err(ModelError::Malformed(format!(
                        "tool call index {index} out of range"
                    )));
                };
                let id = call.get("id").and_then(Value::as_str).map(str::to_owned);
                let function = call.get("function");
                let name = function
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                let arguments = function
                    .and_then(|f| f.get("arguments"))
                    .map(|a| match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .unwrap_or_default();
                if let Some(id) = &id {
                    slot.id = Some(id.clone());
                }
                if let Some(name) = &name {
                    slot.name.push_str(name);
                }
                slot.arguments.push_str(&arguments);
                out.push_back(Ok(ChatEvent::ToolCall(ToolCallDelta {
                    index,
                    id,
                    name,
                    arguments,
                })));
            }
        }
        Ok(false)
    }
}

impl Decoder for SseDecoder {
    fn line(
        &mut self,
        line: &str,
        out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<bool, ModelError> {
        if line.is_empty() {
            return if self.has_data {
                self.dispatch(out)
            } else {
                Ok(false)
            };
        }
        if let Some(rest) = line.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            if self.data.len() + rest.len() + 1 > self.max_event {
                return Err(ModelError::LineTooLong {
                    limit: self.max_event,
                });
            }
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(rest);
            self.has_data = true;
        }
        // Comments (`:`) and the `event`, `id` and `retry` fields carry nothing here.
        Ok(false)
    }

    fn eof(&mut self, out: &mut VecDeque<Result<ChatEvent, ModelError>>) -> Result<(), ModelError> {
        if self.has_data && self.dispatch(out)? {
            return Ok(());
        }
        if self.finish.is_some() {
            // Some servers close after the last chunk without `[DONE]`.
            out.push_back(Ok(self.finish()));
            return Ok(());
        }
        Err(ModelError::StreamInterrupted(
            "the connection closed before the reply was complete".into(),
        ))
    }
}
