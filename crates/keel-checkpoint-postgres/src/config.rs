//! Connection settings.

use std::time::Duration;

use crate::error::PostgresError;

/// The default number of pooled connections.
pub const DEFAULT_POOL_SIZE: usize = 16;
/// The default per-statement timeout.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// The default schema for keel's tables.
pub const DEFAULT_SCHEMA: &str = "public";

/// How to reach PostgreSQL: a connection string plus pool size, statement timeout and
/// the schema keel's tables live in.
///
/// The connection string is either a URL (`postgres://user:pass@host:5432/db?...`) or
/// `key=value` pairs (`host=localhost user=keel dbname=app`), as libpq takes them.
///
/// * **Pool size**: [`DEFAULT_POOL_SIZE`] connections; every checkpointer call borrows
///   one for its duration, so this bounds concurrency (there is no saver-wide lock).
/// * **Statement timeout**: [`DEFAULT_STATEMENT_TIMEOUT`], sent as the session's
///   `statement_timeout` when each connection opens (`None` keeps the server's).
/// * **Schema**: [`DEFAULT_SCHEMA`]; tables are named `keel_*` so they sit beside other
///   applications' tables. [`PostgresSaver::setup`](crate::PostgresSaver::setup)
///   creates the schema if it is missing.
/// * **TLS** follows the string's `sslmode` as libpq does (`disable`, `prefer`, the
///   default, `require`, `verify-ca`, `verify-full`; `sslrootcert` names the roots),
///   with this crate's `tls` feature (rustls). Without it connections are made without
///   TLS, even where the server offers it (unlike `psql`), and a string that requires
///   TLS is refused here with [`PostgresError::ConnectionString`]. [`keel_postgres_tls`] has the details. For client
///   certificates, build a `deadpool_postgres::Pool` with a connector of your own and
///   use [`PostgresSaver::from_pool`](crate::PostgresSaver::from_pool).
///
/// Other session settings go in the connection string's `options`, e.g.
/// `?options=-c%20synchronous_commit%3Doff` (commits return before the WAL is flushed
/// to disk: a crash of the *database server* may lose the last few commits, never
/// half of one; a crash of the client loses nothing).
///
/// ```
/// use std::time::Duration;
/// use keel_checkpoint_postgres::PostgresConfig;
///
/// let config = PostgresConfig::new("postgres://keel@localhost:5432/app")?
///     .pool_size(32)
///     .pool_wait(Duration::from_secs(5))
///     .delta_links(200_000) // a thousand agent threads at once
///     .statement_timeout(Some(Duration::from_secs(5)))
///     .schema("agents")?;
/// assert_eq!(config.get_pool_size(), 32);
/// assert_eq!(config.get_pool_wait(), Duration::from_secs(5));
/// assert_eq!(config.get_delta_links(), 200_000);
/// assert_eq!(config.get_schema(), "agents");
/// # Ok::<(), keel_checkpoint_postgres::PostgresError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PostgresConfig {
    pub(crate) pg: tokio_postgres::Config,
    pub(crate) tls: keel_postgres_tls::Tls,
    pub(crate) pool_size: usize,
    pub(crate) pool_wait: Duration,
    pub(crate) delta_links: usize,
    pub(crate) statement_timeout: Option<Duration>,
    pub(crate) schema: String,
}

/// How long a call waits for a pooled connection by default.
pub(crate) const DEFAULT_POOL_WAIT: Duration = Duration::from_secs(60);

/// Delta links a saver remembers by default (a few hundred bytes each).
pub(crate) const DEFAULT_DELTA_LINKS: usize = 65_536;

impl PostgresConfig {
    /// Parses a connection string (URL or `key=value` pairs), TLS options included;
    /// reads the `sslrootcert` file when the `sslmode` checks certificates.
    pub fn new(connection_string: &str) -> Result<Self, PostgresError> {
        let (mut pg, tls) =
            keel_postgres_tls::ConnectionString::parse(connection_string)?.into_parts();
        if pg.get_application_name().is_none() {
            pg.application_name("keel");
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(Duration::from_secs(10));
        }
        Ok(Self {
            pg,
            tls,
            pool_size: DEFAULT_POOL_SIZE,
            pool_wait: DEFAULT_POOL_WAIT,
            delta_links: DEFAULT_DELTA_LINKS,
            statement_timeout: Some(DEFAULT_STATEMENT_TIMEOUT),
            schema: DEFAULT_SCHEMA.to_owned(),
        })
    }

    /// Reads the connection string from the `DATABASE_URL` environment variable.
    pub fn from_env() -> Result<Self, PostgresError> {
        match std::env::var("DATABASE_URL") {
            Ok(url) if !url.trim().is_empty() => Self::new(&url),
            _ => Err(PostgresError::NoDatabaseUrl),
        }
    }

