//! The repository tour that `agent_sqlite` and `agent_postgres` both run: the agent's
//! settings, a scripted policy standing in for the model, one tool of its own, and a
//! printer for the run's stream. Only the checkpointer and the offload store differ
//! between the two.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use keel::agent::tools::FileTools;
use keel::agent::{Agent, AgentEvent, AgentUpdate};
use keel::checkpoint::Checkpointer;
use keel::compaction::CompactionConfig;
use keel::message::{Message, Role, Tool, ToolCall, ToolContext, ToolError, ToolFuture, ToolSpec};
use keel::model::{ChatResponse, PolicyModel};
use keel::offload::{EvictLargeResults, OffloadStore};
use serde_json::{Value, json};

/// The agent; both "processes" build the same one.
pub fn build_agent(
    repo: &Path,
    saver: Arc<dyn Checkpointer>,
    store: Arc<dyn OffloadStore>,
) -> Result<Agent, Box<dyn Error>> {
    Ok(Agent::builder()
        // The model's name picks its profile: gpt-4o's window, exact o200k counts.
        .model(Arc::new(scripted_agent(repo)?))
        .system("You are a coding agent. Explore the repository with your tools.")
        .goal("Tour the keel repository: list its crates, read their manifests and public types, then describe each crate in one line.")
        .file_tools(FileTools::new(repo)?.read_only())
        .tool(Arc::new(LineCounts {
            root: repo.to_owned(),
        }))
        .checkpointer(saver)
        .offload_store(store)
        // Results over 2,000 tokens go to the offload store; a stub stays in context.
        // (Results of `ls`, `read_file` and `grep` never do: the policy exempts those
        // names, which the file tools share with the retrieval tools.)
        .evict(Some(EvictLargeResults::new().with_threshold(2_000)))
        .compaction(
            CompactionConfig::default()
                .with_every_steps(Some(10))
                // The raw tail kept in full at a milestone. The default (2.5% of the
                // input budget, at most 2,000 tokens) would keep all ten of these short
                // steps, and the step trigger would have nothing to move.
                .with_keep_recent_tokens(500)
                .with_epoch_every(3),
        )
        .build()?)
}

