//! A keep-alive client whose request is refused before its body arrived: the connection carries
//! its next request, or the refusal says `Connection: close` before the gateway closes it.
//! Every case runs against a gateway with the express lane and one without (`--no-express`),
//! which must answer alike.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::Tollgate;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The bound on reading a refused body: the gateways' `--header-timeout`.
const BOUND: Duration = Duration::from_secs(1);

/// A key-required route (401 without one), a limit of one request an hour per `X-Case` value
/// (its second request is 429), a route whose upstream is down (502) and an open one.
fn rules(up: SocketAddr, dead: u16) -> String {
    serde_json::json!({
        "version": 1,
        "upstreams": {
            "up": {"url": format!("http://{up}")},
            "dead": {"url": format!("http://127.0.0.1:{dead}")}
        },
        "limits": {
            "once": {"dimension": {"header": "X-Case"}, "rate": "1/3600s", "burst": 1,
                     "class": "security", "on_store_failure": "local"},
            "loose": {"dimension": "ip", "rate": "1000/1s", "burst": 1000}
        },
        "keys": [],
        "routes": [
            {"name": "locked", "method": "POST", "path": "/locked", "upstream": "up", "cost": {"loose": 1}},
            {"name": "once", "method": "POST", "path": "/once", "upstream": "up", "key": "optional",
             "cost": {"once": 1}},
            {"name": "down", "method": "POST", "path": "/down", "upstream": "dead", "key": "optional",
             "cost": {"loose": 1}},
            {"name": "open", "method": "POST", "path": "/open", "upstream": "up", "key": "optional",
             "cost": {"loose": 1}}
        ]
    })
    .to_string()
}

/// Two gateway processes on the same rules: the express lane's, and hyper's alone.
struct Gateways {
    express: Tollgate,
    general: Tollgate,
    _rules: tempfile::TempDir,
    _dead: tokio::net::TcpSocket,
}

async fn gateways() -> Gateways {
    let up = common::start_demo_upstream().await;
    // Bound and never listening: connecting is refused, and no listener can take the port.
    let dead = tokio::net::TcpSocket::new_v4().unwrap();
    dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    let (dir, path) = common::rules_file(&rules(up, dead_port));
    let path = path.to_str().unwrap();
    let bound = format!("{}s", BOUND.as_secs());
    let args = ["serve", "--rules", path, "--header-timeout", &bound];
    let express = Tollgate::spawn(&args);
    let general = Tollgate::spawn(&[&args[..], &["--no-express"]].concat());
    Gateways {
        express,
        general,
        _rules: dir,
        _dead: dead,
    }
}

impl Gateways {
    /// Runs `case` on both gateways and holds them to the same transcript.
    async fn both<F, Fut>(&self, case: F) -> Vec<String>
    where
        F: Fn(SocketAddr, &'static str) -> Fut,
        Fut: std::future::Future<Output = Vec<String>>,
    {
        let express = case(self.express.addr, "express").await;
        let general = case(self.general.addr, "general").await;
        assert_eq!(
            express, general,
            "the express lane's gateway and --no-express answered differently"
        );
        express
    }
}

/// How a request's body is framed.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Length,
    Chunked,
    /// `Content-Length` with `Expect: 100-continue`: the body goes after a `100 Continue`.
    Expect,
}

/// A response as read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Answer {
    /// Whether it said `Connection: close`.
    fn closes(&self) -> bool {
        self.headers.iter().any(|(n, v)| {
            n.eq_ignore_ascii_case("connection")
                && v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close"))
        })
    }

    /// Its status and whether it announced the close, as the transcript holds it.
    fn line(&self) -> String {
        format!("{} {}", self.status, if self.closes() { "close" } else { "keep" })
    }
}

