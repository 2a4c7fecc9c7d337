//! Rules: the JSON file parsed (`raw`), validated and compiled into one immutable [`Snapshot`]
//! of plain data (no socket, pool or task), the buckets one request pays (`plan`), and who is
//! asking (`identity`: API keys and client IPs).
//!
//! A request loads the snapshot once and uses it to the end. Every error names the file, the
//! field and the reason; nothing is defaulted silently.

pub mod headers;
pub mod identity;
pub mod jwt;
pub mod keys;
pub mod plan;
pub mod quota;
pub mod raw;
mod routes;
pub mod summary;
pub mod tls;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderName, HeaderValue, Method, uri::Authority};
use sha2::{Digest, Sha256};

use headers::policy_value;
use keys::KeysBuilder;
pub use keys::{ApiKey, Keys};
pub use raw::{Identity, KeyRequirement, LimitClass, Mode, Scope};
use raw::{
    RawBlock, RawConcurrency, RawDimension, RawDimensionName, RawEncodedSlashes, RawKey, RawLimit,
    RawNumbers, RawPathMatch, RawQuota, RawRoute, RawRules, RawUpstream, RawUpstreamTls,
};
pub use tls::UpstreamTls;
pub use tollgate_hello::{BadFingerprint, Fingerprint};
use tollgate_http1::path::{self, EncodedSlashes};
pub use tollgate_limit::adaptive::Bounds as ConcurrencyBounds;
use tollgate_limit::batch::FailurePolicy;
pub use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::{BucketParams, Rate};

/// A rules file that can't be used, with where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {field}: {reason}")]
pub struct RulesError {
    pub file: String,
    pub field: String,
    pub reason: String,
}

/// The default time an upstream has to send its response headers.
pub(crate) const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long opening a connection to an upstream may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a kept upstream connection may idle: below the 5 s keep-alive timeout of Node.js
/// and Apache, so the gateway closes first. An upstream that closes sooner (gunicorn: 2 s)
/// wants its own `idle_timeout_ms`; the check before reuse catches most of its closes anyway.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// The default wait for a place under an upstream's `max_in_flight`.
pub(crate) const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_millis(50);
/// An adaptive limit's floor and ceiling when the rules leave them out (Envoy's defaults are
/// 3 and 1000; a probe at 4 measures a median of 8 requests in two rounds).
pub(crate) const DEFAULT_CONCURRENCY_MIN: u32 = 4;
pub(crate) const DEFAULT_CONCURRENCY_MAX: u32 = 2000;
/// The largest ceiling an adaptive limit may have: far above what one gateway keeps in flight
/// to one upstream, so a larger number is a typo.
pub(crate) const MAX_CONCURRENCY: u32 = 1_000_000;
/// A route's largest request body when its rules don't say: an upstream behind a gateway should
/// not have to guard its own memory against one client's body.
pub(crate) const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;

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
    pub upstream: usize,
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
    /// SHA-256 of the file's bytes, hex.
    pub digest: String,
    pub source: String,
    pub loaded_at: SystemTime,
    pub upstreams: Vec<Upstream>,
    pub limits: Vec<Limit>,
    pub keys: Keys,
    /// Sorted longest prefix first. `matcher` indexes it as compiled: it never changes after.
    pub routes: Vec<Route>,
    matcher: routes::Matcher,
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

/// How to compile. No store asks anything of the rules now: on Redis Cluster a request whose
/// buckets lie in several hash slots is checked slot by slot (`tollgate_store::slots`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CompileOptions {}

/// The demo rules, built in so `tollgate demo` works from any directory.
pub(crate) const DEMO_RULES: &[u8] = include_bytes!("../../rules/demo.json");
/// The demo's JWKS, built in beside the demo rules that name it.
pub(crate) const DEMO_JWKS: &[u8] = include_bytes!("../../rules/demo-jwks.json");

/// Where the rules come from.
#[derive(Debug, Clone)]
pub enum RulesSource {
    File(PathBuf),
    Embedded {
        label: &'static str,
        bytes: &'static [u8],
    },
}

impl RulesSource {
    pub fn demo() -> RulesSource {
        RulesSource::Embedded {
            label: "rules/demo.json (built in)",
            bytes: DEMO_RULES,
        }
    }
}

/// Compiles rules the same way at start-up and on every reload, including the demo's
/// upstream override.
#[derive(Debug, Clone)]
pub struct RulesLoader {
    pub source: RulesSource,
    pub opts: CompileOptions,
    /// In demo mode every upstream points at the built-in demo upstream.
    pub upstream_override: Option<http::uri::Authority>,
}

impl RulesLoader {
    pub fn load(&self) -> Result<Snapshot, RulesError> {
        let mut snap = match &self.source {
            RulesSource::File(path) => load(path, self.opts)?,
            RulesSource::Embedded { label, bytes } => {
                let builtin = |name: &str| match name {
                    "demo-jwks.json" => Ok(DEMO_JWKS.to_vec()),
                    other => Err(format!("{other:?} is not built in (only \"demo-jwks.json\" is)")),
                };
                compile_with(bytes, label, self.opts, &builtin)?
            }
        };
        if let Some(auth) = &self.upstream_override {
            let host = HeaderValue::from_str(auth.as_str()).map_err(|_| RulesError {
                file: "(demo upstream)".into(),
                field: "upstreams".into(),
                reason: format!("{auth} can't be a Host header"),
            })?;
            for u in &mut snap.upstreams {
                u.authority = auth.clone();
                u.host_header = host.clone();
                // The demo upstream speaks plain HTTP.
                u.scheme = http::uri::Scheme::HTTP;
                u.tls = None;
            }
        }
        Ok(snap)
    }
}

/// Reads and compiles a rules file.
pub fn load(path: &Path, opts: CompileOptions) -> Result<Snapshot, RulesError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| RulesError {
        file: file.clone(),
        field: "(file)".into(),
        reason: format!("cannot read: {e}"),
    })?;
    compile(&bytes, &file, opts)
}

/// Parses and compiles rules from bytes; `file` names them in errors, and files they name
/// (the JWKS) are read relative to its directory.
pub fn compile(bytes: &[u8], file: &str, opts: CompileOptions) -> Result<Snapshot, RulesError> {
    let dir = Path::new(file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let read = move |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    compile_with(bytes, file, opts, &read)
}

/// Reads a file the rules name, by the name as written.
type ReadNamed<'a> = &'a dyn Fn(&str) -> Result<Vec<u8>, String>;

fn compile_with(
    bytes: &[u8],
    file: &str,
    opts: CompileOptions,
    read: ReadNamed<'_>,
) -> Result<Snapshot, RulesError> {
    // Everything but the keys, which this pass skips: they are read one at a time later, each
    // compiled and dropped before the next, so a file's keys are never all held as parsed.
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw: RawRules = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        parse_error(file, path, e.into_inner())
    })?;
    de.end().map_err(|e| RulesError {
        file: file.to_string(),
        field: "(top level)".into(),
        reason: format!("trailing data after the rules object: {e}"),
    })?;
    let digest = hex::encode(Sha256::digest(bytes));
    // An option added later must be handled here.
    let CompileOptions {} = opts;
    Compiler { file, read, bytes }.run(raw, digest)
}

