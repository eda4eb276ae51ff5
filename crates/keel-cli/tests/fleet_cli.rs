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
