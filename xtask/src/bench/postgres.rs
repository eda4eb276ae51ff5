//! Checkpointing to PostgreSQL: keel-checkpoint-postgres vs LangGraph's and
//! LangGraph.js's PostgresSaver on the graph benchmark's loop (sync durability;
//! `xtask/peers/langgraph_postgres.py`, `xtask/peers/langgraphjs-agent/loop.mjs
//! postgres`), plus a load test of many threads.
//!
//! Uses `DATABASE_URL`, or a throwaway cluster with PostgreSQL's default (durable)
//! settings. Runs twice: with the server's commit setting (normally
//! `synchronous_commit = on`: every step waits for a WAL flush, so the disk's fsync
//! latency bounds one thread's steps/s), and with `synchronous_commit = off` for both
//! sides (a commit returns before the flush; a server crash may lose the last few
//! commits, never half of one).

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::graph::JS_PEER;
use super::report::Row;
use crate::node::NodePeer;
use crate::pg::Database;
use crate::python::Venv;
use crate::util::{self, cargo, run_capture};

const PEERS: &[&str] = &[
    "langgraph==1.2.24",
    "langgraph-checkpoint-postgres==3.2.0",
    "psycopg==3.3.9",
    "psycopg-binary==3.3.9",
];

/// The sizes the peers' PostgresSaver runs at: each of their steps stores the whole
/// message list again, so a run's cost grows with N² (about a minute at 2,000 steps on
/// this machine, over an hour at 20,000).
const PEER_SIZES: [&str; 2] = ["200", "2000"];

/// `url` with `-c synchronous_commit=off` added to the session options.
fn async_commit(url: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}options=-c%20synchronous_commit%3Doff")
    } else {
        format!("{url} options='-c synchronous_commit=off'")
    }
}

fn rows(text: &str) -> Result<Vec<Value>> {
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).context("bench output is not JSON"))
        .collect()
}

/// Runs the Postgres benchmark and prints both sides with the ratio.
pub fn run() -> Result<Vec<Row>> {
    let reps = super::reps("3");
    let peer_reps = std::env::var("KEEL_BENCH_PEER_REPS").unwrap_or_else(|_| reps.clone());
    let db = Database::get(&[], false);
    eprintln!("postgres bench: {}", db.describe());
    let Some(url) = db.url() else {
        bail!("no PostgreSQL for the benchmark: {}", db.describe());
    };
    util::run(cargo().args([
        "build",
        "--release",
        "--quiet",
        "-p",
        "keel-checkpoint-postgres",
        "--example",
        "bench_postgres",
    ]))?;
    let venv = Venv::ensure(PEERS)?;
    let js = NodePeer::ensure(JS_PEER);
    let mut js_failed: Option<String> = None;
    let keel = |session: &str, url: &str, args: &[&str]| -> Result<Vec<Value>> {
        rows(&run_capture(
            cargo()
                .args([
                    "run",
                    "--release",
                    "--quiet",
                    "-p",
                    "keel-checkpoint-postgres",
                ])
                .args(["--example", "bench_postgres", "--"])
                .args(args)
                .env("DATABASE_URL", url)
                .env("KEEL_BENCH_SESSION", session),
        )?)
    };
    let peer = |session: &str, url: &str, sizes: &[&str]| -> Result<Vec<Value>> {
        rows(&run_capture(
            venv.python()
                .arg("xtask/peers/langgraph_postgres.py")
                .arg(&peer_reps)
                .args(sizes)
                .env("DATABASE_URL", url)
                .env("KEEL_BENCH_SESSION", session),
        )?)
    };

    let sessions = [
        ("commit-on", url.clone()),
        ("commit-off", async_commit(&url)),
    ];
    let mut results = Vec::new();
    for (session, url) in &sessions {
        eprintln!("keel ({session}): loop N = 200 / 2,000 / 20,000, {reps} repetitions, median");
        let sizes: &[&str] = if *session == "commit-on" {
            &["200", "2000"] // fsync-bound: 20,000 steps would take minutes
        } else {
            &["200", "2000", "20000"]
        };
        let mut args = vec!["loop", reps.as_str()];
        args.extend_from_slice(sizes);
        results.extend(keel(session, url, &args)?);
        eprintln!("keel ({session}): load, 200 threads x 200 steps on a pool of 16");
        results.extend(keel(session, url, &["load", "200", "200", "16"])?);
        eprintln!(
            "LangGraph PostgresSaver ({session}): loop N = 200 / 2,000, {peer_reps} repetitions"
        );
        results.extend(peer(session, url, &PEER_SIZES)?);
        eprintln!(
            "LangGraph.js PostgresSaver ({session}): loop N = 200 / 2,000, {peer_reps} repetitions"
        );
        let js_rows = match &js {
            Ok(js) => run_capture(
                js.node("loop.mjs")
                    .args(["postgres", &peer_reps])
                    .args(PEER_SIZES)
                    .env("DATABASE_URL", url)
                    .env("KEEL_BENCH_SESSION", session),
            )
            .and_then(|text| rows(&text)),
            Err(e) => Err(anyhow::anyhow!("{e:#}")),
        };
        match js_rows {
            Ok(r) => results.extend(r),
            Err(e) => {
                eprintln!("LangGraph.js PostgresSaver ({session}): {e:#}");
                js_failed = Some(format!("LangGraph.js did not run: {e:#}"));
            }
        }
    }
    drop(db);
    report(&results);
    Ok(table(&results, js_failed.as_deref()))
}

