//! PostgreSQL connection strings read as libpq reads them, `sslmode` and `sslrootcert`
//! included, with TLS over rustls behind the `rustls` feature.
//!
//! The one abstraction is [`ConnectionString`]: a parsed connection string (a URL or
//! `key=value` pairs) that yields a [`tokio_postgres::Config`] and the [`Tls`]
//! connector its `sslmode` asks for. keel's PostgreSQL crates (the checkpointer, the
//! offload store, the fleet's queue) connect through it, so the string that works
//! with `psql` works with them, managed databases that require TLS included.
//!
//! tokio-postgres alone knows `disable`, `prefer` and `require`, and refuses
//! `verify-ca`, `verify-full` and `sslrootcert`. Here every libpq mode is taken:
//!
//! | `sslmode` | with the `rustls` feature | without it |
//! |---|---|---|
//! | `disable` | no TLS | no TLS |
//! | `allow`, `prefer` (the default) | TLS when the server offers it, certificate not checked (as libpq) | no TLS |
//! | `require` | TLS, certificate not checked; checked against `sslrootcert` when one is given (as libpq) | refused: [`ConnectError::NeedsTls`] |
//! | `verify-ca` | TLS, certificate chain checked against the roots | refused |
//! | `verify-full` | TLS, chain and host name checked | refused |
//!
//! The roots are the certificates in the PEM file `sslrootcert` names, or, when it is
//! absent or `system`, the Mozilla roots compiled in (webpki-roots): a managed
//! database whose certificate chains to a public authority needs nothing more, and
//! one with a private authority (Amazon RDS, say) needs its bundle in `sslrootcert`.
//! As with libpq, `PGSSLMODE` and `PGSSLROOTCERT` give the mode and the roots when the
//! string does not, and `ssl_min_protocol_version` / `ssl_max_protocol_version` bound
//! the TLS version (rustls speaks 1.2 and 1.3). A `sslrootcert` file that cannot be
//! read is an error in every mode that reads it (libpq's `require` would go on without
//! checking). Refused with [`ConnectError::Unsupported`], naming the option: client
//! certificates (`sslcert`, `sslkey`, `sslcertmode=require`), revocation lists
//! (`sslcrl`, `sslcrldir`) and `gssencmode=require`; for those, build a pool with a
//! connector of your own. A certificate that no root signed fails with an error naming
//! the roots looked in and `sslrootcert=`. [`redact`] shows a connection string with
//! its password hidden, in either form.
//!
//! ```
//! use keel_postgres_tls::{ConnectionString, SslMode};
//!
//! let parsed: ConnectionString = "postgres://keel@db.example.com/app?sslmode=disable".parse()?;
//! assert_eq!(parsed.ssl_mode(), SslMode::Disable);
//! assert_eq!(parsed.config().get_dbname(), Some("app"));
//!
//! // The modes tokio-postgres refuses are taken, and refused only when TLS is not
//! // built in.
//! let strict = ConnectionString::parse("host=db.example.com user=keel sslmode=verify-full");
//! if cfg!(feature = "rustls") {
//!     assert_eq!(strict?.ssl_mode(), SslMode::VerifyFull);
//! } else {
//!     assert!(strict.is_err());
//! }
//! # Ok::<(), keel_postgres_tls::ConnectError>(())
//! ```
//!
//! Connecting takes the two parts, as tokio-postgres's own connectors:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use keel_postgres_tls::ConnectionString;
//!
//! let (config, tls) = ConnectionString::parse("postgres://keel@db.example.com/app?sslmode=require")?
//!     .into_parts();
//! let (client, connection) = config.connect(tls).await?;
//! tokio::spawn(connection);
//! client.simple_query("SELECT 1").await?;
//! # Ok(())
//! # }
//! ```

mod parse;
pub use parse::redact;
#[cfg(feature = "rustls")]
mod verify;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use tokio_postgres::Socket;
use tokio_postgres::tls::MakeTlsConnect;

