//! The express lane: HTTP/1.1 requests without a body, on plain TCP or TLS, read, checked and
//! forwarded inside their connection's own task, on upstream sockets the lane speaks HTTP/1.1
//! on itself. Its [`Wire`] writes heads and relays bodies as bytes; the steps are
//! [`drive`]'s, the same as on hyper's path.
//!
//! Why it exists: hyper's server and client are general (any body, any framing, HTTP/2, a task
//! per upstream connection, a channel between them), and that generality cost about 30,000
//! instructions a request against nginx's 21,000 in total (benches/README.md). The usual API
//! call (a GET with a key, answered with a fixed-length or chunked body) needs little of it.
//!
//! What it takes: HTTP/1.1 heads that parse, in origin form, without `Transfer-Encoding`,
//! `Expect`, `Upgrade`, a body (no `Content-Length` other than one `0`) or `Connection` other
//! than `keep-alive`. Anything else (and h2c, and heads it can't parse or that are too large)
//! hands the connection, with every byte read so far, to hyper for the rest of its life, before
//! the request begins; hyper and the smuggling watcher then see exactly the bytes they would have
//! seen, and answer as they always do.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri, Version};
use tokio::io::AsyncWrite;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

use super::drive::{Wire, drive};
use super::{Begun, Forward, Gateway, X_REQUEST_ID};
use crate::bufs::{self, Lent};
use crate::proxy::client::{self, Attempted, BodyState, Failure, header_line};
use crate::proxy::pool::RawConn;
use crate::proxy::{Ask, Exchanged};
use crate::respond::{Answer, RateFields, Refusal};
use crate::server::{ConnInfo, Ended, LaneIo, Prefixed, ServerLimits};
use http_body_util::Empty;
use tollgate_http1::response::{self, Framing};

/// Headers a lane request may have; more go to hyper (which takes up to 100).
const MAX_HEADERS: usize = 64;
const READ_SIZE: usize = bufs::SIZE;

/// How a run of requests on the lane ended.
enum Next {
    /// No bytes of a next request are waiting: the connection is idle.
    Idle,
    Closed,
    /// Hyper serves the rest, starting with these bytes.
    HandOff(Bytes),
}

/// Serves requests on `io` until the client closes, the server stops, or a request needs the
/// general path.
///
/// An idle keep-alive connection holds only this future: the socket, one deadline and the wait
/// for bytes. What a request needs (buffers, the parsed head, the steps' futures) is in
/// [`serve_waiting`]'s future, boxed when bytes arrive and dropped when none are left, so it costs an
/// idle connection nothing (issue 24). Not an `async fn`, which would keep its arguments beside
/// the locals they move into.
#[allow(clippy::manual_async_fn, reason = "an async fn would store `io` twice")]
pub(crate) fn serve<'a, S: LaneIo>(
    gw: &'a Gateway,
    mut io: S,
    info: &'a ConnInfo,
    limits: &'a ServerLimits,
    stop: &'a mut watch::Receiver<bool>,
) -> impl Future<Output = Ended<S>> + Send + 'a {
    async move {
        // While no request is in flight it is the idle timeout, from the accept or the last
        // response; once a head has begun, the head timeout from its first bytes. It also times
        // the upstream's answer, which is never awaited while a head is: one timer a connection.
        let mut deadline = Deadline::new(limits.idle_timeout);
        if let Some(s) = &info.entry {
            s.idle();
        }
        loop {
            // Bytes may be there already (a first request sent with the connect, a next one
            // sent before the last answer was read): `serve_waiting` tries before anything waits.
            match crate::boxed::boxed(|| serve_waiting(gw, &mut io, info, limits, stop, &mut deadline)).await
            {
                Next::Idle => {}
                Next::Closed => break,
                Next::HandOff(read) => return Ended::HandOff(Prefixed::new(read, io)),
            }
            // Readiness through the socket's own waker slot, not a `readable()` future: that
            // one joins and leaves a list of waiters under a lock on every idle wait (about
            // 300 instructions a request, callgrind).
            tokio::select! {
                biased;
                r = ready_to_read(io.tcp()) => {
                    if r.is_err() {
                        break;
                    }
                }
                () = deadline.passed() => break,
                _ = stop.changed() => break,
            }
        }
        Box::pin(close(io)).await;
        Ended::Closed
    }
}

