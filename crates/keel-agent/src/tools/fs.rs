//! The built-in file tools: `ls`, `read_file`, `grep`, `write_file` and `edit_file`,
//! rooted in one directory. See [`FileTools`].

mod args;
mod ops;
mod path;
mod search;
mod text;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_message::{Tool, ToolCall, ToolContext, ToolError, ToolFuture, ToolSpec};
use keel_offload::{OffloadStore, RetrievalTools, ThreadId, ToolLimits};
use serde_json::{Map, Value, json};

use self::path::{Relative, Root};
use self::text::thousands;

/// Name of the tool that lists a directory.
pub const LS: &str = keel_offload::LS;
/// Name of the tool that reads numbered lines of a file.
pub const READ_FILE: &str = keel_offload::READ_FILE;
/// Name of the tool that searches files with a regular expression.
pub const GREP: &str = keel_offload::GREP;
/// Name of the tool that creates a file.
pub const WRITE_FILE: &str = "write_file";
/// Name of the tool that replaces a string in a file.
pub const EDIT_FILE: &str = "edit_file";

/// Top-level paths that, with [`FileTools::with_offload`], are read from the offload
/// store instead of the root: large tool results evicted from the context, the
/// archived history (`archive/messages.jsonl`), and long arguments of earlier
/// `write_file`/`edit_file` calls.
pub const OFFLOAD_DIRS: [&str; 3] = ["large_tool_results", "archive", "truncated_arguments"];

/// Limits of the file tools beyond the output caps of [`ToolLimits`]: what they
/// write and how much `grep` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLimits {
    /// Largest `content` `write_file` accepts, and largest file `edit_file` edits
    /// (before and after the edit), in bytes (default 10 MiB).
    pub max_write_bytes: usize,
    /// Files one `grep` call opens at most (default 10,000). The walk also stops after
    /// visiting ten times as many paths (directories, links, files of other names), so
    /// a tree of empty directories cannot keep it going.
    pub max_grep_files: usize,
    /// Bytes one `grep` call reads at most, over all files (default 256 MiB).
    pub max_grep_bytes: u64,
}

