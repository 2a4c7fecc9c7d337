//! The built-in demo upstream ("orders"): answers any path with a small JSON echo, with the
//! status `?status=NNN` asks for (to play a failed login, say), and `/v1/slow?ms=N` after N
//! milliseconds; `/v1/completions?tokens=N` reports its cost as `X-Usage-Tokens: N`, as an LLM
//! service reports the tokens an answer used; `/v1/stream` is a WebSocket that echoes every
//! message. Bodies are read in full but never held. With workers ([`Workers`]) it plays an
//! overloaded service: N requests served at a time, each for a service time, the rest queued
//! without bound. Also the demo's bearer tokens (`tollgate demo-token`), signed with the demo's
//! private key in `certs/`.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::json;

use crate::respond::{ApiError, Body, json_response};
use crate::server::{ConnInfo, Handler};

/// The header the demo's completions report their cost in.
static USAGE_TOKENS: http::HeaderName = http::HeaderName::from_static("x-usage-tokens");

/// Longest delay `/v1/slow` accepts.
const MAX_SLOW_MS: u64 = 120_000;

/// The demo's upstream; `instance` names it in its answers (`"instance"`), to tell several
/// instances behind one upstream apart.
#[derive(Debug, Default, Clone)]
pub struct DemoUpstream {
    pub instance: Option<Arc<str>>,
}

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

/// The cost `/v1/completions?tokens=N` reports, when it names one.
fn query_tokens(query: Option<&str>) -> Result<Option<u64>, String> {
    let Some(q) = query else { return Ok(None) };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("tokens=") {
            return v
                .parse::<u64>()
                .map(Some)
                .map_err(|_| "tokens must be a whole number of tokens".to_string());
        }
    }
    Ok(None)
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
        if req.uri().path() == STREAM_PATH {
            return echo_stream(req);
        }
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
                    return ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
                        .with("message", format!("request body failed: {e}"))
                        .into_response();
                }
            }
        }
        let path = parts.uri.path();
        let slow = if path == "/v1/slow" {
            match query_ms(parts.uri.query()) {
                Ok(ms) => Some(Duration::from_millis(ms)),
                Err(m) => {
                    return ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
                        .with("message", m)
                        .into_response();
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
                return ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
                    .with("message", m)
                    .into_response();
            }
        };
        let tokens = if path == "/v1/completions" {
            match query_tokens(parts.uri.query()) {
                Ok(t) => t,
                Err(m) => {
                    return ApiError::new(StatusCode::BAD_REQUEST, "bad_request")
                        .with("message", m)
                        .into_response();
                }
            }
        } else {
            None
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
        let mut answer = json!({
            "service": "orders",
            "method": parts.method.as_str(),
            "path": path,
            "query": parts.uri.query(),
            "bytes": bytes,
            "headers": headers,
        });
        if let Some(name) = &self.instance {
            answer["instance"] = json!(&**name);
        }
        let mut resp = json_response(status, answer.to_string());
        if let Some(t) = tokens {
            resp.headers_mut()
                .insert(USAGE_TOKENS.clone(), http::HeaderValue::from(t));
        }
        resp
    }
}

/// The demo's WebSocket.
const STREAM_PATH: &str = "/v1/stream";