/// The loop rows for the one table: steps/s at each N, and bytes stored after 2,000 steps.
/// `js_failed` says why LangGraph.js has no results, when it did not run.
fn table(results: &[Value], js_failed: Option<&str>) -> Vec<Row> {
    let find = |session: &str, implementation: &str, n: u64| {
        results.iter().find(|v| {
            v["bench"] == "loop"
                && v["session"] == session
                && v["impl"] == implementation
                && v["n"].as_u64() == Some(n)
        })
    };
    let mut out = Vec::new();
    for session in ["commit-on", "commit-off"] {
        for n in [200, 2_000, 20_000] {
            let Some(k) = find(session, "keel", n) else {
                continue;
            };
            let p = find(session, "langgraph", n);
            let workload = format!(
                "postgres sync, synchronous_commit {}, N = {n}",
                &session[7..]
            );
            let mut row = Row::faster(
                "graph loop",
                workload.clone(),
                "steps/s",
                k["steps_per_s"].as_f64(),
                "LangGraph",
                p.and_then(|p| p["steps_per_s"].as_f64()),
            );
            if p.is_none() {
                row = row.note(skipped("LangGraph", find(session, "langgraph", 2_000)));
            }
            out.push(row);
            let j = find(session, "langgraphjs", n);
            let mut row = Row::faster(
                "graph loop",
                workload,
                "steps/s",
                k["steps_per_s"].as_f64(),
                "LangGraph.js",
                j.and_then(|j| j["steps_per_s"].as_f64()),
            );
            if j.is_none() {
                row = row.note(match js_failed {
                    Some(why) => why.to_owned(),
                    None => skipped("LangGraph.js", find(session, "langgraphjs", 2_000)),
                });
            }
            out.push(row);
        }
        if let Some(k) = find(session, "keel", 2_000) {
            for (peer, implementation) in
                [("LangGraph", "langgraph"), ("LangGraph.js", "langgraphjs")]
            {
                let p = find(session, implementation, 2_000);
                let mut note = format!(
                    "keel's rows alone: {:.0} bytes",
                    k["row_bytes"].as_f64().unwrap_or(f64::NAN)
                );
                if let (Some(why), None) =
                    (js_failed.filter(|_| implementation == "langgraphjs"), p)
                {
                    note = format!("{why}; {note}");
                }
                out.push(
                    Row::faster(
                        "bytes stored per thread, Postgres, 2,000 steps",
                        format!(
                            "synchronous_commit {}: checkpoint tables' size",
                            &session[7..]
                        ),
                        "bytes",
                        k["relation_bytes"].as_f64(),
                        peer,
                        p.and_then(|p| p["relation_bytes"].as_f64()),
                    )
                    .smaller()
                    .note(note),
                );
            }
        }
    }
    out
}

