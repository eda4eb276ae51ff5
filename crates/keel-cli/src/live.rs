//! `keel run`: the compacting agent against a real model server.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use futures::StreamExt;
use keel::agent::tools::{BRIEF_SPECS_BELOW, FileTools};
use keel::agent::{
    Agent, AgentError, AgentEvent, AgentInput, AgentUpdate, BuildError, Stop, StopSignal,
};
use keel::compaction::{CompactionConfig, GoalAnchor};
use keel::message::{Message, Role};
use keel::offload::EvictLargeResults;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::config::Settings;
use crate::model::{self, LIVE_SYSTEM, LiveArgs, ModelSpec};
use crate::store;
use crate::ui::{count, exit, thousands};
use crate::{errln, out, outln};

/// `keel run`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel run --model ollama/qwen2.5:0.5b --goal \"Summarize what this repository does\"
  OPENAI_BASE_URL=http://127.0.0.1:8080/v1 keel run --model openai/local --goal \"...\" --dir ../project --window 8192
  keel run --thread run-0193a5b2-...                 continue a thread with the settings it ran with
  keel run --thread run-0193a5b2-... --message \"Now list the tests\"
  keel run --model ollama/qwen2.5:7b --goal \"Fix the typo in README.md\" --approve

Ctrl-C stops after the current step; `--thread T` resumes the thread where it stopped,
with the model, server address, --dir, --window, --max-tokens, --timeout and
--summarizer it ran with (flags given again override them, and so does a base URL set
in the environment or keel.toml; the API key is never stored).
Servers: OLLAMA_BASE_URL (default http://127.0.0.1:11434), OPENAI_BASE_URL and
OPENAI_API_KEY. Threads live in --home (SQLite) or --database-url / DATABASE_URL.")]
pub struct RunArgs {
    /// `ollama/<name>` or `openai/<name>` (default: the thread's model, KEEL_MODEL, or
    /// `model` in keel.toml).
    #[arg(long, value_parser = crate::model::model_flag)]
    model: Option<String>,
    /// The goal of a new thread (never compacted; heads every prompt).
    #[arg(long, value_parser = crate::ui::some_text)]
    goal: Option<String>,
    /// A follow-up message to a thread.
    #[arg(long, value_parser = crate::ui::some_text)]
    message: Option<String>,
    /// The directory the file tools are rooted at (default: the thread's, else `.`).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The thread id (default: a new `run-<uuid>` thread).
    #[arg(long, value_parser = crate::ui::thread_id)]
    thread: Option<String>,
    /// The home directory of the embedded SQLite file and offload store (given, it wins
    /// over DATABASE_URL and `database_url` in keel.toml).
    #[arg(long)]
    home: Option<PathBuf>,
    /// A Postgres URL for checkpoints and the archive. TLS as with psql:
    /// `?sslmode=require`, `verify-full`, `sslrootcert=`.
    #[arg(long)]
    database_url: Option<String>,
    /// Enable `write_file` and `edit_file`, each call approved at the terminal.
    #[arg(long)]
    approve: bool,
    #[command(flatten)]
    live: LiveArgs,
    /// `extractive` (no model) or a model for summaries (default: the thread's, else
    /// extractive).
    #[arg(long, value_parser = crate::model::summarizer_flag)]
    summarizer: Option<String>,
    /// Model calls at most in this run; the thread then stops resumably.
    #[arg(long, value_name = "CALLS", default_value_t = 100, value_parser = crate::ui::at_least_one::<u64>)]
    max_steps: u64,
}

/// The checkpoint metadata key under which `keel run` keeps what a thread ran with.
const RUN_METADATA: &str = "keel_run";

/// What a thread ran with, stored in its checkpoints' metadata so `--thread T` alone
/// resumes it the same way. Every field is optional: threads saved by older versions
/// have only the first three. Never the API key.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Saved {
    model: Option<String>,
    dir: Option<PathBuf>,
    window: Option<usize>,
    /// The model server's base URL (OpenAI-compatible or Ollama, as `model` says).
    base_url: Option<String>,
    max_tokens: Option<u32>,
    timeout: Option<u64>,
    summarizer: Option<String>,
}

