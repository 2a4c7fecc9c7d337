//! The express lane against real sockets: the upstream framings it relays (fixed, chunked,
//! close-delimited, HTTP/1.0, interim 1xx), the same upstream heads and client answers with the
//! lane on and off, on plain TCP and on TLS, a connection handed to hyper in the middle of a
//! pipeline, and upstream connections kept only while the upstream keeps them.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::{Answer, Http, KBIG, raw};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};

/// An upstream that answers by path with hand-written bytes, and records every request head
/// and every connection it accepts.
#[derive(Default)]
struct Recorder {
    connections: AtomicUsize,
    heads: Mutex<Vec<String>>,
}

async fn recording_upstream() -> (SocketAddr, Arc<Recorder>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let rec = Arc::new(Recorder::default());
    let r = rec.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            r.connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve_upstream(s, r.clone()));
        }
    });
    (addr, rec)
}

async fn serve_upstream(mut s: TcpStream, rec: Arc<Recorder>) {
    let mut buf = Vec::new();
    loop {
        let Some((head, len)) = raw::read_head(&mut s, &mut buf).await else {
            return;
        };
        let head = String::from_utf8(head).unwrap();
        if !raw::read_body(&mut s, &mut buf, len).await {
            return;
        }
        let body: Vec<u8> = buf.drain(..len).collect();
        rec.heads.lock().unwrap().push(head.clone());
        let target = head.split(' ').nth(1).unwrap_or("");
        let path = target.split('?').next().unwrap_or("").to_string();
        let answer: Vec<u8> = match path.as_str() {
            "/v1/fixed" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Up: 1\r\n\r\nhello".to_vec(),
            "/v1/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n\
                5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
                .to_vec(),
            "/v1/hints" => b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n\
                HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                .to_vec(),
            "/v1/empty" => b"HTTP/1.1 204 No Content\r\nX-Up: 1\r\n\r\n".to_vec(),
            "/v1/big" => {
                let mut a = b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n".to_vec();
                a.extend(std::iter::repeat_n(b'x', 1 << 20));
                a
            }
            "/v1/echo" => {
                let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
                a.extend_from_slice(&body);
                a
            }
            "/v1/close" => {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the upstream closes")
                    .await;
                return;
            }
            "/v1/http10" => {
                let _ = s
                    .write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nold")
                    .await;
                return;
            }
            _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        };
        if s.write_all(&answer).await.is_err() {
            return;
        }
    }
}

async fn gateway(upstream: SocketAddr, express: bool) -> (Running, tempfile::TempDir) {
    gateway_with(upstream, express, |_| {}).await
}

async fn gateway_with(
    upstream: SocketAddr,
    express: bool,
    set: impl FnOnce(&mut GatewayConfig),
) -> (Running, tempfile::TempDir) {
    let (dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.clock = tollgate_limit::clock::ManualClock::new(1_000_000);
    cfg.limits.express = express;
    set(&mut cfg);
    (app::start(cfg).await.expect("gateway starts"), dir)
}

/// A gateway on TLS with the demo certificate.
async fn tls_gateway(upstream: SocketAddr, express: bool) -> (Running, tempfile::TempDir) {
    gateway_with(upstream, express, with_tls).await
}

/// The demo certificate on the gateway's listener.
fn with_tls(cfg: &mut GatewayConfig) {
    let certs = common::repo().join("certs");
    cfg.tls = Some((certs.join("demo-cert.pem"), certs.join("demo-key.pem")));
}

/// What a client can compare between the two paths: status, body, and the end-to-end headers
/// (names lowercased; the date and the connection's own framing headers left out).
fn comparable(a: &Answer) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut headers: Vec<(String, String)> = a
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "date" | "connection" | "transfer-encoding"))
        .map(|(n, v)| (n.as_str().to_string(), v.to_str().unwrap().to_string()))
        .collect();
    headers.sort();
    (a.status.as_u16(), headers, a.body.to_vec())
}

