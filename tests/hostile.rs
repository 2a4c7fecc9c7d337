//! Hostile input against a real gateway process: every bad request gets a defined refusal, the
//! upstream sees none of them, slow clients are cut off, a slow upstream is shed, and no log
//! line ever holds a key.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{DEMO_KEYS, Http, K7, K8, Tollgate};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that records every request it sees and can misbehave on purpose.
#[derive(Clone, Default)]
struct Upstream {
    seen: Arc<Mutex<Vec<String>>>,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

type UpBody = http_body_util::Either<Full<Bytes>, StreamBody<tokio_stream_shim::Rx>>;

mod tokio_stream_shim {
    use bytes::Bytes;
    use hyper::body::Frame;
    pub struct Rx(pub tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, std::io::Error>>);
    impl futures_core::Stream for Rx {
        type Item = Result<Frame<Bytes>, std::io::Error>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            self.0.poll_recv(cx)
        }
    }
}

impl Upstream {
    async fn start() -> (Upstream, SocketAddr) {
        let up = Upstream::default();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let me = up.clone();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else { return };
                let me = me.clone();
                me.open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc_me = me.clone();
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let me = svc_me.clone();
                        async move { Ok::<_, std::convert::Infallible>(me.answer(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                    me.open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        (up, addr)
    }

    async fn answer(&self, req: Request<Incoming>) -> Response<UpBody> {
        let path = req.uri().path().to_string();
        self.seen
            .lock()
            .unwrap()
            .push(format!("{} {}", req.method(), req.uri()));
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes().len())
            .unwrap_or(0);
        match path.as_str() {
            "/v1/slowpool" | "/v1/slow-head" => {
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            "/v1/slow-body" => {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                tokio::spawn(async move {
                    let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"first part")))).await;
                    // Then nothing, for longer than the upstream's timeout.
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    drop(tx);
                });
                return Response::new(http_body_util::Either::Right(StreamBody::new(
                    tokio_stream_shim::Rx(rx),
                )));
            }
            _ => {}
        }
        Response::new(http_body_util::Either::Left(Full::new(Bytes::from(
            json!({"path": path, "bytes": body}).to_string(),
        ))))
    }

    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

fn rules(up: SocketAddr) -> String {
    let mut r: Value = serde_json::from_str(&common::demo_rules_for(up)).unwrap();
    r["upstreams"]["slow"] = json!({
        "url": format!("http://{up}"), "timeout_ms": 2000, "max_in_flight": 4, "queue_timeout_ms": 50
    });
    r["upstreams"]["orders"]["timeout_ms"] = json!(300);
    r["limits"]["login-body"] = json!({
        "dimension": {"body_field": "account"}, "rate": "5/60s", "burst": 5,
        "class": "security", "on_store_failure": "closed"
    });
    let routes = r["routes"].as_array_mut().unwrap();
    routes.push(
        json!({"name": "uploads", "method": "POST", "path": "/v1/uploads", "upstream": "orders",
                       "cost": {"plan": 1}, "max_body_bytes": 1024}),
    );
    routes.push(
        json!({"name": "login-json", "method": "POST", "path": "/v2/login", "upstream": "orders",
                       "key": "optional", "cost": {"login-body": 1}}),
    );
    routes.push(json!({"name": "slowpool", "method": "GET", "path": "/v1/slowpool", "upstream": "slow"}));
    r.to_string()
}

struct Setup {
    up: Upstream,
    gw: Tollgate,
    _rules: tempfile::TempDir,
}

async fn setup(extra: &[&str]) -> Setup {
    let (up, addr) = Upstream::start().await;
    let (dir, path) = common::rules_file(&rules(addr));
    let mut args = vec!["serve", "--rules", path.to_str().unwrap()];
    args.extend_from_slice(extra);
    let gw = Tollgate::spawn(&args);
    Setup { up, gw, _rules: dir }
}