/// One client connection, read by hand.
struct Conn {
    tcp: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        let tcp = TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        Conn { tcp, buf: Vec::new() }
    }

    /// Writes `bytes`; a gateway that closed may refuse them, which the reads then show.
    async fn send(&mut self, bytes: &[u8]) {
        let _ = self.tcp.write_all(bytes).await;
    }

    /// Reads more bytes; `false` at the end of the stream (or a reset).
    async fn fill(&mut self) -> bool {
        let mut chunk = [0u8; 8192];
        match tokio::time::timeout(Duration::from_secs(10), self.tcp.read(&mut chunk)).await {
            Err(_) => panic!("no answer within 10 s"),
            Ok(Ok(0) | Err(_)) => false,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// The next response, its body (by `Content-Length` or chunked) read and dropped; `None`
    /// when the connection ended first.
    async fn answer(&mut self) -> Option<Answer> {
        let (status, headers, head_len) = loop {
            let mut h = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut h);
            if let httparse::Status::Complete(len) = resp.parse(&self.buf).expect("a response head") {
                let headers = resp
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect::<Vec<_>>();
                break (resp.code.unwrap(), headers, len);
            }
            if !self.fill().await {
                return None;
            }
        };
        self.buf.drain(..head_len);
        let a = Answer { status, headers };
        if status < 200 {
            return Some(a);
        }
        let length = a
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse::<usize>().unwrap());
        match length {
            Some(n) => {
                while self.buf.len() < n {
                    assert!(self.fill().await, "the connection ended inside a body");
                }
                self.buf.drain(..n);
            }
            None => self.chunked_body().await,
        }
        Some(a)
    }

    async fn chunked_body(&mut self) {
        loop {
            let line = loop {
                if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                assert!(self.fill().await, "the connection ended inside a body");
            };
            let size = std::str::from_utf8(&self.buf[..line]).unwrap();
            let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
            let whole = line + 2 + size + 2;
            while self.buf.len() < whole {
                assert!(self.fill().await, "the connection ended inside a body");
            }
            self.buf.drain(..whole);
            if size == 0 {
                return;
            }
        }
    }

    /// Whether the gateway closes the connection, with nothing more sent, within 3 s.
    async fn closed(&mut self) -> bool {
        let mut chunk = [0u8; 1024];
        match tokio::time::timeout(Duration::from_secs(3), self.tcp.read(&mut chunk)).await {
            Ok(Ok(0) | Err(_)) => self.buf.is_empty(),
            _ => false,
        }
    }

    /// A POST of `body` shaped `shape`: the head, then after a pause (or the `100 Continue`
    /// it asked for) the body; the final answer, with `100` before it when one came.
    async fn post(&mut self, path: &str, extra: &str, body: &[u8], shape: Shape) -> String {
        let framing = match shape {
            Shape::Length => format!("Content-Length: {}\r\n", body.len()),
            Shape::Chunked => "Transfer-Encoding: chunked\r\n".to_string(),
            Shape::Expect => format!("Content-Length: {}\r\nExpect: 100-continue\r\n", body.len()),
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{extra}{framing}\r\n"
        );
        self.send(head.as_bytes()).await;
        let mut interim = "";
        if let Shape::Expect = shape {
            match self.answer().await {
                Some(a) if a.status == 100 => interim = "100 ",
                // Answered without asking for the body: a client sends none.
                Some(a) => return a.line(),
                None => return "closed".into(),
            }
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match shape {
            Shape::Chunked => {
                let (a, b) = body.split_at(body.len() / 2);
                for part in [a, b] {
                    self.send(format!("{:x}\r\n", part.len()).as_bytes()).await;
                    self.send(part).await;
                    self.send(b"\r\n").await;
                }
                self.send(b"0\r\n\r\n").await;
            }
            _ => self.send(body).await,
        }
        match self.answer().await {
            Some(a) => format!("{interim}{}", a.line()),
            None => "closed".into(),
        }
    }
}

/// On one connection: 401, 404, an admitted request and then 429 on its limit, 502 from an
/// upstream that is down, each with its body sent after its head; then a request that succeeds.
async fn refusals_on_one_connection(addr: SocketAddr, gw: &'static str, shape: Shape) -> Vec<String> {
    let body = br#"{"order": 1, "note": "sent a moment after its head"}"#;
    let case = format!("X-Case: {gw}-{shape:?}\r\n");
    let mut c = Conn::open(addr).await;
    vec![
        c.post("/locked", "", body, shape).await,
        c.post("/nowhere", "", body, shape).await,
        c.post("/once", &case, body, shape).await,
        c.post("/once", &case, body, shape).await,
        c.post("/down", "", body, shape).await,
        c.post("/open", "", body, shape).await,
    ]
}

fn expected(interim: &str) -> Vec<String> {
    [
        "401 keep", "404 keep", "200 keep", "429 keep", "502 keep", "200 keep",
    ]
    .iter()
    .map(|s| format!("{interim}{s}"))
    .collect()
}

#[tokio::test]
async fn refused_bodies_with_a_length_are_read_and_the_connection_kept() {
    let g = gateways().await;
    let seen = g
        .both(|a, gw| refusals_on_one_connection(a, gw, Shape::Length))
        .await;
    assert_eq!(seen, expected(""));
}

