//! The data path of one request: route, identity, plan, one store check, then 429 or forward;
//! and what the operator sees of it (metrics, one access line, the request id, its span).

mod drive;
pub mod express;
mod general;

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;

use crate::concurrency::{Place, Places};
use crate::proxy::pool::ConnPool;
use crate::proxy::{Caller, Proxy};
use crate::respond::QuotaHeaders;
use crate::respond::{Answer, Body, Budget, RateFields, Refusal};
use crate::server::{ConnInfo, Handler};
use tollgate_http1::path::{EncodedSlashes, PathError, canonical, has_encoded_slash};
use tollgate_http1::{method_override, sanitize};
use tollgate_limit::batch::FailurePolicy;
use tollgate_limit::clock::Clock;
use tollgate_limit::decision::{Decision, decide};
use tollgate_meter::counter::Meter;
use tollgate_meter::flags::Flags;
use tollgate_rules::identity::{self, KeySource, TrustedProxies};
use tollgate_rules::jwt::{JwtCaller, TokenError};
use tollgate_rules::plan;
use tollgate_rules::quota::Quota;
use tollgate_rules::{Fingerprint, Identity, KeyRequirement, Snapshot, hash_secret};
use tollgate_store::seats::{MemorySeats, Seat, Seats, Taken};
use tollgate_store::{Batch, Outcome, Store, StoreError};
use tollgate_telemetry::logsample::Sampler;
use tollgate_telemetry::metrics::{Handles, Metrics};

pub(crate) static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub proxy: Proxy,
    pub trusted: TrustedProxies,
    pub metrics: Arc<Metrics>,
    /// Counts admitted requests per key for billing, apart from the limiter; `None`: off.
    pub meter: Option<Arc<Meter>>,
    /// The quota flags metering sets, as last read (every second).
    pub quota_flags: Arc<ArcSwap<Flags>>,
    /// The dashboard's counts that no metric keeps (refusals per key).
    pub dashboard: Arc<crate::dashboard::Dashboard>,
    /// Seats of limits on requests in flight: the store's (Redis), or this gateway's.
    pub seats: Arc<dyn Seats>,
    /// Seats kept here while the store's can't be reached, for limits that fail `local`.
    local_seats: MemorySeats,
    /// Limits shared with other Regions: their shares replace the limits' own numbers.
    pub regions: Option<Arc<crate::regions::Regions>>,
    /// Wall-clock time for quota periods (tests pass a manual clock).
    pub clock: Arc<dyn Clock>,
    /// A span per request over OTLP; `None`: off, and nothing is built.
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// Access lines in a conventional format, formatted on their writer thread; `None`: each
    /// request's line is a `tollgate::access` log event.
    pub access: Option<crate::access::AccessLog>,
    /// The longest wait for the rest of a body whose request was answered before it arrived
    /// (the server's header read timeout): past it, the answer closes the connection.
    pub drain_within: std::time::Duration,
    shadow_log: Sampler,
    live: ArcSwap<Live>,
    building: std::sync::Mutex<()>,
}

/// What the access line and the metrics need to know about one request.
#[derive(Default)]
struct Trace {
    route: Option<usize>,
    limit: Option<Arc<str>>,
    key_id: Option<Arc<str>>,
    /// The key an admitted request is billed to, until a refund says it never arrived.
    metered: Option<usize>,
    /// Its connection's client fingerprint.
    fingerprint: Fingerprint,
    /// Its span, when spans are exported.
    span: Option<Box<crate::otel::RequestSpan>>,
    /// The store check that decided it, for its span.
    check: Option<crate::otel::Checked>,
    /// Admitted, and on its way upstream.
    admitted: bool,
    /// Its line for `--access-log-format`, filled in as it goes.
    access: Option<Box<crate::access::Record>>,
}

impl Trace {
    /// What the request came to, for its span.
    fn facts<'a>(&'a self, b: &'a Begun<'_>, status: u16) -> crate::otel::Facts<'a> {
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
fn valid_request_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b':' | b'-'))
}

