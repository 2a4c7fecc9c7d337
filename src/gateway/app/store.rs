//! The store a gateway checks against, built in one order: the base store (embedded, Redis or
//! Redis Cluster), then each wrapper as a `tower::Layer`, listed in the order a check meets
//! them. A new wrapper is one more layer here, in its place in that order.
//!
//! ```text
//! a check ─▶ home Regions ─▶ leases ─▶ slots ─▶ guard ─▶ the base store
//! ```
//!
//! - home Regions (`--region`): a security limit homed in another Region goes to that Region's
//!   store, behind a guard of its own;
//! - leases (Redis): hot limits spend blocks leased from the store, in memory;
//! - slots (Redis Cluster): a request whose buckets lie in several hash slots is checked slot by
//!   slot, each slot behind the guard, so a slot that fails follows its limits' policies;
//! - guard (a store on the network): the timeout, the breaker and the failure policies.

use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use tower::{Layer, ServiceBuilder};

use crate::config::{ClockSource, StoreUrl};
use crate::config::{GatewayConfig, StartError};
use tollgate_rules::Snapshot;
use tollgate_store::Store;
use tollgate_store::guard::{FleetSize, Guard};
use tollgate_store::lease::Leases;
use tollgate_store::memory::MemoryStore;
use tollgate_store::redis::{Access, ConnectError, RedisStore, Target};
use tollgate_store::slots::{Slots, cluster_slot};
use tollgate_telemetry::metrics::Metrics;

/// The built store, and the layers a running gateway reports on or stops.
pub(super) struct StoreStack {
    pub store: Arc<dyn Store>,
    /// The embedded store, when it is the base.
    pub memory: Option<Arc<MemoryStore>>,
    pub guard: Option<Arc<Guard>>,
    pub leases: Option<Arc<Leases>>,
}

type Dyn = Arc<dyn Store>;

/// Builds the store `cfg` asks for. Stores on the network are connected before anything is
/// served; one that is down now is connected later, and limits decide by their failure
/// policies meanwhile. The embedded store's sweeper and the guard's heartbeat start with the
/// other tasks (`tasks::spawn`).
pub(super) async fn build(
    cfg: &GatewayConfig,
    rules: &Arc<ArcSwap<Snapshot>>,
    metrics: &Arc<Metrics>,
) -> Result<StoreStack, StartError> {
    let cluster = matches!(cfg.store, StoreUrl::RedisCluster { .. });
    let (base, memory, redis): (Dyn, _, _) = match cfg.store_target() {
        None => {
            let m = Arc::new(MemoryStore::new(cfg.clock.clone()));
            (m.clone(), Some(m), None)
        }
        Some(target) => {
            let r = redis_store(target, cfg).await?;
            (r.clone(), None, Some(r))
        }
    };
    let remote = base.remote();
    let fleet = Arc::new(match cfg.fleet_size {
        Some(n) => FleetSize::fixed(n),
        None => FleetSize::learned(),
    });
    let guard = GuardLayer {
        on: remote,
        cluster,
        fleet: fleet.clone(),
        cfg,
        rules,
        metrics,
        built: OnceLock::new(),
    };
    let leases = LeaseLayer {
        // The embedded store has no shard to spare: there leased limits are checked like any
        // other.
        lessor: redis.filter(|_| remote),
        fleet,
        metrics,
        wait: cfg.store_timeout,
        built: OnceLock::new(),
    };
    let home = match &cfg.regions {
        Some(rc) => Some(HomeLayer::connect(rc, cfg, rules.clone(), metrics.clone()).await?),
        None => None,
    };
    let store = ServiceBuilder::new()
        .layer(OptionalLayer(home))
        .layer(&leases)
        .layer(SlotsLayer { on: cluster })
        .layer(&guard)
        .service(base);
    Ok(StoreStack {
        store,
        memory,
        guard: guard.built.into_inner(),
        leases: leases.built.into_inner(),
    })
}

/// A layer present or not: without it the store passes through.
struct OptionalLayer<L>(Option<L>);

