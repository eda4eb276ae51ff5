//! `ls`, `read_file`, `write_file` and `edit_file` on the disk. They block: the tool
//! runs them on the blocking pool.

use std::collections::BinaryHeap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::path::Path;

use keel_message::ToolError;
use serde_json::{Map, Value};

use super::args;
use super::path::{PathError, Relative, Root};
use super::text::{LineReader, show_line, thousands};
use super::{EDIT_FILE, FileTools, OFFLOAD_DIRS, READ_FILE};

/// Read buffer of `read_file` and `grep`.
pub(super) const READ_BUFFER: usize = 64 * 1024;

/// `n thing` / `n things`, with thousands separators.
pub(super) fn count(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
}

/// An I/O error on `rel`, as a sentence.
pub(super) fn io_failed(action: &str, rel: &Relative, e: &io::Error) -> ToolError {
    let what = rel.describe();
    match e.kind() {
        io::ErrorKind::NotFound => ToolError::failed(PathError::NotFound(rel.display())),
        io::ErrorKind::PermissionDenied => {
            ToolError::failed(format!("permission denied: could not {action} {what}"))
        }
        _ => ToolError::failed(format!("could not {action} {what}: {e}")),
    }
}

fn capitalized(text: String) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => text,
    }
}

pub(super) fn ls(tools: &FileTools, args: &Map<String, Value>) -> Result<String, ToolError> {
    let rel = args::optional_path(args)?;
    let dir = tools.root.existing(&rel).map_err(ToolError::failed)?;
    let meta = fs::metadata(&dir).map_err(|e| io_failed("list", &rel, &e))?;
    if !meta.is_dir() {
        return Ok(format!(
            "{} is a file of {}, not a directory; read it with {READ_FILE}.",
            capitalized(rel.describe()),
            count(meta.len(), "byte", "bytes")
        ));
    }
    let shadowed = tools.offload.is_some() && rel.is_root();
    let cap = tools.limits.max_ls_entries;
    // The `cap` smallest names, in a max-heap: sorted and bounded however large the
    // directory. Each keeps its entry, whose metadata is read relative to the open
    // directory (no walk of the whole path per entry).
    let mut smallest: BinaryHeap<ByName> = BinaryHeap::new();
    let mut total: u64 = 0;
    let mut unreadable: u64 = 0;
    for entry in fs::read_dir(&dir).map_err(|e| io_failed("list", &rel, &e))? {
        let Ok(entry) = entry else {
            unreadable += 1;
            continue;
        };
        let name = entry.file_name();
        if shadowed && name.to_str().is_some_and(|n| OFFLOAD_DIRS.contains(&n)) {
            continue;
        }
        // A write killed before its rename leaves its temporary file: not the agent's.
        if name.to_str().is_some_and(|n| n.starts_with(TEMP_PREFIX)) {
            continue;
        }
        total += 1;
        smallest.push(ByName(name, entry));
        if smallest.len() > cap {
            smallest.pop();
        }
    }
    let prefix = if rel.is_root() {
        String::new()
    } else {
        format!("{}/", rel.display())
    };
    let mut out = if total == 0 {
        format!("{} is empty.", capitalized(rel.describe()))
    } else {
        format!(
            "{} holds {}:",
            capitalized(rel.describe()),
            count(total, "entry", "entries")
        )
    };
    let mut chars = out.chars().count();
    let mut shown: u64 = 0;
    for ByName(name, entry) in smallest.into_sorted_vec() {
        let line = entry_line(&tools.root, &entry, &prefix, &name);
        let n = line.chars().count() + 1;
        if chars + n > keel_offload::output_room(tools.limits.max_output_chars) {
            break;
        }
        chars += n;
        out.push('\n');
        out.push_str(&line);
        shown += 1;
    }
    if shown < total {
        let _ = write!(
            out,
            "\n[showing the first {} of {}, sorted by name: list a subdirectory, or find \
             files with grep and a glob]",
            thousands(shown),
            count(total, "entry", "entries")
        );
    }
    if unreadable > 0 {
        let _ = write!(
            out,
            "\n[{} could not be read]",
            count(unreadable, "entry", "entries")
        );
    }
    if shadowed {
        out.push_str(
            "\nAlso readable: large_tool_results/, archive/ and truncated_arguments/ hold what \
             left this conversation's context; list, read and grep them like directories.",
        );
    }
    Ok(out)
}

