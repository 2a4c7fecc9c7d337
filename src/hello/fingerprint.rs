//! What names a client's TLS software: the parts of its ClientHello that one client library
//! sends the same on every connection, in a canonical text, hashed to 64 bits.
//!
//! In the manner of JA4 (FoxIO), written anew: the highest protocol version offered, the cipher
//! suites and the extension types sorted (Chrome shuffles its extensions on every connection),
//! the signature schemes and the ALPN names in the client's order (no client shuffles those),
//! GREASE left out everywhere. Also left out, because they change from one connection of the
//! same client to the next: the random, the session id, the server name's value, key shares,
//! and the extensions present only sometimes ([`PER_CONNECTION`]). Unlike JA4 it keeps whole
//! lists, not counts and first-and-last letters; the supported groups are not in it (nor in
//! JA4).

use std::fmt::{self, Write as _};
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::parse::ClientHello;

/// Bytes of the SHA-256 kept: 16 hex digits in logs and bucket names. Telling apart a few
/// thousand client builds needs far fewer than 64 bits; an attacker picking a hello to land in
/// someone else's bucket gains nothing from a collision but a shared limit.
const HASH_BYTES: usize = 8;

/// Extension types a client sends on some connections and not others, left out of the hash.
/// `padding` (0x0015) comes and goes with the hello's length (BoringSSL pads hellos of 256 to
/// 511 bytes), which moves with the server name and a session ticket; `pre_shared_key`
/// (0x0029) and `early_data` (0x002a) come with a resumed session, and `session_ticket`
/// (0x0023) goes or stays with the kind of session held (rustls leaves it out when it resumes
/// a TLS 1.3 session), so a client's second connection would otherwise differ from its first;
/// `cookie` (0x002c) comes only in a hello retried after a HelloRetryRequest.
pub const PER_CONNECTION: [u16; 5] = [0x0015, 0x0023, 0x0029, 0x002a, 0x002c];

/// A connection's client fingerprint, computed once when it is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fingerprint {
    /// Plain TCP: there was no ClientHello.
    #[default]
    None,
    /// TLS whose ClientHello this reader could not follow; rustls decided the handshake.
    Unparsed,
    /// The truncated SHA-256 of [`canonical`].
    Hello([u8; HASH_BYTES]),
}

impl Fingerprint {
    /// The fingerprint of a ClientHello.
    pub fn of(hello: &ClientHello) -> Fingerprint {
        let digest = Sha256::digest(canonical(hello).as_bytes());
        let mut h = [0u8; HASH_BYTES];
        h.copy_from_slice(&digest[..HASH_BYTES]);
        Fingerprint::Hello(h)
    }
}

/// `none`, `unparsed`, or 16 lower-case hex digits: the form of access lines, bucket names and
/// replay traces. None of them needs escaping in a bucket name.
impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fingerprint::None => f.write_str("none"),
            Fingerprint::Unparsed => f.write_str("unparsed"),
            Fingerprint::Hello(h) => h.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

/// Text that is not a fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a client fingerprint: write \"none\" (plain TCP), \"unparsed\", or the 16 lower-case hex digits of an access line's fingerprint"
)]
pub struct BadFingerprint(pub String);

impl FromStr for Fingerprint {
    type Err = BadFingerprint;

    fn from_str(text: &str) -> Result<Fingerprint, BadFingerprint> {
        match text {
            "none" => return Ok(Fingerprint::None),
            "unparsed" => return Ok(Fingerprint::Unparsed),
            _ => {}
        }
        let bad = || BadFingerprint(text.to_string());
        let digits = text.as_bytes();
        if digits.len() != 2 * HASH_BYTES {
            return Err(bad());
        }
        let mut h = [0u8; HASH_BYTES];
        for (out, pair) in h.iter_mut().zip(digits.chunks_exact(2)) {
            *out = (hex_digit(pair[0]).ok_or_else(bad)? << 4) | hex_digit(pair[1]).ok_or_else(bad)?;
        }
        Ok(Fingerprint::Hello(h))
    }
}

