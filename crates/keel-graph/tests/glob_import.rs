//! `use keel_graph::*` brings in no name that shadows a prelude item: the fan-out
//! packet is `SendTo`, so `Send` below is still the marker trait (with a struct named
//! `Send` exported, this file does not compile).
#![allow(clippy::unwrap_used)]

use keel_graph::*;

fn assert_send<T: Send + Sync + 'static>(_: &T) {}

#[derive(Clone, State)]
struct Fan {
    #[reducer(reducer::Append<i64>)]
    done: Vec<i64>,
}

#[tokio::test]
async fn a_glob_import_keeps_the_send_marker_trait() {
    let graph = StateGraph::<Fan>::new()
        .add_node("work", |_s, ctx: NodeContext| async move {
            let n = ctx.payload().and_then(|p| p.as_i64()).unwrap_or_default();
            Ok(FanUpdate::default().done(vec![n]))
        })
        .add_conditional_edges(
            START,
            |_s: &Fan| (1..=3).map(|i| SendTo::new("work", i)).collect::<Vec<_>>(),
            Some(&["work"]),
        )
        .add_edge("work", END)
        .compile()
        .unwrap();
    assert_send(&graph);
    let run = graph
        .invoke(FanUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.done, [1, 2, 3]);
}
