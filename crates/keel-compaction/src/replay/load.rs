//! Loading recorded trajectories.

use std::path::{Path, PathBuf};

use keel_message::{FormatError, Message, Role, openai};
use serde_json::Value;

use crate::state::OBSERVATION_METADATA_KEY;

/// One recorded run: its messages in order, with ids assigned.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Trajectory {
    /// The dataset it came from (`tau-bench`, `swe-agent`).
    pub dataset: String,
    /// A name unique within the dataset.
    pub id: String,
    /// The messages, each with an id.
    pub messages: Vec<Message>,
}

impl Trajectory {
    /// A run of `messages` from `dataset`, named `id`; a message without an id gets
    /// `<id>-<index>`, so compaction can name what it removes. Compaction tells
    /// messages apart by id, so two messages with one id (their own, or one equal to
    /// the `<id>-<index>` given to another) are refused with [`DuplicateId`].
    ///
    /// ```
    /// use keel_compaction::replay::Trajectory;
    /// use keel_compaction::message::Message;
    ///
    /// let t = Trajectory::new("mine", "run-1", vec![Message::user("Book a flight.")])?;
    /// assert_eq!(t.messages[0].id.as_deref(), Some("run-1-0"));
    ///
    /// let twice = vec![
    ///     Message::user("Book a flight.").with_id("m"),
    ///     Message::assistant("Where to?").with_id("m"),
    /// ];
    /// let err = Trajectory::new("mine", "run-2", twice).unwrap_err();
    /// assert_eq!((err.first, err.second), (0, 1));
    /// # Ok::<(), keel_compaction::replay::DuplicateId>(())
    /// ```
    pub fn new(
        dataset: impl Into<String>,
        id: impl Into<String>,
        messages: Vec<Message>,
    ) -> Result<Self, DuplicateId> {
        let id = id.into();
        let messages = with_ids(&id, messages)?;
        Ok(Trajectory {
            dataset: dataset.into(),
            messages,
            id,
        })
    }

    /// Assistant turns (model calls).
    pub fn turns(&self) -> usize {
        self.messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count()
    }

    /// Where the goal is: the first user message that is the task itself, not a
    /// demonstration or an environment observation (messages flagged with
    /// [`OBSERVATION_METADATA_KEY`]) and not a bare greeting (`Hi!`, `Hello there.`);
    /// failing that the first unflagged user message, then the first user message.
    /// `None` for a run without user messages.
    pub fn goal_index(&self) -> Option<usize> {
        goal_index(&self.messages)
    }

    /// The goal message ([`Trajectory::goal_index`]).
    pub fn goal(&self) -> Option<&Message> {
        self.goal_index().and_then(|i| self.messages.get(i))
    }
}

/// [`Trajectory::goal_index`] of a message list.
pub(crate) fn goal_index(messages: &[Message]) -> Option<usize> {
    let flagged = |m: &Message| {
        m.metadata
            .get(OBSERVATION_METADATA_KEY)
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let task = |m: &Message| m.role == Role::User && !flagged(m);
    messages
        .iter()
        .position(|m| task(m) && !is_greeting(&m.text()))
        .or_else(|| messages.iter().position(task))
        .or_else(|| messages.iter().position(|m| m.role == Role::User))
}

/// A user message that only greets (`Hi!`, `Hello there.`, `Good morning`): not the
/// task statement when a later user message holds one.
fn is_greeting(text: &str) -> bool {
    const WORDS: [&str; 12] = [
        "hi",
        "hello",
        "hey",
        "there",
        "good",
        "morning",
        "afternoon",
        "evening",
        "greetings",
        "hiya",
        "howdy",
        "thanks",
    ];
    let words: Vec<String> = text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    !words.is_empty() && words.len() <= 4 && words.iter().all(|w| WORDS.contains(&w.as_str()))
}

/// Why a trajectory file could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not the expected JSON shape.
    #[error("{path}: {reason}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Two messages of a run share an id.
    #[error("{path}, {source}")]
    DuplicateId {
        /// The file.
        path: PathBuf,
        /// The run and the messages.
        #[source]
        source: DuplicateId,
    },
    /// A message did not import.
    #[error("{path}, run {run}: {source}")]
    Message {
        /// The file.
        path: PathBuf,
        /// The run within the file.
        run: String,
        /// The import error.
        #[source]
        source: Box<FormatError>,
    },
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| LoadError::Shape {
        path: path.to_owned(),
        reason: format!("not JSON: {e}"),
    })
}

/// Two messages of one run with the same id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "run {run}: messages {first} and {second} have the same id `{id}`; message ids must be unique"
)]
#[non_exhaustive]
pub struct DuplicateId {
    /// The run.
    pub run: String,
    /// The id they share.
    pub id: String,
    /// The position of the first message with it.
    pub first: usize,
    /// The position of the second.
    pub second: usize,
}

