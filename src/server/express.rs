//! The express lane: plain-TCP HTTP/1.1 requests without a body, read, checked and forwarded
//! inside their connection's own task, on upstream sockets the lane speaks HTTP/1.1 on itself.
//!
//! Why it exists: hyper's server and client are general (any body, any framing, HTTP/2, a task
//! per upstream connection, a channel between them), and that generality cost about 30,000
//! instructions a request against nginx's 21,000 in total (benches/README.md). The usual API
//! call (a GET with a key, answered with a fixed-length or chunked body) needs little of it.
//!
//! What it takes: HTTP/1.1 heads that parse, in origin form, without `Transfer-Encoding`,
//! `Expect`, `Upgrade`, a body (no `Content-Length` other than one `0`) or `Connection` other
//! than `keep-alive`, on routes whose limits don't read the body. Anything else (and h2c, and
//! heads it can't parse or that are too large) hands the connection, with every byte read so
//! far, to hyper for the rest of its life; hyper and the framing watcher then see exactly the
//! bytes they would have seen, and answer as they always do. The gateway's decisions (routes,
//! keys, limits, headers, metrics, access lines) are the same functions on both paths.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, Response, StatusCode, Uri, Version};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{ConnInfo, ServerLimits};
use crate::gateway::{Admission, Gateway, X_REQUEST_ID};
use crate::proxy::HeaderEdits;
use crate::proxy::pool::{ConnPool, RawConn};
use crate::respond::{Body, RATELIMIT, RATELIMIT_POLICY, Refusal};

/// Headers a lane request may have; more go to hyper (which takes up to 100).
const MAX_HEADERS: usize = 64;
/// Headers an upstream response may have.
const MAX_UPSTREAM_HEADERS: usize = 128;
/// Largest upstream response head; larger is a 502.
const MAX_UPSTREAM_HEAD: usize = 64 * 1024;
const READ_SIZE: usize = 8 * 1024;

/// How a connection left the lane.
pub enum Ended {
    Closed,
    /// Hyper serves the rest, starting with these bytes.
    HandOff(Prefixed<TcpStream>),
}

