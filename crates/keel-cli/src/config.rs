//! Settings: flags first, then the environment, then `keel.toml`.
//!
//! ```toml
//! # keel.toml
//! home = ".keel"                      # where the embedded SQLite file and offload store live
//! database_url = "postgres://..."     # use Postgres instead of the embedded file
//! schema = "agents"                   # keel's tables in this Postgres schema (default public)
//! model = "ollama/qwen2.5:0.5b"       # default for `keel run` and `keel demo --model`
//! window = 32768                      # the model's context window, when keel does not know it
//! ollama_base_url = "http://127.0.0.1:11434"
//! openai_base_url = "http://127.0.0.1:8080/v1"
//! ```

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::Deserialize;

/// What `keel.toml` may hold. Unknown keys are an error, so a typo is not ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Directory of the embedded SQLite file and offload store.
    pub home: Option<PathBuf>,
    /// A Postgres URL; threads and checkpoints live there instead of the embedded file.
    /// TLS as with psql: `?sslmode=require`, `verify-full`, `sslrootcert=`.
    pub database_url: Option<String>,
    /// The Postgres schema of keel's tables (`KEEL_SCHEMA` wins; default `public`).
    pub schema: Option<String>,
    /// `ollama/<name>` or `openai/<name>`.
    pub model: Option<String>,
    /// The model's context window in tokens (`--window` wins).
    pub window: Option<usize>,
    /// Ollama's address (`OLLAMA_BASE_URL` wins).
    pub ollama_base_url: Option<String>,
    /// An OpenAI-compatible server's address (`OPENAI_BASE_URL` wins).
    pub openai_base_url: Option<String>,
}

impl Settings {
    /// Reads `path`, or `keel.toml` in the working directory when it exists.
    pub fn load(path: Option<&Path>) -> anyhow::Result<Self> {
        let (path, required) = match path {
            Some(p) => (p.to_owned(), true),
            None => (PathBuf::from("keel.toml"), false),
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self::default());
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot read {}", path.display()));
            }
        };
        toml::from_str(&text).map_err(|e| {
            let problem = e.message().trim_end().trim_end_matches('.');
            // An unknown key's message lists the keys already.
            let keys = if problem.contains("expected one of") {
                ""
            } else {
                " (the keys are home, database_url, schema, model, window, ollama_base_url and openai_base_url)"
            };
            anyhow::anyhow!(
                "the settings file {}{} cannot be used: {problem}; fix it{keys}, or give --config another file",
                path.display(),
                e.span()
                    .map(|at| format!(", line {},", line_of(&text, at.start)))
                    .unwrap_or_default(),
            )
        })
    }

    /// The home directory: the flag, then `KEEL_HOME`, then the file, then `./.keel`.
    pub fn home(&self, flag: Option<&Path>) -> PathBuf {
        flag.map(Path::to_owned)
            .or_else(|| env("KEEL_HOME").map(PathBuf::from))
            .or_else(|| self.home.clone())
            .unwrap_or_else(|| PathBuf::from(".keel"))
    }

    /// The Postgres URL: the flag, then `DATABASE_URL`, then the file; none means the
    /// embedded SQLite file.
    pub fn database_url(&self, flag: Option<&str>) -> Option<String> {
        flag.map(str::to_owned)
            .or_else(|| env("DATABASE_URL"))
            .or_else(|| self.database_url.clone())
    }

    /// The Postgres schema of keel's tables: `KEEL_SCHEMA`, then the file; none means
    /// each library's default (`public`).
    pub fn schema(&self) -> Option<String> {
        env("KEEL_SCHEMA").or_else(|| self.schema.clone())
    }

    /// Where threads live for a command that takes both `--home` and `--database-url`:
    /// the Postgres URL of [`database_url`](Self::database_url), except that a `--home`
    /// flag without a `--database-url` flag picks the SQLite file under that home (flags
    /// beat `DATABASE_URL` and the file).
    pub fn store_url(&self, url_flag: Option<&str>, home_flag: Option<&Path>) -> Option<String> {
        match (url_flag, home_flag) {
            (None, Some(_)) => None,
            _ => self.database_url(url_flag),
        }
    }

    /// The model: the flag, then `KEEL_MODEL`, then the file.
    pub fn model(&self, flag: Option<&str>) -> Option<String> {
        flag.map(str::to_owned)
            .or_else(|| env("KEEL_MODEL"))
            .or_else(|| self.model.clone())
    }
}

/// The 1-based line of byte `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(at)
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// An environment variable, treating an empty value as unset.
pub fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_default_file_is_no_settings_but_a_named_one_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let named = dir.path().join("nope.toml");
        let err = Settings::load(Some(&named)).expect_err("a named file must exist");
        assert!(format!("{err:#}").contains("nope.toml"), "{err:#}");
    }

    #[test]
    fn unknown_keys_are_refused_with_the_file_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keel.toml");
        std::fs::write(&path, "hme = \"x\"\n").expect("write");
        let err = Settings::load(Some(&path)).expect_err("typo");
        let text = format!("{err:#}");
        assert!(text.contains("keel.toml") && text.contains("hme"), "{text}");
        assert!(!text.contains("not a valid keel.toml"), "{text}");
    }

    #[test]
    fn a_bad_file_is_named_with_the_line_and_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("settings.toml");
        std::fs::write(&path, "home = \".keel\"\nwindow = \"big\"\n").expect("write");
        let err = Settings::load(Some(&path)).expect_err("a string window");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "the settings file {}, line 2, cannot be used: ",
                path.display()
            )),
            "{text}"
        );
        assert!(
            text.contains("--config") && text.contains("window"),
            "{text}"
        );
        assert_eq!(
            err.chain().count(),
            1,
            "said once, with no cause repeating it"
        );
    }

    #[test]
    fn the_file_fills_what_flags_leave() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keel.toml");
        std::fs::write(
            &path,
            "home = \"/srv/keel\"\nmodel = \"ollama/m\"\nwindow = 8192\n",
        )
        .expect("write");
        let s = Settings::load(Some(&path)).expect("valid");
        assert_eq!(s.window, Some(8192));
        assert_eq!(s.model(Some("openai/x")).as_deref(), Some("openai/x"));
        if env("KEEL_MODEL").is_none() {
            assert_eq!(s.model(None).as_deref(), Some("ollama/m"));
        }
        if env("KEEL_HOME").is_none() {
            assert_eq!(s.home(None), PathBuf::from("/srv/keel"));
        }
    }
}
