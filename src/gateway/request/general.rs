//! hyper's path: the [`Wire`] of every request the express lane leaves to hyper (HTTP/2, bodies,
//! unusual heads). Bodies stream through hyper's types both ways; the answer is a `Response`
//! that hyper writes after the request is recorded.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Version};
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use hyper::body::Incoming;

use super::drive::{Wire, drive};
use super::{Begun, Forward, Gateway, X_REQUEST_ID, access_line};
use crate::proxy::body::LimitedBody;
use crate::proxy::client::{Attempted, Failure, UpstreamBody};
use crate::proxy::{Ask, Exchanged, Proxy};
use crate::respond::{Answer, Body, Refusal, UpBody};
use crate::server::ConnInfo;

impl Gateway {
    /// Serves one request that hyper read.
    pub(crate) async fn serve(&self, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        // hyper hands the connection over here once it has sent a `101`; only a request with
        // `Upgrade` has one, and most requests' extensions are an empty map, one branch.
        let on_upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>();
        let mut wire = General {
            gw: self,
            version: parts.version,
            body: Either::Left(LimitedBody::new(body, None)),
            head: bytes::BytesMut::new(),
            answer: None,
            conn: &conn,
            on_upgrade,
            switch_to: None,
        };
        // Boxed so the future hyper keeps for every request stays small.
        crate::boxed::boxed(|| drive(self, parts, &conn, &mut wire)).await;
        match wire.answer {
            Some(resp) => resp,
            // The driver makes an answer for every request it ends; this is never reached.
            None => {
                tracing::error!("a request's steps ended without an answer");
                Answer::from(Refusal::BadGateway("no answer was made".into())).into_response()
            }
        }
    }
}

/// A request on hyper's path: its HTTP version and its body.
struct General<'g> {
    gw: &'g Gateway,
    version: Version,
    /// The client's body: streamed upstream under the route's limit, or read whole first
    /// when a limit keys on a field of it.
    body: UpBody,
    /// The upstream's request head.
    head: bytes::BytesMut,
    /// The answer for hyper, made where it is read: a response with an upstream's body is a
    /// few hundred bytes, and each `async` level it was returned through copied it (about
    /// 400 instructions a request, callgrind).
    answer: Option<Response<Body>>,
    conn: &'g ConnInfo,
    /// The client's connection, once hyper has sent the `101` of an upgrade.
    on_upgrade: Option<hyper::upgrade::OnUpgrade>,
    /// The protocol the upstream was asked to switch to.
    switch_to: Option<HeaderValue>,
}

