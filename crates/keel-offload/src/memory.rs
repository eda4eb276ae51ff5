use std::collections::BTreeMap;
use std::io::{self, Read};
use std::sync::{Arc, PoisonError, RwLock};

use crate::error::OffloadError;
use crate::key::{Key, StorePath, ThreadId};
use crate::store::{Entry, OffloadStore};

/// An [`OffloadStore`] in memory: for tests, examples and agents whose offloaded data
/// may die with the process.
///
/// It behaves like [`FsStore`](crate::FsStore) — same path rules, same directory
/// rules (a path cannot be both a file and a directory), same line and grep
/// semantics — and can be given a byte limit, past which writes fail as a full disk
/// would ([`OffloadError::is_storage_full`]).
///
/// ```
/// use keel_offload::{Key, MemoryStore, OffloadStore};
///
/// let store = MemoryStore::new();
/// let key = Key::new("t1", "archive/messages.jsonl")?;
/// assert_eq!(store.append(&key, "{\"a\":1}\n")?, 0);
/// assert_eq!(store.append(&key, "{\"a\":2}\n")?, 8);
/// assert_eq!(store.size(&key)?, Some(16));
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: RwLock<Inner>,
    limit: Option<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    files: BTreeMap<(String, String), Arc<Vec<u8>>>,
    bytes: u64,
}

impl MemoryStore {
    /// An empty store without a size limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that refuses writes that would make it hold more than `bytes`.
    pub fn with_limit(bytes: u64) -> Self {
        MemoryStore {
            inner: RwLock::default(),
            limit: Some(bytes),
        }
    }

    /// Total bytes stored.
    pub fn bytes(&self) -> u64 {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }

    fn check_room(
        &self,
        inner: &Inner,
        key: &Key,
        removed: u64,
        added: u64,
    ) -> Result<(), OffloadError> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        if inner.bytes - removed + added > limit {
            return Err(OffloadError::io(
                "write",
                key,
                io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!("the memory store's limit of {limit} bytes is reached"),
                ),
            ));
        }
        Ok(())
    }

    fn get_arc(&self, key: &Key) -> Result<Arc<Vec<u8>>, OffloadError> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(data) = inner.files.get(&map_key(key)) {
            return Ok(Arc::clone(data));
        }
        check_not_dir(&inner, key)?;
        Err(OffloadError::NotFound {
            key: key.to_string(),
        })
    }
}

fn map_key(key: &Key) -> (String, String) {
    (
        key.thread().as_str().to_owned(),
        key.path().as_str().to_owned(),
    )
}

/// Keys of `thread` under the directory `dir` (`dir/...`).
fn under<'a>(
    files: &'a BTreeMap<(String, String), Arc<Vec<u8>>>,
    thread: &str,
    dir: &str,
) -> impl Iterator<Item = (&'a (String, String), &'a Arc<Vec<u8>>)> {
    // Every path below `dir` sorts between `dir/` and `dir0` ('0' follows '/').
    let lo = (thread.to_owned(), format!("{dir}/"));
    let hi = (thread.to_owned(), format!("{dir}0"));
    files.range(lo..hi)
}

/// A path that is the directory of other files cannot be read as a file.
fn check_not_dir(inner: &Inner, key: &Key) -> Result<(), OffloadError> {
    if under(&inner.files, key.thread().as_str(), key.path().as_str())
        .next()
        .is_some()
    {
        return Err(OffloadError::io(
            "open",
            key,
            io::Error::new(io::ErrorKind::IsADirectory, "it is a directory"),
        ));
    }
    Ok(())
}

/// A file may be created at `key` only if no ancestor is a file and it is not a
/// directory (the prefix of another file).
fn check_shape(inner: &Inner, key: &Key) -> Result<(), OffloadError> {
    let thread = key.thread().as_str();
    let path = key.path().as_str();
    for (i, _) in path.match_indices('/') {
        let ancestor = &path[..i];
        if inner
            .files
            .contains_key(&(thread.to_owned(), ancestor.to_owned()))
        {
            return Err(OffloadError::io(
                "use as a directory",
                key,
                io::Error::new(
                    io::ErrorKind::NotADirectory,
                    format!("`{thread}/{ancestor}` is a file, not a directory"),
                ),
            ));
        }
    }
    check_not_dir(inner, key)
}