impl Default for FileLimits {
    fn default() -> Self {
        FileLimits {
            max_write_bytes: 10 * 1024 * 1024,
            max_grep_files: 10_000,
            max_grep_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Why [`FileTools::new`] refused a root.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileToolsError {
    /// The root does not exist or cannot be resolved.
    #[error("the file tools' root {} cannot be used: {source}", path.display())]
    Root {
        /// The root given.
        path: PathBuf,
        /// Why it cannot be resolved.
        #[source]
        source: io::Error,
    },
    /// The root is not a directory.
    #[error("the file tools' root {} is not a directory", path.display())]
    NotADirectory {
        /// The root given.
        path: PathBuf,
    },
}

/// The file tools over one directory: build it, configure it, and hand
/// [`tools`](FileTools::tools) to the agent.
///
/// They follow the filesystem tools of LangChain's Deep Agents: `ls` lists a
/// directory, `read_file` shows numbered lines a page at a time, `grep` searches with a
/// regular expression, `write_file` only creates files, `edit_file` replaces an exact
/// string. Every path is relative to the root; absolute paths, `..` that climbs above
/// the root, symbolic links that lead out of it and NUL bytes are refused with a
/// message the model can act on. Memory is bounded: lines are streamed (a 10 GB log
/// costs a 64 KiB buffer), outputs are capped by [`ToolLimits`], writes and edits by
/// [`FileLimits`] (an edit's size is checked before it is made), and `grep` stops
/// after a number of files and bytes and does not read an ignore file that is a link
/// or a special file. Time is bounded by those and by the call's own life: a pattern
/// that is slow to match (`[\p{L}\p{N}]{200}Z` runs at about 2 s a MiB) could take
/// minutes on `grep`'s byte budget, so a `grep` whose call is dropped (the agent's
/// tool timeout, a cancelled run) stops at its next line instead of holding a thread
/// of the blocking pool to the end. Writes are atomic (a temporary file in the same
/// directory, then a rename).
///
/// The root is a boundary against the model's arguments, not against another process
/// that can write in it at the same time. A path is checked (canonicalized, every link
/// resolved) and then opened by name, so such a process swapping a directory or a file
/// for a link between the two can make a call read or write outside the root. A hard
/// link in the root to a file outside is read like any file in it (`edit_file`
/// replaces the link with a file, and leaves its target as it was). Root the tools in
/// a directory that nothing else writes in while the agent runs, such as a copy of
/// the tree, when the model's reach must stop at it.
///
/// The arguments each tool takes (its [`ToolSpec`]'s JSON schema says the same to the
/// model; an argument not listed is refused with the list):
///
/// | tool | arguments (required in bold) |
/// |---|---|
/// | `ls` | `path` (default: the root) |
/// | `read_file` | **`path`**, `offset` (lines to skip, default 0), `limit` (lines, default [`ToolLimits::default_read_lines`]) |
/// | `grep` | **`pattern`** (a Rust regex), `path` (default: the root), `glob` (e.g. `*.rs`), `max_results` |
/// | `write_file` | **`path`**, **`content`** (never overwrites) |
/// | `edit_file` | **`path`**, **`old_string`**, **`new_string`**, `replace_all` (default false) |
///
/// # What left the context
///
/// With [`with_offload`](FileTools::with_offload), `ls`, `read_file` and `grep` calls
/// whose path lies under one of [`OFFLOAD_DIRS`] (`large_tool_results/`, `archive/`,
/// `truncated_arguments/`) are served from the [`OffloadStore`] by keel-offload's
/// [`RetrievalTools`], in the thread of the call ([`ToolContext::thread_id`]; a call
/// without one fails). Those are the paths the compaction stubs name —
/// `read_file(path="large_tool_results/call_1", offset=5, limit=100)`, the history at
/// `archive/messages.jsonl`, truncated arguments at `truncated_arguments/<call>/<arg>` —
/// so the agent reads what left its context with the tools it reads the project with;
/// the tool descriptions say so. `grep` without a path searches the root only.
///
/// A root that has top-level directories of those names is **shadowed**: with an
/// offload store they cannot be reached through these tools, and `ls` and `grep` of the
/// root leave them out. Without an offload store they are ordinary directories.
///
/// # Blocking
///
/// All filesystem work runs on Tokio's blocking pool (`spawn_blocking`), so a call
/// never blocks the async runtime. Called outside a Tokio runtime, a tool does its work
/// inline on the calling thread.
///
/// # Example
///
/// ```
/// use keel_agent::tools::{EDIT_FILE, FileTools, READ_FILE, WRITE_FILE};
/// use keel_message::{Tool, ToolContext};
/// use serde_json::json;
///
/// let dir = tempfile::tempdir()?;
/// let tools = FileTools::new(dir.path())?.tools();
/// assert_eq!(tools.len(), 5);
/// let tool = |name: &str| tools.iter().find(|t| t.spec().name == name).cloned().ok_or("no such tool");
/// let (write, edit, read) = (tool(WRITE_FILE)?, tool(EDIT_FILE)?, tool(READ_FILE)?);
///
/// let rt = tokio::runtime::Builder::new_current_thread().build()?;
/// rt.block_on(async {
///     let ctx = || ToolContext::new("call_1");
///     let out = write.call(json!({"path": "notes/todo.md", "content": "one\ntwo\n"}), ctx()).await?;
///     assert_eq!(out, "Created notes/todo.md (2 lines, 8 bytes).");
///
///     edit.call(json!({"path": "notes/todo.md", "old_string": "two", "new_string": "three"}), ctx()).await?;
///     let page = read.call(json!({"path": "notes/todo.md"}), ctx()).await?;
///     assert_eq!(page, "     1\tone\n     2\tthree\n[end of file: 2 lines]");
///
///     // Paths stay inside the root, and the error tells the model why.
///     let escape = read.call(json!({"path": "../secrets.txt"}), ctx()).await.unwrap_err();
///     assert!(escape.to_string().contains("leaves the root directory"));
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct FileTools {
    root: Root,
    limits: ToolLimits,
    file_limits: FileLimits,
    offload: Option<Arc<dyn OffloadStore>>,
    read_only: bool,
    /// Short tool descriptions (`None`: the agent builder chooses by the budget).
    brief: Option<bool>,
    /// What `grep` keeps between calls: compiled patterns, parsed .gitignore files.
    grep_cache: Arc<search::GrepCache>,
}

impl fmt::Debug for FileTools {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileTools")
            .field("root", &self.root.dir())
            .field("limits", &self.limits)
            .field("file_limits", &self.file_limits)
            .field("offload", &self.offload.is_some())
            .field("read_only", &self.read_only)
            .field("brief", &self.brief)
            .finish()
    }
}

impl FileTools {
    /// The tools over `root`, canonicalized now (symbolic links resolved): every path
    /// the model gives is taken relative to it and must stay inside it.
    pub fn new(root: impl AsRef<Path>) -> Result<Self, FileToolsError> {
        let given = root.as_ref();
        let dir = given
            .canonicalize()
            .map_err(|source| FileToolsError::Root {
                path: given.to_owned(),
                source,
            })?;
        if !dir.is_dir() {
            return Err(FileToolsError::NotADirectory {
                path: given.to_owned(),
            });
        }
        Ok(FileTools {
            root: Root::new(dir),
            limits: ToolLimits::default(),
            file_limits: FileLimits::default(),
            offload: None,
            read_only: false,
            brief: None,
            grep_cache: Arc::default(),
        })
    }

    /// Only `ls`, `read_file` and `grep`: [`tools`](FileTools::tools) leaves out the
    /// tools that write.
    #[must_use]
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Short tool descriptions: what each tool does and its arguments, without the
    /// limits and the details the long ones spell out (about 300 tokens less for the
    /// three read tools). The agent builder gives them short descriptions on its own
    /// when the prompt budget is under [`BRIEF_SPECS_BELOW`] tokens, where the long
    /// ones would take a fifth of every prompt or more; this setting overrides that.
    ///
    /// ```
    /// use keel_agent::tools::FileTools;
    /// use keel_message::Tool;
    ///
    /// let long = FileTools::new(".")?.read_only().with_brief_specs(false);
    /// let short = FileTools::new(".")?.read_only().with_brief_specs(true);
    /// let size = |t: &FileTools| -> usize {
    ///     t.tools().iter().map(|t| t.spec().description.len()).sum()
    /// };
    /// assert!(size(&short) * 2 < size(&long));
    /// # Ok::<(), keel_agent::tools::FileToolsError>(())
    /// ```
    #[must_use]
    pub fn with_brief_specs(mut self, brief: bool) -> Self {
        self.brief = Some(brief);
        self
    }

    /// Whether the descriptions are short; `None` when left to the agent builder.
    pub fn brief_specs(&self) -> Option<bool> {
        self.brief
    }

    /// Sets the output caps, shared with keel-offload's retrieval tools: characters
    /// per output and per line, lines per `read_file`, entries per `ls`, matches per
    /// `grep`.
    #[must_use]
    pub fn with_limits(mut self, limits: ToolLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the write and search limits.
    #[must_use]
    pub fn with_file_limits(mut self, limits: FileLimits) -> Self {
        self.file_limits = limits;
        self
    }

    /// Serves paths under [`OFFLOAD_DIRS`] from `store`, in the thread of each call
    /// (see [What left the context](FileTools#what-left-the-context)); such calls fail
    /// when the runtime gives no thread id. Top-level directories of those names in the
    /// root are shadowed.
    #[must_use]
    pub fn with_offload(mut self, store: Arc<dyn OffloadStore>) -> Self {
        self.offload = Some(store);
        self
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        self.root.dir()
    }

    /// The output caps in force.
    pub fn limits(&self) -> &ToolLimits {
        &self.limits
    }

    /// The write and search limits in force.
    pub fn file_limits(&self) -> &FileLimits {
        &self.file_limits
    }

    /// True when built with [`read_only`](FileTools::read_only).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The tools: `ls`, `read_file`, `grep`, then `write_file` and `edit_file`
    /// unless read-only. They share this configuration; changing `self` afterwards
    /// does not change them.
    pub fn tools(&self) -> Vec<Arc<dyn Tool>> {
        let shared = Arc::new(self.clone());
        let kinds: &[Kind] = if self.read_only {
            &[Kind::Ls, Kind::ReadFile, Kind::Grep]
        } else {
            &[
                Kind::Ls,
                Kind::ReadFile,
                Kind::Grep,
                Kind::WriteFile,
                Kind::EditFile,
            ]
        };
        kinds
            .iter()
            .map(|&kind| {
                Arc::new(FileTool {
                    kind,
                    shared: Arc::clone(&shared),
                }) as Arc<dyn Tool>
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ls,
    ReadFile,
    Grep,
    WriteFile,
    EditFile,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Ls => LS,
            Kind::ReadFile => READ_FILE,
            Kind::Grep => GREP,
            Kind::WriteFile => WRITE_FILE,
            Kind::EditFile => EDIT_FILE,
        }
    }

    fn arguments(self) -> &'static [&'static str] {
        match self {
            Kind::Ls => &["path"],
            Kind::ReadFile => &["path", "offset", "limit"],
            Kind::Grep => &["pattern", "path", "glob", "max_results"],
            Kind::WriteFile => &["path", "content"],
            Kind::EditFile => &["path", "old_string", "new_string", "replace_all"],
        }
    }
}

/// One of the tools; all share the configuration they were made from.
struct FileTool {
    kind: Kind,
    shared: Arc<FileTools>,
}

impl fmt::Debug for FileTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileTool")
            .field("name", &self.kind.name())
            .field("root", &self.shared.root.dir())
            .finish()
    }
}

impl Tool for FileTool {
    fn spec(&self) -> ToolSpec {
        spec(self.kind, &self.shared)
    }

