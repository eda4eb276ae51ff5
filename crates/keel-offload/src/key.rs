use std::fmt;

use crate::error::{KeyKind, KeyProblem, OffloadError, Shown};

/// Longest accepted [`StorePath`], in bytes.
pub const MAX_PATH_BYTES: usize = 1024;

/// Longest accepted path component or [`ThreadId`], in bytes (the usual file-name
/// limit).
pub const MAX_COMPONENT_BYTES: usize = 255;

/// The thread an entry belongs to: every key in a store is namespaced by one.
///
/// A thread id is one path component: not empty, at most [`MAX_COMPONENT_BYTES`]
/// bytes, no `/`, `\`, NUL or control characters, and not starting with `.`.
///
/// ```
/// use keel_offload::ThreadId;
///
/// assert_eq!(ThreadId::new("thread-42")?.as_str(), "thread-42");
/// assert!(ThreadId::new("a/b").is_err());
/// assert!(ThreadId::new("..").is_err());
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ThreadId(String);

impl ThreadId {
    /// Validates a thread id.
    pub fn new(id: impl Into<String>) -> Result<Self, OffloadError> {
        let id = id.into();
        match check_thread(&id) {
            Ok(()) => Ok(ThreadId(id)),
            Err(problem) => Err(OffloadError::InvalidKey {
                kind: KeyKind::Thread,
                key: Shown::new(&id),
                problem,
            }),
        }
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ThreadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for ThreadId {
    type Error = OffloadError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        ThreadId::new(s)
    }
}

/// A relative, `/`-separated path inside a thread's namespace.
///
/// Validation refuses, before any storage is touched: empty paths, paths over
/// [`MAX_PATH_BYTES`] bytes or with a component over [`MAX_COMPONENT_BYTES`], absolute
/// paths, `..`, `.` and empty components (`a//b`, a trailing `/`), NUL bytes, control
/// characters and backslashes.
///
/// ```
/// use keel_offload::{KeyProblem, OffloadError, StorePath};
///
/// let p = StorePath::new("large_tool_results/call_1")?;
/// assert_eq!(p.components().collect::<Vec<_>>(), ["large_tool_results", "call_1"]);
///
/// for (bad, why) in [
///     ("/etc/passwd", KeyProblem::Absolute),
///     ("a/../../b", KeyProblem::ParentDir),
///     ("a\0b", KeyProblem::Nul),
/// ] {
///     match StorePath::new(bad) {
///         Err(OffloadError::InvalidKey { problem, .. }) => assert_eq!(problem, why),
///         other => panic!("{bad:?}: {other:?}"),
///     }
/// }
/// assert!(StorePath::new("x".repeat(4096)).is_err());
/// # Ok::<(), OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorePath(String);

impl StorePath {
    /// Validates a path.
    pub fn new(path: impl Into<String>) -> Result<Self, OffloadError> {
        let path = path.into();
        match check_path(&path) {
            Ok(()) => Ok(StorePath(path)),
            Err(problem) => Err(OffloadError::InvalidKey {
                kind: KeyKind::Path,
                key: Shown::new(&path),
                problem,
            }),
        }
    }

    /// A path this crate spells out itself (covered by the tests of each use).
    pub(crate) fn known(path: &'static str) -> Self {
        StorePath(path.to_owned())
    }

    /// The path.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `/`-separated components, in order.
    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// This path with one more component appended (validated).
    ///
    /// ```
    /// use keel_offload::StorePath;
    /// let dir = StorePath::new("large_tool_results")?;
    /// assert_eq!(dir.join("call_1")?.as_str(), "large_tool_results/call_1");
    /// assert!(dir.join("..").is_err());
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn join(&self, component: &str) -> Result<StorePath, OffloadError> {
        StorePath::new(format!("{}/{component}", self.0))
    }

    /// True if `self` is `dir` or lies under it (compared by whole components).
    ///
    /// ```
    /// use keel_offload::StorePath;
    /// let p = StorePath::new("a/bc/d")?;
    /// assert!(p.starts_with(&StorePath::new("a/bc")?));
    /// assert!(!p.starts_with(&StorePath::new("a/b")?));
    /// # Ok::<(), keel_offload::OffloadError>(())
    /// ```
    pub fn starts_with(&self, dir: &StorePath) -> bool {
        self.0 == dir.0
            || (self.0.len() > dir.0.len()
                && self.0.starts_with(&dir.0)
                && self.0.as_bytes()[dir.0.len()] == b'/')
    }
}

impl fmt::Display for StorePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for StorePath {
    type Error = OffloadError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        StorePath::new(s)
    }
}

