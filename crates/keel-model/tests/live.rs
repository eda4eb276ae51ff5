//! Live tests against a real server: `cargo xtask llm-live` runs them when
//! `OPENAI_BASE_URL` or `OLLAMA_BASE_URL` is set (`OPENAI_MODEL` / `OLLAMA_MODEL` pick
//! the model; otherwise the first one the server lists). Each test says it skipped when
//! its variable is not set.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_message::{Message, ToolSpec};
use keel_model::{
    ChatEvent, ChatModel, ChatOptions, HttpConfig, ModelError, OllamaConfig, OllamaModel,
    OpenAiConfig, OpenAiModel,
};
use serde_json::json;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn http() -> HttpConfig {
    HttpConfig::default()
        .request_timeout(Duration::from_secs(180))
        .stream_idle_timeout(Duration::from_secs(120))
}

async fn openai() -> Option<Arc<dyn ChatModel>> {
    var("OPENAI_BASE_URL")?;
    let probe = OpenAiModel::new(OpenAiConfig::from_env("probe").http(http())).ok()?;
    let name = match var("OPENAI_MODEL") {
        Some(m) => m,
        None => probe.list_models().await.ok()?.into_iter().next()?,
    };
    eprintln!(
        "live: OpenAI-compatible server at {:?}, model {name}",
        var("OPENAI_BASE_URL")
    );
    Some(Arc::new(
        OpenAiModel::new(OpenAiConfig::from_env(name).http(http())).ok()?,
    ))
}

async fn ollama() -> Option<Arc<dyn ChatModel>> {
    var("OLLAMA_BASE_URL")?;
    let probe = OllamaModel::new(OllamaConfig::from_env("probe").http(http())).ok()?;
    let name = match var("OLLAMA_MODEL") {
        Some(m) => m,
        None => probe.list_models().await.ok()?.into_iter().next()?,
    };
    eprintln!("live: Ollama at {:?}, model {name}", var("OLLAMA_BASE_URL"));
    Some(Arc::new(
        OllamaModel::new(OllamaConfig::from_env(name).http(http()).num_ctx(8192)).ok()?,
    ))
}

#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
async fn exercise(model: Arc<dyn ChatModel>) {
    let options = ChatOptions::new().temperature(0.0).max_tokens(24);
    let ask = [
        Message::system("You answer in one short sentence."),
        Message::user("What is the capital of France?"),
    ];

    // One complete reply, with usage as the server reports it.
    let reply = model.chat(&ask, &[], &options).await.unwrap();
    eprintln!(
        "live chat: {:?} usage={:?} finish={:?} model={}",
        reply.text(),
        reply.usage,
        reply.finish_reason,
        reply.model
    );
    let usage = reply.usage.expect("the server reports usage");
    assert!(usage.prompt_tokens > 0);

    // Streamed: the final reply is exactly the deltas put together.
    let mut stream = model.chat_stream(&ask, &[], &options).await.unwrap();
    let mut text = String::new();
    let mut deltas = 0;
    let mut done = None;
    while let Some(event) = stream.next().await {
        match event.unwrap() {
            ChatEvent::Text(t) => {
                text.push_str(&t);
                deltas += 1;
            }
            ChatEvent::ToolCall(_) => {}
            ChatEvent::Done(r) => done = Some(r),
        }
    }
    let done = done.expect("the stream ends with Done");
    eprintln!(
        "live stream: {deltas} text deltas, {:?}, usage={:?}",
        done.text(),
        done.usage
    );
    assert_eq!(done.text(), text);

    // Tools offered and asked for in the prompt, with the agent's own `tool_choice`
    // (auto): the reply must call the tool, well formed. A server that does not pass
    // tools to the model (llama-cpp-python without a function-calling chat format,
    // llama.cpp without --jinja) answers in prose, and an agent on it would never
    // call a tool. (Naming the tool in `tool_choice` would not tell: such servers
    // force a call by grammar all the same.)
    let tool = ToolSpec::new(
        "get_weather",
        "Current weather for a city.",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    );
    let asked = options.clone().max_tokens(64);
    let reply = model
        .chat(
            &[Message::user("What is the weather in Paris? Use the tool.")],
            &[tool],
            &asked,
        )
        .await
        .unwrap();
    eprintln!(
        "live tools: text={:?} calls={:?}",
        reply.text(),
        reply.message.tool_calls
    );
    let call = reply.message.tool_calls.first().unwrap_or_else(|| {
        panic!(
            "the server answered {:?} without calling the tool it was asked to call: it does not pass tools to the model (llama-cpp-python: --chat_format chatml-function-calling; llama.cpp: --jinja)",
            reply.text()
        )
    });
    assert!(!call.id.is_empty(), "{call:?}");
    assert_eq!(call.name, "get_weather", "{call:?}");

    // A prompt far past an 8k window: a server that refuses it must say so with a
    // ContextOverflow; one with a larger window may accept it.
    let huge = "lorem ipsum dolor sit amet ".repeat(8_000);
    match model
        .chat(&[Message::user(huge)], &[], &options.clone().max_tokens(4))
        .await
    {
        Err(e) => {
            eprintln!("live overflow: {e}");
            assert!(
                e.is_context_overflow(),
                "expected ContextOverflow, got {e:?}"
            );
        }
        Ok(r) => eprintln!(
            "live overflow: the server accepted ~40k tokens (usage {:?}); nothing to check",
            r.usage
        ),
    }

    // A nonexistent model is a typed error, not a panic or a hang.
    let wrong = model
        .chat(&ask, &[], &options.clone().model("no-such-model-keel"))
        .await;
    eprintln!(
        "live wrong model: {:?}",
        wrong.as_ref().map(|r| r.model.clone())
    );
    if let Err(e) = wrong {
        assert!(!matches!(e, ModelError::Malformed(_)), "{e:?}");
    }
}

#[tokio::test]
#[ignore = "live: needs OPENAI_BASE_URL; run with `cargo xtask llm-live`"]
async fn openai_compatible_server() {
    match openai().await {
        Some(model) => exercise(model).await,
        None => eprintln!("skipped: OPENAI_BASE_URL not set (or the server lists no model)"),
    }
}

#[tokio::test]
#[ignore = "live: needs OLLAMA_BASE_URL; run with `cargo xtask llm-live`"]
async fn ollama_server() {
    match ollama().await {
        Some(model) => exercise(model).await,
        None => eprintln!("skipped: OLLAMA_BASE_URL not set (or the server lists no model)"),
    }
}
