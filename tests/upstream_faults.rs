//! A broken upstream against real gateway processes, on both of the gateway's paths (the
//! express lane, and hyper's with `--no-express`) and for HTTP/1.1 and HTTP/2 clients: a
//! response nobody asked for, connections the upstream closes while idle, a response framed two
//! ways, a length on a 204, statuses and line ends that can't be forwarded, an upstream that
//! can't be reached. Every client must get its own answer, and the next request on the same
//! client connection must be clean. Then one corpus of upstream answers through both paths:
//! the same status, headers and body.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Tollgate, raw};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long the fault upstream keeps an idle connection before it closes it.
const UPSTREAM_IDLE_CLOSE: Duration = Duration::from_millis(300);

struct FaultUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
}

/// An upstream that answers by path with hand-written bytes. Unknown paths answer with the
/// request target and the `x-client` header, so every client can tell its own answer.
async fn fault_upstream() -> FaultUpstream {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let c = connections.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(s));
        }
    });
    FaultUpstream { addr, connections }
}

async fn serve(mut s: TcpStream) {
    let mut buf = Vec::new();
    loop {
        let head = loop {
            if let Some(head) = raw::take_head(&mut buf) {
                break String::from_utf8_lossy(&head).to_string();
            }
            let mut chunk = [0u8; 4096];
            // Like many servers, close a connection idle for a while.
            match tokio::time::timeout(UPSTREAM_IDLE_CLOSE, s.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        };
        let target = head.split(' ').nth(1).unwrap_or("").to_string();
        let client = head
            .lines()
            .find_map(|l| {
                l.strip_prefix("x-client: ")
                    .or_else(|| l.strip_prefix("X-Client: "))
            })
            .unwrap_or("-")
            .to_string();
        let path = target.split('?').next().unwrap_or("").to_string();
        let answer: Vec<u8> = match path.as_str() {
            "/f/stray" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello").await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                // A second response that nobody asked for.
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Stray: 1\r\n\r\nSTRAY".to_vec()
            }
            "/f/clte" => b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
                5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
            "/f/204cl" => b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nX-Up: 1\r\n\r\n".to_vec(),
            "/f/304cl" => b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\nETag: \"a\"\r\n\r\n".to_vec(),
            "/f/status600" => b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/f/status099" => b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/f/barelf" => b"HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/f/silent" => return,
            "/f/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Up: 1\r\n\r\n\
                5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
                .to_vec(),
            "/f/fixed" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Up: 1\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n\r\nhello".to_vec(),
            "/f/hints" => b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n\
                HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                .to_vec(),
            "/f/close-delimited" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nX-Up: 1\r\n\r\nuntil the end").await;
                return;
            }
            "/f/http10" => {
                let _ = s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\nold!").await;
                return;
            }
            "/f/dup-length" => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/f/bad-length" => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok".to_vec(),
            "/f/gzip-te" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx".to_vec(),
            "/f/cut" => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf").await;
                return;
            }
            _ => {
                let body = format!("{target} {client}");
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
            }
        };
        if s.write_all(&answer).await.is_err() {
            return;
        }
    }
}

/// A port nothing listens on.
fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn rules(up: SocketAddr) -> String {
    format!(
        r#"{{
  "version": 1,
  "upstreams": {{
    "faulty": {{ "url": "http://{up}", "timeout_ms": 2000 }},
    "dead": {{ "url": "http://127.0.0.1:{dead}", "timeout_ms": 2000 }}
  }},
  "limits": {{
    "once": {{ "dimension": "ip", "rate": "1/60s", "burst": 1 }}
  }},
  "routes": [
    {{ "name": "f", "method": "*", "path": "/f/", "upstream": "faulty", "key": "optional" }},
    {{ "name": "once", "method": "POST", "path": "/once/", "upstream": "faulty", "key": "optional", "cost": {{ "once": 1 }} }},
    {{ "name": "dead", "method": "POST", "path": "/dead/", "upstream": "dead", "key": "optional", "cost": {{ "once": 1 }} }}
  ]
}}"#,
        dead = dead_port()
    )
}

struct Gw {
    proc: Tollgate,
    _rules: tempfile::TempDir,
}

fn gateway(up: SocketAddr, express: bool) -> Gw {
    let (dir, path) = common::rules_file(&rules(up));
    let mut args = vec!["serve", "--rules", path.to_str().unwrap()];
    if !express {
        args.push("--no-express");
    }
    Gw {
        proc: Tollgate::spawn(&args),
        _rules: dir,
    }
}

/// One answer as a client sees it.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
}

/// A client connection, HTTP/1.1 or HTTP/2 (prior knowledge), that sends requests one after
/// another on the same connection.
enum Client {
    H1(http1::SendRequest<Empty<Bytes>>),
    H2(http2::SendRequest<Empty<Bytes>>),
}

