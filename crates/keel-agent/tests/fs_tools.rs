//! The built-in file tools against real directories.
#![cfg(feature = "fs")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fs;
use std::path::Path;
use std::sync::Arc;

use keel_agent::tools::{
    EDIT_FILE, FileLimits, FileTools, FileToolsError, GREP, LS, OFFLOAD_DIRS, READ_FILE, WRITE_FILE,
};
use keel_message::{Message, Tool, ToolContext, ToolError};
use keel_offload::{Archive, Key, MemoryStore, OffloadStore, ThreadId, ToolLimits};
use serde_json::{Value, json};
use tempfile::TempDir;

/// A root directory with the tools over it.
struct Fixture {
    dir: TempDir,
    tools: Vec<Arc<dyn Tool>>,
}

impl Fixture {
    fn new() -> Self {
        Self::with(|t| t)
    }

    fn with(configure: impl FnOnce(FileTools) -> FileTools) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let tools = configure(FileTools::new(dir.path()).unwrap()).tools();
        Fixture { dir, tools }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn put(&self, rel: &str, content: impl AsRef<[u8]>) {
        let p = self.path().join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, content).unwrap();
    }

    fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.path().join(rel)).unwrap()
    }

    async fn call(&self, name: &str, args: Value) -> Result<String, ToolError> {
        self.call_in(name, args, ToolContext::new("call_test"))
            .await
    }

    async fn call_in(
        &self,
        name: &str,
        args: Value,
        ctx: ToolContext,
    ) -> Result<String, ToolError> {
        let tool = self
            .tools
            .iter()
            .find(|t| t.spec().name == name)
            .unwrap_or_else(|| panic!("no tool {name}"));
        tool.call(args, ctx).await
    }

    async fn ok(&self, name: &str, args: Value) -> String {
        match self.call(name, args.clone()).await {
            Ok(out) => out,
            Err(e) => panic!("{name}({args}) failed: {e}"),
        }
    }

    async fn err(&self, name: &str, args: Value) -> String {
        match self.call(name, args.clone()).await {
            Ok(out) => panic!("{name}({args}) succeeded: {out}"),
            Err(e) => e.to_string(),
        }
    }
}

fn names(tools: &[Arc<dyn Tool>]) -> Vec<String> {
    tools.iter().map(|t| t.spec().name).collect()
}

// ---------------------------------------------------------------------------------
// Construction

#[test]
fn tools_are_the_five_or_the_three_read_only_ones() {
    let dir = tempfile::tempdir().unwrap();
    let files = FileTools::new(dir.path()).unwrap();
    assert_eq!(files.root(), dir.path().canonicalize().unwrap());
    assert!(!files.is_read_only());
    assert_eq!(
        names(&files.tools()),
        [LS, READ_FILE, GREP, WRITE_FILE, EDIT_FILE]
    );
    let read_only = files.read_only();
    assert!(read_only.is_read_only());
    assert_eq!(names(&read_only.tools()), [LS, READ_FILE, GREP]);
    for tool in read_only.tools() {
        let spec = tool.spec();
        assert_eq!(spec.parameters["type"], "object");
        assert!(!spec.description.is_empty());
        // Without an offload store, nothing is said about it.
        assert!(!spec.description.contains("large_tool_results"));
    }
}

#[test]
fn the_root_must_be_an_existing_directory() {
    let dir = tempfile::tempdir().unwrap();
    let missing = FileTools::new(dir.path().join("nope")).unwrap_err();
    assert!(
        matches!(missing, FileToolsError::Root { .. }),
        "{missing:?}"
    );
    assert!(missing.to_string().contains("nope"));
    fs::write(dir.path().join("file"), "x").unwrap();
    let file = FileTools::new(dir.path().join("file")).unwrap_err();
    assert!(
        matches!(file, FileToolsError::NotADirectory { .. }),
        "{file:?}"
    );
    assert!(file.to_string().contains("is not a directory"));
}

#[test]
fn limits_show_in_the_specs() {
    let dir = tempfile::tempdir().unwrap();
    let files = FileTools::new(dir.path())
        .unwrap()
        .with_limits(ToolLimits {
            max_read_lines: 42,
            ..ToolLimits::default()
        })
        .with_file_limits(FileLimits {
            max_write_bytes: 1234,
            ..FileLimits::default()
        });
    assert_eq!(files.limits().max_read_lines, 42);
    assert_eq!(files.file_limits().max_write_bytes, 1234);
    let tools = files.tools();
    let read = tools.iter().find(|t| t.spec().name == READ_FILE).unwrap();
    assert_eq!(read.spec().parameters["properties"]["limit"]["maximum"], 42);
    let write = tools.iter().find(|t| t.spec().name == WRITE_FILE).unwrap();
    assert!(write.spec().description.contains("1,234 bytes"));
}

// ---------------------------------------------------------------------------------
// ls

#[tokio::test]
async fn ls_lists_sorted_with_directories_marked_and_sizes() {
    let f = Fixture::new();
    f.put("b.txt", "hello");
    f.put("a.md", "");
    f.put("src/lib.rs", "fn main() {}\n");
    f.put(".hidden", "x");
    assert_eq!(
        f.ok(LS, json!({})).await,
        "The root directory holds 4 entries:\n.hidden\t1 byte\na.md\t0 bytes\nb.txt\t5 bytes\nsrc/"
    );
    assert_eq!(
        f.ok(LS, json!({"path": "src"})).await,
        "`src` holds 1 entry:\nsrc/lib.rs\t13 bytes"
    );
    assert_eq!(
        f.ok(LS, json!({"path": "./src/"})).await,
        f.ok(LS, json!({"path": "src"})).await
    );
    fs::create_dir(f.path().join("empty")).unwrap();
    assert_eq!(
        f.ok(LS, json!({"path": "empty"})).await,
        "`empty` is empty."
    );
    assert_eq!(
        f.ok(LS, json!({"path": "b.txt"})).await,
        "`b.txt` is a file of 5 bytes, not a directory; read it with read_file."
    );
    let missing = f.err(LS, json!({"path": "nope"})).await;
    assert_eq!(
        missing,
        "`nope` does not exist; use ls to see what is there"
    );
}