/// Serves requests on `tcp` until the client closes, the server stops, or a request needs the
/// general path.
pub async fn serve(
    gw: &Gateway,
    mut tcp: TcpStream,
    info: &ConnInfo,
    limits: &ServerLimits,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    let mut buf = BytesMut::with_capacity(READ_SIZE);
    let mut out = BytesMut::with_capacity(READ_SIZE);
    let mut head_out = BytesMut::with_capacity(1024);
    let mut head = Head::default();
    // Like hyper's: the time to the end of a head counts from when the last response was sent,
    // so an idle keep-alive connection is closed after it too.
    let mut head_deadline = Deadline::new(limits.header_read_timeout);
    let mut upstream_deadline = Deadline::new(limits.header_read_timeout);
    loop {
        head_deadline.set(Instant::now() + limits.header_read_timeout);
        loop {
            if !buf.is_empty() {
                match parse(&buf, &mut head) {
                    Parsed::Lane => break,
                    Parsed::Partial if buf.len() < limits.max_header_bytes => {}
                    // Too large, unusual or malformed: hyper answers it (431, 400, h2c …).
                    _ => return Ended::HandOff(Prefixed::new(buf.freeze(), tcp)),
                }
            }
            buf.reserve(READ_SIZE);
            tokio::select! {
                biased;
                r = tcp.read_buf(&mut buf) => match r {
                    Ok(0) | Err(_) => return Ended::Closed,
                    Ok(_) => {}
                },
                () = head_deadline.passed() => {
                    if !buf.is_empty() {
                        tracing::debug!(peer = %info.peer, "request head not finished in time");
                    }
                    return Ended::Closed;
                }
                _ = stop.changed(), if buf.is_empty() => return Ended::Closed,
            }
        }
        let request_bytes = buf.split_to(head.len).freeze();
        let Some(mut parts) = head.to_parts(&request_bytes) else {
            // Bytes httparse took but `http` doesn't: let hyper refuse them as it would.
            let mut rest = BytesMut::from(&request_bytes[..]);
            rest.extend_from_slice(&buf);
            return Ended::HandOff(Prefixed::new(rest.freeze(), tcp));
        };
        let mut b = gw.begin(parts.method.clone(), &mut parts.headers);
        let closing = *stop.borrow();
        let admitted = gw.admit(&mut b, &mut parts, info).await;
        let f = match admitted {
            Admission::HandOff => {
                let mut rest = BytesMut::from(&request_bytes[..]);
                rest.extend_from_slice(&buf);
                // Nothing was charged yet; hyper's path begins this request again.
                drop(b);
                return Ended::HandOff(Prefixed::new(rest.freeze(), tcp));
            }
            Admission::Answer(resp) => {
                answer(gw, &mut out, b, resp, closing, parts.method == Method::HEAD);
                if tcp.write_all(&out).await.is_err() || closing {
                    return Ended::Closed;
                }
                continue;
            }
            Admission::Forward(f) => f,
        };
        let snap = b.snap.clone();
        let up = &snap.upstreams[f.upstream];
        let extra = Extra {
            budget: f.budget.as_ref(),
            request_id: &b.request_id,
        };
        head_out.clear();
        render_request(&mut head_out, &parts, &gw.edits(&b, &f, &parts, info));
        let started = std::time::Instant::now();
        out.clear();
        let is_head = parts.method == Method::HEAD;
        upstream_deadline.set(Instant::now() + up.timeout);
        let answered = tokio::select! {
            biased;
            r = exchange(&up.pool, &head_out, idempotent(&parts.method), is_head, &extra, closing, &mut out) => Ok(r),
            () = upstream_deadline.passed() => Err(()),
        };
        gw.upstream_answered(&b, &f, started.elapsed());
        let (mut conn, framing, status, upstream_closes) =
            match answered.unwrap_or(Err(Refusal::GatewayTimeout)) {
                Ok(r) => r,
                Err(refusal) => {
                    tracing::debug!(upstream = &*up.name, error = %refusal, "upstream failed");
                    let mut resp = refusal.into_response();
                    gw.forward_headers(&f, resp.headers_mut());
                    answer(gw, &mut out, b, resp, closing, is_head);
                    if tcp.write_all(&out).await.is_err() || closing {
                        return Ended::Closed;
                    }
                    continue;
                }
            };
        let relayed = relay(&mut conn, &mut tcp, &mut out, framing, up.timeout).await;
        let upstream_reusable = matches!(relayed, Relayed::Done { clean: true }) && !upstream_closes;
        gw.finish(b, status);
        drop(f);
        match relayed {
            Relayed::Done { .. } => {
                if upstream_reusable {
                    up.pool.put_raw(conn);
                }
                if closing || framing == Framing::Close {
                    return Ended::Closed;
                }
            }
            Relayed::Broken => return Ended::Closed,
        }
    }
}

/// A byte range of a request head.
type Span = (u32, u32);

/// A deadline that moves with every request and almost never fires: moving it forward is a
/// clock read, and the timer under it is re-armed only when it fires before the deadline.
/// A timer registered and cancelled per request cost about a tenth of the lane's instructions.
struct Deadline {
    sleep: Pin<Box<tokio::time::Sleep>>,
    at: Instant,
}

impl Deadline {
    fn new(after: Duration) -> Deadline {
        let at = Instant::now() + after;
        Deadline {
            sleep: Box::pin(tokio::time::sleep_until(at)),
            at,
        }
    }

    fn set(&mut self, at: Instant) {
        if at < self.sleep.deadline() {
            self.sleep.as_mut().reset(at);
        }
        self.at = at;
    }

    /// Resolves once the deadline has passed.
    async fn passed(&mut self) {
        loop {
            self.sleep.as_mut().await;
            if Instant::now() >= self.at {
                return;
            }
            self.sleep.as_mut().reset(self.at);
        }
    }
}

/// A lane request's head, as offsets into the bytes it was parsed from. One per connection,
/// filled again for each request.
#[derive(Default)]
struct Head {
    len: usize,
    method: Method,
    path: Span,
    headers: smallvec::SmallVec<[(Span, Span); 16]>,
}

enum Parsed {
    /// `Head` holds a request the lane takes.
    Lane,
    Partial,
    /// Anything the lane leaves to hyper.
    Other,
}

