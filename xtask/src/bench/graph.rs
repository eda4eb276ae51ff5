//! Graph engine throughput: keel-graph vs LangGraph on the same self-loop workload.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::Value;

use super::report::Row;
use crate::python::Venv;
use crate::util::{cargo, run_capture};

/// LangGraph version the published figures were measured with.
const LANGGRAPH: &str = "langgraph==1.2.24";

/// Runs the graph benchmark and prints both sides with the ratio.
pub fn run() -> Result<Vec<Row>> {
    let reps = super::reps("5");
    eprintln!("keel-graph: self-loop, N = 200 / 2,000 / 20,000, {reps} repetitions, median");
    let keel = run_capture(cargo().args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "keel-graph",
        "--example",
        "bench_loop",
        "--",
        &reps,
        "200",
        "2000",
        "20000",
    ]))?;

    let venv = Venv::ensure(&[LANGGRAPH])?;
    let script = "xtask/peers/langgraph_loop.py";
    eprintln!(
        "LangGraph {LANGGRAPH}: same workload (20,000 steps only without a saver; its saver's cost grows with N)"
    );
    let peer_reps = super::reps("3");
    let mut peer = run_capture(
        venv.python()
            .args([script, "none", &peer_reps, "200", "2000"]),
    )?;
    peer.push_str(&run_capture(
        venv.python().args([script, "none", "1", "20000"]),
    )?);
    peer.push_str(&run_capture(
        venv.python()
            .args([script, "memory", &peer_reps, "200", "2000"]),
    )?);

    let rows = |text: &str| -> Result<BTreeMap<(String, u64), Value>> {
        text.lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| {
                let v: Value = serde_json::from_str(l).context("bench output is not JSON")?;
                let key = (
                    v["saver"].as_str().unwrap_or("?").to_owned(),
                    v["n"].as_u64().unwrap_or(0),
                );
                Ok((key, v))
            })
            .collect()
    };
    let keel = rows(&keel)?;
    let peer = rows(&peer)?;
    println!(
        "{:<8} {:>7} {:>14} {:>14} {:>9} {:>12}",
        "saver", "N", "keel steps/s", "LangGraph", "ratio", "keel µs/step"
    );
    for ((saver, n), k) in &keel {
        let ks = k["steps_per_s"].as_f64().unwrap_or(0.0);
        let (ps, ratio) = match peer
            .get(&(saver.clone(), *n))
            .and_then(|p| p["steps_per_s"].as_f64())
        {
            Some(p) if p > 0.0 => (format!("{p:.0}"), format!("{:.0}x", ks / p)),
            _ => ("-".into(), "-".into()),
        };
        println!(
            "{saver:<8} {n:>7} {ks:>14.0} {ps:>14} {ratio:>9} {:>12.2}",
            k["us_per_step"].as_f64().unwrap_or(0.0)
        );
    }
    let mut out = Vec::new();
    for ((saver, n), k) in &keel {
        let p = peer.get(&(saver.clone(), *n));
        let mut row = Row::faster(
            "graph loop",
            format!("{saver}, N = {n}"),
            "steps/s",
            k["steps_per_s"].as_f64(),
            "LangGraph",
            p.and_then(|p| p["steps_per_s"].as_f64()),
        );
        if p.is_none() {
            row = row.note(
                "LangGraph's in-memory saver is not run at N = 20,000 (its cost grows with N)",
            );
        }
        out.push(row);
        out.push(
            Row::faster(
                "graph loop",
                format!("{saver}, N = {n}"),
                "steps/s",
                k["steps_per_s"].as_f64(),
                "LangGraph.js",
                None,
            )
            .note(
                "no LangGraph.js peer of the one-node loop in xtask/peers (only of the agent loop)",
            ),
        );
    }
    for saver in ["none", "memory"] {
        let us = |n: u64| {
            keel.get(&(saver.to_owned(), n))
                .and_then(|v| v["us_per_step"].as_f64())
        };
        if let (Some(small), Some(large)) = (us(200), us(20_000)) {
            println!(
                "keel {saver}: per-step cost at N=20,000 is {:.2}x that at N=200",
                large / small
            );
        }
    }
    Ok(out)
}
