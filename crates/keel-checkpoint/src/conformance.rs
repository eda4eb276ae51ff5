//! The conformance suite every [`Checkpointer`] must pass (feature `conformance`).
//!
//! Backend crates run it from their tests:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use keel_checkpoint::{MemorySaver, conformance};
//!
//! conformance::run_all(|| async { MemorySaver::new() }).await;
//! # }
//! ```
//!
//! Or one check at a time, each as its own test (every check uses fresh, random thread
//! ids, so checks may share one saver, and one database):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use keel_checkpoint::{MemorySaver, conformance};
//!
//! conformance::stale_writes_refused(&MemorySaver::new()).await;
//! # }
//! ```
//!
//! A failing check panics with a message that names it: `[conformance::<check>]`.
//! The suite models channels as "append" channels: a value is a JSON array, each
//! update one appended item, and a snapshot the whole array.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use serde_json::{Value, json};

use crate::{
    ChannelChain, ChannelDelta, ChannelVersion, Checkpoint, CheckpointError, CheckpointId,
    CheckpointMetadata, CheckpointSource, CheckpointTuple, Checkpointer, ListOptions, PendingWrite,
    PutRequest, ThreadKey,
};

/// Runs every check, each on a fresh saver from `make`.
pub async fn run_all<C, F, Fut>(make: F)
where
    C: Checkpointer,
    F: Fn() -> Fut,
    Fut: Future<Output = C>,
{
    round_trip(&make().await).await;
    list_order_and_filters(&make().await).await;
    chains_without_snapshots(&make().await).await;
    chains_with_snapshots(&make().await).await;
    chains_across_fork(&make().await).await;
    pending_writes(&make().await).await;
    resume_after_crash_mid_step(&make().await).await;
    delete_thread(&make().await).await;
    prune(&make().await).await;
    sweep_idle(&make().await).await;
    list_threads(&make().await).await;
    stale_writes_refused(&make().await).await;
    racing_writers(&make().await).await;
    invalid_puts_refused(&make().await).await;
    put_many_in_order(&make().await).await;
    namespaces_isolated(&make().await).await;
}

// ---------------------------------------------------------------------------------
// A small driver: a model of the expected state per checkpoint, and helpers that put
// steps and compare what the saver rebuilds with the model.

type State = BTreeMap<String, Vec<Value>>;

/// How one step writes one channel.
#[derive(Clone)]
enum Write {
    /// Append these items.
    Append(Vec<Value>),
    /// Append these items and include the full value as a snapshot.
    AppendSnapshot(Vec<Value>),
    /// Replace the value with these items (a delta with no base).
    Reset(Vec<Value>),
}

fn append(items: &[&str]) -> Write {
    Write::Append(items.iter().map(|s| json!(s)).collect())
}

fn append_snapshot(items: &[&str]) -> Write {
    Write::AppendSnapshot(items.iter().map(|s| json!(s)).collect())
}

fn reset(items: &[&str]) -> Write {
    Write::Reset(items.iter().map(|s| json!(s)).collect())
}

fn fresh_thread(check: &str) -> ThreadKey {
    ThreadKey::new(format!("conformance-{check}-{}", uuid::Uuid::new_v4()))
}

struct Driver<'s, C: ?Sized> {
    check: &'static str,
    saver: &'s C,
    thread: ThreadKey,
    /// Expected checkpoint, metadata and state per id.
    stored: BTreeMap<CheckpointId, (Checkpoint, CheckpointMetadata, State)>,
    head: Option<CheckpointId>,
}

impl<'s, C: Checkpointer + ?Sized> Driver<'s, C> {
    fn new(check: &'static str, saver: &'s C) -> Self {
        Self::on(check, saver, fresh_thread(check))
    }

    fn on(check: &'static str, saver: &'s C, thread: ThreadKey) -> Self {
        Self {
            check,
            saver,
            thread,
            stored: BTreeMap::new(),
            head: None,
        }
    }

    /// Builds the request for one step on top of `parent` (no channels if `None`).
    fn request(
        &self,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
        metadata: CheckpointMetadata,
    ) -> (PutRequest, State) {
        self.request_as(None, parent, writes, metadata)
    }

    /// Like [`request`](Self::request), with checkpoint id `id` instead of a fresh one
    /// (it must sort after the head).
    fn request_as(
        &self,
        id: Option<&CheckpointId>,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
        metadata: CheckpointMetadata,
    ) -> (PutRequest, State) {
        let (mut checkpoint, mut state) = match parent {
            Some(parent) => {
                let (checkpoint, _, state) = &self.stored[parent];
                let mut next = checkpoint.successor();
                if let Some(head) = &self.head {
                    next.id = CheckpointId::new_after(head);
                }
                (next, state.clone())
            }
            None => (Checkpoint::new(None), State::new()),
        };
        if let Some(id) = id {
            checkpoint.id = id.clone();
        }
        let step = metadata.step;
        checkpoint.versions_seen.insert(
            "node".into(),
            BTreeMap::from([("step".into(), step.unsigned_abs())]),
        );
        checkpoint.pending_sends = vec![json!({"node": "next", "arg": step})];
        let mut deltas = Vec::new();
        for (channel, write) in writes {
            let base = checkpoint.channel_versions.get(*channel).cloned();
            let seq = base.as_ref().map_or(1, |v| v.seq + 1);
            let version = ChannelVersion::new(seq, checkpoint.id.clone());
            checkpoint
                .channel_versions
                .insert((*channel).to_owned(), version.clone());
            let value = state.entry((*channel).to_owned()).or_default();
            let (base, updates, snapshot) = match write {
                Write::Append(items) => {
                    value.extend(items.iter().cloned());
                    (base, items.clone(), None)
                }
                Write::AppendSnapshot(items) => {
                    value.extend(items.iter().cloned());
                    (base, items.clone(), Some(Value::Array(value.clone())))
                }
                Write::Reset(items) => {
                    *value = items.clone();
                    (None, items.clone(), None)
                }
            };
            deltas.push(ChannelDelta {
                channel: (*channel).to_owned(),
                version,
                base,
                updates,
                snapshot,
            });
        }
        let request = PutRequest {
            thread: self.thread.clone(),
            checkpoint,
            metadata,
            deltas,
            expected_head: self.head.clone(),
        };
        (request, state)
    }

    /// Puts one step on top of `parent` and records what it should rebuild to.
    async fn step_with(
        &mut self,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
        metadata: CheckpointMetadata,
    ) -> CheckpointId {
        self.step_as(None, parent, writes, metadata).await
    }

    /// Like [`step_with`](Self::step_with), with checkpoint id `id` if given.
    async fn step_as(
        &mut self,
        id: Option<&CheckpointId>,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
        metadata: CheckpointMetadata,
    ) -> CheckpointId {
        let (request, state) = self.request_as(id, parent, writes, metadata);
        let id = request.checkpoint.id.clone();
        let expected = (request.checkpoint.clone(), request.metadata.clone(), state);
        if let Err(err) = self.saver.put(request).await {
            panic!(
                "[conformance::{}] put of a valid checkpoint failed: {err}",
                self.check
            );
        }
        self.stored.insert(id.clone(), expected);
        self.head = Some(id.clone());
        id
    }

    /// Builds a `loop` step on top of `parent` and records it as stored and as the head,
    /// without putting it (for a batch of [`Checkpointer::put_many`]).
    fn stage(&mut self, parent: &CheckpointId, writes: &[(&str, Write)]) -> PutRequest {
        let step = self.stored[parent].1.step + 1;
        let metadata = CheckpointMetadata::new(CheckpointSource::Loop, step);
        let (request, state) = self.request(Some(parent), writes, metadata);
        let id = request.checkpoint.id.clone();
        let expected = (request.checkpoint.clone(), request.metadata.clone(), state);
        self.stored.insert(id.clone(), expected);
        self.head = Some(id);
        request
    }

    /// A `loop` step numbered after its parent.
    async fn step(
        &mut self,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
    ) -> CheckpointId {
        let step = parent.map_or(-1, |p| self.stored[p].1.step + 1);
        let source = if parent.is_none() {
            CheckpointSource::Input
        } else {
            CheckpointSource::Loop
        };
        self.step_with(parent, writes, CheckpointMetadata::new(source, step))
            .await
    }

    /// A step like [`step`](Self::step) whose checkpoint id is `id`.
    async fn step_at(
        &mut self,
        id: &CheckpointId,
        parent: Option<&CheckpointId>,
        writes: &[(&str, Write)],
    ) -> CheckpointId {
        let step = parent.map_or(-1, |p| self.stored[p].1.step + 1);
        let source = if parent.is_none() {
            CheckpointSource::Input
        } else {
            CheckpointSource::Loop
        };
        self.step_as(
            Some(id),
            parent,
            writes,
            CheckpointMetadata::new(source, step),
        )
        .await
    }

