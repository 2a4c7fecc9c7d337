//! The built-in demo upstream ("orders"): answers any path with a small JSON echo, with the
//! status `?status=NNN` asks for (to play a failed login, say), and `/v1/slow?ms=N` after N
//! milliseconds. Bodies are read in full but never held.

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

/// The status `?status=NNN` asks for: a final status that may carry the echo's body.
fn query_status(query: Option<&str>) -> Result<StatusCode, String> {
    let Some(q) = query else { return Ok(StatusCode::OK) };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("status=") {
            return match v.parse::<u16>() {
                Ok(s) if (200..=599).contains(&s) && s != 204 && s != 304 => {
                    StatusCode::from_u16(s).map_err(|e| e.to_string())
                }
                _ => Err("status must be from 200 to 599, not 204 or 304 (they carry no body)".into()),
            };
        }
    }
    Ok(StatusCode::OK)
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
        let status = match query_status(parts.uri.query()) {
            Ok(s) => s,
            Err(m) => {
                return json_response(
                    StatusCode::BAD_REQUEST,
                    json!({"error": "bad_request", "message": m}).to_string(),
                );
            }
        };
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
            status,
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