#[tokio::test]
async fn refused_chunked_bodies_are_read_and_the_connection_kept() {
    let g = gateways().await;
    let seen = g
        .both(|a, gw| refusals_on_one_connection(a, gw, Shape::Chunked))
        .await;
    assert_eq!(seen, expected(""));
}

/// Reading a small declared body is what makes hyper send `100 Continue`: the client sends it,
/// and the connection carries the next request.
#[tokio::test]
async fn refused_bodies_after_expect_continue_are_read_and_the_connection_kept() {
    let g = gateways().await;
    let seen = g
        .both(|a, gw| refusals_on_one_connection(a, gw, Shape::Expect))
        .await;
    assert_eq!(seen, expected("100 "));
}

/// A refusal with `Connection: close`, and then the close, on a connection whose first request
/// is `head` followed by `rest` after a pause (nothing when the refusal must come at once).
async fn refused_and_closed(addr: SocketAddr, head: &str, rest: &[u8]) -> Vec<String> {
    let mut c = Conn::open(addr).await;
    c.send(head.as_bytes()).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    c.send(rest).await;
    let answer = match c.answer().await {
        Some(a) => a.line(),
        None => "closed".into(),
    };
    vec![answer, format!("closed after: {}", c.closed().await)]
}

const LARGE: usize = 100 * 1024;

/// Over 64 KiB declared: not read at all, answered at once (no `100 Continue`) and closed.
#[tokio::test]
async fn a_large_declared_body_is_refused_with_connection_close() {
    let g = gateways().await;
    let expect = ["401 close", "closed after: true"];
    for extra in ["", "Expect: 100-continue\r\n"] {
        let head = format!("POST /locked HTTP/1.1\r\nHost: gw\r\nContent-Length: {LARGE}\r\n{extra}\r\n");
        let seen = g.both(|a, _| refused_and_closed(a, &head, b"")).await;
        assert_eq!(seen, expect, "{extra:?}");
    }
}

/// A chunked body that runs past 64 KiB: read that far, then refused and closed.
#[tokio::test]
async fn a_chunked_body_past_64_kib_is_refused_with_connection_close() {
    let g = gateways().await;
    let head = "POST /locked HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut body = Vec::new();
    for _ in 0..LARGE / 4096 {
        body.extend_from_slice(b"1000\r\n");
        body.extend_from_slice(&[b'x'; 4096]);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    let seen = g.both(|a, _| refused_and_closed(a, head, &body)).await;
    assert_eq!(seen, ["401 close", "closed after: true"]);
}

/// A body that stops arriving: given up on after the bound, refused and closed.
#[tokio::test]
async fn a_stalled_body_is_refused_with_connection_close() {
    let g = gateways().await;
    let head = "POST /locked HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n";
    let started = std::time::Instant::now();
    let seen = g.both(|a, _| refused_and_closed(a, head, b"{\"order\":")).await;
    assert_eq!(seen, ["401 close", "closed after: true"]);
    // Waited out on each gateway, and no longer than the bound and some slack.
    let took = started.elapsed();
    assert!(took >= 2 * BOUND, "answered after {took:?}, before the bound");
    assert!(
        took < 2 * BOUND + Duration::from_secs(4),
        "answered after {took:?}"
    );
}

/// What the partners run: Python's `http.client` on one kept connection, its bodies streamed
/// (chunked, each after its head); a refusal must not leave the next request a broken pipe.
#[tokio::test]
async fn python_http_client_keeps_its_connection_through_refusals() {
    let g = gateways().await;
    let script = r#"
import http.client, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=10)
def body():
    time.sleep(0.02)
    yield b'{"order": 1}'
seen = []
for path, headers in [("/locked", {}), ("/nowhere", {}), ("/once", {"X-Case": "py-" + sys.argv[3]}),
                      ("/once", {"X-Case": "py-" + sys.argv[3]}), ("/open", {})]:
    conn.request("POST", path, body=body(), headers=headers)
    r = conn.getresponse()
    r.read()
    seen.append(str(r.status))
print(" ".join(seen))
"#;
    let run = |addr: SocketAddr, gw: &'static str| {
        let script = script.to_string();
        async move {
            let out = tokio::process::Command::new("python3")
                .args([
                    "-c",
                    &script,
                    &addr.ip().to_string(),
                    &addr.port().to_string(),
                    gw,
                ])
                .output()
                .await
                .expect("python3 runs");
            vec![
                String::from_utf8_lossy(&out.stdout).trim().to_string(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
                    .to_string(),
            ]
        }
    };
    let seen = g.both(run).await;
    assert_eq!(seen, ["401 404 200 429 200", ""]);
}
