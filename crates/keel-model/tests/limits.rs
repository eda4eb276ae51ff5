//! Every input from a server is bounded, for both providers: body size, error bodies,
//! stream lines and events, the streamed answer, and the whole stream's duration.
//! (tests/memory.rs checks the heap with the default limits.)

mod common;

use std::time::Duration;

use common::{
    Step, chunk, chunk_bytes, chunked_head, chunked_status_head, fast_http, json_response,
    raw_server,
};
use keel_message::Message;
use keel_model::{
    ChatModel, ChatOptions, HttpConfig, ModelError, OllamaConfig, OllamaModel, OpenAiConfig,
    OpenAiModel, collect_stream,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Provider {
    OpenAi,
    Ollama,
}

const BOTH: [Provider; 2] = [Provider::OpenAi, Provider::Ollama];

#[allow(clippy::unwrap_used)]
fn model(provider: Provider, base: &str, http: HttpConfig) -> Box<dyn ChatModel> {
    match provider {
        Provider::OpenAi => {
            Box::new(OpenAiModel::new(OpenAiConfig::new("m").base_url(base).http(http)).unwrap())
        }
        Provider::Ollama => {
            Box::new(OllamaModel::new(OllamaConfig::new("m").base_url(base).http(http)).unwrap())
        }
    }
}

/// One streamed text fragment in the provider's framing.
fn event(provider: Provider, text: &str) -> String {
    match provider {
        Provider::OpenAi => {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
            )
        }
        Provider::Ollama => format!(
            "{{\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"done\":false}}\n"
        ),
    }
}

async fn chat(model: &dyn ChatModel) -> Result<keel_model::ChatResponse, ModelError> {
    model
        .chat(&[Message::user("hi")], &[], &ChatOptions::new())
        .await
}

async fn stream(model: &dyn ChatModel) -> Result<keel_model::ChatResponse, ModelError> {
    let stream = model
        .chat_stream(&[Message::user("hi")], &[], &ChatOptions::new())
        .await?;
    collect_stream(stream).await
}

#[tokio::test]
async fn a_body_over_the_limit_is_body_too_large_with_or_without_a_length() {
    let big = format!("{{\"pad\":\"{}\"}}", "p".repeat(2_000));
    let framed = raw_server({
        let big = big.clone();
        move |_| vec![json_response(200, &big)]
    })
    .await;
    let chunked = raw_server(move |_| {
        vec![
            chunked_head("application/json"),
            chunk(&big[..1_000]),
            chunk(&big[1_000..]),
            chunk(""),
        ]
    })
    .await;
    for provider in BOTH {
        for server in [&framed, &chunked] {
            let m = model(provider, &server.url(), fast_http().max_body_bytes(1_024));
            let err = chat(m.as_ref()).await;
            assert!(
                matches!(err, Err(ModelError::BodyTooLarge { limit: 1_024 })),
                "{provider:?}: {err:?}"
            );
            assert!(err.is_err_and(|e| !e.is_retryable()));
        }
    }
}

