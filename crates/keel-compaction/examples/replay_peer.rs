//! keel's compaction replay beside a peer context manager that ran the same recorded
//! trajectories (Deep Agents, driven by `xtask/peers/deepagents_replay.py`), both
//! scored by one metric ([`score_prompts`], the code keel's own replay uses).
//!
//! ```sh
//! # 1. the runs keel's replay example uses (tau-bench with ≥40 messages, swe-agent), as OpenAI messages
//! cargo run --release -p keel-compaction --example replay_peer -- export --work target/bench/deepagents
//! # 2. the peer writes <work>/<window>/<dataset>/<run>.jsonl: each prompt its model received
//! python xtask/peers/deepagents_replay.py target/bench/deepagents 8000 15000 32000 128000
//! # 3. one table: keel and the peer per dataset and window, with ratios
//! cargo run --release -p keel-compaction --example replay_peer -- score --work target/bench/deepagents --windows 8000,15000,32000,128000
//! ```
//!
//! Options: `--data DIR` (default `../shared/data`), `--min-messages N` (40), `--peer
//! NAME` (the peer's name in the table), `--peer-unavailable REASON` (print the peer's
//! rows with that reason instead of reading its output).
//!
//! Both sides see the recording as it is (no needles are planted) and are scored on
//! the runs the peer replayed to the end; a run the peer could not replay is left out
//! of both sides and the row says how many and why. keel summarizes with its
//! extractive summarizer (no model calls, so no summarizer cost); the peer's
//! summarizer calls are counted from its log ([`external_summary_event`]).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use keel_compaction::Strategy;
use keel_compaction::replay::{
    ReplayConfig, Report, RunReport, Trajectory, external_summary_event, load_swe_agent_dir,
    load_tau_bench, replay_trajectory, score_prompts,
};
use keel_message::{Message, openai};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};
use serde_json::{Value, json};

type Error = Box<dyn std::error::Error>;

struct Args {
    mode: String,
    data: PathBuf,
    work: PathBuf,
    min_messages: usize,
    windows: Vec<usize>,
    peer: String,
    unavailable: Option<String>,
}

fn args() -> Result<Args, Error> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        raw.iter()
            .position(|a| a == flag)
            .and_then(|i| raw.get(i + 1))
            .cloned()
    };
    let mode = raw.first().cloned().unwrap_or_default();
    if mode != "export" && mode != "score" {
        return Err("usage: replay_peer export|score --work DIR [--data DIR] [--windows 8000,...] [--min-messages N] [--peer NAME] [--peer-unavailable REASON]".into());
    }
    let windows = value("--windows")
        .unwrap_or_else(|| "8000,15000,32000,128000".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<usize>, _>>()?;
    Ok(Args {
        mode,
        data: value("--data").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data"))
        }),
        work: value("--work")
            .map(PathBuf::from)
            .ok_or("--work DIR is required")?,
        min_messages: value("--min-messages")
            .map(|v| v.parse())
            .transpose()?
            .unwrap_or(40),
        windows,
        peer: value("--peer").unwrap_or_else(|| "deepagents".into()),
        unavailable: value("--peer-unavailable"),
    })
}

/// The runs keel's replay example compares: the long tau-bench runs and swe-agent.
fn datasets(a: &Args) -> Result<Vec<(&'static str, Vec<Trajectory>)>, Error> {
    let tau = load_tau_bench(&a.data.join("tau-bench/gpt-4o-airline.json"))?;
    let long = tau
        .into_iter()
        .filter(|t| t.messages.len() >= a.min_messages)
        .collect();
    let swe = load_swe_agent_dir(&a.data.join("swe-agent"))?;
    Ok(vec![("tau-bench", long), ("swe-agent", swe)])
}

/// A file name for a run: its id with anything but letters, digits, `.`, `_`, `-` as `_`.
fn file_of(dataset: &str, id: &str) -> String {
    let safe: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{dataset}/{safe}")
}

