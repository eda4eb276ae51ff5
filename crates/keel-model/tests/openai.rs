//! The OpenAI-compatible provider against local servers speaking `/v1/chat/completions`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Step, chunk, chunked_head, fast_http, json_response, raw_server};
use futures::StreamExt;
use keel_message::{Message, ToolCall, ToolSpec};
use keel_model::{
    ChatEvent, ChatModel, ChatOptions, FinishReason, HttpConfig, ModelError, OpenAiConfig,
    OpenAiModel, ResponseFormat, RetryPolicy, ToolCallDelta, Usage, collect_stream,
};
use serde_json::{Value, json};
use wiremock::matchers::{header, method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const CHAT: &str = "/v1/chat/completions";

#[allow(clippy::unwrap_used)]
fn model_at(base: &str) -> OpenAiModel {
    OpenAiModel::new(
        OpenAiConfig::new("gpt-4o-mini")
            .base_url(format!("{base}/v1"))
            .api_key("sk-test")
            .http(fast_http()),
    )
    .unwrap()
}

fn history() -> Vec<Message> {
    vec![
        Message::system("You are terse."),
        Message::user("Weather in Paris?"),
        Message::assistant("").with_tool_calls(vec![ToolCall::from_raw_arguments(
            "call_1",
            "get_weather",
            r#"{"city": "Paris"}"#,
        )]),
        Message::tool("call_1", "18°C"),
    ]
}

fn weather_tool() -> ToolSpec {
    ToolSpec::new(
        "get_weather",
        "Current weather.",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    )
}

/// A real-shaped non-streamed reply that asks for a tool call.
fn tool_call_reply() -> Value {
    json!({
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "created": 1_741_569_952,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": null,
                "tool_calls": [{
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}
                }],
                "refusal": null,
                "annotations": []
            },
            "logprobs": null,
            "finish_reason": "tool_calls"
        }],
        "usage": {
            "prompt_tokens": 82,
            "completion_tokens": 17,
            "total_tokens": 99,
            "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0}
        },
        "service_tier": "default",
        "system_fingerprint": "fp_06737a9306"
    })
}

#[tokio::test]
async fn non_streamed_call_sends_the_real_request_shape_and_reads_tool_calls_and_usage() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(CHAT))
        .and(header("authorization", "Bearer sk-test"))
        .respond_with(ResponseTemplate::new(200).set_body_json(tool_call_reply()))
        .expect(1)
        .mount(&server)
        .await;
    let model = model_at(&server.uri());
    let options = ChatOptions::new()
        .temperature(0.0)
        .max_tokens(64)
        .stop("END")
        .seed(7)
        .format(ResponseFormat::Json);
    let reply = model
        .chat(&history(), &[weather_tool()], &options)
        .await
        .unwrap();

    assert_eq!(reply.model, "gpt-4o-mini-2024-07-18");
    assert_eq!(reply.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(reply.usage, Some(Usage::new(82, 17).with_cached_tokens(64)));
    assert_eq!(reply.text(), "");
    let call = &reply.message.tool_calls[0];
    assert_eq!(
        (call.id.as_str(), call.name.as_str()),
        ("call_9", "get_weather")
    );
    assert_eq!(call.arguments.as_json(), Some(&json!({"city": "Oslo"})));
    assert!(
        reply.message.metadata.is_empty(),
        "reply-only fields are not kept"
    );

    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(
        sent,
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                // `""`, not `null`: llama-cpp-python and SGLang refuse `null`.
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
                }]},
                {"role": "tool", "content": "18°C", "tool_call_id": "call_1"}
            ],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            }}],
            // Said outright: llama-cpp-python takes a missing tool_choice as "none".
            "tool_choice": "auto",
            "temperature": 0.0,
            "max_tokens": 64,
            "stop": ["END"],
            "seed": 7,
            "response_format": {"type": "json_object"},
            "stream": false
        })
    );
}

