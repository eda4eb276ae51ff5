use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use async_trait::async_trait;
use keel_message::{Message, ToolCall, ToolSpec};

use crate::model::whole_reply_events;
use crate::{ChatEvent, ChatModel, ChatOptions, ChatResponse, ChatStream, ModelError, Usage};

/// One scripted turn: a reply, or an error to fail the call with.
// Scripts are short lists built once; a boxed reply would only add indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Turn {
    /// Answer with this response.
    Reply(ChatResponse),
    /// Fail the call with this error.
    Fail(ModelError),
}

impl Turn {
    /// A reply with this text.
    pub fn text(text: impl Into<String>) -> Self {
        Turn::message(Message::assistant(text.into()))
    }

    /// A reply asking for tool calls (with optional text).
    pub fn tool_calls(text: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        Turn::message(Message::assistant(text.into()).with_tool_calls(calls))
    }

    /// A reply with this assistant message.
    pub fn message(message: Message) -> Self {
        Turn::Reply(ChatResponse::new(message, ""))
    }

    /// A failing call.
    pub fn fail(error: ModelError) -> Self {
        Turn::Fail(error)
    }

    /// Sets the usage the reply reports (replies report none unless given).
    #[must_use]
    pub fn with_usage(mut self, usage: Usage) -> Self {
        if let Turn::Reply(r) = &mut self {
            r.usage = Some(usage);
        }
        self
    }
}

impl From<&str> for Turn {
    fn from(text: &str) -> Self {
        Turn::text(text)
    }
}

impl From<String> for Turn {
    fn from(text: String) -> Self {
        Turn::text(text)
    }
}

/// A request a [`ScriptedModel`] received, kept for tests to inspect.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// The messages sent.
    pub messages: Vec<Message>,
    /// The tools offered.
    pub tools: Vec<ToolSpec>,
    /// The options given.
    pub options: ChatOptions,
}

/// A model that answers from a script of turns, in order, and records every request.
///
/// For tests, examples and demos: no network, fully deterministic. When the script
/// runs out, calls fail with [`ModelError::Exhausted`]. Streaming splits a reply's text
/// into word-sized deltas, so stream consumers see more than one piece.
///
/// ```
/// use keel_message::{Message, ToolCall};
/// use keel_model::{ChatModel, ChatOptions, ModelError, ScriptedModel, Turn, Usage};
/// use serde_json::json;
///
/// let model = ScriptedModel::new([
///     Turn::tool_calls("", vec![ToolCall::new("c1", "ls", json!({"path": "."}))]),
///     Turn::text("There are two files.").with_usage(Usage::new(50, 6)),
/// ]);
/// let history = [Message::user("What is in this folder?")];
/// let opts = ChatOptions::new();
/// futures::executor::block_on(async {
///     let first = model.chat(&history, &[], &opts).await?;
///     assert_eq!(first.message.tool_calls[0].name, "ls");
///     let second = model.chat(&history, &[], &opts).await?;
///     assert_eq!(second.usage, Some(Usage::new(50, 6)));
///     assert!(matches!(model.chat(&history, &[], &opts).await, Err(ModelError::Exhausted { served: 2 })));
///     Ok::<_, ModelError>(())
/// })?;
/// assert_eq!(model.requests().len(), 3);
/// # Ok::<(), ModelError>(())
/// ```
#[derive(Debug)]
pub struct ScriptedModel {
    name: String,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    turns: VecDeque<Turn>,
    served: usize,
    requests: Vec<RecordedRequest>,
}

impl ScriptedModel {
    /// A model named `scripted` that answers with `turns` in order.
    pub fn new(turns: impl IntoIterator<Item = Turn>) -> Self {
        ScriptedModel {
            name: "scripted".to_owned(),
            state: Mutex::new(State {
                turns: turns.into_iter().collect(),
                ..State::default()
            }),
        }
    }

    /// A model that answers with these texts in order.
    pub fn from_texts<S: Into<String>>(texts: impl IntoIterator<Item = S>) -> Self {
        Self::new(texts.into_iter().map(|t| Turn::text(t)))
    }

    /// Sets the model name (reported by [`ChatModel::model_name`] and on replies).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Appends a turn to the script.
    pub fn push(&self, turn: impl Into<Turn>) {
        self.lock().turns.push_back(turn.into());
    }

    /// Turns not yet served.
    pub fn remaining(&self) -> usize {
        self.lock().turns.len()
    }

    /// Every request received so far, in order (failed ones included).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().requests.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn next(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        let mut state = self.lock();
        state.requests.push(RecordedRequest {
            messages: messages.to_vec(),
            tools: tools.to_vec(),
            options: options.clone(),
        });
        let served = state.served;
        let turn = state
            .turns
            .pop_front()
            .ok_or(ModelError::Exhausted { served })?;
        state.served += 1;
        match turn {
            Turn::Reply(mut r) => {
                if r.model.is_empty() {
                    r.model = options.model.clone().unwrap_or_else(|| self.name.clone());
                }
                Ok(r)
            }
            Turn::Fail(e) => Err(e),
        }
    }
}

#[async_trait]
impl ChatModel for ScriptedModel {
    fn model_name(&self) -> &str {
        &self.name
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        self.next(messages, tools, options)
    }

    async fn chat_stream(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatStream, ModelError> {
        let response = self.next(messages, tools, options)?;
        let mut events: Vec<ChatEvent> = split_words(&response.text())
            .into_iter()
            .map(ChatEvent::Text)
            .collect();
        events.extend(
            whole_reply_events(response)
                .into_iter()
                .filter(|e| !matches!(e, ChatEvent::Text(_))),
        );
        Ok(Box::pin(futures::stream::iter(events.into_iter().map(Ok))))
    }
}

/// Splits text after each run of whitespace, so the pieces concatenate to the text.
fn split_words(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut in_space = false;
    for (i, c) in text.char_indices() {
        if c.is_whitespace() {
            in_space = true;
        } else if in_space {
            pieces.extend(text.get(start..i).map(str::to_owned));
            start = i;
            in_space = false;
        }
    }
    pieces.extend(
        text.get(start..)
            .filter(|rest| !rest.is_empty())
            .map(str::to_owned),
    );
    pieces
}

#[cfg(test)]
mod tests {
    use super::split_words;

    #[test]
    fn words_concatenate_back() {
        let text = "  two  words\nand more ";
        let pieces = split_words(text);
        assert_eq!(pieces, ["  ", "two  ", "words\n", "and ", "more "]);
        assert_eq!(pieces.concat(), text);
        assert!(split_words("").is_empty());
    }
}
