//! [`Retrying`]: retries as a wrapper around any [`ChatModel`].

use std::time::Duration;

use async_trait::async_trait;
use keel_message::{Message, RetryPolicy, ToolSpec};

use futures::StreamExt;

use crate::{ChatEvent, ChatModel, ChatOptions, ChatResponse, ChatStream, ModelError};

/// Retries any [`ChatModel`]'s failed calls with keel's one [`RetryPolicy`], the same
/// policy type graph nodes, the HTTP providers and the compactor use.
///
/// A call is tried again when its error [`is_retryable`](ModelError::is_retryable) (a
/// rate limit, a 5xx status, a connection failure) and the policy allows another
/// attempt. A rate limit that names its wait is waited exactly, unless the wait is
/// longer than [`max_retry_after`](Self::max_retry_after) (default 60 s): then the
/// error is returned at once, so the caller can decide. Other errors (context
/// overflow, bad requests, malformed replies) are returned as they are. A streamed
/// call is retried only while it is being opened: once events flow, an error is the
/// stream's last item, as without the wrapper.
///
/// The HTTP providers retry on their own (see `HttpConfig::retry`); wrap a model of
/// your own, a local one, or a provider built with `RetryPolicy::none()` when retries
/// belong one level up (for example around a router choosing between models).
///
/// ```
/// use std::time::Duration;
///
/// use keel_message::Message;
/// use keel_model::{ChatModel, ChatOptions, ModelError, Retrying, RetryPolicy, ScriptedModel, Turn};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), ModelError> {
/// // A model that is rate limited once, then answers.
/// let flaky = ScriptedModel::new(vec![
///     Turn::Fail(ModelError::RateLimited { message: "slow down".into(), retry_after: None }),
///     Turn::text("hello"),
/// ]);
/// let policy = RetryPolicy::default()
///     .max_attempts(3)
///     .initial_backoff(Duration::from_millis(1));
/// let model = Retrying::new(flaky, policy);
/// let reply = model.chat(&[Message::user("hi")], &[], &ChatOptions::new()).await?;
/// assert_eq!(reply.text(), "hello");
/// // The reply counts the attempt retried before it.
/// assert_eq!(reply.retries, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Retrying<M> {
    inner: M,
    policy: RetryPolicy,
    max_retry_after: Duration,
}

impl<M> Retrying<M> {
    /// Wraps `inner`, retrying with `policy`.
    pub fn new(inner: M, policy: RetryPolicy) -> Self {
        Retrying {
            inner,
            policy,
            max_retry_after: Duration::from_secs(60),
        }
    }

    /// Sets the longest provider-requested wait the wrapper honours (default 60 s).
    #[must_use]
    pub fn max_retry_after(mut self, wait: Duration) -> Self {
        self.max_retry_after = wait;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The wrapped model, unwrapped.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The wait before the next attempt after `failed` failed ones, or `None` when
    /// `err` is final.
    fn wait(&self, err: &ModelError, failed: u32) -> Option<Duration> {
        if !err.is_retryable() || !self.policy.allows_retry(failed) {
            return None;
        }
        retry_wait(
            &self.policy,
            self.max_retry_after,
            failed.saturating_sub(1),
            err.retry_after(),
        )
    }

    /// Runs `attempt` until it succeeds or its error is final; with the value, the
    /// failed attempts retried before it.
    async fn retrying<T, F, Fut>(&self, what: &str, mut attempt: F) -> Result<(T, u32), ModelError>
    where
        M: ChatModel,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ModelError>>,
    {
        let mut failed = 0u32;
        loop {
            let err = match attempt().await {
                Ok(v) => return Ok((v, failed)),
                Err(e) => e,
            };
            failed += 1;
            let Some(wait) = self.wait(&err, failed) else {
                return Err(err);
            };
            tracing::warn!(model = self.inner.model_name(), attempt = failed, wait_ms = wait.as_millis() as u64, error = %err, "{what} failed; retrying");
            tokio::time::sleep(wait).await;
        }
    }
}

/// `events` whose finished reply ([`ChatEvent::Done`]) counts `failed` more retried
/// attempts: those made before the stream opened.
pub(crate) fn add_retries(events: ChatStream, failed: u32) -> ChatStream {
    if failed == 0 {
        return events;
    }
    Box::pin(events.map(move |item| match item {
        Ok(ChatEvent::Done(r)) => {
            let retries = r.retries.saturating_add(failed);
            Ok(ChatEvent::Done(r.with_retries(retries)))
        }
        other => other,
    }))
}

/// The wait before retry number `retry` (0-based): the provider's `retry_after` when it
/// gave one (`None`, give up, if that is longer than `max_retry_after`), else the
/// policy's backoff with jitter.
pub(crate) fn retry_wait(
    policy: &RetryPolicy,
    max_retry_after: Duration,
    retry: u32,
    retry_after: Option<Duration>,
) -> Option<Duration> {
    match retry_after {
        Some(wait) => (wait <= max_retry_after).then_some(wait),
        None => Some(policy.delay(retry)),
    }
}

#[async_trait]
impl<M: ChatModel> ChatModel for Retrying<M> {
    fn model_name(&self) -> &str {
        self.inner.model_name()
    }