fn span(base: &[u8], part: &[u8]) -> Span {
    // Heads are far below 4 GiB: the buffer stops growing at the head size limit.
    let start = (part.as_ptr() as usize - base.as_ptr() as usize) as u32;
    (start, start + part.len() as u32)
}

fn parse(buf: &[u8], head: &mut Head) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other,
    };
    let (Some(method), Some(path), Some(1)) = (req.method, req.path, req.version) else {
        return Parsed::Other;
    };
    if !path.starts_with('/') {
        return Parsed::Other;
    }
    let method = match method {
        "GET" => Method::GET,
        "HEAD" => Method::HEAD,
        "DELETE" => Method::DELETE,
        "OPTIONS" => Method::OPTIONS,
        "POST" => Method::POST,
        "PUT" => Method::PUT,
        "PATCH" => Method::PATCH,
        _ => return Parsed::Other,
    };
    head.headers.clear();
    let mut lengths = 0;
    for h in req.headers.iter() {
        let name = h.name.as_bytes();
        let v = h.value;
        if name.eq_ignore_ascii_case(b"content-length") {
            lengths += 1;
            if lengths > 1 || v.trim_ascii() != b"0" {
                return Parsed::Other;
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding")
            || name.eq_ignore_ascii_case(b"expect")
            || name.eq_ignore_ascii_case(b"upgrade")
            || (name.eq_ignore_ascii_case(b"connection")
                && !v.trim_ascii().eq_ignore_ascii_case(b"keep-alive"))
        {
            return Parsed::Other;
        }
        head.headers.push((span(buf, name), span(buf, v)));
    }
    head.len = len;
    head.method = method;
    head.path = span(buf, path.as_bytes());
    Parsed::Lane
}

impl Head {
    /// The head as `http` types, sharing the request's bytes.
    fn to_parts(&self, bytes: &Bytes) -> Option<http::request::Parts> {
        let r = |(a, b): Span| a as usize..b as usize;
        let (mut parts, ()) = http::Request::new(()).into_parts();
        parts.method = self.method.clone();
        parts.version = Version::HTTP_11;
        parts.uri = Uri::from_maybe_shared(bytes.slice(r(self.path))).ok()?;
        parts.headers.reserve(self.headers.len() + 1);
        for &(n, v) in &self.headers {
            let name = HeaderName::from_bytes(&bytes[r(n)]).ok()?;
            let value = HeaderValue::from_maybe_shared(bytes.slice(r(v))).ok()?;
            parts.headers.append(name, value);
        }
        Some(parts)
    }
}

fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::DELETE | Method::PUT
    )
}

/// The headers the gateway adds to a forwarded response.
struct Extra<'a> {
    budget: Option<&'a crate::respond::Budget>,
    request_id: &'a HeaderValue,
}

impl Extra<'_> {
    /// Whether an upstream header of this name gives way to one of ours.
    fn replaces(&self, name: &[u8]) -> bool {
        name.eq_ignore_ascii_case(X_REQUEST_ID.as_str().as_bytes())
            || self.budget.is_some_and(|b| {
                name.eq_ignore_ascii_case(RATELIMIT.as_str().as_bytes())
                    || (b.policy.is_some() && name.eq_ignore_ascii_case(RATELIMIT_POLICY.as_str().as_bytes()))
            })
    }

    fn render(&self, out: &mut BytesMut) {
        if let Some(b) = self.budget {
            if let Some(p) = &b.policy {
                header_line(out, RATELIMIT_POLICY.as_str().as_bytes(), p.as_bytes());
            }
            out.extend_from_slice(b"ratelimit: ");
            b.write_state(out);
            out.extend_from_slice(b"\r\n");
        }
        header_line(out, X_REQUEST_ID.as_str().as_bytes(), self.request_id.as_bytes());
    }
}

