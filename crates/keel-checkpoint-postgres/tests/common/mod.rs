//! Shared test setup: a real PostgreSQL from `DATABASE_URL`, one fresh schema per test.
//!
//! Without `DATABASE_URL` a test prints "skipped: <reason>" and passes, except under
//! `CI=true`, where it fails: CI must never skip the Postgres tests silently.
//! `cargo xtask test` starts a throwaway cluster and sets `DATABASE_URL` itself.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use keel_checkpoint_postgres::{PostgresConfig, PostgresSaver};

/// `DATABASE_URL`, or `None` after printing why the test is skipped (panics under CI).
pub fn database_url(test: &str) -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            if ci {
                panic!("{test}: CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("{test}: skipped: {reason}");
            None
        }
    }
}

/// A schema name no other test uses.
pub fn fresh_schema(test: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!(
        "keel_test_{}_{}",
        test.chars().take(20).collect::<String>(),
        &id[..12]
    )
}

/// A saver on a fresh schema, set up; `None` when skipped.
pub async fn saver(test: &str) -> Option<TestDb> {
    saver_with(test, |c| c).await
}

/// Like [`saver`], with a say in the configuration.
pub async fn saver_with(
    test: &str,
    configure: impl FnOnce(PostgresConfig) -> PostgresConfig,
) -> Option<TestDb> {
    let url = database_url(test)?;
    let schema = fresh_schema(test);
    let config = configure(
        PostgresConfig::new(&url)
            .unwrap()
            .schema(schema.clone())
            .unwrap(),
    );
    let saver = PostgresSaver::connect(&config).unwrap();
    saver.setup().await.unwrap();
    Some(TestDb {
        url,
        schema,
        config,
        saver,
    })
}

/// A test's saver and its schema; [`TestDb::drop_schema`] cleans up.
pub struct TestDb {
    pub url: String,
    pub schema: String,
    pub config: PostgresConfig,
    pub saver: PostgresSaver,
}

impl TestDb {
    /// A plain connection to the test database.
    pub async fn client(&self) -> tokio_postgres::Client {
        let (client, conn) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        client
    }

    /// Drops the test's schema and everything in it.
    pub async fn drop_schema(self) {
        let client = self.client().await;
        client
            .batch_execute(&format!(
                "DROP SCHEMA \"{}\" CASCADE",
                self.schema.replace('"', "\"\"")
            ))
            .await
            .unwrap();
    }
}

pub mod loop_graph;

/// A small deterministic random source (xorshift), seeded from the clock unless
/// `KEEL_TEST_SEED` is set; the seed is printed so a failure can be replayed.
pub struct Rng(u64);

impl Rng {
    pub fn from_env(test: &str) -> Self {
        let seed = std::env::var("KEEL_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        eprintln!("{test}: KEEL_TEST_SEED={seed}");
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}
