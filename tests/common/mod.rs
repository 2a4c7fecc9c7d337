//! Test fixtures: the demo rules, in-process gateways and their demo upstream, a pooled HTTP
//! client, free ports and seeds. Gateway processes, real Redis, raw reads, stores and the
//! fixtures of one group of tests are the modules below. Every fixture stops what it started
//! when dropped.
#![allow(dead_code)]

pub mod agree;
pub mod bench;
pub mod cdp;
pub mod cli;
pub mod health;
pub mod instances;
pub mod meter;
pub mod pair;
pub mod processes;
pub mod raw;
pub mod redis;
pub mod redis_tls;
pub mod regions;
pub mod relay;
pub mod replay;
pub mod sentinel;
pub mod store;
pub mod tls;

// Where the tests and the benches (which include this module by path) have always named them;
// a binary that uses none of them would otherwise warn of each.
#[allow(unused_imports)]
pub use processes::{DemoUpstreamProc, Tollgate, cpu_secs, gateway_bin, rss_kib, serve_and_exit};
#[allow(unused_imports)]
pub use raw::read_framed;
#[allow(unused_imports)]
pub use redis::{RedisCluster, RedisServer};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};
use tollgate_limit::clock::{Clock, ManualClock};

pub const K7: &str = "k7-demo-key";
pub const K8: &str = "k8-demo-key";
pub const KBIG: &str = "kbig-demo-key";
pub const DEMO_KEYS: [&str; 3] = [K7, K8, KBIG];

/// rules/demo.json with its JWKS named by absolute path, so a copy loads from any directory.
pub fn demo_json() -> String {
    let text = std::fs::read_to_string(repo().join("rules/demo.json")).expect("rules/demo.json");
    let jwks = repo().join("rules/demo-jwks.json");
    let jwks = serde_json::to_string(jwks.to_str().expect("a UTF-8 path")).unwrap();
    assert!(
        text.contains("\"demo-jwks.json\""),
        "the demo rules name demo-jwks.json"
    );
    text.replace("\"demo-jwks.json\"", &jwks)
}

/// The demo rules with every upstream pointed at `upstream`.
pub fn demo_rules_for(upstream: SocketAddr) -> String {
    let text = demo_json();
    text.replace("http://127.0.0.1:8081", &format!("http://{upstream}"))
}

/// The demo rules pointed at `upstream`, with a daily quota of `limit` on k-7, counted in Paris.
pub fn demo_rules_with_k7_quota(upstream: SocketAddr, limit: u64) -> String {
    let mut rules: serde_json::Value = serde_json::from_str(&demo_rules_for(upstream)).unwrap();
    let k7 = rules["keys"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|k| k["id"] == "k-7")
        .unwrap();
    k7["quota"] = serde_json::json!({"per": "day", "limit": limit, "timezone": "Europe/Paris"});
    rules.to_string()
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Writes `text` to a fresh temporary file and returns the directory and path.
pub fn rules_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rules.json");
    std::fs::write(&path, text).expect("write rules");
    (dir, path)
}

/// A gateway in this process on 127.0.0.1:0, on the embedded store with the given clock.
pub async fn start_gateway(rules: &str, clock: Arc<dyn Clock>) -> (Running, tempfile::TempDir) {
    let (dir, path) = rules_file(rules);
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.clock = clock;
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let running = app::start(cfg).await.expect("gateway starts");
    (running, dir)
}

/// The configuration of a gateway in this process on `clock`, which its store reads too (a
/// redis-server through `--clock gateway`), on the express lane or on hyper's path alone, with
/// a store timeout a loaded machine keeps: these tests are about what the store decides.
pub fn manual_config(
    rules: &str,
    store: tollgate_gateway::config::StoreUrl,
    express: bool,
    clock: Arc<ManualClock>,
) -> (GatewayConfig, tempfile::TempDir) {
    let (dir, path) = rules_file(rules);
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.store = store;
    cfg.clock = clock;
    cfg.clock_source = tollgate_gateway::config::ClockSource::Gateway;
    cfg.store_timeout = Duration::from_secs(1);
    cfg.limits.express = express;
    (cfg, dir)
}

