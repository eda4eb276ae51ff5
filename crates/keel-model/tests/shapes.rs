//! Both providers agree on what a malformed reply is: `Malformed`, never an empty
//! answer, in the non-streamed and the streamed path alike.

use futures::StreamExt;
use keel_message::Message;
use keel_model::{
    ChatModel, ChatOptions, ChatResponse, ModelError, OllamaConfig, OllamaModel, OpenAiConfig,
    OpenAiModel, RetryPolicy,
};
use serde_json::{Value, json};
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

/// Shapes that are no answer in either API.
fn malformed() -> Vec<Value> {
    vec![
        json!({}),
        json!({"message": "hello", "done": true}),
        json!({"choices": 5, "message": []}),
        json!({"choices": [{"index": 0, "message": [], "delta": 3}], "message": {"content": 5}, "done": true}),
        json!({"choices": [{"index": 0, "delta": {"content": 5}}], "message": {"role": "assistant", "content": 5}, "done": true}),
        json!({"choices": [7], "message": {"role": "assistant", "tool_calls": "none"}, "done": true}),
        json!({"choices": [{"index": 0, "delta": []}], "message": {"role": "assistant", "content": "x"}, "done": "yes"}),
    ]
}

#[allow(clippy::unwrap_used)]
fn models(base: &str) -> [(&'static str, Box<dyn ChatModel>); 2] {
    let http = keel_model::HttpConfig::default().retry(RetryPolicy::none());
    [
        (
            "openai",
            Box::new(
                OpenAiModel::new(OpenAiConfig::new("m").base_url(base).http(http.clone())).unwrap(),
            ),
        ),
        (
            "ollama",
            Box::new(OllamaModel::new(OllamaConfig::new("m").base_url(base).http(http)).unwrap()),
        ),
    ]
}

async fn serve(body: String, content_type: &str) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, content_type))
        .mount(&server)
        .await;
    server
}

/// The streamed reply's items: every delta, then the end or the error.
async fn streamed(model: &dyn ChatModel) -> Result<ChatResponse, ModelError> {
    let mut stream = model
        .chat_stream(&[Message::user("hi")], &[], &ChatOptions::new())
        .await?;
    while let Some(item) = stream.next().await {
        if let keel_model::ChatEvent::Done(reply) = item? {
            return Ok(reply);
        }
    }
    Err(ModelError::StreamInterrupted("no end".into()))
}

#[tokio::test]
async fn malformed_replies_are_malformed_for_both_providers_streamed_or_not() {
    for shape in malformed() {
        let whole = serve(shape.to_string(), "application/json").await;
        for (name, model) in models(&whole.uri()) {
            let reply = model
                .chat(&[Message::user("hi")], &[], &ChatOptions::new())
                .await;
            assert!(
                matches!(reply, Err(ModelError::Malformed(_))),
                "{name}, not streamed, {shape}: {reply:?}"
            );
        }
        let sse = serve(
            format!("data: {shape}\n\ndata: [DONE]\n\n"),
            "text/event-stream",
        )
        .await;
        let ndjson = serve(format!("{shape}\n"), "application/x-ndjson").await;
        for (server, provider) in [(&sse, "openai"), (&ndjson, "ollama")] {
            let [(_, openai), (_, ollama)] = models(&server.uri());
            let model = if provider == "openai" { openai } else { ollama };
            let reply = streamed(model.as_ref()).await;
            assert!(
                matches!(reply, Err(ModelError::Malformed(_))),
                "{provider}, streamed, {shape}: {reply:?}"
            );
        }
    }
}

#[tokio::test]
async fn minimal_well_formed_replies_are_still_answers() {
    let openai =
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]});
    let ollama = json!({"message": {"role": "assistant", "content": "ok"}, "done": true});
    for (body, provider) in [(openai, "openai"), (ollama, "ollama")] {
        let server = serve(body.to_string(), "application/json").await;
        let [(_, o), (_, l)] = models(&server.uri());
        let model = if provider == "openai" { o } else { l };
        let reply = model
            .chat(&[Message::user("hi")], &[], &ChatOptions::new())
            .await;
        assert_eq!(
            reply.map(|r| r.text().into_owned()).ok().as_deref(),
            Some("ok"),
            "{provider}"
        );
    }
    // Streams: a usage-only last chunk (OpenAI) and a done line without a message
    // (Ollama-compatible servers) are fine.
    let sse = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\n\
               data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n\
               data: [DONE]\n\n";
    let ndjson = "{\"message\":{\"role\":\"assistant\",\"content\":\"ok\"},\"done\":false}\n\
                  {\"done\":true,\"eval_count\":1}\n";
    for (body, provider) in [(sse, "openai"), (ndjson, "ollama")] {
        let server = serve(body.to_owned(), "text/event-stream").await;
        let [(_, o), (_, l)] = models(&server.uri());
        let model = if provider == "openai" { o } else { l };
        let reply = streamed(model.as_ref()).await;
        assert_eq!(
            reply.map(|r| r.text().into_owned()).ok().as_deref(),
            Some("ok"),
            "{provider}"
        );
    }
}
