//! One limit shared by three Regions, live: real gateway processes, one real redis-server per
//! Region, each Region's agent rebalancing every 400 ms. Owns the end-to-end claims of issue 18:
//! shares follow demand and never add up past the limit, a lost Region is reclaimed only on two
//! signals, a Region that is only cut off keeps its share, and a new agent carries on from the
//! old one's state. Also tests the relay and health-server fixtures these tests stand on.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::health::HealthServer;
use common::relay::Relay;
use common::{Http, KBIG, RedisServer, Tollgate};
use http::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The limit the three Regions share, per second (the rules below).
const L: f64 = 300.0;
const INTERVAL: Duration = Duration::from_millis(400);
const LEASE: Duration = Duration::from_millis(1200);
/// The one global slot: limit `plan` of key `k-big`.
const SLOT: &str = "plan/k-big";
const NAMES: [&str; 3] = ["A", "B", "C"];
/// Room for the rounding of shares that add up to exactly the limit.
const EPS: f64 = 1e-6;

/// Every test here runs three redis-servers and three or four gateways under load; on a
/// 2-core machine two of them at once would starve each other's agents and measure the box
/// instead of the gateway.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn rules(upstream: SocketAddr) -> String {
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

fn index(name: &str) -> usize {
    NAMES.iter().position(|n| *n == name).expect("a Region name")
}

// ---------------------------------------------------------------------------------------------
// The three Regions: a store and an outside health check each, and their gateways.

struct Region {
    name: &'static str,
    /// `None` once the test killed it.
    redis: Option<RedisServer>,
    port: u16,
    health: HealthServer,
}

struct World {
    _rules_dir: tempfile::TempDir,
    rules: PathBuf,
    regions: Vec<Region>,
}

