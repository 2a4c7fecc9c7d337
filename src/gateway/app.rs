//! Assembles a running gateway from a validated configuration: rules, store, listeners, the
//! demo upstream, and one shutdown signal for all of them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::Admin;
use crate::config::StoreUrl;
pub use crate::config::{GatewayConfig, MeterConfig, StartError};
use crate::demo_instances::DemoInstances;
use crate::otel::Otel;
use crate::regions::{RegionTasks, Regions};
use crate::reload::{Reloader, WatchHandle};
use crate::request::{Gateway, Parts};
use crate::server::{self, ServerLimits, stopped, tls};
use fred::interfaces::ClientLike;
use tollgate_meter::counter::{self, Meter, Sink};
use tollgate_meter::record::Identity;
use tollgate_meter::sink::{FlagSource, RedisSink, SqliteSink};
use tollgate_rules::{CompileOptions, Snapshot};
pub use tollgate_rules::{RulesLoader, RulesSource};
use tollgate_store::Store;
use tollgate_store::guard::Guard;
use tollgate_store::lease::Leases;
use tollgate_store::memory::MemoryStore;
use tollgate_store::redis::{Target, side_client};
use tollgate_store::seats::RedisSeats;
use tollgate_telemetry::metrics::Metrics;

/// The keys made through the admin API, loaded and put in place before anything serves: in
/// the store's Redis, or in the keys file on the embedded store. A Redis Cluster store has
/// none yet.
async fn start_managed_keys(
    cfg: &GatewayConfig,
    reloader: &Arc<Reloader>,
    rules: &Arc<ArcSwap<Snapshot>>,
    metrics: &Arc<Metrics>,
) -> Result<Option<Arc<crate::managed::ManagedKeys>>, StartError> {
    use tollgate_keys::KeyStore;
    let store = match &cfg.store {
        StoreUrl::Memory => match &cfg.keys_file {
            Some(file) => KeyStore::Sqlite(
                tollgate_keys::sqlite::SqliteKeys::open(file).map_err(|e| {
                    StartError::Keys(format!(
                        "{e}; name a file the gateway can write with --keys-file (TOLLGATE_KEYS_FILE), which by default sits beside --meter-file (TOLLGATE_METER_FILE)"
                    ))
                })?,
            ),
            None => return Ok(None),
        },
        StoreUrl::Redis(url) => {
            let client = side_client(Target::Node(url)).map_err(StartError::Store)?;
            let _task = client.connect();
            KeyStore::Redis(tollgate_keys::redis::RedisKeys::new(client))
        }
        StoreUrl::RedisCluster(_) => {
            tracing::warn!(
                "keys made through the admin API need one Redis node or the embedded store; the key API is off on a Redis Cluster store"
            );
            return Ok(None);
        }
    };
    let keys = crate::managed::ManagedKeys::start(
        store,
        reloader.clone(),
        rules.clone(),
        metrics.clone(),
        cfg.clock.clone(),
    )
    .await
    .map_err(StartError::Keys)?;
    Ok(Some(keys))
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
    tasks: Vec<JoinHandle<usize>>,
    /// Stopped after the listeners, so the last records hold every admitted request.
    meter_task: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    flag_task: Option<JoinHandle<()>>,
    region_tasks: Option<RegionTasks>,
    /// Renews the leases of seats held in Redis; stops with the listeners.
    seat_renewal: Option<JoinHandle<()>>,
    /// The span exporter; flushed once the listeners have finished.
    otel: Option<Arc<Otel>>,
    /// Set when the drain begins: `/readyz` then answers 503.
    draining: Arc<std::sync::atomic::AtomicBool>,
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
        self.draining.store(true, std::sync::atomic::Ordering::SeqCst);
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
        for t in self.tasks {
            open += t.await.unwrap_or(1);
        }
        if let Some(t) = &self.flag_task {
            t.abort();
        }
        if let Some(o) = self.otel {
            o.shutdown().await;
        }
        if let Some(r) = self.region_tasks {
            r.stop().await;
        }
        if let Some(t) = self.seat_renewal {
            t.abort();
        }
        if let Some((stop, task)) = self.meter_task {
            let _ = stop.send(true);
            if tokio::time::timeout(METER_END, task).await.is_err() {
                tracing::error!(
                    "the last usage records were not written in time; the meter reports an unclean end"
                );
            }
        }
        if let Some(l) = &self.leases {
            let back = l.drain(LEASE_DRAIN).await;
            tracing::info!(tokens = back, "leased tokens given back");
        }
        open
    }
}

/// How long shutdown waits for the last usage records.
const METER_END: Duration = Duration::from_secs(6);

/// How long shutdown waits for lease and give-back calls to finish.
const LEASE_DRAIN: Duration = Duration::from_secs(3);

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

