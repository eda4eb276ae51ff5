//! The SQL behind each [`Checkpointer`](keel_checkpoint::Checkpointer) method. Every
//! function here runs on a database thread; all values are bound as parameters.

use std::collections::BTreeMap;

use keel_checkpoint::support::{self, DeltaLink, DeltaLinks};
use keel_checkpoint::{
    ChannelDelta, ChannelVersion, Checkpoint, CheckpointError, CheckpointId, CheckpointMetadata,
    CheckpointSource, CheckpointSummary, CheckpointTuple, ListOptions, PendingWrite, PutRequest,
    ThreadInfo, ThreadKey,
};
use rusqlite::types::{Value as SqlValue, ValueRef};
use rusqlite::{CachedStatement, Connection, OptionalExtension, Row, TransactionBehavior, params};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{OpResult, corrupt, invalid};

/// The checkpoint fields stored as one JSON column, as written since schema 3: each
/// writer listed once, and each channel's version as `[writer index, seq]`.
///
/// ```json
/// {"writers": ["0190…a1", "0190…c7"], "versions": {"messages": [1, 42], "step": [1, 43]},
///  "seen": {}, "sends": []}
/// ```
///
/// A checkpoint's versions name only a few writers (the steps that last wrote each
/// channel), so this is about half the size of a `{"seq", "writer"}` object per
/// channel. It matters for the page count of a commit: a row of the agent's 14
/// channels takes about 450 bytes and stays inside its B-tree page, where the older
/// form's 1,040 bytes spilled onto an overflow page of its own, one more page to write
/// per checkpoint.
#[derive(Serialize)]
struct VersionsRef<'a> {
    writers: Vec<&'a str>,
    versions: BTreeMap<&'a str, (usize, u64)>,
    seen: &'a BTreeMap<String, BTreeMap<String, u64>>,
    sends: &'a [Value],
}

impl<'a> VersionsRef<'a> {
    fn of(checkpoint: &'a Checkpoint) -> Self {
        let mut index: BTreeMap<&str, usize> = BTreeMap::new();
        let mut writers = Vec::new();
        let versions = checkpoint
            .channel_versions
            .iter()
            .map(|(channel, v)| {
                let writer = v.writer.as_str();
                let i = *index.entry(writer).or_insert_with(|| {
                    writers.push(writer);
                    writers.len() - 1
                });
                (channel.as_str(), (i, v.seq))
            })
            .collect();
        VersionsRef {
            writers,
            versions,
            seen: &checkpoint.versions_seen,
            sends: &checkpoint.pending_sends,
        }
    }
}

/// The versions column as read: the form of [`VersionsRef`], or the form files of
/// schema 1 and 2 hold (`channels`: a `{"seq", "writer"}` object per channel).
#[derive(Deserialize)]
struct Versions {
    #[serde(default)]
    writers: Vec<CheckpointId>,
    #[serde(default)]
    versions: Option<BTreeMap<String, (usize, u64)>>,
    #[serde(default)]
    channels: Option<BTreeMap<String, ChannelVersion>>,
    seen: BTreeMap<String, BTreeMap<String, u64>>,
    sends: Vec<Value>,
}

impl Versions {
    /// Each channel's version, writers resolved.
    fn channels(&mut self) -> OpResult<BTreeMap<String, ChannelVersion>> {
        if let Some(channels) = self.channels.take() {
            return Ok(channels);
        }
        let Some(versions) = self.versions.take() else {
            return Err(corrupt(
                "checkpoint versions: neither `versions` nor `channels` is there",
            ));
        };
        versions
            .into_iter()
            .map(|(channel, (i, seq))| {
                let writer = self.writers.get(i).cloned().ok_or_else(|| {
                    corrupt(format!(
                        "checkpoint versions: channel {channel:?} names writer {i} of {}",
                        self.writers.len()
                    ))
                })?;
                Ok((channel, ChannelVersion::new(seq, writer)))
            })
            .collect()
    }
}

const CHECKPOINT_COLUMNS: &str =
    "checkpoint_id, parent_id, created_at, source, step, versions, extra";

fn to_json(value: &impl Serialize) -> OpResult<String> {
    serde_json::to_string(value).map_err(|e| invalid(format!("cannot encode as JSON: {e}")))
}

fn seq_to_sql(seq: u64) -> OpResult<i64> {
    i64::try_from(seq).map_err(|_| invalid(format!("version seq {seq} is above {}", i64::MAX)))
}

fn text<'r>(row: &'r Row<'_>, idx: usize, what: &str) -> OpResult<&'r str> {
    row.get_ref(idx)?
        .as_str()
        .map_err(|e| corrupt(format!("{what}: {e}")))
}

fn json<T: for<'de> Deserialize<'de>>(value: ValueRef<'_>, what: &str) -> OpResult<T> {
    let bytes = value
        .as_bytes()
        .map_err(|e| corrupt(format!("{what}: {e}")))?;
    serde_json::from_slice(bytes).map_err(|e| corrupt(format!("{what}: {e}")))
}

