//! The pair of gateways the paths-agree tests compare, on one rule set and one upstream: the
//! express lane's and hyper's path alone (`--no-express`), each with a kept connection, the
//! upstream that records every request head, and what differed between the two answers.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Answer;
use super::agree::{REQUEST_ID, connect, differences, exchange, normal};
use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http1::SendRequest;
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};
use tollgate_limit::clock::ManualClock;

/// The secret of `k-1`, the key most requests carry.
pub const KEY: &str = "paths-agree-key";
/// The secret of `k-q`, whose key has a daily quota counted in Paris.
pub const QUOTA_KEY: &str = "paths-agree-quota-key";
/// Both gateways' clock, which never moves: no bucket refills during a test. 23:30 in Paris,
/// half an hour before the quota's day ends.
pub const NOW: &str = "2026-12-01T22:30:00Z";

pub fn at(rfc3339: &str) -> u64 {
    rfc3339.parse::<jiff::Timestamp>().unwrap().as_millisecond() as u64 * 1000
}

pub fn sha256(secret: &str) -> String {
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
pub fn rules(up: SocketAddr, dead: u16) -> String {
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
pub struct Upstream {
    pub addr: SocketAddr,
    pub heads: Mutex<Vec<String>>,
    /// How many `hold` requests arrived.
    pub held: watch::Sender<usize>,
    pub release: watch::Sender<bool>,
}

impl Upstream {
    pub async fn start() -> Arc<Upstream> {
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
    pub fn take_heads(&self) -> Vec<String> {
        std::mem::take(&mut *self.heads.lock().unwrap())
    }

    /// Returns once `n` `hold` requests have arrived in all.
    pub async fn wait_held(&self, n: usize) {
        let mut rx = self.held.subscribe();
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|h| *h >= n))
            .await
            .expect("the held request reaches the upstream")
            .unwrap();
    }

    pub fn release(&self) {
        self.release.send_replace(true);
    }
}

pub async fn serve_upstream(mut s: TcpStream, up: Arc<Upstream>) {
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
pub struct Side {
    pub gw: Running,
    pub conn: SendRequest<Empty<Bytes>>,
    pub dir: tempfile::TempDir,
}

impl Side {
    pub async fn start(rules: &str, express: bool, set: &impl Fn(&mut GatewayConfig, &Path)) -> Side {
        let (dir, path) = super::rules_file(rules);
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
pub struct Pair {
    pub up: Arc<Upstream>,
    pub lane: Side,
    pub general: Side,
    pub findings: Vec<String>,
    /// Bound and never listening: connecting to it is refused.
    pub _dead: TcpSocket,
}

impl Pair {
    pub async fn start() -> Pair {
        Pair::start_with(|_, _| {}).await
    }

    /// `set` adjusts each gateway's configuration; its second argument is that gateway's own
    /// directory.
    pub async fn start_with(set: impl Fn(&mut GatewayConfig, &Path)) -> Pair {
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
    pub async fn both(&mut self, method: Method, path: &str, headers: &[(&str, &str)]) -> Answer {
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
    pub fn compare(
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
    pub async fn still_kept(&mut self, after: &str) {
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
    pub async fn hold(&mut self, path: &str) -> [JoinHandle<Answer>; 2] {
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
    pub async fn hold_queued(&mut self) -> Vec<JoinHandle<()>> {
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
    pub async fn release(&mut self, holders: [JoinHandle<Answer>; 2]) {
        self.up.release();
        let [lane, general] = holders;
        let (lane, general) = (lane.await.unwrap(), general.await.unwrap());
        assert_eq!(lane.status, StatusCode::OK, "{:?}", lane.body);
        self.compare("the held request", &lane, &general, &[], &[]);
    }

    /// Fails with every difference found.
    pub fn assert_alike(self) {
        assert!(
            self.findings.is_empty(),
            "the express lane and hyper's path differ:\n{}",
            self.findings.join("\n")
        );
    }
}

pub fn key() -> [(&'static str, &'static str); 1] {
    [("x-api-key", KEY)]
}

pub fn error_of(a: &Answer) -> String {
    a.json()["error"].as_str().unwrap_or("").to_string()
}
