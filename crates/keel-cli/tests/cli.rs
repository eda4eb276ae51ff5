//! The `keel` binary end to end: demo, replay, run against local servers speaking the
//! Ollama and OpenAI wire formats, and thread admin on the embedded file and Postgres.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Output;

use assert_cmd::Command;
use futures::StreamExt;
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

fn keel() -> Command {
    let mut cmd = Command::cargo_bin("keel").unwrap();
    // The tests choose their own settings.
    for var in [
        "KEEL_HOME",
        "KEEL_MODEL",
        "KEEL_WINDOW",
        "DATABASE_URL",
        "OLLAMA_BASE_URL",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("NO_COLOR", "1");
    cmd
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn shared_data() -> Option<PathBuf> {
    let dir = repo_root().join("../shared/data");
    if dir.join("tau-bench/gpt-4o-airline.json").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "skipped: ../shared/data is absent (the recorded trajectories live beside the repository)"
        );
        None
    }
}

/// A small project to survey: the needle is line 3 of its README.
fn project() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    std::fs::write(
        p.join("README.md"),
        "# Orbit\n\nThe orbit service deploys with token ORB-7731-KAPPA.\nMore text.\n",
    )
    .unwrap();
    std::fs::create_dir_all(p.join("src/net")).unwrap();
    for i in 0..12 {
        let body: String = (0..60)
            .map(|l| format!("// file {i} line {l}: nothing to see, error handling TODO {l}\n"))
            .collect();
        std::fs::write(
            p.join(format!("src/mod{i}.rs")),
            format!("pub fn f{i}() {{}}\n{body}"),
        )
        .unwrap();
    }
    std::fs::write(p.join("src/net/http.rs"), "pub struct Client;\n").unwrap();
    dir
}

/// `keel demo ARGS --dir DIR --home HOME`.
fn demo(args: &[&str], dir: &Path, home: &Path) -> Output {
    keel()
        .arg("demo")
        .args(args)
        .arg("--dir")
        .arg(dir)
        .arg("--home")
        .arg(home)
        .output()
        .unwrap()
}

/// A demo thread run again with a ceiling below what it has made says so and how to
/// go on (exit 1), instead of calling the unanswered question a bug of keel (exit 3).
#[test]
fn a_demo_thread_past_its_step_ceiling_says_how_to_go_on() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let first = demo(
        &["--steps", "14", "--thread", "ceiling", "-q"],
        proj.path(),
        home.path(),
    );
    assert!(first.status.success(), "{:?}", text(&first));
    let again = demo(
        &["--steps", "5", "--thread", "ceiling", "-q"],
        proj.path(),
        home.path(),
    );
    let (stdout, stderr) = text(&again);
    assert_eq!(again.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("reached its step ceiling of 15 model calls")
            && stderr.contains("--steps 17 or more")
            && !stderr.contains("bug in keel"),
        "{stderr}"
    );
}

