//! Accepting connections: TCP or TLS, HTTP/1.1 and HTTP/2 (h2c prior knowledge or ALPN) on one
//! port, and a graceful drain on shutdown.

pub mod conns;
pub(crate) mod idle;
pub(crate) mod proxy_protocol;
pub mod smuggling;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

use crate::respond::Body;
use conns::{ConnCounters, ConnEntry, Conns};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use smuggling::{FlaggedHeads, Watched};
use tollgate_hello::Fingerprint;
use tollgate_telemetry::metrics::ShardLabel;

/// The connection a request arrived on.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    /// `http` or `https`.
    pub proto: &'static str,
    /// What the smuggling watcher saw of each request's raw head: made when hyper takes the
    /// connection, so a connection the express lane serves doesn't carry one (issue 24).
    pub(crate) flagged_heads: Option<Arc<FlaggedHeads>>,
    /// The client fingerprint of its TLS ClientHello (`none` on plain TCP), taken once before
    /// the handshake.
    pub fingerprint: Fingerprint,
    /// Its place under `--max-connections` and `--max-connections-per-ip`, when either is set:
    /// a path serving the connection says when a request begins and ends, so that only an idle
    /// connection is closed for a newcomer.
    pub(crate) entry: Option<Arc<ConnEntry>>,
}

impl std::fmt::Debug for ConnEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnEntry")
    }
}

/// Anything that answers requests: the gateway, the admin endpoints, the demo upstream.
pub trait Handler: Send + Sync + 'static {
    fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        conn: ConnInfo,
    ) -> impl Future<Output = Response<Body>> + Send;

    /// Whether this handler serves HTTP/1.1 connections (plain, or TLS without h2) itself
    /// first ([`Handler::serve_lane`]).
    fn has_lane(&self) -> bool {
        false
    }

    /// Serves an HTTP/1.1 connection, plain TCP or TLS, on a fast path of its own until the
    /// client closes, the server stops, or a request needs the general path; then hands the
    /// connection, with every byte read so far, to hyper. It borrows what the connection's
    /// task holds anyway, so an idle connection keeps one copy of each (issue 24).
    fn serve_lane<'a, S: LaneIo>(
        &'a self,
        io: S,
        _info: &'a ConnInfo,
        _limits: &'a ServerLimits,
        _stop: &'a mut tokio::sync::watch::Receiver<bool>,
    ) -> impl Future<Output = Ended<S>> + Send + 'a {
        std::future::ready(Ended::HandOff(Prefixed::new(bytes::Bytes::new(), io)))
    }

    /// The drain's last step, once every shard's requests in flight have finished: the
    /// connections this handler took over after an upgrade get `grace` to end, then are
    /// closed. Resolves to how many were closed. Each relay runs on the runtime of the shard
    /// that accepted its connection, so the shards keep running until this resolves.
    fn close_upgraded(&self, _grace: Duration) -> impl Future<Output = usize> + Send {
        std::future::ready(0)
    }
}

/// A client connection the lane can serve: its bytes, and the TCP socket under them, whose
/// readiness says when an idle connection has something to read and whose peek says when the
/// client hung up. On TLS both see records, not requests: readiness only wakes the lane to
/// read through rustls, and a peek of nothing is still the end of the stream.
pub trait LaneIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    fn tcp(&self) -> &TcpStream;
}

impl LaneIo for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl LaneIo for tokio_rustls::server::TlsStream<TcpStream> {
    fn tcp(&self) -> &TcpStream {
        self.get_ref().0
    }
}

