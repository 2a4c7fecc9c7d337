//! What an upstream is handed when the client is hostile, on both HTTP/1 paths: the express
//! lane and hyper's (`--no-express`). Every case runs on two gateway processes in front of one
//! echo upstream that keeps the raw bytes of each head it receives; both must give the client
//! the same status and hand the upstream the same head, byte for byte but for the value of a
//! request id the gateway made up. Raw TCP clients, so duplicate headers and raw bytes reach
//! the gateway as written.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Tollgate;
use common::raw::{read_body, read_head};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// An upstream that keeps every request head it receives as raw bytes and answers `200 ok`.
#[derive(Clone, Default)]
struct Echo {
    heads: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Echo {
    async fn start() -> (Echo, SocketAddr) {
        let echo = Echo::default();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let me = echo.clone();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else { return };
                tokio::spawn(me.clone().serve(s));
            }
        });
        (echo, addr)
    }

    async fn serve(self, mut s: TcpStream) {
        let mut buf = Vec::new();
        loop {
            let Some((head, len)) = read_head(&mut s, &mut buf).await else {
                return;
            };
            if !read_body(&mut s, &mut buf, len).await {
                return;
            }
            buf.drain(..len);
            self.heads.lock().unwrap().push(head);
            if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                .await
                .is_err()
            {
                return;
            }
        }
    }

    fn count(&self) -> usize {
        self.heads.lock().unwrap().len()
    }
}

/// A head's lines, bytes over 0x7F shown as `\xNN` so they can't hide in a lossy conversion.
fn lines(head: &[u8]) -> Vec<String> {
    let text: String = head
        .iter()
        .map(|&b| {
            if b < 0x80 {
                (b as char).to_string()
            } else {
                format!("\\x{b:02X}")
            }
        })
        .collect();
    text.split("\r\n")
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The values of a header in a head's lines, in order.
fn values(lines: &[String], name: &str) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
        .collect()
}

/// What one request came to on one gateway.
#[derive(Debug)]
struct Outcome {
    status: u16,
    /// The answer's head lines.
    answer: Vec<String>,
    /// The answer's body when it had a length (the gateway's own answers do).
    body: String,
    /// The head the upstream received, if it received one.
    forwarded: Option<Vec<String>>,
}

impl Outcome {
    fn forwarded(&self) -> &[String] {
        self.forwarded
            .as_deref()
            .unwrap_or_else(|| panic!("nothing reached the upstream: {self:?}"))
    }

    fn request_line(&self) -> &str {
        &self.forwarded()[0]
    }

    fn header(&self, name: &str) -> Vec<String> {
        values(self.forwarded(), name)
    }

    fn answered_id(&self) -> Vec<String> {
        values(&self.answer, "x-request-id")
    }

    fn json(&self) -> serde_json::Value {
        let v: serde_json::Value =
            serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not a JSON body ({e}): {self:?}"));
        assert!(v["error"].is_string(), "no error field: {self:?}");
        v
    }
}

/// Sends raw bytes on a fresh connection and reads one answer.
async fn send(addr: SocketAddr, up: &Echo, request: &[u8]) -> Outcome {
    let before = up.count();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    let (head, len) = tokio::time::timeout(Duration::from_secs(10), async {
        let (head, len) = read_head(&mut s, &mut buf).await?;
        read_body(&mut s, &mut buf, len).await;
        Some((head, len))
    })
    .await
    .expect("an answer within 10 s")
    .unwrap_or_else(|| panic!("no answer to {:?}", lines(request)));
    let answer = lines(&head);
    let status = answer[0]
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    let heads = up.heads.lock().unwrap();
    assert!(
        heads.len() <= before + 1,
        "one request reached the upstream twice"
    );
    Outcome {
        status,
        answer,
        body: String::from_utf8_lossy(&buf[..len.min(buf.len())]).into_owned(),
        forwarded: heads.get(before).map(|h| lines(h)),
    }
}