/// Runs `keel run`.
pub async fn run(args: RunArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    const NEEDS_MODEL: &str =
        "`keel run` needs a model: --model ollama/<name> or --model openai/<name> (or KEEL_MODEL)";
    // What can be checked without the database is checked before it is created, and
    // refused as bad usage (exit code 2).
    let usage = || -> anyhow::Result<()> {
        if let Some(m) = &args.model {
            ModelSpec::parse(m)?;
        }
        // A new thread's window is checked with its fixed prompt below, which names
        // the one least window that fits it.
        if let (Some(w), None) = (args.live.window, &args.goal) {
            model::check_least_window(w)?;
        }
        if args.thread.is_none() {
            if args.model.is_none() && settings.model(None).is_none() {
                bail!(NEEDS_MODEL);
            }
            if args.goal.is_none() {
                bail!("a new thread needs a --goal (or give --thread T to continue one)");
            }
        }
        Ok(())
    };
    if let Err(e) = usage() {
        return Ok(crate::ui::usage_error(&e));
    }
    let home = settings.home(args.home.as_deref());
    let url = settings.store_url(args.database_url.as_deref(), args.home.as_deref());
    // Only a run that may start a thread creates the embedded file, and only once the
    // run is known to fit its window: a database that already exists is opened now to
    // read the thread's settings.
    let creates = args.thread.is_none() || args.goal.is_some();
    let opened = if url.is_some() || !creates || store::sqlite_path(&home).exists() {
        Some(store::open(&home, url.as_deref(), creates).await?)
    } else {
        None
    };

    let thread = args
        .thread
        .clone()
        .unwrap_or_else(|| store::new_thread_id("run"));
    let saved = match &opened {
        Some(storage) => saved_settings(&*storage.saver, &thread).await?,
        None => None,
    };
    if saved.is_none() && args.goal.is_none() {
        bail!(
            "there is no thread `{thread}` ({}): `{}` lists the threads there; give --goal to start a new thread",
            opened.as_ref().map_or_else(
                || format!("SQLite file {}", store::sqlite_path(&home).display()),
                |s| s.described.clone()
            ),
            threads_list_hint(&args)
        );
    }
    let spec = args
        .model
        .clone()
        .or_else(|| saved.as_ref().and_then(|s| s.model.clone()))
        .or_else(|| settings.model(None))
        .context(NEEDS_MODEL)?;
    let spec = ModelSpec::parse(&spec)?;
    // The server the thread ran with, unless the environment or keel.toml names one:
    // a local thread's content must not go to the provider's default server.
    let saved_url = saved
        .as_ref()
        .filter(|s| {
            s.model
                .as_deref()
                .and_then(|m| ModelSpec::parse(m).ok())
                .is_some_and(|m| m.same_provider(&spec))
        })
        .and_then(|s| s.base_url.clone());
    let resolved;
    let settings = match (spec.explicit_base_url(settings), saved_url) {
        (None, Some(url)) => {
            resolved = spec.with_base_url(settings, url);
            &resolved
        }
        (Some(given), Some(url)) if given.trim_end_matches('/') != url.trim_end_matches('/') => {
            errln!(
                "note: thread `{thread}` ran with the server at {url}; this run uses {given}, as the environment or keel.toml says"
            );
            settings
        }
        _ => settings,
    };
    let dir = args
        .dir
        .clone()
        .or_else(|| saved.as_ref().and_then(|s| s.dir.clone()))
        .unwrap_or_else(|| PathBuf::from("."));
    let dir = std::fs::canonicalize(&dir).with_context(|| {
        format!(
            "the file tools' directory {} does not exist (give --dir)",
            dir.display()
        )
    })?;
    if args.dir.is_none() && saved.as_ref().is_some_and(|s| s.dir.is_none()) {
        // A thread another command started (`keel demo`) saved no directory.
        errln!(
            "note: thread `{thread}` saved no directory (keel run did not start it); the file tools use {}: give --dir to choose",
            dir.display()
        );
    }
    let asked = args
        .live
        .window(settings, saved.as_ref().and_then(|s| s.window))?;
    if let (Some(w), Some(_)) = (asked, &saved)
        && let Err(e) = model::check_least_window(w)
    {
        return Ok(crate::ui::usage_error(&e));
    }
    // Under keel's least, a new thread is refused below, with the least window its
    // fixed prompt fits in.
    let window = asked.map(|w| w.max(model::MIN_WINDOW));
    let live_args = LiveArgs {
        window: args.live.window,
        max_tokens: args
            .live
            .max_tokens
            .or_else(|| saved.as_ref().and_then(|s| s.max_tokens)),
        timeout: args
            .live
            .timeout
            .or_else(|| saved.as_ref().and_then(|s| s.timeout)),
    };
    let summarizer = args
        .summarizer
        .clone()
        .or_else(|| saved.as_ref().and_then(|s| s.summarizer.clone()))
        .unwrap_or_else(|| "extractive".to_owned());
    let live = live_args.connect(&spec, window, settings)?;
    let counter = model::counter(&live.profile)?;

    let mut tools = FileTools::new(&dir)
        .with_context(|| format!("cannot root the file tools at {}", dir.display()))?;
    if !args.approve {
        tools = tools.read_only();
    }
    let builder = || {
        let mut builder = Agent::builder()
            .model(live.client.clone())
            .options(live.options.clone())
            .profile(live.profile.clone())
            .counter(counter.clone())
            // A model keel has no tokenizer for: its estimates follow the server's
            // counts (AgentBuilder::calibrate).
            .calibrate(!live.profile.counts_exactly())
            .system(LIVE_SYSTEM)
            .file_tools(tools.clone())
            .evict(Some(EvictLargeResults::new()))
            // --max-steps is each run's budget (AgentInput::max_steps), not a ceiling
            // on the thread.
            .compaction(CompactionConfig::default().with_max_steps(u64::MAX));
        if args.approve {
            builder = builder.approve(["write_file", "edit_file"]);
        }
        builder
    };
    if let (None, Some(goal)) = (&saved, &args.goal) {
        // A new thread: its system prompt, goal and tool specs head every prompt and
        // are never compacted. Refused before anything is written.
        let fixed = model::fixed_part(counter.clone(), LIVE_SYSTEM, goal, &tools);
        let goal = GoalAnchor::new(goal.as_str());
        let planned = match asked {
            Some(w) if w < model::MIN_WINDOW => model::with_window(&live.profile, spec.name(), w),
            _ => live.profile.clone(),
        };
        // Advice about the goal only when a short goal would fit.
        let goal_tokens = counter.count_message(goal.message());
        let what = format!(
            "the goal ({}), system prompt and tool specs take",
            crate::ui::count(goal_tokens as u64, "token")
        );
        let here = fixed(planned.input_budget() < BRIEF_SPECS_BELOW);
        let advice = if here.saturating_sub(goal_tokens) <= planned.input_budget() / 2 {
            "put the long material in a file under --dir and make the goal say where it is, or "
        } else {
            ""
        };
        if let Err(e) = model::check_fixed_part_fits(&what, &fixed, 2, &planned, advice) {
            return Ok(crate::ui::usage_error(&e));
        }
    }
    let storage = match opened {
        Some(storage) => storage,
        None => store::open(&home, url.as_deref(), true).await?,
    };
    let offload = store::offload_for(&home, url.as_deref(), true)?
        .context("no offload store could be opened")?;
    let agent = builder()
        .summarizer(model::summarizer(
            &summarizer,
            settings,
            live.http.clone(),
            Some(model::RunModel {
                spec: &spec,
                given: window,
                planned: live.profile.context_window,
            }),
        )?)
        .checkpointer(storage.saver.clone())
        .offload_store(offload.clone())
        .build();
    let agent = match agent {
        // A thread resumed with a window its system prompt and tool specs alone
        // overfill (its goal comes on top).
        Err(e @ BuildError::PromptTooLarge { tokens, .. }) => {
            let least = thousands(model::smallest_window(tokens, 1) as u64);
            let resume = resume_hint(&args, &thread);
            return Err(anyhow::Error::new(e).context(format!(
                "thread `{thread}` cannot run with this window: give a --window over {least}, e.g. {resume} --window N"
            )));
        }
        built => built.context("cannot build the agent")?,
    };
    let existing = agent
        .state(&thread)
        .await
        .with_context(|| format!("cannot read thread `{thread}`"))?;
    let start = existing.as_ref().map_or(0, |s| s.step);
    let mut input = AgentInput::new().max_steps(args.max_steps);
    match (&existing, &args.goal) {
        (None, None) => bail!("thread `{thread}` is new: give it a --goal"),
        (Some(_), Some(_)) => bail!(
            "thread `{thread}` already has a goal (a goal is written once); continue it without --goal, or add --message \"...\""
        ),
        (None, Some(goal)) => input = input.goal(goal.clone()),
        (Some(_), None) => {}
    }
    if let Some(m) = &args.message {
        input = input.message(Message::user(m.clone()));
    }
    let saved = Saved {
        model: Some(spec.to_string()),
        dir: Some(dir.clone()),
        window,
        base_url: Some(without_credentials(spec.base_url(settings))),
        max_tokens: live_args.max_tokens,
        timeout: Some(live_args.timeout.unwrap_or(model::DEFAULT_TIMEOUT_SECS)),
        summarizer: Some(summarizer.clone()),
    };
    outln!(
        "model: {spec} at {}",
        keel::model::redact_url(&spec.base_url(settings))
    );
    outln!(
        "thread: {thread} ({}); files: {}",
        storage.described,
        dir.display()
    );
    if let Some(s) = &existing {
        outln!(
            "continuing after {}; at most {} more in this run",
            count(s.step, "model call"),
            args.max_steps
        );
    }
    let resume = resume_hint(&args, &thread);
    let metadata = serde_json::to_value(&saved).context("cannot encode the run's settings")?;

    input = input.metadata(RUN_METADATA, metadata.clone());
    loop {
        let (stopped, interrupts) = drive(
            &agent,
            &thread,
            &resume,
            input,
            (&spec, settings),
            live.options.max_tokens,
        )
        .await?;
        if let Some(signal) = stopped {
            outln!("\nstopped after the current step. Resume with: {resume}");
            return Ok(ExitCode::from(signal.exit_code()));
        }
        let Some(question) = interrupts else {
            break;
        };
        let answer = ask(&question).await?;
        // The resumed run spends what is left of this run's budget.
        let now = agent.state(&thread).await?.map_or(start, |s| s.step);
        // Every checkpoint carries the settings, those written after the answer too:
        // `--thread T` alone resumes from whichever is newest.
        input = AgentInput::new()
            .resume(answer)
            .max_steps(args.max_steps.saturating_sub(now.saturating_sub(start)))
            .metadata(RUN_METADATA, metadata.clone());
    }
    let state = agent
        .state(&thread)
        .await?
        .context("the thread has no state")?;
    if let Some(stop) = &state.stop {
        let why = match stop {
            // The agent counts the run after the last approval; this command's budget
            // spans every answer given in it.
            Stop::RunBudget { .. } => format!(
                "this run's budget of {} was used ({} made)",
                count(args.max_steps, "model call"),
                state.step.saturating_sub(start)
            ),
            other => other.to_string(),
        };
        outln!("\nthe run stopped early: {why}. Continue with: {resume}");
    }
    // A script tells a stop before the answer from an answer.
    let code = if state.stop.is_some() {
        ExitCode::from(exit::STOPPED)
    } else {
        ExitCode::SUCCESS
    };
    outln!(
        "\nanswer:\n{}",
        state.answer().unwrap_or_else(|| "(none)".into())
    );
    outln!(
        "\n{}, {}, {}; thread {thread}",
        count(state.step, "model call"),
        count(state.milestones_made, "milestone"),
        count(state.epochs_made, "epoch")
    );
    if let Some(factor) = agent.count_factor().filter(|f| (f - 1.0).abs() >= 0.05) {
        outln!(
            "(keel has no tokenizer for {spec}: it planned with its token estimates scaled by {factor:.2}, learned from the prompt sizes the server reported)"
        );
    }
    Ok(code)
}

