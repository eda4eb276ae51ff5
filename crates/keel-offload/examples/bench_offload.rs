//! The offload benchmark workloads, for `cargo xtask bench offload` (which runs this
//! in release mode, adds the `grep -c` / ripgrep peers and prints the table). Each
//! measurement prints one JSON line with the median over the repetitions.
//!
//! Usage (`cargo run --release -p keel-offload --example bench_offload -- ...`):
//!
//! * `evict <work dir> [reps]` — evict and stub 1,000 tool results of 100 KB each,
//!   with the tiktoken `o200k_base` and the approximate counter, into a file store
//!   (fsync off and on) and a memory store.
//! * `append <work dir> [reps]` — archive appends, one message per call and in
//!   batches, fsync off; one message per call with fsync on.
//! * `archive <dir>` — make sure a 1 GiB archive exists under `<dir>` (generating it
//!   when missing) and print its path.
//! * `grep <dir> <pattern> [reps]` — count matching lines of that archive with the
//!   store's grep (the `regex` crate).
//! * `index <dir> [reps]` — rebuild the archive index from the 1 GiB file, then fetch
//!   messages by id.
//! * `lineage <work dir> [reps]` — what lineages cost an unforked thread: archive
//!   appends (`Archive::append` against `append_in`), grep and line reads of the
//!   archive and of a large result (the store itself against a `LineageStore` view),
//!   puts of large results, and the check after each compaction
//!   (`Lineage::sees_all`), on a file store (fsync off) and a memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use keel_message::{Message, ToolCall};
use keel_offload::{
    Archive, EvictLargeResults, FsStore, Fsync, GrepOptions, Key, LineRange, Lineage, LineageStore,
    MemoryStore, OffloadStore, Pattern, PolicyEnv, ThreadId,
};
use keel_token::{ApproxCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

const ARCHIVE_BYTES: u64 = 1 << 30;
const ARCHIVE_THREAD: &str = "bench-archive";
/// Bump when the generated content changes, so an old file is not reused.
const ARCHIVE_VERSION: &str = "keel-offload bench archive v1";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str);
    let reps = |i: usize, default: usize| arg(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    match arg(0) {
        Some("evict") => evict(Path::new(arg(1).expect("work dir")), reps(2, 5)),
        Some("append") => append(Path::new(arg(1).expect("work dir")), reps(2, 5)),
        Some("archive") => {
            let (path, generated) = ensure_archive(Path::new(arg(1).expect("dir")));
            println!(
                "{}",
                json!({"bench": "archive", "path": path, "bytes": size(&path), "generated": generated})
            );
        }
        Some("grep") => grep(
            Path::new(arg(1).expect("dir")),
            arg(2).expect("pattern"),
            reps(3, 5),
        ),
        Some("index") => index(Path::new(arg(1).expect("dir")), reps(2, 3)),
        Some("lineage") => lineage(Path::new(arg(1).expect("work dir")), reps(2, 5)),
        _ => panic!("usage: bench_offload evict|append|archive|grep|index|lineage ..."),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn word(&mut self) -> &'static str {
        WORDS[self.below(WORDS.len() as u64) as usize]
    }
}

const WORDS: &[&str] = &[
    "the",
    "request",
    "handler",
    "returned",
    "status",
    "cache",
    "miss",
    "for",
    "key",
    "user",
    "session",
    "token",
    "expired",
    "retrying",
    "after",
    "backoff",
    "of",
    "ms",
    "worker",
    "pool",
    "queue",
    "depth",
    "is",
    "now",
    "database",
    "query",
    "took",
    "rows",
    "scanned",
    "index",
    "build",
    "compiling",
    "crate",
    "warning",
    "unused",
    "variable",
    "function",
    "test",
    "passed",
    "failed",
    "assertion",
    "left",
    "right",
    "value",
    "expected",
    "found",
    "module",
    "import",
    "path",
    "file",
    "read",
    "write",
    "bytes",
    "offset",
    "line",
    "column",
    "error",
    "ok",
    "service",
    "health",
    "check",
    "upstream",
    "latency",
    "p99",
    "timeout",
    "config",
    "loaded",
    "from",
    "environment",
    "variable",
    "feature",
    "flag",
    "enabled",
    "disabled",
    "deploy",
    "staging",
    "production",
    "rollback",
    "commit",
    "branch",
    "merge",
    "conflict",
    "resolved",
    "agent",
    "tool",
    "call",
    "result",
    "summary",
    "milestone",
    "context",
    "window",
    "prompt",
];

