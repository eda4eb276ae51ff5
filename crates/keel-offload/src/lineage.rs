//! Which branch of a thread's history a read or a write belongs to: [`Lineage`] (in
//! each checkpoint's state), [`LineageStore`] (a store seen from one lineage) and
//! [`collect_garbage`] (what no surviving checkpoint sees).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use keel_message::ToolContext;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::{Entry, OffloadStore};

/// The directory of each thread where keel keeps what lineages need: the record of
/// the thread's puts (`.keel/files.jsonl`) and the files of forks that had to write
/// apart (`.keel/forks/<id>/`). A [`LineageStore`] hides it.
pub const LINEAGE_DIR: &str = ".keel";

/// The key under which keel-agent hands a tool call its [`Lineage`]
/// ([`ToolContext::configurable`]).
pub const LINEAGE_KEY: &str = "keel.lineage";

/// The record of the root segment's puts and appended files.
const ROOT_RECORD: &str = ".keel/files.jsonl";
/// Forked segments, one directory each.
const FORKS: &str = ".keel/forks";
/// Segments one write may open before it gives up (each new one is named after the
/// last, so only a store that keeps changing under the writer gets there).
const MAX_DIVERGE: usize = 8;

/// Where one checkpoint's view of its thread's offloaded files ends: what a run
/// continuing from that checkpoint reads, and where it writes.
///
/// A thread's files (the archive, large tool results, truncated arguments) are shared
/// by every branch of its history: a run resumed from an older checkpoint (a fork)
/// writes into the same thread. A `Lineage` is kept in each checkpoint's state (the
/// compaction engine's `ContextState`, keel-agent's `AgentState`) and read through a
/// [`LineageStore`]. It is a short list of *segments*: the thread's own paths first,
/// then one per fork that had to write apart. For each segment it holds how many bytes
/// of each appended file (the archive) and of the segment's record of puts the lineage
/// has seen. So a fork sees the archive as of the fork point plus its own records, and
/// the large results stored up to the fork point plus its own — never what the other
/// branch stored after it.
///
/// Writes go to the last segment, after checking that the stored files end where the
/// lineage's view ends. If they have grown (another branch continued from a later
/// checkpoint), the bytes past the view are taken over only when they are exactly the
/// bytes being written (a crashed step's retry); otherwise the lineage opens a segment
/// of its own under `.keel/forks/<id>/` and writes there. That is copy-on-write paid
/// only by forks that diverge, and nothing is copied: the normal, unforked path keeps
/// the thread's paths, plus one record line per put. Every key stays led by the thread
/// id.
///
/// [`Lineage::new`] starts a thread; [`Lineage::unscoped`] (the `Default`, which is
/// what a checkpoint stored before lineages existed reads back) sees everything of the
/// thread, as keel did before, and turns into a scoped lineage at its first write.
///
/// ```
/// use std::sync::Arc;
/// use keel_offload::message::Message;
/// use keel_offload::{Archive, Lineage, MemoryStore, Pattern, ThreadId};
///
/// let archive = Archive::new(Arc::new(MemoryStore::new()));
/// let thread = ThreadId::new("t1")?;
/// let mut main = Lineage::new();
/// archive.append_in(&mut main, &thread, &[Message::user("before the fork").with_id("m1")])?;
///
/// // A checkpoint keeps a copy: a run forked from it starts with this lineage.
/// let mut fork = main.clone();
/// archive.append_in(&mut main, &thread, &[Message::user("main after the fork").with_id("m2")])?;
/// archive.append_in(&mut fork, &thread, &[Message::user("the fork's own").with_id("f2")])?;
///
/// let words = |l: &Lineage| -> Result<Vec<String>, keel_offload::OffloadError> {
///     let found = archive.grep_in(l, &thread, &Pattern::new("fork")?, 10)?;
///     Ok(found.messages.iter().map(|m| m.message.text().into_owned()).collect())
/// };
/// assert_eq!(words(&main)?, ["before the fork", "main after the fork"]);
/// assert_eq!(words(&fork)?, ["before the fork", "the fork's own"]);
/// assert_eq!(fork.forks().count(), 1); // the fork had to write apart
/// assert_eq!(main.forks().count(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Lineage {
    /// Oldest first; the first is the thread's own paths, the last is where this
    /// lineage writes. Empty: unscoped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Segment {
    /// `None`: the thread's own paths; else the id of a fork's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fork: Option<String>,
    /// Bytes seen of each file written with `append`, by path.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    logs: BTreeMap<String, u64>,
    /// Bytes seen of the segment's record of puts and appended files.
    #[serde(default, skip_serializing_if = "is_zero")]
    files: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One line of a segment's record: a file written with `put` (its size and hash) or
/// first written with `append` (`log`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    log: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hash: Option<String>,
}

impl Record {
    fn put(path: &StorePath, text: &str) -> Self {
        Record {
            path: path.as_str().to_owned(),
            log: false,
            bytes: Some(text.len() as u64),
            hash: Some(format!(
                "{:016x}",
                xxhash_rust::xxh3::xxh3_64(text.as_bytes())
            )),
        }
    }

    fn log(path: &StorePath) -> Self {
        Record {
            path: path.as_str().to_owned(),
            log: true,
            bytes: None,
            hash: None,
        }
    }