    /// Forgets what was put, as after the thread was deleted.
    fn forget(&mut self) {
        self.stored.clear();
        self.head = None;
    }

    async fn get(&self, id: Option<&CheckpointId>) -> Option<CheckpointTuple> {
        match self.saver.get(&self.thread, id).await {
            Ok(found) => found,
            Err(err) => panic!("[conformance::{}] get({id:?}) failed: {err}", self.check),
        }
    }

    async fn list(&self, options: ListOptions) -> Vec<CheckpointId> {
        match self
            .saver
            .list(&self.thread, options)
            .try_collect::<Vec<_>>()
            .await
        {
            Ok(items) => items.into_iter().map(|s| s.checkpoint.id).collect(),
            Err(err) => panic!("[conformance::{}] list failed: {err}", self.check),
        }
    }

    /// Asserts that checkpoint `id` is stored exactly as put and rebuilds to its state.
    async fn assert_stored(&self, id: &CheckpointId) -> CheckpointTuple {
        let check = self.check;
        let Some(tuple) = self.get(Some(id)).await else {
            panic!("[conformance::{check}] checkpoint {id} is missing");
        };
        let (checkpoint, metadata, state) = &self.stored[id];
        assert_eq!(
            tuple.thread, self.thread,
            "[conformance::{check}] tuple.thread of {id}"
        );
        assert_eq!(
            &tuple.checkpoint, checkpoint,
            "[conformance::{check}] checkpoint {id} changed in storage"
        );
        assert_eq!(
            &tuple.metadata, metadata,
            "[conformance::{check}] metadata of {id}"
        );
        let channels: Vec<&String> = tuple.channels.keys().collect();
        let versions: Vec<&String> = checkpoint.channel_versions.keys().collect();
        assert_eq!(
            channels, versions,
            "[conformance::{check}] {id}: one chain per channel version"
        );
        for (channel, expected) in state {
            let rebuilt = fold(&tuple.channels[channel]);
            assert_eq!(
                &rebuilt, expected,
                "[conformance::{check}] {id}: channel {channel:?} rebuilt from {:?}",
                tuple.channels[channel]
            );
        }
        tuple
    }

    async fn assert_head(&self, expected: Option<&CheckpointId>) {
        let head = self.get(None).await.map(|t| t.checkpoint.id);
        assert_eq!(
            head.as_ref(),
            expected,
            "[conformance::{}] head of {}",
            self.check,
            self.thread
        );
    }

    async fn put_writes(&self, id: &CheckpointId, writes: Vec<PendingWrite>) {
        if let Err(err) = self.saver.put_writes(&self.thread, id, writes).await {
            panic!(
                "[conformance::{}] put_writes on {id} failed: {err}",
                self.check
            );
        }
    }
}

/// The value of an append channel: the snapshot's items, then every update.
fn fold(chain: &ChannelChain) -> Vec<Value> {
    let mut items = match &chain.snapshot {
        None => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(other) => panic!("[conformance] snapshot is not the array that was put: {other}"),
    };
    items.extend(chain.updates().cloned());
    items
}

fn write(task: &str, channel: &str, value: Value) -> PendingWrite {
    PendingWrite::new(task, format!("path/{task}"), channel, value)
}

// ---------------------------------------------------------------------------------
// The checks.

/// Put and get: the newest checkpoint and one by id come back exactly as put; absent
/// threads and ids give `None`.
pub async fn round_trip<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "round_trip";
    let mut d = Driver::new(CHECK, saver);
    assert!(
        d.get(None).await.is_none(),
        "[conformance::{CHECK}] empty thread has a head"
    );
    assert!(
        d.list(ListOptions::default()).await.is_empty(),
        "[conformance::{CHECK}] empty thread lists checkpoints"
    );

    let first = d
        .step_with(
            None,
            &[
                ("messages", append(&["hi"])),
                ("goal", append(&["ship it"])),
            ],
            CheckpointMetadata::new(CheckpointSource::Input, -1)
                .with_writes(["__start__", "tools", "node \"q\" ü"])
                .with_extra("run", json!("r1"))
                .with_extra("nested", json!({"a": [1, 2.5, null, true]})),
        )
        .await;
    let tuple = d.assert_stored(&first).await;
    assert!(
        tuple.pending_writes.is_empty(),
        "[conformance::{CHECK}] fresh checkpoint has writes"
    );
    d.assert_head(Some(&first)).await;

    let second = d
        .step(Some(&first), &[("messages", append(&["hello", "there"]))])
        .await;
    d.assert_head(Some(&second)).await;
    let latest = d.get(None).await.unwrap();
    assert_eq!(
        latest,
        d.assert_stored(&second).await,
        "[conformance::{CHECK}] get(None) differs from get(head)"
    );
    d.assert_stored(&first).await;

    let absent = CheckpointId::new();
    assert!(
        d.get(Some(&absent)).await.is_none(),
        "[conformance::{CHECK}] unknown id found"
    );
    let other = Driver::new(CHECK, saver);
    assert!(
        other.get(None).await.is_none(),
        "[conformance::{CHECK}] another thread sees this one's head"
    );
    assert!(
        other.get(Some(&first)).await.is_none(),
        "[conformance::{CHECK}] another thread sees this one's checkpoint"
    );
}

/// `list`: newest first; `before`, `limit` and metadata filters (`writes` by
/// containment), alone and together.
pub async fn list_order_and_filters<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "list_order_and_filters";
    let mut d = Driver::new(CHECK, saver);
    let mut ids = Vec::new();
    // Writers per step; "a" and "b" are also values of the extra key `run`, so a
    // backend that looks for a name anywhere in the metadata must still check.
    let writers: [&[&str]; 6] = [&["a"], &["a", "b"], &[], &["b"], &["a", "c \"q\""], &["b"]];
    for step in 0..6i64 {
        let source = if step % 2 == 0 {
            CheckpointSource::Loop
        } else {
            CheckpointSource::Update
        };
        let run = if step < 3 { "a" } else { "b" };
        let metadata = CheckpointMetadata::new(source, step)
            .with_writes(writers[step as usize].iter().copied())
            .with_extra("run", json!(run));
        let parent = ids.last().cloned();
        ids.push(
            d.step_with(parent.as_ref(), &[("c", append(&["x"]))], metadata)
                .await,
        );
    }
    let newest_first: Vec<CheckpointId> = ids.iter().rev().cloned().collect();
    let pick = |steps: &[usize]| steps.iter().map(|&i| ids[i].clone()).collect::<Vec<_>>();

    let cases: Vec<(&str, ListOptions, Vec<CheckpointId>)> = vec![
        ("no filter", ListOptions::default(), newest_first.clone()),
        ("limit 2", ListOptions::default().limit(2), pick(&[5, 4])),
        ("limit 0", ListOptions::default().limit(0), vec![]),
        (
            "limit past the end",
            ListOptions::default().limit(100),
            newest_first.clone(),
        ),
        (
            "before #3",
            ListOptions::default().before(ids[3].clone()),
            pick(&[2, 1, 0]),
        ),
        (
            "before the oldest",
            ListOptions::default().before(ids[0].clone()),
            vec![],
        ),
        (
            "before an unstored newer id",
            ListOptions::default().before(CheckpointId::new()),
            newest_first.clone(),
        ),
        (
            "before #4, limit 2",
            ListOptions::default().before(ids[4].clone()).limit(2),
            pick(&[3, 2]),
        ),
        (
            "source update",
            ListOptions::default().metadata("source", json!("update")),
            pick(&[5, 3, 1]),
        ),
        (
            "step 3",
            ListOptions::default().metadata("step", json!(3)),
            pick(&[3]),
        ),
        (
            "extra run b",
            ListOptions::default().metadata("run", json!("b")),
            pick(&[5, 4, 3]),
        ),
        (
            "source loop and run a",
            ListOptions::default()
                .metadata("source", json!("loop"))
                .metadata("run", json!("a")),
            pick(&[2, 0]),
        ),
        (
            "run b, before #5, limit 1",
            ListOptions::default()
                .metadata("run", json!("b"))
                .before(ids[5].clone())
                .limit(1),
            pick(&[4]),
        ),
        (
            "no such value",
            ListOptions::default().metadata("run", json!("z")),
            vec![],
        ),
        (
            "no such key",
            ListOptions::default().metadata("missing", json!(null)),
            vec![],
        ),
        (
            "step as string",
            ListOptions::default().metadata("step", json!("3")),
            vec![],
        ),
        (
            "written by a",
            ListOptions::default().written_by("a"),
            pick(&[4, 1, 0]),
        ),
        (
            "written by a and b",
            ListOptions::default().written_by("a").written_by("b"),
            pick(&[1]),
        ),
        (
            "written by b, limit 1",
            ListOptions::default().written_by("b").limit(1),
            pick(&[5]),
        ),
        (
            "written by b, before #5",
            ListOptions::default()
                .written_by("b")
                .before(ids[5].clone()),
            pick(&[3, 1]),
        ),
        (
            "written by a quoted name",
            ListOptions::default().written_by("c \"q\""),
            pick(&[4]),
        ),
        (
            "written by a and run b",
            ListOptions::default()
                .written_by("a")
                .metadata("run", json!("b")),
            pick(&[4]),
        ),
        (
            "written by nobody known",
            ListOptions::default().written_by("z"),
            vec![],
        ),
        (
            "written by a prefix of a writer",
            ListOptions::default().written_by("c"),
            vec![],
        ),
        (
            "writes: empty list",
            ListOptions::default().metadata("writes", json!([])),
            newest_first.clone(),
        ),
        (
            "writes: a string, not a list",
            ListOptions::default().metadata("writes", json!("a")),
            vec![],
        ),
        (
            "writes: not names",
            ListOptions::default().metadata("writes", json!([1])),
            vec![],
        ),
    ];
    for (name, options, expected) in cases {
        let got = d.list(options).await;
        assert_eq!(got, expected, "[conformance::{CHECK}] list with {name}");
    }

    let summaries: Vec<_> = saver
        .list(&d.thread, ListOptions::default().limit(1))
        .try_collect()
        .await
        .unwrap();
    let (checkpoint, metadata, _) = &d.stored[&ids[5]];
    assert_eq!(summaries.len(), 1);
    assert_eq!(
        &summaries[0].checkpoint, checkpoint,
        "[conformance::{CHECK}] summary checkpoint"
    );
    assert_eq!(
        &summaries[0].metadata, metadata,
        "[conformance::{CHECK}] summary metadata"
    );
    assert_eq!(
        summaries[0].thread, d.thread,
        "[conformance::{CHECK}] summary thread"
    );
}

