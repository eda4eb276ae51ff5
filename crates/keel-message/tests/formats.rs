//! Import/export of keel's own format, OpenAI chat messages and LangChain dicts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_message::{
    Content, ContentPart, FormatError, Message, Problem, Role, ToolArguments, ToolCall, langchain,
    openai,
};
use serde_json::{Value, json};

/// One import case: `input` must import; exporting it again must give `input` back.
fn check_openai_identity(input: Value) {
    let msgs = openai::from_values(input.as_array().unwrap()).unwrap();
    assert_eq!(Value::Array(openai::to_values(&msgs)), input);
}

/// One failing case: importing `input` must fail with exactly `expected` as its message.
fn check_error(result: Result<Vec<Message>, FormatError>, expected: &str) {
    match result {
        Ok(m) => panic!("expected error `{expected}`, imported {m:?}"),
        Err(e) => assert_eq!(e.to_string(), expected),
    }
}

fn rich_history() -> Vec<Message> {
    vec![
        Message::system("Be terse.").with_id("s"),
        Message::user(vec![
            ContentPart::text("what is in "),
            ContentPart::Image {
                url: "data:image/png;base64,AAAA".into(),
                detail: Some("low".into()),
            },
            ContentPart::Other(json!({"type": "input_audio", "input_audio": {"data": "x"}})),
        ])
        .with_id("u")
        .with_name("alice"),
        Message::assistant("Looking.")
            .with_id("a")
            .with_tool_calls(vec![
                ToolCall::new("c1", "read", json!({"z": 1, "a": [true, null]})),
                ToolCall::from_raw_arguments("c2", "sh", "{\"cmd\": \"ls"),
            ]),
        Message::tool("c1", "ok ✓ ünïcödé")
            .with_id("t1")
            .with_name("read"),
        Message::tool("c2", "").with_id("t2"),
    ]
}

#[test]
fn own_format_is_lossless() {
    let history = rich_history()
        .into_iter()
        .map(|m| m.with_metadata("k", json!({"nested": [1, 2]})))
        .collect::<Vec<_>>();
    let text = serde_json::to_string(&history).unwrap();
    let back: Vec<Message> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, history);
    // Invalid arguments survive byte for byte.
    assert_eq!(
        back[2].tool_calls[1].arguments,
        ToolArguments::Invalid("{\"cmd\": \"ls".into())
    );
}

#[test]
fn own_format_rejects_unknown_role_by_name() {
    let err = serde_json::from_str::<Message>(r#"{"role":"robot","content":""}"#).unwrap_err();
    assert!(err.to_string().contains("robot"), "{err}");
}

#[test]
fn openai_round_trip_keeps_every_field_the_format_has() {
    check_openai_identity(json!([
        {"role": "developer", "content": "rules"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
         "name": "bob"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\":1,\"a\":2}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json {"}}],
         "refusal": null},
        {"role": "tool", "content": "r1", "tool_call_id": "c1"},
        {"role": "tool", "content": "r2", "tool_call_id": "c2", "name": "g"},
        {"role": "assistant", "content": "done", "thought": "SWE-agent keeps extra keys"},
    ]));
}

#[test]
fn openai_import_maps_roles_and_flags_invalid_arguments() {
    let msgs = openai::from_json(
        br#"[{"role":"developer","content":"x"},
             {"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{oops"}}]}]"#,
    )
    .unwrap();
    assert_eq!(msgs[0].role, Role::System);
    assert!(msgs[1].has_invalid_tool_arguments());
    assert_eq!(msgs[1].content, Content::Text(String::new()));
}

#[test]
fn a_legacy_function_call_beside_tool_calls_is_not_a_second_call() {
    // llama-cpp-python's function-calling chat formats send both shapes for one call,
    // the old one with a name of its own making.
    let wire = json!([
        {"role": "user", "content": "List it."},
        {"role": "assistant", "content": null,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "ls", "arguments": "{}"}}],
         "function_call": {"name": "ls:", "arguments": "{}"}},
        {"role": "tool", "tool_call_id": "call_1", "content": "a b"}
    ]);
    let msgs = openai::from_values(wire.as_array().unwrap()).unwrap();
    assert_eq!(msgs[1].tool_calls.len(), 1, "{:?}", msgs[1].tool_calls);
    assert_eq!(msgs[1].tool_calls[0].name, "ls");
    assert_eq!(msgs[1].tool_calls[0].id, "call_1");
    let one = openai::from_value(&wire[1]).unwrap();
    assert_eq!(one.tool_calls.len(), 1);
    assert_eq!(one.tool_calls[0].id, "call_1");
    let out = openai::to_values(&msgs);
    assert!(out[1].get("function_call").is_none(), "{}", out[1]);
}

