use std::fmt::Write as _;
use std::sync::Arc;

use keel_message::{Message, ToolArguments, ToolCall, ToolSpec};
use serde_json::{Map, Value, json};

use crate::error::{OffloadError, Shown};
use crate::key::{Key, StorePath, ThreadId};
use crate::lineage::{Lineage, LineageStore};
use crate::policy::{cap_chars, thousands};
use crate::store::{GrepOptions, LineRange, OffloadStore, Pattern};

/// Name of the tool that lists offloaded files.
pub const LS: &str = "ls";
/// Name of the tool that reads lines of an offloaded file.
pub const READ_FILE: &str = "read_file";
/// Name of the tool that searches offloaded files.
pub const GREP: &str = "grep";

/// Output limits of the retrieval tools, so that reading back offloaded text cannot
/// flood the context it was offloaded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolLimits {
    /// Any tool output is cut to this many characters (default 30,000: about 7,500
    /// tokens, well under the eviction threshold).
    pub max_output_chars: usize,
    /// Each line shown by `read_file` is cut to this many characters (default 2,000).
    pub max_line_chars: usize,
    /// Lines `read_file` returns when no `limit` is given (default 100).
    pub default_read_lines: usize,
    /// Largest `limit` `read_file` accepts; larger ones are lowered to it (default 500).
    pub max_read_lines: usize,
    /// Entries `ls` shows at most (default 200).
    pub max_ls_entries: usize,
    /// Matches `grep` returns when no `max_results` is given (default 50).
    pub default_grep_results: usize,
    /// Largest `max_results` `grep` accepts; larger ones are lowered to it (default 200).
    pub max_grep_results: usize,
    /// Each line shown by `grep` is cut to this many characters (default 300).
    pub grep_line_chars: usize,
}

impl Default for ToolLimits {
    fn default() -> Self {
        ToolLimits {
            max_output_chars: 30_000,
            max_line_chars: 2_000,
            default_read_lines: 100,
            max_read_lines: 500,
            max_ls_entries: 200,
            default_grep_results: 50,
            max_grep_results: 200,
            grep_line_chars: 300,
        }
    }
}

impl ToolLimits {
    /// The defaults sized for a prompt budget of `budget_tokens` (a model's window less
    /// its reply), so that one read cannot fill a small window: output is cut to the
    /// budget in characters (about a quarter of it in tokens; at least 2,000 and at
    /// most the default 30,000), and `read_file` without a `limit` returns a line per
    /// 80 tokens of budget (5 to 100), as the stubs of
    /// [`EvictLargeResults::for_budget`](crate::EvictLargeResults::for_budget) suggest.
    /// keel-agent uses it for its retrieval and file tools when their limits are left
    /// at the defaults.
    ///
    /// ```
    /// use keel_offload::ToolLimits;
    ///
    /// assert_eq!(ToolLimits::for_budget(200_000), ToolLimits::default());
    /// let small = ToolLimits::for_budget(1_536); // a 2,048-token window
    /// assert_eq!((small.max_output_chars, small.default_read_lines), (2_000, 19));
    /// ```
    pub fn for_budget(budget_tokens: usize) -> Self {
        let default = ToolLimits::default();
        ToolLimits {
            max_output_chars: budget_tokens.clamp(2_000, default.max_output_chars),
            default_read_lines: (budget_tokens / 80).clamp(5, default.default_read_lines),
            ..default
        }
    }
}

/// Why a retrieval tool call failed.
///
/// The message of every variant is written for the model: send it back as the tool
/// result (what [`RetrievalTools::respond`] does) and the agent can correct its call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// The call names a tool this executor does not run.
    #[error("unknown tool `{name}`: the offload tools are ls, read_file and grep")]
    UnknownTool {
        /// The name called.
        name: String,
    },
    /// The arguments do not fit the tool's schema.
    #[error("{tool}: bad arguments: {problem}")]
    BadArguments {
        /// The tool called.
        tool: &'static str,
        /// What is wrong, naming the argument.
        problem: String,
    },
    /// The store refused or failed: an invalid or missing path, a symbolic link, I/O.
    #[error("{tool}: {source}")]
    Store {
        /// The tool called.
        tool: &'static str,
        /// The store's error.
        #[source]
        source: OffloadError,
    },
}