/// Lower case only, so one fingerprint has one spelling (and one bucket).
fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// What is hashed, readable as it is: `v=0304 c=1301,1302 e=0000,000a s=0403,0804 a=h2`.
/// The gateway logs it at debug level with the fingerprint, so an operator can tell what a
/// hex fingerprint stands for.
pub fn canonical(h: &ClientHello) -> String {
    let mut out = String::with_capacity(64 + 5 * (h.cipher_suites.len() + h.extensions.len()));
    let _ = write!(out, "v={:04x} c=", h.version());
    let mut suites = h.cipher_suites.clone();
    suites.sort_unstable();
    push_list(&mut out, &suites);
    out.push_str(" e=");
    let mut exts: Vec<u16> = h
        .extensions
        .iter()
        .copied()
        .filter(|t| !PER_CONNECTION.contains(t))
        .collect();
    exts.sort_unstable();
    push_list(&mut out, &exts);
    out.push_str(" s=");
    push_list(&mut out, &h.signature_schemes);
    out.push_str(" a=");
    for (i, name) in h.alpn.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Escaped so that no two lists of names read the same (a name may hold a comma).
        for &b in name {
            if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'/' | b'_' | b'-') {
                out.push(b as char);
            } else {
                let _ = write!(out, "%{b:02x}");
            }
        }
    }
    out
}