fn new_request_id() -> HeaderValue {
    let n: u128 = rand::random();
    let mut buf = [0u8; 32];
    hex::encode_to_slice(n.to_be_bytes(), &mut buf).unwrap_or_default();
    HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

impl Gateway {
    pub fn new(
        rules: Arc<ArcSwap<Snapshot>>,
        store: Arc<dyn Store>,
        trusted: TrustedProxies,
        metrics: Arc<Metrics>,
    ) -> Gateway {
        Gateway {
            rules,
            store,
            proxy: Proxy::new(),
            trusted,
            metrics,
            meter: None,
            quota_flags: Arc::new(ArcSwap::from_pointee(Flags::default())),
            regions: None,
            dashboard: crate::dashboard::Dashboard::new(),
            seats: Arc::new(MemorySeats::new()),
            local_seats: MemorySeats::new(),
            clock: tollgate_limit::clock::SystemClock::shared(),
            otel: None,
            access: None,
            drain_within: crate::server::ServerLimits::default().header_read_timeout,
            shadow_log: Sampler::new(std::time::Duration::from_secs(1)),
            live: ArcSwap::from_pointee(Live::default()),
            building: std::sync::Mutex::new(()),
        }
    }

    /// Each upstream of the running rules as the dashboard shows it.
    pub(crate) fn upstreams_now(&self) -> Vec<UpstreamNow> {
        self.live
            .load()
            .upstreams
            .iter()
            .map(|u| {
                let (in_flight, limit, adaptive) = u.places.now();
                UpstreamNow {
                    name: u.name.clone(),
                    in_flight,
                    limit,
                    adaptive,
                }
            })
            .collect()
    }

    /// The live state for this snapshot, made at its first request from the last one's.
    /// Versions only go up, so a version names one snapshot.
    fn live(&self, snap: &Snapshot) -> Arc<Live> {
        let current = self.live.load_full();
        if current.handles.snapshot == snap.version {
            return current;
        }
        // One builder at a time: the first requests of a snapshot arrive together, and each
        // building its own would give each its own in-flight gate, letting an upstream receive
        // a multiple of its cap.
        let _one = self
            .building
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = self.live.load_full();
        if current.handles.snapshot == snap.version {
            return current;
        }
        let fresh = Arc::new(Live::new(snap, &current, self.meter.as_deref(), &self.metrics));
        // A request that loaded its snapshot just before a reload gets state for it (sharing
        // the current pools and gates by name) without pushing the newer one out.
        if snap.version > current.handles.snapshot {
            self.live.store(fresh.clone());
        }
        fresh
    }

    /// Closes kept upstream connections that expired or that their upstream closed.
    pub(crate) fn sweep_upstreams(&self) {
        for u in &self.live.load().upstreams {
            u.pool.sweep();
        }
    }

    /// One store call for a batch. The batch is borrowed, not moved: it is a few hundred bytes,
    /// and every move through an async call is a copy.
    async fn check(
        &self,
        snap: &Snapshot,
        h: &Handles,
        batch: &Batch,
        trace: &mut Trace,
    ) -> Result<(Decision, Outcome), StoreError> {
        let started = Instant::now();
        let result = self.store.check(batch).await;
        let took = started.elapsed();
        self.metrics.store_check_seconds.observe(took.as_secs_f64());
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                trace.check = Some(crate::otel::Checked::failed(took));
                let kind = if e == StoreError::Timeout {
                    "timeout"
                } else {
                    "error"
                };
                self.metrics
                    .store_errors
                    .get_or_create(&tollgate_telemetry::metrics::Kind { kind })
                    .inc();
                return Err(e);
            }
        };
        let decision = decide(batch, &outcome);
        trace.check = Some(crate::otel::Checked::new(took, &decision));
        self.count(snap, h, batch, &decision);
        Ok((decision, outcome))
    }

    /// Gives an admitted request's charge back when it never reached its upstream, in the same
    /// all-or-nothing way it was taken. A refund that fails is logged and counted by the store's
    /// guard; the request's answer does not wait on a retry.
    async fn refund_undelivered(
        &self,
        snap: &Snapshot,
        trace: &mut Trace,
        paid: Option<Box<Paid>>,
        failure: &crate::proxy::client::Failure,
    ) {
        if !failure.undelivered() {
            // Delivered, but no answer came: no status a limit charged on the answer keeps.
            self.settle(snap, paid.as_deref(), None).await;
            return;
        }
        // What never reached its upstream is not billed either.
        trace.metered = None;
        let Some(paid) = paid else {
            return;
        };
        let Paid { batch, outcome } = *paid;
        if let Err(e) = self.store.refund(&batch, &outcome).await {
            tracing::debug!(error = %e, "refund of an undelivered request failed");
        }
    }

    /// Gives back the charge of every limit charged on the upstream's answer (`charge_on`) whose
    /// statuses `status` is not, before the answer goes out: the client's next attempt sees
    /// the bucket as this answer left it.
    pub(crate) async fn settle(&self, snap: &Snapshot, paid: Option<&Paid>, status: Option<u16>) {
        let Some(p) = paid else { return };
        let given_back = |i: &tollgate_store::CheckItem| {
            let l = &snap.limits[i.limit as usize];
            l.charge_on.is_some() && !status.is_some_and(|s| l.keeps_charge(s))
        };
        if !p.outcome.admitted || !p.batch.iter().any(given_back) {
            return;
        }
        let places: smallvec::SmallVec<[usize; 4]> =
            (0..p.batch.len()).filter(|&i| given_back(&p.batch[i])).collect();
        let batch: Batch = places.iter().map(|&i| p.batch[i].clone()).collect();
        if let Err(e) = self.store.refund(&batch, &p.outcome.part(&places)).await {
            tracing::debug!(error = %e, "giving back a charge the answer did not keep failed");
        }
    }

    /// Settles a post-paid request once its answer's head is here: each post-paid bucket it
    /// paid is charged what the answer reports beyond the reserve (given back what it reports
    /// below), in one store call, before the head goes out. Its `RateLimit` then shows the
    /// bucket after the debit, and the next request sees any debt. An answer that does not
    /// say costs the reserve; one that says something else than a count is logged and costs
    /// the reserve too: the client is not refused for its upstream's fault.
    pub(crate) async fn debit(&self, snap: &Snapshot, f: &mut Forward, headers: &http::HeaderMap) {
        let Some(p) = f.paid.as_deref() else { return };
        if !p.outcome.admitted {
            return;
        }
        let mut units: smallvec::SmallVec<[i64; 4]> = smallvec::SmallVec::new();
        for (item, v) in p.batch.iter().zip(&p.outcome.buckets) {
            let limit = &snap.limits[item.limit as usize];
            let owed = match &limit.post_paid {
                Some(pp) if tollgate_limit::bucket::charged(&item.charge, v, true) => {
                    match pp.reported(headers) {
                        Ok(Some(n)) => pp.units(&item.charge.params, n),
                        Ok(None) => 0,
                        Err(why) => {
                            tracing::warn!(limit = %limit.name, "upstream's cost ignored: {why}");
                            0
                        }
                    }
                }
                _ => 0,
            };
            units.push(owed);
        }
        if units.iter().all(|u| *u == 0) {
            return;
        }
        match self.store.adjust(&p.batch, &p.outcome, &units).await {
            Ok(adjusted) => {
                let caller = f.classified.caller();
                if let Some(b) =
                    crate::respond::budget_after(snap, &p.batch, caller, &p.outcome, &adjusted.balances)
                {
                    f.fields.budget = Some(b);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "post-paid debit failed; the reserve stays the whole charge")
            }
        }
    }

    /// Admissions count once per enforced limit paid; a limited or unavailable request counts
    /// for the limit that decided it. Shadow limits count what they would have refused.
    fn count(&self, snap: &Snapshot, h: &Handles, batch: &[tollgate_store::CheckItem], d: &Decision) {
        if d.admitted() {
            for item in batch.iter().filter(|i| !i.charge.shadow) {
                h.decision(&self.metrics, item.limit as usize, d);
            }
        } else if let Some(i) = d.deciding {
            h.decision(&self.metrics, batch[i].limit as usize, d);
        }
        for &li in &d.shadow_refusals {
            let name = &snap.limits[li as usize].name;
            h.shadow(&self.metrics, li as usize);
            if let Some(suppressed) = self.shadow_log.allow(li as usize) {
                tracing::info!(
                    limit = &**name,
                    suppressed,
                    request_admitted = d.admitted(),
                    "shadow limit would have refused this request"
                );
            }
        }
    }

    /// A request without a usable key pays the unauthenticated bucket of its IP: a refused one
    /// gets 429, so guessing keys is limited too; an admitted one gets 401.
    async fn unauthorized(
        &self,
        snap: &Snapshot,
        ip: IpAddr,
        why: Refusal,
        h: &Handles,
        trace: &mut Trace,
    ) -> Answer {
        let batch = plan::unauthenticated_only(snap, ip);
        if batch.is_empty() {
            return why.into();
        }
        let d = match self.check(snap, h, &batch, trace).await {
            Err(_) => return Refusal::LimiterUnavailable.into(),
            Ok((d, _)) => d,
        };
        let refusal = match &d {
            Decision::Unavailable(_) => return Refusal::LimiterUnavailable.into(),
            Decision::Admitted(_) => why,
            Decision::Limited(..) => {
                trace.limit = deciding_name(snap, &batch, &d);
                rate_limited(snap, &batch, &d)
            }
        };
        with_budget(
            refusal,
            crate::respond::budget_values(snap, &batch, plan::Caller::Anonymous, &d),
        )
    }

    /// The limiter's part of a request whose head (and body field, if its route keys on one) is
    /// known: the check to report in headers, or the answer that ends the request.
    #[allow(clippy::too_many_arguments)]
    async fn limit(
        &self,
        snap: &Snapshot,
        route: &tollgate_rules::Route,
        c: &Classified,
        headers: &http::HeaderMap,
        body_value: Option<&[u8]>,
        h: &Handles,
        trace: &mut Trace,
    ) -> Result<Charged, Answer> {
        let key_idx = c.key.map(|k| k.0);
        let caller = c.caller();
        // Seats first: they are given back when this request ends, whatever ends it.
        let seats = match key_idx {
            Some(k)
                if route
                    .costs
                    .iter()
                    .any(|&(li, _)| snap.limits[li as usize].concurrent.is_some()) =>
            {
                self.take_seats(snap, route, k, trace).await?
            }
            _ => Vec::new(),
        };
        let mut batch = match plan::build_for(snap, route, caller, c.ip, c.fingerprint, headers, body_value) {
            Ok(b) => b,
            Err(e) => return Err(Refusal::BadRequest(e.to_string()).into()),
        };
        if let Some(r) = &self.regions {
            r.apply(snap, key_idx, &mut batch);
        }
        if batch.is_empty() {
            return Ok(Charged {
                seats,
                ..Charged::default()
            });
        }
        let (d, outcome) = match self.check(snap, h, &batch, trace).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "limiter store failed");
                return Err(Refusal::LimiterUnavailable.into());
            }
        };
        trace.limit = deciding_name(snap, &batch, &d);
        match d {
            Decision::Admitted(_) => {}
            Decision::Unavailable(_) => return Err(Refusal::LimiterUnavailable.into()),
            Decision::Limited(..) => {
                let budget = crate::respond::budget_values(snap, &batch, caller, &d);
                return Err(with_budget(rate_limited(snap, &batch, &d), budget));
            }
        }
        Ok(Charged {
            budget: crate::respond::budget_values(snap, &batch, caller, &d),
            // Boxed: it travels with the request to its end, and a pointer moves for less than
            // the few hundred bytes of a batch and its outcome.
            paid: Some(Box::new(Paid { batch, outcome })),
            seats,
        })
    }

    /// One seat of each limit on requests in flight the route names, for the key; a full
    /// limit is a 429 and gives back the seats already taken.
    async fn take_seats(
        &self,
        snap: &Snapshot,
        route: &tollgate_rules::Route,
        key: usize,
        trace: &mut Trace,
    ) -> Result<Vec<Seat>, Answer> {
        let mut seats = Vec::new();
        for &(li, _) in &route.costs {
            let limit = &snap.limits[li as usize];
            let Some(c) = &limit.concurrent else { continue };
            let name = format!("seats:{{{}}}:{}", snap.keys[key].tenant, limit.name);
            let taken = match self.seats.take(&name, c.max).await {
                Ok(t) => t,
                Err(e) => match limit.policy {
                    FailurePolicy::Open => continue,
                    FailurePolicy::Closed => {
                        tracing::warn!(error = %e, limit = %limit.name, "seats of a limit on requests in flight can't be taken; closed");
                        return Err(Refusal::LimiterUnavailable.into());
                    }
                    FailurePolicy::Local => match self.local_seats.take(&name, c.max).await {
                        Ok(t) => t,
                        Err(_) => return Err(Refusal::LimiterUnavailable.into()),
                    },
                },
            };
            match taken {
                Taken::Seat(s) => seats.push(s),
                Taken::Full { in_use } => {
                    trace.limit = Some(limit.name.clone());
                    let refusal = Refusal::TooManyInFlight {
                        limit: limit.name.to_string(),
                        max: c.max,
                        in_flight: in_use,
                    };
                    let full = Budget::seats_taken(limit.name.clone(), c.policy.clone());
                    return Err(with_budget(refusal, Some(full)));
                }
            }
        }
        Ok(seats)
    }

    /// Load shedding by the upstream's own health, apart from every client's limits: a place
    /// under its adaptive limit (refused at once) and its `max_in_flight` (waited for up to
    /// `queue_timeout`), held until the response body is done.
    async fn gate(
        &self,
        upstream: &tollgate_rules::Upstream,
        live: &LiveUpstream,
        trace: &mut Trace,
    ) -> Result<Place, Answer> {
        match live.places.acquire(upstream.queue_timeout).await {
            Some(p) => Ok(p),
            None => {
                trace.limit = Some(OVERLOADED.clone());
                Err(Refusal::UpstreamOverloaded { retry_after: 1 }.into())
            }
        }
    }

    fn caller<'a>(&self, snap: &'a Snapshot, c: &'a Classified, conn: &'a ConnInfo) -> Caller {
        Caller {
            peer: tollgate_rules::identity::canonical(conn.peer.ip()),
            peer_trusted: !self.trusted.is_empty() && self.trusted.contains(c.peer),
            proto: conn.proto,
            key: match (&c.jwt, c.key) {
                (Some(j), _) => Some((j.id_header.clone(), j.tenant_header.clone(), KeySource::Bearer)),
                (None, Some((k, src))) => Some((snap.keys[k].id_header(), snap.keys[k].tenant_header(), src)),
                (None, None) => None,
            },
        }
    }

    /// Starts a request on a connection: its snapshot (kept to the end, whatever reloads
    /// meanwhile), its request id (the client's when it sent one and it is valid, else a new
    /// one, also sent upstream) and its clock.
    pub(crate) fn begin(
        &self,
        method: http::Method,
        headers: &mut http::HeaderMap,
        conn: &ConnInfo,
        access: Option<Box<crate::access::Record>>,
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
            trace: Trace {
                fingerprint: conn.fingerprint,
                span: self.otel.as_ref().map(|o| o.begin(headers)),
                access,
                ..Trace::default()
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
    ) -> Option<Box<crate::access::Record>> {
        self.access.as_ref()?;
        Some(crate::access::Record::begin(
            identity::canonical(conn.peer.ip()),
            method.clone(),
            uri,
            version,
            headers,
            conn.fingerprint,
        ))
    }

    /// Ends a request with the status its client got: its metrics and its access line.
    pub fn finish(&self, mut b: Begun<'_>, status: u16) {
        b.end = End::Answered(status);
    }

    fn record(&self, b: &mut Begun<'_>, status: u16) {
        if let Some(counter) = b.trace.metered.and_then(|k| b.live.meter.get(k)) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if status == 429
            && let Some(k) = &b.trace.key_id
        {
            self.dashboard.refused.add(k);
        }
        b.live
            .handles
            .request(&self.metrics, b.trace.route, &NO_ROUTE, status);
        if let Some(log) = &self.access {
            // None: handed to the answer's body, which writes it when it is sent.
            if let Some(r) = access_line(b, status) {
                log.send(r);
            }
            return;
        }
        let route = b.trace.route.map_or("(none)", |r| &*b.snap.routes[r].name);
        tracing::info!(
            target: "tollgate::access",
            method = b.method.as_str(),
            route,
            status,
            limit = b.trace.limit.as_deref().unwrap_or("-"),
            key = b.trace.key_id.as_deref().unwrap_or("-"),
            fingerprint = %b.trace.fingerprint,
            latency_us = b.started.elapsed().as_micros() as u64,
            request_id = b.request_id.to_str().unwrap_or("-"),
            "request"
        );
    }

    /// Ends a request's span with what its access line says.
    fn end_span(&self, b: &Begun<'_>, span: &crate::otel::RequestSpan, status: u16) {
        if let Some(o) = &self.otel {
            o.end(span, &b.trace.facts(b, status));
        }
    }

    /// The first step of every request, on either path: its head read against the rules
    /// (framing, method, `Host`, canonical path, route, caller). On success the request's path
    /// is the canonical one, which is what the upstream will get, and an HTTP/2 request's
    /// authority is its `Host`. A request without a usable key is answered here, after paying
    /// its address's unauthenticated bucket.
    pub(crate) async fn identify(
        &self,
        b: &mut Begun<'_>,
        parts: &mut http::request::Parts,
        conn: &ConnInfo,
    ) -> Result<Classified, Answer> {
        // Disjoint borrows of the request's state, not clones of its `Arc`s.
        let (snap, live, trace) = (&*b.snap, &*b.live, &mut b.trace);
        let peer = identity::canonical(conn.peer.ip());
        let classified = classify(snap, parts, peer, conn.fingerprint, &self.trusted);
        if let Some(r) = &mut trace.access {
            r.client_ip = match &classified {
                Ok((c, _)) => Some(c.ip),
                Err(Early::Unauthorized { ip, .. }) => Some(*ip),
                Err(Early::Refuse(_)) => None,
            };
        }
        let (c, path) = match classified {
            Ok(c) => c,
            Err(Early::Refuse(r)) => return Err(r.into()),
            Err(Early::Unauthorized { route, ip, why }) => {
                trace.route = route;
                // Boxed, like every rare path here: an async fn's future is as large as its
                // largest state, and the common path should not carry (and copy) that size.
                return Err(Box::pin(self.unauthorized(snap, ip, why, &live.handles, trace)).await);
            }
        };
        if let Some(p) = path {
            set_path(&mut parts.uri, p).map_err(Answer::from)?;
        }
        if let Some(m) = &c.method {
            parts.method = m.clone();
        }
        // Only a target with an authority (HTTP/2's, or an absolute form) can lack a Host, so
        // the usual request looks at one field, not the header map.
        if let Some(host) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            && !parts.headers.contains_key(http::header::HOST)
        {
            parts.headers.insert(http::header::HOST, host);
        }
        trace.route = Some(c.route);
        trace.key_id = match &c.jwt {
            Some(j) => Some(j.id.clone()),
            None => c.key.map(|(k, _)| snap.keys[k].id.clone()),
        };
        Ok(c)
    }

    /// The second step: one store check for every bucket the request pays (`body_value` is
    /// the JSON field a limit keys on, when its route has one), then a place under the
    /// upstream's `max_in_flight`; the request's target is pointed at its upstream.
    pub async fn admit(
        &self,
        b: &mut Begun<'_>,
        c: Classified,
        parts: &mut http::request::Parts,
        body_value: Option<&[u8]>,
    ) -> Result<Forward, Answer> {
        let (snap, live, trace) = (&*b.snap, &*b.live, &mut b.trace);
        let route = &snap.routes[c.route];
        let quota = match c
            .key
            .and_then(|(k, _)| snap.keys[k].quota.as_ref().map(|q| (k, q)))
        {
            Some((k, q)) => Some(Box::new(self.quota(snap, k, q, trace).map_err(|r| *r)?)),
            None => None,
        };
        let with_quota = |mut a: Answer| {
            a.fields.quota.clone_from(&quota);
            a
        };
        let Charged { budget, paid, seats } = self
            .limit(snap, route, &c, &parts.headers, body_value, &live.handles, trace)
            .await
            .map_err(with_quota)?;
        let upstream = &snap.upstreams[route.upstream];
        let place = self
            .gate(upstream, &live.upstreams[route.upstream], trace)
            .await
            .map_err(with_quota)?;
        crate::proxy::retarget(upstream, parts).map_err(Answer::from)?;
        trace.metered = c.key.map(|(k, _)| k);
        trace.admitted = true;
        Ok(Forward {
            upstream: route.upstream,
            fields: RateFields { budget, quota },
            paid,
            seats,
            classified: c,
            place: Some(place),
        })
    }

    /// A key's quota, from the flags metering set: over in this period is a 429 until the
    /// reset in the quota's time zone, before any bucket is charged; otherwise the quota's
    /// headers for the answer.
    fn quota(
        &self,
        snap: &Snapshot,
        key: usize,
        quota: &Quota,
        trace: &mut Trace,
    ) -> Result<QuotaHeaders, Box<Answer>> {
        let now_ms = (self.clock.now_us() / 1000) as i64;
        let flags = self.quota_flags.load();
        let flag = flags.get(&*snap.keys[key].id);
        let period = quota.period(now_ms);
        let headers = QuotaHeaders::new(quota, &period, flag, now_ms);
        match flag {
            Some(f) if f.blocks(now_ms) && f.period == period.label => {
                trace.limit = Some(QUOTA.clone());
                let mut a = Answer::from(Refusal::QuotaExceeded {
                    quota: quota.per.as_str(),
                    retry_after: period.secs_to_reset(now_ms),
                    resets_at: period.resets_at,
                });
                a.fields.quota = Some(Box::new(headers));
                Err(Box::new(a))
            }
            _ => Ok(headers),
        }
    }

    /// How the client's headers become the upstream's for a forwarded request.
    pub(crate) fn edits(
        &self,
        b: &Begun<'_>,
        f: &Forward,
        parts: &http::request::Parts,
        conn: &ConnInfo,
    ) -> crate::proxy::HeaderEdits {
        let up = &b.snap.upstreams[f.upstream];
        let mut edits = crate::proxy::HeaderEdits::new(up, parts, self.caller(&b.snap, &f.classified, conn));
        if let Some(s) = &b.trace.span {
            s.propagate(&mut edits.set);
        }
        edits
    }

    /// Records how long an upstream took to answer the head, and gives its adaptive limit the
    /// sample: an answer, or a timeout (the slowest answer there is). A failure to connect or
    /// to send says nothing about how fast the upstream serves.
    pub(crate) fn upstream_answered(
        &self,
        b: &Begun<'_>,
        f: &Forward,
        took: std::time::Duration,
        failure: Option<&crate::proxy::client::Failure>,
    ) {
        b.live.handles.upstream(&self.metrics, f.upstream, took);
        if let Some(a) = &b.live.upstreams[f.upstream].places.adaptive
            && matches!(failure, None | Some(crate::proxy::client::Failure::TimedOut))
        {
            a.sample(took);
        }
    }
}