fn sse(chunks: &[Value]) -> String {
    let mut body = String::new();
    for c in chunks {
        body.push_str(&format!("data: {c}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    body
}

fn chunk_with(delta: Value, finish: Value) -> Value {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_1",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
    })
}

#[tokio::test]
async fn streamed_call_yields_text_and_tool_call_fragments_then_the_assembled_reply() {
    let body = sse(&[
        chunk_with(
            json!({"role": "assistant", "content": "", "refusal": null}),
            Value::Null,
        ),
        chunk_with(json!({"content": "Let me "}), Value::Null),
        chunk_with(json!({"content": "check."}), Value::Null),
        chunk_with(
            json!({"tool_calls": [{"index": 0, "id": "call_A", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        chunk_with(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]}),
            Value::Null,
        ),
        chunk_with(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "ty\":\"Rome\"}"}}]}),
            Value::Null,
        ),
        chunk_with(
            json!({"tool_calls": [{"index": 1, "id": "call_B", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}),
            Value::Null,
        ),
        chunk_with(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini-2024-07-18",
               "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}}),
    ]);
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(CHAT))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
        .mount(&server)
        .await;
    let model = model_at(&server.uri());
    let mut stream = model
        .chat_stream(&history(), &[weather_tool()], &ChatOptions::new())
        .await
        .unwrap();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.unwrap());
    }
    assert_eq!(events[0], ChatEvent::Text("Let me ".into()));
    assert_eq!(events[1], ChatEvent::Text("check.".into()));
    assert_eq!(
        events[2],
        ChatEvent::ToolCall(ToolCallDelta {
            index: 0,
            id: Some("call_A".into()),
            name: Some("get_weather".into()),
            arguments: String::new()
        })
    );
    assert_eq!(events.len(), 7);
    let ChatEvent::Done(reply) = &events[6] else {
        panic!("last event is {:?}", events[6])
    };
    assert_eq!(reply.text(), "Let me check.");
    assert_eq!(reply.usage, Some(Usage::new(40, 12)));
    assert_eq!(reply.finish_reason, Some(FinishReason::ToolCalls));
    let calls = &reply.message.tool_calls;
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].id, "call_A");
    assert_eq!(calls[0].arguments.as_json(), Some(&json!({"city": "Rome"})));
    assert_eq!(calls[1].name, "get_time");

    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(sent["stream"], true);
    assert_eq!(sent["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn sse_comments_crlf_and_multiline_data_are_handled() {
    // CRLF line endings, a keep-alive comment, and one event split over two data lines.
    let body = ": keep-alive\r\n\r\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}],\r\ndata: \"model\":\"m\"}\r\n\r\ndata: [DONE]\r\n\r\n";
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
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
    assert_eq!(reply.text(), "a");
    assert_eq!(reply.model, "m");
    assert_eq!(
        reply.usage, None,
        "no usage chunk: none reported, none invented"
    );
}

#[tokio::test]
async fn rate_limit_with_retry_after_is_waited_out_then_succeeds() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "1")
                .set_body_json(json!({"error": {"message": "Rate limit reached for gpt-4o-mini", "type": "requests", "param": null, "code": "rate_limit_exceeded"}})),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(tool_call_reply()))
        .with_priority(2)
        .mount(&server)
        .await;
    let reply = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    assert_eq!(reply.usage, Some(Usage::new(82, 17).with_cached_tokens(64)));
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
    // The reply says it came after one retried attempt.
    assert_eq!(reply.retries, 1);
}

