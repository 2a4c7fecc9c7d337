//! Kept connections to one upstream, for both of the gateway's paths: sockets, plain or TLS,
//! the proxy speaks HTTP/1.1 on itself (`proxy::client`), reused most-recent-first.
//!
//! HTTP/1.1 has no request ids: the only thing that ties a response to its request is the
//! order on the connection. A byte the upstream sends that nobody asked for (a response
//! written twice, a late error page) would be read as the answer to whichever request the
//! connection carries next, and every answer after it would be one behind. So a connection
//! is kept only when it is known clean, and checked again before reuse:
//! - it goes back only when its last response ended exactly where its framing said and the
//!   upstream did not say it would close (the caller's part);
//! - it is taken again only after it has been quiet for [`QUIET`] since that response ended, so
//!   a second response written right behind the first arrives while nobody uses the
//!   connection;
//! - and only if the socket itself, asked with a non-blocking `MSG_PEEK`, holds no byte and is
//!   not closed. The runtime's readiness flags are not asked: they lag the socket until the
//!   reactor next runs, and a stray response that landed in between went unseen. On a TLS
//!   connection an idle upstream may rightly send records that carry no response (session
//!   tickets, key updates): what the socket holds is read and given to the TLS session, and
//!   only data for the application, or a record not all there yet, counts against it;
//! - it is closed after `idle_timeout`, before the upstream's own idle timeout closes it under a
//!   request (common servers close after 5 to 60 s).
//!
//! What no HTTP/1.1 client can tell apart is a stray that the upstream sends later than
//! [`QUIET`] after its response and after the next request was written: it arrives where the
//! answer is due. So an upstream seen sending bytes nobody asked for (on an idle connection,
//! past a response's end, or before a request was fully written) is not trusted with a kept
//! connection for [`DISTRUST`]: each of its connections carries one request and is closed,
//! and a warning names it. Before it is first seen, a stray later than [`QUIET`] can still
//! reach one request.
//!
//! The list sits under a mutex held only to push or pop: an upstream is one known address, so a
//! pool keyed by scheme and authority (hyper-util's) would do work for nothing. There is one list
//! per serving shard (`crate::shard`): a connection is taken again on the shard that opened it,
//! whose reactor watches its socket.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::uri::Authority;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tollgate_rules::UpstreamTls;

/// Most connections kept per upstream and shard; past it the oldest is closed.
const MAX_IDLE: usize = 1024;

/// How long a connection rests after its response ended before it carries another request.
/// Under load this keeps about `rate × QUIET` more connections open (60 at 30,000 requests a
/// second); a connection that is not reused costs nothing but its socket.
pub(crate) const QUIET: Duration = Duration::from_millis(2);

/// How long an upstream seen sending a response nobody asked for gets no kept connections.
pub(crate) const DISTRUST: Duration = Duration::from_secs(60);

/// Why no connection could be made.
#[derive(Debug, thiserror::Error)]
#[error("connect to {authority}: {why}")]
pub struct ConnectError {
    pub authority: Authority,
    pub why: String,
}

/// An upstream connection and the bytes read from it past the current response's head.
pub(crate) struct RawConn {
    pub io: Stream,
    pub buf: BytesMut,
    /// Whether it came from the idle list (and so may have been closed by the upstream).
    pub reused: bool,
}

/// An upstream connection's byte stream. TLS is boxed so a plain connection, the common one,
/// stays the size of its socket.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    /// The socket under it.
    #[cfg(test)]
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(t) => t,
            Stream::Tls(t) => t.get_ref().0,
        }
    }

    /// Writes all of `bytes` through to the socket: TLS holds what it encrypted until flushed.
    pub async fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Stream::Plain(t) => t.write_all(bytes).await,
            Stream::Tls(t) => {
                t.write_all(bytes).await?;
                t.flush().await
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Stream::Tls(t) => match Pin::new(&mut **t).poll_read(cx, buf) {
                // An upstream that closes without close_notify ends the stream as a plain one
                // would, as common clients take it: every framing but a close-delimited body
                // still finds a cut response short.
                Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => Poll::Ready(Ok(())),
                other => other,
            },
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(t) => Pin::new(t).poll_write(cx, buf),
            Stream::Tls(t) => Pin::new(&mut **t).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(t) => Pin::new(t).poll_flush(cx),
            Stream::Tls(t) => Pin::new(&mut **t).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Stream::Tls(t) => Pin::new(&mut **t).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Stream::Tls(t) => Pin::new(&mut **t).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(t) => t.is_write_vectored(),
            Stream::Tls(t) => t.is_write_vectored(),
        }
    }
}