#[tokio::test]
async fn every_upstream_framing_reaches_the_client_as_on_hypers_path() {
    let (up, _rec) = recording_upstream().await;
    let (lane, _d1) = gateway(up, true).await;
    let (general, _d2) = gateway(up, false).await;
    let http = Http::new();
    let id = [("x-api-key", KBIG), ("x-request-id", "same-id-both-ways")];
    for (path, body) in [
        ("/v1/fixed", &b"hello"[..]),
        ("/v1/chunked", b"hello world"),
        ("/v1/hints", b"ok"),
        ("/v1/empty", b""),
        ("/v1/close", b"until the upstream closes"),
        ("/v1/http10", b"old"),
    ] {
        // Twice each, so the second goes out on whatever connection the first left behind.
        for round in 0..2 {
            let a = http.get(&format!("http://{}{path}", lane.addr), &id).await;
            let b = http.get(&format!("http://{}{path}", general.addr), &id).await;
            assert_eq!(&a.body[..], body, "{path} round {round} on the lane");
            assert_eq!(
                comparable(&a),
                comparable(&b),
                "{path} round {round}: lane vs hyper"
            );
            assert!(a.header("ratelimit").is_some(), "{path}: {:?}", a.headers);
            assert!(a.header("date").is_some(), "{path}: {:?}", a.headers);
        }
    }
    // A HEAD gets the head only, on both paths.
    let a = http
        .send(
            http::Method::HEAD,
            &format!("http://{}/v1/fixed", lane.addr),
            &id,
            b"",
        )
        .await;
    let b = http
        .send(
            http::Method::HEAD,
            &format!("http://{}/v1/fixed", general.addr),
            &id,
            b"",
        )
        .await;
    assert_eq!(comparable(&a), comparable(&b));
    assert!(a.body.is_empty());
    let big = http.get(&format!("http://{}/v1/big", lane.addr), &id).await;
    assert_eq!(big.body.len(), 1 << 20);
    assert!(big.body.iter().all(|&c| c == b'x'));
}

#[tokio::test]
async fn the_upstream_gets_the_same_head_from_both_paths() {
    let (up, rec) = recording_upstream().await;
    let (lane, _d1) = gateway(up, true).await;
    let (general, _d2) = gateway(up, false).await;
    let http = Http::new();
    let cases: [&[(&str, &str)]; 4] = [
        &[("x-api-key", KBIG)],
        &[
            ("authorization", "Bearer kbig-demo-key"),
            ("x-custom", "a"),
            ("x-custom", "b"),
        ],
        &[
            ("x-api-key", KBIG),
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-host", "spoofed.example"),
            ("x-tollgate-key-id", "k-forged"),
            ("connection", "keep-alive"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
        ],
        &[("x-api-key", KBIG), ("content-length", "0"), ("accept", "*/*")],
    ];
    for (i, extra) in cases.iter().enumerate() {
        let mut headers = vec![("x-request-id", "fixed-id")];
        headers.extend_from_slice(extra);
        for addr in [lane.addr, general.addr] {
            let a = http
                .send(
                    http::Method::DELETE,
                    &format!("http://{addr}/v1/echo?case={i}"),
                    &headers,
                    b"",
                )
                .await;
            assert_eq!(a.status, 200, "case {i}");
        }
    }
    let heads = rec.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 2 * cases.len());
    let normal = |head: &str| {
        let mut lines: Vec<String> = head
            .lines()
            .skip(1)
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (n, v) = l.split_once(':').unwrap();
                format!("{}: {}", n.to_ascii_lowercase(), v.trim())
            })
            // The gateway's own Host names each gateway's upstream the same way; the
            // Forwarded-Host is the gateway's address, which differs between the two.
            .filter(|l| !l.starts_with("x-forwarded-host: 127.0.0.1:"))
            .collect();
        lines.sort();
        (head.lines().next().unwrap().to_string(), lines)
    };
    for pair in heads.chunks(2) {
        assert_eq!(
            normal(&pair[0]),
            normal(&pair[1]),
            "lane:\n{}\nhyper:\n{}",
            pair[0],
            pair[1]
        );
        let (_, lines) = normal(&pair[0]);
        assert!(lines.iter().all(|l| !l.contains("kbig-demo-key")), "{lines:?}");
        assert!(
            lines.contains(&"x-tollgate-key-id: k-big".to_string()),
            "{lines:?}"
        );
        assert!(lines.contains(&"x-request-id: fixed-id".to_string()), "{lines:?}");
        assert!(
            !lines
                .iter()
                .any(|l| l.starts_with("keep-alive") || l.starts_with("te:")),
            "{lines:?}"
        );
    }
}