/// What the gateway keeps alive for one rules snapshot: its metric handles, and each upstream's
/// kept connections and in-flight places. The rules are plain data; what lives on between
/// requests lives here, and passes to the next snapshot wherever the upstream is unchanged.
pub struct Live {
    pub handles: Handles,
    /// Per upstream, in the snapshot's order.
    pub upstreams: Vec<LiveUpstream>,
    /// Per key, in the snapshot's order, its metering counter (the same one across reloads);
    /// empty when metering is off.
    meter: Vec<Arc<AtomicU64>>,
}

/// An upstream as the dashboard shows it; in flight is counted only under a limit.
pub(crate) struct UpstreamNow {
    pub name: Arc<str>,
    pub in_flight: Option<u32>,
    /// The adaptive limit now (under the static cap), or the static cap.
    pub limit: Option<u32>,
    pub adaptive: bool,
}

pub struct LiveUpstream {
    name: Arc<str>,
    /// Its kept connections: the same pool across reloads while address, idle timeout and TLS
    /// settings stay.
    pub pool: Arc<ConnPool>,
    /// Its places for requests in flight: static gate and adaptive limit.
    pub places: Places,
}

impl Default for Live {
    fn default() -> Live {
        Live {
            handles: Handles::new(0, vec![], vec![], vec![]),
            upstreams: vec![],
            meter: vec![],
        }
    }
}

