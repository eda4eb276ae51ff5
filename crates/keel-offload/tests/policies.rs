//! The evict and truncate-arguments policies, each on its own: what they store, what
//! they leave in context, and what happens when the store fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io;
use std::sync::Arc;

use keel_message::{ContentPart, Message, ToolArguments, ToolCall, openai};
use keel_offload::{
    EvictLargeResults, FsStore, Fsync, Key, LineRange, METADATA_KEY, MemoryStore, OffloadStore,
    PolicyEnv, RetrievalTools, StoredWhat, ThreadId, TruncateArguments,
};
use keel_token::{ApproxCounter, TiktokenCounter, TokenCounter};
use serde_json::json;

use common::Faulty;

fn thread() -> ThreadId {
    ThreadId::new("t1").unwrap()
}

/// Tool output that looks like a build log: `lines` numbered lines.
fn log(lines: usize) -> String {
    (1..=lines)
        .map(|i| {
            format!(
                "[{i:05}] compiling crate_{} v0.{}.{} (warnings: {})\n",
                i % 97,
                i % 13,
                i % 7,
                i % 3
            )
        })
        .collect()
}

// ---------------------------------------------------------------- evict

#[test]
fn the_threshold_is_counted_in_tokens_by_the_counter() {
    let counter = TiktokenCounter::o200k_base().unwrap();
    let text = log(400);
    let tokens = counter.count_text(&text);
    // A character proxy would disagree with the real count by a wide margin.
    assert_ne!(tokens, text.chars().count() / 4);
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);

    let at = EvictLargeResults::new().with_threshold(tokens);
    let out = at.apply(vec![Message::tool("call_1", text.clone())], &env);
    assert!(out.stored.is_empty(), "exactly at the threshold stays");
    assert_eq!(out.messages[0].text(), text);

    let under = EvictLargeResults::new().with_threshold(tokens - 1);
    let out = under.apply(vec![Message::tool("call_1", text.clone())], &env);
    assert_eq!(out.stored.len(), 1);
    assert_eq!(
        out.stored[0].what,
        StoredWhat::ToolResult {
            tool_call_id: "call_1".into(),
            tokens,
            lines: 400
        }
    );
    assert_eq!(out.stored[0].path.as_str(), "large_tool_results/call_1");
    assert_eq!(out.stored[0].bytes, text.len() as u64);
    assert_eq!(
        store
            .get(&Key::new("t1", "large_tool_results/call_1").unwrap())
            .unwrap(),
        text
    );
}

#[test]
fn the_default_threshold_is_20k_tokens() {
    assert_eq!(EvictLargeResults::new().threshold_tokens, 20_000);
    let counter = ApproxCounter::new().with_chars_per_token(4);
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let just_under = "x".repeat(80_000); // 20,000 tokens at 4 chars per token
    let over = "x".repeat(80_004);
    let out = EvictLargeResults::new().apply(
        vec![Message::tool("a", just_under), Message::tool("b", over)],
        &env,
    );
    assert_eq!(out.stored.len(), 1);
    assert_eq!(out.stored[0].index, 1);
}

#[test]
fn the_stub_points_at_what_read_file_returns() {
    let counter = ApproxCounter::new();
    let store = Arc::new(MemoryStore::new());
    let t = thread();
    let env = PolicyEnv::new(&*store, &t, &counter);
    let text = log(1000);
    let out = EvictLargeResults::new().with_threshold(100).apply(
        vec![Message::tool("call_9", text.clone()).with_id("m7")],
        &env,
    );
    let stub = out.messages[0].text().into_owned();
    let original: Vec<&str> = text.lines().collect();

    // Head and tail are the original lines with their numbers.
    for (n, line) in [
        (1, original[0]),
        (5, original[4]),
        (996, original[995]),
        (1000, original[999]),
    ] {
        assert!(
            stub.contains(&format!("{n:>6}\t{line}\n")),
            "line {n} missing from\n{stub}"
        );
    }
    assert!(!stub.contains(&format!("{:>6}\t", 6)));
    assert!(stub.contains("990 lines omitted"));
    assert!(stub.contains("1,000 lines"));

    // The stub's advice works: read_file from offset 5 continues at line 6.
    let tools = RetrievalTools::new(store.clone(), t.clone());
    let call = ToolCall::new(
        "c",
        "read_file",
        json!({"path": "large_tool_results/call_9", "offset": 5, "limit": 1}),
    );
    let read = tools.execute(&call).unwrap();
    assert!(
        read.starts_with(&format!("     6\t{}\n", original[5])),
        "{read}"
    );

    // The message keeps its identity and records the eviction.
    let m = &out.messages[0];
    assert_eq!(m.id.as_deref(), Some("m7"));
    assert_eq!(m.tool_call_id.as_deref(), Some("call_9"));
    assert_eq!(
        m.metadata[METADATA_KEY]["evicted"]["path"],
        "large_tool_results/call_9"
    );
    assert_eq!(m.metadata[METADATA_KEY]["evicted"]["lines"], 1000);
    // The line count agrees with the store's own line reading.
    let key = Key::new("t1", "large_tool_results/call_9").unwrap();
    let all = store.read_lines(&key, &LineRange::new(999, 10)).unwrap();
    assert_eq!(all.total_lines, Some(1000));
}

