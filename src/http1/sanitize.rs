//! What may enter: request heads that could be read two ways by two parsers (request
//! smuggling), or that don't name one valid host, are refused before anything else looks at
//! them. Paths are [`crate::path`]'s.
//!
//! The HTTP/1 parser already refuses obs-fold, differing duplicate `Content-Length` values,
//! malformed lengths and control bytes in the request line, and answers 431 past the header size
//! limit. These checks cover what it lets through.

use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, Method, Uri, Version};

/// Why a request head is refused; every reason becomes a 400 with a JSON body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    #[error("both Content-Length and Transfer-Encoding are present")]
    LengthAndEncoding,
    #[error("more than one Content-Length header")]
    DuplicateLength,
    #[error("more than one Transfer-Encoding header")]
    DuplicateEncoding,
    #[error("Transfer-Encoding other than \"chunked\" is not accepted")]
    UnsupportedEncoding,
}

/// Checks the framing headers of a request.
pub fn check_head(headers: &HeaderMap) -> Result<(), HeadError> {
    let lengths = headers.get_all(CONTENT_LENGTH).iter().count();
    let encodings: Vec<_> = headers.get_all(TRANSFER_ENCODING).iter().collect();
    if lengths > 0 && !encodings.is_empty() {
        return Err(HeadError::LengthAndEncoding);
    }
    if lengths > 1 {
        return Err(HeadError::DuplicateLength);
    }
    if encodings.len() > 1 {
        return Err(HeadError::DuplicateEncoding);
    }
    if let Some(te) = encodings.first()
        && !te.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked")
    {
        return Err(HeadError::UnsupportedEncoding);
    }
    Ok(())
}

/// The methods of RFC 9110 §9.1 (and PATCH).
static STANDARD_METHODS: [Method; 9] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::OPTIONS,
    Method::PATCH,
    Method::CONNECT,
    Method::TRACE,
];

/// The standard method an extension method spells in another case (`post`, `Get`), if any.
/// Methods are case-sensitive tokens: an upstream that upper-cases them would serve `post` as a
/// POST that no POST route limited.
pub fn miscased_method(m: &Method) -> Option<&'static str> {
    if STANDARD_METHODS.contains(m) {
        return None;
    }
    STANDARD_METHODS
        .iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(m.as_str()))
        .map(Method::as_str)
}

/// Why a request's host is refused; each becomes a 400 (RFC 9112 §3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("an HTTP/1.1 request needs a Host header")]
    Missing,
    #[error("more than one Host header")]
    Duplicate,
    #[error("the Host header is not a host[:port]")]
    Invalid,
    #[error("the Host header and the request's authority differ")]
    Mismatch,
}

/// One valid host per request: exactly one `Host` on HTTP/1.1, at most one on HTTP/1.0, and on
/// HTTP/2 the `:authority`, a `Host`, or both when they agree. It is what `X-Forwarded-Host`
/// tells the upstream, so nothing else may get that far.
pub fn check_host(version: Version, uri: &Uri, headers: &HeaderMap) -> Result<(), HostError> {
    let mut all = headers.get_all(HOST).iter();
    let host = all.next();
    if all.next().is_some() {
        return Err(HostError::Duplicate);
    }
    let valid = |v: &[u8]| {
        if authority(v) {
            Ok(())
        } else {
            Err(HostError::Invalid)
        }
    };
    match (version, host) {
        (Version::HTTP_2 | Version::HTTP_3, _) => match (uri.authority(), host) {
            (None, None) => Err(HostError::Missing),
            (Some(a), None) => valid(a.as_str().as_bytes()),
            (None, Some(h)) => valid(h.as_bytes()),
            (Some(a), Some(h)) => {
                valid(h.as_bytes())?;
                valid(a.as_str().as_bytes())?;
                if a.as_str().as_bytes().eq_ignore_ascii_case(h.as_bytes()) {
                    Ok(())
                } else {
                    Err(HostError::Mismatch)
                }
            }
        },
        (Version::HTTP_11, None) => Err(HostError::Missing),
        (_, None) => Ok(()),
        (_, Some(h)) => valid(h.as_bytes()),
    }
}