impl Live {
    fn new(snap: &Snapshot, prev: &Live, meter: Option<&Meter>, metrics: &Metrics) -> Live {
        let upstreams = snap
            .upstreams
            .iter()
            .map(|u| {
                let old = prev.upstreams.iter().find(|o| o.name == u.name);
                let pool = match old {
                    Some(o)
                        if *o.pool.authority() == u.authority
                            && o.pool.idle_timeout() == u.idle_timeout
                            && o.pool.tls() == u.tls.as_ref() =>
                    {
                        o.pool.clone()
                    }
                    _ => Arc::new(
                        ConnPool::new(
                            u.authority.clone(),
                            tollgate_rules::CONNECT_TIMEOUT,
                            u.idle_timeout,
                        )
                        .with_tls(u.tls.clone())
                        .counting_strays(
                            metrics
                                .upstream_strays
                                .get_or_create(&tollgate_telemetry::metrics::UpstreamLabel {
                                    upstream: u.name.clone(),
                                })
                                .clone(),
                        ),
                    ),
                };
                LiveUpstream {
                    name: u.name.clone(),
                    pool,
                    places: Places::new(u, old.map(|o| &o.places), metrics),
                }
            })
            .collect();
        Live {
            handles: Handles::new(
                snap.version,
                snap.routes.iter().map(|r| r.name.clone()).collect(),
                snap.limits.iter().map(|l| l.name.clone()).collect(),
                snap.upstreams.iter().map(|u| u.name.clone()).collect(),
            ),
            upstreams,
            meter: meter.map_or_else(Vec::new, |m| snap.keys.iter().map(|k| m.counter(&k.id)).collect()),
        }
    }
}

