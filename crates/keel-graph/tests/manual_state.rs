//! A state written by hand, without `#[derive(State)]`: the trait is usable directly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_checkpoint::MemorySaver;
use keel_graph::reducer::{Append, LastValue, Reducer};
use keel_graph::state::support as help;
use keel_graph::{Command, END, RunConfig, START, State, StateError, StateGraph};
use serde_json::Value;

/// Two channels: an appended list of notes and a last-value status.
#[derive(Clone, Debug, Default, PartialEq)]
struct Notes {
    notes: Vec<String>,
    status: String,
}

#[derive(Default)]
struct NotesUpdate {
    notes: Option<Vec<String>>,
    status: Option<String>,
}

impl From<NotesUpdate> for Command<Notes> {
    fn from(u: NotesUpdate) -> Self {
        Command::update(u)
    }
}

impl State for Notes {
    type Update = NotesUpdate;
    const CHANNELS: &'static [&'static str] = &["notes", "status"];

    fn empty() -> Self {
        Notes {
            notes: Append::<String>::default().empty(),
            status: LastValue::<String>::default().empty(),
        }
    }

    fn apply(&mut self, updates: Vec<NotesUpdate>) -> Result<Vec<usize>, StateError> {
        let (mut notes, mut status) = (Vec::new(), Vec::new());
        for u in updates {
            notes.extend(u.notes);
            status.extend(u.status);
        }
        let mut written = Vec::new();
        if !notes.is_empty() {
            help::reduce(&Append::default(), "notes", &mut self.notes, notes)?;
            written.push(0);
        }
        if !status.is_empty() {
            help::reduce(&LastValue::default(), "status", &mut self.status, status)?;
            written.push(1);
        }
        Ok(written)
    }

    fn encode_update(u: &NotesUpdate) -> Result<Vec<(usize, Value)>, StateError> {
        let mut out = Vec::new();
        if let Some(n) = &u.notes {
            out.push((0, help::encode("notes", n)?));
        }
        if let Some(s) = &u.status {
            out.push((1, help::encode("status", s)?));
        }
        Ok(out)
    }

    fn decode_update(values: &[(usize, Value)]) -> Result<NotesUpdate, StateError> {
        let mut u = NotesUpdate::default();
        for (c, v) in values {
            match c {
                0 => u.notes = Some(help::decode("notes", v.clone())?),
                1 => u.status = Some(help::decode("status", v.clone())?),
                other => return Err(StateError::unknown_index(*other)),
            }
        }
        Ok(u)
    }

    fn encode_channel(&self, c: usize) -> Result<Value, StateError> {
        match c {
            0 => help::encode("notes", &self.notes),
            1 => help::encode("status", &self.status),
            other => Err(StateError::unknown_index(other)),
        }
    }

    fn restore_channel(&mut self, c: usize, v: Value) -> Result<(), StateError> {
        match c {
            0 => self.notes = help::decode("notes", v)?,
            1 => self.status = help::decode("status", v)?,
            other => return Err(StateError::unknown_index(other)),
        }
        Ok(())
    }

    fn fold_channel(&mut self, c: usize, updates: Vec<Value>) -> Result<(), StateError> {
        match c {
            0 => help::reduce(
                &Append::default(),
                "notes",
                &mut self.notes,
                help::decode_all("notes", updates)?,
            ),
            1 => help::reduce(
                &LastValue::default(),
                "status",
                &mut self.status,
                help::decode_all("status", updates)?,
            ),
            other => Err(StateError::unknown_index(other)),
        }
    }
}

#[tokio::test]
async fn a_hand_written_state_runs_and_checkpoints() {
    let cp = Arc::new(MemorySaver::new());
    let graph = StateGraph::<Notes>::new()
        .add_node("write", |s: Arc<Notes>, _c| async move {
            Ok(NotesUpdate {
                notes: Some(vec![format!("note {}", s.notes.len())]),
                status: Some("written".into()),
            })
        })
        .add_edge(START, "write")
        .add_conditional_edges(
            "write",
            |s: &Notes| if s.notes.len() < 3 { "write" } else { END },
            None,
        )
        .with_checkpointer(cp)
        .compile()
        .unwrap();
    let config = RunConfig::thread("manual");
    let run = graph
        .invoke(
            NotesUpdate {
                notes: Some(vec!["start".into()]),
                status: None,
            },
            &config,
        )
        .await
        .unwrap();
    assert_eq!(run.state.notes, ["start", "note 1", "note 2"]);
    // The checkpointed state rebuilds from per-channel deltas to the same value.
    let stored = graph.get_state(&config).await.unwrap().unwrap();
    assert_eq!(stored.values, run.state);
    assert_eq!(stored.values.status, "written");
}
