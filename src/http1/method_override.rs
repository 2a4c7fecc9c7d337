//! The headers by which a client asks an upstream framework to serve its request as another
//! method (`X-HTTP-Method-Override` and its two cousins), read the way those frameworks read
//! them, so the gateway can route, limit and forward the method they would have served.
//!
//! An upstream that honours one of them serves a method the gateway did not route on: a GET
//! limited as a GET and run as a POST. So the gateway never forwards them; a route that opts in
//! is routed as the method asked for, and that method is what the upstream gets.

use http::Method;
use http::header::{HeaderMap, HeaderName};

/// The three names frameworks read, lower case as `http` holds them.
pub static NAMES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// Whether a header is one of [`NAMES`]. Cheap enough for every header of every request: the
/// names' lengths (22, 13, 17) turn almost every other header away before any byte compare.
pub fn named(name: &HeaderName) -> bool {
    let n = name.as_str();
    matches!(n.len(), 22 | 13 | 17) && n.starts_with("x-") && NAMES.iter().any(|m| m == name)
}

/// Why an override can't be honoured; a 400 on a route that honours overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadOverride {
    #[error("a method override must name GET, POST, PUT, PATCH, DELETE or OPTIONS")]
    Unknown,
    #[error("method override headers name different methods")]
    Disagree,
}

/// The method a request's override headers ask for: `None` when it has none. Values are read
/// as the frameworks that honour them read them, in any case; every value of every name must
/// name the same method. `HEAD` is refused (the client's answer is framed for its own method,
/// and a HEAD's has no body), and so are `CONNECT` and `TRACE`, which no route should be
/// reached by through a header.
pub fn requested(headers: &HeaderMap) -> Result<Option<Method>, BadOverride> {
    let mut found: Option<Method> = None;
    for name in &NAMES {
        for v in headers.get_all(name) {
            let m = method(v.as_bytes()).ok_or(BadOverride::Unknown)?;
            match &found {
                Some(f) if *f != m => return Err(BadOverride::Disagree),
                Some(_) => {}
                None => found = Some(m),
            }
        }
    }
    Ok(found)
}

/// One override value as a method a POST may become.
fn method(value: &[u8]) -> Option<Method> {
    let v = value.trim_ascii();
    [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
    ]
    .into_iter()
    .find(|m| m.as_str().as_bytes().eq_ignore_ascii_case(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn any_of_the_three_names_in_any_case() {
        for name in ["X-HTTP-Method-Override", "x-http-method", "X-Method-Override"] {
            for (value, m) in [
                (&b"DELETE"[..], Method::DELETE),
                (b"delete", Method::DELETE),
                (b" Patch ", Method::PATCH),
                (b"PUT", Method::PUT),
                (b"GET", Method::GET),
                (b"OPTIONS", Method::OPTIONS),
                (b"POST", Method::POST),
            ] {
                assert_eq!(
                    requested(&headers(&[(name, value)])),
                    Ok(Some(m)),
                    "{name}: {value:?}"
                );
            }
        }
        assert_eq!(requested(&headers(&[("x-other", b"DELETE")])), Ok(None));
        assert_eq!(requested(&HeaderMap::new()), Ok(None));
    }

    #[test]
    fn bad_values() {
        for value in [
            &b""[..],
            b"DELEET",
            b"DELETE, PUT",
            b"HEAD",
            b"CONNECT",
            b"TRACE",
            b"PROPFIND",
            b"DEL\xC3\xA9TE",
        ] {
            assert_eq!(
                requested(&headers(&[("x-http-method-override", value)])),
                Err(BadOverride::Unknown),
                "{value:?}"
            );
        }
    }

    #[test]
    fn several_values_must_agree() {
        let agree = headers(&[("x-http-method-override", b"PATCH"), ("x-http-method", b"patch")]);
        assert_eq!(requested(&agree), Ok(Some(Method::PATCH)));
        let twice = headers(&[
            ("x-http-method-override", b"PUT"),
            ("x-http-method-override", b"PATCH"),
        ]);
        assert_eq!(requested(&twice), Err(BadOverride::Disagree));
        let across = headers(&[("x-http-method", b"PUT"), ("x-method-override", b"DELETE")]);
        assert_eq!(requested(&across), Err(BadOverride::Disagree));
    }

    #[test]
    fn named_knows_exactly_the_three() {
        for n in NAMES.iter() {
            assert!(named(n));
        }
        for other in [
            "x-http-method-overrides",
            "x-http-methods",
            "x-method-overrid",
            "x-forwarded-for",
            "host",
            "content-length",
            "x-request-id",
        ] {
            assert!(!named(&HeaderName::from_static(other)), "{other}");
        }
    }
}
