//! Field access on JSON objects with errors that name the field.

use serde_json::{Map, Value};

use crate::{FormatError, Metadata, Problem};

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON object being read, with the path used in error messages.
pub(crate) struct Obj<'a> {
    pub(crate) map: &'a Map<String, Value>,
    path: String,
}

impl<'a> Obj<'a> {
    /// The top-level object of a message.
    pub(crate) fn root(v: &'a Value) -> Result<Self, FormatError> {
        Self::at(v, String::new())
    }

    fn at(v: &'a Value, path: String) -> Result<Self, FormatError> {
        match v {
            Value::Object(map) => Ok(Obj { map, path }),
            other => Err(FormatError::field(
                if path.is_empty() {
                    "(message)".to_owned()
                } else {
                    path
                },
                Problem::WrongType {
                    expected: "an object",
                    found: type_name(other),
                },
            )),
        }
    }

    pub(crate) fn path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    pub(crate) fn error(&self, key: &str, problem: Problem) -> FormatError {
        FormatError::field(self.path(key), problem)
    }

    fn wrong(&self, key: &str, expected: &'static str, found: &Value) -> FormatError {
        self.error(
            key,
            Problem::WrongType {
                expected,
                found: type_name(found),
            },
        )
    }

    /// A present, non-null value.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&'a str>, FormatError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(key, "a string", other)),
        }
    }

    pub(crate) fn str(&self, key: &str) -> Result<&'a str, FormatError> {
        self.opt_str(key)?
            .ok_or_else(|| self.error(key, Problem::Missing))
    }

    pub(crate) fn opt_object(&self, key: &str) -> Result<Option<Obj<'a>>, FormatError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => Self::at(v, self.path(key)).map(Some),
        }
    }

    pub(crate) fn object(&self, key: &str) -> Result<Obj<'a>, FormatError> {
        self.opt_object(key)?
            .ok_or_else(|| self.error(key, Problem::Missing))
    }

    /// Elements of an optional array, each as an object with an indexed path.
    pub(crate) fn objects(&self, key: &str) -> Result<Vec<Obj<'a>>, FormatError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| Self::at(v, format!("{}[{i}]", self.path(key))))
                .collect(),
            Some(other) => Err(self.wrong(key, "an array", other)),
        }
    }

    pub(crate) fn content(&self, key: &str) -> Result<crate::Content, FormatError> {
        crate::Content::from_value(self.map.get(key).unwrap_or(&Value::Null)).map_err(|found| {
            self.error(
                key,
                Problem::WrongType {
                    expected: "a string or an array of parts",
                    found,
                },
            )
        })
    }

    /// Every entry whose key is not in `known`, to keep in metadata.
    pub(crate) fn extras(&self, known: &[&str]) -> Metadata {
        self.map
            .iter()
            .filter(|(k, _)| !known.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

/// Stores `extras` under `metadata[key]` when non-empty, merging `user` metadata from
/// keel's own export (`metadata[key]` itself is reserved).
pub(crate) fn metadata_with_extras(key: &str, extras: Metadata) -> Metadata {
    let mut m = Metadata::new();
    if !extras.is_empty() {
        m.insert(key.to_owned(), Value::Object(extras));
    }
    m
}

/// Writes the extras kept under `metadata[key]` back into `out`, overriding.
pub(crate) fn restore_extras(key: &str, metadata: &Metadata, out: &mut Map<String, Value>) {
    if let Some(Value::Object(extras)) = metadata.get(key) {
        for (k, v) in extras {
            out.insert(k.clone(), v.clone());
        }
    }
}
