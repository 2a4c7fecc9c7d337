//! The rules file as written: serde types with `deny_unknown_fields`, checked later by `compile`,
//! and the JSON Schema derived from the same types.

use std::borrow::Cow;
use std::collections::BTreeMap;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use tollgate_limit::batch::FailurePolicy;

/// The JSON Schema of a rules file as `tollgate rules-schema` prints it and rules/schema.json
/// holds it: pretty-printed, with a trailing newline.
pub fn schema() -> String {
    let schema = schemars::schema_for!(RawRules);
    let mut text = serde_json::to_string_pretty(&schema).expect("a schema is a JSON value");
    text.push('\n');
    text
}

/// A Tollgate rules file: the upstreams, the limits, the API keys and the routes that charge
/// them. Every object refuses fields it does not know.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "TollgateRules")]
pub(crate) struct RawRules {
    /// The JSON Schema this file follows (`"./schema.json"` in rules/), so editors can check
    /// it; the gateway never reads it.
    #[serde(rename = "$schema", default)]
    #[allow(dead_code)]
    pub schema: Option<String>,
    /// Only goes up: a running gateway ignores a file whose version is not above its own.
    pub version: u64,
    /// The services behind the gateway, by the name routes give them.
    pub upstreams: BTreeMap<String, RawUpstream>,
    /// The token buckets, by the name costs, keys and `unauthenticated` give them (letters,
    /// digits, `-`, `_` and `.`).
    #[serde(default)]
    pub limits: BTreeMap<String, RawLimit>,
    /// The API keys, by the SHA-256 of their secret.
    #[serde(default, deserialize_with = "skip_keys")]
    #[schemars(with = "Vec<RawKey>")]
    #[allow(dead_code)]
    pub keys: Vec<RawKey>,
    /// Which requests go to which upstream and what each costs; the longest matching path
    /// prefix wins.
    pub routes: Vec<RawRoute>,
    /// The limit charged to every request that has no valid key, keyed on the client IP.
    #[serde(default)]
    pub unauthenticated: Option<RawUnauthenticated>,
    /// Bearer tokens for routes with `"identity": "jwt"`: the JWKS and the claims to check.
    #[serde(default)]
    pub jwt: Option<crate::jwt::RawJwt>,
}

/// The keys are skipped when the rules are first parsed (always empty here): compiling reads
/// them in a second pass, one at a time, so a file of a million keys is never held parsed.
fn skip_keys<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<RawKey>, D::Error> {
    serde::de::IgnoredAny::deserialize(d)?;
    Ok(Vec::new())
}

/// A service the gateway forwards to.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Upstream")]
pub(crate) struct RawUpstream {
    /// Base URL: `http://host[:port][/prefix]` or `https://host[:port][/prefix]` (ports 80
    /// and 443 when left out). One target; `targets` names several instead.
    #[serde(default)]
    pub url: Option<String>,
    /// Several instances of the service, each a base URL of the same scheme and path prefix
    /// and a weight; in place of `url`.
    #[serde(default)]
    pub targets: Option<Vec<RawTarget>>,
    /// How often a target's host name is resolved again, in milliseconds (default 5000): a
    /// name with several addresses is that many targets, followed as they change.
    #[serde(default)]
    pub dns_refresh_ms: Option<u64>,
    /// How a request's target is chosen: `least_request` (two at random, the one with fewer
    /// requests in flight for its weight), `round_robin` (in turn, by weight), or `hash` (by
    /// the caller's key id, or its address without a key: one partner keeps to one target
    /// while it is up; refused unless a route that requires a key or a JWT reaches the
    /// upstream).
    #[serde(default)]
    pub balance: RawBalance,
    /// Active health checks: each target asked a path on its own; one that fails them gets no
    /// requests until it passes them again.
    #[serde(default)]
    pub health: Option<RawHealth>,
    /// When a target that keeps failing is left out for a while.
    #[serde(default)]
    pub eject: Option<RawEject>,
    /// How often a request whose target failed goes to another.
    #[serde(default)]
    pub retries: Option<RawRetries>,
    /// How an `https://` upstream's certificate is checked; without it, against the public web's
    /// roots for the URL's host. Refused on an `http://` upstream.
    #[serde(default)]
    pub tls: Option<RawUpstreamTls>,
    /// How long the upstream may take to send its response headers.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// At most this many requests in flight to the upstream; past it, 503.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// How long a request may wait for a place under `max_in_flight`.
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    /// How long a kept connection may sit idle before the gateway closes it; keep it below the
    /// upstream's own keep-alive timeout.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
    /// `%2F` and `%5C` in paths of routes to this upstream (a route may say otherwise).
    #[serde(default)]
    pub encoded_slashes: Option<RawEncodedSlashes>,
    /// Whether routes to this upstream match paths ignoring ASCII case.
    #[serde(default)]
    pub paths: RawPathMatch,
    /// A limit on requests in flight that follows the upstream's latency.
    #[serde(default)]
    pub concurrency: Option<RawConcurrency>,
}

