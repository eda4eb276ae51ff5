#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Real processes on one file.
//!
//! * `killed_at_random_moments_resumes_to_the_uninterrupted_result`: a child process
//!   runs a graph (two parallel nodes per step, so each step stores task writes before
//!   its checkpoint) with a `SqliteSaver` on a file, and is killed with SIGKILL at random
//!   moments, again and again; each new child resumes the thread with `Command::none()`
//!   (or starts it, if no checkpoint was stored yet). The final state must equal an
//!   uninterrupted run's: no message lost, none duplicated.
//! * `two_processes_racing_on_one_thread_keep_a_linear_history`: two child processes put
//!   steps on the same thread as fast as they can, each retrying after a `Conflict`; the
//!   stored history has no fork and every step of each exactly once.
//!
//! The children are this test binary run again with `--ignored --exact child`: the
//! ignored test `child` does the child's work when `KEEL_SQLITE_CHILD` is set.

mod common;

use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use keel_checkpoint::{Checkpointer, ListOptions, MemorySaver, ThreadKey};
use keel_checkpoint_sqlite::{SqliteOptions, SqliteSaver};
use keel_graph::reducer::{AddMessages, AddMessagesUpdate, Messages};
use keel_graph::{Command, CompiledGraph, END, RunConfig, START, State, StateGraph};
use keel_message::Message;
use serde_json::{Value, json};

const CHILD: &str = "KEEL_SQLITE_CHILD";

#[derive(Clone, State)]
struct Loop {
    #[reducer(AddMessages)]
    messages: Messages,
    count: u64,
}

/// About 220 bytes, unique per node and step.
fn text(node: &str, step: u64) -> String {
    let mut s = format!("{node} step {step}: ");
    while s.len() < 220 {
        s.push_str("the agent read the file, ran the tests and noted the result; ");
    }
    s.truncate(220);
    s
}

/// Nodes `a` and `b` run in parallel every step until `count` reaches `n`; `a` bumps
/// the count, both append a message.
fn graph(n: u64, saver: Arc<dyn Checkpointer>) -> CompiledGraph<Loop> {
    StateGraph::<Loop>::new()
        .add_node("a", |s: Arc<Loop>, _c| async move {
            Ok(LoopUpdate::default()
                .messages(AddMessagesUpdate::append([Message::assistant(text(
                    "a", s.count,
                ))]))
                .count(s.count + 1))
        })
        .add_node("b", |s: Arc<Loop>, _c| async move {
            Ok(
                LoopUpdate::default().messages(AddMessagesUpdate::append([Message::assistant(
                    text("b", s.count),
                )])),
            )
        })
        .add_edge(START, "a")
        .add_edge(START, "b")
        .add_conditional_edges(
            "a",
            move |s: &Loop| if s.count < n { "a" } else { END },
            None,
        )
        .add_conditional_edges(
            "b",
            move |s: &Loop| if s.count < n { "b" } else { END },
            None,
        )
        .with_checkpointer(saver)
        .compile()
        .unwrap()
}

fn summary(state: &Loop) -> Value {
    let texts: Vec<String> = state
        .messages
        .iter()
        .map(|m| m.text().into_owned())
        .collect();
    json!({"count": state.count, "texts": texts})
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child: {name} is not set"))
}

