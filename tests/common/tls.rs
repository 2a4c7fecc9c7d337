//! A TLS client that trusts the demo certificate, for tests of the gateway's TLS listener.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// A client config that trusts `certs/demo-cert.pem` and offers `alpn`.
pub fn client_config(alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let cert = CertificateDer::from_pem_file(super::repo().join("certs/demo-cert.pem")).unwrap();
    roots.add(cert).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// A TLS connection to `addr` as `localhost`, offering `alpn` (none: an empty slice).
pub async fn connect(
    addr: SocketAddr,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(client_config(alpn));
    connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the demo certificate")
}
