//! Lineages beyond the conformance check: a thread stored before lineages, forks of
//! forks, a fork that has nothing to write apart, what a view refuses, and a store cut
//! under a lineage.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_message::{Message, ToolCall};
use keel_offload::{
    Archive, FsStore, Fsync, Key, Lineage, LineageStore, MemoryStore, OffloadError, OffloadStore,
    Pattern, RetrievalTools, ThreadId, collect_garbage,
};
use serde_json::json;

fn thread() -> ThreadId {
    ThreadId::new("t").unwrap()
}

fn records(tag: &str, range: std::ops::Range<usize>) -> Vec<Message> {
    range
        .map(|i| Message::user(format!("{tag} record {i}")).with_id(format!("{tag}-{i}")))
        .collect()
}

/// Appends records `<tag> record <range>` as `lineage` writes them.
fn append(archive: &Archive, lineage: &mut Lineage, tag: &str, range: std::ops::Range<usize>) {
    archive
        .append_in(lineage, &thread(), &records(tag, range))
        .unwrap();
}

/// The texts `lineage` finds for `pattern` in the archive.
fn found(archive: &Archive, lineage: &Lineage, pattern: &str) -> Vec<String> {
    archive
        .grep_in(lineage, &thread(), &Pattern::new(pattern).unwrap(), 100)
        .unwrap()
        .messages
        .into_iter()
        .map(|m| m.message.text().into_owned())
        .collect()
}

#[test]
fn a_thread_stored_before_lineages_reads_everything_and_continues_its_archive() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let archive = Archive::new(store.clone());
    // Written the old way: no lineage, no record.
    archive.append(&thread(), &records("old", 0..3)).unwrap();
    store
        .put(
            &Key::new("t", "large_tool_results/call_1").unwrap(),
            "an old result\n",
        )
        .unwrap();
    let old = Lineage::unscoped();
    assert!(!old.is_scoped());
    assert_eq!(archive.len_in(&old, &thread()).unwrap(), 3);
    let tools = RetrievalTools::new(store.clone(), thread()).with_lineage(old.clone());
    let ls = tools.execute(&ToolCall::new("c", "ls", json!({}))).unwrap();
    assert!(
        ls.contains("archive/messages.jsonl") && ls.contains("call_1"),
        "{ls}"
    );

    // Its next compaction continues the archive and makes the lineage scoped there.
    let mut next = old.clone();
    let appended = archive
        .append_in(&mut next, &thread(), &records("new", 0..2))
        .unwrap();
    assert_eq!(appended.seqs, [3, 4]);
    assert!(next.is_scoped());
    assert_eq!(next.forks().count(), 0);
    assert_eq!(
        archive.len(&thread()).unwrap(),
        5,
        "the same file, continued"
    );
    assert_eq!(found(&archive, &next, "record").len(), 5);
    // The old result stays visible to the new lineage (no record names it).
    let view = LineageStore::new(store.clone(), thread(), next.clone());
    assert_eq!(
        view.get(&Key::new("t", "large_tool_results/call_1").unwrap())
            .unwrap(),
        "an old result\n"
    );
    // And a fork from the scoped point is scoped.
    let mut fork = next.clone();
    append(&archive, &mut next, "main", 0..1);
    append(&archive, &mut fork, "fork", 0..1);
    assert!(found(&archive, &fork, "main record").is_empty());
    assert_eq!(found(&archive, &fork, "fork record"), ["fork record 0"]);
}

#[test]
fn forks_of_forks_read_each_ancestor_up_to_where_they_left_it() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn OffloadStore> =
        Arc::new(FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never));
    let archive = Archive::new(store.clone());
    let mut a = Lineage::new();
    append(&archive, &mut a, "a", 0..2);
    let a_point = a.clone();
    append(&archive, &mut a, "a", 2..4);
    let mut b = a_point.clone();
    append(&archive, &mut b, "b", 0..2);
    let b_point = b.clone();
    append(&archive, &mut b, "b", 2..4);
    let mut c = b_point.clone();
    append(&archive, &mut c, "c", 0..2);
    assert_eq!(
        (a.forks().count(), b.forks().count(), c.forks().count()),
        (0, 1, 2)
    );
    assert_eq!(
        found(&archive, &c, "record"),
        [
            "a record 0",
            "a record 1",
            "b record 0",
            "b record 1",
            "c record 0",
            "c record 1"
        ]
    );
    assert_eq!(found(&archive, &b, "record").len(), 6);
    assert_eq!(found(&archive, &a, "record").len(), 4);
    // Read by line through the retrieval tools: one file, numbered on across segments.
    let tools = RetrievalTools::new(store.clone(), thread()).with_lineage(c.clone());
    let read = tools
        .execute(&ToolCall::new(
            "c",
            "read_file",
            json!({"path": "archive/messages.jsonl", "offset": 3, "limit": 2}),
        ))
        .unwrap();
    assert!(
        read.contains("     4\t") && read.contains("b record 1"),
        "{read}"
    );
    assert!(
        read.contains("     5\t") && read.contains("c record 0"),
        "{read}"
    );
    // Only c lives: a's and b's records after the points c left them go.
    collect_garbage(&*store, &thread(), std::slice::from_ref(&c)).unwrap();
    assert!(c.sees_all(&*store, &thread()).unwrap());
    assert_eq!(found(&archive, &c, "record").len(), 6);
    let raw = store
        .get(&Key::new("t", "archive/messages.jsonl").unwrap())
        .unwrap();
    assert!(!raw.contains("a record 2"), "{raw}");
}

