//! The compiled rules: upstreams, limits, routes and the one immutable [`Snapshot`] a request
//! reads from start to end. Plain data: no socket, pool or task.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::uri::Authority;
use http::{HeaderName, HeaderValue, Method};
use tollgate_http1::path::EncodedSlashes;
use tollgate_limit::batch::{FailurePolicy, LeaseBlock};
use tollgate_limit::bucket::BucketParams;

use crate::{
    ConcurrencyBounds, Identity, KeyRequirement, Keys, LimitClass, Mode, Scope, UpstreamTls, identity, jwt,
    routes,
};

#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub scheme: http::uri::Scheme,
    pub authority: Authority,
    /// How its connections speak TLS: `Some` exactly for an `https://` upstream.
    pub tls: Option<UpstreamTls>,
    /// Prepended to every request path; empty or `/prefix` without a trailing slash.
    pub path_prefix: String,
    pub timeout: Duration,
    pub max_in_flight: Option<u32>,
    pub queue_timeout: Duration,
    /// The bounds of its adaptive concurrency limit, when it has one.
    pub adaptive: Option<ConcurrencyBounds>,
    /// How long a kept connection to it may idle.
    pub idle_timeout: Duration,
    /// The `Host` header requests to it carry.
    pub host_header: HeaderValue,
    /// What its routes do with `%2F` and `%5C` unless they say otherwise.
    pub encoded_slashes: EncodedSlashes,
    /// Whether routes to it match paths ignoring ASCII case.
    pub case_insensitive: bool,
    /// Its instances, at least one; the first is `authority`'s, whose host requests carry.
    pub targets: Vec<Target>,
    pub balance: Balance,
    pub health: Option<Health>,
    pub eject: Eject,
    pub retries: Retries,
    /// How often its targets' host names are resolved again.
    pub dns_refresh: Duration,
}

/// Active health checks of an upstream's targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// The whole path asked, the upstream's prefix included.
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

/// One instance of an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub authority: Authority,
    /// Its share of requests against the other targets' weights, at least 1.
    pub weight: u32,
    /// At most this many requests in flight to it (to each of its name's addresses).
    pub max_in_flight: Option<u32>,
}

/// How a request's target is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    LeastRequest,
    RoundRobin,
    Hash,
}

/// When a failing target is left out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eject {
    pub consecutive_failures: u32,
    /// A first ejection's length; each one after doubles it, up to [`MAX_EJECTION`].
    pub first: Duration,
    pub max_percent: u32,
}

/// The longest an ejection lasts, however often the target was ejected.
pub const MAX_EJECTION: Duration = Duration::from_secs(600);

/// Retries of a request whose target failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    pub attempts: u32,
    pub budget_percent: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dimension {
    Key,
    Route,
    Ip,
    Header(HeaderName),
    /// A top-level field of a JSON request body.
    BodyField(String),
    /// The client fingerprint of the connection (`tollgate_hello`): one client library's TLS
    /// ClientHello, whatever address it comes from.
    Fingerprint,
    /// A claim of the caller's verified JWT, inside its tenant.
    Claim(String),
}

impl Dimension {
    pub fn describe(&self) -> String {
        match self {
            Dimension::Key => "key".into(),
            Dimension::Route => "route".into(),
            Dimension::Ip => "ip".into(),
            Dimension::Header(h) => format!("header {h}"),
            Dimension::BodyField(f) => format!("body field {f}"),
            Dimension::Fingerprint => "fingerprint".into(),
            Dimension::Claim(c) => format!("claim {c}"),
        }
    }
}

/// A limit on one key's requests in flight, with its `RateLimit-Policy` item.
#[derive(Debug, Clone)]
pub struct Concurrent {
    pub max: u32,
    pub policy: HeaderValue,
}

/// A limit's numbers with their precomputed `RateLimit-Policy` value.
#[derive(Debug, Clone)]
pub struct Numbers {
    pub params: BucketParams,
    pub policy: HeaderValue,
}

