//! Errors of the Postgres saver and how they map onto [`CheckpointError`].

use keel_checkpoint::{CheckpointError, CheckpointId};

/// SQLSTATE raised by `keel_put` when the expected head is not the thread's head.
pub(crate) const SQLSTATE_CONFLICT: &str = "KL409";
/// SQLSTATE raised by `keel_put` for a request inconsistent with what is stored.
pub(crate) const SQLSTATE_INVALID: &str = "KL422";

/// Why setting up or talking to PostgreSQL failed.
///
/// Checkpointer methods return [`CheckpointError`]; these errors reach the caller
/// inside [`CheckpointError::Backend`] (downcast to tell them apart), and directly
/// from [`PostgresConfig`](crate::PostgresConfig) and
/// [`PostgresSaver::setup`](crate::PostgresSaver::setup).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostgresError {
    /// The connection string or an option is not usable.
    #[error("invalid Postgres configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
    /// The connection string cannot be used (it does not parse, names a root
    /// certificate file that cannot be read, or asks for TLS this build leaves out):
    /// nothing has connected.
    #[error(transparent)]
    ConnectionString(#[from] keel_postgres_tls::ConnectError),
    /// `DATABASE_URL` is not set (for [`PostgresConfig::from_env`](crate::PostgresConfig::from_env)).
    #[error("DATABASE_URL is not set")]
    NoDatabaseUrl,
    /// No pooled connection could be had (the server is down, refused the login, or
    /// every connection stayed busy past the wait timeout).
    #[error("no Postgres connection: {}", chain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A query failed.
    #[error("Postgres query failed: {}", chain(.0))]
    Query(#[from] tokio_postgres::Error),
    /// keel's tables are not in the schema: call
    /// [`PostgresSaver::setup`](crate::PostgresSaver::setup) first.
    #[error(
        "keel's checkpoint tables are missing in schema {schema:?}: call PostgresSaver::setup() first ({})",
        chain(source)
    )]
    NotSetUp {
        /// The schema looked in.
        schema: String,
        /// The error Postgres gave.
        source: tokio_postgres::Error,
    },
    /// The schema holds migrations newer than this build knows: an older binary must not
    /// write to a newer schema.
    #[error(
        "schema {schema:?} is at migration {found}, newer than this keel-checkpoint-postgres knows ({known}): a newer keel upgraded it, and this one leaves it alone; run a keel that knows migration {found}"
    )]
    SchemaTooNew {
        /// The schema.
        schema: String,
        /// The newest migration recorded in it.
        found: i32,
        /// The newest migration this build has.
        known: i32,
    },
    /// A migration failed; it was rolled back.
    #[error("migration {version} ({name}) failed: {}", chain(source))]
    Migration {
        /// The migration's version.
        version: i32,
        /// The migration's name.
        name: &'static str,
        /// The error Postgres gave.
        source: tokio_postgres::Error,
    },
}

/// An error and its sources, joined: tokio-postgres says only "db error" at the top and
/// keeps the server's message in the source.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = inner.source();
    }
    text
}

impl From<PostgresError> for CheckpointError {
    fn from(error: PostgresError) -> Self {
        CheckpointError::backend(error)
    }
}

/// Maps a query error of schema `schema` onto a [`CheckpointError`]: missing tables
/// become [`PostgresError::NotSetUp`], the rest [`PostgresError::Query`].
pub(crate) fn query_error(schema: &str, error: tokio_postgres::Error) -> CheckpointError {
    let not_set_up = error.code().is_some_and(|code| {
        matches!(
            code.code(),
            // undefined_table, undefined_function, invalid_schema_name
            "42P01" | "42883" | "3F000"
        )
    });
    if not_set_up {
        PostgresError::NotSetUp {
            schema: schema.to_owned(),
            source: error,
        }
        .into()
    } else {
        PostgresError::Query(error).into()
    }
}

/// Maps an error of `keel_put` onto a [`CheckpointError`]: fencing and validation
/// refusals raised by the function become [`CheckpointError::Conflict`] and
/// [`CheckpointError::Invalid`].
pub(crate) fn put_error(
    schema: &str,
    expected: &Option<CheckpointId>,
    error: tokio_postgres::Error,
) -> CheckpointError {
    let Some(db) = error.as_db_error() else {
        return query_error(schema, error);
    };
    match db.code().code() {
        SQLSTATE_CONFLICT => {
            let actual = db.detail().filter(|d| !d.is_empty()).map(str::parse);
            match actual {
                None => CheckpointError::Conflict {
                    expected: expected.clone(),
                    actual: None,
                },
                Some(Ok(actual)) => CheckpointError::Conflict {
                    expected: expected.clone(),
                    actual: Some(actual),
                },
                Some(Err(e)) => CheckpointError::Corrupt {
                    what: format!("the thread's head is not a checkpoint id: {e}"),
                },
            }
        }
        SQLSTATE_INVALID => CheckpointError::Invalid {
            reason: db.message().to_owned(),
        },
        // unique_violation: a delta or checkpoint with this id is already stored.
        "23505" => CheckpointError::Invalid {
            reason: format!(
                "already stored: {}",
                db.detail().unwrap_or_else(|| db.message())
            ),
        },
        _ => query_error(schema, error),
    }
}