/// libpq's `sslmode`: whether to use TLS and what to check of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// libpq tries without TLS first; here it is [`Prefer`](Self::Prefer), which
    /// succeeds wherever `allow` would.
    Allow,
    /// TLS when the server offers it, without checking its certificate; libpq's default.
    #[default]
    Prefer,
    /// TLS or no connection; the certificate is checked only against an explicit
    /// `sslrootcert`.
    Require,
    /// TLS, with the server's certificate chain checked against the roots.
    VerifyCa,
    /// TLS, with the chain and the host name checked.
    VerifyFull,
}

impl SslMode {
    /// The mode as libpq spells it (`verify-full`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether a connection in this mode fails rather than go without TLS.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }

    fn parse(value: &str) -> Result<Self, ConnectError> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => {
                return Err(ConnectError::BadSslMode {
                    value: value.to_owned(),
                });
            }
        })
    }

    /// The nearest mode tokio-postgres knows; the checks beyond it are the connector's.
    fn for_tokio(self) -> tokio_postgres::config::SslMode {
        use tokio_postgres::config::SslMode as T;
        match self {
            SslMode::Disable => T::Disable,
            SslMode::Allow | SslMode::Prefer => T::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => T::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a connection string cannot be used. Nothing has connected when one is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// tokio-postgres could not parse the string (the TLS options aside).
    #[error("cannot parse the connection string: {reason}")]
    Parse {
        /// tokio-postgres's reason.
        reason: String,
    },
    /// `sslmode` is not one of libpq's six.
    #[error(
        "sslmode `{value}` is not one of disable, allow, prefer, require, verify-ca, verify-full"
    )]
    BadSslMode {
        /// The value given.
        value: String,
    },
    /// The string requires TLS and this build has none.
    #[error(
        "sslmode={mode} needs TLS, which this build leaves out: turn it on (the `keel` crate's `postgres` feature has it; alone, keel-checkpoint-postgres's, keel-offload's or keel-fleet's `tls` feature)"
    )]
    NeedsTls {
        /// The mode asked for.
        mode: SslMode,
    },
    /// The `sslrootcert` file cannot be read or holds no certificate.
    #[error("cannot use sslrootcert {}: {reason}", path.display())]
    RootCert {
        /// The file named.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// An option libpq knows that is not supported here (client certificates,
    /// revocation lists, GSSAPI encryption).
    #[error("the connection string's `{option}` is not supported: {why}")]
    Unsupported {
        /// The option.
        option: String,
        /// Why, and what to do instead.
        why: &'static str,
    },
    /// rustls refused the settings (no usable protocol version, say).
    #[error("cannot set up TLS: {reason}")]
    Tls {
        /// rustls's reason.
        reason: String,
    },
}

/// A connection string parsed into tokio-postgres's settings and the TLS connector
/// its `sslmode` asks for. See the crate docs for what each mode does.
#[derive(Clone)]
pub struct ConnectionString {
    config: tokio_postgres::Config,
    mode: SslMode,
    root_cert: Option<PathBuf>,
    tls: Tls,
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // tokio-postgres's `Debug` redacts the password.
        f.debug_struct("ConnectionString")
            .field("config", &self.config)
            .field("ssl_mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .finish_non_exhaustive()
    }
}

impl ConnectionString {
    /// Parses a URL (`postgres://user:pass@host:5432/db?sslmode=verify-full`) or
    /// `key=value` pairs (`host=db user=keel sslmode=require`). As libpq, takes
    /// `sslmode` and `sslrootcert` from the environment (`PGSSLMODE`,
    /// `PGSSLROOTCERT`) when the string does not give them. Reads the `sslrootcert`
    /// file when the mode checks certificates.
    pub fn parse(s: &str) -> Result<Self, ConnectError> {
        Self::parse_with_env(s, |name| std::env::var(name).ok())
    }

