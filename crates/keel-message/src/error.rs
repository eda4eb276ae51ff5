use std::fmt;

/// Why a message could not be imported. Each variant says where.
///
/// ```
/// let err = keel_message::openai::from_json(br#"[{"role":"user","content":"hi"},{"role":"robot"}]"#)
///     .unwrap_err();
/// assert_eq!(err.to_string(), "message 1: field `role`: unknown role `robot`");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The input bytes are not UTF-8.
    #[error("invalid UTF-8 at byte offset {offset}")]
    InvalidUtf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The input is not JSON.
    #[error("malformed JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's description.
        message: String,
    },
    /// A list of messages was expected.
    #[error("expected a JSON array of messages, found {found}")]
    NotAList {
        /// The JSON type found instead.
        found: &'static str,
    },
    /// An object holding the list of messages in one of its fields (a chat-completions
    /// request body, a LangGraph state) was given where the list itself was expected.
    ///
    /// ```
    /// use keel_message::{FormatError, openai};
    ///
    /// let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    /// let err = openai::from_json(body).unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "expected a JSON array of messages, found an object with one in its `messages` \
    ///      field: pass that array (`openai::from_values(&body[\"messages\"])`)"
    /// );
    /// // Which is how to read it:
    /// let body: serde_json::Value = serde_json::from_slice(body).unwrap();
    /// let messages = openai::from_values(body["messages"].as_array().unwrap())?;
    /// assert_eq!(messages[0].text(), "hi");
    /// # Ok::<(), FormatError>(())
    /// ```
    #[error(
        "expected a JSON array of messages, found an object with one in its `{field}` field: pass that array (`{module}::from_values(&body[\"{field}\"])`)"
    )]
    ListInObject {
        /// The field that holds the list (`messages`).
        field: &'static str,
        /// The module whose reader was called (`openai` or `langchain`).
        module: &'static str,
    },
    /// The input is empty (or only whitespace).
    #[error("the input is empty: expected a JSON array of messages")]
    Empty,
    /// One field of one message is wrong.
    #[error("{}field `{field}`: {problem}", Index(*index))]
    Field {
        /// Index of the message in its list, when reading a list.
        index: Option<usize>,
        /// Path of the field inside the message, e.g. `tool_calls[1].function.name`.
        field: String,
        /// What is wrong with it.
        problem: Problem,
    },
}

struct Index(Option<usize>);

impl fmt::Display for Index {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(i) => write!(f, "message {i}: "),
            None => Ok(()),
        }
    }
}

impl FormatError {
    pub(crate) fn field(field: impl Into<String>, problem: Problem) -> Self {
        FormatError::Field {
            index: None,
            field: field.into(),
            problem,
        }
    }

    /// Attaches the index of the message in its list.
    #[must_use]
    pub fn at_index(self, i: usize) -> Self {
        match self {
            FormatError::Field { field, problem, .. } => FormatError::Field {
                index: Some(i),
                field,
                problem,
            },
            other => other,
        }
    }

    /// Converts a JSON parse error. The message is the parser's, without the position
    /// it repeats (the line and column are fields of their own).
    pub fn from_json(e: &serde_json::Error) -> Self {
        let full = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let message = full.strip_suffix(&position).unwrap_or(&full).to_owned();
        FormatError::Json {
            line: e.line(),
            column: e.column(),
            message,
        }
    }
}

/// What is wrong with a field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// A required field is absent.
    #[error("missing")]
    Missing,
    /// The field has the wrong JSON type.
    #[error("expected {expected}, found {found}")]
    WrongType {
        /// The type required.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },
    /// A role name keel does not know.
    #[error("unknown role `{0}`")]
    UnknownRole(String),
    /// A message or part type keel does not know.
    #[error("unknown message type `{0}`")]
    UnknownType(String),
}

/// Parses bytes as UTF-8 JSON, reporting the byte offset of invalid UTF-8, an empty
/// input, and JSON Lines (several values where one array was expected) as such.
pub(crate) fn parse_json(bytes: &[u8]) -> Result<serde_json::Value, FormatError> {
    let text = std::str::from_utf8(bytes).map_err(|e| FormatError::InvalidUtf8 {
        offset: e.valid_up_to(),
    })?;
    if text.trim().is_empty() {
        return Err(FormatError::Empty);
    }
    serde_json::from_str(text).map_err(|e| {
        let mut err = FormatError::from_json(&e);
        if let FormatError::Json { message, .. } = &mut err
            && several_values(text)
        {
            message.push_str(
                " (the input holds more than one JSON value: JSON Lines? Read each line with `from_value`)",
            );
        }
        err
    })
}

/// Whether `text` starts with two complete JSON values (one per line, in JSON Lines).
fn several_values(text: &str) -> bool {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<serde::de::IgnoredAny>();
    matches!((values.next(), values.next()), (Some(Ok(_)), Some(Ok(_))))
}

/// Applies `f` to every element of a JSON array, tagging errors with the index.
/// `module` names the caller's module (`openai`, `langchain`) in the error for an
/// object that holds the list in its `messages` field.
pub(crate) fn each<T>(
    v: &serde_json::Value,
    module: &'static str,
    f: impl Fn(&serde_json::Value) -> Result<T, FormatError>,
) -> Result<Vec<T>, FormatError> {
    let items = v.as_array().ok_or_else(|| {
        if v.get("messages").is_some_and(serde_json::Value::is_array) {
            FormatError::ListInObject {
                field: "messages",
                module,
            }
        } else {
            FormatError::NotAList {
                found: crate::value::type_name(v),
            }
        }
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, m)| f(m).map_err(|e| e.at_index(i)))
        .collect()
}
