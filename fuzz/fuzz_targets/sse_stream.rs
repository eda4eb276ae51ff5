//! keel-model's OpenAI SSE decoder behind the stream line splitter, over any body in any
//! chunking (properties: `keel_model::fuzzing::check_stream`).
#![no_main]

use keel_model::fuzzing::Format;
use libfuzzer_sys::fuzz_target;

#[path = "../props/stream.rs"]
mod stream;

fuzz_target!(|data: &[u8]| stream::fuzz(Format::Sse, data));
