//! `keel`: the command line of keel.
//!
//! * `keel demo` runs the compacting agent on embedded defaults (a SQLite file and an
//!   offload store under `./.keel/`, extractive summaries, exact token counts, no
//!   server) over a real directory, and writes a report and a chart.
//! * `keel replay` replays recorded agent runs through keel's compaction and reports
//!   what it would have saved.
//! * `keel run` runs the agent against a real model server.
//! * `keel threads` lists, shows, prunes and deletes stored threads.
//!
//! Every command prints `--help` with examples. Settings come from flags, then the
//! environment, then `keel.toml` (in the working directory, or `--config`).

mod chart;
mod config;
mod demo;
mod fleet;
mod formats;
mod live;
mod model;
mod replay;
mod scenario;
mod store;
mod threads;
mod ui;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// `keel --version`: the version and the versions of the stored formats this build
/// reads and writes, which tell two binaries of one version apart for an upgrade.
static LONG_VERSION: std::sync::LazyLock<String> = std::sync::LazyLock::new(long_version);

fn long_version() -> String {
    format!(
        "{}\nstored formats: checkpoints (SQLite {}, PostgreSQL migration {}), offload store (SQLite {}, PostgreSQL {}), run queue {}",
        env!("CARGO_PKG_VERSION"),
        keel::sqlite::SCHEMA_VERSION,
        keel::postgres::MIGRATIONS
            .iter()
            .map(|m| m.version)
            .max()
            .unwrap_or(0),
        keel::offload::SQLITE_SCHEMA_VERSION,
        keel::offload::POSTGRES_SCHEMA_VERSION,
        keel_fleet::SCHEMA_VERSION,
    )
}

/// One line for errors about stored formats: this build's version and the formats it
/// knows.
pub fn version_line() -> String {
    format!("this is keel {}", LONG_VERSION.replace('\n', "; "))
}

/// keel keeps long-running LLM agents on course: a durable graph runtime plus the
/// context management that stops agents drifting after hundreds of steps.
#[derive(Debug, Parser)]
#[command(
    name = "keel",
    version,
    long_version = LONG_VERSION.as_str(),
    propagate_version = true,
    after_help = EXAMPLES
)]
struct Cli {
    /// Settings file (default: `keel.toml` in the working directory, if present).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,

    #[command(subcommand)]
    command: Command,
}

const EXAMPLES: &str = "\
Examples:
  keel demo                                 the compacting agent over this directory, no server
  keel replay ../shared/data --window 8000  what compaction would have saved on recorded runs
  keel run --model ollama/qwen2.5:0.5b --goal \"Summarize the README\"
  keel threads list                         threads in ./.keel/keel.sqlite (or DATABASE_URL)

Run `keel <command> --help` for each command's options.

Exit codes: 0 success; 1 an error (a sentence on stderr says what to do); 2 bad usage;
3 the demo's final answer was wrong; 4 `keel replay` skipped files it could not read;
5 `keel run` stopped before the model answered (--max-steps, say; the thread resumes);
130 stopped by Ctrl-C after a step (the thread resumes); 143 `keel run` stopped by
SIGTERM after a step (the thread resumes).";

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the compacting agent over a real directory on embedded defaults.
    Demo(demo::DemoArgs),
    /// Replay recorded agent runs and report what compaction would save.
    Replay(replay::ReplayArgs),
    /// Run the agent against a real model server (Ollama or OpenAI-compatible).
    Run(live::RunArgs),
    /// List, inspect, prune and delete stored threads.
    Threads(threads::ThreadsArgs),
    /// Queue a run for a thread in the fleet's Postgres; prints its id.
    Submit(fleet::SubmitArgs),
    /// Run queued runs from the fleet's Postgres until Ctrl-C.
    Worker(fleet::WorkerArgs),
    /// Where a queued run is (or every run of a thread).
    Status(fleet::StatusArgs),
    /// Cancel a queued or running run.
    Cancel(fleet::CancelArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    ui::init_tracing();
    let settings = match config::Settings::load(cli.config.as_deref()) {
        Ok(s) => s,
        Err(e) => return ui::fail(&e),
    };
    store::use_schema(settings.schema());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return ui::fail(&anyhow::Error::new(e).context("cannot start the async runtime"));
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Demo(args) => demo::run(args, &settings).await,
            Command::Replay(args) => replay::run(args, &settings).await,
            Command::Run(args) => live::run(args, &settings).await,
            Command::Threads(args) => threads::run(args, &settings).await,
            Command::Submit(args) => fleet::submit(args, &settings).await,
            Command::Worker(args) => fleet::worker(args, &settings).await,
            Command::Status(args) => fleet::status(args, &settings).await,
            Command::Cancel(args) => fleet::cancel(args, &settings).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => ui::fail(&e),
    }
}
