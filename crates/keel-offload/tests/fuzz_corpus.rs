//! The `offload_key` fuzz corpus (fuzz/corpus/), replayed with the fuzz target's own
//! check (fuzz/props/offload_key.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../../fuzz/props/offload_key.rs"]
mod props;

#[path = "../../../fuzz/props/corpus.rs"]
mod corpus;

#[test]
fn offload_key_corpus_replays() {
    corpus::replay("offload_key", props::check_offload_key);
}
