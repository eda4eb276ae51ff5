//! What nodes return and what they can ask of the engine.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};

use keel_message::RetryPolicy;

use crate::State;

/// A node's result: a state update and where to go next.
///
/// Most nodes just return an update (`#[derive(State)]` generates
/// `From<YourStateUpdate> for Command<YourState>`); a node that routes by itself adds
/// [`Command::goto`]. A caller resumes an interrupted thread with [`Command::resume`]
/// (one answer for every pending interrupt) or [`Command::resume_each`] (an answer per
/// interrupt, as LangGraph's `Command(resume={id: value})`).
pub struct Command<S: State> {
    /// The update to fold into the state.
    pub update: Option<S::Update>,
    /// Nodes (or [`SendTo`] packets) to run next, in addition to the node's edges.
    pub goto: Vec<Goto>,
    /// For input to `invoke`: the answer to every pending `interrupt` not answered in
    /// [`resume_each`](Self::resume_each).
    pub resume: Option<Value>,
    /// For input to `invoke`: answers to pending interrupts, keyed by the
    /// [`Interrupt::task_id`](crate::Interrupt::task_id) that raised each. A pending
    /// interrupt with no answer here (nor in [`resume`](Self::resume)) stays pending:
    /// its node runs again and asks again.
    pub resume_each: BTreeMap<String, Value>,
}

impl<S: State> Default for Command<S> {
    fn default() -> Self {
        Command {
            update: None,
            goto: Vec::new(),
            resume: None,
            resume_each: BTreeMap::new(),
        }
    }
}

impl<S: State> fmt::Debug for Command<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Command")
            .field("update", &self.update.as_ref().map(|_| ".."))
            .field("goto", &self.goto)
            .field("resume", &self.resume)
            .field("resume_each", &self.resume_each)
            .finish()
    }
}

impl<S: State> Command<S> {
    /// A command that only updates the state.
    pub fn update(update: S::Update) -> Self {
        Command {
            update: Some(update),
            ..Self::default()
        }
    }

    /// A command that writes nothing (as a node result) or continues a thread from its
    /// last checkpoint (as `invoke` input).
    pub fn none() -> Self {
        Self::default()
    }

    /// Input that answers every pending interrupt with `value`.
    pub fn resume(value: impl Into<Value>) -> Self {
        Command {
            resume: Some(value.into()),
            ..Self::default()
        }
    }

    /// Input that answers pending interrupts one by one: each pair is the
    /// [`Interrupt::task_id`](crate::Interrupt::task_id) of an interrupt (from
    /// [`Run::interrupts`](crate::Run::interrupts) or
    /// [`StateSnapshot::interrupts`](crate::StateSnapshot::interrupts)) and its answer.
    /// Interrupts not named stay pending, and the run pauses again with them; a task
    /// id that has no pending interrupt is
    /// [`GraphError::UnknownInterrupt`](crate::GraphError::UnknownInterrupt), and nothing
    /// is stored.
    ///
    /// ```
    /// use keel_graph::{Command, State};
    /// use serde_json::json;
    ///
    /// #[derive(Clone, Debug, State)]
    /// struct S {
    ///     n: i64,
    /// }
    ///
    /// // After a step in which two parallel nodes each asked a question:
    /// let answers = Command::<S>::resume_each([("task-a", json!("yes")), ("task-b", json!(3))]);
    /// assert_eq!(answers.resume_each.len(), 2);
    /// ```
    pub fn resume_each<K, V>(answers: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<Value>,
    {
        Command {
            resume_each: answers
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            ..Self::default()
        }
    }

    /// Whether this input answers interrupts ([`resume`](Self::resume) or
    /// [`resume_each`](Self::resume_each)).
    pub fn is_resume(&self) -> bool {
        self.resume.is_some() || !self.resume_each.is_empty()
    }

    /// Adds targets to run next.
    #[must_use]
    pub fn goto(mut self, to: impl Into<Route>) -> Self {
        self.goto.extend(to.into().0);
        self
    }
}

/// One target of a route: a node (run once per step however often named) or a
/// [`SendTo`] packet (one task per packet).
#[derive(Debug, Clone, PartialEq)]
pub enum Goto {
    /// Run this node (or `END`).
    Node(String),
    /// Run a node with its own payload.
    Send(SendTo),
}

/// Fan-out (LangGraph's `Send`): run `node` as its own task with `payload` as its
/// input (read with [`NodeContext::payload`]). Several packets to one node run as
/// several tasks, in the order sent.
///
/// Named `SendTo` rather than `Send` so that `use keel_graph::*` does not shadow the
/// `Send` marker trait.
///
/// ```
/// use keel_graph::{Route, SendTo};
/// use serde_json::json;
///
/// // What a router returns to fan out one `work` task per item.
/// let packets: Vec<SendTo> = ["a", "b"].iter().map(|item| SendTo::new("work", json!(item))).collect();
/// let route = Route::from(packets);
/// assert_eq!(route.0.len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct SendTo {
    /// The node to run.
    pub node: String,
    /// The task's own input.
    pub payload: Value,
}

