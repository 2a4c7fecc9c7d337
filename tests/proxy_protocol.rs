//! `--proxy-protocol` behind an L4 balancer, as real clients over loopback see it: a gateway in
//! this process, the demo upstream echoing what reached it, and raw TCP connections that start
//! with PROXY protocol v1 and v2 headers, on the express lane and on hyper's path. From a
//! trusted peer the header names the client (its per-IP buckets, `X-Forwarded-For`); a header
//! from anyone else, a trusted peer's connection without one, and a header that breaks the
//! protocol close the connection and are counted.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};
use tollgate_rules::identity::TrustedProxies;

const SIG: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";

async fn gateway(upstream: SocketAddr, trusted: &str, express: bool) -> (Running, tempfile::TempDir) {
    let (dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    // Still: the per-IP buckets below refill on no one's schedule but this test's.
    cfg.clock = tollgate_limit::clock::ManualClock::new(1_700_000_000_000_000);
    let trusted = TrustedProxies::parse(&[trusted.to_string()]).unwrap();
    cfg.trusted = trusted.clone();
    cfg.limits.proxy_protocol = Some(Arc::new(trusted));
    cfg.limits.express = express;
    // A header that never completes is given up on after this.
    cfg.limits.header_read_timeout = Duration::from_millis(500);
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    (app::start(cfg).await.expect("gateway starts"), dir)
}

fn v2(cmd: u8, fam: u8, addr: &[u8]) -> Vec<u8> {
    let mut h = SIG.to_vec();
    h.push(0x20 | cmd);
    h.push(fam);
    h.extend((addr.len() as u16).to_be_bytes());
    h.extend(addr);
    h
}

fn v2_tcp4(ip: [u8; 4], port: u16) -> Vec<u8> {
    let mut a = ip.to_vec();
    a.extend([10, 0, 0, 1]);
    a.extend(port.to_be_bytes());
    a.extend(443u16.to_be_bytes());
    v2(1, 0x11, &a)
}

/// Sends `prefix` and then a GET of `path` (with `key`, if any) on a new connection; returns
/// the status and body, or `None` when the gateway closed the connection without an answer.
async fn ask(gw: &Running, prefix: &[u8], path: &str, key: Option<&str>) -> Option<(u16, String)> {
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!("GET {path} HTTP/1.1\r\nHost: gw\r\n{auth}Connection: close\r\n\r\n");
    let mut bytes = prefix.to_vec();
    bytes.extend(req.as_bytes());
    if tcp.write_all(&bytes).await.is_err() {
        return None;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Some((status, body))
}

fn refused(gw: &Running, reason: &str) -> String {
    let want = format!("tollgate_proxy_protocol_refused_total{{reason=\"{reason}\"}}");
    gw.metrics
        .render()
        .lines()
        .find(|l| l.starts_with(&want))
        .unwrap_or("(none)")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_balancer_names_the_client_and_everyone_else_is_its_peer() {
    let upstream = common::start_demo_upstream().await;
    for express in [true, false] {
        let case = format!("express lane {express}");
        let (gw, _dir) = gateway(upstream, "127.0.0.1", express).await;

        // v1: the client's address is what the upstream is told.
        let v1 = b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n";
        let (status, body) = ask(&gw, v1, "/v1/orders", Some(common::K7)).await.expect(&case);
        assert_eq!(status, 200, "{case}: {body}");
        let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(echoed["headers"]["x-forwarded-for"], "203.0.113.7", "{case}");

        // v2, IPv4 and IPv6.
        let (_, body) = ask(
            &gw,
            &v2_tcp4([198, 51, 100, 9], 4000),
            "/v1/orders",
            Some(common::K7),
        )
        .await
        .expect(&case);
        let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(echoed["headers"]["x-forwarded-for"], "198.51.100.9", "{case}");
        let mut a6 = vec![0u8; 36];
        a6[..16].copy_from_slice(&"2001:db8::7".parse::<std::net::Ipv6Addr>().unwrap().octets());
        a6[32..34].copy_from_slice(&4000u16.to_be_bytes());
        let (_, body) = ask(&gw, &v2(1, 0x21, &a6), "/v1/orders", Some(common::K7))
            .await
            .expect(&case);
        let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(echoed["headers"]["x-forwarded-for"], "2001:db8::7", "{case}");

        // Per-IP buckets key on the named client: the unauthenticated bucket (burst 5) of one
        // client runs out, another's is untouched.
        let a = v2_tcp4([192, 0, 2, 10], 1);
        for i in 0..5 {
            let (status, _) = ask(&gw, &a, "/v1/orders", Some("nope")).await.expect(&case);
            assert_eq!(status, 401, "{case}: request {i}");
        }
        assert_eq!(
            ask(&gw, &a, "/v1/orders", Some("nope")).await.map(|r| r.0),
            Some(429),
            "{case}"
        );
        let b = v2_tcp4([192, 0, 2, 11], 1);
        assert_eq!(
            ask(&gw, &b, "/v1/orders", Some("nope")).await.map(|r| r.0),
            Some(401),
            "{case}"
        );

        // LOCAL (the balancer's own health check): the peer is the client.
        let (_, body) = ask(&gw, &v2(0, 0x00, &[]), "/v1/orders", Some(common::K7))
            .await
            .expect(&case);
        let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(echoed["headers"]["x-forwarded-for"], "127.0.0.1", "{case}");

        // From the trusted balancer the header is required, and must keep to the protocol.
        assert_eq!(
            ask(&gw, b"", "/v1/orders", Some(common::K7)).await,
            None,
            "{case}"
        );
        assert!(
            refused(&gw, "missing").ends_with(" 1"),
            "{case}: {}",
            refused(&gw, "missing")
        );
        let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 120], b"\r\n"].concat();
        assert_eq!(ask(&gw, &long, "/v1/orders", None).await, None, "{case}");
        assert!(refused(&gw, "v1_too_long").ends_with(" 1"), "{case}");
        let mismatch = b"PROXY TCP4 2001:db8::7 10.0.0.1 1 2\r\n";
        assert_eq!(ask(&gw, mismatch, "/v1/orders", None).await, None, "{case}");
        assert!(refused(&gw, "family_mismatch").ends_with(" 1"), "{case}");
        let mut wrong = SIG.to_vec();
        wrong[9] = b'X';
        assert_eq!(ask(&gw, &wrong, "/v1/orders", None).await, None, "{case}");
        assert!(refused(&gw, "missing").ends_with(" 2"), "{case}");
        // Truncated: the header's declared length never arrives.
        let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
        tcp.write_all(&v2_tcp4([192, 0, 2, 12], 1)[..20]).await.unwrap();
        let mut out = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
        // Closed (a reset, as the header's bytes were left unread) with no answer.
        assert!(
            n.is_ok() && out.is_empty(),
            "{case}: closed without an answer: {n:?} {out:?}"
        );
        assert!(refused(&gw, "timeout").ends_with(" 1"), "{case}");
        gw.shutdown().await;

        // A gateway that trusts another network: a header from here is refused, a plain
        // request is served as its peer.
        let (gw, _dir) = gateway(upstream, "10.0.0.0/8", express).await;
        assert_eq!(ask(&gw, v1, "/v1/orders", Some(common::K7)).await, None, "{case}");
        assert!(refused(&gw, "untrusted").ends_with(" 1"), "{case}");
        let (status, body) = ask(&gw, b"", "/v1/orders", Some(common::K7)).await.expect(&case);
        assert_eq!(status, 200, "{case}");
        let echoed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(echoed["headers"]["x-forwarded-for"], "127.0.0.1", "{case}");
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_comes_before_tls_and_the_client_is_named_through_it() {
    let upstream = common::start_demo_upstream().await;
    let (dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    let trusted = TrustedProxies::parse(&["127.0.0.1".to_string()]).unwrap();
    cfg.trusted = trusted.clone();
    cfg.limits.proxy_protocol = Some(Arc::new(trusted));
    let certs = common::repo().join("certs");
    cfg.tls = Some((certs.join("demo-cert.pem"), certs.join("demo-key.pem")));
    let gw = app::start(cfg).await.expect("gateway starts");

    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    tcp.write_all(b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n")
        .await
        .unwrap();
    let connector = tokio_rustls::TlsConnector::from(common::tls::client_config(&[b"http/1.1"]));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.expect("TLS after the header");
    let req = format!(
        "GET /v1/orders HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        common::K7
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let body = text.split("\r\n\r\n").nth(1).unwrap();
    let echoed: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(echoed["headers"]["x-forwarded-for"], "203.0.113.7");
    assert_eq!(echoed["headers"]["x-forwarded-proto"], "https");
    gw.shutdown().await;
    drop(dir);
}

/// A v2 header whose fixed part and addresses arrive, declaring 65,535 bytes of which no more
/// ever come: the whole header is under the head timeout, not only its first bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_never_finishes_is_cut_at_the_head_timeout() {
    let upstream = common::start_demo_upstream().await;
    for express in [true, false] {
        let (gw, _dir) = gateway(upstream, "127.0.0.1", express).await;
        let mut header = v2_tcp4([192, 0, 2, 13], 1);
        header[14..16].copy_from_slice(&u16::MAX.to_be_bytes());
        let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
        let sent = std::time::Instant::now();
        tcp.write_all(&header).await.unwrap();
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out)).await;
        let held = sent.elapsed();
        // The launcher's head timeout is 500 ms.
        assert!(
            read.is_ok() && held < Duration::from_millis(1500),
            "express lane {express}: the connection was held {held:?} ({read:?})"
        );
        assert!(out.is_empty(), "express lane {express}: {out:?}");
        assert!(
            refused(&gw, "timeout").ends_with(" 1"),
            "express lane {express}: {}",
            refused(&gw, "timeout")
        );
        gw.shutdown().await;
    }
}