#[derive(Debug)]
pub struct Limit {
    pub name: Arc<str>,
    pub dimension: Dimension,
    /// The limit's own numbers; `None` for a key limit whose numbers every key sets.
    pub numbers: Option<Numbers>,
    pub mode: Mode,
    pub class: LimitClass,
    pub policy: FailurePolicy,
    pub lease: Option<LeaseBlock>,
    pub scope: Scope,
    /// For a limit on requests in flight (`"concurrent": N`) instead of a bucket.
    pub concurrent: Option<Concurrent>,
    /// The upstream's statuses that keep the charge; any other answer gives it back. `None`:
    /// every admitted request pays.
    pub charge_on: Option<Box<[u16]>>,
    /// For a security limit: the Region whose store checks it.
    pub home_region: Option<Arc<str>>,
    /// A key limit's numbers for JWT callers, by the value of one of their claims.
    pub plans: Option<jwt::Plans>,
    /// How much of a client's address its per-IP buckets key on.
    pub ip_prefixes: identity::IpPrefixes,
    /// For a limit whose cost the upstream reports in its answer.
    pub post_paid: Option<PostPaid>,
    /// For a limit that queues rather than refuses (`"delay"`): the longest a request waits
    /// for its tokens, in microseconds; 0 for every other limit.
    pub max_wait_us: u64,
    /// For a limit that blocks (`"block_for"`): how long a bucket that refused a request
    /// refuses every request after it, in microseconds; 0 for every other limit.
    pub block_us: u64,
}

/// A limit charged after the fact: the reserve at the check, the rest of what the upstream's
/// answer reports once its head arrives. Its buckets may owe down to `max_debt`.
#[derive(Debug, Clone)]
pub struct PostPaid {
    /// The response header that carries the cost, a decimal count.
    pub header: http::HeaderName,
    /// What the check takes up front; the route's cost in this limit.
    pub reserve: u64,
    /// How far below empty its buckets may go, in tokens; `None`: one burst of each bucket.
    pub max_debt: Option<u64>,
}

impl PostPaid {
    /// The signed units a bucket with `p` moves by when the answer reports `reported` tokens
    /// after the check took the reserve: taken when it reports more, given back when less. A
    /// report past what the bucket can hold and owe moves it no further, so no product
    /// overflows.
    pub fn units(&self, p: &BucketParams, reported: u64) -> i64 {
        let reserve = p.units(self.reserve) as u128;
        let span = p.capacity as u128 + p.debt as u128 + reserve;
        let reported = (reported as u128 * p.scale as u128).min(span);
        (reserve as i128 - reported as i128) as i64
    }

    /// What the answer with these headers cost: `Ok(None)` when it does not say (the reserve
    /// is the whole cost), an error naming the header when it says something else than a
    /// count.
    pub fn reported(&self, headers: &http::HeaderMap) -> Result<Option<u64>, String> {
        let Some(v) = headers.get(&self.header) else {
            return Ok(None);
        };
        let text = v.to_str().unwrap_or("").trim();
        match text.parse::<u64>() {
            Ok(n) if text.bytes().all(|b| b.is_ascii_digit()) => Ok(Some(n)),
            _ => Err(format!(
                "{}: {:?} is not a count (decimal digits)",
                self.header,
                String::from_utf8_lossy(v.as_bytes())
            )),
        }
    }
}

impl Limit {
    /// Whether an answer with `status` keeps this limit's charge.
    pub fn keeps_charge(&self, status: u16) -> bool {
        self.charge_on
            .as_deref()
            .is_none_or(|s| s.binary_search(&status).is_ok())
    }

    pub fn shadow(&self) -> bool {
        self.mode == Mode::Shadow
    }

    /// The numbers a JWT caller's bucket of this limit uses: its plan's, else the limit's own.
    pub fn jwt_numbers(&self, caller: &jwt::JwtCaller) -> Option<&Numbers> {
        let planned = self
            .plans
            .as_ref()
            .and_then(|p| match caller.claims.get(&p.claim) {
                Some(serde_json::Value::String(v)) => p.numbers.get(v),
                _ => None,
            });
        planned.or(self.numbers.as_ref())
    }
}

#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    /// `None` matches any method.
    pub method: Option<Method>,
    pub prefix: String,
    /// Where its admitted requests go, or what it answers itself.
    pub serves: Serves,
    pub key: KeyRequirement,
    /// Whether callers are API keys or JWTs.
    pub identity: Identity,
    /// (limit index, cost), in limit order.
    pub costs: Vec<(u16, u64)>,
    pub max_body_bytes: u64,
    /// The JSON body field a limit of this route is keyed on, if any.
    pub body_field: Option<String>,
    /// Whether its paths may hold `%2F` and `%5C` (kept encoded).
    pub encoded_slashes: EncodedSlashes,
    /// Its upstream's `"paths": "case-insensitive"`.
    pub case_insensitive: bool,
    /// Whether it charges a post-paid limit, whose debit waits for the upstream's answer.
    pub post_paid: bool,
    /// Whether a POST may be served as this route's method by asking with a method override
    /// header (`tollgate_http1::method_override`).
    pub method_override: bool,
    /// The protocols a request may upgrade to here, lowercase; empty: none.
    pub upgrade: Box<[Box<str>]>,
    /// How long an upgraded connection may stay silent both ways.
    pub idle_timeout: std::time::Duration,
}

