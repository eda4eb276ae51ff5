//! Law checks for reducers, and proptest strategies for messages and
//! [`AddMessages`] updates (feature `proptest`).
//!
//! Each `check_*` function takes a reducer, a value and updates, runs the reducer and
//! returns a [`LawViolation`] describing what went wrong, if anything. They work for any
//! [`Reducer`] whose value is `PartialEq + Debug`, so you can run them on your own
//! reducers with your own strategies. A `LawViolation` is an error, so it converts into
//! proptest's `TestCaseError` and `?` works inside `proptest!`:
//!
//! ```
//! use keel_reducer::laws;
//! use keel_reducer::{AddMessages, Sum};
//! use proptest::prelude::*;
//!
//! proptest! {
//!     #![proptest_config(ProptestConfig::with_cases(16))]
//!     fn sum_laws(start in any::<i16>(), a in prop::collection::vec(any::<i16>(), 0..4),
//!                 b in prop::collection::vec(any::<i16>(), 0..4)) {
//!         laws::check_determinism(&Sum::new(), &start, &a)?;
//!         laws::check_identity(&Sum::<i16>::new(), &start)?;
//!         laws::check_errors_are_atomic(&Sum::new(), &start, &a)?;
//!         laws::check_split_batches(&Sum::new(), &start, &a, &b)?;
//!     }
//!
//!     fn history_flush(state in laws::messages(8), msgs in prop::collection::vec(laws::message(), 0..4)) {
//!         laws::check_flush_idempotence(&state, msgs)?;
//!     }
//! }
//! # sum_laws();
//! # history_flush();
//! ```
//!
//! | law | check | holds for |
//! |---|---|---|
//! | same input, same output | [`check_determinism`] | every reducer |
//! | an empty update list changes nothing | [`check_identity`] | every reducer |
//! | an error leaves the value unchanged | [`check_errors_are_atomic`] | every reducer |
//! | `apply` is `reduce` with one update | [`check_apply_matches_reduce`] | every reducer |
//! | `reduce(a ++ b)` = `reduce(a)`; `reduce(b)` | [`check_split_batches`] | [`Associative`] reducers |
//! | an update applied twice = once | [`check_idempotent_update`] | e.g. [`SetUnion`](crate::SetUnion), [`MergeMap`](crate::MergeMap), [`Max`](crate::Max) |
//! | `replace_all` twice = once | [`check_flush_idempotence`] | [`AddMessages`] |
//! | the value never exceeds a bound | [`check_bounded_growth`], [`check_keep_last_bounded`] | [`KeepLast`] |

use std::fmt::{self, Debug};

use keel_message::{Content, ContentPart, Message, Role, ToolArguments, ToolCall};
use proptest::prelude::*;
use serde_json::json;

use crate::{
    AddMessages, AddMessagesUpdate, Associative, KeepLast, MessageOp, Messages, ReduceError,
    Reducer,
};

/// A law a reducer broke, with the inputs' effect that shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LawViolation {
    /// The law's name, e.g. `"determinism"`.
    pub law: &'static str,
    /// What differed.
    pub details: String,
}

impl fmt::Display for LawViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "reducer law `{}` broken: {}", self.law, self.details)
    }
}

impl std::error::Error for LawViolation {}

fn violation(law: &'static str, details: String) -> Result<(), LawViolation> {
    Err(LawViolation { law, details })
}

/// Reduces a clone of `current`, returning the outcome and the value.
fn run<R: Reducer>(
    r: &R,
    current: &R::Value,
    updates: Vec<R::Update>,
) -> (Result<(), ReduceError>, R::Value) {
    let mut v = current.clone();
    let res = r.reduce(&mut v, updates);
    (res, v)
}