struct Idle {
    conn: RawConn,
    since: Instant,
}

pub(crate) struct ConnPool {
    authority: Authority,
    /// When the pool was made: the zero of `distrusted_until`.
    born: Instant,
    /// Milliseconds after `born` until which no connection is kept (0: trusted).
    distrusted_until: AtomicU64,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// How its connections speak TLS; `None`: plain.
    tls: Option<UpstreamTls>,
    /// Counts the times the upstream was caught straying, for `/metrics`.
    strays: Option<prometheus_client::metrics::counter::Counter>,
    /// One list per shard, oldest first.
    idle: Box<[Mutex<VecDeque<Idle>>]>,
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("authority", &self.authority)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// What the socket of a connection nobody is using holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Socket {
    /// Nothing to read, not closed: as it was left.
    Clean,
    /// Closed by the peer, or failed: what upstreams do to idle connections.
    Closed,
    /// Bytes nobody asked for.
    Stray,
    /// Part of a TLS record, which may be a response or may be a session ticket still arriving:
    /// an idle connection holding it is closed, without blame; before a request's body it is
    /// early bytes all the same.
    Partial,
}

/// Asks the socket itself (a `recv` with `MSG_PEEK` on a non-blocking socket), never the
/// runtime's readiness, which only learns of new bytes when the reactor next runs.
pub(crate) fn look(io: &mut Stream) -> Socket {
    match io {
        Stream::Plain(tcp) => peek(tcp),
        Stream::Tls(tls) => {
            // Plaintext the session already holds (decrypted with the last answer's records)
            // is not on the socket, where the peek looks.
            if tls
                .get_mut()
                .1
                .process_new_packets()
                .is_ok_and(|st| st.plaintext_bytes_to_read() > 0)
            {
                return Socket::Stray;
            }
            match peek(tls.get_ref().0) {
                Socket::Stray => look_tls(tls),
                other => other,
            }
        }
    }
}

fn peek(tcp: &TcpStream) -> Socket {
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    match socket2::SockRef::from(tcp).peek(&mut probe) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Socket::Clean,
        Ok(n) if n > 0 => Socket::Stray,
        _ => Socket::Closed,
    }
}

/// What bytes on an idle TLS connection are: everything the socket holds is read into the TLS
/// session, which takes in what is not for the application (session tickets, key updates). A
/// response shows as plaintext; a record not all there yet can't be told apart from one. The
/// socket is read directly, as `peek` asks it: the runtime may not know yet that it is
/// readable. Emptying it behind the runtime's back leaves the runtime at worst a readiness it
/// clears with its next read's `WouldBlock`.
fn look_tls(tls: &mut TlsStream<TcpStream>) -> Socket {
    let (tcp, session) = tls.get_mut();
    let mut reader = Records::new(socket2::SockRef::from(&*tcp));
    loop {
        match session.read_tls(&mut reader) {
            Ok(0) => return Socket::Closed,
            Ok(_) => match session.process_new_packets() {
                Err(_) => return Socket::Closed,
                Ok(state) if state.plaintext_bytes_to_read() > 0 => return Socket::Stray,
                Ok(state) if state.peer_has_closed() => return Socket::Closed,
                Ok(_) => {}
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Socket::Closed,
        }
    }
    if reader.whole() {
        Socket::Clean
    } else {
        Socket::Partial
    }
}

/// Reads a socket and follows where the bytes fall among TLS records (a 5-byte header whose
/// last two bytes are the length of the body after it), from a record's start.
struct Records<'s> {
    socket: socket2::SockRef<'s>,
    header: [u8; 5],
    /// How much of the current record's header has been read.
    have: usize,
    /// How much of the current record's body is still due.
    left: usize,
}

