//! The retrieval tools as the agent sees them: schemas, outputs, caps, bad calls.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_message::{Role, ToolCall};
use keel_offload::{
    Archive, Key, KeyProblem, MemoryStore, OffloadError, OffloadStore, RetrievalTools, ThreadId,
    ToolError, ToolLimits,
};
use serde_json::{Value, json};

fn setup() -> (Arc<MemoryStore>, RetrievalTools) {
    let store = Arc::new(MemoryStore::new());
    let put = |path: &str, text: &str| store.put(&Key::new("t1", path).unwrap(), text).unwrap();
    put(
        "large_tool_results/call_1",
        &(1..=300)
            .map(|i| format!("result line {i}\n"))
            .collect::<String>(),
    );
    put("large_tool_results/call_2", "alpha\nbeta\n");
    put("truncated_arguments/call_3/content", "fn main() {}\n");
    // Another thread's file, which must stay invisible.
    store
        .put(
            &Key::new("t2", "large_tool_results/secret").unwrap(),
            "beta secret\n",
        )
        .unwrap();
    let tools = RetrievalTools::new(store.clone(), ThreadId::new("t1").unwrap());
    (store, tools)
}

fn call(name: &str, args: Value) -> ToolCall {
    ToolCall::new("c", name, args)
}

/// The last 80 characters, for failure messages.
fn tail(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    chars[chars.len().saturating_sub(80)..].iter().collect()
}

fn run(tools: &RetrievalTools, name: &str, args: Value) -> String {
    tools.execute(&call(name, args)).unwrap()
}

#[test]
fn specs_describe_each_tool_with_a_schema() {
    let (_, tools) = setup();
    let specs = tools.specs();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["ls", "read_file", "grep"]);
    for spec in &specs {
        assert_eq!(spec.parameters["type"], "object");
        assert_eq!(spec.parameters["additionalProperties"], false);
        assert!(!spec.description.is_empty());
        assert!(RetrievalTools::handles(&spec.name));
    }
    assert_eq!(specs[1].parameters["required"], json!(["path"]));
    assert_eq!(specs[1].parameters["properties"]["limit"]["maximum"], 500);
    assert_eq!(specs[2].parameters["required"], json!(["pattern"]));
    assert_eq!(
        specs[2].parameters["properties"]["max_results"]["maximum"],
        200
    );
    assert!(!RetrievalTools::handles("write_file"));
}

#[test]
fn ls_lists_this_thread_only() {
    let (_, tools) = setup();
    assert_eq!(
        run(&tools, "ls", json!({})),
        "3 files:\n\
         large_tool_results/call_1\t4,692 bytes\n\
         large_tool_results/call_2\t11 bytes\n\
         truncated_arguments/call_3/content\t13 bytes"
    );
    assert_eq!(
        run(&tools, "ls", json!({"path": "truncated_arguments"})),
        "1 file under truncated_arguments:\ntruncated_arguments/call_3/content\t13 bytes"
    );
    assert_eq!(
        run(&tools, "ls", Value::Null),
        run(&tools, "ls", json!({"path": "."}))
    );
    let empty = RetrievalTools::new(Arc::new(MemoryStore::new()), ThreadId::new("t9").unwrap());
    assert_eq!(run(&empty, "ls", json!({})), "No files.");
}

#[test]
fn read_file_numbers_lines_and_says_how_to_continue() {
    let (_, tools) = setup();
    let out = run(
        &tools,
        "read_file",
        json!({"path": "large_tool_results/call_1", "offset": 10, "limit": 3}),
    );
    assert_eq!(
        out,
        "    11\tresult line 11\n    12\tresult line 12\n    13\tresult line 13\n\
         [more lines follow: continue with offset=13]"
    );
    let end = run(
        &tools,
        "read_file",
        json!({"path": "large_tool_results/call_1", "offset": 298}),
    );
    assert_eq!(
        end,
        "   299\tresult line 299\n   300\tresult line 300\n[end of file: 300 lines]"
    );
    let past = run(
        &tools,
        "read_file",
        json!({"path": "large_tool_results/call_2", "offset": 9}),
    );
    assert_eq!(past, "Offset 9 is past the end: the file has 2 lines.");
    // The default limit is 100 lines.
    let default = run(
        &tools,
        "read_file",
        json!({"path": "large_tool_results/call_1"}),
    );
    assert_eq!(default.lines().count(), 101);
    assert!(default.ends_with("continue with offset=100]"));
}

