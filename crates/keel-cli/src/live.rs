//! `keel run`: the compacting agent against a real model server.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Args;
use futures::StreamExt;
use keel::agent::tools::FileTools;
use keel::agent::{Agent, AgentEvent, AgentInput, AgentUpdate};
use keel::compaction::CompactionConfig;
use keel::message::{Message, Role};
use keel::offload::EvictLargeResults;
use keel::token::{ModelProfile, ModelProfiles};
use serde_json::{Value, json};

use crate::config::Settings;
use crate::model::{self, ModelSpec};
use crate::store;
use crate::ui::thousands;
use crate::{out, outln};

/// `keel run`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel run --model ollama/qwen2.5:0.5b --goal \"Summarize what this repository does\"
  OPENAI_BASE_URL=http://127.0.0.1:8080/v1 keel run --model openai/local --goal \"...\" --dir ../project
  keel run --model ollama/qwen2.5:7b --thread run-1796164998        continue a thread
  keel run --model ollama/qwen2.5:7b --goal \"Fix the typo in README.md\" --approve

Ctrl-C stops after the current step; `--thread T` resumes the thread where it stopped.
Servers: OLLAMA_BASE_URL (default http://127.0.0.1:11434), OPENAI_BASE_URL and
OPENAI_API_KEY. Threads live in --home (SQLite) or --database-url / DATABASE_URL.")]
pub struct RunArgs {
    /// `ollama/<name>` or `openai/<name>` [default: KEEL_MODEL, or `model` in keel.toml].
    #[arg(long)]
    model: Option<String>,
    /// The goal of a new thread (never compacted; heads every prompt).
    #[arg(long)]
    goal: Option<String>,
    /// A follow-up message to a thread.
    #[arg(long)]
    message: Option<String>,
    /// The directory the file tools are rooted at.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// The thread id (default: a new `run-<time>` thread).
    #[arg(long)]
    thread: Option<String>,
    /// The home directory of the embedded SQLite file and offload store.
    #[arg(long)]
    home: Option<PathBuf>,
    /// A Postgres URL for checkpoints and the archive.
    #[arg(long)]
    database_url: Option<String>,
    /// Enable `write_file` and `edit_file`, each call approved at the terminal.
    #[arg(long)]
    approve: bool,
    /// The model's context window in tokens, when keel does not know the model.
    #[arg(long)]
    window: Option<usize>,
    /// `extractive` (no model) or a model for summaries.
    #[arg(long, default_value = "extractive")]
    summarizer: String,
    /// Model calls at most in this run (a resumable stop).
    #[arg(long, default_value_t = 100)]
    max_steps: u64,
}

/// Runs `keel run`.
pub async fn run(args: RunArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let spec = settings.model(args.model.as_deref()).context(
        "`keel run` needs a model: --model ollama/<name> or --model openai/<name> (or KEEL_MODEL)",
    )?;
    let spec = ModelSpec::parse(&spec)?;
    let home = settings.home(args.home.as_deref());
    let url = settings.database_url(args.database_url.as_deref());
    let storage = store::open(&home, url.as_deref(), true).await?;
    let offload = store::offload_for(&home, url.as_deref(), true)?
        .context("no offload store could be opened")?;

    let known = ModelProfiles::new();
    let mut profile: ModelProfile = known.lookup(spec.name()).clone();
    if let Some(window) = args.window {
        profile = ModelProfile::new(
            spec.name(),
            window,
            (window / 4).min(8_192),
            profile.encoding,
        );
    } else if known.get(spec.name()).is_none() {
        eprintln!(
            "note: keel has no profile for `{}`; using a {}-token window. Pass --window N with the model's real window.",
            spec.name(),
            thousands(profile.context_window as u64)
        );
    }
    let counter = model::counter(&profile)?;
    let mut tools = FileTools::new(&args.dir)
        .with_context(|| format!("cannot root the file tools at {}", args.dir.display()))?;
    if !args.approve {
        tools = tools.read_only();
    }
    let mut builder = Agent::builder()
        .model(spec.client(settings)?)
        .profile(profile.clone())
        .counter(counter)
        .summarizer(model::summarizer(&args.summarizer, settings)?)
        .system("You are a careful engineering agent. Use your tools to look at the files before you answer; answer plainly when you are done. History that leaves your context is archived under archive/, and large results under large_tool_results/; read them back with read_file and grep.")
        .file_tools(tools)
        .checkpointer(storage.saver.clone())
        .offload_store(offload)
        .evict(Some(EvictLargeResults::new()))
        .compaction(CompactionConfig::default().with_max_steps(args.max_steps));
    if args.approve {
        builder = builder.approve(["write_file", "edit_file"]);
    }
    let agent = builder.build().context("cannot build the agent")?;

    let thread = args.thread.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("run-{secs}")
    });
    let existing = agent
        .state(&thread)
        .await
        .with_context(|| format!("cannot read thread `{thread}`"))?;
    let mut input = AgentInput::new();
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
    outln!("model: {spec} at {}", spec.base_url(settings));
    outln!(
        "thread: {thread} ({}); files: {}",
        storage.described,
        args.dir.display()
    );
    if let Some(s) = &existing {
        outln!("continuing at step {}", s.step);
    }

    loop {
        let (stopped, interrupts) = drive(&agent, &thread, input).await?;
        if stopped {
            outln!(
                "\nstopped after the current step. Resume with: keel run --model {spec} --thread {thread}"
            );
            return Ok(ExitCode::from(130));
        }
        let Some(question) = interrupts else {
            break;
        };
        let answer = ask(&question).await?;
        input = AgentInput::new().resume(answer);
    }
    let state = agent
        .state(&thread)
        .await?
        .context("the thread has no state")?;
    if let Some(stop) = &state.stop {
        outln!("\nthe run stopped early ({stop:?}); run again with --thread {thread} to continue");
    }
    outln!(
        "\nanswer:\n{}",
        state.answer().unwrap_or_else(|| "(none)".into())
    );
    outln!(
        "\n{} steps, {} milestones, {} epochs; thread {thread}",
        state.step,
        state.milestones_made,
        state.epochs_made
    );
    Ok(ExitCode::SUCCESS)
}

