//! The data path of one request: route, identity, plan, one store check, then 429 or forward;
//! and what the operator sees of it (metrics, one access line, the request id).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use http::{HeaderValue, Request, Response};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::identity::{self, KeySource, TrustedProxies};
use crate::limit::decision::{Decision, decide};
use crate::limit::plan;
use crate::logsample::Sampler;
use crate::metrics::{LimitDecision, LimitLabel, Metrics, RouteStatus};
use crate::proxy::{Caller, Proxy};
use crate::respond::{Body, Refusal, budget_headers};
use crate::rules::{KeyRequirement, Snapshot, hash_secret};
use crate::server::{ConnInfo, Handler};
use crate::store::{Batch, Store, StoreError};

pub static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub proxy: Proxy,
    pub trusted: TrustedProxies,
    pub metrics: Arc<Metrics>,
    shadow_log: Sampler,
}

/// What the limiter said, with the batch it said it about, for headers and logs.
struct Checked {
    batch: Batch,
    decision: Decision,
}

/// What the access line and the metrics need to know about one request.
#[derive(Default)]
struct Trace {
    route: Option<Arc<str>>,
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
        }
    }

    async fn check(&self, snap: &Snapshot, batch: Batch) -> Result<Checked, StoreError> {
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
        self.count(snap, &batch, &decision);
        Ok(Checked { batch, decision })
    }

    /// Admissions count once per enforced limit paid; a refusal counts for the limit that
    /// decided it. Shadow limits count what they would have refused.
    fn count(&self, snap: &Snapshot, batch: &[crate::store::CheckItem], d: &Decision) {
        if d.allowed {
            for item in batch.iter().filter(|i| !i.charge.shadow) {
                self.metrics
                    .decisions
                    .get_or_create(&LimitDecision {
                        limit: snap.limits[item.limit as usize].name.to_string(),
                        decision: "admitted",
                    })
                    .inc();
            }
        } else if let Some(i) = d.deciding {
            self.metrics
                .decisions
                .get_or_create(&LimitDecision {
                    limit: snap.limits[batch[i].limit as usize].name.to_string(),
                    decision: "refused",
                })
                .inc();
        }
        for &li in &d.shadow_refusals {
            let name = &snap.limits[li as usize].name;
            self.metrics
                .shadow_refusals
                .get_or_create(&LimitLabel {
                    limit: name.to_string(),
                })
                .inc();
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
        trace: &mut Trace,
    ) -> Response<Body> {
        let batch = plan::unauthenticated_only(snap, ip);
        if batch.is_empty() {
            return Refusal::Unauthorized(why).into_response();
        }
        match self.check(snap, batch).await {
            Err(_) => Refusal::LimiterUnavailable.into_response(),
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
        trace: &mut Trace,
    ) -> Response<Body> {
        let Some(ri) = snap.route(req.method(), req.uri().path()) else {
            return Refusal::NotFound.into_response();
        };
        let route = &snap.routes[ri];
        trace.route = Some(route.name.clone());
        let peer = identity::canonical(conn.peer.ip());
        let ip = identity::client_ip(peer, req.headers(), &self.trusted);

        let key: Option<(usize, KeySource)> = match identity::credential(req.headers()) {
            Err(e) => return Refusal::BadRequest(e.to_string()).into_response(),
            Ok(None) => None,
            Ok(Some((secret, source))) => match snap.key_by_hash(&hash_secret(secret)) {
                Some(k) => Some((k, source)),
                None => return self.unauthorized(snap, ip, "unknown API key", trace).await,
            },
        };
        if key.is_none() && route.key == KeyRequirement::Required {
            let why = "this route needs an API key (Authorization: Bearer or X-API-Key)";
            return self.unauthorized(snap, ip, why, trace).await;
        }
        let key_idx = key.map(|k| k.0);
        trace.key_id = key_idx.map(|k| snap.keys[k].id.clone());
        let batch = match plan::build(snap, route, key_idx, ip, req.headers()) {
            Ok(b) => b,
            Err(e) => return Refusal::BadRequest(e.to_string()).into_response(),
        };
        let checked = if batch.is_empty() {
            None
        } else {
            match self.check(snap, batch).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "limiter store failed");
                    return Refusal::LimiterUnavailable.into_response();
                }
            }
        };
        if let Some(c) = &checked {
            trace.limit = deciding_name(snap, c);
            if !c.decision.allowed {
                let mut resp = rate_limited(snap, c);
                budget_headers(resp.headers_mut(), snap, &c.batch, key_idx, &c.decision);
                return resp;
            }
        }

        let caller = Caller {
            peer,
            peer_trusted: self.trusted.contains(peer),
            proto: conn.proto,
            key: key.map(|(k, src)| (&*snap.keys[k].id, &*snap.keys[k].tenant, src)),
        };
        let (parts, body) = req.into_parts();
        let upstream = &snap.upstreams[route.upstream];
        let started = Instant::now();
        let forwarded = self
            .proxy
            .forward(upstream, Request::from_parts(parts, Either::Left(body)), caller)
            .await;
        self.metrics.observe_upstream(&upstream.name, started.elapsed());
        let mut resp = match forwarded {
            Ok(r) => r.map(Either::Left),
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
        let mut resp = self.route(&snap, req, conn, &mut trace).await;
        resp.headers_mut()
            .insert(X_REQUEST_ID.clone(), request_id.clone());
        let status = resp.status().as_u16();
        let route = trace.route.as_deref().unwrap_or("(none)");
        self.metrics
            .requests
            .get_or_create(&RouteStatus {
                route: route.to_string(),
                status,
            })
            .inc();
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