fn push_list(out: &mut String, vals: &[u16]) {
    for (i, v) in vals.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{v:04x}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::tests::{Hello, alpn_ext, sigs_ext, versions_ext};
    use crate::parse::{Read, read};
    use proptest::prelude::*;

    fn fp(h: &Hello) -> Fingerprint {
        match read(&h.bytes()) {
            Read::Hello(h) => Fingerprint::of(&h),
            other => panic!("not a hello: {other:?}"),
        }
    }

    #[test]
    fn the_canonical_form_reads_as_documented() {
        let Read::Hello(h) = read(&Hello::browser().bytes()) else {
            panic!()
        };
        assert_eq!(
            canonical(&h),
            "v=0304 c=1301,1302,1303,c02b,c02f e=0000,000a,000d,0010,002b,0033 s=0403,0804,0401 a=h2,http/1.1"
        );
    }

    #[test]
    fn what_varies_per_connection_is_left_out() {
        let base = fp(&Hello::browser());
        let mut h = Hello::browser();
        h.suites.insert(1, 0x3a3a);
        h.extensions.insert(2, (0x4a4a, vec![0]));
        h.extensions.push((0x0015, vec![0; 100]));
        h.extensions.push((0x0029, vec![1, 2, 3]));
        h.extensions.push((0x0023, vec![]));
        h.extensions[0].1 = b"\x00\x0c\x0bexample.net".to_vec();
        assert_eq!(
            fp(&h),
            base,
            "GREASE, padding, a PSK, a session ticket and the server name's value"
        );
    }

    #[test]
    fn shuffled_suites_and_extensions_are_one_client() {
        let base = fp(&Hello::browser());
        let mut h = Hello::browser();
        h.suites.reverse();
        h.extensions.reverse();
        assert_eq!(fp(&h), base);
    }

    #[test]
    fn what_names_the_software_changes_it() {
        let base = fp(&Hello::browser());
        type Change = Box<dyn Fn(&mut Hello)>;
        let changes: Vec<(&str, Change)> = vec![
            (
                "a suite fewer",
                Box::new(|h| {
                    h.suites.pop();
                }),
            ),
            (
                "TLS 1.2 at most",
                Box::new(|h| h.extensions[4] = versions_ext(&[0x0303])),
            ),
            (
                "another ALPN",
                Box::new(|h| h.extensions[3] = alpn_ext(&[b"http/1.1"])),
            ),
            (
                "ALPN order",
                Box::new(|h| h.extensions[3] = alpn_ext(&[b"http/1.1", b"h2"])),
            ),
            (
                "scheme order",
                Box::new(|h| h.extensions[2] = sigs_ext(&[0x0804, 0x0403, 0x0401])),
            ),
            (
                "no server name",
                Box::new(|h| {
                    h.extensions.remove(0);
                }),
            ),
            (
                "an extension more",
                Box::new(|h| h.extensions.push((0x0017, vec![]))),
            ),
        ];
        for (what, change) in changes {
            let mut h = Hello::browser();
            change(&mut h);
            assert_ne!(fp(&h), base, "{what}");
        }
        // A comma inside a name is not a second name.
        let mut one = Hello::browser();
        one.extensions[3] = alpn_ext(&[b"a,b"]);
        let mut two = Hello::browser();
        two.extensions[3] = alpn_ext(&[b"a", b"b"]);
        assert_ne!(fp(&one), fp(&two));
    }

    #[test]
    fn text_forms_parse_back_and_bad_text_is_named() {
        let f = fp(&Hello::browser());
        let text = f.to_string();
        assert_eq!(text.len(), 16);
        assert_eq!(text.parse::<Fingerprint>(), Ok(f));
        assert_eq!("none".parse::<Fingerprint>(), Ok(Fingerprint::None));
        assert_eq!("unparsed".parse::<Fingerprint>(), Ok(Fingerprint::Unparsed));
        for bad in [
            "",
            "NONE",
            "0123456789ABCDEF",
            "0123456789abcde",
            "0123456789abcdefa",
            "ÿ123456789abcde",
        ] {
            let e = bad.parse::<Fingerprint>().unwrap_err();
            assert!(e.to_string().contains("not a client fingerprint"), "{e}");
        }
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused(text in ".{0,20}") {
            if let Ok(f) = text.parse::<Fingerprint>() {
                prop_assert_eq!(f.to_string(), text);
            }
        }
    }

    /// Real hellos from rustls, made in memory: one configuration gives one fingerprint, a
    /// resumed session included; another gives another.
    mod rustls_hellos {
        use super::*;
        use std::sync::Arc;

        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

        const CERT: &[u8] = include_bytes!("../../certs/demo-cert.pem");
        const KEY: &[u8] = include_bytes!("../../certs/demo-key.pem");

        fn provider() -> Arc<rustls::crypto::CryptoProvider> {
            Arc::new(rustls::crypto::aws_lc_rs::default_provider())
        }

        fn client(alpn: &[&[u8]], tls12_only: bool) -> Arc<rustls::ClientConfig> {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(CertificateDer::from_pem_slice(CERT).unwrap()).unwrap();
            let versions: &[&rustls::SupportedProtocolVersion] = if tls12_only {
                &[&rustls::version::TLS12]
            } else {
                &[&rustls::version::TLS13, &rustls::version::TLS12]
            };
            let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(versions)
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Arc::new(cfg)
        }

        fn server() -> Arc<rustls::ServerConfig> {
            let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![CertificateDer::from_pem_slice(CERT).unwrap()],
                    PrivateKeyDer::from_pem_slice(KEY).unwrap(),
                )
                .unwrap();
            cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            Arc::new(cfg)
        }

        /// Runs a whole handshake in memory and returns the client's first flight.
        fn connect(cfg: &Arc<rustls::ClientConfig>) -> Vec<u8> {
            let name = ServerName::try_from("localhost").unwrap();
            let mut c = rustls::ClientConnection::new(cfg.clone(), name).unwrap();
            let mut s = rustls::ServerConnection::new(server()).unwrap();
            let mut first = Vec::new();
            c.write_tls(&mut first).unwrap();
            let mut to_server = first.clone();
            for _ in 0..10 {
                let mut rd = &to_server[..];
                while !rd.is_empty() {
                    s.read_tls(&mut rd).unwrap();
                    s.process_new_packets().unwrap();
                }
                let mut to_client = Vec::new();
                while s.wants_write() {
                    s.write_tls(&mut to_client).unwrap();
                }
                let mut rd = &to_client[..];
                while !rd.is_empty() {
                    c.read_tls(&mut rd).unwrap();
                    c.process_new_packets().unwrap();
                }
                to_server.clear();
                while c.wants_write() {
                    c.write_tls(&mut to_server).unwrap();
                }
                if !c.is_handshaking() && !s.is_handshaking() && to_server.is_empty() {
                    break;
                }
            }
            assert!(!c.is_handshaking(), "the in-memory handshake finished");
            first
        }

        fn fingerprint(bytes: &[u8]) -> Fingerprint {
            match read(bytes) {
                Read::Hello(h) => Fingerprint::of(&h),
                other => panic!("rustls' hello not read: {other:?}"),
            }
        }

        #[test]
        fn one_configuration_is_one_fingerprint_across_resumption() {
            let cfg = client(&[b"h2", b"http/1.1"], false);
            let first = connect(&cfg);
            // The second connection resumes with the ticket of the first: a pre_shared_key.
            let second = connect(&cfg);
            let (Read::Hello(a), Read::Hello(b)) = (read(&first), read(&second)) else {
                panic!("rustls' hellos not read")
            };
            assert!(b.extensions.contains(&0x0029), "the second hello resumes: {b:?}");
            assert!(!a.extensions.contains(&0x0029));
            assert_eq!(
                Fingerprint::of(&a),
                Fingerprint::of(&b),
                "{}\n{}",
                canonical(&a),
                canonical(&b)
            );
            assert_eq!(a.version(), 0x0304);
        }

        #[test]
        fn other_configurations_are_other_fingerprints() {
            let base = fingerprint(&connect(&client(&[b"h2", b"http/1.1"], false)));
            let alpn = fingerprint(&connect(&client(&[b"http/1.1"], false)));
            let tls12 = fingerprint(&connect(&client(&[b"h2", b"http/1.1"], true)));
            assert_ne!(base, alpn);
            assert_ne!(base, tls12);
            assert_ne!(alpn, tls12);
        }
    }
}
