//! Tools: the registry the `tools` node runs, the offload retrieval tools as [`Tool`]s,
//! and (feature `fs`) file tools rooted in one directory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_message::{
    Message, Tool, ToolArguments, ToolCall, ToolContext, ToolError, ToolFuture, ToolSpec,
};
use keel_offload::{OffloadStore, RetrievalTools, ThreadId, ToolLimits};
use serde_json::Value;

use crate::event::ToolFailure;

#[cfg(feature = "fs")]
mod fs;
#[cfg(feature = "fs")]
pub use fs::*;

/// The default time a tool call may take before it is answered with a timeout.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// The tools an agent may call, by name, with their specs in registration order.
#[derive(Clone, Default)]
pub struct Toolbox {
    tools: BTreeMap<String, Arc<dyn Tool>>,
    /// Shared with the agent's compactor, which then knows the list without comparing.
    specs: Arc<[ToolSpec]>,
    timeout: Option<Duration>,
}

impl std::fmt::Debug for Toolbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Toolbox")
            .field(
                "tools",
                &self.specs.iter().map(|s| &s.name).collect::<Vec<_>>(),
            )
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// How one tool call went.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ToolOutcome {
    /// The tool message answering the call (an error is written into it for the model).
    pub message: Message,
    /// The error, when the call produced no result.
    pub error: Option<String>,
    /// Why the call produced no result, when it did not.
    pub failure: Option<ToolFailure>,
    /// Characters of the result as the tool returned it.
    pub result_chars: usize,
    /// Wall time.
    pub duration: Duration,
}

impl Toolbox {
    /// An empty toolbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool; `Err(name)` if a tool of that name is already registered.
    pub fn add(&mut self, tool: Arc<dyn Tool>) -> Result<(), String> {
        let spec = tool.spec();
        if self.tools.contains_key(&spec.name) {
            return Err(spec.name);
        }
        self.tools.insert(spec.name.clone(), tool);
        let mut specs = self.specs.to_vec();
        specs.push(spec);
        self.specs = specs.into();
        Ok(())
    }

    /// Whether a tool of this name is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    /// Sets the time each call may take (default [`DEFAULT_TOOL_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// The specs sent to the model.
    pub fn specs(&self) -> &[ToolSpec] {
        &self.specs
    }

    /// The specs as a shared list ([`keel_compaction::Compactor::with_tools`]).
    pub fn shared_specs(&self) -> Arc<[ToolSpec]> {
        self.specs.clone()
    }

    /// Runs one call to the end, whatever happens: an unknown tool, arguments that are
    /// not JSON, a tool error, a panic or a timeout each become a tool message that says
    /// so, so the model can act on it and the run goes on.
    pub async fn run(&self, call: &ToolCall, thread_id: Option<&str>) -> ToolOutcome {
        let mut ctx = ToolContext::new(call.id.clone());
        if let Some(t) = thread_id {
            ctx = ctx.with_thread_id(t);
        }
        self.run_in(call, ctx).await
    }