/// A deterministic stand-in for an LLM. The tour is a script of tool calls; what it
/// says about the results is read from the prompt (the last tool result it was sent).
fn scripted_agent(repo: &Path) -> Result<PolicyModel, Box<dyn Error>> {
    let crates = crate_names(repo)?;
    let mut script: Vec<(&'static str, Value)> =
        vec![("ls", json!({})), ("ls", json!({"path": "crates"}))];
    for c in &crates {
        let manifest = format!("crates/{c}/Cargo.toml");
        script.push(("read_file", json!({"path": manifest, "limit": 4})));
    }
    for c in &crates {
        let src = format!("crates/{c}/src");
        let pattern = "^pub (struct|enum|trait) ";
        script.push((
            "grep",
            json!({"pattern": pattern, "path": src, "max_results": 5}),
        ));
    }
    // A large result: over the eviction threshold, so it is offloaded; the next step
    // reads part of it back from the path its stub names.
    script.push(("line_counts", json!({"path": "crates"})));
    script.push(("read_back", Value::Null));
    script.push((
        "grep",
        json!({"pattern": "^description = ", "path": "crates", "glob": "Cargo.toml", "max_results": 50}),
    ));

    let calls = AtomicUsize::new(0);
    Ok(PolicyModel::new("gpt-4o", move |prompt, _tools| {
        let last = prompt.last();
        let last_text = last.map(|m| m.text().into_owned()).unwrap_or_default();
        let call = |id: String, tool: &str, args: Value| vec![ToolCall::new(id, tool, args)];
        let reply = match last {
            // A question from the user: grep for the `identifier` it names.
            Some(m) if m.role == Role::User && last_text.contains('`') => {
                let ident = last_text.split('`').nth(1).unwrap_or_default();
                let args = json!({"pattern": format!(r"\b{ident}\b"), "glob": "*.rs"});
                Message::assistant(format!("Searching for {ident}.")).with_tool_calls(call(
                    format!("ask_{}", prompt.len()),
                    "grep",
                    args,
                ))
            }
            // The result of that search: the line that defines it.
            Some(m)
                if m.tool_call_id
                    .as_deref()
                    .is_some_and(|id| id.starts_with("ask_")) =>
            {
                let hit = last_text
                    .lines()
                    .find(|l| l.contains(": pub "))
                    .unwrap_or("nowhere I can find");
                Message::assistant(format!("It is defined at {hit}"))
            }
            // The tour: the next call of the script, then an answer from the last result.
            _ => {
                let i = calls.fetch_add(1, Ordering::Relaxed);
                let id = format!("call_{}", i + 1);
                match script.get(i) {
                    Some(("read_back", _)) => {
                        let path = stub_path(&last_text).unwrap_or("large_tool_results");
                        let args = json!({"path": path, "offset": 20, "limit": 3});
                        Message::assistant("That result was offloaded; reading some of it.")
                            .with_tool_calls(call(id, "read_file", args))
                    }
                    Some((tool, args)) => Message::assistant(format!("Step {}: {tool}.", i + 1))
                        .with_tool_calls(call(id, tool, args.clone())),
                    None => Message::assistant(describe_crates(&last_text)),
                }
            }
        };
        Ok(ChatResponse::new(reply, "gpt-4o"))
    }))
}

/// One line per crate from grep output like
/// `crates/keel-token/Cargo.toml:3: description = "..."`.
fn describe_crates(grep_output: &str) -> String {
    let lines: Vec<String> = grep_output
        .lines()
        .filter_map(|l| {
            let (path, rest) = l.split_once(':')?;
            let name = path.strip_prefix("crates/")?.strip_suffix("/Cargo.toml")?;
            let desc = rest.split_once("description = ")?.1.trim_matches('"');
            Some(format!("- {name}: {desc}"))
        })
        .collect();
    format!(
        "The workspace has {} crates:\n{}",
        lines.len(),
        lines.join("\n")
    )
}

/// The `large_tool_results/...` path an offload stub names.
fn stub_path(stub: &str) -> Option<&str> {
    let at = stub.find("large_tool_results/")?;
    let rest = &stub[at..];
    let end = rest
        .find(|c: char| c.is_whitespace() || matches!(c, ':' | ')' | ',' | '`' | '"' | '\''))
        .unwrap_or(rest.len());
    Some(rest[..end].trim_end_matches('.'))
}

/// A tool of our own: the line count of every `.rs` file under a directory.
struct LineCounts {
    root: PathBuf,
}

impl Tool for LineCounts {
    fn spec(&self) -> ToolSpec {
        ToolSpec::new(
            "line_counts",
            "Count the lines of every Rust file under a directory of the repository.",
            json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
        )
    }

    fn call(&self, arguments: Value, _ctx: ToolContext) -> ToolFuture<'_> {
        Box::pin(async move {
            let path = arguments["path"]
                .as_str()
                .ok_or_else(|| ToolError::bad_arguments("`path` is required"))?;
            if path.starts_with('/') || path.split('/').any(|c| c == "..") {
                return Err(ToolError::bad_arguments(
                    "`path` must stay inside the repository",
                ));
            }
            let (root, dir) = (self.root.clone(), self.root.join(path));
            // Filesystem work belongs on the blocking pool, off the runtime's threads.
            tokio::task::spawn_blocking(move || {
                let mut files = Vec::new();
                rust_files(&dir, &mut files);
                files.sort();
                let mut out = String::new();
                for f in files {
                    let lines = std::fs::read_to_string(&f).map_or(0, |t| t.lines().count());
                    let shown = f.strip_prefix(&root).unwrap_or(&f).display();
                    out.push_str(&format!("{lines:>6} {shown}\n"));
                }
                out
            })
            .await
            .map_err(ToolError::failed)
        })
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.filter_map(Result::ok).map(|e| e.path()) {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| n.starts_with('.') || n == "target") {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn crate_names(repo: &Path) -> Result<Vec<String>, Box<dyn Error>> {
    let mut names: Vec<String> = std::fs::read_dir(repo.join("crates"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    names.sort();
    Ok(names)
}

pub fn step_of(event: &AgentEvent) -> u64 {
    match event {
        AgentEvent::ModelCall { step, .. }
        | AgentEvent::ToolCall { step, .. }
        | AgentEvent::Offload { step, .. } => *step,
        AgentEvent::Compaction(e) => e.step,
        _ => 0,
    }
}

/// Prints the stream, one line per model call, tool call, offload and compaction.
/// Within a step the events come first, then the messages: the `ModelCall` line is
/// followed by the reply's tool calls.
pub struct Printer;

impl Printer {
    pub fn print(&mut self, update: &AgentUpdate) {
        match update {
            AgentUpdate::Event(AgentEvent::ModelCall {
                step,
                prompt_tokens,
                tool_calls,
                ..
            }) => {
                println!(
                    "step {step:>2}  model call, {prompt_tokens:>5} prompt tokens, {tool_calls} tool call(s)"
                );
            }
            AgentUpdate::Event(AgentEvent::ToolCall {
                name,
                error,
                result_chars,
                ..
            }) => match error {
                None => println!("          <- {name}: {result_chars} chars"),
                Some(e) => println!("          <- {name} failed: {e}"),
            },
            AgentUpdate::Event(AgentEvent::Offload { path, tokens, .. }) => {
                println!("          offloaded the {tokens}-token result to {path}")
            }
            AgentUpdate::Event(AgentEvent::Compaction(e)) => println!(
                "          compaction: {:?} ({:?} trigger), {} messages archived, prompt {} -> {} tokens",
                e.kind, e.trigger, e.messages_archived, e.tokens_before, e.tokens_after
            ),
            AgentUpdate::Event(other) => println!("          event: {other:?}"),
            // A step's events come before its messages: the reply follows its model call.
            AgentUpdate::Message(m) if m.role == Role::Assistant => {
                for c in &m.tool_calls {
                    println!("          -> {}({})", c.name, c.arguments.to_json_string());
                }
            }
            AgentUpdate::Message(_) => {}
            AgentUpdate::Done {
                next, interrupts, ..
            } => {
                println!("done (next: {next:?}, interrupts: {})", interrupts.len())
            }
            _ => {}
        }
    }
}