impl SendTo {
    /// A packet for `node`.
    pub fn new(node: impl Into<String>, payload: impl Into<Value>) -> Self {
        SendTo {
            node: node.into(),
            payload: payload.into(),
        }
    }
}

/// Where a router sends the run: any number of nodes and [`SendTo`] packets.
///
/// A router (or [`Command::goto`]) returns anything that converts into one: a node
/// name (`&str`, `String`), several (`Vec<&str>`, `Vec<String>`, `[&str; N]`,
/// `&[&str]`), one or more [`SendTo`] packets, or [`Goto`]s mixing both.
///
/// ```
/// use keel_graph::{END, Goto, Route, SendTo};
/// use serde_json::json;
///
/// // Names computed at run time, e.g. from the state.
/// let teams: Vec<String> = vec!["billing".into(), "tech".into()];
/// assert_eq!(Route::from(teams).0.len(), 2);
/// assert_eq!(Route::from(["billing", END]), Route::from(vec!["billing", END]));
/// let listed: &[&str] = &["tech"];
/// assert_eq!(Route::from(listed), Route::from("tech"));
/// let mixed = Route::from(vec![Goto::Node("audit".into()), Goto::Send(SendTo::new("work", json!(1)))]);
/// assert_eq!(mixed.0.len(), 2);
/// assert_eq!(Route::from(Goto::Node("audit".into())), Route::from("audit"));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Route(pub Vec<Goto>);

impl From<Goto> for Route {
    fn from(g: Goto) -> Self {
        Route(vec![g])
    }
}
impl From<Vec<String>> for Route {
    fn from(v: Vec<String>) -> Self {
        Route(v.into_iter().map(Goto::Node).collect())
    }
}
impl From<&[&str]> for Route {
    fn from(v: &[&str]) -> Self {
        Route(v.iter().map(|s| Goto::Node((*s).to_owned())).collect())
    }
}
impl<const N: usize> From<[&str; N]> for Route {
    fn from(v: [&str; N]) -> Self {
        Route(v.into_iter().map(|s| Goto::Node(s.to_owned())).collect())
    }
}

impl From<&str> for Route {
    fn from(s: &str) -> Self {
        Route(vec![Goto::Node(s.to_owned())])
    }
}
impl From<String> for Route {
    fn from(s: String) -> Self {
        Route(vec![Goto::Node(s)])
    }
}
impl From<Vec<&str>> for Route {
    fn from(v: Vec<&str>) -> Self {
        Route(v.into_iter().map(|s| Goto::Node(s.to_owned())).collect())
    }
}
impl From<SendTo> for Route {
    fn from(s: SendTo) -> Self {
        Route(vec![Goto::Send(s)])
    }
}
impl From<Vec<SendTo>> for Route {
    fn from(v: Vec<SendTo>) -> Self {
        Route(v.into_iter().map(Goto::Send).collect())
    }
}
impl From<Vec<Goto>> for Route {
    fn from(v: Vec<Goto>) -> Self {
        Route(v)
    }
}

/// Why a node did not produce a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The node paused the thread with [`NodeContext::interrupt`]; not a failure.
    #[error("interrupted: {0}")]
    Interrupt(Value),
    /// The node failed.
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl NodeError {
    /// A failure from any error.
    pub fn new(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        NodeError::Failed(e.into())
    }

    /// A failure with a message.
    pub fn msg(message: impl fmt::Display) -> Self {
        NodeError::Failed(message.to_string().into())
    }
}

