//! The full agent on PostgreSQL: the checkpointer many workers share.
//!
//! The same agent as `agent_sqlite` (a deterministic [`PolicyModel`] touring this
//! repository with the file tools, a milestone every 10 steps, an epoch summary every 3
//! milestones), checkpointed in PostgreSQL by a [`PostgresSaver`]. It prints the
//! streamed [`AgentUpdate`]s and the answer, then drops the agent and its connection
//! pool, connects again with a new saver and a new agent, as another worker would, and
//! continues the same thread with a follow-up question.
//!
//! It needs a server: set `DATABASE_URL` (without it the program says how and exits).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run -p keel --example agent_postgres --features postgres
//! ```
//!
//! keel's tables go to their own schema, `keel_example`, created if missing: the
//! checkpoints and, through a [`PostgresStore`] in the same schema, the offload store
//! (large tool results and the archive of compacted history). So the second worker,
//! with its own connections, reads what the first archived, as a worker on another
//! machine would. At the end it deletes the thread's checkpoints and archive.

use std::error::Error;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;
use keel::agent::{AgentInput, AgentUpdate};
use keel::checkpoint::Checkpointer;
use keel::offload::{OffloadStore, PostgresStore, PostgresStoreOptions, ThreadId};
use keel::postgres::{PostgresConfig, PostgresSaver};

#[path = "tour/mod.rs"]
mod tour;
use tour::{Printer, build_agent, step_of};

/// The schema of keel's tables in this example.
const SCHEMA: &str = "keel_example";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let Some(url) = std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
    else {
        println!(
            "This example needs a PostgreSQL server. Set DATABASE_URL and run it again, e.g.\n\n    \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \\\n        \
             cargo run -p keel --example agent_postgres --features postgres"
        );
        return Ok(());
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()?;
    // The database outlives this program: a fresh thread id for each run.
    let thread = format!("repo-tour-{}", std::process::id());
    let config = PostgresConfig::new(&url)?.schema(SCHEMA)?;

    // ---- First worker: a new thread, streamed. ----
    let saver = Arc::new(PostgresSaver::connect(&config)?);
    // Creates or upgrades keel's tables (idempotent; safe from many workers at once).
    let applied = saver.setup().await?;
    println!(
        "connected to {} (schema `{SCHEMA}`, migrations applied now: {applied:?}); \
         the offload store is in the same schema\n",
        redact(&url),
    );
    let store =
        PostgresStore::connect_with_async(&url, PostgresStoreOptions::new().schema(SCHEMA)?)
            .await?;
    let agent = build_agent(&repo, saver, Arc::new(store))?;
    {
        let mut updates = agent.stream(&thread, AgentInput::new());
        let mut printer = Printer;
        while let Some(update) = updates.next().await {
            printer.print(&update?);
        }
    }
    // The stream ends with `Done`; the answer is in the thread's state.
    let state = agent
        .state(&thread)
        .await?
        .ok_or("the thread has no state")?;
    println!(
        "\nanswer after {} model calls ({} milestones and {} epoch made; {} messages left in the raw buffer):\n{}",
        state.step,
        state.milestones_made,
        state.epochs_made,
        state.messages.len(),
        state.answer().unwrap_or_default()
    );
    drop(agent);

    // ---- Second worker: a new pool, saver and agent over the same database. ----
    let saver = Arc::new(PostgresSaver::connect(&config)?);
    saver.setup().await?;
    let storage = saver.thread_storage(&thread).await?;
    println!(
        "\nreconnected: thread `{thread}` has {} checkpoints (old ones pruned after each compaction) and {} deltas, {} KiB",
        storage.checkpoints,
        storage.deltas,
        storage.total_bytes() / 1024
    );
    let store: Arc<dyn OffloadStore> = Arc::new(
        PostgresStore::connect_with_async(&url, PostgresStoreOptions::new().schema(SCHEMA)?)
            .await?,
    );
    let archived = {
        let (store, id) = (store.clone(), ThreadId::new(thread.as_str())?);
        tokio::task::spawn_blocking(move || keel::offload::Archive::new(store).len(&id)).await??
    };
    println!("{archived} messages of the thread are in the archive, read over the new connection");
    let agent = build_agent(&repo, saver.clone(), store.clone())?;
    let before = agent.state(&thread).await?.ok_or("the thread is gone")?;
    println!(
        "thread `{thread}` is at step {}, goal: {:?}",
        before.step,
        before.goal().map(|g| g.text().into_owned())
    );
    let question = "Follow-up: where is `DEFAULT_KEEP_CHECKPOINTS` defined?";
    println!("user: {question}");
    let run = agent.run(&thread, AgentInput::new().user(question)).await?;
    // `run` does not stream; the state keeps the latest events.
    let mut printer = Printer;
    for event in run.state.events.iter().filter(|e| step_of(e) > before.step) {
        printer.print(&AgentUpdate::Event(event.clone()));
    }
    println!(
        "answer (step {}, {} supersteps this run): {}",
        run.state.step,
        run.supersteps,
        run.answer.as_deref().unwrap_or("-")
    );

    // Leave the database as we found it.
    saver.delete_thread(&thread).await?;
    let id = ThreadId::new(thread.as_str())?;
    let files = tokio::task::spawn_blocking(move || store.delete_thread(&id)).await??;
    println!("deleted thread `{thread}`: its checkpoints and {files} files of its archive");
    Ok(())
}

/// The connection string without its password, for printing.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}
