//! A fleet of worker *processes* killed with SIGKILL and restarted, twice: as plain
//! processes (`killed_worker_processes_lose_nothing_and_never_share_a_thread`) and each
//! in a network namespace of its own
//! (`killed_worker_processes_in_network_namespaces_lose_nothing`). Both submit 50
//! threads of 100 steps — each step an `echo` call and a call of keel-agent's file
//! tools (write, read, grep, list notes in the thread's own directory) — run three
//! worker processes on one PostgreSQL, kill one at a moment a seeded RNG picks, 20
//! times, and start a new one in its place. Every thread must finish with the state of
//! an uninterrupted run (raw messages, milestones, epoch), everything that left a
//! context must be in the archive, every archive must read back, record for record,
//! as the uninterrupted run's from a process in each of the three places (each
//! namespace), and no thread may have been run by two processes at once: the tool log
//! of each thread, in order, must never return to a process after another one took
//! over.
//!
//! The namespaced variant makes three namespaces (`ip netns`), each with a veth pair on
//! a private /30 and `lo` up and nothing else, and forwards a port on each host-side
//! address to the database (which listens on loopback) from this process; worker `i`
//! runs under `ip netns exec` in namespace `i` with a `DATABASE_URL` on its forwarder.
//! Where namespaces cannot be made (not root, no `ip`) it prints why and passes, even
//! under `CI=true`; the plain variant runs everywhere. The namespaces and veths are
//! removed on every way out, and leftovers of dead test processes at the start.
//!
//! The workers are this test binary run again with `--ignored --exact worker_process`
//! (`archive_reader` for the archive check): the ignored tests do the work when
//! `KEEL_FLEET_CHILD` (`KEEL_FLEET_READER`) is set. `KEEL_FLEET_SEED` replays a run's
//! kill moments. Without `DATABASE_URL` the tests print why they are skipped (fail
//! under `CI=true`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Db, Echo, INTERRUPTED_WRITES, archived, database_url, goal, reference_with, summary};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_fleet::{Queue, QueueOptions, RunId, RunInput, RunStatus, Worker};
use keel_offload::{OffloadStore, PostgresStore, PostgresStoreOptions};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};

/// Set (to the schema) in a worker process.
const CHILD: &str = "KEEL_FLEET_CHILD";
/// Set (to the schema) in an archive reader process.
const READER: &str = "KEEL_FLEET_READER";
/// The base directory of the threads' file tools.
const FILES: &str = "KEEL_FLEET_FILES";
/// The worker's name.
const NAME: &str = "KEEL_FLEET_NAME";
/// The threads an archive reader reads, comma-separated.
const THREADS_TO_READ: &str = "KEEL_FLEET_THREADS";
/// Replays the kill moments of a run.
const SEED: &str = "KEEL_FLEET_SEED";
/// How an archive reader's lines start.
const ARCHIVE_LINE: &str = "keel-fleet archive\t";

const STEPS: u64 = 100;
const THREADS: usize = 50;
const PROCESSES: usize = 3;
const SLOTS: usize = 3;
const KILLS: usize = 20;
/// Each echo call's sleep, in milliseconds. The sleeps alone keep the fleet busy for
/// `THREADS * (STEPS - 1) * DELAY_MS / (PROCESSES * SLOTS)` = 11 s however fast the
/// runtime is (it used to be the runtime's slowness that left time for the kills).
const DELAY_MS: u64 = 20;
const DELAY: Duration = Duration::from_millis(DELAY_MS);
/// The wait before each kill, in milliseconds: uniform in this range, so all 20 kills
/// (at most 9 s) land before the fleet can possibly finish (checked below).
const KILL_GAP: std::ops::RangeInclusive<u64> = 100..=450;
const _: () = assert!(
    (KILLS as u64) * *KILL_GAP.end()
        < THREADS as u64 * (STEPS - 1) * DELAY_MS / (PROCESSES * SLOTS) as u64,
    "the kills must all land before the tools' sleeps alone could end the fleet"
);
const DEADLINE: Duration = Duration::from_secs(300);

