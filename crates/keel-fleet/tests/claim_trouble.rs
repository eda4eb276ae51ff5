//! A worker whose claims start failing says so once per slot, and again when they
//! work (it used to only log each failure at warn level and otherwise look idle).
//!
//! Without `DATABASE_URL` each test prints why it is skipped, except under `CI=true`,
//! where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Db, Echo, database_url, goal, is_done, wait_for};
use keel_fleet::{ClaimTrouble, RunInput, Worker};

async fn wait_until(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not {what} after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_claims_are_reported_once_and_so_is_their_recovery() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "claim_trouble").await;
    let events: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = events.clone();
    let echo = Echo::new(3);
    let worker = Worker::builder(db.queue.clone(), db.saver.clone())
        .agent(echo.agent("w"))
        .name("w")
        .concurrency(2)
        .lease(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(100))
        .poll_interval(Duration::from_millis(20))
        .on_claim_trouble(move |t| {
            let line = match t {
                ClaimTrouble::Failing { slot, error } => format!("failing {slot}: {error}"),
                ClaimTrouble::Recovered { slot } => format!("recovered {slot}"),
                other => format!("{other:?}"),
            };
            seen.lock().unwrap().push(line);
        })
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let w = worker.clone();
    let handle = tokio::spawn(async move {
        w.run(async move {
            let _ = rx.await;
        })
        .await
        .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(events.lock().unwrap().is_empty(), "{events:?}");

    // The runs table goes away under the worker: every claim fails.
    db.sql("ALTER TABLE {s}.keel_fleet_runs RENAME TO keel_fleet_runs_away")
        .await;
    let failing = |e: &Vec<String>| e.iter().filter(|l| l.starts_with("failing")).count();
    wait_until("told of both slots failing", || {
        failing(&events.lock().unwrap()) == 2
    })
    .await;
    // Retries are not told again.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    {
        let e = events.lock().unwrap();
        assert_eq!((failing(&e), e.len()), (2, 2), "{e:?}");
        assert!(e.iter().all(|l| l.contains("keel_fleet_runs")), "{e:?}");
    }

    db.sql("ALTER TABLE {s}.keel_fleet_runs_away RENAME TO keel_fleet_runs")
        .await;
    wait_until("told of both slots recovering", || {
        events.lock().unwrap().len() == 4
    })
    .await;
    {
        let e = events.lock().unwrap();
        assert_eq!(
            e.iter().filter(|l| l.starts_with("recovered")).count(),
            2,
            "{e:?}"
        );
    }
    // And the worker runs runs again.
    let run = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    wait_for(&db.queue, run, "done", is_done).await;
    let _ = tx.send(());
    let report = handle.await.unwrap();
    assert_eq!(report.done, 1, "{report:?}");
    db.drop_schema().await;
}