/// Connection limits that protect the server itself, and how a connection's first bytes are
/// read.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    /// A client must finish sending its request headers within this time, from the head's
    /// first byte on the express lane and the watcher of hyper's path.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and nothing read for this long is closed, on
    /// every path and protocol (upgraded connections excepted: their route's own timeout).
    pub idle_timeout: Duration,
    /// A client must send each next piece of a request body within this time; past it, 408.
    pub body_read_timeout: Duration,
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// How long to wait for requests in flight after the shutdown signal.
    pub drain_timeout: Duration,
    /// After that, how long upgraded connections may stay open before they are closed.
    pub upgrade_grace: Duration,
    /// Largest request head accepted; larger gets 431.
    pub max_header_bytes: usize,
    /// Whether plain HTTP/1.1 connections start on the express lane (when the handler has one).
    pub express: bool,
    /// Most client connections open at once; `None`: no cap (`conns`).
    pub max_connections: Option<u32>,
    /// Most client connections open at once from one IP (the TCP peer); `None`: no cap.
    pub max_connections_per_ip: Option<u32>,
    /// `--proxy-protocol`: the peers whose connections start with a PROXY protocol header
    /// naming the client (`server::proxy_protocol`); `None`: no connection may send one.
    pub proxy_protocol: Option<Arc<tollgate_rules::identity::TrustedProxies>>,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(75),
            body_read_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            upgrade_grace: Duration::from_secs(10),
            max_header_bytes: 32 * 1024,
            express: true,
            max_connections: None,
            max_connections_per_ip: None,
            proxy_protocol: None,
        }
    }
}

impl ServerLimits {
    /// These limits without the connection caps and the PROXY protocol, which are the public
    /// listener's: for the admin listener and the demo upstream.
    pub(crate) fn uncapped(&self) -> ServerLimits {
        ServerLimits {
            max_connections: None,
            max_connections_per_ip: None,
            proxy_protocol: None,
            ..self.clone()
        }
    }
}

fn builder(limits: &ServerLimits) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        // The watcher answers 408 at the head timeout (`smuggling::Watched`); hyper's own, which
        // closes without a word, is the backstop. Its clock starts when the last answer is out,
        // not at a head's first byte, so it must also outlast the idle timeout.
        .header_read_timeout(limits.header_read_timeout.max(limits.idle_timeout) + Duration::from_secs(2))
        .max_buf_size(limits.max_header_bytes.max(8192));
    b.http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_bytes as u32);
    b
}

/// Serves `handler` on `listener` until `shutdown` resolves, then stops accepting and waits up
/// to the drain timeout for connections in flight. Returns how many connections were still
/// open when the drain gave up.
pub async fn run<H: Handler>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: Arc<H>,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()>,
) -> usize {
    run_counted(listener, tls, handler, limits, ConnCounters::default(), shutdown).await
}

/// [`run`], counting connections refused or closed under the connection caps in `counters`.
pub(crate) async fn run_counted<H: Handler>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: Arc<H>,
    limits: ServerLimits,
    counters: ConnCounters,
    shutdown: impl Future<Output = ()>,
) -> usize {
    let accepted = counters.accepted.get_or_create(&ShardLabel { shard: 0 }).clone();
    let proxy_refused = counters.proxy_refused.clone();
    let conns = Conns::new(limits.max_connections, limits.max_connections_per_ip, counters);
    let tally = Tally {
        accepted,
        closing: Closing::new(1),
        proxy_refused,
    };
    serve_listener(listener, tls, handler, limits, conns, tally, shutdown).await
}

/// What one listener counts: its accepted connections, and its part in its address's closing.
struct Tally {
    accepted: Counter,
    closing: Arc<Closing>,
    proxy_refused: Family<tollgate_telemetry::metrics::ReasonLabel, Counter>,
}

/// The listeners of one address, one per shard: the last to stop accepting logs that the
/// address is closed, with every shard's open connections. One line per shard would say it
/// while the others still accept.
struct Closing {
    accepting: std::sync::atomic::AtomicUsize,
    open: std::sync::atomic::AtomicUsize,
}

impl Closing {
    fn new(listeners: usize) -> Arc<Closing> {
        Arc::new(Closing {
            accepting: listeners.into(),
            open: 0.into(),
        })
    }

    /// One listener has stopped accepting, with `open` connections still to drain.
    fn stopped(&self, addr: &str, open: usize) {
        use std::sync::atomic::Ordering::AcqRel;
        let all = self.open.fetch_add(open, AcqRel) + open;
        if self.accepting.fetch_sub(1, AcqRel) == 1 {
            tracing::info!(%addr, connections = all, "stopped accepting; draining");
        } else {
            tracing::debug!(%addr, connections = open, "a shard stopped accepting");
        }
    }
}