/// A request in progress: what its metrics and access line need at the end.
///
/// It is a guard: dropped without [`Gateway::finish`] (a client gone mid-request, an early
/// return) it still records the request, with status 499, so no path can lose its metrics or
/// its access line.
#[must_use = "a request must end with Gateway::finish"]
pub struct Begun<'g> {
    gw: &'g Gateway,
    end: End,
    pub snap: Arc<Snapshot>,
    pub live: Arc<Live>,
    started: Instant,
    pub request_id: HeaderValue,
    method: http::Method,
    trace: Trace,
    _in_flight: InFlight<'g>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    Answered(u16),
}

/// The status recorded for a request whose client went away before its answer (nginx's).
const CLIENT_GONE: u16 = 499;

impl Begun<'_> {
    /// The bytes of the answer's body the client was sent, for the access line (`None`: not
    /// known).
    pub(crate) fn body_sent(&mut self, bytes: Option<u64>) {
        if let Some(r) = &mut self.trace.access {
            r.body_bytes = bytes;
        }
    }
}

/// The request's `--access-log-format` record, filled in with how it ended; `None` when it has
/// none (the format is off, or the record went with the body).
fn access_line(b: &mut Begun<'_>, status: u16) -> Option<Box<crate::access::Record>> {
    let mut r = b.trace.access.take()?;
    r.time = std::time::SystemTime::now();
    r.status = status;
    r.set_request_id(&b.request_id);
    r.route = b.trace.route.map(|i| b.snap.routes[i].name.clone());
    r.limit = b.trace.limit.clone();
    r.key_id = b.trace.key_id.clone();
    r.latency_us = b.started.elapsed().as_micros() as u64;
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
        if let Some(span) = self.trace.span.take() {
            self.gw.end_span(self, &span, status);
        }
    }
}

