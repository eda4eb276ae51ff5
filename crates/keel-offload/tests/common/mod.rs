//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::expect_used)]

use std::io::{self, Read};
use std::path::Path;

use keel_offload::{Entry, Key, OffloadError, OffloadStore, StorePath, ThreadId};

/// A store whose every write fails with `kind` (as the OS would report it) and which
/// holds nothing: for checking that policies leave messages in place on failure.
pub struct Faulty(pub io::ErrorKind);

impl Faulty {
    fn fail(&self, key: &Key) -> OffloadError {
        OffloadError::Io {
            op: "write",
            key: key.to_string(),
            source: io::Error::from(self.0),
        }
    }
}

impl OffloadStore for Faulty {
    fn put(&self, key: &Key, _text: &str) -> Result<u64, OffloadError> {
        Err(self.fail(key))
    }
    fn append(&self, key: &Key, _text: &str) -> Result<u64, OffloadError> {
        Err(self.fail(key))
    }
    fn get(&self, key: &Key) -> Result<String, OffloadError> {
        Err(OffloadError::NotFound {
            key: key.to_string(),
        })
    }
    fn open(&self, key: &Key) -> Result<Box<dyn Read + Send + '_>, OffloadError> {
        Err(OffloadError::NotFound {
            key: key.to_string(),
        })
    }
    fn read_at(&self, key: &Key, _offset: u64, _len: usize) -> Result<Vec<u8>, OffloadError> {
        Err(OffloadError::NotFound {
            key: key.to_string(),
        })
    }
    fn size(&self, _key: &Key) -> Result<Option<u64>, OffloadError> {
        Ok(None)
    }
    fn list(
        &self,
        _thread: &ThreadId,
        _under: Option<&StorePath>,
    ) -> Result<Vec<Entry>, OffloadError> {
        Ok(Vec::new())
    }
    fn delete(&self, _key: &Key) -> Result<bool, OffloadError> {
        Ok(false)
    }
}

/// How a test made a directory unwritable.
#[derive(Debug, PartialEq, Eq)]
pub enum Blocked {
    /// `chmod 0555`: writes fail with permission denied.
    ReadOnly,
    /// Running with the power to ignore permissions (root): the directory was replaced
    /// by a regular file, so nothing can be created under it (`ENOTDIR`).
    FileInTheWay,
}

/// Makes `dir` (which must not exist yet) a place where files cannot be created.
///
/// First tries a read-only directory and checks that it really refuses a new file:
/// when it does not (tests run as root, where `chmod` does not stop writes), it uses a
/// regular file in place of the directory instead.
#[cfg(unix)]
pub fn block_dir(dir: &Path) -> Blocked {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).expect("create dir");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).expect("chmod");
    let probe = dir.join(".probe");
    if std::fs::write(&probe, "x").is_err() {
        return Blocked::ReadOnly;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod back");
    std::fs::remove_dir_all(dir).expect("remove dir");
    std::fs::write(dir, "a regular file where a directory should be").expect("write file");
    Blocked::FileInTheWay
}

/// Undoes [`block_dir`] so the temporary directory can be removed.
#[cfg(unix)]
pub fn unblock_dir(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if dir.is_dir() {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    }
}
