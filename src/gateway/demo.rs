//! The built-in demo upstream ("orders"): answers any path with a small JSON echo, and
//! `/v1/slow?ms=N` after N milliseconds. Bodies are read in full but never held.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;

use crate::respond::{Body, json_response};
use crate::server::{ConnInfo, Handler};

/// Longest delay `/v1/slow` accepts.
const MAX_SLOW_MS: u64 = 120_000;

#[derive(Debug, Default)]
pub struct DemoUpstream;

fn query_ms(query: Option<&str>) -> Result<u64, String> {
    let Some(q) = query else { return Ok(0) };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("ms=") {
            return match v.parse::<u64>() {
                Ok(ms) if ms <= MAX_SLOW_MS => Ok(ms),
                _ => Err(format!("ms must be a whole number from 0 to {MAX_SLOW_MS}")),
            };
        }
    }
    Ok(0)
}

impl DemoUpstream {
    pub async fn serve(&self, req: Request<Incoming>) -> Response<Body> {
        let (parts, mut body) = req.into_parts();
        let mut bytes: u64 = 0;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Some(d) = f.data_ref() {
                        bytes += d.len() as u64;
                    }
                }
                Err(e) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        json!({"error": "bad_request", "message": format!("request body failed: {e}")})
                            .to_string(),
                    );
                }
            }
        }
        let path = parts.uri.path();
        if path == "/v1/slow" {
            match query_ms(parts.uri.query()) {
                Ok(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                Err(m) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        json!({"error": "bad_request", "message": m}).to_string(),
                    );
                }
            }
        }
        let headers: serde_json::Map<String, serde_json::Value> = parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    json!(String::from_utf8_lossy(v.as_bytes())),
                )
            })
            .collect();
        json_response(
            StatusCode::OK,
            json!({
                "service": "orders",
                "method": parts.method.as_str(),
                "path": path,
                "query": parts.uri.query(),
                "bytes": bytes,
                "headers": headers,
            })
            .to_string(),
        )
    }
}

impl Handler for DemoUpstream {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        self.serve(req).await
    }
}
