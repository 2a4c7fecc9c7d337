//! An upstream's response head, read once and judged once for both of the gateway's paths: how
//! its body is framed, whether its connection may carry another request, and which of its
//! headers reach the client. The express lane writes the client's head from this as bytes;
//! the proxy builds hyper's response from it. Both therefore forward the same things.

use smallvec::SmallVec;

use super::{chunked_last, connection_tokens};

/// Headers an upstream response may have.
const MAX_HEADERS: usize = 128;
/// Largest upstream response head; larger is a 502.
pub const MAX_HEAD: usize = 64 * 1024;

/// How an upstream response's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Empty,
    Fixed(u64),
    Chunked,
    /// Until the upstream closes; the client's connection closes after it too.
    Close,
}

/// Why an upstream's response can't be forwarded (the 502's reason, for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unforwardable(pub &'static str);

/// What reading the bytes so far gave.
pub enum Parsed<R> {
    /// The head is not complete yet.
    Partial,
    /// An interim (1xx) response of this many bytes, to skip: the final one follows.
    Interim(usize),
    /// The final response head of this many bytes, and what the caller made of it.
    Final(usize, R),
}

/// A final response head, judged.
pub struct Head<'b> {
    pub status: u16,
    pub reason: &'b str,
    pub headers: &'b [httparse::Header<'b>],
    pub framing: Framing,
    /// Whether the connection can carry another request after this response's body: the
    /// upstream keeps it open and framed the response one way only.
    pub reusable: bool,
    /// Whether the upstream sent `Date`.
    pub dated: bool,
    /// The `Content-Length` the client gets: the upstream's, once, where a length may be sent.
    pub length: Option<u64>,
    connection_named: SmallVec<[&'b [u8]; 4]>,
}

/// What the body's reader needs of a judged head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub status: u16,
    pub framing: Framing,
    /// Whether the connection may carry another request after the body (see [`Head`]).
    pub reusable: bool,
}

impl Head<'_> {
    pub fn shape(&self) -> Shape {
        Shape {
            status: self.status,
            framing: self.framing,
            reusable: self.reusable,
        }
    }

    /// Whether a header of this name reaches the client as the upstream sent it: not
    /// hop-by-hop, not named by `Connection`, and not `Content-Length`, which is written once
    /// from [`Head::length`].
    pub fn forwards(&self, name: &[u8]) -> bool {
        !(super::hop_by_hop(name)
            || name.eq_ignore_ascii_case(b"content-length")
            || self.connection_named.iter().any(|c| c.eq_ignore_ascii_case(name)))
    }
}

/// What the request asked that decides how its answer is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked<'a> {
    /// A HEAD: its answer has no body.
    pub head: bool,
    /// The protocol the request asked to upgrade to (lowercase, as the route lists it): a
    /// `101` switching to it is the final answer, after which the connection is that
    /// protocol's. Any other `101` is refused.
    pub upgrade: Option<&'a str>,
}

/// Parses an upstream response head from the start of `buf` and, when it is a final one, hands
/// it judged to `f`.
pub fn parse<R>(
    buf: &[u8],
    asked: Asked<'_>,
    f: impl FnOnce(&Head<'_>) -> R,
) -> Result<Parsed<R>, Unforwardable> {
    let is_head = asked.head;
    // Left uninitialised: zeroing 128 headers (4 KiB) cost every response more than parsing
    // its few headers did.
    let mut headers = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let n = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Ok(Parsed::Partial),
        Ok(httparse::Status::Partial) => return Err(Unforwardable("a head over 64 KiB")),
        Err(httparse::Error::TooManyHeaders) => return Err(Unforwardable("more than 128 headers")),
        Err(_) => return Err(Unforwardable("a malformed head")),
    };
    // httparse takes a bare LF as a line end; RFC 9112 §2.2 lets a recipient do so, but a
    // proxy that passes such a head on hands the next reader a choice, so refuse it.
    if !crlf_lines(&buf[..n], resp.headers) {
        return Err(Unforwardable("a line ending in a bare LF"));
    }
    let status = resp.code.unwrap_or(0);
    if !(100..=599).contains(&status) {
        return Err(Unforwardable("a status outside 100-599"));
    }
    let switched = status == 101;
    if switched {
        switch_asked_for(asked.upgrade, resp.headers)?;
    }
    if status < 200 && !switched {
        return Ok(Parsed::Interim(n));
    }
    let http10 = resp.version == Some(0);
    let mut length: Option<u64> = None;
    let mut encoded = false;
    let mut chunked = false;
    let mut closes = http10;
    let mut dated = false;
    let mut connection_named = SmallVec::new();
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(Unforwardable("an invalid Content-Length"))?;
            if length.is_some_and(|l| l != v) {
                return Err(Unforwardable("disagreeing Content-Length headers"));
            }
            length = Some(v);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if encoded {
                return Err(Unforwardable("more than one Transfer-Encoding"));
            }
            encoded = true;
            chunked = chunked_last(h.value);
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in connection_tokens(h.value) {
                if token.eq_ignore_ascii_case(b"close") {
                    closes = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    closes &= !http10;
                } else {
                    connection_named.push(token);
                }
            }
        } else if name.eq_ignore_ascii_case(b"date") {
            dated = true;
        }
    }
    let bodiless_status = status == 204 || status == 304 || switched;
    let framing = if is_head || bodiless_status {
        Framing::Empty
    } else if encoded {
        if !chunked {
            return Err(Unforwardable("a transfer coding other than chunked"));
        }
        Framing::Chunked
    } else {
        match length {
            Some(0) => Framing::Empty,
            Some(n) => Framing::Fixed(n),
            None => Framing::Close,
        }
    };
    // Content-Length beside Transfer-Encoding: the coding wins (RFC 9112 §6.3), the length is
    // dropped, and a connection framed two ways is not trusted with another request.
    let two_ways = encoded && length.is_some();
    let head = Head {
        status,
        reason: resp.reason.unwrap_or(""),
        headers: resp.headers,
        framing,
        // After a switch the connection is the new protocol's, never a pooled one again.
        reusable: !closes && !two_ways && framing != Framing::Close && !switched,
        dated,
        // No length where the body is chunked or can't exist (RFC 9110 §8.6); a HEAD's says
        // what a GET would carry.
        length: length.filter(|_| !bodiless_status && (!encoded || is_head)),
        connection_named,
    };
    Ok(Parsed::Final(n, f(&head)))
}

