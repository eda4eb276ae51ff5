//! The Ollama provider against local servers speaking `/api/chat`.

mod common;

use common::{chunk, chunked_head, fast_http, raw_server};
use futures::StreamExt;
use keel_message::{ContentPart, Message, ToolCall, ToolSpec};
use keel_model::{
    ChatEvent, ChatModel, ChatOptions, FinishReason, KeepAlive, ModelError, OllamaConfig,
    OllamaModel, ResponseFormat, Usage, collect_stream,
};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

#[allow(clippy::unwrap_used)]
fn model_at(base: &str) -> OllamaModel {
    OllamaModel::new(
        OllamaConfig::new("llama3.1:8b")
            .base_url(base)
            .http(fast_http()),
    )
    .unwrap()
}

fn history() -> Vec<Message> {
    vec![
        Message::system("Be brief."),
        Message::user(vec![
            ContentPart::text("What is in this picture, and the weather in Toronto?"),
            ContentPart::Image {
                url: "data:image/png;base64,iVBORw0KGgo=".into(),
                detail: None,
            },
        ]),
        Message::assistant("").with_tool_calls(vec![ToolCall::new(
            "call_7",
            "get_current_weather",
            json!({"city": "Toronto"}),
        )]),
        Message::tool("call_7", "11 degrees celsius"),
    ]
}

fn weather_tool() -> ToolSpec {
    ToolSpec::new(
        "get_current_weather",
        "Get the current weather for a city",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    )
}

fn done_reply() -> Value {
    json!({
        "model": "llama3.1:8b",
        "created_at": "2025-07-07T20:22:19.184789Z",
        "message": {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_current_weather", "arguments": {"city": "Paris"}}}]
        },
        "done_reason": "stop",
        "done": true,
        "total_duration": 3_244_883_583_u64,
        "load_duration": 2_969_184_542_u64,
        "prompt_eval_count": 169,
        "prompt_eval_duration": 141_656_333,
        "eval_count": 18,
        "eval_duration": 133_293_625
    })
}

#[tokio::test]
async fn non_streamed_call_sends_ollama_shapes_and_reads_tool_calls_and_counts() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/api/chat"))
        .respond_with(ResponseTemplate::new(200).set_body_json(done_reply()))
        .expect(1)
        .mount(&server)
        .await;
    let options = ChatOptions::new()
        .temperature(0.0)
        .max_tokens(128)
        .seed(3)
        .format(ResponseFormat::JsonSchema {
            name: "w".into(),
            schema: json!({"type": "object"}),
        });
    let model = OllamaModel::new(
        OllamaConfig::new("llama3.1:8b")
            .base_url(server.uri())
            .http(fast_http())
            .num_ctx(8192)
            .keep_alive(KeepAlive::For(std::time::Duration::from_secs(300))),
    )
    .unwrap();
    let reply = model
        .chat(&history(), &[weather_tool()], &options)
        .await
        .unwrap();
    assert_eq!(reply.usage, Some(Usage::new(169, 18)));
    assert_eq!(reply.finish_reason, Some(FinishReason::Stop));
    assert_eq!(reply.model, "llama3.1:8b");
    let call = &reply.message.tool_calls[0];
    assert_eq!(call.name, "get_current_weather");
    assert_eq!(call.arguments.as_json(), Some(&json!({"city": "Paris"})));
    assert!(
        call.id.starts_with("call_"),
        "Ollama sends no id; one is made: {}",
        call.id
    );

    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(
        sent,
        json!({
            "model": "llama3.1:8b",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is in this picture, and the weather in Toronto?", "images": ["iVBORw0KGgo="]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_7", "function": {"name": "get_current_weather", "arguments": {"city": "Toronto"}}}
                ]},
                {"role": "tool", "content": "11 degrees celsius", "tool_name": "get_current_weather", "tool_call_id": "call_7"}
            ],
            "tools": [{"type": "function", "function": {
                "name": "get_current_weather", "description": "Get the current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            }}],
            "stream": false,
            "format": {"type": "object"},
            "options": {"temperature": 0.0, "num_ctx": 8192, "num_predict": 128, "seed": 3},
            "keep_alive": 300
        })
    );
}

