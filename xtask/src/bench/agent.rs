//! `cargo xtask bench agent`: keel's full compacting agent loop beside the same pattern
//! written in LangGraph.js (`xtask/peers/langgraphjs-agent/agent.mjs`), in one run, plus
//! pgbench's single-client commit rate on the same PostgreSQL server (and, for context,
//! the same INSERT's latency when each follows 300 µs of idle, as an agent step's
//! commits do: on a virtual machine a commit after idle costs more than back to back).
//!
//! Configurations: memory (LangGraph.js's MemorySaver), SQLite (its SqliteSaver from
//! `@langchain/langgraph-checkpoint-sqlite`; both sides on a file in WAL mode with
//! `synchronous=NORMAL`, keel's default) and PostgreSQL (PostgresSaver), each with sync and
//! async durability, at N = 100, 1,000 and 10,000 agent steps (medians of 3 runs; one
//! LangGraph.js run at 10,000, where each takes minutes; the two sides take turns, one
//! process and one repetition at a time, so a slow spell of the machine falls on both; a
//! 10,000-step run whose estimate from the 1,000-step one exceeds
//! `KEEL_BENCH_AGENT_MAX_SECS`, 240 s by default, is skipped and said so).
//! `KEEL_BENCH_AGENT_SIZES` (e.g. `100,1000`) and `KEEL_BENCH_AGENT_REPS` override the
//! sizes and the repetitions, `KEEL_BENCH_AGENT_BACKENDS` (e.g. `postgres`) the backends,
//! `KEEL_BENCH_AGENT_DURABILITIES` (e.g. `sync`) the durabilities,
//! `KEEL_PGBENCH_SECS` pgbench's duration (10 s) at the start, `KEEL_PGBENCH_TURN_SECS`
//! that of the insert measured again before each of keel's PostgreSQL sync repetitions (3
//! s; 0 turns it off; the bound uses the median of all of them);
//! `KEEL_BENCH_AGENT_RUNTIME=current_thread`
//! runs keel's side on tokio's one-thread scheduler instead of the multi-thread one
//! `#[tokio::main]` builds (the peer, on Node.js, is single-threaded either way).
//! PostgreSQL comes from `DATABASE_URL`, else a throwaway cluster (see `crate::pg`;
//! without TLS); without one, the PostgreSQL rows and pgbench are skipped and the
//! reason printed. On a server that takes TLS, keel and pgbench connect with it (libpq's
//! `sslmode=prefer` default, which keel follows) and node-postgres without it: add
//! `?sslmode=disable` to `DATABASE_URL` to measure all three in the clear.
//!
//! Prints one table and the targets; writes every raw result to `target/bench-agent.json`.
//! keel's PostgreSQL sync results carry `commit_tps_before`, the rate pgbench measured
//! just before their repetition, and the check of the 10,000/100 per-step ratio prints
//! that ratio in units of it beside the raw one (the disk's commit rate drifts by a third
//! within one run on a shared machine).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::agent_keel::{self, Config, Measurement};
use super::report::Row;
use crate::node::NodePeer;
use crate::pg::Database;
use crate::util::{has_program, root, run_capture};

/// The Node.js peer's folder under `xtask/peers/`.
const PEER: &str = "langgraphjs-agent";

/// (backend, durability), in table order; both sides run each.
const CONFIGS: &[(&str, &str)] = &[
    ("memory", "async"),
    ("memory", "sync"),
    ("sqlite", "async"),
    ("sqlite", "sync"),
    ("postgres", "async"),
    ("postgres", "sync"),
];

const DEFAULT_SIZES: &[u64] = &[100, 1_000, 10_000];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// `KEEL_BENCH_AGENT_SIZES`, every item a number of steps (`1_000` or `1000`), else
/// the defaults; a value that is not one is an error naming it, not a size left out.
fn sizes() -> Result<Vec<u64>> {
    match std::env::var("KEEL_BENCH_AGENT_SIZES") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|s| match s.trim().replace('_', "").parse::<u64>() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!(
                    "KEEL_BENCH_AGENT_SIZES: `{}` is not a number of agent steps (e.g. 100,1000)",
                    s.trim()
                ),
            })
            .collect(),
        _ if super::quick() => Ok(vec![100, 1_000]),
        _ => Ok(DEFAULT_SIZES.to_vec()),
    }
}

/// `var` as a comma-separated list of names out of `known`; `None` when unset. A name
/// not known is an error listing the known ones: a typo would otherwise run nothing.
fn names(var: &str, known: &[&str]) -> Result<Option<Vec<String>>> {
    let Ok(v) = std::env::var(var) else {
        return Ok(None);
    };
    let names: Vec<String> = v.split(',').map(|b| b.trim().to_owned()).collect();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        bail!("{var}: `{bad}` is not one of {}", known.join(", "));
    }
    Ok(Some(names))
}

/// How many times each side runs one (backend, durability, N).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reps {
    keel: u32,
    peer: u32,
}

impl Reps {
    /// Rounds of turns: the larger of the two counts.
    fn rounds(self) -> u32 {
        self.keel.max(self.peer)
    }
}