fn render_request(out: &mut BytesMut, parts: &http::request::Parts, edits: &HeaderEdits) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.extend_from_slice(b" ");
    out.extend_from_slice(parts.uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if edits.keeps(name) {
            header_line(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    for (name, value) in &edits.set {
        header_line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

fn status_line(out: &mut BytesMut, status: u16, reason: &str) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(itoa::Buffer::new().format(status).as_bytes());
    out.extend_from_slice(b" ");
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or(reason);
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

fn header_line(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Writes one of the gateway's own answers, with `Date`, `Content-Length` and the request id.
fn render_answer(
    out: &mut BytesMut,
    resp: Response<Body>,
    request_id: &HeaderValue,
    close: bool,
    is_head: bool,
) {
    let (parts, body) = resp.into_parts();
    status_line(out, parts.status.as_u16(), "");
    for (name, value) in &parts.headers {
        header_line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    header_line(out, X_REQUEST_ID.as_str().as_bytes(), request_id.as_bytes());
    date_line(out);
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let body = full_bytes(body);
    header_line(
        out,
        b"content-length",
        itoa::Buffer::new().format(body.len()).as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    if !is_head {
        out.extend_from_slice(&body);
    }
}

/// The bytes of a gateway-made body, which is always whole.
fn full_bytes(body: Body) -> Bytes {
    use http_body::Body as _;
    let mut body = body;
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match Pin::new(&mut body).poll_frame(&mut cx) {
        Poll::Ready(Some(Ok(frame))) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    }
}

/// Ends a request with one of the gateway's own answers, rendered into `out` for the caller
/// to write.
fn answer(
    gw: &Gateway,
    out: &mut BytesMut,
    b: crate::gateway::Begun<'_>,
    resp: Response<Body>,
    close: bool,
    is_head: bool,
) {
    let status = resp.status().as_u16();
    out.clear();
    render_answer(out, resp, &b.request_id, close, is_head);
    gw.finish(b, status);
}

thread_local! {
    static DATE: std::cell::RefCell<(u64, [u8; 29])> = const { std::cell::RefCell::new((u64::MAX, [0; 29])) };
}

/// `date: <IMF-fixdate>`, formatted once a second per thread.
fn date_line(out: &mut BytesMut) {
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let text = httpdate::fmt_http_date(now);
            if text.len() == 29 {
                d.1.copy_from_slice(text.as_bytes());
                d.0 = secs;
            }
        }
        header_line(out, b"date", &d.1);
    });
}

/// How an upstream response's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Fixed(u64),
    Chunked,
    /// Until the upstream closes; the client's connection closes after it too.
    Close,
}

/// Whether a response header is hop-by-hop (the proxy's one list, compared as raw bytes).
fn hop_by_hop(name: &[u8]) -> bool {
    crate::proxy::HOP_BY_HOP
        .iter()
        .any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
}

/// Sends a request head upstream and renders the response head for the client into `out`.
/// A kept connection that fails before any response byte is replaced by a new one when
/// nothing can have been done twice: the write failed, or the request is idempotent.
async fn exchange(
    pool: &ConnPool,
    head: &[u8],
    idempotent: bool,
    is_head: bool,
    extra: &Extra<'_>,
    close: bool,
    out: &mut BytesMut,
) -> Result<(RawConn, Framing, u16, bool), Refusal> {
    let mut fresh_tried = false;
    loop {
        let mut conn = match pool.take_raw() {
            Some(c) => c,
            None => {
                fresh_tried = true;
                Box::pin(pool.connect_raw()).await.map_err(|e| {
                    Refusal::BadGateway(format!(
                        "upstream {} refused the connection: {e}",
                        pool.authority()
                    ))
                })?
            }
        };
        if conn.tcp.write_all(head).await.is_err() {
            if conn.reused || !fresh_tried {
                continue;
            }
            return Err(closed_early(pool));
        }
        match read_head(&mut conn, is_head, extra, close, out).await {
            Ok((framing, status, closes)) => return Ok((conn, framing, status, closes)),
            Err(HeadFailure::ClosedBeforeAnswer) if conn.reused && idempotent => continue,
            Err(HeadFailure::ClosedBeforeAnswer) => return Err(closed_early(pool)),
            Err(HeadFailure::Bad(why)) => {
                return Err(Refusal::BadGateway(format!(
                    "upstream {} sent a response the gateway can't forward: {why}",
                    pool.authority()
                )));
            }
        }
    }
}

fn closed_early(pool: &ConnPool) -> Refusal {
    Refusal::BadGateway(format!(
        "upstream {} closed the connection before answering",
        pool.authority()
    ))
}

enum HeadFailure {
    ClosedBeforeAnswer,
    Bad(&'static str),
}

async fn read_head(
    conn: &mut RawConn,
    is_head: bool,
    extra: &Extra<'_>,
    close: bool,
    out: &mut BytesMut,
) -> Result<(Framing, u16, bool), HeadFailure> {
    let mut got_any = !conn.buf.is_empty();
    loop {
        if !conn.buf.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_UPSTREAM_HEADERS];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&conn.buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = resp.code.unwrap_or(0);
                    if (100..200).contains(&status) {
                        if status == 101 {
                            return Err(HeadFailure::Bad("an upgrade nobody asked for"));
                        }
                        // Interim (100, 103): the final answer follows.
                        conn.buf.advance(n);
                        continue;
                    }
                    let (framing, closes) = render_response(&resp, is_head, extra, close, out)?;
                    conn.buf.advance(n);
                    return Ok((framing, status, closes));
                }
                Ok(httparse::Status::Partial) if conn.buf.len() < MAX_UPSTREAM_HEAD => {}
                Ok(httparse::Status::Partial) => return Err(HeadFailure::Bad("a head over 64 KiB")),
                Err(_) => return Err(HeadFailure::Bad("a malformed head")),
            }
        }
        conn.buf.reserve(READ_SIZE);
        match conn.tcp.read_buf(&mut conn.buf).await {
            Ok(0) | Err(_) if !got_any => return Err(HeadFailure::ClosedBeforeAnswer),
            Ok(0) | Err(_) => return Err(HeadFailure::Bad("the connection closed mid-head")),
            Ok(_) => got_any = true,
        }
    }
}