fn ndjson(lines: &[Value]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

fn partial(text: &str) -> Value {
    json!({"model": "llama3.1:8b", "created_at": "2025-07-07T20:22:19Z", "message": {"role": "assistant", "content": text}, "done": false})
}

#[tokio::test]
async fn streamed_call_reads_ndjson_deltas_and_the_done_line() {
    let mut last = partial("");
    last["done"] = json!(true);
    last["done_reason"] = json!("length");
    last["prompt_eval_count"] = json!(26);
    last["eval_count"] = json!(3);
    let body = ndjson(&[
        partial("The"),
        partial(" sky"),
        json!({"model": "llama3.1:8b", "created_at": "t", "message": {"role": "assistant", "content": "",
               "tool_calls": [{"id": "call_x", "function": {"name": "get_current_weather", "arguments": {"city": "Oslo"}}}]}, "done": false}),
        last,
    ]);
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/api/chat"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "application/x-ndjson"))
        .mount(&server)
        .await;
    let mut stream = model_at(&server.uri())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.unwrap());
    }
    assert_eq!(events[0], ChatEvent::Text("The".into()));
    assert_eq!(events[1], ChatEvent::Text(" sky".into()));
    assert!(matches!(&events[2], ChatEvent::ToolCall(d) if d.id.as_deref() == Some("call_x")));
    let ChatEvent::Done(reply) = &events[3] else {
        panic!("{:?}", events[3])
    };
    assert_eq!(reply.text(), "The sky");
    assert_eq!(reply.usage, Some(Usage::new(26, 3)));
    assert_eq!(reply.finish_reason, Some(FinishReason::Length));
    assert_eq!(reply.message.tool_calls[0].id, "call_x");
    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(sent["stream"], true);
}

#[tokio::test]
async fn context_overflow_reply_is_a_distinct_error() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(400)
                .set_body_json(json!({"error": "the input length exceeds the context length"})),
        )
        .mount(&server)
        .await;
    let model = model_at(&server.uri());
    let err = model
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(err.is_context_overflow(), "{err:?}");
    let err = model
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .err()
        .unwrap();
    assert!(err.is_context_overflow(), "{err:?}");
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

#[tokio::test]
async fn error_line_inside_a_stream_is_reported() {
    let body = ndjson(&[
        partial("Hi"),
        json!({"error": "model runner has unexpectedly stopped"}),
    ]);
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "application/x-ndjson"))
        .mount(&server)
        .await;
    let items: Vec<_> = model_at(&server.uri())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(items[0].as_ref().ok(), Some(&ChatEvent::Text("Hi".into())));
    assert!(
        matches!(&items[1], Err(ModelError::StreamInterrupted(m)) if m.contains("unexpectedly stopped")),
        "{:?}",
        items[1]
    );
}

#[tokio::test]
async fn model_not_found_is_a_typed_api_error() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(404).set_body_json(
            json!({"error": "model \"llama3.1:8b\" not found, try pulling it first"}),
        ))
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Api { status: 404, message, .. } if message.contains("try pulling")),
        "{err:?}"
    );
}

#[tokio::test]
async fn rate_limit_is_retried_after_the_wait() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "0")
                .set_body_json(json!({"error": "too many requests"})),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(done_reply()))
        .with_priority(2)
        .mount(&server)
        .await;
    let reply = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    assert_eq!(reply.usage, Some(Usage::new(169, 18)));
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
    assert_eq!(reply.retries, 1);
}

#[tokio::test]
async fn malformed_ndjson_line_is_a_malformed_error() {
    let body = format!(
        "{}{{\"model\": \"x\", \"message\": \n",
        ndjson(&[partial("ok")])
    );
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "application/x-ndjson"))
        .mount(&server)
        .await;
    let items: Vec<_> = model_at(&server.uri())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(items.len(), 2);
    assert!(matches!(items[1], Err(ModelError::Malformed(_))));

    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200).set_body_raw("<html>proxy error</html>", "text/html"),
        )
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(matches!(err, ModelError::Malformed(_)), "{err:?}");
}

