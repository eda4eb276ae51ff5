//! [`CompiledGraph::stream`]: a run that sends its events to a channel; dropping the
//! stream cancels the run.

use super::*;

impl<S: State> CompiledGraph<S> {
    /// Runs the graph like [`CompiledGraph::invoke`], yielding events as it goes.
    /// Dropping the stream cancels the run (tasks in flight are dropped). The stream is
    /// `Unpin`, so `StreamExt::next` works on it directly; outside a Tokio runtime it
    /// yields [`GraphError::NoRuntime`].
    pub fn stream(
        &self,
        input: impl Into<Command<S>>,
        config: RunConfig,
        mode: StreamMode,
    ) -> impl Stream<Item = Result<Event<S>, GraphError>> + Send + Unpin + 'static {
        let (tx, rx) = mpsc::channel(16);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // The receiver sees this one error and then the end.
            let _ = tx.try_send(Err(GraphError::NoRuntime));
            return EventStream { rx, _run: None };
        };
        let graph = self.clone();
        let input = input.into();
        let handle = runtime.spawn(async move {
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
        EventStream {
            rx,
            _run: Some(AbortOnDrop(handle)),
        }
    }
}

/// The events of a run driven by its own task, which is aborted when this is dropped.
struct EventStream<S: State> {
    rx: mpsc::Receiver<Result<Event<S>, GraphError>>,
    _run: Option<AbortOnDrop>,
}

impl<S: State> Stream for EventStream<S> {
    type Item = Result<Event<S>, GraphError>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.get_mut().rx.poll_recv(cx)
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
