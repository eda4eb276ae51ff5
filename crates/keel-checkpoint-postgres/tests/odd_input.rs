//! Thread ids, namespaces, metadata and values with quotes, SQL, unicode, 10 KB strings
//! and NUL: stored verbatim, or refused with a clear `Invalid` before anything is sent.
//! Never an injection: every value is a bound parameter.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use futures::TryStreamExt;
use keel_checkpoint::{
    ChannelDelta, ChannelVersion, Checkpoint, CheckpointError, CheckpointMetadata,
    CheckpointSource, Checkpointer, ListOptions, PendingWrite, PutRequest, ThreadKey,
};
use keel_checkpoint_postgres::{MAX_THREAD_ID_BYTES, PostgresSaver};
use serde_json::{Value, json};

fn first_put(thread: &ThreadKey, metadata: CheckpointMetadata, value: Value) -> PutRequest {
    let mut checkpoint = Checkpoint::new(None);
    let version = ChannelVersion::new(1, checkpoint.id.clone());
    checkpoint
        .channel_versions
        .insert("log".into(), version.clone());
    PutRequest {
        thread: thread.clone(),
        checkpoint,
        metadata,
        deltas: vec![ChannelDelta {
            channel: "log".into(),
            version,
            base: None,
            updates: vec![value.clone()],
            snapshot: Some(json!([value])),
        }],
        expected_head: None,
    }
}

/// Puts one checkpoint on `thread` and reads everything back.
async fn round_trip(
    saver: &PostgresSaver,
    thread: &ThreadKey,
    metadata: CheckpointMetadata,
    value: Value,
) {
    let request = first_put(thread, metadata.clone(), value.clone());
    let id = request.checkpoint.id.clone();
    saver
        .put(request)
        .await
        .unwrap_or_else(|e| panic!("{thread:?}: {e}"));
    let write = PendingWrite::new("task \"1\"", "path/'1'", "log", value.clone());
    saver
        .put_writes(thread, &id, vec![write.clone()])
        .await
        .unwrap();
    let tuple = saver.get(thread, None).await.unwrap().unwrap();
    assert_eq!(tuple.thread, *thread);
    assert_eq!(tuple.checkpoint.id, id);
    assert_eq!(tuple.metadata, metadata);
    assert_eq!(tuple.channels["log"].snapshot, Some(json!([value])));
    assert_eq!(tuple.pending_writes, vec![write]);
    let listed: Vec<_> = saver
        .list(
            thread,
            ListOptions::default().metadata("extra", metadata.extra["extra"].clone()),
        )
        .try_collect()
        .await
        .unwrap();
    assert_eq!(listed.len(), 1, "{thread:?}: list by metadata");
    assert_eq!(listed[0].metadata, metadata);
}

fn invalid(result: Result<impl std::fmt::Debug, CheckpointError>, needle: &str) {
    match result {
        Err(CheckpointError::Invalid { reason }) => {
            assert!(
                reason.contains(needle),
                "reason {reason:?} lacks {needle:?}"
            )
        }
        other => panic!("expected Invalid ({needle}), got {other:?}"),
    }
}

