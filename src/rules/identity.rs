//! Who is calling: the API key from `Authorization: Bearer` or `X-API-Key`, and the client IP
//! (the peer, or `X-Forwarded-For` only when the peer is a trusted proxy).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use http::HeaderMap;
use http::header::AUTHORIZATION;
use ipnet::IpNet;

pub const X_API_KEY: &str = "x-api-key";

/// Why the credentials of a request can't be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialError {
    #[error("Authorization and X-API-Key carry different keys")]
    Conflict,
    #[error("more than one {0} header")]
    Repeated(&'static str),
}

/// Where the presented key came from; the proxy strips that header before forwarding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    Bearer,
    ApiKeyHeader,
    Both,
}

/// The presented secret, if any.
pub fn credential(headers: &HeaderMap) -> Result<Option<(&[u8], KeySource)>, CredentialError> {
    let mut bearer = None;
    let mut auths = headers.get_all(AUTHORIZATION).iter();
    if let Some(v) = auths.next() {
        if auths.next().is_some() {
            return Err(CredentialError::Repeated("Authorization"));
        }
        let b = v.as_bytes();
        if b.len() > 7 && b[..7].eq_ignore_ascii_case(b"bearer ") {
            let token = trim(&b[7..]);
            if !token.is_empty() {
                bearer = Some(token);
            }
        }
    }
    let mut apikeys = headers.get_all(X_API_KEY).iter();
    let header = match apikeys.next() {
        Some(v) => {
            if apikeys.next().is_some() {
                return Err(CredentialError::Repeated("X-API-Key"));
            }
            let t = trim(v.as_bytes());
            (!t.is_empty()).then_some(t)
        }
        None => None,
    };
    match (bearer, header) {
        (Some(a), Some(b)) if a != b => Err(CredentialError::Conflict),
        (Some(a), Some(_)) => Ok(Some((a, KeySource::Both))),
        (Some(a), None) => Ok(Some((a, KeySource::Bearer))),
        (None, Some(b)) => Ok(Some((b, KeySource::ApiKeyHeader))),
        (None, None) => Ok(None),
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

/// Networks whose `X-Forwarded-For` we believe.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    pub fn new(nets: Vec<IpNet>) -> TrustedProxies {
        TrustedProxies(nets)
    }

    /// Parses `10.0.0.0/8`, `192.168.1.7` or `::1` (a bare address is a /32 or /128).
    pub fn parse(items: &[String]) -> Result<TrustedProxies, String> {
        let mut nets = Vec::new();
        for item in items
            .iter()
            .flat_map(|s| s.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let net = IpNet::from_str(item)
                .or_else(|_| IpAddr::from_str(item).map(IpNet::from))
                .map_err(|_| format!("--trusted-proxy: {item:?} is neither an address nor a CIDR network"))?;
            nets.push(net);
        }
        Ok(TrustedProxies(nets))
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(&ip))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// IPv4 clients of a dual-stack socket arrive as `::ffff:a.b.c.d`; key them as IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// How much of a client's address names one client in per-IP buckets. One host or household
/// gets a whole IPv6 /64, so keying IPv6 on the full address would let it walk through
/// 2^64 buckets; IPv4 stays per address unless a limit says otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpPrefixes {
    /// Leading bits of an IPv4 address, 0 to 32.
    pub v4: u8,
    /// Leading bits of an IPv6 address, 0 to 128.
    pub v6: u8,
}

impl IpPrefixes {
    pub const V4_DEFAULT: u8 = 32;
    pub const V6_DEFAULT: u8 = 64;
}

impl Default for IpPrefixes {
    fn default() -> IpPrefixes {
        IpPrefixes {
            v4: IpPrefixes::V4_DEFAULT,
            v6: IpPrefixes::V6_DEFAULT,
        }
    }
}

/// The network a client's address falls in, and its prefix length; the length is `None` for
/// a full-length prefix, so those buckets keep the names they had before prefixes. An
/// IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) counts as IPv4.
pub fn client_network(ip: IpAddr, prefixes: IpPrefixes) -> (IpAddr, Option<u8>) {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            let len = prefixes.v4.min(32);
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            let net = Ipv4Addr::from(u32::from(v4) & mask);
            (IpAddr::V4(net), (len < 32).then_some(len))
        }
        IpAddr::V6(v6) => {
            let len = prefixes.v6.min(128);
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            let net = Ipv6Addr::from(u128::from(v6) & mask);
            (IpAddr::V6(net), (len < 128).then_some(len))
        }
    }
}

