//! The `StateGraph` builder and its validation.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use keel_checkpoint::Checkpointer;

use crate::command::{Command, NodeContext, NodeError, NodeOptions, Route};
use crate::engine::{CompiledGraph, Inner};
use crate::{END, START, State};

pub(crate) type NodeFn<S> = Arc<
    dyn Fn(Arc<S>, NodeContext) -> BoxFuture<'static, Result<Command<S>, NodeError>> + Send + Sync,
>;
pub(crate) type RouterFn<S> = Arc<dyn Fn(&S) -> Route + Send + Sync>;

pub(crate) struct NodeSpec<S: State> {
    pub(crate) name: Arc<str>,
    pub(crate) run: NodeFn<S>,
    pub(crate) options: NodeOptions,
}

pub(crate) struct RouterSpec<S: State> {
    pub(crate) route: RouterFn<S>,
    /// Declared targets (for validation); `None` = could be anything.
    pub(crate) targets: Option<Vec<String>>,
}

/// A graph that waits for several nodes before running one.
#[derive(Debug, Clone)]
pub(crate) struct Join {
    pub(crate) sources: Vec<String>,
    pub(crate) target: String,
}

/// Builds a graph over a [`State`]: nodes, edges, joins and routers, then
/// [`StateGraph::compile`] checks it and returns a runnable [`CompiledGraph`].
///
/// ```
/// use keel_graph::{Command, END, START, State, StateGraph};
///
/// #[derive(Clone, Default, State)]
/// struct Counter {
///     #[reducer(keel_graph::reducer::Sum<i64>)]
///     total: i64,
/// }
///
/// # tokio_test_block(async {
/// let graph = StateGraph::<Counter>::new()
///     .add_node("add", |_state, _ctx| async { Ok(CounterUpdate::default().total(2)) })
///     .add_edge(START, "add")
///     .add_edge("add", END)
///     .compile()?;
/// let run = graph.invoke(CounterUpdate::default().total(40), &Default::default()).await?;
/// assert_eq!(run.state.total, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # });
/// # fn tokio_test_block<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// ```
pub struct StateGraph<S: State> {
    nodes: Vec<NodeSpec<S>>,
    edges: Vec<(String, String)>,
    joins: Vec<Join>,
    routers: Vec<(String, RouterSpec<S>)>,
    checkpointer: Option<Arc<dyn Checkpointer>>,
    interrupt_before: Vec<String>,
    interrupt_after: Vec<String>,
    errors: Vec<BuildError>,
}

impl<S: State> Default for StateGraph<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: State> StateGraph<S> {
    /// An empty graph.
    pub fn new() -> Self {
        StateGraph {
            nodes: Vec::new(),
            edges: Vec::new(),
            joins: Vec::new(),
            routers: Vec::new(),
            checkpointer: None,
            interrupt_before: Vec::new(),
            interrupt_after: Vec::new(),
            errors: Vec::new(),
        }
    }