impl World {
    async fn start() -> World {
        let upstream = common::start_demo_upstream().await;
        let (rules_dir, rules) = common::rules_file(&rules(upstream));
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

    fn region(&self, name: &str) -> &Region {
        &self.regions[index(name)]
    }

    /// `A=redis://…,B=…,C=…`; `via` replaces a Region's store address (a relay).
    fn regions_arg(&self, via: &[(&str, SocketAddr)]) -> String {
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
    fn health_arg(&self, own: &str) -> String {
        self.regions
            .iter()
            .filter(|r| r.name != own)
            .map(|r| format!("{}={}", r.name, r.health.url()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A gateway of Region `region`, reaching the stores through `via` where given.
    async fn gateway(&self, region: &str, instance: &str, via: &[(&str, SocketAddr)]) -> Tollgate {
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

    fn ports(&self) -> [u16; 3] {
        [self.regions[0].port, self.regions[1].port, self.regions[2].port]
    }
}

// ---------------------------------------------------------------------------------------------
// Reading a store: a few RESP commands over one connection, without a Redis client crate.

struct StoreConn {
    port: u16,
    conn: Option<BufReader<TcpStream>>,
}

impl StoreConn {
    fn new(port: u16) -> StoreConn {
        StoreConn { port, conn: None }
    }

    /// A bulk-string reply, `None` for nil or when the store does not answer within 500 ms
    /// (the connection is then dropped and made again next time).
    async fn command(&mut self, args: &[&str]) -> Option<String> {
        match tokio::time::timeout(Duration::from_millis(500), self.try_command(args)).await {
            Ok(Ok(v)) => v,
            _ => {
                self.conn = None;
                None
            }
        }
    }

    async fn try_command(&mut self, args: &[&str]) -> std::io::Result<Option<String>> {
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
    async fn share(&mut self) -> Option<f64> {
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
struct Sample {
    at: Instant,
    /// A, B, C; `None` when a store has no share or does not answer.
    shares: [Option<f64>; 3],
}

impl Sample {
    fn sum(&self, which: &[usize]) -> f64 {
        which.iter().filter_map(|&i| self.shares[i]).sum()
    }
}

struct Sampler {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Sampler {
    fn start(ports: [u16; 3]) -> Sampler {
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

    fn all(&self) -> Vec<Sample> {
        self.samples.lock().unwrap().clone()
    }

    fn between(&self, from: Instant, to: Instant) -> Vec<Sample> {
        self.all()
            .into_iter()
            .filter(|s| s.at >= from && s.at <= to)
            .collect()
    }

    fn last(&self) -> Option<Sample> {
        self.samples.lock().unwrap().last().copied()
    }

    /// The newest share of Region `i`, waiting for the first sample if need be.
    async fn latest(&self, i: usize) -> Option<f64> {
        for _ in 0..40 {
            if let Some(s) = self.last() {
                return s.shares[i];
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    async fn stop(self) -> Vec<Sample> {
        self.stop.send_replace(true);
        let _ = self.task.await;
        self.samples.lock().unwrap().clone()
    }
}

/// Fails on the first sample where the shares of `which` add up past the limit.
fn assert_sum_within_limit(samples: &[Sample], which: &[usize], what: &str) {
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
fn mean_share(samples: &[Sample], i: usize, from: Instant, to: Instant) -> f64 {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| s.at >= from && s.at <= to)
        .filter_map(|s| s.shares[i])
        .collect();
    assert!(!v.is_empty(), "no share of {} sampled in the window", NAMES[i]);
    v.iter().sum::<f64>() / v.len() as f64
}

fn max_sum(samples: &[Sample], which: &[usize]) -> f64 {
    samples.iter().map(|s| s.sum(which)).fold(0.0, f64::max)
}

// ---------------------------------------------------------------------------------------------
// Paced load: one task per Region, sending k-big's requests at a set rate.

/// Most requests a sender keeps in flight; past it a tick is skipped rather than queued, so a
/// slow gateway lowers the rate sent instead of piling up tasks.
const IN_FLIGHT: usize = 32;

struct Sender {
    name: &'static str,
    url: String,
    rate: Arc<AtomicU32>,
    /// (when sent, status): 0 when the request failed outright.
    log: Arc<Mutex<Vec<(Instant, u16)>>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    ok: u64,
    limited: u64,
    other: u64,
}

impl Counts {
    fn sent(&self) -> u64 {
        self.ok + self.limited + self.other
    }
}

struct Load {
    senders: Vec<Sender>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// One sender per Region, each to the given gateway's public URL, at rate 0.
    fn start(targets: [(&'static str, &Tollgate); 3]) -> Load {
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

    fn sender(&self, name: &str) -> &Sender {
        self.senders.iter().find(|s| s.name == name).unwrap()
    }

    /// Requests per second to Region `name`'s gateway.
    fn set(&self, name: &str, rate: u32) {
        self.sender(name).rate.store(rate, Ordering::SeqCst);
    }

    fn set_all(&self, rates: [u32; 3]) {
        for (name, r) in NAMES.iter().zip(rates) {
            self.set(name, r);
        }
    }

    fn counts(&self, name: &str, from: Instant, to: Instant) -> Counts {
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
    async fn stop(&mut self) {
        self.stop.send_replace(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

async fn pace(
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
async fn try_get(http: &Http, url: &str) -> u16 {
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

async fn view(http: &Http, gw: &Tollgate) -> Value {
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
fn own_share(v: &Value) -> Option<f64> {
    v["limits"][SLOT]["share"].as_f64()
}

/// Room this Region took from `from`'s share after it fell silent (0 when none).
fn reclaimed(v: &Value, from: &str) -> f64 {
    v["limits"][SLOT]["reclaimed"][from].as_f64().unwrap_or(0.0)
}

fn record<'a>(v: &'a Value, region: &str) -> &'a Value {
    &v["regions"][region]
}

fn seq(v: &Value, region: &str) -> Option<u64> {
    record(v, region)["seq"].as_u64()
}

fn age_ms(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["age_ms"].as_f64()
}

fn record_share(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["limits"][SLOT]["share"].as_f64()
}

fn record_demand(v: &Value, region: &str) -> Option<f64> {
    record(v, region)["limits"][SLOT]["demand"].as_f64()
}

fn health<'a>(v: &'a Value, region: &str) -> &'a str {
    v["health"][region].as_str().unwrap_or("<missing>")
}

fn is_agent(v: &Value) -> bool {
    v["is_agent"].as_bool() == Some(true) || (!v["agent"].is_null() && v["agent"] == v["this_gateway"])
}

/// Waits until every gateway's Region has an agent, every gateway sees all three Regions'
/// records with a share of the slot, and every store holds a share: the Regions have met.
async fn wait_ready(http: &Http, gateways: &[&Tollgate], ports: [u16; 3]) {
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
async fn wait_shares(
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

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// Demand moves from A to C; the shares follow it, the gateways admit what the shares say, and
/// at no sample do the three shares add up past the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_follow_demand_and_never_add_up_past_the_limit() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    let begin = Instant::now();
    // 330/s against 300: someone is always short. Targets (5% floor, rest by demand) are
    // about A 170, B 92, C 38 first, then A 38, B 92, C 170.
    load.set_all([200, 100, 30]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let moved = Instant::now();
    load.set_all([30, 100, 200]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let end = Instant::now();
    load.stop().await;
    let samples = sampler.between(begin, end);
    let _ = sampler.stop().await;

    let all = [0, 1, 2];
    for s in &samples {
        assert!(
            s.shares.iter().all(Option::is_some),
            "a store lost its share under load: {s:?}"
        );
    }
    assert_sum_within_limit(&samples, &all, "under moving demand");

    // Steady before the move (its last 3 s) and at the end (the last 3 s): raises are at most
    // 10% of L per rebalance, so 5 s is room for the 130 C has to gain.
    let window = Duration::from_secs(3);
    let before: Vec<f64> = (0..3)
        .map(|i| mean_share(&samples, i, moved - window, moved))
        .collect();
    let after: Vec<f64> = (0..3)
        .map(|i| mean_share(&samples, i, end - window, end))
        .collect();
    eprintln!(
        "mean shares before the move {before:.1?}, after {after:.1?}; max sum {:.3} over {} samples",
        max_sum(&samples, &all),
        samples.len()
    );
    assert!(
        before[0] > 2.0 * before[2],
        "A asks 200/s and C 30/s, yet A's share {:.1} is not well above C's {:.1}",
        before[0],
        before[2]
    );
    assert!(
        after[2] > 2.0 * after[0],
        "after the move C asks 200/s and A 30/s, yet C's share {:.1} is not well above A's {:.1}",
        after[2],
        after[0]
    );

    // What the gateways admitted follows the shares, loosely: the Region asking more than its
    // share is held near it (a steady bucket has no burst left to spend), and the share that
    // moved to C lets C admit far more than A.
    let phases = [
        ("before the move", moved - window, moved, &before, 0usize, 2usize),
        ("after the move", end - window, end, &after, 2, 0),
    ];
    for (phase, from, to, shares, busy, quiet) in phases {
        let counts: Vec<Counts> = NAMES.iter().map(|n| load.counts(n, from, to)).collect();
        let per_s = |n: u64| n as f64 / secs(to - from);
        let ok: Vec<f64> = counts.iter().map(|c| per_s(c.ok)).collect();
        let sent: Vec<f64> = counts.iter().map(|c| per_s(c.sent())).collect();
        eprintln!("{phase}: sent/s {sent:.1?}, admitted/s {ok:.1?}, counts {counts:?}");
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                c.other, 0,
                "{phase}: {} answered neither 200 nor 429: {c:?}",
                NAMES[i]
            );
        }
        // The Region asking far more than its share has had its bucket empty for seconds:
        // it admits about its share and no more. (B, 100/s on about 90, is not held to this:
        // 10/s over its share takes longer than a phase to drain two seconds of burst.)
        assert!(
            ok[busy] <= shares[busy] + 0.05 * L,
            "{phase}: {} admitted {:.1}/s on a share of {:.1}/s",
            NAMES[busy],
            ok[busy],
            shares[busy]
        );
        for i in 0..3 {
            // Every gateway lets through most of what its share allows.
            assert!(
                ok[i] >= 0.8 * sent[i].min(shares[i]),
                "{phase}: {} admitted only {:.1}/s of {:.1}/s sent, on a share of {:.1}/s",
                NAMES[i],
                ok[i],
                sent[i],
                shares[i]
            );
        }
        assert!(
            ok[busy] > 2.0 * ok[quiet],
            "{phase}: {} admitted {:.1}/s, not well above {}'s {:.1}/s",
            NAMES[busy],
            ok[busy],
            NAMES[quiet],
            ok[quiet]
        );
    }
    eprintln!("took {:.1} s", secs(started.elapsed()));
}

/// B's store dies and its health check goes dark while B's gateway keeps running: B's records
/// stop (its gateway lost the lock with its store), both signals agree, and A and C reclaim
/// B's share between them, never holding more than the limit together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_region_is_reclaimed_on_two_signals() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut world = World::start().await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    // Targets about A 142, B 100, C 58; with B gone, A 218 and C 82: both must rise.
    load.set_all([90, 60, 30]);
    wait_shares(
        &sampler,
        Duration::from_secs(12),
        "A's and C's shares did not settle near their targets",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > 125.0 && *c < 75.0),
    )
    .await;
    let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
    for v in [&va, &vc] {
        assert_eq!(health(v, "B"), "up", "B's health check answers 200: {v}");
        assert_eq!(reclaimed(v, "B"), 0.0, "B reclaimed while it publishes: {v}");
    }
    let a_before = own_share(&va).expect("A's share in its view");
    let c_before = own_share(&vc).expect("C's share in its view");

    // Both signals at once: the store (and with it B's agent lock) and the health check.
    load.set("B", 0);
    let killed = Instant::now();
    drop(world.regions[index("B")].redis.take());
    world.region("B").health.stop().await;

    // Silence is 3 of the agent's rebalances with B's record unchanged; then the health
    // check, polled every interval, must also say down. 15 intervals leave room for a lease
    // to run out on B's side and for a loaded box.
    let limit = INTERVAL * 15;
    let mut b_seqs = Vec::new();
    let (va, vc) = loop {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        b_seqs.push((
            killed.elapsed().as_millis(),
            seq(&va, "B"),
            health(&va, "B").to_string(),
            seq(&va, "A"),
        ));
        if reclaimed(&va, "B") > 0.0 && reclaimed(&vc, "B") > 0.0 {
            break (va, vc);
        }
        assert!(
            killed.elapsed() < limit,
            "B not reclaimed by both A and C within {limit:?} of losing its store and health check;\n\
             (ms after the loss, B's seq, B's health, A's seq) as A saw them: {b_seqs:?}\nA: {va}\nC: {vc}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reclaimed_after = killed.elapsed();
    eprintln!("(ms after the loss, B's seq, B's health, A's seq) as A saw them: {b_seqs:?}");
    for v in [&va, &vc] {
        assert_eq!(
            health(v, "B"),
            "down",
            "B reclaimed, yet its health is not down: {v}"
        );
    }
    let b_seq_at_reclaim = seq(&va, "B");

    // The reclaimed room is raised into at most 10% of L per rebalance, after it lands in the pools.
    // A wait, not a bound: on a loaded machine the load falls behind its targets and the shares
    // follow demand more slowly (C at 64 of its 82 after 6 s was seen with both cores busy).
    wait_shares(
        &sampler,
        INTERVAL * 30,
        "A's and C's shares did not rise after reclaiming B",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > a_before + 5.0 && *c > c_before + 5.0),
    )
    .await;
    // A little longer at the new shares, so the sum is watched after the raises too.
    tokio::time::sleep(INTERVAL * 4).await;
    load.stop().await;
    let samples = sampler.stop().await;

    let va = view(&http, &a).await;
    assert_eq!(
        seq(&va, "B"),
        b_seq_at_reclaim,
        "B's gateway lost its store and its lock, yet B's record still changes in A's store"
    );
    let (before, after): (Vec<Sample>, Vec<Sample>) = samples.iter().partition(|s| s.at < killed);
    assert_sum_within_limit(&before, &[0, 1, 2], "before B was lost");
    assert_sum_within_limit(&after, &[0, 2], "after B was lost");
    let last = samples.last().unwrap().shares;
    eprintln!(
        "reclaimed {:.1} s after the loss; A {a_before:.1} -> {:?}, C {c_before:.1} -> {:?}; \
         reclaimed by A {:.1}, by C {:.1}; max A+C {:.3}; took {:.1} s",
        secs(reclaimed_after),
        last[0],
        last[2],
        reclaimed(&va, "B"),
        reclaimed(&view(&http, &c).await, "B"),
        max_sum(&after, &[0, 2]),
        secs(started.elapsed())
    );
}

/// B's gateway writes into A's and C's stores through relays, and the relays are cut: A and
/// C stop hearing from B, but B's health check still answers, so one signal is not enough
/// and B keeps its share. Restored, B's records arrive fresh again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_region_keeps_its_share() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let store = |name| SocketAddr::from(([127, 0, 0, 1], world.region(name).port));
    let to_a = Relay::start(store("A")).await;
    let to_c = Relay::start(store("C")).await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world
        .gateway("B", "gw-b1", &[("A", to_a.addr()), ("C", to_c.addr())])
        .await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    load.set_all([90, 60, 30]);
    wait_shares(
        &sampler,
        Duration::from_secs(12),
        "A's share did not settle well above C's",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > *c + 50.0),
    )
    .await;
    let b_seq_before = seq(&view(&http, &a).await, "B").expect("B's record in A's view");

    to_a.cut();
    to_c.cut();
    let cut = Instant::now();
    let watch_for = INTERVAL * 15;
    let mut first_ages = None;
    let mut views = 0;
    while cut.elapsed() < watch_for {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        views += 1;
        for (who, v) in [("A", &va), ("C", &vc)] {
            assert_eq!(
                reclaimed(v, "B"),
                0.0,
                "{who} reclaimed B's share while B's health check answers 200, {:?} after the cut: {v}",
                cut.elapsed()
            );
            assert_eq!(health(v, "B"), "up", "{who}: B's health check answers 200: {v}");
            // The shares this Region counts on: its own, and the last the others published.
            let own = own_share(v).unwrap_or_else(|| panic!("{who}'s share in its view: {v}"));
            let others: f64 = NAMES
                .iter()
                .filter(|n| **n != who)
                .map(|n| record_share(v, n).unwrap_or_else(|| panic!("{n}'s record in {who}'s view: {v}")))
                .sum();
            assert!(
                own + others <= L + EPS,
                "{who}'s own share {own} and the others' last known shares {others} add up past {L}: {v}"
            );
        }
        let ages = (age_ms(&va, "B"), age_ms(&vc, "B"));
        first_ages.get_or_insert(ages);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
    let blocked = cut.elapsed();
    for (who, v) in [("A", &va), ("C", &vc)] {
        let age = age_ms(v, "B").unwrap_or_else(|| panic!("age of B's record in {who}'s view: {v}"));
        // The last record that got through was written before the cut (give or take one in
        // flight at the moment of the cut).
        assert!(
            age >= (blocked - INTERVAL).as_millis() as f64,
            "{who} shows B's record {age} ms old, {blocked:?} after the cut: the relay let records through: {v}"
        );
        let s = seq(v, "B").unwrap();
        assert!(
            s <= b_seq_before + 1,
            "B's record went from {b_seq_before} to {s} in {who}'s store through a cut relay"
        );
    }
    let b_view = view(&http, &b).await;
    eprintln!(
        "{views} views over {:?} of cut: B's record age in A and C first {first_ages:?}, then {:?}; \
         B's own seq {:?} (was {b_seq_before})",
        blocked,
        (age_ms(&va, "B"), age_ms(&vc, "B")),
        seq(&b_view, "B")
    );
    assert_sum_within_limit(&sampler.all(), &[0, 1, 2], "while B was cut off");

    // Restored: B's gateway makes its store connections again and its records land fresh.
    to_a.restore();
    to_c.restore();
    let restored = Instant::now();
    let limit = INTERVAL * 15;
    loop {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        let fresh = |v: &Value| {
            seq(v, "B").is_some_and(|s| s > b_seq_before + 1)
                && age_ms(v, "B").is_some_and(|a| a < (INTERVAL * 3).as_millis() as f64)
        };
        if fresh(&va) && fresh(&vc) {
            for (who, v) in [("A", &va), ("C", &vc)] {
                assert_eq!(reclaimed(v, "B"), 0.0, "{who} reclaimed B after the restore: {v}");
            }
            break;
        }
        assert!(
            restored.elapsed() < limit,
            "B's records not fresh in A's and C's stores within {limit:?} of the restore:\nA: {va}\nC: {vc}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    load.stop().await;
    let samples = sampler.stop().await;
    assert_sum_within_limit(&samples, &[0, 1, 2], "through cut and restore");
    eprintln!(
        "fresh again {:.1} s after the restore; max sum {:.3}; took {:.1} s",
        secs(restored.elapsed()),
        max_sum(&samples, &[0, 1, 2]),
        secs(started.elapsed())
    );
}

/// Region A runs two gateways; its agent is killed with SIGKILL. The other gateway takes the
/// lock within two leases and carries on from the saved state: A's records keep counting up
/// and A's share does not jump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agent_carries_on_from_the_old_ones_state() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let a1 = world.gateway("A", "gw-a1", &[]).await;
    let a2 = world.gateway("A", "gw-a2", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a1, &a2, &b, &c], world.ports()).await;

    let (v1, v2) = (view(&http, &a1).await, view(&http, &a2).await);
    assert_eq!(
        v1["agent"], v2["agent"],
        "A's gateways disagree on the agent:\n{v1}\n{v2}"
    );
    assert!(
        is_agent(&v1) != is_agent(&v2),
        "exactly one of A's gateways is the agent:\n{v1}\n{v2}"
    );
    let (mut agent, survivor) = if is_agent(&v1) { (a1, a2) } else { (a2, a1) };
    let survivor_name = view(&http, &survivor).await["this_gateway"].clone();

    // All of A's demand goes to the gateway that stays, so the kill does not change it: a
    // share that moves then is the new agent's doing, not the load's. That also makes the
    // agent count requests another gateway of its Region received.
    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &survivor), ("B", &b), ("C", &c)]);
    // Targets about A 185, B 58, C 58: far from an even third, so an agent that started over
    // would show.
    load.set_all([120, 30, 30]);
    let settle = Duration::from_secs(12);
    let settled = Instant::now();
    loop {
        let s = sampler.last().map(|s| s.shares);
        if matches!(s, Some([Some(a), _, _]) if a > 150.0) {
            break;
        }
        if settled.elapsed() > settle {
            let v = view(&http, &survivor).await;
            panic!(
                "A's share did not settle above 150 within {settle:?} (last shares {s:?}); \
                 A's demand in its record {:?}, with 120/s sent to the gateway that is not the agent: {v}",
                record_demand(&v, "A")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Steady a few intervals more.
    tokio::time::sleep(INTERVAL * 3).await;

    let v = view(&http, &survivor).await;
    let seq_before = seq(&v, "A").expect("A's record in its view");
    let share_before = sampler.latest(0).await.expect("A's share");
    agent.signal("KILL");
    let killed = Instant::now();
    let _ = agent.child.wait();

    // A lease of 1200 ms runs out at most one lease after the last renewal; the survivor then
    // takes the lock at its next try, within an interval.
    let limit = LEASE * 2 + INTERVAL;
    let mut seqs = vec![seq_before];
    loop {
        let v = view(&http, &survivor).await;
        if let Some(s) = seq(&v, "A") {
            seqs.push(s);
        }
        if is_agent(&v) {
            break;
        }
        assert!(
            killed.elapsed() <= limit + Duration::from_millis(100),
            "the surviving gateway is not A's agent {:?} after the agent was killed: {v}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took_over = killed.elapsed();
    let holder = StoreConn::new(world.region("A").port)
        .command(&["GET", "tollgate:regions:agent"])
        .await;
    assert_eq!(
        holder.as_deref(),
        survivor_name.as_str(),
        "the lock in A's store is not held by the new agent"
    );

    // The new agent's first record: its seq follows the old agent's, it does not start over.
    let old_last = *seqs.iter().max().unwrap();
    let first_new = loop {
        let v = view(&http, &survivor).await;
        let s = seq(&v, "A").expect("A's record");
        seqs.push(s);
        if s > old_last {
            break Instant::now();
        }
        assert!(
            killed.elapsed() < took_over + INTERVAL * 5,
            "A's record did not move past the old agent's seq {old_last} after the takeover: seqs seen {seqs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // One more interval of the new agent's shares.
    tokio::time::sleep(INTERVAL * 2).await;
    let seq_after = seq(&view(&http, &survivor).await, "A").unwrap();
    seqs.push(seq_after);
    load.stop().await;
    let samples = sampler.stop().await;

    assert!(
        seqs.windows(2).all(|w| w[1] >= w[0]) && seq_after > seq_before,
        "A's record seq went back or stopped across the takeover (old agent's last {seq_before}): {seqs:?}"
    );
    let after: Vec<f64> = samples
        .iter()
        .filter(|s| s.at >= killed && s.at <= first_new + INTERVAL * 2)
        .filter_map(|s| s.shares[0])
        .collect();
    assert!(!after.is_empty(), "no share of A sampled after the kill");
    // The new agent's first decision measures demand across the gap the kill left, so the share
    // may dip (31 below on a loaded CI host); a fresh start would put it at the even split,
    // L / 3, which the test keeps farther away than the bound.
    let bound = 0.15 * L;
    assert!(
        (share_before - L / 3.0).abs() > bound + EPS,
        "A's share {share_before:.1} is too close to the even split for the test to tell a fresh start"
    );
    for s in &after {
        assert!(
            (s - share_before).abs() <= bound + EPS,
            "A's share moved from {share_before:.1} to {s:.1} across the takeover (all after: {after:.1?})"
        );
    }
    assert_sum_within_limit(&samples, &[0, 1, 2], "across the takeover");
    eprintln!(
        "took over {:.2} s after the kill; seq {seq_before} -> {seq_after}; share {share_before:.1} -> {:.1?}; \
         took {:.1} s",
        secs(took_over),
        after.last(),
        secs(started.elapsed())
    );
}

// ---------------------------------------------------------------------------------------------
// The fixtures the tests above stand on.

async fn echo_server() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
    s.write_all(msg).await.unwrap();
    let mut buf = vec![0; msg.len()];
    s.read_exact(&mut buf).await.unwrap();
    buf
}

/// Whether the peer closed: EOF or a reset. Bounded, so a relay that forgot to close fails the
/// test instead of hanging it.
async fn sees_close(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test]
async fn the_relay_passes_bytes_and_a_cut_closes_old_and_new_connections() {
    let relay = Relay::start(echo_server().await).await;
    let mut a = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut a, b"hello").await, b"hello");
    let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(
        round_trip(&mut a, &big).await,
        big,
        "a larger message passes whole"
    );

    relay.cut();
    assert!(relay.is_cut());
    assert!(
        sees_close(&mut a).await,
        "a relayed connection was not closed by the cut"
    );
    let mut b = TcpStream::connect(relay.addr()).await.unwrap();
    assert!(
        sees_close(&mut b).await,
        "a connection made after the cut was relayed"
    );

    relay.restore();
    let mut c = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut c, b"again").await, b"again");
}

#[tokio::test]
async fn dropping_the_relay_closes_its_connections() {
    let relay = Relay::start(echo_server().await).await;
    let mut a = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(round_trip(&mut a, b"x").await, b"x");
    drop(relay);
    assert!(sees_close(&mut a).await);
}

#[tokio::test]
async fn the_health_server_answers_up_down_and_then_not_at_all() {
    let health = HealthServer::start().await;
    let http = Http::new();
    assert_eq!(http.get(&health.url(), &[]).await.status, StatusCode::OK);
    health.set_up(false);
    assert_eq!(
        http.get(&health.url(), &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    health.set_up(true);
    assert_eq!(http.get(&health.url(), &[]).await.status, StatusCode::OK);
    let other = format!("http://{}/other", health.addr());
    assert_eq!(http.get(&other, &[]).await.status, StatusCode::NOT_FOUND);
    assert_eq!(health.hits(), 3, "only GET /healthz counts");
    health.stop().await;
    let e = TcpStream::connect(health.addr())
        .await
        .expect_err("connected to a stopped health server");
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
}