    /// Sets how many connections the pool opens at most (at least 1).
    #[must_use]
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Sets how long a call waits for a connection when every one of the pool's is
    /// busy (default 60 s). Past it the call fails with
    /// [`PostgresError::Pool`](crate::PostgresError::Pool), a checkpointer backend
    /// error that changed nothing: the run stays at its last checkpoint. Many threads
    /// running at once wait here; a larger [`pool_size`](Self::pool_size), up to what
    /// the server takes, waits less.
    #[must_use]
    pub fn pool_wait(mut self, wait: Duration) -> Self {
        self.pool_wait = wait;
        self
    }

    /// Sets how many delta links the saver remembers (default 65,536, a few hundred
    /// bytes each), so that a prune walks the chains of the checkpoints it keeps
    /// without reading them back (one recursive query a prune otherwise, whose cost
    /// grows with the table's bloat). An agent thread that prunes after each
    /// compaction keeps up to a couple of hundred (33 to 97 right after each prune in
    /// keel-agent's long-run test); past the room, the threads put to least recently
    /// are forgotten first. A service running a thousand agent threads at once wants
    /// about 200,000.
    #[must_use]
    pub fn delta_links(mut self, links: usize) -> Self {
        self.delta_links = links;
        self
    }

    /// How long a call waits for a pooled connection.
    pub fn get_pool_wait(&self) -> Duration {
        self.pool_wait
    }

    /// How many delta links the saver remembers.
    pub fn get_delta_links(&self) -> usize {
        self.delta_links
    }

    /// Sets the per-statement timeout (`None`: the server's setting).
    #[must_use]
    pub fn statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Sets the schema of keel's tables. Any name PostgreSQL accepts (it is quoted, never
    /// spliced raw into SQL): at most 63 bytes, no NUL.
    pub fn schema(mut self, schema: impl Into<String>) -> Result<Self, PostgresError> {
        let schema = schema.into();
        check_schema(&schema)?;
        self.schema = schema;
        Ok(self)
    }

    /// The pool size.
    pub fn get_pool_size(&self) -> usize {
        self.pool_size
    }

    /// The schema of keel's tables.
    pub fn get_schema(&self) -> &str {
        &self.schema
    }

    /// The statement timeout.
    pub fn get_statement_timeout(&self) -> Option<Duration> {
        self.statement_timeout
    }

    /// The parsed connection settings.
    pub fn pg_config(&self) -> &tokio_postgres::Config {
        &self.pg
    }

    /// The connection settings with the statement timeout added to the session options.
    pub(crate) fn session_config(&self) -> tokio_postgres::Config {
        let mut pg = self.pg.clone();
        if let Some(timeout) = self.statement_timeout {
            let millis = timeout.as_millis().max(1);
            let options = match pg.get_options() {
                Some(existing) if !existing.trim().is_empty() => {
                    format!("{existing} -c statement_timeout={millis}")
                }
                _ => format!("-c statement_timeout={millis}"),
            };
            pg.options(&options);
        }
        pg
    }
}

/// Refuses schema names PostgreSQL would truncate or cannot store.
pub(crate) fn check_schema(schema: &str) -> Result<(), PostgresError> {
    if schema.is_empty() || schema.len() > 63 || schema.contains('\0') {
        return Err(PostgresError::Config {
            reason: format!(
                "schema name {schema:?} must be 1 to 63 bytes without NUL (PostgreSQL truncates longer names)"
            ),
        });
    }
    Ok(())
}

/// `name` as a quoted SQL identifier.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn parses_urls_and_key_value_strings() {
        let url = PostgresConfig::new("postgres://u@127.0.0.1:5433/db").unwrap();
        assert_eq!(url.pg_config().get_user(), Some("u"));
        assert_eq!(url.pg_config().get_ports(), &[5433]);
        let kv = PostgresConfig::new("host=localhost user=keel dbname=app").unwrap();
        assert_eq!(kv.pg_config().get_dbname(), Some("app"));
        assert_eq!(kv.get_pool_size(), DEFAULT_POOL_SIZE);
        assert!(matches!(
            PostgresConfig::new("postgres://[bad"),
            Err(PostgresError::ConnectionString(
                keel_postgres_tls::ConnectError::Parse { .. }
            ))
        ));
    }

    #[test]
    fn statement_timeout_joins_existing_options() {
        let c = PostgresConfig::new("postgres://u@h/db?options=-c%20work_mem%3D8MB")
            .unwrap()
            .statement_timeout(Some(Duration::from_millis(1500)));
        assert_eq!(
            c.session_config().get_options(),
            Some("-c work_mem=8MB -c statement_timeout=1500")
        );
        let none = c.statement_timeout(None);
        assert_eq!(none.session_config().get_options(), Some("-c work_mem=8MB"));
    }

    #[test]
    fn schema_names_are_checked_and_quoted() {
        assert!(PostgresConfig::new("host=h").unwrap().schema("").is_err());
        assert!(
            PostgresConfig::new("host=h")
                .unwrap()
                .schema("a".repeat(64))
                .is_err()
        );
        assert!(
            PostgresConfig::new("host=h")
                .unwrap()
                .schema("a\0b")
                .is_err()
        );
        assert_eq!(quote_ident(r#"we"ird"#), r#""we""ird""#);
    }
}
