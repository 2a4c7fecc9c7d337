//! The admin listener, never the public port: health, readiness, metrics, the running rules
//! and a key's usage and quota.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use arc_swap::ArcSwap;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use crate::respond::{ApiError, Body, json_response};
use crate::server::{ConnInfo, Handler};
use tollgate_limit::clock::Clock;
use tollgate_meter::counter::Meter;
use tollgate_meter::flags::{Flags, State};
use tollgate_rules::Snapshot;
use tollgate_store::{FailurePolicy, Store};
use tollgate_telemetry::metrics::Metrics;

pub(crate) struct Admin {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// This gateway's usage counts and the quota flags it last read.
    pub meter: Option<Arc<Meter>>,
    pub quota_flags: Arc<ArcSwap<Flags>>,
    pub clock: Arc<dyn Clock>,
    /// Limits shared with other Regions, when this gateway has a Region.
    pub regions: Option<Arc<crate::regions::Regions>>,
    pub gateway: Arc<crate::request::Gateway>,
    pub reloader: Arc<crate::reload::Reloader>,
    /// The names `/admin/` answers to besides IP literals and `localhost`.
    pub hosts: crate::admin_guard::AdminHosts,
    /// The token `/admin/keys` asks for; without one it answers 404.
    pub token: Option<crate::admin_guard::AdminToken>,
    /// Keys made through the admin API; `None` on a store that keeps none.
    pub keys: Option<Arc<crate::managed::ManagedKeys>>,
    /// The stop signal came: `/readyz` answers 503 while the gateway serves on.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// The demo's upstream instances, which `/admin/demo/instances` stops and starts.
    pub demo: Option<Arc<crate::demo_instances::DemoInstances>>,
}

/// A static asset of the dashboard, cached by nobody: it is served from the binary.
fn asset(content_type: &'static str, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(http_body_util::Either::Right(http_body_util::Full::new(
        bytes::Bytes::from_static(body.as_bytes()),
    )));
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    h.insert(
        http::HeaderName::from_static("content-security-policy"),
        http::HeaderValue::from_static("default-src 'self'; style-src 'self' 'unsafe-inline'"),
    );
    h.insert(
        http::HeaderName::from_static("x-content-type-options"),
        http::HeaderValue::from_static("nosniff"),
    );
    resp
}

