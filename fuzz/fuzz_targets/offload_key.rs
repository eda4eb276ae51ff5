//! keel-offload's thread id, path and key validation over any text (properties:
//! fuzz/props/offload_key.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../props/offload_key.rs"]
mod props;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = props::check_offload_key(data) {
        panic!("{e}");
    }
});