/// What one invocation tells its nodes: the thread, the namespace and the user
/// configuration of its [`RunConfig`](crate::RunConfig). Made once per invocation and
/// shared by every task.
#[derive(Debug, Default)]
pub(crate) struct InvocationInfo {
    pub(crate) thread_id: Option<String>,
    pub(crate) checkpoint_ns: String,
    pub(crate) configurable: Map<String, Value>,
    pub(crate) durability: crate::Durability,
}

impl InvocationInfo {
    pub(crate) fn of(config: &crate::RunConfig) -> Self {
        InvocationInfo {
            thread_id: config.thread_id.clone(),
            checkpoint_ns: config.checkpoint_ns.clone(),
            configurable: config.configurable.clone(),
            durability: config.durability,
        }
    }
}

/// What a running node knows about its task and its invocation, and how it asks for
/// human input.
///
/// Besides the task ([`node`](Self::node), [`step`](Self::step),
/// [`task_id`](Self::task_id), [`payload`](Self::payload)) a node sees what LangGraph
/// passes as `config`: the invocation's [`thread_id`](Self::thread_id),
/// [`checkpoint_ns`](Self::checkpoint_ns), [`durability`](Self::durability) and user
/// configuration ([`config`](Self::config), from
/// [`RunConfig::with_configurable`](crate::RunConfig::with_configurable)).
///
/// ```
/// use keel_graph::{END, NodeContext, RunConfig, START, State, StateGraph};
/// use serde_json::json;
///
/// #[derive(Clone, State)]
/// struct Reply {
///     text: String,
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let graph = StateGraph::<Reply>::new()
///     .add_node("greet", |_state, ctx: NodeContext| async move {
///         let user = ctx.config().get("user").and_then(|v| v.as_str()).unwrap_or("stranger");
///         let thread = ctx.thread_id().unwrap_or("-");
///         Ok(ReplyUpdate::default().text(format!("hello {user} on {thread}")))
///     })
///     .add_edge(START, "greet")
///     .add_edge("greet", END)
///     .compile()?;
/// let config = RunConfig::thread("t-7").with_configurable("user", json!("ada"));
/// let run = graph.invoke(ReplyUpdate::default(), &config).await?;
/// assert_eq!(run.state.text, "hello ada on t-7");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct NodeContext {
    pub(crate) node: Arc<str>,
    pub(crate) step: i64,
    pub(crate) task_id: Arc<str>,
    pub(crate) payload: Option<Value>,
    pub(crate) resume: Arc<Vec<Value>>,
    pub(crate) interrupts: Arc<std::sync::atomic::AtomicUsize>,
    pub(crate) invocation: Arc<InvocationInfo>,
    pub(crate) emitter: Option<crate::engine::Emitter>,
}

impl NodeContext {
    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The superstep this task runs in.
    pub fn step(&self) -> i64 {
        self.step
    }

    /// The task's id (stable across a crash and resume).
    pub fn task_id(&self) -> &str {
        &self.task_id
    }

    /// The payload of the [`SendTo`] that started this task, if any.
    pub fn payload(&self) -> Option<&Value> {
        self.payload.as_ref()
    }

    /// The invocation's thread id ([`RunConfig::thread_id`](crate::RunConfig::thread_id)),
    /// as given, whether or not the graph has a checkpointer.
    pub fn thread_id(&self) -> Option<&str> {
        self.invocation.thread_id.as_deref()
    }

    /// The invocation's checkpoint namespace
    /// ([`RunConfig::checkpoint_ns`](crate::RunConfig::checkpoint_ns); `""` for a root
    /// graph).
    pub fn checkpoint_ns(&self) -> &str {
        &self.invocation.checkpoint_ns
    }

    /// The invocation's user configuration
    /// ([`RunConfig::configurable`](crate::RunConfig::configurable), LangGraph's
    /// `config["configurable"]`): model names, user ids, anything a node should know but
    /// the state should not hold. Not stored with checkpoints. Empty unless set.
    pub fn config(&self) -> &Map<String, Value> {
        &self.invocation.configurable
    }

