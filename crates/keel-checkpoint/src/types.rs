//! The data a checkpointer stores and returns.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::id::{CheckpointId, ThreadKey};

/// The version of one channel's value: a sequence number along the branch and the
/// checkpoint whose step wrote it.
///
/// `seq` increases along a branch; two branches forked from one checkpoint may both
/// reach the same `seq`, so `writer` is what makes a version unique, and stored deltas
/// are keyed by it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChannelVersion {
    /// Position along the branch; greater than the version it was built on.
    pub seq: u64,
    /// The checkpoint whose step produced this version.
    pub writer: CheckpointId,
}

impl ChannelVersion {
    /// The version `seq` written by checkpoint `writer`.
    pub fn new(seq: u64, writer: CheckpointId) -> Self {
        Self { seq, writer }
    }
}

/// The state of a graph run after one step, as versions: which version each channel
/// holds, which versions each node has seen, and the `Send` packets queued for the next
/// step. Channel *values* are not here; they are stored once as [`ChannelDelta`]s and
/// come back as [`ChannelChain`]s.
///
/// ```
/// use keel_checkpoint::{ChannelVersion, Checkpoint};
///
/// let first = Checkpoint::new(None);
/// let mut second = first.successor();
/// assert_eq!(second.parent.as_ref(), Some(&first.id));
/// assert!(second.id > first.id);
/// second
///     .channel_versions
///     .insert("messages".into(), ChannelVersion::new(1, second.id.clone()));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// This checkpoint's id.
    pub id: CheckpointId,
    /// The checkpoint this one was made from (for a fork, the older one it branches off).
    pub parent: Option<CheckpointId>,
    /// When it was made, in milliseconds since the Unix epoch.
    pub created_at: u64,
    /// The current version of every channel that has a value.
    pub channel_versions: BTreeMap<String, ChannelVersion>,
    /// For each node, the `seq` of each channel version it last ran on.
    pub versions_seen: BTreeMap<String, BTreeMap<String, u64>>,
    /// `Send` packets to run in the next step (opaque to the checkpointer).
    pub pending_sends: Vec<Value>,
}

impl Checkpoint {
    /// An empty checkpoint with a fresh id, made now.
    pub fn new(parent: Option<CheckpointId>) -> Self {
        Self {
            id: CheckpointId::new(),
            parent,
            created_at: now_millis(),
            channel_versions: BTreeMap::new(),
            versions_seen: BTreeMap::new(),
            pending_sends: Vec::new(),
        }
    }

    /// The next checkpoint on this branch: a fresh id, `parent` = this one, the same
    /// channel versions and versions seen, and no pending sends.
    pub fn successor(&self) -> Self {
        Self {
            id: CheckpointId::new_after(&self.id),
            parent: Some(self.id.clone()),
            created_at: now_millis(),
            channel_versions: self.channel_versions.clone(),
            versions_seen: self.versions_seen.clone(),
            pending_sends: Vec::new(),
        }
    }
}

fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Why a checkpoint was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointSource {
    /// From the input of a run (before the first step).
    Input,
    /// By a step of the run loop.
    Loop,
    /// By a manual state update.
    Update,
    /// As a copy of another checkpoint (a fork).
    Fork,
}

impl CheckpointSource {
    /// The lowercase name used in JSON (`"input"`, `"loop"`, `"update"`, `"fork"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::Loop => "loop",
            Self::Update => "update",
            Self::Fork => "fork",
        }
    }
}

