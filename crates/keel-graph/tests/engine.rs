//! Behaviour of the superstep engine, without and with a checkpointer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use keel_checkpoint::{CheckpointSource, Checkpointer, ListOptions, MemorySaver};
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Append, Messages};
use keel_graph::{
    BuildError, Command, Durability, END, Event, GraphError, NodeError, NodeOptions, RetryPolicy,
    RunConfig, START, SendTo, State, StateError, StateGraph, StreamMode,
};
use keel_message::Message;
use serde_json::json;

#[derive(Clone, Debug, State)]
struct S {
    #[reducer(Append<String>)]
    log: Vec<String>,
    #[reducer(AddMessages)]
    messages: Messages,
    count: i64,
}

fn log(entry: &str) -> SUpdate {
    SUpdate::default().log(vec![entry.to_owned()])
}

/// The whole history of the thread, newest first.
async fn full_history(
    g: &keel_graph::CompiledGraph<S>,
    config: &RunConfig,
) -> Vec<keel_graph::StateSnapshot<S>> {
    g.state_history(config, ListOptions::default())
        .try_collect()
        .await
        .unwrap()
}

fn saver() -> Arc<dyn Checkpointer> {
    Arc::new(MemorySaver::new())
}

/// START → `a` (a logger) → END, with an in-memory checkpointer.
fn one_logger_saved() -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_edge(START, "a")
        .add_edge("a", END)
        .with_checkpointer(saver())
        .compile()
        .unwrap()
}

/// A node that appends its name to the log.
fn logger(
    name: &'static str,
) -> impl Fn(Arc<S>, keel_graph::NodeContext) -> futures::future::Ready<Result<SUpdate, NodeError>>
+ Send
+ Sync
+ 'static {
    move |_s, _c| futures::future::ready(Ok(log(name)))
}

#[tokio::test]
async fn linear_graph_runs_in_order() {
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_edge(START, "a")
        .add_edge("a", "b")
        .add_edge("b", END)
        .compile()
        .unwrap();
    let run = g.invoke(log("in"), &RunConfig::default()).await.unwrap();
    assert_eq!(run.state.log, ["in", "a", "b"]);
    assert_eq!(run.steps, 2);
    assert!(!run.is_paused());
}

#[tokio::test]
async fn parallel_writes_apply_in_task_path_order_whoever_finishes_first() {
    // `b` finishes long before `a`; both append in the same superstep.
    let g = StateGraph::<S>::new()
        .add_node("a", |_s, _c| async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            Ok(log("a"))
        })
        .add_node("b", logger("b"))
        .add_node("c", logger("c"))
        .add_edge(START, "b")
        .add_edge(START, "a")
        .add_join(&["a", "b"], "c")
        .add_edge("c", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["a", "b", "c"]);
    assert_eq!(run.steps, 2);
}

#[tokio::test]
async fn join_waits_for_sources_finishing_in_different_steps() {
    let g = StateGraph::<S>::new()
        .add_node("fast", logger("fast"))
        .add_node("slow1", logger("slow1"))
        .add_node("slow2", logger("slow2"))
        .add_node("join", logger("join"))
        .add_edge(START, "fast")
        .add_edge(START, "slow1")
        .add_edge("slow1", "slow2")
        .add_join(&["fast", "slow2"], "join")
        .add_edge("join", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["fast", "slow1", "slow2", "join"]);
}

#[tokio::test]
async fn two_last_value_writes_in_one_step_are_an_error_naming_the_channel() {
    let g = StateGraph::<S>::new()
        .add_node("a", |_s, _c| async { Ok(SUpdate::default().count(1)) })
        .add_node("b", |_s, _c| async { Ok(SUpdate::default().count(2)) })
        .add_edge(START, "a")
        .add_edge(START, "b")
        .add_edge("a", END)
        .add_edge("b", END)
        .compile()
        .unwrap();
    let err = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap_err();
    match &err {
        GraphError::State(StateError::Reduce { channel, .. }) => assert_eq!(*channel, "count"),
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test]
async fn conditional_edges_loop_until_the_router_says_end() {
    let g = StateGraph::<S>::new()
        .add_node("inc", |s: Arc<S>, _c| async move {
            Ok(SUpdate::default().count(s.count + 1))
        })
        .add_edge(START, "inc")
        .add_conditional_edges(
            "inc",
            |s: &S| if s.count < 5 { "inc" } else { END },
            Some(&["inc", END]),
        )
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.count, 5);
    assert_eq!(run.steps, 5);
}

#[tokio::test]
async fn router_sees_its_own_nodes_writes_only() {
    // `a` and `b` run in one step; `a`'s router must see a's write and not b's.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = Arc::clone(&seen);
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_edge(START, "a")
        .add_edge(START, "b")
        .add_conditional_edges(
            "a",
            move |s: &S| {
                seen2.lock().unwrap().push(s.log.clone());
                END
            },
            Some(&[END]),
        )
        .add_edge("b", END)
        .compile()
        .unwrap();
    let run = g.invoke(log("in"), &RunConfig::default()).await.unwrap();
    assert_eq!(run.state.log, ["in", "a", "b"]);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![vec!["in".to_owned(), "a".to_owned()]]
    );
}

#[tokio::test]
async fn send_fans_out_one_task_per_payload() {
    let g = StateGraph::<S>::new()
        .add_node("split", |_s, _c| async { Ok(SUpdate::default()) })
        .add_node("work", |_s, ctx: keel_graph::NodeContext| async move {
            let n = ctx.payload().and_then(|p| p.as_i64()).unwrap();
            Ok(log(&format!("w{n}")))
        })
        .add_edge(START, "split")
        .add_conditional_edges(
            "split",
            |_s: &S| (1..=3).map(|i| SendTo::new("work", i)).collect::<Vec<_>>(),
            Some(&["work"]),
        )
        .add_edge("work", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["w1", "w2", "w3"]);
}

#[tokio::test]
async fn command_goto_routes_from_inside_a_node() {
    let g = StateGraph::<S>::new()
        .add_node_with(
            "decide",
            NodeOptions::default().destinations(["yes", "no"]),
            |_s, _c| async { Ok(Command::update(log("decide")).goto("yes")) },
        )
        .add_node("yes", logger("yes"))
        .add_node("no", logger("no"))
        .add_edge(START, "decide")
        .add_edge("yes", END)
        .add_edge("no", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["decide", "yes"]);
}

#[test]
fn compile_rejects_bad_graphs_with_typed_errors() {
    fn check(g: StateGraph<S>, expected: BuildError) {
        match g.compile() {
            Ok(_) => panic!("compiled; expected {expected:?}"),
            Err(e) => assert_eq!(e, expected),
        }
    }
    let base = || StateGraph::<S>::new().add_node("a", logger("a"));
    check(
        base().add_edge(START, "a").add_edge("a", "nowhere"),
        BuildError::UnknownNode {
            name: "nowhere".into(),
            used_in: "the edge `a` -> `nowhere`".into(),
            nodes: vec!["a".into()],
        },
    );
    check(
        base()
            .add_node("a", logger("a"))
            .add_edge(START, "a")
            .add_edge("a", END),
        BuildError::DuplicateNode { name: "a".into() },
    );
    check(
        base()
            .add_node("b", logger("b"))
            .add_edge(START, "a")
            .add_edge("a", END)
            .add_edge("a", "b"),
        BuildError::CannotReachEnd { node: "b".into() },
    );
    check(base().add_edge("a", END), BuildError::NoEntry);
    check(
        base()
            .add_node(END, logger("x"))
            .add_edge(START, "a")
            .add_edge("a", END),
        BuildError::ReservedName { name: END.into() },
    );
    for blank in ["", "  "] {
        check(
            base()
                .add_node(blank, logger("x"))
                .add_edge(START, "a")
                .add_edge("a", END),
            BuildError::BlankName { name: blank.into() },
        );
    }
    check(
        base()
            .add_edge(START, "a")
            .add_edge("a", END)
            .add_edge(END, "a"),
        BuildError::MisplacedEndpoint {
            name: END.into(),
            used_in: "the edge `__end__` -> `a`".into(),
        },
    );
    check(
        base()
            .add_edge(START, "a")
            .add_edge("a", END)
            .add_edge("a", START),
        BuildError::MisplacedEndpoint {
            name: START.into(),
            used_in: "the edge `a` -> `__start__`".into(),
        },
    );
    check(
        base()
            .add_edge(START, "a")
            .add_conditional_edges("a", |_s: &S| END, Some(&[START, END])),
        BuildError::MisplacedEndpoint {
            name: START.into(),
            used_in: "the targets of the router after `a`".into(),
        },
    );
    check(
        base()
            .add_edge(START, "a")
            .add_edge("a", END)
            .interrupt_before(&["zz"]),
        BuildError::UnknownNode {
            name: "zz".into(),
            used_in: "interrupt_before".into(),
            nodes: vec!["a".into()],
        },
    );
}

/// A misspelt name says where it is used and which nodes the graph has, so a typo in
/// `add_node` (the edges all right) is as plain as one in an edge.
#[test]
fn an_unknown_node_names_where_it_is_used_and_the_graphs_nodes() {
    let misspelt_node = StateGraph::<S>::new()
        .add_node("clasify", logger("c"))
        .add_node("close", logger("x"))
        .add_edge(START, "classify")
        .add_edge("classify", "close")
        .add_edge("close", END)
        .compile()
        .err()
        .unwrap();
    assert_eq!(
        misspelt_node.to_string(),
        "unknown node `classify` in the edge `__start__` -> `classify`; \
         the graph's nodes are [\"clasify\", \"close\"]"
    );
    let in_router = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_edge(START, "a")
        .add_conditional_edges("a", |_s: &S| END, Some(&["b", END]))
        .compile()
        .err()
        .unwrap();
    assert!(
        matches!(&in_router, BuildError::UnknownNode { name, used_in, .. }
            if name == "b" && used_in == "the targets of the router after `a`"),
        "{in_router:?}"
    );
}