/// About `bytes` of log-like text (ends with a newline).
fn log_text(rng: &mut Rng, bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 200);
    let mut n = 0u64;
    while s.len() < bytes {
        n += 1;
        s.push_str(&format!(
            "2025-06-{:02}T{:02}:{:02}:{:02}Z ",
            1 + rng.below(28),
            rng.below(24),
            rng.below(60),
            rng.below(60)
        ));
        s.push_str(["INFO ", "WARN ", "DEBUG ", "ERROR "][rng.below(4) as usize]);
        for _ in 0..(6 + rng.below(14)) {
            s.push_str(rng.word());
            s.push(' ');
        }
        s.push_str(&format!("id={} n={n}\n", rng.next() % 100_000));
    }
    s
}

// ---------------------------------------------------------------- evict

fn evict(work: &Path, reps: usize) {
    let mut rng = Rng(7);
    let results: Vec<Message> = (0..1000)
        .map(|i| {
            Message::tool(format!("call_{i}"), log_text(&mut rng, 100 * 1024))
                .with_id(format!("m{i}"))
        })
        .collect();
    let total_bytes: usize = results.iter().map(|m| m.text().len()).sum();
    let tiktoken = TiktokenCounter::o200k_base().unwrap();
    let approx = ApproxCounter::new();
    let tokens_each = tiktoken.count_text(&results[0].text());
    let counters: [(&str, &dyn TokenCounter); 2] =
        [("tiktoken o200k", &tiktoken), ("approx", &approx)];
    let policy = EvictLargeResults::new();
    for (counter_name, counter) in counters {
        for store_name in ["fs, fsync off", "fs, fsync on", "memory"] {
            let reps = if store_name == "fs, fsync on" {
                reps.min(3)
            } else {
                reps
            };
            let mut secs = Vec::new();
            for rep in 0..reps {
                let dir = work.join(format!("evict-{rep}"));
                let _ = std::fs::remove_dir_all(&dir);
                let store: Box<dyn OffloadStore> = match store_name {
                    "fs, fsync off" => {
                        Box::new(FsStore::new(&dir).unwrap().with_fsync(Fsync::Never))
                    }
                    "fs, fsync on" => {
                        Box::new(FsStore::new(&dir).unwrap().with_fsync(Fsync::Always))
                    }
                    _ => Box::new(MemoryStore::new()),
                };
                let thread = ThreadId::new(format!("rep-{rep}")).unwrap();
                let env = PolicyEnv::new(&*store, &thread, counter);
                let input = results.clone();
                let start = Instant::now();
                let out = policy.apply(input, &env);
                secs.push(start.elapsed().as_secs_f64());
                assert_eq!(out.stored.len(), 1000, "every result is over the threshold");
                assert!(out.is_complete());
                drop(store);
                let _ = std::fs::remove_dir_all(&dir);
            }
            let s = median(secs);
            println!(
                "{}",
                json!({
                    "bench": "evict", "counter": counter_name, "store": store_name, "results": 1000,
                    "bytes_each": total_bytes / 1000, "tokens_each": tokens_each, "median_s": s,
                    "results_per_s": 1000.0 / s, "mb_per_s": total_bytes as f64 / s / 1e6, "reps": reps,
                })
            );
        }
    }
}

// ---------------------------------------------------------------- append

