//! Recorded agent runs in the formats `keel replay` reads, and detection of which is
//! which.
//!
//! | format | shape |
//! |---|---|
//! | `openai` | a JSON array of chat messages (`role`, `content`, `tool_calls`), an object with `messages`, or an array of such objects (one run each) |
//! | `openai-jsonl` | JSON Lines: one message per line (the file is one run), or one `{"messages": [...]}` object per line (one run per line) |
//! | `langchain` | LangChain message dicts (`type`: `human`, `ai`, `tool`, `system`), in the same containers as `openai` |
//! | `swe-agent` | a SWE-agent `.traj` file (an object with `history`) |
//! | `tau-bench` | tau-bench's results: a JSON array of runs, each with a `traj` |

use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow, bail};
use keel::compaction::replay::{Trajectory, load_swe_agent, load_tau_bench};
use keel::message::{Message, langchain, openai};
use serde_json::Value;

/// A format name as given to `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Detect from the file's content (and say which was picked).
    Auto,
    /// OpenAI chat messages (JSON).
    Openai,
    /// OpenAI chat messages (JSON Lines).
    OpenaiJsonl,
    /// LangChain message dicts.
    Langchain,
    /// SWE-agent `.traj`.
    SweAgent,
    /// tau-bench results.
    TauBench,
}

impl Format {
    /// The name as written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Openai => "openai",
            Self::OpenaiJsonl => "openai-jsonl",
            Self::Langchain => "langchain",
            Self::SweAgent => "swe-agent",
            Self::TauBench => "tau-bench",
        }
    }
}

/// The runs of one file, and the format they were read as.
#[derive(Debug)]
pub struct Loaded {
    /// The file.
    pub path: PathBuf,
    /// The format used.
    pub format: Format,
    /// Whether it was detected (rather than given).
    pub detected: bool,
    /// The runs.
    pub runs: Vec<Trajectory>,
    /// Runs of a file of several that could not be read, each with the reason (the
    /// file's other runs replay).
    pub skipped_runs: Vec<String>,
    /// JSON Lines request logs: lines folded into the line after them, which repeated
    /// their messages and added to them (one conversation logged once per request).
    pub folded: usize,
}

/// The runs read from a file of several, the reasons some could not be, and how many
/// request-log lines were folded into a later one.
#[derive(Default)]
struct Runs {
    runs: Vec<Trajectory>,
    skipped: Vec<String>,
    folded: usize,
}

impl Runs {
    fn of(runs: Vec<Trajectory>) -> Self {
        Runs {
            runs,
            ..Runs::default()
        }
    }

    /// The runs, or an error when none of them could be read.
    fn at_least_one(self, path: &Path) -> anyhow::Result<Self> {
        match self.skipped.first() {
            Some(first) if self.runs.is_empty() => {
                let more = self.skipped.len() - 1;
                if more == 0 {
                    bail!("{first}");
                }
                bail!(
                    "{first} (and {more} more {} of {} could not be read)",
                    if more == 1 { "run" } else { "runs" },
                    path.display()
                )
            }
            _ => Ok(self),
        }
    }
}

/// A path a directory's walk could not read, and why.
pub type Unreadable = (PathBuf, String);

