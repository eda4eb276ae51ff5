//! A Python virtualenv under `target/` for the peers keel is compared with.
//!
//! `cargo xtask` creates it on first use and installs the pinned packages each caller
//! asks for, so a differential test or a side-by-side benchmark is one command.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::util::{cmd, root, run};

/// The peer virtualenv: `target/peers-venv`.
pub struct Venv {
    dir: PathBuf,
}

impl Venv {
    /// Creates the virtualenv if needed and makes sure `packages` (pip specifiers,
    /// e.g. `"langgraph==1.0.2"`) are installed.
    pub fn ensure(packages: &[&str]) -> Result<Venv> {
        let dir = root().join("target").join("peers-venv");
        let venv = Venv { dir };
        if !venv.python_path().exists() {
            let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
            run(cmd(&python).args(["-m", "venv"]).arg(&venv.dir))
                .context("creating the peer virtualenv (needs python3 with venv)")?;
        }
        let missing: Vec<&str> = packages.iter().copied().filter(|p| !venv.has(p)).collect();
        if !missing.is_empty() {
            run(venv
                .python()
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(&missing))
            .context("installing Python peers with pip")?;
        }
        Ok(venv)
    }

    fn python_path(&self) -> PathBuf {
        self.dir.join("bin").join("python")
    }

    /// A `python` command inside the virtualenv, run from the workspace root.
    pub fn python(&self) -> Command {
        let mut c = Command::new(self.python_path());
        c.current_dir(root());
        c
    }

    /// True when `spec` (`name==version` or `name`) is installed at that version.
    fn has(&self, spec: &str) -> bool {
        let (name, version) = spec.split_once("==").unwrap_or((spec, ""));
        let out = Command::new(self.python_path())
            .args(["-m", "pip", "show", "--disable-pip-version-check", name])
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                version.is_empty() || text.lines().any(|l| l == format!("Version: {version}"))
            }
            _ => false,
        }
    }
}