/// A plausible history message of a few hundred bytes to a few KB.
fn history_message(rng: &mut Rng, i: u64) -> Message {
    let id = format!("msg-{i:08}");
    match i % 4 {
        0 => {
            let words = 20 + rng.below(60) as usize;
            Message::user(sentence(rng, words)).with_id(id)
        }
        1 => {
            let words = 10 + rng.below(30) as usize;
            Message::assistant(sentence(rng, words))
            .with_id(id)
            .with_tool_calls(vec![ToolCall::new(
                format!("call_{i}"),
                ["shell", "read_file", "grep", "write_file"][rng.below(4) as usize],
                json!({"path": format!("src/{}/{}.rs", rng.word(), rng.word()), "pattern": rng.word()}),
            )])
        }
        2 => {
            let len = 200 + rng.below(1800) as usize;
            let mut text = log_text(rng, len);
            let roll = rng.below(1000);
            if roll < 5 {
                text.push_str("rpc error: deadline exceeded while waiting for upstream\n");
            } else if roll < 8 {
                text.push_str(&format!(
                    "connection refused by peer on port {}\n",
                    1024 + rng.below(60_000)
                ));
            } else if roll < 10 {
                text.push_str(&format!(
                    "connection reset by peer on port {}\n",
                    1024 + rng.below(60_000)
                ));
            }
            Message::tool(format!("call_{}", i - 1), text).with_id(id)
        }
        _ => {
            let words = 30 + rng.below(120) as usize;
            Message::assistant(sentence(rng, words)).with_id(id)
        }
    }
}

fn sentence(rng: &mut Rng, words: usize) -> String {
    let mut s = String::new();
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(rng.word());
    }
    s.push('.');
    s
}

fn append(work: &Path, reps: usize) {
    let mut rng = Rng(11);
    let n = 100_000u64;
    let messages: Vec<Message> = (0..n).map(|i| history_message(&mut rng, i)).collect();
    let bytes: usize = messages
        .iter()
        .map(|m| serde_json::to_string(m).unwrap().len())
        .sum();
    let cases: [(&str, Fsync, usize, usize); 3] = [
        ("fsync off, 1 per call", Fsync::Never, 1, messages.len()),
        ("fsync off, 100 per call", Fsync::Never, 100, messages.len()),
        ("fsync on, 1 per call", Fsync::Always, 1, 1_000),
    ];
    for (name, fsync, batch, count) in cases {
        let mut secs = Vec::new();
        for rep in 0..reps {
            let dir = work.join(format!("append-{rep}"));
            let _ = std::fs::remove_dir_all(&dir);
            let store = Arc::new(FsStore::new(&dir).unwrap().with_fsync(fsync));
            let archive = Archive::new(store);
            let thread = ThreadId::new("t").unwrap();
            let start = Instant::now();
            for chunk in messages[..count].chunks(batch) {
                archive.append(&thread, chunk).unwrap();
            }
            secs.push(start.elapsed().as_secs_f64());
            assert_eq!(archive.len(&thread).unwrap(), count as u64);
            let _ = std::fs::remove_dir_all(&dir);
        }
        let s = median(secs);
        println!(
            "{}",
            json!({
                "bench": "append", "case": name, "messages": count, "median_s": s,
                "messages_per_s": count as f64 / s,
                "mb_per_s": bytes as f64 * (count as f64 / n as f64) / s / 1e6, "reps": reps,
            })
        );
    }
}

// ---------------------------------------------------------------- 1 GiB archive

/// The archive file, generating it if it is missing or from another version.
fn ensure_archive(dir: &Path) -> (PathBuf, bool) {
    let store = Arc::new(FsStore::new(dir).unwrap().with_fsync(Fsync::Never));
    let thread = ThreadId::new(ARCHIVE_THREAD).unwrap();
    let archive = Archive::new(store.clone());
    let path = dir.join(ARCHIVE_THREAD).join(Archive::DEFAULT_PATH);
    let marker = dir.join("COMPLETE");
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(ARCHIVE_VERSION)
        && size(&path) >= ARCHIVE_BYTES
    {
        return (path, false);
    }
    let _ = std::fs::remove_file(&marker);
    let _ = std::fs::remove_file(&path);
    eprintln!(
        "generating a 1 GiB archive at {} (once; reused afterwards)",
        path.display()
    );
    let start = Instant::now();
    let mut rng = Rng(42);
    let mut i = 0u64;
    while size(&path) < ARCHIVE_BYTES {
        let batch: Vec<Message> = (0..2_000)
            .map(|_| {
                i += 1;
                history_message(&mut rng, i)
            })
            .collect();
        archive.append(&thread, &batch).unwrap();
    }
    std::fs::write(&marker, ARCHIVE_VERSION).unwrap();
    eprintln!(
        "generated {} messages, {} bytes in {:.1} s",
        i,
        size(&path),
        start.elapsed().as_secs_f64()
    );
    (path, true)
}

