//! An `https://` upstream's TLS settings, checked and built when the rules load: a CA file
//! that is missing, not PEM or not a usable root fails the load, never the first request.

use std::sync::{Arc, LazyLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use sha2::{Digest, Sha256};

/// The public web's roots (Mozilla's list, built in), for upstreams whose rules name no CA:
/// the same wherever the gateway runs, whatever the host's certificate store holds.
static WEB_ROOTS: LazyLock<Arc<RootCertStore>> = LazyLock::new(|| {
    Arc::new(RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    })
});

/// How the gateway speaks TLS to one upstream: one client config for all its connections, so
/// sessions resume across them.
#[derive(Clone)]
pub struct UpstreamTls {
    pub config: Arc<ClientConfig>,
    /// The name the upstream's certificate must carry, sent as SNI unless it is an address.
    pub server_name: ServerName<'static>,
    /// The CA file as the rules name it; `None`: the built-in roots.
    pub ca: Option<String>,
    /// The CA file's SHA-256: a reload whose settings are the same keeps the upstream's
    /// connections.
    ca_digest: Option<[u8; 32]>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("ca", &self.ca)
            .finish()
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &UpstreamTls) -> bool {
        self.server_name == other.server_name && self.ca_digest == other.ca_digest
    }
}

impl UpstreamTls {
    /// Settings that trust the certificates of the PEM file `ca` (its bytes `pem`), or the
    /// built-in roots without one. The reason for an error names what is wrong, not where: the
    /// caller adds the file and the field.
    pub fn new(server_name: &str, ca: Option<(&str, &[u8])>) -> Result<UpstreamTls, TlsSettingError> {
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|_| TlsSettingError::ServerName(server_name.to_string()))?;
        let (roots, ca, ca_digest) = match ca {
            None => (WEB_ROOTS.clone(), None, None),
            Some((file, pem)) => {
                let roots = roots_from_pem(pem).map_err(|why| TlsSettingError::Ca {
                    file: file.to_string(),
                    why,
                })?;
                (
                    Arc::new(roots),
                    Some(file.to_string()),
                    Some(Sha256::digest(pem).into()),
                )
            }
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsSettingError::Setup(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // The gateway speaks HTTP/1.1 upstream; an upstream that would pick h2 must not.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(UpstreamTls {
            config: Arc::new(config),
            server_name: name,
            ca,
            ca_digest,
        })
    }
}

/// Why an upstream's TLS settings can't be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsSettingError {
    #[error("{0:?} is not a DNS name or an IP address")]
    ServerName(String),
    #[error("{file}: {why}")]
    Ca { file: String, why: String },
    #[error("TLS setup failed: {0}")]
    Setup(String),
}

/// Every certificate of a PEM file, each a usable root; at least one.
fn roots_from_pem(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
        let cert = cert.map_err(|e| format!("not a valid PEM file: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("certificate {} is not a usable CA certificate: {e}", i + 1))?;
    }
    if roots.is_empty() {
        return Err("no CERTIFICATE block: expected PEM CA certificates".into());
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEMO_CERT: &[u8] = include_bytes!("../../certs/demo-cert.pem");
    const DEMO_KEY: &[u8] = include_bytes!("../../certs/demo-key.pem");

    #[test]
    fn a_pem_root_is_taken_and_other_files_are_refused_with_why() {
        let ok = UpstreamTls::new("localhost", Some(("ca.pem", DEMO_CERT))).unwrap();
        assert_eq!(ok.ca.as_deref(), Some("ca.pem"));
        assert_eq!(ok.config.alpn_protocols, [b"http/1.1".to_vec()]);
        let refused = |pem: &[u8]| match UpstreamTls::new("localhost", Some(("ca.pem", pem))) {
            Err(TlsSettingError::Ca { file, why }) => {
                assert_eq!(file, "ca.pem");
                why
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(
            refused(b"not a certificate\n"),
            "no CERTIFICATE block: expected PEM CA certificates"
        );
        // A key alone is PEM, but no certificate.
        assert_eq!(
            refused(DEMO_KEY),
            "no CERTIFICATE block: expected PEM CA certificates"
        );
        let garbled = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let why = refused(garbled);
        assert!(
            why.starts_with("certificate 1 is not a usable CA certificate"),
            "{why}"
        );
        let cut = &DEMO_CERT[..DEMO_CERT.len() / 2];
        assert!(
            refused(cut).starts_with("not a valid PEM file"),
            "{}",
            refused(cut)
        );
    }

    #[test]
    fn the_server_name_must_be_a_name_or_an_address() {
        assert!(UpstreamTls::new("127.0.0.1", None).is_ok());
        assert!(UpstreamTls::new("::1", None).is_ok());
        assert_eq!(
            UpstreamTls::new("bad name", None).unwrap_err(),
            TlsSettingError::ServerName("bad name".into())
        );
    }

    #[test]
    fn settings_are_the_same_when_their_name_and_ca_file_are() {
        let a = UpstreamTls::new("localhost", Some(("a.pem", DEMO_CERT))).unwrap();
        let b = UpstreamTls::new("localhost", Some(("b.pem", DEMO_CERT))).unwrap();
        assert_eq!(a, b, "the same CA under another name");
        assert_ne!(a, UpstreamTls::new("localhost", None).unwrap());
        assert_ne!(
            a,
            UpstreamTls::new("127.0.0.1", Some(("a.pem", DEMO_CERT))).unwrap()
        );
    }
}