/// Listeners bound to one address, one for each shard to accept on by itself
/// (`SO_REUSEPORT`: the kernel spreads new connections over them). The first is bound as
/// `addr` says, a port of 0 included; the others to the address it got.
pub(crate) fn bind_shards(addr: SocketAddr, shards: usize) -> io::Result<Vec<std::net::TcpListener>> {
    let mut bound = Vec::with_capacity(shards);
    let mut at = addr;
    for _ in 0..shards.max(1) {
        let socket = if at.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        if shards > 1 {
            socket.set_reuseport(true)?;
        }
        socket.bind(at)?;
        let l = socket.listen(1024)?;
        at = l.local_addr()?;
        bound.push(l.into_std()?);
    }
    Ok(bound)
}

/// Serves `handler` on one shard per listener of [`bind_shards`]: the first on the task that
/// awaits the returned future, each other on a thread of its own with a single-threaded
/// runtime, so a connection is read, checked, forwarded and answered on the one thread that
/// accepted it, with no hand-over between threads (the layout of nginx's workers;
/// benches/README.md "The matrix"). The caps of `limits` hold over all the shards together.
/// The threads start before this returns; the future stops accepting when `stop` turns true
/// and resolves to how many connections were still open when the drains gave up.
pub(crate) fn run_shards<H: Handler>(
    listeners: Vec<std::net::TcpListener>,
    tls: Option<TlsAcceptor>,
    handler: Arc<H>,
    limits: ServerLimits,
    counters: ConnCounters,
    stop: tokio::sync::watch::Receiver<bool>,
) -> io::Result<impl Future<Output = usize> + Send + 'static> {
    let accepted = counters.accepted.clone();
    let on = move |shard: usize| {
        accepted
            .get_or_create(&ShardLabel { shard: shard as u32 })
            .clone()
    };
    let proxy_refused = counters.proxy_refused.clone();
    let conns = Conns::new(limits.max_connections, limits.max_connections_per_ip, counters);
    let closing = Closing::new(listeners.len());
    let (finish, finish_rx) = tokio::sync::watch::channel(false);
    let mut listeners = listeners.into_iter();
    let first = listeners
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no listener to serve on"))?;
    let first = TcpListener::from_std(first)?;
    let mut others = Vec::new();
    for (i, l) in listeners.enumerate() {
        let shard = i + 1;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tls, handler, conns, stop) = (tls.clone(), handler.clone(), conns.clone(), stop.clone());
        let (closing, limits, proxy_refused) = (closing.clone(), limits.clone(), proxy_refused.clone());
        let accepted = on(shard);
        let (done, ended) = tokio::sync::oneshot::channel();
        let mut finish = finish_rx.clone();
        std::thread::Builder::new()
            .name(format!("shard-{shard}"))
            .spawn(move || {
                crate::shard::enter(shard);
                // Taken first: a listener the runtime refuses still has its part in the
                // address's closing line, which must name the address.
                let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
                let open = rt.block_on(async move {
                    match TcpListener::from_std(l) {
                        Ok(l) => {
                            let tally = Tally {
                                accepted,
                                closing,
                                proxy_refused,
                            };
                            serve_listener(l, tls, handler, limits, conns, tally, stopped(stop)).await
                        }
                        Err(e) => {
                            tracing::error!(shard, error = %e, "a shard cannot take its listener");
                            closing.stopped(&addr, 0);
                            0
                        }
                    }
                });
                let _ = done.send(open);
                // The runtime goes on driving this shard's upgraded connections until the
                // drain's last step is over.
                rt.block_on(async move {
                    let _ = finish.wait_for(|f| *f).await;
                });
            })?;
        others.push(ended);
    }
    Ok(async move {
        let tally = Tally {
            accepted: on(0),
            closing,
            proxy_refused,
        };
        let grace = limits.upgrade_grace;
        let mut open = serve_listener(first, tls, handler.clone(), limits, conns, tally, stopped(stop)).await;
        for ended in others {
            open += ended.await.unwrap_or(0);
        }
        handler.close_upgraded(grace).await;
        let _ = finish.send(true);
        open
    })
}