/// The agent's way back to what was offloaded: `ls`, `read_file` and `grep` over one
/// thread's namespace of a store, each with a JSON schema and capped output.
///
/// ```
/// use std::sync::Arc;
/// use keel_offload::message::ToolCall;
/// use keel_offload::{Key, MemoryStore, OffloadStore, RetrievalTools, ThreadId};
/// use serde_json::json;
///
/// let store = Arc::new(MemoryStore::new());
/// store.put(&Key::new("t1", "large_tool_results/call_1")?, "alpha\nbeta\ngamma\n")?;
/// let tools = RetrievalTools::new(store, ThreadId::new("t1")?);
/// assert_eq!(tools.specs().len(), 3);
///
/// let read = ToolCall::new("c9", "read_file", json!({"path": "large_tool_results/call_1", "offset": 1, "limit": 1}));
/// assert_eq!(tools.execute(&read)?, "     2\tbeta\n[more lines follow: continue with offset=2]");
///
/// let grep = ToolCall::new("c10", "grep", json!({"pattern": "^g"}));
/// assert_eq!(tools.execute(&grep)?, "large_tool_results/call_1:3: gamma");
///
/// let escape = ToolCall::new("c11", "read_file", json!({"path": "../../etc/passwd"}));
/// assert!(tools.execute(&escape).unwrap_err().to_string().contains("`..`"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RetrievalTools {
    /// The thread's files as the lineage sees them.
    store: Arc<dyn OffloadStore>,
    /// The store below the view.
    raw: Arc<dyn OffloadStore>,
    thread: ThreadId,
    limits: ToolLimits,
}