/// `/v1/stream`: a WebSocket opening handshake is answered `101`, and every text or binary
/// message then sent is sent back; anything else gets `426` saying what the path is.
fn echo_stream(mut req: Request<Incoming>) -> Response<Body> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::{Message, handshake::derive_accept_key, protocol::Role};
    let h = req.headers();
    let websocket = tollgate_http1::upgrade_offered(h).any(|p| p.eq_ignore_ascii_case(b"websocket"));
    let key = h.get("sec-websocket-key").filter(|_| {
        req.method() == http::Method::GET
            && websocket
            && h.get("sec-websocket-version").is_some_and(|v| v == "13")
    });
    let Some(key) = key else {
        let mut resp = ApiError::new(StatusCode::UPGRADE_REQUIRED, "upgrade_required").with("message", "/v1/stream is a WebSocket that echoes each message: connect with a WebSocket client (version 13)").into_response();
        resp.headers_mut()
            .insert(http::header::UPGRADE, http::HeaderValue::from_static("websocket"));
        return resp;
    };
    let accept = derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else { return };
        let io = hyper_util::rt::TokioIo::new(upgraded);
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(io, Role::Server, None).await;
        // Pings are answered and a close is returned by the stream itself.
        while let Some(Ok(msg)) = ws.next().await {
            if matches!(msg, Message::Text(_) | Message::Binary(_)) && ws.send(msg).await.is_err() {
                break;
            }
        }
    });
    let mut resp = Response::new(http_body_util::Either::Right(http_body_util::Full::default()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(http::header::UPGRADE, http::HeaderValue::from_static("websocket"));
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("upgrade"),
    );
    if let Ok(v) = http::HeaderValue::from_str(&accept) {
        h.insert(http::header::SEC_WEBSOCKET_ACCEPT, v);
    }
    resp
}

/// The demo upstream behind a pool of workers: each request waits (in arrival order, without
/// bound, like a real overloaded service) for a worker, which serves it for the service time,
/// or N ms for `/v1/slow?ms=N`.
#[derive(Debug)]
pub struct Workers {
    pool: tokio::sync::Semaphore,
    service: Duration,
    upstream: DemoUpstream,
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
            upstream: DemoUpstream::default(),
        })
    }

    /// These workers answering as `upstream` does (its name).
    pub fn serving(mut self, upstream: DemoUpstream) -> Workers {
        self.upstream = upstream;
        self
    }
}

impl Handler for Workers {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        self.upstream.answer(req, Some(&self)).await
    }
}

impl Handler for DemoUpstream {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, _conn: ConnInfo) -> Response<Body> {
        self.serve(req).await
    }
}

/// The demo's JWT signing key: public in this repository, so good for the demo and nothing else.
const DEMO_JWT_KEY: &[u8] = include_bytes!("../../certs/demo-jwt-key.pem");
/// The demo JWKS's key id for it.
const DEMO_JWT_KID: &str = "demo-1";

/// What `tollgate demo-token` signs.
#[derive(Debug, Clone)]
pub struct DemoToken {
    pub sub: String,
    /// The tenant claim; the subject when not given.
    pub org: Option<String>,
    pub plan: String,
    pub exp_seconds: u64,
}

/// A token for the demo's JWT route, signed with the demo key; its issuer and audience are
/// read from the built-in demo rules, so the two can't drift apart.
pub fn demo_token(t: &DemoToken, now_unix: u64) -> Result<String, String> {
    let loader = tollgate_rules::RulesLoader {
        source: tollgate_rules::RulesSource::demo(),
        opts: tollgate_rules::CompileOptions::default(),
        upstream_override: Vec::new(),
    };
    let snap = loader.load().map_err(|e| e.to_string())?;
    let jwt = snap
        .jwt
        .as_ref()
        .ok_or("the demo rules have no \"jwt\" settings")?;
    let mut claims = serde_json::Map::new();
    claims.insert(jwt.key_claim.clone(), json!(t.sub));
    if let Some(c) = &jwt.tenant_claim {
        claims.insert(c.clone(), json!(t.org.as_deref().unwrap_or(&t.sub)));
    }
    claims.insert("plan".into(), json!(t.plan));
    claims.insert("iss".into(), json!(jwt.issuer));
    claims.insert("aud".into(), json!(jwt.audience));
    claims.insert("iat".into(), json!(now_unix));
    claims.insert("exp".into(), json!(now_unix + t.exp_seconds));
    let key =
        jsonwebtoken::EncodingKey::from_ed_pem(DEMO_JWT_KEY).map_err(|e| format!("the demo key: {e}"))?;
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
    header.kid = Some(DEMO_JWT_KID.into());
    jsonwebtoken::encode(&header, &claims, &key).map_err(|e| format!("signing: {e}"))
}
