//! Compaction: per-step engine cost (criterion), trajectory replay (speed and the
//! token / cache-weighted report against the full history), and keel beside Deep
//! Agents' own context management on the same recorded runs.

use std::path::Path;

use anyhow::Result;

use super::report::Row;
use crate::python::Venv;
use crate::util::{cargo, run, run_capture};

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
    deepagents_scored(data, true).map(drop)
}

/// The replay comparison's rows for the one table: keel's three strategies against
/// Deep Agents at each dataset and window, scored by one scorer. Under `--quick` the
/// Deep Agents prompt logs of an earlier `cargo xtask bench compaction` are scored
/// again when they are there (the scores depend only on the recorded runs).
pub fn rows() -> Result<Vec<Row>> {
    let data = crate::util::root().join("../shared/data");
    if !data.exists() {
        return Ok(vec![
            Row::faster(SECTION, "all", "-", None, "Deep Agents", None)
                .note("../shared/data is absent: nothing to replay"),
        ]);
    }
    let reuse = super::quick() && crate::util::root().join(WORK).join("input").exists();
    let out = deepagents_scored(&data, !reuse)?;
    let mut rows = parse_score(&out);
    if reuse {
        for r in &mut rows {
            if r.peer_value.is_some() {
                r.note = format!(
                    "{}{}Deep Agents' prompt logs from an earlier run, scored again in this one",
                    r.note,
                    if r.note.is_empty() { "" } else { "; " }
                );
            }
        }
    }
    Ok(rows)
}

const SECTION: &str = "compaction replay (../shared/data)";

/// One side's figures from a score line.
struct Side {
    tokens: f64,
    cost: f64,
    cacheable: f64,
    recall: f64,
}

fn parse_side(fields: &[&str]) -> Option<Side> {
    // runs turns full→sent saved% full→sent saved% cacheable% over→over goal% recall% ...
    let sent = |f: &str| f.split('→').nth(1)?.parse::<f64>().ok();
    let pct = |f: &str| f.trim_end_matches('%').parse::<f64>().ok();
    Some(Side {
        tokens: sent(fields.get(2)?)?,
        cost: sent(fields.get(4)?)?,
        cacheable: pct(fields.get(6)?)?,
        recall: pct(fields.get(9)?)?,
    })
}

/// Rows from `replay_peer score`'s output.
fn parse_score(out: &str) -> Vec<Row> {
    let mut keel: Vec<(String, String, String, Side)> = Vec::new();
    let mut peer: std::collections::BTreeMap<(String, String), Side> = Default::default();
    let mut notes: std::collections::BTreeMap<(String, String), String> = Default::default();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[1].parse::<u64>().is_err() {
            continue;
        }
        let key = (f[0].to_owned(), f[1].to_owned());
        if f[2] == "keel" {
            if let Some(side) = parse_side(&f[4..]) {
                keel.push((key.0, key.1, f[3].to_owned(), side));
            }
        } else if f[2] == "deepagents" {
            match parse_side(&f[3..]) {
                Some(side) => {
                    peer.insert(key, side);
                }
                None if f[3] != "its" => {
                    notes.insert(key, f[3..].join(" "));
                }
                None => {}
            }
        }
    }
    let mut rows = Vec::new();
    for (dataset, window, strategy, k) in &keel {
        let key = (dataset.clone(), window.clone());
        let p = peer.get(&key);
        let note = notes.get(&key).cloned().unwrap_or_default();
        let workload = |what: &str| format!("{dataset}, window {window}, keel {strategy}: {what}");
        let mut add = |what: &str, unit: &'static str, kv: f64, pv: Option<f64>, smaller: bool| {
            let mut r = Row::faster(SECTION, workload(what), unit, Some(kv), "Deep Agents", pv)
                .note(note.clone());
            if smaller {
                r = r.smaller();
            }
            rows.push(r);
        };
        add("tokens sent", "tokens", k.tokens, p.map(|p| p.tokens), true);
        add(
            "cache-weighted cost",
            "token-equivalents",
            k.cost,
            p.map(|p| p.cost),
            true,
        );
        add(
            "cacheable turns",
            "%",
            k.cacheable,
            p.map(|p| p.cacheable),
            false,
        );
        add(
            "needed-fact recall",
            "%",
            k.recall,
            p.map(|p| p.recall),
            false,
        );
    }
    rows
}

/// Exports the runs, replays them in Deep Agents when `run_peer`, and returns the
/// scorer's output.
fn deepagents_scored(data: &Path, run_peer: bool) -> Result<String> {
    let work = crate::util::root().join(WORK);
    if run_peer && work.exists() {
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
    if !run_peer {
        let mut score = example("score");
        score.args(["--windows", &WINDOWS.join(","), "--peer", "deepagents"]);
        return run_capture(&mut score);
    }
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
    let out = run_capture(&mut score)?;
    print!("{out}");
    Ok(out)
}