/// Repetitions for `n` steps: `KEEL_BENCH_AGENT_REPS` (3) on each side, except that
/// LangGraph.js runs once at 10,000 and more, where one of its runs takes minutes. keel's
/// take seconds there, so it keeps its count: the 10,000/100 per-step ratio compares two
/// medians instead of a median and one sample of a machine whose speed drifts.
fn reps_for(n: u64, env: Option<&str>) -> Result<Reps> {
    let reps = match env.map(str::trim).filter(|v| !v.is_empty()) {
        None => 3,
        Some(v) => match v.parse::<u32>() {
            Ok(r) if r > 0 => r,
            _ => bail!("KEEL_BENCH_AGENT_REPS: `{v}` is not a number of repetitions (at least 1)"),
        },
    };
    Ok(Reps {
        keel: reps,
        peer: if n >= 10_000 { 1 } else { reps },
    })
}

/// Runs the benchmark, prints the comparison and returns its rows for the one table.
pub fn run() -> Result<Vec<Row>> {
    let sizes = sizes()?;
    if sizes.is_empty() {
        bail!("KEEL_BENCH_AGENT_SIZES has no sizes");
    }
    let reps_env = std::env::var("KEEL_BENCH_AGENT_REPS").ok();
    // Checked before anything starts: a typo is an error, not an empty run.
    reps_for(1, reps_env.as_deref())?;
    let known = |pick: fn(&(&'static str, &'static str)) -> &'static str| {
        let mut names: Vec<&str> = Vec::new();
        for name in CONFIGS.iter().map(pick) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    };
    // KEEL_BENCH_AGENT_BACKENDS=postgres,sqlite runs only those backends.
    let only = names("KEEL_BENCH_AGENT_BACKENDS", &known(|c| c.0))?;
    // KEEL_BENCH_AGENT_DURABILITIES=sync runs only that durability.
    let only_durability = names("KEEL_BENCH_AGENT_DURABILITIES", &known(|c| c.1))?;
    let excluded = |only: &Option<Vec<String>>, name: &str| {
        only.as_ref().is_some_and(|o| !o.iter().any(|b| b == name))
    };
    let max_secs = env_u64("KEEL_BENCH_AGENT_MAX_SECS", 240) as f64;
    let mut skipped: Vec<String> = Vec::new();

    // PostgreSQL and pgbench only for a run with PostgreSQL rows.
    let db = if excluded(&only, "postgres") {
        Database::Unavailable("no PostgreSQL rows asked for (KEEL_BENCH_AGENT_BACKENDS)".into())
    } else {
        Database::get(&[], false)
    };
    eprintln!("agent bench: {}", db.describe());
    let url = db.url();
    if url.is_none() && !excluded(&only, "postgres") {
        skipped.push(format!("PostgreSQL rows and pgbench: {}", db.describe()));
    }

    let probe = match &url {
        Some(url) => match Pgbench::start(url) {
            Ok(p) => Some(p),
            Err(e) => {
                skipped.push(format!("pgbench: {e:#}"));
                None
            }
        },
        None => None,
    };
    let mut pgbench = match &probe {
        Some(probe) => match probe.measure(env_u64("KEEL_PGBENCH_SECS", 10)) {
            Ok(p) => Some(p),
            Err(e) => {
                skipped.push(format!("pgbench: {e:#}"));
                None
            }
        },
        None => None,
    };
    let turn_secs = env_u64("KEEL_PGBENCH_TURN_SECS", 3);

    let peer = NodePeer::ensure(PEER)?;
    let scratch = root().join("target").join("bench-agent-scratch");
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;

    let mut peer_rows: Vec<Value> = Vec::new();
    let mut keel_rows: Vec<Value> = Vec::new();
    let mut keel_errors: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for &(backend, durability) in CONFIGS {
        if backend == "postgres" && url.is_none() {
            continue;
        }
        if excluded(&only, backend) || excluded(&only_durability, durability) {
            continue;
        }
        // Wall seconds of the last size run, per side, to judge whether the next fits.
        let mut last_peer: Option<(u64, f64)> = None;
        let mut last_keel: Option<(u64, f64)> = None;
        for &n in &sizes {
            let reps = reps_for(n, reps_env.as_deref())?;
            let too_long = |last: Option<(u64, f64)>| {
                last.map(|(m, secs)| secs * n as f64 / m as f64)
                    .filter(|est| *est > max_secs)
            };
            let mut run_peer_side = match too_long(last_peer) {
                Some(est) => {
                    skipped.push(format!(
                        "LangGraph.js {backend}/{durability} N={}: would take about {est:.0} s (> {max_secs:.0} s, KEEL_BENCH_AGENT_MAX_SECS)",
                        thousands(n)
                    ));
                    false
                }
                None => true,
            };
            let mut run_keel_side = match too_long(last_keel) {
                Some(est) => {
                    skipped.push(format!(
                        "keel {backend}/{durability} N={}: would take about {est:.0} s (> {max_secs:.0} s)",
                        thousands(n)
                    ));
                    false
                }
                None => true,
            };
            let config = Config {
                backend: backend.to_owned(),
                durability: durability.to_owned(),
                steps: n,
                reps: 1,
                repo: root(),
                database_url: if backend == "postgres" {
                    url.clone()
                } else {
                    None
                },
                scratch: scratch.clone(),
            };
            let postgres = url.as_deref().filter(|_| backend == "postgres");
            let mut peer_walls = Vec::new();
            let mut keel_walls = Vec::new();
            // The sides take turns, one repetition each: a change in the machine's speed
            // during the run (the disk's commit latency swings by several times on a
            // shared machine) falls on both sides instead of on whichever ran then.
            for rep in 1..=reps.rounds() {
                // Says which side runs now, on a freshly vacuumed PostgreSQL.
                let start = |side: &str, of: u32| {
                    eprintln!(
                        "{side} {backend}/{durability}: N = {}, repetition {rep}/{of}",
                        thousands(n)
                    );
                    if let Some(u) = postgres {
                        settle(u);
                    }
                };
                if run_peer_side && rep <= reps.peer {
                    start("LangGraph.js", reps.peer);
                    match run_peer(&peer, postgres, &scratch, backend, durability, n, 1) {
                        Ok(rows) => {
                            peer_walls.extend(rows.iter().map(|r| num(r, "wall_s")));
                            peer_rows.extend(rows);
                        }
                        // One failed peer run costs its row, not the whole run's results.
                        Err(e) => {
                            eprintln!("LangGraph.js {backend}/{durability} N={n} failed: {e:#}");
                            skipped.push(format!(
                                "LangGraph.js {backend}/{durability} N={}: its run failed ({})",
                                thousands(n),
                                first_line(&format!("{e:#}"))
                            ));
                            run_peer_side = false;
                        }
                    }
                }
                if run_keel_side && rep <= reps.keel {
                    // The commit rate again, right before keel's repetition.
                    let mut turn_tps = None;
                    if let (Some(probe), Some(pg)) = (&probe, &mut pgbench)
                        && backend == "postgres"
                        && durability == "sync"
                        && turn_secs > 0
                    {
                        match probe.insert_tps(turn_secs) {
                            Ok(tps) => {
                                pg.turns.push(tps);
                                turn_tps = Some(tps);
                            }
                            Err(e) => eprintln!("pgbench in turns failed: {e:#}"),
                        }
                    }
                    start("keel", reps.keel);
                    match agent_keel::run(&config) {
                        Ok(ms) => {
                            let mut rows: Vec<Value> = ms.iter().map(measurement_json).collect();
                            if let Some(tps) = turn_tps {
                                for row in &mut rows {
                                    if let Some(fields) = row.as_object_mut() {
                                        fields.insert("commit_tps_before".into(), json!(tps));
                                    }
                                }
                            }
                            keel_walls.extend(rows.iter().map(|r| num(r, "wall_s")));
                            keel_rows.extend(rows);
                        }
                        Err(e) => {
                            keel_errors
                                .entry(format!("{e:#}"))
                                .or_default()
                                .push(format!("{backend}/{durability} N={n}"));
                            run_keel_side = false;
                        }
                    }
                }
            }
            if let Some(w) = median(peer_walls.into_iter()) {
                last_peer = Some((n, w));
            }
            if let Some(w) = median(keel_walls.into_iter()) {
                last_keel = Some((n, w));
            }
        }
    }
    drop(probe);
    drop(db);

    let report = Report {
        peer: summarize(&peer_rows),
        keel: summarize(&keel_rows),
        pgbench: pgbench.as_ref(),
    };
    report.print();
    let table = report.rows(&skipped, &keel_errors);
    for (error, configs) in &keel_errors {
        println!("keel side failed ({}): {error}", configs.join(", "));
    }
    for s in &skipped {
        println!("skipped: {s}");
    }

    let out = root().join("target").join("bench-agent.json");
    let raw = json!({
        "sizes": sizes,
        "pgbench": pgbench.as_ref().map(PgBench::to_json),
        "langgraphjs": peer_rows,
        "keel": keel_rows,
        "keel_errors": keel_errors,
        "skipped": skipped,
    });
    std::fs::write(&out, format!("{raw:#}\n"))
        .with_context(|| format!("writing {}", out.display()))?;
    println!("raw results: {}", out.display());
    Ok(table)
}

