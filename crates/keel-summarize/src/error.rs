use std::fmt;

use keel_model::ModelError;

/// Why no summary was produced. Compaction treats every variant the same way: nothing
/// changes, the raw messages stay.
///
/// ```
/// use keel_summarize::{Rejection, SummarizeError};
///
/// let err = SummarizeError::Rejected { reason: Rejection::Empty, attempts: 2 };
/// assert_eq!(err.to_string(), "summary rejected after 2 attempts: the reply was empty");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SummarizeError {
    /// The message at `index` is the goal anchor (it carries
    /// [`GOAL_METADATA_KEY`](crate::GOAL_METADATA_KEY)); the goal is never summarized.
    #[error("message {index} is the goal anchor; the goal is never given to a summarizer")]
    GoalInInput {
        /// Its index in the request's messages.
        index: usize,
    },
    /// No messages and no previous summary.
    #[error("nothing to summarize")]
    EmptyInput,
    /// The budget (or the summarizer model's window) is too small for even a minimal
    /// summary.
    #[error("budget too small: {budget} tokens available, at least {needed} needed")]
    BudgetTooSmall {
        /// Tokens available.
        budget: usize,
        /// Tokens needed at least.
        needed: usize,
    },
    /// The summarizer's model failed (provider down, timeout, context overflow, ...).
    #[error("summarizer model failed: {0}")]
    Model(#[from] ModelError),
    /// The model's replies were rejected (the first one, then the one retry).
    #[error("summary rejected after {attempts} attempts: {reason}")]
    Rejected {
        /// Why the last reply was rejected.
        reason: Rejection,
        /// Replies received.
        attempts: u32,
    },
    /// The blocking-pool thread summarizing a large span stopped before it finished
    /// (it panicked, or the runtime shut down).
    #[error("the summary was interrupted: {0}")]
    Interrupted(String),
}

/// Why a summary reply was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// The reply had no text.
    Empty,
    /// The model stopped at its token limit: the reply is cut off.
    Truncated,
    /// A structured reply lacked required sections.
    MissingSections(Vec<String>),
    /// A bullet reply had no bullets.
    NoBullets,
    /// A bullet reply had more bullets than allowed.
    TooManyBullets {
        /// Bullets found.
        found: usize,
        /// Bullets allowed.
        max: usize,
    },
    /// The reply is longer than the budget.
    OverBudget {
        /// The reply's tokens.
        tokens: usize,
        /// The budget.
        budget: usize,
    },
    /// The reply reads like a provider's error (rate limit, quota, server error,
    /// gateway) and names almost nothing from the input: an error delivered as a
    /// successful reply, not a summary.
    ProviderError(String),
    /// The reply shares no distinctive term (a name, path, number, word) with the
    /// input, or, with ten terms or more, fewer than one in ten: whatever it is, it
    /// does not summarize this span.
    Unrelated,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::Empty => f.write_str("the reply was empty"),
            Rejection::Truncated => f.write_str("the reply was cut off at the token limit"),
            Rejection::MissingSections(s) => {
                write!(f, "the reply lacks the sections {}", s.join(", "))
            }
            Rejection::NoBullets => f.write_str("the reply has no bullet points"),
            Rejection::TooManyBullets { found, max } => {
                write!(
                    f,
                    "the reply has {found} bullet points, at most {max} allowed"
                )
            }
            Rejection::OverBudget { tokens, budget } => {
                write!(f, "the reply has {tokens} tokens, the budget is {budget}")
            }
            Rejection::ProviderError(phrase) => write!(
                f,
                "the reply looks like a provider error (\"{phrase}\"), not a summary of the input"
            ),
            Rejection::Unrelated => f.write_str(
                "the reply names nothing, or almost nothing, from the input (its files, commands, values and words)",
            ),
        }
    }
}