    /// Adds a node: an async function of the state (shared, read-only) and its task
    /// context, returning a [`Command`] (or anything that converts into one, such as
    /// the state's generated update type).
    #[must_use]
    pub fn add_node<F, Fut, R>(self, name: impl Into<String>, node: F) -> Self
    where
        F: Fn(Arc<S>, NodeContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, NodeError>> + Send + 'static,
        R: Into<Command<S>>,
    {
        self.add_node_with(name, NodeOptions::default(), node)
    }

    /// Adds a node with a timeout, a retry policy or declared `goto` destinations.
    #[must_use]
    pub fn add_node_with<F, Fut, R>(
        mut self,
        name: impl Into<String>,
        options: NodeOptions,
        node: F,
    ) -> Self
    where
        F: Fn(Arc<S>, NodeContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, NodeError>> + Send + 'static,
        R: Into<Command<S>>,
    {
        let name = name.into();
        if name == START || name == END {
            self.errors.push(BuildError::ReservedName { name });
            return self;
        }
        if name.trim().is_empty() {
            self.errors.push(BuildError::BlankName { name });
            return self;
        }
        if self.nodes.iter().any(|n| *n.name == *name) {
            self.errors.push(BuildError::DuplicateNode { name });
            return self;
        }
        let run: NodeFn<S> =
            Arc::new(move |state, ctx| node(state, ctx).map(|r| r.map(Into::into)).boxed());
        self.nodes.push(NodeSpec {
            name: name.into(),
            run,
            options,
        });
        self
    }

    /// After `from` finishes, run `to`. `from` may be [`START`], `to` may be [`END`].
    #[must_use]
    pub fn add_edge(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.edges.push((from.into(), to.into()));
        self
    }

    /// Runs `to` once every node in `sources` has finished (in any steps) since `to`
    /// last ran from this join.
    #[must_use]
    pub fn add_join(mut self, sources: &[&str], to: impl Into<String>) -> Self {
        self.joins.push(Join {
            sources: sources.iter().map(|s| (*s).to_owned()).collect(),
            target: to.into(),
        });
        self
    }

    /// After `from` finishes, `router` decides where to go. The router sees the state
    /// with `from`'s own writes of that step applied. `targets` lists every place the
    /// router may send to (checked by `compile`); pass `None` if it can't be listed.
    #[must_use]
    pub fn add_conditional_edges<F, R>(
        mut self,
        from: impl Into<String>,
        router: F,
        targets: Option<&[&str]>,
    ) -> Self
    where
        F: Fn(&S) -> R + Send + Sync + 'static,
        R: Into<Route>,
    {
        let route: RouterFn<S> = Arc::new(move |s| router(s).into());
        self.routers.push((
            from.into(),
            RouterSpec {
                route,
                targets: targets.map(|t| t.iter().map(|s| (*s).to_owned()).collect()),
            },
        ));
        self
    }

    /// Stores a checkpoint after every step (needed for interrupts, resume and time
    /// travel).
    #[must_use]
    pub fn with_checkpointer(mut self, checkpointer: Arc<dyn Checkpointer>) -> Self {
        self.checkpointer = Some(checkpointer);
        self
    }

    /// Pauses the run before these nodes (static breakpoints).
    #[must_use]
    pub fn interrupt_before(mut self, nodes: &[&str]) -> Self {
        self.interrupt_before
            .extend(nodes.iter().map(|s| (*s).to_owned()));
        self
    }

    /// Pauses the run after these nodes.
    #[must_use]
    pub fn interrupt_after(mut self, nodes: &[&str]) -> Self {
        self.interrupt_after
            .extend(nodes.iter().map(|s| (*s).to_owned()));
        self
    }

    /// How many routes leave `node` so far: its edges, its routers (each counts once,
    /// whatever it may return) and the joins it is a source of. A node with two routes
    /// starts both of their targets each time it finishes, as in LangGraph; a builder
    /// that hands its graph to code of its own can check with this that no route was
    /// added where one would run a node twice.
    ///
    /// ```
    /// use keel_graph::{END, START, State, StateGraph};
    ///
    /// #[derive(Clone, Default, State)]
    /// struct Counter {
    ///     total: i64,
    /// }
    ///
    /// let graph = StateGraph::<Counter>::new()
    ///     .add_node("add", |_state, _ctx| async { Ok(CounterUpdate::default().total(2)) })
    ///     .add_edge(START, "add")
    ///     .add_conditional_edges("add", |_s: &Counter| END, Some(&[END]));
    /// assert_eq!(graph.routes_from("add"), 1);
    /// // A second route: both run after `add`.
    /// let graph = graph.add_edge("add", END);
    /// assert_eq!(graph.routes_from("add"), 2);
    /// ```
    pub fn routes_from(&self, node: &str) -> usize {
        self.edges.iter().filter(|(from, _)| from == node).count()
            + self.routers.iter().filter(|(from, _)| from == node).count()
            + self
                .joins
                .iter()
                .filter(|j| j.sources.iter().any(|s| s == node))
                .count()
    }

    /// Checks the graph and makes it runnable.
    ///
    /// Rejects: duplicate, reserved or blank node names, edges or routers that leave
    /// `END` or lead into `START`, edges/joins/routers/breakpoints that name unknown
    /// nodes, breakpoints without a checkpointer, a graph with no edge
    /// from `START`, nodes that cannot reach
    /// `END`, and retry policies with a setting out of range
    /// ([`BuildError::InvalidRetryPolicy`]).
    pub fn compile(self) -> Result<CompiledGraph<S>, BuildError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let index: HashMap<&str, usize> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (&*n.name, i))
            .collect();
        let known_source = |n: &str| n == START || index.contains_key(n);
        let known_target = |n: &str| n == END || index.contains_key(n);
        let unknown = |n: &str, used_in: String| BuildError::UnknownNode {
            name: n.to_owned(),
            used_in,
            nodes: self.nodes.iter().map(|n| n.name.to_string()).collect(),
        };

        let misplaced = |n: &str, used_in: String| BuildError::MisplacedEndpoint {
            name: n.to_owned(),
            used_in,
        };
        for (from, to) in &self.edges {
            let edge = || format!("the edge `{from}` -> `{to}`");
            if from == END {
                return Err(misplaced(from, edge()));
            }
            if to == START {
                return Err(misplaced(to, edge()));
            }
            if !known_source(from) {
                return Err(unknown(from, edge()));
            }
            if !known_target(to) {
                return Err(unknown(to, edge()));
            }
        }
        for j in &self.joins {
            if j.sources.is_empty() {
                return Err(BuildError::EmptyJoin {
                    target: j.target.clone(),
                });
            }
            let join = || format!("the join {:?} -> `{}`", j.sources, j.target);
            if let Some(s) = j.sources.iter().find(|s| !index.contains_key(s.as_str())) {
                return Err(unknown(s, join()));
            }
            if !known_target(&j.target) {
                return Err(unknown(&j.target, join()));
            }
        }
        for (from, r) in &self.routers {
            if from == END {
                return Err(misplaced(
                    from,
                    format!("add_conditional_edges from `{from}`"),
                ));
            }
            if let Some(t) = r.targets.iter().flatten().find(|t| *t == START) {
                return Err(misplaced(
                    t,
                    format!("the targets of the router after `{from}`"),
                ));
            }
            if !known_source(from) {
                return Err(unknown(
                    from,
                    format!("add_conditional_edges from `{from}`"),
                ));
            }
            if let Some(t) = r.targets.iter().flatten().find(|t| !known_target(t)) {
                return Err(unknown(
                    t,
                    format!("the targets of the router after `{from}`"),
                ));
            }
        }
        for n in &self.nodes {
            if let Some(d) = n.options.destinations.iter().find(|d| !known_target(d)) {
                return Err(unknown(d, format!("the destinations of node `{}`", n.name)));
            }
            if let Some(Err(e)) = n.options.retry.as_ref().map(|r| r.validate()) {
                return Err(BuildError::InvalidRetryPolicy {
                    node: n.name.to_string(),
                    setting: e.setting,
                    problem: e.reason,
                });
            }
        }
        for n in &self.interrupt_before {
            if !index.contains_key(n.as_str()) {
                return Err(unknown(n, "interrupt_before".to_owned()));
            }
        }
        for n in &self.interrupt_after {
            if !index.contains_key(n.as_str()) {
                return Err(unknown(n, "interrupt_after".to_owned()));
            }
        }
        if let Some(n) = self
            .interrupt_before
            .iter()
            .chain(&self.interrupt_after)
            .next()
            .filter(|_| self.checkpointer.is_none())
        {
            return Err(BuildError::BreakpointNeedsCheckpointer { node: n.clone() });
        }
        if !self.edges.iter().any(|(f, _)| f == START)
            && !self.routers.iter().any(|(f, _)| f == START)
        {
            return Err(BuildError::NoEntry);
        }

        // Every node must be able to reach END.
        let mut succ: HashMap<&str, BTreeSet<&str>> = HashMap::new();
        let all: Vec<&str> = self.nodes.iter().map(|n| &*n.name).chain([END]).collect();
        for (f, t) in &self.edges {
            succ.entry(f).or_default().insert(t);
        }
        for j in &self.joins {
            for s in &j.sources {
                succ.entry(s).or_default().insert(&j.target);
            }
        }
        for (f, r) in &self.routers {
            let e = succ.entry(f.as_str()).or_default();
            match &r.targets {
                Some(t) => e.extend(t.iter().map(String::as_str)),
                None => e.extend(all.iter().copied()),
            }
        }
        for n in &self.nodes {
            succ.entry(&n.name)
                .or_default()
                .extend(n.options.destinations.iter().map(String::as_str));
        }
        let mut reaches_end: HashSet<&str> = HashSet::from([END]);
        loop {
            let before = reaches_end.len();
            for (n, s) in &succ {
                if s.iter().any(|t| reaches_end.contains(t)) {
                    reaches_end.insert(n);
                }
            }
            if reaches_end.len() == before {
                break;
            }
        }
        if let Some(n) = self.nodes.iter().find(|n| !reaches_end.contains(&*n.name)) {
            return Err(BuildError::CannotReachEnd {
                node: n.name.to_string(),
            });
        }

        Ok(CompiledGraph::new(Inner::new(
            self.nodes,
            self.edges,
            self.joins,
            self.routers,
            self.checkpointer,
            self.interrupt_before,
            self.interrupt_after,
        )?))
    }
}