/// The first line of an error's text, cut to 200 characters (for a table cell).
fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_owned(),
    }
}

fn run_peer(
    peer: &NodePeer,
    url: Option<&str>,
    scratch: &std::path::Path,
    backend: &str,
    durability: &str,
    n: u64,
    reps: u32,
) -> Result<Vec<Value>> {
    let mut c = peer.node("agent.mjs");
    c.arg("--repo")
        .arg(root())
        .args(["--saver", backend, "--durability", durability])
        .args(["--steps", &n.to_string(), "--reps", &reps.to_string()]);
    if let Some(url) = url.filter(|_| backend == "postgres") {
        c.args(["--url", url]);
    }
    if backend == "sqlite" {
        c.arg("--scratch").arg(scratch);
    }
    let text = run_capture(&mut c)?;
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            serde_json::from_str(l).context("the LangGraph.js peer printed a line that is not JSON")
        })
        .collect()
}

fn measurement_json(m: &Measurement) -> Value {
    json!({
        "impl": "keel",
        "backend": m.backend,
        "durability": m.durability,
        "steps": m.steps,
        "wall_s": m.wall_s,
        "steps_per_s": m.steps_per_s,
        "us_per_step": if m.steps_per_s > 0.0 { 1e6 / m.steps_per_s } else { 0.0 },
        "overhead_us_per_step": m.overhead_us_per_step,
        "bytes_per_step": m.bytes_per_step,
        "peak_rss_bytes": m.peak_rss_bytes,
        "supersteps": m.supersteps,
    })
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// The median of the finite `values` (the mean of the middle two for an even count).
pub(super) fn median(values: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// Medians over the repetitions of one (backend, durability, N).
struct Summary {
    reps: usize,
    steps_per_s: f64,
    overhead_us: Option<f64>,
    bytes_per_step: Option<f64>,
    peak_rss: Option<f64>,
    supersteps: Option<f64>,
    /// LangGraph.js only: saver transactions (put + putWrites) per agent step.
    commits_per_step: Option<f64>,
    /// keel's PostgreSQL sync only: a step's wall time in units of the commit time
    /// pgbench measured right before its repetition (`commit_tps_before`), so a change
    /// in the disk's speed between repetitions cancels out.
    commit_times_per_step: Option<f64>,
}

type Key = (usize, u64);

fn config_index(backend: &str, durability: &str) -> usize {
    CONFIGS
        .iter()
        .position(|(b, d)| *b == backend && *d == durability)
        .unwrap_or(CONFIGS.len())
}

fn summarize(rows: &[Value]) -> BTreeMap<Key, Summary> {
    let mut groups: BTreeMap<Key, Vec<&Value>> = BTreeMap::new();
    for r in rows {
        let key = (
            config_index(
                r["backend"].as_str().unwrap_or("?"),
                r["durability"].as_str().unwrap_or("?"),
            ),
            r["steps"].as_u64().unwrap_or(0),
        );
        groups.entry(key).or_default().push(r);
    }
    groups
        .into_iter()
        .map(|(key, rs)| {
            let med = |k: &str| median(rs.iter().map(|r| num(r, k)));
            let commits = median(
                rs.iter()
                    .map(|r| (num(r, "checkpoint_puts") + num(r, "put_writes")) / num(r, "steps")),
            );
            let summary = Summary {
                reps: rs.len(),
                steps_per_s: med("steps_per_s").unwrap_or(0.0),
                overhead_us: med("overhead_us_per_step"),
                bytes_per_step: med("bytes_per_step"),
                peak_rss: rs
                    .iter()
                    .map(|r| num(r, "peak_rss_bytes"))
                    .filter(|x| x.is_finite())
                    .reduce(f64::max),
                supersteps: med("supersteps"),
                commits_per_step: commits,
                commit_times_per_step: median(
                    rs.iter()
                        .map(|r| num(r, "commit_tps_before") / num(r, "steps_per_s")),
                ),
            };
            (key, summary)
        })
        .collect()
}

struct Report<'a> {
    peer: BTreeMap<Key, Summary>,
    keel: BTreeMap<Key, Summary>,
    pgbench: Option<&'a PgBench>,
}

impl Report<'_> {
    /// One row per (backend, durability, N): steps/s beside LangGraph.js, with the
    /// targets `print_targets` checks (memory 30x, Postgres sync 6x).
    fn rows(&self, skipped: &[String], keel_errors: &BTreeMap<String, Vec<String>>) -> Vec<Row> {
        let mut keys: Vec<Key> = self.peer.keys().chain(self.keel.keys()).copied().collect();
        keys.sort();
        keys.dedup();
        let mut out = Vec::new();
        for key in &keys {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            let k = self.keel.get(key);
            let p = self.peer.get(key);
            let label = format!("{backend}/{durability} N={}", thousands(key.1));
            let mut row = Row::faster(
                "agent loop",
                format!(
                    "{backend}, durability {durability}, N = {}",
                    thousands(key.1)
                ),
                "steps/s",
                k.map(|s| s.steps_per_s),
                "LangGraph.js",
                p.map(|s| s.steps_per_s),
            );
            match backend {
                "memory" => row = row.target(30.0),
                "postgres" if durability == "sync" => row = row.target(6.0),
                _ => {}
            }
            let mut notes: Vec<String> = Vec::new();
            if backend == "sqlite" {
                notes.push("both sides: WAL, synchronous=NORMAL".into());
            }
            notes.extend(
                skipped
                    .iter()
                    .filter(|s| s.contains(&label))
                    .map(|s| format!("skipped: {s}")),
            );
            for (error, configs) in keel_errors {
                if configs
                    .iter()
                    .any(|c| c == &format!("{backend}/{durability} N={}", key.1))
                {
                    notes.push(format!("keel failed: {error}"));
                }
            }
            if let (Some(k), Some(p)) = (
                k.and_then(|s| s.bytes_per_step),
                p.and_then(|s| s.bytes_per_step),
            ) {
                notes.push(format!(
                    "bytes/step in the saver: keel {k:.0}, LangGraph.js {p:.0}"
                ));
            }
            if let (Some(k), Some(p)) = (k.and_then(|s| s.peak_rss), p.and_then(|s| s.peak_rss)) {
                notes.push(format!(
                    "peak RSS: keel {:.0} MB, LangGraph.js {:.0} MB",
                    k / 1e6,
                    p / 1e6
                ));
            }
            out.push(row.note(notes.join("; ")));
        }
        out
    }

    fn print(&self) {
        let mut keys: Vec<Key> = self.peer.keys().chain(self.keel.keys()).copied().collect();
        keys.sort();
        keys.dedup();
        println!();
        println!(
            "agent loop (fake model, real tools, compaction every 10 steps, epoch every 5 milestones): medians"
        );
        if let Ok(flavor) = std::env::var("KEEL_BENCH_AGENT_RUNTIME") {
            println!("keel's side on tokio's {flavor} scheduler (KEEL_BENCH_AGENT_RUNTIME)");
        }
        println!(
            "{:<8} {:<5} {:>6} {:>4} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "backend",
            "dur",
            "N",
            "reps",
            "keel st/s",
            "LG.js st/s",
            "ratio",
            "keel ovh",
            "LG.js ovh",
            "keel B/st",
            "LG.js B/st",
            "keel MB",
            "LG.js MB"
        );
        let opt = |v: Option<f64>, scale: f64, prec: usize| match v {
            Some(x) => format!("{:.prec$}", x / scale),
            None => "-".into(),
        };
        for key in &keys {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            let k = self.keel.get(key);
            let p = self.peer.get(key);
            // keel's count, then the peer's where they differ ("3/1").
            let reps = match (k.map(|s| s.reps), p.map(|s| s.reps)) {
                (Some(a), Some(b)) if a != b => format!("{a}/{b}"),
                (a, b) => a.or(b).unwrap_or(0).to_string(),
            };
            println!(
                "{backend:<8} {durability:<5} {:>6} {reps:>4} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
                key.1,
                opt(k.map(|s| s.steps_per_s), 1.0, 0),
                opt(p.map(|s| s.steps_per_s), 1.0, 0),
                ratio(k, p).map_or("-".into(), |r| format!("{r:.1}x")),
                opt(k.and_then(|s| s.overhead_us), 1.0, 1),
                opt(p.and_then(|s| s.overhead_us), 1.0, 1),
                opt(k.and_then(|s| s.bytes_per_step), 1.0, 0),
                opt(p.and_then(|s| s.bytes_per_step), 1.0, 0),
                opt(k.and_then(|s| s.peak_rss), 1e6, 0),
                opt(p.and_then(|s| s.peak_rss), 1e6, 0),
            );
        }
        println!(
            "(st/s: agent steps, i.e. model calls, per second; ovh: runtime µs per step outside the fake model and the tools; \
             B/st: bytes the thread holds in the saver at the end / N; MB: peak RSS)"
        );
        println!(
            "LangGraph.js async PostgresSaver commits trail the graph, so its prune after each compaction finds few committed checkpoints to delete"
        );
        self.print_pgbench();
        self.print_targets(&keys);
    }

    fn print_pgbench(&self) {
        let Some(pg) = self.pgbench else {
            return;
        };
        println!();
        println!(
            "pgbench ({}), one client, {} s: {:.0} tps with one small INSERT per transaction (a checkpoint-like commit){}",
            pg.program,
            pg.secs,
            pg.insert_tps,
            pg.simple_update_tps.map_or(String::new(), |t| format!(
                "; {t:.0} tps on -N (simple update)"
            )),
        );
        if let Some(gapped) = pg.gapped_insert_us {
            let back_to_back = 1e6 / pg.insert_tps;
            println!(
                "  the INSERT after {GAP_US} µs idle, as between an agent step's commits: {gapped:.0} µs against {back_to_back:.0} back to back ({:.2}x); \
                 the bound below is the back-to-back rate",
                gapped / back_to_back
            );
        }
        if !pg.turns.is_empty() {
            let turns: Vec<String> = pg.turns.iter().map(|t| format!("{t:.0}")).collect();
            println!(
                "  the insert again before each keel postgres/sync repetition: {} tps; the bound uses the median of all {} measurements, {:.0} tps",
                turns.join(", "),
                pg.turns.len() + 1,
                pg.bound_tps()
            );
        }
        for (key, p) in &self.peer {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            if backend != "postgres" {
                continue;
            }
            if let Some(c) = p.commits_per_step {
                let allowed = pg.bound_tps() / c;
                println!(
                    "  LangGraph.js {backend}/{durability} N={}: {c:.2} saver transactions per step (a put and a putWrites per superstep) \
                     -> pgbench allows {allowed:.0} steps/s; it ran {:.0} ({:.0}% of that)",
                    key.1,
                    p.steps_per_s,
                    100.0 * p.steps_per_s / allowed
                );
            }
        }
    }

    fn print_targets(&self, keys: &[Key]) {
        println!();
        println!("targets:");
        let verdict = |ok: bool| if ok { "PASS" } else { "FAIL" };
        for key in keys {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            let k = self.keel.get(key);
            let p = self.peer.get(key);
            let target = match backend {
                "memory" => 30.0,
                "postgres" if durability == "sync" => 6.0,
                _ => continue,
            };
            let what = format!(
                "{backend}/{durability} N={}: keel >= {target:.0}x LangGraph.js",
                key.1
            );
            match ratio(k, p) {
                Some(r) => println!("  [{}] {what}: {r:.1}x", verdict(r >= target)),
                None => println!("  [ -- ] {what}: {}", missing(k, p)),
            }
        }
        // Runtime overhead under 300 µs per agent step on SQLite at 1,000 steps.
        for key in keys {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            if backend != "sqlite" || key.1 != 1_000 {
                continue;
            }
            let what = format!("{backend}/{durability} N=1000: keel's runtime < 300 µs per step");
            match self.keel.get(key).and_then(|k| k.overhead_us) {
                Some(us) => println!("  [{}] {what}: {us:.0} µs", verdict(us < 300.0)),
                None => println!("  [ -- ] {what}: keel not measured"),
            }
        }
        // Postgres (sync) within 2x of what pgbench allows.
        for key in keys {
            let (backend, durability) = CONFIGS.get(key.0).copied().unwrap_or(("?", "?"));
            if backend != "postgres" || durability != "sync" {
                continue;
            }
            let what = format!(
                "{backend}/{durability} N={}: keel within 2x of what pgbench allows",
                key.1
            );
            let Some(pg) = self.pgbench else {
                println!("  [ -- ] {what}: no pgbench result");
                continue;
            };
            let k = self.keel.get(key);
            // Same workload on both sides: the peer's superstep count stands in when
            // keel's is not there.
            let supersteps = k
                .and_then(|s| s.supersteps)
                .or_else(|| self.peer.get(key).and_then(|s| s.supersteps));
            let Some(supersteps) = supersteps else {
                println!("  [ -- ] {what}: no superstep count");
                continue;
            };
            let per_step = supersteps / key.1 as f64;
            let allowed = pg.bound_tps() / per_step;
            let derivation = format!(
                "one agent step = 2 supersteps (agent, tools) plus its share of compact and epoch ones = {supersteps:.0} supersteps / {} steps \
                 = {per_step:.3} checkpoint commits per step (one commit per superstep), so pgbench's {:.0} tps allows {allowed:.0} steps/s",
                key.1,
                pg.bound_tps()
            );
            match k {
                Some(k) => println!(
                    "  [{}] {what}: {:.0} steps/s = {:.2}x below the bound ({derivation})",
                    verdict(k.steps_per_s * 2.0 >= allowed),
                    k.steps_per_s,
                    allowed / k.steps_per_s
                ),
                None => println!("  [ -- ] {what}: keel not measured ({derivation})"),
            }
        }
        // Per-step cost at 10,000 within 1.3x of that at 100.
        let mut configs: Vec<usize> = keys.iter().map(|k| k.0).collect();
        configs.dedup();
        for c in configs {
            let (backend, durability) = CONFIGS.get(c).copied().unwrap_or(("?", "?"));
            let what = format!(
                "{backend}/{durability}: keel's per-step cost at N=10,000 within 1.3x of N=100"
            );
            let cost = |side: &BTreeMap<Key, Summary>, n: u64| {
                side.get(&(c, n))
                    .filter(|s| s.steps_per_s > 0.0)
                    .map(|s| 1e6 / s.steps_per_s)
            };
            let peer_growth = match (cost(&self.peer, 100), cost(&self.peer, 10_000)) {
                (Some(a), Some(b)) => format!(" (LangGraph.js: {:.2}x)", b / a),
                _ => String::new(),
            };
            // The same ratio with each repetition's step in units of the commit time
            // measured right before it (PostgreSQL sync), as context for the raw one.
            let commit_times = |n: u64| self.keel.get(&(c, n))?.commit_times_per_step;
            let per_commit = match (commit_times(100), commit_times(10_000)) {
                (Some(a), Some(b)) => format!(
                    "; per commit time measured before each repetition: {a:.2} -> {b:.2} = {:.2}x",
                    b / a
                ),
                _ => String::new(),
            };
            match (cost(&self.keel, 100), cost(&self.keel, 10_000)) {
                (Some(a), Some(b)) => println!(
                    "  [{}] {what}: {a:.1} -> {b:.1} µs/step = {:.2}x{per_commit}{peer_growth}",
                    verdict(b / a <= 1.3),
                    b / a
                ),
                _ => println!("  [ -- ] {what}: keel not measured at both sizes{peer_growth}"),
            }
        }
    }
}

