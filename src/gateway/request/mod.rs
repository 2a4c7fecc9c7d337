//! The data path of one request: route, identity, plan, one store check, then 429 or forward;
//! and what the operator sees of it (metrics, one access line, the request id, its span).
//!
//! The files in the order a request meets them: a wire reads it (`express` for the HTTP/1
//! lane, `general` for hyper's), and `drive` runs its steps: `begin` (its id and the guard that
//! records it), `identify` (route, key, client IP), `admit` (the one store check, seats, the
//! upstream's place, the quota), `forward` (the upstream's header edits, then what its answer
//! settles or a refund), `finish` (the access line, metrics and span). A usage route takes
//! `usage` in place of `admit` and `forward`: its own cost charged and the key's other buckets
//! read in one store check, answered with the caller's budget. `live` holds what outlasts a
//! request beside each rules snapshot.

mod admit;
mod begin;
mod blocks;
mod drive;
pub mod express;
mod finish;
mod forward;
mod general;
mod identify;
mod live;
mod queue;
mod usage;

pub use admit::*;
pub(crate) use begin::*;
pub use identify::*;
pub use live::*;

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::proxy::Proxy;
use crate::respond::Body;
use crate::server::{ConnInfo, Handler};
use tollgate_limit::clock::Clock;
use tollgate_meter::counter::Meter;
use tollgate_meter::flags::Flags;
use tollgate_rules::Snapshot;
use tollgate_rules::identity::TrustedProxies;
use tollgate_store::Store;
use tollgate_store::seats::{MemorySeats, Seats};
use tollgate_telemetry::logsample::Sampler;
use tollgate_telemetry::metrics::Metrics;

pub(crate) static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// Everything a request needs, shared by all connections. Built whole from [`Parts`]: nothing
/// changes a gateway once it serves, and only the request's steps (this module's files) read
/// its fields.
pub struct Gateway {
    rules: Arc<ArcSwap<Snapshot>>,
    store: Arc<dyn Store>,
    proxy: Proxy,
    trusted: TrustedProxies,
    metrics: Arc<Metrics>,
    meter: Option<Arc<Meter>>,
    quota_flags: Arc<ArcSwap<Flags>>,
    /// The dashboard's counts that no metric keeps (refusals per key).
    dashboard: Arc<crate::dashboard::Dashboard>,
    seats: Arc<dyn Seats>,
    /// Seats kept here while the store's can't be reached, for limits that fail `local`.
    local_seats: MemorySeats,
    regions: Option<Arc<crate::regions::Regions>>,
    clock: Arc<dyn Clock>,
    otel: Option<Arc<crate::otel::Otel>>,
    access: Option<crate::access::AccessLog>,
    drain_within: std::time::Duration,
    shadow_log: Sampler,
    live: ArcSwap<Live>,
    building: std::sync::Mutex<()>,
    /// The addresses behind upstream targets' names.
    names: Arc<crate::proxy::names::Names>,
    blocks_seen: blocks::SeenBlocks,
    /// Connections upgraded on a route's `"upgrade"`, relayed in tasks of their own.
    upgrades: Arc<crate::upgrade::Upgrades>,
}

/// What a gateway is built from: the four it cannot run without, and the rest with defaults
/// for one process without metering, spans or Regions. Start-up fills it in, then
/// [`Gateway::new`] takes it whole.
pub(crate) struct Parts {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub trusted: TrustedProxies,
    pub metrics: Arc<Metrics>,
    /// The longest wait for more of a client's body while it is forwarded.
    pub body_timeout: std::time::Duration,
    /// The longest wait for the rest of a body whose request was answered before it arrived
    /// (the server's header read timeout): past it, the answer closes the connection.
    pub drain_within: std::time::Duration,
    /// Wall-clock time for quota periods (tests pass a manual clock).
    pub clock: Arc<dyn Clock>,
    /// Counts admitted requests per key for billing, apart from the limiter; `None`: off.
    pub meter: Option<Arc<Meter>>,
    /// The quota flags metering sets, as last read (every second).
    pub quota_flags: Arc<ArcSwap<Flags>>,
    /// Seats of limits on requests in flight: the store's (Redis), or this gateway's.
    pub seats: Arc<dyn Seats>,
    /// Limits shared with other Regions: their shares replace the limits' own numbers.
    pub regions: Option<Arc<crate::regions::Regions>>,
    /// A span per request over OTLP; `None`: off, and nothing is built.
    pub otel: Option<Arc<crate::otel::Otel>>,
    /// Access lines in a conventional format, formatted on their writer thread; `None`: each
    /// request's line is a `tollgate::access` log event.
    pub access: Option<crate::access::AccessLog>,
    /// Where upstream targets' names are looked up: the system's resolver, or a hosts file
    /// first.
    pub names: Arc<crate::proxy::names::Names>,
}