fn grep(dir: &Path, pattern: &str, reps: usize) {
    let (path, _) = ensure_archive(dir);
    let bytes = size(&path);
    let store = FsStore::new(dir).unwrap();
    let thread = ThreadId::new(ARCHIVE_THREAD).unwrap();
    let archive_path = keel_offload::StorePath::new(Archive::DEFAULT_PATH).unwrap();
    let p = Pattern::new(pattern).unwrap();
    let options = GrepOptions {
        max_results: usize::MAX,
        max_line_bytes: 64,
    };
    let mut secs = Vec::new();
    let mut matches = 0;
    // One warm-up pass so the file is in the page cache for every contender alike.
    let _ = store
        .grep(&thread, Some(&archive_path), &p, &options)
        .unwrap();
    for _ in 0..reps {
        let start = Instant::now();
        let out = store
            .grep(&thread, Some(&archive_path), &p, &options)
            .unwrap();
        secs.push(start.elapsed().as_secs_f64());
        assert_eq!(out.bytes_searched, bytes);
        matches = out.matches.len();
    }
    let s = median(secs);
    println!(
        "{}",
        json!({
            "bench": "grep", "pattern": pattern, "bytes": bytes, "matches": matches,
            "median_s": s, "mb_per_s": bytes as f64 / s / 1e6, "reps": reps,
        })
    );
}

fn index(dir: &Path, reps: usize) {
    let (path, _) = ensure_archive(dir);
    let store: Arc<dyn OffloadStore> = Arc::new(FsStore::new(dir).unwrap());
    let thread = ThreadId::new(ARCHIVE_THREAD).unwrap();
    let mut rebuild = Vec::new();
    let mut records = 0;
    let mut archive = None;
    for _ in 0..reps {
        let a = Archive::new(store.clone());
        let start = Instant::now();
        records = a.len(&thread).unwrap();
        rebuild.push(start.elapsed().as_secs_f64());
        archive = Some(a);
    }
    let archive = archive.unwrap();
    let mut rng = Rng(5);
    let gets = 10_000;
    let start = Instant::now();
    for _ in 0..gets {
        let id = format!("msg-{:08}", 1 + rng.below(records));
        assert!(archive.get(&thread, &id).unwrap().is_some());
    }
    let get_s = start.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({
            "bench": "index", "bytes": size(&path), "records": records,
            "rebuild_median_s": median(rebuild), "get_us": get_s / gets as f64 * 1e6, "reps": reps,
        })
    );
}

// ---------------------------------------------------------------- lineage

/// Medians of `reps` runs of `plain` and of `scoped`, taken in turns so that both see
/// the same machine (the benchmark shares its cores).
fn pair(reps: usize, mut plain: impl FnMut(), mut scoped: impl FnMut()) -> (f64, f64) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let start = Instant::now();
        plain();
        a.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        scoped();
        b.push(start.elapsed().as_secs_f64());
    }
    (median(a), median(b))
}

/// 100 reads of `range` of `key`.
fn read_100(store: &dyn OffloadStore, key: &Key, range: &LineRange) {
    for _ in 0..100 {
        store.read_lines(key, range).unwrap();
    }
}

