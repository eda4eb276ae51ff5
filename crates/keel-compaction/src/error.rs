use keel_offload::OffloadError;
use keel_summarize::SummarizeError;

/// Why a compaction did not happen. The context is unchanged in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompactionError {
    /// A setting of [`CompactionConfig`](crate::CompactionConfig) out of its range
    /// ([`CompactionConfig::validate`](crate::CompactionConfig::validate)).
    #[error("compaction setting `{field}`: {reason}")]
    BadConfig {
        /// The field.
        field: &'static str,
        /// What is wrong, and what to give.
        reason: String,
    },
    /// Nothing can leave the context: the raw buffer is all recent tail, or no cut
    /// keeps tool calls with their results.
    #[error("nothing to compact")]
    NothingToCompact,
    /// The compaction's result was not smaller than what it would replace (a summary
    /// as long as its span, an epoch as long as its milestones), so it was not applied.
    #[error(
        "not applied: the result ({after} tokens) is not smaller than its input ({before} tokens)"
    )]
    NotSmaller {
        /// Tokens of what would have been replaced.
        before: usize,
        /// Tokens of the result.
        after: usize,
    },
    /// The archive write failed, so nothing left the context.
    #[error("archiving failed: {0}")]
    Archive(#[source] OffloadError),
    /// The summarizer failed (after retries, and the fallback when it applied).
    #[error("summarizing failed: {0}")]
    Summarize(#[source] SummarizeError),
    /// The run reached the hard step ceiling.
    #[error(
        "step ceiling reached: {steps} model calls (max {max}); raise it with CompactionConfig::with_max_steps"
    )]
    StepCeiling {
        /// Model calls made.
        steps: u64,
        /// The ceiling.
        max: u64,
    },
}

/// Why [`crate::Compactor::call`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// The model call failed. A context overflow comes here after compacting and
    /// retrying did not cure it, or when there was nothing left to compact.
    #[error(transparent)]
    Model(#[from] keel_model::ModelError),
    /// Compacting after a context overflow failed (the summarizer or the archive).
    #[error(transparent)]
    Compaction(#[from] CompactionError),
    /// The call asks for replies of more tokens (`ChatOptions::max_tokens`) than the
    /// profile keeps free for them: the compactor keeps prompts within the window less
    /// that room, so a server that checks prompt and reply against the window would
    /// refuse every prompt near the budget, and compaction could never make room.
    /// Nothing was sent.
    #[error(
        "the reply cap of {max_tokens} tokens is more than the {reserved} the profile keeps free for the reply (of a {window}-token window): ask for at most {reserved}, or give the compactor a profile whose maximum output is at least {max_tokens} (at most a quarter of the window)"
    )]
    ReplyCapTooLarge {
        /// The `max_tokens` asked for.
        max_tokens: usize,
        /// What the profile keeps free ([`keel_token::ModelProfile::reserved_output`]).
        reserved: usize,
        /// The profile's window.
        window: usize,
    },
}
