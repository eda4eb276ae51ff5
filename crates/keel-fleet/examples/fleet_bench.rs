//! What the fleet costs: aggregate agent steps per second with 1, 2 and 3 workers
//! taking runs from the queue and archiving into PostgreSQL, beside the same threads
//! run by plain `agent.run` loops (no queue, no leases, an in-memory archive); how long
//! a claim takes; and how many bytes an archived message takes in PostgreSQL and in
//! the file store. A third side, plain loops archiving into PostgreSQL, splits the
//! cost between the archive and the queue.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run --release -p keel-fleet --example fleet_bench -- \
//!     [--threads 200] [--steps 100] [--reps 3] [--concurrency 4]
//! ```
//!
//! (`cargo xtask bench fleet` runs it with these defaults.)
//!
//! Each thread is a scripted echo agent (a model whose reply is a function of its
//! prompt, one tool call per step, then an answer) that compacts every 10 steps, so
//! every milestone archives the steps it replaces. Checkpoints go to PostgreSQL through
//! one pool of 16 connections. A worker holds `--concurrency` runs at once; the plain
//! side runs as many loops as all workers hold slots. Each repetition uses fresh
//! schemas, the sides run back to back, and medians are printed: of the steps/s, and
//! of each repetition's ratio to the plain loops.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use keel_agent::{Agent, AgentBuilder, AgentInput};
use keel_checkpoint::Checkpointer;
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_compaction::CompactionConfig;
use keel_fleet::{Queue, QueueOptions, RunInput, Worker};
use keel_message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::{
    Archive, FsStore, MemoryStore, OffloadStore, PostgresStore, PostgresStoreOptions, ThreadId,
};
use keel_token::{Encoding, ModelProfile};
use serde_json::json;

const GOAL: &str = "Echo until done.";

struct Args {
    threads: usize,
    steps: u64,
    reps: usize,
    concurrency: usize,
}

fn args() -> Args {
    let mut a = Args {
        threads: 200,
        steps: 100,
        reps: 3,
        concurrency: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().and_then(|v| v.parse::<u64>().ok());
        match (flag.as_str(), value) {
            ("--threads", Some(v)) => a.threads = v as usize,
            ("--steps", Some(v)) => a.steps = v,
            ("--reps", Some(v)) => a.reps = (v as usize).max(1),
            ("--concurrency", Some(v)) => a.concurrency = (v as usize).max(1),
            _ => {
                panic!("usage: fleet_bench [--threads N] [--steps N] [--reps N] [--concurrency N]")
            }
        }
    }
    a
}

fn agent(steps: u64, store: Arc<dyn OffloadStore>) -> AgentBuilder {
    let model = PolicyModel::new("echo", move |messages: &[Message], _tools| {
        let next = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Tool)
            .and_then(|m| {
                m.text()
                    .strip_prefix("echoed ")
                    .and_then(|t| t.split(' ').next())
                    .and_then(|t| t.parse::<u64>().ok())
            })
            .map_or(0, |n| n + 1);
        let reply = if next >= steps {
            Message::assistant("Done.")
        } else {
            Message::assistant(format!("Echoing {next}.")).with_tool_calls(vec![ToolCall::new(
                format!("c{next}"),
                "echo",
                json!({"n": next}),
            )])
        };
        Ok(ChatResponse::new(reply, "echo"))
    });
    let echo = tool_fn(
        ToolSpec::new("echo", "Echoes a number.", json!({"type": "object"})),
        |args, _ctx| async move {
            let n = args["n"].as_u64().unwrap_or_default();
            Ok(format!("echoed {n} (ticket TCK-{n:05}, status ok)"))
        },
    );
    Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new(
            "echo-model",
            32_000,
            2_000,
            Encoding::Approximate,
        ))
        .tool(Arc::new(echo))
        .offload_store(store)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                .with_keep_recent_tokens(60),
        )
}

