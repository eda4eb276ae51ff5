//! Resuming a thread with a graph of another shape than the one that wrote it: a
//! scheduled node the graph lacks is `GraphError::UnknownNode`, a stored channel the
//! state lacks is `StateError::UnknownChannel`, both naming it, and the thread is left
//! as it was.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_checkpoint::Checkpointer;
use keel_checkpoint_sqlite::SqliteSaver;
use keel_graph::reducer::Append;
use keel_graph::{
    Command, CompiledGraph, END, GraphError, NodeContext, RunConfig, START, State, StateError,
    StateGraph,
};
use serde_json::json;

#[derive(Clone, Debug, State)]
struct S {
    #[reducer(Append<String>)]
    log: Vec<String>,
}

fn log(entry: &str) -> SUpdate {
    SUpdate::default().log(vec![entry.to_owned()])
}

async fn sqlite(dir: &tempfile::TempDir) -> Arc<dyn Checkpointer> {
    Arc::new(
        SqliteSaver::open(dir.path().join("threads.db"))
            .await
            .unwrap(),
    )
}

/// `draft`, then `approve` (asks a human), then `ship`.
fn with_approval(cp: Arc<dyn Checkpointer>) -> CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("draft", |_s, _c| async { Ok(log("draft")) })
        .add_node("approve", |_s, ctx: NodeContext| async move {
            let answer = ctx.interrupt(json!("ship it?"))?;
            Ok(log(&format!("answer={}", answer.as_str().unwrap_or("?"))))
        })
        .add_node("ship", |_s, _c| async { Ok(log("ship")) })
        .add_edge(START, "draft")
        .add_edge("draft", "approve")
        .add_edge("approve", "ship")
        .add_edge("ship", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

/// The next version of the graph: `approve` is gone.
fn without_approval(cp: Arc<dyn Checkpointer>) -> CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("draft", |_s, _c| async { Ok(log("draft")) })
        .add_node("ship", |_s, _c| async { Ok(log("ship")) })
        .add_edge(START, "draft")
        .add_edge("draft", "ship")
        .add_edge("ship", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test]
async fn resuming_with_a_graph_that_lacks_the_interrupted_node_is_unknown_node() {
    let dir = tempfile::tempdir().unwrap();
    let cp = sqlite(&dir).await;
    let (old, new) = (
        with_approval(Arc::clone(&cp)),
        without_approval(Arc::clone(&cp)),
    );
    let config = RunConfig::thread("shape");
    let paused = old.invoke(log("in"), &config).await.unwrap();
    assert_eq!(paused.next, ["approve"]);
    let at = paused.checkpoint_id.clone().unwrap();

    // Answering the interrupt, or continuing, with the new graph: refused, naming the
    // node and the checkpoint.
    for input in [Command::resume("yes"), Command::none()] {
        match new.invoke(input, &config).await {
            Err(GraphError::UnknownNode { node, checkpoint }) => {
                assert_eq!(node, "approve");
                assert_eq!(checkpoint, at);
            }
            other => panic!("expected UnknownNode, got {other:?}"),
        }
    }
    let err = new.invoke(Command::none(), &config).await.unwrap_err();
    assert!(err.to_string().contains("`approve`"), "{err}");

    // Looking is fine: the new graph shows what the thread waits for.
    let snap = new.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.checkpoint_id, at);
    assert_eq!(snap.next, ["approve"]);
    assert_eq!(snap.interrupts.len(), 1);
    assert_eq!(snap.interrupts[0].node, "approve");
    assert_eq!(snap.values.log, ["in", "draft"]);

    // Nothing was written: the old graph still resumes the thread as if nothing
    // happened.
    let done = old.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(done.state.log, ["in", "draft", "answer=yes", "ship"]);

    // A way out with the new graph: an update as one of its nodes schedules that
    // node's successors in place of the stale task.
    let other = RunConfig::thread("shape-2");
    old.invoke(log("in"), &other).await.unwrap();
    new.update_state(&other, log("approved by hand"), Some("draft"))
        .await
        .unwrap();
    let done = new.invoke(Command::none(), &other).await.unwrap();
    assert_eq!(done.state.log, ["in", "draft", "approved by hand", "ship"]);
    assert!(!done.is_paused());
}

