//! `SqliteStore`: the conformance suite on a file and in memory, the same file as the
//! checkpointer's, rows after `delete_thread`, a newer schema refused, a 200 MB value.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_offload::{Key, OffloadError, OffloadStore, SqliteStore, ThreadId, conformance};

fn rows(path: &std::path::Path, thread: &str) -> (i64, i64) {
    let conn = rusqlite::Connection::open(path).unwrap();
    let count = |table: &str| -> i64 {
        conn.query_row(
            &format!("SELECT count(*) FROM {table} WHERE thread_id = ?1"),
            [thread],
            |r| r.get(0),
        )
        .unwrap()
    };
    (count("keel_offload_files"), count("keel_offload_chunks"))
}

#[test]
fn a_sqlite_file_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(dir.path().join("offload.db")).unwrap());
    conformance::run_all(&store);
}

#[test]
fn an_in_memory_sqlite_store_keeps_the_contract() {
    conformance::run_all(&Arc::new(SqliteStore::in_memory().unwrap()));
}

#[test]
fn delete_thread_leaves_no_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("offload.db");
    let store = SqliteStore::open(&path).unwrap();
    let big: String = (0..100_000)
        .map(|i| format!("line {i} of a long result\n"))
        .collect();
    assert!(big.len() > 2 << 20);
    store
        .put(
            &Key::new("doomed", "large_tool_results/call_1").unwrap(),
            &big,
        )
        .unwrap();
    for i in 0..10 {
        store
            .append(
                &Key::new("doomed", "archive/messages.jsonl").unwrap(),
                &format!("{{\"seq\":{i}}}\n"),
            )
            .unwrap();
    }
    store
        .put(&Key::new("other", "notes").unwrap(), "kept")
        .unwrap();
    let (files, chunks) = rows(&path, "doomed");
    assert_eq!(files, 2);
    assert_eq!(
        chunks,
        3 + 10,
        "a 2+ MB value in 1 MiB chunks plus one row per append"
    );
    // A put that replaces a value drops the old chunks.
    store
        .put(
            &Key::new("doomed", "large_tool_results/call_1").unwrap(),
            "short",
        )
        .unwrap();
    assert_eq!(rows(&path, "doomed"), (2, 11));

    assert_eq!(
        store
            .delete_thread(&ThreadId::new("doomed").unwrap())
            .unwrap(),
        2
    );
    assert_eq!(rows(&path, "doomed"), (0, 0));
    assert_eq!(rows(&path, "other"), (1, 1));
}

#[test]
fn forks_and_their_collection_leave_only_the_rows_a_live_lineage_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("offload.db");
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conformance::lineage_rows(&store, &|thread| {
        let count = |sql: &str| -> i64 {
            conn.query_row(sql, [thread.as_str()], |r| r.get(0))
                .unwrap()
        };
        conformance::Rows {
            files: count("SELECT count(*) FROM keel_offload_files WHERE thread_id = ?1"),
            orphan_chunks: count(
                "SELECT count(*) FROM keel_offload_chunks c WHERE c.thread_id = ?1 AND NOT EXISTS
                 (SELECT 1 FROM keel_offload_files f
                  WHERE f.thread_id = c.thread_id AND f.generation = c.generation)",
            ),
            chunk_bytes: count(
                "SELECT coalesce(sum(length(data)), 0) FROM keel_offload_chunks WHERE thread_id = ?1",
            ),
        }
    });
}

