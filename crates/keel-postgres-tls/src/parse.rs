//! Takes libpq's TLS options out of a connection string, leaving the rest for
//! tokio-postgres, which refuses the ones it does not know.

use percent_encoding::percent_decode_str;

use crate::ConnectError;

const CLIENT_CERTIFICATES: &str =
    "client certificates need a pool built with a TLS connector of your own (`from_pool`)";

/// libpq options refused, with why: the connector has no client identity and checks
/// no revocation list, and there is no GSSAPI encryption.
fn unsupported(key: &str, value: &str) -> Option<&'static str> {
    match (key, value) {
        ("sslcert" | "sslkey" | "sslpassword", _) | ("sslcertmode", "require") => {
            Some(CLIENT_CERTIFICATES)
        }
        ("sslcrl" | "sslcrldir", _) => Some(
            "certificate revocation lists are not checked: leave them out, or build a pool with a TLS connector of your own (`from_pool`)",
        ),
        ("gssencmode", "require") => {
            Some("GSSAPI encryption is not supported: encrypt with TLS (`sslmode`) instead")
        }
        _ => None,
    }
}

/// Options libpq takes that change nothing here: rustls always sends SNI for a host
/// name, TLS compression is gone from every protocol version rustls speaks, no client
/// certificate is ever sent, and GSSAPI encryption is never tried (libpq's `prefer`
/// falls back from it too).
const IGNORED: [&str; 4] = ["sslsni", "sslcompression", "sslcertmode", "gssencmode"];

/// A connection string with its TLS options taken out.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Parsed {
    pub(crate) ssl_mode: Option<String>,
    pub(crate) root_cert: Option<String>,
    /// `ssl_min_protocol_version` and `ssl_max_protocol_version`.
    pub(crate) min_version: Option<String>,
    pub(crate) max_version: Option<String>,
    /// The first option refused, and why.
    pub(crate) unsupported: Option<(String, &'static str)>,
    /// The string without the options above, for tokio-postgres.
    pub(crate) rest: String,
}

impl Parsed {
    /// Takes `key`'s `value` if it is one of ours; whether it was.
    fn take(&mut self, key: &str, value: String) -> bool {
        if let Some(why) = unsupported(key, &value) {
            self.unsupported
                .get_or_insert_with(|| (key.to_owned(), why));
            return true;
        }
        match key {
            "sslmode" => self.ssl_mode = Some(value),
            "sslrootcert" => self.root_cert = Some(value),
            "ssl_min_protocol_version" => self.min_version = Some(value),
            "ssl_max_protocol_version" => self.max_version = Some(value),
            k if IGNORED.contains(&k) => {}
            _ => return false,
        }
        true
    }
}

pub(crate) fn split_tls_options(s: &str) -> Result<Parsed, ConnectError> {
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        split_url(s)
    } else {
        Ok(split_pairs(s))
    }
}

fn decode(part: &str, what: &str) -> Result<String, ConnectError> {
    percent_decode_str(part)
        .decode_utf8()
        .map(|d| d.into_owned())
        .map_err(|e| ConnectError::Parse {
            reason: format!("the URL's {what} `{part}` is not UTF-8 once decoded: {e}"),
        })
}

/// `postgres://...?k=v&k=v`: the query's pairs, percent-decoded.
fn split_url(s: &str) -> Result<Parsed, ConnectError> {
    let mut parsed = Parsed::default();
    let Some((base, query)) = s.split_once('?') else {
        parsed.rest = s.to_owned();
        return Ok(parsed);
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if !parsed.take(&decode(key, "option")?, decode(value, "value")?) {
            kept.push(pair);
        }
    }
    parsed.rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(parsed)
}

/// `key=value key='quoted \' value'`, as libpq and tokio-postgres read them. A string
/// that does not scan is passed on whole, for tokio-postgres to name the fault.
fn split_pairs(s: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let Some(pairs) = scan_pairs(s) else {
        parsed.rest = s.to_owned();
        return parsed;
    };
    let mut kept = Vec::new();
    for (key, value, raw) in pairs {
        if !parsed.take(&key, value) {
            kept.push(raw);
        }
    }
    parsed.rest = kept.join(" ");
    parsed
}

/// Each pair's key, unescaped value and raw text; `None` if the string does not scan.
fn scan_pairs(s: &str) -> Option<Vec<(String, String, &str)>> {
    let mut pairs = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let start = rest;
        let key_end = rest.find(|c: char| c == '=' || c.is_whitespace())?;
        let key = &rest[..key_end];
        if key.is_empty() {
            return None;
        }
        rest = rest[key_end..].trim_start().strip_prefix('=')?.trim_start();
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = if rest.starts_with('\'') {
            chars.next();
            loop {
                match chars.next()? {
                    (_, '\\') => value.push(chars.next()?.1),
                    (i, '\'') => break i + 1,
                    (_, c) => value.push(c),
                }
            }
        } else {
            loop {
                match chars.next() {
                    None => break rest.len(),
                    Some((i, c)) if c.is_whitespace() => break i,
                    Some((_, '\\')) => value.push(chars.next()?.1),
                    Some((_, c)) => value.push(c),
                }
            }
        };
        let raw_len = start.len() - rest.len() + end;
        pairs.push((key.to_owned(), value, &start[..raw_len]));
        rest = rest[end..].trim_start();
    }
    Some(pairs)
}

