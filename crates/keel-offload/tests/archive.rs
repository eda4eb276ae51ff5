//! The archive: append, fetch by id, by range, grep; rebuilt from disk; retries,
//! torn writes, and failures that keep messages in context.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_message::{Message, ToolCall};
use keel_offload::{
    Archive, FsStore, Fsync, Key, MemoryStore, OffloadStore, Pattern, StoredWhat, ThreadId,
};
use serde_json::json;

fn thread(id: &str) -> ThreadId {
    ThreadId::new(id).unwrap()
}

/// A varied history: text with quotes and newlines, tool calls, tool results.
fn history(n: usize) -> Vec<Message> {
    (0..n)
        .map(|i| match i % 4 {
            0 => Message::user(format!(
                "step {i}: please check \"config.toml\"\nand report"
            ))
            .with_id(format!("m{i}")),
            1 => Message::assistant("")
                .with_id(format!("m{i}"))
                .with_tool_calls(vec![ToolCall::new(
                    format!("call_{i}"),
                    "shell",
                    json!({"cmd": format!("cat file_{i}")}),
                )]),
            2 => Message::tool(
                format!("call_{}", i - 1),
                format!("contents of file_{}: ok", i - 1),
            )
            .with_id(format!("m{i}")),
            _ => Message::assistant(format!("done with step {i}")).with_id(format!("m{i}")),
        })
        .collect()
}

fn fs_archive(dir: &std::path::Path) -> Archive {
    Archive::new(Arc::new(
        FsStore::new(dir).unwrap().with_fsync(Fsync::Never),
    ))
}

#[test]
fn fetch_by_id_range_and_grep() {
    let archive = Archive::new(Arc::new(MemoryStore::new()));
    let t = thread("t1");
    let messages = history(40);
    let appended = archive.append(&t, &messages[..25]).unwrap();
    assert_eq!(appended.seqs, (0..25).collect::<Vec<u64>>());
    assert_eq!(appended.written, 25);
    archive.append(&t, &messages[25..]).unwrap();
    assert_eq!(archive.len(&t).unwrap(), 40);

    for (i, m) in messages.iter().enumerate() {
        let got = archive.get(&t, m.id.as_deref().unwrap()).unwrap().unwrap();
        assert_eq!((got.seq, &got.message), (i as u64, m));
    }
    assert!(archive.get(&t, "nope").unwrap().is_none());

    let range = archive.range(&t, 10..14).unwrap();
    assert_eq!(
        range.iter().map(|a| a.seq).collect::<Vec<_>>(),
        [10, 11, 12, 13]
    );
    assert_eq!(
        range.iter().map(|a| a.message.clone()).collect::<Vec<_>>(),
        messages[10..14]
    );
    assert_eq!(archive.range(&t, 38..100).unwrap().len(), 2);
    assert!(archive.range(&t, 50..60).unwrap().is_empty());

    let found = archive
        .grep(&t, &Pattern::new(r"file_(9|13)\b").unwrap(), 10)
        .unwrap();
    let ids: Vec<_> = found
        .messages
        .iter()
        .map(|a| a.message.id.clone().unwrap())
        .collect();
    assert_eq!(ids, ["m9", "m10", "m13", "m14"]);
    assert!(!found.truncated);
    let capped = archive.grep(&t, &Pattern::new("step").unwrap(), 3).unwrap();
    assert_eq!(capped.messages.len(), 3);
    assert!(capped.truncated);

    // Threads do not see each other's history.
    assert_eq!(archive.len(&thread("t2")).unwrap(), 0);
    assert!(archive.get(&thread("t2"), "m1").unwrap().is_none());
}

#[test]
fn the_archive_is_json_lines_with_ids() {
    let store = Arc::new(MemoryStore::new());
    let archive = Archive::new(store.clone());
    let t = thread("t1");
    archive.append(&t, &history(3)).unwrap();
    let text = store
        .get(&Key::new("t1", "archive/messages.jsonl").unwrap())
        .unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1]["seq"], 1);
    assert_eq!(lines[1]["id"], "m1");
    assert_eq!(lines[1]["message"]["tool_calls"][0]["name"], "shell");
    assert_eq!(lines[1]["hash"].as_str().unwrap().len(), 16);
}

