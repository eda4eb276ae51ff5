//! What the fleet tests share: the database (skipped without `DATABASE_URL`, failing
//! under `CI=true`), a scripted echo agent whose every reply is a function of its
//! prompt, gates that hold a model call or a tool call, and a tracker that sees two
//! workers running one thread at once.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_agent::{Agent, AgentBuilder, AgentInput, AgentState};
use keel_checkpoint::MemorySaver;
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_compaction::CompactionConfig;
use keel_fleet::{Queue, QueueOptions, RunId, RunInfo, RunStatus};
use keel_message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatModel, ChatOptions, ChatResponse, ModelError};
use keel_offload::{MemoryStore, OffloadStore};
use keel_token::{Encoding, ModelProfile};
use serde_json::{Value, json};
use tokio::sync::Notify;

pub fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("keel-fleet postgres tests: skipped: {reason}");
            None
        }
    }
}

/// One test's schema: the queue's tables and the checkpoints, dropped at the end.
pub struct Db {
    pub url: String,
    pub schema: String,
    pub queue: Queue,
    pub saver: Arc<PostgresSaver>,
}

impl Db {
    pub async fn new(url: &str, test: &str) -> Db {
        let schema = format!("keel_fleet_{test}_{}", std::process::id());
        let db = Db::bare(url, &schema).await;
        db.queue.setup().await.unwrap();
        db.saver.setup().await.unwrap();
        db
    }

    /// The schema, emptied, with nothing set up.
    pub async fn bare(url: &str, schema: &str) -> Db {
        let queue = Queue::connect_with(
            url,
            QueueOptions::new().schema(schema).unwrap().pool_size(8),
        )
        .unwrap();
        let config = PostgresConfig::new(url)
            .unwrap()
            .schema(schema)
            .unwrap()
            .pool_size(8);
        let saver = Arc::new(PostgresSaver::connect(&config).unwrap());
        let client = queue.pool().get().await.unwrap();
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .await
            .unwrap();
        drop(client);
        Db {
            url: url.to_owned(),
            schema: schema.to_owned(),
            queue,
            saver,
        }
    }

    /// Runs SQL in the schema (`{s}` is the quoted schema).
    pub async fn sql(&self, sql: &str) -> u64 {
        let client = self.queue.pool().get().await.unwrap();
        client
            .execute(&sql.replace("{s}", &format!("\"{}\"", self.schema)), &[])
            .await
            .unwrap()
    }

    pub async fn drop_schema(self) {
        let client = self.queue.pool().get().await.unwrap();
        client
            .batch_execute(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .await
            .unwrap();
    }
}

/// Holds the call for number `at` until released; `every` holds it on every attempt,
/// otherwise only the first time.
pub struct Gate {
    pub at: u64,
    pub every: bool,
    passed: AtomicBool,
    pub entered: Notify,
    pub entered_count: AtomicUsize,
    release: Notify,
    released: AtomicBool,
}

impl Gate {
    pub fn new(at: u64) -> Arc<Gate> {
        Arc::new(Gate {
            at,
            every: false,
            passed: AtomicBool::new(false),
            entered: Notify::new(),
            entered_count: AtomicUsize::new(0),
            release: Notify::new(),
            released: AtomicBool::new(false),
        })
    }

    pub fn every_time(at: u64) -> Arc<Gate> {
        let mut g = Gate::new(at);
        Arc::get_mut(&mut g).unwrap().every = true;
        g
    }

    async fn pass(&self, n: u64) {
        if n != self.at || self.released.load(Ordering::SeqCst) {
            return;
        }
        if !self.every && self.passed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.entered_count.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        let released = self.release.notified();
        if self.released.load(Ordering::SeqCst) {
            return;
        }
        released.await;
    }

    pub fn release(&self) {
        self.released.store(true, Ordering::SeqCst);
        self.release.notify_waiters();
    }