    /// Sends `value` to the run's stream as an [`Event::Custom`](crate::Event::Custom)
    /// naming this node and step, when the run is a [`stream`](crate::CompiledGraph::stream)
    /// that asked for [`StreamMode::custom`](crate::StreamMode::custom); otherwise does
    /// nothing ([`emits`](Self::emits) tells which). This is LangGraph's stream writer:
    /// progress, a model's tokens, anything a caller should see before the node
    /// returns. Values are not stored: a node run again (a retry, a resume after an
    /// interrupt or a crash) sends them again.
    ///
    /// The stream holds a few events: while its reader is behind, this waits for it, so
    /// a slow reader slows the node rather than growing memory. That wait is part of
    /// the node's attempt: it counts against the node's
    /// [`timeout`](crate::NodeOptions::timeout), so a node that emits much and has a
    /// timeout wants a reader that keeps up (or a timeout with room for it).
    ///
    /// ```
    /// use futures::StreamExt;
    /// use keel_graph::{END, Event, NodeContext, RunConfig, START, State, StateGraph, StreamMode};
    /// use serde_json::json;
    ///
    /// #[derive(Clone, State)]
    /// struct Job {
    ///     done: u32,
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Job>::new()
    ///     .add_node("work", |_state, ctx: NodeContext| async move {
    ///         for part in 1..=3 {
    ///             ctx.emit(json!({ "part": part, "of": 3 })).await;
    ///         }
    ///         Ok(JobUpdate::default().done(3))
    ///     })
    ///     .add_edge(START, "work")
    ///     .add_edge("work", END)
    ///     .compile()?;
    /// let mut events = graph.stream(JobUpdate::default(), RunConfig::default(), StreamMode::custom());
    /// let mut parts = Vec::new();
    /// while let Some(event) = events.next().await {
    ///     if let Event::Custom { node, value, .. } = event? {
    ///         assert_eq!(node, "work");
    ///         parts.push(value["part"].clone());
    ///     }
    /// }
    /// assert_eq!(parts, [json!(1), json!(2), json!(3)]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn emit(&self, value: Value) {
        if let Some(emitter) = &self.emitter {
            emitter.emit(value).await;
        }
    }

    /// Whether [`emit`](Self::emit) reaches a reader: the run is a stream with
    /// [`StreamMode::custom`](crate::StreamMode::custom). A node can skip building what
    /// it would emit when not.
    pub fn emits(&self) -> bool {
        self.emitter.is_some()
    }

    /// The invocation's durability ([`RunConfig::durability`](crate::RunConfig::durability)):
    /// whether the run waits for each step's checkpoint to be stored, so a node can
    /// decide whether its own bookkeeping writes should make the run wait too.
    ///
    /// ```
    /// use keel_graph::{Durability, END, NodeContext, RunConfig, START, State, StateGraph};
    ///
    /// #[derive(Clone, State)]
    /// struct Probe {
    ///     waits: bool,
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Probe>::new()
    ///     .add_node("probe", |_state, ctx: NodeContext| async move {
    ///         Ok(ProbeUpdate::default().waits(ctx.durability() == Durability::Sync))
    ///     })
    ///     .add_edge(START, "probe")
    ///     .add_edge("probe", END)
    ///     .compile()?;
    /// let config = RunConfig::default().with_durability(Durability::Async);
    /// assert!(!graph.invoke(ProbeUpdate::default(), &config).await?.state.waits);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn durability(&self) -> crate::Durability {
        self.invocation.durability
    }

    /// Pauses the thread and asks for a value, or returns the value if the thread was
    /// resumed with [`Command::resume`] or [`Command::resume_each`].
    ///
    /// Propagate the error with `?`: the engine stores the interrupt with the thread's
    /// checkpoint and `invoke` returns with [`crate::Run::interrupts`] set. On resume the
    /// node runs again from its start, and this call returns the answer. A node may
    /// interrupt several times; answers are matched by order. Interrupts need a
    /// checkpointer and a thread id (without them the run fails with
    /// [`GraphError::CheckpointerRequired`](crate::GraphError::CheckpointerRequired)).
    ///
    /// Two parallel approvals, answered one at a time by task id (the answers could
    /// come from another process: the thread is resumed from its checkpointer):
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use keel_graph::checkpoint::MemorySaver;
    /// use keel_graph::reducer::Append;
    /// use keel_graph::{Command, END, NodeContext, RunConfig, START, State, StateGraph};
    /// use serde_json::json;
    ///
    /// #[derive(Clone, State)]
    /// struct Review {
    ///     #[reducer(Append<String>)]
    ///     verdicts: Vec<String>,
    /// }
    ///
    /// let approver = |team: &'static str| {
    ///     move |_state: Arc<Review>, ctx: NodeContext| async move {
    ///         let answer = ctx.interrupt(json!({ "team": team, "question": "approve?" }))?;
    ///         Ok(ReviewUpdate::default().verdicts(vec![format!("{team}: {answer}")]))
    ///     }
    /// };
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Review>::new()
    ///     .add_node("billing", approver("billing"))
    ///     .add_node("tech", approver("tech"))
    ///     .add_edge(START, "billing")
    ///     .add_edge(START, "tech")
    ///     .add_edge("billing", END)
    ///     .add_edge("tech", END)
    ///     .with_checkpointer(Arc::new(MemorySaver::new()))
    ///     .compile()?;
    /// let config = RunConfig::thread("ticket-1");
    ///
    /// let run = graph.invoke(ReviewUpdate::default(), &config).await?;
    /// assert_eq!(run.interrupts.len(), 2);
    /// // Answer billing's only: tech's stays pending, and nothing is applied yet.
    /// let billing = run.interrupts.iter().find(|i| i.node == "billing").map(|i| i.task_id.clone());
    /// let run = graph.invoke(Command::resume_each(billing.map(|id| (id, "yes"))), &config).await?;
    /// assert_eq!(run.interrupts.len(), 1);
    /// assert!(run.state.verdicts.is_empty());
    ///
    /// // Later (here, or in a new process): what is still waiting, and its answer.
    /// let waiting = graph.get_state(&config).await?.map(|s| s.interrupts).unwrap_or_default();
    /// let answers = waiting.iter().map(|i| (i.task_id.clone(), "no"));
    /// let run = graph.invoke(Command::resume_each(answers), &config).await?;
    /// assert!(!run.is_paused());
    /// assert_eq!(run.state.verdicts, ["billing: \"yes\"", "tech: \"no\""]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn interrupt(&self, value: impl Into<Value>) -> Result<Value, NodeError> {
        let i = self
            .interrupts
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match self.resume.get(i) {
            Some(answer) => Ok(answer.clone()),
            None => Err(NodeError::Interrupt(value.into())),
        }
    }
}

