//! Fencing (invariant 7) with two workers on one thread, each with its own pool, as two
//! machines would be: in every step exactly one put wins and the other gets `Conflict`
//! naming the winner, and nothing of the loser's step is stored.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use futures::TryStreamExt;
use keel_checkpoint::{
    ChannelDelta, ChannelVersion, CheckpointError, CheckpointMetadata, CheckpointSource,
    Checkpointer, ListOptions, PutRequest, ThreadKey,
};
use keel_checkpoint_postgres::PostgresSaver;
use keel_graph::{Command, GraphError, RunConfig};
use serde_json::json;
use tokio::sync::Barrier;

use common::loop_graph::{self, LoopUpdate, Options};

/// One step of `worker` on top of the head it read: appends its name to "log".
fn step(head: &keel_checkpoint::CheckpointTuple, thread: &ThreadKey, worker: &str) -> PutRequest {
    let mut checkpoint = head.checkpoint.successor();
    let base = checkpoint.channel_versions["log"].clone();
    let version = ChannelVersion::new(base.seq + 1, checkpoint.id.clone());
    checkpoint
        .channel_versions
        .insert("log".into(), version.clone());
    PutRequest {
        thread: thread.clone(),
        checkpoint,
        metadata: CheckpointMetadata::new(CheckpointSource::Loop, head.metadata.step + 1)
            .with_extra("worker", json!(worker)),
        deltas: vec![ChannelDelta {
            channel: "log".into(),
            version,
            base: Some(base),
            updates: vec![json!(worker)],
            snapshot: None,
        }],
        expected_head: Some(head.checkpoint.id.clone()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_one_winner_per_step() {
    let Some(db) = common::saver("fencing").await else {
        return;
    };
    let other = PostgresSaver::connect(&db.config).unwrap();
    let thread = ThreadKey::new("contested");
    // The first checkpoint.
    let mut first = keel_checkpoint::Checkpoint::new(None);
    let version = ChannelVersion::new(1, first.id.clone());
    first.channel_versions.insert("log".into(), version.clone());
    db.saver
        .put(PutRequest {
            thread: thread.clone(),
            checkpoint: first,
            metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
            deltas: vec![ChannelDelta {
                channel: "log".into(),
                version,
                base: None,
                updates: vec![json!("start")],
                snapshot: None,
            }],
            expected_head: None,
        })
        .await
        .unwrap();

    const ROUNDS: usize = 40;
    let barrier = Arc::new(Barrier::new(2));
    let run = |saver: PostgresSaver, name: &'static str| {
        let barrier = Arc::clone(&barrier);
        let thread = thread.clone();
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for _ in 0..ROUNDS {
                // Both read the same head, then both put on top of it at once.
                let head = saver.get(&thread, None).await.unwrap().unwrap();
                let request = step(&head, &thread, name);
                let id = request.checkpoint.id.to_string();
                barrier.wait().await;
                outcomes.push(saver.put(request).await.map(|()| id));
                barrier.wait().await;
            }
            outcomes
        })
    };
    let a = run(db.saver.clone(), "a");
    let b = run(other.clone(), "b");
    let (a, b) = (a.await.unwrap(), b.await.unwrap());

    let mut winners = vec!["start".to_owned()];
    let mut losers = Vec::new();
    for (round, (ra, rb)) in a.into_iter().zip(b).enumerate() {
        match (ra, rb) {
            (Ok(id), Err(CheckpointError::Conflict { actual, .. })) => {
                assert_eq!(actual.map(|a| a.to_string()), Some(id.clone()));
                winners.push("a".into());
            }
            (Err(CheckpointError::Conflict { actual, .. }), Ok(id)) => {
                assert_eq!(actual.map(|a| a.to_string()), Some(id.clone()));
                winners.push("b".into());
            }
            other => panic!("round {round}: expected one winner and one Conflict, got {other:?}"),
        }
        losers.push(round);
    }
    // The history is one chain of winners; the log holds exactly their items.
    let head = db.saver.get(&thread, None).await.unwrap().unwrap();
    let log: Vec<String> = head.channels["log"]
        .updates()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(log, winners);
    let history: Vec<_> = other
        .list(&thread, ListOptions::default())
        .try_collect()
        .await
        .unwrap();
    assert_eq!(history.len(), ROUNDS + 1);
    for pair in history.windows(2) {
        assert_eq!(
            pair[0].checkpoint.parent.as_ref(),
            Some(&pair[1].checkpoint.id)
        );
    }
    assert_eq!(losers.len(), ROUNDS);
    db.drop_schema().await;
}

/// Two graph runs resuming one thread at once: one runs, the other is fenced off with
/// a `Conflict`, and the thread's state is the winner's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_graph_workers_on_one_thread() {
    let Some(db) = common::saver("fencing_graph").await else {
        return;
    };
    let options = Options {
        stable_ids: true,
        fan_out: false,
    };
    let noop = Arc::new(|_| {});
    let saver_a: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    let saver_b: Arc<dyn Checkpointer> = Arc::new(PostgresSaver::connect(&db.config).unwrap());
    let config = RunConfig::thread("graph-race").with_recursion_limit(usize::MAX);
    let g1 = loop_graph::graph(300, Some(saver_a), options, noop.clone());
    let g2 = loop_graph::graph(300, Some(saver_b), options, noop);
    // Run a few steps, then stop (recursion limit) with the next step pending: both
    // workers resume from that same head.
    let seed = loop_graph::graph(
        300,
        Some(Arc::new(db.saver.clone())),
        options,
        Arc::new(|_| {}),
    );
    let stopped = seed
        .invoke(
            LoopUpdate::default(),
            &config.clone().with_recursion_limit(5),
        )
        .await;
    assert!(matches!(stopped, Err(GraphError::RecursionLimit { .. })));

    let (r1, r2) = tokio::join!(
        g1.invoke(Command::none(), &config),
        g2.invoke(Command::none(), &config)
    );
    let conflict =
        |r: &Result<_, GraphError>| matches!(r, Err(GraphError::Checkpoint(e)) if e.is_conflict());
    let (winner, loser) = match (&r1, &r2) {
        (Ok(w), l) | (l, Ok(w)) if conflict(l) => (w, l),
        _ => panic!(
            "expected one run to finish and one to be fenced off: {:?} / {:?}",
            r1.as_ref().map(|r| r.state.count),
            r2.as_ref().map(|r| r.state.count)
        ),
    };
    assert!(conflict(loser));
    assert_eq!(winner.state.count, 300);
    let stored = g1.get_state(&config).await.unwrap().unwrap().values;
    assert_eq!(
        loop_graph::transcript(&stored),
        loop_graph::transcript(&winner.state)
    );
    db.drop_schema().await;
}
