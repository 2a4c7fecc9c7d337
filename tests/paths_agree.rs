//! The express lane and hyper's general path (`--no-express`) answer alike: for every kind of
//! answer the gateway makes, two gateways on the same rules and the same upstream give a
//! keep-alive HTTP/1.1 client the same status, end-to-end headers and body, send the upstream
//! the same request head, and keep the connection for the next request.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::Answer;
use common::agree::{HOST, REQUEST_ID, connect, differences, exchange, normal};
use http::{Method, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http1::SendRequest;
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate_gateway::app::{self, GatewayConfig, MeterConfig, RulesSource, Running};
use tollgate_limit::clock::ManualClock;

/// The secret of `k-1`, the key most requests carry.
const KEY: &str = "paths-agree-key";
/// The secret of `k-q`, whose key has a daily quota counted in Paris.
const QUOTA_KEY: &str = "paths-agree-quota-key";
/// Both gateways' clock, which never moves: no bucket refills during a test. 23:30 in Paris,
/// half an hour before the quota's day ends.
const NOW: &str = "2026-12-01T22:30:00Z";

fn at(rfc3339: &str) -> u64 {
    rfc3339.parse::<jiff::Timestamp>().unwrap().as_millisecond() as u64 * 1000
}

fn sha256(secret: &str) -> String {
    hex::encode(sha2::Sha256::digest(secret.as_bytes()))
}

/// One rule set for every scenario: each route gives one kind of answer.
///
/// - `/v1/orders`: a roomy key limit (`plan`), so admitted answers carry `RateLimit`;
/// - `/v1/small`: a bucket of two that never refills, so the third request is `429`;
/// - `/v1/seat`: one request of a key in flight at once;
/// - `/v1/accounts`: limited per value of a JSON body field;
/// - `/v1/completions`: post-paid, charged the `X-Usage-Tokens` the upstream reports;
/// - `/v1/free`: no limit at all (a quota key's quota is then the only budget);
/// - `/v1/usage`: the caller's own budget (`"serve": "usage"`), two asks and then `429`;
/// - `/shed`: an upstream that takes one request at a time and queues none;
/// - `/slow`: an upstream that must answer within 300 ms;
/// - `/down`: an upstream nobody listens for.
///
/// Requests without a valid key pay `unauth`, three and then `429`.
fn rules(up: SocketAddr, dead: u16) -> String {
    let url = format!("http://{up}");
    serde_json::json!({
        "version": 1,
        "upstreams": {
            "up": {"url": url},
            "tight": {"url": url, "timeout_ms": 300},
            "shed": {"url": url, "max_in_flight": 1, "queue_timeout_ms": 0},
            "dead": {"url": format!("http://127.0.0.1:{dead}")}
        },
        "limits": {
            "plan": {"dimension": "key", "rate": "100/1s", "burst": 100},
            "small": {"dimension": "key", "rate": "1/3600s", "burst": 2},
            "seats": {"dimension": "key", "concurrent": 1},
            "account": {"dimension": {"body_field": "account"}, "rate": "10/1s", "burst": 10},
            "tokens": {"dimension": "key", "rate": "1000/60s", "burst": 1000,
                       "cost_from_response": {"header": "X-Usage-Tokens"}},
            "unauth": {"dimension": "ip", "rate": "1/3600s", "burst": 3},
            "asks": {"dimension": "key", "rate": "1/3600s", "burst": 2},
            "queue": {"dimension": "ip", "rate": "1000/1s", "burst": 1, "delay": {"max_wait_ms": 2}},
            "guard": {"dimension": "ip", "rate": "1/3600s", "burst": 1, "block_for": "30s"}
        },
        "keys": [
            {"id": "k-1", "sha256": sha256(KEY)},
            {"id": "k-q", "sha256": sha256(QUOTA_KEY),
             "quota": {"per": "day", "limit": 100, "timezone": "Europe/Paris"}}
        ],
        "routes": [
            {"name": "orders", "method": "*", "path": "/v1/orders", "upstream": "up", "cost": {"plan": 1}},
            {"name": "small", "method": "*", "path": "/v1/small", "upstream": "up", "cost": {"small": 1}},
            {"name": "seat", "method": "*", "path": "/v1/seat", "upstream": "up", "cost": {"seats": 1}},
            {"name": "accounts", "method": "GET", "path": "/v1/accounts", "upstream": "up",
             "cost": {"account": 1}},
            {"name": "completions", "method": "GET", "path": "/v1/completions", "upstream": "up",
             "cost": {"tokens": 1}},
            {"name": "free", "method": "*", "path": "/v1/free", "upstream": "up"},
            {"name": "usage", "method": "GET", "path": "/v1/usage", "serve": "usage", "cost": {"asks": 1}},
            {"name": "queued", "method": "*", "path": "/v1/queued", "upstream": "up", "cost": {"queue": 1}},
            {"name": "guarded", "method": "*", "path": "/v1/guarded", "upstream": "up", "cost": {"guard": 1}},
            {"name": "shed", "method": "*", "path": "/shed", "upstream": "shed", "cost": {"plan": 1}},
            {"name": "slow", "method": "*", "path": "/slow", "upstream": "tight", "cost": {"plan": 1}},
            {"name": "down", "method": "*", "path": "/down", "upstream": "dead", "cost": {"plan": 1}}
        ],
        "unauthenticated": {"limit": "unauth"}
    })
    .to_string()
}

/// The one upstream behind both gateways. It answers `200` with the target it was asked for,
/// and by the query: `hold` waits for [`Upstream::release`], `silent` never answers, `own` adds
/// the upstream's own `RateLimit-Policy` and `RateLimit`, `tokens=N` reports a cost in
/// `X-Usage-Tokens`. It records every request head.
struct Upstream {
    addr: SocketAddr,
    heads: Mutex<Vec<String>>,
    /// How many `hold` requests arrived.
    held: watch::Sender<usize>,
    release: watch::Sender<bool>,
}

impl Upstream {
    async fn start() -> Arc<Upstream> {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = Arc::new(Upstream {
            addr: l.local_addr().unwrap(),
            heads: Mutex::new(Vec::new()),
            held: watch::Sender::new(0),
            release: watch::Sender::new(false),
        });
        let u = up.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve_upstream(s, u.clone()));
            }
        });
        up
    }

    /// The heads received since the last call.
    fn take_heads(&self) -> Vec<String> {
        std::mem::take(&mut *self.heads.lock().unwrap())
    }

    /// Returns once `n` `hold` requests have arrived in all.
    async fn wait_held(&self, n: usize) {
        let mut rx = self.held.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|h| *h >= n))
            .await
            .expect("the held request reaches the upstream")
            .unwrap();
    }

    fn release(&self) {
        self.release.send_replace(true);
    }
}