#[test]
fn a_new_archive_rebuilds_its_index_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let t = thread("t1");
    let messages = history(30);
    fs_archive(dir.path()).append(&t, &messages).unwrap();

    let reopened = fs_archive(dir.path());
    assert_eq!(reopened.len(&t).unwrap(), 30);
    assert_eq!(
        reopened.get(&t, "m17").unwrap().unwrap().message,
        messages[17]
    );
    // Appending after a rebuild continues the sequence.
    let more = history(32);
    assert_eq!(reopened.append(&t, &more[30..]).unwrap().seqs, [30, 31]);
    assert_eq!(reopened.range(&t, 29..32).unwrap()[2].message, more[31]);
}

#[test]
fn ids_that_need_escaping_survive_a_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let t = thread("t1");
    let odd = ["say \"hi\"", "back\\slash", "tab\there", "ünïcödé", ""];
    let messages: Vec<Message> = odd
        .iter()
        .map(|id| Message::user(format!("id {id:?}")).with_id(*id))
        .collect();
    fs_archive(dir.path()).append(&t, &messages).unwrap();
    let reopened = fs_archive(dir.path());
    for m in &messages {
        let id = m.id.as_deref().unwrap();
        assert_eq!(&reopened.get(&t, id).unwrap().unwrap().message, m, "{id:?}");
    }
}

#[test]
fn retries_do_not_duplicate_and_changed_messages_are_appended() {
    let archive = Archive::new(Arc::new(MemoryStore::new()));
    let t = thread("t1");
    let messages = history(5);
    archive.append(&t, &messages[..3]).unwrap();
    // A retried compaction archives an overlapping batch: only the new ones are written.
    let retry = archive.append(&t, &messages).unwrap();
    assert_eq!(retry.seqs, [0, 1, 2, 3, 4]);
    assert_eq!(retry.written, 2);
    // The same message twice in one batch is written once.
    let twice = archive
        .append(&t, &[messages[4].clone(), messages[4].clone()])
        .unwrap();
    assert_eq!((twice.seqs, twice.written), (vec![4, 4], 0));

    // A message whose content changed under the same id is a new record; `get` gives
    // the newest, the old one stays findable by range.
    let edited = Message::user("edited").with_id("m0");
    assert_eq!(
        archive
            .append(&t, std::slice::from_ref(&edited))
            .unwrap()
            .seqs,
        [5]
    );
    assert_eq!(archive.get(&t, "m0").unwrap().unwrap().message, edited);
    assert_eq!(archive.range(&t, 0..1).unwrap()[0].message, messages[0]);
    // Messages without ids are always appended.
    let anon = Message::user("no id");
    archive.append(&t, &[anon.clone(), anon.clone()]).unwrap();
    assert_eq!(archive.len(&t).unwrap(), 8);
}

