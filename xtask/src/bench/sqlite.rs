//! SQLite checkpointer throughput: the graph benchmark's self-loop with a `SqliteSaver`
//! on a file, sync durability, beside `MemorySaver` on the same machine, and beside the
//! peers' SQLite savers on the same loop: LangGraph's `langgraph-checkpoint-sqlite`
//! (`xtask/peers/langgraph_loop.py sqlite:SYNC`) and LangGraph.js's
//! `@langchain/langgraph-checkpoint-sqlite` (`xtask/peers/langgraphjs-agent/loop.mjs
//! sqlite:SYNC`). Every side runs journal_mode=WAL with the same `synchronous` setting
//! (FULL and NORMAL): keel through `SqliteOptions`, the peers on the connection they are
//! handed (their savers set WAL themselves and leave `synchronous` alone).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::Value;

use super::graph::{JS_PEER, LANGGRAPH};
use super::report::Row;
use crate::node::NodePeer;
use crate::python::Venv;
use crate::util::{release_example, run_capture};

/// LangGraph's SQLite saver, installed beside `langgraph` in the peer virtualenv.
const LANGGRAPH_SQLITE: &str = "langgraph-checkpoint-sqlite==3.1.2";

/// The sizes the peers run: at N = 20,000 their files would be about 100 times the
/// 2,000-step one (see [`skip_note`]).
const PEER_SIZES: [&str; 2] = ["200", "2000"];