/// What the thread ran with: the settings of its newest checkpoint that has them
/// (checkpoints written by other programs, or by older versions of `keel run` after an
/// approval, have none). `None` when the thread has no checkpoint at all.
async fn saved_settings(
    saver: &dyn keel::checkpoint::Checkpointer,
    thread: &str,
) -> anyhow::Result<Option<Saved>> {
    let key = keel::checkpoint::ThreadKey::new(thread.to_owned());
    let mut newest_first = saver.list(&key, keel::checkpoint::ListOptions::default());
    let mut exists = false;
    while let Some(item) = newest_first.next().await {
        let summary = item.with_context(|| format!("cannot read thread `{thread}`"))?;
        exists = true;
        if let Some(saved) = summary
            .metadata
            .extra
            .get(RUN_METADATA)
            .and_then(|v| serde_json::from_value(v.clone()).ok())
        {
            return Ok(Some(saved));
        }
    }
    Ok(exists.then(Saved::default))
}

/// What `keel run` last ran `thread` with, for `keel threads`: a line for people
/// (`None` when nothing was saved: a thread of the demo, the fleet or another program)
/// and the same as JSON (`null` then). Never the API key; the URL without credentials.
pub async fn ran_with(
    saver: &dyn keel::checkpoint::Checkpointer,
    thread: &str,
) -> anyhow::Result<(Option<String>, serde_json::Value)> {
    let Some(saved) = saved_settings(saver, thread).await? else {
        return Ok((None, serde_json::Value::Null));
    };
    let Some(model) = &saved.model else {
        return Ok((None, serde_json::Value::Null));
    };
    let mut line = format!("ran with {model}");
    if let Some(url) = &saved.base_url {
        line.push_str(&format!(" at {url}"));
    }
    if let Some(window) = saved.window {
        line.push_str(&format!(
            ", a window of {} tokens",
            crate::ui::thousands(window as u64)
        ));
    }
    if let Some(summarizer) = &saved.summarizer {
        line.push_str(&format!(", summaries by {summarizer}"));
    }
    if let Some(dir) = &saved.dir {
        line.push_str(&format!(", tools in {}", dir.display()));
    }
    Ok((Some(line), serde_json::to_value(&saved)?))
}