impl std::fmt::Debug for RetrievalTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetrievalTools")
            .field("thread", &self.thread)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl RetrievalTools {
    /// The tools over `thread`'s namespace of `store`, with default limits. They read
    /// every file of the thread (as [`Lineage::unscoped`] sees it; keel's own
    /// [`LINEAGE_DIR`](crate::LINEAGE_DIR) is hidden); [`with_lineage`](Self::with_lineage)
    /// narrows them to one branch of the thread.
    pub fn new(store: Arc<dyn OffloadStore>, thread: ThreadId) -> Self {
        let view = LineageStore::new(store.clone(), thread.clone(), Lineage::unscoped());
        RetrievalTools {
            store: Arc::new(view),
            raw: store,
            thread,
            limits: ToolLimits::default(),
        }
    }

    /// Reads the thread as `lineage` sees it: the branch of its history the call's
    /// checkpoint is on (the archive up to the fork point plus the branch's own
    /// records, never another branch's).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use keel_offload::message::ToolCall;
    /// use keel_offload::{Key, Lineage, LineageStore, MemoryStore, OffloadStore, RetrievalTools, ThreadId};
    /// use serde_json::json;
    ///
    /// let store = Arc::new(MemoryStore::new());
    /// let thread = ThreadId::new("t1")?;
    /// let fork_point = Lineage::new();
    /// let main = LineageStore::new(store.clone(), thread.clone(), fork_point.clone());
    /// main.put(&Key::new("t1", "large_tool_results/call_9")?, "stored after the fork point")?;
    ///
    /// let grep = ToolCall::new("c1", "grep", json!({"pattern": "fork point"}));
    /// let on_main = RetrievalTools::new(store.clone(), thread.clone()).with_lineage(main.lineage());
    /// assert!(on_main.execute(&grep)?.contains("call_9"));
    /// let on_fork = RetrievalTools::new(store.clone(), thread.clone()).with_lineage(fork_point);
    /// assert!(on_fork.execute(&grep)?.starts_with("No lines match"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn with_lineage(mut self, lineage: Lineage) -> Self {
        self.store = Arc::new(LineageStore::new(
            self.raw.clone(),
            self.thread.clone(),
            lineage,
        ));
        self
    }

    /// Reads the thread as the lineage a runtime handed `ctx` sees it
    /// ([`Lineage::of_tool_call`]; keel-agent hands every tool call the lineage of its
    /// checkpoint); unchanged when it handed none. A value that is not a lineage is an
    /// error, never a wider view.
    pub fn with_lineage_of(self, ctx: &keel_message::ToolContext) -> Result<Self, OffloadError> {
        Ok(match Lineage::of_tool_call(ctx)? {
            Some(lineage) => self.with_lineage(lineage),
            None => self,
        })
    }

    /// Sets the output limits.
    #[must_use]
    pub fn with_limits(mut self, limits: ToolLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> &ToolLimits {
        &self.limits
    }

    /// True for the names this executor runs.
    pub fn handles(name: &str) -> bool {
        matches!(name, LS | READ_FILE | GREP)
    }

    /// The three tools, described for the model, with JSON schemas of their arguments.
    pub fn specs(&self) -> Vec<ToolSpec> {
        let l = &self.limits;
        vec![
            ToolSpec::new(
                LS,
                format!(
                    "List the files stored for this conversation (large tool results, truncated \
                     arguments, the archived history) with their sizes. Shows at most {} entries.",
                    l.max_ls_entries
                ),
                json!({
                    "type": "object",
                    "properties": {
                        "path": {
                            "type": "string",
                            "description": "A directory or file to list, relative (e.g. `large_tool_results`). Omit to list everything."
                        }
                    },
                    "additionalProperties": false
                }),
            ),
            ToolSpec::new(
                READ_FILE,
                format!(
                    "Read lines of a stored file, numbered from 1. Returns `limit` lines (default \
                     {}, at most {}) starting after `offset` lines; long lines are cut to {} \
                     characters and the output to {} characters.",
                    l.default_read_lines, l.max_read_lines, l.max_line_chars, l.max_output_chars
                ),
                json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "The file, relative (e.g. `large_tool_results/call_1`)."},
                        "offset": {"type": "integer", "minimum": 0, "description": "Lines to skip from the start (0 = from the first line)."},
                        "limit": {"type": "integer", "minimum": 1, "maximum": l.max_read_lines, "description": "Number of lines to return."}
                    },
                    "required": ["path"],
                    "additionalProperties": false
                }),
            ),
            ToolSpec::new(
                GREP,
                format!(
                    "Search stored files for lines matching a regular expression (Rust regex \
                     syntax; `^` and `$` match at line ends). Returns `path:line: text` for up \
                     to `max_results` lines (default {}, at most {}).",
                    l.default_grep_results, l.max_grep_results
                ),
                json!({
                    "type": "object",
                    "properties": {
                        "pattern": {"type": "string", "description": "The regular expression, matched within one line at a time."},
                        "path": {"type": "string", "description": "A file or directory to search, relative. Omit to search everything."},
                        "max_results": {"type": "integer", "minimum": 1, "maximum": l.max_grep_results, "description": "Most matching lines to return."}
                    },
                    "required": ["pattern"],
                    "additionalProperties": false
                }),
            ),
        ]
    }

    /// Runs a call to one of the tools and returns its result text.
    pub fn execute(&self, call: &ToolCall) -> Result<String, ToolError> {
        match call.name.as_str() {
            LS => self.ls(&arguments(LS, call, &["path"])?),
            READ_FILE => self.read_file(&arguments(READ_FILE, call, &["path", "offset", "limit"])?),
            GREP => self.grep(&arguments(GREP, call, &["pattern", "path", "max_results"])?),
            other => Err(ToolError::UnknownTool {
                name: other.to_owned(),
            }),
        }
    }

    /// Runs a call and wraps the result in a tool message answering it; an error
    /// becomes the message's text (`Error: ...`) so the model can correct itself.
    pub fn respond(&self, call: &ToolCall) -> Message {
        let text = match self.execute(call) {
            Ok(text) => text,
            Err(e) => format!("Error: {e}"),
        };
        Message::tool(call.id.clone(), text).with_name(call.name.clone())
    }

    fn ls(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        let path = optional_path(LS, args)?;
        let entries = self
            .store
            .list(&self.thread, path.as_ref())
            .map_err(|source| ToolError::Store {
                tool: LS,
                source: source.within(self.thread.as_str()),
            })?;
        let place = path
            .as_ref()
            .map(|p| format!(" under {p}"))
            .unwrap_or_default();
        if entries.is_empty() {
            return Ok(format!("No files{place}."));
        }
        let mut out = format!("{}{place}:\n", files(entries.len()));
        let shown = entries.len().min(self.limits.max_ls_entries);
        let mut capped = false;
        let mut chars = out.chars().count();
        for e in &entries[..shown] {
            let line = format!("{}\t{} bytes\n", e.path, thousands(e.bytes as usize));
            let n = line.chars().count();
            if chars + n > output_room(self.limits.max_output_chars) {
                capped = true;
                break;
            }
            chars += n;
            out.push_str(&line);
        }
        if capped || shown < entries.len() {
            let _ = write!(
                out,
                "[list cut short: pass a narrower path to see the rest]"
            );
        }
        Ok(out.trim_end().to_owned())
    }

    fn read_file(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        let path = required_path(READ_FILE, args, "path")?;
        let offset = integer(READ_FILE, args, "offset", 0)?.unwrap_or(0);
        let limit = integer(READ_FILE, args, "limit", 1)?
            .unwrap_or(self.limits.default_read_lines)
            .min(self.limits.max_read_lines);
        let key = Key::from_parts(self.thread.clone(), path);
        let range = LineRange {
            offset,
            limit,
            // Room for `max_line_chars` characters of any width.
            max_line_bytes: self.limits.max_line_chars.saturating_mul(4),
        };
        let lines = self
            .store
            .read_lines(&key, &range)
            .map_err(|source| ToolError::Store {
                tool: READ_FILE,
                source: source.within(self.thread.as_str()),
            })?;
        if lines.lines.is_empty() {
            return Ok(match lines.total_lines {
                Some(0) => "The file is empty.".to_owned(),
                Some(total) => format!(
                    "Offset {offset} is past the end: the file has {} lines.",
                    thousands(total)
                ),
                None => "No lines.".to_owned(),
            });
        }
        let mut out = String::new();
        let mut chars = 0;
        let mut next = offset;
        for line in &lines.lines {
            let text = show_line(&line.text, line.truncated, self.limits.max_line_chars);
            let row = format!("{:>6}\t{text}\n", line.number);
            let n = row.chars().count();
            if chars + n > output_room(self.limits.max_output_chars) && !out.is_empty() {
                let _ = write!(
                    out,
                    "[output capped at {} characters: continue with offset={next}]",
                    thousands(self.limits.max_output_chars)
                );
                return Ok(out);
            }
            chars += n;
            out.push_str(&row);
            next = line.number;
        }
        if lines.more {
            let _ = write!(out, "[more lines follow: continue with offset={next}]");
        } else if let Some(total) = lines.total_lines {
            let lines = if total == 1 {
                "1 line".to_owned()
            } else {
                format!("{} lines", thousands(total))
            };
            let _ = write!(out, "[end of file: {lines}]");
        }
        Ok(out)
    }

    fn grep(&self, args: &Map<String, Value>) -> Result<String, ToolError> {
        let pattern_text =
            string(GREP, args, "pattern")?.ok_or_else(|| ToolError::BadArguments {
                tool: GREP,
                problem: "`pattern` is required".into(),
            })?;
        let pattern = Pattern::new(pattern_text).map_err(|e| ToolError::BadArguments {
            tool: GREP,
            problem: e.to_string(),
        })?;
        let path = optional_path(GREP, args)?;
        let max_results = integer(GREP, args, "max_results", 1)?
            .unwrap_or(self.limits.default_grep_results)
            .min(self.limits.max_grep_results);
        let options = GrepOptions {
            max_results,
            max_line_bytes: self.limits.grep_line_chars.saturating_mul(4),
        };
        let found = self
            .store
            .grep(&self.thread, path.as_ref(), &pattern, &options)
            .map_err(|source| ToolError::Store {
                tool: GREP,
                source: source.within(self.thread.as_str()),
            })?;
        if found.matches.is_empty() {
            return Ok(format!(
                "No lines match {} in {}.",
                Shown::new(pattern_text),
                files(found.files_searched)
            ));
        }
        let mut out = String::new();
        let mut chars = 0;
        for m in &found.matches {
            let text = show_line(&m.line, m.truncated, self.limits.grep_line_chars);
            let row = if m.from_byte > 0 {
                format!(
                    "{}:{}: [from byte {} of the line] …{text}\n",
                    m.path,
                    m.line_number,
                    thousands(m.from_byte)
                )
            } else {
                format!("{}:{}: {text}\n", m.path, m.line_number)
            };
            let n = row.chars().count();
            if chars + n > output_room(self.limits.max_output_chars) && !out.is_empty() {
                let _ = write!(
                    out,
                    "[output capped at {} characters: narrow the pattern or the path]",
                    thousands(self.limits.max_output_chars)
                );
                return Ok(out);
            }
            chars += n;
            out.push_str(&row);
        }
        if found.truncated {
            let _ = write!(
                out,
                "[stopped at {max_results} matches: narrow the pattern or the path]"
            );
        }
        Ok(out.trim_end().to_owned())
    }
}

