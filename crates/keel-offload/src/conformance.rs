//! The conformance suite every [`OffloadStore`] backend must pass (feature
//! `conformance`).
//!
//! Backends run it from their tests, on one store or on a fresh one per check:
//!
//! ```
//! use std::sync::Arc;
//! use keel_offload::{MemoryStore, conformance};
//!
//! conformance::run_all(&Arc::new(MemoryStore::new()));
//! // or one check at a time, each as its own test:
//! conformance::contract(&MemoryStore::new());
//! ```
//!
//! Every check names its threads with a prefix no other check (in this process or
//! another) uses, so checks may share one store, and one database, with other tests
//! running at the same time. A failing check panics with a message that starts with
//! `[conformance::<check>]`.
//!
//! The checks cover the contract of [`OffloadStore`] (puts, appends that return their
//! offset, reads at offsets, line reads, listing, grep, deletes, the file-or-directory
//! rule), values large enough to span many internal chunks, `delete_thread`,
//! `truncate`, readers
//! racing a `put`, and the crate's own users over the store: [`Archive`],
//! [`RetrievalTools`] and the lineages of forked threads ([`LineageStore`],
//! [`collect_garbage`]).

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use keel_message::{Message, ToolCall};
use serde_json::json;

use crate::{
    Archive, Entry, GrepOptions, Key, LineRange, Lineage, LineageStore, OffloadError, OffloadStore,
    Pattern, RetrievalTools, StorePath, ThreadId, collect_garbage,
};

/// Runs every check on `store`.
pub fn run_all<S: OffloadStore + 'static>(store: &Arc<S>) {
    contract(&**store);
    large_values(&**store);
    delete_thread(&**store);
    truncate(&**store);
    puts_are_atomic(store);
    archive(store);
    retrieval_tools(store);
    lineages(store);
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Thread ids for one check: `<check>-<unique>-<name>`.
struct Names(String);

impl Names {
    fn new(check: &str) -> Self {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Names(format!("{check}-{:x}-{}-{n}", nanos, std::process::id()))
    }

    fn thread(&self, name: &str) -> ThreadId {
        ThreadId::new(format!("{}-{name}", self.0)).unwrap()
    }

    fn key(&self, thread: &str, path: &str) -> Key {
        Key::from_parts(self.thread(thread), StorePath::new(path).unwrap())
    }
}

fn paths(entries: &[Entry]) -> Vec<&str> {
    entries.iter().map(|e| e.path.as_str()).collect()
}

macro_rules! check {
    ($name:literal, $cond:expr) => {
        assert!(
            $cond,
            "{}",
            concat!("[conformance::", $name, "] ", stringify!($cond))
        )
    };
    ($name:literal, $cond:expr, $($arg:tt)+) => {
        assert!(
            $cond,
            "{}: {}",
            concat!("[conformance::", $name, "] ", stringify!($cond)),
            format!($($arg)+)
        )
    };
}

macro_rules! check_eq {
    ($name:literal, $left:expr, $right:expr $(,)?) => {
        assert_eq!(
            $left,
            $right,
            "{}",
            concat!("[conformance::", $name, "] ", stringify!($left))
        )
    };
}

