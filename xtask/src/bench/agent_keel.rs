//! keel's side of `cargo xtask bench agent`: the compacting agent loop on keel's own
//! runtime, the same workload as the LangGraph.js peer
//! (`xtask/peers/langgraphjs-agent/agent.mjs`, whose header spells it out: the graph, the
//! fake model's answers, the tools' output, compaction every 10 agent steps, an epoch
//! every 5 milestones, pruning to the newest 5 checkpoints after each compaction).
//!
//! [`run`] is called once per [`Config`] and returns one [`Measurement`] per repetition;
//! `bench agent` takes the medians and prints them beside the peer's.

use std::path::PathBuf;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use keel_agent::tools::FileTools;
use keel_agent::{Agent, AgentInput};
use keel_checkpoint::{Checkpointer, MemorySaver};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_checkpoint_sqlite::SqliteSaver;
use keel_compaction::CompactionConfig;
use keel_graph::Durability;
use keel_message::{Message, Tool, ToolCall, ToolContext, ToolFuture, ToolSpec};
use keel_model::{ChatResponse, PolicyModel};
use keel_token::{Encoding, ModelProfile};
use serde_json::{Value, json};

/// One configuration of the benchmark.
#[derive(Debug, Clone)]
pub struct Config {
    /// The checkpoint backend: `"memory"`, `"sqlite"` or `"postgres"`.
    pub backend: String,
    /// `"sync"` (a step's checkpoint is durable before the next step starts) or
    /// `"async"` (it is saved while the next step runs).
    pub durability: String,
    /// Agent steps (model calls) in one run; the model ends the run at this step.
    pub steps: u64,
    /// How many times to run it; [`run`] returns one [`Measurement`] each.
    pub reps: u32,
    /// The repository directory the file tools (`ls`, `read_file`, `grep`) work in.
    pub repo: PathBuf,
    /// The PostgreSQL connection string, for `"postgres"` (else `None`).
    pub database_url: Option<String>,
    /// A scratch directory this run may use (e.g. for the SQLite file); it exists.
    pub scratch: PathBuf,
}

/// One run's numbers.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// As in [`Config::backend`].
    pub backend: String,
    /// As in [`Config::durability`].
    pub durability: String,
    /// Agent steps run (model calls).
    pub steps: u64,
    /// Seconds the run took, from the first step to the last durable checkpoint.
    pub wall_s: f64,
    /// `steps / wall_s`.
    pub steps_per_s: f64,
    /// The runtime's own cost per step in µs: wall time less the time spent in the fake
    /// model, the fake summarizer and the tools' bodies, divided by `steps`.
    pub overhead_us_per_step: f64,
    /// Bytes the thread occupies in the backend at the end, divided by `steps` (`None`
    /// for memory, or when not measured).
    pub bytes_per_step: Option<f64>,
    /// Peak resident memory of the process in bytes (`None` when not measured).
    pub peak_rss_bytes: Option<u64>,
    /// Supersteps run (nodes executed: agent, tools, compact, epoch), each one
    /// checkpoint commit; `bench agent` derives commits per step from it.
    pub supersteps: u64,
}

/// Runs keel's compacting agent loop for `config`, `config.reps` times.
pub fn run(config: &Config) -> Result<Vec<Measurement>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
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

/// The peer's fake model: call i answers with one tool call cycling over ls, read_file
/// and grep, and call N ends the run.
fn model(steps: u64, work: Arc<Work>) -> PolicyModel {
    let calls = AtomicU64::new(0);
    PolicyModel::new("bench", move |messages, _tools| {
        let started = Instant::now();
        let i = calls.fetch_add(1, Ordering::Relaxed) + 1;
        let chars: usize = messages.iter().map(|m| m.text().len()).sum();
        let text = format!("step {i}: {} messages, {chars} chars in the prompt", messages.len());
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
            let path = config
                .scratch
                .join(format!("agent-{}-{}-{tag}.sqlite", config.durability, config.steps));
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            Backend::Sqlite(Arc::new(SqliteSaver::open(&path).await?))
        }
        "postgres" => {
            let url = config
                .database_url
                .as_deref()
                .context("the postgres backend needs a database URL")?;
            let saver = PostgresSaver::connect(&PostgresConfig::new(url)?)?;
            saver.setup().await?;
            Backend::Postgres(Arc::new(saver))
        }
        other => bail!("unknown backend `{other}`"),
    })
}

async fn one(config: &Config, tag: &str) -> Result<Measurement> {
    let backend = backend(config, tag).await?;
    let work = Arc::new(Work::default());
    let tools: Vec<Arc<dyn Tool>> = FileTools::new(&config.repo)?
        .read_only()
        .tools()
        .into_iter()
        .map(|inner| {
            Arc::new(Timed {
                inner,
                work: work.clone(),
            }) as Arc<dyn Tool>
        })
        .collect();
    let durability = match config.durability.as_str() {
        "async" => Durability::Async,
        _ => Durability::Sync,
    };
    let agent = Agent::builder()
        .model(Arc::new(model(config.steps, work.clone())))
        .profile(ModelProfile::new("gpt-4o", 128_000, 16_384, Encoding::O200kBase))
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
        .checkpointer(backend.checkpointer())
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
        bail!(
            "keel's run made {} model calls, expected {}",
            run.state.step,
            config.steps
        );
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
    Ok(Measurement {
        backend: config.backend.clone(),
        durability: config.durability.clone(),
        steps,
        wall_s,
        steps_per_s: steps as f64 / wall_s,
        overhead_us_per_step: (wall_s - work_s).max(0.0) * 1e6 / steps as f64,
        bytes_per_step: bytes.map(|b| b as f64 / steps as f64),
        peak_rss_bytes: peak_rss(),
        supersteps,
    })
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
