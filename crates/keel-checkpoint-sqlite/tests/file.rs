#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The file itself: two savers on one file (two connections, as two processes would
//! have), reopening, migrations, refusing foreign files, and storage errors.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{fold, items, list_all, put_log_step, step};
use keel_checkpoint::{CheckpointError, Checkpointer, PendingWrite, ThreadKey};
use keel_checkpoint_sqlite::rusqlite::{Connection, ErrorCode};
use keel_checkpoint_sqlite::{SCHEMA_VERSION, SqliteError, SqliteOptions, SqliteSaver};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_savers_on_one_file_race_and_exactly_one_wins_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("race.db");
    let a = SqliteSaver::open(&path).await.unwrap();
    let b = SqliteSaver::open(&path).await.unwrap();
    let thread = ThreadKey::new("raced");

    let first = step(&thread, None, "log", vec![json!("start")]);
    a.put(first.clone()).await.unwrap();
    let mut head = first.checkpoint;
    let mut expected = vec![json!("start")];
    let (mut wins_a, mut wins_b) = (0, 0);
    for round in 0..40 {
        let ra = step(
            &thread,
            Some(&head),
            "log",
            vec![json!(format!("a{round}"))],
        );
        let rb = step(
            &thread,
            Some(&head),
            "log",
            vec![json!(format!("b{round}"))],
        );
        // Each put runs on its own saver's writer thread; both go for the write lock.
        let (sa, sb) = (a.clone(), b.clone());
        let (ta, tb) = (ra.clone(), rb.clone());
        let (res_a, res_b) = tokio::join!(
            tokio::spawn(async move { sa.put(ta).await }),
            tokio::spawn(async move { sb.put(tb).await }),
        );
        let (winner, loser) = match (res_a.unwrap(), res_b.unwrap()) {
            (Ok(()), Err(e)) if e.is_conflict() => {
                wins_a += 1;
                (ra, rb)
            }
            (Err(e), Ok(())) if e.is_conflict() => {
                wins_b += 1;
                (rb, ra)
            }
            other => panic!("round {round}: expected one winner and one Conflict, got {other:?}"),
        };
        expected.extend(winner.deltas[0].updates.iter().cloned());
        for saver in [&a, &b] {
            let got = saver.get(&thread, None).await.unwrap().unwrap();
            assert_eq!(got.checkpoint, winner.checkpoint, "round {round}: head");
            assert_eq!(fold(&got.channels["log"]), expected, "round {round}: value");
            assert!(
                saver
                    .get(&thread, Some(&loser.checkpoint.id))
                    .await
                    .unwrap()
                    .is_none(),
                "round {round}: the loser's checkpoint was stored"
            );
        }
        head = winner.checkpoint;
    }
    assert_eq!(wins_a + wins_b, 40);
    let listed = list_all(&b, &thread).await;
    assert_eq!(listed.len(), 41);
    let stats = a.stats().await.unwrap();
    assert_eq!(
        (stats.checkpoints, stats.deltas),
        (41, 41),
        "no trace of the losers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopening_the_file_gives_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reopen.db");
    let thread = ThreadKey::new("t").with_ns("sub:1");
    let saver = SqliteSaver::open(&path).await.unwrap();
    let mut parent = None;
    for i in 0..30 {
        put_log_step(&saver, &thread, &mut parent, items(&format!("s{i}"), 3, 50)).await;
    }
    let head_id = parent.as_ref().unwrap().id.clone();
    saver
        .put_writes(
            &thread,
            &head_id,
            vec![PendingWrite::new("task", "p", "log", json!("pending"))],
        )
        .await
        .unwrap();
    let before = saver.get(&thread, None).await.unwrap().unwrap();
    let listed = list_all(&saver, &thread).await;
    drop(saver);
    assert!(
        !dir.path().join("reopen.db-wal").exists(),
        "closing the last connection folds the WAL into the file"
    );

    let saver = SqliteSaver::open(&path).await.unwrap();
    assert_eq!(saver.get(&thread, None).await.unwrap().unwrap(), before);
    let relisted = list_all(&saver, &thread).await;
    assert_eq!(relisted, listed);
    assert_eq!(fold(&before.channels["log"]).len(), 90);
    // ... and the thread goes on from its head.
    let next = step(
        &thread,
        Some(&before.checkpoint),
        "log",
        vec![json!("more")],
    );
    saver.put(next).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn migrations_are_versioned_and_run_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("schema.db");
    let thread = ThreadKey::new("t");
    let saver = SqliteSaver::open(&path).await.unwrap();
    let request = step(&thread, None, "log", vec![json!(1)]);
    saver.put(request.clone()).await.unwrap();
    // A second saver on the same file while the first is open, then a reopen: the
    // migration does not run again (it would fail: the tables exist) and data stays.
    let second = SqliteSaver::open(&path).await.unwrap();
    drop(saver);
    drop(second);
    let saver = SqliteSaver::open(&path).await.unwrap();
    assert!(saver.get(&thread, None).await.unwrap().is_some());
    drop(saver);

    let conn = Connection::open(&path).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");

    // A file from a newer version is refused, not touched.
    conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    drop(conn);
    match SqliteSaver::open(&path).await {
        Err(SqliteError::NewerSchema {
            found, supported, ..
        }) => assert_eq!((found, supported), (SCHEMA_VERSION + 1, SCHEMA_VERSION)),
        other => panic!("expected NewerSchema, got {other:?}"),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn foreign_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Another application's database.
    let other = dir.path().join("other.db");
    let conn = Connection::open(&other).unwrap();
    conn.execute_batch("CREATE TABLE checkpoints (x); INSERT INTO checkpoints VALUES (1);")
        .unwrap();
    drop(conn);
    assert!(matches!(
        SqliteSaver::open(&other).await,
        Err(SqliteError::ForeignDatabase { .. })
    ));
    // Not a database at all.
    let text = dir.path().join("notes.txt");
    std::fs::write(
        &text,
        "not a database, just text that is long enough to have a header ".repeat(20),
    )
    .unwrap();
    let err = SqliteSaver::open(&text).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotADatabase), "{err}");
}

