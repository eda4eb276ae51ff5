//! Database threads: SQLite calls block, so they run on threads of their own, never on
//! the async runtime's.
//!
//! A [`Lane`] is a queue of jobs served by one or more threads, each owning one
//! connection. The saver has a writer lane (one thread, so writes of this saver queue
//! up instead of fighting over SQLite's write lock) and, for a file, a reader lane
//! (WAL mode lets readers run beside the writer). A job's result comes back through a
//! oneshot channel, so awaiting it needs no particular async runtime.
//!
//! A job someone is waiting for pays two thread hand-offs: to the lane's thread and
//! back (about 70 µs of a 150 µs put on the benchmark machine). So a one-thread lane
//! started with `in_place` can also run a job on the caller's thread
//! ([`Lane::run_on_caller`]): when the caller is a worker of tokio's multi-thread
//! runtime, nothing is queued, and the connection is free, the job runs there inside
//! `tokio::task::block_in_place`, which hands the worker's other tasks to another
//! thread first, so the runtime is never blocked. Anywhere else (another runtime,
//! tokio's current-thread one, a queue in front) the job is queued as usual. It is the
//! user's choice ([`SqliteOptions::block_in_place`](crate::SqliteOptions::block_in_place)):
//! `block_in_place` panics inside a `LocalSet`, which cannot be detected.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use futures::channel::oneshot;
use rusqlite::Connection;

use crate::error::SqliteError;

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// What a lane's thread runs after each job, with the same connection.
pub(crate) type AfterJob = Arc<dyn Fn(&mut Connection) + Send + Sync>;

/// Whether a thread of [`spawn_connection`] opened its connection.
pub(crate) struct Opened(oneshot::Receiver<Result<(), SqliteError>>);

impl Opened {
    /// Waits for the connection: the error `open` returned, if any.
    pub(crate) async fn wait(self) -> Result<(), SqliteError> {
        match self.0.await {
            Ok(result) => result,
            Err(oneshot::Canceled) => Err(SqliteError::WorkerStopped),
        }
    }
}

