//! `ollama/<name>` and `openai/<name>`: which server, which model.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use keel::agent::tools::{BRIEF_SPECS_BELOW, FileTools};
use keel::model::{
    ChatModel, ChatOptions, HttpConfig, ModelError, OllamaConfig, OllamaModel, OpenAiConfig,
    OpenAiModel,
};
use keel::summarize::{ExtractiveSummarizer, LlmSummarizer, Summarizer};
use keel::token::{MemoCounter, ModelProfile, ModelProfiles, TokenCounter};

use crate::config::{Settings, env};
use crate::ui::thousands;

/// The system prompt of the agent `keel run`, `keel demo --model` and `keel worker`
/// run with a live model.
pub const LIVE_SYSTEM: &str = "You are a careful engineering agent. Use your tools to look at the files before you answer; answer plainly when you are done. History that leaves your context is archived under archive/, and large results under large_tool_results/; read them back with read_file and grep.";

/// How a live model is called: its window, reply length and time limit.
#[derive(Debug, Clone, Args)]
pub struct LiveArgs {
    /// The model's context window in tokens, which compaction plans for (needed when
    /// keel does not know the model; `keel demo`'s scripted agent takes it too). An
    /// Ollama model is also run with it (`num_ctx`), since Ollama otherwise runs every
    /// model with its own small default (default: KEEL_WINDOW, or `window` in
    /// keel.toml, else keel's profile of the model).
    #[arg(long, value_name = "TOKENS")]
    pub window: Option<usize>,
    /// The longest reply the model may write, in tokens: at most a quarter of the
    /// window, the most keel keeps free for the reply (default: 1024, or a quarter of
    /// a smaller window; `keel run --thread T`: the thread's).
    #[arg(long, value_name = "TOKENS", value_parser = crate::ui::at_least_one::<u32>)]
    pub max_tokens: Option<u32>,
    /// Seconds one model call may take (default: 300; `keel run --thread T`: the
    /// thread's). A call that takes longer is not retried: the run fails and its
    /// thread resumes from its last checkpoint (HTTP 429 and 5xx replies and failed
    /// connections are retried before a run fails).
    #[arg(long, value_name = "SECS", value_parser = crate::ui::at_least_one::<u64>)]
    pub timeout: Option<u64>,
}

/// `--max-tokens` when none is given.
pub const DEFAULT_MAX_TOKENS: u32 = 1024;
/// `--timeout` when none is given, in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// A live model ready for the agent builder.
pub struct Live {
    /// The client.
    pub client: Arc<dyn ChatModel>,
    /// Its profile (the window compaction plans for).
    pub profile: ModelProfile,
    /// Options of every call (`max_tokens`).
    pub options: ChatOptions,
    /// The HTTP limits (for an LLM summarizer on the same server).
    pub http: HttpConfig,
}

impl LiveArgs {
    /// The window in effect: the flag, then the thread's own (`saved`), then
    /// `KEEL_WINDOW`, then `window` in keel.toml.
    pub fn window(
        &self,
        settings: &Settings,
        saved: Option<usize>,
    ) -> anyhow::Result<Option<usize>> {
        if let Some(w) = self.window.or(saved) {
            return Ok(Some(w));
        }
        window_setting(settings)
    }

    /// Sets up `spec` with these limits. A model keel has no profile for, without a
    /// window, gets a note on stderr saying which window is assumed.
    pub fn connect(
        &self,
        spec: &ModelSpec,
        window: Option<usize>,
        settings: &Settings,
    ) -> anyhow::Result<Live> {
        let mut profile = profile(spec.name(), window)?;
        let max_tokens = reply_cap(self.max_tokens, &mut profile)?;
        let timeout = Duration::from_secs(self.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS));
        let http = HttpConfig::default()
            .request_timeout(timeout)
            .stream_timeout(timeout);
        Ok(Live {
            client: spec.client_with(settings, http.clone(), window)?,
            options: ChatOptions::new().max_tokens(max_tokens),
            profile,
            http,
        })
    }
}