impl Wire for General<'_> {
    type Head = Response<()>;
    type Ready = ();
    type Out = ();
    const BODIES: bool = true;
    const UPGRADES: bool = true;

    async fn read_body(&mut self, cap: u64) -> Result<Bytes, Refusal> {
        let Either::Left(body) = &mut self.body else {
            return Err(Refusal::BadRequest("the request body was read already".into()));
        };
        match Box::pin(Limited::new(body, cap as usize).collect()).await {
            Ok(b) => {
                let bytes = b.to_bytes();
                self.body = Either::Right(Full::new(bytes.clone()));
                Ok(bytes)
            }
            Err(e) if e.is::<LengthLimitError>() => Err(Refusal::PayloadTooLarge { limit: cap }),
            Err(e) => Err(Refusal::BadRequest(format!("request body failed: {e}"))),
        }
    }

    fn write_request(&mut self, parts: &http::request::Parts, edits: &crate::proxy::HeaderEdits) {
        if self.head.capacity() == 0 {
            self.head = bytes::BytesMut::with_capacity(512);
        }
        let chunked = crate::proxy::chunked(parts, &self.body);
        crate::proxy::client::render_request(&mut self.head, parts, edits, chunked);
    }

    async fn exchange(
        &mut self,
        ask: Ask<'_>,
        tried: &mut Attempted,
    ) -> Result<Exchanged<Response<()>>, Failure> {
        if let Either::Left(b) = &mut self.body {
            b.cap(ask.max_body);
        }
        if let Some(p) = ask.upgrade {
            self.switch_to = HeaderValue::from_str(p).ok();
        }
        let proxy: &Proxy = &self.gw.proxy;
        // Boxed: this future is the largest part of a request's, and boxing it once is cheaper
        // than copying it through every enclosing future.
        crate::boxed::boxed(|| proxy.exchange(&ask, &self.head, &mut self.body, tried)).await
    }

    async fn answer(&mut self, b: &mut Begun<'_>, mut a: Answer) {
        // HTTP/2 ends just the stream.
        a.close &= self.version < Version::HTTP_2;
        let mut resp = a.into_response();
        if self.unread_body(&resp) {
            resp = self.unread(resp).await;
        }
        self.ready(b, resp)
    }

    async fn relay(&mut self, b: &mut Begun<'_>, up: Exchanged<Response<()>>, f: &mut Forward) {
        if up.shape.status == 101 {
            return self.switch(b, up, f);
        }
        let pool = b.live.upstreams[f.upstream].targets.list[up.attempted.target]
            .pool
            .clone();
        let timeout = b.snap.upstreams[f.upstream].timeout;
        let mut body = UpstreamBody::new(up.conn, up.shape, pool, timeout, f.place.take());
        body.hold(std::mem::take(&mut f.seats));
        let mut resp = up.head.map(|()| Either::Left(body));
        std::mem::take(&mut f.fields).apply(resp.headers_mut());
        // The upstream may have answered before taking the whole body (it stopped reading).
        if self.unread_body(&resp) {
            resp = self.unread(resp).await;
        }
        self.ready(b, resp)
    }

    async fn send(&mut self, (): ()) {}

    async fn wait(&mut self, turn: impl Future<Output = ()> + Send) -> bool {
        // hyper drops the request of a client that hangs up, and what it paid is given back
        // as it drops (`queue::Owed`).
        turn.await;
        true
    }

    fn gone(&mut self) {
        // hyper drops a request whose client went away, so its exchange never reports one;
        // this is what such a client was owed (nginx's 499), with the connection closed.
        let mut r = Response::new(Either::Right(Full::new(Bytes::new())));
        *r.status_mut() = http::StatusCode::from_u16(499).unwrap_or(http::StatusCode::BAD_REQUEST);
        r.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        self.answer = Some(r);
    }
}

