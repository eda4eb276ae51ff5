//! A model whose every reply is computed by a function of the prompt.

use async_trait::async_trait;
use keel_message::{Message, ToolSpec};

use crate::{ChatModel, ChatOptions, ChatResponse, ModelError};

type Policy =
    dyn Fn(&[Message], &[ToolSpec]) -> Result<ChatResponse, ModelError> + Send + Sync + 'static;

/// A model that answers with a function of what it is sent: a deterministic policy
/// that reads its prompt, for tests, demos and benchmarks that must react to what the
/// context actually holds (a [`ScriptedModel`](crate::ScriptedModel) only replays).
/// It keeps nothing between calls, so a run of any length uses constant memory.
///
/// ```
/// use keel_message::Message;
/// use keel_model::{ChatModel, ChatOptions, ChatResponse, PolicyModel};
///
/// // Answers with the number of messages it was sent.
/// let model = PolicyModel::new("counter", |messages, _tools| {
///     Ok(ChatResponse::new(Message::assistant(messages.len().to_string()), "counter"))
/// });
/// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
/// let reply = model.chat(&[Message::user("a"), Message::user("b")], &[], &ChatOptions::new()).await?;
/// assert_eq!(reply.text(), "2");
/// # Ok::<(), keel_model::ModelError>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PolicyModel {
    name: String,
    policy: Box<Policy>,
}

impl std::fmt::Debug for PolicyModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyModel")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl PolicyModel {
    /// A model named `name` answering with `policy(messages, tools)`.
    pub fn new(
        name: impl Into<String>,
        policy: impl Fn(&[Message], &[ToolSpec]) -> Result<ChatResponse, ModelError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        PolicyModel {
            name: name.into(),
            policy: Box::new(policy),
        }
    }
}

#[async_trait]
impl ChatModel for PolicyModel {
    fn model_name(&self) -> &str {
        &self.name
    }

    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        _options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError> {
        (self.policy)(messages, tools)
    }
}