#[tokio::test]
async fn recursion_limit_is_a_typed_error_with_the_step() {
    let g = StateGraph::<S>::new()
        .add_node("spin", logger("x"))
        .add_edge(START, "spin")
        .add_conditional_edges("spin", |_s: &S| "spin", None)
        .compile()
        .unwrap();
    let err = g
        .invoke(
            SUpdate::default(),
            &RunConfig::default().with_recursion_limit(7),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, GraphError::RecursionLimit { limit: 7, step: 7 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("step 7"), "{err}");
}

#[tokio::test]
async fn default_recursion_limit_allows_ten_thousand_steps() {
    let g = StateGraph::<S>::new()
        .add_node("inc", |s: Arc<S>, _c| async move {
            Ok(SUpdate::default().count(s.count + 1))
        })
        .add_edge(START, "inc")
        .add_conditional_edges(
            "inc",
            |s: &S| if s.count < 10_000 { "inc" } else { END },
            None,
        )
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.count, 10_000);
    let err = g
        .invoke(SUpdate::default().count(-1), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, GraphError::RecursionLimit { limit: 10_000, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn failing_and_panicking_nodes_are_typed_errors_and_the_thread_keeps_its_checkpoint() {
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("ok", logger("ok"))
        .add_node("bad", |s: Arc<S>, _c| async move {
            if s.count == 1 {
                panic!("boom");
            }
            Err::<SUpdate, _>(NodeError::msg("disk on fire"))
        })
        .add_edge(START, "ok")
        .add_edge("ok", "bad")
        .add_edge("bad", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let config = RunConfig::thread("t");
    let err = g.invoke(log("in"), &config).await.unwrap_err();
    assert!(
        matches!(&err, GraphError::Node { node, .. } if node == "bad"),
        "{err:?}"
    );
    assert!(err.to_string().contains("disk on fire"));
    let snap = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.values.log, ["in", "ok"]);
    assert_eq!(snap.next, ["bad"]);
    // The failure is kept with the checkpoint the step ran from.
    assert_eq!(snap.errors.len(), 1, "{:?}", snap.errors);
    assert_eq!(snap.errors[0].node, "bad");
    assert_eq!(snap.errors[0].message, err.to_string());

    let err = g.invoke(log("again").count(1), &config).await.unwrap_err();
    assert!(
        matches!(&err, GraphError::NodePanicked { node, message } if node == "bad" && message == "boom"),
        "{err:?}"
    );
    // A later failure of the same task replaces the earlier one.
    let snap = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.errors.len(), 1, "{:?}", snap.errors);
    assert!(snap.errors[0].message.contains("boom"), "{:?}", snap.errors);
}

#[tokio::test]
async fn a_panicking_router_is_a_typed_error_in_invoke_and_stream_and_the_thread_resumes() {
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("ok", logger("ok"))
        .add_edge(START, "ok")
        .add_conditional_edges(
            "ok",
            |s: &S| {
                if s.count == 1 {
                    panic!("kaboom in router");
                }
                END
            },
            None,
        )
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let config = RunConfig::thread("router");
    let err = g.invoke(log("in").count(1), &config).await.unwrap_err();
    assert!(
        matches!(&err, GraphError::RouterPanicked { from, message } if from == "ok" && message == "kaboom in router"),
        "{err:?}"
    );
    // The step whose router panicked is not stored: the thread waits to run `ok`.
    let snap = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.values.log, ["in"]);
    assert_eq!(snap.next, ["ok"]);

    // A stream ends with the error, not silently.
    let events: Vec<_> = g
        .stream(
            log("s").count(1),
            RunConfig::thread("router-stream"),
            StreamMode::all(),
        )
        .collect()
        .await;
    assert!(
        matches!(events.last(), Some(Err(GraphError::RouterPanicked { .. }))),
        "{events:?}"
    );

    // Once the state no longer makes it panic, the thread goes on from its checkpoint.
    g.update_state(&config, SUpdate::default().count(-1), None)
        .await
        .unwrap();
    let done = g.invoke(Command::<S>::none(), &config).await.unwrap();
    assert_eq!(done.state.log, ["in", "ok"]);
}

#[tokio::test]
async fn timeout_and_retry_policy() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let g = StateGraph::<S>::new()
        .add_node_with(
            "flaky",
            NodeOptions::default()
                .timeout(Duration::from_millis(50))
                .retry(
                    RetryPolicy::default()
                        .max_attempts(3)
                        .initial_backoff(Duration::from_millis(1)),
                ),
            move |_s, _ctx| {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 => Err(NodeError::msg("transient")),
                        1 => {
                            tokio::time::sleep(Duration::from_secs(5)).await;
                            Ok(log("late"))
                        }
                        _ => Ok(log("ok")),
                    }
                }
            },
        )
        .add_edge(START, "flaky")
        .add_edge("flaky", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["ok"]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    let slow = StateGraph::<S>::new()
        .add_node_with(
            "slow",
            NodeOptions::default().timeout(Duration::from_millis(10)),
            |_s, _c| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(log("never"))
            },
        )
        .add_edge(START, "slow")
        .add_edge("slow", END)
        .compile()
        .unwrap();
    let err = slow
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, GraphError::NodeTimeout { .. }), "{err:?}");
}

fn retrying(policy: RetryPolicy) -> Result<keel_graph::CompiledGraph<S>, BuildError> {
    StateGraph::<S>::new()
        .add_node_with(
            "flaky",
            NodeOptions::default().retry(policy),
            logger("flaky"),
        )
        .add_edge(START, "flaky")
        .add_edge("flaky", END)
        .compile()
}

#[test]
fn compile_refuses_retry_settings_out_of_range() {
    for multiplier in [-2.0, 0.0, 0.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let err = retrying(RetryPolicy::default().multiplier(multiplier)).err();
        assert!(
            matches!(&err, Some(BuildError::InvalidRetryPolicy { node, setting: "multiplier", .. }) if node == "flaky"),
            "multiplier {multiplier}: {err:?}"
        );
    }
    let err = retrying(RetryPolicy::default().max_attempts(0)).err();
    assert!(
        matches!(
            &err,
            Some(BuildError::InvalidRetryPolicy {
                setting: "max_attempts",
                ..
            })
        ),
        "{err:?}"
    );
    let message = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        message.contains("`flaky`") && message.contains("max_attempts"),
        "{message}"
    );
    // In range: constant and growing waits, any durations.
    for multiplier in [1.0, 2.0, 1e300] {
        assert!(
            retrying(
                RetryPolicy::default()
                    .multiplier(multiplier)
                    .initial_backoff(Duration::MAX)
                    .max_backoff(Duration::ZERO)
            )
            .is_ok()
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_backoff_past_duration_max_waits_max_backoff_instead_of_panicking() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let g = StateGraph::<S>::new()
        .add_node_with(
            "flaky",
            NodeOptions::default().retry(
                RetryPolicy::default()
                    .max_attempts(4)
                    .initial_backoff(Duration::MAX)
                    .multiplier(1e300)
                    .max_backoff(Duration::from_millis(1)),
            ),
            move |_s, _ctx| {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 3 {
                        Err(NodeError::msg("transient"))
                    } else {
                        Ok(log("ok"))
                    }
                }
            },
        )
        .add_edge(START, "flaky")
        .add_edge("flaky", END)
        .compile()
        .unwrap();
    let run = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, ["ok"]);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

fn approval_graph(cp: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("draft", logger("draft"))
        .add_node("approve", |_s, ctx: keel_graph::NodeContext| async move {
            let answer = ctx.interrupt(json!({"question": "ship it?"}))?;
            Ok(log(&format!("answer={}", answer.as_str().unwrap_or("?"))))
        })
        .add_node("ship", logger("ship"))
        .add_edge(START, "draft")
        .add_edge("draft", "approve")
        .add_edge("approve", "ship")
        .add_edge("ship", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test]
async fn interrupt_pauses_and_resume_reruns_the_node_with_the_answer() {
    let g = approval_graph(saver());
    let config = RunConfig::thread("t1");
    let run = g.invoke(log("in"), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "draft"]);
    assert_eq!(run.interrupts.len(), 1);
    assert_eq!(run.interrupts[0].node, "approve");
    assert_eq!(run.interrupts[0].value, json!({"question": "ship it?"}));
    assert_eq!(run.next, ["approve"]);

    let snap = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.interrupts.len(), 1);

    let run = g.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "draft", "answer=yes", "ship"]);
    assert!(run.interrupts.is_empty());
    assert!(!run.is_paused());

    // Nothing is pending any more.
    let err = g
        .invoke(Command::resume("again"), &config)
        .await
        .unwrap_err();
    assert!(
        matches!(err, GraphError::NoPendingInterrupt { .. }),
        "{err:?}"
    );
}

/// `Command::resume` on a thread paused at a breakpoint says what continues it
/// (`Command::none`), and on a finished thread that it needs a new input.
#[tokio::test]
async fn resuming_a_thread_at_a_breakpoint_names_what_continues_it() {
    let g = StateGraph::<S>::new()
        .add_node("draft", logger("draft"))
        .add_node("publish", logger("publish"))
        .add_edge(START, "draft")
        .add_edge("draft", "publish")
        .add_edge("publish", END)
        .interrupt_before(&["publish"])
        .with_checkpointer(saver())
        .compile()
        .unwrap();
    let config = RunConfig::thread("t");
    let run = g.invoke(log("in"), &config).await.unwrap();
    assert_eq!(run.next, ["publish"]);

    let err = g.invoke(Command::resume("go"), &config).await.unwrap_err();
    match &err {
        GraphError::NoPendingInterrupt { thread_id, next } => {
            assert_eq!(thread_id, "t");
            assert_eq!(next, &["publish"]);
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string().contains("continue it with Command::none()"),
        "{err}"
    );

    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "draft", "publish"]);
    let err = g.invoke(Command::resume("go"), &config).await.unwrap_err();
    assert!(
        matches!(&err, GraphError::NoPendingInterrupt { next, .. } if next.is_empty()),
        "{err:?}"
    );
    assert!(err.to_string().contains("new input"), "{err}");
}