/// A parse error at `path` (serde_path_to_error's form, `.` for the top level).
fn parse_error(file: &str, path: String, inner: serde_json::Error) -> RulesError {
    let field = if path == "." {
        "(top level)".to_string()
    } else {
        path
    };
    let reason = match field.as_str() {
        "version" => format!("must be a positive integer ({inner})"),
        _ => inner.to_string(),
    };
    RulesError {
        file: file.to_string(),
        field,
        reason,
    }
}

struct Compiler<'a> {
    file: &'a str,
    read: ReadNamed<'a>,
    /// The whole file, for the pass that reads its keys.
    bytes: &'a [u8],
}

/// The compiled upstreams, and where each is by name for the routes that name it.
struct Upstreams {
    list: Vec<Upstream>,
    by_name: HashMap<String, usize>,
}

/// The compiled limits, and where each is by name for the keys, routes and
/// `unauthenticated` that name it.
struct Limits<'r> {
    list: Vec<Limit>,
    by_name: BTreeMap<&'r str, usize>,
}

impl Compiler<'_> {
    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> RulesError {
        RulesError {
            file: self.file.to_string(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    fn numbers(&self, field: &str, name: &str, rate: &str, burst: u64) -> Result<Numbers, RulesError> {
        let rate = Rate::parse(rate).map_err(|e| self.err(format!("{field}.rate"), e))?;
        let params = BucketParams::new(rate, burst).map_err(|e| self.err(field, e.to_string()))?;
        let policy = policy_value(name, &params).map_err(|e| self.err(field, e))?;
        Ok(Numbers { params, policy })
    }

    fn run(&self, raw: RawRules, digest: String) -> Result<Snapshot, RulesError> {
        if raw.version == 0 {
            return Err(self.err("version", "must be a positive integer (1 or more)"));
        }
        // Each step looks names up in what the steps before it compiled: keys name limits;
        // routes name upstreams and limits, and are checked against every key's numbers.
        let upstreams = self.upstreams(&raw)?;
        let mut limits = self.limits(&raw)?;
        let mut keys = self.keys(&raw, &limits)?;
        self.owing(&mut limits, &mut keys)?;
        let mut routes = self.routes(&raw, &upstreams, &limits, keys.keys())?;
        sort_routes(&mut routes);
        let matcher = routes::Matcher::new(&routes);
        let unauthenticated = self.unauthenticated(&raw, &limits)?;
        let jwt = self.jwt(&raw)?;
        if jwt.is_none()
            && let Some(i) = raw.routes.iter().position(|r| r.identity == Identity::Jwt)
        {
            return Err(self.err(
                format!("routes[{i}].identity"),
                "a JWT route needs the top-level \"jwt\" settings (its JWKS, issuer and audience)",
            ));
        }
        Ok(Snapshot {
            version: raw.version,
            digest,
            source: self.file.to_string(),
            loaded_at: SystemTime::now(),
            upstreams: upstreams.list,
            limits: limits.list,
            keys: keys.finish(),
            method_override: routes.iter().any(|r| r.method_override),
            routes,
            matcher,
            unauthenticated,
            jwt,
        })
    }

    fn jwt(&self, raw: &RawRules) -> Result<Option<jwt::JwtConfig>, RulesError> {
        let Some(j) = &raw.jwt else {
            return Ok(None);
        };
        let claim = |field: &str, c: &Option<String>, default: Option<&str>| match c {
            Some(c) if c.is_empty() => Err(self.err(format!("jwt.{field}"), "must not be empty")),
            Some(c) => Ok(Some(c.clone())),
            None => Ok(default.map(str::to_string)),
        };
        for (field, v) in [
            ("jwks", &j.jwks),
            ("issuer", &j.issuer),
            ("audience", &j.audience),
        ] {
            if v.is_empty() {
                return Err(self.err(format!("jwt.{field}"), "must not be empty"));
            }
        }
        let leeway_s = j.leeway_s.unwrap_or(jwt::DEFAULT_LEEWAY_S);
        if leeway_s > jwt::MAX_LEEWAY_S {
            return Err(self.err(
                "jwt.leeway_s",
                format!(
                    "{leeway_s} s would keep expired tokens alive; at most {}",
                    jwt::MAX_LEEWAY_S
                ),
            ));
        }
        let bytes = (self.read)(&j.jwks).map_err(|e| self.err("jwt.jwks", e))?;
        let checks = jwt::Checks {
            issuer: &j.issuer,
            audience: &j.audience,
            leeway_s,
        };
        let keys = jwt::keys(&bytes, &checks)
            .map_err(|(f, r)| self.err("jwt.jwks", format!("{}: {f}: {r}", j.jwks)))?;
        Ok(Some(jwt::JwtConfig {
            jwks_path: j.jwks.clone(),
            keys,
            issuer: j.issuer.clone(),
            audience: j.audience.clone(),
            leeway_s,
            key_claim: claim("key_claim", &j.key_claim, Some("sub"))?.unwrap_or_default(),
            tenant_claim: claim("tenant_claim", &j.tenant_claim, None)?,
        }))
    }

    fn upstreams(&self, raw: &RawRules) -> Result<Upstreams, RulesError> {
        let mut upstreams = Upstreams {
            list: Vec::new(),
            by_name: HashMap::new(),
        };
        for (name, u) in &raw.upstreams {
            let upstream = self.upstream(name, u)?;
            upstreams.by_name.insert(name.clone(), upstreams.list.len());
            upstreams.list.push(upstream);
        }
        Ok(upstreams)
    }

    fn upstream(&self, name: &str, u: &RawUpstream) -> Result<Upstream, RulesError> {
        let field = format!("upstreams.{name}");
        let uri: http::Uri = u
            .url
            .parse()
            .map_err(|e| self.err(format!("{field}.url"), format!("{:?} is not a URL: {e}", u.url)))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| {
            self.err(
                format!("{field}.url"),
                format!("{:?} needs a scheme, http:// or https://", u.url),
            )
        })?;
        let https = scheme == http::uri::Scheme::HTTPS;
        if !https && scheme != http::uri::Scheme::HTTP {
            return Err(self.err(
                format!("{field}.url"),
                format!("{:?}: only http:// and https:// upstreams are supported", u.url),
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| self.err(format!("{field}.url"), format!("{:?} needs a host", u.url)))?;
        let tls = match (https, &u.tls) {
            (true, t) => Some(self.upstream_tls(&field, &authority, t.as_ref())?),
            (false, None) => None,
            (false, Some(_)) => {
                return Err(self.err(
                    format!("{field}.tls"),
                    format!(
                        "{:?} is http://: only an https:// upstream takes TLS settings",
                        u.url
                    ),
                ));
            }
        };
        if uri.query().is_some() {
            return Err(self.err(format!("{field}.url"), "a base URL can't have a query"));
        }
        let path_prefix = uri.path().trim_end_matches('/').to_string();
        let timeout = match u.timeout_ms {
            Some(0) => return Err(self.err(format!("{field}.timeout_ms"), "must be above zero")),
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_UPSTREAM_TIMEOUT,
        };
        if u.max_in_flight == Some(0) {
            return Err(self.err(format!("{field}.max_in_flight"), "must be above zero"));
        }
        let queue_timeout = u
            .queue_timeout_ms
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_QUEUE_TIMEOUT);
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|_| self.err(format!("{field}.url"), "the host can't be a Host header"))?;
        let idle_timeout = match u.idle_timeout_ms {
            Some(0) => return Err(self.err(format!("{field}.idle_timeout_ms"), "must be above zero")),
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_IDLE_TIMEOUT,
        };
        let adaptive = match &u.concurrency {
            Some(c) => self.concurrency(&field, c, u.max_in_flight)?,
            None => None,
        };
        Ok(Upstream {
            idle_timeout,
            adaptive,
            name: name.into(),
            scheme,
            authority,
            tls,
            path_prefix,
            timeout,
            max_in_flight: u.max_in_flight,
            queue_timeout,
            host_header,
            encoded_slashes: slashes(u.encoded_slashes).unwrap_or_default(),
            case_insensitive: u.paths == RawPathMatch::CaseInsensitive,
        })
    }

    /// An `https://` upstream's TLS settings: its CA file read relative to the rules file, and
    /// the name its certificate must carry.
    fn upstream_tls(
        &self,
        field: &str,
        authority: &Authority,
        raw: Option<&RawUpstreamTls>,
    ) -> Result<UpstreamTls, RulesError> {
        let raw_ca = raw.and_then(|t| t.ca.as_deref());
        let ca = match raw_ca {
            Some("") => return Err(self.err(format!("{field}.tls.ca"), "must not be empty")),
            Some(name) => Some((
                name,
                (self.read)(name).map_err(|e| self.err(format!("{field}.tls.ca"), e))?,
            )),
            None => None,
        };
        let (name_field, name) = match raw.and_then(|t| t.server_name.as_deref()) {
            Some(n) => (format!("{field}.tls.server_name"), n),
            None => (
                format!("{field}.url"),
                authority.host().trim_start_matches('[').trim_end_matches(']'),
            ),
        };
        let named = raw.is_some_and(|t| t.server_name.is_some());
        UpstreamTls::new(name, ca.as_ref().map(|(n, pem)| (*n, pem.as_slice()))).map_err(|e| match e {
            tls::TlsSettingError::ServerName(_) if !named => self.err(
                name_field,
                format!("{e}; set tls.server_name to the name its certificate carries"),
            ),
            tls::TlsSettingError::ServerName(_) => self.err(name_field, e.to_string()),
            tls::TlsSettingError::Ca { .. } => self.err(format!("{field}.tls.ca"), e.to_string()),
            tls::TlsSettingError::Setup(_) => self.err(format!("{field}.tls"), e.to_string()),
        })
    }

    /// An upstream's `concurrency` block: its bounds when adaptive, none when switched off.
    fn concurrency(
        &self,
        field: &str,
        c: &RawConcurrency,
        max_in_flight: Option<u32>,
    ) -> Result<Option<ConcurrencyBounds>, RulesError> {
        let field = format!("{field}.concurrency");
        let min = c.min.unwrap_or(DEFAULT_CONCURRENCY_MIN);
        let max = c.max.unwrap_or(DEFAULT_CONCURRENCY_MAX);
        if min == 0 {
            return Err(self.err(format!("{field}.min"), "must be above zero"));
        }
        if max > MAX_CONCURRENCY {
            return Err(self.err(
                format!("{field}.max"),
                format!("{max} is above {MAX_CONCURRENCY}, the most an adaptive limit may reach"),
            ));
        }
        if max < min {
            return Err(self.err(format!("{field}.max"), format!("{max} is below min {min}")));
        }
        if let Some(cap) = max_in_flight
            && min > cap
        {
            return Err(self.err(
                format!("{field}.min"),
                format!("{min} is above max_in_flight {cap}, the ceiling every limit stays under"),
            ));
        }
        if !c.adaptive {
            return Ok(None);
        }
        ConcurrencyBounds::new(min, max)
            .map(Some)
            .map_err(|e| self.err(field, e))
    }

    fn limits<'r>(&self, raw: &'r RawRules) -> Result<Limits<'r>, RulesError> {
        let mut limits = Limits {
            list: Vec::new(),
            by_name: BTreeMap::new(),
        };
        for (name, l) in &raw.limits {
            let limit = self.limit(name, l)?;
            limits.by_name.insert(name.as_str(), limits.list.len());
            limits.list.push(limit);
        }
        // Routes and the unauthenticated charge name a limit by a u16 index.
        if limits.list.len() > u16::MAX as usize {
            return Err(self.err("limits", "too many limits"));
        }
        Ok(limits)
    }

    fn limit(&self, name: &str, l: &RawLimit) -> Result<Limit, RulesError> {
        let field = format!("limits.{name}");
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(self.err(&field, "a limit name uses only letters, digits, '-', '_' and '.'"));
        }
        let dimension = self.dimension(&field, &l.dimension)?;
        let ip_prefixes = self.ip_prefixes(&field, l, &dimension)?;
        if let Some(max) = l.concurrent {
            return self.concurrent_limit(&field, name, l, dimension, max);
        }
        let numbers = match (&l.rate, l.burst) {
            (Some(rate), Some(burst)) => Some(self.numbers(&field, name, rate, burst)?),
            (None, None) if dimension == Dimension::Key => None,
            (None, None) => {
                return Err(self.err(
                    &field,
                    "needs \"rate\" and \"burst\" (only key limits may leave them to each key)",
                ));
            }
            (Some(_), None) => {
                return Err(self.err(format!("{field}.burst"), "missing: a rate needs a burst"));
            }
            (None, Some(_)) => {
                return Err(self.err(format!("{field}.rate"), "missing: a burst needs a rate"));
            }
        };
        let policy = l.on_store_failure.unwrap_or(FailurePolicy::Local);
        if l.class == LimitClass::Security && policy == FailurePolicy::Open {
            return Err(self.err(
                format!("{field}.on_store_failure"),
                "a security limit may not fail open; use \"local\" or \"closed\"",
            ));
        }
        let lease = self.lease(&field, l, &dimension)?;
        if let (Some(block), Some(n)) = (lease, &numbers) {
            self.check_leasable(&field, &n.params, block)?;
        }
        if l.scope == Scope::Global {
            if dimension != Dimension::Key {
                return Err(self.err(
                    format!("{field}.scope"),
                    "only key limits can be global: each key's number is what the Regions share",
                ));
            }
            if l.class == LimitClass::Security {
                return Err(self.err(
                    format!("{field}.scope"),
                    "a security limit is not shared out; give it a \"home_region\" instead",
                ));
            }
            if lease.is_some() {
                return Err(self.err(
                    format!("{field}.lease"),
                    "a global limit's share moves every rebalance; it is not leased",
                ));
            }
        }
        let charge_on = match &l.charge_on {
            None => None,
            Some(_) if lease.is_some() => {
                return Err(self.err(
                    format!("{field}.charge_on"),
                    "a limit charged on the answer gives charges back, so it is not leased",
                ));
            }
            Some(c) if c.status.is_empty() => {
                return Err(self.err(format!("{field}.charge_on.status"), "name at least one status"));
            }
            Some(c) => {
                if let Some(bad) = c.status.iter().find(|s| !(100..=599).contains(*s)) {
                    return Err(self.err(
                        format!("{field}.charge_on.status"),
                        format!("{bad} is not an HTTP status (100 to 599)"),
                    ));
                }
                let mut s = c.status.clone();
                s.sort_unstable();
                s.dedup();
                Some(s.into_boxed_slice())
            }
        };
        let home_region = match &l.home_region {
            None => None,
            Some(_) if l.class != LimitClass::Security => {
                return Err(self.err(
                    format!("{field}.home_region"),
                    "only a security limit (\"class\": \"security\") has a home Region",
                ));
            }
            Some(r)
                if r.is_empty()
                    || !r
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') =>
            {
                return Err(self.err(
                    format!("{field}.home_region"),
                    format!("{r:?} is not a Region name (letters, digits, - and _)"),
                ));
            }
            Some(r) => Some(Arc::from(r.as_str())),
        };
        let plans = self.plans(&field, name, l, &dimension)?;
        let post_paid = self.post_paid(&field, l, lease.is_some())?;
        Ok(Limit {
            post_paid,
            plans,
            name: name.into(),
            dimension,
            numbers,
            mode: l.mode,
            class: l.class,
            policy,
            lease,
            scope: l.scope,
            concurrent: None,
            charge_on,
            home_region,
            ip_prefixes,
        })
    }

    /// `cost_from_response`, `reserve` and `max_debt`: a limit whose cost the upstream's answer
    /// reports. Its charges are settled after the answer, so nothing that gives charges back
    /// or takes them ahead (leases, `charge_on`) or moves its numbers (a global share) goes
    /// with it.
    fn post_paid(&self, field: &str, l: &RawLimit, leased: bool) -> Result<Option<PostPaid>, RulesError> {
        let Some(c) = &l.cost_from_response else {
            for (name, set) in [
                ("reserve", l.reserve.is_some()),
                ("max_debt", l.max_debt.is_some()),
            ] {
                if set {
                    return Err(self.err(
                        format!("{field}.{name}"),
                        "only a post-paid limit (with \"cost_from_response\") takes a reserve or a debt",
                    ));
                }
            }
            return Ok(None);
        };
        let header = http::HeaderName::from_bytes(c.header.as_bytes()).map_err(|_| {
            self.err(
                format!("{field}.cost_from_response.header"),
                format!("{:?} is not a header name", c.header),
            )
        })?;
        for (name, clash) in [
            ("lease", leased),
            ("charge_on", l.charge_on.is_some()),
            ("scope", l.scope == Scope::Global),
        ] {
            if clash {
                return Err(self.err(
                    format!("{field}.{name}"),
                    "a post-paid limit (\"cost_from_response\") settles each charge after the answer; it takes no lease, charge_on or global scope",
                ));
            }
        }
        let reserve = l.reserve.unwrap_or(1);
        if reserve == 0 {
            return Err(self.err(
                format!("{field}.reserve"),
                "must be at least 1: a request is admitted only while its bucket holds its reserve",
            ));
        }
        Ok(Some(PostPaid {
            header,
            reserve,
            max_debt: l.max_debt,
        }))
    }

    /// Lets every bucket of each post-paid limit owe down to its debt: the limit's numbers, its
    /// plans' and each key's.
    fn owing(&self, limits: &mut Limits, keys: &mut KeysBuilder) -> Result<(), RulesError> {
        let owe = |field: String, n: &mut Numbers, max_debt: Option<u64>| {
            let debt = max_debt.unwrap_or(n.params.burst);
            n.params = n
                .params
                .with_debt(debt)
                .map_err(|e| self.err(format!("{field}.max_debt"), e.to_string()))?;
            Ok::<(), RulesError>(())
        };
        for (li, l) in limits.list.iter_mut().enumerate() {
            let Some(pp) = l.post_paid.clone() else { continue };
            let field = format!("limits.{}", l.name);
            if let Some(n) = &mut l.numbers {
                owe(field.clone(), n, pp.max_debt)?;
            }
            if let Some(p) = &mut l.plans {
                for (plan, n) in p.numbers.iter_mut() {
                    owe(format!("{field}.plans.{plan}"), n, pp.max_debt)?;
                }
            }
            // Keys that write the same numbers share them: each is owed once, and an error
            // names the first key that wrote them.
            for (_, ki, n) in keys.numbers_mut().filter(|(l, _, _)| *l as usize == li) {
                owe(format!("keys[{ki}].limits.{}", l.name), n, pp.max_debt)?;
            }
        }
        Ok(())
    }

    /// `ipv4_prefix` and `ipv6_prefix`, on limits with per-IP buckets only.
    fn ip_prefixes(
        &self,
        field: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<identity::IpPrefixes, RulesError> {
        let mut prefixes = identity::IpPrefixes::default();
        for (name, given, max, into) in [
            ("ipv4_prefix", l.ipv4_prefix, 32, &mut prefixes.v4),
            ("ipv6_prefix", l.ipv6_prefix, 128, &mut prefixes.v6),
        ] {
            let Some(bits) = given else { continue };
            if !matches!(dimension, Dimension::Ip | Dimension::Route) {
                return Err(self.err(
                    format!("{field}.{name}"),
                    "only a limit with per-IP buckets takes a prefix: dimension \"ip\", or \"route\" (per IP without a key)",
                ));
            }
            *into = u8::try_from(bits).ok().filter(|b| *b <= max).ok_or_else(|| {
                self.err(
                    format!("{field}.{name}"),
                    format!("{bits} is not a prefix length: use 0 to {max} (the leading bits of a client's address that name one client)"),
                )
            })?;
        }
        Ok(prefixes)
    }

    /// A limit on requests in flight per key: one seat per request, taken before it is
    /// forwarded and given back when its answer ends.
    fn concurrent_limit(
        &self,
        field: &str,
        name: &str,
        l: &RawLimit,
        dimension: Dimension,
        max: u32,
    ) -> Result<Limit, RulesError> {
        if max == 0 {
            return Err(self.err(format!("{field}.concurrent"), "must be at least 1"));
        }
        if dimension != Dimension::Key {
            return Err(self.err(
                format!("{field}.concurrent"),
                "only key limits count requests in flight",
            ));
        }
        let other = [
            ("rate", l.rate.is_some()),
            ("burst", l.burst.is_some()),
            ("lease", l.lease.is_some()),
            ("charge_on", l.charge_on.is_some()),
            ("cost_from_response", l.cost_from_response.is_some()),
            ("reserve", l.reserve.is_some()),
            ("max_debt", l.max_debt.is_some()),
            ("quota", l.quota.is_some()),
            ("home_region", l.home_region.is_some()),
            ("scope", l.scope != Scope::Region),
            ("mode", l.mode != Mode::Enforce),
            ("class", l.class != LimitClass::Capacity),
        ];
        if let Some((f, _)) = other.iter().find(|(_, set)| *set) {
            return Err(self.err(
                format!("{field}.{f}"),
                "a limit on requests in flight (\"concurrent\") takes no other numbers or modes",
            ));
        }
        let policy = headers::concurrency_policy_value(name, max).map_err(|e| self.err(field, e))?;
        Ok(Limit {
            name: name.into(),
            dimension,
            numbers: None,
            mode: Mode::Enforce,
            class: LimitClass::Capacity,
            policy: l.on_store_failure.unwrap_or(FailurePolicy::Local),
            lease: None,
            scope: Scope::Region,
            concurrent: Some(Concurrent { max, policy }),
            charge_on: None,
            home_region: None,
            plans: None,
            ip_prefixes: identity::IpPrefixes::default(),
            post_paid: None,
        })
    }

    /// A key limit's numbers per plan, for JWT callers.
    fn plans(
        &self,
        field: &str,
        name: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<Option<jwt::Plans>, RulesError> {
        let Some(raw) = &l.plans else {
            if l.plan_claim.is_some() {
                return Err(self.err(
                    format!("{field}.plan_claim"),
                    "names the claim of \"plans\", which is missing",
                ));
            }
            return Ok(None);
        };
        if *dimension != Dimension::Key {
            return Err(self.err(
                format!("{field}.plans"),
                "only key limits have plans: a plan is a tenant's numbers",
            ));
        }
        if raw.is_empty() {
            return Err(self.err(format!("{field}.plans"), "name at least one plan"));
        }
        let claim = match &l.plan_claim {
            Some(c) if c.is_empty() => {
                return Err(self.err(format!("{field}.plan_claim"), "must not be empty"));
            }
            Some(c) => c.clone(),
            None => "plan".to_string(),
        };
        let mut numbers = BTreeMap::new();
        for (plan, RawNumbers { rate, burst }) in raw {
            let n = self.numbers(&format!("{field}.plans.{plan}"), name, rate, *burst)?;
            numbers.insert(plan.clone(), n);
        }
        Ok(Some(jwt::Plans { claim, numbers }))
    }

    fn dimension(&self, field: &str, raw: &RawDimension) -> Result<Dimension, RulesError> {
        Ok(match raw {
            RawDimension::Named(RawDimensionName::Key) => Dimension::Key,
            RawDimension::Named(RawDimensionName::Route) => Dimension::Route,
            RawDimension::Named(RawDimensionName::Ip) => Dimension::Ip,
            RawDimension::Named(RawDimensionName::Fingerprint) => Dimension::Fingerprint,
            RawDimension::Claim(c) => {
                if c.is_empty() {
                    return Err(self.err(format!("{field}.dimension.claim"), "must not be empty"));
                }
                Dimension::Claim(c.clone())
            }
            RawDimension::BodyField(f) => {
                if f.is_empty() {
                    return Err(self.err(format!("{field}.dimension.body_field"), "must not be empty"));
                }
                Dimension::BodyField(f.clone())
            }
            RawDimension::Header(h) => {
                Dimension::Header(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    self.err(
                        format!("{field}.dimension.header"),
                        format!("{h:?} is not a header name"),
                    )
                })?)
            }
        })
    }

    fn lease(
        &self,
        field: &str,
        l: &RawLimit,
        dimension: &Dimension,
    ) -> Result<Option<LeaseBlock>, RulesError> {
        let Some(lease) = &l.lease else {
            return Ok(None);
        };
        if l.class == LimitClass::Security {
            return Err(self.err(format!("{field}.lease"), "a security limit is never leased"));
        }
        if *dimension != Dimension::Key {
            return Err(self.err(format!("{field}.lease"), "only key limits can be leased"));
        }
        match &lease.block {
            RawBlock::Fixed(0) => {
                Err(self.err(format!("{field}.lease.block"), "must be \"auto\" or at least 1"))
            }
            RawBlock::Fixed(n) => Ok(Some(LeaseBlock::Fixed(*n))),
            RawBlock::Auto(s) if s == "auto" => Ok(Some(LeaseBlock::Auto)),
            RawBlock::Auto(s) => Err(self.err(
                format!("{field}.lease.block"),
                format!("{s:?} is neither \"auto\" nor a number"),
            )),
        }
    }

    /// The keys, read from the file one at a time: each is parsed, checked and compiled before
    /// the next, so the parsed form of one key at most is held, never the whole list.
    fn keys(&self, raw: &RawRules, limits: &Limits) -> Result<KeysBuilder, RulesError> {
        let mut pass = KeysPass {
            compiler: self,
            limits,
            plan_quota: self.plan_quota(raw)?.map(Arc::new),
            keys: KeysBuilder::default(),
            failed: None,
        };
        let mut de = serde_json::Deserializer::from_slice(self.bytes);
        let mut track = serde_path_to_error::Track::new();
        let read = serde::de::DeserializeSeed::deserialize(
            &mut pass,
            serde_path_to_error::Deserializer::new(&mut de, &mut track),
        );
        if let Some(e) = pass.failed.take() {
            return Err(e);
        }
        read.map_err(|e| parse_error(self.file, track.path().to_string(), e))?;
        Ok(pass.keys)
    }

    /// A quota set on a limit: the default of every key. Quotas count a key's admitted
    /// requests, so only a `key` limit may carry one, and only one limit, so each key has one.
    fn plan_quota(&self, raw: &RawRules) -> Result<Option<quota::Quota>, RulesError> {
        let mut found: Option<(&str, quota::Quota)> = None;
        for (name, l) in &raw.limits {
            let Some(q) = &l.quota else { continue };
            let field = format!("limits.{name}.quota");
            if !matches!(l.dimension, RawDimension::Named(RawDimensionName::Key)) {
                return Err(self.err(
                    field,
                    "only a \"key\" limit may carry a quota: a quota counts each key's requests",
                ));
            }
            if let Some((first, _)) = &found {
                return Err(self.err(
                    field,
                    format!("limits {first:?} and {name:?} both carry a quota; a key has one"),
                ));
            }
            found = Some((name, self.quota(&field, &format!("limit {name}"), q)?));
        }
        Ok(found.map(|(_, q)| q))
    }

    /// A quota as written, checked: the error names the field that is wrong.
    fn quota(&self, field: &str, whose: &str, q: &RawQuota) -> Result<quota::Quota, RulesError> {
        let zone = q.timezone.as_deref().unwrap_or("UTC");
        quota::Quota::new(q.per, q.limit, zone).map_err(|e| {
            let part = match e {
                quota::QuotaError::Zone(_) => "timezone",
                quota::QuotaError::Zero => "limit",
            };
            self.err(format!("{field}.{part}"), format!("{whose}: {e}"))
        })
    }

    /// The hash of a key's secret, once its id and its hash are known to be new: a request
    /// finds its key by the hash, and logs and replay name it by the id.
    fn key_hash(&self, field: KeyAt, k: &RawKey, keys: &KeysBuilder) -> Result<[u8; 32], RulesError> {
        if k.id.is_empty() {
            return Err(self.err(format!("{field}.id"), "must not be empty"));
        }
        if keys.id_of(&k.id).is_some() {
            return Err(self.err(format!("{field}.id"), format!("duplicate key id {:?}", k.id)));
        }
        let hash = parse_sha256(&k.sha256)
            .map_err(|reason| self.err(format!("{field}.sha256"), format!("key {}: {reason}", k.id)))?;
        if let Some(other) = keys.hash_of(&hash) {
            return Err(self.err(
                format!("{field}.sha256"),
                format!(
                    "duplicate key hash: keys {:?} and {:?} have the same secret",
                    keys.keys()[other].id,
                    k.id
                ),
            ));
        }
        Ok(hash)
    }

    /// One key, added to `keys`; keys of one tenant must set the same numbers.
    fn key(
        &self,
        field: KeyAt,
        k: RawKey,
        hash: [u8; 32],
        limits: &Limits,
        keys: &mut KeysBuilder,
        plan_quota: Option<&Arc<quota::Quota>>,
    ) -> Result<(), RulesError> {
        let tenant_text = k.tenant.as_deref().unwrap_or(&k.id);
        if tenant_text.is_empty() || tenant_text.contains(['{', '}']) {
            return Err(self.err(format!("{field}.tenant"), "must be non-empty, without braces"));
        }
        let quota = match &k.quota {
            Some(q) => Some(Arc::new(self.quota(
                &format!("{field}.quota"),
                &format!("key {}", k.id),
                q,
            )?)),
            None => plan_quota.cloned(),
        };
        let run = self.key_limits(field, &k, limits, keys)?;
        // Keys of one tenant share buckets, so they must share numbers.
        let shared = match keys.tenant(tenant_text) {
            Some((_, first)) if keys.run(first) != run.as_slice() => {
                return Err(self.err(
                    format!("{field}.limits"),
                    format!(
                        "keys {:?} and {:?} share tenant {tenant_text:?} but set different limits",
                        &*keys.keys()[first].id,
                        k.id
                    ),
                ));
            }
            Some((name, _)) => Some(name.clone()),
            None => None,
        };
        for (what, text) in [("id", &*k.id), ("tenant", tenant_text)] {
            if HeaderValue::from_str(text).is_err() {
                return Err(self.err(
                    format!("{field}.{what}"),
                    "must be printable ASCII (it is sent upstream)",
                ));
            }
        }
        let id: Arc<str> = k.id.as_str().into();
        let tenant = match (shared, &k.tenant) {
            (Some(name), _) => name,
            // The tenant is the id: one allocation for both.
            (None, None) => id.clone(),
            (None, Some(t)) => t.as_str().into(),
        };
        let name = k.name.map(String::into_boxed_str);
        keys.push(keys::new_key(id, tenant, name, hash, quota), &run);
        Ok(())
    }

    /// A key's own numbers, as (limit index, index of the shared numbers) in limit order:
    /// numbers written alike for one limit are compiled once and shared.
    fn key_limits(
        &self,
        field: KeyAt,
        k: &RawKey,
        limits: &Limits,
        keys: &mut KeysBuilder,
    ) -> Result<Vec<(u16, u32)>, RulesError> {
        let mut run = Vec::with_capacity(k.limits.len());
        for (lname, RawNumbers { rate, burst }) in &k.limits {
            let lfield = || format!("{field}.limits.{lname}");
            let Some(&li) = limits.by_name.get(lname.as_str()) else {
                return Err(self.err(lfield(), format!("no limit named {lname:?}")));
            };
            let limit = &limits.list[li];
            if limit.dimension == Dimension::Ip {
                return Err(self.err(lfield(), "ip limits are per address and can't be set per key"));
            }
            let n = match keys.written(li as u16, rate, *burst) {
                keys::Written::Known(n) => n,
                keys::Written::New => {
                    let n = self.numbers(&lfield(), lname, rate, *burst)?;
                    if let Some(block) = limit.lease {
                        self.check_leasable(&lfield(), &n.params, block)?;
                    }
                    keys.add_numbers(li as u16, rate, *burst, n)
                }
            };
            run.push((li as u16, n));
        }
        Ok(run)
    }

    fn routes(
        &self,
        raw: &RawRules,
        upstreams: &Upstreams,
        limits: &Limits,
        keys: &Keys,
    ) -> Result<Vec<Route>, RulesError> {
        let mut routes: Vec<Route> = Vec::new();
        let mut seen = HashMap::new();
        // A set, not a look through the routes so far: 10,000 routes made that 50 million
        // name compares per load.
        let mut names = HashSet::new();
        for (i, r) in raw.routes.iter().enumerate() {
            let field = format!("routes[{i}]");
            let method = if r.method == "*" {
                None
            } else {
                Some(self.route_method(&field, &r.method)?)
            };
            self.route_path(&field, &r.path)?;
            if r.method_override
                && let Some(m) = method.as_ref().filter(|m| {
                    !matches!(
                        **m,
                        Method::GET
                            | Method::POST
                            | Method::PUT
                            | Method::PATCH
                            | Method::DELETE
                            | Method::OPTIONS
                    )
                })
            {
                // A POST may only become a method whose answer it can be sent (not HEAD's,
                // which has no body) and that no route should be reached by through a header.
                return Err(self.err(
                    format!("{field}.method_override"),
                    format!(
                        "a POST can't be overridden into {m}: only GET, POST, PUT, PATCH, DELETE and OPTIONS"
                    ),
                ));
            }
            if r.identity == Identity::Jwt && r.key == KeyRequirement::Optional {
                return Err(self.err(
                    format!("{field}.key"),
                    "a JWT route needs its token: \"optional\" applies to API keys only",
                ));
            }
            let Some(&upstream) = upstreams.by_name.get(&r.upstream) else {
                return Err(self.err(
                    format!("{field}.upstream"),
                    format!(
                        "no upstream named {:?} (known: {:?})",
                        r.upstream,
                        raw.upstreams.keys().collect::<Vec<_>>()
                    ),
                ));
            };
            let name = r
                .name
                .clone()
                .unwrap_or_else(|| format!("{} {}", r.method, r.path));
            if let Some(prev) = seen.insert((r.method.clone(), r.path.clone()), i) {
                return Err(self.err(&field, format!("same method and path as routes[{prev}]")));
            }
            if !names.insert(name.clone()) {
                return Err(self.err(format!("{field}.name"), format!("duplicate route name {name:?}")));
            }
            let costs = self.costs(&field, r, &name, limits, keys)?;
            let body_field = self.body_field(&field, &costs, &limits.list)?;
            let post_paid = costs
                .iter()
                .any(|&(li, _)| limits.list[li as usize].post_paid.is_some());
            let up = &upstreams.list[upstream];
            routes.push(Route {
                post_paid,
                name: name.into(),
                body_field,
                method,
                prefix: r.path.clone(),
                upstream,
                key: r.key,
                identity: r.identity,
                costs,
                max_body_bytes: r.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
                encoded_slashes: slashes(r.encoded_slashes).unwrap_or(up.encoded_slashes),
                case_insensitive: up.case_insensitive,
                method_override: r.method_override,
            });
        }
        Ok(routes)
    }

    fn route_path(&self, field: &str, path: &str) -> Result<(), RulesError> {
        if !path.starts_with('/') {
            return Err(self.err(format!("{field}.path"), format!("{path:?} must start with '/'")));
        }
        // Requests are routed on canonical paths, so a prefix spelled any other way would
        // never match.
        match path::canonical(path, EncodedSlashes::Keep) {
            Ok(c) if c == path => Ok(()),
            Ok(c) => Err(self.err(
                format!("{field}.path"),
                format!("{path:?} is not in canonical form; write {c:?}"),
            )),
            Err(e) => Err(self.err(format!("{field}.path"), format!("{path:?}: {e}"))),
        }
    }

    /// A route's (limit index, cost) pairs. A charge no request could pay (above a burst,
    /// the limit's own or a key's, or in a limit with no numbers for some key) is refused
    /// at load rather than failing every request.
    fn costs(
        &self,
        field: &str,
        r: &RawRoute,
        name: &str,
        limits: &Limits,
        keys: &Keys,
    ) -> Result<Vec<(u16, u64)>, RulesError> {
        let mut costs = Vec::new();
        for (lname, &cost) in &r.cost {
            let cfield = format!("{field}.cost.{lname}");
            let Some(&li) = limits.by_name.get(lname.as_str()) else {
                return Err(self.err(&cfield, format!("no limit named {lname:?}")));
            };
            if cost == 0 {
                return Err(self.err(&cfield, "a cost must be at least 1; leave the limit out instead"));
            }
            let limit = &limits.list[li];
            if let Some(pp) = &limit.post_paid
                && cost != pp.reserve
            {
                return Err(self.err(
                    &cfield,
                    format!(
                        "limit {lname:?} is post-paid: a request pays its reserve ({}) up front and the rest when the answer reports it; write {}",
                        pp.reserve, pp.reserve
                    ),
                ));
            }
            if r.identity == Identity::Jwt {
                self.jwt_cost(&cfield, name, lname, limit, cost)?;
                costs.push((li as u16, cost));
                continue;
            }
            if let Dimension::Claim(c) = &limit.dimension {
                return Err(self.err(
                    &cfield,
                    format!("limit {lname:?} keys on the JWT claim {c:?}, but route {name:?} takes API keys (\"identity\": \"jwt\" to take tokens)"),
                ));
            }
            if limit.concurrent.is_some() {
                if cost != 1 {
                    return Err(self.err(
                        &cfield,
                        "a request takes one seat of a limit on requests in flight; write 1",
                    ));
                }
                costs.push((li as u16, cost));
                continue;
            }
            // `who` is called only for the error: this runs for every key of every route.
            let check = |n: &Numbers, who: &dyn Fn() -> String| {
                if cost > n.params.burst {
                    Err(self.err(
                        &cfield,
                        format!(
                            "route {name:?} costs {cost} in limit {lname:?}, above its burst {}{}: it could never pass",
                            n.params.burst,
                            who()
                        ),
                    ))
                } else {
                    Ok(())
                }
            };
            if let Some(n) = &limit.numbers {
                check(n, &String::new)?;
            }
            for ki in 0..keys.len() {
                match keys.numbers(ki, limit, li) {
                    Some(n) => check(n, &|| format!(" for key {:?}", keys[ki].id))?,
                    None if r.key == KeyRequirement::Required || limit.dimension == Dimension::Key => {
                        return Err(self.err(
                            format!("keys[{ki}].limits.{lname}"),
                            format!(
                                "limit {lname:?} has no numbers of its own and key {:?} sets none, but route {name:?} charges it",
                                keys[ki].id
                            ),
                        ));
                    }
                    None => {}
                }
            }
            costs.push((li as u16, cost));
        }
        Ok(costs)
    }

    /// A JWT route's cost in one limit: payable under every plan, and in limits a token's
    /// caller can pay (its numbers come from the limit or its plans, never from a key).
    fn jwt_cost(
        &self,
        cfield: &str,
        name: &str,
        lname: &str,
        limit: &Limit,
        cost: u64,
    ) -> Result<(), RulesError> {
        if limit.concurrent.is_some() {
            return Err(self.err(
                cfield,
                format!("limit {lname:?} counts requests in flight per API key; a JWT route can't charge it"),
            ));
        }
        if limit.dimension == Dimension::Key && limit.numbers.is_none() && limit.plans.is_none() {
            return Err(self.err(
                cfield,
                format!("limit {lname:?} has no numbers of its own and no \"plans\", so a token's caller has none, but route {name:?} charges it"),
            ));
        }
        let all = limit
            .numbers
            .iter()
            .map(|n| ("".to_string(), n))
            .chain(limit.plans.iter().flat_map(|p| {
                p.numbers
                    .iter()
                    .map(|(plan, n)| (format!(" for plan {plan:?}"), n))
            }));
        for (who, n) in all {
            if cost > n.params.burst {
                return Err(self.err(
                    cfield,
                    format!("route {name:?} costs {cost} in limit {lname:?}, above its burst {}{who}: it could never pass", n.params.burst),
                ));
            }
        }
        Ok(())
    }

    /// The JSON body field a route's limits are keyed on, if any.
    fn body_field(
        &self,
        field: &str,
        costs: &[(u16, u64)],
        limits: &[Limit],
    ) -> Result<Option<String>, RulesError> {
        let mut body_fields: Vec<&String> = costs
            .iter()
            .filter_map(|&(li, _)| match &limits[li as usize].dimension {
                Dimension::BodyField(f) => Some(f),
                _ => None,
            })
            .collect();
        body_fields.dedup();
        if body_fields.len() > 1 {
            return Err(self.err(
                format!("{field}.cost"),
                format!("limits keyed on different body fields {body_fields:?}; one route can read one"),
            ));
        }
        Ok(body_fields.first().map(|f| f.to_string()))
    }

    fn unauthenticated(&self, raw: &RawRules, limits: &Limits) -> Result<Option<(u16, u64)>, RulesError> {
        let Some(u) = &raw.unauthenticated else {
            return Ok(None);
        };
        let Some(&li) = limits.by_name.get(u.limit.as_str()) else {
            return Err(self.err("unauthenticated.limit", format!("no limit named {:?}", u.limit)));
        };
        let limit = &limits.list[li];
        if limit.dimension != Dimension::Ip {
            return Err(self.err(
                "unauthenticated.limit",
                format!("limit {:?} must have dimension \"ip\"", u.limit),
            ));
        }
        if u.cost == 0 {
            return Err(self.err("unauthenticated.cost", "must be at least 1"));
        }
        if let Some(n) = &limit.numbers
            && u.cost > n.params.burst
        {
            return Err(self.err(
                "unauthenticated.cost",
                format!(
                    "cost {} is above the burst {} of limit {:?}",
                    u.cost, n.params.burst, u.limit
                ),
            ));
        }
        Ok(Some((li as u16, u.cost)))
    }

    /// A route's method: a token the way clients must send it. A lower-case `post` would match
    /// no request (those are refused), and CONNECT is never routed.
    fn route_method(&self, field: &str, text: &str) -> Result<Method, RulesError> {
        let m = Method::from_bytes(text.as_bytes()).map_err(|_| {
            self.err(
                format!("{field}.method"),
                format!("{text:?} is not an HTTP method (or \"*\")"),
            )
        })?;
        if m == Method::CONNECT {
            return Err(self.err(
                format!("{field}.method"),
                "CONNECT is refused with 405: the gateway is not a tunnel",
            ));
        }
        if let Some(standard) = tollgate_http1::sanitize::miscased_method(&m) {
            return Err(self.err(
                format!("{field}.method"),
                format!("methods are case-sensitive: write {standard:?}, not {text:?}"),
            ));
        }
        Ok(m)
    }

    /// Leasing pays only for hot capacity limits: at least 500 tokens a second. A fixed block
    /// must fit in the bucket, or no lease could ever be granted.
    fn check_leasable(&self, field: &str, p: &BucketParams, block: LeaseBlock) -> Result<(), RulesError> {
        if (p.rate.tokens as u128) * 1_000_000 < 500 * p.rate.period_us as u128 {
            return Err(self.err(
                format!("{field}.lease"),
                format!("rate {} is under 500/s; leasing is for hot keys only", p.rate),
            ));
        }
        if let LeaseBlock::Fixed(b) = block
            && b > p.burst
        {
            return Err(self.err(
                format!("{field}.lease.block"),
                format!(
                    "block {b} is above the burst {}: the bucket could never hold a whole block",
                    p.burst
                ),
            ));
        }
        Ok(())
    }
}

