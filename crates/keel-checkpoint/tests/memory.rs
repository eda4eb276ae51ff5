#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! MemorySaver: storage growth (invariant 6), prune's garbage collection, concurrent
//! use. The conformance suite runs in `tests/conformance.rs`.

use keel_checkpoint::*;
use serde_json::{Value, json};

/// Puts one step appending `updates` to channel "log" on top of `parent`, optionally
/// with a snapshot of the full value `full`.
async fn append_step(
    saver: &MemorySaver,
    thread: &ThreadKey,
    parent: Option<&Checkpoint>,
    updates: Vec<Value>,
    full: Option<Value>,
) -> Result<Checkpoint, CheckpointError> {
    let mut checkpoint = match parent {
        Some(parent) => parent.successor(),
        None => Checkpoint::new(None),
    };
    let base = checkpoint.channel_versions.get("log").cloned();
    let version = ChannelVersion::new(
        base.as_ref().map_or(1, |v| v.seq + 1),
        checkpoint.id.clone(),
    );
    checkpoint
        .channel_versions
        .insert("log".into(), version.clone());
    saver
        .put(PutRequest {
            thread: thread.clone(),
            checkpoint: checkpoint.clone(),
            metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
            deltas: vec![ChannelDelta {
                channel: "log".into(),
                version,
                base,
                updates,
                snapshot: full,
            }],
            expected_head: parent.map(|p| p.id.clone()),
        })
        .await?;
    Ok(checkpoint)
}

fn fold(chain: &ChannelChain) -> Vec<Value> {
    let mut items = chain
        .snapshot
        .as_ref()
        .map(|s| s.as_array().unwrap().clone())
        .unwrap_or_default();
    items.extend(chain.updates().cloned());
    items
}

#[tokio::test]
async fn storage_grows_with_new_data_not_state_size() {
    // Invariant 6: 1,000 steps that each append one small update store 1,000 update
    // values (O(n)), not the 500,500 a full copy per step would (O(n²)).
    let saver = MemorySaver::new();
    let thread = ThreadKey::new("growth");
    let mut head: Option<Checkpoint> = None;
    for i in 0..1_000 {
        head = Some(
            append_step(&saver, &thread, head.as_ref(), vec![json!(i)], None)
                .await
                .unwrap(),
        );
    }
    let stats = saver.stats();
    assert_eq!(stats.checkpoints, 1_000);
    assert_eq!(stats.deltas, 1_000);
    assert_eq!(stats.update_values, 1_000);
    assert_eq!(stats.snapshots, 0);

    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    let expected: Vec<Value> = (0..1_000).map(|i| json!(i)).collect();
    assert_eq!(fold(&tuple.channels["log"]), expected);
}

#[tokio::test]
async fn snapshots_add_only_what_the_engine_includes() {
    let saver = MemorySaver::new();
    let thread = ThreadKey::new("snapshots");
    let mut head: Option<Checkpoint> = None;
    let mut full = Vec::new();
    for i in 0..100 {
        full.push(json!(i));
        let snapshot = (i % 10 == 9).then(|| Value::Array(full.clone()));
        head = Some(
            append_step(&saver, &thread, head.as_ref(), vec![json!(i)], snapshot)
                .await
                .unwrap(),
        );
    }
    let stats = saver.stats();
    assert_eq!(stats.update_values, 100);
    assert_eq!(stats.snapshots, 10);
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(tuple.channels["log"].deltas.len(), 0);
    assert_eq!(fold(&tuple.channels["log"]), full);
}

