//! TLS for the public listener: rustls with the ring provider, TLS 1.2 and 1.3 only, ALPN h2 then
//! http/1.1. A bad or missing file is an error that names it.

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

#[derive(Debug, thiserror::Error)]
#[error("{file}: {reason}")]
pub struct TlsError {
    pub file: String,
    pub reason: String,
}

/// Builds the acceptor from PEM files.
pub(crate) fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let cert_err = |reason: String| TlsError {
        file: cert.display().to_string(),
        reason,
    };
    let key_err = |reason: String| TlsError {
        file: key.display().to_string(),
        reason,
    };
    if !cert.is_file() {
        return Err(cert_err("certificate file not found".into()));
    }
    if !key.is_file() {
        return Err(key_err("private key file not found".into()));
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| cert_err(format!("cannot read certificates: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| cert_err(format!("not a valid PEM certificate chain: {e}")))?;
    if certs.is_empty() {
        return Err(cert_err("no CERTIFICATE block in the file".into()));
    }
    let private =
        PrivateKeyDer::from_pem_file(key).map_err(|e| key_err(format!("no usable private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| cert_err(format!("TLS setup failed: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|e| key_err(format!("certificate and key don't form a usable pair: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