/// A directory entry ordered by its name.
struct ByName(OsString, fs::DirEntry);

impl PartialEq for ByName {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for ByName {}

impl PartialOrd for ByName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.cmp(&other.0)
    }
}

/// One line of an `ls` listing: `dir/`, `file\tN bytes`, or what a link or special
/// file is.
fn entry_line(root: &Root, entry: &fs::DirEntry, prefix: &str, name: &OsString) -> String {
    let shown = format!("{prefix}{}", name.to_string_lossy());
    // The entry's own metadata: a symbolic link is described, not followed.
    let Ok(meta) = entry.metadata() else {
        return format!("{shown}\t(could not be read)");
    };
    if meta.is_dir() {
        return format!("{shown}/");
    }
    if meta.is_file() {
        return format!("{shown}\t{}", count(meta.len(), "byte", "bytes"));
    }
    if !meta.file_type().is_symlink() {
        return format!("{shown}\t(special file: cannot be read)");
    }
    match entry.path().canonicalize() {
        Ok(target) if root.contains(&target) => {
            let to = root.relative_display(&target);
            match target.metadata() {
                Ok(m) if m.is_dir() => format!("{shown}/\t(symbolic link to {to}/)"),
                Ok(m) => format!(
                    "{shown}\t{} (symbolic link to {to})",
                    count(m.len(), "byte", "bytes")
                ),
                Err(_) => format!("{shown}\t(symbolic link to {to})"),
            }
        }
        Ok(_) => format!("{shown}\t(symbolic link to outside the root: cannot be used)"),
        Err(_) => format!("{shown}\t(broken symbolic link)"),
    }
}

pub(super) fn read_file(tools: &FileTools, args: &Map<String, Value>) -> Result<String, ToolError> {
    let rel = args::file_path(args)?;
    let l = &tools.limits;
    let offset = args::integer(args, "offset", 0)?.unwrap_or(0);
    let limit = args::integer(args, "limit", 1)?
        .unwrap_or(l.default_read_lines)
        .min(l.max_read_lines)
        .max(1);
    let path = tools.root.existing(&rel).map_err(ToolError::failed)?;
    let what = rel.describe();
    let meta = fs::metadata(&path).map_err(|e| io_failed("read", &rel, &e))?;
    if meta.is_dir() {
        return Err(ToolError::failed(format!(
            "{what} is a directory; list it with ls"
        )));
    }
    if !meta.is_file() {
        return Err(ToolError::failed(format!(
            "{what} is not a regular file (a device, socket or pipe), so it cannot be read"
        )));
    }
    let file = File::open(&path).map_err(|e| io_failed("read", &rel, &e))?;
    let mut reader = LineReader::new(BufReader::with_capacity(READ_BUFFER, file));
    let read_err = |e: io::Error| io_failed("read", &rel, &e);
    if reader.looks_binary().map_err(read_err)? {
        return Err(ToolError::failed(format!(
            "{what} is a binary file ({}); read_file shows text files only",
            count(meta.len(), "byte", "bytes")
        )));
    }
    // Room for `max_line_chars` characters of any width.
    let keep = l.max_line_chars.saturating_mul(4).saturating_add(4);
    let mut line = Vec::new();
    for skipped in 0..offset {
        // A huge offset into a huge file reads up to the end: stop once nobody waits.
        if skipped % 4_096 == 4_095 && super::cancelled() {
            return Err(ToolError::failed(format!(
                "reading {what} was stopped at line {skipped} of offset {offset}"
            )));
        }
        if reader.next_line(&mut line, 0).map_err(read_err)?.is_none() {
            return Ok(if skipped == 0 {
                format!("{} is empty.", capitalized(what))
            } else {
                format!(
                    "Offset {offset} is past the end: {what} has {}.",
                    count(skipped as u64, "line", "lines")
                )
            });
        }
    }
    let mut out = String::new();
    let mut chars = 0;
    let mut last = offset;
    while last - offset < limit {
        let Some(info) = reader.next_line(&mut line, keep).map_err(read_err)? else {
            break;
        };
        let number = last + 1;
        if info.nul {
            let _ = write!(
                out,
                "[line {number} holds binary data (a NUL byte): the rest of {what} is not shown]"
            );
            return Ok(out);
        }
        let row = format!(
            "{number:>6}\t{}\n",
            show_line(&line, info.truncated, l.max_line_chars)
        );
        let n = row.chars().count();
        if chars + n > keel_offload::output_room(l.max_output_chars) && !out.is_empty() {
            let _ = write!(
                out,
                "[output capped at {} characters: continue with offset={last}]",
                thousands(l.max_output_chars as u64)
            );
            return Ok(out);
        }
        chars += n;
        out.push_str(&row);
        last = number;
    }
    if last == offset {
        // Nothing after the offset.
        return Ok(if offset == 0 {
            format!("{} is empty.", capitalized(what))
        } else {
            format!(
                "Offset {offset} is past the end: {what} has {}.",
                count(offset as u64, "line", "lines")
            )
        });
    }
    if reader.at_end().map_err(read_err)? {
        let _ = write!(
            out,
            "[end of file: {}]",
            count(last as u64, "line", "lines")
        );
    } else {
        let _ = write!(out, "[more lines follow: continue with offset={last}]");
    }
    Ok(out)
}

