//! An npm installation under `target/` for the Node.js peers keel is compared with.
//!
//! A peer is a folder `xtask/peers/<name>/` with a `package.json` of exact versions, its
//! `package-lock.json` and its `.mjs` scripts. `cargo xtask` copies them into
//! `target/peers-node/` and runs `npm ci` there the first time (and again whenever the
//! manifest or the lockfile changes), so a side-by-side benchmark is one command. The
//! scripts are copied on every use, next to their `node_modules` (ES modules resolve
//! packages from the script's own folder upwards, not from `NODE_PATH`). `NODE` and
//! `NPM` override the programs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{cmd, root, run};

/// The oldest Node.js major version the peers run on.
const MIN_NODE_MAJOR: u32 = 20;

/// An installed Node.js peer: `target/peers-node`.
pub struct NodePeer {
    dir: PathBuf,
}

impl NodePeer {
    /// Installs the peer `xtask/peers/<name>/` into `target/peers-node` if needed.
    pub fn ensure(name: &str) -> Result<NodePeer> {
        let src = root().join("xtask").join("peers").join(name);
        let dir = root().join("target").join("peers-node");
        check_node()?;
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let manifest = read(&src.join("package.json"))?;
        let lock = read(&src.join("package-lock.json")).unwrap_or_default();
        let stamp_path = dir.join(".keel-installed");
        let stamp = format!("{manifest}\n{lock}");
        let installed = std::fs::read_to_string(&stamp_path).is_ok_and(|s| s == stamp)
            && dir.join("node_modules").is_dir();
        if !installed {
            write(&dir.join("package.json"), &manifest)?;
            let npm = std::env::var("NPM").unwrap_or_else(|_| "npm".to_owned());
            let mut c = cmd(&npm);
            c.current_dir(&dir);
            if lock.is_empty() {
                let _ = std::fs::remove_file(dir.join("package-lock.json"));
                c.args(["install", "--omit-lockfile-registry-resolved"]);
            } else {
                write(&dir.join("package-lock.json"), &lock)?;
                c.arg("ci");
            }
            c.args(["--no-audit", "--no-fund", "--loglevel=error"]);
            run(&mut c).with_context(|| {
                format!(
                    "installing the Node.js peer {name} with npm into {}",
                    dir.display()
                )
            })?;
            write(&stamp_path, &stamp)?;
        }
        for entry in
            std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "mjs" || e == "js") {
                let file = path.file_name().context("a script without a name")?;
                std::fs::copy(&path, dir.join(file))
                    .with_context(|| format!("copying {}", path.display()))?;
            }
        }
        Ok(NodePeer { dir })
    }

    /// `node --expose-gc <script>` for one of the peer's scripts, run from the workspace
    /// root.
    pub fn node(&self, script: &str) -> Command {
        let mut c = cmd(&node_program());
        c.arg("--expose-gc").arg(self.dir.join(script));
        c
    }
}

fn node_program() -> String {
    std::env::var("NODE").unwrap_or_else(|_| "node".to_owned())
}

/// Fails unless `node` runs and is at least [`MIN_NODE_MAJOR`].
fn check_node() -> Result<()> {
    let out = Command::new(node_program())
        .arg("--version")
        .output()
        .context(
            "running `node --version` (the Node.js peers need Node.js 20 or newer, with npm)",
        )?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let major = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        Some(m) if m >= MIN_NODE_MAJOR => Ok(()),
        _ => bail!("the Node.js peers need Node.js {MIN_NODE_MAJOR} or newer, found `{version}`"),
    }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
