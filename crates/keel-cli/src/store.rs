//! Where threads live: the embedded SQLite file under the home directory, or Postgres.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use keel::checkpoint::{Checkpointer, ThreadKey};
use keel::offload::{FsStore, OffloadStore, PostgresStore, PostgresStoreOptions};
use keel::postgres::{PostgresConfig, PostgresSaver};
use keel::sqlite::SqliteOptions;

/// An opened checkpointer, and a sentence saying which.
pub struct Storage {
    /// The checkpointer.
    pub saver: Arc<dyn Checkpointer>,
    /// `SQLite file .keel/keel.sqlite` or `Postgres at host:port/db`.
    pub described: String,
}

/// The Postgres schema of keel's tables for this process (`KEEL_SCHEMA`, or `schema`
/// in keel.toml), set once at start.
static SCHEMA: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Sets the Postgres schema every store of this process uses (`None`: the default).
pub fn use_schema(schema: Option<String>) {
    let _ = SCHEMA.set(schema);
}

/// The Postgres schema set by [`use_schema`], if any.
pub fn schema() -> Option<&'static str> {
    SCHEMA.get().and_then(|s| s.as_deref())
}

/// The error context of a schema name a library refused.
pub fn bad_schema(s: &str) -> String {
    format!("KEEL_SCHEMA (or schema in keel.toml) = {s:?} cannot name a schema")
}

/// ` (schema S)` when a schema was set, for messages.
fn in_schema() -> String {
    schema()
        .map(|s| format!(" (schema {s})"))
        .unwrap_or_default()
}

/// The embedded file in `home`.
pub fn sqlite_path(home: &Path) -> PathBuf {
    home.join("keel.sqlite")
}

/// The offload store (large tool results, the archive of compacted history) in `home`.
pub fn offload_dir(home: &Path) -> PathBuf {
    home.join("offload")
}

/// Opens Postgres when a URL is given (its tables created or upgraded), otherwise the
/// embedded SQLite file (created, with its directory, when `create` is set).
pub async fn open(
    home: &Path,
    database_url: Option<&str>,
    create: bool,
) -> anyhow::Result<Storage> {
    open_with(home, database_url, create, true).await
}

/// A database without keel's tables, found by [`open_to_read`]: nothing was stored
/// there. The sentence says where it looked.
#[derive(Debug)]
pub struct NoTables(pub String);

impl std::fmt::Display for NoTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NoTables {}

/// [`open`] for a command that only reads: Postgres's tables are read as they are,
/// not created or upgraded, so it works under a read-only role and leaves no tables
/// behind; a schema without them is named in the error.
pub async fn open_to_read(home: &Path, database_url: Option<&str>) -> anyhow::Result<Storage> {
    open_with(home, database_url, false, false).await
}

async fn open_with(
    home: &Path,
    database_url: Option<&str>,
    create: bool,
    setup: bool,
) -> anyhow::Result<Storage> {
    if let Some(url) = database_url {
        let mut config = PostgresConfig::new(url).map_err(|e| match e {
            keel::postgres::PostgresError::ConnectionString(e) => url_error(e),
            e => anyhow::Error::new(e),
        })?;
        if let Some(s) = schema() {
            config = config.schema(s).with_context(|| bad_schema(s))?;
        }
        let saver = PostgresSaver::connect(&config).context("cannot set up the Postgres pool")?;
        if setup {
            let applied = saver.setup().await.map_err(|e| {
                setup_failed(
                    e,
                    url,
                    format!(
                        "cannot reach Postgres at {}{} or create keel's tables there",
                        redact(url),
                        in_schema()
                    ),
                )
            })?;
            note_upgrade(&applied, "checkpoint tables", &redact(url));
        } else {
            // Read only: a schema a newer keel upgraded is refused, not misread.
            saver.schema_version().await.map_err(|e| {
                let context = if matches!(e, keel::postgres::PostgresError::Pool(_)) {
                    unreachable(&e, url, "keel's database")
                } else {
                    format!(
                        "cannot read keel's tables at {}{} ({})",
                        redact(url),
                        in_schema(),
                        crate::version_line()
                    )
                };
                anyhow::Error::new(e).context(context)
            })?;
            let probe = saver.get(&ThreadKey::new("keel-cli-probe"), None).await;
            if let Err(e) = probe {
                let missing = match &e {
                    keel::checkpoint::CheckpointError::Backend(b) => matches!(
                        b.downcast_ref::<keel::postgres::PostgresError>(),
                        Some(keel::postgres::PostgresError::NotSetUp { .. })
                    ),
                    _ => false,
                };
                if missing {
                    return Err(anyhow::Error::new(NoTables(format!(
                        "no keel tables in schema {} at {}: nothing was stored there yet (or keel's tables are in another schema: set KEEL_SCHEMA)",
                        schema().unwrap_or(config.get_schema()),
                        redact(url)
                    ))));
                }
                return Err(e).with_context(|| {
                    format!(
                        "cannot read keel's tables at {}{}",
                        redact(url),
                        in_schema()
                    )
                });
            }
        }
        return Ok(Storage {
            saver: Arc::new(saver),
            described: format!("Postgres at {}{}", redact(url), in_schema()),
        });
    }
    let path = sqlite_path(home);
    if home.is_file() {
        anyhow::bail!(
            "--home names a directory, and {} is a file: keel keeps its SQLite file there as keel.sqlite (with offloaded results beside it in offload/); pass the directory that holds a keel.sqlite",
            home.display()
        );
    }
    if !create && !path.exists() {
        anyhow::bail!(
            "no keel database at {}: run `keel demo` or `keel run` first, or pass --home DIR or --database-url URL",
            path.display()
        );
    }
    if create {
        std::fs::create_dir_all(home)
            .with_context(|| format!("cannot create the home directory {}", home.display()))?;
    }
    // The CLI's runtime is tokio's multi-thread one and runs no `LocalSet`: awaited
    // writes may run in place, skipping the hand-offs to the writer thread.
    let saver = SqliteOptions::default()
        .block_in_place(true)
        .open(&path)
        .await
        .with_context(|| format!("cannot open the SQLite file {}", path.display()))?;
    Ok(Storage {
        saver: Arc::new(saver),
        described: format!("SQLite file {}", path.display()),
    })
}