#[tokio::test]
async fn a_new_input_with_a_graph_that_lacks_the_interrupted_node_starts_over() {
    // A new input starts a new run on the thread: the stale task is dropped, as with
    // any new input on a paused thread.
    let dir = tempfile::tempdir().unwrap();
    let cp = sqlite(&dir).await;
    let config = RunConfig::thread("shape");
    with_approval(Arc::clone(&cp))
        .invoke(log("in"), &config)
        .await
        .unwrap();
    let run = without_approval(Arc::clone(&cp))
        .invoke(log("again"), &config)
        .await
        .unwrap();
    assert_eq!(run.state.log, ["in", "draft", "again", "draft", "ship"]);
}

/// Version 1 of a state: a log and notes.
#[derive(Clone, Debug, State)]
struct WithNotes {
    #[reducer(Append<String>)]
    log: Vec<String>,
    #[reducer(Append<String>)]
    notes: Vec<String>,
}

/// Version 2: the notes channel is gone.
#[derive(Clone, Debug, State)]
struct WithoutNotes {
    #[reducer(Append<String>)]
    log: Vec<String>,
}

/// Version 2': a channel added instead.
#[derive(Clone, Debug, State)]
struct WithMore {
    #[reducer(Append<String>)]
    log: Vec<String>,
    #[reducer(Append<String>)]
    notes: Vec<String>,
    #[reducer(Append<String>)]
    tags: Vec<String>,
}

/// `note` (writes `note_update`), then `approve` (asks, then logs the answer).
macro_rules! note_then_approve {
    ($state:ty, $update:ident, $cp:expr, $note_update:expr) => {
        StateGraph::<$state>::new()
            .add_node("note", |_s, _c| async { Ok($note_update) })
            .add_node("approve", |_s, ctx: NodeContext| async move {
                let answer = ctx.interrupt(json!("ok?"))?;
                Ok($update::default().log(vec![format!("answer={}", answer)]))
            })
            .add_edge(START, "note")
            .add_edge("note", "approve")
            .add_edge("approve", END)
            .with_checkpointer($cp)
            .compile()
            .unwrap()
    };
}

#[tokio::test]
async fn resuming_with_a_state_that_lacks_a_stored_channel_is_unknown_channel() {
    let dir = tempfile::tempdir().unwrap();
    let cp = sqlite(&dir).await;
    let v1 = note_then_approve!(
        WithNotes,
        WithNotesUpdate,
        Arc::clone(&cp),
        WithNotesUpdate::default().notes(vec!["remember".into()])
    );
    let config = RunConfig::thread("channels");
    let paused = v1
        .invoke(WithNotesUpdate::default().log(vec!["in".into()]), &config)
        .await
        .unwrap();
    assert_eq!(paused.next, ["approve"]);

    let v2 = note_then_approve!(
        WithoutNotes,
        WithoutNotesUpdate,
        Arc::clone(&cp),
        WithoutNotesUpdate::default()
    );
    let unknown_notes = |r: Result<_, GraphError>| match r {
        Err(GraphError::State(StateError::UnknownChannel { channel })) => channel == "notes",
        _ => false,
    };
    assert!(unknown_notes(
        v2.invoke(Command::resume("yes"), &config).await.map(|_| ())
    ));
    assert!(unknown_notes(
        v2.invoke(Command::none(), &config).await.map(|_| ())
    ));
    assert!(unknown_notes(
        v2.invoke(WithoutNotesUpdate::default(), &config)
            .await
            .map(|_| ())
    ));
    assert!(unknown_notes(v2.get_state(&config).await.map(|_| ())));
    let err = v2.get_state(&config).await.unwrap_err();
    assert!(err.to_string().contains("`notes`"), "{err}");

    // A state with a channel more is compatible: the new channel starts empty.
    let v3 = note_then_approve!(
        WithMore,
        WithMoreUpdate,
        Arc::clone(&cp),
        WithMoreUpdate::default()
    );
    let done = v3.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(done.state.log, ["in", "answer=\"yes\""]);
    assert_eq!(done.state.notes, ["remember"]);
    assert!(done.state.tags.is_empty());
}

