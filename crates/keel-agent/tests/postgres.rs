//! The compacting agent on PostgreSQL: a long run compacts and prunes, and a second
//! worker (another pool, another saver) continues the thread from where it stopped.
//!
//! Without `DATABASE_URL` it prints why it is skipped, except under `CI=true`, where it
//! fails. `cargo xtask test` starts a throwaway cluster and sets `DATABASE_URL`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use keel_agent::{Agent, AgentInput, Stop};
use keel_checkpoint::{Checkpointer, ListOptions, ThreadKey};
use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};
use keel_compaction::CompactionConfig;
use keel_message::{Message, ToolCall, ToolSpec, tool_fn};
use keel_model::{ChatResponse, PolicyModel};
use keel_offload::MemoryStore;
use keel_token::{Encoding, ModelProfile};
use serde_json::json;

async fn saver(url: &str, schema: &str) -> Arc<PostgresSaver> {
    let config = PostgresConfig::new(url).unwrap().schema(schema).unwrap();
    let saver = PostgresSaver::connect(&config).unwrap();
    saver.setup().await.unwrap();
    Arc::new(saver)
}

fn agent(saver: Arc<PostgresSaver>, store: Arc<MemoryStore>, max_steps: u64) -> Agent {
    let calls = AtomicU64::new(0);
    let model = PolicyModel::new("pg", move |_m, _t| {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        let reply = Message::assistant(format!("step {n}")).with_tool_calls(vec![ToolCall::new(
            format!("w{}-{n}", max_steps),
            "note",
            json!({"n": n}),
        )]);
        Ok(ChatResponse::new(reply, "pg"))
    });
    let note = tool_fn(
        ToolSpec::new("note", "Notes a number.", json!({"type": "object"})),
        |args, _ctx| async move {
            Ok(format!(
                "noted {} with order id ORD-{:06}",
                args["n"], args["n"]
            ))
        },
    );
    Agent::builder()
        .model(Arc::new(model))
        .profile(ModelProfile::new(
            "pg-model",
            32_000,
            2_000,
            Encoding::Approximate,
        ))
        .goal("Note numbers until told to stop.")
        .tool(Arc::new(note))
        .offload_store(store)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                .with_keep_recent_tokens(100)
                .with_max_steps(max_steps),
        )
        .checkpointer(saver)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_run_on_postgres_compacts_prunes_and_continues_on_another_worker() {
    let Some(url) = common::database_url("keel-agent postgres tests") else {
        return;
    };
    let schema = format!("keel_agent_test_{}", std::process::id());
    let store = Arc::new(MemoryStore::new());
    let first = saver(&url, &schema).await;
    let run = agent(first.clone(), store.clone(), 40)
        .run("pg-thread", AgentInput::new())
        .await
        .unwrap();
    assert_eq!(run.stop, Some(Stop::StepCeiling { steps: 40, max: 40 }));
    // Milestones at steps 10, 20 and 30; at 40 the ceiling comes first.
    assert_eq!(run.state.milestones_made, 3);
    let key = ThreadKey::new("pg-thread".to_owned());
    let stored = first.list(&key, ListOptions::default()).count().await;
    // Pruned to 5 at the last compaction (step 30); steps 31-40 added two supersteps
    // each, and the run's input one more.
    assert!(
        stored <= 5 + 2 * 10 + 2 && stored < run.supersteps,
        "{stored} checkpoints of {} supersteps",
        run.supersteps
    );

    // Another worker: its own pool and saver on the same database, a higher ceiling.
    let second = saver(&url, &schema).await;
    let run = agent(second.clone(), store, 45)
        .run("pg-thread", AgentInput::new())
        .await
        .unwrap();
    assert_eq!(run.stop, Some(Stop::StepCeiling { steps: 45, max: 45 }));
    assert_eq!(run.state.step, 45);
    // The steps after the first worker's ceiling are the second worker's own.
    let tail: Vec<String> = run
        .state
        .messages
        .iter()
        .filter_map(|m| m.tool_call_id.clone())
        .collect();
    assert_eq!(tail.last().map(String::as_str), Some("w45-4"), "{tail:?}");
    assert!(
        tail.iter().any(|id| id.starts_with("w40-")),
        "the first worker's recent steps are still raw: {tail:?}"
    );

    second.delete_thread("pg-thread").await.unwrap();
    assert!(second.get(&key, None).await.unwrap().is_none());
    let client = second.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}
