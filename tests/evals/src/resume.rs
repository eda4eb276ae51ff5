//! Eval 7, `resume-after-kill`: a process killed with SIGKILL right after a
//! compaction resumes, and every later prompt equals the uninterrupted run's.
//!
//! The walk of 30 records runs three times with the same agent: uninterrupted in this
//! process (memory checkpointer and store); then in a child process on a SQLite file
//! and a file offload store, which prints each prompt as it is sent and, at the first
//! prompt holding a milestone (the compaction's checkpoint is stored), stops in its
//! next tool call until the parent kills it with SIGKILL; then in a second child on
//! the same files, which resumes the thread. It passes when the killed child's prompts
//! equal the first ones of the uninterrupted run, the resumed child's prompts equal
//! the rest of them turn for turn (none missing, at most the one in flight repeated),
//! and the resumed run reaches the end.
//!
//! It fails if the compaction's state (milestones, the flushed raw buffer, the step
//! counters) is not durable at the kill, if resuming rebuilds the context differently
//! (a summary re-made, a message duplicated or lost), or if the resumed run cannot
//! continue.
//!
//! The child is whatever command the caller gives ([`run`]); it must call
//! [`child_main`] first thing (the `keel-evals` binary and the integration test do).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_agent::{Agent, AgentInput};
use keel_checkpoint::{Checkpointer, MemorySaver};
use keel_checkpoint_sqlite::SqliteSaver;
use keel_message::{Tool, ToolContext, ToolFuture, ToolSpec};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::{FsStore, MemoryStore, OffloadStore};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::world::{self, Recorder, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "resume-after-kill";
/// Records in the chain.
pub const LEN: usize = 30;
/// The environment variable naming the child's directory.
pub const CHILD_ENV: &str = "KEEL_EVALS_RESUME_CHILD";
/// Set (to anything) in the child that is to be killed.
pub const HANG_ENV: &str = "KEEL_EVALS_RESUME_HANG";
const TURN: &str = "KEEL-EVAL-TURN ";
const COMPACTED: &str = "KEEL-EVAL-COMPACTED";
const THREAD: &str = "resume";
const GOAL: &str =
    "Walk the chain of records to its end and say where it ends. Start at key K-0000.";
/// The longest a child may take.
const CHILD_TIMEOUT: Duration = Duration::from_secs(120);

/// `visit` over the chain, stopping (until killed) once `hang` is set.
struct Visit {
    chain: VisitTool,
    hang: Arc<AtomicBool>,
}

impl Tool for Visit {
    fn spec(&self) -> ToolSpec {
        self.chain.spec()
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            if self.hang.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_secs(3_600)).await;
            }
            self.chain.call(arguments, ctx).await
        })
    }
}

/// The agent of all three runs. With `echo`, each prompt is printed as it is sent; with
/// `hang`, the first prompt holding a milestone is announced and the next tool call
/// stops.
fn agent(
    saver: Arc<dyn Checkpointer>,
    store: Arc<dyn OffloadStore>,
    recorder: Recorder,
    echo: bool,
    hang: bool,
) -> Result<Agent, EvalError> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let model = PolicyModel::new("keel-eval-reader", move |prompt, _tools| {
        let reply = world::reply(prompt);
        recorder.record(prompt, &reply);
        if echo && let Some(turn) = recorder.turns().last() {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{TURN}{}", turn.to_json());
            if hang && turn.layers > 0 && !flag.swap(true, Ordering::SeqCst) {
                let _ = writeln!(out, "{COMPACTED}");
            }
            let _ = out.flush();
        }
        Ok(ChatResponse::new(reply, "keel-eval-reader"))
    });
    Ok(Agent::builder()
        .model(Arc::new(model))
        .profile(world::profile())
        .system("You walk a chain of records with `visit`.")
        .tool(Arc::new(Visit {
            chain: VisitTool::chain(LEN),
            hang: stop,
        }))
        .goal(GOAL)
        .compaction(world::forced())
        .offload_store(store)
        .checkpointer(saver)
        .build()?)
}

