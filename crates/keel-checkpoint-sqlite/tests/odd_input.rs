#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Odd input is stored verbatim and never reaches SQL as text: quotes, SQL fragments,
//! Unicode, 10 KB strings and NUL bytes in thread ids, namespaces, channel names, task
//! ids, metadata keys and values, and list filters.

mod common;

use common::{fold, step};
use futures::TryStreamExt;
use keel_checkpoint::{
    CheckpointMetadata, CheckpointSource, Checkpointer, ListOptions, PendingWrite, ThreadKey,
};
use keel_checkpoint_sqlite::SqliteSaver;
use serde_json::{Value, json};

fn odd_strings() -> Vec<String> {
    vec![
        "plain".into(),
        String::new(),
        "it's \"quoted\" `back` [bracket]".into(),
        "'; DROP TABLE checkpoints; --".into(),
        "x' OR '1'='1".into(),
        "%_ like wildcards _%".into(),
        "naïve café — 日本語 — 🦀 — \u{202e}rtl".into(),
        "nul\0inside".into(),
        "\0".into(),
        "trailing nul\0".into(),
        "line\nbreak\ttab\r\n".into(),
        "\\ backslash \\\\".into(),
        "/".into(),
        "ns:with|separators".into(),
        "k".repeat(10 * 1024),
        format!("{}\0{}", "é".repeat(5 * 1024), "z"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_thread_ids_namespaces_and_channels_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("odd.db")).await.unwrap();
    let odd = odd_strings();
    let mut stored = Vec::new();
    for (i, s) in odd.iter().enumerate() {
        let thread = ThreadKey::new(s.clone()).with_ns(odd[(i + 3) % odd.len()].clone());
        let channel = odd[(i + 5) % odd.len()].clone();
        let first = step(&thread, None, &channel, vec![json!(s)]);
        saver.put(first.clone()).await.unwrap();
        let second = step(&thread, Some(&first.checkpoint), &channel, vec![json!(i)]);
        saver.put(second.clone()).await.unwrap();
        let write = PendingWrite::new(s.clone(), s.clone(), s.clone(), json!({ s.clone(): s }));
        saver
            .put_writes(&thread, &second.checkpoint.id, vec![write.clone()])
            .await
            .unwrap();
        stored.push((thread, channel, second, write));
    }
    for (i, (thread, channel, second, write)) in stored.iter().enumerate() {
        let tuple = saver.get(thread, None).await.unwrap().unwrap();
        assert_eq!(&tuple.thread, thread);
        assert_eq!(tuple.checkpoint, second.checkpoint);
        assert_eq!(
            fold(&tuple.channels[channel]),
            vec![json!(odd[i]), json!(i)]
        );
        assert_eq!(tuple.pending_writes, vec![write.clone()]);
        let listed: Vec<_> = saver
            .list(thread, ListOptions::default())
            .try_collect()
            .await
            .unwrap();
        assert_eq!(listed.len(), 2, "thread {:?}", thread.thread_id);
        assert!(listed.iter().all(|s| &s.thread == thread));
    }
    // Keys differing only after a NUL byte are different keys.
    for (a, b) in [
        ("nul\0inside", "nul"),
        ("\0", ""),
        ("trailing nul\0", "trailing nul"),
    ] {
        let thread = ThreadKey::new(b);
        let found = saver.get(&thread, None).await.unwrap();
        if let Some(found) = found {
            assert_ne!(found.thread.thread_id, a);
        }
    }
    // Nothing was injected: every thread is still there, and one delete removes one.
    assert_eq!(saver.stats().await.unwrap().threads, odd.len() as u64);
    saver
        .delete_thread("'; DROP TABLE checkpoints; --")
        .await
        .unwrap();
    assert_eq!(saver.stats().await.unwrap().threads, odd.len() as u64 - 1);
    saver.delete_thread("nul").await.unwrap();
    assert_eq!(saver.stats().await.unwrap().threads, odd.len() as u64 - 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_metadata_is_stored_verbatim_and_filters_match_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("meta.db")).await.unwrap();
    let thread = ThreadKey::new("meta");
    let odd = odd_strings();
    let mut parent = None;
    let mut all = Vec::new();
    for (i, s) in odd.iter().enumerate() {
        let mut request = step(&thread, parent.as_ref(), "log", vec![json!(i)]);
        request.metadata = CheckpointMetadata::new(CheckpointSource::Loop, i as i64)
            .with_extra(s.clone(), json!(s))
            .with_extra("odd", json!(s))
            .with_extra("nested", json!({"k": [s, 1, 2.5, null, true], "n": -7}))
            .with_extra("index", json!(i))
            .with_extra("float", json!(if i % 2 == 0 { 0.0 } else { -0.0 }));
        saver.put(request.clone()).await.unwrap();
        parent = Some(request.checkpoint.clone());
        all.push(request);
    }
    let listed: Vec<_> = saver
        .list(&thread, ListOptions::default())
        .try_collect()
        .await
        .unwrap();
    let newest_first: Vec<_> = all.iter().rev().map(|r| r.metadata.clone()).collect();
    assert_eq!(
        listed
            .iter()
            .map(|s| s.metadata.clone())
            .collect::<Vec<_>>(),
        newest_first,
        "metadata stored verbatim"
    );

    let list = |options: ListOptions| {
        let saver = saver.clone();
        let thread = thread.clone();
        async move {
            saver
                .list(&thread, options)
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.metadata.step)
                .collect::<Vec<i64>>()
        }
    };
    for (i, s) in odd.iter().enumerate() {
        let i = i as i64;
        assert_eq!(
            list(ListOptions::default().metadata("odd", json!(s))).await,
            vec![i]
        );
        assert_eq!(
            list(ListOptions::default().metadata(s.clone(), json!(s))).await,
            vec![i]
        );
        let nested = json!({"n": -7, "k": [s, 1, 2.5, null, true]});
        assert_eq!(
            list(ListOptions::default().metadata("nested", nested)).await,
            vec![i],
            "object filters compare as values, whatever the key order"
        );
    }
    // -0.0 equals 0.0 as a JSON value: every checkpoint matches.
    assert_eq!(
        list(ListOptions::default().metadata("float", json!(0.0)))
            .await
            .len(),
        odd.len()
    );
    assert_eq!(
        list(ListOptions::default().metadata("index", json!(3))).await,
        vec![3]
    );
    assert!(
        list(ListOptions::default().metadata("index", json!("3")))
            .await
            .is_empty()
    );
    assert!(
        list(ListOptions::default().metadata("odd", Value::Null))
            .await
            .is_empty()
    );
    assert!(
        list(ListOptions::default().metadata("odd", json!("x' OR '1'='1' --")))
            .await
            .is_empty()
    );
    assert_eq!(
        list(ListOptions::default().metadata("odd", json!("x' OR '1'='1"))).await,
        vec![4]
    );
}

