//! The demo certificate on both ends: a TLS client that trusts it, for tests of the gateway's
//! TLS listener, and a server that shows it, for TLS upstreams.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

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

/// A server config that shows `certs/demo-cert.pem` (its own root) and offers http/1.1.
pub fn server_config() -> Arc<rustls::ServerConfig> {
    let cert = CertificateDer::from_pem_file(super::repo().join("certs/demo-cert.pem")).unwrap();
    let key = PrivateKeyDer::from_pem_file(super::repo().join("certs/demo-key.pem")).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// A blocking TLS server connection over an accepted socket; the handshake happens on its
/// first read or write.
pub type Accepted = rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>;

pub fn accept(tcp: std::net::TcpStream, config: &Arc<rustls::ServerConfig>) -> Accepted {
    rustls::StreamOwned::new(rustls::ServerConnection::new(config.clone()).unwrap(), tcp)
}

/// A rules file's upstream `tls` block trusting the demo certificate, by absolute path.
pub fn demo_ca() -> serde_json::Value {
    serde_json::json!({ "ca": super::repo().join("certs/demo-cert.pem").to_str().unwrap() })
}
