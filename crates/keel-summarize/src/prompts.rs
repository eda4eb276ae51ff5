//! Versioned prompt templates. A template's text never changes under the same version:
//! change the text, bump the version, so every stored summary says which prompt wrote
//! it.

use crate::Level;

/// A system prompt with its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Template {
    /// Recorded on every summary as [`Summary::prompt_version`](crate::Summary).
    pub version: &'static str,
    /// The system prompt.
    pub system: &'static str,
}

/// Milestone notes as at most five bullets.
pub const MILESTONE_V1: Template = Template {
    version: "milestone-v1",
    system: "\
You condense a stretch of an AI agent's working history into a milestone note. The agent \
will read this note later in place of the messages, so it must carry everything it needs \
to continue.

Write at most 5 bullet points, each on its own line starting with \"- \". Cover, when the \
messages show them and in this order: what was accomplished or discovered; decisions made \
and the reason for each; errors that are still unresolved, with their message quoted \
exactly; blockers; actions still pending.

Rules:
- Use only what the messages show. Do not invent files, results, numbers or reasons.
- Keep identifiers exact: file paths, commands, exit codes, error text, ids, numbers.
- Do not restate the overall task or goal; it is kept elsewhere.
- Reply with the bullet points only: no heading, no preamble, no closing remark.",
};

/// Epoch summaries merging milestones into at most six bullets.
pub const EPOCH_V1: Template = Template {
    version: "epoch-v1",
    system: "\
You merge an AI agent's milestone notes, and the previous epoch summary when one is given, \
into a single epoch summary that replaces all of them.

Write at most 6 bullet points, each on its own line starting with \"- \".

Rules:
- Copy unresolved errors and open issues word for word.
- Drop facts that later notes supersede: an error since fixed, a plan since replaced, a \
value since changed. When notes disagree, the later one wins.
- Use only what the notes show. Do not invent anything.
- Keep identifiers exact: file paths, commands, exit codes, error text, ids, numbers.
- Do not restate the overall task or goal; it is kept elsewhere.
- Reply with the bullet points only: no heading, no preamble, no closing remark.",
};

/// Structured summaries with four required sections, at either level.
pub const STRUCTURED_V1: Template = Template {
    version: "structured-v1",
    system: "\
You condense part of an AI agent's working history into a structured note that the agent \
will read later in place of the input.

Reply with exactly these four sections, in this order. Put each heading alone on its \
line, followed by bullet points starting with \"- \"; write \"- none\" under a heading \
with nothing to report.

SESSION INTENT:
(what the user asked for in this input, in their words where possible; not the overall \
goal, which is kept elsewhere)
SUMMARY:
(what was done and found, decisions and why, errors still unresolved quoted exactly)
ARTIFACTS:
(files, commands with their exit status, ids and values that matter)
NEXT STEPS:
(pending actions and blockers)

When the input is earlier notes rather than raw messages, merge them: keep unresolved \
issues word for word and drop facts that later notes supersede.

Use only what the input shows; never invent anything. Keep identifiers exact. Write \
nothing outside the four sections.",
};

/// The most bullets a bullet summary may have at `level`.
pub(crate) fn max_bullets(level: Level) -> usize {
    match level {
        Level::Milestone => 5,
        Level::Epoch => 6,
    }
}
