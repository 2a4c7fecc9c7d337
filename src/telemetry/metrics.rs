//! Prometheus metrics, one registry per gateway (no globals, so tests in one process never mix
//! counts). Labels are low-cardinality: routes, limits, upstreams and outcomes, never API keys
//! or client addresses. Label values are shared `Arc<str>`s, so counting allocates nothing.

use std::sync::Arc;

use tollgate_limit::decision::Decision;

/// A check's result as the metrics name it, in `Decision`'s order.
const DECISIONS: [&str; 3] = ["admitted", "limited", "unavailable"];
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// How many access lines the process's log writer has dropped so far: set once by the binary
/// that owns the writer (the writer is the logging setup's, not the gateway's).
pub static ACCESS_LINES_DROPPED: std::sync::OnceLock<Box<dyn Fn() -> u64 + Send + Sync>> =
    std::sync::OnceLock::new();

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteStatus {
    pub route: Arc<str>,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitDecision {
    pub limit: Arc<str>,
    /// `admitted`, `limited` or `unavailable` (the words of `limit::decision::Decision`).
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    pub limit: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitPolicy {
    pub limit: Arc<str>,
    pub policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Kind {
    pub kind: &'static str,
}

/// Which serving shard (thread) accepted a connection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabel {
    pub shard: u32,
}

/// Which connection cap acted: `max_connections` or `max_connections_per_ip`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CapLabel {
    pub cap: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub upstream: Arc<str>,
}

/// Every metric the gateway keeps.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RouteStatus, Counter>,
    pub decisions: Family<LimitDecision, Counter>,
    pub shadow_refusals: Family<LimitLabel, Counter>,
    pub store_check_seconds: Histogram,
    pub store_errors: Family<Kind, Counter>,
    pub breaker_open: Gauge,
    pub store_bypass: Family<LimitPolicy, Counter>,
    /// Changes after a check the guard made (refunds of undelivered requests, post-paid
    /// charges), by where they went (`store`, `local`).
    pub store_refunds: Family<Kind, Counter>,
    /// Refunds that were lost, by why (`error`, `timeout`, `breaker_open`).
    pub store_refund_failures: Family<Kind, Counter>,
    pub rules_version: Gauge,
    pub rules_reloads: Family<ResultLabel, Counter>,
    /// Changes made through the admin API's key endpoints, by action.
    pub admin_changes: Family<ActionLabel, Counter>,
    pub upstream_seconds: Family<UpstreamLabel, Histogram>,
    pub in_flight: Gauge,
    /// Per upstream: the limit on requests in flight (adaptive, under the static cap; the cap
    /// alone when not adaptive), the requests holding a place, and those shed for want of one.
    pub upstream_concurrency_limit: Family<UpstreamLabel, Gauge>,
    pub upstream_in_flight: Family<UpstreamLabel, Gauge>,
    pub upstream_shed: Family<UpstreamLabel, Counter>,
    pub upstream_strays: Family<UpstreamLabel, Counter>,
    /// Lease-script calls, `kind` = `lease` or `give_back`, answered or not.
    pub lease_calls: Family<Kind, Counter>,
    pub lease_grants: Counter,
    pub lease_denials: Counter,
    /// Lease-script calls that failed or timed out, by `kind`.
    pub lease_failures: Family<Kind, Counter>,
    pub lease_tokens_granted: Counter,
    pub lease_tokens_returned: Counter,
    pub lease_tokens_held: Gauge,
    /// Request spans dropped because the OTLP export queue was full.
    pub otlp_spans_dropped: Counter,
    /// Access lines dropped because the log writer fell behind; brought up to date from
    /// [`ACCESS_LINES_DROPPED`] at each render.
    access_lines_dropped: Counter,
    access_sync: std::sync::Mutex<()>,
    /// Client connections closed at accept: a cap was full with none idle.
    pub connections_refused: Family<CapLabel, Counter>,
    /// Idle client connections closed to make room for a new one.
    pub connections_evicted: Family<CapLabel, Counter>,
    /// Client connections open, and of them idle, when a connection cap is set.
    pub connections_open: Gauge,
    pub connections_idle: Gauge,
    /// Client connections accepted, by the shard that accepted them: how the kernel spreads
    /// them over the shards' listeners.
    pub connections_accepted: Family<ShardLabel, Counter>,
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 27 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("tollgate");
        let requests = Family::<RouteStatus, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by route and status",
            requests.clone(),
        );
        let decisions = Family::<LimitDecision, Counter>::default();
        registry.register(
            "limit_decisions",
            "Requests admitted, limited (429) or unavailable (503, a failure policy refused), by the limit that decided",
            decisions.clone(),
        );
        let shadow_refusals = Family::<LimitLabel, Counter>::default();
        registry.register(
            "shadow_would_refuse",
            "Requests a shadow-mode limit would have refused",
            shadow_refusals.clone(),
        );
        let store_check_seconds = latency_histogram();
        registry.register(
            "store_check_seconds",
            "Time of one limiter store check",
            store_check_seconds.clone(),
        );
        let store_errors = Family::<Kind, Counter>::default();
        registry.register(
            "store_errors",
            "Limiter store failures, by kind",
            store_errors.clone(),
        );
        let breaker_open = Gauge::default();
        registry.register(
            "store_breaker_open",
            "Breakers open in front of the limiter store: 1 or 0, or on a cluster the hash slots whose breaker is open",
            breaker_open.clone(),
        );
        let store_bypass = Family::<LimitPolicy, Counter>::default();
        registry.register(
            "store_bypass",
            "Decisions made without the store, by limit and failure policy",
            store_bypass.clone(),
        );
        let store_refunds = Family::<Kind, Counter>::default();
        registry.register(
            "store_refunds",
            "Changes to admitted requests' buckets after their check (refunds of undelivered requests, post-paid charges), by where they went (store, local)",
            store_refunds.clone(),
        );
        let store_refund_failures = Family::<Kind, Counter>::default();
        registry.register(
            "store_refund_failures",
            "Refunds lost (the charge stands), by kind (error, timeout, breaker_open)",
            store_refund_failures.clone(),
        );
        let rules_version = Gauge::default();
        registry.register(
            "rules_version",
            "Version of the running rules",
            rules_version.clone(),
        );
        let rules_reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "rules_reloads",
            "Rules reloads, by result (ok, ignored, failed)",
            rules_reloads.clone(),
        );
        let admin_changes = Family::<ActionLabel, Counter>::default();
        registry.register(
            "admin_changes",
            "Changes through the admin API's key endpoints, by action (create, rotate, revoke, patch)",
            admin_changes.clone(),
        );
        let upstream_seconds =
            Family::<UpstreamLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "upstream_seconds",
            "Time until an upstream's response headers",
            upstream_seconds.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("in_flight_requests", "Requests being served", in_flight.clone());
        let upstream_concurrency_limit = Family::<UpstreamLabel, Gauge>::default();
        registry.register(
            "upstream_concurrency_limit",
            "Requests that may be in flight to an upstream now: its adaptive limit under max_in_flight",
            upstream_concurrency_limit.clone(),
        );
        let upstream_in_flight = Family::<UpstreamLabel, Gauge>::default();
        registry.register(
            "upstream_in_flight",
            "Requests forwarded to an upstream whose response has not ended",
            upstream_in_flight.clone(),
        );
        let upstream_shed = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_shed",
            "Requests answered 503 upstream_overloaded: no place under the upstream's limit",
            upstream_shed.clone(),
        );
        let upstream_strays = Family::<UpstreamLabel, Counter>::default();
        registry.register(
            "upstream_strays",
            "Times an upstream was caught sending a response nobody asked for; its connections then carry one request each for a minute",
            upstream_strays.clone(),
        );
        let lease_calls = Family::<Kind, Counter>::default();
        registry.register(
            "lease_calls",
            "Calls to the store's lease script, by kind (lease, give_back)",
            lease_calls.clone(),
        );
        let lease_grants = Counter::default();
        registry.register(
            "lease_grants",
            "Leases that granted a whole block",
            lease_grants.clone(),
        );
        let lease_denials = Counter::default();
        registry.register(
            "lease_denials",
            "Leases that granted nothing (the bucket held less than a block)",
            lease_denials.clone(),
        );
        let lease_failures = Family::<Kind, Counter>::default();
        registry.register(
            "lease_failures",
            "Lease-script calls that failed or timed out, by kind (lease, give_back)",
            lease_failures.clone(),
        );
        let lease_tokens_granted = Counter::default();
        registry.register(
            "lease_tokens_granted",
            "Tokens received in leased blocks",
            lease_tokens_granted.clone(),
        );
        let lease_tokens_returned = Counter::default();
        registry.register(
            "lease_tokens_returned",
            "Leased tokens given back to the store unused (expiry, shutdown, refunds)",
            lease_tokens_returned.clone(),
        );
        let lease_tokens_held = Gauge::default();
        registry.register(
            "lease_tokens_held",
            "Leased tokens this gateway holds now",
            lease_tokens_held.clone(),
        );
        let otlp_spans_dropped = Counter::default();
        registry.register(
            "otlp_spans_dropped",
            "Request spans dropped, not exported, because the OTLP export queue was full",
            otlp_spans_dropped.clone(),
        );
        let access_lines_dropped = Counter::default();
        registry.register(
            "access_lines_dropped",
            "Access lines dropped, not written, because the log writer fell behind",
            access_lines_dropped.clone(),
        );
        let connections_refused = Family::<CapLabel, Counter>::default();
        registry.register(
            "connections_refused",
            "Client connections closed at accept because a cap was full with none idle, by cap",
            connections_refused.clone(),
        );
        let connections_evicted = Family::<CapLabel, Counter>::default();
        registry.register(
            "connections_evicted",
            "Idle client connections closed to make room for a new one, by cap",
            connections_evicted.clone(),
        );
        let connections_open = Gauge::default();
        registry.register(
            "connections_open",
            "Client connections open (kept only when a connection cap is set)",
            connections_open.clone(),
        );
        let connections_idle = Gauge::default();
        registry.register(
            "connections_idle",
            "Client connections open with no request in flight (kept only when a connection cap is set)",
            connections_idle.clone(),
        );
        let connections_accepted = Family::<ShardLabel, Counter>::default();
        registry.register(
            "connections_accepted",
            "Client connections accepted on the public listener, by the shard (thread) that accepted them",
            connections_accepted.clone(),
        );
        Arc::new(Metrics {
            registry,
            requests,
            decisions,
            shadow_refusals,
            store_check_seconds,
            store_errors,
            breaker_open,
            store_bypass,
            store_refunds,
            store_refund_failures,
            rules_version,
            rules_reloads,
            admin_changes,
            upstream_seconds,
            in_flight,
            upstream_concurrency_limit,
            upstream_in_flight,
            upstream_shed,
            upstream_strays,
            lease_calls,
            lease_grants,
            lease_denials,
            lease_failures,
            lease_tokens_granted,
            lease_tokens_returned,
            lease_tokens_held,
            otlp_spans_dropped,
            access_lines_dropped,
            access_sync: std::sync::Mutex::new(()),
            connections_refused,
            connections_evicted,
            connections_open,
            connections_idle,
            connections_accepted,
        })
    }

    /// The exposition text (OpenMetrics, which Prometheus scrapes).
    pub fn render(&self) -> String {
        if let Some(dropped) = ACCESS_LINES_DROPPED.get() {
            // Two scrapes at once must not both add the same difference.
            let _one = self.access_sync.lock().unwrap_or_else(|e| e.into_inner());
            let (now, shown) = (dropped(), self.access_lines_dropped.get());
            if now > shown {
                self.access_lines_dropped.inc_by(now - shown);
            }
        }
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The store check's p50 and p99 in seconds: the upper bound of the histogram bucket each
    /// falls in; `None` before the first check.
    pub fn store_check_quantiles(&self) -> Option<(f64, f64)> {
        quantiles(&self.store_check_seconds, &[0.5, 0.99]).map(|q| (q[0], q[1]))
    }

    /// What a counter of `family` holds for `labels` now; 0 when it was never counted.
    pub fn count<S: Clone + std::hash::Hash + Eq>(family: &Family<S, Counter>, labels: &S) -> u64 {
        family.get(labels).map_or(0, |c| c.get())
    }

    pub fn reload(&self, result: &'static str) {
        self.rules_reloads.get_or_create(&ResultLabel { result }).inc();
    }

    /// One change through the admin API's key endpoints: `create`, `rotate`, `revoke`, `patch`.
    pub fn admin_change(&self, action: &'static str) {
        self.admin_changes.get_or_create(&ActionLabel { action }).inc();
    }
}

