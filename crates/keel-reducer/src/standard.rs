//! The standard reducers for plain values: last value, append, sum, max/min, set union,
//! map merge, keep-last-n.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::marker::PhantomData;

use crate::{Associative, ReduceError, Reducer};

/// Unit-like reducers generic over their item type: `new()`, `Default`, `Clone`, `Copy`,
/// `Debug` without bounds on `T` (a derive would demand `T: Default` and so on).
macro_rules! unit_reducer {
    ($name:ident) => {
        unit_reducer!($name<T>);
    };
    ($name:ident<$($t:ident),+>) => {
        impl<$($t),+> $name<$($t),+> {
            /// The reducer (it holds no data).
            pub const fn new() -> Self {
                $name(PhantomData)
            }
        }

        impl<$($t),+> Default for $name<$($t),+> {
            fn default() -> Self {
                Self::new()
            }
        }

        impl<$($t),+> Clone for $name<$($t),+> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<$($t),+> Copy for $name<$($t),+> {}

        impl<$($t),+> fmt::Debug for $name<$($t),+> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(stringify!($name))
            }
        }
    };
}

/// Each write replaces the value; two or more writes in one superstep are an error
/// ([`ReduceError::InvalidUpdate`]), as in LangGraph's `LastValue` channel: which one
/// should win would depend on scheduling.
///
/// The value before any write is `T::default()`; use `LastValue<Option<T>>` to tell
/// "never written" apart.
///
/// ```
/// use keel_reducer::{LastValue, ReduceError, Reducer};
///
/// let r = LastValue::<String>::new();
/// let mut v = r.empty();
/// r.reduce(&mut v, vec!["plan".into()])?;
/// assert_eq!(v, "plan");
/// r.reduce(&mut v, vec![])?; // no write: unchanged
/// assert_eq!(v, "plan");
/// assert!(r.reduce(&mut v, vec!["a".into(), "b".into()]).is_err());
/// assert_eq!(v, "plan");
/// # Ok::<(), ReduceError>(())
/// ```
pub struct LastValue<T>(PhantomData<fn() -> T>);
unit_reducer!(LastValue);

impl<T> Reducer for LastValue<T>
where
    T: Clone + Default + Send + Sync + 'static,
{
    type Value = T;
    type Update = T;

    fn empty(&self) -> T {
        T::default()
    }

    fn reduce(&self, current: &mut T, mut updates: Vec<T>) -> Result<(), ReduceError> {
        if updates.len() > 1 {
            return Err(ReduceError::InvalidUpdate {
                writes: updates.len(),
            });
        }
        if let Some(v) = updates.pop() {
            *current = v;
        }
        Ok(())
    }
}

/// Appends every update's items, in order.
///
/// ```
/// use keel_reducer::{Append, Reducer};
///
/// let r = Append::<&str>::new();
/// let mut log = r.empty();
/// r.reduce(&mut log, vec![vec!["a"], vec!["b", "c"]])?;
/// assert_eq!(log, ["a", "b", "c"]);
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct Append<T>(PhantomData<fn() -> T>);
unit_reducer!(Append);

impl<T> Reducer for Append<T>
where
    T: Clone + Send + Sync + 'static,
{
    type Value = Vec<T>;
    type Update = Vec<T>;

    fn empty(&self) -> Vec<T> {
        Vec::new()
    }

    fn reduce(&self, current: &mut Vec<T>, updates: Vec<Vec<T>>) -> Result<(), ReduceError> {
        current.reserve(updates.iter().map(Vec::len).sum());
        for u in updates {
            current.extend(u);
        }
        Ok(())
    }
}

impl<T: Clone + Send + Sync + 'static> Associative for Append<T> {}

/// A number [`Sum`] can add: integers refuse to overflow, floats add as IEEE does.
pub trait Summand: Clone + Default + Send + Sync + 'static {
    /// `self + rhs`, or `None` on overflow.
    fn checked_sum(self, rhs: Self) -> Option<Self>;
}

macro_rules! summand_int {
    ($($t:ty),*) => {$(
        impl Summand for $t {
            fn checked_sum(self, rhs: Self) -> Option<Self> {
                self.checked_add(rhs)
            }
        }
    )*};
}
summand_int!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize
);

impl Summand for f32 {
    fn checked_sum(self, rhs: Self) -> Option<Self> {
        Some(self + rhs)
    }
}

