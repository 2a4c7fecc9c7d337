//! TLS for the public listener: rustls with the aws-lc-rs provider, TLS 1.2 and 1.3 only, ALPN h2 then
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
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A ClientHello record with a `padding` extension of `pad` bytes, to make it as long as
    /// a test needs (padding is left out of the fingerprint, so any length names one client).
    fn hello(pad: usize) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 4, 0x13, 0x01, 0x13, 0x02, 1, 0]);
        let mut exts = vec![0x00, 0x15];
        exts.extend_from_slice(&(pad as u16).to_be_bytes());
        exts.resize(exts.len() + pad, 0);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend(exts);
        let mut msg = vec![1];
        msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        msg.extend(body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        rec.extend(msg);
        rec
    }

    fn expected(bytes: &[u8]) -> Fingerprint {
        match tollgate_hello::read(bytes) {
            Read::Hello(h) => Fingerprint::of(&h),
            other => panic!("{other:?}"),
        }
    }

    /// Sends `parts` with a pause between them; returns the fingerprint the server side saw
    /// and every byte it then read, which must be all that was sent.
    async fn peek(parts: Vec<Vec<u8>>) -> (Fingerprint, Vec<u8>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            for p in parts {
                c.write_all(&p).await.unwrap();
                c.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        });
        let (mut tcp, peer) = l.accept().await.unwrap();
        let fp = tokio::time::timeout(Duration::from_secs(5), fingerprint(&tcp, peer))
            .await
            .expect("the peek ends");
        client.await.unwrap();
        let mut read = Vec::new();
        tcp.read_to_end(&mut read).await.unwrap();
        (fp, read)
    }

    #[tokio::test]
    async fn a_hello_in_pieces_and_longer_than_the_first_look_is_peeked_whole() {
        let big = hello(6000);
        assert!(big.len() > FIRST_LOOK);
        let (a, b) = big.split_at(700);
        let (b, c) = b.split_at(3000);
        let (fp, read) = peek(vec![a.to_vec(), b.to_vec(), c.to_vec()]).await;
        assert_eq!(fp, expected(&big));
        assert_eq!(read, big, "nothing was consumed: rustls reads the same bytes");
    }

    #[tokio::test]
    async fn what_is_not_a_whole_hello_is_unparsed() {
        let (fp, read) = peek(vec![b"GET / HTTP/1.1\r\n\r\n".to_vec()]).await;
        assert_eq!(
            (fp, &read[..]),
            (Fingerprint::Unparsed, &b"GET / HTTP/1.1\r\n\r\n"[..])
        );
        // A client that closes before sending anything.
        assert_eq!(peek(vec![]).await.0, Fingerprint::Unparsed);
    }
}