impl<L: Layer<Dyn, Service = Dyn>> Layer<Dyn> for OptionalLayer<L> {
    type Service = Dyn;

    fn layer(&self, inner: Dyn) -> Dyn {
        match &self.0 {
            Some(l) => l.layer(inner),
            None => inner,
        }
    }
}

/// The timeout, breaker and failure policies in front of a store on the network; on a cluster,
/// one breaker per slot, so one master failing opens only its own slots'.
struct GuardLayer<'a> {
    on: bool,
    cluster: bool,
    fleet: Arc<FleetSize>,
    cfg: &'a GatewayConfig,
    rules: &'a Arc<ArcSwap<Snapshot>>,
    metrics: &'a Arc<Metrics>,
    built: OnceLock<Arc<Guard>>,
}

impl Layer<Dyn> for GuardLayer<'_> {
    type Service = Dyn;

    fn layer(&self, inner: Dyn) -> Dyn {
        if !self.on {
            return inner;
        }
        let g = Guard::new(
            inner,
            self.cfg.store_timeout,
            self.fleet.clone(),
            self.cfg.clock.clone(),
            limit_names(self.rules.clone()),
            self.metrics.clone(),
        );
        let g = Arc::new(if self.cluster { g.per_slot(cluster_slot) } else { g });
        let _ = self.built.set(g.clone());
        g
    }
}

/// A request over several hash slots checked slot by slot (Redis Cluster only).
struct SlotsLayer {
    on: bool,
}

impl Layer<Dyn> for SlotsLayer {
    type Service = Dyn;

    fn layer(&self, inner: Dyn) -> Dyn {
        if self.on {
            Arc::new(Slots::new(inner))
        } else {
            inner
        }
    }
}

/// Leased limits spend blocks in memory, leased from a Redis store behind the guard.
struct LeaseLayer<'a> {
    lessor: Option<Arc<RedisStore>>,
    fleet: Arc<FleetSize>,
    metrics: &'a Arc<Metrics>,
    wait: std::time::Duration,
    built: OnceLock<Arc<Leases>>,
}

impl Layer<Dyn> for LeaseLayer<'_> {
    type Service = Dyn;

    fn layer(&self, inner: Dyn) -> Dyn {
        let Some(r) = &self.lessor else { return inner };
        let l = Leases::new(
            inner,
            r.clone(),
            self.fleet.clone(),
            self.metrics.clone(),
            self.wait,
        );
        let _ = self.built.set(l.clone());
        l
    }
}

/// Security limits homed in another Region checked in that Region's store, each behind its
/// own guard: a home Region that doesn't answer in `--region-store-timeout` decides by the
/// limit's failure policy.
struct HomeLayer {
    homes: std::collections::BTreeMap<Arc<str>, Dyn>,
    home_of: crate::regions::home::HomeOf,
}

impl HomeLayer {
    async fn connect(
        rc: &crate::regions::RegionsConfig,
        cfg: &GatewayConfig,
        rules: Arc<ArcSwap<Snapshot>>,
        metrics: Arc<Metrics>,
    ) -> Result<HomeLayer, StartError> {
        let clock = match cfg.clock_source {
            ClockSource::Store => None,
            ClockSource::Gateway => Some(cfg.clock.clone()),
        };
        let mut homes = std::collections::BTreeMap::new();
        for (name, url) in rc.stores.iter().filter(|(n, _)| **n != rc.region) {
            let place = StoreUrl::parse(url).map_err(StartError::Regions)?;
            let target = place
                .target(Access::none())
                .ok_or_else(|| StartError::Regions(format!("Region {name} ({url}): not a Redis store")))?;
            // Connected before serving, like this Region's store: a Region that is down now is
            // connected later, and its limits decide by their failure policies meanwhile.
            let remote = match RedisStore::connect(target, clock.clone()).await {
                Ok(r) => r,
                Err(e @ ConnectError::Unreachable { .. }) => {
                    tracing::warn!(region = %name, error = %e, "another Region's store is down; its security limits decide by their failure policies until it answers");
                    RedisStore::connect_later(target, clock.clone())
                        .map_err(|e| StartError::Regions(format!("Region {name} ({url}): {e}")))?
                }
                Err(e) => return Err(StartError::Regions(format!("Region {name} ({url}): {e}"))),
            };
            let guard = Guard::new(
                Arc::new(remote),
                rc.store_timeout,
                Arc::new(FleetSize::fixed(cfg.fleet_size.unwrap_or(1))),
                cfg.clock.clone(),
                limit_names(rules.clone()),
                metrics.clone(),
            );
            // A cluster's buckets lie in many slots: checked slot by slot, each slot behind a
            // breaker of its own, as this Region's are.
            let home: Dyn = match place {
                StoreUrl::RedisCluster { .. } => Arc::new(Slots::new(Arc::new(guard.per_slot(cluster_slot)))),
                _ => Arc::new(guard),
            };
            homes.insert(Arc::from(name.as_str()), home);
        }
        let own: Arc<str> = Arc::from(rc.region.as_str());
        let home_of: crate::regions::home::HomeOf = Arc::new(move |li| {
            rules
                .load()
                .limits
                .get(li as usize)
                .and_then(|l| l.home_region.clone())
                .filter(|h| *h != own)
        });
        Ok(HomeLayer { homes, home_of })
    }
}

