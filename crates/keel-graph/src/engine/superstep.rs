//! Scheduling and running supersteps: the run loop, the tasks of a step and their paths,
//! running a task (timeout, retries, panics), folding a step's updates in task-path
//! order, and routing to the next step.

use super::*;

/// A task scheduled for the next step, as stored in `Checkpoint::pending_sends`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct TaskSpec {
    pub(super) node: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) payload: Option<Value>,
}

/// A task of the current step.
pub(super) struct Task {
    pub(super) node: NodeIx,
    pub(super) path: String,
    pub(super) id: String,
    pub(super) payload: Option<Value>,
}

/// What one finished task produced.
pub(super) enum Outcome<S: State> {
    Done(Command<S>),
    Interrupted(Value),
}

impl<S: State> CompiledGraph<S> {
    pub(super) async fn run(
        &self,
        input: Command<S>,
        config: &RunConfig,
        events: Option<EventSink<S>>,
    ) -> Result<Run<S>, GraphError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(GraphError::NoRuntime);
        }
        let g = &*self.inner;
        if g.checkpointer.is_some() && config.thread_key()?.is_none() {
            return Err(GraphError::NoThreadId);
        }
        let mut run = RunState::load(self, config, events).await?;
        let mut writer = Writer::new(g.checkpointer.clone(), config);
        match self.drive(input, config, &mut run, &mut writer).await {
            Ok(end) => Ok(run.finish(end)),
            Err(e) => {
                // The steps finished before the failure stay stored, whatever the
                // durability: background writes are waited for (a retry then finds
                // them), and with `Exit` the last finished step is stored now, as
                // LangGraph's exit mode does on an error. The run's error wins over
                // one of storing.
                if !matches!(e, GraphError::Checkpoint(_) | GraphError::WriterStopped)
                    && let Err(stored) = writer.flush_after_failure(&mut run).await
                {
                    tracing::warn!(error = %stored, "storing the steps before a failure failed");
                }
                Err(e)
            }
        }
    }

    /// Applies `input` and runs supersteps until the graph ends, pauses, is stopped
    /// or fails; returns how it ended.
    async fn drive(
        &self,
        input: Command<S>,
        config: &RunConfig,
        run: &mut RunState<S>,
        writer: &mut Writer,
    ) -> Result<Ended, GraphError> {
        let g = &*self.inner;
        let mut skip_breakpoint = false;

        if input.is_resume() {
            if input.update.is_some() || !input.goto.is_empty() {
                return Err(GraphError::ResumeWithUpdate);
            }
            let thread = run
                .thread
                .clone()
                .ok_or(GraphError::CheckpointerRequired { what: "resume" })?;
            let tasks = tasks_with_ids(g, &run.tasks, &run.checkpoint.id)?;
            // Before anything is written: a thread this graph cannot run stays as it was.
            run.check_stored_writes()?;
            let names = task_names(&run.tasks, &run.checkpoint.id);
            let interrupted = pending_interrupts(&run.pending, &names);
            if interrupted.is_empty() {
                return Err(GraphError::NoPendingInterrupt {
                    thread_id: thread.thread_id,
                    next: names.into_iter().map(|(_, node)| node).collect(),
                });
            }
            if let Some(unknown) = input
                .resume_each
                .keys()
                .find(|id| !interrupted.iter().any(|i| &i.task_id == *id))
            {
                return Err(GraphError::UnknownInterrupt {
                    thread_id: thread.thread_id,
                    task_id: unknown.clone(),
                    pending: interrupted.iter().map(|i| i.task_id.clone()).collect(),
                });
            }
            let mut writes = Vec::new();
            for i in interrupted {
                // Unanswered, it stays pending: its node asks again.
                let Some(answer) = input.resume_each.get(&i.task_id).or(input.resume.as_ref())
                else {
                    continue;
                };
                let path = tasks
                    .iter()
                    .find(|t| t.id == i.task_id)
                    .map(|t| t.path.clone())
                    .unwrap_or_default();
                // The task's earlier answers again under their own keys, then this one:
                // a node that interrupts several times gets them in order.
                let earlier = resume::task_values(&run.pending, &i.task_id, RESUME);
                for a in earlier.into_iter().chain([answer]) {
                    writes.push(PendingWrite::new(
                        i.task_id.clone(),
                        path.clone(),
                        RESUME,
                        a.clone(),
                    ));
                }
            }
            writer
                .put_writes(&thread, &run.checkpoint.id, writes.clone())
                .await?;
            run.remember(writes);
            skip_breakpoint = true;
        } else if input.update.is_some() || !input.goto.is_empty() {
            // A new run on this thread: apply the input, then start from START.
            let mut per_channel = BTreeMap::new();
            if let Some(update) = input.update {
                let encoded = if writer.stores() {
                    st::encode_update::<S>(&update)?
                } else {
                    Vec::new()
                };
                let written = st::apply(Arc::make_mut(&mut run.state), vec![update])?;
                per_channel = group_by_channel(&written, vec![encoded]);
            }
            let mut next = Vec::new();
            let mut sends = Vec::new();
            let state = Arc::clone(&run.state);
            run.route_from(None, &state, &mut next, &mut sends)?;
            run.goto(START, input.goto, &mut next, &mut sends)?;
            run.tasks = run.specs(next, sends);
            run.pending.clear();
            run.step += 1;
            if writer.stores() {
                run.writers.insert(START.to_owned());
            }
            // As LangGraph's values mode: the state with the input applied comes first
            // (once stored, as every step's events).
            let values = run
                .events
                .as_ref()
                .filter(|s| s.mode.values)
                .map(|_| Event::Values {
                    step: run.step,
                    state: (*run.state).clone(),
                });
            run.persist(writer, CheckpointSource::Input, per_channel)
                .await?;
            run.send_all(values.into_iter().collect()).await?;
        } else {
            run.check_stored_writes()?;
            skip_breakpoint = true;
        }

        let first_step = run.step;
        let mut steps = 0usize;
        while !run.tasks.is_empty() {
            // Between supersteps, everything before stored: the next run starts here.
            if config.stop_requested() {
                writer.flush(run).await?;
                return Ok(Ended::stopped(steps));
            }
            let tasks = tasks_with_ids(g, &run.tasks, &run.checkpoint.id)?;
            if !skip_breakpoint && tasks.iter().any(|t| g.node(t.node).interrupt_before) {
                if run.thread.is_none() {
                    return Err(GraphError::CheckpointerRequired {
                        what: "a breakpoint (interrupt_before)",
                    });
                }
                writer.flush(run).await?;
                return Ok(Ended::paused(Vec::new(), steps));
            }
            skip_breakpoint = false;
            if run.step - first_step >= i64::try_from(config.recursion_limit).unwrap_or(i64::MAX) {
                return Err(GraphError::RecursionLimit {
                    limit: config.recursion_limit,
                    step: run.step + 1,
                });
            }

            let outcomes = run.execute(&tasks, writer).await?;
            let interrupts: Vec<Interrupt> = tasks
                .iter()
                .zip(&outcomes)
                .filter_map(|(t, o)| match o {
                    Outcome::Interrupted(v) => Some(Interrupt {
                        node: g.name(t.node).to_string(),
                        task_id: t.id.clone(),
                        value: v.clone(),
                    }),
                    Outcome::Done(_) => None,
                })
                .collect();
            if !interrupts.is_empty() {
                if run.thread.is_none() || g.checkpointer.is_none() {
                    return Err(GraphError::CheckpointerRequired { what: "interrupt" });
                }
                writer.flush(run).await?;
                return Ok(Ended::paused(interrupts, steps));
            }
            run.step += 1;
            steps += 1;
            let commands: Vec<Command<S>> = outcomes
                .into_iter()
                .filter_map(|o| match o {
                    Outcome::Done(c) => Some(c),
                    Outcome::Interrupted(_) => None,
                })
                .collect();
            run.advance(&tasks, commands, writer).await?;
            if tasks.iter().any(|t| g.node(t.node).interrupt_after) && !run.tasks.is_empty() {
                if run.thread.is_none() {
                    return Err(GraphError::CheckpointerRequired {
                        what: "a breakpoint (interrupt_after)",
                    });
                }
                writer.flush(run).await?;
                return Ok(Ended::paused(Vec::new(), steps));
            }
        }
        writer.flush(run).await?;
        Ok(Ended::paused(Vec::new(), steps))
    }
}

