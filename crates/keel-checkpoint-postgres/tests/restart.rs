//! PostgreSQL restarted in the middle of a run: the run either reconnects and carries
//! on, or fails with a clear error and then resumes cleanly; the final state equals an
//! uninterrupted run's.
//!
//! It stops and starts the server with `pg_ctl`, so it needs the throwaway cluster of
//! `cargo xtask test` (`KEEL_PG_DATADIR`, `KEEL_PG_CTL`, and `KEEL_PG_RUNAS` as root); with an external
//! `DATABASE_URL` it is skipped, saying why. It is alone in this test binary because a
//! restart cuts every connection to the server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command as Process;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_checkpoint::{Checkpointer, MemorySaver, ThreadKey};
use keel_graph::{Command, RunConfig};

use common::loop_graph::{self, Loop, LoopUpdate, Options};

const STEPS: u64 = 1_500;

fn pg_ctl(data: &str, run_as: &str, args: &[&str]) {
    let program = std::env::var("KEEL_PG_CTL").unwrap_or_else(|_| "pg_ctl".into());
    let mut cmd = if run_as.is_empty() {
        Process::new(&program)
    } else {
        let mut c = Process::new("runuser");
        c.args(["-u", run_as, "--", &program]);
        c
    };
    let status = cmd.arg("-D").arg(data).args(args).status().unwrap();
    assert!(status.success(), "pg_ctl {args:?} failed: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_mid_run_resumes_cleanly() {
    let Some(db) = common::saver("restart").await else {
        return;
    };
    let Ok(data) = std::env::var("KEEL_PG_DATADIR") else {
        eprintln!(
            "restart: skipped: DATABASE_URL names a server this test cannot restart \
             (cargo xtask test's throwaway cluster sets KEEL_PG_DATADIR)"
        );
        db.drop_schema().await;
        return;
    };
    let run_as = std::env::var("KEEL_PG_RUNAS").unwrap_or_default();

    let progress = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&progress);
    let on_step = Arc::new(move |count: u64| seen.store(count, Ordering::SeqCst));
    let options = Options {
        stable_ids: true,
        fan_out: false,
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(db.saver.clone());
    let g = loop_graph::graph(STEPS, Some(Arc::clone(&saver)), options, on_step);
    let config = RunConfig::thread("restarted").with_recursion_limit(usize::MAX);

    // Restart the server once the run is well under way.
    let restarter = {
        let progress = Arc::clone(&progress);
        let data = data.clone();
        let run_as = run_as.clone();
        tokio::task::spawn_blocking(move || {
            while progress.load(Ordering::SeqCst) < 200 {
                std::thread::sleep(Duration::from_millis(5));
            }
            let at = progress.load(Ordering::SeqCst);
            pg_ctl(&data, &run_as, &["-m", "fast", "-w", "-t", "60", "stop"]);
            std::thread::sleep(Duration::from_millis(700));
            let log = format!("{data}/../restart.log");
            pg_ctl(&data, &run_as, &["-w", "-t", "60", "-l", &log, "start"]);
            at
        })
    };

    let mut errors = Vec::new();
    let mut state: Option<Loop> = None;
    for _attempt in 0..600 {
        let input: Command<Loop> = match saver.get(&ThreadKey::new("restarted"), None).await {
            Ok(None) => LoopUpdate::default().into(),
            Ok(Some(_)) => Command::none(),
            Err(e) => {
                errors.push(e.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match g.invoke(input, &config).await {
            Ok(run) => {
                state = Some(run.state);
                break;
            }
            Err(e) => {
                errors.push(e.to_string());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let stopped_at = restarter.await.unwrap();
    assert!(stopped_at < STEPS, "the run ended before the restart");
    let state = state.unwrap_or_else(|| panic!("never resumed; errors: {errors:?}"));
    let mut distinct = errors.clone();
    distinct.sort();
    distinct.dedup();
    eprintln!(
        "restart: server stopped at step {stopped_at}; {} failed attempts before resuming: {distinct:#?}",
        errors.len()
    );
    // Every failure said what went wrong with the database, beyond "db error".
    for e in &errors {
        assert!(e.contains("Postgres"), "unclear error: {e}");
        assert!(
            !e.ends_with("db error"),
            "error without the server's reason: {e}"
        );
    }

    let memory: Arc<dyn Checkpointer> = Arc::new(MemorySaver::new());
    let reference = loop_graph::graph(STEPS, Some(memory), options, Arc::new(|_| {}));
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
        loop_graph::transcript(&expected)
    );
    let stored = g.get_state(&config).await.unwrap().unwrap().values;
    assert_eq!(
        loop_graph::transcript(&stored),
        loop_graph::transcript(&expected)
    );
    db.drop_schema().await;
}
