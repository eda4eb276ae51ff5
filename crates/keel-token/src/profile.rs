use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

#[cfg(feature = "tiktoken")]
use crate::TiktokenCounter;
use crate::{ApproxCounter, Encoding, TokenCounter, TokenError};

/// What keel needs to know about a model to budget its context.
///
/// ```
/// use keel_token::{Encoding, ModelProfile};
///
/// let p = ModelProfile::new("my-finetune", 32_768, 4_096, Encoding::Cl100kBase);
/// assert_eq!(p.input_budget(), 28_672);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelProfile {
    /// The model name (or name prefix) this profile is registered under.
    pub name: String,
    /// Total tokens the model accepts: prompt plus completion.
    pub context_window: usize,
    /// The most tokens one reply may have. For open models with no separate limit this
    /// is the share of the window keel reserves for the reply.
    pub max_output_tokens: usize,
    /// How to count the model's tokens.
    pub encoding: Encoding,
}

impl ModelProfile {
    /// A profile.
    pub fn new(
        name: impl Into<String>,
        context_window: usize,
        max_output_tokens: usize,
        encoding: Encoding,
    ) -> Self {
        ModelProfile {
            name: name.into(),
            context_window,
            max_output_tokens,
            encoding,
        }
    }

    /// Tokens left for the prompt once the reply's share is reserved: the maximum
    /// output, but never more than a quarter of the window (a model whose maximum
    /// output equals its window, as `gpt-4`'s 8,192 does, would otherwise leave no room
    /// for any prompt).
    ///
    /// ```
    /// use keel_token::{Encoding, ModelProfile};
    /// let gpt4 = ModelProfile::new("gpt-4", 8_192, 8_192, Encoding::Cl100kBase);
    /// assert_eq!(gpt4.input_budget(), 6_144);
    /// let roomy = ModelProfile::new("gpt-4o", 128_000, 16_384, Encoding::O200kBase);
    /// assert_eq!(roomy.input_budget(), 128_000 - 16_384);
    /// ```
    pub fn input_budget(&self) -> usize {
        let reserve = self.max_output_tokens.min(self.context_window / 4);
        self.context_window.saturating_sub(reserve)
    }

    /// Tokens kept free for the reply (see [`ModelProfile::input_budget`]).
    pub fn reserved_output(&self) -> usize {
        self.context_window - self.input_budget()
    }

    /// Whether [`ModelProfile::counter`] counts this model exactly: an OpenAI encoding
    /// with the `tiktoken` feature on. False for [`Encoding::Approximate`] models, and
    /// for every model in a build without `tiktoken` (a crate that depends on keel-token
    /// without its default features, as keel-offload and keel-compaction do, leaves it
    /// off unless something in the build turns it on). Check it where an estimate is
    /// not good enough, e.g. a prompt kept within a small window:
    ///
    /// ```
    /// use keel_token::ModelProfiles;
    ///
    /// let profiles = ModelProfiles::new();
    /// let gpt = profiles.lookup("gpt-4o");
    /// assert_eq!(gpt.counts_exactly(), cfg!(feature = "tiktoken"));
    /// assert!(!profiles.lookup("claude-sonnet-4-5").counts_exactly());
    /// ```
    pub fn counts_exactly(&self) -> bool {
        cfg!(feature = "tiktoken") && self.encoding.is_bpe()
    }

