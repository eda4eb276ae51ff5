//! Provider overhead: requests per second against a minimal local mock server, with 64
//! calls in flight.
//!
//! The mock is a bare tokio TCP server (HTTP/1.1 keep-alive, one canned reply) on its
//! own thread, so what is measured is the client: request building and JSON encoding,
//! the connection pool, the concurrency limiter, retries bookkeeping, and reply
//! parsing. Prints one JSON line per provider with the median of the repetitions.
//!
//! `cargo run --release -p keel-model --example bench_provider -- [reps] [requests]`

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use keel_message::{Message, ToolCall};
use keel_model::{
    ChatModel, ChatOptions, HttpConfig, OllamaConfig, OllamaModel, OpenAiConfig, OpenAiModel,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const CONCURRENCY: usize = 64;

fn openai_reply() -> String {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"src/lib.rs\"}"}}]}}],
        "usage": {"prompt_tokens": 412, "completion_tokens": 19, "total_tokens": 431}
    })
    .to_string()
}

fn ollama_reply() -> String {
    json!({
        "model": "llama3.1:8b", "created_at": "2025-01-01T00:00:00Z",
        "message": {"role": "assistant", "content": "",
                    "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "src/lib.rs"}}}]},
        "done": true, "done_reason": "stop", "prompt_eval_count": 412, "eval_count": 19
    })
    .to_string()
}

/// Serves `body` to every request on every connection, keeping connections open.
fn spawn_mock(body: String) -> std::io::Result<std::net::SocketAddr> {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let response: Arc<[u8]> = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
    .into();
    std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async move {
            let Ok(listener) = TcpListener::from_std(std_listener) else {
                return;
            };
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::with_capacity(8192);
                    let mut tmp = [0u8; 8192];
                    loop {
                        // Complete requests in the buffer: head, then content-length body.
                        while let Some(end) = request_end(&buf) {
                            buf.drain(..end);
                            if stream.write_all(&response).await.is_err() {
                                return;
                            }
                        }
                        match stream.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                });
            }
        });
    });
    Ok(addr)
}

/// The length of the first complete request in `buf`, if there is one.
fn request_end(buf: &[u8]) -> Option<usize> {
    let head = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = std::str::from_utf8(&buf[..head]).ok()?;
    let len = text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    (buf.len() >= head + len).then_some(head + len)
}

fn history() -> Vec<Message> {
    vec![
        Message::system("You are a coding agent."),
        Message::user("Find where the config is parsed."),
        Message::assistant("").with_tool_calls(vec![ToolCall::new(
            "c1",
            "grep",
            json!({"pattern": "parse_config", "path": "."}),
        )]),
        Message::tool("c1", "src/config.rs:12: pub fn parse_config(text: &str)"),
    ]
}

async fn measure(model: Arc<dyn ChatModel>, requests: usize) -> Result<f64, String> {
    let messages = Arc::new(history());
    let options = Arc::new(ChatOptions::new().temperature(0.0).max_tokens(256));
    let start = Instant::now();
    let mut calls = futures::stream::iter(0..requests)
        .map(|_| {
            let (model, messages, options) = (model.clone(), messages.clone(), options.clone());
            async move { model.chat(&messages, &[], &options).await }
        })
        .buffer_unordered(CONCURRENCY);
    let mut done = 0usize;
    while let Some(reply) = calls.next().await {
        let reply = reply.map_err(|e| e.to_string())?;
        if reply.message.tool_calls.len() != 1 {
            return Err("unexpected reply".into());
        }
        done += 1;
    }
    Ok(done as f64 / start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let reps = args.first().copied().unwrap_or(5);
    let requests = args.get(1).copied().unwrap_or(20_000);
    let openai_addr = spawn_mock(openai_reply())?;
    let ollama_addr = spawn_mock(ollama_reply())?;
    let http = HttpConfig::default().max_concurrency(CONCURRENCY);
    let openai: Arc<dyn ChatModel> = Arc::new(OpenAiModel::new(
        OpenAiConfig::new("gpt-4o-mini")
            .base_url(format!("http://{openai_addr}/v1"))
            .api_key("sk-bench")
            .http(http.clone()),
    )?);
    let ollama: Arc<dyn ChatModel> = Arc::new(OllamaModel::new(
        OllamaConfig::new("llama3.1:8b")
            .base_url(format!("http://{ollama_addr}"))
            .http(http),
    )?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    eprintln!(
        "provider overhead: {requests} non-streamed calls per repetition, {CONCURRENCY} in flight, {reps} repetitions, mock server on its own thread"
    );
    for (name, model) in [("openai", openai), ("ollama", ollama)] {
        // Warm up the connection pool.
        rt.block_on(measure(model.clone(), 2_000))?;
        let mut rates = Vec::new();
        for _ in 0..reps {
            rates.push(rt.block_on(measure(model.clone(), requests))?);
        }
        println!(
            "{}",
            json!({
                "bench": "provider",
                "provider": name,
                "concurrency": CONCURRENCY,
                "requests": requests,
                "median_requests_per_s": median(rates.clone()),
                "min_requests_per_s": rates.iter().copied().fold(f64::INFINITY, f64::min),
                "max_requests_per_s": rates.iter().copied().fold(0.0, f64::max),
            })
        );
    }
    Ok(())
}