/// A fresh schema with the queue's, the checkpointer's and the archive's tables.
async fn fresh(url: &str, schema: &str) -> (Queue, Arc<PostgresSaver>, Arc<PostgresStore>) {
    let queue = Queue::connect_with(
        url,
        QueueOptions::new().schema(schema).unwrap().pool_size(4),
    )
    .unwrap();
    let client = queue.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
        .await
        .unwrap();
    drop(client);
    queue.setup().await.unwrap();
    let config = PostgresConfig::new(url)
        .unwrap()
        .schema(schema)
        .unwrap()
        .pool_size(16);
    let saver = Arc::new(PostgresSaver::connect(&config).unwrap());
    saver.setup().await.unwrap();
    let options = PostgresStoreOptions::new()
        .schema(schema)
        .unwrap()
        .pool_size(4);
    let store = PostgresStore::connect_with_async(url, options)
        .await
        .unwrap();
    (queue, saver, Arc::new(store))
}

async fn drop_schema(queue: &Queue) {
    let client = queue.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", queue.schema()))
        .await
        .unwrap();
}

/// Records in every thread's archive: each is one message that left the context.
async fn archived(store: Arc<dyn OffloadStore>, threads: usize) -> u64 {
    tokio::task::spawn_blocking(move || {
        let archive = Archive::new(store);
        (0..threads)
            .map(|i| {
                archive
                    .len(&ThreadId::new(format!("t{i}")).unwrap())
                    .unwrap()
            })
            .sum()
    })
    .await
    .unwrap()
}

struct Fleet {
    steps_per_s: f64,
    claims: Vec<Duration>,
    /// Archived messages, and the archive tables' bytes: on disk (heap, TOAST and
    /// indexes) and the stored payload alone.
    messages: u64,
    disk_bytes: u64,
    payload_bytes: u64,
}

