//! [`AddMessages`]: the message-history reducer, its value [`Messages`] and its update
//! [`AddMessagesUpdate`].

use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;

use keel_message::{FormatError, Message, Problem, langchain};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Value, json};

use crate::index::IdIndex;
use crate::{Associative, ReduceError, Reducer};

/// The id LangChain's `RemoveMessage` carries to mean "remove every message"
/// (LangGraph's `REMOVE_ALL_MESSAGES`).
pub const REMOVE_ALL_MESSAGES: &str = "__remove_all__";

/// A fresh message id: a random UUID v4, as LangGraph assigns.
fn new_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The id of a message stored in [`Messages`] (always present there).
fn stored_id(m: &Message) -> &str {
    m.id.as_deref().unwrap_or_default()
}

/// A message history: the value of an [`AddMessages`] channel.
///
/// A list of [`Message`]s, every one with an id and no id twice, plus an index from id
/// to position, so appending is O(1) amortised and replacing by id is O(1) however long
/// the history grows. It dereferences to `[Message]` for reading.
///
/// It serializes as the plain list of messages (the index is rebuilt when
/// deserializing), so a checkpoint stores nothing but the messages. Deserializing, or
/// converting
/// with [`TryFrom<Vec<Message>>`](#impl-TryFrom%3CVec%3CMessage%3E%3E-for-Messages),
/// refuses a list with a message without id or an id seen twice.
///
/// ```
/// use keel_message::Message;
/// use keel_reducer::{AddMessages, AddMessagesUpdate, Messages, Reducer};
///
/// let history = AddMessages.apply(
///     Messages::new(),
///     AddMessagesUpdate::append([Message::user("hi").with_id("1"), Message::assistant("hello")]),
/// )?;
/// assert_eq!(history.len(), 2);
/// assert_eq!(history.get("1").map(|m| m.text().into_owned()), Some("hi".to_owned()));
/// assert!(history[1].id.is_some()); // assigned
///
/// let json = serde_json::to_string(&history)?;
/// let back: Messages = serde_json::from_str(&json)?;
/// assert_eq!(back, history);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct Messages {
    list: Vec<Message>,
    index: IdIndex,
}

impl Messages {
    /// An empty history.
    pub fn new() -> Self {
        Self::default()
    }

    /// The message with this id.
    pub fn get(&self, id: &str) -> Option<&Message> {
        self.position(id).and_then(|i| self.list.get(i))
    }

    /// The position of the message with this id.
    ///
    /// ```
    /// use keel_message::Message;
    /// use keel_reducer::Messages;
    ///
    /// let h = Messages::try_from(vec![Message::user("a").with_id("x"), Message::user("b").with_id("y")])?;
    /// assert_eq!(h.position("y"), Some(1));
    /// assert_eq!(h.position("z"), None);
    /// # Ok::<(), keel_reducer::ReduceError>(())
    /// ```
    pub fn position(&self, id: &str) -> Option<usize> {
        self.index.position(&self.list, id)
    }

    /// True if a message has this id.
    pub fn contains_id(&self, id: &str) -> bool {
        self.position(id).is_some()
    }

    /// The messages, in order.
    pub fn as_slice(&self) -> &[Message] {
        &self.list
    }

    /// The messages, in order, as a plain list.
    pub fn into_vec(self) -> Vec<Message> {
        self.list
    }

    /// Keeps the first `len` messages and drops the rest (O(number dropped)); does
    /// nothing when `len` is not below the length.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.list.len() {
            return;
        }
        for (pos, m) in self.list.iter().enumerate().skip(len) {
            self.index.remove(stored_id(m), pos);
        }
        self.list.truncate(len);
    }

    fn clear(&mut self) {
        self.list.clear();
        self.index.clear();
    }

    /// Replaces the message with `message`'s id in place, or appends it. The message
    /// must have an id.
    fn upsert(&mut self, message: Message) {
        let new_pos = self.list.len();
        match self
            .index
            .get_or_insert(&self.list, stored_id(&message), new_pos)
        {
            Some(pos) => {
                if let Some(slot) = self.list.get_mut(pos) {
                    *slot = message;
                }
            }
            None => self.list.push(message),
        }
    }

    /// Removes every message whose id is in `ids`, keeping the order of the rest.
    fn remove_ids(&mut self, ids: &HashSet<String>) {
        let mut remap = Vec::with_capacity(self.list.len());
        let mut next = 0;
        for m in &self.list {
            if ids.contains(stored_id(m)) {
                remap.push(None);
            } else {
                remap.push(Some(next));
                next += 1;
            }
        }
        self.list.retain(|m| !ids.contains(stored_id(m)));
        self.index.remap(&remap);
    }
}

