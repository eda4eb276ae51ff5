//! `keel submit` and `keel worker`: a fleet of agent workers on one Postgres.
//!
//! `keel submit` stores a run (a goal for a new thread, or a follow-up message) in the
//! run queue and prints its id; any number of `keel worker` processes, on any
//! machines, claim runs under leases and run their threads from the last checkpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{ArgGroup, Args};
use keel::agent::Agent;
use keel::agent::tools::FileTools;
use keel::checkpoint::{Checkpointer, ThreadKey};
use keel::compaction::CompactionConfig;
use keel::message::{Message, Role, ToolCall};
use keel::model::{ChatModel, ChatOptions, ChatResponse, PolicyModel};
use keel::postgres::{PostgresConfig, PostgresSaver};
use keel::token::{Encoding, ModelProfile};
use keel_fleet::{
    ClaimTrouble, FleetError, Policy, Queue, RunEnd, RunId, RunInput, RunOutcome, RunStatus, Worker,
};
use serde_json::json;

use crate::config::Settings;
use crate::model::{self, LIVE_SYSTEM, LiveArgs, ModelSpec};
use crate::store;
use crate::{errln, outln};

/// `keel submit`
#[derive(Debug, Args)]
#[command(
    group(ArgGroup::new("what").required(true).args(["goal", "message"])),
    after_help = "\
Examples:
  keel submit --database-url postgres://keel@db/app --thread ticket-42 --goal \"Find where the config is parsed\"
  keel submit --thread ticket-42 --message \"Now list its callers\" --policy enqueue
  keel submit --thread ticket-42 --message \"Stop; summarize what you found\" --policy interrupt

Prints the run's id (and with --wait, how it ended). The run is stored when the command returns; a `keel worker`
on the same database runs it. A thread with a queued or running run refuses a second
one unless --policy says otherwise: enqueue (run after them) or interrupt (cancel the
queued ones, stop the running one at its next step, keeping its steps, and run this one
next). A thread's goal is written once: --goal starts a thread, --message continues it.
The URL may also come from DATABASE_URL or keel.toml; the queue's tables are created
when missing.

Exit codes with --wait, as `keel run`'s: 0 the run ended (with the answer, or waiting
for an approval), 5 it stopped before the model answered (the worker's --max-steps, the
step ceiling; a worker with a higher limit continues the thread), 1 it failed or was
cancelled."
)]
pub struct SubmitArgs {
    /// The Postgres URL of the fleet (default: DATABASE_URL, or `database_url` in
    /// keel.toml). TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long)]
    database_url: Option<String>,
    /// The thread to run.
    #[arg(long, value_parser = crate::ui::thread_id)]
    thread: String,
    /// The goal of a new thread (written once; heads every prompt).
    #[arg(long, value_parser = crate::ui::some_text)]
    goal: Option<String>,
    /// A follow-up message to the thread (which has a goal: from a run that started it,
    /// or from a run queued before this one).
    #[arg(long, value_parser = crate::ui::some_text)]
    message: Option<String>,
    /// What to do when the thread already has a queued or running run.
    #[arg(long, default_value = "reject", value_parser = ["reject", "enqueue", "interrupt"])]
    policy: String,
    /// Wait until the run ends and print how it ended (the answer, or the error).
    #[arg(long)]
    wait: bool,
}

/// `keel worker`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel worker --database-url postgres://keel@db/app --model scripted
  keel worker --model ollama/qwen2.5:7b --concurrency 4 --dir ../project
  OPENAI_BASE_URL=http://127.0.0.1:8080/v1 keel worker --model openai/local --name gpu-1