/// An edit (`update_state` with no `as_node`) of a thread waiting on an interrupt keeps
/// it waiting: the resume the `ResumeWithUpdate` error points to after the edit answers
/// it, and a task of the step that had finished does not run again.
#[tokio::test(flavor = "multi_thread")]
async fn an_edit_while_an_interrupt_waits_keeps_the_interrupt_and_the_finished_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Checkpointer> = Arc::new(
        keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("t.db"))
            .await
            .unwrap(),
    );
    for cp in [saver(), sqlite] {
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&sent);
        let g = StateGraph::<S>::new()
            .add_node(
                "ask",
                |s: Arc<S>, ctx: keel_graph::NodeContext| async move {
                    let answer = ctx.interrupt("ok?")?;
                    Ok(log(&format!("ask={answer} seeing {:?}", s.log)))
                },
            )
            .add_node("email", move |_s, _c| {
                counter.fetch_add(1, Ordering::SeqCst);
                futures::future::ready(Ok(log("emailed")))
            })
            .add_edge(START, "ask")
            .add_edge(START, "email")
            .add_edge("ask", END)
            .add_edge("email", END)
            .with_checkpointer(cp)
            .compile()
            .unwrap();
        let config = RunConfig::thread("t");
        let run = g.invoke(log("draft"), &config).await.unwrap();
        assert_eq!(run.interrupts.len(), 1);

        g.update_state(&config, log("edited"), None).await.unwrap();
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert_eq!(snap.values.log, ["draft", "edited"]);
        assert_eq!(snap.next, ["ask", "email"]);
        assert_eq!(snap.interrupts.len(), 1, "the edit keeps the pause");
        assert_eq!(snap.interrupts[0].value, json!("ok?"));

        let run = g.invoke(Command::resume("yes"), &config).await.unwrap();
        assert!(!run.is_paused());
        assert_eq!(
            run.state.log,
            [
                "draft",
                "edited",
                "ask=\"yes\" seeing [\"draft\", \"edited\"]",
                "emailed"
            ]
        );
        assert_eq!(sent.load(Ordering::SeqCst), 1, "email ran once");

        // A fork from the older, paused checkpoint runs its tasks anew: `ask` asks again.
        let paused = full_history(&g, &config)
            .await
            .into_iter()
            .find(|h| h.metadata.step == -1 && h.metadata.source == CheckpointSource::Input)
            .unwrap();
        g.update_state(
            &config.clone().at(paused.checkpoint_id),
            log("forked"),
            None,
        )
        .await
        .unwrap();
        assert!(
            g.get_state(&config)
                .await
                .unwrap()
                .unwrap()
                .interrupts
                .is_empty()
        );
        let run = g.invoke(Command::none(), &config).await.unwrap();
        assert_eq!(run.interrupts.len(), 1);
        assert_eq!(sent.load(Ordering::SeqCst), 2, "the fork ran email again");
    }
}

/// A node that asks twice; each answer is matched to its question by order.
fn two_questions(cp: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("ask", |_s, ctx: keel_graph::NodeContext| async move {
            let name = ctx.interrupt("name?")?;
            let age = ctx.interrupt("age?")?;
            Ok(log(&format!("{name} {age}")))
        })
        .add_edge(START, "ask")
        .add_edge("ask", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_interrupts_twice_is_resumed_twice_in_memory_and_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Checkpointer> = Arc::new(
        keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("t.db"))
            .await
            .unwrap(),
    );
    for cp in [saver(), sqlite] {
        let config = RunConfig::thread("t");
        let run = two_questions(cp.clone())
            .invoke(log("in"), &config)
            .await
            .unwrap();
        assert_eq!(run.interrupts.len(), 1);
        assert_eq!(run.interrupts[0].value, json!("name?"));

        // Each call compiles the graph again: what it knows comes from the saver.
        let run = two_questions(cp.clone())
            .invoke(Command::resume("ada"), &config)
            .await
            .unwrap();
        assert_eq!(run.interrupts.len(), 1, "{:?}", run.interrupts);
        assert_eq!(run.interrupts[0].value, json!("age?"));
        let snap = two_questions(cp.clone())
            .get_state(&config)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(snap.next, ["ask"]);
        assert_eq!(snap.interrupts.len(), 1);
        assert_eq!(snap.interrupts[0].value, json!("age?"));

        let run = two_questions(cp.clone())
            .invoke(Command::resume(36), &config)
            .await
            .unwrap();
        assert!(run.interrupts.is_empty());
        assert!(!run.is_paused());
        assert_eq!(run.state.log, ["in", "\"ada\" 36"]);
        let err = two_questions(cp)
            .invoke(Command::resume("again"), &config)
            .await
            .unwrap_err();
        assert!(
            matches!(err, GraphError::NoPendingInterrupt { .. }),
            "{err:?}"
        );
    }
}

/// Two nodes in one step, each asking its own question.
fn two_askers(cp: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<S> {
    let asker = |name: &'static str| {
        move |_s: Arc<S>, ctx: keel_graph::NodeContext| async move {
            let answer = ctx.interrupt(format!("{name}?"))?;
            Ok(log(&format!("{name}={answer}")))
        }
    };
    StateGraph::<S>::new()
        .add_node("a", asker("a"))
        .add_node("b", asker("b"))
        .add_edge(START, "a")
        .add_edge(START, "b")
        .add_edge("a", END)
        .add_edge("b", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn parallel_interrupts_are_answered_one_by_one_with_resume_each() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Checkpointer> = Arc::new(
        keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("t.db"))
            .await
            .unwrap(),
    );
    for cp in [saver(), sqlite] {
        let g = two_askers(cp);
        let config = RunConfig::thread("t");
        let run = g.invoke(log("in"), &config).await.unwrap();
        let mut asked: Vec<_> = run.interrupts.iter().map(|i| i.value.clone()).collect();
        asked.sort_by_key(|v| v.to_string());
        assert_eq!(asked, [json!("a?"), json!("b?")]);
        let task = |node: &str| {
            run.interrupts
                .iter()
                .find(|i| i.node == node)
                .unwrap()
                .task_id
                .clone()
        };
        let (a, b) = (task("a"), task("b"));

        // A task with no pending interrupt: refused, and nothing is stored.
        let err = g
            .invoke(
                Command::resume_each([(a.clone(), json!(1)), ("nope".to_owned(), json!(2))]),
                &config,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, GraphError::UnknownInterrupt { task_id, pending, .. }
                if task_id == "nope" && pending.len() == 2),
            "{err:?}"
        );
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert_eq!(snap.interrupts.len(), 2);

        // Only `a` answered: `b` asks again and the step waits for it.
        let run = g
            .invoke(Command::resume_each([(a.clone(), json!("yes"))]), &config)
            .await
            .unwrap();
        assert_eq!(run.interrupts.len(), 1, "{:?}", run.interrupts);
        assert_eq!(run.interrupts[0].task_id, b);
        assert_eq!(run.interrupts[0].value, json!("b?"));
        assert_eq!(run.state.log, ["in"], "the step is not applied yet");

        // `b`'s answer finishes the step with both answers, each to its own node.
        let run = g
            .invoke(Command::resume_each([(b.clone(), json!(7))]), &config)
            .await
            .unwrap();
        assert!(run.interrupts.is_empty());
        assert!(!run.is_paused());
        assert_eq!(run.state.log, ["in", "a=\"yes\"", "b=7"]);
    }
}

/// `get_state` lists pending interrupts in task order, as the run that paused did, not
/// in the order the tasks happened to finish and store them.
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_lists_interrupts_in_task_order_whichever_task_finished_first() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Checkpointer> = Arc::new(
        keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("t.db"))
            .await
            .unwrap(),
    );
    for cp in [saver(), sqlite] {
        // `a` comes first in task order but asks last.
        let asker = |name: &'static str, wait_ms: u64| {
            move |_s: Arc<S>, ctx: keel_graph::NodeContext| async move {
                tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                let answer = ctx.interrupt(format!("{name}?"))?;
                Ok(log(&format!("{name}={answer}")))
            }
        };
        let g = StateGraph::<S>::new()
            .add_node("a", asker("a", 200))
            .add_node("b", asker("b", 0))
            .add_edge(START, "a")
            .add_edge(START, "b")
            .add_edge("a", END)
            .add_edge("b", END)
            .with_checkpointer(cp)
            .compile()
            .unwrap();
        let config = RunConfig::thread("t");
        let run = g.invoke(log("in"), &config).await.unwrap();
        let nodes =
            |i: &[keel_graph::Interrupt]| i.iter().map(|i| i.node.clone()).collect::<Vec<_>>();
        assert_eq!(nodes(&run.interrupts), ["a", "b"]);
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert_eq!(snap.interrupts, run.interrupts);
        let newest = full_history(&g, &config).await.remove(0);
        assert_eq!(nodes(&newest.interrupts), ["a", "b"]);
    }
}

#[tokio::test]
async fn resume_answers_the_interrupts_resume_each_does_not_name() {
    let g = two_askers(saver());
    let config = RunConfig::thread("t");
    let run = g.invoke(log("in"), &config).await.unwrap();
    let a = run.interrupts.iter().find(|i| i.node == "a").unwrap();
    let mut both = Command::resume_each([(a.task_id.clone(), json!("mine"))]);
    both.resume = Some(json!("default"));
    let run = g.invoke(both, &config).await.unwrap();
    assert!(run.interrupts.is_empty());
    assert_eq!(run.state.log, ["in", "a=\"mine\"", "b=\"default\""]);
}

#[tokio::test]
async fn a_resume_with_an_update_is_refused_and_changes_nothing() {
    let g = approval_graph(saver());
    let config = RunConfig::thread("t1");
    g.invoke(log("in"), &config).await.unwrap();
    let mut answer = Command::resume("yes");
    answer.update = Some(log("extra"));
    let err = g.invoke(answer, &config).await.unwrap_err();
    assert!(matches!(err, GraphError::ResumeWithUpdate), "{err:?}");
    // The interrupt still waits, and a plain answer finishes the run.
    let run = g.invoke(Command::resume("yes"), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "draft", "answer=yes", "ship"]);
}