/// One instance of an upstream.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Target")]
pub(crate) struct RawTarget {
    /// Its base URL, of the upstream's scheme and path prefix.
    pub url: String,
    /// Its share of requests against the other targets' (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
    /// At most this many requests in flight to it (each address of a name, to each); the
    /// upstream's is then the sum. Not with the upstream's own `max_in_flight`.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

/// How an upstream's target is chosen for a request.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "Balance")]
pub(crate) enum RawBalance {
    /// Two targets at random, weighted; the one with fewer requests in flight for its weight.
    #[default]
    LeastRequest,
    /// Each target in turn, as often as its weight says.
    RoundRobin,
    /// By the caller's key id (its address without a key): a partner keeps to one target,
    /// and a lost target moves only its own partners. Only on an upstream that a route
    /// requiring a key or a JWT reaches.
    Hash,
}

/// Active health checks of an upstream's targets.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Health")]
pub(crate) struct RawHealth {
    /// The path each target is asked with a GET (after the upstream's path prefix); any 2xx
    /// passes.
    pub path: String,
    /// How often each target is asked (default 2000).
    #[serde(default)]
    pub interval_ms: Option<u64>,
    /// How long an answer may take (default 1000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Failed checks in a row that take a target out (default 2).
    #[serde(default)]
    pub unhealthy_after: Option<u32>,
    /// Passed checks in a row that bring it back (default 2).
    #[serde(default)]
    pub healthy_after: Option<u32>,
}

/// Passive ejection: what real requests see of a target.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Eject")]
pub(crate) struct RawEject {
    /// Failures in a row (connect failures, resets before an answer, 502, 503 and 504) that
    /// eject a target (default 5).
    #[serde(default)]
    pub consecutive_failures: Option<u32>,
    /// How long a first ejection lasts (default 30000); each one after doubles it, up to 10
    /// minutes.
    #[serde(default)]
    pub for_ms: Option<u64>,
    /// The largest share of the targets out at once, in percent (default 50).
    #[serde(default)]
    pub max_percent: Option<u32>,
}

/// Retries of a request whose target failed, on another target.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Retries")]
pub(crate) struct RawRetries {
    /// At most this many more attempts (default 2; 0: none).
    #[serde(default)]
    pub attempts: Option<u32>,
    /// Retries may be at most this percent of the requests of the last 10 s (default 20).
    #[serde(default)]
    pub budget_percent: Option<u32>,
}

/// How the gateway checks an `https://` upstream's certificate.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpstreamTls")]
pub(crate) struct RawUpstreamTls {
    /// A PEM file of the CA certificates the upstream's certificate must chain to, relative to
    /// the rules file; they replace the built-in roots (Mozilla's, for public certificates).
    #[serde(default)]
    pub ca: Option<String>,
    /// The name the upstream's certificate must carry, sent as SNI; by default the URL's host.
    #[serde(default)]
    pub server_name: Option<String>,
}

/// An upstream's adaptive limit on requests in flight, under its `max_in_flight`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Concurrency")]
pub(crate) struct RawConcurrency {
    /// Whether the limit follows the upstream's latency; required, so a block that was meant
    /// to be off says so.
    pub adaptive: bool,
    /// The fewest requests in flight the limit goes down to (default 4).
    #[serde(default)]
    pub min: Option<u32>,
    /// The most requests in flight the limit goes up to (default 2000, at most 1000000).
    #[serde(default)]
    pub max: Option<u32>,
}

/// What a path's `%2F` and `%5C` do.
#[derive(Debug, Deserialize, JsonSchema, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
#[schemars(rename = "EncodedSlashes")]
pub(crate) enum RawEncodedSlashes {
    /// A 400, so an upstream can't decode them into separators the gateway didn't route on.
    Refuse,
    /// Kept encoded, as data inside one segment.
    Keep,
}

/// How a route's path prefix is compared with a request's path.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
#[schemars(rename = "PathMatch")]
pub(crate) enum RawPathMatch {
    /// Paths match byte for byte.
    #[default]
    Exact,
    /// For upstreams that serve `/V1/Exports` as `/v1/exports`, so limits can't be dodged by
    /// case; the upstream still gets the client's spelling.
    CaseInsensitive,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RawDimensionName {
    /// One bucket per tenant (the key's plan).
    Key,
    /// One bucket per tenant (or client IP, without a key) per route.
    Route,
    /// One bucket per client IP.
    Ip,
    /// One bucket per client fingerprint (the TLS ClientHello's; `none` on plain TCP).
    Fingerprint,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RawDimension {
    Named(RawDimensionName),
    /// One bucket per value of this request header.
    Header(String),
    /// One bucket per value of this top-level field of a JSON request body (read at most
    /// 16 KiB of it), e.g. the account of a login.
    BodyField(String),
    /// One bucket per value of this claim of a verified JWT, inside its tenant.
    Claim(String),
}

/// Every form a dimension may take, for the error that names a wrong one.
const DIMENSIONS: &str = "\"key\", \"route\", \"ip\", \"fingerprint\", {\"header\": NAME}, {\"body_field\": NAME} or {\"claim\": NAME}";

/// Read by hand rather than as an untagged enum, whose one error ("did not match any variant")
/// would not say what was wrong nor what is allowed.
impl<'de> Deserialize<'de> for RawDimension {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawDimension, D::Error> {
        use serde::de::Error;
        use serde_json::Value;
        let v = Value::deserialize(d)?;
        match &v {
            Value::String(s) => Ok(RawDimension::Named(match s.as_str() {
                "key" => RawDimensionName::Key,
                "route" => RawDimensionName::Route,
                "ip" => RawDimensionName::Ip,
                "fingerprint" => RawDimensionName::Fingerprint,
                other => {
                    return Err(D::Error::custom(format!(
                        "{other:?} is not a dimension; use {DIMENSIONS}"
                    )));
                }
            })),
            Value::Object(m) if m.len() == 1 => {
                let (name, value) = m.iter().next().expect("one entry");
                let text = |what: &str| match value {
                    Value::String(t) => Ok(t.clone()),
                    _ => Err(D::Error::custom(format!(
                        "{{{name:?}: ...}} takes the {what} as a string"
                    ))),
                };
                match name.as_str() {
                    "header" => Ok(RawDimension::Header(text("header's name")?)),
                    "body_field" => Ok(RawDimension::BodyField(text("field's name")?)),
                    "claim" => Ok(RawDimension::Claim(text("claim's name")?)),
                    "key" | "route" | "ip" | "fingerprint" => Err(D::Error::custom(format!(
                        "the {name} dimension takes no settings: write \"{name}\""
                    ))),
                    other => Err(D::Error::custom(format!(
                        "{other:?} is not a dimension; use {DIMENSIONS}"
                    ))),
                }
            }
            other => Err(D::Error::custom(format!(
                "{other} is not a dimension; use {DIMENSIONS}"
            ))),
        }
    }
}

/// Written by hand to accept what the hand-written `Deserialize` above accepts: one of the
/// four names, or an object of exactly one of the three named fields holding a string.
impl JsonSchema for RawDimension {
    fn schema_name() -> Cow<'static, str> {
        "Dimension".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let named = |name: &str, about: &str| {
            json_schema!({
                "const": name,
                "description": about,
            })
        };
        let with = |field: &str, about: &str| {
            json_schema!({
                "type": "object",
                "properties": { field: { "type": "string" } },
                "required": [field],
                "additionalProperties": false,
                "description": about,
            })
        };
        json_schema!({
            "description": "What gets a bucket of its own: a name, or an object naming a header, a body field or a claim.",
            "oneOf": [
                named("key", "One bucket per tenant (the key's plan)."),
                named("route", "One bucket per tenant (or client IP, without a key) per route."),
                named("ip", "One bucket per client IP (or network prefix)."),
                named("fingerprint", "One bucket per client fingerprint (the TLS ClientHello's; `none` on plain TCP)."),
                with("header", "One bucket per value of this request header."),
                with("body_field", "One bucket per value of this top-level field of a JSON request body (read at most 16 KiB of it)."),
                with("claim", "One bucket per value of this claim of a verified JWT, inside its tenant."),
            ],
        })
    }
}

/// The schema's copy of `tollgate_limit::batch::FailurePolicy`, whose crate stays free of
/// schema code; the tests hold the two to the same names.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
#[schemars(rename = "FailurePolicy")]
// Never built: only its schema is used.
#[allow(dead_code)]
pub(crate) enum FailurePolicySchema {
    /// A share of the limit (rate r/N, burst max(1, b/N)) in this gateway's memory.
    Local,
    /// Admit, and count the bypass.
    Open,
    /// Refuse with 503.
    Closed,
}

/// Whether a limit refuses or only counts.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Refuses when short.
    #[default]
    Enforce,
    /// Computed and counted, never refuses.
    Shadow,
}

/// Where a limit's number holds: in each Region alone, or once across every Region.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Each Region enforces the whole limit on its own store.
    #[default]
    Region,
    /// One limit for all Regions together: each Region enforces the share its agent holds.
    Global,
}

