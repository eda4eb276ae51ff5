//! The demo's scenario: a long survey of a real directory with the file tools, then a
//! question whose answer was only in the second tool result of the run.
//!
//! The script stands in for a model, deterministically: it walks the directory up
//! front to plan its tool calls (`ls`, `read_file`, `grep`), and for the final
//! question it *reads its prompt*: when the early tool result is still there it
//! answers from it; when compaction has moved it out, it greps the archive for that
//! call's result and reads the record back. A wrong answer is reported as wrong.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use keel::message::{Message, Role, ToolCall};
use keel::model::{ChatResponse, PolicyModel};
use serde_json::{Value, json};

/// The call id of the early read whose result the final question is about.
pub const NEEDLE_CALL: &str = "call_2";
/// The call ids of the reader's archive lookups.
const ASK_GREP: &str = "ask_grep";
const ASK_READ: &str = "ask_read";

/// Files the planner looks at, at most.
const MAX_FILES: usize = 2_000;
/// Files larger than this are not read by the script.
const MAX_FILE_BYTES: u64 = 1 << 20;
/// Lines of the early read.
const NEEDLE_READ_LINES: usize = 6;

/// The fact the final question asks for.
#[derive(Debug, Clone)]
pub struct Needle {
    /// The file, relative to the surveyed directory, `/`-separated.
    pub path: String,
    /// The 1-based line.
    pub line: usize,
    /// The line's text as `read_file` shows it.
    pub text: String,
}

/// A planned survey.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// The directory surveyed.
    pub dir: PathBuf,
    /// The text files found (relative, sorted).
    pub files: Vec<String>,
    /// The directories found (relative, sorted).
    pub dirs: Vec<String>,
    /// What the final question asks.
    pub needle: Needle,
    /// Model calls of the survey, the final answer included.
    pub steps: usize,
}

impl Scenario {
    /// Walks `dir` (respecting `.gitignore`, skipping hidden files, `target/` and
    /// keel's home) and plans a survey of `steps` model calls.
    pub fn plan(dir: &Path, steps: usize) -> anyhow::Result<Self> {
        if steps < 3 {
            bail!("--steps must be at least 3 (a listing, the early read, the report)");
        }
        let dir = dir
            .canonicalize()
            .with_context(|| format!("cannot open the directory {}", dir.display()))?;
        if !dir.is_dir() {
            bail!("{} is not a directory: pass --dir DIR", dir.display());
        }
        let (files, dirs) = walk(&dir);
        // A README at the top reads best as the early fact; any text file will do.
        let readme_first = files
            .iter()
            .filter(|f| !f.contains('/') && f.to_ascii_lowercase().starts_with("readme"))
            .chain(files.iter());
        let needle = readme_first
            .clone()
            .find_map(|f| needle_in(&dir, f))
            .with_context(|| {
                format!(
                    "{} has no readable text file with a line of at least 12 characters; pass --dir with a directory of text files",
                    dir.display()
                )
            })?;
        Ok(Self {
            dir,
            files,
            dirs,
            needle,
            steps,
        })
    }

