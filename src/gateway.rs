//! The data path of one request: route, identity, plan, one store check, then 429 or forward;
//! and what the operator sees of it (metrics, one access line, the request id).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use http::{HeaderValue, Request, Response};
use http_body_util::Either;
use hyper::body::Incoming;

use http_body_util::{BodyExt, Full, LengthLimitError, Limited};

use crate::identity::{self, KeySource, TrustedProxies};
use crate::limit::decision::{Decision, decide};
use crate::limit::plan;
use crate::logsample::Sampler;
use crate::metrics::{Handles, Metrics};
use crate::proxy::body::{IdleBody, LimitedBody};
use crate::proxy::{Caller, Proxy};
use crate::respond::{Body, Refusal, budget_headers};
use crate::rules::{KeyRequirement, Snapshot, hash_secret};
use crate::sanitize;
use crate::server::{ConnInfo, Handler};
use crate::store::{Batch, FailurePolicy, Source, Store, StoreError};

pub static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub proxy: Proxy,
    pub trusted: TrustedProxies,
    pub metrics: Arc<Metrics>,
    shadow_log: Sampler,
    handles: ArcSwap<Handles>,
}

/// What the limiter said, with the batch it said it about, for headers and logs.
struct Checked {
    batch: Batch,
    decision: Decision,
}

