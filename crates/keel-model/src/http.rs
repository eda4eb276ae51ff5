//! What the HTTP providers share: configuration, retries with backoff, concurrency and
//! rate limits, error classification, and the line-oriented stream driver.

use std::cell::Cell;
use std::collections::VecDeque;
use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{Stream, StreamExt};
use keel_message::RetryPolicy;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::{looks_like_overflow, snippet};
use crate::retry::retry_wait;
use crate::{ChatEvent, ChatStream, ModelError};

/// An environment variable's value, unless unset or blank.
pub(crate) fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Transport settings shared by the HTTP providers.
///
/// Each client built from a config gets its own connection pool, concurrency limit
/// and rate limit: build the agent's model and the summarizer's model as two clients
/// and a slow or rate-limited summarizer never takes the agent's slots. Clones of one
/// client share its limits.
///
/// Everything a server sends is bounded, so a misbehaving server can neither grow the
/// process without limit nor keep a call alive forever:
///
/// | what | setting | default | error |
/// |---|---|---|---|
/// | a non-streamed reply body | [`max_body_bytes`](Self::max_body_bytes) | 32 MiB | [`ModelError::BodyTooLarge`] |
/// | an error reply's body | read up to its first 64 KiB to classify it | | |
/// | one line (or SSE event) of a stream | [`max_line_bytes`](Self::max_line_bytes) | 4 MiB | [`ModelError::LineTooLong`] |
/// | a streamed answer (text and tool calls) | [`max_answer_bytes`](Self::max_answer_bytes) | 16 MiB | [`ModelError::AnswerTooLarge`] |
/// | a whole streamed call | [`stream_timeout`](Self::stream_timeout) | 10 min | [`ModelError::Timeout`] |
/// | a stream's silence | [`stream_idle_timeout`](Self::stream_idle_timeout) | 60 s | [`ModelError::Timeout`] |
///
/// ```
/// use std::time::Duration;
/// use keel_model::{HttpConfig, RateLimit, RetryPolicy};
///
/// let config = HttpConfig::default()
///     .request_timeout(Duration::from_secs(60))
///     .stream_timeout(Duration::from_secs(300))
///     .max_body_bytes(8 << 20)
///     .max_concurrency(4)
///     .rate_limit(RateLimit::per_second(2.0, 4))
///     .retry(RetryPolicy::default().max_attempts(6));
/// assert_eq!(config.max_concurrency, 4);
/// assert_eq!(config.max_body_bytes, 8 << 20);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HttpConfig {
    /// Deadline for a whole non-streamed call, and for a streamed call's response
    /// headers (default 120 s), per attempt.
    /// [`ChatOptions::timeout`](crate::ChatOptions::timeout) overrides it per call.
    pub request_timeout: Duration,
    /// Deadline for opening a connection (default 10 s).
    pub connect_timeout: Duration,
    /// The longest a stream may go without sending anything (default 60 s).
    pub stream_idle_timeout: Duration,
    /// Deadline for a whole streamed call, from its first attempt to its last event,
    /// however steadily the server keeps sending (default 10 min). Past it the stream
    /// ends with [`ModelError::Timeout`].
    pub stream_timeout: Duration,
    /// The most bytes of a non-streamed reply body (default 32 MiB). A longer body is
    /// [`ModelError::BodyTooLarge`], found out without reading more than the limit. An
    /// error reply is classified from its first 64 KiB, whatever its length.
    pub max_body_bytes: usize,
    /// The longest line of a streamed reply, and the longest server-sent event (its
    /// `data:` lines together), in bytes (default 4 MiB). A longer one ends the stream
    /// with [`ModelError::LineTooLong`].
    pub max_line_bytes: usize,
    /// The most bytes of text and tool-call fragments a streamed reply may carry
    /// (default 16 MiB). More ends the stream with [`ModelError::AnswerTooLarge`].
    pub max_answer_bytes: usize,
    /// How failed attempts are retried: keel's one [`RetryPolicy`] (default 3 attempts
    /// in all, 500 ms doubling to at most 30 s, with jitter).
    ///
    /// An attempt is retried when it failed with HTTP 429, a 5xx status, or a
    /// connection error (including a non-streamed reply cut off mid-body). A
    /// `Retry-After` (or `retry-after-ms`) header is honoured exactly instead of the
    /// backoff; one asking for more than [`max_retry_after`](Self::max_retry_after)
    /// ends the call at once with [`ModelError::RateLimited`] carrying the wait, so the
    /// caller can decide (a wait over a year, or too large to represent, is reported as
    /// a year; a negative, NaN or infinite one is ignored and the backoff applies).
    /// Context overflow, other 4xx statuses, timeouts, replies over a size limit and
    /// malformed replies are never retried.
    pub retry: RetryPolicy,
    /// The longest `Retry-After` the client waits for (default 60 s).
    pub max_retry_after: Duration,
    /// The most calls this client has in flight at once, retries and streams included
    /// (default 8). Further calls wait for a slot.
    pub max_concurrency: usize,
    /// A client-side request rate limit (default none).
    pub rate_limit: Option<RateLimit>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            request_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(10),
            stream_idle_timeout: Duration::from_secs(60),
            stream_timeout: Duration::from_secs(600),
            max_body_bytes: 32 << 20,
            max_line_bytes: 4 << 20,
            max_answer_bytes: 16 << 20,
            retry: RetryPolicy::default(),
            max_retry_after: Duration::from_secs(60),
            max_concurrency: 8,
            rate_limit: None,
        }
    }
}