    /// [`parse`](Self::parse) with the environment given as a function.
    fn parse_with_env(s: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConnectError> {
        // A URL of another database reads as nothing useful to tokio-postgres ("unexpected
        // EOF"): name its scheme instead (only the scheme, never the credentials).
        if let Some((scheme, _)) = s.trim_start().split_once("://")
            && scheme != "postgres"
            && scheme != "postgresql"
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        {
            return Err(ConnectError::Parse {
                reason: format!(
                    "a `{scheme}://` URL is not a PostgreSQL connection string, which starts with postgres:// or postgresql://, in lower case (or is key=value pairs)"
                ),
            });
        }
        let parsed = parse::split_tls_options(s)?;
        if let Some((option, why)) = parsed.unsupported {
            return Err(ConnectError::Unsupported { option, why });
        }
        let mode = match parsed.ssl_mode.or_else(|| env("PGSSLMODE")) {
            Some(v) => SslMode::parse(&v)?,
            None => SslMode::default(),
        };
        let versions =
            TlsVersions::between(parsed.min_version.as_deref(), parsed.max_version.as_deref())?;
        let mut config =
            tokio_postgres::Config::from_str(&parsed.rest).map_err(|e| ConnectError::Parse {
                reason: with_sources(&e),
            })?;
        config.ssl_mode(mode.for_tokio());
        let root_cert = parsed
            .root_cert
            .or_else(|| env("PGSSLROOTCERT"))
            .filter(|r| r != "system")
            .map(PathBuf::from);
        let tls = Tls::new(mode, root_cert.as_deref(), versions)?;
        Ok(ConnectionString {
            config,
            mode,
            root_cert,
            tls,
        })
    }

    /// The settings for tokio-postgres, with its `ssl_mode` set to the nearest of its
    /// three (`verify-*` is `Require` there, and the connector checks the rest).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The settings, to change (an application name, a timeout, session options).
    pub fn config_mut(&mut self) -> &mut tokio_postgres::Config {
        &mut self.config
    }

    /// The `sslmode` given, or [`SslMode::Prefer`].
    pub fn ssl_mode(&self) -> SslMode {
        self.mode
    }

    /// The `sslrootcert` file given (`None` when absent or `system`).
    pub fn root_cert(&self) -> Option<&std::path::Path> {
        self.root_cert.as_deref()
    }

    /// The connector for this string's mode.
    pub fn tls(&self) -> &Tls {
        &self.tls
    }

    /// The settings and the connector, for `config.connect(tls)` or a
    /// `deadpool_postgres::Manager`.
    pub fn into_parts(self) -> (tokio_postgres::Config, Tls) {
        (self.config, self.tls)
    }
}

/// The TLS versions a connection may use: libpq's `ssl_min_protocol_version` and
/// `ssl_max_protocol_version` over the two rustls speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TlsVersions {
    pub(crate) tls12: bool,
    pub(crate) tls13: bool,
}

impl TlsVersions {
    fn between(min: Option<&str>, max: Option<&str>) -> Result<Self, ConnectError> {
        // libpq's spellings, as minor versions of TLS 1.
        let minor = |option: &str, value: &str| match value {
            "TLSv1" => Ok(0),
            "TLSv1.1" => Ok(1),
            "TLSv1.2" => Ok(2),
            "TLSv1.3" => Ok(3),
            _ => Err(ConnectError::Parse {
                reason: format!(
                    "{option} `{value}` is not one of TLSv1, TLSv1.1, TLSv1.2, TLSv1.3"
                ),
            }),
        };
        let low = min.map_or(Ok(2), |v| minor("ssl_min_protocol_version", v))?;
        let high = max.map_or(Ok(3), |v| minor("ssl_max_protocol_version", v))?;
        let versions = TlsVersions {
            tls12: low <= 2 && 2 <= high,
            tls13: low <= 3 && 3 <= high,
        };
        if !versions.tls12 && !versions.tls13 {
            return Err(ConnectError::Unsupported {
                option: "ssl_max_protocol_version".to_owned(),
                why: "the versions allowed leave out TLS 1.2 and 1.3, the ones rustls speaks",
            });
        }
        Ok(versions)
    }
}

