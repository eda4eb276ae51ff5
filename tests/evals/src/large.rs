//! Eval 6, `large-result`: a 5 MB tool result is offloaded, and its stub plus one
//! targeted read answers a question about its middle.
//!
//! The reader visits one record whose result is a 5 MB build log; the line
//! `checksum of build B-7734 is 3f9a1c77e2d4` sits in its middle. The final question
//! asks for that checksum. The reader answers from its prompt if it can, else greps the
//! offloaded file the stub names. It passes when the answer is right, it took exactly
//! one tool call, and no prompt held more than 64 KiB of text.
//!
//! It fails if the result is not offloaded (the prompt holds 5 MB), if the stub does
//! not name where the result went (the reader greps the archive and finds nothing,
//! since the result never left the context), or if the grep cannot find the line.

use std::sync::Arc;

use keel_agent::{AgentEvent, AgentInput};
use keel_checkpoint::MemorySaver;
use keel_message::Message;

use crate::world::{self, Recorder, VisitTool};
use crate::{EvalError, Outcome};

/// The eval's name.
pub const NAME: &str = "large-result";
/// The size of the tool result, in bytes (about).
pub const BYTES: usize = 5 << 20;
/// The checksum the question asks for.
pub const VALUE: &str = "3f9a1c77e2d4";
/// The most text a prompt may hold.
pub const MAX_PROMPT_CHARS: usize = 64 << 10;
const GOAL: &str =
    "Fetch the build log stored under a key, then answer questions about it. Start at key K-0000.";

fn log() -> String {
    let line = |i: usize| {
        format!(
            "[{i:07}] compile unit u{:05} ok in {} ms\n",
            i % 40_000,
            3 + i % 97
        )
    };
    let mut out = String::with_capacity(BYTES + 4096);
    let mut i = 0;
    while out.len() < BYTES / 2 {
        out.push_str(&line(i));
        i += 1;
    }
    out.push_str(&format!(
        "[{i:07}] checksum of build B-7734 is {VALUE} (sha256 prefix)\n"
    ));
    i += 1;
    while out.len() < BYTES {
        out.push_str(&line(i));
        i += 1;
    }
    out.push_str("next key: none (end of chain)\n");
    out
}

/// Runs the eval.
pub async fn run() -> Result<Outcome, EvalError> {
    let recorder = Recorder::default();
    let text = Arc::new(log());
    let served = text.clone();
    let visit = VisitTool::new(move |k| match world::index(k) {
        Some(0) => Ok(served.as_str().to_owned()),
        _ => Err(format!("no record named {k}")),
    });
    let agent = world::builder(Arc::new(world::reader_model(recorder.clone())), visit)
        .goal(GOAL)
        .compaction(world::forced())
        .checkpointer(Arc::new(MemorySaver::new()))
        .build()?;
    let first = agent.run("large", AgentInput::new()).await?;
    let offloaded = first
        .state
        .events
        .iter()
        .any(|e| matches!(e, AgentEvent::Offload { .. }));
    let question = format!(
        "{} what came after \"checksum of build B-7734 is\" in the build log?",
        world::FINAL_QUESTION
    );
    let run = agent
        .run("large", AgentInput::new().message(Message::user(question)))
        .await?;
    let turns = recorder.turns();
    let calls = world::calls_after_question(&turns);
    let biggest = turns.iter().map(world::Turn::chars).max().unwrap_or(0);
    let answer = run.answer.unwrap_or_default();
    let right = answer.starts_with(world::ANSWER) && answer.contains(VALUE);
    let passed = right && calls == 1 && biggest <= MAX_PROMPT_CHARS && offloaded;
    let detail = format!(
        "{} MB result {}; largest prompt {} chars; answer {answer:?}",
        text.len() >> 20,
        if offloaded {
            "offloaded"
        } else {
            "NOT offloaded"
        },
        biggest
    );
    Ok(Outcome::new(
        NAME,
        passed,
        calls as f64,
        "tool calls after the question (exactly 1)",
        detail,
    )
    .with_transcript(&turns))
}