fn parse_id(text: &str, what: &str) -> OpResult<CheckpointId> {
    text.parse().map_err(|e| corrupt(format!("{what}: {e}")))
}

fn parse_source(text: &str) -> OpResult<CheckpointSource> {
    Ok(match text {
        "input" => CheckpointSource::Input,
        "loop" => CheckpointSource::Loop,
        "update" => CheckpointSource::Update,
        "fork" => CheckpointSource::Fork,
        other => return Err(corrupt(format!("unknown checkpoint source {other:?}"))),
    })
}

/// The metadata of a checkpoint row (columns as in [`CHECKPOINT_COLUMNS`]): `source`
/// and `step` from their columns, every other key (the step's `writes`, the extras)
/// from the JSON column, read back through `CheckpointMetadata`'s own serde.
fn metadata_from_row(row: &Row<'_>) -> OpResult<CheckpointMetadata> {
    let source = parse_source(text(row, 3, "checkpoint source")?)?;
    let step: i64 = row.get(4)?;
    let mut map: Map<String, Value> = json(row.get_ref(6)?, "checkpoint metadata")?;
    map.insert("source".to_owned(), Value::from(source.as_str()));
    map.insert("step".to_owned(), Value::from(step));
    serde_json::from_value(Value::Object(map))
        .map_err(|e| corrupt(format!("checkpoint metadata: {e}")))
}

/// The JSON column of a checkpoint's metadata: the metadata as JSON without `source`
/// and `step` (they are columns). Going through `CheckpointMetadata`'s serde keeps
/// every typed field (such as `writes`) along with the extras.
fn metadata_to_json(metadata: &CheckpointMetadata) -> OpResult<String> {
    let mut value = serde_json::to_value(metadata)
        .map_err(|e| invalid(format!("cannot encode metadata as JSON: {e}")))?;
    if let Value::Object(map) = &mut value {
        map.shift_remove("source");
        map.shift_remove("step");
    }
    to_json(&value)
}

/// A checkpoint row (columns as in [`CHECKPOINT_COLUMNS`]) with its metadata.
fn summary_from_row(
    thread: &ThreadKey,
    row: &Row<'_>,
    metadata: CheckpointMetadata,
) -> OpResult<CheckpointSummary> {
    let id = parse_id(text(row, 0, "checkpoint id")?, "checkpoint id")?;
    let parent = match row.get_ref(1)? {
        ValueRef::Null => None,
        _ => Some(parse_id(text(row, 1, "parent id")?, "parent id")?),
    };
    let created_at: i64 = row.get(2)?;
    let mut versions: Versions = json(row.get_ref(5)?, "checkpoint versions")?;
    Ok(CheckpointSummary {
        thread: thread.clone(),
        checkpoint: Checkpoint {
            id,
            parent,
            created_at: u64::try_from(created_at).unwrap_or(0),
            channel_versions: versions.channels()?,
            versions_seen: versions.seen,
            pending_sends: versions.sends,
        },
        metadata,
    })
}

/// The namespace's newest checkpoint id, and its `heads` row's id (which may trail it
/// by up to `HEAD_REFRESH_MILLIS`), in one statement.
fn newest_and_recorded(
    conn: &Connection,
    thread: &ThreadKey,
) -> OpResult<(Option<CheckpointId>, Option<String>)> {
    let mut stmt = conn.prepare_cached(
        "SELECT (SELECT checkpoint_id FROM checkpoints WHERE thread_id = ?1 AND ns = ?2 \
                 ORDER BY checkpoint_id DESC LIMIT 1), \
                (SELECT head FROM heads WHERE thread_id = ?1 AND ns = ?2)",
    )?;
    let mut rows = stmt.query(params![thread.thread_id, thread.ns])?;
    let Some(row) = rows.next()? else {
        return Ok((None, None));
    };
    let newest = match row.get_ref(0)? {
        ValueRef::Null => None,
        _ => Some(parse_id(text(row, 0, "checkpoint id")?, "checkpoint id")?),
    };
    let recorded = match row.get_ref(1)? {
        ValueRef::Null => None,
        _ => Some(text(row, 1, "heads head")?.to_owned()),
    };
    Ok((newest, recorded))
}

/// What the writer remembers of what it stored (it alone writes through this saver):
/// the head versions of each namespace, so a put need not look up what they carry,
/// and the delta links, so a prune need not read chains back.
pub(crate) struct Memo {
    pub(crate) heads: support::HeadVersions,
    pub(crate) links: DeltaLinks,
}

impl Memo {
    pub(crate) fn new(heads: usize, links: usize) -> Self {
        Memo {
            heads: support::HeadVersions::new(heads),
            links: DeltaLinks::new(links),
        }
    }

    fn remember(&mut self, request: &PutRequest) {
        self.heads.remember(request);
        self.links.remember(request);
    }
}