/// A `write_file` killed between writing its temporary file and renaming it leaves
/// `.keel-write-*` behind: neither `ls` nor `grep` shows it (found by the fleet test,
/// which SIGKILLs workers mid-write).
#[tokio::test]
async fn a_killed_writes_temporary_file_is_not_listed_or_searched() {
    let f = Fixture::new();
    f.put("notes.txt", "the answer is 42\n");
    f.put(".keel-write-Ab12Cd", "the answer is 42\n");
    f.put("src/.keel-write-Zz9", "partial");
    assert_eq!(
        f.ok(LS, json!({})).await,
        "The root directory holds 2 entries:\nnotes.txt\t17 bytes\nsrc/"
    );
    assert_eq!(f.ok(LS, json!({"path": "src"})).await, "`src` is empty.");
    let hits = f.ok("grep", json!({"pattern": "answer"})).await;
    assert!(
        hits.contains("notes.txt") && !hits.contains(".keel-write-"),
        "{hits}"
    );
}

#[tokio::test]
async fn ls_keeps_the_first_entries_by_name_and_says_how_many_more() {
    let f = Fixture::with(|t| {
        t.with_limits(ToolLimits {
            max_ls_entries: 3,
            ..ToolLimits::default()
        })
    });
    for i in (0..10).rev() {
        f.put(&format!("f{i}"), "");
    }
    let out = f.ok(LS, json!({})).await;
    assert_eq!(
        out,
        "The root directory holds 10 entries:\nf0\t0 bytes\nf1\t0 bytes\nf2\t0 bytes\n\
         [showing the first 3 of 10 entries, sorted by name: list a subdirectory, or find \
         files with grep and a glob]"
    );
}

// ---------------------------------------------------------------------------------
// read_file

fn numbered(range: std::ops::RangeInclusive<usize>) -> String {
    range.map(|i| format!("line {i}\n")).collect()
}

#[tokio::test]
async fn read_file_numbers_lines_and_says_how_to_continue() {
    let f = Fixture::new();
    f.put("notes.txt", numbered(1..=250));
    let first = f.ok(READ_FILE, json!({"path": "notes.txt"})).await;
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines.len(), 101);
    assert_eq!(lines[0], "     1\tline 1");
    assert_eq!(lines[99], "   100\tline 100");
    assert_eq!(lines[100], "[more lines follow: continue with offset=100]");

    let page = f
        .ok(
            READ_FILE,
            json!({"path": "notes.txt", "offset": 100, "limit": 2}),
        )
        .await;
    assert_eq!(
        page,
        "   101\tline 101\n   102\tline 102\n[more lines follow: continue with offset=102]"
    );
    let tail = f
        .ok(READ_FILE, json!({"path": "notes.txt", "offset": 248}))
        .await;
    assert_eq!(
        tail,
        "   249\tline 249\n   250\tline 250\n[end of file: 250 lines]"
    );
    // A limit over the maximum is lowered to it.
    let big = f
        .ok(READ_FILE, json!({"path": "notes.txt", "limit": 10_000}))
        .await;
    assert!(
        big.ends_with("[more lines follow: continue with offset=500]")
            || big.contains("[end of file: 250 lines]")
    );
    assert_eq!(big.lines().count(), 251);

    assert_eq!(
        f.ok(READ_FILE, json!({"path": "notes.txt", "offset": 250}))
            .await,
        "Offset 250 is past the end: `notes.txt` has 250 lines."
    );
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "notes.txt", "offset": 900}))
            .await,
        "Offset 900 is past the end: `notes.txt` has 250 lines."
    );
    f.put("empty.txt", "");
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "empty.txt"})).await,
        "`empty.txt` is empty."
    );
    f.put("crlf.txt", "a\r\nb\r\nlast without newline");
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "crlf.txt"})).await,
        "     1\ta\n     2\tb\n     3\tlast without newline\n[end of file: 3 lines]"
    );
}

#[tokio::test]
async fn read_file_cuts_long_lines_and_caps_the_output() {
    let f = Fixture::with(|t| {
        t.with_limits(ToolLimits {
            max_line_chars: 10,
            max_output_chars: 100,
            ..ToolLimits::default()
        })
    });
    f.put("long.txt", format!("{}\nshort\n", "x".repeat(25)));
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "long.txt"})).await,
        "     1\txxxxxxxxxx… [15 more characters]\n     2\tshort\n[end of file: 2 lines]"
    );
    f.put("many.txt", numbered(1..=50));
    let out = f.ok(READ_FILE, json!({"path": "many.txt"})).await;
    assert!(out.chars().count() < 200, "{out}");
    let last = out.lines().last().unwrap();
    assert!(
        last.starts_with("[output capped at 100 characters: continue with offset="),
        "{out}"
    );
    // The offset in the note continues right after the last line shown.
    let shown = out.lines().count() - 1;
    assert_eq!(
        last,
        format!("[output capped at 100 characters: continue with offset={shown}]")
    );
}

#[tokio::test]
async fn read_file_streams_huge_files_and_huge_lines() {
    let f = Fixture::new();
    // One 64 MiB line: read_file keeps only the start of it.
    let file = fs::File::create(f.path().join("one-line.log")).unwrap();
    file.set_len(0).unwrap();
    {
        use std::io::Write;
        let mut w = std::io::BufWriter::new(file);
        let chunk = vec![b'a'; 1 << 20];
        for _ in 0..64 {
            w.write_all(&chunk).unwrap();
        }
        w.write_all(b"\nsecond\n").unwrap();
    }
    let out = f
        .ok(READ_FILE, json!({"path": "one-line.log", "limit": 2}))
        .await;
    assert!(out.starts_with("     1\taaaa"), "{}", &out[..50]);
    assert!(out.contains("… [line cut]\n     2\tsecond\n[end of file: 2 lines]"));
    assert!(out.len() < 3_000);

    // 300,000 lines: reading near the end streams past the start.
    f.put("many.log", numbered(1..=300_000));
    let out = f
        .ok(READ_FILE, json!({"path": "many.log", "offset": 299_998}))
        .await;
    assert_eq!(
        out,
        "299999\tline 299999\n300000\tline 300000\n[end of file: 300,000 lines]"
    );
}

