//! Forks and the offload store: a run forked from an older checkpoint reads the archive
//! and the offloaded results as they were at the fork point plus its own, never what
//! the other branch stored after it (through the retrieval tools, as the model does);
//! pruning removes what only pruned branches saw; `delete_thread` and the TTL sweep
//! remove everything of the thread. Stored files are counted after each, on memory,
//! SQLite and PostgreSQL (rows of both offload tables counted with SQL there).
//!
//! Without `DATABASE_URL` the PostgreSQL test prints why it is skipped, except under
//! `CI=true`, where it fails. `cargo xtask test` starts a throwaway cluster and sets it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use keel_agent::{Agent, AgentInput, AgentState, AgentStateUpdate, COMPACT};
use keel_checkpoint::{CheckpointId, Checkpointer, ListOptions, MemorySaver, ThreadKey};
use keel_checkpoint_postgres::PostgresSaver;
use keel_checkpoint_sqlite::SqliteSaver;
use keel_compaction::CompactionConfig;
use keel_graph::reducer::AddMessagesUpdate;
use keel_graph::{Durability, RunConfig};
use keel_message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::{
    EvictLargeResults, Key, Lineage, MemoryStore, OffloadStore, PostgresStore,
    PostgresStoreOptions, RetrievalTools, SqliteStore, ThreadId,
};
use keel_token::{Encoding, ModelProfile};
use serde_json::json;

/// A user message that starts a search on a fork: `search: A B` greps the archive for
/// `A`, then for `B`, then answers with both results.
const SEARCH: &str = "search: ";
/// A user message that names the branch: later echoes carry its tag.
const BRANCH: &str = "branch: ";

/// Echoes on branch A go to 12, on any other branch to 24.
fn last_echo(tag: &str) -> u64 {
    if tag == "A" { 12 } else { 24 }
}

/// A model that echoes one number a step, tagged with the branch the newest `branch:`
/// message names (`A` without one), then answers; given a `search:` message it greps
/// the archive for each word and answers with what the greps said.
fn model() -> PolicyModel {
    PolicyModel::new("fork", move |messages, _tools| {
        let newest = |prefix: &str| {
            messages
                .iter()
                .rposition(|m| m.role == Role::User && m.text().starts_with(prefix))
        };
        if let Some(at) = newest(SEARCH) {
            let words: Vec<String> = messages[at].text()[SEARCH.len()..]
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            let results: Vec<String> = messages[at + 1..]
                .iter()
                .filter(|m| m.role == Role::Tool)
                .map(|m| m.text().into_owned())
                .collect();
            let reply = match words.get(results.len()) {
                Some(word) => {
                    Message::assistant("Searching.").with_tool_calls(vec![ToolCall::new(
                        format!("search-{}", results.len()),
                        "grep",
                        json!({"pattern": word, "path": "archive"}),
                    )])
                }
                None => Message::assistant(results.join("\n---\n")),
            };
            return Ok(ChatResponse::new(reply, "fork"));
        }
        // The raw buffer is compacted, so go on from the newest echo call in view: its
        // number, and its tag unless a newer `branch:` message names another.
        let newest_echo = messages.iter().enumerate().rev().find_map(|(at, m)| {
            let args = m
                .tool_calls
                .iter()
                .find(|c| c.name == "echo")?
                .arguments
                .as_json()?;
            Some((
                at,
                args.get("i")?.as_u64()?,
                args.get("tag")?.as_str()?.to_owned(),
            ))
        });
        let next = newest_echo.as_ref().map_or(0, |(_, i, _)| i + 1);
        let tag = match (newest(BRANCH), &newest_echo) {
            (Some(b), Some((e, _, _))) if b < *e => newest_echo.as_ref().map(|(_, _, t)| t.clone()),
            (Some(b), _) => Some(messages[b].text()[BRANCH.len()..].trim().to_owned()),
            (None, _) => newest_echo.as_ref().map(|(_, _, t)| t.clone()),
        }
        .unwrap_or_else(|| "A".to_owned());
        let reply = if next < last_echo(&tag) {
            Message::assistant(format!("Echo {next}.")).with_tool_calls(vec![ToolCall::new(
                format!("echo-{next}"),
                "echo",
                json!({"i": next, "tag": tag}),
            )])
        } else {
            Message::assistant("Done echoing.")
        };
        Ok(ChatResponse::new(reply, "fork"))
    })
}

