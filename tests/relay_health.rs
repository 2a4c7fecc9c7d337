//! The fixtures the live Regions tests (`regions_live.rs`) stand on: the TCP relay that cuts a
//! Region off from the others' stores, and the health server that answers up, down and then not
//! at all.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::Http;
use common::health::HealthServer;
use common::relay::Relay;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// ---------------------------------------------------------------------------------------------
// The fixtures the tests above stand on.

async fn echo_server() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
    s.write_all(msg).await.unwrap();
    let mut buf = vec![0; msg.len()];
    s.read_exact(&mut buf).await.unwrap();
    buf
}

/// Whether the peer closed: EOF or a reset. Bounded, so a relay that forgot to close fails the
/// test instead of hanging it.
async fn sees_close(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test]
async fn the_relay_passes_bytes_and_a_cut_closes_old_and_new_connections() {
    let relay = Relay::start(echo_server().await).await;
    let mut a = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut a, b"hello").await, b"hello");
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(
        round_trip(&mut a, &big).await,
        big,
        "a larger message passes whole"
    );

    relay.cut();
    assert!(relay.is_cut());
    assert!(
        sees_close(&mut a).await,
        "a relayed connection was not closed by the cut"
    );
    let mut b = TcpStream::connect(relay.addr()).await.unwrap();
    assert!(
        sees_close(&mut b).await,
        "a connection made after the cut was relayed"
    );

    relay.restore();
    let mut c = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut c, b"again").await, b"again");
}

#[tokio::test]
async fn dropping_the_relay_closes_its_connections() {
    let relay = Relay::start(echo_server().await).await;
    let mut a = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut a, b"x").await, b"x");
    drop(relay);
    assert!(sees_close(&mut a).await);
}

#[tokio::test]
async fn the_health_server_answers_up_down_and_then_not_at_all() {
    let health = HealthServer::start().await;
    let http = Http::new();
    assert_eq!(http.get(&health.url(), &[]).await.status, StatusCode::OK);
    health.set_up(false);
    assert_eq!(
        http.get(&health.url(), &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    health.set_up(true);
    assert_eq!(http.get(&health.url(), &[]).await.status, StatusCode::OK);
    let other = format!("http://{}/other", health.addr());
    assert_eq!(http.get(&other, &[]).await.status, StatusCode::NOT_FOUND);
    assert_eq!(health.hits(), 3, "only GET /healthz counts");
    health.stop().await;
    let e = TcpStream::connect(health.addr())
        .await
        .expect_err("connected to a stopped health server");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
}
