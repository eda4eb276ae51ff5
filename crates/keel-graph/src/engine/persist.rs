//! Checkpoint writes: each step as per-channel deltas with the snapshot policy, task
//! writes, and the writers of the three durability modes.

use super::*;

/// A channel is snapshotted once the deltas since its last snapshot weigh this many
/// times the snapshot.
const SNAPSHOT_RATIO: usize = 2;
/// Capacity of the async writer's queue.
const ASYNC_QUEUE: usize = 64;

/// Per-channel bookkeeping for the snapshot policy.
#[derive(Clone, Default)]
pub(super) struct ChannelBook {
    pub(super) version: Option<ChannelVersion>,
    pub(super) delta_bytes: usize,
    pub(super) snapshot_bytes: usize,
}

impl<S: State> RunState<S> {
    pub(super) fn task_writes(
        &self,
        t: &Task,
        o: &Outcome<S>,
    ) -> Result<Vec<PendingWrite>, GraphError> {
        let mut writes = Vec::new();
        match o {
            Outcome::Interrupted(v) => {
                // Every interrupt the task raised so far, one write each: the earlier
                // ones are stored again under their own keys, this one after them.
                let answered = resume::task_values(&self.pending, &t.id, RESUME).len();
                let raised = resume::task_values(&self.pending, &t.id, INTERRUPT);
                for earlier in raised.into_iter().take(answered).chain([v]) {
                    writes.push(PendingWrite::new(
                        t.id.clone(),
                        t.path.clone(),
                        INTERRUPT,
                        earlier.clone(),
                    ));
                }
            }
            Outcome::Done(c) => {
                if let Some(u) = &c.update {
                    for (ch, v) in st::encode_update::<S>(u)? {
                        writes.push(PendingWrite::new(
                            t.id.clone(),
                            t.path.clone(),
                            channel_name::<S>(ch, "State::encode_update")?,
                            v,
                        ));
                    }
                }
                let specs: Vec<TaskSpec> = c
                    .goto
                    .iter()
                    .map(|g| match g {
                        Goto::Node(n) => TaskSpec {
                            node: n.clone(),
                            payload: None,
                        },
                        Goto::Send(s) => TaskSpec {
                            node: s.node.clone(),
                            payload: Some(s.payload.clone()),
                        },
                    })
                    .collect();
                // Always written, so a finished task with no update is still recognised.
                writes.push(PendingWrite::new(
                    t.id.clone(),
                    t.path.clone(),
                    GOTO,
                    serde_json::to_value(specs).unwrap_or(Value::Null),
                ));
            }
        }
        Ok(writes)
    }
}

impl<S: State> RunState<S> {
    /// Makes the step's checkpoint and hands it to the writer.
    pub(super) async fn persist(
        &mut self,
        writer: &mut Writer,
        source: CheckpointSource,
        per_channel: BTreeMap<usize, Vec<Value>>,
    ) -> Result<(), GraphError> {
        match writer {
            // Nothing stored: no checkpoint ids or versions to keep.
            Writer::None => Ok(()),
            Writer::Exit(_) => {
                self.dirty.extend(per_channel.keys());
                self.steps_since_store += 1;
                Ok(())
            }
            Writer::Sync(cp) => {
                let cp = Arc::clone(cp);
                let thread = self
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                self.commit(source, per_channel, Some(&cp), &thread)
                    .await
                    .map(|_| ())
            }
            Writer::Async { .. } => {
                let thread = self
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                let request = self.build_put(source, per_channel, &thread)?;
                writer.enqueue(request).await?;
                self.after_put().await
            }
        }
    }

    /// Builds and stores a checkpoint now.
    pub(super) async fn commit(
        &mut self,
        source: CheckpointSource,
        per_channel: BTreeMap<usize, Vec<Value>>,
        cp: Option<&Arc<dyn Checkpointer>>,
        thread: &ThreadKey,
    ) -> Result<CheckpointId, GraphError> {
        let request = self.build_put(source, per_channel, thread)?;
        let id = request.checkpoint.id.clone();
        if let Some(cp) = cp {
            cp.put(request).await?;
        }
        self.after_put().await?;
        Ok(id)
    }

    pub(super) async fn after_put(&mut self) -> Result<(), GraphError> {
        self.steps_since_store = 0;
        self.head = Some(self.checkpoint.id.clone());
        self.stored = Some(self.checkpoint.id.clone());
        if let Some(sink) = &self.events
            && sink.mode.debug
        {
            sink.send(Event::Checkpoint {
                step: self.step,
                id: self.checkpoint.id.clone(),
                next: self.tasks.iter().map(|t| t.node.clone()).collect(),
            })
            .await?;
        }
        Ok(())
    }

