use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use keel_message::{Message, Role, ToolSpec, openai};

use crate::{ChatModel, ChatOptions, ChatResponse, FinishReason, ModelError};

/// A model that answers with the assistant turns of a recorded trajectory, in order.
///
/// Give it a whole recorded history (system, user, assistant, tool messages); each call
/// returns the next assistant message. That replays an agent run without a model: the
/// tools can run for real (or be replayed too), and compaction sees the same shape of
/// history as in the recording.
///
/// In [strict](ReplayModel::strict) mode each call checks that the last message it was
/// given has the same role and text as the message that preceded the turn in the
/// recording, and fails with [`ModelError::ReplayDiverged`] otherwise.
///
/// ```
/// use keel_message::Message;
/// use keel_model::{ChatModel, ChatOptions, ModelError, ReplayModel};
///
/// let recording = br#"[
///   {"role": "user", "content": "Book a flight to Oslo"},
///   {"role": "assistant", "content": null, "tool_calls": [
///     {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"to\":\"OSL\"}"}}]},
///   {"role": "tool", "tool_call_id": "c1", "content": "SK123 at 09:10"},
///   {"role": "assistant", "content": "Booked SK123."}
/// ]"#;
/// let model = ReplayModel::from_openai_json(recording)?.strict(true);
/// let opts = ChatOptions::new();
/// futures::executor::block_on(async {
///     let first = model.chat(&[Message::user("Book a flight to Oslo")], &[], &opts).await?;
///     assert_eq!(first.message.tool_calls[0].name, "search");
///     let wrong = model.chat(&[Message::tool("c1", "no flights")], &[], &opts).await;
///     assert!(matches!(wrong, Err(ModelError::ReplayDiverged { turn: 1, .. })));
///     Ok::<_, ModelError>(())
/// })?;
/// # Ok::<(), ModelError>(())
/// ```
#[derive(Debug)]
pub struct ReplayModel {
    name: String,
    turns: Vec<(Option<Message>, Message)>,
    next: Mutex<usize>,
    strict: bool,
}

impl ReplayModel {
    /// A model replaying the assistant messages of `history`.
    pub fn new(history: Vec<Message>) -> Self {
        let mut turns = Vec::new();
        let mut previous: Option<Message> = None;
        for m in history {
            if m.role == Role::Assistant {
                turns.push((previous.take(), m.clone()));
            }
            previous = Some(m);
        }
        ReplayModel {
            name: "replay".to_owned(),
            turns,
            next: Mutex::new(0),
            strict: false,
        }
    }

    /// A model replaying an OpenAI-format message list (a JSON array).
    pub fn from_openai_json(bytes: &[u8]) -> Result<Self, ModelError> {
        Ok(Self::new(openai::from_json(bytes)?))
    }

    /// Sets the model name.
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Turns strict checking of the request against the recording on or off.
    #[must_use]
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// The number of assistant turns in the recording.
    pub fn len(&self) -> usize {
        self.turns.len()
    }

    /// True when the recording has no assistant turn.
    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// Turns not yet replayed.
    pub fn remaining(&self) -> usize {
        let next = *self.next.lock().unwrap_or_else(PoisonError::into_inner);
        self.turns.len().saturating_sub(next)
    }
}

#[async_trait]
impl ChatModel for ReplayModel {
    fn model_name(&self) -> &str {
        &self.name
    }

    async fn chat(
        &self,
        messages: &[Message],
        _tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let turn = *next;
        let (before, reply) = self
            .turns
            .get(turn)
            .ok_or(ModelError::Exhausted { served: turn })?;
        if self.strict
            && let Some(expected) = before
        {
            let last = messages.last();
            let same = last.is_some_and(|m| m.role == expected.role && m.text() == expected.text());
            if !same {
                return Err(ModelError::ReplayDiverged {
                    turn,
                    expected: expected.text().into_owned(),
                    found: last.map(|m| m.text().into_owned()).unwrap_or_default(),
                });
            }
        }
        *next += 1;
        let mut message = reply.clone();
        message.id = None;
        let finish = if message.tool_calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        };
        Ok(ChatResponse {
            message,
            usage: None,
            finish_reason: Some(finish),
            model: options.model.clone().unwrap_or_else(|| self.name.clone()),
            retries: 0,
        })
    }
}
