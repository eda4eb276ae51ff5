//! Token counting throughput: keel-token vs Python tiktoken on the same text.
//!
//! The corpus is this repository's own `.rs` and `.md` files (sorted by path,
//! concatenated, repeated to about 1 MB), written to `target/bench/token-corpus.txt`,
//! so a fresh clone measures the same kind of text with nothing from outside. Python
//! tiktoken cannot download its BPE file here, so the peer builds `o200k_base` from the
//! copy tiktoken-rs ships in its crate sources, located with `cargo metadata`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::report::Row;
use crate::python::Venv;
use crate::util::{cargo, release_example, root, run_capture};

/// The median of `xs` (NaN when none is finite).
fn median(xs: Vec<f64>) -> f64 {
    super::agent::median(xs.into_iter()).unwrap_or(f64::NAN)
}

/// The Python peer, pinned.
const TIKTOKEN: &str = "tiktoken==0.14.0";

/// Fresh processes per side for the load time.
const LOAD_RUNS: usize = 5;

/// Corpus size to reach, in bytes.
const CORPUS_BYTES: usize = 1_000_000;

/// Runs the token benchmark and prints both sides with their ratio.
pub fn run() -> Result<Vec<Row>> {
    let runs = super::reps("15");
    let (corpus, files) = write_corpus()?;
    let bpe = o200k_file()?;
    let size = std::fs::metadata(&corpus)?.len();
    eprintln!(
        "token counting, o200k_base: {:.2} MB corpus ({files} .rs/.md files of this repository, repeated), {runs} runs each, median",
        size as f64 / 1e6
    );

    let keel = run_capture(
        release_example("keel-token", "count_bench")
            .arg(&corpus)
            .arg(&runs),
    )?;
    let keel = last_json(&keel).context("keel-token bench output")?;

    let venv = Venv::ensure(&[TIKTOKEN])?;
    let peer = run_capture(
        venv.python()
            .arg("xtask/peers/tiktoken_bench.py")
            .arg("--bpe")
            .arg(&bpe)
            .arg("--corpus")
            .arg(&corpus)
            .arg("--runs")
            .arg(&runs),
    )?;
    let peer = last_json(&peer).context("tiktoken bench output")?;

    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let keel_1 = num(&keel, "keel_1_thread_mb_s");
    let keel_2 = num(&keel, "keel_2_threads_mb_s");
    let tiktoken_rs = num(&keel, "tiktoken_rs_mb_s");
    let python = num(&peer, "median_mb_s");
    // Loading happens once per process: each side in fresh processes, taking turns.
    let (mut keel_loads, mut rs_loads, mut python_loads) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..LOAD_RUNS {
        let k = last_json(&run_capture(
            release_example("keel-token", "count_bench").arg("--load"),
        )?)
        .context("keel-token load output")?;
        keel_loads.push(num(&k, "keel_load_ms"));
        rs_loads.push(num(&k, "tiktoken_rs_load_ms"));
        let p = last_json(&run_capture(
            venv.python()
                .arg("xtask/peers/tiktoken_bench.py")
                .arg("--bpe")
                .arg(&bpe)
                .arg("--load"),
        )?)
        .context("tiktoken load output")?;
        python_loads.push(num(&p, "load_ms"));
    }
    let (keel_load, tiktoken_rs_load, python_load) =
        (median(keel_loads), median(rs_loads), median(python_loads));
    let version = peer["tiktoken_version"].as_str().unwrap_or("?");

    println!("{:<34} {:>10}", "o200k_base counting", "MB/s");
    println!("{:<34} {keel_1:>10.1}", "keel-token, 1 thread");
    println!("{:<34} {keel_2:>10.1}", "keel-token, 2 threads");
    println!(
        "{:<34} {tiktoken_rs:>10.1}",
        "tiktoken-rs 0.12.1 encode_ordinary"
    );
    println!(
        "{:<34} {python:>10.1}",
        format!("Python tiktoken {version}")
    );
    println!(
        "ratio vs Python tiktoken: {:.2}x (1 thread), {:.2}x (2 threads)",
        keel_1 / python,
        keel_2 / python
    );

    println!(
        "loading o200k_base: keel-token {keel_load:.1} ms (first count), tiktoken-rs {tiktoken_rs_load:.1} ms, Python tiktoken {python_load:.1} ms"
    );

    let (ours, theirs) = (keel["tokens"].as_u64(), peer["tokens"].as_u64());
    match (ours, theirs) {
        (Some(a), Some(b)) if a == b => println!("tokens: keel-token {a} = tiktoken {b}"),
        _ => bail!("token counts differ: keel-token {ours:?}, tiktoken {theirs:?}"),
    }
    let section = "token counting (o200k_base)";
    let workload = format!(
        "{:.2} MB of this repository's .rs/.md, repeated",
        size as f64 / 1e6
    );
    let peer = Some(python);
    Ok(vec![
        Row::faster(
            section,
            format!("{workload}; keel 1 thread"),
            "MB/s",
            Some(keel_1),
            "Python tiktoken",
            peer,
        )
        .note("same token count on both sides"),
        Row::faster(
            section,
            format!("{workload}; keel 2 threads"),
            "MB/s",
            Some(keel_2),
            "Python tiktoken",
            peer,
        ),
        Row::faster(
            section,
            format!("{workload}; tiktoken-rs encode_ordinary"),
            "MB/s",
            Some(tiktoken_rs),
            "Python tiktoken",
            peer,
        )
        .note("tiktoken-rs in keel's place, for reference"),
        Row::faster(
            section,
            "loading o200k_base (a process's first count)",
            "ms",
            Some(keel_load),
            "Python tiktoken",
            Some(python_load),
        )
        .smaller()
        .note(format!(
            "median of {LOAD_RUNS} processes a side; tiktoken-rs's o200k_base() {tiktoken_rs_load:.1} ms"
        )),
    ])
}

