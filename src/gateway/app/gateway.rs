//! The gateway phase of start-up: the `Gateway` built from its `Parts` over the rules and the
//! store, with the parts it needs that hold no task yet: the upstream client's timeouts, the
//! hosts file, spans, the access log, the meter and its sink, Regions and seats. Their tasks
//! start in the next phase (`tasks`).

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::{GatewayConfig, MeterConfig, StartError};
use crate::otel::Otel;
use crate::proxy::names::Names;
use crate::regions::{Regions, RegionsConfig};
use crate::request::{Gateway, Parts};
use tollgate_meter::counter::{Meter, Sink};
use tollgate_meter::flags::Flags;
use tollgate_meter::record::Identity;
use tollgate_meter::sink::{FlagSource, RedisSink, SqliteSink};
use tollgate_rules::{Scope, Snapshot};
use tollgate_store::Store;
use tollgate_store::redis::{Target, side_client};
use tollgate_store::seats::RedisSeats;
use tollgate_telemetry::metrics::Metrics;

/// The least a seat's take may wait for Redis: it rides its own connection, not the check's.
const SEAT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(50);

/// A gateway built, with the parts its tasks and `Running` keep.
pub(super) struct Built {
    pub gateway: Arc<Gateway>,
    pub otel: Option<Arc<Otel>>,
    pub metering: Option<Metering>,
    pub regions: Option<Arc<Regions>>,
    /// Seats of limits on requests in flight, when they live in Redis.
    pub seats: Option<Arc<RedisSeats>>,
    pub quota_flags: Arc<ArcSwap<Flags>>,
}

/// The meter's counts, where they are written, and where quota flags are read.
pub(super) struct Metering {
    pub meter: Arc<Meter>,
    pub sink: Arc<dyn Sink>,
    pub flags: Arc<dyn FlagSource>,
    pub every: std::time::Duration,
}

/// Builds the gateway over `rules` and `store`. Every target name is looked up once here, so
/// the first request finds its addresses.
pub(super) async fn build(
    cfg: &GatewayConfig,
    rules: &Arc<ArcSwap<Snapshot>>,
    store: &Arc<dyn Store>,
    metrics: &Arc<Metrics>,
) -> Result<Built, StartError> {
    let mut parts = Parts::new(rules.clone(), store.clone(), cfg.trusted.clone(), metrics.clone());
    parts.body_timeout = cfg.limits.body_read_timeout;
    parts.drain_within = cfg.limits.header_read_timeout;
    parts.clock = cfg.clock.clone();
    if let Some(file) = &cfg.hosts_file {
        parts.names = Arc::new(Names::with_hosts_file(file).map_err(StartError::HostsFile)?);
    }
    let otel = match &cfg.otlp {
        Some(o) => Some(Arc::new(
            Otel::start(o, metrics.otlp_spans_dropped.clone()).map_err(StartError::Otlp)?,
        )),
        None => None,
    };
    parts.otel = otel.clone();
    parts.access = cfg.access_log.clone();
    let metering = match &cfg.meter {
        Some(m) => Some(open_meter(m, cfg)?),
        None => None,
    };
    parts.meter = metering.as_ref().map(|m| m.meter.clone());
    let regions = match &cfg.regions {
        Some(rc) => {
            warn_home_regions(&rules.load(), rc);
            Some(Regions::connect(rc.clone()).map_err(StartError::Regions)?)
        }
        None => {
            warn_global_without_regions(&rules.load());
            None
        }
    };
    parts.regions = regions.clone();
    let seats = redis_seats(cfg)?;
    if let Some(s) = &seats {
        parts.seats = s.clone();
    }
    let quota_flags = parts.quota_flags.clone();
    let gateway = Arc::new(Gateway::new(parts));
    gateway.follow_names().await;
    Ok(Built {
        gateway,
        otel,
        metering,
        regions,
        seats,
        quota_flags,
    })
}

/// Counting for billing: records go to the Redis store's stream, or to the SQLite file beside
/// the embedded store. A Redis store that is down now only delays records: the sink connects
/// in the background and every flush retries with the newest totals.
fn open_meter(m: &MeterConfig, cfg: &GatewayConfig) -> Result<Metering, StartError> {
    let (sink, flags): (Arc<dyn Sink>, Arc<dyn FlagSource>) = match cfg.store_target() {
        None => {
            let s = Arc::new(SqliteSink::open(&m.file).map_err(|e| {
                StartError::Meter(format!(
                    "{e}; name a file the gateway can write with --meter-file (TOLLGATE_METER_FILE), or count nothing with --no-meter"
                ))
            })?);
            (s.clone(), s)
        }
        Some(target) => {
            let s = redis_sink(target)?;
            (s.clone(), s)
        }
    };
    Ok(Metering {
        meter: Meter::new(Identity::new(m.instance.clone())),
        sink,
        flags,
        every: m.interval,
    })
}

fn redis_sink(target: Target<'_>) -> Result<Arc<RedisSink>, StartError> {
    let client = side_client(target).map_err(|e| StartError::Meter(format!("{target}: {e}")))?;
    Ok(Arc::new(RedisSink::start(client)))
}

/// Seats of limits on requests in flight live beside the buckets: in Redis for a fleet.
fn redis_seats(cfg: &GatewayConfig) -> Result<Option<Arc<RedisSeats>>, StartError> {
    let Some(target) = cfg.store_target() else {
        return Ok(None);
    };
    let client = side_client(target).map_err(StartError::Store)?;
    Ok(Some(RedisSeats::new(
        client,
        cfg.seat_lease,
        cfg.store_timeout.max(SEAT_TIMEOUT),
    )))
}

/// Names a home Region the flags don't know, once at start.
fn warn_home_regions(snap: &Snapshot, rc: &RegionsConfig) {
    for l in &snap.limits {
        if let Some(home) = &l.home_region
            && !rc.stores.contains_key(&**home)
        {
            tracing::warn!(limit = %l.name, home = %home, "a security limit's home Region is not among --regions; it is checked in this Region's store");
        }
    }
}

/// Global limits on a gateway outside Regions are enforced whole: said once at start.
fn warn_global_without_regions(snap: &Snapshot) {
    if snap.limits.iter().any(|l| l.scope == Scope::Global) {
        tracing::warn!(
            "the rules have global limits but this gateway has no --region: it enforces each of them whole"
        );
    }
}