/// Resolves when the socket has bytes (or is closed); `Send` whatever the connection's type.
fn ready_to_read(tcp: &tokio::net::TcpStream) -> impl Future<Output = std::io::Result<()>> + Send + '_ {
    std::future::poll_fn(move |cx| tcp.poll_read_ready(cx))
}

/// Ends the connection as hyper does: TLS sends its `close_notify` (a client may take a bare
/// close for a truncated answer), then both send their FIN. A client that reads nothing gets
/// a second before the socket is simply dropped.
async fn close<S: LaneIo>(mut io: S) {
    let _ = tokio::time::timeout(Duration::from_secs(1), io.shutdown()).await;
}

/// Serves the requests whose bytes are waiting on `io`, one after another, until none are.
async fn serve_waiting<S: LaneIo>(
    gw: &Gateway,
    io: &mut S,
    info: &ConnInfo,
    limits: &ServerLimits,
    stop: &watch::Receiver<bool>,
    deadline: &mut Deadline,
) -> Next {
    // Lent while the connection is busy, and back to the thread's buffers when it goes idle.
    let mut buf = Lent::default();
    let mut out = Lent::default();
    let mut head_out = BytesMut::new();
    let mut head = Head::default();
    // The deadline and the slot were set when the connection last went idle.
    let mut first = true;
    loop {
        if !first {
            deadline.set(Instant::now() + limits.idle_timeout);
            if let Some(s) = &info.entry {
                s.idle();
            }
        }
        first = false;
        // A head that arrives whole in one read, the usual case, never reads the clock for it.
        let mut head_timed = false;
        loop {
            if buf.is_empty() {
                // Between requests: a buffer only for bytes that are there; none there, and the
                // connection is idle.
                if buf.capacity() == 0 {
                    *buf = bufs::take();
                }
                buf.reserve(READ_SIZE);
                match read_waiting(io, &mut buf).await {
                    None => return Next::Idle,
                    Some(Ok(0) | Err(_)) => return Next::Closed,
                    Some(Ok(_)) => {}
                }
            }
            match parse(&buf, &mut head) {
                Parsed::Lane => break,
                Parsed::Partial if buf.len() < limits.max_header_bytes => {}
                // Too large, unusual or malformed: hyper answers it (431, 400, h2c …).
                _ => return Next::HandOff(std::mem::take(&mut *buf).freeze()),
            }
            if !head_timed {
                // Begun and not finished: the rest is due within the head timeout.
                head_timed = true;
                deadline.set(Instant::now() + limits.header_read_timeout);
            }
            buf.reserve(READ_SIZE);
            tokio::select! {
                biased;
                r = io.read_buf(&mut *buf) => match r {
                    Ok(0) | Err(_) => return Next::Closed,
                    Ok(_) => {}
                },
                () = deadline.passed() => {
                    // A head was started and not finished: say so before closing (RFC 9110
                    // §15.5.9), so the client doesn't take the close for a lost response.
                    tracing::debug!(peer = %info.peer, "request head not finished in time");
                    let _ = send(io, crate::respond::REQUEST_TIMEOUT_HTTP1).await;
                    return Next::Closed;
                }
            }
        }
        // Closed for a newcomer while the head arrived: it must not be served.
        if info.entry.as_ref().is_some_and(|s| !s.enter()) {
            return Next::Closed;
        }
        let request_bytes = buf.split_to(head.len).freeze();
        let Some(parts) = head.to_parts(&request_bytes) else {
            // Bytes httparse took but `http` doesn't: let hyper refuse them as it would.
            let mut rest = BytesMut::from(&request_bytes[..]);
            rest.extend_from_slice(&buf);
            return Next::HandOff(rest.freeze());
        };
        let mut lane = Lane {
            io: &mut *io,
            out: &mut out,
            head_out: &mut head_out,
            deadline: &mut *deadline,
            closing: *stop.borrow(),
            is_head: parts.method == Method::HEAD,
            next_waiting: !buf.is_empty(),
        };
        // The steps are awaited in place: this whole future is boxed only while the connection
        // is busy (`serve`), so they no longer size an idle connection's task, and a box of
        // each cost an allocation and a copy per request (about 750 instructions).
        match drive(gw, parts, info, &mut lane).await {
            Flow::Next => {}
            Flow::Closed => return Next::Closed,
        }
    }
}