/// The last line of `out` that is a JSON object.
fn last_json(out: &str) -> Result<Value> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line")?;
    Ok(serde_json::from_str(line)?)
}

/// Writes the corpus; returns its path and how many files went into it.
fn write_corpus() -> Result<(PathBuf, usize)> {
    let root = root();
    let mut files = Vec::new();
    collect(&root, &root, &mut files)?;
    files.sort();
    let mut one = String::new();
    for rel in &files {
        let text =
            std::fs::read_to_string(root.join(rel)).with_context(|| format!("reading {rel}"))?;
        one.push_str(&text);
    }
    if one.is_empty() {
        bail!("no .rs or .md files found under {}", root.display());
    }
    let mut corpus = String::with_capacity(CORPUS_BYTES + one.len());
    while corpus.len() < CORPUS_BYTES {
        corpus.push_str(&one);
    }
    let dir = root.join("target").join("bench");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("token-corpus.txt");
    std::fs::write(&path, corpus)?;
    Ok((path, files.len()))
}

/// Every `.rs` and `.md` file under `dir`, as `/`-separated paths relative to `root`,
/// skipping `target/` and hidden directories.
fn collect(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            if name.starts_with('.') || (dir == root && name == "target") {
                continue;
            }
            collect(root, &path, out)?;
        } else if kind.is_file() && (name.ends_with(".rs") || name.ends_with(".md")) {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(parts.join("/"));
        }
    }
    Ok(())
}

/// The `o200k_base.tiktoken` file in tiktoken-rs's crate sources.
fn o200k_file() -> Result<PathBuf> {
    let meta = run_capture(cargo().args(["metadata", "--format-version", "1"]))?;
    let meta: Value = serde_json::from_str(&meta).context("cargo metadata output")?;
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "tiktoken-rs")
        .and_then(|p| p["manifest_path"].as_str())
        .context("tiktoken-rs is not in the dependency graph")?;
    let file = Path::new(manifest)
        .parent()
        .context("tiktoken-rs manifest has no directory")?
        .join("assets")
        .join("o200k_base.tiktoken");
    if !file.is_file() {
        bail!("{} not found (run `cargo fetch`)", file.display());
    }
    Ok(file)
}