/// What a route does with a request once it is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// Forwards it to the upstream at this index of [`Snapshot::upstreams`].
    Upstream(usize),
    /// Answers with the caller's own budget (`"serve": "usage"`), forwarding nothing: its
    /// key's buckets read without charging them, the route's own cost charged as usual.
    Usage,
}

impl Route {
    /// Whether `path` (canonical) is under this route's prefix, on segment boundaries.
    pub fn matches_path(&self, path: &str) -> bool {
        let p = self.prefix.as_bytes();
        let Some(head) = path.as_bytes().get(..p.len()) else {
            return false;
        };
        let same = if self.case_insensitive {
            head.eq_ignore_ascii_case(p)
        } else {
            head == p
        };
        let rest = &path.as_bytes()[p.len()..];
        same && (rest.is_empty() || p.ends_with(b"/") || rest.starts_with(b"/"))
    }

    /// Whether a request of this method may take this route. TRACE echoes a request back,
    /// credentials and all, so only a route that names it takes it; `*` does not.
    pub fn matches_method(&self, method: &Method) -> bool {
        match &self.method {
            Some(m) => m == method,
            None => method != Method::TRACE,
        }
    }
}

/// The compiled rules: immutable, swapped whole.
#[derive(Debug)]
pub struct Snapshot {
    pub version: u64,
    /// This snapshot among those the process compiled, in order: above the last one's even
    /// when only the admin API's keys changed and the file's `version` did not.
    pub serial: u64,
    /// SHA-256 of the file's bytes, hex.
    pub digest: String,
    pub source: String,
    pub loaded_at: SystemTime,
    pub upstreams: Vec<Upstream>,
    pub limits: Vec<Limit>,
    pub keys: Keys,
    /// Sorted longest prefix first. `matcher` indexes it as compiled: it never changes after.
    pub routes: Vec<Route>,
    pub(crate) matcher: routes::Matcher,
    /// (limit index, cost) charged to every request without a valid key.
    pub unauthenticated: Option<(u16, u64)>,
    /// The JWKS and claims for routes with `"identity": "jwt"`.
    pub jwt: Option<jwt::JwtConfig>,
    /// Whether any route honours method overrides: without one, a request's override headers
    /// are only dropped, never read.
    pub method_override: bool,
}

impl Snapshot {
    /// The route for a method and a canonical path: the longest matching prefix, a route
    /// naming the method before a catch-all of the same prefix, then the file's order. One
    /// lookup per `/` boundary of the path, however many routes there are.
    pub fn route(&self, method: &Method, path: &str) -> Option<usize> {
        self.matcher.find(&self.routes, method, path)
    }

    /// The same answer as [`Snapshot::route`] by scanning every route in order: the
    /// reference the matcher is tested against, and the baseline of `benches/routes.rs`.
    pub fn route_by_scan(&self, method: &Method, path: &str) -> Option<usize> {
        self.routes
            .iter()
            .position(|r| r.matches_method(method) && r.matches_path(path))
    }

    /// The key whose secret hashes to `digest`.
    pub fn key_by_hash(&self, digest: &[u8; 32]) -> Option<usize> {
        self.keys.by_hash(digest)
    }

    /// The keys made through the admin API that this snapshot holds, as the compiler takes
    /// them.
    pub fn managed_keys(&self) -> Vec<crate::ManagedKey> {
        self.keys.managed_keys(|l| &self.limits[l].name)
    }

    /// The key with this public id.
    pub fn key_by_id(&self, id: &str) -> Option<usize> {
        self.keys.by_id(id)
    }

    /// Verifies a bearer token for a JWT route: the token itself, then that every limit the
    /// route charges has numbers for the caller's plan.
    pub fn verify_jwt(&self, route: &Route, token: &[u8]) -> Result<jwt::JwtCaller, jwt::TokenError> {
        let Some(cfg) = &self.jwt else {
            // compile refuses a JWT route without `jwt`; this is only a guard.
            return Err(jwt::TokenError::AlgMismatch);
        };
        let caller = cfg.verify(token)?;
        for &(li, _) in &route.costs {
            let l = &self.limits[li as usize];
            if l.dimension == Dimension::Key && l.jwt_numbers(&caller).is_none() {
                return Err(jwt::TokenError::UnknownPlan);
            }
        }
        Ok(caller)
    }

    /// The name of the limit whose bucket decided a check of `batch`.
    pub fn deciding_limit(
        &self,
        batch: &[tollgate_limit::batch::CheckItem],
        d: &tollgate_limit::decision::Decision,
    ) -> Option<&str> {
        d.deciding.map(|i| &*self.limits[batch[i].limit as usize].name)
    }
}