/// What the access line and the metrics need to know about one request.
#[derive(Default)]
struct Trace {
    route: Option<usize>,
    limit: Option<Arc<str>>,
    key_id: Option<Arc<str>>,
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
            shadow_log: Sampler::new(std::time::Duration::from_secs(1)),
            handles: ArcSwap::from_pointee(Handles::new(0, vec![], vec![], vec![])),
        }
    }

    /// Counter handles for this snapshot, made at its first request. Versions only go up, so a
    /// version names one snapshot.
    fn handles(&self, snap: &Snapshot) -> Arc<Handles> {
        let current = self.handles.load_full();
        if current.snapshot == snap.version {
            return current;
        }
        let fresh = Arc::new(Handles::new(
            snap.version,
            snap.routes.iter().map(|r| r.name.clone()).collect(),
            snap.limits.iter().map(|l| l.name.clone()).collect(),
            snap.upstreams.iter().map(|u| u.name.clone()).collect(),
        ));
        self.handles.store(fresh.clone());
        fresh
    }

    async fn check(&self, snap: &Snapshot, h: &Handles, batch: Batch) -> Result<Checked, StoreError> {
        let started = Instant::now();
        let result = self.store.check(&batch).await;
        self.metrics
            .store_check_seconds
            .observe(started.elapsed().as_secs_f64());
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                let kind = if e == StoreError::Timeout {
                    "timeout"
                } else {
                    "error"
                };
                self.metrics
                    .store_errors
                    .get_or_create(&crate::metrics::Kind { kind })
                    .inc();
                return Err(e);
            }
        };
        let decision = decide(&batch, &outcome);
        self.count(snap, h, &batch, &decision);
        Ok(Checked { batch, decision })
    }

    /// Admissions count once per enforced limit paid; a refusal counts for the limit that
    /// decided it. Shadow limits count what they would have refused.
    fn count(&self, snap: &Snapshot, h: &Handles, batch: &[crate::store::CheckItem], d: &Decision) {
        if d.allowed {
            for item in batch.iter().filter(|i| !i.charge.shadow) {
                h.decision(&self.metrics, item.limit as usize, true);
            }
        } else if let Some(i) = d.deciding {
            h.decision(&self.metrics, batch[i].limit as usize, false);
        }
        for &li in &d.shadow_refusals {
            let name = &snap.limits[li as usize].name;
            h.shadow(&self.metrics, li as usize);
            if let Some(suppressed) = self.shadow_log.allow(li as usize) {
                tracing::info!(
                    limit = &**name,
                    suppressed,
                    request_admitted = d.allowed,
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
        why: &'static str,
        h: &Handles,
        trace: &mut Trace,
    ) -> Response<Body> {
        let batch = plan::unauthenticated_only(snap, ip);
        if batch.is_empty() {
            return Refusal::Unauthorized(why).into_response();
        }
        match self.check(snap, h, batch).await {
            Err(_) => Refusal::LimiterUnavailable.into_response(),
            Ok(c) if !c.decision.allowed && c.decision.source == Source::Bypass(FailurePolicy::Closed) => {
                Refusal::LimiterUnavailable.into_response()
            }
            Ok(c) => {
                let mut resp = if c.decision.allowed {
                    Refusal::Unauthorized(why).into_response()
                } else {
                    trace.limit = deciding_name(snap, &c);
                    rate_limited(snap, &c)
                };
                budget_headers(resp.headers_mut(), snap, &c.batch, None, &c.decision);
                resp
            }
        }
    }

    async fn route(
        &self,
        snap: &Snapshot,
        req: Request<Incoming>,
        conn: ConnInfo,
        h: &Handles,
        trace: &mut Trace,
    ) -> Response<Body> {
        let peer = identity::canonical(conn.peer.ip());
        let c = match classify(snap, req.method(), req.uri(), req.headers(), peer, &self.trusted) {
            Ok(c) => c,
            Err(Early::Refuse(r)) => return r.into_response(),
            Err(Early::Unauthorized { route, ip, why }) => {
                trace.route = route;
                // Boxed, like every rare path here: an async fn's future is as large as its
                // largest state, and the common path should not carry (and copy) that size.
                return Box::pin(self.unauthorized(snap, ip, why, h, trace)).await;
            }
        };
        let route = &snap.routes[c.route];
        trace.route = Some(c.route);
        let key_idx = c.key.map(|k| k.0);
        trace.key_id = key_idx.map(|k| snap.keys[k].id.clone());

        if let (Some(max), Some(len)) = (route.max_body_bytes, declared_length(req.headers()))
            && len > max
        {
            return Refusal::PayloadTooLarge { limit: max }.into_response();
        }
        let (parts, body) = req.into_parts();
        // A limit keyed on a body field needs the body before the check: read a bounded prefix,
        // then send what was read.
        let (up_body, tripped, body_value) = match &route.body_field {
            None => {
                let (b, tripped) = LimitedBody::new(body, route.max_body_bytes);
                (Either::Left(b), Some(tripped), None)
            }
            Some(field) => {
                let cap = route.max_body_bytes.unwrap_or(MAX_FIELD_BODY).min(MAX_FIELD_BODY);
                let bytes = match Box::pin(Limited::new(body, cap as usize).collect()).await {
                    Ok(b) => b.to_bytes(),
                    Err(e) if e.is::<LengthLimitError>() => {
                        return Refusal::PayloadTooLarge { limit: cap }.into_response();
                    }
                    Err(e) => {
                        return Refusal::BadRequest(format!("request body failed: {e}")).into_response();
                    }
                };
                let value = match body_field(&bytes, field) {
                    Ok(v) => v,
                    Err(why) => return Refusal::BadRequest(why).into_response(),
                };
                (Either::Right(Full::new(bytes)), None, Some(value))
            }
        };
        let batch = match plan::build(snap, route, key_idx, c.ip, &parts.headers, body_value.as_deref()) {
            Ok(b) => b,
            Err(e) => return Refusal::BadRequest(e.to_string()).into_response(),
        };
        let checked = if batch.is_empty() {
            None
        } else {
            match self.check(snap, h, batch).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "limiter store failed");
                    return Refusal::LimiterUnavailable.into_response();
                }
            }
        };
        if let Some(c) = &checked {
            trace.limit = deciding_name(snap, c);
            if !c.decision.allowed && c.decision.source == Source::Bypass(FailurePolicy::Closed) {
                // The client did nothing wrong: the limiter can't decide, and this limit
                // would rather refuse than guess.
                return Refusal::LimiterUnavailable.into_response();
            }
            if !c.decision.allowed {
                let mut resp = rate_limited(snap, c);
                budget_headers(resp.headers_mut(), snap, &c.batch, key_idx, &c.decision);
                return resp;
            }
        }

        let upstream = &snap.upstreams[route.upstream];
        // Load shedding by the upstream's own health, apart from every client's limits.
        let permit = match &upstream.gate {
            None => None,
            Some(gate) => {
                match tokio::time::timeout(upstream.queue_timeout, gate.clone().acquire_owned()).await {
                    Ok(Ok(p)) => Some(p),
                    _ => {
                        trace.limit = Some(OVERLOADED.clone());
                        return Refusal::UpstreamOverloaded { retry_after: 1 }.into_response();
                    }
                }
            }
        };
        let caller = Caller {
            peer: &conn.peer_header,
            peer_trusted: !self.trusted.is_empty() && self.trusted.contains(c.peer),
            proto: conn.proto,
            key: c
                .key
                .map(|(k, src)| (&snap.keys[k].id_header, &snap.keys[k].tenant_header, src)),
        };
        let started = Instant::now();
        // Boxed: this future is the largest part of a request's, and boxing it once is cheaper
        // than copying it through every enclosing future.
        let forwarded = Box::pin(
            self.proxy
                .forward(upstream, Request::from_parts(parts, up_body), caller),
        )
        .await;
        h.upstream(&self.metrics, route.upstream, started.elapsed());
        let mut resp = match forwarded {
            Ok(r) => r.map(|b| Either::Left(IdleBody::new(b, upstream.timeout, permit))),
            Err(_) if tripped.is_some_and(|t| t.load(std::sync::atomic::Ordering::Acquire)) => {
                let limit = route.max_body_bytes.unwrap_or(0);
                return Refusal::PayloadTooLarge { limit }.into_response();
            }
            Err(refusal) => refusal.into_response(),
        };
        if let Some(c) = &checked {
            budget_headers(resp.headers_mut(), snap, &c.batch, key_idx, &c.decision);
        }
        resp
    }

    /// Serves one request with one rules snapshot from start to end, whatever reloads meanwhile.
    pub async fn serve(&self, mut req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        let started = Instant::now();
        let _in_flight = InFlight::new(&self.metrics.in_flight);
        let snap = self.rules.load_full();
        let h = self.handles(&snap);
        let request_id = match req.headers().get(&X_REQUEST_ID) {
            Some(v) if valid_request_id(v) => v.clone(),
            _ => {
                let id = new_request_id();
                req.headers_mut().insert(X_REQUEST_ID.clone(), id.clone());
                id
            }
        };
        let method = req.method().clone();
        let mut trace = Trace::default();
        let mut resp = match conn.framing.next_request() {
            // Framed two ways: refuse, and close the connection, whose next bytes can't be trusted.
            Some(why) => {
                let mut r = Refusal::BadRequest(why.to_string()).into_response();
                r.headers_mut()
                    .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
                r
            }
            // Boxed so the future hyper keeps for every request stays small.
            None => Box::pin(self.route(&snap, req, conn, &h, &mut trace)).await,
        };
        resp.headers_mut()
            .insert(X_REQUEST_ID.clone(), request_id.clone());
        let status = resp.status().as_u16();
        h.request(&self.metrics, trace.route, &NO_ROUTE, status);
        let route = trace.route.map_or("(none)", |r| &*snap.routes[r].name);
        tracing::info!(
            target: "tollgate::access",
            method = method.as_str(),
            route,
            status,
            limit = trace.limit.as_deref().unwrap_or("-"),
            key = trace.key_id.as_deref().unwrap_or("-"),
            latency_us = started.elapsed().as_micros() as u64,
            request_id = request_id.to_str().unwrap_or("-"),
            "request"
        );
        resp
    }
}

