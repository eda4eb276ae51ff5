//! What the fleet tests share: the database (skipped without `DATABASE_URL`, failing
//! under `CI=true`), a scripted echo agent whose every reply is a function of its
//! prompt (optionally with keel-agent's file tools in a directory per thread), gates
//! that hold a model call or a tool call, and a tracker that sees two workers running
//! one thread at once.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_agent::tools::{EDIT_FILE, FileTools, GREP, LS, READ_FILE, WRITE_FILE};
use keel_agent::{Agent, AgentBuilder, AgentInput, AgentState};
use keel_checkpoint::MemorySaver;
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_compaction::CompactionConfig;
use keel_fleet::{Queue, QueueOptions, RunId, RunInfo, RunStatus};
use keel_message::{Message, Role, Tool, ToolCall, ToolError, ToolSpec, tool_fn};
use keel_model::{ChatModel, ChatOptions, ChatResponse, ModelError};
use keel_offload::{Archive, MemoryStore, OffloadStore, ThreadId};
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
    /// A fresh schema `keel_fleet_<test>_<pid>` with the queue's and the saver's
    /// tables. The schemas of fleet tests whose process is gone (killed by a signal, or
    /// failed before dropping its schema) are dropped first.
    pub async fn new(url: &str, test: &str) -> Db {
        let schema = format!("keel_fleet_{test}_{}", std::process::id());
        let db = Db::bare(url, &schema).await;
        db.drop_stale().await;
        db.queue.setup().await.unwrap();
        db.saver.setup().await.unwrap();
        db
    }

    /// Drops `keel_fleet_<test>_<pid>` schemas whose process no longer runs here.
    async fn drop_stale(&self) {
        let client = self.queue.pool().get().await.unwrap();
        let rows = client
            .query(
                r"SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'keel\_fleet\_%'",
                &[],
            )
            .await
            .unwrap();
        for row in rows {
            let name: String = row.get(0);
            // The benchmark's schemas end in a repetition number, not a pid.
            if name.starts_with("keel_fleet_bench_") {
                continue;
            }
            let Some(pid) = name.rsplit('_').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if pid > 1
                && pid != std::process::id()
                && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            {
                eprintln!("dropping the schema {name} of a fleet test process that is gone");
                let _ = client
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                    .await;
            }
        }
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
        .filter(|m| m.role == Role::Tool)
        .find_map(|m| {
            m.text()
                .strip_prefix("echoed ")
                .and_then(|t| t.split(' ').next().map(str::to_owned))
        })
        .and_then(|n| n.parse::<u64>().ok())
        .map_or(0, |n| n + 1)
}

/// The file tool call of step `n`, beside its echo: every fourth step writes a note,
/// the next reads it, the next greps for it, the next lists the notes.
fn file_call(n: u64) -> ToolCall {
    let note = |k: u64| format!("notes/step-{k:03}.md");
    let (name, args) = match n % 4 {
        0 => (
            WRITE_FILE,
            json!({"path": note(n), "content": format!("step {n}\nnote N{n:05}\n")}),
        ),
        1 => (READ_FILE, json!({"path": note(n - 1)})),
        2 => (
            GREP,
            json!({"pattern": format!("N{:05}", n - 2), "path": "notes"}),
        ),
        _ => (LS, json!({"path": "notes"})),
    };
    ToolCall::new(format!("f{n}"), name, args)
}

/// The echo model: calls `echo` with the next number until `steps`, then answers;
/// with `files`, each step also calls a file tool ([`file_call`]).
pub struct EchoModel {
    pub steps: u64,
    pub gate: Option<Arc<Gate>>,
    pub files: bool,
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
            let mut calls = vec![ToolCall::new(
                format!("c{next}"),
                "echo",
                json!({"n": next}),
            )];
            if self.files {
                calls.push(file_call(next));
            }
            Message::assistant(format!("Echoing {next}.")).with_tool_calls(calls)
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
    /// With a directory: the file tools, each thread's rooted in its own
    /// subdirectory ([`thread_file_tools`]), and a file call at every step.
    pub files: Option<PathBuf>,
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
            files: None,
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
        let files = self.files.as_deref().map(thread_file_tools);
        Agent::builder()
            .model(Arc::new(EchoModel {
                steps: self.steps,
                gate: self.model_gate.clone(),
                files: files.is_some(),
            }))
            .profile(ModelProfile::new(
                "echo-model",
                32_000,
                2_000,
                Encoding::Approximate,
            ))
            .tool(Arc::new(echo))
            .tools(files.unwrap_or_default())
            .offload_store(self.store.clone())
            .compaction(
                CompactionConfig::default()
                    .with_every_steps(Some(10))
                    .with_keep_recent_tokens(60),
            )
    }
}

