//! The request body with its guard: it stops at the route's size limit, without buffering
//! anything. (The upstream's body, with its idle guard, is `client::UpstreamBody`.)

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// Raised when a streamed request body passes the route's limit.
#[derive(Debug, thiserror::Error)]
#[error("request body over {0} bytes")]
pub struct TooLarge(pub u64);

/// A request body counted as it streams; past `max` it fails with [`TooLarge`], which the
/// gateway answers with 413 instead of 502.
pub(crate) struct LimitedBody {
    inner: Incoming,
    seen: u64,
    max: Option<u64>,
}

impl LimitedBody {
    pub fn new(inner: Incoming, max: Option<u64>) -> LimitedBody {
        LimitedBody { inner, seen: 0, max }
    }

    /// Limits the body to `max` bytes from here on (the route's, once the request is routed).
    pub fn cap(&mut self, max: u64) {
        self.max = Some(max);
    }

    /// The client's body, with whatever of it is still to come: an answer made before it was
    /// read to its end decides what becomes of the rest.
    pub fn into_inner(self) -> Incoming {
        self.inner
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
