//! Every answer the gateway makes itself, built in one place: each refusal or failure maps to
//! its status, headers and small JSON body here.

use crate::proxy::body::LimitedBody;
use crate::proxy::client::UpstreamBody;
use bytes::{Bytes, BytesMut};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};
use smallvec::SmallVec;

use tollgate_limit::decision::Decision;
use tollgate_meter::flags::Flag;
use tollgate_rules::Snapshot;
use tollgate_rules::plan::Caller;
use tollgate_rules::quota::{Period, Quota};
use tollgate_store::CheckItem;

/// Bodies the gateway sends: an upstream's streamed through, or one of its own.
pub(crate) type Body = Either<UpstreamBody, Full<Bytes>>;

/// Bodies the gateway sends upstream: the client's streamed through under the route's size
/// limit, or one it had to read first (to find a limit's body field).
pub(crate) type UpBody = Either<LimitedBody, Full<Bytes>>;

pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// A request the gateway answers itself instead of forwarding.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("no route")]
    NotFound,
    #[error("{0}")]
    BadRequest(String),
    /// No usable API key; `reason` says which way: `missing_key`, `unknown_key`,
    /// `key_expired` (the key, or the secret presented, is past its end) or `key_revoked`.
    #[error("{message}")]
    Unauthorized {
        reason: &'static str,
        message: &'static str,
    },
    /// A JWT route's bearer token is missing or does not verify; the body says which.
    #[error("{0}")]
    BadToken(tollgate_rules::jwt::TokenError),
    #[error("{0}")]
    MethodNotAllowed(&'static str),
    /// An upgrade (`Upgrade` with `Connection: upgrade`) to a protocol the route does not list.
    #[error("{0}")]
    UpgradeNotAllowed(String),
    #[error("body over {limit} bytes")]
    PayloadTooLarge { limit: u64 },
    /// Refused by a limit's bucket: for want of tokens, or `blocked` for a while after one of
    /// its limit's refusals (`"block_for"`).
    #[error("rate limited by {limit}")]
    RateLimited {
        limit: String,
        retry_after: Option<u64>,
        blocked: bool,
    },
    #[error("{quota} quota exceeded")]
    QuotaExceeded {
        quota: &'static str,
        resets_at: String,
        retry_after: u64,
    },
    #[error("{limit}: too many requests in flight")]
    TooManyInFlight { limit: String, max: u32, in_flight: u32 },
    #[error("limiter unavailable")]
    LimiterUnavailable,
    #[error("upstream overloaded")]
    UpstreamOverloaded { retry_after: u64 },
    #[error("bad gateway: {0}")]
    BadGateway(String),
    #[error("{0}")]
    GatewayTimeout(String),
    #[error("the request body stalled")]
    RequestTimeout,
    /// Not a refusal: a usage route's answer, the caller's own budget (`200`).
    #[error("usage of key {}", .0.key)]
    Usage(Box<Usage>),
}

/// A usage route's answer: the caller's key, each of its own buckets as `RateLimit` would
/// report it now, and its quota. Serialized in this order, not as a map's.
#[derive(Debug, serde::Serialize)]
pub struct Usage {
    pub key: String,
    pub tenant: String,
    pub limits: Vec<UsageLimit>,
    pub quota: Option<UsageQuota>,
}

/// One bucket of a key, read without charging it (or as the usage request's own cost left it).
#[derive(Debug, serde::Serialize)]
pub struct UsageLimit {
    pub name: String,
    /// The key's rate, `600/60s`.
    pub rate: String,
    pub burst: u64,
    /// `r` of its `RateLimit` member: whole tokens left.
    pub remaining: u64,
    /// `t` of its `RateLimit` member: seconds until the bucket is full.
    pub reset_s: u64,
}

