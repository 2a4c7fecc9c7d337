//! Replays a trace against a real rules file: route match, the key's limits, `rules::plan`'s
//! batch and one all-or-nothing `MemoryStore::check_at` per row, read by `limit::decision`,
//! the same path a request takes through the gateway.
//!
//! Under `local` and `shares` every bucket of the batch is renamed per gateway (and, for
//! shares, given rate r/N and burst max(1, b/N)), so each gateway keeps its own copy of every
//! limit, as a fleet without a shared store would.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use http::{HeaderMap, Method};

use super::algorithms::{Verdict, share};
use super::{Design, RowError};
use tollgate_limit::batch::{Batch, Outcome};
use tollgate_limit::bucket::{BucketParams, Rate};
use tollgate_limit::clock::ManualClock;
use tollgate_limit::decision::decide;
use tollgate_rules::plan;
use tollgate_rules::{Dimension, Fingerprint, Identity, KeyRequirement, Limit, Route, Snapshot};
use tollgate_store::fingerprint;
use tollgate_store::memory::MemoryStore;

pub(crate) struct RulesFleet {
    snap: Arc<Snapshot>,
    store: MemoryStore,
    design: Design,
    gateways: u64,
    headers: HeaderMap,
    /// Per-gateway bucket names: (fingerprint, gateway) → (name, fingerprint).
    renamed: HashMap<(u64, u64), (Arc<str>, u64)>,
    shares: HashMap<BucketParams, BucketParams>,
    pub store_calls: u64,
}

/// A row's caller, as far as the trace tells: its client address and its connection's client
/// fingerprint, each optional.
#[derive(Clone, Copy, Debug, Default)]
pub struct TraceCaller<'a> {
    pub ip: Option<&'a [u8]>,
    pub fingerprint: Option<&'a [u8]>,
}

/// What one row paid: the verdict, and the tokens it paid into its key's rate limit (for
/// the excess statistic; 0 when limited or when the route doesn't charge that limit).
pub struct Paid {
    pub verdict: Verdict,
    pub tokens: u64,
}

impl RulesFleet {
    pub fn new(snap: Arc<Snapshot>, design: Design, gateways: u64) -> RulesFleet {
        RulesFleet {
            snap,
            store: MemoryStore::new(ManualClock::new(0)),
            design,
            gateways,
            headers: HeaderMap::new(),
            renamed: HashMap::new(),
            shares: HashMap::new(),
            store_calls: 0,
        }
    }

    /// The key's id to its index in the rules, or an error listing the known ids.
    pub fn key(&self, id: &str) -> Result<usize, RowError> {
        if id.is_empty() {
            return Err(RowError::new(
                "key",
                "empty; with --rules every row needs the key id from the rules file (rows without a key are not replayed)",
            ));
        }
        self.snap.key_by_id(id).ok_or_else(|| {
            let known: Vec<&str> = self.snap.keys.iter().map(|k| &*k.id).collect();
            RowError::new(
                "key",
                format!(
                    "unknown key id {id:?}; the rules file {} knows {} (use the id, never the secret)",
                    self.snap.source,
                    known.join(", ")
                ),
            )
        })
    }

    /// The limit and rate that the excess statistic of a key follows: its first enforced
    /// key-dimension limit (the plan, in the demo rules).
    pub(crate) fn excess_limit(&self, key: usize) -> Option<(u16, Rate)> {
        self.snap.limits.iter().enumerate().find_map(|(i, l)| {
            if l.dimension != Dimension::Key || l.shadow() {
                return None;
            }
            self.snap
                .keys
                .numbers(key, l, i)
                .map(|n| (i as u16, n.params.rate))
        })
    }

    fn shared(&mut self, p: BucketParams) -> Result<BucketParams, RowError> {
        if let Some(s) = self.shares.get(&p) {
            return Ok(*s);
        }
        let (rate, burst) = share(p.rate, p.burst, self.gateways);
        // A post-paid bucket's debt is shared out as its burst is; a queue waits as long at
        // each share's rate.
        let debt = (p.debt / p.scale).div_ceil(self.gateways);
        let s = BucketParams::new(rate, burst)
            .and_then(|s| match (p.max_wait_us, debt) {
                (0, 0) => Ok(s),
                (0, _) => s.with_debt(debt),
                (w, _) => s.with_delay(w),
            })
            .map_err(|e| {
                RowError::new(
                    "key",
                    format!(
                        "a share of {} burst {} for {} gateways can't be computed exactly: {e}",
                        p.rate, p.burst, self.gateways
                    ),
                )
            })?;
        self.shares.insert(p, s);
        Ok(s)
    }

