//! `ollama/<name>` and `openai/<name>`: which server, which model.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use keel::model::{ChatModel, OllamaConfig, OllamaModel, OpenAiConfig, OpenAiModel};
use keel::summarize::{ExtractiveSummarizer, LlmSummarizer, Summarizer};
use keel::token::{MemoCounter, ModelProfile, TokenCounter};

use crate::config::{Settings, env};

/// A parsed `--model` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// Ollama's `/api/chat` at `OLLAMA_BASE_URL` (default `http://127.0.0.1:11434`).
    Ollama(String),
    /// An OpenAI-compatible `/chat/completions` at `OPENAI_BASE_URL`.
    OpenAi(String),
}

impl ModelSpec {
    /// Parses `ollama/<name>` or `openai/<name>`; the name may contain `/` and `:`.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let (provider, name) = text.split_once('/').unwrap_or((text, ""));
        if name.trim().is_empty() {
            bail!(
                "`{text}` is not a model: write `ollama/<name>` (e.g. ollama/qwen2.5:0.5b) or `openai/<name>` (e.g. openai/gpt-4o-mini)"
            );
        }
        match provider {
            "ollama" => Ok(Self::Ollama(name.to_owned())),
            "openai" => Ok(Self::OpenAi(name.to_owned())),
            other => bail!(
                "unknown provider `{other}` in `{text}`: keel speaks `ollama/<name>` and `openai/<name>` (any OpenAI-compatible server, with OPENAI_BASE_URL)"
            ),
        }
    }

    /// The model's own name (what picks its token profile).
    pub fn name(&self) -> &str {
        match self {
            Self::Ollama(n) | Self::OpenAi(n) => n,
        }
    }

    /// Where requests go.
    pub fn base_url(&self, settings: &Settings) -> String {
        match self {
            Self::Ollama(_) => env("OLLAMA_BASE_URL")
                .or_else(|| settings.ollama_base_url.clone())
                .unwrap_or_else(|| OllamaConfig::DEFAULT_BASE_URL.to_owned()),
            Self::OpenAi(_) => env("OPENAI_BASE_URL")
                .or_else(|| settings.openai_base_url.clone())
                .unwrap_or_else(|| OpenAiConfig::DEFAULT_BASE_URL.to_owned()),
        }
    }

    /// A client for the model.
    pub fn client(&self, settings: &Settings) -> anyhow::Result<Arc<dyn ChatModel>> {
        let url = self.base_url(settings);
        Ok(match self {
            Self::Ollama(name) => Arc::new(
                OllamaModel::new(OllamaConfig::new(name.clone()).base_url(url.clone()))
                    .with_context(|| format!("cannot set up Ollama at {url}"))?,
            ),
            Self::OpenAi(name) => {
                let mut config = OpenAiConfig::new(name.clone()).base_url(url.clone());
                if let Some(key) = env("OPENAI_API_KEY") {
                    config = config.api_key(key);
                }
                Arc::new(OpenAiModel::new(config).with_context(|| {
                    format!("cannot set up the OpenAI-compatible server at {url}")
                })?)
            }
        })
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ollama(n) => write!(f, "ollama/{n}"),
            Self::OpenAi(n) => write!(f, "openai/{n}"),
        }
    }
}

/// The token counter of a model profile: exact for the OpenAI encodings, an estimate
/// for models keel has no tokenizer for; memoized either way.
pub fn counter(profile: &ModelProfile) -> anyhow::Result<Arc<dyn TokenCounter>> {
    let inner = profile
        .counter()
        .with_context(|| format!("cannot load the tokenizer of {}", profile.name))?;
    Ok(Arc::new(MemoCounter::new(inner)))
}

/// `extractive` (no model) or a model spec for LLM summaries.
pub fn summarizer(text: &str, settings: &Settings) -> anyhow::Result<Arc<dyn Summarizer>> {
    if text == "extractive" {
        return Ok(Arc::new(ExtractiveSummarizer::new()));
    }
    let spec = ModelSpec::parse(text).context(
        "--summarizer takes `extractive` (no model needed) or a model such as ollama/<name>",
    )?;
    Ok(Arc::new(LlmSummarizer::new(spec.client(settings)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_what_to_write() {
        assert_eq!(
            ModelSpec::parse("ollama/qwen2.5:0.5b").unwrap(),
            ModelSpec::Ollama("qwen2.5:0.5b".into())
        );
        assert_eq!(
            ModelSpec::parse("openai/org/model-x").unwrap().name(),
            "org/model-x"
        );
        for bad in ["gpt-4o", "ollama/", "anthropic/claude"] {
            let err = ModelSpec::parse(bad).unwrap_err().to_string();
            assert!(err.contains("ollama/<name>"), "{bad}: {err}");
        }
    }
}