/// What a limit protects.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LimitClass {
    /// Protects capacity or fairness.
    #[default]
    Capacity,
    /// Protects accounts (logins): never fails open, never leased.
    Security,
}

#[derive(Debug, Deserialize, JsonSchema, Clone, PartialEq, Eq)]
#[serde(untagged)]
#[schemars(rename = "Block")]
pub(crate) enum RawBlock {
    /// This many tokens per block (at least 1).
    Fixed(u64),
    /// `"auto"`: the block size follows the limit's rate.
    Auto(String),
}

/// Spend the limit from blocks of tokens leased into each gateway's memory (for hot keys).
#[derive(Debug, Deserialize, JsonSchema, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Lease")]
pub(crate) struct RawLease {
    /// `"auto"` or a fixed number of tokens per block.
    pub block: RawBlock,
}

/// A token bucket per value of its dimension, or a count of requests in flight.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Limit")]
pub(crate) struct RawLimit {
    /// What gets a bucket of its own.
    pub dimension: RawDimension,
    /// `N/P`, e.g. `600/60s`. Optional for `key` limits whose numbers every key sets.
    #[serde(default)]
    pub rate: Option<String>,
    /// The most tokens a bucket holds: the largest burst it lets through at once.
    #[serde(default)]
    pub burst: Option<u64>,
    /// Whether the limit refuses or only counts.
    #[serde(default)]
    pub mode: Mode,
    /// What the limit protects, which decides how it fails and whether it is leased.
    #[serde(default)]
    pub class: LimitClass,
    /// Requests of one key in flight at once, instead of a rate and a burst.
    #[serde(default)]
    pub concurrent: Option<u32>,
    /// Charge the bucket only when the upstream answers with one of these statuses.
    #[serde(default)]
    pub charge_on: Option<RawChargeOn>,
    /// `"global"`: one limit shared by all Regions (key limits only).
    #[serde(default)]
    pub scope: Scope,
    /// The one Region whose store holds a security limit's buckets, so an attacker can't
    /// spend a full allowance in every Region.
    #[serde(default)]
    pub home_region: Option<String>,
    /// What the limit does when its store can't answer (default `"local"`; a security limit
    /// may not fail open).
    #[serde(default)]
    #[schemars(with = "Option<FailurePolicySchema>")]
    pub on_store_failure: Option<FailurePolicy>,
    /// Spend a `key` limit from leased blocks of tokens in the gateway's memory.
    #[serde(default)]
    pub lease: Option<RawLease>,
    /// A billing quota every key on this plan gets, unless the key sets its own.
    #[serde(default)]
    pub quota: Option<RawQuota>,
    /// Numbers per value of a JWT claim (`plan_claim`, default `"plan"`), for JWT callers.
    #[serde(default)]
    pub plans: Option<BTreeMap<String, RawNumbers>>,
    /// The JWT claim whose value picks a plan (default `"plan"`).
    #[serde(default)]
    pub plan_claim: Option<String>,
    /// Accepted so a rules file can say what a limit is for; the gateway never reads it.
    #[serde(default)]
    #[allow(dead_code)]
    pub description: Option<String>,
    /// Per-IP buckets: the leading bits of an IPv6 client's address that name one client.
    #[serde(default)]
    pub ipv6_prefix: Option<u64>,
    /// Per-IP buckets: the leading bits of an IPv4 client's address that name one client.
    #[serde(default)]
    pub ipv4_prefix: Option<u64>,
    /// A post-paid limit: what a request costs is read from the upstream's answer, and the
    /// part beyond the reserve is taken when the answer's head arrives.
    #[serde(default)]
    pub cost_from_response: Option<RawCostFromResponse>,
    /// A post-paid limit's up-front cost, taken at the check (default 1); a route charging the
    /// limit names the same cost.
    #[serde(default)]
    pub reserve: Option<u64>,
    /// How far below empty a post-paid limit's bucket may go (default: one burst); refill pays
    /// the debt first.
    #[serde(default)]
    pub max_debt: Option<u64>,
    /// Queue instead of refusing: a request short of tokens waits until they are due, up to
    /// `max_wait_ms`, and is then forwarded; one that would wait longer is refused.
    #[serde(default)]
    pub delay: Option<RawDelay>,
    /// Once the limit refuses a request, refuse every request its bucket would pay for this
    /// long (`"30s"`, `"10m"`), whatever refills meanwhile.
    #[serde(default)]
    pub block_for: Option<String>,
}