/// Chains with no snapshots: every checkpoint rebuilds exactly, including channels
/// carried over unchanged from many steps back and a channel reset to a new value.
pub async fn chains_without_snapshots<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "chains_without_snapshots";
    let mut d = Driver::new(CHECK, saver);
    let mut ids: Vec<CheckpointId> = Vec::new();
    for i in 0..20 {
        let item = format!("m{i}");
        let mut writes = vec![("every", append(&[item.as_str(), "again"]))];
        if i == 12 {
            writes.push(("third", reset(&["fresh start"])));
        } else if i % 3 == 0 {
            writes.push(("third", append(&[item.as_str()])));
        }
        if i == 0 {
            writes.push(("once", append(&["set once"])));
            writes.push(("empty", append(&[])));
        }
        let parent = ids.last().cloned();
        ids.push(d.step(parent.as_ref(), &writes).await);
    }
    for id in &ids {
        d.assert_stored(id).await;
    }
    let head = d.assert_stored(&ids[19]).await;
    let every = &head.channels["every"];
    assert_eq!(
        every.snapshot, None,
        "[conformance::{CHECK}] snapshot out of nowhere"
    );
    assert_eq!(
        every.deltas.len(),
        20,
        "[conformance::{CHECK}] one delta per step, got {every:?}"
    );
    let third = &head.channels["third"];
    assert_eq!(
        third.deltas.len(),
        3,
        "[conformance::{CHECK}] a reset (no base) must end the chain: steps 12, 15, 18; got {third:?}"
    );
    assert_eq!(
        head.channels["empty"].deltas,
        vec![Vec::<Value>::new()],
        "[conformance::{CHECK}] empty delta"
    );
}

/// Chains with snapshots: they start at the newest snapshot on the way back and fold
/// only the later deltas.
pub async fn chains_with_snapshots<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "chains_with_snapshots";
    let mut d = Driver::new(CHECK, saver);
    let mut ids: Vec<CheckpointId> = Vec::new();
    for i in 0..15 {
        let item = format!("m{i}");
        let write = if i % 5 == 4 {
            append_snapshot(&[item.as_str()])
        } else {
            append(&[item.as_str()])
        };
        let parent = ids.last().cloned();
        ids.push(d.step(parent.as_ref(), &[("log", write)]).await);
    }
    for (i, id) in ids.iter().enumerate() {
        let tuple = d.assert_stored(id).await;
        let chain = &tuple.channels["log"];
        let (has_snapshot, expected_deltas) = match i {
            0..=3 => (false, i + 1),
            _ if i % 5 == 4 => (true, 0),
            _ => (true, (i + 1) % 5),
        };
        assert_eq!(
            (chain.snapshot.is_some(), chain.deltas.len()),
            (has_snapshot, expected_deltas),
            "[conformance::{CHECK}] checkpoint #{i}: chain must start at the newest snapshot, got {chain:?}"
        );
    }

    // A snapshot of an empty update list (a value set whole) is honoured too.
    let head = ids.last().cloned();
    let only_snapshot = d
        .step(head.as_ref(), &[("log", append_snapshot(&[]))])
        .await;
    let after = d
        .step(Some(&only_snapshot), &[("log", append(&["tail"]))])
        .await;
    let tuple = d.assert_stored(&after).await;
    assert_eq!(
        tuple.channels["log"].deltas,
        vec![vec![json!("tail")]],
        "[conformance::{CHECK}] after a bare snapshot"
    );
}

/// Two branches forked from one checkpoint each rebuild their own values and never see
/// the other's deltas, although their versions have the same `seq`.
pub async fn chains_across_fork<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "chains_across_fork";
    let mut d = Driver::new(CHECK, saver);
    let root = d
        .step(None, &[("log", append(&["a"])), ("side", append(&["s"]))])
        .await;
    let mid = d.step(Some(&root), &[("log", append(&["b"]))]).await;
    let left = d
        .step(
            Some(&mid),
            &[("log", append(&["left"])), ("side", append(&["l"]))],
        )
        .await;
    let left2 = d
        .step(Some(&left), &[("log", append_snapshot(&["left2"]))])
        .await;
    // Fork from `mid` (expected head is still `left2`, the current head).
    let fork_meta = CheckpointMetadata::new(CheckpointSource::Fork, 2);
    let right = d
        .step_with(Some(&mid), &[("log", append(&["right"]))], fork_meta)
        .await;
    let right2 = d.step(Some(&right), &[("log", append(&["right2"]))]).await;
    let left3 = d.step(Some(&left2), &[("log", append(&["left3"]))]).await;

    for id in [&root, &mid, &left, &left2, &right, &right2, &left3] {
        d.assert_stored(id).await;
    }
    let r = d.get(Some(&right2)).await.unwrap();
    let l = d.get(Some(&left3)).await.unwrap();
    assert_eq!(
        fold(&r.channels["log"]),
        vec![json!("a"), json!("b"), json!("right"), json!("right2")]
    );
    assert_eq!(
        fold(&l.channels["log"]),
        vec![
            json!("a"),
            json!("b"),
            json!("left"),
            json!("left2"),
            json!("left3")
        ]
    );
    assert_eq!(
        fold(&r.channels["side"]),
        vec![json!("s")],
        "[conformance::{CHECK}] right branch sees left's side write"
    );
    assert_eq!(
        d.stored[&right].0.channel_versions["log"].seq,
        d.stored[&left].0.channel_versions["log"].seq,
        "[conformance::{CHECK}] test setup: both branches reach the same seq"
    );
    assert_eq!(
        r.checkpoint.parent.as_ref(),
        Some(&right),
        "[conformance::{CHECK}] parent link"
    );
    assert_eq!(d.stored[&right].0.parent.as_ref(), Some(&mid));
    d.assert_head(Some(&left3)).await;
}