    /// Advances `self.checkpoint` to a successor with new versions for `channels`.
    pub(super) fn next_checkpoint(
        &mut self,
        channels: &BTreeMap<usize, Vec<Value>>,
    ) -> Result<Vec<(usize, Option<ChannelVersion>, ChannelVersion)>, StateError> {
        // Every index is checked before anything changes.
        let names = channels
            .keys()
            .map(|&c| Ok((c, channel_name::<S>(c, "State::apply")?)))
            .collect::<Result<Vec<_>, StateError>>()?;
        let mut next = self.checkpoint.successor();
        // Ids order a thread's history: a new one must sort after the thread's head,
        // even when that head was written by another machine or this run forked.
        if let Some(head) = &self.head
            && next.id <= *head
        {
            next.id = CheckpointId::new_after(head);
        }
        next.pending_sends = self
            .tasks
            .iter()
            .filter_map(|t| serde_json::to_value(t).ok())
            .collect();
        for (j, seen) in self.joins_seen.iter().enumerate() {
            let key = format!("{JOIN_PREFIX}{j}");
            if seen.is_empty() {
                next.versions_seen.remove(&key);
            } else {
                next.versions_seen.insert(
                    key,
                    seen.iter()
                        .map(|n| (self.graph.name(*n).to_string(), 1))
                        .collect(),
                );
            }
        }
        let mut versions = Vec::new();
        for (c, name) in names {
            let book = book_mut::<S>(&mut self.books, c)?;
            let base = book.version.clone();
            let version =
                ChannelVersion::new(base.as_ref().map_or(1, |v| v.seq + 1), next.id.clone());
            next.channel_versions
                .insert(name.to_owned(), version.clone());
            book.version = Some(version.clone());
            versions.push((c, base, version));
        }
        self.checkpoint = next;
        Ok(versions)
    }

    pub(super) fn build_put(
        &mut self,
        source: CheckpointSource,
        mut per_channel: BTreeMap<usize, Vec<Value>>,
        thread: &ThreadKey,
    ) -> Result<PutRequest, GraphError> {
        // Channels written while not storing (exit durability) go as snapshots.
        let dirty = std::mem::take(&mut self.dirty);
        let snapshot_only: BTreeSet<usize> = dirty
            .iter()
            .copied()
            .filter(|c| !per_channel.contains_key(c))
            .collect();
        for c in &dirty {
            per_channel.entry(*c).or_default();
        }
        let versions = self.next_checkpoint(&per_channel)?;
        let mut deltas = Vec::with_capacity(versions.len());
        for (c, base, version) in versions {
            let updates = per_channel.remove(&c).unwrap_or_default();
            let book = book_mut::<S>(&mut self.books, c)?;
            let bytes: usize = updates.iter().map(json_size).sum();
            book.delta_bytes += bytes;
            // Snapshot when the deltas since the last snapshot outweigh it
            // SNAPSHOT_RATIO times: snapshots of a growing value then add up to at most
            // about 1.5x its final size (storage stays linear in
            // the data written), and rebuilding folds at most twice the value's size in
            // deltas.
            let snapshot = if snapshot_only.contains(&c)
                || dirty.contains(&c)
                || base.is_none()
                || book.delta_bytes >= SNAPSHOT_RATIO * book.snapshot_bytes
            {
                let v = self.state.encode_channel(c)?;
                book.snapshot_bytes = json_size(&v);
                book.delta_bytes = 0;
                Some(v)
            } else {
                None
            };
            // A snapshot already holds this step's updates, and a chain starts at its
            // newest snapshot: storing the updates too would only repeat them.
            let updates = if snapshot.is_some() {
                Vec::new()
            } else {
                updates
            };
            deltas.push(ChannelDelta {
                channel: channel_name::<S>(c, "State::apply")?.to_owned(),
                version,
                base: if snapshot_only.contains(&c) {
                    None
                } else {
                    base
                },
                updates,
                snapshot,
            });
        }
        let mut metadata = CheckpointMetadata::new(source, self.step);
        // A BTreeSet: sorted and without repeats, as `writes` promises.
        metadata.writes = std::mem::take(&mut self.writers).into_iter().collect();
        for (k, v) in &self.metadata {
            metadata = metadata.with_extra(k.clone(), v.clone());
        }
        let mut checkpoint = self.checkpoint.clone();
        // Parent is the last stored checkpoint (not an unstored in-memory one).
        checkpoint.parent = self.stored.clone();
        Ok(PutRequest {
            thread: thread.clone(),
            checkpoint,
            metadata,
            deltas,
            expected_head: self.head.clone(),
        })
    }
}