/// A key's quota as the gateway's last flags from metering say.
#[derive(Debug, serde::Serialize)]
pub struct UsageQuota {
    pub per: &'static str,
    pub limit: u64,
    pub used: u64,
    pub remaining: u64,
    /// The period's end, RFC 3339 in the quota's zone.
    pub resets_at: String,
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::NotFound => StatusCode::NOT_FOUND,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            Refusal::Unauthorized { .. } | Refusal::BadToken(_) => StatusCode::UNAUTHORIZED,
            Refusal::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::UpgradeNotAllowed(_) => StatusCode::FORBIDDEN,
            Refusal::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::RateLimited { .. } | Refusal::QuotaExceeded { .. } | Refusal::TooManyInFlight { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Refusal::LimiterUnavailable | Refusal::UpstreamOverloaded { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refusal::BadGateway(_) => StatusCode::BAD_GATEWAY,
            Refusal::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Refusal::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Refusal::Usage(_) => StatusCode::OK,
        }
    }

    fn body(&self) -> serde_json::Value {
        use serde_json::json;
        match self {
            Refusal::NotFound => {
                json!({"error": "not_found", "message": "no route for this method and path"})
            }
            Refusal::BadRequest(m) => json!({"error": "bad_request", "message": m}),
            Refusal::Unauthorized { reason, message } => {
                json!({"error": "unauthorized", "reason": reason, "message": message})
            }
            Refusal::BadToken(e) => {
                json!({"error": "unauthorized", "reason": e.reason(), "message": e.to_string()})
            }
            Refusal::MethodNotAllowed(m) => json!({"error": "method_not_allowed", "message": m}),
            Refusal::UpgradeNotAllowed(m) => json!({"error": "upgrade_not_allowed", "message": m}),
            Refusal::PayloadTooLarge { limit } => {
                json!({"error": "payload_too_large", "max_body_bytes": limit})
            }
            Refusal::RateLimited {
                limit,
                retry_after,
                blocked,
            } => {
                let error = if *blocked { "blocked" } else { "rate_limited" };
                json!({"error": error, "limit": limit, "retry_after_seconds": retry_after})
            }
            Refusal::QuotaExceeded { quota, resets_at, .. } => {
                json!({"error": "quota_exceeded", "quota": quota, "resets_at": resets_at})
            }
            Refusal::TooManyInFlight {
                limit,
                max,
                in_flight,
            } => json!({
                "error": "too_many_in_flight",
                "limit": limit,
                "max_in_flight": max,
                "in_flight": in_flight,
            }),
            Refusal::LimiterUnavailable => json!({"error": "limiter_unavailable"}),
            Refusal::UpstreamOverloaded { .. } => json!({"error": "upstream_overloaded"}),
            Refusal::BadGateway(m) => json!({"error": "bad_gateway", "message": m}),
            Refusal::GatewayTimeout(m) => json!({"error": "gateway_timeout", "message": m}),
            Refusal::RequestTimeout => {
                json!({"error": "request_timeout", "message": "the request was not received in time"})
            }
            Refusal::Usage(u) => serde_json::to_value(u).unwrap_or_default(),
        }
    }

    /// The refusal's JSON body.
    pub(crate) fn body_text(&self) -> String {
        match self {
            // Its fields in the order a reader expects them, which a `Value`'s map would sort.
            Refusal::Usage(u) => serde_json::to_string(u).unwrap_or_default(),
            r => r.body().to_string(),
        }
    }

    /// The headers that go with this refusal besides `Content-Type` and the rate-limit fields
    /// of the request's buckets, the same on every wire.
    pub(crate) fn fields(&self) -> SmallVec<[(HeaderName, HeaderValue); 3]> {
        let no_store = || (CACHE_CONTROL, HeaderValue::from_static("no-store"));
        let mut f = SmallVec::new();
        match self {
            Refusal::RateLimited { retry_after, .. } => {
                if let Some(s) = retry_after {
                    f.push((RETRY_AFTER, HeaderValue::from(*s)));
                }
                f.push(no_store());
            }
            // A seat frees when some answer ends: no wait can be known, so one second.
            Refusal::LimiterUnavailable | Refusal::TooManyInFlight { .. } => {
                f.push((RETRY_AFTER, HeaderValue::from_static("1")));
                f.push(no_store());
            }
            Refusal::UpstreamOverloaded { retry_after } | Refusal::QuotaExceeded { retry_after, .. } => {
                f.push((RETRY_AFTER, HeaderValue::from(*retry_after)));
                f.push(no_store());
            }
            // A budget is true only at the moment it was read.
            Refusal::Usage(_) => f.push(no_store()),
            // RFC 6750: a client library knows to fetch a new token on `invalid_token`.
            Refusal::BadToken(e) => {
                let v = match e {
                    tollgate_rules::jwt::TokenError::Missing => "Bearer".to_string(),
                    e => format!(
                        "Bearer error=\"invalid_token\", error_description=\"{}\"",
                        e.reason()
                    ),
                };
                if let Ok(v) = HeaderValue::from_str(&v) {
                    f.push((http::header::WWW_AUTHENTICATE, v));
                }
            }
            _ => {}
        }
        f
    }