/// The [`OffloadStore`] contract on small values: put, get, size, overwrite; appends
/// and their offsets; `read_at`; `read_lines`; separate namespaces; sorted listing
/// under a directory or one file; a path is a file or a directory, not both; grep in
/// path order with line numbers, offsets and limits; delete.
pub fn contract(store: &dyn OffloadStore) {
    let n = Names::new("contract");
    let t1 = n.thread("t1");
    // put / get / size / overwrite
    let a = n.key("t1", "large_tool_results/call_1");
    check_eq!("contract", store.size(&a).unwrap(), None);
    check!("contract", store.get(&a).unwrap_err().is_not_found());
    check_eq!("contract", store.put(&a, "one\ntwo\nthree\n").unwrap(), 14);
    check_eq!("contract", store.get(&a).unwrap(), "one\ntwo\nthree\n");
    check_eq!("contract", store.size(&a).unwrap(), Some(14));
    store.put(&a, "replaced").unwrap();
    check_eq!("contract", store.get(&a).unwrap(), "replaced");
    check_eq!("contract", store.size(&a).unwrap(), Some(8));

    // append returns the offset where the text starts
    let log = n.key("t1", "archive/messages.jsonl");
    check_eq!("contract", store.append(&log, "first\n").unwrap(), 0);
    check_eq!("contract", store.append(&log, "second\n").unwrap(), 6);
    check_eq!("contract", store.append(&log, "").unwrap(), 13);
    check_eq!("contract", store.get(&log).unwrap(), "first\nsecond\n");
    check_eq!("contract", store.read_at(&log, 6, 6).unwrap(), b"second");
    check_eq!("contract", store.read_at(&log, 3, 6).unwrap(), b"st\nsec");
    check_eq!("contract", store.read_at(&log, 10, 100).unwrap(), b"nd\n");
    check_eq!("contract", store.read_at(&log, 100, 5).unwrap(), b"");
    check_eq!("contract", store.read_at(&log, 0, 0).unwrap(), b"");
    // An empty append creates an empty file.
    let empty = n.key("t1", "empty");
    check_eq!("contract", store.append(&empty, "").unwrap(), 0);
    check_eq!("contract", store.size(&empty).unwrap(), Some(0));
    check_eq!("contract", store.get(&empty).unwrap(), "");
    check!("contract", store.delete(&empty).unwrap());
    // Multi-byte text survives byte offsets that split characters.
    let utf = n.key("t1", "utf8");
    store.put(&utf, "é").unwrap();
    store.append(&utf, "日本\n").unwrap();
    check_eq!("contract", store.get(&utf).unwrap(), "é日本\n");
    check_eq!("contract", store.read_at(&utf, 1, 2).unwrap(), [0xa9, 0xe6]);
    check!("contract", store.delete(&utf).unwrap());

    // read_lines
    store.put(&a, "l1\nl2\r\nl3\nl4").unwrap();
    let lines = store.read_lines(&a, &LineRange::new(1, 2)).unwrap();
    let got: Vec<(usize, &str)> = lines
        .lines
        .iter()
        .map(|l| (l.number, l.text.as_str()))
        .collect();
    check_eq!("contract", got, [(2, "l2"), (3, "l3")]);
    check!("contract", lines.more);
    let rest = store.read_lines(&a, &LineRange::new(3, 10)).unwrap();
    check_eq!("contract", rest.lines[0].text, "l4");
    check_eq!("contract", rest.total_lines, Some(4));
    let cut = store
        .read_lines(&a, &LineRange::new(0, 1).with_max_line_bytes(1))
        .unwrap();
    check_eq!(
        "contract",
        (cut.lines[0].text.as_str(), cut.lines[0].truncated),
        ("l", true)
    );

    // namespaces are separate
    store
        .put(&n.key("t2", "large_tool_results/call_1"), "other thread")
        .unwrap();
    check_eq!("contract", store.get(&a).unwrap(), "l1\nl2\r\nl3\nl4");

    // list: sorted, per thread, under a directory or one file
    store
        .put(&n.key("t1", "large_tool_results/call_0"), "zero")
        .unwrap();
    store.put(&n.key("t1", "notes"), "n").unwrap();
    let all = store.list(&t1, None).unwrap();
    check_eq!(
        "contract",
        paths(&all),
        [
            "archive/messages.jsonl",
            "large_tool_results/call_0",
            "large_tool_results/call_1",
            "notes"
        ]
    );
    check_eq!("contract", all[1].bytes, 4);
    check_eq!("contract", all[0].bytes, 13);
    let dir = StorePath::new("large_tool_results").unwrap();
    check_eq!(
        "contract",
        paths(&store.list(&t1, Some(&dir)).unwrap()),
        ["large_tool_results/call_0", "large_tool_results/call_1"]
    );
    let one = StorePath::new("notes").unwrap();
    check_eq!(
        "contract",
        paths(&store.list(&t1, Some(&one)).unwrap()),
        ["notes"]
    );
    // `large` is a prefix of a directory name, not a directory
    let partial = StorePath::new("large").unwrap();
    check!(
        "contract",
        store.list(&t1, Some(&partial)).unwrap_err().is_not_found()
    );
    check!(
        "contract",
        store.list(&n.thread("nobody"), None).unwrap().is_empty()
    );
    // Sorting is by bytes: `a-b` < `a/b` < `a0` ('-' < '/' < '0'), and `a/b` lists under `a`.
    let sort = n.thread("sort");
    for p in ["a0", "a/b", "a-b", "A", "é"] {
        store
            .put(
                &Key::from_parts(sort.clone(), StorePath::new(p).unwrap()),
                p,
            )
            .unwrap();
    }
    check_eq!(
        "contract",
        paths(&store.list(&sort, None).unwrap()),
        ["A", "a-b", "a/b", "a0", "é"]
    );
    let a_dir = StorePath::new("a").unwrap();
    check_eq!(
        "contract",
        paths(&store.list(&sort, Some(&a_dir)).unwrap()),
        ["a/b"]
    );

    // a path is a file or a directory, not both
    check!(
        "contract",
        store.put(&n.key("t1", "notes/inner"), "x").is_err()
    );
    check!(
        "contract",
        store
            .append(&n.key("t1", "notes/inner/deeper"), "x")
            .is_err()
    );
    check!(
        "contract",
        store.put(&n.key("t1", "large_tool_results"), "x").is_err()
    );
    check!(
        "contract",
        store
            .append(&n.key("t1", "large_tool_results"), "x")
            .is_err()
    );
    let is_dir = |e: OffloadError| matches!(&e, OffloadError::Io { source, .. } if source.kind() == std::io::ErrorKind::IsADirectory);
    check!(
        "contract",
        is_dir(store.get(&n.key("t1", "large_tool_results")).unwrap_err())
    );
    check!(
        "contract",
        is_dir(store.size(&n.key("t1", "large_tool_results")).unwrap_err())
    );

    // grep: in path order, line numbers, offsets, limits
    let p = Pattern::new("^l[24]$").unwrap();
    let found = store.grep(&t1, None, &p, &GrepOptions::default()).unwrap();
    let got: Vec<(&str, usize, u64, &str)> = found
        .matches
        .iter()
        .map(|m| {
            (
                m.path.as_str(),
                m.line_number,
                m.byte_offset,
                m.line.as_str(),
            )
        })
        .collect();
    check_eq!(
        "contract",
        got,
        [
            ("large_tool_results/call_1", 2, 3, "l2"),
            ("large_tool_results/call_1", 4, 10, "l4")
        ]
    );
    check!("contract", !found.truncated);
    check_eq!("contract", found.files_searched, 4);
    let limited = store
        .grep(
            &t1,
            Some(&dir),
            &Pattern::new("l").unwrap(),
            &GrepOptions {
                max_results: 1,
                max_line_bytes: 10,
            },
        )
        .unwrap();
    check_eq!("contract", limited.matches.len(), 1);
    check!("contract", limited.truncated);

    // delete
    check!("contract", store.delete(&a).unwrap());
    check!("contract", !store.delete(&a).unwrap());
    check!("contract", store.get(&a).unwrap_err().is_not_found());
    check!(
        "contract",
        store
            .read_lines(&a, &LineRange::new(0, 1))
            .unwrap_err()
            .is_not_found()
    );
    check!(
        "contract",
        store.read_at(&a, 0, 1).unwrap_err().is_not_found()
    );
    // After a delete the path can be reused, as a file or as a directory.
    check!("contract", store.delete(&n.key("t1", "notes")).unwrap());
    store
        .put(&n.key("t1", "notes/inner"), "now a directory")
        .unwrap();
    check_eq!(
        "contract",
        store.get(&n.key("t1", "notes/inner")).unwrap(),
        "now a directory"
    );
    for t in ["t1", "t2", "sort"] {
        store.delete_thread(&n.thread(t)).unwrap();
    }
}