    fn line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }
}

/// A record line read back: where it starts and ends in the record.
struct Recorded {
    start: u64,
    end: u64,
    record: Record,
}

impl Segment {
    fn fork(id: String) -> Self {
        Segment {
            fork: Some(id),
            ..Segment::default()
        }
    }

    /// The key of this segment's record.
    fn record_key(&self, thread: &ThreadId) -> Result<Key, OffloadError> {
        let path = match &self.fork {
            None => StorePath::known(ROOT_RECORD),
            Some(id) => StorePath::new(format!("{FORKS}/{id}/files.jsonl"))?,
        };
        Ok(Key::from_parts(thread.clone(), path))
    }

    /// Where this segment keeps the file at `path`.
    fn data_key(&self, thread: &ThreadId, path: &StorePath) -> Result<Key, OffloadError> {
        let stored = match &self.fork {
            None => path.clone(),
            Some(id) => StorePath::new(format!("{FORKS}/{id}/data/{path}"))?,
        };
        Ok(Key::from_parts(thread.clone(), stored))
    }
}

/// The id of the segment `lineage` opens to write `text` at `path` apart: 16 hex
/// digits of a hash of both, so a retry of the same write (a step that crashed
/// before its checkpoint) opens the same segment and takes over what it left there.
fn fork_id(lineage: &Lineage, path: &StorePath, text: &str) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(
        serde_json::to_string(lineage)
            .unwrap_or_default()
            .as_bytes(),
    );
    h.update(b"\0");
    h.update(path.as_str().as_bytes());
    h.update(b"\0");
    h.update(&xxhash_rust::xxh3::xxh3_64(text.as_bytes()).to_le_bytes());
    format!("{:016x}", h.digest())
}

/// Whether `path` lies in the lineage directory (hidden from views).
fn hidden(path: &StorePath) -> bool {
    path.components().next() == Some(LINEAGE_DIR)
}

fn problem(key: impl std::fmt::Display, reason: impl Into<String>) -> OffloadError {
    OffloadError::Lineage {
        key: key.to_string(),
        reason: reason.into(),
    }
}

/// What a reader is told when the store lost what a checkpoint saw.
const LOST: &str = " (an in-memory store, the agent's default, keeps nothing past its \
                    process: give every run of a thread the same durable store, such as \
                    SqliteStore, FsStore or PostgresStore)";

fn not_held(key: &Key, what: &str, seen: u64, size: u64) -> OffloadError {
    problem(
        key,
        format!(
            "the offload store holds {size} of the {seen} bytes the thread's checkpoint has \
             seen of this file ({what}): it is not the store the thread wrote to, or it lost \
             them{LOST}"
        ),
    )
}

fn shorter(key: &Key, seen: u64, size: u64) -> OffloadError {
    problem(
        key,
        format!(
            "the stored file has {size} bytes but this lineage has seen {seen}: it was cut or \
             deleted under a checkpoint that still refers to it{LOST}"
        ),
    )
}