/// The peers' results keyed by (peer, synchronous, N).
type PeerRows = BTreeMap<(&'static str, String, u64), Value>;

/// Runs both peers' SQLite savers at [`PEER_SIZES`], synchronous FULL and NORMAL.
fn peers(reps: &str) -> Result<PeerRows> {
    let venv = Venv::ensure(&[LANGGRAPH, LANGGRAPH_SQLITE])?;
    let js = NodePeer::ensure(JS_PEER)?;
    let mut out = PeerRows::new();
    for sync in ["full", "normal"] {
        let saver = format!("sqlite:{sync}");
        eprintln!(
            "LangGraph {LANGGRAPH_SQLITE} and LangGraph.js SqliteSaver: the loop on a file, \
             WAL, synchronous={sync}, sync durability, N = 200 / 2,000, {reps} repetition(s)"
        );
        let python = run_capture(
            venv.python()
                .args(["xtask/peers/langgraph_loop.py", &saver, reps])
                .args(PEER_SIZES),
        )?;
        let node = run_capture(js.node("loop.mjs").args([&saver, reps]).args(PEER_SIZES))?;
        for (peer, text) in [("LangGraph", python), ("LangGraph.js", node)] {
            for line in text.lines().filter(|l| l.starts_with('{')) {
                let v: Value = serde_json::from_str(line).with_context(|| {
                    format!("{peer}'s SQLite loop printed a line that is not JSON")
                })?;
                let n = v["n"].as_u64().unwrap_or(0);
                out.insert((peer, sync.to_owned(), n), v);
            }
        }
    }
    Ok(out)
}

/// Why `peer` was not run at `n` (beyond [`PEER_SIZES`]): its saver stores every
/// checkpoint with the whole message list, so its file grows with N².
fn skip_note(peer: &'static str, peers: &PeerRows, sync: &str, n: u64) -> String {
    let at_2000 = peers
        .get(&(peer, sync.to_owned(), 2_000))
        .and_then(|v| v["file_bytes"].as_f64())
        .map_or(String::new(), |b| {
            format!(" ({:.0} MB after 2,000 steps)", b / 1e6)
        });
    format!(
        "{peer} not run at N = {}: its SqliteSaver stores every checkpoint with the whole \
         message list, so the file grows with N²{at_2000}; 20,000 steps would write about \
         100 times that",
        super::agent::thousands(n)
    )
}

/// Runs the SQLite benchmark and prints steps/s, per-step cost growth and file size.
pub fn run() -> Result<Vec<Row>> {
    let reps = super::reps("5");
    let full_up_to =
        std::env::var("KEEL_BENCH_SQLITE_FULL_UP_TO").unwrap_or_else(|_| "2000".into());
    eprintln!(
        "keel-checkpoint-sqlite: self-loop on a file, sync durability, N = 200 / 2,000 / 20,000, \
         {reps} repetitions, median (synchronous=FULL up to N = {full_up_to})"
    );
    let out = run_capture(
        release_example("keel-checkpoint-sqlite", "bench_sqlite").args([
            &reps,
            "200",
            "2000",
            "20000",
            "--full-up-to",
            &full_up_to,
        ]),
    )?;
    let mut rows: BTreeMap<(String, String, u64), Value> = BTreeMap::new();
    for line in out.lines().filter(|l| l.starts_with('{')) {
        let v: Value = serde_json::from_str(line).context("bench output is not JSON")?;
        let key = (
            v["saver"].as_str().unwrap_or("?").to_owned(),
            v["synchronous"].as_str().unwrap_or("?").to_owned(),
            v["n"].as_u64().unwrap_or(0),
        );
        rows.insert(key, v);
    }
    println!(
        "{:<8} {:<12} {:>7} {:>12} {:>10} {:>12} {:>10}",
        "saver", "synchronous", "N", "steps/s", "µs/step", "file bytes", "snapshots"
    );
    for ((saver, sync, n), v) in &rows {
        let file = v["file_bytes"]
            .as_u64()
            .map_or("-".into(), |b| b.to_string());
        let snaps = v["snapshots"]
            .as_u64()
            .map_or("-".into(), |s| s.to_string());
        println!(
            "{saver:<8} {sync:<12} {n:>7} {:>12.0} {:>10.2} {file:>12} {snaps:>10}",
            v["steps_per_s"].as_f64().unwrap_or(0.0),
            v["us_per_step"].as_f64().unwrap_or(0.0),
        );
    }
    let peer_reps = super::reps("3");
    let (peers, peers_failed) = match peers(&peer_reps) {
        Ok(p) => (p, None),
        Err(e) => {
            eprintln!("SQLite peers: {e:#}");
            (PeerRows::new(), Some(format!("peers did not run: {e:#}")))
        }
    };
    println!(
        "{:<12} {:>7} {:>12} {:>12} {:>8} {:>14} {:>8} {:>14} {:>14}",
        "synchronous",
        "N",
        "keel st/s",
        "LangGraph",
        "ratio",
        "LangGraph.js",
        "ratio",
        "LG file B",
        "LG.js file B"
    );
    for ((saver, sync, n), v) in &rows {
        if saver != "sqlite" {
            continue;
        }
        let ks = v["steps_per_s"].as_f64().unwrap_or(0.0);
        let cell = |peer: &'static str, key: &str| {
            peers
                .get(&(peer, sync.clone(), *n))
                .and_then(|p| p[key].as_f64())
        };
        let rate = |peer: &'static str| match cell(peer, "steps_per_s") {
            Some(p) if p > 0.0 => (format!("{p:.0}"), format!("{:.0}x", ks / p)),
            _ => ("-".into(), "-".into()),
        };
        let file =
            |peer: &'static str| cell(peer, "file_bytes").map_or("-".into(), |b| format!("{b:.0}"));
        let (lg, lg_ratio) = rate("LangGraph");
        let (js, js_ratio) = rate("LangGraph.js");
        println!(
            "{sync:<12} {n:>7} {ks:>12.0} {lg:>12} {lg_ratio:>8} {js:>14} {js_ratio:>8} {:>14} {:>14}",
            file("LangGraph"),
            file("LangGraph.js")
        );
    }
    let mut table = Vec::new();
    for ((saver, sync, n), v) in &rows {
        if saver != "sqlite" {
            continue;
        }
        let memory = rows
            .iter()
            .find(|((s, _, m), _)| s == "memory" && m == n)
            .and_then(|(_, v)| v["us_per_step"].as_f64());
        let us = v["us_per_step"].as_f64();
        let overhead = match (us, memory) {
            (Some(a), Some(b)) => format!("; {:.1} µs/step over keel's MemorySaver", a - b),
            _ => String::new(),
        };
        let bytes = v["file_bytes"]
            .as_u64()
            .map_or(String::new(), |b| format!("; keel's file {b} bytes"));
        for peer in ["LangGraph", "LangGraph.js"] {
            let p = peers.get(&(peer, sync.clone(), *n));
            let pragmas = format!("WAL, synchronous={} on both sides", sync.to_uppercase());
            let note = match p {
                Some(p) => {
                    let peer_file = p["file_bytes"]
                        .as_u64()
                        .map_or(String::new(), |b| format!(", {peer}'s {b} bytes"));
                    format!("{pragmas}{overhead}{bytes}{peer_file} (WAL checkpointed)")
                }
                None => format!(
                    "{}; {pragmas}{overhead}{bytes}",
                    peers_failed
                        .clone()
                        .unwrap_or_else(|| skip_note(peer, &peers, sync, *n))
                ),
            };
            table.push(
                Row::faster(
                    "graph loop",
                    format!("sqlite ({sync}), N = {n}"),
                    "steps/s",
                    v["steps_per_s"].as_f64(),
                    peer,
                    p.and_then(|p| p["steps_per_s"].as_f64()),
                )
                .note(note),
            );
        }
    }
    let variants: Vec<(String, String)> = rows
        .keys()
        .map(|(s, y, _)| (s.clone(), y.clone()))
        .collect();
    let mut seen = Vec::new();
    for (saver, sync) in variants {
        if seen.contains(&(saver.clone(), sync.clone())) {
            continue;
        }
        seen.push((saver.clone(), sync.clone()));
        let us = |n: u64| {
            rows.get(&(saver.clone(), sync.clone(), n))
                .and_then(|v| v["us_per_step"].as_f64())
        };
        if let (Some(small), Some(large)) = (us(200), us(20_000)) {
            println!(
                "{saver} ({sync}): per-step cost at N=20,000 is {:.2}x that at N=200",
                large / small
            );
        }
        if let Some(bytes) = rows
            .get(&(saver.clone(), sync.clone(), 2_000))
            .and_then(|v| v["file_bytes"].as_u64())
        {
            println!(
                "{saver} ({sync}): file after 2,000 steps (WAL checkpointed): {bytes} bytes ({:.0} bytes/step)",
                bytes as f64 / 2_000.0
            );
        }
    }
    Ok(table)
}
