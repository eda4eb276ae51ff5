//! Output helpers: errors as sentences, tables, tracing to stderr.

use std::fmt::Write as _;
use std::process::ExitCode;

/// `println!` that ends the process quietly when stdout is closed (`keel threads show T
/// | head`), instead of panicking as `println!` does on a broken pipe.
#[macro_export]
macro_rules! outln {
    () => { $crate::ui::write_out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::ui::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` with the same care.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::ui::write_out(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics: a closed or full stderr loses the line, nothing else.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::ui::write_err(format_args!("{}\n", format_args!($($arg)*))) };
}

/// Writes to stderr, ignoring failure (there is nowhere left to report it).
pub fn write_err(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// Writes to stdout; a closed pipe exits with success, another failure with code 1.
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        write_err(format_args!("error: cannot write to stdout: {e}\n"));
        std::process::exit(1);
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: errors only; what a user must
/// see is printed as a sentence by the command itself, so library warnings such as a
/// rejected summary stay out of the output unless `RUST_LOG=warn` asks for them).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// A flag's whole number of at least 1 (clap turns the error into a usage error, exit
/// code 2, naming the flag).
pub fn at_least_one<T>(text: &str) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + From<u8> + std::fmt::Display,
{
    whole_at_least(text, T::from(1), "", T::from(10))
}

/// A flag's whole number of at least `least`, `why` saying why after the refusal and
/// `example` given as one that would do (clap turns the error into a usage error, exit
/// code 2, naming the flag).
pub fn whole_at_least<T>(text: &str, least: T, why: &str, example: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    match text.trim().parse::<T>() {
        Ok(n) if n >= least => Ok(n),
        Ok(_) => Err(format!("it must be at least {least}{why}")),
        Err(_) => Err(format!(
            "give a whole number, at least {least} (e.g. {example})"
        )),
    }
}

/// A flag's fraction, from 0 to 1 (clap turns the error into a usage error, exit code
/// 2, naming the flag).
pub fn fraction(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        Ok(_) => Err("it must be from 0 to 1 (e.g. 0.4)".to_owned()),
        Err(_) => Err("give a number from 0 to 1 (e.g. 0.4)".to_owned()),
    }
}

/// A flag's text that must say something (not empty, not only spaces).
pub fn some_text(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        Err("it is empty: give the text, or leave the flag out".to_owned())
    } else {
        Ok(text.to_owned())
    }
}

/// A flag's thread id, checked as keel stores threads: one name (not empty, no `/`,
/// `\`, NUL or control characters, not starting with `.`, at most 255 bytes). Refused
/// as a usage error before anything is written, with the one reason.
pub fn thread_id(text: &str) -> Result<String, String> {
    match keel::offload::ThreadId::new(text) {
        Ok(_) => Ok(text.to_owned()),
        Err(keel::offload::OffloadError::InvalidKey { problem, .. }) => Err(format!(
            "{problem}: give a thread id such as ticket-42 (one name: no `/`, `\\` or control characters, not starting with `.`)"
        )),
        Err(e) => Err(format!("{e}: give a thread id such as ticket-42")),
    }
}

/// Exit codes, as `keel --help` lists them.
pub mod exit {
    /// An error (a sentence on stderr says what to do).
    pub const ERROR: u8 = 1;
    /// Bad usage: a flag, or a combination of them, that cannot work.
    pub const USAGE: u8 = 2;
    /// The demo's final answer was wrong.
    pub const WRONG_ANSWER: u8 = 3;
    /// `keel replay` skipped files or runs it could not read (the rest were replayed).
    pub const SKIPPED_FILES: u8 = 4;
    /// `keel run` stopped before the model answered (its --max-steps, the thread's
    /// step ceiling, a model that kept replying with nothing or with too many tool
    /// calls); the thread resumes.
    pub const STOPPED: u8 = 5;
    /// Stopped by Ctrl-C after a step; the thread resumes.
    pub const INTERRUPTED: u8 = 130;
    /// Stopped by SIGTERM after a step; the thread resumes.
    pub const TERMINATED: u8 = 143;
}

/// Prints an error and its causes, one per line, and returns exit code 1.
pub fn fail(error: &anyhow::Error) -> ExitCode {
    for line in error_lines(error) {
        write_err(format_args!("{line}\n"));
    }
    ExitCode::from(exit::ERROR)
}

/// Prints a refusal of the command line as given (and its causes) and returns exit
/// code 2, as clap does for a bad flag.
pub fn usage_error(error: &anyhow::Error) -> ExitCode {
    for line in error_lines(error) {
        write_err(format_args!("{line}\n"));
    }
    ExitCode::from(exit::USAGE)
}

/// `error: ...` and one `caused by: ...` per cause, leaving out a cause whose text the
/// line before already says (an error that prints its source, wrapped by `anyhow`,
/// would otherwise repeat it).
fn error_lines(error: &anyhow::Error) -> Vec<String> {
    let mut lines = vec![format!("error: {error}")];
    let mut previous = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !previous.contains(&text) {
            lines.push(format!("  caused by: {text}"));
        }
        previous = text;
    }
    lines
}

/// A plain text table: the first row is the header; numeric-looking cells are
/// right-aligned.
pub fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0usize; columns];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for (r, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (c, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let numeric = r > 0 && looks_numeric(cell);
            let pad = w.saturating_sub(cell.chars().count());
            if numeric {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
        if r == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(out, "{}", rule.join("  "));
        }
    }
    out
}

fn looks_numeric(cell: &str) -> bool {
    let t = cell
        .trim_end_matches(['%', 'x', 's'])
        .trim_start_matches(['-', '+']);
    !t.is_empty()
        && t.chars()
            .all(|c| c.is_ascii_digit() || c == ',' || c == '.')
}

/// `12345` → `12,345`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// This process's peak resident memory (Linux `VmHWM`), for the reports the benchmarks
/// read; `None` elsewhere.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// `milestone: prompt 4,506 -> 3,021 tokens, 10 messages archived` (an epoch, which
/// archives no messages, leaves the count out; a token-triggered one at the budget
/// says so).
pub fn compaction(e: &keel::compaction::CompactionEvent) -> String {
    let mut line = format!(
        "{}: prompt {} -> {} tokens",
        e.kind.as_str(),
        thousands(e.tokens_before as u64),
        thousands(e.tokens_after as u64)
    );
    if e.messages_archived > 0 {
        let _ = write!(
            line,
            ", {} archived",
            count(e.messages_archived as u64, "message")
        );
    }
    if e.trigger == keel::compaction::Trigger::Tokens && e.at_budget() {
        // Due whatever it cost, not chosen because it paid.
        line.push_str(" (at the budget)");
    }
    if e.fallback {
        // The summarizer failed at it; the fallback (extractive) wrote the summary.
        let _ = write!(line, " (written by the {} fallback)", e.summarizer_model);
    }
    line
}

/// `1 model call`, `2 model calls`: a count with its noun, in thousands.
pub fn count(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{} {noun}s", thousands(n))
    }
}

/// A share as a percentage with one decimal: `0.4012` → `40.1%`.
pub fn percent(share: f64) -> String {
    if share.is_finite() {
        format!("{:.1}%", share * 100.0)
    } else {
        "-".to_owned()
    }
}

/// Creates `dir` and its parents, `what` naming it in the error; a path on the way
/// that is a file is said to be one (the OS says only "File exists" or "Not a
/// directory").
pub fn create_dir(dir: &std::path::Path, what: &str) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if let Some(file) = dir.ancestors().find(|p| p.is_file()) {
        anyhow::bail!(
            "cannot create {}, {what}: {} is a file, not a directory",
            dir.display(),
            file.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}, {what}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn a_cause_already_in_the_line_before_is_not_repeated() {
        #[derive(Debug)]
        struct Inner;
        impl std::fmt::Display for Inner {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("connection refused")
            }
        }
        impl std::error::Error for Inner {}
        #[derive(Debug)]
        struct Outer(Inner);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot reach the server: {}", self.0)
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Outer(Inner)).context("the run failed");
        assert_eq!(
            error_lines(&e),
            [
                "error: the run failed",
                "  caused by: cannot reach the server: connection refused"
            ]
        );
        let plain = anyhow::anyhow!("disk full").context("cannot write report.json");
        assert_eq!(error_lines(&plain).len(), 2);
    }

    #[test]
    fn thread_ids_are_checked_with_one_reason() {
        assert_eq!(thread_id("ticket-42"), Ok("ticket-42".to_owned()));
        let empty = thread_id("").unwrap_err();
        assert!(
            empty.starts_with("it is empty: give a thread id"),
            "{empty}"
        );
        assert_eq!(empty.matches("empty").count(), 1, "said once: {empty}");
        let slash = thread_id("bad/../id").unwrap_err();
        assert!(slash.contains("cannot contain `/`"), "{slash}");
        assert!(thread_id(".hidden").unwrap_err().contains("start with `.`"));
    }

    #[test]
    fn counts_take_the_plural_but_for_one() {
        assert_eq!(count(1, "model call"), "1 model call");
        assert_eq!(count(0, "epoch"), "0 epochs");
        assert_eq!(count(1_200, "milestone"), "1,200 milestones");
    }

    #[test]
    fn table_aligns_numbers_right() {
        let t = table(&[
            vec!["name".into(), "tokens".into()],
            vec!["a".into(), "5".into()],
            vec!["bb".into(), "1,000".into()],
        ]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "name  tokens");
        assert_eq!(lines[2], "a          5");
        assert_eq!(lines[3], "bb     1,000");
    }
}