/// Reducing the same value with the same updates twice gives the same result (value or
/// error).
pub fn check_determinism<R>(
    r: &R,
    current: &R::Value,
    updates: &[R::Update],
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + Debug,
    R::Update: Clone,
{
    let first = run(r, current, updates.to_vec());
    let second = run(r, current, updates.to_vec());
    if first != second {
        return violation(
            "determinism",
            format!("first run gave {first:?}, second gave {second:?}"),
        );
    }
    Ok(())
}

/// Reducing with no update succeeds and changes nothing.
pub fn check_identity<R>(r: &R, current: &R::Value) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + Debug,
{
    let (res, v) = run(r, current, Vec::new());
    if let Err(e) = res {
        return violation("identity", format!("an empty update list failed: {e}"));
    }
    if v != *current {
        return violation(
            "identity",
            format!("an empty update list changed {current:?} into {v:?}"),
        );
    }
    Ok(())
}

/// When `reduce` fails, the value is exactly what it was.
pub fn check_errors_are_atomic<R>(
    r: &R,
    current: &R::Value,
    updates: &[R::Update],
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + Debug,
    R::Update: Clone,
{
    let (res, v) = run(r, current, updates.to_vec());
    if let Err(e) = res
        && v != *current
    {
        return violation(
            "atomic errors",
            format!("failed with `{e}` but changed {current:?} into {v:?}"),
        );
    }
    Ok(())
}

/// [`Reducer::apply`] gives what [`Reducer::reduce`] with that one update gives.
pub fn check_apply_matches_reduce<R>(
    r: &R,
    current: &R::Value,
    update: &R::Update,
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + Debug,
    R::Update: Clone,
{
    let applied = r.apply(current.clone(), update.clone());
    let (res, v) = run(r, current, vec![update.clone()]);
    let reduced = res.map(|()| v);
    if applied != reduced {
        return violation(
            "apply matches reduce",
            format!("apply gave {applied:?}, reduce gave {reduced:?}"),
        );
    }
    Ok(())
}

/// For an [`Associative`] reducer: reducing `a ++ b` in one call gives the same value as
/// reducing `a` then `b`; when the single call fails, the split one fails with the same
/// error.
pub fn check_split_batches<R>(
    r: &R,
    current: &R::Value,
    a: &[R::Update],
    b: &[R::Update],
) -> Result<(), LawViolation>
where
    R: Associative,
    R::Value: PartialEq + Debug,
    R::Update: Clone,
{
    let mut all = a.to_vec();
    all.extend_from_slice(b);
    let (batch_res, batch) = run(r, current, all);
    let mut split = current.clone();
    let split_res = r
        .reduce(&mut split, a.to_vec())
        .and_then(|()| r.reduce(&mut split, b.to_vec()));
    match (batch_res, split_res) {
        (Ok(()), Ok(())) if batch == split => Ok(()),
        (Ok(()), Ok(())) => violation(
            "split batches",
            format!("one call gave {batch:?}, two calls gave {split:?}"),
        ),
        (Err(x), Err(y)) if x == y => Ok(()),
        (x, y) => violation(
            "split batches",
            format!("one call returned {x:?}, two calls returned {y:?}"),
        ),
    }
}

/// Applying `update` to the result of applying it gives that result again (when the
/// first application succeeds).
pub fn check_idempotent_update<R>(
    r: &R,
    current: &R::Value,
    update: &R::Update,
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + Debug,
    R::Update: Clone,
{
    let Ok(once) = r.apply(current.clone(), update.clone()) else {
        return Ok(());
    };
    match r.apply(once.clone(), update.clone()) {
        Ok(twice) if twice == once => Ok(()),
        other => violation(
            "idempotent update",
            format!("once gave {once:?}, twice gave {other:?}"),
        ),
    }
}

/// Compaction's flush, [`AddMessagesUpdate::replace_all`], applied twice leaves the
/// history it leaves once, and that history is exactly the replacement (ids assigned,
/// a repeated id kept once at its first position with its last content).
pub fn check_flush_idempotence(
    current: &Messages,
    replacement: Vec<Message>,
) -> Result<(), LawViolation> {
    let flush = AddMessagesUpdate::replace_all(replacement);
    check_idempotent_update(&AddMessages, current, &flush)?;
    let from_scratch = AddMessages.apply(Messages::new(), flush.clone());
    let flushed = AddMessages.apply(current.clone(), flush);
    if flushed != from_scratch {
        return violation(
            "flush idempotence",
            format!("flushing {current:?} gave {flushed:?}, not {from_scratch:?}"),
        );
    }
    Ok(())
}

/// After a successful `reduce`, `len(value) <= bound`.
pub fn check_bounded_growth<R, F>(
    r: &R,
    current: &R::Value,
    updates: &[R::Update],
    bound: usize,
    len: F,
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Update: Clone,
    F: Fn(&R::Value) -> usize,
{
    let (res, v) = run(r, current, updates.to_vec());
    if res.is_ok() && len(&v) > bound {
        return violation(
            "bounded growth",
            format!("length {} exceeds the bound {bound}", len(&v)),
        );
    }
    Ok(())
}

/// [`KeepLast`] never holds more than its limit, and holds the last items written.
pub fn check_keep_last_bounded<T>(
    r: &KeepLast<T>,
    current: &std::collections::VecDeque<T>,
    updates: &[Vec<T>],
) -> Result<(), LawViolation>
where
    T: Clone + PartialEq + Debug + Send + Sync + 'static,
{
    check_bounded_growth(r, current, updates, r.limit(), |v| v.len())?;
    let (_, v) = run(r, current, updates.to_vec());
    let all: Vec<&T> = current.iter().chain(updates.iter().flatten()).collect();
    let expected = all
        .get(all.len().saturating_sub(r.limit())..)
        .unwrap_or_default();
    if !v.iter().eq(expected.iter().copied()) {
        return violation(
            "keep last",
            format!(
                "kept {v:?}, expected the last {} items {expected:?}",
                r.limit()
            ),
        );
    }
    Ok(())
}

/// Ids the message strategies draw from: `m0` to `m23`. Histories and updates share
/// them, so updates replace and remove existing messages often.
pub const ID_POOL: usize = 24;

/// An id from the shared pool.
pub fn pool_id() -> impl Strategy<Value = String> {
    (0..ID_POOL).prop_map(|i| format!("m{i}"))
}

fn content() -> impl Strategy<Value = Content> {
    prop_oneof![
        4 => "[a-z ]{0,12}".prop_map(Content::Text),
        1 => prop::collection::vec(
            prop_oneof![
                "[a-z]{0,6}".prop_map(ContentPart::text),
                "[a-z]{1,6}".prop_map(|s| ContentPart::Image {
                    url: format!("https://example.com/{s}.png"),
                    detail: None,
                }),
            ],
            0..3,
        )
        .prop_map(Content::Parts),
    ]
}

fn tool_call() -> impl Strategy<Value = ToolCall> {
    ("c[0-9]{1,2}", "[a-z_]{1,8}", any::<bool>(), any::<u8>()).prop_map(|(id, name, valid, n)| {
        let mut call = ToolCall::new(id, name, json!({"n": n}));
        if !valid {
            call.arguments = ToolArguments::Invalid(format!("{{n: {n}"));
        }
        call
    })
}

/// A message of any role, without id: text or multi-part content, tool calls on
/// assistant messages, a `tool_call_id` on tool messages, sometimes a name.
pub fn message() -> impl Strategy<Value = Message> {
    (
        prop_oneof![
            Just(Role::System),
            Just(Role::User),
            Just(Role::Assistant),
            Just(Role::Tool)
        ],
        content(),
        prop::collection::vec(tool_call(), 0..3),
        "c[0-9]{1,2}",
        prop::option::of("[a-z]{1,6}"),
    )
        .prop_map(|(role, content, calls, call_id, name)| {
            let mut m = Message::new(role, content);
            m.name = name;
            match role {
                Role::Assistant => m.tool_calls = calls,
                Role::Tool => m.tool_call_id = Some(call_id),
                Role::System | Role::User => {}
            }
            m
        })
}

/// A message with an id from the shared pool.
pub fn message_with_pool_id() -> impl Strategy<Value = Message> {
    (message(), pool_id()).prop_map(|(m, id)| m.with_id(id))
}

/// A history of at most `max_len` messages with distinct ids from the shared pool, in
/// any order.
pub fn messages(max_len: usize) -> impl Strategy<Value = Messages> {
    prop::collection::btree_set(0..ID_POOL, 0..=max_len.min(ID_POOL))
        .prop_flat_map(|ids| {
            let n = ids.len();
            (Just(ids), prop::collection::vec(message(), n..=n))
        })
        .prop_flat_map(|(ids, msgs)| {
            let list: Vec<Message> = ids
                .into_iter()
                .zip(msgs)
                .map(|(i, m)| m.with_id(format!("m{i}")))
                .collect();
            Just(list).prop_shuffle()
        })
        .prop_map(|list| Messages::try_from(list).unwrap_or_default())
}

/// One operation: mostly upserts (of pool ids, replacing or adding, and of fresh ids
/// `f…`), some removals of pool ids (which may not exist: an error case), and rarely
/// a remove-all.
pub fn message_op() -> impl Strategy<Value = MessageOp> {
    prop_oneof![
        5 => message_with_pool_id().prop_map(MessageOp::Upsert),
        3 => (message(), any::<u32>()).prop_map(|(m, n)| MessageOp::Upsert(m.with_id(format!("f{n}")))),
        3 => pool_id().prop_map(MessageOp::Remove),
        1 => Just(MessageOp::RemoveAll),
    ]
}

/// An update of at most `max_ops` operations.
pub fn add_messages_update(max_ops: usize) -> impl Strategy<Value = AddMessagesUpdate> {
    prop::collection::vec(message_op(), 0..=max_ops).prop_map(AddMessagesUpdate::from_ops)
}

/// A superstep's worth of updates: at most `max_updates` of at most `max_ops` each.
pub fn add_messages_updates(
    max_updates: usize,
    max_ops: usize,
) -> impl Strategy<Value = Vec<AddMessagesUpdate>> {
    prop::collection::vec(add_messages_update(max_ops), 0..=max_updates)
}