fn lineage(work: &Path, reps: usize) {
    let mut rng = Rng(17);
    let messages: Vec<Message> = (0..20_000).map(|i| history_message(&mut rng, i)).collect();
    let result = log_text(&mut rng, 400_000);
    let dir = work.join("lineage");
    let _ = std::fs::remove_dir_all(&dir);
    let stores: Vec<(&str, Arc<dyn OffloadStore>)> = vec![
        (
            "files",
            Arc::new(FsStore::new(&dir).unwrap().with_fsync(Fsync::Never)),
        ),
        ("memory", Arc::new(MemoryStore::new())),
    ];
    let row = |store: &str, what: &str, (old, new): (f64, f64), scale: f64, unit: &str| {
        println!(
            "{}",
            json!({
                "bench": "lineage", "store": store, "case": what, "unit": unit,
                "without": old * scale, "with": new * scale, "ratio": new / old, "reps": reps,
            })
        );
    };
    for (name, store) in stores {
        let plain_t = ThreadId::new("plain").unwrap();
        let scoped_t = ThreadId::new("scoped").unwrap();
        // Appends of 20 messages (a compaction's worth), 20,000 messages in all, each
        // thread deleted before the next run.
        let mut last = Lineage::new();
        let per = messages.len() as f64;
        let appends = pair(
            reps,
            || {
                store.delete_thread(&plain_t).unwrap();
                let archive = Archive::new(store.clone());
                for batch in messages.chunks(20) {
                    archive.append(&plain_t, batch).unwrap();
                }
            },
            || {
                store.delete_thread(&scoped_t).unwrap();
                let archive = Archive::new(store.clone());
                let mut lineage = Lineage::new();
                for batch in messages.chunks(20) {
                    archive.append_in(&mut lineage, &scoped_t, batch).unwrap();
                }
                last = lineage;
            },
        );
        row(
            name,
            "archive append, 20 per call",
            appends,
            1e6 / per,
            "us/message",
        );
        let t = scoped_t.clone();
        let view = LineageStore::new(store.clone(), t.clone(), last.clone());
        let archive_path = keel_offload::StorePath::new(Archive::DEFAULT_PATH).unwrap();
        let options = GrepOptions {
            max_results: usize::MAX,
            max_line_bytes: 64,
        };
        let p = Pattern::new("deadline exceeded").unwrap();
        let greps = pair(
            reps,
            || {
                store.grep(&t, Some(&archive_path), &p, &options).unwrap();
            },
            || {
                view.grep(&t, Some(&archive_path), &p, &options).unwrap();
            },
        );
        row(name, "grep the archive", greps, 1e3, "ms");
        let key = Key::from_parts(t.clone(), archive_path.clone());
        let range = LineRange::new(15_000, 100);
        let reads = pair(
            reps,
            || read_100(&*store, &key, &range),
            || read_100(&view, &key, &range),
        );
        row(
            name,
            "read 100 archive lines at 15,000",
            reads,
            1e4,
            "us/read",
        );
        // Large results: 50 puts of 400 KB, then line reads of one.
        let (plain_r, scoped_r) = (
            ThreadId::new("plain-results").unwrap(),
            ThreadId::new("scoped-results").unwrap(),
        );
        let path = |i: usize| {
            keel_offload::StorePath::new(format!("large_tool_results/call_{i}")).unwrap()
        };
        let mut results = LineageStore::new(store.clone(), scoped_r.clone(), Lineage::new());
        let puts = pair(
            reps,
            || {
                store.delete_thread(&plain_r).unwrap();
                for i in 0..50 {
                    store
                        .put(&Key::from_parts(plain_r.clone(), path(i)), &result)
                        .unwrap();
                }
            },
            || {
                store.delete_thread(&scoped_r).unwrap();
                results = LineageStore::new(store.clone(), scoped_r.clone(), Lineage::new());
                for i in 0..50 {
                    results
                        .put(&Key::from_parts(scoped_r.clone(), path(i)), &result)
                        .unwrap();
                }
            },
        );
        row(name, "put a 400 KB result", puts, 1e6 / 50.0, "us/put");
        let (plain_k, scoped_k) = (
            Key::from_parts(plain_r.clone(), path(7)),
            Key::from_parts(scoped_r.clone(), path(7)),
        );
        let range = LineRange::new(1_000, 100);
        let result_reads = pair(
            reps,
            || read_100(&*store, &plain_k, &range),
            || read_100(&results, &scoped_k, &range),
        );
        row(
            name,
            "read 100 lines of a result",
            result_reads,
            1e4,
            "us/read",
        );
        let checks = pair(
            reps,
            || {},
            || {
                for _ in 0..100 {
                    assert!(last.sees_all(&*store, &t).unwrap());
                }
            },
        );
        println!(
            "{}",
            json!({"bench": "lineage", "store": name, "case": "sees_all after a compaction", "unit": "us", "with": checks.1 * 1e4, "reps": reps})
        );
        for t in [&plain_t, &scoped_t, &plain_r, &scoped_r] {
            store.delete_thread(t).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