/// Whether a `101` switches to the protocol the request asked to upgrade to; anything else
/// would hand the client a connection in a protocol it did not ask for. Apart from `parse`,
/// whose usual response never comes here.
#[cold]
fn switch_asked_for(upgrade: Option<&str>, headers: &[httparse::Header<'_>]) -> Result<(), Unforwardable> {
    let Some(want) = upgrade else {
        return Err(Unforwardable("an upgrade nobody asked for"));
    };
    let to = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("upgrade"))
        .and_then(|h| connection_tokens(h.value).next());
    if !to.is_some_and(|p| p.eq_ignore_ascii_case(want.as_bytes())) {
        return Err(Unforwardable(
            "a switch to a protocol other than the one asked for",
        ));
    }
    Ok(())
}

/// Whether every line of a parsed head ends in CRLF. httparse has found the lines, so only
/// their ends are looked at: after the status line, after each header's value (and any
/// whitespace after it), and the empty line. This runs on every response; a scan of every
/// byte cost about 3% of a request.
fn crlf_lines(head: &[u8], headers: &[httparse::Header<'_>]) -> bool {
    let base = head.as_ptr() as usize;
    let Some(first) = head.iter().position(|&c| c == b'\n') else {
        return false;
    };
    if first == 0 || head[first - 1] != b'\r' {
        return false;
    }
    for h in headers {
        // Just past the value; an empty value may not point into the head, so start after the
        // name's colon then.
        let mut end = if h.value.is_empty() {
            (h.name.as_ptr() as usize - base) + h.name.len() + 1
        } else {
            (h.value.as_ptr() as usize - base) + h.value.len()
        };
        while matches!(head.get(end), Some(b' ' | b'\t')) {
            end += 1;
        }
        if head.get(end) != Some(&b'\r') || head.get(end + 1) != Some(&b'\n') {
            return false;
        }
    }
    head.ends_with(b"\r\n\r\n") || (headers.is_empty() && head.len() == first + 3 && head.ends_with(b"\r\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Status, framing, reuse, and the headers the client gets (a written length included).
    type Judged = (u16, Framing, bool, Vec<String>);

    fn judge(raw: &str, is_head: bool) -> Result<Parsed<Judged>, Unforwardable> {
        judge_asked(
            raw,
            Asked {
                head: is_head,
                upgrade: None,
            },
        )
    }

    fn judge_asked(raw: &str, asked: Asked<'_>) -> Result<Parsed<Judged>, Unforwardable> {
        parse(raw.as_bytes(), asked, |h| {
            let mut kept: Vec<String> = h
                .headers
                .iter()
                .filter(|x| h.forwards(x.name.as_bytes()))
                .map(|x| x.name.to_ascii_lowercase())
                .collect();
            if let Some(n) = h.length {
                kept.insert(0, format!("content-length: {n}"));
            }
            (h.status, h.framing, h.reusable, kept)
        })
    }

    fn fin(raw: &str, is_head: bool) -> Judged {
        match judge(raw, is_head) {
            Ok(Parsed::Final(_, r)) => r,
            _ => panic!("not a final head: {raw:?}"),
        }
    }

    #[test]
    fn framings() {
        let (s, f, r, kept) = fin("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\n", false);
        assert_eq!((s, f, r), (200, Framing::Fixed(5), true));
        assert_eq!(kept, ["content-length: 5", "x-a"]);
        let (_, _, _, kept) = fin(
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n",
            false,
        );
        assert_eq!(kept, ["content-length: 2"], "equal lengths are written once");
        let (_, f, r, kept) = fin(
            "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            false,
        );
        assert_eq!((f, r), (Framing::Chunked, false), "CL+TE: chunked, not reused");
        assert!(kept.is_empty(), "neither header is forwarded: {kept:?}");
        let (_, f, _, kept) = fin("HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n", false);
        assert_eq!(f, Framing::Empty);
        assert!(kept.is_empty());
        let (_, f, _, kept) = fin("HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n", true);
        assert_eq!(
            (f, kept.as_slice()),
            (Framing::Empty, &["content-length: 7".to_string()][..])
        );
        let (_, f, r, _) = fin("HTTP/1.1 200 OK\r\n\r\n", false);
        assert_eq!((f, r), (Framing::Close, false));
        let (_, _, r, _) = fin("HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false);
        assert!(!r, "HTTP/1.0 closes unless it says keep-alive");
        let (_, _, r, _) = fin(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\n",
            false,
        );
        assert!(r);
        let (_, _, r, kept) = fin(
            "HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nX-Hop: 1\r\nContent-Length: 1\r\n\r\n",
            false,
        );
        assert!(!r);
        assert_eq!(kept, ["content-length: 1"]);
        assert!(matches!(
            judge("HTTP/1.1 103 Early Hints\r\n\r\n", false),
            Ok(Parsed::Interim(28))
        ));
        // Empty values and trailing whitespace still end in CRLF.
        let (_, f, _, kept) = fin(
            "HTTP/1.1 200 OK\r\nX-Empty:\r\nX-Pad: a \t\r\nContent-Length: 0\r\n\r\n",
            false,
        );
        assert_eq!(f, Framing::Empty);
        assert_eq!(kept, ["content-length: 0", "x-empty", "x-pad"]);
        assert!(matches!(
            judge("HTTP/1.1 204 No Content\r\n\r\n", false),
            Ok(Parsed::Final(..))
        ));
        assert!(matches!(
            judge("HTTP/1.1 200 OK\r\nContent-Le", false),
            Ok(Parsed::Partial)
        ));
    }

    proptest::proptest! {
        /// Any bytes get an answer and no panic, and the line-end check agrees with a scan of
        /// every byte: a head is taken only when no LF in it stands without its CR.
        #[test]
        fn line_ends_agree_with_a_full_scan(
            lines in proptest::collection::vec(
                (proptest::sample::select(vec!["X-A", "Content-Length", "X-Empty", "Date"]),
                 proptest::sample::select(vec!["1", "", " a ", "\t", "0"]),
                 proptest::bool::ANY),
                0..6),
            status_crlf in proptest::bool::ANY,
            end_crlf in proptest::bool::ANY,
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
        ) {
            let mut head = String::from("HTTP/1.1 200 OK");
            head.push_str(if status_crlf { "\r\n" } else { "\n" });
            for (name, value, crlf) in &lines {
                head.push_str(&format!("{name}:{value}{}", if *crlf { "\r\n" } else { "\n" }));
            }
            head.push_str(if end_crlf { "\r\n" } else { "\n" });
            let bytes = head.as_bytes();
            let naive_ok = bytes.iter().enumerate().all(|(i, &c)| c != b'\n' || (i > 0 && bytes[i - 1] == b'\r'));
            match parse(bytes, Asked::default(), |_| ()) {
                Ok(Parsed::Final(n, ())) => proptest::prop_assert!(naive_ok && n == bytes.len(), "{head:?}"),
                Err(Unforwardable("a line ending in a bare LF")) => proptest::prop_assert!(!naive_ok, "{head:?}"),
                _ => {}
            }
            let _ = parse(&noise, Asked::default(), |_| ());
        }
    }

    #[test]
    fn unforwardable_heads() {
        for raw in [
            "HTTP/1.1 600 Odd\r\n\r\n",
            "HTTP/1.1 099 Odd\r\n\r\n",
            "HTTP/1.1 200 OK\nContent-Length: 1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX: a\nContent-Length: 1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX:\nContent-Length: 1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX: a  \nContent-Length: 1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\n",
            "HTTP/1.1 204 No Content\r\n\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            "HTTX/1.1 200 OK\r\n\r\n",
        ] {
            assert!(judge(raw, false).is_err(), "{raw:?} was taken");
        }
    }

    #[test]
    fn a_switch_is_final_only_to_the_protocol_asked_for() {
        let ws = Asked {
            head: false,
            upgrade: Some("websocket"),
        };
        let raw = "HTTP/1.1 101 Switching Protocols\r\nUpgrade: WebSocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\nContent-Length: 5\r\n\r\nframe";
        match judge_asked(raw, ws) {
            Ok(Parsed::Final(n, (status, framing, reusable, kept))) => {
                // The bytes after the head are the new protocol's, not a body.
                assert_eq!(&raw[n..], "frame");
                assert_eq!((status, framing, reusable), (101, Framing::Empty, false));
                assert_eq!(kept, ["sec-websocket-accept"]);
            }
            _ => panic!("a switch to the protocol asked for is the answer"),
        }
        for other in [
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
        ] {
            assert!(judge_asked(other, ws).is_err(), "{other:?} was taken");
        }
        // An interim answer before the switch is still skipped.
        assert!(matches!(
            judge_asked("HTTP/1.1 100 Continue\r\n\r\n", ws),
            Ok(Parsed::Interim(_))
        ));
    }
}
