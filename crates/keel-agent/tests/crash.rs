//! A real process killed mid-run: `killed_at_random_moments_the_agent_resumes_to_the_uninterrupted_result`
//! runs the compacting agent in a child process on a SQLite file and a file offload
//! store, kills it with SIGKILL at random moments again and again (often inside a
//! compaction), and lets each new child continue the thread. The final state must equal
//! an uninterrupted run's — the same raw messages, milestones and epoch — and every
//! step that left the context must be in the archive.
//!
//! The child is this test binary run again with `--ignored --exact child`: the ignored
//! test `child` does the work when `KEEL_AGENT_CHILD` is set.

#![cfg(feature = "fs")] // the child keeps its offload store in files
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use keel_agent::{Agent, AgentInput, AgentState};
use keel_checkpoint::{Checkpointer, MemorySaver};
use keel_checkpoint_sqlite::SqliteSaver;
use keel_compaction::CompactionConfig;
use keel_message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::{Archive, FsStore, MemoryStore, OffloadStore, Pattern, ThreadId};
use keel_token::{Encoding, ModelProfile};
use serde_json::{Value, json};

const CHILD: &str = "KEEL_AGENT_CHILD";
const STEPS: u64 = 80;
const THREAD: &str = "crash";

/// A model that reads its prompt: it echoes one more than the last number a tool
/// result reported (the newest step always stays in the prompt), and answers at the end.
fn model() -> PolicyModel {
    PolicyModel::new("reader", |messages, _tools| {
        let last = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Tool)
            .and_then(|m| {
                m.text()
                    .strip_prefix("echoed ")
                    .and_then(|t| t.split(' ').next().map(str::to_owned))
            })
            .and_then(|n| n.parse::<u64>().ok());
        let next = last.map_or(0, |n| n + 1);
        let reply = if next >= STEPS {
            Message::assistant(format!("Reached {STEPS}."))
        } else {
            Message::assistant(format!("Echoing {next}.")).with_tool_calls(vec![ToolCall::new(
                format!("c{next}"),
                "echo",
                json!({"n": next}),
            )])
        };
        Ok(ChatResponse::new(reply, "reader"))
    })
}

fn agent(saver: Arc<dyn Checkpointer>, store: Arc<dyn OffloadStore>) -> Agent {
    let echo = tool_fn(
        ToolSpec::new("echo", "Echoes a number.", json!({"type": "object"})),
        |args, _ctx| async move {
            // A little time per step, so kills land everywhere.
            tokio::time::sleep(Duration::from_millis(10)).await;
            let n = args["n"].as_u64().unwrap_or_default();
            Ok(format!("echoed {n} (ticket TCK-{n:05}, status ok)"))
        },
    );
    Agent::builder()
        .model(Arc::new(model()))
        .profile(ModelProfile::new(
            "crash-model",
            32_000,
            2_000,
            Encoding::Approximate,
        ))
        .goal("Echo the numbers up to the end.")
        .tool(Arc::new(echo))
        .offload_store(store)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(5))
                .with_keep_recent_tokens(60)
                .with_epoch_every(3),
        )
        .checkpointer(saver)
        .build()
        .unwrap()
}

/// What must match: the raw buffer (ids are random per process, so role, text and
/// tool call id), the milestones and the epoch, the step.
fn summary(s: &AgentState) -> Value {
    json!({
        "step": s.step,
        "messages": s.messages.iter().map(|m| json!([
            format!("{:?}", m.role), m.text(), m.tool_call_id,
        ])).collect::<Vec<_>>(),
        "milestones": s.milestones.iter().map(|l| l.text.clone()).collect::<Vec<_>>(),
        "epoch": s.epoch.as_ref().map(|l| l.text.clone()),
        "milestones_made": s.milestones_made,
        "epochs_made": s.epochs_made,
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The child process's work: continue (or start) the thread and print its summary.
#[test]
#[ignore = "child process of the crash test; it runs it"]
fn child() {
    let Ok(dir) = std::env::var(CHILD) else {
        return;
    };
    let dir = Path::new(&dir);
    runtime().block_on(async {
        let saver = SqliteSaver::open(dir.join("agent.sqlite")).await.unwrap();
        let store = FsStore::new(dir.join("offload")).unwrap();
        let agent = agent(Arc::new(saver), Arc::new(store));
        let run = agent.run(THREAD, AgentInput::new()).await.unwrap();
        println!("{}", summary(&run.state));
    });
}

fn nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos().into())
}

fn spawn(dir: &Path) -> std::process::Child {
    Process::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child", "--nocapture", "--quiet"])
        .env(CHILD, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn killed_at_random_moments_the_agent_resumes_to_the_uninterrupted_result() {
    // The uninterrupted run, in this process.
    let expected = runtime().block_on(async {
        let agent = agent(Arc::new(MemorySaver::new()), Arc::new(MemoryStore::new()));
        let run = agent.run(THREAD, AgentInput::new()).await.unwrap();
        assert_eq!(run.answer, Some(format!("Reached {STEPS}.")));
        summary(&run.state)
    });
    assert!(expected["epochs_made"].as_u64().unwrap() >= 2, "{expected}");

    let dir = tempfile::tempdir().unwrap();
    let mut kills = 0;
    while kills < 20 {
        let mut child = spawn(dir.path());
        std::thread::sleep(Duration::from_millis(30 + nanos() % 150));
        match child.try_wait().unwrap() {
            Some(_) => break, // finished before the kill
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                kills += 1;
            }
        }
    }
    let out = spawn(dir.path()).wait_with_output().unwrap();
    assert!(out.status.success(), "the last child failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no summary in the child's output: {text}"));
    let got: Value = serde_json::from_str(line).unwrap();
    assert!(kills >= 5, "only {kills} kills landed before the run ended");
    assert_eq!(got, expected, "after {kills} kills");

    // Nothing lost: every echo that left the context is in the archive.
    let store: Arc<dyn OffloadStore> = Arc::new(FsStore::new(dir.path().join("offload")).unwrap());
    let archive = Archive::new(store);
    let thread = ThreadId::new(THREAD).unwrap();
    let raw: Vec<&str> = got["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m[2].as_str())
        .collect();
    for n in 0..STEPS {
        let id = format!("c{n}");
        if raw.contains(&id.as_str()) {
            continue;
        }
        let pattern = Pattern::literal(&format!("TCK-{n:05}")).unwrap();
        let found = archive.grep(&thread, &pattern, 10).unwrap();
        assert!(
            !found.messages.is_empty(),
            "step {n} left the context but is not archived"
        );
    }
}