#[tokio::test]
async fn prune_drops_deltas_behind_the_newest_needed_snapshot() {
    let saver = MemorySaver::new();
    let thread = ThreadKey::new("prune-gc");
    let mut head: Option<Checkpoint> = None;
    let mut full = Vec::new();
    let mut ids = Vec::new();
    for i in 0..20 {
        full.push(json!(i));
        let snapshot = (i == 14).then(|| Value::Array(full.clone()));
        let checkpoint = append_step(&saver, &thread, head.as_ref(), vec![json!(i)], snapshot)
            .await
            .unwrap();
        ids.push(checkpoint.id.clone());
        head = Some(checkpoint);
    }
    saver
        .put_writes(
            &thread,
            &ids[3],
            vec![PendingWrite::new("t", "p", "log", json!(1))],
        )
        .await
        .unwrap();
    assert_eq!(saver.stats().pending_writes, 1);

    // Keeping the newest 3 (#17..#19) needs the deltas #14 (snapshot) .. #19.
    assert_eq!(saver.prune(&thread, 3).await.unwrap(), 17);
    let stats = saver.stats();
    assert_eq!(stats.checkpoints, 3);
    assert_eq!(stats.deltas, 6);
    assert_eq!(stats.snapshots, 1);
    assert_eq!(stats.pending_writes, 0);
    for id in &ids[17..] {
        let tuple = saver.get(&thread, Some(id)).await.unwrap().unwrap();
        let n = ids.iter().position(|x| x == id).unwrap();
        let expected: Vec<Value> = (0..=n).map(|i| json!(i)).collect();
        assert_eq!(fold(&tuple.channels["log"]), expected);
    }

    // Keeping 10 (#10..#19) with no snapshot before #14 needs everything back to #0.
    let saver2 = MemorySaver::new();
    let mut head: Option<Checkpoint> = None;
    for i in 0..20 {
        head = Some(
            append_step(&saver2, &thread, head.as_ref(), vec![json!(i)], None)
                .await
                .unwrap(),
        );
    }
    assert_eq!(saver2.prune(&thread, 10).await.unwrap(), 10);
    assert_eq!(saver2.stats().deltas, 20);
    assert_eq!(saver2.prune(&thread, 0).await.unwrap(), 10);
    assert_eq!(saver2.stats(), MemoryStats::default());
}

