use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::{Entry, OffloadStore};

/// Whether [`FsStore`] forces each write to stable storage before returning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fsync {
    /// `fsync` the file (and its directory when an entry is created or renamed)
    /// before a write returns: once `put` or `append` succeeds, the data survives a
    /// power cut. The default, because the archive's promise (nothing leaves the
    /// context before it is durably stored) depends on it.
    #[default]
    Always,
    /// Leave flushing to the operating system: a crash of the process loses nothing,
    /// a crash of the machine can lose the last writes. Much faster.
    Never,
}

/// An [`OffloadStore`] in a directory on disk.
///
/// Layout: `<root>/<thread>/<path>`, plus `<root>/.tmp/` for writes in progress (thread
/// ids never start with `.`, so the two cannot meet).
///
/// * `put` writes a temporary file in `<root>/.tmp/` and renames it over the target,
///   so a reader sees the old content or the new, never half of it. The text is
///   written straight from the caller's `&str`: a 200 MB result is not copied.
/// * `append` opens the file in append mode and writes only the new bytes. The handle
///   stays open (up to 64 files), so later appends cost one write; `put` and `delete`
///   close it first. Appends to one key through one store (and its clones) take
///   turns, so the offset returned is where the text landed, whatever the threads;
///   another process appending to the same file is not seen (keel's rule is one
///   writer per thread).
/// * With [`Fsync::Always`] (the default) the file, and the directory when an entry
///   appears, are synced before the call returns.
/// * Symbolic links are never followed: every directory on the way to an entry is
///   checked with `symlink_metadata`, a link anywhere (pointing inside the root or
///   out of it) is refused with [`OffloadError::Symlink`], and on Unix the final open
///   uses `O_NOFOLLOW`, so a link swapped in after the check fails the open instead of
///   being followed. The remaining window — a directory on the way replaced by a link
///   between the check and the open — needs someone else writing inside the root
///   while the store runs; the store assumes its root is its own.
///
/// Temporary files of a process that crashed mid-`put` stay in `<root>/.tmp/` (they
/// are never read); they can be removed whenever no store is running.
///
/// All methods block; see [`OffloadStore`] for use from async code.
///
/// ```
/// use keel_offload::{FsStore, Fsync, Key, OffloadStore};
///
/// let dir = tempfile::tempdir()?;
/// let store = FsStore::new(dir.path())?.with_fsync(Fsync::Never);
/// let key = Key::new("t1", "large_tool_results/call_1")?;
/// store.put(&key, "line 1\nline 2\n")?;
/// assert_eq!(store.get(&key)?, "line 1\nline 2\n");
/// assert!(dir.path().join("t1/large_tool_results/call_1").is_file());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct FsStore {
    root: PathBuf,
    tmp: PathBuf,
    fsync: Fsync,
    /// Files opened for appending, kept open so an append costs a write rather than a
    /// path walk and an open. `put` and `delete` drop a key's handle before replacing
    /// or removing its file.
    appenders: Arc<Mutex<HashMap<Key, Arc<Mutex<File>>>>>,
}

/// Most files kept open for appending; past it, the handles are closed and reopened
/// on demand.
const MAX_APPENDERS: usize = 64;

