//! keel's standard reducers pass the laws of `keel_reducer::laws`, and the law checks
//! catch reducers that break them. Runs with `--features proptest` (or `--all-features`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_message::Message;
use keel_reducer::laws::{self, LawViolation};
use keel_reducer::{
    AddMessages, AddMessagesUpdate, Append, Associative, KeepLast, LastValue, Max, MergeMap, Min,
    ReduceError, Reducer, SetUnion, Sum,
};
use proptest::prelude::*;

/// The laws every reducer must pass, on one value and two batches.
fn general_laws<R>(
    r: &R,
    v: &R::Value,
    a: &[R::Update],
    b: &[R::Update],
) -> Result<(), LawViolation>
where
    R: Reducer,
    R::Value: PartialEq + std::fmt::Debug,
    R::Update: Clone,
{
    laws::check_determinism(r, v, a)?;
    laws::check_identity(r, v)?;
    laws::check_errors_are_atomic(r, v, a)?;
    let mut both = a.to_vec();
    both.extend_from_slice(b);
    laws::check_errors_are_atomic(r, v, &both)?;
    if let Some(u) = a.first() {
        laws::check_apply_matches_reduce(r, v, u)?;
    }
    Ok(())
}

fn associative_laws<R>(
    r: &R,
    v: &R::Value,
    a: &[R::Update],
    b: &[R::Update],
) -> Result<(), LawViolation>
where
    R: Associative,
    R::Value: PartialEq + std::fmt::Debug,
    R::Update: Clone,
{
    general_laws(r, v, a, b)?;
    laws::check_split_batches(r, v, a, b)
}

fn batch<T: Strategy>(item: T) -> impl Strategy<Value = Vec<T::Value>> {
    prop::collection::vec(item, 0..5)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn add_messages_laws(
        state in laws::messages(12),
        a in laws::add_messages_updates(3, 5),
        b in laws::add_messages_updates(3, 5),
        replacement in prop::collection::vec(laws::message(), 0..5),
        replacement_with_ids in prop::collection::vec(laws::message_with_pool_id(), 0..5),
    ) {
        associative_laws(&AddMessages, &state, &a, &b)?;
        laws::check_flush_idempotence(&state, replacement)?;
        // Repeated ids inside the replacement, too.
        laws::check_flush_idempotence(&state, replacement_with_ids)?;
    }

    #[test]
    fn add_messages_append_is_idempotent_for_ids_it_holds(
        state in laws::messages(12),
        msgs in prop::collection::vec(laws::message_with_pool_id(), 0..5),
    ) {
        laws::check_idempotent_update(&AddMessages, &state, &AddMessagesUpdate::append(msgs))?;
    }

    #[test]
    fn last_value_laws(v in any::<i64>(), a in prop::collection::vec(any::<i64>(), 0..3), b in batch(any::<i64>())) {
        general_laws(&LastValue::<i64>::new(), &v, &a, &b)?;
        if let [one] = a.as_slice() {
            laws::check_idempotent_update(&LastValue::<i64>::new(), &v, one)?;
        }
    }

    #[test]
    fn append_laws(v in batch(any::<u8>()), a in batch(batch(any::<u8>())), b in batch(batch(any::<u8>()))) {
        associative_laws(&Append::<u8>::new(), &v, &a, &b)?;
    }

    #[test]
    fn sum_laws(v in any::<i32>(), a in batch(any::<i32>()), b in batch(any::<i32>())) {
        // Full-range i32s overflow often: the error path is exercised too.
        associative_laws(&Sum::<i32>::new(), &v, &a, &b)?;
    }

    #[test]
    fn sum_float_laws(v in -1e6f64..1e6, a in batch(-1e6f64..1e6), b in batch(-1e6f64..1e6)) {
        associative_laws(&Sum::<f64>::new(), &v, &a, &b)?;
    }

    #[test]
    fn max_min_laws(v in prop::option::of(any::<i16>()), a in batch(any::<i16>()), b in batch(any::<i16>())) {
        associative_laws(&Max::<i16>::new(), &v, &a, &b)?;
        associative_laws(&Min::<i16>::new(), &v, &a, &b)?;
        if let Some(u) = a.first() {
            laws::check_idempotent_update(&Max::<i16>::new(), &v, u)?;
            laws::check_idempotent_update(&Min::<i16>::new(), &v, u)?;
        }
    }

    #[test]
    fn set_union_laws(
        v in prop::collection::btree_set(0u8..32, 0..8),
        a in batch(prop::collection::btree_set(0u8..32, 0..4)),
        b in batch(prop::collection::btree_set(0u8..32, 0..4)),
    ) {
        associative_laws(&SetUnion::<u8>::new(), &v, &a, &b)?;
        if let Some(u) = a.first() {
            laws::check_idempotent_update(&SetUnion::<u8>::new(), &v, u)?;
        }
    }

    #[test]
    fn merge_map_laws(
        v in prop::collection::btree_map(0u8..16, any::<u8>(), 0..8),
        a in batch(prop::collection::btree_map(0u8..16, any::<u8>(), 0..4)),
        b in batch(prop::collection::btree_map(0u8..16, any::<u8>(), 0..4)),
    ) {
        let r = MergeMap::<u8, u8>::new();
        associative_laws(&r, &v, &a, &b)?;
        if let Some(u) = a.first() {
            laws::check_idempotent_update(&r, &v, u)?;
        }
        // Every key written holds its last write; every other key is as it was.
        let mut merged = v.clone();
        r.reduce(&mut merged, a.clone()).unwrap();
        for (k, value) in &merged {
            let last = a.iter().rev().find_map(|u| u.get(k));
            prop_assert_eq!(Some(value), last.or_else(|| v.get(k)));
        }
        prop_assert!(v.keys().chain(a.iter().flat_map(|u| u.keys())).all(|k| merged.contains_key(k)));
    }

    #[test]
    fn keep_last_laws(
        n in 0usize..6,
        v in batch(any::<u8>()),
        a in batch(batch(any::<u8>())),
        b in batch(batch(any::<u8>())),
    ) {
        let r = KeepLast::<u8>::new(n);
        // Start from a value already within the bound, as the reducer leaves it.
        let v: VecDeque<u8> = r.apply(VecDeque::new(), v).unwrap();
        associative_laws(&r, &v, &a, &b)?;
        laws::check_keep_last_bounded(&r, &v, &a)?;
        let mut both = a.clone();
        both.extend(b);
        laws::check_keep_last_bounded(&r, &v, &both)?;
    }
}

