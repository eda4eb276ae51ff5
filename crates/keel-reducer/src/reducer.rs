//! The [`Reducer`] trait and its error type.

/// How a state channel folds the writes of one superstep into its value.
///
/// A reducer is a pure function held in a value: given the channel's current value and
/// the updates written to it during one superstep (in the order the engine fixed, by
/// task path), it produces the next value. It never looks at anything else, so the same
/// value and the same updates always give the same result, and it needs no graph: any
/// loop that keeps state can use one.
///
/// Implementations fold updates in order and must leave `current` untouched when they
/// return an error: validate first, then mutate.
///
/// # Example
///
/// A reducer of your own needs [`Reducer::empty`] and [`Reducer::reduce`];
/// [`Reducer::apply`] comes for free.
///
/// ```
/// use keel_reducer::{ReduceError, Reducer};
///
/// /// Keeps the longest string written so far.
/// struct Longest;
///
/// impl Reducer for Longest {
///     type Value = String;
///     type Update = String;
///
///     fn empty(&self) -> String {
///         String::new()
///     }
///
///     fn reduce(&self, current: &mut String, updates: Vec<String>) -> Result<(), ReduceError> {
///         for u in updates {
///             if u.len() > current.len() {
///                 *current = u;
///             }
///         }
///         Ok(())
///     }
/// }
///
/// let mut v = Longest.empty();
/// Longest.reduce(&mut v, vec!["ab".into(), "abcd".into(), "abc".into()])?;
/// assert_eq!(v, "abcd");
/// assert_eq!(Longest.apply(v, "abcde".into())?, "abcde");
/// # Ok::<(), ReduceError>(())
/// ```
pub trait Reducer: Send + Sync + 'static {
    /// The channel's value.
    type Value: Clone + Send + Sync + 'static;
    /// One write to the channel.
    type Update: Send + 'static;

    /// The channel's value before any write.
    fn empty(&self) -> Self::Value;

    /// Fold one superstep's updates, in the given order, into `current`.
    ///
    /// On `Err`, `current` is unchanged (implementations validate before mutating).
    fn reduce(
        &self,
        current: &mut Self::Value,
        updates: Vec<Self::Update>,
    ) -> Result<(), ReduceError>;

    /// The pure `(current, update) -> new` form: [`Reducer::reduce`] with one update.
    ///
    /// ```
    /// use keel_reducer::{Append, Reducer};
    ///
    /// let v = Append::<u32>::new().apply(vec![1], vec![2, 3])?;
    /// assert_eq!(v, [1, 2, 3]);
    /// # Ok::<(), keel_reducer::ReduceError>(())
    /// ```
    fn apply(
        &self,
        current: Self::Value,
        update: Self::Update,
    ) -> Result<Self::Value, ReduceError> {
        let mut value = current;
        self.reduce(&mut value, vec![update])?;
        Ok(value)
    }
}

/// A marker for reducers whose batches may be split: reducing `a ++ b` in one call
/// gives the same result (or the same error) as reducing `a`, then `b`.
///
/// Every standard reducer folds its updates one after another and so has this property,
/// except [`LastValue`](crate::LastValue), which refuses two writes in one superstep.
/// `laws::check_split_batches` (with the `proptest` feature) checks it for a reducer
/// that claims it.
pub trait Associative: Reducer {}

/// Why a reducer refused a superstep's updates. The value it was given is unchanged.
///
/// ```
/// use keel_reducer::{LastValue, ReduceError, Reducer};
///
/// let mut v = 0;
/// let err = LastValue::<i32>::new().reduce(&mut v, vec![1, 2]).unwrap_err();
/// assert_eq!(err, ReduceError::InvalidUpdate { writes: 2 });
/// assert_eq!(v, 0);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// A [`LastValue`](crate::LastValue) channel received more than one write in one
    /// superstep (LangGraph's `InvalidUpdateError`).
    #[error(
        "a last-value channel can receive only one write per superstep, got {writes}; use a reducer that merges writes"
    )]
    InvalidUpdate {
        /// How many writes arrived.
        writes: usize,
    },
    /// [`AddMessages`](crate::AddMessages) was asked to remove an id the state does not
    /// hold.
    #[error("cannot remove message `{id}`: no message has that id")]
    UnknownMessageId {
        /// The id.
        id: String,
    },
    /// A list of messages given as a [`Messages`](crate::Messages) value has the same id
    /// twice.
    #[error("message id `{id}` appears more than once")]
    DuplicateMessageId {
        /// The id.
        id: String,
    },
    /// A list of messages given as a [`Messages`](crate::Messages) value has a message
    /// without an id.
    #[error("message {index} has no id")]
    MissingMessageId {
        /// Its position in the list.
        index: usize,
    },
    /// [`Sum`](crate::Sum) overflowed its integer type.
    #[error("the sum overflowed its type; the value is unchanged")]
    Overflow,
    /// A reducer outside this crate refused an update.
    #[error("{0}")]
    Custom(String),
}
