//! Offload store throughput: evict + stub, archive appends, and grep over a 1 GiB
//! archive side by side with `grep -c` and ripgrep (when installed) on the same file.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::util::{has_program, release_example, root, run_capture};

/// Patterns searched by every contender; valid for the `regex` crate, POSIX ERE and
/// ripgrep alike.
const PATTERNS: [&str; 2] = [
    "deadline exceeded",
    "connection (refused|reset) by peer on port [0-9]+",
];

/// Runs the offload benchmark and prints the figures.
pub fn run() -> Result<()> {
    let reps: usize = std::env::var("KEEL_BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5)
        .max(1);
    let base = root().join("target").join("offload-bench");
    let work = base.join("work");
    let data = base.join("archive-1g");
    std::fs::create_dir_all(&work)?;
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        eprintln!("load average before the run: {}", load.trim());
    }

    let example = |args: &[&str]| -> Result<Vec<Value>> {
        let out = run_capture(release_example("keel-offload", "bench_offload").args(args))?;
        out.lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).context("bench output is not JSON"))
            .collect()
    };
    let reps_s = reps.to_string();
    let work_s = work.to_string_lossy().into_owned();
    let data_s = data.to_string_lossy().into_owned();

    let evict = example(&["evict", &work_s, &reps_s])?;
    let append = example(&["append", &work_s, &reps_s])?;
    let archive = example(&["archive", &data_s])?;
    let file = archive
        .first()
        .and_then(|a| a["path"].as_str())
        .context("no archive path")?
        .to_owned();
    let file = if Path::new(&file).is_absolute() {
        file
    } else {
        root().join(file).to_string_lossy().into_owned()
    };
    let mut keel_grep = BTreeMap::new();
    for p in PATTERNS {
        for row in example(&["grep", &data_s, p, &reps_s])? {
            keel_grep.insert(p, row);
        }
    }
    let index = example(&["index", &data_s, "3"])?;

    let first = evict.first().context("no evict figures")?;
    println!(
        "\nevict + stub: 1,000 tool results of {} bytes (~{} o200k tokens) each, median of {reps}",
        first["bytes_each"], first["tokens_each"]
    );
    println!(
        "{:<16} {:<15} {:>11} {:>9}",
        "counter", "store", "results/s", "MB/s"
    );
    for r in &evict {
        println!(
            "{:<16} {:<15} {:>11.0} {:>9.1}",
            r["counter"].as_str().unwrap_or("?"),
            r["store"].as_str().unwrap_or("?"),
            r["results_per_s"].as_f64().unwrap_or(0.0),
            r["mb_per_s"].as_f64().unwrap_or(0.0)
        );
    }

    println!("\narchive append (Archive::append on an FsStore), median of {reps}");
    println!(
        "{:<26} {:>9} {:>12} {:>8}",
        "case", "messages", "messages/s", "MB/s"
    );
    for r in &append {
        println!(
            "{:<26} {:>9} {:>12.0} {:>8.1}",
            r["case"].as_str().unwrap_or("?"),
            r["messages"],
            r["messages_per_s"].as_f64().unwrap_or(0.0),
            r["mb_per_s"].as_f64().unwrap_or(0.0)
        );
    }

    let bytes = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) as f64;
    let mut peers: Vec<(&str, Vec<&str>)> = vec![("grep -c", vec!["grep", "-c", "-E"])];
    if has_program("rg") {
        peers.push(("rg -c", vec!["rg", "-c"]));
    } else {
        eprintln!("ripgrep is not installed: comparing with grep -c only");
    }
    println!(
        "\ngrep over a {:.2} GB archive ({file}), page cache warm, median of {reps}; peers run with LC_ALL=C",
        bytes / 1e9
    );
    print!("{:<52} {:>9}", "pattern", "keel MB/s");
    for (name, _) in &peers {
        print!(" {:>12} {:>7}", format!("{name} MB/s"), "ratio");
    }
    println!("  matching lines");
    for p in PATTERNS {
        let k = &keel_grep[p];
        let keel_mbs = k["mb_per_s"].as_f64().unwrap_or(0.0);
        let mut counts = vec![format!("keel {}", k["matches"])];
        print!("{p:<52} {keel_mbs:>9.0}");
        for (name, argv) in &peers {
            let (secs, count) = time_peer(argv, p, &file, reps)?;
            let mbs = bytes / secs / 1e6;
            print!(" {mbs:>12.0} {:>6.2}x", keel_mbs / mbs);
            counts.push(format!("{name} {count}"));
            if Some(count) != k["matches"].as_u64() {
                eprintln!(
                    "warning: {name} counted {count} lines for `{p}`, keel {}",
                    k["matches"]
                );
            }
        }
        println!("  {}", counts.join(", "));
    }

    if let Some(r) = index.first() {
        println!(
            "\narchive index: rebuilt from the {:.2} GB file ({} records) in {:.2} s (median of 3); get by id {:.1} µs",
            r["bytes"].as_f64().unwrap_or(0.0) / 1e9,
            r["records"],
            r["rebuild_median_s"].as_f64().unwrap_or(0.0),
            r["get_us"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// Median wall time of `argv pattern file` over `reps` runs (after one warm-up), and
/// the count it printed.
fn time_peer(argv: &[&str], pattern: &str, file: &str, reps: usize) -> Result<(f64, u64)> {
    let run = || -> Result<(f64, u64)> {
        let start = Instant::now();
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .arg(pattern)
            .arg(file)
            .env("LC_ALL", "C")
            .output()
            .with_context(|| format!("could not run {}", argv[0]))?;
        let secs = start.elapsed().as_secs_f64();
        // grep exits 1 when nothing matches; anything else is a failure.
        if !out.status.success() && out.status.code() != Some(1) {
            bail!(
                "{} failed: {}",
                argv[0],
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let count = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0);
        Ok((secs, count))
    };
    run()?;
    let mut secs = Vec::with_capacity(reps);
    let mut count = 0;
    for _ in 0..reps {
        let (s, c) = run()?;
        secs.push(s);
        count = c;
    }
    secs.sort_by(|a, b| a.total_cmp(b));
    let n = secs.len();
    let median = if n % 2 == 1 {
        secs[n / 2]
    } else {
        (secs[n / 2 - 1] + secs[n / 2]) / 2.0
    };
    Ok((median, count))
}