const TMP_DIR: &str = ".tmp";

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl FsStore {
    /// A store rooted at `root`, which is created if missing. The root path itself may
    /// go through symbolic links (it is canonicalized once here); nothing inside it
    /// may.
    pub fn new(root: impl AsRef<Path>) -> Result<Self, OffloadError> {
        let given = root.as_ref();
        let shown = given.display().to_string();
        fs::create_dir_all(given)
            .map_err(|e| OffloadError::io("create the store root", &shown, e))?;
        let root = fs::canonicalize(given)
            .map_err(|e| OffloadError::io("resolve the store root", &shown, e))?;
        let tmp = root.join(TMP_DIR);
        match fs::symlink_metadata(&tmp) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(OffloadError::Symlink {
                    key: shown,
                    at: TMP_DIR.to_owned(),
                });
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::create_dir(&tmp) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(OffloadError::io(
                        "create the temporary directory",
                        &shown,
                        e,
                    ));
                }
            },
            Err(e) => {
                return Err(OffloadError::io(
                    "inspect the temporary directory",
                    &shown,
                    e,
                ));
            }
        }
        Ok(FsStore {
            root,
            tmp,
            fsync: Fsync::default(),
            appenders: Arc::default(),
        })
    }

    /// Sets the fsync policy.
    #[must_use]
    pub fn with_fsync(mut self, fsync: Fsync) -> Self {
        self.fsync = fsync;
        self
    }

    /// The canonical root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The fsync policy.
    pub fn fsync(&self) -> Fsync {
        self.fsync
    }

    /// Where `key` lives on disk (whether or not it exists).
    pub fn path_of(&self, key: &Key) -> PathBuf {
        let mut p = self.root.join(key.thread().as_str());
        p.extend(key.path().components());
        p
    }

    /// Walks `components` below the root, checking (and with `create`, creating) each
    /// as a real directory. `Ok(None)`: one is missing and `create` is false.
    fn walk_dirs<'a>(
        &self,
        key: &dyn std::fmt::Display,
        components: impl Iterator<Item = &'a str>,
        create: bool,
    ) -> Result<Option<PathBuf>, OffloadError> {
        let mut p = self.root.clone();
        let mut rel = String::new();
        for c in components {
            p.push(c);
            if !rel.is_empty() {
                rel.push('/');
            }
            rel.push_str(c);
            match fs::symlink_metadata(&p) {
                Ok(m) => check_dir(key, &rel, &m)?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if !create {
                        return Ok(None);
                    }
                    match fs::create_dir(&p) {
                        Ok(()) => {
                            if self.fsync == Fsync::Always {
                                sync_parent(&p)
                                    .map_err(|e| OffloadError::io("sync a directory", key, e))?;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                            let m = fs::symlink_metadata(&p)
                                .map_err(|e| OffloadError::io("inspect a directory", key, e))?;
                            check_dir(key, &rel, &m)?;
                        }
                        Err(e) => return Err(OffloadError::io("create a directory", key, e)),
                    }
                }
                Err(e) => return Err(OffloadError::io("inspect a directory", key, e)),
            }
        }
        Ok(Some(p))
    }

    /// The on-disk path of a file entry, after checking every directory on the way and
    /// that the entry itself is not a link or a directory. `Ok(None)`: a parent is
    /// missing and `create` is false.
    fn file_path(&self, key: &Key, create: bool) -> Result<Option<PathBuf>, OffloadError> {
        let mut parts: Vec<&str> = std::iter::once(key.thread().as_str())
            .chain(key.path().components())
            .collect();
        let Some(last) = parts.pop() else {
            return Ok(None);
        };
        let Some(mut p) = self.walk_dirs(key, parts.into_iter(), create)? else {
            return Ok(None);
        };
        p.push(last);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => Err(OffloadError::Symlink {
                key: key.to_string(),
                at: format!("{}/{}", key.thread(), key.path()),
            }),
            Ok(m) if m.is_dir() => Err(OffloadError::io(
                "open",
                key,
                io::Error::new(io::ErrorKind::IsADirectory, "it is a directory"),
            )),
            Ok(_) => Ok(Some(p)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Some(p)),
            Err(e) => Err(OffloadError::io("inspect", key, e)),
        }
    }

    fn existing_file(&self, key: &Key) -> Result<PathBuf, OffloadError> {
        self.file_path(key, false)?.ok_or_else(|| not_found(key))
    }

    /// Opens `key` to read. A FIFO or a device placed in the store (by another process)
    /// is refused rather than read: opened without `O_NONBLOCK`, a FIFO with no writer
    /// would hang the open forever (reads of a regular file do not change with it).
    fn open_read(&self, key: &Key) -> Result<File, OffloadError> {
        let p = self.existing_file(key)?;
        let mut options = no_follow();
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
        }
        let f = options
            .read(true)
            .open(&p)
            .map_err(|e| open_error(key, "open", e))?;
        let meta = f
            .metadata()
            .map_err(|e| OffloadError::io("inspect", key, e))?;
        if !meta.is_file() {
            return Err(OffloadError::io(
                "open",
                key,
                io::Error::other("not a regular file (a FIFO, a device or a directory)"),
            ));
        }
        Ok(f)
    }

    /// The open append handle of `key`, opening (with every check) when needed.
    fn appender(&self, key: &Key) -> Result<Arc<Mutex<File>>, OffloadError> {
        let mut open = self
            .appenders
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = open.get(key) {
            return Ok(Arc::clone(f));
        }
        let target = self.file_path(key, true)?.ok_or_else(|| not_found(key))?;
        let f = no_follow()
            .append(true)
            .create(true)
            .open(&target)
            .map_err(|e| open_error(key, "open for append", e))?;
        let created = f.metadata().map(|m| m.len() == 0).unwrap_or(true);
        if created && self.fsync == Fsync::Always {
            sync_parent(&target).map_err(|e| OffloadError::io("sync a directory", key, e))?;
        }
        if open.len() >= MAX_APPENDERS {
            open.clear();
        }
        let f = Arc::new(Mutex::new(f));
        open.insert(key.clone(), Arc::clone(&f));
        Ok(f)
    }

    fn forget_appender(&self, key: &Key) {
        self.appenders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }

    fn tmp_path(&self) -> PathBuf {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        self.tmp
            .join(format!("{}-{n}-{nanos}.tmp", std::process::id()))
    }
}