/// The two fleet tests run one after the other: each has the two cores (and the
/// database's connections) to itself.
static ONE_FLEET: Mutex<()> = Mutex::new(());

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn store(url: &str, schema: &str) -> PostgresStore {
    PostgresStore::connect_with(
        url,
        PostgresStoreOptions::new()
            .schema(schema)
            .unwrap()
            .pool_size(4),
    )
    .unwrap()
}

fn echo(url: &str, schema: &str, log: (deadpool_postgres::Pool, String), files: PathBuf) -> Echo {
    let mut echo = Echo::new(STEPS);
    echo.store = Arc::new(store(url, schema));
    echo.delay = DELAY;
    echo.log = Some(log);
    echo.files = Some(files);
    echo
}

/// A worker process: runs until it is killed.
#[test]
#[ignore = "a worker process of the fleet tests; they run it"]
fn worker_process() {
    let Ok(schema) = std::env::var(CHILD) else {
        return;
    };
    // The test holds our stdin: when it ends, however it ends, so do we.
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let url = std::env::var("DATABASE_URL").unwrap();
    let files = PathBuf::from(std::env::var(FILES).unwrap());
    let queue = Queue::connect_with(
        &url,
        QueueOptions::new()
            .schema(schema.clone())
            .unwrap()
            .pool_size(6),
    )
    .unwrap();
    let config = PostgresConfig::new(&url)
        .unwrap()
        .schema(schema.clone())
        .unwrap()
        .pool_size(6);
    let saver = Arc::new(PostgresSaver::connect(&config).unwrap());
    let log = (queue.pool().clone(), format!("\"{schema}\".fleet_log"));
    let echo = echo(&url, &schema, log, files);
    let name = format!("{}-p{}", std::env::var(NAME).unwrap(), std::process::id());
    let worker = Worker::builder(queue, saver)
        .agent(echo.agent(&name))
        .name(name)
        .concurrency(SLOTS)
        .lease(Duration::from_secs(3))
        .heartbeat(Duration::from_millis(250))
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    runtime().block_on(async {
        worker.run(std::future::pending()).await.unwrap();
    });
}

/// An archive reader process: prints the archive of each thread it is given, one line
/// each (see [`archived`]).
#[test]
#[ignore = "an archive reader of the fleet tests; they run it"]
fn archive_reader() {
    let Ok(schema) = std::env::var(READER) else {
        return;
    };
    let url = std::env::var("DATABASE_URL").unwrap();
    let store: Arc<dyn OffloadStore> = Arc::new(store(&url, &schema));
    for thread in std::env::var(THREADS_TO_READ).unwrap().split(',') {
        let records = Value::from(archived(store.clone(), thread));
        println!("{ARCHIVE_LINE}{thread}\t{records}");
    }
}

/// Where the fleet's processes run.
enum Hosts {
    /// Plain processes on the database URL as given.
    Plain(String),
    /// Process `i` in network namespace `i`, on the URL of its forwarder.
    Netns(Netns),
}

impl Hosts {
    fn label(&self) -> &'static str {
        match self {
            Hosts::Plain(_) => "procs",
            Hosts::Netns(_) => "netns",
        }
    }

    /// This test binary running one ignored test, in place `slot`.
    fn command(&self, slot: usize, test: &str) -> Process {
        let exe = std::env::current_exe().unwrap();
        let (mut cmd, url) = match self {
            Hosts::Plain(url) => (Process::new(exe), url),
            Hosts::Netns(n) => {
                let mut cmd = Process::new("ip");
                cmd.args(["netns", "exec", &n.names[slot]]).arg(exe);
                (cmd, &n.urls[slot])
            }
        };
        cmd.args(["--ignored", "--exact", test, "--nocapture", "--quiet"])
            .env("DATABASE_URL", url);
        cmd
    }
}

/// The namespaces (`<prefix><pid>n<i>`), their veth pairs (host end
/// `<prefix><pid>h<i>`) and the forwarders of one test process; removed when dropped,
/// or at a SIGINT, SIGTERM or SIGHUP (see [`undo_later`]).
struct Netns {
    names: Vec<String>,
    urls: Vec<String>,
    forwarders: Vec<tokio::task::JoinHandle<()>>,
    /// The `ip` commands that remove what was made, in the order made.
    undo: Vec<Vec<String>>,
}