impl HttpConfig {
    /// Sets [`HttpConfig::request_timeout`].
    #[must_use]
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// Sets [`HttpConfig::connect_timeout`].
    #[must_use]
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Sets [`HttpConfig::stream_idle_timeout`].
    #[must_use]
    pub fn stream_idle_timeout(mut self, d: Duration) -> Self {
        self.stream_idle_timeout = d;
        self
    }

    /// Sets [`HttpConfig::stream_timeout`].
    #[must_use]
    pub fn stream_timeout(mut self, d: Duration) -> Self {
        self.stream_timeout = d;
        self
    }

    /// Sets [`HttpConfig::max_body_bytes`].
    #[must_use]
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Sets [`HttpConfig::max_line_bytes`].
    #[must_use]
    pub fn max_line_bytes(mut self, bytes: usize) -> Self {
        self.max_line_bytes = bytes;
        self
    }

    /// Sets [`HttpConfig::max_answer_bytes`].
    #[must_use]
    pub fn max_answer_bytes(mut self, bytes: usize) -> Self {
        self.max_answer_bytes = bytes;
        self
    }

    /// Sets [`HttpConfig::retry`].
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets [`HttpConfig::max_retry_after`].
    #[must_use]
    pub fn max_retry_after(mut self, d: Duration) -> Self {
        self.max_retry_after = d;
        self
    }

    /// Sets [`HttpConfig::max_concurrency`] (0 is taken as 1).
    #[must_use]
    pub fn max_concurrency(mut self, n: usize) -> Self {
        self.max_concurrency = n.max(1);
        self
    }

    /// Sets [`HttpConfig::rate_limit`].
    #[must_use]
    pub fn rate_limit(mut self, limit: RateLimit) -> Self {
        self.rate_limit = Some(limit);
        self
    }
}

/// A token-bucket limit on how often a client starts requests (retries included).
///
/// The rate must be positive and finite, and slow enough a rate still has a wait that
/// fits a [`Duration`] (one request in under about 584 billion years); building a
/// client with any other rate is [`ModelError::Config`].
///
/// ```
/// let limit = keel_model::RateLimit::per_second(5.0, 10);
/// assert_eq!(limit.burst, 10);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Sustained requests per second (must be positive).
    pub requests_per_second: f64,
    /// Requests that may start at once after a quiet period (at least 1).
    pub burst: u32,
}

impl RateLimit {
    /// `requests_per_second` sustained, `burst` at once.
    pub fn per_second(requests_per_second: f64, burst: u32) -> Self {
        RateLimit {
            requests_per_second,
            burst: burst.max(1),
        }
    }
}