#[tokio::test]
async fn a_router_may_route_only_to_its_declared_targets() {
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_node("c", logger("c"))
        .add_edge(START, "a")
        .add_edge(START, "c")
        .add_conditional_edges("a", |_s: &S| "c", Some(&["b", END]))
        .add_edge("b", END)
        .add_edge("c", END)
        .compile()
        .unwrap();
    let err = g
        .invoke(log("in"), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, GraphError::UndeclaredTarget { from, to, declared }
            if from == "a" && to == "c" && declared == &["b", END]),
        "{err:?}"
    );
    assert!(err.to_string().contains("add_conditional_edges"), "{err}");
}

#[tokio::test]
async fn a_checkpointed_graph_needs_a_thread_id_and_a_breakpoint_a_checkpointer() {
    let g = one_logger_saved();
    let err = g
        .invoke(log("in"), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, GraphError::NoThreadId), "{err:?}");
    assert!(err.to_string().contains("RunConfig::thread"), "{err}");

    // A breakpoint with nothing to store the pause in could never be resumed: refused
    // when the graph is compiled, not when a run first reaches it.
    for after in [false, true] {
        let g = StateGraph::<S>::new()
            .add_node("a", logger("a"))
            .add_edge(START, "a")
            .add_edge("a", END);
        let g = if after {
            g.interrupt_after(&["a"])
        } else {
            g.interrupt_before(&["a"])
        };
        let err = g.compile().err().unwrap();
        assert!(
            matches!(&err, keel_graph::BuildError::BreakpointNeedsCheckpointer { node } if node == "a"),
            "{err:?}"
        );
        assert!(err.to_string().contains("with_checkpointer"), "{err}");
    }
}

#[tokio::test]
async fn interrupt_needs_a_checkpointer() {
    let g = StateGraph::<S>::new()
        .add_node("ask", |_s, ctx: keel_graph::NodeContext| async move {
            ctx.interrupt("?")?;
            Ok(SUpdate::default())
        })
        .add_edge(START, "ask")
        .add_edge("ask", END)
        .compile()
        .unwrap();
    let err = g
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, GraphError::CheckpointerRequired { what: "interrupt" }),
        "{err:?}"
    );
}

#[tokio::test]
async fn static_breakpoints_pause_before_and_after() {
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_node("c", logger("c"))
        .add_edge(START, "a")
        .add_edge("a", "b")
        .add_edge("b", "c")
        .add_edge("c", END)
        .interrupt_before(&["b"])
        .interrupt_after(&["b"])
        .with_checkpointer(saver())
        .compile()
        .unwrap();
    let config = RunConfig::thread("bp");
    let run = g.invoke(log("in"), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "a"]);
    assert_eq!(run.next, ["b"]);
    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "a", "b"]);
    assert_eq!(run.next, ["c"]);
    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "a", "b", "c"]);
    assert!(run.next.is_empty());
}

#[tokio::test]
async fn stream_yields_values_updates_and_checkpoints() {
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_edge(START, "a")
        .add_edge("a", "b")
        .add_edge("b", END)
        .with_checkpointer(saver())
        .compile()
        .unwrap();
    let events: Vec<Event<S>> = g
        .stream(log("in"), RunConfig::thread("s"), StreamMode::all())
        .map(Result::unwrap)
        .collect()
        .await;
    let values: Vec<Vec<String>> = events
        .iter()
        .filter_map(|e| match e {
            Event::Values { state, .. } => Some(state.log.clone()),
            _ => None,
        })
        .collect();
    // As LangGraph's: the input's state first, then each step's.
    assert_eq!(
        values,
        vec![vec!["in"], vec!["in", "a"], vec!["in", "a", "b"]]
    );
    let updates: Vec<(String, serde_json::Value)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Updates { node, update, .. } => Some((node.clone(), update[0].1.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        updates,
        vec![("a".into(), json!(["a"])), ("b".into(), json!(["b"]))]
    );
    let checkpoints = events
        .iter()
        .filter(|e| matches!(e, Event::Checkpoint { .. }))
        .count();
    assert_eq!(checkpoints, 3, "input + two steps");
    assert!(matches!(events.last(), Some(Event::Done { next, .. }) if next.is_empty()));
}

/// `NodeContext::emit`: custom events arrive while their node runs, before its update,
/// in the order sent, from parallel nodes alike; without the custom mode, or in
/// `invoke`, they go nowhere and the run is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_emit_custom_events_while_they_run() {
    let emitter = |name: &'static str, n: usize| {
        move |_s: Arc<S>, ctx: keel_graph::NodeContext| async move {
            for i in 0..n {
                ctx.emit(json!({ "from": name, "i": i, "heard": ctx.emits() }))
                    .await;
            }
            Ok(log(name))
        }
    };
    let g = StateGraph::<S>::new()
        .add_node("a", emitter("a", 200))
        .add_node("b", emitter("b", 3))
        .add_node("c", emitter("c", 2))
        .add_edge(START, "a")
        .add_edge(START, "b")
        .add_edge("a", "c")
        .add_edge("b", "c")
        .add_edge("c", END)
        .compile()
        .unwrap();

    // The reader is slow: the nodes wait for it, and nothing is lost or reordered.
    let mut stream = g.stream(
        log("in"),
        RunConfig::default(),
        StreamMode::updates().with_custom(),
    );
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        if events.len() % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        events.push(e.unwrap());
    }
    for (name, n) in [("a", 200), ("b", 3), ("c", 2)] {
        // The step of the node's own update.
        let step = events
            .iter()
            .find_map(|e| match e {
                Event::Updates { step, node, .. } if node == name => Some(*step),
                _ => None,
            })
            .unwrap();
        let sent: Vec<(i64, serde_json::Value)> = events
            .iter()
            .filter_map(|e| match e {
                Event::Custom { step, node, value } if node == name => Some((*step, value.clone())),
                _ => None,
            })
            .collect();
        let expected: Vec<(i64, serde_json::Value)> = (0..n)
            .map(|i| (step, json!({ "from": name, "i": i, "heard": true })))
            .collect();
        assert_eq!(sent, expected, "{name}");
        let last_custom = events
            .iter()
            .rposition(|e| matches!(e, Event::Custom { node, .. } if node == name))
            .unwrap();
        let update = events
            .iter()
            .position(|e| matches!(e, Event::Updates { node, .. } if node == name))
            .unwrap();
        assert!(last_custom < update, "{name}: emitted before its update");
    }

    // Not asked for: no custom events, and the node knows it.
    let g2 = StateGraph::<S>::new()
        .add_node("a", |_s: Arc<S>, ctx: keel_graph::NodeContext| async move {
            ctx.emit(json!("unheard")).await;
            Ok(log(if ctx.emits() { "heard" } else { "unheard" }))
        })
        .add_edge(START, "a")
        .add_edge("a", END)
        .compile()
        .unwrap();
    let events: Vec<Event<S>> = g2
        .stream(log("in"), RunConfig::default(), StreamMode::values())
        .map(Result::unwrap)
        .collect()
        .await;
    assert!(!events.iter().any(|e| matches!(e, Event::Custom { .. })));
    let run = g2.invoke(log("in"), &RunConfig::default()).await.unwrap();
    assert_eq!(run.state.log, ["in", "unheard"]);
}

#[tokio::test]
async fn dropping_the_stream_cancels_the_run() {
    let started = Arc::new(AtomicUsize::new(0));
    let s2 = Arc::clone(&started);
    let g = StateGraph::<S>::new()
        .add_node("tick", move |s: Arc<S>, _c| {
            s2.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok(SUpdate::default().count(s.count + 1))
            }
        })
        .add_edge(START, "tick")
        .add_conditional_edges("tick", |_s: &S| "tick", None)
        .compile()
        .unwrap();
    // Unpin: polled as it is, no Box::pin.
    let mut stream = g.stream(
        SUpdate::default(),
        RunConfig::default(),
        StreamMode::values(),
    );
    stream.next().await.unwrap().unwrap();
    drop(stream);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after_drop = started.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        started.load(Ordering::SeqCst),
        after_drop,
        "the run kept going"
    );
}

