//! Retention: `prune` after a long graph run keeps the state rebuildable from far fewer
//! rows; `sweep_idle` deletes only threads idle past the age (every namespace idle, by
//! checkpoint id time), in bounded batches, and keeps a thread written while it waits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use keel_checkpoint::{
    ChannelDelta, ChannelVersion, Checkpoint, CheckpointId, CheckpointMetadata, CheckpointSource,
    Checkpointer, PutRequest, ThreadKey,
};
use keel_checkpoint_postgres::ThreadStorage;
use keel_graph::RunConfig;
use serde_json::json;

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

/// The first checkpoint of `thread`, with id `id` (e.g. an old one) and one delta.
fn first_at(thread: &ThreadKey, id: &str) -> PutRequest {
    let id: CheckpointId = id.parse().unwrap();
    let mut checkpoint = Checkpoint::new(None);
    checkpoint.id = id.clone();
    let version = ChannelVersion::new(1, id);
    checkpoint
        .channel_versions
        .insert("log".into(), version.clone());
    PutRequest {
        thread: thread.clone(),
        checkpoint,
        metadata: CheckpointMetadata::new(CheckpointSource::Input, -1),
        deltas: vec![ChannelDelta {
            channel: "log".into(),
            version,
            base: None,
            updates: vec![json!("old")],
            snapshot: None,
        }],
        expected_head: None,
    }
}