    /// A counter for this model: exact [`TiktokenCounter`]s for OpenAI encodings
    /// (`o200k_base` for GPT-4o, GPT-4.1, GPT-5 and the o-series, `cl100k_base` for
    /// GPT-4 and GPT-3.5), an [`ApproxCounter`] for everything else. To count a model
    /// differently, register a profile with another [`Encoding`].
    ///
    /// Without the `tiktoken` feature there is no vocabulary to count with: OpenAI
    /// encodings get an [`ApproxCounter`] as well, and a `tracing` warning says so (once
    /// per process); [`ModelProfile::counts_exactly`] tells which you get.
    ///
    /// ```
    /// use keel_token::{ModelProfiles, TokenCounter};
    ///
    /// let profiles = ModelProfiles::new();
    /// let gpt = profiles.lookup("gpt-4o-2024-08-06");
    /// // Exact o200k_base counts with the `tiktoken` feature, an estimate without it.
    /// let exact = gpt.counts_exactly();
    /// assert_eq!(gpt.counter()?.count_text("Hello, world!"), if exact { 4 } else { 5 });
    /// let claude = profiles.lookup("claude-sonnet-4-5").counter()?;
    /// assert_eq!(claude.count_text("Hello, world!"), 5); // an estimate (`ApproxCounter`)
    /// # Ok::<(), keel_token::TokenError>(())
    /// ```
    pub fn counter(&self) -> Result<Arc<dyn TokenCounter>, TokenError> {
        Ok(match self.encoding {
            #[cfg(feature = "tiktoken")]
            Encoding::O200kBase | Encoding::Cl100kBase => {
                Arc::new(TiktokenCounter::new(self.encoding)?)
            }
            #[cfg(not(feature = "tiktoken"))]
            Encoding::O200kBase | Encoding::Cl100kBase => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        encoding = %self.encoding,
                        "keel-token built without feature `tiktoken`: estimating BPE counts with ApproxCounter"
                    );
                });
                Arc::new(ApproxCounter::new())
            }
            Encoding::Approximate => Arc::new(ApproxCounter::new()),
        })
    }
}

/// A registry of [`ModelProfile`]s, looked up by exact name and then by the longest
/// known name followed by a variant suffix (`-`, `:`, `@` or `_`).
///
/// [`ModelProfiles::new`] holds the providers' documented figures for common models
/// (see [`builtin_profiles`]). Names are matched case-insensitively; a dated or tagged
/// variant finds its family by prefix (`gpt-4o-2024-08-06` → `gpt-4o`,
/// `gpt-4o-mini-x` → `gpt-4o-mini`, `llama3.1:8b` → `llama3.1`), and a
/// `provider/model` name is also tried without its provider. An unknown model gets the
/// conservative [`default_profile`](Self::default_profile) and a `tracing` warning
/// (once per name).
///
/// ```
/// use keel_token::{Encoding, ModelProfile, ModelProfiles};
///
/// let mut profiles = ModelProfiles::new();
/// assert_eq!(profiles.lookup("gpt-4.1").context_window, 1_047_576);
/// assert_eq!(profiles.lookup("gpt-4o-mini-2024-07-18").name, "gpt-4o-mini");
/// assert_eq!(profiles.lookup("openai/gpt-4o").name, "gpt-4o");
///
/// // Unknown: the default (and a warning).
/// assert_eq!(profiles.lookup("acme-7b").context_window, 8_192);
///
/// // Register or override.
/// profiles.register(ModelProfile::new("acme", 65_536, 8_192, Encoding::Cl100kBase));
/// assert_eq!(profiles.lookup("acme-7b").context_window, 65_536);
/// ```
#[derive(Debug)]
pub struct ModelProfiles {
    by_name: HashMap<String, ModelProfile>,
    default: ModelProfile,
    warned: Mutex<HashSet<String>>,
}

/// Unknown names remembered for warn-once; past this many, every miss warns.
const WARN_MEMORY: usize = 1024;

impl ModelProfiles {
    /// The built-in profiles and the conservative default.
    pub fn new() -> Self {
        let mut profiles = Self::empty(Self::conservative_default());
        for p in builtin_profiles() {
            profiles.register(p);
        }
        profiles
    }