#[tokio::test(flavor = "current_thread")]
async fn list_pages_through_long_histories() {
    // More checkpoints than one page, with filters that match rarely and often.
    let saver = SqliteSaver::open_in_memory().await.unwrap();
    let thread = ThreadKey::new("long");
    let mut parent = None;
    let mut ids = Vec::new();
    for i in 0..700i64 {
        let mut request = step(&thread, parent.as_ref(), "log", vec![json!(i)]);
        request.metadata = CheckpointMetadata::new(CheckpointSource::Loop, i)
            .with_extra("every7", json!(i % 7 == 0))
            .with_extra("bucket", json!(i / 100));
        saver.put(request.clone()).await.unwrap();
        parent = Some(request.checkpoint.clone());
        ids.push(request.checkpoint.id);
    }
    let steps = |options: ListOptions| {
        let saver = saver.clone();
        let thread = thread.clone();
        async move {
            saver
                .list(&thread, options)
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.metadata.step)
                .collect::<Vec<i64>>()
        }
    };
    assert_eq!(
        steps(ListOptions::default()).await,
        (0..700).rev().collect::<Vec<_>>()
    );
    let sevens: Vec<i64> = (0..700).rev().filter(|i| i % 7 == 0).collect();
    assert_eq!(
        steps(ListOptions::default().metadata("every7", json!(true))).await,
        sevens
    );
    assert_eq!(
        steps(
            ListOptions::default()
                .metadata("every7", json!(true))
                .limit(30)
        )
        .await,
        sevens[..30]
    );
    assert_eq!(
        steps(
            ListOptions::default()
                .metadata("bucket", json!(2))
                .before(ids[250].clone())
                .limit(20)
        )
        .await,
        (230..250).rev().collect::<Vec<_>>()
    );
    assert_eq!(
        steps(ListOptions::default().limit(300).before(ids[400].clone())).await,
        (100..400).rev().collect::<Vec<_>>()
    );
    assert_eq!(
        steps(ListOptions::default().metadata("step", json!(650))).await,
        vec![650]
    );
    // A stream dropped early reads no further.
    let first_two: Vec<_> = {
        use futures::StreamExt;
        saver
            .list(&thread, ListOptions::default())
            .take(2)
            .try_collect()
            .await
            .unwrap()
    };
    assert_eq!(first_two.len(), 2);
}
