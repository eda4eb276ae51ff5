//! What the database backends share: a value is a row of `files` (thread, path,
//! generation, size) plus its bytes in `chunks` rows (thread, generation, offset,
//! data) of at most [`CHUNK`] bytes, read back by offset range.
//!
//! * A `put` gives the value a new random generation, so the chunks of the old value
//!   and of the new never mix: a reader that started on the old one finds its chunks
//!   gone and fails with [`changed`] instead of reading half of each.
//! * An `append` adds chunk rows at the end and bumps the size; nothing stored is
//!   rewritten.
//! * Chunks of one generation are contiguous (each starts where the one before it
//!   ends), so a range of offsets `[pos, pos + FETCH)` holds at most `FETCH + CHUNK`
//!   bytes: every read is bounded, whatever the value's size.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::OffloadError;
use crate::key::Key;

/// Largest chunk row, in bytes.
pub(crate) const CHUNK: usize = 1 << 20;

/// A streaming read asks for the chunks starting in this many bytes at a time.
pub(crate) const FETCH: u64 = 1 << 20;

static GEN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new random generation (positive, so it reads the same as a signed SQL integer).
pub(crate) fn new_gen() -> i64 {
    let n = GEN_COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = std::collections::hash_map::RandomState::new().hash_one((n, std::process::id()));
    i64::try_from(h >> 1).unwrap_or(i64::MAX)
}

/// The bounds of the paths under the directory `dir`: every one sorts in
/// `[dir/, dir0)` byte-wise (`0` follows `/`).
pub(crate) fn dir_bounds(dir: &str) -> (String, String) {
    (format!("{dir}/"), format!("{dir}0"))
}

/// `a`, `a/b` for the path `a/b/c`: the directories a file at `path` needs.
pub(crate) fn ancestors(path: &str) -> Vec<String> {
    path.match_indices('/')
        .map(|(i, _)| path[..i].to_owned())
        .collect()
}

/// A file cannot be read, sized or replaced where a directory is.
pub(crate) fn is_a_directory(key: &Key) -> OffloadError {
    OffloadError::io(
        "open",
        key,
        io::Error::new(io::ErrorKind::IsADirectory, "it is a directory"),
    )
}

/// A file cannot be created under another file.
pub(crate) fn not_a_directory(key: &Key, ancestor: &str) -> OffloadError {
    OffloadError::io(
        "use as a directory",
        key,
        io::Error::new(
            io::ErrorKind::NotADirectory,
            format!("`{}/{ancestor}` is a file, not a directory", key.thread()),
        ),
    )
}

pub(crate) fn not_found(key: &Key) -> OffloadError {
    OffloadError::NotFound {
        key: key.to_string(),
    }
}

/// The error of a read whose value was replaced or deleted under it.
pub(crate) fn changed() -> io::Error {
    io::Error::other("the value was replaced or deleted while it was being read")
}

/// Checks that `rows` continue a value at `pos` without a gap and moves `pos` past
/// them.
pub(crate) fn follow(pos: &mut u64, rows: &[(u64, Vec<u8>)]) -> io::Result<()> {
    for (off, data) in rows {
        if *off != *pos || data.is_empty() {
            return Err(changed());
        }
        *pos += data.len() as u64;
    }
    Ok(())
}

/// A value's bytes from `read_at`'s row slices: `(offset of the chunk, bytes from
/// max(start, offset))`, in offset order.
pub(crate) fn join_slices(start: u64, len: u64, rows: Vec<(u64, Vec<u8>)>) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0).min(64 << 20));
    let mut at = start;
    for (off, data) in rows {
        if off.max(start) != at {
            return Err(changed());
        }
        at += data.len() as u64;
        out.extend_from_slice(&data);
    }
    out.truncate(usize::try_from(len).unwrap_or(usize::MAX));
    Ok(out)
}

/// A streaming reader over a value's chunks: asks `fetch(pos)` for the chunks of one
/// generation starting in `[pos, pos + FETCH)`, in order, and serves them; stops at
/// the size the value had when it was opened.
pub(crate) struct ChunkReader<F> {
    fetch: F,
    /// Offset just past what was fetched.
    pos: u64,
    size: u64,
    queue: VecDeque<Vec<u8>>,
    current: Vec<u8>,
    at: usize,
}

impl<F> ChunkReader<F>
where
    F: FnMut(u64) -> io::Result<Vec<(u64, Vec<u8>)>>,
{
    pub(crate) fn new(size: u64, fetch: F) -> Self {
        ChunkReader {
            fetch,
            pos: 0,
            size,
            queue: VecDeque::new(),
            current: Vec::new(),
            at: 0,
        }
    }
}

impl<F> Read for ChunkReader<F>
where
    F: FnMut(u64) -> io::Result<Vec<(u64, Vec<u8>)>>,
{
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.at < self.current.len() {
                let rest = &self.current[self.at..];
                let n = rest.len().min(buf.len());
                buf[..n].copy_from_slice(&rest[..n]);
                self.at += n;
                return Ok(n);
            }
            if let Some(next) = self.queue.pop_front() {
                self.current = next;
                self.at = 0;
                continue;
            }
            if self.pos >= self.size || buf.is_empty() {
                return Ok(0);
            }
            let rows = (self.fetch)(self.pos)?;
            if rows.is_empty() {
                return Err(changed());
            }
            follow(&mut self.pos, &rows)?;
            self.queue.extend(rows.into_iter().map(|(_, data)| data));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn ancestors_and_bounds() {
        assert_eq!(ancestors("a/b/c"), ["a", "a/b"]);
        assert!(ancestors("a").is_empty());
        assert_eq!(dir_bounds("x"), ("x/".to_owned(), "x0".to_owned()));
        assert!(new_gen() > 0);
        assert_ne!(new_gen(), new_gen());
    }

    #[test]
    fn the_reader_follows_chunks_and_refuses_gaps() {
        let chunks: Vec<(u64, Vec<u8>)> = vec![(0, b"abc".to_vec()), (3, b"de".to_vec())];
        let rows = chunks.clone();
        let mut r = ChunkReader::new(5, move |pos| {
            Ok(rows
                .iter()
                .filter(|(o, _)| *o >= pos)
                .take(1)
                .cloned()
                .collect())
        });
        let mut s = String::new();
        r.read_to_string(&mut s).unwrap();
        assert_eq!(s, "abcde");
        // A value replaced under the reader: its chunks are gone.
        let mut gone = ChunkReader::new(5, |_| Ok(Vec::new()));
        assert!(gone.read(&mut [0; 4]).is_err());
        let mut gap = ChunkReader::new(5, |_| Ok(vec![(1, b"x".to_vec())]));
        assert!(gap.read(&mut [0; 4]).is_err());
        assert_eq!(
            join_slices(2, 3, vec![(0, b"c".to_vec()), (3, b"de".to_vec())]).unwrap(),
            b"cde"
        );
        assert!(join_slices(2, 3, vec![(0, b"c".to_vec()), (4, b"e".to_vec())]).is_err());
    }
}
