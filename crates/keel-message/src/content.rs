use std::borrow::Cow;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Value, json};

/// A message's content: plain text, or a list of parts (text, images, anything else).
///
/// Serialized as a JSON string or a JSON array, the shape OpenAI and LangChain use.
///
/// ```
/// use keel_message::{Content, ContentPart};
///
/// let c: Content = serde_json::from_str(r#"[{"type":"text","text":"a"},{"type":"text","text":"b"}]"#)?;
/// assert_eq!(c.text(), "ab");
/// assert_eq!(c, Content::Parts(vec![ContentPart::text("a"), ContentPart::text("b")]));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Multi-part content.
    Parts(Vec<ContentPart>),
}

impl Default for Content {
    fn default() -> Self {
        Content::Text(String::new())
    }
}

impl Content {
    /// The text: the string itself, or every text part joined with no separator.
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            Content::Text(s) => Cow::Borrowed(s),
            Content::Parts(parts) => {
                let mut texts = parts.iter().filter_map(ContentPart::as_text);
                match (texts.next(), texts.next()) {
                    (None, _) => Cow::Borrowed(""),
                    (Some(one), None) => Cow::Borrowed(one),
                    (Some(a), Some(b)) => {
                        let mut s = String::with_capacity(a.len() + b.len());
                        s.push_str(a);
                        s.push_str(b);
                        texts.for_each(|t| s.push_str(t));
                        Cow::Owned(s)
                    }
                }
            }
        }
    }

    /// True for empty text or no parts.
    pub fn is_empty(&self) -> bool {
        match self {
            Content::Text(s) => s.is_empty(),
            Content::Parts(p) => p.is_empty(),
        }
    }

    /// The content as a JSON value (a string or an array of part objects).
    pub fn to_value(&self) -> Value {
        match self {
            Content::Text(s) => Value::String(s.clone()),
            Content::Parts(parts) => {
                Value::Array(parts.iter().map(ContentPart::to_value).collect())
            }
        }
    }

    /// Reads a JSON string or array. `null` is empty text. Anything else is `Err` with the
    /// JSON type found.
    pub fn from_value(v: &Value) -> Result<Self, &'static str> {
        match v {
            Value::Null => Ok(Content::default()),
            Value::String(s) => Ok(Content::Text(s.clone())),
            Value::Array(items) => Ok(Content::Parts(
                items.iter().map(ContentPart::from_value).collect(),
            )),
            other => Err(crate::value::type_name(other)),
        }
    }
}

impl From<String> for Content {
    fn from(s: String) -> Self {
        Content::Text(s)
    }
}

impl From<&str> for Content {
    fn from(s: &str) -> Self {
        Content::Text(s.to_owned())
    }
}

impl From<Vec<ContentPart>> for Content {
    fn from(p: Vec<ContentPart>) -> Self {
        Content::Parts(p)
    }
}

impl Serialize for Content {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Content::Text(t) => s.serialize_str(t),
            Content::Parts(parts) => parts.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Content::from_value(&v).map_err(|found| {
            serde::de::Error::custom(format!(
                "content must be a string or an array of parts, found {found}"
            ))
        })
    }
}

/// One part of multi-part content.
///
/// Text and image parts in their canonical shape are typed; any other part (audio,
/// provider-specific blocks, a text part with extra keys) is kept verbatim as
/// [`ContentPart::Other`], so round trips lose nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    /// `{"type": "text", "text": ...}`
    Text {
        /// The text.
        text: String,
    },
    /// `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`
    Image {
        /// An `https:` or `data:` URL.
        url: String,
        /// OpenAI's `detail` hint (`low`, `high`, `auto`), if given.
        detail: Option<String>,
    },
    /// Any other part, verbatim.
    Other(Value),
}

impl ContentPart {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart::Text { text: text.into() }
    }

    /// The text of a text part (also of an `Other` object with `"type": "text"`).
    pub fn as_text(&self) -> Option<&str> {
        match self {
            ContentPart::Text { text } => Some(text),
            ContentPart::Other(v) if v.get("type").and_then(Value::as_str) == Some("text") => {
                v.get("text").and_then(Value::as_str)
            }
            _ => None,
        }
    }

    /// The part as JSON.
    pub fn to_value(&self) -> Value {
        match self {
            ContentPart::Text { text } => json!({"type": "text", "text": text}),
            ContentPart::Image { url, detail } => {
                let mut image = serde_json::Map::new();
                image.insert("url".into(), Value::String(url.clone()));
                if let Some(d) = detail {
                    image.insert("detail".into(), Value::String(d.clone()));
                }
                json!({"type": "image_url", "image_url": image})
            }
            ContentPart::Other(v) => v.clone(),
        }
    }

    /// Reads a part; canonical text and image shapes become typed, the rest `Other`.
    pub fn from_value(v: &Value) -> Self {
        let Some(obj) = v.as_object() else {
            return ContentPart::Other(v.clone());
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("text") if obj.len() == 2 => {
                if let Some(text) = obj.get("text").and_then(Value::as_str) {
                    return ContentPart::text(text);
                }
            }
            Some("image_url") if obj.len() == 2 => {
                if let Some(image) = obj.get("image_url").and_then(Value::as_object) {
                    let url = image.get("url").and_then(Value::as_str);
                    let detail = image.get("detail");
                    let canonical_keys = image.keys().all(|k| {
                        k == "url" || (k == "detail" && detail.is_some_and(Value::is_string))
                    });
                    if let (Some(url), true) = (url, canonical_keys) {
                        return ContentPart::Image {
                            url: url.to_owned(),
                            detail: detail.and_then(Value::as_str).map(str::to_owned),
                        };
                    }
                }
            }
            _ => {}
        }
        ContentPart::Other(v.clone())
    }
}

impl Serialize for ContentPart {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for ContentPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Value::deserialize(d).map(|v| ContentPart::from_value(&v))
    }
}