/// Pending writes come back with their checkpoint, in stored order; putting them again
/// changes nothing, except that special channels take the newest value.
pub async fn pending_writes<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "pending_writes";
    let mut d = Driver::new(CHECK, saver);
    let first = d.step(None, &[("log", append(&["a"]))]).await;

    let batch_a = vec![
        write("task-a", "log", json!("from a")),
        write("task-a", "log", json!("from a, again")),
        write("task-a", "count", json!(1)),
    ];
    let batch_b = vec![
        write("task-b", "log", json!({"b": [1, 2]})),
        write("task-b", PendingWrite::ERROR, json!({"message": "boom"})),
    ];
    d.put_writes(&first, batch_a.clone()).await;
    d.put_writes(&first, batch_b.clone()).await;
    d.put_writes(&first, vec![]).await;
    let expected: Vec<PendingWrite> = batch_a.iter().chain(&batch_b).cloned().collect();
    let tuple = d.assert_stored(&first).await;
    assert_eq!(
        tuple.pending_writes, expected,
        "[conformance::{CHECK}] writes as put"
    );

    // Repeats are idempotent.
    d.put_writes(&first, batch_a.clone()).await;
    d.put_writes(&first, batch_b.clone()).await;
    let tuple = d.get(Some(&first)).await.unwrap();
    assert_eq!(
        tuple.pending_writes, expected,
        "[conformance::{CHECK}] repeated put_writes duplicated writes"
    );

    // An ordinary write with a known key keeps the first value; a special one is replaced
    // in place; a new key is appended.
    d.put_writes(
        &first,
        vec![
            write("task-a", "log", json!("changed?")),
            write(
                "task-b",
                PendingWrite::ERROR,
                json!({"message": "boom, retried"}),
            ),
            write(
                "task-c",
                PendingWrite::INTERRUPT,
                json!({"ask": "approve?"}),
            ),
        ],
    )
    .await;
    let mut expected = expected;
    expected[4].value = json!({"message": "boom, retried"});
    expected.push(write(
        "task-c",
        PendingWrite::INTERRUPT,
        json!({"ask": "approve?"}),
    ));
    let tuple = d.get(Some(&first)).await.unwrap();
    assert_eq!(
        tuple.pending_writes, expected,
        "[conformance::{CHECK}] key rules on repeat"
    );

    // Writes belong to their checkpoint only.
    let second = d.step(Some(&first), &[("log", append(&["b"]))]).await;
    let head = d.get(None).await.unwrap();
    assert_eq!(head.checkpoint.id, second);
    assert!(
        head.pending_writes.is_empty(),
        "[conformance::{CHECK}] new checkpoint inherited writes"
    );
    let tuple = d.get(Some(&first)).await.unwrap();
    assert_eq!(
        tuple.pending_writes, expected,
        "[conformance::{CHECK}] writes lost when a successor was put"
    );
    d.put_writes(
        &second,
        vec![write("task-d", PendingWrite::RESUME, json!("yes"))],
    )
    .await;
    let head = d.get(None).await.unwrap();
    assert_eq!(
        head.pending_writes,
        vec![write("task-d", PendingWrite::RESUME, json!("yes"))]
    );

    // Writes against an unknown checkpoint are refused.
    let unknown = CheckpointId::new();
    match saver
        .put_writes(&d.thread, &unknown, vec![write("t", "log", json!(1))])
        .await
    {
        Err(CheckpointError::NotFound { .. }) => {}
        other => {
            panic!("[conformance::{CHECK}] put_writes on an unknown checkpoint gave {other:?}")
        }
    }
    match saver
        .put_writes(
            &fresh_thread(CHECK),
            &first,
            vec![write("t", "log", json!(1))],
        )
        .await
    {
        Err(CheckpointError::NotFound { .. }) => {}
        other => panic!(
            "[conformance::{CHECK}] put_writes on another thread's checkpoint gave {other:?}"
        ),
    }
}

/// Resuming after a crash mid-step: the writes finished tasks saved against the head
/// (which has no successor yet) come back with it, and the step can then complete.
pub async fn resume_after_crash_mid_step<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "resume_after_crash_mid_step";
    let mut d = Driver::new(CHECK, saver);
    let first = d.step(None, &[("log", append(&["start"]))]).await;
    let second = d.step(Some(&first), &[("log", append(&["step 0"]))]).await;
    // Step 1 runs three tasks; two finish and save their writes, then the process dies.
    let finished = vec![
        write("task-1", "log", json!("result 1")),
        write("task-2", "log", json!("result 2")),
        write("task-2", "notes", json!("note 2")),
    ];
    d.put_writes(&second, finished[..1].to_vec()).await;
    d.put_writes(&second, finished[1..].to_vec()).await;

    // A new worker picks the thread up.
    let resumed = d
        .get(None)
        .await
        .unwrap_or_else(|| panic!("[conformance::{CHECK}] head lost"));
    assert_eq!(
        resumed.checkpoint.id, second,
        "[conformance::{CHECK}] resumed from the wrong checkpoint"
    );
    assert_eq!(
        resumed.pending_writes, finished,
        "[conformance::{CHECK}] finished tasks' writes lost"
    );
    d.assert_stored(&second).await;

    // It runs the remaining task, saves its write too, and completes the step.
    d.put_writes(&second, vec![write("task-3", "log", json!("result 3"))])
        .await;
    let third = d
        .step(
            Some(&second),
            &[("log", append(&["result 1", "result 2", "result 3"]))],
        )
        .await;
    d.assert_stored(&third).await;
    d.assert_head(Some(&third)).await;
    assert_eq!(d.get(Some(&second)).await.unwrap().pending_writes.len(), 4);
}

/// `delete_thread` removes every namespace of the thread and nothing else; the thread
/// can start over afterwards.
pub async fn delete_thread<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "delete_thread";
    let doomed = fresh_thread(CHECK);
    let mut root = Driver::on(CHECK, saver, doomed.clone());
    let mut sub = Driver::on(CHECK, saver, doomed.clone().with_ns("sub:1"));
    let mut other = Driver::new(CHECK, saver);
    let mut other_same_ns = Driver::on(CHECK, saver, other.thread.clone().with_ns("sub:1"));

    let r = root.step(None, &[("log", append(&["r"]))]).await;
    root.put_writes(&r, vec![write("t", "log", json!(1))]).await;
    let s = sub.step(None, &[("log", append(&["s"]))]).await;
    let o = other.step(None, &[("log", append(&["o"]))]).await;
    other
        .put_writes(&o, vec![write("t", "log", json!(2))])
        .await;
    let os = other_same_ns.step(None, &[("log", append(&["os"]))]).await;

    if let Err(err) = saver.delete_thread(&doomed.thread_id).await {
        panic!("[conformance::{CHECK}] delete_thread failed: {err}");
    }
    for (driver, id) in [(&root, &r), (&sub, &s)] {
        driver.assert_head(None).await;
        assert!(
            driver.get(Some(id)).await.is_none(),
            "[conformance::{CHECK}] deleted checkpoint found"
        );
        assert!(
            driver.list(ListOptions::default()).await.is_empty(),
            "[conformance::{CHECK}] deleted thread lists"
        );
    }
    let kept = other.assert_stored(&o).await;
    assert_eq!(
        kept.pending_writes.len(),
        1,
        "[conformance::{CHECK}] other thread lost writes"
    );
    other_same_ns.assert_stored(&os).await;

    // Deleting an unknown thread is fine; a deleted thread starts over from no head.
    if let Err(err) = saver.delete_thread(&fresh_thread(CHECK).thread_id).await {
        panic!("[conformance::{CHECK}] delete_thread of an unknown thread failed: {err}");
    }
    root.stored.clear();
    root.head = None;
    let again = root.step(None, &[("log", append(&["again"]))]).await;
    root.assert_stored(&again).await;
}

/// `prune` keeps the newest N checkpoints, which still rebuild exactly (snapshots or
/// not, across a fork, channels carried from pruned steps), and removes the rest.
pub async fn prune<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "prune";
    let mut d = Driver::new(CHECK, saver);
    let mut ids: Vec<CheckpointId> = Vec::new();
    for i in 0..12 {
        let item = format!("m{i}");
        let mut writes = vec![("plain", append(&[item.as_str()]))];
        writes.push((
            "snap",
            if i % 4 == 1 {
                append_snapshot(&[item.as_str()])
            } else {
                append(&[item.as_str()])
            },
        ));
        if i == 0 {
            writes.push(("once", append(&["set at step 0"])));
        }
        let parent = ids.last().cloned();
        let id = d.step(parent.as_ref(), &writes).await;
        d.put_writes(&id, vec![write("t", "plain", json!(i))]).await;
        ids.push(id);
    }
    // A fork from #2, made last, so it is among the newest.
    let fork = d
        .step_with(
            Some(&ids[2]),
            &[("plain", append(&["fork"]))],
            CheckpointMetadata::new(CheckpointSource::Fork, 3),
        )
        .await;
    ids.push(fork.clone());

    let removed = match saver.prune(&d.thread, 3).await {
        Ok(n) => n,
        Err(err) => panic!("[conformance::{CHECK}] prune failed: {err}"),
    };
    assert_eq!(
        removed, 10,
        "[conformance::{CHECK}] prune(3) of 13 removed {removed}"
    );
    let kept: Vec<CheckpointId> = ids[10..].iter().rev().cloned().collect();
    assert_eq!(
        d.list(ListOptions::default()).await,
        kept,
        "[conformance::{CHECK}] survivors"
    );
    for id in &kept {
        d.assert_stored(id).await;
    }
    for id in &ids[..10] {
        assert!(
            d.get(Some(id)).await.is_none(),
            "[conformance::{CHECK}] pruned {id} still found"
        );
    }
    assert_eq!(
        d.get(Some(&ids[11])).await.unwrap().pending_writes.len(),
        1,
        "[conformance::{CHECK}] kept writes"
    );
    d.assert_head(Some(&fork)).await;

    // Nothing more to prune; the thread goes on from its head.
    assert_eq!(
        saver.prune(&d.thread, 3).await.ok(),
        Some(0),
        "[conformance::{CHECK}] second prune"
    );
    assert_eq!(
        saver.prune(&d.thread, 100).await.ok(),
        Some(0),
        "[conformance::{CHECK}] prune above count"
    );
    let next = d
        .step(Some(&fork), &[("snap", append(&["after prune"]))])
        .await;
    d.assert_stored(&next).await;
    let from_old = d
        .step(Some(&ids[11]), &[("plain", append(&["from #11"]))])
        .await;
    d.assert_stored(&from_old).await;

    // prune(0) empties the namespace; the thread can start over.
    assert_eq!(
        saver.prune(&d.thread, 0).await.ok(),
        Some(5),
        "[conformance::{CHECK}] prune(0)"
    );
    d.assert_head(None).await;
    assert!(d.list(ListOptions::default()).await.is_empty());
    assert_eq!(
        saver.prune(&fresh_thread(CHECK), 1).await.ok(),
        Some(0),
        "[conformance::{CHECK}] unknown thread"
    );
    d.stored.clear();
    d.head = None;
    let again = d.step(None, &[("plain", append(&["again"]))]).await;
    d.assert_stored(&again).await;
}