/// The reply cap of every call, with `profile` keeping that much of its window free
/// for the reply: `asked` (`--max-tokens`), else [`DEFAULT_MAX_TOKENS`] cut to a
/// quarter of the window. keel keeps at most a quarter of the window for the reply
/// ([`ModelProfile::input_budget`]), so a larger cap is refused: a reply that long
/// would not fit beside a prompt at its budget, and the server would refuse the call.
pub fn reply_cap(asked: Option<u32>, profile: &mut ModelProfile) -> anyhow::Result<u32> {
    let quarter = u32::try_from(profile.context_window / 4).unwrap_or(u32::MAX);
    let cap = match asked {
        Some(n) if n > quarter => {
            bail!(
                "--max-tokens {} is more than a quarter of the {}-token window, the most keel keeps free for the reply (a longer reply would not fit beside a full prompt): give --max-tokens {} or less, or a --window of at least {}",
                thousands(u64::from(n)),
                thousands(profile.context_window as u64),
                thousands(u64::from(quarter)),
                thousands(u64::from(n).saturating_mul(4))
            );
        }
        Some(n) => n,
        None => DEFAULT_MAX_TOKENS.min(quarter.max(1)),
    };
    profile.max_output_tokens = profile.max_output_tokens.max(cap as usize);
    Ok(cap)
}

/// The window the settings give when no flag does: `KEEL_WINDOW`, then `window` in
/// keel.toml.
pub fn window_setting(settings: &Settings) -> anyhow::Result<Option<usize>> {
    match env("KEEL_WINDOW") {
        Some(text) => text.trim().parse().map(Some).with_context(|| {
            format!("KEEL_WINDOW={text} is not a number of tokens (e.g. KEEL_WINDOW=32768)")
        }),
        None => Ok(settings.window),
    }
}

/// `a` or `an` before a number written with [`thousands`]: `an 8,192`, `an 11,000`,
/// `a 1,024`.
pub fn a_or_an(number: &str) -> &'static str {
    let lead = number.split(',').next().unwrap_or(number);
    if lead.starts_with('8') || lead == "11" || lead == "18" {
        "an"
    } else {
        "a"
    }
}

/// The note for a model keel has no profile for: the window assumed (when none was
/// given), and that token counts are estimates when keel has no tokenizer for it.
pub fn no_profile_note(name: &str, assumed_window: Option<usize>, approximate: bool) -> String {
    let counts = if approximate {
        "token counts are approximate (keel has no tokenizer for it)"
    } else {
        "token counts use the default tokenizer"
    };
    match assumed_window {
        Some(w) => {
            let w = thousands(w as u64);
            format!(
                "note: keel has no profile for `{name}`; assuming {} {w}-token window, and {counts}. Give --window N (or `window` in keel.toml) with the model's real window.",
                a_or_an(&w)
            )
        }
        None => format!("note: keel has no profile for `{name}`; {counts}."),
    }
}

/// The smallest `--window` keel runs with: less leaves no room for the goal, the
/// summaries and a reply.
pub const MIN_WINDOW: usize = 1_024;

/// `base` planning for a `window`-token context (`--window`): a quarter of it, at most
/// 8,192 tokens, is kept for the reply. Not checked against [`MIN_WINDOW`].
pub fn with_window(base: &ModelProfile, name: &str, window: usize) -> ModelProfile {
    ModelProfile::new(name, window, (window / 4).min(8_192), base.encoding)
}

