//! `keel-evals`: runs the targeted context evals and prints one line each.
//!
//! `keel-evals [--live] [--out DIR]`: the offline evals (deterministic, no model
//! server), or with `--live` the model-facing ones against `OPENAI_BASE_URL` /
//! `OLLAMA_BASE_URL`. Each eval's model calls go to `DIR/<name>.jsonl` (default
//! `target/evals`). Exits with 1 if any eval failed or could not run.

use std::path::PathBuf;
use std::process::ExitCode;

use keel_evals::{EvalError, Outcome, intent, live, needle, resume};

const NOT_MODEL_FACING: [&str; 5] = [
    keel_evals::continuation::NAME,
    keel_evals::goal::NAME,
    keel_evals::adversarial::NAME,
    keel_evals::large::NAME,
    resume::NAME,
];

fn usage() -> ExitCode {
    eprintln!("usage: keel-evals [--live] [--out DIR]");
    ExitCode::from(2)
}

fn child_command() -> tokio::process::Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("keel-evals"));
    tokio::process::Command::new(exe)
}

async fn offline() -> Vec<(&'static str, Result<Outcome, EvalError>)> {
    let mut out: Vec<(&'static str, Result<Outcome, EvalError>)> = vec![
        (
            keel_evals::continuation::NAME,
            keel_evals::continuation::run().await,
        ),
        (needle::NAME, needle::run(None).await),
        (intent::NAME, intent::run(None).await),
        (keel_evals::goal::NAME, keel_evals::goal::run().await),
        (
            keel_evals::adversarial::NAME,
            keel_evals::adversarial::run().await,
        ),
        (keel_evals::large::NAME, keel_evals::large::run().await),
    ];
    out.push((resume::NAME, resume::run(child_command).await));
    out
}

async fn live_evals() -> Result<Vec<(&'static str, Result<Outcome, EvalError>)>, EvalError> {
    let model = match live::from_env().await? {
        Ok(model) => model,
        Err(why) => {
            println!("live evals skipped: {why}");
            return Ok(Vec::new());
        }
    };
    println!("live model: {}", model.name);
    let mut out = vec![
        (needle::NAME, needle::run(Some(&model)).await),
        (intent::NAME, intent::run(Some(&model)).await),
    ];
    for name in NOT_MODEL_FACING {
        out.push((name, Ok(Outcome::skipped(name, "not model-facing"))));
    }
    Ok(out)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match resume::child_main().await {
        Ok(true) => return ExitCode::SUCCESS,
        Ok(false) => {}
        Err(e) => {
            eprintln!("keel-evals child: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut live_mode = false;
    let mut out_dir = PathBuf::from("target").join("evals");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--live" => live_mode = true,
            "--out" => match args.next() {
                Some(dir) => out_dir = PathBuf::from(dir),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    let results = if live_mode {
        match live_evals().await {
            Ok(r) => r,
            Err(e) => {
                println!("live evals: could not reach the model: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        offline().await
    };
    if let Err(e) = std::fs::create_dir_all(&out_dir) {
        eprintln!("cannot create {}: {e}", out_dir.display());
    }
    let mut failed = false;
    let (mut passed, total) = (0, results.len());
    for (name, result) in results {
        match result {
            Ok(outcome) => {
                println!("{outcome}");
                failed |= !outcome.ok();
                passed += usize::from(outcome.ok());
                if !outcome.transcript.is_empty() {
                    let path = out_dir.join(format!(
                        "{name}{}.jsonl",
                        if live_mode { "-live" } else { "" }
                    ));
                    let mut text = outcome.transcript.join("\n");
                    text.push('\n');
                    if let Err(e) = std::fs::write(&path, text) {
                        eprintln!("cannot write {}: {e}", path.display());
                    }
                }
            }
            Err(e) => {
                println!("{name:<26} FAIL    — could not run: {e}");
                failed = true;
            }
        }
    }
    println!(
        "{passed} of {total} evals passed{}",
        if live_mode { " (live)" } else { "" }
    );
    if live_mode || !failed {
        println!("transcripts: {}", out_dir.display());
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