#[derive(Debug)]
struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    fn new(limit: RateLimit) -> Result<Self, ModelError> {
        let rate = limit.requests_per_second;
        if !(rate.is_finite() && rate > 0.0) {
            return Err(ModelError::Config(format!(
                "rate limit must be a positive number of requests per second, got {rate}"
            )));
        }
        if Duration::try_from_secs_f64(1.0 / rate).is_err() {
            return Err(ModelError::Config(format!(
                "rate limit of {rate} requests per second is too small: one request would \
                 take longer than the longest wait there is"
            )));
        }
        let burst = f64::from(limit.burst.max(1));
        Ok(TokenBucket {
            rate: limit.requests_per_second,
            burst,
            state: Mutex::new((burst, Instant::now())),
        })
    }

    async fn acquire(&self) {
        loop {
            let wait = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                let now = Instant::now();
                let elapsed = now.saturating_duration_since(state.1).as_secs_f64();
                state.0 = (state.0 + elapsed * self.rate).min(self.burst);
                state.1 = now;
                if state.0 >= 1.0 {
                    state.0 -= 1.0;
                    return;
                }
                // At most 1/rate (checked in `new`); at least a nanosecond, so time
                // moves on even when a huge rate rounds the wait to zero.
                Duration::try_from_secs_f64((1.0 - state.0) / self.rate)
                    .unwrap_or(Duration::MAX)
                    .max(Duration::from_nanos(1))
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// Turns an error reply into a [`ModelError`]: status, body, and the `Retry-After` wait.
pub(crate) type Classify = fn(u16, &[u8], Option<Duration>) -> ModelError;

/// A configured HTTP client with its own limits.
#[derive(Clone)]
pub(crate) struct Http {
    client: reqwest::Client,
    /// Sent with every request (an API key), not baked into the client, so a client
    /// the caller built works the same.
    headers: HeaderMap,
    pub(crate) config: HttpConfig,
    slots: Arc<Semaphore>,
    bucket: Option<Arc<TokenBucket>>,
    classify: Classify,
}

impl std::fmt::Debug for Http {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Http {
    /// `client`: the caller's own `reqwest::Client` (proxies, custom CAs, middleware),
    /// or `None` for one built from `config` (its connect timeout, rustls).
    pub(crate) fn new(
        config: HttpConfig,
        headers: &[(&str, String)],
        classify: Classify,
        client: Option<reqwest::Client>,
    ) -> Result<Self, ModelError> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|e| ModelError::Config(format!("header name `{name}`: {e}")))?;
            let mut value = HeaderValue::from_str(value)
                .map_err(|e| ModelError::Config(format!("header `{name}`: {e}")))?;
            value.set_sensitive(true);
            map.insert(name, value);
        }
        let client = match client {
            Some(c) => c,
            None => reqwest::Client::builder()
                .connect_timeout(config.connect_timeout)
                .build()
                .map_err(|e| ModelError::Config(error_chain(&e)))?,
        };
        let bucket = config
            .rate_limit
            .map(TokenBucket::new)
            .transpose()?
            .map(Arc::new);
        Ok(Http {
            client,
            headers: map,
            slots: Arc::new(Semaphore::new(config.max_concurrency.max(1))),
            bucket,
            classify,
            config,
        })
    }

    async fn slot(&self) -> Result<OwnedSemaphorePermit, ModelError> {
        Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .map_err(|_| ModelError::Config("the client's concurrency limiter was closed".into()))
    }

    /// Runs `attempt` until it succeeds, fails for good, or retries run out; with the
    /// value, the failed attempts retried before it.
    async fn retrying<T, F, Fut>(&self, url: &str, mut attempt: F) -> Result<(T, u32), ModelError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        let policy = &self.config.retry;
        let mut retry = 0;
        loop {
            if let Some(bucket) = &self.bucket {
                bucket.acquire().await;
            }
            let err = match attempt().await {
                Ok(v) => return Ok((v, retry)),
                Err(e) => e,
            };
            if !err.is_retryable() || !policy.allows_retry(retry + 1) {
                return Err(err);
            }
            let Some(wait) = retry_wait(
                policy,
                self.config.max_retry_after,
                retry,
                err.retry_after(),
            ) else {
                return Err(err);
            };
            tracing::warn!(url = %redact_url(url), retry = retry + 1, wait_ms = wait.as_millis() as u64, error = %err, "retrying model call");
            tokio::time::sleep(wait).await;
            retry += 1;
        }
    }

    async fn send(
        &self,
        url: &str,
        body: &[u8],
        get: bool,
    ) -> Result<reqwest::Response, ModelError> {
        let request = if get {
            self.client.get(url)
        } else {
            self.client
                .post(url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_vec())
        };
        let response = request
            .headers(self.headers.clone())
            .send()
            .await
            .map_err(transport_error)?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry_after = retry_after(response.headers());
        let body = read_prefix(response, ERROR_BODY_PREFIX).await?;
        Err((self.classify)(status.as_u16(), &body, retry_after))
    }

    /// A complete call: the body of a successful reply.
    pub(crate) async fn call(
        &self,
        url: &str,
        body: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, ModelError> {
        self.call_counted(url, body, timeout).await.map(|(b, _)| b)
    }

    /// [`HttpClient::call`], with the failed attempts retried before the reply.
    pub(crate) async fn call_counted(
        &self,
        url: &str,
        body: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<(Vec<u8>, u32), ModelError> {
        let _slot = self.slot().await?;
        let deadline = timeout.unwrap_or(self.config.request_timeout);
        self.retrying(url, || async {
            let attempt = async {
                let response = self.send(url, body.unwrap_or(&[]), body.is_none()).await?;
                read_capped(response, self.config.max_body_bytes).await
            };
            tokio::time::timeout(deadline, attempt)
                .await
                .map_err(|_| ModelError::Timeout(deadline))?
        })
        .await
    }

    /// A streamed call: the successful response, decoded line by line.
    pub(crate) async fn stream<D: Decoder>(
        &self,
        url: &str,
        body: &[u8],
        timeout: Option<Duration>,
        decoder: D,
    ) -> Result<ChatStream, ModelError> {
        let slot = self.slot().await?;
        let limits = StreamLimits::of(&self.config);
        // The whole call, retries and response headers included, ends by then.
        let end = Instant::now().checked_add(limits.total);
        let headers_timeout = timeout.unwrap_or(self.config.request_timeout);
        let attempts = self.retrying(url, || async {
            tokio::time::timeout(headers_timeout, self.send(url, body, false))
                .await
                .map_err(|_| ModelError::Timeout(headers_timeout))?
        });
        let (response, retries) = match end {
            Some(end) => tokio::time::timeout_at(end, attempts)
                .await
                .map_err(|_| ModelError::Timeout(limits.total))??,
            None => attempts.await?,
        };
        let events = drive(response.bytes_stream(), slot, decoder, limits, end);
        Ok(crate::retry::add_retries(events, retries))
    }
}

/// How much of an error reply's body is read to classify it.
pub(crate) const ERROR_BODY_PREFIX: usize = 64 * 1024;

/// A successful reply's body, at most `limit` bytes: a longer one is
/// [`ModelError::BodyTooLarge`], known from `Content-Length` when the server sent one,
/// else found after reading `limit` bytes and no more.
async fn read_capped(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, ModelError> {
    let too_large = ModelError::BodyTooLarge { limit };
    let announced = response.content_length();
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    // Trust the announced length only for a first allocation of at most 1 MiB.
    let first = announced.map_or(0, |n| n.min(1 << 20) as usize);
    let mut body = Vec::with_capacity(first);
    while let Some(chunk) = response.chunk().await.map_err(transport_error)? {
        let needed = body.len().saturating_add(chunk.len());
        if needed > limit {
            return Err(too_large);
        }
        if needed > body.capacity() {
            // Double as `Vec` would, but never past the limit.
            let capacity = body.capacity().saturating_mul(2).max(needed).min(limit);
            body.reserve_exact(capacity - body.len());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The first `limit` bytes of an error reply's body (the rest is never read).
async fn read_prefix(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, ModelError> {
    let mut body = Vec::new();
    while body.len() < limit {
        let Some(chunk) = response.chunk().await.map_err(transport_error)? else {
            break;
        };
        let room = limit - body.len();
        body.extend_from_slice(chunk.get(..room).unwrap_or(&chunk));
    }
    Ok(body)
}

/// The error of a request that got no (complete) response. The URL reqwest puts in
/// its message is left out (its query may hold a key); the error says the server's
/// address, redacted, instead.
pub(crate) fn transport_error(e: reqwest::Error) -> ModelError {
    if e.is_timeout() && !e.is_connect() {
        return ModelError::Timeout(Duration::ZERO);
    }
    let at = e.url().map(|u| redact_url(u.as_str()));
    let chain = error_chain(&e.without_url());
    ModelError::Connection(match at {
        Some(at) => format!("{chain} (to {at})"),
        None => chain,
    })
}

/// An error and its sources, joined with ": ".
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

/// The longest wait a `Retry-After` header is read as: longer ones (and ones too large
/// for a [`Duration`]) are taken as this, which is more than any client waits, so the
/// call ends at once with [`ModelError::RateLimited`] carrying a wait that callers can
/// still add to an `Instant`.
pub(crate) const RETRY_AFTER_CEILING: Duration = Duration::from_secs(365 * 24 * 3600);

/// A number of seconds from a header as a wait: `None` if negative or not finite,
/// at most [`RETRY_AFTER_CEILING`].
fn wait_of(secs: f64) -> Option<Duration> {
    if !(secs.is_finite() && secs >= 0.0) {
        return None;
    }
    Some(
        Duration::try_from_secs_f64(secs)
            .unwrap_or(RETRY_AFTER_CEILING)
            .min(RETRY_AFTER_CEILING),
    )
}

/// `retry-after-ms` (OpenAI), else `retry-after` in seconds or as an HTTP date.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(wait) = text("retry-after-ms")
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|ms| wait_of(ms / 1000.0))
    {
        return Some(wait);
    }
    parse_retry_after(text("retry-after")?, std::time::SystemTime::now())
}

/// Parses a `Retry-After` value: delta seconds, or an HTTP date (relative to `now`).
/// Negative or non-finite seconds are ignored; long waits are capped at
/// [`RETRY_AFTER_CEILING`].
pub(crate) fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    if let Ok(secs) = value.parse::<f64>() {
        return wait_of(secs);
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(
        when.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(RETRY_AFTER_CEILING),
    )
}

/// The shared mapping of an error status and message to a [`ModelError`].
pub(crate) fn classify_status(
    status: u16,
    message: String,
    code: Option<String>,
    retry_after: Option<Duration>,
) -> ModelError {
    let overflow_code = code.as_deref().is_some_and(looks_like_overflow);
    if overflow_code || (status < 500 && status != 429 && looks_like_overflow(&message)) {
        return ModelError::ContextOverflow { message };
    }
    // OpenAI answers 429 for an exhausted quota too; waiting does not help there.
    if status == 429 && code.as_deref() != Some("insufficient_quota") {
        return ModelError::RateLimited {
            retry_after,
            message,
        };
    }
    ModelError::Api {
        status,
        message,
        code,
    }
}

/// The message of an error body that is not JSON.
pub(crate) fn body_text(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let trimmed = text.trim();
    if trimmed.is_empty() {
        "(empty body)".to_owned()
    } else {
        snippet(trimmed, 500)
    }
}

/// A JSON value from bytes, or a [`ModelError::Malformed`] that quotes the start.
pub(crate) fn parse_body(bytes: &[u8]) -> Result<Value, ModelError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ModelError::Malformed(format!(
            "{e} in {}",
            snippet(&String::from_utf8_lossy(bytes), 200)
        ))
    })
}

thread_local! {
    static RNG: Cell<u64> = Cell::new({
        let mut h = RandomState::new().build_hasher();
        h.write_u64(0x6b65_656c);
        h.finish() | 1
    });
}

/// A random u64 (splitmix64 over a per-thread random seed; not for cryptography).
pub(crate) fn random_u64() -> u64 {
    RNG.with(|state| {
        let next = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(next);
        let mut z = next;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// A fresh tool-call id, for providers that send none.
pub(crate) fn new_call_id() -> String {
    format!("call_{:016x}", random_u64())
}

/// Turns the lines of a streamed body into events.
pub(crate) trait Decoder: Send + 'static {
    /// Handles one line (without its line ending). Returns `Ok(true)` when the reply is
    /// complete.
    fn line(
        &mut self,
        line: &str,
        out: &mut VecDeque<Result<ChatEvent, ModelError>>,
    ) -> Result<bool, ModelError>;

    /// The body ended before [`line`](Decoder::line) reported completion.
    fn eof(&mut self, out: &mut VecDeque<Result<ChatEvent, ModelError>>) -> Result<(), ModelError>;
}

/// The bounds of one streamed reply, from [`HttpConfig`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamLimits {
    /// The longest silence.
    pub(crate) idle: Duration,
    /// The whole call's deadline, from its start.
    pub(crate) total: Duration,
    /// The longest line.
    pub(crate) max_line: usize,
    /// The most text and tool-call bytes.
    pub(crate) max_answer: usize,
}

impl StreamLimits {
    pub(crate) fn of(config: &HttpConfig) -> Self {
        StreamLimits {
            idle: config.stream_idle_timeout,
            total: config.stream_timeout,
            max_line: config.max_line_bytes,
            max_answer: config.max_answer_bytes,
        }
    }
}

/// Splits a streamed body into lines for a [`Decoder`], within [`StreamLimits`].
///
/// Each byte is searched for a line end once: `scanned` remembers how far the
/// unfinished line at the front of `buf` was already searched, so a long line arriving
/// in many chunks costs linear, not quadratic, time; and it may not grow past
/// `max_line` bytes.
struct Driver<S, D> {
    body: S,
    decoder: D,
    /// Bytes received and not yet handed to the decoder: at most one unfinished line
    /// after each chunk.
    buf: Vec<u8>,
    /// `buf[..scanned]` holds no line end.
    scanned: usize,
    pending: VecDeque<Result<ChatEvent, ModelError>>,
    finished: bool,
    limits: StreamLimits,
    /// Text and tool-call bytes the decoder has emitted.
    answer: usize,
    /// When the whole call must have ended (`None`: too far away to represent).
    end: Option<Instant>,
    /// Bytes searched for line ends, for tests of the linear scan.
    #[cfg(test)]
    searched: usize,
    _slot: OwnedSemaphorePermit,
}

/// Bytes of text and tool-call fragments an event adds to the answer.
fn answer_bytes(event: &ChatEvent) -> usize {
    match event {
        ChatEvent::Text(t) => t.len(),
        ChatEvent::ToolCall(d) => {
            d.arguments.len()
                + d.name.as_ref().map_or(0, String::len)
                + d.id.as_ref().map_or(0, String::len)
        }
        ChatEvent::Done(_) => 0,
    }
}

impl<S, D, B> Driver<S, D>
where
    S: Stream<Item = Result<B, reqwest::Error>> + Unpin + Send + 'static,
    B: AsRef<[u8]>,
    D: Decoder,
{
    fn fail(&mut self, e: ModelError) {
        self.pending.push_back(Err(e));
        self.finished = true;
    }

    /// Feeds complete lines of `buf` to the decoder; with `all`, the rest too.
    fn lines(&mut self, all: bool) {
        let max_line = self.limits.max_line;
        let mut start = 0;
        while !self.finished {
            let unsearched = self.buf.get(self.scanned..).unwrap_or_default();
            #[cfg(test)]
            {
                self.searched += unsearched.len();
            }
            let end = match unsearched.iter().position(|&b| b == b'\n') {
                Some(i) => self.scanned + i,
                None => {
                    self.scanned = self.buf.len();
                    if all && start < self.buf.len() {
                        self.buf.len()
                    } else {
                        break;
                    }
                }
            };
            let line = self.buf.get(start..end).unwrap_or_default();
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let before = self.pending.len();
            let result = if line.len() > max_line {
                Err(ModelError::LineTooLong { limit: max_line })
            } else {
                match std::str::from_utf8(line) {
                    Ok(text) => self.decoder.line(text, &mut self.pending),
                    Err(e) => Err(ModelError::Malformed(format!(
                        "stream line is not UTF-8: {e}"
                    ))),
                }
            };
            start = end.saturating_add(1).min(self.buf.len());
            self.scanned = start;
            match result {
                Ok(done) => self.finished = done,
                Err(e) => self.fail(e),
            }
            let added: usize = self
                .pending
                .iter()
                .skip(before)
                .map(|item| match item {
                    Ok(event) => answer_bytes(event),
                    Err(_) => 0,
                })
                .sum();
            self.answer = self.answer.saturating_add(added);
            if self.answer > self.limits.max_answer && !self.finished {
                let limit = self.limits.max_answer;
                self.fail(ModelError::AnswerTooLarge { limit });
            }
        }
        // An unfinished line may not grow past the limit. A `\r` at its end may be the
        // start of its `\r\n` and does not count yet: a line of exactly `max_line`
        // bytes is accepted whether or not its ending arrives in one chunk.
        let unfinished = self.buf.get(start..).unwrap_or_default();
        let unfinished = unfinished.strip_suffix(b"\r").unwrap_or(unfinished);
        if !self.finished && unfinished.len() > max_line {
            self.fail(ModelError::LineTooLong { limit: max_line });
        }
        self.buf.drain(..start);
        self.scanned = self.scanned.saturating_sub(start);
    }

    async fn next(&mut self) -> Option<Result<ChatEvent, ModelError>> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return Some(item);
            }
            if self.finished {
                return None;
            }
            let now = Instant::now();
            // Checked here too: a server that always has more ready never lets a
            // timer fire.
            if self.end.is_some_and(|end| now >= end) {
                self.fail(ModelError::Timeout(self.limits.total));
                continue;
            }
            let idle_end = now.checked_add(self.limits.idle);
            let (wake, timeout) = match (self.end, idle_end) {
                (Some(end), Some(idle)) if idle < end => (Some(idle), self.limits.idle),
                (Some(end), _) => (Some(end), self.limits.total),
                (None, idle) => (idle, self.limits.idle),
            };
            let item = match wake {
                Some(wake) => tokio::time::timeout_at(wake, self.body.next()).await,
                None => Ok(self.body.next().await),
            };
            match item {
                Err(_) => self.fail(ModelError::Timeout(timeout)),
                Ok(Some(Ok(chunk))) => {
                    self.buf.extend_from_slice(chunk.as_ref());
                    self.lines(false);
                }
                Ok(Some(Err(e))) => {
                    self.fail(ModelError::StreamInterrupted(error_chain(&e)));
                }
                Ok(None) => {
                    self.lines(true);
                    if !self.finished {
                        self.finished = true;
                        if let Err(e) = self.decoder.eof(&mut self.pending) {
                            self.pending.push_back(Err(e));
                        }
                    }
                }
            }
        }
    }
}