/// A request id the gateway made up: 32 hex digits.
fn made_up(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The forwarded head with a made-up request id's value masked: it differs between gateways.
fn masked(forwarded: &Option<Vec<String>>) -> Option<Vec<String>> {
    forwarded.as_ref().map(|ls| {
        ls.iter()
            .map(|l| match l.split_once(':') {
                Some((n, v)) if n.eq_ignore_ascii_case("x-request-id") && made_up(v.trim()) => {
                    format!("{n}: <made up>")
                }
                _ => l.clone(),
            })
            .collect()
    })
}

/// The same rules on two gateways, the express lane's and hyper's, before one echo upstream.
struct Pair {
    up: Echo,
    lane: Tollgate,
    hyper: Tollgate,
    _dir: tempfile::TempDir,
}

impl Pair {
    async fn start(rules: impl Fn(SocketAddr) -> String, extra: &[&str]) -> Pair {
        let (up, addr) = Echo::start().await;
        let (dir, path) = common::rules_file(&rules(addr));
        let mut args = vec!["serve", "--rules", path.to_str().unwrap()];
        args.extend_from_slice(extra);
        let lane = Tollgate::spawn(&args);
        args.push("--no-express");
        let hyper = Tollgate::spawn(&args);
        Pair {
            up,
            lane,
            hyper,
            _dir: dir,
        }
    }

    /// Sends `request` to both gateways and checks they agree; returns the lane's outcome.
    async fn both(&self, request: &[u8]) -> Outcome {
        let lane = send(self.lane.addr, &self.up, request).await;
        let hyper = send(self.hyper.addr, &self.up, request).await;
        // The request line and the header names: a value may be 10 KB.
        let what: Vec<String> = lines(request)
            .iter()
            .map(|l| l.split(':').next().unwrap_or("").to_string())
            .collect();
        assert_eq!(
            lane.status, hyper.status,
            "{what:?}: lane {lane:?}, hyper {hyper:?}"
        );
        assert_eq!(
            masked(&lane.forwarded),
            masked(&hyper.forwarded),
            "{what:?}: the upstream's heads differ"
        );
        if lane.status != 200 {
            assert_eq!(lane.body, hyper.body, "{what:?}");
        }
        for o in [&lane, &hyper] {
            if let Some(f) = &o.forwarded {
                // The one id the upstream got is the one the client was answered with.
                assert_eq!(values(f, "x-request-id"), o.answered_id(), "{what:?}: {o:?}");
            }
        }
        lane
    }
}

const KEYLESS: &str = r#""key": "optional""#;

/// Routes for everything but method overrides: the old gateway can load these too.
fn rules(up: SocketAddr) -> String {
    format!(
        r#"{{"version": 1,
            "upstreams": {{"echo": {{"url": "http://{up}"}}}},
            "limits": {{"cafe": {{"dimension": "ip", "rate": "1/3600s", "burst": 2}}}},
            "routes": [
              {{"method": "GET", "path": "/v1/orders", "upstream": "echo", {KEYLESS}}},
              {{"method": "POST", "path": "/v1/orders", "upstream": "echo", {KEYLESS}}},
              {{"method": "DELETE", "path": "/v1/orders", "upstream": "echo", {KEYLESS}}},
              {{"name": "cafe", "method": "GET", "path": "/caf%C3%A9", "upstream": "echo",
                "cost": {{"cafe": 1}}, {KEYLESS}}},
              {{"method": "GET", "path": "/other/", "upstream": "echo", {KEYLESS}}}
            ]}}"#
    )
}

fn get(target: &str, extra: &str) -> Vec<u8> {
    format!("GET {target} HTTP/1.1\r\nHost: gw.example\r\n{extra}\r\n").into_bytes()
}

