//! WebSocket relay, side by side in one run (benches/README.md "WebSocket relay"): the demo
//! upstream's echo on `/v1/stream` reached directly, through Tollgate (its route's
//! `"upgrade": ["websocket"]`, checked and charged as a request, then relayed), and through
//! nginx configured as a WebSocket proxy (`benches/nginx/websocket.conf`). Two figures each:
//!
//! - **echo**: `--clients` WebSockets, each sending a `--size`-byte text message and waiting for
//!   its echo, for `--seconds`: round trips a second, and the p99 round trip;
//! - **handshakes**: opening handshakes a second, one after another on new connections, each
//!   closed at once.
//!
//! Targets alternate for `--rounds` rounds, so a noisy machine spreads its noise over all three.
//!
//! Run: `cargo bench --bench websocket` (options after `--`: `--clients 32 --seconds 5 --rounds
//! 2 --size 64 --handshakes 500`). Under `cargo test --all-targets` it only says how to run it.

#[path = "../tests/common/mod.rs"]
mod common;

use common::bench::{Nginx, arg};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn open(addr: SocketAddr) -> Ws {
    let mut req = format!("ws://{addr}/v1/stream").into_client_request().unwrap();
    req.headers_mut().insert(
        "authorization",
        format!("Bearer {}", common::KBIG).parse().unwrap(),
    );
    let (ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .unwrap_or_else(|e| panic!("{addr}: the handshake failed: {e}"));
    ws
}

/// Round trips a second over `clients` WebSockets for `seconds`, and their p99 in µs.
async fn echo(addr: SocketAddr, clients: usize, seconds: f64, size: usize) -> (f64, u64) {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let payload = "x".repeat(size);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut ws = open(addr).await;
            let mut rtts = Vec::new();
            while Instant::now() < until {
                let sent = Instant::now();
                ws.send(Message::text(payload.clone())).await.expect("send");
                match ws.next().await {
                    Some(Ok(Message::Text(_))) => rtts.push(sent.elapsed().as_micros() as u64),
                    other => panic!("{addr}: no echo: {other:?}"),
                }
            }
            let _ = ws.close(None).await;
            rtts
        }));
    }
    let started = Instant::now();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let took = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let p99 = all.get(all.len() * 99 / 100).copied().unwrap_or(0);
    (all.len() as f64 / took, p99)
}

/// Opening handshakes a second, `n` one after another, each closed at once.
async fn handshakes(addr: SocketAddr, n: usize) -> f64 {
    let started = Instant::now();
    for _ in 0..n {
        let mut ws = open(addr).await;
        let _ = ws.close(None).await;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("websocket: a benchmark, not a test; run `cargo bench --bench websocket`");
        return;
    }
    let clients: usize = arg("--clients", 32);
    let seconds: f64 = arg("--seconds", 5.0);
    let rounds: usize = arg("--rounds", 2);
    let size: usize = arg("--size", 64);
    let n_handshakes: usize = arg("--handshakes", 500);
    println!("{}", tollgate_testkit::machine_line());
    let dir = tempfile::tempdir().unwrap();
    let upstream = common::DemoUpstreamProc::spawn(64, 0);
    // k-big's plan (10,000 a second) leaves the handshakes unrefused; one gateway thread, as
    // nginx runs one worker.
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream.addr)).unwrap();
    rules["limits"]["streams"]["concurrent"] = serde_json::json!(100_000);
    let (_rules_dir, rules_path) = common::rules_file(&rules.to_string());
    let gw = common::Tollgate::spawn(&[
        "serve",
        "--rules",
        rules_path.to_str().unwrap(),
        "--threads",
        "1",
        "--no-meter",
    ]);
    let nginx = Nginx::start(
        "websocket.conf",
        dir.path(),
        &[("__UPSTREAM__", upstream.addr.to_string())],
    );
    let targets: [(&str, SocketAddr); 3] = [
        ("direct", upstream.addr),
        ("tollgate", gw.addr),
        ("nginx", nginx.addr()),
    ];
    println!(
        "{clients} clients, {size}-byte messages, {seconds} s a round, {rounds} rounds; {n_handshakes} handshakes a round"
    );
    for round in 1..=rounds {
        for (name, addr) in targets {
            let (rate, p99) = echo(addr, clients, seconds, size).await;
            let hs = handshakes(addr, n_handshakes).await;
            println!("round {round}  {name:<9} echo {rate:>9.0}/s  p99 {p99:>6} us  handshakes {hs:>7.0}/s");
        }
    }
}