const NETNS_PREFIX: &str = "kfl";

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Process::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("`ip` cannot be run: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What the namespaced tests of this process have made and not removed yet.
static UNDO: Mutex<Vec<Vec<String>>> = Mutex::new(Vec::new());

/// Records how to remove something just made. The first call starts a thread that, at
/// SIGINT, SIGTERM or SIGHUP, removes everything recorded and ends the process (so a
/// test interrupted by hand leaves nothing behind; the workers see their stdin close
/// and exit).
fn undo_later(netns: &mut Netns, args: &[&str]) {
    static WATCH: std::sync::Once = std::sync::Once::new();
    WATCH.call_once(|| {
        std::thread::spawn(|| {
            use tokio::signal::unix::{SignalKind, signal};
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let code = rt.block_on(async {
                let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
                    signal(SignalKind::interrupt()),
                    signal(SignalKind::terminate()),
                    signal(SignalKind::hangup()),
                ) else {
                    return None;
                };
                tokio::select! {
                    _ = int.recv() => Some(130),
                    _ = term.recv() => Some(143),
                    _ = hup.recv() => Some(129),
                }
            });
            let Some(code) = code else { return };
            let undo = std::mem::take(&mut *UNDO.lock().unwrap_or_else(|e| e.into_inner()));
            for args in undo.iter().rev() {
                let _ = ip(&args.iter().map(String::as_str).collect::<Vec<_>>());
            }
            std::process::exit(code);
        });
    });
    let args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
    UNDO.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(args.clone());
    netns.undo.push(args);
}

impl Netns {
    /// Three namespaces wired to the database at `url`, or why they cannot be made.
    fn new(rt: &tokio::runtime::Runtime, url: &str) -> Result<Netns, String> {
        remove_leftovers();
        let upstream = upstream(url)?;
        let pid = std::process::id();
        let net = free_subnet(pid)?;
        let mut made = Netns {
            names: Vec::new(),
            urls: Vec::new(),
            forwarders: Vec::new(),
            undo: Vec::new(),
        };
        for i in 0..PROCESSES {
            let ns = format!("{NETNS_PREFIX}{pid}n{i}");
            ip(&["netns", "add", &ns])?;
            undo_later(&mut made, &["netns", "del", &ns]);
            made.names.push(ns.clone());
            let (host, inner) = (
                format!("{NETNS_PREFIX}{pid}h{i}"),
                format!("{NETNS_PREFIX}{pid}c{i}"),
            );
            ip(&[
                "link", "add", &host, "type", "veth", "peer", "name", &inner, "netns", &ns,
            ])?;
            undo_later(&mut made, &["link", "del", &host]);
            let host_ip = format!("{net}.{}", 4 * i + 1);
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host])?;
            ip(&["link", "set", &host, "up"])?;
            let inner_ip = format!("{net}.{}/30", 4 * i + 2);
            ip(&["-n", &ns, "addr", "add", &inner_ip, "dev", &inner])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let listener = rt
                .block_on(TcpListener::bind((host_ip.as_str(), 0)))
                .map_err(|e| format!("cannot listen on {host_ip}: {e}"))?;
            let local = listener.local_addr().map_err(|e| e.to_string())?;
            made.urls.push(with_host(url, &local.to_string())?);
            made.forwarders
                .push(rt.spawn(forward(listener, upstream.clone())));
        }
        Ok(made)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for f in &self.forwarders {
            f.abort();
        }
        for args in self.undo.iter().rev() {
            let _ = ip(&args.iter().map(String::as_str).collect::<Vec<_>>());
            UNDO.lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|a| a != args);
        }
    }
}