/// One stored entry: a [`ThreadId`] and a [`StorePath`] inside it.
///
/// ```
/// use keel_offload::Key;
/// let key = Key::new("t1", "large_tool_results/call_1")?;
/// assert_eq!(key.to_string(), "t1/large_tool_results/call_1");
/// # Ok::<(), keel_offload::OffloadError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    thread: ThreadId,
    path: StorePath,
}

impl Key {
    /// Validates both parts.
    pub fn new(thread: impl Into<String>, path: impl Into<String>) -> Result<Self, OffloadError> {
        Ok(Key {
            thread: ThreadId::new(thread)?,
            path: StorePath::new(path)?,
        })
    }

    /// A key from parts already validated.
    pub fn from_parts(thread: ThreadId, path: StorePath) -> Self {
        Key { thread, path }
    }

    /// The thread.
    pub fn thread(&self) -> &ThreadId {
        &self.thread
    }

    /// The path inside the thread.
    pub fn path(&self) -> &StorePath {
        &self.path
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.thread, self.path)
    }
}

/// Turns any text (a tool-call id, an argument name) into one safe path component.
///
/// Text that is already a short, plain name (ASCII letters, digits, `_`, `-`, `.`, at
/// most 128 bytes, not `.` or `..`, not ending as a mapped name does) is kept as it is,
/// so `call_abc123` stays `call_abc123`. Anything else has every other character
/// replaced by `_`, is cut to 64 bytes, and gets `-` and a 16-digit hash of the
/// original appended. A kept name never ends in `-` and 16 lowercase hex digits, so it
/// cannot equal a mapped one: different texts never share a component (short of a
/// 64-bit hash collision).
///
/// ```
/// use keel_offload::safe_component;
///
/// assert_eq!(safe_component("call_abc123"), "call_abc123");
/// let odd = safe_component("../../etc/passwd");
/// assert!(odd.starts_with(".._.._etc_passwd-"));
/// assert_ne!(safe_component("a/b"), safe_component("a_b"));
/// // A plain name shaped like a mapped one is mapped too.
/// let mapped = safe_component("a/b");
/// assert_ne!(safe_component(&mapped), mapped);
/// ```
pub fn safe_component(raw: &str) -> String {
    const KEEP_MAX: usize = 128;
    const CUT: usize = 64;
    const HASH_DIGITS: usize = 16;
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    let looks_mapped = |s: &str| {
        s.len() > HASH_DIGITS
            && s.as_bytes()[s.len() - HASH_DIGITS - 1] == b'-'
            && s.as_bytes()[s.len() - HASH_DIGITS..]
                .iter()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    if !raw.is_empty()
        && raw.len() <= KEEP_MAX
        && raw != "."
        && raw != ".."
        && raw.chars().all(plain)
        && !looks_mapped(raw)
    {
        return raw.to_owned();
    }
    let mut out: String = raw
        .chars()
        .map(|c| if plain(c) { c } else { '_' })
        .take(CUT)
        .collect();
    let hash = xxhash_rust::xxh3::xxh3_64(raw.as_bytes());
    out.push_str(&format!("-{hash:016x}"));
    out
}

fn check_common(s: &str) -> Result<(), KeyProblem> {
    if s.is_empty() {
        return Err(KeyProblem::Empty);
    }
    if s.chars().all(char::is_whitespace) {
        return Err(KeyProblem::Blank);
    }
    for c in s.chars() {
        if c == '\0' {
            return Err(KeyProblem::Nul);
        }
        // Text-direction marks and overrides would make a name read as another.
        if c.is_control()
            || matches!(c, '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
        {
            return Err(KeyProblem::ControlChar(u32::from(c)));
        }
        if c == '\\' {
            return Err(KeyProblem::Backslash);
        }
    }
    Ok(())
}

fn check_thread(s: &str) -> Result<(), KeyProblem> {
    if s.len() > MAX_COMPONENT_BYTES {
        return Err(KeyProblem::TooLong {
            len: s.len(),
            max: MAX_COMPONENT_BYTES,
        });
    }
    check_common(s)?;
    if s.contains('/') {
        return Err(KeyProblem::Separator);
    }
    if s.starts_with('.') {
        return Err(KeyProblem::LeadingDot);
    }
    Ok(())
}

fn check_path(s: &str) -> Result<(), KeyProblem> {
    if s.len() > MAX_PATH_BYTES {
        return Err(KeyProblem::TooLong {
            len: s.len(),
            max: MAX_PATH_BYTES,
        });
    }
    check_common(s)?;
    if s.starts_with('/') {
        return Err(KeyProblem::Absolute);
    }
    for component in s.split('/') {
        match component {
            ".." => return Err(KeyProblem::ParentDir),
            "" | "." => return Err(KeyProblem::EmptyComponent),
            c if c.len() > MAX_COMPONENT_BYTES => {
                return Err(KeyProblem::ComponentTooLong {
                    len: c.len(),
                    max: MAX_COMPONENT_BYTES,
                });
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(path: &str) -> Option<KeyProblem> {
        match StorePath::new(path) {
            Ok(_) => None,
            Err(OffloadError::InvalidKey { problem, .. }) => Some(problem),
            Err(other) => panic!("unexpected error {other}"),
        }
    }

    #[test]
    fn paths() {
        let cases: &[(&str, Option<KeyProblem>)] = &[
            ("a", None),
            ("a/b/c.txt", None),
            (".hidden/x", None),
            ("a..b", None),
            ("", Some(KeyProblem::Empty)),
            ("/a", Some(KeyProblem::Absolute)),
            ("/", Some(KeyProblem::Absolute)),
            ("..", Some(KeyProblem::ParentDir)),
            ("a/..", Some(KeyProblem::ParentDir)),
            ("../../etc/passwd", Some(KeyProblem::ParentDir)),
            (".", Some(KeyProblem::EmptyComponent)),
            ("a/./b", Some(KeyProblem::EmptyComponent)),
            ("a//b", Some(KeyProblem::EmptyComponent)),
            ("a/", Some(KeyProblem::EmptyComponent)),
            ("a\0b", Some(KeyProblem::Nul)),
            ("a\nb", Some(KeyProblem::ControlChar(10))),
            ("a\\..\\b", Some(KeyProblem::Backslash)),
            (
                &"x".repeat(256),
                Some(KeyProblem::ComponentTooLong { len: 256, max: 255 }),
            ),
            (
                &"x".repeat(4096),
                Some(KeyProblem::TooLong {
                    len: 4096,
                    max: 1024,
                }),
            ),
        ];
        for (path, want) in cases {
            assert_eq!(&problem(path), want, "{path:?}");
        }
        // Exactly at the limits is fine.
        let long = vec!["y".repeat(255); 4].join("/");
        assert_eq!(long.len(), 1023);
        assert_eq!(problem(&long), None);
    }

    #[test]
    fn threads() {
        assert!(ThreadId::new("0191b6c2-7c3e-7cc4-a7a5-5d9d2b1f2e4a").is_ok());
        for bad in [
            "",
            ".",
            "..",
            ".tmp",
            "a/b",
            "a\\b",
            "a\0",
            &"t".repeat(256),
        ] {
            assert!(ThreadId::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shown_keys_are_escaped_and_short() {
        let err = StorePath::new(format!("{}\0", "n".repeat(4000))).unwrap_err();
        let text = err.to_string();
        assert!(text.len() < 200, "{text}");
        assert!(text.contains("4001 characters"), "{text}");
        let err = StorePath::new("a\0b").unwrap_err().to_string();
        assert!(err.contains(r#""a\0b""#), "{err}");
    }

    #[test]
    fn safe_components_are_valid_and_distinct() {
        let ids = [
            "call_1",
            "..",
            ".",
            "",
            "a/b",
            "a_b",
            "toolu_01A09q90qw90lq917835lq9",
            "日本語",
            &"z".repeat(1000),
            "a\0b",
        ];
        let mut seen = std::collections::HashSet::new();
        for id in ids {
            let c = safe_component(id);
            assert!(StorePath::new(c.clone()).is_ok(), "{id:?} -> {c:?}");
            assert!(!c.contains('/'));
            assert!(seen.insert(c), "{id:?} collides");
        }
    }
}