/// Where checkpoints go.
pub(super) enum Writer {
    None,
    Sync(Arc<dyn Checkpointer>),
    Async {
        tx: Option<mpsc::Sender<WriteOp>>,
        handle: Option<tokio::task::JoinHandle<Result<(), GraphError>>>,
    },
    Exit(Arc<dyn Checkpointer>),
}

pub(super) enum WriteOp {
    Put(Box<PutRequest>),
    Writes(ThreadKey, CheckpointId, Vec<PendingWrite>),
}

impl Writer {
    pub(super) fn new(cp: Option<Arc<dyn Checkpointer>>, config: &RunConfig) -> Self {
        let Some(cp) = cp.filter(|_| config.thread_id.is_some()) else {
            return Writer::None;
        };
        match config.durability {
            Durability::Sync => Writer::Sync(cp),
            Durability::Exit => Writer::Exit(cp),
            // A checkpointer that is not durable (in memory) stores a checkpoint at once,
            // under a lock: handing it to a background writer would cost more than the
            // put, and storing it before the next step is what async promises at least.
            Durability::Async if !cp.is_durable() => Writer::Sync(cp),
            Durability::Async => {
                let (tx, mut rx) = mpsc::channel::<WriteOp>(ASYNC_QUEUE);
                let handle = tokio::spawn(async move {
                    // Checkpoints queued while the last write ran go to the
                    // checkpointer as one batch (`put_many`: one transaction on SQLite).
                    let mut next = rx.recv().await;
                    while let Some(op) = next.take() {
                        match op {
                            WriteOp::Put(r) => {
                                let mut batch = vec![*r];
                                while batch.len() < ASYNC_QUEUE {
                                    match rx.try_recv() {
                                        Ok(WriteOp::Put(r)) => batch.push(*r),
                                        Ok(other) => {
                                            next = Some(other);
                                            break;
                                        }
                                        Err(_) => break,
                                    }
                                }
                                cp.put_many(batch).await?;
                            }
                            WriteOp::Writes(t, id, w) => cp.put_writes(&t, &id, w).await?,
                        }
                        if next.is_none() {
                            next = rx.recv().await;
                        }
                    }
                    Ok(())
                });
                Writer::Async {
                    tx: Some(tx),
                    handle: Some(handle),
                }
            }
        }
    }

    /// True when checkpoints are stored at all.
    pub(super) fn stores(&self) -> bool {
        !matches!(self, Writer::None)
    }

