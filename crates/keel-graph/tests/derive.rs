//! `#[derive(State)]` end to end: the generated update type, setters, `State` impl and
//! `Command` conversion, against the real reducers.

use std::collections::VecDeque;

use keel_graph::reducer::{
    AddMessages, AddMessagesUpdate, KeepLast, Messages, ReduceError, Reducer, Sum,
};
use keel_graph::{Command, State, StateError};
use keel_message::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// A chat agent's state: one channel per standard reducer kind.
#[derive(Clone, Debug, PartialEq, State)]
pub struct Chat {
    /// The conversation.
    #[reducer(AddMessages)]
    pub messages: Messages,
    /// No attribute: `LastValue<String>`.
    pub mood: String,
    /// The last three notes.
    #[reducer(KeepLast<String>, with = KeepLast::new(3))]
    pub recent: VecDeque<String>,
    /// Tokens spent.
    #[reducer(Sum<u64>)]
    pub tokens: u64,
}

fn say(id: &str, text: &str) -> AddMessagesUpdate {
    AddMessagesUpdate::append([Message::user(text).with_id(id)])
}

fn notes(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn channels_are_the_fields_in_order() {
    assert_eq!(Chat::CHANNELS, ["messages", "mood", "recent", "tokens"]);
    assert_eq!(keel_graph::channel_index::<Chat>("recent"), Some(2));
}

#[test]
fn empty_is_every_reducers_empty() {
    let s = Chat::empty();
    assert!(s.messages.is_empty());
    assert_eq!(s.mood, "");
    assert!(s.recent.is_empty());
    assert_eq!(s.tokens, 0);
}

#[test]
fn apply_folds_each_channel_and_reports_the_written_ones() -> TestResult {
    let mut s = Chat::empty();
    let written = s.apply(vec![
        ChatUpdate::default()
            .tokens(5)
            .recent(notes(&["a"]))
            .messages(say("1", "hi")),
        ChatUpdate::default(),
        ChatUpdate::default()
            .recent(notes(&["b", "c", "d"]))
            .tokens(7),
    ])?;
    assert_eq!(written, [0, 2, 3]);
    assert_eq!(s.tokens, 12);
    assert_eq!(s.recent, ["b", "c", "d"]);
    assert_eq!(s.messages.len(), 1);
    assert_eq!(s.mood, "");

    assert_eq!(
        s.apply(vec![ChatUpdate::default().mood("calm".into())])?,
        [1]
    );
    assert_eq!(s.mood, "calm");

    let before = s.clone();
    assert!(s.apply(Vec::new())?.is_empty());
    assert!(s.apply(vec![ChatUpdate::default()])?.is_empty());
    assert_eq!(s, before);
    Ok(())
}

#[test]
fn last_value_refuses_two_writes_and_names_the_channel() {
    let mut s = Chat::empty();
    let err = s
        .apply(vec![
            ChatUpdate::default().mood("a".into()),
            ChatUpdate::default().mood("b".into()),
        ])
        .err();
    match &err {
        Some(StateError::Reduce { channel, source }) => {
            assert_eq!(*channel, "mood");
            assert_eq!(*source, ReduceError::InvalidUpdate { writes: 2 });
        }
        other => panic!("expected a reduce error on `mood`, got {other:?}"),
    }
    assert!(
        err.map(|e| e.to_string())
            .unwrap_or_default()
            .contains("`mood`")
    );
}

#[test]
fn setters_replace_and_fields_are_public() {
    let u = ChatUpdate::default().tokens(1).tokens(2);
    assert_eq!(u.tokens, Some(2));
    assert!(u.mood.is_none());
    let u = ChatUpdate {
        mood: Some("x".into()),
        ..ChatUpdate::default()
    };
    assert_eq!(u.mood.as_deref(), Some("x"));
}

#[test]
fn update_converts_into_a_command() {
    let c: Command<Chat> = ChatUpdate::default().tokens(3).into();
    assert_eq!(c.update.and_then(|u| u.tokens), Some(3));
}

#[test]
fn update_debug_lists_the_written_channels() {
    assert_eq!(format!("{:?}", ChatUpdate::default()), "ChatUpdate");
    assert_eq!(
        format!(
            "{:?}",
            ChatUpdate::default().tokens(3).recent(notes(&["x"]))
        ),
        r#"ChatUpdate { recent: ["x"], tokens: 3 }"#
    );
}

#[test]
fn encode_update_then_decode_update_round_trips() -> TestResult {
    let u = ChatUpdate::default()
        .messages(say("1", "hi"))
        .tokens(4)
        .recent(notes(&["n"]));
    let encoded = Chat::encode_update(&u)?;
    let indexes: Vec<usize> = encoded.iter().map(|(i, _)| *i).collect();
    assert_eq!(indexes, [0, 2, 3]);
    assert_eq!(encoded[1].1, json!(["n"]));
    assert_eq!(encoded[2].1, json!(4));

    let back = Chat::decode_update(&encoded)?;
    assert_eq!(back.messages, u.messages);
    assert_eq!(back.mood, None);
    assert_eq!(back.recent, u.recent);
    assert_eq!(back.tokens, u.tokens);
    assert_eq!(Chat::encode_update(&back)?, encoded);

    assert!(Chat::encode_update(&ChatUpdate::default())?.is_empty());
    Ok(())
}

#[test]
fn decode_update_keeps_the_last_value_given_for_a_channel() -> TestResult {
    let u = Chat::decode_update(&[(3, json!(1)), (1, json!("m")), (3, json!(2))])?;
    assert_eq!(u.tokens, Some(2));
    assert_eq!(u.mood.as_deref(), Some("m"));
    Ok(())
}

#[test]
fn unknown_channel_indexes_are_errors() {
    let mut s = Chat::empty();
    assert!(matches!(
        Chat::decode_update(&[(4, json!(1))]),
        Err(StateError::UnknownChannel { channel }) if channel == "#4"
    ));
    assert!(matches!(
        s.encode_channel(9),
        Err(StateError::UnknownChannel { .. })
    ));
    assert!(matches!(
        s.restore_channel(4, json!(0)),
        Err(StateError::UnknownChannel { .. })
    ));
    assert!(matches!(
        s.fold_channel(4, vec![]),
        Err(StateError::UnknownChannel { .. })
    ));
}

fn busy_chat() -> Result<Chat, StateError> {
    let mut s = Chat::empty();
    s.apply(vec![
        ChatUpdate::default()
            .messages(say("1", "hi").then(say("2", "there")))
            .mood("glad".into())
            .recent(notes(&["a", "b", "c", "d"]))
            .tokens(9),
    ])?;
    Ok(s)
}

#[test]
fn encode_channel_then_restore_channel_round_trips() -> TestResult {
    let s = busy_chat()?;
    let mut restored = Chat::empty();
    for i in 0..Chat::CHANNELS.len() {
        restored.restore_channel(i, s.encode_channel(i)?)?;
    }
    assert_eq!(restored, s);
    assert_eq!(s.encode_channel(2)?, json!(["b", "c", "d"]));
    assert_eq!(s.encode_channel(1)?, json!("glad"));
    Ok(())
}

/// Folds steps the way a checkpointer replays them: each step's updates encoded,
/// grouped by channel, and folded channel by channel.
fn replay(steps: &[Vec<ChatUpdate>]) -> Result<Chat, StateError> {
    let mut s = Chat::empty();
    for step in steps {
        let mut per_channel: Vec<Vec<Value>> = vec![Vec::new(); Chat::CHANNELS.len()];
        for u in step {
            for (i, v) in Chat::encode_update(u)? {
                per_channel[i].push(v);
            }
        }
        for (i, delta) in per_channel.into_iter().enumerate() {
            s.fold_channel(i, delta)?;
        }
    }
    Ok(s)
}

#[test]
fn fold_channel_equals_apply() -> TestResult {
    let steps = || {
        vec![
            vec![
                ChatUpdate::default().messages(say("1", "hi")).tokens(2),
                ChatUpdate::default()
                    .recent(notes(&["a", "b"]))
                    .tokens(3)
                    .mood("curious".into()),
            ],
            vec![],
            vec![
                ChatUpdate::default()
                    .messages(say("1", "hello").then(say("2", "again")))
                    .recent(notes(&["c", "d"])),
            ],
            vec![
                ChatUpdate::default().mood("done".into()),
                ChatUpdate::default().messages(AddMessagesUpdate::remove(["2"])),
            ],
        ]
    };
    let mut applied = Chat::empty();
    for step in steps() {
        applied.apply(step)?;
    }
    let folded = replay(&steps())?;
    assert_eq!(folded, applied);
    assert_eq!(applied.messages.len(), 1);
    assert_eq!(applied.messages[0].text(), "hello");
    assert_eq!(applied.recent, ["b", "c", "d"]);
    assert_eq!(applied.tokens, 5);
    assert_eq!(applied.mood, "done");

    // The same refusal either way.
    let mut s = Chat::empty();
    let err = s.fold_channel(1, vec![json!("a"), json!("b")]).err();
    assert!(matches!(
        err,
        Some(StateError::Reduce {
            channel: "mood",
            ..
        })
    ));
    Ok(())
}

fn decode_channel(err: Result<impl std::fmt::Debug, StateError>) -> Option<String> {
    match err {
        Err(StateError::Decode { channel, .. }) => Some(channel),
        _ => None,
    }
}

#[test]
fn mismatched_json_is_a_decode_error_naming_the_channel() {
    let mut s = Chat::empty();
    assert_eq!(
        decode_channel(s.restore_channel(3, json!("many"))).as_deref(),
        Some("tokens")
    );
    assert_eq!(
        decode_channel(s.fold_channel(2, vec![json!(["ok"]), json!({"not": "a list"})])).as_deref(),
        Some("recent")
    );
    assert_eq!(
        decode_channel(Chat::decode_update(&[(1, json!(7))])).as_deref(),
        Some("mood")
    );
    assert_eq!(s, Chat::empty(), "a failed decode leaves the state alone");
}

/// An update type without `Debug`.
#[derive(Clone, Serialize, Deserialize)]
pub struct Longer(String);

/// Keeps the longest string of at least `min` bytes.
pub struct Longest {
    min: usize,
}

impl Reducer for Longest {
    type Value = String;
    type Update = Longer;

    fn empty(&self) -> String {
        String::new()
    }

    fn reduce(&self, current: &mut String, updates: Vec<Longer>) -> Result<(), ReduceError> {
        for Longer(u) in updates {
            if u.len() >= self.min && u.len() > current.len() {
                *current = u;
            }
        }
        Ok(())
    }
}

/// A custom reducer built with `with =`, a renamed update type and a raw field name.
#[derive(Clone, Debug, PartialEq, State)]
#[state(update = Patch)]
struct Draft {
    #[reducer(Longest, with = Longest { min: 3 })]
    r#type: String,
    count: Option<u8>,
}

#[test]
fn custom_reducer_renamed_update_and_raw_field() -> TestResult {
    assert_eq!(Draft::CHANNELS, ["type", "count"]);
    let mut d = Draft::empty();
    let written = d.apply(vec![
        Patch::default().r#type(Longer("ab".into())),
        Patch::default()
            .r#type(Longer("abcd".into()))
            .count(Some(1)),
        Patch::default().r#type(Longer("abc".into())),
    ])?;
    assert_eq!(written, [0, 1]);
    assert_eq!(d.r#type, "abcd");
    assert_eq!(d.count, Some(1));
    assert_eq!(
        format!(
            "{:?}",
            Patch::default().r#type(Longer("x".into())).count(None)
        ),
        "Patch { type: .., count: None }"
    );
    let _: Command<Draft> = Patch::default().into();
    Ok(())
}

/// A state without channels.
#[derive(Clone, Debug, PartialEq, State)]
struct Nothing {}

#[test]
fn a_state_without_channels() -> TestResult {
    assert!(Nothing::CHANNELS.is_empty());
    let mut n = Nothing::empty();
    assert!(n.apply(vec![NothingUpdate::default()])?.is_empty());
    assert!(Nothing::encode_update(&NothingUpdate::default())?.is_empty());
    assert!(Nothing::decode_update(&[]).is_ok());
    assert!(Nothing::decode_update(&[(0, json!(1))]).is_err());
    assert!(n.encode_channel(0).is_err());
    assert_eq!(format!("{:?}", NothingUpdate::default()), "NothingUpdate");
    Ok(())
}

/// keel-graph under another path, as the facade crate re-exports it (`keel::graph`).
mod reexport {
    pub use keel_graph as graph;
}

/// States whose generated code reaches keel-graph through `crate::reexport::graph`
/// (`#[state(crate = ..)]`, as a string and as a bare path), not `::keel_graph`.
mod through_a_reexport {
    use crate::reexport::graph;
    use graph::reducer::Sum;

    #[derive(Clone, Debug, PartialEq, graph::State)]
    #[state(crate = "crate::reexport::graph")]
    pub struct Counter {
        #[reducer(Sum<i64>)]
        pub total: i64,
        /// A `LastValue` channel: the default reducer is named through the path too.
        pub label: String,
    }

    #[derive(Clone, Debug, PartialEq, graph::State)]
    #[state(crate = super::reexport::graph, update = Bump)]
    pub struct Bare {
        #[reducer(Sum<u8>)]
        pub n: u8,
    }

    #[derive(Clone, Debug, PartialEq, graph::State)]
    #[state(crate = "self::graph")]
    pub struct Empty {}
}

#[test]
fn the_crate_attribute_reaches_keel_graph_through_a_reexport() -> TestResult {
    use reexport::graph::{END, RunConfig, START, StateGraph};
    use through_a_reexport::{Bare, Bump, Counter, CounterUpdate, Empty, EmptyUpdate};

    assert_eq!(Counter::CHANNELS, ["total", "label"]);
    let mut c = Counter::empty();
    assert_eq!(
        c.apply(vec![
            CounterUpdate::default().total(2),
            CounterUpdate::default().total(3).label("five".into()),
        ])?,
        [0, 1]
    );
    assert_eq!((c.total, c.label.as_str()), (5, "five"));
    let mut b = Bare::empty();
    b.apply(vec![Bump::default().n(4)])?;
    assert_eq!(b.n, 4);
    assert!(Empty::CHANNELS.is_empty());
    let _: Command<Empty> = EmptyUpdate::default().into();

    // And it runs in a graph like any state.
    let graph = StateGraph::<Counter>::new()
        .add_node("add", |_s, _c| async {
            Ok(CounterUpdate::default().total(40).label("done".into()))
        })
        .add_edge(START, "add")
        .add_edge("add", END)
        .compile()?;
    let run = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(graph.invoke(CounterUpdate::default().total(2), &RunConfig::default()))?;
    assert_eq!(run.state.total, 42);
    assert_eq!(run.state.label, "done");
    Ok(())
}