/// Files named on the command line: files as they are, directories walked for
/// `.json`, `.jsonl` and `.traj` files (sorted, recursively). With them, what the walk
/// could not read (a broken link, a directory it may not list), each with why, to be
/// reported as skipped; a link loop is left out in silence.
pub fn expand(inputs: &[PathBuf]) -> anyhow::Result<(Vec<PathBuf>, Vec<Unreadable>)> {
    let mut files = Vec::new();
    let mut unreadable = Vec::new();
    for input in inputs {
        let meta = std::fs::metadata(input)
            .with_context(|| format!("cannot read {}: check the path", input.display()))?;
        if meta.is_dir() {
            // Links are followed (to files and directories alike; a loop is skipped).
            let mut found: Vec<PathBuf> = ignore::WalkBuilder::new(input)
                .hidden(true)
                .follow_links(true)
                .build()
                .filter_map(|entry| match entry {
                    Ok(e) => Some(e),
                    Err(e) => {
                        if let Some(path) = walk_error_path(&e) {
                            // A link whose target is gone says so.
                            let dangling = std::fs::symlink_metadata(&path)
                                .is_ok_and(|m| m.file_type().is_symlink())
                                && !path.exists();
                            let why = if dangling {
                                "it is a link to nothing".to_owned()
                            } else {
                                format!("cannot read it: {}", walk_error_cause(&e))
                            };
                            unreadable.push((path, why));
                        }
                        None
                    }
                })
                .filter(|e| e.file_type().is_some_and(|t| t.is_file()))
                .map(ignore::DirEntry::into_path)
                .filter(|p| {
                    p.extension()
                        .is_some_and(|e| e == "json" || e == "jsonl" || e == "traj")
                })
                .collect();
            found.sort();
            if found.is_empty() && unreadable.is_empty() {
                bail!(
                    "{} holds no .json, .jsonl or .traj files to replay",
                    input.display()
                );
            }
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    Ok((files, unreadable))
}

/// The path a walk error is about; `None` for a link loop (left out in silence).
fn walk_error_path(e: &ignore::Error) -> Option<PathBuf> {
    match e {
        ignore::Error::WithPath { path, .. } => Some(path.clone()),
        ignore::Error::WithDepth { err, .. } | ignore::Error::WithLineNumber { err, .. } => {
            walk_error_path(err)
        }
        ignore::Error::Loop { .. } => None,
        ignore::Error::Partial(errs) => errs.iter().find_map(walk_error_path),
        _ => None,
    }
}

/// A walk error's cause, without the path it is about (said before it).
fn walk_error_cause(e: &ignore::Error) -> String {
    match e {
        ignore::Error::WithPath { err, .. }
        | ignore::Error::WithDepth { err, .. }
        | ignore::Error::WithLineNumber { err, .. } => walk_error_cause(err),
        ignore::Error::Io(io) => io.to_string(),
        other => other.to_string(),
    }
}

/// `files` with each file once, in the order first named: a file named twice, or named
/// and also found in a directory named, would be replayed twice and counted twice in
/// the totals. Returns the files kept and the repeats left out.
pub fn without_repeats(files: Vec<PathBuf>) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut seen = std::collections::HashSet::new();
    let mut kept = Vec::with_capacity(files.len());
    let mut repeats = Vec::new();
    for file in files {
        let same = std::fs::canonicalize(&file).unwrap_or_else(|_| file.clone());
        if seen.insert(same) {
            kept.push(file);
        } else {
            repeats.push(file);
        }
    }
    (kept, repeats)
}

/// A size over a limit (`limit` bytes) in MiB with one decimal, never reading as the
/// limit or below it: 3.9 MiB over 1 MiB, not 3; 1.1 for a byte over 1 MiB.
fn mib_over(bytes: u64, limit: u64) -> String {
    let mib = 1u64 << 20;
    let nearest = (bytes.saturating_mul(10) + mib / 2) / mib;
    let tenths = nearest.max(limit.saturating_mul(10).div_ceil(mib) + 1);
    format!("{}.{}", tenths / 10, tenths % 10)
}

/// Reads one file as `format` (or detects it), refusing files over `max_bytes`.
pub fn load(path: &Path, format: Format, max_bytes: u64) -> anyhow::Result<Loaded> {
    let size = std::fs::metadata(path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    if size > max_bytes {
        bail!(
            "{} is {} MiB, over the {} MiB limit for one file: pass --max-file-mb to raise it",
            path.display(),
            mib_over(size, max_bytes),
            max_bytes >> 20
        );
    }
    let mut bytes =
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    // A UTF-8 byte-order mark (Windows tools write one) is not part of the JSON.
    if bytes.starts_with(b"\xEF\xBB\xBF") {
        bytes.drain(..3);
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        bail!("{} is empty: there is no run to replay", path.display());
    }
    if bytes.iter().take(8192).any(|b| *b == 0) || std::str::from_utf8(&bytes).is_err() {
        bail!(
            "{} is not text (binary or not UTF-8): keel replays JSON and JSON Lines files",
            path.display()
        );
    }
    let (format, detected) = match format {
        Format::Auto => (detect(path, &bytes)?, true),
        f => (f, false),
    };
    let read = match format {
        Format::TauBench => Runs::of(load_tau_bench(path).map_err(|e| anyhow!("{e}"))?),
        Format::SweAgent => Runs::of(vec![load_swe_agent(path).map_err(|e| anyhow!("{e}"))?]),
        Format::Openai | Format::Langchain => {
            let value = parse(path, &bytes)?;
            conversations(path, &value, format)?
        }
        Format::OpenaiJsonl => jsonl(path, &bytes)?,
        Format::Auto => bail!("{}: no format detected", path.display()),
    };
    let read = read.at_least_one(path)?;
    if read.runs.iter().all(|r| r.messages.is_empty()) {
        bail!("{} holds no messages", path.display());
    }
    Ok(Loaded {
        path: path.to_owned(),
        format,
        detected,
        runs: read.runs,
        skipped_runs: read.skipped,
        folded: read.folded,
    })
}

/// What serde_json found wrong, without the position its message ends with (the
/// sentences here say where, once).
fn json_problem(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    text.strip_suffix(&position).unwrap_or(&text).to_owned()
}

fn parse(path: &Path, bytes: &[u8]) -> anyhow::Result<Value> {
    serde_json::from_slice(bytes).map_err(|e| {
        anyhow!(
            "{} is not valid JSON at line {}, column {}: {}{}",
            path.display(),
            e.line(),
            e.column(),
            json_problem(&e),
            if e.is_eof() {
                " (the file looks cut short)"
            } else {
                ""
            }
        )
    })
}

/// Which format a file is in, from its content.
pub fn detect(path: &Path, bytes: &[u8]) -> anyhow::Result<Format> {
    let text = std::str::from_utf8(bytes).unwrap_or_default();
    let first = text.trim_start();
    let jsonl_ext = path.extension().is_some_and(|e| e == "jsonl");
    let whole = serde_json::from_slice::<Value>(bytes);
    let first_line = first.lines().next().unwrap_or_default();
    let first_object = serde_json::from_str::<Value>(first_line)
        .ok()
        .filter(Value::is_object);
    // JSON Lines: a `.jsonl` file, or several lines of which the first is an object
    // on its own while the whole is not one JSON value.
    if jsonl_ext || (whole.is_err() && first_object.is_some()) {
        let Some(v) = first_object else {
            return Err(anyhow!(
                "{}: line 1 is not a JSON object; keel replays JSON Lines of chat messages or {{\"messages\": [...]}} objects",
                path.display()
            ));
        };
        return match message_kind(&v).or_else(|| v.get("messages").and_then(container_kind)) {
            Some(Format::Openai) => Ok(Format::OpenaiJsonl),
            Some(Format::Langchain) => bail!(
                "{}: LangChain dicts as JSON Lines are not supported; write them as a JSON array",
                path.display()
            ),
            _ => bail!(
                "{}: JSON Lines whose first line is neither a chat message nor a {{\"messages\": [...]}} object",
                path.display()
            ),
        };
    }
    let value = match whole {
        Ok(v) => v,
        Err(_) => return parse(path, bytes).map(|_| Format::Auto),
    };
    if value.get("history").is_some_and(Value::is_array) {
        return Ok(Format::SweAgent);
    }
    // `[]` or `{"messages": []}`: a conversation with nothing in it, whatever its format.
    let empty = |v: &Value| v.as_array().is_some_and(Vec::is_empty);
    if empty(&value) || value.get("messages").is_some_and(empty) {
        bail!(
            "{} is an empty conversation (no messages): there is no run to replay",
            path.display()
        );
    }
    if let Some(items) = value.as_array()
        && items
            .first()
            .is_some_and(|r| r.get("traj").is_some_and(Value::is_array))
    {
        return Ok(Format::TauBench);
    }
    container_kind(&value).ok_or_else(|| {
        anyhow!(
            "{}: cannot tell the format (not OpenAI or LangChain messages, a SWE-agent .traj or tau-bench results); pass --format",
            path.display()
        )
    })
}

/// The format of a message list, a `{"messages": ...}` object, or a list of those.
fn container_kind(v: &Value) -> Option<Format> {
    if let Some(messages) = v.get("messages") {
        return container_kind(messages);
    }
    let first = v.as_array()?.first()?;
    message_kind(first).or_else(|| first.get("messages").and_then(container_kind))
}

fn message_kind(v: &Value) -> Option<Format> {
    let obj = v.as_object()?;
    if obj.get("role").is_some_and(Value::is_string) {
        return Some(Format::Openai);
    }
    match obj.get("type").and_then(Value::as_str) {
        Some("human" | "ai" | "tool" | "system" | "function" | "chat") => Some(Format::Langchain),
        _ => None,
    }
}

fn messages_of(
    path: &Path,
    values: &[Value],
    format: Format,
    run: &str,
) -> anyhow::Result<Vec<Message>> {
    let result = match format {
        Format::Langchain => langchain::from_values(values),
        _ => openai::from_values(values),
    };
    result.map_err(|e| anyhow!("{}, run {run}: {e}", path.display()))
}

/// The runs of a parsed JSON file of `openai` or `langchain` messages. In a list of
/// runs, a run that cannot be read is skipped with its reason and the others load.
fn conversations(path: &Path, value: &Value, format: Format) -> anyhow::Result<Runs> {
    let stem = stem(path);
    let dataset = format.name().to_owned();
    // Compaction names what it removes by id: two messages with one id (LangChain dicts
    // carry their own, and one may even be the `<run>-<index>` given to a message
    // without) are refused.
    let make = |id: String, messages: Vec<Message>| {
        Trajectory::new(dataset.clone(), id, messages)
            .map_err(|e| anyhow!("{}, {e}", path.display()))
    };
    if let Some(messages) = value.get("messages").and_then(Value::as_array) {
        return Ok(Runs::of(vec![make(
            stem.clone(),
            messages_of(path, messages, format, &stem)?,
        )?]));
    }
    let items = value.as_array().ok_or_else(|| {
        anyhow!(
            "{}: expected a list of messages, an object with `messages`, or a list of such objects",
            path.display()
        )
    })?;
    if items.first().is_some_and(|f| f.get("messages").is_some()) {
        let mut read = Runs::default();
        for (i, item) in items.iter().enumerate() {
            let id = format!("{stem}-{i}");
            let run = item
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| anyhow!("{}: run {i} has no `messages` list", path.display()))
                .and_then(|messages| make(id.clone(), messages_of(path, messages, format, &id)?));
            match run {
                Ok(run) => read.runs.push(run),
                Err(e) => read.skipped.push(format!("{e:#}")),
            }
        }
        return Ok(read);
    }
    Ok(Runs::of(vec![make(
        stem.clone(),
        messages_of(path, items, format, &stem)?,
    )?]))
}

/// JSON Lines: one message per line (one run, which a bad line refuses), or one
/// `{"messages": [...]}` run per line (a bad line is skipped with its reason).
///
/// A request log writes one line per model call, each with the whole conversation so
/// far: a line whose messages begin with all of the line before it is the same run,
/// later, and replaces it.
fn jsonl(path: &Path, bytes: &[u8]) -> anyhow::Result<Runs> {
    let text =
        std::str::from_utf8(bytes).map_err(|_| anyhow!("{} is not UTF-8", path.display()))?;
    let stem = stem(path);
    let lines: Vec<(usize, Result<Value, String>)> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(n, line)| {
            let value = serde_json::from_str::<Value>(line).map_err(|e| {
                format!(
                    "{}: line {} is not valid JSON at column {}: {}",
                    path.display(),
                    n + 1,
                    e.column(),
                    json_problem(&e)
                )
            });
            (n + 1, value)
        })
        .collect();
    let has_messages = |v: &Value| v.get("messages").is_some_and(Value::is_array);
    let one_run_a_line = lines
        .iter()
        .any(|(_, v)| v.as_ref().is_ok_and(has_messages));
    if !one_run_a_line {
        let mut messages = Vec::with_capacity(lines.len());
        for (n, value) in lines {
            let m = value.map_err(|e| anyhow!("{e}")).and_then(|v| {
                openai::from_value(&v).map_err(|e| anyhow!("{}: line {n}: {e}", path.display()))
            })?;
            messages.push(m);
        }
        return Ok(Runs::of(vec![
            Trajectory::new("openai-jsonl", stem, messages)
                .map_err(|e| anyhow!("{}, {e}", path.display()))?,
        ]));
    }
    let mut read = Runs::default();
    // The raw messages of the last run read, to fold a request log's next line into it.
    let mut last: Option<Vec<Value>> = None;
    for (n, value) in lines {
        let run = value.map_err(|e| anyhow!("{e}")).and_then(|v| {
            let raw = v
                .get("messages")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    anyhow!(
                        "{}: line {n} is not a {{\"messages\": [...]}} object, as the file's other lines are",
                        path.display()
                    )
                })?;
            let messages = openai::from_values(raw)
                .map_err(|e| anyhow!("{}: line {n}: {e}", path.display()))?;
            let run = Trajectory::new("openai-jsonl", format!("{stem}-{n}"), messages)
                .map_err(|e| anyhow!("{}, {e}", path.display()))?;
            Ok((run, raw.clone()))
        });
        match run {
            Ok((run, raw)) => {
                let continues = last
                    .as_ref()
                    .is_some_and(|before| raw.len() > before.len() && raw.starts_with(before));
                if continues {
                    read.runs.pop();
                    read.folded += 1;
                }
                read.runs.push(run);
                last = Some(raw);
            }
            Err(e) => {
                read.skipped.push(format!("{e:#}"));
                last = None;
            }
        }
    }
    Ok(read)
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".to_owned())
}

