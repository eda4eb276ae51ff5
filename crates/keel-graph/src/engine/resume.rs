//! Loading a thread: the state rebuilt from stored channel chains (consumed, not
//! copied), the scheduled tasks, and the writes a crashed or interrupted step left.

use super::*;

impl<S: State> RunState<S> {
    pub(super) async fn load(
        graph: &CompiledGraph<S>,
        config: &RunConfig,
        events: Option<EventSink<S>>,
    ) -> Result<Self, GraphError> {
        let g = Arc::clone(&graph.inner);
        let thread = match (&g.checkpointer, config.thread_key()?) {
            (Some(_), Some(t)) => Some(t),
            _ => None,
        };
        let mut run = RunState {
            state: Arc::new(S::empty()),
            checkpoint: Checkpoint::new(None),
            step: -2,
            thread: thread.clone(),
            head: None,
            stored: None,
            tasks: Vec::new(),
            pending: Vec::new(),
            books: vec![ChannelBook::default(); S::CHANNELS.len()],
            dirty: BTreeSet::new(),
            steps_since_store: 0,
            writers: BTreeSet::new(),
            joins_seen: vec![BTreeSet::new(); g.joins.len()],
            metadata: config.metadata.clone(),
            invocation: Arc::new(InvocationInfo::of(config)),
            events,
            graph: g,
        };
        let (Some(cp), Some(thread)) = (run.graph.checkpointer.clone(), thread) else {
            return Ok(run);
        };
        let latest = cp.get(&thread, None).await?;
        run.head = latest.as_ref().map(|t| t.checkpoint.id.clone());
        let tuple = match &config.checkpoint_id {
            None => latest,
            Some(id) => Some(cp.get(&thread, Some(id)).await?.ok_or_else(|| {
                GraphError::CheckpointNotFound {
                    thread_id: thread.thread_id.clone(),
                    id: id.clone(),
                }
            })?),
        };
        let Some(tuple) = tuple else {
            return Ok(run);
        };
        let CheckpointTuple {
            checkpoint,
            metadata,
            channels,
            pending_writes,
            ..
        } = tuple;
        let (state, books) = rebuild::<S>(channels, &checkpoint)?;
        run.state = Arc::new(state);
        run.books = books;
        run.tasks = decode_tasks(&checkpoint)?;
        for (i, seen) in run.joins_seen.iter_mut().enumerate() {
            if let Some(m) = checkpoint.versions_seen.get(&format!("{JOIN_PREFIX}{i}")) {
                *seen = m
                    .keys()
                    .filter_map(|n| run.graph.index.get(n).copied())
                    .collect();
            }
        }
        run.step = metadata.step;
        run.pending = pending_writes;
        run.stored = Some(checkpoint.id.clone());
        run.checkpoint = checkpoint;
        Ok(run)
    }
}

