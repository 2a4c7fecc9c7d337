//! The admin listener, never the public port: health, readiness and the running rules.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use arc_swap::ArcSwap;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use crate::respond::{Body, json_response};
use crate::server::{ConnInfo, Handler};
use tollgate_rules::Snapshot;
use tollgate_store::{FailurePolicy, Store};
use tollgate_telemetry::metrics::Metrics;

pub(crate) struct Admin {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
}

impl Admin {
    pub async fn serve(&self, req: Request<Incoming>) -> Response<Body> {
        if req.method() != Method::GET {
            return json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                json!({"error": "method_not_allowed"}).to_string(),
            );
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
            _ => json_response(StatusCode::NOT_FOUND, json!({"error": "not_found"}).to_string()),
        }
    }
}

impl Handler for Admin {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        self.serve(req).await
    }
}