    fn call(&self, arguments: Value, ctx: ToolContext) -> ToolFuture<'_> {
        let kind = self.kind;
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let args = args::object(arguments, kind.arguments())?;
            if let Some(store) = &shared.offload
                && matches!(kind, Kind::Ls | Kind::ReadFile | Kind::Grep)
            {
                let path = args::optional_path(&args)?;
                if is_offloaded(&path) {
                    let store = Arc::clone(store);
                    return offloaded(kind, store, shared.limits, args, &path, &ctx).await;
                }
            }
            blocking(move || match kind {
                Kind::Ls => ops::ls(&shared, &args),
                Kind::ReadFile => ops::read_file(&shared, &args),
                Kind::Grep => search::grep(&shared, &args),
                Kind::WriteFile => ops::write_file(&shared, &args),
                Kind::EditFile => ops::edit_file(&shared, &args),
            })
            .await
        })
    }
}

/// True when `path` lies under (or is) one of [`OFFLOAD_DIRS`].
fn is_offloaded(path: &Relative) -> bool {
    path.first()
        .is_some_and(|first| OFFLOAD_DIRS.contains(&first))
}

/// Serves a call on an offloaded path with keel-offload's retrieval tools.
async fn offloaded(
    kind: Kind,
    store: Arc<dyn OffloadStore>,
    limits: ToolLimits,
    mut args: Map<String, Value>,
    path: &Relative,
    ctx: &ToolContext,
) -> Result<String, ToolError> {
    let where_ = path.describe();
    let thread = ctx.thread_id().ok_or_else(|| {
        ToolError::failed(format!(
            "{where_} holds what left this conversation's context, but this run has no \
             thread id to find it by; read files of the project instead"
        ))
    })?;
    let thread = ThreadId::new(thread).map_err(|e| {
        ToolError::failed(format!(
            "{where_} holds what left this conversation's context, but the run's thread id \
             cannot name stored files: {e}"
        ))
    })?;
    if args.get("glob").is_some_and(|g| !g.is_null()) {
        return Err(ToolError::bad_arguments(format!(
            "`glob` does not apply to {where_} (what left the context); drop it and narrow \
             `path` or `pattern` instead"
        )));
    }
    args.remove("glob");
    args.insert("path".to_owned(), Value::String(path.display()));
    let call = ToolCall::new(ctx.call_id(), kind.name(), Value::Object(args));
    let tools = RetrievalTools::new(store, thread)
        .with_limits(limits)
        .with_lineage_of(ctx)
        .map_err(ToolError::failed)?;
    blocking(move || {
        tools.execute(&call).map_err(|e| match e {
            keel_offload::ToolError::BadArguments { problem, .. } => {
                ToolError::bad_arguments(problem)
            }
            other => ToolError::failed(other),
        })
    })
    .await
}

