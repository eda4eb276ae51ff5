//! The fleet commands (`keel submit`, `worker`, `status`, `cancel`) end to end: flag
//! values refused before anything runs, what an unreachable database is called, and
//! submits a worker could not run, refused at once.
//!
//! The tests that need Postgres use `DATABASE_URL` (skipped without it, failing under
//! `CI=true`); they start no worker and cancel every run they leave queued, so they
//! leave nothing for another test's worker to claim.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;

use assert_cmd::Command;

fn keel() -> Command {
    let mut cmd = Command::cargo_bin("keel").unwrap();
    for var in [
        "KEEL_HOME",
        "KEEL_MODEL",
        "KEEL_WINDOW",
        "DATABASE_URL",
        "OLLAMA_BASE_URL",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("NO_COLOR", "1");
    cmd
}

fn run(args: &[&str]) -> (Output, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = keel().current_dir(dir.path()).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// A Postgres URL nothing listens at.
const NOWHERE: &str = "postgres://postgres@127.0.0.1:1/fleet";

#[test]
fn a_lease_longer_than_a_day_is_a_usage_error() {
    // It used to start a worker whose every claim failed (the lease overflowed the
    // database's interval arithmetic), silently running nothing.
    let (out, stdout, stderr) = run(&[
        "worker",
        "--database-url",
        NOWHERE,
        "--model",
        "scripted",
        "--lease",
        "99999999999999",
    ]);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains("--lease") && stderr.contains("at most 86400"),
        "{stderr}"
    );
}

#[test]
fn status_and_cancel_on_an_unreachable_database_say_so() {
    // They used to say "no usable run queue ...: `keel submit` creates it", advice that
    // fits a database without the queue's tables, not a server that cannot be reached.
    for args in [
        vec!["status", "--database-url", NOWHERE, "--thread", "t"],
        vec![
            "cancel",
            "--database-url",
            NOWHERE,
            "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80",
        ],
    ] {
        let (out, stdout, stderr) = run(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{stdout}");
        assert!(
            stderr.contains("cannot reach Postgres at postgres://postgres@127.0.0.1:1/fleet")
                && !stderr.contains("creates it"),
            "{args:?}: {stderr}"
        );
    }
}

fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but DATABASE_URL is unset: the fleet CLI tests must run in CI")
        }
        _ => {
            eprintln!(
                "skipped: DATABASE_URL is unset, so the fleet CLI tests did not run (cargo xtask test starts a throwaway cluster)"
            );
            None
        }
    }
}

#[test]
fn submits_a_worker_could_not_run_are_refused_at_once() {
    let Some(url) = database_url() else { return };
    let thread = format!("fleet-cli-goal-{}", std::process::id());
    let submit = |args: &[&str]| {
        let mut all = vec!["submit", "--database-url", &url, "--thread", &thread];
        all.extend_from_slice(args);
        run(&all)
    };
    let (out, stdout, stderr) = submit(&["--goal", "What is here?"]);
    assert!(out.status.success(), "{stderr}");
    let first = stdout.trim().to_owned();

    // An interrupting message would cancel the queued run that carries the thread's
    // goal: it used to be queued, then fail on a worker for want of a goal.
    let (out, stdout, stderr) = submit(&["--message", "Stop.", "--policy", "interrupt"]);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.is_empty()
            && stderr.contains("no goal yet")
            && stderr.contains(&first)
            && stderr.contains("--policy enqueue"),
        "{stderr}"
    );

    // A second goal behind the queued one: it used to be queued, then fail.
    let (out, stdout, stderr) = submit(&["--goal", "Another.", "--policy", "enqueue"]);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(
        stdout.is_empty()
            && stderr.contains("already has a goal, from run")
            && stderr.contains(&first)
            && stderr.contains("--message"),
        "{stderr}"
    );

    // Nothing was queued but the first run; leave nothing for a worker to claim.
    let (out, stdout, stderr) = run(&[
        "status",
        "--database-url",
        &url,
        "--thread",
        &thread,
        "--json",
    ]);
    assert!(out.status.success(), "{stderr}");
    let runs: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(runs.as_array().unwrap().len(), 1, "{stdout}");
    let (out, _, stderr) = run(&["cancel", "--database-url", &url, &first]);
    assert!(out.status.success(), "{stderr}");
}