#[test]
fn grep_reports_path_and_line() {
    let (_, tools) = setup();
    assert_eq!(
        run(&tools, "grep", json!({"pattern": "beta"})),
        "large_tool_results/call_2:2: beta"
    );
    assert_eq!(
        run(
            &tools,
            "grep",
            json!({"pattern": r"line 7\d$", "path": "large_tool_results/call_1", "max_results": 2})
        ),
        "large_tool_results/call_1:70: result line 70\n\
         large_tool_results/call_1:71: result line 71\n\
         [stopped at 2 matches: narrow the pattern or the path]"
    );
    assert_eq!(
        run(&tools, "grep", json!({"pattern": "zeta"})),
        r#"No lines match "zeta" in 3 files."#
    );
}

#[test]
fn grep_shows_a_match_far_into_a_long_line() {
    // An offloaded result of one 2 MB line (compact JSON, say): reading pages by
    // lines, so grep is how its far end is reached, and it must show the match, not
    // the line's first characters.
    let (store, tools) = setup();
    let line = format!("{}END-MARKER tail", "0123456789abcdef".repeat(125_000));
    store
        .put(
            &Key::new("t1", "large_tool_results/one_line").unwrap(),
            &line,
        )
        .unwrap();
    let out = run(
        &tools,
        "grep",
        json!({"pattern": "END-MARKER", "path": "large_tool_results/one_line"}),
    );
    assert!(
        out.starts_with("large_tool_results/one_line:1: [from byte 1,99"),
        "{out}"
    );
    assert!(out.ends_with("0123456789abcdefEND-MARKER tail"), "{out}");
    // A match near the start shows the line from its start, as before.
    let out = run(
        &tools,
        "grep",
        json!({"pattern": "^0123", "path": "large_tool_results/one_line"}),
    );
    assert!(
        out.starts_with("large_tool_results/one_line:1: 0123456789abcdef"),
        "{out}"
    );
}

#[test]
fn grep_finds_archived_history() {
    let (store, tools) = setup();
    let archive = Archive::new(store.clone());
    let t = ThreadId::new("t1").unwrap();
    archive
        .append(
            &t,
            &[keel_message::Message::user("the deploy key is in vault").with_id("m1")],
        )
        .unwrap();
    let out = run(&tools, "grep", json!({"pattern": "deploy key"}));
    assert!(
        out.starts_with("archive/messages.jsonl:1: {\"seq\":0,\"id\":\"m1\""),
        "{out}"
    );
}

#[test]
fn every_output_is_capped() {
    let store = Arc::new(MemoryStore::new());
    let line = "é".repeat(5_000);
    let text: String = (0..600).map(|_| format!("{line}\n")).collect();
    store.put(&Key::new("t1", "big").unwrap(), &text).unwrap();
    for i in 0..300 {
        store
            .put(&Key::new("t1", format!("many/f{i:03}")).unwrap(), "x\n")
            .unwrap();
    }
    let limits = ToolLimits::default();
    let tools = RetrievalTools::new(store, ThreadId::new("t1").unwrap());

    // Long lines are cut, and the whole output stops at the character cap.
    let out = run(&tools, "read_file", json!({"path": "big", "limit": 500}));
    assert!(
        out.chars().count() <= limits.max_output_chars,
        "{}",
        out.len()
    );
    let first = out.lines().next().unwrap();
    assert_eq!(
        first.chars().filter(|&c| c == 'é').count(),
        limits.max_line_chars
    );
    assert!(first.ends_with("é… [line cut]"), "{}", tail(first));
    assert!(out.ends_with("continue with offset=14]"), "{}", tail(&out));

    // A limit above the maximum is lowered to it.
    let ok = run(
        &tools,
        "read_file",
        json!({"path": "many/f000", "limit": 100_000}),
    );
    assert_eq!(ok, "     1\tx\n[end of file: 1 line]");

    // ls shows at most max_ls_entries.
    let ls = run(&tools, "ls", json!({"path": "many"}));
    assert_eq!(ls.lines().count(), 1 + limits.max_ls_entries + 1);
    assert!(ls.ends_with("[list cut short: pass a narrower path to see the rest]"));

    // grep caps results, line length and output.
    let grep = run(&tools, "grep", json!({"pattern": "é", "max_results": 1000}));
    // The note that says so included.
    assert!(grep.chars().count() <= limits.max_output_chars);
    assert!(grep.contains("é… [line cut]"));
}