async fn count_rows(db: &common::TestDb) -> i64 {
    let client = db.client().await;
    let s = format!("\"{}\"", db.schema);
    let row = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {s}.keel_checkpoints) + (SELECT count(*) FROM {s}.keel_deltas)
                      + (SELECT count(*) FROM {s}.keel_writes) + (SELECT count(*) FROM {s}.keel_heads)"
            ),
            &[],
        )
        .await
        .unwrap();
    row.get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_thread_ids_and_metadata_are_stored_verbatim() {
    let Some(db) = common::saver("odd_verbatim").await else {
        return;
    };
    let big = "ü".repeat(5 * 1024); // 10 KB of two-byte characters
    let ids = [
        String::new(),
        "'; DROP TABLE keel_checkpoints; --".to_owned(),
        "\"double\" and 'single' quotes, back\\slash, $1 $$ %s {}".to_owned(),
        "スレッド 🧵 ñ é\u{200b}\t\n\r".to_owned(),
        "x".repeat(MAX_THREAD_ID_BYTES),
        "\u{1}\u{7f}control".to_owned(),
    ];
    for (i, thread_id) in ids.iter().enumerate() {
        let thread = ThreadKey::new(thread_id.clone()).with_ns(format!("ns '{i}' ∂"));
        let metadata = CheckpointMetadata::new(CheckpointSource::Input, -1)
            .with_extra("extra", json!(format!("{i} {big}")))
            .with_extra(
                "quote\"key'",
                json!({"nested": ["'", "\"", "\\", "🧵", null, 1.5e-7, u64::MAX]}),
            )
            .with_extra("ключ", json!(thread_id));
        let value = json!({"nul": "a\u{0}b", "big": big, "sql": "'); DELETE FROM keel_heads; --"});
        round_trip(&db.saver, &thread, metadata, value).await;
    }
    // The tables are intact and hold every thread.
    let client = db.client().await;
    let n: i64 = client
        .query_one(
            &format!(
                "SELECT count(DISTINCT thread_id) FROM \"{}\".keel_checkpoints",
                db.schema
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, ids.len() as i64);
    for thread_id in &ids {
        db.saver.delete_thread(thread_id).await.unwrap();
    }
    assert_eq!(count_rows(&db).await, 0);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_postgres_cannot_store_is_refused_before_sending() {
    let Some(db) = common::saver("odd_refused").await else {
        return;
    };
    let saver = &db.saver;
    let meta =
        || CheckpointMetadata::new(CheckpointSource::Input, -1).with_extra("extra", json!("x"));
    let ok = ThreadKey::new("fine");

    // NUL in a thread id, a namespace, a metadata value, key or writer, a channel name.
    let nul_thread = ThreadKey::new("a\u{0}b");
    invalid(
        saver.put(first_put(&nul_thread, meta(), json!(1))).await,
        "thread id contains a NUL",
    );
    invalid(saver.get(&nul_thread, None).await, "NUL");
    invalid(saver.delete_thread("a\u{0}b").await, "NUL");
    invalid(saver.prune(&nul_thread, 1).await, "NUL");
    let nul_ns = ThreadKey::new("fine").with_ns("n\u{0}s");
    invalid(
        saver.put(first_put(&nul_ns, meta(), json!(1))).await,
        "namespace contains a NUL",
    );
    let nul_meta = meta().with_extra("bad", json!(["ok", {"deep": "x\u{0}"}]));
    invalid(
        saver.put(first_put(&ok, nul_meta, json!(1))).await,
        "metadata contains a NUL",
    );
    let nul_key = meta().with_extra("k\u{0}", json!(1));
    invalid(saver.put(first_put(&ok, nul_key, json!(1))).await, "NUL");
    let nul_writer = meta().with_writes(["agent", "to\u{0}ols"]);
    invalid(
        saver.put(first_put(&ok, nul_writer, json!(1))).await,
        "metadata writes contains a NUL",
    );
    let mut nul_channel = first_put(&ok, meta(), json!(1));
    let version = nul_channel.deltas[0].version.clone();
    nul_channel.checkpoint.channel_versions.clear();
    nul_channel
        .checkpoint
        .channel_versions
        .insert("l\u{0}g".into(), version);
    nul_channel.deltas[0].channel = "l\u{0}g".into();
    invalid(saver.put(nul_channel).await, "channel name contains a NUL");

    // Too long to be an index key.
    let long = ThreadKey::new("t".repeat(10 * 1024));
    invalid(
        saver.put(first_put(&long, meta(), json!(1))).await,
        "at most 1024",
    );

    // Nothing was written by any of them.
    assert_eq!(count_rows(&db).await, 0);

    // Pending writes: NUL in a value is kept; in a task id or path it is refused.
    let request = first_put(&ok, meta(), json!(1));
    let id = request.checkpoint.id.clone();
    saver.put(request).await.unwrap();
    let kept = PendingWrite::new("t", "p", "log", json!("nul \u{0} inside"));
    saver
        .put_writes(&ok, &id, vec![kept.clone()])
        .await
        .unwrap();
    invalid(
        saver
            .put_writes(
                &ok,
                &id,
                vec![PendingWrite::new("t\u{0}", "p", "log", json!(1))],
            )
            .await,
        "task id contains a NUL",
    );
    invalid(
        saver
            .put_writes(
                &ok,
                &id,
                vec![PendingWrite::new("t", "p\u{0}", "log", json!(1))],
            )
            .await,
        "task path contains a NUL",
    );
    assert_eq!(
        saver.get(&ok, None).await.unwrap().unwrap().pending_writes,
        vec![kept]
    );

    // A filter no stored metadata can match lists nothing.
    let none: Vec<_> = saver
        .list(
            &ok,
            ListOptions::default().metadata("extra", json!("x\u{0}")),
        )
        .try_collect()
        .await
        .unwrap();
    assert!(none.is_empty());
    db.drop_schema().await;
}