#[tokio::test]
async fn clones_share_storage() {
    let saver = MemorySaver::new();
    let clone = saver.clone();
    let thread = ThreadKey::new("shared");
    let first = append_step(&saver, &thread, None, vec![json!("a")], None)
        .await
        .unwrap();
    let seen = clone.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(seen.checkpoint.id, first.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_one_winner_per_step() {
    // Many workers on many threads; on each thread's contested step, every worker
    // tries to put from the same head. Exactly one put per step succeeds.
    let saver = MemorySaver::new();
    let mut handles = Vec::new();
    for t in 0..8 {
        let thread = ThreadKey::new(format!("race-{t}"));
        let first = append_step(&saver, &thread, None, vec![json!("start")], None)
            .await
            .unwrap();
        for w in 0..4 {
            let saver = saver.clone();
            let thread = thread.clone();
            let first = first.clone();
            handles.push(tokio::spawn(async move {
                let mut wins = 0;
                let mut head = first;
                for step in 0..25 {
                    match append_step(&saver, &thread, Some(&head), vec![json!([w, step])], None)
                        .await
                    {
                        Ok(next) => {
                            wins += 1;
                            head = next;
                        }
                        Err(CheckpointError::Conflict { actual, .. }) => {
                            // Catch up with the winner and carry on from there.
                            let actual = actual.unwrap();
                            head = saver
                                .get(&thread, Some(&actual))
                                .await
                                .unwrap()
                                .unwrap()
                                .checkpoint;
                        }
                        Err(other) => panic!("unexpected error: {other}"),
                    }
                    tokio::task::yield_now().await;
                }
                wins
            }));
        }
    }
    let mut total_wins = 0;
    for handle in handles {
        total_wins += handle.await.unwrap();
    }
    let stats = saver.stats();
    // Every successful put is one checkpoint; refused ones left nothing behind.
    assert_eq!(stats.checkpoints, 8 + total_wins);
    assert_eq!(stats.deltas, stats.checkpoints);
    for t in 0..8 {
        let thread = ThreadKey::new(format!("race-{t}"));
        let head = saver.get(&thread, None).await.unwrap().unwrap();
        // The head's chain links every winning step on this thread, in order.
        let steps = fold(&head.channels["log"]).len() - 1;
        let listed = {
            use futures::TryStreamExt;
            saver
                .list(&thread, ListOptions::default())
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
                .len()
        };
        assert_eq!(steps + 1, listed);
    }
}

#[tokio::test]
async fn pending_write_round_trip_preserves_json() {
    let saver = MemorySaver::new();
    let thread = ThreadKey::new("json");
    let first = append_step(
        &saver,
        &thread,
        None,
        vec![json!({"k": [1, 2.5, null]})],
        None,
    )
    .await
    .unwrap();
    let value = json!({"z": 1, "a": {"nested": [true, "x"]}, "m": null});
    saver
        .put_writes(
            &thread,
            &first.id,
            vec![PendingWrite::new("t", "0", "log", value.clone())],
        )
        .await
        .unwrap();
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(tuple.pending_writes[0].value, value);
    // preserve_order: key order survives.
    assert_eq!(
        serde_json::to_string(&tuple.pending_writes[0].value).unwrap(),
        serde_json::to_string(&value).unwrap()
    );
}

#[tokio::test]
async fn sweep_idle_measures_age_with_the_clock() {
    // Real ids made now: after a short sleep they are older than a few milliseconds,
    // not older than an hour.
    let saver = MemorySaver::new();
    let a = ThreadKey::new("a");
    let b = ThreadKey::new("b");
    let first = append_step(&saver, &a, None, vec![json!(1)], None)
        .await
        .unwrap();
    append_step(&saver, &a, Some(&first), vec![json!(2)], None)
        .await
        .unwrap();
    append_step(
        &saver,
        &b.clone().with_ns("sub"),
        None,
        vec![json!(3)],
        None,
    )
    .await
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(10));
    let hour = std::time::Duration::from_secs(3600);
    assert!(saver.sweep_idle(hour, 10).await.unwrap().is_empty());
    let ms = std::time::Duration::from_millis(2);
    let mut swept = saver.sweep_idle(ms, 10).await.unwrap();
    swept.sort();
    assert_eq!(swept, ["a", "b"]);
    assert_eq!(saver.stats(), MemoryStats::default());
}

#[tokio::test]
async fn sweep_idle_takes_the_oldest_first() {
    // Not promised by the contract, but MemorySaver does: the limit keeps the newest.
    let saver = MemorySaver::new();
    let mut threads = Vec::new();
    for i in 0..5 {
        let thread = ThreadKey::new(format!("t{i}"));
        append_step(&saver, &thread, None, vec![json!(i)], None)
            .await
            .unwrap();
        threads.push(thread);
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let swept = saver
        .sweep_idle(std::time::Duration::ZERO, 3)
        .await
        .unwrap();
    assert_eq!(swept, ["t0", "t1", "t2"]);
    assert_eq!(saver.stats().threads, 2);
}

/// A backend written before `sweep_idle` existed: it keeps the default.
struct Legacy(MemorySaver);

#[async_trait::async_trait]
impl Checkpointer for Legacy {
    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> Result<Option<CheckpointTuple>, CheckpointError> {
        self.0.get(thread, id).await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> futures::stream::BoxStream<'a, Result<CheckpointSummary, CheckpointError>> {
        self.0.list(thread, options)
    }

    async fn put(&self, request: PutRequest) -> Result<(), CheckpointError> {
        self.0.put(request).await
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), CheckpointError> {
        self.0.put_writes(thread, checkpoint, writes).await
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), CheckpointError> {
        self.0.delete_thread(thread_id).await
    }

    async fn prune(&self, thread: &ThreadKey, keep_last: usize) -> Result<usize, CheckpointError> {
        self.0.prune(thread, keep_last).await
    }
}

#[tokio::test]
async fn sweep_idle_defaults_to_unsupported_and_arc_forwards_it() {
    let inner = MemorySaver::new();
    append_step(&inner, &ThreadKey::new("t"), None, vec![json!(1)], None)
        .await
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    let legacy = std::sync::Arc::new(Legacy(inner.clone())) as std::sync::Arc<dyn Checkpointer>;
    let err = legacy
        .sweep_idle(std::time::Duration::ZERO, 10)
        .await
        .unwrap_err();
    assert!(err.is_unsupported(), "{err:?}");
    assert!(matches!(
        err,
        CheckpointError::Unsupported {
            operation: "sweep_idle"
        }
    ));
    assert_eq!(inner.stats().threads, 1, "Unsupported deleted something");
    // Through Arc<dyn> the real implementation is reached, not the default.
    let shared = std::sync::Arc::new(inner.clone()) as std::sync::Arc<dyn Checkpointer>;
    assert_eq!(
        shared
            .sweep_idle(std::time::Duration::ZERO, 10)
            .await
            .unwrap(),
        ["t"]
    );
}