#[test]
fn bad_calls_are_typed_errors_with_clear_messages() {
    let (_, tools) = setup();
    let err = |name: &str, args: Value| tools.execute(&call(name, args)).unwrap_err();

    assert!(matches!(
        err("write_file", json!({})),
        ToolError::UnknownTool { .. }
    ));
    let e = err("read_file", json!({}));
    assert_eq!(
        e.to_string(),
        "read_file: bad arguments: `path` is required"
    );
    let e = err("read_file", json!({"path": "x", "lines": 3}));
    assert_eq!(
        e.to_string(),
        "read_file: bad arguments: unknown argument `lines` (expected path, offset, limit)"
    );
    let e = err("read_file", json!({"path": "x", "offset": -1}));
    assert_eq!(
        e.to_string(),
        "read_file: bad arguments: `offset` must be an integer of at least 0, got -1"
    );
    let e = err("read_file", json!({"path": "x", "limit": 0}));
    assert!(matches!(
        e,
        ToolError::BadArguments {
            tool: "read_file",
            ..
        }
    ));
    let e = err("read_file", json!({"path": 7}));
    assert_eq!(
        e.to_string(),
        "read_file: bad arguments: `path` must be a string"
    );
    let e = err("grep", json!({"pattern": "(unclosed"}));
    assert!(
        e.to_string()
            .starts_with("grep: bad arguments: invalid pattern \"(unclosed\""),
        "{e}"
    );
    let e = err("ls", json!(["not", "an", "object"]));
    assert_eq!(
        e.to_string(),
        "ls: bad arguments: arguments must be a JSON object"
    );
    let broken = ToolCall::from_raw_arguments("c", "grep", "{pattern: x");
    let e = tools.execute(&broken).unwrap_err();
    assert_eq!(
        e.to_string(),
        "grep: bad arguments: arguments are not valid JSON: \"{pattern: x\""
    );

    // Escapes and odd paths are refused by the key rules.
    for (path, want) in [
        ("../../etc/passwd", KeyProblem::ParentDir),
        ("/etc/passwd", KeyProblem::Absolute),
        ("large_tool_results/\0", KeyProblem::Nul),
    ] {
        match err("read_file", json!({ "path": path })) {
            ToolError::Store {
                source: OffloadError::InvalidKey { problem, .. },
                ..
            } => assert_eq!(problem, want, "{path:?}"),
            other => panic!("{path:?}: {other}"),
        }
    }
    let long = "a".repeat(4096);
    assert!(
        err("ls", json!({ "path": long }))
            .to_string()
            .contains("4096 bytes long")
    );
    // Another thread's file does not exist from here, and the error names the path
    // as the model gave it (not the store's key, which starts with the thread id).
    let e = err("read_file", json!({"path": "large_tool_results/secret"}));
    assert_eq!(
        e.to_string(),
        "read_file: large_tool_results/secret: no such file"
    );
    let e = err("ls", json!({"path": "archive"}));
    assert_eq!(e.to_string(), "ls: archive: no such file");
}

#[test]
fn respond_answers_the_call_even_on_error() {
    let (_, tools) = setup();
    let ok = tools.respond(&ToolCall::new("c7", "grep", json!({"pattern": "alpha"})));
    assert_eq!(ok.role, Role::Tool);
    assert_eq!(ok.tool_call_id.as_deref(), Some("c7"));
    assert_eq!(ok.name.as_deref(), Some("grep"));
    assert_eq!(ok.text(), "large_tool_results/call_2:1: alpha");
    let bad = tools.respond(&ToolCall::new("c8", "read_file", json!({"path": "../x"})));
    assert_eq!(bad.tool_call_id.as_deref(), Some("c8"));
    assert!(
        bad.text()
            .starts_with("Error: read_file: invalid path \"../x\""),
        "{}",
        bad.text()
    );
}
