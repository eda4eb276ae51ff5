//! keel's side of `cargo xtask bench agent`: the compacting agent loop on keel's own
//! runtime, the same workload as the LangGraph.js peer
//! (`xtask/peers/langgraphjs-agent/agent.mjs`, whose header spells it out): the file
//! tools over a real directory, a fake model answering at once, compaction every 10
//! agent steps and an epoch every 5 milestones (extractive summaries), pruning to the
//! newest 5 checkpoints after each compaction.
//!
//! ```sh
//! cargo run --release -p keel-agent --example bench_agent -- \
//!     memory|sqlite|postgres sync|async|exit STEPS REPS REPO_DIR SCRATCH_DIR
//! ```
//! (`DATABASE_URL` for postgres; `KEEL_BENCH_AGENT_RUNTIME=current_thread` for tokio's
//! one-thread scheduler; `KEEL_BENCH_TIME_SAVER=1` times each saver call and adds
//! `saver` to the output: µs a step awaiting puts, prunes and the rest, where with
//! `async` the puts are awaited by the background writer, off the step's path). Prints
//! one JSON line per repetition.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use keel_agent::tools::FileTools;
use keel_agent::{Agent, AgentInput};
use keel_checkpoint::{
    CheckpointError, CheckpointId, CheckpointSummary, CheckpointTuple, Checkpointer, ListOptions,
    MemorySaver, PendingWrite, PutRequest, ThreadKey,
};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_checkpoint_sqlite::{SqliteOptions, SqliteSaver};
use keel_compaction::CompactionConfig;
use keel_graph::Durability;
use keel_message::{Message, Tool, ToolCall, ToolContext, ToolFuture, ToolSpec};
use keel_model::{ChatResponse, PolicyModel};
use keel_token::{Encoding, ModelProfile};
use serde_json::{Value, json};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Debug, Clone)]
struct Config {
    backend: String,
    durability: String,
    steps: u64,
    reps: u32,
    repo: PathBuf,
    database_url: Option<String>,
    scratch: PathBuf,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [backend, durability, steps, reps, repo, scratch] = args.as_slice() else {
        return Err(
            "usage: bench_agent memory|sqlite|postgres sync|async|exit STEPS REPS REPO SCRATCH"
                .into(),
        );
    };
    let config = Config {
        backend: backend.clone(),
        durability: durability.clone(),
        steps: steps.parse()?,
        reps: reps.parse()?,
        repo: repo.into(),
        database_url: std::env::var("DATABASE_URL").ok(),
        scratch: scratch.into(),
    };
    // Everything checked before anything is made: a typo costs no stray files.
    durability_of(&config.durability)?;
    if !["memory", "sqlite", "postgres"].contains(&config.backend.as_str()) {
        return Err(format!("unknown backend `{}`", config.backend).into());
    }
    // The fake model's calls read these; elsewhere every call would fail and the run
    // would measure error messages instead of the tools.
    for needed in ["Cargo.toml", "crates/keel-message"] {
        if !config.repo.join(needed).exists() {
            return Err(format!(
                "REPO {} has no {needed}: give the keel repository's root",
                config.repo.display()
            )
            .into());
        }
    }
    std::fs::create_dir_all(&config.scratch)?;
    for m in run(&config)? {
        println!("{m}");
    }
    Ok(())
}

/// Runs keel's compacting agent loop for `config`, `config.reps` times.
fn run(config: &Config) -> Result<Vec<Value>> {
    // KEEL_BENCH_AGENT_RUNTIME=current_thread: tokio's one-thread scheduler instead of
    // the multi-thread one `#[tokio::main]` builds (blocking work still goes to its pool).
    let rt = match runtime_flavor()? {
        "current_thread" => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()?;
    rt.block_on(async {
        let mut out = Vec::new();
        // An untimed warm-up, as the peer does.
        let warm = Config {
            steps: 50.min(config.steps),
            ..config.clone()
        };
        one(&warm, "warmup").await?;
        for rep in 0..config.reps {
            out.push(one(config, &format!("rep-{rep}")).await?);
        }
        Ok(out)
    })
}

/// The durability named `name`.
fn durability_of(name: &str) -> Result<Durability> {
    match name {
        "async" => Ok(Durability::Async),
        "exit" => Ok(Durability::Exit),
        "sync" => Ok(Durability::Sync),
        other => Err(format!("unknown durability `{other}`: use sync, async or exit").into()),
    }
}

/// The tokio scheduler the run uses: `multi_thread` (the default) or `current_thread`.
fn runtime_flavor() -> Result<&'static str> {
    match std::env::var("KEEL_BENCH_AGENT_RUNTIME").as_deref() {
        Err(_) | Ok("" | "multi_thread") => Ok("multi_thread"),
        Ok("current_thread") => Ok("current_thread"),
        Ok(other) => Err(format!(
            "KEEL_BENCH_AGENT_RUNTIME is `{other}`: use multi_thread or current_thread"
        )
        .into()),
    }
}