/// What to say of a connection to Postgres at `url` that failed with `e`: a refused TLS
/// handshake is not a server that is down. `names` is what `--database-url` should
/// name ("keel's database", "the fleet's database").
pub fn unreachable(e: &dyn std::fmt::Display, url: &str, names: &str) -> String {
    if e.to_string().contains("TLS handshake") {
        format!(
            "cannot connect to Postgres at {} over TLS: see the TLS options of the URL (sslmode, sslrootcert)",
            redact(url)
        )
    } else {
        format!(
            "cannot reach Postgres at {}: check that the server is up and that --database-url (or DATABASE_URL) names {names}",
            redact(url)
        )
    }
}

/// The error of a failed setup of keel's tables at `url`: headed as one of a schema a
/// newer keel upgraded when it is one (the server was reached, and nothing is wrong
/// with it), else by `otherwise`.
pub fn setup_failed(e: impl Into<anyhow::Error>, url: &str, otherwise: String) -> anyhow::Error {
    let e: anyhow::Error = e.into();
    let too_new = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<keel::postgres::PostgresError>(),
            Some(keel::postgres::PostgresError::SchemaTooNew { .. })
        ) || matches!(
            c.downcast_ref::<keel_fleet::FleetError>(),
            Some(keel_fleet::FleetError::SchemaTooNew { .. })
        ) || matches!(
            c.downcast_ref::<keel::offload::OffloadError>(),
            Some(keel::offload::OffloadError::SchemaTooNew { .. })
        )
    });
    if too_new {
        e.context(format!(
            "keel's tables at {}{} were upgraded by a newer keel than this one ({})",
            redact(url),
            in_schema(),
            crate::version_line()
        ))
    } else {
        e.context(otherwise)
    }
}

/// Says on stderr that keel's tables were upgraded (`applied` holds migrations, and
/// not the first: a new schema is created, not upgraded), since binaries older than
/// this one refuse them from now on.
pub fn note_upgrade(applied: &[i32], what: &str, at: &str) {
    if let (Some(&to), false) = (applied.iter().max(), applied.contains(&1)) {
        crate::errln!(
            "note: upgraded keel's {what} at {at}{} to version {to}; older keel binaries refuse them from now on",
            in_schema()
        );
    }
}

/// The offload store under `home` (created when missing).
pub fn offload(home: &Path) -> anyhow::Result<Arc<dyn OffloadStore>> {
    let dir = offload_dir(home);
    let store = FsStore::new(&dir)
        .with_context(|| format!("cannot open the offload store at {}", dir.display()))?;
    Ok(Arc::new(store))
}

/// The offload store that goes with the checkpointer: Postgres (the same database, so
/// every worker reads every archive) when a URL is given, else the directory under
/// `home`. `None` when `create` is off and the directory does not exist.
pub fn offload_for(
    home: &Path,
    database_url: Option<&str>,
    create: bool,
) -> anyhow::Result<Option<Arc<dyn OffloadStore>>> {
    if let Some(url) = database_url {
        let mut options = PostgresStoreOptions::new();
        if let Some(s) = schema() {
            options = options.schema(s).with_context(|| bad_schema(s))?;
        }
        let store = PostgresStore::connect_with(url, options).with_context(|| {
            format!(
                "cannot open the offload store in Postgres at {}{}",
                redact(url),
                in_schema()
            )
        })?;
        return Ok(Some(Arc::new(store)));
    }
    if !create && !offload_dir(home).exists() {
        return Ok(None);
    }
    offload(home).map(Some)
}

/// A new thread id: `prefix-` and a UUID v7, unique across processes and sorting by
/// creation time.
pub fn new_thread_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::now_v7())
}

/// A URL with its password replaced, for messages.
pub fn redact(url: &str) -> String {
    keel::postgres::tls::redact(url)
}

/// The error of a connection string keel cannot use: said to be malformed only when
/// it does not parse (a root certificate file that cannot be read, or an option keel
/// does not support, says so itself).
pub fn url_error(e: keel::postgres::tls::ConnectError) -> anyhow::Error {
    let malformed = matches!(e, keel::postgres::tls::ConnectError::Parse { .. });
    let e = anyhow::Error::new(e);
    if malformed {
        e.context("the database URL is not a valid Postgres connection string (postgres://user@host:port/db)")
    } else {
        e.context("the database URL cannot be used")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_made_at_once_differ() {
        let ids: Vec<String> = (0..100).map(|_| new_thread_id("run")).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 100, "no two alike");
        assert!(ids.iter().all(|id| id.starts_with("run-")));
    }

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact("postgres://bob:hunter2@db:5432/x"),
            "postgres://bob:***@db:5432/x"
        );
        assert_eq!(redact("postgres://bob@db/x"), "postgres://bob@db/x");
        assert_eq!(redact("host=db user=bob"), "host=db user=bob");
        assert_eq!(
            redact("host=db user=bob password=s3cret sslmode=require"),
            "host=db user=bob password=*** sslmode=require"
        );
        assert_eq!(
            redact("postgres://bob@db/x?password=s3cret&sslmode=require"),
            "postgres://bob@db/x?password=***&sslmode=require"
        );
    }
}
