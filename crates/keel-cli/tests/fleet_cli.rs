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
        // A read of the threads said "cannot read keel's tables", as if they were bad.
        vec!["threads", "list", "--database-url", NOWHERE],
        vec!["threads", "show", "t", "--database-url", NOWHERE],
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

/// Held by the tests that use the database: one starts a worker, which would claim
/// the runs another leaves queued for a moment.
static DB: std::sync::Mutex<()> = std::sync::Mutex::new(());

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

/// Removes `thread` from the database (its checkpoints, archive and runs), so the
/// tests leave nothing behind in a database they were given.
fn forget(url: &str, thread: &str) {
    let (out, stdout, stderr) = run(&["threads", "delete", "--database-url", url, thread]);
    assert!(out.status.success(), "{stdout}{stderr}");
}

/// Submits the goal "What is here?" to `thread` on `url`; returns the run id.
fn submit_goal(url: &str, thread: &str) -> String {
    let (out, stdout, stderr) = run(&[
        "submit",
        "--database-url",
        url,
        "--thread",
        thread,
        "--goal",
        "What is here?",
    ]);
    assert!(out.status.success(), "{stderr}");
    stdout.trim().to_owned()
}

#[test]
fn submits_a_worker_could_not_run_are_refused_at_once() {
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
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
    forget(&url, &thread);
}

/// A TCP proxy to the database that can cut every connection and refuse new ones,
/// as a database server going away does.
struct Proxy {
    port: u16,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(target: String) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (o, c) = (open.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if !o.load(Ordering::SeqCst) {
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                let mut held = c.lock().unwrap();
                held.push(client.try_clone().unwrap());
                held.push(server.try_clone().unwrap());
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, open, conns }
    }

