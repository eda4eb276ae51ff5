//! The `keel` binary as a user runs it (release build, whole process): `keel demo` with
//! the default scenario, the same with 1,000 steps (the chart of a 1,000-turn run), and
//! `keel replay` of the 200 tau-bench runs. Wall time is measured around the process;
//! peak memory and the chart's drawing time come from the reports the binary writes.

use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::util::{cargo, cmd, root, run, run_capture};

const REPS: usize = 5;

struct Sample {
    wall_s: f64,
    peak_mb: Option<f64>,
    chart_ms: Option<f64>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Runs `keel <args>` `reps` times; `home` adds a fresh `--home` per run (commands
/// that keep threads take one, `replay` does not).
fn measure(args: &[&str], reps: usize, home: bool) -> Result<Vec<Sample>> {
    let keel = root().join("target/release/keel");
    let mut samples = Vec::new();
    for _ in 0..reps {
        let dir = tempfile::tempdir().context("a temporary home")?;
        let mut c = cmd(keel.to_str().unwrap_or("keel"));
        c.args(args);
        if home {
            c.arg("--home").arg(dir.path());
        }
        let started = Instant::now();
        let out = run_capture(&mut c)?;
        let wall_s = started.elapsed().as_secs_f64();
        let report: Value = serde_json::from_str(&out).context("keel printed no JSON report")?;
        samples.push(Sample {
            wall_s,
            peak_mb: report["peak_rss_bytes"].as_f64().map(|b| b / 1e6),
            chart_ms: report["chart_ms"].as_f64(),
        });
    }
    Ok(samples)
}

fn row(name: &str, samples: &[Sample]) {
    let wall = median(samples.iter().map(|s| s.wall_s).collect());
    let peak = median(samples.iter().filter_map(|s| s.peak_mb).collect());
    let chart = median(samples.iter().filter_map(|s| s.chart_ms).collect());
    let show = |v: Option<f64>, digits: usize| {
        v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
    };
    println!(
        "{name:<44} {:>8} {:>9} {:>9}",
        show(wall, 2),
        show(peak, 0),
        show(chart, 1)
    );
}

/// Runs the CLI benchmarks.
pub fn run_bench() -> Result<()> {
    run(cargo().args(["build", "--release", "-q", "-p", "keel-cli"]))?;
    let repo = root();
    let dir = repo.to_string_lossy().into_owned();
    let demo = measure(&["demo", "--quiet", "--json", "--dir", &dir], REPS, true)?;
    let long = measure(
        &[
            "demo", "--quiet", "--json", "--steps", "1000", "--dir", &dir,
        ],
        3,
        true,
    )?;
    let tau = repo.join("../shared/data/tau-bench/gpt-4o-airline.json");
    let replay = if tau.exists() {
        let path = tau.to_string_lossy().into_owned();
        Some(measure(
            &["replay", "--window", "8000", "--json", &path],
            REPS,
            false,
        )?)
    } else {
        eprintln!("skipped the replay: {} is absent", tau.display());
        None
    };
    println!("\nkeel CLI, release build, medians ({REPS} runs; 3 for 1,000 steps)");
    println!(
        "{:<44} {:>8} {:>9} {:>9}",
        "", "wall s", "peak MB", "chart ms"
    );
    row("keel demo (160 steps over this repository)", &demo);
    row("keel demo --steps 1000", &long);
    if let Some(r) = &replay {
        row("keel replay tau-bench (200 runs, 8,000 window)", r);
    }
    Ok(())
}
