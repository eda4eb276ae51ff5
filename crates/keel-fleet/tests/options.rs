//! Worker options refused when the worker is built, before any database is reached.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use keel_agent::Agent;
use keel_checkpoint::MemorySaver;
use keel_fleet::{FleetError, MAX_LEASE, Queue, Worker, WorkerBuilder};
use keel_model::ScriptedModel;

/// A builder over a queue that is never reached (building a worker connects nothing).
fn builder() -> WorkerBuilder {
    let queue = Queue::connect("postgres://nobody@127.0.0.1:1/nothing").unwrap();
    Worker::builder(queue, Arc::new(MemorySaver::new()))
        .agent(Agent::builder().model(Arc::new(ScriptedModel::from_texts(["Hello."]))))
}

#[test]
fn a_lease_longer_than_a_day_is_refused_when_built() {
    // Such a lease overflowed the database's time arithmetic: the worker started and
    // every claim failed, so it never ran anything.
    let err = builder()
        .lease(Duration::from_secs(99_999_999_999_999))
        .heartbeat(Duration::from_secs(2))
        .build()
        .unwrap_err();
    match err {
        FleetError::Config { reason } => {
            assert!(reason.contains("too long"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        builder()
            .lease(MAX_LEASE + Duration::from_secs(1))
            .build()
            .is_err()
    );
}

#[test]
fn a_lease_of_a_day_is_allowed() {
    let worker = builder().lease(MAX_LEASE).name("w").build().unwrap();
    assert_eq!(worker.name(), "w");
}
