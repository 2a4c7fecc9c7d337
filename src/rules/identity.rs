//! Who is calling: the API key from `Authorization: Bearer` or `X-API-Key`, and the client IP
//! (the peer, or `X-Forwarded-For` only when the peer is a trusted proxy).

use std::net::IpAddr;
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