/// How [`CompiledGraph::drive`] ended, when it did not fail.
pub(super) struct Ended {
    /// Pending interrupts.
    interrupts: Vec<Interrupt>,
    /// Supersteps run.
    steps: usize,
    /// Ended by a raised stop signal.
    stopped: bool,
}

impl Ended {
    /// At `END`, an interrupt or a breakpoint.
    fn paused(interrupts: Vec<Interrupt>, steps: usize) -> Self {
        Ended {
            interrupts,
            steps,
            stopped: false,
        }
    }

    /// By a raised stop signal.
    fn stopped(steps: usize) -> Self {
        Ended {
            interrupts: Vec::new(),
            steps,
            stopped: true,
        }
    }
}

/// The mutable state of one invocation.
pub(super) struct RunState<S: State> {
    pub(super) graph: Arc<Inner<S>>,
    pub(super) state: Arc<S>,
    /// The latest checkpoint of this run (stored, or in memory when not storing).
    pub(super) checkpoint: Checkpoint,
    pub(super) step: i64,
    pub(super) thread: Option<ThreadKey>,
    /// The thread's newest stored checkpoint (for fencing).
    pub(super) head: Option<CheckpointId>,
    /// The newest checkpoint this run stored.
    pub(super) stored: Option<CheckpointId>,
    pub(super) tasks: Vec<TaskSpec>,
    pub(super) pending: Vec<PendingWrite>,
    pub(super) books: Vec<ChannelBook>,
    /// Channels written since the last stored checkpoint (exit durability).
    pub(super) dirty: BTreeSet<usize>,
    /// Steps run since the last stored checkpoint (exit durability).
    pub(super) steps_since_store: usize,
    /// The nodes that wrote the steps since the last stored checkpoint: the next
    /// checkpoint's `writes` metadata.
    pub(super) writers: BTreeSet<String>,
    pub(super) joins_seen: Vec<BTreeSet<NodeIx>>,
    pub(super) metadata: serde_json::Map<String, Value>,
    /// What every task's [`NodeContext`] shares about this invocation.
    pub(super) invocation: Arc<InvocationInfo>,
    pub(super) events: Option<EventSink<S>>,
}

