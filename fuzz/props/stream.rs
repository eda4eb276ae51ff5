//! The `sse_stream` and `ndjson_stream` targets' shared driver: keel-model's stream
//! check (`keel_model::fuzzing::check_stream`, whose corpus replay is keel-model's own
//! test) on a tokio runtime, whose timers the stream driver needs.

use std::sync::LazyLock;

use keel_model::fuzzing::{Format, check_stream};
use tokio::runtime::{Builder, Runtime};

static RUNTIME: LazyLock<Runtime> = LazyLock::new(|| {
    Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap_or_else(|e| panic!("no tokio runtime: {e}"))
});

/// Checks `data` as a body in `format`, panicking (a crash) where a property fails.
pub fn fuzz(format: Format, data: &[u8]) {
    if let Err(e) = RUNTIME.block_on(check_stream(format, data)) {
        panic!("{e}");
    }
}