/// 2000-01-01T00:00:00Z in Unix milliseconds. `sweep_idle` dates its idle threads'
/// checkpoints then and sweeps threads idle since the day after, so on a saver that
/// other checks (or anything made in this century) share, it deletes only its own.
const Y2K_MILLIS: u64 = 946_684_800_000;
const DAY_MILLIS: u64 = 24 * 3600 * 1000;

/// A v7 id made at `millis` (Unix milliseconds), its other bits random.
fn id_at(millis: u64) -> CheckpointId {
    let random = uuid::Uuid::new_v4().into_bytes();
    let mut bytes = [0u8; 10];
    bytes.copy_from_slice(&random[..10]);
    let uuid = uuid::Builder::from_unix_timestamp_millis(millis, &bytes).into_uuid();
    uuid.to_string().parse().unwrap()
}

/// How long ago `millis` (Unix milliseconds) was.
fn since(millis: u64) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    now.saturating_sub(Duration::from_millis(millis))
}

async fn sweep<C: Checkpointer + ?Sized>(
    saver: &C,
    what: &str,
    idle_for: Duration,
    limit: usize,
) -> Vec<String> {
    match saver.sweep_idle(idle_for, limit).await {
        Ok(ids) => ids,
        Err(err) => panic!(
            "[conformance::sweep_idle] {what}: sweep_idle({idle_for:?}, {limit}) failed: {err}"
        ),
    }
}

/// One namespace of a thread the check watches: its driver, and each checkpoint with the
/// number of pending writes it holds.
type Watched<'d, 's, C> = (&'d Driver<'s, C>, Vec<(CheckpointId, usize)>);

async fn assert_swept<C: Checkpointer + ?Sized>(what: &str, namespaces: &[Watched<'_, '_, C>]) {
    for (d, checkpoints) in namespaces {
        d.assert_head(None).await;
        assert!(
            d.list(ListOptions::default()).await.is_empty(),
            "[conformance::{}] {what}: swept {} still lists checkpoints",
            d.check,
            d.thread
        );
        for (id, _) in checkpoints {
            assert!(
                d.get(Some(id)).await.is_none(),
                "[conformance::{}] {what}: checkpoint {id} of swept {} still found",
                d.check,
                d.thread
            );
        }
    }
}

async fn assert_kept<C: Checkpointer + ?Sized>(what: &str, namespaces: &[Watched<'_, '_, C>]) {
    for (d, checkpoints) in namespaces {
        for (id, writes) in checkpoints {
            let tuple = d.assert_stored(id).await;
            assert_eq!(
                tuple.pending_writes.len(),
                *writes,
                "[conformance::{}] {what}: pending writes of {id} in kept {}",
                d.check,
                d.thread
            );
        }
        let newest = checkpoints.iter().map(|(id, _)| id).max();
        d.assert_head(newest).await;
    }
}

/// Puts checkpoint `id` (no parent, `writes`) on a thread that was swept, where it was
/// the first checkpoint once: it must go in as on a new thread (no head, no delta of
/// its id left) and come back without the writes it had.
async fn put_again<C: Checkpointer + ?Sized>(
    d: &mut Driver<'_, C>,
    id: &CheckpointId,
    writes: &[(&str, Write)],
) {
    let check = d.check;
    d.forget();
    let metadata = CheckpointMetadata::new(CheckpointSource::Input, -1);
    let (request, state) = d.request_as(Some(id), None, writes, metadata);
    let expected = (request.checkpoint.clone(), request.metadata.clone(), state);
    if let Err(err) = d.saver.put(request).await {
        panic!(
            "[conformance::{check}] putting checkpoint {id} of swept {} again failed \
             (a head or delta left behind?): {err}",
            d.thread
        );
    }
    d.stored.insert(id.clone(), expected);
    d.head = Some(id.clone());
    let tuple = d.assert_stored(id).await;
    assert!(
        tuple.pending_writes.is_empty(),
        "[conformance::{check}] writes of swept {} came back: {:?}",
        d.thread,
        tuple.pending_writes
    );
}

/// `list_threads` pages through the stored threads in id order, each once, with its
/// newest checkpoint over every namespace and the number of namespaces; a deleted
/// thread is gone from it. Other checks' threads may share the saver, so only this
/// check's own ids (one random prefix) are compared.
pub async fn list_threads<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "list_threads";
    let prefix = format!("conformance-{CHECK}-{}", uuid::Uuid::new_v4());
    let key = |n: usize| ThreadKey::new(format!("{prefix}-{n}"));
    let mut expected: Vec<(String, CheckpointId, usize)> = Vec::new();
    for n in 0..5 {
        let mut root = Driver::on(CHECK, saver, key(n));
        let first = root.step(None, &[("log", append(&["a"]))]).await;
        let mut newest = root.step(Some(&first), &[("log", append(&["b"]))]).await;
        let mut namespaces = 1;
        if n == 2 {
            let mut sub = Driver::on(CHECK, saver, key(n).with_ns("sub:1"));
            newest = sub.step(None, &[("log", append(&["s"]))]).await;
            namespaces = 2;
        }
        expected.push((key(n).thread_id.clone(), newest, namespaces));
    }
    let seen = listed_with_prefix(saver, &prefix).await;
    assert_eq!(
        seen, expected,
        "[conformance::{CHECK}] threads in id order, each with its newest checkpoint and namespace count"
    );
    if let Err(err) = saver.delete_thread(&expected[1].0).await {
        panic!("[conformance::{CHECK}] delete_thread failed: {err}");
    }
    expected.remove(1);
    assert_eq!(
        listed_with_prefix(saver, &prefix).await,
        expected,
        "[conformance::{CHECK}] a deleted thread is no longer listed"
    );
    match saver.list_threads(None, 0).await {
        Ok(none) => assert!(
            none.is_empty(),
            "[conformance::{CHECK}] limit 0 lists nothing"
        ),
        Err(err) => panic!("[conformance::{CHECK}] list_threads(None, 0) failed: {err}"),
    }
}

/// Every thread `list_threads` returns whose id starts with `prefix`, paging by 2.
async fn listed_with_prefix<C: Checkpointer + ?Sized>(
    saver: &C,
    prefix: &str,
) -> Vec<(String, CheckpointId, usize)> {
    const CHECK: &str = "list_threads";
    let mut seen = Vec::new();
    let mut after = prefix.to_owned();
    loop {
        let page = match saver.list_threads(Some(&after), 2).await {
            Ok(p) => p,
            Err(err) => panic!("[conformance::{CHECK}] list_threads failed: {err}"),
        };
        assert!(
            page.len() <= 2,
            "[conformance::{CHECK}] a page over its limit"
        );
        let Some(last) = page.last() else { break };
        after.clone_from(&last.thread_id);
        let done = !last.thread_id.starts_with(prefix);
        seen.extend(
            page.into_iter()
                .filter(|t| t.thread_id.starts_with(prefix))
                .map(|t| (t.thread_id, t.head, t.namespaces)),
        );
        if done {
            break;
        }
    }
    seen
}