impl Setup {
    /// None of the refused requests reached the upstream.
    fn assert_upstream_untouched(&self) {
        assert_eq!(
            self.up.count(),
            0,
            "the upstream saw {:?}",
            self.up.seen.lock().unwrap()
        );
    }

    /// Every test ends by checking that no log line holds a key.
    fn assert_logs_clean(&self) {
        let log = self.gw.stderr();
        for key in DEMO_KEYS {
            assert!(!log.contains(key), "a log line holds {key}:\n{log}");
        }
    }
}

/// Sends raw bytes and reads the answer until the server closes or goes quiet.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

fn json_error(body: &str) -> String {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    v["error"].as_str().unwrap_or_default().to_string()
}

#[tokio::test]
async fn smuggling_shapes_are_refused_before_the_upstream() {
    let s = setup(&[]).await;
    let a = s.gw.addr;
    let cases: [(&str, &[u8], u16, Option<&str>); 6] = [
        (
            "Content-Length and Transfer-Encoding",
            b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n",
            400,
            Some("bad_request"),
        ),
        (
            "duplicate Content-Length, same value",
            b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nContent-Length: 5\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello",
            400,
            Some("bad_request"),
        ),
        (
            "duplicate Content-Length, different values",
            b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
            400,
            None,
        ),
        (
            "Transfer-Encoding other than chunked",
            b"POST /v1/orders HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n0\r\n\r\n",
            400,
            Some("bad_request"),
        ),
        (
            "obs-fold",
            b"GET /v1/orders HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nX-Folded: a\r\n b\r\n\r\n",
            400,
            None,
        ),
        (
            "headers over 32 KiB",
            &[b"GET /v1/orders HTTP/1.1\r\nHost: x\r\nX-Big: ".as_slice(), &[b'a'; 40_000], b"\r\n\r\n"].concat(),
            431,
            None,
        ),
    ];
    for (what, bytes, status, error) in cases {
        let (got, body) = raw(a, bytes).await;
        assert_eq!(got, status, "{what}: {body}");
        // The HTTP/1 parser answers the unparseable ones itself, with an empty body; every
        // request that parses gets a JSON body.
        if let Some(e) = error {
            assert_eq!(json_error(&body), e, "{what}");
        }
    }
    s.assert_upstream_untouched();
    s.assert_logs_clean();
}

#[tokio::test]
async fn unclean_paths_and_unknown_routes() {
    let s = setup(&[]).await;
    let a = s.gw.addr;
    for (what, line, status) in [
        ("control byte", &b"GET /v1/or\x01ders HTTP/1.1"[..], 400),
        ("raw invalid UTF-8", b"GET /v1/or\xff\xfeders HTTP/1.1", 400),
        (
            "percent-encoded invalid UTF-8",
            b"GET /v1/or%ffders HTTP/1.1",
            400,
        ),
        (
            "percent-encoded overlong slash",
            b"GET /v1/%C0%AFetc HTTP/1.1",
            400,
        ),
        ("percent-encoded NUL", b"GET /v1/or%00ders HTTP/1.1", 400),
        (
            "percent-encoded newline",
            b"GET /v1/a%0d%0aSet-Cookie:x HTTP/1.1",
            400,
        ),
        ("no route", b"GET /admin/secrets HTTP/1.1", 404),
        ("no route for the method", b"DELETE /login HTTP/1.1", 404),
    ] {
        let req = [
            line,
            b"\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nConnection: close\r\n\r\n",
        ]
        .concat();
        let (got, body) = raw(a, &req).await;
        assert_eq!(got, status, "{what}: {body}");
        if what.starts_with("percent") {
            assert_eq!(json_error(&body), "bad_request", "{what}");
        }
        if status == 404 {
            assert_eq!(json_error(&body), "not_found", "{what}");
        }
    }
    s.assert_upstream_untouched();
    s.assert_logs_clean();
}

