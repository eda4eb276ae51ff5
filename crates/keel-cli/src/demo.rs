//! `keel demo`: the compacting agent over a real directory, on embedded defaults.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use keel::agent::tools::FileTools;
use keel::agent::{Agent, AgentEvent, AgentInput, AgentState, AgentUpdate, Stop};
use keel::compaction::CompactionConfig;
use keel::message::{Message, Role};
use keel::model::{ChatModel, ChatOptions, HttpConfig};
use keel::offload::EvictLargeResults;
use keel::token::{ModelProfile, TokenCounter};
use serde::Serialize;
use serde_json::Value;

use crate::chart::{self, Mark, Turn};
use crate::config::Settings;
use crate::model::{self, LiveArgs, ModelSpec};
use crate::scenario::{NEEDLE_CALL, Scenario};
use crate::store;
use crate::ui::{count, percent, table, thousands};

/// `keel demo`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel demo                          survey this directory with the scripted agent
  keel demo --dir ../my-project      survey another directory
  keel demo --steps 400 --every 20   a longer run, a milestone every 20 model calls
  keel demo --window 4096            a small window: the token budget triggers compaction
  keel demo --model ollama/qwen2.5:7b   the same scenario with a live model
  keel demo --model openai/local --window 8192   a live model keel has no profile for

A \"step\" is one model call and the tool calls it asked for. A live model decides for
itself when its survey is done, so it may make far fewer calls than --steps.

