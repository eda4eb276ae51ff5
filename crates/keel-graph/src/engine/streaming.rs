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
                            stopped: run.stopped,
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

    /// Where a task's [`NodeContext::emit`] sends, when the stream asked for custom
    /// events.
    pub(super) fn emitter(&self, node: Arc<str>, step: i64) -> Option<Emitter> {
        self.mode.custom.then(|| {
            Emitter(Arc::new(Custom {
                tx: self.tx.clone(),
                node,
                step,
            }))
        })
    }
}

/// One task's way into its run's stream, without the state's type.
#[derive(Clone)]
pub(crate) struct Emitter(Arc<dyn EmitCustom>);

impl Emitter {
    pub(crate) async fn emit(&self, value: Value) {
        self.0.emit(value).await;
    }
}

impl std::fmt::Debug for Emitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Emitter")
    }
}

trait EmitCustom: Send + Sync {
    fn emit(&self, value: Value) -> futures::future::BoxFuture<'_, ()>;
}

struct Custom<S: State> {
    tx: mpsc::Sender<Result<Event<S>, GraphError>>,
    node: Arc<str>,
    step: i64,
}

impl<S: State> EmitCustom for Custom<S> {
    fn emit(&self, value: Value) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            // A dropped receiver cancels the run at the engine's next event; the node
            // need not hear of it.
            let _ = self
                .tx
                .send(Ok(Event::Custom {
                    step: self.step,
                    node: self.node.to_string(),
                    value,
                }))
                .await;
        })
    }
}