/// What is known about a checkpoint besides its state: why and at which step it was
/// made, which nodes wrote it, plus free-form keys.
///
/// As JSON (and for [`ListOptions::metadata`] filters) it is one flat object:
/// `{"source": "loop", "step": 3, "writes": ["agent"], ...extra}` (`writes` is left out
/// when empty).
///
/// ```
/// use keel_checkpoint::{CheckpointMetadata, CheckpointSource};
/// use serde_json::json;
///
/// let meta = CheckpointMetadata::new(CheckpointSource::Loop, 3)
///     .with_writes(["tools", "agent", "tools"])
///     .with_extra("run", json!("r1"));
/// assert_eq!(meta.writes, ["agent", "tools"]);
/// assert_eq!(
///     serde_json::to_value(&meta)?,
///     json!({"source": "loop", "step": 3, "writes": ["agent", "tools"], "run": "r1"})
/// );
/// let filter = json!({"step": 3, "run": "r1", "writes": ["tools"]});
/// assert!(meta.matches(filter.as_object().unwrap()));
/// assert!(meta.written_by("agent"));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// Why the checkpoint was made.
    pub source: CheckpointSource,
    /// The step number (`-1` for the input checkpoint, then 0, 1, …).
    pub step: i64,
    /// The nodes that wrote the step this checkpoint stores, sorted, without repeats.
    /// keel-graph records the nodes whose tasks ran in the step (a node that ran but
    /// changed nothing included), `__start__` for the input, the `as_node` of a state
    /// update, and for a checkpoint that stores several steps at once (durability
    /// `Exit`) the nodes of all of them. Empty for a manual edit and in metadata
    /// stored before this field existed. (LangGraph keeps each node's writes under
    /// this key; here it is only the names, the writes are the channel deltas.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writes: Vec<String>,
    /// Any other keys (the field names `source`, `step` and `writes` are not allowed
    /// here: [`support::validate_put`](crate::support::validate_put) refuses them).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl CheckpointMetadata {
    /// The JSON keys of the typed fields, which [`extra`](Self::extra) may not use.
    pub const RESERVED_KEYS: [&'static str; 3] = ["source", "step", "writes"];

    /// Metadata with no writers and no extra keys.
    pub fn new(source: CheckpointSource, step: i64) -> Self {
        Self {
            source,
            step,
            writes: Vec::new(),
            extra: Map::new(),
        }
    }

    /// Sets the nodes that wrote the step (sorted, repeats dropped).
    pub fn with_writes<I, N>(mut self, nodes: I) -> Self
    where
        I: IntoIterator<Item = N>,
        N: Into<String>,
    {
        let mut writes: Vec<String> = nodes.into_iter().map(Into::into).collect();
        writes.sort_unstable();
        writes.dedup();
        self.writes = writes;
        self
    }

    /// Adds one extra key.
    pub fn with_extra(mut self, key: impl Into<String>, value: Value) -> Self {
        self.extra.insert(key.into(), value);
        self
    }

    /// Whether `node` is one of the step's writers ([`writes`](Self::writes)).
    pub fn written_by(&self, node: &str) -> bool {
        self.writes.iter().any(|w| w == node)
    }

    /// Whether every key of `filter` matches this metadata. An empty filter matches
    /// everything.
    ///
    /// `source`, `step` and extra keys match when equal. `writes` is a containment
    /// test: it takes an array of node names and matches when every one of them is
    /// among the step's writers (so `{"writes": ["agent"]}` finds the checkpoints
    /// `agent` wrote, whoever else wrote with it; `[]` matches everything); any value
    /// other than an array of strings matches nothing.
    pub fn matches(&self, filter: &Map<String, Value>) -> bool {
        filter.iter().all(|(key, want)| match key.as_str() {
            "source" => want.as_str() == Some(self.source.as_str()),
            "step" => want.as_i64() == Some(self.step),
            "writes" => want.as_array().is_some_and(|nodes| {
                nodes
                    .iter()
                    .all(|n| n.as_str().is_some_and(|n| self.written_by(n)))
            }),
            _ => self.extra.get(key) == Some(want),
        })
    }
}

/// What one step wrote to one channel: the updates of that step, in application
/// order, and (when the writer chose to include one) the full value after them.
///
/// Deltas are stored once, keyed by `(thread, ns, channel, version.writer)`, and shared
/// by every later checkpoint that still holds this version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelDelta {
    /// The channel written.
    pub channel: String,
    /// The new version; its `writer` is the checkpoint being put.
    pub version: ChannelVersion,
    /// The version these updates apply to; `None` = the channel's empty value.
    pub base: Option<ChannelVersion>,
    /// The updates, in application order.
    pub updates: Vec<Value>,
    /// The full value after the updates, if provided.
    pub snapshot: Option<Value>,
}

/// How to rebuild one channel's value: start from `snapshot` (or the channel's empty
/// value when `None`) and apply the updates of each delta in order, oldest first.
///
/// ```
/// use keel_checkpoint::ChannelChain;
/// use serde_json::json;
///
/// let chain = ChannelChain {
///     snapshot: Some(json!([1, 2])),
///     deltas: vec![vec![json!(3)], vec![json!(4), json!(5)]],
/// };
/// // An "append" channel: fold the updates onto the snapshot.
/// let mut value = chain.snapshot.clone().unwrap_or(json!([]));
/// for update in chain.updates() {
///     value.as_array_mut().unwrap().push(update.clone());
/// }
/// assert_eq!(value, json!([1, 2, 3, 4, 5]));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChannelChain {
    /// The value to start from; `None` = the channel's empty value.
    pub snapshot: Option<Value>,
    /// The updates of each delta after the snapshot, oldest delta first.
    pub deltas: Vec<Vec<Value>>,
}

