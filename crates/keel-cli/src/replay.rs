//! `keel replay`: recorded agent runs through keel's compaction, and what it saved.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use keel::compaction::replay::{ReplayConfig, Report, RunReport, Trajectory, replay_trajectory};
use keel::compaction::{EventKind, Strategy};
use keel::message::Message;
use keel::token::ModelProfiles;
use serde_json::json;

use crate::chart::{self, Mark, Turn};
use crate::config::Settings;
use crate::formats::{self, Format, Loaded};
use crate::model::{self, ModelSpec};
use crate::ui::{count, percent, table, thousands};

/// `keel replay`
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  keel replay runs/                                   every .json/.jsonl/.traj file under runs/
  keel replay ../shared/data --window 8000            force an 8,000-token window
  keel replay run.json --strategy hierarchical --strategy masking --strategy hybrid
  keel replay tau.json --format tau-bench --json > report.json
  keel replay session.jsonl --chart tokens.svg

The goal of each run is its task statement: --goal, or else the first user message that
is not a demonstration (SWE-agent's `is_demo`); the report names it. Tokens are counted with the model's tokenizer where keel has it (OpenAI's models; --model, default gpt-4o: the model the recorded runs were sent to, not keel.toml's `model`, which is for `keel run`), and estimated for others, with a note saying so.
Cache-weighted cost prices prompt tokens a provider cache would serve at 0.1 of an uncached one, or at --cached-price: what your provider bills (GPT-4o 0.5, GPT-4.1 0.25, GPT-5 and Anthropic 0.1). keel's step trigger compacts only when that pays, so the price changes what keel does as well as what it costs.
A prompt over the budget (the window less the reply's reserve: the model's maximum output, at most a quarter of the window) leaves the reply less room than it reserved; a provider sent that maximum output refuses it.")]
pub struct ReplayArgs {
    /// Files or directories of recorded runs.
    #[arg(required = true, value_name = "FILE|DIR")]
    inputs: Vec<PathBuf>,
    /// The files' format.
    #[arg(long, value_enum, default_value_t = Format::Auto)]
    format: Format,
    /// Compaction strategies to compare (repeat the flag).
    #[arg(long, value_enum, default_values_t = [StrategyName::Hierarchical])]
    strategy: Vec<StrategyName>,
    /// The model window in tokens, at least 1,000 (default: KEEL_WINDOW, or `window` in
    /// keel.toml, else the model's window).
    #[arg(long, value_parser = parse_window)]
    window: Option<usize>,
    /// The model the recorded runs were sent to, whose profile (window, tokenizer) to
    /// use (keel.toml's `model` is `keel run`'s, and is not read here).
    #[arg(long, default_value = "gpt-4o")]
    model: String,
    /// A milestone every N steps, whatever it costs (default: keel's triggers, which
    /// compact on steps only when an estimate says it pays for the prompt cache it
    /// resets; made before a run's end is known, it pays over many runs, and a run
    /// that ends soon after a milestone can cost a few percent more: a note names
    /// such runs). Each
    /// milestone resets the cache for everything after it, so on a roomy window this can
    /// cost more than the full history (swe-agent at 128,000 with --every 10: 4% dearer).
    #[arg(long, value_parser = crate::ui::at_least_one::<usize>)]
    every: Option<usize>,
    /// The price of a prompt token a provider serves from its cache, relative to an
    /// uncached one (0 to 1; default 0.1, whatever --model says): what the costs are
    /// weighed with, and what keel's cost model assumes when it decides whether
    /// compacting pays. The cheaper cache reads are, the cheaper the full history, so
    /// 0.1 is the hard case for compaction; give your provider's price (gpt-4o's is 0.5).
    #[arg(long, value_name = "PRICE", value_parser = parse_price, allow_negative_numbers = true)]
    cached_price: Option<f64>,
    /// An epoch summary every M milestones.
    #[arg(long, value_parser = crate::ui::at_least_one::<usize>)]
    epoch: Option<usize>,
    /// `extractive` (no model needed), or `ollama/<name>` / `openai/<name>`: summaries
    /// written by that model through the run's cached prefix, its calls counted in the
    /// cost.
    #[arg(long, default_value = "extractive", value_parser = crate::model::summarizer_flag)]
    summarizer: String,
    /// The goal of every run, instead of each run's own task statement.
    #[arg(long, value_parser = crate::ui::some_text)]
    goal: Option<String>,
    /// Print a JSON report to stdout instead of tables: the model, window, files read and
    /// skipped, and for each strategy its `total` and every run's `report` (token
    /// counts, costs, and shares as fractions from 0 to 1: `null` where there is
    /// nothing to share, as `-` in the tables).
    #[arg(long)]
    json: bool,
    /// Write an SVG chart of prompt tokens per turn for the longest run, under the first
    /// --strategy given (a `.svg` file; missing directories are created).
    #[arg(long, value_name = "FILE", value_parser = parse_chart)]
    chart: Option<PathBuf>,
    /// Largest file read, in MiB.
    #[arg(long, default_value_t = 256)]
    max_file_mb: u64,
    /// Print one row per run as well as the totals.
    #[arg(long)]
    runs: bool,
}

/// A strategy name on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyName {
    /// Milestones, epochs and the goal anchor (keel's default).
    Hierarchical,
    /// Old tool results replaced by placeholders (observation masking).
    Masking,
    /// Masking first, summaries when masking is not enough.
    Hybrid,
}