#[tokio::test]
async fn a_stored_write_to_a_channel_the_state_lacks_is_unknown_channel() {
    // One step runs `note` and `approve` in parallel: `note` finishes and its write to
    // `notes` is stored with the step, `approve` interrupts. Resuming with a state
    // without `notes` meets that stored write.
    let dir = tempfile::tempdir().unwrap();
    let cp = sqlite(&dir).await;
    let v1 = StateGraph::<WithNotes>::new()
        .add_node("note", |_s, _c| async {
            Ok(WithNotesUpdate::default().notes(vec!["remember".into()]))
        })
        .add_node("approve", |_s, ctx: NodeContext| async move {
            ctx.interrupt(json!("ok?"))?;
            Ok(WithNotesUpdate::default())
        })
        .add_edge(START, "note")
        .add_edge(START, "approve")
        .add_edge("note", END)
        .add_edge("approve", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let config = RunConfig::thread("writes");
    let paused = v1
        .invoke(WithNotesUpdate::default().log(vec!["in".into()]), &config)
        .await
        .unwrap();
    assert_eq!(paused.interrupts.len(), 1);

    let v2 = StateGraph::<WithoutNotes>::new()
        .add_node("note", |_s, _c| async { Ok(WithoutNotesUpdate::default()) })
        .add_node("approve", |_s, ctx: NodeContext| async move {
            ctx.interrupt(json!("ok?"))?;
            Ok(WithoutNotesUpdate::default())
        })
        .add_edge(START, "note")
        .add_edge(START, "approve")
        .add_edge("note", END)
        .add_edge("approve", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    match v2.invoke(Command::resume("yes"), &config).await {
        Err(GraphError::State(StateError::UnknownChannel { channel })) => {
            assert_eq!(channel, "notes");
        }
        other => panic!("expected UnknownChannel, got {other:?}"),
    }
    // v1 still finishes the thread, without running `note` again.
    let done = v1.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(done.state.notes, ["remember"]);
    assert_eq!(done.state.log, ["in"]);
}

/// `route` (goes to `review` by itself) and `approve` (asks) in one step.
fn route_and_approve(cp: Arc<dyn Checkpointer>, with_review: bool) -> CompiledGraph<S> {
    let g = StateGraph::<S>::new()
        .add_node_with(
            "route",
            keel_graph::NodeOptions::default().destinations(if with_review {
                vec!["review"]
            } else {
                Vec::new()
            }),
            move |_s, _c| async move {
                let c = Command::update(log("route"));
                Ok(if with_review { c.goto("review") } else { c })
            },
        )
        .add_node("approve", |_s, ctx: NodeContext| async move {
            ctx.interrupt(json!("ok?"))?;
            Ok(log("approved"))
        })
        .add_edge(START, "route")
        .add_edge(START, "approve")
        .add_edge("approve", END);
    let g = if with_review {
        g.add_node("review", |_s, _c| async { Ok(log("review")) })
            .add_edge("review", END)
    } else {
        g.add_edge("route", END)
    };
    g.with_checkpointer(cp).compile().unwrap()
}

#[tokio::test]
async fn a_stored_route_to_a_node_the_graph_lacks_is_unknown_node() {
    let dir = tempfile::tempdir().unwrap();
    let cp = sqlite(&dir).await;
    let v1 = route_and_approve(Arc::clone(&cp), true);
    let config = RunConfig::thread("routes");
    let paused = v1.invoke(log("in"), &config).await.unwrap();
    assert_eq!(paused.interrupts.len(), 1);

    // `route` finished in the paused step and its `goto("review")` is stored with it.
    let v2 = route_and_approve(Arc::clone(&cp), false);
    for input in [Command::resume("yes"), Command::none()] {
        match v2.invoke(input, &config).await {
            Err(GraphError::UnknownNode { node, checkpoint }) => {
                assert_eq!(node, "review");
                assert_eq!(Some(checkpoint), paused.checkpoint_id);
            }
            other => panic!("expected UnknownNode, got {other:?}"),
        }
    }
    // Refused before anything was written: v1 resumes the thread as it was.
    let done = v1.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(done.state.log, ["in", "approved", "route", "review"]);
}