#[tokio::test]
async fn an_error_body_is_classified_from_its_first_64_kib_without_waiting_for_the_rest() {
    // A 503 whose body goes on past 64 KiB and then never ends: the status is known
    // from the prefix; reading the whole body would wait until the request timeout.
    let server = raw_server(|_| {
        let mut head = chunked_status_head(503, "text/plain");
        if let Step::Write(bytes) = &mut head {
            bytes.extend(chunk_bytes(&"upstream overloaded ".repeat(4_000)));
        }
        vec![head, Step::Hang]
    })
    .await;
    for provider in BOTH {
        let http = fast_http()
            .request_timeout(Duration::from_secs(30))
            .retry(keel_model::RetryPolicy::none());
        let err = chat(model(provider, &server.url(), http).as_ref()).await;
        match err {
            Err(ModelError::Api {
                status: 503,
                message,
                ..
            }) => assert!(message.starts_with("upstream overloaded"), "{message}"),
            other => panic!("{provider:?}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_stream_line_over_the_limit_is_line_too_long() {
    let server = raw_server(|_| {
        vec![
            chunked_head("application/x-ndjson"),
            chunk(&"z".repeat(3_000)),
            Step::Hang,
        ]
    })
    .await;
    for provider in BOTH {
        let http = fast_http()
            .max_line_bytes(1_024)
            .stream_idle_timeout(Duration::from_secs(30));
        let err = stream(model(provider, &server.url(), http).as_ref()).await;
        assert!(
            matches!(err, Err(ModelError::LineTooLong { limit: 1_024 })),
            "{provider:?}: {err:?}"
        );
    }
}

#[tokio::test]
async fn a_server_sent_event_over_the_limit_is_line_too_long() {
    // Short `data:` lines that never end the event add up like one long line.
    let server = raw_server(|_| {
        let mut steps = vec![chunked_head("text/event-stream")];
        steps.extend((0..100).map(|_| chunk("data: {\"choices\":[]}\n")));
        steps.push(Step::Hang);
        steps
    })
    .await;
    let http = fast_http()
        .max_line_bytes(1_024)
        .stream_idle_timeout(Duration::from_secs(30));
    let err = stream(model(Provider::OpenAi, &server.url(), http).as_ref()).await;
    assert!(
        matches!(err, Err(ModelError::LineTooLong { limit: 1_024 })),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_streamed_answer_over_the_limit_is_answer_too_large() {
    for provider in BOTH {
        let server = raw_server(move |_| {
            let mut steps = vec![chunked_head("text/event-stream")];
            steps.extend((0..100).map(|_| chunk(&event(provider, &"a".repeat(100)))));
            steps.push(Step::Hang);
            steps
        })
        .await;
        let http = fast_http()
            .max_answer_bytes(4_096)
            .stream_idle_timeout(Duration::from_secs(30));
        let err = stream(model(provider, &server.url(), http).as_ref()).await;
        assert!(
            matches!(err, Err(ModelError::AnswerTooLarge { limit: 4_096 })),
            "{provider:?}: {err:?}"
        );
    }
}

#[tokio::test]
async fn a_stream_that_trickles_on_ends_at_the_stream_timeout() {
    // One event every 50 ms for 30 s: never idle, never done.
    for provider in BOTH {
        let server = raw_server(move |_| {
            let mut steps = vec![chunked_head("text/event-stream")];
            for _ in 0..600 {
                steps.push(chunk(&event(provider, "tick ")));
                steps.push(Step::Sleep(Duration::from_millis(50)));
            }
            steps
        })
        .await;
        let http = fast_http()
            .stream_timeout(Duration::from_millis(500))
            .stream_idle_timeout(Duration::from_secs(10));
        let err = stream(model(provider, &server.url(), http).as_ref()).await;
        assert!(
            matches!(err, Err(ModelError::Timeout(d)) if d == Duration::from_millis(500)),
            "{provider:?}: {err:?}"
        );
    }
}

#[tokio::test]
async fn a_stream_that_never_pauses_still_ends_at_the_stream_timeout() {
    // Keep-alive comments (SSE) or blank lines (NDJSON) as fast as the socket takes
    // them: there is always data ready, and none of it is an answer.
    for provider in BOTH {
        let filler = match provider {
            Provider::OpenAi => ": keep-alive\n",
            Provider::Ollama => "\n",
        };
        let frame = chunk_bytes(&filler.repeat(256));
        let server = raw_server(move |_| {
            vec![
                chunked_head("text/event-stream"),
                Step::Repeat(frame.clone(), usize::MAX),
            ]
        })
        .await;
        let http = fast_http()
            .stream_timeout(Duration::from_millis(500))
            .stream_idle_timeout(Duration::from_secs(10));
        let err = stream(model(provider, &server.url(), http).as_ref()).await;
        assert!(
            matches!(err, Err(ModelError::Timeout(d)) if d == Duration::from_millis(500)),
            "{provider:?}: {err:?}"
        );
    }
}

/// A base URL no request could reach is refused when the client is built, with a
/// `Config` error (not retried as a connection failure at every call).
#[test]
fn a_base_url_that_is_not_an_http_url_is_refused_when_built() {
    for bad in [
        "not a url",
        "ftp://example.com/v1",
        "http://exa mple.com/v1",
        "localhost:8080",
        "",
    ] {
        let openai = OpenAiModel::new(OpenAiConfig::new("m").base_url(bad));
        assert!(
            matches!(&openai, Err(ModelError::Config(why)) if why.contains("base URL")),
            "{bad:?}: {:?}",
            openai.err()
        );
        let ollama = OllamaModel::new(OllamaConfig::new("m").base_url(bad));
        assert!(
            matches!(&ollama, Err(ModelError::Config(_))),
            "{bad:?}: {:?}",
            ollama.err()
        );
    }
    for good in [
        "http://localhost:11434",
        "https://api.example.com/v1/",
        " http://127.0.0.1:8080/v1 ",
    ] {
        assert!(
            OpenAiModel::new(OpenAiConfig::new("m").base_url(good)).is_ok(),
            "{good}"
        );
        assert!(
            OllamaModel::new(OllamaConfig::new("m").base_url(good)).is_ok(),
            "{good}"
        );
    }
}
