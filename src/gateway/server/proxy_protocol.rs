//! The PROXY protocol (v1 text and v2 binary, as HAProxy specifies them) on the public
//! listener, for a gateway behind an L4 load balancer (AWS NLB, HAProxy in TCP mode) whose
//! connections would otherwise all come from the balancer. From a `--trusted-proxy` peer the
//! header is required and its source address is the client's; from anyone else a header is
//! refused, and a connection without one is served as its peer. The header is read before TLS,
//! exactly: not a byte of what follows it is consumed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;
use tollgate_rules::identity::TrustedProxies;

/// v2's twelve-byte signature.
const SIG: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// v1's first bytes.
const V1: &[u8; 6] = b"PROXY ";
/// The longest v1 line, its CRLF included.
const V1_MAX: usize = 107;
/// What a peek reads: a v1 line, or v2's fixed part and a TCP over IPv6 address block.
const PEEK: usize = 128;

/// What the bytes a connection starts with say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// Too few bytes to tell yet.
    NeedMore,
    /// Not a PROXY header: HTTP, or a TLS ClientHello.
    NotProxy,
    /// A header of `len` bytes; `source` is the client, or `None` for one that names no address
    /// (v2 `LOCAL`, v1 `UNKNOWN`, a family that is not TCP): the peer is then the client.
    Header { len: usize, source: Option<SocketAddr> },
    /// A header that breaks the protocol: the connection is closed.
    Bad(&'static str),
}

/// Reads the start of a connection.
pub(crate) fn parse(buf: &[u8]) -> Parsed {
    if buf.first() == Some(&SIG[0]) {
        return v2(buf);
    }
    if buf.first() == Some(&V1[0]) {
        return v1(buf);
    }
    if buf.is_empty() {
        Parsed::NeedMore
    } else {
        Parsed::NotProxy
    }
}

fn v1(buf: &[u8]) -> Parsed {
    let n = buf.len().min(V1.len());
    if buf[..n] != V1[..n] {
        return Parsed::NotProxy;
    }
    let Some(end) = buf.windows(2).take(V1_MAX - 1).position(|w| w == b"\r\n") else {
        return if buf.len() >= V1_MAX {
            Parsed::Bad("v1_too_long")
        } else {
            Parsed::NeedMore
        };
    };
    let len = end + 2;
    let Ok(line) = std::str::from_utf8(&buf[V1.len()..end]) else {
        return Parsed::Bad("v1_malformed");
    };
    let parts: Vec<&str> = line.split(' ').collect();
    let source = match parts.as_slice() {
        ["UNKNOWN", ..] => None,
        [fam @ ("TCP4" | "TCP6"), src, dst, sport, dport] => {
            let (Ok(src), Ok(dst)) = (src.parse::<IpAddr>(), dst.parse::<IpAddr>()) else {
                return Parsed::Bad("v1_malformed");
            };
            let v4 = *fam == "TCP4";
            if src.is_ipv4() != v4 || dst.is_ipv4() != v4 {
                return Parsed::Bad("family_mismatch");
            }
            let port = |p: &str| p.parse::<u16>().ok().filter(|_| !p.starts_with('0') || p == "0");
            let (Some(sport), Some(_)) = (port(sport), port(dport)) else {
                return Parsed::Bad("v1_malformed");
            };
            Some(SocketAddr::new(src, sport))
        }
        _ => return Parsed::Bad("v1_malformed"),
    };
    Parsed::Header { len, source }
}

