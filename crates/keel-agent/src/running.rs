//! One run of a thread at a time in one agent: a second run that starts while one is
//! going is refused before it reads anything, so it cannot run the first one's tool
//! calls again (both would load the same checkpoint, and the loser's calls would run
//! before its write is refused).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Semaphore;

use crate::error::AgentError;

/// The threads with a run going, shared by an agent's clones.
#[derive(Clone, Default)]
pub(crate) struct Running {
    threads: Arc<Mutex<HashMap<String, Arc<Slot>>>>,
}

/// One thread's run: whether its caller has stopped waiting for it, and a semaphore
/// closed when it has ended (a closed semaphore wakes every waiter, however late).
struct Slot {
    stopping: AtomicBool,
    ended: Semaphore,
}

/// Held by a run while it goes; dropping it frees the thread.
pub(crate) struct RunGuard {
    running: Running,
    thread: String,
    slot: Arc<Slot>,
}

/// Marks a run as stopping when its caller stops waiting (drops the run's future or
/// stream), so the next run of the thread waits for it to end instead of being
/// refused. Made before the run has taken its thread (a stream's run takes it on its
/// own task), it marks the run once its [`Watcher`] has been given the guard.
#[derive(Default)]
pub(crate) struct StopOnDrop(Arc<Mutex<Option<Arc<Slot>>>>);

/// Where a run that takes its thread later tells its [`StopOnDrop`] which run it is.
pub(crate) struct Watcher(Arc<Mutex<Option<Arc<Slot>>>>);

impl Running {
    /// How many threads have a run going.
    pub(crate) fn count(&self) -> usize {
        self.threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// [`Running::begin`], with what marks the run as stopping when it is dropped:
    /// hold it where the caller waits.
    pub(crate) async fn begin_watched(
        &self,
        thread: &str,
    ) -> Result<(RunGuard, StopOnDrop), AgentError> {
        let guard = self.begin(thread).await?;
        let stop = StopOnDrop::default();
        stop.watcher().watch(&guard);
        Ok((guard, stop))
    }

    /// Takes `thread` for a run. A run of it that is going makes this fail with
    /// [`AgentError::ThreadBusy`]; one whose caller has stopped waiting (it is being
    /// cancelled) is waited for.
    pub(crate) async fn begin(&self, thread: &str) -> Result<RunGuard, AgentError> {
        loop {
            let held = {
                let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
                match threads.get(thread) {
                    Some(slot) => slot.clone(),
                    None => {
                        let slot = Arc::new(Slot {
                            stopping: AtomicBool::new(false),
                            ended: Semaphore::new(0),
                        });
                        threads.insert(thread.to_owned(), slot.clone());
                        return Ok(RunGuard {
                            running: self.clone(),
                            thread: thread.to_owned(),
                            slot,
                        });
                    }
                }
            };
            if !held.stopping.load(Ordering::Acquire) {
                return Err(AgentError::ThreadBusy {
                    thread_id: thread.to_owned(),
                });
            }
            // Cancelled and stopping at its next await: wait for it, then try again.
            let _ = held.ended.acquire().await;
        }
    }
}

impl StopOnDrop {
    /// The handle a run gives its guard to, once it has one.
    pub(crate) fn watcher(&self) -> Watcher {
        Watcher(Arc::clone(&self.0))
    }
}

impl Watcher {
    /// Marks `guard`'s run as stopping when the [`StopOnDrop`] is dropped.
    pub(crate) fn watch(&self, guard: &RunGuard) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(guard.slot.clone());
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        let mut threads = self
            .running
            .threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if threads
            .get(&self.thread)
            .is_some_and(|s| Arc::ptr_eq(s, &self.slot))
        {
            threads.remove(&self.thread);
        }
        drop(threads);
        self.slot.ended.close();
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(slot) = self.0.lock().unwrap_or_else(PoisonError::into_inner).take() {
            slot.stopping.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Running;
    use crate::error::AgentError;

    #[tokio::test]
    async fn a_second_run_is_refused_and_one_being_cancelled_is_waited_for() {
        let running = Running::default();
        let first = running.begin("t").await.unwrap();
        assert!(matches!(
            running.begin("t").await,
            Err(AgentError::ThreadBusy { thread_id }) if thread_id == "t"
        ));
        // Another thread is free.
        drop(running.begin("u").await.unwrap());
        // The caller stops waiting: the next run waits for the first to end.
        let stop = super::StopOnDrop::default();
        stop.watcher().watch(&first);
        drop(stop);
        let waiting = tokio::spawn({
            let running = running.clone();
            async move { running.begin("t").await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(first);
        waiting.await.unwrap().unwrap();
        // Ended runs leave nothing behind.
        assert!(running.threads.lock().unwrap().is_empty());
    }
}