/// The model `keel run` last ran `thread` with (`provider/name`), if it saved one.
pub async fn saved_model(
    saver: &dyn keel::checkpoint::Checkpointer,
    thread: &str,
) -> anyhow::Result<Option<String>> {
    Ok(saved_settings(saver, thread).await?.and_then(|s| s.model))
}

/// The command that lists the threads where this run looked.
fn threads_list_hint(args: &RunArgs) -> String {
    let mut hint = "keel threads list".to_owned();
    if let Some(home) = &args.home {
        hint.push_str(&format!(" --home {}", home.display()));
    }
    if let Some(url) = &args.database_url {
        hint.push_str(&format!(" --database-url {}", store::redact(url)));
    }
    hint
}

/// The command that continues `thread`: the thread's own settings come back from its
/// metadata, so only where it is stored needs repeating.
fn resume_hint(args: &RunArgs, thread: &str) -> String {
    let mut hint = format!("keel run --thread {thread}");
    if let Some(home) = &args.home {
        hint.push_str(&format!(" --home {}", home.display()));
    }
    if let Some(url) = &args.database_url {
        hint.push_str(&format!(" --database-url {}", store::redact(url)));
    }
    if args.approve {
        hint.push_str(" --approve");
    }
    hint
}

/// A signal that stops a run after its current step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    /// Ctrl-C (SIGINT).
    CtrlC,
    /// SIGTERM (unix).
    Term,
}

