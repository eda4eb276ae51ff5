//! The process the crash test kills: runs the loop graph on one thread with the
//! Postgres saver (sync durability), resuming from the thread's last checkpoint.
//!
//! Usage: `crash_child THREAD_ID STEPS` with `DATABASE_URL` and `KEEL_PG_SCHEMA` set.
//! Prints `step K` as each step starts and `done K` at the end; exits 2 on error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::sync::Arc;

use keel_checkpoint::{Checkpointer, ThreadKey};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_graph::{Command, RunConfig};

#[path = "../tests/common/loop_graph.rs"]
mod loop_graph;

use loop_graph::{LoopUpdate, Options};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (thread_id, steps) = match args.as_slice() {
        [thread, steps] => (thread.clone(), steps.parse::<u64>().expect("STEPS")),
        _ => {
            eprintln!("usage: crash_child THREAD_ID STEPS");
            std::process::exit(64);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if let Err(e) = rt.block_on(run(thread_id, steps)) {
        eprintln!("crash_child: {e}");
        std::process::exit(2);
    }
}

async fn run(thread_id: String, steps: u64) -> Result<(), Box<dyn std::error::Error>> {
    let schema = std::env::var("KEEL_PG_SCHEMA")?;
    let config = PostgresConfig::from_env()?.schema(schema)?.pool_size(4);
    let saver = PostgresSaver::connect(&config)?;
    saver.setup().await?;
    let on_step = Arc::new(|count: u64| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "step {count}");
        let _ = out.flush();
    });
    let options = Options {
        stable_ids: true,
        fan_out: true,
    };
    let saver: Arc<dyn Checkpointer> = Arc::new(saver);
    let graph = loop_graph::graph(steps, Some(Arc::clone(&saver)), options, on_step);
    let config = RunConfig::thread(thread_id.clone()).with_recursion_limit(usize::MAX);
    // Fresh input only when the thread has no checkpoint yet; otherwise resume.
    let input: Command<loop_graph::Loop> = match saver.get(&ThreadKey::new(thread_id), None).await?
    {
        None => LoopUpdate::default().into(),
        Some(_) => Command::none(),
    };
    let run = graph.invoke(input, &config).await?;
    println!("done {}", run.state.count);
    Ok(())
}