impl<S: State> RunState<S> {
    /// Adds stored writes to what this run knows, as the saver keeps them: a write to
    /// a special channel (interrupts, answers) replaces the task's earlier ones there,
    /// which the new writes list again.
    pub(super) fn remember(&mut self, writes: Vec<PendingWrite>) {
        self.pending.retain(|old| {
            !(old.is_special()
                && writes
                    .iter()
                    .any(|w| w.task_id == old.task_id && w.channel == old.channel))
        });
        self.pending.extend(writes);
    }

    pub(super) fn specs(&self, next: Vec<NodeIx>, sends: Vec<TaskSpec>) -> Vec<TaskSpec> {
        next.into_iter()
            .map(|n| TaskSpec {
                node: self.graph.name(n).to_string(),
                payload: None,
            })
            .chain(sends)
            .collect()
    }

    /// Adds the targets of `source`'s static edges and routers (evaluated on `state`);
    /// `None` is `START`.
    pub(super) fn route_from(
        &mut self,
        source: Option<NodeIx>,
        state: &S,
        next: &mut Vec<NodeIx>,
        sends: &mut Vec<TaskSpec>,
    ) -> Result<(), GraphError> {
        let g = Arc::clone(&self.graph);
        let (out, from) = g.outgoing(source);
        for t in &out.edges {
            if let Target::Node(n) = t {
                push_unique(next, *n);
            }
        }
        for r in &out.routers {
            // A router is the caller's code, as a node is: its panic is an error of the
            // run, not an unwind through the caller.
            let route = std::panic::catch_unwind(AssertUnwindSafe(|| (r.route)(state))).map_err(
                |panic| GraphError::RouterPanicked {
                    from: from.to_owned(),
                    message: panic_message(panic.as_ref()),
                },
            )?;
            if let Some(declared) = &r.targets {
                let undeclared = route.0.iter().find_map(|g| {
                    let name = match g {
                        Goto::Node(n) => n,
                        Goto::Send(s) => &s.node,
                    };
                    (!declared.contains(name)).then(|| name.clone())
                });
                if let Some(to) = undeclared {
                    return Err(GraphError::UndeclaredTarget {
                        from: from.to_owned(),
                        to,
                        declared: declared.clone(),
                    });
                }
            }
            self.goto(from, route.0, next, sends)?;
        }
        Ok(())
    }