/// Text of about `bytes` bytes in numbered lines (`line 1 ...\n`).
fn numbered(lines: std::ops::Range<usize>, width: usize) -> String {
    let pad = "x".repeat(width);
    lines.map(|i| format!("line {i} {pad}\n")).collect()
}

/// Values of several MB: put and get whole, `read_at` across the places a backend
/// may split them, appends of large text, streaming line reads and grep far from the
/// start, and a put that shrinks a value.
pub fn large_values(store: &dyn OffloadStore) {
    let n = Names::new("large");
    let k = n.key("t", "large_tool_results/big");
    // ~6.5 MB: more than a few chunks of any sensible size.
    let text = numbered(0..60_000, 100);
    check_eq!(
        "large_values",
        store.put(&k, &text).unwrap(),
        text.len() as u64
    );
    check_eq!(
        "large_values",
        store.size(&k).unwrap(),
        Some(text.len() as u64)
    );
    check!(
        "large_values",
        store.get(&k).unwrap() == text,
        "get returned other text"
    );
    for (offset, len) in [
        (0usize, 10usize),
        ((1 << 16) - 3, 7),
        ((1 << 18) - 5, 10),
        ((1 << 20) - 1, 2),
        ((1 << 20) - 100, 3 << 20),
        (text.len() - 4, 100),
    ] {
        let got = store.read_at(&k, offset as u64, len).unwrap();
        let end = (offset + len).min(text.len());
        check!(
            "large_values",
            got == text.as_bytes()[offset..end],
            "read_at({offset}, {len}) returned {} other bytes",
            got.len()
        );
    }
    // Streaming reads and search far into the value.
    let lines = store.read_lines(&k, &LineRange::new(59_990, 20)).unwrap();
    check_eq!("large_values", lines.lines.len(), 10);
    check!(
        "large_values",
        lines.lines[0].text.starts_with("line 59990 x")
    );
    check_eq!("large_values", lines.total_lines, Some(60_000));
    let found = store
        .grep(
            &n.thread("t"),
            None,
            &Pattern::new(r"^line (17|41234|59999) ").unwrap(),
            &GrepOptions::default(),
        )
        .unwrap();
    let at: Vec<(usize, u64)> = found
        .matches
        .iter()
        .map(|m| (m.line_number, m.byte_offset))
        .collect();
    let offset_of = |i: usize| text.find(&format!("line {i} ")).unwrap() as u64;
    check_eq!(
        "large_values",
        at,
        [
            (18, offset_of(17)),
            (41_235, offset_of(41_234)),
            (60_000, offset_of(59_999))
        ]
    );
    let mut streamed = Vec::new();
    std::io::Read::read_to_end(&mut store.open(&k).unwrap(), &mut streamed).unwrap();
    check!(
        "large_values",
        streamed == text.as_bytes(),
        "open streamed other bytes"
    );

    // A large append lands at the end; small ones after it.
    let more = numbered(60_000..80_000, 100);
    check_eq!(
        "large_values",
        store.append(&k, &more).unwrap(),
        text.len() as u64
    );
    let at = store.append(&k, "tail\n").unwrap();
    check_eq!("large_values", at, (text.len() + more.len()) as u64);
    let whole = store.get(&k).unwrap();
    check!(
        "large_values",
        whole.len() == text.len() + more.len() + 5
            && whole.starts_with(&text)
            && whole[text.len()..].starts_with(&more)
    );
    check!(
        "large_values",
        whole.ends_with("\ntail\n") && whole[..whole.len() - 5].ends_with(&more)
    );
    let boundary = store.read_at(&k, text.len() as u64 - 3, 10).unwrap();
    check_eq!(
        "large_values",
        boundary,
        whole.as_bytes()[text.len() - 3..text.len() + 7]
    );
    // Shrinking put: nothing of the old value remains.
    store.put(&k, "small\n").unwrap();
    check_eq!("large_values", store.get(&k).unwrap(), "small\n");
    check_eq!(
        "large_values",
        store.read_at(&k, 0, 1 << 20).unwrap(),
        b"small\n"
    );
    check_eq!(
        "large_values",
        store.list(&n.thread("t"), None).unwrap()[0].bytes,
        6
    );
    // Many small appends read back in order.
    let log = n.key("t", "archive/messages.jsonl");
    let mut want = String::new();
    for i in 0..500 {
        let line = format!("{{\"seq\":{i}}}\n");
        check_eq!(
            "large_values",
            store.append(&log, &line).unwrap(),
            want.len() as u64
        );
        want.push_str(&line);
    }
    check_eq!("large_values", store.get(&log).unwrap(), want);
    let lines = store.read_lines(&log, &LineRange::new(250, 2)).unwrap();
    check_eq!("large_values", lines.lines[1].text, "{\"seq\":251}");
    store.delete_thread(&n.thread("t")).unwrap();
}