/// Why `peer`'s PostgresSaver has no row at this N, with its 2,000-step run's figures.
fn skipped(peer: &str, at_2000: Option<&Value>) -> String {
    let measured = at_2000
        .and_then(|v| {
            let rate = v["steps_per_s"].as_f64()?;
            let bytes = v["relation_bytes"].as_f64()?;
            Some(format!(
                " ({:.0} s and {:.0} MB of tables at N = 2,000)",
                2_000.0 / rate,
                bytes / 1e6
            ))
        })
        .unwrap_or_default();
    format!(
        "{peer}'s PostgresSaver is run at N = 200 and 2,000 only: each step stores the whole \
         message list again, so a run's time and tables grow with N²{measured}; 20,000 steps \
         would take about 100 times as long"
    )
}

fn report(results: &[Value]) {
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let loops: BTreeMap<(String, String, u64), &Value> = results
        .iter()
        .filter(|v| v["bench"] == "loop")
        .map(|v| {
            let key = (
                v["session"].as_str().unwrap_or("?").to_owned(),
                v["impl"].as_str().unwrap_or("?").to_owned(),
                v["n"].as_u64().unwrap_or(0),
            );
            (key, v)
        })
        .collect();
    println!(
        "{:<11} {:>6} {:>12} {:>10} {:>7} {:>10} {:>7} {:>11} {:>13} {:>13} {:>12} {:>12}",
        "session",
        "N",
        "keel st/s",
        "LangGraph",
        "ratio",
        "LG.js",
        "ratio",
        "keel µs/st",
        "keel rows B",
        "keel tables B",
        "LG tables B",
        "LG.js tbl B"
    );
    for ((session, implementation, n), k) in &loops {
        if implementation != "keel" {
            continue;
        }
        let ks = num(k, "steps_per_s");
        let peer =
            |implementation: &str| match loops.get(&(session.clone(), implementation.into(), *n)) {
                Some(p) if num(p, "steps_per_s") > 0.0 => (
                    format!("{:.0}", num(p, "steps_per_s")),
                    format!("{:.1}x", ks / num(p, "steps_per_s")),
                    format!("{:.0}", num(p, "relation_bytes")),
                ),
                _ => ("-".into(), "-".into(), "-".into()),
            };
        let (ps, ratio, pb) = peer("langgraph");
        let (js, js_ratio, jb) = peer("langgraphjs");
        println!(
            "{session:<11} {n:>6} {ks:>12.0} {ps:>10} {ratio:>7} {js:>10} {js_ratio:>7} {:>11.1} {:>13.0} {:>13.0} {pb:>12} {jb:>12}",
            num(k, "us_per_step"),
            num(k, "row_bytes"),
            num(k, "relation_bytes"),
        );
    }
    for v in results
        .iter()
        .filter(|v| v["impl"] == "langgraphjs" && v["n"].as_u64() == Some(2_000))
    {
        println!(
            "LangGraph.js {}: the saver's connections ran with synchronous_commit = {}",
            v["session"].as_str().unwrap_or("?"),
            v["synchronous_commit"].as_str().unwrap_or("?")
        );
    }
    for (session, _) in loops
        .keys()
        .filter(|(_, i, n)| i == "keel" && *n == 200)
        .map(|(s, i, _)| (s, i))
    {
        let us = |n: u64| {
            loops
                .get(&(session.clone(), "keel".into(), n))
                .map(|v| num(v, "us_per_step"))
        };
        if let (Some(small), Some(large)) = (us(200), us(20_000)) {
            println!(
                "keel {session}: per-step cost at N=20,000 is {:.2}x that at N=200",
                large / small
            );
        }
    }
    for v in results.iter().filter(|v| v["bench"] == "load") {
        println!(
            "keel {} load: {} threads x {} steps, pool {}: {:.0} steps/s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {} errors",
            v["session"].as_str().unwrap_or("?"),
            v["threads"],
            v["steps"],
            v["pool"],
            num(v, "steps_per_s"),
            num(v, "p50_ms"),
            num(v, "p99_ms"),
            num(v, "max_ms"),
            v["errors"]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::async_commit;

    #[test]
    fn async_commit_adds_the_session_option() {
        assert_eq!(
            async_commit("postgres://u@h/db"),
            "postgres://u@h/db?options=-c%20synchronous_commit%3Doff"
        );
        assert_eq!(
            async_commit("postgresql://u@h/db?sslmode=disable"),
            "postgresql://u@h/db?sslmode=disable&options=-c%20synchronous_commit%3Doff"
        );
        assert_eq!(
            async_commit("host=h user=u"),
            "host=h user=u options='-c synchronous_commit=off'"
        );
    }
}