async fn serve_upstream(mut s: TcpStream, up: Arc<Upstream>) {
    let mut buf = Vec::new();
    loop {
        // Every request of these tests is bodiless: a head is a whole request.
        let head = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
                buf.drain(..end + 4);
                break head;
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        up.heads.lock().unwrap().push(head.clone());
        let mut line = head.split(' ');
        let method = line.next().unwrap_or("").to_string();
        let target = line.next().unwrap_or("").to_string();
        let query = target.split_once('?').map_or("", |(_, q)| q).to_string();
        let asks = |word: &str| query.split('&').any(|p| p == word);
        if asks("silent") {
            // No answer: the gateway gives up on its timeout and closes.
            let _ = s.read(&mut [0u8; 1]).await;
            return;
        }
        if asks("hold") {
            let mut release = up.release.subscribe();
            up.held.send_modify(|n| *n += 1);
            let _ = release.wait_for(|r| *r).await;
        }
        let body = format!("{{\"served\":\"{target}\"}}");
        let mut answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Up: 1\r\nContent-Length: {}\r\n",
            body.len()
        );
        if asks("own") {
            answer.push_str("RateLimit-Policy: \"upstream\";q=9;w=1\r\nRateLimit: \"upstream\";r=8;t=1\r\n");
        }
        if let Some(n) = query.split('&').find_map(|p| p.strip_prefix("tokens=")) {
            answer.push_str(&format!("X-Usage-Tokens: {n}\r\n"));
        }
        answer.push_str("\r\n");
        if method != "HEAD" {
            answer.push_str(&body);
        }
        if s.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// A gateway, and the keep-alive connection a test talks to it on.
struct Side {
    gw: Running,
    conn: SendRequest<Empty<Bytes>>,
    dir: tempfile::TempDir,
}

impl Side {
    async fn start(rules: &str, express: bool, set: &impl Fn(&mut GatewayConfig, &Path)) -> Side {
        let (dir, path) = common::rules_file(rules);
        let mut cfg = GatewayConfig::new(RulesSource::File(path));
        cfg.clock = ManualClock::new(at(NOW));
        cfg.limits.express = express;
        set(&mut cfg, dir.path());
        let gw = app::start(cfg).await.expect("gateway starts");
        let conn = connect(gw.addr).await;
        Side { gw, conn, dir }
    }
}

/// Two gateways on the same rules and upstream: the express lane's, and hyper's path alone. What
/// differs between them is collected, so one difference doesn't hide the next, and reported by
/// [`Pair::assert_alike`].
struct Pair {
    up: Arc<Upstream>,
    lane: Side,
    general: Side,
    findings: Vec<String>,
    /// Bound and never listening: connecting to it is refused.
    _dead: TcpSocket,
}

impl Pair {
    async fn start() -> Pair {
        Pair::start_with(|_, _| {}).await
    }

    /// `set` adjusts each gateway's configuration; its second argument is that gateway's own
    /// directory.
    async fn start_with(set: impl Fn(&mut GatewayConfig, &Path)) -> Pair {
        let up = Upstream::start().await;
        let dead = TcpSocket::new_v4().unwrap();
        dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let rules = rules(up.addr, dead.local_addr().unwrap().port());
        let lane = Side::start(&rules, true, &set).await;
        let general = Side::start(&rules, false, &set).await;
        Pair {
            up,
            lane,
            general,
            findings: Vec::new(),
            _dead: dead,
        }
    }

    /// Sends the same request to both gateways on their kept connections and compares the
    /// answers and the heads the upstream got; then checks that each connection carries the
    /// next request. Returns the lane's answer.
    async fn both(&mut self, method: Method, path: &str, headers: &[(&str, &str)]) -> Answer {
        let what = format!("{method} {path} {headers:?}");
        let lane = exchange(&mut self.lane.conn, &method, path, headers)
            .await
            .unwrap_or_else(|e| panic!("{what} on the lane: {e}"));
        let lane_heads = self.up.take_heads();
        let general = exchange(&mut self.general.conn, &method, path, headers)
            .await
            .unwrap_or_else(|e| panic!("{what} on hyper's path: {e}"));
        let general_heads = self.up.take_heads();
        self.compare(&what, &lane, &general, &lane_heads, &general_heads);
        self.still_kept(&what).await;
        lane
    }

    /// Records what differs between two answers to one request, and between the heads the
    /// upstream got for it.
    fn compare(
        &mut self,
        what: &str,
        lane: &Answer,
        general: &Answer,
        lane_heads: &[String],
        general_heads: &[String],
    ) {
        for d in differences(lane, general) {
            self.findings.push(format!("{what}: {d}"));
        }
        if normal(lane_heads) != normal(general_heads) {
            self.findings.push(format!(
                "{what}: the upstream got\n  from the lane {lane_heads:?}\n  from hyper's path {general_heads:?}"
            ));
        }
        for (path, a) in [("lane", lane), ("hyper", general)] {
            if a.header("x-request-id") != Some(REQUEST_ID) {
                self.findings.push(format!(
                    "{what}: {path} answered with x-request-id {:?}",
                    a.header("x-request-id")
                ));
            }
        }
    }

    /// The next request on each connection: a `404` (no route, nothing charged). A connection
    /// the gateway closed is a finding, and a new one takes its place so the test goes on.
    async fn still_kept(&mut self, after: &str) {
        for (path, side) in [("lane", &mut self.lane), ("hyper", &mut self.general)] {
            match exchange(&mut side.conn, &Method::GET, "/nowhere", &[]).await {
                Ok(a) if a.status == StatusCode::NOT_FOUND => {}
                Ok(a) => panic!("after {after}, {path}: the next request got {}", a.status),
                Err(e) => {
                    self.findings.push(format!(
                        "after {after}: {path}'s connection did not carry the next request: {e}"
                    ));
                    side.conn = connect(side.gw.addr).await;
                }
            }
        }
    }

    /// Starts `path` on a connection of its own to each gateway, lane first, and returns once
    /// the upstream holds both; the upstream heads are compared as they arrive.
    async fn hold(&mut self, path: &str) -> [JoinHandle<Answer>; 2] {
        let mut holders = Vec::new();
        let mut heads = Vec::new();
        for (n, side) in [&self.lane, &self.general].into_iter().enumerate() {
            let mut conn = connect(side.gw.addr).await;
            let path = path.to_string();
            holders.push(tokio::spawn(async move {
                exchange(&mut conn, &Method::GET, &path, &[("x-api-key", KEY)])
                    .await
                    .unwrap_or_else(|e| panic!("the held request {path}: {e}"))
            }));
            self.up.wait_held(n + 1).await;
            heads.push(self.up.take_heads());
        }
        if normal(&heads[0]) != normal(&heads[1]) {
            self.findings.push(format!(
                "held {path}: the upstream got\n  from the lane {:?}\n  from hyper's path {:?}",
                heads[0], heads[1]
            ));
        }
        holders.try_into().unwrap()
    }

    /// Starts a queued request on a connection of its own to each gateway and returns once both
    /// wait: on a clock that stands, they wait for good.
    async fn hold_queued(&mut self) -> Vec<JoinHandle<()>> {
        let mut holders = Vec::new();
        for side in [&self.lane, &self.general] {
            let mut conn = connect(side.gw.addr).await;
            holders.push(tokio::spawn(async move {
                let _ = exchange(&mut conn, &Method::GET, "/v1/queued", &[("x-api-key", KEY)]).await;
            }));
            let m = side.gw.metrics.clone();
            let want = m.queue_waiting.get() + 1;
            tokio::time::timeout(Duration::from_secs(10), async move {
                while m.queue_waiting.get() < want {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
            .await
            .expect("the queued request waits");
        }
        holders
    }

    /// Lets the held requests go and compares their answers.
    async fn release(&mut self, holders: [JoinHandle<Answer>; 2]) {
        self.up.release();
        let [lane, general] = holders;
        let (lane, general) = (lane.await.unwrap(), general.await.unwrap());
        assert_eq!(lane.status, StatusCode::OK, "{:?}", lane.body);
        self.compare("the held request", &lane, &general, &[], &[]);
    }

    /// Fails with every difference found.
    fn assert_alike(self) {
        assert!(
            self.findings.is_empty(),
            "the express lane and hyper's path differ:\n{}",
            self.findings.join("\n")
        );
    }
}

fn key() -> [(&'static str, &'static str); 1] {
    [("x-api-key", KEY)]
}

fn error_of(a: &Answer) -> String {
    a.json()["error"].as_str().unwrap_or("").to_string()
}

#[tokio::test]
async fn refusals_before_any_limit_answer_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/nowhere", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::NOT_FOUND, "not_found".into())
    );
    p.both(Method::DELETE, "/nowhere", &key()).await;
    let a = p.both(Method::HEAD, "/nowhere", &key()).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert!(a.body.is_empty());
    // A `..` above the root, and encoded slashes on a route and off every route.
    for path in ["/../x", "/v1/orders/a%2Fb", "/v1/a%2Fb"] {
        let a = p.both(Method::GET, path, &key()).await;
        assert_eq!(
            (a.status, error_of(&a)),
            (StatusCode::BAD_REQUEST, "bad_request".into()),
            "{path}"
        );
    }
    let a = p.both(Method::HEAD, "/v1/orders/a%2Fb", &key()).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.is_empty());
    // Two keys that disagree.
    let a = p
        .both(
            Method::GET,
            "/v1/orders",
            &[("x-api-key", KEY), ("authorization", "Bearer another")],
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    // And then an admitted request, with its budget.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.header("ratelimit").is_some(), "{:?}", a.headers);
    p.assert_alike();
}

/// An upgrade is not a request the lane takes: one the route does not list is refused alike,
/// uncharged, and `h2c` is ignored alike (the upstream is asked no upgrade); the connection
/// then goes on.
#[tokio::test]
async fn an_unlisted_upgrade_answers_alike() {
    let mut p = Pair::start().await;
    let ws = [
        ("x-api-key", KEY),
        ("upgrade", "websocket"),
        ("connection", "upgrade"),
    ];
    let a = p.both(Method::GET, "/v1/orders", &ws).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::FORBIDDEN, "upgrade_not_allowed".into())
    );
    assert!(a.header("ratelimit").is_none(), "{:?}", a.headers);
    let h2c = [
        ("x-api-key", KEY),
        ("upgrade", "h2c"),
        ("connection", "upgrade, http2-settings"),
        ("http2-settings", "AAMAAABkAAQAoAAAAAIAAAAA"),
    ];
    let a = p.both(Method::GET, "/v1/orders", &h2c).await;
    assert_eq!(a.status, StatusCode::OK);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// TRACE is not a method the lane takes: the express gateway's connection goes to hyper with
/// it, and must answer as `--no-express` does, then go on.
#[tokio::test]
async fn trace_is_refused_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::TRACE, "/v1/orders", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// Unknown and missing keys pay the unauthenticated bucket of three: three `401`s with its
/// budget, then `429`.
#[tokio::test]
async fn unknown_and_missing_keys_answer_alike() {
    let mut p = Pair::start().await;
    let unknown = [("x-api-key", "not-a-key")];
    let a = p.both(Method::GET, "/v1/orders", &unknown).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::UNAUTHORIZED, "unauthorized".into())
    );
    assert!(a.header("ratelimit").is_some(), "{:?}", a.headers);
    let a = p.both(Method::DELETE, "/v1/orders", &unknown).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    let a = p.both(Method::GET, "/v1/orders", &[]).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::UNAUTHORIZED, "unauthorized".into())
    );
    // The bucket is spent.
    let a = p.both(Method::HEAD, "/v1/orders", &[]).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    let a = p.both(Method::GET, "/v1/orders", &unknown).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    assert!(a.header("retry-after").is_some(), "{:?}", a.headers);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A bucket of two: two admitted answers with their budget, then `429` with `Retry-After`,
