//! The `openai_import` and `langchain_import` fuzz corpora (fuzz/corpus/), replayed
//! with the fuzz targets' own checks (fuzz/props/messages.rs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../../fuzz/props/messages.rs"]
mod props;

#[path = "../../../fuzz/props/corpus.rs"]
mod corpus;

#[test]
fn openai_import_corpus_replays() {
    corpus::replay("openai_import", props::check_openai);
}

#[test]
fn langchain_import_corpus_replays() {
    corpus::replay("langchain_import", props::check_langchain);
}