    pub(super) fn goto(
        &self,
        from: &str,
        targets: Vec<Goto>,
        next: &mut Vec<NodeIx>,
        sends: &mut Vec<TaskSpec>,
    ) -> Result<(), GraphError> {
        for t in targets {
            let (name, payload) = match t {
                Goto::Node(n) => (n, None),
                Goto::Send(s) => (s.node, Some(s.payload)),
            };
            if name == END {
                continue;
            }
            let Some(&n) = self.graph.index.get(&name) else {
                return Err(GraphError::UnknownTarget {
                    from: from.to_owned(),
                    to: name,
                });
            };
            match payload {
                None => push_unique(next, n),
                Some(p) => sends.push(TaskSpec {
                    node: name,
                    payload: Some(p),
                }),
            }
        }
        Ok(())
    }

    /// Runs the step's tasks concurrently. Tasks whose writes are already stored (from
    /// an earlier attempt at this step) are not run again.
    pub(super) async fn execute(
        &mut self,
        tasks: &[Task],
        writer: &mut Writer,
    ) -> Result<Vec<Outcome<S>>, GraphError> {
        let mut outcomes: Vec<Option<Outcome<S>>> = Vec::with_capacity(tasks.len());
        let mut to_run: Vec<(usize, &Task)> = Vec::new();
        for (i, t) in tasks.iter().enumerate() {
            let stored = self.stored_outcome(t)?;
            if stored.is_none() {
                to_run.push((i, t));
            }
            outcomes.push(stored);
        }
        let g = Arc::clone(&self.graph);
        let make = |i: usize, t: &Task| {
            let resume: Vec<Value> = resume::task_values(&self.pending, &t.id, RESUME)
                .into_iter()
                .cloned()
                .collect();
            let emitter = self
                .events
                .as_ref()
                .and_then(|e| e.emitter(Arc::clone(g.name(t.node)), self.step + 1));
            let ctx = NodeContext {
                node: Arc::clone(g.name(t.node)),
                step: self.step + 1,
                emitter,
                task_id: t.id.as_str().into(),
                payload: t.payload.clone(),
                resume: Arc::new(resume),
                interrupts: Arc::new(AtomicUsize::new(0)),
                invocation: Arc::clone(&self.invocation),
            };
            let g = Arc::clone(&g);
            let state = Arc::clone(&self.state);
            let node = t.node;
            async move { (i, run_task(&g.node(node).spec, state, ctx).await) }
        };

        let single = to_run.len() == 1;
        let results: Vec<(usize, Result<Outcome<S>, GraphError>)> = match to_run.as_slice() {
            [(i, t)] => vec![make(*i, t).await],
            _ => {
                let mut set = tokio::task::JoinSet::new();
                for (i, t) in &to_run {
                    set.spawn(make(*i, t));
                }
                let mut results = Vec::with_capacity(to_run.len());
                while let Some(joined) = set.join_next().await {
                    match joined {
                        Ok((i, r)) => {
                            // Store finished work at once: a crash later in the step
                            // does not lose it.
                            let writes = match (&r, &self.thread, tasks.get(i)) {
                                (Ok(o), Some(_), Some(t)) => Some(self.task_writes(t, o)?),
                                _ => None,
                            };
                            if let (Some(writes), Some(thread)) = (writes, self.thread.clone()) {
                                writer
                                    .put_writes(&thread, &self.checkpoint.id, writes.clone())
                                    .await?;
                                self.remember(writes);
                            }
                            results.push((i, r));
                        }
                        // Panics are caught inside the task; a join error means the
                        // task was aborted.
                        Err(_) => results.push((usize::MAX, Err(GraphError::Cancelled))),
                    }
                }
                results
            }
        };
        let mut first_error = None;
        for (i, r) in results {
            match r {
                Ok(o) => {
                    // A lone task's writes go with the step's checkpoint right after;
                    // only an interrupt must be stored on its own.
                    let writes = match (&o, &self.thread, tasks.get(i)) {
                        (Outcome::Interrupted(_), Some(_), Some(t)) if single => {
                            Some(self.task_writes(t, &o)?)
                        }
                        _ => None,
                    };
                    if let (Some(writes), Some(thread)) = (writes, self.thread.clone()) {
                        writer
                            .put_writes(&thread, &self.checkpoint.id, writes.clone())
                            .await?;
                        self.remember(writes);
                    }
                    if let Some(slot) = outcomes.get_mut(i) {
                        *slot = Some(o);
                    }
                }
                Err(e) => {
                    if let (Some(thread), Some(t)) = (self.thread.clone(), tasks.get(i)) {
                        let w = PendingWrite::new(
                            t.id.clone(),
                            t.path.clone(),
                            ERROR,
                            Value::String(e.to_string()),
                        );
                        writer
                            .put_writes(&thread, &self.checkpoint.id, vec![w.clone()])
                            .await?;
                        // With `Exit`, stored as the run ends, with its checkpoint.
                        self.remember(vec![w]);
                    }
                    if first_error.as_ref().is_none_or(|(j, _)| i < *j) {
                        first_error = Some((i, e));
                    }
                }
            }
        }
        if let Some((_, e)) = first_error {
            return Err(e);
        }
        Ok(outcomes.into_iter().flatten().collect())
    }
}