/// Longest prefix first, and a route with a method before the catch-all of the same prefix:
/// [`Snapshot::route`] takes the first route that matches.
fn sort_routes(routes: &mut [Route]) {
    routes.sort_by(|a, b| {
        b.prefix
            .len()
            .cmp(&a.prefix.len())
            .then_with(|| a.method.is_none().cmp(&b.method.is_none()))
    });
}

fn slashes(raw: Option<RawEncodedSlashes>) -> Option<EncodedSlashes> {
    raw.map(|s| match s {
        RawEncodedSlashes::Refuse => EncodedSlashes::Refuse,
        RawEncodedSlashes::Keep => EncodedSlashes::Keep,
    })
}

/// The second pass over a rules file: its `keys`, each compiled as soon as it is parsed.
struct KeysPass<'p, 'a, 'r> {
    compiler: &'p Compiler<'a>,
    limits: &'p Limits<'r>,
    /// The quota of a key that names none, shared.
    plan_quota: Option<Arc<quota::Quota>>,
    keys: KeysBuilder,
    /// Why the pass stopped, when a key parsed but is not valid.
    failed: Option<RulesError>,
}

/// The field of the key at an index, `keys[i]`, written out only in an error.
#[derive(Clone, Copy)]
struct KeyAt(usize);

impl std::fmt::Display for KeyAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "keys[{}]", self.0)
    }
}