/// What a request paid to the limiter: every bucket of its one check and the store's answer,
/// kept so a request that is never delivered can be given its charge back.
pub struct Paid {
    batch: Batch,
    outcome: Outcome,
}

/// The limiter's verdict on an admitted request: its budget headers and what it paid (nothing
/// when no limit applies).
#[derive(Default)]
struct Charged {
    budget: Option<Budget>,
    paid: Option<Box<Paid>>,
    seats: Vec<Seat>,
}

/// An admitted request on its way upstream.
pub struct Forward {
    pub upstream: usize,
    /// Its `RateLimit-Policy` and `RateLimit`: the deciding bucket's budget (after a post-paid
    /// debit, the bucket's then) and the key's quota.
    pub fields: RateFields,
    /// What it paid, given back if it never reaches the upstream.
    pub paid: Option<Box<Paid>>,
    /// Its seats of limits on requests in flight, given back when they are dropped: the lane
    /// drops them when the answer is relayed, hyper's path hands them to the answer's body.
    pub seats: Vec<Seat>,
    classified: Classified,
    /// The upstream's in-flight place, held until the response body is done (hyper's path
    /// moves it into the body).
    pub place: Option<Place>,
}

/// The most of a body read to find a limit's JSON field.
pub(crate) const MAX_FIELD_BODY: u64 = 16 * 1024;

/// The access line's `limit` for a request refused by its quota.
static QUOTA: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("(quota)"));

static NO_ROUTE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("(none)"));
static OVERLOADED: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("(upstream overloaded)"));

