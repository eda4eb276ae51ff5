//! The store contract, run against every backend, and the file store's own promises:
//! refused keys, symbolic links, atomic puts, appends that only add bytes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_offload::{
    Entry, FsStore, Fsync, GrepOptions, Key, KeyProblem, LineRange, MemoryStore, OffloadError,
    OffloadStore, Pattern, StorePath, ThreadId, conformance,
};

fn key(thread: &str, path: &str) -> Key {
    Key::new(thread, path).unwrap()
}

fn thread(id: &str) -> ThreadId {
    ThreadId::new(id).unwrap()
}

fn paths(entries: &[Entry]) -> Vec<&str> {
    entries.iter().map(|e| e.path.as_str()).collect()
}

#[test]
fn memory_store_keeps_the_contract() {
    conformance::run_all(&Arc::new(MemoryStore::new()));
}

#[test]
fn fs_store_keeps_the_contract() {
    for fsync in [Fsync::Never, Fsync::Always] {
        let dir = tempfile::tempdir().unwrap();
        let store = FsStore::new(dir.path()).unwrap().with_fsync(fsync);
        if fsync == Fsync::Always {
            conformance::contract(&store);
        } else {
            conformance::run_all(&Arc::new(store));
        }
        // Writes in progress live in `.tmp`, never in a thread's namespace, and none is
        // left behind.
        assert_eq!(
            std::fs::read_dir(dir.path().join(".tmp")).unwrap().count(),
            0
        );
    }
}

#[test]
fn stores_work_behind_shared_pointers() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let k = key("t", "a");
    store.put(&k, "x").unwrap();
    let shared = Arc::clone(&store);
    let text = std::thread::spawn(move || shared.get(&k).unwrap())
        .join()
        .unwrap();
    assert_eq!(text, "x");
}

#[test]
fn bad_keys_are_refused_before_any_io() {
    let cases: &[(&str, KeyProblem)] = &[
        ("../../etc/passwd", KeyProblem::ParentDir),
        (
            "large_tool_results/../../../etc/passwd",
            KeyProblem::ParentDir,
        ),
        ("/etc/passwd", KeyProblem::Absolute),
        ("a\0b", KeyProblem::Nul),
        ("a\\..\\b", KeyProblem::Backslash),
        ("a/./b", KeyProblem::EmptyComponent),
    ];
    for (path, want) in cases {
        match Key::new("t1", *path) {
            Err(OffloadError::InvalidKey { problem, .. }) => assert_eq!(&problem, want, "{path:?}"),
            other => panic!("{path:?} was not refused: {other:?}"),
        }
    }
    let long = "n".repeat(4096);
    let err = Key::new("t1", long.as_str()).unwrap_err();
    assert!(matches!(
        err,
        OffloadError::InvalidKey {
            problem: KeyProblem::TooLong { len: 4096, .. },
            ..
        }
    ));
    assert!(err.to_string().contains("4096 bytes long"), "{err}");
    for bad_thread in ["..", "a/b", ".tmp", "", "t\0"] {
        assert!(Key::new(bad_thread, "x").is_err(), "{bad_thread:?}");
    }
    // A blank id, or one a text-direction override makes read as another.
    for (thread, want) in [
        (" ", KeyProblem::Blank),
        ("\t \u{3000}", KeyProblem::Blank),
        ("\u{202E}live-prod", KeyProblem::ControlChar(0x202E)),
        ("run\u{2067}1", KeyProblem::ControlChar(0x2067)),
    ] {
        match ThreadId::new(thread) {
            Err(OffloadError::InvalidKey { problem, .. }) => {
                assert_eq!(problem, want, "{thread:?}")
            }
            other => panic!("{thread:?} was not refused: {other:?}"),
        }
    }
    assert!(ThreadId::new("run 1").is_ok(), "inner spaces are fine");
}

