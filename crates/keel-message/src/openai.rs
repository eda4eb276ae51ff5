//! OpenAI chat-completions messages: import and export.
//!
//! The wire shape is `{"role", "content", "name", "tool_calls", "tool_call_id"}`, with
//! each tool call `{"id", "type": "function", "function": {"name", "arguments"}}` and
//! `arguments` a JSON *string*.
//!
//! * `developer` imports as [`Role::System`] and exports as `developer` again.
//! * The legacy function-calling shape (before `tool_calls`) imports too: an
//!   assistant's `function_call` becomes one tool call and a `function` message its
//!   tool result. That shape has no call ids, so keel makes them: read as a list, the
//!   nth message's call gets `function-call-<n>` and each `function` result the id of
//!   the latest call of its name before it; read alone, a call and a result are
//!   paired by name (`function-call-<name>`). Such messages export in the current
//!   shape.
//! * Fields keel does not model (`refusal`, `audio`, SWE-agent's `thought`, ...) are
//!   kept in `metadata["openai"]` and written back on export.
//! * Arguments that are not valid JSON are kept verbatim ([`ToolArguments::Invalid`])
//!   and exported unchanged. Valid arguments are exported as they were received, byte
//!   for byte (spacing and key order kept); arguments built from a JSON value are
//!   written compactly.
//! * An assistant message with tool calls and empty text exports `"content": null`.
//! * Message ids and keel metadata have no place in this format and are not exported.
//!
//! ```
//! use keel_message::{openai, ToolArguments};
//!
//! let wire = br#"[{"role":"assistant","content":null,"tool_calls":[
//!     {"id":"c1","type":"function","function":{"name":"sh","arguments":"{not json"}}]}]"#;
//! let msgs = openai::from_json(wire)?;
//! assert_eq!(msgs[0].tool_calls[0].arguments, ToolArguments::Invalid("{not json".into()));
//! assert!(msgs[0].has_invalid_tool_arguments());
//! # Ok::<(), keel_message::FormatError>(())
//! ```

use serde_json::{Map, Value, json};

use crate::error::{each, parse_json};
use crate::value::{Obj, metadata_with_extras, restore_extras};
use crate::{Content, FormatError, Message, Problem, Role, ToolArguments, ToolCall, ToolSpec};

const EXTRAS: &str = "openai";
const KNOWN: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "function_call",
];
/// The prefix of the call ids keel makes for the legacy `function_call` shape.
const LEGACY_ID: &str = "function-call-";

/// Reads a JSON array of OpenAI messages from bytes.
pub fn from_json(bytes: &[u8]) -> Result<Vec<Message>, FormatError> {
    from_values_value(&parse_json(bytes)?)
}

/// Reads a slice of OpenAI message values.
pub fn from_values(values: &[Value]) -> Result<Vec<Message>, FormatError> {
    let mut messages = values
        .iter()
        .enumerate()
        .map(|(i, v)| from_value(v).map_err(|e| e.at_index(i)))
        .collect::<Result<Vec<_>, _>>()?;
    number_legacy_calls(values, &mut messages);
    Ok(messages)
}

fn from_values_value(v: &Value) -> Result<Vec<Message>, FormatError> {
    let mut messages = each(v, "openai", from_value)?;
    if let Some(values) = v.as_array() {
        number_legacy_calls(values, &mut messages);
    }
    Ok(messages)
}

/// Reads one OpenAI message.
pub fn from_value(v: &Value) -> Result<Message, FormatError> {
    let obj = Obj::root(v)?;
    let role_name = obj.str("role")?;
    let (role, keep_role) = match role_name {
        "system" => (Role::System, false),
        "developer" => (Role::System, true),
        "user" => (Role::User, false),
        "assistant" => (Role::Assistant, false),
        "tool" | "function" => (Role::Tool, false),
        other => return Err(obj.error("role", Problem::UnknownRole(other.to_owned()))),
    };
    let mut tool_calls = obj
        .objects("tool_calls")?
        .iter()
        .map(tool_call_from)
        .collect::<Result<Vec<_>, _>>()?;
    // The legacy `function_call`, when it is the reply's only call. A server that sends
    // it beside `tool_calls` (llama-cpp-python's function-calling formats do) repeats
    // one of them in the old shape: it is not run a second time, and, as every legacy
    // field, it exports in the current shape (as the `tool_calls`).
    let legacy = match obj.opt_object("function_call")? {
        Some(_) if repeated_legacy_call(v) => None,
        legacy => legacy,
    };
    if let Some(call) = legacy {
        let name = call.str("name")?;
        tool_calls.push(ToolCall {
            id: format!("{LEGACY_ID}{name}"),
            name: name.to_owned(),
            arguments: arguments_of(&call),
        });
    }
    let mut tool_call_id = obj.opt_str("tool_call_id")?.map(str::to_owned);
    if role_name == "function" && tool_call_id.is_none() {
        tool_call_id = Some(format!("{LEGACY_ID}{}", obj.str("name")?));
    }
    if role == Role::Tool && tool_call_id.is_none() {
        return Err(obj.error("tool_call_id", Problem::Missing));
    }
    let mut extras = obj.extras(KNOWN);
    if keep_role {
        extras.insert("role".into(), Value::String(role_name.to_owned()));
    }
    Ok(Message {
        id: None,
        role,
        content: obj.content("content")?,
        tool_calls,
        tool_call_id,
        name: obj.opt_str("name")?.map(str::to_owned),
        metadata: metadata_with_extras(EXTRAS, extras),
    })
}