    /// Checks one row. `excess_limit` is the limit whose tokens are reported back. Without a
    /// `key` the row is an unauthenticated caller's, as [`RulesFleet::check_route`] says.
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &mut self,
        key: Option<usize>,
        method: &[u8],
        path: &[u8],
        who: TraceCaller<'_>,
        gw: u64,
        now: u64,
        excess_limit: Option<u16>,
        cost_after: Option<u64>,
    ) -> Result<Paid, RowError> {
        let (method, path) = request_line(method, path)?;
        let Some(ri) = self.snap.route(&method, path) else {
            return Err(RowError::new(
                "path",
                format!(
                    "no route of {} matches {method} {path}; the gateway would answer 404 without a limit check, so drop such rows",
                    self.snap.source
                ),
            ));
        };
        let route = &self.snap.routes[ri];
        let ip = client_ip(&self.snap, route, who.ip)?;
        let client = client_fingerprint(&self.snap, route, who.fingerprint)?;
        self.check_route(ri, key, ip, client, gw, now, excess_limit, cost_after)
    }

    /// Checks a request already matched to route `ri`. A caller without a key pays what the
    /// gateway makes it pay: the unauthenticated bucket alone where the route needs a key or a
    /// token (the gateway answers 401 after it), else the route's limits as an anonymous caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_route(
        &mut self,
        ri: usize,
        key: Option<usize>,
        ip: IpAddr,
        client: Fingerprint,
        gw: u64,
        now: u64,
        excess_limit: Option<u16>,
        cost_after: Option<u64>,
    ) -> Result<Paid, RowError> {
        let snap = self.snap.clone();
        let route = &snap.routes[ri];
        let mut batch = if key.is_none() && needs_caller(route) {
            plan::unauthenticated_only(&snap, ip)
        } else {
            plan::build(&snap, route, key, ip, client, &self.headers, None).map_err(|e| {
                RowError::new(
                    "path",
                    format!("route {:?}: {e} (traces carry no headers)", route.name),
                )
            })?
        };
        if batch.is_empty() {
            return Ok(Paid {
                verdict: Verdict::ALLOW,
                tokens: 0,
            });
        }
        self.place_for_design(&mut batch, gw)?;
        let outcome = self.store.check_at(&batch, now);
        // The gateway's debit when the answer's head arrives, at the same instant: a replay
        // has no upstream latency.
        let reported = cost_after.filter(|_| outcome.admitted && route.post_paid);
        if let Some(n) = reported {
            self.debit_post_paid(&batch, &outcome, n, now);
        }
        if !outcome.admitted {
            let verdict = Verdict {
                retry_after: decide(&batch, &outcome).retry_after(),
                ..Verdict::refuse(None)
            };
            return Ok(Paid { verdict, tokens: 0 });
        }
        let tokens = excess_limit
            .and_then(|li| batch.iter().find(|i| i.limit == li))
            .map_or(0, |i| {
                match (&snap.limits[i.limit as usize].post_paid, reported) {
                    (Some(_), Some(n)) => n,
                    _ => i.charge.cost,
                }
            });
        Ok(Paid {
            verdict: Verdict::ALLOW,
            tokens,
        })
    }

    /// Points the batch at the buckets the design checks: under `central` the shared ones as
    /// they are; under `local` and `shares` this gateway's own copies.
    fn place_for_design(&mut self, batch: &mut Batch, gw: u64) -> Result<(), RowError> {
        match self.design {
            Design::Central => self.store_calls += 1,
            Design::Local | Design::Shares => {
                for item in batch.iter_mut() {
                    let (name, fp) = self
                        .renamed
                        .entry((item.fp, gw))
                        .or_insert_with(|| {
                            let name: Arc<str> = format!("{}:g{gw}", item.key).into();
                            let fp = fingerprint(&name);
                            (name, fp)
                        })
                        .clone();
                    item.key = name;
                    item.fp = fp;
                    if self.design == Design::Shares {
                        item.charge.params = self.shared(item.charge.params)?;
                    }
                }
            }
            Design::Lease | Design::Edge => unreachable!("rejected when the replay is set up"),
        }
        Ok(())
    }

    /// Debits the `reported` cost of an admitted post-paid row from the buckets it charged.
    fn debit_post_paid(&mut self, batch: &Batch, outcome: &Outcome, reported: u64, now: u64) {
        let units: Vec<i64> = batch
            .iter()
            .zip(&outcome.buckets)
            .map(
                |(item, v)| match &self.snap.limits[item.limit as usize].post_paid {
                    Some(pp) if tollgate_limit::bucket::charged(&item.charge, v, true) => {
                        pp.units(&item.charge.params, reported)
                    }
                    _ => 0,
                },
            )
            .collect();
        if units.iter().any(|u| *u != 0) {
            self.store.adjust_at(batch, &units, now);
        }
    }
}