impl Deref for Messages {
    type Target = [Message];

    fn deref(&self) -> &[Message] {
        &self.list
    }
}

impl AsRef<[Message]> for Messages {
    fn as_ref(&self) -> &[Message] {
        &self.list
    }
}

impl PartialEq for Messages {
    fn eq(&self, other: &Self) -> bool {
        self.list == other.list
    }
}

impl fmt::Debug for Messages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.list).finish()
    }
}

impl TryFrom<Vec<Message>> for Messages {
    type Error = ReduceError;

    /// Takes a list whose messages all have distinct ids.
    ///
    /// ```
    /// use keel_message::Message;
    /// use keel_reducer::{Messages, ReduceError};
    ///
    /// let dup = vec![Message::user("a").with_id("x"), Message::user("b").with_id("x")];
    /// assert_eq!(Messages::try_from(dup), Err(ReduceError::DuplicateMessageId { id: "x".into() }));
    /// assert_eq!(
    ///     Messages::try_from(vec![Message::user("no id")]),
    ///     Err(ReduceError::MissingMessageId { index: 0 })
    /// );
    /// ```
    fn try_from(list: Vec<Message>) -> Result<Self, ReduceError> {
        let mut index = IdIndex::with_capacity(list.len());
        for (i, m) in list.iter().enumerate() {
            let id =
                m.id.as_deref()
                    .ok_or(ReduceError::MissingMessageId { index: i })?;
            if index.get_or_insert(&list, id, i).is_some() {
                return Err(ReduceError::DuplicateMessageId { id: id.to_owned() });
            }
        }
        Ok(Messages { list, index })
    }
}

impl From<Messages> for Vec<Message> {
    fn from(m: Messages) -> Self {
        m.list
    }
}

impl IntoIterator for Messages {
    type Item = Message;
    type IntoIter = std::vec::IntoIter<Message>;

    fn into_iter(self) -> Self::IntoIter {
        self.list.into_iter()
    }
}

impl<'a> IntoIterator for &'a Messages {
    type Item = &'a Message;
    type IntoIter = std::slice::Iter<'a, Message>;

    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

impl Serialize for Messages {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.list.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Messages {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let list = Vec::<Message>::deserialize(d)?;
        Messages::try_from(list).map_err(serde::de::Error::custom)
    }
}

/// One operation of an [`AddMessagesUpdate`].
///
/// Serialized externally tagged: `{"upsert": {message}}`, `{"remove": "id"}`,
/// `"remove_all"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MessageOp {
    /// Replace the message with this message's id in place, or append it if the id is
    /// new. A message without id gets a fresh UUID v4 (the update constructors assign it
    /// up front).
    Upsert(Message),
    /// Remove the message with this id; an id the state does not hold is
    /// [`ReduceError::UnknownMessageId`]. Removals take effect at the end of the update,
    /// so a later upsert of the same id in the same update cancels the removal and
    /// replaces the message in place.
    Remove(String),
    /// Remove every message. Operations before the last `RemoveAll` of an update are
    /// ignored.
    RemoveAll,
}

/// One write to an [`AddMessages`] channel: a list of [`MessageOp`]s applied in order.
///
/// Build it with [`append`](Self::append), [`remove`](Self::remove),
/// [`replace_all`](Self::replace_all) or [`remove_all`](Self::remove_all), and join
/// updates with [`then`](Self::then). Every constructor gives id-less messages a fresh
/// UUID v4 when the update is built, so a stored update replays to the same state.
///
/// Serialized as the plain list of operations.
///
/// ```
/// use keel_message::Message;
/// use keel_reducer::{AddMessages, AddMessagesUpdate, MessageOp, Reducer};
///
/// let u = AddMessagesUpdate::remove(["old"]).then(AddMessagesUpdate::append([Message::user("new")]));
/// assert_eq!(u.ops()[0], MessageOp::Remove("old".into()));
/// assert!(matches!(&u.ops()[1], MessageOp::Upsert(m) if m.id.is_some()));
/// assert_eq!(serde_json::to_value(&u)?[0], serde_json::json!({"remove": "old"}));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct AddMessagesUpdate {
    ops: Ops,
}