/// What the connection does after a request.
enum Flow {
    Next,
    Closed,
}

/// A request on the lane: the connection's socket and buffers, and its deadline, which also
/// times the upstream's answer (never awaited while a head is): one timer a connection.
struct Lane<'c, S> {
    io: &'c mut S,
    out: &'c mut BytesMut,
    head_out: &'c mut BytesMut,
    deadline: &'c mut Deadline,
    /// The server is stopping: the answer says `Connection: close`, and the connection ends.
    closing: bool,
    is_head: bool,
    /// Bytes of a next request are waiting: the client is there.
    next_waiting: bool,
}

/// A lane answer made ready: the gateway's own, rendered into `out` to write, or the
/// upstream's, relayed already.
enum Ready {
    Write { close: bool },
    Relayed(Flow),
}

impl<S: LaneIo> Wire for Lane<'_, S> {
    type Head = Tail;
    type Ready = Ready;
    type Out = Flow;
    const BODIES: bool = false;
    const UPGRADES: bool = false;

    async fn read_body(&mut self, _cap: u64) -> Result<Bytes, Refusal> {
        // The lane takes only requests without a body.
        Ok(Bytes::new())
    }

    fn write_request(&mut self, parts: &http::request::Parts, edits: &crate::proxy::HeaderEdits) {
        self.head_out.clear();
        self.head_out.reserve(1024);
        client::render_request(self.head_out, parts, edits, false);
    }

    async fn exchange(&mut self, ask: Ask<'_>, tried: &mut Attempted) -> Result<Exchanged<Tail>, Failure> {
        let Lane {
            io,
            out,
            head_out,
            deadline,
            is_head,
            next_waiting,
            ..
        } = self;
        start(out);
        deadline.set(Instant::now() + ask.upstream.timeout);
        let exchange = client::exchange::<Empty<Bytes>, _>(
            ask.targets,
            ask.picking,
            head_out,
            None,
            ask.idempotent,
            // The lane hands every upgrade to hyper.
            tollgate_http1::response::Asked {
                head: *is_head,
                upgrade: None,
            },
            None,
            tried,
            |h| (head_start(h, ask.ours, out), h.shape(), ask.capture(h)),
        );
        tokio::pin!(exchange);
        // A client that hangs up while the upstream thinks must not keep its place under the
        // upstream's limit, or its key's seats, until the answer or the timeout. Bytes of a
        // next request already waiting say the client is there: stop watching. Watching costs
        // a syscall, so only requests that hold a limited place or a seat pay it.
        let mut watch = !*next_waiting && ask.holds;
        let (conn, (tail, shape, reported), attempted) = loop {
            tokio::select! {
                biased;
                r = &mut exchange => break r?,
                () = deadline.passed() => return Err(Failure::TimedOut),
                gone = hung_up(io.tcp()), if watch => {
                    if gone {
                        return Err(Failure::ClientGone);
                    }
                    watch = false;
                }
            }
        };
        Ok(Exchanged {
            conn,
            shape,
            head: tail,
            reported,
            attempted,
        })
    }

    async fn answer(&mut self, b: &mut Begun<'_>, a: Answer) -> Ready {
        let close = a.close || self.closing;
        start(self.out);
        let body = write_answer(self.out, a, &b.request_id, close, self.is_head);
        b.body_sent(Some(body));
        Ready::Write { close }
    }

    async fn relay(&mut self, b: &mut Begun<'_>, up: Exchanged<Tail>, f: &mut Forward) -> Ready {
        let Exchanged {
            mut conn,
            shape,
            head: tail,
            attempted,
            ..
        } = up;
        tail.finish(&f.fields, &b.request_id, self.closing, self.out);
        let pool = &b.live.upstreams[f.upstream].targets.list[attempted.target].pool;
        let idle = b.snap.upstreams[f.upstream].timeout;
        let mut sent = 0;
        let relayed = relay(
            &mut conn,
            self.io,
            self.out,
            BodyState::new(shape.framing),
            idle,
            &mut sent,
        )
        .await;
        // Its place and seats go back as the answer ends.
        drop(f.place.take());
        f.seats.clear();
        let flow = match relayed {
            Relayed::Done => {
                pool.give_back(conn, shape.reusable);
                if self.closing { Flow::Closed } else { Flow::Next }
            }
            Relayed::Broken => Flow::Closed,
        };
        b.body_sent(Some(sent));
        Ready::Relayed(flow)
    }

    async fn send(&mut self, ready: Ready) -> Flow {
        match ready {
            Ready::Relayed(flow) => flow,
            Ready::Write { close } => {
                if send(self.io, self.out).await.is_err() || close {
                    Flow::Closed
                } else {
                    Flow::Next
                }
            }
        }
    }

    async fn wait(&mut self, turn: impl Future<Output = ()> + Send) -> bool {
        tokio::pin!(turn);
        // As in the exchange: bytes of a next request say the client is there.
        let mut watch = !self.next_waiting;
        loop {
            tokio::select! {
                biased;
                () = &mut turn => return true,
                gone = hung_up(self.io.tcp()), if watch => {
                    if gone {
                        return false;
                    }
                    watch = false;
                }
            }
        }
    }

    fn gone(&mut self) -> Flow {
        Flow::Closed
    }
}