/// A reducer that counts calls: not deterministic.
#[derive(Default)]
struct Counter(AtomicU64);

impl Reducer for Counter {
    type Value = u64;
    type Update = ();

    fn empty(&self) -> u64 {
        0
    }

    fn reduce(&self, current: &mut u64, _: Vec<()>) -> Result<(), ReduceError> {
        *current += self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Appends, then rejects a write of zero: mutates before failing.
struct Sloppy;

impl Reducer for Sloppy {
    type Value = Vec<u8>;
    type Update = u8;

    fn empty(&self) -> Vec<u8> {
        Vec::new()
    }

    fn reduce(&self, current: &mut Vec<u8>, updates: Vec<u8>) -> Result<(), ReduceError> {
        for u in updates {
            if u == 0 {
                return Err(ReduceError::Custom("zero".into()));
            }
            current.push(u);
        }
        Ok(())
    }
}

impl Associative for Sloppy {}

/// Keeps only the first write of each `reduce` call, and claims to be associative.
struct FirstOfBatch;

impl Reducer for FirstOfBatch {
    type Value = Vec<u8>;
    type Update = u8;

    fn empty(&self) -> Vec<u8> {
        Vec::new()
    }

    fn reduce(&self, current: &mut Vec<u8>, updates: Vec<u8>) -> Result<(), ReduceError> {
        current.extend(updates.first());
        Ok(())
    }
}

impl Associative for FirstOfBatch {}

#[test]
fn checks_catch_broken_reducers() {
    let e = laws::check_determinism(&Counter::default(), &0, &[()]).unwrap_err();
    assert_eq!(e.law, "determinism");
    // A fresh counter adds 0 on its first call, so identity breaks on the second.
    let c = Counter::default();
    laws::check_identity(&c, &0).unwrap();
    assert_eq!(laws::check_identity(&c, &0).unwrap_err().law, "identity");

    let e = laws::check_errors_are_atomic(&Sloppy, &vec![], &[1, 0]).unwrap_err();
    assert_eq!(e.law, "atomic errors");
    assert!(e.to_string().contains("zero"), "{e}");
    laws::check_errors_are_atomic(&Sloppy, &vec![], &[0, 1]).unwrap();

    let e = laws::check_split_batches(&FirstOfBatch, &vec![], &[1], &[2]).unwrap_err();
    assert_eq!(e.law, "split batches");

    // A KeepLast over a value longer than its bound is trimmed, not left to grow.
    let r = KeepLast::<u8>::new(2);
    laws::check_keep_last_bounded(&r, &VecDeque::from([1, 2, 3, 4]), &[vec![5]]).unwrap();
    // ... while nothing written changes nothing, even that value (the identity law).
    laws::check_identity(&r, &VecDeque::from([1, 2, 3, 4])).unwrap();
    let e = laws::check_bounded_growth(&Append::<u8>::new(), &vec![1, 2], &[vec![3]], 2, Vec::len)
        .unwrap_err();
    assert_eq!(e.law, "bounded growth");
}

#[test]
fn last_value_is_not_batch_splittable() {
    // Why LastValue does not implement Associative: one batch of two writes fails,
    // two batches of one succeed.
    let r = LastValue::<u8>::new();
    let mut v = 0;
    assert_eq!(
        r.reduce(&mut v, vec![1, 2]),
        Err(ReduceError::InvalidUpdate { writes: 2 })
    );
    r.reduce(&mut v, vec![1]).unwrap();
    r.reduce(&mut v, vec![2]).unwrap();
    assert_eq!(v, 2);
}

#[test]
fn flush_replaces_everything() {
    let state = AddMessages
        .apply(
            AddMessages.empty(),
            AddMessagesUpdate::append([Message::user("a"), Message::user("b")]),
        )
        .unwrap();
    let flush = AddMessagesUpdate::replace_all([Message::system("summary").with_id("s")]);
    let once = AddMessages.apply(state, flush).unwrap();
    assert_eq!(once.len(), 1);
    assert_eq!(once[0].id.as_deref(), Some("s"));
}
