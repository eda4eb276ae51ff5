//! Paths from the model, kept inside the root.
//!
//! A path is checked twice. First as text ([`Relative::parse`]): no NUL byte, not
//! absolute, not too long, and `.`/`..` folded so that it never climbs above the root.
//! Then on the disk ([`Root::existing`], [`Root::new_file`]): the path is canonicalized
//! (every symbolic link resolved) and must still lie under the canonical root, so a
//! link pointing outside is refused however it is reached, as long as nothing changes
//! the tree between the check and the open (see the crate's `FileTools` docs: another
//! process writing in the root can race them).

use std::fmt;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::text::quoted;

/// Longest path accepted, in bytes (Linux's `PATH_MAX`).
pub(super) const MAX_PATH_BYTES: usize = 4096;

/// Why a path was refused. The message is written for the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PathError {
    Nul(String),
    TooLong(usize),
    Absolute(String),
    Escapes(String),
    LinkOutside(String),
    NotFound(String),
    NotADirectory(String),
    Io(String, String),
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathError::Nul(p) => write!(
                f,
                "the path {} contains a NUL byte, which no file name can hold",
                quoted(p)
            ),
            PathError::TooLong(n) => write!(
                f,
                "the path is {n} bytes long; paths of at most {MAX_PATH_BYTES} bytes are accepted"
            ),
            PathError::Absolute(p) => write!(
                f,
                "{} is an absolute path; give a path relative to the root directory, \
                 such as `src/main.rs`",
                quoted(p)
            ),
            PathError::Escapes(p) => write!(
                f,
                "{} leaves the root directory (its `..` goes above the root); paths must \
                 stay inside the root",
                quoted(p)
            ),
            PathError::LinkOutside(p) => write!(
                f,
                "{} goes through a symbolic link that points outside the root directory, \
                 so it cannot be used",
                quoted(p)
            ),
            PathError::NotFound(p) => {
                write!(
                    f,
                    "{} does not exist; use ls to see what is there",
                    quoted(p)
                )
            }
            PathError::NotADirectory(p) => write!(
                f,
                "{} is a file, so nothing can be created under it",
                quoted(p)
            ),
            PathError::Io(p, e) => write!(f, "could not look up {}: {e}", quoted(p)),
        }
    }
}

/// A path relative to the root, checked as text and folded: no `.`, no `..`, no
/// empty components. The empty path is the root itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Relative {
    parts: Vec<String>,
}

impl Relative {
    /// The root itself.
    pub(super) fn root() -> Self {
        Relative { parts: Vec::new() }
    }

    /// Checks `input` as text and folds `.` and `..`.
    pub(super) fn parse(input: &str) -> Result<Self, PathError> {
        if input.contains('\0') {
            return Err(PathError::Nul(input.to_owned()));
        }
        if input.len() > MAX_PATH_BYTES {
            return Err(PathError::TooLong(input.len()));
        }
        let path = Path::new(input);
        if path.is_absolute() || input.starts_with('/') || input.starts_with('\\') {
            return Err(PathError::Absolute(input.to_owned()));
        }
        let mut parts: Vec<String> = Vec::new();
        for component in path.components() {
            match component {
                Component::Prefix(_) | Component::RootDir => {
                    return Err(PathError::Absolute(input.to_owned()));
                }
                Component::CurDir => {}
                Component::ParentDir => {
                    if parts.pop().is_none() {
                        return Err(PathError::Escapes(input.to_owned()));
                    }
                }
                Component::Normal(name) => {
                    parts.push(name.to_string_lossy().into_owned());
                }
            }
        }
        Ok(Relative { parts })
    }

    /// True for the root itself.
    pub(super) fn is_root(&self) -> bool {
        self.parts.is_empty()
    }

    /// The first component (`archive` of `archive/messages.jsonl`).
    pub(super) fn first(&self) -> Option<&str> {
        self.parts.first().map(String::as_str)
    }

    /// The last component: the file or directory name.
    pub(super) fn name(&self) -> Option<&str> {
        self.parts.last().map(String::as_str)
    }

    /// Joined with `/`: `""` for the root.
    pub(super) fn display(&self) -> String {
        self.parts.join("/")
    }

    /// For messages: the path, or "the root directory".
    pub(super) fn describe(&self) -> String {
        if self.is_root() {
            "the root directory".to_owned()
        } else {
            quoted(&self.display())
        }
    }