/// The client's response head: the upstream's, less hop-by-hop headers (and those its
/// `Connection` names) and what the gateway sets itself, plus the gateway's headers. Returns
/// the body's framing and whether the upstream closes the connection after it.
fn render_response(
    resp: &httparse::Response<'_, '_>,
    is_head: bool,
    extra: &Extra<'_>,
    close: bool,
    out: &mut BytesMut,
) -> Result<(Framing, bool), HeadFailure> {
    let status = resp.code.unwrap_or(0);
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut encoded = false;
    let mut upstream_closes = resp.version == Some(0);
    let mut dated = false;
    let mut connection_named: smallvec::SmallVec<[&[u8]; 4]> = smallvec::SmallVec::new();
    for h in resp.headers.iter() {
        let n = h.name.as_bytes();
        if n.eq_ignore_ascii_case(b"content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or(HeadFailure::Bad("an invalid Content-Length"))?;
            if length.is_some_and(|l| l != v) {
                return Err(HeadFailure::Bad("disagreeing Content-Length headers"));
            }
            length = Some(v);
        } else if n.eq_ignore_ascii_case(b"transfer-encoding") {
            encoded = true;
            chunked = h
                .value
                .rsplit(|&c| c == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if n.eq_ignore_ascii_case(b"connection") {
            for token in h.value.split(|&c| c == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    upstream_closes = true;
                } else if resp.version == Some(0) && token.eq_ignore_ascii_case(b"keep-alive") {
                    upstream_closes = false;
                } else if !token.is_empty() {
                    connection_named.push(token);
                }
            }
        } else if n.eq_ignore_ascii_case(b"date") {
            dated = true;
        }
    }
    let framing = if is_head || status == 204 || status == 304 {
        Framing::Empty
    } else if encoded {
        if !chunked {
            return Err(HeadFailure::Bad("a transfer coding other than chunked"));
        }
        Framing::Chunked
    } else if let Some(n) = length {
        if n == 0 { Framing::Empty } else { Framing::Fixed(n) }
    } else {
        Framing::Close
    };
    status_line(out, status, resp.reason.unwrap_or(""));
    for h in resp.headers.iter() {
        let n = h.name.as_bytes();
        if hop_by_hop(n) || connection_named.iter().any(|c| c.eq_ignore_ascii_case(n)) || extra.replaces(n) {
            continue;
        }
        header_line(out, n, h.value);
    }
    extra.render(out);
    if !dated {
        date_line(out);
    }
    if framing == Framing::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if close || framing == Framing::Close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok((framing, upstream_closes))
}

enum Relayed {
    /// The body went through; `clean` when the upstream sent nothing past its end.
    Done { clean: bool },
    /// The client or the upstream failed mid-body: close the client's connection.
    Broken,
}

/// Sends the rendered head and the body to the client, reading the body from the upstream
/// with `idle` as the longest wait for each read.
async fn relay(
    conn: &mut RawConn,
    client: &mut TcpStream,
    out: &mut BytesMut,
    framing: Framing,
    idle: Duration,
) -> Relayed {
    let mut left = match framing {
        Framing::Fixed(n) => n,
        _ => 0,
    };
    let mut chunks = Chunks::default();
    loop {
        // Move what the upstream sent so far into `out`, up to the body's end.
        let (take, done) = match framing {
            Framing::Empty => (0, true),
            Framing::Fixed(_) => {
                let take = (conn.buf.len() as u64).min(left) as usize;
                left -= take as u64;
                (take, left == 0)
            }
            Framing::Chunked => match chunks.scan(&conn.buf) {
                Ok(Some(end)) => (end, true),
                Ok(None) => (conn.buf.len(), false),
                Err(()) => return Relayed::Broken,
            },
            Framing::Close => (conn.buf.len(), false),
        };
        out.extend_from_slice(&conn.buf[..take]);
        conn.buf.advance(take);
        if !out.is_empty() {
            if client.write_all(out).await.is_err() {
                return Relayed::Broken;
            }
            out.clear();
        }
        if done {
            // Bytes past the response's end mean the upstream framed it differently from us.
            return Relayed::Done {
                clean: conn.buf.is_empty(),
            };
        }
        conn.buf.reserve(READ_SIZE);
        match tokio::time::timeout(idle, conn.tcp.read_buf(&mut conn.buf)).await {
            Ok(Ok(0)) if framing == Framing::Close => {
                return Relayed::Done { clean: false };
            }
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Relayed::Broken,
            Ok(Ok(_)) => {}
        }
    }
}

/// Finds the end of a chunked body as its bytes stream past, without copying them.
#[derive(Debug, Default)]
struct Chunks {
    state: ChunkState,
    size: u64,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    /// Past a `;` extension or whitespace, up to the line's end.
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// At the start of a trailer line, or of the final empty line.
    TrailerStart,
    TrailerLine,
    EndLf,
}

impl Chunks {
    /// The offset just past the body's end, if it is in `data`; `Err` on malformed framing.
    /// Each call continues where the last one stopped.
    fn scan(&mut self, data: &[u8]) -> Result<Option<usize>, ()> {
        let mut i = 0;
        while i < data.len() {
            let c = data[i];
            match self.state {
                ChunkState::Size => match c {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (c as char).to_digit(16).ok_or(())? as u64;
                        self.size = self.size.checked_mul(16).ok_or(())?.checked_add(d).ok_or(())?;
                        if self.size > 1 << 48 {
                            return Err(());
                        }
                    }
                    b';' | b' ' | b'\t' => self.state = ChunkState::Extension,
                    b'\r' => self.state = ChunkState::SizeLf,
                    _ => return Err(()),
                },
                ChunkState::Extension => {
                    if c == b'\r' {
                        self.state = ChunkState::SizeLf;
                    }
                }
                ChunkState::SizeLf => {
                    if c != b'\n' {
                        return Err(());
                    }
                    self.state = if self.size == 0 {
                        ChunkState::TrailerStart
                    } else {
                        ChunkState::Data
                    };
                }
                ChunkState::Data => {
                    let take = (data.len() - i).min(self.size as usize);
                    self.size -= take as u64;
                    i += take;
                    if self.size == 0 {
                        self.state = ChunkState::DataCr;
                    }
                    continue;
                }
                ChunkState::DataCr => {
                    if c != b'\r' {
                        return Err(());
                    }
                    self.state = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if c != b'\n' {
                        return Err(());
                    }
                    self.state = ChunkState::Size;
                }
                ChunkState::TrailerStart => {
                    self.state = if c == b'\r' {
                        ChunkState::EndLf
                    } else {
                        ChunkState::TrailerLine
                    };
                }
                ChunkState::TrailerLine => {
                    if c == b'\n' {
                        self.state = ChunkState::TrailerStart;
                    }
                }
                ChunkState::EndLf => {
                    if c != b'\n' {
                        return Err(());
                    }
                    *self = Chunks::default();
                    return Ok(Some(i + 1));
                }
            }
            i += 1;
        }
        Ok(None)
    }
}

