//! Typed state: a struct whose fields are channels, each merged by a reducer.

use serde_json::Value;

use keel_reducer::ReduceError;

/// A graph's state schema.
///
/// Each field is a *channel* with a [`keel_reducer::Reducer`]; nodes return a partial
/// [`State::Update`] and the engine folds all updates of one superstep into the state,
/// channel by channel, in task-path order. Channels serialize one by one (serde JSON), so
/// a checkpointer stores each channel's per-step updates (deltas) rather than the whole
/// state.
///
/// Implement it with `#[derive(State)]` (see the crate docs), or by hand.
pub trait State: Clone + Send + Sync + 'static {
    /// The partial update a node returns: every channel optional.
    type Update: Default + Send + 'static;

    /// Channel names, in declaration order.
    const CHANNELS: &'static [&'static str];

    /// The state before any write: every channel's reducer-empty value.
    fn empty() -> Self;

    /// Folds one superstep's updates, in the order given, into the state. Returns the
    /// indexes (into [`State::CHANNELS`]) of the channels written, ascending.
    ///
    /// On error the state may have been changed in channels before the failing one; the
    /// engine discards it and the thread stays at its last checkpoint.
    fn apply(&mut self, updates: Vec<Self::Update>) -> Result<Vec<usize>, StateError>;

    /// The channels an update writes, each with its update encoded as JSON.
    fn encode_update(update: &Self::Update) -> Result<Vec<(usize, Value)>, StateError>;

    /// Rebuilds an update from per-channel JSON (the inverse of [`State::encode_update`]).
    fn decode_update(values: &[(usize, Value)]) -> Result<Self::Update, StateError>;

    /// The full value of one channel, as JSON.
    fn encode_channel(&self, channel: usize) -> Result<Value, StateError>;

    /// Replaces one channel's value with a decoded snapshot.
    fn restore_channel(&mut self, channel: usize, snapshot: Value) -> Result<(), StateError>;

    /// Folds one stored delta (the JSON updates of one step) into one channel.
    fn fold_channel(&mut self, channel: usize, updates: Vec<Value>) -> Result<(), StateError>;

    /// Sets channel `channel` of `self` to a copy of that channel of `source`, and
    /// returns `true`; or returns `false`, changing nothing, if this implementation
    /// does not copy single channels (the default).
    ///
    /// Optional. In a step of several tasks each router sees the state with only its
    /// own node's writes; with this and [`swap_channel`](Self::swap_channel) the engine
    /// copies just the channels that node wrote, instead of the whole state per router.
    /// `#[derive(State)]` implements both.
    fn clone_channel_from(&mut self, source: &Self, channel: usize) -> bool {
        let _ = (source, channel);
        false
    }

    /// Swaps the value of channel `channel` between `self` and `other` and returns
    /// `true`; or returns `false`, changing nothing (the default). See
    /// [`clone_channel_from`](Self::clone_channel_from).
    fn swap_channel(&mut self, other: &mut Self, channel: usize) -> bool {
        let _ = (other, channel);
        false
    }
}

/// Looks up a channel index by name.
pub fn channel_index<S: State>(name: &str) -> Option<usize> {
    S::CHANNELS.iter().position(|c| *c == name)
}

/// An error reading or writing a state channel. Always names the channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The channel's reducer refused the step's updates.
    #[error("channel `{channel}`: {source}")]
    Reduce {
        /// The channel.
        channel: &'static str,
        /// The reducer's error.
        #[source]
        source: ReduceError,
    },
    /// A value or update could not be encoded as JSON: a map whose keys are not
    /// strings, or a NaN or infinite float (JSON has no such number). Nothing of the
    /// step is stored; the thread stays at its last checkpoint.
    #[error("channel `{channel}`: cannot encode: {source}")]
    Encode {
        /// The channel.
        channel: &'static str,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// Stored JSON does not decode into the channel's type (for example, the schema
    /// changed since it was written). Never replaced by a default.
    #[error("channel `{channel}`: stored data does not match its type: {source}")]
    Decode {
        /// The channel.
        channel: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
    /// A stored channel the schema does not have.
    #[error(
        "unknown channel `{channel}`: this state has no such field (was the thread written by another version of the state?)"
    )]
    UnknownChannel {
        /// The name or index found.
        channel: String,
    },
    /// A [`State`] implementation returned a channel index that is not a position in
    /// its [`State::CHANNELS`] (a hand-written `apply` or `encode_update` with a wrong
    /// number). The engine refuses the step; nothing is stored.
    #[error(
        "state `{state}`: `{method}` returned channel #{index}, but CHANNELS has {count} \
         (channels are numbered from 0 in CHANNELS order)"
    )]
    ChannelOutOfRange {
        /// The state type.
        state: &'static str,
        /// The method that returned it (`State::apply` or `State::encode_update`).
        method: &'static str,
        /// The index returned.
        index: usize,
        /// How many channels [`State::CHANNELS`] names.
        count: usize,
    },
}