/// Time spent outside keel's runtime: the fake model's and the tools' bodies.
#[derive(Default)]
struct Work {
    nanos: AtomicU64,
}

impl Work {
    fn add(&self, since: Instant) {
        let n = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(n, Ordering::Relaxed);
    }
}

/// A tool whose body is timed as work.
struct Timed {
    inner: Arc<dyn Tool>,
    work: Arc<Work>,
}

impl Tool for Timed {
    fn spec(&self) -> ToolSpec {
        self.inner.spec()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let started = Instant::now();
            let r = self.inner.call(arguments, ctx).await;
            self.work.add(started);
            r
        })
    }
}

/// A tool answering a fixed 3 kB text.
struct Fixed(&'static str);

impl Tool for Fixed {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(self.0, "A fixed answer.", json!({"type": "object"}))
    }

    fn call(&self, _arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            Ok((1..=50)
                .map(|i| format!("{i:>6}\tline {i} of a file with some words in it\n"))
                .collect())
        })
    }
}

/// The peer's fake model: call i answers with one tool call cycling over ls, read_file
/// and grep, and call N ends the run.
fn model(steps: u64, work: Arc<Work>) -> PolicyModel {
    let calls = AtomicU64::new(0);
    PolicyModel::new("bench", move |messages, _tools| {
        let started = Instant::now();
        let i = calls.fetch_add(1, Ordering::Relaxed) + 1;
        let chars: usize = messages.iter().map(|m| m.text().len()).sum();
        let text = format!(
            "step {i}: {} messages, {chars} chars in the prompt",
            messages.len()
        );
        let reply = if i >= steps {
            Message::assistant(format!("done after {steps} steps"))
        } else {
            let call = match i % 3 {
                1 => ToolCall::new(format!("call_{i}"), "ls", json!({"path": "crates"})),
                2 => ToolCall::new(
                    format!("call_{i}"),
                    "read_file",
                    json!({"path": "Cargo.toml", "limit": 50}),
                ),
                _ => ToolCall::new(
                    format!("call_{i}"),
                    "grep",
                    json!({"pattern": "fn ", "path": "crates/keel-message", "max_results": 50}),
                ),
            };
            Message::assistant(text).with_tool_calls(vec![call])
        };
        work.add(started);
        Ok(ChatResponse::new(reply, "bench"))
    })
}

/// Time awaited on each kind of saver call, in nanoseconds.
#[derive(Default)]
struct SaverTimes {
    put: AtomicU64,
    puts: AtomicU64,
    prune: AtomicU64,
    prunes: AtomicU64,
    other: AtomicU64,
}

impl SaverTimes {
    fn add(counter: &AtomicU64, since: Instant) {
        let n = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// µs a step for each kind, and the call counts.
    fn report(&self, steps: u64) -> Value {
        let per_step = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / 1e3 / steps as f64;
        json!({
            "put_us_per_step": per_step(&self.put),
            "puts": self.puts.load(Ordering::Relaxed),
            "prune_us_per_step": per_step(&self.prune),
            "prunes": self.prunes.load(Ordering::Relaxed),
            "other_us_per_step": per_step(&self.other),
        })
    }
}

/// A saver whose calls are timed (`KEEL_BENCH_TIME_SAVER=1`): where a step's waiting goes.
struct TimedSaver {
    inner: Arc<dyn Checkpointer>,
    times: Arc<SaverTimes>,
}

impl TimedSaver {
    async fn timed<T>(&self, counter: &AtomicU64, call: impl Future<Output = T>) -> T {
        let started = Instant::now();
        let out = call.await;
        SaverTimes::add(counter, started);
        out
    }
}

#[async_trait::async_trait]
impl Checkpointer for TimedSaver {
    fn is_durable(&self) -> bool {
        self.inner.is_durable()
    }