/// `Checkpointer::put`: fencing, reference checks and every insert in one
/// `BEGIN IMMEDIATE` transaction. Any refusal or failure rolls it all back.
pub(crate) fn put(conn: &mut Connection, request: &PutRequest, memo: &mut Memo) -> OpResult<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    put_in(&tx, request, &memo.heads)?;
    tx.commit()?;
    memo.remember(request);
    Ok(())
}

/// `Checkpointer::put_many`: the batch in one `BEGIN IMMEDIATE` transaction, so its
/// checkpoints share one commit (and the pages they all touch are written once).
///
/// If any request fails, the transaction rolls back and the batch is stored again one
/// put at a time, so the requests before the failing one are stored and its own error
/// is returned, as the trait asks.
pub(crate) fn put_many(
    conn: &mut Connection,
    requests: &[PutRequest],
    memo: &mut Memo,
) -> OpResult<()> {
    if let [request] = requests {
        return put(conn, request, memo);
    }
    if put_batch(conn, requests, &mut memo.heads).is_ok() {
        for request in requests {
            memo.links.remember(request);
        }
        return Ok(());
    }
    // Rolled back: the head versions the batch remembered were never stored.
    memo.heads.clear();
    for request in requests {
        put(conn, request, memo)?;
    }
    Ok(())
}

fn put_batch(
    conn: &mut Connection,
    requests: &[PutRequest],
    heads: &mut support::HeadVersions,
) -> OpResult<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    for request in requests {
        put_in(&tx, request, heads)?;
        // Not committed yet: the caller forgets it if the batch fails.
        heads.remember(request);
    }
    tx.commit()?;
    Ok(())
}

/// One put's statements inside `tx` (the caller commits, then remembers the head).
fn put_in(
    tx: &rusqlite::Transaction<'_>,
    request: &PutRequest,
    heads: &support::HeadVersions,
) -> OpResult<()> {
    let PutRequest {
        thread,
        checkpoint,
        metadata,
        deltas,
        expected_head,
    } = request;
    let (current, recorded) = newest_and_recorded(tx, thread)?;
    if current != *expected_head {
        return Err(CheckpointError::Conflict {
            expected: expected_head.clone(),
            actual: current,
        }
        .into());
    }
    if let Some(current) = &current
        && checkpoint.id <= *current
    {
        return Err(invalid(format!(
            "checkpoint id {} does not sort after the head {current}",
            checkpoint.id
        )));
    }
    {
        let mut stored_seq = tx.prepare_cached(
            "SELECT seq FROM deltas \
             WHERE thread_id = ?1 AND ns = ?2 AND channel = ?3 AND writer = ?4",
        )?;
        // The head is `expected_head` (checked above): what it carried is stored.
        for (channel, version) in heads.to_check(request) {
            let seq: Option<i64> = stored_seq
                .query_row(
                    params![
                        thread.thread_id,
                        thread.ns,
                        channel,
                        version.writer.as_str()
                    ],
                    |r| r.get(0),
                )
                .optional()?;
            if seq.is_none() || seq != i64::try_from(version.seq).ok() {
                return Err(invalid(format!(
                    "channel {channel:?}: version {} by {} is not stored",
                    version.seq, version.writer
                )));
            }
        }

        let mut insert_delta = tx.prepare_cached(
            "INSERT INTO deltas \
             (thread_id, ns, channel, writer, seq, base_writer, base_seq, updates, snapshot) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING",
        )?;
        for delta in deltas {
            let base_seq = delta.base.as_ref().map(|b| seq_to_sql(b.seq)).transpose()?;
            let snapshot = delta.snapshot.as_ref().map(to_json).transpose()?;
            let inserted = insert_delta.execute(params![
                thread.thread_id,
                thread.ns,
                delta.channel,
                delta.version.writer.as_str(),
                seq_to_sql(delta.version.seq)?,
                delta.base.as_ref().map(|b| b.writer.as_str()),
                base_seq,
                to_json(&delta.updates)?,
                snapshot,
            ])?;
            if inserted == 0 {
                return Err(invalid(format!(
                    "channel {:?}: a delta by {} is already stored",
                    delta.channel, delta.version.writer
                )));
            }
        }

        let versions = VersionsRef::of(checkpoint);
        let created_at = i64::try_from(checkpoint.created_at).map_err(|_| {
            invalid(format!(
                "created_at {} is out of range",
                checkpoint.created_at
            ))
        })?;
        let mut insert_checkpoint = tx.prepare_cached(
            "INSERT INTO checkpoints \
             (thread_id, ns, checkpoint_id, parent_id, created_at, source, step, versions, extra) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        insert_checkpoint.execute(params![
            thread.thread_id,
            thread.ns,
            checkpoint.id.as_str(),
            checkpoint.parent.as_ref().map(CheckpointId::as_str),
            created_at,
            metadata.source.as_str(),
            metadata.step,
            to_json(&versions)?,
            metadata_to_json(metadata)?,
        ])?;
        // The id sorts after the old head (checked above), so it is the new head. The
        // row is rewritten only when it is missing or HEAD_REFRESH_MILLIS old: a read
        // instead of two pages written on most puts.
        if head_is_stale(recorded.as_deref(), &checkpoint.id) {
            tx.prepare_cached(
                "INSERT INTO heads (thread_id, ns, head) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (thread_id, ns) DO UPDATE SET head = excluded.head",
            )?
            .execute(params![thread.thread_id, thread.ns, checkpoint.id.as_str()])?;
        }
    }
    Ok(())
}