#[test]
fn exempt_tools_are_found_by_name_or_by_their_call() {
    let counter = ApproxCounter::new();
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let big = log(200);
    let messages = vec![
        Message::assistant("").with_tool_calls(vec![
            ToolCall::new("c1", "read_file", json!({"path": "x"})),
            ToolCall::new("c2", "shell", json!({"cmd": "make"})),
            ToolCall::new("c3", "custom_reader", json!({})),
        ]),
        Message::tool("c1", big.clone()),
        Message::tool("c2", big.clone()),
        Message::tool("c3", big.clone()),
        Message::tool("c4", big.clone()).with_name("grep"),
    ];
    let policy = EvictLargeResults::new()
        .with_threshold(10)
        .exempt("custom_reader");
    let out = policy.apply(messages, &env);
    let evicted: Vec<usize> = out.stored.iter().map(|s| s.index).collect();
    assert_eq!(evicted, [2]);
    assert_eq!(out.messages[1].text(), big);
    assert_eq!(out.messages[3].text(), big);
    assert_eq!(out.messages[4].text(), big);
}

#[test]
fn a_call_id_used_again_takes_the_tool_of_its_own_turn() {
    // `call_0` in two turns: the first result is a `read_file` (exempt), the second a
    // `shell` output, which is evicted; so is the third, under a path of its own.
    let counter = ApproxCounter::new();
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let big = log(200);
    let call = |tool: &str| {
        Message::assistant("").with_tool_calls(vec![ToolCall::new("call_0", tool, json!({}))])
    };
    let messages = vec![
        call("read_file"),
        Message::tool("call_0", big.clone()),
        call("shell"),
        Message::tool("call_0", big.clone()),
        call("shell"),
        Message::tool("call_0", log(300)),
    ];
    let out = EvictLargeResults::new()
        .with_threshold(10)
        .apply(messages, &env);
    let evicted: Vec<usize> = out.stored.iter().map(|s| s.index).collect();
    assert_eq!(evicted, [3, 5]);
    assert_eq!(out.messages[1].text(), big);
    assert_ne!(out.stored[0].path, out.stored[1].path);
}

#[test]
fn evicting_twice_changes_nothing_the_second_time() {
    let counter = ApproxCounter::new();
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let policy = EvictLargeResults::new()
        .with_threshold(10)
        .with_preview(50, 50);
    let first = policy.apply(
        vec![Message::tool("c1", log(300)), Message::user("next")],
        &env,
    );
    assert_eq!(first.stored.len(), 1);
    // The stub itself is over the threshold here, and is still not evicted again.
    assert!(counter.count_text(&first.messages[0].text()) > 10);
    let second = policy.apply(first.messages.clone(), &env);
    assert!(second.stored.is_empty());
    assert_eq!(second.messages, first.messages);
}

#[test]
fn a_tool_call_id_used_twice_never_overwrites_the_first_result() {
    let counter = ApproxCounter::new();
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let policy = EvictLargeResults::new().with_threshold(10);
    let (first, second) = (
        format!("first\n{}", log(300)),
        format!("second\n{}", log(300)),
    );
    let mut paths = Vec::new();
    // The same id on two turns, then an empty id twice: four values, four places.
    for (id, text) in [("c", &first), ("c", &second), ("", &first), ("", &second)] {
        let out = policy.apply(vec![Message::tool(id, text.clone())], &env);
        assert!(out.is_complete(), "{:?}", out.failures);
        let path = out.stored[0].path.clone();
        assert!(
            out.messages[0].text().contains(path.as_str()),
            "the stub names {path}"
        );
        assert_eq!(
            store
                .get(&Key::from_parts(t.clone(), path.clone()))
                .unwrap(),
            *text
        );
        paths.push(path);
    }
    assert_eq!(paths[0].as_str(), "large_tool_results/c");
    assert_eq!(paths[1].as_str(), "large_tool_results/c~2");
    assert!(paths[3].as_str().ends_with("~2"), "{}", paths[3]);
    assert_eq!(
        store
            .get(&Key::from_parts(t.clone(), paths[0].clone()))
            .unwrap(),
        first,
        "the first result is still there"
    );
    // The same result stored again (a step run twice after a crash) reuses its place.
    let again = policy.apply(vec![Message::tool("c", second.clone())], &env);
    assert_eq!(again.stored[0].path, paths[1]);
}

