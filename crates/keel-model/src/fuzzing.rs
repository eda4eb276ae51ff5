//! What `cargo fuzz` (the repository's `fuzz/` crate) reaches inside this crate: thin
//! wrappers around the crate-private parsers of what a server sends (the OpenAI SSE and
//! Ollama NDJSON decoders behind the line splitter, and `Retry-After` parsing), and the
//! properties the fuzz targets check. Built only with `--cfg fuzzing` (cargo-fuzz sets
//! it) and for this crate's tests, whose corpus replay below runs the same checks on
//! every file of `fuzz/corpus/<target>/`.
//!
//! A check returns `Err` with a description when a property does not hold; the fuzz
//! target turns that into a crash, the replay test into a failure.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderValue};

use crate::http::{RETRY_AFTER_CEILING, decode_chunks};
use crate::{ChatEvent, ModelError};

/// The bounds a fuzzed stream is decoded within.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest line (and, for SSE, the longest event).
    pub max_line: usize,
    /// The most text and tool-call bytes.
    pub max_answer: usize,
}

/// The limits every stream input is decoded with: roomy ones, and small ones that
/// inputs of a few KiB can run into.
pub const LIMITS: [Limits; 2] = [
    Limits {
        max_line: 1 << 20,
        max_answer: 1 << 20,
    },
    Limits {
        max_line: 96,
        max_answer: 160,
    },
];

/// Which stream decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenAI's server-sent events (`data: {chunk}` ... `data: [DONE]`).
    Sse,
    /// Ollama's JSON lines (`{"message": ...}` ... `{"done": true}`).
    Ndjson,
}

/// The items a streamed reply yields when its body arrives as `chunks`.
pub async fn decode(
    format: Format,
    chunks: Vec<Vec<u8>>,
    limits: Limits,
) -> Vec<Result<ChatEvent, ModelError>> {
    let Limits {
        max_line,
        max_answer,
    } = limits;
    match format {
        // As the providers build them: an SSE event may be as long as a line.
        Format::Sse => {
            let decoder = crate::openai::SseDecoder::new("fuzz", max_line);
            decode_chunks(chunks, decoder, max_line, max_answer).await
        }
        Format::Ndjson => {
            let decoder = crate::ollama::Accumulator::new("fuzz");
            decode_chunks(chunks, decoder, max_line, max_answer).await
        }
    }
}

/// A `Retry-After` value read at `now`.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    crate::http::parse_retry_after(value, now)
}

/// The wait a response's `retry-after-ms` and `retry-after` headers name (a value that
/// is not a valid header value is left out, as no response could carry it).
pub fn retry_after(retry_after: Option<&[u8]>, retry_after_ms: Option<&[u8]>) -> Option<Duration> {
    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("retry-after", retry_after),
        ("retry-after-ms", retry_after_ms),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_bytes(v).ok()) {
            headers.insert(name, value);
        }
    }
    crate::http::retry_after(&headers)
}

/// Moments a `Retry-After` date is read against: the epoch, a day in 1994, and the end
/// of year 9999 (past the last date an HTTP date can name).
fn moments() -> [SystemTime; 3] {
    let at = |secs| {
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_secs(secs))
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    [at(0), at(784_111_777), at(253_402_300_799)]
}

/// The wait a number of seconds should give: `None` if negative or not finite, else
/// the seconds (within a microsecond for rounding), at most the ceiling.
fn expected_wait(secs: f64, got: Option<Duration>) -> Result<(), String> {
    if !(secs.is_finite() && secs >= 0.0) {
        return match got {
            None => Ok(()),
            Some(w) => Err(format!("{secs} seconds gave a wait of {w:?}")),
        };
    }
    let ceiling = RETRY_AFTER_CEILING.as_secs_f64();
    let want = secs.min(ceiling);
    match got {
        Some(w) if (w.as_secs_f64() - want).abs() <= 1e-6 * want.max(1.0) => Ok(()),
        other => Err(format!("{secs} seconds gave {other:?}, not {want}s")),
    }
}