impl General<'_> {
    /// The upstream switched protocols: the client gets the `101` (with the switch's own
    /// hop-by-hop fields, which the judged head dropped), and once hyper has sent it, the two
    /// connections are relayed to each other in a task of their own, holding the request's
    /// seats.
    fn switch(&mut self, b: &mut Begun<'_>, up: Exchanged<Response<()>>, f: &mut Forward) {
        let (Some(on_upgrade), Some(protocol)) = (self.on_upgrade.take(), self.switch_to.take()) else {
            // An upstream's 101 is taken only for an upgrade asked on HTTP/1.1, which hyper
            // can hand over.
            let a = Answer::from(Refusal::BadGateway("the connection can't be switched".into()));
            return self.ready(b, a.into_response());
        };
        let route = &b.snap.routes[f.classified.route];
        let mut resp = up.head.map(|()| Either::Right(Full::new(Bytes::new())));
        let h = resp.headers_mut();
        h.insert(http::header::UPGRADE, protocol);
        h.insert(http::header::CONNECTION, HeaderValue::from_static("upgrade"));
        std::mem::take(&mut f.fields).apply(h);
        let held = crate::upgrade::Held {
            seats: std::mem::take(&mut f.seats),
            entry: self.conn.entry.clone(),
        };
        self.gw
            .upgrades
            .relay(on_upgrade, up.conn, held, route.idle_timeout, route.name.clone());
        self.ready(b, resp)
    }

    /// An answer made before the client's body was read to its end. hyper's HTTP/1
    /// connection can't find the next request's start past an unread body, so it closes after
    /// an answer that did not say so, and a kept-alive client's next request fails on it. The
    /// rest of a small body is read and dropped, within the header read timeout, and the
    /// connection is kept; a larger, slower or broken one gets `Connection: close`. HTTP/2
    /// needs neither: hyper resets just that stream.
    async fn unread(&mut self, answer: Response<Body>) -> Response<Body> {
        if !self.unread_body(&answer) {
            return answer;
        }
        let body = match std::mem::replace(&mut self.body, Either::Right(Full::default())) {
            Either::Left(b) => b.into_inner(),
            Either::Right(_) => return answer,
        };
        // Boxed, like every rare path here: a request without a body never builds it.
        crate::boxed::boxed(|| drain_or_close(answer, body, self.gw.drain_within)).await
    }

    /// Whether `answer` goes out before the client's HTTP/1 body was read to its end, and
    /// does not close the connection. The body first: most requests have none, and that is
    /// one flag.
    fn unread_body(&self, answer: &Response<Body>) -> bool {
        matches!(&self.body, Either::Left(b) if !http_body::Body::is_end_stream(b))
            && self.version < Version::HTTP_2
            && !answer.headers().contains_key(http::header::CONNECTION)
    }

    /// The answer as hyper will send it: with the request id, and its access line handed to
    /// an upstream's body still to come, or told the length of the body it will send.
    fn ready(&mut self, b: &mut Begun<'_>, resp: Response<Body>) {
        let access = &self.gw.access;
        let resp = self.answer.insert(resp);
        resp.headers_mut()
            .insert(X_REQUEST_ID.clone(), b.request_id.clone());
        let status = resp.status().as_u16();
        if let Some(log) = access {
            // hyper sends the body after this returns: an upstream's body still to come counts
            // itself and writes the line at its end; any other says what it will send.
            match resp.body_mut() {
                Either::Left(up) if !http_body::Body::is_end_stream(&*up) => {
                    if let Some(r) = access_line(b, status) {
                        up.log_when_done(crate::access::Pending::new(r, log.clone(), b.started));
                    }
                }
                body => {
                    let promised = promised_body(&b.method, status, body);
                    b.body_sent(promised);
                }
            }
        }
    }
}

/// The body an answer handed to hyper will send, when nothing of it is still to come from an
/// upstream: none to a `HEAD` or with a status that has none, else its length (a gateway's own
/// answer is whole; an upstream's that has ended is empty).
fn promised_body(method: &http::Method, status: u16, body: &Body) -> Option<u64> {
    use http_body::Body as _;
    if *method == http::Method::HEAD || status < 200 || status == 204 || status == 304 {
        return Some(0);
    }
    body.size_hint().exact()
}

/// The most of a body read and dropped after its request was answered, to keep the connection:
/// past it, the client is told `Connection: close` instead of being read for longer.
pub(crate) const DRAIN_MAX: u64 = 64 * 1024;

/// `answer`, once the rest of `body` is read and dropped; with `Connection: close` when that is
/// over [`DRAIN_MAX`], fails, or takes longer than `within`.
async fn drain_or_close(answer: Response<Body>, mut body: Incoming, within: Duration) -> Response<Body> {
    use http_body::Body as _;
    // A declared length over the bound is not read at all, and after `Expect: 100-continue`
    // not polled either: hyper sends `100 Continue` only when the body is first polled.
    let drained = body.size_hint().lower() <= DRAIN_MAX
        && tokio::time::timeout(within, read_off(&mut body))
            .await
            .unwrap_or(false);
    if drained { answer } else { closing(answer) }
}

/// Reads `body` to its end; `false` when it holds more than [`DRAIN_MAX`] or fails.
async fn read_off(body: &mut Incoming) -> bool {
    let mut left = DRAIN_MAX;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return false };
        if let Some(d) = frame.data_ref() {
            match left.checked_sub(d.len() as u64) {
                Some(l) => left = l,
                None => return false,
            }
        }
    }
    true
}

/// `answer` with `Connection: close`: hyper closes after sending it, and the client knows.
fn closing(mut answer: Response<Body>) -> Response<Body> {
    answer
        .headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    answer
}