impl<'s> Records<'s> {
    fn new(socket: socket2::SockRef<'s>) -> Records<'s> {
        Records {
            socket,
            header: [0; 5],
            have: 0,
            left: 0,
        }
    }

    /// Whether the bytes read so far end where a record does.
    fn whole(&self) -> bool {
        self.have == 0 && self.left == 0
    }

    fn follow(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = self.left.min(bytes.len());
                self.left -= n;
                bytes = &bytes[n..];
            } else {
                self.header[self.have] = bytes[0];
                self.have += 1;
                bytes = &bytes[1..];
                if self.have == self.header.len() {
                    self.left = u16::from_be_bytes([self.header[3], self.header[4]]) as usize;
                    self.have = 0;
                }
            }
        }
    }
}

impl io::Read for Records<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = io::Read::read(&mut &*self.socket, buf)?;
        self.follow(&buf[..n]);
        Ok(n)
    }
}

impl ConnPool {
    /// A pool with a list for each shard serving now.
    pub fn new(authority: Authority, connect_timeout: Duration, idle_timeout: Duration) -> ConnPool {
        Self::with_shards(authority, connect_timeout, idle_timeout, crate::shard::count())
    }

    fn with_shards(
        authority: Authority,
        connect_timeout: Duration,
        idle_timeout: Duration,
        shards: usize,
    ) -> ConnPool {
        ConnPool {
            authority,
            born: Instant::now(),
            distrusted_until: AtomicU64::new(0),
            connect_timeout,
            idle_timeout,
            tls: None,
            strays: None,
            idle: (0..shards.max(1)).map(|_| Mutex::new(VecDeque::new())).collect(),
        }
    }

    /// The pool, its connections speaking TLS with `tls` (plain with `None`).
    pub fn with_tls(mut self, tls: Option<UpstreamTls>) -> ConnPool {
        self.tls = tls;
        self
    }

