//! The gateway's one HTTP/1.1 client to upstreams, used by both paths: the express lane relays
//! the response body verbatim from the connection it gets back; hyper's path wraps it in an
//! [`UpstreamBody`] that decodes it into frames. The request head, the retry policy, the
//! response head's judgement ([`tollgate_http1::response`]) and the connection's life
//! ([`super::pool`]) are the same for both, so the two paths can't answer differently.
//!
//! On a kept connection, bytes from the upstream before the request was fully written can
//! only be a response to something else (a stray the pool's checks could not see yet): the
//! exchange fails with [`Failure::EarlyBytes`] and the connection is closed; they are never
//! taken for the answer. On a new connection an early answer (a 413 before the body was
//! read) is the upstream's to give, and is forwarded.
//!
//! Retry policy, in one place: a request goes out again, once, on a new connection when it
//! can't have been acted on twice: the kept connection failed before the request left
//! (writing the head failed), or it closed before any byte of an answer and the request is
//! idempotent without a streamed body. On an upstream of several targets, an idempotent
//! request's body of up to 64 KiB is kept as it goes out, so it too may go to another target.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderValue;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use smallvec::SmallVec;
use tokio::io::AsyncWriteExt;
use tokio::time::Sleep;

use super::HeaderEdits;
use super::body::BoxError;
use super::pool::{ConnPool, RawConn, Stream};
use super::targets::{Outcome, Picking, RetryWhy, Targets};
use tollgate_http1::chunked::{ChunkError, Decoder};
use tollgate_http1::response::{self, Framing, Head, Parsed, Unforwardable};

const READ_SIZE: usize = 8 * 1024;

/// Why an exchange with an upstream failed.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// No connection could be made: the request never left.
    #[error("{0}")]
    Unreachable(String),
    /// The connection failed before any byte of an answer; `sent` when the request may have
    /// reached the upstream.
    #[error("the connection closed before an answer ({why})")]
    Closed { sent: bool, why: String },
    /// The upstream answered with something that can't be forwarded.
    #[error("{0}")]
    Unforwardable(#[from] Unforwardable),
    /// The client's body failed (too large, malformed, reset).
    #[error("the request body failed: {0}")]
    ClientBody(BoxError),
    /// The client sent no body bytes for the body timeout.
    #[error("the request body stalled")]
    ClientStalled,
    /// No response head within the upstream's timeout.
    #[error("no answer in time")]
    TimedOut,
    /// The client closed its connection while the upstream was asked (the express lane
    /// watches for it; hyper drops the request instead).
    #[error("the client closed its connection")]
    ClientGone,
    /// A kept connection had bytes from the upstream before the request was fully written.
    #[error("the upstream sent bytes before the request was written; the connection was closed")]
    EarlyBytes,
}

impl Failure {
    /// Whether the upstream can't have seen the request: it is then not charged.
    pub fn undelivered(&self) -> bool {
        matches!(
            self,
            Failure::Unreachable(_) | Failure::Closed { sent: false, .. }
        )
    }
}

/// The request's body and how it goes upstream.
pub(crate) struct Outgoing<'a, B> {
    pub body: &'a mut B,
    /// Chunked when the client's length is unknown (HTTP/2 without `content-length`, or a
    /// chunked HTTP/1 body, which hyper decoded).
    pub chunked: bool,
    /// The longest wait for the client's next body bytes.
    pub timeout: Duration,
}