#[tokio::test]
async fn read_file_refuses_binary_files_directories_and_special_files() {
    let f = Fixture::new();
    f.put("image.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR");
    assert_eq!(
        f.err(READ_FILE, json!({"path": "image.png"})).await,
        "`image.png` is a binary file (16 bytes); read_file shows text files only"
    );
    let mut late = "text\n".repeat(3000).into_bytes();
    late.extend_from_slice(b"bin\0ary\nmore\n");
    f.put("late.bin", &late);
    let out = f
        .ok(READ_FILE, json!({"path": "late.bin", "offset": 2999}))
        .await;
    assert_eq!(
        out,
        "  3000\ttext\n[line 3001 holds binary data (a NUL byte): the rest of `late.bin` is not shown]"
    );
    fs::create_dir(f.path().join("dir")).unwrap();
    assert_eq!(
        f.err(READ_FILE, json!({"path": "dir"})).await,
        "`dir` is a directory; list it with ls"
    );
    assert_eq!(
        f.err(READ_FILE, json!({"path": "missing.txt"})).await,
        "`missing.txt` does not exist; use ls to see what is there"
    );
    assert_eq!(
        f.err(READ_FILE, json!({})).await,
        "bad arguments: `path` is required"
    );
    #[cfg(unix)]
    {
        let fifo = f.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let err = f.err(READ_FILE, json!({"path": "pipe"})).await;
            assert!(err.contains("is not a regular file"), "{err}");
        }
    }
}

// ---------------------------------------------------------------------------------
// grep

#[tokio::test]
async fn grep_reports_path_line_and_text() {
    let f = Fixture::new();
    f.put(
        "src/lib.rs",
        "pub mod a;\nfn helper() {}\npub fn main() {}\n",
    );
    f.put("src/a.rs", "// nothing\npub fn a() {}\n");
    f.put("README.md", "Call main() to start.\n");
    assert_eq!(
        f.ok(GREP, json!({"pattern": r"^pub fn"})).await,
        "src/a.rs:2: pub fn a() {}\nsrc/lib.rs:3: pub fn main() {}"
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "main", "path": "src"})).await,
        "src/lib.rs:3: pub fn main() {}"
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "(?i)CALL", "path": "README.md"}))
            .await,
        "README.md:1: Call main() to start."
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "zebra"})).await,
        "No lines match `zebra` in 3 files under the root directory."
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "zebra", "path": "README.md"}))
            .await,
        "No lines match `zebra` in `README.md`."
    );
    let bad = f.err(GREP, json!({"pattern": "(unclosed"})).await;
    assert!(
        bad.starts_with("bad arguments: `pattern` is not a valid regular expression"),
        "{bad}"
    );
}

#[tokio::test]
async fn grep_skips_hidden_target_ignored_and_binary_files() {
    let f = Fixture::new();
    f.put("src/main.rs", "needle\n");
    f.put(".git/config", "needle\n");
    f.put(".env", "needle\n");
    f.put("target/debug/out.txt", "needle\n");
    f.put("crates/x/target/y.txt", "needle\n");
    f.put("build/gen.rs", "needle\n");
    f.put("app.log", "needle\n");
    f.put(".gitignore", "build/\n*.log\n");
    f.put("blob.bin", b"needle\0\x01\x02");
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle"})).await,
        "src/main.rs:1: needle\n[1 file skipped as binary]"
    );
    // Named explicitly, an ignored or hidden place is searched.
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle", "path": "build"}))
            .await,
        "build/gen.rs:1: needle"
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle", "path": ".git"}))
            .await,
        ".git/config:1: needle"
    );
}

#[tokio::test]
async fn grep_applies_gitignore_files_between_the_root_and_the_search_path() {
    let f = Fixture::new();
    f.put(".gitignore", "*.gen\n");
    f.put("a/.gitignore", "secret/\n");
    f.put("a/b/keep.txt", "needle\n");
    f.put("a/b/skip.gen", "needle\n");
    f.put("a/b/secret/x.txt", "needle\n");
    f.put("a/b/.gitignore", "local.txt\n");
    f.put("a/b/local.txt", "needle\n");
    for path in ["", "a", "a/b"] {
        assert_eq!(
            f.ok(GREP, json!({"pattern": "needle", "path": path})).await,
            "a/b/keep.txt:1: needle",
            "searching {path:?}"
        );
    }
    // The tools keep the parsed .gitignore files above the search path between calls:
    // an edited one is read again.
    f.put("a/.gitignore", "secret/\nkeep.txt\n");
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle", "path": "a/b"}))
            .await,
        "No lines match `needle` in 0 files under `a/b`."
    );
    fs::remove_file(f.path().join("a/.gitignore")).unwrap();
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle", "path": "a/b"}))
            .await,
        "a/b/keep.txt:1: needle\na/b/secret/x.txt:1: needle"
    );
}

#[tokio::test]
async fn grep_glob_keeps_matching_files() {
    let f = Fixture::new();
    f.put("src/a.rs", "fn x() {}\n");
    f.put("src/b.py", "def x(): pass\n");
    f.put("src/deep/c.rs", "fn y() {}\n");
    assert_eq!(
        f.ok(GREP, json!({"pattern": "x|y", "glob": "*.rs"})).await,
        "src/a.rs:1: fn x() {}\nsrc/deep/c.rs:1: fn y() {}"
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "x", "path": "src", "glob": "*.py"}))
            .await,
        "src/b.py:1: def x(): pass"
    );
    let bad = f
        .err(GREP, json!({"pattern": "x", "glob": "[unclosed"}))
        .await;
    assert!(
        bad.starts_with("bad arguments: `glob` is not a valid glob"),
        "{bad}"
    );
}

#[tokio::test]
async fn grep_stops_at_results_files_and_bytes() {
    let f = Fixture::with(|t| {
        t.with_file_limits(FileLimits {
            max_grep_files: 3,
            max_grep_bytes: 1_000,
            ..FileLimits::default()
        })
    });
    f.put("a.txt", "hit\nhit\nhit\n");
    let out = f
        .ok(GREP, json!({"pattern": "hit", "max_results": 2}))
        .await;
    assert_eq!(
        out,
        "a.txt:1: hit\na.txt:2: hit\n[stopped at 2 matches: narrow the pattern or the path]"
    );
    for name in ["b.txt", "c.txt", "d.txt", "e.txt"] {
        f.put(name, "miss\n");
    }
    let out = f.ok(GREP, json!({"pattern": "zzz"})).await;
    assert_eq!(
        out,
        "No lines match `zzz` in 3 files under the root directory.\n[stopped after \
         searching 3 files, the most one call searches: narrow the path or add a glob to \
         search the rest]"
    );
    f.put(
        "big/huge.txt",
        format!("{}needle\n", "filler\n".repeat(1_000)),
    );
    let out = f
        .ok(GREP, json!({"pattern": "needle", "path": "big"}))
        .await;
    assert_eq!(
        out,
        "No lines match `needle` in 1 file under `big`.\n[stopped after reading 1,000 \
         bytes, the most one call reads: narrow the path or add a glob to search the rest]"
    );
}

