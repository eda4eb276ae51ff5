use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// A tool call requested by an assistant message.
///
/// keel's own format writes valid arguments as a JSON value under `arguments`, and
/// arguments that were not JSON verbatim under `invalid_arguments`:
///
/// ```
/// use keel_message::{ToolArguments, ToolCall};
/// use serde_json::json;
///
/// let ok = ToolCall::new("c1", "ls", json!({"path": "."}));
/// assert_eq!(serde_json::to_value(&ok)?, json!({"id": "c1", "name": "ls", "arguments": {"path": "."}}));
///
/// let broken = ToolCall::from_raw_arguments("c2", "ls", "{path: .");
/// assert_eq!(broken.arguments, ToolArguments::Invalid("{path: .".into()));
/// assert_eq!(serde_json::to_value(&broken)?["invalid_arguments"], "{path: .");
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ToolCall {
    /// Provider-assigned id; tool results answer it with `tool_call_id`.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments.
    pub arguments: ToolArguments,
}

impl ToolCall {
    /// A call with JSON arguments.
    pub fn new(id: impl Into<String>, name: impl Into<String>, arguments: Value) -> Self {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: ToolArguments::Json(arguments),
        }
    }

    /// A call whose arguments arrived as a string (OpenAI's wire form): parsed when it is
    /// JSON, kept verbatim and flagged as [`ToolArguments::Invalid`] when it is not.
    pub fn from_raw_arguments(
        id: impl Into<String>,
        name: impl Into<String>,
        raw: impl Into<String>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: ToolArguments::parse(raw.into()),
        }
    }
}

/// Tool-call arguments: a JSON value, or the raw text when it was not valid JSON.
///
/// Arguments that arrive as text (OpenAI's wire form) keep that text, so exporting them
/// again is byte-identical: `{"a": 1}` does not become `{"a":1}`, and prompts rebuilt
/// from imported history count the same tokens.
///
/// Equality compares the arguments, not their formatting: `Json(v)` equals
/// `JsonText { value: v, .. }` whatever the text.
#[derive(Debug, Clone)]
pub enum ToolArguments {
    /// Parsed arguments (usually an object), built in code or imported as JSON.
    Json(Value),
    /// Valid JSON that arrived as text: the parsed value and the text, verbatim.
    JsonText {
        /// The parsed value.
        value: Value,
        /// The exact text it was parsed from.
        raw: String,
    },
    /// Arguments that failed to parse as JSON, verbatim. Never dropped.
    Invalid(String),
}

impl PartialEq for ToolArguments {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ToolArguments::Invalid(a), ToolArguments::Invalid(b)) => a == b,
            (a, b) => a.as_json().is_some() && a.as_json() == b.as_json(),
        }
    }
}

impl ToolArguments {
    /// Parses a JSON string; keeps it as `Invalid` if it is not JSON.
    ///
    /// ```
    /// use keel_message::ToolArguments;
    /// assert!(ToolArguments::parse(r#"{"a":1}"#.into()).is_valid());
    /// assert!(!ToolArguments::parse("{a:1".into()).is_valid());
    /// ```
    pub fn parse(raw: String) -> Self {
        match serde_json::from_str(&raw) {
            Ok(value) => ToolArguments::JsonText { value, raw },
            Err(_) => ToolArguments::Invalid(raw),
        }
    }

    /// False for arguments that were not valid JSON.
    pub fn is_valid(&self) -> bool {
        !matches!(self, ToolArguments::Invalid(_))
    }

    /// The parsed value, if valid.
    pub fn as_json(&self) -> Option<&Value> {
        match self {
            ToolArguments::Json(v) | ToolArguments::JsonText { value: v, .. } => Some(v),
            ToolArguments::Invalid(_) => None,
        }
    }

    /// The arguments as a JSON string: the original text when there is one (valid or
    /// not), compact JSON otherwise.
    ///
    /// ```
    /// use keel_message::ToolArguments;
    /// let spaced = ToolArguments::parse(r#"{"a": 1}"#.into());
    /// assert_eq!(spaced.to_json_string(), r#"{"a": 1}"#);
    /// assert_eq!(ToolArguments::Json(serde_json::json!({"a": 1})).to_json_string(), r#"{"a":1}"#);
    /// ```
    pub fn to_json_string(&self) -> String {
        match self {
            ToolArguments::Json(v) => v.to_string(),
            ToolArguments::JsonText { raw, .. } | ToolArguments::Invalid(raw) => raw.clone(),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct ToolCallRepr {
    id: String,
    name: String,
    // `null` arguments are `Some(Value::Null)`, not absent.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    arguments: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    raw_arguments: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    invalid_arguments: Option<String>,
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (arguments, raw_arguments, invalid_arguments) = match &self.arguments {
            ToolArguments::Json(v) => (Some(v.clone()), None, None),
            ToolArguments::JsonText { value, raw } => {
                (Some(value.clone()), Some(raw.clone()), None)
            }
            ToolArguments::Invalid(raw) => (None, None, Some(raw.clone())),
        };
        ToolCallRepr {
            id: self.id.clone(),
            name: self.name.clone(),
            arguments,
            raw_arguments,
            invalid_arguments,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for ToolCall {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = ToolCallRepr::deserialize(d)?;
        let arguments = match (r.arguments, r.raw_arguments, r.invalid_arguments) {
            (Some(v), None, None) => ToolArguments::Json(v),
            (Some(value), Some(raw), None) => ToolArguments::JsonText { value, raw },
            (None, None, Some(raw)) => ToolArguments::Invalid(raw),
            (None, None, None) => ToolArguments::Json(Value::Object(Default::default())),
            _ => {
                return Err(serde::de::Error::custom(
                    "a tool call has `invalid_arguments` together with `arguments` or `raw_arguments`",
                ));
            }
        };
        Ok(ToolCall {
            id: r.id,
            name: r.name,
            arguments,
        })
    }
}

/// A tool the model may call: name, description, and a JSON Schema for its arguments.
///
/// ```
/// use keel_message::ToolSpec;
/// use serde_json::json;
///
/// let spec = ToolSpec::new("read_file", "Read lines of an archived file.", json!({
///     "type": "object",
///     "properties": {"path": {"type": "string"}},
///     "required": ["path"],
/// }));
/// assert_eq!(keel_message::openai::tool_to_value(&spec)["function"]["name"], "read_file");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolSpec {
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments object.
    #[serde(default = "empty_object_schema")]
    pub parameters: Value,
}

fn empty_object_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}

impl ToolSpec {
    /// A tool spec.
    pub fn new(name: impl Into<String>, description: impl Into<String>, parameters: Value) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters,
        }
    }
}