thread_local! {
    /// Set, on a blocking-pool thread, while it does a call's work: raised when the
    /// call's future is dropped (its timeout, a cancelled run).
    static CANCELLED: std::cell::RefCell<Option<Arc<AtomicBool>>> =
        const { std::cell::RefCell::new(None) };
}

/// Whether the call whose work this thread does was dropped: long work (`grep`)
/// stops at its next check instead of holding the blocking pool's thread to the end.
pub(super) fn cancelled() -> bool {
    CANCELLED.with(|c| {
        c.borrow()
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    })
}

/// Runs `work` on Tokio's blocking pool (inline when there is no Tokio runtime). When
/// this future is dropped before the work ends, [`cancelled`] turns true for it.
async fn blocking<F>(work: F) -> Result<String, ToolError>
where
    F: FnOnce() -> Result<String, ToolError> + Send + 'static,
{
    /// Raises the flag when the call's future goes (harmless once the work is done).
    struct CancelOnDrop(Arc<AtomicBool>);
    impl Drop for CancelOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            let flag = Arc::new(AtomicBool::new(false));
            let _cancel = CancelOnDrop(Arc::clone(&flag));
            handle
                .spawn_blocking(move || {
                    CANCELLED.with(|c| *c.borrow_mut() = Some(flag));
                    let out = work();
                    CANCELLED.with(|c| *c.borrow_mut() = None);
                    out
                })
                .await
                .map_err(|e| {
                    ToolError::failed(format!("the file tool stopped before it finished: {e}"))
                })?
        }
        Err(_) => work(),
    }
}

