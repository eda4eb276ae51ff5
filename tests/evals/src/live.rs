//! A real model for the model-facing evals (`cargo xtask eval --live`).
//!
//! [`from_env`] builds an [`OpenAiModel`] when `OPENAI_BASE_URL` is set (the model from
//! `OPENAI_MODEL`, else the first the server lists), else an [`OllamaModel`] when
//! `OLLAMA_BASE_URL` is set (`OLLAMA_MODEL`, else the first listed). Every call asks
//! for at most [`MAX_TOKENS`] tokens and gives up after [`TIMEOUT`].
//!
//! Model-facing evals: [`crate::intent`] (the LLM summarizer writes the structured
//! summaries) and [`crate::needle`] (the final question goes to the model, with the
//! retrieval tools). The others drive no model judgment and say so.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_message::{Message, ToolSpec};
use keel_model::{
    ChatModel, ChatOptions, ChatResponse, HttpConfig, ModelError, OllamaConfig, OllamaModel,
    OpenAiConfig, OpenAiModel,
};

use crate::EvalError;
use crate::world::Recorder;

/// The most tokens a live call may write.
pub const MAX_TOKENS: u32 = 400;
/// The longest a live call may take.
pub const TIMEOUT: Duration = Duration::from_secs(180);

/// A live model and how to call it.
#[derive(Clone)]
pub struct Live {
    /// The client.
    pub model: Arc<dyn ChatModel>,
    /// `openai/<model> at <url>` or `ollama/<model> at <url>`.
    pub name: String,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Live {
    /// The options of every live call: [`MAX_TOKENS`], [`TIMEOUT`], temperature 0.
    pub fn options(base: &ChatOptions) -> ChatOptions {
        base.clone()
            .max_tokens(MAX_TOKENS)
            .timeout(TIMEOUT)
            .temperature(0.0)
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn http() -> HttpConfig {
    HttpConfig::default().request_timeout(TIMEOUT)
}

/// The model named by `env_var`, else the first one the server lists.
async fn model_name(
    env_var: &str,
    url: &str,
    listed: impl std::future::Future<Output = Result<Vec<String>, ModelError>>,
) -> Result<String, EvalError> {
    if let Some(m) = var(env_var) {
        return Ok(m);
    }
    listed.await?.into_iter().next().ok_or_else(|| {
        EvalError::Model(ModelError::Malformed(format!(
            "{url} lists no models; set {env_var}"
        )))
    })
}

/// The live model named by the environment; `Ok(Err(why))` when no server is set.
pub async fn from_env() -> Result<Result<Live, String>, EvalError> {
    if let Some(url) = var("OPENAI_BASE_URL") {
        let probe = OpenAiModel::new(OpenAiConfig::from_env("probe").http(http()))?;
        let name = model_name("OPENAI_MODEL", &url, probe.list_models()).await?;
        let model = OpenAiModel::new(OpenAiConfig::from_env(name.clone()).http(http()))?;
        return Ok(Ok(Live {
            model: Arc::new(model),
            name: format!("openai/{name} at {url}"),
        }));
    }
    if let Some(url) = var("OLLAMA_BASE_URL") {
        let probe = OllamaModel::new(OllamaConfig::from_env("probe").http(http()))?;
        let name = model_name("OLLAMA_MODEL", &url, probe.list_models()).await?;
        let model = OllamaModel::new(OllamaConfig::from_env(name.clone()).http(http()))?;
        return Ok(Ok(Live {
            model: Arc::new(model),
            name: format!("ollama/{name} at {url}"),
        }));
    }
    Ok(Err(
        "neither OPENAI_BASE_URL nor OLLAMA_BASE_URL is set (e.g. OPENAI_BASE_URL=http://127.0.0.1:8089/v1 for a local llama.cpp server)".to_owned(),
    ))
}

/// A live model that records each call, with [`Live::options`].
#[derive(Clone)]
pub struct Recorded {
    live: Live,
    recorder: Recorder,
}

impl Recorded {
    /// Records `live`'s calls into `recorder`.
    pub fn new(live: &Live, recorder: Recorder) -> Self {
        Recorded {
            live: live.clone(),
            recorder,
        }
    }
}

#[async_trait::async_trait]
impl ChatModel for Recorded {
    fn model_name(&self) -> &str {
        self.live.model.model_name()
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let reply = self
            .live
            .model
            .chat(messages, tools, &Live::options(options))
            .await;
        match &reply {
            Ok(r) => self.recorder.record(messages, &r.message),
            Err(e) => self.recorder.record(
                messages,
                &Message::assistant(format!("[live call failed: {e}]")),
            ),
        }
        reply
    }
}

/// The scripted reader until [`Switch::go_live`], then the live model.
#[derive(Clone)]
pub struct Switch {
    reader: Arc<dyn ChatModel>,
    live: Recorded,
    on: Arc<AtomicBool>,
}

impl Switch {
    /// Starts as `reader`; the live model's calls go to `recorder`.
    pub fn new(reader: Arc<dyn ChatModel>, live: &Live, recorder: Recorder) -> Self {
        Switch {
            reader,
            live: Recorded::new(live, recorder),
            on: Arc::new(AtomicBool::new(false)),
        }
    }

    /// From now on, the live model answers.
    pub fn go_live(&self) {
        self.on.store(true, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl ChatModel for Switch {
    fn model_name(&self) -> &str {
        self.reader.model_name()
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        if self.on.load(Ordering::SeqCst) {
            self.live.chat(messages, tools, options).await
        } else {
            self.reader.chat(messages, tools, options).await
        }
    }
}