impl Summand for f64 {
    fn checked_sum(self, rhs: Self) -> Option<Self> {
        Some(self + rhs)
    }
}

impl Summand for std::time::Duration {
    fn checked_sum(self, rhs: Self) -> Option<Self> {
        self.checked_add(rhs)
    }
}

/// Adds every update to the value (starting from zero). Integer overflow is
/// [`ReduceError::Overflow`], never a wrap or a panic.
///
/// ```
/// use keel_reducer::{ReduceError, Reducer, Sum};
///
/// let tokens = Sum::<u64>::new();
/// assert_eq!(tokens.apply(100, 23)?, 123);
///
/// let mut small = 250u8;
/// let err = Sum::<u8>::new().reduce(&mut small, vec![3, 3]).unwrap_err();
/// assert_eq!(err, ReduceError::Overflow);
/// assert_eq!(
///     err.to_string(),
///     "the sum overflowed its type; the value is unchanged"
/// );
/// assert_eq!(small, 250);
/// # Ok::<(), ReduceError>(())
/// ```
pub struct Sum<T>(PhantomData<fn() -> T>);
unit_reducer!(Sum);

impl<T: Summand> Reducer for Sum<T> {
    type Value = T;
    type Update = T;

    fn empty(&self) -> T {
        T::default()
    }

    fn reduce(&self, current: &mut T, updates: Vec<T>) -> Result<(), ReduceError> {
        let mut total = current.clone();
        for u in updates {
            total = total.checked_sum(u).ok_or(ReduceError::Overflow)?;
        }
        *current = total;
        Ok(())
    }
}

impl<T: Summand> Associative for Sum<T> {}

/// Keeps the greatest value written; `None` until the first write.
///
/// ```
/// use keel_reducer::{Max, Reducer};
///
/// let r = Max::<u32>::new();
/// let mut best = r.empty();
/// r.reduce(&mut best, vec![3, 9, 4])?;
/// assert_eq!(best, Some(9));
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct Max<T>(PhantomData<fn() -> T>);
unit_reducer!(Max);

impl<T: Ord + Clone + Send + Sync + 'static> Reducer for Max<T> {
    type Value = Option<T>;
    type Update = T;

    fn empty(&self) -> Option<T> {
        None
    }

    fn reduce(&self, current: &mut Option<T>, updates: Vec<T>) -> Result<(), ReduceError> {
        for u in updates {
            if current.as_ref().is_none_or(|c| u > *c) {
                *current = Some(u);
            }
        }
        Ok(())
    }
}

impl<T: Ord + Clone + Send + Sync + 'static> Associative for Max<T> {}

/// Keeps the least value written; `None` until the first write.
///
/// ```
/// use keel_reducer::{Min, Reducer};
///
/// assert_eq!(Min::<i32>::new().apply(Some(2), -5)?, Some(-5));
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct Min<T>(PhantomData<fn() -> T>);
unit_reducer!(Min);

impl<T: Ord + Clone + Send + Sync + 'static> Reducer for Min<T> {
    type Value = Option<T>;
    type Update = T;

    fn empty(&self) -> Option<T> {
        None
    }

    fn reduce(&self, current: &mut Option<T>, updates: Vec<T>) -> Result<(), ReduceError> {
        for u in updates {
            if current.as_ref().is_none_or(|c| u < *c) {
                *current = Some(u);
            }
        }
        Ok(())
    }
}

impl<T: Ord + Clone + Send + Sync + 'static> Associative for Min<T> {}

/// The union of every set written.
///
/// ```
/// use std::collections::BTreeSet;
/// use keel_reducer::{Reducer, SetUnion};
///
/// let r = SetUnion::<&str>::new();
/// let tools = r.apply(BTreeSet::from(["ls"]), BTreeSet::from(["cat", "ls"]))?;
/// assert_eq!(tools, BTreeSet::from(["cat", "ls"]));
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct SetUnion<T>(PhantomData<fn() -> T>);
unit_reducer!(SetUnion);

impl<T: Ord + Clone + Send + Sync + 'static> Reducer for SetUnion<T> {
    type Value = BTreeSet<T>;
    type Update = BTreeSet<T>;

    fn empty(&self) -> BTreeSet<T> {
        BTreeSet::new()
    }

    fn reduce(
        &self,
        current: &mut BTreeSet<T>,
        updates: Vec<BTreeSet<T>>,
    ) -> Result<(), ReduceError> {
        for mut u in updates {
            current.append(&mut u);
        }
        Ok(())
    }
}

