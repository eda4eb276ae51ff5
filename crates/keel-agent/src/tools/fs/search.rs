//! `grep` on the disk: ripgrep's walker (the `ignore` crate) and a line-by-line regex.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use ignore::gitignore::Gitignore;
use ignore::overrides::OverrideBuilder;
use ignore::{DirEntry, Match, WalkBuilder};
use keel_message::ToolError;
use regex::bytes::{Regex, RegexBuilder};
use serde_json::{Map, Value};

use super::args;
use super::ops::{READ_BUFFER, count};
use super::path::Root;
use super::text::{LineReader, quoted, show_line, thousands};
use super::{FileTools, OFFLOAD_DIRS};

/// Bytes of each line matched against the pattern: a match further into a longer
/// line is not found.
pub(super) const GREP_LINE_BYTES: usize = 64 * 1024;

/// Most bytes of compiled regex a pattern may take.
const REGEX_SIZE_LIMIT: usize = 16 * 1024 * 1024;

/// Compiled patterns [`GrepCache`] keeps at most (it starts over past that).
const CACHED_PATTERNS: usize = 64;

/// Parsed .gitignore files [`GrepCache`] keeps at most (it starts over past that).
const CACHED_IGNORES: usize = 256;

/// What `grep` keeps between calls of one [`FileTools`]: the compiled regex of recent
/// patterns (an agent greps the same few again and again; compiling one costs more than
/// searching a small tree), and the .gitignore files above the search path, parsed,
/// each used again only while its modification time and length are unchanged.
#[derive(Debug, Default)]
pub(super) struct GrepCache {
    patterns: Mutex<HashMap<String, Regex>>,
    ignores: Mutex<HashMap<PathBuf, (Stamp, Arc<Gitignore>)>>,
}

/// When a file was last changed, as far as the cache can tell.
type Stamp = (Option<SystemTime>, u64);

impl GrepCache {
    fn regex(&self, pattern: &str) -> Result<Regex, ToolError> {
        let mut patterns = self.patterns.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(regex) = patterns.get(pattern) {
            return Ok(regex.clone());
        }
        let regex = RegexBuilder::new(pattern)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|e| {
                ToolError::bad_arguments(format!(
                    "`pattern` is not a valid regular expression: {e}"
                ))
            })?;
        if patterns.len() >= CACHED_PATTERNS {
            patterns.clear();
        }
        patterns.insert(pattern.to_owned(), regex.clone());
        Ok(regex)
    }

    /// The parsed .gitignore at `file`, if it is a file.
    fn gitignore(&self, file: PathBuf) -> Option<Arc<Gitignore>> {
        let meta = std::fs::metadata(&file)
            .ok()
            .filter(std::fs::Metadata::is_file)?;
        let stamp: Stamp = (meta.modified().ok(), meta.len());
        let mut ignores = self.ignores.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((seen, gitignore)) = ignores.get(&file)
            && seen.0.is_some()
            && *seen == stamp
        {
            return Some(Arc::clone(gitignore));
        }
        // Parsed under the lock: two calls do not parse the same file twice.
        let (gitignore, _partial_errors) = Gitignore::new(&file);
        let gitignore = Arc::new(gitignore);
        if ignores.len() >= CACHED_IGNORES {
            ignores.clear();
        }
        ignores.insert(file, (stamp, Arc::clone(&gitignore)));
        Some(gitignore)
    }
}

/// Why the walk stopped early.
enum Stop {
    Results,
    Files,
    Entries,
    Bytes,
}

struct Found {
    path: String,
    line: u64,
    text: String,
}