/// In a child process (when [`CHILD_ENV`] is set): runs or resumes the walk there and
/// returns `Ok(true)`; otherwise does nothing and returns `Ok(false)`.
pub async fn child_main() -> Result<bool, EvalError> {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return Ok(false);
    };
    let dir = Path::new(&dir);
    let hang = std::env::var_os(HANG_ENV).is_some();
    let saver = SqliteSaver::open(dir.join("agent.sqlite")).await?;
    let store = FsStore::new(dir.join("offload"))?;
    let agent = agent(
        Arc::new(saver),
        Arc::new(store),
        Recorder::default(),
        true,
        hang,
    )?;
    agent.run(THREAD, AgentInput::new()).await?;
    Ok(true)
}

/// Runs a child to its end, or until it announces the compaction when `kill` is set
/// (then it is killed with SIGKILL); returns the prompts it printed.
async fn child(
    mut command: tokio::process::Command,
    dir: &Path,
    kill: bool,
) -> Result<(Vec<Value>, bool), EvalError> {
    command
        .env(CHILD_ENV, dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    if kill {
        command.env(HANG_ENV, "1");
    } else {
        command.env_remove(HANG_ENV);
    }
    let mut process = command
        .spawn()
        .map_err(EvalError::io("starting the child process"))?;
    let stdout = process
        .stdout
        .take()
        .ok_or_else(|| EvalError::Child("no stdout".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    let mut turns = Vec::new();
    let mut killed = false;
    let read = async {
        while let Some(line) = lines
            .next_line()
            .await
            .map_err(EvalError::io("reading the child's output"))?
        {
            if let Some(turn) = line.strip_prefix(TURN) {
                let value: Value = serde_json::from_str(turn).map_err(|e| {
                    EvalError::Child(format!("a prompt line that is not JSON: {e}"))
                })?;
                turns.push(value);
            } else if kill && line == COMPACTED {
                process
                    .start_kill()
                    .map_err(EvalError::io("killing the child"))?; // SIGKILL
                killed = true;
                break;
            }
        }
        let status = process
            .wait()
            .await
            .map_err(EvalError::io("waiting for the child"))?;
        if !killed && !status.success() {
            return Err(EvalError::Child(format!("the child exited with {status}")));
        }
        Ok::<(), EvalError>(())
    };
    tokio::time::timeout(CHILD_TIMEOUT, read)
        .await
        .map_err(|_| EvalError::Child(format!("no end within {} s", CHILD_TIMEOUT.as_secs())))??;
    Ok((turns, killed))
}

/// Runs the eval; `command` makes the command that runs a child (one calling
/// [`child_main`]).
pub async fn run(command: impl Fn() -> tokio::process::Command) -> Result<Outcome, EvalError> {
    let recorder = Recorder::default();
    let expected = agent(
        Arc::new(MemorySaver::new()),
        Arc::new(MemoryStore::new()),
        recorder.clone(),
        false,
        false,
    )?;
    expected.run(THREAD, AgentInput::new()).await?;
    let turns = recorder.turns();
    let expected: Vec<Value> = turns.iter().map(world::Turn::to_json).collect();

    let dir = tempfile::tempdir().map_err(EvalError::io("making a temporary directory"))?;
    let (before, killed) = child(command(), dir.path(), true).await?;
    let (after, _) = child(command(), dir.path(), false).await?;

    let n = expected.len();
    let k = before.len();
    let m = after.len();
    let prefix_equal = k <= n && before[..] == expected[..k];
    // The resumed run's prompts are the last `m` of the uninterrupted run's.
    let start = n.saturating_sub(m);
    let equal = after
        .iter()
        .zip(&expected[start..])
        .filter(|(a, b)| a == b)
        .count();
    let compacted_at_kill = before.last().is_some_and(|t| {
        t["prompt"]
            .as_array()
            .is_some_and(|p| p.iter().any(|m| m[4].is_string()))
    });
    let covered = k + m >= n && k + m <= n + 1;
    let end = json!(format!(
        "Reached the end of the chain at {}.",
        world::key(LEN - 1)
    ));
    let finished = after.last().is_some_and(|t| t["reply"][0] == end);
    let passed =
        killed && compacted_at_kill && prefix_equal && covered && m > 0 && equal == m && finished;
    let detail = format!(
        "uninterrupted {n} prompts; killed with SIGKILL after prompt {k} (the first with a milestone: {compacted_at_kill}); resumed with {m} prompts, {equal} equal to the uninterrupted run's; prompts before the kill equal: {prefix_equal}; reached the end: {finished}"
    );
    Ok(Outcome::new(
        NAME,
        passed,
        equal as f64,
        format!("of {m} prompts after the resume equal"),
        detail,
    )
    .with_transcript(&turns))
}
