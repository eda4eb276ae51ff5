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

/// A hand-written state whose index functions can lie: `apply` returning a channel
/// number past `CHANNELS`, or `encode_update` encoding under one.
#[derive(Clone, Debug, Default)]
struct Liar {
    value: i64,
}

#[derive(Default)]
struct LiarUpdate {
    value: Option<i64>,
    /// `apply` reports this channel as written.
    apply_says: Option<usize>,
    /// `encode_update` puts the value under this channel.
    encode_says: Option<usize>,
}

impl From<LiarUpdate> for Command<Liar> {
    fn from(u: LiarUpdate) -> Self {
        Command::update(u)
    }
}

impl State for Liar {
    type Update = LiarUpdate;
    const CHANNELS: &'static [&'static str] = &["value"];

    fn empty() -> Self {
        Liar::default()
    }

    fn apply(&mut self, updates: Vec<LiarUpdate>) -> Result<Vec<usize>, StateError> {
        let mut written = Vec::new();
        for u in updates {
            if let Some(v) = u.value {
                self.value = v;
                written.push(u.apply_says.unwrap_or(0));
            }
        }
        Ok(written)
    }

    fn encode_update(u: &LiarUpdate) -> Result<Vec<(usize, Value)>, StateError> {
        Ok(u.value
            .map(|v| (u.encode_says.unwrap_or(0), Value::from(v)))
            .into_iter()
            .collect())
    }

    fn decode_update(values: &[(usize, Value)]) -> Result<LiarUpdate, StateError> {
        let mut u = LiarUpdate::default();
        for (c, v) in values {
            match c {
                0 => u.value = Some(help::decode("value", v.clone())?),
                other => return Err(StateError::unknown_index(*other)),
            }
        }
        Ok(u)
    }

    fn encode_channel(&self, c: usize) -> Result<Value, StateError> {
        match c {
            0 => help::encode("value", &self.value),
            other => Err(StateError::unknown_index(other)),
        }
    }

    fn restore_channel(&mut self, c: usize, v: Value) -> Result<(), StateError> {
        match c {
            0 => self.value = help::decode("value", v)?,
            other => return Err(StateError::unknown_index(other)),
        }
        Ok(())
    }

    fn fold_channel(&mut self, c: usize, updates: Vec<Value>) -> Result<(), StateError> {
        match c {
            0 => {
                for v in updates {
                    self.value = help::decode("value", v)?;
                }
                Ok(())
            }
            other => Err(StateError::unknown_index(other)),
        }
    }
}

fn liar_graph(
    node_update: fn() -> LiarUpdate,
    cp: Option<Arc<MemorySaver>>,
) -> keel_graph::CompiledGraph<Liar> {
    let mut g = StateGraph::<Liar>::new()
        .add_node("lie", move |_s, _c| async move { Ok(node_update()) })
        .add_edge(START, "lie")
        .add_edge("lie", END);
    if let Some(cp) = cp {
        g = g.with_checkpointer(cp);
    }
    g.compile().unwrap()
}

fn assert_out_of_range(
    result: Result<impl std::fmt::Debug, keel_graph::GraphError>,
    method: &str,
    index: usize,
) {
    let err = result.unwrap_err();
    assert!(
        matches!(
            &err,
            keel_graph::GraphError::State(StateError::ChannelOutOfRange { method: m, index: i, count: 1, state })
                if *m == method && *i == index && state.ends_with("Liar")
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&format!("#{index}")) && message.contains(method),
        "{message}"
    );
}

#[tokio::test]
async fn a_state_returning_a_channel_past_channels_is_a_typed_error_not_a_panic() {
    let apply_lies = || LiarUpdate {
        value: Some(1),
        apply_says: Some(7),
        encode_says: None,
    };
    let encode_lies = || LiarUpdate {
        value: Some(1),
        apply_says: None,
        encode_says: Some(9),
    };
    // Without a checkpointer.
    let g = liar_graph(apply_lies, None);
    assert_out_of_range(
        g.invoke(LiarUpdate::default(), &RunConfig::default()).await,
        "State::apply",
        7,
    );
    // With one: the step's checkpoint would be written under the channel.
    let cp = Arc::new(MemorySaver::new());
    let g = liar_graph(apply_lies, Some(Arc::clone(&cp)));
    let config = RunConfig::thread("liar");
    assert_out_of_range(
        g.invoke(LiarUpdate::default(), &config).await,
        "State::apply",
        7,
    );
    // The thread stays at its input checkpoint.
    let stored = g.get_state(&config).await.unwrap().unwrap();
    assert_eq!(stored.next, ["lie"]);

    let g = liar_graph(encode_lies, Some(Arc::new(MemorySaver::new())));
    assert_out_of_range(
        g.invoke(LiarUpdate::default(), &RunConfig::thread("liar"))
            .await,
        "State::encode_update",
        9,
    );
    // As input, and streamed as an update.
    let g = liar_graph(LiarUpdate::default, Some(Arc::new(MemorySaver::new())));
    assert_out_of_range(
        g.invoke(encode_lies(), &RunConfig::thread("x")).await,
        "State::encode_update",
        9,
    );
    let g = liar_graph(encode_lies, None);
    let events: Vec<_> = futures::StreamExt::collect::<Vec<_>>(g.stream(
        LiarUpdate::default(),
        RunConfig::default(),
        keel_graph::StreamMode::updates(),
    ))
    .await;
    let last = events.into_iter().last().unwrap();
    assert_out_of_range(last, "State::encode_update", 9);
}

#[tokio::test]
async fn routers_of_one_step_see_their_own_writes_with_a_state_that_copies_only_whole() {
    // `Notes` implements neither `clone_channel_from` nor `swap_channel`: each router
    // gets a copy of the whole state, and still sees only its own node's writes.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut g = StateGraph::<Notes>::new();
    for name in ["a", "b"] {
        let seen = Arc::clone(&seen);
        g = g
            .add_node(name, move |_s, _c| async move {
                Ok(NotesUpdate {
                    notes: Some(vec![name.to_owned()]),
                    status: None,
                })
            })
            .add_edge(START, name)
            .add_conditional_edges(
                name,
                move |s: &Notes| {
                    seen.lock().unwrap().push(s.notes.clone());
                    END
                },
                Some(&[END]),
            );
    }
    let run = g
        .compile()
        .unwrap()
        .invoke(NotesUpdate::default(), &RunConfig::default())
        .await
        .unwrap();
    assert_eq!(run.state.notes, ["a", "b"]);
    assert_eq!(*seen.lock().unwrap(), [vec!["a"], vec!["b"]]);
}