#[test]
fn a_newer_schema_is_refused_with_its_version() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("offload.db");
    drop(SqliteStore::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute("UPDATE keel_offload_schema SET version = 99", [])
        .unwrap();
    drop(conn);
    match SqliteStore::open(&path) {
        Err(e @ OffloadError::SchemaTooNew { found: 99, .. }) => {
            assert!(e.to_string().contains("version 99"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // Reopening an up-to-date file changes nothing.
    conn_version(&path, 1);
    drop(SqliteStore::open(&path));
}

fn conn_version(path: &std::path::Path, v: i64) {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute("UPDATE keel_offload_schema SET version = ?1", [v])
        .unwrap();
    let n: i64 = conn
        .query_row("SELECT count(*) FROM keel_offload_schema", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[test]
fn two_stores_on_one_file_see_each_others_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("offload.db");
    let a = Arc::new(SqliteStore::open(&path).unwrap());
    let b = Arc::new(SqliteStore::open(&path).unwrap());
    let k = Key::new("t", "archive/messages.jsonl").unwrap();
    let writers: Vec<_> = [a.clone(), b.clone()]
        .into_iter()
        .enumerate()
        .map(|(w, s)| {
            let k = k.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    s.append(&k, &format!("w{w} {i}\n")).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let text = a.get(&k).unwrap();
    assert_eq!(text.lines().count(), 100);
    assert_eq!(b.get(&k).unwrap(), text);
}

/// One file holds the checkpoints and the archive: the checkpointer opens it first,
/// the store adds its own tables, and both reopen it afterwards with everything kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpointers_file_holds_the_archive_too() {
    use keel_checkpoint_sqlite::SqliteSaver;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.db");
    let saver = SqliteSaver::open(&path).await.unwrap();
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    keel_checkpoint::conformance::round_trip(&saver).await;
    let s = Arc::clone(&store);
    tokio::task::spawn_blocking(move || conformance::archive(&s))
        .await
        .unwrap();
    let k = Key::new("ticket-42", "archive/messages.jsonl").unwrap();
    let s = Arc::clone(&store);
    let k2 = k.clone();
    tokio::task::spawn_blocking(move || s.append(&k2, "{\"seq\":0}\n").unwrap())
        .await
        .unwrap();
    drop(saver);
    drop(store);

    // Both reopen the shared file: the saver's schema and ours live side by side.
    let saver = SqliteSaver::open(&path).await.unwrap();
    keel_checkpoint::conformance::delete_thread(&saver).await;
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.get(&k).unwrap(), "{\"seq\":0}\n");
    let conn = rusqlite::Connection::open(&path).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for ours in [
        "keel_offload_chunks",
        "keel_offload_files",
        "keel_offload_schema",
    ] {
        assert!(tables.iter().any(|t| t == ours), "{tables:?}");
    }
    assert!(
        tables.len() > 3,
        "the checkpointer's tables too: {tables:?}"
    );
}

/// A database at its size limit fails writes as a full disk would, changes nothing,
/// and the archive policy keeps the messages in context (invariant 2).
#[test]
fn a_full_database_keeps_messages_in_context() {
    use keel_offload::{Archive, SqliteStoreOptions};

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.db");
    let store = Arc::new(
        SqliteStore::open_with(&path, SqliteStoreOptions::new().max_size(Some(512 * 1024)))
            .unwrap(),
    );
    let big = "y".repeat(2 << 20);
    let err = store
        .put(&Key::new("t", "large_tool_results/call_1").unwrap(), &big)
        .unwrap_err();
    assert!(err.is_storage_full(), "{err}");
    assert_eq!(rows(&path, "t"), (0, 0), "a failed put leaves no rows");

    let archive = Archive::new(store.clone());
    let t = ThreadId::new("t").unwrap();
    let history: Vec<keel_message::Message> = (0..4)
        .map(|i| keel_message::Message::user("z".repeat(300 * 1024)).with_id(format!("m{i}")))
        .collect();
    let out = archive.archive_and_remove(history.clone(), 0..4, &t);
    assert_eq!(out.messages, history);
    assert!(out.failures[0].error.is_storage_full());
    assert_eq!(archive.len(&t).unwrap(), 0);
    let ok = archive.archive_and_remove(history.clone(), 0..1, &t);
    assert!(ok.is_complete(), "{:?}", ok.failures);
    assert_eq!(ok.messages.len(), 3);
}
