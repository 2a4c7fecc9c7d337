//! The rules file as written: serde types with `deny_unknown_fields`, checked later by `compile`.

use std::collections::BTreeMap;

use serde::Deserialize;

use tollgate_limit::batch::FailurePolicy;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRules {
    /// Only goes up: a running gateway ignores a file whose version is not above its own.
    pub version: u64,
    pub upstreams: BTreeMap<String, RawUpstream>,
    #[serde(default)]
    pub limits: BTreeMap<String, RawLimit>,
    #[serde(default)]
    pub keys: Vec<RawKey>,
    pub routes: Vec<RawRoute>,
    /// The limit charged to every request that has no valid key, keyed on the client IP.
    #[serde(default)]
    pub unauthenticated: Option<RawUnauthenticated>,
    /// Bearer tokens for routes with `"identity": "jwt"`: the JWKS and the claims to check.
    #[serde(default)]
    pub jwt: Option<crate::jwt::RawJwt>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUpstream {
    /// Base URL: `http://host:port[/prefix]`.
    pub url: String,
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConcurrency {
    /// Required, so a block that was meant to be off says so.
    pub adaptive: bool,
    #[serde(default)]
    pub min: Option<u32>,
    #[serde(default)]
    pub max: Option<u32>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum RawEncodedSlashes {
    /// A 400, so an upstream can't decode them into separators the gateway didn't route on.
    Refuse,
    /// Kept encoded, as data inside one segment.
    Keep,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum RawPathMatch {
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

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Refuses when short.
    #[default]
    Enforce,
    /// Computed and counted, never refuses.
    Shadow,
}

/// Where a limit's number holds: in each Region alone, or once across every Region.
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Each Region enforces the whole limit on its own store.
    #[default]
    Region,
    /// One limit for all Regions together: each Region enforces the share its agent holds.
    Global,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LimitClass {
    /// Protects capacity or fairness.
    #[default]
    Capacity,
    /// Protects accounts (logins): never fails open, never leased.
    Security,
}

#[derive(Debug, Deserialize, Clone, PartialEq, Eq)]
#[serde(untagged)]
pub(crate) enum RawBlock {
    Fixed(u64),
    Auto(String),
}

#[derive(Debug, Deserialize, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLease {
    /// `"auto"` or a fixed number of tokens per block.
    pub block: RawBlock,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLimit {
    pub dimension: RawDimension,
    /// `N/P`, e.g. `600/60s`. Optional for `key` limits whose numbers every key sets.
    #[serde(default)]
    pub rate: Option<String>,
    #[serde(default)]
    pub burst: Option<u64>,
    #[serde(default)]
    pub mode: Mode,
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
    #[serde(default)]
    pub on_store_failure: Option<FailurePolicy>,
    #[serde(default)]
    pub lease: Option<RawLease>,
    /// A billing quota every key on this plan gets, unless the key sets its own.
    #[serde(default)]
    pub quota: Option<RawQuota>,
    /// Numbers per value of a JWT claim (`plan_claim`, default `"plan"`), for JWT callers.
    #[serde(default)]
    pub plans: Option<BTreeMap<String, RawNumbers>>,
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
}

/// `{"header": "X-Usage-Tokens"}`: the response header whose decimal value is the cost.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawCostFromResponse {
    pub header: String,
}

/// `{"status": [401, 403]}`.
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawChargeOn {
    pub status: Vec<u16>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNumbers {
    pub rate: String,
    pub burst: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKey {
    /// The key's public id, as in access logs and replay traces (`k-7`). Never the secret.
    pub id: String,
    /// Buckets of `key` and `route` limits are per tenant; defaults to the id.
    #[serde(default)]
    pub tenant: Option<String>,
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
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawQuota {
    pub per: crate::quota::Per,
    pub limit: u64,
    /// An IANA name; UTC when absent.
    #[serde(default)]
    pub timezone: Option<String>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum KeyRequirement {
    /// No key: 401.
    #[default]
    Required,
    /// A valid key is used when sent; without one the request is unauthenticated.
    Optional,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Identity {
    /// `Authorization: Bearer` or `X-API-Key` holds a secret whose hash is in `keys`.
    #[default]
    Key,
    /// `Authorization: Bearer` holds a JWT verified against the rules' `jwt` JWKS.
    Jwt,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    #[serde(default)]
    pub name: Option<String>,
    /// An HTTP method, or `*` for any.
    pub method: String,
    /// A path prefix, matched on whole segments.
    pub path: String,
    pub upstream: String,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawUnauthenticated {
    pub limit: String,
    #[serde(default = "one")]
    pub cost: u64,
}

fn one() -> u64 {
    1
}
