//! LlmSummarizer: prompts, bounded input, checked replies, failures.

use std::sync::Arc;

use keel_message::{Message, ToolCall};
use keel_model::{
    ChatResponse, FinishReason, ModelError, OpenAiConfig, OpenAiModel, ScriptedModel, Turn, Usage,
};
use keel_summarize::{
    ARTIFACTS, EPOCH_V1, GOAL_METADATA_KEY, LlmSummarizer, MILESTONE_V1, NEXT_STEPS, Rejection,
    STRUCTURED_V1, SUMMARY, SummarizeError, Summarizer, SummaryFormat, SummaryRequest,
};
use keel_token::{ApproxCounter, TokenCounter};
use serde_json::json;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

fn steps() -> Vec<Message> {
    vec![
        Message::user("The nightly build fails; find out why."),
        Message::assistant("Running the build.").with_tool_calls(vec![ToolCall::new(
            "c1",
            "sh",
            json!({"cmd": "make all"}),
        )]),
        Message::tool(
            "c1",
            "gcc -c net.c\nnet.c:88: error: 'MSG_NOSIGNAL' undeclared\nexit status 2",
        ),
    ]
}

const STRUCTURED_REPLY: &str = "SESSION INTENT:\n- find why the nightly build fails\nSUMMARY:\n- `make all` fails: net.c:88: error: 'MSG_NOSIGNAL' undeclared\nARTIFACTS:\n- make all (exit status 2)\nNEXT STEPS:\n- none\n";

fn scripted(turns: impl IntoIterator<Item = Turn>) -> Arc<ScriptedModel> {
    Arc::new(ScriptedModel::new(turns).with_name("summarizer-1b"))
}

#[tokio::test]
async fn milestone_prompt_and_summary() {
    let model = scripted([Turn::text(
        "Here is the note:\n- Build fails: net.c:88: error: 'MSG_NOSIGNAL' undeclared\n- Cause not yet known",
    )
    .with_usage(Usage::new(300, 25))]);
    let summarizer = LlmSummarizer::new(model.clone());
    let msgs = steps();
    let summary = summarizer
        .summarize(&SummaryRequest::milestone(&msgs, 200).previous("- Cloned the repo"))
        .await
        .unwrap();
    assert_eq!(summary.prompt_version, "milestone-v1");
    assert_eq!(summary.model, "summarizer-1b");
    assert_eq!(summary.usage, Some(Usage::new(300, 25)));
    assert_eq!(
        summary.text,
        "- Build fails: net.c:88: error: 'MSG_NOSIGNAL' undeclared\n- Cause not yet known\n"
    );
    assert_eq!(summary.section(SUMMARY).map(<[String]>::len), Some(2));

    let request = &model.requests()[0];
    assert_eq!(request.options.temperature, Some(0.0));
    assert_eq!(request.options.max_tokens, Some(200));
    assert!(request.tools.is_empty());
    assert_eq!(request.messages.len(), 2);
    assert_eq!(request.messages[0].text(), MILESTONE_V1.system);
    let user = request.messages[1].text();
    assert!(user.starts_with("Previous milestone summary:\n- Cloned the repo\n\nMessages to summarize (3, oldest first):\n[1] user: The nightly build fails"));
    assert!(user.contains("-> calls sh({\"cmd\":\"make all\"}) [id c1]"));
    assert!(user.contains("[3] tool result (sh, c1): gcc -c net.c\n    net.c:88"));
    assert!(user.ends_with("Write the milestone summary now, in at most 200 tokens."));
}

#[tokio::test]
async fn epoch_uses_the_epoch_template() {
    let model = scripted([Turn::text("- Step one done; step two failed on a timeout")]);
    let notes = [
        Message::assistant("- step one done"),
        Message::assistant("- step two failed: timeout"),
    ];
    let summary = LlmSummarizer::new(model.clone())
        .summarize(&SummaryRequest::epoch(&notes, 100))
        .await
        .unwrap();
    assert_eq!(summary.prompt_version, EPOCH_V1.version);
    assert!(
        model.requests()[0].messages[1]
            .text()
            .contains("Milestone notes to summarize (2, oldest first)")
    );
}

#[tokio::test]
async fn the_goal_is_refused_before_any_call() {
    let model = scripted([Turn::text("- x")]);
    let mut msgs = steps();
    msgs.insert(
        0,
        Message::system("GOAL: make the nightly build green")
            .with_metadata(GOAL_METADATA_KEY, json!(true)),
    );
    let err = LlmSummarizer::new(model.clone())
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SummarizeError::GoalInInput { index: 0 }),
        "{err:?}"
    );
    assert!(
        model.requests().is_empty(),
        "the model never saw the request"
    );
}