#[cfg(unix)]
mod symlinks {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A root, a store on it, and a directory outside the root holding a secret.
    fn setup() -> (tempfile::TempDir, tempfile::TempDir, FsStore) {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "do not read").unwrap();
        let store = FsStore::new(root.path()).unwrap().with_fsync(Fsync::Never);
        (root, outside, store)
    }

    fn is_symlink_error(e: &OffloadError) -> bool {
        matches!(e, OffloadError::Symlink { .. })
    }

    #[test]
    fn a_directory_link_pointing_outside_is_never_followed() {
        let (root, outside, store) = setup();
        std::fs::create_dir(root.path().join("t1")).unwrap();
        symlink(outside.path(), root.path().join("t1/escape")).unwrap();

        let k = key("t1", "escape/secret");
        assert!(is_symlink_error(&store.get(&k).unwrap_err()));
        assert!(is_symlink_error(&store.read_at(&k, 0, 4).unwrap_err()));
        assert!(is_symlink_error(
            &store.read_lines(&k, &LineRange::new(0, 1)).unwrap_err()
        ));
        assert!(is_symlink_error(&store.size(&k).unwrap_err()));
        let w = key("t1", "escape/planted");
        assert!(is_symlink_error(&store.put(&w, "x").unwrap_err()));
        assert!(is_symlink_error(&store.append(&w, "x").unwrap_err()));
        assert!(is_symlink_error(&store.delete(&k).unwrap_err()));
        let under = StorePath::new("escape").unwrap();
        assert!(is_symlink_error(
            &store.list(&thread("t1"), Some(&under)).unwrap_err()
        ));

        // Nothing was written or removed outside the root.
        assert!(!outside.path().join("planted").exists());
        assert_eq!(
            std::fs::read_to_string(outside.path().join("secret")).unwrap(),
            "do not read"
        );
        // Listing and grepping the whole thread skip the link.
        assert!(store.list(&thread("t1"), None).unwrap().is_empty());
        let found = store
            .grep(
                &thread("t1"),
                None,
                &Pattern::new("read").unwrap(),
                &GrepOptions::default(),
            )
            .unwrap();
        assert!(found.matches.is_empty());
    }

    #[test]
    fn a_file_link_is_refused_even_inside_the_root() {
        let (root, outside, store) = setup();
        store.put(&key("t1", "real"), "inside").unwrap();
        symlink(root.path().join("t1/real"), root.path().join("t1/alias")).unwrap();
        symlink(outside.path().join("secret"), root.path().join("t1/secret")).unwrap();
        for name in ["alias", "secret"] {
            let k = key("t1", name);
            assert!(is_symlink_error(&store.get(&k).unwrap_err()), "{name}");
            assert!(
                is_symlink_error(&store.put(&k, "overwrite").unwrap_err()),
                "{name}"
            );
            assert!(
                is_symlink_error(&store.append(&k, "more").unwrap_err()),
                "{name}"
            );
        }
        assert_eq!(
            std::fs::read_to_string(outside.path().join("secret")).unwrap(),
            "do not read"
        );
        assert_eq!(store.get(&key("t1", "real")).unwrap(), "inside");
        assert_eq!(paths(&store.list(&thread("t1"), None).unwrap()), ["real"]);
    }

    #[test]
    fn a_thread_directory_that_is_a_link_is_refused() {
        let (root, outside, store) = setup();
        symlink(outside.path(), root.path().join("t1")).unwrap();
        assert!(is_symlink_error(
            &store.get(&key("t1", "secret")).unwrap_err()
        ));
        assert!(is_symlink_error(
            &store.put(&key("t1", "new"), "x").unwrap_err()
        ));
        assert!(is_symlink_error(
            &store.list(&thread("t1"), None).unwrap_err()
        ));
        assert!(!outside.path().join("new").exists());
    }

    #[test]
    fn the_root_itself_may_be_reached_through_a_link() {
        let real = tempfile::tempdir().unwrap();
        let links = tempfile::tempdir().unwrap();
        let via = links.path().join("store");
        symlink(real.path(), &via).unwrap();
        let store = FsStore::new(&via).unwrap().with_fsync(Fsync::Never);
        store.put(&key("t1", "a"), "ok").unwrap();
        assert_eq!(
            std::fs::read_to_string(real.path().join("t1/a")).unwrap(),
            "ok"
        );
    }
}

#[cfg(unix)]
#[test]
fn append_adds_bytes_in_place_and_put_replaces_atomically() {
    use std::os::unix::fs::MetadataExt;

    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let log = key("t1", "archive/messages.jsonl");
    store.append(&log, "one\n").unwrap();
    let path = store.path_of(&log);
    let inode = std::fs::metadata(&path).unwrap().ino();
    for i in 0..100 {
        store.append(&log, &format!("line {i}\n")).unwrap();
    }
    // Same file, grown in place: appends never rewrite it.
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode);
    assert!(store.get(&log).unwrap().starts_with("one\nline 0\n"));

    // `put` renames a new file over the old one.
    let k = key("t1", "result");
    store.put(&k, "old").unwrap();
    let before = std::fs::metadata(store.path_of(&k)).unwrap().ino();
    store.put(&k, "new").unwrap();
    assert_ne!(std::fs::metadata(store.path_of(&k)).unwrap().ino(), before);
}