impl StrategyName {
    fn strategy(self) -> Strategy {
        match self {
            Self::Hierarchical => Strategy::Hierarchical,
            Self::Masking => Strategy::masking(),
            Self::Hybrid => Strategy::hybrid(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Hierarchical => "hierarchical",
            Self::Masking => "masking",
            Self::Hybrid => "hybrid",
        }
    }
}

/// Runs `keel replay`.
pub async fn run(mut args: ReplayArgs, settings: &Settings) -> anyhow::Result<ExitCode> {
    // A strategy named twice is replayed once (it would print the same rows twice).
    let mut seen = Vec::with_capacity(args.strategy.len());
    args.strategy.retain(|s| {
        let new = !seen.contains(s);
        seen.push(*s);
        new
    });
    let (summary_spec, summary_model) = match args.summarizer.as_str() {
        "extractive" => (None, None),
        other => {
            let spec = ModelSpec::parse(other).context(
                "--summarizer takes `extractive` (no model needed) or a model such as ollama/<name>",
            )?;
            let client = spec.client(settings)?;
            (Some(spec), Some(client))
        }
    };
    let started = Instant::now();
    if let Some(path) = &args.chart {
        chart::prepare(path)?;
    }
    let (files, unreadable) = formats::expand(&args.inputs)?;
    let (files, repeats) = formats::without_repeats(files);
    for path in &repeats {
        crate::errln!(
            "note: {} was named more than once (or also lies in a directory named): it is replayed once",
            path.display()
        );
    }
    let profiles = ModelProfiles::new();
    let profile = profiles.lookup(&args.model).clone();
    let given = match args.window {
        Some(w) => Some(w),
        None => model::window_setting(settings)?,
    };
    let window = given.unwrap_or(profile.context_window);
    let approximate = profile.encoding == keel::token::Encoding::Approximate;
    if profiles.get(&args.model).is_none() {
        crate::errln!(
            "{}",
            model::no_profile_note(&args.model, given.is_none().then_some(window), approximate)
        );
    } else if approximate {
        crate::errln!(
            "note: keel has no tokenizer for `{}`: its token counts are estimates (they lean high)",
            args.model
        );
    }
    if window < MIN_REPLAY_WINDOW {
        // The flag is checked as it is parsed: this window is from the settings.
        let source = if crate::config::env("KEEL_WINDOW").is_some() {
            "KEEL_WINDOW"
        } else {
            "`window` in keel.toml"
        };
        anyhow::bail!(
            "the window of {source}, {window} tokens, is too small to hold a prompt: set it to at least {}, or give --window",
            thousands(MIN_REPLAY_WINDOW as u64)
        );
    }
    let counter = model::counter(&profile)?;

    // Load every file; a bad one is reported and skipped.
    let mut loaded: Vec<Loaded> = Vec::new();
    // What a directory's walk could not read is skipped as a bad file is.
    let mut skipped: Vec<(PathBuf, String)> = unreadable;
    let bar = progress(files.len() as u64, args.json, "reading");
    for path in &files {
        match formats::load(path, args.format, args.max_file_mb << 20) {
            Ok(l) => loaded.push(l),
            Err(e) => skipped.push((path.clone(), format!("{e:#}"))),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    for (path, why) in &skipped {
        crate::errln!("{}", skipped_line(path, why));
    }
    if loaded.is_empty() {
        anyhow::bail!(
            "no file could be read as recorded runs ({} skipped)",
            skipped.len()
        );
    }
    let mut skipped_runs = 0;
    for why in loaded.iter().flat_map(|l| &l.skipped_runs) {
        crate::errln!("skipped a run: {why}");
        skipped_runs += 1;
    }
    if !args.json {
        for l in &loaded {
            crate::outln!(
                "{}: {} ({}), {}{}",
                l.path.display(),
                l.format.name(),
                if l.detected { "detected" } else { "as given" },
                count(l.runs.len() as u64, "run"),
                match l.skipped_runs.len() {
                    0 => String::new(),
                    n => format!(" ({} skipped)", count(n as u64, "run")),
                }
            );
        }
    }
    for l in loaded.iter().filter(|l| l.folded > 0) {
        crate::errln!(
            "note: {} reads as a request log: {} repeated the messages of the line before and added to them, so each was taken as that run, later ({} in all)",
            l.path.display(),
            count(l.folded as u64, "line"),
            count(l.runs.len() as u64, "run")
        );
    }
    for l in &loaded {
        if l.runs.iter().all(|r| r.turns() == 0) {
            crate::errln!(
                "note: {} has no model turns (no assistant message), so there is nothing to compact: its shares show as - (null in --json)",
                l.path.display()
            );
        }
    }
    unique_run_ids(&mut loaded);
    if let Some(goal) = &args.goal {
        for run in loaded.iter_mut().flat_map(|l| &mut l.runs) {
            set_goal(run, goal);
        }
    } else {
        for l in &loaded {
            if let Some(note) = no_goal_note(l) {
                crate::errln!("{note}");
            }
        }
    }
    let runs: Vec<&Trajectory> = loaded.iter().flat_map(|l| &l.runs).collect();
    let goal_used = if args.goal.is_some() {
        "--goal"
    } else {
        "each run's task statement (its first user message that is not a demonstration)"
    };

    // Replay each run under each strategy.
    let bar = progress(
        (runs.len() * args.strategy.len()) as u64,
        args.json,
        "replaying",
    );
    let mut results: Vec<(StrategyName, Vec<RunReport>)> = Vec::new();
    // The replay's settings at a window, for each strategy; the note on a replay that
    // compacted nothing asks them where the token trigger would fire.
    let config_at = |window: usize, name: StrategyName| {
        let mut config = ReplayConfig::new(window, name.strategy());
        config.encoding = profile.encoding;
        config.reserve_output = profile.max_output_tokens.min(window / 4);
        config.summary_model.clone_from(&summary_model);
        if let Some(every) = args.every {
            config.compaction = config.compaction.with_every_steps(Some(every.max(1)));
        }
        if let Some(epoch) = args.epoch {
            config.compaction = config.compaction.with_epoch_every(epoch.max(1));
        }
        if let Some(price) = args.cached_price {
            config.compaction = config.compaction.with_cached_input_price(price);
        }
        config
    };
    // The same for every strategy.
    let (budget, cached_price) = {
        let any = config_at(window, StrategyName::Hierarchical);
        (any.input_budget(), any.compaction.cached_input_price)
    };
    for &name in &args.strategy {
        let config = config_at(window, name);
        let mut reports = Vec::with_capacity(runs.len());
        for run in &runs {
            let report = match replay_trajectory(run, &config, counter.clone()).await {
                Ok(report) => report,
                Err(e) => {
                    let failed = format!("replaying run {} ({}) failed", run.id, run.dataset);
                    // A summarizer model that cannot be reached: what to fix, as `keel
                    // demo` and `keel run` say it.
                    let message = match summary_spec
                        .as_ref()
                        .and_then(|spec| model::what_to_fix(&e, spec, settings))
                    {
                        Some(fix) => format!(
                            "{failed} at a summary by {}: {fix}; or replay with --summarizer extractive (no model needed)",
                            args.summarizer
                        ),
                        None => failed,
                    };
                    return Err(anyhow::Error::new(e).context(message));
                }
            };
            reports.push(report);
            bar.inc(1);
        }
        results.push((name, reports));
    }
    bar.finish_and_clear();

    let totals: Vec<(StrategyName, Report)> = results
        .iter()
        .map(|(name, reports)| {
            (
                *name,
                Report::from_config("all", &config_at(window, *name), reports),
            )
        })
        .collect();
    // The chart is written before the report, so the report can name it (and a chart
    // that cannot be written fails the run before anything is printed).
    let mut chart = None;
    if let Some(path) = &args.chart
        && let Some((name, reports)) = results.first()
        && let Some(rr) = reports.iter().max_by_key(|r| r.turns.len())
    {
        let turns: Vec<Turn> = rr
            .turns
            .iter()
            .enumerate()
            .map(|(i, t)| Turn {
                turn: i as u64 + 1,
                compacted: t.tokens as u64,
                full: t.full_tokens as u64,
            })
            .collect();
        let made = || rr.events.iter().filter(|e| e.error.is_none());
        // Results replaced by stubs (masked, or the newest step's stored to fit) are
        // drawn as masks; summaries as milestones and epochs.
        let stubbed = |k: EventKind| matches!(k, EventKind::Mask | EventKind::Fit);
        let marks: Vec<Mark> = made()
            .filter(|e| !stubbed(e.kind))
            .map(|e| Mark {
                turn: e.step + 1,
                epoch: e.kind == EventKind::Epoch,
            })
            .collect();
        let masks: Vec<u64> = made()
            .filter(|e| stubbed(e.kind))
            .map(|e| e.step + 1)
            .collect();
        chart::write_svg_with_masks(
            path,
            &format!(
                "{} ({}, {} window): prompt tokens per turn",
                rr.id,
                name.name(),
                thousands(window as u64)
            ),
            &turns,
            &marks,
            &masks,
        )?;
        chart = Some(json!({
            "path": path.display().to_string(),
            "run": rr.id,
            "strategy": name.name(),
            "turns": turns.len(),
        }));
    }
    if args.json {
        let out = json!({
            "model": args.model,
            "window": window,
            "budget": budget,
            "cached_price": cached_price,
            "files": loaded.iter().map(|l| json!({
                "path": l.path.display().to_string(), "format": l.format.name(),
                "detected": l.detected, "runs": l.runs.len(), "folded_lines": l.folded,
                "skipped_runs": &l.skipped_runs})).collect::<Vec<_>>(),
            "skipped": skipped.iter().map(|(p, why)| json!({"path": p.display().to_string(), "error": why})).collect::<Vec<_>>(),
            "goal": goal_used,
            "summarizer": args.summarizer,
            "strategies": totals.iter().map(|(name, r)| json!({
                "strategy": name.name(),
                "total": report_json(r),
                "runs": results.iter().find(|(n, _)| n == name).map(|(_, reports)| {
                    let config = config_at(window, *name);
                    reports.iter().zip(&runs).map(|(rr, t)| {
                    let one = Report::from_config(&rr.dataset, &config, std::slice::from_ref(rr));
                    json!({"id": rr.id, "dataset": rr.dataset, "goal": goal_of(t), "report": report_json(&one)})
                }).collect::<Vec<_>>()}).unwrap_or_default(),
            })).collect::<Vec<_>>(),
            "chart": chart,
            "seconds": started.elapsed().as_secs_f64(),
            "peak_rss_bytes": crate::ui::peak_rss_bytes(),
        });
        crate::outln!(
            "{}",
            serde_json::to_string_pretty(&out).context("cannot encode the report")?
        );
    } else {
        // The model turns replayed, as the table counts them (a run without a user
        // message has no goal, so none of its turns is).
        let turns = totals.first().map_or(0, |(_, r)| r.turns);
        crate::outln!(
            "\n{}, {}; window {} tokens ({}); summaries: {}; goal: {goal_used}\n",
            count(runs.len() as u64, "run"),
            count(turns as u64, "model turn"),
            thousands(window as u64),
            args.model,
            args.summarizer
        );
        if args.runs {
            for (name, reports) in &results {
                let mut rows = vec![header("run")];
                let config = config_at(window, *name);
                for rr in reports {
                    let one = Report::from_config(&rr.dataset, &config, std::slice::from_ref(rr));
                    rows.push(row(
                        &format!("{} ({})", short_id(&rr.id), name.name()),
                        &one,
                    ));
                }
                crate::outln!("{}", table(&rows));
            }
        }
        let mut rows = vec![header("strategy")];
        for (name, r) in &totals {
            rows.push(row(name.name(), r));
        }
        crate::outln!("{}", table(&rows));
        crate::outln!(
            "saved = 1 - keel/full; cache-weighted prices cached prompt tokens at {cached_price}; over budget = prompts over {} tokens (the window less {} reserved for the reply); recall = needed ids and values still in the prompt when the agent used them (+archive: readable back).",
            thousands(budget as u64),
            thousands(window.saturating_sub(budget) as u64)
        );
        let threshold_at = |w: usize| config_at(w, StrategyName::Hierarchical).token_threshold();
        if let Some(note) = nothing_compacted_note(&totals, window, args.every, &threshold_at) {
            crate::outln!("{note}");
        }
        if let Some(note) = over_budget_note(&totals, window) {
            crate::outln!("{note}");
        }
        // One strategy compacted nothing where another did: its saving is not compaction's.
        if totals.iter().any(|(_, r)| r.compactions > 0) {
            for (name, _) in totals
                .iter()
                .filter(|(_, r)| r.compactions + r.failed_compactions == 0 && r.turns > 0)
            {
                crate::outln!(
                    "note: {} compacted nothing here (its trigger waited: the prompts stayed under its threshold, or compacting would not have paid); its saving comes from what keel does to each tool result as it arrives (a large one offloaded, JSON made compact)",
                    name.name()
                );
            }
        }
        for (name, reports) in &results {
            let config = config_at(window, *name);
            let one = |rr: &RunReport| {
                Report::from_config(&rr.dataset, &config, std::slice::from_ref(rr))
            };
            if let Some(note) = dearer_note(
                name.name(),
                reports.iter().map(|rr| (rr.id.as_str(), one(rr))),
            ) {
                crate::outln!("{note}");
            }
        }
        for (name, r) in totals.iter().filter(|(_, r)| r.over_budget > 0) {
            crate::outln!(
                "note: {} of {}'s prompts were over the budget: at this window what every prompt keeps (the system prompt, the goal, and the newest step with its large results stubbed) can take more than {} tokens; give a larger --window",
                thousands(r.over_budget as u64),
                name.name(),
                thousands(r.budget as u64)
            );
        }
        if let Some(c) = &chart {
            crate::outln!(
                "chart of {} ({}, {} turns): {}",
                c["run"].as_str().unwrap_or_default(),
                c["strategy"].as_str().unwrap_or_default(),
                c["turns"],
                c["path"].as_str().unwrap_or_default()
            );
        }
        crate::outln!("replayed in {:.2}s", started.elapsed().as_secs_f64());
    }
    Ok(if skipped.is_empty() && skipped_runs == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::ui::exit::SKIPPED_FILES)
    })
}

/// The least `--window` a replay takes.
const MIN_REPLAY_WINDOW: usize = 1_000;

/// `--window`: a number of tokens a prompt fits in (clap makes a bad one a usage
/// error, exit code 2).
fn parse_window(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(w) if w >= MIN_REPLAY_WINDOW => Ok(w),
        Ok(_) => Err(format!(
            "a window under {} tokens cannot hold a prompt: use at least {} tokens (e.g. --window 8000)",
            thousands(MIN_REPLAY_WINDOW as u64),
            thousands(MIN_REPLAY_WINDOW as u64)
        )),
        Err(_) => {
            Err("give a whole number of tokens, at least 1,000 (e.g. --window 8000)".to_owned())
        }
    }
}

