//! The listeners phase of start-up, the last: the public listener (one per shard) and the
//! admin listener bound and serving the built gateway.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

use crate::admin::Admin;
use crate::config::{GatewayConfig, StartError};
use crate::request::Gateway;
use crate::server::{self, ServerLimits, stopped, tls};
use tollgate_telemetry::metrics::Metrics;

/// The listeners serving, and where.
pub(super) struct Serving {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    /// Each resolves, once the stop signal has been sent and its connections have ended, to
    /// the connections it left open.
    pub tasks: Vec<JoinHandle<usize>>,
}

/// The TLS acceptor of `--tls-cert` and `--tls-key`, read before anything else starts so a bad
/// certificate stops start-up first.
pub(super) fn acceptor(cfg: &GatewayConfig) -> Result<Option<TlsAcceptor>, StartError> {
    match &cfg.tls {
        Some((cert, key)) => Ok(Some(tls::acceptor(cert, key)?)),
        None => Ok(None),
    }
}

/// Binds the public listener and, with `admin`, the admin listener, and serves them.
pub(super) async fn serve(
    cfg: &GatewayConfig,
    tls: Option<TlsAcceptor>,
    gateway: Arc<Gateway>,
    admin: Option<Admin>,
    metrics: &Metrics,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Serving, StartError> {
    let bind_err = |addr| move |source| StartError::Bind { addr, source };
    let listeners = server::bind_shards(cfg.listen, cfg.shards).map_err(bind_err(cfg.listen))?;
    let addr = listeners[0].local_addr().map_err(bind_err(cfg.listen))?;
    let admin_bound = match cfg.admin_listen {
        Some(a) => {
            let l = TcpListener::bind(a).await.map_err(bind_err(a))?;
            let addr = l.local_addr().map_err(bind_err(a))?;
            Some((l, addr))
        }
        None => None,
    };
    let serving = server::run_shards(
        listeners,
        tls,
        gateway,
        cfg.limits.clone(),
        conn_counters(metrics),
        stop_rx.clone(),
    )
    .map_err(bind_err(cfg.listen))?;
    let mut tasks = vec![tokio::spawn(serving)];
    let admin_addr = match (admin_bound, admin) {
        (Some((l, a)), Some(handler)) => {
            tasks.extend(serve_admin(l, handler, cfg.limits.uncapped(), stop_rx));
            Some(a)
        }
        _ => None,
    };
    Ok(Serving {
        addr,
        admin_addr,
        tasks,
    })
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