fn drive<S, D, B>(
    body: S,
    slot: OwnedSemaphorePermit,
    decoder: D,
    limits: StreamLimits,
    end: Option<Instant>,
) -> ChatStream
where
    S: Stream<Item = Result<B, reqwest::Error>> + Unpin + Send + 'static,
    B: AsRef<[u8]> + Send + 'static,
    D: Decoder,
{
    Box::pin(futures::stream::unfold(
        Driver::new(body, decoder, limits, end, slot),
        |mut d| async move {
            let item = d.next().await?;
            Some((item, d))
        },
    ))
}

impl<S, D> Driver<S, D> {
    fn new(
        body: S,
        decoder: D,
        limits: StreamLimits,
        end: Option<Instant>,
        slot: OwnedSemaphorePermit,
    ) -> Self {
        Driver {
            body,
            decoder,
            buf: Vec::new(),
            scanned: 0,
            pending: VecDeque::new(),
            finished: false,
            limits,
            answer: 0,
            end,
            #[cfg(test)]
            searched: 0,
            _slot: slot,
        }
    }
}

/// A body already in memory, as the chunks a server sent it in (tests and fuzzing).
#[cfg(any(test, all(fuzzing, feature = "openai", feature = "ollama")))]
pub(crate) type Chunks = futures::stream::Iter<std::vec::IntoIter<Result<Vec<u8>, reqwest::Error>>>;

