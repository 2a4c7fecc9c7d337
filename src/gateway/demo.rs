//! The built-in demo upstream ("orders"): answers any path with a small JSON echo, with the
//! status `?status=NNN` asks for (to play a failed login, say), and `/v1/slow?ms=N` after N
//! milliseconds. Bodies are read in full but never held. With workers ([`Workers`]) it plays an
//! overloaded service: N requests served at a time, each for a service time, the rest queued
//! without bound.

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
        self.answer(req, None).await
    }

    /// The answer; `workers` when a pool serves it, which then holds a worker for the service
    /// time instead of sleeping unbounded.
    async fn answer(&self, req: Request<Incoming>, workers: Option<&Workers>) -> Response<Body> {
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
        let slow = if path == "/v1/slow" {
            match query_ms(parts.uri.query()) {
                Ok(ms) => Some(Duration::from_millis(ms)),
                Err(m) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        json!({"error": "bad_request", "message": m}).to_string(),
                    );
                }
            }
        } else {
            None
        };
        match workers {
            Some(w) => {
                // A closed semaphore can't happen (it is never closed); serve without a worker
                // rather than fail if it ever did.
                let _worker = w.pool.acquire().await.ok();
                tokio::time::sleep(slow.unwrap_or(w.service)).await;
            }
            // Only `/v1/slow` waits: a zero sleep still waits for the timer's next tick.
            None => {
                if let Some(d) = slow {
                    tokio::time::sleep(d).await;
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

/// The demo upstream behind a pool of workers: each request waits (in arrival order, without
/// bound, like a real overloaded service) for a worker, which serves it for the service time,
/// or N ms for `/v1/slow?ms=N`.
#[derive(Debug)]
pub struct Workers {
    pool: tokio::sync::Semaphore,
    service: Duration,
}

impl Workers {
    /// `workers` at a time (at least 1), each request taking `service`.
    pub fn new(workers: u32, service: Duration) -> Result<Workers, String> {
        if workers == 0 {
            return Err("--workers must be at least 1".into());
        }
        if service > Duration::from_millis(MAX_SLOW_MS) {
            return Err(format!("--latency-ms must be at most {MAX_SLOW_MS}"));
        }
        Ok(Workers {
            pool: tokio::sync::Semaphore::new(workers as usize),
            service,
        })
    }
}

impl Handler for Workers {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        DemoUpstream.answer(req, Some(&self)).await
    }
}

impl Handler for DemoUpstream {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        self.serve(req).await
    }
}
