//! What the queue costs: aggregate agent steps per second with 1, 2 and 3 workers
//! taking runs from the queue, beside the same threads run by as many plain
//! `agent.run` loops (no queue, no leases), and how long a claim takes.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run --release -p keel-fleet --example fleet_bench -- [--threads 50] [--steps 40] [--reps 3]
//! ```
//!
//! Each thread is a scripted echo agent (a model whose reply is a function of its
//! prompt, one tool call per step, then an answer), checkpointed in PostgreSQL through
//! a pool of 16 connections. Each repetition uses a fresh schema; medians are printed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use keel_agent::{Agent, AgentBuilder, AgentInput};
use keel_checkpoint::Checkpointer;
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_fleet::{Queue, QueueOptions, RunInput, Worker};
use keel_message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::MemoryStore;
use keel_token::{Encoding, ModelProfile};
use serde_json::json;

struct Args {
    threads: usize,
    steps: u64,
    reps: usize,
}

fn args() -> Args {
    let mut a = Args {
        threads: 50,
        steps: 40,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().and_then(|v| v.parse::<u64>().ok());
        match (flag.as_str(), value) {
            ("--threads", Some(v)) => a.threads = v as usize,
            ("--steps", Some(v)) => a.steps = v,
            ("--reps", Some(v)) => a.reps = v as usize,
            _ => panic!("usage: fleet_bench [--threads N] [--steps N] [--reps N]"),
        }
    }
    a
}

fn agent(steps: u64) -> AgentBuilder {
    let model = PolicyModel::new("echo", move |messages: &[Message], _tools| {
        let next = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Tool)
            .and_then(|m| {
                m.text()
                    .strip_prefix("echoed ")
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
        |args, _ctx| async move { Ok(format!("echoed {}", args["n"])) },
    );
    Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new(
            "echo-model",
            128_000,
            4_000,
            Encoding::Approximate,
        ))
        .tool(Arc::new(echo))
        .offload_store(Arc::new(MemoryStore::new()))
}

async fn fresh(url: &str, schema: &str) -> (Queue, Arc<PostgresSaver>) {
    let queue = Queue::connect_with(
        url,
        QueueOptions::new().schema(schema).unwrap().pool_size(8),
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
    (queue, saver)
}

async fn drop_schema(queue: &Queue) {
    let client = queue.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", queue.schema()))
        .await
        .unwrap();
}

struct Sample {
    steps_per_s: f64,
    claims: Vec<Duration>,
}

/// `workers` workers (one run at a time each) drain the queue.
async fn with_queue(url: &str, a: &Args, workers: usize, rep: usize) -> Sample {
    let schema = format!("keel_fleet_bench_q{workers}_{rep}");
    let (queue, saver) = fresh(url, &schema).await;
    for i in 0..a.threads {
        queue
            .submit(&format!("t{i}"), RunInput::new().goal("Echo until done."))
            .await
            .unwrap();
    }
    let ws: Vec<Worker> = (0..workers)
        .map(|i| {
            Worker::builder(queue.clone(), saver.clone() as Arc<dyn Checkpointer>)
                .agent(agent(a.steps))
                .name(format!("bench{i}"))
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
    drop_schema(&queue).await;
    Sample {
        steps_per_s: (a.threads as u64 * a.steps) as f64 / elapsed.as_secs_f64(),
        claims,
    }
}

/// `loops` plain `agent.run` loops over the same threads, no queue.
async fn without_queue(url: &str, a: &Args, loops: usize, rep: usize) -> Sample {
    let schema = format!("keel_fleet_bench_p{loops}_{rep}");
    let (queue, saver) = fresh(url, &schema).await;
    let agent = agent(a.steps).checkpointer(saver).build().unwrap();
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
                        .run(&format!("t{i}"), AgentInput::new().goal("Echo until done."))
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
    Sample {
        steps_per_s: (a.threads as u64 * a.steps) as f64 / elapsed.as_secs_f64(),
        claims: Vec::new(),
    }
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
        "fleet_bench: {} threads x {} steps, scripted model, checkpointer pool 16, {} reps (medians)",
        a.threads, a.steps, a.reps
    );
    println!(
        "{:>7}  {:>13}  {:>13}  {:>11}  {:>9}  {:>9}",
        "workers", "queue steps/s", "plain steps/s", "queue/plain", "claim p50", "claim p99"
    );
    rt.block_on(async {
        for workers in [1, 2, 3] {
            let mut queued = Vec::new();
            let mut plain = Vec::new();
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            for rep in 0..a.reps {
                let mut q = with_queue(&url, &a, workers, rep).await;
                let p = without_queue(&url, &a, workers, rep).await;
                queued.push(q.steps_per_s);
                plain.push(p.steps_per_s);
                p50.push(percentile(&mut q.claims, 0.50).as_secs_f64() * 1e3);
                p99.push(percentile(&mut q.claims, 0.99).as_secs_f64() * 1e3);
            }
            let (q, p) = (median(queued), median(plain));
            println!(
                "{workers:>7}  {q:>13.0}  {p:>13.0}  {:>10.1}%  {:>7.2}ms  {:>7.2}ms",
                100.0 * q / p,
                median(p50),
                median(p99)
            );
        }
    });
}