#[tokio::test]
async fn a_stream_opened_after_a_retry_says_so_in_its_reply() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "0")
                .set_body_json(json!({"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}})),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&server)
        .await;
    let body = sse(&[chunk_with(json!({"content": "Hi."}), json!("stop"))]);
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
        .with_priority(2)
        .mount(&server)
        .await;
    let mut stream = model_at(&server.uri())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    let mut done = None;
    while let Some(e) = stream.next().await {
        if let ChatEvent::Done(reply) = e.unwrap() {
            done = Some(reply);
        }
    }
    let reply = done.unwrap();
    assert_eq!(reply.text(), "Hi.");
    assert_eq!(reply.retries, 1);
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

#[tokio::test]
async fn retry_after_longer_than_allowed_fails_at_once_with_the_wait() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "3600")
                .set_body_json(json!({"error": {"message": "Too many requests", "type": "requests", "code": "rate_limit_exceeded"}})),
        )
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    match err {
        ModelError::RateLimited {
            retry_after,
            message,
        } => {
            assert_eq!(retry_after, Some(Duration::from_secs(3600)));
            assert_eq!(message, "Too many requests");
        }
        other => panic!("expected RateLimited, got {other:?}"),
    }
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn absurd_retry_after_values_never_panic() {
    // Too large for a Duration: taken as a year, longer than any client waits, so the
    // call ends at once with the wait. Negative, NaN or infinite: ignored, backoff used.
    let cases = [
        (
            "retry-after-ms",
            "1e300",
            Some(Duration::from_secs(365 * 24 * 3600)),
        ),
        (
            "retry-after",
            "1e30",
            Some(Duration::from_secs(365 * 24 * 3600)),
        ),
        ("retry-after", "-5", None),
        ("retry-after-ms", "NaN", None),
        ("retry-after", "inf", None),
    ];
    for (name, value, expected) in cases {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(
                ResponseTemplate::new(429)
                    .insert_header(name, value)
                    .set_body_json(json!({"error": {"message": "slow down"}})),
            )
            .mount(&server)
            .await;
        let err = model_at(&server.uri())
            .chat(&history(), &[], &ChatOptions::new())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ModelError::RateLimited { retry_after, .. } if *retry_after == expected),
            "{name}: {value}: {err:?}"
        );
        // Ignored values fall back to backoff: the retries were made.
        let attempts = server.received_requests().await.unwrap().len();
        assert_eq!(
            attempts,
            if expected.is_some() { 1 } else { 3 },
            "{name}: {value}"
        );
    }
}

#[tokio::test]
async fn insufficient_quota_429_is_not_retried() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(429).set_body_json(json!({"error": {
            "message": "You exceeded your current quota", "type": "insufficient_quota", "param": null, "code": "insufficient_quota"}})))
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Api { status: 429, ref code, .. } if code.as_deref() == Some("insufficient_quota")),
        "{err:?}"
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn server_errors_are_retried_with_backoff() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(503).set_body_string("upstream overloaded"))
        .up_to_n_times(2)
        .with_priority(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(tool_call_reply()))
        .with_priority(2)
        .mount(&server)
        .await;
    let reply = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    assert_eq!(reply.message.tool_calls.len(), 1);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
}

#[tokio::test]
async fn persistent_server_errors_give_up_after_the_retries() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500).set_body_json(
            json!({"error": {"message": "The server had an error", "type": "server_error"}}),
        ))
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Api { status: 500, ref message, .. } if message == "The server had an error"),
        "{err:?}"
    );
    // The first attempt and the two retries of `fast_http`.
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
}

#[tokio::test]
async fn context_length_exceeded_is_a_distinct_error_and_not_retried() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(400).set_body_json(json!({"error": {
            "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130415 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})))
        .mount(&server)
        .await;
    let model = model_at(&server.uri());
    let err = model
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(err.is_context_overflow(), "{err:?}");
    assert!(err.to_string().contains("130415 tokens"));
    // Streaming reports it before the stream starts.
    let err = model
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .err()
        .unwrap();
    assert!(err.is_context_overflow(), "{err:?}");
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

#[tokio::test]
async fn llama_cpp_and_vllm_overflow_bodies_are_context_overflow_too() {
    for body in [
        // llama.cpp's server
        json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}}),
        // vLLM (FastAPI-style error object)
        json!({"object": "error", "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion).", "type": "BadRequestError", "param": null, "code": 400}),
    ] {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(400).set_body_json(body))
            .mount(&server)
            .await;
        let err = model_at(&server.uri())
            .chat(&history(), &[], &ChatOptions::new())
            .await
            .unwrap_err();
        assert!(err.is_context_overflow(), "{err:?}");
    }
}

#[tokio::test]
async fn other_client_errors_are_typed_and_not_retried() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(401).set_body_json(json!({"error": {
            "message": "Incorrect API key provided", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}})))
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Api { status: 401, code, .. } if code.as_deref() == Some("invalid_api_key")),
        "{err:?}"
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn malformed_json_reply_is_a_malformed_error() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_raw("{\"choices\": [{\"message\": ", "application/json"),
        )
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(matches!(err, ModelError::Malformed(_)), "{err:?}");

    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"object": "chat.completion", "choices": []})),
        )
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::Malformed(m) if m.contains("no choices")),
        "{err:?}"
    );
}

