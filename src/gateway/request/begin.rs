//! A request's start: its id, its access record and the [`Begun`] guard that records it however
//! it ends (no early return can skip the line, the metrics or the span).

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;
use tollgate_rules::{Fingerprint, Snapshot, identity};

use super::Gateway;
use crate::request::{InFlight, Live, X_REQUEST_ID};
use crate::server::ConnInfo;

/// What the access line and the metrics need to know about one request.
#[derive(Default)]
pub(super) struct Facts {
    pub(super) route: Option<usize>,
    pub(super) limit: Option<Arc<str>>,
    pub(super) key_id: Option<Arc<str>>,
    /// The key an admitted request is billed to, until a refund says it never arrived.
    pub(super) metered: Option<usize>,
    /// Its connection's client fingerprint.
    pub(super) fingerprint: Fingerprint,
    /// Its span, when spans are exported.
    pub(super) span: Option<Box<crate::otel::RequestSpan>>,
    /// The store check that decided it, for its span.
    pub(super) check: Option<crate::otel::Checked>,
    /// Admitted: on its way upstream, or answered with its caller's usage.
    pub(super) admitted: bool,
    /// Its line for `--access-log-format`, filled in as it goes.
    pub(super) access: Option<Box<crate::access::AccessEntry>>,
    /// The time the limiter's check used (the store's clock), when one was made.
    pub(super) checked_at: Option<u64>,
    /// What the upstream's answer reported for a post-paid limit.
    pub(super) reported: Option<u64>,
    /// The upstream asked and the target of its last attempt, with the attempts made; `None`
    /// when no upstream was asked.
    pub(super) tried: Option<(usize, crate::proxy::client::Attempted)>,
}

impl Facts {
    /// What the request came to, for its span.
    pub(super) fn facts<'a>(&'a self, b: &'a Begun<'_>, status: u16) -> crate::otel::Facts<'a> {
        crate::otel::Facts {
            method: &b.method,
            route: self.route.map(|r| &*b.snap.routes[r].name),
            key_id: self.key_id.as_deref(),
            admitted: self.admitted,
            limit: self.limit.as_deref(),
            check: self.check,
            status,
            request_id: b.request_id.to_str().unwrap_or("-"),
        }
    }
}

/// A client's `X-Request-Id` is kept when it is 1 to 128 characters of `[A-Za-z0-9._:-]`;
/// anything else is replaced, so logs never carry a client's arbitrary bytes.
pub(super) fn valid_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-'))
}

pub(super) fn new_request_id() -> HeaderValue {
    let n: u128 = rand::random();
    let mut buf = [0u8; 32];
    hex::encode_to_slice(n.to_be_bytes(), &mut buf).unwrap_or_default();
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// A request in progress: what its metrics and access line need at the end.
///
/// It is a guard: dropped without [`Gateway::finish`] (a client gone mid-request, an early
/// return) it still records the request, with status 499, so no path can lose its metrics or
/// its access line.
#[must_use = "a request must end with Gateway::finish"]
pub(crate) struct Begun<'g> {
    pub(super) gw: &'g Gateway,
    pub(super) end: End,
    pub snap: Arc<Snapshot>,
    pub live: Arc<Live>,
    pub(super) started: Instant,
    pub request_id: HeaderValue,
    pub(super) method: http::Method,
    pub(super) facts: Facts,
    pub(super) _in_flight: InFlight<'g>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    Open,
    Answered(u16),
}

/// The status recorded for a request whose client went away before its answer (nginx's).
pub(super) const CLIENT_GONE: u16 = 499;

impl Begun<'_> {
    /// The bytes of the answer's body the client was sent, for the access line (`None`: not
    /// known).
    pub(crate) fn body_sent(&mut self, bytes: Option<u64>) {
        if let Some(r) = &mut self.facts.access {
            r.body_bytes = bytes;
        }
    }
}

/// The request's `--access-log-format` record, filled in with how it ended; `None` when it has
/// none (the format is off, or the record went with the body).
pub(super) fn access_line(b: &mut Begun<'_>, status: u16) -> Option<Box<crate::access::AccessEntry>> {
    let mut r = b.facts.access.take()?;
    r.time = std::time::SystemTime::now();
    r.status = status;
    r.set_request_id(&b.request_id);
    r.route = b.facts.route.map(|i| b.snap.routes[i].name.clone());
    r.limit = b.facts.limit.clone();
    r.key_id = b.facts.key_id.clone();
    r.latency_us = b.started.elapsed().as_micros() as u64;
    r.check_us = b.facts.checked_at;
    r.rules_version = b.snap.version;
    r.cost_reported = b.facts.reported;
    if let Some((u, tried)) = b.facts.tried {
        r.upstream_target = Some(b.live.upstreams[u].targets.list[tried.target].label.clone());
        r.attempts = tried.attempts;
    }
    Some(r)
}

impl Drop for Begun<'_> {
    fn drop(&mut self) {
        let status = match self.end {
            End::Answered(status) => status,
            End::Open => CLIENT_GONE,
        };
        let gw = self.gw;
        gw.record(self, status);
        if let Some(span) = self.facts.span.take() {
            self.gw.end_span(self, &span, status);
        }
    }
}

impl Gateway {
    /// Starts a request on a connection: its snapshot (kept to the end, whatever reloads
    /// meanwhile), its request id (the client's when it sent one and it is valid, else a new
    /// one, also sent upstream) and its clock.
    pub(crate) fn begin(
        &self,
        method: http::Method,
        headers: &mut http::HeaderMap,
        conn: &ConnInfo,
        access: Option<Box<crate::access::AccessEntry>>,
    ) -> Begun<'_> {
        let started = Instant::now();
        let in_flight = InFlight::new(&self.metrics.in_flight);
        let snap = self.rules.load_full();
        let live = self.live(&snap);
        // Exactly one id goes upstream: the client's when it sent one valid one, else ours in
        // place of all it sent (`insert` drops every value); a second would pass unchecked.
        let mut ids = headers.get_all(&X_REQUEST_ID).iter();
        let request_id = match (ids.next(), ids.next()) {
            (Some(v), None) if valid_request_id(v) => v.clone(),
            _ => {
                let id = new_request_id();
                headers.insert(X_REQUEST_ID.clone(), id.clone());
                id
            }
        };
        Begun {
            gw: self,
            snap,
            live,
            started,
            request_id,
            method,
            facts: Facts {
                fingerprint: conn.fingerprint,
                span: self.otel.as_ref().map(|o| o.begin(headers)),
                access,
                ..Facts::default()
            },
            end: End::Open,
            _in_flight: in_flight,
        }
    }

    /// The start of a request's line for `--access-log-format` (`None` when that is off): the
    /// head as the client sent it, taken before [`Gateway::begin`] and `identify` change it.
    pub(crate) fn access_record(
        &self,
        method: &http::Method,
        uri: &http::Uri,
        version: http::Version,
        headers: &http::HeaderMap,
        conn: &ConnInfo,
    ) -> Option<Box<crate::access::AccessEntry>> {
        self.access.as_ref()?;
        Some(crate::access::AccessEntry::begin(
            identity::canonical(conn.peer.ip()),
            method.clone(),
            uri,
            version,
            headers,
            conn.fingerprint,
        ))
    }
}
