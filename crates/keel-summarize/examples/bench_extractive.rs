//! Extractive summarizer throughput over real transcript text.
//!
//! Concatenates the trajectories in `../shared/data` (tau-bench and SWE-agent, as
//! messages) until the text passes ~10 MB, then times `summarize_sync` over the whole
//! span at once and in milestone-sized slices of 20 messages. Without the data folder
//! it says so and uses generated agent-like text. Prints one JSON line per case with
//! the median of the repetitions.
//!
//! `cargo run --release -p keel-summarize --example bench_extractive -- [reps] [--show]`

use std::path::PathBuf;
use std::time::Instant;

use keel_message::{Message, ToolCall, openai};
use keel_summarize::{ExtractiveSummarizer, SummaryRequest};
use serde_json::{Value, json};

const TARGET_BYTES: usize = 10 * 1024 * 1024;

fn data_dir() -> PathBuf {
    std::env::var_os("KEEL_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"))
}

fn real_trajectories() -> Option<Vec<Vec<Message>>> {
    let dir = data_dir();
    let tau: Vec<Value> =
        serde_json::from_slice(&std::fs::read(dir.join("tau-bench/gpt-4o-airline.json")).ok()?)
            .ok()?;
    let mut out: Vec<Vec<Message>> = tau
        .iter()
        .filter_map(|r| openai::from_values(r["traj"].as_array()?).ok())
        .collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("swe-agent"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "traj"))
        .collect();
    files.sort();
    for f in files {
        let v: Value = serde_json::from_slice(&std::fs::read(f).ok()?).ok()?;
        out.push(
            v["history"]
                .as_array()?
                .iter()
                .filter_map(|m| openai::from_value(m).ok())
                .collect(),
        );
    }
    Some(out)
}

fn generated() -> Vec<Vec<Message>> {
    (0..200)
        .map(|i| {
            let mut run = vec![Message::user(format!(
                "Fix issue #{i}: the parser drops the last line."
            ))];
            for step in 0..20 {
                run.push(
                    Message::assistant(format!(
                        "Step {step}: I will inspect src/parser_{i}.rs because the tail is lost."
                    ))
                    .with_tool_calls(vec![ToolCall::new(
                        format!("c{i}_{step}"),
                        "bash",
                        json!({"command": format!("cargo test parser_{step}")}),
                    )]),
                );
                let mut out = String::new();
                for line in 0..60 {
                    out.push_str(&format!(
                        "test parser::case_{line} ... ok ({} ms)\n",
                        line * 3 + step
                    ));
                }
                out.push_str(&format!(
                    "error[E0308]: mismatched types at src/parser_{i}.rs:{step}:9\nexit code 101\n"
                ));
                run.push(Message::tool(format!("c{i}_{step}"), out));
            }
            run
        })
        .collect()
}

fn text_bytes(messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| {
            m.text().len()
                + m.tool_calls
                    .iter()
                    .map(|c| c.name.len() + c.arguments.to_json_string().len())
                    .sum::<usize>()
        })
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let reps: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(11);
    let show = args.iter().any(|a| a == "--show");
    let (runs, source) = match real_trajectories() {
        Some(r) => (r, "shared/data (tau-bench + swe-agent)"),
        None => {
            eprintln!(
                "{} not found: using generated agent-like text instead",
                data_dir().display()
            );
            (generated(), "generated")
        }
    };
    let mut all: Vec<Message> = Vec::new();
    let mut copies = 0;
    while text_bytes(&all) < TARGET_BYTES {
        for run in &runs {
            all.extend(
                run.iter()
                    .filter(|m| m.role != keel_message::Role::System)
                    .cloned(),
            );
        }
        copies += 1;
    }
    let bytes = text_bytes(&all);
    eprintln!(
        "extractive: {} messages, {:.1} MB of text from {source} ({copies} pass(es) over {} trajectories), {reps} repetitions",
        all.len(),
        bytes as f64 / 1e6,
        runs.len()
    );
    let summarizer = ExtractiveSummarizer::new();
    if show && let Some(run) = runs.iter().max_by_key(|r| text_bytes(r)) {
        match summarizer.summarize_sync(&SummaryRequest::milestone(run, 600)) {
            Ok(s) => eprintln!(
                "--- sample summary (largest trajectory, 600 tokens) ---\n{}",
                s.text
            ),
            Err(e) => eprintln!("sample failed: {e}"),
        }
    }
    let cases: [(&str, usize); 2] = [
        ("whole span at once", all.len()),
        ("slices of 20 messages", 20),
    ];
    for (name, slice) in cases {
        let mut secs = Vec::new();
        for _ in 0..reps {
            let start = Instant::now();
            let mut kept = 0usize;
            for part in all.chunks(slice) {
                match summarizer.summarize_sync(&SummaryRequest::milestone(part, 800)) {
                    Ok(s) => kept += s.text.len(),
                    Err(e) => {
                        eprintln!("summarize failed: {e}");
                        std::process::exit(1);
                    }
                }
            }
            secs.push(start.elapsed().as_secs_f64());
            std::hint::black_box(kept);
        }
        let med = median(secs);
        println!(
            "{}",
            json!({
                "bench": "extractive",
                "case": name,
                "source": source,
                "bytes": bytes,
                "median_s": med,
                "mb_per_s": bytes as f64 / 1e6 / med,
            })
        );
    }
}