/// Reads `n` responses with `Content-Length` bodies from a raw connection.
async fn read_responses<S: AsyncRead + Unpin>(s: &mut S, n: usize) -> Vec<(u16, Vec<u8>)> {
    read_answers(s, n)
        .await
        .into_iter()
        .map(|(code, _, body)| (code, body))
        .collect()
}

/// [`read_responses`] with each response's head as sent.
async fn read_answers<S: AsyncRead + Unpin>(s: &mut S, n: usize) -> Vec<(u16, String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while out.len() < n {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(&buf) {
            let body_len: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                // A 204 has none, and no body.
                .unwrap_or_else(|| {
                    assert_eq!(resp.code, Some(204), "a content-length");
                    0
                });
            if buf.len() >= len + body_len {
                let head = String::from_utf8_lossy(&buf[..len]).into_owned();
                out.push((resp.code.unwrap(), head, buf[len..len + body_len].to_vec()));
                buf.drain(..len + body_len);
                continue;
            }
        }
        let mut chunk = [0u8; 4096];
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("the gateway answers")
            .unwrap();
        assert!(got > 0, "the gateway closed after {} responses", out.len());
        buf.extend_from_slice(&chunk[..got]);
    }
    out
}

/// A lane GET, a POST with a body (hyper's), then a GET hyper now serves, for one write.
fn pipeline() -> String {
    let key = format!("X-API-Key: {KBIG}\r\nHost: gw\r\n");
    format!(
        "GET /v1/fixed HTTP/1.1\r\n{key}\r\n\
         POST /v1/echo HTTP/1.1\r\n{key}Content-Length: 7\r\n\r\npayload\
         GET /v1/fixed HTTP/1.1\r\n{key}\r\n"
    )
}

#[tokio::test]
async fn a_pipelined_connection_moves_to_hyper_mid_stream_and_keeps_its_order() {
    let (up, rec) = recording_upstream().await;
    let (gw, _d) = gateway(up, true).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(pipeline().as_bytes()).await.unwrap();
    let answers = read_responses(&mut s, 3).await;
    assert_eq!(
        answers,
        vec![
            (200, b"hello".to_vec()),
            (200, b"payload".to_vec()),
            (200, b"hello".to_vec())
        ]
    );
    // And the smuggling watcher still sees hyper's requests from their first byte.
    s.write_all(
        b"POST /v1/echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.starts_with("HTTP/1.1 400"), "{rest}");
    assert_eq!(
        rec.heads.lock().unwrap().len(),
        3,
        "the smuggling-shaped request reached the upstream"
    );
}

#[tokio::test]
async fn unusual_requests_on_the_lane_port_are_served_by_hyper() {
    let (up, _rec) = recording_upstream().await;
    let (gw, _d) = gateway(up, true).await;
    // HTTP/1.0, Connection: close, h2c prior knowledge: each still answered.
    for req in [
        format!("GET /v1/fixed HTTP/1.0\r\nX-API-Key: {KBIG}\r\n\r\n"),
        format!("GET /v1/fixed HTTP/1.1\r\nHost: gw\r\nX-API-Key: {KBIG}\r\nConnection: close\r\n\r\n"),
    ] {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut out))
            .await
            .expect("the gateway closes after answering")
            .unwrap();
        let out = String::from_utf8_lossy(&out);
        assert!(
            out.starts_with("HTTP/1.") && out.contains(" 200 OK"),
            "{req:?}: {out}"
        );
        assert!(out.ends_with("hello"), "{out}");
    }
    let out = tokio::process::Command::new("curl")
        .args([
            "-s",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
        ])
        .args([
            "-H",
            &format!("x-api-key: {KBIG}"),
            &format!("http://{}/v1/fixed", gw.addr),
        ])
        .output()
        .await
        .expect("curl runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "2 200");
}

