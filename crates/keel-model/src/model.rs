use std::sync::Arc;

use async_trait::async_trait;
use keel_message::{Message, ToolSpec};

use crate::{ChatEvent, ChatOptions, ChatResponse, ChatStream, ModelError, ToolCallDelta};

/// A chat model: messages, tool specs and options in; an assistant message (text and
/// tool calls) with the provider's usage out.
///
/// The trait is object safe, so a runtime holds `Arc<dyn ChatModel>` and does not care
/// whether it talks to Ollama, an OpenAI-compatible server, or a script. Implementors
/// write [`chat`](ChatModel::chat); [`chat_stream`](ChatModel::chat_stream) has a
/// default that answers with one text delta and the final response.
///
/// ```
/// use std::sync::Arc;
/// use keel_message::Message;
/// use keel_model::{ChatModel, ChatOptions, ScriptedModel};
///
/// let model: Arc<dyn ChatModel> = Arc::new(ScriptedModel::from_texts(["Paris."]));
/// let reply = futures::executor::block_on(model.chat(
///     &[Message::user("Capital of France?")],
///     &[],
///     &ChatOptions::new().temperature(0.0),
/// ))?;
/// assert_eq!(reply.text(), "Paris.");
/// # Ok::<(), keel_model::ModelError>(())
/// ```
///
/// Your own model (a client for another API, a test double) implements `chat` under
/// the re-exported [`async_trait`](crate::async_trait) attribute:
///
/// ```
/// use keel_message::{Message, ToolSpec};
/// use keel_model::{ChatModel, ChatOptions, ChatResponse, FinishReason, ModelError, Usage};
///
/// struct Echo;
///
/// #[keel_model::async_trait]
/// impl ChatModel for Echo {
///     fn model_name(&self) -> &str {
///         "echo"
///     }
///
///     async fn chat(
///         &self,
///         messages: &[Message],
///         _tools: &[ToolSpec],
///         _options: &ChatOptions,
///     ) -> Result<ChatResponse, ModelError> {
///         let last = messages.last().map(|m| m.text().into_owned()).unwrap_or_default();
///         Ok(ChatResponse::new(Message::assistant(last), "echo")
///             .with_usage(Usage::new(messages.len() as u64, 1))
///             .with_finish_reason(FinishReason::Stop))
///     }
/// }
///
/// let reply = futures::executor::block_on(Echo.chat(&[Message::user("hi")], &[], &ChatOptions::new()))?;
/// assert_eq!(reply.text(), "hi");
/// # Ok::<(), ModelError>(())
/// ```
#[async_trait]
pub trait ChatModel: Send + Sync {
    /// The name of the model this client calls by default (recorded on summaries and in
    /// traces).
    fn model_name(&self) -> &str;

    /// The context window, in tokens, this client runs the model with, when the
    /// client sets it (Ollama's `num_ctx`); `None` (the default) when it is the
    /// server's or the model's own. Callers that size prompts from a model profile
    /// (keel-agent, keel-summarize's `LlmSummarizer`) keep them within it.
    fn context_window(&self) -> Option<usize> {
        None
    }

    /// One complete reply.
    async fn chat(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatResponse, ModelError>;

    /// A streamed reply: text and tool-call deltas as they arrive, then
    /// [`ChatEvent::Done`] with the assembled message and usage.
    ///
    /// Errors before the reply starts (connection, status, context overflow) are
    /// returned here; errors after it started (a dropped connection) are the stream's
    /// last item.
    async fn chat_stream(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        options: &ChatOptions,
    ) -> Result<ChatStream, ModelError> {
        let response = self.chat(messages, tools, options).await?;
        Ok(Box::pin(futures::stream::iter(
            whole_reply_events(response).into_iter().map(Ok),
        )))
    }
}

/// The events of a reply delivered in one piece: its text, each tool call, then Done.
pub(crate) fn whole_reply_events(response: ChatResponse) -> Vec<ChatEvent> {
    let mut events = Vec::new();
    let text = response.text();
    if !text.is_empty() {
        events.push(ChatEvent::Text(text.into_owned()));
    }
    for (index, call) in response.message.tool_calls.iter().enumerate() {
        events.push(ChatEvent::ToolCall(ToolCallDelta {
            index,
            id: Some(call.id.clone()),
            name: Some(call.name.clone()),
            arguments: call.arguments.to_json_string(),
        }));
    }
    events.push(ChatEvent::Done(response));
    events
}

macro_rules! forward {
    ($($ptr:ty),*) => {$(
        #[async_trait]
        impl<T: ChatModel + ?Sized> ChatModel for $ptr {
            fn model_name(&self) -> &str {
                (**self).model_name()
            }
            fn context_window(&self) -> Option<usize> {
                (**self).context_window()
            }
            async fn chat(
                &self,
                messages: &[Message],
                tools: &[ToolSpec],
                options: &ChatOptions,
            ) -> Result<ChatResponse, ModelError> {
                (**self).chat(messages, tools, options).await
            }
            async fn chat_stream(
                &self,
                messages: &[Message],
                tools: &[ToolSpec],
                options: &ChatOptions,
            ) -> Result<ChatStream, ModelError> {
                (**self).chat_stream(messages, tools, options).await
            }
        }
    )*};
}

forward!(&T, Box<T>, Arc<T>);