/// Writes the upstream's request head: the method, the routed target and the client's headers
/// through `edits`.
pub(crate) fn render_request(
    out: &mut BytesMut,
    parts: &http::request::Parts,
    edits: &HeaderEdits,
    chunked: bool,
) {
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.extend_from_slice(b" ");
    out.extend_from_slice(parts.uri.path_and_query().map_or("/", |p| p.as_str()).as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        // `Expect` is the client's exchange with the gateway, which answered it: an upstream
        // that answered `100 Continue` too would send bytes while the body is still going out.
        if edits.keeps(name) && name != http::header::EXPECT {
            header_line(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    for (name, value) in &edits.set {
        header_line(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

pub(crate) fn header_line(out: &mut BytesMut, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Which target an exchange ended on, and how many attempts it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Attempted {
    pub target: usize,
    pub attempts: u8,
}

/// Sends a request head (and body) upstream and reads the final response head, which
/// `on_head` sees judged. Returns the connection, positioned at the response body, what
/// `on_head` made, and the target that answered.
///
/// The target is `targets`' pick. A request goes to another target when its connection
/// failed before any byte of it was written (always safe), or, when it is `idempotent` (its
/// method, or an `Idempotency-Key`) and has no body or one the gateway kept whole (at most
/// [`KEPT_BODY`]), when the target closed
/// before any byte of an answer or answered 502, 503 or 504: at most the upstream's retry
/// attempts, never the same target twice, and those the target saw within its retry budget.
/// A 502, 503 or 504 that no retry follows is the answer. `on_head` sees only the answer
/// kept, so nothing of a discarded one reaches the client.
///
/// `timeout` bounds each wait on the upstream: a write it doesn't take, and its answer after
/// the request is sent. A client's slow body is its own timeout's business, not the
/// upstream's. `None` when the caller bounds the whole (a request without a body).
///
/// `tried` is the target of the attempt under way and the attempts so far, kept up as each
/// begins: a request that fails, or whose exchange its caller stops (the lane's deadline, a
/// client gone), still says where it went.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn exchange<B, R>(
    targets: &Targets,
    picking: Picking,
    head: &[u8],
    mut body: Option<Outgoing<'_, B>>,
    idempotent: bool,
    asked: response::Asked<'_>,
    timeout: Option<Duration>,
    tried_so_far: &mut Attempted,
    mut on_head: impl FnMut(&Head<'_>) -> R,
) -> Result<(RawConn, R, Attempted), Failure>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let bodiless = body.as_ref().is_none_or(|b| b.body.is_end_stream());
    // What of the body went out, kept while it is small enough to send again on another
    // target; only an idempotent request with a body to an upstream of several targets keeps
    // any.
    let mut kept = Kept::new(idempotent && !bodiless && targets.several());
    targets.count_request();
    let mut tried: SmallVec<[usize; 4]> = SmallVec::new();
    let mut retries = 0u32;
    // Whether another attempt on another target may follow `failed`, for `why`.
    let again = |tried: &[usize], retries: u32, why: RetryWhy| {
        targets.several() && tried.len() < targets.list.len() && targets.may_retry(why, retries)
    };
    loop {
        // Targets that filled up between being picked and taken are passed over for this
        // attempt; with every untried one full, the first untried goes anyway.
        let mut full: SmallVec<[usize; 4]> = SmallVec::new();
        let (t, _in_flight) = loop {
            let picked = if full.is_empty() {
                targets.pick(picking, &tried)
            } else {
                let mut skip = tried.clone();
                skip.extend_from_slice(&full);
                targets.pick(picking, &skip)
            };
            match picked {
                Some(t) => match targets.begin(t) {
                    Some(g) => break (t, g),
                    None => full.push(t),
                },
                None => {
                    let t = (0..targets.list.len())
                        .find(|i| !tried.contains(i))
                        .expect("a target is untried while another attempt may go");
                    break (t, targets.begin_anyway(t));
                }
            }
        };
        tried.push(t);
        let target = &targets.list[t];
        let attempted = Attempted {
            target: t,
            attempts: tried.len() as u8,
        };
        *tried_so_far = attempted;
        match attempt(
            &target.pool,
            head,
            &mut body,
            &mut kept,
            idempotent && bodiless,
            asked,
            timeout,
            &mut |h: &Head<'_>, replayable: bool| {
                if matches!(h.status, 502..=504)
                    && idempotent
                    && replayable
                    && again(&tried, retries, RetryWhy::ErrorStatus)
                {
                    None
                } else {
                    Some(on_head(h))
                }
            },
        )
        .await
        {
            Ok((conn, Some(r), failed)) => {
                let status = if failed { Outcome::ErrorStatus } else { Outcome::Ok };
                targets.record(t, status, || "answered 502, 503 or 504".into());
                return Ok((conn, r, attempted));
            }
            Ok((conn, None, _)) => {
                // A 502, 503 or 504 another target may answer better: this one's connection
                // still holds its body, so it goes.
                drop(conn);
                targets.record(t, Outcome::ErrorStatus, || "answered 502, 503 or 504".into());
                retries += 1;
            }
            Err(e) => {
                let (outcome, why) = match &e {
                    Failure::Unreachable(_) | Failure::Closed { sent: false, .. } => {
                        (Outcome::ConnectFailure, RetryWhy::ConnectFailure)
                    }
                    Failure::Closed { sent: true, .. } => (Outcome::Reset, RetryWhy::Reset),
                    Failure::TimedOut => (Outcome::Timeout, RetryWhy::Reset),
                    _ => return Err(e),
                };
                targets.record(t, outcome, || e.to_string());
                let safe = match outcome {
                    Outcome::ConnectFailure => true,
                    Outcome::Reset => idempotent && (bodiless || kept.whole()),
                    _ => false,
                };
                if !safe || !again(&tried, retries, why) {
                    return Err(e);
                }
                tracing::debug!(target = %target.label, error = %e, "upstream target failed; trying another");
                retries += 1;
            }
        }
    }
}

/// The most of a request body kept to send again on another target.
pub(crate) const KEPT_BODY: usize = 64 * 1024;

/// The bytes of a request body as they went upstream (chunk framing and all), while they fit
/// in [`KEPT_BODY`]: once the body has ended within it, another attempt sends these instead
/// of the body, which is spent.
struct Kept {
    bytes: BytesMut,
    state: KeptState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KeptState {
    /// Not kept: a request that is never sent twice, or a body past the size.
    Off,
    Filling,
    /// The body ended and every byte of it is here.
    Whole,
}

impl Kept {
    fn new(on: bool) -> Kept {
        Kept {
            bytes: BytesMut::new(),
            state: if on { KeptState::Filling } else { KeptState::Off },
        }
    }

    fn whole(&self) -> bool {
        self.state == KeptState::Whole
    }

    fn keep(&mut self, wire: &[u8]) {
        if self.state != KeptState::Filling {
            return;
        }
        if self.bytes.len() + wire.len() > KEPT_BODY + KEPT_BODY / 8 {
            // Past the size (the eighth is room for chunk framing): nothing is kept.
            self.state = KeptState::Off;
            self.bytes = BytesMut::new();
        } else {
            self.bytes.extend_from_slice(wire);
        }
    }

    fn ended(&mut self) {
        if self.state == KeptState::Filling {
            self.state = KeptState::Whole;
        }
    }

    /// The body did not all go out (the upstream stopped reading): what is kept can't stand
    /// for it.
    fn lost(&mut self) {
        self.state = KeptState::Off;
        self.bytes = BytesMut::new();
    }
}

/// One attempt on one target: [`exchange`]'s request on `pool`, with the one retry on a new
/// connection after a kept one closed under it. Also says whether the answer was a 502, 503
/// or 504.
#[allow(clippy::too_many_arguments)]
async fn attempt<B, R>(
    pool: &ConnPool,
    head: &[u8],
    body: &mut Option<Outgoing<'_, B>>,
    kept: &mut Kept,
    bodiless_idempotent: bool,
    asked: response::Asked<'_>,
    timeout: Option<Duration>,
    on_head: &mut impl FnMut(&Head<'_>, bool) -> Option<R>,
) -> Result<(RawConn, Option<R>, bool), Failure>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut retried = false;
    loop {
        // The one retry after an answerless close goes out on a new connection.
        let idle = if retried { None } else { pool.take() };
        let (mut conn, fresh) = match idle {
            Some(c) => (c, false),
            None => {
                // Boxed: connecting is the rare path, and its future would make every request's
                // larger.
                let c = Box::pin(pool.connect())
                    .await
                    .map_err(|e| Failure::Unreachable(e.to_string()))?;
                (c, true)
            }
        };
        if let Err(e) = bounded(timeout, conn.io.send(head)).await? {
            if !fresh {
                // A kept connection the upstream closed just now: nothing left.
                continue;
            }
            return Err(Failure::Closed {
                sent: false,
                why: e.to_string(),
            });
        }
        if kept.whole() {
            // An attempt after one that sent the whole body: the kept bytes stand for it.
            if let Err(e) = bounded(timeout, conn.io.send(&kept.bytes)).await? {
                return Err(Failure::Closed {
                    sent: true,
                    why: e.to_string(),
                });
            }
        } else if let Some(out) = body.as_mut()
            && !out.body.is_end_stream()
            && let Err(e) = send_body(&mut conn, out, timeout, kept).await
        {
            if matches!(e, Failure::EarlyBytes) {
                pool.stray_seen();
            }
            return Err(e);
        }
        // Whether this request may go out again on another connection or target.
        let replayable = bodiless_idempotent || kept.whole();
        let mut failed_status = false;
        let read = bounded(
            timeout,
            read_head(&mut conn, asked, &mut |h: &Head<'_>| {
                failed_status = matches!(h.status, 502..=504);
                on_head(h, replayable)
            }),
        )
        .await?;
        match read {
            Ok(r) => return Ok((conn, r, failed_status)),
            Err(HeadFailure::ClosedBeforeAnswer(why)) => {
                if !fresh && !retried && replayable {
                    retried = true;
                    tracing::debug!(authority = %pool.authority(), %why, "kept upstream connection closed under a request; sending it again on a new one");
                    continue;
                }
                return Err(Failure::Closed { sent: true, why });
            }
            Err(HeadFailure::Bad(why)) => return Err(Failure::Unforwardable(why)),
        }
    }
}

/// Streams the client's body upstream. A client that stops sending for the body timeout gets
/// 408; a body that fails gets its own answer (413, 400), never a 502 blaming the upstream.
async fn send_body<B>(
    conn: &mut RawConn,
    out: &mut Outgoing<'_, B>,
    timeout: Option<Duration>,
    kept: &mut Kept,
) -> Result<(), Failure>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut frame_head = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout(out.timeout, out.body.frame()).await {
            Err(_) => return Err(Failure::ClientStalled),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(Failure::ClientBody(e.into())),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            // Trailers: not forwarded.
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if conn.reused
            && matches!(
                super::pool::look(&mut conn.io),
                super::pool::Socket::Stray | super::pool::Socket::Partial
            )
        {
            return Err(Failure::EarlyBytes);
        }
        let io = &mut conn.io;
        if out.chunked {
            frame_head.clear();
            frame_head.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
            kept.keep(&frame_head);
            kept.keep(&data);
            kept.keep(b"\r\n");
        } else {
            kept.keep(&data);
        }
        let written = bounded(timeout, async {
            if out.chunked {
                io.write_all(&frame_head).await?;
                io.write_all(&data).await?;
                io.send(b"\r\n").await
            } else {
                io.send(&data).await
            }
        })
        .await?;
        if let Err(e) = written {
            // The upstream stopped reading; it may still have answered (413, 400 …): the head
            // read that follows finds out.
            tracing::debug!(error = %e, "upstream stopped reading the request body");
            kept.lost();
            return Ok(());
        }
    }
    if out.chunked {
        kept.keep(b"0\r\n\r\n");
        // A failure here shows in the head read that follows.
        let _ = bounded(timeout, conn.io.send(b"0\r\n\r\n")).await?;
    }
    kept.ended();
    Ok(())
}

/// `f`, given up on after `timeout` when there is one.
async fn bounded<F: std::future::Future>(timeout: Option<Duration>, f: F) -> Result<F::Output, Failure> {
    match timeout {
        None => Ok(f.await),
        Some(t) => tokio::time::timeout(t, f).await.map_err(|_| Failure::TimedOut),
    }
}

enum HeadFailure {
    ClosedBeforeAnswer(String),
    Bad(Unforwardable),
}

async fn read_head<R>(
    conn: &mut RawConn,
    asked: response::Asked<'_>,
    on_head: &mut impl FnMut(&Head<'_>) -> R,
) -> Result<R, HeadFailure> {
    let mut got_any = !conn.buf.is_empty();
    loop {
        if !conn.buf.is_empty() {
            match response::parse(&conn.buf, asked, &mut *on_head) {
                Ok(Parsed::Final(n, r)) => {
                    conn.buf.advance(n);
                    return Ok(r);
                }
                Ok(Parsed::Interim(n)) => {
                    conn.buf.advance(n);
                    continue;
                }
                Ok(Parsed::Partial) => {}
                Err(why) => return Err(HeadFailure::Bad(why)),
            }
        }
        conn.buf.reserve(READ_SIZE);
        match tokio::io::AsyncReadExt::read_buf(&mut conn.io, &mut conn.buf).await {
            Ok(0) if !got_any => return Err(HeadFailure::ClosedBeforeAnswer("end of stream".into())),
            Err(e) if !got_any => return Err(HeadFailure::ClosedBeforeAnswer(e.to_string())),
            Ok(0) | Err(_) => return Err(HeadFailure::Bad(Unforwardable("the connection closed mid-head"))),
            Ok(_) => got_any = true,
        }
    }
}

/// Where a response body is, as its bytes arrive.
#[derive(Debug, Clone)]
pub(crate) struct BodyState {
    framing: Framing,
    left: u64,
    chunks: Decoder,
}

/// One step of a response body over the bytes read so far.
pub(crate) struct Step {
    /// Bytes of `buf` that belong to the body (framing included, for a verbatim relay).
    pub take: usize,
    /// Whether the body ends within them.
    pub done: bool,
}

impl BodyState {
    pub fn new(framing: Framing) -> BodyState {
        BodyState {
            framing,
            left: match framing {
                Framing::Fixed(n) => n,
                _ => 0,
            },
            chunks: Decoder::default(),
        }
    }

    /// How much of `buf` belongs to the body, calling `on_data` with every range of payload
    /// in it (the chunk data for chunked bodies, everything otherwise).
    pub fn step(
        &mut self,
        buf: &[u8],
        mut on_data: impl FnMut(std::ops::Range<usize>),
    ) -> Result<Step, ChunkError> {
        Ok(match self.framing {
            Framing::Empty => Step { take: 0, done: true },
            Framing::Fixed(_) => {
                let take = (buf.len() as u64).min(self.left) as usize;
                self.left -= take as u64;
                if take > 0 {
                    on_data(0..take);
                }
                Step {
                    take,
                    done: self.left == 0,
                }
            }
            Framing::Chunked => match self.chunks.scan(buf, on_data)? {
                Some(end) => Step {
                    take: end,
                    done: true,
                },
                None => Step {
                    take: buf.len(),
                    done: false,
                },
            },
            Framing::Close => {
                if !buf.is_empty() {
                    on_data(0..buf.len());
                }
                Step {
                    take: buf.len(),
                    done: false,
                }
            }
        })
    }

    /// What end of stream means here: the body's end for a close-delimited body, a cut body
    /// for any other.
    pub(crate) fn eof_ends(&self) -> bool {
        self.framing == Framing::Close
    }

    fn remaining(&self) -> Option<u64> {
        match self.framing {
            Framing::Empty => Some(0),
            Framing::Fixed(_) => Some(self.left),
            _ => None,
        }
    }
}

/// Raised when an upstream's body is cut or malformed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BodyError {
    #[error("upstream body stalled for {0:?}")]
    Stalled(Duration),
    #[error("upstream closed the connection mid-body")]
    Cut,
    #[error("upstream body: {0}")]
    Io(std::io::Error),
    #[error("upstream body: {0}")]
    Chunks(#[from] ChunkError),
}

/// An upstream response body for hyper's server, read from the connection `exchange` returned.
/// When it ends cleanly (nothing past its end, the upstream keeps the connection) the connection
/// goes back to its pool; otherwise it is closed. No frame for `idle` fails the body, and the
/// server then ends the client's stream instead of holding it open.
pub struct UpstreamBody {
    conn: Option<RawConn>,
    state: BodyState,
    reusable: bool,
    pool: Arc<ConnPool>,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// The upstream's in-flight place, held until the body is done or dropped.
    _permit: Option<crate::concurrency::Place>,
    /// The key's seats of limits on requests in flight, held as long.
    seats: Vec<tollgate_store::seats::Seat>,
    /// The request's `--access-log-format` line, written when the body is done or dropped.
    access: Option<Box<crate::access::Pending>>,
}

impl UpstreamBody {
    pub(crate) fn new(
        conn: RawConn,
        shape: response::Shape,
        pool: Arc<ConnPool>,
        idle: Duration,
        permit: Option<crate::concurrency::Place>,
    ) -> UpstreamBody {
        let framing = shape.framing;
        let mut b = UpstreamBody {
            conn: Some(conn),
            state: BodyState::new(framing),
            reusable: shape.reusable,
            pool,
            idle,
            timer: None,
            _permit: permit,
            seats: Vec::new(),
            access: None,
        };
        if framing == Framing::Empty {
            b.finish();
        }
        b
    }

    fn finish(&mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.give_back(c, self.reusable);
        }
        self._permit = None;
        self.seats.clear();
    }

    /// Holds `seats` until the body is done or dropped; at once gives them back when it is
    /// done already.
    pub fn hold(&mut self, seats: Vec<tollgate_store::seats::Seat>) {
        if self.conn.is_some() {
            self.seats = seats;
        }
    }

    /// Counts the body's bytes into `line` and hands it over when the body is done or dropped.
    pub(crate) fn log_when_done(&mut self, line: crate::access::Pending) {
        self.access = Some(Box::new(line));
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if !conn.buf.is_empty() {
                let mut pieces: SmallVec<[std::ops::Range<usize>; 4]> = SmallVec::new();
                let step = match this.state.step(&conn.buf, |r| pieces.push(r)) {
                    Ok(s) => s,
                    Err(e) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(Box::new(BodyError::from(e)))));
                    }
                };
                let taken = conn.buf.split_to(step.take).freeze();
                let data = match pieces.len() {
                    0 => Bytes::new(),
                    1 => taken.slice(pieces[0].clone()),
                    _ => {
                        let mut joined = BytesMut::with_capacity(pieces.iter().map(|r| r.len()).sum());
                        for r in pieces {
                            joined.extend_from_slice(&taken[r]);
                        }
                        joined.freeze()
                    }
                };
                if step.done {
                    this.finish();
                }
                if !data.is_empty() {
                    this.timer = None;
                    if let Some(a) = &mut this.access {
                        a.count(data.len());
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                continue;
            }
            conn.buf.reserve(READ_SIZE);
            let read = match conn.io {
                Stream::Plain(ref tcp) => match tcp.poll_read_ready(cx) {
                    Poll::Ready(Ok(())) => Poll::Ready(tcp.try_read_buf(&mut conn.buf)),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                },
                // TLS reads through its session, which may take records and yield no byte.
                Stream::Tls(_) => tokio_util::io::poll_read_buf(Pin::new(&mut conn.io), cx, &mut conn.buf),
            };
            let Poll::Ready(read) = read else {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                ready!(timer.as_mut().poll(cx));
                this.timer = None;
                this.conn = None;
                return Poll::Ready(Some(Err(Box::new(BodyError::Stalled(idle)))));
            };
            match read {
                Ok(0) if this.state.eof_ends() => {
                    this.reusable = false;
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(Box::new(BodyError::Cut))));
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(Box::new(BodyError::Io(e)))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (self.conn.is_none(), self.state.remaining()) {
            (true, _) => SizeHint::with_exact(0),
            (false, Some(n)) => SizeHint::with_exact(n),
            (false, None) => SizeHint::default(),
        }
    }
}

/// A `HeaderValue` for a forwarded upstream header; httparse already refused the bytes a
/// header value can't hold.
pub(crate) fn header_value(v: &[u8]) -> Option<HeaderValue> {
    HeaderValue::from_bytes(v).ok()
}