    fn set_open(&self, open: bool) {
        self.open.store(open, std::sync::atomic::Ordering::SeqCst);
        if !open {
            for conn in self.conns.lock().unwrap().drain(..) {
                let _ = conn.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// A child process killed when dropped (a failed assertion leaves no worker running).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads lines from a child's pipe into a shared buffer.
fn collect(pipe: impl std::io::Read + Send + 'static) -> std::sync::Arc<std::sync::Mutex<String>> {
    let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let t = text.clone();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            let mut t = t.lock().unwrap();
            t.push_str(&line);
            t.push('\n');
        }
    });
    text
}

/// A `keel worker --model scripted` on `url` with `extra` flags, rooted at `dir`: the
/// process (killed when dropped) and what it prints to stdout and stderr.
type Printed = std::sync::Arc<std::sync::Mutex<String>>;
fn worker(url: &str, extra: &[&str], dir: &tempfile::TempDir) -> (Killed, Printed, Printed) {
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .args(["worker", "--database-url", url, "--model", "scripted"])
        .args(extra)
        .arg("--dir")
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Killed(child);
    let stdout = collect(child.0.stdout.take().unwrap());
    let stderr = collect(child.0.stderr.take().unwrap());
    (child, stdout, stderr)
}

fn wait_until(what: &str, text: &std::sync::Mutex<String>, f: impl Fn(&str) -> bool) {
    let start = std::time::Instant::now();
    while !f(&text.lock().unwrap()) {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "not {what} after 60 s: {}",
            text.lock().unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn a_worker_says_when_its_database_goes_away_and_comes_back() {
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // postgres://user@host:port/db: the proxy stands in for host:port.
    let Some((before, rest)) = url.split_once('@') else {
        eprintln!("skipped: DATABASE_URL has no user@host part to put a proxy in");
        return;
    };
    let Some((target, after)) = rest.split_once('/') else {
        eprintln!("skipped: DATABASE_URL has no /database part");
        return;
    };
    let target = if target.contains(':') {
        target.to_owned()
    } else {
        format!("{target}:5432")
    };
    let proxy = Proxy::start(target);
    let proxied = format!("{before}@127.0.0.1:{}/{after}", proxy.port);
    // The queue's tables exist before the worker starts (a submit creates them).
    let thread = format!("fleet-cli-away-{}", std::process::id());
    let run_id = submit_goal(&proxied, &thread);

    let dir = tempfile::tempdir().unwrap();
    let (child, stdout, stderr) = worker(&proxied, &["--concurrency", "2", "--lease", "2"], &dir);
    wait_until("ran the submitted run", &stdout, |t| {
        t.contains(&format!("run {run_id}"))
    });

    proxy.set_open(false);
    wait_until("said it cannot claim", &stderr, |t| {
        t.contains("cannot claim runs from the queue at")
    });
    // Two slots, many retries: one line.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(
        stderr.lock().unwrap().matches("cannot claim runs").count(),
        1,
        "{}",
        stderr.lock().unwrap()
    );

    proxy.set_open(true);
    wait_until("said the queue answers again", &stderr, |t| {
        t.contains("answers again")
    });
    drop(child);
    assert_eq!(
        stderr.lock().unwrap().matches("answers again").count(),
        1,
        "{}",
        stderr.lock().unwrap()
    );
    // The worker is gone; its run, if it was still running, is cancelled first.
    let (out, _, err) = run(&["cancel", "--database-url", &url, &run_id]);
    assert!(out.status.success(), "{err}");
    forget(&url, &thread);
}

#[test]
fn submit_wait_asks_whether_a_worker_runs_when_none_takes_the_run() {
    // It used to wait without a word for as long as no worker ran.
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let thread = format!("fleet-cli-wait-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .args(["submit", "--database-url", &url, "--thread", &thread])
        .args(["--goal", "What is here?", "--wait"])
        .current_dir(dir.path())
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = collect(child.stdout.take().unwrap());
    let stderr = collect(child.stderr.take().unwrap());
    let _child = Killed(child);
    wait_until("asking for a worker", &stderr, |t| {
        t.contains("still queued after 5 s") && t.contains("keel worker")
    });
    // The run stays queued; nothing else may take it from this test's database.
    let run_id = stdout.lock().unwrap().trim().to_owned();
    assert!(!run_id.is_empty(), "{}", stderr.lock().unwrap());
    let (out, _, err) = run(&["cancel", "--database-url", &url, &run_id]);
    assert!(out.status.success(), "{err}");
    forget(&url, &thread);
}

#[test]
fn submit_wait_exits_5_when_the_run_stops_before_an_answer() {
    // It exited 0, so a script could not tell a stop from an answer (`keel run` exits 5).
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let thread = format!("fleet-cli-stopped-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.md"), "# Notes\nNothing much.\n").unwrap();
    let (_worker, _, _) = worker(&url, &["--max-steps", "1"], &dir);
    let (out, stdout, stderr) = run(&[
        "submit",
        "--database-url",
        &url,
        "--thread",
        &thread,
        "--goal",
        "What is here?",
        "--wait",
    ]);
    assert_eq!(out.status.code(), Some(5), "{stdout}{stderr}");
    assert!(stdout.contains("done, stopped early"), "{stdout}");
    forget(&url, &thread);
}

#[test]
fn gc_keeps_an_idle_thread_whose_fleet_run_is_in_flight() {
    // `keel threads gc` used to delete the checkpoints of every thread idle by its
    // checkpoints, also one whose run waited for a worker or was held by one in a long
    // model call: the worker's next write then failed, and the thread was lost.
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let thread = format!("fleet-cli-gc-{}", std::process::id());
    let first = submit_goal(&url, &thread);

    // A worker runs the goal to its end, which stores the thread's checkpoints.
    let dir = tempfile::tempdir().unwrap();
    let (child, worker_out, _worker_err) = worker(&url, &[], &dir);
    wait_until("ran the goal", &worker_out, |t| {
        t.contains(&format!("run {first}"))
    });
    let done = || {
        let (out, stdout, stderr) = run(&["status", "--database-url", &url, &first, "--json"]);
        assert!(out.status.success(), "{stderr}");
        stdout.contains("\"done\"")
    };
    let start = std::time::Instant::now();
    while !done() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "run {first} not done"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    drop(child);

    // A follow-up waits in the queue, with no worker to take it.
    let (out, stdout, stderr) = run(&[
        "submit",
        "--database-url",
        &url,
        "--thread",
        &thread,
        "--message",
        "And the tests?",
    ]);
    assert!(out.status.success(), "{stderr}");
    let queued = stdout.trim().to_owned();

    let gc = || {
        let (out, stdout, stderr) = run(&[
            "threads",
            "gc",
            "--database-url",
            &url,
            "--older-than",
            "0s",
            "--dry-run",
            "--json",
        ]);
        assert!(out.status.success(), "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let names = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().or(t["thread"].as_str()).unwrap().to_owned())
            .collect()
    };
    let plan = gc();
    assert!(!names(&plan["would_delete"]).contains(&thread), "{plan}");
    let kept = plan["kept_in_flight"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["thread"] == thread.as_str())
        .unwrap_or_else(|| panic!("{plan}"));
    assert_eq!(kept["run"], queued.as_str(), "{plan}");
    assert_eq!(kept["status"], "queued", "{plan}");

    // Once the run is cancelled the thread is idle and would go.
    let (out, _, stderr) = run(&["cancel", "--database-url", &url, &queued]);
    assert!(out.status.success(), "{stderr}");
    let plan = gc();
    assert!(names(&plan["would_delete"]).contains(&thread), "{plan}");
    forget(&url, &thread);
}

#[test]
fn keel_schema_puts_the_queue_and_the_threads_in_that_schema() {
    // A library deployment may keep keel's tables in a schema of its own
    // (`PostgresConfig::schema`, `QueueOptions::schema`); the CLI used only `public`.
    let Some(url) = database_url() else { return };
    let _db = DB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let thread = format!("fleet-cli-schema-{}", std::process::id());
    // `keel args` with keel's tables in `schema`; what it printed, once it succeeded.
    let in_schema_named = |schema: &str, args: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let out = keel()
            .current_dir(dir.path())
            .env("KEEL_SCHEMA", schema)
            .args(args)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {stdout}{stderr}");
        stdout
    };
    let in_schema = |args: &[&str]| in_schema_named("keel_cli_schema_test", args);
    let submit = ["submit", "--database-url", &url, "--thread", &thread];
    let run_id = in_schema(&[&submit[..], &["--goal", "What is here?"]].concat());
    let run_id = run_id.trim();
    let status = ["status", "--database-url", &url, "--thread", &thread];
    assert!(in_schema(&status).contains(run_id));
    // Queued only, with or without checkpoint tables in the schema yet (`keel submit`
    // creates only the queue's): listed, and shown with its run.
    let listed: serde_json::Value = serde_json::from_str(&in_schema(&[
        "threads",
        "list",
        "--json",
        "--database-url",
        &url,
    ]))
    .unwrap();
    let row = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["thread"] == thread.as_str())
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(row["queue_only"], true, "{row}");
    assert_eq!(row["namespaces"], 0, "{row}");
    let shown = in_schema(&["threads", "show", "--database-url", &url, &thread]);
    assert!(
        shown.contains("no checkpoint yet") && shown.contains(run_id),
        "{shown}"
    );
    // A dry run reads only: it created keel's tables in a schema that had none.
    let dry_run = "keel_cli_dry_run_test";
    let gc = ["threads", "gc", "--older-than", "0s", "--dry-run", "--json"];
    let stdout = in_schema_named(dry_run, &[&gc[..], &["--database-url", &url]].concat());
    let dry: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(dry["would_delete"], serde_json::json!([]), "{dry}");
    let text = in_schema_named(dry_run, &["threads", "list", "--database-url", &url]);
    assert!(
        text.contains("no keel tables in schema keel_cli_dry_run_test"),
        "the dry run left tables behind: {text}"
    );
    // The default schema's queue knows nothing of it.
    let (_, stdout, stderr) = run(&status);
    assert!(
        !stdout.contains(run_id) && !stderr.contains(run_id),
        "{stdout}{stderr}"
    );
    assert!(in_schema(&["cancel", "--database-url", &url, run_id]).contains("cancelled"));
    in_schema(&["threads", "delete", "--database-url", &url, &thread]);
    assert!(!in_schema(&status).contains(run_id));
}