/// `sweep_idle` deletes the threads whose newest checkpoint, over every namespace, is
/// older than the age (by checkpoint id time), at most `limit` per call, each with every
/// namespace and its deltas and writes; threads with any newer checkpoint, in any
/// namespace, are untouched, and a namespace emptied by `prune` counts no more. Old
/// checkpoints are made with ids dated 2000-01-01, which
/// the contract allows for a thread's first checkpoint, so nothing sleeps and the check
/// sweeps nothing but its own threads.
pub async fn sweep_idle<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "sweep_idle";
    let t0 = Y2K_MILLIS;
    // The age of the sweeps below: idle since a day after t0.
    let ttl = || since(t0 + DAY_MILLIS);

    // Three idle threads. The first has three old steps with writes, and an old
    // subgraph namespace with writes.
    let idle = fresh_thread(CHECK);
    let mut root = Driver::on(CHECK, saver, idle.clone());
    let mut sub = Driver::on(CHECK, saver, idle.clone().with_ns("sub:1"));
    let first_writes = [("log", append(&["a1"])), ("side", append(&["s"]))];
    let a1 = root.step_at(&id_at(t0), None, &first_writes).await;
    root.put_writes(&a1, vec![write("t", "log", json!(1))])
        .await;
    let a2 = root
        .step_at(&id_at(t0 + 1), Some(&a1), &[("log", append(&["a2"]))])
        .await;
    let a3 = root
        .step_at(&id_at(t0 + 2), Some(&a2), &[("log", append(&["a3"]))])
        .await;
    root.put_writes(
        &a3,
        vec![
            write("t", "log", json!(2)),
            write("u", PendingWrite::INTERRUPT, json!("?")),
        ],
    )
    .await;
    let sub_writes = [("log", append(&["s1"]))];
    let s1 = sub.step_at(&id_at(t0 + 3), None, &sub_writes).await;
    sub.put_writes(&s1, vec![write("t", "log", json!(3))]).await;
    let mut idle2 = Driver::new(CHECK, saver);
    let b1 = idle2
        .step_at(&id_at(t0 + 10), None, &[("log", append(&["b"]))])
        .await;
    let mut idle3 = Driver::new(CHECK, saver);
    let c1 = idle3
        .step_at(&id_at(t0 + 20), None, &[("log", append(&["c"]))])
        .await;
    idle3
        .put_writes(&c1, vec![write("t", "log", json!(4))])
        .await;

    // Not idle: a thread made now; one whose old history goes on now; one with an old
    // root namespace and a fresh subgraph namespace.
    let mut fresh = Driver::new(CHECK, saver);
    let f1 = fresh.step(None, &[("log", append(&["f"]))]).await;
    let mut revived = Driver::new(CHECK, saver);
    let r1 = revived
        .step_at(&id_at(t0), None, &[("log", append(&["r1"]))])
        .await;
    let r2 = revived.step(Some(&r1), &[("log", append(&["r2"]))]).await;
    let half = fresh_thread(CHECK);
    let mut half_root = Driver::on(CHECK, saver, half.clone());
    let mut half_sub = Driver::on(CHECK, saver, half.clone().with_ns("sub:1"));
    let h1 = half_root
        .step_at(&id_at(t0), None, &[("log", append(&["h"]))])
        .await;
    half_root
        .put_writes(&h1, vec![write("t", "log", json!(5))])
        .await;
    let hs = half_sub.step(None, &[("log", append(&["hs"]))]).await;
    // Two steps 0.6 s apart, one on each side of the sweeps' age: the newer keeps the
    // thread (a saver that records heads lazily must still look at it).
    let mut close = Driver::new(CHECK, saver);
    let k1 = close
        .step_at(
            &id_at(t0 + DAY_MILLIS - 300),
            None,
            &[("log", append(&["k1"]))],
        )
        .await;
    let k2 = close
        .step_at(
            &id_at(t0 + DAY_MILLIS + 300),
            Some(&k1),
            &[("log", append(&["k2"]))],
        )
        .await;

    {
        let idle_threads: Vec<(String, Vec<Watched<'_, '_, C>>)> = vec![
            (
                idle.thread_id.clone(),
                vec![
                    (
                        &root,
                        vec![(a1.clone(), 1), (a2.clone(), 0), (a3.clone(), 2)],
                    ),
                    (&sub, vec![(s1.clone(), 1)]),
                ],
            ),
            (
                idle2.thread.thread_id.clone(),
                vec![(&idle2, vec![(b1.clone(), 0)])],
            ),
            (
                idle3.thread.thread_id.clone(),
                vec![(&idle3, vec![(c1.clone(), 1)])],
            ),
        ];
        let busy: Vec<Watched<'_, '_, C>> = vec![
            (&fresh, vec![(f1.clone(), 0)]),
            (&revived, vec![(r1.clone(), 0), (r2.clone(), 0)]),
            (&half_root, vec![(h1.clone(), 1)]),
            (&half_sub, vec![(hs.clone(), 0)]),
            (&close, vec![(k1.clone(), 0), (k2.clone(), 0)]),
        ];

        // Nothing is idle that long; a zero limit deletes nothing.
        let swept = sweep(
            saver,
            "an age above every thread's",
            since(t0 - DAY_MILLIS),
            100,
        )
        .await;
        assert!(
            swept.is_empty(),
            "[conformance::{CHECK}] swept threads younger than the age: {swept:?}"
        );
        let swept = sweep(saver, "limit 0", ttl(), 0).await;
        assert!(
            swept.is_empty(),
            "[conformance::{CHECK}] limit 0 swept {swept:?}"
        );
        for (_, namespaces) in &idle_threads {
            assert_kept("before any sweep", namespaces).await;
        }

        // The limit holds: two of the three idle threads, whole; the third untouched.
        let first = sweep(saver, "limit 2 of 3", ttl(), 2).await;
        let first_set: BTreeSet<&String> = first.iter().collect();
        assert!(
            first.len() == 2 && first_set.len() == 2,
            "[conformance::{CHECK}] sweep with limit 2 of 3 idle threads returned {first:?}"
        );
        for (thread_id, namespaces) in &idle_threads {
            if first_set.contains(thread_id) {
                assert_swept("first batch", namespaces).await;
            } else {
                assert_kept("left by the first batch", namespaces).await;
            }
        }
        for id in &first {
            assert!(
                idle_threads.iter().any(|(t, _)| t == id),
                "[conformance::{CHECK}] swept {id:?}, which is not idle"
            );
        }

        // The next call takes the third, fewer than the limit: the sweep is done.
        let second = sweep(saver, "the rest", ttl(), 2).await;
        let mut all: BTreeSet<String> = first.iter().chain(&second).cloned().collect();
        let expected: BTreeSet<String> = idle_threads.iter().map(|(t, _)| t.clone()).collect();
        assert!(
            second.len() == 1 && all == expected,
            "[conformance::{CHECK}] second batch {second:?} after {first:?}: expected the rest of {expected:?}"
        );
        for (_, namespaces) in &idle_threads {
            assert_swept("second batch", namespaces).await;
        }
        let third = sweep(saver, "nothing left", ttl(), 2).await;
        assert!(
            third.is_empty(),
            "[conformance::{CHECK}] a third sweep found {third:?}"
        );
        all.clear();

        // A fresh checkpoint in any namespace keeps the whole thread, old history too.
        assert_kept("not idle", &busy).await;
    }

    // The swept thread left nothing: its first checkpoints go in again as on a new
    // thread (no head, no delta of theirs) and come back without their writes, and the
    // deltas of its later steps are gone (a checkpoint naming one is refused).
    put_again(&mut root, &a1, &first_writes).await;
    put_again(&mut sub, &s1, &sub_writes).await;
    let (mut request, _) = root.request(
        Some(&a1),
        &[],
        CheckpointMetadata::new(CheckpointSource::Update, 0),
    );
    request
        .checkpoint
        .channel_versions
        .insert("log".into(), ChannelVersion::new(2, a2.clone()));
    match saver.put(request).await {
        Err(CheckpointError::Invalid { .. }) => {}
        other => panic!(
            "[conformance::{CHECK}] a checkpoint naming a delta of a swept thread gave {other:?}, not Invalid"
        ),
    }

    // Put again with old ids, that thread is idle again. A namespace emptied by
    // `prune(_, 0)` keeps its thread no longer: the half-idle thread is idle now.
    assert_eq!(
        saver.prune(&half_sub.thread, 0).await.ok(),
        Some(1),
        "[conformance::{CHECK}] prune(0) of the fresh namespace"
    );
    let mut last = sweep(saver, "after put again and prune", ttl(), 10).await;
    last.sort();
    let mut expected = vec![idle.thread_id.clone(), half.thread_id.clone()];
    expected.sort();
    assert_eq!(
        last, expected,
        "[conformance::{CHECK}] sweep after putting a swept thread again and emptying a namespace"
    );
    for d in [&root, &sub, &half_root, &half_sub] {
        d.assert_head(None).await;
    }
    fresh.assert_stored(&f1).await;
    revived.assert_head(Some(&r2)).await;
    revived.assert_stored(&r1).await;
}

