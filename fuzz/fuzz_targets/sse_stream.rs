//! keel-model's OpenAI SSE decoder behind the stream line splitter, over any body in any
//! chunking (properties: `keel_model::fuzzing::check_stream`).
#![no_main]

use std::sync::LazyLock;

use keel_model::fuzzing::{Format, check_stream};
use libfuzzer_sys::fuzz_target;
use tokio::runtime::{Builder, Runtime};

static RUNTIME: LazyLock<Runtime> = LazyLock::new(|| {
    Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("no tokio runtime: {e}"))
});

fuzz_target!(|data: &[u8]| {
    if let Err(e) = RUNTIME.block_on(check_stream(Format::Sse, data)) {
        panic!("{e}");
    }
});
