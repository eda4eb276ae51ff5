//! Checkpoint ids and thread keys.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The id of one checkpoint: a UUID v7 in its canonical text form (lowercase, hyphenated).
///
/// UUID v7 starts with a millisecond Unix timestamp, so ids are time-ordered, and
/// because the text form is fixed-width lowercase hex, comparing ids as strings
/// (`Ord`) compares them in time. Ids made by one process are strictly increasing:
/// when two are made in the same millisecond (or the clock steps back), the later one
/// still sorts after.
///
/// Savers require that, within one thread and namespace, every new checkpoint's id
/// sorts after the current newest one. A writer whose clock may lag another machine's
/// makes its id with [`CheckpointId::new_after`] the head it expects.
///
/// ```
/// use keel_checkpoint::CheckpointId;
///
/// let a = CheckpointId::new();
/// let b = CheckpointId::new();
/// assert!(a < b);
/// let parsed: CheckpointId = a.as_str().parse()?;
/// assert_eq!(parsed, a);
/// assert_eq!(serde_json::to_value(&a)?, serde_json::json!(a.as_str()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CheckpointId(Arc<str>);

/// The last id this process made, as a `u128`; new ids are made strictly greater.
static LAST_ID: Mutex<u128> = Mutex::new(0);

const TS_SHIFT: u32 = 80;
const RAND_B_BITS: u32 = 62;
const RAND_B_MASK: u128 = (1 << RAND_B_BITS) - 1;
const RAND_A_MASK: u128 = 0xfff;
const COUNTER_BITS: u32 = 74;
const COUNTER_MAX: u128 = (1 << COUNTER_BITS) - 1;

impl CheckpointId {
    /// A fresh id, later than every id this process made before.
    pub fn new() -> Self {
        Self::generate(None)
    }

    /// A fresh id that sorts after `previous` as well as after every id this process
    /// made before, even if this machine's clock is behind the one that made `previous`.
    ///
    /// ```
    /// use keel_checkpoint::CheckpointId;
    ///
    /// // An id from a machine whose clock is far ahead of ours.
    /// let future: CheckpointId = "7fffffff-ffff-7fff-bfff-ffffffffffff".parse()?;
    /// let next = CheckpointId::new_after(&future);
    /// assert!(next > future);
    /// # Ok::<(), keel_checkpoint::ParseCheckpointIdError>(())
    /// ```
    pub fn new_after(previous: &CheckpointId) -> Self {
        Self::generate(Some(previous))
    }

    fn generate(previous: Option<&CheckpointId>) -> Self {
        let random = Uuid::new_v4().into_bytes();
        let mut bytes = [0u8; 10];
        bytes.copy_from_slice(&random[..10]);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        let mut candidate = uuid::Builder::from_unix_timestamp_millis(now, &bytes)
            .into_uuid()
            .as_u128();
        // A random step in 1..=2^32 keeps bumped ids unguessable and unlikely to collide
        // with another process bumping from the same id.
        let step = u128::from(u32::from_le_bytes([
            random[10], random[11], random[12], random[13],
        ])) + 1;

        let mut last = LAST_ID.lock().unwrap_or_else(|e| e.into_inner());
        let mut floor = *last;
        if let Some(previous) = previous {
            floor = floor.max(previous.as_u128());
        }
        if candidate <= floor {
            candidate = bump(floor, step);
        }
        *last = candidate;
        drop(last);
        Self(Uuid::from_u128(candidate).hyphenated().to_string().into())
    }

    /// The id as text (a lowercase hyphenated UUID v7).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The millisecond Unix timestamp the id starts with.
    ///
    /// ```
    /// use keel_checkpoint::CheckpointId;
    ///
    /// let id: CheckpointId = "01890a5d-ac96-774b-bcce-b302099a8057".parse()?;
    /// assert_eq!(id.timestamp_millis(), 1_688_096_058_518);
    /// # Ok::<(), keel_checkpoint::ParseCheckpointIdError>(())
    /// ```
    pub fn timestamp_millis(&self) -> u64 {
        u64::try_from(self.as_u128() >> TS_SHIFT).unwrap_or(u64::MAX)
    }

    /// The smallest id whose timestamp is `millis` (every random bit zero): an id made
    /// before that millisecond sorts below it, any id made in it or later does not.
    pub(crate) fn floor_at(millis: u64) -> Self {
        let millis = millis.min((1 << 48) - 1);
        let uuid = uuid::Builder::from_unix_timestamp_millis(millis, &[0; 10]).into_uuid();
        Self(uuid.hyphenated().to_string().into())
    }