#[tokio::test]
async fn connection_dropped_mid_stream_is_stream_interrupted() {
    let first = partial("Once upon").to_string();
    let server = raw_server(move |_| {
        vec![
            chunked_head("application/x-ndjson"),
            chunk(&format!("{first}\n")),
            // Half a line, then the connection closes.
            chunk("{\"model\": \"llama3.1:8b\", \"mess"),
        ]
    })
    .await;
    let items: Vec<_> = model_at(&server.url())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap()
        .collect()
        .await;
    assert_eq!(
        items[0].as_ref().ok(),
        Some(&ChatEvent::Text("Once upon".into()))
    );
    assert!(
        matches!(items.last(), Some(Err(ModelError::StreamInterrupted(_)))),
        "{items:?}"
    );
    assert_eq!(items.len(), 2);
}

#[tokio::test]
async fn stream_closing_cleanly_without_done_is_interrupted_too() {
    let body = ndjson(&[partial("partial answer")]);
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "application/x-ndjson"))
        .mount(&server)
        .await;
    let err = collect_stream(
        model_at(&server.uri())
            .chat_stream(&history(), &[], &ChatOptions::new())
            .await
            .unwrap(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ModelError::StreamInterrupted(_)), "{err:?}");
}

#[tokio::test]
async fn list_models_reads_tags() {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/tags"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"models": [
            {"name": "llama3.1:8b", "model": "llama3.1:8b", "modified_at": "2025-05-04T17:37:44Z", "size": 4_920_753_328_u64,
             "digest": "abc", "details": {"format": "gguf", "family": "llama", "parameter_size": "8.0B", "quantization_level": "Q4_K_M"}}
        ]})))
        .mount(&server)
        .await;
    assert_eq!(
        model_at(&server.uri()).list_models().await.unwrap(),
        ["llama3.1:8b"]
    );
}

#[tokio::test]
async fn arguments_that_are_not_an_object_are_wrapped() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(done_reply()))
        .mount(&server)
        .await;
    let msgs = [Message::assistant("")
        .with_tool_calls(vec![ToolCall::from_raw_arguments("c1", "sh", "{broken")])];
    model_at(&server.uri())
        .chat(&msgs, &[], &ChatOptions::new())
        .await
        .unwrap();
    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(
        sent["messages"][0]["tool_calls"][0]["function"]["arguments"],
        json!({"arguments": "{broken"})
    );
}

#[tokio::test]
async fn cached_prompt_tokens_are_reported_when_ollama_sends_them() {
    // Newer Ollama servers count the prompt tokens read from the KV cache in
    // `prompt_eval_cached_count` (included in `prompt_eval_count`); older ones send
    // nothing comparable, and the count stays unknown.
    let mut cached = done_reply();
    cached["prompt_eval_cached_count"] = json!(150);
    let mut last = partial("");
    last["done"] = json!(true);
    last["prompt_eval_count"] = json!(40);
    last["prompt_eval_cached_count"] = json!(32);
    last["eval_count"] = json!(5);
    let streamed = ndjson(&[partial("ok"), last]);
    for (body, expected) in [
        (cached.to_string(), Some(150)),
        (done_reply().to_string(), None),
    ] {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(200).set_body_raw(body, "application/json"))
            .mount(&server)
            .await;
        let reply = model_at(&server.uri())
            .chat(&history(), &[], &ChatOptions::new())
            .await
            .unwrap();
        let usage = reply.usage.unwrap();
        assert_eq!((usage.prompt_tokens, usage.cached_tokens), (169, expected));
    }
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(streamed, "application/x-ndjson"))
        .mount(&server)
        .await;
    let reply = collect_stream(
        model_at(&server.uri())
            .chat_stream(&history(), &[], &ChatOptions::new())
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(reply.usage, Some(Usage::new(40, 5).with_cached_tokens(32)));
}