    fn context_window(&self) -> Option<usize> {
        self.inner.context_window()
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let (reply, failed) = self
            .retrying("model call", || self.inner.chat(messages, tools, options))
            .await?;
        let retries = reply.retries.saturating_add(failed);
        Ok(reply.with_retries(retries))
    }

    async fn chat_stream(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatStream, ModelError> {
        let (events, failed) = self
            .retrying("opening a model stream", || {
                self.inner.chat_stream(messages, tools, options)
            })
            .await?;
        Ok(add_retries(events, failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_wait_honours_retry_after_within_the_cap() {
        let p = RetryPolicy::default().jitter(false);
        let cap = Duration::from_secs(10);
        let three = Some(Duration::from_secs(3));
        assert_eq!(retry_wait(&p, cap, 0, three), three);
        assert_eq!(retry_wait(&p, cap, 0, Some(Duration::from_secs(11))), None);
        assert_eq!(retry_wait(&p, cap, 1, None), Some(Duration::from_secs(1)));
    }

    use crate::{ScriptedModel, Turn};

    fn fast(attempts: u32) -> RetryPolicy {
        RetryPolicy::default()
            .max_attempts(attempts)
            .initial_backoff(Duration::from_millis(1))
            .max_backoff(Duration::from_millis(2))
    }

    fn server_error() -> ModelError {
        ModelError::Api {
            status: 503,
            message: "overloaded".into(),
            code: None,
        }
    }

    async fn ask(model: &Retrying<ScriptedModel>) -> Result<ChatResponse, ModelError> {
        model
            .chat(&[Message::user("hi")], &[], &ChatOptions::new())
            .await
    }

    #[tokio::test]
    async fn retries_retryable_errors_up_to_the_attempts() {
        let model = Retrying::new(
            ScriptedModel::new(vec![
                Turn::Fail(server_error()),
                Turn::Fail(server_error()),
                Turn::text("third time"),
            ]),
            fast(3),
        );
        assert_eq!(
            ask(&model).await.map(|r| r.text().into_owned()).ok(),
            Some("third time".into())
        );
        assert_eq!(model.inner().requests().len(), 3);

        let model = Retrying::new(
            ScriptedModel::new(vec![
                Turn::Fail(server_error()),
                Turn::Fail(server_error()),
                Turn::text("too late"),
            ]),
            fast(2),
        );
        assert!(matches!(
            ask(&model).await,
            Err(ModelError::Api { status: 503, .. })
        ));
        assert_eq!(model.inner().requests().len(), 2);
    }

    #[tokio::test]
    async fn final_errors_and_long_waits_are_returned_at_once() {
        let model = Retrying::new(
            ScriptedModel::new(vec![
                Turn::Fail(ModelError::Api {
                    status: 400,
                    message: "bad request".into(),
                    code: None,
                }),
                Turn::text("never"),
            ]),
            fast(5),
        );
        assert!(matches!(
            ask(&model).await,
            Err(ModelError::Api { status: 400, .. })
        ));
        assert_eq!(model.inner().requests().len(), 1);

        let model = Retrying::new(
            ScriptedModel::new(vec![
                Turn::Fail(ModelError::RateLimited {
                    message: "come back tomorrow".into(),
                    retry_after: Some(Duration::from_secs(86_400)),
                }),
                Turn::text("never"),
            ]),
            fast(5),
        );
        assert!(matches!(
            ask(&model).await,
            Err(ModelError::RateLimited { .. })
        ));
        assert_eq!(model.inner().requests().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_named_wait_is_honoured_exactly() {
        let model = Retrying::new(
            ScriptedModel::new(vec![
                Turn::Fail(ModelError::RateLimited {
                    message: "slow down".into(),
                    retry_after: Some(Duration::from_secs(7)),
                }),
                Turn::text("ok"),
            ]),
            fast(2),
        );
        let started = tokio::time::Instant::now();
        assert!(ask(&model).await.is_ok());
        assert_eq!(started.elapsed().as_secs(), 7);
    }
}