fn ratio(k: Option<&Summary>, p: Option<&Summary>) -> Option<f64> {
    match (k, p) {
        (Some(k), Some(p)) if p.steps_per_s > 0.0 => Some(k.steps_per_s / p.steps_per_s),
        _ => None,
    }
}

fn missing(k: Option<&Summary>, p: Option<&Summary>) -> &'static str {
    match (k, p) {
        (None, None) => "neither side measured",
        (None, _) => "keel not measured",
        _ => "LangGraph.js not measured",
    }
}

/// `n` with a comma between each group of three digits.
pub(super) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// pgbench's single-client commit rates.
struct PgBench {
    program: String,
    secs: u64,
    /// One small INSERT (a ~1 kB row) per transaction.
    insert_tps: f64,
    /// The INSERT's latency in µs when each follows an idle gap of [`GAP_US`] (what a
    /// client working between its commits gets), when that measurement worked.
    gapped_insert_us: Option<f64>,
    /// pgbench's built-in `-N` (simple update) script, when `pgbench -i` worked.
    simple_update_tps: Option<f64>,
    /// The insert rate measured again before each of keel's PostgreSQL sync
    /// repetitions, in turns with them (`KEEL_PGBENCH_TURN_SECS` each).
    turns: Vec<f64>,
}

impl PgBench {
    fn to_json(&self) -> Value {
        json!({
            "program": self.program,
            "seconds": self.secs,
            "insert_tps": self.insert_tps,
            "simple_update_tps": self.simple_update_tps,
            "gap_us": GAP_US,
            "gapped_insert_us": self.gapped_insert_us,
            "insert_tps_in_turns": self.turns,
            "bound_tps": self.bound_tps(),
        })
    }

