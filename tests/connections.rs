//! The connection caps, on real `tollgate demo` processes: when a cap is full the connection
//! idle longest is closed for a newcomer, and with none idle the newcomer is closed at once
//! and counted; on the express lane and on hyper's path alike.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Http, KBIG, Tollgate};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A keep-alive client connection speaking raw HTTP/1.1.
struct Conn {
    tcp: TcpStream,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        Conn {
            tcp: TcpStream::connect(addr).await.expect("connect"),
        }
    }

    async fn send(&mut self, path: &str) {
        let head = format!("GET {path} HTTP/1.1\r\nHost: gw\r\nX-API-Key: {KBIG}\r\n\r\n");
        self.tcp.write_all(head.as_bytes()).await.expect("write");
    }

    /// Reads one response with a `Content-Length` body; its status.
    async fn status(&mut self) -> u16 {
        common::raw::read_status(&mut self.tcp, Duration::from_secs(20)).await
    }

    async fn get(&mut self, path: &str) -> u16 {
        self.send(path).await;
        self.status().await
    }

    /// Whether the gateway has closed this connection (EOF or reset, with nothing sent).
    async fn closed(&mut self) -> bool {
        let mut one = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(10), self.tcp.read(&mut one)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(_)) => panic!("the gateway sent bytes on a connection with no request"),
            Err(_) => false,
        }
    }
}

async fn metric(http: &Http, gw: &Tollgate, line_start: &str) -> Option<f64> {
    let text = String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned();
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until the gauge on the line starting `line_start` reads `want`.
async fn wait_for(http: &Http, gw: &Tollgate, line_start: &str, want: usize, args: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while metric(http, gw, line_start).await != Some(want as f64) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{args:?}: {line_start} never reached {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Opens `cap` connections one request apiece, then a newcomer: the first (idle longest) is
/// closed, the others keep serving. Then `cap` connections each hold a slow request and a
/// newcomer is closed at once; the slow requests still get their 200.
async fn cap_holds(flag: &str, label: &str, path_args: &[&str]) {
    const CAP: usize = 4;
    // Idle keep-alive connections end at the idle timeout; none may end so on a loaded machine.
    let mut args = vec!["demo", flag, "4", "--idle-timeout", "120s"];
    args.extend_from_slice(path_args);
    let gw = Tollgate::spawn(&args);
    let http = Http::new();
    let mut conns = Vec::new();
    // A connection is idle again once the gateway has finished its request, a moment after the
    // client has the response: each is waited for before the next opens, so they become idle
    // in order even when the gateway's tasks run late.
    for i in 0..CAP {
        let mut c = Conn::open(gw.addr).await;
        assert_eq!(c.get("/v1/orders").await, 200);
        conns.push(c);
        wait_for(&http, &gw, "tollgate_connections_idle ", i + 1, &args).await;
    }
    let mut newcomer = Conn::open(gw.addr).await;
    assert_eq!(
        newcomer.get("/v1/orders").await,
        200,
        "{args:?}: the newcomer is served"
    );
    assert!(
        conns[0].closed().await,
        "{args:?}: the connection idle longest was not closed"
    );
    for c in &mut conns[1..] {
        assert_eq!(
            c.get("/v1/orders").await,
            200,
            "{args:?}: a newer idle connection was closed"
        );
    }
    let evicted = format!("tollgate_connections_evicted_total{{cap=\"{label}\"}}");
    assert_eq!(metric(&http, &gw, &evicted).await, Some(1.0), "{args:?}");

    // Every place busy: three old connections and the newcomer each wait on a slow answer.
    conns.remove(0);
    conns.push(newcomer);
    for c in &mut conns {
        c.send("/v1/slow?ms=3000").await;
    }
    wait_for(&http, &gw, "tollgate_in_flight_requests ", CAP, &args).await;
    let mut refused = Conn::open(gw.addr).await;
    // The write may land before or after the close; what it gets back is the close alone.
    let _ = refused
        .tcp
        .write_all(b"GET /v1/orders HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await;
    assert!(
        refused.closed().await,
        "{args:?}: a fifth connection was not refused"
    );
    let counted = format!("tollgate_connections_refused_total{{cap=\"{label}\"}}");
    assert_eq!(metric(&http, &gw, &counted).await, Some(1.0), "{args:?}");
    for c in &mut conns {
        assert_eq!(c.status().await, 200, "{args:?}: a busy connection was cut");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_gateway_closes_the_oldest_idle_connection_or_refuses() {
    cap_holds("--max-connections", "max_connections", &[]).await;
    cap_holds("--max-connections", "max_connections", &["--no-express"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_ip_cap_works_the_same_way() {
    // Loopback is one IP, which is all the per-IP cap needs.
    cap_holds("--max-connections-per-ip", "max_connections_per_ip", &[]).await;
}

#[test]
fn a_cap_of_zero_is_refused_by_name() {
    for flag in ["--max-connections", "--max-connections-per-ip"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["demo", flag, "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(flag), "{flag} 0: {err}");
    }
}
