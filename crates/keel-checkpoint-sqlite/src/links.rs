//! What the writer remembers of the delta chains it stored, so a prune walks them in
//! memory instead of reading each delta's base back from the database.
//!
//! A delta's link (its seq, whether it holds a snapshot, its base) never changes once
//! stored, and its key (namespace, channel, writer checkpoint id) is never reused: ids
//! are fresh UUIDs. So a remembered link is either right or about a delta that is gone,
//! and a prune only follows links from the checkpoints it keeps, whose deltas are
//! stored. Links of deltas a prune deletes are dropped with them; deleting a thread or
//! a namespace drops its links. Another saver on the same file may prune or delete
//! behind this one's back: that leaves links of deltas that are gone, which no walk
//! reaches.

use std::collections::HashMap;

use keel_checkpoint::{PutRequest, ThreadKey};

/// Where a delta's chain goes next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    /// The delta's version seq.
    pub(crate) seq: u64,
    /// Whether the delta holds a snapshot (its chain starts there).
    pub(crate) snapshot: bool,
    /// The version it applies to: writer id and seq.
    pub(crate) base: Option<(String, u64)>,
}

/// Per namespace, channel and writer id: the links of the deltas this saver put. At
/// most `capacity` in all; past it every link is forgotten (a prune then reads what it
/// needs from the database, as without this memory).
#[derive(Debug)]
pub(crate) struct DeltaLinks {
    threads: HashMap<ThreadKey, HashMap<String, HashMap<String, Link>>>,
    len: usize,
    capacity: usize,
}

impl DeltaLinks {
    pub(crate) fn new(capacity: usize) -> Self {
        DeltaLinks {
            threads: HashMap::new(),
            len: 0,
            capacity,
        }
    }

    /// Records the deltas of `request`. Call it only after the put committed.
    pub(crate) fn remember(&mut self, request: &PutRequest) {
        if self.len + request.deltas.len() > self.capacity {
            self.threads.clear();
            self.len = 0;
        }
        if request.deltas.len() > self.capacity {
            return;
        }
        let channels = self.threads.entry(request.thread.clone()).or_default();
        for delta in &request.deltas {
            let link = Link {
                seq: delta.version.seq,
                snapshot: delta.snapshot.is_some(),
                base: delta
                    .base
                    .as_ref()
                    .map(|b| (b.writer.as_str().to_owned(), b.seq)),
            };
            let writers = channels.entry(delta.channel.clone()).or_default();
            if writers
                .insert(delta.version.writer.as_str().to_owned(), link)
                .is_none()
            {
                self.len += 1;
            }
        }
    }

    /// The link of the delta of `channel` written by `writer` in `thread`, if known.
    pub(crate) fn get(&self, thread: &ThreadKey, channel: &str, writer: &str) -> Option<&Link> {
        self.threads.get(thread)?.get(channel)?.get(writer)
    }

    /// Keeps, of `thread`'s links, those for which `keep(channel, writer)` holds.
    pub(crate) fn retain(&mut self, thread: &ThreadKey, keep: impl Fn(&str, &str) -> bool) {
        let Some(channels) = self.threads.get_mut(thread) else {
            return;
        };
        let mut removed = 0;
        for (channel, writers) in channels.iter_mut() {
            let before = writers.len();
            writers.retain(|writer, _| keep(channel, writer));
            removed += before - writers.len();
        }
        channels.retain(|_, writers| !writers.is_empty());
        if channels.is_empty() {
            self.threads.remove(thread);
        }
        self.len -= removed;
    }

    /// Forgets one namespace's links.
    pub(crate) fn forget(&mut self, thread: &ThreadKey) {
        self.retain(thread, |_, _| false);
    }

    /// Forgets the links of every namespace of `thread_id`.
    pub(crate) fn forget_thread(&mut self, thread_id: &str) {
        let keys: Vec<ThreadKey> = self
            .threads
            .keys()
            .filter(|k| k.thread_id == thread_id)
            .cloned()
            .collect();
        for key in keys {
            self.forget(&key);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use keel_checkpoint::{
        ChannelDelta, ChannelVersion, Checkpoint, CheckpointMetadata, CheckpointSource,
    };
    use serde_json::json;

    fn request(thread: &ThreadKey, parent: Option<&Checkpoint>, channels: &[&str]) -> PutRequest {
        let mut checkpoint = parent.map_or_else(|| Checkpoint::new(None), Checkpoint::successor);
        let mut deltas = Vec::new();
        for channel in channels {
            let base = checkpoint.channel_versions.get(*channel).cloned();
            let version = ChannelVersion::new(
                base.as_ref().map_or(1, |b| b.seq + 1),
                checkpoint.id.clone(),
            );
            checkpoint
                .channel_versions
                .insert((*channel).to_owned(), version.clone());
            deltas.push(ChannelDelta {
                channel: (*channel).to_owned(),
                version,
                base,
                updates: vec![json!(1)],
                snapshot: None,
            });
        }
        PutRequest {
            thread: thread.clone(),
            checkpoint,
            metadata: CheckpointMetadata::new(CheckpointSource::Loop, 0),
            deltas,
            expected_head: parent.map(|p| p.id.clone()),
        }
    }

    #[test]
    fn links_follow_bases_and_are_forgotten_with_their_deltas() {
        let t = ThreadKey::new("t");
        let mut links = DeltaLinks::new(100);
        let first = request(&t, None, &["a", "b"]);
        let second = request(&t, Some(&first.checkpoint), &["a"]);
        links.remember(&first);
        links.remember(&second);
        assert_eq!(links.len(), 3);
        let a2 = links
            .get(&t, "a", second.checkpoint.id.as_str())
            .unwrap()
            .clone();
        assert_eq!(
            a2,
            Link {
                seq: 2,
                snapshot: false,
                base: Some((first.checkpoint.id.as_str().to_owned(), 1)),
            }
        );
        assert!(links.get(&t, "b", second.checkpoint.id.as_str()).is_none());
        assert!(
            links
                .get(
                    &ThreadKey::new("t").with_ns("sub"),
                    "a",
                    second.checkpoint.id.as_str()
                )
                .is_none()
        );

        let keep = second.checkpoint.id.as_str().to_owned();
        links.retain(&t, |_, writer| writer == keep);
        assert_eq!(links.len(), 1);
        assert!(links.get(&t, "a", first.checkpoint.id.as_str()).is_none());
        links.forget_thread("t");
        assert_eq!(links.len(), 0);
        assert!(links.threads.is_empty());
    }

    #[test]
    fn over_capacity_everything_is_forgotten() {
        let mut links = DeltaLinks::new(3);
        let t = ThreadKey::new("t");
        let first = request(&t, None, &["a", "b"]);
        links.remember(&first);
        let second = request(&t, Some(&first.checkpoint), &["a", "b"]);
        links.remember(&second);
        assert_eq!(links.len(), 2, "the first two were dropped to make room");
        assert!(links.get(&t, "a", first.checkpoint.id.as_str()).is_none());
        assert!(links.get(&t, "a", second.checkpoint.id.as_str()).is_some());
        let mut none = DeltaLinks::new(0);
        none.remember(&second);
        assert_eq!(none.len(), 0);
    }
}