/// Starts counting for billing: records go to the Redis store's stream, or to the SQLite file
/// beside the embedded store. A Redis store that is down now only delays records: the sink
/// connects in the background and every flush retries with the newest totals.
async fn start_meter(m: &MeterConfig, store: &StoreUrl) -> Result<Metering, StartError> {
    let (sink, flags): (Arc<dyn Sink>, Arc<dyn FlagSource>) = match store {
        StoreUrl::Memory => {
            let s = Arc::new(SqliteSink::open(&m.file).map_err(|e| {
                StartError::Meter(format!(
                    "{e}; name a file the gateway can write with --meter-file (TOLLGATE_METER_FILE), or count nothing with --no-meter"
                ))
            })?);
            (s.clone(), s)
        }
        StoreUrl::Redis(url) => {
            let s = redis_sink(Target::Node(url))?;
            (s.clone(), s)
        }
        StoreUrl::RedisCluster(nodes) => {
            let s = redis_sink(Target::Cluster(nodes))?;
            (s.clone(), s)
        }
    };
    let meter = Meter::new(Identity::new(m.instance.clone()));
    tracing::info!(identity = %meter.identity(), every = ?m.interval, "metering admitted requests");
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(counter::run(meter.clone(), sink, m.interval, stop_rx));
    Ok(Metering {
        meter,
        task: (stop, task),
        flags,
    })
}

/// A running meter: its counts, the task that writes them, and where quota flags come from.
struct Metering {
    meter: Arc<Meter>,
    task: (watch::Sender<bool>, JoinHandle<()>),
    flags: Arc<dyn FlagSource>,
}

fn redis_sink(target: Target<'_>) -> Result<Arc<RedisSink>, StartError> {
    let client = side_client(target).map_err(|e| StartError::Meter(format!("{target}: {e}")))?;
    Ok(Arc::new(RedisSink::start(client)))
}

/// The least a seat's take may wait for Redis: it rides its own connection, not the check's.
const SEAT_TIMEOUT: Duration = Duration::from_millis(50);

/// How often a gateway reads the quota flags.
const FLAG_READ: Duration = Duration::from_secs(1);