#[tokio::test]
async fn grep_stops_in_a_tree_of_empty_directories() {
    let f = Fixture::with(|t| {
        t.with_file_limits(FileLimits {
            max_grep_files: 1,
            ..FileLimits::default()
        })
    });
    for i in 0..30 {
        fs::create_dir_all(f.path().join(format!("d{i:02}/e"))).unwrap();
    }
    assert_eq!(
        f.ok(GREP, json!({"pattern": "x"})).await,
        "No lines match `x` in 0 files under the root directory.\n[stopped after visiting \
         10 paths, the most one call visits: narrow the path or add a glob to search the \
         rest]"
    );
}

#[tokio::test]
async fn grep_cuts_long_lines() {
    let f = Fixture::with(|t| {
        t.with_limits(ToolLimits {
            grep_line_chars: 8,
            ..ToolLimits::default()
        })
    });
    f.put("a.txt", "needle in a long haystack\n");
    assert_eq!(
        f.ok(GREP, json!({"pattern": "needle"})).await,
        "a.txt:1: needle i… [17 more characters]"
    );
}

// ---------------------------------------------------------------------------------
// write_file

#[tokio::test]
async fn write_file_creates_parents_and_never_overwrites() {
    let f = Fixture::new();
    assert_eq!(
        f.ok(
            WRITE_FILE,
            json!({"path": "a/b/c.txt", "content": "x\ny\n"})
        )
        .await,
        "Created a/b/c.txt (2 lines, 4 bytes)."
    );
    assert_eq!(f.read("a/b/c.txt"), "x\ny\n");
    assert_eq!(
        f.ok(WRITE_FILE, json!({"path": "one.txt", "content": "single"}))
            .await,
        "Created one.txt (1 line, 6 bytes)."
    );
    assert_eq!(
        f.err(WRITE_FILE, json!({"path": "a/b/c.txt", "content": "new"}))
            .await,
        "`a/b/c.txt` already exists, and write_file never overwrites; change it with \
         edit_file (read it first with read_file), or write to a new path"
    );
    assert_eq!(f.read("a/b/c.txt"), "x\ny\n");
    assert_eq!(
        f.err(WRITE_FILE, json!({"path": "a/b", "content": "x"}))
            .await,
        "`a/b` is a directory; give the path of a file to create"
    );
    let under_file = f
        .err(WRITE_FILE, json!({"path": "one.txt/x", "content": "x"}))
        .await;
    assert_eq!(
        under_file,
        "`one.txt` is a file, so nothing can be created under it"
    );
    assert_eq!(
        f.err(WRITE_FILE, json!({"path": ".", "content": "x"}))
            .await,
        "bad arguments: `path` must name a file, got `.` (the root directory)"
    );
    assert_eq!(
        f.err(WRITE_FILE, json!({"path": "x.txt"})).await,
        "bad arguments: `content` is required"
    );
    // No temporary file is left behind.
    let left: Vec<_> = fs::read_dir(f.path().join("a/b"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["c.txt"]);
}

#[cfg(unix)]
#[tokio::test]
async fn write_file_refuses_a_dangling_symlink_instead_of_writing_through_it() {
    let f = Fixture::new();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path().join("new.txt"), f.path().join("link.txt")).unwrap();
    let err = f
        .err(WRITE_FILE, json!({"path": "link.txt", "content": "x"}))
        .await;
    assert!(err.contains("already exists"), "{err}");
    assert!(!outside.path().join("new.txt").exists());
}

#[tokio::test]
async fn write_file_caps_the_content_size() {
    let f = Fixture::with(|t| {
        t.with_file_limits(FileLimits {
            max_write_bytes: 10,
            ..FileLimits::default()
        })
    });
    assert_eq!(
        f.err(
            WRITE_FILE,
            json!({"path": "big.txt", "content": "x".repeat(11)})
        )
        .await,
        "bad arguments: `content` is 11 bytes; write_file writes at most 10 bytes: write a \
         smaller file, or several"
    );
    assert!(!f.path().join("big.txt").exists());
    f.ok(
        WRITE_FILE,
        json!({"path": "ok.txt", "content": "x".repeat(10)}),
    )
    .await;
}

#[test]
fn default_write_limit_is_ten_mib() {
    assert_eq!(FileLimits::default().max_write_bytes, 10 * 1024 * 1024);
}

// ---------------------------------------------------------------------------------
// edit_file

#[tokio::test]
async fn edit_file_replaces_a_unique_string_or_every_one_when_asked() {
    let f = Fixture::new();
    f.put("a.rs", "let x = 1;\nlet y = 2;\nlet x2 = x;\n");
    assert_eq!(
        f.ok(
            EDIT_FILE,
            json!({"path": "a.rs", "old_string": "y = 2", "new_string": "y = 3"})
        )
        .await,
        "Replaced 1 occurrence in a.rs."
    );
    assert_eq!(f.read("a.rs"), "let x = 1;\nlet y = 3;\nlet x2 = x;\n");
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "a.rs", "old_string": "x", "new_string": "z"})
        )
        .await,
        "`old_string` occurs 3 times in `a.rs`; include more surrounding lines to make it \
         unique, or set replace_all to true to replace all 3"
    );
    assert_eq!(f.read("a.rs"), "let x = 1;\nlet y = 3;\nlet x2 = x;\n");
    assert_eq!(
        f.ok(
            EDIT_FILE,
            json!({"path": "a.rs", "old_string": "x", "new_string": "z", "replace_all": true})
        )
        .await,
        "Replaced 3 occurrences in a.rs."
    );
    assert_eq!(f.read("a.rs"), "let z = 1;\nlet y = 3;\nlet z2 = z;\n");
}