/// `truncate` cuts a value in place: inside a chunk of a multi-chunk value and at its
/// start, a cut past the end changes nothing, appends continue from the cut, a missing
/// file is `NotFound`, and a directory is not a file.
pub fn truncate(store: &dyn OffloadStore) {
    let n = Names::new("truncate");
    let key = n.key("t", "archive/messages.jsonl");
    // Two and a half MiB of lines: several chunks in the database backends.
    let line = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde\n";
    let text = line.repeat(40_000);
    store.put(&key, &text).unwrap();
    let cut = 1_500_007u64;
    check!("truncate", store.truncate(&key, cut).unwrap());
    check_eq!("truncate", store.size(&key).unwrap(), Some(cut));
    let got = store.get(&key).unwrap();
    check!(
        "truncate",
        got == text[..cut as usize],
        "{} bytes read back",
        got.len()
    );
    check_eq!(
        "truncate",
        store.read_at(&key, cut - 10, 100).unwrap(),
        text.as_bytes()[cut as usize - 10..cut as usize].to_vec()
    );
    // Appends continue where the cut is.
    check_eq!("truncate", store.append(&key, "tail\n").unwrap(), cut);
    check_eq!("truncate", store.size(&key).unwrap(), Some(cut + 5));
    let got = store.get(&key).unwrap();
    check!(
        "truncate",
        got.ends_with("tail\n") && got.len() as u64 == cut + 5
    );
    // A cut inside a character is refused and changes nothing.
    let wide = n.key("t", "notes/wide.txt");
    store.put(&wide, "日本").unwrap();
    check!("truncate", store.truncate(&wide, 1).is_err());
    check_eq!("truncate", store.get(&wide).unwrap(), "日本");
    check!("truncate", store.truncate(&wide, 3).unwrap());
    check_eq!("truncate", store.get(&wide).unwrap(), "日");
    // Past the end: nothing to cut.
    check!("truncate", !store.truncate(&key, cut + 5).unwrap());
    check!("truncate", !store.truncate(&key, u64::MAX).unwrap());
    // To nothing: the file stays, empty.
    check!("truncate", store.truncate(&key, 0).unwrap());
    check_eq!("truncate", store.size(&key).unwrap(), Some(0));
    check_eq!("truncate", store.get(&key).unwrap(), "");
    store.append(&key, "again\n").unwrap();
    check_eq!("truncate", store.get(&key).unwrap(), "again\n");
    // Missing files and directories.
    check!(
        "truncate",
        store
            .truncate(&n.key("t", "nope"), 1)
            .unwrap_err()
            .is_not_found()
    );
    check!(
        "truncate",
        store.truncate(&n.key("t", "archive"), 1).is_err()
    );
    store.delete_thread(&n.thread("t")).unwrap();
}