#[tokio::test]
async fn crash_mid_step_resumes_without_rerunning_finished_tasks() {
    // Step with two tasks: `steady` finishes and its writes are stored; `crashy` fails
    // the first time (standing in for a process that died mid-step).
    let steady_calls = Arc::new(AtomicUsize::new(0));
    let crashy_calls = Arc::new(AtomicUsize::new(0));
    let (sc, cc) = (Arc::clone(&steady_calls), Arc::clone(&crashy_calls));
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("steady", move |_s, _c| {
            sc.fetch_add(1, Ordering::SeqCst);
            async { Ok(log("steady")) }
        })
        .add_node("crashy", move |_s, _c| {
            let n = cc.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                if n == 0 {
                    Err(NodeError::msg("killed"))
                } else {
                    Ok(log("crashy"))
                }
            }
        })
        .add_edge(START, "steady")
        .add_edge(START, "crashy")
        .add_edge("steady", END)
        .add_edge("crashy", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let config = RunConfig::thread("crash");
    g.invoke(log("in"), &config).await.unwrap_err();
    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "crashy", "steady"]);
    assert_eq!(
        steady_calls.load(Ordering::SeqCst),
        1,
        "finished task ran again"
    );
    assert_eq!(crashy_calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn time_travel_history_update_state_and_fork() {
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_node("b", logger("b"))
        .add_edge(START, "a")
        .add_edge("a", "b")
        .add_edge("b", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let config = RunConfig::thread("tt");
    g.invoke(log("in"), &config).await.unwrap();
    let history = full_history(&g, &config).await;
    let logs: Vec<Vec<String>> = history.iter().map(|h| h.values.log.clone()).collect();
    assert_eq!(
        logs,
        vec![vec!["in", "a", "b"], vec!["in", "a"], vec!["in"]]
    );
    assert_eq!(history[2].metadata.source, CheckpointSource::Input);
    assert_eq!(history[1].next, ["b"]);

    // Resume from the checkpoint after `a`: `b` runs again on that branch.
    let after_a = history[1].checkpoint_id.clone();
    let run = g
        .invoke(Command::none(), &config.clone().at(after_a.clone()))
        .await
        .unwrap();
    assert_eq!(run.state.log, ["in", "a", "b"]);
    let latest = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(latest.parent_id.as_ref(), Some(&after_a));

    // Edit the past: pretend `a` wrote something else, then continue from there.
    let forked = g
        .update_state(
            &config.clone().at(after_a.clone()),
            log("edited"),
            Some("a"),
        )
        .await
        .unwrap();
    let snap = g
        .get_state(&config.clone().at(forked.clone()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(snap.values.log, ["in", "a", "edited"]);
    assert_eq!(snap.metadata.source, CheckpointSource::Update);
    assert_eq!(snap.next, ["b"]);
    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["in", "a", "edited", "b"]);
}

/// A node `inc` that logs and bumps `count`, looping until it is 20 (21 checkpoints).
fn counting_to_20(cp: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("inc", |s: Arc<S>, _c| async move {
            Ok(SUpdate::default()
                .count(s.count + 1)
                .log(vec![format!("{}", s.count)]))
        })
        .add_edge(START, "inc")
        .add_conditional_edges("inc", |s: &S| if s.count < 20 { "inc" } else { END }, None)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test]
async fn durability_modes_agree_on_the_result() {
    async fn run(d: Durability) -> (Vec<String>, usize) {
        let cp = saver();
        let g = counting_to_20(Arc::clone(&cp));
        let config = RunConfig::thread("d").with_durability(d);
        g.invoke(SUpdate::default(), &config).await.unwrap();
        let stored = g.get_state(&config).await.unwrap().unwrap();
        let n = full_history(&g, &config).await.len();
        (stored.values.log, n)
    }
    let (sync, n_sync) = run(Durability::Sync).await;
    let (asyn, n_async) = run(Durability::Async).await;
    let (exit, n_exit) = run(Durability::Exit).await;
    assert_eq!(sync.len(), 20);
    assert_eq!(sync, asyn);
    assert_eq!(sync, exit);
    assert_eq!(n_sync, 21);
    assert_eq!(n_async, 21);
    assert_eq!(n_exit, 1, "exit durability stores only the end");
}

/// With `Durability::Async` and an in-memory checkpointer each checkpoint is stored at
/// once, before the next step runs: handing it to a background writer would cost more
/// than the put. On this one-thread runtime a background writer would not have run yet
/// when the next step looks.
#[tokio::test]
async fn async_durability_stores_at_once_in_memory() {
    let memory = Arc::new(MemorySaver::new());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (m, log) = (Arc::clone(&memory), Arc::clone(&seen));
    let g = StateGraph::<S>::new()
        .add_node("inc", move |s: Arc<S>, _c| {
            let (m, log) = (Arc::clone(&m), Arc::clone(&log));
            async move {
                let key = keel_checkpoint::ThreadKey::new("at-once".to_owned());
                let stored = m.list(&key, ListOptions::default()).count().await;
                log.lock().unwrap().push(stored);
                Ok(SUpdate::default().count(s.count + 1))
            }
        })
        .add_edge(START, "inc")
        .add_conditional_edges("inc", |s: &S| if s.count < 3 { "inc" } else { END }, None)
        .with_checkpointer(memory.clone())
        .compile()
        .unwrap();
    let config = RunConfig::thread("at-once").with_durability(Durability::Async);
    g.invoke(SUpdate::default(), &config).await.unwrap();
    // The input's checkpoint, then one more before each later step.
    assert_eq!(*seen.lock().unwrap(), [1, 2, 3]);
}

/// With `Durability::Async`, checkpoints queued behind a slow write reach the
/// checkpointer as one `put_many` batch, in order, and every one is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_durability_hands_queued_checkpoints_over_as_one_batch() {
    let counting = Arc::new(CountingSaver::new(Duration::from_millis(200)));
    let cp: Arc<dyn Checkpointer> = counting.clone();
    let g = counting_to_20(Arc::clone(&cp));
    let config = RunConfig::thread("batched").with_durability(Durability::Async);
    let run = g.invoke(SUpdate::default(), &config).await.unwrap();
    assert_eq!(run.state.count, 20);

    let batches = counting.batches.lock().unwrap().clone();
    assert_eq!(
        batches.iter().sum::<usize>(),
        21,
        "every checkpoint was put once: {batches:?}"
    );
    assert!(
        batches.iter().any(|&n| n > 1),
        "checkpoints queued behind a put came as a batch: {batches:?}"
    );
    let history = full_history(&g, &config).await;
    let steps: Vec<i64> = history.iter().rev().map(|s| s.metadata.step).collect();
    assert_eq!(steps, (-1..20).collect::<Vec<_>>(), "stored in order");
    assert_eq!(history[0].values.log.len(), 20);
}

#[tokio::test]
async fn a_schema_change_is_a_typed_error_naming_the_channel() {
    #[derive(Clone, Debug, State)]
    struct V1 {
        count: i64,
    }
    #[derive(Clone, Debug, State)]
    struct V2 {
        count: String,
    }
    let cp = saver();
    let v1 = StateGraph::<V1>::new()
        .add_node("n", |_s, _c| async { Ok(V1Update::default().count(3)) })
        .add_edge(START, "n")
        .add_edge("n", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    v1.invoke(V1Update::default(), &RunConfig::thread("schema"))
        .await
        .unwrap();
    let v2 = StateGraph::<V2>::new()
        .add_node("n", |_s, _c| async { Ok(V2Update::default()) })
        .add_edge(START, "n")
        .add_edge("n", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let err = v2
        .invoke(Command::none(), &RunConfig::thread("schema"))
        .await
        .unwrap_err();
    match err {
        GraphError::State(StateError::Decode { channel, .. }) => assert_eq!(channel, "count"),
        other => panic!("unexpected {other:?}"),
    }
}

/// START → `work` → END on `cp`, where `work` waits at `gate` before it writes: two
/// of them on one thread race to store the same step.
fn gated_worker(
    cp: &Arc<dyn Checkpointer>,
    gate: Arc<tokio::sync::Barrier>,
) -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("work", move |_s, _c| {
            let gate = Arc::clone(&gate);
            async move {
                gate.wait().await;
                Ok(log("w"))
            }
        })
        .add_edge(START, "work")
        .add_edge("work", END)
        .with_checkpointer(Arc::clone(cp))
        .compile()
        .unwrap()
}

#[tokio::test]
async fn stale_writer_is_refused() {
    // Two graphs (workers) run the same thread from the same checkpoint: the second
    // one to store a step is refused.
    let cp = saver();
    let gate = Arc::new(tokio::sync::Barrier::new(2));
    let make = |gate: Arc<tokio::sync::Barrier>| gated_worker(&cp, gate);
    let seed = make(Arc::new(tokio::sync::Barrier::new(1)));
    let config = RunConfig::thread("race");
    seed.invoke(log("in"), &config.clone().with_durability(Durability::Sync))
        .await
        .unwrap();
    let state = seed.get_state(&config).await.unwrap().unwrap();
    // Fork point: re-run from the input checkpoint on two workers at once.
    let history = full_history(&seed, &config).await;
    let input_cp = history.last().unwrap().checkpoint_id.clone();
    assert_eq!(state.values.log, ["in", "w"]);
    let (g1, g2) = (make(Arc::clone(&gate)), make(Arc::clone(&gate)));
    let c1 = config.clone().at(input_cp.clone());
    let c2 = config.clone().at(input_cp);
    let (r1, r2) = tokio::join!(
        g1.invoke(Command::none(), &c1),
        g2.invoke(Command::none(), &c2)
    );
    let conflicts = [&r1, &r2]
        .iter()
        .filter(|r| matches!(r, Err(GraphError::Checkpoint(e)) if e.is_conflict()))
        .count();
    assert_eq!(conflicts, 1, "{r1:?} {r2:?}");
    assert_eq!([&r1, &r2].iter().filter(|r| r.is_ok()).count(), 1);
}

#[tokio::test]
async fn add_messages_state_survives_a_checkpoint_round_trip() {
    let cp = saver();
    let g =
        StateGraph::<S>::new()
            .add_node("reply", |s: Arc<S>, _c| async move {
                let n = s.messages.len();
                Ok(SUpdate::default().messages(AddMessagesUpdate::append(vec![
                    Message::assistant(format!("reply {n}")),
                ])))
            })
            .add_edge(START, "reply")
            .add_edge("reply", END)
            .with_checkpointer(Arc::clone(&cp))
            .compile()
            .unwrap();
    let config = RunConfig::thread("msgs");
    for i in 0..50 {
        g.invoke(
            SUpdate::default().messages(AddMessagesUpdate::append(vec![Message::user(format!(
                "q{i}"
            ))])),
            &config,
        )
        .await
        .unwrap();
    }
    let state = g.get_state(&config).await.unwrap().unwrap().values;
    assert_eq!(state.messages.len(), 100);
    assert_eq!(state.messages.as_slice()[99].text(), "reply 99");
    assert!(state.messages.as_slice().iter().all(|m| m.id.is_some()));
}

/// What a node reads of its invocation, as one log line.
fn describe(ctx: &keel_graph::NodeContext) -> String {
    format!(
        "{} thread={} ns={:?} model={} keys={}",
        ctx.node(),
        ctx.thread_id().unwrap_or("-"),
        ctx.checkpoint_ns(),
        ctx.config()
            .get("model")
            .and_then(|v| v.as_str())
            .unwrap_or("-"),
        ctx.config().len()
    )
}

#[tokio::test]
async fn nodes_see_the_thread_namespace_and_configurable_of_their_invocation() {
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("split", |_s, ctx: keel_graph::NodeContext| async move {
            Ok(log(&describe(&ctx)))
        })
        .add_node("work", |_s, ctx: keel_graph::NodeContext| async move {
            let n = ctx.payload().and_then(|p| p.as_i64()).unwrap();
            Ok(log(&format!("{} #{n}", describe(&ctx))))
        })
        .add_edge(START, "split")
        .add_conditional_edges(
            "split",
            |_s: &S| (1..=2).map(|i| SendTo::new("work", i)).collect::<Vec<_>>(),
            Some(&["work"]),
        )
        .add_edge("work", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();

    // Every task of every step, parallel ones included, sees the same configuration.
    let mut config = RunConfig::thread("cfg")
        .with_configurable("model", "small")
        .with_configurable("user_id", 7);
    config.checkpoint_ns = "sub".into();
    let run = g.invoke(SUpdate::default(), &config).await.unwrap();
    assert_eq!(
        run.state.log,
        [
            r#"split thread=cfg ns="sub" model=small keys=2"#,
            r#"work thread=cfg ns="sub" model=small keys=2 #1"#,
            r#"work thread=cfg ns="sub" model=small keys=2 #2"#,
        ]
    );
    // The configuration is not checkpoint metadata: nothing of it is stored.
    for snap in full_history(&g, &config).await {
        assert!(!snap.metadata.extra.contains_key("model"), "{snap:?}");
        assert!(!snap.metadata.extra.contains_key("user_id"), "{snap:?}");
    }
    // A later invocation sees its own configuration, not an earlier one.
    let run = g
        .invoke(log("again"), &RunConfig::thread("cfg2"))
        .await
        .unwrap();
    assert_eq!(
        run.state.log[1],
        r#"split thread=cfg2 ns="" model=- keys=0"#
    );

    // Without a checkpointer the thread id is still the one given, or none.
    let plain = StateGraph::<S>::new()
        .add_node("n", |_s, ctx: keel_graph::NodeContext| async move {
            Ok(log(&describe(&ctx)))
        })
        .add_edge(START, "n")
        .add_edge("n", END)
        .compile()
        .unwrap();
    let run = plain
        .invoke(SUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.log, [r#"n thread=- ns="" model=- keys=0"#]);
    let run = plain
        .invoke(
            SUpdate::default(),
            &RunConfig::thread("no-saver").with_configurable("model", "big"),
        )
        .await
        .unwrap();
    assert_eq!(
        run.state.log,
        [r#"n thread=no-saver ns="" model=big keys=1"#]
    );
}

/// A checkpointer that counts `get`s (each loads a checkpoint's channel data) and
/// records the size of each `put_many` batch; its first put takes `first_put_delay`.
struct CountingSaver {
    inner: MemorySaver,
    gets: AtomicUsize,
    batches: std::sync::Mutex<Vec<usize>>,
    first_put_delay: Duration,
}

impl CountingSaver {
    fn new(first_put_delay: Duration) -> Self {
        CountingSaver {
            inner: MemorySaver::new(),
            gets: AtomicUsize::new(0),
            batches: std::sync::Mutex::new(Vec::new()),
            first_put_delay,
        }
    }
}

#[async_trait::async_trait]
impl Checkpointer for CountingSaver {
    async fn get(
        &self,
        thread: &keel_checkpoint::ThreadKey,
        id: Option<&keel_checkpoint::CheckpointId>,
    ) -> Result<Option<keel_checkpoint::CheckpointTuple>, keel_checkpoint::CheckpointError> {
        self.gets.fetch_add(1, Ordering::SeqCst);
        self.inner.get(thread, id).await
    }

    fn list<'a>(
        &'a self,
        thread: &'a keel_checkpoint::ThreadKey,
        options: keel_checkpoint::ListOptions,
    ) -> futures::stream::BoxStream<
        'a,
        Result<keel_checkpoint::CheckpointSummary, keel_checkpoint::CheckpointError>,
    > {
        self.inner.list(thread, options)
    }

    async fn put(
        &self,
        request: keel_checkpoint::PutRequest,
    ) -> Result<(), keel_checkpoint::CheckpointError> {
        let first = {
            let mut batches = self.batches.lock().unwrap();
            batches.push(1);
            batches.len() == 1
        };
        if first {
            tokio::time::sleep(self.first_put_delay).await;
        }
        self.inner.put(request).await
    }

    async fn put_many(
        &self,
        requests: Vec<keel_checkpoint::PutRequest>,
    ) -> Result<(), keel_checkpoint::CheckpointError> {
        let first = {
            let mut batches = self.batches.lock().unwrap();
            batches.push(requests.len());
            batches.len() == 1
        };
        if first {
            tokio::time::sleep(self.first_put_delay).await;
        }
        self.inner.put_many(requests).await
    }

    async fn put_writes(
        &self,
        thread: &keel_checkpoint::ThreadKey,
        checkpoint: &keel_checkpoint::CheckpointId,
        writes: Vec<keel_checkpoint::PendingWrite>,
    ) -> Result<(), keel_checkpoint::CheckpointError> {
        self.inner.put_writes(thread, checkpoint, writes).await
    }

    async fn delete_thread(&self, thread_id: &str) -> Result<(), keel_checkpoint::CheckpointError> {
        self.inner.delete_thread(thread_id).await
    }

    async fn prune(
        &self,
        thread: &keel_checkpoint::ThreadKey,
        keep_last: usize,
    ) -> Result<usize, keel_checkpoint::CheckpointError> {
        self.inner.prune(thread, keep_last).await
    }
}

/// `plan`, then `a` and `b` in parallel, then three `work` tasks (one `SendTo` each).
fn fan_graph(cp: Arc<dyn Checkpointer>) -> keel_graph::CompiledGraph<S> {
    StateGraph::<S>::new()
        .add_node("plan", logger("plan"))
        .add_node("b", logger("b"))
        .add_node("a", logger("a"))
        .add_node("work", logger("work"))
        .add_edge(START, "plan")
        .add_edge("plan", "b")
        .add_edge("plan", "a")
        .add_join(&["a", "b"], "fan")
        .add_node("fan", |_s, _c| async { Ok(SUpdate::default()) })
        .add_conditional_edges(
            "fan",
            |_s: &S| (0..3).map(|i| SendTo::new("work", i)).collect::<Vec<_>>(),
            Some(&["work"]),
        )
        .add_edge("work", END)
        .with_checkpointer(cp)
        .compile()
        .unwrap()
}

#[tokio::test]
async fn checkpoint_metadata_records_the_nodes_that_wrote_each_step() {
    let cp = saver();
    let g = fan_graph(Arc::clone(&cp));
    let config = RunConfig::thread("writers");
    g.invoke(log("in"), &config).await.unwrap();
    let writes: Vec<(CheckpointSource, Vec<String>)> = full_history(&g, &config)
        .await
        .into_iter()
        .rev()
        .map(|h| (h.metadata.source, h.metadata.writes))
        .collect();
    let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        writes,
        [
            (CheckpointSource::Input, names(&["__start__"])),
            (CheckpointSource::Loop, names(&["plan"])),
            // Parallel tasks: sorted by name, whatever their order in the graph.
            (CheckpointSource::Loop, names(&["a", "b"])),
            // A node that ran and wrote nothing still ran.
            (CheckpointSource::Loop, names(&["fan"])),
            // Three tasks of one node: named once.
            (CheckpointSource::Loop, names(&["work"])),
        ]
    );

    // update_state records its `as_node`, and nothing without one.
    g.update_state(&config, log("edit"), Some("b"))
        .await
        .unwrap();
    g.update_state(&config, log("note"), None).await.unwrap();
    // As a node the graph does not have: refused, naming the ones it has.
    for missing in ["nope", END] {
        let err = g
            .update_state(&config, log("lost"), Some(missing))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, GraphError::UnknownAsNode { name, nodes }
                if name == missing && nodes.iter().any(|n| n == "plan")),
            "{err:?}"
        );
    }
    let history = full_history(&g, &config).await;
    assert_eq!(history[1].metadata.writes, ["b"]);
    assert_eq!(history[1].metadata.source, CheckpointSource::Update);
    assert!(history[0].metadata.writes.is_empty());

    // Exit durability stores one checkpoint for the whole run: all its writers.
    let exit = RunConfig::thread("writers-exit").with_durability(Durability::Exit);
    g.invoke(log("in"), &exit).await.unwrap();
    let history = full_history(&g, &exit).await;
    assert_eq!(history.len(), 1);
    assert_eq!(
        history[0].metadata.writes,
        ["__start__", "a", "b", "fan", "plan", "work"]
    );

    // Async durability records the same as sync.
    let asynchronous = RunConfig::thread("writers-async").with_durability(Durability::Async);
    g.invoke(log("in"), &asynchronous).await.unwrap();
    let steps: Vec<Vec<String>> = full_history(&g, &asynchronous)
        .await
        .into_iter()
        .rev()
        .map(|h| h.metadata.writes)
        .collect();
    assert_eq!(
        steps,
        writes.into_iter().map(|(_, w)| w).collect::<Vec<_>>()
    );

    // `writes` is the checkpoint's own key: user metadata may not set it.
    let mut clash = RunConfig::thread("writers-clash");
    clash.metadata.insert("writes".into(), json!(["me"]));
    let err = g.invoke(log("in"), &clash).await.unwrap_err();
    assert!(
        matches!(&err, GraphError::Checkpoint(keel_checkpoint::CheckpointError::Invalid { reason }) if reason.contains("writes")),
        "{err:?}"
    );
}

#[tokio::test]
async fn last_checkpoint_by_finds_a_nodes_newest_checkpoint_from_metadata() {
    let counting = Arc::new(CountingSaver::new(Duration::ZERO));
    let cp: Arc<dyn Checkpointer> = counting.clone();
    let g = fan_graph(Arc::clone(&cp));
    let config = RunConfig::thread("by-node");
    for round in 0..20 {
        g.invoke(log(&format!("in{round}")), &config).await.unwrap();
    }
    let history = full_history(&g, &config).await;
    assert_eq!(history.len(), 100);

    // The newest checkpoint `plan` wrote: one list and one get, not one get per
    // checkpoint.
    let gets = counting.gets.load(Ordering::SeqCst);
    let snap = g
        .last_checkpoint_by(&config, "plan")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counting.gets.load(Ordering::SeqCst) - gets, 1);
    assert_eq!(snap.metadata.writes, ["plan"]);
    assert_eq!(snap.checkpoint_id, history[3].checkpoint_id);
    assert_eq!(snap.values.log.last().map(String::as_str), Some("plan"));
    assert_eq!(snap.values.log.len(), history[3].values.log.len());
    assert_eq!(snap.next, ["b", "a"], "in scheduling order");

    // A node among several writers of a step; START is the last input.
    let a = g.last_checkpoint_by(&config, "a").await.unwrap().unwrap();
    assert_eq!(a.checkpoint_id, history[2].checkpoint_id);
    let input = g.last_checkpoint_by(&config, START).await.unwrap().unwrap();
    assert_eq!(input.checkpoint_id, history[4].checkpoint_id);
    assert_eq!(input.metadata.source, CheckpointSource::Input);

    // At or before a point: the point itself when the node wrote it, else older.
    let at_plan = config.clone().at(history[8].checkpoint_id.clone());
    let snap = g
        .last_checkpoint_by(&at_plan, "plan")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(snap.checkpoint_id, history[8].checkpoint_id);
    let before = config.clone().at(history[9].checkpoint_id.clone());
    let gets = counting.gets.load(Ordering::SeqCst);
    let snap = g
        .last_checkpoint_by(&before, "plan")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counting.gets.load(Ordering::SeqCst) - gets, 2);
    assert_eq!(snap.checkpoint_id, history[13].checkpoint_id);
    let oldest = config.clone().at(history[99].checkpoint_id.clone());
    assert!(
        g.last_checkpoint_by(&oldest, "plan")
            .await
            .unwrap()
            .is_none()
    );

    // Nobody of that name, an unknown point, no checkpointer: typed answers.
    assert!(
        g.last_checkpoint_by(&config, "ghost")
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        g.last_checkpoint_by(&RunConfig::thread("empty"), "plan")
            .await
            .unwrap()
            .is_none()
    );
    let unknown = config.clone().at(keel_checkpoint::CheckpointId::new());
    assert!(matches!(
        g.last_checkpoint_by(&unknown, "plan").await,
        Err(GraphError::CheckpointNotFound { .. })
    ));
    assert!(matches!(
        g.last_checkpoint_by(&RunConfig::default(), "plan").await,
        Err(GraphError::CheckpointerRequired {
            what: "last_checkpoint_by"
        })
    ));
}

#[tokio::test]
async fn last_checkpoint_by_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let cp: Arc<dyn Checkpointer> = Arc::new(
        keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("by-node.db"))
            .await
            .unwrap(),
    );
    let g = fan_graph(Arc::clone(&cp));
    let config = RunConfig::thread("by-node");
    g.invoke(log("one"), &config).await.unwrap();
    g.invoke(log("two"), &config).await.unwrap();
    let b = g.last_checkpoint_by(&config, "b").await.unwrap().unwrap();
    assert_eq!(b.metadata.writes, ["a", "b"]);
    assert_eq!(
        b.values.log,
        [
            "one", "plan", "a", "b", "work", "work", "work", "two", "plan", "a", "b"
        ]
    );
}

