//! One table for `cargo xtask bench` (no target, or `all`): every group returns rows,
//! and this module writes them with the machine, the date and the versions to
//! `docs/benchmarks.md`.

use std::fmt::Write as _;

use anyhow::{Context, Result};

use crate::util::{cmd, root, run_capture};

/// One comparison: keel and one peer on one workload, in one unit.
#[derive(Debug, Clone)]
pub struct Row {
    /// The table section ("graph loop", "token counting", ...).
    pub section: &'static str,
    /// What was run, e.g. `memory, N = 2,000`.
    pub workload: String,
    /// keel's median, when measured.
    pub keel: Option<f64>,
    /// The peer's name ("LangGraph", "LangGraph.js", ...), or "-" for none.
    pub peer: &'static str,
    /// The peer's median, when measured.
    pub peer_value: Option<f64>,
    /// The unit of both medians.
    pub unit: &'static str,
    /// Whether more is better (steps/s, MB/s) or less (bytes, µs).
    pub higher_is_better: bool,
    /// A stated target on the ratio (keel this many times better than the peer).
    pub target: Option<f64>,
    /// Why a side is missing, or what else the row needs said.
    pub note: String,
}

impl Row {
    /// A row comparing keel with `peer` in a throughput unit (more is better).
    pub fn faster(
        section: &'static str,
        workload: impl Into<String>,
        unit: &'static str,
        keel: Option<f64>,
        peer: &'static str,
        peer_value: Option<f64>,
    ) -> Self {
        Row {
            section,
            workload: workload.into(),
            keel,
            peer,
            peer_value,
            unit,
            higher_is_better: true,
            target: None,
            note: String::new(),
        }
    }

    /// Sets the target ratio.
    pub fn target(mut self, ratio: f64) -> Self {
        self.target = Some(ratio);
        self
    }

    /// Sets the note.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }

    /// Marks the unit as less-is-better.
    pub fn smaller(mut self) -> Self {
        self.higher_is_better = false;
        self
    }

    /// How many times better keel is than the peer: keel/peer for throughput,
    /// peer/keel for costs.
    pub fn ratio(&self) -> Option<f64> {
        match (self.keel, self.peer_value) {
            (Some(k), Some(p)) if k > 0.0 && p > 0.0 => {
                Some(if self.higher_is_better { k / p } else { p / k })
            }
            _ => None,
        }
    }

    fn verdict(&self) -> String {
        match (self.target, self.ratio()) {
            (None, _) => "no target".into(),
            (Some(t), Some(r)) if r >= t => format!("≥ {t}x: met ({r:.1}x)"),
            (Some(t), Some(r)) => format!("≥ {t}x: not met ({r:.1}x)"),
            (Some(t), None) => format!("≥ {t}x: not measured"),
        }
    }
}

/// A row saying a whole group could not run.
pub fn failed(section: &'static str, peer: &'static str, why: &anyhow::Error) -> Row {
    Row::faster(section, "all", "-", None, peer, None).note(format!("did not run: {why:#}"))
}

fn value(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// What /proc says about this machine: CPU model, cores, memory.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpu
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU".to_owned(), |(_, m)| m.trim().to_owned());
    let cores = cpu.lines().filter(|l| l.starts_with("processor")).count();
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = mem
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok());
    let mem = kb.map_or("unknown memory".into(), |kb| {
        format!("{:.1} GiB memory", kb / 1024.0 / 1024.0)
    });
    format!("{model}, {cores} logical cores, {mem} (Linux, shared machine)")
}

fn command_line(program: &str, args: &[&str]) -> String {
    run_capture(cmd(program).args(args))
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|e| format!("unknown ({e:#})"))
}