/// The smallest `--window` (at least [`MIN_WINDOW`]) whose prompt budget holds
/// `tokens` `share` times.
pub fn smallest_window(tokens: usize, share: usize) -> usize {
    let base = ModelProfiles::new().lookup("").clone();
    let need = tokens.saturating_mul(share.max(1));
    let fits = |w: usize| with_window(&base, "", w).input_budget() >= need;
    // The budget grows with the window: search between a window too small and one
    // large enough (the budget is at least three quarters of the window).
    let (mut lo, mut hi) = (MIN_WINDOW, need.saturating_mul(2).max(MIN_WINDOW));
    if fits(lo) {
        return lo;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// Refuses a window under [`MIN_WINDOW`], which leaves no room for any prompt.
pub fn check_least_window(window: usize) -> anyhow::Result<()> {
    if window < MIN_WINDOW {
        bail!(
            "{} {}-token window leaves no room for the goal, the summaries and a reply: give --window at least {}",
            a_or_an(&thousands(window as u64)),
            thousands(window as u64),
            thousands(MIN_WINDOW as u64)
        );
    }
    Ok(())
}

/// keel's profile of `name`, with its window replaced by `window` when given. A model
/// keel does not know, without a window, gets a note on stderr.
pub fn profile(name: &str, window: Option<usize>) -> anyhow::Result<ModelProfile> {
    let known = ModelProfiles::new();
    let base = known.lookup(name).clone();
    match window {
        Some(w) => {
            check_least_window(w)?;
            Ok(with_window(&base, name, w))
        }
        None => {
            if known.get(name).is_none() {
                crate::errln!(
                    "{}",
                    no_profile_note(
                        name,
                        Some(base.context_window),
                        base.encoding == keel::token::Encoding::Approximate
                    )
                );
            }
            Ok(base)
        }
    }
}

/// The tokens of the part of every prompt no compaction shrinks (`system`, `goal` and
/// the specs of `files`), by whether the file tools' specs are the short ones (see
/// [`check_fixed_part_fits`]).
pub fn fixed_part(
    counter: Arc<dyn TokenCounter>,
    system: &str,
    goal: &str,
    files: &FileTools,
) -> impl Fn(bool) -> usize {
    move |brief| {
        // A window no fixed part fills: only the count is wanted.
        let probe = keel::agent::Agent::builder()
            .model(Arc::new(keel::model::ScriptedModel::new(Vec::new())))
            .profile(ModelProfile::new(
                "probe",
                1 << 30,
                1_024,
                keel::token::Encoding::Approximate,
            ))
            .counter(counter.clone())
            .system(system)
            .goal(goal)
            .file_tools(files.clone().with_brief_specs(brief))
            .build();
        probe.map_or(usize::MAX, |agent| agent.fixed_prompt_tokens(None, None))
    }
}

/// The smallest `--window` whose prompt budget holds the fixed part `share` times,
/// `fixed` counting it with the short file tool specs or the long ones: the agent
/// gives the short ones under a budget of [`BRIEF_SPECS_BELOW`] tokens.
pub fn least_window(fixed: &dyn Fn(bool) -> usize, share: usize) -> usize {
    let brief = smallest_window(fixed(true), share);
    let base = ModelProfiles::new().lookup("").clone();
    if with_window(&base, "", brief).input_budget() < BRIEF_SPECS_BELOW {
        brief
    } else {
        smallest_window(fixed(false), share)
    }
}

/// Refuses a run whose never-compacted part (`what`; `fixed` counts it, with the short
/// file tool specs of a small budget or the long ones: the goal, the system prompt
/// and the tool specs) takes more than `1 / share` of the prompt budget: every prompt
/// would start that full, leaving too little room for the summaries and the recent
/// steps. `advice` says what to change besides a larger window.
pub fn check_fixed_part_fits(
    what: &str,
    fixed: &dyn Fn(bool) -> usize,
    share: usize,
    profile: &ModelProfile,
    advice: &str,
) -> anyhow::Result<()> {
    let input_budget = profile.input_budget();
    let tokens = fixed(input_budget < BRIEF_SPECS_BELOW);
    let needed = least_window(fixed, share);
    let least = thousands(needed as u64);
    if profile.context_window < MIN_WINDOW && tokens <= input_budget / share.max(1) {
        let window = thousands(profile.context_window as u64);
        bail!(
            "{} {window}-token window leaves no room for the goal, the summaries and a reply: give --window at least {least}",
            a_or_an(&window),
        );
    }
    if tokens > input_budget / share.max(1) {
        let part = match share {
            2 => "half".to_owned(),
            3 => "a third".to_owned(),
            n => format!("1/{n}"),
        };
        bail!(
            "{what} {} tokens, more than {part} of the {}-token prompt budget of {} ({}-token window), and no compaction shrinks that part of every prompt: {advice}give a --window of at least {least}",
            thousands(tokens as u64),
            thousands(input_budget as u64),
            profile.name,
            thousands(profile.context_window as u64),
        );
    }
    Ok(())
}

/// A parsed `--model` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// Ollama's `/api/chat` at `OLLAMA_BASE_URL` (default `http://127.0.0.1:11434`).
    Ollama(String),
    /// An OpenAI-compatible `/chat/completions` at `OPENAI_BASE_URL`.
    OpenAi(String),
}

impl ModelSpec {
    /// Parses `ollama/<name>` or `openai/<name>`; the name may contain `/` and `:`.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let (provider, name) = text.split_once('/').unwrap_or((text, ""));
        if name.trim().is_empty() {
            bail!(
                "`{text}` is not a model: write `ollama/<name>` (e.g. ollama/qwen2.5:0.5b) or `openai/<name>` (e.g. openai/gpt-4o-mini)"
            );
        }
        match provider {
            "ollama" => Ok(Self::Ollama(name.to_owned())),
            "openai" => Ok(Self::OpenAi(name.to_owned())),
            other => bail!(
                "unknown provider `{other}` in `{text}`: keel speaks `ollama/<name>` and `openai/<name>` (any OpenAI-compatible server, with OPENAI_BASE_URL)"
            ),
        }
    }

    /// The model's own name (what picks its token profile).
    pub fn name(&self) -> &str {
        match self {
            Self::Ollama(n) | Self::OpenAi(n) => n,
        }
    }

    /// Where requests go.
    pub fn base_url(&self, settings: &Settings) -> String {
        match self {
            Self::Ollama(_) => env("OLLAMA_BASE_URL")
                .or_else(|| settings.ollama_base_url.clone())
                .unwrap_or_else(|| OllamaConfig::DEFAULT_BASE_URL.to_owned()),
            Self::OpenAi(_) => env("OPENAI_BASE_URL")
                .or_else(|| settings.openai_base_url.clone())
                .unwrap_or_else(|| OpenAiConfig::DEFAULT_BASE_URL.to_owned()),
        }
    }

    /// The base URL the environment or keel.toml gives for this model's provider, if
    /// any (`None`: [`base_url`](Self::base_url) is the provider's default).
    pub fn explicit_base_url(&self, settings: &Settings) -> Option<String> {
        match self {
            Self::Ollama(_) => env("OLLAMA_BASE_URL").or_else(|| settings.ollama_base_url.clone()),
            Self::OpenAi(_) => env("OPENAI_BASE_URL").or_else(|| settings.openai_base_url.clone()),
        }
    }

    /// `settings` with this provider's base URL set to `url` in the place of keel.toml
    /// (the environment still wins).
    pub fn with_base_url(&self, settings: &Settings, url: String) -> Settings {
        let mut settings = settings.clone();
        match self {
            Self::Ollama(_) => settings.ollama_base_url = Some(url),
            Self::OpenAi(_) => settings.openai_base_url = Some(url),
        }
        settings
    }

    /// Whether `other` is served by the same provider (and so the same base URL).
    pub fn same_provider(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }

    /// A client for the model, with the default HTTP limits.
    pub fn client(&self, settings: &Settings) -> anyhow::Result<Arc<dyn ChatModel>> {
        self.client_with(settings, HttpConfig::default(), None)
    }

    /// A client for the model with these HTTP limits; an Ollama model given a
    /// `window` is run with it (`num_ctx`).
    pub fn client_with(
        &self,
        settings: &Settings,
        http: HttpConfig,
        window: Option<usize>,
    ) -> anyhow::Result<Arc<dyn ChatModel>> {
        let url = self.base_url(settings);
        Ok(match self {
            Self::Ollama(name) => {
                let mut config = OllamaConfig::new(name.clone())
                    .base_url(url.clone())
                    .http(http);
                if let Some(w) = window {
                    config = config.num_ctx(u32::try_from(w).unwrap_or(u32::MAX));
                }
                Arc::new(
                    OllamaModel::new(config)
                        .with_context(|| format!("cannot set up Ollama at {url}"))?,
                )
            }
            Self::OpenAi(name) => {
                let mut config = OpenAiConfig::new(name.clone())
                    .base_url(url.clone())
                    .http(http);
                if let Some(key) = env("OPENAI_API_KEY") {
                    config = config.api_key(key);
                }
                Arc::new(OpenAiModel::new(config).with_context(|| {
                    format!("cannot set up the OpenAI-compatible server at {url}")
                })?)
            }
        })
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ollama(n) => write!(f, "ollama/{n}"),
            Self::OpenAi(n) => write!(f, "openai/{n}"),
        }
    }
}

