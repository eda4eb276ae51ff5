//! The error type of every checkpointer.

use crate::id::CheckpointId;

/// Why a checkpointer operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Fencing refused a put: the thread's newest checkpoint is not the one the writer
    /// expected (another writer got there first). Nothing was written.
    #[error(
        "stale writer: expected head {}, but the thread's head is {}: another run of this thread wrote first (run a thread once at a time); nothing was written, and running the thread again continues from its head",
        show(expected),
        show(actual)
    )]
    Conflict {
        /// The head the writer expected.
        expected: Option<CheckpointId>,
        /// The thread's actual head.
        actual: Option<CheckpointId>,
    },
    /// Something the operation needs does not exist (e.g. the checkpoint writes are
    /// put against).
    #[error("not found: {what}")]
    NotFound {
        /// What was missing.
        what: String,
    },
    /// The request is malformed or inconsistent with what is stored (e.g. a delta
    /// whose writer is not the checkpoint being put, or a base version never stored).
    /// Nothing was written.
    #[error("invalid request: {reason}")]
    Invalid {
        /// What is wrong with it.
        reason: String,
    },
    /// Stored data is inconsistent (e.g. a delta a chain needs is missing).
    #[error("corrupt checkpoint data: {what}")]
    Corrupt {
        /// What is inconsistent.
        what: String,
    },
    /// The checkpointer does not implement this operation; nothing was changed. A
    /// backend that keeps the trait's default for an optional method (such as
    /// [`Checkpointer::sweep_idle`](crate::Checkpointer::sweep_idle)) says so with this.
    #[error("{operation} is not supported by this checkpointer")]
    Unsupported {
        /// The operation (the `Checkpointer` method's name).
        operation: &'static str,
    },
    /// The storage backend failed.
    #[error("checkpoint backend error: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl CheckpointError {
    /// Wraps a backend's own error.
    pub fn backend(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Backend(error.into())
    }

    /// Whether this is a fencing [`Conflict`](Self::Conflict).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Self::Conflict { .. })
    }

    /// Whether this is [`Unsupported`](Self::Unsupported): the backend lacks the
    /// operation.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}

fn show(id: &Option<CheckpointId>) -> String {
    match id {
        Some(id) => id.to_string(),
        None => "none (empty thread)".to_owned(),
    }
}