    /// The commit rate the bound is computed from: the median of every insert
    /// measurement, the first one and those taken in turns with keel's repetitions (the
    /// disk's commit rate drifts over a run; the turns measure it when keel runs).
    fn bound_tps(&self) -> f64 {
        median(std::iter::once(self.insert_tps).chain(self.turns.iter().copied()))
            .unwrap_or(self.insert_tps)
    }
}

/// `pgbench` on PATH, else the newest `/usr/lib/postgresql/<version>/bin/pgbench`.
fn find_pgbench() -> Result<String> {
    find_pg_program("pgbench")
}

/// Lets the server settle between two Postgres runs (one side's leftovers — dead rows,
/// dirty pages, a pending autovacuum — measured on the other's clock otherwise): a
/// `VACUUM` and a `CHECKPOINT` through psql, when psql is there.
fn settle(url: &str) {
    let Ok(psql) = find_pg_program("psql") else {
        return;
    };
    let status = std::process::Command::new(psql)
        .args(["-q", "-X", "-d", url, "-c", "VACUUM", "-c", "CHECKPOINT"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    if !status.is_ok_and(|s| s.success()) {
        eprintln!("could not VACUUM/CHECKPOINT between runs (psql failed); measuring anyway");
    }
}

/// A PostgreSQL client program on PATH, else the newest one in Debian's
/// `/usr/lib/postgresql/<version>/bin`.
fn find_pg_program(name: &str) -> Result<String> {
    if has_program(name) {
        return Ok(name.into());
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let program = e.path().join("bin").join(name);
            program.exists().then_some((version, program))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, p)) => Ok(p.display().to_string()),
        None => bail!(
            "{name} is not on PATH nor in /usr/lib/postgresql/*/bin (it comes with the PostgreSQL client package)"
        ),
    }
}