#[tokio::test]
async fn structured_reply_missing_a_section_is_retried_once_then_accepted() {
    let model = scripted([
        Turn::text("SUMMARY:\n- build fails\nARTIFACTS:\n- make all")
            .with_usage(Usage::new(100, 10)),
        Turn::text(STRUCTURED_REPLY).with_usage(Usage::new(130, 40)),
    ]);
    let msgs = steps();
    let summary = LlmSummarizer::new(model.clone())
        .with_format(SummaryFormat::Structured)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap();
    assert_eq!(summary.prompt_version, STRUCTURED_V1.version);
    assert_eq!(summary.usage, Some(Usage::new(230, 50)));
    assert_eq!(summary.sections.len(), 4);
    assert_eq!(
        summary.section(NEXT_STEPS),
        Some(&[][..]),
        "`- none` is no item"
    );
    assert_eq!(
        summary.section(ARTIFACTS),
        Some(&["make all (exit status 2)".to_owned()][..])
    );
    assert_eq!(summary.text, STRUCTURED_REPLY);
    let retry = &model.requests()[1].messages;
    assert_eq!(retry.len(), 4);
    assert!(
        retry[3]
            .text()
            .contains("rejected: the reply lacks the sections SESSION INTENT, NEXT STEPS")
    );
}