Runs queued runs until Ctrl-C or SIGTERM, then stops each held run at its next step and
puts it back in the queue, and exits 0. Start as many workers as you like, on any machines: a run is held
by one worker at a time under a lease the database times; a worker that dies loses its
runs after --lease seconds and another continues them from their last checkpoint.
Checkpoints, the archive and offloaded results live in the same database. The file
tools are read-only and rooted at --dir. `--model scripted` needs no model server: a
deterministic agent that lists the directory, greps it twice and answers.")]
pub struct WorkerArgs {
    /// The Postgres URL of the fleet (default: DATABASE_URL, or `database_url` in
    /// keel.toml). TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long)]
    database_url: Option<String>,
    /// Runs held at once.
    #[arg(long, default_value_t = 1, value_parser = crate::ui::at_least_one::<usize>)]
    concurrency: usize,
    /// `ollama/<name>`, `openai/<name>` or `scripted` (default: KEEL_MODEL, or `model` in keel.toml).
    #[arg(long, value_parser = crate::model::worker_model_flag)]
    model: Option<String>,
    /// The directory the (read-only) file tools are rooted at.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// The worker's name in run statuses (default: host name and process id).
    #[arg(long)]
    name: Option<String>,
    /// Seconds a silent worker keeps its runs before another takes them over (1 to
    /// 86400, a day).
    #[arg(long, default_value_t = 30, value_parser = lease_secs)]
    lease: u64,
    /// Model calls at most per thread, over all its runs (the thread then stops
    /// resumably; a worker with a higher limit continues it).
    #[arg(long, value_name = "CALLS", default_value_t = 100, value_parser = crate::ui::at_least_one::<u64>)]
    max_steps: u64,
    #[command(flatten)]
    live: LiveArgs,
}

/// `--lease`: whole seconds from 1 to a day ([`keel_fleet::MAX_LEASE`]); a longer lease
/// would leave the worker unable to claim anything.
fn lease_secs(text: &str) -> Result<u64, String> {
    let secs = crate::ui::at_least_one::<u64>(text)?;
    let max = keel_fleet::MAX_LEASE.as_secs();
    if secs > max {
        return Err(format!(
            "it must be at most {max} (a day): a lease is how long a silent worker's runs wait for another worker"
        ));
    }
    Ok(secs)
}

fn database_url(flag: Option<&str>, settings: &Settings, command: &str) -> anyhow::Result<String> {
    settings.database_url(flag).with_context(|| {
        format!("`keel {command}` needs the fleet's Postgres: --database-url postgres://user@host/db (or DATABASE_URL)")
    })
}

fn queue(url: &str) -> anyhow::Result<Queue> {
    let mut options = keel_fleet::QueueOptions::new();
    if let Some(s) = crate::store::schema() {
        options = options
            .schema(s)
            .with_context(|| crate::store::bad_schema(s))?;
    }
    Queue::connect_with(url, options).map_err(|e| match e {
        keel_fleet::FleetError::ConnectionString(e) => store::url_error(e),
        e => anyhow::Error::new(e),
    })
}