/// Fencing (invariant 7): a put whose expected head is not the current head fails with
/// `Conflict`, writes nothing, and leaves the head alone.
pub async fn stale_writes_refused<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "stale_writes_refused";
    let mut d = Driver::new(CHECK, saver);

    // Expecting a head on an empty thread.
    let (mut request, _) = d.request(
        None,
        &[("log", append(&["x"]))],
        CheckpointMetadata::new(CheckpointSource::Input, -1),
    );
    let phantom = CheckpointId::new();
    request.expected_head = Some(phantom.clone());
    let refused = request.checkpoint.id.clone();
    expect_conflict(CHECK, saver.put(request).await, Some(&phantom), None);
    d.assert_head(None).await;
    assert!(d.get(Some(&refused)).await.is_none());

    let first = d.step(None, &[("log", append(&["a"]))]).await;
    let second = d.step(Some(&first), &[("log", append(&["b"]))]).await;

    // A writer that last saw `first`.
    let stale_head = Some(first.clone());
    let (mut request, _) = d.request(
        Some(&first),
        &[("log", append(&["stale"])), ("new", append(&["n"]))],
        CheckpointMetadata::new(CheckpointSource::Loop, 1),
    );
    request.expected_head = stale_head;
    let stale = request.checkpoint.clone();
    expect_conflict(CHECK, saver.put(request).await, Some(&first), Some(&second));

    // A writer that thinks the thread is new.
    let (mut request, _) = d.request(
        None,
        &[("log", append(&["fresh"]))],
        CheckpointMetadata::new(CheckpointSource::Input, -1),
    );
    request.expected_head = None;
    let fresh = request.checkpoint.id.clone();
    expect_conflict(CHECK, saver.put(request).await, None, Some(&second));

    d.assert_head(Some(&second)).await;
    assert!(
        d.get(Some(&stale.id)).await.is_none(),
        "[conformance::{CHECK}] refused checkpoint stored"
    );
    assert!(
        d.get(Some(&fresh)).await.is_none(),
        "[conformance::{CHECK}] refused checkpoint stored"
    );
    assert_eq!(
        d.list(ListOptions::default()).await,
        vec![second.clone(), first.clone()]
    );
    d.assert_stored(&second).await;

    // Nothing of the refused deltas was stored: a checkpoint that refers to them is invalid.
    let (mut request, _) = d.request(
        Some(&second),
        &[],
        CheckpointMetadata::new(CheckpointSource::Update, 2),
    );
    request.checkpoint.channel_versions = stale.channel_versions.clone();
    match saver.put(request).await {
        Err(CheckpointError::Invalid { .. }) => {}
        other => panic!(
            "[conformance::{CHECK}] deltas of a refused put were stored (or misreported): {other:?}"
        ),
    }

    // The current writer carries on.
    let third = d.step(Some(&second), &[("log", append(&["c"]))]).await;
    d.assert_stored(&third).await;
}

/// A v7 id one millisecond older than `id`.
fn id_before(id: &CheckpointId) -> CheckpointId {
    let millis = id.timestamp_millis().saturating_sub(1);
    let uuid = uuid::Builder::from_unix_timestamp_millis(millis, &[0; 10]).into_uuid();
    uuid.to_string().parse().unwrap()
}

fn expect_conflict(
    check: &str,
    result: Result<(), CheckpointError>,
    expected: Option<&CheckpointId>,
    actual: Option<&CheckpointId>,
) {
    match result {
        Err(CheckpointError::Conflict {
            expected: e,
            actual: a,
        }) => {
            assert_eq!(
                e.as_ref(),
                expected,
                "[conformance::{check}] Conflict.expected"
            );
            assert_eq!(a.as_ref(), actual, "[conformance::{check}] Conflict.actual");
        }
        other => panic!("[conformance::{check}] stale put: expected Conflict, got {other:?}"),
    }
}

/// Two writers racing from the same head: exactly one wins; the other gets `Conflict`
/// and leaves no trace.
pub async fn racing_writers<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "racing_writers";
    let mut d = Driver::new(CHECK, saver);
    let mut head = d.step(None, &[("log", append(&["start"]))]).await;
    for round in 0..10 {
        let meta = CheckpointMetadata::new(CheckpointSource::Loop, round);
        let (a, state_a) = d.request(Some(&head), &[("log", append(&["a"]))], meta.clone());
        let (b, state_b) = d.request(Some(&head), &[("log", append(&["b"]))], meta);
        let (ida, idb) = (a.checkpoint.id.clone(), b.checkpoint.id.clone());
        let (checkpoint_a, checkpoint_b) = (a.checkpoint.clone(), b.checkpoint.clone());
        let (metadata_a, metadata_b) = (a.metadata.clone(), b.metadata.clone());
        let (ra, rb) = futures::join!(saver.put(a), saver.put(b));
        let (winner, loser) = match (ra, rb) {
            (Ok(()), Err(e)) if e.is_conflict() => {
                d.stored
                    .insert(ida.clone(), (checkpoint_a, metadata_a, state_a));
                (ida, idb)
            }
            (Err(e), Ok(())) if e.is_conflict() => {
                d.stored
                    .insert(idb.clone(), (checkpoint_b, metadata_b, state_b));
                (idb, ida)
            }
            other => panic!(
                "[conformance::{CHECK}] round {round}: expected one winner and one Conflict, got {other:?}"
            ),
        };
        d.head = Some(winner.clone());
        d.assert_head(Some(&winner)).await;
        d.assert_stored(&winner).await;
        assert!(
            d.get(Some(&loser)).await.is_none(),
            "[conformance::{CHECK}] loser stored"
        );
        head = winner;
    }
}

/// Malformed or dangling puts fail with `Invalid` and write nothing.
pub async fn invalid_puts_refused<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "invalid_puts_refused";
    let mut d = Driver::new(CHECK, saver);
    let first = d.step(None, &[("log", append(&["a"]))]).await;
    let meta = CheckpointMetadata::new(CheckpointSource::Loop, 0);

    type Mangle = fn(&mut PutRequest, &CheckpointId);
    let cases: Vec<(&str, Mangle)> = vec![
        ("delta writer is not the checkpoint", |r, _| {
            let other = CheckpointId::new();
            r.deltas[0].version.writer = other.clone();
            r.checkpoint
                .channel_versions
                .insert("log".into(), r.deltas[0].version.clone());
        }),
        ("delta version differs from the checkpoint's", |r, _| {
            r.deltas[0].version.seq += 5
        }),
        ("delta for a channel without version", |r, _| {
            r.checkpoint.channel_versions.remove("log");
        }),
        ("written channel without delta", |r, _| {
            r.deltas.clear();
        }),
        ("two deltas for one channel", |r, _| {
            let twin = r.deltas[0].clone();
            r.deltas.push(twin);
        }),
        ("base not below version", |r, _| {
            let seq = r.deltas[0].version.seq;
            r.deltas[0].base.as_mut().unwrap().seq = seq;
        }),
        ("base never stored", |r, _| {
            r.deltas[0].base = Some(ChannelVersion::new(1, CheckpointId::new()));
        }),
        ("base with the wrong seq", |r, _| {
            r.deltas[0].version.seq = 9;
            r.checkpoint
                .channel_versions
                .insert("log".into(), r.deltas[0].version.clone());
            r.deltas[0].base.as_mut().unwrap().seq = 8;
        }),
        ("carried version never stored", |r, _| {
            r.checkpoint
                .channel_versions
                .insert("ghost".into(), ChannelVersion::new(3, CheckpointId::new()));
        }),
        ("extra key named like a field (writes)", |r, _| {
            r.metadata.extra.insert("writes".into(), json!(["x"]));
        }),
        ("extra key named like a field (step)", |r, _| {
            r.metadata.extra.insert("step".into(), json!(4));
        }),
        ("id not after the head", |r, head| {
            // An id from before the head was made.
            let older = id_before(head);
            r.checkpoint.id = older.clone();
            for delta in &mut r.deltas {
                delta.version.writer = older.clone();
            }
            for version in r.checkpoint.channel_versions.values_mut() {
                version.writer = older.clone();
            }
        }),
    ];
    for (name, mangle) in cases {
        let (mut request, _) = d.request(Some(&first), &[("log", append(&["b"]))], meta.clone());
        mangle(&mut request, &first);
        let id = request.checkpoint.id.clone();
        match saver.put(request).await {
            Err(CheckpointError::Invalid { .. }) => {}
            other => panic!("[conformance::{CHECK}] {name}: expected Invalid, got {other:?}"),
        }
        d.assert_head(Some(&first)).await;
        assert!(
            d.get(Some(&id)).await.is_none(),
            "[conformance::{CHECK}] {name}: refused checkpoint stored"
        );
    }
    assert_eq!(d.list(ListOptions::default()).await, vec![first.clone()]);
    let second = d.step(Some(&first), &[("log", append(&["b"]))]).await;
    d.assert_stored(&second).await;
}

