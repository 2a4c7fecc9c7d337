//! What may enter: request heads that could be read two ways by two parsers (request
//! smuggling), or whose path is not clean text, are refused before anything else looks at them.
//!
//! The HTTP/1 parser already refuses obs-fold, differing duplicate `Content-Length` values,
//! malformed lengths and control bytes in the request line, and answers 431 past the header size
//! limit. These checks cover what it lets through.

use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, Uri};

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
    #[error("the path is not valid percent-encoded UTF-8")]
    PathNotUtf8,
    #[error("the path holds a control character")]
    PathControl,
}

/// Checks the framing headers and the path of a request.
pub fn check_head(uri: &Uri, headers: &HeaderMap) -> Result<(), HeadError> {
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
    check_path(uri.path())
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The path, percent-decoded, must be UTF-8 without control characters: `%00`, `%0A` or an
/// overlong `%C0%AF` must not reach an upstream that decodes paths differently.
pub fn check_path(path: &str) -> Result<(), HeadError> {
    let raw = path.as_bytes();
    if !raw.contains(&b'%') {
        // `http` already refused raw bytes outside the URI grammar; nothing to decode.
        return if raw.iter().any(|b| b.is_ascii_control()) {
            Err(HeadError::PathControl)
        } else {
            Ok(())
        };
    }
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let (Some(h), Some(l)) = (
                raw.get(i + 1).copied().and_then(hex),
                raw.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(HeadError::PathNotUtf8);
            };
            decoded.push(h << 4 | l);
            i += 3;
        } else {
            decoded.push(raw[i]);
            i += 1;
        }
    }
    let text = std::str::from_utf8(&decoded).map_err(|_| HeadError::PathNotUtf8)?;
    if text.chars().any(char::is_control) {
        return Err(HeadError::PathControl);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(check_path("/v1/orders"), Ok(()));
        assert_eq!(check_path("/v1/caf%C3%A9"), Ok(()));
        assert_eq!(check_path("/v1/%ff"), Err(HeadError::PathNotUtf8));
        assert_eq!(check_path("/v1/%C0%AF"), Err(HeadError::PathNotUtf8));
        assert_eq!(check_path("/v1/%00"), Err(HeadError::PathControl));
        assert_eq!(check_path("/v1/a%0Ab"), Err(HeadError::PathControl));
        assert_eq!(check_path("/v1/%zz"), Err(HeadError::PathNotUtf8));
        assert_eq!(check_path("/v1/%4"), Err(HeadError::PathNotUtf8));
    }

    #[test]
    fn framing() {
        let uri: Uri = "/v1/x".parse().unwrap();
        let mut h = HeaderMap::new();
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&uri, &h), Ok(()));
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&uri, &h), Err(HeadError::DuplicateLength));
        let mut h = HeaderMap::new();
        h.append(TRANSFER_ENCODING, "gzip, chunked".parse().unwrap());
        assert_eq!(check_head(&uri, &h), Err(HeadError::UnsupportedEncoding));
        h.append(CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_head(&uri, &h), Err(HeadError::LengthAndEncoding));
    }
}