/// The properties of `Retry-After` parsing. `data` is a `retry-after` value, then
/// optionally a line feed and a `retry-after-ms` value.
///
/// * Delta seconds give their own wait (capped at a year) whatever the time, negative
///   or non-finite ones none; an HTTP date gives a wait no longer than a year that
///   never grows as time passes; anything else gives none.
/// * With both headers a valid `retry-after-ms` wins; every wait is at most a year.
/// * Nothing panics.
pub fn check_retry_after(data: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(data);
    let (value, ms) = match text.split_once('\n') {
        Some((value, ms)) => (value, Some(ms)),
        None => (text.as_ref(), None),
    };
    let waits = moments().map(|now| parse_retry_after(value, now));
    if let Some(w) = waits.iter().flatten().find(|w| **w > RETRY_AFTER_CEILING) {
        return Err(format!("{value:?} gave {w:?}, over the ceiling"));
    }
    if let Ok(secs) = value.parse::<f64>() {
        for got in waits {
            expected_wait(secs, got).map_err(|e| format!("{value:?}: {e}"))?;
        }
    } else if httpdate::parse_http_date(value).is_ok() {
        let mut previous: Option<Duration> = None;
        for got in waits {
            let Some(got) = got else {
                return Err(format!("the HTTP date {value:?} gave no wait"));
            };
            if previous.is_some_and(|p| got > p) {
                return Err(format!("the wait for {value:?} grew as time passed"));
            }
            previous = Some(got);
        }
    } else if let Some(w) = waits.iter().flatten().next() {
        return Err(format!(
            "{value:?} is neither seconds nor a date, yet gave {w:?}"
        ));
    }

    let header = |v: &str| {
        HeaderValue::from_bytes(v.as_bytes())
            .ok()
            .and_then(|h| h.to_str().ok().map(|s| s.trim().to_owned()))
    };
    let both = retry_after(Some(value.as_bytes()), ms.map(str::as_bytes));
    if let Some(w) = both.filter(|w| *w > RETRY_AFTER_CEILING) {
        return Err(format!("the headers gave {w:?}, over the ceiling"));
    }
    let ms_secs = ms
        .and_then(header)
        .and_then(|m| m.parse::<f64>().ok())
        .map(|m| m / 1000.0)
        .filter(|s| s.is_finite() && *s >= 0.0);
    if let Some(secs) = ms_secs {
        expected_wait(secs, both).map_err(|e| format!("retry-after-ms {ms:?}: {e}"))?;
    }
    Ok(())
}

/// A deterministic chunking of `data`: pieces of 1 to 64 bytes, drawn from a hash of
/// the data, so every input is also tried split in odd places.
fn scattered(data: &[u8]) -> Vec<Vec<u8>> {
    // FNV-1a, then xorshift64.
    let mut state = data.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1;
    let mut chunks = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let size = usize::try_from(state % 64).unwrap_or(0) + 1;
        let (piece, tail) = rest.split_at(size.min(rest.len()));
        chunks.push(piece.to_vec());
        rest = tail;
    }
    chunks
}