/// The echo tool: a marker per number and branch; every fourth is a large result
/// (offloaded under the call id, which both branches use).
fn echo() -> Arc<dyn keel_message::Tool> {
    Arc::new(tool_fn(
        ToolSpec::new("echo", "Echoes a number.", json!({"type": "object"})),
        |args, _ctx| async move {
            let i = args["i"].as_u64().unwrap_or(0);
            let tag = args["tag"].as_str().unwrap_or("A");
            let line = format!("echoed marker REQ-{i:05} tag {tag}");
            Ok(if i % 4 == 3 {
                format!("{line}\n").repeat(200)
            } else {
                line
            })
        },
    ))
}

fn agent(store: Arc<dyn OffloadStore>, checkpointer: Arc<dyn Checkpointer>, keep: usize) -> Agent {
    agent_with(store, checkpointer, keep, Durability::Sync)
}

fn agent_with(
    store: Arc<dyn OffloadStore>,
    checkpointer: Arc<dyn Checkpointer>,
    keep: usize,
    durability: Durability,
) -> Agent {
    Agent::builder()
        .durability(durability)
        .model(Arc::new(model()))
        .profile(ModelProfile::new(
            "fork-model",
            32_000,
            2_000,
            Encoding::Approximate,
        ))
        .goal("Echo the numbers.")
        .tool(echo())
        .offload_store(store)
        .evict(Some(EvictLargeResults::new().with_threshold(500)))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(3))
                .with_keep_recent_tokens(40),
        )
        .keep_checkpoints(Some(keep))
        .checkpointer(checkpointer)
        .build()
        .unwrap()
}

async fn state_at(agent: &Agent, thread: &str, at: &CheckpointId) -> AgentState {
    agent
        .graph()
        .get_state(&RunConfig::thread(thread).at(at.clone()))
        .await
        .unwrap()
        .unwrap()
        .values
}

/// The checkpoint the compaction before the last one wrote.
async fn before_last_compaction(agent: &Agent, thread: &str) -> CheckpointId {
    let last = agent
        .last_checkpoint_by(thread, COMPACT, None)
        .await
        .unwrap();
    agent
        .last_checkpoint_by(thread, COMPACT, last)
        .await
        .unwrap()
        .unwrap()
}

/// Forks `thread` at `at` with a user message (time travel: `update_state` at an old
/// checkpoint), then runs the fork to its answer.
async fn run_fork(agent: &Agent, thread: &str, at: CheckpointId, text: String) -> AgentState {
    agent
        .graph()
        .update_state(
            &RunConfig::thread(thread).at(at),
            AgentStateUpdate::default()
                .messages(AddMessagesUpdate::append(vec![Message::user(text)])),
            None,
        )
        .await
        .unwrap();
    agent.run(thread, AgentInput::new()).await.unwrap().state
}

/// What the retrieval tools answer on `lineage`'s branch of `thread`.
fn grep(store: &Arc<dyn OffloadStore>, thread: &str, lineage: &Lineage, pattern: &str) -> String {
    RetrievalTools::new(store.clone(), ThreadId::new(thread).unwrap())
        .with_lineage(lineage.clone())
        .execute(&ToolCall::new("g", "grep", json!({"pattern": pattern})))
        .unwrap()
}

/// The stored files of a thread.
fn stored(store: &dyn OffloadStore, thread: &str) -> Vec<String> {
    store
        .list(&ThreadId::new(thread).unwrap(), None)
        .unwrap()
        .into_iter()
        .map(|e| e.path.to_string())
        .collect()
}

