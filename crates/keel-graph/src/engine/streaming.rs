//! [`CompiledGraph::stream`]: a run that sends its events to a channel; dropping the
//! stream cancels the run.

use super::*;

impl<S: State> CompiledGraph<S> {
    /// Runs the graph like [`CompiledGraph::invoke`], yielding events as it goes.
    /// Dropping the stream cancels the run (tasks in flight are dropped).
    pub fn stream(
        &self,
        input: impl Into<Command<S>>,
        config: RunConfig,
        mode: StreamMode,
    ) -> impl Stream<Item = Result<Event<S>, GraphError>> + Send + 'static {
        let (tx, rx) = mpsc::channel(16);
        let graph = self.clone();
        let input = input.into();
        let handle = tokio::spawn(async move {
            let sink = EventSink {
                tx: tx.clone(),
                mode,
            };
            match graph.run(input, &config, Some(sink)).await {
                Ok(run) => {
                    let _ = tx
                        .send(Ok(Event::Done {
                            next: run.next,
                            interrupts: run.interrupts,
                        }))
                        .await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                }
            }
        });
        let guard = AbortOnDrop(handle);
        futures::stream::unfold((rx, guard), |(mut rx, guard)| async move {
            rx.recv().await.map(|item| (item, (rx, guard)))
        })
    }
}

pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub(crate) struct EventSink<S: State> {
    pub(super) tx: mpsc::Sender<Result<Event<S>, GraphError>>,
    pub(super) mode: StreamMode,
}

impl<S: State> EventSink<S> {
    pub(super) async fn send(&self, e: Event<S>) -> Result<(), GraphError> {
        // A dropped receiver cancels the run.
        self.tx.send(Ok(e)).await.map_err(|_| GraphError::Cancelled)
    }
}
