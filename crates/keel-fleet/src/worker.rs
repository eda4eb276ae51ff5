//! Workers: claim runs, hold their leases, run their threads with an agent.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_agent::{Agent, AgentBuilder, AgentError, AgentInput, AgentRun};
use keel_checkpoint::Checkpointer;
use keel_graph::{Durability, GraphError, RunConfig};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::error::FleetError;
use crate::fence::{Fence, RunCtl, StopReason, is_refusal};
use crate::input::RunInput;
use crate::queue::{Claimed, Queue, Renewal, RunId, RunResult};

/// The default lease: a worker that stops renewing loses its runs this long after its
/// last renewal.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default interval between lease renewals (each also reads the cancel flag).
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(2);
/// The longest lease a worker takes: a silent worker's runs wait at most this long
/// for another worker. (Far longer leases do not fit the database's time arithmetic,
/// and every claim would fail.)
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 60 * 60);
/// The default wait before claiming again when the queue had nothing to claim.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(250);
/// How often a run is retried in one claim when another writer moved its thread's
/// head while this worker still held the lease (a late write of a worker that lost it).
const MAX_CONFLICT_RETRIES: u32 = 3;

/// What a worker did, returned when it stops.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct WorkerReport {
    /// Runs claimed (takeovers included).
    pub claimed: usize,
    /// Of those, runs taken over from a worker whose lease had lapsed (it died, hung,
    /// or lost the database).
    pub taken_over: usize,
    /// Runs this worker finished.
    pub done: usize,
    /// Runs it failed (an agent error, an input that does not decode).
    pub failed: usize,
    /// Runs it stopped because they were cancelled.
    pub cancelled: usize,
    /// Runs it put back in the queue when it shut down.
    pub released: usize,
    /// Runs it stopped without marking them because their lease was no longer its own
    /// (another worker took them over).
    pub superseded: usize,
    /// Checkpoint writes the checkpointer refused as stale (fencing).
    pub conflicts: usize,
    /// Supersteps its runs made.
    pub supersteps: u64,
    /// How long each successful claim took (the claim statements' round trips).
    pub claim_latencies: Vec<Duration>,
}

impl WorkerReport {
    fn merge(&mut self, other: WorkerReport) {
        self.claimed += other.claimed;
        self.taken_over += other.taken_over;
        self.done += other.done;
        self.failed += other.failed;
        self.cancelled += other.cancelled;
        self.released += other.released;
        self.superseded += other.superseded;
        self.conflicts += other.conflicts;
        self.supersteps += other.supersteps;
        self.claim_latencies.extend(other.claim_latencies);
    }
}

/// How a run a worker claimed ended, as given to [`WorkerBuilder::on_run_end`].
#[derive(Debug)]
#[non_exhaustive]
pub struct RunEnd<'a> {
    /// The run.
    pub run: RunId,
    /// Its thread.
    pub thread: &'a str,
    /// How it ended.
    pub outcome: RunOutcome<'a>,
}

/// How a run ended on a worker ([`RunEnd::outcome`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum RunOutcome<'a> {
    /// The agent finished the run (an answer, an interrupt or a resumable stop).
    Done(&'a AgentRun),
    /// The run failed; `error` is what the queue stores.
    Failed {
        /// The text the queue stores.
        error: &'a str,
        /// The agent's error, when the agent failed the run (match on
        /// [`AgentError::model_error`] to say what to fix).
        agent: Option<&'a AgentError>,
    },
    /// The run was cancelled (it stopped at a step boundary).
    Cancelled,
    /// The worker shut down and put the run back in the queue.
    Released,
    /// The run's lease is another worker's now; this worker left the run alone.
    Superseded,
}

/// A callback given each run's end.
type OnRunEnd = Arc<dyn Fn(&RunEnd<'_>) + Send + Sync>;

/// A slot's claims started failing or work again, as given to
/// [`WorkerBuilder::on_claim_trouble`].
#[derive(Debug)]
#[non_exhaustive]
pub enum ClaimTrouble<'a> {
    /// A claim failed after the last one worked (the database cannot be reached, or a
    /// query failed); the slot retries, waiting up to 5 s between tries.
    Failing {
        /// The slot (`name/0`, ...).
        slot: &'a str,
        /// Why the claim failed.
        error: &'a FleetError,
    },
    /// A claim worked again after failing.
    Recovered {
        /// The slot.
        slot: &'a str,
    },
}

