//! What the tests on PostgreSQL share.

/// `DATABASE_URL`, or `None` after saying why `what` is skipped; under `CI=true` a
/// missing database fails instead.
pub fn database_url(what: &str) -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("{what}: skipped: {reason}");
            None
        }
    }
}