/// The client's address. `X-Forwarded-For` counts only when the peer is trusted; then the
/// rightmost address that is not itself a trusted proxy is the client.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &TrustedProxies) -> IpAddr {
    let peer = canonical(peer);
    if trusted.is_empty() || !trusted.contains(peer) {
        return peer;
    }
    let mut client = peer;
    let hops = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for hop in hops.iter().rev() {
        let Ok(ip) = IpAddr::from_str(hop) else { break };
        client = canonical(ip);
        if !trusted.contains(client) {
            break;
        }
    }
    client
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn reads_either_header_and_refuses_disagreement() {
        assert_eq!(
            credential(&headers(&[("authorization", "Bearer abc")])).unwrap(),
            Some((&b"abc"[..], KeySource::Bearer))
        );
        assert_eq!(
            credential(&headers(&[("x-api-key", "abc")])).unwrap(),
            Some((&b"abc"[..], KeySource::ApiKeyHeader))
        );
        assert_eq!(
            credential(&headers(&[("authorization", "Basic Zm9v")])).unwrap(),
            None
        );
        assert_eq!(
            credential(&headers(&[("authorization", "bearer abc"), ("x-api-key", "abd")])),
            Err(CredentialError::Conflict)
        );
    }

    fn network(ip: &str, v4: u8, v6: u8) -> String {
        match client_network(ip.parse().unwrap(), IpPrefixes { v4, v6 }) {
            (net, Some(len)) => format!("{net}/{len}"),
            (net, None) => net.to_string(),
        }
    }

    #[test]
    fn ipv6_clients_are_keyed_on_their_prefix_and_ipv4_on_the_address() {
        let d = IpPrefixes::default();
        assert_eq!((d.v4, d.v6), (32, 64));
        assert_eq!(
            network("2001:db8:1:2:aaaa:bbbb:cccc:dddd", 32, 64),
            "2001:db8:1:2::/64"
        );
        assert_eq!(network("2001:db8:1:2::1", 32, 64), "2001:db8:1:2::/64");
        assert_eq!(network("2001:db8:1:3::1", 32, 64), "2001:db8:1:3::/64");
        assert_eq!(network("2001:db8:1:2:ffff::1", 32, 56), "2001:db8:1::/56");
        assert_eq!(network("2001:db8:1:2:ffff::1", 32, 48), "2001:db8:1::/48");
        assert_eq!(network("2001:db8:1:2:ffff::1", 32, 1), "::/1");
        assert_eq!(network("a001:db8::1", 32, 1), "8000::/1");
        assert_eq!(network("2001:db8::1", 32, 0), "::/0");
        // A full-length prefix names the address as before, without "/128" or "/32".
        assert_eq!(network("2001:db8::1", 32, 128), "2001:db8::1");
        assert_eq!(network("2001:db8::1", 32, 127), "2001:db8::/127");
        assert_eq!(network("203.0.113.77", 32, 64), "203.0.113.77");
        assert_eq!(network("10.1.200.7", 16, 64), "10.1.0.0/16");
        assert_eq!(network("10.1.200.7", 24, 64), "10.1.200.0/24");
        assert_eq!(network("10.1.200.7", 31, 64), "10.1.200.6/31");
        assert_eq!(network("10.1.200.7", 0, 64), "0.0.0.0/0");
        // An IPv4-mapped address is IPv4: its v4 prefix, never the v6 one.
        assert_eq!(network("::ffff:203.0.113.77", 32, 64), "203.0.113.77");
        assert_eq!(network("::ffff:10.1.200.7", 16, 64), "10.1.0.0/16");
    }

    #[test]
    fn forwarded_for_only_from_trusted_peers() {
        let trusted = TrustedProxies::parse(&["10.0.0.0/8".into()]).unwrap();
        let h = headers(&[("x-forwarded-for", "203.0.113.9, 10.1.1.1")]);
        let peer: IpAddr = "10.2.2.2".parse().unwrap();
        assert_eq!(
            client_ip(peer, &h, &trusted),
            "203.0.113.9".parse::<IpAddr>().unwrap()
        );
        let stranger: IpAddr = "198.51.100.4".parse().unwrap();
        assert_eq!(client_ip(stranger, &h, &trusted), stranger);
        assert_eq!(client_ip(peer, &h, &TrustedProxies::default()), peer);
    }
}