impl Signal {
    fn exit_code(self) -> u8 {
        match self {
            Self::CtrlC => exit::INTERRUPTED,
            Self::Term => exit::TERMINATED,
        }
    }
}

#[cfg(unix)]
pub(crate) type TermListener = tokio::signal::unix::Signal;
#[cfg(not(unix))]
pub(crate) type TermListener = ();

/// A listener for SIGTERM (none where there is no such signal, or it cannot be had).
pub(crate) fn listen_for_term() -> Option<TermListener> {
    #[cfg(unix)]
    {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok()
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Completes at the next SIGTERM; never without a listener.
pub(crate) async fn terminated(listener: &mut Option<TermListener>) {
    #[cfg(unix)]
    if let Some(l) = listener
        && l.recv().await.is_some()
    {
        return;
    }
    #[cfg(not(unix))]
    let _ = listener;
    std::future::pending::<()>().await;
}

/// Streams one run. Returns the signal that stopped it after a step (none when the
/// run ended on its own, an answer given while stopping included), and the pending
/// approval question, if any.
async fn drive(
    agent: &Agent,
    thread: &str,
    resume: &str,
    input: AgentInput,
    (spec, settings): (&ModelSpec, &Settings),
    cap: Option<u32>,
) -> anyhow::Result<(Option<Signal>, Option<Value>)> {
    // A signal raises it: the run ends once the step in flight is stored.
    let stop = StopSignal::new();
    let mut updates = agent.stream(thread, input.stop_signal(stop.clone()));
    let mut stopping = None;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut term = listen_for_term();
    loop {
        let signal = tokio::select! {
            u = updates.next() => Err(u),
            _ = &mut ctrl_c, if stopping.is_none() => Ok(Signal::CtrlC),
            () = terminated(&mut term), if stopping.is_none() => Ok(Signal::Term),
        };
        let update = match signal {
            Ok(signal) => {
                stopping = Some(signal);
                stop.raise();
                match signal {
                    Signal::CtrlC => errln!(
                        "\nCtrl-C: stopping after the current step (Ctrl-C again to quit at once)"
                    ),
                    Signal::Term => errln!(
                        "\nSIGTERM: stopping after the current step (a second SIGTERM or Ctrl-C quits at once)"
                    ),
                }
                tokio::spawn(async {
                    let mut term = listen_for_term();
                    let code = tokio::select! {
                        r = tokio::signal::ctrl_c() => {
                            if r.is_err() {
                                return;
                            }
                            exit::INTERRUPTED
                        }
                        () = terminated(&mut term) => exit::TERMINATED,
                    };
                    std::process::exit(i32::from(code));
                });
                continue;
            }
            Err(update) => update,
        };
        let Some(update) = update else {
            return Ok((None, None));
        };
        let update = match update {
            Ok(u) => u,
            Err(e) => return Err(failed(agent, thread, resume, e, (spec, settings)).await),
        };
        print_update(&update, cap);
        if let AgentUpdate::Done {
            interrupts, stop, ..
        } = update
        {
            // A run that ended anyway (its answer, a question) is reported as such.
            let stopped = stopping.filter(|_| stop == Some(Stop::Requested));
            return Ok((stopped, interrupts.first().map(|i| i.value.clone())));
        }
    }
}

/// The error of a failed run: what to fix, and how to resume the thread when it has a
/// checkpoint to resume from (a run refused before its first step left none).
async fn failed(
    agent: &Agent,
    thread: &str,
    resume: &str,
    error: AgentError,
    (spec, settings): (&ModelSpec, &Settings),
) -> anyhow::Error {
    if let AgentError::ApprovalNotAsked { tools, .. } = &error {
        // Paused for an approval of a write tool, resumed without --approve.
        let message = format!(
            "thread `{thread}` waits for your approval of {}: nothing ran; resume it with --approve to be asked: {resume} --approve",
            tools.join(", ")
        );
        return anyhow::Error::new(error).context(message);
    }
    if let AgentError::PromptTooLarge { tokens, .. } = &error {
        // The thread ran with a larger window than this run gives it.
        let least = model::smallest_window(*tokens, 1);
        let message = format!(
            "thread `{thread}` cannot run with this window: give --window {least} or more, e.g. {resume} --window {least}"
        );
        return anyhow::Error::new(error).context(message);
    }
    let state = agent.state(thread).await.ok().flatten();
    let resumable = state.is_some();
    let fix = model::what_to_fix(&error, spec, settings);
    if let (Some(server), Some(fix)) = (model::context_overflow(&error), &fix) {
        // Resuming as it ran would overflow the server again: resume with a smaller
        // window, unless the part of the prompt that is never compacted (system
        // prompt, goal, tool specs) needs more than the server holds.
        let least = state.as_ref().map(|s| {
            model::smallest_window(agent.fixed_prompt_tokens(s.goal(), s.system.as_ref()), 1)
        });
        if let (Some(server), Some(least)) = (server, least)
            && least > server
        {
            let message = format!(
                "the run of thread `{thread}` failed: the server holds {} tokens, and the thread's system prompt, goal and tool specs, which are never compacted, need a window of at least {}. The thread cannot run on this server: give the server a larger context (llama.cpp's --ctx-size, llama-cpp-python's --n_ctx, Ollama's num_ctx), then resume with {resume} --window {}; or start a new thread with a shorter --goal",
                thousands(server as u64),
                thousands(least as u64),
                least
            );
            return anyhow::Error::new(error).context(message);
        }
        let window = server.map_or_else(|| "N".to_owned(), |n| n.to_string());
        let message = if resumable {
            format!(
                "the run of thread `{thread}` failed: {fix}. It resumes from its last checkpoint with a window the server holds: {resume} --window {window}"
            )
        } else {
            format!(
                "the run of thread `{thread}` failed before its first checkpoint: {fix}, then run the command again with that --window"
            )
        };
        return anyhow::Error::new(error).context(message);
    }
    let message = match (fix, resumable) {
        (Some(fix), true) => format!(
            "the run of thread `{thread}` failed: {fix}. It resumes from its last checkpoint with: {resume}"
        ),
        (None, true) => format!(
            "the run of thread `{thread}` failed; it resumes from its last checkpoint with: {resume}"
        ),
        (Some(fix), false) => format!(
            "the run of thread `{thread}` failed before its first checkpoint, so there is nothing to resume: {fix}, then run the command again"
        ),
        (None, false) => format!(
            "the run of thread `{thread}` failed before its first checkpoint, so there is nothing to resume: run the command again once the cause below is fixed"
        ),
    };
    anyhow::Error::new(error).context(message)
}

/// Once per process, when a server counted a prompt at a third of keel's count or
/// less: servers that do not pass tools to the model (llama-cpp-python without a chat
/// format that takes them) drop the specs from the prompt, and the model answers
/// without ever calling a tool; llama-cpp-python's `chatml-function-calling` drops the
/// tool results instead (a trial saw its count unchanged whatever a result held).
fn tools_dropped_note(event: &AgentEvent) -> Option<String> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let AgentEvent::ModelCall {
        step,
        prompt_tokens,
        provider_prompt_tokens: Some(server),
        ..
    } = event
    else {
        return None;
    };
    if *prompt_tokens < 300 || server.saturating_mul(3) > *prompt_tokens {
        return None;
    }
    if SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    Some(format!(
        "note: at step {step} the server counted {} prompt tokens where keel counted {}: it may have left part of the prompt out: the tool specs (then the model cannot call a tool) or the tool results (then it never sees what its calls returned). llama-cpp-python passes tools only with --chat_format chatml-function-calling, and that format leaves tool results out; llama.cpp's server with --jinja passes both (see the README's table of servers)",
        thousands(*server),
        thousands(*prompt_tokens)
    ))
}

/// Once per process, when the server wrote more tokens than the reply cap it was
/// sent: it ignores `max_tokens` (llama-cpp-python's chatml-function-calling format
/// was seen to), so a smaller `--max-tokens` cannot shorten its calls.
fn over_cap_note(event: &AgentEvent, cap: Option<u32>) -> Option<String> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let (
        AgentEvent::ModelCall {
            completion_tokens: Some(wrote),
            ..
        },
        Some(cap),
    ) = (event, cap)
    else {
        return None;
    };
    if *wrote <= u64::from(cap) || SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    Some(format!(
        "note: the server wrote {} tokens, over the {} --max-tokens asks for: it ignores the cap, so its replies can take longer than --max-tokens suggests (give a larger --timeout, or a server that keeps to max_tokens)",
        thousands(*wrote),
        thousands(u64::from(cap))
    ))
}