#[tokio::test]
async fn edit_file_says_what_is_wrong() {
    let f = Fixture::new();
    f.put("a.txt", "alpha\r\nbeta\r\n");
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "gamma", "new_string": "x"})
        )
        .await,
        "`old_string` was not found in `a.txt`; read the file again and copy the text \
         exactly, with its whitespace and indentation and without line numbers."
    );
    let crlf = f
        .err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "alpha\nbeta", "new_string": "x"}),
        )
        .await;
    assert!(crlf.contains("Windows line endings"), "{crlf}");
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "", "new_string": "x"})
        )
        .await,
        "bad arguments: `old_string` is empty; pass the exact text to replace (to create a \
         file, use write_file)"
    );
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "beta", "new_string": "beta"})
        )
        .await,
        "bad arguments: `old_string` and `new_string` are the same, so there is nothing to change"
    );
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "nope.txt", "old_string": "a", "new_string": "b"})
        )
        .await,
        "`nope.txt` does not exist; use ls to see what is there"
    );
    f.put("latin1.txt", b"caf\xe9\n");
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "latin1.txt", "old_string": "caf", "new_string": "x"})
        )
        .await,
        "`latin1.txt` is not UTF-8 text, so edit_file cannot edit it"
    );
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "a", "new_string": "b", "replace_all": "yes"})
        )
        .await,
        "bad arguments: `replace_all` must be true or false, got \"yes\""
    );
}

#[tokio::test]
async fn edit_file_caps_the_file_size() {
    let f = Fixture::with(|t| {
        t.with_file_limits(FileLimits {
            max_write_bytes: 20,
            ..FileLimits::default()
        })
    });
    f.put("big.txt", "x".repeat(21));
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "big.txt", "old_string": "x", "new_string": "y", "replace_all": true})
        )
        .await,
        "`big.txt` is 21 bytes; edit_file edits files of at most 20 bytes"
    );
    f.put("small.txt", "ab");
    assert_eq!(
        f.err(
            EDIT_FILE,
            json!({"path": "small.txt", "old_string": "b", "new_string": "b".repeat(30)})
        )
        .await,
        "the edit would make `small.txt` 31 bytes, over the 20 bytes edit_file writes; \
         nothing was changed"
    );
    assert_eq!(f.read("small.txt"), "ab");
}

#[tokio::test]
async fn an_edit_that_would_grow_a_file_past_the_cap_is_refused_before_it_is_made() {
    // Ten million one-byte matches each replaced by a kilobyte: 10 GB, which the edit
    // used to allocate (and the process aborted) before refusing it.
    let f = Fixture::new();
    f.put("a.txt", "a".repeat(10_000_000));
    let err = f
        .err(
            EDIT_FILE,
            json!({"path": "a.txt", "old_string": "a", "new_string": "x".repeat(1_000), "replace_all": true}),
        )
        .await;
    assert!(
        err.starts_with("the edit would make `a.txt` 10,000,000,000 bytes, over the"),
        "{err}"
    );
    assert_eq!(f.read("a.txt").len(), 10_000_000, "nothing was changed");
}

#[cfg(unix)]
#[tokio::test]
async fn edit_file_keeps_the_file_mode() {
    use std::os::unix::fs::PermissionsExt;
    let f = Fixture::new();
    f.put("run.sh", "#!/bin/sh\necho hi\n");
    fs::set_permissions(f.path().join("run.sh"), fs::Permissions::from_mode(0o750)).unwrap();
    f.ok(
        EDIT_FILE,
        json!({"path": "run.sh", "old_string": "hi", "new_string": "bye"}),
    )
    .await;
    let mode = fs::metadata(f.path().join("run.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o750);
    assert_eq!(f.read("run.sh"), "#!/bin/sh\necho bye\n");
}

// ---------------------------------------------------------------------------------
// Safety: every path stays inside the root

#[tokio::test]
async fn absolute_paths_are_refused() {
    let f = Fixture::new();
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("secret.txt"), "secret").unwrap();
    let abs = outside.path().join("secret.txt").display().to_string();
    for (tool, args) in [
        (LS, json!({"path": "/"})),
        (READ_FILE, json!({"path": abs})),
        (GREP, json!({"pattern": "secret", "path": abs})),
        (
            WRITE_FILE,
            json!({"path": outside.path().join("new.txt").display().to_string(), "content": "x"}),
        ),
        (
            EDIT_FILE,
            json!({"path": abs, "old_string": "secret", "new_string": "x"}),
        ),
    ] {
        let err = f.err(tool, args).await;
        assert!(err.starts_with("bad arguments: `/"), "{tool}: {err}");
        assert!(
            err.contains("is an absolute path; give a path relative to the root directory"),
            "{tool}: {err}"
        );
    }
    assert!(!outside.path().join("new.txt").exists());
    assert_eq!(
        fs::read_to_string(outside.path().join("secret.txt")).unwrap(),
        "secret"
    );
}

#[tokio::test]
async fn dot_dot_that_leaves_the_root_is_refused_and_inside_it_is_folded() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("root");
    fs::create_dir(&root).unwrap();
    fs::write(parent.path().join("secret.txt"), "secret").unwrap();
    let tools = FileTools::new(&root).unwrap().tools();
    let f = Fixture {
        dir: tempfile::tempdir().unwrap(),
        tools,
    };
    for (tool, args) in [
        (LS, json!({"path": ".."})),
        (READ_FILE, json!({"path": "../secret.txt"})),
        (READ_FILE, json!({"path": "a/../../secret.txt"})),
        (GREP, json!({"pattern": "secret", "path": ".."})),
        (WRITE_FILE, json!({"path": "../new.txt", "content": "x"})),
        (
            EDIT_FILE,
            json!({"path": "../secret.txt", "old_string": "secret", "new_string": "x"}),
        ),
    ] {
        let err = f.err(tool, args).await;
        assert!(err.contains("leaves the root directory"), "{tool}: {err}");
    }
    assert!(!parent.path().join("new.txt").exists());
    assert_eq!(
        fs::read_to_string(parent.path().join("secret.txt")).unwrap(),
        "secret"
    );

    fs::create_dir(root.join("src")).unwrap();
    fs::write(root.join("top.txt"), "top\n").unwrap();
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "src/../top.txt"})).await,
        "     1\ttop\n[end of file: 1 line]"
    );
}