/// The child process's work, chosen by `KEEL_SQLITE_CHILD`.
#[test]
#[ignore = "child process of the crash tests; they run it"]
fn child() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let path = env("KEEL_SQLITE_DB");
    let thread = env("KEEL_SQLITE_THREAD");
    let rt = runtime();
    match role.as_str() {
        "graph" => rt.block_on(async {
            let n: u64 = env("KEEL_SQLITE_STEPS").parse().unwrap();
            // Write-ahead log checkpoints every few steps (in the background, or on
            // the writer at four times this), so kills land in them too.
            let saver = SqliteOptions::default()
                .checkpoint_pages(8)
                .open(&path)
                .await
                .unwrap();
            let g = graph(n, Arc::new(saver.clone()));
            let config = RunConfig::thread(thread.clone()).with_recursion_limit(usize::MAX);
            let started = saver.get(&ThreadKey::new(thread), None).await.unwrap();
            let input = match started {
                Some(_) => Command::none(),
                None => LoopUpdate::default().into(),
            };
            let run = g.invoke(input, &config).await.unwrap();
            println!("{}", summary(&run.state));
        }),
        "racer" => rt.block_on(async {
            let name = env("KEEL_SQLITE_NAME");
            let steps: usize = env("KEEL_SQLITE_STEPS").parse().unwrap();
            let saver = SqliteOptions::default()
                .busy_timeout(Duration::from_secs(30))
                .checkpoint_pages(8)
                .open(&path)
                .await
                .unwrap();
            let thread = ThreadKey::new(thread);
            let (mut wins, mut conflicts) = (0, 0);
            while wins < steps {
                let head = saver.get(&thread, None).await.unwrap().unwrap();
                let item = json!(format!("{name}-{wins}"));
                let request = common::step(&thread, Some(&head.checkpoint), "log", vec![item]);
                match saver.put(request).await {
                    Ok(()) => wins += 1,
                    Err(e) if e.is_conflict() => conflicts += 1,
                    Err(e) => panic!("racer {name}: {e}"),
                }
            }
            println!(
                "{}",
                json!({"name": name, "wins": wins, "conflicts": conflicts})
            );
        }),
        other => panic!("unknown child role {other}"),
    }
}

fn spawn_child(
    role: &str,
    db: &Path,
    thread: &str,
    extra: &[(&str, String)],
    stdout: Stdio,
) -> std::process::Child {
    let mut cmd = Process::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "child",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ])
    .env(CHILD, role)
    .env("KEEL_SQLITE_DB", db)
    .env("KEEL_SQLITE_THREAD", thread)
    .stdin(Stdio::null())
    .stdout(stdout)
    .stderr(Stdio::piped());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// The JSON line a child printed.
fn child_output(child: std::process::Child) -> Value {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("child printed no result:\n{stdout}"));
    serde_json::from_str(line).unwrap()
}

/// A small xorshift generator: the kill times need no more.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The head's step, or `None` for a thread without checkpoints.
fn head_step(rt: &tokio::runtime::Runtime, db: &Path, thread: &str) -> Option<i64> {
    rt.block_on(async {
        let saver = SqliteOptions::default().readers(0).open(db).await.unwrap();
        let head = saver.get(&ThreadKey::new(thread), None).await.unwrap();
        head.map(|t| t.metadata.step)
    })
}