/// `--chart`: a file name ending in `.svg`, the image it writes.
fn parse_chart(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        Ok(path)
    } else {
        Err(
            "the chart is an SVG image: give a file name ending in .svg (e.g. --chart tokens.svg)"
                .to_owned(),
        )
    }
}

/// The line for a file that could not be read: `why` names the file already (every
/// loader error does), so the path is not said twice.
fn skipped_line(path: &std::path::Path, why: &str) -> String {
    let shown = path.display().to_string();
    if why.starts_with(&format!("{shown}: ")) {
        format!("skipped {why}")
    } else if why.contains(&shown) {
        format!("skipped: {why}")
    } else {
        format!("skipped {shown}: {why}")
    }
}

fn progress(len: u64, hidden: bool, what: &'static str) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(what);
    bar
}

fn goal_of(t: &Trajectory) -> String {
    t.goal()
        .map(|m| m.text().chars().take(160).collect())
        .unwrap_or_default()
}

/// Puts `goal` in front of the run's messages (after its system prompt), so it is the
/// task statement the replay anchors.
fn set_goal(run: &mut Trajectory, goal: &str) {
    let at = run
        .messages
        .iter()
        .take_while(|m| m.role == keel::message::Role::System)
        .count();
    let mut message = Message::user(goal.to_owned());
    message.id = Some(format!("{}-goal", run.id));
    run.messages.insert(at, message);
}