/// Per-node execution options, built from `default()` with the setters.
///
/// [`RetryPolicy`] is keel's one retry policy (the same type as model calls and
/// summaries use; re-exported here): `compile` refuses a policy with `max_attempts` 0
/// or a `multiplier` that is not a finite number of at least 1
/// ([`BuildError::InvalidRetryPolicy`](crate::BuildError::InvalidRetryPolicy)). A node
/// without a policy runs once.
///
/// ```
/// use std::time::Duration;
///
/// use keel_graph::{NodeOptions, RetryPolicy};
///
/// let retry = RetryPolicy::default()
///     .max_attempts(5)
///     .initial_backoff(Duration::from_millis(200))
///     .multiplier(3.0)
///     .max_backoff(Duration::from_secs(10));
/// let options = NodeOptions::default()
///     .timeout(Duration::from_secs(60))
///     .retry(retry)
///     .destinations(["review", "publish"]);
/// assert_eq!(options.retry.map(|r| r.max_attempts), Some(5));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct NodeOptions {
    /// Fail the attempt if it takes longer.
    pub timeout: Option<Duration>,
    /// Retry failed attempts: a node's `Err` and a timeout. Not interrupts, and not
    /// panics: a panic is a bug, not a passing failure, and ends the run at once with
    /// [`GraphError::NodePanicked`](crate::GraphError::NodePanicked).
    pub retry: Option<RetryPolicy>,
    /// Where a node that routes itself with [`Command::goto`] may go, for the
    /// reachability check in `compile`.
    pub destinations: Vec<String>,
}

impl NodeOptions {
    /// Sets [`timeout`](Self::timeout): each attempt fails after this long.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sets [`retry`](Self::retry).
    #[must_use]
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }

    /// Sets [`destinations`](Self::destinations): where the node's `goto` may lead.
    #[must_use]
    pub fn destinations<I, N>(mut self, nodes: I) -> Self
    where
        I: IntoIterator<Item = N>,
        N: Into<String>,
    {
        self.destinations = nodes.into_iter().map(Into::into).collect();
        self
    }
}