fn v2(buf: &[u8]) -> Parsed {
    let n = buf.len().min(SIG.len());
    if buf[..n] != SIG[..n] {
        return Parsed::NotProxy;
    }
    if buf.len() < 16 {
        return Parsed::NeedMore;
    }
    let (ver, cmd, fam) = (buf[12] >> 4, buf[12] & 0x0f, buf[13]);
    let len = 16 + usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    if ver != 2 {
        return Parsed::Bad("v2_version");
    }
    let local = match cmd {
        0 => true,
        1 => false,
        _ => return Parsed::Bad("v2_command"),
    };
    // The address block, as far as the family needs it: TCP over IPv4 or IPv6.
    let need = match fam {
        0x11 => 12,
        0x21 => 36,
        // UDP is not this listener's; UNSPEC and UNIX name no address to use.
        0x12 | 0x22 => return Parsed::Bad("v2_not_stream"),
        _ => 0,
    };
    if len - 16 < need {
        return Parsed::Bad("family_mismatch");
    }
    if buf.len() < 16 + need {
        return Parsed::NeedMore;
    }
    let a = &buf[16..];
    let source = match (local, fam) {
        (true, _) | (false, 0x00 | 0x31 | 0x32) => None,
        (false, 0x11) => Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3])),
            u16::from_be_bytes([a[8], a[9]]),
        )),
        (false, 0x21) => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&a[..16]);
            Some(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(ip)),
                u16::from_be_bytes([a[32], a[33]]),
            ))
        }
        _ => return Parsed::Bad("v2_family"),
    };
    Parsed::Header { len, source }
}

/// Why a connection was closed before anything was served, for the metric's `reason`.
pub(crate) type Refused = &'static str;

/// Reads the connection's PROXY header, if it must or may have one, and returns the client's
/// address: the header's source from a trusted peer, the peer otherwise. A trusted peer's
/// connection without a header, anyone else's with one, a header that breaks the protocol, and
/// one not complete within `within` are refused.
pub(crate) async fn take(
    tcp: &mut TcpStream,
    peer: SocketAddr,
    trusted: &TrustedProxies,
    within: Duration,
) -> Result<SocketAddr, Refused> {
    // One deadline for the whole header: a v2 header may declare up to 64 KiB past its first
    // bytes, and a client that declares them and sends nothing must not hold the connection.
    tokio::time::timeout(within, read_header(tcp, peer, trusted))
        .await
        .map_err(|_| "timeout")?
}

async fn read_header(
    tcp: &mut TcpStream,
    peer: SocketAddr,
    trusted: &TrustedProxies,
) -> Result<SocketAddr, Refused> {
    let from_proxy = trusted.contains(tollgate_rules::identity::canonical(peer.ip()));
    let parsed = peek_header(tcp).await?;
    match (parsed, from_proxy) {
        (Parsed::Header { len, source }, true) => {
            // Consumed, TLVs and all, without keeping a copy: only its source was wanted.
            let mut header = tokio::io::AsyncReadExt::take(&mut *tcp, len as u64);
            let read = tokio::io::copy(&mut header, &mut tokio::io::sink())
                .await
                .map_err(|_| "truncated")?;
            if read != len as u64 {
                return Err("truncated");
            }
            Ok(source.unwrap_or(peer))
        }
        (Parsed::NotProxy, true) => Err("missing"),
        (Parsed::NotProxy, false) => Ok(peer),
        (Parsed::Header { .. }, false) => Err("untrusted"),
        (Parsed::Bad(why), _) => Err(why),
        // `peek_header` returns only once it can tell.
        (Parsed::NeedMore, _) => Err("truncated"),
    }
}