fn header(first: &str) -> Vec<String> {
    [
        first,
        "runs",
        "turns",
        "tokens full",
        "tokens keel",
        "saved",
        "cache-weighted saved",
        "cacheable",
        "over budget (full/keel)",
        "recall",
        "+archive",
        "goal intact",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn row(name: &str, r: &Report) -> Vec<String> {
    vec![
        name.to_owned(),
        thousands(r.runs as u64),
        thousands(r.turns as u64),
        thousands(r.full_tokens as u64),
        thousands(r.tokens as u64),
        share(r, r.token_reduction()),
        share(r, r.cost_reduction()),
        cacheable(r),
        format!("{}/{}", r.full_over_budget, r.over_budget),
        if r.needed_facts == 0 {
            "-".to_owned()
        } else {
            percent(r.recall())
        },
        if r.needed_facts == 0 {
            "-".to_owned()
        } else {
            percent(r.archive_recall())
        },
        share(r, r.goal_share()),
    ]
}

/// A share of the report's model turns, or `-` when it has none (nothing was replayed,
/// so there is nothing to compare).
fn share(r: &Report, value: f64) -> String {
    if r.turns == 0 {
        "-".to_owned()
    } else {
        percent(value)
    }
}

/// The share of follow-up turns whose prompt extends the previous one, or `-` when
/// no run had a second turn (there is no previous prompt to share a prefix with).
fn cacheable(r: &Report) -> String {
    if r.followup_turns == 0 {
        "-".to_owned()
    } else {
        percent(r.cacheable_share())
    }
}

/// Run ids come from file names (`openai.json` and `openai.jsonl` both give `openai`,
/// as do `a/run.json` and `b/run.json`); they name the rows of `--runs` and the runs of
/// `--json`, so an id that more than one run has gets its file's path beside it.
fn unique_run_ids(loaded: &mut [Loaded]) {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for run in loaded.iter().flat_map(|l| &l.runs) {
        *seen.entry(run.id.clone()).or_default() += 1;
    }
    for l in loaded.iter_mut() {
        for run in &mut l.runs {
            if seen.get(&run.id).is_some_and(|&n| n > 1) {
                run.id = format!("{} ({})", run.id, l.path.display());
            }
        }
    }
}

/// A note for a file whose runs have model turns but no user message: keel anchors a
/// run on its task statement (a user message), so without one the run is not
/// replayed, and its turns are not in the totals.
fn no_goal_note(l: &Loaded) -> Option<String> {
    let goalless = l
        .runs
        .iter()
        .filter(|r| r.turns() > 0 && r.goal().is_none())
        .count();
    (goalless > 0).then(|| {
        format!(
            "note: {}: {} with model turns but no user message (no task statement to anchor as the goal) {} not replayed: give --goal to replay {}",
            l.path.display(),
            count(goalless as u64, "run"),
            if goalless == 1 { "was" } else { "were" },
            if goalless == 1 { "it" } else { "them" },
        )
    })
}

/// A share as JSON: `null` when the report has no model turns.
fn share_json(r: &Report, value: f64) -> serde_json::Value {
    if r.turns == 0 {
        serde_json::Value::Null
    } else {
        json!(value)
    }
}

/// A note when the full history had turns over the budget: a model would have
/// refused those prompts (or, over the budget but within the window, been left less
/// room for the reply than it reserved), so "saved" against it counts tokens no run
/// could have sent.
fn over_budget_note(totals: &[(StrategyName, Report)], window: usize) -> Option<String> {
    let r = &totals.first()?.1;
    let (over, beyond) = (r.full_over_budget, r.full_over_window);
    (over > 0).then(|| {
        format!(
            "note: {} of the full history's {} {} over the {}-token budget (the over-budget column; {} over the {}-token window itself): a model sent the reply's reserve would have refused those prompts, so \"tokens full\" and \"saved\" count what no run could have sent there",
            count(over as u64, "prompt"),
            count(r.turns as u64, "turn"),
            if over == 1 { "was" } else { "were" },
            thousands(r.budget as u64),
            thousands(beyond as u64),
            thousands(window as u64)
        )
    })
}

/// A note when runs whose full history fit the budget cost more with `strategy` than
/// without compaction: the cost model decides before a run's end is known, so it pays
/// over many runs, not in each.
fn dearer_note<'a>(
    strategy: &str,
    runs: impl Iterator<Item = (&'a str, Report)>,
) -> Option<String> {
    let mut dearer = 0usize;
    let mut worst: Option<(&str, f64)> = None;
    for (id, r) in runs.filter(|(_, r)| r.full_over_budget == 0 && r.cost > r.full_cost) {
        dearer += 1;
        let more = r.cost / r.full_cost - 1.0;
        if worst.is_none_or(|(_, w)| more > w) {
            worst = Some((id, more));
        }
    }
    let (id, more) = worst?;
    Some(format!(
        "note: {} that fit the budget cost more with {strategy} than with the full history (the most: {}, {} more): keel compacts when its estimate says the reset prompt cache is paid back within a few calls, made before it knows how soon the run ends, so it pays over many runs, not in each",
        count(dearer as u64, "run"),
        short_id(id),
        percent(more)
    ))
}

/// A run id short enough for a table row: its first and last characters around `…`
/// when it is long (SWE-agent's run ids run to 200 characters; `--json` has them
/// whole).
fn short_id(id: &str) -> std::borrow::Cow<'_, str> {
    const HEAD: usize = 28;
    const TAIL: usize = 27;
    let chars = id.chars().count();
    if chars <= HEAD + TAIL + 1 {
        return id.into();
    }
    let head: String = id.chars().take(HEAD).collect();
    let tail: String = id.chars().skip(chars - TAIL).collect();
    format!("{head}…{tail}").into()
}

/// `--cached-price`: a price relative to an uncached prompt token, from 0 to 1.
fn parse_price(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err("give the price of a cached prompt token relative to an uncached one, from 0 to 1 (e.g. --cached-price 0.5 for GPT-4o)".to_owned()),
    }
}