/// pgbench measuring the server's single-client commit rate in a scratch schema of its
/// own, created at `start` and dropped with it.
struct Pgbench {
    program: String,
    url: String,
    schema: String,
    insert: PathBuf,
    /// The same INSERT after an idle gap of [`GAP_US`].
    gapped: PathBuf,
    teardown: PathBuf,
}

/// The idle gap before each INSERT of the gapped pgbench measurement: about what an
/// agent step's other work leaves between two of its commits.
const GAP_US: u64 = 300;

impl Pgbench {
    /// Writes the scripts and creates the scratch schema.
    fn start(url: &str) -> Result<Self> {
        let program = find_pgbench()?;
        let dir = root().join("target").join("bench-agent-pgbench");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let schema = format!("keel_pgbench_{}", std::process::id());
        let script = |name: &str, sql: String| -> Result<PathBuf> {
            let path = dir.join(name);
            std::fs::write(&path, sql).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        };
        let setup = script(
            "setup.sql",
            format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE;\nCREATE SCHEMA {schema};\n\
                 CREATE TABLE {schema}.commit_probe (id bigserial PRIMARY KEY, thread text NOT NULL, payload bytea NOT NULL);\n"
            ),
        )?;
        let insert = script(
            "insert.sql",
            format!(
                "INSERT INTO {schema}.commit_probe (thread, payload) VALUES ('bench', convert_to(repeat('x', 1000), 'UTF8'));\n"
            ),
        )?;
        let gapped = script(
            "insert_gapped.sql",
            format!(
                "\\sleep {GAP_US} us\nINSERT INTO {schema}.commit_probe (thread, payload) VALUES ('bench', convert_to(repeat('x', 1000), 'UTF8'));\n"
            ),
        )?;
        let teardown = script(
            "teardown.sql",
            format!("DROP SCHEMA IF EXISTS {schema} CASCADE;\n"),
        )?;
        let probe = Pgbench {
            program,
            url: url.to_owned(),
            schema,
            insert,
            gapped,
            teardown,
        };
        probe
            .once(&setup)
            .context("pgbench: creating the scratch schema")?;
        Ok(probe)
    }

    fn once(&self, file: &PathBuf) -> Result<()> {
        run_capture(
            Command::new(&self.program)
                .args(["-n", "-t", "1", "-f"])
                .arg(file)
                .arg(&self.url),
        )
        .map(drop)
    }

    fn timed(&self, secs: u64, args: &[&str], search_path: bool) -> Result<f64> {
        let mut c = Command::new(&self.program);
        c.args(["-n", "-c", "1", "-j", "1", "-T", &secs.to_string()])
            .args(args)
            .arg(&self.url);
        if search_path {
            c.env("PGOPTIONS", format!("-c search_path={}", self.schema));
        }
        parse_tps(&run_capture(&mut c)?)
    }

    /// One small INSERT per transaction for `secs` seconds: transactions per second.
    fn insert_tps(&self, secs: u64) -> Result<f64> {
        let file = self.insert.display().to_string();
        self.timed(secs, &["-f", &file], false)
    }

    /// The INSERT's own latency in µs (pgbench's `-r`) when each follows an idle gap
    /// of [`GAP_US`], for `secs` seconds.
    fn gapped_insert_us(&self, secs: u64) -> Result<f64> {
        let out = run_capture(
            Command::new(&self.program)
                .args(["-n", "-r", "-c", "1", "-j", "1", "-T"])
                .arg(secs.to_string())
                .arg("-f")
                .arg(&self.gapped)
                .arg(&self.url),
        )?;
        parse_statement_ms(&out, "INSERT").map(|ms| ms * 1e3)
    }

    /// The first measurement: the insert rate, the INSERT after idle gaps, then
    /// pgbench's own `-N` script.
    fn measure(&self, secs: u64) -> Result<PgBench> {
        let insert_tps = self.insert_tps(secs)?;
        let gapped_insert_us = self
            .gapped_insert_us(secs.min(5))
            .map_err(|e| eprintln!("pgbench with idle gaps failed: {e:#}"))
            .ok();
        let init = run_capture(
            Command::new(&self.program)
                .args(["-i", "-q", "-s", "1"])
                .arg(&self.url)
                .env("PGOPTIONS", format!("-c search_path={}", self.schema)),
        );
        let simple_update_tps = match init {
            Ok(_) => self
                .timed(secs, &["-N"], true)
                .map_err(|e| eprintln!("pgbench -N failed: {e:#}"))
                .ok(),
            Err(e) => {
                eprintln!("pgbench -i failed: {e:#}");
                None
            }
        };
        Ok(PgBench {
            program: self.program.clone(),
            secs,
            insert_tps,
            gapped_insert_us,
            simple_update_tps,
            turns: Vec::new(),
        })
    }
}