#[tokio::test]
async fn upstream_connections_are_kept_only_while_the_upstream_keeps_them() {
    let (up, rec) = recording_upstream().await;
    let (gw, _d) = gateway(up, true).await;
    let http = Http::new();
    let base = format!("http://{}", gw.addr);
    let get = |path: &'static str| {
        let (http, url) = (http.clone(), format!("{base}{path}"));
        async move {
            let got = http.get(&url, &[("x-api-key", KBIG)]).await;
            // A kept connection rests 2 ms after its answer before it carries another request.
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            got
        }
    };
    for _ in 0..5 {
        assert_eq!(get("/v1/fixed").await.status, 200);
    }
    assert_eq!(
        rec.connections.load(Ordering::SeqCst),
        1,
        "five requests, one connection"
    );
    // The upstream closes after these: the next request needs a new connection each time.
    assert_eq!(get("/v1/close").await.status, 200);
    assert_eq!(get("/v1/http10").await.status, 200);
    assert_eq!(get("/v1/fixed").await.status, 200);
    assert_eq!(get("/v1/fixed").await.status, 200);
    assert_eq!(rec.connections.load(Ordering::SeqCst), 3);
}

/// A request to send raw, keep-alive, with the big key.
fn raw_get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: gw\r\nX-API-Key: {KBIG}\r\nX-Request-Id: same-id-both-ways\r\n\r\n")
}

/// What a client compares of a raw answer: the status, the body, and the head's lines less the
/// date, lowercased and sorted.
fn comparable_raw(a: &(u16, String, Vec<u8>)) -> (u16, Vec<String>, Vec<u8>) {
    let mut lines: Vec<String> =
        a.1.lines()
            .skip(1)
            .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("date:"))
            .map(|l| l.to_ascii_lowercase())
            .collect();
    lines.sort();
    (a.0, lines, a.2.clone())
}

#[tokio::test]
async fn tls_http1_takes_the_lane_and_answers_as_hypers_path() {
    let (up, rec) = recording_upstream().await;
    let (lane, _d1) = tls_gateway(up, true).await;
    let (general, _d2) = tls_gateway(up, false).await;
    // ALPN http/1.1, and a client that offers no ALPN at all: both speak HTTP/1.1.
    for alpn in [&[&b"http/1.1"[..]][..], &[]] {
        let mut on_lane = common::tls::connect(lane.addr, alpn).await;
        let mut on_hyper = common::tls::connect(general.addr, alpn).await;
        for path in ["/v1/fixed", "/v1/chunked", "/v1/empty", "/v1/http10", "/v1/fixed"] {
            let req = raw_get(path);
            on_lane.write_all(req.as_bytes()).await.unwrap();
            on_hyper.write_all(req.as_bytes()).await.unwrap();
            let (a, b) = if path == "/v1/chunked" {
                (
                    read_chunked(&mut on_lane).await,
                    read_chunked(&mut on_hyper).await,
                )
            } else {
                (
                    read_answers(&mut on_lane, 1).await.remove(0),
                    read_answers(&mut on_hyper, 1).await.remove(0),
                )
            };
            assert_eq!(
                comparable_raw(&a),
                comparable_raw(&b),
                "{path} {alpn:?}: lane vs hyper"
            );
            assert!(a.1.contains("ratelimit: "), "{path}: {}", a.1);
            // Which path answered: the lane relays the upstream's header names as they came,
            // hyper's path writes them as `http` keeps them, lowercased.
            if path != "/v1/http10" {
                assert!(
                    a.1.contains("\r\nX-Up: 1\r\n"),
                    "{path}: not the lane's answer: {}",
                    a.1
                );
                assert!(
                    b.1.contains("\r\nx-up: 1\r\n"),
                    "{path}: not hyper's answer: {}",
                    b.1
                );
            }
        }
    }
    // The upstream heard the same from both, with the TLS connection's scheme.
    let heads = rec.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 20);
    for pair in heads.chunks(2) {
        let proto = |h: &str| {
            h.lines()
                .find(|l| l.to_ascii_lowercase().starts_with("x-forwarded-proto:"))
                .map(|l| l.to_ascii_lowercase())
        };
        assert_eq!(
            proto(&pair[0]).as_deref(),
            Some("x-forwarded-proto: https"),
            "{}",
            pair[0]
        );
        assert_eq!(proto(&pair[0]), proto(&pair[1]));
    }
}