#[tokio::test]
async fn state_history_is_a_stream_with_before_limit_and_metadata() {
    // 70 steps: more than one page of summaries.
    let g = StateGraph::<S>::new()
        .add_node("step", |s: Arc<S>, _c| async move {
            Ok(log("s").count(s.count + 1))
        })
        .add_edge(START, "step")
        .add_conditional_edges(
            "step",
            |s: &S| if s.count < 70 { "step" } else { END },
            None,
        )
        .with_checkpointer(saver())
        .compile()
        .unwrap();
    let config = RunConfig::thread("pages");
    g.invoke(log("in"), &config).await.unwrap();

    let all = full_history(&g, &config).await;
    assert_eq!(all.len(), 71);
    assert!(
        all.windows(2)
            .all(|w| w[0].checkpoint_id > w[1].checkpoint_id)
    );
    assert!(
        all.iter()
            .enumerate()
            .all(|(i, h)| h.values.count == 70 - i as i64)
    );
    let ids = |h: &[keel_graph::StateSnapshot<S>]| -> Vec<_> {
        h.iter().map(|s| s.checkpoint_id.clone()).collect()
    };
    let page = |options: ListOptions| {
        let g = g.clone();
        let config = config.clone();
        async move {
            g.state_history(&config, options)
                .try_collect::<Vec<_>>()
                .await
                .unwrap()
        }
    };

    assert_eq!(
        ids(&page(ListOptions::default().limit(5)).await),
        ids(&all[..5])
    );
    let older = page(
        ListOptions::default()
            .before(all[40].checkpoint_id.clone())
            .limit(50),
    )
    .await;
    assert_eq!(ids(&older), ids(&all[41..]));
    // Paging with `before` from the last id seen walks the whole history.
    let mut walked = Vec::new();
    let mut options = ListOptions::default().limit(9);
    loop {
        let got = page(options.clone()).await;
        let Some(last) = got.last() else { break };
        options = options.before(last.checkpoint_id.clone());
        walked.extend(got);
    }
    assert_eq!(ids(&walked), ids(&all));
    // Metadata filters, as `Checkpointer::list` takes them.
    let inputs = page(ListOptions::default().metadata("source", json!("input"))).await;
    assert_eq!(ids(&inputs), ids(&all[70..]));
    let by_step = page(ListOptions::default().written_by("step").limit(100)).await;
    assert_eq!(ids(&by_step), ids(&all[..70]));
    let at_step = page(ListOptions::default().metadata("step", json!(3))).await;
    assert_eq!(at_step.len(), 1);
    assert_eq!(at_step[0].values.count, 4);

    // The stream rebuilds states as it is read: taking two reads two.
    let first_two: Vec<_> = g
        .state_history(&config, ListOptions::default())
        .take(2)
        .collect()
        .await;
    assert_eq!(first_two.len(), 2);

    // Without a checkpointer (or a thread) the one item is the error.
    let bare = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_edge(START, "a")
        .add_edge("a", END)
        .compile()
        .unwrap();
    let items: Vec<_> = bare
        .state_history(&config, ListOptions::default())
        .collect()
        .await;
    assert!(
        matches!(
            items.as_slice(),
            [Err(GraphError::CheckpointerRequired {
                what: "state_history"
            })]
        ),
        "{items:?}"
    );
}

