//! Request paths in canonical form: the one spelling the gateway routes on, limits on and
//! forwards, so no other spelling of a path can reach an upstream by a cheaper route.
//!
//! Canonical means: unreserved characters (`A-Z a-z 0-9 - . _ ~`) never percent-encoded, the
//! hex of every other `%XX` in upper case, `;` parameters dropped from every segment, no dot
//! segments (RFC 3986 §5.2.4) and no empty segments (`//`). An encoded `/` or `\` (`%2F`,
//! `%5C`; a raw `\` counts as `%5C`, since some servers read it as `/`) is refused unless the
//! caller keeps it, and then it stays encoded, never decoded into a separator. A `..` that climbs
//! above the root is refused rather than clamped: no client of a real API sends one.
//!
//! The path, percent-decoded, must also be UTF-8 without control characters, so `%00`, `%0A` or
//! an overlong `%C0%AF` never reach an upstream that decodes paths its own way.
//!
//! Bytes over 0x7F sent raw (`/café`, which `http` and httparse take when they are UTF-8) are
//! percent-encoded like any other byte outside the URI grammar: otherwise `/café` and
//! `/caf%C3%A9` would be two spellings of one path, routed and limited apart.

use std::borrow::Cow;

/// What to do with `%2F` and `%5C` in a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncodedSlashes {
    /// A 400: the upstream might decode them into separators the gateway did not route on.
    #[default]
    Refuse,
    /// Kept encoded, as data inside one segment.
    Keep,
}

/// Why a path is refused; each becomes a 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path is not valid percent-encoded UTF-8")]
    NotUtf8,
    #[error("the path holds a control character")]
    Control,
    #[error("the path holds an encoded '/' or '\\' (%2F or %5C), which this route does not accept")]
    EncodedSlash,
    #[error("the path climbs above the root with '..'")]
    AboveRoot,
}

/// The canonical form of `path`. A path that is already canonical, the usual case, comes back
/// borrowed: this runs on every request.
///
/// A target that doesn't start with `/` (`*` of `OPTIONS *`) is returned as it is: no route
/// matches it.
pub fn canonical(path: &str, slashes: EncodedSlashes) -> Result<Cow<'_, str>, PathError> {
    let b = path.as_bytes();
    if is_canonical(b) {
        return Ok(Cow::Borrowed(path));
    }
    check_decoded(b)?;
    if !path.starts_with('/') {
        return Ok(Cow::Borrowed(path));
    }
    let mut out: Vec<u8> = Vec::with_capacity(b.len());
    // Where each kept segment's '/' sits in `out`, so `..` can drop the last one.
    let mut starts: smallvec::SmallVec<[usize; 16]> = smallvec::SmallVec::new();
    let mut ends_as_directory = false;
    for raw in path[1..].split('/') {
        let raw = raw.split(';').next().unwrap_or("");
        let start = out.len();
        out.push(b'/');
        push_segment(&mut out, raw.as_bytes(), slashes)?;
        match &out[start + 1..] {
            b"" | b"." => {
                out.truncate(start);
                ends_as_directory = true;
            }
            b".." => {
                let parent = starts.pop().ok_or(PathError::AboveRoot)?;
                out.truncate(parent);
                ends_as_directory = true;
            }
            _ => {
                starts.push(start);
                ends_as_directory = false;
            }
        }
    }
    if ends_as_directory || out.is_empty() {
        out.push(b'/');
    }
    if out == b {
        return Ok(Cow::Borrowed(path));
    }
    // Only ASCII was written: every byte over 0x7F went out percent-encoded.
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| PathError::NotUtf8)
}

/// Whether a canonical path holds an encoded `/` or `\`, kept by [`EncodedSlashes::Keep`].
pub fn has_encoded_slash(canonical: &str) -> bool {
    let b = canonical.as_bytes();
    b.contains(&b'%') && b.windows(3).any(|w| w == b"%2F" || w == b"%5C")
}

/// One pass for the common case: nothing to decode, no parameters, no `//`, no segment that
/// starts with a dot (a few of those, `/.well-known`, take the long way for nothing).
fn is_canonical(b: &[u8]) -> bool {
    if b.first() != Some(&b'/') {
        return false;
    }
    let mut prev = 0u8;
    for &c in b {
        if matches!(c, b'%' | b';' | b'\\')
            || c.is_ascii_control()
            || !c.is_ascii()
            || (prev == b'/' && matches!(c, b'/' | b'.'))
        {
            return false;
        }
        prev = c;
    }
    true
}