/// Streams one run. Returns whether Ctrl-C stopped it, and the pending approval
/// question, if any.
async fn drive(
    agent: &Agent,
    thread: &str,
    input: AgentInput,
) -> anyhow::Result<(bool, Option<Value>)> {
    let mut updates = agent.stream(thread, input);
    let mut stopping = false;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let update = tokio::select! {
            u = updates.next() => u,
            _ = &mut ctrl_c, if !stopping => {
                stopping = true;
                eprintln!("\nCtrl-C: stopping after the current step (Ctrl-C again to quit at once)");
                tokio::spawn(async {
                    if tokio::signal::ctrl_c().await.is_ok() {
                        std::process::exit(130);
                    }
                });
                continue;
            }
        };
        let Some(update) = update else {
            return Ok((stopping, None));
        };
        let update = update.with_context(|| format!("the run of thread `{thread}` failed; it resumes from its last checkpoint with --thread {thread}"))?;
        print_update(&update);
        match update {
            AgentUpdate::Done { interrupts, .. } => {
                let question = interrupts.first().map(|i| i.value.clone());
                return Ok((stopping && question.is_none(), question));
            }
            // A step's messages come after its events: the step is done.
            AgentUpdate::Message(_) if stopping => return Ok((true, None)),
            _ => {}
        }
    }
}

fn print_update(update: &AgentUpdate) {
    match update {
        AgentUpdate::Event(AgentEvent::ModelCall {
            step,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            duration_ms,
            ..
        }) => {
            let cached = cached_tokens
                .map(|c| format!(", {} cached", thousands(c)))
                .unwrap_or_default();
            let out_tokens = completion_tokens
                .map(|c| format!(" -> {} out", thousands(c)))
                .unwrap_or_default();
            outln!(
                "step {step:>3}  model: {} prompt tokens{cached}{out_tokens}, {duration_ms} ms",
                thousands(*prompt_tokens)
            );
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
            "          {:?}: prompt {} -> {} tokens, {} messages archived{}",
            e.kind,
            thousands(e.tokens_before as u64),
            thousands(e.tokens_after as u64),
            e.messages_archived,
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