/// Starts a thread named `name` that opens its connection with `open` and then runs
/// `serve` with it (neither blocks the caller, which awaits [`Opened::wait`]).
pub(crate) fn spawn_connection<C, O, S>(
    name: String,
    open: O,
    serve: S,
) -> Result<(JoinHandle<()>, Opened), SqliteError>
where
    O: FnOnce() -> Result<C, SqliteError> + Send + 'static,
    S: FnOnce(C) + Send + 'static,
{
    let (ready_tx, ready_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(name)
        .spawn(move || match open() {
            Ok(conn) => {
                let _ = ready_tx.send(Ok(()));
                serve(conn);
            }
            Err(err) => {
                let _ = ready_tx.send(Err(err));
            }
        })
        .map_err(SqliteError::Thread)?;
    Ok((thread, Opened(ready_rx)))
}

/// A thread's connection: `None` before it opened and after its thread closed it.
type Slot = Arc<Mutex<Option<Connection>>>;

/// A job queue and the threads that serve it.
pub(crate) struct Lane {
    tx: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs queued and not yet finished.
    queued: Arc<AtomicUsize>,
    /// The connection of a one-thread lane, for [`Lane::run_on_caller`].
    only: Option<Slot>,
    after: Option<AfterJob>,
}

impl Lane {
    /// Starts `count` threads named `name`, each with the connection `open` makes
    /// (called on that thread). Returns once every connection is open, or with the
    /// first error (the threads started so far then stop).
    pub(crate) async fn start<F>(name: &str, count: usize, open: F) -> Result<Self, SqliteError>
    where
        F: Fn() -> Result<Connection, SqliteError> + Send + Sync + 'static,
    {
        Self::start_with(name, count, open, None, false).await
    }

    /// [`Lane::start`], with `after` run on the job's thread after each job (a panic in
    /// it is caught, as a job's is), and with `in_place`, a one-thread lane whose
    /// [`Lane::run_on_caller`] may run jobs on the caller's thread.
    pub(crate) async fn start_with<F>(
        name: &str,
        count: usize,
        open: F,
        after: Option<AfterJob>,
        in_place: bool,
    ) -> Result<Self, SqliteError>
    where
        F: Fn() -> Result<Connection, SqliteError> + Send + Sync + 'static,
    {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let open = Arc::new(open);
        let queued = Arc::new(AtomicUsize::new(0));
        let mut lane = Lane {
            tx: Some(tx),
            threads: Vec::with_capacity(count),
            queued: Arc::clone(&queued),
            only: None,
            after: after.clone(),
        };
        let mut ready = Vec::with_capacity(count);
        for i in 0..count {
            let (rx, open, after) = (Arc::clone(&rx), Arc::clone(&open), after.clone());
            let (slot, queued) = (Slot::default(), Arc::clone(&queued));
            if count == 1 && in_place {
                lane.only = Some(Arc::clone(&slot));
            }
            let opened_slot = Arc::clone(&slot);
            let (thread, opened) = spawn_connection(
                format!("{name}-{i}"),
                // In its slot before the lane reports it open.
                move || {
                    *lock(&opened_slot) = Some(open()?);
                    Ok(())
                },
                move |()| serve(&rx, &slot, &queued, after.as_deref()),
            )?;
            lane.threads.push(thread);
            ready.push(opened);
        }
        for opened in ready {
            opened.wait().await?;
        }
        Ok(lane)
    }

    /// Runs `f` on one of the lane's connections and returns its result.
    ///
    /// If the future is dropped after the job was queued, the job still runs to its
    /// end (a put still commits, or not, as a whole).
    pub(crate) async fn run<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<SqliteError> + Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let _ = tx.send(f(conn));
        });
        self.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.tx.as_ref().is_some_and(|q| q.send(job).is_ok());
        if !sent {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(SqliteError::WorkerStopped.into());
        }
        match rx.await {
            Ok(result) => result,
            Err(oneshot::Canceled) => Err(SqliteError::WorkerStopped.into()),
        }
    }

    /// Runs `f` as [`Lane::run`] does, or on the calling thread when that saves the two
    /// hand-offs (see the module docs): a one-thread lane started `in_place`, a worker
    /// of tokio's multi-thread runtime, no job queued, the connection free. For a job its caller
    /// waits on; a throughput-bound batch does better on the lane's thread, where it
    /// runs beside the caller's next work.
    ///
    /// A job that panics returns [`SqliteError::WorkerStopped`], as on the lane's
    /// thread (an open transaction rolls back as the panic unwinds); the connection
    /// stays usable.
    pub(crate) async fn run_on_caller<T, E, F>(&self, f: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<SqliteError> + Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, E> + Send + 'static,
    {
        if let Some(slot) = &self.only
            && in_multi_thread_runtime()
            && self.queued.load(Ordering::Acquire) == 0
            && let Ok(mut conn) = slot.try_lock()
            && let Some(conn) = conn.as_mut()
        {
            let after = self.after.as_deref();
            return tokio::task::block_in_place(|| {
                run_job(conn, f, after).unwrap_or_else(|_| Err(SqliteError::WorkerStopped.into()))
            });
        }
        self.run(f).await
    }
}