/// How far the `heads` row may trail a namespace's newest checkpoint, in milliseconds of
/// their ids. The row only narrows the TTL sweep and `list_threads` to candidates; both
/// read the checkpoints themselves for the newest id.
const HEAD_REFRESH_MILLIS: u64 = 1_000;

/// Whether the `heads` row (`stored`) must be rewritten for the new head `new`.
fn head_is_stale(stored: Option<&str>, new: &CheckpointId) -> bool {
    let Some(stored) = stored.and_then(|s| s.parse::<CheckpointId>().ok()) else {
        return true;
    };
    new.timestamp_millis()
        .saturating_sub(stored.timestamp_millis())
        >= HEAD_REFRESH_MILLIS
}

/// `Checkpointer::get`, in one read transaction (a consistent snapshot even while
/// another connection writes or prunes).
pub(crate) fn get(
    conn: &mut Connection,
    thread: &ThreadKey,
    id: Option<&CheckpointId>,
) -> OpResult<Option<CheckpointTuple>> {
    let tx = conn.transaction()?;
    let summary = {
        let mut stmt = match id {
            Some(_) => tx.prepare_cached(&format!(
                "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints \
                 WHERE thread_id = ?1 AND ns = ?2 AND checkpoint_id = ?3"
            ))?,
            None => tx.prepare_cached(&format!(
                "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE thread_id = ?1 AND ns = ?2 \
                 ORDER BY checkpoint_id DESC LIMIT 1"
            ))?,
        };
        let mut rows = match id {
            Some(id) => stmt.query(params![thread.thread_id, thread.ns, id.as_str()])?,
            None => stmt.query(params![thread.thread_id, thread.ns])?,
        };
        match rows.next()? {
            Some(row) => {
                let metadata = metadata_from_row(row)?;
                Some(summary_from_row(thread, row, metadata)?)
            }
            None => None,
        }
    };
    let Some(CheckpointSummary {
        thread: _,
        checkpoint,
        metadata,
    }) = summary
    else {
        return Ok(None);
    };

    let mut channels = BTreeMap::new();
    {
        let mut lookup = tx.prepare_cached(
            "SELECT seq, base_writer, base_seq, snapshot, \
             CASE WHEN snapshot IS NULL THEN updates END \
             FROM deltas WHERE thread_id = ?1 AND ns = ?2 AND channel = ?3 AND writer = ?4",
        )?;
        for (channel, version) in &checkpoint.channel_versions {
            let chain = support::build_chain(channel, version, |writer| {
                load_delta(&mut lookup, thread, channel, writer).map_err(CheckpointError::from)
            })?;
            channels.insert(channel.clone(), chain);
        }
    }
    let pending_writes = load_writes(&tx, thread, &checkpoint.id)?;
    tx.finish()?;
    Ok(Some(CheckpointTuple {
        thread: thread.clone(),
        checkpoint,
        metadata,
        channels,
        pending_writes,
    }))
}

/// One stored delta, for `support::build_chain`. A delta with a snapshot comes back
/// without its updates: the chain starts at the snapshot and never reads them.
fn load_delta(
    lookup: &mut CachedStatement<'_>,
    thread: &ThreadKey,
    channel: &str,
    writer: &CheckpointId,
) -> OpResult<Option<ChannelDelta>> {
    let mut rows = lookup.query(params![
        thread.thread_id,
        thread.ns,
        channel,
        writer.as_str()
    ])?;
    let Some(row) = rows.next()? else {
        return Ok(None);
    };
    let what = || format!("delta of channel {channel:?} by {writer}");
    let seq: i64 = row.get(0)?;
    let base = match row.get_ref(1)? {
        ValueRef::Null => None,
        _ => {
            let base_writer = parse_id(text(row, 1, &what())?, &what())?;
            let base_seq: i64 = row.get(2)?;
            Some(ChannelVersion::new(
                u64::try_from(base_seq).map_err(|_| corrupt(what()))?,
                base_writer,
            ))
        }
    };
    let snapshot: Option<Value> = match row.get_ref(3)? {
        ValueRef::Null => None,
        value => Some(json(value, &what())?),
    };
    let updates: Vec<Value> = match row.get_ref(4)? {
        ValueRef::Null => Vec::new(),
        value => json(value, &what())?,
    };
    Ok(Some(ChannelDelta {
        channel: channel.to_owned(),
        version: ChannelVersion::new(
            u64::try_from(seq).map_err(|_| corrupt(what()))?,
            writer.clone(),
        ),
        base,
        updates,
        snapshot,
    }))
}

