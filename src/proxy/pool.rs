//! Keep-alive connections to one upstream: HTTP/1.1 connections made with hyper's connection
//! API and reused most-recent-first.
//!
//! hyper-util's pooled client does the same job generically (any scheme and authority, hashed
//! per request, a checkout future per request); an upstream here is one known address, so its
//! pool is a short list under a mutex that is held only to push or pop. A connection goes back
//! on the list as soon as its response head arrives; it is taken again only once it is ready,
//! which for HTTP/1.1 is when the previous response body has been read.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::respond::UpBody;

/// Most connections kept per upstream; past it the oldest is closed.
const MAX_IDLE: usize = 1024;

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("connect: {0}")]
    Connect(String),
    #[error("{0}")]
    Failed(#[from] hyper::Error),
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("authority", &self.authority)
            .finish()
    }
}

pub struct ConnPool {
    authority: Authority,
    connect_timeout: Duration,
    idle: Mutex<Vec<SendRequest<UpBody>>>,
    /// The express lane's connections: plain sockets it speaks HTTP/1.1 on itself.
    raw: Mutex<Vec<RawConn>>,
}

/// An upstream connection the express lane drives itself, with the bytes it read past the
/// last response (none, when the connection is idle).
pub struct RawConn {
    pub tcp: TcpStream,
    pub buf: bytes::BytesMut,
    /// Whether it came from the idle list (and so may have been closed by the upstream).
    pub reused: bool,
}

impl ConnPool {
    pub fn new(authority: Authority, connect_timeout: Duration) -> ConnPool {
        ConnPool {
            authority,
            connect_timeout,
            idle: Mutex::new(Vec::new()),
            raw: Mutex::new(Vec::new()),
        }
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// A connection that can take a request now, most recently used first. Closed ones are
    /// dropped; busy ones (still streaming a body) stay for later.
    fn take_ready(&self) -> Option<SendRequest<UpBody>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let mut i = idle.len();
        while i > 0 {
            i -= 1;
            if idle[i].is_closed() {
                idle.swap_remove(i);
            } else if idle[i].is_ready() {
                return Some(idle.swap_remove(i));
            }
        }
        None
    }

    fn put(&self, tx: SendRequest<UpBody>) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() >= MAX_IDLE {
            idle.remove(0);
        }
        idle.push(tx);
    }

    /// An idle express-lane connection, most recently used first.
    pub fn take_raw(&self) -> Option<RawConn> {
        let mut c = self.raw.lock().unwrap_or_else(PoisonError::into_inner).pop()?;
        c.reused = true;
        Some(c)
    }

    /// Keeps an express-lane connection whose last response was read to its end.
    pub fn put_raw(&self, c: RawConn) {
        let mut raw = self.raw.lock().unwrap_or_else(PoisonError::into_inner);
        if raw.len() >= MAX_IDLE {
            raw.remove(0);
        }
        raw.push(c);
    }

    /// A new express-lane connection.
    pub async fn connect_raw(&self) -> Result<RawConn, SendError> {
        Ok(RawConn {
            tcp: self.dial().await?,
            buf: bytes::BytesMut::with_capacity(8192),
            reused: false,
        })
    }

    async fn dial(&self) -> Result<TcpStream, SendError> {
        let host = self
            .authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = self.authority.port_u16().unwrap_or(80);
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| SendError::Connect(format!("no connection within {:?}", self.connect_timeout)))?
            .map_err(|e| SendError::Connect(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }

    async fn connect(&self) -> Result<SendRequest<UpBody>, SendError> {
        let tcp = self.dial().await?;
        let (tx, conn) = http1::Builder::new()
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| SendError::Connect(e.to_string()))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok(tx)
    }

    /// Sends a request, on a kept connection when one is ready. A kept connection the upstream
    /// closed meanwhile hands the unsent request back, and it goes to the next one. If a kept
    /// connection fails after the request went out (the upstream closed it at that very moment),
    /// an idempotent request without a body is sent once more on a new connection: nothing of it
    /// can have been lost or done twice that a retry would repeat wrongly.
    pub async fn send(&self, mut req: Request<UpBody>) -> Result<Response<Incoming>, SendError> {
        let replay = replayable(&req);
        while let Some(mut tx) = self.take_ready() {
            match tx.try_send_request(req).await {
                Ok(resp) => {
                    self.put(tx);
                    return Ok(resp);
                }
                Err(mut e) => match (e.take_message(), &replay) {
                    (Some(unsent), _) => req = unsent,
                    (None, Some(head)) => {
                        tracing::debug!(error = %e.into_error(), "kept upstream connection failed; sending again on a new one");
                        req = rebuild(head);
                        break;
                    }
                    (None, None) => return Err(SendError::Failed(e.into_error())),
                },
            }
        }
        // Boxed: connecting is the rare path, and its future would make every request's larger.
        let mut tx = Box::pin(self.connect()).await?;
        let resp = tx.send_request(req).await?;
        self.put(tx);
        Ok(resp)
    }
}

/// The head of a request that may be sent again: idempotent and without a body.
fn replayable(req: &Request<UpBody>) -> Option<http::request::Parts> {
    use http_body::Body as _;
    let idempotent = matches!(
        *req.method(),
        http::Method::GET
            | http::Method::HEAD
            | http::Method::OPTIONS
            | http::Method::DELETE
            | http::Method::PUT
    );
    if !idempotent || !req.body().is_end_stream() {
        return None;
    }
    let mut head = Request::new(());
    *head.method_mut() = req.method().clone();
    *head.uri_mut() = req.uri().clone();
    *head.version_mut() = req.version();
    *head.headers_mut() = req.headers().clone();
    Some(head.into_parts().0)
}

fn rebuild(head: &http::request::Parts) -> Request<UpBody> {
    let mut req = Request::new(http_body_util::Either::Right(http_body_util::Full::new(
        bytes::Bytes::new(),
    )));
    *req.method_mut() = head.method.clone();
    *req.uri_mut() = head.uri.clone();
    *req.version_mut() = head.version;
    *req.headers_mut() = head.headers.clone();
    req
}
