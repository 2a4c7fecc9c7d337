//! The express lane and hyper's general path (`--no-express`) answer alike on an upstream of
//! several targets: a request whose first target refused the connection is retried on the live
//! one with the same answer and its limits charged once, and a target that keeps hanging up is
//! ejected by both and gets no request from either after that. Each scenario runs two gateways
//! on the same rules and the same targets, as `paths_agree.rs` does for one target.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::agree::{REQUEST_ID, connect, differences, exchange, normal};
use common::{Answer, Http};
use http::{Method, StatusCode};
use http_body_util::Empty;
use hyper::client::conn::http1::SendRequest;
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};
use tollgate_limit::clock::ManualClock;

const KEY: &str = "paths-agree-targets-key";

/// A target that answers every request `200` with the path it was asked, and records the heads.
struct Live {
    addr: SocketAddr,
    heads: Mutex<Vec<String>>,
}

impl Live {
    async fn start() -> Arc<Live> {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live = Arc::new(Live {
            addr: l.local_addr().unwrap(),
            heads: Mutex::new(Vec::new()),
        });
        let up = live.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(serve(s, up.clone()));
            }
        });
        live
    }

    fn take_heads(&self) -> Vec<String> {
        std::mem::take(&mut *self.heads.lock().unwrap())
    }
}

