//! Retention: `prune` after a long graph run keeps the state rebuildable from far fewer
//! rows; `sweep_idle` deletes only threads idle past the age (every namespace idle).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use keel_checkpoint::{Checkpointer, ThreadKey};
use keel_graph::RunConfig;

use common::loop_graph::{self, LoopUpdate, Options};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keeps_what_the_newest_checkpoints_need() {
    let Some(db) = common::saver("prune_graph").await else {
        return;
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    let options = Options {
        stable_ids: true,
        fan_out: true,
    };
    let g = loop_graph::graph(300, Some(Arc::clone(&saver)), options, Arc::new(|_| {}));
    let config = RunConfig::thread("long").with_recursion_limit(usize::MAX);
    let run = g.invoke(LoopUpdate::default(), &config).await.unwrap();
    let before = db.saver.thread_storage("long").await.unwrap();
    assert_eq!(before.checkpoints, 301);

    let removed = saver.prune(&ThreadKey::new("long"), 3).await.unwrap();
    assert_eq!(removed, 298);
    let after = db.saver.thread_storage("long").await.unwrap();
    assert_eq!(after.checkpoints, 3);
    assert!(
        after.deltas < before.deltas / 2 && after.total_bytes() < before.total_bytes() / 2,
        "prune left {after:?} of {before:?}"
    );
    // The newest checkpoints still rebuild the whole state.
    let state = g.get_state(&config).await.unwrap().unwrap().values;
    assert_eq!(
        loop_graph::transcript(&state),
        loop_graph::transcript(&run.state)
    );
    // And the thread goes on from there: a new run on it continues the count.
    let longer = loop_graph::graph(310, Some(saver), options, Arc::new(|_| {}));
    let more = longer.invoke(LoopUpdate::default(), &config).await.unwrap();
    assert_eq!(more.state.count, 310);
    // 10 more steps and 9 more notes, ids all distinct.
    assert_eq!(more.state.messages.len(), 2 * 300 - 1 + 10 + 9);
    let mut ids: Vec<_> = more.state.messages.iter().map(|m| m.id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), more.state.messages.len());
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_deletes_threads_idle_past_the_age() {
    let Some(db) = common::saver("sweep").await else {
        return;
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    let options = Options::default();
    let g = loop_graph::graph(3, Some(saver.clone()), options, Arc::new(|_| {}));
    for thread in ["old", "fresh", "half"] {
        g.invoke(LoopUpdate::default(), &RunConfig::thread(thread))
            .await
            .unwrap();
    }
    // A subgraph namespace of "half" that is still active.
    let mut sub = RunConfig::thread("half");
    sub.checkpoint_ns = "child:1".into();
    g.invoke(LoopUpdate::default(), &sub).await.unwrap();

    // Age "old" (all namespaces) and the root namespace of "half" by two days.
    let client = db.client().await;
    client
        .execute(
            &format!(
                "UPDATE \"{}\".keel_heads SET updated_at = now() - interval '2 days'
                 WHERE thread_id = 'old' OR (thread_id = 'half' AND ns = '')",
                db.schema
            ),
            &[],
        )
        .await
        .unwrap();

    let deleted = db
        .saver
        .sweep_idle(Duration::from_secs(24 * 3600))
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert!(
        saver
            .get(&ThreadKey::new("old"), None)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        saver
            .get(&ThreadKey::new("fresh"), None)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        saver
            .get(&ThreadKey::new("half"), None)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        db.saver.thread_storage("old").await.unwrap().total_bytes(),
        0
    );
    // Nothing left that old: a second sweep deletes nothing.
    assert_eq!(
        db.saver
            .sweep_idle(Duration::from_secs(24 * 3600))
            .await
            .unwrap(),
        0
    );
    // With a zero age every thread is idle.
    assert_eq!(db.saver.sweep_idle(Duration::ZERO).await.unwrap(), 2);
    db.drop_schema().await;
}