fn check_dir(key: &dyn std::fmt::Display, rel: &str, m: &fs::Metadata) -> Result<(), OffloadError> {
    if m.file_type().is_symlink() {
        Err(OffloadError::Symlink {
            key: key.to_string(),
            at: rel.to_owned(),
        })
    } else if m.is_dir() {
        Ok(())
    } else {
        Err(OffloadError::io(
            "use as a directory",
            key,
            io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("`{rel}` is a file, not a directory"),
            ),
        ))
    }
}

fn not_found(key: &Key) -> OffloadError {
    OffloadError::NotFound {
        key: key.to_string(),
    }
}

/// Maps an error of opening a checked path: a vanished file is `NotFound`, a link
/// planted after the check (`ELOOP` under `O_NOFOLLOW`) is `Symlink`.
fn open_error(key: &Key, op: &'static str, e: io::Error) -> OffloadError {
    if e.kind() == io::ErrorKind::NotFound {
        return not_found(key);
    }
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ELOOP) {
        return OffloadError::Symlink {
            key: key.to_string(),
            at: format!("{}/{}", key.thread(), key.path()),
        };
    }
    OffloadError::io(op, key, e)
}

fn no_follow() -> OpenOptions {
    #[allow(unused_mut)]
    let mut o = OpenOptions::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW);
    }
    o
}

fn sync_parent(p: &Path) -> io::Result<()> {
    match p.parent() {
        Some(dir) => sync_dir(dir),
        None => Ok(()),
    }
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}

/// Writes all of `text` and, when asked, syncs it.
fn write_synced(mut f: &File, text: &[u8], fsync: Fsync) -> io::Result<()> {
    f.write_all(text)?;
    if fsync == Fsync::Always {
        f.sync_data()?;
    }
    Ok(())
}