/// A callback given each change in a slot's claims.
type OnClaimTrouble = Arc<dyn Fn(&ClaimTrouble<'_>) + Send + Sync>;

/// Builds a [`Worker`].
#[must_use]
pub struct WorkerBuilder {
    queue: Queue,
    checkpointer: Arc<dyn Checkpointer>,
    agent: Option<AgentBuilder>,
    name: Option<String>,
    concurrency: usize,
    lease: Duration,
    heartbeat: Duration,
    poll_interval: Duration,
    on_run_end: Option<OnRunEnd>,
    on_claim_trouble: Option<OnClaimTrouble>,
}

impl std::fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("queue", &self.queue)
            .field("name", &self.name)
            .field("concurrency", &self.concurrency)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    /// The agent the worker runs threads with (required). The worker gives it the
    /// checkpointer (through its gate) and `Durability::Sync`; everything else (model,
    /// tools, offload store, compaction) is the builder's. Give it an offload store
    /// every worker shares (keel-offload's `PostgresStore` in the same database), so a
    /// thread compacted on one worker reads its archive on another.
    pub fn agent(mut self, agent: AgentBuilder) -> Self {
        self.agent = Some(agent);
        self
    }

    /// The worker's name in run statuses (default: host name and process id); slots
    /// are `name/0`, `name/1`, ...
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Runs held at once (default 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// The lease (default 30 s): how long after its last renewal a silent worker's runs
    /// can be taken over. Measured by the database's clock. From 100 ms to
    /// [`MAX_LEASE`] (a day); [`build`](Self::build) refuses others.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Time between renewals (default 2 s); each also reads the cancel flag, so it
    /// bounds how long a cancel takes to be seen. Must be under four fifths of the
    /// lease.
    pub fn heartbeat(mut self, heartbeat: Duration) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// The wait before claiming again after an empty claim (default 250 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Called as each run this worker claimed ends, after the queue recorded it (for
    /// a superseded run, when the worker let it go): a place to log it, count it or
    /// tell someone. Keep it short; it runs on the worker's slot.
    ///
    /// ```
    /// # fn doc(queue: keel_fleet::Queue, saver: std::sync::Arc<dyn keel_checkpoint::Checkpointer>) {
    /// use keel_fleet::{RunOutcome, Worker};
    /// let builder = Worker::builder(queue, saver).on_run_end(|end| match &end.outcome {
    ///     RunOutcome::Failed { error, .. } => eprintln!("run {} failed: {error}", end.run),
    ///     other => eprintln!("run {} of {}: {other:?}", end.run, end.thread),
    /// });
    /// # }
    /// ```
    pub fn on_run_end(mut self, f: impl Fn(&RunEnd<'_>) + Send + Sync + 'static) -> Self {
        self.on_run_end = Some(Arc::new(f));
        self
    }

    /// Called when a slot's claims start failing (once, however long they keep
    /// failing) and when they work again: without it a worker whose database went
    /// away only logs each failure (`tracing`, warn level) and otherwise looks idle.
    ///
    /// ```
    /// # fn doc(queue: keel_fleet::Queue, saver: std::sync::Arc<dyn keel_checkpoint::Checkpointer>) {
    /// use keel_fleet::{ClaimTrouble, Worker};
    /// let builder = Worker::builder(queue, saver).on_claim_trouble(|t| match t {
    ///     ClaimTrouble::Failing { slot, error } => eprintln!("{slot}: cannot claim: {error}"),
    ///     other => eprintln!("{other:?}"),
    /// });
    /// # }
    /// ```
    pub fn on_claim_trouble(
        mut self,
        f: impl Fn(&ClaimTrouble<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.on_claim_trouble = Some(Arc::new(f));
        self
    }

    /// Builds the worker and its agent.
    pub fn build(self) -> Result<Worker, FleetError> {
        let builder = self.agent.ok_or(FleetError::NoAgent)?;
        if self.lease < Duration::from_millis(100) {
            return Err(FleetError::Config {
                reason: format!("a lease of {:?} is too short (at least 100 ms)", self.lease),
            });
        }
        if self.lease > MAX_LEASE {
            return Err(FleetError::Config {
                reason: format!(
                    "a lease of {:?} is too long (at most {:?}, a day)",
                    self.lease, MAX_LEASE
                ),
            });
        }
        if self.heartbeat.is_zero() || self.heartbeat >= self.lease - margin(self.lease) {
            return Err(FleetError::Config {
                reason: format!(
                    "the heartbeat ({:?}) must be positive and under four fifths of the lease ({:?})",
                    self.heartbeat, self.lease
                ),
            });
        }
        let fence = Arc::new(Fence::new(self.checkpointer));
        let gate: Arc<dyn Checkpointer> = fence.clone();
        let agent = builder
            .checkpointer(gate)
            .durability(Durability::Sync)
            .build()?;
        Ok(Worker {
            inner: Arc::new(WorkerInner {
                queue: self.queue,
                fence,
                agent,
                name: self.name.unwrap_or_else(default_name),
                concurrency: self.concurrency,
                lease: self.lease,
                heartbeat: self.heartbeat,
                poll_interval: self.poll_interval,
                on_run_end: self.on_run_end,
                on_claim_trouble: self.on_claim_trouble,
            }),
        })
    }
}

/// A worker: `concurrency` slots, each claiming a run, holding its lease and running
/// its thread from the thread's last checkpoint with the worker's agent.
///
/// A run's steps go through the worker's gate in front of the checkpointer: it refuses
/// a step once the lease may have ended (renewals are measured with the monotonic
/// clock, from before each renewal was sent), and at a cancel it lets the step in
/// progress finish only if it is not a model reply, so a stopped thread never ends
/// on tool calls without results.
#[derive(Clone)]
pub struct Worker {
    inner: Arc<WorkerInner>,
}

struct WorkerInner {
    queue: Queue,
    fence: Arc<Fence>,
    agent: Agent,
    name: String,
    concurrency: usize,
    lease: Duration,
    heartbeat: Duration,
    poll_interval: Duration,
    on_run_end: Option<OnRunEnd>,
    on_claim_trouble: Option<OnClaimTrouble>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.inner.name)
            .field("concurrency", &self.inner.concurrency)
            .finish_non_exhaustive()
    }
}

/// How a run's execution ended, before the queue is told.
enum Outcome {
    Finished(Box<AgentRun>),
    Failed(String, Option<AgentError>),
    Stopped(StopReason),
    /// The lease is not ours any more: leave the run alone.
    Superseded,
}

impl Worker {
    /// A builder over the queue and the checkpointer the agent's threads live in
    /// (keel-checkpoint-postgres's `PostgresSaver` on the same database, for a fleet).
    pub fn builder(queue: Queue, checkpointer: Arc<dyn Checkpointer>) -> WorkerBuilder {
        WorkerBuilder {
            queue,
            checkpointer,
            agent: None,
            name: None,
            concurrency: 1,
            lease: DEFAULT_LEASE,
            heartbeat: DEFAULT_HEARTBEAT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            on_run_end: None,
            on_claim_trouble: None,
        }
    }

    /// The agent (to read a thread's state).
    pub fn agent(&self) -> &Agent {
        &self.inner.agent
    }

    /// The worker's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Runs until `shutdown` completes, then stops: no new claims; each run held stops
    /// at its next step boundary and goes back to the queue (another worker continues
    /// it from its last checkpoint). Fails at once, claiming nothing, when the queue's
    /// schema is not this build's version ([`Queue::check`]).
    ///
    /// Dropping the future stops everything at once, as a killed process would: the
    /// leases expire and other workers take the runs over.
    pub async fn run(
        &self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<WorkerReport, FleetError> {
        self.inner.queue.check().await?;
        let (tx, rx) = watch::channel(false);
        let mut slots = self.spawn_slots(&rx, false);
        tokio::pin!(shutdown);
        let mut report = WorkerReport::default();
        let mut signalled = false;
        loop {
            tokio::select! {
                () = &mut shutdown, if !signalled => {
                    signalled = true;
                    let _ = tx.send(true);
                }
                joined = slots.join_next() => match joined {
                    Some(Ok(r)) => report.merge(r),
                    Some(Err(e)) => tracing::error!(error = %e, "a worker slot ended abnormally"),
                    None => break,
                },
            }
        }
        Ok(report)
    }

    /// Runs until every slot finds nothing to claim, then returns (a batch worker; runs
    /// still queued behind other workers' runs are left for later).
    pub async fn run_until_idle(&self) -> Result<WorkerReport, FleetError> {
        self.inner.queue.check().await?;
        let (_tx, rx) = watch::channel(false);
        let mut slots = self.spawn_slots(&rx, true);
        let mut report = WorkerReport::default();
        while let Some(joined) = slots.join_next().await {
            match joined {
                Ok(r) => report.merge(r),
                Err(e) => tracing::error!(error = %e, "a worker slot ended abnormally"),
            }
        }
        Ok(report)
    }

    fn spawn_slots(
        &self,
        shutdown: &watch::Receiver<bool>,
        until_idle: bool,
    ) -> JoinSet<WorkerReport> {
        let mut slots = JoinSet::new();
        for i in 0..self.inner.concurrency {
            let worker = self.clone();
            let shutdown = shutdown.clone();
            let name = format!("{}/{i}", self.inner.name);
            slots.spawn(async move { worker.slot(name, shutdown, until_idle).await });
        }
        slots
    }

    /// One slot: claim, run, repeat.
    async fn slot(
        &self,
        name: String,
        mut shutdown: watch::Receiver<bool>,
        until_idle: bool,
    ) -> WorkerReport {
        let w = &*self.inner;
        let mut report = WorkerReport::default();
        let mut backoff = w.poll_interval;
        let mut failing = false;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let started = Instant::now();
            let claim = w.queue.claim(&name, w.lease).await;
            if claim.is_ok() && failing {
                failing = false;
                tracing::info!(slot = %name, "claiming works again");
                if let Some(f) = &w.on_claim_trouble {
                    f(&ClaimTrouble::Recovered { slot: &name });
                }
            }
            match claim {
                Ok(Some(claimed)) => {
                    report.claim_latencies.push(started.elapsed());
                    report.claimed += 1;
                    report.taken_over += usize::from(claimed.takeover);
                    backoff = w.poll_interval;
                    tracing::debug!(slot = %name, run = %claimed.run, thread = %claimed.thread, attempt = claimed.attempts, "claimed");
                    self.execute(claimed, &mut shutdown, &mut report).await;
                    continue;
                }
                Ok(None) if until_idle => break,
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(slot = %name, error = %e, "claiming failed; retrying");
                    if !failing {
                        failing = true;
                        if let Some(f) = &w.on_claim_trouble {
                            f(&ClaimTrouble::Failing {
                                slot: &name,
                                error: &e,
                            });
                        }
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
            let wait = if backoff > w.poll_interval {
                backoff
            } else {
                w.poll_interval
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => {}
            }
        }
        report
    }

    /// Runs one claimed run to its end and tells the queue how it ended.
    async fn execute(
        &self,
        claimed: Claimed,
        shutdown: &mut watch::Receiver<bool>,
        report: &mut WorkerReport,
    ) {
        let w = &*self.inner;
        let input = match RunInput::decode(&claimed.input) {
            Ok(input) => input,
            Err(reason) => {
                let error = format!("the run's input cannot be used: {reason}");
                tracing::warn!(run = %claimed.run, %error, "failing the run");
                let outcome = match w.queue.fail(&claimed, &error).await {
                    Ok(true) => {
                        report.failed += 1;
                        RunOutcome::Failed {
                            error: &error,
                            agent: None,
                        }
                    }
                    Ok(false) => {
                        report.superseded += 1;
                        RunOutcome::Superseded
                    }
                    Err(e) => {
                        tracing::warn!(run = %claimed.run, error = %e, "cannot mark the run failed");
                        return;
                    }
                };
                self.tell(&claimed, outcome);
                return;
            }
        };
        let deadline = claimed.sent_at + w.lease - margin(w.lease);
        let ctl = Arc::new(RunCtl::new(
            w.queue.clone(),
            claimed.clone(),
            deadline,
            !input.is_empty() && !claimed.input_applied,
        ));
        w.fence.register(&claimed.thread, ctl.clone());
        let mut conflicts = 0;
        let outcome = loop {
            let applied = claimed.input_applied
                || ctl.wrote()
                || input.is_empty()
                || (claimed.attempts > 1 && self.reached_thread(&claimed.thread, &input).await);
            let agent_input = if applied {
                AgentInput::new()
            } else {
                input.clone().into_agent_input()
            };
            match self.supervise(&claimed, &ctl, agent_input, shutdown).await {
                Supervised::Finished(Ok(run)) => break Outcome::Finished(run),
                Supervised::Finished(Err(e)) => {
                    if let Some(reason) = ctl.stopping()
                        && refused(&e)
                    {
                        break Outcome::Stopped(reason);
                    }
                    if ctl.is_lost() {
                        break Outcome::Superseded;
                    }
                    if is_conflict(&e) {
                        report.conflicts += 1;
                        // Fencing refused a step: someone else wrote the thread. If the
                        // lease is still ours that was a late write of a worker that lost
                        // it; continue from the new head. Otherwise stop, marking nothing.
                        match w.queue.holds(&claimed).await {
                            Ok(true) if conflicts < MAX_CONFLICT_RETRIES => {
                                conflicts += 1;
                                tracing::info!(run = %claimed.run, "a stale write moved the thread; continuing from its head");
                                continue;
                            }
                            Ok(true) => {
                                break Outcome::Failed(
                                    format!("{e} ({} times in a row)", conflicts + 1),
                                    Some(e),
                                );
                            }
                            Ok(false) | Err(_) => break Outcome::Superseded,
                        }
                    }
                    break Outcome::Failed(e.to_string(), Some(e));
                }
                Supervised::Stopped(reason) => break Outcome::Stopped(reason),
                Supervised::Lost => break Outcome::Superseded,
                Supervised::Panicked(message) => break Outcome::Failed(message, None),
            }
        };
        w.fence.deregister(&claimed.thread, &ctl);
        let marked = match &outcome {
            Outcome::Finished(run) => {
                report.supersteps += run.supersteps as u64;
                let result = RunResult {
                    answer: run.answer.clone(),
                    stop: run.stop.clone(),
                    interrupted: !run.interrupts.is_empty(),
                    supersteps: run.supersteps as u64,
                };
                w.queue
                    .complete(&claimed, &result)
                    .await
                    .map(|ok| (ok, "done"))
            }
            Outcome::Failed(error, _) => {
                w.queue.fail(&claimed, error).await.map(|ok| (ok, "failed"))
            }
            Outcome::Stopped(StopReason::Cancel) => w
                .queue
                .cancelled(&claimed)
                .await
                .map(|ok| (ok, "cancelled")),
            Outcome::Stopped(StopReason::Shutdown) => {
                w.queue.release(&claimed).await.map(|ok| (ok, "released"))
            }
            Outcome::Superseded => Ok((false, "superseded")),
        };
        let told = match marked {
            Ok((true, "done")) => {
                report.done += 1;
                match &outcome {
                    Outcome::Finished(run) => RunOutcome::Done(run),
                    _ => return,
                }
            }
            Ok((true, "failed")) => {
                report.failed += 1;
                match &outcome {
                    Outcome::Failed(error, agent) => RunOutcome::Failed {
                        error,
                        agent: agent.as_ref(),
                    },
                    _ => return,
                }
            }
            Ok((true, "cancelled")) => {
                report.cancelled += 1;
                RunOutcome::Cancelled
            }
            Ok((true, _)) => {
                report.released += 1;
                RunOutcome::Released
            }
            Ok((false, how)) => {
                tracing::info!(run = %claimed.run, how, "the run's lease is no longer this worker's; leaving it");
                report.superseded += 1;
                RunOutcome::Superseded
            }
            Err(e) => {
                tracing::warn!(run = %claimed.run, error = %e, "cannot record how the run ended");
                return;
            }
        };
        self.tell(&claimed, told);
    }

    /// Gives the run's end to the builder's callback, if any.
    fn tell(&self, claimed: &Claimed, outcome: RunOutcome<'_>) {
        if let Some(f) = &self.inner.on_run_end {
            f(&RunEnd {
                run: claimed.run,
                thread: &claimed.thread,
                outcome,
            });
        }
    }

    /// Whether a run's input already reached its thread (a takeover after a worker died
    /// between storing the input and recording that it had).
    async fn reached_thread(&self, thread: &str, input: &RunInput) -> bool {
        let graph = self.inner.agent.graph();
        let snapshot = match graph.get_state(&RunConfig::thread(thread)).await {
            Ok(Some(s)) => s,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(thread, error = %e, "cannot read the thread to see whether the run's input reached it");
                return false;
            }
        };
        if input.get_resume().is_some() {
            return snapshot.interrupts.is_empty();
        }
        if let Some(first) = input.get_messages().first() {
            return snapshot
                .values
                .messages
                .iter()
                .any(|m| m.id.is_some() && m.id == first.id);
        }
        match input.get_goal() {
            Some(goal) => snapshot
                .values
                .goal
                .as_ref()
                .is_some_and(|g| g.text() == goal),
            None => true,
        }
    }

    /// Runs the agent on the run's thread while renewing the lease; stops it when it is
    /// cancelled, shut down or loses the lease.
    async fn supervise(
        &self,
        claimed: &Claimed,
        ctl: &Arc<RunCtl>,
        input: AgentInput,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Supervised {
        let w = &*self.inner;
        let agent = w.agent.clone();
        let thread = claimed.thread.clone();
        let mut task = AbortOnDrop(tokio::spawn(async move { agent.run(&thread, input).await }));
        let mut beat =
            tokio::time::interval_at(tokio::time::Instant::now() + w.heartbeat, w.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shutting = *shutdown.borrow();
        if shutting {
            ctl.stop(StopReason::Shutdown);
        }
        loop {
            if ctl.is_lost() || ctl.check_deadline() {
                task.abort_and_wait().await;
                return Supervised::Lost;
            }
            if let Some(reason) = ctl.stopping()
                && ctl.try_close()
            {
                task.abort_and_wait().await;
                return Supervised::Stopped(reason);
            }
            tokio::select! {
                joined = &mut task.0 => {
                    return match joined {
                        Ok(result) => Supervised::Finished(result.map(Box::new)),
                        Err(e) => Supervised::Panicked(format!("the run's task ended abnormally: {e}")),
                    };
                }
                _ = beat.tick() => {
                    let sent = Instant::now();
                    match w.queue.renew(claimed, w.lease).await {
                        Ok(Renewal::Held { cancel_requested }) => {
                            ctl.extend(sent + w.lease - margin(w.lease));
                            if cancel_requested {
                                ctl.stop(StopReason::Cancel);
                            }
                        }
                        Ok(Renewal::Lost) => ctl.lose(),
                        Err(e) => {
                            tracing::warn!(run = %claimed.run, error = %e, "renewing the lease failed");
                            ctl.check_deadline();
                        }
                    }
                }
                () = ctl.changed.notified() => {}
                changed = shutdown.changed(), if !shutting => {
                    shutting = true;
                    if changed.is_ok() && *shutdown.borrow() {
                        ctl.stop(StopReason::Shutdown);
                    }
                }
            }
        }
    }
}

enum Supervised {
    Finished(Result<Box<AgentRun>, AgentError>),
    Stopped(StopReason),
    Lost,
    Panicked(String),
}

/// A run's task, aborted when dropped (a dropped worker leaves nothing running).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Aborts the task and waits until it is gone: after this, it writes nothing.
    async fn abort_and_wait(&mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The part of a lease a worker does not count on: a run's last write must be sent
/// before four fifths of the lease have passed since the renewal was sent.
fn margin(lease: Duration) -> Duration {
    lease / 5
}

fn is_conflict(e: &AgentError) -> bool {
    matches!(e, AgentError::Graph(GraphError::Checkpoint(c)) if c.is_conflict())
}

fn refused(e: &AgentError) -> bool {
    matches!(e, AgentError::Graph(GraphError::Checkpoint(c)) if is_refusal(c))
}

fn default_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.trim().is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "worker".to_owned());
    format!("{host}-{}", std::process::id())
}