#[test]
fn readers_never_see_half_a_put() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never));
    let k = key("t1", "flip");
    let a = "a".repeat(1 << 20);
    let b = "b".repeat(1 << 20);
    store.put(&k, &a).unwrap();
    let writer = {
        let (store, k, a, b) = (Arc::clone(&store), k.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            for i in 0..50 {
                store.put(&k, if i % 2 == 0 { &b } else { &a }).unwrap();
            }
        })
    };
    let mut reads = 0;
    while !writer.is_finished() || reads == 0 {
        let got = store.get(&k).unwrap();
        assert!(got == a || got == b, "a torn read of {} bytes", got.len());
        reads += 1;
    }
    writer.join().unwrap();
}

/// Threads appending to one key through one store get the offsets their text landed
/// at: every offset distinct, and the text at each is the thread's own.
#[test]
fn appends_from_many_threads_return_where_each_landed() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never));
    let k = key("t1", "log.jsonl");
    store.put(&k, "").unwrap();
    let writers: Vec<_> = (0..8)
        .map(|t| {
            let (store, k) = (Arc::clone(&store), k.clone());
            std::thread::spawn(move || {
                (0..2_000)
                    .map(|i| {
                        let line = format!("thread {t} line {i:03}\n");
                        (store.append(&k, &line).unwrap(), line)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let all: Vec<(u64, String)> = writers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    let text = store.get(&k).unwrap();
    let offsets: std::collections::HashSet<u64> = all.iter().map(|(o, _)| *o).collect();
    assert_eq!(
        offsets.len(),
        all.len(),
        "two appends were given one offset"
    );
    for (offset, line) in &all {
        let at = usize::try_from(*offset).unwrap();
        assert_eq!(&text[at..at + line.len()], line);
    }
}

#[test]
fn invalid_utf8_on_disk_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let k = key("t1", "bytes");
    store.put(&k, "placeholder").unwrap();
    std::fs::write(store.path_of(&k), [b'o', b'k', 0xff, b'\n']).unwrap();
    assert!(matches!(
        store.get(&k).unwrap_err(),
        OffloadError::NotUtf8 { .. }
    ));
    // Line reads and grep replace invalid bytes instead of failing.
    let lines = store.read_lines(&k, &LineRange::new(0, 1)).unwrap();
    assert_eq!(lines.lines[0].text, "ok\u{fffd}");
}

#[test]
fn a_memory_store_with_a_limit_fills_up_like_a_disk() {
    let store = MemoryStore::with_limit(10);
    let k = key("t1", "a");
    store.put(&k, "12345").unwrap();
    store.append(&k, "678").unwrap();
    let err = store.append(&k, "9ab").unwrap_err();
    assert!(err.is_storage_full(), "{err}");
    // A failed write changes nothing.
    assert_eq!(store.get(&k).unwrap(), "12345678");
    // Replacing frees the old bytes first.
    store.put(&k, "0123456789").unwrap();
    assert_eq!(store.bytes(), 10);
}

/// Deleting a thread from the file store leaves no empty directory tree behind, keeps
/// other threads, and never follows a link planted in the thread's directory.
#[test]
fn fs_delete_thread_removes_the_threads_directories() {
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    store
        .put(&key("t1", "archive/messages.jsonl"), "{}\n")
        .unwrap();
    store
        .put(&key("t1", "large_tool_results/call_1"), "big")
        .unwrap();
    store
        .put(&key("t2", "archive/messages.jsonl"), "{}\n")
        .unwrap();
    assert_eq!(store.delete_thread(&thread("t1")).unwrap(), 2);
    assert!(
        !dir.path().join("t1").exists(),
        "the thread's directory is gone"
    );
    assert_eq!(
        store.get(&key("t2", "archive/messages.jsonl")).unwrap(),
        "{}\n"
    );

    #[cfg(unix)]
    {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep.txt"), "keep").unwrap();
        store.put(&key("t3", "notes/a"), "a").unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("t3/link")).unwrap();
        store.delete_thread(&thread("t3")).unwrap();
        assert!(
            outside.path().join("keep.txt").exists(),
            "a link is not followed"
        );
        assert!(
            dir.path().join("t3/link").exists(),
            "what the store does not own stays"
        );
        assert!(!dir.path().join("t3/notes").exists());
    }
}

#[cfg(unix)]
#[test]
fn a_fifo_placed_in_an_fs_store_is_refused_not_read() {
    // Opening a FIFO with no writer hung the read forever.
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap();
    let key = Key::new("t1", "large_tool_results/pipe").unwrap();
    store
        .put(&Key::new("t1", "large_tool_results/x").unwrap(), "x")
        .unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(dir.path().join("t1/large_tool_results/pipe"))
        .status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped: mkfifo is not available here");
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(store.get(&key).map(|_| ()));
    });
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the read returned");
    let err = got.unwrap_err();
    assert!(matches!(err, OffloadError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("not a regular file"), "{err}");
}