/// A [`Driver`] over a body in memory: no deadline, an hour's idle timeout, and
/// `max_line` / `max_answer` as its limits. `None` only if a fresh one-permit
/// semaphore had no permit.
#[cfg(any(test, all(fuzzing, feature = "openai", feature = "ollama")))]
fn chunk_driver<D: Decoder>(
    chunks: Vec<Vec<u8>>,
    decoder: D,
    max_line: usize,
    max_answer: usize,
) -> Option<Driver<Chunks, D>> {
    let chunks: Vec<Result<Vec<u8>, reqwest::Error>> = chunks.into_iter().map(Ok).collect();
    let slot = Arc::new(Semaphore::new(1)).try_acquire_owned().ok()?;
    let limits = StreamLimits {
        idle: Duration::from_secs(3600),
        total: Duration::from_secs(3600),
        max_line,
        max_answer,
    };
    Some(Driver::new(
        futures::stream::iter(chunks),
        decoder,
        limits,
        None,
        slot,
    ))
}

/// Every item a streamed reply yields when its body arrives as `chunks` (fuzzing).
#[cfg(all(any(fuzzing, test), feature = "openai", feature = "ollama"))]
pub(crate) async fn decode_chunks<D: Decoder>(
    chunks: Vec<Vec<u8>>,
    decoder: D,
    max_line: usize,
    max_answer: usize,
) -> Vec<Result<ChatEvent, ModelError>> {
    let Some(mut d) = chunk_driver(chunks, decoder, max_line, max_answer) else {
        return vec![Err(ModelError::Config("no stream slot".into()))];
    };
    let mut items = Vec::new();
    while let Some(item) = d.next().await {
        items.push(item);
    }
    items
}