/// The step line of a model call (`None` for other events).
fn model_call_line(event: &AgentEvent) -> Option<String> {
    let AgentEvent::ModelCall {
        step,
        prompt_tokens,
        completion_tokens,
        provider_prompt_tokens,
        cached_tokens,
        duration_ms,
        cut_off,
        overflow_retries,
        retries,
        ..
    } = event
    else {
        return None;
    };
    // keel's count, and the server's when it reports one that differs.
    let server = provider_prompt_tokens
        .filter(|p| p != prompt_tokens)
        .map(|p| format!(" (server: {})", thousands(p)))
        .unwrap_or_default();
    let cached = cached_tokens
        .map(|c| format!(", {} cached", thousands(c)))
        .unwrap_or_default();
    let mut retried = String::new();
    if *retries > 0 {
        retried += &format!(
            ", after {} retried (rate limit or server error; the time includes the waits)",
            crate::ui::count(u64::from(*retries), "attempt")
        );
    }
    if *overflow_retries > 0 {
        retried += &format!(
            ", after {} the server refused as over its context",
            crate::ui::count(u64::from(*overflow_retries), "prompt")
        );
    }
    let out_tokens = completion_tokens
        .map(|c| format!(" -> {} out", thousands(c)))
        .unwrap_or_default();
    let cut = if *cut_off {
        " (stopped at --max-tokens: the reply may be cut off; raise it and send a message to go on)"
    } else {
        ""
    };
    Some(format!(
        "step {step:>3}  model: {} prompt tokens{server}{cached}{out_tokens}, {duration_ms} ms{retried}{cut}",
        thousands(*prompt_tokens)
    ))
}