/// A tool-call id a provider made up (`call_` and 16 hex digits): random, so left out
/// when two decodings are compared.
fn made_up(id: &str) -> bool {
    id.strip_prefix("call_")
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The items as text to compare, with made-up tool-call ids masked.
fn comparable(items: &[Result<ChatEvent, ModelError>]) -> Vec<String> {
    let mask = |id: &mut String| {
        if made_up(id) {
            "call_*".clone_into(id);
        }
    };
    items
        .iter()
        .map(|item| match item {
            Ok(ChatEvent::ToolCall(delta)) => {
                let mut delta = delta.clone();
                if let Some(id) = delta.id.as_mut() {
                    mask(id);
                }
                format!("{delta:?}")
            }
            Ok(ChatEvent::Done(response)) => {
                let mut response = response.clone();
                for call in &mut response.message.tool_calls {
                    mask(&mut call.id);
                }
                format!("{response:?}")
            }
            other => format!("{other:?}"),
        })
        .collect()
}

/// What one streamed reply must look like, however it arrived.
fn check_items(
    format: Format,
    limits: Limits,
    items: &[Result<ChatEvent, ModelError>],
) -> Result<(), String> {
    let Some((last, deltas)) = items.split_last() else {
        return Err("the stream ended with neither a reply nor an error".into());
    };
    let mut text = String::new();
    // Per call index: the name and arguments its deltas spell, and its last id.
    let mut calls: Vec<(String, String, Option<String>)> = Vec::new();
    for (i, item) in deltas.iter().enumerate() {
        match item {
            Ok(ChatEvent::Text(t)) => {
                text.push_str(t);
            }
            Ok(ChatEvent::ToolCall(d)) => {
                if d.index >= calls.len() {
                    calls.resize(d.index.saturating_add(1), Default::default());
                }
                let Some(call) = calls.get_mut(d.index) else {
                    return Err(format!("item {i}: call index {}", d.index));
                };
                call.0.push_str(d.name.as_deref().unwrap_or_default());
                call.1.push_str(&d.arguments);
                if d.id.is_some() {
                    call.2.clone_from(&d.id);
                }
            }
            other => return Err(format!("item {i} of {} is {other:?}", items.len())),
        }
    }
    match last {
        Ok(ChatEvent::Done(response)) => {
            if response.message.text() != text {
                return Err(format!(
                    "the reply's text {:?} is not its deltas' {text:?}",
                    response.message.text()
                ));
            }
            let got = &response.message.tool_calls;
            if got.len() != calls.len() {
                return Err(format!(
                    "{} calls, {} in the deltas",
                    got.len(),
                    calls.len()
                ));
            }
            for (call, (name, arguments, id)) in got.iter().zip(&calls) {
                let arguments = match format {
                    Format::Sse if arguments.trim().is_empty() => "{}",
                    _ => arguments.as_str(),
                };
                if call.name != *name || call.arguments.to_json_string() != arguments {
                    return Err(format!(
                        "call {call:?} is not its deltas' {name:?}({arguments:?})"
                    ));
                }
                if id.as_ref().is_some_and(|id| *id != call.id) {
                    return Err(format!("call {call:?} lost its id {id:?}"));
                }
            }
        }
        Ok(other) => return Err(format!("the stream ended on {other:?}")),
        Err(ModelError::LineTooLong { limit }) | Err(ModelError::AnswerTooLarge { limit })
            if *limit != limits.max_line && *limit != limits.max_answer =>
        {
            return Err(format!("a limit of {limit} that is not one of {limits:?}"));
        }
        Err(_) => {}
    }
    Ok(())
}

/// The properties of a stream decoder, for a body `data` in the given `format`.
///
/// * Decoding ends in one reply or one error, after text and tool-call deltas only;
///   the reply's text is its text deltas joined, its tool calls their deltas'.
/// * Limit errors name the configured limit.
/// * The outcome does not depend on how the body was split into chunks: as one
///   chunk, byte by byte, and in pieces of 1 to 64 bytes give the same items.
/// * Nothing panics.
pub async fn check_stream(format: Format, data: &[u8]) -> Result<(), String> {
    for limits in LIMITS {
        let whole = decode(format, vec![data.to_vec()], limits).await;
        check_items(format, limits, &whole).map_err(|e| format!("{limits:?}, one chunk: {e}"))?;
        let expected = comparable(&whole);
        let chunkings = [
            ("byte by byte", data.iter().map(|b| vec![*b]).collect()),
            ("scattered", scattered(data)),
        ];
        for (name, chunks) in chunkings {
            let got = comparable(&decode(format, chunks, limits).await);
            if got != expected {
                let mut diff = String::new();
                let _ = write!(diff, "{limits:?}: {name} differs from one chunk:");
                let _ = write!(diff, "\n  one chunk: {expected:?}\n  {name}: {got:?}");
                return Err(diff);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "../../../fuzz/props/corpus.rs"]
mod corpus;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::corpus::{files, replay};

    #[test]
    fn retry_after_corpus_replays() {
        replay("retry_after", check_retry_after);
    }

    async fn replay_stream(target: &str, format: Format) {
        for file in files(target) {
            let data = std::fs::read(&file).unwrap();
            if let Err(e) = check_stream(format, &data).await {
                panic!("{}: {e}", file.display());
            }
        }
    }

    #[tokio::test]
    async fn sse_stream_corpus_replays() {
        replay_stream("sse_stream", Format::Sse).await;
    }

    #[tokio::test]
    async fn ndjson_stream_corpus_replays() {
        replay_stream("ndjson_stream", Format::Ndjson).await;
    }

    #[test]
    fn chunkings_cover_the_input() {
        let data: Vec<u8> = (0..=255).collect();
        assert_eq!(scattered(&data).concat(), data);
        assert!(scattered(&data).len() > 4);
        assert!(made_up("call_0123456789abcdef"));
        assert!(!made_up("call_1"));
    }
}
