//! The goal anchor: the original request and hard constraints, never compacted.

use keel_message::{Content, Message};
use keel_summarize::GOAL_METADATA_KEY;
use serde::{Deserialize, Serialize};

/// The id every goal message carries.
pub const GOAL_ID: &str = "keel-goal";

/// The original request and its hard constraints, set once.
///
/// The anchor is rendered to one message when it is made, and that message is what
/// heads every assembled prompt, byte for byte (invariant 1). It is flagged with
/// [`GOAL_METADATA_KEY`], so every summarizer refuses it as input: the goal is never
/// paraphrased.
///
/// ```
/// use keel_compaction::GoalAnchor;
///
/// let goal = GoalAnchor::new("Book the cheapest flight to Lisbon on May 3.")
///     .with_constraints(["Never pay more than $400.", "Ask before charging a card."]);
/// assert!(goal.text().starts_with("Book the cheapest flight"));
/// assert!(goal.text().contains("- Never pay more than $400."));
/// assert!(keel_compaction::summarize::is_goal(goal.message()));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoalAnchor {
    request: Content,
    constraints: Vec<String>,
    message: Message,
}

impl GoalAnchor {
    /// An anchor for `request`, with no separate constraints. The message's text is
    /// exactly `request`.
    pub fn new(request: impl Into<String>) -> Self {
        Self::build(Content::Text(request.into()), Vec::new())
    }

    /// An anchor whose message carries `message`'s content verbatim (text or parts),
    /// for a request that arrived as a user message.
    pub fn from_message(message: &Message) -> Self {
        Self::build(message.content.clone(), Vec::new())
    }

    /// Adds hard constraints, rendered after the request as a bulleted list.
    #[must_use]
    pub fn with_constraints<I, S>(self, constraints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut all = self.constraints;
        all.extend(constraints.into_iter().map(Into::into));
        Self::build(self.request, all)
    }

    fn build(request: Content, constraints: Vec<String>) -> Self {
        let content = if constraints.is_empty() {
            request.clone()
        } else {
            let mut list = String::from("\n\nHard constraints:");
            for c in &constraints {
                list.push_str("\n- ");
                list.push_str(c);
            }
            match &request {
                Content::Text(t) => Content::Text(format!("{t}{list}")),
                Content::Parts(parts) => {
                    let mut parts = parts.clone();
                    parts.push(keel_message::ContentPart::text(list));
                    Content::Parts(parts)
                }
            }
        };
        let mut message = Message::user(content).with_id(GOAL_ID);
        message
            .metadata
            .insert(GOAL_METADATA_KEY.to_owned(), serde_json::Value::Bool(true));
        GoalAnchor {
            request,
            constraints,
            message,
        }
    }

    /// The rendered text, as it appears in every prompt.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        self.message.text()
    }

    /// The constraints.
    pub fn constraints(&self) -> &[String] {
        &self.constraints
    }

    /// The goal message that heads every prompt (after the system prompt).
    pub fn message(&self) -> &Message {
        &self.message
    }
}

/// The rendered text, as [`GoalAnchor::text`] gives it.
///
/// ```
/// let goal = keel_compaction::GoalAnchor::new("Ship it.").with_constraints(["Tests pass."]);
/// assert_eq!(goal.to_string(), goal.text());
/// ```
impl std::fmt::Display for GoalAnchor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text())
    }
}

impl From<&str> for GoalAnchor {
    fn from(request: &str) -> Self {
        GoalAnchor::new(request)
    }
}

impl From<String> for GoalAnchor {
    fn from(request: String) -> Self {
        GoalAnchor::new(request)
    }
}
