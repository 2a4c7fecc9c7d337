//! Start-up in one path, a file a phase, each phase only doing what its name says:
//!
//! ```text
//! flags ─▶ config ─▶ rules ─▶ store ─▶ gateway ─▶ tasks ─▶ listeners
//! ```
//!
//! - `config` (`crate::config`): the `serve` flags and environment into a [`GatewayConfig`];
//! - [`rules`]: the rules file loaded and watched (after the demo's upstream it may point at),
//!   and the keys made through the admin API;
//! - [`store`]: the store and its wrappers, as `tower` layers in one order;
//! - [`gateway`]: the `Gateway` built from its `Parts`, starting no task;
//! - [`tasks`]: every background task, spawned in one place;
//! - [`listeners`]: the public and admin listeners bound and serving.
//!
//! [`Running`] then stops them in the reverse order: listeners, tasks, spans, leases.

mod gateway;
mod listeners;
mod rules;
mod store;
mod tasks;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::Admin;
pub use crate::config::{GatewayConfig, MeterConfig, StartError};
use crate::otel::Otel;
use crate::reload::{Reloader, WatchHandle};
pub use store::check_store;
use tollgate_meter::counter::Meter;
use tollgate_rules::Snapshot;
pub use tollgate_rules::{RulesLoader, RulesSource};
use tollgate_store::Store;
use tollgate_store::guard::Guard;
use tollgate_store::lease::Leases;
use tollgate_store::memory::MemoryStore;
use tollgate_telemetry::metrics::Metrics;

/// Starts a gateway, phase by phase. Fails before serving anything if a part can't start.
pub async fn start(cfg: GatewayConfig) -> Result<Running, StartError> {
    // Before anything keeps state per shard.
    crate::shard::set_count(cfg.shards);
    let tls = listeners::acceptor(&cfg)?;
    let (stop, stop_rx) = watch::channel(false);
    let metrics = Metrics::new();

    let demo = rules::demo_upstream(&cfg, &stop_rx).await?;
    let demo_upstreams = demo.as_ref().map(|d| d.addrs()).unwrap_or_default();
    let live = rules::live(&cfg, &demo_upstreams, tls.is_some(), &metrics)?;
    let stack = store::build(&cfg, &live.rules, &metrics).await?;
    let keys = rules::managed_keys(&cfg, &live, &metrics).await?;
    let built = gateway::build(&cfg, &live.rules, &stack.store, &metrics).await?;
    let tasks = tasks::spawn(
        &built,
        &live.rules,
        stack.memory.as_ref(),
        stack.guard.as_ref(),
        keys.clone(),
        &stop_rx,
    );

    let draining = Arc::new(AtomicBool::new(false));
    let admin = cfg.admin_listen.map(|_| Admin {
        rules: live.rules.clone(),
        store: stack.store.clone(),
        metrics: metrics.clone(),
        meter: built.metering.as_ref().map(|m| m.meter.clone()),
        quota_flags: built.quota_flags.clone(),
        clock: cfg.clock.clone(),
        regions: built.regions.clone(),
        gateway: built.gateway.clone(),
        reloader: live.reloader.clone(),
        hosts: cfg.admin_hosts.clone(),
        token: cfg.admin_token.clone(),
        keys,
        draining: draining.clone(),
        demo,
    });
    let serving = listeners::serve(&cfg, tls, built.gateway.clone(), admin, &metrics, &stop_rx).await?;

    Ok(Running {
        addr: serving.addr,
        admin_addr: serving.admin_addr,
        demo_upstream: demo_upstreams.first().copied(),
        demo_upstreams,
        rules: live.rules,
        store: stack.store,
        memory: stack.memory,
        guard: stack.guard,
        leases: stack.leases,
        metrics,
        reloader: live.reloader,
        meter: built.metering.map(|m| m.meter),
        _watch: live.watch,
        stop,
        listeners: serving.tasks,
        tasks,
        otel: built.otel,
        draining,
        shutdown_delay: cfg.shutdown_delay,
    })
}

/// A gateway that is serving.
pub struct Running {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub demo_upstream: Option<SocketAddr>,
    /// Every instance of the demo upstream, the first one's `demo_upstream`.
    pub demo_upstreams: Vec<SocketAddr>,
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub store: Arc<dyn Store>,
    pub memory: Option<Arc<MemoryStore>>,
    pub guard: Option<Arc<Guard>>,
    /// Hot keys' leased blocks (a Redis store); drained on shutdown.
    pub leases: Option<Arc<Leases>>,
    pub metrics: Arc<Metrics>,
    pub reloader: Arc<Reloader>,
    /// This gateway's usage counts, when metering is on.
    pub meter: Option<Arc<Meter>>,
    _watch: WatchHandle,
    stop: watch::Sender<bool>,
    listeners: Vec<JoinHandle<usize>>,
    tasks: tasks::Tasks,
    /// The span exporter; flushed once the listeners have finished.
    otel: Option<Arc<Otel>>,
    /// Set when the drain begins: `/readyz` then answers 503.
    draining: Arc<AtomicBool>,
    shutdown_delay: Duration,
}

impl Running {
    /// Stops accepting and drains; resolves when every listener has finished and every
    /// leased token this gateway held is back in the store.
    pub async fn shutdown(self) -> usize {
        let _ = self.stop.send(true);
        self.wait().await
    }

    /// What a stop signal starts, in order: `/readyz` answers 503 (so a load balancer or
    /// Kubernetes takes the gateway out), everything still serves for `shutdown_delay`, then the
    /// listeners stop, the requests in flight finish, and upgraded connections get their
    /// grace ([`Running::shutdown`]). `again` resolving (a second signal) cuts the delay short.
    pub async fn drain(self, again: impl std::future::Future<Output = ()>) -> usize {
        self.draining.store(true, Ordering::SeqCst);
        if !self.shutdown_delay.is_zero() {
            tracing::info!(delay = ?self.shutdown_delay, "not ready: serving on until the listener stops");
            tokio::select! {
                () = tokio::time::sleep(self.shutdown_delay) => {}
                () = again => tracing::info!("a second signal: stopping now"),
            }
        }
        self.shutdown().await
    }

    /// Resolves when every listener has finished (the public one's upgraded connections
    /// closed last, after `--upgrade-grace`), then gives leased tokens back.
    pub async fn wait(self) -> usize {
        let mut open = 0;
        for t in self.listeners {
            open += t.await.unwrap_or(1);
        }
        open += self.tasks.stop().await;
        if let Some(o) = self.otel {
            o.shutdown().await;
        }
        if let Some(l) = &self.leases {
            let back = l.drain(LEASE_DRAIN).await;
            tracing::info!(tokens = back, "leased tokens given back");
        }
        open
    }
}

/// How long shutdown waits for lease and give-back calls to finish.
const LEASE_DRAIN: Duration = Duration::from_secs(3);