/// A state that counts its whole-state copies (its `Clone` impl is the only way to
/// copy all of it).
#[derive(State)]
struct Counted {
    #[reducer(Append<String>)]
    log: Vec<String>,
    #[reducer(Append<String>)]
    notes: Vec<String>,
    big: Vec<u8>,
}

static COUNTED_CLONES: AtomicUsize = AtomicUsize::new(0);

impl Clone for Counted {
    fn clone(&self) -> Self {
        COUNTED_CLONES.fetch_add(1, Ordering::SeqCst);
        Counted {
            log: self.log.clone(),
            notes: self.notes.clone(),
            big: self.big.clone(),
        }
    }
}

#[tokio::test]
async fn routers_of_one_step_each_see_only_their_own_writes_without_copying_the_state() {
    // Three routed nodes in one step: two write `log`, one writes `notes`; each
    // router records what it sees.
    type Seen = Vec<(String, Vec<String>, Vec<String>)>;
    let seen: Arc<std::sync::Mutex<Seen>> = Arc::default();
    let mut g = StateGraph::<Counted>::new();
    for (name, channel) in [("a", "log"), ("b", "log"), ("c", "notes")] {
        let seen = Arc::clone(&seen);
        g = g
            .add_node(name, move |_s, _c| async move {
                let u = CountedUpdate::default();
                Ok(if channel == "log" {
                    u.log(vec![name.to_owned()])
                } else {
                    u.notes(vec![name.to_owned()])
                })
            })
            .add_edge(START, name)
            .add_conditional_edges(
                name,
                move |s: &Counted| {
                    seen.lock()
                        .unwrap()
                        .push((name.to_owned(), s.log.clone(), s.notes.clone()));
                    END
                },
                Some(&[END]),
            );
    }
    let g = g.compile().unwrap();
    let input = CountedUpdate::default()
        .log(vec!["in".to_owned()])
        .big(vec![7; 1 << 20]);
    let before = COUNTED_CLONES.load(Ordering::SeqCst);
    let run = g.invoke(input, &RunConfig::default()).await.unwrap();
    let clones = COUNTED_CLONES.load(Ordering::SeqCst) - before;
    assert_eq!(run.state.log, ["in", "a", "b"]);
    assert_eq!(run.state.notes, ["c"]);
    let v = |items: &[&str]| items.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            ("a".to_owned(), v(&["in", "a"]), v(&[])),
            ("b".to_owned(), v(&["in", "b"]), v(&[])),
            ("c".to_owned(), v(&["in"]), v(&["c"])),
        ]
    );
    // One copy for the step (the state before it), not one more per router.
    assert_eq!(clones, 1, "whole-state copies in the routed step");
}

