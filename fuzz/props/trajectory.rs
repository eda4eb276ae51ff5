//! The properties of keel-compaction's trajectory loaders (tau-bench results and
//! SWE-agent `.traj` files) over any bytes, shared by the `trajectory_import` fuzz
//! target and keel-compaction's corpus replay test (tests/fuzz_corpus.rs). The CLI's
//! `keel replay` loading, which the same target fuzzes, has its own check beside it
//! (crates/keel-cli/src/formats.rs).
//!
//! * Loading never panics: runs, or a typed [`LoadError`] that names the file.
//! * tau-bench: one run per element, every message with an id, unique in its run
//!   (`Trajectory::new` refuses a run whose ids repeat, with a typed error); the
//!   messages export to OpenAI values that import back to them.
//! * SWE-agent: every message with an id, unique; no OpenAI extras kept; at most one
//!   user message not flagged as an observation, and a goal whenever there is a user
//!   message.

use std::collections::HashSet;
use std::path::Path;

use keel_compaction::OBSERVATION_METADATA_KEY;
use keel_compaction::replay::{LoadError, Trajectory, load_swe_agent, load_tau_bench};
use keel_message::{Message, Role, openai};
use serde_json::Value;

/// Writes `data` to `dir/run.json` and checks both loaders on it.
pub fn check_trajectory(dir: &Path, data: &[u8]) -> Result<(), String> {
    let path = dir.join("run.json");
    std::fs::write(&path, data).map_err(|e| format!("{}: {e}", path.display()))?;
    match load_tau_bench(&path) {
        Ok(runs) => {
            let elements = serde_json::from_slice::<Value>(data)
                .ok()
                .and_then(|v| v.as_array().map(Vec::len));
            if elements != Some(runs.len()) {
                return Err(format!("{} tau-bench runs of {elements:?}", runs.len()));
            }
            for run in &runs {
                check_ids(run)?;
                let plain: Vec<Message> = run
                    .messages
                    .iter()
                    .cloned()
                    .map(|mut m| {
                        m.id = None;
                        m
                    })
                    .collect();
                match openai::from_values(&openai::to_values(&plain)) {
                    Ok(back) if back == plain => {}
                    other => return Err(format!("run {}: exported, imports as {other:?}", run.id)),
                }
            }
        }
        Err(e) => names_the_file(&e, &path)?,
    }
    match load_swe_agent(&path) {
        Ok(run) => {
            check_ids(&run)?;
            if run
                .messages
                .iter()
                .any(|m| m.metadata.contains_key("openai"))
            {
                return Err("a SWE-agent message kept OpenAI extras".into());
            }
            let flagged =
                |m: &Message| m.metadata.get(OBSERVATION_METADATA_KEY) == Some(&Value::Bool(true));
            let users = run.messages.iter().filter(|m| m.role == Role::User);
            if users.clone().filter(|m| !flagged(m)).count() > 1 {
                return Err("more than one SWE-agent task message".into());
            }
            let has_user = users.count() > 0;
            if run.goal().is_some() != has_user || run.turns() > run.messages.len() {
                return Err(format!(
                    "goal {:?} with user messages: {has_user}",
                    run.goal()
                ));
            }
        }
        Err(e) => names_the_file(&e, &path)?,
    }
    Ok(())
}

fn names_the_file(e: &LoadError, path: &Path) -> Result<(), String> {
    let text = e.to_string();
    if text.contains(&path.display().to_string()) {
        Ok(())
    } else {
        Err(format!(
            "the error {text:?} does not name {}",
            path.display()
        ))
    }
}

fn check_ids(run: &Trajectory) -> Result<(), String> {
    let mut seen = HashSet::new();
    for m in &run.messages {
        match &m.id {
            Some(id) if seen.insert(id.as_str()) => {}
            other => return Err(format!("run {}: message id {other:?}", run.id)),
        }
    }
    Ok(())
}