fn print_update(update: &AgentUpdate, cap: Option<u32>) {
    if let AgentUpdate::Event(event) = update
        && let Some(line) = model_call_line(event)
    {
        outln!("{line}");
        for note in [tools_dropped_note(event), over_cap_note(event, cap)]
            .into_iter()
            .flatten()
        {
            errln!("{note}");
        }
        return;
    }
    match update {
        AgentUpdate::Event(AgentEvent::CallsRefused { calls, max, .. }) => outln!(
            "          {} refused: at most {max} a reply, none was run",
            crate::ui::count(*calls as u64, "tool call")
        ),
        // What keel told the model (an empty reply, too many calls).
        AgentUpdate::Message(m)
            if m.role == Role::User && m.metadata.contains_key(keel::agent::NUDGE_METADATA_KEY) =>
        {
            outln!("          keel to the model: {}", m.text().trim());
        }
        AgentUpdate::Event(AgentEvent::ToolCall {
            name,
            error,
            result_chars,
            ..
        }) => match error {
            None => outln!(
                "          {name}: {} chars",
                thousands(*result_chars as u64)
            ),
            Some(e) => outln!("          {name} failed: {e}"),
        },
        AgentUpdate::Event(AgentEvent::Offload { path, tokens, .. }) => {
            outln!(
                "          offloaded a {}-token result to {path}",
                thousands(*tokens)
            );
        }
        AgentUpdate::Event(AgentEvent::Compaction(e)) => outln!(
            "          {}{}",
            crate::ui::compaction(e),
            e.error
                .as_ref()
                .map(|x| format!(" (failed: {x})"))
                .unwrap_or_default()
        ),
        AgentUpdate::Message(m) if m.role == Role::Assistant => {
            let text = m.text();
            if !text.trim().is_empty() && !m.tool_calls.is_empty() {
                outln!(
                    "          says: {}",
                    text.trim().chars().take(200).collect::<String>()
                );
            }
            for c in &m.tool_calls {
                outln!(
                    "          -> {}({})",
                    c.name,
                    c.arguments
                        .to_json_string()
                        .chars()
                        .take(200)
                        .collect::<String>()
                );
            }
        }
        _ => {}
    }
}

