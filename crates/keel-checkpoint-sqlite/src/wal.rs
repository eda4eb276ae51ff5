//! Write-ahead log checkpoints off the writer's path.
//!
//! In WAL mode a commit appends pages to the log; a *checkpoint* copies them back into
//! the database file so the log can start over. By default SQLite runs one on the
//! connection that commits, after the commit that takes the log past 1,000 pages, and
//! with `synchronous=NORMAL` that checkpoint first flushes the whole log to the disk:
//! one put in about a hundred waited milliseconds for it (8.7 ms a checkpoint, 70 µs
//! a put on average, in the agent benchmark).
//!
//! Here the writer connection only notes the log's size after each commit (a WAL hook,
//! which also turns SQLite's own automatic checkpoints off), and a thread of its own,
//! with its own connection, runs `PRAGMA wal_checkpoint(PASSIVE)` once the log reaches
//! [`SqliteOptions::checkpoint_pages`](crate::SqliteOptions::checkpoint_pages). A passive
//! checkpoint never blocks the writer or the readers; it copies what no reader still
//! needs. The log starts over at the first write after a checkpoint that copied all of
//! it, which a background pass racing the writer's commits seldom leaves; so once a
//! pass has left only a few pages uncopied, the writer copies them itself after its
//! next commit (a short pass, after the put's answer has gone out). While a pass runs
//! the writer asks for no other: the first commit after it ends decides, so the thread
//! does not chase the writer with pass after pass (each with its two flushes). Should a steady
//! stream of commits keep even that from happening, the writer waits for the running
//! pass and copies the rest once the log reaches four times the threshold, so the log
//! stays bounded.

use std::cell::Cell;
use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use rusqlite::Connection;
use rusqlite::hooks::Wal;

use crate::error::SqliteError;
use crate::worker::spawn_connection;

/// Past `checkpoint_pages` times this, the writer checkpoints itself.
const BACKSTOP_FACTOR: u32 = 4;

/// Once a background pass has left at most `checkpoint_pages / CATCH_UP_DIVISOR` pages
/// uncopied, the writer copies the rest itself after its next commit (a short pass):
/// the log starts over only at a write that finds all of it copied, which a
/// background pass racing the writer's commits seldom leaves.
const CATCH_UP_DIVISOR: u32 = 16;

/// ... and at least this many (a commit's worth), for small thresholds.
const CATCH_UP_MIN: u32 = 8;

thread_local! {
    /// Pages in the log after the last commit of the writer connection on this thread,
    /// or 0 when it has not committed since [`Trigger::after_job`] last looked.
    static LOG_PAGES: Cell<c_int> = const { Cell::new(0) };
}

/// The WAL hook of the writer connection: notes the log's size (SQLite calls it on the
/// committing thread, after each commit).
fn note_log_pages(_: &Wal, pages: c_int) -> rusqlite::Result<()> {
    LOG_PAGES.set(pages);
    Ok(())
}

/// Turns SQLite's automatic checkpoints off on the writer connection and has it note
/// the log's size after each commit instead ([`Trigger::after_job`] reads it).
pub(crate) fn watch_log(conn: &Connection) {
    conn.wal_hook(Some(note_log_pages));
}

/// What the writer's thread and the checkpoint thread share.
#[derive(Default)]
struct Signal {
    state: Mutex<State>,
    changed: Condvar,
    /// Log pages the last background pass left copied (0 after the log started over).
    copied: AtomicU32,
}

#[derive(Default)]
struct State {
    /// The log has reached the threshold since the last pass began.
    wanted: bool,
    /// A pass is running on the checkpoint thread.
    running: bool,
    /// The saver is closing: the thread ends.
    stop: bool,
}

impl Signal {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }
}

/// The writer's side: decides after each of its jobs whether the log needs a checkpoint.
#[derive(Clone)]
pub(crate) struct Trigger {
    signal: Arc<Signal>,
    /// Log pages that wake the checkpoint thread (`0`: never).
    threshold: u32,
}

impl Trigger {
    /// The writer's side for a log `threshold` in pages (`0`: no automatic
    /// checkpoints); [`Checkpoints::start`] takes it to share its state.
    pub(crate) fn new(threshold: u32) -> Self {
        Self {
            signal: Arc::default(),
            threshold,
        }
    }