/// `delete_thread` removes every file of one thread, large and small, and nothing of
/// another thread's; the thread can be written again afterwards.
pub fn delete_thread(store: &dyn OffloadStore) {
    let n = Names::new("delthread");
    let gone = n.thread("gone");
    let kept = n.thread("kept");
    store
        .put(
            &n.key("gone", "large_tool_results/call_1"),
            &numbered(0..20_000, 80),
        )
        .unwrap();
    store
        .append(&n.key("gone", "archive/messages.jsonl"), "{}\n")
        .unwrap();
    store
        .append(&n.key("gone", "archive/messages.jsonl"), "{}\n")
        .unwrap();
    store
        .put(&n.key("gone", "truncated_arguments/call_2/content"), "x")
        .unwrap();
    store
        .put(&n.key("kept", "large_tool_results/call_1"), "mine")
        .unwrap();
    check_eq!("delete_thread", store.delete_thread(&gone).unwrap(), 3);
    check!("delete_thread", store.list(&gone, None).unwrap().is_empty());
    check!(
        "delete_thread",
        store
            .get(&n.key("gone", "archive/messages.jsonl"))
            .unwrap_err()
            .is_not_found()
    );
    check_eq!("delete_thread", store.delete_thread(&gone).unwrap(), 0);
    check_eq!(
        "delete_thread",
        store
            .get(&n.key("kept", "large_tool_results/call_1"))
            .unwrap(),
        "mine"
    );
    // Written again from nothing: appends start at 0.
    check_eq!(
        "delete_thread",
        store
            .append(&n.key("gone", "archive/messages.jsonl"), "{}\n")
            .unwrap(),
        0
    );
    store.delete_thread(&gone).unwrap();
    store.delete_thread(&kept).unwrap();
}

/// Readers racing a `put` see the old value or the new one whole, never a mix.
pub fn puts_are_atomic<S: OffloadStore + 'static>(store: &Arc<S>) {
    let n = Names::new("atomic");
    let k = n.key("t", "flip");
    let a = "a".repeat(3 << 20);
    let b = "b".repeat(3 << 20);
    store.put(&k, &a).unwrap();
    let writer = {
        let (store, k, a, b) = (Arc::clone(store), k.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            for i in 0..10 {
                store.put(&k, if i % 2 == 0 { &b } else { &a }).unwrap();
            }
        })
    };
    let mut reads = 0;
    while !writer.is_finished() || reads == 0 {
        let got = store.get(&k).unwrap();
        check!(
            "puts_are_atomic",
            got == a || got == b,
            "a torn read of {} bytes",
            got.len()
        );
        reads += 1;
    }
    writer.join().unwrap();
    store.delete_thread(&n.thread("t")).unwrap();
}

fn history(n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| match i % 3 {
            0 => Message::user(format!("step {i}: check \"config.toml\"\nand report"))
                .with_id(format!("m{i}")),
            1 => Message::assistant("")
                .with_id(format!("m{i}"))
                .with_tool_calls(vec![ToolCall::new(
                    format!("call_{i}"),
                    "shell",
                    json!({"cmd": format!("cat file_{i}")}),
                )]),
            _ => Message::tool(
                format!("call_{}", i - 1),
                format!("contents of file_{i}: ok"),
            )
            .with_id(format!("m{i}")),
        })
        .collect()
}