impl<S: State> RunState<S> {
    /// Checks that this graph can replay the writes stored against the checkpoint
    /// (see [`Self::stored_outcome`]): each is to a channel of the state or a special
    /// channel, and each stored route names a node of the graph (or `END`).
    pub(super) fn check_stored_writes(&self) -> Result<(), GraphError> {
        for w in &self.pending {
            if w.channel == GOTO {
                let specs: Vec<TaskSpec> =
                    serde_json::from_value(w.value.clone()).map_err(|e| {
                        GraphError::CorruptTasks {
                            id: self.checkpoint.id.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                if let Some(s) = specs
                    .iter()
                    .find(|s| s.node != END && !self.graph.index.contains_key(&s.node))
                {
                    return Err(GraphError::UnknownNode {
                        node: s.node.clone(),
                        checkpoint: self.checkpoint.id.clone(),
                    });
                }
            } else if !w.channel.starts_with("__") && channel_index::<S>(&w.channel).is_none() {
                return Err(StateError::UnknownChannel {
                    channel: w.channel.clone(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// A task's outcome rebuilt from writes stored by an earlier attempt at this step.
    pub(super) fn stored_outcome(&self, t: &Task) -> Result<Option<Outcome<S>>, GraphError> {
        let mine: Vec<&PendingWrite> = self.pending.iter().filter(|w| w.task_id == t.id).collect();
        let done = mine
            .iter()
            .any(|w| !w.channel.starts_with("__") || w.channel == GOTO);
        if !done {
            return Ok(None);
        }
        let mut values = Vec::new();
        let mut goto = Vec::new();
        for w in mine {
            if w.channel == GOTO {
                let specs: Vec<TaskSpec> =
                    serde_json::from_value(w.value.clone()).map_err(|e| {
                        GraphError::CorruptTasks {
                            id: self.checkpoint.id.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                goto.extend(specs.into_iter().map(|s| match s.payload {
                    None => Goto::Node(s.node),
                    Some(p) => Goto::Send(crate::SendTo {
                        node: s.node,
                        payload: p,
                    }),
                }));
            } else if let Some(c) = channel_index::<S>(&w.channel) {
                values.push((c, w.value.clone()));
            } else if !w.channel.starts_with("__") {
                return Err(StateError::UnknownChannel {
                    channel: w.channel.clone(),
                }
                .into());
            }
        }
        let update = if values.is_empty() {
            None
        } else {
            Some(S::decode_update(&values)?)
        };
        Ok(Some(Outcome::Done(Command {
            update,
            goto,
            ..Command::default()
        })))
    }
}

/// The id and node name of each scheduled task, whether or not this graph has the
/// node (for showing a stored checkpoint).
pub(super) fn task_names(specs: &[TaskSpec], checkpoint: &CheckpointId) -> Vec<(String, String)> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("{checkpoint}:{}", task_path(i, s)), s.node.clone()))
        .collect()
}

/// The interrupts not answered yet, in the order of `tasks` (task path order, as
/// `Run::interrupts`); `tasks` gives each task id's node name.
pub(super) fn pending_interrupts(
    pending: &[PendingWrite],
    tasks: &[(String, String)],
) -> Vec<Interrupt> {
    // A task's interrupts and answers are stored in order, one write each (a node may
    // interrupt several times): the task waits when it raised more than were answered.
    let mut seen: Vec<&str> = Vec::new();
    let mut out = Vec::new();
    for w in pending.iter().filter(|w| w.channel == INTERRUPT) {
        if seen.contains(&w.task_id.as_str()) {
            continue;
        }
        seen.push(&w.task_id);
        let raised = task_values(pending, &w.task_id, INTERRUPT);
        let answered = task_values(pending, &w.task_id, RESUME).len();
        if let Some(value) = raised.get(answered..).and_then(<[&Value]>::last) {
            out.push(Interrupt {
                node: tasks
                    .iter()
                    .find(|(id, _)| *id == w.task_id)
                    .map(|(_, node)| node.clone())
                    .unwrap_or_default(),
                task_id: w.task_id.clone(),
                value: (*value).clone(),
            });
        }
    }
    // In the order of the step's tasks (task path), as `Run::interrupts` lists them: the
    // stored writes are in the order the tasks finished, which is anyone's guess.
    out.sort_by_key(|i| {
        tasks
            .iter()
            .position(|(id, _)| *id == i.task_id)
            .unwrap_or(usize::MAX)
    });
    out
}

/// The tasks whose last stored outcome is an error, in the order of `tasks` (task id,
/// node), each with its last error: a task that failed and then ran again and wrote is
/// not listed.
pub(super) fn task_errors(pending: &[PendingWrite], tasks: &[(String, String)]) -> Vec<TaskError> {
    tasks
        .iter()
        .filter_map(|(id, node)| {
            let mine: Vec<&PendingWrite> = pending.iter().filter(|w| w.task_id == *id).collect();
            let last = mine.iter().rposition(|w| w.channel == ERROR)?;
            let after = mine.get(last..)?;
            // Stored writes are in order: a write after the error is a later success.
            if after.iter().skip(1).any(|w| w.channel != ERROR) {
                return None;
            }
            let value = &after.first()?.value;
            Some(TaskError {
                node: node.clone(),
                task_id: id.clone(),
                message: value
                    .as_str()
                    .map_or_else(|| value.to_string(), str::to_owned),
            })
        })
        .collect()
}

/// The values a task wrote to a special channel (its interrupts, or the answers it was
/// given), in order.
pub(super) fn task_values<'a>(
    pending: &'a [PendingWrite],
    task_id: &str,
    channel: &str,
) -> Vec<&'a Value> {
    pending
        .iter()
        .filter(|w| w.task_id == task_id && w.channel == channel)
        .map(|w| &w.value)
        .collect()
}

pub(super) fn decode_tasks(checkpoint: &Checkpoint) -> Result<Vec<TaskSpec>, GraphError> {
    checkpoint
        .pending_sends
        .iter()
        .map(|v| {
            serde_json::from_value(v.clone()).map_err(|e| GraphError::CorruptTasks {
                id: checkpoint.id.clone(),
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Rebuilds the state from a checkpoint's channel chains, which it consumes: each
/// stored snapshot and delta is moved into the state, not copied.
pub(super) fn rebuild<S: State>(
    channels: BTreeMap<String, ChannelChain>,
    checkpoint: &Checkpoint,
) -> Result<(S, Vec<ChannelBook>), GraphError> {
    let mut state = S::empty();
    let mut books = vec![ChannelBook::default(); S::CHANNELS.len()];
    for (name, chain) in channels {
        let c = channel_index::<S>(&name).ok_or_else(|| StateError::UnknownChannel {
            channel: name.clone(),
        })?;
        let book = book_mut::<S>(&mut books, c)?;
        if let Some(s) = chain.snapshot {
            book.snapshot_bytes = json_size(&s);
            state.restore_channel(c, s)?;
        }
        for d in chain.deltas {
            book.delta_bytes += d.iter().map(json_size).sum::<usize>();
            state.fold_channel(c, d)?;
        }
        book.version = checkpoint.channel_versions.get(&name).cloned();
    }
    Ok((state, books))
}
