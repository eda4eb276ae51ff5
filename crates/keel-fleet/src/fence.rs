//! The worker's gate in front of the checkpointer: every checkpoint a run writes
//! passes it, so the worker knows each step boundary as it is stored, and a run that
//! is stopping or has lost its lease cannot store another step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use keel_checkpoint::{
    CheckpointError, CheckpointId, CheckpointSource, CheckpointSummary, CheckpointTuple,
    Checkpointer, ListOptions, PendingWrite, PutRequest, ThreadInfo, ThreadKey,
};
use tokio::sync::Notify;

use crate::queue::{Claimed, Queue};

/// Why a worker stops a run before it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopReason {
    /// `Queue::cancel`, or a run submitted with `Policy::Interrupt`.
    Cancel,
    /// The worker is shutting down; the run goes back to the queue.
    Shutdown,
}

/// A write the gate refused; the run's graph fails with it and the worker, which
/// refused it, knows why.
#[derive(Debug, thiserror::Error)]
#[error("keel-fleet refused a write to thread {thread:?}: {why}")]
pub(crate) struct Refused {
    thread: String,
    why: &'static str,
}

/// One run's control block, shared by its worker slot and the gate.
pub(crate) struct RunCtl {
    state: Mutex<CtlState>,
    /// Wakes the slot after every stored step and state change.
    pub(crate) changed: Notify,
    queue: Queue,
    claimed: Claimed,
}

#[derive(Debug)]
struct CtlState {
    /// The lease is surely ours until then (monotonic clock; renewals move it).
    deadline: Instant,
    stopping: Option<StopReason>,
    /// Nothing more may be written.
    closed: bool,
    lost: bool,
    in_flight: usize,
    /// Whether the last stored step was the model's (its tool calls may lack results).
    last_by_agent: bool,
    /// Whether this worker stored anything for the run (so its input reached the thread).
    wrote: bool,
    /// Whether the queue must be told when the input reaches the thread.
    mark_applied: bool,
}

impl RunCtl {
    pub(crate) fn new(
        queue: Queue,
        claimed: Claimed,
        deadline: Instant,
        mark_applied: bool,
    ) -> Self {
        RunCtl {
            state: Mutex::new(CtlState {
                deadline,
                stopping: None,
                closed: false,
                lost: false,
                in_flight: 0,
                last_by_agent: false,
                wrote: false,
                mark_applied,
            }),
            changed: Notify::new(),
            queue,
            claimed,
        }
    }

    fn lock(&self) -> MutexGuard<'_, CtlState> {
        // A poisoned lock only means a panic elsewhere while holding it; the state is
        // plain data and still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A renewal succeeded: the lease is ours until `deadline`.
    pub(crate) fn extend(&self, deadline: Instant) {
        let mut s = self.lock();
        if deadline > s.deadline {
            s.deadline = deadline;
        }
    }

    /// The lease is gone (renewal refused, or not renewed in time): write nothing more.
    pub(crate) fn lose(&self) {
        {
            let mut s = self.lock();
            s.lost = true;
            s.closed = true;
        }
        self.changed.notify_one();
    }

    /// Stops the run at its next step boundary.
    pub(crate) fn stop(&self, reason: StopReason) {
        {
            let mut s = self.lock();
            // A cancel outranks a shutdown: the run must not go back to the queue.
            if s.stopping.is_none() || reason == StopReason::Cancel {
                s.stopping = Some(reason);
            }
        }
        self.changed.notify_one();
    }

    /// Whether the lease may have ended by now (by this machine's monotonic clock,
    /// which a wall-clock jump does not move); marks it lost if so.
    pub(crate) fn check_deadline(&self) -> bool {
        let expired = Instant::now() >= self.lock().deadline;
        if expired {
            self.lose();
        }
        expired
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lock().lost
    }

    pub(crate) fn stopping(&self) -> Option<StopReason> {
        self.lock().stopping
    }

    pub(crate) fn wrote(&self) -> bool {
        self.lock().wrote
    }

    /// When stopping and the thread is at a clean boundary (no write in flight, and the
    /// last stored step did not leave tool calls waiting for results), closes the run
    /// to writes and says so: the slot may then abort it.
    pub(crate) fn try_close(&self) -> bool {
        let mut s = self.lock();
        if s.stopping.is_some() && s.in_flight == 0 && !s.last_by_agent {
            s.closed = true;
            return true;
        }
        false
    }

    /// Admits a write, or says why not.
    fn admit(&self, kind: Write) -> Result<InFlight<'_>, &'static str> {
        let mut s = self.lock();
        if s.lost {
            return Err("the run's lease is lost");
        }
        if s.closed {
            return Err("the run is stopping");
        }
        if Instant::now() >= s.deadline {
            s.lost = true;
            s.closed = true;
            drop(s);
            self.changed.notify_one();
            return Err("the run's lease may have expired (not renewed in time)");
        }
        if s.stopping.is_some() {
            let refuse = match kind {
                // A model reply stored now could leave tool calls without results, and
                // an input not yet stored need not be.
                Write::Step { by_agent, input } => by_agent || input,
                Write::Pending => !s.wrote,
                Write::Admin => false,
            };
            if refuse {
                s.closed = true;
                drop(s);
                self.changed.notify_one();
                return Err("the run is stopping");
            }
        }
        s.in_flight += 1;
        Ok(InFlight { ctl: self })
    }