    async fn get(
        &self,
        thread: &ThreadKey,
        id: Option<&CheckpointId>,
    ) -> std::result::Result<Option<CheckpointTuple>, CheckpointError> {
        self.timed(&self.times.other, self.inner.get(thread, id))
            .await
    }

    fn list<'a>(
        &'a self,
        thread: &'a ThreadKey,
        options: ListOptions,
    ) -> futures::stream::BoxStream<'a, std::result::Result<CheckpointSummary, CheckpointError>>
    {
        self.inner.list(thread, options)
    }

    async fn put(&self, request: PutRequest) -> std::result::Result<(), CheckpointError> {
        self.times.puts.fetch_add(1, Ordering::Relaxed);
        self.timed(&self.times.put, self.inner.put(request)).await
    }

    async fn put_many(
        &self,
        requests: Vec<PutRequest>,
    ) -> std::result::Result<(), CheckpointError> {
        self.times
            .puts
            .fetch_add(requests.len() as u64, Ordering::Relaxed);
        self.timed(&self.times.put, self.inner.put_many(requests))
            .await
    }

    async fn put_writes(
        &self,
        thread: &ThreadKey,
        checkpoint: &CheckpointId,
        writes: Vec<PendingWrite>,
    ) -> std::result::Result<(), CheckpointError> {
        self.timed(
            &self.times.other,
            self.inner.put_writes(thread, checkpoint, writes),
        )
        .await
    }

    async fn delete_thread(&self, thread_id: &str) -> std::result::Result<(), CheckpointError> {
        self.inner.delete_thread(thread_id).await
    }

    async fn prune(
        &self,
        thread: &ThreadKey,
        keep_last: usize,
    ) -> std::result::Result<usize, CheckpointError> {
        self.times.prunes.fetch_add(1, Ordering::Relaxed);
        self.timed(&self.times.prune, self.inner.prune(thread, keep_last))
            .await
    }
}

enum Backend {
    Memory(Arc<MemorySaver>),
    Sqlite(Arc<SqliteSaver>),
    Postgres(Arc<PostgresSaver>),
}

impl Backend {
    fn checkpointer(&self) -> Arc<dyn Checkpointer> {
        match self {
            Backend::Memory(s) => s.clone(),
            Backend::Sqlite(s) => s.clone(),
            Backend::Postgres(s) => s.clone(),
        }
    }

    async fn bytes(&self, thread: &str) -> Result<Option<u64>> {
        Ok(match self {
            Backend::Memory(_) => None,
            Backend::Sqlite(s) => {
                let stats = s.stats().await?;
                Some(stats.database_bytes.saturating_sub(stats.free_bytes))
            }
            Backend::Postgres(s) => {
                let t = s.thread_storage(thread).await?;
                Some(t.checkpoint_bytes + t.delta_bytes + t.write_bytes + t.head_bytes)
            }
        })
    }
}

async fn backend(config: &Config, tag: &str) -> Result<Backend> {
    Ok(match config.backend.as_str() {
        "memory" => Backend::Memory(Arc::new(MemorySaver::new())),
        "sqlite" => {
            let path = config.scratch.join(format!(
                "agent-{}-{}-{tag}.sqlite",
                config.durability, config.steps
            ));
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            // KEEL_BENCH_SQLITE_IN_PLACE=1: awaited writes run on the caller's worker
            // (`SqliteOptions::block_in_place`, off by default).
            let options = SqliteOptions::default()
                .block_in_place(std::env::var("KEEL_BENCH_SQLITE_IN_PLACE").is_ok());
            Backend::Sqlite(Arc::new(SqliteSaver::open_with(&path, options).await?))
        }
        "postgres" => {
            let url = config
                .database_url
                .as_deref()
                .ok_or("the postgres backend needs DATABASE_URL")?;
            let saver = PostgresSaver::connect(&PostgresConfig::new(url)?)?;
            saver.setup().await?;
            Backend::Postgres(Arc::new(saver))
        }
        other => return Err(format!("unknown backend `{other}`").into()),
    })
}

