use crate::Encoding;

/// Why a counter could not be built or configured.
///
/// Counting itself never fails: every method of [`TokenCounter`](crate::TokenCounter)
/// returns a number for any input.
///
/// ```
/// # #[cfg(feature = "tiktoken")] {
/// use keel_token::{Encoding, TiktokenCounter, TokenError};
///
/// let err = TiktokenCounter::new(Encoding::Approximate).unwrap_err();
/// assert!(matches!(err, TokenError::NotBpe { .. }));
/// assert_eq!(err.to_string(), "`approximate` is not a BPE encoding");
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// [`TiktokenCounter`](crate::TiktokenCounter) was asked for an encoding that has no
    /// BPE vocabulary.
    #[error("`{encoding}` is not a BPE encoding")]
    NotBpe {
        /// The encoding asked for.
        encoding: Encoding,
    },
    /// The vocabulary built into the crate (from `tiktoken-rs`'s files) could not be
    /// loaded.
    #[error("could not load the `{encoding}` vocabulary: {reason}")]
    Vocabulary {
        /// The encoding being loaded.
        encoding: Encoding,
        /// What went wrong.
        reason: String,
    },
    /// A calibration setting is out of range.
    #[error("invalid calibration setting: {0}")]
    InvalidCalibration(String),
}