fn export(a: &Args) -> Result<(), Error> {
    let input = a.work.join("input");
    let mut manifest = Vec::new();
    for (dataset, runs) in datasets(a)? {
        std::fs::create_dir_all(input.join(dataset))?;
        for t in &runs {
            let file = format!("{}.json", file_of(dataset, &t.id));
            let body =
                json!({"dataset": dataset, "id": t.id, "messages": openai::to_values(&t.messages)});
            std::fs::write(input.join(&file), serde_json::to_vec(&body)?)?;
            manifest.push(json!({"dataset": dataset, "id": t.id, "file": file}));
        }
        eprintln!("exported {} {dataset} runs", runs.len());
    }
    std::fs::write(
        input.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest)?,
    )?;
    Ok(())
}

/// What the peer left for one run at one window.
struct PeerRun {
    report: RunReport,
    seconds: f64,
}

/// Reads and scores the peer's log of one run; `Err` says why it cannot be compared.
fn peer_run(
    path: &Path,
    t: &Trajectory,
    peer: &str,
    counter: &Arc<dyn TokenCounter>,
) -> Result<PeerRun, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("no output ({e})"))?;
    let mut prompts: Vec<Vec<Message>> = Vec::new();
    let mut summaries = Vec::new();
    let mut end = None;
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("bad log line: {e}"))?;
        let messages = || -> Result<Vec<Message>, String> {
            let list = v["messages"].as_array().cloned().unwrap_or_default();
            openai::from_values(&list).map_err(|e| format!("bad prompt: {e}"))
        };
        match v["kind"].as_str() {
            Some("prompt") => prompts.push(messages()?),
            Some("summary") => summaries.push((
                v["turn"].as_u64().unwrap_or(0) as usize,
                messages()?,
                v["summary"].as_str().unwrap_or_default().to_owned(),
                v["summarized"].as_u64().unwrap_or(0) as usize,
            )),
            Some("end") => end = Some(v.clone()),
            _ => {}
        }
    }
    let end = end.ok_or("the log has no end (the peer was stopped)")?;
    if let Some(e) = end["error"].as_str() {
        return Err(e.to_owned());
    }
    if end["desync"].as_u64().unwrap_or(0) > 0 {
        return Err("user messages between a tool call and the next reply".into());
    }
    let mut report = score_prompts(t, &prompts, Arc::clone(counter)).map_err(|e| e.to_string())?;
    for (turn, prompt, summary, summarized) in summaries {
        report.events.push(external_summary_event(
            turn,
            &prompt,
            &summary,
            summarized,
            &format!("{peer} (placeholder reply)"),
            &**counter,
        ));
    }
    Ok(PeerRun {
        report,
        seconds: end["seconds"].as_f64().unwrap_or(0.0),
    })
}

const HEADER: &str = "dataset    window side               runs turns  tokens sent(full→sent)  saved  cache-weighted(full→sent)  saved  cacheable over(full→sent) goal  recall  facts compactions    time";

fn row(side: &str, r: &Report, seconds: f64) -> String {
    format!(
        "{:<10} {:>6} {:<18} {:>4} {:>5} {:>10}→{:<10} {:>6.1}% {:>11.0}→{:<11.0} {:>6.1}% {:>8.1}% {:>6}→{:<6} {:>4.0}% {:>6.1}% {:>5} {:>11} {:>6.2}s",
        r.dataset,
        r.window,
        side,
        r.runs,
        r.turns,
        r.full_tokens,
        r.tokens,
        100.0 * r.token_reduction(),
        r.full_cost,
        r.cost,
        100.0 * r.cost_reduction(),
        100.0 * r.cacheable_share(),
        r.full_over_window,
        r.over_window,
        100.0 * r.goal_share(),
        100.0 * r.recall(),
        r.needed_facts,
        r.compactions,
        seconds,
    )
}

fn ratio(a: f64, b: f64) -> String {
    match a / b {
        r if !r.is_finite() => "-".into(),
        r if r < 0.1 => format!("{r:.4}x"),
        r => format!("{r:.2}x"),
    }
}