async fn one(config: &Config, tag: &str) -> Result<Value> {
    let backend = backend(config, tag).await?;
    let work = Arc::new(Work::default());
    // KEEL_BENCH_FIXED_TOOLS=1: tools that answer a fixed text at once, to see the
    // runtime's own cost without the filesystem (a diagnostic, not the benchmark).
    let file_tools = if std::env::var("KEEL_BENCH_FIXED_TOOLS").is_ok() {
        ["ls", "read_file", "grep"]
            .into_iter()
            .map(|name| Arc::new(Fixed(name)) as Arc<dyn Tool>)
            .collect()
    } else {
        FileTools::new(&config.repo)?.read_only().tools()
    };
    let tools: Vec<Arc<dyn Tool>> = file_tools
        .into_iter()
        .map(|inner| {
            Arc::new(Timed {
                inner,
                work: work.clone(),
            }) as Arc<dyn Tool>
        })
        .collect();
    let durability = durability_of(&config.durability)?;
    let times = std::env::var("KEEL_BENCH_TIME_SAVER")
        .is_ok()
        .then(|| Arc::new(SaverTimes::default()));
    let checkpointer = match &times {
        Some(times) => Arc::new(TimedSaver {
            inner: backend.checkpointer(),
            times: times.clone(),
        }),
        None => backend.checkpointer(),
    };
    let agent = Agent::builder()
        .model(Arc::new(model(config.steps, work.clone())))
        .profile(ModelProfile::new(
            "gpt-4o",
            128_000,
            16_384,
            if std::env::var("KEEL_BENCH_APPROX").is_ok() {
                Encoding::Approximate
            } else {
                Encoding::O200kBase
            },
        ))
        .system("You are a coding agent exploring a repository.")
        .goal("Explore the repository and report what its crates do.")
        .tools(tools)
        .retrieval_tools(false)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                .with_epoch_every(5)
                .with_keep_recent_tokens(500)
                .with_max_steps(config.steps + 1),
        )
        .keep_checkpoints(Some(5))
        .durability(durability)
        .checkpointer(checkpointer)
        // The archive in memory, as the peer keeps none: only the checkpointer varies.
        .offload_store(Arc::new(keel_offload::MemoryStore::new()))
        .build()?;
    let thread = format!(
        "bench-{}-{}-{}-{tag}-{}",
        config.backend,
        config.durability,
        config.steps,
        std::process::id()
    );
    reset_peak_rss();
    let started = Instant::now();
    let run = agent.run(&thread, AgentInput::new()).await?;
    let wall_s = started.elapsed().as_secs_f64();
    if run.state.step != config.steps {
        return Err(format!(
            "keel's run made {} model calls, expected {}",
            run.state.step, config.steps
        )
        .into());
    }
    let work_s = work.nanos.load(Ordering::Relaxed) as f64 / 1e9;
    let steps = config.steps;
    let bytes = backend.bytes(&thread).await?;
    let supersteps = agent
        .graph()
        .get_state(&keel_graph::RunConfig::thread(&thread))
        .await?
        .map_or(0, |s| u64::try_from(s.metadata.step.max(0)).unwrap_or(0));
    if let Backend::Postgres(s) = &backend {
        s.delete_thread(&thread).await?;
    }
    let mut out = json!({
        "backend": config.backend,
        "durability": config.durability,
        "runtime": runtime_flavor()?,
        "steps": steps,
        "wall_s": wall_s,
        "steps_per_s": steps as f64 / wall_s,
        "overhead_us_per_step": (wall_s - work_s).max(0.0) * 1e6 / steps as f64,
        "bytes_per_step": bytes.map(|b| b as f64 / steps as f64),
        "peak_rss_bytes": peak_rss(),
        "supersteps": supersteps,
    });
    if let Some(times) = &times {
        out["saver"] = times.report(steps);
    }
    Ok(out)
}

/// Resets the kernel's peak-RSS mark of this process (Linux `clear_refs`).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident memory since the last reset (Linux `VmHWM`).
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
