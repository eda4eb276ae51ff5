//! The rustls client settings for each `sslmode`.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use crate::{ConnectError, SslMode, TlsVersions};

/// The client settings for `mode`, with `root_cert`'s certificates (or the Mozilla
/// roots) when the mode checks the server's.
pub(crate) fn client_config(
    mode: SslMode,
    root_cert: Option<&Path>,
    versions: TlsVersions,
) -> Result<ClientConfig, ConnectError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut allowed = Vec::new();
    if versions.tls12 {
        allowed.push(&rustls::version::TLS12);
    }
    if versions.tls13 {
        allowed.push(&rustls::version::TLS13);
    }
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&allowed)
        .map_err(|e| ConnectError::Tls {
            reason: e.to_string(),
        })?;
    // libpq: `require` with a root certificate given checks the chain, as `verify-ca`.
    let check_chain = match mode {
        SslMode::VerifyCa | SslMode::VerifyFull => true,
        SslMode::Require => root_cert.is_some(),
        _ => false,
    };
    let chain = if check_chain {
        let roots = Arc::new(roots(root_cert)?);
        let webpki = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
            .build()
            .map_err(|e| ConnectError::Tls {
                reason: e.to_string(),
            })?;
        Some(Chain {
            webpki,
            check_name: mode == SslMode::VerifyFull,
            roots: match root_cert {
                Some(path) => format!("the certificates in {}", path.display()),
                None => "the Mozilla roots (no sslrootcert given)".to_owned(),
            },
        })
    } else {
        None
    };
    let verifier = Verifier { provider, chain };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// An unknown issuer, said in the terms of the connection string.
#[derive(Debug)]
struct UnknownIssuer(String);

impl std::fmt::Display for UnknownIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the server's certificate is not signed by {}: name its authority's certificate (a managed database's CA bundle) in sslrootcert=",
            self.0
        )
    }
}

impl std::error::Error for UnknownIssuer {}

/// The certificates of the PEM file, or the Mozilla roots.
fn roots(root_cert: Option<&Path>) -> Result<RootCertStore, ConnectError> {
    let Some(path) = root_cert else {
        return Ok(RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        });
    };
    let bad = |reason: String| ConnectError::RootCert {
        path: path.to_owned(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("the file holds no PEM certificate".to_owned()));
    }
    let mut store = RootCertStore::empty();
    let (_, refused) = store.add_parsable_certificates(certs);
    if store.is_empty() {
        return Err(bad(format!(
            "none of its {refused} certificates could be used as a root"
        )));
    }
    Ok(store)
}

/// What is checked of the server's certificate. Without a chain (`prefer`, and
/// `require` without `sslrootcert`, as libpq has them) nothing is: the handshake's
/// signatures still are, against the certificate the server presents, so the
/// connection is encrypted, but who is at the other end is not proved.
#[derive(Debug)]
struct Verifier {
    provider: Arc<CryptoProvider>,
    chain: Option<Chain>,
}

/// `verify-full`, and `verify-ca` (`check_name` off): the chain is checked against the
/// roots, and with `check_name` the host name too. webpki checks the chain before the
/// name, so a name error means the chain passed. An unknown issuer says which roots
/// were looked in and how to give others.
#[derive(Debug)]
struct Chain {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
    roots: String,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        let checked = chain.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        );
        match checked {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !chain.check_name => Ok(ServerCertVerified::assertion()),
            // As rustls's own error, the sentence would be shown by `Debug`, wrapped.
            Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)) => {
                Err(rustls::Error::Other(rustls::OtherError(Arc::new(
                    UnknownIssuer(chain.roots.clone()),
                ))))
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
