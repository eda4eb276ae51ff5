//! `keel threads`: admin of stored threads, on the embedded file or Postgres.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use futures::StreamExt;
use keel::agent::{Agent, AgentState};
use keel::checkpoint::{Checkpointer, ListOptions, ThreadKey};
use keel::graph::StateSnapshot;
use keel::message::Message;
use keel::model::{ModelError, PolicyModel};
use keel::offload::{OffloadStore, ThreadId};
use keel::token::ModelProfiles;
use serde_json::json;

use crate::config::Settings;
use crate::store;
use crate::ui::{table, thousands};

/// `keel threads`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel threads list                          threads in ./.keel/keel.sqlite
  keel threads show demo-0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10          the goal, epoch, milestones and raw tail, with tokens
  keel threads history demo-0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10 --limit 5
  keel threads prune demo-0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10 --keep 3
  keel threads delete demo-0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10        checkpoints and archived history
  keel threads gc --older-than 7d --dry-run  list the threads idle for a week, delete nothing
  keel threads gc --older-than 7d            delete threads idle for a week
  DATABASE_URL=postgres://postgres@127.0.0.1/test keel threads list")]
pub struct ThreadsArgs {
    /// The home directory of the embedded SQLite file and offload store (given, it wins
    /// over DATABASE_URL and `database_url` in keel.toml).
    #[arg(long, global = true)]
    home: Option<PathBuf>,
    /// A Postgres URL (else `DATABASE_URL`, else `database_url` in keel.toml, else the
    /// embedded file). TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long, global = true)]
    database_url: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: ThreadsCommand,
}