/// What a request head says against the rules, before any I/O.
#[derive(Debug, Clone)]
pub struct Classified {
    pub route: usize,
    /// The authenticated key and where its secret came from.
    pub key: Option<(usize, KeySource)>,
    /// The verified token's caller, on a JWT route.
    pub jwt: Option<Arc<JwtCaller>>,
    /// The TCP peer.
    pub peer: IpAddr,
    /// The client address the limits key on.
    pub ip: IpAddr,
    /// The connection's client fingerprint.
    pub fingerprint: Fingerprint,
    /// The method a POST's override asked for, on a route that honours it: routed, limited
    /// and forwarded in place of the client's.
    pub method: Option<http::Method>,
}

impl Classified {
    /// Whose buckets the request pays.
    pub fn caller(&self) -> plan::Caller<'_> {
        match (&self.jwt, self.key) {
            (Some(j), _) => plan::Caller::Jwt(j),
            (None, Some((k, _))) => plan::Caller::Key(k),
            (None, None) => plan::Caller::Anonymous,
        }
    }
}

/// A request answered before any limit is checked.
#[derive(Debug)]
pub enum Early {
    Refuse(Refusal),
    /// No usable key: the unauthenticated bucket of `ip` decides between 401 and 429.
    Unauthorized {
        route: Option<usize>,
        ip: IpAddr,
        why: Refusal,
    },
}

/// Reads a request head against a snapshot: framing, method, host and path checks, the route,
/// the client address and the key; `fingerprint` is its connection's. Pure, so it can be fuzzed.
///
/// Routing is on the canonical path; when that differs from the client's spelling it comes
/// back too, and the caller forwards it (see [`set_path`]), so the upstream serves exactly the
/// path that was limited.
pub fn classify(
    snap: &Snapshot,
    parts: &http::request::Parts,
    peer: IpAddr,
    fingerprint: Fingerprint,
    trusted: &TrustedProxies,
) -> Result<(Classified, Option<String>), Early> {
    let bad = |e: &dyn std::fmt::Display| Early::Refuse(Refusal::BadRequest(e.to_string()));
    let (method, headers) = (&parts.method, &parts.headers);
    sanitize::check_head(headers).map_err(|e| bad(&e))?;
    if *method == http::Method::CONNECT {
        return Err(Early::Refuse(Refusal::MethodNotAllowed(
            "CONNECT: the gateway is not a tunnel",
        )));
    }
    if let Some(standard) = sanitize::miscased_method(method) {
        return Err(bad(&format_args!(
            "methods are case-sensitive: {:?} is not {standard}",
            method.as_str()
        )));
    }
    // An absolute-form target names where to send the request; a gateway for HTTP serves
    // only `http` and `https`, whatever else it would route the path to.
    if let Some(scheme) = parts.uri.scheme()
        && *scheme != http::uri::Scheme::HTTP
        && *scheme != http::uri::Scheme::HTTPS
    {
        return Err(bad(&format_args!(
            "the request target's scheme {:?} is not http or https",
            scheme.as_str()
        )));
    }
    sanitize::check_host(parts.version, &parts.uri, headers).map_err(|e| bad(&e))?;
    let path = canonical(parts.uri.path(), EncodedSlashes::Keep).map_err(|e| bad(&e))?;
    // Read only when some route honours overrides: otherwise they are just dropped (`edits`).
    let overridden = if snap.method_override && *method == http::Method::POST {
        overriding_method(snap, headers, &path).map_err(|e| bad(&e))?
    } else {
        None
    };
    let method = overridden.as_ref().unwrap_or(method);
    let route = match snap.route(method, &path) {
        Some(r) => r,
        None if *method == http::Method::TRACE => {
            return Err(Early::Refuse(Refusal::MethodNotAllowed(
                "TRACE is served only by a route that names it",
            )));
        }
        // Refused as it would be on a route that doesn't keep them, not a 404 that tells
        // a prober nothing about why.
        None if has_encoded_slash(&path) => return Err(bad(&PathError::EncodedSlash)),
        None => return Err(Early::Refuse(Refusal::NotFound)),
    };
    if snap.routes[route].encoded_slashes == EncodedSlashes::Refuse && has_encoded_slash(&path) {
        return Err(bad(&PathError::EncodedSlash));
    }
    let ip = identity::client_ip(peer, headers, trusted);
    if snap.routes[route].identity == Identity::Jwt {
        let refused = |e| Early::Unauthorized {
            route: Some(route),
            ip,
            why: Refusal::BadToken(e),
        };
        let token = match identity::credential(headers) {
            Err(e) => return Err(Early::Refuse(Refusal::BadRequest(e.to_string()))),
            Ok(Some((token, KeySource::Bearer | KeySource::Both))) => token,
            Ok(_) => return Err(refused(TokenError::Missing)),
        };
        let caller = snap.verify_jwt(&snap.routes[route], token).map_err(refused)?;
        let rewritten = match path {
            Cow::Owned(p) => Some(p),
            Cow::Borrowed(_) => None,
        };
        return Ok((
            Classified {
                route,
                key: None,
                jwt: Some(Arc::new(caller)),
                peer,
                ip,
                fingerprint,
                method: overridden,
            },
            rewritten,
        ));
    }
    let key = match identity::credential(headers) {
        Err(e) => return Err(Early::Refuse(Refusal::BadRequest(e.to_string()))),
        Ok(None) => None,
        Ok(Some((secret, source))) => match snap.key_by_hash(&hash_secret(secret)) {
            Some(k) => Some((k, source)),
            None => {
                return Err(Early::Unauthorized {
                    route: Some(route),
                    ip,
                    why: Refusal::Unauthorized("unknown API key"),
                });
            }
        },
    };
    if key.is_none() && snap.routes[route].key == KeyRequirement::Required {
        return Err(Early::Unauthorized {
            route: Some(route),
            ip,
            why: Refusal::Unauthorized("this route needs an API key (Authorization: Bearer or X-API-Key)"),
        });
    }
    let rewritten = match path {
        Cow::Owned(p) => Some(p),
        Cow::Borrowed(_) => None,
    };
    Ok((
        Classified {
            route,
            key,
            jwt: None,
            peer,
            ip,
            fingerprint,
            method: overridden,
        },
        rewritten,
    ))
}

