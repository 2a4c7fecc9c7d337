//! Prometheus metrics, one registry per gateway (no globals, so tests in one process never mix
//! counts). Labels are low-cardinality: routes, limits, upstreams and outcomes, never API keys
//! or client addresses.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteStatus {
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitDecision {
    pub limit: String,
    /// `admitted` or `refused`.
    pub decision: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    pub limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitPolicy {
    pub limit: String,
    pub policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Kind {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub upstream: String,
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
    pub rules_version: Gauge,
    pub rules_reloads: Family<ResultLabel, Counter>,
    pub upstream_seconds: Family<UpstreamLabel, Histogram>,
    pub in_flight: Gauge,
    pub leases: Family<Kind, Counter>,
    pub lease_tokens_returned: Counter,
    pub lease_tokens_held: Gauge,
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
            "Requests admitted or refused, by the limit that decided",
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
            "1 while the breaker in front of the limiter store is open",
            breaker_open.clone(),
        );
        let store_bypass = Family::<LimitPolicy, Counter>::default();
        registry.register(
            "store_bypass",
            "Decisions made without the store, by limit and failure policy",
            store_bypass.clone(),
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
        let upstream_seconds =
            Family::<UpstreamLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "upstream_seconds",
            "Time until an upstream's response headers",
            upstream_seconds.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("in_flight_requests", "Requests being served", in_flight.clone());
        let leases = Family::<Kind, Counter>::default();
        registry.register(
            "lease_calls",
            "Lease calls to the store, by result (granted, denied, failed)",
            leases.clone(),
        );
        let lease_tokens_returned = Counter::default();
        registry.register(
            "lease_tokens_returned",
            "Leased tokens given back unused",
            lease_tokens_returned.clone(),
        );
        let lease_tokens_held = Gauge::default();
        registry.register(
            "lease_tokens_held",
            "Leased tokens this gateway holds now",
            lease_tokens_held.clone(),
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
            rules_version,
            rules_reloads,
            upstream_seconds,
            in_flight,
            leases,
            lease_tokens_returned,
            lease_tokens_held,
        })
    }

    /// The exposition text (OpenMetrics, which Prometheus scrapes).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    pub fn reload(&self, result: &'static str) {
        self.rules_reloads.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn observe_upstream(&self, upstream: &str, took: Duration) {
        self.upstream_seconds
            .get_or_create(&UpstreamLabel {
                upstream: upstream.to_string(),
            })
            .observe(took.as_secs_f64());
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
