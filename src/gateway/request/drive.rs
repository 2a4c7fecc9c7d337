//! One request's steps, ordered once for both wires: begin, identify, read the body field a
//! limit keys on, admit (or, on a usage route, the caller's budget as the answer), the
//! upstream's header edits, the exchange, settle (or refund), the answer, finish. What differs
//! between the express lane and hyper's path (how a body is read, how a head is written, how a
//! body is relayed) is a [`Wire`]; the steps can't differ between them, because there is one
//! copy of them, here.

use std::future::Future;
use std::time::Instant;

use bytes::Bytes;

use super::{Begun, Forward, Gateway, MAX_FIELD_BODY, body_field, declared_length};
use crate::proxy::client::{Attempted, Failure};
use crate::proxy::{Ask, Exchanged};
use crate::respond::{Answer, Refusal};
use crate::server::ConnInfo;

/// What differs between the wires a request arrives on. Each method is one step's I/O; the
/// order of the steps is [`drive`]'s.
pub(crate) trait Wire {
    /// The upstream's response head as this wire keeps it until the gateway's fields are
    /// known (after a post-paid debit).
    type Head: Send;
    /// An answer ready to send, once the request is recorded.
    type Ready: Send;
    /// What the connection gets back when the request is over.
    type Out;
    /// Whether a request on this wire can have a body: the lane takes only requests without.
    const BODIES: bool;
    /// Whether a request on this wire may upgrade its connection: the lane hands upgrades to
    /// hyper.
    const UPGRADES: bool;

    /// The request's whole body, up to `cap` bytes, for a limit keyed on a field of it: more
    /// is a 413, a broken body a 400.
    fn read_body(&mut self, cap: u64) -> impl Future<Output = Result<Bytes, Refusal>> + Send;

    /// Writes the upstream's request head: the routed request through `edits`. Apart from the
    /// exchange, so the edits are gone before anything waits.
    fn write_request(&mut self, parts: &http::request::Parts, edits: &crate::proxy::HeaderEdits);

    /// Sends the request head written last, and the body, upstream, and reads the answer's
    /// head. `tried` is kept up with the target asked and the attempts so far, so a request
    /// that fails still says where it went.
    fn exchange(
        &mut self,
        ask: Ask<'_>,
        tried: &mut Attempted,
    ) -> impl Future<Output = Result<Exchanged<Self::Head>, Failure>> + Send;

