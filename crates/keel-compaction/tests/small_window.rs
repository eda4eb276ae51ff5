//! A small window whose fixed part (system prompt, goal, tool specs) takes a large
//! share of the budget: compaction must free room that lasts, not one step's worth at
//! every step, and the prompt must still never pass the budget.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use keel_compaction::{CompactionConfig, Compactor, ContextState, EventKind, GoalAnchor};
use keel_message::{Message, ToolCall, ToolSpec};
use keel_offload::{Archive, MemoryStore, ThreadId};
use keel_summarize::ExtractiveSummarizer;
use keel_token::{ApproxCounter, Encoding, ModelProfile, TokenCounter};
use serde_json::json;

const STEPS: usize = 160;

/// A deterministic stream of numbers (an LCG), so the run is the same every time.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % below as u64) as usize
    }
}

/// One step of a code survey: a listing, a file read or a grep, with a result of the
/// size such tools return (a few lines to a few dozen).
fn survey_step(i: usize, rng: &mut Lcg) -> (Message, Vec<Message>) {
    let (tool, args, result) = match rng.next(3) {
        0 => {
            let n = 4 + rng.next(30);
            let listing: String = (0..n)
                .map(|k| {
                    format!(
                        "crates/part-{i}/src/module_{k}.rs  {} bytes\n",
                        900 + 37 * k
                    )
                })
                .collect();
            (
                "ls",
                json!({"path": format!("crates/part-{i}/src")}),
                listing,
            )
        }
        1 => {
            let n = 10 + rng.next(60);
            let file: String = (0..n)
                .map(|k| {
                    format!(
                        "{:>6}\tlet value_{k} = compute_{i}_{k}(&input, Options::default())?;\n",
                        k + 1
                    )
                })
                .collect();
            (
                "read_file",
                json!({"path": format!("crates/part-{i}/src/lib.rs")}),
                file,
            )
        }
        _ => {
            let n = 3 + rng.next(30);
            let hits: String = (0..n)
                .map(|k| {
                    format!(
                        "crates/part-{k}/src/lib.rs:{}: fn handle_{i}(request: Request) -> Result<Response, Error> {{\n",
                        10 + k * 7
                    )
                })
                .collect();
            ("grep", json!({"pattern": format!("handle_{i}")}), hits)
        }
    };
    let reply = Message::assistant(format!("Step {i}: next, {tool}."))
        .with_tool_calls(vec![ToolCall::new(format!("c{i}"), tool, args)]);
    (reply, vec![Message::tool(format!("c{i}"), result)])
}

fn tools() -> Vec<ToolSpec> {
    ["ls", "read_file", "grep", "write_file", "edit_file"]
        .iter()
        .map(|name| {
            ToolSpec::new(
                *name,
                format!("The {name} tool of the survey: works on files under the root directory, returns text, and fails with a message naming the path when it cannot."),
                json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "A path relative to the root."},
                        "pattern": {"type": "string", "description": "A regular expression."}
                    },
                    "required": ["path"]
                }),
            )
        })
        .collect()
}

/// Four characters a token, whatever they are: the sizes below were chosen for it.
fn flat() -> ApproxCounter {
    ApproxCounter::new().with_chars_per_token(4)
}

/// Runs the survey on a `window`-token model with `config`; returns the compactor, the
/// final state and the prompt's tokens after each step.
async fn survey(window: usize, config: CompactionConfig) -> (Compactor, ContextState, Vec<usize>) {
    let compactor = Compactor::new(
        Arc::new(ExtractiveSummarizer::new().with_counter(Arc::new(flat()))),
        Arc::new(Archive::new(Arc::new(MemoryStore::new()))),
        ThreadId::new("small").unwrap(),
        Arc::new(flat()),
        ModelProfile::new("small", window, window / 4, Encoding::Approximate),
    )
    .with_config(config);
    let tools = tools();
    let system: String = (0..8)
        .map(|k| format!("Rule {k}: survey the repository with the file tools, read before you conclude, and cite the path and line of every fact you report.\n"))
        .collect();
    let mut state = ContextState::new(GoalAnchor::new(
        "Survey this repository: list its crates, read their entry points, and report what each one does and how they depend on each other.",
    ))
    .with_system(Message::system(system));
    let mut rng = Lcg(7);
    let mut prompts = Vec::with_capacity(STEPS);
    for i in 0..STEPS {
        let (reply, results) = survey_step(i, &mut rng);
        compactor.push_step(&mut state, reply, results);
        compactor.after_step(&mut state, &tools).await.unwrap();
        prompts.push(compactor.tokens(&mut state, &tools).total);
    }
    (compactor, state, prompts)
}