/// Removes namespaces and veths of this test whose process is gone.
fn remove_leftovers() {
    let dead = |name: &str, kind: char| {
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            return false;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        rest[digits.len()..].starts_with(kind)
            && digits
                .parse::<u32>()
                .is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    for line in ip(&["-o", "link", "show"]).unwrap_or_default().lines() {
        // "12: kfl123h0@if11: <...>"
        if let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next())
            && dead(name, 'h')
        {
            let _ = ip(&["link", "del", name]);
        }
    }
    for line in ip(&["netns", "list"]).unwrap_or_default().lines() {
        if let Some(name) = line.split_whitespace().next()
            && dead(name, 'n')
        {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// A /24 of 10/8 that no interface of this machine is in: `10.a.b`.
fn free_subnet(pid: u32) -> Result<String, String> {
    let taken = ip(&["-o", "-4", "addr", "show"])?;
    (0..256)
        .map(|k| format!("10.{}.{}", 200 + (pid / 256 + k) % 50, (pid + k) % 256))
        .find(|net| !taken.contains(&format!("inet {net}.")))
        .ok_or_else(|| "no free 10.x.y.0/24 for the namespaces".to_owned())
}

/// The database's TCP address in `url`.
fn upstream(url: &str) -> Result<(String, u16), String> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| format!("DATABASE_URL: {e}"))?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => return Err("DATABASE_URL names no TCP host to forward to".to_owned()),
    };
    Ok((host, config.get_ports().first().copied().unwrap_or(5432)))
}

/// `url` (a `postgres://` URL) with its host and port replaced by `host_port`.
fn with_host(url: &str, host_port: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or("DATABASE_URL is not a postgres:// URL")?;
    let scheme = &url[..url.len() - rest.len()];
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let user = authority.rfind('@').map_or("", |at| &authority[..=at]);
    Ok(format!("{scheme}{user}{host_port}{tail}"))
}

