//! Every eval passes (so `cargo test --workspace` runs them in CI). The resume eval's
#![allow(clippy::panic)]
//! child is this test binary run again with `--ignored --exact resume_child`.

use keel_evals::{Outcome, resume};

fn check(outcome: Result<Outcome, keel_evals::EvalError>) {
    match outcome {
        Ok(o) => {
            println!("{o}");
            assert!(o.passed(), "{o}");
        }
        Err(e) => panic!("the eval could not run: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn continue_after_compaction() {
    check(keel_evals::continuation::run().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn needle() {
    check(keel_evals::needle::run(None).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn intent_and_next_steps() {
    check(keel_evals::intent::run(None).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn goal_fidelity() {
    check(keel_evals::goal::run().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn adversarial_errors() {
    check(keel_evals::adversarial::run().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn large_result() {
    check(keel_evals::large::run().await);
}

#[tokio::test(flavor = "multi_thread")]
async fn resume_after_kill() {
    check(
        resume::run(|| {
            let mut c = tokio::process::Command::new(
                std::env::current_exe().unwrap_or_else(|e| panic!("no test binary: {e}")),
            );
            c.args([
                "--ignored",
                "--exact",
                "resume_child",
                "--nocapture",
                "--quiet",
            ]);
            c
        })
        .await,
    );
}

/// The child process of `resume_after_kill`: does nothing unless its variable is set.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "child process of resume_after_kill; it runs it"]
async fn resume_child() {
    if let Err(e) = resume::child_main().await {
        panic!("{e}");
    }
}