/// Whether this thread is in a tokio multi-thread runtime, where `block_in_place` may
/// be called (unless a `LocalSet` is running: the lane's owner vouches for that).
fn in_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Runs `job` and then `after` on `conn`, each with its panic caught (an open
/// transaction rolls back as the panic unwinds); `Err` when the job panicked.
fn run_job<R>(
    conn: &mut Connection,
    job: impl FnOnce(&mut Connection) -> R,
    after: Option<&(dyn Fn(&mut Connection) + Send + Sync)>,
) -> std::thread::Result<R> {
    let result = catch_unwind(AssertUnwindSafe(|| job(conn)));
    if let Some(after) = after {
        let _ = catch_unwind(AssertUnwindSafe(|| after(conn)));
    }
    result
}

fn lock(slot: &Mutex<Option<Connection>>) -> std::sync::MutexGuard<'_, Option<Connection>> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves jobs until the queue closes, then closes the connection on this thread. A
/// job that panics loses its reply (its caller gets [`SqliteError::WorkerStopped`])
/// but not the thread; an open transaction is rolled back as the panic unwinds.
fn serve(
    rx: &Mutex<mpsc::Receiver<Job>>,
    slot: &Mutex<Option<Connection>>,
    queued: &AtomicUsize,
    after: Option<&(dyn Fn(&mut Connection) + Send + Sync)>,
) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(PoisonError::into_inner);
            rx.recv()
        };
        let Ok(job) = job else {
            // Closed here, not wherever the lane is dropped (closing may copy the log).
            drop(lock(slot).take());
            return;
        };
        {
            let mut conn = lock(slot);
            if let Some(conn) = conn.as_mut() {
                let _ = run_job(conn, job, after);
            }
        }
        queued.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Lane {
    /// Closes the queue and waits for the threads to finish their jobs and close their
    /// connections.
    fn drop(&mut self) {
        self.tx = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::thread::{self, ThreadId};

    use super::*;

    async fn lane(threads: usize) -> Lane {
        Lane::start_with(
            "keel-test-lane",
            threads,
            || Connection::open_in_memory().map_err(SqliteError::from),
            None,
            true,
        )
        .await
        .unwrap()
    }

    fn here(_: &mut Connection) -> Result<ThreadId, SqliteError> {
        Ok(thread::current().id())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_awaited_job_runs_on_a_multi_thread_worker_and_a_batch_on_the_lane() {
        let lane = lane(1).await;
        let caller = thread::current().id();
        assert_eq!(lane.run_on_caller(here).await.unwrap(), caller);
        assert_ne!(lane.run(here).await.unwrap(), caller);
        // A lane of several threads has no one connection to borrow.
        let readers = self::lane(2).await;
        assert_ne!(readers.run_on_caller(here).await.unwrap(), caller);
        // Nor does a lane started without `in_place`.
        let plain = Lane::start("keel-test-lane", 1, || {
            Connection::open_in_memory().map_err(SqliteError::from)
        })
        .await
        .unwrap();
        assert_ne!(plain.run_on_caller(here).await.unwrap(), caller);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn on_the_current_thread_runtime_every_job_goes_to_the_lane() {
        let lane = lane(1).await;
        assert_ne!(
            lane.run_on_caller(here).await.unwrap(),
            thread::current().id()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_that_panics_on_the_caller_is_an_error_and_the_connection_lives_on() {
        let lane = lane(1).await;
        lane.run_on_caller(|c: &mut Connection| {
            c.execute_batch("CREATE TABLE t (x INTEGER)")
                .map_err(SqliteError::from)
        })
        .await
        .unwrap();
        let err = lane
            .run_on_caller(|c: &mut Connection| -> Result<(), SqliteError> {
                let tx = c.transaction()?;
                tx.execute("INSERT INTO t VALUES (1)", [])?;
                panic!("a bug in a job")
            })
            .await
            .unwrap_err();
        assert!(matches!(err, SqliteError::WorkerStopped), "{err:?}");
        // The panic's transaction did not stay open: a new one starts, and the row
        // written before the panic is not there.
        let n: i64 = lane
            .run_on_caller(|c: &mut Connection| {
                let tx = c.transaction()?;
                let n = tx.query_row("SELECT count(*) FROM t", [], |r| r.get(0))?;
                tx.commit()?;
                Ok::<_, SqliteError>(n)
            })
            .await
            .unwrap();
        assert_eq!(n, 0);
    }
}
