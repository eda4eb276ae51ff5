//! Memory stays bounded whatever a server sends: huge reply bodies (success or error),
//! a stream line that never ends, a stream of valid events that never stops.
//!
//! One test in its own binary: the allocation counter is process-wide, so nothing else
//! may run beside it. Each scenario streams 256 MiB from a local server that writes one
//! small buffer over and over, and checks the client's peak allocation stays far below.

mod common;

use common::{Step, chunk_bytes, chunked_head, raw_server, repeated_chunks, unframed_head};
use futures::StreamExt;
use keel_message::Message;
use keel_model::{
    ChatModel, ChatOptions, HttpConfig, ModelError, OllamaConfig, OllamaModel, OpenAiConfig,
    OpenAiModel, RetryPolicy, collect_stream,
};
use peak_alloc::PeakAlloc;

#[global_allocator]
static PEAK: PeakAlloc = PeakAlloc;

const MIB: usize = 1 << 20;
/// What each server sends: eight times the largest default limit.
const SENT: usize = 256 * MIB;

fn http() -> HttpConfig {
    HttpConfig::default().retry(RetryPolicy::none())
}

#[allow(clippy::unwrap_used)]
fn models(base: &str) -> Vec<(&'static str, Box<dyn ChatModel>)> {
    vec![
        (
            "openai",
            Box::new(OpenAiModel::new(OpenAiConfig::new("m").base_url(base).http(http())).unwrap()),
        ),
        (
            "ollama",
            Box::new(OllamaModel::new(OllamaConfig::new("m").base_url(base).http(http())).unwrap()),
        ),
    ]
}

/// Runs `call` and returns its result and how far the process's allocations grew.
async fn measured<T>(call: impl std::future::Future<Output = T>) -> (T, usize) {
    PEAK.reset_peak_usage();
    let before = PEAK.current_usage();
    let out = call.await;
    let grew = PEAK.peak_usage().saturating_sub(before);
    eprintln!("peak heap growth: {:.1} MiB", grew as f64 / MIB as f64);
    (out, grew)
}

#[tokio::test]
async fn huge_replies_fail_typed_and_memory_stays_bounded() {
    let history = [Message::user("hi")];
    let options = ChatOptions::new();

    // A 200 with a 256 MiB body of unknown length: BodyTooLarge at the 32 MiB default.
    let server = raw_server(|_| {
        vec![
            unframed_head(200, "application/json"),
            Step::Repeat(vec![b' '; 64 * 1024], SENT / (64 * 1024)),
        ]
    })
    .await;
    for (name, model) in models(&server.url()) {
        let (result, grew) = measured(model.chat(&history, &[], &options)).await;
        assert!(
            matches!(result, Err(ModelError::BodyTooLarge { limit }) if limit == 32 * MIB),
            "{name}: {result:?}"
        );
        // The body buffer doubles as it fills, so up to about twice the limit while it
        // grows; the whole 256 MiB would be far more.
        assert!(
            grew < 96 * MIB,
            "{name}: a 200 body grew the heap by {grew} bytes"
        );
    }

    // A 500 with a 256 MiB chunked body: classified from its first 64 KiB.
    let server = raw_server(|_| {
        vec![
            common::chunked_status_head(500, "text/plain"),
            repeated_chunks(b'e', 64 * 1024, SENT / (64 * 1024)),
        ]
    })
    .await;
    for (name, model) in models(&server.url()) {
        let (result, grew) = measured(model.chat(&history, &[], &options)).await;
        assert!(
            matches!(result, Err(ModelError::Api { status: 500, .. })),
            "{name}: {result:?}"
        );
        assert!(
            grew < 8 * MIB,
            "{name}: a 500 body grew the heap by {grew} bytes"
        );
    }

    // A stream whose first line never ends: LineTooLong at the 4 MiB default.
    let server = raw_server(|_| {
        vec![
            chunked_head("text/event-stream"),
            repeated_chunks(b'x', 64 * 1024, SENT / (64 * 1024)),
        ]
    })
    .await;
    for (name, model) in models(&server.url()) {
        let (result, grew) = measured(async {
            collect_stream(model.chat_stream(&history, &[], &options).await?).await
        })
        .await;
        assert!(
            matches!(result, Err(ModelError::LineTooLong { limit }) if limit == 4 * MIB),
            "{name}: {result:?}"
        );
        assert!(
            grew < 24 * MIB,
            "{name}: an endless line grew the heap by {grew} bytes"
        );
    }

    // 256 MiB of valid events: AnswerTooLarge at the 16 MiB default.
    let text = "y".repeat(4096);
    let sse = chunk_bytes(&format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
    ));
    let ndjson = chunk_bytes(&format!(
        "{{\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"done\":false}}\n"
    ));
    for (name, frame) in [("openai", sse), ("ollama", ndjson)] {
        let times = SENT / frame.len();
        let server = raw_server(move |_| {
            vec![
                chunked_head("text/event-stream"),
                Step::Repeat(frame.clone(), times),
            ]
        })
        .await;
        let Some((_, model)) = models(&server.url()).into_iter().find(|(n, _)| *n == name) else {
            unreachable!("both providers are built")
        };
        let (result, grew) = measured(async {
            let mut stream = model.chat_stream(&history, &[], &options).await?;
            // Consume as a caller would, keeping nothing.
            while let Some(event) = stream.next().await {
                event?;
            }
            Ok::<(), ModelError>(())
        })
        .await;
        assert!(
            matches!(result, Err(ModelError::AnswerTooLarge { limit }) if limit == 16 * MIB),
            "{name}: {result:?}"
        );
        assert!(
            grew < 96 * MIB,
            "{name}: an endless answer grew the heap by {grew} bytes"
        );
    }
}
