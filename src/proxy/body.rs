//! Streaming bodies with guards: a request body that stops at the route's size limit, and a
//! response body that gives up when the upstream goes quiet mid-body. Neither buffers anything.

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use std::future::Future as _;

use tokio::time::Sleep;

pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Raised when a streamed request body passes the route's limit.
#[derive(Debug, thiserror::Error)]
#[error("request body over {0} bytes")]
pub struct TooLarge(pub u64);

/// Raised when an upstream sends nothing for too long in the middle of a body.
#[derive(Debug, thiserror::Error)]
#[error("upstream body stalled for {0:?}")]
pub struct Stalled(pub Duration);

/// A request body counted as it streams; past `max` it fails and sets `tripped`, so the
/// gateway can answer 413 instead of 502.
pub struct LimitedBody {
    inner: Incoming,
    seen: u64,
    max: Option<u64>,
    tripped: Arc<AtomicBool>,
}

impl LimitedBody {
    pub fn new(inner: Incoming, max: Option<u64>) -> (LimitedBody, Arc<AtomicBool>) {
        let tripped = Arc::new(AtomicBool::new(false));
        (
            LimitedBody {
                inner,
                seen: 0,
                max,
                tripped: tripped.clone(),
            },
            tripped,
        )
    }
}

impl Body for LimitedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    self.seen += d.len() as u64;
                    if let Some(max) = self.max
                        && self.seen > max
                    {
                        self.tripped.store(true, Ordering::Release);
                        return Poll::Ready(Some(Err(Box::new(TooLarge(max)))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An upstream response body that fails when no frame arrives for `idle`; the server then
/// ends the client's stream (HTTP/1 closes the connection, HTTP/2 resets the stream) instead
/// of holding it open forever.
pub struct IdleBody {
    inner: Incoming,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// The upstream's in-flight place, held until the body is done or dropped.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl IdleBody {
    pub fn new(
        inner: Incoming,
        idle: Duration,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> IdleBody {
        IdleBody {
            inner,
            idle,
            timer: None,
            _permit: permit,
        }
    }
}

impl Body for IdleBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(r) => {
                self.timer = None;
                Poll::Ready(r.map(|f| f.map_err(|e| Box::new(e) as BoxError)))
            }
            Poll::Pending => {
                let idle = self.idle;
                let timer = self
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.timer = None;
                        Poll::Ready(Some(Err(Box::new(Stalled(idle)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
