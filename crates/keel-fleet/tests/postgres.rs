//! The run queue and its workers against a real PostgreSQL: claims, leases and
//! takeovers, fencing, double-texting policies, cancels, bad input, schema versions.
//!
//! Without `DATABASE_URL` each test prints why it is skipped, except under `CI=true`,
//! where it fails. Each test has its own schema.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    Db, Echo, Gate, database_url, goal, is_done, reference, summary, tool_calls_answered, wait_for,
};
use keel_fleet::{
    FleetError, Policy, QueueOptions, RunInput, RunOutcome, RunStatus, SCHEMA_VERSION, Worker,
    WorkerReport,
};
use keel_message::Message;

/// A worker with test timings: a short lease, fast heartbeats and polls.
fn worker(db: &Db, echo: &Echo, name: &str, concurrency: usize) -> Worker {
    Worker::builder(db.queue.clone(), db.saver.clone())
        .agent(echo.agent(name))
        .name(name)
        .concurrency(concurrency)
        .lease(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(100))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// Runs a worker in the background until the returned sender fires (or is dropped).
fn background(
    worker: &Worker,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<WorkerReport>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let w = worker.clone();
    let handle = tokio::spawn(async move {
        w.run(async move {
            let _ = rx.await;
        })
        .await
        .unwrap()
    });
    (tx, handle)
}

async fn state(worker: &Worker, thread: &str) -> keel_agent::AgentState {
    worker.agent().state(thread).await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_claim_complete() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "complete").await;
    let echo = Echo::new(12);
    let threads = ["a", "b", "c"];
    let mut runs = Vec::new();
    for t in threads {
        let run = db
            .queue
            .submit(t, RunInput::new().goal(goal(t)))
            .await
            .unwrap();
        let info = db.queue.status(run).await.unwrap();
        assert_eq!(info.status, RunStatus::Queued);
        assert_eq!((info.thread.as_str(), info.seq, info.attempts), (t, 1, 0));
        runs.push(run);
    }
    let w = worker(&db, &echo, "w", 2);
    let report = w.run_until_idle().await.unwrap();
    assert_eq!((report.claimed, report.done, report.failed), (3, 3, 0));
    assert_eq!(
        report.taken_over, 0,
        "queued runs are claimed, not taken over"
    );
    assert_eq!(report.claim_latencies.len(), 3);
    for (t, run) in threads.iter().zip(runs) {
        let info = db.queue.status(run).await.unwrap();
        match &info.status {
            RunStatus::Done { result, .. } => {
                assert_eq!(result.answer.as_deref(), Some("Reached 12."));
                assert!(!result.interrupted && result.stop.is_none());
                assert!(result.supersteps >= 24, "{result:?}");
            }
            other => panic!("{t}: {other:?}"),
        }
        assert_eq!(info.attempts, 1);
        assert_eq!(db.queue.runs(t).await.unwrap(), vec![info]);
        assert_eq!(summary(&state(&w, t).await), reference(12, t, &[]).await);
    }
    // Nothing is left to claim.
    assert_eq!(w.run_until_idle().await.unwrap().claimed, 0);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_never_run_one_thread_at_once() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "two_workers").await;
    let mut echo = Echo::new(15);
    echo.delay = Duration::from_millis(5);
    let threads: Vec<String> = (0..6).map(|i| format!("t{i}")).collect();
    let mut runs = Vec::new();
    for t in &threads {
        runs.push(
            db.queue
                .submit(t, RunInput::new().goal(goal(t)))
                .await
                .unwrap(),
        );
        // A follow-up queued behind each, so both workers want every thread.
        runs.push(
            db.queue
                .submit_with(
                    t,
                    RunInput::new().message(Message::user("Once more.")),
                    Policy::Enqueue,
                )
                .await
                .unwrap(),
        );
    }
    let w1 = worker(&db, &echo, "w1", 2);
    let w2 = worker(&db, &echo, "w2", 2);
    let (r1, r2) = tokio::join!(w1.run_until_idle(), w2.run_until_idle());
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    // A slot may find nothing while the other worker holds a thread's first run:
    // finish what is left.
    let rest = w1.run_until_idle().await.unwrap();
    assert_eq!(r1.done + r2.done + rest.done, 12, "{r1:?} {r2:?} {rest:?}");
    assert!(
        r1.done > 0 && r2.done > 0,
        "both workers ran: {r1:?} {r2:?}"
    );
    assert_eq!(echo.tracker.overlaps.load(Ordering::SeqCst), 0);
    assert!(echo.tracker.calls.load(Ordering::SeqCst) >= 6 * 15);
    for t in &threads {
        assert_eq!(
            summary(&state(&w1, t).await),
            reference(15, t, &["Once more."]).await,
            "{t}"
        );
    }
    for run in runs {
        assert_eq!(db.queue.status(run).await.unwrap().attempts, 1);
    }
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_takeover_continues_from_the_last_checkpoint() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "takeover").await;
    // The first worker hangs in its 13th model call, then dies (its future is dropped:
    // no more renewals, nothing more written).
    let gate = Gate::new(12);
    let first = Echo::new(30).model_gate(gate.clone());
    let second = Echo {
        model_gate: None,
        ..first.clone()
    };
    let run = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let w1 = worker(&db, &first, "w1", 1);
    let (_stop1, h1) = background(&w1);
    gate.wait_entered().await;
    let info = db.queue.status(run).await.unwrap();
    let RunStatus::Running {
        worker: holder,
        since,
        lease_until,
        lease_expired,
        cancel_requested,
    } = info.status
    else {
        panic!("{info:?}")
    };
    assert_eq!(holder, "w1/0");
    assert!(lease_until > since && !lease_expired && !cancel_requested);
    h1.abort();
    let _ = h1.await;
    assert_eq!(state(&w1, "t").await.step, 12);

    let w2 = worker(&db, &second, "w2", 1);
    let (stop2, h2) = background(&w2);
    let info = wait_for(&db.queue, run, "done", is_done).await;
    stop2.send(()).unwrap();
    let report = h2.await.unwrap();
    assert_eq!((report.claimed, report.taken_over, report.done), (1, 1, 1));
    assert_eq!(info.attempts, 2);
    let after = state(&w2, "t").await;
    assert!(after.milestones_made >= 2, "compacted across the takeover");
    assert_eq!(summary(&after), reference(30, "t", &[]).await);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_was_taken_over_gets_a_conflict_and_stops_without_marking() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "conflict").await;
    let gate = Gate::new(5);
    let slow = Echo::new(20).model_gate(gate.clone());
    let fast = Echo {
        model_gate: None,
        ..slow.clone()
    };
    let run = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    // A paused worker: a long lease it would renew only every 10 s, held in its 6th
    // model call.
    let paused = Worker::builder(db.queue.clone(), db.saver.clone())
        .agent(slow.agent("paused"))
        .name("paused")
        .lease(Duration::from_secs(60))
        .heartbeat(Duration::from_secs(10))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let (stop_paused, h_paused) = background(&paused);
    gate.wait_entered().await;
    // Its lease runs out by the database's clock (as if it had been paused for a
    // minute), and another worker takes the run over and finishes it.
    assert_eq!(
        db.sql("UPDATE {s}.keel_fleet_runs SET lease_until = now() - interval '1 second'")
            .await,
        1
    );
    let taker = worker(&db, &fast, "taker", 1);
    let (stop_taker, h_taker) = background(&taker);
    let done = wait_for(&db.queue, run, "done", is_done).await;
    stop_taker.send(()).unwrap();
    assert_eq!(h_taker.await.unwrap().done, 1);

    // The paused worker wakes up: its step is refused by fencing, and it leaves the run
    // as the other worker marked it.
    gate.release();
    // Its write is refused within milliseconds; give it a second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_paused.send(()).unwrap();
    let report = h_paused.await.unwrap();
    assert_eq!(report.conflicts, 1, "{report:?}");
    assert_eq!((report.superseded, report.done, report.failed), (1, 0, 0));
    assert_eq!(db.queue.status(run).await.unwrap(), done);
    match &done.status {
        RunStatus::Done { result, .. } => assert_eq!(result.answer.as_deref(), Some("Reached 20.")),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        summary(&state(&taker, "t").await),
        reference(20, "t", &[]).await
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_text_reject_refuses_a_busy_thread() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "reject").await;
    let gate = Gate::new(3);
    let echo = Echo::new(6).model_gate(gate.clone());
    let first = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let again = RunInput::new().message(Message::user("Hurry."));
    match db.queue.submit("t", again.clone()).await {
        Err(FleetError::ThreadBusy {
            thread,
            run,
            status,
            more,
        }) => {
            assert_eq!(
                (thread.as_str(), run, status, more),
                ("t", first, "queued", 0)
            );
        }
        other => panic!("{other:?}"),
    }
    // With a second run queued after the first, the refusal counts it too.
    let second = db
        .queue
        .submit_with("t", again.clone(), Policy::Enqueue)
        .await
        .unwrap();
    let err = db.queue.submit("t", again.clone()).await.unwrap_err();
    assert!(
        matches!(err, FleetError::ThreadBusy { run, more: 1, .. } if run == first),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("(and 1 more run queued after it)"),
        "{err}"
    );
    db.queue.cancel(second).await.unwrap();
    let w = worker(&db, &echo, "w", 1);
    let (stop, h) = background(&w);
    gate.wait_entered().await;
    let err = db
        .queue
        .submit_with("t", again, Policy::Reject)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            FleetError::ThreadBusy {
                status: "running",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("Policy::Enqueue"), "{err}");
    gate.release();
    wait_for(&db.queue, first, "done", is_done).await;
    stop.send(()).unwrap();
    h.await.unwrap();
    // Only the first run and the cancelled second exist; another thread was never busy.
    assert_eq!(db.queue.runs("t").await.unwrap().len(), 2);
    db.queue
        .submit("u", RunInput::new().goal(goal("u")))
        .await
        .unwrap();
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_text_enqueue_runs_after_the_running_one() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "enqueue").await;
    let gate = Gate::new(4);
    let echo = Echo::new(10).model_gate(gate.clone());
    let first = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let w = worker(&db, &echo, "w", 2);
    let (stop, h) = background(&w);
    gate.wait_entered().await;
    let second = db
        .queue
        .submit_with(
            "t",
            RunInput::new().message(Message::user("Once more.")),
            Policy::Enqueue,
        )
        .await
        .unwrap();
    // The worker has a free slot, but the thread is busy: the second run waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        db.queue.status(second).await.unwrap().status,
        RunStatus::Queued
    );
    gate.release();
    let last = wait_for(&db.queue, second, "done", is_done).await;
    stop.send(()).unwrap();
    h.await.unwrap();
    let runs = db.queue.runs("t").await.unwrap();
    assert_eq!(runs.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2]);
    let RunStatus::Done {
        finished_at: first_end,
        ..
    } = runs[0].status
    else {
        panic!("{runs:?}")
    };
    let RunStatus::Done {
        finished_at: second_end,
        ..
    } = last.status
    else {
        panic!()
    };
    assert!(first_end <= second_end);
    assert_eq!(runs[0].id, first);
    assert_eq!(
        summary(&state(&w, "t").await),
        reference(10, "t", &["Once more."]).await
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_text_interrupt_cancels_the_running_run_and_runs_next() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "interrupt").await;
    // Eight steps: no compaction, so the whole history stays in the raw buffer.
    let gate = Gate::new(5);
    let echo = Echo::new(8).model_gate(gate.clone());
    let first = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let w = worker(&db, &echo, "w", 1);
    let (stop, h) = background(&w);
    gate.wait_entered().await;
    // A queued follow-up, then a double text that interrupts both.
    let queued = db
        .queue
        .submit_with(
            "t",
            RunInput::new().message(Message::user("Later.")),
            Policy::Enqueue,
        )
        .await
        .unwrap();
    let second = db
        .queue
        .submit_with(
            "t",
            RunInput::new().message(Message::user("Change of plan: go on.")),
            Policy::Interrupt,
        )
        .await
        .unwrap();
    let cancelled = wait_for(&db.queue, first, "cancelled", |s| {
        matches!(s, RunStatus::Cancelled { .. })
    })
    .await;
    let reason = format!("interrupted by run {second}");
    assert!(
        matches!(&cancelled.status, RunStatus::Cancelled { reason: Some(r), .. } if *r == reason),
        "{cancelled:?}"
    );
    assert!(matches!(
        db.queue.status(queued).await.unwrap().status,
        RunStatus::Cancelled { reason: Some(ref r), .. } if *r == reason
    ));
    let done = wait_for(&db.queue, second, "done", is_done).await;
    stop.send(()).unwrap();
    let report = h.await.unwrap();
    assert_eq!((report.cancelled, report.done), (1, 1), "{report:?}");
    assert!(
        matches!(done.status, RunStatus::Done { ref result, .. } if result.answer.as_deref() == Some("Reached 8."))
    );
    // The cancelled run kept its five steps; its sixth model reply was never stored, so
    // the new message follows the fifth tool result and every call has its result.
    let s = state(&w, "t").await;
    assert!(tool_calls_answered(&s));
    let texts: Vec<String> = s.messages.iter().map(|m| m.text().into_owned()).collect();
    let at = texts
        .iter()
        .position(|t| t == "Change of plan: go on.")
        .unwrap();
    assert!(texts[at - 1].starts_with("echoed 4 "), "{texts:?}");
    assert!(!texts.iter().any(|t| t == "Later."));
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_run_after_its_current_step() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "cancel").await;

    // Held in a model call: the reply that arrives after the cancel is not stored.
    let model_gate = Gate::new(5);
    // Held in a tool call: the tools step completes, then the run stops.
    let tool_gate = Gate::new(7);
    let by_model = Echo::new(20).model_gate(model_gate.clone());
    let by_tool = Echo::new(20).tool_gate(tool_gate.clone());
    let w1 = worker(&db, &by_model, "w1", 1);
    let w2 = worker(&db, &by_tool, "w2", 1);
    let r1 = db
        .queue
        .submit("m", RunInput::new().goal(goal("m")))
        .await
        .unwrap();
    let r2 = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let (stop1, h1) = background(&w1);
    model_gate.wait_entered().await;
    let (stop2, h2) = background(&w2);
    tool_gate.wait_entered().await;

    for run in [r1, r2] {
        let info = db.queue.cancel(run).await.unwrap();
        assert!(
            matches!(
                info.status,
                RunStatus::Running {
                    cancel_requested: true,
                    ..
                }
            ),
            "{info:?}"
        );
    }
    wait_for(&db.queue, r1, "cancelled", |s| {
        matches!(s, RunStatus::Cancelled { .. })
    })
    .await;
    // A worker sees a cancel at its next heartbeat (100 ms here): let it see this one
    // while its tool call is still held.
    tokio::time::sleep(Duration::from_millis(500)).await;
    tool_gate.release();
    wait_for(&db.queue, r2, "cancelled", |s| {
        matches!(s, RunStatus::Cancelled { .. })
    })
    .await;

    let m = state(&w1, "m").await;
    assert_eq!(
        m.step, 5,
        "five model calls stored; the sixth was cancelled"
    );
    assert!(tool_calls_answered(&m));
    let t = state(&w2, "t").await;
    assert_eq!(
        t.step, 8,
        "the eighth call's tool step finished before the stop"
    );
    assert!(tool_calls_answered(&t));
    assert!(
        t.messages
            .iter()
            .last()
            .unwrap()
            .text()
            .starts_with("echoed 7 ")
    );

    // A cancelled thread keeps its steps: a new run continues it to the same end as an
    // uninterrupted run.
    model_gate.release();
    let more = db.queue.submit("m", RunInput::new()).await.unwrap();
    wait_for(&db.queue, more, "done", is_done).await;
    assert_eq!(
        summary(&state(&w1, "m").await),
        reference(20, "m", &[]).await
    );

    // A queued run is cancelled at once; an ended one stays as it ended.
    stop1.send(()).unwrap();
    stop2.send(()).unwrap();
    let (r1, r2) = (h1.await.unwrap(), h2.await.unwrap());
    assert_eq!((r1.cancelled, r2.cancelled, r1.done + r2.done), (1, 1, 1));
    let queued = db
        .queue
        .submit_with("m", RunInput::new(), Policy::Enqueue)
        .await
        .unwrap();
    let info = db.queue.cancel(queued).await.unwrap();
    assert!(
        matches!(info.status, RunStatus::Cancelled { reason: Some(ref r), .. } if r == "cancelled")
    );
    assert!(is_done(&db.queue.cancel(more).await.unwrap().status));
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_input_fails_the_run_with_the_reason() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "bad_input").await;
    let echo = Echo::new(3);
    let bad = db
        .queue
        .submit("bad", RunInput::new().goal("g"))
        .await
        .unwrap();
    let future = db
        .queue
        .submit("future", RunInput::new().goal("g"))
        .await
        .unwrap();
    db.sql(
        "UPDATE {s}.keel_fleet_runs SET input = '{\"v\": 1, \"input\": {\"goal\": 7}}' WHERE thread_id = 'bad'",
    )
    .await;
    db.sql(
        "UPDATE {s}.keel_fleet_runs SET input = '{\"v\": 2, \"input\": {}}' WHERE thread_id = 'future'",
    )
    .await;
    let good = db
        .queue
        .submit("good", RunInput::new().goal(goal("good")))
        .await
        .unwrap();
    let w = worker(&db, &echo, "w", 1);
    let report = w.run_until_idle().await.unwrap();
    assert_eq!((report.failed, report.done), (2, 1), "{report:?}");
    for (run, says) in [(bad, "does not decode"), (future, "format 2")] {
        let info = db.queue.status(run).await.unwrap();
        match &info.status {
            RunStatus::Failed { error, .. } => {
                assert!(
                    error.contains("input cannot be used") && error.contains(says),
                    "{error}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(info.attempts, 1);
    }
    assert!(is_done(&db.queue.status(good).await.unwrap().status));
    // Failed for good: not claimed again.
    assert_eq!(w.run_until_idle().await.unwrap().claimed, 0);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_workers_keep_dying_fails_after_max_attempts() {
    let Some(url) = database_url() else { return };
    let mut db = Db::new(&url, "attempts").await;
    db.queue = keel_fleet::Queue::from_pool(
        db.queue.pool().clone(),
        QueueOptions::new()
            .schema(db.schema.clone())
            .unwrap()
            .max_attempts(2),
    )
    .unwrap();
    // Every worker hangs at the third model call and dies there.
    let gate = Gate::every_time(2);
    let echo = Echo::new(5).model_gate(gate.clone());
    let run = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    for attempt in 1..=2 {
        let w = worker(&db, &echo, &format!("w{attempt}"), 1);
        let (_stop, h) = background(&w);
        while gate.entered_count.load(Ordering::SeqCst) < attempt {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        h.abort();
        let _ = h.await;
        assert_eq!(
            db.queue.status(run).await.unwrap().attempts as usize,
            attempt
        );
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let w = worker(&db, &echo, "w3", 1);
    let report = w.run_until_idle().await.unwrap();
    assert_eq!(report.claimed, 0);
    let info = db.queue.status(run).await.unwrap();
    match &info.status {
        RunStatus::Failed { error, .. } => {
            assert!(
                error.contains("gave up after 2 attempts") && error.contains("w2/0"),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    gate.release();
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_versions_older_and_newer_are_typed_errors() {
    let Some(url) = database_url() else { return };
    let echo = Echo::new(2);
    let schema = format!("keel_fleet_versions_{}", std::process::id());
    let db = Db::bare(&url, &schema).await;
    db.saver.setup().await.unwrap();
    let w = worker(&db, &echo, "w", 1);

    // Nothing set up.
    assert!(matches!(
        db.queue.check().await,
        Err(FleetError::NotSetUp { .. })
    ));
    assert!(matches!(
        w.run_until_idle().await,
        Err(FleetError::NotSetUp { .. })
    ));
    // The queue's own calls say so too, instead of the server's missing-table error.
    let run: keel_fleet::RunId = "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80".parse().unwrap();
    for err in [
        db.queue.thread_ids(None, 10).await.unwrap_err(),
        db.queue.runs("t").await.unwrap_err(),
        db.queue.status(run).await.unwrap_err(),
        db.queue.cancel(run).await.unwrap_err(),
        db.queue.forget_thread("t").await.unwrap_err(),
        db.queue
            .submit("t", RunInput::new().goal("g"))
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(&err, FleetError::NotSetUp { schema: s } if *s == schema),
            "{err}"
        );
    }

    // An older schema: the version table at 0.
    db.sql("CREATE TABLE {s}.keel_fleet_schema (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())").await;
    db.sql("INSERT INTO {s}.keel_fleet_schema (version, name) VALUES (0, 'before')")
        .await;
    let err = w.run_until_idle().await.unwrap_err();
    assert!(
        matches!(err, FleetError::SchemaTooOld { found: 0, expected, .. } if expected == SCHEMA_VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("version 0"), "{err}");
    // Setup upgrades it; then the worker runs.
    assert_eq!(db.queue.setup().await.unwrap(), vec![1]);
    assert!(db.queue.setup().await.unwrap().is_empty());
    db.queue.check().await.unwrap();
    db.queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    assert_eq!(w.run_until_idle().await.unwrap().done, 1);

    // A newer schema: refused by workers and by setup.
    db.sql("INSERT INTO {s}.keel_fleet_schema (version, name) VALUES (7, 'from the future')")
        .await;
    let err = w.run_until_idle().await.unwrap_err();
    assert!(
        matches!(err, FleetError::SchemaTooNew { found: 7, supported, .. } if supported == SCHEMA_VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("version 7"), "{err}");
    assert!(matches!(
        db.queue.setup().await,
        Err(FleetError::SchemaTooNew { found: 7, .. })
    ));
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_puts_held_runs_back_and_another_worker_finishes_them() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "shutdown").await;
    let gate = Gate::new(6);
    let first = Echo::new(14).model_gate(gate.clone());
    let second = Echo {
        model_gate: None,
        ..first.clone()
    };
    let run = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    let w1 = worker(&db, &first, "w1", 1);
    let (stop1, h1) = background(&w1);
    gate.wait_entered().await;
    stop1.send(()).unwrap();
    let report = h1.await.unwrap();
    assert_eq!((report.released, report.done), (1, 0), "{report:?}");
    let info = db.queue.status(run).await.unwrap();
    assert_eq!((info.status, info.attempts), (RunStatus::Queued, 0));
    assert_eq!(state(&w1, "t").await.step, 6);

    let w2 = worker(&db, &second, "w2", 1);
    assert_eq!(w2.run_until_idle().await.unwrap().done, 1);
    let info = db.queue.status(run).await.unwrap();
    assert!(is_done(&info.status) && info.attempts == 1, "{info:?}");
    assert_eq!(
        summary(&state(&w2, "t").await),
        reference(14, "t", &[]).await
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_thread_ids_and_unknown_runs_are_typed_errors() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "typed").await;
    assert!(matches!(
        db.queue.submit("../x", RunInput::new()).await,
        Err(FleetError::BadThreadId { .. })
    ));
    let missing: keel_fleet::RunId = "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80".parse().unwrap();
    assert!(matches!(
        db.queue.status(missing).await,
        Err(FleetError::UnknownRun { run }) if run == missing
    ));
    assert!(matches!(
        db.queue.cancel(missing).await,
        Err(FleetError::UnknownRun { .. })
    ));
    assert!(db.queue.runs("nobody").await.unwrap().is_empty());
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgetting_a_thread_removes_its_runs_once_none_is_in_flight() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "forget").await;
    let echo = Echo::new(2);
    let done = db
        .queue
        .submit("f", RunInput::new().goal(goal("f")))
        .await
        .unwrap();
    let queued = db
        .queue
        .submit_with(
            "f",
            RunInput::new().message(Message::user("More.")),
            Policy::Enqueue,
        )
        .await
        .unwrap();
    // A thread that only ever had a cancelled run: in no checkpointer, still in the queue.
    let lone = db
        .queue
        .submit("g", RunInput::new().goal(goal("g")))
        .await
        .unwrap();
    db.queue.cancel(lone).await.unwrap();
    assert_eq!(db.queue.thread_ids(None, 10).await.unwrap(), ["f", "g"]);
    assert_eq!(db.queue.thread_ids(None, 1).await.unwrap(), ["f"]);
    assert_eq!(db.queue.thread_ids(Some("f"), 10).await.unwrap(), ["g"]);
    // In flight: refused, nothing removed.
    let err = db.queue.forget_thread("f").await.unwrap_err();
    assert!(
        matches!(err, FleetError::ThreadActive { ref thread, run, status: "queued" } if thread == "f" && run == done),
        "{err}"
    );
    assert!(err.to_string().contains("cancel it"), "{err}");
    assert_eq!(db.queue.runs("f").await.unwrap().len(), 2);
    let w = worker(&db, &echo, "w", 1);
    let (stop, h) = background(&w);
    wait_for(&db.queue, queued, "done", is_done).await;
    stop.send(()).unwrap();
    h.await.unwrap();
    assert_eq!(db.queue.forget_thread("f").await.unwrap(), 2);
    assert_eq!(db.queue.forget_thread("g").await.unwrap(), 1);
    assert_eq!(db.queue.forget_thread("never").await.unwrap(), 0);
    assert!(db.queue.runs("f").await.unwrap().is_empty());
    assert!(db.queue.thread_ids(None, 10).await.unwrap().is_empty());
    assert!(matches!(
        db.queue.status(done).await,
        Err(FleetError::UnknownRun { .. })
    ));
    // The thread can be used again from the start.
    db.queue
        .submit("f", RunInput::new().goal(goal("f")))
        .await
        .unwrap();
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_run_end_hears_how_each_run_ended_with_the_agent_s_error() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "run_end").await;
    let echo = Echo::new(2);
    let good = db
        .queue
        .submit("good", RunInput::new().goal(goal("good")))
        .await
        .unwrap();
    // No goal anywhere: the agent refuses the run with a typed error.
    let lost = db
        .queue
        .submit("lost", RunInput::new().message(Message::user("Hello?")))
        .await
        .unwrap();
    let bad = db
        .queue
        .submit("bad", RunInput::new().goal("g"))
        .await
        .unwrap();
    db.sql("UPDATE {s}.keel_fleet_runs SET input = '{\"v\": 2, \"input\": {}}' WHERE thread_id = 'bad'")
        .await;
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = heard.clone();
    let w = Worker::builder(db.queue.clone(), db.saver.clone())
        .agent(echo.agent("w"))
        .name("w")
        .lease(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(100))
        .poll_interval(Duration::from_millis(20))
        .on_run_end(move |end| {
            let what = match &end.outcome {
                RunOutcome::Done(run) => format!("done: {:?}", run.answer),
                RunOutcome::Failed { error, agent } => format!(
                    "failed ({}): {error}",
                    match agent {
                        Some(keel_agent::AgentError::NoGoal { .. }) => "no goal",
                        Some(_) => "agent",
                        None => "no agent error",
                    }
                ),
                other => format!("{other:?}"),
            };
            h.lock()
                .unwrap()
                .push((end.run, end.thread.to_owned(), what));
        })
        .build()
        .unwrap();
    let report = w.run_until_idle().await.unwrap();
    assert_eq!((report.done, report.failed), (1, 2), "{report:?}");
    let mut heard = heard.lock().unwrap().clone();
    heard.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(heard.len(), 3, "{heard:?}");
    assert_eq!((heard[0].0, heard[0].1.as_str()), (bad, "bad"));
    assert!(
        heard[0]
            .2
            .starts_with("failed (no agent error): the run's input cannot be used"),
        "{heard:?}"
    );
    assert_eq!((heard[1].0, heard[2].0), (good, lost));
    assert_eq!(heard[1].2, "done: Some(\"Reached 2.\")");
    assert!(heard[2].2.starts_with("failed (no goal):"), "{heard:?}");
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_sweep_deletes_idle_threads_but_those_with_a_run_in_flight() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "sweep").await;
    let echo = Echo::new(2);
    let w = worker(&db, &echo, "w", 2);
    let (stop, h) = background(&w);
    let mut last = Vec::new();
    for t in ["idle", "waiting"] {
        last.push(
            db.queue
                .submit(t, RunInput::new().goal(goal(t)))
                .await
                .unwrap(),
        );
    }
    for run in last {
        wait_for(&db.queue, run, "done", is_done).await;
    }
    stop.send(()).unwrap();
    h.await.unwrap();
    // No worker runs: this run waits in the queue while its thread looks idle.
    let waiting = db
        .queue
        .submit("waiting", RunInput::new().message(Message::user("More.")))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let agent = w.agent();
    assert_eq!(
        agent
            .idle_threads(Duration::from_secs(1), 10)
            .await
            .unwrap(),
        ["idle", "waiting"]
    );
    let swept = db
        .queue
        .sweep_idle(agent, Duration::from_secs(1), 10)
        .await
        .unwrap();
    assert_eq!(swept.deleted, ["idle"]);
    assert_eq!(swept.kept.len(), 1);
    assert_eq!(
        (
            swept.kept[0].thread.as_str(),
            swept.kept[0].run,
            swept.kept[0].status
        ),
        ("waiting", waiting, "queued")
    );
    assert!(agent.state("idle").await.unwrap().is_none());
    assert!(db.queue.runs("idle").await.unwrap().is_empty());
    assert!(agent.state("waiting").await.unwrap().is_some());
    // The kept thread's run still finishes, on the thread it was submitted for.
    let (stop, h) = background(&w);
    wait_for(&db.queue, waiting, "done", is_done).await;
    stop.send(()).unwrap();
    h.await.unwrap();
    db.drop_schema().await;
}
