//! The tool contract: something an agent can call.
//!
//! It lives here, beside [`ToolSpec`] and [`ToolCall`], so that every crate that has
//! tools (keel-offload's retrieval tools, keel-agent's file tools, yours) and every
//! runtime that calls them share one small trait without depending on each other.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use serde_json::Value;

use crate::ToolSpec;

/// The future a [`Tool`] returns.
pub type ToolFuture<'a> = Pin<Box<dyn Future<Output = Result<String, ToolError>> + Send + 'a>>;

/// What a tool knows about the call it serves: its id, the thread, and values the
/// runtime hands every call (LangGraph's `config["configurable"]`).
///
/// ```
/// use serde_json::json;
///
/// let ctx = keel_message::ToolContext::new("call_7")
///     .with_thread_id("t-1")
///     .with_configurable("user", json!("ada"));
/// assert_eq!(ctx.call_id(), "call_7");
/// assert_eq!(ctx.thread_id(), Some("t-1"));
/// assert_eq!(ctx.configurable("user"), Some(&json!("ada")));
/// assert_eq!(ctx.configurable("missing"), None);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ToolContext {
    call_id: String,
    thread_id: Option<String>,
    step: Option<u64>,
    configurable: serde_json::Map<String, Value>,
}

impl ToolContext {
    /// The context of the call with id `call_id`.
    pub fn new(call_id: impl Into<String>) -> Self {
        ToolContext {
            call_id: call_id.into(),
            thread_id: None,
            step: None,
            configurable: serde_json::Map::new(),
        }
    }

    /// Sets the thread the call runs in.
    #[must_use]
    pub fn with_thread_id(mut self, thread_id: impl Into<String>) -> Self {
        self.thread_id = Some(thread_id.into());
        self
    }

    /// The id of the tool call (what the result answers with `tool_call_id`).
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// The thread the call runs in, when the runtime has one.
    pub fn thread_id(&self) -> Option<&str> {
        self.thread_id.as_deref()
    }

    /// Sets the step of the reply that asked for the call (keel-agent: the thread's
    /// model calls up to that reply).
    #[must_use]
    pub fn with_step(mut self, step: u64) -> Self {
        self.step = Some(step);
        self
    }

    /// The step of the reply that asked for the call, when the runtime gives one.
    pub fn step(&self) -> Option<u64> {
        self.step
    }

    /// A key that names this call alone, for a tool whose effects outside the agent (a
    /// payment, an email) must not repeat when the call is run again: the thread, the
    /// step and the call id, which stay the same when a resumed run repeats the call.
    /// The call id alone does not do: ids are unique within one reply, but some
    /// servers number each reply's calls from `call_0` again.
    ///
    /// ```
    /// let first = keel_message::ToolContext::new("call_0").with_thread_id("t-1").with_step(3);
    /// let later = keel_message::ToolContext::new("call_0").with_thread_id("t-1").with_step(4);
    /// assert_eq!(first.idempotency_key(), "t-1/3/call_0");
    /// assert_ne!(first.idempotency_key(), later.idempotency_key());
    /// ```
    pub fn idempotency_key(&self) -> String {
        let step = self.step.map(|s| s.to_string());
        [
            self.thread_id.as_deref().unwrap_or_default(),
            step.as_deref().unwrap_or_default(),
            &self.call_id,
        ]
        .join("/")
    }

    /// Sets one value the runtime hands the call. keel-agent puts the lineage of the
    /// thread's checkpoint here (`keel.lineage`), so the offload tools read the branch
    /// of the thread the call runs on.
    #[must_use]
    pub fn with_configurable(mut self, key: impl Into<String>, value: Value) -> Self {
        self.configurable.insert(key.into(), value);
        self
    }

    /// A value the runtime handed the call, by key.
    pub fn configurable(&self, key: &str) -> Option<&Value> {
        self.configurable.get(key)
    }
}

/// Why a tool call produced no result. Its message is written for the model: a runtime
/// sends it back as the tool result, so the agent can correct its call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// The arguments do not fit the tool's schema.
    #[error("bad arguments: {0}")]
    BadArguments(String),
    /// The tool ran and failed.
    #[error("{0}")]
    Failed(String),
}