Writes keel.sqlite, offload/, report.json and context-tokens.svg under --home (default ./.keel).")]
pub struct DemoArgs {
    /// The directory the agent surveys with its file tools (read-only).
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Where the SQLite file, the offload store and the outputs go (default: ./.keel,
    /// or KEEL_HOME, or `home` in keel.toml).
    #[arg(long)]
    home: Option<PathBuf>,
    /// Where report.json and context-tokens.svg go (default: the home directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Model calls of the scripted survey (the final question adds two or three); a
    /// live model stops when it is done, at most this many calls.
    #[arg(long, default_value_t = 160, value_parser = survey_steps)]
    steps: usize,
    /// A milestone every N model calls, whatever it costs (the demo shows the
    /// hierarchy; `keel run` and the library default compact on steps only when it pays
    /// for the prompt cache it resets).
    #[arg(long, default_value_t = 10, value_parser = crate::ui::at_least_one::<usize>)]
    every: usize,
    /// An epoch summary every M milestones.
    #[arg(long, default_value_t = 5, value_parser = crate::ui::at_least_one::<usize>)]
    epoch: usize,
    /// The most of the prompt's room (the budget less the system prompt, goal and
    /// tool specs) the summary layers may hold, from 0 to 1 (default 0.4): on a small
    /// window the summary budgets shrink to fit it.
    #[arg(long, value_parser = crate::ui::fraction)]
    summary_share: Option<f64>,
    /// The least a milestone asked for by the token trigger must free, as a share of
    /// the room, from 0 to 1 (default 0.5; 0 compacts at the threshold whatever it
    /// frees). A milestone that would free less waits, until the prompt reaches the
    /// budget.
    #[arg(long, value_parser = crate::ui::fraction)]
    min_token_gain: Option<f64>,
    /// A live model instead of the script: `ollama/<name>` or `openai/<name>`.
    #[arg(long, value_parser = crate::model::model_flag)]
    model: Option<String>,
    #[command(flatten)]
    live: LiveArgs,
    /// `extractive` (no model) or a model for summaries, e.g. `ollama/<name>`.
    #[arg(long, default_value = "extractive", value_parser = crate::model::summarizer_flag)]
    summarizer: String,
    /// The thread id (default: a new `demo-<uuid>` thread).
    #[arg(long, value_parser = crate::ui::thread_id)]
    thread: Option<String>,
    /// Print report.json to stdout instead of the summary table.
    #[arg(long)]
    json: bool,
    /// No progress bar or per-compaction lines.
    #[arg(long, short)]
    quiet: bool,
}

/// What `report.json` holds.
#[derive(Debug, Serialize)]
struct Report {
    model: String,
    scripted: bool,
    /// The window compaction planned for, in tokens, and the prompt budget it leaves
    /// (the window less the reply's room).
    context_window: usize,
    prompt_budget: usize,
    thread: String,
    directory: String,
    files_seen: usize,
    wall_seconds: f64,
    /// Peak resident memory of the whole process (Linux).
    peak_rss_bytes: Option<u64>,
    /// Time to draw and write the chart.
    chart_ms: f64,
    /// This run's model calls, tool calls and compactions (a thread that already ran
    /// makes only the final question's).
    model_calls: u64,
    tool_calls: u64,
    tool_errors: u64,
    offloads: u64,
    milestones: u64,
    epochs: u64,
    /// The thread's totals, over every run of it.
    thread_model_calls: u64,
    thread_milestones: u64,
    thread_epochs: u64,
    prompt_tokens_sent: u64,
    prompt_tokens_full_history: u64,
    tokens_saved: f64,
    peak_context_tokens: u64,
    peak_full_history_tokens: u64,
    final_context_tokens: u64,
    question: Question,
    turns: Vec<TurnRow>,
    compactions: Vec<CompactionRow>,
    files: Files,
}

#[derive(Debug, Serialize)]
struct Question {
    text: String,
    expected: String,
    answer: String,
    correct: bool,
    /// `archive` when the answer was read back from the archive, `context` when the
    /// early result was still in the prompt.
    source: String,
    /// Tool calls the answer took.
    tool_calls: u64,
    /// The first compaction after the early read: when that result left the context.
    left_context_at_step: Option<u64>,
}

#[derive(Debug, Serialize)]
struct TurnRow {
    turn: u64,
    context_tokens: u64,
    full_history_tokens: u64,
}

#[derive(Debug, Serialize)]
struct CompactionRow {
    step: u64,
    kind: String,
    trigger: String,
    tokens_before: usize,
    tokens_after: usize,
    messages_archived: usize,
    prompt_version: String,
}

#[derive(Debug, Serialize)]
struct Files {
    database: String,
    offload_store: String,
    report: String,
    chart: String,
}

/// What the stream told us, accumulated.
#[derive(Default)]
struct Tally {
    turns: Vec<TurnRow>,
    compactions: Vec<CompactionRow>,
    tool_calls: u64,
    tool_errors: u64,
    offloads: u64,
    /// Prompt tokens of the first call, then the tokens of every message since: what
    /// the full history would have cost.
    full: u64,
    saw_first_call: bool,
    answer: Option<String>,
    archive_reads: u64,
}

impl Tally {
    fn observe(
        &mut self,
        update: &AgentUpdate,
        counter: &dyn TokenCounter,
        bar: &ProgressBar,
        quiet: bool,
    ) {
        match update {
            AgentUpdate::Event(AgentEvent::ModelCall { prompt_tokens, .. }) => {
                if !self.saw_first_call {
                    self.full = *prompt_tokens;
                    self.saw_first_call = true;
                }
                let turn = self.turns.len() as u64 + 1;
                self.turns.push(TurnRow {
                    turn,
                    context_tokens: *prompt_tokens,
                    full_history_tokens: self.full.max(*prompt_tokens),
                });
                bar.inc(1);
                bar.set_message(format!(
                    "context {} tokens · {} milestones · {} epochs · {} offloads",
                    thousands(*prompt_tokens),
                    self.milestones(),
                    self.epochs(),
                    self.offloads
                ));
            }
            AgentUpdate::Event(AgentEvent::ToolCall { ok, .. }) => {
                self.tool_calls += 1;
                if !ok {
                    self.tool_errors += 1;
                }
            }
            AgentUpdate::Event(AgentEvent::Offload { .. }) => self.offloads += 1,
            AgentUpdate::Event(AgentEvent::Compaction(e)) => {
                if let Some(error) = &e.error {
                    // Shown as it happens; the run stops after a few in a row.
                    if !quiet {
                        say(
                            bar,
                            format!("step {:>4}  {} failed: {error}", e.step, e.kind.as_str()),
                        );
                    }
                    return;
                }
                let kind = e.kind.as_str();
                if !quiet {
                    say(
                        bar,
                        format!("step {:>4}  {}", e.step, crate::ui::compaction(e)),
                    );
                }
                self.compactions.push(CompactionRow {
                    step: e.step,
                    kind: kind.to_owned(),
                    trigger: serde_json::to_value(e.trigger)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    tokens_before: e.tokens_before,
                    tokens_after: e.tokens_after,
                    messages_archived: e.messages_archived,
                    prompt_version: e.prompt_version.clone(),
                });
            }
            AgentUpdate::Message(m) => {
                if self.saw_first_call {
                    self.full += counter.count_message(m) as u64;
                }
                if m.role == Role::Assistant {
                    let reads_archive = m.tool_calls.iter().any(|c| {
                        let args = c.arguments.to_json_string();
                        args.contains("\"archive") || args.contains("\"large_tool_results")
                    });
                    if reads_archive {
                        self.archive_reads += 1;
                    }
                }
            }
            AgentUpdate::Done { answer, .. } => self.answer.clone_from(answer),
            _ => {}
        }
    }