/// `e` and its sources: tokio-postgres says which option is wrong only in the source.
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl FromStr for ConnectionString {
    type Err = ConnectError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The TLS connector a [`ConnectionString`] asks for: tokio-postgres's `NoTls` without
/// the `rustls` feature, rustls with it. Cheap to clone.
#[derive(Clone)]
pub struct Tls {
    #[cfg(feature = "rustls")]
    inner: tokio_postgres_rustls::MakeRustlsConnect,
    #[cfg(not(feature = "rustls"))]
    inner: tokio_postgres::NoTls,
    mode: SslMode,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("rustls", &cfg!(feature = "rustls"))
            .field("ssl_mode", &self.mode)
            .finish()
    }
}

impl Tls {
    #[cfg(feature = "rustls")]
    fn new(
        mode: SslMode,
        root_cert: Option<&std::path::Path>,
        versions: TlsVersions,
    ) -> Result<Self, ConnectError> {
        let config = verify::client_config(mode, root_cert, versions)?;
        Ok(Tls {
            inner: tokio_postgres_rustls::MakeRustlsConnect::new(config),
            mode,
        })
    }

    #[cfg(not(feature = "rustls"))]
    fn new(
        mode: SslMode,
        _root_cert: Option<&std::path::Path>,
        _versions: TlsVersions,
    ) -> Result<Self, ConnectError> {
        if mode.requires_tls() {
            return Err(ConnectError::NeedsTls { mode });
        }
        Ok(Tls {
            inner: tokio_postgres::NoTls,
            mode,
        })
    }

    /// Whether this build has TLS (the `rustls` feature).
    pub fn available() -> bool {
        cfg!(feature = "rustls")
    }
}

#[cfg(feature = "rustls")]
type Inner = tokio_postgres_rustls::MakeRustlsConnect;
#[cfg(not(feature = "rustls"))]
type Inner = tokio_postgres::NoTls;

impl MakeTlsConnect<Socket> for Tls {
    type Stream = <Inner as MakeTlsConnect<Socket>>::Stream;
    type TlsConnect = <Inner as MakeTlsConnect<Socket>>::TlsConnect;
    type Error = <Inner as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        <Inner as MakeTlsConnect<Socket>>::make_tls_connect(&mut self.inner, domain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_libpq_mode_is_read_and_mapped_to_the_nearest_of_tokio_postgres() {
        use tokio_postgres::config::SslMode as T;
        for (text, tokio) in [
            ("disable", T::Disable),
            ("allow", T::Prefer),
            ("prefer", T::Prefer),
            ("require", T::Require),
            ("verify-ca", T::Require),
            ("verify-full", T::Require),
        ] {
            let mode = SslMode::parse(text).unwrap();
            assert_eq!(mode.as_str(), text);
            assert_eq!(mode.for_tokio(), tokio, "{text}");
            if !Tls::available() && mode.requires_tls() {
                continue;
            }
            let parsed = ConnectionString::parse(&format!("host=h sslmode={text}")).unwrap();
            assert_eq!(parsed.ssl_mode(), mode);
            assert_eq!(parsed.config().get_ssl_mode(), tokio);
        }
        // The environment left out: `PGSSLMODE` would set the mode.
        let default = ConnectionString::parse_with_env("postgres://u@h/db", |_| None).unwrap();
        assert_eq!(default.ssl_mode(), SslMode::Prefer);
    }

    #[test]
    fn another_databases_url_is_named_by_its_scheme_alone() {
        let e = ConnectionString::parse_with_env("mysql://root:secret@h/db", |_| None).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("a `mysql://` URL is not a PostgreSQL"),
            "{text}"
        );
        assert!(!text.contains("secret"), "{text}");
        // tokio-postgres reads the schemes in lower case only.
        let e = ConnectionString::parse_with_env("PostgreSQL://u@h/db", |_| None).unwrap_err();
        assert!(e.to_string().contains("in lower case"), "{e}");
        for ok in [
            "postgres://u@h/db",
            "postgresql://u@h/db",
            "host=h password=a://b",
        ] {
            ConnectionString::parse_with_env(ok, |_| None).unwrap();
        }
    }