#[test]
fn a_tool_call_id_used_twice_keeps_both_truncated_arguments() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let mut input = old_write_calls(2);
    for m in &mut input[..2] {
        m.tool_calls[0].id = "call_0".into();
    }
    let out = TruncateArguments::new().apply_with_usage(input.clone(), &env, 90, 100);
    assert!(out.is_complete());
    let paths: Vec<&str> = out.stored.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "truncated_arguments/call_0/content",
            "truncated_arguments/call_0~2/content"
        ]
    );
    for (i, s) in out.stored.iter().enumerate() {
        let original = input[i].tool_calls[0].arguments.as_json().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            store
                .get(&Key::from_parts(t.clone(), s.path.clone()))
                .unwrap(),
            original
        );
    }
}

#[test]
fn hostile_tool_call_ids_stay_inside_the_namespace() {
    let counter = ApproxCounter::new();
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path().join("root"))
        .unwrap()
        .with_fsync(Fsync::Never);
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let ids = [
        "../../../etc/passwd",
        "/abs",
        "a\0b",
        &"z".repeat(4096),
        "..",
        "",
    ];
    let messages = ids.iter().map(|id| Message::tool(*id, log(50))).collect();
    let out = EvictLargeResults::new()
        .with_threshold(10)
        .apply(messages, &env);
    assert!(out.is_complete(), "{:?}", out.failures);
    assert_eq!(out.stored.len(), ids.len());
    let mut seen = std::collections::HashSet::new();
    for s in &out.stored {
        let p = s.path.as_str();
        assert!(p.starts_with("large_tool_results/"), "{p}");
        assert_eq!(p.matches('/').count(), 1, "{p}");
        assert!(seen.insert(p.to_owned()), "two ids share {p}");
    }
    // Everything landed under the store's root, and nothing next to it.
    let outside: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(outside, ["root"]);
    assert_eq!(store.list(&t, None).unwrap().len(), ids.len());
}

#[test]
fn text_parts_are_evicted_joined_and_images_are_left() {
    let counter = ApproxCounter::new();
    let store = MemoryStore::new();
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let parts = Message::tool(
        "c1",
        vec![ContentPart::text(log(100)), ContentPart::text(log(100))],
    );
    let image = Message::tool(
        "c2",
        vec![
            ContentPart::text(log(100)),
            ContentPart::Image {
                url: "data:image/png;base64,AAAA".into(),
                detail: None,
            },
        ],
    );
    let out = EvictLargeResults::new()
        .with_threshold(10)
        .apply(vec![parts, image.clone()], &env);
    assert_eq!(out.stored.len(), 1);
    let stored = store
        .get(&Key::new("t1", "large_tool_results/c1").unwrap())
        .unwrap();
    assert_eq!(stored, format!("{}{}", log(100), log(100)));
    assert_eq!(out.messages[1], image);
}

#[test]
fn a_full_store_leaves_the_message_in_context() {
    let counter = ApproxCounter::new();
    let small = log(20);
    let big = log(2000);
    // Room for the small result, not for the big one.
    let store = MemoryStore::with_limit(small.len() as u64 + 10);
    let t = thread();
    let env = PolicyEnv::new(&store, &t, &counter);
    let input = vec![
        Message::tool("c1", small.clone()).with_id("m1"),
        Message::tool("c2", big.clone()).with_id("m2"),
    ];
    let out = EvictLargeResults::new()
        .with_threshold(10)
        .apply(input.clone(), &env);
    assert_eq!(out.stored.len(), 1);
    assert_eq!(out.stored[0].index, 0);
    assert_eq!(out.failures.len(), 1);
    let failure = &out.failures[0];
    assert_eq!(
        (failure.index, failure.message_id.as_deref()),
        (1, Some("m2"))
    );
    assert!(failure.error.is_storage_full(), "{}", failure.error);
    // The message that could not be stored is exactly what came in.
    assert_eq!(out.messages[1], input[1]);
    assert_eq!(out.messages.len(), 2);
}

