//! Test helpers: client configs for tests, and a raw TCP server for what wiremock
//! cannot do (drop a connection mid-body, hang, count concurrent requests).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_model::{HttpConfig, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Fast retries so tests do not sleep for long.
pub fn fast_http() -> HttpConfig {
    HttpConfig::default()
        .request_timeout(Duration::from_secs(10))
        .retry(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_backoff(Duration::from_millis(1))
                .max_backoff(Duration::from_millis(5)),
        )
}

/// One step of a raw server's reply.
#[derive(Debug, Clone)]
pub enum Step {
    /// Write these bytes.
    Write(Vec<u8>),
    /// Write these bytes this many times (a large body without holding it in memory).
    Repeat(Vec<u8>, usize),
    /// Wait.
    Sleep(Duration),
    /// Never answer (until the client gives up).
    Hang,
}

/// A chunked HTTP/1.1 response head.
pub fn chunked_head(content_type: &str) -> Step {
    Step::Write(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        .into_bytes(),
    )
}

/// A response head with no length: the body runs until the connection closes.
pub fn unframed_head(status: u16, content_type: &str) -> Step {
    Step::Write(
        format!("HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n\r\n")
            .into_bytes(),
    )
}

/// `times` chunks of a chunked body, each `size` bytes of `byte`.
pub fn repeated_chunks(byte: u8, size: usize, times: usize) -> Step {
    let mut frame = format!("{size:x}\r\n").into_bytes();
    frame.extend(std::iter::repeat_n(byte, size));
    frame.extend_from_slice(b"\r\n");
    Step::Repeat(frame, times)
}

/// A chunked HTTP/1.1 response head with this status.
pub fn chunked_status_head(status: u16, content_type: &str) -> Step {
    Step::Write(
        format!(
            "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        .into_bytes(),
    )
}

/// One chunk of a chunked body.
pub fn chunk(data: &str) -> Step {
    Step::Write(chunk_bytes(data))
}

/// The bytes of one chunk of a chunked body.
pub fn chunk_bytes(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

/// A complete response with a JSON body.
pub fn json_response(status: u16, body: &str) -> Step {
    Step::Write(
        format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

/// A server running `script(connection_number)` for each connection, then closing it.
pub struct RawServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub connections: Arc<AtomicUsize>,
    /// The most requests it was serving at the same time.
    pub max_in_flight: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl RawServer {
    /// The base URL (`http://addr`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn raw_server<F>(script: F) -> RawServer
where
    F: Fn(usize) -> Vec<Step> + Send + Sync + 'static,
{
    let listener = match TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => unreachable!("cannot bind a local port: {e}"),
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => unreachable!("no local address: {e}"),
    };
    let connections = Arc::new(AtomicUsize::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let script = Arc::new(script);
    let (c, m) = (connections.clone(), max_in_flight.clone());
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let n = c.fetch_add(1, Ordering::SeqCst);
            let steps = script(n);
            let (m, in_flight) = (m.clone(), in_flight.clone());
            tokio::spawn(async move {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                m.fetch_max(now, Ordering::SeqCst);
                let _ = serve_one(stream, steps).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    RawServer {
        addr,
        connections,
        max_in_flight,
        task,
    }
}

async fn serve_one(mut stream: TcpStream, steps: Vec<Step>) -> std::io::Result<()> {
    read_request(&mut stream).await?;
    for step in steps {
        match step {
            Step::Write(bytes) => {
                stream.write_all(&bytes).await?;
                stream.flush().await?;
            }
            Step::Repeat(bytes, times) => {
                for _ in 0..times {
                    stream.write_all(&bytes).await?;
                }
                stream.flush().await?;
            }
            Step::Sleep(d) => tokio::time::sleep(d).await,
            Step::Hang => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        }
    }
    // Dropping the stream closes the connection, whatever was (not) written.
    Ok(())
}

/// Reads one request: the head, then `content-length` bytes of body.
async fn read_request(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            return Ok(buf);
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = stream.read(&mut tmp).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Ok(buf[head_end..].to_vec())
}