#[test]
fn killed_at_random_moments_resumes_to_the_uninterrupted_result() {
    const STEPS: u64 = 600;
    /// Kills that must land while the child was running steps (it had stored progress).
    const MID_RUN_KILLS: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let rt = runtime();

    // The uninterrupted run.
    let expected = rt.block_on(async {
        let g = graph(STEPS, Arc::new(MemorySaver::new()));
        let config = RunConfig::thread("reference").with_recursion_limit(usize::MAX);
        summary(
            &g.invoke(LoopUpdate::default(), &config)
                .await
                .unwrap()
                .state,
        )
    });
    // `b`'s router reads `b`'s own view of the step (without `a`'s new count), so `b`
    // runs once more than `a`.
    assert_eq!(
        expected["texts"].as_array().unwrap().len(),
        2 * STEPS as usize + 1
    );

    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    eprintln!("kill schedule seed: {seed}");
    let mut rng = Rng(seed);
    let steps = [("KEEL_SQLITE_STEPS", STEPS.to_string())];
    let check = |out: &Value, thread: &str| {
        assert_eq!(out["count"], expected["count"], "thread {thread}");
        let got = out["texts"].as_array().unwrap();
        let mut unique = got.clone();
        unique.sort_by_key(|v| v.to_string());
        unique.dedup();
        assert_eq!(
            unique.len(),
            got.len(),
            "thread {thread}: duplicated messages"
        );
        assert_eq!(
            out, &expected,
            "thread {thread}: final state differs from the uninterrupted run"
        );
    };

    // Threads run one after another: if a run completes between kills (a fast
    // machine), it is checked and the next thread starts.
    let mut thread_no = 0;
    let (mut kills, mut mid_run, mut no_checkpoint, mut completed) = (0, 0, 0, 0);
    let mut last: Option<i64> = None;
    let mut delay_ms = 40u64;
    for _round in 0..400 {
        if mid_run >= MID_RUN_KILLS {
            break;
        }
        let thread = format!("crash-{thread_no}");
        // Nothing reads this child's output: one that reaches the end must not block
        // on a full pipe writing its summary, which would look like a hung run.
        let mut child = spawn_child("graph", &db, &thread, &steps, Stdio::null());
        // Up to `delay_ms`, at microsecond resolution: lands in start-up (opening the
        // file, loading the thread), in a step, in a task's writes, or in a commit.
        std::thread::sleep(Duration::from_micros(rng.next() % (delay_ms * 1000)));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            if !child.wait().unwrap().success() {
                kills += 1;
                let step = head_step(&rt, &db, &thread);
                match (last, step) {
                    (_, None) => no_checkpoint += 1,
                    (Some(prev), Some(now)) if now < prev => {
                        panic!("{thread}: the head went back from step {prev} to {now}")
                    }
                    (prev, Some(now)) if prev != Some(now) => mid_run += 1,
                    _ => {
                        // No progress this round: the child spent it starting up.
                        delay_ms = (delay_ms + 10).min(500);
                    }
                }
                last = step;
                continue;
            }
        }
        // The child finished before the kill: the run is complete.
        let out = child_output(spawn_child("graph", &db, &thread, &steps, Stdio::piped()));
        check(&out, &thread);
        completed += 1;
        thread_no += 1;
        last = None;
    }
    eprintln!(
        "{kills} kills: {mid_run} while running steps, {no_checkpoint} before the thread's first checkpoint; {completed} runs completed between kills"
    );
    assert!(
        mid_run >= MID_RUN_KILLS,
        "only {mid_run} of {kills} kills landed while the child ran steps"
    );

    // The last child runs to the end.
    let thread = format!("crash-{thread_no}");
    let out = child_output(spawn_child("graph", &db, &thread, &steps, Stdio::piped()));
    check(&out, &thread);
}

#[test]
fn two_processes_racing_on_one_thread_keep_a_linear_history() {
    const STEPS: usize = 150;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("race.db");
    let rt = runtime();
    let thread = ThreadKey::new("raced");
    rt.block_on(async {
        let saver = SqliteSaver::open(&db).await.unwrap();
        saver
            .put(common::step(&thread, None, "log", vec![json!("start")]))
            .await
            .unwrap();
    });

    let racers: Vec<_> = ["left", "right"]
        .into_iter()
        .map(|name| {
            let extra = [
                ("KEEL_SQLITE_NAME", name.to_owned()),
                ("KEEL_SQLITE_STEPS", STEPS.to_string()),
            ];
            spawn_child("racer", &db, "raced", &extra, Stdio::piped())
        })
        .collect();
    let outputs: Vec<Value> = racers.into_iter().map(child_output).collect();
    eprintln!("racers: {outputs:?}");

    rt.block_on(async {
        let saver = SqliteSaver::open(&db).await.unwrap();
        let mut history: Vec<_> = saver
            .list(&thread, ListOptions::default())
            .try_collect::<Vec<_>>()
            .await
            .unwrap()
            .into_iter()
            .map(|s| (s.checkpoint.id, s.checkpoint.parent))
            .collect();
        history.reverse();
        assert_eq!(history.len(), 2 * STEPS + 1);
        common::assert_linear(&history);

        let head = saver.get(&thread, None).await.unwrap().unwrap();
        let log = common::fold(&head.channels["log"]);
        assert_eq!(log.len(), 2 * STEPS + 1);
        for name in ["left", "right"] {
            let mine: Vec<&Value> = log
                .iter()
                .filter(|v| v.as_str().is_some_and(|s| s.starts_with(name)))
                .collect();
            let want: Vec<Value> = (0..STEPS).map(|i| json!(format!("{name}-{i}"))).collect();
            assert_eq!(mine, want.iter().collect::<Vec<_>>(), "{name}'s steps");
        }
    });
}
