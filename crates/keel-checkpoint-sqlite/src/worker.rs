//! Database threads: SQLite calls block, so they run on threads of their own, never on
//! the async runtime's.
//!
//! A [`Lane`] is a queue of jobs served by one or more threads, each owning one
//! connection. The saver has a writer lane (one thread, so writes of this saver queue
//! up instead of fighting over SQLite's write lock) and, for a file, a reader lane
//! (WAL mode lets readers run beside the writer). A job's result comes back through a
//! oneshot channel, so awaiting it needs no particular async runtime.

use std::panic::{AssertUnwindSafe, catch_unwind};
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
pub(crate) fn spawn_connection<O, S>(
    name: String,
    open: O,
    serve: S,
) -> Result<(JoinHandle<()>, Opened), SqliteError>
where
    O: FnOnce() -> Result<Connection, SqliteError> + Send + 'static,
    S: FnOnce(Connection) + Send + 'static,
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

/// A job queue and the threads that serve it.
pub(crate) struct Lane {
    tx: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Lane {
    /// Starts `count` threads named `name`, each with the connection `open` makes
    /// (called on that thread). Returns once every connection is open, or with the
    /// first error (the threads started so far then stop).
    pub(crate) async fn start<F>(name: &str, count: usize, open: F) -> Result<Self, SqliteError>
    where
        F: Fn() -> Result<Connection, SqliteError> + Send + Sync + 'static,
    {
        Self::start_with(name, count, open, None).await
    }

    /// [`Lane::start`], with `after` run on the job's thread after each job (a panic in
    /// it is caught, as a job's is).
    pub(crate) async fn start_with<F>(
        name: &str,
        count: usize,
        open: F,
        after: Option<AfterJob>,
    ) -> Result<Self, SqliteError>
    where
        F: Fn() -> Result<Connection, SqliteError> + Send + Sync + 'static,
    {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let open = Arc::new(open);
        let mut lane = Lane {
            tx: Some(tx),
            threads: Vec::with_capacity(count),
        };
        let mut ready = Vec::with_capacity(count);
        for i in 0..count {
            let (rx, open, after) = (Arc::clone(&rx), Arc::clone(&open), after.clone());
            let (thread, opened) = spawn_connection(
                format!("{name}-{i}"),
                move || open(),
                move |mut conn| serve(&rx, &mut conn, after.as_deref()),
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
        let sent = self.tx.as_ref().is_some_and(|q| q.send(job).is_ok());
        if !sent {
            return Err(SqliteError::WorkerStopped.into());
        }
        match rx.await {
            Ok(result) => result,
            Err(oneshot::Canceled) => Err(SqliteError::WorkerStopped.into()),
        }
    }
}

/// Serves jobs until the queue closes. A job that panics loses its reply (its caller
/// gets [`SqliteError::WorkerStopped`]) but not the thread; an open transaction is
/// rolled back as the panic unwinds.
fn serve(
    rx: &Mutex<mpsc::Receiver<Job>>,
    conn: &mut Connection,
    after: Option<&(dyn Fn(&mut Connection) + Send + Sync)>,
) {
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(PoisonError::into_inner);
            rx.recv()
        };
        let Ok(job) = job else {
            return;
        };
        let _ = catch_unwind(AssertUnwindSafe(|| job(conn)));
        if let Some(after) = after {
            let _ = catch_unwind(AssertUnwindSafe(|| after(conn)));
        }
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
