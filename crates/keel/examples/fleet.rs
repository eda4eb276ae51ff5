//! A fleet on one PostgreSQL: runs submitted to a queue, two workers taking them, and
//! the archive of what left each thread's context read back over another connection.
//!
//! Everything a thread has lives in the one database — its checkpoints
//! ([`PostgresSaver`]), its archive and offloaded results ([`PostgresStore`]), its runs
//! ([`Queue`]) — so any worker on any machine can continue any thread. Here the two
//! workers are in one process; run `keel worker` on other machines for a real fleet.
//!
//! Each thread is a deterministic [`PolicyModel`] that looks up 25 tickets with a
//! `lookup` tool, one per step, then answers. A milestone every 10 steps archives the
//! steps it replaces. The program submits four runs (and shows what a second run on a
//! busy thread gets), lets two workers drain the queue, prints each run's status, greps
//! one thread's archive from a fresh store, and drops its schema at the end.
//!
//! It needs a server: set `DATABASE_URL` (without it the program says how and exits).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run -p keel --features fleet --example fleet
//! ```

use std::error::Error;
use std::sync::Arc;

use keel::agent::{Agent, AgentBuilder};
use keel::compaction::CompactionConfig;
use keel::fleet::{FleetError, Policy, Queue, QueueOptions, RunInput, RunStatus, Worker};
use keel::message::{Message, Role, ToolCall, ToolSpec, tool_fn};
use keel::model::{ChatResponse, PolicyModel};
use keel::offload::{
    Archive, OffloadStore, Pattern, PostgresStore, PostgresStoreOptions, ThreadId,
};
use keel::postgres::{PostgresConfig, PostgresSaver};
use keel::token::{Encoding, ModelProfile};
use serde_json::json;

/// The schema of the example's tables (queue, checkpoints and archive together).
const SCHEMA: &str = "keel_example_fleet";
/// Tickets each thread looks up, one per agent step.
const TICKETS: u64 = 25;

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let Some(url) = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    else {
        println!(
            "This example needs a PostgreSQL server. Set DATABASE_URL and run it again, e.g.\n\n    \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\\n        \
             cargo run -p keel --features fleet --example fleet"
        );
        return Ok(());
    };

    // Each part creates or upgrades its own tables (idempotent; safe from many workers
    // at once).
    let queue = Queue::connect_with(&url, QueueOptions::new().schema(SCHEMA)?)?;
    queue.setup().await?;
    let saver = Arc::new(PostgresSaver::connect(
        &PostgresConfig::new(&url)?.schema(SCHEMA)?,
    )?);
    saver.setup().await?;
    // The archive and offloaded results, in the same database and schema.
    let store: Arc<dyn OffloadStore> = Arc::new(
        PostgresStore::connect_with_async(&url, PostgresStoreOptions::new().schema(SCHEMA)?)
            .await?,
    );

    // ---- Anyone, anywhere: submit runs. Each is stored when `submit` returns. ----
    let threads: Vec<String> = (0..4)
        .map(|i| format!("tickets-{}-{i}", std::process::id()))
        .collect();
    let mut runs = Vec::new();
    for thread in &threads {
        let goal = format!("Look up tickets TCK-00001 to TCK-{TICKETS:05} and report.");
        runs.push(queue.submit(thread, RunInput::new().goal(goal)).await?);
    }
    println!("submitted {} runs to schema `{SCHEMA}`", runs.len());
    // A second run on a thread that already has one: the default policy refuses it.
    let again = RunInput::new().message(Message::user("And ticket 26?"));
    match queue.submit(&threads[0], again.clone()).await {
        Err(e @ FleetError::ThreadBusy { .. }) => println!("a second run, Policy::Reject: {e}"),
        other => return Err(format!("expected ThreadBusy, got {other:?}").into()),
    }
    // Enqueued instead, it runs after the first on the same thread.
    runs.push(
        queue
            .submit_with(&threads[0], again, Policy::Enqueue)
            .await?,
    );
    println!("the same run with Policy::Enqueue: queued behind the first\n");

    // ---- Two workers drain the queue (in production: `keel worker` processes). ----
    let worker = |name: &str| {
        Worker::builder(queue.clone(), saver.clone())
            .agent(agent(store.clone()))
            .name(name)
            .concurrency(2)
            .build()
    };
    let (a, b) = (worker("worker-a")?, worker("worker-b")?);
    let (ra, rb) = tokio::join!(a.run_until_idle(), b.run_until_idle());
    for (name, report) in [("worker-a", ra?), ("worker-b", rb?)] {
        println!(
            "{name}: claimed {}, finished {}, {} supersteps",
            report.claimed, report.done, report.supersteps
        );
    }
    println!();
    for run in &runs {
        let info = queue.status(*run).await?;
        match &info.status {
            RunStatus::Done { result, .. } => println!(
                "run {} on {} (#{}): done in {} supersteps: {}",
                info.id,
                info.thread,
                info.seq,
                result.supersteps,
                result.answer.as_deref().unwrap_or("-")
            ),
            other => return Err(format!("run {run} did not finish: {other:?}").into()),
        }
    }

    // ---- Another machine: a fresh connection reads what left the context. ----
    let elsewhere =
        PostgresStore::connect_with_async(&url, PostgresStoreOptions::new().schema(SCHEMA)?)
            .await?;
    let thread = ThreadId::new(threads[0].as_str())?;
    let found = tokio::task::spawn_blocking(move || {
        let archive = Archive::new(Arc::new(elsewhere));
        let len = archive.len(&thread)?;
        let hits = archive.grep(&thread, &Pattern::literal("TCK-00003")?, 3)?;
        Ok::<_, keel::offload::OffloadError>((len, hits))
    })
    .await??;
    println!(
        "\n{} messages of {} are in the archive; grep TCK-00003 over a new connection:",
        found.0, threads[0]
    );
    for hit in &found.1.messages {
        println!(
            "  #{} {:?}: {}",
            hit.seq,
            hit.message.role,
            hit.message.text()
        );
    }

    // Leave the database as we found it.
    let client = queue.pool().get().await?;
    client
        .batch_execute(&format!("DROP SCHEMA \"{SCHEMA}\" CASCADE"))
        .await?;
    println!("\ndropped schema `{SCHEMA}`");
    Ok(())
}