    fn as_u128(&self) -> u128 {
        Uuid::parse_str(&self.0).map(|u| u.as_u128()).unwrap_or(0)
    }
}

/// The smallest UUID v7 value greater than `floor` by about `step` (`floor` is a v7 id
/// or 0): the 74 random bits are treated as a counter; on overflow the timestamp moves
/// on by one millisecond.
fn bump(floor: u128, step: u128) -> u128 {
    let ts = floor >> TS_SHIFT;
    let counter = (((floor >> 64) & RAND_A_MASK) << RAND_B_BITS) | (floor & RAND_B_MASK);
    let (ts, counter) = if counter + step > COUNTER_MAX {
        (ts + 1, step - 1)
    } else {
        (ts, counter + step)
    };
    let ts = ts.min((1 << 48) - 1);
    (ts << TS_SHIFT)
        | (0x7 << 76)
        | ((counter >> RAND_B_BITS) << 64)
        | (0b10 << RAND_B_BITS)
        | (counter & RAND_B_MASK)
}

impl Default for CheckpointId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for CheckpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for CheckpointId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// The text given to [`CheckpointId::from_str`] is not a UUID v7.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a UUID v7 checkpoint id: {text:?}")]
#[non_exhaustive]
pub struct ParseCheckpointIdError {
    /// The text that was refused.
    pub text: String,
}

impl FromStr for CheckpointId {
    type Err = ParseCheckpointIdError;

    /// Accepts any textual form of a UUID v7 and keeps its canonical lowercase
    /// hyphenated form (so string order stays time order).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match Uuid::parse_str(text) {
            Ok(uuid) if uuid.get_version_num() == 7 => {
                Ok(Self(uuid.hyphenated().to_string().into()))
            }
            _ => Err(ParseCheckpointIdError {
                text: text.to_owned(),
            }),
        }
    }
}

impl TryFrom<String> for CheckpointId {
    type Error = ParseCheckpointIdError;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<CheckpointId> for String {
    fn from(id: CheckpointId) -> Self {
        id.0.to_string()
    }
}

/// Which checkpoint history: a thread id and a namespace within it.
///
/// The root graph of a thread uses the empty namespace; a subgraph running inside it
/// uses its own namespace, with its own history and its own head. Deleting a thread
/// deletes all its namespaces.
///
/// ```
/// use keel_checkpoint::ThreadKey;
///
/// let root = ThreadKey::new("ticket-42");
/// let sub = root.clone().with_ns("research:1");
/// assert_eq!(root.ns, "");
/// assert_eq!(sub.thread_id, "ticket-42");
/// assert_eq!(sub.to_string(), "ticket-42/research:1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ThreadKey {
    /// The thread (one conversation or task run).
    pub thread_id: String,
    /// The namespace within the thread; `""` is the root graph.
    pub ns: String,
}

impl ThreadKey {
    /// The root namespace of `thread_id`.
    pub fn new(thread_id: impl Into<String>) -> Self {
        Self {
            thread_id: thread_id.into(),
            ns: String::new(),
        }
    }

    /// The same thread in namespace `ns`.
    pub fn with_ns(mut self, ns: impl Into<String>) -> Self {
        self.ns = ns.into();
        self
    }

    /// Why the thread id is not one every keel saver stores alike, if it is not: it
    /// is empty or only whitespace, holds a NUL (which PostgreSQL text cannot store),
    /// or is longer than [`MAX_THREAD_ID_BYTES`]. Savers take any id they can store;
    /// keel-graph refuses these before a run, so an id that works on SQLite in
    /// development works on PostgreSQL in production.
    ///
    /// ```
    /// use keel_checkpoint::ThreadKey;
    ///
    /// assert!(ThreadKey::new("ticket-42").portability_problem().is_none());
    /// assert!(ThreadKey::new("  ").portability_problem().is_some());
    /// assert!(ThreadKey::new("a\0b").portability_problem().is_some());
    /// ```
    pub fn portability_problem(&self) -> Option<String> {
        let id = &self.thread_id;
        if id.trim().is_empty() {
            return Some("it is empty or only whitespace".to_owned());
        }
        if id.contains('\0') {
            return Some(
                "it holds a NUL character (U+0000), which PostgreSQL cannot store".to_owned(),
            );
        }
        if id.len() > MAX_THREAD_ID_BYTES {
            return Some(format!(
                "it is {} bytes, over the {MAX_THREAD_ID_BYTES} every saver stores",
                id.len()
            ));
        }
        None
    }
}