    fn milestones(&self) -> usize {
        self.compactions
            .iter()
            .filter(|c| c.kind == "milestone")
            .count()
    }

    fn epochs(&self) -> usize {
        self.compactions
            .iter()
            .filter(|c| c.kind == "epoch")
            .count()
    }
}

/// `model call` for 1, `10 model calls` for 10 (after "every").
fn every(n: usize, noun: &str) -> String {
    if n == 1 {
        noun.to_owned()
    } else {
        count(n as u64, noun)
    }
}

/// A line above the progress bar, or on stdout when the bar is hidden (not a terminal).
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        crate::outln!("{line}");
    } else {
        bar.println(line);
    }
}

/// Runs `keel demo`.
pub async fn run(args: DemoArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let home = settings.home(args.home.as_deref());
    let out = args.out.clone().unwrap_or_else(|| home.clone());
    // A directory with nothing to survey is refused before anything is created.
    let scenario = Scenario::plan(&args.dir, args.steps)?;
    crate::ui::create_dir(
        &out,
        "where the report and chart go (--out, else the home directory)",
    )?;
    let live = settings
        .model(args.model.as_deref())
        .filter(|_| args.model.is_some())
        .map(|m| ModelSpec::parse(&m))
        .transpose()?;

    // Exact counts with the model's tokenizer; the scripted agent poses as gpt-4o.
    let model_name = live.as_ref().map_or("gpt-4o", ModelSpec::name).to_owned();
    // A window below keel's least is refused below, once the demo's fixed prompt is
    // counted, with the one least window the demo can run with.
    let asked = args.live.window(settings, None)?;
    let window = asked.map(|w| w.max(model::MIN_WINDOW));
    let (chat, profile, options, http): (Arc<dyn ChatModel>, ModelProfile, _, _) = match &live {
        Some(spec) => {
            let l = args.live.connect(spec, window, settings)?;
            (l.client, l.profile, l.options, l.http)
        }
        // The scripted agent plans for the window asked for, like a live model: a
        // small one shows compaction triggered by the token budget.
        None => (
            Arc::new(scenario.policy(&model_name)),
            model::profile(&model_name, window)?,
            ChatOptions::new(),
            HttpConfig::default(),
        ),
    };
    let counter = model::counter(&profile)?;
    let planned = match asked {
        Some(w) if w < model::MIN_WINDOW => model::with_window(&profile, &model_name, w),
        _ => profile.clone(),
    };
    let planned_window = profile.context_window;
    let files = FileTools::new(&scenario.dir)
        .with_context(|| format!("cannot root the file tools at {}", scenario.dir.display()))?
        .read_only();
    let storage = store::open(&home, None, true).await?;
    let offload = store::offload(&home)?;
    let agent = Agent::builder()
        .model(chat)
        .options(options)
        .profile(profile)
        .counter(counter.clone())
        .summarizer(model::summarizer(
            &args.summarizer,
            settings,
            http,
            live.as_ref().map(|spec| model::RunModel {
                spec,
                given: window,
                planned: planned_window,
            }),
        )?)
        .system(scenario.system())
        .goal(scenario.goal())
        .file_tools(files.clone())
        .checkpointer(storage.saver.clone())
        .offload_store(offload)
        .evict(Some(EvictLargeResults::new()))
        .compaction({
            let mut c = CompactionConfig::default()
                .with_every_steps(Some(args.every))
                .with_epoch_every(args.epoch)
                // Room for the survey and the final question's reads.
                .with_max_steps(args.steps as u64 + 10);
            if let Some(share) = args.summary_share {
                c = c.with_summary_share(share);
            }
            if let Some(gain) = args.min_token_gain {
                c = c.with_min_token_gain(gain);
            }
            c
        })
        .build();
    // The system prompt, the goal and the tool specs head every prompt and are never
    // compacted; with the summaries and a step's results they must fit the budget.
    // A window too small for them is refused as bad usage (exit code 2), as `keel run`
    // refuses one.
    if let Err(e) = model::check_fixed_part_fits(
        "the demo's system prompt, goal and tool specs are",
        &model::fixed_part(counter.clone(), scenario.system(), &scenario.goal(), &files),
        3,
        &planned,
        "",
    ) {
        return Ok(crate::ui::usage_error(&e));
    }
    let agent = agent.context("cannot build the agent")?;

    let thread = args
        .thread
        .clone()
        .unwrap_or_else(|| store::new_thread_id("demo"));
    // A thread that finished has done its survey: only the final question is asked
    // again. One stopped part-way (Ctrl-C) resumes the part it was in. Either way the
    // table counts this run's calls only.
    let earlier = agent
        .state(&thread)
        .await
        .with_context(|| format!("cannot read thread `{thread}`"))?;
    let stopped_in = match &earlier {
        Some(state) if !finished(state) => Some(
            match agent
                .metadata(&thread)
                .await
                .with_context(|| format!("cannot read thread `{thread}`"))?
                .as_ref()
                .and_then(|m| m.get(PHASE_KEY))
                .and_then(Value::as_str)
            {
                Some(QUESTION) => QUESTION,
                _ => SURVEY,
            },
        ),
        _ => None,
    };
    let label = match &live {
        Some(spec) => format!("model: {spec} (live)"),
        None => "model: a scripted policy (deterministic, no model server), posing as gpt-4o for its token profile".to_owned(),
    };
    if !args.json {
        crate::outln!("keel demo — the compacting agent on embedded defaults");
        crate::outln!("{label}");
        crate::outln!(
            "directory: {} ({} text files)",
            scenario.dir.display(),
            scenario.files.len()
        );
        crate::outln!(
            "checkpoints: {}; offload store and archive: {}",
            storage.described,
            store::offload_dir(&home).display()
        );
        crate::outln!(
            "thread: {thread}; a milestone every {}, an epoch every {}\n",
            every(args.every, "model call"),
            every(args.epoch, "milestone"),
        );
        if let Some(before) = &earlier {
            let so_far = format!(
                "{}, {}, {} before now",
                count(before.step, "model call"),
                count(before.milestones_made, "milestone"),
                count(before.epochs_made, "epoch"),
            );
            match stopped_in {
                Some(phase) => crate::outln!(
                    "note: thread `{thread}` stopped during its {phase} ({so_far}): it resumes where it stopped{}, and the table below counts this run's calls and compactions only (its full history starts from the prompt this run began with, so it is less than the whole thread's).\n",
                    if phase == SURVEY {
                        ", then the final question is asked"
                    } else {
                        ""
                    }
                ),
                None => crate::outln!(
                    "note: thread `{thread}` already ran ({so_far}), so its survey is not repeated: only the final question is asked again, and the table below counts this run's calls and compactions only (its full history starts from the prompt this run began with, so it is less than the whole thread's). Leave out --thread (or give a new one) for a full run.\n"
                ),
            }
        }
    }

    let bar = if args.quiet || args.json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(args.steps as u64 + 3);
        bar.set_style(
            ProgressStyle::with_template("{spinner} step {pos:>4}/{len} [{bar:30}] {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar
    };
    let mut tally = Tally::default();
    let watch = Watch {
        counter: counter.as_ref(),
        bar: &bar,
        quiet: args.quiet || args.json,
        live: live.as_ref().map(|spec| (spec, settings)),
        summarizer: &args.summarizer,
        settings,
    };
    // Each part's runs carry its name in their checkpoints' metadata, so a thread
    // stopped part-way resumes the part it was in; a thread that finished has nothing
    // of its survey left to run.
    let in_question = stopped_in == Some(QUESTION);
    let survey_done = earlier.is_some() && stopped_in.is_none();
    if !in_question
        && !survey_done
        && drive(
            &agent,
            &thread,
            AgentInput::new().metadata(PHASE_KEY, SURVEY),
            &mut tally,
            &watch,
        )
        .await?
    {
        return Ok(interrupted(&thread, &tally, &bar));
    }
    let survey_answer = tally.answer.take();
    let reads_before = tally.archive_reads;
    let calls_before = tally.tool_calls;
    let question = scenario.question();
    let ask = if in_question {
        // Asked in the run that stopped: it is answered as the thread goes on.
        AgentInput::new()
    } else {
        tally.full += counter.count_message(&Message::user(question.clone())) as u64;
        AgentInput::new().message(Message::user(question.clone()))
    };
    if drive(
        &agent,
        &thread,
        ask.metadata(PHASE_KEY, QUESTION),
        &mut tally,
        &watch,
    )
    .await?
    {
        return Ok(interrupted(&thread, &tally, &bar));
    }
    bar.finish_and_clear();
    let answer = tally.answer.clone().unwrap_or_default();
    let correct = scenario.is_correct(&answer);
    let from_archive = tally.archive_reads > reads_before;

    let state = agent
        .state(&thread)
        .await?
        .context("the thread has no state after the run")?;
    let chart_path = out.join("context-tokens.svg");
    let report_path = out.join("report.json");
    let turns: Vec<Turn> = tally
        .turns
        .iter()
        .map(|t| Turn {
            turn: t.turn,
            compacted: t.context_tokens,
            full: t.full_history_tokens,
        })
        .collect();
    let marks = marks_for(&tally);
    let chart_started = Instant::now();
    chart::write_svg(
        &chart_path,
        &format!(
            "keel demo: prompt tokens per turn ({} turns, {})",
            turns.len(),
            model_name
        ),
        &turns,
        &marks,
    )?;
    let chart_ms = chart_started.elapsed().as_secs_f64() * 1e3;
    let sent: u64 = tally.turns.iter().map(|t| t.context_tokens).sum();
    let full: u64 = tally.turns.iter().map(|t| t.full_history_tokens).sum();
    let report = Report {
        model: live
            .as_ref()
            .map_or_else(|| "scripted".to_owned(), ToString::to_string),
        scripted: live.is_none(),
        context_window: planned.context_window,
        prompt_budget: planned.input_budget(),
        thread: thread.clone(),
        directory: scenario.dir.display().to_string(),
        files_seen: scenario.files.len(),
        wall_seconds: started.elapsed().as_secs_f64(),
        peak_rss_bytes: crate::ui::peak_rss_bytes(),
        chart_ms,
        model_calls: tally.turns.len() as u64,
        tool_calls: tally.tool_calls,
        tool_errors: tally.tool_errors,
        offloads: tally.offloads,
        milestones: tally.milestones() as u64,
        epochs: tally.epochs() as u64,
        thread_model_calls: state.step,
        thread_milestones: state.milestones_made,
        thread_epochs: state.epochs_made,
        prompt_tokens_sent: sent,
        prompt_tokens_full_history: full,
        tokens_saved: if full == 0 {
            0.0
        } else {
            1.0 - sent as f64 / full as f64
        },
        peak_context_tokens: tally
            .turns
            .iter()
            .map(|t| t.context_tokens)
            .max()
            .unwrap_or(0),
        peak_full_history_tokens: tally
            .turns
            .iter()
            .map(|t| t.full_history_tokens)
            .max()
            .unwrap_or(0),
        final_context_tokens: tally.turns.last().map_or(0, |t| t.context_tokens),
        question: Question {
            text: question,
            expected: scenario.needle.text.clone(),
            answer: answer.clone(),
            correct,
            source: if from_archive { "archive" } else { "context" }.to_owned(),
            tool_calls: tally.tool_calls - calls_before,
            // This process saw the thread's first compaction only on a thread that
            // had none before; an earlier process's is not known here.
            left_context_at_step: if earlier.as_ref().is_some_and(|e| e.milestones_made > 0) {
                None
            } else {
                tally.compactions.first().map(|c| c.step)
            },
        },
        turns: tally.turns,
        compactions: tally.compactions,
        files: Files {
            database: store::sqlite_path(&home).display().to_string(),
            offload_store: store::offload_dir(&home).display().to_string(),
            report: report_path.display().to_string(),
            chart: chart_path.display().to_string(),
        },
    };
    let json = serde_json::to_string_pretty(&report).context("cannot encode the report")?;
    std::fs::write(&report_path, &json)
        .with_context(|| format!("cannot write {}", report_path.display()))?;

    if args.json {
        crate::outln!("{json}");
    } else {
        print_summary(&report, survey_answer.as_deref());
        if let Some(spec) = &live
            && (report.model_calls as usize) < args.steps
        {
            crate::outln!(
                "\nnote: {spec} decided its survey was done after {}; the scripted policy makes {}. Compaction starts after {}, so a short live survey shows few or no milestones: ask for more with a larger model, or see the scripted run (`keel demo` without --model).",
                count(report.model_calls, "model call"),
                args.steps,
                count(args.every as u64, "call"),
            );
        }
    }
    if settings.database_url(None).is_some() {
        // `keel threads` would look in that Postgres, where the demo's thread is not.
        crate::errln!(
            "note: the demo ran on its embedded SQLite file {}, not on the Postgres of DATABASE_URL (or database_url in keel.toml); see its thread with `keel threads list --home {}`",
            store::sqlite_path(&home).display(),
            home.display()
        );
    }
    if report.scripted && !report.question.correct {
        crate::errln!(
            "error: the scripted agent could not answer the final question from its context or the archive; this is a bug in keel — please report it with {}",
            report_path.display()
        );
        return Ok(ExitCode::from(crate::ui::exit::WRONG_ANSWER));
    }
    Ok(ExitCode::SUCCESS)
}

/// Fails when the thread's last run stopped because its compactions kept failing (the
/// demo would otherwise report a run without compaction as if it were one) or at its
/// step ceiling (it would report the question unanswered as keel's bug).
async fn stop_if_stopped_early(
    agent: &Agent,
    thread: &str,
    watch: &Watch<'_>,
) -> anyhow::Result<()> {
    let state = agent
        .state(thread)
        .await?
        .context("the thread has no state after the run")?;
    if let Some(Stop::StepCeiling { steps, max }) = &state.stop {
        // A thread resumed past its ceiling (an earlier demo ran on, or stopped there):
        // nothing is asked, and the answer check would blame keel.
        watch.bar.finish_and_clear();
        anyhow::bail!(
            "thread `{thread}` reached its step ceiling of {max} model calls ({steps} made), so the demo could not go on: the ceiling is --steps plus 10, so run it again with --steps {steps} or more, or on a new thread (without --thread)"
        );
    }
    let Some(stop @ Stop::CompactionFailing { .. }) = &state.stop else {
        return Ok(());
    };
    watch.bar.finish_and_clear();
    let fix = match (ModelSpec::parse(watch.summarizer), stop) {
        (Ok(spec), Stop::CompactionFailing { error, .. }) => {
            summarizer_fix(&spec, &spec.base_url(watch.settings), error)
        }
        _ => "Fix the cause and run the demo again".to_owned(),
    };
    anyhow::bail!(
        "the demo stopped after {} because compaction failed: {stop}. {fix}",
        count(state.step, "model call")
    )
}

/// What to do when the summarizer `spec` at `url` failed the compactions with `error`
/// (the last failure's text): a server that did not answer is started or pointed at; a
/// model whose summaries were rejected is replaced.
fn summarizer_fix(spec: &ModelSpec, url: &str, error: &str) -> String {
    let lower = error.to_ascii_lowercase();
    if lower.contains("summary rejected") {
        let why = error
            .split_once("summary rejected")
            .map_or(error, |(_, rest)| rest)
            .trim_start_matches(|c: char| c != ':')
            .trim_start_matches(':')
            .trim();
        return format!(
            "The summarizer {spec} at {url} answered, but its summaries were rejected ({why}): run the demo with --summarizer extractive (no model needed), or give a larger summarizer model"
        );
    }
    let unreachable = ["connection failed", "timed out", "error sending request"]
        .iter()
        .any(|w| lower.contains(w));
    if unreachable {
        return format!(
            "The summarizer {spec} at {url} made no summary: start its server or set {} to where it listens, or run the demo with --summarizer extractive (no model needed)",
            match spec {
                ModelSpec::Ollama(_) => "OLLAMA_BASE_URL",
                ModelSpec::OpenAi(_) => "OPENAI_BASE_URL",
            }
        );
    }
    format!(
        "The summarizer {spec} at {url} made no usable summary: fix the cause above, or run the demo with --summarizer extractive (no model needed)"
    )
}

/// How a run of the demo is watched: counted, shown, and explained when it fails.
struct Watch<'a> {
    counter: &'a dyn TokenCounter,
    bar: &'a ProgressBar,
    quiet: bool,
    /// The live model and the settings it was reached with, if there is one.
    live: Option<(&'a ModelSpec, &'a Settings)>,
    /// `--summarizer`.
    summarizer: &'a str,
    settings: &'a Settings,
}

