//! TLS for the public listener: rustls with the ring provider, TLS 1.2 and 1.3 only, ALPN h2 then
//! http/1.1, and each connection's client fingerprint, peeked before rustls reads the hello. A
//! bad or missing file is an error that names it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tollgate_hello::{Fingerprint, Read};

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

/// How long to wait before looking again at a ClientHello that has not all arrived. A peek
/// answers at once while any byte is unread, so it can't wait for the next bytes: the wait is
/// a short sleep, doubling. Most hellos are whole at the first look; the rest, a segment or
/// two later.
const FIRST_WAIT: Duration = Duration::from_millis(1);
const LONGEST_WAIT: Duration = Duration::from_millis(50);
/// The first look's buffer: browsers' hellos, post-quantum key shares included, fit.
const FIRST_LOOK: usize = 2048;

/// The client fingerprint of a TLS connection, from its ClientHello peeked (not read) off the
/// socket, so rustls then reads the same bytes. What this reader can't follow is `unparsed`,
/// and rustls decides the handshake as it would have. The caller bounds the time: a client
/// that sends half a hello and stops is waited for until the handshake timeout, as rustls
/// would wait.
pub(crate) async fn fingerprint(tcp: &TcpStream, peer: SocketAddr) -> Fingerprint {
    let mut buf = vec![0u8; FIRST_LOOK];
    let mut wait = FIRST_WAIT;
    loop {
        let n = match tcp.peek(&mut buf).await {
            Ok(0) | Err(_) => return Fingerprint::Unparsed,
            Ok(n) => n,
        };
        match tollgate_hello::read(&buf[..n]) {
            Read::Hello(hello) => {
                let fp = Fingerprint::of(&hello);
                tracing::debug!(
                    %peer,
                    fingerprint = %fp,
                    hello = %tollgate_hello::fingerprint::canonical(&hello),
                    "client fingerprint"
                );
                return fp;
            }
            Read::Unparsed(why) => {
                tracing::debug!(%peer, reason = %why, "ClientHello not fingerprinted");
                return Fingerprint::Unparsed;
            }
            Read::Partial { needed } => {
                let looked = buf.len();
                // `needed` is bounded by `tollgate_hello::MAX_PEEK`.
                if needed > looked {
                    buf.resize(needed, 0);
                }
                // A full buffer may have more behind it already: look again at once.
                if n < looked {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LONGEST_WAIT);
                }
            }
        }
    }
}