/// Gives every message without an id `<prefix>-<index>`; fails when two messages end
/// up with one id.
fn with_ids(prefix: &str, mut messages: Vec<Message>) -> Result<Vec<Message>, DuplicateId> {
    for (i, m) in messages.iter_mut().enumerate() {
        if m.id.is_none() {
            m.id = Some(format!("{prefix}-{i}"));
        }
    }
    let mut first = std::collections::HashMap::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if let Some(id) = m.id.as_deref()
            && let Some(earlier) = first.insert(id, i)
        {
            return Err(DuplicateId {
                run: prefix.to_owned(),
                id: id.to_owned(),
                first: earlier,
                second: i,
            });
        }
    }
    Ok(messages)
}

/// Reads tau-bench's `historical_trajectories` file: a JSON list of runs, each with a
/// `traj` of OpenAI chat messages. Runs are named `<task_id>-<trial>` (or by index).
pub fn load_tau_bench(path: &Path) -> Result<Vec<Trajectory>, LoadError> {
    let file = read_json(path)?;
    let runs = file.as_array().ok_or_else(|| LoadError::Shape {
        path: path.to_owned(),
        reason: "expected a JSON list of runs".into(),
    })?;
    runs.iter()
        .enumerate()
        .map(|(i, run)| {
            let id = match (run.get("task_id"), run.get("trial")) {
                (Some(t), Some(k)) => format!("task{t}-trial{k}-{i}"),
                _ => format!("run{i}"),
            };
            let traj =
                run.get("traj")
                    .and_then(Value::as_array)
                    .ok_or_else(|| LoadError::Shape {
                        path: path.to_owned(),
                        reason: format!("run {i} has no `traj` list"),
                    })?;
            let messages = openai::from_values(traj).map_err(|source| LoadError::Message {
                path: path.to_owned(),
                run: id.clone(),
                source: Box::new(source),
            })?;
            Trajectory::new("tau-bench", id, messages).map_err(|source| LoadError::DuplicateId {
                path: path.to_owned(),
                source,
            })
        })
        .collect()
}

/// Reads one SWE-agent `.traj` file: its `history` of role/content messages. User
/// messages after the first task message are environment observations, and
/// demonstrations (`is_demo`) are not the task: both are flagged with
/// [`OBSERVATION_METADATA_KEY`], so the goal is the task statement. `tool_call_ids`
/// lists become `tool_call_id`.
pub fn load_swe_agent(path: &Path) -> Result<Trajectory, LoadError> {
    let file = read_json(path)?;
    let history = file
        .get("history")
        .and_then(Value::as_array)
        .ok_or_else(|| LoadError::Shape {
            path: path.to_owned(),
            reason: "expected an object with a `history` list".into(),
        })?;
    let id = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut messages = Vec::with_capacity(history.len());
    let mut seen_user = false;
    for (i, raw) in history.iter().enumerate() {
        let demonstration = raw.get("is_demo").and_then(Value::as_bool) == Some(true);
        let mut v = raw.clone();
        if let Some(obj) = v.as_object_mut() {
            // SWE-agent's own keys; not part of the chat.
            for k in [
                "agent",
                "message_type",
                "thought",
                "action",
                "is_demo",
                "cache_control",
            ] {
                obj.remove(k);
            }
            if let Some(ids) = obj.remove("tool_call_ids")
                && let Some(first) = ids.as_array().and_then(|a| a.first()).cloned()
            {
                obj.insert("tool_call_id".into(), first);
            }
            if let Some(Value::Array(parts)) = obj.get("content") {
                // Content parts: keep the text.
                let text: String = parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect();
                obj.insert("content".into(), Value::String(text));
            }
        }
        let mut m = openai::from_value(&v).map_err(|source| LoadError::Message {
            path: path.to_owned(),
            run: id.clone(),
            source: Box::new(source.at_index(i)),
        })?;
        if m.role == Role::User {
            if seen_user || demonstration {
                m.metadata
                    .insert(OBSERVATION_METADATA_KEY.to_owned(), Value::Bool(true));
            }
            seen_user |= !demonstration;
        }
        m.metadata.remove("openai");
        messages.push(m);
    }
    Trajectory::new("swe-agent", id, messages).map_err(|source| LoadError::DuplicateId {
        path: path.to_owned(),
        source,
    })
}

/// Reads every `.traj` file of a directory, sorted by name.
pub fn load_swe_agent_dir(dir: &Path) -> Result<Vec<Trajectory>, LoadError> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| LoadError::Io {
            path: dir.to_owned(),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "traj"))
        .collect();
    paths.sort();
    paths.iter().map(|p| load_swe_agent(p)).collect()
}