/// The connection string with every password shown as `***`: a URL's (`user:pw@`,
/// `?password=`) and a `password=` pair's. A `key=value` string that does not scan
/// is not shown at all, since where its password ends cannot be told.
pub fn redact(s: &str) -> String {
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        return redact_url(s);
    }
    match scan_pairs(s) {
        Some(pairs) => pairs
            .into_iter()
            .map(|(key, _, raw)| {
                if key == "password" {
                    "password=***".to_owned()
                } else {
                    raw.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(" "),
        None if s.contains("password") => {
            "(a connection string that does not parse, not shown: it names a password)".to_owned()
        }
        None => s.to_owned(),
    }
}

fn redact_url(s: &str) -> String {
    let (base, query) = match s.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (s, None),
    };
    let (scheme, rest) = base.split_once("://").unwrap_or(("postgres", base));
    // The userinfo ends at the last `@` before the query: a password written with an
    // unescaped `/` or `@` is still hidden whole.
    let base = match rest.rfind('@') {
        Some(at) => {
            let (userinfo, after) = rest.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***{after}"),
                None => base.to_owned(),
            }
        }
        None => base.to_owned(),
    };
    match query {
        None => base,
        Some(q) => {
            let pairs: Vec<String> = q
                .split('&')
                .map(|pair| {
                    let key = pair.split_once('=').map_or(pair, |(k, _)| k);
                    if percent_decode_str(key).decode_utf8_lossy() == "password" {
                        format!("{key}=***")
                    } else {
                        pair.to_owned()
                    }
                })
                .collect();
            format!("{base}?{}", pairs.join("&"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Parsed {
        split_tls_options(s).unwrap()
    }

    #[test]
    fn url_options_are_taken_out_and_the_rest_kept_verbatim() {
        let p = split(
            "postgres://u:p%40ss@h:5432/db?application_name=a%20b&sslmode=verify-full&sslrootcert=%2Ftmp%2Fca%20x.pem&connect_timeout=5",
        );
        assert_eq!(p.ssl_mode.as_deref(), Some("verify-full"));
        assert_eq!(p.root_cert.as_deref(), Some("/tmp/ca x.pem"));
        assert_eq!(
            p.rest,
            "postgres://u:p%40ss@h:5432/db?application_name=a%20b&connect_timeout=5"
        );
        let only = split("postgresql://h/db?sslmode=require");
        assert_eq!(only.rest, "postgresql://h/db");
        assert_eq!(split("postgres://h/db").rest, "postgres://h/db");
    }

    #[test]
    fn pairs_with_quotes_and_escapes_are_taken_out() {
        let p = split(
            r"host=h  user = keel sslrootcert='/etc/my ca\'s.pem' sslmode=verify-ca password=a\ b",
        );
        assert_eq!(p.ssl_mode.as_deref(), Some("verify-ca"));
        assert_eq!(p.root_cert.as_deref(), Some("/etc/my ca's.pem"));
        assert_eq!(p.rest, r"host=h user = keel password=a\ b");
        assert_eq!(p.unsupported, None);
    }

    #[test]
    fn client_certificates_are_flagged_and_libpq_only_options_dropped() {
        let p = split("host=h sslsni=1 sslcert=/c.pem sslkey=/k.pem gssencmode=disable");
        assert_eq!(p.unsupported.map(|u| u.0).as_deref(), Some("sslcert"));
        assert_eq!(p.rest, "host=h");
        let u = split("postgres://h/db?sslkey=%2Fk&sslcompression=0&sslcertmode=allow");
        assert_eq!(u.unsupported.map(|u| u.0).as_deref(), Some("sslkey"));
        assert_eq!(u.rest, "postgres://h/db");
        let crl = split("host=h sslcrl=/crl.pem").unsupported.unwrap();
        assert!(crl.1.contains("revocation"), "{}", crl.1);
        let gss = split("host=h gssencmode=require").unsupported.unwrap();
        assert!(gss.1.contains("GSSAPI"), "{}", gss.1);
        let v = split("host=h ssl_min_protocol_version=TLSv1.3");
        assert_eq!(v.min_version.as_deref(), Some("TLSv1.3"));
        assert_eq!(v.rest, "host=h");
    }

    #[test]
    fn a_string_that_does_not_scan_is_passed_on_whole() {
        for bad in ["host", "host='unterminated", "=x", "host=a\\"] {
            let p = split(bad);
            assert_eq!(p.rest, bad);
            assert_eq!(p.ssl_mode, None);
        }
    }

    #[test]
    fn passwords_are_never_shown() {
        for (given, shown) in [
            (
                "postgres://bob:hunter2@db:5432/x",
                "postgres://bob:***@db:5432/x",
            ),
            (
                "postgres://bob:p@ss@db/x?sslmode=require",
                "postgres://bob:***@db/x?sslmode=require",
            ),
            ("postgres://bob:p/ss@db/x", "postgres://bob:***@db/x"),
            (
                "postgresql://bob@db/x?password=hunter2&sslmode=require",
                "postgresql://bob@db/x?password=***&sslmode=require",
            ),
            (
                "postgres://db/x?pass%77ord=hunter2",
                "postgres://db/x?pass%77ord=***",
            ),
            ("postgres://bob@db/x", "postgres://bob@db/x"),
            (
                "host=db user=bob password=hunter2 sslmode=require",
                "host=db user=bob password=*** sslmode=require",
            ),
            (r"host=db password='hun ter\'2'", "host=db password=***"),
            ("host=db user=bob", "host=db user=bob"),
        ] {
            assert_eq!(redact(given), shown, "{given}");
        }
        let unscannable = redact("host=db password='hunter2");
        assert!(!unscannable.contains("hunter2"), "{unscannable}");
    }

    #[test]
    fn a_url_value_that_is_not_utf8_is_a_parse_error() {
        let e = split_tls_options("postgres://h/db?sslrootcert=%FF").unwrap_err();
        assert!(matches!(e, ConnectError::Parse { .. }), "{e}");
    }
}
