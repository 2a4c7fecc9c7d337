//! What lives beside a rules snapshot and outlasts a request: each upstream's kept connections
//! and places, the metric handles, rebuilt when the rules change.

use super::*;
use crate::dashboard::UpstreamNow;

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
    /// Its kept connections: the same pool across reloads while address, idle timeout and TLS
    /// settings stay.
    pub pool: Arc<ConnPool>,
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
    fn new(snap: &Snapshot, prev: &Live, meter: Option<&Meter>, metrics: &Metrics) -> Live {
        let upstreams = snap
            .upstreams
            .iter()
            .map(|u| {
                let old = prev.upstreams.iter().find(|o| o.name == u.name);
                let pool = match old {
                    Some(o)
                        if *o.pool.authority() == u.authority
                            && o.pool.idle_timeout() == u.idle_timeout
                            && o.pool.tls() == u.tls.as_ref() =>
                    {
                        o.pool.clone()
                    }
                    _ => Arc::new(
                        ConnPool::new(
                            u.authority.clone(),
                            tollgate_rules::CONNECT_TIMEOUT,
                            u.idle_timeout,
                        )
                        .with_tls(u.tls.clone())
                        .counting_strays(
                            metrics
                                .upstream_strays
                                .get_or_create(&tollgate_telemetry::metrics::UpstreamLabel {
                                    upstream: u.name.clone(),
                                })
                                .clone(),
                        ),
                    ),
                };
                LiveUpstream {
                    name: u.name.clone(),
                    pool,
                    places: Places::new(u, old.map(|o| &o.places), metrics),
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
    /// Each upstream of the running rules as the dashboard shows it.
    pub(crate) fn upstreams_now(&self) -> Vec<UpstreamNow> {
        self.live
            .load()
            .upstreams
            .iter()
            .map(|u| {
                let (in_flight, limit, adaptive) = u.places.now();
                UpstreamNow {
                    name: u.name.clone(),
                    in_flight,
                    limit,
                    adaptive,
                }
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
        let fresh = Arc::new(Live::new(snap, &current, self.meter.as_deref(), &self.metrics));
        // A request that loaded its snapshot just before a reload gets state for it (sharing
        // the current pools and gates by name) without pushing the newer one out.
        if snap.serial > current.handles.snapshot {
            self.live.store(fresh.clone());
        }
        fresh
    }

    /// Closes kept upstream connections that expired or that their upstream closed.
    pub(crate) fn sweep_upstreams(&self) {
        for u in &self.live.load().upstreams {
            u.pool.sweep();
        }
    }
}