    #[test]
    fn bad_modes_client_certificates_and_bad_strings_are_typed_errors() {
        let e = ConnectionString::parse("host=h sslmode=on").unwrap_err();
        assert!(
            matches!(e, ConnectError::BadSslMode { ref value } if value == "on"),
            "{e}"
        );
        let e = ConnectionString::parse("postgres://h/db?sslcert=%2Fc.pem").unwrap_err();
        assert!(matches!(e, ConnectError::Unsupported { ref option, .. } if option == "sslcert"));
        let e = ConnectionString::parse("postgres://h/db?nonsense=1").unwrap_err();
        assert!(matches!(e, ConnectError::Parse { .. }), "{e}");
        assert!(e.to_string().contains("nonsense"), "{e}");
    }

    #[test]
    fn the_password_stays_out_of_debug_output() {
        let parsed = ConnectionString::parse("postgres://u:hunter2@h/db?sslmode=disable").unwrap();
        assert!(!format!("{parsed:?}").contains("hunter2"));
    }

    #[test]
    fn the_environment_gives_what_the_string_does_not_as_libpq() {
        let env = |name: &str| match name {
            "PGSSLMODE" => Some("disable".to_owned()),
            _ => None,
        };
        let from_env = ConnectionString::parse_with_env("host=h", env).unwrap();
        assert_eq!(from_env.ssl_mode(), SslMode::Disable);
        let given = ConnectionString::parse_with_env("host=h sslmode=allow", env).unwrap();
        assert_eq!(given.ssl_mode(), SslMode::Allow);
        let bad = |name: &str| (name == "PGSSLMODE").then(|| "on".to_owned());
        assert!(matches!(
            ConnectionString::parse_with_env("host=h", bad),
            Err(ConnectError::BadSslMode { .. })
        ));
        let root = |name: &str| (name == "PGSSLROOTCERT").then(|| "/etc/ca.pem".to_owned());
        let with_root = ConnectionString::parse_with_env("host=h sslmode=prefer", root).unwrap();
        assert_eq!(
            with_root.root_cert(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
    }

    #[test]
    fn protocol_versions_are_libpqs_spellings_over_the_two_rustls_speaks() {
        let v = |min, max| TlsVersions::between(min, max);
        assert_eq!(
            v(None, None).unwrap(),
            TlsVersions {
                tls12: true,
                tls13: true
            }
        );
        assert_eq!(
            v(Some("TLSv1.3"), None).unwrap(),
            TlsVersions {
                tls12: false,
                tls13: true
            }
        );
        assert_eq!(
            v(Some("TLSv1"), Some("TLSv1.2")).unwrap(),
            TlsVersions {
                tls12: true,
                tls13: false
            }
        );
        assert!(matches!(
            v(None, Some("TLSv1.1")),
            Err(ConnectError::Unsupported { .. })
        ));
        assert!(matches!(
            v(Some("1.3"), None),
            Err(ConnectError::Parse { .. })
        ));
        ConnectionString::parse("host=h ssl_min_protocol_version=TLSv1.3").unwrap();
    }

    #[cfg(not(feature = "rustls"))]
    #[test]
    fn without_tls_a_string_that_requires_it_is_refused() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let e = ConnectionString::parse(&format!("host=h sslmode={mode}")).unwrap_err();
            assert!(matches!(e, ConnectError::NeedsTls { .. }), "{e}");
            assert!(e.to_string().contains("`postgres` feature"), "{e}");
        }
    }
}