    /// The response, without the rate-limit fields of the request's buckets (see [`Answer`]).
    pub fn into_response(self) -> Response<Body> {
        let mut resp = json_response(self.status(), self.body_text());
        let h = resp.headers_mut();
        for (name, value) in self.fields() {
            h.insert(name, value);
        }
        resp
    }
}

/// One of the gateway's own answers as the request's steps return it: what was refused, with
/// the rate-limit fields of what the request paid. Each wire renders it once, its own way:
/// hyper's path as a `Response` ([`Answer::into_response`]), the express lane as bytes.
#[derive(Debug)]
pub struct Answer {
    pub refusal: Refusal,
    pub fields: RateFields,
    /// Whether the connection closes after it: the rest of the request's body will not be
    /// read, or its framing can't be trusted. HTTP/2 ignores it: only the stream ends.
    pub close: bool,
}

impl From<Refusal> for Answer {
    fn from(refusal: Refusal) -> Answer {
        Answer {
            refusal,
            fields: RateFields::default(),
            close: false,
        }
    }
}

impl Answer {
    pub fn status(&self) -> u16 {
        self.refusal.status().as_u16()
    }

    /// This answer, with the connection closed after it.
    pub(crate) fn closing(mut self) -> Answer {
        self.close = true;
        self
    }