#[test]
fn ctrl_c_stops_the_demo_with_exit_130_and_the_same_command_resumes_it() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    const STEPS: u64 = 1_500;
    let args = ["demo", "--steps", "1500", "--thread", "interrupted", "-q"];
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .args(args)
        .arg("--dir")
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Steps are being checkpointed once the write-ahead log has grown: the run (and
    // its Ctrl-C handler) is going.
    let wal = home.path().join("keel.sqlite-wal");
    let started = std::time::Instant::now();
    while std::fs::metadata(&wal).map_or(0, |m| m.len()) < 64 * 1024 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the demo never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("Ctrl-C: the demo stopped after")
            && stderr.contains("keel threads show interrupted"),
        "{stderr}"
    );
    let show = keel()
        .args(["threads", "show", "interrupted", "--home"])
        .arg(home.path())
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(show.status.success(), "{:?}", text(&show));

    // The same command again (a new process, so the scripted model has no memory of
    // the run) resumes the survey where it stopped, then asks the final question.
    let out = keel()
        .args(args)
        .arg("--dir")
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("stopped during its survey") && stdout.contains("resumes where it stopped"),
        "{stdout}"
    );
    let report: Value =
        serde_json::from_slice(&std::fs::read(home.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(report["question"]["correct"], true, "{report:#}");
    // Every survey call once, none again: the survey's calls, then the question's
    // tool calls and its answer.
    let question_calls = report["question"]["tool_calls"].as_u64().unwrap() + 1;
    assert_eq!(
        report["thread_model_calls"].as_u64().unwrap(),
        STEPS + question_calls,
        "{report:#}"
    );
}

#[test]
fn demo_answers_the_final_question_from_the_archive_and_writes_the_report_and_chart() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let out = demo(
        &["--steps", "60", "--every", "10", "--epoch", "2"],
        proj.path(),
        home.path(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("scripted"),
        "the output says the model is scripted:\n{stdout}"
    );
    assert!(
        stdout.contains("correct") && stdout.contains("read back from the archive"),
        "{stdout}"
    );

    let report: Value =
        serde_json::from_slice(&std::fs::read(home.path().join("report.json")).unwrap()).unwrap();
    assert_eq!(report["question"]["correct"], true, "{report:#}");
    assert_eq!(report["question"]["source"], "archive");
    assert_eq!(
        report["question"]["expected"],
        "The orbit service deploys with token ORB-7731-KAPPA."
    );
    assert!(
        report["question"]["answer"]
            .as_str()
            .unwrap()
            .contains("ORB-7731-KAPPA")
    );
    assert!(
        report["milestones"].as_u64().unwrap() >= 3,
        "{}",
        report["milestones"]
    );
    assert!(
        report["epochs"].as_u64().unwrap() >= 1,
        "{}",
        report["epochs"]
    );
    assert!(report["model_calls"].as_u64().unwrap() >= 60);
    let sent = report["prompt_tokens_sent"].as_u64().unwrap();
    let full = report["prompt_tokens_full_history"].as_u64().unwrap();
    assert!(
        sent < full,
        "compaction sends less than the full history: {sent} vs {full}"
    );
    let svg = std::fs::read_to_string(home.path().join("context-tokens.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("full history"),
        "{}",
        &svg[..200.min(svg.len())]
    );
    assert!(home.path().join("keel.sqlite").is_file());

    // The thread the demo left is there for `keel threads`.
    let thread = report["thread"].as_str().unwrap().to_owned();
    let list = keel()
        .args(["threads", "list", "--json", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    assert!(list.status.success(), "{:?}", text(&list));
    let listed: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(listed[0]["thread"], thread.as_str());
    assert_eq!(listed[0]["model_calls"], report["model_calls"]);
    // The demo's agent answered its question.
    assert_eq!(listed[0]["state"], "answered");

    let show = keel()
        .args(["threads", "show", &thread, "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    let (show_out, show_err) = text(&show);
    assert!(show.status.success(), "{show_err}");
    // The demo saved no model: counted as gpt-4o counts.
    assert!(
        show_out.contains("tokens (o200k_base) before tool specs"),
        "{show_out}"
    );
    for layer in [
        "== system",
        "== goal (never compacted)",
        "== epoch summaries",
        "== milestones",
        "== raw tail",
    ] {
        assert!(show_out.contains(layer), "{layer} missing:\n{show_out}");
    }
    // The demo made epoch summaries: the prompt shows each one it keeps.
    assert!(!show_out.contains("(none yet)"), "{show_out}");
    let show = keel()
        .args(["threads", "show", &thread, "--json", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    let shown: Value = serde_json::from_slice(&show.stdout).unwrap();
    let summaries =
        shown["epochs"].as_array().unwrap().len() + usize::from(!shown["epoch"].is_null());
    assert!(summaries >= 1, "{shown:#}");
    assert!(
        shown["epochs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["tokens"].as_u64().unwrap() > 0 && !e["text"].as_str().unwrap().is_empty()),
        "{shown:#}"
    );

    let history = keel()
        .args([
            "threads", "history", &thread, "--limit", "3", "--json", "--home",
        ])
        .arg(home.path())
        .output()
        .unwrap();
    let rows: Value = serde_json::from_slice(&history.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 3);

    // An abandoned fork's file, which no checkpoint reads: the prune removes it.
    let fork = home
        .path()
        .join("offload")
        .join(&thread)
        .join(".keel/forks/abandoned/large_tool_results");
    std::fs::create_dir_all(&fork).unwrap();
    std::fs::write(fork.join("call_9"), "only an abandoned branch saw this").unwrap();
    let prune = keel()
        .args([
            "threads", "prune", &thread, "--keep", "2", "--json", "--home",
        ])
        .arg(home.path())
        .output()
        .unwrap();
    assert!(prune.status.success(), "{:?}", text(&prune));
    let history = keel()
        .args(["threads", "history", &thread, "--json", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    let rows: Value = serde_json::from_slice(&history.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 2, "pruned to 2");
    assert!(
        !fork.join("call_9").exists(),
        "the files only pruned checkpoints could see go with them"
    );

    let gc = keel()
        .args(["threads", "gc", "--older-than", "1d", "--json", "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    let swept: Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(swept["deleted"], json!([]), "a fresh thread is not idle");

    let archive = home.path().join("offload").join(&thread);
    assert!(archive.exists(), "the thread's archive is on disk");
    let delete = keel()
        .args(["threads", "delete", &thread, "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    assert!(delete.status.success(), "{:?}", text(&delete));
    assert!(!archive.exists(), "delete removes the archive too");
    let missing = keel()
        .args(["threads", "show", &thread, "--home"])
        .arg(home.path())
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing).1.contains("no thread"),
        "{:?}",
        text(&missing)
    );
}

#[test]
fn threads_gc_dry_run_lists_what_it_would_delete_and_deletes_nothing() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let out = demo(&["--steps", "5", "--json", "-q"], proj.path(), home.path());
    assert!(out.status.success(), "{:?}", text(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let thread = report["thread"].as_str().unwrap().to_owned();
    let threads = |args: &[&str]| {
        keel()
            .arg("threads")
            .args(args)
            .arg("--home")
            .arg(home.path())
            .output()
            .unwrap()
    };

    // A newer thread whose id sorts first: both lists are in id order, not by age.
    let newer = demo(
        &["--steps", "5", "--json", "-q", "--thread", "a-newer"],
        proj.path(),
        home.path(),
    );
    assert!(newer.status.success(), "{:?}", text(&newer));
    let both = json!(["a-newer", thread.as_str()]);

    let dry = threads(&["gc", "--older-than", "0s", "--dry-run", "--json"]);
    assert!(dry.status.success(), "{:?}", text(&dry));
    let listed: Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(listed["would_delete"], both, "{listed}");
    let dry = threads(&["gc", "--older-than", "0s", "--dry-run"]);
    let (stdout, _) = text(&dry);
    assert!(
        stdout.contains(&thread) && stdout.contains("nothing was deleted"),
        "{stdout}"
    );
    let none = threads(&["gc", "--older-than", "1w", "--dry-run", "--json"]);
    let listed: Value = serde_json::from_slice(&none.stdout).unwrap();
    assert_eq!(
        listed["would_delete"],
        json!([]),
        "a fresh thread is not idle"
    );
    let show = threads(&["show", &thread]);
    assert!(show.status.success(), "still there: {:?}", text(&show));

    let half = threads(&["gc", "--older-than", "1.5d"]);
    let (_, stderr) = text(&half);
    assert_eq!(half.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("whole number") && !stderr.contains("the unit must"),
        "{stderr}"
    );

    // Without --dry-run, what it listed goes.
    let gc = threads(&["gc", "--older-than", "0s", "--json"]);
    let swept: Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(
        swept["deleted"], both,
        "in the order --dry-run listed: {swept}"
    );
    assert_eq!(threads(&["show", &thread]).status.code(), Some(1));
}

#[test]
fn with_database_url_set_the_demo_says_where_its_thread_is_and_home_wins() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    // Nothing listens there: the demo never connects, and `--home` must keep the
    // threads commands off it.
    let url = "postgres://nobody@127.0.0.1:9/none";
    let out = keel()
        .args(["demo", "--steps", "5", "--json", "-q", "--dir"])
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let sqlite = home.path().join("keel.sqlite");
    let note = stderr
        .lines()
        .find(|l| l.starts_with("note:"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        note.contains(&sqlite.display().to_string())
            && note.contains(&format!(
                "keel threads list --home {}",
                home.path().display()
            )),
        "{note}"
    );

    let list = keel()
        .args(["threads", "list", "--json", "--home"])
        .arg(home.path())
        .env("DATABASE_URL", url)
        .output()
        .unwrap();
    assert!(list.status.success(), "{:?}", text(&list));
    let listed: Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(listed[0]["thread"], report["thread"]);

    // Without DATABASE_URL there is nothing to note.
    let out = demo(&["--steps", "5", "--json", "-q"], proj.path(), home.path());
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(!text(&out).1.contains("note:"), "{:?}", text(&out));
}

#[test]
fn the_default_demo_runs_its_160_steps_over_this_repository() {
    let home = tempfile::tempdir().unwrap();
    let out = keel()
        .args(["demo", "--quiet", "--json", "--dir"])
        .arg(repo_root())
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert!(report["model_calls"].as_u64().unwrap() >= 160);
    assert!(report["milestones"].as_u64().unwrap() >= 5);
    assert!(report["epochs"].as_u64().unwrap() >= 1);
    assert_eq!(report["question"]["correct"], true);
    assert_eq!(report["question"]["source"], "archive");
}

#[test]
fn bad_arguments_are_sentences_with_exit_code_2_or_1() {
    // 2: refused as the command line is read, before anything runs; 1: refused by
    // what the command found (the filesystem, the database).
    let home = tempfile::tempdir().unwrap();
    let h = home.path().to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str, i32)> = vec![
        (
            vec!["demo", "--home", h, "--dir", "/definitely/not/here"],
            "cannot open the directory",
            1,
        ),
        (vec!["run", "--home", h, "--goal", "x"], "needs a model", 2),
        (
            vec!["run", "--home", h, "--model", "gpt-4o", "--goal", "x"],
            "ollama/<name>",
            2,
        ),
        (
            vec!["run", "--home", h, "--model", "ollama/x", "--window", "0"],
            "give --window at least 1,024",
            2,
        ),
        (
            vec!["run", "--home", h, "--model", "ollama/x"],
            "needs a --goal",
            2,
        ),
        (vec!["threads", "--home", h, "list"], "no keel database", 1),
        (
            vec!["threads", "--home", h, "gc", "--older-than", "7"],
            "unit",
            2,
        ),
        (
            vec!["replay", "/definitely/not/here.json"],
            "cannot read",
            1,
        ),
    ];
    for (args, want, code) in cases {
        let out = keel().args(&args).output().unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            stderr.contains(want),
            "{args:?}: expected {want:?} in:\n{stderr}"
        );
    }
    let bad_toml = home.path().join("keel.toml");
    std::fs::write(&bad_toml, "hme = 1").unwrap();
    let out = keel()
        .arg("--config")
        .arg(&bad_toml)
        .args(["threads", "list"])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains(&format!(
            "the settings file {}, line 1, cannot be used: unknown field `hme`",
            bad_toml.display()
        )) && !stderr.contains("not a valid keel.toml"),
        "{stderr}"
    );
}

#[test]
fn every_command_has_help_with_examples() {
    for cmd in [
        vec![],
        vec!["demo"],
        vec!["replay"],
        vec!["run"],
        vec!["threads"],
        vec!["submit"],
        vec!["worker"],
        vec!["status"],
        vec!["cancel"],
    ] {
        let out = keel().args(&cmd).arg("--help").output().unwrap();
        let (stdout, _) = text(&out);
        assert!(out.status.success(), "{cmd:?}");
        assert!(stdout.contains("Examples:"), "{cmd:?}:\n{stdout}");
    }
}

const OPENAI_RUN: &str = r#"[{"role":"system","content":"You are a support agent."},
 {"role":"user","content":"Cancel reservation ZK81QP for user mia_li_3668."},
 {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_user","arguments":"{\"user_id\":\"mia_li_3668\"}"}}]},
 {"role":"tool","tool_call_id":"c1","content":"{\"user_id\":\"mia_li_3668\",\"reservations\":[\"ZK81QP\",\"NO6JO3\"],\"email\":\"mia.li3818@example.com\"}"},
 {"role":"assistant","content":null,"tool_calls":[{"id":"c2","type":"function","function":{"name":"cancel","arguments":"{\"reservation_id\":\"ZK81QP\"}"}}]},
 {"role":"tool","tool_call_id":"c2","content":"cancelled ZK81QP; refund 452 USD"},
 {"role":"assistant","content":"Done: ZK81QP is cancelled and 452 USD refunded."}]"#;

#[test]
fn replay_detects_each_format_and_skips_bad_files_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("a-openai.json"), OPENAI_RUN).unwrap();
    let values: Vec<Value> = serde_json::from_str(OPENAI_RUN).unwrap();
    let jsonl: String = values.iter().map(|v| format!("{v}\n")).collect();
    std::fs::write(d.join("b-session.jsonl"), jsonl).unwrap();
    std::fs::write(
        d.join("c-langchain.json"),
        r#"[{"type":"human","content":"list the files"},{"type":"ai","content":"","tool_calls":[{"name":"ls","args":{},"id":"t1","type":"tool_call"}]},{"type":"tool","content":"a.txt b.txt","tool_call_id":"t1"},{"type":"ai","content":"two files"}]"#,
    )
    .unwrap();
    // Bad files.
    std::fs::write(
        d.join("d-truncated.json"),
        &OPENAI_RUN[..OPENAI_RUN.len() / 2],
    )
    .unwrap();
    std::fs::write(d.join("e-empty.json"), "").unwrap();
    std::fs::write(d.join("f-binary.json"), [0u8, 159, 146, 150, 0, 1]).unwrap();
    let big = std::fs::File::create(d.join("g-huge.json")).unwrap();
    big.set_len(100 << 20).unwrap();
    std::fs::write(d.join("h-unknown.json"), r#"{"hello": "world"}"#).unwrap();

    let out = keel()
        .args([
            "replay",
            "--window",
            "2000",
            "--strategy",
            "hierarchical",
            "--strategy",
            "masking",
            "--max-file-mb",
            "64",
        ])
        .arg(d)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(4),
        "some files were skipped:\n{stdout}\n{stderr}"
    );
    for (file, why) in [
        ("d-truncated.json", "cut short"),
        ("e-empty.json", "empty"),
        ("f-binary.json", "not text"),
        ("g-huge.json", "over the 64 MiB limit"),
        ("h-unknown.json", "--format"),
    ] {
        let line = stderr
            .lines()
            .find(|l| l.contains(file))
            .unwrap_or_else(|| panic!("{file} not reported:\n{stderr}"));
        assert!(
            line.starts_with("skipped") && line.contains(why),
            "{file}: {line}"
        );
        assert_eq!(line.matches(file).count(), 1, "named once: {line}");
        assert!(line.matches("column").count() <= 1, "one position: {line}");
    }
    for (file, format) in [
        ("a-openai.json", "openai"),
        ("b-session.jsonl", "openai-jsonl"),
        ("c-langchain.json", "langchain"),
    ] {
        let line = stdout
            .lines()
            .find(|l| l.contains(file))
            .unwrap_or_else(|| panic!("{file} not replayed:\n{stdout}"));
        assert!(line.contains(&format!(": {format} (detected)")), "{line}");
    }
    assert!(
        stdout.contains("hierarchical") && stdout.contains("masking"),
        "{stdout}"
    );

    let json_out = keel()
        .args(["replay", "--json", "--format", "openai"])
        .arg(d.join("a-openai.json"))
        .output()
        .unwrap();
    assert!(json_out.status.success(), "{:?}", text(&json_out));
    let report: Value = serde_json::from_slice(&json_out.stdout).unwrap();
    assert_eq!(report["files"][0]["detected"], false);
    let total = &report["strategies"][0]["total"];
    assert_eq!(total["runs"], 1);
    assert_eq!(total["turns"], 3);
    assert_eq!(
        report["strategies"][0]["runs"][0]["goal"],
        "Cancel reservation ZK81QP for user mia_li_3668."
    );
}

#[test]
fn replay_skips_a_bad_run_not_its_file_and_folds_a_request_log() {
    let d = tempfile::tempdir().unwrap();
    let call = |n: usize| {
        let messages: Vec<String> = (0..n)
            .map(|i| {
                if i.is_multiple_of(2) {
                    format!(r#"{{"role":"user","content":"question {i}"}}"#)
                } else {
                    format!(r#"{{"role":"assistant","content":"answer {i}"}}"#)
                }
            })
            .collect();
        format!(r#"{{"messages":[{}]}}"#, messages.join(","))
    };
    let log = [call(1), call(3), "{broken".to_owned(), call(2), call(4)].join("\n");
    let file = d.path().join("requests.jsonl");
    std::fs::write(&file, log).unwrap();
    let out = keel()
        .args(["replay", "--window", "2000"])
        .arg(&file)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(4),
        "a run was skipped:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("skipped a run: ") && stderr.contains("line 3 is not valid JSON"),
        "{stderr}"
    );
    assert!(
        stdout.contains("2 runs (1 run skipped)"),
        "the file's other runs replay: {stdout}"
    );
    assert!(
        stderr.contains("reads as a request log: 2 lines repeated"),
        "{stderr}"
    );

    let out = keel()
        .args(["replay", "--window", "2000", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let loaded = &report["files"][0];
    assert_eq!(loaded["runs"], 2, "{report}");
    assert_eq!(loaded["folded_lines"], 2, "{report}");
    assert_eq!(
        loaded["skipped_runs"].as_array().unwrap().len(),
        1,
        "{report}"
    );
}

#[test]
fn replay_of_the_shared_tau_bench_runs_saves_tokens_and_writes_a_chart() {
    let Some(data) = shared_data() else { return };
    let chart = tempfile::tempdir().unwrap();
    let svg = chart.path().join("tau.svg");
    let out = keel()
        .args(["replay", "--window", "8000", "--json", "--chart"])
        .arg(&svg)
        .arg(data.join("tau-bench/gpt-4o-airline.json"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["files"][0]["format"], "tau-bench");
    let total = &report["strategies"][0]["total"];
    assert_eq!(total["runs"], 200);
    assert!(total["tokens"].as_u64() < total["tokens_full"].as_u64());
    assert!(total["recall"].as_f64().unwrap() > 0.5, "{total}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("</svg>"));
    // The JSON report names the chart it wrote, and the run drawn.
    let drawn = &report["chart"];
    assert_eq!(drawn["path"], svg.display().to_string(), "{drawn}");
    assert_eq!(drawn["strategy"], "hierarchical", "{drawn}");
    assert!(drawn["turns"].as_u64().unwrap() > 1, "{drawn}");
    assert!(
        drawn["run"].as_str().is_some_and(|r| !r.is_empty()),
        "{drawn}"
    );
}

#[test]
fn replay_of_the_shared_swe_agent_runs() {
    let Some(data) = shared_data() else { return };
    let out = keel()
        .args(["replay", "--window", "8000", "--json"])
        .arg(data.join("swe-agent"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        report["files"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["format"] == "swe-agent")
    );
    assert!(
        report["strategies"][0]["total"]["tokens_saved"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

/// An OpenAI chat-completions reply carrying `message`.
fn openai_reply(message: Value, finish_reason: &str, usage: Value) -> ResponseTemplate {
    ResponseTemplate::new(200).set_body_json(json!({
        "id": "x", "object": "chat.completion", "model": "local",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage}))
}

/// A chat server that answers the first request with a tool call (`ls`) and any
/// request that carries a tool result with a final answer.
struct Scripted {
    openai: bool,
}

impl Respond for Scripted {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let has_result = body["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
        let reply = if has_result {
            "The directory holds README.md and src."
        } else {
            ""
        };
        if self.openai {
            let message = if has_result {
                json!({"role": "assistant", "content": reply})
            } else {
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]})
            };
            openai_reply(
                message,
                if has_result { "stop" } else { "tool_calls" },
                json!({"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129,
                       "prompt_tokens_details": {"cached_tokens": 64}}),
            )
        } else {
            let message = if has_result {
                json!({"role": "assistant", "content": reply})
            } else {
                json!({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls", "arguments": {}}}]})
            };
            ResponseTemplate::new(200).set_body_json(json!({
                "model": "local", "created_at": "2026-12-01T00:00:00Z", "message": message,
                "done": true, "done_reason": "stop", "prompt_eval_count": 120, "eval_count": 9}))
        }
    }
}

async fn server(openai: bool) -> MockServer {
    let server = MockServer::start().await;
    let route = if openai {
        "/v1/chat/completions"
    } else {
        "/api/chat"
    };
    Mock::given(method("POST"))
        .and(path(route))
        .respond_with(Scripted { openai })
        .mount(&server)
        .await;
    server
}

fn run_live(model: &str, env: (&str, String), home: &Path, dir: &Path, extra: &[&str]) -> Output {
    let mut cmd = keel();
    cmd.args([
        "run",
        "--model",
        model,
        "--goal",
        "What is in this directory?",
        "--thread",
        "live-1",
        "--window",
        "8000",
    ])
    .arg("--home")
    .arg(home)
    .arg("--dir")
    .arg(dir)
    .args(extra)
    .env(env.0, env.1);
    cmd.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_speaks_the_ollama_and_openai_wire_formats() {
    let proj = project();
    for openai in [false, true] {
        let server = server(openai).await;
        let home = tempfile::tempdir().unwrap();
        let (model, env) = if openai {
            (
                "openai/local",
                ("OPENAI_BASE_URL", format!("{}/v1", server.uri())),
            )
        } else {
            ("ollama/local", ("OLLAMA_BASE_URL", server.uri()))
        };
        let (h, d) = (home.path().to_owned(), proj.path().to_owned());
        let out = tokio::task::spawn_blocking(move || run_live(model, env, &h, &d, &[]))
            .await
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{model}:\n{stdout}\n{stderr}");
        assert!(
            stdout.contains("-> ls({})"),
            "{model}: the tool call is shown:\n{stdout}"
        );
        assert!(
            stdout.contains("The directory holds README.md and src."),
            "{model}:\n{stdout}"
        );
        assert!(
            stdout.contains("prompt tokens (server: 120)"),
            "{model}: the server's own count is shown beside keel's:\n{stdout}"
        );
        // 120 against keel's count of the system prompt, goal and tool specs: a server
        // that left the tools out counts that little. Said once.
        assert_eq!(
            stderr
                .matches("it may have left part of the prompt out")
                .count(),
            1,
            "{model}:\n{stderr}"
        );
        // It wrote 9 tokens a reply, within the default cap.
        assert!(!stderr.contains("it ignores the cap"), "{model}:\n{stderr}");
        // keel has no tokenizer for `local`: its estimates followed the server's far
        // lower counts, down to the lowest factor.
        assert!(
            stdout.contains(&format!(
                "(keel has no tokenizer for {model}: it planned with its token estimates scaled by 0."
            )),
            "{model}:\n{stdout}"
        );
        if openai {
            // Over a cap of 8: a server that ignores the cap is told apart.
            let home = tempfile::tempdir().unwrap();
            let (h, d) = (home.path().to_owned(), proj.path().to_owned());
            let env = ("OPENAI_BASE_URL", format!("{}/v1", server.uri()));
            let out = tokio::task::spawn_blocking(move || {
                run_live(model, env, &h, &d, &["--max-tokens", "8"])
            })
            .await
            .unwrap();
            let (_, stderr) = text(&out);
            assert!(
                stderr.contains("the server wrote 9 tokens, over the 8 --max-tokens asks for"),
                "{stderr}"
            );
        }
        if openai {
            assert!(
                stdout.contains("64 cached"),
                "cached tokens are reported:\n{stdout}"
            );
        }
        // `--window` is the window Ollama runs the model with (it otherwise uses its own
        // small default); the OpenAI wire format has no such setting.
        let requests = server.received_requests().await.unwrap();
        assert!(!requests.is_empty());
        for r in &requests {
            let body: Value = serde_json::from_slice(&r.body).unwrap();
            let num_ctx = body.pointer("/options/num_ctx").cloned();
            let expected = (!openai).then(|| json!(8000));
            assert_eq!(num_ctx, expected, "{model}: {body}");
        }
        // The thread continues; a second goal is refused with a sentence.
        let (h, d) = (home.path().to_owned(), proj.path().to_owned());
        let env = if openai {
            ("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        } else {
            ("OLLAMA_BASE_URL", server.uri())
        };
        let again = tokio::task::spawn_blocking(move || run_live(model, env, &h, &d, &[]))
            .await
            .unwrap();
        assert_eq!(again.status.code(), Some(1));
        assert!(
            text(&again).1.contains("already has a goal"),
            "{:?}",
            text(&again)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reports_an_unreachable_server_as_a_sentence() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let (h, d) = (home.path().to_owned(), proj.path().to_owned());
    // Port 9 (discard) on loopback: nothing listens.
    let out = tokio::task::spawn_blocking(move || {
        run_live(
            "ollama/local",
            ("OLLAMA_BASE_URL", "http://127.0.0.1:9".into()),
            &h,
            &d,
            &[],
        )
    })
    .await
    .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error:") && stderr.contains("live-1") && !stderr.contains("panicked"),
        "{stderr}"
    );
    // The thread keeps why its run failed, and what it ran with.
    let threads = |args: &[&str]| {
        let out = keel()
            .arg("threads")
            .args(args)
            .arg("--home")
            .arg(home.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {:?}", text(&out));
        text(&out).0
    };
    let table = threads(&["list"]);
    assert!(table.contains("failed in agent"), "{table}");
    let listed: serde_json::Value = serde_json::from_str(&threads(&["list", "--json"])).unwrap();
    assert_eq!(listed[0]["state"], "failed in agent", "{listed}");
    assert_eq!(listed[0]["model"], "ollama/local", "{listed}");
    assert_eq!(listed[0]["error"]["node"], "agent", "{listed}");
    let error = listed[0]["error"]["message"].as_str().unwrap();
    assert!(
        error.starts_with("node `agent` failed: ") && error.contains("127.0.0.1:9"),
        "{error}"
    );
    let shown = threads(&["show", "live-1"]);
    assert!(
        shown.contains("ran with ollama/local at http://127.0.0.1:9")
            && shown.contains(&format!("last run: {error}")),
        "{shown}"
    );
    let shown: serde_json::Value =
        serde_json::from_str(&threads(&["show", "live-1", "--json"])).unwrap();
    assert_eq!(shown["error"], listed[0]["error"], "{shown}");
    assert_eq!(shown["ran_with"]["model"], "ollama/local", "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_server_errors_say_what_to_fix_and_how_to_resume() {
    let proj = project();
    // (model, status, body, what the error must say)
    let cases = [
        (
            "openai/local",
            401,
            json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}}),
            "set OPENAI_API_KEY",
        ),
        (
            "openai/local",
            403,
            json!({"error": {"message": "Forbidden"}}),
            "set OPENAI_API_KEY",
        ),
        (
            "openai/local",
            404,
            json!({"error": {"message": "The model `local` does not exist", "type": "invalid_request_error", "code": "model_not_found"}}),
            "has no model `local`",
        ),
        (
            "ollama/local",
            404,
            json!({"error": "model \"local\" not found, try pulling it first"}),
            "ollama pull local",
        ),
    ];
    for (model, status, body, want) in cases {
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(status).set_body_json(body))
            .mount(&server)
            .await;
        let env = if model.starts_with("openai") {
            ("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        } else {
            ("OLLAMA_BASE_URL", server.uri())
        };
        let home = tempfile::tempdir().unwrap();
        let (h, d) = (home.path().to_owned(), proj.path().to_owned());
        let out = tokio::task::spawn_blocking(move || run_live(model, env, &h, &d, &[]))
            .await
            .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{model} {status}: {stderr}");
        let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
        assert!(
            first.contains(want)
                && first
                    .contains("resumes from its last checkpoint with: keel run --thread live-1"),
            "{model} {status}: {stderr}"
        );
    }
    // Nothing listens on port 9 (discard) on loopback.
    for (model, var, url) in [
        ("ollama/local", "OLLAMA_BASE_URL", "http://127.0.0.1:9"),
        ("openai/local", "OPENAI_BASE_URL", "http://127.0.0.1:9/v1"),
    ] {
        let home = tempfile::tempdir().unwrap();
        let (h, d) = (home.path().to_owned(), proj.path().to_owned());
        let out =
            tokio::task::spawn_blocking(move || run_live(model, (var, url.into()), &h, &d, &[]))
                .await
                .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{model}: {stderr}");
        let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
        assert!(
            first.contains(&format!("nothing answers at {url}"))
                && first.contains(&format!("set {var}"))
                && first.contains("keel run --thread live-1"),
            "{model}: {stderr}"
        );
    }
    // `keel demo --model` says the same.
    let home = tempfile::tempdir().unwrap();
    let out = keel()
        .args(["demo", "--model", "ollama/local", "--window", "8000", "-q"])
        .arg("--dir")
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .env("OLLAMA_BASE_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("nothing answers at http://127.0.0.1:9")
            && stderr.contains("OLLAMA_BASE_URL"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_call_fails_the_run_at_once_as_the_help_says() {
    let help = keel().args(["run", "--help"]).output().unwrap();
    let (help, _) = text(&help);
    let timeout = &help[help.find("--timeout").unwrap()..];
    let timeout = &timeout[..timeout.find("\n  -").unwrap_or(timeout.len())];
    assert!(
        timeout.contains("is not retried") && !timeout.contains("(and is retried)"),
        "{timeout}"
    );

    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/api/chat"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(json!({"model": "local", "message": {"role": "assistant", "content": "late"}, "done": true}))
                .set_delay(std::time::Duration::from_secs(5)),
        )
        .mount(&server)
        .await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let (h, d, uri) = (home.path().to_owned(), proj.path().to_owned(), server.uri());
    let out = tokio::task::spawn_blocking(move || {
        run_live(
            "ollama/local",
            ("OLLAMA_BASE_URL", uri),
            &h,
            &d,
            &["--timeout", "1"],
        )
    })
    .await
    .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--timeout") && stderr.contains("keel run --thread live-1"),
        "{stderr}"
    );
    assert_eq!(
        server.received_requests().await.unwrap().len(),
        1,
        "a timed-out call is not retried"
    );
}

/// Asks to write `notes.txt` once, then answers from the tool result.
struct Writer;

impl Respond for Writer {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let result = body["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "tool"))
            .map(|m| m["content"].as_str().unwrap_or_default().to_owned());
        let message = match result {
            Some(r) => json!({"role": "assistant", "content": format!("Tool said: {r}")}),
            None => json!({"role": "assistant", "content": "", "tool_calls": [{"function": {
                "name": "write_file", "arguments": {"path": "notes.txt", "content": "hello\n"}}}]}),
        };
        ResponseTemplate::new(200).set_body_json(json!({
            "model": "local", "message": message, "done": true, "prompt_eval_count": 50, "eval_count": 5}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_thread_run_again_without_dir_says_where_its_file_tools_are() {
    let server = server(true).await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let demo = keel()
        .args([
            "demo",
            "--steps",
            "5",
            "-q",
            "--thread",
            "from-demo",
            "--dir",
        ])
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    assert!(demo.status.success(), "{:?}", text(&demo));
    let (h, uri) = (home.path().to_owned(), server.uri());
    let out = tokio::task::spawn_blocking(move || {
        keel()
            .args(["run", "--thread", "from-demo", "--model", "openai/local"])
            .args(["--window", "8000", "--message", "And now?"])
            .arg("--home")
            .arg(&h)
            .env("OPENAI_BASE_URL", format!("{uri}/v1"))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        stderr.contains("note: thread `from-demo` saved no directory")
            && stderr.contains("give --dir"),
        "{stdout}\n{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stopped_at_max_tokens_is_said_to_be_cut_off() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(openai_reply(
            json!({"role": "assistant", "content": "The directory holds README.md and"}),
            "length",
            json!({"prompt_tokens": 120, "completion_tokens": 8, "total_tokens": 128}),
        ))
        .mount(&server)
        .await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let (h, d, uri) = (home.path().to_owned(), proj.path().to_owned(), server.uri());
    let out = tokio::task::spawn_blocking(move || {
        run_live(
            "openai/local",
            ("OPENAI_BASE_URL", format!("{uri}/v1")),
            &h,
            &d,
            &["--max-tokens", "8"],
        )
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("(stopped at --max-tokens: the reply may be cut off"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_asks_at_the_terminal_before_a_write() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/api/chat"))
        .respond_with(Writer)
        .mount(&server)
        .await;
    for (answer, written) in [("y\n", true), ("n\n", false), ("", false)] {
        let proj = project();
        let home = tempfile::tempdir().unwrap();
        let (h, d, uri) = (home.path().to_owned(), proj.path().to_owned(), server.uri());
        let out = tokio::task::spawn_blocking(move || {
            let mut cmd = keel();
            cmd.args([
                "run",
                "--model",
                "ollama/local",
                "--window",
                "8000",
                "--approve",
                "--goal",
                "Write a note.",
            ])
            .arg("--home")
            .arg(&h)
            .arg("--dir")
            .arg(&d)
            .env("OLLAMA_BASE_URL", uri)
            .write_stdin(answer);
            cmd.output().unwrap()
        })
        .await
        .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{answer:?}: {stdout}\n{stderr}");
        assert!(stdout.contains("approve write_file("), "{stdout}");
        assert_eq!(
            proj.path().join("notes.txt").exists(),
            written,
            "{answer:?}: {stdout}"
        );
        let verdict = if written { "approved" } else { "denied" };
        assert!(stdout.contains(verdict), "{answer:?}: {stdout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_paused_at_an_approval_resumes_with_only_its_id() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/api/chat"))
        .respond_with(Writer)
        .mount(&server)
        .await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let (h, d, uri) = (home.path().to_owned(), proj.path().to_owned(), server.uri());
    // The one call of the budget asks to write; the answer comes after it.
    let first = tokio::task::spawn_blocking(move || {
        keel()
            .args(["run", "--model", "ollama/local", "--window", "8000"])
            .args(["--approve", "--goal", "Write a note.", "--max-steps", "1"])
            .args(["--thread", "ap2", "--home"])
            .arg(&h)
            .arg("--dir")
            .arg(&d)
            .env("OLLAMA_BASE_URL", uri)
            .write_stdin("y\n")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&first);
    assert_eq!(first.status.code(), Some(5), "{stdout}\n{stderr}");
    assert!(proj.path().join("notes.txt").exists(), "{stdout}");
    assert!(
        stdout.contains("this run's budget of 1 model call was used (1 made)"),
        "the whole command's budget and calls, not the part after the answer:\n{stdout}"
    );

    // Every checkpoint, those written after the answer too, says what the thread ran with.
    let saver = keel::sqlite::SqliteOptions::default()
        .open(home.path().join("keel.sqlite"))
        .await
        .unwrap();
    let key = keel::checkpoint::ThreadKey::new("ap2".to_owned());
    let all: Vec<_> = keel::checkpoint::Checkpointer::list(
        &saver,
        &key,
        keel::checkpoint::ListOptions::default(),
    )
    .collect()
    .await;
    assert!(all.len() > 2, "{}", all.len());
    for c in all {
        let c = c.unwrap();
        assert_eq!(
            c.metadata.extra["keel_run"]["model"], "ollama/local",
            "step {}: {:?}",
            c.metadata.step, c.metadata.extra
        );
    }
    drop(saver);

    let (h, uri, cwd) = (
        home.path().to_owned(),
        server.uri(),
        elsewhere.path().to_owned(),
    );
    let second = tokio::task::spawn_blocking(move || {
        keel()
            .current_dir(&cwd)
            .args(["run", "--thread", "ap2", "--home"])
            .arg(&h)
            .env("OLLAMA_BASE_URL", uri)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&second);
    assert!(second.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("model: ollama/local"), "{stdout}");
    assert!(stdout.contains("Tool said:"), "{stdout}");

    // A thread that does not exist is named, with how to list the threads.
    let h = home.path().to_owned();
    let missing = keel()
        .args(["run", "--thread", "nope-123", "--home"])
        .arg(&h)
        .output()
        .unwrap();
    let (_, stderr) = text(&missing);
    assert_eq!(missing.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no thread `nope-123`")
            && stderr.contains("keel threads list --home")
            && !stderr.contains("needs a model"),
        "{stderr}"
    );
}

fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!(
                "CI=true but DATABASE_URL is unset: the Postgres CLI tests must run in CI (cargo xtask test provides a database)"
            )
        }
        _ => {
            eprintln!(
                "skipped: DATABASE_URL is unset, so the Postgres CLI tests did not run (cargo xtask test starts a throwaway cluster)"
            );
            None
        }
    }
}

/// Held by the Postgres tests that leave runs queued for a while and by those that start
/// a `keel worker` (which would claim any queued run).
static FLEET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `url` with `extra` options added (`k=v&k=v`).
fn with_options(url: &str, extra: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{extra}")
}

#[test]
fn looking_at_threads_creates_no_tables_and_names_the_schema_it_looked_in() {
    let Some(url) = database_url() else { return };
    let schema = format!("keel_cli_empty_{}", std::process::id());
    // A password in the query (the server trusts the login and ignores it) is never
    // shown.
    let url = with_options(&url, "password=s3cret");
    let list = || {
        keel()
            .args(["threads", "list", "--database-url", &url])
            .env("KEEL_SCHEMA", &schema)
            .output()
            .unwrap()
    };
    // Twice: had the first look created keel's tables, the second would list no
    // threads without saying there are no tables.
    for _ in 0..2 {
        let out = list();
        assert!(out.status.success(), "{:?}", text(&out));
        let said = text(&out).0;
        assert!(
            said.contains("no threads")
                && said.contains(&format!("no keel tables in schema {schema}"))
                && said.contains("KEEL_SCHEMA")
                && said.contains("password=***")
                && !said.contains("s3cret"),
            "{said}"
        );
    }
    // A thread asked for by name is not there: an error naming the schema.
    let show = keel()
        .args(["threads", "show", "t", "--database-url", &url])
        .env("KEEL_SCHEMA", &schema)
        .output()
        .unwrap();
    assert_eq!(show.status.code(), Some(1), "{:?}", text(&show));
    assert!(
        text(&show).1.contains("no keel tables in schema"),
        "{:?}",
        text(&show)
    );
}

/// A schema a newer keel upgraded is refused by what reads it (under its own headline,
/// not "cannot reach Postgres") as by what would write it, each naming the stored
/// formats this build knows; `--version` lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_a_newer_keel_upgraded_is_refused_by_readers_and_writers_alike() {
    let Some(url) = database_url() else { return };
    let schema = format!("keel_cli_newer_{}", std::process::id());
    let admin = |args: &[&str]| {
        keel()
            .args(["threads"])
            .args(args)
            .args(["--database-url", &url])
            .env("KEEL_SCHEMA", &schema)
            .output()
            .unwrap()
    };
    // Creating the tables is not an upgrade: nothing said.
    let created = admin(&["gc", "--older-than", "7d"]);
    assert!(created.status.success(), "{:?}", text(&created));
    assert!(
        !text(&created).1.contains("upgraded"),
        "{:?}",
        text(&created)
    );

    let config = keel::postgres::PostgresConfig::new(&url)
        .unwrap()
        .schema(&schema)
        .unwrap();
    let saver = keel::postgres::PostgresSaver::connect(&config).unwrap();
    let client = saver.pool().get().await.unwrap();
    client
        .batch_execute(&format!(
            "INSERT INTO {schema}.keel_migrations (version, name) VALUES (99, 'from the future')"
        ))
        .await
        .unwrap();

    let listed = admin(&["list"]);
    let (_, stderr) = text(&listed);
    assert_eq!(listed.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is at migration 99, newer than this keel-checkpoint-postgres knows")
            && stderr.contains("stored formats: checkpoints"),
        "{stderr}"
    );
    let deleted = admin(&["gc", "--older-than", "7d"]);
    let (_, stderr) = text(&deleted);
    assert_eq!(deleted.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("were upgraded by a newer keel than this one")
            && !stderr.contains("cannot reach Postgres"),
        "{stderr}"
    );
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();

    let version = keel().arg("--version").output().unwrap();
    assert!(
        text(&version)
            .0
            .contains("stored formats: checkpoints (SQLite "),
        "{:?}",
        text(&version)
    );
}

#[test]
fn a_home_that_is_a_file_says_home_is_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mine.sqlite");
    std::fs::write(&file, b"").unwrap();
    let out = keel()
        .args(["threads", "list", "--home"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("--home names a directory") && text(&out).1.contains("keel.sqlite"),
        "{:?}",
        text(&out)
    );
}

#[test]
fn the_database_url_takes_libpq_tls_options() {
    let Some(url) = database_url() else { return };
    let list = |url: &str| {
        keel()
            .args(["threads", "list", "--database-url", url])
            .output()
            .unwrap()
    };
    // A root file that is not there is named before anything connects.
    let missing = list(&with_options(
        &url,
        "sslmode=verify-full&sslrootcert=/nonexistent/keel-root.pem",
    ));
    assert_eq!(missing.status.code(), Some(1), "{:?}", text(&missing));
    assert!(
        text(&missing)
            .1
            .contains("sslrootcert /nonexistent/keel-root.pem"),
        "{:?}",
        text(&missing)
    );
    // Connected: the threads are listed, or the database (fresh, before any other
    // test stored a thread) is found to hold no keel tables.
    let connected =
        |out: &Output| out.status.success() || text(out).1.contains("no keel tables in schema");
    let plain = list(&with_options(&url, "sslmode=disable"));
    assert!(connected(&plain), "{:?}", text(&plain));
    // `require` connects where the server takes TLS (the throwaway cluster of `cargo
    // xtask test` does) and fails, saying so, where it does not.
    let required = list(&with_options(&url, "sslmode=require"));
    if std::env::var("KEEL_PG_TLS_CERT").is_ok() {
        assert!(connected(&required), "{:?}", text(&required));
    } else if !connected(&required) {
        eprintln!(
            "the sslmode=require check skipped: the server at DATABASE_URL does not take TLS ({})",
            text(&required).1.trim()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_admin_works_on_postgres() {
    let Some(url) = database_url() else { return };
    let _fleet = FLEET.lock().await;
    let server = server(false).await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let thread = format!("cli-pg-{}", std::process::id());
    let (h, d, u, t, s) = (
        home.path().to_owned(),
        proj.path().to_owned(),
        url.clone(),
        thread.clone(),
        server.uri(),
    );
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = keel();
        cmd.args([
            "run",
            "--model",
            "ollama/local",
            "--goal",
            "What is in this directory?",
            "--window",
            "8000",
            "--thread",
            &t,
            "--database-url",
            &u,
        ])
        .arg("--home")
        .arg(&h)
        .arg("--dir")
        .arg(&d)
        .env("OLLAMA_BASE_URL", s);
        cmd.output().unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let admin = |args: &[&str]| {
        let mut cmd = keel();
        cmd.arg("threads").args(args).env("DATABASE_URL", &url);
        cmd.output().unwrap()
    };
    let before = thread.trim_end_matches(char::is_numeric).to_owned();
    let list = admin(&["list", "--json", "--after", &before, "--limit", "1000"]);
    let listed: Value =
        serde_json::from_slice(&list.stdout).unwrap_or_else(|_| panic!("{:?}", text(&list)));
    let ours = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["thread"] == thread.as_str())
        .expect("listed");
    assert_eq!(ours["model_calls"], 2);
    let show = admin(&["show", &thread]);
    assert!(
        text(&show).0.contains("What is in this directory?"),
        "{:?}",
        text(&show)
    );
    // Counted as the thread's model counts: keel has no profile of `local`.
    assert!(
        text(&show)
            .0
            .contains("tokens (approximate) before tool specs"),
        "{:?}",
        text(&show)
    );
    let history = admin(&["history", &thread, "--json"]);
    assert!(
        !serde_json::from_slice::<Value>(&history.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .is_empty()
    );
    // A second goal for the thread is refused before anything is queued.
    let again = keel()
        .args(["submit", "--thread", &thread, "--goal", "Something else."])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(!again.status.success(), "{:?}", text(&again));
    assert!(
        text(&again).1.contains("already has a goal") && text(&again).1.contains("--message"),
        "{:?}",
        text(&again)
    );
    let show = admin(&["show", &thread]);
    assert!(!text(&show).0.contains("queued"), "{:?}", text(&show));
    // A queued run shows in `threads show` and `threads list` (no worker runs it).
    let submitted = keel()
        .args(["submit", "--thread", &thread, "--message", "And the tests?"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(submitted.status.success(), "{:?}", text(&submitted));
    let run = text(&submitted).0.trim().to_owned();
    let show = admin(&["show", &thread]);
    assert!(
        text(&show).0.contains(&format!("run {run}")) && text(&show).0.contains("queued"),
        "{:?}",
        text(&show)
    );
    let list = admin(&["list", "--json", "--after", &before, "--limit", "1000"]);
    let listed: Value = serde_json::from_slice(&list.stdout).unwrap();
    let ours = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["thread"] == thread.as_str())
        .expect("listed");
    assert_eq!(ours["last_run"], "queued");
    let cancel = keel()
        .args(["cancel", &run])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(cancel.status.success(), "{:?}", text(&cancel));

    let prune = admin(&["prune", &thread, "--keep", "1"]);
    assert!(prune.status.success(), "{:?}", text(&prune));
    let delete = admin(&["delete", &thread]);
    assert!(delete.status.success(), "{:?}", text(&delete));
    assert!(
        text(&delete)
            .0
            .contains("its 1 run(s) from the fleet's queue"),
        "{:?}",
        text(&delete)
    );
    let gone = admin(&["show", &thread]);
    assert!(text(&gone).1.contains("no thread"), "{:?}", text(&gone));
    let runs = keel()
        .args(["status", "--thread", &thread, "--json"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        !text(&runs).0.contains(&run),
        "the queue forgot the thread's runs: {:?}",
        text(&runs)
    );
}

/// Calls `ls` on every request and never answers; remembers each request's
/// `max_tokens`.
struct Looper {
    max_tokens: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
}

impl Respond for Looper {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let body: Value = serde_json::from_slice(&request.body).unwrap_or_default();
        self.max_tokens
            .lock()
            .unwrap()
            .push(body["max_tokens"].clone());
        let n = self.max_tokens.lock().unwrap().len();
        openai_reply(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("call_{n}"), "type": "function",
                 "function": {"name": "ls", "arguments": "{}"}}]}),
            "tool_calls",
            json!({"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_cap_the_window_cannot_hold_is_refused_and_the_default_fits_a_small_one() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(Looper {
            max_tokens: seen.clone(),
        })
        .mount(&server)
        .await;
    let url = format!("{}/v1", server.uri());
    let run = |window: &'static str, cap: Option<&'static str>| {
        let (h, d, u) = (home.path().to_owned(), proj.path().to_owned(), url.clone());
        tokio::task::spawn_blocking(move || {
            let mut cmd = keel();
            cmd.args(["run", "--model", "openai/local", "--goal", "List it."])
                .args(["--window", window, "--max-steps", "1"])
                .arg("--home")
                .arg(&h)
                .arg("--dir")
                .arg(&d)
                .env("OPENAI_BASE_URL", u);
            if let Some(cap) = cap {
                cmd.args(["--max-tokens", cap]);
            }
            cmd.output().unwrap()
        })
    };
    // A reply of up to 8,000 tokens beside a prompt at its budget would overflow an
    // 8,192-token window at the server: refused before any call.
    let out = run("8192", Some("8000")).await.unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("--max-tokens 8,000 is more than a quarter of the 8,192-token window")
            && stderr.contains("give --max-tokens 2,048 or less, or a --window of at least 32,000"),
        "{stderr}"
    );
    assert!(seen.lock().unwrap().is_empty(), "no call was made");
    // A cap within the quarter is sent as given. (Each run stops at its one model
    // call, before an answer: exit code 5.)
    let out = run("8192", Some("2048")).await.unwrap();
    assert_eq!(out.status.code(), Some(5), "{:?}", text(&out));
    // The default (1,024) is cut to a quarter of a 3,600-token window.
    let out = run("3600", None).await.unwrap();
    assert_eq!(out.status.code(), Some(5), "{:?}", text(&out));
    assert_eq!(seen.lock().unwrap().as_slice(), [json!(2048), json!(900)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_thread_keeps_its_directory_window_and_model_and_max_steps_counts_per_run() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(Looper {
            max_tokens: seen.clone(),
        })
        .mount(&server)
        .await;
    let url = format!("{}/v1", server.uri());
    let (h, d, u) = (home.path().to_owned(), proj.path().to_owned(), url.clone());
    let first = tokio::task::spawn_blocking(move || {
        keel()
            .args([
                "run",
                "--model",
                "openai/local",
                "--goal",
                "List it forever.",
            ])
            .args(["--window", "8000", "--max-steps", "2", "--max-tokens", "77"])
            .arg("--home")
            .arg(&h)
            .arg("--dir")
            .arg(&d)
            .env("OPENAI_BASE_URL", u)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&first);
    // Stopped before an answer: exit code 5, and the thread list says so.
    assert_eq!(first.status.code(), Some(5), "{stdout}\n{stderr}");
    let list = keel()
        .args(["threads", "list"])
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    let (table, _) = text(&list);
    assert!(table.contains("stopped: run budget"), "{table}");
    assert!(
        stdout.contains("this run's budget of 2 model calls was used (2 made)"),
        "{stdout}"
    );
    assert!(!stdout.contains("RunBudget"), "no Debug output: {stdout}");
    let thread = stdout
        .split_whitespace()
        .find(|w| w.starts_with("run-"))
        .unwrap()
        .trim_end_matches([';', ','])
        .to_owned();
    assert!(thread.len() > 30, "a uuid thread id: {thread}");
    assert!(
        stdout.contains(&format!("Continue with: keel run --thread {thread} --home")),
        "{stdout}"
    );
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        [json!(77), json!(77)],
        "--max-tokens reaches every request"
    );

    // Resumed from another directory with only --thread, and no OPENAI_BASE_URL: same
    // files, window, model, server and --max-tokens; --max-steps 3 allows three more
    // calls, not one.
    let (h, t, cwd) = (
        home.path().to_owned(),
        thread.clone(),
        elsewhere.path().to_owned(),
    );
    let second = tokio::task::spawn_blocking(move || {
        keel()
            .current_dir(&cwd)
            .args(["run", "--thread", &t, "--max-steps", "3"])
            .arg("--home")
            .arg(&h)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = text(&second);
    assert_eq!(second.status.code(), Some(5), "{stdout}\n{stderr}");
    let dir = proj.path().canonicalize().unwrap();
    assert!(
        stdout.contains(&format!("files: {}", dir.display())),
        "the thread's directory, not the working one:\n{stdout}"
    );
    assert!(stdout.contains("model: openai/local"), "{stdout}");
    assert!(
        !stderr.contains("no profile"),
        "the saved --window is used: {stderr}"
    );
    assert!(
        stdout.contains("continuing after 2 model calls; at most 3 more"),
        "{stdout}"
    );
    assert!(
        stdout.contains("this run's budget of 3 model calls was used (3 made)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("model: openai/local at {url}")),
        "the thread's server, not api.openai.com:\n{stdout}"
    );
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        vec![json!(77); 5].as_slice(),
        "the thread's --max-tokens"
    );

    // A server named in the environment wins, with a note saying the thread ran with
    // another.
    let (h, t) = (home.path().to_owned(), thread.clone());
    let third = tokio::task::spawn_blocking(move || {
        keel()
            .args(["run", "--thread", &t, "--max-steps", "1", "--timeout", "1"])
            .arg("--home")
            .arg(&h)
            .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (_, stderr) = text(&third);
    assert!(
        stderr.contains(&format!(
            "note: thread `{thread}` ran with the server at {url}"
        )) && stderr.contains("this run uses http://127.0.0.1:9/v1"),
        "{stderr}"
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        5,
        "nothing went to the saved server"
    );
}

#[test]
fn demo_plans_for_the_window_given_and_refuses_one_its_fixed_prompt_would_crowd() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let out = demo(
        &["--steps", "40", "--window", "4096", "--json", "-q"],
        proj.path(),
        home.path(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["context_window"], 4096, "{report:#}");
    let budget = report["prompt_budget"].as_u64().unwrap();
    assert!(budget < 4096, "{report:#}");
    // The token budget, not only the step count (every 10 calls), made milestones.
    let by_tokens = report["compactions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["kind"] == "milestone" && c["trigger"] != "steps")
        .count();
    assert!(by_tokens > 0, "{:#}", report["compactions"]);
    assert!(report["milestones"].as_u64().unwrap() > 4, "{report:#}");
    assert_eq!(report["question"]["correct"], true, "{report:#}");

    // 2,000 tokens fit the demo's fixed part (the file tools' specs are short under a
    // 4,000-token budget); 1,500 do not.
    let out = demo(
        &["--steps", "40", "--window", "2000", "-q"],
        proj.path(),
        home.path(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let out = demo(
        &["--steps", "40", "--window", "1500", "-q"],
        proj.path(),
        home.path(),
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("system prompt, goal and tool specs")
            && stderr.contains("give a --window of at least"),
        "{stderr}"
    );
}

#[test]
fn a_demo_whose_summarizer_is_down_misses_one_compaction_and_says_who_wrote_the_rest() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    // Nothing listens on port 9 (discard) on loopback: every LLM summary fails. The
    // first compaction fails; from the second in a row on, the extractive fallback
    // writes the summaries, so the run goes on and says so.
    let out = keel()
        .args(["demo", "--steps", "40", "--summarizer", "ollama/local"])
        .arg("--dir")
        .arg(proj.path())
        .arg("--home")
        .arg(home.path())
        .env("OLLAMA_BASE_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.matches("milestone failed: ").count(),
        1,
        "one failure, shown as it happens:\n{stdout}"
    );
    assert!(
        stdout.contains("(written by the extractive fallback)"),
        "{stdout}"
    );
}

#[test]
fn replay_with_an_unreachable_summarizer_says_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = vec![json!({"role": "user", "content": "Look up every order."})];
    for i in 0..30 {
        run.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function",
            "function": {"name": "get_order", "arguments": format!("{{\"order\":{i}}}")}}]}));
        run.push(json!({"role": "tool", "tool_call_id": format!("c{i}"),
            "content": format!("order {i}: {}", "lamp, desk, chair ".repeat(40))}));
    }
    let file = dir.path().join("long.json");
    std::fs::write(&file, serde_json::to_string(&run).unwrap()).unwrap();
    // Nothing listens on port 9 (discard) on loopback.
    let out = keel()
        .args(["replay", "--summarizer", "ollama/foo", "--window", "8000"])
        .arg(&file)
        .env("OLLAMA_BASE_URL", "http://127.0.0.1:9")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let error = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(
        error.contains("nothing answers at http://127.0.0.1:9: start Ollama (`ollama serve`)")
            && error.contains("OLLAMA_BASE_URL")
            && error.contains("--summarizer extractive"),
        "{stderr}"
    );
}

#[test]
fn a_goal_that_fills_the_window_is_refused_before_the_thread_exists() {
    let home = tempfile::tempdir().unwrap();
    let goal = "word ".repeat(3_000);
    let out = keel()
        .args(["run", "--model", "openai/local", "--window", "2000"])
        .args(["--goal", &goal, "--thread", "big"])
        .arg("--home")
        .arg(home.path())
        .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    // A window too small for the goal is a usage error.
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // The goal is what makes it long: the advice says so.
    assert!(
        stderr.contains("system prompt and tool specs take")
            && stderr.contains("put the long material in a file under --dir")
            && stderr.contains("--window"),
        "{stderr}"
    );
    let list = keel()
        .args(["threads", "list", "--json"])
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&list.stdout).contains("\"big\""),
        "{:?}",
        text(&list)
    );
}

#[test]
fn usage_errors_exit_2_and_a_closed_stderr_does_not_panic() {
    let home = tempfile::tempdir().unwrap();
    let prune = keel()
        .args(["threads", "prune", "t", "--keep", "0"])
        .arg("--home")
        .arg(home.path())
        .output()
        .unwrap();
    let (_, stderr) = text(&prune);
    assert_eq!(prune.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("keel threads delete") && !stderr.contains("18446744073709551615"),
        "a sentence, not a type's range: {stderr}"
    );
    // `2>&-`: stderr closed; the error cannot be printed, but the exit code says it.
    let bin = assert_cmd::cargo::cargo_bin("keel");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("\"$0\" replay /definitely/not/here.json 2>&-")
        .arg(&bin)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{:?}", text(&out));
}

#[test]
fn a_malformed_model_or_summarizer_flag_is_a_usage_error() {
    for (args, says) in [
        (&["demo", "--model", "gpt-4o"][..], "ollama/<name>"),
        (&["demo", "--summarizer", "ollama"][..], "extractive"),
        (
            &["run", "--model", "claude/x", "--goal", "g"][..],
            "unknown provider",
        ),
        (
            &["replay", "x.json", "--summarizer", "nope"][..],
            "extractive",
        ),
        (&["worker", "--model", "llama"][..], "scripted"),
    ] {
        let out = keel().args(args).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: nothing runs: {stdout}");
    }
}

#[test]
fn values_that_cannot_work_are_usage_errors_with_exit_2() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path().to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (
            vec!["replay", "--every", "0", "x.json"],
            "--every",
            "at least 1",
        ),
        (
            vec!["replay", "--epoch", "0", "x.json"],
            "--epoch",
            "at least 1",
        ),
        (vec!["replay", "--goal", " ", "x.json"], "--goal", "empty"),
        (
            vec!["worker", "--concurrency", "0"],
            "--concurrency",
            "at least 1",
        ),
        (vec!["worker", "--lease", "0"], "--lease", "at least 1"),
        (
            vec!["run", "--max-steps", "0", "--home", h],
            "--max-steps",
            "at least 1",
        ),
        (
            vec!["run", "--timeout", "0", "--home", h],
            "--timeout",
            "at least 1",
        ),
        (vec!["run", "--goal", "", "--home", h], "--goal", "empty"),
        (
            vec!["submit", "--thread", "t", "--goal", ""],
            "--goal",
            "empty",
        ),
        (
            vec!["demo", "--steps", "0", "--home", h],
            "--steps",
            "at least 3",
        ),
        (
            vec!["demo", "--steps", "1", "--home", h],
            "--steps",
            "at least 3 (a listing, the early read, the report)",
        ),
        (
            vec!["demo", "--every", "0", "--home", h],
            "--every",
            "at least 1",
        ),
        (
            vec!["demo", "--epoch", "0", "--home", h],
            "--epoch",
            "at least 1",
        ),
        (
            vec!["demo", "--every", "x", "--home", h],
            "--every",
            "whole number",
        ),
        (
            vec!["replay", "--window", "0", "x.json"],
            "--window",
            "use at least 1,000 tokens",
        ),
        (
            vec!["replay", "--chart", "out/c.png", "x.json"],
            "--chart",
            "ending in .svg",
        ),
        (vec!["cancel", "nope"], "RUN", "`keel submit` printed"),
        (vec!["status", "nope"], "RUN", "`keel submit` printed"),
        (
            vec!["submit", "--thread", "", "--goal", "x"],
            "--thread",
            "it is empty: give a thread id",
        ),
        (
            vec!["demo", "--thread", "bad/../id", "--home", h],
            "--thread",
            "cannot contain `/`",
        ),
        (
            vec!["run", "--thread", ".hidden", "--home", h],
            "--thread",
            "cannot start with `.`",
        ),
        (
            vec!["threads", "--home", h, "history", "t", "--limit", "0"],
            "--limit",
            "at least 1",
        ),
        (
            vec!["threads", "--home", h, "list", "--limit", "0"],
            "--limit",
            "at least 1",
        ),
    ];
    for (args, flag, want) in cases {
        let out = keel().args(&args).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "refused before any output: {stdout}");
        assert!(
            !stderr.contains("is not valid: invalid"),
            "said once: {stderr}"
        );
        assert!(
            stderr.contains(flag)
                && stderr.contains(want)
                && !stderr.contains("18446744073709551615"),
            "{args:?}: {stderr}"
        );
    }
    assert!(
        std::fs::read_dir(home.path()).unwrap().next().is_none(),
        "nothing was written"
    );
}

#[test]
fn the_demo_takes_the_summary_share_and_the_token_gain_floor() {
    let proj = project();
    // The report's compactions at a 4k window, with the settings given as `extra`.
    let compactions = |extra: &[&str]| {
        let home = tempfile::tempdir().unwrap();
        let mut args = vec!["--steps", "60", "--window", "4096", "--json", "-q"];
        args.extend_from_slice(extra);
        let out = demo(&args, proj.path(), home.path());
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        let report: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(report["question"]["correct"], true, "{extra:?}: {report:#}");
        report["compactions"].as_array().unwrap().len()
    };
    let default = compactions(&[]);
    // No floor on what a milestone frees, summaries as large as the room allows: the
    // token trigger compacts as soon as it fires.
    let eager = compactions(&["--min-token-gain", "0", "--summary-share", "1"]);
    assert!(eager > default, "{eager} compactions against {default}");
    for (flag, value) in [
        ("--summary-share", "1.5"),
        ("--min-token-gain", "2"),
        ("--min-token-gain", "half"),
    ] {
        let home = tempfile::tempdir().unwrap();
        let out = demo(&[flag, value], proj.path(), home.path());
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("from 0 to 1"),
            "{stderr}"
        );
    }
}

#[test]
fn keel_run_states_one_least_window_for_a_new_thread() {
    let home = tempfile::tempdir().unwrap();
    let least = |window: &str| {
        let out = keel()
            .args([
                "run",
                "--model",
                "openai/local",
                "--goal",
                "y",
                "--window",
                window,
            ])
            .arg("--home")
            .arg(home.path())
            .env("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{window}: {stderr}");
        let at = stderr
            .rfind("at least ")
            .unwrap_or_else(|| panic!("{stderr}"));
        stderr[at + "at least ".len()..].trim().to_owned()
    };
    let minimum = least("0");
    for window in ["1000", "1024", "1200"] {
        assert_eq!(least(window), minimum, "--window {window}");
    }
    assert!(!home.path().join("keel.sqlite").exists());
}

#[test]
fn the_demo_states_one_least_window_and_runs_with_it() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let least = |window: &str| {
        let out = demo(
            &["--steps", "20", "--window", window, "-q"],
            proj.path(),
            home.path(),
        );
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{window}: {stderr}");
        let at = stderr
            .rfind("at least ")
            .unwrap_or_else(|| panic!("{stderr}"));
        let least = stderr[at + "at least ".len()..].trim();
        assert!(
            least.len() < 4 || least.contains(','),
            "written with thousands separators: {stderr}"
        );
        least
            .replace(',', "")
            .parse::<usize>()
            .unwrap_or_else(|_| panic!("a number to give to --window: {stderr}"))
    };
    let minimum = least("1000");
    for window in ["1024", "1200", "1500"] {
        assert_eq!(least(window), minimum, "--window {window}");
    }
    assert_eq!(least(&(minimum - 1).to_string()), minimum);
    let out = demo(
        &[
            "--steps",
            "20",
            "--window",
            &minimum.to_string(),
            "-q",
            "--json",
        ],
        proj.path(),
        home.path(),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "--window {minimum}: {stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["context_window"], minimum);
}

/// Answers every request with a structured summary; counts the requests.
struct Summaries {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Respond for Summaries {
    fn respond(&self, _request: &Request) -> ResponseTemplate {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let text = "SESSION INTENT:\n- Look up the orders of user mia_li_3668.\nSUMMARY:\n- Looked up orders 1 to 5 of mia_li_3668; each was found.\nARTIFACTS:\n- none\nNEXT STEPS:\n- Look up the next order.";
        openai_reply(
            json!({"role": "assistant", "content": text}),
            "stop",
            json!({"prompt_tokens": 900, "completion_tokens": 60, "total_tokens": 960}),
        )
    }
}

/// `keel replay --json --every 5 --window 6000 --summarizer openai/local` of `file`,
/// with `server` as the OpenAI-compatible summarizer, and `extra` flags.
async fn replay_summarized_by(server: &MockServer, file: PathBuf, extra: &[&str]) -> Output {
    let url = format!("{}/v1", server.uri());
    let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        keel()
            .args(["replay", "--json", "--every", "5", "--window", "6000"])
            .args(&extra)
            .args(["--summarizer", "openai/local"])
            .arg(&file)
            .env("OPENAI_BASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// `dir/long.json`: a run asking `ask`, then 30 `get_order` calls with long results
/// and an answer.
fn orders_run(dir: &Path, ask: &str) -> PathBuf {
    let mut run = vec![
        json!({"role": "system", "content": "You are a support agent."}),
        json!({"role": "user", "content": ask}),
    ];
    for i in 0..30 {
        run.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function",
            "function": {"name": "get_order", "arguments": format!("{{\"order\":\"#W{i:04}\"}}")}}]}));
        run.push(json!({"role": "tool", "tool_call_id": format!("c{i}"),
            "content": format!("order #W{i:04} of mia_li_3668: status delivered, total {} USD, items: {}", 100 + i, "lamp, desk, chair ".repeat(20))}));
    }
    run.push(json!({"role": "assistant", "content": "All 30 orders are delivered."}));
    let file = dir.join("long.json");
    std::fs::write(&file, serde_json::to_string(&run).unwrap()).unwrap();
    file
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_takes_an_explicit_goal_and_an_llm_summarizer() {
    let dir = tempfile::tempdir().unwrap();
    let file = orders_run(dir.path(), "Hi!");

    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(Summaries {
            calls: calls.clone(),
        })
        .mount(&server)
        .await;
    let out = replay_summarized_by(
        &server,
        file,
        &["--goal", "Report the status of every order of mia_li_3668."],
    )
    .await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["goal"], "--goal");
    assert_eq!(report["summarizer"], "openai/local");
    let per_run = &report["strategies"][0]["runs"][0];
    assert_eq!(
        per_run["goal"],
        "Report the status of every order of mia_li_3668."
    );
    assert!(
        calls.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the summaries were asked of the model server"
    );
    assert!(
        report["strategies"][0]["total"]["tokens_saved"]
            .as_f64()
            .unwrap()
            > 0.0,
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_goes_on_when_the_summarizer_writes_summaries_the_checks_refuse() {
    // A model that answers in prose, without the summary's sections: each refused
    // summary is a failed compaction and the extractive fallback writes the next one,
    // as in a live agent; the replay used to stop at the first with exit 1.
    let dir = tempfile::tempdir().unwrap();
    let file = orders_run(dir.path(), "Report every order of mia_li_3668.");
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/chat/completions"))
        .respond_with(openai_reply(
            json!({"role": "assistant", "content": "The agent looked at some orders and they seemed fine."}),
            "stop",
            json!({"prompt_tokens": 300, "completion_tokens": 12, "total_tokens": 312}),
        ))
        .mount(&server)
        .await;
    let out = replay_summarized_by(&server, file, &[]).await;
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let total = &report["strategies"][0]["total"];
    assert!(
        total["failed_compactions"].as_u64().unwrap() >= 1,
        "{total}"
    );
    assert!(total["compactions"].as_u64().unwrap() >= 1, "{total}");
}

#[test]
fn status_and_cancel_of_a_queued_run_on_postgres() {
    let Some(url) = database_url() else { return };
    let _fleet = FLEET.blocking_lock();
    let thread = format!(
        "cli-queue-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let fleet = |args: &[&str]| {
        keel()
            .args(args)
            .args(["--database-url", &url])
            .output()
            .unwrap()
    };
    let submitted = fleet(&["submit", "--thread", &thread, "--goal", "Wait for me."]);
    assert!(submitted.status.success(), "{:?}", text(&submitted));
    let run = text(&submitted).0.trim().to_owned();

    let status = fleet(&["status", &run, "--json"]);
    assert!(status.status.success(), "{:?}", text(&status));
    let info: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(info["status"], "queued");
    assert_eq!(info["thread"], thread.as_str());
    assert!(is_iso_utc(info["submitted_at"].as_str().unwrap()), "{info}");

    // A thread with a queued run is not deleted; the error gives the command that
    // cancels the run.
    let busy = fleet(&["threads", "delete", &thread]);
    let (_, stderr) = text(&busy);
    assert_eq!(busy.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cancel it with `keel cancel {run} --database-url "
        )) && stderr.contains("nothing was deleted"),
        "{stderr}"
    );

    let cancelled = fleet(&["cancel", &run]);
    assert!(cancelled.status.success(), "{:?}", text(&cancelled));
    assert!(
        text(&cancelled).0.contains("cancelled"),
        "{:?}",
        text(&cancelled)
    );

    let listed = fleet(&["status", "--thread", &thread]);
    let (stdout, _) = text(&listed);
    assert!(
        stdout.contains(&run) && stdout.contains(": cancelled at"),
        "{stdout}"
    );

    let bad = fleet(&["status", "not-a-run"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad).1.contains("is not a run id"), "{:?}", text(&bad));
    // A run id the queue has no run of: where the right one is found.
    for command in ["cancel", "status"] {
        let unknown = fleet(&[command, "0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80"]);
        let (_, stderr) = text(&unknown);
        assert_eq!(unknown.status.code(), Some(1), "{command}: {stderr}");
        assert!(
            stderr.contains("no run 0190f5f6-5a8e-7c1e-9d2a-3b4c5d6e7f80 in the queue")
                && stderr.contains("`keel status --thread T`")
                && stderr.contains("`keel submit` prints"),
            "{command}: {stderr}"
        );
    }

    // A thread whose only run was cancelled before any checkpoint is in the queue
    // alone: `threads list` shows it, and `threads delete` removes it from there.
    let before = thread.trim_end_matches(char::is_numeric).to_owned();
    let listed = fleet(&[
        "threads", "list", "--json", "--after", &before, "--limit", "1000",
    ]);
    let listed: Value =
        serde_json::from_slice(&listed.stdout).unwrap_or_else(|_| panic!("{:?}", text(&listed)));
    let ours = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["thread"] == thread.as_str())
        .unwrap_or_else(|| panic!("not listed: {listed}"));
    assert_eq!(
        (&ours["queue_only"], &ours["last_run"]),
        (&json!(true), &json!("cancelled"))
    );
    let table = fleet(&["threads", "list", "--after", &before, "--limit", "1000"]);
    assert!(
        text(&table).0.contains("no checkpoint yet"),
        "{:?}",
        text(&table)
    );
    let deleted = fleet(&["threads", "delete", &thread]);
    assert!(deleted.status.success(), "{:?}", text(&deleted));
    assert!(
        text(&deleted).0.contains("its 1 run(s)"),
        "{:?}",
        text(&deleted)
    );
    let gone = fleet(&["status", &run]);
    assert_eq!(gone.status.code(), Some(1), "{:?}", text(&gone));
    let again = fleet(&["threads", "delete", &thread]);
    assert!(text(&again).1.contains("no thread"), "{:?}", text(&again));
}

/// `keel ARGS --database-url URL`.
fn on_fleet(url: &str, args: &[&str]) -> Output {
    keel()
        .args(args)
        .args(["--database-url", url])
        .output()
        .unwrap()
}

/// The run id `keel submit` printed.
fn submitted_run(out: &Output) -> String {
    assert!(out.status.success(), "{:?}", text(out));
    text(out).0.trim().to_owned()
}

/// A thread name no other test (or earlier run) uses.
fn unique_thread(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// Starts `keel worker ARGS` on `url` in `dir`, waits until `run` has ended, stops the
/// worker with Ctrl-C (SIGINT) and returns its output.
fn worker_until_ended(
    url: &str,
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    run: &str,
) -> Output {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"));
    for var in [
        "KEEL_MODEL",
        "KEEL_WINDOW",
        "OLLAMA_BASE_URL",
        "OPENAI_BASE_URL",
    ] {
        cmd.env_remove(var);
    }
    cmd.arg("worker")
        .args(args)
        .args(["--database-url", url, "--dir"])
        .arg(dir)
        .envs(env.iter().copied())
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let status = keel()
            .args(["status", run, "--json", "--database-url", url])
            .output()
            .unwrap();
        let info: Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
        if ["done", "failed", "cancelled"].contains(&info["status"].as_str().unwrap_or("")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the run did not end: {info}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let signalled = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    child.wait_with_output().unwrap()
}

#[test]
fn the_worker_prints_how_each_run_ended_and_what_to_fix() {
    let Some(url) = database_url() else { return };
    let _fleet = FLEET.blocking_lock();
    let proj = project();
    let fleet = |args: &[&str]| {
        keel()
            .args(args)
            .args(["--database-url", &url])
            .output()
            .unwrap()
    };
    let submit = |thread: &str| {
        let out = fleet(&[
            "submit",
            "--thread",
            thread,
            "--goal",
            "What is in this directory?",
        ]);
        assert!(out.status.success(), "{:?}", text(&out));
        text(&out).0.trim().to_owned()
    };

    // A run the scripted agent finishes: done, with its answer.
    let done_thread = unique_thread("cli-worker-done");
    let run = submit(&done_thread);
    let out = worker_until_ended(&url, proj.path(), &["--model", "scripted"], &[], &run);
    let (stdout, stderr) = text(&out);
    assert!(
        stdout.contains(&format!(
            "run {run} (thread `{done_thread}`): done: Scripted survey"
        )),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("stopped: 1 run(s) claimed (0 of them taken over from workers that stopped renewing), 1 done"),
        "{stdout}"
    );

    // A run whose model server does not answer: failed, with the error and the fix.
    let failed_thread = unique_thread("cli-worker-failed");
    let run = submit(&failed_thread);
    let out = worker_until_ended(
        &url,
        proj.path(),
        &["--model", "ollama/local", "--window", "8000"],
        &[("OLLAMA_BASE_URL", "http://127.0.0.1:9")],
        &run,
    );
    let (stdout, stderr) = text(&out);
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("run {run} (thread `{failed_thread}`): failed: ")))
        .unwrap_or_else(|| panic!("no line for the failed run:\n{stdout}\n{stderr}"));
    assert!(
        line.contains("Connection refused")
            && line.contains("nothing answers at http://127.0.0.1:9: start Ollama"),
        "{line}"
    );

    for thread in [&done_thread, &failed_thread] {
        let deleted = fleet(&["threads", "delete", thread]);
        assert!(deleted.status.success(), "{:?}", text(&deleted));
    }
}

#[test]
fn a_message_to_a_thread_without_a_goal_is_refused_at_submit() {
    let Some(url) = database_url() else { return };
    let _fleet = FLEET.blocking_lock();
    let proj = project();
    let fleet = |args: &[&str]| {
        keel()
            .args(args)
            .args(["--database-url", &url])
            .output()
            .unwrap()
    };
    let thread = unique_thread("cli-no-goal");
    let refused = fleet(&["submit", "--thread", &thread, "--message", "hello"]);
    let (_, stderr) = text(&refused);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("has no goal yet")
            && stderr.contains("--goal")
            && !stderr.contains(".goal(..)"),
        "{stderr}"
    );
    let runs = fleet(&["status", "--thread", &thread]);
    assert!(
        text(&runs).0.contains("has no runs"),
        "nothing was queued: {:?}",
        text(&runs)
    );

    // A message behind a queued goal is taken; if the goal's run is cancelled, the
    // worker fails the message's run, in words for the command line.
    let goal = fleet(&["submit", "--thread", &thread, "--goal", "What is here?"]);
    assert!(goal.status.success(), "{:?}", text(&goal));
    let message = fleet(&[
        "submit",
        "--thread",
        &thread,
        "--message",
        "hello",
        "--policy",
        "enqueue",
    ]);
    assert!(message.status.success(), "{:?}", text(&message));
    let run = text(&message).0.trim().to_owned();
    let cancelled = fleet(&["cancel", text(&goal).0.trim()]);
    assert!(cancelled.status.success(), "{:?}", text(&cancelled));
    let out = worker_until_ended(&url, proj.path(), &["--model", "scripted"], &[], &run);
    let (stdout, stderr) = text(&out);
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("run {run} ")))
        .unwrap_or_else(|| panic!("no line for the run:\n{stdout}\n{stderr}"));
    assert!(
        line.contains("has no goal") && line.contains("--goal") && !line.contains(".goal(..)"),
        "{line}"
    );
    let status = fleet(&["status", &run]);
    assert!(
        text(&status).0.contains("--goal") && !text(&status).0.contains(".goal(..)"),
        "{:?}",
        text(&status)
    );
    let deleted = fleet(&["threads", "delete", &thread]);
    assert!(deleted.status.success(), "{:?}", text(&deleted));
}

#[test]
fn replay_notes_a_model_without_a_profile_and_takes_the_window_settings() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("run.json"), OPENAI_RUN).unwrap();
    let replay = |extra: &[&str], env: &[(&str, &str)]| {
        let out = keel()
            .args(["replay", "run.json", "--model", "claude-3-5-sonnet"])
            .args(extra)
            .envs(env.iter().copied())
            .current_dir(d)
            .output()
            .unwrap();
        assert!(out.status.success(), "{:?}", text(&out));
        text(&out)
    };
    // No window anywhere: the assumed one, and approximate counts.
    let (stdout, stderr) = replay(&[], &[]);
    assert!(
        stderr.contains("no profile for `claude-3-5-sonnet`")
            && stderr.contains("assuming an 8,192-token window")
            && stderr.contains("approximate"),
        "{stderr}"
    );
    assert!(stdout.contains("window 8,192 tokens"), "{stdout}");
    assert!(stdout.contains("1 run, 3 model turns;"), "{stdout}");
    // keel.toml, then KEEL_WINDOW, then --window.
    std::fs::write(d.join("keel.toml"), "window = 30000\n").unwrap();
    let (stdout, stderr) = replay(&[], &[]);
    assert!(stdout.contains("window 30,000 tokens"), "{stdout}");
    assert!(
        !stderr.contains("assuming") && stderr.contains("approximate"),
        "{stderr}"
    );
    let (stdout, _) = replay(&[], &[("KEEL_WINDOW", "20000")]);
    assert!(stdout.contains("window 20,000 tokens"), "{stdout}");
    let (stdout, _) = replay(&["--window", "12000"], &[("KEEL_WINDOW", "20000")]);
    assert!(stdout.contains("window 12,000 tokens"), "{stdout}");
    // A model keel knows gets no note.
    let known = keel()
        .args(["replay", "run.json", "--model", "gpt-4o"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(!text(&known).1.contains("no profile"), "{:?}", text(&known));
}

#[test]
fn replay_of_a_file_without_model_turns_shows_no_shares() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one.jsonl");
    std::fs::write(&file, "{\"role\":\"user\",\"content\":\"hello\"}\n").unwrap();
    let out = keel().arg("replay").arg(&file).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("has no model turns"), "{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hierarchical"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(!row.contains('%'), "no share of nothing: {row}");
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells,
        [
            "hierarchical",
            "1",
            "0",
            "0",
            "0",
            "-",
            "-",
            "-",
            "0/0",
            "-",
            "-",
            "-"
        ],
        "{row}"
    );
    let json = keel()
        .args(["replay", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&json.stdout).unwrap();
    let total = &report["strategies"][0]["total"];
    for key in [
        "tokens_saved",
        "cost_saved",
        "cacheable_share",
        "goal_intact_share",
    ] {
        assert_eq!(total[key], Value::Null, "{key}: {total}");
    }
}

/// Whether `text` is an ISO 8601 UTC timestamp such as `2026-12-05T17:14:17Z`.
fn is_iso_utc(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 20
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_json_gives_the_whole_goal_and_iso_utc_timestamps() {
    let server = server(false).await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let goal =
        "Find where the configuration of the orbit service is parsed and list every caller of it";
    let (h, d, s) = (home.path().to_owned(), proj.path().to_owned(), server.uri());
    let out = tokio::task::spawn_blocking(move || {
        keel()
            .args(["run", "--model", "ollama/local", "--window", "8000"])
            .args(["--thread", "long-goal", "--goal", goal])
            .arg("--home")
            .arg(&h)
            .arg("--dir")
            .arg(&d)
            .env("OLLAMA_BASE_URL", s)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{:?}", text(&out));
    let threads = |args: &[&str]| {
        keel()
            .arg("threads")
            .args(args)
            .arg("--home")
            .arg(home.path())
            .output()
            .unwrap()
    };
    let list = threads(&["list", "--json"]);
    let listed: Value =
        serde_json::from_slice(&list.stdout).unwrap_or_else(|_| panic!("{:?}", text(&list)));
    assert_eq!(listed[0]["goal"], goal);
    let when = listed[0]["last_active"].as_str().unwrap();
    assert!(is_iso_utc(when), "{when}");
    let history = threads(&["history", "long-goal", "--json"]);
    let history: Value = serde_json::from_slice(&history.stdout).unwrap();
    let made = history[0]["made"].as_str().unwrap();
    assert!(is_iso_utc(made), "{made}");
    // The table keeps its short form, cut at a word.
    let table = text(&threads(&["list"])).0;
    assert!(
        table.contains("Find where the configuration of the orbit service is parsed...")
            && !table.contains("list every caller"),
        "{table}"
    );
}

#[test]
fn a_demo_rerun_on_its_thread_says_so_and_counts_this_run_only() {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let args = ["--thread", "again", "--steps", "20", "--quiet"];
    let first = demo(&args, proj.path(), home.path());
    assert!(first.status.success(), "{:?}", text(&first));
    assert!(
        !text(&first).0.contains("already ran"),
        "{:?}",
        text(&first)
    );
    let report: Value =
        serde_json::from_slice(&std::fs::read(home.path().join("report.json")).unwrap()).unwrap();
    let first_calls = report["model_calls"].as_u64().unwrap();
    assert!(report["milestones"].as_u64().unwrap() > 0, "{report}");

    let second = demo(&args, proj.path(), home.path());
    let (stdout, stderr) = text(&second);
    assert!(second.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!(
            "note: thread `again` already ran ({first_calls} model calls,"
        )) && stdout.contains("counts this run's calls and compactions only"),
        "{stdout}"
    );
    // The earlier run's answer is not shown as this run's survey report.
    assert!(!stdout.contains("survey report:"), "{stdout}");
    let report: Value =
        serde_json::from_slice(&std::fs::read(home.path().join("report.json")).unwrap()).unwrap();
    // This run's counts agree with each other; the thread's totals are apart.
    let compactions = report["compactions"].as_array().unwrap();
    let milestones = compactions
        .iter()
        .filter(|c| c["kind"] == "milestone")
        .count() as u64;
    assert_eq!(report["milestones"], milestones, "{report}");
    assert!(report["model_calls"].as_u64().unwrap() < first_calls);
    assert_eq!(
        report["thread_model_calls"].as_u64().unwrap(),
        first_calls + report["model_calls"].as_u64().unwrap()
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with("milestones / epochs"))
        .unwrap();
    assert!(row.ends_with(&format!("{milestones} / 0")), "{row}");
}

#[test]
fn small_wording_sizes_and_chart_paths() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A 3.9 MiB file over a 1 MiB limit is not said to be 3 MiB.
    let big = std::fs::File::create(d.join("big.json")).unwrap();
    big.set_len(3_900 * 1_048_576 / 1_000 + 1).unwrap();
    let out = keel()
        .args(["replay", "--max-file-mb", "1"])
        .arg(d.join("big.json"))
        .output()
        .unwrap();
    assert!(
        text(&out).1.contains("is 3.9 MiB, over the 1 MiB limit"),
        "{:?}",
        text(&out)
    );
    // --chart writes SVG: another extension is refused before any work.
    std::fs::write(d.join("run.json"), OPENAI_RUN).unwrap();
    let png = keel()
        .args(["replay", "run.json", "--chart", "x.png"])
        .current_dir(d)
        .output()
        .unwrap();
    assert_eq!(png.status.code(), Some(2), "{:?}", text(&png));
    assert!(text(&png).1.contains(".svg"), "{:?}", text(&png));
    assert!(!d.join("x.png").exists());
    // Its directories are created, as `keel demo --out` does.
    let nested = keel()
        .args(["replay", "run.json", "--chart", "charts/new/x.svg"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(nested.status.success(), "{:?}", text(&nested));
    assert!(
        std::fs::read_to_string(d.join("charts/new/x.svg"))
            .unwrap()
            .starts_with("<svg")
    );
    // Counts of one are singular.
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let out = demo(
        &["--steps", "20", "--every", "1", "--epoch", "1", "--quiet"],
        proj.path(),
        home.path(),
    );
    assert!(
        text(&out)
            .0
            .contains("a milestone every model call, an epoch every milestone"),
        "{:?}",
        text(&out)
    );
}

/// An OpenAI chat run of `turns` tool calls, each result a few hundred tokens of
/// distinct text.
fn long_openai_run(turns: usize) -> String {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful engineer."}),
        json!({"role": "user", "content": "Find which service logs the failing request."}),
    ];
    for i in 0..turns {
        let id = format!("c{i}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function",
             "function": {"name": "read_log", "arguments": format!("{{\"service\":\"svc-{i}\"}}")}}]}));
        let body: String = (0..40)
            .map(|l| {
                format!(
                    "svc-{i} line {l}: request {} handled in {} ms\n",
                    i * 1_000 + l,
                    7 * l + i
                )
            })
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
    }
    messages.push(json!({"role": "assistant", "content": "svc-3 logs it."}));
    serde_json::to_string(&messages).unwrap()
}

#[test]
fn replay_notes_a_replay_that_compacted_nothing_and_a_window_that_compacts() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.json");
    std::fs::write(&file, long_openai_run(30)).unwrap();
    // Hierarchical with a milestone every 100 steps: its step trigger never fires in
    // these 31 turns, so only the token trigger could.
    for strategy in ["masking", "hybrid", "hierarchical"] {
        let every = ["--every", "100"];
        let out = keel()
            .args(["replay", "--strategy", strategy])
            .args(every)
            .arg(&file)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stdout.contains("note: nothing was compacted")
                && stdout.contains("128,000-token window")
                && stdout.contains("as it arrives"),
            "{stdout}"
        );
        // The window it suggests compacts, under every strategy.
        let window = stdout
            .split("--window (e.g. ")
            .nth(1)
            .and_then(|rest| rest.split(')').next())
            .unwrap_or_else(|| panic!("no window suggested: {stdout}"))
            .replace(',', "");
        let out = keel()
            .args(["replay", "--strategy", strategy, "--window", &window])
            .args(every)
            .arg(&file)
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(
            !stdout.contains("nothing was compacted"),
            "{strategy} at --window {window}: {stdout}"
        );
    }
    // A run too short for any window to compact: no window is suggested.
    let short = dir.path().join("short.json");
    std::fs::write(&short, OPENAI_RUN).unwrap();
    let out = keel()
        .args(["replay", "--strategy", "masking"])
        .arg(&short)
        .output()
        .unwrap();
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("no smaller --window or --every would change that"),
        "{stdout}"
    );
    let file = short;
    // A milestone every step compacts: no note.
    let out = keel()
        .args(["replay", "--every", "1"])
        .arg(&file)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stdout.contains("nothing was compacted"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_fixed_prompt_overfills_the_window_is_refused_before_anything_is_written() {
    let server = server(true).await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let url = format!("{}/v1", server.uri());
    let run_with = |window: String, thread: &'static str, goal: String| {
        let (h, d, url) = (home.path().to_owned(), proj.path().to_owned(), url.clone());
        move || {
            keel()
                .args(["run", "--model", "openai/local", "--goal", &goal])
                .args(["--thread", thread, "--window", &window])
                .arg("--home")
                .arg(&h)
                .arg("--dir")
                .arg(&d)
                .env("OPENAI_BASE_URL", url)
                .output()
                .unwrap()
        }
    };
    let run =
        |window: String, thread: &'static str| run_with(window, thread, "What is here?".into());
    let out = tokio::task::spawn_blocking(run("1024".into(), "small"))
        .await
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
    // A short goal: no advice to shorten it.
    assert!(
        stderr.contains("the goal (10 tokens), system prompt and tool specs take")
            && !stderr.contains("put the long material")
            && !stderr.contains("resume"),
        "{stderr}"
    );
    assert!(
        server.received_requests().await.unwrap().is_empty(),
        "no model call"
    );
    assert!(
        !home.path().join("keel.sqlite").exists(),
        "no database is left behind"
    );
    let at = stderr.rfind("at least ").unwrap();
    let least = stderr[at + "at least ".len()..].trim().replace(',', "");
    least.parse::<usize>().unwrap();
    // The window it names does.
    let out = tokio::task::spawn_blocking(run(least, "fits"))
        .await
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("The directory holds README.md and src."),
        "{stdout}"
    );

    // A thread with a long goal, resumed with a window its fixed part does not fit
    // (with the short tool specs of a small window): refused, saying which does.
    let goal = format!("What is here? {}", "Look at every file. ".repeat(80));
    let out = tokio::task::spawn_blocking(run_with("8192".into(), "long", goal))
        .await
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let (h, d) = (home.path().to_owned(), proj.path().to_owned());
    let out = tokio::task::spawn_blocking(move || {
        keel()
            .args(["run", "--thread", "long", "--window", "1024"])
            .arg("--home")
            .arg(&h)
            .arg("--dir")
            .arg(&d)
            .env("OPENAI_BASE_URL", url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The window to give fits the goal with them.
    assert!(
        stderr.contains("cannot run with this window: give --window ")
            && stderr.contains(" or more, e.g. keel run --thread long")
            && stderr.contains("keel run --thread long"),
        "{stderr}"
    );
}

/// An OpenAI-compatible server whose context is 2,048 tokens: every call overflows it.
async fn overflowing_server() -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(400).set_body_json(json!({"error": {
            "message": "Requested tokens (9000) exceed context window of 2048",
            "type": "invalid_request_error", "code": "context_length_exceeded"}})))
        .mount(&server)
        .await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_context_smaller_than_the_window_is_said_with_the_window_to_give() {
    let server = overflowing_server().await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let (h, d, url) = (
        home.path().to_owned(),
        proj.path().to_owned(),
        format!("{}/v1", server.uri()),
    );
    let out = tokio::task::spawn_blocking(move || {
        run_live("openai/local", ("OPENAI_BASE_URL", url), &h, &d, &[])
    })
    .await
    .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(
        first.contains("exceed context window of 2048")
            && first.contains("give --window 2048 or less")
            && first.contains("--window 2048"),
        "{stderr}"
    );
    assert!(
        !first.contains("resumes from its last checkpoint with: keel run --thread live-1 --home"),
        "not resumed as it ran: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_too_small_for_the_goal_is_said_to_be_so_not_given_a_window_to_retry() {
    let server = overflowing_server().await;
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    // A goal of some 3,000 tokens, never compacted: no window of 2,048 holds it.
    let goal = "Check every module for error handling. ".repeat(500);
    let out = keel()
        .args(["run", "--model", "openai/local", "--goal", &goal])
        .args(["--thread", "big-goal", "--window", "100000"])
        .arg("--home")
        .arg(home.path())
        .arg("--dir")
        .arg(proj.path())
        .env("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let first = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
    assert!(
        first.contains("the server holds 2,048 tokens")
            && first.contains("cannot run on this server")
            && first.contains("start a new thread with a shorter --goal")
            && !first.contains("--window 2048"),
        "{stderr}"
    );
}

/// [`Scripted`] (OpenAI), each reply `delay` late.
struct Slow(std::time::Duration);

impl Respond for Slow {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        Scripted { openai: true }.respond(request).set_delay(self.0)
    }
}

/// `keel run` against `server`, sent `signal` once the server has `after` requests;
/// its output, its home and its project directory.
#[cfg(unix)]
async fn signalled_run(
    server: &MockServer,
    signal: &str,
    after: usize,
) -> (Output, tempfile::TempDir, tempfile::TempDir) {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .args(["run", "--model", "openai/local", "--goal", "What is here?"])
        .args(["--thread", "signalled", "--window", "8000"])
        .arg("--home")
        .arg(home.path())
        .arg("--dir")
        .arg(proj.path())
        .env("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        .env_remove("OPENAI_API_KEY")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while server.received_requests().await.unwrap().len() < after {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the run never made request {after}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let kill = std::process::Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    (out, home, proj)
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_run_after_its_step_and_ctrl_c_during_the_answer_shows_it() {
    let delay = std::time::Duration::from_millis(1500);
    // SIGTERM during the first step: the step ends, then the run stops with 143.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(Slow(delay))
        .mount(&server)
        .await;
    let (out, home, proj) = signalled_run(&server, "-TERM", 1).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(143), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("SIGTERM: stopping after the current step")
            && stdout.contains(
                "stopped after the current step. Resume with: keel run --thread signalled"
            ),
        "{stdout}\n{stderr}"
    );
    assert!(stdout.contains("-> ls({})"), "the step finished: {stdout}");
    // The step was stored before the run stopped: resuming runs its tool call and asks
    // the model once more, not for the reply it already gave.
    let resumed = keel()
        .args(["run", "--thread", "signalled"])
        .arg("--home")
        .arg(home.path())
        .arg("--dir")
        .arg(proj.path())
        .env("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        .env_remove("OPENAI_API_KEY")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&resumed);
    assert!(resumed.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("answer:\nThe directory holds README.md and src."),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        server.received_requests().await.unwrap().len(),
        2,
        "one model call before the stop, one after the resume: {stdout}"
    );

    // Ctrl-C while the final answer is being written: the run ends with it.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(Slow(delay))
        .mount(&server)
        .await;
    let (out, _home, _proj) = signalled_run(&server, "-INT", 2).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("answer:\nThe directory holds README.md and src.")
            && !stdout.contains("stopped after the current step"),
        "{stdout}\n{stderr}"
    );
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_worker_and_puts_its_run_back_in_the_queue() {
    let Some(url) = database_url() else { return };
    let _fleet = FLEET.lock().await;
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(Slow(std::time::Duration::from_millis(1500)))
        .mount(&server)
        .await;
    let proj = project();
    let thread = unique_thread("cli-worker-sigterm");
    let fleet = |args: &[&str]| on_fleet(&url, args);
    let run = submitted_run(&fleet(&[
        "submit",
        "--thread",
        &thread,
        "--goal",
        "What is here?",
    ]));
    let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("keel"))
        .args(["worker", "--model", "openai/local", "--lease", "600"])
        .args(["--database-url", &url, "--dir"])
        .arg(proj.path())
        .env("OPENAI_BASE_URL", format!("{}/v1", server.uri()))
        .env_remove("OPENAI_API_KEY")
        .env_remove("KEEL_MODEL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The worker holds the run and is in its first model call.
    let started = std::time::Instant::now();
    while server.received_requests().await.unwrap().is_empty() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the worker never called the model"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("1 put back in the queue"),
        "{stdout}\n{stderr}"
    );
    // Back in the queue at once, not held until its 600-second lease ends.
    let status = fleet(&["status", &run, "--json"]);
    let info: Value =
        serde_json::from_slice(&status.stdout).unwrap_or_else(|_| panic!("{:?}", text(&status)));
    assert_eq!(info["status"], "queued", "{info}");
    let cancelled = fleet(&["cancel", &run]);
    assert!(cancelled.status.success(), "{:?}", text(&cancelled));
}

#[test]
fn a_chart_or_output_path_through_a_file_fails_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run.json");
    std::fs::write(&run, OPENAI_RUN).unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "not a directory").unwrap();
    let out = keel()
        .arg("replay")
        .arg(&run)
        .arg("--chart")
        .arg(file.join("tokens.svg"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("notes.txt is a file, not a directory"),
        "{stderr}"
    );
    assert!(
        !stdout.contains("replayed in"),
        "nothing replayed: {stdout}"
    );

    let proj = project();
    let out = demo(&["--steps", "5"], proj.path(), &file);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("notes.txt is a file, not a directory"),
        "{stderr}"
    );
}

#[test]
fn replay_tells_apart_runs_of_files_with_one_stem() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("openai.json"), OPENAI_RUN).unwrap();
    let lines: String = serde_json::from_str::<Vec<Value>>(OPENAI_RUN)
        .unwrap()
        .iter()
        .map(|m| format!("{m}\n"))
        .collect();
    std::fs::write(d.join("openai.jsonl"), lines).unwrap();
    let out = keel().arg("replay").arg(d).arg("--runs").output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for name in ["openai.json)", "openai.jsonl)"] {
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.starts_with("openai (") && l.contains(name))
                .count(),
            1,
            "one row for the run of {name}: {stdout}"
        );
    }
}

#[test]
fn replay_counts_a_file_named_twice_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("a.json"), OPENAI_RUN).unwrap();
    let out = keel()
        .arg("replay")
        .arg(d)
        .arg(d.join("a.json"))
        .arg(d.join("a.json"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("a.json was named more than once") && stderr.contains("replayed once"),
        "{stderr}"
    );
    assert_eq!(
        stdout.matches("a.json: openai (detected)").count(),
        1,
        "{stdout}"
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hierarchical"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells[1..3],
        ["1", "3"],
        "one run of 3 turns, not three: {row}"
    );
}

#[test]
fn replay_says_which_runs_had_no_goal_and_counts_the_turns_it_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("a.json"), OPENAI_RUN).unwrap();
    // Model turns but no user message: no task statement to anchor.
    std::fs::write(
        d.join("b.json"),
        r#"[{"role":"system","content":"be brief"},{"role":"assistant","content":"hello"},{"role":"assistant","content":"still here"}]"#,
    )
    .unwrap();
    let out = keel().arg("replay").arg(d).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("b.json: 1 run with model turns but no user message")
            && stderr.contains("--goal"),
        "{stderr}"
    );
    // a.json's 3 turns; b.json's 2 were not replayed: the header and the table agree.
    assert!(stdout.contains("2 runs, 3 model turns;"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hierarchical"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1..3], ["2", "3"], "{row}");

    // With --goal the run has one, and its turns are replayed.
    let out = keel()
        .args(["replay", "--goal", "Greet the user."])
        .arg(d.join("b.json"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("no user message"), "{stderr}");
    assert!(stdout.contains("1 run, 2 model turns;"), "{stdout}");
}

#[test]
fn replay_of_one_model_turn_has_no_cacheable_share() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("one-turn.json");
    std::fs::write(
        &file,
        r#"[{"role":"user","content":"Say hi."},{"role":"assistant","content":"hi"}]"#,
    )
    .unwrap();
    let out = keel().arg("replay").arg(&file).output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("hierarchical"))
        .unwrap_or_else(|| panic!("{stdout}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // No second turn, so no previous prompt to extend: not 0% cacheable.
    assert_eq!(cells[7], "-", "{row}");
    let out = keel()
        .args(["replay", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let total = &report["strategies"][0]["total"];
    assert_eq!(total["cacheable_share"], Value::Null, "{total}");
    assert_eq!(total["turns"], 1, "{total}");
}

/// The notes under the table agree with the JSON report: the runs that fit the budget
/// and cost more than their full history are counted per strategy, and a strategy that
/// compacted nothing beside one that did is said to have.
#[test]
fn replay_notes_dearer_runs_and_a_strategy_that_compacted_nothing() {
    let Some(data) = shared_data() else { return };
    let args = |json: bool| {
        let mut cmd = keel();
        cmd.args(["replay", "--window", "128000"])
            .args(["--strategy", "hierarchical", "--strategy", "masking"])
            .arg(data.join("swe-agent"));
        if json {
            cmd.arg("--json");
        }
        cmd.output().unwrap()
    };
    let out = args(true);
    assert!(out.status.success(), "{}", text(&out).1);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let out = args(false);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let mut any = false;
    for strategy in report["strategies"].as_array().unwrap() {
        let name = strategy["strategy"].as_str().unwrap();
        let dearer = strategy["runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| &r["report"])
            .filter(|r| r["turns_over_budget_full"] == 0)
            .filter(|r| r["cost"].as_f64() > r["cost_full"].as_f64())
            .count();
        let said = stdout
            .lines()
            .find(|l| l.contains(&format!("cost more with {name} than with the full history")));
        match dearer {
            0 => assert_eq!(said, None, "{stdout}"),
            n => {
                any = true;
                let runs = if n == 1 { "run" } else { "runs" };
                let line = said.unwrap_or_else(|| panic!("no note for {name}: {stdout}"));
                assert!(
                    line.starts_with(&format!("note: {n} {runs} that fit")),
                    "{line}"
                );
            }
        }
        let compacted = strategy["total"]["compactions"].as_u64().unwrap();
        let quiet = stdout.contains(&format!("note: {name} compacted nothing here"));
        assert_eq!(quiet, compacted == 0, "{name}: {stdout}");
    }
    // On these runs at this window a run does cost more (the cost model cannot know
    // how soon a run ends), so the note's wording is checked, not only its absence.
    assert!(any, "{stdout}");
}

#[test]
fn replay_json_recall_with_archive_is_at_least_the_recall_and_runs_add_up_to_totals() {
    let Some(data) = shared_data() else { return };
    let out = keel()
        .args(["replay", "--window", "4000", "--json"])
        .args(["--strategy", "hierarchical", "--strategy", "masking"])
        .arg(data.join("tau-bench/gpt-4o-airline.json"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    for strategy in report["strategies"].as_array().unwrap() {
        let total = &strategy["total"];
        let runs = strategy["runs"].as_array().unwrap();
        for key in [
            "runs",
            "turns",
            "tokens_full",
            "tokens",
            "needed_facts",
            "facts_in_prompt",
            "facts_in_archive",
        ] {
            let sum: u64 = runs
                .iter()
                .map(|r| r["report"][key].as_u64().unwrap())
                .sum();
            assert_eq!(Some(sum), total[key].as_u64(), "{key}: {total}");
        }
        let mut archived = 0;
        for r in runs.iter().map(|r| &r["report"]).chain([total]) {
            assert!(r["tokens"].as_u64() <= r["tokens_full"].as_u64(), "{r}");
            let Some(needed) = r["needed_facts"].as_u64().filter(|&n| n > 0) else {
                assert_eq!(r["recall_with_archive"], Value::Null, "{r}");
                continue;
            };
            let recall = r["recall"].as_f64().unwrap();
            let reach = r["recall_with_archive"].as_f64().unwrap();
            let found =
                r["facts_in_prompt"].as_u64().unwrap() + r["facts_in_archive"].as_u64().unwrap();
            assert!(
                (0.0..=1.0).contains(&recall) && (0.0..=1.0).contains(&reach),
                "{r}"
            );
            assert!(reach >= recall, "the archive only adds: {r}");
            assert!((reach - found as f64 / needed as f64).abs() < 1e-9, "{r}");
            archived += r["facts_in_archive"].as_u64().unwrap();
        }
        assert!(
            archived > 0,
            "some facts were read back from the archive at 4,000 tokens"
        );
    }
}

#[test]
fn a_masking_chart_marks_masking_not_milestones() {
    let dir = tempfile::tempdir().unwrap();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coder."}),
        json!({"role": "user", "content": "Find the bug."}),
    ];
    // Results under the eviction threshold (750 tokens at this window), so they
    // enter whole and masking is what makes room.
    for i in 0..12 {
        let id = format!("c{i}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "cat", "arguments": format!("{{\"path\":\"f{i}.py\"}}")}}]}));
        let body: String = (0..40)
            .map(|k| format!("line {k} of file {i}: value = {}\n", k * i))
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
    }
    messages.push(json!({"role": "assistant", "content": "Done."}));
    let file = dir.path().join("masky.json");
    std::fs::write(&file, Value::Array(messages).to_string()).unwrap();
    let svg = dir.path().join("m.svg");
    let out = keel()
        .args([
            "replay",
            "--window",
            "4000",
            "--strategy",
            "masking",
            "--chart",
        ])
        .arg(&svg)
        .arg(&file)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("chart of masky (masking, 13 turns)"),
        "{stdout}"
    );
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.contains("tool results masked"), "{chart}");
    assert!(
        !chart.contains("milestone"),
        "masking makes no milestones: {chart}"
    );
}

#[test]
fn replay_of_a_run_longer_than_the_agents_step_ceiling_reaches_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut messages = vec![json!({"role": "user", "content": "Count to 520."})];
    for k in 0..520 {
        messages.push(json!({"role": "assistant", "content": format!("{k}")}));
        messages.push(json!({"role": "user", "content": "next"}));
    }
    let file = dir.path().join("long.json");
    std::fs::write(&file, Value::Array(messages).to_string()).unwrap();
    let out = keel()
        .args(["replay", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["strategies"][0]["total"]["turns"], 520);
}

/// A demo thread `few` of more than two checkpoints in a new home, and how many it has.
fn few_checkpoints() -> (tempfile::TempDir, usize) {
    let proj = project();
    let home = tempfile::tempdir().unwrap();
    let out = demo(
        &["--steps", "5", "--json", "-q", "--thread", "few"],
        proj.path(),
        home.path(),
    );
    assert!(out.status.success(), "{:?}", text(&out));
    let all = threads_in(
        home.path(),
        &["history", "few", "--limit", "1000", "--json"],
    );
    let stored = serde_json::from_slice::<Value>(&all.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .len();
    assert!(stored > 2, "{stored}");
    (home, stored)
}

fn threads_in(home: &Path, args: &[&str]) -> Output {
    keel()
        .arg("threads")
        .args(args)
        .arg("--home")
        .arg(home)
        .output()
        .unwrap()
}

#[test]
fn threads_history_says_when_older_checkpoints_follow() {
    let (home, stored) = few_checkpoints();
    let two = threads_in(home.path(), &["history", "few", "--limit", "2"]);
    let (stdout, _) = text(&two);
    assert_eq!(
        stdout.lines().count(),
        2 + 2 + 2,
        "header, rule, 2 rows, what a superstep is, the hint: {stdout}"
    );
    assert!(stdout.contains("(a superstep is one round"), "{stdout}");
    assert!(
        stdout.contains("(the newest 2 shown; older ones follow: --limit 4 shows more)"),
        "{stdout}"
    );
    let limit = stored.to_string();
    let every = threads_in(home.path(), &["history", "few", "--limit", &limit]);
    let (stdout, _) = text(&every);
    assert!(
        !stdout.contains("older ones follow"),
        "all {stored} shown: {stdout}"
    );
}

#[test]
fn threads_prune_says_how_many_it_kept() {
    let (home, stored) = few_checkpoints();
    // More kept than there are: all of them, said as such.
    let prune = threads_in(home.path(), &["prune", "few", "--keep", "1000", "--json"]);
    let pruned: Value = serde_json::from_slice(&prune.stdout).unwrap();
    assert_eq!(pruned["kept"], stored, "{pruned}");
    assert_eq!(pruned["removed"], 0, "{pruned}");
    let prune = threads_in(home.path(), &["prune", "few", "--keep", "1000"]);
    let (stdout, _) = text(&prune);
    assert!(
        stdout.contains(&format!("it has {stored}, fewer than --keep 1000")),
        "{stdout}"
    );
    let prune = threads_in(home.path(), &["prune", "few", "--keep", "2"]);
    let (stdout, _) = text(&prune);
    assert!(stdout.contains("kept the newest 2"), "{stdout}");
    let show = threads_in(home.path(), &["show", "few"]);
    assert!(
        show.status.success(),
        "a pruned thread still shows: {:?}",
        text(&show)
    );
}

#[test]
fn replay_reads_a_file_with_a_byte_order_mark_and_follows_links_in_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Windows tools (PowerShell's exports) start UTF-8 files with a byte-order mark.
    let mut bom = b"\xEF\xBB\xBF".to_vec();
    bom.extend_from_slice(OPENAI_RUN.as_bytes());
    std::fs::create_dir(d.join("real")).unwrap();
    std::fs::write(d.join("real/bom.json"), &bom).unwrap();
    let lines: String = serde_json::from_str::<Vec<Value>>(OPENAI_RUN)
        .unwrap()
        .iter()
        .map(|m| format!("{m}\n"))
        .collect();
    let mut bom_lines = b"\xEF\xBB\xBF".to_vec();
    bom_lines.extend_from_slice(lines.as_bytes());
    std::fs::write(d.join("real/bom.jsonl"), &bom_lines).unwrap();
    // A directory of links: to a file, and to a directory holding that file too (it
    // is replayed once).
    std::fs::create_dir(d.join("links")).unwrap();
    std::os::unix::fs::symlink(d.join("real/bom.json"), d.join("links/linked.json")).unwrap();
    std::os::unix::fs::symlink(d.join("real"), d.join("links/dir")).unwrap();
    for (target, files) in [(d.join("real"), 2), (d.join("links"), 2)] {
        let out = keel()
            .arg("replay")
            .arg(&target)
            .arg("--json")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{target:?}: {stdout}\n{stderr}");
        let v: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(v["files"].as_array().unwrap().len(), files, "{v}");
        assert!(v["skipped"].as_array().unwrap().is_empty(), "{v}");
    }
}

#[test]
fn replay_says_when_a_known_model_is_counted_by_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.json");
    std::fs::write(&file, OPENAI_RUN).unwrap();
    for (model, estimated) in [("llama3", true), ("gpt-4o", false)] {
        let out = keel()
            .arg("replay")
            .arg(&file)
            .args(["--model", model])
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert_eq!(
            stderr.contains(&format!("keel has no tokenizer for `{model}`")),
            estimated,
            "{model}: {stderr}"
        );
    }
}

#[test]
fn replay_of_a_strategy_named_twice_shows_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.json");
    std::fs::write(&file, OPENAI_RUN).unwrap();
    let out = keel()
        .arg("replay")
        .arg(&file)
        .args([
            "--strategy",
            "masking",
            "--strategy",
            "hybrid",
            "--strategy",
            "masking",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("masking ")).count(),
        1,
        "{stdout}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("hybrid ")).count(),
        1,
        "{stdout}"
    );
}

#[test]
fn replay_notes_full_history_prompts_no_model_would_have_taken() {
    let dir = tempfile::tempdir().unwrap();
    let mut run = vec![
        json!({"role": "system", "content": "You are a support agent."}),
        json!({"role": "user", "content": "Read the four logs."}),
    ];
    for i in 0..4 {
        run.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function",
            "function": {"name": "read_log", "arguments": format!("{{\"log\":{i}}}")}}]}));
        run.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("log {i}: {}", "request served in 12 ms; ".repeat(600))}));
    }
    run.push(json!({"role": "assistant", "content": "The logs are fine."}));
    let file = dir.path().join("logs.json");
    std::fs::write(&file, serde_json::to_string(&run).unwrap()).unwrap();
    let out = keel()
        .args(["replay", "--window", "8000"])
        .arg(&file)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("of the full history's 5 turns were over the 6,000-token budget")
            && stdout.contains("over the 8,000-token window itself")
            && stdout.contains("count what no run could have sent there"),
        "{stdout}"
    );
    // The budget is the window less the reply's reserve, as the legend says.
    assert!(
        stdout.contains(
            "over budget = prompts over 6,000 tokens (the window less 2,000 reserved for the reply)"
        ),
        "{stdout}"
    );
    // A run that fits says nothing of the kind.
    let small = dir.path().join("small.json");
    std::fs::write(&small, OPENAI_RUN).unwrap();
    let out = keel().arg("replay").arg(&small).output().unwrap();
    assert!(!text(&out).0.contains("over the"), "{:?}", text(&out));
}

#[test]
fn replay_prices_cached_tokens_as_told() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("run.json");
    std::fs::write(&file, OPENAI_RUN).unwrap();
    let cost = |price: Option<&str>| {
        let mut cmd = keel();
        cmd.args(["replay", "--json"]).arg(&file);
        if let Some(p) = price {
            cmd.args(["--cached-price", p]);
        }
        let out = cmd.output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let total = &v["strategies"][0]["total"];
        (
            v["cached_price"].as_f64().unwrap(),
            total["cost_full"].as_f64().unwrap(),
            total["tokens_full"].as_f64().unwrap(),
        )
    };
    let (p, default_cost, tokens) = cost(None);
    assert_eq!(p, 0.1);
    let (p, dear, _) = cost(Some("1"));
    assert_eq!(p, 1.0);
    // At 1 a cached token costs what any other does.
    assert_eq!(dear, tokens);
    assert!(default_cost < dear, "{default_cost} {dear}");
    let (_, half, _) = cost(Some("0.5"));
    assert!(
        default_cost < half && half < dear,
        "{default_cost} {half} {dear}"
    );
    // A price out of range is a usage error that says what to give.
    let out = keel()
        .args(["replay", "--cached-price", "2"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).1.contains("from 0 to 1"), "{:?}", text(&out));
}

/// A state of a graph of the user's own, not the agent's.
#[derive(Clone, keel::graph::State)]
struct Plain {
    #[reducer(keel::reducer::Append<String>)]
    log: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_on_a_thread_of_another_graph_says_whose_it_is_and_history_still_lists_it() {
    use keel::graph::{END, RunConfig, START, StateGraph};
    let home = tempfile::tempdir().unwrap();
    let saver = keel::sqlite::SqliteOptions::default()
        .open(home.path().join("keel.sqlite"))
        .await
        .unwrap();
    let graph = StateGraph::<Plain>::new()
        .add_node("note", |_s, _c| async {
            Ok(PlainUpdate::default().log(vec!["noted".to_owned()]))
        })
        .add_edge(START, "note")
        .add_edge("note", END)
        .with_checkpointer(std::sync::Arc::new(saver))
        .compile()
        .unwrap();
    let config = RunConfig::thread("plain");
    graph.invoke(PlainUpdate::default(), &config).await.unwrap();
    // A fork: an edit at the thread's first checkpoint.
    let first = graph
        .get_state(&config)
        .await
        .unwrap()
        .unwrap()
        .parent_id
        .unwrap();
    let fork = graph
        .update_state(
            &config.clone().at(first.clone()),
            PlainUpdate::default().log(vec!["edited".to_owned()]),
            None,
        )
        .await
        .unwrap();
    let h = home.path().to_owned();
    let (show, history) = tokio::task::spawn_blocking(move || {
        let run = |args: &[&str]| {
            keel()
                .arg("threads")
                .args(args)
                .arg("--home")
                .arg(&h)
                .output()
                .unwrap()
        };
        (
            run(&["show", "plain"]),
            (
                run(&["history", "plain"]),
                run(&["history", "plain", "--json"]),
            ),
        )
    })
    .await
    .unwrap();
    let (history, history_json) = history;
    assert_eq!(show.status.code(), Some(1), "{:?}", text(&show));
    assert!(
        text(&show).1.contains("was not written by keel's agent")
            && text(&show).1.contains("keel threads history plain"),
        "{:?}",
        text(&show)
    );
    assert!(history.status.success(), "{:?}", text(&history));
    // The fork's parent is not the row below it: named, with a note saying why.
    let table = text(&history).0;
    let fork_row = table
        .lines()
        .find(|l| l.starts_with(&fork.to_string()))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(fork_row.ends_with(&first.to_string()), "{table}");
    assert!(table.contains("the thread was forked there"), "{table}");
    let listed: Value = serde_json::from_slice(&history_json.stdout).unwrap();
    let fork_entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["checkpoint"] == fork.to_string().as_str())
        .unwrap();
    assert_eq!(fork_entry["parent"], first.to_string().as_str());
}

#[test]
fn a_demo_over_a_directory_with_nothing_to_read_creates_nothing() {
    let empty = tempfile::tempdir().unwrap();
    let home = empty.path().join(".keel");
    let out = demo(&["-q"], empty.path(), &home);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("has no readable text file"), "{stderr}");
    assert!(!home.exists(), "no home is left behind");
}
