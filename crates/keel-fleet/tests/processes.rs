//! A fleet of worker *processes* killed with SIGKILL and restarted:
//! `killed_worker_processes_lose_nothing_and_never_share_a_thread` submits 10 threads of
//! 30 steps, runs three worker processes (two slots each) on one PostgreSQL, kills one
//! at random moments again and again and starts a new one in its place. Every thread
//! must finish with the state of an uninterrupted run (raw messages, milestones,
//! epoch), everything that left a context must be in the archive (in the same
//! database), and no thread may have been run by two processes at once: the tool log
//! of each thread, in order, must never return to a process after another one took
//! over.
//!
//! The workers are this test binary run again with `--ignored --exact worker_process`:
//! the ignored test does the work when `KEEL_FLEET_CHILD` is set. Without
//! `DATABASE_URL` the test prints why it is skipped (fails under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::process::{Child, Command as Process, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Db, Echo, database_url, goal, reference, summary};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_fleet::{Queue, QueueOptions, RunInput, RunStatus, Worker};
use keel_offload::{Archive, OffloadStore, Pattern, PostgresOptions, PostgresStore, ThreadId};

const CHILD: &str = "KEEL_FLEET_CHILD";
const STEPS: u64 = 30;
const THREADS: usize = 10;
const PROCESSES: usize = 3;
const KILLS: usize = 12;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn store(url: &str, schema: &str) -> PostgresStore {
    PostgresStore::connect_with(
        url,
        PostgresOptions::new().schema(schema).unwrap().pool_size(4),
    )
    .unwrap()
}

fn echo(url: &str, schema: &str, log: Option<(deadpool_postgres::Pool, String)>) -> Echo {
    let mut echo = Echo::new(STEPS);
    echo.store = Arc::new(store(url, schema));
    echo.delay = Duration::from_millis(40);
    echo.log = log;
    echo
}

/// A worker process: runs until it is killed.
#[test]
#[ignore = "a worker process of the fleet test; it runs it"]
fn worker_process() {
    let Ok(schema) = std::env::var(CHILD) else {
        return;
    };
    let url = std::env::var("DATABASE_URL").unwrap();
    let queue = Queue::connect_with(
        &url,
        QueueOptions::new()
            .schema(schema.clone())
            .unwrap()
            .pool_size(6),
    )
    .unwrap();
    let config = PostgresConfig::new(&url)
        .unwrap()
        .schema(schema.clone())
        .unwrap()
        .pool_size(6);
    let saver = Arc::new(PostgresSaver::connect(&config).unwrap());
    let log = (queue.pool().clone(), format!("\"{schema}\".fleet_log"));
    let echo = echo(&url, &schema, Some(log));
    let name = format!("p{}", std::process::id());
    let worker = Worker::builder(queue, saver)
        .agent(echo.agent(&name))
        .name(name)
        .concurrency(2)
        .lease(Duration::from_secs(3))
        .heartbeat(Duration::from_millis(250))
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    runtime().block_on(async {
        worker.run(std::future::pending()).await.unwrap();
    });
}

fn spawn(url: &str, schema: &str) -> Child {
    Process::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "worker_process",
            "--nocapture",
            "--quiet",
        ])
        .env(CHILD, schema)
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos().into())
}