/// The records of a segment, up to `upto` bytes (all with `None`). A record cut short
/// (a torn write) is left out.
fn read_records(
    store: &dyn OffloadStore,
    key: &Key,
    upto: Option<u64>,
) -> Result<Vec<Recorded>, OffloadError> {
    if upto == Some(0) {
        return Ok(Vec::new());
    }
    let reader = match store.open(key) {
        Ok(r) => r,
        Err(OffloadError::NotFound { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let reader: Box<dyn Read + Send + '_> = match upto {
        Some(n) => Box::new(reader.take(n)),
        None => reader,
    };
    let mut out = Vec::new();
    crate::scan::each_line(reader, 16 * 1024, |start, line, complete| {
        // A record cut short (a torn write) is left out.
        if complete && let Ok(record) = serde_json::from_slice::<Record>(line) {
            let end = start + line.len() as u64 + 1;
            out.push(Recorded { start, end, record });
        }
    })
    .map_err(|e| OffloadError::io("read the lineage record", key, e))?;
    Ok(out)
}

/// The size of `key`, 0 when nothing is stored.
fn size_or_zero(store: &dyn OffloadStore, key: &Key) -> Result<u64, OffloadError> {
    Ok(store.size(key)?.unwrap_or(0))
}

/// Every fork directory of the thread in the store.
fn stored_forks(
    store: &dyn OffloadStore,
    thread: &ThreadId,
) -> Result<BTreeMap<String, Vec<Entry>>, OffloadError> {
    let entries = match store.list(thread, Some(&StorePath::known(FORKS))) {
        Ok(e) => e,
        Err(OffloadError::NotFound { .. }) => return Ok(BTreeMap::new()),
        Err(e) => return Err(e),
    };
    let mut forks: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    for e in entries {
        let id = e.path.components().nth(2).map(str::to_owned);
        if let Some(id) = id {
            forks.entry(id).or_default().push(e);
        }
    }
    Ok(forks)
}

impl Lineage {
    /// The lineage of a new thread: its own paths, nothing seen yet.
    pub fn new() -> Self {
        Lineage {
            segments: vec![Segment::default()],
        }
    }

    /// The view of a thread stored before lineages existed: everything of the thread
    /// (but the forks' directories), as keel read it before. Its first write through a
    /// [`LineageStore`] makes it scoped, at what the thread holds then.
    pub fn unscoped() -> Self {
        Lineage::default()
    }

    /// False for [`Lineage::unscoped`].
    pub fn is_scoped(&self) -> bool {
        !self.segments.is_empty()
    }

    /// The ids of the fork segments this lineage reads, oldest first (none until a
    /// fork had to write apart from its other branch).
    pub fn forks(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| s.fork.as_deref())
    }

    /// The lineage a runtime handed a tool call under [`LINEAGE_KEY`]; `None` when it
    /// handed none. A value that is not a lineage is an error, never a wider view.
    ///
    /// ```
    /// use keel_offload::message::ToolContext;
    /// use keel_offload::{LINEAGE_KEY, Lineage};
    ///
    /// let ctx = ToolContext::new("c1").with_configurable(LINEAGE_KEY, Lineage::new().to_value());
    /// assert_eq!(Lineage::of_tool_call(&ctx)?, Some(Lineage::new()));
    /// assert_eq!(Lineage::of_tool_call(&ToolContext::new("c2"))?, None);
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn of_tool_call(ctx: &ToolContext) -> Result<Option<Lineage>, OffloadError> {
        ctx.configurable(LINEAGE_KEY)
            .map(|v| {
                serde_json::from_value(v.clone())
                    .map_err(|e| problem(LINEAGE_KEY, format!("not a lineage: {e}")))
            })
            .transpose()
    }

    /// The lineage as JSON, for [`ToolContext::with_configurable`].
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Whether the store holds nothing of `thread`'s files this lineage does not see:
    /// no fork directory it does not read, no record or appended file past its view.
    /// A few size queries and one listing. When true, nothing of the thread can be
    /// garbage while this lineage lives, so [`collect_garbage`] is not needed.
    pub fn sees_all(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
    ) -> Result<bool, OffloadError> {
        let mine: BTreeSet<&str> = self.forks().collect();
        if stored_forks(store, thread)?
            .keys()
            .any(|id| !mine.contains(id.as_str()))
        {
            return Ok(false);
        }
        for (key, _, seen) in self.seen_files(thread)? {
            if size_or_zero(store, &key)? != seen {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks that the store still holds everything this lineage has seen of
    /// `thread`'s files: each segment's record and each appended file (the archive
    /// among them) at least as long as seen. A few size queries; an unscoped lineage
    /// checks nothing.
    ///
    /// The error ([`OffloadError::Lineage`]) names the first file that is missing or
    /// shorter and what usually causes it: a thread resumed with another store than
    /// the one its checkpoints wrote to, such as the in-memory default after a restart.
    ///
    /// ```
    /// use keel_offload::{Key, Lineage, LineageStore, MemoryStore, OffloadStore, ThreadId};
    /// use std::sync::Arc;
    ///
    /// let thread = ThreadId::new("t")?;
    /// let store = Arc::new(MemoryStore::new());
    /// let view = LineageStore::new(store.clone(), thread.clone(), Lineage::new());
    /// view.append(&Key::new("t", "notes.md")?, "seen by the lineage\n")?;
    /// let lineage = view.lineage();
    /// lineage.check_stored(&*store, &thread)?;
    ///
    /// // A new process with a new in-memory store has none of it.
    /// let err = lineage.check_stored(&MemoryStore::new(), &thread).unwrap_err();
    /// assert!(err.to_string().contains("in-memory store"), "{err}");
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn check_stored(
        &self,
        store: &dyn OffloadStore,
        thread: &ThreadId,
    ) -> Result<(), OffloadError> {
        for (key, what, seen) in self.seen_files(thread)? {
            let size = size_or_zero(store, &key)?;
            if size < seen {
                return Err(not_held(&key, what, seen, size));
            }
        }
        Ok(())
    }

    /// Every stored file whose size this lineage records, with what it is and the
    /// bytes seen: each segment's record, then its appended files.
    fn seen_files(&self, thread: &ThreadId) -> Result<Vec<(Key, &'static str, u64)>, OffloadError> {
        let mut files = Vec::new();
        for seg in &self.segments {
            files.push((
                seg.record_key(thread)?,
                "the thread's record of its files",
                seg.files,
            ));
            for (path, &seen) in &seg.logs {
                let key = seg.data_key(thread, &StorePath::new(path.as_str())?)?;
                files.push((key, "an appended file", seen));
            }
        }
        Ok(files)
    }

    /// A hash of everything but the last segment's sizes: two lineages with the same
    /// fingerprint read prefixes of the same bytes (0 for the thread's own paths).
    pub(crate) fn fingerprint(&self) -> u64 {
        match self.segments.split_last() {
            None => 0,
            Some((last, rest)) if rest.is_empty() && last.fork.is_none() => 0,
            Some((last, rest)) => {
                let text = serde_json::to_string(&(rest, &last.fork)).unwrap_or_default();
                xxhash_rust::xxh3::xxh3_64(text.as_bytes()) | 1
            }
        }
    }

    /// The segment writes go to (a scoped lineage has one).
    fn open_segment(&mut self) -> Result<&mut Segment, OffloadError> {
        self.segments
            .last_mut()
            .ok_or_else(|| problem(LINEAGE_KEY, "an unscoped lineage has no segment to write"))
    }

    /// The parts of the appended file at `path`: each segment's stored key and the
    /// bytes seen of it.
    fn log_parts(
        &self,
        thread: &ThreadId,
        path: &StorePath,
    ) -> Result<Vec<(Key, u64)>, OffloadError> {
        self.segments
            .iter()
            .filter_map(|s| s.logs.get(path.as_str()).map(|&seen| (s, seen)))
            .map(|(s, seen)| Ok((s.data_key(thread, path)?, seen)))
            .collect()
    }

    fn is_log(&self, path: &StorePath) -> bool {
        self.segments
            .iter()
            .any(|s| s.logs.contains_key(path.as_str()))
    }
}

/// What a path is in a view.
enum Resolved {
    /// An appended file: its parts, oldest first, and the bytes seen of each.
    Log(Vec<(Key, u64)>),
    /// A file written with `put`, where it is stored.
    File(Key),
    Missing,
}

/// Which of the root segment's stored files a lineage sees.
enum RootView {
    /// All of them: nothing was recorded past the lineage's view.
    All,
    /// Those not recorded, or first recorded within the view: (path, first record
    /// starts at, ends at, is a log).
    Records(BTreeMap<String, (u64, u64, bool)>),
}

impl RootView {
    fn sees(&self, path: &str, seen: u64) -> bool {
        match self {
            RootView::All => true,
            RootView::Records(first) => match first.get(path) {
                None => true,
                Some(&(_, end, log)) => !log && end <= seen,
            },
        }
    }
}

/// An [`OffloadStore`] seen from one [`Lineage`] of one thread: reads show what the
/// lineage sees, writes go where it writes, and [`LineageStore::lineage`] is the
/// lineage after them (store it with the checkpoint the writes belong to).
///
/// Paths are the thread's as the agent knows them (`archive/messages.jsonl`,
/// `large_tool_results/<id>`): a file appended to in several segments reads as one,
/// a fork's own files shadow the older ones, and [`LINEAGE_DIR`] is hidden. Any
/// backend works under it; every call is a few calls of the store below, which stay
/// keyed by the thread. A view serves one thread: keys of another are refused.
///
/// `delete` and `truncate` are refused (what lineages no longer need is removed by
/// [`collect_garbage`]); `delete_thread` deletes the whole thread, every branch.
///
/// ```
/// use std::sync::Arc;
/// use keel_offload::{Key, Lineage, LineageStore, MemoryStore, OffloadStore, ThreadId};
///
/// let store = Arc::new(MemoryStore::new());
/// let thread = ThreadId::new("t1")?;
/// let key = Key::new("t1", "large_tool_results/call_1")?;
///
/// let main = LineageStore::new(store.clone(), thread.clone(), Lineage::new());
/// let fork_point = main.lineage();
/// main.put(&key, "the main branch's result")?;
///
/// // A run forked from before the put does not see it, and writes its own.
/// let fork = LineageStore::new(store.clone(), thread.clone(), fork_point);
/// assert!(fork.get(&key).unwrap_err().is_not_found());
/// fork.put(&key, "the fork's result")?;
/// assert_eq!(fork.get(&key)?, "the fork's result");
/// assert_eq!(main.get(&key)?, "the main branch's result");
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
pub struct LineageStore {
    inner: Arc<dyn OffloadStore>,
    thread: ThreadId,
    lineage: Mutex<Lineage>,
}

impl std::fmt::Debug for LineageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineageStore")
            .field("thread", &self.thread)
            .field("lineage", &self.lineage())
            .finish_non_exhaustive()
    }
}

impl LineageStore {
    /// `inner` as `lineage` of `thread` sees it.
    pub fn new(inner: Arc<dyn OffloadStore>, thread: ThreadId, lineage: Lineage) -> Self {
        LineageStore {
            inner,
            thread,
            lineage: Mutex::new(lineage),
        }
    }

    /// The lineage now: the one given, moved on by the writes made through the view.
    pub fn lineage(&self) -> Lineage {
        self.lineage
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The thread.
    pub fn thread(&self) -> &ThreadId {
        &self.thread
    }

    /// The store below.
    pub fn inner(&self) -> &Arc<dyn OffloadStore> {
        &self.inner
    }

    fn check_thread(&self, thread: &ThreadId) -> Result<(), OffloadError> {
        if thread != &self.thread {
            return Err(problem(
                thread,
                format!("this view serves thread {}, not this one", self.thread),
            ));
        }
        Ok(())
    }

    fn check_key(&self, key: &Key) -> Result<(), OffloadError> {
        self.check_thread(key.thread())
    }

    /// What the root segment's stored files are to `lineage`.
    fn root_view(&self, lineage: &Lineage) -> Result<RootView, OffloadError> {
        let Some(root) = lineage.segments.first() else {
            return Ok(RootView::All);
        };
        let key = root.record_key(&self.thread)?;
        if size_or_zero(&*self.inner, &key)? == root.files {
            return Ok(RootView::All);
        }
        let mut first = BTreeMap::new();
        for r in read_records(&*self.inner, &key, None)? {
            first
                .entry(r.record.path)
                .or_insert((r.start, r.end, r.record.log));
        }
        Ok(RootView::Records(first))
    }

    /// The paths a fork segment recorded with `put` within what `seg` has seen.
    fn fork_puts(&self, seg: &Segment) -> Result<BTreeSet<String>, OffloadError> {
        let key = seg.record_key(&self.thread)?;
        Ok(read_records(&*self.inner, &key, Some(seg.files))?
            .into_iter()
            .filter(|r| !r.record.log)
            .map(|r| r.record.path)
            .collect())
    }

    /// How the root segment's record first names `path`: `Some(true)` as appended,
    /// `Some(false)` as put, `None` not at all.
    fn root_record_of(&self, path: &StorePath) -> Result<Option<bool>, OffloadError> {
        let key = Segment::default().record_key(&self.thread)?;
        Ok(read_records(&*self.inner, &key, None)?
            .into_iter()
            .find(|r| r.record.path == path.as_str())
            .map(|r| r.record.log))
    }

    fn resolve(&self, lineage: &Lineage, path: &StorePath) -> Result<Resolved, OffloadError> {
        if hidden(path) {
            return Ok(Resolved::Missing);
        }
        let root_key = Key::from_parts(self.thread.clone(), path.clone());
        if !lineage.is_scoped() {
            return Ok(match self.inner.size(&root_key)? {
                Some(_) => Resolved::File(root_key),
                None => Resolved::Missing,
            });
        }
        if lineage.is_log(path) {
            return Ok(Resolved::Log(lineage.log_parts(&self.thread, path)?));
        }
        for seg in lineage.segments.iter().rev() {
            if seg.fork.is_some() {
                if self.fork_puts(seg)?.contains(path.as_str()) {
                    let key = seg.data_key(&self.thread, path)?;
                    if self.inner.size(&key)?.is_some() {
                        return Ok(Resolved::File(key));
                    }
                }
            } else if self.inner.size(&root_key)?.is_some()
                && self.root_view(lineage)?.sees(path.as_str(), seg.files)
            {
                return Ok(Resolved::File(root_key));
            }
        }
        Ok(Resolved::Missing)
    }

    /// The error for a path the view does not hold: a directory, or nothing.
    fn missing(&self, key: &Key) -> OffloadError {
        match self.list(key.thread(), Some(key.path())) {
            Ok(entries) if entries.iter().any(|e| e.path != *key.path()) => OffloadError::io(
                "open",
                key,
                io::Error::new(io::ErrorKind::IsADirectory, "it is a directory"),
            ),
            _ => OffloadError::NotFound {
                key: key.to_string(),
            },
        }
    }

    fn snapshot(&self) -> Lineage {
        self.lineage()
    }
    /// The lineage, locked and scoped, for a write at `key`; and whether it was scoped
    /// before.
    fn writable(&self, key: &Key) -> Result<(MutexGuard<'_, Lineage>, bool), OffloadError> {
        self.check_key(key)?;
        if hidden(key.path()) {
            return Err(problem(key, format!("`{LINEAGE_DIR}/` is keel's own")));
        }
        let mut lineage = self.lineage.lock().unwrap_or_else(PoisonError::into_inner);
        let was_scoped = lineage.is_scoped();
        self.scope(&mut lineage)?;
        Ok((lineage, was_scoped))
    }

    /// Makes an unscoped lineage scoped at what the thread holds now.
    fn scope(&self, lineage: &mut Lineage) -> Result<(), OffloadError> {
        if lineage.is_scoped() {
            return Ok(());
        }
        let mut root = Segment::default();
        root.files = size_or_zero(&*self.inner, &root.record_key(&self.thread)?)?;
        lineage.segments.push(root);
        Ok(())
    }

    /// Appends `line` to the open segment's record, or takes over the same line a
    /// crashed attempt left there. `false`: the record has grown past the lineage's
    /// view with other lines, so the lineage must write apart.
    fn record(&self, lineage: &mut Lineage, line: &str) -> Result<bool, OffloadError> {
        let thread = self.thread.clone();
        let seg = lineage.open_segment()?;
        let key = seg.record_key(&thread)?;
        if !continue_at(&*self.inner, &key, seg.files, line)? {
            return Ok(false);
        }
        seg.files += line.len() as u64;
        Ok(true)
    }

    /// Opens a segment of the lineage's own, to write `text` at `path` in.
    fn diverge(lineage: &mut Lineage, path: &StorePath, text: &str) {
        let id = fork_id(lineage, path, text);
        lineage.segments.push(Segment::fork(id));
    }

    /// Whether the stored file at `key` holds exactly `text`.
    fn holds(&self, key: &Key, text: &str) -> Result<bool, OffloadError> {
        if size_or_zero(&*self.inner, key)? != text.len() as u64 {
            return Ok(false);
        }
        let mut reader = self.inner.open(key)?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut at = 0usize;
        loop {
            let n = reader
                .read(&mut buf)
                .map_err(|e| OffloadError::io("read", key, e))?;
            if n == 0 {
                return Ok(at == text.len());
            }
            if text.as_bytes().get(at..at + n) != buf.get(..n) {
                return Ok(false);
            }
            at += n;
        }
    }
}

/// Writes `text` at `seen` bytes into the file at `key`: appends when the file ends
/// there, takes over what is stored past `seen` when it is the start of `text` (and
/// appends the rest). `false`: other bytes lie past `seen`, nothing was written.
fn continue_at(
    store: &dyn OffloadStore,
    key: &Key,
    seen: u64,
    text: &str,
) -> Result<bool, OffloadError> {
    let size = size_or_zero(store, key)?;
    if size < seen {
        return Err(shorter(key, seen, size));
    }
    let extra = size - seen;
    if extra > text.len() as u64 {
        return Ok(false);
    }
    let taken = usize::try_from(extra).unwrap_or(usize::MAX);
    if extra > 0 && store.read_at(key, seen, taken)? != text.as_bytes()[..taken] {
        return Ok(false);
    }
    let Some(rest) = text.get(taken..) else {
        // What lies past `seen` ends inside a character of `text`: not ours.
        return Ok(false);
    };
    if !rest.is_empty() {
        let at = store.append(key, rest)?;
        if at != size {
            return Err(problem(
                key,
                format!("another writer appended at the same time (at {at}, expected {size})"),
            ));
        }
    }
    Ok(true)
}

/// Reads the parts of an appended file one after another, each cut to the bytes seen,
/// failing when a part is shorter than that.
struct Parts<'a> {
    store: &'a dyn OffloadStore,
    parts: std::vec::IntoIter<(Key, u64)>,
    current: Option<(Key, Box<dyn Read + Send + 'a>, u64)>,
}

impl Read for Parts<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if let Some((key, reader, left)) = &mut self.current
                && *left > 0
            {
                let want = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                let n = reader.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "{key}: the stored file is shorter than this lineage has seen{LOST}"
                        ),
                    ));
                }
                *left -= n as u64;
                return Ok(n);
            }
            self.current = None;
            let Some((key, seen)) = self.parts.next() else {
                return Ok(0);
            };
            if seen == 0 {
                continue;
            }
            let reader = match self.store.open(&key) {
                Ok(reader) => reader,
                Err(OffloadError::NotFound { .. }) => {
                    return Err(io::Error::other(shorter(&key, seen, 0)));
                }
                Err(e) => return Err(io::Error::other(e)),
            };
            self.current = Some((key, reader, seen));
        }
    }
}