/// Quantiles of a histogram from its cumulative buckets. The crate keeps the buckets to itself,
/// so they are read back from its own exposition of this one histogram.
fn quantiles(h: &Histogram, qs: &[f64]) -> Option<Vec<f64>> {
    let mut reg = Registry::default();
    reg.register("h", "", h.clone());
    let mut text = String::new();
    encode(&mut text, &reg).ok()?;
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("h_bucket{le=\"") else {
            continue;
        };
        let (le, n) = rest.split_once("\"}")?;
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        buckets.push((le, n.trim().parse().ok()?));
    }
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    qs.iter()
        .map(|q| {
            let rank = (q * total as f64).ceil().max(1.0) as u64;
            buckets.iter().find(|(_, n)| *n >= rank).map(|(le, _)| *le)
        })
        .collect()
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Statuses with a counter handle kept per route; others go through the family lookup.
const STATUSES: [u16; 14] = [
    200, 201, 202, 204, 304, 400, 401, 404, 413, 429, 500, 502, 503, 504,
];

/// Counter handles resolved once per rules snapshot, so a request's counting is a few atomic
/// adds instead of hashing label sets under a lock. Built lazily for the snapshot it was made
/// for; a reload makes a new one.
pub struct Handles {
    /// The serial of the snapshot these handles belong to (0: none yet).
    pub snapshot: u64,
    routes: Vec<RouteHandles>,
    limits: Vec<LimitHandles>,
    upstreams: Vec<std::sync::OnceLock<Histogram>>,
    route_names: Vec<Arc<str>>,
    limit_names: Vec<Arc<str>>,
    upstream_names: Vec<Arc<str>>,
}