/// Below this prompt budget (tokens) the agent builder gives the file tools short
/// descriptions ([`FileTools::with_brief_specs`]): a 4,096-token window less 1,024 for
/// the reply is under it, an 8,192-token one is not.
pub const BRIEF_SPECS_BELOW: usize = 4_000;

/// The spec of one tool, its description stating the limits in force.
fn spec(kind: Kind, tools: &FileTools) -> ToolSpec {
    if tools.brief == Some(true) {
        return brief_spec(kind, tools);
    }
    let l = &tools.limits;
    let f = &tools.file_limits;
    let offload = tools.offload.is_some();
    let offload_note = |what: &str| {
        if offload {
            format!(
                " Paths under large_tool_results/, archive/ and truncated_arguments/ {what} \
                 what left this conversation's context (large tool results, the archived \
                 history in archive/messages.jsonl, long arguments of earlier calls), not \
                 files of the root."
            )
        } else {
            String::new()
        }
    };
    match kind {
        Kind::Ls => ToolSpec::new(
            LS,
            format!(
                "List a directory: its subdirectories (ending in `/`) and files with their \
                 sizes, sorted by name, at most {} entries. Paths are relative to the root \
                 directory; omit `path` to list the root.{}",
                l.max_ls_entries,
                offload_note("list")
            ),
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The directory to list, relative to the root (e.g. `src`). Omit for the root."}
                },
                "additionalProperties": false
            }),
        ),
        Kind::ReadFile => ToolSpec::new(
            READ_FILE,
            format!(
                "Read a text file as numbered lines (like `cat -n`, numbered from 1). Returns \
                 `limit` lines (default {}, at most {}) after skipping `offset` lines (default \
                 0); when more lines follow, the output ends with the offset to continue \
                 from. Lines are cut to {} characters and the output to {} characters. Binary \
                 files are not shown.{}",
                l.default_read_lines,
                l.max_read_lines,
                l.max_line_chars,
                l.max_output_chars,
                offload_note("read")
            ),
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file, relative to the root (e.g. `src/main.rs`)."},
                    "offset": {"type": "integer", "minimum": 0, "description": "Lines to skip from the start (0 = from the first line)."},
                    "limit": {"type": "integer", "minimum": 1, "maximum": l.max_read_lines, "description": "Number of lines to return."}
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        ),
        Kind::Grep => ToolSpec::new(
            GREP,
            format!(
                "Search files for lines matching a regular expression (Rust regex syntax; `^` \
                 and `$` match at line start and end, `(?i)` ignores case). Returns \
                 `path:line: text` for up to `max_results` lines (default {}, at most {}). \
                 `path` is a directory or file to search (default: the root directory); \
                 `glob` keeps only files matching it (e.g. `*.rs`, `src/**/*.py`, relative \
                 to `path`). Skips binary files, hidden files and directories (such as \
                 `.git`), `target/` directories and what .gitignore files exclude; searches \
                 at most {} files and {} bytes per call.{}",
                l.default_grep_results,
                l.max_grep_results,
                thousands(f.max_grep_files as u64),
                thousands(f.max_grep_bytes),
                if offload {
                    " Without `path` only the root directory is searched: to search what left \
                     this conversation's context, pass path `large_tool_results`, `archive` or \
                     `truncated_arguments` (no `glob` there)."
                } else {
                    ""
                }
            ),
            json!({
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "The regular expression, matched within one line at a time."},
                    "path": {"type": "string", "description": "A directory or file to search, relative to the root. Omit for the root."},
                    "glob": {"type": "string", "description": "Only search files whose path matches this glob, e.g. `*.rs`."},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": l.max_grep_results, "description": "Most matching lines to return."}
                },
                "required": ["pattern"],
                "additionalProperties": false
            }),
        ),
        Kind::WriteFile => ToolSpec::new(
            WRITE_FILE,
            format!(
                "Create a new file with the given content, creating missing parent \
                 directories. It never overwrites: to change a file that exists, use \
                 edit_file. Paths are relative to the root directory; content is at most {} \
                 bytes.",
                thousands(f.max_write_bytes as u64)
            ),
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The new file, relative to the root (e.g. `src/util.rs`)."},
                    "content": {"type": "string", "description": "The whole content of the file."}
                },
                "required": ["path", "content"],
                "additionalProperties": false
            }),
        ),
        Kind::EditFile => ToolSpec::new(
            EDIT_FILE,
            format!(
                "Replace exact text in an existing file. `old_string` must occur exactly once \
                 (include surrounding lines to make it unique) unless `replace_all` is true, \
                 which replaces every occurrence. Copy `old_string` from read_file output \
                 without the line-number prefix, keeping whitespace and indentation exactly. \
                 Edits UTF-8 text files of at most {} bytes.",
                thousands(f.max_write_bytes as u64)
            ),
            json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file, relative to the root."},
                    "old_string": {"type": "string", "description": "The exact text to replace."},
                    "new_string": {"type": "string", "description": "The text to put in its place."},
                    "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false)."}
                },
                "required": ["path", "old_string", "new_string"],
                "additionalProperties": false
            }),
        ),
    }
}