impl Client {
    async fn connect(addr: SocketAddr, h2: bool) -> Client {
        let tcp = TcpStream::connect(addr).await.unwrap();
        if h2 {
            let (tx, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
            tokio::spawn(conn);
            Client::H2(tx)
        } else {
            let (tx, conn) = http1::handshake(TokioIo::new(tcp)).await.unwrap();
            tokio::spawn(conn);
            Client::H1(tx)
        }
    }

    async fn send(&mut self, method: Method, path: &str, who: &str) -> Seen {
        let mut req = Request::builder()
            .method(method)
            .header("x-client", who)
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = match self {
            Client::H1(tx) => {
                *req.uri_mut() = path.parse().unwrap();
                req.headers_mut().insert("host", "tollgate.test".parse().unwrap());
                tx.ready().await.expect("client connection alive");
                tx.send_request(req).await
            }
            Client::H2(tx) => {
                *req.uri_mut() = format!("http://tollgate.test{path}").parse().unwrap();
                tx.ready().await.expect("client connection alive");
                tx.send_request(req).await
            }
        }
        .unwrap_or_else(|e| panic!("{path}: {e}"));
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        Seen {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

const MODES: [(bool, bool); 3] = [(true, false), (false, false), (false, true)];

fn mode_name(express: bool, h2: bool) -> &'static str {
    match (express, h2) {
        (true, false) => "express lane, HTTP/1.1",
        (false, false) => "--no-express, HTTP/1.1",
        (true, true) => "express lane port, HTTP/2",
        (false, true) => "--no-express, HTTP/2",
    }
}

#[tokio::test]
async fn a_response_nobody_asked_for_never_reaches_the_next_client() {
    for (express, h2) in MODES.into_iter().chain([(true, true)]) {
        let up = fault_upstream().await;
        let gw = gateway(up.addr, express);
        let mode = mode_name(express, h2);
        let mut first = Client::connect(gw.proc.addr, h2).await;
        let a = first.send(Method::GET, "/f/stray", "a").await;
        assert_eq!((a.status, a.text().as_str()), (StatusCode::OK, "hello"), "{mode}");
        // The stray response arrives while the upstream connection sits idle.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for who in ["b", "c", "d"] {
            let mut c = Client::connect(gw.proc.addr, h2).await;
            for n in 0..2 {
                let path = format!("/f/echo-{who}-{n}");
                let got = c.send(Method::GET, &path, who).await;
                assert_eq!(got.status, StatusCode::OK, "{mode}: {path}");
                assert_eq!(
                    got.text(),
                    format!("{path} {who}"),
                    "{mode}: {who} got another's answer"
                );
                assert!(got.headers.get("x-stray").is_none(), "{mode}");
            }
        }
        let again = first.send(Method::GET, "/f/echo-a", "a").await;
        assert_eq!(
            again.text(),
            "/f/echo-a a",
            "{mode}: the first client's next request"
        );
    }
}

#[tokio::test]
async fn connections_the_upstream_closed_while_idle_are_not_used() {
    for (express, h2) in MODES {
        let up = fault_upstream().await;
        let gw = gateway(up.addr, express);
        let mode = mode_name(express, h2);
        let mut c = Client::connect(gw.proc.addr, h2).await;
        for round in 0..3 {
            let got = c.send(Method::GET, &format!("/f/warm-{round}"), "w").await;
            assert_eq!(got.status, StatusCode::OK, "{mode}");
            // Longer than the upstream keeps an idle connection, shorter than the gateway's
            // default idle timeout (4 s): only the check before reuse can save the next one.
            tokio::time::sleep(UPSTREAM_IDLE_CLOSE * 2).await;
            // Not idempotent, no body: it can't be sent twice, so it must go out on a clean
            // connection the first time.
            let post = c
                .send(Method::POST, &format!("/once/{round}-{}", mode.len()), "p")
                .await;
            if round == 0 {
                assert_eq!(post.status, StatusCode::OK, "{mode}: {}", post.text());
            } else {
                assert_eq!(
                    post.status,
                    StatusCode::TOO_MANY_REQUESTS,
                    "{mode}: the limit still holds"
                );
            }
        }
        assert!(
            up.connections.load(Ordering::SeqCst) >= 3,
            "{mode}: new connections were made"
        );
    }
}

#[tokio::test]
async fn framing_faults_get_one_answer_and_leave_the_client_connection_clean() {
    for (express, h2) in MODES.into_iter().chain([(true, true)]) {
        let up = fault_upstream().await;
        let gw = gateway(up.addr, express);
        let mode = mode_name(express, h2);
        let mut c = Client::connect(gw.proc.addr, h2).await;

        let clte = c.send(Method::GET, "/f/clte", "x").await;
        assert_eq!(
            (clte.status, clte.text().as_str()),
            (StatusCode::OK, "hello"),
            "{mode}"
        );
        assert!(
            clte.headers.get("content-length").is_none() || h2,
            "{mode}: CL+TE keeps no length: {:?}",
            clte.headers
        );

        let empty = c.send(Method::GET, "/f/204cl", "x").await;
        assert_eq!(empty.status, StatusCode::NO_CONTENT, "{mode}");
        assert!(
            empty.headers.get("content-length").is_none(),
            "{mode}: a 204 has no length"
        );
        assert_eq!(
            empty.headers.get("x-up").map(|v| v.as_bytes()),
            Some(&b"1"[..]),
            "{mode}"
        );
        let not_modified = c.send(Method::GET, "/f/304cl", "x").await;
        assert_eq!(not_modified.status, StatusCode::NOT_MODIFIED, "{mode}");
        assert!(
            not_modified.headers.get("content-length").is_none(),
            "{mode}: a 304 has no length here"
        );
        assert!(not_modified.body.is_empty(), "{mode}");

        for bad in [
            "/f/status600",
            "/f/status099",
            "/f/barelf",
            "/f/bad-length",
            "/f/gzip-te",
        ] {
            let got = c.send(Method::GET, bad, "x").await;
            assert_eq!(
                got.status,
                StatusCode::BAD_GATEWAY,
                "{mode}: {bad}: {}",
                got.text()
            );
            let body: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
            assert_eq!(
                body["message"], "upstream \"faulty\" sent a response the gateway can't forward",
                "{mode}: {bad}"
            );
        }
        let silent = c.send(Method::GET, "/f/silent", "x").await;
        assert_eq!(silent.status, StatusCode::BAD_GATEWAY, "{mode}");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&silent.body).unwrap()["message"],
            "upstream \"faulty\" closed the connection before answering",
            "{mode}"
        );
        let mine = c.send(Method::GET, "/f/after-faults", "x").await;
        assert_eq!(
            mine.text(),
            "/f/after-faults x",
            "{mode}: the next request on the same connection"
        );
    }
}