/// `{"max_wait_ms": 2000}`.
#[derive(Debug, Deserialize, JsonSchema, Clone, Copy)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Delay")]
pub(crate) struct RawDelay {
    /// The longest a request waits for its tokens, in milliseconds (1 to 60,000).
    pub max_wait_ms: u64,
}

/// `{"header": "X-Usage-Tokens"}`: the response header whose decimal value is the cost.
#[derive(Debug, Deserialize, JsonSchema, Clone)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CostFromResponse")]
pub(crate) struct RawCostFromResponse {
    /// The response header that reports the cost.
    pub header: String,
}

/// `{"status": [401, 403]}`.
#[derive(Debug, Deserialize, JsonSchema, Clone)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "ChargeOn")]
pub(crate) struct RawChargeOn {
    /// The statuses that keep the charge (100 to 599, at least one).
    pub status: Vec<u16>,
}

/// A rate and a burst that replace a limit's own.
#[derive(Debug, Deserialize, JsonSchema, Clone)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Numbers")]
pub(crate) struct RawNumbers {
    /// `N/P`, e.g. `600/60s`.
    pub rate: String,
    /// The most tokens the bucket holds.
    pub burst: u64,
}

/// An API key: its hash, its tenant and its own numbers.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Key")]
pub(crate) struct RawKey {
    /// The key's public id, as in access logs and replay traces (`k-7`). Never the secret. 1 to
    /// 128 letters, digits, `-`, `_` and `.`, and not dots alone.
    pub id: String,
    /// Buckets of `key` and `route` limits are per tenant; defaults to the id.
    #[serde(default)]
    pub tenant: Option<String>,
    /// A name for people, such as the customer's.
    #[serde(default)]
    pub name: Option<String>,
    /// Lower-case hex SHA-256 of the secret key.
    pub sha256: String,
    /// This key's own numbers for some limits.
    #[serde(default)]
    pub limits: BTreeMap<String, RawNumbers>,
    /// A billing quota, enforced from metering, not from a bucket.
    #[serde(default)]
    pub quota: Option<RawQuota>,
}

