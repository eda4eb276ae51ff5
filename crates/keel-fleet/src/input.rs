//! What a queued run brings to its thread, in a form that survives the database.

use keel_agent::AgentInput;
use keel_message::Message;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The version of the stored input format. A worker refuses (and fails the run with
/// the reason) an input written in a format it does not know.
pub const INPUT_FORMAT: u32 = 1;

/// What a run adds to its thread: the serializable form of
/// [`AgentInput`](keel_agent::AgentInput) — a goal and system prompt for a new
/// thread, messages to append (a user's follow-up), or the answer to a pending
/// interrupt.
///
/// An empty input continues the thread from its last checkpoint (after a crash, or
/// a step ceiling raised).
///
/// ```
/// use keel_fleet::RunInput;
/// use keel_message::Message;
///
/// let first = RunInput::new().goal("Count the lines of every file under src/.");
/// let follow_up = RunInput::new().message(Message::user("Now only the .rs files."));
/// assert_eq!(first.get_goal(), Some("Count the lines of every file under src/."));
/// assert_eq!(follow_up.get_messages().len(), 1);
/// assert!(RunInput::new().is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RunInput {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    goal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resume: Option<Value>,
}

impl RunInput {
    /// Nothing new: start the thread with the agent's goal, or continue it.
    pub fn new() -> Self {
        Self::default()
    }

    /// The goal of a new thread (a thread's goal is written once).
    #[must_use]
    pub fn goal(mut self, goal: impl Into<String>) -> Self {
        self.goal = Some(goal.into());
        self
    }

    /// The system prompt of a new thread (overrides the agent's).
    #[must_use]
    pub fn system(mut self, system: impl Into<String>) -> Self {
        self.system = Some(system.into());
        self
    }

    /// A message to append before the model is called.
    #[must_use]
    pub fn message(mut self, message: Message) -> Self {
        self.messages.push(message);
        self
    }

    /// The answer to a pending interrupt (tool approval).
    #[must_use]
    pub fn resume(mut self, answer: impl Into<Value>) -> Self {
        self.resume = Some(answer.into());
        self
    }

    /// The goal, if any.
    pub fn get_goal(&self) -> Option<&str> {
        self.goal.as_deref()
    }

    /// The system prompt, if any.
    pub fn get_system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// The messages to append.
    pub fn get_messages(&self) -> &[Message] {
        &self.messages
    }

    /// The answer to a pending interrupt, if any.
    pub fn get_resume(&self) -> Option<&Value> {
        self.resume.as_ref()
    }

    /// Whether the input brings nothing (the run continues its thread).
    pub fn is_empty(&self) -> bool {
        self.goal.is_none()
            && self.system.is_none()
            && self.messages.is_empty()
            && self.resume.is_none()
    }

    /// The agent's input.
    pub fn into_agent_input(self) -> AgentInput {
        let mut input = AgentInput::new();
        if let Some(goal) = self.goal {
            input = input.goal(goal);
        }
        if let Some(system) = self.system {
            input = input.system(system);
        }
        for m in self.messages {
            input = input.message(m);
        }
        if let Some(answer) = self.resume {
            input = input.resume(answer);
        }
        input
    }

    /// Gives every message without an id a stable one (`<run>-m<i>`), so a worker that
    /// takes a run over can tell whether its messages already reached the thread.
    pub(crate) fn with_ids(mut self, run: &str) -> Self {
        for (i, m) in self.messages.iter_mut().enumerate() {
            if m.id.is_none() {
                m.id = Some(format!("{run}-m{i}"));
            }
        }
        self
    }

    /// The stored form: `{"v": 1, "input": {...}}`.
    pub(crate) fn encode(&self) -> Result<Value, serde_json::Error> {
        Ok(serde_json::json!({ "v": INPUT_FORMAT, "input": serde_json::to_value(self)? }))
    }

    /// Reads the stored form; the error says why it cannot be used.
    pub(crate) fn decode(stored: &Value) -> Result<Self, String> {
        let Some(object) = stored.as_object() else {
            return Err(format!(
                "the stored input is not a JSON object but {}",
                kind(stored)
            ));
        };
        match object.get("v").and_then(Value::as_u64) {
            Some(v) if v == u64::from(INPUT_FORMAT) => {}
            Some(v) => {
                return Err(format!(
                    "the stored input is in format {v}; this worker reads format {INPUT_FORMAT}"
                ));
            }
            None => return Err("the stored input has no format version `v`".to_owned()),
        }
        let input = object
            .get("input")
            .ok_or_else(|| "the stored input has no `input` field".to_owned())?;
        serde_json::from_value(input.clone())
            .map_err(|e| format!("the stored input does not decode: {e}"))
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_round_trip_and_bad_ones_say_why() {
        let input = RunInput::new()
            .goal("g")
            .system("s")
            .message(Message::user("hi"))
            .resume(json!({"c1": true}))
            .with_ids("r1");
        assert_eq!(input.get_messages()[0].id.as_deref(), Some("r1-m0"));
        let stored = input.encode().unwrap();
        assert_eq!(RunInput::decode(&stored).unwrap(), input);

        for (bad, says) in [
            (json!("text"), "not a JSON object but a string"),
            (json!({"input": {}}), "no format version"),
            (json!({"v": 7, "input": {}}), "format 7"),
            (json!({"v": 1}), "no `input`"),
            (json!({"v": 1, "input": {"goal": 3}}), "does not decode"),
            (
                json!({"v": 1, "input": {"rollback": true}}),
                "unknown field",
            ),
        ] {
            let err = RunInput::decode(&bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