    /// Counts each stray seen on `counter`.
    pub(crate) fn counting_strays(
        mut self,
        counter: prometheus_client::metrics::counter::Counter,
    ) -> ConnPool {
        self.strays = Some(counter);
        self
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    pub fn tls(&self) -> Option<&UpstreamTls> {
        self.tls.as_ref()
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// The calling shard's list.
    fn list(&self) -> std::sync::MutexGuard<'_, VecDeque<Idle>> {
        Self::lock(&self.idle[crate::shard::current() % self.idle.len()])
    }

    fn lock(list: &Mutex<VecDeque<Idle>>) -> std::sync::MutexGuard<'_, VecDeque<Idle>> {
        list.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A kept connection that is still clean, most recently used first among those that have
    /// been quiet for [`QUIET`]. Expired and unclean ones met on the way are closed; those still
    /// resting stay for a later request.
    pub fn take(&self) -> Option<RawConn> {
        let now = Instant::now();
        let rested = now.checked_sub(QUIET)?;
        let mut list = self.list();
        loop {
            // Oldest first, so those still resting are the newest ones, at the back.
            let ready = list.partition_point(|i| i.since <= rested);
            let mut idle = list.remove(ready.checked_sub(1)?)?;
            if now.duration_since(idle.since) >= self.idle_timeout {
                // The newest rested one has expired, so have all the older ones.
                list.drain(..ready - 1);
                return None;
            }
            match look(&mut idle.conn.io) {
                Socket::Clean => {
                    drop(list);
                    let mut c = idle.conn;
                    c.reused = true;
                    c.buf = crate::bufs::take();
                    return Some(c);
                }
                Socket::Closed | Socket::Partial => {}
                Socket::Stray => {
                    drop(list);
                    self.stray_seen();
                    return None;
                }
            }
        }
    }

    /// Whether connections to this upstream may be kept now.
    fn trusted(&self) -> bool {
        let until = self.distrusted_until.load(Ordering::Relaxed);
        until == 0 || (self.born.elapsed().as_millis() as u64) >= until
    }

    /// The upstream sent bytes nobody asked for: for [`DISTRUST`] none of its connections is
    /// kept, and those kept now are closed.
    pub(crate) fn stray_seen(&self) {
        if let Some(c) = &self.strays {
            c.inc();
        }
        let now = self.born.elapsed().as_millis() as u64;
        let was = self
            .distrusted_until
            .swap(now + DISTRUST.as_millis() as u64, Ordering::Relaxed);
        if was == 0 || now >= was {
            tracing::warn!(
                upstream = %self.authority,
                for_secs = DISTRUST.as_secs(),
                "upstream sent a response nobody asked for; its connections now carry one request each"
            );
        }
        for list in &self.idle {
            Self::lock(list).clear();
        }
    }

    /// A connection whose response body was read to its end: kept when its upstream keeps it
    /// (`reusable`) and sent nothing past the end; bytes past the end are a response nobody
    /// asked for, and the upstream is distrusted. The one reuse rule of both paths.
    pub fn give_back(&self, c: RawConn, reusable: bool) {
        if !reusable {
            return;
        }
        if c.buf.is_empty() {
            self.put(c);
        } else {
            self.stray_seen();
        }
    }

    /// Keeps a connection whose last response was read exactly to its end. Its read buffer is
    /// given back while it waits: a pool grown by a burst would otherwise hold 8 KiB for each
    /// connection kept, and `take` asks for a new one.
    pub fn put(&self, mut c: RawConn) {
        debug_assert!(c.buf.is_empty(), "a kept connection must have nothing unread");
        if !self.trusted() {
            return;
        }
        crate::bufs::give(std::mem::take(&mut c.buf));
        let now = Instant::now();
        let mut list = self.list();
        while list.len() >= MAX_IDLE
            || list
                .front()
                .is_some_and(|i| now.duration_since(i.since) >= self.idle_timeout)
        {
            list.pop_front();
        }
        list.push_back(Idle { conn: c, since: now });
    }

    /// Closes kept connections that expired or that the upstream closed or wrote to, so none
    /// lingers half-closed while no request comes to take it.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut stray = false;
        for list in &self.idle {
            Self::lock(list).retain_mut(|i| {
                now.duration_since(i.since) < self.idle_timeout
                    && match look(&mut i.conn.io) {
                        Socket::Clean => true,
                        Socket::Closed | Socket::Partial => false,
                        Socket::Stray => {
                            stray = true;
                            false
                        }
                    }
            });
        }
        if stray {
            self.stray_seen();
        }
    }

    /// A new connection; over TLS, its handshake done within the same connect timeout.
    pub async fn connect(&self) -> Result<RawConn, ConnectError> {
        let err = |why: String| ConnectError {
            authority: self.authority.clone(),
            why,
        };
        let io = tokio::time::timeout(self.connect_timeout, self.open())
            .await
            .map_err(|_| err(format!("no connection within {:?}", self.connect_timeout)))?
            .map_err(err)?;
        Ok(RawConn {
            io,
            buf: crate::bufs::take(),
            reused: false,
        })
    }

    async fn open(&self) -> Result<Stream, String> {
        let host = self
            .authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let default_port = if self.tls.is_some() { 443 } else { 80 };
        let port = self.authority.port_u16().unwrap_or(default_port);
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        let Some(tls) = &self.tls else {
            return Ok(Stream::Plain(tcp));
        };
        let stream = tokio_rustls::TlsConnector::from(tls.config.clone())
            .connect(tls.server_name.clone(), tcp)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        Ok(Stream::Tls(Box::new(stream)))
    }
}

#[cfg(test)]
mod tests {
    impl ConnPool {
        /// How many connections are kept now.
        fn idle_count(&self) -> usize {
            self.idle.iter().map(|l| Self::lock(l).len()).sum()
        }
    }

    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    async fn pair(pool: &ConnPool, l: &TcpListener) -> (RawConn, TcpStream) {
        let c = pool.connect().await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        (c, s)
    }

    /// Past the rest a kept connection takes before it is used again.
    fn rest() {
        std::thread::sleep(QUIET + Duration::from_millis(1));
    }