impl Admin {
    pub async fn serve(&self, req: Request<Incoming>, peer: std::net::SocketAddr) -> Response<Body> {
        if let Some(refused) = duplicated(&req) {
            return refused;
        }
        if let Some(refused) = self.foreign_host(&req) {
            return refused;
        }
        let path = req.uri().path();
        if path == "/admin/keys" || path.starts_with("/admin/keys/") {
            return self.keys_api(req, peer).await;
        }
        if path == "/admin/blocks" {
            return self.blocks_api(req, peer).await;
        }
        if let Some(demo) = &self.demo
            && let Some(rest) = path.strip_prefix("/admin/demo/instances")
        {
            return demo_instances(demo, req.method(), rest).await;
        }
        if req.method() != Method::GET {
            return ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").into_response();
        }
        match req.uri().path() {
            "/metrics" => {
                let mut resp = Response::new(http_body_util::Either::Right(http_body_util::Full::new(
                    bytes::Bytes::from(self.metrics.render()),
                )));
                resp.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(tollgate_telemetry::metrics::CONTENT_TYPE),
                );
                resp
            }
            "/healthz" => json_response(StatusCode::OK, json!({"status": "alive"}).to_string()),
            "/admin/regions" => match &self.regions {
                Some(r) => {
                    let now_ms = std::time::SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64);
                    json_response(StatusCode::OK, r.describe(now_ms).await.to_string())
                }
                None => ApiError::new(StatusCode::NOT_FOUND, "no_regions")
                    .with("detail", "this gateway was started without --region")
                    .into_response(),
            },
            "/readyz" if self.draining.load(std::sync::atomic::Ordering::SeqCst) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "draining", "reason": "the gateway is shutting down"}).to_string(),
            ),
            "/readyz" => {
                let snap = self.rules.load();
                match self.store.ping().await {
                    Ok(_) => json_response(
                        StatusCode::OK,
                        json!({"status": "ready", "rules_version": snap.version, "store": self.store.kind()}).to_string(),
                    ),
                    // The store is down, but limits that may decide without it keep serving.
                    Err(e) if snap.limits.iter().any(|l| l.policy != FailurePolicy::Closed) => json_response(
                        StatusCode::OK,
                        json!({"status": "degraded", "rules_version": snap.version, "store": self.store.kind(),
                               "reason": e.to_string(), "serving": "by failure policy"})
                        .to_string(),
                    ),
                    Err(e) => json_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        json!({"status": "not_ready", "store": self.store.kind(), "reason": e.to_string()}).to_string(),
                    ),
                }
            }
            "/admin/rules" => {
                let snap = self.rules.load();
                let loaded = snap
                    .loaded_at
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                json_response(
                    StatusCode::OK,
                    json!({
                        "version": snap.version,
                        "digest": format!("sha256:{}", snap.digest),
                        "source": snap.source,
                        "loaded_at_unix_ms": loaded,
                        "limits": snap.limits.len(),
                        "routes": snap.routes.len(),
                        "keys": snap.keys.len(),
                    })
                    .to_string(),
                )
            }
            "/admin/usage" => self.usage(req.uri().query()),
            "/admin/upstreams" => json_response(
                StatusCode::OK,
                json!({"upstreams": self.gateway.upstream_targets()}).to_string(),
            ),
            "/admin" | "/admin/" => asset("text/html; charset=utf-8", crate::dashboard::INDEX_HTML),
            "/admin/favicon.svg" => asset("image/svg+xml", crate::dashboard::FAVICON),
            "/admin/app.js" => asset("text/javascript; charset=utf-8", crate::dashboard::APP_JS),
            "/admin/vendor/uPlot.iife.min.js" => {
                asset("text/javascript; charset=utf-8", crate::dashboard::UPLOT_JS)
            }
            "/admin/vendor/uPlot.min.css" => asset("text/css; charset=utf-8", crate::dashboard::UPLOT_CSS),
            "/admin/api/overview" => {
                let view = crate::dashboard::View {
                    rules: &self.rules,
                    reloader: &self.reloader,
                    metrics: &self.metrics,
                    store_kind: self.store.kind(),
                    meter: self.meter.as_deref(),
                    upstreams: self.gateway.upstreams_now(),
                    regions: self.regions.as_deref(),
                };
                json_response(
                    StatusCode::OK,
                    self.gateway.dashboard().overview(view).await.to_string(),
                )
            }
            _ => ApiError::new(StatusCode::NOT_FOUND, "not_found").into_response(),
        }
    }
}

