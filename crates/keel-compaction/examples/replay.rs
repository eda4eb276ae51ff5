//! Replays the recorded trajectories in `../shared/data` (or a directory given as the
//! first argument) through each compaction strategy at several forced windows, and
//! prints what a model would have been sent compared with the full history.
//!
//! ```sh
//! cargo run --release -p keel-compaction --example replay -- [data-dir] [--min-messages N] [--show-missed] [--speed-only]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use keel_compaction::replay::{
    ReplayConfig, Report, load_swe_agent_dir, load_tau_bench, replay_all,
};
use keel_compaction::{StepTrigger, Strategy};
use keel_token::{MemoCounter, TiktokenCounter, TokenCounter};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: replay [data-dir] [--min-messages N] [--show-missed] [--speed-only]\n\
             data-dir holds tau-bench/gpt-4o-airline.json and swe-agent/ (default: ../shared/data beside the repository)"
        );
        return Ok(());
    }
    let dir = args
        .iter()
        .find(|a| !a.starts_with("--") && a.parse::<usize>().is_err())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data"))
        });
    let min_messages: usize = args
        .iter()
        .position(|a| a == "--min-messages")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    // --show-missed: list the needed facts each run's prompt lacked.
    let show_missed = args.iter().any(|a| a == "--show-missed");
    let counter: Arc<dyn TokenCounter> = Arc::new(MemoCounter::new(TiktokenCounter::o200k_base()?));

    let tau_file = dir.join("tau-bench/gpt-4o-airline.json");
    if !tau_file.is_file() {
        eprintln!(
            "no recorded runs at {}: give the data directory (it holds tau-bench/gpt-4o-airline.json and swe-agent/) as the first argument",
            dir.display()
        );
        std::process::exit(1);
    }
    let tau = load_tau_bench(&tau_file)?;
    // Speed: every tau-bench run, extractive summaries; the first pass warms the
    // counter's tables, then the median of 5 timed passes.
    let mut times = Vec::new();
    for _ in 0..6 {
        let memo = Arc::new(MemoCounter::new(TiktokenCounter::o200k_base()?));
        let fresh: Arc<dyn TokenCounter> = memo.clone();
        let started = Instant::now();
        replay_all(
            &tau,
            &ReplayConfig::new(8_000, Strategy::Hierarchical),
            fresh,
        )
        .await?;
        times.push(started.elapsed().as_secs_f64());
        if std::env::var("KEEL_MEMO_STATS").is_ok() {
            eprintln!("{:?}", memo.stats());
        }
    }
    let mut timed = times[1..].to_vec();
    timed.sort_by(f64::total_cmp);
    println!(
        "replayed all {} tau-bench runs ({} turns; hierarchical, 8,000 window, extractive summaries) in {:.3}s (median of 5)",
        tau.len(),
        tau.iter().map(|t| t.turns()).sum::<usize>(),
        timed[2]
    );
    if args.iter().any(|a| a == "--speed-only") {
        return Ok(());
    }
    let long: Vec<_> = tau
        .iter()
        .filter(|t| t.messages.len() >= min_messages)
        .cloned()
        .collect();
    let swe = load_swe_agent_dir(&dir.join("swe-agent"))?;
    println!(
        "tau-bench: {} runs with ≥{min_messages} messages; swe-agent: {} runs\n",
        long.len(),
        swe.len()
    );

    let strategies = [
        Strategy::Hierarchical,
        Strategy::masking(),
        Strategy::hybrid(),
    ];
    println!("{}", Report::HEADER);
    // The long tau-bench runs, all 200 of them (`tau-all`), and swe-agent.
    for (label, set) in [("tau-bench", &long), ("tau-all", &tau), ("swe-agent", &swe)] {
        for window in [8_000, 15_000, 32_000, 128_000] {
            for strategy in strategies {
                let mut config = ReplayConfig::new(window, strategy);
                let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
                if let Some(v) = env("KEEL_KEEP") {
                    config.compaction.keep_recent_tokens = Some(v);
                }
                if let Some(v) = env("KEEL_MBUDGET") {
                    config.compaction.milestone_budget_tokens = Some(v);
                }
                if let Some(v) = env("KEEL_EBUDGET") {
                    config.compaction.epoch_budget_tokens = Some(v);
                }
                if let Some(v) = env("KEEL_EVERY") {
                    config.compaction.every_steps = (v > 0).then_some(v);
                }
                if let Some(v) = env("KEEL_FRACTION") {
                    config.compaction.window_fraction = v as f64 / 100.0;
                }
                let started = Instant::now();
                if let Some(v) = env("KEEL_RATIO") {
                    config.compaction.summary_ratio = v as f64 / 100.0;
                }
                if let Some(v) = env("KEEL_PAYBACK") {
                    config.compaction.step_trigger = StepTrigger::WhenItPays {
                        payback_steps: v as u32,
                    };
                }
                let (_, runs) = replay_all(set, &config, Arc::clone(&counter)).await?;
                let report = Report::from_config(label, &config, &runs);
                println!("{report}  [{:.2}s]", started.elapsed().as_secs_f64());
                if show_missed {
                    for run in &runs {
                        for f in run.facts.iter().filter(|f| !f.in_prompt) {
                            println!("    missed {} turn {}: {}", run.id, f.turn, f.fact);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