    /// hyper's rendering: the refusal's response with the rate-limit fields (and, on HTTP/1,
    /// `Connection: close` when it closes).
    pub fn into_response(self) -> Response<Body> {
        let mut resp = self.refusal.into_response();
        self.fields.apply(resp.headers_mut());
        if self.close {
            resp.headers_mut()
                .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// The `RateLimit-Policy` and `RateLimit` fields of a request: its deciding bucket's budget and
/// its key's quota, each as a list member. When the gateway has either, the two fields are the
/// gateway's alone: an upstream's own are dropped, on both paths.
#[derive(Debug, Default, Clone)]
pub struct RateFields {
    pub budget: Option<Budget>,
    pub quota: Option<Box<QuotaHeaders>>,
}

impl RateFields {
    /// Whether the gateway writes the fields (and so drops an upstream's).
    pub(crate) fn any(&self) -> bool {
        self.budget.is_some() || self.quota.is_some()
    }

    /// The fields as HTTP/1 header lines.
    pub(crate) fn write_http1(&self, out: &mut BytesMut) {
        if self.budget.as_ref().is_some_and(|b| b.policy.is_some()) || self.quota.is_some() {
            out.extend_from_slice(b"ratelimit-policy: ");
            self.write_policy(out);
            out.extend_from_slice(b"\r\n");
        }
        if self.any() {
            out.extend_from_slice(b"ratelimit: ");
            self.write_state(out);
            out.extend_from_slice(b"\r\n");
        }
    }

    /// The fields in a header map, in place of any there.
    pub fn apply(self, headers: &mut HeaderMap) {
        if !self.any() {
            return;
        }
        let mut state = BytesMut::with_capacity(64);
        self.write_state(&mut state);
        if self.quota.is_some() {
            let mut v = BytesMut::new();
            self.write_policy(&mut v);
            insert_bytes(headers, &RATELIMIT_POLICY, v);
        } else {
            match self.budget.and_then(|b| b.policy) {
                // The usual answer: the limit's policy as compiled, moved, not copied.
                Some(p) => {
                    headers.insert(RATELIMIT_POLICY.clone(), p);
                }
                None => {
                    headers.remove(&RATELIMIT_POLICY);
                }
            }
        }
        insert_bytes(headers, &RATELIMIT, state);
    }

    fn write_policy(&self, out: &mut BytesMut) {
        let policy = self.budget.as_ref().and_then(|b| b.policy.as_ref());
        if let Some(p) = policy {
            out.extend_from_slice(p.as_bytes());
        }
        if let Some(q) = &self.quota {
            if policy.is_some() {
                out.extend_from_slice(b", ");
            }
            out.extend_from_slice(q.policy.as_bytes());
        }
    }

    fn write_state(&self, out: &mut BytesMut) {
        if let Some(b) = &self.budget {
            b.write_state(out);
        }
        if let Some(q) = &self.quota {
            if self.budget.is_some() {
                out.extend_from_slice(b", ");
            }
            out.extend_from_slice(q.state.as_bytes());
        }
    }
}

/// Bytes the gateway wrote itself, which are always a valid field value.
fn insert_bytes(headers: &mut HeaderMap, name: &HeaderName, v: BytesMut) {
    if let Ok(v) = HeaderValue::from_maybe_shared(v.freeze()) {
        headers.insert(name.clone(), v);
    }
}

/// A key's quota as `RateLimit-Policy` and `RateLimit` list members: `"day";q=100000;w=86400`
/// and `"day";r=<left>;t=<seconds to the reset>`, from the last flags read.
#[derive(Debug, Clone)]
pub struct QuotaHeaders {
    policy: String,
    state: String,
}

impl QuotaHeaders {
    /// `period` is the quota's period holding `now_ms`.
    pub fn new(quota: &Quota, period: &Period, flag: Option<&Flag>, now_ms: i64) -> QuotaHeaders {
        let used = quota_used(period, flag, now_ms);
        let name = quota.per.as_str();
        QuotaHeaders {
            policy: format!("\"{name}\";q={};w={}", quota.limit, period.seconds()),
            state: format!(
                "\"{name}\";r={};t={}",
                quota.limit.saturating_sub(used),
                period.secs_to_reset(now_ms)
            ),
        }
    }
}

/// What a key has used of its quota in `period` (the one holding `now_ms`), as its last flag
/// says: the quota's `RateLimit` member and a usage route's answer both count it so.
pub(crate) fn quota_used(period: &Period, flag: Option<&Flag>, now_ms: i64) -> u64 {
    // A flag of another period says nothing about this one.
    flag.filter(|f| f.in_force(now_ms) && f.period == period.label)
        .map_or(0, |f| f.used)
}

/// The `408` for a request head not finished in time, as HTTP/1.1 bytes: it is written where no
/// request exists yet to answer through either path. Its body is `Refusal::RequestTimeout`'s.
pub(crate) const REQUEST_TIMEOUT_HTTP1: &[u8] = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncache-control: no-store\r\nconnection: close\r\ncontent-length: 76\r\n\r\n{\"error\":\"request_timeout\",\"message\":\"the request was not received in time\"}";

/// A JSON response the gateway makes itself.
/// An error of the gateway's own APIs (admin, keys, blocks, the demo upstream): its status and
/// one JSON object, `{"error": CODE, …}` with the fields that say more (`message`, `detail`,
/// `field`, `reason`), as requests' refusals are answered through [`Refusal`].
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    body: serde_json::Map<String, serde_json::Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &str) -> ApiError {
        let mut body = serde_json::Map::new();
        body.insert("error".into(), error.into());
        ApiError { status, body }
    }

    /// The error with one more field.
    pub fn with(mut self, name: &str, value: impl Into<serde_json::Value>) -> ApiError {
        self.body.insert(name.into(), value.into());
        self
    }

    pub fn into_response(self) -> Response<Body> {
        json_response(self.status, serde_json::Value::Object(self.body).to_string())
    }
}

pub(crate) fn json_response(status: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// What `RateLimit-Policy` and `RateLimit` say about an answered request, kept as numbers so
/// either path can write them its own way.
#[derive(Debug, Clone)]
pub struct Budget {
    /// `RateLimit-Policy`, when the deciding limit has numbers.
    pub policy: Option<HeaderValue>,
    name: std::sync::Arc<str>,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    /// A token bucket: whole tokens left, and seconds until it is full.
    Bucket { remaining: u64, reset_secs: u64 },
    /// A limit on requests in flight with every seat taken: when one frees can't be known.
    SeatsTaken,
}

impl Budget {
    /// A limit on requests in flight whose seats are all taken.
    pub(crate) fn seats_taken(name: std::sync::Arc<str>, policy: HeaderValue) -> Budget {
        Budget {
            policy: Some(policy),
            name,
            state: State::SeatsTaken,
        }
    }

    /// The `RateLimit` value's bytes.
    pub fn write_state(&self, out: &mut bytes::BytesMut) {
        match self.state {
            State::Bucket {
                remaining,
                reset_secs,
            } => tollgate_rules::headers::write_state(out, &self.name, remaining, reset_secs),
            State::SeatsTaken => {
                out.extend_from_slice(b"\"");
                out.extend_from_slice(self.name.as_bytes());
                out.extend_from_slice(b"\";r=0");
            }
        }
    }
}

/// The values of `RateLimit-Policy` (when the limit has numbers) and `RateLimit` for the
/// deciding bucket of a decision; `None` when no bucket decided.
pub fn budget_values(
    snap: &Snapshot,
    batch: &[CheckItem],
    caller: Caller<'_>,
    d: &Decision,
) -> Option<Budget> {
    let i = d.deciding?;
    let li = batch[i].limit as usize;
    let limit = &snap.limits[li];
    let numbers = match caller {
        Caller::Key(k) => snap.keys.numbers(k, limit, li),
        Caller::Jwt(j) => limit.jwt_numbers(j),
        Caller::Anonymous => limit.numbers.as_ref(),
    };
    Some(Budget {
        policy: numbers.map(|n| n.policy.clone()),
        name: limit.name.clone(),
        state: State::Bucket {
            remaining: d.remaining,
            reset_secs: d.reset_secs,
        },
    })
}

/// The `RateLimit` of an admitted request after [`Store::adjust`](tollgate_store::Store::adjust)
/// settled some of its buckets (`balances`, `None` where it left one alone): the enforced bucket
/// with the fewest tokens left decides, and of those the one furthest from full, so a bucket
/// in debt shows its debt's repayment in the reset.
pub(crate) fn budget_after(
    snap: &Snapshot,
    batch: &[CheckItem],
    caller: Caller<'_>,
    outcome: &tollgate_limit::batch::Outcome,
    balances: &[Option<i64>],
) -> Option<Budget> {
    use tollgate_limit::bucket::{secs_to_full, secs_to_full_from};
    let (i, remaining, reset_secs) = batch
        .iter()
        .zip(&outcome.buckets)
        .enumerate()
        .filter(|(_, (item, _))| !item.charge.shadow)
        .map(|(i, (item, v))| {
            let p = &item.charge.params;
            match balances.get(i).copied().flatten() {
                Some(b) => (i, b.max(0) as u64 / p.scale, secs_to_full_from(p, b)),
                None => (i, v.remaining(p), secs_to_full(p, v.tokens)),
            }
        })
        .min_by_key(|&(_, remaining, reset)| (remaining, std::cmp::Reverse(reset)))?;
    let li = batch[i].limit as usize;
    let limit = &snap.limits[li];
    let numbers = match caller {
        Caller::Key(k) => snap.keys.numbers(k, limit, li),
        Caller::Jwt(j) => limit.jwt_numbers(j),
        Caller::Anonymous => limit.numbers.as_ref(),
    };
    Some(Budget {
        policy: numbers.map(|n| n.policy.clone()),
        name: limit.name.clone(),
        state: State::Bucket {
            remaining,
            reset_secs,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_raw_408_says_what_the_refusal_says() {
        let raw = std::str::from_utf8(REQUEST_TIMEOUT_HTTP1).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert_eq!(body, Refusal::RequestTimeout.body().to_string());
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert!(head.starts_with("HTTP/1.1 408 "));
    }
}