/// Resolves once `rx` reads true, or its sender is gone.
pub async fn stopped(mut rx: tokio::sync::watch::Receiver<bool>) {
    while !*rx.borrow_and_update() {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Accepts on one listener until `shutdown`, then drains its connections.
async fn serve_listener<H: Handler>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: Arc<H>,
    limits: ServerLimits,
    conns: Option<Arc<Conns>>,
    tally: Tally,
    shutdown: impl Future<Output = ()>,
) -> usize {
    let graceful = GracefulShutdown::new();
    // The express lane's connections hold a graceful watcher (so the drain waits for them) and
    // learn of the shutdown here, to close when idle.
    let (stopping, stop_rx) = tokio::sync::watch::channel(false);
    let listen = Arc::new(Listening {
        lane: limits.express && handler.has_lane(),
        builder: builder(&limits),
        handler,
        limits,
    });
    let proto = if tls.is_some() { "https" } else { "http" };
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        tally.accepted.inc();
        let entry = match &conns {
            None => None,
            Some(c) => match c.admit(tollgate_rules::identity::canonical(peer.ip())) {
                Ok(s) => Some(Arc::new(s)),
                Err(why) => {
                    // Closed before anything is read: no request of its has begun.
                    tracing::debug!(%peer, cap = why.cap(), "connection refused: cap full, none idle");
                    drop(tcp);
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let mut info = ConnInfo {
            peer,
            proto,
            flagged_heads: None,
            fingerprint: Fingerprint::None,
            entry: entry.clone(),
        };
        // What a connection's task holds while it idles is every idle connection's memory:
        // the listener's shared part by one pointer, the socket, the `ConnInfo`, the drain's
        // watcher (issue 24).
        let listen = listen.clone();
        let watcher = graceful.watcher();
        if let Some(trusted) = listen.limits.proxy_protocol.clone() {
            // Its own task from here: the header is read before anything else, TLS included.
            let (tls, stop, refused) = (tls.clone(), stop_rx.clone(), tally.proxy_refused.clone());
            let serve = async move {
                let mut tcp = tcp;
                let within = listen.limits.header_read_timeout;
                match proxy_protocol::take(&mut tcp, peer, &trusted, within).await {
                    Ok(client) => info.peer = client,
                    Err(reason) => {
                        tracing::debug!(%peer, reason, "connection closed: its PROXY protocol header");
                        refused
                            .get_or_create(&tollgate_telemetry::metrics::ReasonLabel { reason })
                            .inc();
                        return;
                    }
                }
                match tls {
                    None => lane_first(listen, tcp, info, watcher, stop, true).await,
                    Some(acceptor) => secure(listen, acceptor, tcp, info, watcher, stop).await,
                }
            };
            tokio::spawn(Closable::new(entry, serve));
            continue;
        }
        match &tls {
            None => {
                let serve = lane_first(listen, tcp, info, watcher, stop_rx.clone(), true);
                tokio::spawn(Closable::new(entry, serve));
            }
            Some(acceptor) => {
                let serve = secure(listen, acceptor.clone(), tcp, info, watcher, stop_rx.clone());
                tokio::spawn(Closable::new(entry, serve));
            }
        }
    }
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    drop(listener);
    let _ = stopping.send(true);
    // Which listener: the gateway's, the admin's and the demo upstream's all stop this way.
    tally.closing.stopped(&addr, graceful.count());
    match tokio::time::timeout(listen.limits.drain_timeout, graceful.shutdown()).await {
        Ok(()) => 0,
        Err(_) => {
            tracing::warn!("drain timeout reached with connections still open");
            1
        }
    }
}

/// A TLS connection's task: its ClientHello's fingerprint, the handshake, then HTTP.
async fn secure<H: Handler>(
    listen: Arc<Listening<H>>,
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    mut info: ConnInfo,
    watcher: hyper_util::server::graceful::Watcher,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let peer = info.peer;
    // The peek and the handshake share the one timeout: a client can't hold a connection
    // longer by sending its hello slowly.
    let handshake_done = async {
        let fingerprint = tls::fingerprint(&tcp, peer).await;
        (fingerprint, acceptor.accept(tcp).await)
    };
    let stream = match tokio::time::timeout(listen.limits.handshake_timeout, handshake_done).await {
        Ok((fingerprint, Ok(s))) => {
            info.fingerprint = fingerprint;
            s
        }
        Ok((_, Err(e))) => {
            tracing::debug!(%peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    // h2 is hyper's; HTTP/1.1 (by ALPN, or a client that offered none) takes the lane as
    // plain TCP does.
    let h1 = stream.get_ref().1.alpn_protocol() != Some(b"h2");
    lane_first(listen, stream, info, watcher, stop, h1).await;
}

/// A connection's task once its bytes are HTTP (after TLS's handshake), less its cap's
/// eviction: the express lane first when the handler has one and `h1` says the client speaks
/// HTTP/1.1 (or may: plain TCP), then hyper with every byte the lane read.
#[allow(
    clippy::manual_async_fn,
    reason = "as an async fn its future is 752 bytes, not 592: it keeps the arguments beside the lane's future"
)]
fn lane_first<H: Handler, S: LaneIo>(
    listen: Arc<Listening<H>>,
    io: S,
    info: ConnInfo,
    watcher: hyper_util::server::graceful::Watcher,
    mut stop: tokio::sync::watch::Receiver<bool>,
    h1: bool,
) -> impl Future<Output = ()> + Send {
    async move {
        let io = if listen.lane && h1 {
            match listen
                .handler
                .serve_lane(io, &info, &listen.limits, &mut stop)
                .await
            {
                Ended::Closed => return,
                Ended::HandOff(io) => io,
            }
        } else {
            Prefixed::new(bytes::Bytes::new(), io)
        };
        // hyper counts its requests from here.
        if let Some(s) = &info.entry {
            s.idle();
        }
        let peer = info.peer;
        // Boxed: allocated only for connections handed to hyper.
        if let Err(e) = Box::pin(on_hyper(listen, io, info, watcher, stop)).await {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
        }
    }
}

/// Hyper's connection, serving until it ends, the server stops (then its requests in flight
/// finish first), or it has been idle for the idle timeout ([`idle::Closing`]).
fn on_hyper<H: Handler, S: LaneIo>(
    listen: Arc<Listening<H>>,
    io: Prefixed<S>,
    mut info: ConnInfo,
    watcher: hyper_util::server::graceful::Watcher,
    stop: tokio::sync::watch::Receiver<bool>,
) -> impl Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send {
    let flagged = Arc::new(FlaggedHeads::default());
    info.flagged_heads = Some(flagged.clone());
    let activity = Arc::new(idle::Activity::new());
    // With upgrades: a route may switch a connection to WebSocket (`upgrade`); hyper hands such
    // a connection over after its `101` and this ends, leaving it to the route's own idle
    // timeout.
    let conn = listen.builder.serve_connection_with_upgrades(
        TokioIo::new(Watched::new(
            idle::Stamped::new(io, activity.clone()),
            flagged,
            listen.limits.header_read_timeout,
        )),
        service(listen.handler.clone(), info, activity.clone()),
    );
    idle::Closing::new(
        conn.into_owned(),
        stopped(stop),
        activity,
        listen.limits.idle_timeout,
        watcher,
    )
}

/// The size of a plain connection's task future, idle before its first request: what every
/// idle connection's task holds, besides tokio's own header and trailer.
#[cfg(test)]
pub(crate) fn idle_task_size<H: Handler>(handler: Arc<H>, tcp: TcpStream, info: ConnInfo) -> usize {
    let limits = ServerLimits::default();
    let listen = Arc::new(Listening {
        lane: true,
        builder: builder(&limits),
        handler,
        limits,
    });
    let graceful = GracefulShutdown::new();
    let (_tx, stop) = tokio::sync::watch::channel(false);
    let task = Closable::new(
        None,
        lane_first(listen, tcp, info, graceful.watcher(), stop, true),
    );
    std::mem::size_of_val(&task)
}

/// The sizes of hyper's service future for one request and of the handler's own future in it.
#[cfg(test)]
pub(crate) fn service_future_sizes<H: Handler>(handler: Arc<H>, info: ConnInfo) -> (usize, usize) {
    use hyper::service::Service;
    fn returned<A, R>(_: &impl Fn(A) -> R) -> usize {
        std::mem::size_of::<R>()
    }
    let svc = service(handler.clone(), info.clone(), Arc::new(idle::Activity::new()));
    let call = returned(&|req: Request<Incoming>| svc.call(req));
    let path = returned(&|req: Request<Incoming>| handler.clone().handle(req, info.clone()));
    (call, path)
}

/// What every connection of a listener shares.
pub(crate) struct Listening<H> {
    handler: Arc<H>,
    limits: ServerLimits,
    builder: auto::Builder<TokioExecutor>,
    /// Whether plain connections start on the handler's own lane.
    lane: bool,
}

/// hyper's service for one connection, made once its `ConnInfo` is whole: a TLS connection's
/// fingerprint is known only in its own task.
fn service<H: Handler>(
    handler: Arc<H>,
    info: ConnInfo,
    activity: Arc<idle::Activity>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Tracked<Body>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Tracked<Body>>, Infallible>> + Send,
> + Clone
+ Send {
    service_fn(move |req| {
        let handler = handler.clone();
        let info = info.clone();
        let activity = activity.clone();
        async move {
            let busy = Busy::enter(info.entry.clone(), activity);
            // A handler that answers `101` has switched the connection to another protocol,
            // whose bytes the smuggling watcher and its head timeout must leave alone.
            let switching = req
                .headers()
                .contains_key(http::header::UPGRADE)
                .then(|| info.flagged_heads.clone())
                .flatten();
            // Boxed: hyper moves the service's future into each h2 stream's task and the task
            // into tokio's cell, and inline the general path's future (over a KiB) rode along
            // in every move (a profile of h2: memcpy 5.5% of the CPU, most of it here). A box
            // is one allocation. `Box::pin`, not `crate::boxed`: built in place here, h2 cost
            // 8% more CPU a response (`benches/h2_builds.sh`, six rounds side by side).
            let resp = Box::pin(handler.handle(req, info)).await;
            if let Some(heads) = switching
                && resp.status() == http::StatusCode::SWITCHING_PROTOCOLS
            {
                heads.switched();
            }
            Ok::<_, Infallible>(resp.map(|body| Tracked { body, _busy: busy }))
        }
    })
}

pin_project_lite::pin_project! {
    /// Serves a connection until it ends or, while idle, is closed for a newcomer: dropping the
    /// future closes the socket, whichever path was serving it. A struct rather than an
    /// `async fn`: an `async fn` keeps its argument and the future it awaits side by side, so
    /// every connection's task held its serving future twice (issue 24).
    struct Closable<F> {
        #[pin]
        serve: F,
        // Boxed: a pointer in every connection's task where no cap is set, the usual case.
        evicted: Option<Pin<Box<tokio::sync::futures::OwnedNotified>>>,
    }
}

impl<F> Closable<F> {
    fn new(entry: Option<Arc<ConnEntry>>, serve: F) -> Closable<F> {
        Closable {
            serve,
            evicted: entry.map(|s| Box::pin(s.evicted())),
        }
    }
}

impl<F: Future<Output = ()>> Future for Closable<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if let Some(evicted) = this.evicted
            && evicted.as_mut().poll(cx).is_ready()
        {
            tracing::debug!("idle connection closed for a newcomer");
            return Poll::Ready(());
        }
        this.serve.poll(cx)
    }
}

/// One request in flight on hyper's path, from the service's call until hyper drops its
/// response body (sent whole, or the connection ended): for the caps and the idle timeout.
struct Busy {
    entry: Option<Arc<ConnEntry>>,
    activity: Arc<idle::Activity>,
}

impl Busy {
    fn enter(entry: Option<Arc<ConnEntry>>, activity: Arc<idle::Activity>) -> Busy {
        activity.enter();
        Busy {
            // An evicted connection is being dropped by `closable`; nothing to count.
            entry: entry.filter(|s| s.enter()),
            activity,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(s) = &self.entry {
            s.leave();
        }
        self.activity.leave();
    }
}

/// A response body that holds its request's [`Busy`].
pub struct Tracked<B> {
    body: B,
    _busy: Busy,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How a connection left the lane.
pub enum Ended<S> {
    Closed,
    /// Hyper serves the rest, starting with these bytes.
    HandOff(Prefixed<S>),
}

/// A connection whose first bytes were already read: they are read again first.
pub struct Prefixed<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(prefix: Bytes, inner: T) -> Prefixed<T> {
        Prefixed { prefix, inner }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