/// The operations of an update. A single operation (most updates are one message) is
/// stored inline: building and reducing it allocates nothing beyond the message.
#[derive(Clone)]
enum Ops {
    One(MessageOp),
    Many(Vec<MessageOp>),
}

impl Default for Ops {
    fn default() -> Self {
        Ops::Many(Vec::new())
    }
}

impl Ops {
    fn collect(ops: impl IntoIterator<Item = MessageOp>) -> Self {
        let mut it = ops.into_iter();
        let Some(first) = it.next() else {
            return Ops::default();
        };
        let Some(second) = it.next() else {
            return Ops::One(first);
        };
        let mut v = Vec::with_capacity(2 + it.size_hint().0);
        v.push(first);
        v.push(second);
        v.extend(it);
        Ops::Many(v)
    }

    fn as_slice(&self) -> &[MessageOp] {
        match self {
            Ops::One(op) => std::slice::from_ref(op),
            Ops::Many(v) => v,
        }
    }

    fn into_vec(self) -> Vec<MessageOp> {
        match self {
            Ops::One(op) => vec![op],
            Ops::Many(v) => v,
        }
    }

    fn extend(&mut self, more: impl IntoIterator<Item = MessageOp>) {
        let mut more = more.into_iter().peekable();
        if more.peek().is_none() {
            return;
        }
        if self.as_slice().is_empty() {
            *self = Ops::collect(more);
        } else {
            let mut v = std::mem::take(self).into_vec();
            v.extend(more);
            *self = Ops::Many(v);
        }
    }
}

impl PartialEq for AddMessagesUpdate {
    fn eq(&self, other: &Self) -> bool {
        self.ops() == other.ops()
    }
}

impl fmt::Debug for AddMessagesUpdate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.ops()).finish()
    }
}

impl Serialize for AddMessagesUpdate {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.ops().serialize(s)
    }
}

impl<'de> Deserialize<'de> for AddMessagesUpdate {
    /// Reads the list of operations verbatim: an id-less upsert stays id-less (the
    /// reducer gives it an id).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<MessageOp>::deserialize(d).map(|ops| AddMessagesUpdate {
            ops: Ops::collect(ops),
        })
    }
}

fn with_id(mut m: Message) -> Message {
    if m.id.is_none() {
        m.id = Some(new_id());
    }
    m
}

fn with_ids(op: MessageOp) -> MessageOp {
    match op {
        MessageOp::Upsert(m) => MessageOp::Upsert(with_id(m)),
        other => other,
    }
}

impl AddMessagesUpdate {
    /// An update that changes nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append messages; a message whose id is already in the state replaces it in place.
    ///
    /// ```
    /// use keel_message::Message;
    /// use keel_reducer::{AddMessages, AddMessagesUpdate, Messages, Reducer};
    ///
    /// let h = AddMessages.apply(Messages::new(), AddMessagesUpdate::append([
    ///     Message::user("draft").with_id("q"),
    ///     Message::assistant("ok").with_id("a"),
    /// ]))?;
    /// let h = AddMessages.apply(h, AddMessagesUpdate::append([Message::user("final").with_id("q")]))?;
    /// assert_eq!(h[0].text(), "final");
    /// assert_eq!(h.len(), 2);
    /// # Ok::<(), keel_reducer::ReduceError>(())
    /// ```
    pub fn append(messages: impl IntoIterator<Item = Message>) -> Self {
        AddMessagesUpdate {
            ops: Ops::collect(messages.into_iter().map(|m| MessageOp::Upsert(with_id(m)))),
        }
    }