#[derive(Debug, Subcommand)]
enum ThreadsCommand {
    /// List threads, in id order, each with where it stands: answered, stopped (a
    /// resumable stop, and why), failed in NODE (its last run stopped on an error,
    /// which `show` gives) or unfinished (a run is going, or the last one was cut off).
    List {
        /// Threads shown at most.
        #[arg(long, default_value_t = 100, value_parser = crate::ui::at_least_one::<usize>)]
        limit: usize,
        /// Start after this thread id (paging).
        #[arg(long)]
        after: Option<String>,
    },
    /// The thread's context as the model would see it, with token counts per layer.
    Show {
        /// The thread id.
        thread: String,
        /// Print every raw message in full (default: the last 10, cut to 300 characters).
        #[arg(long)]
        full: bool,
    },
    /// The thread's checkpoints, newest first.
    History {
        /// The thread id.
        thread: String,
        /// Checkpoints shown at most.
        #[arg(long, default_value_t = 20, value_parser = crate::ui::at_least_one::<usize>)]
        limit: usize,
    },
    /// Keep the newest N checkpoints of a thread; delete the rest.
    Prune {
        /// The thread id.
        thread: String,
        /// Checkpoints kept (at least 1; `keel threads delete` removes a whole thread).
        #[arg(long, value_parser = parse_keep)]
        keep: u64,
    },
    /// Delete a thread: its checkpoints and its archived history.
    Delete {
        /// The thread id.
        thread: String,
    },
    /// Delete every thread idle for longer than a duration (`--dry-run` first to see which).
    ///
    /// On a fleet's database, a thread with a run queued or running is kept, however
    /// old its last checkpoint: `keel cancel` the run first to delete it.
    Gc {
        /// `90s`, `30m`, `12h`, `7d` or `2w`.
        #[arg(long, value_parser = parse_duration)]
        older_than: Duration,
        /// List the threads that would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Runs `keel threads`.
pub async fn run(args: ThreadsArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let home = settings.home(args.home.as_deref());
    let url = settings.store_url(args.database_url.as_deref(), args.home.as_deref());
    // A look at the threads creates no tables; the commands that delete open the
    // stores as every other command does (in Postgres, creating or upgrading their
    // tables), and they alone need the offload store.
    let writes = matches!(
        args.command,
        ThreadsCommand::Prune { .. }
            | ThreadsCommand::Delete { .. }
            | ThreadsCommand::Gc { dry_run: false, .. }
    );
    let (storage, offload) = if writes {
        (
            store::open(&home, url.as_deref(), false).await?,
            store::offload_for(&home, url.as_deref(), false)?,
        )
    } else {
        match store::open_to_read(&home, url.as_deref()).await {
            Ok(storage) => (storage, None),
            // No checkpoint stored there yet: the fleet's queue may still hold runs
            // (`keel submit` creates only its own tables), else a list of no threads,
            // not a failure.
            Err(e)
                if matches!(
                    args.command,
                    ThreadsCommand::List { .. }
                        | ThreadsCommand::Show { .. }
                        | ThreadsCommand::Gc { .. }
                ) =>
            {
                let Some(none) = e.downcast_ref::<store::NoTables>() else {
                    return Err(e);
                };
                let queue = match url.as_deref() {
                    Some(url) => crate::fleet::queue_if_set_up(url).await,
                    None => None,
                };
                match (args.command, queue) {
                    (ThreadsCommand::List { limit, after }, Some(q)) => {
                        list(None, Some(&q), limit, after, args.json).await?;
                    }
                    (ThreadsCommand::Show { thread, .. }, Some(q))
                        if queue_only_show(&q, &thread, args.json).await? => {}
                    (ThreadsCommand::Show { thread, .. }, _) => {
                        bail!("no thread `{thread}` ({none})")
                    }
                    // A dry run: nothing to delete, and nothing created to say so.
                    (ThreadsCommand::Gc { .. }, _) => report(
                        args.json,
                        json!({"dry_run": true, "would_delete": [], "kept_in_flight": []}),
                        || format!("no threads ({none}): nothing would be deleted"),
                    ),
                    _ if args.json => crate::outln!("[]"),
                    _ => crate::outln!("no threads ({none})"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            Err(e) => return Err(e),
        }
    };
    let saver = storage.saver.clone();
    let queue = match url.as_deref() {
        Some(url) => crate::fleet::queue_if_set_up(url).await,
        None => None,
    };
    match args.command {
        ThreadsCommand::List { limit, after } => {
            list(Some(&saver), queue.as_ref(), limit, after, args.json).await?;
        }
        ThreadsCommand::Show { thread, full } => {
            // A thread with no checkpoint may have runs in the fleet's queue.
            let shown = match &queue {
                Some(q) if !has_checkpoint(&saver, &thread).await? => {
                    queue_only_show(q, &thread, args.json).await?
                }
                _ => false,
            };
            if !shown {
                show(&saver, queue.as_ref(), &thread, full, args.json).await?;
            }
        }
        ThreadsCommand::History { thread, limit } => {
            history(&saver, &thread, limit, args.json).await?;
        }
        ThreadsCommand::Prune { thread, keep } => {
            exists(&saver, &thread).await?;
            let keep = usize::try_from(keep).unwrap_or(usize::MAX);
            // With the offload store, through the agent: the archive records and large
            // results only the pruned checkpoints saw go with them.
            let removed = match &offload {
                Some(store) => keel::agent::Agent::builder()
                    .model(Arc::new(keel::model::ScriptedModel::new(Vec::new())))
                    .checkpointer(saver.clone())
                    .offload_store(store.clone())
                    .build()
                    .context("cannot set up the pruning")?
                    .prune(&thread, keep)
                    .await
                    .with_context(|| format!("cannot prune thread `{thread}`"))?,
                None => saver
                    .prune(&ThreadKey::new(thread.clone()), keep)
                    .await
                    .with_context(|| format!("cannot prune thread `{thread}`"))?,
            };
            // What is left, not what was asked for: a thread with fewer checkpoints
            // than --keep keeps them all.
            let kept = checkpoints(&saver, &thread).await?;
            report(
                args.json,
                json!({"thread": thread, "removed": removed, "kept": kept}),
                || pruned_line(&thread, removed, kept, keep),
            );
        }
        ThreadsCommand::Delete { thread } => {
            let stored = saver
                .get(&ThreadKey::new(thread.clone()), None)
                .await
                .with_context(|| format!("cannot read thread `{thread}`"))?
                .is_some();
            // The fleet's runs first: refused while one is queued or running, before
            // anything is deleted. A thread whose runs never reached a checkpoint is
            // only there.
            let runs = match &queue {
                Some(q) => match q.forget_thread(&thread).await {
                    Ok(runs) => runs,
                    Err(keel_fleet::FleetError::ThreadActive { run, status, .. }) => {
                        bail!(
                            "thread `{thread}` has run {run} {status}, so nothing was deleted: cancel it with `{}`, then run this again once the run has ended (a running one stops at its next step)",
                            cancel_hint(run, args.database_url.as_deref())
                        );
                    }
                    Err(e) => {
                        return Err(e).with_context(|| format!("cannot delete thread `{thread}`"));
                    }
                },
                None => 0,
            };
            if !stored && runs == 0 {
                bail!("no thread `{thread}`: `keel threads list` shows the stored ones");
            }
            let files = if stored {
                saver
                    .delete_thread(&thread)
                    .await
                    .with_context(|| format!("cannot delete thread `{thread}`"))?;
                delete_offloaded(offload.as_deref(), &thread).await?
            } else {
                0
            };
            report(
                args.json,
                json!({"thread": thread, "offloaded_files_deleted": files, "queued_runs_deleted": runs}),
                || {
                    let runs = if queue.is_some() {
                        format!(", and its {runs} run(s) from the fleet's queue")
                    } else {
                        String::new()
                    };
                    format!(
                        "deleted thread `{thread}` ({files} archived or offloaded file(s) with it{runs})"
                    )
                },
            );
        }
        ThreadsCommand::Gc {
            older_than,
            dry_run: true,
        } => {
            let (idle, busy) = gc_candidates(&saver, queue.as_ref(), older_than).await?;
            report(
                args.json,
                json!({"dry_run": true, "would_delete": idle, "kept_in_flight": busy_json(&busy)}),
                || {
                    format!(
                        "would delete {} thread(s) idle for over {}{}; nothing was deleted (run again without --dry-run to delete them){}",
                        idle.len(),
                        human_duration(older_than),
                        listed(&idle),
                        busy_note(&busy)
                    )
                },
            );
        }
        ThreadsCommand::Gc { older_than, .. } => {
            let mut deleted = Vec::new();
            let mut busy = Vec::new();
            let mut files = 0;
            match &queue {
                // Without a fleet nothing else knows of a run in flight: the sweep
                // deletes, in batches, what is idle at the moment it looks.
                None => loop {
                    let batch = saver
                        .sweep_idle(older_than, 500)
                        .await
                        .context("the idle-thread sweep failed")?;
                    let done = batch.len() < 500;
                    deleted.extend(batch);
                    if done {
                        break;
                    }
                },
                // With a fleet, a thread whose run is queued or running may be idle by
                // its checkpoints (a long model call, a run waiting for a worker) and
                // still in use: its runs are forgotten first, which the queue refuses
                // while one is in flight, and only then are its checkpoints deleted.
                Some(q) => {
                    let (idle, _) = gc_candidates(&saver, None, older_than).await?;
                    for t in idle {
                        match q.forget_thread(&t).await {
                            Ok(_) => {
                                saver
                                    .delete_thread(&t)
                                    .await
                                    .with_context(|| format!("cannot delete thread `{t}`"))?;
                                deleted.push(t);
                            }
                            Err(keel_fleet::FleetError::ThreadActive { run, status, .. }) => {
                                busy.push((t, run, status));
                            }
                            Err(e) => {
                                return Err(e)
                                    .with_context(|| format!("cannot delete thread `{t}`"));
                            }
                        }
                    }
                }
            }
            // In id order, as `--dry-run` lists them (the sweep returns them in its own).
            deleted.sort();
            for t in &deleted {
                files += delete_offloaded(offload.as_deref(), t).await?;
            }
            report(
                args.json,
                json!({"deleted": deleted, "offloaded_files_deleted": files, "kept_in_flight": busy_json(&busy)}),
                || {
                    format!(
                        "deleted {} thread(s) idle for over {}{}{}",
                        deleted.len(),
                        human_duration(older_than),
                        listed(&deleted),
                        busy_note(&busy)
                    )
                },
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A thread id as a table shows it: control characters escaped, an empty id as `""`,
/// and a long one cut to 64 characters, so one odd id written by a program of its own
/// does not break every row (`--json` has it whole).
fn shown_id(id: &str) -> String {
    if id.is_empty() {
        return "\"\"".to_owned();
    }
    let escaped: String = id
        .chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect();
    if escaped.chars().count() <= 64 {
        return escaped;
    }
    let kept: String = escaped.chars().take(63).collect();
    format!("{kept}…")
}

/// The command that cancels `run`, on the database given by `--database-url` when it
/// was (its password left out; `DATABASE_URL` and keel.toml need no repeating).
fn cancel_hint(run: keel_fleet::RunId, database_url: Option<&str>) -> String {
    match database_url {
        Some(url) => format!("keel cancel {run} --database-url {}", store::redact(url)),
        None => format!("keel cancel {run}"),
    }
}

/// `: a, b, c` after a count of threads, or nothing when there are none.
fn listed(threads: &[String]) -> String {
    if threads.is_empty() {
        String::new()
    } else {
        format!(": {}", threads.join(", "))
    }
}

fn report(json: bool, value: serde_json::Value, text: impl FnOnce() -> String) {
    if json {
        crate::outln!("{value}");
    } else {
        crate::outln!("{}", text());
    }
}

async fn exists(saver: &Arc<dyn Checkpointer>, thread: &str) -> anyhow::Result<()> {
    let found = saver
        .get(&ThreadKey::new(thread.to_owned()), None)
        .await
        .with_context(|| format!("cannot read thread `{thread}`"))?;
    if found.is_none() {
        bail!("no thread `{thread}`: `keel threads list` shows the stored ones");
    }
    Ok(())
}

/// Whether `thread` has a checkpoint (its newest one's summary is read, not its state).
async fn has_checkpoint(saver: &Arc<dyn Checkpointer>, thread: &str) -> anyhow::Result<bool> {
    let key = ThreadKey::new(thread.to_owned());
    match saver
        .list(&key, ListOptions::default().limit(1))
        .next()
        .await
    {
        Some(item) => {
            item.with_context(|| format!("cannot read thread `{thread}`"))?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// How many checkpoints `thread` has.
async fn checkpoints(saver: &Arc<dyn Checkpointer>, thread: &str) -> anyhow::Result<u64> {
    let key = ThreadKey::new(thread.to_owned());
    let mut items = saver.list(&key, ListOptions::default());
    let mut n = 0;
    while let Some(item) = items.next().await {
        item.with_context(|| format!("cannot read the history of `{thread}`"))?;
        n += 1;
    }
    Ok(n)
}

/// What `keel threads prune` did: `kept` checkpoints are left of the `keep` asked for.
fn pruned_line(thread: &str, removed: impl std::fmt::Display, kept: u64, keep: usize) -> String {
    if (kept as usize) < keep {
        format!(
            "thread `{thread}`: removed {removed} checkpoint(s); it has {kept}, fewer than --keep {keep}, so all are kept"
        )
    } else {
        format!("thread `{thread}`: removed {removed} checkpoint(s), kept the newest {kept}")
    }
}

async fn delete_offloaded(store: Option<&dyn OffloadStore>, thread: &str) -> anyhow::Result<u64> {
    let Some(store) = store else {
        return Ok(0);
    };
    let Ok(id) = ThreadId::new(thread) else {
        // Not a name the offload store accepts: nothing of it can be there.
        return Ok(0);
    };
    // Deleting files is blocking I/O.
    let result = tokio::task::block_in_place(|| store.delete_thread(&id));
    result.with_context(|| format!("cannot delete the archived history of `{thread}`"))
}

/// An agent over `saver` to read states with; its model is never called.
fn reader(saver: Arc<dyn Checkpointer>) -> anyhow::Result<Agent> {
    let model = PolicyModel::new("gpt-4o", |_, _| {
        Err(ModelError::Malformed(
            "keel threads does not call models".into(),
        ))
    });
    Agent::builder()
        .model(Arc::new(model))
        .retrieval_tools(false)
        .checkpointer(saver)
        // It only reads states: it never archives.
        .offload_store(Arc::new(keel::offload::MemoryStore::new()))
        .build()
        .context("cannot set up the thread reader")
}

/// The thread's newest snapshot: its state, and the errors its last run stopped on.
async fn state_of(
    saver: &Arc<dyn Checkpointer>,
    thread: &str,
) -> anyhow::Result<Option<StateSnapshot<AgentState>>> {
    match reader(saver.clone())?.snapshot(thread).await {
        Ok(state) => Ok(state),
        // A state of another shape: a graph of the user's own wrote the thread.
        Err(keel::agent::AgentError::Graph(keel::graph::GraphError::State(e))) => {
            anyhow::bail!(
                "thread `{thread}` was not written by keel's agent, whose state this command reads ({e}); `keel threads history {thread}` lists its checkpoints, and the graph that wrote it reads its values (`CompiledGraph::get_state`)"
            )
        }
        Err(e) => Err(e)
            .with_context(|| format!("thread `{thread}` is not an agent thread keel can read")),
    }
}

/// A thread kept by `gc` for its run in flight: the thread, the run and its status.
type Busy = (String, keel_fleet::RunId, &'static str);

/// The threads `gc` would delete now, and those it keeps for a run of theirs that is
/// queued or running in the fleet's queue (when there is one).
async fn gc_candidates(
    saver: &Arc<dyn Checkpointer>,
    queue: Option<&keel_fleet::Queue>,
    older_than: Duration,
) -> anyhow::Result<(Vec<String>, Vec<Busy>)> {
    let idle = idle_threads(saver, older_than).await?;
    let Some(q) = queue else {
        return Ok((idle, Vec::new()));
    };
    let mut doomed = Vec::new();
    let mut busy = Vec::new();
    for t in idle {
        let runs = q
            .runs(&t)
            .await
            .with_context(|| format!("cannot read the fleet's runs of thread `{t}`"))?;
        let in_flight = runs.iter().find_map(|r| match r.status {
            keel_fleet::RunStatus::Queued => Some((r.id, "queued")),
            keel_fleet::RunStatus::Running { .. } => Some((r.id, "running")),
            _ => None,
        });
        match in_flight {
            Some((run, status)) => busy.push((t, run, status)),
            None => doomed.push(t),
        }
    }
    Ok((doomed, busy))
}

fn busy_json(busy: &[Busy]) -> serde_json::Value {
    busy.iter()
        .map(|(t, run, status)| json!({"thread": t, "run": run.to_string(), "status": status}))
        .collect()
}

/// What `gc` says of the threads it kept for their runs in flight.
fn busy_note(busy: &[Busy]) -> String {
    if busy.is_empty() {
        return String::new();
    }
    let each: Vec<String> = busy
        .iter()
        .map(|(t, run, status)| format!("`{t}` (run {run} {status})"))
        .collect();
    format!(
        "; kept {} idle thread(s) whose fleet run is queued or running: {}",
        busy.len(),
        each.join(", ")
    )
}

/// The threads `sweep_idle(older_than)` would delete now: those whose newest checkpoint,
/// over every namespace, is older than `older_than`.
async fn idle_threads(
    saver: &Arc<dyn Checkpointer>,
    older_than: Duration,
) -> anyhow::Result<Vec<String>> {
    keel::checkpoint::support::idle_threads(saver.as_ref(), older_than, usize::MAX)
        .await
        .context("cannot list threads")
}

/// Where a thread stands: `answered`, `stopped: <why>` (a resumable stop, named as
/// `Stop` serializes it), `failed in <node>` (its last run stopped on an error, which
/// [`last_error`] gives), or `unfinished` (its last run was cut off before the model
/// answered). Running it again goes on from its last checkpoint.
fn where_it_stands(snapshot: &StateSnapshot<AgentState>) -> String {
    let state = &snapshot.values;
    if let Some(failed) = snapshot.errors.first() {
        return format!("failed in {}", failed.node);
    }
    if let Some(stop) = &state.stop {
        let kind = serde_json::to_value(stop)
            .ok()
            .and_then(|v| v["kind"].as_str().map(|k| k.replace('_', " ")))
            .unwrap_or_else(|| "early".to_owned());
        return format!("stopped: {kind}");
    }
    match state.last_message() {
        Some(m)
            if m.role == keel::message::Role::Assistant
                && m.tool_calls.is_empty()
                && state.answer().is_some() =>
        {
            "answered".to_owned()
        }
        _ => "unfinished".to_owned(),
    }
}

/// The error the thread's last run stopped on, if it stopped on one: its message (which
/// names the node) and, for JSON, the node too.
fn last_error(snapshot: &StateSnapshot<AgentState>) -> Option<(String, serde_json::Value)> {
    snapshot.errors.first().map(|e| {
        (
            e.message.clone(),
            json!({"node": e.node, "message": e.message}),
        )
    })
}

/// `keel threads show` of a thread with runs in the fleet's queue and no checkpoint
/// yet: its runs. False (nothing said) when the queue has no run of it either.
async fn queue_only_show(
    queue: &keel_fleet::Queue,
    thread: &str,
    json_out: bool,
) -> anyhow::Result<bool> {
    let runs: Vec<_> = queue
        .runs(thread)
        .await
        .with_context(|| format!("cannot list the queued runs of thread `{thread}`"))?
        .iter()
        .map(crate::fleet::describe)
        .collect();
    if runs.is_empty() {
        return Ok(false);
    }
    if json_out {
        crate::outln!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "thread": thread, "queue_only": true,
                "runs": runs.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>(),
            }))?
        );
    } else {
        crate::outln!(
            "thread `{thread}`: no checkpoint yet (its runs are in the fleet's queue only)"
        );
        for (line, _) in &runs {
            crate::outln!("  {line}");
        }
    }
    Ok(true)
}

/// `saver`: `None` where no checkpoint table exists yet (only the queue's runs are
/// listed then).
async fn list(
    saver: Option<&Arc<dyn Checkpointer>>,
    queue: Option<&keel_fleet::Queue>,
    limit: usize,
    after: Option<String>,
    json_out: bool,
) -> anyhow::Result<()> {
    let threads = match saver {
        Some(saver) => saver
            .list_threads(after.as_deref(), limit)
            .await
            .context("cannot list threads")?,
        None => Vec::new(),
    };
    let mut rows = vec![vec![
        "thread".to_owned(),
        "last active (UTC)".into(),
        "model calls".into(),
        "milestones".into(),
        "epochs".into(),
        "state".into(),
        "goal".into(),
    ]];
    if queue.is_some() {
        rows[0].insert(2, "last run".into());
    }
    let mut out = Vec::new();
    for t in &threads {
        // `threads` is empty without a saver.
        let Some(saver) = saver else { break };
        let snapshot = state_of(saver, &t.thread_id).await.ok().flatten();
        let state = snapshot.as_ref().map(|s| &s.values);
        let error = snapshot.as_ref().and_then(last_error);
        let model = crate::live::saved_model(&**saver, &t.thread_id)
            .await
            .ok()
            .flatten();
        let when = utc(t.head.timestamp_millis());
        let full_goal = state
            .as_ref()
            .and_then(|s| s.goal().map(|g| g.text().into_owned()))
            .unwrap_or_default();
        // The table's goal is short, cut at a word where it can be.
        let goal = short(&full_goal, 60);
        let (steps, milestones, epochs) = state.as_ref().map_or((None, None, None), |s| {
            (Some(s.step), Some(s.milestones_made), Some(s.epochs_made))
        });
        let last_run = match queue {
            Some(q) => q
                .runs(&t.thread_id)
                .await
                .ok()
                .and_then(|runs| runs.last().map(|r| r.status.name())),
            None => None,
        };
        let where_ = snapshot.as_ref().map(where_it_stands);
        out.push(
            json!({"thread": t.thread_id, "last_active": iso_utc(t.head.timestamp_millis()), "namespaces": t.namespaces,
            "model_calls": steps, "milestones": milestones, "epochs": epochs, "state": where_, "error": error.map(|(_, json)| json),
            "model": model, "goal": full_goal, "last_run": last_run, "queue_only": false}),
        );
        let show = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), thousands);
        let mut row = vec![
            shown_id(&t.thread_id),
            when,
            show(steps),
            show(milestones),
            show(epochs),
            where_.unwrap_or_else(|| "-".to_owned()),
            goal,
        ];
        if queue.is_some() {
            row.insert(2, last_run.unwrap_or("-").to_owned());
        }
        rows.push(row);
    }
    // Threads only the fleet's queue knows (their runs never reached a checkpoint), in
    // this page's range of ids: up to the page's last id when more may follow.
    let queue_only = match queue {
        Some(q) => queue_only_threads(q, &threads, after.as_deref(), limit).await?,
        None => Vec::new(),
    };
    for (thread, last_run) in &queue_only {
        out.push(
            json!({"thread": thread, "last_active": null, "namespaces": 0,
            "model_calls": null, "milestones": null, "epochs": null, "state": null, "error": null,
            "model": null, "goal": null, "last_run": last_run, "queue_only": true}),
        );
        let dash = || "-".to_owned();
        rows.push(vec![
            shown_id(thread),
            dash(),
            last_run.clone(),
            dash(),
            dash(),
            dash(),
            dash(),
            "(no checkpoint yet: runs in the queue only)".to_owned(),
        ]);
    }
    if !queue_only.is_empty() {
        rows[1..].sort_by(|a, b| a[0].cmp(&b[0]));
        out.sort_by(|a, b| a["thread"].as_str().cmp(&b["thread"].as_str()));
    }
    if json_out {
        crate::outln!("{}", serde_json::to_string_pretty(&out)?);
    } else if threads.is_empty() && queue_only.is_empty() {
        crate::outln!(
            "no threads{}",
            after.map(|a| format!(" after `{a}`")).unwrap_or_default()
        );
    } else {
        crate::out!("{}", table(&rows));
        if threads.len() == limit
            && let Some(last) = threads.last()
        {
            crate::outln!("(more may follow: --after {})", last.thread_id);
        }
    }
    Ok(())
}

/// The ids (and last run status) of threads the fleet's queue has runs of but the
/// checkpointer has no checkpoint of, after `after` and, when the page of stored
/// `threads` is full, up to its last id; at most `limit`.
async fn queue_only_threads(
    queue: &keel_fleet::Queue,
    threads: &[keel::checkpoint::ThreadInfo],
    after: Option<&str>,
    limit: usize,
) -> anyhow::Result<Vec<(String, String)>> {
    let upper = (threads.len() == limit)
        .then(|| threads.last().map(|t| t.thread_id.as_str()))
        .flatten();
    let mut found = Vec::new();
    let mut from = after.map(str::to_owned);
    'pages: loop {
        let ids = queue
            .thread_ids(from.as_deref(), 500)
            .await
            .context("cannot list the fleet's threads")?;
        let Some(last) = ids.last().cloned() else {
            break;
        };
        for id in ids {
            if upper.is_some_and(|u| id.as_str() > u) || found.len() >= limit {
                break 'pages;
            }
            if threads.iter().any(|t| t.thread_id == id) {
                continue;
            }
            let last_run = queue
                .runs(&id)
                .await
                .ok()
                .and_then(|runs| runs.last().map(|r| r.status.name().to_owned()))
                .unwrap_or_else(|| "-".to_owned());
            found.push((id, last_run));
        }
        from = Some(last);
    }
    Ok(found)
}

async fn show(
    saver: &Arc<dyn Checkpointer>,
    queue: Option<&keel_fleet::Queue>,
    thread: &str,
    full: bool,
    json_out: bool,
) -> anyhow::Result<()> {
    exists(saver, thread).await?;
    let runs = match queue {
        Some(q) => q
            .runs(thread)
            .await
            .with_context(|| format!("cannot list the queued runs of thread `{thread}`"))?
            .iter()
            .map(crate::fleet::describe)
            .collect(),
        None => Vec::new(),
    };
    let snapshot = state_of(saver, thread)
        .await?
        .with_context(|| format!("thread `{thread}` has no state"))?;
    let error = last_error(&snapshot);
    let (ran_with, ran_with_json) = crate::live::ran_with(&**saver, thread).await?;
    let state = &snapshot.values;
    // Counted as the thread's model counts (as gpt-4o's o200k for a thread that saved
    // no model, as the demo's).
    let profiles = ModelProfiles::new();
    let profile = ran_with_json
        .get("model")
        .and_then(serde_json::Value::as_str)
        .and_then(|m| crate::model::ModelSpec::parse(m).ok())
        .map_or_else(
            || profiles.lookup("gpt-4o"),
            |spec| profiles.lookup(spec.name()),
        );
    let encoding = profile.encoding;
    let counter = crate::model::counter(profile)?;
    let count = |m: &Message| counter.count_message(m);
    let system = state.system.as_ref();
    let goal = state.goal();
    let system_tokens = system.map_or(0, count);
    let goal_tokens = goal.map_or(0, |g| count(g.message()));
    // The top summary (the era, with three tiers), then the kept epoch summaries.
    let top_tokens = state.epoch.as_ref().map_or(0, |e| count(&e.message));
    let epochs_tokens: usize = state.epochs.iter().map(|e| count(&e.message)).sum();
    let milestone_tokens: usize = state.milestones.iter().map(|m| count(&m.message)).sum();
    let raw_tokens: usize = state.messages.iter().map(count).sum();
    if json_out {
        let layer = |l: &keel::compaction::Layer| json!({"steps": [l.first_step, l.last_step], "tokens": count(&l.message), "text": l.text});
        crate::outln!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "thread": thread, "model_calls": state.step, "milestones_made": state.milestones_made, "epochs_made": state.epochs_made,
                "stop": state.stop, "error": error.as_ref().map(|(_, json)| json), "ran_with": ran_with_json,
                "runs": runs.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>(),
                "system": {"tokens": system_tokens, "text": system.map(|m| m.text().into_owned())},
                "goal": {"tokens": goal_tokens, "text": goal.map(|g| g.text().into_owned())},
                "epoch": state.epoch.as_ref().map(layer),
                "epochs": state.epochs.iter().map(layer).collect::<Vec<_>>(),
                "milestones": state.milestones.iter().map(layer).collect::<Vec<_>>(),
                "raw": {"tokens": raw_tokens, "messages": state.messages.iter().map(|m| json!({
                    "role": m.role.as_str(), "tokens": count(m), "text": m.text(),
                    "tool_calls": m.tool_calls.iter().map(|c| json!({"name": c.name, "arguments": c.arguments.to_json_string()})).collect::<Vec<_>>()})).collect::<Vec<_>>()},
            }))?
        );
        return Ok(());
    }
    let total =
        system_tokens + goal_tokens + top_tokens + epochs_tokens + milestone_tokens + raw_tokens;
    crate::outln!(
        "thread `{thread}`: {}, {} and {} made{}",
        crate::ui::count(state.step, "model call"),
        crate::ui::count(state.milestones_made, "milestone"),
        crate::ui::count(state.epochs_made, "epoch"),
        state
            .stop
            .as_ref()
            .map(|s| format!("; stopped: {s}"))
            .unwrap_or_default()
    );
    if let Some(line) = &ran_with {
        crate::outln!("  {line}");
    }
    if let Some((error, _)) = &error {
        crate::outln!("  last run: {error}\n  (running it again goes on from its last checkpoint)");
    }
    for (line, _) in &runs {
        crate::outln!("  {line}");
    }
    crate::outln!(
        "the prompt in order, {} tokens ({encoding}) before tool specs:\n",
        thousands(total as u64)
    );
    let section = |name: &str, tokens: usize| {
        crate::outln!("== {name} ({} tokens)", thousands(tokens as u64))
    };
    section("system", system_tokens);
    crate::outln!(
        "{}\n",
        system
            .map(|m| m.text().into_owned())
            .unwrap_or_else(|| "(none)".into())
    );
    section("goal (never compacted)", goal_tokens);
    crate::outln!(
        "{}\n",
        goal.map(|g| g.text().into_owned())
            .unwrap_or_else(|| "(none)".into())
    );
    let layer = |l: &keel::compaction::Layer| {
        crate::outln!(
            "-- steps {}-{} ({} tokens)\n{}\n",
            l.first_step,
            l.last_step,
            count(&l.message),
            l.text
        );
    };
    if let Some(top) = &state.epoch {
        section("top summary (everything older, folded)", top_tokens);
        layer(top);
    }
    section(
        &format!("epoch summaries ({})", state.epochs.len()),
        epochs_tokens,
    );
    if state.epoch.is_none() && state.epochs.is_empty() {
        crate::outln!("(none yet)\n");
    }
    state.epochs.iter().for_each(layer);
    section(
        &format!("milestones ({})", state.milestones.len()),
        milestone_tokens,
    );
    state.milestones.iter().for_each(layer);
    section(
        &format!("raw tail ({} messages)", state.messages.len()),
        raw_tokens,
    );
    let skip = if full {
        0
    } else {
        state.messages.len().saturating_sub(10)
    };
    if skip > 0 {
        crate::outln!("({skip} earlier messages not shown; --full shows them)");
    }
    for m in state.messages.iter().skip(skip) {
        let mut text = m.text().into_owned();
        if !full && text.chars().count() > 300 {
            text = text.chars().take(300).collect::<String>() + " …";
        }
        let calls: Vec<String> = m
            .tool_calls
            .iter()
            .map(|c| format!("{}({})", c.name, c.arguments.to_json_string()))
            .collect();
        crate::outln!(
            "[{}, {} tokens] {text}{}",
            m.role.as_str(),
            count(m),
            if calls.is_empty() {
                String::new()
            } else {
                format!(" -> {}", calls.join(", "))
            }
        );
    }
    Ok(())
}

async fn history(
    saver: &Arc<dyn Checkpointer>,
    thread: &str,
    limit: usize,
    json_out: bool,
) -> anyhow::Result<()> {
    exists(saver, thread).await?;
    let key = ThreadKey::new(thread.to_owned());
    // One more than shown, to say when there are more.
    let mut items = saver.list(&key, ListOptions::default().limit(limit.saturating_add(1)));
    let mut more = false;
    let mut rows = vec![vec![
        "checkpoint".to_owned(),
        "made (UTC)".into(),
        "superstep".into(),
        "source".into(),
        "written by".into(),
        "parent".into(),
    ]];
    let mut listed = Vec::new();
    while let Some(item) = items.next().await {
        let c = item.with_context(|| format!("cannot read the history of `{thread}`"))?;
        if listed.len() == limit {
            more = true;
            break;
        }
        listed.push(c);
    }
    let mut out = Vec::new();
    let mut forked = false;
    for (i, c) in listed.iter().enumerate() {
        let when = utc(c.checkpoint.id.timestamp_millis());
        let source = format!("{:?}", c.metadata.source).to_lowercase();
        let parent = c.checkpoint.parent.as_ref().map(ToString::to_string);
        out.push(json!({"checkpoint": c.checkpoint.id.to_string(), "made": iso_utc(c.checkpoint.id.timestamp_millis()), "step": c.metadata.step, "source": source, "writes": c.metadata.writes, "parent": parent}));
        // The usual parent is the row below (the next older checkpoint): left blank,
        // so the ids that stand out are where the thread forked.
        let below = listed.get(i + 1).map(|b| &b.checkpoint.id);
        let shown_parent = match &c.checkpoint.parent {
            None => "-".to_owned(),
            Some(p) if Some(p) == below => String::new(),
            // Every checkpoint is listed and this one's parent is not among them.
            Some(p) if !more && !listed.iter().any(|l| l.checkpoint.id == *p) => {
                "(pruned)".to_owned()
            }
            // The page's last row: its parent is on the next page.
            Some(_) if below.is_none() => String::new(),
            Some(p) => {
                forked = true;
                p.to_string()
            }
        };
        rows.push(vec![
            c.checkpoint.id.to_string(),
            when,
            c.metadata.step.to_string(),
            source,
            c.metadata.writes.join(", "),
            shown_parent,
        ]);
    }
    if json_out {
        crate::outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        crate::out!("{}", table(&rows));
        crate::outln!(
            "(a superstep is one round of the graph's nodes: a model call (`agent`) is one, the tool calls it asked for (`tools`) the next; `keel threads show` counts model calls)"
        );
        if forked {
            crate::outln!(
                "(a parent is named where it is not the row below: the thread was forked there, by a run from a past checkpoint or an edit of its state)"
            );
        }
        if more {
            crate::outln!(
                "(the newest {limit} shown; older ones follow: --limit {} shows more)",
                limit.saturating_mul(2)
            );
        }
    }
    Ok(())
}

/// `--keep`: a whole number of checkpoints, at least 1.
fn parse_keep(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(0) => Err(
            "a thread keeps at least its newest checkpoint; `keel threads delete` removes a whole thread"
                .to_owned(),
        ),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a number of checkpoints (e.g. --keep 3)")),
    }
}

/// `90s`, `30m`, `12h`, `7d`, `2w`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (n, unit) = text.split_at(split);
    if !n.is_empty() && unit.starts_with(['.', ',']) {
        return Err(format!(
            "`{text}`: the number must be a whole number; use a smaller unit instead (e.g. 36h, not 1.5d)"
        ));
    }
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write e.g. 90s, 30m, 12h, 7d or 2w"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        "w" => 604_800,
        _ => {
            return Err(format!(
                "`{text}`: the unit must be s, m, h, d or w (e.g. 7d)"
            ));
        }
    };
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("`{text}` is too long a duration"))
}

fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s % 86_400 == 0 && s > 0 => format!("{} day(s)", s / 86_400),
        s if s % 3_600 == 0 && s > 0 => format!("{} hour(s)", s / 3_600),
        s if s % 60 == 0 && s > 0 => format!("{} minute(s)", s / 60),
        s => format!("{s} second(s)"),
    }
}

/// `text` cut to about `limit` characters at a word boundary, with `...` when cut.
fn short(text: &str, limit: usize) -> String {
    if text.chars().count() <= limit {
        return text.to_owned();
    }
    let cut: String = text.chars().take(limit).collect();
    let at_word = match cut.rfind(char::is_whitespace) {
        Some(i) if i > 0 => cut[..i].trim_end().to_owned(),
        _ => cut,
    };
    format!("{at_word}...")
}

/// Unix milliseconds as ISO 8601 in UTC, `2026-12-01T22:30:05Z` (what `--json` prints).
pub(crate) fn iso_utc(millis: u64) -> String {
    format!("{}Z", utc(millis).replacen(' ', "T", 1))
}

/// Unix milliseconds as `2026-12-01 22:30:05` (UTC; the tables' form).
pub(crate) fn utc(millis: u64) -> String {
    let secs = millis / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_thread_ids_keep_the_table_in_shape() {
        assert_eq!(shown_id("ticket-42"), "ticket-42");
        assert_eq!(shown_id(""), "\"\"");
        assert_eq!(shown_id("a\0b\nc"), "a\\u{0}b\\nc");
        let long = shown_id(&"é".repeat(2000));
        assert_eq!(long.chars().count(), 64);
        assert!(long.ends_with('…'));
        assert_eq!(shown_id(&"x".repeat(64)), "x".repeat(64));
    }

    #[test]
    fn durations_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
        assert!(parse_duration("7").unwrap_err().contains("unit"));
        assert!(parse_duration("d").unwrap_err().contains("90s"));
        assert!(parse_duration("99999999999999999999w").is_err());
        let half = parse_duration("1.5d").unwrap_err();
        assert!(
            half.contains("whole number") && !half.contains("unit must"),
            "{half}"
        );
    }

    #[test]
    fn a_prune_that_keeps_all_says_so() {
        assert_eq!(
            pruned_line("t", 6, 3, 3),
            "thread `t`: removed 6 checkpoint(s), kept the newest 3"
        );
        let all = pruned_line("t", 0, 9, 100);
        assert!(
            all.contains("it has 9, fewer than --keep 100") && !all.contains("newest 100"),
            "{all}"
        );
    }

    #[test]
    fn short_goals_end_at_a_word() {
        assert_eq!(short("Find the config", 60), "Find the config");
        assert_eq!(
            short("Find where the config is parsed", 20),
            "Find where the..."
        );
        assert_eq!(short("Supercalifragilistic", 10), "Supercalif...");
    }

    #[test]
    fn utc_formats_known_instants() {
        assert_eq!(iso_utc(1_796_164_962_000), "2026-12-01T22:42:42Z");
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(utc(1_796_164_962_000), "2026-12-01 22:42:42");
    }
}