/// The properties of `keel replay`'s loading over any bytes: for the
/// `trajectory_import` fuzz target (the repository's `fuzz/` crate builds this file into
/// itself) and the corpus replay test below.
#[cfg(any(fuzzing, test))]
pub mod fuzzing {
    use std::collections::HashSet;
    use std::path::Path;

    use super::{Format, load};

    const FORMATS: [Format; 6] = [
        Format::Auto,
        Format::Openai,
        Format::OpenaiJsonl,
        Format::Langchain,
        Format::SweAgent,
        Format::TauBench,
    ];

    /// Writes `data` to `dir/run.json` and loads it in every format, detected or
    /// given, then to `dir/run.jsonl` and loads it detected (only detection looks at
    /// the extension).
    ///
    /// * Loading never panics: runs, or an error that names the file.
    /// * Loaded runs are in the format given (a detected one said so), hold messages,
    ///   and every message has an id, unique in its run.
    /// * Loading again in the detected format gives the same runs.
    pub fn check_load(dir: &Path, data: &[u8]) -> Result<(), String> {
        for (name, formats) in [("run.json", &FORMATS[..]), ("run.jsonl", &FORMATS[..1])] {
            let path = dir.join(name);
            std::fs::write(&path, data).map_err(|e| format!("{}: {e}", path.display()))?;
            for &format in formats {
                let loaded = match load(&path, format, 1 << 20) {
                    Ok(loaded) => loaded,
                    Err(e) if format!("{e:#}").contains(name) => continue,
                    Err(e) => return Err(format!("{name} as {format:?}: {e:#} names no file")),
                };
                let what = format!("{name} as {format:?}");
                let detected = format == Format::Auto;
                if loaded.format == Format::Auto
                    || loaded.detected != detected
                    || (!detected && loaded.format != format)
                {
                    return Err(format!("{what}: loaded as {:?}", loaded.format));
                }
                if loaded.runs.iter().all(|r| r.messages.is_empty()) {
                    return Err(format!("{what}: no messages"));
                }
                for run in &loaded.runs {
                    let mut seen = HashSet::new();
                    if !run
                        .messages
                        .iter()
                        .all(|m| m.id.as_ref().is_some_and(|id| seen.insert(id)))
                    {
                        return Err(format!(
                            "{what}: run {} has a message without a unique id",
                            run.id
                        ));
                    }
                }
                if detected {
                    match load(&path, loaded.format, 1 << 20) {
                        Ok(again) if again.runs == loaded.runs => {}
                        Ok(_) => {
                            return Err(format!("{what}: loading as {:?} differs", loaded.format));
                        }
                        Err(e) => {
                            return Err(format!("{what}: as {:?} fails: {e:#}", loaded.format));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "../../../fuzz/props/corpus.rs"]
mod corpus;

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const OPENAI: &str = r#"[{"role":"system","content":"be brief"},{"role":"user","content":"list files"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"ls","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":"a.txt"},{"role":"assistant","content":"one file"}]"#;

    #[test]
    fn sizes_over_the_limit_never_read_as_the_limit() {
        let mib = 1u64 << 20;
        assert_eq!(mib_over(3_900 * mib / 1_000 + 1, mib), "3.9");
        assert_eq!(mib_over(mib + 1, mib), "1.1");
        assert_eq!(mib_over(100 * mib, 64 * mib), "100.0");
    }

    #[test]
    fn detects_each_format() {
        let d = tempfile::tempdir().unwrap();
        let cases = [
            ("a.json", OPENAI.to_owned(), Format::Openai),
            ("b.json", format!(r#"{{"messages": {OPENAI}}}"#), Format::Openai),
            ("c.json", r#"[{"type":"human","content":"hi"},{"type":"ai","content":"hello"}]"#.to_owned(), Format::Langchain),
            ("d.traj", r#"{"history":[{"role":"user","content":"fix it"}]}"#.to_owned(), Format::SweAgent),
            ("e.json", r#"[{"task_id":1,"traj":[{"role":"user","content":"x"}]}]"#.to_owned(), Format::TauBench),
            ("f.jsonl", "{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"assistant\",\"content\":\"b\"}\n".to_owned(), Format::OpenaiJsonl),
            ("g.jsonl", format!("{{\"messages\": {}}}\n", OPENAI.replace('\n', " ")), Format::OpenaiJsonl),
        ];
        for (name, text, want) in cases {
            let p = write(d.path(), name, &text);
            let loaded =
                load(&p, Format::Auto, 1 << 20).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(loaded.format, want, "{name}");
            assert!(loaded.detected);
            assert!(
                !loaded.runs.is_empty() && !loaded.runs[0].messages.is_empty(),
                "{name}"
            );
            assert!(
                loaded.runs[0].messages.iter().all(|m| m.id.is_some()),
                "{name}: ids assigned"
            );
        }
    }

    #[test]
    fn bad_files_say_what_is_wrong_and_where() {
        let d = tempfile::tempdir().unwrap();
        let cut = write(d.path(), "cut.json", &OPENAI[..OPENAI.len() / 2]);
        let err = format!("{:#}", load(&cut, Format::Auto, 1 << 20).unwrap_err());
        assert!(
            err.contains("cut.json") && err.contains("line") && err.contains("cut short"),
            "{err}"
        );

        for (name, text) in [("none.json", "[]"), ("nothing.json", r#"{"messages": []}"#)] {
            let p = write(d.path(), name, text);
            let err = format!("{:#}", load(&p, Format::Auto, 1 << 20).unwrap_err());
            assert!(
                err.contains(name)
                    && err.contains("empty conversation")
                    && !err.contains("--format"),
                "an empty conversation is not an unknown format: {err}"
            );
        }

        let empty = write(d.path(), "empty.json", "  \n");
        let err = format!("{:#}", load(&empty, Format::Auto, 1 << 20).unwrap_err());
        assert!(err.contains("empty"), "{err}");

        let bin = d.path().join("bin.json");
        std::fs::write(&bin, [0x7b, 0, 0xff, 0x10]).unwrap();
        let err = format!("{:#}", load(&bin, Format::Auto, 1 << 20).unwrap_err());
        assert!(err.contains("not text"), "{err}");

        let big = write(d.path(), "big.json", &"x".repeat(3 << 20));
        let err = format!("{:#}", load(&big, Format::Auto, 1 << 20).unwrap_err());
        assert!(err.contains("--max-file-mb"), "{err}");

        let other = write(d.path(), "other.json", r#"{"hello": 1}"#);
        let err = format!("{:#}", load(&other, Format::Auto, 1 << 20).unwrap_err());
        assert!(err.contains("--format"), "{err}");

        let twice = write(
            d.path(),
            "twice.json",
            r#"[{"type":"human","content":"a","id":"m1"},{"type":"ai","content":"b","id":"m1"}]"#,
        );
        let err = format!("{:#}", load(&twice, Format::Auto, 1 << 20).unwrap_err());
        assert!(
            err.contains("twice.json") && err.contains("messages 0 and 1") && err.contains("`m1`"),
            "{err}"
        );

        let jsonl = write(
            d.path(),
            "bad.jsonl",
            "{\"role\":\"user\",\"content\":\"a\"}\n{oops\n",
        );
        let err = format!("{:#}", load(&jsonl, Format::Auto, 1 << 20).unwrap_err());
        assert!(err.contains("line 2"), "{err}");
        assert!(!err.contains("line 1 column"), "one position: {err}");

        let blank = write(d.path(), "x.json", "]");
        let err = format!("{:#}", load(&blank, Format::Openai, 1 << 20).unwrap_err());
        assert!(
            err.ends_with("is not valid JSON at line 1, column 1: expected value"),
            "the position is said once: {err}"
        );
    }

    #[test]
    fn a_bad_run_of_several_is_skipped_and_the_others_load() {
        let d = tempfile::tempdir().unwrap();
        let good = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}"#;
        let list = write(
            d.path(),
            "runs.json",
            &format!(r#"[{good}, {{"messages": 3}}, {good}]"#),
        );
        let loaded = load(&list, Format::Auto, 1 << 20).unwrap();
        assert_eq!(loaded.runs.len(), 2);
        assert_eq!(loaded.skipped_runs.len(), 1, "{:?}", loaded.skipped_runs);
        assert!(
            loaded.skipped_runs[0].contains("runs.json")
                && loaded.skipped_runs[0].contains("run 1"),
            "{:?}",
            loaded.skipped_runs
        );

        let lines = write(
            d.path(),
            "runs.jsonl",
            &format!("{good}\n{{oops\n{{\"role\":\"user\",\"content\":\"x\"}}\n{good}\n"),
        );
        let loaded = load(&lines, Format::Auto, 1 << 20).unwrap();
        assert_eq!(loaded.runs.len(), 2);
        let why = loaded.skipped_runs.join("\n");
        assert!(
            why.contains("line 2 is not valid JSON") && why.contains("line 3 is not a"),
            "{why}"
        );

        // With no run readable, the file is refused, with the first reason.
        let none = write(
            d.path(),
            "none.json",
            r#"[{"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, {"messages": 2}]"#,
        );
        let err = format!("{:#}", load(&none, Format::Auto, 1 << 20).unwrap_err());
        assert!(
            err.contains("run none-0") && err.contains("and 1 more run of"),
            "{err}"
        );
    }

    #[test]
    fn a_request_log_folds_each_call_into_the_next() {
        let d = tempfile::tempdir().unwrap();
        let m = |i: usize| {
            if i.is_multiple_of(2) {
                format!(r#"{{"role":"user","content":"q{i}"}}"#)
            } else {
                format!(r#"{{"role":"assistant","content":"a{i}"}}"#)
            }
        };
        let request = |range: std::ops::Range<usize>| {
            let messages: Vec<String> = range.map(m).collect();
            format!(r#"{{"model":"x","messages":[{}]}}"#, messages.join(","))
        };
        // One conversation logged at each of its three calls, then another run of two
        // calls, which starts over, then a line that only shares the first run's start.
        let text = [
            request(0..1),
            request(0..3),
            request(0..5),
            request(10..11),
            request(10..13),
            request(0..2),
        ]
        .join("\n");
        let log = write(d.path(), "requests.jsonl", &text);
        let loaded = load(&log, Format::Auto, 1 << 20).unwrap();
        assert_eq!(loaded.folded, 3);
        let lengths: Vec<usize> = loaded.runs.iter().map(|r| r.messages.len()).collect();
        assert_eq!(lengths, [5, 3, 2]);
        assert_eq!(loaded.runs[0].id, "requests-3");
    }

    /// Every input of `fuzz/corpus/trajectory_import/` loads as the fuzz target checks.
    #[test]
    fn trajectory_import_corpus_replays() {
        let d = tempfile::tempdir().unwrap();
        super::corpus::replay("trajectory_import", |data| {
            fuzzing::check_load(d.path(), data)
        });
    }

    #[test]
    fn a_directory_expands_to_its_run_files() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "b.json", "[]");
        write(d.path(), "a.traj", "{}");
        write(d.path(), "notes.txt", "x");
        let (files, unreadable) = expand(&[d.path().to_owned()]).unwrap();
        assert!(unreadable.is_empty());
        let names: Vec<_> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a.traj", "b.json"]);
        let empty = tempfile::tempdir().unwrap();
        assert!(expand(&[empty.path().to_owned()]).is_err());

        // The directory and one of its files: that file once.
        let named = d.path().join("a.traj");
        let both = expand(&[d.path().to_owned(), named.clone(), named.clone()])
            .unwrap()
            .0;
        let (kept, repeats) = without_repeats(both);
        assert_eq!(kept, files);
        assert_eq!(repeats, [named.clone(), named]);

        // A broken link is said, not left out in silence.
        #[cfg(unix)]
        {
            let gone = d.path().join("gone.json");
            std::os::unix::fs::symlink(d.path().join("nowhere.json"), &gone).unwrap();
            let (files, unreadable) = expand(&[d.path().to_owned()]).unwrap();
            assert_eq!(files.len(), 2);
            assert_eq!(unreadable.len(), 1, "{unreadable:?}");
            assert_eq!(unreadable[0].0, gone);
            assert_eq!(unreadable[0].1, "it is a link to nothing");
        }
    }
}