impl OffloadStore for FsStore {
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let target = self.file_path(key, true)?.ok_or_else(|| not_found(key))?;
        self.forget_appender(key);
        let tmp = self.tmp_path();
        let result: Result<u64, OffloadError> = (|| {
            let f = no_follow()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| OffloadError::io("create a temporary file", key, e))?;
            write_synced(&f, text.as_bytes(), self.fsync)
                .map_err(|e| OffloadError::io("write", key, e))?;
            drop(f);
            fs::rename(&tmp, &target).map_err(|e| OffloadError::io("move into place", key, e))?;
            if self.fsync == Fsync::Always {
                sync_parent(&target).map_err(|e| OffloadError::io("sync a directory", key, e))?;
            }
            Ok(text.len() as u64)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let file = self.appender(key)?;
        let result = (|| {
            // Appends to one key through this store take turns, so the end found is
            // where this text lands (another process appending is not seen).
            let file = file.lock().unwrap_or_else(PoisonError::into_inner);
            let start = (&*file)
                .seek(SeekFrom::End(0))
                .map_err(|e| OffloadError::io("seek", key, e))?;
            write_synced(&file, text.as_bytes(), self.fsync)
                .map_err(|e| OffloadError::io("append", key, e))?;
            Ok(start)
        })();
        if result.is_err() {
            self.forget_appender(key);
        }
        result
    }

    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        let mut f = self.open_read(key)?;
        let len = f.metadata().map_or(0, |m| m.len());
        let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        f.read_to_end(&mut bytes)
            .map_err(|e| OffloadError::io("read", key, e))?;
        String::from_utf8(bytes).map_err(|_| OffloadError::NotUtf8 {
            key: key.to_string(),
        })
    }

    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        Ok(Box::new(self.open_read(key)?))
    }

    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
        let mut f = self.open_read(key)?;
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| OffloadError::io("seek", key, e))?;
        let mut out = Vec::with_capacity(len.min(64 << 20));
        f.take(len as u64)
            .read_to_end(&mut out)
            .map_err(|e| OffloadError::io("read", key, e))?;
        Ok(out)
    }

    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
        let Some(p) = self.file_path(key, false)? else {
            return Ok(None);
        };
        match fs::symlink_metadata(&p) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(OffloadError::io("inspect", key, e)),
        }
    }

    fn list(
        &self,
        thread: &ThreadId,
        under: Option<&StorePath>,
    ) -> Result<Vec<Entry>, OffloadError> {
        let shown = match under {
            Some(p) => format!("{thread}/{p}"),
            None => thread.to_string(),
        };
        let components =
            std::iter::once(thread.as_str()).chain(under.into_iter().flat_map(|p| p.components()));
        // The thread directory and everything on the way to `under` must be real
        // directories, except the last component, which may be a file.
        let mut parts: Vec<&str> = components.collect();
        let last = parts.pop().unwrap_or_default();
        let Some(mut p) = self.walk_dirs(&shown, parts.into_iter(), false)? else {
            return match under {
                None => Ok(Vec::new()),
                Some(_) => Err(OffloadError::NotFound { key: shown }),
            };
        };
        p.push(last);
        let m = match fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return match under {
                    None => Ok(Vec::new()),
                    Some(_) => Err(OffloadError::NotFound { key: shown }),
                };
            }
            Err(e) => return Err(OffloadError::io("inspect", &shown, e)),
        };
        if m.file_type().is_symlink() {
            return Err(OffloadError::Symlink {
                at: shown.clone(),
                key: shown,
            });
        }
        if !m.is_dir() {
            return Ok(match under {
                Some(path) => vec![Entry {
                    path: path.clone(),
                    bytes: m.len(),
                }],
                None => Vec::new(),
            });
        }
        let mut out = Vec::new();
        let prefix = under.map(|p| p.as_str().to_owned()).unwrap_or_default();
        let mut stack = vec![(p, prefix)];
        while let Some((dir, rel)) = stack.pop() {
            let entries = fs::read_dir(&dir).map_err(|e| OffloadError::io("list", &shown, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| OffloadError::io("list", &shown, e))?;
                let Ok(name) = entry.file_name().into_string() else {
                    continue; // not UTF-8: no StorePath can name it
                };
                let child = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                // `file_type` and `metadata` of a directory entry do not follow links.
                let ft = entry
                    .file_type()
                    .map_err(|e| OffloadError::io("list", &shown, e))?;
                if ft.is_symlink() {
                    continue; // never followed, never listed
                }
                if ft.is_dir() {
                    stack.push((entry.path(), child));
                } else if ft.is_file() {
                    let Ok(path) = StorePath::new(child) else {
                        continue;
                    };
                    let bytes = entry
                        .metadata()
                        .map_err(|e| OffloadError::io("list", &shown, e))?
                        .len();
                    out.push(Entry { path, bytes });
                }
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
        self.forget_appender(key);
        let Some(p) = self.file_path(key, false)? else {
            return Ok(false);
        };
        match fs::remove_file(&p) {
            Ok(()) => {
                if self.fsync == Fsync::Always {
                    sync_parent(&p).map_err(|e| OffloadError::io("sync a directory", key, e))?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(OffloadError::io("delete", key, e)),
        }
    }

    /// Cuts the file in place (`set_len`), synced as writes are.
    fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
        self.forget_appender(key);
        let p = self.existing_file(key)?;
        let mut f = no_follow()
            .read(true)
            .write(true)
            .open(&p)
            .map_err(|e| open_error(key, "open for truncation", e))?;
        let size = f
            .metadata()
            .map_err(|e| OffloadError::io("inspect", key, e))?
            .len();
        if len >= size {
            return Ok(false);
        }
        let mut at = [0u8; 1];
        f.seek(std::io::SeekFrom::Start(len))
            .and_then(|_| f.read_exact(&mut at))
            .map_err(|e| OffloadError::io("truncate", key, e))?;
        if crate::store::continues_char(at[0]) {
            return Err(crate::store::cut_inside_char(key));
        }
        f.set_len(len)
            .map_err(|e| OffloadError::io("truncate", key, e))?;
        if self.fsync == Fsync::Always {
            f.sync_data()
                .map_err(|e| OffloadError::io("truncate", key, e))?;
        }
        Ok(true)
    }

    /// Deletes the thread's files, then its directories, so a deleted thread leaves no
    /// empty tree behind. Directories are removed only when empty, deepest first, and
    /// symbolic links are never followed.
    fn delete_thread(&self, thread: &ThreadId) -> Result<u64, OffloadError> {
        let mut removed = 0;
        for entry in self.list(thread, None)? {
            if self.delete(&Key::from_parts(thread.clone(), entry.path))? {
                removed += 1;
            }
        }
        let dir = self.root.join(thread.as_str());
        remove_empty_dirs(&dir).map_err(|e| OffloadError::Io {
            op: "delete a thread's directories",
            key: thread.as_str().to_owned(),
            source: e,
        })?;
        Ok(removed)
    }
}

/// Removes `dir` and the directories under it that are (or become) empty; leaves
/// anything else, links included, where it is.
fn remove_empty_dirs(dir: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return Ok(());
    }
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            remove_empty_dirs(&entry.path())?;
        }
    }
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        // Not empty (a file the store does not know, a link): keep it.
        Err(e) if e.kind() == io::ErrorKind::DirectoryNotEmpty => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real `ENOSPC` from the kernel (`/dev/full`) goes through the same write path
    /// and error mapping as `put` and `append`, and is reported as storage full.
    #[cfg(target_os = "linux")]
    #[test]
    fn dev_full_is_storage_full() {
        let Ok(f) = OpenOptions::new().write(true).open("/dev/full") else {
            eprintln!("skipped: /dev/full is not available");
            return;
        };
        let key = Key::new("t", "x").unwrap();
        let err = write_synced(&f, &[b'x'; 1 << 16], Fsync::Never)
            .map_err(|e| OffloadError::io("write", &key, e))
            .unwrap_err();
        assert!(err.is_storage_full(), "{err}");
        assert!(!err.is_permission_denied());
        assert!(
            err.to_string().starts_with("t/x: could not write:"),
            "{err}"
        );
    }
}