    pub(super) async fn put_writes(
        &mut self,
        thread: &ThreadKey,
        id: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> Result<(), GraphError> {
        match self {
            Writer::None | Writer::Exit(_) => Ok(()),
            Writer::Sync(cp) => Ok(cp.put_writes(thread, id, writes).await?),
            Writer::Async { .. } => {
                self.send(WriteOp::Writes(thread.clone(), id.clone(), writes))
                    .await
            }
        }
    }

    pub(super) async fn enqueue(&mut self, r: PutRequest) -> Result<(), GraphError> {
        self.send(WriteOp::Put(Box::new(r))).await
    }

    pub(super) async fn send(&mut self, op: WriteOp) -> Result<(), GraphError> {
        if let Writer::Async { tx: Some(tx), .. } = self
            && tx.send(op).await.is_ok()
        {
            return Ok(());
        }
        // The writer stopped: report its error.
        self.join().await?;
        Err(GraphError::WriterStopped)
    }

    pub(super) async fn join(&mut self) -> Result<(), GraphError> {
        if let Writer::Async { tx, handle } = self {
            tx.take();
            if let Some(h) = handle.take() {
                return h.await.map_err(|_| GraphError::WriterStopped)?;
            }
        }
        Ok(())
    }

    /// After a failed step: waits for background writes, and with `Exit` stores the
    /// steps this run finished (nothing when it finished none, so a thread refused
    /// before its first step stays as it was).
    pub(super) async fn flush_after_failure<S: State>(
        &mut self,
        run: &mut RunState<S>,
    ) -> Result<(), GraphError> {
        match self {
            Writer::Async { .. } => self.join().await,
            Writer::Exit(_) if run.steps_since_store > 0 || !run.dirty.is_empty() => {
                self.flush(run).await
            }
            _ => Ok(()),
        }
    }

    /// Stores whatever is not stored yet and waits for background writes.
    pub(super) async fn flush<S: State>(
        &mut self,
        run: &mut RunState<S>,
    ) -> Result<(), GraphError> {
        match self {
            Writer::Exit(cp) => {
                let cp = Arc::clone(cp);
                let thread = run
                    .thread
                    .clone()
                    .ok_or(GraphError::CheckpointerRequired { what: "checkpoint" })?;
                let old = run.checkpoint.id.clone();
                let ran = !run.dirty.is_empty() || run.steps_since_store > 0;
                // A run that loaded nothing and ran nothing (`Command::none()` on an
                // empty thread) stores nothing, as with the other durabilities.
                if ran || run.stored.as_ref().is_some_and(|s| *s != old) {
                    run.commit(CheckpointSource::Loop, BTreeMap::new(), Some(&cp), &thread)
                        .await?;
                }
                // Writes made during the run (interrupts) belong to the new checkpoint:
                // task ids are derived from it.
                let new = run.checkpoint.id.clone();
                if new != old && !run.pending.is_empty() {
                    let prefix = format!("{old}:");
                    let rekeyed: Vec<PendingWrite> = run
                        .pending
                        .iter()
                        .map(|w| {
                            let mut w = w.clone();
                            if let Some(path) = w.task_id.strip_prefix(&prefix) {
                                w.task_id = format!("{new}:{path}");
                            }
                            w
                        })
                        .collect();
                    cp.put_writes(&thread, &new, rekeyed.clone()).await?;
                    run.pending = rekeyed;
                }
                Ok(())
            }
            Writer::Async { .. } => self.join().await,
            Writer::None | Writer::Sync(_) => Ok(()),
        }
    }
}

/// The book of channel `c` (`books` has one per channel of `S`).
pub(super) fn book_mut<S: State>(
    books: &mut [ChannelBook],
    c: usize,
) -> Result<&mut ChannelBook, StateError> {
    match books.get_mut(c) {
        Some(book) => Ok(book),
        None => Err(channel_name::<S>(c, "State::apply")
            .err()
            .unwrap_or_else(|| StateError::unknown_index(c))),
    }
}

/// Groups encoded task updates by channel, keeping task order within each channel.
pub(super) fn group_by_channel(
    written: &[usize],
    encoded: Vec<Vec<(usize, Value)>>,
) -> BTreeMap<usize, Vec<Value>> {
    let mut out: BTreeMap<usize, Vec<Value>> = written.iter().map(|c| (*c, Vec::new())).collect();
    for task in encoded {
        for (c, v) in task {
            if let Some(list) = out.get_mut(&c) {
                list.push(v);
            }
        }
    }
    out
}

/// About the length of a value's compact JSON, from its structure alone: strings count
/// their bytes without escapes and numbers their digits. The snapshot policy weighs
/// deltas against snapshots with it, so only its proportions matter; walking the value
/// costs a fraction of serializing it, which every update of every step would pay.
pub(super) fn json_size(v: &Value) -> usize {
    // An explicit stack: a value built in code may nest deeper than the call stack allows.
    let mut stack = vec![v];
    let mut size = 0usize;
    while let Some(v) = stack.pop() {
        size = size.saturating_add(match v {
            Value::Null => 4,
            Value::Bool(b) => 4 + usize::from(!*b),
            Value::Number(n) => number_size(n),
            Value::String(s) => s.len() + 2,
            Value::Array(a) => {
                stack.extend(a.iter());
                2 + a.len().saturating_sub(1)
            }
            Value::Object(o) => {
                stack.extend(o.values());
                // Braces, and per entry the quoted key, a colon and a comma.
                2 + o.len().saturating_sub(1) + o.keys().map(|k| k.len() + 3).sum::<usize>()
            }
        });
    }
    size
}

/// The digits (and sign) of an integer; a float as its shortest form is at most 24.
fn number_size(n: &serde_json::Number) -> usize {
    fn digits(mut x: u64) -> usize {
        let mut d = 1;
        while x >= 10 {
            x /= 10;
            d += 1;
        }
        d
    }
    if let Some(u) = n.as_u64() {
        digits(u)
    } else if let Some(i) = n.as_i64() {
        1 + digits(i.unsigned_abs())
    } else {
        24
    }
}

#[cfg(test)]
mod tests {
    use super::json_size;
    use serde_json::{Value, json};

    #[test]
    fn json_size_is_the_compact_length_when_nothing_needs_escaping() {
        let values = [
            json!(null),
            json!(true),
            json!(false),
            json!(0),
            json!(-7),
            json!(u64::MAX),
            json!(i64::MIN),
            json!("plain text"),
            json!([]),
            json!({}),
            json!([1, "two", [3, {"four": 4}], null]),
            json!({"role": "tool", "content": "ok", "n": [10, 200, 3000], "m": {"x": false}}),
        ];
        for v in values {
            assert_eq!(
                json_size(&v),
                serde_json::to_string(&v).unwrap().len(),
                "{v}"
            );
        }
    }

    #[test]
    fn json_size_walks_nesting_deeper_than_the_call_stack() {
        let mut v = Value::Null;
        for _ in 0..200_000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(json_size(&v), 200_000 * 2 + 4);
        // Dropping a value this deep recurses: leak it rather than overflow the stack.
        std::mem::forget(v);
    }
}
