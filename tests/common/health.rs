//! An outside health check for a Region, as a test controls it: `GET /healthz` answers 200
//! while up, 503 while down, and nothing at all (a refused connection) once stopped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct HealthServer {
    addr: SocketAddr,
    state: Arc<State>,
    accept: std::sync::Mutex<Option<JoinHandle<()>>>,
}

struct State {
    up: AtomicBool,
    /// `GET /healthz` requests answered, so a test can tell the gateways do poll it.
    hits: AtomicU64,
}

impl HealthServer {
    /// Listens on 127.0.0.1:0, up.
    pub async fn start() -> HealthServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("health server binds");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            up: AtomicBool::new(true),
            hits: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, state.clone()));
        HealthServer {
            addr,
            state,
            accept: std::sync::Mutex::new(Some(accept)),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/healthz`.
    pub fn url(&self) -> String {
        format!("http://{}/healthz", self.addr)
    }

    /// `false`: answer 503 from now on.
    pub fn set_up(&self, up: bool) {
        self.state.up.store(up, Ordering::SeqCst);
    }

    pub fn hits(&self) -> u64 {
        self.state.hits.load(Ordering::SeqCst)
    }

    /// Closes the listener: from when this returns, connections are refused.
    pub async fn stop(&self) {
        let handle = self.accept.lock().unwrap().take();
        if let Some(handle) = handle {
            handle.abort();
            // The listener is dropped with the task; wait for that, so "stopped" is true on return.
            let _ = handle.await;
        }
    }
}

impl Drop for HealthServer {
    fn drop(&mut self) {
        if let Some(handle) = self.accept.lock().unwrap().take() {
            handle.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: wait rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        tokio::spawn(answer(stream, state.clone()));
    }
}

/// Reads one request head and answers it, then closes: one request per connection is all a
/// health poller needs, and `Connection: close` tells it so.
async fn answer(mut stream: TcpStream, state: Arc<State>) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 16 * 1024 {
            return;
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (status, body): (&str, &str) = if method == b"GET" && path == b"/healthz" {
        state.hits.fetch_add(1, Ordering::SeqCst);
        if state.up.load(Ordering::SeqCst) {
            ("200 OK", "ok\n")
        } else {
            ("503 Service Unavailable", "down\n")
        }
    } else {
        ("404 Not Found", "not found\n")
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
}
