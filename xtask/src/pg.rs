//! PostgreSQL for the tests and benchmarks: `DATABASE_URL` when set, otherwise a
//! throwaway cluster made with the local `initdb` and `pg_ctl`.
//!
//! The throwaway cluster lives in a fresh temporary directory, listens on 127.0.0.1 on a
//! free port (its socket stays in that directory), trusts local logins as `postgres`,
//! and is stopped and removed when the [`Cluster`] is dropped — after the tests pass,
//! fail, or panic. PostgreSQL refuses to run as root, so as root (as in CI) every
//! PostgreSQL command runs as the `postgres` user (`KEEL_PG_USER` overrides it) through
//! `runuser`, in a directory that user owns.
//!
//! The tests read `DATABASE_URL`; with a throwaway cluster they also get
//! `KEEL_PG_DATADIR`, `KEEL_PG_CTL` and `KEEL_PG_RUNAS`, so a test may stop and start
//! the server (`$KEEL_PG_CTL -D "$KEEL_PG_DATADIR" stop|start`, as `$KEEL_PG_RUNAS` when
//! set). `initdb` and `pg_ctl` come from PATH, or else from Debian's
//! `/usr/lib/postgresql/<version>/bin`.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::util::{has_program, run};

/// Where the tests' or the benchmark's PostgreSQL comes from.
pub enum Database {
    /// `DATABASE_URL` was set.
    External(String),
    /// A throwaway cluster started for this run.
    Throwaway(Cluster),
    /// Neither: why not.
    Unavailable(String),
}

impl Database {
    /// `DATABASE_URL` if set, else a throwaway cluster (`tune`: extra
    /// `postgresql.conf` lines; `tls`: TLS on, see [`Cluster::start`]), else the
    /// reason there is none.
    pub fn get(tune: &[&str], tls: bool) -> Database {
        if let Ok(url) = std::env::var("DATABASE_URL")
            && !url.trim().is_empty()
        {
            return Database::External(url);
        }
        match Cluster::start(tune, tls) {
            Ok(cluster) => Database::Throwaway(cluster),
            Err(e) => Database::Unavailable(format!("{e:#}")),
        }
    }

    /// The connection string, if there is a database.
    pub fn url(&self) -> Option<String> {
        match self {
            Database::External(url) => Some(url.clone()),
            Database::Throwaway(cluster) => Some(cluster.url()),
            Database::Unavailable(_) => None,
        }
    }

    /// Environment variables for the processes that use it.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        match self {
            Database::External(url) => vec![("DATABASE_URL", url.clone())],
            Database::Throwaway(cluster) => cluster.env(),
            Database::Unavailable(_) => Vec::new(),
        }
    }

    /// One line saying which database this is.
    pub fn describe(&self) -> String {
        match self {
            Database::External(_) => "PostgreSQL from DATABASE_URL".into(),
            Database::Throwaway(c) => format!(
                "throwaway PostgreSQL cluster on 127.0.0.1:{} in {}",
                c.port,
                c.dir.display()
            ),
            Database::Unavailable(reason) => format!("no PostgreSQL: {reason}"),
        }
    }
}

/// A throwaway PostgreSQL cluster, stopped and deleted on drop.
pub struct Cluster {
    dir: PathBuf,
    data: PathBuf,
    port: u16,
    /// The user PostgreSQL's commands run as (when we are root).
    run_as: Option<String>,
    /// Where `initdb` and `pg_ctl` are, when not on PATH.
    bin: Option<PathBuf>,
    /// The server's certificate, when TLS is on.
    tls_cert: Option<PathBuf>,
}