impl Layer<Dyn> for HomeLayer {
    type Service = Dyn;

    fn layer(&self, inner: Dyn) -> Dyn {
        Arc::new(crate::regions::home::HomeRouted::new(
            inner,
            self.homes.clone(),
            self.home_of.clone(),
        ))
    }
}

/// A Redis store, connected now, or later when it is down now.
async fn redis_store(target: Target<'_>, cfg: &GatewayConfig) -> Result<Arc<RedisStore>, StartError> {
    let clock = match cfg.clock_source {
        ClockSource::Store => None,
        ClockSource::Gateway => {
            tracing::warn!(
                "--clock gateway: buckets refill on each gateway's own clock; skew between gateways hands out extra tokens"
            );
            Some(cfg.clock.clone())
        }
    };
    match RedisStore::connect(target, clock.clone()).await {
        Ok(store) => {
            if let Some(found) = store.found() {
                tracing::info!(store = %found, "store found");
            }
            Ok(Arc::new(store))
        }
        // Down now: start degraded under the failure policies, and connect when it is back.
        Err(e @ ConnectError::Unreachable { .. }) => {
            tracing::warn!(error = %e, "starting degraded: limits decide by their failure policies until the store answers");
            let store =
                RedisStore::connect_later(target, clock).map_err(|e| StartError::Store(e.to_string()))?;
            Ok(Arc::new(store))
        }
        Err(e) => Err(StartError::Store(e.to_string())),
    }
}

/// What `tollgate check-store` prints: the store `args` name, connected as `serve` would on
/// `clock`, in one line; or why it can't serve.
pub async fn check_store(args: &crate::config::StoreArgs, clock: ClockSource) -> Result<String, String> {
    let url = StoreUrl::parse(&args.url)?;
    let mut cfg = GatewayConfig::new(tollgate_rules::RulesSource::demo());
    cfg.store_access = args.access(&url)?;
    cfg.store = url;
    let Some(target) = cfg.store_target() else {
        return Ok("memory: the embedded store, in this process; nothing to check".into());
    };
    let clock = match clock {
        ClockSource::Store => None,
        ClockSource::Gateway => Some(cfg.clock.clone()),
    };
    let store = RedisStore::connect(target, clock)
        .await
        .map_err(|e| e.to_string())?;
    let found = store.found().ok_or("the store was not surveyed")?;
    if found.uncovered_slots > 0 {
        return Err(format!(
            "{found}: a cluster without full coverage can't serve those slots' checks"
        ));
    }
    Ok(found.to_string())
}

/// The running rules' limit names, for the store guard's metrics.
fn limit_names(rules: Arc<ArcSwap<Snapshot>>) -> tollgate_store::guard::LimitNames {
    Arc::new(move |li| {
        rules
            .load()
            .limits
            .get(li as usize)
            .map_or_else(|| Arc::from("?"), |l| l.name.clone())
    })
}