#[test]
fn a_fork_with_nothing_stored_past_its_point_writes_on_in_place() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let archive = Archive::new(store.clone());
    let mut main = Lineage::new();
    append(&archive, &mut main, "base", 0..2);
    // A fork from the newest checkpoint (the other branch stored nothing since).
    let mut fork = main.clone();
    append(&archive, &mut fork, "fork", 0..2);
    assert_eq!(fork.forks().count(), 0, "no copy, no segment: {fork:?}");
    // Now the old branch is the one that must write apart.
    append(&archive, &mut main, "main", 0..2);
    assert_eq!(main.forks().count(), 1);
    assert!(found(&archive, &main, "fork").is_empty());
    assert!(found(&archive, &fork, "main").is_empty());
}

#[test]
fn a_view_refuses_other_threads_its_own_directory_and_mixed_writes() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let view = LineageStore::new(store.clone(), thread(), Lineage::new());
    let refused = |r: Result<u64, OffloadError>| match r {
        Err(OffloadError::Lineage { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    let other = refused(view.put(&Key::new("u", "notes").unwrap(), "x"));
    assert!(other.contains("serves thread t"), "{other}");
    assert!(view.list(&ThreadId::new("u").unwrap(), None).is_err());
    let own = refused(view.put(&Key::new("t", ".keel/files.jsonl").unwrap(), "x"));
    assert!(own.contains("keel's own"), "{own}");
    view.put(&Key::new("t", "notes").unwrap(), "a note\n")
        .unwrap();
    let mixed = refused(view.append(&Key::new("t", "notes").unwrap(), "more\n"));
    assert!(mixed.contains("written with put"), "{mixed}");
    view.append(&Key::new("t", "log").unwrap(), "one\n")
        .unwrap();
    let mixed = refused(view.put(&Key::new("t", "log").unwrap(), "two\n"));
    assert!(mixed.contains("written with append"), "{mixed}");
    assert!(matches!(
        view.delete(&Key::new("t", "notes").unwrap()),
        Err(OffloadError::Lineage { .. })
    ));
    // The lineage directory is not listed, read or searched.
    assert!(
        store
            .size(&Key::new("t", ".keel/files.jsonl").unwrap())
            .unwrap()
            .is_some()
    );
    let listed: Vec<String> = view
        .list(&thread(), None)
        .unwrap()
        .into_iter()
        .map(|e| e.path.to_string())
        .collect();
    assert_eq!(listed, ["log", "notes"]);
    assert!(
        view.get(&Key::new("t", ".keel/files.jsonl").unwrap())
            .unwrap_err()
            .is_not_found()
    );
    // A directory is a directory, not a missing file.
    view.put(&Key::new("t", "dir/a").unwrap(), "a\n").unwrap();
    let err = view.get(&Key::new("t", "dir").unwrap()).unwrap_err();
    assert!(!err.is_not_found(), "{err}");
}

#[test]
fn a_file_cut_under_a_lineage_is_an_error_not_a_narrower_view() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let archive = Archive::new(store.clone());
    let mut main = Lineage::new();
    append(&archive, &mut main, "base", 0..4);
    let key = Key::new("t", "archive/messages.jsonl").unwrap();
    store.truncate(&key, 10).unwrap();
    let view = LineageStore::new(store.clone(), thread(), main.clone());
    assert!(view.get(&key).is_err());
    match archive.append_in(&mut main.clone(), &thread(), &records("more", 0..1)) {
        Err(OffloadError::Lineage { reason, .. }) => {
            assert!(reason.contains("has seen"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_retried_put_takes_over_its_file_and_a_different_one_writes_apart() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let key = Key::new("t", "large_tool_results/call_1").unwrap();
    let before = Lineage::new();
    let first = LineageStore::new(store.clone(), thread(), before.clone());
    first.put(&key, "the result\n").unwrap();
    // The step crashed before its checkpoint: the retry starts from `before` again.
    let retry = LineageStore::new(store.clone(), thread(), before.clone());
    retry.put(&key, "the result\n").unwrap();
    assert_eq!(retry.lineage(), first.lineage());
    // A tool that answers differently on the retry: the first answer is not overwritten.
    let other = LineageStore::new(store.clone(), thread(), before);
    other.put(&key, "another result\n").unwrap();
    assert_eq!(other.lineage().forks().count(), 1);
    assert_eq!(other.get(&key).unwrap(), "another result\n");
    assert_eq!(first.get(&key).unwrap(), "the result\n");
}