/// Why a graph does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Two nodes share a name.
    #[error("duplicate node `{name}`")]
    DuplicateNode {
        /// The name.
        name: String,
    },
    /// A node was named `__start__` or `__end__`.
    #[error("`{name}` is reserved")]
    ReservedName {
        /// The name.
        name: String,
    },
    /// A node was named with nothing but whitespace (or nothing at all).
    #[error("a node's name is empty or only whitespace ({name:?})")]
    BlankName {
        /// The name.
        name: String,
    },
    /// An edge or router leaves `END` or leads into `START`: a run enters at `START`
    /// and ends at `END`.
    #[error(
        "{used_in}: a run ends at `{END}` and enters at `{START}`, so no edge leaves the one or leads into the other; `{name}` is misplaced"
    )]
    MisplacedEndpoint {
        /// `START` or `END`.
        name: String,
        /// Where it is named: ``the edge `a` -> `__start__` ``, ...
        used_in: String,
    },
    /// An edge, join, router or breakpoint names a node that does not exist.
    #[error("unknown node `{name}` in {used_in}; the graph's nodes are {nodes:?}")]
    UnknownNode {
        /// The name.
        name: String,
        /// Where it is named: ``the edge `a` -> `b` ``, ``the router after `a` ``, ...
        used_in: String,
        /// The nodes the graph has (besides `START` and `END`), in the order added: a
        /// misspelt name is often here, or in the edges, spelt otherwise.
        nodes: Vec<String>,
    },
    /// A join with no sources.
    #[error("join into `{target}` has no sources")]
    EmptyJoin {
        /// The join's target.
        target: String,
    },
    /// Nothing leaves `START`.
    #[error("no edge from START: the graph has no entry point")]
    NoEntry,
    /// A breakpoint (`interrupt_before`, `interrupt_after`) on a graph without a
    /// checkpointer: a run paused there could not be resumed, as nothing kept it.
    #[error(
        "the breakpoint at `{node}` needs a checkpointer to keep the paused run: call `with_checkpointer` before `compile`"
    )]
    BreakpointNeedsCheckpointer {
        /// A node with a breakpoint.
        node: String,
    },
    /// A node's [`RetryPolicy`](crate::RetryPolicy) has a setting out of range: no
    /// attempt at all (`max_attempts` 0), or a `multiplier` that is not a finite number
    /// of at least 1 (NaN, infinite, negative, zero or shrinking).
    #[error("node `{node}`: retry policy `{setting}` {problem}")]
    InvalidRetryPolicy {
        /// The node.
        node: String,
        /// The setting (a field of `RetryPolicy`).
        setting: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A node from which no path leads to `END`.
    #[error(
        "node `{node}` cannot reach END: give it an edge or a router toward END (a node that routes itself with Command::goto lists where in NodeOptions::destinations)"
    )]
    CannotReachEnd {
        /// The node.
        node: String,
    },
}
