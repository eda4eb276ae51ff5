use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Content, Metadata, ToolCall};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions from the application (OpenAI `system`/`developer`, LangChain `system`).
    System,
    /// The human or calling program (LangChain `human`).
    User,
    /// The model (LangChain `ai`).
    Assistant,
    /// The result of a tool call, linked by `tool_call_id`.
    Tool,
}

impl Role {
    /// The lowercase name used by keel's own format and by OpenAI.
    ///
    /// ```
    /// assert_eq!(keel_message::Role::Assistant.as_str(), "assistant");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error of parsing an unknown role name; it carries the name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected system, user, assistant or tool)")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    /// Parses keel/OpenAI role names.
    ///
    /// ```
    /// use keel_message::Role;
    /// assert_eq!("tool".parse::<Role>(), Ok(Role::Tool));
    /// assert!("robot".parse::<Role>().unwrap_err().to_string().contains("robot"));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            "tool" => Ok(Role::Tool),
            other => Err(UnknownRole(other.to_owned())),
        }
    }
}

/// One entry of an agent's history.
///
/// `id` is optional on construction; the `AddMessages` reducer assigns one to every
/// message it stores, and everything downstream (archive, token memo, compaction)
/// refers to messages by it.
///
/// keel's own serialized form is plain serde and loses nothing:
///
/// ```
/// use keel_message::Message;
///
/// let m = Message::user("hello").with_id("m1").with_metadata("source", "cli".into());
/// let json = serde_json::to_string(&m)?;
/// assert_eq!(json, r#"{"id":"m1","role":"user","content":"hello","metadata":{"source":"cli"}}"#);
/// assert_eq!(serde_json::from_str::<Message>(&json)?, m);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Message {
    /// Stable identifier, unique within a thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Who wrote it.
    pub role: Role,
    /// Text or multi-part content.
    #[serde(default)]
    pub content: Content,
    /// Tool calls requested by an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For [`Role::Tool`]: the id of the call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional author or tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Free metadata. Importers keep fields keel does not model here (under the keys
    /// `"openai"` and `"langchain"`), so exporting to the same format restores them.
    #[serde(default, skip_serializing_if = "Metadata::is_empty")]
    pub metadata: Metadata,
}

impl Message {
    /// A message with the given role and text, and nothing else.
    pub fn new(role: Role, content: impl Into<Content>) -> Self {
        Message {
            id: None,
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            metadata: Metadata::new(),
        }
    }

    /// A system message.
    pub fn system(content: impl Into<Content>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<Content>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message (add tool calls with [`Message::with_tool_calls`]).
    pub fn assistant(content: impl Into<Content>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// A tool result answering the call `tool_call_id`.
    ///
    /// ```
    /// let m = keel_message::Message::tool("call_7", "exit status 0");
    /// assert_eq!(m.tool_call_id.as_deref(), Some("call_7"));
    /// ```
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<Content>) -> Self {
        let mut m = Self::new(Role::Tool, content);
        m.tool_call_id = Some(tool_call_id.into());
        m
    }

    /// Sets the id.
    #[must_use]
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the name.
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets the tool calls.
    #[must_use]
    pub fn with_tool_calls(mut self, calls: Vec<ToolCall>) -> Self {
        self.tool_calls = calls;
        self
    }

    /// Adds one metadata entry.
    #[must_use]
    pub fn with_metadata(mut self, key: impl Into<String>, value: serde_json::Value) -> Self {
        self.metadata.insert(key.into(), value);
        self
    }

    /// The text of the message: the string content, or its text parts joined.
    ///
    /// ```
    /// assert_eq!(keel_message::Message::user("hi").text(), "hi");
    /// ```
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        self.content.text()
    }

    /// True if any tool call's arguments were not valid JSON when imported.
    pub fn has_invalid_tool_arguments(&self) -> bool {
        self.tool_calls.iter().any(|c| !c.arguments.is_valid())
    }
}

/// For each message, the index of the message holding the tool call it answers: a
/// tool result answers the latest earlier call with its `tool_call_id`. `None` for a
/// message that is not a tool result, and for a result no earlier call matches.
///
/// Pairing by position rather than by id alone keeps the turns of an id that comes
/// back apart: some servers number the tool calls of each reply, so `call_0` is the id
/// of a call in every turn.
///
/// ```
/// use keel_message::{Message, ToolCall, answered_calls};
/// use serde_json::json;
///
/// let call = || Message::assistant("").with_tool_calls(vec![ToolCall::new("call_0", "ls", json!({}))]);
/// let history = vec![
///     Message::user("go"),
///     call(),
///     Message::tool("call_0", "a.txt"),
///     call(),
///     Message::tool("call_0", "b.txt"),
///     Message::tool("call_9", "an answer to no call"),
/// ];
/// assert_eq!(answered_calls(&history), [None, None, Some(1), None, Some(3), None]);
/// ```
pub fn answered_calls(messages: &[Message]) -> Vec<Option<usize>> {
    let mut latest: std::collections::HashMap<&str, usize> = Default::default();
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let answers = match (m.role, m.tool_call_id.as_deref()) {
                (Role::Tool, Some(id)) => latest.get(id).copied(),
                _ => None,
            };
            for call in &m.tool_calls {
                latest.insert(call.id.as_str(), i);
            }
            answers
        })
        .collect()
}

/// For each message, the tool call it answers (see [`answered_calls`]): `None` for a
/// message that is not a tool result, and for a result no earlier call matches.
pub fn answered_tool_calls(messages: &[Message]) -> Vec<Option<&ToolCall>> {
    answered_calls(messages)
        .into_iter()
        .zip(messages)
        .map(|(call, m)| {
            let id = m.tool_call_id.as_deref()?;
            messages[call?].tool_calls.iter().find(|c| c.id == id)
        })
        .collect()
}