/// Runs `keel submit`.
pub async fn submit(args: SubmitArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let url = database_url(args.database_url.as_deref(), settings, "submit")?;
    let queue = queue(&url)?;
    let applied = queue.setup().await.map_err(|e| {
        store::setup_failed(
            e,
            &url,
            format!(
                "cannot reach Postgres at {} or create the run queue's tables there",
                store::redact(&url)
            ),
        )
    })?;
    store::note_upgrade(&applied, "run queue tables", &store::redact(&url));
    if args.goal.is_some() && thread_started(&queue, &url, &args.thread).await {
        bail!(
            "thread `{}` already has a goal (a goal is written once); continue it with --message \"...\" instead of --goal, or submit to a new thread",
            args.thread
        );
    }
    let policy: Policy = args.policy.parse()?;
    if args.goal.is_none() && !thread_started(&queue, &url, &args.thread).await {
        let pending = pending_runs(&queue, &args.thread).await?;
        if pending.is_empty() {
            bail!(
                "thread `{}` has no goal yet, so a worker could not run this message: start the thread with --goal \"...\" (a follow-up --message comes after that)",
                args.thread
            );
        }
        // An interrupt cancels the queued runs, the one with the thread's goal too
        // (a running one has written it by its first step).
        if policy == Policy::Interrupt
            && !pending
                .iter()
                .any(|r| matches!(r.status, RunStatus::Running { .. }))
        {
            bail!(
                "thread `{}` has no goal yet: it is in queued run {}, which --policy interrupt would cancel, so a worker could not run this message; submit it with --policy enqueue to run after that run",
                args.thread,
                pending
                    .first()
                    .map(|r| r.id.to_string())
                    .unwrap_or_default()
            );
        }
    }
    let mut input = RunInput::new();
    if let Some(goal) = args.goal {
        input = input.goal(goal);
    }
    if let Some(message) = args.message {
        input = input.message(Message::user(message));
    }
    let run = match queue.submit_with(&args.thread, input, policy).await {
        Ok(run) => run,
        Err(FleetError::ThreadBusy {
            thread,
            run,
            status,
            more,
            ..
        }) => {
            bail!(
                "thread `{thread}` is busy: run {run} is {status}{}; pass --policy enqueue to run after it, or --policy interrupt to cancel it",
                keel_fleet::queued_after(more)
            )
        }
        Err(FleetError::GoalTaken { thread, run }) => {
            bail!(
                "thread `{thread}` already has a goal, from run {run} (a goal is written once); continue it with --message \"...\" instead of --goal, or submit to a new thread"
            )
        }
        Err(e) => return Err(e).context("cannot submit the run"),
    };
    outln!("{run}");
    if !args.wait {
        return Ok(ExitCode::SUCCESS);
    }
    let waiting_since = std::time::Instant::now();
    let mut noted = false;
    loop {
        let info = queue.status(run).await?;
        if !noted
            && matches!(info.status, RunStatus::Queued)
            && waiting_since.elapsed() >= QUEUED_NOTE_AFTER
        {
            noted = true;
            errln!(
                "run {run} is still queued after {} s: no worker has taken it. Is a `keel worker` running on this database? (Workers busy with other runs take it when they can; Ctrl-C stops waiting and leaves it queued.)",
                QUEUED_NOTE_AFTER.as_secs()
            );
        }
        match info.status {
            RunStatus::Done { result, .. } => {
                outln!("done{}", result_outcome(&result, usize::MAX));
                // As `keel run`: a script tells a stop before the answer from one.
                return Ok(if result.answer.is_none() && result.stop.is_some() {
                    ExitCode::from(crate::ui::exit::STOPPED)
                } else {
                    ExitCode::SUCCESS
                });
            }
            RunStatus::Failed { error, .. } => {
                outln!("failed: {}", cli_error(&error, &args.thread));
                return Ok(ExitCode::FAILURE);
            }
            RunStatus::Cancelled { reason, .. } => {
                outln!("cancelled: {}", reason.as_deref().unwrap_or("cancelled"));
                return Ok(ExitCode::FAILURE);
            }
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// How long `keel submit --wait` waits on a run no worker has taken before it asks
/// whether a worker is running.
const QUEUED_NOTE_AFTER: Duration = Duration::from_secs(5);

/// Whether `thread` has a checkpoint in the database at `url` (read over the queue's
/// pool, in the schema `keel worker` uses), so its goal is set. Only reads: a database
/// without keel's checkpoint tables, or any error, counts as no (the worker then
/// reports what is wrong).
async fn thread_started(queue: &Queue, url: &str, thread: &str) -> bool {
    let Ok(config) = PostgresConfig::new(url) else {
        return false;
    };
    let schema = crate::store::schema().unwrap_or(config.get_schema());
    let Ok(saver) = PostgresSaver::from_pool(queue.pool().clone(), schema) else {
        return false;
    };
    matches!(saver.get(&ThreadKey::new(thread), None).await, Ok(Some(_)))
}

/// The queued and running runs of `thread` (which may carry its goal: a message
/// submitted after them runs once it has), oldest first.
async fn pending_runs(queue: &Queue, thread: &str) -> anyhow::Result<Vec<keel_fleet::RunInfo>> {
    let runs = queue
        .runs(thread)
        .await
        .with_context(|| format!("cannot read the runs of thread `{thread}` in the queue"))?;
    Ok(runs
        .into_iter()
        .filter(|r| matches!(r.status, RunStatus::Queued | RunStatus::Running { .. }))
        .collect())
}

/// Runs `keel worker`.
pub async fn worker(args: WorkerArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let url = database_url(args.database_url.as_deref(), settings, "worker")?;
    let model = settings.model(args.model.as_deref()).context(
        "`keel worker` needs a model: --model scripted (no server), ollama/<name> or openai/<name> (or KEEL_MODEL)",
    )?;
    let queue = queue(&url)?;
    match queue.check().await {
        Ok(()) => {}
        // A new database: create the tables. An older or newer schema is an operator's
        // decision, so it stays an error naming the version.
        Err(FleetError::NotSetUp { .. }) => {
            queue
                .setup()
                .await
                .context("cannot create the run queue's tables")?;
        }
        Err(e) => {
            let otherwise = format!("the run queue at {} cannot be used", store::redact(&url));
            return Err(store::setup_failed(e, &url, otherwise));
        }
    }
    let home = settings.home(None);
    let storage = store::open(&home, Some(&url), true).await?;
    let offload =
        store::offload_for(&home, Some(&url), true)?.context("no offload store could be opened")?;
    let (client, profile, options, described, spec): (
        Arc<dyn ChatModel>,
        ModelProfile,
        _,
        String,
        Option<ModelSpec>,
    ) = if model == "scripted" {
        (
            Arc::new(scripted()),
            ModelProfile::new("scripted", 32_000, 2_000, Encoding::Approximate),
            ChatOptions::new(),
            "scripted (no server)".to_owned(),
            None,
        )
    } else {
        let spec = ModelSpec::parse(&model)
            .context("--model takes `scripted`, `ollama/<name>` or `openai/<name>`")?;
        let live = args
            .live
            .connect(&spec, args.live.window(settings, None)?, settings)?;
        let described = format!(
            "{spec} at {}",
            keel::model::redact_url(&spec.base_url(settings))
        );
        (
            live.client,
            live.profile,
            live.options,
            described,
            Some(spec),
        )
    };
    let tools = FileTools::new(&args.dir)
        .with_context(|| format!("cannot root the file tools at {}", args.dir.display()))?
        .read_only();
    let agent = Agent::builder()
        .model(client)
        .options(options)
        .profile(profile)
        .system(LIVE_SYSTEM)
        .file_tools(tools)
        .offload_store(offload)
        .compaction(CompactionConfig::default().with_max_steps(args.max_steps));
    let fix = spec.map(|spec| {
        let url = spec.base_url(settings);
        (spec, url)
    });
    let mut builder = Worker::builder(queue, storage.saver.clone())
        .agent(agent)
        .concurrency(args.concurrency)
        .lease(Duration::from_secs(args.lease.max(1)))
        .heartbeat(Duration::from_secs(args.lease.max(1)) / 10)
        .on_run_end(move |end| outln!("{}", run_end_line(end, fix.as_ref())))
        .on_claim_trouble(claim_trouble(store::redact(&url)));
    if let Some(name) = &args.name {
        builder = builder.name(name.clone());
    }
    let worker = builder.build().context("cannot set up the worker")?;
    outln!(
        "worker {}: {} slot(s), model {described}, files {} (read-only), {}; Ctrl-C or SIGTERM stops",
        worker.name(),
        args.concurrency.max(1),
        args.dir.display(),
        storage.described
    );
    // Ctrl-C, or SIGTERM from a service manager (`docker stop`, systemd, Kubernetes):
    // either stops the worker after the runs' current steps and puts them back in the
    // queue for another worker, rather than leaving them held until their lease ends.
    let mut term = crate::live::listen_for_term();
    let report = worker
        .run(async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = crate::live::terminated(&mut term) => {}
            }
        })
        .await;
    let report = report.context("the worker stopped")?;
    outln!(
        "stopped: {} run(s) claimed ({} of them taken over from workers that stopped renewing), {} done, {} failed, {} cancelled, {} put back in the queue, {} taken over by other workers",
        report.claimed,
        report.taken_over,
        report.done,
        report.failed,
        report.cancelled,
        report.released,
        report.superseded
    );
    Ok(ExitCode::SUCCESS)
}

/// What `keel worker` says when its claims fail (the database went away) and when they
/// work again: one line each, however many slots (and retries) there are.
fn claim_trouble(url: String) -> impl Fn(&ClaimTrouble<'_>) + Send + Sync + 'static {
    let failing = AtomicUsize::new(0);
    move |trouble| {
        let line = match trouble {
            ClaimTrouble::Failing { error, .. } => (failing.fetch_add(1, Ordering::SeqCst) == 0)
                .then(|| format!(
                    "cannot claim runs from the queue at {url}: {error}; retrying every few seconds (queued runs wait; held runs keep their lease only while renewals get through)"
                )),
            ClaimTrouble::Recovered { .. } => (failing.fetch_sub(1, Ordering::SeqCst) == 1)
                .then(|| format!("the queue at {url} answers again; claiming runs")),
            _ => None,
        };
        if let Some(line) = line {
            errln!("{line}");
        }
    }
}

/// The line `keel worker` prints as a run it claimed ends: done (the answer, or why
/// it stopped), failed (the error's first sentence, and what to fix when a model call
/// failed it), cancelled, put back in the queue, or taken over by another worker.
fn run_end_line(end: &RunEnd<'_>, fix: Option<&(ModelSpec, String)>) -> String {
    let what = match &end.outcome {
        RunOutcome::Done(run) => format!(
            "done{}",
            outcome(
                run.answer.as_deref(),
                run.stop.as_ref(),
                !run.interrupts.is_empty(),
                200
            )
        ),
        RunOutcome::Failed { error, agent } => {
            let error = cli_error(error, end.thread);
            let fix = agent
                .zip(fix)
                .and_then(|(agent, (spec, url))| model::what_to_fix_at(agent, spec, url));
            match fix {
                Some(fix) => format!("failed: {}; {fix}", first_sentence(&error)),
                None => format!("failed: {}", first_sentence(&error)),
            }
        }
        RunOutcome::Cancelled => "cancelled".to_owned(),
        RunOutcome::Released => {
            "put back in the queue; a worker continues it from its last checkpoint".to_owned()
        }
        RunOutcome::Superseded => "taken over by another worker".to_owned(),
        other => format!("{other:?}"),
    };
    format!("run {} (thread `{}`): {what}", end.run, end.thread)
}

/// The text up to the end of its first sentence (a period followed by a space).
fn first_sentence(text: &str) -> &str {
    match text.find(". ") {
        Some(end) => &text[..end],
        None => text.trim_end_matches('.'),
    }
}

/// A run's stored error as the command line words it: the agent library's advice for
/// a thread without a goal names its Rust API, so it is replaced by the command.
pub(crate) fn cli_error(error: &str, thread: &str) -> String {
    match error.find(" has no goal") {
        Some(at) => format!(
            "{} has no goal: start it with `keel submit --thread {thread} --goal \"...\"`, then send follow-ups with --message",
            &error[..at]
        ),
        None => error.to_owned(),
    }
}

/// The `scripted` model: after each user message (or the goal) it lists the root,
/// greps for TODO/FIXME lines, greps Markdown headings, and answers with what the
/// three calls returned. Deterministic: the reply is a function of the prompt.
fn scripted() -> PolicyModel {
    PolicyModel::new("scripted", |messages, _tools| {
        let since_user: Vec<&Message> = messages
            .iter()
            .rev()
            .take_while(|m| m.role != Role::User)
            .collect();
        let results: Vec<&Message> = since_user
            .iter()
            .rev()
            .filter(|m| m.role == Role::Tool)
            .copied()
            .collect();
        let call = |id: &str, name: &str, args: serde_json::Value, say: &str| {
            Message::assistant(say).with_tool_calls(vec![ToolCall::new(id, name, args)])
        };
        let step = messages.len();
        let reply = match results.len() {
            0 => call(
                &format!("ls-{step}"),
                "ls",
                json!({}),
                "Listing the directory.",
            ),
            1 => call(
                &format!("todo-{step}"),
                "grep",
                json!({"pattern": "(?i)\\b(todo|fixme)\\b", "max_results": 20}),
                "Looking for open TODO and FIXME notes.",
            ),
            2 => call(
                &format!("md-{step}"),
                "grep",
                json!({"pattern": "^#{1,3} ", "glob": "*.md", "max_results": 20}),
                "Reading the Markdown headings.",
            ),
            _ => {
                // `ls` lines, and grep's `path:line: text` matches.
                let lines = |m: &Message| m.text().lines().filter(|l| !l.trim().is_empty()).count();
                let matches = |m: &Message| {
                    m.text()
                        .lines()
                        .filter(|l| {
                            l.split(':')
                                .nth(1)
                                .is_some_and(|n| n.trim().parse::<u64>().is_ok())
                        })
                        .count()
                };
                Message::assistant(format!(
                    "Scripted survey: `ls` gave {} line(s); {} TODO/FIXME line(s) and {} Markdown heading(s) found.",
                    lines(results[0]),
                    matches(results[1]),
                    matches(results[2]),
                ))
            }
        };
        Ok(ChatResponse::new(reply, "scripted"))
    })
}

/// `keel status`
#[derive(Debug, Args)]
#[command(
    group(ArgGroup::new("which").required(true).args(["run", "thread"])),
    after_help = "\
Examples:
  keel status 0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10     one run: queued, running (by whom, lease), done, failed, cancelled
  keel status --thread ticket-42                       every run of a thread, oldest first
  keel status --thread ticket-42 --json"
)]
pub struct StatusArgs {
    /// The run id `keel submit` printed.
    #[arg(value_parser = parse_run_id)]
    run: Option<RunId>,
    /// Every run of this thread instead.
    #[arg(long, value_parser = crate::ui::thread_id)]
    thread: Option<String>,
    /// The Postgres URL of the fleet (default: DATABASE_URL, or `database_url` in
    /// keel.toml). TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long)]
    database_url: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `keel cancel`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel cancel 0193a5b2-7c1e-7d3a-9f00-5b8e2c4d6a10

A queued run is cancelled at once; a running one stops at its next step boundary and
its thread keeps the steps it made. A finished run is left as it is.")]
pub struct CancelArgs {
    /// The run id `keel submit` printed.
    #[arg(value_parser = parse_run_id)]
    run: RunId,
    /// The Postgres URL of the fleet (default: DATABASE_URL, or `database_url` in
    /// keel.toml). TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long)]
    database_url: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Opens the queue for an admin command; a database without the queue's tables is
/// a sentence, not a created schema.
async fn existing_queue(
    flag: Option<&str>,
    settings: &Settings,
    command: &str,
) -> anyhow::Result<(Queue, String)> {
    let url = database_url(flag, settings, command)?;
    let queue = queue(&url)?;
    match queue.check().await {
        Ok(()) => Ok((queue, url)),
        // Only a database without the tables is one `keel submit` would fix.
        Err(e @ FleetError::NotSetUp { .. }) => Err(e).with_context(|| {
            format!(
                "no run queue at {} yet: `keel submit` creates it",
                store::redact(&url)
            )
        }),
        Err(e @ (FleetError::Pool(_) | FleetError::Query(_))) => {
            let context = store::unreachable(&e, &url, "the fleet's database");
            Err(e).context(context)
        }
        Err(e) => Err(e)
            .with_context(|| format!("the run queue at {} cannot be used", store::redact(&url))),
    }
}

/// A run id the queue at `url` has no run of: where the right id is found.
fn unknown_run(run: RunId, url: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "no run {run} in the queue at {}: check the id (`keel submit` prints each run's id; `keel status --thread T` lists the runs of thread T with theirs), and that --database-url (or DATABASE_URL) names the fleet's database",
        store::redact(url)
    )
}

/// The fleet's queue in the database at `url`, if its tables are there (for `keel
/// threads` to show run status; any failure means no queue to show).
pub(crate) async fn queue_if_set_up(url: &str) -> Option<Queue> {
    let queue = queue(url).ok()?;
    queue.check().await.ok()?;
    Some(queue)
}

fn millis(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How a finished run ended, after the word "done": `: <answer>` (cut to `limit`
/// characters), `, stopped early: <why>`, `, waiting for an approval`, or nothing.
fn result_outcome(result: &keel_fleet::RunResult, limit: usize) -> String {
    outcome(
        result.answer.as_deref(),
        result.stop.as_ref(),
        result.interrupted,
        limit,
    )
}

/// [`result_outcome`] from its parts (an agent's run, or a stored result).
fn outcome(
    answer: Option<&str>,
    stop: Option<&keel::agent::Stop>,
    interrupted: bool,
    limit: usize,
) -> String {
    match (answer, stop, interrupted) {
        (Some(answer), _, _) => format!(": {}", answer.chars().take(limit).collect::<String>()),
        (None, Some(stop), _) => format!(", stopped early: {stop}"),
        (None, None, true) => ", waiting for an approval".to_owned(),
        (None, None, false) => String::new(),
    }
}

/// One run as a line of text and as JSON.
pub(crate) fn describe(info: &keel_fleet::RunInfo) -> (String, serde_json::Value) {
    let when = |t| format!("{} UTC", crate::threads::utc(millis(t)));
    let iso = |t| crate::threads::iso_utc(millis(t));
    let (what, extra) = match &info.status {
        RunStatus::Queued => ("queued".to_owned(), json!({})),
        RunStatus::Running {
            worker,
            since,
            lease_until,
            lease_expired,
            cancel_requested,
            ..
        } => (
            format!(
                "running on {worker} since {}; lease {} {}{}",
                when(*since),
                if *lease_expired {
                    "expired at"
                } else {
                    "until"
                },
                when(*lease_until),
                if *cancel_requested {
                    "; cancel requested"
                } else {
                    ""
                }
            ),
            json!({"worker": worker, "since": iso(*since), "lease_until": iso(*lease_until),
                   "lease_expired": lease_expired, "cancel_requested": cancel_requested}),
        ),
        RunStatus::Done {
            result,
            finished_at,
        } => (
            format!(
                "done at {}{}",
                when(*finished_at),
                result_outcome(result, 200)
            ),
            json!({"finished_at": iso(*finished_at), "answer": result.answer,
                       "stop": result.stop.as_ref().map(ToString::to_string), "interrupted": result.interrupted}),
        ),
        RunStatus::Failed { error, finished_at } => {
            let error = cli_error(error, &info.thread);
            (
                format!("failed at {}: {error}", when(*finished_at)),
                json!({"finished_at": iso(*finished_at), "error": error}),
            )
        }
        RunStatus::Cancelled {
            reason,
            finished_at,
        } => (
            format!(
                "cancelled at {}{}",
                when(*finished_at),
                reason
                    .as_ref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
            json!({"finished_at": iso(*finished_at), "reason": reason}),
        ),
        _ => (info.status.name().to_owned(), json!({})),
    };
    let line = format!(
        "run {} (thread `{}`, #{}, {} of {} claims): {what}",
        info.id, info.thread, info.seq, info.attempts, info.max_attempts
    );
    let mut value = json!({
        "run": info.id.to_string(), "thread": info.thread, "seq": info.seq,
        "status": info.status.name(), "policy": info.policy.as_str(),
        "attempts": info.attempts, "max_attempts": info.max_attempts,
        "submitted_at": iso(info.submitted_at),
    });
    if let (Some(v), Some(extra)) = (value.as_object_mut(), extra.as_object()) {
        v.extend(extra.clone());
    }
    (line, value)
}

/// A run id on the command line (clap makes a bad one a usage error, exit code 2).
fn parse_run_id(text: &str) -> Result<RunId, String> {
    text.parse::<RunId>().map_err(|_| {
        "it is not a run id (a UUID such as 0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80): give the id `keel submit` printed, or list a thread's runs with `keel status --thread T`".to_owned()
    })
}

/// Runs `keel status`.
pub async fn status(args: StatusArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let run = args.run;
    let (queue, url) = existing_queue(args.database_url.as_deref(), settings, "status").await?;
    let infos = match (run, &args.thread) {
        (Some(run), _) => match queue.status(run).await {
            Ok(info) => vec![info],
            Err(FleetError::UnknownRun { .. }) => return Err(unknown_run(run, &url)),
            Err(e) => return Err(e).context("cannot read the run"),
        },
        (None, Some(thread)) => {
            let runs = queue
                .runs(thread)
                .await
                .with_context(|| format!("cannot list the runs of thread `{thread}`"))?;
            if runs.is_empty() && !args.json {
                outln!("thread `{thread}` has no runs in the queue");
            }
            runs
        }
        (None, None) => bail!("give a run id, or --thread T"),
    };
    let described: Vec<_> = infos.iter().map(describe).collect();
    if args.json {
        let values: Vec<_> = described.into_iter().map(|(_, v)| v).collect();
        let out = if run.is_some() {
            values.into_iter().next().unwrap_or_default()
        } else {
            serde_json::Value::Array(values)
        };
        outln!("{out}");
    } else {
        for (line, _) in described {
            outln!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `keel cancel`.
pub async fn cancel(args: CancelArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let run = args.run;
    let (queue, url) = existing_queue(args.database_url.as_deref(), settings, "cancel").await?;
    let info = match queue.cancel(run).await {
        Ok(info) => info,
        Err(FleetError::UnknownRun { .. }) => return Err(unknown_run(run, &url)),
        Err(e) => return Err(e).context("cannot cancel the run"),
    };
    let (line, value) = describe(&info);
    if args.json {
        outln!("{value}");
    } else {
        outln!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}
