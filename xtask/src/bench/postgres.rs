//! Checkpointing to PostgreSQL: keel-checkpoint-postgres vs LangGraph's PostgresSaver on
//! the graph benchmark's loop (sync durability), plus a load test of many threads.
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

use super::report::Row;
use crate::pg::Database;
use crate::python::Venv;
use crate::util::{self, cargo, run_capture};

const PEERS: &[&str] = &[
    "langgraph==1.2.24",
    "langgraph-checkpoint-postgres==3.2.0",
    "psycopg==3.3.9",
    "psycopg-binary==3.3.9",
];

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
    let db = Database::get(&[]);
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
        eprintln!("LangGraph PostgresSaver ({session}): loop N = 2,000, {peer_reps} repetitions");
        results.extend(peer(session, url, &["2000"])?);
    }
    drop(db);
    report(&results);
    Ok(table(&results))
}

/// The loop rows for the one table: steps/s at each N, and bytes stored after 2,000 steps.
fn table(results: &[Value]) -> Vec<Row> {
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
                row = row.note("LangGraph's PostgresSaver is run at N = 2,000 only (fsync-bound, minutes per size)");
            }
            out.push(row);
            out.push(
                Row::faster("graph loop", workload, "steps/s", k["steps_per_s"].as_f64(), "LangGraph.js", None)
                    .note("no LangGraph.js peer of the one-node loop in xtask/peers (its PostgresSaver is measured in the agent loop)"),
            );
        }
        if let Some(k) = find(session, "keel", 2_000) {
            let p = find(session, "langgraph", 2_000);
            out.push(
                Row::faster(
                    "bytes stored per thread, Postgres, 2,000 steps",
                    format!(
                        "synchronous_commit {}: checkpoint tables' size",
                        &session[7..]
                    ),
                    "bytes",
                    k["relation_bytes"].as_f64(),
                    "LangGraph",
                    p.and_then(|p| p["relation_bytes"].as_f64()),
                )
                .smaller()
                .note(format!(
                    "keel's rows alone: {:.0} bytes",
                    k["row_bytes"].as_f64().unwrap_or(f64::NAN)
                )),
            );
        }
    }
    out.push(
        Row::faster("bytes stored per thread, Postgres, 2,000 steps", "checkpoint tables' size", "bytes", None, "LangGraph.js", None)
            .smaller()
            .note("no LangGraph.js one-node loop peer; the agent loop's bytes per step compare keel with LangGraph.js's PostgresSaver"),
    );
    out
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
        "{:<11} {:>6} {:>12} {:>10} {:>7} {:>11} {:>13} {:>13} {:>12}",
        "session",
        "N",
        "keel st/s",
        "LangGraph",
        "ratio",
        "keel µs/st",
        "keel rows B",
        "keel tables B",
        "LG tables B"
    );
    for ((session, implementation, n), k) in &loops {
        if implementation != "keel" {
            continue;
        }
        let ks = num(k, "steps_per_s");
        let p = loops.get(&(session.clone(), "langgraph".into(), *n));
        let (ps, ratio, pb) = match p {
            Some(p) if num(p, "steps_per_s") > 0.0 => (
                format!("{:.0}", num(p, "steps_per_s")),
                format!("{:.1}x", ks / num(p, "steps_per_s")),
                format!("{:.0}", num(p, "relation_bytes")),
            ),
            _ => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{session:<11} {n:>6} {ks:>12.0} {ps:>10} {ratio:>7} {:>11.1} {:>13.0} {:>13.0} {pb:>12}",
            num(k, "us_per_step"),
            num(k, "row_bytes"),
            num(k, "relation_bytes"),
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
