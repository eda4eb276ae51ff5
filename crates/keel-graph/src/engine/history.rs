//! [`CompiledGraph::state_history`]: a thread's checkpoints as a stream of states, a
//! page of summaries at a time.

use super::*;

impl<S: State> CompiledGraph<S> {
    /// A thread's checkpoints, newest first (id order, every branch included), each
    /// with its state, filtered like [`Checkpointer::list`]: `options.before` (only
    /// checkpoints older than that id: the next page after the last one seen),
    /// `options.limit` and `options.metadata` (every key equal; `writes` contained,
    /// see [`ListOptions::written_by`]). `config.checkpoint_id` is not used.
    ///
    /// A stream: each state is rebuilt when the stream reaches its checkpoint, from that
    /// checkpoint's stored channels, and summaries are read a page at a time, so memory
    /// holds one state (and the page), however long the history. A checkpoint pruned
    /// while the stream runs is left out. Without a checkpointer or a thread id the
    /// stream's one item is [`GraphError::CheckpointerRequired`]. To find one
    /// checkpoint by the node that wrote it, use
    /// [`last_checkpoint_by`](Self::last_checkpoint_by).
    ///
    /// Each state rebuilt costs its channels' decoding, so listing a long history this
    /// way takes time in proportion to it. To list checkpoints without their states
    /// (ids, parents, steps, the nodes that wrote them), read the checkpointer's
    /// [`Checkpointer::list`] with the same options: it decodes no channel.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use futures::TryStreamExt;
    /// use keel_checkpoint::{ListOptions, MemorySaver};
    /// use keel_graph::reducer::Append;
    /// use keel_graph::{END, RunConfig, START, State, StateGraph};
    ///
    /// #[derive(Clone, State)]
    /// struct Log {
    ///     #[reducer(Append<String>)]
    ///     lines: Vec<String>,
    /// }
    /// let line = |s: &str| LogUpdate::default().lines(vec![s.to_owned()]);
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
    /// let graph = StateGraph::<Log>::new()
    ///     .add_node("draft", move |_s, _c| async move { Ok(line("draft")) })
    ///     .add_edge(START, "draft")
    ///     .add_edge("draft", END)
    ///     .with_checkpointer(Arc::new(MemorySaver::new()))
    ///     .compile()?;
    /// let config = RunConfig::thread("doc-1");
    /// graph.invoke(line("brief"), &config).await?;
    ///
    /// // Newest first: after `draft`, then the input.
    /// let all: Vec<_> = graph.state_history(&config, ListOptions::default()).try_collect().await?;
    /// assert_eq!(all.len(), 2);
    /// assert_eq!(all[0].values.lines, ["brief", "draft"]);
    /// // The page after the newest one, and a metadata filter.
    /// let older = ListOptions::default().before(all[0].checkpoint_id.clone()).limit(10);
    /// let page: Vec<_> = graph.state_history(&config, older).try_collect().await?;
    /// assert_eq!(page[0].values.lines, ["brief"]);
    /// let by_draft = ListOptions::default().written_by("draft");
    /// assert_eq!(graph.state_history(&config, by_draft).try_collect::<Vec<_>>().await?.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn state_history(
        &self,
        config: &RunConfig,
        options: ListOptions,
    ) -> BoxStream<'static, Result<StateSnapshot<S>, GraphError>> {
        let (cp, thread) = match self.require_checkpointer(config, "state_history") {
            Ok(found) => found,
            Err(e) => return futures::stream::once(async move { Err(e) }).boxed(),
        };
        let cursor = HistoryCursor {
            graph: self.clone(),
            cp,
            thread,
            before: options.before,
            remaining: options.limit.unwrap_or(usize::MAX),
            metadata: options.metadata,
            page: VecDeque::new(),
            listed_all: false,
        };
        futures::stream::try_unfold(cursor, |mut cursor| async move {
            let item = cursor.next().await?;
            Ok(item.map(|snapshot| (snapshot, cursor)))
        })
        .boxed()
    }
}

/// Summaries read per `list` call by [`CompiledGraph::state_history`].
pub(super) const HISTORY_PAGE: usize = 32;

/// Where a [`CompiledGraph::state_history`] stream is: the next checkpoints to show,
/// and the id to list the page after them from.
pub(super) struct HistoryCursor<S: State> {
    pub(super) graph: CompiledGraph<S>,
    pub(super) cp: Arc<dyn Checkpointer>,
    pub(super) thread: ThreadKey,
    /// List checkpoints older than this (the last one listed).
    pub(super) before: Option<CheckpointId>,
    /// How many more the caller wants.
    pub(super) remaining: usize,
    pub(super) metadata: serde_json::Map<String, Value>,
    pub(super) page: VecDeque<CheckpointSummary>,
    /// The last `list` returned less than a page: nothing older matches.
    pub(super) listed_all: bool,
}

impl<S: State> HistoryCursor<S> {
    /// The next checkpoint's snapshot, or `None` at the end.
    pub(super) async fn next(&mut self) -> Result<Option<StateSnapshot<S>>, GraphError> {
        while self.remaining > 0 {
            let Some(summary) = self.page.pop_front() else {
                if self.listed_all {
                    return Ok(None);
                }
                self.list_page().await?;
                continue;
            };
            // Absent only if pruned since it was listed: then it is no longer history.
            if let Some(tuple) = self
                .cp
                .get(&self.thread, Some(&summary.checkpoint.id))
                .await?
            {
                self.remaining -= 1;
                return self.graph.snapshot_of(tuple).map(Some);
            }
        }
        Ok(None)
    }

    pub(super) async fn list_page(&mut self) -> Result<(), GraphError> {
        let want = self.remaining.min(HISTORY_PAGE);
        let mut options = ListOptions::default().limit(want);
        options.before = self.before.clone();
        options.metadata = self.metadata.clone();
        let page: VecDeque<CheckpointSummary> =
            self.cp.list(&self.thread, options).try_collect().await?;
        self.listed_all = page.len() < want;
        if let Some(last) = page.back() {
            self.before = Some(last.checkpoint.id.clone());
        }
        self.page = page;
        Ok(())
    }
}
