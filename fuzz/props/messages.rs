//! The properties of keel-message's OpenAI and LangChain importers over any bytes,
//! shared by the `openai_import` / `langchain_import` fuzz targets and keel-message's
//! corpus replay test (tests/fuzz_corpus.rs).
//!
//! * Importing never panics: it gives messages or a typed [`FormatError`], and a field
//!   error says which message it is in.
//! * What imported exports and imports again to the same messages, and exporting
//!   those gives the same values again (the value and string forms alike).

use keel_message::{FormatError, Message, langchain, openai};
use serde_json::Value;

/// One wire format's import and export.
struct Wire {
    name: &'static str,
    from_json: fn(&[u8]) -> Result<Vec<Message>, FormatError>,
    from_values: fn(&[Value]) -> Result<Vec<Message>, FormatError>,
    to_values: fn(&[Message]) -> Vec<Value>,
}

const OPENAI: Wire = Wire {
    name: "OpenAI",
    from_json: openai::from_json,
    from_values: openai::from_values,
    to_values: openai::to_values,
};

const LANGCHAIN: Wire = Wire {
    name: "LangChain",
    from_json: langchain::from_json,
    from_values: langchain::from_values,
    to_values: langchain::to_values,
};

/// [`OPENAI`]'s properties for `data`.
pub fn check_openai(data: &[u8]) -> Result<(), String> {
    check(&OPENAI, data)?;
    // The string form says the same as the values.
    if let Ok(messages) = openai::from_json(data) {
        let text = openai::to_json(&messages);
        match openai::from_json(text.as_bytes()) {
            Ok(again) if again == messages => {}
            other => return Err(format!("to_json {text} imports as {other:?}")),
        }
    }
    Ok(())
}

/// [`LANGCHAIN`]'s properties for `data`.
pub fn check_langchain(data: &[u8]) -> Result<(), String> {
    check(&LANGCHAIN, data)
}

fn check(wire: &Wire, data: &[u8]) -> Result<(), String> {
    let name = wire.name;
    let messages = match (wire.from_json)(data) {
        Ok(messages) => messages,
        Err(FormatError::Field { index: None, .. }) => {
            return Err(format!("{name}: a field error that names no message"));
        }
        Err(e) if e.to_string().is_empty() => return Err(format!("{name}: {e:?} says nothing")),
        Err(_) => return Ok(()),
    };
    let exported = (wire.to_values)(&messages);
    let again = (wire.from_values)(&exported)
        .map_err(|e| format!("{name}: the export of {messages:?} does not import: {e}"))?;
    if again != messages {
        return Err(format!(
            "{name}: export then import changed the messages\n  imported: {messages:?}\n  exported: {}\n  again:    {again:?}",
            Value::Array(exported)
        ));
    }
    let exported_again = (wire.to_values)(&again);
    if exported_again != exported {
        return Err(format!(
            "{name}: exporting again changed the values\n  first:  {}\n  second: {}",
            Value::Array(exported),
            Value::Array(exported_again)
        ));
    }
    Ok(())
}
