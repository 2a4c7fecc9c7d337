//! WebSocket through the gateway, end to end with real processes and a real WebSocket client:
//! a route's `"upgrade": ["websocket"]` checks and charges the handshake like any request,
//! relays messages both ways on either path (the express lane hands upgrades to hyper), holds
//! its `concurrent` seat while open (on the embedded store and on redis-server), closes a
//! silent connection after the route's `idle_timeout_ms`, and is closed last in a drain, after
//! `--upgrade-grace`. An upgrade the route does not list is refused before it is charged.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use common::{K7, K8, Tollgate};

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens `path` on `gw` as a WebSocket with `secret` (none when empty): the socket and the `101`'s headers, or
/// the HTTP answer that refused it (status and body).
async fn open(addr: SocketAddr, path: &str, secret: &str) -> Result<(Ws, http::HeaderMap), (u16, String)> {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    if !secret.is_empty() {
        req.headers_mut()
            .insert("authorization", format!("Bearer {secret}").parse().unwrap());
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, resp)) => Ok((ws, resp.headers().clone())),
        Err(tungstenite::Error::Http(resp)) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((resp.status().as_u16(), body))
        }
        Err(e) => panic!("the handshake failed outright: {e}"),
    }
}

async fn opened(addr: SocketAddr, path: &str, secret: &str) -> (Ws, http::HeaderMap) {
    open(addr, path, secret)
        .await
        .unwrap_or_else(|(s, b)| panic!("refused with {s}: {b}"))
}

/// Sends `msg` and reads the next message, which the demo's echo makes the same.
async fn echo(ws: &mut Ws, msg: Message) -> Message {
    ws.send(msg).await.expect("send");
    tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("an echo within 10 s")
        .expect("the stream is open")
        .expect("a message")
}

