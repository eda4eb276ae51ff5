//! SQLite checkpointer throughput: the graph benchmark's self-loop with a `SqliteSaver`
//! on a file, sync durability, beside `MemorySaver` on the same machine.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::Value;

use super::report::Row;
use crate::util::{cargo, run_capture};

/// Runs the SQLite benchmark and prints steps/s, per-step cost growth and file size.
pub fn run() -> Result<Vec<Row>> {
    let reps = super::reps("5");
    let full_up_to =
        std::env::var("KEEL_BENCH_SQLITE_FULL_UP_TO").unwrap_or_else(|_| "2000".into());
    eprintln!(
        "keel-checkpoint-sqlite: self-loop on a file, sync durability, N = 200 / 2,000 / 20,000, \
         {reps} repetitions, median (synchronous=FULL up to N = {full_up_to})"
    );
    let out = run_capture(cargo().args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "keel-checkpoint-sqlite",
        "--example",
        "bench_sqlite",
        "--",
        &reps,
        "200",
        "2000",
        "20000",
        "--full-up-to",
        &full_up_to,
    ]))?;
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
            .map_or(String::new(), |b| format!("; file {b} bytes"));
        for peer in ["LangGraph", "LangGraph.js"] {
            table.push(
                Row::faster(
                    "graph loop",
                    format!("sqlite ({sync}), N = {n}"),
                    "steps/s",
                    v["steps_per_s"].as_f64(),
                    peer,
                    None,
                )
                .note(format!(
                    "peer not run: the bench installs no SQLite saver for {peer}{overhead}{bytes}"
                )),
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