impl<T: Ord + Clone + Send + Sync + 'static> Associative for SetUnion<T> {}

/// Merges maps key by key: each key written takes the value of its last write, and
/// keys no write names keep theirs (LangGraph's `operator.or_` on a dict channel).
///
/// A superstep's writes are folded in task order, so when two tasks write one key the
/// later task's value wins, the same in every run. To remove a key, make the value an
/// `Option` and write `None`, or keep the map in a [`LastValue`] channel.
///
/// ```
/// use std::collections::BTreeMap;
/// use keel_reducer::{MergeMap, Reducer};
///
/// let r = MergeMap::<&str, u32>::new();
/// let mut seen = r.empty();
/// // Two tasks of one superstep report what they found.
/// r.reduce(&mut seen, vec![
///     BTreeMap::from([("src", 12), ("docs", 3)]),
///     BTreeMap::from([("tests", 7), ("docs", 4)]),
/// ])?;
/// assert_eq!(seen, BTreeMap::from([("docs", 4), ("src", 12), ("tests", 7)]));
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct MergeMap<K, V>(PhantomData<fn() -> (K, V)>);
unit_reducer!(MergeMap<K, V>);

impl<K, V> Reducer for MergeMap<K, V>
where
    K: Ord + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    type Value = BTreeMap<K, V>;
    type Update = BTreeMap<K, V>;

    fn empty(&self) -> BTreeMap<K, V> {
        BTreeMap::new()
    }

    fn reduce(
        &self,
        current: &mut BTreeMap<K, V>,
        updates: Vec<BTreeMap<K, V>>,
    ) -> Result<(), ReduceError> {
        for u in updates {
            current.extend(u);
        }
        Ok(())
    }
}

impl<K, V> Associative for MergeMap<K, V>
where
    K: Ord + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
}

/// Appends like [`Append`] but keeps only the last `n` items: the value never grows
/// past `n`.
///
/// ```
/// use keel_reducer::{KeepLast, Reducer};
///
/// let recent = KeepLast::<u32>::new(3);
/// let mut v = recent.empty();
/// recent.reduce(&mut v, vec![vec![1, 2], vec![3, 4, 5]])?;
/// assert_eq!(v, [3, 4, 5]);
/// # Ok::<(), keel_reducer::ReduceError>(())
/// ```
pub struct KeepLast<T> {
    n: usize,
    item: PhantomData<fn() -> T>,
}

impl<T> KeepLast<T> {
    /// A reducer keeping the last `n` items (`n == 0` keeps nothing).
    pub const fn new(n: usize) -> Self {
        KeepLast {
            n,
            item: PhantomData,
        }
    }

    /// The bound `n`.
    pub const fn limit(&self) -> usize {
        self.n
    }
}

impl<T> Clone for KeepLast<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for KeepLast<T> {}

impl<T> fmt::Debug for KeepLast<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeepLast").field(&self.n).finish()
    }
}

impl<T: Clone + Send + Sync + 'static> Reducer for KeepLast<T> {
    type Value = VecDeque<T>;
    type Update = Vec<T>;

    fn empty(&self) -> VecDeque<T> {
        VecDeque::new()
    }

    fn reduce(&self, current: &mut VecDeque<T>, updates: Vec<Vec<T>>) -> Result<(), ReduceError> {
        let incoming: usize = updates.iter().map(Vec::len).sum();
        if incoming == 0 {
            // Nothing written changes nothing, even a value longer than `n` that came
            // from elsewhere (the identity law).
            return Ok(());
        }
        // Items that would be pushed out again within this call are skipped outright.
        let mut skip = incoming.saturating_sub(self.n);
        let keep_old = self.n.saturating_sub(incoming.min(self.n));
        let drop_old = current.len().saturating_sub(keep_old);
        current.drain(..drop_old);
        for u in updates {
            for item in u {
                if skip > 0 {
                    skip -= 1;
                } else {
                    current.push_back(item);
                }
            }
        }
        Ok(())
    }
}

impl<T: Clone + Send + Sync + 'static> Associative for KeepLast<T> {}