impl Cluster {
    /// Makes, configures and starts a cluster; `tune` lines go into `postgresql.conf`.
    /// With `tls`, and `openssl` on PATH, the server takes TLS with a self-signed
    /// certificate for `localhost` (named to the tests in `KEEL_PG_TLS_CERT`), so the
    /// tests of each `sslmode` run; without `openssl` they report the server's TLS off.
    pub fn start(tune: &[&str], tls: bool) -> Result<Cluster> {
        let bin = server_bin_dir()?;
        let run_as = if is_root()? {
            let user = std::env::var("KEEL_PG_USER").unwrap_or_else(|_| "postgres".into());
            if !has_program("runuser") {
                bail!(
                    "running as root, PostgreSQL must run as `{user}`, but `runuser` is not on PATH"
                );
            }
            let known = Command::new("id")
                .arg("-u")
                .arg(&user)
                .output()
                .is_ok_and(|o| o.status.success());
            if !known {
                bail!(
                    "running as root, PostgreSQL must run as another user, but `{user}` does not exist (set KEEL_PG_USER)"
                );
            }
            Some(user)
        } else {
            None
        };
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("keel-pg-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cluster = Cluster {
            data: dir.join("data"),
            dir,
            port: 0,
            run_as,
            bin,
            tls_cert: None,
        };
        // From here on, dropping `cluster` cleans up whatever was made.
        if let Some(user) = &cluster.run_as {
            run(Command::new("chown")
                .arg(format!("{user}:"))
                .arg(&cluster.dir))?;
        }
        run(cluster
            .as_owner("initdb")
            .arg("-D")
            .arg(&cluster.data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C"])
            .args(["--no-sync", "--no-instructions"])
            .stdout(std::process::Stdio::null()))
        .context("initdb failed")?;
        cluster.port = free_port()?;
        let mut conf = format!(
            "\n# keel throwaway cluster\nport = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nmax_connections = 300\n",
            cluster.port,
            cluster.dir.display()
        );
        for line in tune {
            conf.push_str(line);
            conf.push('\n');
        }
        if tls {
            match cluster.make_certificate() {
                Ok(Some((cert, key))) => {
                    conf.push_str(&format!(
                        "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                        cert.display(),
                        key.display()
                    ));
                    cluster.tls_cert = Some(cert);
                }
                Ok(None) => eprintln!(
                    "the throwaway PostgreSQL cluster has TLS off: `openssl` is not on PATH"
                ),
                Err(e) => eprintln!("the throwaway PostgreSQL cluster has TLS off: {e:#}"),
            }
        }
        let conf_path = cluster.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path)
            .with_context(|| format!("reading {}", conf_path.display()))?;
        text.push_str(&conf);
        std::fs::write(&conf_path, text)
            .with_context(|| format!("writing {}", conf_path.display()))?;
        run(cluster
            .pg_ctl()
            .args(["-w", "-t", "60", "-l"])
            .arg(cluster.dir.join("server.log"))
            .arg("start")
            .stdout(std::process::Stdio::null()))
        .with_context(|| {
            format!(
                "pg_ctl start failed; server log: {}",
                cluster.dir.join("server.log").display()
            )
        })?;
        eprintln!(
            "started a throwaway PostgreSQL cluster on 127.0.0.1:{} ({})",
            cluster.port,
            cluster.dir.display()
        );
        Ok(cluster)
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `DATABASE_URL`, `KEEL_PG_DATADIR`, `KEEL_PG_RUNAS` and `KEEL_PG_CTL` for the
    /// test processes, and `KEEL_PG_TLS_CERT` when TLS is on.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("DATABASE_URL", self.url()),
            ("KEEL_PG_DATADIR", self.data.display().to_string()),
            ("KEEL_PG_RUNAS", self.run_as.clone().unwrap_or_default()),
            ("KEEL_PG_CTL", self.program("pg_ctl")),
        ];
        if let Some(cert) = &self.tls_cert {
            env.push(("KEEL_PG_TLS_CERT", cert.display().to_string()));
        }
        env
    }

    /// A self-signed certificate for `localhost` and its key, in the cluster's
    /// directory and owned by the server's user; `None` without `openssl`.
    fn make_certificate(&self) -> Result<Option<(PathBuf, PathBuf)>> {
        let has_openssl = Command::new("openssl")
            .arg("version")
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has_openssl {
            return Ok(None);
        }
        let (cert, key) = (self.dir.join("server.crt"), self.dir.join("server.key"));
        run(Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
            .args([
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost",
            ])
            // A server's certificate, not an authority's (openssl's default for -x509):
            // rustls refuses an authority's certificate presented by a server.
            .args(["-addext", "basicConstraints=critical,CA:FALSE"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(std::process::Stdio::null()))
        .context("openssl could not make a certificate")?;
        {
            use std::os::unix::fs::PermissionsExt;
            // The server refuses a key others can read.
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))
                .context("making the key private")?;
        }
        if let Some(user) = &self.run_as {
            run(Command::new("chown")
                .arg(format!("{user}:"))
                .arg(&cert)
                .arg(&key))?;
        }
        Ok(Some((cert, key)))
    }

    /// `program` (a PostgreSQL server program) as a path or a name on PATH.
    fn program(&self, program: &str) -> String {
        match &self.bin {
            Some(dir) => dir.join(program).display().to_string(),
            None => program.to_owned(),
        }
    }

    /// `program` run as the cluster's owner.
    fn as_owner(&self, program: &str) -> Command {
        let program = self.program(program);
        match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--", &program]);
                c
            }
            None => Command::new(&program),
        }
    }

    fn pg_ctl(&self) -> Command {
        let mut c = self.as_owner("pg_ctl");
        c.arg("-D").arg(&self.data);
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.data.join("postmaster.pid").exists() {
            let stopped = self
                .pg_ctl()
                .args(["-m", "fast", "-w", "-t", "60", "stop"])
                .stdout(std::process::Stdio::null())
                .status();
            if !stopped.is_ok_and(|s| s.success()) {
                eprintln!(
                    "warning: could not stop the throwaway PostgreSQL cluster in {}",
                    self.dir.display()
                );
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("warning: could not remove {}: {e}", self.dir.display());
        } else {
            eprintln!("stopped and removed the throwaway PostgreSQL cluster");
        }
    }
}

/// `None` when `initdb` and `pg_ctl` are on PATH; else the newest
/// `/usr/lib/postgresql/<version>/bin` (Debian's layout) that has them.
fn server_bin_dir() -> Result<Option<PathBuf>> {
    if has_program("initdb") && has_program("pg_ctl") {
        return Ok(None);
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some((version, bin))
        })
        .collect();
    dirs.sort();
    match dirs.pop() {
        Some((_, bin)) => Ok(Some(bin)),
        None => bail!(
            "`initdb` and `pg_ctl` are not on PATH nor in /usr/lib/postgresql/*/bin (install the PostgreSQL server package)"
        ),
    }
}

fn is_root() -> Result<bool> {
    let out = Command::new("id")
        .arg("-u")
        .output()
        .context("running `id -u`")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "0")
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Whether CI is running us (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}