impl<S: State> RunState<S> {
    /// Applies the step's updates in task-path order, schedules the next tasks and
    /// checkpoints the step.
    pub(super) async fn advance(
        &mut self,
        tasks: &[Task],
        commands: Vec<Command<S>>,
        writer: &mut Writer,
    ) -> Result<(), GraphError> {
        let g = Arc::clone(&self.graph);
        let multi = tasks.len() > 1;
        let needs_local = multi && tasks.iter().any(|t| !g.node(t.node).out.routers.is_empty());
        // Each router of a several-task step sees the state before the step with only
        // its own node's writes: one copy of that state, which each router's writes go
        // into and come back out of (see `LocalView`).
        let mut before = if needs_local {
            Some(LocalView::new((*self.state).clone()))
        } else {
            None
        };

        let encode =
            writer.stores() || needs_local || self.events.as_ref().is_some_and(|e| e.mode.updates);
        let mut encoded = Vec::with_capacity(commands.len());
        let mut updates = Vec::with_capacity(commands.len());
        let mut gotos = Vec::with_capacity(commands.len());
        for c in commands {
            let u = c.update.unwrap_or_default();
            encoded.push(if encode {
                st::encode_update::<S>(&u)?
            } else {
                Vec::new()
            });
            updates.push(u);
            gotos.push(c.goto);
        }
        let written = st::apply(Arc::make_mut(&mut self.state), updates)?;

        let mut next = Vec::new();
        let mut sends = Vec::new();
        let state = Arc::clone(&self.state);
        for ((t, goto), enc) in tasks.iter().zip(gotos).zip(&encoded) {
            let node = g.node(t.node);
            if !node.out.routers.is_empty() {
                match &mut before {
                    Some(before) => {
                        before.with_writes(enc, |local| {
                            self.route_from(Some(t.node), local, &mut next, &mut sends)
                        })?;
                    }
                    None => self.route_from(Some(t.node), &state, &mut next, &mut sends)?,
                }
            } else {
                self.route_from(Some(t.node), &state, &mut next, &mut sends)?;
            }
            self.goto(&node.spec.name, goto, &mut next, &mut sends)?;
            for (join, seen) in g.joins.iter().zip(self.joins_seen.iter_mut()) {
                if join.sources.contains(&t.node) {
                    seen.insert(t.node);
                }
            }
        }
        for (join, seen) in g.joins.iter().zip(self.joins_seen.iter_mut()) {
            if join.sources.iter().all(|s| seen.contains(s)) {
                seen.clear();
                if let Target::Node(n) = join.target {
                    push_unique(&mut next, n);
                }
            }
        }
        self.tasks = self.specs(next, sends);
        self.pending.clear();

        let mut events = Vec::new();
        if let Some(sink) = &self.events {
            if sink.mode.updates {
                for (t, enc) in tasks.iter().zip(&encoded) {
                    let update = enc
                        .iter()
                        .map(|(c, v)| {
                            Ok((channel_name::<S>(*c, "State::encode_update")?, v.clone()))
                        })
                        .collect::<Result<_, StateError>>()?;
                    events.push(Event::Updates {
                        step: self.step,
                        node: g.name(t.node).to_string(),
                        update,
                    });
                }
            }
            if sink.mode.values {
                events.push(Event::Values {
                    step: self.step,
                    state: (*self.state).clone(),
                });
            }
        }
        if writer.stores() {
            self.writers
                .extend(tasks.iter().map(|t| g.name(t.node).to_string()));
        }
        let per_channel = group_by_channel(&written, encoded);
        self.persist(writer, CheckpointSource::Loop, per_channel)
            .await?;
        // Only once the step is stored (queued, with async durability): a reader that
        // stops at a step's updates, or a run whose store is refused, never shows a
        // step the thread does not have.
        self.send_all(events).await
    }