#[tokio::test]
async fn structured_reply_missing_sections_twice_is_rejected() {
    let model = scripted([Turn::text("All good."), Turn::text("SUMMARY:\n- all good")]);
    let msgs = steps();
    let err = LlmSummarizer::new(model)
        .with_format(SummaryFormat::Structured)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap_err();
    match err {
        SummarizeError::Rejected {
            reason: Rejection::MissingSections(missing),
            attempts: 2,
        } => assert_eq!(missing, ["SESSION INTENT", "ARTIFACTS", "NEXT STEPS"]),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn empty_truncated_over_budget_and_too_many_bullets_are_rejected() {
    let msgs = steps();
    let mut cut_off = ChatResponse::new(Message::assistant("- a very long"), "m");
    cut_off.finish_reason = Some(FinishReason::Length);
    let long = format!("- {}", "word ".repeat(400));
    let six = "- net.c:88 fails\n- b\n- c\n- d\n- e\n- f";
    let cases: Vec<(Vec<Turn>, Rejection)> = vec![
        (vec![Turn::text(""), Turn::text("  \n")], Rejection::Empty),
        (
            vec![Turn::Reply(cut_off.clone()), Turn::Reply(cut_off)],
            Rejection::Truncated,
        ),
        (
            vec![Turn::text(long.clone()), Turn::text(long)],
            // "-" and 400 words, a token each, and a quarter more.
            Rejection::OverBudget {
                tokens: 502,
                budget: 100,
            },
        ),
        (
            vec![Turn::text(six), Turn::text(six)],
            Rejection::TooManyBullets { found: 6, max: 5 },
        ),
        (
            vec![Turn::text("no bullets"), Turn::text("still none")],
            Rejection::NoBullets,
        ),
    ];
    for (turns, expected) in cases {
        let err = LlmSummarizer::new(scripted(turns))
            .summarize(&SummaryRequest::milestone(&msgs, 100))
            .await
            .unwrap_err();
        match err {
            SummarizeError::Rejected { reason, attempts } => {
                assert_eq!((reason, attempts), (expected, 2));
            }
            other => panic!("{other:?}"),
        }
    }
    // Six bullets are fine for an epoch.
    let ok = LlmSummarizer::new(scripted([Turn::text(six)]))
        .summarize(&SummaryRequest::epoch(&msgs, 100))
        .await
        .unwrap();
    assert_eq!(ok.sections[0].items.len(), 6);
}

#[tokio::test]
async fn a_failing_provider_is_an_error_never_a_summary() {
    let msgs = steps();
    for error in [
        ModelError::Connection("connection refused".into()),
        ModelError::Timeout(std::time::Duration::from_secs(30)),
        ModelError::ContextOverflow {
            message: "too long".into(),
        },
    ] {
        let err = LlmSummarizer::new(scripted([Turn::fail(error)]))
            .summarize(&SummaryRequest::milestone(&msgs, 100))
            .await
            .unwrap_err();
        assert!(matches!(err, SummarizeError::Model(_)), "{err:?}");
    }
}

#[tokio::test]
async fn input_is_capped_per_message_and_fitted_by_head_and_tail() {
    let counter = ApproxCounter::new();
    let msgs: Vec<Message> = (0..200)
        .map(|i| {
            Message::tool(
                format!("c{i}"),
                format!("OUTPUT-{i:03} {}", "x".repeat(5_000)),
            )
        })
        .collect();
    let model = scripted([Turn::text("- OUTPUT-000 to OUTPUT-199 were printed")]);
    LlmSummarizer::new(model.clone())
        .with_window_tokens(8_000)
        .summarize(&SummaryRequest::milestone(&msgs, 500))
        .await
        .unwrap();
    let prompt = &model.requests()[0].messages;
    let user = prompt[1].text();
    assert!(user.contains("OUTPUT-000"), "the head is kept");
    assert!(user.contains("OUTPUT-199"), "the tail is kept");
    assert!(!user.contains("OUTPUT-100"), "the middle is left out");
    assert!(user.contains("messages omitted …]"));
    assert!(user.contains("characters omitted…]"), "each message capped");
    // Each message keeps at most 1,500 characters of its text.
    assert!(!user.contains(&"x".repeat(1_500)));
    let prompt_tokens = counter.count_messages(prompt);
    assert!(
        prompt_tokens + 500 <= 8_000,
        "prompt {prompt_tokens} + budget fits the window"
    );
    // The tail gets more of the window than the head.
    let kept: Vec<usize> = (0..200)
        .filter(|i| user.contains(&format!("OUTPUT-{i:03}")))
        .collect();
    let head = kept.iter().take_while(|&&i| i < 100).count();
    assert!(kept.len() - head > head, "{kept:?}");
}

#[tokio::test]
async fn a_window_too_small_for_the_budget_is_an_error() {
    let msgs = steps();
    let err = LlmSummarizer::new(scripted([]))
        .with_window_tokens(300)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SummarizeError::BudgetTooSmall { .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_budget_no_acceptable_reply_fits_is_refused_before_any_call() {
    let msgs = steps();
    for (format, budget) in [(SummaryFormat::Bullets, 1), (SummaryFormat::Structured, 12)] {
        let model = scripted([]);
        let err = LlmSummarizer::new(model.clone())
            .with_format(format)
            .summarize(&SummaryRequest::milestone(&msgs, budget))
            .await
            .unwrap_err();
        match err {
            SummarizeError::BudgetTooSmall {
                budget: given,
                needed,
            } => assert!(given == budget && needed > budget, "{given} {needed}"),
            other => panic!("{format:?}: {other:?}"),
        }
        assert!(
            model.requests().is_empty(),
            "{format:?}: the model was called"
        );
    }
    // The smallest structured reply (every heading, `- none`) fits its own count.
    let skeleton =
        "SESSION INTENT:\n- none\nSUMMARY:\n- none\nARTIFACTS:\n- none\nNEXT STEPS:\n- none\n";
    let needed = ApproxCounter::new().count_text(skeleton);
    let err = LlmSummarizer::new(scripted([Turn::text(skeleton), Turn::text(skeleton)]))
        .with_format(SummaryFormat::Structured)
        .summarize(&SummaryRequest::milestone(&msgs, needed))
        .await
        .unwrap_err();
    // Past the budget check, it is the grounding check that refuses it.
    assert!(
        matches!(
            err,
            SummarizeError::Rejected {
                reason: Rejection::Unrelated,
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn end_to_end_over_an_openai_compatible_server() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "x", "object": "chat.completion", "created": 1, "model": "smollm2",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": STRUCTURED_REPLY}}],
            "usage": {"prompt_tokens": 210, "completion_tokens": 52, "total_tokens": 262}
        })))
        .mount(&server)
        .await;
    let model = Arc::new(
        OpenAiModel::new(OpenAiConfig::new("smollm2").base_url(format!("{}/v1", server.uri())))
            .unwrap(),
    );
    let msgs = steps();
    let summary = LlmSummarizer::new(model)
        .with_format(SummaryFormat::Structured)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap();
    assert_eq!(summary.model, "smollm2");
    assert_eq!(summary.usage, Some(Usage::new(210, 52)));
    let sent: serde_json::Value = server.received_requests().await.unwrap()[0]
        .body_json()
        .unwrap();
    assert_eq!(sent["temperature"], 0.0);
    assert_eq!(sent["max_tokens"], 200);
    assert_eq!(sent["messages"][0]["content"], STRUCTURED_V1.system);
}

#[tokio::test]
async fn an_http_provider_error_is_a_summarize_error() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_raw("{not json", "application/json"))
        .mount(&server)
        .await;
    let model = Arc::new(
        OpenAiModel::new(OpenAiConfig::new("m").base_url(format!("{}/v1", server.uri()))).unwrap(),
    );
    let msgs = steps();
    let err = LlmSummarizer::new(model)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SummarizeError::Model(ModelError::Malformed(_))),
        "{err:?}"
    );
}

