//! The live dashboard on the admin listener: the page at `/admin/` (its script and the vendored
//! uPlot served from the binary) and the JSON it polls, `/admin/api/overview`. Everything on it
//! comes from counters the gateway keeps anyway (and the upstream targets' state, read as the
//! admin API reads it); a sampler reads the counters once a second into five minutes of
//! history, so an open page adds no work to any request.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use serde_json::{Value, json};
use tokio::sync::watch;

use tollgate_meter::counter::Meter;
use tollgate_rules::Snapshot;
use tollgate_telemetry::metrics::{LimitDecision, LimitLabel, LimitPolicy, Metrics, RouteStatus};

use crate::regions::Regions;
use crate::reload::Reloader;

/// Seconds of history a chart shows.
const SECONDS: usize = 300;
/// How many keys each "hottest" list shows.
const TOP: usize = 10;

pub(crate) const INDEX_HTML: &str = include_str!("index.html");
pub(crate) const APP_JS: &str = include_str!("app.js");
pub(crate) const FAVICON: &str = include_str!("favicon.svg");
pub(crate) const UPLOT_JS: &str = include_str!("vendor/uplot/uPlot.iife.min.js");
pub(crate) const UPLOT_CSS: &str = include_str!("vendor/uplot/uPlot.min.css");

/// Requests refused per key id, counted on each 429 (never per admitted request).
#[derive(Default)]
pub(crate) struct KeyCounts {
    counts: Mutex<HashMap<Arc<str>, u64>>,
}

impl KeyCounts {
    pub fn add(&self, key: &Arc<str>) {
        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        match c.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                c.insert(key.clone(), 1);
            }
        }
    }

    fn top(&self, n: usize) -> Vec<(Arc<str>, u64)> {
        let c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        top(c.iter().map(|(k, v)| (k.clone(), *v)).collect(), n)
    }
}

fn top(mut all: Vec<(Arc<str>, u64)>, n: usize) -> Vec<(Arc<str>, u64)> {
    all.retain(|(_, v)| *v > 0);
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(n);
    all
}

/// One limit's requests per second, oldest first.
#[derive(Default, Clone)]
struct Series {
    admitted: VecDeque<u64>,
    limited: VecDeque<u64>,
    shadow: VecDeque<u64>,
}

impl Series {
    fn push(&mut self, a: u64, l: u64, s: u64) {
        for (q, v) in [
            (&mut self.admitted, a),
            (&mut self.limited, l),
            (&mut self.shadow, s),
        ] {
            q.push_back(v);
            while q.len() > SECONDS {
                q.pop_front();
            }
        }
    }
}

#[derive(Default)]
struct History {
    /// When the newest sample was taken, Unix ms.
    at_ms: u64,
    /// Samples taken so far, at most `SECONDS`.
    len: usize,
    limits: BTreeMap<Arc<str>, Series>,
    /// Each limit's counters at the last sample: (admitted, limited, shadow).
    last: HashMap<Arc<str>, (u64, u64, u64)>,
}

/// The dashboard's state: the sampled history and the refusals per key.
#[derive(Default)]
pub(crate) struct Dashboard {
    history: Mutex<History>,
    pub refused: KeyCounts,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Dashboard {
    pub fn new() -> Arc<Dashboard> {
        Arc::new(Dashboard::default())
    }

    /// Reads every limit's counters and appends one second of history.
    pub fn sample(&self, snap: &Snapshot, metrics: &Metrics, now_ms: u64) {
        let mut h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        let len = h.len;
        for l in &snap.limits {
            let read = |decision: &'static str| {
                Metrics::count(
                    &metrics.decisions,
                    &LimitDecision {
                        limit: l.name.clone(),
                        decision,
                    },
                )
            };
            let now = (
                read("admitted"),
                read("limited"),
                Metrics::count(
                    &metrics.shadow_refusals,
                    &LimitLabel {
                        limit: l.name.clone(),
                    },
                ),
            );
            // The first sample of a limit has nothing to subtract: it counts from here.
            let before = h.last.insert(l.name.clone(), now).unwrap_or(now);
            let series = h.limits.entry(l.name.clone()).or_insert_with(|| {
                let mut s = Series::default();
                for _ in 0..len {
                    s.push(0, 0, 0);
                }
                s
            });
            series.push(
                now.0.saturating_sub(before.0),
                now.1.saturating_sub(before.1),
                now.2.saturating_sub(before.2),
            );
        }
        // A limit gone from the rules stays on the chart until its history scrolls away.
        let names: Vec<Arc<str>> = snap.limits.iter().map(|l| l.name.clone()).collect();
        h.limits.retain(|name, s| {
            if !names.contains(name) {
                s.push(0, 0, 0);
            }
            names.contains(name)
                || s.admitted
                    .iter()
                    .chain(&s.limited)
                    .chain(&s.shadow)
                    .any(|v| *v > 0)
        });
        h.len = (len + 1).min(SECONDS);
        h.at_ms = now_ms;
    }