/// "1 file", "2 files".
fn files(n: usize) -> String {
    if n == 1 {
        "1 file".to_owned()
    } else {
        format!("{} files", thousands(n))
    }
}

/// What a tool's output may hold before the note that says it was cut, so the
/// output, note included, stays within `max_output_chars` (keel-agent's file tools
/// cut theirs the same way).
pub fn output_room(max_output_chars: usize) -> usize {
    max_output_chars.saturating_sub(NOTE_ROOM.min(max_output_chars / 4))
}

/// Room kept for the note ending a cut output (the longest is under 100 characters),
/// at most a quarter of the output.
const NOTE_ROOM: usize = 100;

/// A line cut to `max` characters. A line the store already cut (its full length
/// unknown here) is marked `[line cut]`; otherwise the note says how much is hidden.
fn show_line(text: &str, cut_by_store: bool, max: usize) -> String {
    if cut_by_store {
        let kept: String = text.chars().take(max).collect();
        format!("{kept}… [line cut]")
    } else {
        cap_chars(text, max).into_owned()
    }
}

/// The call's arguments as an object with only `allowed` keys (`null` counts as `{}`).
fn arguments(
    tool: &'static str,
    call: &ToolCall,
    allowed: &[&str],
) -> Result<Map<String, Value>, ToolError> {
    let bad = |problem: String| ToolError::BadArguments { tool, problem };
    let map = match &call.arguments {
        ToolArguments::Invalid(raw) => {
            return Err(bad(format!(
                "arguments are not valid JSON: {}",
                Shown::new(raw)
            )));
        }
        args => match args.as_json() {
            Some(Value::Object(map)) => map.clone(),
            Some(Value::Null) | None => Map::new(),
            Some(_) => return Err(bad("arguments must be a JSON object".into())),
        },
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(format!(
            "unknown argument `{unknown}` (expected {})",
            allowed.join(", ")
        )));
    }
    Ok(map)
}