/// Asks at the terminal about each call awaiting approval; EOF denies.
async fn ask(question: &Value) -> anyhow::Result<Value> {
    let calls = question["approve"].as_array().cloned().unwrap_or_default();
    let mut answers = serde_json::Map::new();
    for call in calls {
        let id = call["id"].as_str().unwrap_or_default().to_owned();
        let name = call["name"].as_str().unwrap_or_default();
        let arguments = call["arguments"].as_str().unwrap_or_default();
        out!("\napprove {name}({arguments})? [y/N] ");
        let line = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        })
        .await
        .context("the terminal prompt failed")?
        .context("cannot read the answer from standard input")?;
        let yes = matches!(line.trim().to_ascii_lowercase().as_str(), "y" | "yes");
        outln!("{}", if yes { "approved" } else { "denied" });
        answers.insert(id, json!(yes));
    }
    Ok(Value::Object(answers))
}

/// `url` without a user name or password written into it: they are as secret as the
/// API key, which is never stored either.
fn without_credentials(url: String) -> String {
    match keel::model::reqwest::Url::parse(&url) {
        Ok(mut parsed) if !parsed.username().is_empty() || parsed.password().is_some() => {
            // Both succeed on a URL with a host, as one with credentials has.
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.to_string()
        }
        _ => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_call(extra: serde_json::Value) -> AgentEvent {
        let mut event = json!({
            "event": "model_call", "step": 7, "model": "m", "prompt_tokens": 1234,
            "provider_prompt_tokens": null, "completion_tokens": 56, "cached_tokens": null,
            "tool_calls": 1, "duration_ms": 80, "overflow_retries": 0
        });
        for (k, v) in extra.as_object().unwrap() {
            event[k] = v.clone();
        }
        serde_json::from_value(event).unwrap()
    }

    #[test]
    fn the_step_line_says_what_the_server_saw_and_refused() {
        let plain = model_call_line(&model_call(json!({}))).unwrap();
        assert_eq!(
            plain,
            "step   7  model: 1,234 prompt tokens -> 56 out, 80 ms"
        );
        // The server's own count only when it differs from keel's.
        let same = model_call_line(&model_call(json!({"provider_prompt_tokens": 1234})));
        assert_eq!(same.unwrap(), plain);
        let line = model_call_line(&model_call(json!({
            "provider_prompt_tokens": 1300, "cached_tokens": 1024,
            "overflow_retries": 2, "cut_off": true
        })))
        .unwrap();
        assert_eq!(
            line,
            "step   7  model: 1,234 prompt tokens (server: 1,300), 1,024 cached -> 56 out, 80 ms, \
             after 2 prompts the server refused as over its context \
             (stopped at --max-tokens: the reply may be cut off; raise it and send a message to go on)"
        );
        // Retried attempts (events written before they were counted have none).
        let retried = model_call_line(&model_call(json!({"retries": 3}))).unwrap();
        assert!(
            retried.ends_with(", after 3 attempts retried (rate limit or server error; the time includes the waits)"),
            "{retried}"
        );
        let one = model_call_line(&model_call(json!({"overflow_retries": 1}))).unwrap();
        assert!(
            one.ends_with(", after 1 prompt the server refused as over its context"),
            "{one}"
        );
        let tool: AgentEvent = serde_json::from_value(json!({
            "event": "tool_call", "step": 7, "call_id": "c", "name": "ls", "ok": true,
            "error": null, "result_chars": 3, "duration_ms": 1
        }))
        .unwrap();
        assert_eq!(model_call_line(&tool), None);
    }

    #[test]
    fn a_saved_base_url_keeps_no_credentials() {
        assert_eq!(
            without_credentials("https://ada:s3cret@llm.example/v1".to_owned()),
            "https://llm.example/v1"
        );
        assert_eq!(
            without_credentials("http://127.0.0.1:8089/v1".to_owned()),
            "http://127.0.0.1:8089/v1"
        );
        assert_eq!(without_credentials("not a url".to_owned()), "not a url");
    }

    #[test]
    fn settings_saved_by_older_versions_still_read() {
        let old: Saved = serde_json::from_value(json!({
            "model": "openai/local", "dir": "/srv/p", "window": 8000
        }))
        .unwrap();
        assert_eq!(old.model.as_deref(), Some("openai/local"));
        assert_eq!(old.window, Some(8000));
        assert!(old.base_url.is_none() && old.max_tokens.is_none() && old.summarizer.is_none());
    }
}