    /// The same path one level up (the root stays the root).
    fn parent(&self) -> Relative {
        let mut parts = self.parts.clone();
        parts.pop();
        Relative { parts }
    }
}

/// Where a new file goes: its existing, canonical parent directory (inside the root)
/// and the directories still to create under it.
#[derive(Debug)]
pub(super) struct NewFile {
    /// The deepest directory of the path that exists, canonical.
    pub base: PathBuf,
    /// Directories to create under `base`, in order.
    pub missing_dirs: Vec<String>,
    /// The file name.
    pub name: String,
}

/// The canonical root directory every path is taken against.
#[derive(Debug, Clone)]
pub(super) struct Root {
    dir: PathBuf,
}

impl Root {
    /// `dir` must already be canonical.
    pub(super) fn new(dir: PathBuf) -> Self {
        Root { dir }
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    fn join(&self, rel: &Relative) -> PathBuf {
        let mut p = self.dir.clone();
        p.extend(&rel.parts);
        p
    }

    /// True when canonical `path` lies inside the root (or is it).
    pub(super) fn contains(&self, path: &Path) -> bool {
        path.starts_with(&self.dir)
    }

    /// `path` (canonical, inside the root) relative to the root, with `/`: what the
    /// model should type to reach it.
    pub(super) fn relative_display(&self, path: &Path) -> String {
        let rel = path.strip_prefix(&self.dir).unwrap_or(path);
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        parts.join("/")
    }

    /// The canonical location of an existing `rel`, checked to be inside the root.
    pub(super) fn existing(&self, rel: &Relative) -> Result<PathBuf, PathError> {
        let lexical = self.join(rel);
        match lexical.canonicalize() {
            Ok(real) if self.contains(&real) => Ok(real),
            Ok(_) => Err(PathError::LinkOutside(rel.display())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A dangling link is "not found" to canonicalize; say whether it is one.
                if lexical.symlink_metadata().is_ok() {
                    Err(PathError::Io(
                        rel.display(),
                        "it is a symbolic link whose target does not exist".to_owned(),
                    ))
                } else {
                    Err(PathError::NotFound(rel.display()))
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotADirectory => {
                Err(PathError::NotFound(rel.display()))
            }
            Err(e) => Err(PathError::Io(rel.display(), e.to_string())),
        }
    }

    /// Where a file at `rel` (which must not be the root) would be created: the
    /// deepest existing directory on its way, canonical and inside the root, and the
    /// directories to create under it. Says nothing about whether the file exists.
    pub(super) fn new_file(&self, rel: &Relative) -> Result<NewFile, PathError> {
        let name = rel.name().unwrap_or_default().to_owned();
        let mut existing = rel.parent();
        let mut missing: Vec<String> = Vec::new();
        loop {
            let lexical = self.join(&existing);
            match lexical.symlink_metadata() {
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                    ) && !existing.is_root() =>
                {
                    if let Some(last) = existing.parts.pop() {
                        missing.push(last);
                    }
                }
                Err(e) => return Err(PathError::Io(existing.display(), e.to_string())),
            }
        }
        missing.reverse();
        let base = self.existing(&existing)?;
        if !base.is_dir() {
            return Err(PathError::NotADirectory(existing.display()));
        }
        Ok(NewFile {
            base,
            missing_dirs: missing,
            name,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folded(input: &str) -> Result<String, PathError> {
        Relative::parse(input).map(|r| r.display())
    }

    #[test]
    fn text_checks_and_folding() {
        assert_eq!(folded("src/main.rs"), Ok("src/main.rs".into()));
        assert_eq!(folded("./src//main.rs"), Ok("src/main.rs".into()));
        assert_eq!(folded("src/../docs/"), Ok("docs".into()));
        assert_eq!(folded(""), Ok(String::new()));
        assert_eq!(folded("."), Ok(String::new()));
        assert_eq!(folded("a/.."), Ok(String::new()));
        assert!(matches!(folded(".."), Err(PathError::Escapes(_))));
        assert!(matches!(folded("a/../../b"), Err(PathError::Escapes(_))));
        assert!(matches!(folded("/etc/passwd"), Err(PathError::Absolute(_))));
        assert!(matches!(folded("\\etc"), Err(PathError::Absolute(_))));
        assert!(matches!(folded("a\0b"), Err(PathError::Nul(_))));
        assert!(matches!(
            folded(&"a".repeat(MAX_PATH_BYTES + 1)),
            Err(PathError::TooLong(_))
        ));
    }
}
