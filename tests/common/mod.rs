//! Test fixtures: in-process gateways, mock upstreams, gateway processes, and a real
//! `redis-server` on a free port. Every fixture stops what it started when dropped.
#![allow(dead_code)]

pub mod agree;
pub mod bench;
pub mod cdp;
pub mod cli;
pub mod health;
pub mod instances;
pub mod meter;
pub mod pair;
pub mod raw;
pub mod regions;
pub mod relay;
pub mod replay;
pub mod store;
pub mod tls;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// A real `redis-server` on a free loopback port, with no persistence; killed on drop.
pub struct RedisServer {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts redis-server on `port` and waits until it listens; `None` if it exits or
    /// doesn't listen within 5 s (another process may have taken the port).
    fn try_start(
        port: u16,
        dir: tempfile::TempDir,
        extra: &[String],
    ) -> Result<RedisServer, tempfile::TempDir> {
        let mut child = Command::new(require_binary("redis-server"))
            .args(tollgate_testkit::redis_server_args(port, dir.path()))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(RedisServer {
                    port,
                    child,
                    _dir: dir,
                });
            }
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(dir)
    }

    /// A server on a given port (one a test reserved and left free on purpose).
    pub fn start_on(port: u16) -> RedisServer {
        RedisServer::try_start(port, tempfile::tempdir().unwrap(), &[])
            .unwrap_or_else(|_| panic!("redis-server did not start on port {port}"))
    }

    pub fn start_with(extra: &[&str]) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        RedisServer::start_with_fn(|| extra.clone())
    }

    /// Like `start_with`, with arguments made afresh for each attempt (a new free port each).
    pub fn start_with_fn(extra: impl Fn() -> Vec<String>) -> RedisServer {
        let mut dir = tempfile::tempdir().unwrap();
        for _ in 0..5 {
            match RedisServer::try_start(free_port(), dir, &extra()) {
                Ok(server) => return server,
                Err(d) => dir = d,
            }
        }
        panic!("redis-server did not start on a free port");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the server with SIGKILL, as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(require_binary("redis-cli"))
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Runs a hash command on the bucket `key` where the store keeps it, its field of its page
    /// (`lua/bucket.lua`): `bucket("HEXISTS", key)`, `bucket("HGET", key)`, `bucket("HSTRLEN",
    /// key)`, or `bucket_with("HSET", key, &[value])`.
    pub fn bucket(&self, command: &str, key: &str) -> String {
        self.bucket_with(command, key, &[])
    }

    /// The names of every bucket the store holds whose name starts with `prefix`, sorted: the
    /// fields of every page.
    pub fn bucket_names(&self, prefix: &str) -> Vec<String> {
        let mut names: Vec<String> = self
            .cli(&["--scan", "--pattern", "rl:page:*"])
            .lines()
            .filter(|p| !p.is_empty())
            .flat_map(|page| {
                self.cli(&["HKEYS", page])
                    .lines()
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.sort();
        names
    }

    pub fn bucket_with(&self, command: &str, key: &str, rest: &[&str]) -> String {
        let page = tollgate_store::page::page_of(key);
        let mut args = vec![command, page.as_str(), key];
        args.extend_from_slice(rest);
        self.cli(&args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Redis Cluster of three masters (and, from [`RedisCluster::with_replicas`], a replica of
/// each), each a `RedisServer` on free ports (client and bus); stopped on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three masters, no replicas, a node timeout of 5 s.
    pub fn start() -> RedisCluster {
        RedisCluster::start_as(0, 5_000, &[])
    }

    /// Three masters and one replica each, failing over after `node_timeout_ms` of silence.
    /// `cluster-require-full-coverage no`: while one master is down and not yet replaced, the
    /// other masters keep serving their slots rather than the whole cluster refusing.
    pub fn with_replicas(node_timeout_ms: u32) -> RedisCluster {
        RedisCluster::start_as(1, node_timeout_ms, &["--cluster-require-full-coverage", "no"])
    }

    /// `masters` masters and no replicas, a node timeout of 5 s: the slots split evenly.
    pub fn with_masters(masters: usize) -> RedisCluster {
        RedisCluster::start_n(masters, 0, 5_000, &[])
    }

    fn start_as(replicas: usize, node_timeout_ms: u32, extra: &[&str]) -> RedisCluster {
        RedisCluster::start_n(3, replicas, node_timeout_ms, extra)
    }

    fn start_n(masters: usize, replicas: usize, node_timeout_ms: u32, extra: &[&str]) -> RedisCluster {
        let count = masters * (1 + replicas);
        let nodes: Vec<RedisServer> = (0..count)
            .map(|_| {
                RedisServer::start_with_fn(|| {
                    let mut args = [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        &node_timeout_ms.to_string(),
                        "--cluster-port",
                        &free_port().to_string(),
                    ]
                    .map(String::from)
                    .to_vec();
                    args.extend(extra.iter().map(|s| s.to_string()));
                    args
                })
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        if count == 1 {
            // `redis-cli --cluster create` wants three masters; one node takes every slot itself.
            let added = nodes[0].cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]);
            assert_eq!(added, "OK", "CLUSTER ADDSLOTSRANGE on a one-node cluster");
        } else {
            let out = Command::new(require_binary("redis-cli"))
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
                .output()
                .expect("redis-cli --cluster create runs");
            assert!(
                out.status.success(),
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let cluster = RedisCluster { nodes };
        let known = format!("cluster_known_nodes:{count}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = cluster.nodes.iter().all(|n| {
                let info = n.cli(&["CLUSTER", "INFO"]);
                let synced = n.cli(&["ROLE"]).starts_with("master")
                    || n.cli(&["INFO", "replication"]).contains("master_link_status:up");
                info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && info.contains(&known)
                    && synced
            });
            if ready {
                return cluster;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster of {count} nodes did not become ready in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis-cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        format!("redis-cluster://{}", self.node_list().join(","))
    }

    pub fn node_list(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect()
    }

    /// Runs `redis-cli -c` (following redirections) against the first node.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(require_binary("redis-cli"))
            .args(["-c", "-p", &self.nodes[0].port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

/// The gateway binary spawned as `Tollgate`: this build's, or the one `TOLLGATE_BIN` names, so a
/// bench can measure another commit's build beside this one in one run (benches/README.md).
pub fn gateway_bin() -> std::ffi::OsString {
    std::env::var_os("TOLLGATE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_tollgate").into())
}

/// Runs `tollgate serve --rules <rules>` expecting it to exit; returns (success, stderr).
pub fn serve_and_exit(rules: &str, args: &[&str]) -> (bool, String) {
    let (dir, rules) = rules_file(rules);
    let meter_file = dir.path().join("usage.db");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "serve",
            "--rules",
            rules.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--meter-file",
            meter_file.to_str().unwrap(),
        ])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            return (status.success(), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tollgate {args:?} was expected to exit but still runs after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls every future once, so each check is queued in the order given, without waiting.
pub async fn queue_all(futures: &mut [std::pin::Pin<Box<tollgate_store::CheckFuture<'_>>>]) {
    use std::future::Future;
    std::future::poll_fn(|cx| {
        for f in futures.iter_mut() {
            assert!(
                f.as_mut().poll(cx).is_pending(),
                "a check finished on its first poll, before it could queue"
            );
        }
        std::task::Poll::Ready(())
    })
    .await;
}

/// A `tollgate` process; killed on drop unless it already exited.
pub struct Tollgate {
    pub child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    pub stderr_path: PathBuf,
    /// Every line it printed on stdout so far.
    stdout: Arc<std::sync::Mutex<Vec<String>>>,
    drain: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Tollgate {
    /// Starts `tollgate <args>` with `--listen 127.0.0.1:0` and waits for its address.
    pub fn spawn(args: &[&str]) -> Tollgate {
        Tollgate::spawn_with_env(args, &[])
    }

    /// [`Tollgate::spawn`] with extra environment variables (`TOLLGATE_LOG`, say).
    pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Tollgate {
        Tollgate::spawn_with_stderr(args, env, None)
    }

    /// [`Tollgate::spawn_with_env`] with stderr sent to `stderr` (a pipe the test takes from
    /// `child.stderr`, say) instead of the file [`Tollgate::stderr`] reads.
    pub fn spawn_with_stderr(args: &[&str], env: &[(&str, &str)], stderr: Option<Stdio>) -> Tollgate {
        let dir = tempfile::tempdir().unwrap();
        let stderr_path = dir.path().join("stderr.log");
        let file = std::fs::File::create(&stderr_path).unwrap();
        let stderr = stderr.unwrap_or_else(|| file.into());
        // Usage records of the embedded store go to the test's own directory.
        let meter_file = dir.path().join("usage.db");
        let meter_args: Vec<&str> = if args.contains(&"--meter-file") {
            vec![]
        } else {
            vec!["--meter-file", meter_file.to_str().unwrap()]
        };
        let mut child = Command::new(gateway_bin())
            .args(args)
            .args(meter_args)
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            // A test that counts what a bucket admits needs the store's answer: 3 ms is meant for
            // a store that answers in 1 ms, not for a debug gateway and Redis on two loaded
            // cores, where a timed-out check goes to the limit's failure policy (fail open
            // admits). A flag or the test's own environment still wins.
            .env("TOLLGATE_STORE_TIMEOUT", "1s")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn tollgate");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let mut admin = None;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        for line in lines.by_ref() {
            let line = line.unwrap_or_default();
            seen.lock().unwrap().push(line.clone());
            // With --log-format json the startup lines are events with the address as a field.
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                let a = v["addr"].as_str().and_then(|a| a.parse::<SocketAddr>().ok());
                match v["message"].as_str() {
                    Some("tollgate listening") => addr = a,
                    Some("admin listening") => admin = a,
                    _ => {}
                }
            } else if let Some(rest) = line.split("listening on http").nth(1) {
                let a = rest.trim_start_matches('s').trim_start_matches("://");
                let a = a.split_whitespace().next().unwrap_or("");
                let a: SocketAddr = a.parse().unwrap_or_else(|_| panic!("bad address in {line:?}"));
                if line.starts_with("admin") {
                    admin = Some(a);
                } else {
                    addr = Some(a);
                }
            }
            if addr.is_some() && admin.is_some() {
                break;
            }
        }
        // Keep draining stdout so the process never blocks on a full pipe.
        let keep = seen.clone();
        let drain = std::thread::spawn(move || {
            for line in lines {
                keep.lock().unwrap().push(line.unwrap_or_default());
            }
        });
        let Some(addr) = addr else {
            let _ = child.kill();
            let err = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            panic!("tollgate did not start: {err}");
        };
        Tollgate {
            child,
            addr,
            admin,
            stderr_path,
            stdout: seen,
            drain: Some(drain),
            _dir: dir,
        }
    }

    /// Stops the process with SIGTERM and returns everything it printed on stdout and stderr.
    pub fn stop(&mut self) -> (String, String) {
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "tollgate still runs 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(d) = self.drain.take() {
            d.join().unwrap();
        }
        (self.stdout.lock().unwrap().join("\n"), self.stderr())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin.expect("admin listener"), path)
    }

    /// Stderr once `seen` holds for it, for up to 10 s: access lines are written by a thread
    /// of their own, a moment after their request is answered. Returns it either way.
    pub async fn stderr_when(&self, seen: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.stderr();
            if seen(&log) || Instant::now() > deadline {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends a signal with `kill`.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// Peak resident memory of the process in KiB (VmHWM).
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `tollgate demo-upstream` process with a pool of workers; killed on drop.
pub struct DemoUpstreamProc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl DemoUpstreamProc {
    /// `tollgate demo-upstream --workers <workers> --latency-ms <latency_ms>` on a free port.
    pub fn spawn(workers: u32, latency_ms: u64) -> DemoUpstreamProc {
        DemoUpstreamProc::spawn_with(&[
            "--listen",
            "127.0.0.1:0",
            "--workers",
            &workers.to_string(),
            "--latency-ms",
            &latency_ms.to_string(),
        ])
    }

    /// `tollgate demo-upstream <args>`, once it says where it listens.
    pub fn spawn_with(args: &[&str]) -> DemoUpstreamProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("demo-upstream")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tollgate demo-upstream");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let addr = lines.by_ref().find_map(|l| {
            let l = l.ok()?;
            l.strip_prefix("demo upstream listening on http://")?
                .trim()
                .parse()
                .ok()
        });
        std::thread::spawn(move || for _ in lines {});
        let Some(addr) = addr else {
            let _ = child.kill();
            panic!("tollgate demo-upstream did not start");
        };
        DemoUpstreamProc { child, addr }
    }
}

impl Drop for DemoUpstreamProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one response with a `Content-Length` body from `tcp` into `buf` (cleared first): its
/// status and where its body lies in `buf`. For benches that drive raw connections and count
/// errors rather than fail on them.
pub async fn read_framed<S: tokio::io::AsyncRead + Unpin + ?Sized>(
    tcp: &mut S,
    buf: &mut Vec<u8>,
) -> std::io::Result<(u16, std::ops::Range<usize>)> {
    use tokio::io::AsyncReadExt;
    buf.clear();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(buf) {
            let body: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok()?.parse().ok())
                .ok_or_else(|| std::io::Error::other("a response without Content-Length"))?;
            if buf.len() >= len + body {
                return Ok((resp.code.unwrap_or(0), len..len + body));
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tcp.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Resident memory of process `pid` in KiB (`VmRSS`), 0 once it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds (user + system) process `pid` has used, from /proc; 0 once it is gone.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    // utime and stime, in USER_HZ (100 on Linux).
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

/// Reads one response with a `Content-Length` body from `tcp`, waiting at most `within` for each
/// read; its status. For tests that hold raw keep-alive connections.
pub async fn read_status(tcp: &mut tokio::net::TcpStream, within: Duration) -> u16 {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(&buf) {
            let body: usize = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .map(|h| std::str::from_utf8(h.value).unwrap().parse().unwrap())
                .expect("a content-length");
            if buf.len() >= len + body {
                return resp.code.unwrap();
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(within, tcp.read(&mut chunk))
            .await
            .expect("the gateway answers")
            .expect("read a response");
        assert!(n > 0, "the gateway closed a connection mid-request");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A bucket as the Redis scripts keep it, for the models the equivalence tests hold them to:
/// its state and its field's expiry in the call's clock (`lua/bucket.lua`). A field past its
/// expiry reads as missing, a full bucket, whatever rule reads it.
#[derive(Clone, Copy, Debug)]
pub struct Stored {
    pub state: tollgate_limit::bucket::BucketState,
    pub expires_us: u64,
}

impl Stored {
    /// `state` written at `now` under `p`: expiring `b/r` plus a second after its ts, which is
    /// later than now for a bucket in debt.
    pub fn written(
        p: &tollgate_limit::bucket::BucketParams,
        state: tollgate_limit::bucket::BucketState,
        now: u64,
    ) -> Stored {
        let mut px = p.ttl_ms();
        if state.ts > now {
            px += (state.ts - now).div_ceil(1_000);
        }
        Stored {
            state,
            expires_us: now + px * 1_000,
        }
    }

    /// What a script reads at `now`.
    pub fn read(stored: Option<&Stored>, now: u64) -> Option<tollgate_limit::bucket::BucketState> {
        stored.filter(|s| s.expires_us >= now).map(|s| s.state)
    }
}