/// [`Archive`] over the store: append, fetch by id and range, grep, retries that
/// write nothing, an index rebuilt by a second archive (another worker), and appends
/// from several threads at once.
pub fn archive<S: OffloadStore + 'static>(store: &Arc<S>) {
    let n = Names::new("archive");
    let t = n.thread("t");
    let shared: Arc<dyn OffloadStore> = store.clone();
    let archive = Archive::new(shared.clone());
    let messages = history(60);
    let appended = archive.append(&t, &messages[..25]).unwrap();
    check_eq!("archive", appended.seqs, (0..25).collect::<Vec<u64>>());
    archive.append(&t, &messages[25..]).unwrap();
    check_eq!("archive", archive.append(&t, &messages).unwrap().written, 0);
    check_eq!("archive", archive.len(&t).unwrap(), 60);
    for m in &messages {
        let got = archive.get(&t, m.id.as_deref().unwrap()).unwrap().unwrap();
        check_eq!("archive", &got.message, m);
    }
    let range = archive.range(&t, 20..30).unwrap();
    check_eq!("archive", range.len(), 10);
    check_eq!("archive", range[0].message, messages[20]);
    let found = archive
        .grep(&t, &Pattern::new("file_(14|47):").unwrap(), 10)
        .unwrap();
    let ids: Vec<_> = found
        .messages
        .iter()
        .map(|a| a.message.id.clone().unwrap())
        .collect();
    check_eq!("archive", ids, ["m14", "m47"]);

    // Another worker over the same store rebuilds the index and continues.
    let other = Archive::new(shared.clone());
    check_eq!("archive", other.len(&t).unwrap(), 60);
    check_eq!(
        "archive",
        other.get(&t, "m33").unwrap().unwrap().message,
        messages[33]
    );
    let next = Message::user("after the rebuild").with_id("m60");
    check_eq!(
        "archive",
        other.append(&t, std::slice::from_ref(&next)).unwrap().seqs,
        [60]
    );
    check_eq!(
        "archive",
        Archive::new(shared.clone())
            .get(&t, "m60")
            .unwrap()
            .unwrap()
            .message,
        next
    );

    // Archives on several OS threads at once, two threads of records each.
    let archive = Arc::new(Archive::new(shared.clone()));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (archive, t) = (Arc::clone(&archive), n.thread(&format!("w{}", w % 2)));
            std::thread::spawn(move || {
                for i in 0..25 {
                    let m = Message::user(format!("w{w} i{i}")).with_id(format!("w{w}-{i}"));
                    archive.append(&t, &[m]).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    for w in ["w0", "w1"] {
        let t = n.thread(w);
        check_eq!("archive", archive.len(&t).unwrap(), 50);
        let fresh = Archive::new(shared.clone());
        for a in archive.range(&t, 0..50).unwrap() {
            let id = a.message.id.clone().unwrap();
            check_eq!("archive", fresh.get(&t, &id).unwrap().unwrap(), a);
        }
        store.delete_thread(&t).unwrap();
    }
    store.delete_thread(&t).unwrap();
}

/// [`RetrievalTools`] over the store: `ls`, `read_file` and `grep` give the agent the
/// thread's files, and only that thread's.
pub fn retrieval_tools<S: OffloadStore + 'static>(store: &Arc<S>) {
    let n = Names::new("tools");
    let results: String = (1..=300).map(|i| format!("result line {i}\n")).collect();
    store
        .put(&n.key("t1", "large_tool_results/call_1"), &results)
        .unwrap();
    store
        .put(&n.key("t1", "large_tool_results/call_2"), "alpha\nbeta\n")
        .unwrap();
    store
        .put(&n.key("t2", "large_tool_results/secret"), "beta secret\n")
        .unwrap();
    let tools = RetrievalTools::new(store.clone(), n.thread("t1"));
    let run = |name: &str, args: serde_json::Value| {
        tools.execute(&ToolCall::new("c", name, args)).unwrap()
    };
    let ls = run("ls", json!({}));
    check!(
        "retrieval_tools",
        ls.contains("large_tool_results/call_1"),
        "{ls}"
    );
    check!(
        "retrieval_tools",
        ls.contains("large_tool_results/call_2"),
        "{ls}"
    );
    check!("retrieval_tools", !ls.contains("secret"), "{ls}");
    let read = run(
        "read_file",
        json!({"path": "large_tool_results/call_1", "offset": 149, "limit": 2}),
    );
    check!(
        "retrieval_tools",
        read.starts_with("   150\tresult line 150\n   151\tresult line 151"),
        "{read}"
    );
    check!("retrieval_tools", read.contains("offset=151"), "{read}");
    let grep = run("grep", json!({"pattern": "^beta"}));
    check_eq!("retrieval_tools", grep, "large_tool_results/call_2:2: beta");
    let missing = tools.execute(&ToolCall::new(
        "c",
        "read_file",
        json!({"path": "large_tool_results/nope"}),
    ));
    check!("retrieval_tools", missing.is_err());
    store.delete_thread(&n.thread("t1")).unwrap();
    store.delete_thread(&n.thread("t2")).unwrap();
}

/// Messages `<tag> record <i>` (padded with `pad` bytes), ids `<tag>-<i>`.
fn tagged(tag: &str, range: std::ops::Range<usize>, pad: usize) -> Vec<Message> {
    range
        .map(|i| {
            Message::user(format!("{tag} record {i}{}", " ".repeat(pad)))
                .with_id(format!("{tag}-{i}"))
        })
        .collect()
}

/// Puts `text` at `key` as `lineage` writes it; the lineage after.
fn put_in(store: &Arc<dyn OffloadStore>, lineage: &Lineage, key: &Key, text: &str) -> Lineage {
    let view = LineageStore::new(store.clone(), key.thread().clone(), lineage.clone());
    view.put(key, text).unwrap();
    view.lineage()
}

/// The listed paths, each fork's id written `<fork>`.
fn forks_masked(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .map(|e| {
            let mut parts: Vec<&str> = e.path.components().collect();
            if parts.get(..2) == Some(&[".keel", "forks"][..]) && parts.len() > 2 {
                parts[2] = "<fork>";
            }
            parts.join("/")
        })
        .collect()
}

/// Lineages over the store: a fork reads the archive and the large results as of the
/// fork point plus its own (through [`RetrievalTools`], as the agent does) and never
/// what the other branch stored after it; a retried write takes over its own bytes; the
/// files left after [`collect_garbage`] are exactly those a live lineage sees, and
/// `delete_thread` leaves none.
pub fn lineages<S: OffloadStore + 'static>(store: &Arc<S>) {
    let n = Names::new("lineages");
    let t = n.thread("t");
    let shared: Arc<dyn OffloadStore> = store.clone();
    let archive = Archive::new(shared.clone());
    let records = |tag: &str, range| tagged(tag, range, 0);
    let big = n.key("t", "large_tool_results/call_7");
    let stored = || forks_masked(&store.list(&t, None).unwrap());

    // The main branch: 10 records, the fork point, then 5 records and a large result.
    let mut main = Lineage::new();
    archive
        .append_in(&mut main, &t, &records("base", 0..10))
        .unwrap();
    let fork_point = main.clone();
    archive
        .append_in(&mut main, &t, &records("main", 0..5))
        .unwrap();
    let main = put_in(&shared, &main, &big, "main's large result\n");
    check!("lineages", main.sees_all(&*shared, &t).unwrap());
    check_eq!("lineages", main.forks().count(), 0);

    // The fork writes apart: its own records, its own result under the same path.
    let mut fork = fork_point.clone();
    archive
        .append_in(&mut fork, &t, &records("fork", 0..3))
        .unwrap();
    check_eq!("lineages", fork.forks().count(), 1);
    // A retry of that write (a step that crashed before its checkpoint) takes over the
    // bytes it left: the same lineage, nothing written twice.
    let size = |k: &str| store.size(&n.key("t", k)).unwrap();
    let root_bytes = size("archive/messages.jsonl");
    let files_before = store.list(&t, None).unwrap().len();
    let mut retry = fork_point.clone();
    archive
        .append_in(&mut retry, &t, &records("fork", 0..3))
        .unwrap();
    check_eq!("lineages", &retry, &fork);
    check_eq!("lineages", size("archive/messages.jsonl"), root_bytes);
    check_eq!(
        "lineages",
        store.list(&t, None).unwrap().len(),
        files_before
    );
    let fork = put_in(&shared, &fork, &big, "the fork's large result\n");
    check!("lineages", !fork.sees_all(&*shared, &t).unwrap());
    check!("lineages", !main.sees_all(&*shared, &t).unwrap());

    let tools =
        |l: &Lineage| RetrievalTools::new(shared.clone(), t.clone()).with_lineage(l.clone());
    let run = |l: &Lineage, name: &str, args: serde_json::Value| {
        tools(l).execute(&ToolCall::new("c", name, args)).unwrap()
    };
    let grep = |l: &Lineage, p: &str| run(l, "grep", json!({"pattern": p, "path": "archive"}));
    check!(
        "lineages",
        grep(&fork, "main record").starts_with("No lines match")
    );
    check!(
        "lineages",
        grep(&fork, "base record 9").contains("archive/messages.jsonl:10:")
    );
    let own = grep(&fork, "fork record 2");
    check!(
        "lineages",
        own.contains("archive/messages.jsonl:13:"),
        "{own}"
    );
    check!(
        "lineages",
        grep(&main, "fork record").starts_with("No lines match")
    );
    check!(
        "lineages",
        grep(&main, "main record 4").contains("archive/messages.jsonl:15:")
    );
    let lines = run(
        &fork,
        "read_file",
        json!({"path": "archive/messages.jsonl", "offset": 9}),
    );
    check!(
        "lineages",
        lines.contains("base record 9") && lines.contains("fork record 0"),
        "{lines}"
    );
    check!(
        "lineages",
        lines.ends_with("[end of file: 13 lines]"),
        "{lines}"
    );
    let read = |l: &Lineage| run(l, "read_file", json!({"path": "large_tool_results/call_7"}));
    check!("lineages", read(&main).contains("main's large result"));
    check!("lineages", read(&fork).contains("the fork's large result"));
    let at_fork_point = run(&fork_point, "ls", json!({}));
    check!(
        "lineages",
        !at_fork_point.contains("call_7"),
        "{at_fork_point}"
    );
    check!(
        "lineages",
        !at_fork_point.contains(".keel"),
        "{at_fork_point}"
    );
    check_eq!("lineages", archive.len_in(&main, &t).unwrap(), 15);
    check_eq!("lineages", archive.len_in(&fork, &t).unwrap(), 13);
    check_eq!("lineages", archive.len_in(&fork_point, &t).unwrap(), 10);
    check!(
        "lineages",
        archive.get_in(&fork, &t, "main-0").unwrap().is_none()
    );
    check_eq!(
        "lineages",
        archive
            .get_in(&fork, &t, "fork-1")
            .unwrap()
            .unwrap()
            .message
            .text(),
        "fork record 1"
    );

    // Both branches live: nothing goes.
    let kept = collect_garbage(&*shared, &t, &[main.clone(), fork.clone()]).unwrap();
    check_eq!("lineages", kept.files, 0);
    check_eq!("lineages", kept.bytes, 0);
    // Only the fork lives (the main branch's checkpoints were pruned): main's records
    // are cut off the shared archive and its result deleted.
    let removed = collect_garbage(&*shared, &t, std::slice::from_ref(&fork)).unwrap();
    check_eq!("lineages", removed.files, 1);
    check!("lineages", removed.bytes > 0);
    check_eq!(
        "lineages",
        stored(),
        [
            ".keel/files.jsonl",
            ".keel/forks/<fork>/data/archive/messages.jsonl",
            ".keel/forks/<fork>/data/large_tool_results/call_7",
            ".keel/forks/<fork>/files.jsonl",
            "archive/messages.jsonl",
        ]
    );
    check!("lineages", fork.sees_all(&*shared, &t).unwrap());
    check!(
        "lineages",
        grep(&fork, "base record 0").contains("archive/messages.jsonl:1:")
    );
    check!("lineages", read(&fork).contains("the fork's large result"));
    check_eq!("lineages", archive.len_in(&fork, &t).unwrap(), 13);
    // Only the fork point lives: the fork's directory (its record, archive and result) goes too.
    let removed = collect_garbage(&*shared, &t, std::slice::from_ref(&fork_point)).unwrap();
    check_eq!("lineages", removed.files, 3);
    check_eq!(
        "lineages",
        stored(),
        [".keel/files.jsonl", "archive/messages.jsonl"]
    );
    check_eq!("lineages", archive.len_in(&fork_point, &t).unwrap(), 10);
    // No lineage lives: every recorded file goes.
    collect_garbage(&*shared, &t, &[]).unwrap();
    check!("lineages", stored().is_empty(), "{:?}", stored());

    // delete_thread takes every branch.
    let mut again = Lineage::new();
    archive
        .append_in(&mut again, &t, &records("base", 0..2))
        .unwrap();
    let mut other = Lineage::new();
    archive
        .append_in(&mut other, &t, &records("other", 0..2))
        .unwrap();
    check_eq!("lineages", other.forks().count(), 1);
    store.delete_thread(&t).unwrap();
    check!("lineages", store.list(&t, None).unwrap().is_empty());
}