    /// No profiles at all: every lookup gets `default`.
    pub fn empty(default: ModelProfile) -> Self {
        ModelProfiles {
            by_name: HashMap::new(),
            default,
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// The profile given to unknown models by [`ModelProfiles::new`]: an 8,192-token
    /// window with 2,048 reserved for the reply, approximate counting. Small on purpose:
    /// compacting too early is cheap, overflowing the real window is not.
    pub fn conservative_default() -> ModelProfile {
        ModelProfile::new("default", 8_192, 2_048, Encoding::Approximate)
    }

    /// Adds a profile, or replaces the one registered under the same name (case
    /// insensitive); returns the replaced one.
    pub fn register(&mut self, profile: ModelProfile) -> Option<ModelProfile> {
        self.by_name.insert(normalize(&profile.name), profile)
    }

    /// Removes the profile registered under exactly `name`.
    pub fn remove(&mut self, name: &str) -> Option<ModelProfile> {
        self.by_name.remove(&normalize(name))
    }

    /// Replaces the profile unknown models get.
    pub fn set_default(&mut self, profile: ModelProfile) {
        self.default = profile;
    }

    /// The profile unknown models get.
    pub fn default_profile(&self) -> &ModelProfile {
        &self.default
    }

    /// The profile for `model` if one matches (exact name, else the longest registered
    /// prefix, else the same without a `provider/` part), without falling back.
    ///
    /// ```
    /// use keel_token::ModelProfiles;
    /// let profiles = ModelProfiles::new();
    /// assert_eq!(profiles.get("o3-2025-04-16").map(|p| p.name.as_str()), Some("o3"));
    /// assert!(profiles.get("no-such-model").is_none());
    /// // A prefix matches only before a variant suffix, not more of another name.
    /// assert!(profiles.get("gpt-4.5-preview").is_none());
    /// assert_eq!(profiles.get("gpt-4-32k").map(|p| p.context_window), Some(32_768));
    /// // Variants with a smaller window than the name they begin with have their own.
    /// assert_eq!(profiles.get("o1-mini-2024-09-12").map(|p| p.context_window), Some(128_000));
    /// assert_eq!(profiles.get("gpt-5-chat-latest").map(|p| p.context_window), Some(128_000));
    /// assert_eq!(profiles.get("gpt-5-mini").map(|p| p.context_window), Some(400_000));
    /// ```
    pub fn get(&self, model: &str) -> Option<&ModelProfile> {
        let name = normalize(model);
        self.find(&name).or_else(|| {
            let (_, bare) = name.rsplit_once('/')?;
            self.find(bare)
        })
    }

    fn find(&self, name: &str) -> Option<&ModelProfile> {
        if name.is_empty() {
            return None;
        }
        if let Some(p) = self.by_name.get(name) {
            return Some(p);
        }
        // A known name followed by a variant suffix (`-2024-08-06`, `:7b`, `@latest`),
        // never by more of a name: `gpt-4.5` and `gpt-40` are not `gpt-4`.
        self.by_name
            .iter()
            .filter(|(key, _)| {
                name.strip_prefix(key.as_str())
                    .is_some_and(|rest| rest.starts_with(['-', ':', '@', '_']))
            })
            .max_by_key(|(key, _)| key.len())
            .map(|(_, p)| p)
    }

    /// The profile for `model`, or the default profile with a warning (logged once per
    /// unknown name) when none matches.
    pub fn lookup(&self, model: &str) -> &ModelProfile {
        if let Some(p) = self.get(model) {
            return p;
        }
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        let first_time = if warned.len() < WARN_MEMORY {
            warned.insert(normalize(model))
        } else {
            !warned.contains(&normalize(model))
        };
        if first_time {
            tracing::warn!(
                model,
                context_window = self.default.context_window,
                max_output_tokens = self.default.max_output_tokens,
                "unknown model: using the default profile; register a ModelProfile for it"
            );
        }
        &self.default
    }

    /// Every registered profile, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &ModelProfile> {
        self.by_name.values()
    }
}

impl Default for ModelProfiles {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for ModelProfiles {
    fn clone(&self) -> Self {
        ModelProfiles {
            by_name: self.by_name.clone(),
            default: self.default.clone(),
            warned: Mutex::new(HashSet::new()),
        }
    }
}

fn normalize(name: &str) -> String {
    name.trim().to_lowercase()
}

/// The profiles [`ModelProfiles::new`] starts with.
///
/// Figures are the providers' documented limits:
///
/// | model | window | max output | counted with |
/// |---|---|---|---|
/// | `gpt-4.1`, `-mini`, `-nano` | 1,047,576 | 32,768 | `o200k_base` |
/// | `gpt-4o`, `gpt-4o-mini` | 128,000 | 16,384 | `o200k_base` |
/// | `gpt-5` (and `-mini`, `-nano`) | 400,000 | 128,000 | `o200k_base` |
/// | `o1`, `o3`, `o4-mini` | 200,000 | 100,000 | `o200k_base` |
/// | `gpt-4` | 8,192 | 8,192 | `cl100k_base` |
/// | `gpt-4-turbo` | 128,000 | 4,096 | `cl100k_base` |
/// | `gpt-3.5-turbo` | 16,385 | 4,096 | `cl100k_base` |
/// | `claude-sonnet-4-5` (`claude-sonnet-4.5`) | 200,000 | 64,000 | approximate |
/// | `claude-opus-4-1` (`claude-opus-4.1`) | 200,000 | 32,000 | approximate |
/// | `llama3` (Llama 3 8B) | 8,192 | 2,048 reserved | approximate |
/// | `llama3.1` (Llama 3.1 8B) | 131,072 | 4,096 reserved | approximate |
/// | `qwen2.5-coder` | 32,768 | 8,192 | approximate |
/// | `mistral` (Mistral 7B v0.3) | 32,768 | 4,096 reserved | approximate |
///
/// The open models (Llama, Qwen, Mistral) have no output limit apart from the window;
/// "reserved" is the share keel keeps free for the reply. Claude's 1M-token window is
/// a beta option, not the default, so the profiles keep 200,000. Local servers such as
/// Ollama often run these models with a smaller window (`num_ctx`): register a profile
/// with the window you actually configure.
pub fn builtin_profiles() -> Vec<ModelProfile> {
    use Encoding::{Approximate, Cl100kBase, O200kBase};
    let p = ModelProfile::new;
    vec![
        p("gpt-4.1", 1_047_576, 32_768, O200kBase),
        p("gpt-4.1-mini", 1_047_576, 32_768, O200kBase),
        p("gpt-4.1-nano", 1_047_576, 32_768, O200kBase),
        p("gpt-4o", 128_000, 16_384, O200kBase),
        p("gpt-4o-mini", 128_000, 16_384, O200kBase),
        p("gpt-5", 400_000, 128_000, O200kBase),
        // Variants with smaller windows than the name they begin with.
        p("gpt-5-chat", 128_000, 16_384, O200kBase),
        p("o1", 200_000, 100_000, O200kBase),
        p("o1-mini", 128_000, 65_536, O200kBase),
        p("o1-preview", 128_000, 32_768, O200kBase),
        p("o3", 200_000, 100_000, O200kBase),
        p("o4-mini", 200_000, 100_000, O200kBase),
        p("gpt-4", 8_192, 8_192, Cl100kBase),
        p("gpt-4-turbo", 128_000, 4_096, Cl100kBase),
        p("gpt-4-32k", 32_768, 8_192, Cl100kBase),
        p("gpt-3.5-turbo", 16_385, 4_096, Cl100kBase),
        p("claude-sonnet-4-5", 200_000, 64_000, Approximate),
        p("claude-sonnet-4.5", 200_000, 64_000, Approximate),
        p("claude-opus-4-1", 200_000, 32_000, Approximate),
        p("claude-opus-4.1", 200_000, 32_000, Approximate),
        p("llama3", 8_192, 2_048, Approximate),
        p("llama-3", 8_192, 2_048, Approximate),
        p("meta-llama-3", 8_192, 2_048, Approximate),
        p("llama3.1", 131_072, 4_096, Approximate),
        p("llama-3.1", 131_072, 4_096, Approximate),
        p("meta-llama-3.1", 131_072, 4_096, Approximate),
        p("qwen2.5-coder", 32_768, 8_192, Approximate),
        p("mistral", 32_768, 4_096, Approximate),
    ]
}
