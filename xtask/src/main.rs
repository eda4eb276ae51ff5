//! keel's project automation, run as `cargo xtask <command>`.
//!
//! * `ci` — everything CI checks: fmt, clippy (all targets and features, `-D warnings`),
//!   the tests, and cargo-deny when it is installed.
//! * `test` — the test suite (the README's test command).
//! * `bench` — benchmarks, side by side with the Python peers.
//! * `eval` — the targeted context evals (`--live`: the model-facing ones on a real
//!   server).
//! * `gen-vectors` — regenerate differential test vectors from LangGraph's Python code.
//! * `fuzz` — run the cargo-fuzz targets of `fuzz/` for a while each (not part of `ci`,
//!   which replays their corpora through the tests).

use clap::{Parser, Subcommand};

mod bench;
mod ci;
mod eval;
mod fuzz;
mod llm;
mod node;
mod pg;
mod python;
mod vectors;

mod util;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "keel project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// fmt --check, clippy -D warnings, tests, cargo-deny (when installed).
    Ci,
    /// Run the whole test suite.
    Test {
        /// Extra arguments passed to `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks beside their peers: one group (`token`, `graph`, ...), or `all` (the
    /// default), which writes one table to docs/benchmarks.md.
    Bench {
        /// Which benchmark group to run.
        #[arg(default_value = "all")]
        target: String,
        /// One repetition per size and smaller agent-loop sizes (said so in the file).
        #[arg(long)]
        quick: bool,
    },
    /// The targeted context evals (tests/evals): goal, intent, needle, continuation,
    /// resume, large and adversarial, each a line with what it measured against its
    /// limit, then a count of those passed; transcripts under target/evals. What each
    /// proves: docs/architecture.md, "keel-evals".
    Eval {
        /// Run the model-facing evals against OPENAI_BASE_URL / OLLAMA_BASE_URL.
        #[arg(long)]
        live: bool,
    },
    /// Live provider and summarizer tests against OLLAMA_BASE_URL / OPENAI_BASE_URL (skips when neither is set).
    LlmLive,
    /// Regenerate the differential test vectors from LangGraph's Python `add_messages`.
    GenVectors,
    /// Run the cargo-fuzz targets (nightly; installs cargo-fuzz if missing) for a while
    /// each; fails naming the targets that crashed and their artifacts.
    Fuzz {
        /// libFuzzer time per target, in seconds.
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Targets to run (default: all of them).
        #[arg(value_parser = clap::builder::PossibleValuesParser::new(fuzz::TARGETS))]
        targets: Vec<String>,
    },
}

fn main() -> std::process::ExitCode {
    let done = match Cli::parse().command {
        Command::Ci => ci::ci(),
        Command::Test { args } => ci::test(&args),
        Command::Bench { target, quick } => bench::bench(&target, quick),
        Command::Eval { live } => eval::eval(live),
        Command::LlmLive => llm::live(),
        Command::GenVectors => vectors::gen_vectors(),
        Command::Fuzz { seconds, targets } => fuzz::fuzz(seconds, &targets),
    };
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The message and its causes, without the backtrace `RUST_BACKTRACE` would add:
        // a failed step is the command that failed, not a place in xtask.
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
