#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Counting throughput on a corpus file: keel-token (one and two threads) and, for
//! reference, `tiktoken-rs`'s own encoder. Prints one JSON object on stdout.
//!
//! With `--load` instead of a corpus it measures what loading `o200k_base` takes, once
//! per process (run it several times): keel's first count in the process, and
//! tiktoken-rs's `o200k_base()`.
//!
//! `cargo xtask bench token` runs this in release mode next to Python tiktoken on the
//! same file; run it by hand with
//! `cargo run --release -p keel-token --example count_bench -- CORPUS [REPS]`
//! (or `-- --load`).

use std::time::Instant;

use keel_token::{TiktokenCounter, TokenCounter};
use serde_json::json;

/// Throughput of `runs` timed calls of `f` (after one untimed warm-up), in MB/s, and
/// the value `f` returned.
fn measure(bytes: usize, runs: usize, mut f: impl FnMut() -> usize) -> (Vec<f64>, usize) {
    let value = f();
    let rates = (0..runs)
        .map(|_| {
            let start = Instant::now();
            let v = f();
            let secs = start.elapsed().as_secs_f64();
            assert_eq!(v, value, "counts differ between runs");
            bytes as f64 / 1e6 / secs
        })
        .collect();
    (rates, value)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: count_bench CORPUS [REPS] | --load");
    if path == "--load" {
        load();
        return;
    }
    let runs: usize = args
        .next()
        .map_or(15, |r| r.parse().expect("REPS is a number"));
    let text = std::fs::read_to_string(&path).expect("corpus is readable UTF-8");
    let bytes = text.len();

    let one = TiktokenCounter::o200k_base().unwrap();
    let two = one.clone().with_threads(2);
    let reference = tiktoken_rs::o200k_base_singleton();

    let (keel_1, tokens) = measure(bytes, runs, || one.count_text(&text));
    let (keel_2, tokens_2) = measure(bytes, runs, || two.count_text(&text));
    let (tiktoken_rs, tokens_rs) = measure(bytes, runs, || reference.encode_ordinary(&text).len());
    assert_eq!(tokens, tokens_2, "two-thread count differs");
    assert_eq!(tokens, tokens_rs, "keel-token and tiktoken-rs disagree");

    let out = json!({
        "encoding": "o200k_base",
        "bytes": bytes,
        "runs": runs,
        "tokens": tokens,
        "keel_1_thread_mb_s": median(keel_1),
        "keel_2_threads_mb_s": median(keel_2),
        "tiktoken_rs_mb_s": median(tiktoken_rs),
    });
    println!("{out}");
}

/// The first count of the process (which loads the vocabulary), then a fresh
/// tiktoken-rs `o200k_base()`, in milliseconds.
fn load() {
    let start = Instant::now();
    let counter = TiktokenCounter::o200k_base().unwrap();
    assert!(counter.count_text("hello") > 0);
    let keel = start.elapsed().as_secs_f64() * 1e3;
    let start = Instant::now();
    let reference = tiktoken_rs::o200k_base().unwrap();
    assert!(!reference.encode_ordinary("hello").is_empty());
    let tiktoken_rs = start.elapsed().as_secs_f64() * 1e3;
    let out = json!({ "keel_load_ms": keel, "tiktoken_rs_load_ms": tiktoken_rs });
    println!("{out}");
}