impl KeysPass<'_, '_, '_> {
    fn add(&mut self, k: RawKey) -> Result<(), RulesError> {
        let c = self.compiler;
        let i = self.keys.len();
        if i >= keys::MAX_KEYS {
            return Err(c.err("keys", format!("more than {} keys", keys::MAX_KEYS)));
        }
        let field = KeyAt(i);
        let hash = c.key_hash(field, &k, &self.keys)?;
        c.key(
            field,
            k,
            hash,
            self.limits,
            &mut self.keys,
            self.plan_quota.as_ref(),
        )
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for &mut KeysPass<'_, '_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for &mut KeysPass<'_, '_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the rules object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // The first pass has checked every field but the keys' contents.
        while let Some(field) = map.next_key::<String>()? {
            if field == "keys" {
                map.next_value_seed(KeyList(&mut *self))?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// The `keys` array of [`KeysPass`].
struct KeyList<'x, 'p, 'a, 'r>(&'x mut KeysPass<'p, 'a, 'r>);

impl<'de> serde::de::DeserializeSeed<'de> for KeyList<'_, '_, '_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyList<'_, '_, '_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(k) = seq.next_element::<RawKey>()? {
            if let Err(e) = self.0.add(k) {
                self.0.failed = Some(e);
                return Err(serde::de::Error::custom("an invalid key"));
            }
        }
        Ok(())
    }
}

fn parse_sha256(text: &str) -> Result<[u8; 32], String> {
    if text.len() != 64
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!(
            "{text:?} is not 64 lower-case hex digits (the SHA-256 of the key)"
        ));
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// The SHA-256 of a presented secret: the only form in which keys are compared.
pub fn hash_secret(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}
