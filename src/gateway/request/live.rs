//! What lives beside a rules snapshot and outlasts a request: each upstream's kept connections
//! and places, the metric handles, rebuilt when the rules change.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use tollgate_meter::counter::Meter;
use tollgate_rules::Snapshot;
use tollgate_telemetry::metrics::{Handles, Metrics};

use super::Gateway;
use crate::concurrency::Places;
use crate::dashboard::UpstreamNow;
use crate::proxy::names::Names;
use crate::proxy::targets::Targets;

/// What the gateway keeps alive for one rules snapshot: its metric handles, and each upstream's
/// kept connections and in-flight places. The rules are plain data; what lives on between
/// requests lives here, and passes to the next snapshot wherever the upstream is unchanged.
pub struct Live {
    pub handles: Handles,
    /// Per upstream, in the snapshot's order.
    pub(crate) upstreams: Vec<LiveUpstream>,
    /// Per key, in the snapshot's order, its metering counter (the same one across reloads);
    /// empty when metering is off.
    pub(super) meter: Vec<Arc<AtomicU64>>,
}

pub(crate) struct LiveUpstream {
    pub(super) name: Arc<str>,
    /// Its targets: each one's kept connections and state, the same across reloads while its
    /// address, idle timeout and TLS settings stay.
    pub targets: Targets,
    /// Its places for requests in flight: static gate and adaptive limit.
    pub places: Places,
}

impl Default for Live {
    fn default() -> Live {
        Live {
            handles: Handles::new(0, vec![], vec![], vec![]),
            upstreams: vec![],
            meter: vec![],
        }
    }
}

impl Live {
    fn new(snap: &Snapshot, prev: &Live, meter: Option<&Meter>, metrics: &Metrics, names: &Names) -> Live {
        let upstreams = snap
            .upstreams
            .iter()
            .map(|u| {
                let old = prev.upstreams.iter().find(|o| o.name == u.name);
                let targets = Targets::new(u, old.map(|o| &o.targets), metrics, names);
                // Targets with caps of their own make the upstream's: their sum.
                let cap = u.max_in_flight.or_else(|| targets.cap_sum());
                LiveUpstream {
                    name: u.name.clone(),
                    places: Places::new(u, cap, old.map(|o| &o.places), metrics),
                    targets,
                }
            })
            .collect();
        Live {
            handles: Handles::new(
                snap.serial,
                snap.routes.iter().map(|r| r.name.clone()).collect(),
                snap.limits.iter().map(|l| l.name.clone()).collect(),
                snap.upstreams.iter().map(|u| u.name.clone()).collect(),
            ),
            upstreams,
            meter: meter.map_or_else(Vec::new, |m| snap.keys.iter().map(|k| m.counter(&k.id)).collect()),
        }
    }
}

impl Gateway {
    /// Each upstream of the running rules as the dashboard shows it, its targets as
    /// [`Gateway::upstream_targets`] lists them.
    pub(crate) fn upstreams_now(&self) -> Vec<UpstreamNow> {
        // The running rules' state, made if no request has yet: a gateway that has served
        // nothing since a reload still has targets to show.
        let snap = self.rules.load();
        let live = self.live(&snap);
        snap.upstreams
            .iter()
            .zip(&live.upstreams)
            .map(|(up, u)| {
                let (in_flight, limit, adaptive) = u.places.now();
                UpstreamNow {
                    name: u.name.clone(),
                    in_flight,
                    limit,
                    adaptive,
                    balance: balance_name(up.balance),
                    targets: u.targets.view(),
                }
            })
            .collect()
    }

    /// Starts the active health checks of every upstream that has them, where due.
    pub(crate) fn check_targets(&self) {
        let snap = self.rules.load();
        let live = self.live(&snap);
        for (u, l) in snap.upstreams.iter().zip(&live.upstreams) {
            if let Some(h) = &u.health {
                l.targets.check_due(h, &u.host_header);
            }
        }
    }

    /// Every upstream's targets, each with its state, requests in flight and last failure, as
    /// `GET /admin/upstreams` shows them.
    pub(crate) fn upstream_targets(&self) -> Vec<serde_json::Value> {
        let snap = self.rules.load();
        let live = self.live(&snap);
        snap.upstreams
            .iter()
            .zip(&live.upstreams)
            .map(|(u, l)| {
                serde_json::json!({
                    "name": &*u.name,
                    "balance": balance_name(u.balance),
                    "targets": l.targets.view(),
                })
            })
            .collect()
    }

    /// The live state for this snapshot, made at its first request from the last one's.
    /// Serials only go up, and a key change through the admin API makes a new one, so a serial
    /// names one snapshot.
    pub(super) fn live(&self, snap: &Snapshot) -> Arc<Live> {
        let current = self.live.load_full();
        if current.handles.snapshot == snap.serial {
            return current;
        }
        // One builder at a time: the first requests of a snapshot arrive together, and each
        // building its own would give each its own in-flight gate, letting an upstream receive
        // a multiple of its cap.
        let _one = self
            .building
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = self.live.load_full();
        if current.handles.snapshot == snap.serial {
            return current;
        }
        let fresh = Arc::new(Live::new(
            snap,
            &current,
            self.meter.as_deref(),
            &self.metrics,
            &self.names,
        ));
        // A request that loaded its snapshot just before a reload gets state for it (sharing
        // the current pools and gates by name) without pushing the newer one out.
        if snap.serial > current.handles.snapshot {
            self.live.store(fresh.clone());
        }
        fresh
    }

    /// Learns the addresses of the upstreams' target names that are due, and when any changed,
    /// gives the running rules targets at the new addresses: those still there keep their
    /// connections and state, those gone get no new request and their connections close as
    /// the requests on them end.
    pub(crate) async fn follow_names(&self) {
        let snap = self.rules.load_full();
        if !self.names.refresh(&snap).await {
            return;
        }
        let _one = self
            .building
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let snap = self.rules.load_full();
        let current = self.live.load_full();
        let fresh = Live::new(&snap, &current, self.meter.as_deref(), &self.metrics, &self.names);
        self.live.store(Arc::new(fresh));
    }

    /// Closes kept upstream connections that expired or that their upstream closed.
    pub(crate) fn sweep_upstreams(&self) {
        for u in &self.live.load().upstreams {
            for t in &u.targets.list {
                t.pool.sweep();
            }
            u.targets.refresh();
        }
    }
}

/// How the rules spell a balance.
fn balance_name(b: tollgate_rules::Balance) -> &'static str {
    match b {
        tollgate_rules::Balance::LeastRequest => "least_request",
        tollgate_rules::Balance::RoundRobin => "round_robin",
        tollgate_rules::Balance::Hash => "hash",
    }
}