    /// Makes one of the gateway's own answers ready.
    fn answer(&mut self, b: &mut Begun<'_>, a: Answer) -> impl Future<Output = Self::Ready> + Send;

    /// The upstream's answer with the gateway's fields; the lane relays its body here.
    fn relay(
        &mut self,
        b: &mut Begun<'_>,
        up: Exchanged<Self::Head>,
        f: &mut Forward,
    ) -> impl Future<Output = Self::Ready> + Send;

    /// Sends what is ready.
    fn send(&mut self, ready: Self::Ready) -> impl Future<Output = Self::Out> + Send;

    /// The client went away while the upstream was asked: nothing is sent.
    fn gone(&mut self) -> Self::Out;

    /// Waits for `turn`, a queued request's: false when the client hung up meanwhile.
    fn wait(&mut self, turn: impl Future<Output = ()> + Send) -> impl Future<Output = bool> + Send;
}

/// How a request's steps ended before its answer was sent.
pub(super) enum Stop {
    Answer(Answer),
    /// The client hung up: nothing to send.
    Gone,
}

impl From<Answer> for Stop {
    fn from(a: Answer) -> Stop {
        Stop::Answer(a)
    }
}

/// Serves one request whose head is `parts` over `wire`, with one rules snapshot from start to
/// end, whatever reloads meanwhile.
///
/// The steps are one block, not a function of their own: every `async fn` between the
/// connection and the upstream is one more state machine entered on each wake-up, and one
/// more move of what it returns (about 300 instructions a request, callgrind). A step that
/// ends the request leaves the block with its [`Stop`].
pub(crate) async fn drive<W: Wire>(
    gw: &Gateway,
    mut parts: http::request::Parts,
    conn: &ConnInfo,
    wire: &mut W,
) -> W::Out {
    let access = gw.access_record(&parts.method, &parts.uri, parts.version, &parts.headers, conn);
    let mut begun = gw.begin(parts.method.clone(), &mut parts.headers, conn, access);
    let b = &mut begun;
    let parts = &mut parts;
    let ended: Result<(W::Ready, u16), Stop> = 'steps: {
        // A step's answer ends the steps.
        macro_rules! step {
            ($e:expr) => {
                match $e {
                    Ok(v) => v,
                    Err(stop) => break 'steps Err(Stop::from(stop)),
                }
            };
        }
        if let Some(why) = conn.flagged_heads.as_ref().and_then(|f| f.next_request()) {
            // Framed two ways: the connection's next bytes can't be trusted.
            break 'steps Err(Answer::from(Refusal::BadRequest(why.to_string()))
                .closing()
                .into());
        }
        let c = step!(gw.identify(b, parts, conn).await);
        // Borrowed, not cloned: an `Arc`'s count is two atomic operations a request.
        let route = &b.snap.routes[c.route];
        let (max, post_paid) = (route.max_body_bytes, route.post_paid);
        let usage = route.serves == tollgate_rules::Serves::Usage;
        // Chosen before anything is charged: an upgrade the route does not list is refused.
        let upgrade = if W::UPGRADES && parts.headers.contains_key(http::header::UPGRADE) {
            step!(crate::upgrade::chosen(route, parts.version, &parts.headers).map_err(Answer::from))
        } else {
            None
        };
        if W::BODIES && declared_length(&parts.headers).is_some_and(|len| len > max) {
            // Declared too large: nothing of it will be read, so it is answered at once and
            // the connection closed, rather than waited for.
            break 'steps Err(Answer::from(Refusal::PayloadTooLarge { limit: max })
                .closing()
                .into());
        }
        let body_value = match &route.body_field {
            None => None,
            Some(field) => {
                let bytes = step!(
                    wire.read_body(max.min(MAX_FIELD_BODY))
                        .await
                        .map_err(Answer::from)
                );
                Some(step!(
                    body_field(&bytes, field).map_err(|why| Answer::from(Refusal::BadRequest(why)))
                ))
            }
        };
        if usage {
            // Answered here, in place of admission and the exchange. Boxed, like every rare
            // path here: the usual request never builds it.
            let a = Box::pin(gw.usage(b, c, &parts.headers, body_value.as_deref())).await;
            break 'steps Err(a.into());
        }
        let mut f = step!(gw.admit(b, c, parts, body_value.as_deref()).await);
        if f.delay_us > 0 {
            // Boxed, like every rare path here: the usual request never builds it.
            step!(Box::pin(gw.wait_turn(b, &mut f, wire)).await);
        }
        let protocol = upgrade.map(|i| &*b.snap.routes[f.classified.route].upgrade[i]);
        {
            // In a block of its own, so the edits are gone before anything waits.
            let mut edits = gw.edits(b, &f, parts, conn);
            if let Some(p) = protocol {
                crate::upgrade::ask_upstream(&mut edits, p);
            }
            wire.write_request(parts, &edits);
        }
        let ask = gw.ask(b, &f, parts, (max, post_paid), protocol);
        let started = Instant::now();
        let mut tried = Attempted::default();
        let exchanged = wire.exchange(ask, &mut tried).await;
        if tried.attempts > 0 {
            b.facts.tried = Some((f.upstream, tried));
        }
        gw.upstream_answered(b, &f, started.elapsed(), exchanged.as_ref().err());
        match exchanged {
            Ok(up) => {
                gw.settle(&b.snap, f.paid.as_deref(), Some(up.shape.status)).await;
                if let Some(headers) = &up.reported {
                    b.facts.reported = gw.debit(&b.snap, &mut f, headers).await;
                }
                // Handed to the wire here, not carried out of the block: a request's
                // connection is a hundred bytes, and a move is a copy. What it paid is lent:
                // the wire takes the place and seats it gives back when the answer ends.
                let status = up.shape.status;
                Ok((wire.relay(b, up, &mut f).await, status))
            }
            Err(Failure::ClientGone) => Err(Stop::Gone),
            // Boxed, like every rare path here: the usual request never builds it.
            Err(failure) => Err(Box::pin(gw.failed(b, &mut f, failure)).await.into()),
        }
    };
    let (ready, status) = match ended {
        Ok(relayed) => relayed,
        Err(Stop::Answer(a)) => {
            let status = a.status();
            (wire.answer(b, a).await, status)
        }
        // Recorded as a client gone (499) as it drops.
        Err(Stop::Gone) => return wire.gone(),
    };
    // Recorded before it is sent: the access line says what was to be sent, even to a client
    // whose socket then fails.
    gw.finish(begun, status);
    wire.send(ready).await
}