impl Parts {
    pub fn new(
        rules: Arc<ArcSwap<Snapshot>>,
        store: Arc<dyn Store>,
        trusted: TrustedProxies,
        metrics: Arc<Metrics>,
    ) -> Parts {
        let limits = crate::server::ServerLimits::default();
        Parts {
            rules,
            store,
            trusted,
            metrics,
            body_timeout: limits.body_read_timeout,
            drain_within: limits.header_read_timeout,
            clock: tollgate_limit::clock::SystemClock::shared(),
            meter: None,
            quota_flags: Arc::new(ArcSwap::from_pointee(Flags::default())),
            seats: Arc::new(MemorySeats::new()),
            regions: None,
            otel: None,
            access: None,
            names: Arc::new(crate::proxy::names::Names::system()),
        }
    }
}

impl Gateway {
    pub(crate) fn new(p: Parts) -> Gateway {
        let mut proxy = Proxy::new();
        proxy.body_timeout = p.body_timeout;
        let upgrades = Arc::new(crate::upgrade::Upgrades::new(
            p.metrics.upgraded_open.clone(),
            p.metrics.upgraded_closed.clone(),
        ));
        Gateway {
            rules: p.rules,
            store: p.store,
            proxy,
            trusted: p.trusted,
            metrics: p.metrics,
            meter: p.meter,
            quota_flags: p.quota_flags,
            regions: p.regions,
            dashboard: crate::dashboard::Dashboard::new(),
            seats: p.seats,
            local_seats: MemorySeats::new(),
            clock: p.clock,
            otel: p.otel,
            access: p.access,
            drain_within: p.drain_within,
            shadow_log: Sampler::new(std::time::Duration::from_secs(1)),
            live: ArcSwap::from_pointee(Live::default()),
            building: std::sync::Mutex::new(()),
            names: p.names,
            blocks_seen: blocks::SeenBlocks::default(),
            upgrades,
        }
    }

    /// The dashboard's counts this gateway keeps.
    pub(crate) fn dashboard(&self) -> &Arc<crate::dashboard::Dashboard> {
        &self.dashboard
    }
}

impl Handler for Gateway {
    async fn handle(self: Arc<Self>, req: Request<Incoming>, conn: ConnInfo) -> Response<Body> {
        self.serve(req, conn).await
    }

    fn has_lane(&self) -> bool {
        true
    }

    fn serve_lane<'a, S: crate::server::LaneIo>(
        &'a self,
        io: S,
        info: &'a ConnInfo,
        limits: &'a crate::server::ServerLimits,
        stop: &'a mut tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = crate::server::Ended<S>> + Send + 'a {
        express::serve(self, io, info, limits, stop)
    }

    fn close_upgraded(&self, grace: std::time::Duration) -> impl Future<Output = usize> + Send {
        self.upgrades.close(grace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::clock::ManualClock;
    use tollgate_store::memory::MemoryStore;

    /// The first requests of a snapshot arrive together; they must share one in-flight gate
    /// and one pool per upstream, or an upstream could receive a multiple of its cap.
    #[test]
    fn concurrent_first_requests_share_one_live_state() {
        let snap = tollgate_rules::compile(
            br#"{"version": 3, "upstreams": {"u": {"url": "http://127.0.0.1:9", "max_in_flight": 4}},
                "routes": [{"method": "GET", "path": "/", "upstream": "u", "key": "optional"}]}"#,
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap();
        let snap = Arc::new(snap);
        let gw = Gateway::new(Parts::new(
            Arc::new(ArcSwap::new(snap.clone())),
            Arc::new(MemoryStore::new(ManualClock::new(0))),
            TrustedProxies::default(),
            Metrics::new(),
        ));
        for _ in 0..300 {
            let barrier = std::sync::Barrier::new(8);
            let lives: Vec<Arc<Live>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            gw.live(&snap)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let gate = |l: &Live| l.upstreams[0].places.gate.clone().unwrap();
            for l in &lives {
                assert!(
                    Arc::ptr_eq(&gate(l), &gate(&lives[0])),
                    "two gates for one upstream"
                );
                assert!(Arc::ptr_eq(
                    l.upstreams[0].targets.first_pool(),
                    lives[0].upstreams[0].targets.first_pool()
                ));
            }
            // The next round starts from a fresh gateway state again.
            gw.live.store(Arc::new(Live::default()));
        }
    }
}