#[tokio::test]
async fn bodies_over_the_route_limit_get_413() {
    let s = setup(&[]).await;
    let http = Http::new();
    // Declared too large: refused at once.
    let (status, body) = raw(
        s.gw.addr,
        b"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 413);
    assert_eq!(json_error(&body), "payload_too_large");
    // Streamed (chunked) past the limit: refused when the count passes it.
    let tcp = TcpStream::connect(s.gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        for _ in 0..8 {
            if tx
                .send(Ok(Frame::data(Bytes::from(vec![b'x'; 512]))))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let req = Request::post("/v1/uploads")
        .header("host", "x")
        .header("x-api-key", K8)
        .body(StreamBody::new(tokio_stream_shim::Rx(rx)))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // Under the limit passes.
    let ok = http
        .send(
            http::Method::POST,
            &s.gw.url("/v1/uploads"),
            &[("x-api-key", K8)],
            &[b'y'; 1000],
        )
        .await;
    assert_eq!(ok.status, StatusCode::OK);
    assert_eq!(ok.json()["bytes"], 1000);
    s.assert_logs_clean();
}

#[tokio::test]
async fn slowloris_is_cut_off_at_the_header_timeout() {
    // On the express lane, and on hyper's path (which TLS connections take too).
    for extra in [&[][..], &["--no-express"][..]] {
        slowloris(extra).await;
    }
}

async fn slowloris(extra: &[&str]) {
    let mut args = vec!["--header-timeout", "1s"];
    args.extend_from_slice(extra);
    let s = setup(&args).await;
    let mut c = TcpStream::connect(s.gw.addr).await.unwrap();
    let started = Instant::now();
    c.write_all(b"GET /v1/orders HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut closed_at = None;
    let mut buf = [0u8; 1024];
    let mut answer = Vec::new();
    for _ in 0..100 {
        // One more header byte every 100 ms: never finishing the head.
        if c.write_all(b"X").await.is_err() {
            closed_at = Some(started.elapsed());
            break;
        }
        match tokio::time::timeout(Duration::from_millis(100), c.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed_at = Some(started.elapsed());
                break;
            }
            Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
            Err(_) => {}
        }
    }
    let at = closed_at.expect("the gateway kept a trickling connection open for 10 s");
    assert!(at < Duration::from_secs(4), "closed only after {at:?}");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 408 ") && answer.contains("request_timeout"),
        "{extra:?}: no 408 before the close: {answer:?}"
    );
    assert_eq!(s.up.count(), 0);
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_is_ignored() {
    let s = setup(&[]).await;
    let http = Http::new();
    // Five unauthenticated requests, each claiming another address: all one bucket (burst 5).
    let mut statuses = vec![];
    for i in 0..6 {
        let xff = format!("198.51.100.{i}");
        let a = http
            .get(&s.gw.url("/v1/orders"), &[("x-forwarded-for", &xff)])
            .await;
        statuses.push(a.status);
    }
    assert_eq!(statuses[..5], [StatusCode::UNAUTHORIZED; 5]);
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(s.up.count(), 0);
}

/// Unauthenticated requests through a trusted proxy, one per `X-Forwarded-For` address.
async fn through_the_proxy(http: &Http, gw: &Tollgate, clients: &[String]) -> Vec<StatusCode> {
    let mut statuses = vec![];
    for xff in clients {
        let a = http.get(&gw.url("/v1/orders"), &[("x-forwarded-for", xff)]).await;
        statuses.push(a.status);
    }
    statuses
}

#[tokio::test]
async fn ipv6_clients_of_one_slash_64_share_the_unauthenticated_bucket() {
    let redis = common::RedisServer::start();
    let (up, addr) = Upstream::start().await;
    let mut r: Value = serde_json::from_str(&rules(addr)).unwrap();
    // No refill while the test runs: what passes is what the burst of 5 holds.
    r["limits"]["unauth"]["rate"] = json!("5/1h");
    let (_dir, path) = common::rules_file(&r.to_string());
    let url = redis.url();
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &url,
        "--trusted-proxy",
        "127.0.0.1",
    ]);
    let http = Http::new();
    // Six addresses of 2001:db8:1:2::/64, as a client that holds the /64 would rotate them.
    let one_net: Vec<String> = [
        "::1",
        "::2",
        ":aaaa::9",
        ":ffff:ffff:ffff:ffff",
        "::77",
        ":1:2:3:4",
    ]
    .iter()
    .map(|host| format!("2001:db8:1:2{host}"))
    .collect();
    let statuses = through_the_proxy(&http, &gw, &one_net).await;
    assert_eq!(
        statuses,
        [
            [StatusCode::UNAUTHORIZED; 5].as_slice(),
            &[StatusCode::TOO_MANY_REQUESTS]
        ]
        .concat(),
        "six addresses of one /64 must pay one bucket of 5"
    );
    // Another /64 has its own bucket, and so does an IPv4 client beside them.
    let other_net = ["2001:db8:1:3::1".to_string(), "2001:db8:1:3::2".to_string()];
    assert_eq!(
        through_the_proxy(&http, &gw, &other_net).await,
        [StatusCode::UNAUTHORIZED; 2]
    );
    assert_eq!(
        through_the_proxy(&http, &gw, &["203.0.113.9".to_string()]).await,
        [StatusCode::UNAUTHORIZED]
    );
    let buckets = redis.bucket_names("rl:{ip:");
    assert_eq!(
        buckets,
        [
            "rl:{ip:2001:db8:1:2::/64}:unauth",
            "rl:{ip:2001:db8:1:3::/64}:unauth",
            "rl:{ip:203.0.113.9}:unauth"
        ]
    );
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn disagreeing_credentials_get_400() {
    let s = setup(&[]).await;
    let a = Http::new()
        .get(
            &s.gw.url("/v1/orders"),
            &[("x-api-key", K7), ("authorization", &format!("Bearer {K8}"))],
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.json()["error"], "bad_request");
    assert!(a.json()["message"].as_str().unwrap().contains("different keys"));
    // The same key in both is fine.
    let b = Http::new()
        .get(
            &s.gw.url("/v1/orders"),
            &[("x-api-key", K7), ("authorization", &format!("Bearer {K7}"))],
        )
        .await;
    assert_eq!(b.status, StatusCode::OK);
    assert_eq!(s.up.count(), 1);
    s.assert_logs_clean();
}

#[tokio::test]
async fn login_limit_keyed_on_a_json_body_field() {
    let s = setup(&[]).await;
    let http = Http::new();
    let url = s.gw.url("/v2/login");
    let post = |body: &'static [u8]| http.send(http::Method::POST, &url, &[], body);
    for _ in 0..5 {
        let a = post(br#"{"account": "alice", "password": "x"}"#).await;
        assert_eq!(a.status, StatusCode::OK);
        // The upstream gets the body the gateway read.
        assert_eq!(a.json()["bytes"], 37);
    }
    let a = post(br#"{"account": "alice", "password": "y"}"#).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    // Both the account's bucket and this address's unauthenticated bucket are spent; the
    // account's wait (12 s) is the longer, so it decides.
    assert_eq!(a.json()["limit"], "login-body");
    assert_eq!(a.header("retry-after"), Some("12"));
    // Another account from the same address meets the address's bucket.
    let b = post(br#"{"account": "bob"}"#).await;
    assert_eq!(b.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(b.json()["limit"], "unauth");
    let bad = post(b"account=alice").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.json()["error"], "bad_request");
    let missing = post(br#"{"user": "alice"}"#).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    let huge: &'static [u8] = Box::leak(
        format!(r#"{{"account": "{}"}}"#, "a".repeat(20_000))
            .into_bytes()
            .into_boxed_slice(),
    );
    let a = post(huge).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(s.up.count(), 5);
    s.assert_logs_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_is_shed_past_its_in_flight_cap() {
    let s = setup(&[]).await;
    let mut tasks = vec![];
    for _ in 0..20 {
        let url = s.gw.url("/v1/slowpool");
        tasks.push(tokio::spawn(async move {
            Http::new().get(&url, &[("x-api-key", K8)]).await
        }));
    }
    let mut ok = 0;
    let mut shed = 0;
    for t in tasks {
        let a = t.await.unwrap();
        match a.status {
            StatusCode::OK => ok += 1,
            StatusCode::SERVICE_UNAVAILABLE => {
                shed += 1;
                assert_eq!(a.header("retry-after"), Some("1"));
                assert_eq!(a.json()["error"], "upstream_overloaded");
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, shed), (4, 16));
    assert_eq!(s.up.count(), 4, "the upstream received more than its cap");
}

#[tokio::test]
async fn upstream_faults_have_defined_answers_and_leak_nothing() {
    let s = setup(&[]).await;
    let http = Http::new();
    // Slow headers past the upstream's 300 ms timeout: 504.
    let a = http.get(&s.gw.url("/v1/slow-head"), &[("x-api-key", K8)]).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(a.json()["error"], "gateway_timeout");
    // Slow body after the headers: the status is already sent, so the stream is cut cleanly.
    let tcp = TcpStream::connect(s.gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = Request::get("/v1/slow-body")
        .header("host", "x")
        .header("x-api-key", K8)
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let started = Instant::now();
    let body = resp.into_body().collect().await;
    assert!(
        body.is_err(),
        "a stalled body must end in an error, not look complete"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let _ = conn.await;
    // Every upstream connection the gateway opened for these is closed again.
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.up.open.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        assert!(
            Instant::now() < deadline,
            "{} upstream connections still open",
            s.up.open.load(std::sync::atomic::Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.assert_logs_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_offers_h2_and_refuses_old_versions() {
    let curl = common::require_binary("curl");
    let (up, addr) = Upstream::start().await;
    let (_dir, path) = common::rules_file(&rules(addr));
    let certs = common::repo().join("certs");
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--tls-cert",
        certs.join("demo-cert.pem").to_str().unwrap(),
        "--tls-key",
        certs.join("demo-key.pem").to_str().unwrap(),
    ]);
    let url = format!("https://localhost:{}/v1/orders", gw.addr.port());
    let run = |extra: &[&str]| {
        std::process::Command::new(&curl)
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_version} %{http_code}",
                "--cacert",
            ])
            .arg(certs.join("demo-cert.pem"))
            .args(["--resolve", &format!("localhost:{}:127.0.0.1", gw.addr.port())])
            .args(["-H", "x-api-key: k8-demo-key"])
            .args(extra)
            .arg(&url)
            .output()
            .unwrap()
    };
    for _ in 0..3 {
        let out = run(&["--http2"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "2 200");
        let out = run(&["--http1.1"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "1.1 200");
        let out = run(&["--tlsv1.0", "--tls-max", "1.1"]);
        assert!(!out.status.success(), "TLS 1.1 was accepted");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "0 000");
    }
    assert_eq!(up.count(), 6);
}

#[tokio::test]
async fn a_stalled_or_malformed_request_body_is_the_clients_fault_not_the_upstreams() {
    let s = setup(&["--body-timeout", "500ms", "--no-express"]).await;
    // Ten bytes of a hundred, then nothing.
    let mut c = TcpStream::connect(s.gw.addr).await.unwrap();
    c.write_all(b"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let started = Instant::now();
    while !String::from_utf8_lossy(&answer).contains("\r\n\r\n") && started.elapsed() < Duration::from_secs(5)
    {
        match tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "a stalled body: {answer:?}");

    // A chunked body whose framing breaks: 400, not a 502 that blames the upstream.
    let (status, body) = raw(
        s.gw.addr,
        b"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nX-API-Key: k8-demo-key\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\n",
    )
    .await;
    assert_eq!(status, 400, "a malformed chunked body: {body}");
    assert!(body.contains("bad_request"), "{body}");
    s.assert_logs_clean();
}
