//! Model providers and summarizers: extractive summarizer throughput over real
//! transcripts, and provider overhead against a local mock server (64 calls in flight).

use anyhow::{Context, Result};
use serde_json::Value;

use crate::util::{cargo, run_capture};

fn rows(text: &str) -> Result<Vec<Value>> {
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).context("bench output is not JSON"))
        .collect()
}

/// Runs both benchmarks and prints their medians.
pub fn run() -> Result<()> {
    let reps = std::env::var("KEEL_BENCH_REPS").unwrap_or_else(|_| "11".into());
    let extractive = rows(&run_capture(cargo().args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "keel-summarize",
        "--example",
        "bench_extractive",
        "--",
        &reps,
    ]))?)?;
    let provider = rows(&run_capture(cargo().args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "keel-model",
        "--example",
        "bench_provider",
        "--",
        &reps,
        "20000",
    ]))?)?;
    println!("extractive summarizer (goal: at least 50 MB/s)");
    println!(
        "{:<24} {:>10} {:>12} {:>10}",
        "case", "MB", "median ms", "MB/s"
    );
    for r in &extractive {
        println!(
            "{:<24} {:>10.1} {:>12.1} {:>10.1}   ({})",
            r["case"].as_str().unwrap_or("?"),
            r["bytes"].as_f64().unwrap_or(0.0) / 1e6,
            r["median_s"].as_f64().unwrap_or(0.0) * 1e3,
            r["mb_per_s"].as_f64().unwrap_or(0.0),
            r["source"].as_str().unwrap_or("?"),
        );
    }
    println!();
    println!(
        "provider overhead, 64 in flight against a local mock (goal: at least 5,000 requests/s)"
    );
    println!(
        "{:<10} {:>16} {:>12} {:>12}",
        "provider", "median req/s", "min", "max"
    );
    for r in &provider {
        println!(
            "{:<10} {:>16.0} {:>12.0} {:>12.0}",
            r["provider"].as_str().unwrap_or("?"),
            r["median_requests_per_s"].as_f64().unwrap_or(0.0),
            r["min_requests_per_s"].as_f64().unwrap_or(0.0),
            r["max_requests_per_s"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}