    /// Remove the messages with these ids (each must be in the state).
    ///
    /// ```
    /// use keel_message::Message;
    /// use keel_reducer::{AddMessages, AddMessagesUpdate, Messages, ReduceError, Reducer};
    ///
    /// let h = Messages::try_from(vec![Message::user("a").with_id("1"), Message::user("b").with_id("2")])?;
    /// let h = AddMessages.apply(h, AddMessagesUpdate::remove(["1"]))?;
    /// assert_eq!(h.len(), 1);
    /// assert_eq!(
    ///     AddMessages.apply(h.clone(), AddMessagesUpdate::remove(["9"])),
    ///     Err(ReduceError::UnknownMessageId { id: "9".into() })
    /// );
    /// // LangGraph's remove-all id clears the list.
    /// let none = AddMessages.apply(h, AddMessagesUpdate::remove([keel_reducer::REMOVE_ALL_MESSAGES]))?;
    /// assert!(none.is_empty());
    /// # Ok::<(), ReduceError>(())
    /// ```
    pub fn remove<I>(ids: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        AddMessagesUpdate {
            ops: Ops::collect(ids.into_iter().map(|id| {
                let id = id.into();
                // LangGraph's `RemoveMessage(id=REMOVE_ALL_MESSAGES)`.
                if id == REMOVE_ALL_MESSAGES {
                    MessageOp::RemoveAll
                } else {
                    MessageOp::Remove(id)
                }
            })),
        }
    }

    /// Remove every message (also [`AddMessagesUpdate::remove`] of
    /// [`REMOVE_ALL_MESSAGES`], as LangGraph's `RemoveMessage(id=REMOVE_ALL_MESSAGES)`).
    pub fn remove_all() -> Self {
        AddMessagesUpdate {
            ops: Ops::One(MessageOp::RemoveAll),
        }
    }

    /// Remove every message and put these in their place: compaction's "flush the raw
    /// buffer and replace it with the compacted version". Applying the same update twice
    /// gives the same state as applying it once.
    ///
    /// ```
    /// use keel_message::Message;
    /// use keel_reducer::{AddMessages, AddMessagesUpdate, Messages, Reducer};
    ///
    /// let h = Messages::try_from(vec![Message::user("a").with_id("1"), Message::user("b").with_id("2")])?;
    /// let flush = AddMessagesUpdate::replace_all([Message::system("summary: a, b")]);
    /// let once = AddMessages.apply(h, flush.clone())?;
    /// assert_eq!(once.len(), 1);
    /// assert_eq!(AddMessages.apply(once.clone(), flush)?, once);
    /// # Ok::<(), keel_reducer::ReduceError>(())
    /// ```
    pub fn replace_all(messages: impl IntoIterator<Item = Message>) -> Self {
        Self::remove_all().then(Self::append(messages))
    }

    /// These operations, in order (id-less messages get an id now).
    pub fn from_ops(ops: impl IntoIterator<Item = MessageOp>) -> Self {
        AddMessagesUpdate {
            ops: Ops::collect(ops.into_iter().map(with_ids)),
        }
    }

    /// This update followed by `next`.
    #[must_use]
    pub fn then(mut self, next: AddMessagesUpdate) -> Self {
        self.ops.extend(next.ops.into_vec());
        self
    }

    /// Adds one operation at the end (an id-less message gets an id now).
    pub fn push(&mut self, op: MessageOp) {
        self.ops.extend([with_ids(op)]);
    }

    /// The operations, in order.
    pub fn ops(&self) -> &[MessageOp] {
        self.ops.as_slice()
    }

    /// The operations, in order.
    pub fn into_ops(self) -> Vec<MessageOp> {
        self.ops.into_vec()
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops().len()
    }

    /// True when there is no operation.
    pub fn is_empty(&self) -> bool {
        self.ops().is_empty()
    }