impl ChannelChain {
    /// Every update of the chain, in application order.
    pub fn updates(&self) -> impl Iterator<Item = &Value> {
        self.deltas.iter().flatten()
    }
}

/// One write a task made during the step after a checkpoint, saved before the step's
/// checkpoint so a crashed step can resume without rerunning finished tasks.
///
/// Writes to the special channels [`ERROR`](Self::ERROR),
/// [`INTERRUPT`](Self::INTERRUPT) and [`RESUME`](Self::RESUME) replace an earlier
/// write with the same key when put again; ordinary writes are kept as first stored
/// (see [`Checkpointer::put_writes`](crate::Checkpointer::put_writes)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingWrite {
    /// The task that wrote.
    pub task_id: String,
    /// The task's path (the engine orders a step's writes by it).
    pub task_path: String,
    /// The channel written (or a special channel).
    pub channel: String,
    /// The value written.
    pub value: Value,
}

impl PendingWrite {
    /// Special channel: the task failed; the value describes the error.
    pub const ERROR: &'static str = "__error__";
    /// Special channel: the task was interrupted; the value is the interrupt payload.
    pub const INTERRUPT: &'static str = "__interrupt__";
    /// Special channel: the value resumes an interrupted task.
    pub const RESUME: &'static str = "__resume__";

    /// A write of `value` to `channel` by task `task_id` at `task_path`.
    pub fn new(
        task_id: impl Into<String>,
        task_path: impl Into<String>,
        channel: impl Into<String>,
        value: Value,
    ) -> Self {
        Self {
            task_id: task_id.into(),
            task_path: task_path.into(),
            channel: channel.into(),
            value,
        }
    }

    /// Whether the channel is one of the special channels, whose writes replace
    /// earlier ones with the same key.
    pub fn is_special(&self) -> bool {
        matches!(
            self.channel.as_str(),
            Self::ERROR | Self::INTERRUPT | Self::RESUME
        )
    }
}

/// A checkpoint with everything needed to resume from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointTuple {
    /// Where it is stored.
    pub thread: ThreadKey,
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its metadata.
    pub metadata: CheckpointMetadata,
    /// One chain per channel in `checkpoint.channel_versions`.
    pub channels: BTreeMap<String, ChannelChain>,
    /// Writes stored against this checkpoint, in stored order.
    pub pending_writes: Vec<PendingWrite>,
}

/// A checkpoint without its channel data, as [`Checkpointer::list`](crate::Checkpointer::list) returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointSummary {
    /// Where it is stored.
    pub thread: ThreadKey,
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its metadata.
    pub metadata: CheckpointMetadata,
}

/// A stored thread, as [`Checkpointer::list_threads`](crate::Checkpointer::list_threads)
/// returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ThreadInfo {
    /// The thread id.
    pub thread_id: String,
    /// Its newest checkpoint over every namespace (its id carries the time it was made:
    /// [`CheckpointId::timestamp_millis`](crate::CheckpointId::timestamp_millis)).
    pub head: CheckpointId,
    /// Namespaces holding checkpoints (1 for a thread without subgraphs).
    pub namespaces: usize,
}

impl ThreadInfo {
    /// A thread whose newest checkpoint is `head`.
    pub fn new(thread_id: impl Into<String>, head: CheckpointId, namespaces: usize) -> Self {
        Self {
            thread_id: thread_id.into(),
            head,
            namespaces,
        }
    }
}

/// A checkpoint to store, with the deltas its step wrote and the head the writer
/// expects (fencing, invariant 7).
#[derive(Debug, Clone, PartialEq)]
pub struct PutRequest {
    /// Where to store it.
    pub thread: ThreadKey,
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its metadata.
    pub metadata: CheckpointMetadata,
    /// One delta per channel whose version this checkpoint's step wrote
    /// (`version.writer == checkpoint.id`).
    pub deltas: Vec<ChannelDelta>,
    /// The thread's newest checkpoint id as the writer last saw it (`None` = the thread
    /// has no checkpoint yet). For a fork this is still the current head, not the
    /// checkpoint forked from.
    pub expected_head: Option<CheckpointId>,
}