/// Writes `docs/benchmarks.md` from the rows.
pub fn write(rows: &[Row], quick: bool, peers: &[(&str, &str)], secs: f64) -> Result<()> {
    let mut md = String::new();
    let date = command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let rustc = command_line("rustc", &["-V"]);
    let python = command_line("python3", &["--version"]);
    let node = command_line("node", &["--version"]);
    let commit = command_line("git", &["rev-parse", "--short", "HEAD"]);
    let _ = writeln!(md, "# Benchmarks\n");
    let _ = writeln!(
        md,
        "Written by `cargo xtask bench{}`: one command, one run, keel and its peers on the same \
         workloads in the same run. Absolute times on this machine are noisy (it is shared, \
         and others compiled on it during the run); the keel/peer ratios of one run are the result.\n",
        if quick { " --quick" } else { "" }
    );
    let _ = writeln!(md, "* Machine: {}", machine());
    let _ = writeln!(md, "* Date: {date}; the run took {:.0} min", secs / 60.0);
    let _ = writeln!(
        md,
        "* keel {} at commit {commit}, built with {rustc}; {python}; Node.js {node}",
        env!("CARGO_PKG_VERSION")
    );
    for (peer, version) in peers {
        let _ = writeln!(md, "* {peer}: {version}");
    }
    if quick {
        let _ = writeln!(
            md,
            "* `--quick`: one repetition per size (medians of one) in the graph, SQLite, Postgres and token \
             groups; the agent loop at N = 100 and 1,000 only; Deep Agents is not driven again: the prompt \
             logs of an earlier `cargo xtask bench compaction` are scored again (the scores depend only on \
             the recorded runs and those logs). A full run (5 repetitions, the agent loop to N = 10,000, \
             Deep Agents replaying every run at four windows) took 83 minutes on 2 cores (2026-12-02)"
        );
    }
    let _ = writeln!(
        md,
        "\nRatio: how many times better keel is than the peer (keel/peer for throughput, \
         peer/keel for bytes). Targets are the ones the bench groups and \
         docs/architecture.md state; \"no target\" where none is stated.\n"
    );
    let _ = writeln!(
        md,
        "Runs of single groups (`cargo xtask bench agent`, ...), and what was measured and \
         tried along the way, are in [benchmark-notes.md](benchmark-notes.md): the latest \
         agent-loop run first, then this full run's agent-loop figures with the targets each \
         met or missed (among them the runtime a step and the pgbench bound, which these \
         tables do not show), then every earlier run.\n"
    );
    let mut sections: Vec<&str> = Vec::new();
    for r in rows {
        if !sections.contains(&r.section) {
            sections.push(r.section);
        }
    }
    for section in sections {
        let _ = writeln!(md, "## {section}\n");
        let _ = writeln!(
            md,
            "| workload | unit | keel | peer | peer median | ratio | target | note |"
        );
        let _ = writeln!(md, "|---|---|---:|---|---:|---:|---|---|");
        for r in rows.iter().filter(|r| r.section == section) {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                cell(&r.workload),
                r.unit,
                value(r.keel),
                r.peer,
                value(r.peer_value),
                r.ratio().map_or("-".into(), |x| format!("{x:.1}x")),
                r.verdict(),
                cell(&r.note)
            );
        }
        let _ = writeln!(md);
    }
    let path = root().join("docs").join("benchmarks.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote docs/benchmarks.md ({} rows)", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Row;

    #[test]
    fn ratios_and_verdicts() {
        let r = Row::faster("s", "w", "steps/s", Some(200.0), "P", Some(10.0)).target(20.0);
        assert_eq!(r.ratio(), Some(20.0));
        assert!(r.verdict().contains("met (20.0x)"));
        let b = Row::faster("s", "w", "bytes", Some(10.0), "P", Some(50.0)).smaller();
        assert_eq!(b.ratio(), Some(5.0));
        assert_eq!(b.verdict(), "no target");
        let m = Row::faster("s", "w", "x", None, "P", Some(1.0)).target(6.0);
        assert!(m.verdict().contains("not measured"));
    }
}