pub(super) fn write_file(
    tools: &FileTools,
    args: &Map<String, Value>,
) -> Result<String, ToolError> {
    let rel = args::file_path(args)?;
    let content = args::required_string(args, "content")?;
    let max = tools.file_limits.max_write_bytes;
    if content.len() > max {
        return Err(ToolError::bad_arguments(format!(
            "`content` is {}; write_file writes at most {}: write a smaller file, or \
             several",
            count(content.len() as u64, "byte", "bytes"),
            count(max as u64, "byte", "bytes")
        )));
    }
    let what = rel.describe();
    let exists = || {
        ToolError::failed(format!(
            "{what} already exists, and write_file never overwrites; change it with \
             {EDIT_FILE} (read it first with {READ_FILE}), or write to a new path"
        ))
    };
    let place = tools.root.new_file(&rel).map_err(ToolError::failed)?;
    if place.missing_dirs.is_empty() {
        match place.base.join(&place.name).symlink_metadata() {
            Ok(m) if m.is_dir() => {
                return Err(ToolError::failed(format!(
                    "{what} is a directory; give the path of a file to create"
                )));
            }
            Ok(_) => return Err(exists()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_failed("write", &rel, &e)),
        }
    }
    let mut dir = place.base.clone();
    dir.extend(&place.missing_dirs);
    fs::create_dir_all(&dir).map_err(|e| io_failed("create the directories of", &rel, &e))?;
    // Checked again after creating: a link swapped in meanwhile must not lead out.
    let dir = dir
        .canonicalize()
        .map_err(|e| io_failed("write", &rel, &e))?;
    if !tools.root.contains(&dir) {
        return Err(ToolError::failed(PathError::LinkOutside(rel.display())));
    }
    let mut temp = temp_file(&dir, None).map_err(|e| io_failed("write", &rel, &e))?;
    write_all_synced(&mut temp, content.as_bytes()).map_err(|e| io_failed("write", &rel, &e))?;
    // Renames without replacing: if the file appeared meanwhile, it is kept.
    temp.persist_noclobber(dir.join(&place.name))
        .map_err(|e| match e.error.kind() {
            io::ErrorKind::AlreadyExists => exists(),
            _ => io_failed("write", &rel, &e.error),
        })?;
    Ok(format!(
        "Created {} ({}, {}).",
        rel.display(),
        count(content.lines().count() as u64, "line", "lines"),
        count(content.len() as u64, "byte", "bytes")
    ))
}