fn tool_call_from(call: &Obj<'_>) -> Result<ToolCall, FormatError> {
    if let Some(kind) = call.opt_str("type")?
        && kind != "function"
    {
        return Err(call.error("type", Problem::UnknownType(kind.to_owned())));
    }
    let function = call.object("function")?;
    Ok(ToolCall {
        id: call.str("id")?.to_owned(),
        name: function.str("name")?.to_owned(),
        arguments: arguments_of(&function),
    })
}

/// The `arguments` of a `function` object (a tool call's, or a legacy `function_call`).
fn arguments_of(function: &Obj<'_>) -> ToolArguments {
    match function.get("arguments") {
        None => ToolArguments::Json(Value::Object(Map::new())),
        Some(Value::String(raw)) => ToolArguments::parse(raw.clone()),
        // Some servers (Ollama's OpenAI shim among them) send an object.
        Some(v) => ToolArguments::Json(v.clone()),
    }
}

/// Whether the message `v` has a legacy `function_call` beside a non-empty
/// `tool_calls`: the calls are the `tool_calls` alone.
fn repeated_legacy_call(v: &Value) -> bool {
    v.get("function_call").is_some()
        && v.get("tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|calls| !calls.is_empty())
}

/// Gives the legacy calls read from `values` ids unique in the list: the nth
/// message's call `function-call-<n>`, and each `function` result without an id the id
/// of the latest call of its name before it.
fn number_legacy_calls(values: &[Value], messages: &mut [Message]) {
    let mut latest: std::collections::HashMap<String, String> = Default::default();
    for (i, (v, m)) in values.iter().zip(messages.iter_mut()).enumerate() {
        if v.get("function_call").is_some_and(Value::is_object)
            && !repeated_legacy_call(v)
            && let Some(call) = m.tool_calls.last_mut()
        {
            call.id = format!("{LEGACY_ID}{i}");
            latest.insert(call.name.clone(), call.id.clone());
        } else if v.get("role").and_then(Value::as_str) == Some("function")
            && v.get("tool_call_id").is_none()
            && let Some(id) = m.name.as_ref().and_then(|name| latest.get(name))
        {
            m.tool_call_id = Some(id.clone());
        }
    }
}

/// Writes messages as OpenAI message values.
pub fn to_values(messages: &[Message]) -> Vec<Value> {
    messages.iter().map(to_value).collect()
}

/// Writes messages as a JSON array string.
pub fn to_json(messages: &[Message]) -> String {
    Value::Array(to_values(messages)).to_string()
}

/// Writes one message as an OpenAI message value.
pub fn to_value(m: &Message) -> Value {
    let mut out = Map::new();
    out.insert("role".into(), Value::String(m.role.as_str().to_owned()));
    // Empty parts (`[]`) stay a list: only empty text reads back from `null`.
    let empty_text = matches!(&m.content, Content::Text(text) if text.is_empty());
    let content = if empty_text && !m.tool_calls.is_empty() {
        Value::Null
    } else {
        m.content.to_value()
    };
    out.insert("content".into(), content);
    if let Some(name) = &m.name {
        out.insert("name".into(), Value::String(name.clone()));
    }
    if !m.tool_calls.is_empty() {
        let calls = m
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_json_string()},
                })
            })
            .collect();
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    restore_extras(EXTRAS, &m.metadata, &mut out);
    Value::Object(out)
}

/// A tool spec in OpenAI's `tools` shape: `{"type": "function", "function": {...}}`.
pub fn tool_to_value(spec: &ToolSpec) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters,
        },
    })
}

/// Reads a tool spec from OpenAI's `tools` shape (or a bare `function` object).
///
/// ```
/// use keel_message::openai;
/// let v = serde_json::json!({"type":"function","function":{"name":"ls","parameters":{"type":"object"}}});
/// assert_eq!(openai::tool_from_value(&v)?.name, "ls");
/// # Ok::<(), keel_message::FormatError>(())
/// ```
pub fn tool_from_value(v: &Value) -> Result<ToolSpec, FormatError> {
    let obj = Obj::root(v)?;
    let function = match obj.opt_object("function")? {
        Some(f) => f,
        None => obj,
    };
    Ok(ToolSpec {
        name: function.str("name")?.to_owned(),
        description: function.opt_str("description")?.unwrap_or("").to_owned(),
        parameters: function
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
    })
}
