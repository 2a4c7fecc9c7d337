//! `tollgate check-rules`: a human summary of a compiled rule set.

use std::fmt::Write as _;

use super::{Dimension, Limit, PostPaid, Snapshot};

/// The networks a limit's per-IP buckets key on: `(IPv4 /32, IPv6 /64)`.
fn prefixes(l: &Limit) -> String {
    format!("(IPv4 /{}, IPv6 /{})", l.ip_prefixes.v4, l.ip_prefixes.v6)
}

/// Version, upstreams, limits with their numbers (and per-key numbers), routes with costs.
pub fn summary(snap: &Snapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: OK, version {} (sha256:{})",
        snap.source, snap.version, snap.digest
    );
    write_upstreams(&mut out, snap);
    write_limits(&mut out, snap);
    let _ = writeln!(out, "keys: {}", snap.keys.len());
    write_routes(&mut out, snap);
    write_callers(&mut out, snap);
    out
}

fn write_upstreams(out: &mut String, snap: &Snapshot) {
    let _ = writeln!(out, "upstreams:");
    for u in &snap.upstreams {
        let _ = writeln!(
            out,
            "  {:<12} {}://{}{}  timeout {} ms{}{}{}",
            &*u.name,
            u.scheme,
            u.authority,
            u.path_prefix,
            u.timeout.as_millis(),
            u.max_in_flight
                .map(|m| format!(", max {m} in flight"))
                .unwrap_or_default(),
            u.adaptive
                .map(|b| format!(", adaptive concurrency {} to {}", b.min, b.max))
                .unwrap_or_default(),
            u.tls
                .as_ref()
                .and_then(|t| t.ca.as_ref())
                .map(|ca| format!(", CA {ca}"))
                .unwrap_or_default()
        );
    }
}

/// Each limit on a line, followed by the numbers that keys and JWT plans set for it.
fn write_limits(out: &mut String, snap: &Snapshot) {
    let _ = writeln!(out, "limits:");
    for (i, l) in snap.limits.iter().enumerate() {
        let _ = writeln!(
            out,
            "  {:<12} {}; {}; {:?}, {:?}, on store failure {:?}{}{}",
            &*l.name,
            numbers(l),
            dimension(l),
            l.mode,
            l.class,
            l.policy,
            l.lease.map(|b| format!(", leased ({b:?})")).unwrap_or_default(),
            l.post_paid.as_ref().map(post_paid).unwrap_or_default()
        );
        write_key_and_plan_numbers(out, snap, i, l);
    }
}

/// The limit's own numbers, when the rule sets them rather than each key.
fn numbers(l: &Limit) -> String {
    match (&l.numbers, &l.concurrent) {
        (_, Some(c)) => format!("{} in flight", c.max),
        (Some(n), _) => format!(
            "{} ({:.3}/s), burst {}",
            n.params.rate,
            n.params.rate.per_second(),
            n.params.burst
        ),
        (None, None) => "numbers set per key".into(),
    }
}

/// Whose buckets the limit keeps.
fn dimension(l: &Limit) -> String {
    match &l.dimension {
        Dimension::Key => "per key".to_string(),
        Dimension::Route => format!(
            "per key and route, or per client IP without a key {}",
            prefixes(l)
        ),
        Dimension::Ip => format!("per client IP {}", prefixes(l)),
        Dimension::Header(h) => format!("per {h} value"),
        Dimension::BodyField(f) => format!("per body field {f:?}"),
        Dimension::Fingerprint => "per client fingerprint".to_string(),
        Dimension::Claim(c) => format!("per value of the JWT claim {c:?}"),
    }
}

fn post_paid(p: &PostPaid) -> String {
    format!(
        ", post-paid from {} (reserve {}, debt down to {})",
        p.header,
        p.reserve,
        p.max_debt
            .map_or_else(|| "one burst".to_string(), |d| format!("-{d}"))
    )
}

/// The numbers keys and JWT plans set for limit `i`, in place of its own.
fn write_key_and_plan_numbers(out: &mut String, snap: &Snapshot, i: usize, l: &Limit) {
    for (ki, k) in snap.keys.iter().enumerate() {
        if let Some(n) = snap.keys.own_numbers(ki, i) {
            let _ = writeln!(
                out,
                "    key {:<8} {} ({:.3}/s), burst {}",
                &*k.id,
                n.params.rate,
                n.params.rate.per_second(),
                n.params.burst
            );
        }
    }
    for (plan, n) in l
        .plans
        .iter()
        .flat_map(|p| p.numbers.iter().map(move |(v, n)| ((&p.claim, v), n)))
    {
        let _ = writeln!(
            out,
            "    JWT {}={:<8} {} ({:.3}/s), burst {}",
            plan.0,
            plan.1,
            n.params.rate,
            n.params.rate.per_second(),
            n.params.burst
        );
    }
}

fn write_routes(out: &mut String, snap: &Snapshot) {
    let _ = writeln!(out, "routes:");
    for r in &snap.routes {
        let costs: Vec<String> = r
            .costs
            .iter()
            .map(|&(li, c)| format!("{} {c}", snap.limits[li as usize].name))
            .collect();
        let upgrade = if r.upgrade.is_empty() {
            String::new()
        } else {
            format!(
                "; upgrades to {}, closed after {} ms idle",
                r.upgrade.join(", "),
                r.idle_timeout.as_millis()
            )
        };
        let _ = writeln!(
            out,
            "  {:<12} {} {} -> {}; {}; costs: {}{}",
            &*r.name,
            r.method.as_ref().map_or("*", |m| m.as_str()),
            r.prefix,
            match r.serves {
                crate::Serves::Upstream(u) => &*snap.upstreams[u].name,
                crate::Serves::Usage => "(the caller's usage)",
            },
            match r.identity {
                crate::Identity::Key => format!("key {:?}", r.key),
                crate::Identity::Jwt => "JWT".to_string(),
            },
            if costs.is_empty() {
                "none".to_string()
            } else {
                costs.join(", ")
            },
            upgrade
        );
    }
}

/// How callers are known: the JWT settings, and what a request without a valid key pays.
fn write_callers(out: &mut String, snap: &Snapshot) {
    if let Some(j) = &snap.jwt {
        let _ = writeln!(
            out,
            "jwt: {} key(s) from {}; iss {:?}, aud {:?}, leeway {} s; key id from {:?}, tenant from {:?}",
            j.keys.len(),
            j.jwks_path,
            j.issuer,
            j.audience,
            j.leeway_s,
            j.key_claim,
            j.tenant_claim.as_deref().unwrap_or(&j.key_claim)
        );
    }
    if let Some((li, c)) = snap.unauthenticated {
        let _ = writeln!(
            out,
            "unauthenticated: {} {c} per request without a valid key",
            snap.limits[li as usize].name
        );
    }
}