/// `--steps`: the survey needs a listing, the early read and the report.
fn survey_steps(text: &str) -> Result<usize, String> {
    crate::ui::whole_at_least(text, 3, " (a listing, the early read, the report)", 160)
}

/// The metadata key naming the part of the demo a run was: [`SURVEY`] or [`QUESTION`].
const PHASE_KEY: &str = "demo";
const SURVEY: &str = "survey";
const QUESTION: &str = "final question";

/// Whether the thread's last run ended with an answer (the model's reply without tool
/// calls), rather than stopping part-way.
fn finished(state: &AgentState) -> bool {
    state
        .last_message()
        .is_some_and(|m| m.role == Role::Assistant && m.tool_calls.is_empty())
}

/// Ctrl-C stopped the demo: says where its thread is, and exits 130.
fn interrupted(thread: &str, tally: &Tally, bar: &ProgressBar) -> ExitCode {
    bar.finish_and_clear();
    crate::errln!(
        "Ctrl-C: the demo stopped after {}; thread `{thread}` keeps every checkpoint so far (`keel threads show {thread}`)",
        count(tally.turns.len() as u64, "model call")
    );
    ExitCode::from(crate::ui::exit::INTERRUPTED)
}

/// Streams one run into `tally`. Returns true when Ctrl-C stopped it (dropping the
/// stream cancels the run at its next step; every step before is checkpointed).
async fn drive(
    agent: &Agent,
    thread: &str,
    input: AgentInput,
    tally: &mut Tally,
    watch: &Watch<'_>,
) -> anyhow::Result<bool> {
    let Watch {
        counter,
        bar,
        quiet,
        live,
        ..
    } = *watch;
    let mut updates = agent.stream(thread, input);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let update = tokio::select! {
            u = updates.next() => u,
            _ = &mut ctrl_c => return Ok(true),
        };
        let Some(update) = update else { break };
        let update = match update {
            Ok(u) => u,
            Err(e) => {
                let fix = live.and_then(|(spec, settings)| model::what_to_fix(&e, spec, settings));
                let message = match fix {
                    Some(fix) => format!("the agent run on thread `{thread}` failed: {fix}"),
                    None => format!("the agent run on thread `{thread}` failed"),
                };
                return Err(anyhow::Error::new(e).context(message));
            }
        };
        tally.observe(&update, counter, bar, quiet);
    }
    stop_if_stopped_early(agent, thread, watch).await?;
    Ok(false)
}

