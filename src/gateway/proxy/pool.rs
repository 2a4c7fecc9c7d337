//! Kept connections to one upstream, for both of the gateway's paths: plain sockets the proxy
//! speaks HTTP/1.1 on itself (`proxy::client`), reused most-recent-first.
//!
//! A connection is kept only when it is known clean, and checked again before reuse:
//! - it goes back only when its last response ended exactly where its framing said and the
//!   upstream did not say it would close (the caller's part);
//! - it is taken again only if no byte has arrived since and the peer has not closed it. A byte
//!   from an idle upstream is a response nobody asked for, and whoever read it next would hand
//!   it to the wrong client;
//! - it is closed after `idle_timeout`, before the upstream's own idle timeout closes it under a
//!   request (common servers close after 5 to 60 s).
//!
//! The list sits under a mutex held only to push or pop: an upstream is one known address, so a
//! pool keyed by scheme and authority (hyper-util's) would do work for nothing. There is one list
//! per serving shard (`crate::shard`): a connection is taken again on the shard that opened it,
//! whose reactor watches its socket.

use std::collections::VecDeque;
use std::io;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::uri::Authority;
use tokio::net::TcpStream;

/// Most connections kept per upstream and shard; past it the oldest is closed.
const MAX_IDLE: usize = 1024;

/// Why no connection could be made.
#[derive(Debug, thiserror::Error)]
#[error("connect to {authority}: {why}")]
pub struct ConnectError {
    pub authority: Authority,
    pub why: String,
}

/// An upstream connection and the bytes read from it past the current response's head.
pub struct RawConn {
    pub tcp: TcpStream,
    pub buf: BytesMut,
    /// Whether it came from the idle list (and so may have been closed by the upstream).
    pub reused: bool,
}

struct Idle {
    conn: RawConn,
    since: Instant,
}

pub struct ConnPool {
    authority: Authority,
    connect_timeout: Duration,
    idle_timeout: Duration,
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

/// Whether an idle connection is as it was left: nothing to read and not closed. `try_read`
/// asks the socket only when the runtime saw it become readable since the last empty read, so
/// a quiet connection costs no system call.
fn clean(tcp: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(tcp.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
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
            connect_timeout,
            idle_timeout,
            idle: (0..shards.max(1)).map(|_| Mutex::new(VecDeque::new())).collect(),
        }
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
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

    /// A kept connection that is still clean, most recently used first. Expired and unclean
    /// ones met on the way are closed.
    pub fn take(&self) -> Option<RawConn> {
        let now = Instant::now();
        loop {
            let idle = self.list().pop_back()?;
            if now.duration_since(idle.since) >= self.idle_timeout {
                // The newest has expired, so have all the others.
                self.list().clear();
                return None;
            }
            if clean(&idle.conn.tcp) {
                let mut c = idle.conn;
                c.reused = true;
                c.buf = crate::bufs::take();
                return Some(c);
            }
        }
    }

    /// Keeps a connection whose last response was read exactly to its end. Its read buffer is
    /// given back while it waits: a pool grown by a burst would otherwise hold 8 KiB for each
    /// connection kept, and `take` asks for a new one.
    pub fn put(&self, mut c: RawConn) {
        debug_assert!(c.buf.is_empty(), "a kept connection must have nothing unread");
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
        for list in &self.idle {
            Self::lock(list)
                .retain(|i| now.duration_since(i.since) < self.idle_timeout && clean(&i.conn.tcp));
        }
    }

    /// A new connection.
    pub async fn connect(&self) -> Result<RawConn, ConnectError> {
        let host = self
            .authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = self.authority.port_u16().unwrap_or(80);
        let err = |why: String| ConnectError {
            authority: self.authority.clone(),
            why,
        };
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| err(format!("no connection within {:?}", self.connect_timeout)))?
            .map_err(|e| err(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        Ok(RawConn {
            tcp,
            buf: crate::bufs::take(),
            reused: false,
        })
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

        // Closed by the upstream while idle: never reused.
        let (c, s) = pair(&pool, &l).await;
        pool.put(c);
        drop(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(pool.take().is_none(), "a closed connection was reused");

        // Clean: reused, and marked so.
        let (c, _s) = pair(&pool, &l).await;
        pool.put(c);
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