    /// Called on the writer's thread after each job: wakes the checkpoint thread when
    /// the job committed and the log has reached the threshold, and checkpoints on the
    /// writer itself when it has reached the backstop.
    pub(crate) fn after_job(&self, conn: &Connection) {
        let pages = u32::try_from(LOG_PAGES.replace(0)).unwrap_or(0);
        if self.threshold == 0 || pages == 0 {
            return;
        }
        if pages < self.threshold {
            self.signal.copied.store(0, Ordering::Relaxed);
            return;
        }
        let behind = pages.saturating_sub(self.signal.copied.load(Ordering::Relaxed));
        if pages >= self.threshold.saturating_mul(BACKSTOP_FACTOR) {
            // The backstop: copy the rest here, so the log stops growing.
            self.wait_idle();
        } else {
            let mut state = self.signal.lock();
            if state.running {
                // The pass copies up to where the log was when it began; the first
                // commit after it ends decides what comes next (asking for another
                // pass now would have the thread chase the writer, pass after pass).
                return;
            }
            let catch_up = (self.threshold / CATCH_UP_DIVISOR).max(CATCH_UP_MIN);
            if behind > catch_up {
                state.wanted = true;
                drop(state);
                self.signal.changed.notify_all();
                return;
            }
        }
        // The last few pages (or, at the backstop, all that is left), so that the next
        // write finds the log copied and starts it over. The put that committed has its
        // answer already. A failure leaves the pages in the log for the next try.
        let _ = passive_checkpoint(conn);
    }

    /// On the writer's thread: waits for a running background pass to end and starts
    /// no other until the writer's next job has run, so a checkpoint the writer runs
    /// now finds the checkpoint lock free.
    pub(crate) fn wait_idle(&self) {
        let mut state = self.signal.lock();
        state.wanted = false;
        while state.running {
            state = self
                .signal
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// The checkpoint thread; dropping it stops the thread (after its pass) and closes its
/// connection.
pub(crate) struct Checkpoints {
    signal: Arc<Signal>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpoints {
    /// Starts the checkpoint thread for `trigger` with the connection `open` makes (on
    /// that thread). Returns once the connection is open.
    pub(crate) async fn start<F>(trigger: &Trigger, open: F) -> Result<Self, SqliteError>
    where
        F: FnOnce() -> Result<Connection, SqliteError> + Send + 'static,
    {
        let signal = Arc::clone(&trigger.signal);
        let (thread, opened) = {
            let signal = Arc::clone(&signal);
            spawn_connection("keel-sqlite-checkpoint".into(), open, move |conn| {
                serve(&signal, &conn);
            })?
        };
        // Built first, so a failed open still stops and joins the thread.
        let checkpoints = Self {
            signal,
            thread: Some(thread),
        };
        opened.wait().await?;
        Ok(checkpoints)
    }
}

/// Runs a pass each time the writer asks, until the saver closes.
fn serve(signal: &Signal, conn: &Connection) {
    let mut state = signal.lock();
    loop {
        if state.stop {
            return;
        }
        if state.wanted {
            state.wanted = false;
            state.running = true;
            drop(state);
            // A failed pass loses nothing: the log keeps the pages for the next pass
            // or the writer's backstop. A panic must not leave `running` set, or the
            // writer's backstop would wait for ever.
            let copied = catch_unwind(AssertUnwindSafe(|| passive_checkpoint(conn)));
            if let Ok(Ok(copied)) = copied {
                let copied = u32::try_from(copied).unwrap_or(0);
                signal.copied.store(copied, Ordering::Relaxed);
            }
            state = signal.lock();
            state.running = false;
            signal.changed.notify_all();
            continue;
        }
        state = signal
            .changed
            .wait(state)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// `PRAGMA wal_checkpoint(PASSIVE)`: copies what it can without waiting for anyone;
/// returns the log pages copied so far.
fn passive_checkpoint(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(2))
}

impl Drop for Checkpoints {
    fn drop(&mut self) {
        self.signal.set(|s| s.stop = true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
