//! The full agent, durable on one SQLite file: no model server, no database server.
//!
//! `keel::agent::Agent` is the compacting agent graph (`agent` ⇄ `tools`, with
//! `compact` and `epoch` when a trigger fires) over a checkpointer. This program gives
//! it
//!
//! * a deterministic model ([`PolicyModel`]) that acts like a scripted coding agent: it
//!   lists, reads and greps this repository with the file tools, then answers;
//! * the file tools ([`FileTools`]) rooted at the repository, read-only, and one tool
//!   of its own (`line_counts`, whose large output is offloaded);
//! * a [`SqliteSaver`] file and an [`FsStore`] offload store (large tool results and the
//!   archive of compacted history), both in a temporary directory;
//! * a milestone every 10 steps and an epoch summary every 3 milestones.
//!
//! It prints the run's stream of [`AgentUpdate`]s (model calls, tool calls, offloads,
//! compactions) and the answer. Then it drops the agent, builds a new one over the same
//! files, as a new process would, and continues the same thread with a follow-up
//! question.
//!
//! ```sh
//! cargo run -p keel --example agent_sqlite
//! ```

use std::error::Error;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;
use keel::agent::{AgentInput, AgentUpdate};
use keel::offload::FsStore;
use keel::sqlite::SqliteSaver;

#[path = "tour/mod.rs"]
mod tour;
use tour::{Printer, build_agent, step_of};

const THREAD: &str = "repo-tour";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()?;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("agent.sqlite");
    let offload = dir.path().join("offload");
    println!(
        "model: a scripted policy (deterministic, no model server) standing in for an LLM\n\
         checkpoints: {}\noffload store: {}\n",
        db.display(),
        offload.display()
    );

    // ---- First process: a new thread, streamed. ----
    let agent = build_agent(
        &repo,
        Arc::new(SqliteSaver::open(&db).await?),
        Arc::new(FsStore::new(&offload)?),
    )?;
    {
        let mut updates = agent.stream(THREAD, AgentInput::new());
        let mut printer = Printer;
        while let Some(update) = updates.next().await {
            printer.print(&update?);
        }
    }
    // The stream ends with `Done`; the answer is in the thread's state.
    let state = agent
        .state(THREAD)
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

    // ---- Second process: the same files, a new saver and a new agent. ----
    let saver = Arc::new(SqliteSaver::open(&db).await?);
    let stats = saver.stats().await?;
    println!(
        "\nreopened the file: {} thread, {} checkpoints (old ones pruned after each compaction), {} KiB",
        stats.threads,
        stats.checkpoints,
        stats.database_bytes / 1024
    );
    let agent = build_agent(&repo, saver, Arc::new(FsStore::new(&offload)?))?;
    let before = agent.state(THREAD).await?.ok_or("the thread is gone")?;
    println!(
        "thread `{THREAD}` is at step {}, goal: {:?}",
        before.step,
        before.goal().map(|g| g.text().into_owned())
    );
    let question = "Follow-up: where is `DEFAULT_KEEP_CHECKPOINTS` defined?";
    println!("user: {question}");
    let run = agent.run(THREAD, AgentInput::new().user(question)).await?;
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
    Ok(())
}
