//! A thread's goal is written once: a run bringing a second goal is refused when it is
//! submitted (it used to be queued, then failed on its worker), except that an
//! interrupt replaces a queued goal that never reached the thread.
//!
//! Without `DATABASE_URL` each test prints why it is skipped, except under `CI=true`,
//! where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{Db, Echo, database_url, goal};
use keel_fleet::{FleetError, Policy, RunInput, RunStatus, Worker};
use keel_message::Message;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_goal_is_refused_at_submit_unless_it_replaces_a_queued_one() {
    let Some(url) = database_url() else { return };
    let db = Db::new(&url, "goals").await;
    let first = db
        .queue
        .submit("t", RunInput::new().goal(goal("t")))
        .await
        .unwrap();
    // Behind the queued goal run, a second goal could never run.
    for policy in [Policy::Enqueue, Policy::Reject] {
        match db
            .queue
            .submit_with("t", RunInput::new().goal("Another goal."), policy)
            .await
        {
            Err(FleetError::GoalTaken { thread, run }) => {
                assert_eq!((thread.as_str(), run), ("t", first), "{policy}");
            }
            other => panic!("{policy}: {other:?}"),
        }
    }
    // A message behind it is fine.
    let follow = db
        .queue
        .submit_with(
            "t",
            RunInput::new().message(Message::user("Once more.")),
            Policy::Enqueue,
        )
        .await
        .unwrap();
    // An interrupt cancels the queued goal run, so its goal replaces that one.
    let second = db
        .queue
        .submit_with("t", RunInput::new().goal(goal("t")), Policy::Interrupt)
        .await
        .unwrap();
    for run in [first, follow] {
        assert!(matches!(
            db.queue.status(run).await.unwrap().status,
            RunStatus::Cancelled { .. }
        ));
    }
    let echo = Echo::new(3);
    let worker = Worker::builder(db.queue.clone(), db.saver.clone())
        .agent(echo.agent("w"))
        .name("w")
        .lease(Duration::from_secs(1))
        .heartbeat(Duration::from_millis(100))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let report = worker.run_until_idle().await.unwrap();
    assert_eq!((report.done, report.failed), (1, 0), "{report:?}");
    // The goal reached the thread: no policy submits another, not even an interrupt.
    for policy in [Policy::Reject, Policy::Enqueue, Policy::Interrupt] {
        match db
            .queue
            .submit_with("t", RunInput::new().goal("Another goal."), policy)
            .await
        {
            Err(FleetError::GoalTaken { run, .. }) => assert_eq!(run, second, "{policy}"),
            other => panic!("{policy}: {other:?}"),
        }
    }
    // Refused submits leave no run behind.
    assert_eq!(db.queue.runs("t").await.unwrap().len(), 3);
    db.drop_schema().await;
}