fn string<'a>(
    tool: &'static str,
    args: &'a Map<String, Value>,
    name: &str,
) -> Result<Option<&'a str>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ToolError::BadArguments {
            tool,
            problem: format!("`{name}` must be a string"),
        }),
    }
}

fn integer(
    tool: &'static str,
    args: &Map<String, Value>,
    name: &str,
    min: u64,
) -> Result<Option<usize>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            _ => Err(ToolError::BadArguments {
                tool,
                problem: format!("`{name}` must be an integer of at least {min}, got {v}"),
            }),
        },
    }
}

/// A path argument: validated as a [`StorePath`]; `""`, `.` and absence mean the
/// whole namespace.
fn optional_path(
    tool: &'static str,
    args: &Map<String, Value>,
) -> Result<Option<StorePath>, ToolError> {
    match string(tool, args, "path")? {
        None | Some("" | ".") => Ok(None),
        Some(p) => StorePath::new(p)
            .map(Some)
            .map_err(|source| ToolError::Store { tool, source }),
    }
}

fn required_path(
    tool: &'static str,
    args: &Map<String, Value>,
    name: &str,
) -> Result<StorePath, ToolError> {
    let p = string(tool, args, name)?.ok_or_else(|| ToolError::BadArguments {
        tool,
        problem: format!("`{name}` is required"),
    })?;
    StorePath::new(p).map_err(|source| ToolError::Store { tool, source })
}
