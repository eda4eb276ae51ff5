//! A 200 MB tool result is offloaded without a second copy in memory.
//!
//! This test binary counts every allocation (a counting global allocator from the
//! `peak_alloc` crate) and holds this one test only, so the peak it reads is the
//! policy's own. Evicting writes the text to the file store straight from the
//! message's string and builds the stub from borrowed lines, so the peak above the
//! starting point stays small; a second copy would add 200 MB.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_message::Message;
use keel_offload::{EvictLargeResults, FsStore, Fsync, Key, OffloadStore, PolicyEnv, ThreadId};
use keel_token::ApproxCounter;
use peak_alloc::PeakAlloc;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

const MB: usize = 1 << 20;
const SIZE: usize = 200 * MB;

#[test]
fn a_200_mb_result_is_offloaded_with_one_copy_in_memory() {
    // 200 MB of log lines, allocated once at the exact size.
    let mut text = String::with_capacity(SIZE);
    let mut i = 0u64; // line number written
    let line = " INFO request served from cache in 3 ms, upstream healthy, queue depth 0\n";
    while text.len() + 12 + line.len() <= SIZE {
        text.push_str(&format!("{i:>12}"));
        text.push_str(line);
        i += 1;
    }
    while text.len() < SIZE {
        text.push('.');
    }
    assert_eq!((text.len(), text.capacity()), (SIZE, SIZE));
    let first_line = text.lines().next().unwrap().to_owned();
    let line_count = text.lines().count();

    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let thread = ThreadId::new("t1").unwrap();
    // Four characters a token, whatever they are: the count below is a quarter.
    let counter = ApproxCounter::new().with_chars_per_token(4);
    let env = PolicyEnv::new(&store, &thread, &counter);
    let messages = vec![Message::tool("call_big", text)];

    let before = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let out = EvictLargeResults::new().apply(messages, &env);
    let peak_above_start = ALLOC.peak_usage() - before;
    let after = ALLOC.current_usage();
    eprintln!(
        "evicting 200 MB: peak allocation above the starting point {:.2} MB; {:.1} MB freed",
        peak_above_start as f64 / MB as f64,
        before.saturating_sub(after) as f64 / MB as f64
    );

    assert!(out.is_complete(), "{:?}", out.failures);
    // No second copy: the peak stays far below the size of the result.
    assert!(
        peak_above_start < 4 * MB,
        "peak above start was {peak_above_start} bytes"
    );
    // The original text was freed once the stub replaced it.
    assert!(
        before - after > SIZE - MB,
        "only {} bytes freed",
        before - after
    );

    let key = Key::new("t1", "large_tool_results/call_big").unwrap();
    assert_eq!(store.size(&key).unwrap(), Some(SIZE as u64));
    let stub = out.messages[0].text();
    assert!(stub.contains(&format!("     1\t{first_line}")), "{stub}");
    match &out.stored[0].what {
        keel_offload::StoredWhat::ToolResult { lines, tokens, .. } => {
            assert_eq!(*lines, line_count);
            assert_eq!(*tokens, SIZE / 4);
        }
        other => panic!("unexpected record {other:?}"),
    }
    assert!(stub.len() < 8_000, "{} bytes", stub.len());
}