/// Filters for [`Checkpointer::list`](crate::Checkpointer::list).
///
/// ```
/// use keel_checkpoint::ListOptions;
/// use serde_json::json;
///
/// let options = ListOptions::default().limit(10).metadata("source", json!("loop"));
/// assert_eq!(options.limit, Some(10));
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListOptions {
    /// Only checkpoints whose id sorts before this one.
    pub before: Option<CheckpointId>,
    /// At most this many.
    pub limit: Option<usize>,
    /// Only checkpoints whose metadata has every one of these keys equal (`writes`:
    /// contained; see [`CheckpointMetadata::matches`]).
    pub metadata: Map<String, Value>,
}

impl ListOptions {
    /// Only checkpoints older than `id`.
    pub fn before(mut self, id: CheckpointId) -> Self {
        self.before = Some(id);
        self
    }

    /// At most `limit` checkpoints.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Only checkpoints whose metadata `key` equals `value` (for `writes`, see
    /// [`written_by`](Self::written_by)).
    pub fn metadata(mut self, key: impl Into<String>, value: Value) -> Self {
        self.metadata.insert(key.into(), value);
        self
    }

    /// Only checkpoints whose step `node` wrote ([`CheckpointMetadata::writes`]
    /// contains it). Called again, each node must be among the writers.
    ///
    /// ```
    /// use keel_checkpoint::ListOptions;
    /// use serde_json::json;
    ///
    /// let options = ListOptions::default().written_by("agent").written_by("tools").limit(1);
    /// assert_eq!(options.metadata["writes"], json!(["agent", "tools"]));
    /// ```
    pub fn written_by(mut self, node: impl Into<String>) -> Self {
        let node = Value::String(node.into());
        match self.metadata.get_mut("writes") {
            Some(Value::Array(nodes)) => {
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
            _ => {
                self.metadata
                    .insert("writes".to_owned(), Value::Array(vec![node]));
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn filter(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    #[test]
    fn metadata_without_writes_reads_as_no_writers_and_writes_nothing_back()
    -> Result<(), serde_json::Error> {
        let old = json!({"source": "loop", "step": 2, "run": "r"});
        let meta: CheckpointMetadata = serde_json::from_value(old.clone())?;
        assert!(meta.writes.is_empty());
        assert_eq!(meta.extra.len(), 1);
        assert_eq!(serde_json::to_value(&meta)?, old);
        Ok(())
    }

    #[test]
    fn writes_round_trip_beside_the_extras() -> Result<(), serde_json::Error> {
        let meta = CheckpointMetadata::new(CheckpointSource::Update, 4)
            .with_writes(["b", "a", "b"])
            .with_extra("run", json!(1));
        let text = serde_json::to_string(&meta)?;
        assert_eq!(
            text,
            r#"{"source":"update","step":4,"writes":["a","b"],"run":1}"#
        );
        let back: CheckpointMetadata = serde_json::from_str(&text)?;
        assert_eq!(back, meta);
        assert!(!back.extra.contains_key("writes"));
        Ok(())
    }

    #[test]
    fn a_writes_filter_is_containment() {
        let meta = CheckpointMetadata::new(CheckpointSource::Loop, 1).with_writes(["a", "b"]);
        let yes = [
            json!({"writes": ["a"]}),
            json!({"writes": ["b", "a"]}),
            json!({"writes": []}),
            json!({"writes": ["a"], "step": 1}),
        ];
        for f in yes {
            assert!(meta.matches(&filter(f.clone())), "{f}");
        }
        let no = [
            json!({"writes": ["c"]}),
            json!({"writes": ["a", "c"]}),
            json!({"writes": "a"}),
            json!({"writes": [1]}),
            json!({"writes": null}),
            json!({"writes": ["a"], "step": 2}),
        ];
        for f in no {
            assert!(!meta.matches(&filter(f.clone())), "{f}");
        }
        let none = CheckpointMetadata::new(CheckpointSource::Loop, 1);
        assert!(none.matches(&filter(json!({"writes": []}))));
        assert!(!none.matches(&filter(json!({"writes": ["a"]}))));
    }

    #[test]
    fn written_by_builds_one_writes_filter() {
        let options = ListOptions::default()
            .written_by("a")
            .written_by("b")
            .written_by("a");
        assert_eq!(options.metadata, filter(json!({"writes": ["a", "b"]})));
        // A `writes` filter that is not a list is replaced.
        let options = ListOptions::default()
            .metadata("writes", json!("x"))
            .written_by("a");
        assert_eq!(options.metadata, filter(json!({"writes": ["a"]})));
    }
}