    /// Samples once a second until stopped.
    pub async fn run(
        self: Arc<Self>,
        rules: Arc<ArcSwap<Snapshot>>,
        metrics: Arc<Metrics>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            self.sample(&rules.load(), &metrics, unix_ms(SystemTime::now()));
        }
    }

    /// `GET /admin/api/overview`.
    pub(crate) async fn overview(&self, v: View<'_>) -> Value {
        let snap = v.rules.load();
        let (history, at_ms, len) = {
            let h = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            let limits: Vec<Value> = h
                .limits
                .iter()
                .map(|(name, s)| {
                    json!({
                        "name": &**name,
                        "admitted": s.admitted,
                        "limited": s.limited,
                        "shadow": s.shadow,
                    })
                })
                .collect();
            (limits, h.at_ms, h.len)
        };
        let m = v.metrics;
        let rejected = v
            .reloader
            .last_rejected()
            .map(|r| json!({"at_unix_ms": unix_ms(r.at), "error": r.why}));
        let bypass: BTreeMap<&str, u64> = ["local", "open", "closed"]
            .iter()
            .map(|&policy| {
                let n: u64 = snap
                    .limits
                    .iter()
                    .map(|l| {
                        Metrics::count(
                            &m.store_bypass,
                            &LimitPolicy {
                                limit: l.name.clone(),
                                policy,
                            },
                        )
                    })
                    .sum();
                (policy, n)
            })
            .collect();
        let (p50, p99) = m
            .store_check_quantiles()
            .map_or((None, None), |(a, b)| (Some(a * 1e3), Some(b * 1e3)));
        let admitted_keys = v.meter.map(|m| top(m.totals(), TOP));
        let upstreams: Vec<Value> = v
            .upstreams
            .iter()
            .map(|u| {
                let status = |s: u16| -> u64 {
                    snap.routes
                        .iter()
                        .filter(|r| {
                            matches!(r.serves, tollgate_rules::Serves::Upstream(i) if *snap.upstreams[i].name == *u.name)
                        })
                        .map(|r| {
                            Metrics::count(
                                &m.requests,
                                &RouteStatus {
                                    route: r.name.clone(),
                                    status: s,
                                },
                            )
                        })
                        .sum()
                };
                json!({
                    "name": &*u.name,
                    "in_flight": u.in_flight,
                    "limit": u.limit,
                    "adaptive": u.adaptive,
                    "bad_gateway": status(502),
                    "gateway_timeout": status(504),
                    "balance": u.balance,
                    "targets": u.targets,
                })
            })
            .collect();
        let regions = match v.regions {
            Some(r) => Some(r.describe(unix_ms(SystemTime::now())).await),
            None => None,
        };
        json!({
            "now_unix_ms": unix_ms(SystemTime::now()),
            "rules": {
                "version": snap.version,
                "digest": format!("sha256:{}", snap.digest),
                "source": snap.source,
                "loaded_at_unix_ms": unix_ms(snap.loaded_at),
                "last_rejected": rejected,
            },
            "history": {"seconds": len, "newest_unix_ms": at_ms, "limits": history},
            "store": {
                "kind": v.store_kind,
                "check_p50_ms": p50,
                "check_p99_ms": p99,
                "breaker": if m.breaker_open.get() > 0 { "open" } else { "closed" },
                "bypass": bypass,
            },
            "keys": {
                "admitted": admitted_keys.map(|k| pairs(&k)),
                "refused": pairs(&self.refused.top(TOP)),
            },
            "leases": {
                "tokens_held": m.lease_tokens_held.get(),
                "grants": m.lease_grants.get(),
                "denials": m.lease_denials.get(),
            },
            "upstreams": upstreams,
            "regions": regions,
        })
    }
}

fn pairs(k: &[(Arc<str>, u64)]) -> Vec<Value> {
    k.iter()
        .map(|(id, n)| json!({"key": &**id, "count": n}))
        .collect()
}

/// An upstream as the dashboard shows it; in flight is counted only under a limit.
pub(crate) struct UpstreamNow {
    pub name: Arc<str>,
    pub in_flight: Option<u32>,
    /// The adaptive limit now (under the static cap), or the static cap.
    pub limit: Option<u32>,
    pub adaptive: bool,
    /// `least_request`, `round_robin` or `hash`.
    pub balance: &'static str,
    /// Each target as `GET /admin/upstreams` lists it: the page shows the same state.
    pub targets: Vec<Value>,
}

/// What the overview reads: the gateway's counters as plain values, not the gateway itself.
pub(crate) struct View<'a> {
    pub rules: &'a ArcSwap<Snapshot>,
    pub reloader: &'a Reloader,
    pub metrics: &'a Metrics,
    pub store_kind: &'static str,
    pub meter: Option<&'a Meter>,
    /// Each upstream of the running rules, as its gate stands now.
    pub upstreams: Vec<UpstreamNow>,
    pub regions: Option<&'a Regions>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_keys_are_sorted_and_cut() {
        let k = KeyCounts::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("k-a"), Arc::from("k-b"));
        for _ in 0..3 {
            k.add(&b);
        }
        k.add(&a);
        let t = k.top(1);
        assert_eq!(t, vec![(b, 3)]);
    }
}