    /// The goal anchor of the run.
    pub fn goal(&self) -> String {
        let name = self
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| ".".to_owned());
        format!(
            "Survey the directory `{name}` with your tools: list it, read its files, and search them for structure, errors and TODOs; then report what you found. Keep track of what you read: you will be asked about it at the end."
        )
    }

    /// The system prompt.
    pub fn system(&self) -> &'static str {
        "You are a careful engineering agent. Your tools ls, read_file and grep are rooted at the directory under survey. History that leaves your context is archived: `grep` and `read_file` with a path under archive/ read it back, and results too large for the context are under large_tool_results/."
    }

    /// The final question.
    pub fn question(&self) -> String {
        format!(
            "Final question: what exactly did line {} of `{}` say when you read it at the start of the survey? Quote the line.",
            self.needle.line, self.needle.path
        )
    }

    /// Whether `answer` quotes the needle's line.
    pub fn is_correct(&self, answer: &str) -> bool {
        let want = self.needle.text.trim();
        !want.is_empty() && answer.contains(want)
    }

    /// The survey's tool calls, in order (the `i`-th model call makes `calls[i]`; the
    /// call after the last one reports).
    pub fn calls(&self) -> Vec<(&'static str, Value)> {
        let mut calls = vec![
            ("ls", json!({})),
            (
                "read_file",
                json!({"path": self.needle.path, "limit": NEEDLE_READ_LINES}),
            ),
        ];
        const PATTERNS: [&str; 5] = [
            "TODO|FIXME|XXX",
            r"\b(error|Error|ERROR)\b",
            r"^\s*(pub )?(fn|struct|enum|trait|class|def|func|interface) ",
            r"\b(test|spec)\b",
            r"https?://",
        ];
        let (mut file, mut pattern, mut dir) = (0usize, 0usize, 0usize);
        while calls.len() + 1 < self.steps {
            let slot = calls.len() % 10;
            if slot == 4 || slot == 8 {
                calls.push((
                    "grep",
                    json!({"pattern": PATTERNS[pattern % PATTERNS.len()], "max_results": 8}),
                ));
                pattern += 1;
            } else if slot == 6 && !self.dirs.is_empty() {
                let d = &self.dirs[dir % self.dirs.len()];
                calls.push(("ls", json!({"path": d})));
                dir += 1;
            } else if self.files.is_empty() {
                calls.push(("ls", json!({})));
            } else {
                let round = file / self.files.len();
                let path = &self.files[file % self.files.len()];
                calls.push((
                    "read_file",
                    json!({"path": path, "offset": 40 * round, "limit": 40}),
                ));
                file += 1;
            }
        }
        calls
    }

    /// The scripted model. `model_name` picks the token profile (its window and
    /// tokenizer), as a real model's name would.
    ///
    /// It keeps no count of its own: the survey's next call follows from the prompt's
    /// last tool result (`call_k` is answered, so call `k + 1` is next), so a thread
    /// resumed in a new process, or a prompt sent again after an overflow, picks up
    /// where the thread is.
    pub fn policy(&self, model_name: &str) -> PolicyModel {
        let calls = self.calls();
        let needle = self.needle.clone();
        let files_read = self.files.len();
        let name = model_name.to_owned();
        PolicyModel::new(model_name, move |prompt, _tools| {
            let reply = reply_to(prompt, &calls, &needle, files_read);
            Ok(ChatResponse::new(reply, name.clone()))
        })
    }
}