/// `put_many`: a batch is stored in order, each request building on the one before it
/// (across threads too); an empty batch does nothing; a request that fails (a stale
/// `expected_head`, an invalid request) leaves the requests before it stored, itself
/// and the later ones not, and returns its error; the saver then goes on normally.
pub async fn put_many_in_order<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "put_many_in_order";
    let mut d = Driver::new(CHECK, saver);
    let mut other = Driver::new(CHECK, saver);
    let first = d.step(None, &[("log", append(&["a"]))]).await;
    let other_first = other.step(None, &[("log", append(&["x"]))]).await;

    let s1 = d.stage(&first, &[("log", append(&["b"]))]);
    let e1 = other.stage(&other_first, &[("log", append(&["y"]))]);
    let s2 = d.stage(
        &s1.checkpoint.id.clone(),
        &[("log", append_snapshot(&["c"])), ("aux", append(&["1"]))],
    );
    let s3 = d.stage(&s2.checkpoint.id.clone(), &[("log", reset(&["d"]))]);
    let ids: Vec<CheckpointId> = [&s1, &s2, &s3]
        .iter()
        .map(|r| r.checkpoint.id.clone())
        .collect();
    let e1_id = e1.checkpoint.id.clone();
    if let Err(err) = saver.put_many(vec![s1, e1, s2, s3]).await {
        panic!("[conformance::{CHECK}] a valid batch failed: {err}");
    }
    for id in &ids {
        d.assert_stored(id).await;
    }
    d.assert_head(Some(&ids[2])).await;
    other.assert_stored(&e1_id).await;
    other.assert_head(Some(&e1_id)).await;
    let listed = d.list(ListOptions::default()).await;
    assert_eq!(
        listed,
        vec![
            ids[2].clone(),
            ids[1].clone(),
            ids[0].clone(),
            first.clone()
        ],
        "[conformance::{CHECK}] list after a batch"
    );

    if let Err(err) = saver.put_many(Vec::new()).await {
        panic!("[conformance::{CHECK}] an empty batch failed: {err}");
    }
    d.assert_head(Some(&ids[2])).await;

    // A stale expected head in the middle of a batch.
    let t1 = d.stage(&ids[2], &[("log", append(&["e"]))]);
    let t1_id = t1.checkpoint.id.clone();
    let meta = CheckpointMetadata::new(CheckpointSource::Loop, 9);
    let (mut stale, _) = d.request(Some(&t1_id), &[("log", append(&["f"]))], meta.clone());
    stale.expected_head = Some(ids[2].clone());
    let (after, _) = d.request(Some(&t1_id), &[("log", append(&["g"]))], meta.clone());
    let refused = [stale.checkpoint.id.clone(), after.checkpoint.id.clone()];
    match saver.put_many(vec![t1, stale, after]).await {
        Err(CheckpointError::Conflict { .. }) => {}
        other => {
            panic!("[conformance::{CHECK}] stale head in a batch: expected Conflict, got {other:?}")
        }
    }
    d.assert_stored(&t1_id).await;
    d.assert_head(Some(&t1_id)).await;
    for id in &refused {
        assert!(
            d.get(Some(id)).await.is_none(),
            "[conformance::{CHECK}] a request at or after the conflict was stored"
        );
    }

    // An invalid request in the middle of a batch.
    let u1 = d.stage(&t1_id, &[("log", append(&["h"]))]);
    let u1_id = u1.checkpoint.id.clone();
    let (mut invalid, _) = d.request(Some(&u1_id), &[("log", append(&["i"]))], meta.clone());
    invalid.deltas.clear();
    let (after, _) = d.request(Some(&u1_id), &[("log", append(&["j"]))], meta);
    let refused = [invalid.checkpoint.id.clone(), after.checkpoint.id.clone()];
    match saver.put_many(vec![u1, invalid, after]).await {
        Err(CheckpointError::Invalid { .. }) => {}
        other => panic!(
            "[conformance::{CHECK}] invalid request in a batch: expected Invalid, got {other:?}"
        ),
    }
    d.assert_stored(&u1_id).await;
    d.assert_head(Some(&u1_id)).await;
    for id in &refused {
        assert!(
            d.get(Some(id)).await.is_none(),
            "[conformance::{CHECK}] a request at or after the invalid one was stored"
        );
    }

    // The saver goes on from the stored prefix.
    let next = d.step(Some(&u1_id), &[("log", append(&["k"]))]).await;
    d.assert_stored(&next).await;
    d.assert_head(Some(&next)).await;
}

/// Namespaces of one thread are separate histories: heads, lists, fencing, writes and
/// pruning do not cross.
pub async fn namespaces_isolated<C: Checkpointer + ?Sized>(saver: &C) {
    const CHECK: &str = "namespaces_isolated";
    let thread = fresh_thread(CHECK);
    let mut root = Driver::on(CHECK, saver, thread.clone());
    let mut sub = Driver::on(CHECK, saver, thread.clone().with_ns("child:1"));

    let r1 = root.step(None, &[("log", append(&["root 1"]))]).await;
    // The subgraph starts with no head although the root has one.
    let s1 = sub.step(None, &[("log", append(&["sub 1"]))]).await;
    let r2 = root.step(Some(&r1), &[("log", append(&["root 2"]))]).await;
    let s2 = sub.step(Some(&s1), &[("log", append(&["sub 2"]))]).await;
    sub.put_writes(&s2, vec![write("t", "log", json!("sub write"))])
        .await;

    root.assert_head(Some(&r2)).await;
    sub.assert_head(Some(&s2)).await;
    assert_eq!(
        root.list(ListOptions::default()).await,
        vec![r2.clone(), r1.clone()]
    );
    assert_eq!(
        sub.list(ListOptions::default()).await,
        vec![s2.clone(), s1.clone()]
    );
    assert!(
        root.get(Some(&s1)).await.is_none(),
        "[conformance::{CHECK}] root sees a subgraph checkpoint"
    );
    assert!(
        sub.get(Some(&r1)).await.is_none(),
        "[conformance::{CHECK}] subgraph sees a root checkpoint"
    );
    assert!(root.assert_stored(&r2).await.pending_writes.is_empty());
    assert_eq!(sub.assert_stored(&s2).await.pending_writes.len(), 1);
    match saver
        .put_writes(&thread, &s2, vec![write("t", "log", json!(1))])
        .await
    {
        Err(CheckpointError::NotFound { .. }) => {}
        other => panic!("[conformance::{CHECK}] put_writes across namespaces gave {other:?}"),
    }

    // Fencing is per namespace: the root's head is no head for the subgraph.
    let (mut request, _) = sub.request(
        Some(&s2),
        &[("log", append(&["x"]))],
        CheckpointMetadata::new(CheckpointSource::Loop, 2),
    );
    request.expected_head = Some(r2.clone());
    expect_conflict(CHECK, saver.put(request).await, Some(&r2), Some(&s2));

    // A delta of the root is no base for the subgraph.
    let (mut request, _) = sub.request(
        Some(&s2),
        &[("log", append(&["x"]))],
        CheckpointMetadata::new(CheckpointSource::Loop, 2),
    );
    request.deltas[0].base = Some(root.stored[&r2].0.channel_versions["log"].clone());
    request.deltas[0].version.seq = 3;
    request
        .checkpoint
        .channel_versions
        .insert("log".into(), request.deltas[0].version.clone());
    match saver.put(request).await {
        Err(CheckpointError::Invalid { .. }) => {}
        other => panic!("[conformance::{CHECK}] root delta used as subgraph base gave {other:?}"),
    }

    // Pruning one namespace leaves the other alone.
    assert_eq!(saver.prune(&sub.thread, 1).await.ok(), Some(1));
    assert_eq!(
        root.list(ListOptions::default()).await,
        vec![r2.clone(), r1.clone()]
    );
    root.assert_stored(&r1).await;
    sub.assert_stored(&s2).await;

    // Same channel name, same seq, different namespace: each rebuilds its own.
    let r3 = root.step(Some(&r2), &[("log", append(&["root 3"]))]).await;
    let s3 = sub.step(Some(&s2), &[("log", append(&["sub 3"]))]).await;
    root.assert_stored(&r3).await;
    sub.assert_stored(&s3).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemorySaver;

    #[test]
    fn fold_appends_to_snapshot() {
        let chain = ChannelChain {
            snapshot: Some(json!(["a"])),
            deltas: vec![vec![json!("b")], vec![]],
        };
        assert_eq!(fold(&chain), vec![json!("a"), json!("b")]);
    }

    #[test]
    fn driver_builds_valid_requests() {
        let saver = MemorySaver::new();
        let d = Driver::new("t", &saver);
        let (request, state) = d.request(
            None,
            &[("x", append(&["1"]))],
            CheckpointMetadata::new(CheckpointSource::Input, -1),
        );
        crate::support::validate_put(&request).unwrap();
        assert_eq!(state["x"], vec![json!("1")]);
    }
}