impl OffloadStore for MemoryStore {
    fn put(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        check_shape(&inner, key)?;
        let k = map_key(key);
        let old = inner.files.get(&k).map_or(0, |v| v.len() as u64);
        self.check_room(&inner, key, old, text.len() as u64)?;
        inner.files.insert(k, Arc::new(text.as_bytes().to_vec()));
        inner.bytes = inner.bytes - old + text.len() as u64;
        Ok(text.len() as u64)
    }

    fn append(&self, key: &Key, text: &str) -> Result<u64, OffloadError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        check_shape(&inner, key)?;
        self.check_room(&inner, key, 0, text.len() as u64)?;
        let data = inner.files.entry(map_key(key)).or_default();
        let start = data.len() as u64;
        // Copies only if a reader still holds the previous bytes.
        Arc::make_mut(data).extend_from_slice(text.as_bytes());
        inner.bytes += text.len() as u64;
        Ok(start)
    }

    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        let data = self.get_arc(key)?;
        String::from_utf8(data.as_ref().clone()).map_err(|_| OffloadError::NotUtf8 {
            key: key.to_string(),
        })
    }

    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        Ok(Box::new(ArcReader {
            data: self.get_arc(key)?,
            pos: 0,
        }))
    }

    fn read_at(&self, key: &Key, offset: u64, len: usize) -> Result<Vec<u8>, OffloadError> {
        let data = self.get_arc(key)?;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let end = start.saturating_add(len).min(data.len());
        Ok(data[start..end].to_vec())
    }

    fn size(&self, key: &Key) -> Result<Option<u64>, OffloadError> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        match inner.files.get(&map_key(key)) {
            Some(v) => Ok(Some(v.len() as u64)),
            None => check_not_dir(&inner, key).map(|()| None),
        }
    }

    fn list(&self, thread: &ThreadId, dir: Option<&StorePath>) -> Result<Vec<Entry>, OffloadError> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let entry = |(k, v): (&(String, String), &Arc<Vec<u8>>)| {
            StorePath::new(k.1.clone()).map(|path| Entry {
                path,
                bytes: v.len() as u64,
            })
        };
        match dir {
            None => {
                let lo = (thread.as_str().to_owned(), String::new());
                inner
                    .files
                    .range(lo..)
                    .take_while(|(k, _)| k.0 == thread.as_str())
                    .map(entry)
                    .collect()
            }
            Some(p) => {
                let k = (thread.as_str().to_owned(), p.as_str().to_owned());
                if let Some(v) = inner.files.get(&k) {
                    return Ok(vec![Entry {
                        path: p.clone(),
                        bytes: v.len() as u64,
                    }]);
                }
                let found: Vec<Entry> = under(&inner.files, thread.as_str(), p.as_str())
                    .map(entry)
                    .collect::<Result<_, _>>()?;
                if found.is_empty() {
                    return Err(OffloadError::NotFound {
                        key: format!("{thread}/{p}"),
                    });
                }
                Ok(found)
            }
        }
    }

    fn truncate(&self, key: &Key, len: u64) -> Result<bool, OffloadError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        let Some(data) = inner.files.get_mut(&map_key(key)) else {
            check_not_dir(&inner, key)?;
            return Err(OffloadError::NotFound {
                key: key.to_string(),
            });
        };
        let old = data.len() as u64;
        if len >= old {
            return Ok(false);
        }
        let at = usize::try_from(len).unwrap_or(usize::MAX);
        if data
            .get(at)
            .copied()
            .is_some_and(crate::store::continues_char)
        {
            return Err(crate::store::cut_inside_char(key));
        }
        // Copies only if a reader still holds the previous bytes.
        Arc::make_mut(data).truncate(usize::try_from(len).unwrap_or(usize::MAX));
        inner.bytes -= old - len;
        Ok(true)
    }

    fn delete(&self, key: &Key) -> Result<bool, OffloadError> {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        match inner.files.remove(&map_key(key)) {
            Some(v) => {
                inner.bytes -= v.len() as u64;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

struct ArcReader {
    data: Arc<Vec<u8>>,
    pos: usize,
}

impl Read for ArcReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let rest = self.data.get(self.pos..).unwrap_or_default();
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.pos += n;
        Ok(n)
    }
}