/// Reads one chunked response whole: its status, its head, and the body decoded (the chunk
/// framing, extensions and trailers are each path's own).
async fn read_chunked<S: AsyncRead + Unpin>(s: &mut S) -> (u16, String, Vec<u8>) {
    let mut buf = Vec::new();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n")
            && let Some(body) = dechunk(&buf[end + 4..])
        {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            let code = head[9..12].parse().unwrap();
            return (code, head, body);
        }
        let mut chunk = [0u8; 4096];
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("the gateway answers")
            .unwrap();
        assert!(got > 0, "the gateway closed mid-answer");
        buf.extend_from_slice(&chunk[..got]);
    }
}

/// The body of a complete chunked stream, or `None` while it is not complete.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..line])
            .unwrap()
            .split(';')
            .next()
            .unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        b = &b[line + 2..];
        if size == 0 {
            // Trailer lines, then the empty line.
            loop {
                let line = b.windows(2).position(|w| w == b"\r\n")?;
                if line == 0 {
                    return Some(body);
                }
                b = &b[line + 2..];
            }
        }
        if b.len() < size + 2 {
            return None;
        }
        body.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[tokio::test]
async fn a_tls_pipeline_moves_to_hyper_mid_stream_and_keeps_its_order() {
    let (up, rec) = recording_upstream().await;
    let (gw, _d) = tls_gateway(up, true).await;
    let mut s = common::tls::connect(gw.addr, &[b"http/1.1"]).await;
    s.write_all(pipeline().as_bytes()).await.unwrap();
    let answers = read_answers(&mut s, 3).await;
    let got: Vec<(u16, &[u8])> = answers.iter().map(|(c, _, b)| (*c, &b[..])).collect();
    assert_eq!(
        got,
        vec![(200, &b"hello"[..]), (200, b"payload"), (200, b"hello")]
    );
    // The first on the lane, the rest on hyper's path after the hand-off.
    assert!(answers[0].1.contains("\r\nX-Up: 1\r\n"), "{}", answers[0].1);
    assert!(answers[2].1.contains("\r\nx-up: 1\r\n"), "{}", answers[2].1);
    assert_eq!(rec.heads.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn an_idle_tls_connection_on_the_lane_is_closed_with_close_notify() {
    let (up, _rec) = recording_upstream().await;
    let (gw, _d) = gateway_with(up, true, |cfg| {
        with_tls(cfg);
        cfg.limits.idle_timeout = std::time::Duration::from_millis(300);
    })
    .await;
    let mut s = common::tls::connect(gw.addr, &[b"http/1.1"]).await;
    s.write_all(raw_get("/v1/fixed").as_bytes()).await.unwrap();
    let a = read_answers(&mut s, 1).await.remove(0);
    assert!(a.1.contains("\r\nX-Up: 1\r\n"), "not the lane's answer: {}", a.1);
    // Idle past the timeout: a clean end of the stream (rustls reports a close without
    // close_notify as an error).
    let mut rest = Vec::new();
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut rest))
        .await
        .expect("the gateway closes the idle connection");
    assert!(end.is_ok(), "{end:?}");
    assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
}
