//! The rules phase of start-up: the rules file loaded and watched, the demo's upstream it may
//! point at, and the keys made through the admin API put in place beside the file's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use fred::interfaces::ClientLike;
use tokio::sync::watch;

use crate::config::{GatewayConfig, StartError};
use crate::demo_instances::DemoInstances;
use crate::managed::ManagedKeys;
use crate::reload::{Reloader, WatchHandle};
use tollgate_keys::KeyStore;
use tollgate_rules::{CompileOptions, RulesLoader, Snapshot};
use tollgate_store::redis::side_client;
use tollgate_telemetry::metrics::Metrics;

/// The demo's upstream instances on ports of their own, when `--demo` asks for them: the rules
/// point every upstream at them, so they listen before the rules load.
pub(super) async fn demo_upstream(
    cfg: &GatewayConfig,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Option<Arc<DemoInstances>>, StartError> {
    if !cfg.demo {
        return Ok(None);
    }
    DemoInstances::start(cfg.demo_targets, cfg.limits.uncapped(), stop_rx.clone())
        .await
        .map(Some)
        .map_err(|source| StartError::Bind {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            source,
        })
}

/// The rules a gateway serves, what reloads them, and the file watch that asks it to.
pub(super) struct LiveRules {
    pub rules: Arc<ArcSwap<Snapshot>>,
    pub reloader: Arc<Reloader>,
    pub watch: WatchHandle,
}

/// The rules, loaded now and again whenever their file changes (or on SIGHUP).
pub(super) fn live(
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
    let reloader = Arc::new(
        Reloader::new(loader, rules.clone(), metrics.clone())
            .with_store_credentials(cfg.store_access.credentials.clone()),
    );
    let watch = reloader
        .watch(Duration::from_millis(100))
        .map_err(StartError::Watch)?;
    Ok(LiveRules {
        rules,
        reloader,
        watch,
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

/// The keys made through the admin API, loaded and put in place before anything serves: in
/// the store's Redis, or in the keys file on the embedded store. Following their changes is a
/// task (`tasks::spawn`).
pub(super) async fn managed_keys(
    cfg: &GatewayConfig,
    live: &LiveRules,
    metrics: &Arc<Metrics>,
) -> Result<Option<Arc<ManagedKeys>>, StartError> {
    let store = match cfg.store_target() {
        None => match &cfg.keys_file {
            Some(file) => KeyStore::Sqlite(
                tollgate_keys::sqlite::SqliteKeys::open(file).map_err(|e| {
                    StartError::Keys(format!(
                        "{e}; name a file the gateway can write with --keys-file (TOLLGATE_KEYS_FILE), which by default sits beside --meter-file (TOLLGATE_METER_FILE)"
                    ))
                })?,
            ),
            None => return Ok(None),
        },
        // A node, a Sentinel's primary or a cluster: on a cluster the keys share a hash tag.
        Some(target) => {
            let client = side_client(target).map_err(StartError::Store)?;
            let _task = client.connect();
            KeyStore::Redis(tollgate_keys::redis::RedisKeys::new(client))
        }
    };
    let keys = ManagedKeys::load(
        store,
        live.reloader.clone(),
        live.rules.clone(),
        metrics.clone(),
        cfg.clock.clone(),
    )
    .await
    .map_err(StartError::Keys)?;
    Ok(Some(keys))
}