    /// Runs one call like [`Toolbox::run`], handing the tool `ctx` (its thread and
    /// configurable values; the agent's tools node adds the checkpoint's lineage
    /// under [`keel_offload::LINEAGE_KEY`], so the offload tools read the branch of the
    /// thread the call runs on).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_agent::tools::Toolbox;
    /// use keel_message::{ToolCall, ToolContext, ToolSpec, tool_fn};
    /// use serde_json::json;
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let mut tools = Toolbox::new();
    /// let who = tool_fn(ToolSpec::new("who", "Says who asked.", json!({})), |_args, ctx| async move {
    ///     Ok(ctx.configurable("user").and_then(|v| v.as_str()).unwrap_or("nobody").to_owned())
    /// });
    /// tools.add(Arc::new(who)).unwrap();
    /// let call = ToolCall::new("c1", "who", json!({}));
    /// let ctx = ToolContext::new("c1").with_configurable("user", json!("ada"));
    /// assert_eq!(tools.run_in(&call, ctx).await.message.text(), "ada");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn run_in(&self, call: &ToolCall, ctx: ToolContext) -> ToolOutcome {
        let started = Instant::now();
        let result = self.execute(call, ctx).await;
        let (text, error, failure, chars) = match result {
            Ok(text) => {
                let n = text.len();
                (text, None, None, n)
            }
            Err((failure, e)) => {
                let text = format!("Error: {e}");
                (text, Some(e), Some(failure), 0)
            }
        };
        let mut message = Message::tool(call.id.clone(), text);
        message.name = Some(call.name.clone());
        ToolOutcome {
            message,
            error,
            failure,
            result_chars: chars,
            duration: started.elapsed(),
        }
    }

    async fn execute(
        &self,
        call: &ToolCall,
        ctx: ToolContext,
    ) -> Result<String, (ToolFailure, String)> {
        let Some(tool) = self.tools.get(&call.name).cloned() else {
            let known: Vec<&str> = self.specs.iter().map(|s| s.name.as_str()).collect();
            return Err((
                ToolFailure::UnknownTool,
                format!(
                    "there is no tool named `{}`; the tools are: {}",
                    clip(&call.name, 64),
                    known.join(", ")
                ),
            ));
        };
        let arguments = match &call.arguments {
            ToolArguments::Invalid(raw) => {
                return Err((
                    ToolFailure::BadArguments,
                    format!(
                        "the arguments of this `{}` call are not valid JSON ({}); call it again with a JSON object",
                        clip(&call.name, 64),
                        preview(raw)
                    ),
                ));
            }
            a => a.as_json().cloned().unwrap_or(Value::Null),
        };
        let timeout = self.timeout.unwrap_or(DEFAULT_TOOL_TIMEOUT);
        // Its own task: a panic is caught as a JoinError, and a tool that never yields
        // cannot stall the other calls of the step.
        let task = tokio::spawn(async move { tool.call(arguments, ctx).await });
        // Dropped with this call when the run is cancelled (its stream or future
        // dropped): the tool's task stops at its next await, as it would have on the
        // run's own task, rather than running on with nobody to take its result.
        let _abort = AbortOnDrop(task.abort_handle());
        match tokio::time::timeout(timeout, task).await {
            Err(_) => Err((
                ToolFailure::TimedOut,
                format!(
                    "`{}` did not finish within {} s; its result is discarded, and whatever it changed before then stays changed",
                    call.name,
                    timeout.as_secs_f64()
                ),
            )),
            Ok(Err(join)) if join.is_panic() => Err((
                ToolFailure::Panicked,
                format!(
                    "`{}` crashed (it panicked: {}); the call had no effect you can rely on",
                    call.name,
                    panic_message(join.into_panic())
                ),
            )),
            Ok(Err(_)) => Err((
                ToolFailure::Cancelled,
                format!("`{}` was cancelled", call.name),
            )),
            Ok(Ok(Err(ToolError::BadArguments(p)))) => Err((
                ToolFailure::BadArguments,
                format!("bad arguments for `{}`: {p}", call.name),
            )),
            Ok(Ok(Err(other))) => Err((ToolFailure::Failed, other.to_string())),
            Ok(Ok(Ok(text))) => Ok(text),
        }
    }
}

/// Aborts a task when dropped (a no-op once it has finished).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn preview(raw: &str) -> String {
    format!("`{}`", clip(raw, 80))
}

/// `text` cut to its first `max_chars` characters, with `…` when it was longer: for
/// what the model or a caller sent (a tool name, a tool's error) repeated in a message
/// or an event, which must not grow with it.
pub(crate) fn clip(text: &str, max_chars: usize) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(max_chars) {
        None => std::borrow::Cow::Borrowed(text),
        Some((end, _)) => std::borrow::Cow::Owned(format!("{}…", &text[..end])),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "no message".to_owned()
    }
}

/// keel-offload's retrieval tools (`ls`, `read_file`, `grep` over what left the
/// context: `large_tool_results/` and `archive/`) as [`Tool`]s, for an agent without
/// file tools. Each call runs on the blocking pool and reads the namespace of the
/// call's thread.
pub fn retrieval_tools(store: Arc<dyn OffloadStore>, limits: ToolLimits) -> Vec<Arc<dyn Tool>> {
    let specs = ThreadId::new("spec")
        .map(|t| {
            RetrievalTools::new(store.clone(), t)
                .with_limits(limits)
                .specs()
        })
        .unwrap_or_default();
    specs
        .into_iter()
        .map(|spec| {
            Arc::new(OffloadTool {
                spec,
                store: store.clone(),
                limits,
            }) as Arc<dyn Tool>
        })
        .collect()
}

struct OffloadTool {
    spec: ToolSpec,
    store: Arc<dyn OffloadStore>,
    limits: ToolLimits,
}

impl Tool for OffloadTool {
    fn spec(&self) -> ToolSpec {
        self.spec.clone()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let thread = ctx
                .thread_id()
                .ok_or_else(|| ToolError::failed("this tool needs the run's thread id"))?;
            let thread = ThreadId::new(thread).map_err(ToolError::failed)?;
            let tools = RetrievalTools::new(self.store.clone(), thread)
                .with_limits(self.limits)
                .with_lineage_of(&ctx)
                .map_err(ToolError::failed)?;
            let call = ToolCall::new(ctx.call_id(), self.spec.name.clone(), arguments);
            tokio::task::spawn_blocking(move || tools.execute(&call))
                .await
                .map_err(|e| ToolError::failed(format!("the read was interrupted: {e}")))?
                .map_err(ToolError::failed)
        })
    }
}