fn load_writes(
    conn: &Connection,
    thread: &ThreadKey,
    checkpoint: &CheckpointId,
) -> OpResult<Vec<PendingWrite>> {
    let mut stmt = conn.prepare_cached(
        "SELECT task_id, task_path, channel, value FROM writes \
         WHERE thread_id = ?1 AND ns = ?2 AND checkpoint_id = ?3 ORDER BY ord",
    )?;
    let mut rows = stmt.query(params![thread.thread_id, thread.ns, checkpoint.as_str()])?;
    let mut writes = Vec::new();
    while let Some(row) = rows.next()? {
        writes.push(PendingWrite {
            task_id: text(row, 0, "write task id")?.to_owned(),
            task_path: text(row, 1, "write task path")?.to_owned(),
            channel: text(row, 2, "write channel")?.to_owned(),
            value: json(row.get_ref(3)?, "write value")?,
        });
    }
    Ok(writes)
}

/// `Checkpointer::put_writes`, in one `BEGIN IMMEDIATE` transaction.
pub(crate) fn put_writes(
    conn: &mut Connection,
    thread: &ThreadKey,
    checkpoint: &CheckpointId,
    writes: &[PendingWrite],
) -> OpResult<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let exists = tx
        .prepare_cached(
            "SELECT 1 FROM checkpoints WHERE thread_id = ?1 AND ns = ?2 AND checkpoint_id = ?3",
        )?
        .exists(params![thread.thread_id, thread.ns, checkpoint.as_str()])?;
    if !exists {
        return Err(CheckpointError::NotFound {
            what: format!("checkpoint {checkpoint} of thread {thread}"),
        }
        .into());
    }
    if writes.is_empty() {
        return Ok(());
    }
    {
        let next_ord: i64 = tx
            .prepare_cached(
                "SELECT coalesce(max(ord) + 1, 0) FROM writes \
                 WHERE thread_id = ?1 AND ns = ?2 AND checkpoint_id = ?3",
            )?
            .query_row(
                params![thread.thread_id, thread.ns, checkpoint.as_str()],
                |r| r.get(0),
            )?;
        const INSERT: &str = "INSERT INTO writes \
             (thread_id, ns, checkpoint_id, task_id, channel, idx, ord, task_path, value) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
             ON CONFLICT (thread_id, ns, checkpoint_id, task_id, channel, idx) ";
        // A repeated key keeps the stored write, except on the special channels, where
        // the new write replaces it in place (same `ord`).
        let mut keep = tx.prepare_cached(&format!("{INSERT} DO NOTHING"))?;
        let mut replace = tx.prepare_cached(&format!(
            "{INSERT} DO UPDATE SET task_path = excluded.task_path, value = excluded.value"
        ))?;
        for (i, (key, write)) in support::write_keys(writes)
            .into_iter()
            .zip(writes)
            .enumerate()
        {
            let stmt = if write.is_special() {
                &mut replace
            } else {
                &mut keep
            };
            let offset = i64::try_from(i).unwrap_or(i64::MAX);
            stmt.execute(params![
                thread.thread_id,
                thread.ns,
                checkpoint.as_str(),
                write.task_id,
                write.channel,
                i64::try_from(key.index).unwrap_or(i64::MAX),
                next_ord.saturating_add(offset),
                write.task_path,
                to_json(&write.value)?,
            ])?;
        }
    }
    tx.commit()?;
    Ok(())
}

/// `Checkpointer::delete_thread`: every namespace, in one transaction.
pub(crate) fn delete_thread(conn: &mut Connection, thread_id: &str) -> OpResult<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    delete_rows(&tx, thread_id)?;
    tx.commit()?;
    Ok(())
}

/// Deletes every row of `thread_id`, all namespaces (inside the caller's transaction).
fn delete_rows(conn: &Connection, thread_id: &str) -> OpResult<()> {
    for table in ["writes", "deltas", "checkpoints", "heads"] {
        conn.prepare_cached(&format!("DELETE FROM {table} WHERE thread_id = ?1"))?
            .execute([thread_id])?;
    }
    Ok(())
}

/// The heads below the cutoff `?1`, oldest first, of threads with no head at or above
/// it (`INDEXED BY`: preparing fails rather than falling back to a full scan), nor a
/// checkpoint at or above it in any namespace: a `heads` row may trail its namespace's
/// newest checkpoint by up to `HEAD_REFRESH_MILLIS`, so the checkpoints decide.
const SWEEP_IDLE: &str = "SELECT h.thread_id FROM heads h INDEXED BY heads_by_head \
     WHERE h.head < ?1 AND NOT EXISTS \
         (SELECT 1 FROM heads f WHERE f.thread_id = h.thread_id AND (f.head >= ?1 OR \
             EXISTS (SELECT 1 FROM checkpoints c \
                 WHERE c.thread_id = f.thread_id AND c.ns = f.ns AND c.checkpoint_id >= ?1))) \
     ORDER BY h.head";