async fn score(a: &Args) -> Result<(), Error> {
    let counter: Arc<dyn TokenCounter> = Arc::new(MemoCounter::new(TiktokenCounter::o200k_base()?));
    println!(
        "keel vs {} on the same recorded runs, one scorer; ratios are keel/{}",
        a.peer, a.peer
    );
    println!("{HEADER}");
    for (dataset, runs) in datasets(a)? {
        for &window in &a.windows {
            // The peer's side first: which runs it replayed to the end.
            let mut peer_runs = Vec::new();
            let mut left_out: BTreeMap<String, usize> = BTreeMap::new();
            let mut kept: Vec<&Trajectory> = Vec::new();
            let mut peer_seconds = 0.0;
            if let Some(reason) = &a.unavailable {
                println!("{dataset:<10} {window:>6} {:<18} not run: {reason}", a.peer);
            } else {
                for t in &runs {
                    let path = a
                        .work
                        .join(window.to_string())
                        .join(format!("{}.jsonl", file_of(dataset, &t.id)));
                    match peer_run(&path, t, &a.peer, &counter) {
                        Ok(p) => {
                            peer_seconds += p.seconds;
                            peer_runs.push(p.report);
                            kept.push(t);
                        }
                        Err(why) => *left_out.entry(why).or_default() += 1,
                    }
                }
            }
            let keel_set: Vec<&Trajectory> = if a.unavailable.is_some() || kept.is_empty() {
                runs.iter().collect()
            } else {
                kept.clone()
            };
            let mut keel = Vec::new();
            for strategy in [
                Strategy::Hierarchical,
                Strategy::masking(),
                Strategy::hybrid(),
            ] {
                let mut config = ReplayConfig::new(window, strategy);
                // The peer sees the recording as it is: no needles.
                config.needles = 0;
                let started = Instant::now();
                let mut reports = Vec::new();
                for t in &keel_set {
                    reports.push(replay_trajectory(t, &config, Arc::clone(&counter)).await?);
                }
                let r = Report::from_runs(dataset, strategy.name(), window, &reports);
                let seconds = started.elapsed().as_secs_f64();
                println!("{}", row(&format!("keel {}", strategy.name()), &r, seconds));
                keel.push((r, seconds));
            }
            if a.unavailable.is_some() {
                continue;
            }
            for (why, n) in &left_out {
                println!(
                    "{dataset:<10} {window:>6} {:<18} {n} run(s) left out of both sides: {why}",
                    a.peer
                );
            }
            if peer_runs.is_empty() {
                println!("{dataset:<10} {window:>6} {:<18} no run to compare", a.peer);
                continue;
            }
            let p = Report::from_runs(dataset, &a.peer, window, &peer_runs);
            println!("{}", row(&a.peer, &p, peer_seconds));
            println!(
                "{dataset:<10} {window:>6} {:<18} its summarizer: {} calls, {} prompt and {} output tokens, {:.0} of its cache-weighted cost",
                a.peer,
                p.compactions,
                p.summary_input_tokens,
                p.summary_output_tokens,
                p.summary_cost(),
            );
            let (k, k_seconds) = &keel[0];
            println!(
                "{dataset:<10} {window:>6} {:<18} tokens sent {}, cache-weighted cost {}, cacheable turns {}, goal kept {}, recall {}, time {}",
                format!("keel/{}", a.peer),
                ratio(k.tokens as f64, p.tokens as f64),
                ratio(k.cost, p.cost),
                ratio(k.cacheable_share(), p.cacheable_share()),
                ratio(k.goal_share(), p.goal_share()),
                ratio(k.recall(), p.recall()),
                ratio(*k_seconds, peer_seconds),
            );
        }
    }
    println!(
        "\nkeel/{peer} compares keel's default (hierarchical). {peer}'s summaries are a fixed placeholder (its recall is a lower bound); its summarizer's prompts count at full price, the replies at the output price; keel summarizes extractively (no model call). LangChain re-serializes the recorded tool-call arguments (json.dumps spacing), so {peer}'s prompts run a little over the full history where it never summarizes. Times: keel's replay against the peer's whole driven agent (graph, checkpoints, tools), so only their ratio within one run means anything.",
        peer = a.peer
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let a = args()?;
    match a.mode.as_str() {
        "export" => export(&a),
        _ => score(&a).await,
    }
}
