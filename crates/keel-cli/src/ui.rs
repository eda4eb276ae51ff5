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

/// Writes to stdout; a closed pipe exits with success, another failure with code 1.
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: warnings and errors).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// Prints an error and its causes, one per line, and returns exit code 1.
pub fn fail(error: &anyhow::Error) -> ExitCode {
    eprintln!("error: {error}");
    for cause in error.chain().skip(1) {
        eprintln!("  caused by: {cause}");
    }
    ExitCode::from(1)
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

/// A share as a percentage with one decimal: `0.4012` → `40.1%`.
pub fn percent(share: f64) -> String {
    if share.is_finite() {
        format!("{:.1}%", share * 100.0)
    } else {
        "-".to_owned()
    }
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
