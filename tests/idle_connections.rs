//! Ten thousand idle keep-alive connections on a real `tollgate demo` process while 32 active
//! clients run: every idle connection stays open and usable, and the active clients get only
//! 200s. Correctness only; what they cost in memory and latency is benches/idle_conns.rs.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Tollgate, repo};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const IDLE: usize = 10_000;
const ACTIVE: usize = 32;
const ACTIVE_REQUESTS: usize = 40;

/// Sends one GET on `tcp` and reads its `Content-Length` framed response; its status.
async fn request(tcp: &mut TcpStream) -> u16 {
    tcp.write_all(b"GET /v1/orders HTTP/1.1\r\nHost: gw\r\nX-API-Key: bench-demo-key\r\n\r\n")
        .await
        .expect("write a request");
    // A deadline, so a lost answer fails the test instead of hanging it.
    common::raw::read_status(tcp, Duration::from_secs(60)).await
}

async fn connect(addr: SocketAddr) -> TcpStream {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let _ = tcp.set_nodelay(true);
    tcp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_connections_stay_open_while_active_clients_run() {
    // The gateway inherits the raised limit: each side holds one descriptor per connection.
    let limit = rlimit::increase_nofile_limit(u64::MAX).expect("raise the descriptor limit");
    assert!(
        limit as usize > IDLE + 1000,
        "the descriptor limit is {limit}: this test needs {} (raise the hard limit)",
        IDLE + 1000
    );
    let rules = repo().join("rules/bench.json");
    // The idle timeout ends idle keep-alive connections: keep them past the test.
    let gw = Tollgate::spawn_with_env(
        &[
            "demo",
            "--rules",
            rules.to_str().unwrap(),
            "--idle-timeout",
            "300s",
        ],
        &[("TOLLGATE_LOG", "warn")],
    );
    let addr = gw.addr;

    let mut idle = Vec::with_capacity(IDLE);
    let mut set = tokio::task::JoinSet::new();
    let mut started = 0;
    while idle.len() < IDLE {
        while started < IDLE && set.len() < 200 {
            started += 1;
            set.spawn(async move {
                let mut tcp = connect(addr).await;
                assert_eq!(request(&mut tcp).await, 200, "an idle connection's first request");
                tcp
            });
        }
        idle.push(set.join_next().await.unwrap().unwrap());
    }

    let mut active = tokio::task::JoinSet::new();
    for _ in 0..ACTIVE {
        active.spawn(async move {
            let mut tcp = connect(addr).await;
            let mut statuses = Vec::with_capacity(ACTIVE_REQUESTS);
            for _ in 0..ACTIVE_REQUESTS {
                statuses.push(request(&mut tcp).await);
            }
            statuses
        });
    }
    let mut served = 0;
    while let Some(statuses) = active.join_next().await {
        let statuses = statuses.unwrap();
        assert!(
            statuses.iter().all(|s| *s == 200),
            "an active client got {statuses:?}"
        );
        served += statuses.len();
    }
    assert_eq!(served, ACTIVE * ACTIVE_REQUESTS);

    // Open: nothing to read and no end of stream on any of them.
    let mut one = [0u8; 1];
    let closed = idle
        .iter()
        .filter(|c| !matches!(c.try_read(&mut one), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock))
        .count();
    assert_eq!(
        closed, 0,
        "{closed} of {IDLE} idle connections were closed or sent bytes"
    );
    // Usable: a sample of them, spread over the order they were opened in, is served again.
    for c in idle.iter_mut().step_by(50) {
        assert_eq!(request(c).await, 200, "an idle connection's next request");
    }
}