/// Reads one bodiless request head from `s`, `None` at the end of the connection.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            buf.drain(..end + 4);
            return Some(head);
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn serve(mut s: TcpStream, up: Arc<Live>) {
    let mut buf = Vec::new();
    while let Some(head) = read_head(&mut s, &mut buf).await {
        up.heads.lock().unwrap().push(head.clone());
        let target = head.split(' ').nth(1).unwrap_or("").to_string();
        let body = format!("{{\"served\":\"{target}\"}}");
        let answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Up: live\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// A target going away: it takes each request and closes without a byte of answer. Counts the
/// requests it took, so the test sees from the target's side whether a gateway still sends.
struct HangsUp {
    addr: SocketAddr,
    taken: Arc<AtomicUsize>,
}

impl HangsUp {
    async fn start() -> HangsUp {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let taken = Arc::new(AtomicUsize::new(0));
        let t = taken.clone();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let t = t.clone();
                tokio::spawn(async move {
                    if read_head(&mut s, &mut Vec::new()).await.is_some() {
                        t.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        HangsUp { addr, taken }
    }

    fn taken(&self) -> usize {
        self.taken.load(Ordering::SeqCst)
    }
}

/// Rules with one upstream, `up`, of `targets` in turn (so which one a request meets first is
/// the same on both gateways), and one route whose key bucket holds `burst` requests.
fn rules(targets: &[SocketAddr], consecutive_failures: u32, burst: u64) -> String {
    serde_json::json!({
        "version": 1,
        "upstreams": {"up": {
            "targets": targets.iter().map(|a| serde_json::json!({"url": format!("http://{a}")})).collect::<Vec<_>>(),
            "balance": "round_robin",
            "eject": {"consecutive_failures": consecutive_failures, "for_ms": 600000},
        }},
        "limits": {"small": {"dimension": "key", "rate": "1/3600s", "burst": burst}},
        "keys": [{"id": "k-1", "sha256": hex::encode(sha2::Sha256::digest(KEY.as_bytes()))}],
        "routes": [{"name": "orders", "method": "*", "path": "/v1/orders", "upstream": "up",
                    "cost": {"small": 1}}]
    })
    .to_string()
}

/// A gateway with its admin listener, and the keep-alive connection the test talks to it on.
struct Side {
    gw: Running,
    conn: SendRequest<Empty<Bytes>>,
    _dir: tempfile::TempDir,
}

impl Side {
    async fn start(rules: &str, express: bool) -> Side {
        let (dir, path) = common::rules_file(rules);
        let mut cfg = GatewayConfig::new(RulesSource::File(path));
        // A clock that stands: no bucket refills during a test.
        cfg.clock = ManualClock::new(1_800_000_000_000_000);
        cfg.limits.express = express;
        cfg.admin_listen = Some("127.0.0.1:0".parse().unwrap());
        let gw = app::start(cfg).await.expect("gateway starts");
        let conn = connect(gw.addr).await;
        Side { gw, conn, _dir: dir }
    }

    fn admin(&self, path: &str) -> String {
        format!("http://{}{path}", self.gw.admin_addr.unwrap())
    }

    /// The state `GET /admin/upstreams` gives `target` of `up`.
    async fn state(&self, http: &Http, target: SocketAddr) -> String {
        let r = http.get(&self.admin("/admin/upstreams"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        let listed = r.json();
        let t = listed["upstreams"]
            .as_array()
            .and_then(|u| u.iter().find(|u| u["name"] == "up"))
            .and_then(|u| u["targets"].as_array())
            .and_then(|t| t.iter().find(|t| t["target"] == target.to_string()))
            .unwrap_or_else(|| panic!("{target} is not in {listed}"))
            .clone();
        t["state"].as_str().unwrap().to_string()
    }

    /// The sum of the scrape's samples of `family` whose labels hold every one of `labels`.
    async fn metric(&self, http: &Http, family: &str, labels: &[&str]) -> f64 {
        let r = http.get(&self.admin("/metrics"), &[]).await;
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .filter(|l| labels.iter().all(|want| l.contains(want)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// The two gateways, what they answered alike or not, and the live target behind both.
struct Pair {
    live: Arc<Live>,
    lane: Side,
    general: Side,
    findings: Vec<String>,
    http: Http,
}

impl Pair {
    async fn start(live: Arc<Live>, rules: &str) -> Pair {
        Pair {
            lane: Side::start(rules, true).await,
            general: Side::start(rules, false).await,
            live,
            findings: Vec::new(),
            http: Http::new(),
        }
    }

    /// One `GET` with the key to each gateway on its kept connection, lane first: the answers
    /// and the heads the live target got for each are compared. Returns the lane's answer.
    async fn get(&mut self, path: &str) -> Answer {
        let key = [("x-api-key", KEY)];
        let lane = exchange(&mut self.lane.conn, &Method::GET, path, &key)
            .await
            .unwrap_or_else(|e| panic!("GET {path} on the lane: {e}"));
        let lane_heads = self.live.take_heads();
        let general = exchange(&mut self.general.conn, &Method::GET, path, &key)
            .await
            .unwrap_or_else(|e| panic!("GET {path} on hyper's path: {e}"));
        let general_heads = self.live.take_heads();
        for d in differences(&lane, &general) {
            self.findings.push(format!("GET {path}: {d}"));
        }
        if normal(&lane_heads) != normal(&general_heads) {
            self.findings.push(format!(
                "GET {path}: the live target got\n  from the lane {lane_heads:?}\n  from hyper's path {general_heads:?}"
            ));
        }
        // A retried request reaches the live target once; a refused one not at all.
        let once = usize::from(lane.status == StatusCode::OK);
        for (side, heads) in [("lane", &lane_heads), ("hyper", &general_heads)] {
            if heads.len() != once {
                self.findings.push(format!(
                    "GET {path}: {side}'s answer {} came with {} requests to the live target",
                    lane.status,
                    heads.len()
                ));
            }
        }
        for (side, a) in [("lane", &lane), ("hyper", &general)] {
            if a.header("x-request-id") != Some(REQUEST_ID) {
                self.findings
                    .push(format!("GET {path}: {side} lost the request id"));
            }
        }
        lane
    }

    fn sides(&self) -> [(&'static str, &Side); 2] {
        [("lane", &self.lane), ("hyper", &self.general)]
    }

    fn assert_alike(self) {
        assert!(
            self.findings.is_empty(),
            "the express lane and hyper's path differ:\n{}",
            self.findings.join("\n")
        );
    }
}

/// What `RateLimit` says is left of the key's bucket.
fn remaining(a: &Answer) -> Option<u64> {
    let v = a.header("ratelimit")?;
    v.split(';')
        .find_map(|p| p.trim().strip_prefix("r=")?.parse().ok())
}

#[tokio::test]
async fn a_request_retried_past_a_refusing_target_answers_alike_and_is_charged_once() {
    let live = Live::start().await;
    // Bound and never listening: every connection to it is refused.
    let refusing = TcpSocket::new_v4().unwrap();
    refusing.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let refusing = refusing.local_addr().unwrap();
    // Never ejected here: every other request meets the refusing target first.
    const BURST: u64 = 4;
    let rules = rules(&[refusing, live.addr], 1000, BURST);
    let mut p = Pair::start(live, &rules).await;
    for n in 1..=BURST {
        let a = p.get(&format!("/v1/orders/{n}")).await;
        assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
        assert_eq!(a.header("x-up"), Some("live"));
        assert_eq!(a.json()["served"], format!("/v1/orders/{n}"));
        // A retry that charged again would leave less than one token fewer a request.
        assert_eq!(remaining(&a), Some(BURST - n), "request {n}");
    }
    // The bucket is spent by exactly one charge a request, on both paths alike.
    let a = p.get("/v1/orders/last").await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    for (side, s) in p.sides() {
        // Every other request met the refusing target first and went on to the live one.
        let retried = s
            .metric(
                &p.http,
                "tollgate_upstream_retries_total",
                &["reason=\"connect_failure\""],
            )
            .await;
        assert_eq!(retried, (BURST / 2) as f64, "{side}: retries");
        let refused = s
            .metric(
                &p.http,
                "tollgate_upstream_requests_total",
                &[&format!("target=\"{refusing}\""), "outcome=\"connect_failure\""],
            )
            .await;
        assert_eq!(
            refused,
            (BURST / 2) as f64,
            "{side}: attempts on the refusing target"
        );
        assert_eq!(s.state(&p.http, refusing).await, "up", "{side}");
    }
    p.assert_alike();
}

#[tokio::test]
async fn an_ejected_target_gets_nothing_more_from_either_path() {
    let live = Live::start().await;
    let dying = HangsUp::start().await;
    let rules = rules(&[dying.addr, live.addr], 2, 100);
    let mut p = Pair::start(live, &rules).await;
    // In turn, every other request meets the dying target first; its second failure ejects it.
    for n in 1..=4 {
        let a = p.get(&format!("/v1/orders/{n}")).await;
        assert_eq!(a.status, StatusCode::OK, "request {n}: {:?}", a.body);
        assert_eq!(a.header("x-up"), Some("live"));
    }
    assert_eq!(dying.taken(), 4, "two requests from each gateway");
    for (side, s) in p.sides() {
        assert_eq!(s.state(&p.http, dying.addr).await, "ejected", "{side}");
        assert_eq!(s.state(&p.http, p.live.addr).await, "up", "{side}");
        let ejections = s
            .metric(
                &p.http,
                "tollgate_upstream_ejections_total",
                &[&format!("target=\"{}\"", dying.addr)],
            )
            .await;
        assert_eq!(ejections, 1.0, "{side}");
    }
    // Out now: every request goes to the live target alone, on both paths.
    for n in 5..=8 {
        let a = p.get(&format!("/v1/orders/{n}")).await;
        assert_eq!(a.status, StatusCode::OK, "request {n}: {:?}", a.body);
    }
    assert_eq!(dying.taken(), 4, "the ejected target took requests");
    for (side, s) in p.sides() {
        assert_eq!(s.state(&p.http, dying.addr).await, "ejected", "{side}");
    }
    p.assert_alike();
}
