//! Helpers shared by the integration tests: steps on "append" channels.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use futures::TryStreamExt;
use keel_checkpoint::{
    ChannelChain, ChannelDelta, ChannelVersion, Checkpoint, CheckpointId, CheckpointMetadata,
    CheckpointSource, CheckpointSummary, Checkpointer, ListOptions, PutRequest, ThreadKey,
};
use serde_json::{Value, json};

/// Puts the step on top of `parent` (a fresh thread when `None`) that appends `items`
/// to the "log" channel, and makes it the new `parent`.
pub async fn put_log_step(
    saver: &impl Checkpointer,
    thread: &ThreadKey,
    parent: &mut Option<Checkpoint>,
    items: Vec<Value>,
) {
    let request = step(thread, parent.as_ref(), "log", items);
    saver.put(request.clone()).await.unwrap();
    *parent = Some(request.checkpoint);
}

/// A put of one step on top of `parent` (a fresh thread when `None`) appending `items`
/// to `channel`, expecting `parent` to be the head.
pub fn step(
    thread: &ThreadKey,
    parent: Option<&Checkpoint>,
    channel: &str,
    items: Vec<Value>,
) -> PutRequest {
    let mut checkpoint = match parent {
        Some(parent) => parent.successor(),
        None => Checkpoint::new(None),
    };
    let base = checkpoint.channel_versions.get(channel).cloned();
    let version = ChannelVersion::new(
        base.as_ref().map_or(1, |v| v.seq + 1),
        checkpoint.id.clone(),
    );
    checkpoint
        .channel_versions
        .insert(channel.to_owned(), version.clone());
    let source = if parent.is_some() {
        CheckpointSource::Loop
    } else {
        CheckpointSource::Input
    };
    PutRequest {
        thread: thread.clone(),
        metadata: CheckpointMetadata::new(source, parent.map_or(-1, |_| 0)),
        deltas: vec![ChannelDelta {
            channel: channel.to_owned(),
            version,
            base,
            updates: items,
            snapshot: None,
        }],
        expected_head: parent.map(|p| p.id.clone()),
        checkpoint,
    }
}

/// Every checkpoint of `thread`, newest first.
pub async fn list_all(saver: &impl Checkpointer, thread: &ThreadKey) -> Vec<CheckpointSummary> {
    saver
        .list(thread, ListOptions::default())
        .try_collect()
        .await
        .unwrap()
}

/// The value of an append channel.
pub fn fold(chain: &ChannelChain) -> Vec<Value> {
    let mut items = match &chain.snapshot {
        Some(Value::Array(items)) => items.clone(),
        Some(other) => panic!("snapshot is not an array: {other}"),
        None => Vec::new(),
    };
    items.extend(chain.updates().cloned());
    items
}

/// `n` items of about `size` bytes each, tagged with `tag`.
pub fn items(tag: &str, n: usize, size: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let mut s = format!("{tag}-{i}:");
            while s.len() < size {
                s.push('x');
            }
            json!(s)
        })
        .collect()
}

/// Checks that `ids` form one linear history: each checkpoint's parent is the one
/// before it.
pub fn assert_linear(history: &[(CheckpointId, Option<CheckpointId>)]) {
    for pair in history.windows(2) {
        assert_eq!(
            pair[1].1.as_ref(),
            Some(&pair[0].0),
            "history forks at {}",
            pair[1].0
        );
    }
}