impl Drop for Pgbench {
    fn drop(&mut self) {
        if let Err(e) = self.once(&self.teardown) {
            eprintln!(
                "warning: could not drop the pgbench scratch schema {}: {e:#}",
                self.schema
            );
        }
    }
}

/// The latency in ms pgbench's `-r` gives the script line starting with `statement`.
fn parse_statement_ms(out: &str, statement: &str) -> Result<f64> {
    out.lines()
        .find_map(|l| {
            let mut fields = l.split_whitespace();
            let ms = fields.next()?.parse::<f64>().ok()?;
            let _failures = fields.next()?;
            fields.next()?.starts_with(statement).then_some(ms)
        })
        .with_context(|| format!("pgbench -r printed no latency for `{statement}`"))
}

fn parse_tps(out: &str) -> Result<f64> {
    out.lines()
        .find_map(|l| {
            let rest = l.trim().strip_prefix("tps = ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .context("pgbench printed no `tps = ` line")
}

#[cfg(test)]
mod tests {
    use super::{Reps, median, parse_statement_ms, parse_tps, reps_for, summarize, thousands};

    #[test]
    fn a_step_in_commit_times_uses_the_rate_measured_before_its_repetition() {
        let row = |steps_per_s: f64, tps: Option<f64>| {
            let mut r = serde_json::json!({
                "backend": "postgres", "durability": "sync", "steps": 100,
                "steps_per_s": steps_per_s,
            });
            if let Some(tps) = tps {
                r["commit_tps_before"] = serde_json::json!(tps);
            }
            r
        };
        // 500 steps/s while the disk commits 3,000 a second: 6 commit times a step;
        // 400 at 2,000: 5; 800 at 3,200: 4. The median is 5.
        let rows = [
            row(500.0, Some(3_000.0)),
            row(400.0, Some(2_000.0)),
            row(800.0, Some(3_200.0)),
        ];
        let s = summarize(&rows);
        let only = s.values().next().expect("one group");
        assert_eq!(only.commit_times_per_step, Some(5.0));
        // Without turns (another backend, or KEEL_PGBENCH_TURN_SECS=0): none.
        let s = summarize(&[row(500.0, None)]);
        assert_eq!(
            s.values().next().expect("one group").commit_times_per_step,
            None
        );
    }

    #[test]
    fn keel_keeps_its_repetitions_where_the_peer_runs_once() {
        assert_eq!(reps_for(1_000, None).unwrap(), Reps { keel: 3, peer: 3 });
        assert_eq!(reps_for(10_000, None).unwrap(), Reps { keel: 3, peer: 1 });
        assert_eq!(
            reps_for(10_000, Some(" 5 ")).unwrap(),
            Reps { keel: 5, peer: 1 }
        );
        assert_eq!(reps_for(100, Some("2")).unwrap(), Reps { keel: 2, peer: 2 });
        // A value that is not a count is an error naming it, not a silent default.
        assert!(reps_for(100, Some("0")).is_err());
        assert!(
            reps_for(100, Some("x"))
                .unwrap_err()
                .to_string()
                .contains("`x`")
        );
        assert_eq!(reps_for(10_000, None).unwrap().rounds(), 3);
    }

    #[test]
    fn parses_pgbench_tps() {
        let out = "latency average = 0.429 ms\ninitial connection time = 5.985 ms\ntps = 2331.673911 (without initial connection time)\n";
        assert!((parse_tps(out).unwrap() - 2331.673911).abs() < 1e-9);
        assert!(parse_tps("nothing").is_err());
    }

    #[test]
    fn parses_a_statement_latency_of_pgbench_r() {
        let out = "latency average = 0.656 ms\ntps = 1523.956549 (without initial connection time)\n\
                   statement latencies in milliseconds and failures:\n\
                   \x20        0.388           0  \\sleep 300 us\n\
                   \x20        0.268           0  INSERT INTO s.commit_probe (thread) VALUES ('x');\n";
        assert!((parse_statement_ms(out, "INSERT").unwrap() - 0.268).abs() < 1e-9);
        assert!((parse_statement_ms(out, "\\sleep").unwrap() - 0.388).abs() < 1e-9);
        assert!(parse_statement_ms(out, "UPDATE").is_err());
    }

    #[test]
    fn medians_and_thousands() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), Some(2.0));
        assert_eq!(median([4.0, 1.0].into_iter()), Some(2.5));
        assert_eq!(median(std::iter::empty()), None);
        assert_eq!(thousands(10_000), "10,000");
        assert_eq!(thousands(100), "100");
    }
}
