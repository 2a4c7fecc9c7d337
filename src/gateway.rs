//! The data path of one request: route, identity, plan, one store check, then 429 or forward.

use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{Request, Response};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::identity::{self, KeySource, TrustedProxies};
use crate::limit::decision::{Decision, decide};
use crate::limit::plan;
use crate::proxy::{Caller, Proxy};
use crate::respond::{Body, Refusal, budget_headers};
use crate::rules::{KeyRequirement, Snapshot, hash_secret};
use crate::server::{ConnInfo, Handler};
use crate::store::{Batch, Store, StoreError};

/// Everything a request needs, shared by all connections.
pub struct Gateway {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub proxy: Proxy,
    pub trusted: TrustedProxies,
}

/// What the limiter said, with the batch it said it about, for headers and logs.
struct Checked {
    batch: Batch,
    decision: Decision,
}

impl Gateway {
    pub fn new(rules: Arc<ArcSwap<Snapshot>>, store: Arc<dyn Store>, trusted: TrustedProxies) -> Gateway {
        Gateway {
            rules,
            store,
            proxy: Proxy::new(),
            trusted,
        }
    }

    async fn check(&self, batch: Batch) -> Result<Checked, StoreError> {
        let outcome = self.store.check(&batch).await?;
        let decision = decide(&batch, &outcome);
        Ok(Checked { batch, decision })
    }

    /// A request without a usable key pays the unauthenticated bucket of its IP: a refused one
    /// gets 429, so guessing keys is limited too; an admitted one gets 401.
    async fn unauthorized(&self, snap: &Snapshot, ip: IpAddr, why: &'static str) -> Response<Body> {
        let batch = plan::unauthenticated_only(snap, ip);
        if batch.is_empty() {
            return Refusal::Unauthorized(why).into_response();
        }
        match self.check(batch).await {
            Err(_) => Refusal::LimiterUnavailable.into_response(),
            Ok(c) => {
                let mut resp = if c.decision.allowed {
                    Refusal::Unauthorized(why).into_response()
                } else {
                    rate_limited(snap, &c)
                };
                budget_headers(resp.headers_mut(), snap, &c.batch, None, &c.decision);
                resp
            }
        }
    }

    pub async fn serve(&self, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        // One snapshot from start to end, whatever reloads meanwhile.
        let snap = self.rules.load_full();
        let Some(ri) = snap.route(req.method(), req.uri().path()) else {
            return Refusal::NotFound.into_response();
        };
        let route = &snap.routes[ri];
        let peer = identity::canonical(conn.peer.ip());
        let ip = identity::client_ip(peer, req.headers(), &self.trusted);

        let key: Option<(usize, KeySource)> = match identity::credential(req.headers()) {
            Err(e) => return Refusal::BadRequest(e.to_string()).into_response(),
            Ok(None) => None,
            Ok(Some((secret, source))) => match snap.key_by_hash(&hash_secret(secret)) {
                Some(k) => Some((k, source)),
                None => return self.unauthorized(&snap, ip, "unknown API key").await,
            },
        };
        if key.is_none() && route.key == KeyRequirement::Required {
            return self
                .unauthorized(
                    &snap,
                    ip,
                    "this route needs an API key (Authorization: Bearer or X-API-Key)",
                )
                .await;
        }
        let key_idx = key.map(|k| k.0);
        let batch = match plan::build(&snap, route, key_idx, ip, req.headers()) {
            Ok(b) => b,
            Err(e) => return Refusal::BadRequest(e.to_string()).into_response(),
        };
        let checked = if batch.is_empty() {
            None
        } else {
            match self.check(batch).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "limiter store failed");
                    return Refusal::LimiterUnavailable.into_response();
                }
            }
        };
        if let Some(c) = &checked
            && !c.decision.allowed
        {
            let mut resp = rate_limited(&snap, c);
            budget_headers(resp.headers_mut(), &snap, &c.batch, key_idx, &c.decision);
            return resp;
        }

        let caller = Caller {
            peer,
            peer_trusted: self.trusted.contains(peer),
            proto: conn.proto,
            key: key.map(|(k, src)| (&*snap.keys[k].id, &*snap.keys[k].tenant, src)),
        };
        let (parts, body) = req.into_parts();
        let upstream = &snap.upstreams[route.upstream];
        let mut resp = match self
            .proxy
            .forward(upstream, Request::from_parts(parts, Either::Left(body)), caller)
            .await
        {
            Ok(r) => r.map(Either::Left),
            Err(refusal) => refusal.into_response(),
        };
        if let Some(c) = &checked {
            budget_headers(resp.headers_mut(), &snap, &c.batch, key_idx, &c.decision);
        }
        resp
    }
}

fn rate_limited(snap: &Snapshot, c: &Checked) -> Response<Body> {
    let limit = c
        .decision
        .deciding
        .map(|i| snap.limits[c.batch[i].limit as usize].name.to_string())
        .unwrap_or_default();
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