    /// Sends `events` to the run's stream, in order.
    pub(super) async fn send_all(&self, events: Vec<Event<S>>) -> Result<(), GraphError> {
        if let Some(sink) = &self.events {
            for e in events {
                sink.send(e).await?;
            }
        }
        Ok(())
    }
}

impl<S: State> RunState<S> {
    pub(super) fn finish(self, end: Ended) -> Run<S> {
        let state = Arc::try_unwrap(self.state).unwrap_or_else(|a| (*a).clone());
        Run {
            state,
            interrupts: end.interrupts,
            next: self.tasks.iter().map(|t| t.node.clone()).collect(),
            checkpoint_id: self.stored,
            steps: end.steps,
            stopped: end.stopped,
        }
    }
}

/// The message a panic carries (`panic!("...")` gives a `&str` or a `String`).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned())
}

/// Runs one task with its timeout and retry policy.
pub(super) async fn run_task<S: State>(
    node: &NodeSpec<S>,
    state: Arc<S>,
    ctx: NodeContext,
) -> Result<Outcome<S>, GraphError> {
    let policy = node
        .options
        .retry
        .clone()
        .unwrap_or_else(crate::RetryPolicy::none);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let mut ctx = ctx.clone();
        ctx.interrupts = Arc::new(AtomicUsize::new(0));
        let fut = AssertUnwindSafe((node.run)(Arc::clone(&state), ctx)).catch_unwind();
        let result = match node.options.timeout {
            None => Some(fut.await),
            Some(d) => tokio::time::timeout(d, fut).await.ok(),
        };
        let error = match result {
            Some(Ok(Ok(c))) => return Ok(Outcome::Done(c)),
            Some(Ok(Err(NodeError::Interrupt(v)))) => return Ok(Outcome::Interrupted(v)),
            Some(Ok(Err(NodeError::Failed(e)))) => GraphError::Node {
                node: node.name.to_string(),
                source: e,
            },
            Some(Err(panic)) => {
                return Err(GraphError::NodePanicked {
                    node: node.name.to_string(),
                    message: panic_message(panic.as_ref()),
                });
            }
            None => GraphError::NodeTimeout {
                node: node.name.to_string(),
                after: node.options.timeout.unwrap_or_default(),
            },
        };
        if attempt >= policy.max_attempts.max(1) {
            return Err(error);
        }
        tracing::warn!(node = %node.name, attempt, error = %error, "node failed; retrying");
        tokio::time::sleep(policy.delay(attempt - 1)).await;
    }
}