#[test]
fn invoke_and_stream_outside_a_tokio_runtime_are_a_typed_error() {
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_edge(START, "a")
        .add_edge("a", END)
        .compile()
        .unwrap();
    let invoked = futures::executor::block_on(g.invoke(log("in"), &RunConfig::default()));
    assert!(matches!(invoked, Err(GraphError::NoRuntime)), "{invoked:?}");
    let mut stream = g.stream(log("in"), RunConfig::default(), StreamMode::values());
    let first = futures::executor::block_on(stream.next());
    assert!(matches!(first, Some(Err(GraphError::NoRuntime))));
    assert!(futures::executor::block_on(stream.next()).is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failed_step_keeps_the_steps_before_it_with_every_durability() {
    for durability in [Durability::Sync, Durability::Async, Durability::Exit] {
        let dir = tempfile::tempdir().unwrap();
        let cp: Arc<dyn Checkpointer> = Arc::new(
            keel_checkpoint_sqlite::SqliteSaver::open(dir.path().join("t.db"))
                .await
                .unwrap(),
        );
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let g = {
            let fail = fail.clone();
            StateGraph::<S>::new()
                .add_node("a", logger("a"))
                .add_node("b", logger("b"))
                .add_node("c", move |_s, _c| {
                    let failing = fail.load(Ordering::SeqCst);
                    async move {
                        if failing {
                            Err(NodeError::msg("c is down"))
                        } else {
                            Ok(log("c"))
                        }
                    }
                })
                .add_edge(START, "a")
                .add_edge("a", "b")
                .add_edge("b", "c")
                .add_edge("c", END)
                .with_checkpointer(cp)
                .compile()
                .unwrap()
        };
        let config = RunConfig::thread("t").with_durability(durability);
        let err = g.invoke(log("in"), &config).await.unwrap_err();
        assert!(
            matches!(err, GraphError::Node { .. }),
            "{durability:?}: {err:?}"
        );
        // What `a` and `b` did is stored, and `c` is next.
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert_eq!(snap.values.log, ["in", "a", "b"], "{durability:?}");
        assert_eq!(snap.next, ["c"], "{durability:?}");
        let failed: Vec<_> = snap.errors.iter().map(|e| e.node.as_str()).collect();
        assert_eq!(failed, ["c"], "{durability:?}");
        assert!(
            snap.errors[0].message.contains("c is down"),
            "{durability:?}"
        );
        fail.store(false, Ordering::SeqCst);
        let run = g.invoke(Command::none(), &config).await.unwrap();
        assert_eq!(run.state.log, ["in", "a", "b", "c"], "{durability:?}");
        // The step succeeded: the newest checkpoint carries no error.
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert!(snap.errors.is_empty(), "{durability:?}: {:?}", snap.errors);
    }
}

#[derive(Clone, Debug, State)]
struct Scores {
    score: f64,
    maybe: Option<f64>,
    #[reducer(Append<f32>)]
    samples: Vec<f32>,
}

#[tokio::test]
async fn a_float_json_cannot_hold_is_refused_and_the_thread_stays_readable() {
    let g = StateGraph::<Scores>::new()
        .add_node("score", |s: Arc<Scores>, _c| async move {
            Ok(match s.score as i64 {
                0 => ScoresUpdate::default().score(1.5).maybe(None),
                1 => ScoresUpdate::default().maybe(Some(f64::INFINITY)),
                _ => ScoresUpdate::default().samples(vec![f32::NAN]),
            })
        })
        .add_edge(START, "score")
        .add_edge("score", END)
        .with_checkpointer(saver())
        .compile()
        .unwrap();
    let config = RunConfig::thread("t");
    // Finite floats and a `None` (stored as null too) pass.
    let run = g.invoke(ScoresUpdate::default(), &config).await.unwrap();
    assert_eq!((run.state.score, run.state.maybe), (1.5, None));
    // The node's write is refused (the input before it is stored); an input holding
    // one is refused before anything runs.
    for (input, channel, shown, score) in [
        (ScoresUpdate::default().score(1.0), "maybe", "inf", 1.0),
        (ScoresUpdate::default().score(2.0), "samples", "NaN", 2.0),
        (
            ScoresUpdate::default().score(f64::NEG_INFINITY),
            "score",
            "-inf",
            2.0,
        ),
    ] {
        let err = g.invoke(input, &config).await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(&err, GraphError::State(StateError::Encode { channel: c, .. }) if *c == channel),
            "{err:?}"
        );
        assert!(
            text.contains(&format!("{shown} is not a number JSON can hold")),
            "{text}"
        );
        // The refused value was not stored: the thread reads back.
        let snap = g.get_state(&config).await.unwrap().unwrap();
        assert_eq!((snap.values.score, snap.values.maybe), (score, None));
        assert!(snap.values.samples.is_empty());
    }
}

#[tokio::test]
async fn update_state_as_start_seeds_a_new_thread_that_then_runs() {
    let g = one_logger_saved();
    let config = RunConfig::thread("seeded");
    g.update_state(&config, log("seed"), Some(START))
        .await
        .unwrap();
    let snap = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(snap.values.log, ["seed"]);
    assert_eq!(snap.next, ["a"]);
    assert_eq!(snap.metadata.writes, [START]);
    let run = g.invoke(Command::none(), &config).await.unwrap();
    assert_eq!(run.state.log, ["seed", "a"]);
    // Without `as_node` an edit of a new thread schedules nothing.
    let other = RunConfig::thread("edited");
    g.update_state(&other, log("seed"), None).await.unwrap();
    assert!(g.get_state(&other).await.unwrap().unwrap().next.is_empty());
}

#[tokio::test]
async fn continuing_a_thread_that_has_nothing_stores_nothing_with_every_durability() {
    for durability in [Durability::Sync, Durability::Async, Durability::Exit] {
        let g = one_logger_saved();
        let config = RunConfig::thread("never-started").with_durability(durability);
        let run = g.invoke(Command::<S>::none(), &config).await.unwrap();
        assert!(run.state.log.is_empty(), "{durability:?}");
        assert!(
            g.get_state(&config).await.unwrap().is_none(),
            "{durability:?} stored a checkpoint for a thread that ran nothing"
        );
    }
}

#[tokio::test]
async fn get_state_at_a_checkpoint_the_thread_does_not_hold_is_checkpoint_not_found() {
    let g = one_logger_saved();
    let config = RunConfig::thread("pruned");
    g.invoke(log("in"), &config).await.unwrap();
    let missing = keel_checkpoint::CheckpointId::new();
    let err = g
        .get_state(&config.clone().at(missing.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, GraphError::CheckpointNotFound { thread_id, id } if thread_id == "pruned" && *id == missing),
        "{err:?}"
    );
    // A thread with no checkpoint at all is still `None`.
    assert!(
        g.get_state(&RunConfig::thread("never"))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn thread_ids_no_saver_could_store_alike_are_refused_before_anything_runs() {
    let cp = saver();
    let g = StateGraph::<S>::new()
        .add_node("a", logger("a"))
        .add_edge(START, "a")
        .add_edge("a", END)
        .with_checkpointer(Arc::clone(&cp))
        .compile()
        .unwrap();
    let long = "x".repeat(keel_checkpoint::MAX_THREAD_ID_BYTES + 1);
    for id in ["", "  ", "a\0b", long.as_str()] {
        let config = RunConfig::thread(id);
        let err = g.invoke(log("in"), &config).await.unwrap_err();
        assert!(
            matches!(err, GraphError::BadThreadId { .. }),
            "{id:?}: {err:?}"
        );
        assert!(matches!(
            g.get_state(&config).await,
            Err(GraphError::BadThreadId { .. })
        ));
        let key = keel_checkpoint::ThreadKey::new(id);
        assert!(cp.get(&key, None).await.unwrap().is_none(), "{id:?} stored");
    }
    let longest = "x".repeat(keel_checkpoint::MAX_THREAD_ID_BYTES);
    g.invoke(log("in"), &RunConfig::thread(longest))
        .await
        .unwrap();
}

/// A raised `StopSignal` ends the run between supersteps: the superstep in flight
/// finishes and is stored (with every durability, on a durable saver too), the run
/// reports `stopped` with the nodes due, and the next run goes on from there without
/// running the finished nodes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_stop_signal_ends_the_run_after_the_step_in_flight_and_the_next_run_goes_on() {
    for durability in [Durability::Sync, Durability::Async, Durability::Exit] {
        let sqlite: Arc<dyn Checkpointer> = Arc::new(
            keel_checkpoint_sqlite::SqliteSaver::open_in_memory()
                .await
                .unwrap(),
        );
        for cp in [saver(), sqlite] {
            let stop = keel_graph::StopSignal::new();
            let calls = Arc::new(AtomicUsize::new(0));
            let (signal, counted) = (stop.clone(), Arc::clone(&calls));
            let g = StateGraph::<S>::new()
                .add_node("a", logger("a"))
                .add_node("b", move |_s, _c| {
                    // Raised while `b` works: `b` still finishes and is stored.
                    signal.raise();
                    counted.fetch_add(1, Ordering::SeqCst);
                    futures::future::ready(Ok(log("b")))
                })
                .add_node("c", logger("c"))
                .add_edge(START, "a")
                .add_edge("a", "b")
                .add_edge("b", "c")
                .add_edge("c", END)
                .with_checkpointer(cp)
                .compile()
                .unwrap();
            let config = RunConfig::thread("stopped").with_durability(durability);
            let events: Vec<Event<S>> = g
                .stream(
                    log("in"),
                    config.clone().with_stop(stop.clone()),
                    StreamMode::updates(),
                )
                .map(Result::unwrap)
                .collect()
                .await;
            assert!(
                matches!(events.last(), Some(Event::Done { next, stopped: true, interrupts, .. })
                    if next == &["c"] && interrupts.is_empty()),
                "{durability:?}: {events:?}"
            );
            let stored = g.get_state(&config).await.unwrap().unwrap();
            assert_eq!(stored.values.log, ["in", "a", "b"], "{durability:?}");
            assert_eq!(stored.next, ["c"], "{durability:?}");

            // The signal stays raised: a run given it again stops before any node.
            let again = g
                .invoke(Command::none(), &config.clone().with_stop(stop))
                .await
                .unwrap();
            assert!(again.stopped && again.steps == 0, "{durability:?}");

            let run = g.invoke(Command::none(), &config).await.unwrap();
            assert!(!run.stopped && !run.is_paused(), "{durability:?}");
            assert_eq!(run.state.log, ["in", "a", "b", "c"], "{durability:?}");
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "{durability:?}: `b` ran once"
            );
        }
    }
}

/// A step's updates are streamed once the step is stored: a run whose store is
/// refused (a stale writer) never shows the step it could not store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_the_saver_refused_is_not_streamed() {
    let cp = saver();
    let gate = Arc::new(tokio::sync::Barrier::new(2));
    let make = |gate: Arc<tokio::sync::Barrier>| gated_worker(&cp, gate);
    let config = RunConfig::thread("race-stream");
    make(Arc::new(tokio::sync::Barrier::new(1)))
        .invoke(log("in"), &config)
        .await
        .unwrap();
    let history = full_history(&make(Arc::new(tokio::sync::Barrier::new(1))), &config).await;
    let input_cp = history.last().unwrap().checkpoint_id.clone();
    let (g1, g2) = (make(Arc::clone(&gate)), make(Arc::clone(&gate)));
    let collect = |g: keel_graph::CompiledGraph<S>| {
        let config = config.clone().at(input_cp.clone());
        async move {
            g.stream(Command::none(), config, StreamMode::updates())
                .collect::<Vec<_>>()
                .await
        }
    };
    let (e1, e2) = tokio::join!(collect(g1), collect(g2));
    for events in [e1, e2] {
        let refused = events
            .iter()
            .any(|e| matches!(e, Err(GraphError::Checkpoint(c)) if c.is_conflict()));
        let shown = events
            .iter()
            .any(|e| matches!(e, Ok(Event::Updates { node, .. }) if node == "work"));
        assert_ne!(refused, shown, "{events:?}");
    }
}