#[cfg(unix)]
#[tokio::test]
async fn symlinks_that_resolve_outside_the_root_are_refused() {
    use std::os::unix::fs::symlink;
    let f = Fixture::new();
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("secret.txt"), "secret\n").unwrap();
    symlink(
        outside.path().join("secret.txt"),
        f.path().join("file-link"),
    )
    .unwrap();
    symlink(outside.path(), f.path().join("dir-link")).unwrap();
    // A link inside a subdirectory that climbs out with `..`.
    fs::create_dir(f.path().join("sub")).unwrap();
    symlink("../../", f.path().join("sub/up")).unwrap();

    for (tool, args) in [
        (READ_FILE, json!({"path": "file-link"})),
        (READ_FILE, json!({"path": "dir-link/secret.txt"})),
        (LS, json!({"path": "dir-link"})),
        (GREP, json!({"pattern": "secret", "path": "dir-link"})),
        (GREP, json!({"pattern": "secret", "path": "file-link"})),
        (
            EDIT_FILE,
            json!({"path": "file-link", "old_string": "secret", "new_string": "x"}),
        ),
        (
            EDIT_FILE,
            json!({"path": "dir-link/secret.txt", "old_string": "secret", "new_string": "x"}),
        ),
        (
            WRITE_FILE,
            json!({"path": "dir-link/new.txt", "content": "x"}),
        ),
        (
            WRITE_FILE,
            json!({"path": "dir-link/deeper/new.txt", "content": "x"}),
        ),
        (LS, json!({"path": "sub/up"})),
    ] {
        let err = f.err(tool, args.clone()).await;
        assert!(
            err.contains("goes through a symbolic link that points outside the root directory"),
            "{tool}({args}): {err}"
        );
    }
    assert_eq!(
        fs::read_to_string(outside.path().join("secret.txt")).unwrap(),
        "secret\n"
    );
    assert!(!outside.path().join("new.txt").exists());
    assert!(!outside.path().join("deeper").exists());

    // Listing shows the links without following them out; grep of the root does not
    // follow them either.
    let listing = f.ok(LS, json!({})).await;
    assert!(
        listing.contains("dir-link\t(symbolic link to outside the root: cannot be used)"),
        "{listing}"
    );
    assert!(
        listing.contains("file-link\t(symbolic link to outside the root: cannot be used)"),
        "{listing}"
    );
    assert_eq!(
        f.ok(GREP, json!({"pattern": "secret"})).await,
        "No lines match `secret` in 0 files under the root directory."
    );
}