#[test]
fn killed_worker_processes_lose_nothing_and_never_share_a_thread() {
    let Some(url) = database_url() else { return };
    let rt = runtime();
    let (db, runs) = rt.block_on(async {
        let db = Db::new(&url, "procs").await;
        db.sql(
            "CREATE TABLE {s}.fleet_log (id bigserial PRIMARY KEY, thread text NOT NULL, \
             n bigint NOT NULL, pid integer NOT NULL)",
        )
        .await;
        let mut runs = Vec::new();
        for i in 0..THREADS {
            let t = format!("thread-{i}");
            runs.push((
                t.clone(),
                db.queue
                    .submit(&t, RunInput::new().goal(goal(&t)))
                    .await
                    .unwrap(),
            ));
        }
        (db, runs)
    });
    // The offload tables, before the workers race to create them.
    drop(store(&url, &db.schema));

    let all_done = |db: &Db| {
        rt.block_on(async {
            let mut done = 0;
            for (_, run) in &runs {
                if matches!(
                    db.queue.status(*run).await.unwrap().status,
                    RunStatus::Done { .. }
                ) {
                    done += 1;
                }
            }
            done == runs.len()
        })
    };

    let mut children: Vec<Child> = (0..PROCESSES).map(|_| spawn(&url, &db.schema)).collect();
    let start = Instant::now();
    let mut kills = 0;
    loop {
        std::thread::sleep(Duration::from_millis(300 + nanos() % 500));
        if all_done(&db) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the fleet did not finish in 300 s ({kills} kills)"
        );
        if kills < KILLS {
            let i = (nanos() as usize) % children.len();
            children[i].kill().unwrap(); // SIGKILL
            children[i].wait().unwrap();
            children[i] = spawn(&url, &db.schema);
            kills += 1;
        }
    }
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(
        kills >= 5,
        "only {kills} kills landed before the fleet finished"
    );

    rt.block_on(async {
        let reader = Echo::new(STEPS)
            .agent("reader")
            .checkpointer(db.saver.clone())
            .build()
            .unwrap();
        let archive = Archive::new(Arc::new(store(&url, &db.schema)) as Arc<dyn OffloadStore>);
        let mut takeovers = 0;
        for (thread, run) in &runs {
            let info = db.queue.status(*run).await.unwrap();
            match &info.status {
                RunStatus::Done { result, .. } => {
                    assert_eq!(result.answer.as_deref(), Some("Reached 30."), "{thread}");
                }
                other => panic!("{thread}: {other:?}"),
            }
            if info.attempts > 1 {
                takeovers += 1;
            }
            let state = reader.state(thread).await.unwrap().unwrap();
            let got = summary(&state);
            assert_eq!(got, reference(STEPS, thread, &[]).await, "{thread}");
            // Nothing lost: each echo that left the context is in the archive.
            let raw: Vec<String> = state
                .messages
                .iter()
                .filter_map(|m| m.tool_call_id.clone())
                .collect();
            let id = ThreadId::new(thread.as_str()).unwrap();
            for n in 0..STEPS {
                if raw.contains(&format!("c{n}")) {
                    continue;
                }
                let pattern = Pattern::literal(&format!("TCK-{n:05}")).unwrap();
                let found = archive.grep(&id, &pattern, 10).unwrap();
                assert!(
                    !found.messages.is_empty(),
                    "{thread}: step {n} left the context but is not archived"
                );
            }
        }
        assert!(takeovers >= 1, "no run was taken over ({kills} kills)");

        // No thread went back to a process after another took it over.
        let client = db.queue.pool().get().await.unwrap();
        let rows = client
            .query(
                &format!(
                    "SELECT thread, pid FROM \"{}\".fleet_log ORDER BY id",
                    db.schema
                ),
                &[],
            )
            .await
            .unwrap();
        let mut segments: HashMap<String, Vec<i32>> = HashMap::new();
        for row in &rows {
            let pids = segments.entry(row.get(0)).or_default();
            let pid: i32 = row.get(1);
            if pids.last() != Some(&pid) {
                assert!(
                    !pids.contains(&pid),
                    "thread {} went back to process {pid} after {pids:?}",
                    row.get::<_, String>(0)
                );
                pids.push(pid);
            }
        }
        let moved = segments.values().filter(|p| p.len() > 1).count();
        eprintln!(
            "fleet: {kills} kills, {takeovers} runs taken over, {moved} threads moved between processes, {} tool calls",
            rows.len()
        );
        drop(client);
        db.drop_schema().await;
    });
}