#[tokio::test]
async fn a_small_window_compacts_when_it_frees_room_that_lasts() {
    let (compactor, mut state, prompts) = survey(4_096, CompactionConfig::default()).await;
    // The prompt never passes the budget.
    for (i, &tokens) in prompts.iter().enumerate() {
        assert!(
            tokens <= compactor.budget(),
            "step {i}: a {tokens}-token prompt passes the {}-token budget",
            compactor.budget()
        );
    }
    let peak = prompts.iter().copied().max().unwrap_or(0);
    let tools = tools();
    let t = compactor.tokens(&mut state, &tools);
    let fixed = t.system + t.goal + t.tools;
    // The scenario is the one that churned: a fixed part near a third of the 3,072-token
    // budget and steps of about 450 tokens.
    assert!((750..=950).contains(&fixed), "fixed part {fixed}");
    let counter = flat();
    let mut rng = Lcg(7);
    let raw: usize = (0..STEPS)
        .map(|i| {
            let (reply, results) = survey_step(i, &mut rng);
            counter.count_message(&reply) + counter.count_messages(&results)
        })
        .sum();
    let per_step = raw / STEPS;
    assert!((350..=600).contains(&per_step), "{per_step} tokens a step");

    eprintln!(
        "fixed {fixed}, {per_step} tokens a step, peak {peak}, {} milestones",
        state.milestones_made
    );
    let milestones: Vec<_> = state
        .events
        .iter()
        .filter(|e| e.error.is_none() && e.messages_archived > 0)
        .collect();
    assert_eq!(milestones.len() as u64, state.milestones_made);
    // Each milestone moves at least a quarter of the room (2,611 - fixed) out of the
    // prompt: the cut keeps only the newest step, so it frees what has gathered
    // since the last one, not one step's worth.
    let room = compactor.threshold() - fixed;
    for e in &milestones {
        let freed = e.tokens_before - e.tokens_after;
        assert!(
            freed >= room / 4,
            "step {}: a milestone freed {freed} tokens of a {room}-token room ({} -> {})",
            e.step,
            e.tokens_before,
            e.tokens_after
        );
    }
    // Hence a milestone every two and a half steps or more (with steps of ~450 tokens and
    // about 1,800 tokens of room, one every step or two churned before).
    assert!(
        milestones.len() <= STEPS * 2 / 5,
        "{} milestones in {STEPS} steps",
        milestones.len()
    );
    // Below the budget a milestone waited until it freed enough: the prompt went past
    // the threshold.
    assert!(peak > compactor.threshold(), "peak {peak}");
    assert!(state.events.iter().any(|e| e.kind == EventKind::Epoch));
}

#[tokio::test]
async fn compacting_at_the_threshold_whatever_it_frees_is_still_available() {
    // `min_token_gain(0.0)` and `summary_share(1.0)`: the token trigger fires at the
    // threshold however little the milestone frees, and the summaries are sized from
    // the budget alone (as before both settings): it compacts far more often.
    let eager = CompactionConfig::default()
        .with_min_token_gain(0.0)
        .with_summary_share(1.0);
    let (eager_compactor, eager_state, eager_prompts) = survey(4_096, eager).await;
    let (_, state, _) = survey(4_096, CompactionConfig::default()).await;
    let over = eager_prompts
        .iter()
        .filter(|&&t| t > eager_compactor.budget())
        .count();
    eprintln!(
        "eager {} milestones ({over} prompts over the budget), default {}",
        eager_state.milestones_made, state.milestones_made
    );
    assert!(
        eager_state.milestones_made > state.milestones_made * 4 / 3,
        "eager {} vs default {}",
        eager_state.milestones_made,
        state.milestones_made
    );
}

#[tokio::test]
async fn a_roomy_window_is_not_held_back() {
    // From 16k up the defaults' summary budgets fit their share of the room, and every
    // milestone frees far more than the floor: the default compacts exactly as the
    // eager configuration (no floor, summaries sized from the budget alone) does.
    let eager = CompactionConfig::default()
        .with_min_token_gain(0.0)
        .with_summary_share(1.0);
    for window in [16_000, 128_000] {
        let (_, default, _) = survey(window, CompactionConfig::default()).await;
        let (_, before, _) = survey(window, eager.clone()).await;
        eprintln!(
            "{window}: {} milestones by default, {} eager",
            default.milestones_made, before.milestones_made
        );
        assert!(default.milestones_made > 0, "{window}");
        let events = |s: &ContextState| {
            s.events
                .iter()
                .map(|e| (e.step, e.trigger, e.kind, e.tokens_before, e.tokens_after))
                .collect::<Vec<_>>()
        };
        assert_eq!(events(&default), events(&before), "{window}");
        assert_eq!(default.raw, before.raw, "{window}");
    }
}

#[tokio::test]
async fn a_waiting_milestone_keeps_the_prompt_within_max_prompt_tokens() {
    // A roomy window held to a 3,072-token prompt: a milestone that would free little
    // waits only while the prompt fits that ceiling, not the model's whole budget.
    let config = CompactionConfig::default().with_max_prompt_tokens(Some(3_072));
    let (compactor, _state, prompts) = survey(16_000, config).await;
    assert_eq!(compactor.prompt_budget(), 3_072);
    for (i, &tokens) in prompts.iter().enumerate() {
        assert!(
            tokens <= compactor.prompt_budget(),
            "step {i}: a {tokens}-token prompt passes the 3,072-token ceiling"
        );
    }
}