async fn checkpoints(cp: &dyn Checkpointer, thread: &str) -> Vec<CheckpointId> {
    cp.list(&ThreadKey::new(thread.to_owned()), ListOptions::default())
        .map(|s| s.unwrap().checkpoint.id)
        .collect()
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_does_not_see_what_the_other_branch_archived_after_the_fork_point() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    let saver = Arc::new(MemorySaver::new());
    let agent = agent(store.clone(), saver.clone(), 1_000);
    let run = agent.run("t", AgentInput::new()).await.unwrap();
    assert_eq!(run.answer.as_deref(), Some("Done echoing."));
    assert!(
        run.state.milestones_made >= 3,
        "{}",
        run.state.milestones_made
    );

    let fork_point = before_last_compaction(&agent, "t").await;
    let step = state_at(&agent, "t", &fork_point).await.step;
    // REQ-00000 was archived long before the fork point; the newest echo was made after
    // it, on the other branch, and archived there by the last compaction.
    let archive = store
        .get(&Key::new("t", "archive/messages.jsonl").unwrap())
        .unwrap();
    let after = (step..12)
        .rev()
        .map(|i| format!("REQ-{i:05}"))
        .find(|m| archive.contains(m.as_str()))
        .expect("the last compaction archived an echo made after the fork point");
    assert!(archive.contains("REQ-00000"));

    // The fork through `run_from` (the other tests fork with `update_state`).
    let fork = agent
        .run_from(
            "t",
            &fork_point,
            AgentInput::new().message(Message::user(format!("{SEARCH}REQ-00000 {after}"))),
        )
        .await
        .unwrap()
        .state;
    let answer = fork.answer().unwrap();
    let (before_fork, after_fork) = answer.split_once("\n---\n").unwrap();
    assert!(
        before_fork.contains("archive/messages.jsonl:") && before_fork.contains("REQ-00000"),
        "the fork sees what was archived before the fork point: {before_fork}"
    );
    assert!(
        after_fork.starts_with("No lines match"),
        "the fork must not see {after}, archived by the other branch after the fork point: {after_fork}"
    );
    // The fork's checkpoints descend from the fork point.
    let history: Vec<_> = agent
        .graph()
        .state_history(&RunConfig::thread("t"), ListOptions::default())
        .map(Result::unwrap)
        .collect()
        .await;
    let mut parent = history.first().unwrap().parent_id.clone();
    loop {
        let p = parent.expect("the newest checkpoint descends from the fork point");
        if p == fork_point {
            break;
        }
        parent = history
            .iter()
            .find(|h| h.checkpoint_id == p)
            .and_then(|h| h.parent_id.clone());
    }

    // A checkpoint the thread does not have, and an agent without checkpoints, fail
    // before anything is written.
    let head = || async { checkpoints(&*saver, "t").await };
    let before = head().await;
    let unknown = CheckpointId::new();
    let err = agent
        .run_from("t", &unknown, AgentInput::new().message(Message::user("x")))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            keel_agent::AgentError::Graph(keel_graph::GraphError::CheckpointNotFound { .. })
        ),
        "{err:?}"
    );
    assert_eq!(head().await, before, "nothing was written");
    let plain = Agent::builder()
        .model(Arc::new(model()))
        .goal("Echo the numbers.")
        .build()
        .unwrap();
    let err = plain
        .run_from("t", &fork_point, AgentInput::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, keel_agent::AgentError::NoCheckpointer { thread_id } if thread_id == "t"),
        "{err:?}"
    );
}

/// Counts of a thread's rows, for the database backends (`None`: not a database).
type Rows<'a> =
    &'a (dyn Fn(&str) -> futures::future::BoxFuture<'static, Option<(i64, i64)>> + Sync);