/// Whether a caller without a key is refused on `route` (401) once the unauthenticated bucket
/// has admitted it: a route that needs a key, or a JWT route (whose callers the log names by a
/// token's claim, never by a key of the rules).
pub(crate) fn needs_caller(route: &Route) -> bool {
    route.key == KeyRequirement::Required || route.identity == Identity::Jwt
}

/// The row's method and path, as the gateway would accept them.
fn request_line<'a>(method: &[u8], path: &'a [u8]) -> Result<(Method, &'a str), RowError> {
    let method = Method::from_bytes(method).map_err(|_| {
        RowError::new(
            "method",
            format!("{:?} is not an HTTP method", String::from_utf8_lossy(method)),
        )
    })?;
    let path = std::str::from_utf8(path).map_err(|_| RowError::new("path", "not UTF-8"))?;
    if !path.starts_with('/') {
        return Err(RowError::new("path", format!("{path:?} must start with '/'")));
    }
    Ok((method, path))
}

/// The first limit of `route` keyed on `dimension`: a row without that column can't be checked.
fn charged_on<'a>(snap: &'a Snapshot, route: &Route, dimension: Dimension) -> Option<&'a Limit> {
    route
        .costs
        .iter()
        .map(|(li, _)| &snap.limits[*li as usize])
        .find(|l| l.dimension == dimension)
}

/// The row's client address; without an ip column, an address nothing reads, unless the
/// route charges a per-IP limit.
fn client_ip(snap: &Snapshot, route: &Route, ip: Option<&[u8]>) -> Result<IpAddr, RowError> {
    if let Some(text) = ip {
        let t = std::str::from_utf8(text).unwrap_or("");
        return t.parse().map_err(|_| {
            RowError::new(
                "ip",
                format!("{:?} is not an IP address", String::from_utf8_lossy(text)),
            )
        });
    }
    if let Some(limit) = charged_on(snap, route, Dimension::Ip) {
        return Err(RowError::new(
            "ip",
            format!(
                "route {:?} charges the per-IP limit {:?}, but the trace has no ip column",
                route.name, limit.name
            ),
        ));
    }
    // Never read: with a key, only per-IP limits use the address.
    Ok(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// The row's client fingerprint; without a fingerprint column, none, unless the route charges
/// a fingerprint limit.
fn client_fingerprint(
    snap: &Snapshot,
    route: &Route,
    fingerprint: Option<&[u8]>,
) -> Result<Fingerprint, RowError> {
    if let Some(text) = fingerprint {
        return std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse::<Fingerprint>().ok())
            .ok_or_else(|| {
                let shown = String::from_utf8_lossy(text);
                let e = tollgate_rules::BadFingerprint(shown.into_owned());
                RowError::new("fingerprint", e.to_string())
            });
    }
    if let Some(limit) = charged_on(snap, route, Dimension::Fingerprint) {
        return Err(RowError::new(
            "fingerprint",
            format!(
                "route {:?} charges the fingerprint limit {:?}, but the trace has no fingerprint column",
                route.name, limit.name
            ),
        ));
    }
    // Never read: no limit of the route keys on it.
    Ok(Fingerprint::None)
}
