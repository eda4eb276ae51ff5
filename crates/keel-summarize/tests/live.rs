//! Live summarizer tests against a real server: `cargo xtask llm-live` runs them when
//! `OPENAI_BASE_URL` or `OLLAMA_BASE_URL` is set. The rule under test: a summary either
//! has its required shape and fits its budget, or it is an error; never a malformed
//! summary, never error text as a summary.

use std::sync::Arc;
use std::time::Duration;

use keel_message::{Message, ToolCall};
use keel_model::{
    ChatModel, ChatOptions, HttpConfig, OllamaConfig, OllamaModel, OpenAiConfig, OpenAiModel,
};
use keel_summarize::{
    LlmSummarizer, SECTIONS, SummarizeError, Summarizer, SummaryFormat, SummaryRequest,
};
use keel_token::{ApproxCounter, TokenCounter};
use serde_json::json;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn http() -> HttpConfig {
    HttpConfig::default().request_timeout(Duration::from_secs(180))
}

async fn models() -> Vec<Arc<dyn ChatModel>> {
    let mut out: Vec<Arc<dyn ChatModel>> = Vec::new();
    if var("OPENAI_BASE_URL").is_some()
        && let Ok(probe) = OpenAiModel::new(OpenAiConfig::from_env("probe").http(http()))
    {
        let name = match var("OPENAI_MODEL") {
            Some(m) => Some(m),
            None => probe
                .list_models()
                .await
                .ok()
                .and_then(|m| m.into_iter().next()),
        };
        if let Some(name) = name
            && let Ok(m) = OpenAiModel::new(OpenAiConfig::from_env(name).http(http()))
        {
            out.push(Arc::new(m));
        }
    }
    if var("OLLAMA_BASE_URL").is_some()
        && let Ok(probe) = OllamaModel::new(OllamaConfig::from_env("probe").http(http()))
    {
        let name = match var("OLLAMA_MODEL") {
            Some(m) => Some(m),
            None => probe
                .list_models()
                .await
                .ok()
                .and_then(|m| m.into_iter().next()),
        };
        if let Some(name) = name
            && let Ok(m) =
                OllamaModel::new(OllamaConfig::from_env(name).http(http()).num_ctx(8_192))
        {
            out.push(Arc::new(m));
        }
    }
    out
}

fn session() -> Vec<Message> {
    vec![
        Message::user("The nightly build of the server fails. Find out why and fix it."),
        Message::assistant("I will run the build to see the error.").with_tool_calls(vec![
            ToolCall::new("c1", "bash", json!({"command": "make all"})),
        ]),
        Message::tool(
            "c1",
            "gcc -O2 -c net.c\nnet.c:88:21: error: 'MSG_NOSIGNAL' undeclared (first use in this function)\nmake: *** [Makefile:12: net.o] Error 1\nexit status 2",
        ),
        Message::assistant(
            "MSG_NOSIGNAL is Linux-only; the nightly runs on macOS. I will guard it with #ifdef and use SO_NOSIGPIPE instead.",
        )
        .with_tool_calls(vec![ToolCall::new(
            "c2",
            "edit",
            json!({"path": "net.c", "line": 88}),
        )]),
        Message::tool("c2", "edited net.c"),
    ]
}

#[tokio::test]
#[ignore = "live: needs OPENAI_BASE_URL or OLLAMA_BASE_URL; run with `cargo xtask llm-live`"]
async fn live_summaries_have_their_shape_and_budget_or_are_errors() {
    let models = models().await;
    if models.is_empty() {
        eprintln!("skipped: neither OPENAI_BASE_URL nor OLLAMA_BASE_URL is set");
        return;
    }
    let counter = ApproxCounter::new();
    let msgs = session();
    let window = var("KEEL_LIVE_WINDOW")
        .and_then(|w| w.parse().ok())
        .unwrap_or(8_192);
    for model in models {
        for format in [SummaryFormat::Bullets, SummaryFormat::Structured] {
            let summarizer = LlmSummarizer::new(model.clone())
                .with_format(format)
                .with_window_tokens(window)
                .with_options(ChatOptions::new());
            let budget = 200;
            let result = summarizer
                .summarize(&SummaryRequest::milestone(&msgs, budget))
                .await;
            match result {
                Ok(summary) => {
                    eprintln!(
                        "live {} {format:?}: accepted ({}, usage {:?}):\n{}",
                        model.model_name(),
                        summary.prompt_version,
                        summary.usage,
                        summary.text
                    );
                    assert!(counter.count_text(&summary.text) <= budget);
                    if format == SummaryFormat::Structured {
                        let titles: Vec<&str> =
                            summary.sections.iter().map(|s| s.title.as_str()).collect();
                        assert_eq!(titles, SECTIONS);
                    } else {
                        let n = summary.sections[0].items.len();
                        assert!((1..=5).contains(&n));
                    }
                }
                Err(SummarizeError::Rejected { reason, attempts }) => {
                    eprintln!(
                        "live {} {format:?}: rejected after {attempts} attempts: {reason}",
                        model.model_name()
                    );
                    assert_eq!(attempts, 2);
                }
                Err(other) => panic!("unexpected failure: {other}"),
            }
        }
    }
}