/// `Checkpointer::sweep_idle`, in one `BEGIN IMMEDIATE` transaction: finds up to `limit`
/// threads whose every head sorts below `cutoff` and deletes them.
///
/// The heads below the cutoff are read in id order from the `heads_by_head` index (a
/// range scan that stops once `limit` threads are found); for each, the thread's other
/// heads are looked up by primary key, so a thread with any newer head is skipped.
pub(crate) fn sweep_idle(
    conn: &mut Connection,
    cutoff: &CheckpointId,
    limit: usize,
) -> OpResult<Vec<String>> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut doomed: Vec<String> = Vec::new();
    {
        let mut stmt = tx.prepare_cached(SWEEP_IDLE)?;
        let mut rows = stmt.query([cutoff.as_str()])?;
        // A thread with several idle namespaces comes once per namespace.
        let mut seen = std::collections::HashSet::new();
        while doomed.len() < limit {
            let Some(row) = rows.next()? else { break };
            let thread_id = text(row, 0, "head thread id")?;
            if seen.insert(thread_id.to_owned()) {
                doomed.push(thread_id.to_owned());
            }
        }
    }
    for thread_id in &doomed {
        delete_rows(&tx, thread_id)?;
    }
    tx.commit()?;
    Ok(doomed)
}

/// `Checkpointer::list_threads`: a range of the heads table's primary key, grouped by
/// thread (the rows of one thread are adjacent in key order).
pub(crate) fn list_threads(
    conn: &mut Connection,
    after: Option<&str>,
    limit: usize,
) -> OpResult<Vec<ThreadInfo>> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    // Each namespace's newest checkpoint (a primary-key seek), as its `heads` row may
    // trail it by up to HEAD_REFRESH_MILLIS.
    let mut stmt = conn.prepare_cached(
        "SELECT h.thread_id, max(coalesce((SELECT c.checkpoint_id FROM checkpoints c \
             WHERE c.thread_id = h.thread_id AND c.ns = h.ns \
             ORDER BY c.checkpoint_id DESC LIMIT 1), h.head)), count(*) \
         FROM heads h WHERE ?1 IS NULL OR h.thread_id > ?1 \
         GROUP BY h.thread_id ORDER BY h.thread_id LIMIT ?2",
    )?;
    let mut rows = stmt.query(params![after, limit])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let thread_id = text(row, 0, "heads thread id")?.to_owned();
        let head = parse_id(text(row, 1, "heads head")?, "heads head")?;
        let namespaces: i64 = row.get(2)?;
        out.push(ThreadInfo::new(
            thread_id,
            head,
            usize::try_from(namespaces).unwrap_or(0),
        ));
    }
    Ok(out)
}

