//! From a matched route and an identity to the batch of buckets one request must pay.

use std::cell::Cell;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;

use super::identity::{IpPrefixes, client_network};
use super::jwt::JwtCaller;
use super::{Dimension, Fingerprint, Keys, Limit, Route, Snapshot};
use tollgate_limit::batch::{Batch, CheckItem};
use tollgate_limit::bucket::Charge;

/// Why a request's buckets can't be named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("limit {limit:?} needs the {header} header")]
    MissingHeader { limit: Arc<str>, header: String },
    #[error("the {header} header is not valid for limit {limit:?}")]
    BadHeader { limit: Arc<str>, header: String },
    #[error("limit {limit:?} needs the JSON body field {field:?}")]
    MissingField { limit: Arc<str>, field: String },
    #[error("limit {limit:?} needs the token claim {claim:?} (a string, number or boolean)")]
    MissingClaim { limit: Arc<str>, claim: String },
}

/// Asker a request's buckets belong to.
#[derive(Debug, Clone, Copy)]
pub enum Caller<'a> {
    /// No valid credential: the client IP's buckets.
    Anonymous,
    /// A static API key of the rules, by index.
    Key(usize),
    /// A verified JWT: its key id and tenant come from claims, not from the rules.
    Jwt(&'a JwtCaller),
}

/// Header values longer than this are named by their hash in bucket keys.
const MAX_VALUE_IN_KEY: usize = 64;

/// Whether a byte goes into a bucket name as it is: printable ASCII but the hash tag's braces,
/// the segments' `:` and the escape's own `%`.
#[inline]
fn plain(b: u8) -> bool {
    matches!(b, 0x21..=0x7e) && !matches!(b, b'{' | b'}' | b':' | b'%')
}