/// A v7 id from June 2023 ending in `n`.
fn old_id(n: u64) -> String {
    format!("01890a5d-ac96-7000-8000-{n:012x}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_deletes_threads_idle_past_the_age() {
    let Some(db) = common::saver("sweep").await else {
        return;
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    // Graph runs on "fresh" and on a subgraph namespace of "half", whose root namespace
    // (like both namespaces of "old") was last written in June 2023.
    saver
        .put(first_at(&ThreadKey::new("old"), &old_id(1)))
        .await
        .unwrap();
    saver
        .put(first_at(
            &ThreadKey::new("old").with_ns("child:1"),
            &old_id(2),
        ))
        .await
        .unwrap();
    saver
        .put(first_at(&ThreadKey::new("half"), &old_id(3)))
        .await
        .unwrap();
    let g = loop_graph::graph(3, Some(saver.clone()), Options::default(), Arc::new(|_| {}));
    g.invoke(LoopUpdate::default(), &RunConfig::thread("fresh"))
        .await
        .unwrap();
    let mut sub = RunConfig::thread("half");
    sub.checkpoint_ns = "child:1".into();
    g.invoke(LoopUpdate::default(), &sub).await.unwrap();
    assert!(db.saver.thread_storage("old").await.unwrap().total_bytes() > 0);

    let day = Duration::from_secs(24 * 3600);
    assert_eq!(db.saver.sweep_idle(day).await.unwrap(), 1);
    for ns in ["", "child:1"] {
        let key = ThreadKey::new("old").with_ns(ns);
        assert!(saver.get(&key, None).await.unwrap().is_none());
    }
    assert_eq!(
        db.saver.thread_storage("old").await.unwrap(),
        ThreadStorage::default()
    );
    for thread in ["fresh", "half"] {
        let key = ThreadKey::new(thread);
        assert!(saver.get(&key, None).await.unwrap().is_some(), "{thread}");
    }
    // Nothing left that old: a second sweep deletes nothing.
    assert_eq!(db.saver.sweep_idle(day).await.unwrap(), 0);
    assert!(saver.sweep_idle(day, 10).await.unwrap().is_empty());
    // With a zero age every thread is idle once its newest id's millisecond is past.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut swept = saver.sweep_idle(Duration::ZERO, 10).await.unwrap();
    swept.sort();
    assert_eq!(swept, ["fresh", "half"]);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_in_batches_and_the_inherent_sweep_takes_them_all() {
    let Some(db) = common::saver("sweep_batches").await else {
        return;
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    // 600 idle threads, 100 of them with a second idle namespace, and 3 busy ones.
    for i in 0..600u64 {
        let thread = ThreadKey::new(format!("idle-{i:03}"));
        saver.put(first_at(&thread, &old_id(i))).await.unwrap();
        if i % 6 == 0 {
            let sub = thread.with_ns("sub");
            saver.put(first_at(&sub, &old_id(1000 + i))).await.unwrap();
        }
    }
    let g = loop_graph::graph(1, Some(saver.clone()), Options::default(), Arc::new(|_| {}));
    for i in 0..3 {
        g.invoke(
            LoopUpdate::default(),
            &RunConfig::thread(format!("busy-{i}")),
        )
        .await
        .unwrap();
    }
    let day = Duration::from_secs(24 * 3600);
    // The trait's sweep: at most the limit per call, each thread once.
    let first = saver.sweep_idle(day, 250).await.unwrap();
    assert_eq!(first.len(), 250);
    let distinct: std::collections::BTreeSet<&String> = first.iter().collect();
    assert_eq!(distinct.len(), 250);
    assert!(first.iter().all(|t| t.starts_with("idle-")));
    // The inherent sweep takes the other 350 in batches of 256.
    assert_eq!(db.saver.sweep_idle(day).await.unwrap(), 350);
    assert!(saver.sweep_idle(day, 250).await.unwrap().is_empty());
    let client = db.client().await;
    let left: Vec<String> = client
        .query(
            &format!(
                "SELECT DISTINCT thread_id FROM \"{}\".keel_checkpoints ORDER BY 1",
                db.schema
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["busy-0", "busy-1", "busy-2"]);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_written_while_the_sweep_waits_for_it_is_kept() {
    let Some(db) = common::saver("sweep_race").await else {
        return;
    };
    let thread = ThreadKey::new("racing");
    db.saver.put(first_at(&thread, &old_id(1))).await.unwrap();
    // Another session holds the thread's head row, as a put in flight does, and moves
    // the head to a fresh id before committing.
    let mut other = db.client().await;
    let tx = other.transaction().await.unwrap();
    let heads = format!("\"{}\".keel_heads", db.schema);
    tx.execute(
        &format!("SELECT 1 FROM {heads} WHERE thread_id = 'racing' FOR UPDATE"),
        &[],
    )
    .await
    .unwrap();
    let saver = db.saver.clone();
    let sweep = tokio::spawn(async move {
        Checkpointer::sweep_idle(&saver, Duration::from_secs(3600), 10).await
    });
    // The sweep picked the thread (its committed head is old) and waits for the lock.
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                   AND query LIKE '%' || $1 || '%FOR UPDATE%'";
    let probe = db.client().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let waits = || async {
        let row = probe.query_one(waiting, &[&db.schema]).await.unwrap();
        row.get::<_, i64>(0) > 0
    };
    while !waits().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sweep never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fresh = uuid::Uuid::parse_str(CheckpointId::new().as_str()).unwrap();
    tx.execute(
        &format!("UPDATE {heads} SET head = $1 WHERE thread_id = 'racing'"),
        &[&fresh],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(sweep.await.unwrap().unwrap().is_empty());
    assert_eq!(
        db.saver.thread_storage("racing").await.unwrap().checkpoints,
        1
    );
    db.drop_schema().await;
}

/// Steps alternating channels "a" and "b", each appending one item, with a snapshot of
/// "a" every fourth time it is written, so prunes have deltas to delete.
fn alternating_steps(
    thread: &ThreadKey,
    steps: std::ops::Range<usize>,
    parent: &mut Option<Checkpoint>,
    values: &mut std::collections::BTreeMap<&'static str, Vec<serde_json::Value>>,
) -> Vec<PutRequest> {
    let mut out = Vec::new();
    for i in steps {
        let channel = if i % 2 == 0 { "a" } else { "b" };
        let item = json!(format!("{channel}{i}"));
        let value = values.entry(channel).or_default();
        value.push(item.clone());
        let mut checkpoint = parent
            .as_ref()
            .map_or_else(|| Checkpoint::new(None), Checkpoint::successor);
        let base = checkpoint.channel_versions.get(channel).cloned();
        let version = ChannelVersion::new(
            base.as_ref().map_or(1, |b| b.seq + 1),
            checkpoint.id.clone(),
        );
        checkpoint
            .channel_versions
            .insert(channel.into(), version.clone());
        let snapshot =
            (channel == "a" && value.len().is_multiple_of(4)).then(|| json!(value.clone()));
        out.push(PutRequest {
            thread: thread.clone(),
            checkpoint: checkpoint.clone(),
            metadata: CheckpointMetadata::new(CheckpointSource::Loop, i as i64),
            deltas: vec![ChannelDelta {
                channel: channel.into(),
                version,
                base,
                updates: vec![item],
                snapshot,
            }],
            expected_head: parent.as_ref().map(|p| p.id.clone()),
        });
        *parent = Some(checkpoint);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writers_prune_from_memory_and_a_fresh_savers_prune_leave_the_same_rows() {
    let thread = ThreadKey::new("t");
    let mut parent = None;
    let mut values = std::collections::BTreeMap::new();
    let early = alternating_steps(&thread, 0..40, &mut parent, &mut values);
    let late = alternating_steps(&thread, 40..60, &mut parent, &mut values);

    // `fresh`: every prune by a saver that put nothing (it reads the chains back);
    // `writer`: every prune by the saver that put the steps (it walks the links it
    // remembers, including links of deltas another saver's prune deleted).
    let mut results = Vec::new();
    for (name, fresh) in [("prune_fresh", true), ("prune_writer", false)] {
        let Some(db) = common::saver(name).await else {
            return;
        };
        let other = || keel_checkpoint_postgres::PostgresSaver::connect(&db.config).unwrap();
        let writer = &db.saver;
        writer.put_many(early.clone()).await.unwrap();
        // Another saver prunes behind the writer's back in both schemas.
        assert_eq!(other().prune(&thread, 20).await.unwrap(), 20);
        let pruner = |fresh| if fresh { other() } else { writer.clone() };
        assert_eq!(pruner(fresh).prune(&thread, 5).await.unwrap(), 15);
        writer.put_many(late.clone()).await.unwrap();
        assert_eq!(pruner(fresh).prune(&thread, 5).await.unwrap(), 20);

        let mut tuples = Vec::new();
        let mut cursor = None;
        while let Some(t) = other().get(&thread, cursor.as_ref()).await.unwrap() {
            cursor = t.checkpoint.parent.clone();
            tuples.push(t);
            if tuples.len() == 5 {
                break;
            }
        }
        assert_eq!(tuples.len(), 5);
        results.push((writer.thread_storage("t").await.unwrap(), tuples));
        db.drop_schema().await;
    }
    let [fresh, writer] = results.as_slice() else {
        panic!("both runs measured");
    };
    assert_eq!(fresh.1, writer.1, "the kept checkpoints rebuild alike");
    assert_eq!(
        fresh.0.checkpoint_bytes + fresh.0.delta_bytes,
        writer.0.checkpoint_bytes + writer.0.delta_bytes,
        "the same rows are left: {fresh:?} {writer:?}"
    );
    assert_eq!(
        (fresh.0.checkpoints, fresh.0.deltas, fresh.0.snapshots),
        (writer.0.checkpoints, writer.0.deltas, writer.0.snapshots)
    );
    assert!(
        fresh.0.deltas < 60 && fresh.0.deltas > 5,
        "the prunes deleted deltas but kept the chains: {:?}",
        fresh.0
    );
    let head = &fresh.1[0];
    for channel in ["a", "b"] {
        let chain = &head.channels[channel];
        let mut items = match &chain.snapshot {
            Some(serde_json::Value::Array(items)) => items.clone(),
            Some(other) => panic!("snapshot is not an array: {other}"),
            None => Vec::new(),
        };
        items.extend(chain.updates().cloned());
        assert_eq!(items, values[channel], "{channel}");
    }
}

/// A prune commits without waiting for the WAL flush (losing it to a crash loses
/// nothing: the next prune deletes the same rows), and only the prune: the connection
/// it used goes back to the pool with every later commit flushed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prunes_unflushed_commit_does_not_outlive_the_prune() {
    let Some(db) = common::saver_with("prune_no_flush", |c| c.pool_size(1)).await else {
        return;
    };
    let thread = ThreadKey::new("t");
    let (mut parent, mut values) = (None, std::collections::BTreeMap::new());
    let steps = alternating_steps(&thread, 0..12, &mut parent, &mut values);
    db.saver.put_many(steps).await.unwrap();
    assert_eq!(db.saver.prune(&thread, 5).await.unwrap(), 7);
    // The pool's one connection, the one the prune ran on.
    let client = db.saver.pool().get().await.unwrap();
    let row = client
        .query_one("SHOW synchronous_commit", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "on");
    drop(client);
    assert_eq!(db.saver.thread_storage("t").await.unwrap().checkpoints, 5);
    db.drop_schema().await;
}

/// A prune cancelled while it waits (here for the head row, which another transaction
/// holds) leaves no transaction open on a pooled connection: it deleted nothing, and the
/// next put on the saver (whose pool has one connection) commits on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_prune_leaves_no_transaction_open() {
    let Some(db) = common::saver_with("prune_cancelled", |c| c.pool_size(1)).await else {
        return;
    };
    let thread = ThreadKey::new("t");
    let (mut parent, mut values) = (None, std::collections::BTreeMap::new());
    let steps = alternating_steps(&thread, 0..12, &mut parent, &mut values);
    db.saver.put_many(steps).await.unwrap();

    let mut other = db.client().await;
    let holder = other.transaction().await.unwrap();
    holder
        .execute(
            &format!(
                "SELECT 1 FROM {}.keel_heads WHERE thread_id = 't' FOR UPDATE",
                db.schema
            ),
            &[],
        )
        .await
        .unwrap();
    let prune = tokio::time::timeout(Duration::from_millis(300), db.saver.prune(&thread, 5));
    assert!(
        prune.await.is_err(),
        "the prune should wait for the head row"
    );
    holder.rollback().await.unwrap();

    let next = alternating_steps(&thread, 12..13, &mut parent, &mut values);
    db.saver.put_many(next).await.unwrap();
    // Seen from another connection: the new checkpoint is committed and the cancelled
    // prune removed nothing.
    let count = format!(
        "SELECT count(*) FROM {}.keel_checkpoints WHERE thread_id = 't'",
        db.schema
    );
    let count = async |client: &tokio_postgres::Client| {
        client
            .query_one(&count, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(count(&other).await, 13);
    // The saver goes on: a prune now runs to the end.
    assert_eq!(db.saver.prune(&thread, 5).await.unwrap(), 8);
    assert_eq!(count(&other).await, 5);
    drop(other);
    db.drop_schema().await;
}