/// Readies `out` for a response: empty, with room for a head and the first of a body.
fn start(out: &mut BytesMut) {
    out.clear();
    if out.capacity() == 0 {
        *out = bufs::take();
    }
    out.reserve(READ_SIZE);
}

/// Writes all of `bytes` and flushes: TLS holds what the socket didn't take until a flush.
async fn send<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

/// Whether the client closed its side (or the socket failed); false once it has sent more.
async fn hung_up(tcp: &tokio::net::TcpStream) -> bool {
    let mut one = [0u8; 1];
    matches!(tcp.peek(&mut one).await, Ok(0) | Err(_))
}

/// A byte range of a request head.
type Span = (u32, u32);

/// Reads what is waiting on `io` without waiting for more: `None` when nothing is. Through
/// `poll_read`, which marks the socket drained when a read comes back short of the buffer, so
/// asking again after the answer is sent costs no system call; `try_read_buf` keeps the socket
/// marked readable until a read fails, and cost a `recvfrom` that found nothing on nearly every
/// request (strace: 2.6 reads a request against nginx's 2.0).
async fn read_waiting<S: LaneIo>(io: &mut S, buf: &mut BytesMut) -> Option<std::io::Result<usize>> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match tokio_util::io::poll_read_buf(Pin::new(&mut *io), cx, buf) {
            Poll::Ready(r) => Some(r),
            Poll::Pending => None,
        })
    })
    .await
}

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
    // Left uninitialised, as the upstream's heads are (`tollgate_http1::response::parse`).
    let mut headers = [std::mem::MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, &mut headers) {
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

/// Writes one of the gateway's own answers, with `Date`, `Content-Length` and the request id.
/// Returns the bytes of its body written.
fn write_answer(out: &mut BytesMut, a: Answer, request_id: &HeaderValue, close: bool, is_head: bool) -> u64 {
    status_line(out, a.status(), "");
    header_line(out, b"content-type", b"application/json");
    for (name, value) in a.refusal.fields() {
        header_line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    a.fields.write_http1(out);
    header_line(out, X_REQUEST_ID.as_str().as_bytes(), request_id.as_bytes());
    date_line(out);
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let body = a.refusal.body_text();
    header_line(
        out,
        b"content-length",
        itoa::Buffer::new().format(body.len()).as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    if is_head {
        return 0;
    }
    out.extend_from_slice(body.as_bytes());
    body.len() as u64
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

/// The start of the client's response head from the upstream's judged one: the status line
/// and the upstream's forwarded headers, less those the gateway sets itself. The rest waits
/// for the gateway's fields ([`Tail::finish`]), which a post-paid debit may change.
fn head_start(h: &response::Head<'_>, ours: bool, out: &mut BytesMut) -> Tail {
    status_line(out, h.status, h.reason);
    for x in h.headers {
        let n = x.name.as_bytes();
        if h.forwards(n)
            && !n.eq_ignore_ascii_case(X_REQUEST_ID.as_str().as_bytes())
            && !(ours && crate::proxy::rate_field(n))
        {
            header_line(out, n, x.value);
        }
    }
    Tail {
        dated: h.dated,
        length: h.length,
        framing: h.framing,
    }
}

/// What the client's response head still needs once the upstream's headers are written.
pub(crate) struct Tail {
    dated: bool,
    length: Option<u64>,
    framing: Framing,
}

impl Tail {
    /// Ends the head: the gateway's fields, the request id, `Date` when the upstream sent
    /// none, and the framing.
    fn finish(&self, fields: &RateFields, request_id: &HeaderValue, close: bool, out: &mut BytesMut) {
        fields.write_http1(out);
        header_line(out, X_REQUEST_ID.as_str().as_bytes(), request_id.as_bytes());
        if !self.dated {
            date_line(out);
        }
        if let Some(n) = self.length {
            header_line(out, b"content-length", itoa::Buffer::new().format(n).as_bytes());
        }
        // A close-delimited body goes to the client chunked, as hyper's server sends it, so
        // the client's connection outlives the upstream's.
        if matches!(self.framing, Framing::Chunked | Framing::Close) {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        if close {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
    }
}

enum Relayed {
    /// The body went through; the connection holds whatever the upstream sent past its end.
    Done,
    /// The client or the upstream failed mid-body: close the client's connection.
    Broken,
}

/// Sends the rendered head and the body to the client, reading the body from the upstream
/// with `idle` as the longest wait for each read. The body's bytes go through as they came,
/// framing and all, except a close-delimited body, which is chunked on the way. `sent` counts
/// the body's bytes the client's socket took, without chunk framing.
async fn relay<S: LaneIo>(
    conn: &mut RawConn,
    client: &mut S,
    out: &mut BytesMut,
    mut body: BodyState,
    idle: Duration,
    sent: &mut u64,
) -> Relayed {
    let rechunk = body.eof_ends();
    loop {
        // Move what the upstream sent so far into `out`, up to the body's end.
        let mut payload = 0;
        let Ok(step) = body.step(&conn.buf, |r| payload += r.len() as u64) else {
            return Relayed::Broken;
        };
        if rechunk && step.take > 0 {
            out.extend_from_slice(format!("{:x}\r\n", step.take).as_bytes());
            out.extend_from_slice(&conn.buf[..step.take]);
            out.extend_from_slice(b"\r\n");
        } else {
            out.extend_from_slice(&conn.buf[..step.take]);
        }
        conn.buf.advance(step.take);
        if !out.is_empty() {
            if send(client, out).await.is_err() {
                return Relayed::Broken;
            }
            out.clear();
        }
        *sent += payload;
        if step.done {
            // Bytes past the response's end mean the upstream framed it differently from us.
            return Relayed::Done;
        }
        conn.buf.reserve(READ_SIZE);
        match tokio::time::timeout(idle, conn.io.read_buf(&mut conn.buf)).await {
            Ok(Ok(0)) if rechunk => {
                return match send(client, b"0\r\n\r\n").await {
                    // The upstream closed: its connection is not reusable, whatever is left.
                    Ok(()) => Relayed::Done,
                    Err(_) => Relayed::Broken,
                };
            }
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return Relayed::Broken,
            Ok(Ok(_)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpStream;

    /// An idle keep-alive connection holds this future and nothing of a request (issue 24):
    /// the buffers, the parsed head and the steps live in `serve_waiting`'s boxed future. Inline, the
    /// head alone is larger than this bound; the future measured 440 bytes when this was
    /// written, unoptimised (less in a release build).
    fn gateway() -> Gateway {
        let snap = tollgate_rules::compile(
            br#"{"version": 3, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
                "routes": [{"method": "GET", "path": "/", "upstream": "u", "key": "optional"}]}"#,
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap();
        Gateway::new(crate::request::Parts::new(
            std::sync::Arc::new(arc_swap::ArcSwap::from_pointee(snap)),
            std::sync::Arc::new(tollgate_store::memory::MemoryStore::new(
                tollgate_limit::clock::ManualClock::new(0),
            )),
            Default::default(),
            tollgate_telemetry::metrics::Metrics::new(),
        ))
    }

    /// hyper moves the service's future into each h2 stream's task, and the task into tokio's
    /// cell: the gateway's general path is boxed inside it, so those moves copy the request
    /// and a pointer, not the path's whole future (376 and 1,344 bytes when this was written,
    /// unoptimised).
    #[test]
    fn hypers_service_future_holds_the_general_path_boxed() {
        let info = ConnInfo {
            peer: "127.0.0.1:1".parse().unwrap(),
            proto: "http",
            flagged_heads: None,
            fingerprint: Default::default(),
            entry: None,
        };
        let (call, path) = crate::server::service_future_sizes(std::sync::Arc::new(gateway()), info);
        assert!(call <= 512, "hyper's service future is {call} bytes");
        assert!(
            path > 2 * call,
            "the general path's future is {path} bytes, the service's {call}"
        );
    }

    #[tokio::test]
    async fn an_idle_connection_holds_only_a_small_future() {
        let gw = gateway();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (tcp, peer) = listener.accept().await.unwrap();
        let info = ConnInfo {
            peer,
            proto: "http",
            flagged_heads: None,
            fingerprint: Default::default(),
            entry: None,
        };
        let limits = ServerLimits::default();
        let (_tx, mut stop) = watch::channel(false);
        let idle = serve(&gw, tcp, &info, &limits, &mut stop);
        let size = std::mem::size_of_val(&idle);
        assert!(size <= 512, "an idle connection's future is {size} bytes");
        drop(idle);

        // The whole task: the lane's future, what the connection keeps for a hand-off to
        // hyper, and the eviction wait. With tokio's header and trailer (about 128 bytes) its
        // cell stays within the allocator's 768-byte class; it was 808 bytes and a
        // 1,024-byte cell before the listener's shared part was held by one pointer.
        let _client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        let task = crate::server::idle_task_size(std::sync::Arc::new(gw), tcp, info);
        assert!(task <= 640, "an idle connection's task future is {task} bytes");
    }

    proptest::proptest! {
        /// Hostile bytes from a client: the head parser answers every input (take it, wait for
        /// more, or leave it to hyper) and never panics.
        #[test]
        fn any_bytes_get_an_answer(data in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            let mut head = Head::default();
            if let Parsed::Lane = parse(&data, &mut head) {
                proptest::prop_assert!(head.len <= data.len());
                let bytes = Bytes::from(data.clone());
                let _ = head.to_parts(&bytes.slice(..head.len));
            }
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