/// The gateway itself over its rules and store: its upstream client's timeouts, spans, access
/// log, metering and quota flags, Regions and seats, with the tasks that keep them.
async fn assemble(
    cfg: &GatewayConfig,
    rules: &Arc<ArcSwap<Snapshot>>,
    store: &Arc<dyn Store>,
    metrics: &Arc<Metrics>,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Assembled, StartError> {
    let mut parts = Parts::new(rules.clone(), store.clone(), cfg.trusted.clone(), metrics.clone());
    parts.body_timeout = cfg.limits.body_read_timeout;
    parts.drain_within = cfg.limits.header_read_timeout;
    parts.clock = cfg.clock.clone();
    if let Some(file) = &cfg.hosts_file {
        parts.names =
            Arc::new(crate::proxy::names::Names::with_hosts_file(file).map_err(StartError::HostsFile)?);
    }
    let otel = match &cfg.otlp {
        Some(o) => Some(Arc::new(
            Otel::start(o, metrics.otlp_spans_dropped.clone()).map_err(StartError::Otlp)?,
        )),
        None => None,
    };
    parts.otel = otel.clone();
    parts.access = cfg.access_log.clone();
    let (meter, meter_task, flag_task) = match &cfg.meter {
        Some(m) => {
            let metering = start_meter(m, &cfg.store).await?;
            let follow = tokio::spawn(tollgate_meter::flags::follow(
                metering.flags,
                parts.quota_flags.clone(),
                FLAG_READ,
            ));
            (Some(metering.meter), Some(metering.task), Some(follow))
        }
        None => (None, None, None),
    };
    parts.meter = meter.clone();
    let (regions, region_tasks) = match &cfg.regions {
        Some(rc) => {
            let r = Regions::connect(rc.clone()).map_err(StartError::Regions)?;
            warn_home_regions(&rules.load(), rc);
            let tasks = crate::regions::start(r.clone(), rules.clone());
            tracing::info!(region = %rc.region, holder = %rc.holder, every = ?rc.interval, "sharing global limits across Regions");
            (Some(r), Some(tasks))
        }
        None => {
            if rules
                .load()
                .limits
                .iter()
                .any(|l| l.scope == tollgate_rules::Scope::Global)
            {
                tracing::warn!(
                    "the rules have global limits but this gateway has no --region: it enforces each of them whole"
                );
            }
            (None, None)
        }
    };
    parts.regions = regions.clone();
    // Seats of limits on requests in flight live beside the buckets: in Redis for a fleet.
    let seat_renewal = match &cfg.store {
        StoreUrl::Memory => None,
        StoreUrl::Redis(url) => Some(side_client(Target::Node(url))),
        StoreUrl::RedisCluster(nodes) => Some(side_client(Target::Cluster(nodes))),
    }
    .map(|client| -> Result<_, StartError> {
        let client = client.map_err(StartError::Store)?;
        let seats = RedisSeats::new(client, cfg.seat_lease, cfg.store_timeout.max(SEAT_TIMEOUT));
        parts.seats = seats.clone();
        Ok(tokio::spawn(seats.renew(stop_rx.clone())))
    })
    .transpose()?;
    Ok(Assembled {
        quota_flags: parts.quota_flags.clone(),
        gateway: Arc::new(Gateway::new(parts)),
        otel,
        meter,
        meter_task,
        flag_task,
        regions,
        region_tasks,
        seat_renewal,
    })
}

/// A gateway assembled, with what `Running` keeps of its parts.
struct Assembled {
    gateway: Arc<Gateway>,
    otel: Option<Arc<Otel>>,
    meter: Option<Arc<Meter>>,
    meter_task: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    flag_task: Option<JoinHandle<()>>,
    regions: Option<Arc<Regions>>,
    region_tasks: Option<RegionTasks>,
    seat_renewal: Option<JoinHandle<()>>,
    quota_flags: Arc<ArcSwap<tollgate_meter::flags::Flags>>,
}

/// The demo's upstream instances on ports of their own, every upstream pointed at them.
async fn start_demo_upstream(
    cfg: &GatewayConfig,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Arc<DemoInstances>, StartError> {
    DemoInstances::start(cfg.demo_targets, cfg.limits.uncapped(), stop_rx.clone())
        .await
        .map_err(|source| StartError::Bind {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            source,
        })
}

/// The rules, loaded now and again whenever their file changes (or on SIGHUP).
fn live_rules(
    cfg: &GatewayConfig,
    demo_upstreams: &[SocketAddr],
    with_tls: bool,
    metrics: &Arc<Metrics>,
) -> Result<LiveRules, StartError> {
    let loader = RulesLoader {
        source: cfg.rules.clone(),
        opts: CompileOptions::default(),
        upstream_override: demo_upstreams
            .iter()
            .map(|a| {
                a.to_string()
                    .parse()
                    .expect("a socket address is a valid authority")
            })
            .collect(),
    };
    let snapshot = loader.load()?;
    if !with_tls {
        warn_fingerprints_without_tls(&snapshot);
    }
    let rules = Arc::new(ArcSwap::from_pointee(snapshot));
    let reloader = Arc::new(Reloader::new(loader, rules.clone(), metrics.clone()));
    let watch = reloader
        .watch(Duration::from_millis(100))
        .map_err(StartError::Watch)?;
    Ok(LiveRules {
        rules,
        reloader,
        watch,
    })
}

/// The rules a gateway serves, what reloads them, and the file watch that asks it to.
struct LiveRules {
    rules: Arc<ArcSwap<Snapshot>>,
    reloader: Arc<Reloader>,
    watch: WatchHandle,
}

/// The admin listener and its dashboard's once-a-second sampler. The caps are the public
/// listener's: an operator reaches a full gateway's admin.
fn serve_admin(
    l: TcpListener,
    handler: Admin,
    limits: ServerLimits,
    stop_rx: &watch::Receiver<bool>,
) -> [JoinHandle<usize>; 2] {
    let sampler = handler.gateway.dashboard().clone().run(
        handler.rules.clone(),
        handler.metrics.clone(),
        stop_rx.clone(),
    );
    [
        tokio::spawn(async move {
            sampler.await;
            0
        }),
        tokio::spawn(server::run(
            l,
            None,
            Arc::new(handler),
            limits.uncapped(),
            stopped(stop_rx.clone()),
        )),
    ]
}

/// The connection counts the listeners keep, in the gateway's metrics.
fn conn_counters(metrics: &Metrics) -> server::conns::ConnCounters {
    server::conns::ConnCounters {
        refused: metrics.connections_refused.clone(),
        evicted: metrics.connections_evicted.clone(),
        open: metrics.connections_open.clone(),
        idle: metrics.connections_idle.clone(),
        accepted: metrics.connections_accepted.clone(),
        proxy_refused: metrics.proxy_protocol_refused.clone(),
    }
}

/// The public listener (one per shard) and its address, and the admin listener's, bound
/// before anything serves.
async fn bind_listeners(
    cfg: &GatewayConfig,
) -> Result<
    (
        Vec<std::net::TcpListener>,
        SocketAddr,
        Option<(TcpListener, SocketAddr)>,
    ),
    StartError,
> {
    let bind_err = |addr| move |source| StartError::Bind { addr, source };
    let listeners = server::bind_shards(cfg.listen, cfg.shards).map_err(bind_err(cfg.listen))?;
    let addr = listeners[0].local_addr().map_err(bind_err(cfg.listen))?;
    let admin = match cfg.admin_listen {
        Some(a) => {
            let l = bind(a).await?;
            let addr = l.local_addr().map_err(bind_err(a))?;
            Some((l, addr))
        }
        None => None,
    };
    Ok((listeners, addr, admin))
}

/// Starts every listener. Fails before serving anything if a part can't start.
pub async fn start(cfg: GatewayConfig) -> Result<Running, StartError> {
    // Before anything keeps state per shard.
    crate::shard::set_count(cfg.shards);
    let tls = match &cfg.tls {
        Some((cert, key)) => Some(tls::acceptor(cert, key)?),
        None => None,
    };
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();

    let demo = if cfg.demo {
        Some(start_demo_upstream(&cfg, &stop_rx).await?)
    } else {
        None
    };
    let demo_upstreams = demo.as_ref().map(|d| d.addrs()).unwrap_or_default();
    let demo_upstream = demo_upstreams.first().copied();

    let metrics = Metrics::new();
    let LiveRules {
        rules,
        reloader,
        watch,
    } = live_rules(&cfg, &demo_upstreams, tls.is_some(), &metrics)?;

    let crate::stack::StoreStack {
        store,
        memory,
        guard,
        leases,
    } = crate::stack::build(&cfg, &rules, &metrics).await?;
    let keys = start_managed_keys(&cfg, &reloader, &rules, &metrics).await?;
    tasks.extend(keys.clone().map(|k| {
        let stop = stopped(stop_rx.clone());
        tokio::spawn(async move {
            k.follow(stop).await;
            0
        })
    }));

    let (listeners, addr, admin) = bind_listeners(&cfg).await?;

    let Assembled {
        gateway,
        otel,
        meter,
        meter_task,
        flag_task,
        regions,
        region_tasks,
        seat_renewal,
        quota_flags,
    } = assemble(&cfg, &rules, &store, &metrics, &stop_rx).await?;
    tasks.push(tokio::spawn(sweep_upstreams(
        gateway.clone(),
        stopped(stop_rx.clone()),
    )));
    tasks.push(tokio::spawn(check_targets(
        gateway.clone(),
        stopped(stop_rx.clone()),
    )));
    // Every target name is looked up once before anything is served, then followed.
    gateway.follow_names().await;
    tasks.push(tokio::spawn(follow_names(
        gateway.clone(),
        stopped(stop_rx.clone()),
    )));
    let draining = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let serving = server::run_shards(
        listeners,
        tls,
        gateway.clone(),
        cfg.limits.clone(),
        conn_counters(&metrics),
        stop_rx.clone(),
    )
    .map_err(|source| StartError::Bind {
        addr: cfg.listen,
        source,
    })?;
    tasks.push(tokio::spawn(serving));
    let admin_addr = match admin {
        Some((l, a)) => {
            let handler = Admin {
                rules: rules.clone(),
                store: store.clone(),
                metrics: metrics.clone(),
                meter: meter.clone(),
                quota_flags,
                clock: cfg.clock.clone(),
                regions,
                gateway: gateway.clone(),
                reloader: reloader.clone(),
                hosts: cfg.admin_hosts.clone(),
                token: cfg.admin_token.clone(),
                keys,
                draining: draining.clone(),
                demo: demo.clone(),
            };
            tasks.extend(serve_admin(l, handler, cfg.limits.uncapped(), &stop_rx));
            Some(a)
        }
        None => None,
    };

    Ok(Running {
        addr,
        admin_addr,
        demo_upstream,
        demo_upstreams,
        rules,
        store,
        memory,
        guard,
        leases,
        metrics,
        reloader,
        meter,
        _watch: watch,
        stop,
        tasks,
        meter_task,
        flag_task,
        region_tasks,
        seat_renewal,
        otel,
        draining,
        shutdown_delay: cfg.shutdown_delay,
    })
}

/// Without TLS every connection's fingerprint is `none`, so a fingerprint limit is one bucket
/// for all its clients together: allowed (behind a proxy that ends TLS that may be meant), but
/// said once at start.
fn warn_fingerprints_without_tls(snap: &Snapshot) {
    for l in &snap.limits {
        if l.dimension == tollgate_rules::Dimension::Fingerprint {
            tracing::warn!(limit = %l.name, "a fingerprint limit without --tls-cert: every client's fingerprint is \"none\", so all of them share one bucket");
        }
    }
}

/// Names a home Region the flags don't know, once at start.
fn warn_home_regions(snap: &Snapshot, rc: &crate::regions::RegionsConfig) {
    for l in &snap.limits {
        if let Some(home) = &l.home_region
            && !rc.stores.contains_key(&**home)
        {
            tracing::warn!(limit = %l.name, home = %home, "a security limit's home Region is not among --regions; it is checked in this Region's store");
        }
    }
}