/// Peeks until the start of the connection says what it is. A balancer sends its header in
/// one segment, so the first peek nearly always tells; a header split across segments is
/// peeked again after a millisecond.
async fn peek_header(tcp: &TcpStream) -> Result<Parsed, Refused> {
    let mut buf = [0u8; PEEK];
    let mut seen = 0;
    loop {
        let n = tcp.peek(&mut buf).await.map_err(|_| "truncated")?;
        if n == 0 {
            return Err("truncated");
        }
        match parse(&buf[..n]) {
            Parsed::NeedMore if n < PEEK => {}
            Parsed::NeedMore => return Ok(Parsed::Bad("v1_too_long")),
            done => return Ok(done),
        }
        if n == seen {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2_header(cmd: u8, fam: u8, addr: &[u8]) -> Vec<u8> {
        let mut h = SIG.to_vec();
        h.push(0x20 | cmd);
        h.push(fam);
        h.extend((addr.len() as u16).to_be_bytes());
        h.extend(addr);
        h
    }

    #[test]
    fn v1_lines_name_the_client() {
        let line = b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\nGET / HTTP/1.1\r\n";
        assert_eq!(
            parse(line),
            Parsed::Header {
                len: 43,
                source: Some("203.0.113.7:51234".parse().unwrap())
            }
        );
        let six = b"PROXY TCP6 2001:db8::7 2001:db8::1 51234 443\r\n";
        assert_eq!(
            parse(six),
            Parsed::Header {
                len: six.len(),
                source: Some("[2001:db8::7]:51234".parse().unwrap())
            }
        );
        assert_eq!(
            parse(b"PROXY UNKNOWN\r\n"),
            Parsed::Header {
                len: 15,
                source: None
            }
        );
        assert_eq!(parse(b"PROXY TCP4 203.0"), Parsed::NeedMore);
        assert_eq!(parse(b"PRO"), Parsed::NeedMore);
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Parsed::NotProxy);
        assert_eq!(parse(b"POST / HTTP/1.1\r\n"), Parsed::NotProxy);
        assert_eq!(parse(&[0x16, 0x03, 0x01]), Parsed::NotProxy);
    }

    #[test]
    fn v1_faults_are_named() {
        assert_eq!(
            parse(b"PROXY TCP4 2001:db8::7 10.0.0.1 1 2\r\n"),
            Parsed::Bad("family_mismatch")
        );
        assert_eq!(
            parse(b"PROXY TCP4 1.2.3.4 5.6.7.8 99999 2\r\n"),
            Parsed::Bad("v1_malformed")
        );
        assert_eq!(parse(b"PROXY TCP4 1.2.3.4\r\n"), Parsed::Bad("v1_malformed"));
        let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 120]].concat();
        assert_eq!(parse(&long), Parsed::Bad("v1_too_long"));
    }

    #[test]
    fn v2_headers_name_the_client() {
        let addr4 = [203, 0, 113, 7, 10, 0, 0, 1, 0xc8, 0x22, 0x01, 0xbb];
        let h = v2_header(1, 0x11, &addr4);
        assert_eq!(
            parse(&h),
            Parsed::Header {
                len: 28,
                source: Some("203.0.113.7:51234".parse().unwrap())
            }
        );
        // TLVs after the addresses are part of the header, skipped whole.
        let mut with_tlv = addr4.to_vec();
        with_tlv.extend([0x04, 0x00, 0x02, b'x', b'y']);
        assert!(matches!(
            parse(&v2_header(1, 0x11, &with_tlv)),
            Parsed::Header { len: 33, .. }
        ));
        let mut addr6 = vec![0u8; 36];
        addr6[..16].copy_from_slice(&"2001:db8::7".parse::<Ipv6Addr>().unwrap().octets());
        addr6[32..34].copy_from_slice(&51234u16.to_be_bytes());
        assert_eq!(
            parse(&v2_header(1, 0x21, &addr6)),
            Parsed::Header {
                len: 52,
                source: Some("[2001:db8::7]:51234".parse().unwrap())
            }
        );
        // LOCAL: the balancer's own health check; the peer is the client.
        assert_eq!(
            parse(&v2_header(0, 0x00, &[])),
            Parsed::Header {
                len: 16,
                source: None
            }
        );
        assert_eq!(parse(&h[..10]), Parsed::NeedMore);
        assert_eq!(parse(&h[..20]), Parsed::NeedMore);
    }

    #[test]
    fn v2_faults_are_named() {
        let mut h = v2_header(1, 0x11, &[1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 0, 2]);
        h[12] = 0x11;
        assert_eq!(parse(&h), Parsed::Bad("v2_version"));
        assert_eq!(parse(&v2_header(2, 0x11, &[0; 12])), Parsed::Bad("v2_command"));
        // TCP over IPv6 in an IPv4-sized block.
        assert_eq!(
            parse(&v2_header(1, 0x21, &[0; 12])),
            Parsed::Bad("family_mismatch")
        );
        assert_eq!(parse(&v2_header(1, 0x12, &[0; 12])), Parsed::Bad("v2_not_stream"));
        let mut wrong = SIG.to_vec();
        wrong[5] = b'X';
        assert_eq!(parse(&wrong), Parsed::NotProxy);
    }
}