/// Branch A runs, a fork B from an older checkpoint runs past every A checkpoint the
/// prune keeps, then the thread is deleted; another thread is swept. Checks what the
/// branches read and what stays stored after each.
async fn fork_prune_delete_sweep(
    store: Arc<dyn OffloadStore>,
    cp: Arc<dyn Checkpointer>,
    rows: Rows<'_>,
    durability: Durability,
) {
    // Branch A keeps every checkpoint; the fork point is before its second-to-last
    // compaction, so A archived messages made after it.
    let keep_all = agent_with(store.clone(), cp.clone(), 1_000, durability);
    let a = keep_all
        .run("forked", AgentInput::new())
        .await
        .unwrap()
        .state;
    assert_eq!(a.answer().as_deref(), Some("Done echoing."));
    let fork_point = before_last_compaction(&keep_all, "forked").await;
    let at = state_at(&keep_all, "forked", &fork_point).await;
    let raw_archive = || {
        store
            .get(&Key::new("forked", "archive/messages.jsonl").unwrap())
            .unwrap()
    };
    let a_after: Vec<String> = (at.step..12)
        .map(|i| format!("REQ-{i:05} tag A"))
        .filter(|m| raw_archive().contains(m.as_str()))
        .collect();
    assert!(
        !a_after.is_empty(),
        "branch A archived after the fork point"
    );

    // An agent that prunes to the last 3 checkpoints after each compaction.
    let agent = agent_with(store.clone(), cp.clone(), 3, durability);
    // Fork B: the same call ids, other content; it compacts and prunes A away.
    let b = run_fork(&agent, "forked", fork_point, format!("{BRANCH}B")).await;
    assert_eq!(b.answer().as_deref(), Some("Done echoing."));
    assert_eq!(
        b.lineage.forks().count(),
        1,
        "B writes apart: {:?}",
        b.lineage
    );
    // Only B's checkpoints after its first compaction are left.
    let b_checkpoints = checkpoints(cp.as_ref(), "forked").await;
    // With `Sync`, 5 (3 kept and 2 written after the last prune). With `Async` a
    // background prune can reach the saver before the writes of the steps since the
    // previous compaction step (3 agent steps, at most 3 checkpoints each) do; those
    // stay until the next compaction step: 5 to 12 were seen. A full run stores 30.
    let most = match durability {
        Durability::Async => 5 + 9,
        _ => 5,
    };
    assert!(
        b_checkpoints.len() <= most,
        "{} checkpoints",
        b_checkpoints.len()
    );
    for id in &b_checkpoints {
        let st = state_at(&agent, "forked", id).await;
        assert_eq!(
            st.lineage.forks().count(),
            1,
            "step {} of {}: {:?} (B: {:?})",
            st.step,
            b.step,
            st.lineage,
            b.lineage
        );
    }
    // B reads what A archived before the fork point, its own, and nothing of A's after.
    assert!(grep(&store, "forked", &b.lineage, "REQ-00000 tag A").contains("archive/"));
    assert!(grep(&store, "forked", &b.lineage, "REQ-00020 tag B").contains("archive/"));
    for m in &a_after {
        let found = grep(&store, "forked", &b.lineage, m);
        assert!(found.starts_with("No lines match"), "{m}: {found}");
    }
    // Its large results are its own, A's under the same call ids are gone or unseen.
    let big = grep(&store, "forked", &b.lineage, "REQ-00023 tag B$");
    assert!(big.contains("large_tool_results/echo-23:"), "{big}");
    // Nothing is stored that B does not see: A's records after the fork point were cut
    // off the shared archive, A's results and records deleted.
    let thread = ThreadId::new("forked").unwrap();
    assert!(b.lineage.sees_all(&*store, &thread).unwrap());
    for m in &a_after {
        assert!(!raw_archive().contains(m.as_str()), "{m} is still stored");
    }
    let files = stored(&*store, "forked");
    let expected_results = (0..24).filter(|i| i % 4 == 3).count();
    let fork = b.lineage.forks().next().unwrap().to_owned();
    let own = format!(".keel/forks/{fork}/");
    assert!(
        files.iter().all(|f| {
            let f = f.strip_prefix(&own).map_or(f.as_str(), |rest| {
                rest.strip_prefix("data/").unwrap_or(rest)
            });
            ["archive/messages.jsonl", ".keel/files.jsonl", "files.jsonl"].contains(&f)
                || f.starts_with("large_tool_results/echo-")
        }),
        "{files:?}"
    );
    let results = files
        .iter()
        .filter(|f| f.contains("large_tool_results/"))
        .count();
    assert!(
        results <= expected_results,
        "{results} results stored: {files:?}"
    );
    if let Some((file_rows, orphan_chunks)) = rows("forked").await {
        assert_eq!(file_rows, files.len() as i64);
        assert_eq!(orphan_chunks, 0);
    }

    // Pruning to the newest checkpoint keeps what it sees.
    agent.prune("forked", 1).await.unwrap();
    assert_eq!(checkpoints(cp.as_ref(), "forked").await.len(), 1);
    let newest = agent.state("forked").await.unwrap().unwrap();
    assert!(newest.lineage.sees_all(&*store, &thread).unwrap());
    assert!(grep(&store, "forked", &newest.lineage, "REQ-00000 tag A").contains("archive/"));

    // delete_thread: no checkpoint, no file, no row.
    agent.delete_thread("forked").await.unwrap();
    assert!(checkpoints(cp.as_ref(), "forked").await.is_empty());
    assert!(stored(&*store, "forked").is_empty());
    if let Some(counts) = rows("forked").await {
        assert_eq!(counts, (0, 0));
    }

    // The TTL sweep takes a forked thread whole too.
    let agent = self::agent_with(store.clone(), cp.clone(), 1_000, durability);
    agent.run("swept", AgentInput::new()).await.unwrap();
    let first = checkpoints(cp.as_ref(), "swept").await;
    run_fork(
        &agent,
        "swept",
        first[first.len() / 2].clone(),
        format!("{BRANCH}C"),
    )
    .await;
    assert!(
        stored(&*store, "swept")
            .iter()
            .any(|f| f.starts_with(".keel/forks/"))
    );
    // Idle means a head older than the sweep's millisecond.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let swept = agent.sweep_idle(Duration::ZERO, 100).await.unwrap();
    assert!(swept.iter().any(|t| t == "swept"), "{swept:?}");
    assert!(checkpoints(cp.as_ref(), "swept").await.is_empty());
    assert!(stored(&*store, "swept").is_empty());
    if let Some(counts) = rows("swept").await {
        assert_eq!(counts, (0, 0));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pruning_keeps_what_the_surviving_branch_sees_and_deleting_leaves_nothing_in_memory() {
    let store: Arc<dyn OffloadStore> = Arc::new(MemoryStore::new());
    fork_prune_delete_sweep(
        store,
        Arc::new(MemorySaver::new()),
        &|_| Box::pin(async { None }),
        Durability::Sync,
    )
    .await;
}

/// [`fork_prune_delete_sweep`] on one SQLite file holding the checkpoints and the store.
async fn fork_prune_delete_sweep_on_sqlite(durability: Durability) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.db");
    // The checkpointer first: it refuses a file with tables but no checkpoint schema.
    let saver = Arc::new(SqliteSaver::open(&file).await.unwrap());
    let store: Arc<dyn OffloadStore> = Arc::new(SqliteStore::open(&file).unwrap());
    // One row per stored file: the store's listing is its rows (chunks go with them, as
    // keel-offload's `delete_thread_leaves_no_rows` counts with SQL).
    fork_prune_delete_sweep(store, saver, &|_| Box::pin(async { None }), durability).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pruning_keeps_what_the_surviving_branch_sees_and_deleting_leaves_nothing_on_sqlite() {
    fork_prune_delete_sweep_on_sqlite(Durability::Sync).await;
}

/// The same with asynchronous durability: each compaction step's prune goes on in the
/// background, and what only pruned checkpoints saw is removed at the thread's next
/// compaction step or as the run ends.
#[tokio::test(flavor = "multi_thread")]
async fn pruning_in_the_background_keeps_what_the_surviving_branch_sees_on_sqlite() {
    fork_prune_delete_sweep_on_sqlite(Durability::Async).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pruning_keeps_what_the_surviving_branch_sees_and_deleting_leaves_nothing_on_postgres() {
    let Some(url) = common::database_url("keel-agent fork tests on postgres") else {
        return;
    };
    let schema = format!(
        "keel_agent_fork_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let store = PostgresStore::connect_with(
        &url,
        PostgresStoreOptions::new().schema(schema.clone()).unwrap(),
    )
    .unwrap();
    let saver = Arc::new(PostgresSaver::from_pool(store.pool().clone(), &schema).unwrap());
    saver.setup().await.unwrap();
    let pool = store.pool().clone();
    let (files, chunks) = (
        format!("{schema}.keel_offload_files"),
        format!("{schema}.keel_offload_chunks"),
    );
    let rows = move |thread: &str| -> futures::future::BoxFuture<'static, Option<(i64, i64)>> {
        let (pool, thread) = (pool.clone(), thread.to_owned());
        let (files, chunks) = (files.clone(), chunks.clone());
        Box::pin(async move {
            let client = pool.get().await.unwrap();
            let count = |sql: String| {
                let (client, thread) = (&client, thread.clone());
                async move {
                    client
                        .query_one(sql.as_str(), &[&thread])
                        .await
                        .unwrap()
                        .get::<_, i64>(0)
                }
            };
            let file_rows =
                count(format!("SELECT count(*) FROM {files} WHERE thread_id = $1")).await;
            // Chunks no file row holds: what a leak would leave.
            let orphans = count(format!(
                "SELECT count(*) FROM {chunks} c WHERE c.thread_id = $1 AND NOT EXISTS
                 (SELECT 1 FROM {files} f WHERE f.thread_id = c.thread_id AND f.generation = c.generation)"
            ))
            .await;
            let all_chunks = count(format!(
                "SELECT count(*) FROM {chunks} WHERE thread_id = $1"
            ))
            .await;
            Some((file_rows, if file_rows == 0 { all_chunks } else { orphans }))
        })
    };
    fork_prune_delete_sweep(
        Arc::new(store.clone()),
        saver.clone(),
        &rows,
        Durability::Sync,
    )
    .await;
    let client = saver.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}

/// Needs the file store (feature `fs`).
#[cfg(feature = "fs")]
#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_fails_during_cleanup_is_a_typed_error_naming_the_thread() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let store: Arc<dyn OffloadStore> = Arc::new(keel_offload::FsStore::new(&root).unwrap());
    let saver = Arc::new(MemorySaver::new());
    let agent = agent(store, saver.clone(), 3);
    agent.run("t", AgentInput::new()).await.unwrap();
    // The store's directory becomes a file: every call on it fails.
    std::fs::remove_dir_all(&root).unwrap();
    std::fs::write(&root, "not a directory").unwrap();
    let err = agent.prune("t", 1).await.unwrap_err();
    assert!(
        matches!(
            &err,
            keel_agent::AgentError::Offload { thread_id, source: keel_agent::CleanupError::Store(_) }
                if thread_id == "t"
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("thread `t`"), "{err}");
    assert!(
        std::error::Error::source(&err).is_some(),
        "the store's error is the source"
    );
    let err = agent.delete_thread("t").await.unwrap_err();
    assert!(
        matches!(
            &err,
            keel_agent::AgentError::Offload {
                source: keel_agent::CleanupError::Store(_),
                ..
            }
        ),
        "{err:?}"
    );
}