/// [`spec`] with short descriptions: what the tool does and its arguments.
fn brief_spec(kind: Kind, tools: &FileTools) -> ToolSpec {
    let l = &tools.limits;
    let offload = tools.offload.is_some();
    let schema = |properties: Value, required: &[&str]| {
        json!({
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false
        })
    };
    let path = json!({"type": "string", "description": "Relative to the root."});
    match kind {
        Kind::Ls => ToolSpec::new(
            LS,
            format!(
                "List a directory (default: the root); directories end in `/`.{}",
                if offload {
                    " archive/ and large_tool_results/ hold what left the context."
                } else {
                    ""
                }
            ),
            schema(json!({"path": path}), &[]),
        ),
        Kind::ReadFile => ToolSpec::new(
            READ_FILE,
            "Read a text file as numbered lines, `limit` lines after `offset`.",
            schema(
                json!({
                    "path": path,
                    "offset": {"type": "integer", "minimum": 0},
                    "limit": {"type": "integer", "minimum": 1, "maximum": l.max_read_lines}
                }),
                &["path"],
            ),
        ),
        Kind::Grep => ToolSpec::new(
            GREP,
            format!(
                "Search files for a regex; returns `path:line: text`. `glob` filters files \
                 (e.g. `*.rs`).{}",
                if offload {
                    " Path `archive` searches what left the context."
                } else {
                    ""
                }
            ),
            schema(
                json!({
                    "pattern": {"type": "string"},
                    "path": path,
                    "glob": {"type": "string"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": l.max_grep_results}
                }),
                &["pattern"],
            ),
        ),
        Kind::WriteFile => ToolSpec::new(
            WRITE_FILE,
            "Create a new file (never overwrites; use edit_file to change one).",
            schema(
                json!({"path": path, "content": {"type": "string"}}),
                &["path", "content"],
            ),
        ),
        Kind::EditFile => ToolSpec::new(
            EDIT_FILE,
            "Replace `old_string`, which must occur once unless `replace_all`, in a file.",
            schema(
                json!({
                    "path": path,
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                    "replace_all": {"type": "boolean"}
                }),
                &["path", "old_string", "new_string"],
            ),
        ),
    }
}