/// keel-offload's `SqliteStore` may open the file first: its `keel_offload_*` tables
/// are keel's, not a foreign schema, and the saver adds its own beside them.
#[tokio::test(flavor = "current_thread")]
async fn the_offload_stores_tables_are_not_foreign() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.db");
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE keel_offload_schema (version INTEGER NOT NULL);
         CREATE TABLE keel_offload_files (thread_id TEXT, path TEXT);",
    )
    .unwrap();
    drop(conn);
    let saver = SqliteSaver::open(&path).await.unwrap();
    keel_checkpoint::conformance::round_trip(&saver).await;
    // A table of someone else's still makes the file foreign.
    let other = dir.path().join("other.db");
    let conn = Connection::open(&other).unwrap();
    conn.execute_batch("CREATE TABLE keel_offloaded (x); CREATE TABLE keel_offload_x (y);")
        .unwrap();
    drop(conn);
    assert!(matches!(
        SqliteSaver::open(&other).await,
        Err(SqliteError::ForeignDatabase { .. })
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn a_full_disk_is_a_typed_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.db");
    let saver = SqliteOptions::default()
        .max_size(256 * 1024)
        .open(&path)
        .await
        .unwrap();
    let thread = ThreadKey::new("t");
    let first = step(&thread, None, "log", items("small", 1, 100));
    saver.put(first.clone()).await.unwrap();
    // One step of about 400 KB cannot fit.
    let big = step(
        &thread,
        Some(&first.checkpoint),
        "log",
        items("big", 400, 1000),
    );
    let err = saver.put(big.clone()).await.unwrap_err();
    let sqlite = SqliteError::of(&err).unwrap_or_else(|| panic!("not a SqliteError: {err}"));
    assert_eq!(sqlite.code(), Some(ErrorCode::DiskFull), "{err}");
    // Nothing of the step was written; the saver carries on.
    let head = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(head.checkpoint, first.checkpoint);
    assert!(
        saver
            .get(&thread, Some(&big.checkpoint.id))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(saver.stats().await.unwrap().deltas, 1);
    let small = step(&thread, Some(&first.checkpoint), "log", items("ok", 1, 100));
    saver.put(small).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_past_the_busy_timeout_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    let saver = SqliteOptions::default()
        .busy_timeout(Duration::from_millis(50))
        .open(&path)
        .await
        .unwrap();
    let thread = ThreadKey::new("t");
    let first = step(&thread, None, "log", vec![json!(1)]);
    saver.put(first.clone()).await.unwrap();

    // Another connection (as another process would) takes the write lock and holds it.
    let blocker = Connection::open(&path).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let next = step(&thread, Some(&first.checkpoint), "log", vec![json!(2)]);
    let err = saver.put(next.clone()).await.unwrap_err();
    let sqlite = SqliteError::of(&err).unwrap_or_else(|| panic!("not a SqliteError: {err}"));
    assert!(sqlite.is_busy(), "{err}");
    // Reads go on meanwhile (WAL).
    assert_eq!(
        saver.get(&thread, None).await.unwrap().unwrap().checkpoint,
        first.checkpoint
    );
    blocker.execute_batch("ROLLBACK").unwrap();
    saver.put(next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_see_a_consistent_snapshot_while_the_writer_works() {
    // Many gets race with puts and prunes on the same thread: every get returns a
    // checkpoint whose chains are complete (never a Corrupt error from a half-pruned
    // or half-written state).
    let dir = tempfile::tempdir().unwrap();
    let saver = Arc::new(SqliteSaver::open(dir.path().join("mvcc.db")).await.unwrap());
    let thread = ThreadKey::new("t");
    let first = step(&thread, None, "log", vec![json!(0)]);
    saver.put(first.clone()).await.unwrap();

    let writer = {
        let (saver, thread) = (Arc::clone(&saver), thread.clone());
        tokio::spawn(async move {
            let mut head = first.checkpoint;
            for i in 1..200 {
                let request = step(&thread, Some(&head), "log", vec![json!(i)]);
                saver.put(request.clone()).await.unwrap();
                head = request.checkpoint;
                if i % 20 == 0 {
                    saver.prune(&thread, 3).await.unwrap();
                }
            }
        })
    };
    let mut reads = 0;
    while !writer.is_finished() {
        let tuple = saver.get(&thread, None).await.unwrap().unwrap();
        let value = fold(&tuple.channels["log"]);
        let expected: Vec<_> = (0..value.len()).map(|i| json!(i)).collect();
        assert_eq!(value, expected);
        reads += 1;
    }
    writer.await.unwrap();
    assert!(reads > 0);
    let tuple = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(fold(&tuple.channels["log"]).len(), 200);
}

#[tokio::test(flavor = "current_thread")]
async fn checkpoint_errors_are_not_storage_errors() {
    let saver = SqliteSaver::open_in_memory().await.unwrap();
    let thread = ThreadKey::new("t");
    let err = saver
        .put_writes(&thread, &keel_checkpoint::CheckpointId::new(), vec![])
        .await
        .unwrap_err();
    assert!(matches!(err, CheckpointError::NotFound { .. }));
    assert!(SqliteError::of(&err).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savers_opening_a_new_file_at_once_create_it_once() {
    // Each saver switches the file to WAL mode and migrates it under the write lock;
    // the others wait (busy timeout) and then find it done.
    for round in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fresh.db");
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let path = path.clone();
                tokio::spawn(async move { SqliteSaver::open(path).await })
            })
            .collect();
        let mut savers = Vec::new();
        for open in opens {
            savers.push(
                open.await
                    .unwrap()
                    .unwrap_or_else(|e| panic!("round {round}: {e}")),
            );
        }
        let thread = ThreadKey::new("t");
        let first = step(&thread, None, "log", vec![json!(1)]);
        savers[0].put(first.clone()).await.unwrap();
        for saver in &savers {
            let head = saver.get(&thread, None).await.unwrap().unwrap();
            assert_eq!(head.checkpoint, first.checkpoint);
        }
    }
}

/// The first step of `thread` with checkpoint id `id` (e.g. an old one).
fn first_step_at(thread: &ThreadKey, id: &str) -> keel_checkpoint::PutRequest {
    let id: keel_checkpoint::CheckpointId = id.parse().unwrap();
    let mut request = step(thread, None, "log", vec![json!(id.as_str())]);
    request.checkpoint.id = id.clone();
    request.deltas[0].version.writer = id;
    request
        .checkpoint
        .channel_versions
        .insert("log".into(), request.deltas[0].version.clone());
    request
}

#[tokio::test(flavor = "current_thread")]
async fn version_1_files_get_their_heads_and_can_be_swept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    let saver = SqliteSaver::open(&path).await.unwrap();
    let old = ThreadKey::new("old");
    let new = ThreadKey::new("new");
    // June 2023, in two namespaces of "old"; now in "new" and in a namespace of "old"'s
    // neighbour "half" whose root is old.
    saver
        .put(first_step_at(&old, "01890a5d-ac96-774b-bcce-b302099a8057"))
        .await
        .unwrap();
    saver
        .put(first_step_at(
            &old.clone().with_ns("sub"),
            "01890a5d-ac97-7000-8000-000000000001",
        ))
        .await
        .unwrap();
    let half = ThreadKey::new("half");
    saver
        .put(first_step_at(&half, "01890a5d-ac98-7000-8000-000000000001"))
        .await
        .unwrap();
    saver
        .put(step(
            &half.clone().with_ns("sub"),
            None,
            "log",
            vec![json!(1)],
        ))
        .await
        .unwrap();
    let first = step(&new, None, "log", vec![json!(1)]);
    saver.put(first.clone()).await.unwrap();
    saver
        .put(step(&new, Some(&first.checkpoint), "log", vec![json!(2)]))
        .await
        .unwrap();
    drop(saver);

    // Make it the file version 1 wrote: no heads table.
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch("DROP TABLE heads; PRAGMA user_version = 1;")
        .unwrap();
    drop(conn);

    // Opening migrates it: the heads are filled in from the checkpoints.
    let saver = SqliteSaver::open(&path).await.unwrap();
    let conn = Connection::open(&path).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let heads: Vec<(String, String, String)> = conn
        .prepare("SELECT thread_id, ns, head FROM heads ORDER BY thread_id, ns")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let keys: Vec<(&str, &str)> = heads
        .iter()
        .map(|(t, n, _)| (t.as_str(), n.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("half", ""),
            ("half", "sub"),
            ("new", ""),
            ("old", ""),
            ("old", "sub")
        ]
    );
    let new_head = saver.get(&new, None).await.unwrap().unwrap().checkpoint.id;
    assert_eq!(heads[2].2, new_head.as_str());
    drop(conn);

    let day = std::time::Duration::from_secs(24 * 3600);
    assert_eq!(saver.sweep_idle(day, 10).await.unwrap(), ["old"]);
    assert!(saver.get(&old, None).await.unwrap().is_none());
    assert!(
        saver
            .get(&old.clone().with_ns("sub"), None)
            .await
            .unwrap()
            .is_none()
    );
    assert!(saver.get(&half, None).await.unwrap().is_some());
    assert!(saver.get(&new, None).await.unwrap().is_some());
    assert_eq!(saver.stats().await.unwrap().threads, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_idle_in_batches() {
    // 300 idle threads and 5 busy ones: batches of 128 take 128, 128, 44, and the
    // short batch says the sweep is done.
    let dir = tempfile::tempdir().unwrap();
    let saver = SqliteSaver::open(dir.path().join("batches.db"))
        .await
        .unwrap();
    for i in 0..300u32 {
        let id = format!("01890a5d-ac96-7000-8000-{i:012x}");
        saver
            .put(first_step_at(&ThreadKey::new(format!("idle-{i}")), &id))
            .await
            .unwrap();
    }
    for i in 0..5 {
        saver
            .put(step(
                &ThreadKey::new(format!("busy-{i}")),
                None,
                "log",
                vec![json!(i)],
            ))
            .await
            .unwrap();
    }
    let hour = std::time::Duration::from_secs(3600);
    let mut sizes = Vec::new();
    let mut swept = std::collections::BTreeSet::new();
    loop {
        let batch = saver.sweep_idle(hour, 128).await.unwrap();
        sizes.push(batch.len());
        swept.extend(batch);
        if *sizes.last().unwrap() < 128 {
            break;
        }
    }
    assert_eq!(sizes, [128, 128, 44]);
    assert_eq!(swept.len(), 300);
    assert!(swept.iter().all(|t| t.starts_with("idle-")));
    let stats = saver.stats().await.unwrap();
    assert_eq!((stats.threads, stats.checkpoints, stats.deltas), (5, 5, 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_written_before_schema_3_stay_readable_and_new_ones_list_each_writer_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("versions.sqlite");
    let thread = ThreadKey::new("t");
    let saver = SqliteSaver::open(&path).await.unwrap();
    // Steps alternating between two channels: later checkpoints name several writers.
    let mut parent = None;
    for i in 0..6 {
        let channel = if i % 2 == 0 { "log" } else { "notes" };
        let request = step(&thread, parent.as_ref(), channel, vec![json!(i)]);
        saver.put(request.clone()).await.unwrap();
        parent = Some(request.checkpoint);
    }
    let before = saver.get(&thread, None).await.unwrap().unwrap();
    let listed = list_all(&saver, &thread).await;
    drop(saver);

    // New rows list each writer once.
    let conn = Connection::open(&path).unwrap();
    let (writers, distinct): (i64, i64) = conn
        .query_row(
            "SELECT json_array_length(versions, '$.writers'), \
             (SELECT count(DISTINCT value) FROM json_each(versions, '$.writers')) \
             FROM checkpoints ORDER BY checkpoint_id DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((writers, distinct), (2, 2));

    // Rewrite every row in the form schemas 1 and 2 wrote, as an older build left it.
    conn.execute_batch(
        "UPDATE checkpoints SET versions = json_object(
             'channels', (SELECT json_group_object(v.key, json_object(
                 'seq', json_extract(v.value, '$[1]'),
                 'writer', json_extract(checkpoints.versions,
                     '$.writers[' || json_extract(v.value, '$[0]') || ']')))
                 FROM json_each(checkpoints.versions, '$.versions') v),
             'seen', json(json_extract(versions, '$.seen')),
             'sends', json(json_extract(versions, '$.sends')));
         PRAGMA user_version = 2;",
    )
    .unwrap();
    let old_form: i64 = conn
        .query_row(
            "SELECT count(*) FROM checkpoints WHERE json_type(versions, '$.channels') = 'object' \
             AND json_type(versions, '$.writers') IS NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(old_form, 6);
    drop(conn);

    // Opened by this build: migrated, and the old rows read back as they were.
    let saver = SqliteSaver::open(&path).await.unwrap();
    let after = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(after.checkpoint, before.checkpoint);
    assert_eq!(fold(&after.channels["log"]), [json!(0), json!(2), json!(4)]);
    assert_eq!(
        fold(&after.channels["notes"]),
        [json!(1), json!(3), json!(5)]
    );
    let relisted = list_all(&saver, &thread).await;
    assert_eq!(relisted.len(), listed.len());
    for (a, b) in relisted.iter().zip(&listed) {
        assert_eq!(a.checkpoint, b.checkpoint);
    }

    // The thread goes on in the new form, and a prune walks old and new rows alike.
    let request = step(&thread, Some(&after.checkpoint), "log", vec![json!(6)]);
    saver.put(request.clone()).await.unwrap();
    assert_eq!(saver.prune(&thread, 2).await.unwrap(), 5);
    let last = saver.get(&thread, None).await.unwrap().unwrap();
    assert_eq!(
        fold(&last.channels["log"]),
        [json!(0), json!(2), json!(4), json!(6)]
    );
    assert_eq!(
        fold(&last.channels["notes"]),
        [json!(1), json!(3), json!(5)]
    );
    drop(saver);
    let conn = Connection::open(&path).unwrap();
    let forms: Vec<(bool, bool)> = conn
        .prepare(
            "SELECT json_type(versions, '$.writers') IS 'array', \
             json_type(versions, '$.channels') IS NOT NULL \
             FROM checkpoints ORDER BY checkpoint_id",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(forms, [(false, true), (true, false)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_versions_column_naming_a_writer_it_does_not_list_is_reported_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corrupt.sqlite");
    let thread = ThreadKey::new("t");
    let saver = SqliteSaver::open(&path).await.unwrap();
    saver
        .put(step(&thread, None, "log", vec![json!(1)]))
        .await
        .unwrap();
    drop(saver);
    let conn = Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE checkpoints SET versions = json_set(versions, '$.versions.log[0]', 7)",
        [],
    )
    .unwrap();
    drop(conn);
    let saver = SqliteSaver::open(&path).await.unwrap();
    let err = saver.get(&thread, None).await.unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Corrupt { what } if what.contains("names writer 7 of 1")),
        "{err:?}"
    );
}

/// Steps alternating channels "a" and "b", each appending one item, with a snapshot of
/// "a" every fourth time it is written, so prunes have deltas to delete.
fn alternating_steps(
    thread: &ThreadKey,
    from: usize,
    to: usize,
    parent: &mut Option<keel_checkpoint::Checkpoint>,
    values: &mut std::collections::BTreeMap<&'static str, Vec<serde_json::Value>>,
) -> Vec<keel_checkpoint::PutRequest> {
    let mut out = Vec::new();
    for i in from..to {
        let channel = if i % 2 == 0 { "a" } else { "b" };
        let item = json!(format!("{channel}{i}"));
        let value = values.entry(channel).or_default();
        value.push(item.clone());
        let mut request = step(thread, parent.as_ref(), channel, vec![item]);
        if channel == "a" && value.len().is_multiple_of(4) {
            request.deltas[0].snapshot = Some(json!(value.clone()));
        }
        *parent = Some(request.checkpoint.clone());
        out.push(request);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writers_prune_from_memory_and_a_fresh_savers_prune_leave_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let thread = ThreadKey::new("t");
    let mut parent = None;
    let mut values = std::collections::BTreeMap::new();
    let early = alternating_steps(&thread, 0, 40, &mut parent, &mut values);
    let late = alternating_steps(&thread, 40, 60, &mut parent, &mut values);

    // `fresh`: every prune by a saver that put nothing (it reads the chains back);
    // `writer`: every prune by the saver that put the steps (it walks what it
    // remembers, including links of deltas another saver's prune deleted).
    let mut results = Vec::new();
    for (name, fresh) in [("fresh", true), ("writer", false)] {
        let path = dir.path().join(format!("{name}.db"));
        let writer = SqliteSaver::open(&path).await.unwrap();
        let prune = |keep| {
            let (path, writer, thread) = (path.clone(), writer.clone(), thread.clone());
            async move {
                if fresh {
                    let other = SqliteSaver::open(&path).await.unwrap();
                    other.prune(&thread, keep).await.unwrap()
                } else {
                    writer.prune(&thread, keep).await.unwrap()
                }
            }
        };
        writer.put_many(early.clone()).await.unwrap();
        // Another saver prunes behind the writer's back in both files.
        let removed = SqliteSaver::open(&path)
            .await
            .unwrap()
            .prune(&thread, 20)
            .await
            .unwrap();
        assert_eq!(removed, 20);
        assert_eq!(prune(5).await, 15);
        writer.put_many(late.clone()).await.unwrap();
        assert_eq!(prune(5).await, 20);

        let reader = SqliteSaver::open(&path).await.unwrap();
        let listed = list_all(&reader, &thread).await;
        assert_eq!(listed.len(), 5);
        let mut tuples = Vec::new();
        for summary in &listed {
            tuples.push(
                reader
                    .get(&thread, Some(&summary.checkpoint.id))
                    .await
                    .unwrap()
                    .unwrap(),
            );
        }
        results.push((reader.stats().await.unwrap(), tuples));
    }
    let (fresh, writer) = (&results[0], &results[1]);
    assert_eq!(fresh.1, writer.1, "the kept checkpoints rebuild alike");
    let rows = |s: &keel_checkpoint_sqlite::SqliteStats| {
        (
            s.checkpoints,
            s.deltas,
            s.snapshots,
            s.pending_writes,
            s.delta_bytes,
        )
    };
    assert_eq!(rows(&fresh.0), rows(&writer.0), "the same rows are left");
    assert!(
        fresh.0.deltas < 60 && fresh.0.deltas > 5,
        "the prunes deleted deltas but kept the chains: {:?}",
        fresh.0
    );
    let head = &fresh.1[0];
    assert_eq!(fold(&head.channels["a"]), values["a"]);
    assert_eq!(fold(&head.channels["b"]), values["b"]);
}