    /// Waits until a call is held at the gate.
    pub async fn wait_entered(&self) {
        tokio::time::timeout(Duration::from_secs(60), self.entered.notified())
            .await
            .expect("nothing reached the gate in 60 s");
    }
}

/// The number a prompt asks for next: one more than the last echoed number.
fn next_number(messages: &[Message]) -> u64 {
    messages
        .iter()
        .rev()
        .find(|m| m.role == Role::Tool)
        .and_then(|m| {
            m.text()
                .strip_prefix("echoed ")
                .and_then(|t| t.split(' ').next().map(str::to_owned))
        })
        .and_then(|n| n.parse::<u64>().ok())
        .map_or(0, |n| n + 1)
}

/// The echo model: calls `echo` with the next number until `steps`, then answers.
pub struct EchoModel {
    pub steps: u64,
    pub gate: Option<Arc<Gate>>,
}

#[async_trait::async_trait]
impl ChatModel for EchoModel {
    fn model_name(&self) -> &str {
        "echo"
    }

    async fn chat(
        &self,
        messages: &[Message],
        _tools: &[ToolSpec],
        _options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let next = next_number(messages);
        if let Some(gate) = &self.gate {
            gate.pass(next).await;
        }
        let reply = if next >= self.steps {
            Message::assistant(format!("Reached {}.", self.steps))
        } else {
            Message::assistant(format!("Echoing {next}.")).with_tool_calls(vec![ToolCall::new(
                format!("c{next}"),
                "echo",
                json!({"n": next}),
            )])
        };
        Ok(ChatResponse::new(reply, "echo"))
    }
}

/// Who is running a tool of which thread right now; counts overlaps.
#[derive(Default)]
pub struct Tracker {
    active: Mutex<HashMap<String, String>>,
    pub overlaps: AtomicUsize,
    pub calls: AtomicUsize,
}

/// Settings of the test agent.
#[derive(Clone)]
pub struct Echo {
    pub steps: u64,
    pub model_gate: Option<Arc<Gate>>,
    pub tool_gate: Option<Arc<Gate>>,
    pub tracker: Arc<Tracker>,
    pub delay: Duration,
    pub store: Arc<dyn OffloadStore>,
    /// Where each tool call is logged as `(thread, n, pid)`: a pool and the quoted
    /// table name.
    pub log: Option<(deadpool_postgres::Pool, String)>,
}

impl Echo {
    pub fn new(steps: u64) -> Echo {
        Echo {
            steps,
            model_gate: None,
            tool_gate: None,
            tracker: Arc::new(Tracker::default()),
            delay: Duration::from_millis(2),
            store: Arc::new(MemoryStore::new()),
            log: None,
        }
    }

    pub fn model_gate(mut self, gate: Arc<Gate>) -> Echo {
        self.model_gate = Some(gate);
        self
    }

    pub fn tool_gate(mut self, gate: Arc<Gate>) -> Echo {
        self.tool_gate = Some(gate);
        self
    }