#[tokio::test]
async fn an_unreachable_upstream_is_named_and_the_request_is_not_charged() {
    for (express, h2) in MODES {
        let up = fault_upstream().await;
        let gw = gateway(up.addr, express);
        let mode = mode_name(express, h2);
        let mut c = Client::connect(gw.proc.addr, h2).await;
        // `once` holds one token a minute: were undelivered requests charged, the second
        // would be refused with 429.
        for attempt in 0..3 {
            let got = c.send(Method::POST, "/dead/x", "x").await;
            assert_eq!(got.status, StatusCode::BAD_GATEWAY, "{mode}: attempt {attempt}");
            let text = got.text();
            assert!(
                text.contains("upstream \\\"dead\\\" could not be reached"),
                "{mode}: {text}"
            );
            assert!(
                !text.contains("127.0.0.1") && !text.to_lowercase().contains("refused"),
                "{mode}: {text}"
            );
        }
        let delivered = c.send(Method::POST, "/once/x", "x").await;
        assert_eq!(
            delivered.status,
            StatusCode::OK,
            "{mode}: the token was given back"
        );
    }
}

/// What both paths must agree on: status, headers less the per-request ones, and body.
fn comparable(s: &Seen) -> (u16, Vec<(String, String)>, Bytes) {
    let mut h: Vec<(String, String)> = s
        .headers
        .iter()
        .filter(|(n, _)| !matches!(n.as_str(), "date" | "x-request-id"))
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).to_string(),
            )
        })
        .collect();
    h.sort();
    (s.status.as_u16(), h, s.body.clone())
}

#[tokio::test]
async fn both_paths_answer_a_corpus_of_upstream_answers_alike() {
    let corpus = [
        "/f/fixed",
        "/f/chunked",
        "/f/hints",
        "/f/clte",
        "/f/204cl",
        "/f/304cl",
        "/f/status600",
        "/f/barelf",
        "/f/dup-length",
        "/f/bad-length",
        "/f/gzip-te",
        "/f/silent",
        "/f/close-delimited",
        "/f/http10",
        "/f/echo?q=1",
    ];
    let up = fault_upstream().await;
    let lane = gateway(up.addr, true);
    let general = gateway(up.addr, false);
    for method in [Method::GET, Method::HEAD, Method::DELETE] {
        for path in corpus {
            // A new client connection each time: a close-delimited answer ends its connection.
            let a = Client::connect(lane.proc.addr, false)
                .await
                .send(method.clone(), path, "d")
                .await;
            let b = Client::connect(general.proc.addr, false)
                .await
                .send(method.clone(), path, "d")
                .await;
            assert_eq!(
                comparable(&a),
                comparable(&b),
                "{method} {path}: the lane and hyper's path differ"
            );
        }
    }
}