impl OffloadStore for LineageStore {
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let path = key.path();
        let (mut lineage, _) = self.writable(key)?;
        if lineage.is_log(path) {
            return Err(problem(
                key,
                "this file was written with append; a lineage keeps it append-only",
            ));
        }
        let line = Record::put(path, text).line();
        // In the open segment, or one of the lineage's own (a retry may find its
        // segment taken further by an attempt that got further).
        for _ in 0..MAX_DIVERGE {
            if let Resolved::File(seen) = self.resolve(&lineage, path)?
                && self.holds(&seen, text)?
            {
                return Ok(text.len() as u64); // seen already, with this very content
            }
            let stored = lineage.open_segment()?.data_key(&self.thread, path)?;
            let existing = self.inner.size(&stored)?;
            if existing.is_some() && !self.holds(&stored, text)? {
                // Another branch (or an older checkpoint of this one) may see what is
                // there: never overwrite it.
                Self::diverge(&mut lineage, path, text);
                continue;
            }
            if !self.record(&mut lineage, &line)? {
                Self::diverge(&mut lineage, path, text);
                continue;
            }
            if existing.is_none() {
                self.inner.put(&stored, text)?;
            }
            return Ok(text.len() as u64);
        }
        Err(problem(
            key,
            "a segment of the lineage's own could not take the write",
        ))
    }

    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let path = key.path();
        let (mut lineage, was_scoped) = self.writable(key)?;
        if !lineage.is_log(path)
            && let Resolved::File(stored) = self.resolve(&lineage, path)?
        {
            // A file this lineage sees, appended to for the first time: only one of the
            // thread's own paths no record names as a put (written before lineages, or
            // straight to the store) continues, from its end.
            let named = self.root_record_of(path)?;
            let continues = stored.path() == path
                && match named {
                    None => true,
                    Some(log) => log && !was_scoped,
                };
            if !continues {
                return Err(problem(
                    key,
                    "this file was written with put; a lineage does not append to it",
                ));
            }
            let size = size_or_zero(&*self.inner, &stored)?;
            if let Some(root) = lineage.segments.first_mut() {
                root.logs.insert(path.as_str().to_owned(), size);
            }
        }
        let logical: u64 = lineage
            .segments
            .iter()
            .filter_map(|s| s.logs.get(path.as_str()))
            .sum();
        for _ in 0..MAX_DIVERGE {
            if !lineage.open_segment()?.logs.contains_key(path.as_str()) {
                if !self.record(&mut lineage, &Record::log(path).line())? {
                    Self::diverge(&mut lineage, path, text);
                    continue;
                }
                lineage
                    .open_segment()?
                    .logs
                    .insert(path.as_str().to_owned(), 0);
            }
            let seg = lineage.open_segment()?;
            let seen = seg.logs.get(path.as_str()).copied().unwrap_or(0);
            let stored = seg.data_key(&self.thread, path)?;
            if !continue_at(&*self.inner, &stored, seen, text)? {
                Self::diverge(&mut lineage, path, text);
                continue;
            }
            lineage
                .open_segment()?
                .logs
                .insert(path.as_str().to_owned(), seen + text.len() as u64);
            return Ok(logical);
        }
        Err(problem(
            key,
            "a segment of the lineage's own could not take the write",
        ))
    }

    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        let mut bytes = Vec::new();
        self.open(key)?
            .read_to_end(&mut bytes)
            .map_err(|e| OffloadError::io("read", key, e))?;
        String::from_utf8(bytes).map_err(|_| OffloadError::NotUtf8 {
            key: key.to_string(),
        })
    }

    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        self.check_key(key)?;
        match self.resolve(&self.snapshot(), key.path())? {
            Resolved::Log(parts) => Ok(Box::new(Parts {
                store: &*self.inner,
                parts: parts.into_iter(),
                current: None,
            })),
            Resolved::File(stored) => self.inner.open(&stored),
            Resolved::Missing => Err(self.missing(key)),
        }
    }

    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
        self.check_key(key)?;
        match self.resolve(&self.snapshot(), key.path())? {
            Resolved::Log(parts) => {
                let end = offset.saturating_add(len as u64);
                let mut out = Vec::with_capacity(len.min(64 << 20));
                let mut base = 0u64;
                for (stored, seen) in parts {
                    let (lo, hi) = (offset.max(base), end.min(base + seen));
                    if lo < hi {
                        let want = usize::try_from(hi - lo).unwrap_or(usize::MAX);
                        let got = self.inner.read_at(&stored, lo - base, want)?;
                        if got.len() != want {
                            return Err(shorter(&stored, seen, lo - base + got.len() as u64));
                        }
                        out.extend_from_slice(&got);
                    }
                    base += seen;
                }
                Ok(out)
            }
            Resolved::File(stored) => self.inner.read_at(&stored, offset, len),
            Resolved::Missing => Err(self.missing(key)),
        }
    }

    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
        self.check_key(key)?;
        match self.resolve(&self.snapshot(), key.path())? {
            Resolved::Log(parts) => Ok(Some(parts.iter().map(|(_, seen)| seen).sum())),
            Resolved::File(stored) => self.inner.size(&stored),
            Resolved::Missing => match self.missing(key) {
                OffloadError::NotFound { .. } => Ok(None),
                e => Err(e),
            },
        }
    }

    fn list(
        &self,
        thread: &ThreadId,
        under: Option<&StorePath>,
    ) -> Result<Vec<Entry>, OffloadError> {
        self.check_thread(thread)?;
        let not_found = || OffloadError::NotFound {
            key: match under {
                Some(p) => format!("{thread}/{p}"),
                None => thread.to_string(),
            },
        };
        if under.is_some_and(hidden) {
            return Err(not_found());
        }
        let lineage = self.snapshot();
        let within = |p: &StorePath| under.is_none_or(|u| p.starts_with(u));
        let mut found: BTreeMap<StorePath, u64> = BTreeMap::new();
        let stored = match self.inner.list(thread, under) {
            Ok(e) => e,
            Err(OffloadError::NotFound { .. }) => Vec::new(),
            Err(e) => return Err(e),
        };
        let root = self.root_view(&lineage)?;
        let root_seen = lineage.segments.first().map_or(0, |s| s.files);
        for e in stored {
            if hidden(&e.path)
                || lineage.is_log(&e.path)
                || (lineage.is_scoped() && !root.sees(e.path.as_str(), root_seen))
            {
                continue;
            }
            found.insert(e.path, e.bytes);
        }
        for seg in lineage.segments.iter().filter(|s| s.fork.is_some()) {
            for p in self.fork_puts(seg)? {
                let path = StorePath::new(p)?;
                if !within(&path) {
                    continue;
                }
                if let Some(bytes) = self.inner.size(&seg.data_key(thread, &path)?)? {
                    found.insert(path, bytes);
                }
            }
        }
        let mut logs: BTreeMap<StorePath, u64> = BTreeMap::new();
        for seg in &lineage.segments {
            for (p, &seen) in &seg.logs {
                let path = StorePath::new(p.as_str())?;
                if within(&path) {
                    *logs.entry(path).or_default() += seen;
                }
            }
        }
        found.extend(logs);
        if under.is_some() && found.is_empty() {
            return Err(not_found());
        }
        Ok(found
            .into_iter()
            .map(|(path, bytes)| Entry { path, bytes })
            .collect())
    }

    fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
        Err(problem(
            key,
            "a lineage view does not delete files: older checkpoints may still see them \
             (collect_garbage removes what none sees)",
        ))
    }

    fn truncate(&self, key: &Key, _len: u64) -> Result<bool, OffloadError> {
        Err(problem(
            key,
            "a lineage view does not cut files: older checkpoints may still see them",
        ))
    }

    /// Deletes the whole thread, every branch of it.
    fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        self.check_thread(thread)?;
        self.inner.delete_thread(thread)
    }
}