/// A gateway in this process on [`manual_config`], started: the tests of the queue, of
/// post-paid debits and of blocks each run one a case.
pub async fn start_manual(
    rules: &str,
    store: tollgate_gateway::config::StoreUrl,
    express: bool,
    clock: Arc<ManualClock>,
) -> (Running, tempfile::TempDir) {
    let (cfg, dir) = manual_config(rules, store, express, clock);
    let running = tollgate_gateway::app::start(cfg).await.expect("gateway starts");
    (running, dir)
}

/// A gateway in this process on 127.0.0.1:0 with an admin listener, on the given store.
pub async fn start_gateway_on(
    rules: &str,
    store: tollgate_gateway::config::StoreUrl,
) -> (Running, tempfile::TempDir) {
    let (dir, path) = rules_file(rules);
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.store = store;
    // These tests are about what the store decides, not about its timeout: on a loaded
    // 2-core machine a 3 ms budget would let the failure policy decide now and then.
    cfg.store_timeout = Duration::from_secs(1);
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let running = app::start(cfg)
        .await
        .unwrap_or_else(|e| panic!("gateway starts: {e}"));
    (running, dir)
}

/// The demo upstream in this process on a free port.
pub async fn start_demo_upstream() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(tollgate_gateway::server::run(
        l,
        None,
        Arc::new(tollgate_gateway::demo::DemoUpstream::default()),
        tollgate_gateway::server::ServerLimits::default(),
        std::future::pending::<()>(),
    ));
    addr
}

/// A demo gateway on a manual clock in this process, with its own demo upstream.
pub async fn demo_gateway() -> (Running, Arc<ManualClock>, tempfile::TempDir) {
    let upstream = start_demo_upstream().await;
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (running, dir) = start_gateway(&demo_rules_for(upstream), clock.clone()).await;
    (running, clock, dir)
}

/// An answer, read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// The body as text, for a test's messages.
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A plain HTTP/1.1 client with a connection pool.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Http::new()
    }
}

impl Http {
    pub fn new() -> Http {
        Http {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: &'static [u8],
    ) -> Answer {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = self
            .client
            .request(req.body(Full::new(Bytes::from_static(body))).unwrap())
            .await
            .unwrap_or_else(|e| panic!("request to {url} failed: {e}"));
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("response body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// [`Http::send`] that returns a failed exchange (refused, reset) instead of panicking.
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
    ) -> Result<Answer, String> {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = self
            .client
            .request(req.body(Full::new(Bytes::new())).unwrap())
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| format!("{url}: body: {e}"))?;
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.to_bytes(),
        })
    }

    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Answer {
        self.send(Method::GET, url, headers, b"").await
    }
}

/// Finds a binary on PATH or fails the test with a message that says how to get it.
pub fn require_binary(name: &str) -> PathBuf {
    tollgate_testkit::find_binary(name).unwrap_or_else(|| {
        panic!(
            "{name} is not installed: this test needs a real {name}. Run tests/run.sh, which installs it with apt-get."
        )
    })
}

/// A free TCP port on loopback (bind :0, read, release).
pub fn free_port() -> u16 {
    tollgate_testkit::free_port().expect("a free loopback port")
}

/// The seed of a randomized equivalence run: `TOLLGATE_EQ_SEED` replays one, else a new one.
/// The caller prints it, so a failure can be replayed.
pub fn eq_seed() -> u64 {
    use rand::Rng;
    match std::env::var("TOLLGATE_EQ_SEED") {
        Ok(s) => s.parse().expect("TOLLGATE_EQ_SEED must be a number"),
        Err(_) => rand::rng().random(),
    }
}