/// Appends `value` %-escaped: every byte but the [`plain`] ones as `%XX` (upper-case hex).
fn push_escaped(out: &mut String, value: &[u8]) {
    if value.iter().all(|&b| plain(b)) {
        // Only printable ASCII, so this is UTF-8.
        out.push_str(std::str::from_utf8(value).unwrap_or_default());
        return;
    }
    for &b in value {
        if plain(b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// Appends a caller's value (a header, a body field, a claim) to a bucket name so it can't
/// break out of its hash tag or its segment, nor spell another value: escaped as
/// [`push_escaped`], and a long value replaced by `%sha256=` and its hash, which no escaped
/// value can spell (an escape is `%` and two hex digits).
pub(crate) fn push_value(out: &mut String, value: &[u8]) {
    if value.len() > MAX_VALUE_IN_KEY {
        out.push_str("%sha256=");
        let h = crate::hash_secret(value);
        out.push_str(&hex::encode(&h[..16]));
        return;
    }
    push_escaped(out, value);
}

/// `rl:{TENANT}:LIMIT`, pushed piece by piece: `write!` costs a request hundreds of
/// instructions in the formatting machinery for what is three copies. The tenant is escaped:
/// every other tag starts with a kind and a `:` (`ip:`, `h:`, `fp:`), which an escaped tenant
/// can't hold, so a tenant named `ip:203.0.113.9` never spells that address's buckets. A
/// tenant of plain characters, nearly every one, keeps the name it always had.
fn tenant_prefix(name: &mut String, tenant: &str, limit: &str) {
    name.reserve(6 + tenant.len() + limit.len());
    name.push_str("rl:{");
    push_escaped(name, tenant.as_bytes());
    name.push_str("}:");
    name.push_str(limit);
}

/// A bucket per value: within the tenant for a keyed request, on its own tag without a key.
fn tagged_value(name: &mut String, tenant: Option<&str>, limit: &str, value: &[u8]) {
    match tenant {
        Some(t) => {
            tenant_prefix(name, t, limit);
            name.push(':');
            push_value(name, value);
        }
        None => {
            name.push_str("rl:{h:");
            push_value(name, value);
            name.push_str("}:");
            name.push_str(limit);
        }
    }
}

/// The tag of a client's per-IP buckets: its address, or the network of its prefix
/// (`rl:{ip:2001:db8:1:2::/64}:`).
fn ip_tag(out: &mut String, ip: IpAddr, prefixes: IpPrefixes) {
    match client_network(ip, prefixes) {
        (net, Some(len)) => {
            let _ = write!(out, "rl:{{ip:{net}/{len}}}:");
        }
        (net, None) => {
            let _ = write!(out, "rl:{{ip:{net}}}:");
        }
    }
}

/// Builds the batch for one request. `key` is the authenticated key, if any; `fingerprint`
/// is the connection's client fingerprint. `body_value` is the route's JSON body field,
/// already read, for limits keyed on it.
pub fn build(
    snap: &Snapshot,
    route: &Route,
    key: Option<usize>,
    ip: IpAddr,
    fingerprint: Fingerprint,
    headers: &HeaderMap,
    body_value: Option<&[u8]>,
) -> Result<Batch, PlanError> {
    let caller = key.map_or(Caller::Anonymous, Caller::Key);
    build_for(snap, route, caller, ip, fingerprint, headers, body_value)
}

/// [`build`] for any caller, a JWT's included.
pub fn build_for(
    snap: &Snapshot,
    route: &Route,
    caller: Caller<'_>,
    ip: IpAddr,
    fingerprint: Fingerprint,
    headers: &HeaderMap,
    body_value: Option<&[u8]>,
) -> Result<Batch, PlanError> {
    let key = match caller {
        Caller::Anonymous => None,
        Caller::Key(k) => Some(Id::Key(&snap.keys, k)),
        Caller::Jwt(j) => Some(Id::Jwt(j)),
    };
    let mut batch = Batch::new();
    let mut has_unauth = false;
    for &(li, cost) in &route.costs {
        let idx = li as usize;
        let limit = &snap.limits[idx];
        if key.is_none() && Some(li) == snap.unauthenticated.map(|u| u.0) {
            has_unauth = true;
        }
        let who = Asker { key, ip, fingerprint };
        let Some(item) = item_for(limit, idx, &who, route, headers, body_value, cost)? else {
            continue;
        };
        batch.push(item);
    }
    if key.is_none()
        && !has_unauth
        && let Some((li, cost)) = snap.unauthenticated
    {
        batch.extend(unauthenticated(snap, li, cost, ip));
    }
    Ok(batch)
}

/// The key's own buckets a usage route reads without charging: one item of cost 0 for every
/// enforced `"key"` limit the key has numbers for (its own or the limit's), in limit order,
/// but those the route's `cost` already charges, whose charged item answers for them. Named and
/// leased exactly as a request paying them would name them, so each reads that bucket.
pub fn key_peeks(snap: &Snapshot, route: &Route, key: usize, ip: IpAddr) -> Batch {
    let mut batch = Batch::new();
    let who = Asker {
        key: Some(Id::Key(&snap.keys, key)),
        ip,
        fingerprint: Fingerprint::None,
    };
    for (idx, limit) in snap.limits.iter().enumerate() {
        if limit.dimension != Dimension::Key
            || limit.concurrent.is_some()
            || limit.shadow()
            || route.costs.iter().any(|&(li, _)| li as usize == idx)
        {
            continue;
        }
        // A key limit's name needs neither headers nor a body, so this never errs.
        if let Ok(Some(item)) = item_for(limit, idx, &who, route, &HeaderMap::new(), None, 0) {
            batch.push(item);
        }
    }
    batch
}

/// The unauthenticated bucket alone: what a request with a missing or unknown key pays.
pub fn unauthenticated_only(snap: &Snapshot, ip: IpAddr) -> Batch {
    let mut batch = Batch::new();
    if let Some((li, cost)) = snap.unauthenticated {
        batch.extend(unauthenticated(snap, li, cost, ip));
    }
    batch
}

fn unauthenticated(snap: &Snapshot, li: u16, cost: u64, ip: IpAddr) -> Option<CheckItem> {
    let limit = &snap.limits[li as usize];
    let numbers = limit.numbers.as_ref()?;
    // Room for the longest tag, `rl:{ip:<39 characters>/NNN}:`, and a short limit name.
    let mut name = String::with_capacity(64);
    ip_tag(&mut name, ip, limit.ip_prefixes);
    name.push_str(&limit.name);
    Some(CheckItem::new(
        name.into(),
        Charge {
            params: numbers.params,
            cost,
            shadow: limit.shadow(),
        },
        li,
        limit.policy,
    ))
}

/// An authenticated caller, as the buckets see it: a key of the rules by position, or a JWT.
#[derive(Clone, Copy)]
enum Id<'s> {
    Key(&'s Keys, usize),
    Jwt(&'s JwtCaller),
}

impl<'s> Id<'s> {
    /// What goes inside the hash tag of the caller's buckets.
    fn tenant(self) -> &'s str {
        match self {
            Id::Key(keys, k) => &keys[k].tenant,
            Id::Jwt(j) => &j.tenant,
        }
    }
}

thread_local! {
    /// The buffer bucket names are written in, kept between requests: a name then costs one
    /// allocation, its `Arc<str>`.
    static NAME: Cell<String> = const { Cell::new(String::new()) };
}

/// Asker is asking, as far as the connection and the key tell.
struct Asker<'s> {
    key: Option<Id<'s>>,
    ip: IpAddr,
    fingerprint: Fingerprint,
}

fn item_for(
    limit: &Limit,
    idx: usize,
    who: &Asker<'_>,
    route: &Route,
    headers: &HeaderMap,
    body_value: Option<&[u8]>,
    cost: u64,
) -> Result<Option<CheckItem>, PlanError> {
    let (key, ip) = (who.key, who.ip);
    let numbers = match key {
        Some(Id::Key(keys, k)) => keys.numbers(k, limit, idx),
        Some(Id::Jwt(j)) => limit.jwt_numbers(j),
        None => limit.numbers.as_ref(),
    };
    let Some(numbers) = numbers else {
        // A key limit without a key, or without numbers for this caller: nothing to pay.
        return Ok(None);
    };
    let charge = Charge {
        params: numbers.params,
        cost,
        shadow: limit.shadow(),
    };
    // Taken out for this name and put back once it is copied; an early return (an error)
    // leaves a new one for the next.
    let mut name = NAME.take();
    name.clear();
    let tenant = key.map(Id::tenant);
    match (&limit.dimension, key) {
        // A JWT's tenant bucket is named as an API key's of the same tenant, so both pay one
        // bucket. Written per request rather than kept per key: kept, the names were a third
        // of a key's memory, where writing one is a few bytes and one allocation.
        (Dimension::Key, Some(k)) => {
            tenant_prefix(&mut name, k.tenant(), &limit.name);
        }
        (Dimension::Key, None) => return Ok(None),
        (Dimension::Claim(c), Some(Id::Jwt(j))) => {
            let Some(value) = j.claim(c) else {
                return Err(PlanError::MissingClaim {
                    limit: limit.name.clone(),
                    claim: c.clone(),
                });
            };
            tagged_value(&mut name, tenant, &limit.name, &value);
        }
        // The rules let only JWT routes charge a claim limit.
        (Dimension::Claim(c), _) => {
            return Err(PlanError::MissingClaim {
                limit: limit.name.clone(),
                claim: c.clone(),
            });
        }
        (Dimension::Route, Some(k)) => {
            tenant_prefix(&mut name, k.tenant(), &limit.name);
            name.push(':');
            push_value(&mut name, route.name.as_bytes());
        }
        (Dimension::Route, None) => {
            ip_tag(&mut name, ip, limit.ip_prefixes);
            name.push_str(&limit.name);
            name.push(':');
            push_value(&mut name, route.name.as_bytes());
        }
        (Dimension::Ip, _) => {
            ip_tag(&mut name, ip, limit.ip_prefixes);
            name.push_str(&limit.name);
        }
        // Its text form needs no escaping: `none`, `unparsed` or hex digits.
        (Dimension::Fingerprint, Some(k)) => {
            tenant_prefix(&mut name, k.tenant(), &limit.name);
            let _ = write!(name, ":{}", who.fingerprint);
        }
        (Dimension::Fingerprint, None) => {
            let _ = write!(name, "rl:{{fp:{}}}:{}", who.fingerprint, limit.name);
        }
        (Dimension::BodyField(f), _) => {
            let Some(value) = body_value.filter(|v| !v.is_empty()) else {
                return Err(PlanError::MissingField {
                    limit: limit.name.clone(),
                    field: f.clone(),
                });
            };
            tagged_value(&mut name, tenant, &limit.name, value);
        }
        (Dimension::Header(h), _) => {
            let mut values = headers.get_all(h).iter();
            let Some(value) = values.next() else {
                return Err(PlanError::MissingHeader {
                    limit: limit.name.clone(),
                    header: h.to_string(),
                });
            };
            if values.next().is_some() || value.is_empty() {
                return Err(PlanError::BadHeader {
                    limit: limit.name.clone(),
                    header: h.to_string(),
                });
            }
            tagged_value(&mut name, tenant, &limit.name, value.as_bytes());
        }
    }
    let item = CheckItem {
        lease: match (&limit.dimension, key) {
            (Dimension::Key, Some(Id::Key(..))) => limit.lease,
            _ => None,
        },
        ..CheckItem::new(Arc::from(name.as_str()), charge, idx as u16, limit.policy)
    };
    NAME.set(name);
    Ok(Some(item))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_cannot_escape_their_tag() {
        let mut s = String::new();
        push_value(&mut s, b"a}b{c:d%e f");
        assert_eq!(s, "a%7Db%7Bc%3Ad%25e%20f");
        let mut long = String::new();
        push_value(&mut long, &[b'x'; 200]);
        assert!(long.starts_with("%sha256=") && long.len() == 8 + 32);
    }

    fn fingerprint_rules(opts: crate::CompileOptions) -> Result<Snapshot, crate::RulesError> {
        crate::compile(
            br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
                "limits": {"clients": {"dimension": "fingerprint", "rate": "20/60s", "burst": 20},
                           "plan": {"dimension": "key", "rate": "10/1s", "burst": 10}},
                "keys": [{"id": "k-7", "tenant": "k7",
                          "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc"}],
                "routes": [{"method": "POST", "path": "/login", "upstream": "u", "key": "optional",
                            "cost": {"clients": 1}},
                           {"method": "GET", "path": "/v1", "upstream": "u", "cost": {"clients": 1, "plan": 1}}]}"#,
            "t.json",
            opts,
        )
    }

    #[test]
    fn fingerprint_buckets_are_per_fingerprint_and_within_a_tenant() {
        let snap = fingerprint_rules(crate::CompileOptions::default()).unwrap();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let other_ip: IpAddr = "198.51.100.7".parse().unwrap();
        let fp: Fingerprint = "0123456789abcdef".parse().unwrap();
        let names = |route: usize, key: Option<usize>, ip: IpAddr, fp: Fingerprint| -> Vec<String> {
            build(&snap, &snap.routes[route], key, ip, fp, &HeaderMap::new(), None)
                .unwrap()
                .iter()
                .map(|i| i.key.to_string())
                .collect()
        };
        let login = snap.routes.iter().position(|r| &*r.prefix == "/login").unwrap();
        let v1 = snap.routes.iter().position(|r| &*r.prefix == "/v1").unwrap();
        assert_eq!(names(login, None, ip, fp), ["rl:{fp:0123456789abcdef}:clients"]);
        assert_eq!(
            names(login, None, ip, fp),
            names(login, None, other_ip, fp),
            "one client from two addresses is one bucket"
        );
        assert_eq!(
            names(login, None, ip, Fingerprint::None),
            ["rl:{fp:none}:clients"]
        );
        assert_eq!(
            names(login, None, ip, Fingerprint::Unparsed),
            ["rl:{fp:unparsed}:clients"]
        );
        assert_eq!(
            names(v1, Some(0), ip, fp),
            ["rl:{k7}:clients:0123456789abcdef", "rl:{k7}:plan"],
            "with a key, within the tenant's tag"
        );
    }

    #[test]
    fn a_usage_route_peeks_at_the_key_buckets_it_does_not_charge() {
        let snap = crate::compile(
            br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
                "limits": {"plan": {"dimension": "key"},
                           "usage": {"dimension": "key", "rate": "1/1s", "burst": 5},
                           "tokens": {"dimension": "key", "rate": "1000/60s", "burst": 1000},
                           "watch": {"dimension": "key", "rate": "1/1s", "burst": 1, "mode": "shadow"},
                           "seats": {"dimension": "key", "concurrent": 2},
                           "exports": {"dimension": "route", "rate": "1/5s", "burst": 1},
                           "jwt_only": {"dimension": "key", "plans": {"free": {"rate": "1/1s", "burst": 1}}}},
                "keys": [{"id": "k-7", "tenant": "k7", "limits": {"plan": {"rate": "600/60s", "burst": 20}},
                          "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc"}],
                "routes": [{"method": "GET", "path": "/v1/usage", "serve": "usage", "cost": {"usage": 1}},
                           {"method": "GET", "path": "/v1", "upstream": "u", "cost": {"plan": 1, "exports": 1}}]}"#,
            "t.json",
            crate::CompileOptions::default(),
        )
        .unwrap();
        let usage = snap
            .routes
            .iter()
            .position(|r| &*r.prefix == "/v1/usage")
            .unwrap();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let peeks = key_peeks(&snap, &snap.routes[usage], 0, ip);
        let read: Vec<(String, u64)> = peeks.iter().map(|i| (i.key.to_string(), i.charge.cost)).collect();
        let mut want = vec![("rl:{k7}:plan".to_string(), 0), ("rl:{k7}:tokens".to_string(), 0)];
        want.sort_by_key(|(name, _)| snap.limits.iter().position(|l| name.ends_with(&*l.name)));
        assert_eq!(read, want);
        // Each names the bucket a request paying it names.
        let v1 = snap.routes.iter().position(|r| &*r.prefix == "/v1").unwrap();
        let paid = build(
            &snap,
            &snap.routes[v1],
            Some(0),
            ip,
            Fingerprint::None,
            &HeaderMap::new(),
            None,
        )
        .unwrap();
        let plan = peeks.iter().find(|i| i.key.ends_with(":plan")).unwrap();
        let charged = paid.iter().find(|i| i.key.ends_with(":plan")).unwrap();
        assert_eq!(
            (&plan.key, plan.fp, plan.charge.params),
            (&charged.key, charged.fp, charged.charge.params)
        );
    }

    #[test]
    fn a_route_over_two_hash_tags_compiles() {
        // On a cluster the store checks the two tags slot by slot (tollgate_store::slots).
        let text = br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
            "limits": {"clients": {"dimension": "fingerprint", "rate": "20/60s", "burst": 20},
                       "account": {"dimension": {"header": "X-Account"}, "rate": "5/60s", "burst": 5}},
            "routes": [{"method": "POST", "path": "/login", "upstream": "u", "key": "optional",
                        "cost": {"clients": 1, "account": 1}}]}"#;
        let snap = crate::compile(text, "t.json", crate::CompileOptions::default()).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-account", "ann".parse().unwrap());
        let fp = Fingerprint::None;
        let names: Vec<String> = build(
            &snap,
            &snap.routes[0],
            None,
            "203.0.113.9".parse().unwrap(),
            fp,
            &headers,
            None,
        )
        .unwrap()
        .iter()
        .map(|i| i.key.to_string())
        .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().any(|n| n.starts_with("rl:{fp:none}")), "{names:?}");
        assert!(!names.iter().all(|n| n.starts_with("rl:{fp:none}")), "{names:?}");
    }

    /// Rules with per-IP limits: `unauth` (the unauthenticated bucket), `per-ip` and `paths`
    /// (route) with the extra fields given, on an optional-key route.
    fn ip_rules(extra: &str, opts: crate::CompileOptions) -> Result<Snapshot, crate::RulesError> {
        let text = format!(
            r#"{{"version": 1, "upstreams": {{"u": {{"url": "http://127.0.0.1:9"}}}},
                "limits": {{"unauth": {{"dimension": "ip", "rate": "5/60s", "burst": 5}},
                           "per-ip": {{"dimension": "ip", "rate": "5/60s", "burst": 5{extra}}},
                           "paths": {{"dimension": "route", "rate": "5/60s", "burst": 5{extra}}}}},
                "unauthenticated": {{"limit": "unauth", "cost": 1}},
                "routes": [{{"method": "GET", "path": "/p", "upstream": "u", "key": "optional",
                            "cost": {{"per-ip": 1, "paths": 1}}}}]}}"#
        );
        crate::compile(text.as_bytes(), "t.json", opts)
    }

    fn anonymous_names(snap: &Snapshot, ip: &str) -> Vec<String> {
        build(
            snap,
            &snap.routes[0],
            None,
            ip.parse().unwrap(),
            Fingerprint::None,
            &HeaderMap::new(),
            None,
        )
        .unwrap()
        .iter()
        .map(|i| i.key.to_string())
        .collect()
    }

    #[test]
    fn ipv6_clients_share_the_buckets_of_their_slash_64() {
        let snap = ip_rules("", crate::CompileOptions::default()).unwrap();
        let names = anonymous_names(&snap, "2001:db8:1:2:aaaa::7");
        assert_eq!(
            names,
            [
                "rl:{ip:2001:db8:1:2::/64}:paths:GET%20/p",
                "rl:{ip:2001:db8:1:2::/64}:per-ip",
                "rl:{ip:2001:db8:1:2::/64}:unauth"
            ]
        );
        assert_eq!(names, anonymous_names(&snap, "2001:db8:1:2:ffff:ffff:ffff:ffff"));
        assert_ne!(names, anonymous_names(&snap, "2001:db8:1:3::7"));
        // IPv4, and IPv4 mapped into IPv6, keep the names per address they had.
        assert_eq!(
            anonymous_names(&snap, "203.0.113.9")[1],
            "rl:{ip:203.0.113.9}:per-ip"
        );
        assert_eq!(
            anonymous_names(&snap, "::ffff:203.0.113.9"),
            anonymous_names(&snap, "203.0.113.9")
        );
        assert_eq!(
            unauthenticated_only(&snap, "2001:db8:1:2::9".parse().unwrap())
                .iter()
                .map(|i| i.key.to_string())
                .collect::<Vec<_>>(),
            ["rl:{ip:2001:db8:1:2::/64}:unauth"]
        );
    }

    #[test]
    fn a_limit_sets_its_own_prefixes() {
        let snap = ip_rules(
            r#", "ipv4_prefix": 16, "ipv6_prefix": 48"#,
            crate::CompileOptions::default(),
        )
        .unwrap();
        let names = anonymous_names(&snap, "10.1.200.7");
        assert_eq!(
            names,
            [
                "rl:{ip:10.1.0.0/16}:paths:GET%20/p",
                "rl:{ip:10.1.0.0/16}:per-ip",
                // The unauthenticated limit keeps its defaults.
                "rl:{ip:10.1.200.7}:unauth"
            ]
        );
        assert_eq!(
            anonymous_names(&snap, "2001:db8:1:2::7")[1],
            "rl:{ip:2001:db8:1::/48}:per-ip"
        );
        let full = ip_rules(r#", "ipv6_prefix": 128"#, crate::CompileOptions::default()).unwrap();
        assert_eq!(
            anonymous_names(&full, "2001:db8:1:2::7")[1],
            "rl:{ip:2001:db8:1:2::7}:per-ip",
            "a full-length prefix keeps the name per address"
        );
    }

    #[test]
    fn prefixes_out_of_range_or_on_other_limits_are_refused() {
        let opts = crate::CompileOptions::default();
        for (extra, field, says) in [
            (
                r#", "ipv6_prefix": 129"#,
                "limits.paths.ipv6_prefix",
                "129 is not a prefix length: use 0 to 128",
            ),
            (
                r#", "ipv4_prefix": 33"#,
                "limits.paths.ipv4_prefix",
                "33 is not a prefix length: use 0 to 32",
            ),
            (
                r#", "ipv6_prefix": 300"#,
                "limits.paths.ipv6_prefix",
                "300 is not a prefix length",
            ),
        ] {
            let e = ip_rules(extra, opts).unwrap_err();
            assert_eq!(e.file, "t.json");
            assert_eq!(e.field, field, "{e}");
            assert!(e.reason.contains(says), "{e}");
        }
        // Read in file order, where `per-ip` comes first.
        let e = ip_rules(r#", "ipv6_prefix": -1"#, opts).unwrap_err();
        assert_eq!(e.field, "limits.per-ip.ipv6_prefix", "{e}");
        ip_rules(r#", "ipv4_prefix": 0, "ipv6_prefix": 0"#, opts).expect("0: one bucket for all");
        let text = br#"{"version": 1, "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
            "limits": {"plan": {"dimension": "key", "rate": "5/60s", "burst": 5, "ipv6_prefix": 56}},
            "routes": [{"method": "GET", "path": "/p", "upstream": "u", "cost": {"plan": 1}}]}"#;
        let e = crate::compile(text, "t.json", opts).unwrap_err();
        assert_eq!(e.field, "limits.plan.ipv6_prefix", "{e}");
        assert!(e.reason.contains("only a limit with per-IP buckets"), "{e}");
    }

    #[test]
    fn per_ip_limits_on_different_prefixes_are_two_tags() {
        let snap = ip_rules(r#", "ipv6_prefix": 48"#, crate::CompileOptions::default()).unwrap();
        let names = anonymous_names(&snap, "2001:db8:1:2:aaaa::7");
        assert_eq!(
            names,
            [
                "rl:{ip:2001:db8:1::/48}:paths:GET%20/p",
                "rl:{ip:2001:db8:1::/48}:per-ip",
                "rl:{ip:2001:db8:1:2::/64}:unauth"
            ]
        );
    }

    #[test]
    fn a_wrong_dimension_is_named_with_the_choices() {
        let with = |dim: &str| {
            let text = format!(
                r#"{{"version": 1, "upstreams": {{"u": {{"url": "http://127.0.0.1:9"}}}},
                    "limits": {{"l": {{"dimension": {dim}, "rate": "1/1s", "burst": 1}}}},
                    "routes": [{{"method": "GET", "path": "/", "upstream": "u", "cost": {{"l": 1}}}}]}}"#
            );
            crate::compile(text.as_bytes(), "t.json", crate::CompileOptions::default())
        };
        let snap = with(r#""fingerprint""#).unwrap();
        assert_eq!(snap.limits[0].dimension, Dimension::Fingerprint);
        for (dim, says) in [
            (
                r#""fingerprnt""#,
                r#""fingerprnt" is not a dimension; use "key", "route", "ip", "fingerprint""#,
            ),
            (
                r#"{"fingerprint": true}"#,
                r#"the fingerprint dimension takes no settings: write "fingerprint""#,
            ),
            (
                r#"{"header": 7}"#,
                r#"{"header": ...} takes the header's name as a string"#,
            ),
            (r#"{"header": "a", "body_field": "b"}"#, "is not a dimension"),
            ("42", "42 is not a dimension"),
        ] {
            let e = with(dim).unwrap_err();
            assert_eq!(e.field, "limits.l.dimension", "{e}");
            assert!(e.reason.contains(says), "{dim}: {e}");
        }
    }
}