#[cfg(unix)]
#[tokio::test]
async fn symlinks_inside_the_root_are_followed() {
    use std::os::unix::fs::symlink;
    let f = Fixture::new();
    f.put("real/notes.txt", "inside\n");
    symlink(f.path().join("real"), f.path().join("alias")).unwrap();
    symlink("real/notes.txt", f.path().join("notes-link")).unwrap();
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "alias/notes.txt"})).await,
        "     1\tinside\n[end of file: 1 line]"
    );
    assert_eq!(
        f.ok(READ_FILE, json!({"path": "notes-link"})).await,
        "     1\tinside\n[end of file: 1 line]"
    );
    let listing = f.ok(LS, json!({})).await;
    assert!(
        listing.contains("alias/\t(symbolic link to real/)"),
        "{listing}"
    );
    assert!(
        listing.contains("notes-link\t7 bytes (symbolic link to real/notes.txt)"),
        "{listing}"
    );
    // grep of a linked directory reports the real paths.
    assert_eq!(
        f.ok(GREP, json!({"pattern": "inside", "path": "alias"}))
            .await,
        "real/notes.txt:1: inside"
    );
    f.ok(
        EDIT_FILE,
        json!({"path": "notes-link", "old_string": "inside", "new_string": "edited"}),
    )
    .await;
    assert_eq!(f.read("real/notes.txt"), "edited\n");
    assert!(
        fs::symlink_metadata(f.path().join("notes-link"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
}

#[tokio::test]
async fn nul_bytes_and_overlong_paths_are_refused() {
    let f = Fixture::new();
    for (tool, args) in [
        (LS, json!({"path": "a\u{0}b"})),
        (READ_FILE, json!({"path": "a\u{0}b"})),
        (GREP, json!({"pattern": "x", "path": "a\u{0}b"})),
        (WRITE_FILE, json!({"path": "a\u{0}b", "content": "x"})),
        (
            EDIT_FILE,
            json!({"path": "a\u{0}b", "old_string": "a", "new_string": "b"}),
        ),
    ] {
        let err = f.err(tool, args).await;
        assert!(err.contains("contains a NUL byte"), "{tool}: {err}");
    }
    let err = f.err(READ_FILE, json!({"path": "a/".repeat(3000)})).await;
    assert_eq!(
        err,
        "bad arguments: the path is 6000 bytes long; paths of at most 4096 bytes are accepted"
    );
}

#[tokio::test]
async fn arguments_are_checked() {
    let f = Fixture::new();
    assert_eq!(
        f.err(LS, json!({"dir": "src"})).await,
        "bad arguments: unknown argument `dir` (the arguments are path)"
    );
    assert_eq!(
        f.err(READ_FILE, json!(["x"])).await,
        "bad arguments: arguments must be a JSON object"
    );
    assert_eq!(
        f.err(READ_FILE, json!({"path": "x", "offset": -1})).await,
        "bad arguments: `offset` must be an integer of at least 0, got -1"
    );
    assert_eq!(
        f.err(READ_FILE, json!({"path": "x", "limit": 0})).await,
        "bad arguments: `limit` must be an integer of at least 1, got 0"
    );
    assert_eq!(
        f.err(GREP, json!({"pattern": 3})).await,
        "bad arguments: `pattern` must be a string"
    );
    // `null` arguments are an empty object.
    assert!(
        f.ok(LS, Value::Null)
            .await
            .starts_with("The root directory")
    );
}

// ---------------------------------------------------------------------------------
// What left the context

fn offload_fixture() -> (Fixture, Arc<MemoryStore>) {
    let store = Arc::new(MemoryStore::new());
    let dyn_store: Arc<dyn OffloadStore> = store.clone();
    let f = Fixture::with(|t| t.with_offload(dyn_store));
    (f, store)
}

fn in_thread() -> ToolContext {
    ToolContext::new("call_9").with_thread_id("thread-1")
}

#[tokio::test]
async fn offloaded_paths_are_read_from_the_store() {
    let (f, store) = offload_fixture();
    let result: String = (1..=300).map(|i| format!("result line {i}\n")).collect();
    store
        .put(
            &Key::new("thread-1", "large_tool_results/call_1").unwrap(),
            &result,
        )
        .unwrap();
    store
        .put(
            &Key::new("other-thread", "large_tool_results/call_1").unwrap(),
            "not ours\n",
        )
        .unwrap();
    let archive = Archive::new(store.clone());
    archive
        .append(
            &ThreadId::new("thread-1").unwrap(),
            &[Message::user("Deploy the service to staging").with_id("m1")],
        )
        .unwrap();
    f.put("src/main.rs", "fn main() {}\n");

    // The stub's own call, as the eviction policy writes it.
    let page = f
        .call_in(
            READ_FILE,
            json!({"path": "large_tool_results/call_1", "offset": 5, "limit": 2}),
            in_thread(),
        )
        .await
        .unwrap();
    assert_eq!(
        page,
        "     6\tresult line 6\n     7\tresult line 7\n[more lines follow: continue with offset=7]"
    );
    let listing = f
        .call_in(LS, json!({"path": "large_tool_results"}), in_thread())
        .await
        .unwrap();
    assert!(listing.contains("large_tool_results/call_1"), "{listing}");
    let found = f
        .call_in(
            GREP,
            json!({"pattern": "staging", "path": "archive/"}),
            in_thread(),
        )
        .await
        .unwrap();
    assert!(found.starts_with("archive/messages.jsonl:1: "), "{found}");
    let dotted = f
        .call_in(
            GREP,
            json!({"pattern": r"line 250\b", "path": "./large_tool_results"}),
            in_thread(),
        )
        .await
        .unwrap();
    assert_eq!(dotted, "large_tool_results/call_1:250: result line 250");

    // Grep without a path searches the root only, not the store.
    assert_eq!(
        f.call_in(GREP, json!({"pattern": "result line|fn main"}), in_thread())
            .await
            .unwrap(),
        "src/main.rs:1: fn main() {}"
    );
    // Other paths still read the root.
    assert_eq!(
        f.call_in(READ_FILE, json!({"path": "src/main.rs"}), in_thread())
            .await
            .unwrap(),
        "     1\tfn main() {}\n[end of file: 1 line]"
    );
    let glob = f
        .call_in(
            GREP,
            json!({"pattern": "x", "path": "archive", "glob": "*.jsonl"}),
            in_thread(),
        )
        .await
        .unwrap_err();
    assert!(
        glob.to_string()
            .starts_with("bad arguments: `glob` does not apply to `archive`"),
        "{glob}"
    );
    // Store errors come back as sentences too.
    let missing = f
        .call_in(
            READ_FILE,
            json!({"path": "large_tool_results/call_404"}),
            in_thread(),
        )
        .await
        .unwrap_err();
    assert!(missing.to_string().starts_with("read_file: "), "{missing}");
}

#[tokio::test]
async fn offloaded_paths_need_a_thread_id() {
    let (f, _store) = offload_fixture();
    let err = f
        .call(READ_FILE, json!({"path": "archive/messages.jsonl"}))
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "`archive/messages.jsonl` holds what left this conversation's context, but this run \
         has no thread id to find it by; read files of the project instead"
    );
    let bad = f
        .call_in(
            LS,
            json!({"path": "archive"}),
            ToolContext::new("c").with_thread_id("../escape"),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("the run's thread id cannot name stored files"),
        "{bad}"
    );
}

#[tokio::test]
async fn the_offload_store_shadows_root_directories_of_those_names() {
    let (f, store) = offload_fixture();
    f.put("archive/old.txt", "on disk\n");
    f.put("large_tool_results/x", "on disk\n");
    f.put("keep.txt", "on disk\n");
    store
        .put(
            &Key::new("thread-1", "archive/messages.jsonl").unwrap(),
            "in store\n",
        )
        .unwrap();
    let err = f
        .call_in(READ_FILE, json!({"path": "archive/old.txt"}), in_thread())
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("read_file: "), "{err}");
    let listing = f.call_in(LS, json!({}), in_thread()).await.unwrap();
    assert_eq!(
        listing,
        "The root directory holds 1 entry:\nkeep.txt\t8 bytes\nAlso readable: \
         large_tool_results/, archive/ and truncated_arguments/ hold what left this \
         conversation's context; list, read and grep them like directories."
    );
    assert_eq!(
        f.call_in(GREP, json!({"pattern": "disk|store"}), in_thread())
            .await
            .unwrap(),
        "keep.txt:1: on disk"
    );
    for tool in &f.tools {
        if [LS, READ_FILE, GREP].contains(&tool.spec().name.as_str()) {
            assert!(
                tool.spec().description.contains("`large_tool_results`")
                    || tool.spec().description.contains("large_tool_results/"),
                "{}",
                tool.spec().name
            );
        }
    }
    assert_eq!(
        OFFLOAD_DIRS,
        ["large_tool_results", "archive", "truncated_arguments"]
    );

    // Without an offload store the same directories are plain directories.
    let plain = Fixture::new();
    plain.put("archive/old.txt", "on disk\n");
    assert_eq!(
        plain
            .ok(READ_FILE, json!({"path": "archive/old.txt"}))
            .await,
        "     1\ton disk\n[end of file: 1 line]"
    );
}

// ---------------------------------------------------------------------------------
// Runtimes

#[test]
fn tools_run_on_a_current_thread_runtime_and_without_one() {
    let f = Fixture::new();
    f.put("a.txt", "hello\n");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(
        rt.block_on(f.call(READ_FILE, json!({"path": "a.txt"})))
            .unwrap(),
        "     1\thello\n[end of file: 1 line]"
    );
    // No Tokio runtime at all: the work runs inline.
    let out = poll_to_end(f.call(GREP, json!({"pattern": "hel+o"})));
    assert_eq!(out.unwrap(), "a.txt:1: hello");
}

