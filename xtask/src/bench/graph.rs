//! Graph engine throughput: keel-graph vs LangGraph and LangGraph.js on the same
//! self-loop workload (`xtask/peers/langgraph_loop.py`,
//! `xtask/peers/langgraphjs-agent/loop.mjs`).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde_json::Value;

use super::report::Row;
use crate::node::NodePeer;
use crate::python::Venv;
use crate::util::{release_example, run_capture};

/// LangGraph version the published figures were measured with.
pub(super) const LANGGRAPH: &str = "langgraph==1.2.24";

/// The Node.js peer folder holding the LangGraph.js loop (`loop.mjs`), shared with the
/// agent loop's peer.
pub(super) const JS_PEER: &str = "langgraphjs-agent";

/// Why LangGraph.js without a saver is not run at N = 20,000.
const JS_NONE_SKIP: &str = "LangGraph.js without a saver is not run at N = 20,000: its \
     per-step cost grows with N (in a trial on this machine about 3 ms/step at N = 2,000 and \
     10.6 ms/step at N = 5,000), so 20,000 steps would take well over 10 minutes";

/// Why LangGraph.js's MemorySaver is not run at N = 20,000.
const JS_MEMORY_SKIP: &str = "LangGraph.js's MemorySaver is not run at N = 20,000: each step \
     stores the whole message list again (its per-step cost grows with N; the 2,000-step run \
     is already about a minute on this machine)";

/// Runs the graph benchmark and prints both sides with the ratio.
pub fn run() -> Result<Vec<Row>> {
    let reps = super::reps("5");
    eprintln!("keel-graph: self-loop, N = 200 / 2,000 / 20,000, {reps} repetitions, median");
    let keel = run_capture(
        release_example("keel-graph", "bench_loop").args([&reps, "200", "2000", "20000"]),
    )?;

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

    eprintln!(
        "LangGraph.js: same workload (xtask/peers/langgraphjs-agent/loop.mjs), N = 200 / 2,000"
    );
    let (js_out, js_failed) = match js_loop(&peer_reps) {
        Ok(out) => (out, None),
        Err(e) => {
            eprintln!("LangGraph.js loop: {e:#}");
            (
                String::new(),
                Some(format!("LangGraph.js did not run: {e:#}")),
            )
        }
    };

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
    let js = rows(&js_out)?;
    println!(
        "{:<8} {:>7} {:>14} {:>12} {:>9} {:>14} {:>9} {:>12}",
        "saver", "N", "keel steps/s", "LangGraph", "ratio", "LangGraph.js", "ratio", "keel µs/step"
    );
    let side = |map: &BTreeMap<(String, u64), Value>, key: &(String, u64), ks: f64| match map
        .get(key)
        .and_then(|p| p["steps_per_s"].as_f64())
    {
        Some(p) if p > 0.0 => (format!("{p:.0}"), format!("{:.0}x", ks / p)),
        _ => ("-".into(), "-".into()),
    };
    for (key, k) in &keel {
        let ks = k["steps_per_s"].as_f64().unwrap_or(0.0);
        let (ps, ratio) = side(&peer, key, ks);
        let (js_s, js_ratio) = side(&js, key, ks);
        println!(
            "{:<8} {:>7} {ks:>14.0} {ps:>12} {ratio:>9} {js_s:>14} {js_ratio:>9} {:>12.2}",
            key.0,
            key.1,
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
        let j = js.get(&(saver.clone(), *n));
        let mut row = Row::faster(
            "graph loop",
            format!("{saver}, N = {n}"),
            "steps/s",
            k["steps_per_s"].as_f64(),
            "LangGraph.js",
            j.and_then(|j| j["steps_per_s"].as_f64()),
        );
        if j.is_none() {
            row = row.note(match &js_failed {
                Some(why) => why.as_str(),
                None if saver == "memory" => JS_MEMORY_SKIP,
                None if saver == "none" => JS_NONE_SKIP,
                None => "LangGraph.js printed no result for this size",
            });
        }
        out.push(row);
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

/// The LangGraph.js loop without a saver and on MemorySaver, at N = 200 and 2,000 (see
/// [`JS_NONE_SKIP`] and [`JS_MEMORY_SKIP`]); its JSON lines.
fn js_loop(reps: &str) -> Result<String> {
    let js = NodePeer::ensure(JS_PEER)?;
    let mut out = run_capture(js.node("loop.mjs").args(["none", reps, "200", "2000"]))?;
    out.push_str(&run_capture(
        js.node("loop.mjs").args(["memory", reps, "200", "2000"]),
    )?);
    Ok(out)
}