/// A connection whose first bytes were already read: they are read again first.
pub struct Prefixed<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(prefix: Bytes, inner: T) -> Prefixed<T> {
        Prefixed { prefix, inner }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_all(body: &[u8], step: usize) -> Result<Option<usize>, ()> {
        let mut c = Chunks::default();
        let mut at = 0;
        for piece in body.chunks(step) {
            if let Some(end) = c.scan(piece)? {
                return Ok(Some(at + end));
            }
            at += piece.len();
        }
        Ok(None)
    }

    #[test]
    fn chunked_end_is_found_in_any_split() {
        let body = b"5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\nNEXT";
        let end = body.len() - 4;
        for step in 1..body.len() {
            assert_eq!(scan_all(body, step), Ok(Some(end)), "split every {step} bytes");
        }
        assert_eq!(scan_all(b"0\r\n\r\n", 1), Ok(Some(5)));
        assert_eq!(scan_all(b"5\r\nhel", 3), Ok(None));
    }

    proptest::proptest! {
        /// Hostile bytes from a client or an upstream: the head parser and the chunk scanner
        /// answer every input (take it, wait for more, or leave it to hyper / refuse it) and
        /// never panic; a found chunked end is inside the bytes scanned.
        #[test]
        fn any_bytes_get_an_answer(data in proptest::collection::vec(proptest::num::u8::ANY, 0..600), split in 1usize..64) {
            let mut head = Head::default();
            if let Parsed::Lane = parse(&data, &mut head) {
                proptest::prop_assert!(head.len <= data.len());
                let bytes = Bytes::from(data.clone());
                let _ = head.to_parts(&bytes.slice(..head.len));
            }
            if let Ok(Some(end)) = scan_all(&data, split) {
                proptest::prop_assert!(end <= data.len());
            }
        }

        /// Any chunked body, cut anywhere, ends where it was written to end.
        #[test]
        fn chunked_bodies_end_where_written(sizes in proptest::collection::vec(1usize..300, 0..8), split in 1usize..50) {
            let mut body = Vec::new();
            for n in &sizes {
                body.extend_from_slice(format!("{n:x}\r\n").as_bytes());
                body.extend(std::iter::repeat_n(b'a', *n));
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n\r\n");
            let end = body.len();
            body.extend_from_slice(b"GET / HTTP/1.1\r\n");
            proptest::prop_assert_eq!(scan_all(&body, split), Ok(Some(end)));
        }
    }

    #[test]
    fn malformed_chunks_are_refused() {
        for bad in [&b"z\r\n"[..], b"5\r\nhelloXX", b"5\n", b"fffffffffffffffff\r\n"] {
            assert_eq!(scan_all(bad, 64), Err(()), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_lane_takes_only_plain_bodiless_heads() {
        let lane = |raw: &str| matches!(parse(raw.as_bytes(), &mut Head::default()), Parsed::Lane);
        assert!(lane("GET /v1/orders HTTP/1.1\r\nHost: a\r\nX-API-Key: k\r\n\r\n"));
        assert!(lane(
            "DELETE /x HTTP/1.1\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"
        ));
        for other in [
            "GET /x HTTP/1.0\r\n\r\n",
            "POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
            "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET /x HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
            "GET /x HTTP/1.1\r\nConnection: close\r\n\r\n",
            "GET /x HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
            "GET /x HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "GET http://a/x HTTP/1.1\r\n\r\n",
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "BREW /x HTTP/1.1\r\n\r\n",
            "GET /x HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
        ] {
            assert!(!lane(other), "the lane took {other:?}");
        }
        assert!(matches!(
            parse(b"GET /x HTTP/1.1\r\nHost:", &mut Head::default()),
            Parsed::Partial
        ));
    }
}