fn poll_to_end<F: std::future::Future>(future: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut future = std::pin::pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_do_not_block_each_other() {
    let f = Arc::new(Fixture::new());
    for i in 0..20 {
        f.put(&format!("f{i}.txt"), format!("value {i}\n"));
    }
    let mut handles = Vec::new();
    for i in 0..20 {
        let f = Arc::clone(&f);
        handles.push(tokio::spawn(async move {
            f.call(READ_FILE, json!({"path": format!("f{i}.txt")}))
                .await
        }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.await.unwrap().unwrap(),
            format!("     1\tvalue {i}\n[end of file: 1 line]")
        );
    }
}

/// At a 4,000-token window the file tools' default output cap (30,000 characters, about
/// 7,500 tokens) is lowered to the input budget in characters, so one read cannot fill
/// the window; explicit limits are kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_small_window_caps_the_file_tools_output() {
    use keel_agent::Agent;
    use keel_message::ToolCall;
    use keel_model::ScriptedModel;
    use keel_token::{Encoding, ModelProfile};

    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..3_000)
        .map(|l| format!("line {l}: some words here\n"))
        .collect();
    std::fs::write(dir.path().join("big.txt"), text).unwrap();
    let build = |tools: FileTools, window: usize| {
        Agent::builder()
            .model(Arc::new(ScriptedModel::new(Vec::new())))
            .profile(ModelProfile::new("m", window, 500, Encoding::Approximate))
            .file_tools(tools)
            .build()
            .unwrap()
    };
    let read = ToolCall::new("r", "read_file", json!({"path": "big.txt", "limit": 500}));
    let small = build(FileTools::new(dir.path()).unwrap(), 4_000);
    let out = small.nodes().toolbox().run(&read, Some("t")).await;
    let chars = out.message.text().len();
    assert!(out.error.is_none(), "{:?}", out.error);
    assert!(
        chars <= 3_500 + 300,
        "{chars} characters at a 4,000-token window"
    );
    // A roomy window keeps the default cap: the 500 lines come back whole.
    let roomy = build(FileTools::new(dir.path()).unwrap(), 128_000);
    let out = roomy.nodes().toolbox().run(&read, Some("t")).await;
    assert!(out.message.text().len() > 10_000);
    // Limits set by the user are theirs.
    let mine = ToolLimits {
        max_output_chars: 12_000,
        ..ToolLimits::default()
    };
    let chosen = build(FileTools::new(dir.path()).unwrap().with_limits(mine), 4_000);
    let out = chosen.nodes().toolbox().run(&read, Some("t")).await;
    assert!(
        out.message.text().len() > 3_800,
        "explicit limits must be kept"
    );
}

#[cfg(unix)]
#[tokio::test]
async fn grep_does_not_read_an_ignore_file_that_is_a_link_or_a_fifo() {
    // A cloned repository can hold `.gitignore -> /dev/zero` (the walker read it line
    // by line until memory ran out) or a FIFO (the search never returned).
    use std::os::unix::fs::symlink;
    let f = Fixture::new();
    f.put("top.txt", "needle at the top\n");
    f.put("zero/a.txt", "needle under zero\n");
    symlink("/dev/zero", f.path().join("zero/.gitignore")).unwrap();
    f.put("pipe/b.txt", "needle under pipe\n");
    let made = std::process::Command::new("mkfifo")
        .arg(f.path().join("pipe/.ignore"))
        .status();
    let fifo = made.is_ok_and(|s| s.success());
    f.put("fine/c.txt", "needle under fine\nskipped.txt\n");
    f.put("fine/.gitignore", "skipped.txt\n");
    f.put("fine/skipped.txt", "needle ignored\n");
    let out = f.ok(GREP, json!({"pattern": "needle"})).await;
    assert!(out.contains("top.txt:1: needle at the top"), "{out}");
    assert!(out.contains("fine/c.txt:1:"), "{out}");
    assert!(
        !out.contains("skipped.txt:1:"),
        "a regular .gitignore applies: {out}"
    );
    assert!(!out.contains("zero/a.txt"), "{out}");
    assert!(
        out.contains(
            "[a directory not searched: `zero/.gitignore` is a symbolic link, which grep does not read]"
        ),
        "{out}"
    );
    if fifo {
        assert!(!out.contains("pipe/b.txt"), "{out}");
        assert!(
            out.contains("`pipe/.ignore` is not a regular file"),
            "{out}"
        );
    }
    // Searched from a directory whose own ignore file is such: none applies, said so.
    let out = f
        .ok(GREP, json!({"pattern": "needle", "path": "zero"}))
        .await;
    assert!(out.contains("zero/a.txt:1: needle under zero"), "{out}");
    assert!(
        out.contains("[no ignore file was applied: `zero/.gitignore` is a symbolic link, which grep does not read]"),
        "{out}"
    );
}

/// On a runtime with one blocking thread: `slow` (a call on `f` after `setup`) is cut
/// off by a `cut` timeout, and the next call must get the thread back within `then`
/// (the dropped call's work stopped).
fn a_dropped_call_frees_the_blocking_thread(
    setup: impl FnOnce(&Fixture),
    slow: (&'static str, Value),
    cut: std::time::Duration,
    then: std::time::Duration,
) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()
        .unwrap();
    runtime.block_on(async {
        let f = Fixture::new();
        setup(&f);
        f.put("small.txt", "hi\n");
        assert!(
            tokio::time::timeout(cut, f.call(slow.0, slow.1))
                .await
                .is_err(),
            "the call is slow enough to be cut off"
        );
        let next =
            tokio::time::timeout(then, f.call(READ_FILE, json!({"path": "small.txt"}))).await;
        let out = next.expect("the blocking thread was freed").unwrap();
        assert!(out.contains("hi"), "{out}");
    });
}

#[test]
fn a_grep_whose_call_was_dropped_stops_and_frees_its_blocking_thread() {
    // A slow pattern over 4 MiB would hold the blocking pool's thread for many seconds
    // after the tool's timeout dropped the call.
    a_dropped_call_frees_the_blocking_thread(
        |f| {
            let line = format!("{}\n", "abcdefghij".repeat(100));
            f.put("big.txt", line.repeat(4 * 1024));
        },
        (GREP, json!({"pattern": r"[\p{L}\p{N}]{200}Z"})),
        std::time::Duration::from_millis(200),
        std::time::Duration::from_secs(5),
    );
}

#[test]
fn a_read_at_a_huge_offset_whose_call_was_dropped_stops_and_frees_its_blocking_thread() {
    // Skipping to an offset past the end of a file of 48 million empty lines reads it
    // all; after the call's timeout nobody waits for that.
    a_dropped_call_frees_the_blocking_thread(
        |f| f.put("lines.txt", "\n".repeat(48 << 20)),
        (
            READ_FILE,
            json!({"path": "lines.txt", "offset": 1u64 << 40}),
        ),
        std::time::Duration::from_millis(100),
        std::time::Duration::from_millis(1_500),
    );
}