/// What a database backend's tables hold of one thread, for [`lineage_rows`]: file
/// rows, chunk rows no file row holds, and the bytes of its chunk rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Rows of the files table.
    pub files: i64,
    /// Chunk rows of a generation no file row has.
    pub orphan_chunks: i64,
    /// Bytes of all the thread's chunk rows.
    pub chunk_bytes: i64,
}

/// For database backends: after forks and [`collect_garbage`] the tables hold exactly
/// the files a live lineage reads (one row each, their chunks' bytes adding up to their
/// sizes, no chunk without its file), and after `delete_thread` nothing. `rows` counts
/// a thread's rows with SQL.
pub fn lineage_rows<S: OffloadStore + 'static>(store: &Arc<S>, rows: &dyn Fn(&ThreadId) -> Rows) {
    let n = Names::new("lineage_rows");
    let t = n.thread("t");
    let shared: Arc<dyn OffloadStore> = store.clone();
    let archive = Archive::new(shared.clone());
    let records = |tag: &str, range| tagged(tag, range, 200);
    let check_rows = |when: &str| {
        let listed = store.list(&t, None).unwrap();
        let bytes: u64 = listed.iter().map(|e| e.bytes).sum();
        let got = rows(&t);
        check_eq!(
            "lineage_rows",
            (when, got),
            (
                when,
                Rows {
                    files: listed.len() as i64,
                    orphan_chunks: 0,
                    chunk_bytes: bytes as i64,
                }
            )
        );
        listed.len()
    };
    let big = n.key("t", "large_tool_results/call_1");
    // Several chunks: the cut of a shared value crosses chunk rows.
    let large = |tag: &str| format!("{tag} line of a large result\n").repeat(100_000);
    let mut main = Lineage::new();
    archive
        .append_in(&mut main, &t, &records("base", 0..5))
        .unwrap();
    let fork_point = main.clone();
    for k in 0..3 {
        archive
            .append_in(&mut main, &t, &records("main", k * 5..k * 5 + 5))
            .unwrap();
    }
    let main = put_in(&shared, &main, &big, &large("main"));
    let mut fork = fork_point.clone();
    archive
        .append_in(&mut fork, &t, &records("fork", 0..5))
        .unwrap();
    let fork = put_in(&shared, &fork, &big, &large("fork"));
    let mut sibling = fork_point.clone();
    archive
        .append_in(&mut sibling, &t, &records("sibling", 0..5))
        .unwrap();
    check_rows("after the forks");
    collect_garbage(&*shared, &t, &[main.clone(), fork.clone(), sibling]).unwrap();
    let all = check_rows("with every branch live");
    collect_garbage(&*shared, &t, std::slice::from_ref(&fork)).unwrap();
    let kept = check_rows("with the fork live");
    check!("lineage_rows", kept < all, "{kept} of {all} files kept");
    check!("lineage_rows", fork.sees_all(&*shared, &t).unwrap());
    check_eq!("lineage_rows", archive.len_in(&fork, &t).unwrap(), 10);
    collect_garbage(&*shared, &t, std::slice::from_ref(&fork_point)).unwrap();
    check_rows("with the fork point live");
    check_eq!("lineage_rows", archive.len_in(&fork_point, &t).unwrap(), 5);
    drop(main);
    store.delete_thread(&t).unwrap();
    check_eq!(
        "lineage_rows",
        rows(&t),
        Rows {
            files: 0,
            orphan_chunks: 0,
            chunk_bytes: 0,
        }
    );
}