impl ToolError {
    /// Bad arguments, saying what is wrong.
    pub fn bad_arguments(problem: impl fmt::Display) -> Self {
        ToolError::BadArguments(problem.to_string())
    }

    /// A failure with a message.
    pub fn failed(message: impl fmt::Display) -> Self {
        ToolError::Failed(message.to_string())
    }
}

/// Something an agent can call: a [`ToolSpec`] for the model and an async `call`.
///
/// `call` gets the parsed JSON arguments (a runtime answers arguments that are not
/// JSON itself, without calling the tool) and returns the text of the tool result.
/// Tools are object safe, so a runtime holds them as `Arc<dyn Tool>`.
///
/// ```
/// use keel_message::{Tool, ToolContext, ToolError, ToolFuture, ToolSpec};
/// use serde_json::{Value, json};
///
/// struct Add;
///
/// impl Tool for Add {
///     fn spec(&self) -> ToolSpec {
///         ToolSpec::new("add", "Adds two integers.", json!({
///             "type": "object",
///             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
///             "required": ["a", "b"],
///         }))
///     }
///
///     fn call(&self, arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
///         Box::pin(async move {
///             let arg = |k: &str| arguments[k].as_i64().ok_or_else(|| ToolError::bad_arguments(format!("`{k}` must be an integer")));
///             Ok((arg("a")? + arg("b")?).to_string())
///         })
///     }
/// }
///
/// # futures_lite_block_on::run(async {
/// let out = Add.call(json!({"a": 2, "b": 40}), ToolContext::new("c1")).await;
/// assert_eq!(out, Ok("42".to_owned()));
/// let bad = Add.call(json!({"a": "two"}), ToolContext::new("c2")).await;
/// assert_eq!(bad.unwrap_err().to_string(), "bad arguments: `a` must be an integer");
/// # });
/// # mod futures_lite_block_on {
/// #     pub fn run<F: std::future::Future>(f: F) -> F::Output {
/// #         use std::task::{Context, Poll, Waker};
/// #         let mut f = std::pin::pin!(f);
/// #         let mut cx = Context::from_waker(Waker::noop());
/// #         loop { if let Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
/// #     }
/// # }
/// ```
pub trait Tool: Send + Sync {
    /// The name, description and argument schema the model sees.
    fn spec(&self) -> ToolSpec;

    /// Runs the tool.
    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_>;
}

impl<T: Tool + ?Sized> Tool for std::sync::Arc<T> {
    fn spec(&self) -> ToolSpec {
        (**self).spec()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        (**self).call(arguments, ctx)
    }
}

/// A [`Tool`] made of a spec and an async function, for tools that need no struct of
/// their own.
///
/// ```
/// use keel_message::{Tool, ToolContext, ToolError, ToolSpec, tool_fn};
/// use serde_json::json;
///
/// let shout = tool_fn(
///     ToolSpec::new("shout", "Upper-cases `text`.", json!({
///         "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
///     })),
///     |args, _ctx| async move {
///         let text = args["text"].as_str().ok_or_else(|| ToolError::bad_arguments("`text` must be a string"))?;
///         Ok(text.to_uppercase())
///     },
/// );
/// assert_eq!(shout.spec().name, "shout");
/// # let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
/// # let mut f = shout.call(json!({"text": "hi"}), ToolContext::new("c1"));
/// # let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) else { panic!() };
/// # assert_eq!(out, Ok("HI".to_owned()));
/// ```
pub fn tool_fn<F, Fut>(spec: ToolSpec, f: F) -> FnTool<F>
where
    F: Fn(Value, ToolContext) -> Fut + Send + Sync,
    Fut: Future<Output = Result<String, ToolError>> + Send + 'static,
{
    FnTool { spec, f }
}

/// A tool from [`tool_fn`].
pub struct FnTool<F> {
    spec: ToolSpec,
    f: F,
}

impl<F> fmt::Debug for FnTool<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnTool")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl<F, Fut> Tool for FnTool<F>
where
    F: Fn(Value, ToolContext) -> Fut + Send + Sync,
    Fut: Future<Output = Result<String, ToolError>> + Send + 'static,
{
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin((self.f)(arguments, ctx))
    }
}