/// keel-agent's file tools (all but `edit_file`), each call served by the tools rooted
/// in `base/<thread id>` (created on first use), so every thread has a directory of its
/// own on any worker of this machine.
///
/// What a worker killed in a tools step leaves behind is cleared before each call, as
/// a deployment has to:
/// * a worker killed after a tools step ran but before it was stored runs the step
///   again on takeover. `write_file` never overwrites, so a write is made replay-safe:
///   a file that already holds exactly the content asked for is removed first and the
///   write answers as the first one did (`edit_file` is left out: it cannot be
///   repeated);
/// * a worker killed inside `write_file` leaves its temporary file
///   (`.keel-write-*`), which `ls` lists (though the file tools' `temp_file` says
///   listings pass over it): such leftovers are removed, and each is logged in
///   [`INTERRUPTED_WRITES`] under `base`.
pub fn thread_file_tools(base: &Path) -> Vec<Arc<dyn Tool>> {
    let template = FileTools::new(base).unwrap().tools();
    template
        .iter()
        .map(|t| t.spec())
        .filter(|spec| spec.name != EDIT_FILE)
        .map(|spec| {
            let name = spec.name.clone();
            let base = base.to_owned();
            Arc::new(tool_fn(spec, move |args, ctx| {
                let dir = base.join(ctx.thread_id().unwrap_or("no-thread"));
                let name = name.clone();
                let base = base.clone();
                async move {
                    std::fs::create_dir_all(&dir).map_err(ToolError::failed)?;
                    remove_interrupted_writes(&base, &dir);
                    if name == WRITE_FILE
                        && let (Some(path), Some(content)) =
                            (args["path"].as_str(), args["content"].as_str())
                        && std::fs::read_to_string(dir.join(path)).is_ok_and(|c| c == content)
                    {
                        std::fs::remove_file(dir.join(path)).map_err(ToolError::failed)?;
                    }
                    let tools = FileTools::new(&dir).map_err(ToolError::failed)?.tools();
                    let tool = tools.into_iter().find(|t| t.spec().name == name).unwrap();
                    tool.call(args, ctx).await
                }
            })) as Arc<dyn Tool>
        })
        .collect()
}

/// The file under the base directory of [`thread_file_tools`] that names each
/// interrupted write's leftover they removed, one a line.
pub const INTERRUPTED_WRITES: &str = "interrupted-writes.log";

/// Removes `write_file`'s temporary files under `dir` and logs them.
fn remove_interrupted_writes(base: &Path, dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_interrupted_writes(base, &path);
        } else if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".keel-write-")
        {
            std::fs::remove_file(&path).unwrap();
            let mut log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(base.join(INTERRUPTED_WRITES))
                .unwrap();
            std::io::Write::write_all(&mut log, format!("{}\n", path.display()).as_bytes())
                .unwrap();
        }
    }
}

/// A thread's archive, record by record, as `[role, text, tool call id]` (ids are
/// random); panics if an id is archived twice or the last record is not found by its
/// id.
pub fn archived(store: Arc<dyn OffloadStore>, thread: &str) -> Vec<Value> {
    let archive = Archive::new(store);
    let id = ThreadId::new(thread).unwrap();
    let records = archive.range(&id, 0..archive.len(&id).unwrap()).unwrap();
    let mut ids = std::collections::HashSet::new();
    for r in &records {
        if let Some(m) = r.message.id.as_deref() {
            assert!(ids.insert(m), "{thread}: message {m} archived twice");
        }
    }
    if let Some(last) = records.last()
        && let Some(m) = last.message.id.as_deref()
    {
        assert_eq!(
            archive.get(&id, m).unwrap().as_ref(),
            Some(last),
            "{thread}"
        );
    }
    records
        .iter()
        .map(|r| {
            json!([
                format!("{:?}", r.message.role),
                r.message.text(),
                r.message.tool_call_id
            ])
        })
        .collect()
}

pub fn goal(thread: &str) -> String {
    format!("Echo the numbers up to the end, for {thread}.")
}

/// The state an uninterrupted run reaches: the same agent on a memory saver.
pub async fn reference(steps: u64, thread: &str, follow_ups: &[&str]) -> Value {
    reference_with(&Echo::new(steps), thread, follow_ups).await
}

/// [`reference`] of an agent with these settings (give it a store and a files
/// directory of its own: the run writes there).
pub async fn reference_with(echo: &Echo, thread: &str, follow_ups: &[&str]) -> Value {
    let agent = echo
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
