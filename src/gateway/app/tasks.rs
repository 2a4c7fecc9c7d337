//! The tasks phase of start-up: every background task a running gateway keeps, spawned in one
//! place, and stopped in one order once the listeners have finished (`Tasks::stop`).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::gateway::{Built, Metering};
use crate::managed::ManagedKeys;
use crate::regions::RegionTasks;
use crate::request::Gateway;
use crate::server::stopped;
use tollgate_meter::counter;
use tollgate_rules::Snapshot;
use tollgate_store::guard::Guard;
use tollgate_store::memory::MemoryStore;

/// How often a gateway reads the quota flags.
const FLAG_READ: Duration = Duration::from_secs(1);

/// How often the embedded store drops buckets that have refilled.
const SWEEP_BUCKETS: Duration = Duration::from_secs(5);

/// How long shutdown waits for the last usage records.
const METER_END: Duration = Duration::from_secs(6);

/// The tasks of a running gateway.
pub(super) struct Tasks {
    /// Tasks that end on the stop signal: the managed keys' follower, the upstreams' sweeps,
    /// health checks and name lookups.
    until_stop: Vec<JoinHandle<usize>>,
    /// Stopped after the listeners, so the last records hold every admitted request.
    meter: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    flags: Option<JoinHandle<()>>,
    regions: Option<RegionTasks>,
    /// Renews the leases of seats held in Redis.
    seat_renewal: Option<JoinHandle<()>>,
}

/// Starts every background task of a gateway built by `gateway::build`.
pub(super) fn spawn(
    built: &Built,
    rules: &Arc<ArcSwap<Snapshot>>,
    memory: Option<&Arc<MemoryStore>>,
    guard: Option<&Arc<Guard>>,
    keys: Option<Arc<ManagedKeys>>,
    stop_rx: &watch::Receiver<bool>,
) -> Tasks {
    if let Some(m) = memory {
        m.spawn_sweeper(SWEEP_BUCKETS);
    }
    if let Some(g) = guard {
        g.spawn_heartbeat(format!("{:032x}", rand::random::<u128>()));
    }
    let gateway = &built.gateway;
    let mut until_stop = vec![
        tokio::spawn(sweep_upstreams(gateway.clone(), stopped(stop_rx.clone()))),
        tokio::spawn(check_targets(gateway.clone(), stopped(stop_rx.clone()))),
        tokio::spawn(follow_names(gateway.clone(), stopped(stop_rx.clone()))),
    ];
    if let Some(k) = keys {
        let stop = stopped(stop_rx.clone());
        until_stop.push(tokio::spawn(async move {
            k.follow(stop).await;
            0
        }));
    }
    let (meter, flags) = match &built.metering {
        Some(m) => {
            let (meter, flags) = spawn_meter(m, built);
            (Some(meter), Some(flags))
        }
        None => (None, None),
    };
    let regions = built.regions.as_ref().map(|r| {
        let rc = &r.cfg;
        tracing::info!(region = %rc.region, holder = %rc.holder, every = ?rc.interval, "sharing global limits across Regions");
        crate::regions::start(r.clone(), rules.clone())
    });
    let seat_renewal = built
        .seats
        .as_ref()
        .map(|s| tokio::spawn(s.clone().renew(stop_rx.clone())));
    Tasks {
        until_stop,
        meter,
        flags,
        regions,
        seat_renewal,
    }
}

/// The meter's writer, with a stop of its own, and the quota flags' reader.
fn spawn_meter(m: &Metering, built: &Built) -> ((watch::Sender<bool>, JoinHandle<()>), JoinHandle<()>) {
    tracing::info!(identity = %m.meter.identity(), every = ?m.every, "metering admitted requests");
    let (stop, stop_rx) = watch::channel(false);
    let writer = tokio::spawn(counter::run(m.meter.clone(), m.sink.clone(), m.every, stop_rx));
    let flags = tokio::spawn(tollgate_meter::flags::follow(
        m.flags.clone(),
        built.quota_flags.clone(),
        FLAG_READ,
    ));
    ((stop, writer), flags)
}

impl Tasks {
    /// Stops every task once the stop signal has been sent and the listeners have finished:
    /// the meter last, so its final records count every request served. Returns the
    /// connections the tasks left open.
    pub(super) async fn stop(self) -> usize {
        let mut open = 0;
        for t in self.until_stop {
            open += t.await.unwrap_or(1);
        }
        if let Some(t) = &self.flags {
            t.abort();
        }
        if let Some(r) = self.regions {
            r.stop().await;
        }
        if let Some(t) = self.seat_renewal {
            t.abort();
        }
        if let Some((stop, task)) = self.meter {
            let _ = stop.send(true);
            if tokio::time::timeout(METER_END, task).await.is_err() {
                tracing::error!(
                    "the last usage records were not written in time; the meter reports an unclean end"
                );
            }
        }
        open
    }
}

/// Closes kept upstream connections that expired or that their upstream closed, once a second,
/// so none lingers half-closed while no request comes to take it.
async fn sweep_upstreams(gateway: Arc<Gateway>, stop: impl std::future::Future<Output = ()>) -> usize {
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return 0,
            _ = tick.tick() => gateway.sweep_upstreams(),
        }
    }
}

/// Starts the upstreams' active health checks as they fall due (each target's interval is its
/// upstream's; this only looks often enough to keep to it).
async fn check_targets(gateway: Arc<Gateway>, stop: impl std::future::Future<Output = ()>) -> usize {
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return 0,
            _ = tick.tick() => gateway.check_targets(),
        }
    }
}

/// Follows the upstream targets' names: the hosts file is looked at each tick, and each name is
/// asked again as its upstream's `dns_refresh_ms` falls due.
async fn follow_names(gateway: Arc<Gateway>, stop: impl std::future::Future<Output = ()>) -> usize {
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut stop => return 0,
            _ = tick.tick() => gateway.follow_names().await,
        }
    }
}
