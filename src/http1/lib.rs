//! The gateway's one HTTP/1 vocabulary, shared by the smuggling watcher, the express lane and the
//! proxy: request targets in canonical form, chunked bodies, upstream response heads,
//! `Connection` tokens, which methods may be sent twice, the method override headers
//! (`method_override`), and which request heads are refused
//! before anything reads them (`sanitize`). Anything that reads HTTP/1 bytes
//! itself reads them with these.

pub mod chunked;
pub mod method_override;
pub mod path;
pub mod response;
pub mod sanitize;

use http::header::{self, HeaderName};

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), so a proxy never
/// forwards them, in either direction.
pub static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Whether a header name (raw bytes, any case) is hop-by-hop.
pub(crate) fn hop_by_hop(name: &[u8]) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
}

/// The tokens of one `Connection` header value, trimmed, empty ones skipped.
pub fn connection_tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&c| c == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a byte may be part of a token (RFC 9110 §5.6.2): a header's name, a protocol's.
pub fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The protocols an HTTP/1.1 request offers to upgrade its connection to, in its order of
/// preference: the `Upgrade` header's, when `Connection` names `upgrade` too (RFC 9110 §7.8;
/// an `Upgrade` that `Connection` does not name was not meant for this hop). Empty for any
/// other request.
pub fn upgrade_offered(headers: &http::HeaderMap) -> impl Iterator<Item = &[u8]> {
    let asked = headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| connection_tokens(v.as_bytes()).any(|t| t.eq_ignore_ascii_case(b"upgrade")));
    headers
        .get_all(header::UPGRADE)
        .iter()
        .filter(move |_| asked)
        .flat_map(|v| connection_tokens(v.as_bytes()))
}

/// Whether a request with this method may be sent again when its first attempt may have
/// reached the upstream (RFC 9110 §9.2.2).
pub fn idempotent(m: &http::Method) -> bool {
    matches!(
        *m,
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::DELETE
            | http::Method::PUT
    )
}

/// Whether the last transfer coding of a `Transfer-Encoding` value is `chunked`.
pub(crate) fn chunked_last(value: &[u8]) -> bool {
    value
        .rsplit(|&c| c == b',')
        .next()
        .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_codings() {
        let t: Vec<&[u8]> = connection_tokens(b" keep-alive, ,X-Hop ").collect();
        assert_eq!(t, vec![&b"keep-alive"[..], b"X-Hop"]);
        assert!(chunked_last(b"gzip, Chunked "));
        assert!(!chunked_last(b"chunked, gzip"));
        assert!(idempotent(&http::Method::PUT) && !idempotent(&http::Method::POST));
    }

    #[test]
    fn an_upgrade_is_offered_only_with_connection_naming_it() {
        let mut h = http::HeaderMap::new();
        h.insert(header::UPGRADE, "websocket, foo/2".parse().unwrap());
        assert_eq!(upgrade_offered(&h).count(), 0);
        h.insert(header::CONNECTION, "keep-alive, Upgrade".parse().unwrap());
        let offered: Vec<&[u8]> = upgrade_offered(&h).collect();
        assert_eq!(offered, vec![&b"websocket"[..], b"foo/2"]);
        assert!(is_tchar(b'~') && !is_tchar(b'/') && !is_tchar(b' '));
    }
}
