//! LangChain message dicts: import and export.
//!
//! Import accepts both shapes LangChain produces: the flat `model_dump()` dict
//! (`{"type": "human", "content": ..., "id": ...}`) and `messages_to_dict`'s wrapper
//! (`{"type": "human", "data": {...}}`). Export writes the flat shape, which
//! `langchain_core.messages.convert_to_messages` accepts.
//!
//! | LangChain `type` | keel [`Role`] |
//! |---|---|
//! | `system` | `System` |
//! | `human` | `User` |
//! | `ai` | `Assistant` |
//! | `tool` | `Tool` |
//!
//! * `tool_calls` carry `args` as JSON objects; `invalid_tool_calls` (whose `args` is a
//!   string that failed to parse) become [`ToolArguments::Invalid`] and are exported
//!   back to `invalid_tool_calls`. AI messages always export both lists; another
//!   message exports them when it has calls.
//! * Fields keel does not model (`additional_kwargs`, `response_metadata`,
//!   `usage_metadata`, `artifact`, `status`, ...) are kept in `metadata["langchain"]`
//!   and written back on export.
//!
//! ```
//! use keel_message::{langchain, Role};
//! use serde_json::json;
//!
//! let dicts = json!([
//!     {"type": "human", "content": "list files", "id": "1"},
//!     {"type": "ai", "content": "", "id": "2",
//!      "tool_calls": [{"name": "ls", "args": {"path": "."}, "id": "c1", "type": "tool_call"}]},
//!     {"type": "tool", "content": "a.txt", "tool_call_id": "c1", "id": "3"},
//! ]);
//! let msgs = langchain::from_values(dicts.as_array().unwrap())?;
//! assert_eq!(msgs[1].role, Role::Assistant);
//! assert_eq!(msgs[1].tool_calls[0].arguments.as_json(), Some(&json!({"path": "."})));
//! assert_eq!(langchain::from_values(&langchain::to_values(&msgs))?, msgs);
//! # Ok::<(), keel_message::FormatError>(())
//! ```

use serde_json::{Map, Value, json};

use crate::error::{each, parse_json};
use crate::value::{Obj, metadata_with_extras, restore_extras};
use crate::{FormatError, Message, Problem, Role, ToolArguments, ToolCall};

const EXTRAS: &str = "langchain";
const KNOWN: &[&str] = &[
    "type",
    "content",
    "id",
    "name",
    "tool_calls",
    "invalid_tool_calls",
    "tool_call_id",
];

/// Reads a JSON array of LangChain message dicts from bytes.
pub fn from_json(bytes: &[u8]) -> Result<Vec<Message>, FormatError> {
    each(&parse_json(bytes)?, "langchain", from_value)
}

/// Reads a slice of LangChain message dicts.
pub fn from_values(values: &[Value]) -> Result<Vec<Message>, FormatError> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| from_value(v).map_err(|e| e.at_index(i)))
        .collect()
}

/// The keel role for a LangChain message `type`, if it is one keel knows.
pub fn role_for_type(kind: &str) -> Option<Role> {
    match kind {
        "system" => Some(Role::System),
        "human" => Some(Role::User),
        "ai" => Some(Role::Assistant),
        "tool" => Some(Role::Tool),
        _ => None,
    }
}

/// The LangChain message `type` for a keel role.
pub fn type_for_role(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::User => "human",
        Role::Assistant => "ai",
        Role::Tool => "tool",
    }
}

/// Reads one LangChain message dict (flat or `{"type", "data"}`).
pub fn from_value(v: &Value) -> Result<Message, FormatError> {
    let outer = Obj::root(v)?;
    let kind = outer.str("type")?;
    let obj = match (outer.get("content"), outer.opt_object("data")?) {
        (None, Some(data)) => data,
        _ => outer,
    };
    let role = role_for_type(kind)
        .ok_or_else(|| obj.error("type", Problem::UnknownType(kind.to_owned())))?;

    let mut tool_calls = Vec::new();
    for call in obj.objects("tool_calls")? {
        let arguments = match call.map.get("args") {
            None => ToolArguments::Json(Value::Object(Map::new())),
            Some(v) => ToolArguments::Json(v.clone()),
        };
        tool_calls.push(ToolCall {
            id: call.opt_str("id")?.unwrap_or_default().to_owned(),
            name: call.str("name")?.to_owned(),
            arguments,
        });
    }
    for call in obj.objects("invalid_tool_calls")? {
        tool_calls.push(ToolCall {
            id: call.opt_str("id")?.unwrap_or_default().to_owned(),
            name: call.opt_str("name")?.unwrap_or_default().to_owned(),
            arguments: ToolArguments::Invalid(call.opt_str("args")?.unwrap_or_default().to_owned()),
        });
    }

    let tool_call_id = obj.opt_str("tool_call_id")?.map(str::to_owned);
    if role == Role::Tool && tool_call_id.is_none() {
        return Err(obj.error("tool_call_id", Problem::Missing));
    }
    let mut extras = obj.extras(KNOWN);
    extras.retain(|k, v| !is_default_extra(k, v));
    Ok(Message {
        id: obj.opt_str("id")?.map(str::to_owned),
        role,
        content: obj.content("content")?,
        tool_calls,
        tool_call_id,
        name: obj.opt_str("name")?.map(str::to_owned),
        metadata: metadata_with_extras(EXTRAS, extras),
    })
}

/// Extras whose value is what export writes anyway: not worth keeping.
fn is_default_extra(key: &str, v: &Value) -> bool {
    match key {
        "additional_kwargs" | "response_metadata" => v.as_object().is_some_and(Map::is_empty),
        _ => v.is_null(),
    }
}

/// Writes messages as flat LangChain dicts.
pub fn to_values(messages: &[Message]) -> Vec<Value> {
    messages.iter().map(to_value).collect()
}

/// Writes one message as a flat LangChain dict.
pub fn to_value(m: &Message) -> Value {
    let mut out = Map::new();
    out.insert("content".into(), m.content.to_value());
    out.insert("additional_kwargs".into(), json!({}));
    out.insert("response_metadata".into(), json!({}));
    out.insert("type".into(), Value::String(type_for_role(m.role).into()));
    out.insert("name".into(), opt(&m.name));
    out.insert("id".into(), opt(&m.id));
    // Only AI messages have the fields in LangChain, but a call on another message
    // (imported from one that carried it) is written too, so it is not lost.
    if m.role == Role::Assistant || !m.tool_calls.is_empty() {
        let (mut valid, mut invalid) = (Vec::new(), Vec::new());
        for c in &m.tool_calls {
            let id = if c.id.is_empty() {
                Value::Null
            } else {
                Value::String(c.id.clone())
            };
            match &c.arguments {
                ToolArguments::Json(args) | ToolArguments::JsonText { value: args, .. } => {
                    valid.push(json!({
                        "name": c.name, "args": args, "id": id, "type": "tool_call",
                    }));
                }
                ToolArguments::Invalid(raw) => invalid.push(json!({
                    "name": c.name, "args": raw, "id": id, "error": null,
                    "type": "invalid_tool_call",
                })),
            }
        }
        out.insert("tool_calls".into(), Value::Array(valid));
        out.insert("invalid_tool_calls".into(), Value::Array(invalid));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    restore_extras(EXTRAS, &m.metadata, &mut out);
    Value::Object(out)
}

fn opt(s: &Option<String>) -> Value {
    s.as_ref().map_or(Value::Null, |s| Value::String(s.clone()))
}