/// The agent every worker runs: the worker adds the checkpointer and durability; the
/// offload store is the one in the database, shared by all workers.
fn agent(store: Arc<dyn OffloadStore>) -> AgentBuilder {
    let model = PolicyModel::new("ticket-bot", |messages: &[Message], _tools| {
        // The next ticket: one past the last looked up (the last tool result says which).
        let next = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Tool)
            .and_then(|m| {
                let text = m.text();
                let digits = text.strip_prefix("ticket TCK-")?.get(..5)?;
                digits.parse::<u64>().ok()
            })
            .map_or(1, |n| n + 1);
        let asked_more = messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .is_some_and(|m| m.text().contains("26"));
        let last = if asked_more { TICKETS + 1 } else { TICKETS };
        let reply = if next > last {
            Message::assistant(format!("Done: looked up {last} tickets; all are open."))
        } else {
            Message::assistant(format!("Looking up TCK-{next:05}.")).with_tool_calls(vec![
                ToolCall::new(format!("call-{next}"), "lookup", json!({"ticket": next})),
            ])
        };
        Ok(ChatResponse::new(reply, "ticket-bot"))
    });
    let lookup = tool_fn(
        ToolSpec::new(
            "lookup",
            "Looks up a ticket by number.",
            json!({"type": "object", "properties": {"ticket": {"type": "integer"}}}),
        ),
        |args, _ctx| async move {
            let n = args["ticket"].as_u64().unwrap_or_default();
            Ok(format!("ticket TCK-{n:05}: open, owner ana@example.com"))
        },
    );
    Agent::builder()
        .model(Arc::new(model))
        // A model keel has no profile for: say its window (else 8,192 is assumed).
        .profile(ModelProfile::new(
            "ticket-bot",
            32_000,
            2_000,
            Encoding::Approximate,
        ))
        .tool(Arc::new(lookup))
        .offload_store(store)
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                .with_keep_recent_tokens(100),
        )
}