/// `/admin/demo/instances`: the list, and `POST …/NAME/stop` and `…/NAME/start`, the demo's
/// own controls (no token: only `tollgate demo` has them).
async fn demo_instances(
    demo: &crate::demo_instances::DemoInstances,
    method: &Method,
    rest: &str,
) -> Response<Body> {
    let parts: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let done = |name: &str, r: Option<bool>, did: &str| match r {
        None => ApiError::new(StatusCode::NOT_FOUND, "not_found")
            .with("message", format!("no demo instance {name:?}"))
            .into_response(),
        Some(changed) => json_response(
            StatusCode::OK,
            json!({"instance": name, did: changed}).to_string(),
        ),
    };
    match (method, parts.as_slice()) {
        (&Method::GET, []) => json_response(StatusCode::OK, demo.view().to_string()),
        (&Method::POST, [name, "stop"]) => done(name, demo.stop(name), "stopped"),
        (&Method::POST, [name, "start"]) => match demo.start_again(name).await {
            Ok(r) => done(name, r, "started"),
            Err(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable")
                .with("message", format!("{name}: cannot listen again: {e}"))
                .into_response(),
        },
        (_, [] | [_, "stop" | "start"]) => {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").into_response()
        }
        _ => ApiError::new(StatusCode::NOT_FOUND, "not_found").into_response(),
    }
}

/// 400 for a request with two `Host` or two `Authorization` headers, as the public port refuses
/// a second `Host`: taking the first of two would let whatever added the other decide which
/// name or token the listener judges.
fn duplicated(req: &Request<Incoming>) -> Option<Response<Body>> {
    [
        (http::header::HOST, "Host"),
        (http::header::AUTHORIZATION, "Authorization"),
    ]
    .into_iter()
    .find(|(name, _)| req.headers().get_all(name).iter().nth(1).is_some())
    .map(|(_, shown)| {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
            .with("message", format!("more than one {shown} header"))
            .into_response()
    })
}

impl Admin {
    /// 421 for an `/admin` request naming a host the pages don't answer to. Probes and
    /// scrapers name the gateway however they reach it; the pages and the API are what a page
    /// in a browser must not reach through a rebound name.
    fn foreign_host(&self, req: &Request<Incoming>) -> Option<Response<Body>> {
        if !req.uri().path().starts_with("/admin") {
            return None;
        }
        let host = match req.uri().authority() {
            Some(a) => a.as_str(),
            None => req
                .headers()
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or(""),
        };
        (!self.hosts.allows(host)).then(|| {
            ApiError::new(StatusCode::MISDIRECTED_REQUEST, "misdirected_request")
                .with(
                    "detail",
                    "the admin pages answer to IP literals, localhost and the names given with --admin-host",
                )
                .into_response()
        })
    }

    /// `/admin/keys…`: only with the operator's token, and not at all without one configured
    /// (404, as if there were no such API).
    async fn keys_api(&self, req: Request<Incoming>, peer: std::net::SocketAddr) -> Response<Body> {
        let (Some(_), Some(keys)) = (&self.token, &self.keys) else {
            return ApiError::new(StatusCode::NOT_FOUND, "not_found")
                .with(
                    "detail",
                    "the key API is on with --admin-token-file, on the embedded store or one Redis node",
                )
                .into_response();
        };
        if let Some(refused) = self.token_refuses(&req, peer, "the key API") {
            return refused;
        }
        keys.serve(req, peer).await
    }

    /// A change through the admin API needs the operator's token: 404 without one configured
    /// (as if there were no such API), 401 without it or with another, logged and counted so
    /// someone guessing the token shows up.
    pub(crate) fn token_refuses(
        &self,
        req: &Request<Incoming>,
        peer: std::net::SocketAddr,
        what: &str,
    ) -> Option<Response<Body>> {
        let Some(token) = &self.token else {
            return Some(
                ApiError::new(StatusCode::NOT_FOUND, "not_found")
                    .with("detail", format!("{what} is on with --admin-token-file"))
                    .into_response(),
            );
        };
        if token.allows(req.headers().get(http::header::AUTHORIZATION)) {
            return None;
        }
        self.metrics.admin_auth_failures.inc();
        let given = if req.headers().contains_key(http::header::AUTHORIZATION) {
            "a wrong token"
        } else {
            "no token"
        };
        tracing::warn!(peer = %peer, path = req.uri().path(), method = %req.method(),
            "admin request refused: {given}");
        let mut r = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized")
            .with("reason", "admin_token")
            .into_response();
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        Some(r)
    }

    /// `GET /admin/usage?key=ID`: what this gateway has admitted for the key since it started,
    /// and the key's quota as the last flags read say.
    fn usage(&self, query: Option<&str>) -> Response<Body> {
        let bad = |status: StatusCode, message: String| {
            ApiError::new(status, "bad_request")
                .with("message", message)
                .into_response()
        };
        let Some(id) = query
            .unwrap_or("")
            .split('&')
            .find_map(|p| p.strip_prefix("key="))
            .filter(|k| !k.is_empty())
        else {
            return bad(
                StatusCode::BAD_REQUEST,
                "name the key: /admin/usage?key=ID".into(),
            );
        };
        let snap = self.rules.load();
        let Some(k) = snap.key_by_id(id) else {
            return ApiError::new(StatusCode::NOT_FOUND, "not_found")
                .with("message", format!("no key with id {id:?}"))
                .into_response();
        };
        let key = &snap.keys[k];
        let admitted = self.meter.as_ref().map(|m| {
            m.totals()
                .into_iter()
                .find(|(kid, _)| **kid == *key.id)
                .map_or(0, |(_, t)| t)
        });
        let now_ms = (self.clock.now_us() / 1000) as i64;
        let flags = self.quota_flags.load();
        let flag = flags.get(&*key.id);
        let quota = key.quota.as_ref().map(|q| {
            let period = q.period(now_ms);
            let current = flag.filter(|f| f.in_force(now_ms) && f.period == period.label);
            json!({
                "per": q.per.as_str(),
                "limit": q.limit,
                "timezone": q.zone_name,
                "period": period.label,
                "resets_at": period.resets_at,
                "used": current.map(|f| f.used),
                "state": current.map_or("under", |f| match f.state {
                    State::Under => "under",
                    State::Near => "near",
                    State::Over => "over",
                }),
            })
        });
        json_response(
            StatusCode::OK,
            json!({
                "key": &*key.id,
                "tenant": &*key.tenant,
                "metering": self.meter.as_ref().map(|m| m.identity().to_string()),
                "admitted_by_this_gateway": admitted,
                "quota": quota,
            })
            .to_string(),
        )
    }
}

impl Handler for Admin {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        self.serve(req, conn.peer).await
    }
}
