//! Upgraded connections (a route's `"upgrade": ["websocket"]`): which protocol a request may
//! switch to, how the upstream is asked for it, and, after the upstream's `101`, the relay of
//! bytes both ways until either side closes, the route's `idle_timeout_ms` passes in silence,
//! or the drain's grace (`--upgrade-grace`) ends.
//!
//! The upgrade request itself is any request: authenticated, checked and charged by the same
//! steps, on hyper's path (the express lane hands upgrades over). What an upgraded connection
//! holds while it is open, it holds from the request: the key's `concurrent` seats, and its
//! place among the client connections (`--max-connections`, as a busy one). The upstream's
//! in-flight place is given back at the `101`: it bounds requests waiting for answers, and a
//! connection open for hours would take it from them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::header::{self, HeaderMap, HeaderValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::proxy::HeaderEdits;
use crate::proxy::pool::RawConn;
use crate::respond::Refusal;
use crate::server::conns::ConnEntry;
use tollgate_rules::Route;
use tollgate_store::seats::Seat;
use tollgate_telemetry::metrics::ReasonLabel;

/// Which of the route's protocols an HTTP/1.1 request asks to switch to (an index into
/// [`Route::upgrade`]): the first it offers that the route lists. `None` for a request that
/// asks no upgrade, or only `h2c`, which is ignored as RFC 9110 lets a server do (its headers
/// are hop-by-hop and go no further). Any other upgrade the route does not list is refused
/// with 403, before anything is charged: forwarded as a plain request it would reach an
/// upstream that answers it as one, and the client would be left to guess why its handshake
/// failed.
pub(crate) fn chosen(
    route: &Route,
    version: http::Version,
    headers: &HeaderMap,
) -> Result<Option<usize>, Refusal> {
    if version != http::Version::HTTP_11 {
        return Ok(None);
    }
    let mut unlisted: Option<&[u8]> = None;
    for offered in tollgate_http1::upgrade_offered(headers) {
        if let Some(i) = route
            .upgrade
            .iter()
            .position(|p| p.as_bytes().eq_ignore_ascii_case(offered))
        {
            return Ok(Some(i));
        }
        if !offered.eq_ignore_ascii_case(b"h2c") {
            unlisted = unlisted.or(Some(offered));
        }
    }
    match unlisted {
        None => Ok(None),
        Some(p) => Err(Refusal::UpgradeNotAllowed(format!(
            "route {:?} does not upgrade connections to {:?}",
            &*route.name,
            String::from_utf8_lossy(p)
        ))),
    }
}

/// Asks the upstream for the switch: the chosen protocol only, with the `Connection` token that
/// makes `Upgrade` meant for it. Both are hop-by-hop, so the client's never go on by themselves.
pub(crate) fn ask_upstream(edits: &mut HeaderEdits, protocol: &str) {
    if let Ok(v) = HeaderValue::from_str(protocol) {
        edits.set.push((header::UPGRADE, v));
        edits
            .set
            .push((header::CONNECTION, HeaderValue::from_static("upgrade")));
    }
}

/// Why an upgraded connection ended, as `tollgate_upgraded_closed_total{reason}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Either side closed (both directions ended), or failed.
    Closed,
    /// Nothing either way for the route's idle timeout.
    Idle,
    /// Still open when the drain's grace ended.
    Drain,
    /// hyper never handed the client's connection over (it closed before the `101` went out).
    NotSwitched,
}

impl Ended {
    fn reason(self) -> &'static str {
        match self {
            Ended::Closed => "closed",
            Ended::Idle => "idle",
            Ended::Drain => "drain",
            Ended::NotSwitched => "not_switched",
        }
    }
}

/// What an upgraded connection keeps from its request while it is open.
pub(crate) struct Held {
    /// The key's seats of `concurrent` limits.
    pub seats: Vec<Seat>,
    /// Its client connection's place under the connection caps, busy while the relay lasts.
    pub entry: Option<Arc<ConnEntry>>,
}

/// The gateway's upgraded connections: each one's relay is a task of its own, tracked so the
/// drain can wait for them and, after its grace, close them.
pub(crate) struct Upgrades {
    tracker: TaskTracker,
    stop: CancellationToken,
    open: Gauge,
    closed: Family<ReasonLabel, Counter>,
}

impl Upgrades {
    pub fn new(open: Gauge, closed: Family<ReasonLabel, Counter>) -> Upgrades {
        Upgrades {
            tracker: TaskTracker::new(),
            stop: CancellationToken::new(),
            open,
            closed,
        }
    }

    /// Relays `client` (once hyper hands it over, after sending the `101`) and `upstream` both
    /// ways, in a task of its own.
    pub fn relay(
        &self,
        client: hyper::upgrade::OnUpgrade,
        upstream: RawConn,
        held: Held,
        idle: Duration,
        route: Arc<str>,
    ) {
        let stop = self.stop.clone();
        let open = self.open.clone();
        let closed = self.closed.clone();
        self.tracker.spawn(async move {
            let Held { seats, entry } = held;
            if let Some(e) = &entry {
                e.enter();
            }
            open.inc();
            let started = Instant::now();
            let (ended, up, down) = match client.await {
                Ok(c) => both_ways(hyper_util::rt::TokioIo::new(c), upstream, idle, &stop).await,
                Err(e) => {
                    tracing::debug!(error = %e, route = &*route, "the client's connection was not handed over");
                    (Ended::NotSwitched, 0, 0)
                }
            };
            open.dec();
            closed
                .get_or_create(&ReasonLabel {
                    reason: ended.reason(),
                })
                .inc();
            tracing::debug!(route = &*route, reason = ended.reason(), bytes_to_upstream = up, bytes_to_client = down, lasted = ?started.elapsed(), "upgraded connection ended");
            drop(seats);
            if let Some(e) = entry {
                e.leave();
            }
        });
    }