/// A POST without a body, which the lane takes.
fn post(target: &str, extra: &str) -> Vec<u8> {
    format!("POST {target} HTTP/1.1\r\nHost: gw.example\r\nContent-Length: 0\r\n{extra}\r\n").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_one_request_id_reaches_the_upstream() {
    let p = Pair::start(rules, &[]).await;
    let mut hostile = b"X-Request-Id: <script>".to_vec();
    hostile.extend(std::iter::repeat_n(b'a', 10 * 1024));
    hostile.extend_from_slice(b"\xC3\xA9\xFF\r\n");
    let mut two = b"GET /v1/orders HTTP/1.1\r\nHost: gw.example\r\nX-Request-Id: client-1\r\n".to_vec();
    two.extend_from_slice(&hostile);
    two.extend_from_slice(b"\r\n");
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        (
            "one valid id",
            get("/v1/orders", "X-Request-Id: client-1\r\n"),
            Some("client-1"),
        ),
        ("two ids, the second hostile", two, None),
        (
            "two valid ids",
            get(
                "/v1/orders",
                "X-Request-Id: client-1\r\nX-Request-Id: client-2\r\n",
            ),
            None,
        ),
        (
            "two ids in one line",
            get("/v1/orders", "X-Request-Id: client-1, client-2\r\n"),
            None,
        ),
        ("one invalid id", get("/v1/orders", "X-Request-Id: a<b\r\n"), None),
        ("an empty id", get("/v1/orders", "X-Request-Id:\r\n"), None),
        ("no id", get("/v1/orders", ""), None),
    ];
    for (what, request, kept) in cases {
        let o = p.both(&request).await;
        assert_eq!(o.status, 200, "{what}: {o:?}");
        let ids = o.header("x-request-id");
        assert_eq!(ids.len(), 1, "{what}: the upstream got {ids:?}");
        match kept {
            Some(id) => assert_eq!(ids[0], id, "{what}"),
            None => assert!(made_up(&ids[0]), "{what}: the upstream got {:?}", ids[0]),
        }
        assert_eq!(o.answered_id(), ids, "{what}: the client's answer");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_and_x_real_ip_from_an_untrusted_client_are_dropped() {
    let p = Pair::start(rules, &[]).await;
    let o = p
        .both(&get(
            "/v1/orders",
            "Forwarded: for=203.0.113.7;proto=https\r\nforwarded: for=198.51.100.1\r\n\
             X-Real-IP: 203.0.113.7\r\nX-Forwarded-For: 203.0.113.7\r\n",
        ))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.header("forwarded"), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.header("x-real-ip"), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.header("x-forwarded-for"), ["127.0.0.1"], "{o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxys_forwarded_and_x_real_ip_go_on_like_x_forwarded_for() {
    let p = Pair::start(rules, &["--trusted-proxy", "127.0.0.1"]).await;
    let o = p
        .both(&get(
            "/v1/orders",
            "Forwarded: for=203.0.113.7;proto=https\r\nForwarded: for=198.51.100.1\r\n\
             X-Real-IP: 203.0.113.7\r\n\
             X-Forwarded-For: 203.0.113.7\r\nX-Forwarded-For: 198.51.100.1\r\n",
        ))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    // Each proxy appends the address it was reached from: here the trusted proxy's.
    assert_eq!(
        o.header("forwarded"),
        ["for=203.0.113.7;proto=https, for=198.51.100.1, for=127.0.0.1"],
        "{o:?}"
    );
    assert_eq!(
        o.header("x-forwarded-for"),
        ["203.0.113.7, 198.51.100.1, 127.0.0.1"],
        "{o:?}"
    );
    assert_eq!(o.header("x-real-ip"), ["203.0.113.7"], "{o:?}");
    // Without them from the proxy, none is made up.
    let o = p.both(&get("/v1/orders", "")).await;
    assert_eq!(o.header("forwarded"), Vec::<String>::new(), "{o:?}");
    assert_eq!(o.header("x-real-ip"), Vec::<String>::new(), "{o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_utf8_path_is_the_percent_encoded_one() {
    let p = Pair::start(rules, &[]).await;
    // The route's limit has a burst of 2: the two spellings share one bucket.
    let raw = p
        .both("GET /caf\u{e9} HTTP/1.1\r\nHost: gw.example\r\n\r\n".as_bytes())
        .await;
    assert_eq!(raw.status, 200, "{raw:?}");
    assert_eq!(raw.request_line(), "GET /caf%C3%A9 HTTP/1.1");
    let lower = p.both(&get("/caf%c3%a9", "")).await;
    assert_eq!(lower.status, 200, "{lower:?}");
    assert_eq!(lower.request_line(), "GET /caf%C3%A9 HTTP/1.1");
    let spent = p
        .both("GET /caf\u{e9} HTTP/1.1\r\nHost: gw.example\r\n\r\n".as_bytes())
        .await;
    assert_eq!(spent.status, 429, "{spent:?}");
    assert!(spent.forwarded.is_none());
    // Under a catch-all, with a query: the path is encoded, the query left as it came.
    let o = p
        .both("GET /other/\u{e9}t\u{e9}?q=\u{e9} HTTP/1.1\r\nHost: gw.example\r\n\r\n".as_bytes())
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "GET /other/%C3%A9t%C3%A9?q=\\xC3\\xA9 HTTP/1.1");
    // Bytes that are not UTF-8 are refused, on both paths, by the parser (hyper's answer to
    // a head it can't read, which has no body).
    let o = p
        .both(b"GET /other/caf\xE9 HTTP/1.1\r\nHost: gw.example\r\n\r\n")
        .await;
    assert_eq!(o.status, 400, "{o:?}");
    assert!(o.forwarded.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_target_of_another_scheme_is_refused() {
    let p = Pair::start(rules, &[]).await;
    for target in [
        "ftp://x/v1/orders",
        "gopher://gw.example/v1/orders",
        "file://gw.example/v1/orders",
    ] {
        let o = p.both(&get(target, "")).await;
        assert_eq!(o.status, 400, "{target}: {o:?}");
        o.json();
        assert!(o.forwarded.is_none(), "{target}: {o:?}");
    }
    for target in ["http://gw.example/v1/orders", "https://gw.example/v1/orders"] {
        let o = p.both(&get(target, "")).await;
        assert_eq!(o.status, 200, "{target}: {o:?}");
        assert_eq!(o.request_line(), "GET /v1/orders HTTP/1.1", "{target}");
    }
}

const OVERRIDES: [&str; 3] = ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"];

fn no_override_headers(o: &Outcome) {
    for name in OVERRIDES {
        assert_eq!(
            o.header(name),
            Vec::<String>::new(),
            "{name} reached the upstream: {o:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_override_headers_never_reach_the_upstream_by_default() {
    let p = Pair::start(rules, &[]).await;
    for name in OVERRIDES {
        for (request, line) in [
            (
                get("/v1/orders", &format!("{name}: POST\r\n")),
                "GET /v1/orders HTTP/1.1",
            ),
            (
                post("/v1/orders", &format!("{name}: DELETE\r\n")),
                "POST /v1/orders HTTP/1.1",
            ),
            (
                post("/v1/orders", &format!("{name}: NO SUCH\r\n")),
                "POST /v1/orders HTTP/1.1",
            ),
        ] {
            let o = p.both(&request).await;
            assert_eq!(o.status, 200, "{o:?}");
            assert_eq!(o.request_line(), line);
            no_override_headers(&o);
        }
    }
}

/// Routes of which some honour method overrides.
fn override_rules(up: SocketAddr) -> String {
    format!(
        r#"{{"version": 1,
            "upstreams": {{"echo": {{"url": "http://{up}"}}}},
            "limits": {{"deletes": {{"dimension": "ip", "rate": "1/3600s", "burst": 1}}}},
            "routes": [
              {{"method": "POST", "path": "/v1/items", "upstream": "echo", {KEYLESS}}},
              {{"method": "GET", "path": "/v1/items", "upstream": "echo", {KEYLESS}}},
              {{"method": "DELETE", "path": "/v1/items", "upstream": "echo", {KEYLESS},
                "method_override": true, "cost": {{"deletes": 1}}}},
              {{"method": "PUT", "path": "/v1/items", "upstream": "echo", {KEYLESS}}},
              {{"method": "*", "path": "/v2/", "upstream": "echo", {KEYLESS}, "method_override": true}},
              {{"method": "POST", "path": "/v3/items", "upstream": "echo", {KEYLESS}}}
            ]}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_opts_in_is_routed_limited_and_forwarded_as_the_override() {
    let p = Pair::start(override_rules, &[]).await;
    // A POST that asks for DELETE takes the DELETE route, pays its limit (a burst of 1) and
    // reaches the upstream as a DELETE, without the header.
    let o = p
        .both(&post("/v1/items", "X-HTTP-Method-Override: DELETE\r\n"))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "DELETE /v1/items HTTP/1.1");
    no_override_headers(&o);
    let o = p.both(&post("/v1/items", "X-Method-Override: delete\r\n")).await;
    assert_eq!(o.status, 429, "the DELETE route's limit: {o:?}");
    assert!(o.forwarded.is_none());
    // A GET never overrides: a link can't delete.
    let o = p
        .both(&get("/v1/items", "X-HTTP-Method-Override: DELETE\r\n"))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "GET /v1/items HTTP/1.1");
    no_override_headers(&o);
    // The PUT route doesn't opt in: the POST stays a POST.
    let o = p.both(&post("/v1/items", "X-HTTP-Method: PUT\r\n")).await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "POST /v1/items HTTP/1.1");
    no_override_headers(&o);
    // A catch-all that opts in forwards the method asked for.
    for (name, method) in [("X-HTTP-Method", "PATCH"), ("X-Method-Override", "PUT")] {
        let o = p
            .both(&post("/v2/things", &format!("{name}: {method}\r\n")))
            .await;
        assert_eq!(o.status, 200, "{o:?}");
        assert_eq!(o.request_line(), format!("{method} /v2/things HTTP/1.1"));
        no_override_headers(&o);
    }
    // Where no route opts in, the header is only dropped.
    let o = p
        .both(&post("/v3/items", "X-HTTP-Method-Override: DELETE\r\n"))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "POST /v3/items HTTP/1.1");
    no_override_headers(&o);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_override_on_a_route_that_opts_in_is_a_400() {
    let p = Pair::start(override_rules, &[]).await;
    for extra in [
        "X-HTTP-Method-Override: DELEET\r\n",
        "X-HTTP-Method-Override: DELETE, PUT\r\n",
        "X-HTTP-Method-Override: DELETE\r\nX-HTTP-Method: PUT\r\n",
        "X-HTTP-Method-Override: PUT\r\nX-HTTP-Method-Override: PATCH\r\n",
        "X-HTTP-Method-Override: CONNECT\r\n",
        "X-HTTP-Method-Override: HEAD\r\n",
        "X-HTTP-Method-Override:\r\n",
    ] {
        for target in ["/v1/items", "/v2/things"] {
            let o = p.both(&post(target, extra)).await;
            assert_eq!(o.status, 400, "{target} {extra:?}: {o:?}");
            o.json();
            assert!(o.forwarded.is_none(), "{target} {extra:?}: {o:?}");
        }
    }
    // The same value twice is one value.
    let o = p
        .both(&post(
            "/v2/things",
            "X-HTTP-Method-Override: PATCH\r\nX-HTTP-Method: patch\r\n",
        ))
        .await;
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.request_line(), "PATCH /v2/things HTTP/1.1");
}