#[test]
fn a_torn_last_record_is_skipped_and_the_next_append_starts_a_new_line() {
    let dir = tempfile::tempdir().unwrap();
    let t = thread("t1");
    let messages = history(6);
    fs_archive(dir.path()).append(&t, &messages[..4]).unwrap();
    // A crash in the middle of writing a record leaves half a line.
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let key = Key::new("t1", Archive::DEFAULT_PATH).unwrap();
    store
        .append(
            &key,
            r#"{"seq":4,"id":"m4","hash":"00","message":{"role":"us"#,
        )
        .unwrap();

    let archive = fs_archive(dir.path());
    assert_eq!(archive.len(&t).unwrap(), 4);
    assert!(archive.get(&t, "m4").unwrap().is_none());
    assert_eq!(archive.append(&t, &messages[4..]).unwrap().seqs, [4, 5]);
    assert_eq!(archive.get(&t, "m4").unwrap().unwrap().message, messages[4]);
    // And it all still reads back after another restart.
    let again = fs_archive(dir.path());
    let all: Vec<Message> = again
        .range(&t, 0..10)
        .unwrap()
        .into_iter()
        .map(|a| a.message)
        .collect();
    assert_eq!(all, messages);
    // A grep that hits the torn line returns only whole records.
    let found = again
        .grep(&t, &Pattern::new(r#""id":"m4""#).unwrap(), 10)
        .unwrap();
    assert_eq!(found.messages.len(), 1);
}

#[test]
fn a_damaged_record_in_the_middle_is_not_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let t = thread("t1");
    let messages = history(6);
    fs_archive(dir.path()).append(&t, &messages[..4]).unwrap();
    // A torn write that happens to end like a record, then later appends after it.
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let key = Key::new("t1", Archive::DEFAULT_PATH).unwrap();
    store
        .append(&key, r#"{"seq":4,"id":"m4","hash":"0123456789abcdef","message":{"role":"user","content":"a}}"#)
        .unwrap();
    fs_archive(dir.path()).append(&t, &messages[4..]).unwrap();

    let reopened = fs_archive(dir.path());
    assert_eq!(reopened.len(&t).unwrap(), 6);
    assert_eq!(
        reopened.get(&t, "m4").unwrap().unwrap().message,
        messages[4]
    );
    let all: Vec<Message> = reopened
        .range(&t, 0..6)
        .unwrap()
        .into_iter()
        .map(|a| a.message)
        .collect();
    assert_eq!(all, messages);
}

/// What a test's code logged, as text.
#[derive(Clone, Default)]
struct Logged(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn lines_that_are_not_records_are_skipped_and_said_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let t = thread("t1");
    let messages = history(4);
    fs_archive(dir.path()).append(&t, &messages[..2]).unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let key = Key::new("t1", Archive::DEFAULT_PATH).unwrap();
    store.append(&key, "garbage, not a record\n").unwrap();
    fs_archive(dir.path()).append(&t, &messages[2..]).unwrap();

    let logged = Logged::default();
    let writer = logged.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let all = tracing::subscriber::with_default(subscriber, || {
        fs_archive(dir.path()).range(&t, 0..10).unwrap()
    });
    let all: Vec<Message> = all.into_iter().map(|a| a.message).collect();
    assert_eq!(all, messages, "every record reads back");
    let log = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("WARN"), "{log}");
    assert!(
        log.contains("archive lines that are not records were skipped"),
        "{log}"
    );
    assert!(log.contains("lines=1"), "{log}");
}

#[test]
fn records_written_by_hand_are_read_by_the_full_parser() {
    let store = Arc::new(MemoryStore::new());
    let key = Key::new("t1", Archive::DEFAULT_PATH).unwrap();
    // Different key order and spacing than the archive writes.
    store
        .append(&key, "{\"message\": {\"role\": \"user\", \"content\": \"hi\", \"id\": \"x1\"}, \"hash\": \"00000000000000ff\", \"id\": \"x1\", \"seq\": 0}\n")
        .unwrap();
    let archive = Archive::new(store);
    let t = thread("t1");
    assert_eq!(archive.len(&t).unwrap(), 1);
    assert_eq!(archive.get(&t, "x1").unwrap().unwrap().message.text(), "hi");
}

#[test]
fn messages_leave_only_after_they_are_archived() {
    let archive = Archive::new(Arc::new(MemoryStore::new()));
    let t = thread("t1");
    let messages = history(8);
    let out = archive.archive_and_remove(messages.clone(), 2..6, &t);
    assert!(out.is_complete());
    assert_eq!(out.messages, [&messages[..2], &messages[6..]].concat());
    let seqs: Vec<(usize, StoredWhat)> = out
        .stored
        .iter()
        .map(|s| (s.index, s.what.clone()))
        .collect();
    assert_eq!(
        seqs,
        (0..4)
            .map(|i| (i + 2, StoredWhat::Archived { seq: i as u64 }))
            .collect::<Vec<_>>()
    );
    assert!(
        out.stored
            .iter()
            .all(|s| s.path.as_str() == "archive/messages.jsonl" && s.bytes > 0)
    );
    // Empty and out-of-range cuts change nothing.
    let same = archive.archive_and_remove(messages.clone(), 3..3, &t);
    assert_eq!(same.messages, messages);
    let clamped = archive.archive_and_remove(messages.clone(), 6..100, &t);
    assert_eq!(clamped.messages, messages[..6]);
}

#[test]
fn a_failed_archive_keeps_every_message() {
    let t = thread("t1");
    let messages = history(8);
    // Room for a few records, not for the whole cut.
    let archive = Archive::new(Arc::new(MemoryStore::with_limit(300)));
    let out = archive.archive_and_remove(messages.clone(), 0..8, &t);
    assert_eq!(out.messages, messages);
    assert!(out.stored.is_empty());
    assert_eq!(out.failures.len(), 1);
    assert!(out.failures[0].error.is_storage_full());
    assert_eq!(out.failures[0].message_id.as_deref(), Some("m0"));
    assert_eq!(archive.len(&t).unwrap(), 0);
    // A smaller cut that fits goes through afterwards.
    let ok = archive.archive_and_remove(messages.clone(), 0..1, &t);
    assert!(ok.is_complete());
    assert_eq!(ok.messages.len(), 7);
}

#[test]
fn concurrent_appends_on_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let archive = Arc::new(fs_archive(dir.path()));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let archive = Arc::clone(&archive);
            std::thread::spawn(move || {
                let t = thread(&format!("thread-{}", w % 2));
                for i in 0..50 {
                    let m = Message::user(format!("w{w} i{i}")).with_id(format!("w{w}-{i}"));
                    archive.append(&t, &[m]).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    for t in ["thread-0", "thread-1"] {
        let t = thread(t);
        assert_eq!(archive.len(&t).unwrap(), 100);
        // The in-memory index agrees with a rebuild from disk.
        let fresh = fs_archive(dir.path());
        for a in archive.range(&t, 0..100).unwrap() {
            let id = a.message.id.clone().unwrap();
            assert_eq!(fresh.get(&t, &id).unwrap().unwrap(), a);
        }
    }
}

#[test]
fn the_archive_path_is_configurable() {
    let store = Arc::new(MemoryStore::new());
    let path = keel_offload::StorePath::new("history/log.jsonl").unwrap();
    let archive = Archive::new(store.clone()).with_path(path.clone());
    let t = thread("t1");
    archive.append(&t, &history(1)).unwrap();
    assert_eq!(store.list(&t, None).unwrap()[0].path, path);
}

/// Two archives on one store (two workers on one database): each sees what the other
/// appended, and a deleted thread's archive starts again from nothing.
#[test]
fn an_archive_sees_other_writers_and_a_deleted_thread() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let (a, b) = (Archive::new(store.clone()), Archive::new(store.clone()));
    let t = thread("moving");
    let h = history(6);
    a.append(&t, &h[..2]).unwrap();
    assert_eq!(b.len(&t).unwrap(), 2);
    b.append(&t, &h[2..4]).unwrap();
    // `a` read the archive when it held 2 records; it sees 4 now and appends after them.
    assert_eq!(a.len(&t).unwrap(), 4);
    let appended = a.append(&t, &h[4..]).unwrap();
    assert_eq!(appended.seqs, [4, 5]);
    assert_eq!(b.get(&t, "m5").unwrap().unwrap().message, h[5]);
    assert_eq!(a.append(&t, &h).unwrap().written, 0, "nothing twice");

    store.delete_thread(&t).unwrap();
    assert_eq!(a.len(&t).unwrap(), 0);
    assert!(a.get(&t, "m1").unwrap().is_none());
    assert_eq!(a.append(&t, &h[..1]).unwrap().seqs, [0]);
    assert_eq!(a.get(&t, "m0").unwrap().unwrap().message, h[0]);
}

/// An archive that touched many threads keeps a bounded number of indexes, and one
/// dropped from memory reads back from the store.
#[test]
fn indexes_of_many_threads_stay_bounded_and_reload() {
    let archive = Archive::new(Arc::new(MemoryStore::new()));
    let h = history(2);
    for i in 0..(Archive::CACHED_THREADS * 3) {
        archive.append(&thread(&format!("t{i}")), &h).unwrap();
    }
    for i in [0, Archive::CACHED_THREADS, Archive::CACHED_THREADS * 3 - 1] {
        let t = thread(&format!("t{i}"));
        assert_eq!(archive.len(&t).unwrap(), 2);
        assert_eq!(archive.get(&t, "m1").unwrap().unwrap().message, h[1]);
    }
    assert!(archive.cached_threads() <= Archive::CACHED_THREADS);
}

#[test]
fn two_archives_appending_to_one_thread_at_once_return_distinct_true_positions() {
    // Two workers' `Archive`s over one store (one writer a thread is the rule, but a
    // worker taking over a thread may overlap with one that has not noticed yet).
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let t = thread("shared");
    let per_writer = 300;
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let archive = Archive::new(store.clone());
            let t = t.clone();
            std::thread::spawn(move || {
                (0..per_writer)
                    .map(|i| {
                        let m = Message::user(format!("writer {w} message {i}"))
                            .with_id(format!("w{w}-{i}"));
                        let seq = archive.append(&t, std::slice::from_ref(&m)).unwrap().seqs[0];
                        (seq, m)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let appended: Vec<(u64, Message)> = writers
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let mut seqs: Vec<u64> = appended.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(
        seqs.len(),
        2 * per_writer,
        "two appends were given one position"
    );
    // Each position holds the message appended there, read by a third archive.
    let reader = Archive::new(store);
    for (seq, m) in &appended {
        let found = reader.range(&t, *seq..seq + 1).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].message.content, m.content, "position {seq}");
    }
}