fn unreserved(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn push_encoded(out: &mut Vec<u8>, v: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.extend_from_slice(&[b'%', HEX[(v >> 4) as usize], HEX[(v & 15) as usize]]);
}

/// Appends one segment (parameters already cut off) in canonical spelling. `check_decoded`
/// has made sure every `%` starts a well-formed escape.
fn push_segment(out: &mut Vec<u8>, seg: &[u8], slashes: EncodedSlashes) -> Result<(), PathError> {
    let mut i = 0;
    while i < seg.len() {
        let (v, encoded) = match seg[i] {
            b'%' => {
                let (Some(h), Some(l)) = (
                    seg.get(i + 1).copied().and_then(hex),
                    seg.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(PathError::NotUtf8);
                };
                i += 3;
                (h << 4 | l, true)
            }
            c => {
                i += 1;
                (c, false)
            }
        };
        if v == b'/' || v == b'\\' {
            if slashes == EncodedSlashes::Refuse {
                return Err(PathError::EncodedSlash);
            }
            push_encoded(out, v);
        } else if (encoded && !unreserved(v)) || !v.is_ascii() {
            push_encoded(out, v);
        } else {
            out.push(v);
        }
    }
    Ok(())
}

/// The path, percent-decoded, must be UTF-8 without control characters.
fn check_decoded(raw: &[u8]) -> Result<(), PathError> {
    if !raw.contains(&b'%') && raw.is_ascii() {
        // `http` already refused raw bytes outside the URI grammar; nothing to decode.
        return if raw.iter().any(|b| b.is_ascii_control()) {
            Err(PathError::Control)
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
                return Err(PathError::NotUtf8);
            };
            decoded.push(h << 4 | l);
            i += 3;
        } else {
            decoded.push(raw[i]);
            i += 1;
        }
    }
    let text = std::str::from_utf8(&decoded).map_err(|_| PathError::NotUtf8)?;
    if text.chars().any(char::is_control) {
        return Err(PathError::Control);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refuse(p: &str) -> Result<String, PathError> {
        canonical(p, EncodedSlashes::Refuse).map(Cow::into_owned)
    }

    fn keep(p: &str) -> Result<String, PathError> {
        canonical(p, EncodedSlashes::Keep).map(Cow::into_owned)
    }

    #[test]
    fn canonical_paths_are_borrowed() {
        for p in [
            "/",
            "/v1/orders",
            "/v1/orders/",
            "/v1/orders/123",
            "/a.b/c-d_e~f",
            "/v1/caf.e",
        ] {
            assert!(
                matches!(canonical(p, EncodedSlashes::Refuse), Ok(Cow::Borrowed(_))),
                "{p}"
            );
        }
        // The long way, but nothing changed: still no copy handed back.
        assert!(matches!(
            canonical("/.well-known/x", EncodedSlashes::Refuse),
            Ok(Cow::Borrowed(_))
        ));
        assert!(matches!(
            canonical("/v1/caf%C3%A9", EncodedSlashes::Refuse),
            Ok(Cow::Borrowed(_))
        ));
    }

    #[test]
    fn spellings_of_one_path() {
        for p in [
            "/v1/exports",
            "/v1/./exports",
            "/v1/x/../exports",
            "/v1//exports",
            "//v1//exports",
            "/./v1/exports",
            "/v1/%65xports",
            "/v1/%65%78ports",
            "/v1/exports;x",
            "/v1;a=b/exports;c",
            "/v1/%2e/exports",
            "/v1/x/%2E%2E/exports",
            "/v1/x/%2e%2E/exports",
            "/v1/x/..;y/exports",
            "/v1/;p/exports",
            "/login/../v1/exports",
            "/%76%31/%65%78%70%6f%72%74%73",
        ] {
            assert_eq!(refuse(p).as_deref(), Ok("/v1/exports"), "{p}");
        }
    }

    #[test]
    fn directories_and_the_root() {
        assert_eq!(refuse("/v1/exports/").as_deref(), Ok("/v1/exports/"));
        assert_eq!(refuse("/v1/exports//").as_deref(), Ok("/v1/exports/"));
        assert_eq!(refuse("/v1/exports/.").as_deref(), Ok("/v1/exports/"));
        assert_eq!(refuse("/v1/exports/..").as_deref(), Ok("/v1/"));
        assert_eq!(refuse("/v1/exports/;x").as_deref(), Ok("/v1/exports/"));
        assert_eq!(refuse("//").as_deref(), Ok("/"));
        assert_eq!(refuse("/.").as_deref(), Ok("/"));
        assert_eq!(refuse("/a/..").as_deref(), Ok("/"));
        assert_eq!(refuse("/;x").as_deref(), Ok("/"));
    }

    #[test]
    fn escapes_are_normalised() {
        assert_eq!(refuse("/v1/%7Euser").as_deref(), Ok("/v1/~user"));
        assert_eq!(refuse("/v1/%7e").as_deref(), Ok("/v1/~"));
        assert_eq!(refuse("/v1/caf%c3%a9").as_deref(), Ok("/v1/caf%C3%A9"));
        assert_eq!(refuse("/v1/a%20b").as_deref(), Ok("/v1/a%20b"));
        assert_eq!(
            refuse("/v1/a%3bb").as_deref(),
            Ok("/v1/a%3Bb"),
            "an encoded ';' is data"
        );
        assert_eq!(
            refuse("/v1/%252F").as_deref(),
            Ok("/v1/%252F"),
            "decoded once only"
        );
        assert_eq!(refuse("/v1/.%2e.").as_deref(), Ok("/v1/..."));
    }

    #[test]
    fn raw_bytes_over_0x7f_are_percent_encoded() {
        for p in ["/v1/caf\u{e9}", "/v1/caf%C3%A9", "/v1/caf%c3%a9", "/v1/caf%C3%a9"] {
            assert_eq!(refuse(p).as_deref(), Ok("/v1/caf%C3%A9"), "{p}");
        }
        assert!(matches!(
            canonical("/v1/caf\u{e9}", EncodedSlashes::Refuse),
            Ok(Cow::Owned(_))
        ));
        assert_eq!(
            refuse("/\u{65e5}\u{672c}/x;p/../y").as_deref(),
            Ok("/%E6%97%A5%E6%9C%AC/y")
        );
        assert_eq!(refuse("/a/\u{1F600}").as_deref(), Ok("/a/%F0%9F%98%80"));
        assert_eq!(
            refuse("/caf\u{e9}%2Fx"),
            Err(PathError::EncodedSlash),
            "still judged after encoding"
        );
        // A control character outside ASCII (NEL, U+0085) is refused raw as it is encoded.
        assert_eq!(refuse("/a\u{85}b"), Err(PathError::Control));
        assert_eq!(refuse("/a%C2%85b"), Err(PathError::Control));
    }

    #[test]
    fn refusals() {
        assert_eq!(refuse("/.."), Err(PathError::AboveRoot));
        assert_eq!(refuse("/../v1/exports"), Err(PathError::AboveRoot));
        assert_eq!(refuse("/v1/../../x"), Err(PathError::AboveRoot));
        assert_eq!(refuse("/%2e%2e/x"), Err(PathError::AboveRoot));
        assert_eq!(refuse("/v1/exports%2Fx"), Err(PathError::EncodedSlash));
        assert_eq!(refuse("/v1/exports%2f"), Err(PathError::EncodedSlash));
        assert_eq!(refuse("/v1/a%5Cb"), Err(PathError::EncodedSlash));
        assert_eq!(refuse("/v1/a\\b"), Err(PathError::EncodedSlash));
        assert_eq!(refuse("/v1/caf%C3%A9"), Ok("/v1/caf%C3%A9".into()));
        assert_eq!(refuse("/v1/%ff"), Err(PathError::NotUtf8));
        assert_eq!(refuse("/v1/%C0%AF"), Err(PathError::NotUtf8));
        assert_eq!(refuse("/v1/%00"), Err(PathError::Control));
        assert_eq!(refuse("/v1/a%0Ab"), Err(PathError::Control));
        assert_eq!(refuse("/v1/%zz"), Err(PathError::NotUtf8));
        assert_eq!(refuse("/v1/%4"), Err(PathError::NotUtf8));
        assert_eq!(refuse("/v1/a\u{1}b"), Err(PathError::Control));
    }

    #[test]
    fn kept_slashes_stay_encoded() {
        assert_eq!(keep("/files/a%2fb").as_deref(), Ok("/files/a%2Fb"));
        assert_eq!(keep("/files/a%5cb").as_deref(), Ok("/files/a%5Cb"));
        assert_eq!(keep("/files/a\\b").as_deref(), Ok("/files/a%5Cb"));
        assert_eq!(keep("/files/%2F/../x").as_deref(), Ok("/files/x"));
        assert!(has_encoded_slash("/files/a%2Fb"));
        assert!(has_encoded_slash("/files/a%5Cb"));
        assert!(!has_encoded_slash("/files/a%252Fb"));
        assert!(!has_encoded_slash("/files/ab"));
    }

    #[test]
    fn other_targets_pass_unchanged() {
        assert_eq!(refuse("*").as_deref(), Ok("*"));
    }

    use proptest::strategy::Strategy;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Canonical output is a fixed point, has no `//` or dot segments, and is borrowed
        /// when it equals its input.
        #[test]
        fn canonical_is_a_fixed_point(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(vec![
                        "/", "//", ".", "..", "%2e", "%2E", "%2e%2E", ";", ";x=1", "%2F", "%2f",
                        "%5C", "\\", "%41", "%7e", "%7E", "%3B", "%25", "%C3%A9", "%c3%a9", "a",
                        "B", "-", "_", "~", "%20", "%ff", "\u{e9}", "\u{65e5}",
                    ]).prop_map(str::to_string),
                    "[a-z./;%]{1,4}",
                ],
                0..16,
            ),
            slashes in proptest::bool::ANY,
        ) {
            let slashes = if slashes { EncodedSlashes::Keep } else { EncodedSlashes::Refuse };
            let p = format!("/{}", parts.concat());
            if let Ok(c) = canonical(&p, slashes) {
                let again = canonical(&c, slashes).expect("canonical output is accepted");
                proptest::prop_assert_eq!(&*again, &*c, "from {:?}", p);
                proptest::prop_assert!(matches!(again, Cow::Borrowed(_)), "{:?} copied again", c);
                proptest::prop_assert!(c.starts_with('/'));
                for bad in ["//", "/./", "/../", ";"] {
                    proptest::prop_assert!(!c.contains(bad), "{:?} from {:?} holds {:?}", c, p, bad);
                }
                proptest::prop_assert!(!c.ends_with("/.") && !c.ends_with("/.."), "{:?}", c);
            }
        }
    }
}