/// A note for a replay in which no strategy compacted anything (the runs stayed under
/// the triggers at this window), so a 0% saving is not read as keel failing.
/// It suggests only what would change something: the largest window (a multiple of
/// 1,000, smaller than this one) whose token trigger, `threshold_at(window)`, fires
/// by three quarters of keel's largest prompt, so it fires in more than the last
/// turns; an `--every` smaller than the one given.
fn nothing_compacted_note(
    totals: &[(StrategyName, Report)],
    window: usize,
    every: Option<usize>,
    threshold_at: &dyn Fn(usize) -> usize,
) -> Option<String> {
    let compacted = totals
        .iter()
        .any(|(_, r)| r.compactions + r.failed_compactions > 0);
    // keel's own prompts, not the full history's: a huge tool result is offloaded as
    // it arrives, so the history can dwarf the window while keel's prompts stay small.
    let peak = totals.iter().map(|(_, r)| r.peak).max()?;
    let full_peak = totals.iter().map(|(_, r)| r.full_peak).max()?;
    if compacted || totals.iter().all(|(_, r)| r.turns == 0) {
        return None;
    }
    let largest = if full_peak > peak {
        format!(
            "keel's largest prompt ({} tokens; {} with the full history)",
            thousands(peak as u64),
            thousands(full_peak as u64)
        )
    } else {
        format!("keel's largest prompt ({} tokens)", thousands(peak as u64))
    };
    let smaller = (MIN_REPLAY_WINDOW / 1_000..window.div_ceil(1_000))
        .rev()
        .map(|k| k * 1_000)
        .find(|&w| threshold_at(w) <= peak / 4 * 3);
    let hints: Vec<String> = [
        smaller.map(|w| format!("a smaller --window (e.g. {})", thousands(w as u64))),
        // Only the hierarchical strategy makes a milestone every N steps.
        (every != Some(1) && totals.iter().any(|(n, _)| *n == StrategyName::Hierarchical))
            .then(|| "a smaller --every (a milestone every N steps, whatever it costs)".to_owned()),
    ]
    .into_iter()
    .flatten()
    .collect();
    // Savings without a compaction come from what keel does to every tool result on
    // arrival: large ones offloaded to the archive, JSON made compact.
    let on_arrival = "any saving shown comes from what keel does to each tool result as it arrives (a large one offloaded, JSON made compact)";
    if hints.is_empty() {
        return Some(format!(
            "note: nothing was compacted, and no smaller --window or --every would change that: the runs are too short ({largest}) for compaction to make a prompt smaller; {on_arrival}",
        ));
    }
    let hint = hints.join(" or ");
    Some(format!(
        "note: nothing was compacted: {largest} stayed under what keel's triggers wait for at a {}-token window; replay with {hint} to see compaction; {on_arrival}",
        thousands(window as u64),
    ))
}