pub(super) fn edit_file(tools: &FileTools, args: &Map<String, Value>) -> Result<String, ToolError> {
    let rel = args::file_path(args)?;
    let old = args::required_string(args, "old_string")?;
    let new = args::required_string(args, "new_string")?;
    let replace_all = args::boolean(args, "replace_all")?.unwrap_or(false);
    if old.is_empty() {
        return Err(ToolError::bad_arguments(
            "`old_string` is empty; pass the exact text to replace (to create a file, use \
             write_file)",
        ));
    }
    if old == new {
        return Err(ToolError::bad_arguments(
            "`old_string` and `new_string` are the same, so there is nothing to change",
        ));
    }
    let max = tools.file_limits.max_write_bytes;
    let path = tools.root.existing(&rel).map_err(ToolError::failed)?;
    let what = rel.describe();
    let meta = fs::metadata(&path).map_err(|e| io_failed("read", &rel, &e))?;
    if meta.is_dir() {
        return Err(ToolError::failed(format!(
            "{what} is a directory; edit_file edits files"
        )));
    }
    if !meta.is_file() {
        return Err(ToolError::failed(format!(
            "{what} is not a regular file, so it cannot be edited"
        )));
    }
    let too_big = |bytes: u64| {
        ToolError::failed(format!(
            "{what} is {}; edit_file edits files of at most {}",
            count(bytes, "byte", "bytes"),
            count(max as u64, "byte", "bytes")
        ))
    };
    if meta.len() > max as u64 {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::new();
    File::open(&path)
        .and_then(|f| f.take(max as u64 + 1).read_to_end(&mut bytes))
        .map_err(|e| io_failed("read", &rel, &e))?;
    if bytes.len() > max {
        return Err(too_big(bytes.len() as u64));
    }
    let text = String::from_utf8(bytes).map_err(|_| {
        ToolError::failed(format!(
            "{what} is not UTF-8 text, so edit_file cannot edit it"
        ))
    })?;
    let found = text.matches(old).count();
    if found == 0 {
        let hint = if text.contains("\r\n") && old.contains('\n') && !old.contains("\r\n") {
            " The file has Windows line endings (\\r\\n): put \\r\\n in `old_string` where it \
             spans lines."
        } else {
            ""
        };
        return Err(ToolError::failed(format!(
            "`old_string` was not found in {what}; read the file again and copy the text \
             exactly, with its whitespace and indentation and without line numbers.{hint}"
        )));
    }
    if found > 1 && !replace_all {
        return Err(ToolError::failed(format!(
            "`old_string` occurs {} in {what}; include more surrounding lines to make it \
             unique, or set replace_all to true to replace all {}",
            count(found as u64, "time", "times"),
            thousands(found as u64)
        )));
    }
    // The size the edit makes, known before it is made: ten million one-byte matches
    // each replaced by a kilobyte would otherwise allocate gigabytes to be refused.
    let replaced = if replace_all { found } else { 1 };
    let size = (text.len() as u128 + replaced as u128 * new.len() as u128)
        .saturating_sub(replaced as u128 * old.len() as u128);
    if size > max as u128 {
        return Err(ToolError::failed(format!(
            "the edit would make {what} {}, over the {} edit_file writes; nothing was changed",
            count(u64::try_from(size).unwrap_or(u64::MAX), "byte", "bytes"),
            count(max as u64, "byte", "bytes")
        )));
    }
    let updated = if replace_all {
        text.replace(old, new)
    } else {
        text.replacen(old, new, 1)
    };
    let dir = path.parent().unwrap_or(tools.root.dir());
    let mut temp =
        temp_file(dir, Some(meta.permissions())).map_err(|e| io_failed("write", &rel, &e))?;
    write_all_synced(&mut temp, updated.as_bytes()).map_err(|e| io_failed("write", &rel, &e))?;
    temp.persist(&path)
        .map_err(|e| io_failed("write", &rel, &e.error))?;
    Ok(format!(
        "Replaced {} in {}.",
        count(found as u64, "occurrence", "occurrences"),
        rel.display()
    ))
}

/// The name prefix of the tools' temporary files (see [`temp_file`]).
const TEMP_PREFIX: &str = ".keel-write-";

/// A temporary file in `dir` (hidden, so `grep` and `ls` pass over a leftover of a
/// write that was killed before its rename),
/// with exactly `keep` permissions (those of the file an edit replaces), or the usual
/// ones of a new file (`0o666` less the umask).
fn temp_file(dir: &Path, keep: Option<fs::Permissions>) -> io::Result<tempfile::NamedTempFile> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(TEMP_PREFIX);
    if let Some(p) = default_permissions() {
        builder.permissions(p);
    }
    let temp = builder.tempfile_in(dir)?;
    if let Some(p) = keep {
        fs::set_permissions(temp.path(), p)?;
    }
    Ok(temp)
}

#[cfg(unix)]
fn default_permissions() -> Option<fs::Permissions> {
    use std::os::unix::fs::PermissionsExt as _;
    Some(fs::Permissions::from_mode(0o666))
}

#[cfg(not(unix))]
fn default_permissions() -> Option<fs::Permissions> {
    None
}

fn write_all_synced(temp: &mut tempfile::NamedTempFile, bytes: &[u8]) -> io::Result<()> {
    temp.write_all(bytes)?;
    temp.flush()?;
    temp.as_file().sync_all()
}
