//! kill -9 crash test: a child process runs the loop graph on one thread with the
//! Postgres saver and is killed with SIGKILL at random moments (during startup, during
//! steps, and just after a step starts, while its writes and checkpoint are being
//! stored), then resumed, at least 20 times. The final state must equal an
//! uninterrupted run's: no message lost, none duplicated, one checkpoint per step.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use futures::TryStreamExt;
use keel_checkpoint::{Checkpointer, ListOptions, MemorySaver, ThreadKey};
use keel_graph::RunConfig;

use common::loop_graph::{self, LoopUpdate, Options};

const KILLS: usize = 24;
const STEPS: u64 = 500;

/// The `crash_child` example, built beside this test (cargo builds examples with tests).
fn child_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile_dir
        .join("examples")
        .join(format!("crash_child{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test` (which builds examples) or `cargo build -p keel-checkpoint-postgres --example crash_child` first",
        path.display()
    );
    path
}

enum Line {
    Step,
    Done,
    Closed,
}

fn spawn(bin: &PathBuf, url: &str, schema: &str, thread: &str) -> (Child, mpsc::Receiver<Line>) {
    let mut child = Command::new(bin)
        .args([thread, &STEPS.to_string()])
        .env("DATABASE_URL", url)
        .env("KEEL_PG_SCHEMA", schema)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let msg = if line.starts_with("done") {
                Line::Done
            } else {
                Line::Step
            };
            if tx.send(msg).is_err() {
                return;
            }
        }
        let _ = tx.send(Line::Closed);
    });
    (child, rx)
}

#[test]
fn kill_9_at_random_moments_loses_and_duplicates_nothing() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some(db) = rt.block_on(common::saver("crash")) else {
        return;
    };
    let bin = child_binary();
    let mut rng = common::Rng::from_env("crash");
    let thread = "crash 'thread' \"one\"";

    let mut kills = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        assert!(runs < 200, "too many runs");
        let (mut child, lines) = spawn(&bin, &db.url, &db.schema, thread);
        if kills >= KILLS {
            let status = child.wait().unwrap();
            assert!(status.success(), "final run failed: {status}");
            break;
        }
        // Pick a moment: a random time after start (often during connect/setup/load),
        // or just after the k-th step starts (during its writes and checkpoint).
        let mut finished = false;
        if rng.below(3) == 0 {
            std::thread::sleep(Duration::from_micros(rng.below(60_000)));
        } else {
            let k = 1 + rng.below(12);
            let mut seen = 0;
            while seen < k {
                match lines.recv_timeout(Duration::from_secs(60)) {
                    Ok(Line::Step) => seen += 1,
                    Ok(Line::Done) | Ok(Line::Closed) => {
                        finished = true;
                        break;
                    }
                    Err(e) => panic!("child silent for 60 s: {e}"),
                }
            }
            std::thread::sleep(Duration::from_micros(rng.below(3_000)));
        }
        let running = child.try_wait().unwrap().is_none();
        if running {
            child.kill().unwrap(); // SIGKILL
            kills += 1;
        }
        let status = child.wait().unwrap();
        if !running || finished {
            assert!(
                kills >= KILLS,
                "the run finished after only {kills} kills ({status}); raise STEPS"
            );
        }
    }

    rt.block_on(async {
        let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
        let options = Options {
            stable_ids: true,
            fan_out: true,
        };
        let noop = Arc::new(|_| {});
        let g = loop_graph::graph(STEPS, Some(Arc::clone(&saver)), options, noop.clone());
        let config = RunConfig::thread(thread).with_recursion_limit(usize::MAX);
        let state = g.get_state(&config).await.unwrap().unwrap().values;

        // The same run, uninterrupted, in memory.
        let memory: Arc<dyn Checkpointer> = Arc::new(MemorySaver::new());
        let reference = loop_graph::graph(STEPS, Some(memory), options, noop);
        let expected = reference
            .invoke(
                LoopUpdate::default(),
                &RunConfig::thread("reference").with_recursion_limit(usize::MAX),
            )
            .await
            .unwrap()
            .state;
        assert_eq!(state.count, STEPS);
        assert_eq!(
            loop_graph::transcript(&state),
            loop_graph::transcript(&expected),
            "messages differ from an uninterrupted run"
        );
        assert_eq!(state.messages.len() as u64, 2 * STEPS - 1);

        // One checkpoint per step: a linear history with no step stored twice.
        let history: Vec<_> = saver
            .list(&ThreadKey::new(thread), ListOptions::default())
            .try_collect()
            .await
            .unwrap();
        let steps: Vec<i64> = history.iter().rev().map(|s| s.metadata.step).collect();
        let expected_steps: Vec<i64> = (-1..steps.len() as i64 - 1).collect();
        assert_eq!(steps, expected_steps, "steps stored twice or skipped");
        for pair in history.windows(2) {
            assert_eq!(
                pair[0].checkpoint.parent.as_ref(),
                Some(&pair[1].checkpoint.id),
                "history is not one chain"
            );
        }
        eprintln!(
            "crash: {kills} kills over {runs} runs; {} checkpoints",
            history.len()
        );
    });
    rt.block_on(db.drop_schema());
}