/// What [`collect_garbage`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Collected {
    /// Files deleted.
    pub files: u64,
    /// Bytes removed: the deleted files' and what was cut off the kept ones.
    pub bytes: u64,
}

/// What the live lineages see of one segment.
#[derive(Default)]
struct Seen {
    files: u64,
    logs: BTreeMap<String, u64>,
}

/// Removes what none of the `live` lineages sees from `thread`'s files: the
/// directories of forks none reads, files recorded past every live view, and the
/// bytes past every live view of the appended files (with
/// [`OffloadStore::truncate`]). Files no record names (written before lineages, or
/// straight to the store) are kept, and an unscoped live lineage keeps everything
/// of the thread's own paths.
///
/// Give it the lineage of every checkpoint that stays after a prune (and of a step
/// still running); nothing any of them reads is touched. With no live lineage,
/// everything recorded goes. Every call stays within the thread.
///
/// ```
/// use std::sync::Arc;
/// use keel_offload::{Key, Lineage, LineageStore, MemoryStore, OffloadStore, ThreadId, collect_garbage};
///
/// let store = Arc::new(MemoryStore::new());
/// let thread = ThreadId::new("t1")?;
/// let key = Key::new("t1", "large_tool_results/call_1")?;
/// let fork_point = Lineage::new();
/// let abandoned = LineageStore::new(store.clone(), thread.clone(), fork_point.clone());
/// abandoned.put(&key, "only the abandoned branch sees this")?;
///
/// // The abandoned branch's checkpoints were pruned; only the fork point's lineage lives.
/// let removed = collect_garbage(&*store, &thread, &[fork_point])?;
/// assert_eq!(removed.files, 2); // the result and the record of it
/// assert!(store.list(&thread, None)?.is_empty());
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
pub fn collect_garbage(
    store: &dyn OffloadStore,
    thread: &ThreadId,
    live: &[Lineage],
) -> Result<Collected, OffloadError> {
    let mut out = Collected::default();
    let root_all = live.iter().any(|l| !l.is_scoped());
    let mut seen: BTreeMap<Option<String>, Seen> = BTreeMap::new();
    for seg in live.iter().flat_map(|l| &l.segments) {
        let s = seen.entry(seg.fork.clone()).or_default();
        s.files = s.files.max(seg.files);
        for (p, &n) in &seg.logs {
            let e = s.logs.entry(p.clone()).or_default();
            *e = (*e).max(n);
        }
    }
    let delete = |key: &Key, bytes: u64, out: &mut Collected| -> Result<(), OffloadError> {
        if store.delete(key)? {
            out.files += 1;
            out.bytes += bytes;
        }
        Ok(())
    };
    for (id, entries) in stored_forks(store, thread)? {
        let Some(s) = seen.get(&Some(id.clone())) else {
            for e in entries {
                delete(&Key::from_parts(thread.clone(), e.path), e.bytes, &mut out)?;
            }
            continue;
        };
        let segment = Segment::fork(id.clone());
        let puts: BTreeSet<String> =
            read_records(store, &segment.record_key(thread)?, Some(s.files))?
                .into_iter()
                .filter(|r| !r.record.log)
                .map(|r| r.record.path)
                .collect();
        let data = format!("{FORKS}/{id}/data/");
        for e in entries {
            // The record itself is cut below.
            if let Some(path) = e.path.as_str().strip_prefix(&data)
                && !puts.contains(path)
                && !s.logs.contains_key(path)
            {
                delete(
                    &Key::from_parts(thread.clone(), e.path.clone()),
                    e.bytes,
                    &mut out,
                )?;
            }
        }
    }
    for (fork, s) in &seen {
        if fork.is_none() && root_all {
            continue;
        }
        let segment = Segment {
            fork: fork.clone(),
            ..Segment::default()
        };
        let record_key = segment.record_key(thread)?;
        let records = read_records(store, &record_key, None)?;
        let within: BTreeSet<&str> = records
            .iter()
            .filter(|r| r.end <= s.files)
            .map(|r| r.record.path.as_str())
            .collect();
        for r in records.iter().filter(|r| r.end > s.files) {
            let path = r.record.path.as_str();
            if within.contains(path) || s.logs.contains_key(path) {
                continue;
            }
            let key = segment.data_key(thread, &StorePath::new(path)?)?;
            if let Some(bytes) = store.size(&key)? {
                delete(&key, bytes, &mut out)?;
            }
        }
        for (p, &n) in &s.logs {
            let key = segment.data_key(thread, &StorePath::new(p.as_str())?)?;
            if let Some(size) = store.size(&key)?
                && size > n
            {
                if n == 0 {
                    delete(&key, size, &mut out)?;
                } else if store.truncate(&key, n)? {
                    out.bytes += size - n;
                }
            }
        }
        if let Some(size) = store.size(&record_key)?
            && size > s.files
        {
            if s.files == 0 {
                delete(&record_key, size, &mut out)?;
            } else if store.truncate(&record_key, s.files)? {
                out.bytes += size - s.files;
            }
        }
    }
    if !seen.contains_key(&None) && !root_all {
        // No live lineage reads the thread's own paths: everything recorded goes.
        let segment = Segment::default();
        let record_key = segment.record_key(thread)?;
        for r in read_records(store, &record_key, None)? {
            let key = segment.data_key(thread, &StorePath::new(r.record.path.as_str())?)?;
            if let Some(bytes) = store.size(&key)? {
                delete(&key, bytes, &mut out)?;
            }
        }
        if let Some(size) = store.size(&record_key)? {
            delete(&record_key, size, &mut out)?;
        }
    }
    Ok(out)
}