/// `workers` workers drain the queue, archiving into the same database.
async fn fleet(url: &str, a: &Args, workers: usize, rep: usize) -> Fleet {
    let schema = format!("keel_fleet_bench_q{workers}_{rep}");
    let (queue, saver, store) = fresh(url, &schema).await;
    for i in 0..a.threads {
        queue
            .submit(&format!("t{i}"), RunInput::new().goal(GOAL))
            .await
            .unwrap();
    }
    let ws: Vec<Worker> = (0..workers)
        .map(|i| {
            Worker::builder(queue.clone(), saver.clone() as Arc<dyn Checkpointer>)
                .agent(agent(a.steps, store.clone()))
                .name(format!("bench{i}"))
                .concurrency(a.concurrency)
                .build()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let reports = futures::future::join_all(ws.iter().map(|w| w.run_until_idle())).await;
    let elapsed = start.elapsed();
    let mut claims = Vec::new();
    let mut done = 0;
    for r in reports {
        let r = r.unwrap();
        done += r.done;
        claims.extend(r.claim_latencies);
    }
    assert_eq!(done, a.threads, "every run finished");
    let messages = archived(store.clone(), a.threads).await;
    let client = queue.pool().get().await.unwrap();
    let row = client
        .query_one(
            &format!(
                "SELECT (pg_total_relation_size('\"{schema}\".keel_offload_files') \
                       + pg_total_relation_size('\"{schema}\".keel_offload_chunks'))::bigint, \
                        (SELECT coalesce(sum(length(data)), 0) FROM \"{schema}\".keel_offload_chunks)::bigint"
            ),
            &[],
        )
        .await
        .unwrap();
    drop(client);
    drop_schema(&queue).await;
    Fleet {
        steps_per_s: (a.threads as u64 * a.steps) as f64 / elapsed.as_secs_f64(),
        claims,
        messages,
        disk_bytes: row.get::<_, i64>(0) as u64,
        payload_bytes: row.get::<_, i64>(1) as u64,
    }
}

/// `loops` plain `agent.run` loops over the same threads: no queue, no leases, the
/// archive in `store`.
/// With `store` `None`, the archive goes to the schema's own `PostgresStore`.
async fn plain(
    url: &str,
    a: &Args,
    loops: usize,
    tag: &str,
    store: Option<Arc<dyn OffloadStore>>,
) -> f64 {
    let schema = format!("keel_fleet_bench_{tag}");
    let (queue, saver, pg) = fresh(url, &schema).await;
    let store = store.unwrap_or(pg);
    let agent = agent(a.steps, store).checkpointer(saver).build().unwrap();
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..loops)
        .map(|_| {
            let agent = agent.clone();
            let next = next.clone();
            let threads = a.threads;
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= threads {
                        break;
                    }
                    let run = agent
                        .run(&format!("t{i}"), AgentInput::new().goal(GOAL))
                        .await
                        .unwrap();
                    assert_eq!(run.answer.as_deref(), Some("Done."));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = start.elapsed();
    drop_schema(&queue).await;
    (a.threads as u64 * a.steps) as f64 / elapsed.as_secs_f64()
}

/// Bytes of the files under `dir` and of the blocks they take on disk.
fn dir_bytes(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut blocks) = (0, 0);
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            let (b, k) = dir_bytes(&entry.path());
            bytes += b;
            blocks += k;
        } else {
            bytes += meta.len();
            blocks += meta.blocks() * 512;
        }
    }
    (bytes, blocks)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn main() {
    let Ok(url) = std::env::var("DATABASE_URL") else {
        eprintln!("fleet_bench: skipped: DATABASE_URL is not set");
        return;
    };
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "fleet_bench: {} threads x {} steps, scripted model, milestone every 10 steps, \
         checkpointer pool 16, {} runs per worker, {} reps (medians)",
        a.threads, a.steps, a.concurrency, a.reps
    );
    println!(
        "{:>7}  {:>13}  {:>13}  {:>11}  {:>13}  {:>13}  {:>9}  {:>9}",
        "workers",
        "fleet steps/s",
        "plain steps/s",
        "fleet/plain",
        "+pg archive/s",
        "archive/plain",
        "claim p50",
        "claim p99"
    );
    rt.block_on(async {
        let mut pg = (0, 0, 0);
        for workers in [1, 2, 3] {
            let mut fleets = Vec::new();
            let mut plains = Vec::new();
            let mut archived_plains = Vec::new();
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            for rep in 0..a.reps {
                let mut f = fleet(&url, &a, workers, rep).await;
                let loops = workers * a.concurrency;
                let p = plain(
                    &url,
                    &a,
                    loops,
                    &format!("p{workers}_{rep}"),
                    Some(Arc::new(MemoryStore::new())),
                )
                .await;
                let ap = plain(&url, &a, loops, &format!("a{workers}_{rep}"), None).await;
                fleets.push(f.steps_per_s);
                plains.push(p);
                archived_plains.push(ap);
                p50.push(percentile(&mut f.claims, 0.50).as_secs_f64() * 1e3);
                p99.push(percentile(&mut f.claims, 0.99).as_secs_f64() * 1e3);
                pg = (f.messages, f.disk_bytes, f.payload_bytes);
            }
            // Ratios within each repetition (the sides ran back to back), then their
            // median: a machine that slows down between repetitions moves both sides.
            let ratio = |a: &[f64], b: &[f64]| {
                median(a.iter().zip(b).map(|(a, b)| 100.0 * a / b).collect())
            };
            let (fleet_ratio, archive_ratio) =
                (ratio(&fleets, &plains), ratio(&archived_plains, &plains));
            let (f, p, ap) = (median(fleets), median(plains), median(archived_plains));
            println!(
                "{workers:>7}  {f:>13.0}  {p:>13.0}  {fleet_ratio:>10.1}%  {ap:>13.0}  {archive_ratio:>12.1}%  {:>7.2}ms  {:>7.2}ms",
                median(p50),
                median(p99)
            );
        }
        // The same threads once more, archived into the file store, for its bytes.
        let dir = tempfile::tempdir().unwrap();
        let fs: Arc<dyn OffloadStore> = Arc::new(FsStore::new(dir.path()).unwrap());
        plain(&url, &a, a.concurrency, "fs", Some(fs.clone())).await;
        let fs_messages = archived(fs, a.threads).await;
        let (fs_bytes, fs_blocks) = dir_bytes(dir.path());
        let per = |bytes: u64, n: u64| bytes as f64 / n.max(1) as f64;
        println!(
            "archived messages: {} in PostgreSQL ({} bytes on disk, {} payload), \
             {fs_messages} in the file store ({fs_blocks} bytes on disk, {fs_bytes} in files)",
            pg.0, pg.1, pg.2
        );
        println!(
            "bytes per archived message: PostgreSQL {:.0} on disk ({:.0} payload), \
             file store {:.0} on disk ({:.0} in files)",
            per(pg.1, pg.0),
            per(pg.2, pg.0),
            per(fs_blocks, fs_messages),
            per(fs_bytes, fs_messages),
        );
    });
}
