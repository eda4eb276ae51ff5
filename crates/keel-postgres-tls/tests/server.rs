//! Each `sslmode` against a real server with TLS on: `DATABASE_URL`, as `cargo xtask
//! test` sets it (its throwaway cluster has TLS on, with a certificate for `localhost`
//! that it names in `KEEL_PG_TLS_CERT`). Skipped, saying why, without `DATABASE_URL`
//! (failing under `CI=true`) or when the server has TLS off.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use keel_postgres_tls::{ConnectError, ConnectionString};

fn database_url() -> Option<String> {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let reason = "DATABASE_URL is not set (run `cargo xtask test`, which starts a throwaway PostgreSQL cluster)";
            if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
                panic!("CI=true but no PostgreSQL: {reason}");
            }
            eprintln!("server: skipped: {reason}");
            None
        }
    }
}

/// `url` with `extra` options added (`k=v&k=v`).
fn with(url: &str, extra: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{extra}")
}

/// Connects with `s`; whether the session is encrypted (`pg_stat_ssl`).
async fn encrypted(s: &str) -> Result<bool, String> {
    let (config, tls) = ConnectionString::parse(s)
        .map_err(|e| e.to_string())?
        .into_parts();
    let (client, connection) = config.connect(tls).await.map_err(|e| {
        let mut text = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            text.push_str(&format!(": {s}"));
            source = s.source();
        }
        text
    })?;
    let driver = tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    drop(client);
    let _ = driver.await;
    Ok(row.get(0))
}

/// The server's certificate file, when this process can read it.
async fn server_cert(url: &str) -> Option<PathBuf> {
    if let Ok(path) = std::env::var("KEEL_PG_TLS_CERT") {
        return Some(path.into());
    }
    let (config, tls) = ConnectionString::parse(&with(url, "sslmode=disable"))
        .unwrap()
        .into_parts();
    let (client, connection) = config.connect(tls).await.ok()?;
    tokio::spawn(connection);
    let file: String = client
        .query_one("SHOW ssl_cert_file", &[])
        .await
        .ok()?
        .get(0);
    let mut path = PathBuf::from(file);
    if path.is_relative() {
        let dir: String = client
            .query_one("SHOW data_directory", &[])
            .await
            .ok()?
            .get(0);
        path = PathBuf::from(dir).join(path);
    }
    std::fs::metadata(&path).ok().map(|_| path)
}

