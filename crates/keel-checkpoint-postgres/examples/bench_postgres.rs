//! The graph benchmark's loop (keel-graph's `bench_loop`: one node, one ~220-byte
//! message per step through `AddMessages`, sync durability) on the Postgres saver, and a
//! load test of many threads at once. Prints one JSON line per measurement for
//! `cargo xtask bench postgres`.
//!
//! Usage (with `DATABASE_URL` set):
//! * `bench_postgres loop REPS N...`: median steps/s per N over REPS runs, each on a
//!   fresh schema, plus what the last run's thread occupies: the sum of its rows'
//!   `pg_column_size` and `pg_total_relation_size` of the tables (indexes and TOAST
//!   included; the schema holds only that thread);
//! * `bench_postgres load THREADS STEPS POOL`: THREADS runs of STEPS steps at once on a
//!   pool of POOL connections: throughput, p50/p99 step latency, errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Instant;

use keel_checkpoint::Checkpointer;
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_graph::RunConfig;

#[path = "../tests/common/loop_graph.rs"]
mod loop_graph;

use loop_graph::{LoopUpdate, Options};

fn config(schema: &str, pool: usize) -> PostgresConfig {
    PostgresConfig::from_env()
        .expect("DATABASE_URL")
        .schema(schema)
        .unwrap()
        .pool_size(pool)
}

async fn fresh(schema: &str, pool: usize) -> PostgresSaver {
    let saver = PostgresSaver::connect(&config(schema, pool)).unwrap();
    drop_schema(&saver).await;
    saver.setup().await.unwrap();
    saver
}

async fn drop_schema(saver: &PostgresSaver) {
    let client = saver.pool().get().await.unwrap();
    client
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            saver.schema()
        ))
        .await
        .unwrap();
}

async fn relation_bytes(saver: &PostgresSaver) -> i64 {
    let client = saver.pool().get().await.unwrap();
    client
        .query_one(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relkind = 'r' AND c.relname <> 'keel_migrations'",
            &[&saver.schema()],
        )
        .await
        .unwrap()
        .get(0)
}

fn session() -> String {
    std::env::var("KEEL_BENCH_SESSION").unwrap_or_else(|_| "default".into())
}

async fn bench_loop(reps: usize, sizes: &[u64]) {
    let schema = format!("keel_bench_{}", std::process::id());
    for &n in sizes {
        let mut rates = Vec::new();
        let mut storage = None;
        for rep in 0..reps {
            let saver = fresh(&schema, 4).await;
            let cp: Arc<dyn Checkpointer> = Arc::new(saver.clone());
            let g = loop_graph::graph(n, Some(cp), Options::default(), Arc::new(|_| {}));
            let thread = format!("bench-{rep}");
            let config = RunConfig::thread(thread.clone()).with_recursion_limit(usize::MAX);
            let start = Instant::now();
            let run = g.invoke(LoopUpdate::default(), &config).await.unwrap();
            let secs = start.elapsed().as_secs_f64();
            assert_eq!(run.state.count, n);
            rates.push(n as f64 / secs);
            if rep + 1 == reps {
                let rows = saver.thread_storage(&thread).await.unwrap();
                storage = Some((rows, relation_bytes(&saver).await));
            }
            drop_schema(&saver).await;
        }
        rates.sort_by(f64::total_cmp);
        let median = rates[rates.len() / 2];
        let (rows, relations) = storage.unwrap();
        println!(
            "{{\"impl\":\"keel\",\"bench\":\"loop\",\"session\":\"{}\",\"n\":{n},\"steps_per_s\":{median:.0},\"us_per_step\":{:.1},\"row_bytes\":{},\"relation_bytes\":{relations},\"checkpoints\":{},\"deltas\":{},\"snapshots\":{}}}",
            session(),
            1e6 / median,
            rows.total_bytes(),
            rows.checkpoints,
            rows.deltas,
            rows.snapshots
        );
    }
}

async fn bench_load(threads: usize, steps: u64, pool: usize) {
    let schema = format!("keel_load_{}", std::process::id());
    let saver = fresh(&schema, pool).await;
    let cp: Arc<dyn Checkpointer> = Arc::new(saver.clone());
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(threads * steps as usize)));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..threads {
        let last = Arc::new(Mutex::new(None::<Instant>));
        let latencies = Arc::clone(&latencies);
        let on_step = Arc::new(move |_count: u64| {
            let now = Instant::now();
            let mut last = last.lock().unwrap();
            if let Some(prev) = last.replace(now) {
                latencies.lock().unwrap().push(now - prev);
            }
        });
        let g = loop_graph::graph(steps, Some(Arc::clone(&cp)), Options::default(), on_step);
        tasks.spawn(async move {
            let config = RunConfig::thread(format!("load-{t}")).with_recursion_limit(usize::MAX);
            g.invoke(LoopUpdate::default(), &config)
                .await
                .map(|r| r.state.count)
        });
    }
    let mut errors = 0;
    let mut done_steps = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(count)) => done_steps += count,
            Ok(Err(e)) => {
                errors += 1;
                eprintln!("load: run failed: {e}");
            }
            Err(e) => {
                errors += 1;
                eprintln!("load: task failed: {e}");
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 - 1.0) * p).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    println!(
        "{{\"impl\":\"keel\",\"bench\":\"load\",\"session\":\"{}\",\"threads\":{threads},\"steps\":{steps},\"pool\":{pool},\"errors\":{errors},\"total_steps\":{done_steps},\"secs\":{secs:.2},\"steps_per_s\":{:.0},\"p50_ms\":{:.2},\"p99_ms\":{:.2},\"max_ms\":{:.2}}}",
        session(),
        done_steps as f64 / secs,
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    drop_schema(&saver).await;
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    match args.first().map(String::as_str) {
        Some("loop") => {
            let reps = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3);
            let sizes: Vec<u64> = args[2.min(args.len())..]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect();
            rt.block_on(bench_loop(reps, &sizes));
        }
        Some("load") => {
            let n = |i: usize, d: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
            rt.block_on(bench_load(n(1, 200) as usize, n(2, 200), n(3, 16) as usize));
        }
        _ => {
            eprintln!("usage: bench_postgres loop REPS N... | load THREADS STEPS POOL");
            std::process::exit(64);
        }
    }
}