fn report_json(r: &Report) -> serde_json::Value {
    json!({
        "runs": r.runs, "turns": r.turns,
        "tokens_full": r.full_tokens, "tokens": r.tokens, "tokens_saved": share_json(r, r.token_reduction()),
        "cost_full": r.full_cost, "cost": r.cost, "cost_saved": share_json(r, r.cost_reduction()),
        "cacheable_turns": r.cacheable_turns,
        "cacheable_share": if r.followup_turns == 0 { serde_json::Value::Null } else { json!(r.cacheable_share()) },
        "peak_full": r.full_peak, "peak": r.peak,
        "turns_over_window_full": r.full_over_window, "turns_over_window": r.over_window,
        "turns_over_budget_full": r.full_over_budget, "turns_over_budget": r.over_budget,
        "goal_intact_share": share_json(r, r.goal_share()),
        "compactions": r.compactions, "failed_compactions": r.failed_compactions,
        "needed_facts": r.needed_facts, "facts_in_prompt": r.facts_in_prompt, "facts_in_archive": r.facts_in_archive,
        "recall": if r.needed_facts == 0 { serde_json::Value::Null } else { json!(r.recall()) },
        "recall_with_archive": if r.needed_facts == 0 { serde_json::Value::Null } else { json!(r.reachable()) },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_under_the_least_and_charts_not_svg_are_refused_with_what_to_give() {
        assert_eq!(parse_window("8000"), Ok(8_000));
        assert_eq!(parse_window("1000"), Ok(1_000));
        let zero = parse_window("0").unwrap_err();
        assert!(zero.contains("use at least 1,000 tokens"), "{zero}");
        assert!(parse_window("lots").unwrap_err().contains("whole number"));
        assert_eq!(parse_chart("c.SVG"), Ok(PathBuf::from("c.SVG")));
        let png = parse_chart("out/c.png").unwrap_err();
        assert!(png.contains("ending in .svg"), "{png}");
    }

    #[test]
    fn the_help_says_which_strategy_the_chart_shows_and_what_json_holds() {
        use clap::CommandFactory as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            replay: ReplayArgs,
        }
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("under the first --strategy given"), "{help}");
        assert!(help.contains("shares as fractions from 0 to 1"), "{help}");
    }

    /// A report of `turns` turns of `peak` tokens at most that compacted nothing.
    fn quiet(name: StrategyName, peak: usize) -> (StrategyName, Report) {
        let mut r = Report::from_runs("x", name.name(), 8_000, &[]);
        r.turns = 2;
        r.full_peak = peak;
        r.peak = peak;
        (name, r)
    }

    /// The default token trigger at `w` with a tenth kept for the reply: 0.85 of the rest.
    fn threshold(w: usize) -> usize {
        ReplayConfig::new(w, StrategyName::Hierarchical.strategy()).token_threshold()
    }

    #[test]
    fn the_nothing_compacted_note_suggests_only_what_would_change_something() {
        // The largest window whose trigger fires by three quarters of the peak: at
        // 11,000 tokens the trigger waits for 8,415, at 10,000 for 7,650 (the peak's
        // three quarters are 7,875).
        let h = [quiet(StrategyName::Hierarchical, 10_500)];
        let both = nothing_compacted_note(&h, 128_000, None, &threshold).unwrap();
        assert!(
            both.contains("--window (e.g. 10,000)") && both.contains("smaller --every"),
            "{both}"
        );
        assert!(threshold(10_000) <= 10_500 / 4 * 3 && threshold(11_000) > 10_500 / 4 * 3);
        // Already at the least window: --every is left.
        let every = nothing_compacted_note(&h, 1_000, None, &threshold).unwrap();
        assert!(
            !every.contains("--window (e.g.") && every.contains("smaller --every"),
            "{every}"
        );
        // A run so short that no window fires the trigger, and a milestone every step:
        // nothing left to suggest.
        let tiny = [quiet(StrategyName::Hierarchical, 65)];
        let none = nothing_compacted_note(&tiny, 128_000, Some(1), &threshold).unwrap();
        assert!(
            none.contains("too short") && !none.contains("e.g."),
            "{none}"
        );
        // A long run at a huge window: the window where the trigger fires by 52,500.
        let big = nothing_compacted_note(
            &[quiet(StrategyName::Hierarchical, 70_000)],
            1_000_000,
            None,
            &threshold,
        )
        .unwrap();
        assert!(big.contains("--window (e.g. 68,000)"), "{big}");
        // Masking makes no milestones: --every changes nothing for it.
        let m = [quiet(StrategyName::Masking, 10_500)];
        let window = nothing_compacted_note(&m, 17_000, None, &threshold).unwrap();
        assert!(
            window.contains("--window (e.g. 10,000)") && !window.contains("--every"),
            "{window}"
        );
        assert!(window.contains("as it arrives"), "{window}");
    }

    #[test]
    fn the_dearer_note_names_fitting_runs_that_cost_more_and_the_worst() {
        let run = |cost: f64, full_cost: f64, over: usize| {
            let mut r = Report::from_runs("x", "hierarchical", 8_000, &[]);
            (r.cost, r.full_cost, r.full_over_budget) = (cost, full_cost, over);
            r
        };
        let runs = [
            ("cheaper", run(90.0, 100.0, 0)),
            ("a bit", run(101.0, 100.0, 0)),
            ("most", run(105.0, 100.0, 0)),
            // Its full history was over the budget: no run could have sent it.
            ("unfit", run(150.0, 100.0, 2)),
        ];
        let note = dearer_note("hierarchical", runs.into_iter()).unwrap();
        assert!(
            note.starts_with("note: 2 runs that fit the budget cost more with hierarchical"),
            "{note}"
        );
        assert!(note.contains("(the most: most, 5.0% more)"), "{note}");
        let none = [("cheaper", run(90.0, 100.0, 0))];
        assert_eq!(dearer_note("masking", none.into_iter()), None);
    }

    #[test]
    fn long_run_ids_are_shortened_in_the_middle_for_the_table() {
        assert_eq!(short_id("task8-trial3-158"), "task8-trial3-158");
        let long = "test__gpt4__swe-agent__test-repo__default_from_url__t-0.00__p-0.95__c-3.00__install-1__swe-agent__test-repo-i1";
        let short = short_id(long);
        assert_eq!(short.chars().count(), 56);
        assert!(
            short.starts_with("test__gpt4__swe-agent__test-")
                && short.ends_with("1__swe-agent__test-repo-i1"),
            "{short}"
        );
        // Characters, not bytes: a long id of accented letters is cut where a char ends.
        assert_eq!(short_id(&"é".repeat(100)).chars().count(), 56);
    }

    #[test]
    fn a_skipped_file_is_named_once() {
        let path = std::path::Path::new("bad/x.json");
        assert_eq!(
            skipped_line(path, "bad/x.json: cannot tell the format; pass --format"),
            "skipped bad/x.json: cannot tell the format; pass --format"
        );
        assert_eq!(
            skipped_line(path, "bad/x.json is empty: there is no run to replay"),
            "skipped: bad/x.json is empty: there is no run to replay"
        );
        assert_eq!(
            skipped_line(path, "permission denied"),
            "skipped bad/x.json: permission denied"
        );
    }
}