/// What to fix when a call to the model server `spec` failed with `error` (a
/// [`ModelError`] somewhere in its chain of causes): a sentence naming the setting to
/// change, or `None` when the error is of no kind with a known fix.
pub fn what_to_fix(
    error: &(dyn std::error::Error + 'static),
    spec: &ModelSpec,
    settings: &Settings,
) -> Option<String> {
    what_to_fix_at(error, spec, &spec.base_url(settings))
}

/// [`what_to_fix`] for a server at `url` (the model's base URL).
pub fn what_to_fix_at(
    error: &(dyn std::error::Error + 'static),
    spec: &ModelSpec,
    url: &str,
) -> Option<String> {
    let model_error = model_error(error)?;
    // Said to the user: no password or key from the URL.
    let url = &keel::model::redact_url(url);
    let name = spec.name();
    let ollama = matches!(spec, ModelSpec::Ollama(_));
    Some(match model_error {
        ModelError::Connection(_) if ollama => format!(
            "nothing answers at {url}: start Ollama (`ollama serve`), or set OLLAMA_BASE_URL (or `ollama_base_url` in keel.toml) to the address it listens on"
        ),
        ModelError::Connection(_) => format!(
            "nothing answers at {url}: start the server, or set OPENAI_BASE_URL (or `openai_base_url` in keel.toml) to the address it listens on, e.g. http://127.0.0.1:8080/v1"
        ),
        ModelError::Api { status, .. } if (*status == 401 || *status == 403) && ollama => {
            format!(
                "the server at {url} refused the request (HTTP {status}); keel sends Ollama no API key, so set OLLAMA_BASE_URL to an Ollama server that needs none"
            )
        }
        ModelError::Api { status, .. } if *status == 401 || *status == 403 => {
            if env("OPENAI_API_KEY").is_some() {
                format!(
                    "the server at {url} refused the API key (HTTP {status}): set OPENAI_API_KEY to a key it accepts"
                )
            } else {
                format!("the server at {url} wants an API key (HTTP {status}): set OPENAI_API_KEY")
            }
        }
        ModelError::Api {
            status: 404,
            message,
            code,
        } if code.as_deref().is_some_and(|c| c.contains("model"))
            || message.to_ascii_lowercase().contains("model") =>
        {
            if ollama {
                format!(
                    "Ollama at {url} has no model `{name}`: check the name after `ollama/` in --model against `ollama list`, or fetch it with `ollama pull {name}`"
                )
            } else {
                format!(
                    "the server at {url} has no model `{name}`: check the name after `openai/` in --model against the names the server lists at {url}/models"
                )
            }
        }
        ModelError::Api { status: 404, .. } if ollama => format!(
            "{url} has no Ollama chat endpoint (HTTP 404): check OLLAMA_BASE_URL (Ollama's address, without a path, e.g. http://127.0.0.1:11434)"
        ),
        ModelError::Api { status: 404, .. } => format!(
            "{url} has no chat completions endpoint (HTTP 404): check OPENAI_BASE_URL (it usually ends in /v1) and the model name after `openai/` in --model"
        ),
        ModelError::ContextOverflow { message }
            if keel::agent::refused_before_sending(model_error) =>
        {
            let counted = message.strip_suffix("; it was not sent").unwrap_or(message);
            format!(
                "keel did not send the prompt: {counted}, and compacting could not bring it under. The newest step or message alone is too large for the window: give a larger --window if the server's context allows it, or a shorter --message"
            )
        }
        ModelError::ContextOverflow { message } => {
            let says = format!(
                "the server at {url} says the prompt does not fit its context (\"{message}\")"
            );
            match server_context_length(message) {
                Some(n) => format!(
                    "{says}: its context ({} tokens) is smaller than the window keel plans for; give --window {n} or less (or start the server with a larger context)",
                    thousands(n as u64)
                ),
                None => format!(
                    "{says}: its context is smaller than the window keel plans for; give a --window at or below the server's context length (llama.cpp's --ctx-size, n_ctx), or start the server with a larger context"
                ),
            }
        }
        ModelError::Timeout(after) => format!(
            "the model gave no complete answer within {} s: give a larger --timeout, a smaller --max-tokens, or a faster model",
            after.as_secs()
        ),
        _ => return None,
    })
}

/// The [`ModelError`] somewhere in `error`'s chain of causes.
fn model_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a ModelError> {
    let mut cause = Some(error);
    std::iter::from_fn(|| {
        let e = cause?;
        cause = e.source();
        Some(e)
    })
    .find_map(|e| e.downcast_ref::<ModelError>())
}

/// `Some` when `error` is the server saying the prompt does not fit its context
/// ([`ModelError::ContextOverflow`]), holding the context length its message states, if
/// it states one.
pub fn context_overflow(error: &(dyn std::error::Error + 'static)) -> Option<Option<usize>> {
    match model_error(error)? {
        // keel's own refusal of a prompt over the budget: the server was not asked.
        e if keel::agent::refused_before_sending(e) => None,
        ModelError::ContextOverflow { message } => Some(server_context_length(message)),
        _ => None,
    }
}

/// The context length a server's overflow message states: the first number after
/// "context" ("maximum context length is 8192 tokens", "exceed context window of 2048",
/// "exceeds the available context size (4096 tokens)").
fn server_context_length(message: &str) -> Option<usize> {
    let lower = message.to_ascii_lowercase();
    let after = &lower[lower.find("context")?..];
    let start = after.find(|c: char| c.is_ascii_digit())?;
    let digits: String = after[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',')
        .filter(char::is_ascii_digit)
        .collect();
    digits.parse().ok().filter(|n| *n > 0)
}

/// The token counter of a model profile: exact for the OpenAI encodings, an estimate
/// for models keel has no tokenizer for; memoized either way.
pub fn counter(profile: &ModelProfile) -> anyhow::Result<Arc<dyn TokenCounter>> {
    let inner = profile
        .counter()
        .with_context(|| format!("cannot load the tokenizer of {}", profile.name))?;
    Ok(Arc::new(MemoCounter::new(inner)))
}

/// A `--model` flag's value, checked as the command line is read: a malformed one is
/// a usage error (exit 2) before anything runs.
pub fn model_flag(text: &str) -> Result<String, String> {
    ModelSpec::parse(text)
        .map(|_| text.to_owned())
        .map_err(|e| e.to_string())
}

/// `keel worker --model`: `scripted` or a model.
pub fn worker_model_flag(text: &str) -> Result<String, String> {
    if text == "scripted" {
        return Ok(text.to_owned());
    }
    model_flag(text).map_err(|e| format!("{e}; or `scripted` (no server)"))
}

/// A `--summarizer` flag's value: `extractive` or a model.
pub fn summarizer_flag(text: &str) -> Result<String, String> {
    if text == "extractive" {
        return Ok(text.to_owned());
    }
    model_flag(text).map_err(|e| format!("{e}; or `extractive` (no model needed)"))
}

/// The model the agent runs with, for a summarizer that may be the same one: its spec,
/// the window the user gave (`--window`, the thread's, ...) if any, and the window the
/// run plans for.
#[derive(Debug, Clone, Copy)]
pub struct RunModel<'a> {
    /// The agent's model.
    pub spec: &'a ModelSpec,
    /// The window given for the run, if any (an Ollama model is run with it).
    pub given: Option<usize>,
    /// The window the run plans for (its profile's).
    pub planned: usize,
}

/// `extractive` (no model) or a model spec for LLM summaries, called with `http`'s
/// limits. A summarizer that is the run's own model (`run`) on the same server fits its
/// input to the run's window; another model fits it to keel's profile of that model.
pub fn summarizer(
    text: &str,
    settings: &Settings,
    http: HttpConfig,
    run: Option<RunModel<'_>>,
) -> anyhow::Result<Arc<dyn Summarizer>> {
    if text == "extractive" {
        return Ok(Arc::new(ExtractiveSummarizer::new()));
    }
    Ok(Arc::new(llm_summarizer(text, settings, http, run)?))
}

/// The LLM summarizer of [`summarizer`].
fn llm_summarizer(
    text: &str,
    settings: &Settings,
    http: HttpConfig,
    run: Option<RunModel<'_>>,
) -> anyhow::Result<LlmSummarizer> {
    let spec = ModelSpec::parse(text).context(
        "--summarizer takes `extractive` (no model needed) or a model such as ollama/<name>",
    )?;
    // The same settings give the same server to the same model.
    match run.filter(|r| *r.spec == spec) {
        Some(run) => Ok(
            LlmSummarizer::new(spec.client_with(settings, http, run.given)?)
                .with_window_tokens(run.planned),
        ),
        None => Ok(LlmSummarizer::new(spec.client_with(settings, http, None)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_take_the_right_article() {
        for (n, article) in [
            ("8,192", "an"),
            ("800", "an"),
            ("11,000", "an"),
            ("18", "an"),
            ("1,024", "a"),
            ("110", "a"),
            ("32,768", "a"),
        ] {
            assert_eq!(a_or_an(n), article, "{n}");
        }
    }

    #[test]
    fn least_windows_are_written_with_thousands_separators() {
        let small = profile("gpt-4o", Some(800)).unwrap_err().to_string();
        assert!(
            small.starts_with("an 800-token window") && small.ends_with("at least 1,024"),
            "{small}"
        );
        let base = ModelProfiles::new().lookup("gpt-4o").clone();
        let crowded = check_fixed_part_fits(
            "the goal is",
            &|_| 2_000,
            2,
            &with_window(&base, "gpt-4o", 2_000),
            "",
        )
        .unwrap_err()
        .to_string();
        let least = thousands(smallest_window(2_000, 2) as u64);
        assert!(least.contains(','), "{least}");
        assert!(
            crowded.ends_with(&format!("give a --window of at least {least}")),
            "{crowded}"
        );
    }

    #[test]
    fn the_least_window_counts_the_tool_specs_that_window_would_get() {
        // Short specs while the window found keeps the budget under the threshold.
        let small = |brief: bool| if brief { 500 } else { 900 };
        assert_eq!(least_window(&small, 2), smallest_window(500, 2));
        // Past it the agent would give the long ones: the window must hold those.
        let large = |brief: bool| if brief { 2_500 } else { 2_900 };
        let least = least_window(&large, 2);
        assert_eq!(least, smallest_window(2_900, 2));
        let base = ModelProfiles::new().lookup("").clone();
        assert!(with_window(&base, "", least).input_budget() >= BRIEF_SPECS_BELOW);
    }

    #[test]
    fn a_summarizer_that_is_the_run_model_fits_its_input_to_the_run_window() {
        let settings = Settings::default();
        let spec = ModelSpec::parse("openai/local").unwrap();
        let run = RunModel {
            spec: &spec,
            given: Some(2_048),
            planned: 2_048,
        };
        let same =
            llm_summarizer("openai/local", &settings, HttpConfig::default(), Some(run)).unwrap();
        assert!(
            format!("{same:?}").contains("window_tokens: 2048"),
            "{same:?}"
        );
        // Another model keeps keel's profile of it.
        let other =
            llm_summarizer("openai/gpt-4o", &settings, HttpConfig::default(), Some(run)).unwrap();
        let profile = ModelProfiles::new().lookup("gpt-4o").context_window;
        assert!(
            format!("{other:?}").contains(&format!("window_tokens: {profile}")),
            "{other:?}"
        );
    }

    #[test]
    fn a_context_overflow_names_the_window_to_give() {
        for (message, n) in [
            (
                "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
                Some(8192),
            ),
            (
                "Requested tokens (9000) exceed context window of 2048",
                Some(2048),
            ),
            (
                "request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it",
                Some(4096),
            ),
            (
                "the request exceeds the available context size, try increasing it",
                None,
            ),
        ] {
            assert_eq!(server_context_length(message), n, "{message}");
            let error = ModelError::ContextOverflow {
                message: message.into(),
            };
            let spec = ModelSpec::parse("openai/local").unwrap();
            let fix = what_to_fix_at(&error, &spec, "http://127.0.0.1:8000/v1").unwrap();
            assert!(fix.contains(message), "the server's words: {fix}");
            match n {
                Some(n) => assert!(fix.contains(&format!("give --window {n} or less")), "{fix}"),
                None => assert!(
                    fix.contains("at or below the server's context length"),
                    "{fix}"
                ),
            }
            assert_eq!(context_overflow(&error), Some(n));
        }
        // keel's own refusal: the server was never asked, and a smaller window would
        // not help.
        let error = ModelError::ContextOverflow {
            message: "the prompt counts 3307 tokens, over the input budget of 3072 (the model's 4096-token window less 1024 kept for the reply); it was not sent".into(),
        };
        let spec = ModelSpec::parse("openai/local").unwrap();
        let fix = what_to_fix_at(&error, &spec, "http://127.0.0.1:8000/v1").unwrap();
        assert!(
            fix.starts_with("keel did not send the prompt: the prompt counts 3307 tokens"),
            "{fix}"
        );
        assert!(!fix.contains("server at"), "{fix}");
        assert!(!fix.contains("it was not sent"), "{fix}");
        assert_eq!(context_overflow(&error), None);
    }

    #[test]
    fn specs_parse_and_bad_ones_say_what_to_write() {
        assert_eq!(
            ModelSpec::parse("ollama/qwen2.5:0.5b").unwrap(),
            ModelSpec::Ollama("qwen2.5:0.5b".into())
        );
        assert_eq!(
            ModelSpec::parse("openai/org/model-x").unwrap().name(),
            "org/model-x"
        );
        for bad in ["gpt-4o", "ollama/", "anthropic/claude"] {
            let err = ModelSpec::parse(bad).unwrap_err().to_string();
            assert!(err.contains("ollama/<name>"), "{bad}: {err}");
        }
    }
}