/// A request body as JSON bytes.
pub(crate) fn encode_body(body: &serde_json::Value) -> Result<Vec<u8>, ModelError> {
    serde_json::to_vec(body)
        .map_err(|e| ModelError::Config(format!("request is not serializable: {e}")))
}

/// `base` (a server's base URL) with `path` after it, or [`ModelError::Config`] when
/// `base` is not an `http` or `https` URL with a host: a URL no request could reach
/// is refused when the client is built, not retried as a connection failure at every
/// call.
pub(crate) fn endpoint(base: &str, path: &str) -> Result<String, ModelError> {
    let url = reqwest::Url::parse(base.trim()).map_err(|e| {
        ModelError::Config(format!(
            "base URL `{}` is not a URL ({e}); give one like http://localhost:11434",
            redact_url(base)
        ))
    })?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err(ModelError::Config(format!(
            "base URL `{}` is not an http or https URL with a host; give one like http://localhost:11434",
            redact_url(base)
        )));
    }
    // The path goes after the base's path, before its query (`?api-version=..`).
    let mut url = url;
    url.set_fragment(None);
    if let Ok(mut segments) = url.path_segments_mut() {
        segments.pop_if_empty().extend(path.split('/'));
    }
    Ok(url.to_string())
}

/// `url` as it may be shown (logs, errors, a CLI's output): without a user name or
/// password, and with each query parameter's value replaced by `***` (an `api-key=`
/// there is a secret). Text that is not a URL is shown as it is, unless it holds an
/// `@` or a `?`. keel's model clients log and report their server's address this way.
///
/// ```
/// use keel_model::redact_url;
///
/// assert_eq!(
///     redact_url("https://ada:s3cret@llm.example/v1?api-version=2024-10&api-key=k"),
///     "https://llm.example/v1?api-version=***&api-key=***"
/// );
/// assert_eq!(redact_url("http://127.0.0.1:8080/v1"), "http://127.0.0.1:8080/v1");
/// ```
pub fn redact_url(url: &str) -> String {
    let parsed = reqwest::Url::parse(url.trim())
        .ok()
        .filter(|u| u.host_str().is_some_and(|h| !h.is_empty()));
    let Some(mut parsed) = parsed else {
        // Not a URL with a host: shown as typed, unless it looks like it holds a
        // password or a key.
        return if url.contains(['@', '?']) {
            "(not shown: it may hold a password)".to_owned()
        } else {
            url.chars().take(200).collect()
        };
    };
    if parsed.username().is_empty() && parsed.password().is_none() && parsed.query().is_none() {
        // Nothing to hide: shown as given.
        return url.trim().to_owned();
    }
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    if parsed.query().is_some() {
        let keys: Vec<String> = parsed.query_pairs().map(|(k, _)| k.into_owned()).collect();
        let mut query = parsed.query_pairs_mut();
        query.clear();
        for key in keys {
            query.append_pair(&key, "***");
        }
    }
    parsed.set_fragment(None);
    parsed.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_goes_after_the_base_path_and_before_its_query() {
        let cases = [
            ("http://h:11434", "api/chat", "http://h:11434/api/chat"),
            (
                "http://h/v1",
                "chat/completions",
                "http://h/v1/chat/completions",
            ),
            (
                "http://h/v1/",
                "chat/completions",
                "http://h/v1/chat/completions",
            ),
            (
                "https://x.example/openai/deployments/d?api-version=2024-10-21",
                "chat/completions",
                "https://x.example/openai/deployments/d/chat/completions?api-version=2024-10-21",
            ),
        ];
        for (base, path, want) in cases {
            assert_eq!(endpoint(base, path).ok().as_deref(), Some(want), "{base}");
        }
    }

    #[test]
    fn a_url_is_shown_without_its_password_or_query_values() {
        let shown = redact_url("http://svc:pw-SECRET@127.0.0.1:18080/v1?api-key=QSECRET");
        assert_eq!(shown, "http://127.0.0.1:18080/v1?api-key=***");
        for bad in ["svc:pw-SECRET@host", "host?key=QSECRET"] {
            assert!(!redact_url(bad).contains("SECRET"), "{bad}");
        }
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("http://127.0.0.1:9"),
            "http://127.0.0.1:9",
            "as given"
        );
        let Err(ModelError::Config(e)) = endpoint("ftp://u:pw-SECRET@h/?k=QSECRET", "x") else {
            unreachable!("refused")
        };
        assert!(!e.contains("SECRET"), "{e}");
    }

    #[tokio::test]
    async fn a_connection_error_names_the_server_without_its_secrets() {
        // Nothing listens on port 9 (discard) here; the connection is refused.
        let url = "http://svc:pw-SECRET@127.0.0.1:9/v1/chat/completions?api-key=QSECRET";
        let Err(e) = reqwest::Client::new().post(url).send().await else {
            unreachable!("nothing listens on port 9")
        };
        let text = transport_error(e).to_string();
        assert!(!text.contains("SECRET"), "{text}");
        assert!(text.contains("127.0.0.1:9"), "{text}");
    }

    #[test]
    fn retry_after_parses_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").ok();
        let Some(now) = now else {
            unreachable!("valid date")
        };
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("0.25", now),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:50:07 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-3", now), None);
    }

    #[test]
    fn retry_after_ms_header_wins() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("20"));
        h.insert("retry-after-ms", HeaderValue::from_static("1500"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
    }

    #[test]
    fn absurd_retry_after_values_are_clamped_or_ignored_never_a_panic() {
        let now = std::time::SystemTime::UNIX_EPOCH;
        let year = Duration::from_secs(365 * 24 * 3600);
        assert_eq!(parse_retry_after("1e30", now), Some(year));
        assert_eq!(parse_retry_after("1e300", now), Some(year));
        assert_eq!(parse_retry_after("18446744073709551616", now), Some(year));
        assert_eq!(
            parse_retry_after("Fri, 31 Dec 9999 23:59:59 GMT", now),
            Some(year)
        );
        for ignored in ["-1", "NaN", "inf", "-inf", "1e-400x"] {
            assert_eq!(parse_retry_after(ignored, now), None, "{ignored}");
        }
        for (value, expected) in [
            ("1e300", Some(year)),
            ("1e19", Some(year)),
            ("-3", None),
            ("NaN", None),
            ("inf", None),
        ] {
            let mut h = HeaderMap::new();
            h.insert("retry-after-ms", HeaderValue::from_static(value));
            assert_eq!(retry_after(&h), expected, "{value}");
        }
    }

    #[test]
    fn backoff_and_jitter_never_overflow() {
        let p = RetryPolicy::default()
            .initial_backoff(Duration::MAX)
            .max_backoff(Duration::MAX);
        assert_eq!(p.backoff(0), Duration::MAX);
        assert_eq!(p.backoff(64), Duration::MAX);
        assert_eq!(p.delay_with(3, 1.0), Duration::MAX);
        assert!(p.delay_with(3, 0.5) < Duration::MAX);
        let mut huge = RetryPolicy::default().max_backoff(Duration::MAX);
        huge.multiplier = f64::MAX;
        assert_eq!(huge.backoff(40), Duration::MAX);
        huge.multiplier = f64::NAN;
        assert_eq!(huge.backoff(2), Duration::from_millis(500));
    }

    #[test]
    fn a_rate_too_small_to_wait_for_is_a_config_error() {
        for rate in [1e-300, f64::MIN_POSITIVE, 1e-20] {
            assert!(
                matches!(
                    TokenBucket::new(RateLimit::per_second(rate, 1)),
                    Err(ModelError::Config(_))
                ),
                "{rate}"
            );
        }
        assert!(TokenBucket::new(RateLimit::per_second(1e-6, 1)).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_huge_rate_never_spins_without_time_passing() {
        // With a rate this large the wait for the next token rounds to zero; each wait
        // must still let (paused, virtual) time move on, or this loops forever.
        for rate in [1e300, f64::MAX] {
            let Ok(bucket) = TokenBucket::new(RateLimit::per_second(rate, 1)) else {
                unreachable!("a huge rate is valid")
            };
            for _ in 0..5 {
                bucket.acquire().await;
            }
        }
    }

    /// Records each line; never done.
    struct Lines(Vec<String>);

    impl Decoder for Lines {
        fn line(
            &mut self,
            line: &str,
            out: &mut VecDeque<Result<ChatEvent, ModelError>>,
        ) -> Result<bool, ModelError> {
            self.0.push(line.to_owned());
            out.push_back(Ok(ChatEvent::Text(line.to_owned())));
            Ok(false)
        }

        fn eof(
            &mut self,
            _: &mut VecDeque<Result<ChatEvent, ModelError>>,
        ) -> Result<(), ModelError> {
            Ok(())
        }
    }

    fn driver(chunks: Vec<&[u8]>, max_line: usize, max_answer: usize) -> Driver<Chunks, Lines> {
        let chunks = chunks.into_iter().map(<[u8]>::to_vec).collect();
        let Some(d) = chunk_driver(chunks, Lines(Vec::new()), max_line, max_answer) else {
            unreachable!("a fresh semaphore has a permit")
        };
        d
    }

    async fn drain(d: &mut Driver<Chunks, Lines>) -> Vec<Result<ChatEvent, ModelError>> {
        let mut items = Vec::new();
        while let Some(item) = d.next().await {
            items.push(item);
        }
        items
    }

    #[tokio::test]
    async fn lines_split_across_chunks_crlf_and_a_last_line_without_an_end() {
        let mut d = driver(
            vec![b"one\r", b"\ntw", b"o\n\nthr", b"ee\r\nfour"],
            1024,
            1024,
        );
        drain(&mut d).await;
        assert_eq!(d.decoder.0, ["one", "two", "", "three", "four"]);
    }

    #[tokio::test]
    async fn a_long_line_in_many_chunks_is_searched_once() {
        // 1 MiB without a line end, in 1 KiB chunks, then its end: searching from the
        // start of the buffer for every chunk would look at 512 MiB.
        let piece = [b'x'; 1024];
        let mut chunks: Vec<&[u8]> = vec![&piece; 1024];
        chunks.push(b"\nok\n");
        let mut d = driver(chunks, 2 << 20, 4 << 20);
        drain(&mut d).await;
        assert_eq!(d.decoder.0.len(), 2);
        assert_eq!(d.decoder.0.first().map(String::len), Some(1 << 20));
        assert!(d.searched <= (1 << 20) + 8, "searched {} bytes", d.searched);
    }

    #[tokio::test]
    async fn a_line_over_the_limit_fails_before_it_is_complete() {
        let piece = [b'x'; 100];
        let mut d = driver(vec![&piece; 1000], 1000, 1 << 20);
        let items = drain(&mut d).await;
        assert!(
            matches!(
                items.as_slice(),
                [Err(ModelError::LineTooLong { limit: 1000 })]
            ),
            "{items:?}"
        );
        assert!(d.buf.len() <= 1100, "buffered {} bytes", d.buf.len());
        // A complete line over the limit too.
        let long = [b'y'; 1001];
        let mut d = driver(vec![b"short\n", &long, b"\n"], 1000, 1 << 20);
        let items = drain(&mut d).await;
        assert!(
            matches!(
                items.as_slice(),
                [Ok(_), Err(ModelError::LineTooLong { limit: 1000 })]
            ),
            "{items:?}"
        );
    }

    #[tokio::test]
    async fn a_line_at_the_limit_is_kept_when_its_crlf_is_split() {
        // Found by the sse_stream and ndjson_stream fuzz targets: the `\r` of a line
        // of exactly the limit counted against it while the `\n` had not arrived.
        let line = [b'z'; 10];
        for chunks in [
            vec![&line[..], b"\r\n"],
            vec![&line[..], b"\r", b"\n"],
            vec![&line[..], b"\r"],
        ] {
            let mut d = driver(chunks.clone(), 10, 1 << 20);
            let items = drain(&mut d).await;
            assert!(items.iter().all(Result::is_ok), "{chunks:?}: {items:?}");
            assert_eq!(d.decoder.0, ["zzzzzzzzzz"], "{chunks:?}");
        }
        let mut d = driver(vec![&line[..], b"z\r"], 10, 1 << 20);
        let items = drain(&mut d).await;
        assert!(
            matches!(
                items.as_slice(),
                [Err(ModelError::LineTooLong { limit: 10 })]
            ),
            "{items:?}"
        );
    }

    #[tokio::test]
    async fn the_answer_is_capped_across_lines() {
        let mut d = driver(vec![b"aaaa\nbbbb\ncccc\ndddd\n"], 1000, 10);
        let items = drain(&mut d).await;
        assert!(
            matches!(
                items.as_slice(),
                [
                    Ok(_),
                    Ok(_),
                    Ok(_),
                    Err(ModelError::AnswerTooLarge { limit: 10 })
                ]
            ),
            "{items:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_past_its_end_fails_even_with_data_ready() {
        let mut d = driver(vec![b"a\n", b"b\n"], 1000, 1000);
        d.end = Some(Instant::now());
        let items = drain(&mut d).await;
        assert!(
            matches!(items.as_slice(), [Err(ModelError::Timeout(_))]),
            "{items:?}"
        );
    }

    #[test]
    fn classification() {
        assert!(
            classify_status(
                400,
                "x".into(),
                Some("context_length_exceeded".into()),
                None
            )
            .is_context_overflow()
        );
        assert!(matches!(
            classify_status(429, "slow".into(), None, Some(Duration::from_secs(1))),
            ModelError::RateLimited {
                retry_after: Some(_),
                ..
            }
        ));
        assert!(matches!(
            classify_status(429, "pay".into(), Some("insufficient_quota".into()), None),
            ModelError::Api { status: 429, .. }
        ));
        assert!(matches!(
            classify_status(503, "maximum context length".into(), None, None),
            ModelError::Api { status: 503, .. }
        ));
    }

    #[test]
    fn bad_rate_limit_is_a_config_error() {
        assert!(matches!(
            TokenBucket::new(RateLimit::per_second(0.0, 1)),
            Err(ModelError::Config(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn token_bucket_spaces_requests_after_the_burst() {
        let bucket = TokenBucket::new(RateLimit::per_second(2.0, 2)).ok();
        let Some(bucket) = bucket else {
            unreachable!("valid limit")
        };
        let start = Instant::now();
        for _ in 0..6 {
            bucket.acquire().await;
        }
        // Two at once, then one every 500 ms of (paused, virtual) time.
        assert_eq!(start.elapsed().as_millis() / 100, 20);
    }
}
