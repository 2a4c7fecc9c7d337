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

/// Why something was refused, in a word.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
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

/// One target of an upstream (`host:port`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    pub upstream: Arc<str>,
    pub target: Arc<str>,
}

/// An attempt on a target and how it went: `ok` (an answer, but 502, 503 and 504),
/// `error_status` (those three), `connect_failure`, `reset` (closed before an answer) or
/// `timeout`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetOutcome {
    pub upstream: Arc<str>,
    pub target: Arc<str>,
    pub outcome: &'static str,
}

/// A retry on another target, by why: `connect_failure`, `reset` or `error_status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryReason {
    pub upstream: Arc<str>,
    pub reason: &'static str,
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
    /// Admin requests refused for a missing or wrong token.
    pub admin_auth_failures: Counter,
    pub upstream_seconds: Family<UpstreamLabel, Histogram>,
    pub in_flight: Gauge,
    /// Per upstream: the limit on requests in flight (adaptive, under the static cap; the cap
    /// alone when not adaptive), the requests holding a place, and those shed for want of one.
    pub upstream_concurrency_limit: Family<UpstreamLabel, Gauge>,
    pub upstream_in_flight: Family<UpstreamLabel, Gauge>,
    pub upstream_shed: Family<UpstreamLabel, Counter>,
    pub upstream_strays: Family<UpstreamLabel, Counter>,
    /// Per target of an upstream: 1 while it may be chosen, 0 while ejected.
    pub upstream_target_up: Family<TargetLabel, Gauge>,
    pub upstream_requests: Family<TargetOutcome, Counter>,
    pub upstream_retries: Family<RetryReason, Counter>,
    pub upstream_ejections: Family<TargetLabel, Counter>,
    pub upstream_retry_budget_exhausted: Counter,
    /// Requests a queueing limit (`"delay"`) admitted to wait for their tokens, and those
    /// waiting now.
    pub queued: Counter,
    pub queue_waiting: Gauge,
    /// Queued requests whose client left before their turn, counted once their tokens are
    /// given back.
    pub queue_left: Counter,
    /// Connections upgraded on a route's `"upgrade"` (WebSocket) open now, and those ended,
    /// by reason: `closed` (by either side), `idle`, `drain`, `not_switched`.
    pub upgraded_open: Gauge,
    pub upgraded_closed: Family<ReasonLabel, Counter>,
    /// Blocks a `block_for` limit started (in shadow mode: would have started), per limit, and
    /// those in force as this gateway knows them (started here, refused by, or listed).
    pub blocks_started: Family<LimitLabel, Counter>,
    pub blocks_in_force: Family<LimitLabel, Gauge>,
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
    /// Client connections closed for their PROXY protocol header (`--proxy-protocol`): one
    /// that breaks the protocol, one from a peer not trusted to send it, one missing.
    pub proxy_protocol_refused: Family<ReasonLabel, Counter>,
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
        let mut metrics = Metrics::unregistered();
        metrics.register_request_families();
        metrics.register_store_families();
        metrics.register_rules_families();
        metrics.register_upstream_families();
        metrics.register_lease_families();
        metrics.register_drop_families();
        metrics.register_connection_families();
        Arc::new(metrics)
    }

    /// Every metric at zero and the registry empty: the `register_*` methods below name each
    /// to the registry, by family, in the order the exposition lists them.
    fn unregistered() -> Metrics {
        Metrics {
            registry: Registry::with_prefix("tollgate"),
            requests: Default::default(),
            decisions: Default::default(),
            shadow_refusals: Default::default(),
            store_check_seconds: latency_histogram(),
            store_errors: Default::default(),
            breaker_open: Default::default(),
            store_bypass: Default::default(),
            store_refunds: Default::default(),
            store_refund_failures: Default::default(),
            rules_version: Default::default(),
            rules_reloads: Default::default(),
            admin_changes: Default::default(),
            admin_auth_failures: Default::default(),
            upstream_seconds: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            in_flight: Default::default(),
            upstream_concurrency_limit: Default::default(),
            upstream_in_flight: Default::default(),
            upstream_shed: Default::default(),
            upstream_strays: Default::default(),
            upstream_target_up: Default::default(),
            upstream_requests: Default::default(),
            upstream_retries: Default::default(),
            upstream_ejections: Default::default(),
            upstream_retry_budget_exhausted: Default::default(),
            queued: Default::default(),
            queue_waiting: Default::default(),
            queue_left: Default::default(),
            upgraded_open: Default::default(),
            upgraded_closed: Default::default(),
            blocks_started: Default::default(),
            blocks_in_force: Default::default(),
            lease_calls: Default::default(),
            lease_grants: Default::default(),
            lease_denials: Default::default(),
            lease_failures: Default::default(),
            lease_tokens_granted: Default::default(),
            lease_tokens_returned: Default::default(),
            lease_tokens_held: Default::default(),
            otlp_spans_dropped: Default::default(),
            access_lines_dropped: Default::default(),
            access_sync: std::sync::Mutex::new(()),
            connections_refused: Default::default(),
            proxy_protocol_refused: Default::default(),
            connections_evicted: Default::default(),
            connections_open: Default::default(),
            connections_idle: Default::default(),
            connections_accepted: Default::default(),
        }
    }

    /// Requests answered and in flight, and what each limit decided.
    fn register_request_families(&mut self) {
        self.registry.register(
            "requests",
            "Requests answered, by route and status",
            self.requests.clone(),
        );
        self.registry.register(
            "in_flight_requests",
            "Requests being served",
            self.in_flight.clone(),
        );
        self.registry.register(
            "limit_decisions",
            "Requests admitted, limited (429) or unavailable (503, a failure policy refused), by the limit that decided",
            self.decisions.clone(),
        );
        self.registry.register(
            "shadow_would_refuse",
            "Requests a shadow-mode limit would have refused",
            self.shadow_refusals.clone(),
        );
    }

    /// The limiter store: its checks' time, failures, the breaker, and changes after a check.
    fn register_store_families(&mut self) {
        self.registry.register(
            "store_check_seconds",
            "Time of one limiter store check",
            self.store_check_seconds.clone(),
        );
        self.registry.register(
            "store_errors",
            "Limiter store failures, by kind",
            self.store_errors.clone(),
        );
        self.registry.register(
            "store_breaker_open",
            "Breakers open in front of the limiter store: 1 or 0, or on a cluster the hash slots whose breaker is open",
            self.breaker_open.clone(),
        );
        self.registry.register(
            "store_bypass",
            "Decisions made without the store, by limit and failure policy",
            self.store_bypass.clone(),
        );
        self.registry.register(
            "store_refunds",
            "Changes to admitted requests' buckets after their check (refunds of undelivered requests, post-paid charges), by where they went (store, local)",
            self.store_refunds.clone(),
        );
        self.registry.register(
            "store_refund_failures",
            "Refunds lost (the charge stands), by kind (error, timeout, breaker_open)",
            self.store_refund_failures.clone(),
        );
    }

    fn register_rules_families(&mut self) {
        self.registry.register(
            "rules_version",
            "Version of the running rules",
            self.rules_version.clone(),
        );
        self.registry.register(
            "rules_reloads",
            "Rules reloads, by result (ok, ignored, failed)",
            self.rules_reloads.clone(),
        );
        self.registry.register(
            "admin_changes",
            "Changes through the admin API's key endpoints, by action (create, rotate, revoke, patch)",
            self.admin_changes.clone(),
        );
        self.registry.register(
            "admin_auth_failures",
            "Admin API requests refused 401 for a missing or wrong token",
            self.admin_auth_failures.clone(),
        );
    }

    /// Upstreams: their response time and their places for requests in flight.
    fn register_upstream_families(&mut self) {
        self.registry.register(
            "upstream_seconds",
            "Time until an upstream's response headers",
            self.upstream_seconds.clone(),
        );
        self.registry.register(
            "upstream_concurrency_limit",
            "Requests that may be in flight to an upstream now: its adaptive limit under max_in_flight",
            self.upstream_concurrency_limit.clone(),
        );
        self.registry.register(
            "upstream_in_flight",
            "Requests forwarded to an upstream whose response has not ended",
            self.upstream_in_flight.clone(),
        );
        self.registry.register(
            "upstream_shed",
            "Requests answered 503 upstream_overloaded: no place under the upstream's limit",
            self.upstream_shed.clone(),
        );
        self.registry.register(
            "upstream_strays",
            "Times an upstream was caught sending a response nobody asked for; its connections then carry one request each for a minute",
            self.upstream_strays.clone(),
        );
        self.registry.register(
            "upstream_target_up",
            "Per target of an upstream: 1 while requests may go to it, 0 while it is ejected",
            self.upstream_target_up.clone(),
        );
        self.registry.register(
            "upstream_requests",
            "Attempts on each target of an upstream, by outcome: ok, error_status (502, 503, 504), connect_failure, reset, timeout",
            self.upstream_requests.clone(),
        );
        self.registry.register(
            "upstream_retries",
            "Requests sent again to another target of their upstream, by why: connect_failure, reset, error_status",
            self.upstream_retries.clone(),
        );
        self.registry.register(
            "upstream_ejections",
            "Times a target was left out of its upstream for failing in a row",
            self.upstream_ejections.clone(),
        );
        self.registry.register(
            "upstream_retry_budget_exhausted",
            "Retries not sent because retries were already the upstream's budget share of its requests of the last 10 s",
            self.upstream_retry_budget_exhausted.clone(),
        );
        self.registry.register(
            "queued",
            "Requests a limit with \"delay\" admitted to wait for their tokens before they were forwarded",
            self.queued.clone(),
        );
        self.registry.register(
            "queue_waiting",
            "Requests waiting now for their tokens under a limit with \"delay\"",
            self.queue_waiting.clone(),
        );
        self.registry.register(
            "queue_left",
            "Queued requests whose client left before their turn; their tokens were given back",
            self.queue_left.clone(),
        );
        self.registry.register(
            "upgraded_connections",
            "Client connections upgraded on a route's \"upgrade\" (WebSocket) and relayed to their upstream now",
            self.upgraded_open.clone(),
        );
        self.registry.register(
            "upgraded_closed",
            "Upgraded connections ended, by reason: closed by either side, idle for the route's idle_timeout_ms, cut after the drain's grace, or never handed over",
            self.upgraded_closed.clone(),
        );
        self.registry.register(
            "blocks_started",
            "Blocks a limit with \"block_for\" started after refusing a request (in shadow mode, would have started)",
            self.blocks_started.clone(),
        );
        self.registry.register(
            "blocks_in_force",
            "Blocks in force, as this gateway has seen them: started here, refused by, or listed by GET /admin/blocks",
            self.blocks_in_force.clone(),
        );
    }

    /// Leased blocks: the lease script's calls and the tokens they moved.
    fn register_lease_families(&mut self) {
        self.registry.register(
            "lease_calls",
            "Calls to the store's lease script, by kind (lease, give_back)",
            self.lease_calls.clone(),
        );
        self.registry.register(
            "lease_grants",
            "Leases that granted a whole block",
            self.lease_grants.clone(),
        );
        self.registry.register(
            "lease_denials",
            "Leases that granted nothing (the bucket held less than a block)",
            self.lease_denials.clone(),
        );
        self.registry.register(
            "lease_failures",
            "Lease-script calls that failed or timed out, by kind (lease, give_back)",
            self.lease_failures.clone(),
        );
        self.registry.register(
            "lease_tokens_granted",
            "Tokens received in leased blocks",
            self.lease_tokens_granted.clone(),
        );
        self.registry.register(
            "lease_tokens_returned",
            "Leased tokens given back to the store unused (expiry, shutdown, refunds)",
            self.lease_tokens_returned.clone(),
        );
        self.registry.register(
            "lease_tokens_held",
            "Leased tokens this gateway holds now",
            self.lease_tokens_held.clone(),
        );
    }

    /// What the gateway's own telemetry dropped for want of room.
    fn register_drop_families(&mut self) {
        self.registry.register(
            "otlp_spans_dropped",
            "Request spans dropped, not exported, because the OTLP export queue was full",
            self.otlp_spans_dropped.clone(),
        );
        self.registry.register(
            "access_lines_dropped",
            "Access lines dropped, not written, because the log writer fell behind",
            self.access_lines_dropped.clone(),
        );
    }

    /// Client connections: accepted per shard, and what the connection caps did.
    fn register_connection_families(&mut self) {
        self.registry.register(
            "proxy_protocol_refused",
            "Client connections closed for their PROXY protocol header: malformed, sent by a peer not in --trusted-proxy, or missing from one that is",
            self.proxy_protocol_refused.clone(),
        );
        self.registry.register(
            "connections_refused",
            "Client connections closed at accept because a cap was full with none idle, by cap",
            self.connections_refused.clone(),
        );
        self.registry.register(
            "connections_evicted",
            "Idle client connections closed to make room for a new one, by cap",
            self.connections_evicted.clone(),
        );
        self.registry.register(
            "connections_open",
            "Client connections open (kept only when a connection cap is set)",
            self.connections_open.clone(),
        );
        self.registry.register(
            "connections_idle",
            "Client connections open with no request in flight (kept only when a connection cap is set)",
            self.connections_idle.clone(),
        );
        self.registry.register(
            "connections_accepted",
            "Client connections accepted on the public listener, by the shard (thread) that accepted them",
            self.connections_accepted.clone(),
        );
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
