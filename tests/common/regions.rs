//! Three Regions sharing one limit, live, for the tests that watch them: a redis-server and an
//! outside health check per Region and their gateway processes, the stores' shares sampled
//! every 50 ms, paced load per Region, and each gateway's view of the Regions
//! (`GET /admin/regions`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::health::HealthServer;
use super::{Http, KBIG, RedisServer, Tollgate};

/// The limit the three Regions share, per second (the rules below).
pub const L: f64 = 300.0;
pub const INTERVAL: Duration = Duration::from_millis(400);
pub const LEASE: Duration = Duration::from_millis(1200);
/// The one global slot: limit `plan` of key `k-big`.
pub const SLOT: &str = "plan/k-big";
pub const NAMES: [&str; 3] = ["A", "B", "C"];
/// Room for the rounding of shares that add up to exactly the limit.
pub const EPS: f64 = 1e-6;

pub fn rules(upstream: SocketAddr) -> String {
    serde_json::json!({
        "version": 1,
        "upstreams": {"orders": {"url": format!("http://{upstream}")}},
        "limits": {"plan": {"dimension": "key", "scope": "global"}},
        "keys": [{
            "id": "k-big",
            "tenant": "kbig",
            "sha256": "3192d083bcbdda7385b5570eb52766ded7d5cbb554f1104918ddc5b2250cca03",
            "limits": {"plan": {"rate": "300/1s", "burst": 600}}
        }],
        "routes": [{"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "orders", "cost": {"plan": 1}}]
    })
    .to_string()
}

pub fn index(name: &str) -> usize {
    NAMES.iter().position(|n| *n == name).expect("a Region name")
}

// ---------------------------------------------------------------------------------------------
// The three Regions: a store and an outside health check each, and their gateways.

pub struct Region {
    pub name: &'static str,
    /// `None` once the test killed it.
    pub redis: Option<RedisServer>,
    pub port: u16,
    pub health: HealthServer,
}

pub struct World {
    pub _rules_dir: tempfile::TempDir,
    pub rules: PathBuf,
    pub regions: Vec<Region>,
}

impl World {
    pub async fn start() -> World {
        let upstream = super::start_demo_upstream().await;
        let (rules_dir, rules) = super::rules_file(&rules(upstream));
        let mut regions = Vec::new();
        for name in NAMES {
            let redis = RedisServer::start();
            regions.push(Region {
                name,
                port: redis.port,
                redis: Some(redis),
                health: HealthServer::start().await,
            });
        }
        World {
            _rules_dir: rules_dir,
            rules,
            regions,
        }
    }

    pub fn region(&self, name: &str) -> &Region {
        &self.regions[index(name)]
    }

    /// `A=redis://…,B=…,C=…`; `via` replaces a Region's store address (a relay).
    pub fn regions_arg(&self, via: &[(&str, SocketAddr)]) -> String {
        self.regions
            .iter()
            .map(|r| {
                let addr = via
                    .iter()
                    .find(|(n, _)| *n == r.name)
                    .map(|(_, a)| *a)
                    .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], r.port)));
                format!("{}=redis://{addr}", r.name)
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The health URLs of the Regions other than `own`.
    pub fn health_arg(&self, own: &str) -> String {
        self.regions
            .iter()
            .filter(|r| r.name != own)
            .map(|r| format!("{}={}", r.name, r.health.url()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A gateway of Region `region`, reaching the stores through `via` where given.
    pub async fn gateway(&self, region: &str, instance: &str, via: &[(&str, SocketAddr)]) -> Tollgate {
        let args: Vec<String> = [
            "serve",
            "--rules",
            self.rules.to_str().unwrap(),
            "--region",
            region,
            "--regions",
            &self.regions_arg(via),
            "--region-health",
            &self.health_arg(region),
            "--rebalance-interval",
            "400ms",
            "--region-lease",
            "1200ms",
            "--instance",
            instance,
            // What these tests watch is the shares, not the store's timeout: on a loaded
            // 2-core machine the default 3 ms would let the failure policy decide now and then.
            "--store-timeout",
            "200ms",
        ]
        .map(String::from)
        .to_vec();
        // Spawning waits for the process to print its addresses; off the runtime's threads,
        // so the relays and health servers it may reach meanwhile keep answering.
        tokio::task::spawn_blocking(move || {
            Tollgate::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .await
        .unwrap()
    }

    pub fn ports(&self) -> [u16; 3] {
        [self.regions[0].port, self.regions[1].port, self.regions[2].port]
    }
}

// ---------------------------------------------------------------------------------------------
// Reading a store: a few RESP commands over one connection, without a Redis client crate.

pub struct StoreConn {
    pub port: u16,
    pub conn: Option<BufReader<TcpStream>>,
}

impl StoreConn {
    pub fn new(port: u16) -> StoreConn {
        StoreConn { port, conn: None }
    }

    /// A bulk-string reply, `None` for nil or when the store does not answer within 500 ms
    /// (the connection is then dropped and made again next time).
    pub async fn command(&mut self, args: &[&str]) -> Option<String> {
        match tokio::time::timeout(Duration::from_millis(500), self.try_command(args)).await {
            Ok(Ok(v)) => v,
            _ => {
                self.conn = None;
                None
            }
        }
    }

    pub async fn try_command(&mut self, args: &[&str]) -> std::io::Result<Option<String>> {
        if self.conn.is_none() {
            let s = TcpStream::connect(("127.0.0.1", self.port)).await?;
            s.set_nodelay(true)?;
            self.conn = Some(BufReader::new(s));
        }
        let c = self.conn.as_mut().unwrap();
        let mut cmd = format!("*{}\r\n", args.len());
        for a in args {
            cmd.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        c.get_mut().write_all(cmd.as_bytes()).await?;
        let mut line = String::new();
        c.read_line(&mut line).await?;
        let bad = || std::io::Error::other(format!("unexpected reply {line:?}"));
        match line.as_bytes().first() {
            Some(b'$') => {
                let n: i64 = line[1..].trim().parse().map_err(|_| bad())?;
                if n < 0 {
                    return Ok(None);
                }
                let mut buf = vec![0; n as usize + 2];
                c.read_exact(&mut buf).await?;
                buf.truncate(n as usize);
                Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
            }
            Some(b'+') | Some(b':') => Ok(Some(line[1..].trim().to_string())),
            _ => Err(bad()),
        }
    }

    /// The share this Region's gateways enforce, as its agent wrote it.
    pub async fn share(&mut self) -> Option<f64> {
        let text = self.command(&["HGET", "tollgate:regions:shares", SLOT]).await?;
        Some(
            text.trim()
                .parse()
                .unwrap_or_else(|_| panic!("share of {SLOT} is not a number: {text:?}")),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Sampling the three enforced shares every 50 ms, for as long as a test runs.

#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub at: Instant,
    /// A, B, C; `None` when a store has no share or does not answer.
    pub shares: [Option<f64>; 3],
}

impl Sample {
    pub fn sum(&self, which: &[usize]) -> f64 {
        which.iter().filter_map(|&i| self.shares[i]).sum()
    }
}

pub struct Sampler {
    pub samples: Arc<Mutex<Vec<Sample>>>,
    pub stop: watch::Sender<bool>,
    pub task: JoinHandle<()>,
}

impl Sampler {
    pub fn start(ports: [u16; 3]) -> Sampler {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (stop, mut stopped) = watch::channel(false);
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let mut conns = ports.map(StoreConn::new);
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => return,
                }
                // All three at once, so a sum is of shares at (nearly) one moment: read one
                // after another, a store read late could already hold room granted by a store
                // read early.
                let [a, b, c] = &mut conns;
                let (sa, sb, sc) = tokio::join!(a.share(), b.share(), c.share());
                out.lock().unwrap().push(Sample {
                    at: Instant::now(),
                    shares: [sa, sb, sc],
                });
            }
        });
        Sampler { samples, stop, task }
    }

    pub fn all(&self) -> Vec<Sample> {
        self.samples.lock().unwrap().clone()
    }

    pub fn between(&self, from: Instant, to: Instant) -> Vec<Sample> {
        self.all()
            .into_iter()
            .filter(|s| s.at >= from && s.at <= to)
            .collect()
    }

    pub fn last(&self) -> Option<Sample> {
        self.samples.lock().unwrap().last().copied()
    }

    /// The newest share of Region `i`, waiting for the first sample if need be.
    pub async fn latest(&self, i: usize) -> Option<f64> {
        for _ in 0..40 {
            if let Some(s) = self.last() {
                return s.shares[i];
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    pub async fn stop(self) -> Vec<Sample> {
        self.stop.send_replace(true);
        let _ = self.task.await;
        self.samples.lock().unwrap().clone()
    }
}

/// Fails on the first sample where the shares of `which` add up past the limit.
pub fn assert_sum_within_limit(samples: &[Sample], which: &[usize], what: &str) {
    let names: Vec<&str> = which.iter().map(|&i| NAMES[i]).collect();
    for (n, s) in samples.iter().enumerate() {
        assert!(
            s.sum(which) <= L + EPS,
            "{what}: the shares of {names:?} add up to {} > {L} at sample {n}: {:?}; around it: {:?}",
            s.sum(which),
            s.shares,
            &samples[n.saturating_sub(3)..(n + 3).min(samples.len())]
                .iter()
                .map(|s| s.shares)
                .collect::<Vec<_>>()
        );
    }
}

/// The mean share of Region `i` over a window.
pub fn mean_share(samples: &[Sample], i: usize, from: Instant, to: Instant) -> f64 {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.at >= from && s.at <= to)
        .filter_map(|s| s.shares[i])
        .collect();
    assert!(!v.is_empty(), "no share of {} sampled in the window", NAMES[i]);
    v.iter().sum::<f64>() / v.len() as f64
}

pub fn max_sum(samples: &[Sample], which: &[usize]) -> f64 {
    samples.iter().map(|s| s.sum(which)).fold(0.0, f64::max)
}

// ---------------------------------------------------------------------------------------------
// Paced load: one task per Region, sending k-big's requests at a set rate.

/// Most requests a sender keeps in flight; past it a tick is skipped rather than queued, so a
/// slow gateway lowers the rate sent instead of piling up tasks.
pub const IN_FLIGHT: usize = 32;

pub struct Sender {
    pub name: &'static str,
    pub url: String,
    pub rate: Arc<AtomicU32>,
    /// (when sent, status): 0 when the request failed outright.
    pub log: Arc<Mutex<Vec<(Instant, u16)>>>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub ok: u64,
    pub limited: u64,
    pub other: u64,
}

impl Counts {
    pub fn sent(&self) -> u64 {
        self.ok + self.limited + self.other
    }
}

pub struct Load {
    pub senders: Vec<Sender>,
    pub stop: watch::Sender<bool>,
    pub tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// One sender per Region, each to the given gateway's public URL, at rate 0.
    pub fn start(targets: [(&'static str, &Tollgate); 3]) -> Load {
        let (stop, _) = watch::channel(false);
        let mut senders = Vec::new();
        let mut tasks = Vec::new();
        for (name, gw) in targets {
            let s = Sender {
                name,
                url: gw.url("/v1/orders"),
                rate: Arc::new(AtomicU32::new(0)),
                log: Arc::new(Mutex::new(Vec::new())),
            };
            tasks.push(tokio::spawn(pace(
                s.url.clone(),
                s.rate.clone(),
                s.log.clone(),
                stop.subscribe(),
            )));
            senders.push(s);
        }
        Load { senders, stop, tasks }
    }

    pub fn sender(&self, name: &str) -> &Sender {
        self.senders.iter().find(|s| s.name == name).unwrap()
    }

    /// Requests per second to Region `name`'s gateway.
    pub fn set(&self, name: &str, rate: u32) {
        self.sender(name).rate.store(rate, Ordering::SeqCst);
    }

    pub fn set_all(&self, rates: [u32; 3]) {
        for (name, r) in NAMES.iter().zip(rates) {
            self.set(name, r);
        }
    }

    pub fn counts(&self, name: &str, from: Instant, to: Instant) -> Counts {
        let mut c = Counts::default();
        for &(at, status) in self.sender(name).log.lock().unwrap().iter() {
            if at < from || at > to {
                continue;
            }
            match status {
                200 => c.ok += 1,
                429 => c.limited += 1,
                _ => c.other += 1,
            }
        }
        c
    }

    /// Stops sending; the log stays readable.
    pub async fn stop(&mut self) {
        self.stop.send_replace(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

pub async fn pace(
    url: String,
    rate: Arc<AtomicU32>,
    log: Arc<Mutex<Vec<(Instant, u16)>>>,
    mut stop: watch::Receiver<bool>,
) {
    let http = Http::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut next = Instant::now();
    loop {
        let r = rate.load(Ordering::SeqCst);
        let wait = if r == 0 {
            next = Instant::now() + Duration::from_millis(20);
            next
        } else {
            next += Duration::from_secs_f64(1.0 / r as f64);
            // Fell behind (a busy box): start again from now instead of sending a burst to
            // catch up, which would look like demand the test never meant.
            let now = Instant::now();
            if next + Duration::from_millis(100) < now {
                next = now;
            }
            next
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wait.into()) => {}
            _ = stop.changed() => {
                // Let the requests in flight finish, so none is cut off by a gateway the test
                // stops next.
                let _ = slots.acquire_many(IN_FLIGHT as u32).await;
                return;
            }
        }
        if r == 0 {
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let (http, url, log) = (http.clone(), url.clone(), log.clone());
        tokio::spawn(async move {
            let at = Instant::now();
            let status = try_get(&http, &url).await;
            log.lock().unwrap().push((at, status));
            drop(slot);
        });
    }
}

/// The status of one k-big request; 0 if it got no answer in 5 s.
pub async fn try_get(http: &Http, url: &str) -> u16 {
    let (http, url) = (http.clone(), url.to_string());
    // `Http::get` panics on a failed request; a task's panic stays in that task.
    let req = tokio::spawn(async move { http.get(&url, &[("x-api-key", KBIG)]).await.status });
    match tokio::time::timeout(Duration::from_secs(5), req).await {
        Ok(Ok(status)) => status.as_u16(),
        _ => 0,
    }
}

// ---------------------------------------------------------------------------------------------
// A gateway's view: GET /admin/regions.

pub async fn view(http: &Http, gw: &Tollgate) -> Value {
    let a = http.get(&gw.admin_url("/admin/regions"), &[]).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "/admin/regions: {}",
        String::from_utf8_lossy(&a.body)
    );
    a.json()
}

/// This Region's own share of the slot, in its view.
pub fn own_share(v: &Value) -> Option<f64> {
    v["limits"][SLOT]["share"].as_f64()
}

/// Room this Region took from `from`'s share after it fell silent (0 when none).
pub fn reclaimed(v: &Value, from: &str) -> f64 {
    v["limits"][SLOT]["reclaimed"][from].as_f64().unwrap_or(0.0)
}

pub fn record<'a>(v: &'a Value, region: &str) -> &'a Value {
    &v["regions"][region]
}

pub fn seq(v: &Value, region: &str) -> Option<u64> {
    record(v, region)["seq"].as_u64()
}

pub fn age_ms(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["age_ms"].as_f64()
}

pub fn record_share(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["limits"][SLOT]["share"].as_f64()
}

pub fn record_demand(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["limits"][SLOT]["demand"].as_f64()
}

pub fn health<'a>(v: &'a Value, region: &str) -> &'a str {
    v["health"][region].as_str().unwrap_or("<missing>")
}

pub fn is_agent(v: &Value) -> bool {
    v["is_agent"].as_bool() == Some(true) || (!v["agent"].is_null() && v["agent"] == v["this_gateway"])
}

/// Waits until every gateway's Region has an agent, every gateway sees all three Regions'
/// records with a share of the slot, and every store holds a share: the Regions have met.
pub async fn wait_ready(http: &Http, gateways: &[&Tollgate], ports: [u16; 3]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut conns = ports.map(StoreConn::new);
    loop {
        let mut missing = Vec::new();
        for gw in gateways {
            let v = view(http, gw).await;
            let region = v["region"].as_str().unwrap_or("?").to_string();
            if v["agent"].is_null() {
                missing.push(format!("{region}: no agent"));
            }
            for name in NAMES {
                if record_share(&v, name).is_none() {
                    missing.push(format!("{region} has no record of {name} with {SLOT}"));
                }
            }
        }
        for (i, c) in conns.iter_mut().enumerate() {
            if c.share().await.is_none() {
                missing.push(format!("no share in {}'s store", NAMES[i]));
            }
        }
        if missing.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the Regions did not meet within 15 s: {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until `cond` holds on the sampled shares, or fails with `what` after `limit`.
pub async fn wait_shares(
    sampler: &Sampler,
    limit: Duration,
    what: &str,
    cond: impl Fn(&[Option<f64>; 3]) -> bool,
) {
    let deadline = Instant::now() + limit;
    loop {
        if sampler.last().is_some_and(|s| cond(&s.shares)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {limit:?}; last shares {:?}",
            sampler.last().map(|s| s.shares)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