    /// A stray byte that reaches the socket while the runtime has not looked: the check
    /// before reuse must still see it. The peer writes from a blocking socket and nothing
    /// yields to the reactor in between, so the runtime's readiness is not updated; reading
    /// the readiness instead of the socket missed this byte.
    #[tokio::test(flavor = "current_thread")]
    async fn a_stray_byte_the_reactor_has_not_seen_is_found() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));
        let c = pool.connect().await.unwrap();
        let (mut s, _) = l.accept().unwrap();
        // A response read to its end leaves the socket marked drained, as the relay does.
        std::io::Write::write_all(&mut s, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").unwrap();
        let mut c = c;
        tokio::io::AsyncReadExt::read_buf(&mut c.io, &mut c.buf)
            .await
            .unwrap();
        c.buf.clear();
        pool.put(c);
        rest();
        std::io::Write::write_all(&mut s, b"HTTP/1.1 200 OK\r\n").unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            pool.take().is_none(),
            "a connection holding a stray response was reused"
        );
    }

    #[tokio::test]
    async fn an_upstream_seen_straying_keeps_no_connections() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));
        let (a, _sa) = pair(&pool, &l).await;
        let (b, mut sb) = pair(&pool, &l).await;
        pool.put(a);
        pool.put(b);
        rest();
        sb.write_all(b"X").await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(pool.take().is_none(), "the stray was not seen");
        assert_eq!(
            pool.idle_count(),
            0,
            "a straying upstream's connections were kept"
        );
        let (c, _sc) = pair(&pool, &l).await;
        pool.put(c);
        assert_eq!(pool.idle_count(), 0, "a connection was kept while distrusted");
        // Trusted again once the distrust has run out.
        pool.distrusted_until.store(1, Ordering::Relaxed);
        let (d, _sd) = pair(&pool, &l).await;
        pool.put(d);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_connection_rests_before_it_is_reused() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));
        let (c, _s) = pair(&pool, &l).await;
        pool.put(c);
        assert!(
            pool.take().is_none(),
            "a connection was reused within {QUIET:?} of its response"
        );
        assert_eq!(pool.idle_count(), 1, "a resting connection was closed");
        rest();
        assert!(pool.take().is_some(), "a rested clean connection was not reused");
    }

    #[tokio::test]
    async fn the_newest_rested_connection_goes_first() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));
        let (a, _sa) = pair(&pool, &l).await;
        let (b, _sb) = pair(&pool, &l).await;
        let (c, _sc) = pair(&pool, &l).await;
        let port = |c: &RawConn| c.io.tcp().local_addr().unwrap().port();
        let (pa, pb) = (port(&a), port(&b));
        pool.put(a);
        pool.put(b);
        rest();
        pool.put(c);
        let first = pool.take().expect("a rested connection");
        assert_eq!(port(&first), pb, "not the newest of the rested ones");
        let second = pool.take().expect("another rested connection");
        assert_eq!(port(&second), pa);
        assert!(pool.take().is_none(), "the resting one was taken");
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn only_clean_unexpired_connections_are_reused() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));

        // A stray byte from the upstream while idle: never reused.
        let (c, mut s) = pair(&pool, &l).await;
        pool.put(c);
        s.write_all(b"H").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take().is_none(), "a connection with unread bytes was reused");
        // Trusted again, for the cases below (distrust has its own test).
        pool.distrusted_until.store(0, Ordering::Relaxed);

        // Closed by the upstream while idle: never reused, and no reason for distrust.
        let (c, s) = pair(&pool, &l).await;
        pool.put(c);
        drop(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take().is_none(), "a closed connection was reused");
        assert!(pool.trusted(), "an idle close made the upstream distrusted");

        // Clean: reused, and marked so.
        let (c, _s) = pair(&pool, &l).await;
        pool.put(c);
        rest();
        let again = pool.take().expect("a clean connection is reused");
        assert!(again.reused);
    }

    #[tokio::test]
    async fn kept_connections_hold_no_read_buffer() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_secs(60));
        let (c, _s) = pair(&pool, &l).await;
        assert!(c.buf.capacity() >= crate::bufs::SIZE);
        pool.put(c);
        assert_eq!(
            pool.list()[0].conn.buf.capacity(),
            0,
            "an idle connection kept its buffer"
        );
        rest();
        let again = pool.take().expect("a clean connection is reused");
        assert!(
            again.buf.capacity() >= crate::bufs::SIZE,
            "a reused connection has room to read"
        );
    }

    #[tokio::test]
    async fn a_connection_is_taken_again_only_on_its_own_shard() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = std::sync::Arc::new(ConnPool::with_shards(
            auth,
            Duration::from_secs(1),
            Duration::from_secs(60),
            2,
        ));
        let (c, _s) = pair(&pool, &l).await;
        let on_one = pool.clone();
        std::thread::spawn(move || {
            crate::shard::enter(1);
            on_one.put(c);
        })
        .join()
        .unwrap();
        rest();
        assert!(pool.take().is_none(), "shard 0 took shard 1's connection");
        assert_eq!(pool.idle_count(), 1);
        let on_one = pool.clone();
        let again = std::thread::spawn(move || {
            crate::shard::enter(1);
            on_one.take().map(|c| c.reused)
        })
        .join()
        .unwrap();
        assert_eq!(again, Some(true), "shard 1 did not get its own connection back");
    }

    /// A TLS upstream on the demo certificate, and a pool that trusts it.
    mod tls {
        use super::*;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use tokio::io::AsyncReadExt;
        use tokio_rustls::server::TlsStream as ServerTls;

        const CERT: &[u8] = include_bytes!("../../../certs/demo-cert.pem");
        const KEY: &[u8] = include_bytes!("../../../certs/demo-key.pem");

        pub(super) async fn listener() -> (TcpListener, ConnPool) {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
            let tls = UpstreamTls::new("localhost", Some(("demo-cert.pem", CERT))).unwrap();
            let pool =
                ConnPool::new(auth, Duration::from_secs(5), Duration::from_secs(60)).with_tls(Some(tls));
            (l, pool)
        }

        /// A new connection and the upstream's end of it, the handshake done on both ends: a
        /// TLS 1.3 server sends its session tickets after it, so they are on their way to the
        /// gateway's socket.
        pub(super) async fn pair(pool: &ConnPool, l: &TcpListener) -> (RawConn, ServerTls<TcpStream>) {
            let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    vec![CertificateDer::from_pem_slice(CERT).unwrap()],
                    PrivateKeyDer::from_pem_slice(KEY).unwrap(),
                )
                .unwrap();
            let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
            let server = async {
                let (s, _) = l.accept().await.unwrap();
                // Else a small write waits, under Nagle's rule, for the gateway's delayed ack.
                s.set_nodelay(true).unwrap();
                acceptor.accept(s).await.unwrap()
            };
            let (c, s) = tokio::join!(pool.connect(), server);
            (c.unwrap(), s)
        }

        /// One request and its answer over `c`: the session is in step on both ends and
        /// nothing waits on a readiness the check before reuse used up.
        pub(super) async fn round_trip(c: &mut RawConn, s: &mut ServerTls<TcpStream>) {
            c.io.send(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
                .await
                .expect("the upstream got the request in time")
                .unwrap();
            assert_eq!(&got, b"ping");
            s.write_all(b"pong").await.unwrap();
            s.flush().await.unwrap();
            let mut got = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(5), c.io.read_exact(&mut got))
                .await
                .expect("the answer came in time")
                .unwrap();
            assert_eq!(&got, b"pong");
        }
    }

    /// Session tickets and key updates are TLS records with no response in them: an idle TLS
    /// connection that got them is clean, and still carries requests afterwards.
    #[tokio::test]
    async fn tls_records_without_data_leave_an_idle_connection_clean() {
        let (l, pool) = tls::listener().await;
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            peek(c.io.tcp()),
            Socket::Stray,
            "the session tickets did not reach the socket, so this test shows nothing"
        );
        pool.put(c);
        rest();
        c = pool
            .take()
            .expect("a connection holding session tickets was not reused");
        assert_eq!(
            peek(c.io.tcp()),
            Socket::Clean,
            "the tickets were left in the socket"
        );
        tls::round_trip(&mut c, &mut s).await;

        s.get_mut().1.refresh_traffic_keys().unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        pool.put(c);
        rest();
        let mut c = pool
            .take()
            .expect("a connection holding a key update was not reused");
        tls::round_trip(&mut c, &mut s).await;
        assert!(pool.trusted());
    }

    /// A response nobody asked for, encrypted: found in the idle connection, which is closed,
    /// and the upstream is distrusted as over plain HTTP.
    #[tokio::test]
    async fn tls_data_on_an_idle_connection_is_a_stray() {
        let (l, pool) = tls::listener().await;
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c, &mut s).await;
        pool.put(c);
        s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        rest();
        assert!(
            pool.take().is_none(),
            "a TLS connection holding a stray response was reused"
        );
        assert!(!pool.trusted(), "the straying upstream is still trusted");
        assert_eq!(pool.idle_count(), 0);
    }

    /// The stray seen through the check before a request's body goes out.
    #[tokio::test]
    async fn tls_data_before_the_body_is_seen_by_look() {
        let (l, pool) = tls::listener().await;
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c, &mut s).await;
        assert_eq!(look(&mut c.io), Socket::Clean);
        s.write_all(b"HTTP/1.1 200 OK\r\n").await.unwrap();
        s.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(look(&mut c.io), Socket::Stray);
    }

    /// Part of a record, written under the TLS session: it may be a response still arriving,
    /// so the idle connection is not reused, but nothing says it is a stray.
    #[tokio::test]
    async fn part_of_a_tls_record_closes_an_idle_connection_without_blame() {
        let (l, pool) = tls::listener().await;
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c, &mut s).await;
        let (mut c2, mut s2) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c2, &mut s2).await;
        pool.put(c);
        // An application-data record of 16 KiB, three bytes of it sent.
        s.get_mut()
            .0
            .write_all(&[23, 3, 3, 0x40, 0x00, 1, 2, 3])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        rest();
        assert!(
            pool.take().is_none(),
            "a connection holding part of a record was reused"
        );
        assert!(pool.trusted(), "part of a record made the upstream distrusted");
        s2.get_mut()
            .0
            .write_all(&[23, 3, 3, 0x40, 0x00, 1])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(look(&mut c2.io), Socket::Partial, "before a body, early bytes");
    }

    /// An upstream that closes an idle TLS connection, with close_notify or without: closed,
    /// not a stray.
    #[tokio::test]
    async fn a_closed_idle_tls_connection_is_closed_not_stray() {
        let (l, pool) = tls::listener().await;
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c, &mut s).await;
        s.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(look(&mut c.io), Socket::Closed);
        let (mut c, mut s) = tls::pair(&pool, &l).await;
        tls::round_trip(&mut c, &mut s).await;
        drop(s);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(look(&mut c.io), Socket::Closed);
    }

    #[test]
    fn records_are_followed_across_reads() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut r = Records::new(socket2::SockRef::from(&socket));
        assert!(r.whole());
        // A header and a body of 3, split across reads.
        r.follow(&[23, 3, 3]);
        assert!(!r.whole());
        r.follow(&[0, 3, 1, 2]);
        assert!(!r.whole());
        r.follow(&[3]);
        assert!(r.whole());
        // Two records in one read, the second cut in its body.
        r.follow(&[23, 3, 3, 0, 1, 9, 23, 3, 3, 0, 2, 9]);
        assert!(!r.whole());
        r.follow(&[9, 23, 3, 3, 0, 0]);
        assert!(r.whole(), "an empty record ends at its header");
    }

    #[tokio::test]
    async fn expired_connections_are_closed() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let auth: Authority = l.local_addr().unwrap().to_string().parse().unwrap();
        let pool = ConnPool::new(auth, Duration::from_secs(1), Duration::from_millis(30));
        let (c, _s1) = pair(&pool, &l).await;
        pool.put(c);
        let (c, _s2) = pair(&pool, &l).await;
        pool.put(c);
        assert_eq!(pool.idle_count(), 2);
        tokio::time::sleep(Duration::from_millis(60)).await;
        pool.sweep();
        assert_eq!(pool.idle_count(), 0);
        let (c, _s3) = pair(&pool, &l).await;
        pool.put(c);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(pool.take().is_none(), "an expired connection was reused");
    }
}
