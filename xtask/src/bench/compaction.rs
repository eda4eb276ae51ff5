//! Compaction: per-step engine cost (criterion), trajectory replay (speed and the
//! token / cache-weighted report against the full history), and keel beside Deep
//! Agents' own context management on the same recorded runs.

use std::path::Path;

use anyhow::Result;

use crate::python::Venv;
use crate::util::{cargo, run};

/// The Deep Agents peer and the LangChain packages its script imports.
const DEEPAGENTS: &[&str] = &[
    "deepagents==0.7.32",
    "langchain==1.5.2",
    "langchain-core==1.8.3",
    "langgraph==1.2.24",
];

/// The windows keel's replay example forces, in tokens.
const WINDOWS: &[&str] = &["8000", "15000", "32000", "128000"];

/// Where the peer's inputs and prompt logs go (under `target/`, never in the repo).
const WORK: &str = "target/bench/deepagents";

/// Runs the compaction benchmarks.
pub fn run_bench() -> Result<()> {
    run(cargo().args([
        "bench",
        "-p",
        "keel-compaction",
        "--bench",
        "step",
        "--",
        "--warm-up-time",
        "1",
        "--measurement-time",
        "3",
    ]))?;
    let data = crate::util::root().join("../shared/data");
    if data.exists() {
        run(cargo().args([
            "run",
            "--release",
            "-q",
            "-p",
            "keel-compaction",
            "--example",
            "replay",
        ]))?;
        if let Err(e) = deepagents_peer(&data) {
            eprintln!("keel vs Deep Agents: not compared: {e:#}");
        }
    } else {
        eprintln!("skipped the replay: {} is absent", data.display());
    }
    Ok(())
}

/// keel vs Deep Agents: the runs are exported as OpenAI messages, a real
/// `create_deep_agent` replays each at each window (`xtask/peers/deepagents_replay.py`
/// logs every prompt its model received), and keel-compaction's `replay_peer` example
/// scores those prompts with `score_prompts` beside keel's replay. A peer that cannot
/// be installed or run makes its rows say why; the bench goes on.
fn deepagents_peer(data: &Path) -> Result<()> {
    let work = crate::util::root().join(WORK);
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    let example = |mode: &str| {
        let mut c = cargo();
        c.args([
            "run",
            "--release",
            "-q",
            "-p",
            "keel-compaction",
            "--example",
            "replay_peer",
            "--",
            mode,
            "--work",
            WORK,
            "--data",
        ])
        .arg(data);
        c
    };
    run(&mut example("export"))?;
    let unavailable = match Venv::ensure(DEEPAGENTS) {
        Err(e) => Some(format!("deepagents could not be installed ({e:#})")),
        Ok(venv) => {
            eprintln!(
                "Deep Agents {}: replaying each run in a real create_deep_agent at windows {}",
                DEEPAGENTS[0],
                WINDOWS.join(", ")
            );
            match run(venv
                .python()
                .args(["xtask/peers/deepagents_replay.py", WORK])
                .args(WINDOWS))
            {
                Ok(()) => None,
                // Whatever it logged before it stopped is still scored; runs without a
                // log say so in their row.
                Err(e) => {
                    eprintln!("the Deep Agents peer stopped: {e:#}");
                    None
                }
            }
        }
    };
    let mut score = example("score");
    score.args(["--windows", &WINDOWS.join(","), "--peer", "deepagents"]);
    if let Some(why) = unavailable {
        score.args(["--peer-unavailable", &why]);
    }
    run(&mut score)
}
