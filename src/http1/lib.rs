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
}