/// Compaction marks on the turn they preceded.
fn marks_for(tally: &Tally) -> Vec<Mark> {
    tally
        .compactions
        .iter()
        .map(|c| Mark {
            turn: c.step + 1,
            epoch: c.kind == "epoch",
        })
        .collect()
}

fn print_summary(r: &Report, survey_answer: Option<&str>) {
    // The final question's calls: its tool calls and the answer.
    let question_calls = (r.question.tool_calls + 1).min(r.model_calls);
    let question_tools = r.question.tool_calls.min(r.tool_calls);
    let rows = vec![
        vec!["".to_owned(), "value".to_owned()],
        vec![
            format!(
                "model calls: {} survey + {question_calls} question",
                thousands(r.model_calls - question_calls)
            ),
            thousands(r.model_calls),
        ],
        vec![
            format!(
                "tool calls: {} survey + {question_tools} question (errors)",
                thousands(r.tool_calls - question_tools)
            ),
            format!("{} ({})", thousands(r.tool_calls), r.tool_errors),
        ],
        vec!["large results offloaded".into(), thousands(r.offloads)],
        vec![
            "milestones / epochs".into(),
            format!("{} / {}", r.milestones, r.epochs),
        ],
        vec!["prompt tokens sent".into(), thousands(r.prompt_tokens_sent)],
        vec![
            "  full history would send".into(),
            thousands(r.prompt_tokens_full_history),
        ],
        vec!["  saved".into(), percent(r.tokens_saved)],
        vec![
            "peak prompt sent (full history)".into(),
            format!(
                "{} ({})",
                thousands(r.peak_context_tokens),
                thousands(r.peak_full_history_tokens)
            ),
        ],
        vec!["final context".into(), thousands(r.final_context_tokens)],
        vec!["wall time".into(), format!("{:.2}s", r.wall_seconds)],
    ];
    crate::outln!("{}", table(&rows));
    if let Some(a) = survey_answer {
        crate::outln!("survey report: {a}\n");
    }
    crate::outln!("question: {}", r.question.text);
    crate::outln!("answer:   {}", r.question.answer);
    let verdict = if r.question.correct {
        "correct"
    } else {
        "WRONG"
    };
    let source = match (r.question.source.as_str(), r.question.left_context_at_step) {
        ("archive", Some(step)) => format!(
            "read back from the archive with {} tool calls ({NEEDLE_CALL}'s result left the context at the compaction of step {step})",
            r.question.tool_calls
        ),
        ("archive", None) => format!(
            "read back from the archive with {} tool calls",
            r.question.tool_calls
        ),
        _ => "answered from the context".to_owned(),
    };
    crate::outln!(
        "          {verdict}: expected {:?}; {source}\n",
        r.question.expected
    );
    crate::outln!("report: {}\nchart:  {}", r.files.report, r.files.chart);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_summaries_get_advice_for_why_they_failed() {
        let spec = ModelSpec::parse("openai/local").unwrap();
        let url = "http://127.0.0.1:8000/v1";
        let rejected = summarizer_fix(
            &spec,
            url,
            "milestone failed: summary rejected after 2 attempts: the reply was cut off at the token limit",
        );
        assert!(
            rejected.contains("summaries were rejected (the reply was cut off at the token limit)")
                && rejected.contains("--summarizer extractive")
                && rejected.contains("larger summarizer model")
                && !rejected.contains("start its server"),
            "{rejected}"
        );
        let down = summarizer_fix(
            &spec,
            url,
            "summarizer model failed: connection failed: error sending request",
        );
        assert!(
            down.contains("start its server") && down.contains("OPENAI_BASE_URL"),
            "{down}"
        );
    }
}