    /// The drain's last step: upgraded connections get `grace` to end by themselves; those
    /// still open then are closed. Returns how many were.
    pub async fn close(&self, grace: Duration) -> usize {
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait()).await.is_ok() {
            return 0;
        }
        let left = self.tracker.len();
        tracing::info!(
            connections = left,
            ?grace,
            "closing upgraded connections still open after the grace"
        );
        self.stop.cancel();
        // Each relay ends at its next poll; this only waits for them to be dropped.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.tracker.wait()).await;
        left
    }
}

/// How long the upstream may still talk after the client has ended its side.
const LINGER: Duration = Duration::from_secs(5);

/// When either side last sent a byte, in milliseconds since the relay began.
struct Heard {
    start: Instant,
    last_ms: AtomicU64,
}

impl Heard {
    fn now(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        self.start
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// A reader that notes when it last read anything, and how much.
struct Noted<'a, R> {
    inner: R,
    heard: &'a Heard,
    bytes: u64,
}

impl<R: AsyncRead + Unpin> AsyncRead for Noted<'_, R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.bytes += n as u64;
            self.heard.now();
        }
        r
    }
}

/// Copies each side's bytes to the other until the upstream ends (or, after the client has
/// ended, [`LINGER`] passes), either fails, both are silent for `idle`, or `stop` is cancelled. Bytes the
/// upstream sent behind its `101` go to the client first. Returns why it ended and the bytes
/// relayed each way (to the upstream, to the client).
async fn both_ways<C>(
    client: C,
    mut upstream: RawConn,
    idle: Duration,
    stop: &CancellationToken,
) -> (Ended, u64, u64)
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let early = std::mem::take(&mut upstream.buf);
    let heard = Heard {
        start: Instant::now(),
        last_ms: AtomicU64::new(0),
    };
    let (client_read, mut client_write) = tokio::io::split(client);
    let (upstream_read, mut upstream_write) = tokio::io::split(upstream.io);
    let mut from_client = Noted {
        inner: client_read,
        heard: &heard,
        bytes: 0,
    };
    let mut from_upstream = Noted {
        inner: upstream_read,
        heard: &heard,
        bytes: early.len() as u64,
    };
    let to_upstream = async {
        tokio::io::copy(&mut from_client, &mut upstream_write).await?;
        upstream_write.shutdown().await
    };
    let to_client = async {
        if !early.is_empty() {
            client_write.write_all(&early).await?;
            client_write.flush().await?;
        }
        tokio::io::copy(&mut from_upstream, &mut client_write).await?;
        client_write.shutdown().await
    };
    let silence = async {
        loop {
            let quiet = heard.silent_for();
            if quiet >= idle {
                return;
            }
            tokio::time::sleep(idle - quiet).await;
        }
    };
    // The upstream's end is the connection's (a WebSocket server closes first, RFC 6455
    // §7.1.1): the client is told, and nothing it sends after can be answered. A client's end
    // is passed on, and the upstream's last bytes (its close reply) still reach the client,
    // for a moment.
    let relayed = async {
        tokio::pin!(to_upstream, to_client);
        tokio::select! {
            r = &mut to_client => r,
            r = &mut to_upstream => {
                r?;
                tokio::time::timeout(LINGER, to_client).await.unwrap_or(Ok(()))
            }
        }
    };
    let ended = tokio::select! {
        r = relayed => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "upgraded connection failed");
            }
            Ended::Closed
        }
        () = silence => Ended::Idle,
        () = stop.cancelled() => Ended::Drain,
    };
    (ended, from_client.bytes, from_upstream.bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(upgrade: &str) -> Route {
        let rules = format!(
            r#"{{"version": 1, "upstreams": {{"u": {{"url": "http://127.0.0.1:9"}}}},
                "routes": [{{"name": "s", "method": "GET", "path": "/s", "upstream": "u", "key": "optional", "upgrade": {upgrade}}}]}}"#
        );
        tollgate_rules::compile(
            rules.as_bytes(),
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap()
        .routes
        .remove(0)
    }

    fn asking(upgrade: &str, connection: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, HeaderValue::from_str(upgrade).unwrap());
        h.insert(header::CONNECTION, HeaderValue::from_str(connection).unwrap());
        h
    }

    #[test]
    fn the_first_listed_protocol_offered_is_chosen() {
        let r = route(r#"["websocket", "foo/2"]"#);
        let v11 = http::Version::HTTP_11;
        assert_eq!(
            chosen(&r, v11, &asking("bar, FOO/2, websocket", "Upgrade")).unwrap(),
            Some(1)
        );
        assert_eq!(
            chosen(&r, v11, &asking("WebSocket", "keep-alive, upgrade")).unwrap(),
            Some(0)
        );
        // Not meant for this hop, or not HTTP/1.1: no upgrade at all.
        assert_eq!(chosen(&r, v11, &asking("websocket", "keep-alive")).unwrap(), None);
        assert_eq!(
            chosen(&r, http::Version::HTTP_10, &asking("websocket", "upgrade")).unwrap(),
            None
        );
    }

    #[test]
    fn an_unlisted_upgrade_is_refused_and_h2c_ignored() {
        let r = route("[]");
        let v11 = http::Version::HTTP_11;
        assert_eq!(
            chosen(&r, v11, &asking("h2c", "Upgrade, HTTP2-Settings")).unwrap(),
            None
        );
        let refused = chosen(&r, v11, &asking("h2c, websocket", "upgrade")).unwrap_err();
        assert_eq!(refused.status(), http::StatusCode::FORBIDDEN);
        assert!(refused.to_string().contains("\"websocket\""), "{refused}");
    }
}