/// `Checkpointer::prune`, in one transaction: drops all but the newest `keep_last`
/// checkpoints with their writes, then every delta no kept checkpoint's chain reaches.
pub(crate) fn prune(
    conn: &mut Connection,
    thread: &ThreadKey,
    keep_last: usize,
    links: &mut DeltaLinks,
) -> OpResult<usize> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let cutoff: Option<String> = match keep_last {
        0 => None,
        n => {
            let offset = i64::try_from(n - 1).unwrap_or(i64::MAX);
            let found: Option<String> = tx
                .prepare_cached(
                    "SELECT checkpoint_id FROM checkpoints WHERE thread_id = ?1 AND ns = ?2 \
                     ORDER BY checkpoint_id DESC LIMIT 1 OFFSET ?3",
                )?
                .query_row(params![thread.thread_id, thread.ns, offset], |r| r.get(0))
                .optional()?;
            match found {
                Some(id) => Some(id),
                None => return Ok(0), // keep_last or fewer checkpoints
            }
        }
    };
    // Without a cutoff (`keep_last = 0`) every checkpoint goes.
    let older = "thread_id = ?1 AND ns = ?2 AND (?3 IS NULL OR checkpoint_id < ?3)";
    let removed = tx
        .prepare_cached(&format!("DELETE FROM checkpoints WHERE {older}"))?
        .execute(params![thread.thread_id, thread.ns, cutoff])?;
    if removed == 0 {
        return Ok(0);
    }
    tx.prepare_cached(&format!("DELETE FROM writes WHERE {older}"))?
        .execute(params![thread.thread_id, thread.ns, cutoff])?;
    if cutoff.is_none() {
        // The namespace is empty: it has no head any more.
        tx.prepare_cached("DELETE FROM heads WHERE thread_id = ?1 AND ns = ?2")?
            .execute(params![thread.thread_id, thread.ns])?;
    }

    // Mark every delta a kept checkpoint's chain reaches (the walk of
    // `support::build_chain`), then delete the unmarked ones. Only deltas written
    // before the cutoff can go: a kept checkpoint's own deltas are on its chain. Each
    // link comes from what this saver remembers, else from the stored delta, and each
    // (channel, writer) is read once however many kept checkpoints share it.
    let mut tips = Vec::new();
    {
        let mut kept =
            tx.prepare_cached("SELECT versions FROM checkpoints WHERE thread_id = ?1 AND ns = ?2")?;
        let mut rows = kept.query(params![thread.thread_id, thread.ns])?;
        while let Some(row) = rows.next()? {
            let mut versions: Versions = json(row.get_ref(0)?, "checkpoint versions")?;
            for (channel, version) in versions.channels()? {
                tips.push((channel, version.writer.as_str().to_owned()));
            }
        }
    }
    let walked = {
        let mut step = tx.prepare_cached(
            "SELECT seq, snapshot IS NULL, base_writer, base_seq FROM deltas \
             WHERE thread_id = ?1 AND ns = ?2 AND channel = ?3 AND writer = ?4",
        )?;
        support::walk_chains(tips, |channel, writer| {
            if let Some(link) = links.get(thread, channel, writer) {
                return Ok(Some(link.clone()));
            }
            let found = step
                .query_row(params![thread.thread_id, thread.ns, channel, writer], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, bool>(1)?,
                        r.get::<_, Option<String>>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                    ))
                })
                .optional()?;
            Ok::<_, rusqlite::Error>(found.map(|(seq, no_snapshot, base_writer, base_seq)| {
                DeltaLink::new(
                    u64::try_from(seq).unwrap_or(0),
                    !no_snapshot,
                    base_writer.zip(base_seq.and_then(|s| u64::try_from(s).ok())),
                )
            }))
        })?
    };
    tx.execute_batch(
        "CREATE TEMP TABLE IF NOT EXISTS prune_keep \
         (channel TEXT NOT NULL, writer TEXT NOT NULL, PRIMARY KEY (channel, writer)) WITHOUT ROWID; \
         DELETE FROM temp.prune_keep;",
    )?;
    {
        let mut mark = tx.prepare_cached(
            "INSERT OR IGNORE INTO temp.prune_keep (channel, writer) VALUES (?1, ?2)",
        )?;
        for (channel, writers) in &walked {
            for writer in writers {
                if cutoff
                    .as_deref()
                    .is_some_and(|cutoff| writer.as_str() < cutoff)
                {
                    mark.execute(params![channel, writer])?;
                }
            }
        }
    }
    tx.prepare_cached(
        "DELETE FROM deltas WHERE thread_id = ?1 AND ns = ?2 \
         AND (?3 IS NULL OR writer < ?3) AND NOT EXISTS \
         (SELECT 1 FROM temp.prune_keep k WHERE k.channel = deltas.channel AND k.writer = deltas.writer)",
    )?
    .execute(params![thread.thread_id, thread.ns, cutoff])?;
    tx.execute_batch("DELETE FROM temp.prune_keep")?;
    tx.commit()?;
    links.forget_pruned(thread, cutoff.as_deref(), &walked);
    Ok(removed)
}

/// Where a `list` stream stands: the filters, and the id to continue below.
#[derive(Debug, Clone)]
pub(crate) struct ListQuery {
    pub(crate) thread: ThreadKey,
    pub(crate) options: ListOptions,
    /// Continue with ids below this one (starts as `options.before`).
    pub(crate) below: Option<CheckpointId>,
}

/// One page of a `list`.
pub(crate) struct Page {
    /// The matching checkpoints, newest first.
    pub(crate) items: Vec<CheckpointSummary>,
    /// The oldest id scanned (where the next page continues).
    pub(crate) last: Option<CheckpointId>,
    /// True when the scan reached the oldest checkpoint.
    pub(crate) done: bool,
}

/// Whether a metadata filter can match anything at all (`source` must be a string,
/// `step` an integer and `writes` an array of strings).
pub(crate) fn filter_can_match(filter: &Map<String, Value>) -> bool {
    let source_ok = filter.get("source").is_none_or(Value::is_string);
    let step_ok = filter.get("step").is_none_or(|v| v.as_i64().is_some());
    let writes_ok = filter
        .get("writes")
        .is_none_or(|v| v.as_array().is_some_and(|a| a.iter().all(Value::is_string)));
    source_ok && step_ok && writes_ok
}

/// Whether every key of the filter is checked exactly by the SQL (so a page can be cut
/// at the caller's limit).
pub(crate) fn filter_is_exact(filter: &Map<String, Value>) -> bool {
    filter.keys().all(|k| k == "source" || k == "step")
}