struct RouteHandles {
    by_status: [std::sync::OnceLock<Counter>; STATUSES.len()],
}

#[derive(Default)]
struct LimitHandles {
    /// One counter per [`DECISIONS`] word.
    decided: [std::sync::OnceLock<Counter>; 3],
    shadow: std::sync::OnceLock<Counter>,
}

impl Handles {
    pub fn new(
        snapshot: u64,
        routes: Vec<Arc<str>>,
        limits: Vec<Arc<str>>,
        upstreams: Vec<Arc<str>>,
    ) -> Handles {
        Handles {
            snapshot,
            routes: routes
                .iter()
                .map(|_| RouteHandles {
                    by_status: Default::default(),
                })
                .collect(),
            limits: limits.iter().map(|_| LimitHandles::default()).collect(),
            upstreams: upstreams.iter().map(|_| std::sync::OnceLock::new()).collect(),
            route_names: routes,
            limit_names: limits,
            upstream_names: upstreams,
        }
    }

    /// Counts one answer of route `route` (`None`: no route matched).
    pub fn request(&self, m: &Metrics, route: Option<usize>, none: &Arc<str>, status: u16) {
        let (Some(r), Some(slot)) = (route, STATUSES.iter().position(|s| *s == status)) else {
            let name = route.map_or_else(|| none.clone(), |r| self.route_names[r].clone());
            m.requests
                .get_or_create(&RouteStatus { route: name, status })
                .inc();
            return;
        };
        self.routes[r].by_status[slot]
            .get_or_init(|| {
                m.requests
                    .get_or_create(&RouteStatus {
                        route: self.route_names[r].clone(),
                        status,
                    })
                    .clone()
            })
            .inc();
    }