    /// A write finished.
    async fn stored(&self, kind: Write) {
        let mark = {
            let mut s = self.lock();
            s.wrote = true;
            if let Write::Step { by_agent, .. } = kind {
                s.last_by_agent = by_agent;
            }
            std::mem::take(&mut s.mark_applied)
        };
        if mark {
            // The first write of a run stores its input: say so, so a worker taking the
            // run over does not apply it twice.
            if let Err(e) = self.queue.mark_applied(&self.claimed).await {
                tracing::warn!(run = %self.claimed.run, error = %e, "cannot record that the run's input was applied");
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Write {
    /// A checkpoint: by the model's node, or the run's input.
    Step { by_agent: bool, input: bool },
    /// Tasks' writes within a step (an interrupt, a resume answer).
    Pending,
    /// Pruning after a compaction.
    Admin,
}

/// Counts a write in flight until it returns or is dropped.
struct InFlight<'a> {
    ctl: &'a RunCtl,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        {
            let mut s = self.ctl.lock();
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        self.ctl.changed.notify_one();
    }
}

/// The gate: a [`Checkpointer`] over the real one, keyed by the threads the worker's
/// runs hold. Reads pass through; writes to a thread no run of this worker holds are
/// refused.
pub(crate) struct Fence {
    inner: Arc<dyn Checkpointer>,
    runs: Mutex<HashMap<String, Arc<RunCtl>>>,
}

impl Fence {
    pub(crate) fn new(inner: Arc<dyn Checkpointer>) -> Self {
        Fence {
            inner,
            runs: Mutex::new(HashMap::new()),
        }
    }

    fn runs(&self) -> MutexGuard<'_, HashMap<String, Arc<RunCtl>>> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn register(&self, thread: &str, ctl: Arc<RunCtl>) {
        if let Some(old) = self.runs().insert(thread.to_owned(), ctl) {
            // Another slot of this worker still held the thread (its lease was lost):
            // it may write nothing more.
            old.lose();
        }
    }

    pub(crate) fn deregister(&self, thread: &str, ctl: &Arc<RunCtl>) {
        let mut runs = self.runs();
        if runs.get(thread).is_some_and(|c| Arc::ptr_eq(c, ctl)) {
            runs.remove(thread);
        }
    }

    fn ctl(&self, thread: &str) -> Result<Arc<RunCtl>, CheckpointError> {
        self.runs()
            .get(thread)
            .cloned()
            .ok_or_else(|| refused(thread, "no run of this worker holds the thread"))
    }
}

fn refused(thread: &str, why: &'static str) -> CheckpointError {
    CheckpointError::backend(Refused {
        thread: thread.to_owned(),
        why,
    })
}

/// Whether an error is the gate's refusal.
pub(crate) fn is_refusal(e: &CheckpointError) -> bool {
    matches!(e, CheckpointError::Backend(b) if b.is::<Refused>())
}

#[async_trait]
impl Checkpointer for Fence {
    fn is_durable(&self) -> bool {
        self.inner.is_durable()
    }

    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        self.inner.get(thread, id).await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        self.inner.list(thread, options)
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        let thread = request.thread.thread_id.clone();
        let ctl = self.ctl(&thread)?;
        let kind = Write::Step {
            by_agent: request
                .metadata
                .writes
                .iter()
                .any(|w| w == keel_agent::AGENT),
            input: request.metadata.source == CheckpointSource::Input,
        };
        let guard = ctl.admit(kind).map_err(|why| refused(&thread, why))?;
        let result = self.inner.put(request).await;
        if result.is_ok() {
            ctl.stored(kind).await;
        }
        drop(guard);
        result
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        let ctl = self.ctl(&thread.thread_id)?;
        let guard = ctl
            .admit(Write::Pending)
            .map_err(|why| refused(&thread.thread_id, why))?;
        let result = self.inner.put_writes(thread, checkpoint, writes).await;
        if result.is_ok() {
            ctl.stored(Write::Pending).await;
        }
        drop(guard);
        result
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        self.inner.delete_thread(thread_id).await
    }

    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        let ctl = self.runs().get(&thread.thread_id).cloned();
        match ctl {
            // A run's own pruning (after a compaction) must hold the thread.
            Some(ctl) => {
                let guard = ctl
                    .admit(Write::Admin)
                    .map_err(|why| refused(&thread.thread_id, why))?;
                let result = self.inner.prune(thread, keep_last).await;
                drop(guard);
                result
            }
            None => self.inner.prune(thread, keep_last).await,
        }
    }

    async fn sweep_idle(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<Vec<String>, CheckpointError> {
        self.inner.sweep_idle(idle_for, limit).await
    }

    async fn list_threads(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<ThreadInfo>, CheckpointError> {
        self.inner.list_threads(after, limit).await
    }
}