#[test]
fn openai_legacy_function_calls_import_as_tool_calls_with_made_ids() {
    let wire = json!([
        {"role": "user", "content": "Weather in Paris, then Rome?"},
        {"role": "assistant", "content": null,
         "function_call": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
        {"role": "function", "name": "weather", "content": "18C"},
        {"role": "assistant", "content": null,
         "function_call": {"name": "weather", "arguments": "{\"city\":\"Rome\"}"}},
        {"role": "function", "name": "weather", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."}
    ]);
    let from_bytes = openai::from_json(wire.to_string().as_bytes()).unwrap();
    let msgs = openai::from_values(wire.as_array().unwrap()).unwrap();
    assert_eq!(from_bytes, msgs);
    // Each call has an id of its own, and each result answers the call before it.
    assert_eq!(msgs[1].tool_calls.len(), 1);
    assert_eq!(msgs[1].tool_calls[0].name, "weather");
    assert_eq!(
        msgs[1].tool_calls[0].arguments,
        ToolArguments::Json(json!({"city": "Paris"}))
    );
    assert_eq!(msgs[1].tool_calls[0].id, "function-call-1");
    assert_eq!(msgs[2].role, Role::Tool);
    assert_eq!(msgs[2].tool_call_id.as_deref(), Some("function-call-1"));
    assert_eq!(msgs[3].tool_calls[0].id, "function-call-3");
    assert_eq!(msgs[4].tool_call_id.as_deref(), Some("function-call-3"));
    // No trace of the legacy fields is kept: they export in the current shape.
    let out = openai::to_values(&msgs);
    assert!(out[1].get("function_call").is_none(), "{}", out[1]);
    assert_eq!(out[1]["tool_calls"][0]["id"], "function-call-1");
    assert_eq!(out[2]["role"], "tool");
    // One message alone: a call and a result pair by name.
    let call = openai::from_value(&wire[1]).unwrap();
    let result = openai::from_value(&wire[2]).unwrap();
    assert_eq!(call.tool_calls[0].id, "function-call-weather");
    assert_eq!(
        result.tool_call_id.as_deref(),
        Some("function-call-weather")
    );
    // A function result without a name cannot be paired.
    check_error(
        openai::from_values(&[json!({"role": "function", "content": "18C"})]),
        "message 0: field `name`: missing",
    );
}

#[test]
fn keel_to_openai_and_back_keeps_what_openai_can_express() {
    let history = rich_history();
    let back = openai::from_values(&openai::to_values(&history)).unwrap();
    // OpenAI messages carry no id: everything else survives.
    let without_ids: Vec<Message> = history
        .into_iter()
        .map(|mut m| {
            m.id = None;
            m
        })
        .collect();
    assert_eq!(back, without_ids);
}

#[test]
fn keel_to_langchain_and_back_is_identity() {
    let history = rich_history();
    let dicts = langchain::to_values(&history);
    assert_eq!(dicts[2]["type"], "ai");
    assert_eq!(
        dicts[2]["tool_calls"][0]["args"],
        json!({"z": 1, "a": [true, null]})
    );
    assert_eq!(dicts[2]["invalid_tool_calls"][0]["args"], "{\"cmd\": \"ls");
    assert_eq!(langchain::from_values(&dicts).unwrap(), history);
}

#[test]
fn openai_arguments_text_is_kept_byte_for_byte() {
    check_openai_identity(
        json!([{"role": "assistant", "content": null, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1,  \"a\": [2]}"}}]}]),
    );
    let m = openai::from_json(br#"[{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":"{\"a\": 1}"}}]}]"#).unwrap();
    assert_eq!(
        m[0].tool_calls[0].arguments.as_json(),
        Some(&json!({"a": 1}))
    );
    let own = serde_json::to_string(&m[0]).unwrap();
    let back = serde_json::from_str::<Message>(&own).unwrap();
    assert_eq!(back.tool_calls[0].arguments.to_json_string(), r#"{"a": 1}"#);
}

#[test]
fn langchain_accepts_messages_to_dict_wrapper_and_keeps_extras() {
    let input = json!([
        {"type": "human", "data": {"content": "hi", "type": "human", "id": "1",
                                   "additional_kwargs": {}, "response_metadata": {}, "example": false}},
        {"type": "ai", "content": "x", "id": "2",
         "usage_metadata": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
         "response_metadata": {"model_name": "m"}, "tool_calls": [], "invalid_tool_calls": []},
        {"type": "tool", "content": "r", "tool_call_id": "c", "id": "3", "status": "error",
         "artifact": null},
    ]);
    let msgs = langchain::from_values(input.as_array().unwrap()).unwrap();
    assert_eq!(msgs[0].role, Role::User);
    assert_eq!(msgs[0].id.as_deref(), Some("1"));
    let out = langchain::to_values(&msgs);
    assert_eq!(out[0]["example"], false);
    assert_eq!(out[1]["usage_metadata"]["total_tokens"], 4);
    assert_eq!(out[1]["response_metadata"]["model_name"], "m");
    assert_eq!(out[2]["status"], "error");
    assert_eq!(langchain::from_values(&out).unwrap(), msgs);
}

#[test]
fn input_in_the_wrong_shape_says_what_to_pass() {
    // An empty file, not "EOF while parsing a value at line 1 column 0".
    check_error(
        openai::from_json(b""),
        "the input is empty: expected a JSON array of messages",
    );
    check_error(
        langchain::from_json(b" \n "),
        "the input is empty: expected a JSON array of messages",
    );
    // A logged chat request body, or a LangGraph state: the list is one field down.
    let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    let err = openai::from_json(body).unwrap_err();
    assert_eq!(
        err,
        FormatError::ListInObject {
            field: "messages",
            module: "openai"
        }
    );
    assert_eq!(
        err.to_string(),
        "expected a JSON array of messages, found an object with one in its `messages` field: \
         pass that array (`openai::from_values(&body[\"messages\"])`)"
    );
    check_error(
        langchain::from_json(br#"{"messages":[{"type":"human","content":"hi"}]}"#),
        "expected a JSON array of messages, found an object with one in its `messages` field: \
         pass that array (`langchain::from_values(&body[\"messages\"])`)",
    );
    // JSON Lines: one message per line is not one array.
    check_error(
        openai::from_json(
            b"{\"role\":\"user\",\"content\":\"a\"}\n{\"role\":\"user\",\"content\":\"b\"}\n",
        ),
        "malformed JSON at line 2, column 1: trailing characters (the input holds more than one \
         JSON value: JSON Lines? Read each line with `from_value`)",
    );
    // Trailing garbage after one array is not called JSON Lines.
    check_error(
        openai::from_json(b"[] x"),
        "malformed JSON at line 1, column 4: trailing characters",
    );
}

#[test]
fn malformed_input_names_what_and_where() {
    check_error(
        openai::from_json(b"[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]"),
        "invalid UTF-8 at byte offset 27",
    );
    check_error(
        openai::from_json(b"[{\"role\": \"user\",\n \"content\": }]"),
        "malformed JSON at line 2, column 13: expected value",
    );
    check_error(
        openai::from_json(br#"{"role":"user"}"#),
        "expected a JSON array of messages, found an object",
    );
    check_error(
        openai::from_json(br#"[{"role":"user","content":"a"},{"role":"critic","content":"b"}]"#),
        "message 1: field `role`: unknown role `critic`",
    );
    check_error(
        openai::from_json(br#"[{"content":"a"}]"#),
        "message 0: field `role`: missing",
    );
    check_error(
        openai::from_json(br#"[{"role":"tool","content":"a"}]"#),
        "message 0: field `tool_call_id`: missing",
    );
    check_error(
        openai::from_json(br#"[{"role":"user","content":42}]"#),
        "message 0: field `content`: expected a string or an array of parts, found a number",
    );
    check_error(
        openai::from_json(
            br#"[{"role":"user","content":""},{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}},{"id":"b","function":{"arguments":"{}"}}]}]"#,
        ),
        "message 1: field `tool_calls[1].function.name`: missing",
    );
    check_error(
        openai::from_json(br#"[{"role":"assistant","tool_calls":[{"id":"a","type":"custom","function":{"name":"f"}}]}]"#),
        "message 0: field `tool_calls[0].type`: unknown message type `custom`",
    );
    check_error(
        openai::from_json(br#"[7]"#),
        "message 0: field `(message)`: expected an object, found a number",
    );
    check_error(
        langchain::from_json(br#"[{"type":"chat","content":"x"}]"#),
        "message 0: field `type`: unknown message type `chat`",
    );
    check_error(
        langchain::from_json(br#"[{"type":"tool","content":"x"}]"#),
        "message 0: field `tool_call_id`: missing",
    );
    check_error(
        langchain::from_json(br#"[{"type":"ai","content":"x","tool_calls":{"a":1}}]"#),
        "message 0: field `tool_calls`: expected an array, found an object",
    );
}

#[test]
fn errors_are_typed() {
    let err = openai::from_json(br#"[{"role":"robot"}]"#).unwrap_err();
    assert_eq!(
        err,
        FormatError::Field {
            index: Some(0),
            field: "role".into(),
            problem: Problem::UnknownRole("robot".into()),
        }
    );
}

#[test]
fn a_fifty_megabyte_message_round_trips() {
    let big = "x".repeat(50 << 20);
    let m = Message::tool("c", big.as_str());
    let wire = serde_json::to_vec(&openai::to_values(std::slice::from_ref(&m))).unwrap();
    let back = openai::from_json(&wire).unwrap();
    assert_eq!(back[0].text().len(), 50 << 20);
}

/// Every tau-bench trajectory imports, and exports back to the very same JSON.
#[test]
fn real_tau_bench_trajectories_round_trip() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/tau-bench/gpt-4o-airline.json");
    let Ok(bytes) = std::fs::read(&path) else {
        eprintln!(
            "skipped: {} is absent (shared trajectories are only in CI)",
            path.display()
        );
        return;
    };
    let runs: Vec<Value> = serde_json::from_slice(&bytes).unwrap();
    let mut total = 0;
    for (i, run) in runs.iter().enumerate() {
        let traj = run["traj"].as_array().unwrap();
        let msgs = openai::from_values(traj).unwrap_or_else(|e| panic!("run {i}: {e}"));
        total += msgs.len();
        assert_eq!(&openai::to_values(&msgs), traj, "run {i}");
    }
    assert_eq!(runs.len(), 200);
    assert!(total > 5_000, "{total}");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn text() -> impl Strategy<Value = String> {
        "[a-z ü✓\"\\\\{}]{0,12}"
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|n| json!(n)),
            text().prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn tool_call() -> impl Strategy<Value = ToolCall> {
        (
            "[a-z0-9]{1,6}",
            "[a-z_]{1,8}",
            json_value(),
            any::<bool>(),
            text(),
        )
            .prop_map(|(id, name, args, valid, raw)| {
                if valid {
                    ToolCall::new(id, name, args)
                } else {
                    ToolCall::from_raw_arguments(id, name, format!("{{{raw}"))
                }
            })
    }

    fn message() -> impl Strategy<Value = Message> {
        (
            0..4u8,
            text(),
            prop::option::of("[a-z0-9-]{1,8}"),
            prop::option::of("[a-z]{1,5}"),
            prop::collection::vec(tool_call(), 0..3),
            "[a-z0-9]{1,6}",
        )
            .prop_map(|(role, content, id, name, calls, call_id)| {
                let mut m = match role {
                    0 => Message::system(content),
                    1 => Message::user(content),
                    2 => Message::assistant(content).with_tool_calls(calls),
                    _ => Message::tool(call_id, content),
                };
                m.id = id;
                m.name = name;
                m
            })
    }

    proptest! {
        #[test]
        fn own_format_round_trips(m in message()) {
            let text = serde_json::to_string(&m).unwrap();
            prop_assert_eq!(serde_json::from_str::<Message>(&text).unwrap(), m);
        }

        #[test]
        fn langchain_round_trips(m in message()) {
            prop_assume!(m.tool_calls.iter().all(|c| !c.id.is_empty()));
            let back = langchain::from_value(&langchain::to_value(&m)).unwrap();
            // LangChain lists valid calls before invalid ones.
            let mut expected = m.clone();
            expected.tool_calls.sort_by_key(|c| !c.arguments.is_valid());
            prop_assert_eq!(back, expected);
        }

        #[test]
        fn openai_round_trips_all_but_the_id(m in message()) {
            let back = openai::from_value(&openai::to_value(&m)).unwrap();
            let mut expected = m.clone();
            expected.id = None;
            prop_assert_eq!(back, expected);
        }
    }
}