/// The state before a step, lent to each router of the step with only its own node's
/// writes applied.
///
/// With a state that copies single channels (`State::clone_channel_from` and
/// `swap_channel`, which `#[derive(State)]` implements) a router costs a copy of the
/// channels its node wrote: they are saved, the writes applied, the router run, and the
/// saved values swapped back. Otherwise each router gets a copy of the whole state.
pub(super) struct LocalView<S: State> {
    pub(super) state: S,
    /// Holds the saved channels while a router runs (its other channels stay empty).
    pub(super) saved: S,
}

impl<S: State> LocalView<S> {
    pub(super) fn new(state: S) -> Self {
        LocalView {
            state,
            saved: S::empty(),
        }
    }

    /// Runs `f` on the state with `writes` (one task's encoded update) applied.
    pub(super) fn with_writes<T>(
        &mut self,
        writes: &[(usize, Value)],
        f: impl FnOnce(&S) -> Result<T, GraphError>,
    ) -> Result<T, GraphError> {
        if writes.is_empty() {
            return f(&self.state);
        }
        let mut channels: Vec<usize> = writes.iter().map(|(c, _)| *c).collect();
        channels.sort_unstable();
        channels.dedup();
        let update = S::decode_update(writes)?;
        let copied = channels
            .iter()
            .all(|&c| self.saved.clone_channel_from(&self.state, c));
        if !copied {
            let mut local = self.state.clone();
            st::apply(&mut local, vec![update])?;
            return f(&local);
        }
        // On an error the step fails and this view is dropped: no need to restore.
        st::apply(&mut self.state, vec![update])?;
        let result = f(&self.state);
        for &c in &channels {
            if !self.state.swap_channel(&mut self.saved, c) {
                self.state.clone_channel_from(&self.saved, c);
            }
        }
        result
    }
}

pub(super) fn push_unique(v: &mut Vec<NodeIx>, n: NodeIx) {
    if !v.contains(&n) {
        v.push(n);
    }
}

/// A scheduled task's path: `pull:<node>`, or `push:<n>:<node>` for the `n`-th
/// scheduled task when it comes from a `SendTo`.
pub(super) fn task_path(i: usize, spec: &TaskSpec) -> String {
    match &spec.payload {
        None => format!("pull:{}", spec.node),
        Some(_) => format!("push:{i:08}:{}", spec.node),
    }
}

/// Gives each scheduled task its node, path and id, sorted by path. Pull tasks
/// (`pull:<node>`) sort by node name before push tasks (`push:<n>:<node>`, one per
/// `SendTo`, in the order sent). The id is derived from the checkpoint and the path, so it
/// is the same when a crashed step is run again. A task for a node this graph does not
/// have is [`GraphError::UnknownNode`].
pub(super) fn tasks_with_ids<S: State>(
    g: &Inner<S>,
    specs: &[TaskSpec],
    checkpoint: &CheckpointId,
) -> Result<Vec<Task>, GraphError> {
    let mut tasks = specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let node = *g
                .index
                .get(&s.node)
                .ok_or_else(|| GraphError::UnknownNode {
                    node: s.node.clone(),
                    checkpoint: checkpoint.clone(),
                })?;
            let path = task_path(i, s);
            Ok(Task {
                node,
                id: format!("{checkpoint}:{path}"),
                path,
                payload: s.payload.clone(),
            })
        })
        .collect::<Result<Vec<_>, GraphError>>()?;
    tasks.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(tasks)
}