/// Reads up to `page` checkpoints below the cursor that pass the SQL filters, and keeps
/// those whose metadata matches the whole filter. `source` and `step` are filtered in
/// SQL; an extra key with a string, integer, boolean or null value is pre-filtered by
/// looking for its exact JSON text (`"key":value`) in the stored extras, which every
/// match contains, and each node of a `writes` filter by its JSON string (`"node"`);
/// `CheckpointMetadata::matches` decides.
pub(crate) fn list_page(conn: &Connection, query: &ListQuery, page: usize) -> OpResult<Page> {
    let mut sql =
        format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE thread_id = ?1 AND ns = ?2");
    let mut args: Vec<SqlValue> = vec![
        SqlValue::Text(query.thread.thread_id.clone()),
        SqlValue::Text(query.thread.ns.clone()),
    ];
    let mut bind = |sql: &mut String, clause: &str, value: SqlValue| {
        args.push(value);
        sql.push_str(&clause.replace('?', &format!("?{}", args.len())));
    };
    if let Some(below) = &query.below {
        bind(
            &mut sql,
            " AND checkpoint_id < ?",
            SqlValue::Text(below.as_str().to_owned()),
        );
    }
    for (key, want) in &query.options.metadata {
        match (key.as_str(), want) {
            ("source", Value::String(source)) => {
                bind(&mut sql, " AND source = ?", SqlValue::Text(source.clone()));
            }
            ("step", want) => {
                if let Some(step) = want.as_i64() {
                    bind(&mut sql, " AND step = ?", SqlValue::Integer(step));
                }
            }
            ("writes", Value::Array(nodes)) => {
                for node in nodes.iter().filter(|n| n.is_string()) {
                    bind(
                        &mut sql,
                        " AND instr(extra, ?) > 0",
                        SqlValue::Text(to_json(node)?),
                    );
                }
            }
            (_, Value::String(_) | Value::Bool(_) | Value::Null) => {
                let needle = format!("{}:{}", to_json(key)?, to_json(want)?);
                bind(&mut sql, " AND instr(extra, ?) > 0", SqlValue::Text(needle));
            }
            (_, Value::Number(n)) if n.is_i64() || n.is_u64() => {
                let needle = format!("{}:{}", to_json(key)?, to_json(want)?);
                bind(&mut sql, " AND instr(extra, ?) > 0", SqlValue::Text(needle));
            }
            _ => {}
        }
    }
    let limit = i64::try_from(page).unwrap_or(i64::MAX);
    bind(
        &mut sql,
        " ORDER BY checkpoint_id DESC LIMIT ?",
        SqlValue::Integer(limit),
    );

    let mut stmt = conn.prepare_cached(&sql)?;
    let mut rows = stmt.query(rusqlite::params_from_iter(args))?;
    let mut items = Vec::new();
    let mut last = None;
    let mut scanned = 0usize;
    while let Some(row) = rows.next()? {
        scanned += 1;
        last = Some(parse_id(text(row, 0, "checkpoint id")?, "checkpoint id")?);
        let metadata = metadata_from_row(row)?;
        if metadata.matches(&query.options.metadata) {
            items.push(summary_from_row(&query.thread, row, metadata)?);
        }
    }
    Ok(Page {
        items,
        last,
        done: scanned < page,
    })
}

/// Counts of what a database holds.
pub(crate) fn stats(conn: &Connection) -> OpResult<crate::SqliteStats> {
    let count = |sql: &str| -> OpResult<u64> {
        let n: i64 = conn.query_row(sql, [], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let page_size = count("PRAGMA page_size")?;
    Ok(crate::SqliteStats {
        threads: count("SELECT count(*) FROM (SELECT DISTINCT thread_id FROM checkpoints)")?,
        checkpoints: count("SELECT count(*) FROM checkpoints")?,
        deltas: count("SELECT count(*) FROM deltas")?,
        snapshots: count("SELECT count(*) FROM deltas WHERE snapshot IS NOT NULL")?,
        pending_writes: count("SELECT count(*) FROM writes")?,
        delta_bytes: count(
            "SELECT coalesce(sum(length(updates) + coalesce(length(snapshot), 0)), 0) FROM deltas",
        )?,
        database_bytes: count("PRAGMA page_count")? * page_size,
        free_bytes: count("PRAGMA freelist_count")? * page_size,
    })
}

/// `PRAGMA wal_checkpoint(TRUNCATE)`: copies the write-ahead log into the database file
/// and empties it. Returns whether a reader kept it from finishing.
pub(crate) fn wal_checkpoint(conn: &Connection) -> OpResult<bool> {
    let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
    Ok(busy != 0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn sweep_reads_a_range_of_the_heads_index() {
        let conn = crate::schema::open_memory(&crate::SqliteOptions::default()).unwrap();
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {SWEEP_IDLE}"))
            .unwrap();
        let plan: Vec<String> = stmt
            .query_map(["01890a5d-ac96-7000-8000-000000000000"], |r| r.get(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let has = |step: &str| plan.iter().any(|p| p.contains(step));
        assert!(
            has("SEARCH h USING COVERING INDEX heads_by_head (head<?)"),
            "{plan:?}"
        );
        assert!(has("SEARCH f USING PRIMARY KEY (thread_id=?)"), "{plan:?}");
        assert!(
            has("SEARCH c USING PRIMARY KEY (thread_id=? AND ns=? AND checkpoint_id>?)"),
            "{plan:?}"
        );
        assert!(!plan.iter().any(|p| p.starts_with("SCAN")), "{plan:?}");
    }
}