/// An OpenAI-compatible server answering every call with 200 and `content`.
#[allow(clippy::unwrap_used)]
async fn misbehaving_server(content: &str) -> (MockServer, Arc<OpenAiModel>) {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "id": "x", "object": "chat.completion", "created": 1, "model": "proxy",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}]
        })))
        .mount(&server)
        .await;
    let model = Arc::new(
        OpenAiModel::new(OpenAiConfig::new("proxy").base_url(format!("{}/v1", server.uri())))
            .unwrap(),
    );
    (server, model)
}

#[tokio::test]
async fn a_provider_error_written_as_bullets_is_rejected_not_stored() {
    // Proxies and gateways that answer 200 with their error as the message content.
    let msgs = steps();
    for content in [
        "- Error: rate limit exceeded for model proxy\n- Please try again in 20s",
        "- 500 Internal Server Error\n- The server encountered an unexpected condition",
        "- upstream connect error or disconnect/reset before headers",
        "- You exceeded your current quota, please check your plan and billing details",
        "SESSION INTENT:\n- none\nSUMMARY:\n- Internal server error\nARTIFACTS:\n- none\nNEXT STEPS:\n- retry later",
    ] {
        let (server, model) = misbehaving_server(content).await;
        let format = if content.starts_with("SESSION") {
            SummaryFormat::Structured
        } else {
            SummaryFormat::Bullets
        };
        let err = LlmSummarizer::new(model)
            .with_format(format)
            .summarize(&SummaryRequest::milestone(&msgs, 200))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                SummarizeError::Rejected {
                    reason: Rejection::ProviderError(_),
                    attempts: 2
                }
            ),
            "{content}: {err:?}"
        );
        let retry: serde_json::Value = server.received_requests().await.unwrap()[1]
            .body_json()
            .unwrap();
        assert!(
            retry["messages"][3]["content"]
                .as_str()
                .is_some_and(|m| m.contains("looks like a provider error")),
            "{retry}"
        );
    }
}

#[tokio::test]
async fn a_reply_with_nothing_from_the_span_is_rejected() {
    let msgs = steps();
    let (_server, model) =
        misbehaving_server("- Paris is the capital of France\n- Water boils at 100 degrees").await;
    let err = LlmSummarizer::new(model)
        .summarize(&SummaryRequest::milestone(&msgs, 200))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            SummarizeError::Rejected {
                reason: Rejection::Unrelated,
                attempts: 2
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_summary_that_quotes_an_error_from_the_span_is_kept() {
    // The span itself is about rate limits and a 500: a faithful summary says so, and
    // names what the span names.
    let msgs = vec![
        Message::user("Mirror the issues of acme/widgets."),
        Message::assistant("").with_tool_calls(vec![ToolCall::new(
            "c1",
            "http_get",
            json!({"url": "https://api.github.com/repos/acme/widgets/issues"}),
        )]),
        Message::tool(
            "c1",
            "HTTP 403: API rate limit exceeded for 203.0.113.7. Then HTTP 500 Internal Server Error.",
        ),
    ];
    for reply in [
        "- GET api.github.com/repos/acme/widgets/issues failed: `API rate limit exceeded`, then a 500 Internal Server Error\n- Issues of acme/widgets not mirrored yet",
        "- rate limit exceeded on the widgets issues endpoint",
    ] {
        let summary = LlmSummarizer::new(scripted([Turn::text(reply)]))
            .summarize(&SummaryRequest::milestone(&msgs, 200))
            .await
            .unwrap();
        assert!(summary.text.contains("rate limit exceeded"), "{reply}");
    }
}

/// An Ollama client run with `num_ctx` gives the summarizer its window, not the
/// model's builtin profile (llama3.1: 131,072 tokens).
#[test]
fn the_summarizer_takes_the_window_the_client_runs_the_model_with() {
    let small =
        keel_model::OllamaModel::new(keel_model::OllamaConfig::new("llama3.1:8b").num_ctx(4_096))
            .unwrap();
    let summarizer = LlmSummarizer::new(Arc::new(small));
    assert!(
        format!("{summarizer:?}").contains("window_tokens: 4096"),
        "{summarizer:?}"
    );
    let unset = keel_model::OllamaModel::new(keel_model::OllamaConfig::new("llama3.1:8b")).unwrap();
    let summarizer = LlmSummarizer::new(Arc::new(unset));
    assert!(
        format!("{summarizer:?}").contains("window_tokens: 131072"),
        "{summarizer:?}"
    );
}