    /// Reads a list of LangChain message dicts, as a LangGraph node would return them:
    /// messages (imported with [`keel_message::langchain`]) are upserts, a
    /// `RemoveMessage` (`"type": "remove"`) is a removal, and one whose id is
    /// [`REMOVE_ALL_MESSAGES`] removes everything. Id-less messages get an id now.
    ///
    /// ```
    /// use keel_reducer::{AddMessagesUpdate, MessageOp};
    /// use serde_json::json;
    ///
    /// let u = AddMessagesUpdate::from_langchain(&[
    ///     json!({"type": "remove", "id": "__remove_all__"}),
    ///     json!({"type": "human", "content": "hi", "id": "1"}),
    ///     json!({"type": "remove", "id": "1"}),
    /// ])?;
    /// assert_eq!(u.ops()[0], MessageOp::RemoveAll);
    /// assert_eq!(u.ops()[2], MessageOp::Remove("1".into()));
    /// # Ok::<(), keel_message::FormatError>(())
    /// ```
    pub fn from_langchain(values: &[Value]) -> Result<Self, FormatError> {
        let mut ops = Vec::with_capacity(values.len());
        for (i, v) in values.iter().enumerate() {
            if v.get("type").and_then(Value::as_str) == Some("remove") {
                // Flat (`model_dump()`) or wrapped (`messages_to_dict`: `{"type", "data"}`).
                let fields = match (v.get("id"), v.get("data")) {
                    (None, Some(data)) if data.is_object() => data,
                    _ => v,
                };
                let id = match fields.get("id") {
                    Some(Value::String(id)) => id.clone(),
                    Some(other) if !other.is_null() => {
                        return Err(FormatError::Field {
                            index: Some(i),
                            field: "id".into(),
                            problem: Problem::WrongType {
                                expected: "a string",
                                found: json_type(other),
                            },
                        });
                    }
                    _ => {
                        return Err(FormatError::Field {
                            index: Some(i),
                            field: "id".into(),
                            problem: Problem::Missing,
                        });
                    }
                };
                ops.push(if id == REMOVE_ALL_MESSAGES {
                    MessageOp::RemoveAll
                } else {
                    MessageOp::Remove(id)
                });
            } else {
                let m = langchain::from_value(v).map_err(|e| e.at_index(i))?;
                ops.push(MessageOp::Upsert(with_id(m)));
            }
        }
        Ok(AddMessagesUpdate {
            ops: Ops::collect(ops),
        })
    }

    /// Writes the update as LangChain message dicts: messages flat, removals as
    /// `RemoveMessage` dicts. [`from_langchain`](Self::from_langchain) reads it back.
    pub fn to_langchain(&self) -> Vec<Value> {
        self.ops()
            .iter()
            .map(|op| match op {
                MessageOp::Upsert(m) => langchain::to_value(m),
                MessageOp::Remove(id) => remove_message(id),
                MessageOp::RemoveAll => remove_message(REMOVE_ALL_MESSAGES),
            })
            .collect()
    }
}