#[tokio::test]
async fn each_sslmode_connects_or_refuses_as_libpq_would() {
    let Some(url) = database_url() else { return };
    let url = ConnectionString::parse(&url)
        .map(|_| url.clone())
        .expect("DATABASE_URL parses");
    let plain = encrypted(&with(&url, "sslmode=disable")).await.unwrap();
    assert!(!plain, "sslmode=disable gave an encrypted session");
    let ssl_on = encrypted(&with(&url, "sslmode=prefer")).await.unwrap();
    if !ssl_on {
        eprintln!(
            "server: skipped: the server at DATABASE_URL has TLS off (`cargo xtask test`'s throwaway cluster turns it on)"
        );
        return;
    }
    // `require` encrypts without checking the certificate, as libpq.
    assert!(encrypted(&with(&url, "sslmode=require")).await.unwrap());
    // `verify-full` against the Mozilla roots: a test server's certificate is not
    // signed by a public authority, so the handshake is refused.
    let refused = encrypted(&with(&url, "sslmode=verify-full"))
        .await
        .expect_err("a self-signed certificate passed verify-full");
    assert!(
        refused.contains("not signed by the Mozilla roots") && refused.contains("sslrootcert="),
        "{refused}"
    );
    // Either TLS version rustls speaks, when the string pins one.
    for pinned in [
        "ssl_min_protocol_version=TLSv1.3",
        "ssl_max_protocol_version=TLSv1.2",
    ] {
        assert!(
            encrypted(&with(&url, &format!("sslmode=require&{pinned}")))
                .await
                .unwrap(),
            "{pinned}"
        );
    }
    let Some(cert) = server_cert(&url).await else {
        eprintln!(
            "server: the checks against the server's own certificate skipped: its file cannot be read here"
        );
        return;
    };
    let root = format!(
        "sslrootcert={}",
        percent_encode(cert.to_str().expect("a UTF-8 path"))
    );
    // `verify-ca` checks the chain only: the server's certificate as the root passes
    // whatever host name it holds.
    assert!(
        encrypted(&with(&url, &format!("sslmode=verify-ca&{root}")))
            .await
            .unwrap()
    );
    // `require` with a root checks the chain too (libpq): a root that did not sign the
    // server's certificate is refused.
    let other = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(other.path(), OTHER_CA).unwrap();
    let other_root = format!(
        "sslrootcert={}",
        percent_encode(other.path().to_str().unwrap())
    );
    let wrong = encrypted(&with(&url, &format!("sslmode=require&{other_root}"))).await;
    assert!(wrong.is_err(), "a root that signed nothing was accepted");
    if std::env::var("KEEL_PG_TLS_CERT").is_ok() {
        // xtask's certificate names `localhost` only: `verify-full` passes for that
        // name and refuses the address.
        let by_name = url.replace("@127.0.0.1:", "@localhost:");
        assert!(
            encrypted(&with(&by_name, &format!("sslmode=verify-full&{root}")))
                .await
                .unwrap()
        );
        let by_address = encrypted(&with(&url, &format!("sslmode=verify-full&{root}")))
            .await
            .expect_err("verify-full accepted a certificate for another name");
        assert!(
            by_address.contains("name") || by_address.contains("Name"),
            "{by_address}"
        );
    }
}

#[test]
fn a_missing_or_empty_root_file_is_a_typed_error_before_connecting() {
    let e = ConnectionString::parse("host=h sslmode=verify-ca sslrootcert=/nonexistent/ca.pem")
        .unwrap_err();
    assert!(matches!(e, ConnectError::RootCert { .. }), "{e}");
    let empty = tempfile::NamedTempFile::new().unwrap();
    let e = ConnectionString::parse(&format!(
        "host=h sslmode=verify-full sslrootcert={}",
        empty.path().display()
    ))
    .unwrap_err();
    assert!(e.to_string().contains("no PEM certificate"), "{e}");
    // `prefer` reads no root file, as libpq.
    ConnectionString::parse("host=h sslmode=prefer sslrootcert=/nonexistent/ca.pem").unwrap();
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A CA certificate that signed none of the test servers' certificates (made once
/// with `openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256`).
const OTHER_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBqzCCAVGgAwIBAgIUJk28F3hvl0XBZ9RWqb5V/KXlE5QwCgYIKoZIzj0EAwIw
KjEoMCYGA1UEAwwfa2VlbCB0ZXN0IENBIHRoYXQgc2lnbnMgbm90aGluZzAgFw0y
NjEyMDcwNDUxNDRaGA8yMTI2MTExMzA0NTE0NFowKjEoMCYGA1UEAwwfa2VlbCB0
ZXN0IENBIHRoYXQgc2lnbnMgbm90aGluZzBZMBMGByqGSM49AgEGCCqGSM49AwEH
A0IABEaacRCq6ilQlkb7rJsg0gI8MHeAaGOOKE+7mi7sVmtUP/SqE9E52ORDrIPi
7YcXD8fDnswoIn4ZpAwyjAHwjz6jUzBRMB0GA1UdDgQWBBR/6JQom3LzPNLsWCZ8
1wdKXxUr6TAfBgNVHSMEGDAWgBR/6JQom3LzPNLsWCZ81wdKXxUr6TAPBgNVHRMB
Af8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCIQDm1qEhNznlVH6UrkCGxYHYm5eV
732AsS+/O0hbo4U5DQIgKpIe4N35NEVEYHvNE/3zuSKYQPsAcmAVNEg4+RQY4sI=
-----END CERTIFICATE-----
";