#[test]
fn injected_os_errors_leave_every_policy_s_input_unchanged() {
    let counter = ApproxCounter::new();
    let t = thread();
    for kind in [io::ErrorKind::PermissionDenied, io::ErrorKind::StorageFull] {
        let store = Faulty(kind);
        let env = PolicyEnv::new(&store, &t, &counter);

        let input = vec![Message::tool("c1", log(500)).with_id("m1")];
        let out = EvictLargeResults::new()
            .with_threshold(10)
            .apply(input.clone(), &env);
        assert_eq!(out.messages, input);
        assert!(out.stored.is_empty());
        let e = &out.failures[0].error;
        assert_eq!(
            e.is_permission_denied(),
            kind == io::ErrorKind::PermissionDenied,
            "{e}"
        );
        assert_eq!(
            e.is_storage_full(),
            kind == io::ErrorKind::StorageFull,
            "{e}"
        );

        let input = old_write_calls(3);
        let out =
            TruncateArguments::new()
                .keep_recent(0)
                .apply_with_usage(input.clone(), &env, 100, 100);
        assert_eq!(out.messages, input);
        assert_eq!(out.failures.len(), 3);
    }
}

#[cfg(unix)]
#[test]
fn an_unwritable_directory_leaves_the_message_in_context() {
    let counter = ApproxCounter::new();
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::new(dir.path()).unwrap().with_fsync(Fsync::Never);
    let t = thread();
    std::fs::create_dir(dir.path().join("t1")).unwrap();
    let blocked = dir.path().join("t1/large_tool_results");
    let how = common::block_dir(&blocked);
    eprintln!("unwritable directory made by: {how:?}");

    let env = PolicyEnv::new(&store, &t, &counter);
    let input = vec![Message::tool("c1", log(500)).with_id("m1")];
    let out = EvictLargeResults::new()
        .with_threshold(10)
        .apply(input.clone(), &env);
    common::unblock_dir(&blocked);

    assert_eq!(out.messages, input);
    assert!(out.stored.is_empty());
    let e = &out.failures[0].error;
    match how {
        common::Blocked::ReadOnly => assert!(e.is_permission_denied(), "{e}"),
        common::Blocked::FileInTheWay => assert!(e.to_string().contains("not a directory"), "{e}"),
    }
    // No stray temporary file is left behind either.
    assert_eq!(
        std::fs::read_dir(dir.path().join(".tmp")).unwrap().count(),
        0
    );
}

// ---------------------------------------------------------------- truncate

/// `n` old assistant messages each calling `write_file` with 3,000 characters, plus 20
/// recent ones.
fn old_write_calls(n: usize) -> Vec<Message> {
    let mut messages: Vec<Message> = (0..n)
        .map(|i| {
            Message::assistant("")
                .with_id(format!("a{i}"))
                .with_tool_calls(vec![ToolCall::new(
                    format!("call_{i}"),
                    "write_file",
                    json!({"path": format!("src/f{i}.rs"), "content": format!("// file {i}\n{}", "x = 1;\n".repeat(427))}),
                )])
        })
        .collect();
    messages.extend((0..20).map(|i| Message::user(format!("recent {i}"))));
    messages
}

fn env_parts() -> (MemoryStore, ThreadId, ApproxCounter) {
    (MemoryStore::new(), thread(), ApproxCounter::new())
}

#[test]
fn nothing_happens_below_the_trigger() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let input = old_write_calls(2);
    let out = TruncateArguments::new().apply_with_usage(input.clone(), &env, 84, 100);
    assert_eq!(out.messages, input);
    assert!(out.stored.is_empty());
    assert_eq!(store.bytes(), 0);
}

