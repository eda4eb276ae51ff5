//! keel-model's `Retry-After` / `retry-after-ms` parsing (properties:
//! `keel_model::fuzzing::check_retry_after`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = keel_model::fuzzing::check_retry_after(data) {
        panic!("{e}");
    }
});
