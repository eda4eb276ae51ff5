//! keel-message's openai importer over any bytes (properties: fuzz/props/messages.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)] // each target uses one of the two checks
#[path = "../props/messages.rs"]
mod props;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = props::check_openai(data) {
        panic!("{e}");
    }
});
