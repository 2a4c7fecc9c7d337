//! The idle timeout of connections on hyper's path (HTTP/2, and HTTP/1 off the express lane):
//! what a connection has done lately, and closing it once it has done nothing for
//! `--idle-timeout`. Idle is no request in flight and no byte read; a long download or a slow
//! upstream is a request in flight, never idle.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use std::future::Future;
use std::sync::Arc;

use hyper_util::server::graceful::GracefulConnection;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How long a connection told to close (GOAWAY on h2) gets to close by itself before it is
/// dropped: a client that doesn't answer h2's closing ping would otherwise hold it.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// One connection's requests in flight and the moment it last read a byte or finished a
/// request.
#[derive(Debug)]
pub(crate) struct Activity {
    busy: AtomicU32,
    /// Milliseconds after `since`.
    last: AtomicU64,
    since: Instant,
}

impl Activity {
    pub fn new() -> Activity {
        Activity {
            busy: AtomicU32::new(0),
            last: AtomicU64::new(0),
            since: Instant::now(),
        }
    }

    fn stamp(&self) {
        let ms = self.since.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Release);
    }

    /// A request begins.
    pub fn enter(&self) {
        self.busy.fetch_add(1, Ordering::AcqRel);
    }

    /// A request ended: the idle time counts from now.
    pub fn leave(&self) {
        self.stamp();
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }

    /// `None` once the connection has been idle for `timeout`; else when to look again.
    pub fn idle_until(&self, timeout: Duration) -> Option<Instant> {
        let now = Instant::now();
        if self.busy.load(Ordering::Acquire) > 0 {
            return Some(now + timeout);
        }
        let at = self.since + Duration::from_millis(self.last.load(Ordering::Acquire)) + timeout;
        (at > now).then_some(at)
    }
}

/// A connection's bytes, each read stamping its [`Activity`].
pub(crate) struct Stamped<IO> {
    io: IO,
    activity: Arc<Activity>,
}

impl<IO> Stamped<IO> {
    pub fn new(io: IO, activity: Arc<Activity>) -> Stamped<IO> {
        Stamped { io, activity }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Stamped<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.stamp();
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Stamped<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    /// The server is stopping: hyper closes once the requests in flight have finished, which
    /// the drain timeout bounds.
    Draining,
    /// Idle past the timeout and told to close; the timer is now the grace's.
    Closing,
}

pin_project_lite::pin_project! {
    /// A hyper connection that closes gracefully (GOAWAY on h2) when `stopped` resolves or once
    /// it has been idle for `timeout`, and is dropped [`CLOSE_GRACE`] after an idle close.
    /// A struct, not an `async fn`: every idle h2 connection holds one, and an `async fn` kept
    /// its arguments beside what it awaited (unoptimised, 2,560 bytes as an `async fn`, 2,072
    /// as this struct, 1,904 for hyper's connection under the drain's watcher alone, as it was
    /// served before the idle timeout). One timer serves the idle wait and the grace.
    pub(crate) struct Closing<C, F, G> {
        #[pin]
        conn: C,
        #[pin]
        timer: Sleep,
        #[pin]
        stopped: F,
        activity: Arc<Activity>,
        timeout: Duration,
        phase: Phase,
        // Held until the connection ends: the drain waits for it.
        _guard: G,
    }
}

impl<C, F, G> Closing<C, F, G> {
    pub fn new(conn: C, stopped: F, activity: Arc<Activity>, timeout: Duration, guard: G) -> Self {
        Closing {
            conn,
            timer: tokio::time::sleep(timeout),
            stopped,
            activity,
            timeout,
            phase: Phase::Open,
            _guard: guard,
        }
    }
}

impl<C: GracefulConnection, F: Future<Output = ()>, G> Future for Closing<C, F, G> {
    type Output = Result<(), C::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // Before the connection is polled: told to close, it must be polled to act on it.
        if *this.phase == Phase::Open {
            if this.stopped.poll(cx).is_ready() {
                *this.phase = Phase::Draining;
                this.conn.as_mut().graceful_shutdown();
            } else {
                while this.timer.as_mut().poll(cx).is_ready() {
                    match this.activity.idle_until(*this.timeout) {
                        Some(at) => this.timer.as_mut().reset(at),
                        None => {
                            tracing::debug!("idle connection closed");
                            *this.phase = Phase::Closing;
                            this.conn.as_mut().graceful_shutdown();
                            this.timer.as_mut().reset(Instant::now() + CLOSE_GRACE);
                        }
                    }
                }
            }
        }
        if let Poll::Ready(ended) = this.conn.poll(cx) {
            return Poll::Ready(ended);
        }
        if *this.phase == Phase::Closing && this.timer.poll(cx).is_ready() {
            // A client that doesn't answer h2's closing ping: dropped.
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_last_request_and_never_while_one_is_in_flight() {
        let t = Duration::from_secs(2);
        let a = Activity::new();
        assert!(a.idle_until(t).is_some());
        tokio::time::advance(Duration::from_millis(2001)).await;
        assert_eq!(a.idle_until(t), None, "silent since the accept");
        a.enter();
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(a.idle_until(t).is_some(), "a request in flight is not idle");
        a.leave();
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(a.idle_until(t).is_some());
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(a.idle_until(t), None);
    }
}