/// Forwards every connection to `listener` to `to`.
async fn forward(listener: TcpListener, to: (String, u16)) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let to = to.clone();
        tokio::spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect((to.0.as_str(), to.1)).await {
                // As the client and the server do: without it, Nagle's algorithm and
                // delayed acks hold each small reply for tens of milliseconds.
                let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// The generator of the kill moments and victims, from a seed it prints.
fn rng(label: &str) -> fastrand::Rng {
    let seed = std::env::var(SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("fleet ({label}): seed {seed} (replay the kill moments with {SEED}={seed})");
    fastrand::Rng::with_seed(seed)
}

/// The worker processes, one per place, and which place each pid ran in.
struct Fleet<'a> {
    hosts: &'a Hosts,
    schema: String,
    files: PathBuf,
    children: Vec<Child>,
    place_of: HashMap<i32, usize>,
}

impl Fleet<'_> {
    fn start<'a>(hosts: &'a Hosts, schema: &str, files: &Path) -> Fleet<'a> {
        let mut fleet = Fleet {
            hosts,
            schema: schema.to_owned(),
            files: files.to_owned(),
            children: Vec::new(),
            place_of: HashMap::new(),
        };
        for slot in 0..PROCESSES {
            let child = fleet.spawn(slot);
            fleet.children.push(child);
        }
        fleet
    }

    fn spawn(&mut self, slot: usize) -> Child {
        let child = self
            .hosts
            .command(slot, "worker_process")
            .env(CHILD, &self.schema)
            .env(FILES, &self.files)
            .env(NAME, format!("{}{slot}", self.hosts.label()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        self.place_of.insert(child.id() as i32, slot);
        child
    }

    /// SIGKILL, and a new process in its place.
    fn kill(&mut self, slot: usize) {
        self.children[slot].kill().unwrap();
        self.children[slot].wait().unwrap();
        self.children[slot] = self.spawn(slot);
    }
}

impl Drop for Fleet<'_> {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What an uninterrupted run of each thread ends with: its summary and its archive.
async fn references(dir: PathBuf, threads: Vec<String>) -> HashMap<String, (Value, Vec<Value>)> {
    let runs = threads.into_iter().map(|thread| {
        let dir = dir.clone();
        async move {
            let mut echo = Echo::new(STEPS);
            echo.files = Some(dir);
            let state = reference_with(&echo, &thread, &[]).await;
            let archive = archived(echo.store.clone(), &thread);
            (thread, (state, archive))
        }
    });
    futures::future::join_all(runs).await.into_iter().collect()
}

#[test]
fn killed_worker_processes_lose_nothing_and_never_share_a_thread() {
    let Some(url) = database_url() else { return };
    let _one = ONE_FLEET.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    fleet(&rt, &Hosts::Plain(url.clone()), &url);
}

#[test]
fn killed_worker_processes_in_network_namespaces_lose_nothing() {
    let Some(url) = database_url() else { return };
    let _one = ONE_FLEET.lock().unwrap_or_else(|e| e.into_inner());
    let rt = runtime();
    let netns = match Netns::new(&rt, &url) {
        Ok(netns) => netns,
        Err(reason) => {
            eprintln!("keel-fleet network namespace test: skipped: {reason}");
            return;
        }
    };
    fleet(&rt, &Hosts::Netns(netns), &url);
}

/// The test: submit, run the fleet under kills, check every thread (see the module).
fn fleet(rt: &tokio::runtime::Runtime, hosts: &Hosts, url: &str) {
    let label = hosts.label();
    let mut rng = rng(label);
    let threads: Vec<String> = (0..THREADS).map(|i| format!("thread-{i}")).collect();
    let (db, runs) = rt.block_on(async {
        let db = Db::new(url, label).await;
        db.sql(
            "CREATE TABLE {s}.fleet_log (id bigserial PRIMARY KEY, thread text NOT NULL, \
             n bigint NOT NULL, pid integer NOT NULL)",
        )
        .await;
        // Many kills may land on one run: it must not run out of attempts.
        let submit = Queue::connect_with(
            url,
            QueueOptions::new()
                .schema(db.schema.clone())
                .unwrap()
                .pool_size(2)
                .max_attempts(1_000),
        )
        .unwrap();
        let mut runs: Vec<(String, RunId)> = Vec::new();
        for t in &threads {
            let run = submit
                .submit(t, RunInput::new().goal(goal(t)))
                .await
                .unwrap();
            runs.push((t.clone(), run));
        }
        (db, runs)
    });
    // The offload tables, before the workers race to create them.
    drop(store(url, &db.schema));
    let files = tempfile::tempdir().unwrap();
    let reference_files = tempfile::tempdir().unwrap();
    let references = rt.spawn(references(
        reference_files.path().to_owned(),
        threads.clone(),
    ));

    let all_done = || {
        rt.block_on(async {
            let mut done = 0;
            for (_, run) in &runs {
                if matches!(
                    db.queue.status(*run).await.unwrap().status,
                    RunStatus::Done { .. }
                ) {
                    done += 1;
                }
            }
            done == runs.len()
        })
    };

    let start = Instant::now();
    let mut fleet = Fleet::start(hosts, &db.schema, files.path());
    let mut kills = 0;
    loop {
        std::thread::sleep(Duration::from_millis(rng.u64(KILL_GAP)));
        if all_done() {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the fleet did not finish in {DEADLINE:?} ({kills} kills)"
        );
        if kills < KILLS {
            fleet.kill(rng.usize(..PROCESSES));
            kills += 1;
        }
    }
    let ran_for = start.elapsed();
    let place_of = std::mem::take(&mut fleet.place_of);
    drop(fleet);
    assert_eq!(
        kills, KILLS,
        "only {kills} kills landed before the fleet finished"
    );

    let checks = Instant::now();
    let references = rt.block_on(references).unwrap();
    let (takeovers, mut in_context, finished_in, tool_calls, moved) = rt.block_on(async {
        let reader = Echo::new(STEPS)
            .agent("reader")
            .checkpointer(db.saver.clone())
            .build()
            .unwrap();
        let mut takeovers = 0;
        // The tool call ids in each thread's context at the end.
        let mut in_context: HashMap<String, Vec<String>> = HashMap::new();
        for (thread, run) in &runs {
            let info = db.queue.status(*run).await.unwrap();
            match &info.status {
                RunStatus::Done { result, .. } => {
                    assert_eq!(
                        result.answer.as_deref(),
                        Some(format!("Reached {STEPS}.").as_str()),
                        "{thread}"
                    );
                }
                other => panic!("{thread}: {other:?}"),
            }
            if info.attempts > 1 {
                takeovers += 1;
            }
            let state = reader.state(thread).await.unwrap().unwrap();
            assert_eq!(summary(&state), references[thread].0, "{thread}");
            let ids = state.messages.iter().filter_map(|m| m.tool_call_id.clone());
            in_context.insert(thread.clone(), ids.collect());
        }
        assert!(takeovers >= 1, "no run was taken over ({kills} kills)");

        // No thread went back to a process after another took it over.
        let client = db.queue.pool().get().await.unwrap();
        let rows = client
            .query(
                &format!(
                    "SELECT thread, pid FROM \"{}\".fleet_log ORDER BY id",
                    db.schema
                ),
                &[],
            )
            .await
            .unwrap();
        let mut segments: HashMap<String, Vec<i32>> = HashMap::new();
        for row in &rows {
            let pids = segments.entry(row.get(0)).or_default();
            let pid: i32 = row.get(1);
            if pids.last() != Some(&pid) {
                assert!(
                    !pids.contains(&pid),
                    "thread {} went back to process {pid} after {pids:?}",
                    row.get::<_, String>(0)
                );
                pids.push(pid);
            }
        }
        let moved = segments.values().filter(|p| p.len() > 1).count();
        // Where each thread made its last step.
        let finished_in: HashMap<String, usize> = segments
            .iter()
            .map(|(t, pids)| (t.clone(), place_of[pids.last().unwrap()]))
            .collect();
        (takeovers, in_context, finished_in, rows.len(), moved)
    });

    // Every archive reads back the same from a process in each place.
    let readers: Vec<Child> = (0..PROCESSES)
        .map(|slot| {
            hosts
                .command(slot, "archive_reader")
                .env(READER, &db.schema)
                .env(THREADS_TO_READ, threads.join(","))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut read_elsewhere = 0;
    for (slot, reader) in readers.into_iter().enumerate() {
        let out = reader.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "archive reader {slot}: {}",
            out.status
        );
        let mut read = 0;
        for line in String::from_utf8(out.stdout).unwrap().lines() {
            let Some(line) = line.strip_prefix(ARCHIVE_LINE) else {
                continue;
            };
            let (thread, records) = line.split_once('\t').unwrap();
            let records: Vec<Value> = serde_json::from_str(records).unwrap();
            assert_eq!(
                records, references[thread].1,
                "{thread}: its archive read in place {slot}"
            );
            // Nothing lost: each echo that left the context is in the archive.
            if let Some(mut ids) = in_context.remove(thread) {
                ids.extend(
                    records
                        .iter()
                        .filter_map(|r| r[2].as_str().map(str::to_owned)),
                );
                for n in 0..STEPS {
                    assert!(
                        ids.contains(&format!("c{n}")),
                        "{thread}: step {n} left the context but is not archived"
                    );
                }
            }
            read += 1;
            if finished_in[thread] != slot {
                read_elsewhere += 1;
            }
        }
        assert_eq!(read, THREADS, "archive reader {slot} read {read} threads");
    }
    let interrupted_writes = std::fs::read_to_string(files.path().join(INTERRUPTED_WRITES))
        .map_or(0, |log| log.lines().count());
    let archived_records: usize = references.values().map(|r| r.1.len()).sum();
    let mut per_place = [0; PROCESSES];
    for place in finished_in.values() {
        per_place[*place] += 1;
    }
    let checks = checks.elapsed();
    eprintln!(
        "fleet ({label}): {THREADS} threads x {STEPS} steps in {:.1} s (checks {:.1} s), {kills} kills, \
         {takeovers} runs taken over, {moved} threads moved between processes, \
         {tool_calls} echo calls, {interrupted_writes} interrupted writes cleared; threads \
         finished per place {per_place:?}; \
         {archived_records} archived records read back in each of {PROCESSES} places \
         ({read_elsewhere} thread archives read outside the place that finished them)",
        ran_for.as_secs_f64(),
        checks.as_secs_f64()
    );
    rt.block_on(db.drop_schema());
}