impl StateError {
    /// `UnknownChannel` for an index.
    pub fn unknown_index(channel: usize) -> Self {
        StateError::UnknownChannel {
            channel: format!("#{channel}"),
        }
    }
}

/// The name of channel `index` of `S`, or [`StateError::ChannelOutOfRange`] naming the
/// method that returned the index.
pub(crate) fn channel_name<S: State>(
    index: usize,
    method: &'static str,
) -> Result<&'static str, StateError> {
    S::CHANNELS
        .get(index)
        .copied()
        .ok_or_else(|| StateError::ChannelOutOfRange {
            state: std::any::type_name::<S>(),
            method,
            index,
            count: S::CHANNELS.len(),
        })
}

/// [`State::apply`], with every returned index checked against [`State::CHANNELS`].
pub(crate) fn apply<S: State>(
    state: &mut S,
    updates: Vec<S::Update>,
) -> Result<Vec<usize>, StateError> {
    let written = state.apply(updates)?;
    for &c in &written {
        channel_name::<S>(c, "State::apply")?;
    }
    Ok(written)
}

/// [`State::encode_update`], with every returned index checked against
/// [`State::CHANNELS`].
pub(crate) fn encode_update<S: State>(
    update: &S::Update,
) -> Result<Vec<(usize, Value)>, StateError> {
    let encoded = S::encode_update(update)?;
    for (c, _) in &encoded {
        channel_name::<S>(*c, "State::encode_update")?;
    }
    Ok(encoded)
}

mod finite;

/// Helpers for implementing [`State`] by hand (the derive calls the same ones): each
/// names the channel in its error.
pub mod support {
    use keel_reducer::Reducer;
    use serde::Serialize;
    use serde::de::DeserializeOwned;
    #[doc(hidden)]
    pub use serde_json::Value;

    use super::StateError;

    /// Folds `updates` into `value` with `reducer`, naming `channel` on error.
    pub fn reduce<R: Reducer>(
        reducer: &R,
        channel: &'static str,
        value: &mut R::Value,
        updates: Vec<R::Update>,
    ) -> Result<(), StateError> {
        reducer
            .reduce(value, updates)
            .map_err(|source| StateError::Reduce { channel, source })
    }

    /// Encodes to JSON, naming `channel` on error. A NaN or an infinity is refused:
    /// JSON has no such number, and the `null` it would be stored as could not be
    /// read back into the float.
    pub fn encode<T: Serialize>(channel: &'static str, v: &T) -> Result<Value, StateError> {
        let value =
            serde_json::to_value(v).map_err(|source| StateError::Encode { channel, source })?;
        // A non-finite float becomes `null`: only a value holding one needs the walk.
        if has_null(&value)
            && let Err(f) = super::finite::check(v)
        {
            return Err(StateError::Encode {
                channel,
                source: serde::ser::Error::custom(format_args!(
                    "{f} is not a number JSON can hold (it would be stored as null, which the float could not be read back from)"
                )),
            });
        }
        Ok(value)
    }

    fn has_null(v: &Value) -> bool {
        match v {
            Value::Null => true,
            Value::Array(items) => items.iter().any(has_null),
            Value::Object(map) => map.values().any(has_null),
            _ => false,
        }
    }

    /// Decodes from JSON, naming `channel` on error.
    pub fn decode<T: DeserializeOwned>(channel: &'static str, v: Value) -> Result<T, StateError> {
        serde_json::from_value(v).map_err(|source| StateError::Decode {
            channel: channel.to_owned(),
            source,
        })
    }

    /// Decodes each stored update of one delta.
    pub fn decode_all<T: DeserializeOwned>(
        channel: &'static str,
        vs: Vec<Value>,
    ) -> Result<Vec<T>, StateError> {
        vs.into_iter().map(|v| decode(channel, v)).collect()
    }
}