#[tokio::test]
async fn malformed_sse_chunk_ends_the_stream_with_an_error() {
    let body = format!(
        "data: {}\n\ndata: {{\"choices\": [\n\ndata: [DONE]\n\n",
        chunk_with(json!({"content": "ok"}), Value::Null)
    );
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
        .mount(&server)
        .await;
    let stream = model_at(&server.uri())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    let items: Vec<_> = stream.collect().await;
    assert_eq!(items.len(), 2);
    assert_eq!(items[0].as_ref().ok(), Some(&ChatEvent::Text("ok".into())));
    assert!(matches!(items[1], Err(ModelError::Malformed(_))));
}

#[tokio::test]
async fn error_event_inside_a_stream_is_reported() {
    let body = "data: {\"error\": {\"message\": \"The server had an error while processing your request.\", \"type\": \"server_error\"}}\n\n";
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
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
    assert!(
        matches!(&err, ModelError::StreamInterrupted(m) if m.contains("while processing")),
        "{err:?}"
    );
}

#[tokio::test]
async fn an_error_object_in_a_plain_200_reply_says_the_server_answered_with_it() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"error": {"message": "quota exceeded"}})),
        )
        .mount(&server)
        .await;
    let err = model_at(&server.uri())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("the server answered with an error: quota exceeded")
            && !text.contains("stream"),
        "{text}"
    );
}

#[tokio::test]
async fn connection_dropped_mid_stream_is_stream_interrupted_after_the_deltas_so_far() {
    let first = chunk_with(json!({"content": "Hel"}), Value::Null);
    let second = chunk_with(json!({"content": "lo"}), Value::Null);
    let server = raw_server(move |_| {
        vec![
            chunked_head("text/event-stream"),
            chunk(&format!("data: {first}\n\n")),
            chunk(&format!("data: {second}\n\n")),
            // No terminating chunk, no [DONE]: the connection just closes.
        ]
    })
    .await;
    let stream = model_at(&server.url())
        .chat_stream(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    let items: Vec<_> = stream.collect().await;
    assert_eq!(items.len(), 3, "{items:?}");
    assert_eq!(items[0].as_ref().ok(), Some(&ChatEvent::Text("Hel".into())));
    assert_eq!(items[1].as_ref().ok(), Some(&ChatEvent::Text("lo".into())));
    assert!(
        matches!(items[2], Err(ModelError::StreamInterrupted(_))),
        "{:?}",
        items[2]
    );
}

#[tokio::test]
async fn non_streamed_reply_cut_off_mid_body_is_retried_on_a_new_connection() {
    let full = tool_call_reply().to_string();
    let cut = full[..full.len() / 2].to_owned();
    let server = raw_server(move |n| {
        if n == 0 {
            vec![Step::Write(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{cut}",
                    full.len()
                )
                .into_bytes(),
            )]
        } else {
            vec![json_response(200, &full)]
        }
    })
    .await;
    let reply = model_at(&server.url())
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    assert_eq!(reply.message.tool_calls[0].name, "get_weather");
    assert_eq!(
        server.connections.load(std::sync::atomic::Ordering::SeqCst),
        2
    );
}