/// The method a POST's override headers ask for when the route that method takes honours
/// overrides; `None` when it has none or that route doesn't. A value that names no method is
/// refused where some route of the path honours overrides, and only dropped elsewhere.
fn overriding_method(
    snap: &Snapshot,
    headers: &http::HeaderMap,
    path: &str,
) -> Result<Option<http::Method>, method_override::BadOverride> {
    let honours = |m: &http::Method| {
        snap.route(m, path)
            .is_some_and(|r| snap.routes[r].method_override)
    };
    match method_override::requested(headers) {
        Ok(Some(m)) if honours(&m) => Ok(Some(m)),
        Ok(_) => Ok(None),
        Err(e) => {
            use http::Method as M;
            let methods = [M::GET, M::POST, M::PUT, M::PATCH, M::DELETE, M::OPTIONS];
            if methods.iter().any(honours) {
                Err(e)
            } else {
                Ok(None)
            }
        }
    }
}

/// Puts a canonical path in place of the client's, keeping the query byte for byte.
pub(crate) fn set_path(uri: &mut http::Uri, path: String) -> Result<(), Refusal> {
    let mut pq = path;
    // From the '?' on, as the client sent it, even an empty query.
    if let Some(q) = uri
        .path_and_query()
        .and_then(|pq| pq.as_str().find('?').map(|i| &pq.as_str()[i..]))
    {
        pq.push_str(q);
    }
    let unforwardable =
        |e: &dyn std::fmt::Display| Refusal::BadRequest(format!("request target can't be forwarded: {e}"));
    let mut p = std::mem::take(uri).into_parts();
    p.path_and_query = Some(http::uri::PathAndQuery::from_maybe_shared(pq).map_err(|e| unforwardable(&e))?);
    *uri = http::Uri::from_parts(p).map_err(|e| unforwardable(&e))?;
    Ok(())
}

fn declared_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// The value of a top-level field of a JSON body, as bucket-name bytes.
fn body_field(body: &[u8], field: &str) -> Result<Vec<u8>, String> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("the body must be a JSON object with {field:?}: {e}"))?;
    match v.get(field) {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.as_bytes().to_vec()),
        Some(serde_json::Value::Number(n)) => Ok(n.to_string().into_bytes()),
        _ => Err(format!("the JSON body needs a non-empty string field {field:?}")),
    }
}

/// Counts a request in flight until it is answered or its client goes away.
struct InFlight<'a>(&'a prometheus_client::metrics::gauge::Gauge);

impl<'a> InFlight<'a> {
    fn new(g: &'a prometheus_client::metrics::gauge::Gauge) -> Self {
        g.inc();
        InFlight(g)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn deciding_name(snap: &Snapshot, batch: &Batch, d: &Decision) -> Option<Arc<str>> {
    d.deciding
        .map(|i| snap.limits[batch[i].limit as usize].name.clone())
}

fn rate_limited(snap: &Snapshot, batch: &Batch, d: &Decision) -> Refusal {
    let limit = deciding_name(snap, batch, d)
        .map(|n| n.to_string())
        .unwrap_or_default();
    Refusal::RateLimited {
        limit,
        retry_after: d.retry_after(),
    }
}

/// A refusal with the `RateLimit` fields of the bucket that decided it.
fn with_budget(refusal: Refusal, budget: Option<Budget>) -> Answer {
    let mut a = Answer::from(refusal);
    a.fields.budget = budget;
    a
}

impl Handler for Gateway {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        self.serve(req, conn).await
    }

    fn has_lane(&self) -> bool {
        true
    }

    fn serve_lane<'a, S: crate::server::LaneIo>(
        &'a self,
        io: S,
        info: &'a ConnInfo,
        limits: &'a crate::server::ServerLimits,
        stop: &'a mut tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = crate::server::Ended<S>> + Send + 'a {
        express::serve(self, io, info, limits, stop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::clock::ManualClock;
    use tollgate_store::memory::MemoryStore;

    /// The first requests of a snapshot arrive together; they must share one in-flight gate
    /// and one pool per upstream, or an upstream could receive a multiple of its cap.
    #[test]
    fn concurrent_first_requests_share_one_live_state() {
        let snap = tollgate_rules::compile(
            br#"{"version": 3, "upstreams": {"u": {"url": "http://127.0.0.1:9", "max_in_flight": 4}},
                "routes": [{"method": "GET", "path": "/", "upstream": "u", "key": "optional"}]}"#,
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap();
        let snap = Arc::new(snap);
        let gw = Gateway::new(
            Arc::new(ArcSwap::new(snap.clone())),
            Arc::new(MemoryStore::new(ManualClock::new(0))),
            TrustedProxies::default(),
            Metrics::new(),
        );
        for _ in 0..300 {
            let barrier = std::sync::Barrier::new(8);
            let lives: Vec<Arc<Live>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            gw.live(&snap)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let gate = |l: &Live| l.upstreams[0].places.gate.clone().unwrap();
            for l in &lives {
                assert!(
                    Arc::ptr_eq(&gate(l), &gate(&lives[0])),
                    "two gates for one upstream"
                );
                assert!(Arc::ptr_eq(&l.upstreams[0].pool, &lives[0].upstreams[0].pool));
            }
            // The next round starts from a fresh gateway state again.
            gw.live.store(Arc::new(Live::default()));
        }
    }
}