fn remove_message(id: &str) -> Value {
    json!({
        "content": "", "additional_kwargs": {}, "response_metadata": {},
        "type": "remove", "name": null, "id": id,
    })
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl From<Message> for AddMessagesUpdate {
    fn from(m: Message) -> Self {
        Self::append([m])
    }
}

impl From<Vec<Message>> for AddMessagesUpdate {
    fn from(ms: Vec<Message>) -> Self {
        Self::append(ms)
    }
}

impl FromIterator<MessageOp> for AddMessagesUpdate {
    fn from_iter<I: IntoIterator<Item = MessageOp>>(iter: I) -> Self {
        Self::from_ops(iter)
    }
}

impl Extend<MessageOp> for AddMessagesUpdate {
    fn extend<I: IntoIterator<Item = MessageOp>>(&mut self, iter: I) {
        self.ops.extend(iter.into_iter().map(with_ids));
    }
}

/// The message-history reducer: LangGraph's `add_messages`, typed.
///
/// For each [`AddMessagesUpdate`], in order:
///
/// 1. If it contains [`MessageOp::RemoveAll`], the history is emptied and only the
///    operations after the last `RemoveAll` are applied.
/// 2. [`MessageOp::Upsert`]: a message whose id is in the history replaces it in place;
///    otherwise it is appended (O(1) amortised). A message without id gets a UUID v4.
/// 3. [`MessageOp::Remove`]: the id must be in the history at that point (present before
///    the update, or upserted earlier in it), else [`ReduceError::UnknownMessageId`].
///    Removals are applied at the end of the update, so an upsert of the same id after
///    the removal cancels it.
///
/// A superstep with several updates folds them one after another. If any fails, the
/// history is left exactly as it was: removals are checked before anything changes.
///
/// See the crate docs for the [differences from LangGraph](crate#differences-from-langgraphs-add_messages).
///
/// ```
/// use keel_message::{Message, ToolCall};
/// use keel_reducer::{AddMessages, AddMessagesUpdate, Reducer};
/// use serde_json::json;
///
/// let r = AddMessages;
/// let mut history = r.empty();
/// r.reduce(&mut history, vec![
///     AddMessagesUpdate::append([Message::user("list files").with_id("u1")]),
///     AddMessagesUpdate::append([Message::assistant("")
///         .with_id("a1")
///         .with_tool_calls(vec![ToolCall::new("c1", "ls", json!({}))])]),
/// ])?;
/// r.reduce(&mut history, vec![AddMessagesUpdate::append([Message::tool("c1", "a.txt")])])?;
/// assert_eq!(history.len(), 3);
///
/// // Remove and re-add in one update: the message is replaced where it was.
/// r.reduce(&mut history, vec![AddMessagesUpdate::remove(["u1"])
///     .then(AddMessagesUpdate::append([Message::user("list all files").with_id("u1")]))])?;
/// assert_eq!(history[0].text(), "list all files");
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AddMessages;

/// The operations of an update that take effect: those after its last `RemoveAll`.
fn effective(ops: &[MessageOp]) -> (bool, &[MessageOp]) {
    match ops
        .iter()
        .rposition(|op| matches!(op, MessageOp::RemoveAll))
    {
        Some(i) => (true, ops.get(i + 1..).unwrap_or_default()),
        None => (false, ops),
    }
}

/// Checks that every removal in `updates` names an id that exists when it runs,
/// without touching `current`: tracks only the ids the updates add and remove.
fn validate(current: &Messages, updates: &[AddMessagesUpdate]) -> Result<(), ReduceError> {
    let any_removal = updates.iter().any(|u| {
        effective(u.ops())
            .1
            .iter()
            .any(|op| matches!(op, MessageOp::Remove(_)))
    });
    if !any_removal {
        return Ok(());
    }
    let mut cleared = false;
    let mut added: HashSet<&str> = HashSet::new();
    let mut removed: HashSet<&str> = HashSet::new();
    for u in updates {
        let (clears, ops) = effective(u.ops());
        if clears {
            cleared = true;
            added.clear();
            removed.clear();
        }
        let mut pending: HashSet<&str> = HashSet::new();
        for op in ops {
            let exists = |id: &str, added: &HashSet<&str>| {
                added.contains(id) || (!cleared && current.contains_id(id) && !removed.contains(id))
            };
            match op {
                MessageOp::Upsert(m) => {
                    // An id-less message gets a fresh UUID: it cannot be removed by id
                    // in the same update, so it need not be tracked.
                    if let Some(id) = m.id.as_deref()
                        && !exists(id, &added)
                    {
                        added.insert(id);
                    }
                    if let Some(id) = m.id.as_deref() {
                        pending.remove(id);
                    }
                }
                MessageOp::Remove(id) => {
                    if !exists(id, &added) {
                        return Err(ReduceError::UnknownMessageId { id: id.clone() });
                    }
                    pending.insert(id);
                }
                MessageOp::RemoveAll => {}
            }
        }
        for id in pending {
            if !added.remove(id) {
                removed.insert(id);
            }
        }
    }
    Ok(())
}

fn apply_update(current: &mut Messages, update: AddMessagesUpdate) -> Result<(), ReduceError> {
    let (clears, rest) = effective(update.ops());
    let skip = update.len() - rest.len();
    if clears {
        current.clear();
    }
    let mut pending: HashSet<String> = HashSet::new();
    match update.ops {
        Ops::One(op) => {
            if skip == 0 {
                apply_op(current, op, &mut pending)?;
            }
        }
        Ops::Many(ops) => {
            for op in ops.into_iter().skip(skip) {
                apply_op(current, op, &mut pending)?;
            }
        }
    }
    if !pending.is_empty() {
        current.remove_ids(&pending);
    }
    Ok(())
}

/// Applies one operation; removals are collected in `pending`, for the end of the
/// update.
fn apply_op(
    current: &mut Messages,
    op: MessageOp,
    pending: &mut HashSet<String>,
) -> Result<(), ReduceError> {
    match op {
        MessageOp::Upsert(mut m) => {
            let id = m.id.get_or_insert_with(new_id);
            if !pending.is_empty() {
                pending.remove(id.as_str());
            }
            current.upsert(m);
        }
        MessageOp::Remove(id) => {
            if !current.contains_id(&id) {
                return Err(ReduceError::UnknownMessageId { id });
            }
            pending.insert(id);
        }
        MessageOp::RemoveAll => current.clear(),
    }
    Ok(())
}

impl Reducer for AddMessages {
    type Value = Messages;
    type Update = AddMessagesUpdate;

    fn empty(&self) -> Messages {
        Messages::new()
    }

    fn reduce(
        &self,
        current: &mut Messages,
        updates: Vec<AddMessagesUpdate>,
    ) -> Result<(), ReduceError> {
        validate(current, &updates)?;
        for u in updates {
            apply_update(current, u)?;
        }
        Ok(())
    }
}

impl Associative for AddMessages {}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn msgs(ids: &[&str]) -> Messages {
        Messages::try_from(
            ids.iter()
                .map(|id| Message::user(format!("text {id}")).with_id(*id))
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    fn ids(m: &Messages) -> Vec<&str> {
        m.iter().map(stored_id).collect()
    }

    fn index_is_consistent(m: &Messages) -> bool {
        m.index.len() == m.list.len()
            && m.list
                .iter()
                .enumerate()
                .all(|(i, msg)| m.position(stored_id(msg)) == Some(i))
    }

    #[test]
    fn removal_keeps_order_and_index() {
        let mut h = msgs(&["a", "b", "c", "d"]);
        AddMessages
            .reduce(&mut h, vec![AddMessagesUpdate::remove(["b", "d"])])
            .unwrap();
        assert_eq!(ids(&h), ["a", "c"]);
        assert!(index_is_consistent(&h));
    }

    #[test]
    fn truncate_updates_index() {
        let mut h = msgs(&["a", "b", "c"]);
        h.truncate(1);
        assert_eq!(ids(&h), ["a"]);
        assert!(index_is_consistent(&h));
        assert!(!h.contains_id("b"));
        h.truncate(5);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn failed_superstep_changes_nothing() {
        let mut h = msgs(&["a", "b"]);
        let before = h.clone();
        let err = AddMessages
            .reduce(
                &mut h,
                vec![
                    AddMessagesUpdate::append([Message::user("x").with_id("x")]),
                    AddMessagesUpdate::remove(["a"]),
                    // `a` is gone after the second update.
                    AddMessagesUpdate::remove(["a"]),
                ],
            )
            .unwrap_err();
        assert_eq!(err, ReduceError::UnknownMessageId { id: "a".into() });
        assert_eq!(h, before);
        assert!(index_is_consistent(&h));
    }

    #[test]
    fn validation_tracks_ids_across_updates() {
        let mut h = msgs(&["a"]);
        AddMessages
            .reduce(
                &mut h,
                vec![
                    AddMessagesUpdate::append([Message::user("x").with_id("x")]),
                    AddMessagesUpdate::remove(["x"]),
                    AddMessagesUpdate::replace_all([Message::user("y").with_id("y")]),
                    AddMessagesUpdate::remove(["y"]),
                ],
            )
            .unwrap();
        assert!(h.is_empty());
        assert!(index_is_consistent(&h));
        let mut h = msgs(&["a"]);
        let err = AddMessages
            .reduce(
                &mut h,
                vec![
                    AddMessagesUpdate::remove_all(),
                    AddMessagesUpdate::remove(["a"]),
                ],
            )
            .unwrap_err();
        assert_eq!(err, ReduceError::UnknownMessageId { id: "a".into() });
        assert_eq!(ids(&h), ["a"]);
    }

    #[test]
    fn remove_then_upsert_in_one_update_replaces_in_place() {
        let mut h = msgs(&["a", "b", "c"]);
        let u =
            AddMessagesUpdate::remove(["a"])
                .then(AddMessagesUpdate::append([
                    Message::assistant("new a").with_id("a")
                ]));
        AddMessages.reduce(&mut h, vec![u]).unwrap();
        assert_eq!(ids(&h), ["a", "b", "c"]);
        assert_eq!(h[0].text(), "new a");
    }

    #[test]
    fn remove_then_upsert_in_two_updates_appends() {
        let mut h = msgs(&["a", "b"]);
        AddMessages
            .reduce(
                &mut h,
                vec![
                    AddMessagesUpdate::remove(["a"]),
                    AddMessagesUpdate::append([Message::assistant("new a").with_id("a")]),
                ],
            )
            .unwrap();
        assert_eq!(ids(&h), ["b", "a"]);
        assert!(index_is_consistent(&h));
    }

    #[test]
    fn hand_built_upsert_without_id_gets_one() {
        let update: AddMessagesUpdate =
            serde_json::from_value(json!([{"upsert": {"role": "user", "content": "hi"}}])).unwrap();
        let h = AddMessages.apply(Messages::new(), update).unwrap();
        assert!(h[0].id.as_deref().is_some_and(|id| !id.is_empty()));
        assert!(index_is_consistent(&h));
    }

    #[test]
    fn updates_of_any_length_build_and_round_trip() {
        let a = Message::user("a").with_id("a");
        let b = Message::user("b").with_id("b");
        let cases = [
            AddMessagesUpdate::new(),
            AddMessagesUpdate::append([a.clone()]),
            AddMessagesUpdate::append([a.clone(), b.clone()]),
            AddMessagesUpdate::remove_all(),
            AddMessagesUpdate::replace_all([a.clone()]),
        ];
        for u in cases {
            let json = serde_json::to_value(&u).unwrap();
            assert_eq!(json.as_array().unwrap().len(), u.len());
            let back: AddMessagesUpdate = serde_json::from_value(json).unwrap();
            assert_eq!(back, u);
            assert_eq!(back.clone().into_ops(), u.ops());
        }
        let mut u = AddMessagesUpdate::new();
        u.push(MessageOp::Upsert(a.clone()));
        assert_eq!(u, AddMessagesUpdate::append([a.clone()]));
        u.push(MessageOp::Remove("a".into()));
        u.extend([]);
        assert_eq!(
            u.ops(),
            [MessageOp::Upsert(a.clone()), MessageOp::Remove("a".into())]
        );
        let joined = AddMessagesUpdate::new()
            .then(AddMessagesUpdate::append([a.clone()]))
            .then(AddMessagesUpdate::new())
            .then(AddMessagesUpdate::append([b.clone()]));
        assert_eq!(joined, AddMessagesUpdate::append([a, b]));
        assert_eq!(
            format!("{:?}", AddMessagesUpdate::remove_all()),
            "[RemoveAll]"
        );
    }

    #[test]
    fn deserialize_rebuilds_the_index() {
        let h: Messages = serde_json::from_value(json!([
            {"id": "a", "role": "user", "content": "1"},
            {"id": "b", "role": "assistant", "content": "2"},
        ]))
        .unwrap();
        assert!(index_is_consistent(&h));
        assert_eq!(h.position("b"), Some(1));
        let h = AddMessages
            .apply(
                h,
                AddMessagesUpdate::append([Message::user("3").with_id("b")]),
            )
            .unwrap();
        assert_eq!(h.len(), 2);
        assert_eq!(h[1].text(), "3");
    }

    #[test]
    fn deserialize_refuses_duplicates() {
        let err = serde_json::from_value::<Messages>(json!([
            {"id": "a", "role": "user", "content": "1"},
            {"id": "a", "role": "user", "content": "2"},
        ]))
        .unwrap_err();
        assert!(
            err.to_string().contains("`a` appears more than once"),
            "{err}"
        );
    }

    #[test]
    fn langchain_update_round_trip() {
        let u = AddMessagesUpdate::remove_all()
            .then(AddMessagesUpdate::append([Message::user("a").with_id("1")]))
            .then(AddMessagesUpdate::remove(["1"]));
        let back = AddMessagesUpdate::from_langchain(&u.to_langchain()).unwrap();
        assert_eq!(back, u);
    }

    #[test]
    fn langchain_remove_in_either_shape() {
        let u = AddMessagesUpdate::from_langchain(&[
            json!({"type": "remove", "data": {"id": "x", "content": ""}}),
            json!({"type": "remove", "id": "__remove_all__"}),
        ])
        .unwrap();
        assert_eq!(
            u.ops(),
            [MessageOp::Remove("x".into()), MessageOp::RemoveAll]
        );
    }

    #[test]
    fn langchain_remove_without_id_is_an_error() {
        let err = AddMessagesUpdate::from_langchain(&[
            json!({"type": "human", "content": "a"}),
            json!({"type": "remove"}),
        ])
        .unwrap_err();
        assert_eq!(err.to_string(), "message 1: field `id`: missing");
    }
}
