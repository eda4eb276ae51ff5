//! `#[derive(State)]`'s compile errors, checked where both the macro and keel-graph
//! are visible: each `tests/ui/*.rs` must fail with the text in its `.stderr` (the
//! derive's own message at the offending tokens), and `tests/ui/pass/*.rs` must build,
//! so a failure above is the derive's and not a missing import.
//!
//! After changing a message: `TRYBUILD=overwrite cargo test -p keel-graph --test ui`,
//! then read the new `.stderr` files before committing them.

#[test]
fn derive_state_errors() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/*.rs");
}