/// The longest thread id, in bytes, that every keel saver stores (PostgreSQL's is part
/// of an index key).
pub const MAX_THREAD_ID_BYTES: usize = 1024;

impl fmt::Display for ThreadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ns.is_empty() {
            f.write_str(&self.thread_id)
        } else {
            write!(f, "{}/{}", self.thread_id, self.ns)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn ids_made_in_a_burst_strictly_increase() {
        let ids: Vec<CheckpointId> = (0..10_000).map(|_| CheckpointId::new()).collect();
        for pair in ids.windows(2) {
            assert!(pair[0] < pair[1], "{} !< {}", pair[0], pair[1]);
        }
    }

    #[test]
    fn ids_are_canonical_v7() {
        let id = CheckpointId::new();
        let uuid = Uuid::parse_str(id.as_str()).unwrap();
        assert_eq!(uuid.get_version_num(), 7);
        assert_eq!(id.as_str(), uuid.hyphenated().to_string());
        assert_eq!(id.as_str().len(), 36);
    }

    #[test]
    fn parse_normalizes_and_refuses_other_versions() {
        let id = CheckpointId::new();
        let upper = id.as_str().to_uppercase();
        assert_eq!(upper.parse::<CheckpointId>().unwrap(), id);
        let simple = Uuid::parse_str(id.as_str()).unwrap().simple().to_string();
        assert_eq!(simple.parse::<CheckpointId>().unwrap(), id);
        let v4 = Uuid::new_v4().to_string();
        assert!(v4.parse::<CheckpointId>().is_err());
        assert!("not an id".parse::<CheckpointId>().is_err());
        assert!(serde_json::from_str::<CheckpointId>(&format!("\"{v4}\"")).is_err());
    }

    #[test]
    fn serde_is_the_plain_string() {
        let id = CheckpointId::new();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<CheckpointId>(&json).unwrap(), id);
    }

    #[test]
    fn new_after_beats_a_clock_far_ahead() {
        let ahead = "7fffffff-ffff-7fff-bfff-ffffffffffff".parse().unwrap();
        let next = CheckpointId::new_after(&ahead);
        assert!(next > ahead);
        assert_eq!(Uuid::parse_str(next.as_str()).unwrap().get_version_num(), 7);
        // and ids made afterwards stay above it
        assert!(CheckpointId::new() > next);
    }

    #[test]
    fn bump_carries_into_the_timestamp() {
        let full = (5u128 << TS_SHIFT) | (0x7 << 76) | (0xfff << 64) | (0b10 << 62) | RAND_B_MASK;
        let next = bump(full, 1);
        assert!(next > full);
        assert_eq!(next >> TS_SHIFT, 6);
        assert_eq!(Uuid::from_u128(next).get_version_num(), 7);
        assert_eq!(Uuid::from_u128(next).get_variant(), uuid::Variant::RFC4122);
    }

    #[test]
    fn floor_at_splits_ids_by_millisecond() {
        let floor = CheckpointId::floor_at(1_688_096_058_518);
        assert_eq!(floor.as_str(), "01890a5d-ac96-7000-8000-000000000000");
        assert_eq!(floor.timestamp_millis(), 1_688_096_058_518);
        assert_eq!(floor.as_str().parse::<CheckpointId>().unwrap(), floor);
        let same_ms: CheckpointId = "01890a5d-ac96-774b-bcce-b302099a8057".parse().unwrap();
        let ms_before: CheckpointId = "01890a5d-ac95-7fff-bfff-ffffffffffff".parse().unwrap();
        assert!(ms_before < floor && floor < same_ms);
        assert!(CheckpointId::floor_at(0) <= CheckpointId::floor_at(0));
        assert_eq!(
            CheckpointId::floor_at(u64::MAX).timestamp_millis(),
            (1 << 48) - 1
        );
    }

    #[test]
    fn thread_key_display() {
        assert_eq!(ThreadKey::new("t").to_string(), "t");
        assert_eq!(ThreadKey::new("t").with_ns("a").to_string(), "t/a");
    }
}