    /// The agent of a worker called `label`.
    pub fn agent(&self, label: &str) -> AgentBuilder {
        let tracker = self.tracker.clone();
        let gate = self.tool_gate.clone();
        let delay = self.delay;
        let log = self.log.clone();
        let label = label.to_owned();
        let echo = tool_fn(
            ToolSpec::new("echo", "Echoes a number.", json!({"type": "object"})),
            move |args, ctx| {
                let tracker = tracker.clone();
                let gate = gate.clone();
                let label = label.clone();
                let log = log.clone();
                async move {
                    let n = args["n"].as_u64().unwrap_or_default();
                    let thread = ctx.thread_id().unwrap_or("?").to_owned();
                    if let Some((pool, table)) = &log {
                        let client = pool.get().await.unwrap();
                        client
                            .execute(
                                &format!(
                                    "INSERT INTO {table} (thread, n, pid) VALUES ($1, $2, $3)"
                                ),
                                &[&thread, &(n as i64), &(std::process::id() as i32)],
                            )
                            .await
                            .unwrap();
                    }
                    tracker.calls.fetch_add(1, Ordering::SeqCst);
                    {
                        let mut active = tracker.active.lock().unwrap();
                        if let Some(other) = active.get(&thread)
                            && *other != label
                        {
                            tracker.overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        active.insert(thread.clone(), label.clone());
                    }
                    if let Some(gate) = &gate {
                        gate.pass(n).await;
                    }
                    tokio::time::sleep(delay).await;
                    tracker.active.lock().unwrap().remove(&thread);
                    Ok(format!("echoed {n} (ticket TCK-{n:05}, status ok)"))
                }
            },
        );
        Agent::builder()
            .model(Arc::new(EchoModel {
                steps: self.steps,
                gate: self.model_gate.clone(),
            }))
            .profile(ModelProfile::new(
                "echo-model",
                32_000,
                2_000,
                Encoding::Approximate,
            ))
            .tool(Arc::new(echo))
            .offload_store(self.store.clone())
            .compaction(
                CompactionConfig::default()
                    .with_every_steps(Some(10))
                    .with_keep_recent_tokens(60),
            )
    }
}

pub fn goal(thread: &str) -> String {
    format!("Echo the numbers up to the end, for {thread}.")
}

/// The state an uninterrupted run reaches: the same agent on a memory saver.
pub async fn reference(steps: u64, thread: &str, follow_ups: &[&str]) -> Value {
    let agent = Echo::new(steps)
        .agent("reference")
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()
        .unwrap();
    agent
        .run(thread, AgentInput::new().goal(goal(thread)))
        .await
        .unwrap();
    let mut last = None;
    for m in follow_ups {
        last = Some(
            agent
                .run(thread, AgentInput::new().message(Message::user(*m)))
                .await
                .unwrap(),
        );
    }
    let state = match last {
        Some(run) => run.state,
        None => agent.state(thread).await.unwrap().unwrap(),
    };
    summary(&state)
}

/// What must match between runs: the raw buffer (ids are random, so role, text and
/// tool call id), the milestones and epoch, the step.
pub fn summary(s: &AgentState) -> Value {
    json!({
        "step": s.step,
        "goal": s.goal.as_ref().map(|g| g.text().into_owned()),
        "messages": s.messages.iter().map(|m| json!([
            format!("{:?}", m.role), m.text(), m.tool_call_id,
        ])).collect::<Vec<_>>(),
        "milestones": s.milestones.iter().map(|l| l.text.clone()).collect::<Vec<_>>(),
        "epoch": s.epoch.as_ref().map(|l| l.text.clone()),
        "milestones_made": s.milestones_made,
        "epochs_made": s.epochs_made,
    })
}

/// Every assistant tool call in the raw buffer is answered before the next
/// non-tool message.
pub fn tool_calls_answered(s: &AgentState) -> bool {
    let messages: Vec<&Message> = s.messages.iter().collect();
    for (i, m) in messages.iter().enumerate() {
        for call in &m.tool_calls {
            let answered = messages[i + 1..]
                .iter()
                .take_while(|n| n.role == Role::Tool)
                .any(|n| n.tool_call_id.as_deref() == Some(call.id.as_str()));
            if !answered {
                return false;
            }
        }
    }
    true
}

/// Polls a run until `done(status)` holds (60 s at most).
pub async fn wait_for(
    queue: &Queue,
    run: RunId,
    what: &str,
    done: impl Fn(&RunStatus) -> bool,
) -> RunInfo {
    let start = Instant::now();
    loop {
        let info = queue.status(run).await.unwrap();
        if done(&info.status) {
            return info;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "run {run} not {what} after 60 s: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn is_done(s: &RunStatus) -> bool {
    matches!(s, RunStatus::Done { .. })
}

pub fn is_running(s: &RunStatus) -> bool {
    matches!(s, RunStatus::Running { .. })
}