#[tokio::test]
async fn unreachable_server_is_a_connection_error_after_retries() {
    // Bind and drop a listener: nothing listens on that port any more.
    let addr = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let err = model_at(&format!("http://{addr}"))
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap_err();
    assert!(matches!(err, ModelError::Connection(_)), "{err:?}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let server = raw_server(|_| vec![Step::Hang]).await;
    let err = model_at(&server.url())
        .chat(
            &history(),
            &[],
            &ChatOptions::new().timeout(Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, ModelError::Timeout(d) if d == Duration::from_millis(200)),
        "{err:?}"
    );
}

#[tokio::test]
async fn concurrency_limit_bounds_requests_in_flight() {
    let reply = tool_call_reply().to_string();
    let server = raw_server(move |_| {
        vec![
            Step::Sleep(Duration::from_millis(30)),
            json_response(200, &reply),
        ]
    })
    .await;
    let model = Arc::new(
        OpenAiModel::new(
            OpenAiConfig::new("m")
                .base_url(format!("{}/v1", server.url()))
                .http(fast_http().max_concurrency(2)),
        )
        .unwrap(),
    );
    let calls = (0..8).map(|_| {
        let model = model.clone();
        async move { model.chat(&history(), &[], &ChatOptions::new()).await }
    });
    let results = futures::future::join_all(calls).await;
    assert!(results.iter().all(Result::is_ok));
    let max = server
        .max_in_flight
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!((1..=2).contains(&max), "max in flight {max}");
}

#[tokio::test]
async fn a_stuck_client_does_not_block_another_client() {
    // The "summarizer" server never answers; the "agent" server does.
    let stuck = raw_server(|_| vec![Step::Hang]).await;
    let reply = tool_call_reply().to_string();
    let healthy = raw_server(move |_| vec![json_response(200, &reply)]).await;
    let one_slot = HttpConfig::default()
        .max_concurrency(1)
        .retry(RetryPolicy::none());
    let summarizer = Arc::new(
        OpenAiModel::new(
            OpenAiConfig::new("small")
                .base_url(format!("{}/v1", stuck.url()))
                .http(one_slot.clone()),
        )
        .unwrap(),
    );
    let agent = OpenAiModel::new(
        OpenAiConfig::new("big")
            .base_url(format!("{}/v1", healthy.url()))
            .http(one_slot),
    )
    .unwrap();
    let s = summarizer.clone();
    let hung = tokio::spawn(async move { s.chat(&history(), &[], &ChatOptions::new()).await });
    // Let the summarizer call take its only slot.
    while stuck.connections.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let reply = agent
        .chat(&history(), &[], &ChatOptions::new())
        .await
        .unwrap();
    assert_eq!(reply.message.tool_calls.len(), 1);
    assert!(!hung.is_finished());
    hung.abort();
}

#[tokio::test]
async fn list_models_reads_the_models_endpoint() {
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/v1/models"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "object": "list",
            "data": [{"id": "smollm2", "object": "model", "owned_by": "me", "permissions": []}]
        })))
        .mount(&server)
        .await;
    assert_eq!(
        model_at(&server.uri()).list_models().await.unwrap(),
        ["smollm2"]
    );
}

#[tokio::test]
async fn max_completion_tokens_and_extra_fields() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(tool_call_reply()))
        .mount(&server)
        .await;
    let model = OpenAiModel::new(
        OpenAiConfig::new("o3")
            .base_url(format!("{}/v1", server.uri()))
            .max_completion_tokens(true),
    )
    .unwrap();
    model
        .chat(
            &history(),
            &[],
            &ChatOptions::new()
                .max_tokens(100)
                .model("o4-mini")
                .extra("reasoning_effort", json!("low")),
        )
        .await
        .unwrap();
    let sent: Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(sent["max_completion_tokens"], 100);
    assert!(sent.get("max_tokens").is_none());
    assert_eq!(sent["model"], "o4-mini");
    assert_eq!(sent["reasoning_effort"], "low");
}

#[tokio::test]
async fn a_client_of_the_callers_own_sends_its_headers_and_the_api_key() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(CHAT))
        .and(header("authorization", "Bearer sk-test"))
        .and(header("x-trace", "abc"))
        .respond_with(ResponseTemplate::new(200).set_body_json(tool_call_reply()))
        .expect(1)
        .mount(&server)
        .await;
    let mut headers = keel_model::reqwest::header::HeaderMap::new();
    headers.insert("x-trace", "abc".parse().unwrap());
    let client = keel_model::reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap();
    let model = OpenAiModel::with_client(
        OpenAiConfig::new("gpt-4o-mini")
            .base_url(format!("{}/v1", server.uri()))
            .api_key("sk-test")
            .http(fast_http()),
        client,
    )
    .unwrap();
    let reply = model.chat(&history(), &[], &ChatOptions::new()).await;
    assert!(reply.is_ok(), "{reply:?}");
}