/// The most of a body read to find a limit's JSON field.
pub const MAX_FIELD_BODY: u64 = 16 * 1024;

static NO_ROUTE: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("(none)"));
static OVERLOADED: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from("(upstream overloaded)"));

/// What a request head says against the rules, before any I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classified {
    pub route: usize,
    /// The authenticated key and where its secret came from.
    pub key: Option<(usize, KeySource)>,
    /// The TCP peer.
    pub peer: IpAddr,
    /// The client address the limits key on.
    pub ip: IpAddr,
}

/// A request answered before any limit is checked.
#[derive(Debug)]
pub enum Early {
    Refuse(Refusal),
    /// No usable key: the unauthenticated bucket of `ip` decides between 401 and 429.
    Unauthorized {
        route: Option<usize>,
        ip: IpAddr,
        why: &'static str,
    },
}

/// Reads a request head against a snapshot: framing and path checks, the route, the client
/// address and the key. Pure, so it can be fuzzed.
pub fn classify(
    snap: &Snapshot,
    method: &http::Method,
    uri: &http::Uri,
    headers: &http::HeaderMap,
    peer: IpAddr,
    trusted: &TrustedProxies,
) -> Result<Classified, Early> {
    sanitize::check_head(uri, headers).map_err(|e| Early::Refuse(Refusal::BadRequest(e.to_string())))?;
    let route = snap
        .route(method, uri.path())
        .ok_or(Early::Refuse(Refusal::NotFound))?;
    let ip = identity::client_ip(peer, headers, trusted);
    let key = match identity::credential(headers) {
        Err(e) => return Err(Early::Refuse(Refusal::BadRequest(e.to_string()))),
        Ok(None) => None,
        Ok(Some((secret, source))) => match snap.key_by_hash(&hash_secret(secret)) {
            Some(k) => Some((k, source)),
            None => {
                return Err(Early::Unauthorized {
                    route: Some(route),
                    ip,
                    why: "unknown API key",
                });
            }
        },
    };
    if key.is_none() && snap.routes[route].key == KeyRequirement::Required {
        return Err(Early::Unauthorized {
            route: Some(route),
            ip,
            why: "this route needs an API key (Authorization: Bearer or X-API-Key)",
        });
    }
    Ok(Classified { route, key, peer, ip })
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

fn deciding_name(snap: &Snapshot, c: &Checked) -> Option<Arc<str>> {
    c.decision
        .deciding
        .map(|i| snap.limits[c.batch[i].limit as usize].name.clone())
}

fn rate_limited(snap: &Snapshot, c: &Checked) -> Response<Body> {
    let limit = deciding_name(snap, c).map(|n| n.to_string()).unwrap_or_default();
    Refusal::RateLimited {
        limit,
        retry_after: c.decision.retry_after,
    }
    .into_response()
}

impl Handler for Gateway {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        self.serve(req, conn).await
    }
}