/// Reads until the connection ends (a close, an error or its end), for at most `within`:
/// `true` when it ended.
async fn ends_within(ws: &mut Ws, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Err(_) => return false,
            Ok(None) | Ok(Some(Err(_))) | Ok(Some(Ok(Message::Close(_)))) => return true,
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// A metric's value in the admin listener's exposition, 0 when absent.
async fn metric(gw: &Tollgate, line_start: &str) -> f64 {
    let answer = common::Http::new().get(&gw.admin_url("/metrics"), &[]).await;
    String::from_utf8_lossy(&answer.body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Polls `metric` until it reads `want`, for up to 10 s: a relay's end is counted by its own
/// task, a moment after the client sees the close.
async fn metric_becomes(gw: &Tollgate, line_start: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = metric(gw, line_start).await;
        if v == want {
            return;
        }
        assert!(Instant::now() < deadline, "{line_start} is {v}, not {want}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The demo gateway, its plain HTTP/1.1 connections on the express lane first or on hyper's
/// path alone.
fn demo_on(lane: bool) -> Tollgate {
    Tollgate::spawn(if lane {
        &["demo"]
    } else {
        &["demo", "--no-express"]
    })
}

/// A gateway on the rules file at `path`, on the express lane first or on hyper's path alone.
fn serve_on(path: &std::path::Path, lane: bool) -> Tollgate {
    let p = path.to_str().unwrap();
    Tollgate::spawn(&if lane {
        vec!["serve", "--rules", p]
    } else {
        vec!["serve", "--rules", p, "--no-express"]
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_echo_through_the_demo_on_both_paths() {
    for lane in [true, false] {
        let gw = demo_on(lane);
        let (mut ws, headers) = opened(gw.addr, "/v1/stream", K7).await;
        // The handshake is a request like any other: limited, and named.
        assert!(headers.contains_key("x-request-id"), "{headers:?}");
        assert!(
            headers
                .get("ratelimit-policy")
                .is_some_and(|v| v.to_str().unwrap().contains("\"plan\"")),
            "{headers:?}"
        );
        assert_eq!(
            echo(&mut ws, Message::text("hello")).await,
            Message::text("hello"),
            "lane {lane}"
        );
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            echo(&mut ws, Message::binary(big.clone())).await,
            Message::binary(big)
        );
        metric_becomes(&gw, "tollgate_upgraded_connections ", 1.0).await;
        ws.close(None).await.unwrap();
        assert!(ends_within(&mut ws, Duration::from_secs(10)).await);
        metric_becomes(&gw, "tollgate_upgraded_connections ", 0.0).await;
        metric_becomes(&gw, "tollgate_upgraded_closed_total{reason=\"closed\"}", 1.0).await;
        let log = gw
            .stderr_when(|l| l.contains("route=\"stream\" status=101"))
            .await;
        assert!(log.contains("route=\"stream\" status=101"), "{log}");
    }
}

/// The demo's `streams` limit: two WebSockets open at once per key. A third is refused with
/// 429 until one of the two closes; another key is not affected.
async fn seats_are_held_while_open(gw: &Tollgate) {
    let (mut a, _) = opened(gw.addr, "/v1/stream", K7).await;
    let (mut b, _) = opened(gw.addr, "/v1/stream", K7).await;
    let (status, body) = open(gw.addr, "/v1/stream", K7)
        .await
        .map(|_| ())
        .expect_err("a third stream of k-7 is refused");
    assert_eq!(status, 429, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"], "too_many_in_flight", "{body}");
    assert_eq!(v["limit"], "streams", "{body}");
    // Another key has seats of its own.
    let (mut other, _) = opened(gw.addr, "/v1/stream", K8).await;
    assert_eq!(echo(&mut other, Message::text("k8")).await, Message::text("k8"));
    // Held while the streams talk, however long after their handshake.
    assert_eq!(echo(&mut a, Message::text("a")).await, Message::text("a"));
    assert!(open(gw.addr, "/v1/stream", K7).await.is_err());
    b.close(None).await.unwrap();
    assert!(ends_within(&mut b, Duration::from_secs(10)).await);
    // Given back when the relay ends, a moment after the close.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        match open(gw.addr, "/v1/stream", K7).await {
            Ok((ws, _)) => break ws,
            Err((429, _)) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err((s, body)) => panic!("the closed stream's seat was not given back: {s} {body}"),
        }
    };
    assert_eq!(echo(&mut c, Message::text("c")).await, Message::text("c"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_holds_its_concurrent_seat_on_the_embedded_store() {
    let gw = Tollgate::spawn(&["demo"]);
    seats_are_held_while_open(&gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_holds_its_concurrent_seat_in_redis() {
    let redis = common::RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (_dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &redis.url(),
    ]);
    seats_are_held_while_open(&gw).await;
}

/// A raw HTTP/1.1 exchange on one connection: every request's answer status, in order.
async fn statuses(addr: SocketAddr, requests: &[String]) -> Vec<(u16, String)> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for r in requests {
        tcp.write_all(r.as_bytes()).await.unwrap();
        let (status, body) =
            tokio::time::timeout(Duration::from_secs(10), common::read_framed(&mut tcp, &mut buf))
                .await
                .expect("an answer within 10 s")
                .unwrap_or_else(|e| panic!("after {out:?}: {e}"));
        out.push((status, String::from_utf8_lossy(&buf[body]).into_owned()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_the_route_does_not_list_is_refused_before_it_is_charged() {
    for lane in [true, false] {
        let gw = demo_on(lane);
        let usage = format!("GET /v1/usage HTTP/1.1\r\nHost: t\r\nX-API-Key: {K7}\r\n\r\n");
        let ws_on_orders = format!(
            "GET /v1/orders HTTP/1.1\r\nHost: t\r\nX-API-Key: {K7}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        );
        // curl --http2 on plain HTTP asks for h2c: ignored, and the request served as HTTP/1.1.
        let h2c = format!(
            "GET /v1/orders HTTP/1.1\r\nHost: t\r\nX-API-Key: {K7}\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n"
        );
        // The upstream refuses an upgrade it can't make (no key): its answer goes back, and the
        // connection goes on as HTTP/1.1.
        let half = format!(
            "GET /v1/stream HTTP/1.1\r\nHost: t\r\nX-API-Key: {K7}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        );
        let got = statuses(
            gw.addr,
            &[usage.clone(), ws_on_orders, usage.clone(), h2c, half, usage],
        )
        .await;
        let plan_left = |body: &str| -> u64 {
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            let plan = v["limits"]
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["name"] == "plan")
                .unwrap_or_else(|| panic!("no plan in {body}"))
                .clone();
            plan["remaining"].as_u64().unwrap()
        };
        assert_eq!(got[0].0, 200, "{:?}", got[0]);
        assert_eq!(got[1].0, 403, "lane {lane}: {:?}", got[1]);
        let refusal: serde_json::Value = serde_json::from_str(&got[1].1).unwrap();
        assert_eq!(refusal["error"], "upgrade_not_allowed");
        assert!(
            refusal["message"].as_str().unwrap().contains("\"websocket\""),
            "{refusal}"
        );
        // Nothing was charged for the refused upgrade: no limit was checked.
        assert_eq!(plan_left(&got[2].1), plan_left(&got[0].1), "{got:?}");
        let log = gw.stderr_when(|l| l.contains("status=403")).await;
        let line = log
            .lines()
            .find(|l| l.contains("status=403"))
            .unwrap_or_else(|| panic!("{log}"));
        assert!(line.contains("limit=\"-\""), "{line}");
        assert_eq!(got[3].0, 200, "{:?}", got[3]);
        let echoed: serde_json::Value = serde_json::from_str(&got[3].1).unwrap();
        let upstream_saw = echoed["headers"].as_object().unwrap();
        assert!(
            !upstream_saw.contains_key("upgrade") && !upstream_saw.contains_key("http2-settings"),
            "{echoed}"
        );
        assert_eq!(got[4].0, 426, "{:?}", got[4]);
        assert_eq!(got[5].0, 200, "the connection went on: {:?}", got[5]);
    }
}

fn stream_rules(upstream: SocketAddr, idle_ms: u64) -> String {
    format!(
        r#"{{"version": 1, "upstreams": {{"u": {{"url": "http://{upstream}"}}}},
            "routes": [{{"method": "GET", "path": "/v1/stream", "upstream": "u", "key": "optional",
                         "upgrade": ["websocket"], "idle_timeout_ms": {idle_ms}}}]}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_closed_after_its_idle_timeout() {
    let upstream = common::start_demo_upstream().await;
    let (_dir, path) = common::rules_file(&stream_rules(upstream, 1000));
    let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap()]);
    let (mut talking, _) = opened(gw.addr, "/v1/stream", "").await;
    let (mut silent, _) = opened(gw.addr, "/v1/stream", "").await;
    // One message every 100 ms keeps a stream open past its 1 s idle timeout.
    let began = Instant::now();
    while began.elapsed() < Duration::from_millis(2500) {
        assert_eq!(echo(&mut talking, Message::text("x")).await, Message::text("x"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ends_within(&mut silent, Duration::from_secs(10)).await,
        "the silent stream is still open"
    );
    assert_eq!(echo(&mut talking, Message::text("y")).await, Message::text("y"));
    metric_becomes(&gw, "tollgate_upgraded_closed_total{reason=\"idle\"}", 1.0).await;
    metric_becomes(&gw, "tollgate_upgraded_connections ", 1.0).await;
}

/// A SIGTERM with a request in flight and a WebSocket open: the listener stops, the request
/// finishes, the WebSocket still talks after it, and is closed at the end of its grace; then
/// the process exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_closes_upgraded_connections_last_after_their_grace() {
    let mut gw = Tollgate::spawn(&["demo", "--drain-timeout", "20s", "--upgrade-grace", "3s"]);
    let (mut ws, _) = opened(gw.addr, "/v1/stream", K7).await;
    let http = common::Http::new();
    let slow = {
        let (http, url) = (http.clone(), gw.url("/v1/slow?ms=1500"));
        let auth = format!("Bearer {K7}");
        tokio::spawn(async move { http.get(&url, &[("authorization", auth.as_str())]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.signal("TERM");
    // The listener stops.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(gw.addr).await.is_ok() {
        assert!(Instant::now() < deadline, "still accepting 10 s after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The request in flight finishes.
    let answer = slow.await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let finished = Instant::now();
    // The WebSocket is still relayed after the requests have finished...
    assert_eq!(
        echo(&mut ws, Message::text("still here")).await,
        Message::text("still here")
    );
    // ...until its grace ends.
    assert!(
        ends_within(&mut ws, Duration::from_secs(15)).await,
        "never closed"
    );
    assert!(
        finished.elapsed() < Duration::from_secs(15),
        "closed {:?} after the requests finished",
        finished.elapsed()
    );
    let status = gw.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let log = gw.stderr();
    assert!(
        log.contains("closing upgraded connections still open after the grace"),
        "{log}"
    );
}

/// An upstream that answers `101` and then sends bytes at once: they reach the client right
/// behind the gateway's `101`, and the client's bytes reach the upstream, on both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_right_behind_the_switch_are_relayed() {
    let up = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = up.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = up.accept().await.unwrap();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut b).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    head.extend_from_slice(&b[..n]);
                }
                let text = String::from_utf8_lossy(&head).to_lowercase();
                assert!(text.contains("upgrade: websocket") && text.contains("connection: upgrade"));
                s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nEARLY")
                    .await
                    .unwrap();
                // Echo what the client sends next, then close.
                let n = s.read(&mut b).await.unwrap();
                s.write_all(&b[..n]).await.unwrap();
            });
        }
    });
    let (_dir, path) = common::rules_file(&stream_rules(up_addr, 60_000));
    for lane in [true, false] {
        let gw = serve_on(&path, lane);
        let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        tcp.write_all(
            b"GET /v1/stream HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        )
        .await
        .unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 1024];
        while !got.ends_with(b"EARLY") {
            let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut b))
                .await
                .expect("the switch within 10 s")
                .unwrap();
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&b[..n]);
        }
        let text = String::from_utf8_lossy(&got).to_lowercase();
        assert!(text.starts_with("http/1.1 101 "), "{text}");
        assert!(
            text.contains("\r\nupgrade: websocket\r\n") && text.contains("\r\nconnection: upgrade\r\n"),
            "{text}"
        );
        tcp.write_all(b"ping-bytes").await.unwrap();
        let mut back = vec![0u8; 10];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut back))
            .await
            .expect("the echo within 10 s")
            .unwrap();
        assert_eq!(&back, b"ping-bytes", "lane {lane}");
    }
}

/// `wss://`: the handshake and the relay over the gateway's TLS listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_echo_over_tls() {
    let cert = common::repo().join("certs/demo-cert.pem");
    let key = common::repo().join("certs/demo-key.pem");
    let gw = Tollgate::spawn(&[
        "demo",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let tls = common::tls::connect(gw.addr, &[b"http/1.1"]).await;
    let mut req = format!("wss://localhost:{}/v1/stream", gw.addr.port())
        .into_client_request()
        .unwrap();
    req.headers_mut()
        .insert("authorization", format!("Bearer {K7}").parse().unwrap());
    let (mut ws, resp) = tokio_tungstenite::client_async(req, tls)
        .await
        .expect("the handshake over TLS");
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("over tls")).await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("an echo within 10 s")
        .unwrap()
        .unwrap();
    assert_eq!(back, Message::text("over tls"));
}

/// After the switch the client's bytes are WebSocket frames, not request heads: the head
/// timeout (which answers 408 to a head left unfinished) must not read them as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_head_timeout_leaves_an_upgraded_connection_alone() {
    let gw = Tollgate::spawn(&["demo", "--header-timeout", "1s"]);
    let (mut ws, _) = opened(gw.addr, "/v1/stream", K7).await;
    assert_eq!(echo(&mut ws, Message::text("one")).await, Message::text("one"));
    // Silent for more than the head timeout.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(echo(&mut ws, Message::text("two")).await, Message::text("two"));
}

/// An upstream over TLS (`https://`, its CA in the rules): the switch and the relay run over
/// the upstream's TLS session as over plain TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_echo_to_an_upstream_over_tls() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(common::tls::server_config());
    tokio::spawn(async move {
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut ws) = tokio_tungstenite::accept_async(tls).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_text() && ws.send(msg).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let rules = serde_json::json!({
        "version": 1,
        "upstreams": {"secure": {"url": format!("https://{up}"), "tls": common::tls::demo_ca()}},
        "routes": [{"method": "GET", "path": "/v1/stream", "upstream": "secure", "key": "optional",
                    "upgrade": ["websocket"]}]
    });
    let (_dir, path) = common::rules_file(&rules.to_string());
    for lane in [true, false] {
        let gw = serve_on(&path, lane);
        let (mut ws, _) = opened(gw.addr, "/v1/stream", "").await;
        assert_eq!(
            echo(&mut ws, Message::text("through tls")).await,
            Message::text("through tls"),
            "lane {lane}"
        );
    }
}