pub(super) fn grep(tools: &FileTools, args: &Map<String, Value>) -> Result<String, ToolError> {
    let pattern = args::required_string(args, "pattern")?;
    let regex = tools.grep_cache.regex(pattern)?;
    let rel = args::optional_path(args)?;
    let glob = args::string(args, "glob")?;
    let l = &tools.limits;
    let f = &tools.file_limits;
    let max_results = args::integer(args, "max_results", 1)?
        .unwrap_or(l.default_grep_results)
        .min(l.max_grep_results)
        .max(1);
    let target = tools.root.existing(&rel).map_err(ToolError::failed)?;
    let what = rel.describe();

    let mut walk = WalkBuilder::new(&target);
    // .gitignore files are read as the walker's custom ignore files, not with its git
    // options: those make it canonicalize the search path and read the ignore files of
    // every directory up to `/` before the first entry (a third of a small search's
    // time), all of which `parents(false)` then leaves unused. The ones between the root
    // and the search path are `above`.
    walk.standard_filters(true)
        .hidden(true)
        .parents(false)
        .git_ignore(false)
        .git_exclude(false)
        .git_global(false)
        .add_custom_ignore_filename(".gitignore")
        .require_git(false)
        .follow_links(false)
        .sort_by_file_name(|a, b| a.cmp(b));
    if let Some(glob) = glob {
        let mut globs = OverrideBuilder::new(&target);
        globs
            .add(glob)
            .map_err(|e| ToolError::bad_arguments(format!("`glob` is not a valid glob: {e}")))?;
        let globs = globs
            .build()
            .map_err(|e| ToolError::bad_arguments(format!("`glob` is not a valid glob: {e}")))?;
        walk.overrides(globs);
    }
    let above = ancestor_ignores(&tools.grep_cache, &tools.root, &target);
    let skip_offload_dirs = tools.offload.is_some() && target == tools.root.dir();
    walk.filter_entry(move |entry| keep_entry(entry, &above, skip_offload_dirs));

    let keep = GREP_LINE_BYTES;
    let mut found: Vec<Found> = Vec::new();
    let mut files: u64 = 0;
    let mut visited: u64 = 0;
    let max_visited = (f.max_grep_files as u64).saturating_mul(10);
    let mut bytes: u64 = 0;
    let mut binary: u64 = 0;
    let mut unreadable: u64 = 0;
    let mut stop: Option<Stop> = None;
    let mut line = Vec::new();
    'walk: for entry in walk.build() {
        let Ok(entry) = entry else {
            unreadable += 1;
            continue;
        };
        visited += 1;
        if visited > max_visited {
            stop = Some(Stop::Entries);
            break;
        }
        if !entry.file_type().is_some_and(|t| t.is_file()) {
            continue;
        }
        if files >= f.max_grep_files as u64 {
            stop = Some(Stop::Files);
            break;
        }
        let budget = f.max_grep_bytes.saturating_sub(bytes);
        if budget == 0 {
            stop = Some(Stop::Bytes);
            break;
        }
        files += 1;
        let Ok(file) = File::open(entry.path()) else {
            unreadable += 1;
            continue;
        };
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut reader = LineReader::new(BufReader::with_capacity(READ_BUFFER, file.take(budget)));
        match reader.looks_binary() {
            Ok(false) => {}
            Ok(true) => {
                binary += 1;
                continue;
            }
            Err(_) => {
                unreadable += 1;
                continue;
            }
        }
        let shown = tools.root.relative_display(entry.path());
        let mut number: u64 = 0;
        loop {
            match reader.next_line(&mut line, keep) {
                Ok(Some(info)) => {
                    number += 1;
                    if info.nul {
                        // Binary from here on, as ripgrep treats it.
                        binary += 1;
                        break;
                    }
                    if regex.is_match(&line) {
                        found.push(Found {
                            path: shown.clone(),
                            line: number,
                            text: show_line(&line, info.truncated, l.grep_line_chars),
                        });
                        if found.len() >= max_results {
                            bytes = bytes.saturating_add(reader.consumed());
                            stop = Some(Stop::Results);
                            break 'walk;
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    unreadable += 1;
                    break;
                }
            }
        }
        bytes = bytes.saturating_add(reader.consumed());
        if reader.consumed() >= budget && size > budget {
            stop = Some(Stop::Bytes);
            break;
        }
    }

    let mut notes = String::new();
    match stop {
        Some(Stop::Results) => {
            let _ = write!(
                notes,
                "\n[stopped at {max_results} matches: narrow the pattern or the path]"
            );
        }
        Some(Stop::Files) => {
            let _ = write!(
                notes,
                "\n[stopped after searching {}, the most one call searches: narrow the \
                 path or add a glob to search the rest]",
                count(files, "file", "files")
            );
        }
        Some(Stop::Entries) => {
            let _ = write!(
                notes,
                "\n[stopped after visiting {}, the most one call visits: narrow the path \
                 or add a glob to search the rest]",
                count(max_visited, "path", "paths")
            );
        }
        Some(Stop::Bytes) => {
            let _ = write!(
                notes,
                "\n[stopped after reading {}, the most one call reads: narrow the path or \
                 add a glob to search the rest]",
                count(bytes, "byte", "bytes")
            );
        }
        None => {}
    }
    if binary > 0 {
        let _ = write!(
            notes,
            "\n[{} skipped as binary]",
            count(binary, "file", "files")
        );
    }
    if unreadable > 0 {
        let _ = write!(
            notes,
            "\n[{} could not be read]",
            count(unreadable, "path", "paths")
        );
    }

    if found.is_empty() {
        let place = if target.is_dir() {
            format!("{} under {what}", count(files, "file", "files"))
        } else {
            what
        };
        return Ok(format!(
            "No lines match {} in {place}.{notes}",
            quoted(pattern)
        ));
    }
    let mut out = String::new();
    let mut chars = 0;
    for m in &found {
        let row = format!("{}:{}: {}\n", m.path, m.line, m.text);
        let n = row.chars().count();
        if chars + n > l.max_output_chars && !out.is_empty() {
            let _ = write!(
                out,
                "[output capped at {} characters: narrow the pattern or the path]",
                thousands(l.max_output_chars as u64)
            );
            return Ok(out);
        }
        chars += n;
        out.push_str(&row);
    }
    let text = out.trim_end().to_owned();
    Ok(format!("{text}{notes}"))
}

/// The .gitignore files of the directories from the root down to `target`'s parent:
/// the walker reads those at `target` and below, but none above it (it would climb
/// past the root).
fn ancestor_ignores(cache: &GrepCache, root: &Root, target: &Path) -> Vec<Arc<Gitignore>> {
    let mut out = Vec::new();
    let Ok(rel) = target.strip_prefix(root.dir()) else {
        return out;
    };
    if rel.as_os_str().is_empty() {
        // `target` is the root: the walker reads its .gitignore.
        return out;
    }
    let mut dir = root.dir().to_path_buf();
    let mut parts = rel.components().peekable();
    loop {
        if let Some(gitignore) = cache.gitignore(dir.join(".gitignore")) {
            out.push(gitignore);
        }
        match parts.next() {
            // Stop before `target` itself: its own .gitignore is the walker's.
            Some(part) if parts.peek().is_some() => dir.push(part),
            _ => break,
        }
    }
    out
}

/// Whether the walk goes into / searches `entry`: not `target/` directories, not
/// top-level offload directories (shadowed), not what the .gitignore files above the
/// search path exclude. The search path itself (depth 0) is always kept.
fn keep_entry(entry: &DirEntry, above: &[Arc<Gitignore>], skip_offload_dirs: bool) -> bool {
    if entry.depth() == 0 {
        return true;
    }
    let is_dir = entry.file_type().is_some_and(|t| t.is_dir());
    let name = entry.file_name();
    if is_dir && name == "target" {
        return false;
    }
    if skip_offload_dirs
        && is_dir
        && entry.depth() == 1
        && name.to_str().is_some_and(|n| OFFLOAD_DIRS.contains(&n))
    {
        return false;
    }
    // The deepest .gitignore with an opinion decides.
    for gitignore in above.iter().rev() {
        match gitignore.matched(entry.path(), is_dir) {
            Match::Ignore(_) => return false,
            Match::Whitelist(_) => return true,
            Match::None => {}
        }
    }
    true
}