#[test]
fn long_arguments_of_old_write_calls_become_pointers() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let mut input = old_write_calls(2);
    // Another tool with a long argument, a short write, and a recent long write.
    input.insert(
        0,
        Message::assistant("").with_tool_calls(vec![
            ToolCall::new("s1", "shell", json!({"cmd": "y".repeat(5000)})),
            ToolCall::new("w1", "write_file", json!({"path": "a", "content": "short"})),
        ]),
    );
    input.push(Message::assistant("").with_tool_calls(vec![ToolCall::new(
        "recent",
        "write_file",
        json!({"content": "r".repeat(5000)}),
    )]));
    let original_content = input[1].tool_calls[0].arguments.as_json().unwrap()["content"]
        .as_str()
        .unwrap()
        .to_owned();

    let out = TruncateArguments::new().apply_with_usage(input.clone(), &env, 90, 100);
    assert!(out.is_complete());
    let stored: Vec<(usize, &str)> = out
        .stored
        .iter()
        .map(|s| (s.index, s.path.as_str()))
        .collect();
    assert_eq!(
        stored,
        [
            (1, "truncated_arguments/call_0/content"),
            (2, "truncated_arguments/call_1/content")
        ]
    );
    assert_eq!(
        out.stored[0].what,
        StoredWhat::Argument {
            tool_call_id: "call_0".into(),
            argument: Some("content".into()),
            chars: original_content.chars().count()
        }
    );
    // Untouched: the other tool, the short write, the recent window.
    assert_eq!(out.messages[0], input[0]);
    let n = out.messages.len();
    assert_eq!(out.messages[n - 1], input[n - 1]);

    let args = out.messages[1].tool_calls[0].arguments.as_json().unwrap();
    assert_eq!(args["path"], "src/f0.rs");
    let pointer = args["content"].as_str().unwrap();
    assert!(pointer.starts_with("// file 0\nx = 1;"), "{pointer}");
    assert!(pointer.contains("the full text is stored at truncated_arguments/call_0/content"));
    assert!(pointer.chars().count() < 300);
    let key = Key::new("t1", "truncated_arguments/call_0/content").unwrap();
    assert_eq!(store.get(&key).unwrap(), original_content);
    // The edit is recorded on the message.
    let record = &out.messages[1].metadata[METADATA_KEY]["truncated_arguments"];
    assert_eq!(record[0]["path"], "truncated_arguments/call_0/content");
    // The edited call still exports as valid JSON arguments.
    let wire = openai::to_values(&out.messages[1..2]);
    let raw = wire[0]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(raw).is_ok());
}

#[test]
fn the_prompt_prefix_stays_byte_identical_across_turns() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let policy = TruncateArguments::new();
    let turn1 = policy.apply_with_usage(old_write_calls(3), &env, 95, 100);
    assert_eq!(turn1.stored.len(), 3);
    let prefix = serde_json::to_string(&turn1.messages).unwrap();

    // Next turn: more messages arrive and the trigger fires again, with settings that
    // would edit differently if the policy recomputed old edits.
    let mut next = turn1.messages.clone();
    next.push(Message::user("one more turn"));
    let stricter = TruncateArguments {
        max_chars: 10,
        preview_chars: 3,
        ..TruncateArguments::new()
    };
    let turn2 = stricter.apply_with_usage(next, &env, 95, 100);
    assert!(turn2.stored.is_empty(), "{:?}", turn2.stored);
    let again = serde_json::to_string(&turn2.messages[..turn1.messages.len()]).unwrap();
    assert_eq!(again, prefix);
}

#[test]
fn arguments_that_are_not_json_are_stored_whole() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let raw = format!("{{\"content\": \"{}", "q".repeat(3000)); // cut off: not JSON
    let mut input = vec![Message::assistant("").with_tool_calls(vec![
        ToolCall::from_raw_arguments("c1", "edit_file", raw.clone()),
    ])];
    input.extend((0..20).map(|i| Message::user(format!("{i}"))));
    let out = TruncateArguments::new().apply_with_usage(input, &env, 90, 100);
    assert_eq!(out.stored.len(), 1);
    assert_eq!(out.stored[0].path.as_str(), "truncated_arguments/c1/@raw");
    assert_eq!(
        store
            .get(&Key::new("t1", "truncated_arguments/c1/@raw").unwrap())
            .unwrap(),
        raw
    );
    match &out.messages[0].tool_calls[0].arguments {
        ToolArguments::Invalid(pointer) => assert!(pointer.contains("truncated_arguments/c1/@raw")),
        other => panic!("expected the raw pointer, got {other:?}"),
    }
}

#[test]
fn apply_counts_the_context_with_the_counter() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let input = old_write_calls(1);
    let used = counter.count_messages(&input);
    let policy = TruncateArguments::new();
    // Window so large that the context is far below 85%: nothing happens.
    assert!(
        policy
            .apply(input.clone(), &env, used * 10)
            .stored
            .is_empty()
    );
    // Window so that the context is at 90%: it fires.
    let window = used * 100 / 90;
    assert_eq!(policy.apply(input, &env, window).stored.len(), 1);
}

#[test]
fn configurable_tool_names() {
    let (store, t, counter) = env_parts();
    let env = PolicyEnv::new(&store, &t, &counter);
    let input = old_write_calls(1);
    let none = TruncateArguments::new().with_tools(["str_replace_editor"]);
    assert!(
        none.apply_with_usage(input.clone(), &env, 99, 100)
            .stored
            .is_empty()
    );
    let both = TruncateArguments::new().with_tools(["write_file", "str_replace_editor"]);
    assert_eq!(both.apply_with_usage(input, &env, 99, 100).stored.len(), 1);
}