/// `{"per": "day", "limit": 100000, "timezone": "Europe/Paris"}`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Quota")]
pub(crate) struct RawQuota {
    /// The calendar period the count resets on.
    pub per: crate::quota::Per,
    /// The most admitted requests in one period.
    pub limit: u64,
    /// An IANA name; UTC when absent.
    #[serde(default)]
    pub timezone: Option<String>,
}

/// Whether a route needs a valid API key.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum KeyRequirement {
    /// No key: 401.
    #[default]
    Required,
    /// A valid key is used when sent; without one the request is unauthenticated.
    Optional,
}

/// Who a route's caller is.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Identity {
    /// `Authorization: Bearer` or `X-API-Key` holds a secret whose hash is in `keys`.
    #[default]
    Key,
    /// `Authorization: Bearer` holds a JWT verified against the rules' `jwt` JWKS.
    Jwt,
}

/// What a route answers itself instead of forwarding.
#[derive(Debug, Deserialize, Serialize, JsonSchema, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
#[schemars(rename = "Serve")]
pub(crate) enum RawServe {
    /// The caller's key, its limits' buckets as `RateLimit` would report them, and its quota;
    /// nothing is forwarded, and only the route's own `cost` is charged.
    Usage,
}

/// Requests of one method under one path prefix: where they go and what they cost.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Route")]
pub(crate) struct RawRoute {
    /// How metrics, access lines and messages name the route, unique among routes (default:
    /// the method and the path, `"POST /v1/exports"`).
    #[serde(default)]
    pub name: Option<String>,
    /// An HTTP method, or `*` for any.
    pub method: String,
    /// A path prefix, matched on whole segments.
    pub path: String,
    /// The name of an upstream in `upstreams`; none on a route that serves the caller's usage.
    #[serde(default)]
    pub upstream: Option<String>,
    /// What the route answers itself instead of forwarding: `"usage"`, the caller's own budget.
    #[serde(default)]
    pub serve: Option<RawServe>,
    /// Whether a request needs a valid API key.
    #[serde(default)]
    pub key: KeyRequirement,
    /// Who the caller is: an API key (the default) or a verified JWT.
    #[serde(default)]
    pub identity: Identity,
    /// Tokens this route costs in each limit.
    #[serde(default)]
    pub cost: BTreeMap<String, u64>,
    /// Largest request body accepted, in bytes; 1 MiB when not set.
    #[serde(default)]
    pub max_body_bytes: Option<u64>,
    /// `%2F` and `%5C` in this route's paths; the upstream's setting when not set.
    #[serde(default)]
    pub encoded_slashes: Option<RawEncodedSlashes>,
    /// Whether a POST whose `X-HTTP-Method-Override` (or `X-HTTP-Method`, `X-Method-Override`)
    /// names a method this route takes is routed, limited and forwarded as that method.
    #[serde(default)]
    pub method_override: bool,
    /// The protocols an HTTP/1.1 request may upgrade its connection to on this route
    /// (`["websocket"]`): the upgrade is checked and charged like any request, then the
    /// connection is relayed both ways until either side closes.
    #[serde(default)]
    pub upgrade: Vec<String>,
    /// How long an upgraded connection may carry no byte either way before the gateway closes
    /// it, in milliseconds; 300000 (5 minutes) when not set.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
}