/// One scripted turn.
fn reply_to(
    prompt: &[Message],
    calls: &[(&'static str, Value)],
    needle: &Needle,
    files: usize,
) -> Message {
    let call = |id: &str, tool: &str, args: Value| {
        vec![ToolCall::new(id.to_owned(), tool.to_owned(), args)]
    };
    let Some(last) = prompt.last() else {
        return Message::assistant("I have no instructions.");
    };
    let last_text = last.text().into_owned();
    match (last.role, last.tool_call_id.as_deref()) {
        // The final question: from the context if the early result is still there,
        // otherwise from the archive.
        (Role::User, _) if last_text.starts_with("Final question:") => {
            let early = prompt
                .iter()
                .find(|m| m.role == Role::Tool && m.tool_call_id.as_deref() == Some(NEEDLE_CALL));
            match early.and_then(|m| line_in_listing(&m.text(), needle.line)) {
                Some(line) => Message::assistant(format!(
                    "From my context (the result of {NEEDLE_CALL}): line {} of `{}` was: {line}",
                    needle.line, needle.path
                )),
                None => Message::assistant(format!(
                    "The result of {NEEDLE_CALL} is no longer in my context; searching the archive."
                ))
                .with_tool_calls(call(
                    ASK_GREP,
                    "grep",
                    json!({"pattern": format!("\"tool_call_id\":\"{NEEDLE_CALL}\""), "path": "archive"}),
                )),
            }
        }
        // The archive search: the record's line number, then that record.
        (Role::Tool, Some(ASK_GREP)) => match grep_hit(&last_text) {
            Some((path, line)) => Message::assistant(format!(
                "Found the archived result at {path}:{line}; reading that record."
            ))
            .with_tool_calls(call(
                ASK_READ,
                "read_file",
                json!({"path": path, "offset": line.saturating_sub(1), "limit": 1}),
            )),
            None => Message::assistant(format!(
                "I cannot answer: the result of {NEEDLE_CALL} is neither in my context nor in the archive."
            )),
        },
        (Role::Tool, Some(ASK_READ)) => match line_in_record(&last_text, needle.line) {
            Some(line) => Message::assistant(format!(
                "From the archive (the result of {NEEDLE_CALL}, read back): line {} of `{}` was: {line}",
                needle.line, needle.path
            )),
            None => Message::assistant(format!(
                "I found the archived record but not line {} in it.",
                needle.line
            )),
        },
        // The survey: after `call_k`'s result comes call `k + 1` (index `k`); the
        // goal alone starts it.
        (_, id) => {
            let i = id
                .and_then(|id| id.strip_prefix("call_"))
                .and_then(|k| k.parse::<usize>().ok())
                .unwrap_or(0);
            match calls.get(i) {
                Some((tool, args)) => {
                    let id = format!("call_{}", i + 1);
                    Message::assistant(format!("Step {}: {tool}.", i + 1)).with_tool_calls(call(
                        &id,
                        tool,
                        args.clone(),
                    ))
                }
                None => Message::assistant(format!(
                    "Survey done: {} tool calls so far, over {files} text files. Findings are in the tool results above and in the archive.",
                    calls.len()
                )),
            }
        }
    }
}

/// Line `n` of a `read_file` listing (`{n:>6}\t{text}` rows).
fn line_in_listing(listing: &str, n: usize) -> Option<String> {
    let prefix = format!("{n:>6}\t");
    listing
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(str::to_owned)
}

/// The first `path:line:` of a grep result.
fn grep_hit(output: &str) -> Option<(String, usize)> {
    output.lines().find_map(|l| {
        let (path, rest) = l.split_once(':')?;
        let (line, _) = rest.split_once(':')?;
        Some((path.to_owned(), line.trim().parse().ok()?))
    })
}

/// Line `n` of the `read_file` listing inside an archived record, as `read_file`
/// shows the record (itself a listing row holding the record's JSON).
fn line_in_record(output: &str, n: usize) -> Option<String> {
    let row = output.lines().find(|l| l.contains("\"message\""))?;
    let json_start = row.find('{')?;
    let record: Value = serde_json::from_str(&row[json_start..]).ok()?;
    let content = &record["message"]["content"];
    let text = match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => return None,
    };
    line_in_listing(&text, n)
}

/// Text files and directories under `root`, relative and sorted.
fn walk(root: &Path) -> (Vec<String>, Vec<String>) {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    let walker = ignore::WalkBuilder::new(root)
        .hidden(true)
        .filter_entry(|e| {
            let name = e.file_name().to_string_lossy();
            !(name == "target" || name == "node_modules" || name == ".keel")
        })
        .sort_by_file_name(std::cmp::Ord::cmp)
        .build();
    for entry in walker.filter_map(Result::ok) {
        if files.len() >= MAX_FILES {
            break;
        }
        let Ok(rel) = entry.path().strip_prefix(root) else {
            continue;
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        let rel = rel.to_string_lossy().replace('\\', "/");
        match entry.file_type() {
            Some(t) if t.is_dir() => dirs.push(rel),
            Some(t) if t.is_file() => {
                let small = entry.metadata().is_ok_and(|m| m.len() <= MAX_FILE_BYTES);
                if small && is_text(entry.path()) {
                    files.push(rel);
                }
            }
            _ => {}
        }
    }
    files.sort();
    dirs.sort();
    (files, dirs)
}

fn is_text(path: &Path) -> bool {
    use std::io::Read as _;
    let mut head = [0u8; 1024];
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(n) = f.read(&mut head) else {
        return false;
    };
    n > 0 && !head[..n].contains(&0) && std::str::from_utf8(&head[..n]).is_ok()
}

/// The first line among the first few of `file` that is long enough to be a fact.
fn needle_in(root: &Path, file: &str) -> Option<Needle> {
    let text = std::fs::read_to_string(root.join(file)).ok()?;
    let (i, line) = text
        .lines()
        .take(NEEDLE_READ_LINES)
        .enumerate()
        .find(|(_, l)| l.trim().chars().filter(|c| c.is_alphanumeric()).count() >= 12)?;
    Some(Needle {
        path: file.to_owned(),
        line: i + 1,
        text: line.trim_end().chars().take(200).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (tempfile::TempDir, Scenario) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("README.md"),
            "# T\n\nThe launch code is ZX-9041-ALPHA.\n",
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("src")).unwrap();
        std::fs::write(
            dir.path().join("src/lib.rs"),
            "pub fn main() {}\n// TODO: more\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("blob.bin"), [0u8, 1, 2, 3]).unwrap();
        let s = Scenario::plan(dir.path(), 40).unwrap();
        (dir, s)
    }

    #[test]
    fn plans_from_text_files_and_skips_binaries() {
        let (_d, s) = sample();
        assert_eq!(s.files, ["README.md", "src/lib.rs"]);
        assert_eq!(s.dirs, ["src"]);
        assert_eq!(s.needle.path, "README.md");
        assert_eq!(s.needle.line, 3);
        assert_eq!(s.needle.text, "The launch code is ZX-9041-ALPHA.");
        assert_eq!(s.calls().len(), 39, "one call per step but the report");
        assert_eq!(s.calls()[1].0, "read_file");
    }

    #[test]
    fn an_empty_directory_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Scenario::plan(dir.path(), 40).unwrap_err().to_string();
        assert!(err.contains("no readable text file"), "{err}");
    }

    #[test]
    fn the_survey_goes_on_from_the_last_answered_call_as_a_resumed_thread_needs() {
        let (_d, s) = sample();
        let calls = s.calls();
        let goal = Message::user(s.goal());
        let first = reply_to(std::slice::from_ref(&goal), &calls, &s.needle, 2);
        assert_eq!(first.tool_calls[0].id, "call_1");
        // A new process (no count carried over) resuming after call_7's result.
        let after = Message::tool("call_7", "some result");
        let next = reply_to(&[goal.clone(), after.clone()], &calls, &s.needle, 2);
        assert_eq!(next.tool_calls[0].id, "call_8");
        assert_eq!(next.tool_calls[0].name, calls[7].0);
        // The same prompt sent again (an overflow's retry) asks for the same call.
        let again = reply_to(&[goal.clone(), after], &calls, &s.needle, 2);
        assert_eq!(again.tool_calls[0].id, "call_8");
        // After the last call, the report.
        let last = Message::tool(format!("call_{}", calls.len()), "done");
        let report = reply_to(&[goal, last], &calls, &s.needle, 2);
        assert!(report.tool_calls.is_empty());
        assert!(
            report.text().starts_with("Survey done"),
            "{}",
            report.text()
        );
    }

    #[test]
    fn the_reader_answers_from_context_when_it_can_and_from_the_archive_otherwise() {
        let (_d, s) = sample();
        let calls = s.calls();
        let q = Message::user(s.question());
        let early = Message::tool(
            NEEDLE_CALL,
            "     1\t# T\n     2\t\n     3\tThe launch code is ZX-9041-ALPHA.\n",
        );
        let from_context = reply_to(&[early, q.clone()], &calls, &s.needle, 2);
        assert!(
            s.is_correct(&from_context.text()),
            "{}",
            from_context.text()
        );
        assert!(from_context.tool_calls.is_empty());

        let search = reply_to(&[q], &calls, &s.needle, 2);
        assert_eq!(search.tool_calls[0].name, "grep");
        let hit = Message::tool(
            ASK_GREP,
            "archive/messages.jsonl:7: {\"seq\":6,\"id\":\"m\"… [line cut]",
        );
        let read = reply_to(&[hit], &calls, &s.needle, 2);
        assert_eq!(
            read.tool_calls[0].arguments.to_json_string(),
            r#"{"path":"archive/messages.jsonl","offset":6,"limit":1}"#
        );
        let record = json!({"seq": 6, "id": "m", "message": {"role": "tool", "tool_call_id": NEEDLE_CALL,
            "content": "     1\t# T\n     2\t\n     3\tThe launch code is ZX-9041-ALPHA.\n"}});
        let row = Message::tool(ASK_READ, format!("lines 7-7 of 9\n     7\t{record}\n"));
        let answer = reply_to(&[row], &calls, &s.needle, 2);
        assert!(s.is_correct(&answer.text()), "{}", answer.text());
        assert!(answer.text().contains("From the archive"));

        let missing = reply_to(
            &[Message::tool(ASK_GREP, "No matches.")],
            &calls,
            &s.needle,
            2,
        );
        assert!(!s.is_correct(&missing.text()));
    }
}