/// The bytes of an RFC 3986 reg-name (unreserved, sub-delims, and `%` of pct-encoded), as a
/// table: this runs on every request's `Host`.
static REG_NAME: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b'%'
            );
        c += 1;
    }
    t
};

/// `host[:port]` as RFC 3986 writes an authority without userinfo: a reg-name or IPv4 address,
/// or an IPv6 literal in brackets; a port of 1 to 5 digits up to 65535. An empty host names
/// nothing an upstream could use, so it is refused too.
fn authority(v: &[u8]) -> bool {
    let (host_ok, rest) = if let Some(inner) = v.strip_prefix(b"[") {
        let Some(end) = inner.iter().position(|&c| c == b']') else {
            return false;
        };
        let ip = std::str::from_utf8(&inner[..end]).ok();
        (
            ip.is_some_and(|s| s.parse::<std::net::Ipv6Addr>().is_ok()),
            &inner[end + 1..],
        )
    } else {
        let end = v.iter().position(|&c| c == b':').unwrap_or(v.len());
        let host = &v[..end];
        let reg_name = |c: &u8| REG_NAME[*c as usize];
        (!host.is_empty() && host.iter().all(reg_name), &v[end..])
    };
    let port_ok = match rest {
        [] => true,
        [b':', port @ ..] => {
            !port.is_empty()
                && port.len() <= 5
                && port.iter().all(u8::is_ascii_digit)
                && std::str::from_utf8(port).is_ok_and(|p| p.parse::<u16>().is_ok())
        }
        _ => false,
    };
    host_ok && port_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        for ok in [
            "a",
            "api.example.com",
            "api.example.com:443",
            "127.0.0.1:8080",
            "[::1]",
            "[::1]:80",
            "x_y-z~",
        ] {
            assert!(authority(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "", ":80", "a:", "a:99999", "a:8x", "u@a", "a/b", "a b", "a?b", "a#b", "[::1", "[zz]", "[::1]x",
            "a:80:80",
        ] {
            assert!(!authority(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn one_host_per_request() {
        let uri: Uri = "/v1/x".parse().unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(check_host(Version::HTTP_11, &uri, &h), Err(HostError::Missing));
        assert_eq!(check_host(Version::HTTP_10, &uri, &h), Ok(()));
        h.append(HOST, "a.example".parse().unwrap());
        assert_eq!(check_host(Version::HTTP_11, &uri, &h), Ok(()));
        h.append(HOST, "a.example".parse().unwrap());
        assert_eq!(check_host(Version::HTTP_11, &uri, &h), Err(HostError::Duplicate));
        let mut h = HeaderMap::new();
        h.append(HOST, "user@a.example".parse().unwrap());
        assert_eq!(check_host(Version::HTTP_10, &uri, &h), Err(HostError::Invalid));
        let h2: Uri = "https://A.example/v1/x".parse().unwrap();
        assert_eq!(check_host(Version::HTTP_2, &h2, &HeaderMap::new()), Ok(()));
        assert_eq!(
            check_host(Version::HTTP_2, &uri, &HeaderMap::new()),
            Err(HostError::Missing)
        );
        let mut h = HeaderMap::new();
        h.append(HOST, "a.example".parse().unwrap());
        assert_eq!(check_host(Version::HTTP_2, &h2, &h), Ok(()));
        assert_eq!(check_host(Version::HTTP_2, &uri, &h), Ok(()));
        let mut h = HeaderMap::new();
        h.append(HOST, "b.example".parse().unwrap());
        assert_eq!(check_host(Version::HTTP_2, &h2, &h), Err(HostError::Mismatch));
    }

    #[test]
    fn framing() {
        let mut h = HeaderMap::new();
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&h), Ok(()));
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&h), Err(HeadError::DuplicateLength));
        let mut h = HeaderMap::new();
        h.append(TRANSFER_ENCODING, "gzip, chunked".parse().unwrap());
        assert_eq!(check_head(&h), Err(HeadError::UnsupportedEncoding));
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&h), Err(HeadError::LengthAndEncoding));
    }
}
