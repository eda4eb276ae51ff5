//! The arguments of a call: a JSON object with known keys and typed values.

use keel_message::ToolError;
use serde_json::{Map, Value};

use super::path::Relative;

/// The call's arguments as an object holding only `allowed` keys (`null` counts as
/// `{}`).
pub(super) fn object(arguments: Value, allowed: &[&str]) -> Result<Map<String, Value>, ToolError> {
    let map = match arguments {
        Value::Object(map) => map,
        Value::Null => Map::new(),
        _ => return Err(ToolError::bad_arguments("arguments must be a JSON object")),
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ToolError::bad_arguments(format!(
            "unknown argument `{unknown}` (the arguments are {})",
            allowed.join(", ")
        )));
    }
    Ok(map)
}

/// An optional string argument.
pub(super) fn string<'a>(
    args: &'a Map<String, Value>,
    name: &str,
) -> Result<Option<&'a str>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ToolError::bad_arguments(format!(
            "`{name}` must be a string"
        ))),
    }
}

/// A string argument that must be there.
pub(super) fn required_string<'a>(
    args: &'a Map<String, Value>,
    name: &str,
) -> Result<&'a str, ToolError> {
    string(args, name)?.ok_or_else(|| ToolError::bad_arguments(format!("`{name}` is required")))
}

/// An optional integer argument of at least `min`.
pub(super) fn integer(
    args: &Map<String, Value>,
    name: &str,
    min: u64,
) -> Result<Option<usize>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            _ => Err(ToolError::bad_arguments(format!(
                "`{name}` must be an integer of at least {min}, got {v}"
            ))),
        },
    }
}

/// An optional boolean argument.
pub(super) fn boolean(args: &Map<String, Value>, name: &str) -> Result<Option<bool>, ToolError> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ToolError::bad_arguments(format!(
            "`{name}` must be true or false, got {v}"
        ))),
    }
}

/// The `path` argument, checked as text; absent, `""` and `.` are the root.
pub(super) fn optional_path(args: &Map<String, Value>) -> Result<Relative, ToolError> {
    match string(args, "path")? {
        None => Ok(Relative::root()),
        Some(p) => Relative::parse(p).map_err(ToolError::bad_arguments),
    }
}

/// The `path` argument, required and naming something other than the root.
pub(super) fn file_path(args: &Map<String, Value>) -> Result<Relative, ToolError> {
    let p = required_string(args, "path")?;
    let rel = Relative::parse(p).map_err(ToolError::bad_arguments)?;
    if rel.is_root() {
        return Err(ToolError::bad_arguments(format!(
            "`path` must name a file, got `{p}` (the root directory)"
        )));
    }
    Ok(rel)
}