/// The bucket of requests without a valid key.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Unauthenticated")]
pub(crate) struct RawUnauthenticated {
    /// The name of an `"ip"` limit in `limits`.
    pub limit: String,
    /// Tokens each such request costs in it.
    #[serde(default = "one")]
    pub cost: u64,
}

fn one() -> u64 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn validator<T: JsonSchema>() -> jsonschema::Validator {
        let schema = serde_json::to_value(schemars::schema_for!(T)).unwrap();
        jsonschema::validator_for(&schema).unwrap()
    }

    fn parses<T: for<'de> Deserialize<'de>>(v: &Value) -> bool {
        serde_json::from_value::<T>(v.clone()).is_ok()
    }

    /// The dimension is read by hand, so its schema is written by hand: both must take the
    /// same values.
    #[test]
    fn the_dimension_schema_takes_what_the_parser_takes() {
        let schema = validator::<RawDimension>();
        let cases = [
            json!("key"),
            json!("route"),
            json!("ip"),
            json!("fingerprint"),
            json!({"header": "X-Tenant"}),
            json!({"body_field": "account"}),
            json!({"claim": "sub"}),
            json!({"header": ""}),
            json!("Key"),
            json!("fingerprnt"),
            json!(""),
            json!(7),
            json!(null),
            json!(["key"]),
            json!({"header": 1}),
            json!({"header": null}),
            json!({"key": "x"}),
            json!({"ip": {}}),
            json!({"cookie": "session"}),
            json!({}),
            json!({"header": "X-A", "claim": "sub"}),
        ];
        let mut taken = 0;
        for c in &cases {
            let parsed = parses::<RawDimension>(c);
            assert_eq!(schema.is_valid(c), parsed, "{c}: the parser says {parsed}");
            taken += usize::from(parsed);
        }
        assert_eq!(taken, 8, "the cases cover both answers");
    }

    /// `FailurePolicy` lives in tollgate-limit, which carries no schema code; its copy here
    /// must name the same values.
    #[test]
    fn the_failure_policy_copy_names_what_the_limit_crate_parses() {
        use FailurePolicy::{Closed, Local, Open};
        // Stops compiling when a policy is added, so the list below gets it too.
        let _ = |p: FailurePolicy| match p {
            Local | Open | Closed => (),
        };
        let schema = validator::<FailurePolicySchema>();
        for p in [Local, Open, Closed] {
            let name = serde_json::to_value(p).unwrap();
            assert!(schema.is_valid(&name), "{name} is missing from the schema");
        }
        for name in ["local", "open", "closed", "Local", "fail-open", "", "none"] {
            let v = json!(name);
            assert_eq!(schema.is_valid(&v), parses::<FailurePolicy>(&v), "{name}");
        }
    }

    /// The schema describes the parse (types, required and unknown fields, names), not the
    /// checks `compile` makes afterwards: on every shipped and every broken file, the schema
    /// and the parser agree. tests/rules_schema.rs names which broken files that refuses.
    #[test]
    fn on_every_rules_file_the_schema_and_the_parser_agree() {
        let schema = validator::<RawRules>();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = Vec::new();
        for dir in ["rules", "tests/broken_rules"] {
            for e in std::fs::read_dir(root.join(dir)).unwrap() {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                // Not rules files: JWKS and the schema itself.
                if name.ends_with("-jwks.json") || name == "schema.json" {
                    continue;
                }
                if name.ends_with(".json") || name.ends_with(".json.txt") {
                    files.push(p);
                }
            }
        }
        assert!(files.len() > 40, "found only {files:?}");
        let (mut taken, mut refused) = (0, 0);
        for f in &files {
            let v: Value = serde_json::from_slice(&std::fs::read(f).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            // The keys are parsed in a pass of their own (`skip_keys`).
            let parsed = parses::<RawRules>(&v) && v.get("keys").is_none_or(parses::<Vec<RawKey>>);
            assert_eq!(
                schema.is_valid(&v),
                parsed,
                "{}: the parser says {parsed}",
                f.display()
            );
            if parsed {
                taken += 1;
            } else {
                refused += 1;
            }
        }
        assert!(taken > 0 && refused > 0, "{taken} taken, {refused} refused");
    }
}