    pub fn decision(&self, m: &Metrics, limit: usize, decision: &Decision) {
        let word = match decision {
            Decision::Admitted(_) => 0,
            Decision::Limited(..) => 1,
            Decision::Unavailable(_) => 2,
        };
        let h = &self.limits[limit];
        let decision = DECISIONS[word];
        h.decided[word]
            .get_or_init(|| {
                m.decisions
                    .get_or_create(&LimitDecision {
                        limit: self.limit_names[limit].clone(),
                        decision,
                    })
                    .clone()
            })
            .inc();
    }

    pub fn shadow(&self, m: &Metrics, limit: usize) {
        self.limits[limit]
            .shadow
            .get_or_init(|| {
                m.shadow_refusals
                    .get_or_create(&LimitLabel {
                        limit: self.limit_names[limit].clone(),
                    })
                    .clone()
            })
            .inc();
    }

    pub fn upstream(&self, m: &Metrics, upstream: usize, took: Duration) {
        self.upstreams[upstream]
            .get_or_init(|| {
                m.upstream_seconds
                    .get_or_create(&UpstreamLabel {
                        upstream: self.upstream_names[upstream].clone(),
                    })
                    .clone()
            })
            .observe(took.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_buckets() {
        let m = Metrics::new();
        assert_eq!(m.store_check_quantiles(), None);
        for _ in 0..98 {
            m.store_check_seconds.observe(0.000_07);
        }
        m.store_check_seconds.observe(0.003);
        m.store_check_seconds.observe(0.003);
        let (p50, p99) = m.store_check_quantiles().unwrap();
        // Buckets are 50 µs × 2^k: 70 µs falls under 100 µs, 3 ms under 3.2 ms.
        assert!((p50 - 0.000_1).abs() < 1e-12, "{p50}");
        assert!((p99 - 0.003_2).abs() < 1e-12, "{p99}");
    }
}