/// `RateLimit-Policy`, `RateLimit` and a JSON body, to GET, HEAD and DELETE alike.
#[tokio::test]
async fn a_spent_bucket_answers_alike() {
    let mut p = Pair::start().await;
    for left in [1, 0] {
        let a = p.both(Method::GET, "/v1/small", &key()).await;
        assert_eq!(a.status, StatusCode::OK);
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.contains(&format!(";r={left};")), "{state}");
    }
    let a = p.both(Method::GET, "/v1/small", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    for h in ["retry-after", "ratelimit-policy", "ratelimit"] {
        assert!(a.header(h).is_some(), "{h}: {:?}", a.headers);
    }
    let a = p.both(Method::HEAD, "/v1/small", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    let a = p.both(Method::DELETE, "/v1/small", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A queueing limit (1 a millisecond, burst 1, a wait of up to 2 ms): the second request waits
/// its millisecond and is forwarded; with two waiting, the next would wait 3 ms and is refused.
/// Each gateway's clock moves only while it has a request waiting, so each waits as long.
#[tokio::test]
async fn a_queued_request_answers_alike() {
    let clocks = [ManualClock::new(at(NOW)), ManualClock::new(at(NOW))];
    let started = std::sync::atomic::AtomicUsize::new(0);
    let given = clocks.clone();
    let mut p = Pair::start_with(move |cfg, _| {
        // The lane's gateway starts first, then hyper's.
        cfg.clock = given[started.fetch_add(1, std::sync::atomic::Ordering::SeqCst)].clone();
    })
    .await;
    let sides = [p.lane.gw.metrics.clone(), p.general.gw.metrics.clone()];
    let mover = tokio::spawn(async move {
        loop {
            for (m, c) in sides.iter().zip(&clocks) {
                if m.queue_waiting.get() > 0 {
                    c.advance_us(100);
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    for side in [&p.lane, &p.general] {
        assert_eq!(side.gw.metrics.queued.get(), 1);
    }
    mover.abort();
    // The clocks stand: two more wait for good, and the next would wait 3 ms.
    let holders = p.hold_queued().await;
    let mut more = p.hold_queued().await;
    let a = p.both(Method::GET, "/v1/queued", &key()).await;
    assert_eq!(
        (a.status, error_of(&a), a.header("retry-after")),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into(), Some("1"))
    );
    more.extend(holders);
    for h in more {
        h.abort();
    }
    p.assert_alike();
}

/// A blocking limit: the refusal that starts the block and the ones during it answer alike.
#[tokio::test]
async fn a_blocked_bucket_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/guarded", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    for _ in 0..2 {
        let a = p.both(Method::GET, "/v1/guarded", &key()).await;
        assert_eq!(
            (a.status, error_of(&a), a.header("retry-after")),
            (StatusCode::TOO_MANY_REQUESTS, "blocked".into(), Some("30"))
        );
    }
    let a = p.both(Method::HEAD, "/v1/guarded", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    p.assert_alike();
}

/// One seat per key: while a slow request holds it, the next gets `429` `too_many_in_flight`.
#[tokio::test]
async fn a_full_seat_limit_answers_alike() {
    let mut p = Pair::start().await;
    let holders = p.hold("/v1/seat?hold").await;
    let a = p.both(Method::GET, "/v1/seat", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "too_many_in_flight".into())
    );
    assert_eq!(a.header("retry-after"), Some("1"));
    let a = p.both(Method::HEAD, "/v1/seat", &key()).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(a.body.is_empty());
    p.release(holders).await;
    p.assert_alike();
}

/// An upstream that takes one request at a time and queues none: `503` `upstream_overloaded`
/// while one is in flight.
#[tokio::test]
async fn an_overloaded_upstream_answers_alike() {
    let mut p = Pair::start().await;
    let holders = p.hold("/shed?hold").await;
    let a = p.both(Method::GET, "/shed", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::SERVICE_UNAVAILABLE, "upstream_overloaded".into())
    );
    assert_eq!(a.header("retry-after"), Some("1"));
    let a = p.both(Method::HEAD, "/shed", &key()).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(a.body.is_empty());
    p.both(Method::DELETE, "/shed", &key()).await;
    p.release(holders).await;
    p.assert_alike();
}

#[tokio::test]
async fn an_unreachable_upstream_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/down", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::BAD_GATEWAY, "bad_gateway".into())
    );
    let a = p.both(Method::HEAD, "/down", &key()).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert!(a.body.is_empty());
    p.both(Method::DELETE, "/down", &key()).await;
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// An upstream that takes the request and never answers, past its 300 ms: `504`.
#[tokio::test]
async fn an_upstream_past_its_timeout_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/slow?silent", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::GATEWAY_TIMEOUT, "gateway_timeout".into())
    );
    let a = p.both(Method::HEAD, "/slow?silent", &key()).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(a.body.is_empty());
    let a = p.both(Method::GET, "/slow", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A limit keyed on a JSON body field, asked without a body: the lane serves such a route
/// itself, and both must refuse it alike.
#[tokio::test]
async fn a_body_field_limit_on_a_bodiless_get_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/accounts", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::BAD_REQUEST, "bad_request".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A post-paid limit of 1,000 tokens: 300 reported leave 700, 900 more leave it 200 in debt,
/// and the next is refused until the debt is repaid. `RateLimit` is read after each debit.
#[tokio::test]
async fn a_post_paid_debit_shows_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/completions?tokens=300", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header("x-usage-tokens"), Some("300"));
    let state = a.header("ratelimit").unwrap_or("");
    assert!(state.starts_with("\"tokens-burst\";r=700;"), "{state}");
    let a = p.both(Method::GET, "/v1/completions?tokens=900", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    let state = a.header("ratelimit").unwrap_or("");
    assert!(state.starts_with("\"tokens-burst\";r=0;"), "{state}");
    let a = p.both(Method::GET, "/v1/completions?tokens=1", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// An upstream that writes its own `RateLimit-Policy` and `RateLimit`: on a limited route the
/// gateway's budget is what the client gets; on a route without a limit, the upstream's.
#[tokio::test]
async fn an_upstreams_own_ratelimit_on_a_limited_route_answers_alike() {
    let mut p = Pair::start().await;
    for method in [Method::GET, Method::HEAD] {
        let a = p.both(method.clone(), "/v1/orders?own", &key()).await;
        assert_eq!(a.status, StatusCode::OK);
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.starts_with("\"plan-burst\";"), "{method}: {state}");
    }
    let a = p.both(Method::GET, "/v1/free?own", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// The same upstream for a key with a quota: on a route with no limit (the quota is its only
/// budget), and on a limited one (the bucket, then the quota).
#[tokio::test]
async fn an_upstreams_own_ratelimit_with_a_quota_answers_alike() {
    let mut p = Pair::start().await;
    let quota = [("x-api-key", QUOTA_KEY)];
    for path in ["/v1/free?own", "/v1/orders?own", "/v1/free"] {
        let a = p.both(Method::GET, path, &quota).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.contains("\"day\";r=100;t=1800"), "{path}: {state}");
    }
    let a = p.both(Method::HEAD, "/v1/free?own", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A quota key as metering flags it: near its quota, every answer lists what is left; over
/// it, `429` `quota_exceeded` until the reset in Paris. The flags go into each gateway's
/// metering file, which it reads every second.
#[tokio::test]
async fn a_quota_keys_answers_follow_its_flags_alike() {
    use tollgate_meter::flags::{Flag, State};
    let mut p = Pair::start_with(|cfg, dir| {
        cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        cfg.meter = Some(MeterConfig {
            instance: "paths-agree".into(),
            interval: Duration::from_secs(5),
            file: dir.join("usage.db"),
        });
    })
    .await;
    let quota = [("x-api-key", QUOTA_KEY)];
    let flag = |state: State, used: u64| Flag {
        state,
        quota: tollgate_rules::quota::Per::Day,
        period: "2026-12-01".into(),
        used,
        limit: 100,
        resets_at_ms: at("2026-12-01T23:00:00Z") as i64 / 1000,
        resets_at: "2026-12-02T00:00:00+01:00".into(),
    };

    flag_both(&p, &flag(State::Near, 85), "near").await;
    for path in ["/v1/free", "/v1/orders"] {
        let a = p.both(Method::GET, path, &quota).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.ends_with("\"day\";r=15;t=1800"), "{path}: {state}");
    }
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(
        (
            a.status,
            &a.json()["quota"]["used"],
            &a.json()["quota"]["remaining"]
        ),
        (StatusCode::OK, &serde_json::json!(85), &serde_json::json!(15))
    );

    flag_both(&p, &flag(State::Over, 100), "over").await;
    for method in [Method::GET, Method::HEAD, Method::DELETE] {
        let a = p.both(method.clone(), "/v1/orders", &quota).await;
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{method}");
        assert_eq!(a.header("retry-after"), Some("1800"), "{method}");
    }
    let a = p.both(Method::GET, "/v1/free", &quota).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded".into())
    );
    // Asking what is left is not billed, so a spent quota does not refuse it.
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["quota"]["remaining"], 0);
    // Another key is not held to k-q's quota.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// Writes `flag` for k-q into both gateways' metering files, and returns once each has read it
/// (its admin listener shows `state`). This waits for the once-a-second read of the flags, not
/// for any bucket: the clocks don't move.
async fn flag_both(p: &Pair, flag: &tollgate_meter::flags::Flag, state: &str) {
    let http = common::Http::new();
    for side in [&p.lane, &p.general] {
        let conn = tollgate_meter::sqlite::open(&side.dir.path().join("usage.db")).unwrap();
        tollgate_meter::sqlite::write_flag(&conn, "k-q", flag).unwrap();
        let url = format!("http://{}/admin/usage?key=k-q", side.gw.admin_addr.unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while http.get(&url, &[]).await.json()["quota"]["state"] != state {
            assert!(Instant::now() < deadline, "the {state} flag was never read");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The caller's own budget, answered by the gateway on both wires alike: each bucket of the key
/// as a request paying it is told, the route's own limit charged (two asks, then `429`) and
/// nothing else; a quota key's quota; `401` without a usable key.
#[tokio::test]
async fn the_usage_route_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.header("ratelimit"), Some("\"plan-burst\";r=99;t=1"));
    let limits = |asks: u64| {
        serde_json::json!([
            {"name": "asks", "rate": "1/3600s", "burst": 2, "remaining": asks, "reset_s": (2 - asks) * 3600},
            {"name": "plan", "rate": "100/1s", "burst": 100, "remaining": 99, "reset_s": 1},
            {"name": "small", "rate": "1/3600s", "burst": 2, "remaining": 2, "reset_s": 0},
            {"name": "tokens", "rate": "1000/60s", "burst": 1000, "remaining": 1000, "reset_s": 0}
        ])
    };
    for left in [1, 0] {
        let a = p.both(Method::GET, "/v1/usage", &key()).await;
        assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
        assert_eq!(a.header("content-type"), Some("application/json"));
        assert_eq!(a.header("cache-control"), Some("no-store"));
        assert_eq!(
            a.header("ratelimit"),
            Some(format!("\"asks-burst\";r={left};t={}", (2 - left) * 3600).as_str())
        );
        assert_eq!(
            a.json(),
            serde_json::json!({"key": "k-1", "tenant": "k-1", "limits": limits(left), "quota": null})
        );
        let body = String::from_utf8_lossy(&a.body).into_owned();
        assert!(body.starts_with("{\"key\":\"k-1\",\"tenant\":"), "{body}");
    }
    let a = p.both(Method::GET, "/v1/usage", &key()).await;
    assert_eq!(
        (a.status, a.json()["limit"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("asks"))
    );
    // Asking charged nothing but its own limit.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.header("ratelimit"), Some("\"plan-burst\";r=98;t=1"));
    let quota = [("x-api-key", QUOTA_KEY)];
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.json()["quota"],
        serde_json::json!({"per": "day", "limit": 100, "used": 0, "remaining": 100,
                           "resets_at": "2026-12-02T00:00:00+01:00"})
    );
    assert!(
        a.header("ratelimit")
            .is_some_and(|s| s.ends_with("\"day\";r=100;t=1800")),
        "{:?}",
        a.headers
    );
    for unusable in [&[("x-api-key", "not-a-key")][..], &[]] {
        let a = p.both(Method::GET, "/v1/usage", unusable).await;
        assert_eq!(
            (a.status, error_of(&a)),
            (StatusCode::UNAUTHORIZED, "unauthorized".into())
        );
    }
    p.assert_alike();
}

/// The comparisons above mean something only if the express gateway serves those requests on
/// the lane, not handed to hyper. The lane relays an upstream's header names as they came and
/// hyper writes them lowercased, and a connection handed to hyper stays there: so after each
/// refusal the lane takes, an admitted request on the same raw connection still shows `X-Up`.
#[tokio::test]
async fn the_lane_serves_the_refusals_it_is_compared_on() {
    let p = Pair::start().await;
    let refusals = [
        ("/nowhere", KEY, 404),
        ("/../x", KEY, 400),
        ("/v1/orders", "not-a-key", 401),
        ("/v1/orders", "", 401),
        ("/v1/small", KEY, 200),
        ("/v1/small", KEY, 200),
        ("/v1/small", KEY, 429),
        // A limit keyed on a body field, and a post-paid one: begun on the lane, ended there.
        ("/v1/accounts", KEY, 400),
        ("/v1/completions?tokens=5", KEY, 200),
        // Answered by the gateway itself, with a body of its own.
        ("/v1/usage", KEY, 200),
        ("/down", KEY, 502),
        ("/slow?silent", KEY, 504),
    ];
    for (side, upstream_case) in [(&p.lane, "\r\nX-Up: 1\r\n"), (&p.general, "\r\nx-up: 1\r\n")] {
        let mut tcp = TcpStream::connect(side.gw.addr).await.unwrap();
        for (path, secret, status) in refusals {
            let got = raw_get(&mut tcp, path, secret).await;
            assert!(got.starts_with(&format!("HTTP/1.1 {status} ")), "{path}: {got}");
            let next = raw_get(&mut tcp, "/v1/orders", KEY).await;
            assert!(
                next.starts_with("HTTP/1.1 200 ") && next.contains(upstream_case),
                "after {path}, not served as expected ({upstream_case:?}): {next}"
            );
        }
    }
}

/// Sends a GET on a raw keep-alive connection and reads its answer (its body framed by
/// `Content-Length`): the head and body as text.
async fn raw_get(tcp: &mut TcpStream, path: &str, secret: &str) -> String {
    let key = if secret.is_empty() {
        String::new()
    } else {
        format!("X-API-Key: {secret}\r\n")
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: {HOST}\r\nX-Request-Id: {REQUEST_ID}\r\n{key}\r\n");
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let read = async {
        let (head, len) = common::raw::read_head(tcp, &mut buf).await?;
        common::raw::read_body(tcp, &mut buf, len)
            .await
            .then(|| [head, buf[..len].to_vec()].concat())
    };
    let got = tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the gateway answers")
        .unwrap_or_else(|| panic!("{path}: the gateway closed the connection"));
    String::from_utf8_lossy(&got).into_owned()
}
