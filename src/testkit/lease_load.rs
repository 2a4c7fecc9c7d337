//! A hot key on real parts: N lease clients (each the gateway's own `Leases` layer on
//! its own `RedisStore` connection, no HTTP) drive one hot key against one real `redis-server`
//! on a real clock, and every admission is recorded with its time. Shared by tests/lease.rs
//! (10 s), tests/lease_crash.rs and benches/lease.rs (the batch job's minute).

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tollgate_limit::batch::LeaseBlock;
use tollgate_limit::bucket::{BucketParams, BucketState, Charge, Rate, refill};
use tollgate_limit::lease::Account;
use tollgate_store::guard::FleetSize;
use tollgate_store::lease::{GiveBackReply, LeaseReply, Leases, Lessor};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{BoxFuture, CheckFuture, CheckItem, FailurePolicy, Outcome, Store, StoreError};
use tollgate_telemetry::metrics::{Kind, Metrics};

/// The hot key's bucket, as the gateway names a key limit `plan` of tenant `kbig`.
pub const KEY: &str = "rl:{kbig}:plan";

#[derive(Clone, Debug)]
pub struct Load {
    pub clients: usize,
    pub rate: &'static str,
    pub burst: u64,
    /// Requests a second over the whole fleet, spread evenly over the clients.
    pub offered_per_s: u64,
    pub seconds: f64,
    pub block: LeaseBlock,
    /// How long a request may wait for a lease in flight (the gateway's store timeout).
    pub wait: Duration,
}

impl Load {
    /// A hot key: 20 gateways, k-big at 10,000/s burst 20,000, 100,000 offered a second.
    pub fn hot_key(seconds: f64) -> Load {
        Load {
            clients: 20,
            rate: "10000/1s",
            burst: 20_000,
            offered_per_s: 100_000,
            seconds,
            block: LeaseBlock::Auto,
            wait: Duration::from_millis(3),
        }
    }
}

/// `cmdstat_evalsha` calls so far: every check, lease and give-back the server ran.
pub fn evalsha_calls(port: u16) -> u64 {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "INFO", "commandstats"])
        .output()
        .expect("redis-cli runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The stored state of a bucket: (tokens in units, ts in µs, scale), from the first 18 of the
/// 25 bytes of its field in its page (`<I7I7I4I7`, as lua/bucket.lua writes it).
pub fn stored_bucket(port: u16, key: &str) -> Option<(u64, u64, u64)> {
    let page = tollgate_store::page::page_of(key);
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "--raw", "HGET", &page, key])
        .output()
        .expect("redis-cli runs");
    let b = out.stdout;
    // --raw prints the bytes and a newline; a missing field prints just the newline.
    if b.len() < 25 {
        return None;
    }
    let le = |s: &[u8]| s.iter().rev().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
    Some((le(&b[0..7]), le(&b[7..14]), le(&b[14..18])))
}

/// Reads the stored bucket every 20 ms on its own thread; the most units it ever saw.
pub struct BucketWatch {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<(u64, usize)>,
}

impl BucketWatch {
    pub fn start(port: u16) -> BucketWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut max, mut samples) = (0, 0);
            while !s.load(Ordering::Acquire) {
                if let Some((tokens, _, _)) = stored_bucket(port, KEY) {
                    max = max.max(tokens);
                    samples += 1;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (max, samples)
        });
        BucketWatch { stop, handle }
    }

    /// The most units seen, and how many samples found the bucket.
    pub fn finish(self) -> (u64, usize) {
        self.stop.store(true, Ordering::Release);
        self.handle.join().expect("bucket watch thread")
    }
}

/// The store's own answers about the hot bucket: (store time µs, units left), one per call.
type Log = Arc<Mutex<Vec<(u64, u64)>>>;

/// A client's store: the real `RedisStore`, noting what every lease, give-back and check of the
/// hot bucket left in it, so the test knows the shared bucket at any instant.
struct Recorder {
    store: Arc<RedisStore>,
    log: Log,
    /// Requests checked in the store directly (no lease answer in time) and how many it
    /// admitted: those admissions spend no leased token.
    checks: Arc<(AtomicU64, AtomicU64)>,
}

impl Recorder {
    fn note(&self, now_us: u64, units: u64) {
        self.log.lock().unwrap().push((now_us, units));
    }
}

impl Lessor for Recorder {
    fn lease<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
        Box::pin(async move {
            let r = self.store.lease(key, p, block, cycle_us, acct).await?;
            self.note(r.now_us, r.units_left);
            Ok(r)
        })
    }

    fn give_back<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
        acct: Account<'a>,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
        Box::pin(async move {
            let r = self.store.give_back(key, p, tokens, acct).await?;
            self.note(r.now_us, r.units_left);
            Ok(r)
        })
    }
}

impl Store for Recorder {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        CheckFuture::Boxed(Box::pin(async move {
            let out: Outcome = self.store.check_batch(batch).await?;
            self.checks.0.fetch_add(1, Ordering::Relaxed);
            if out.admitted {
                self.checks.1.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(v) = out.buckets.first() {
                self.note(out.now_us, v.tokens);
            }
            Ok(out)
        }))
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<tollgate_store::Adjusted, StoreError>> {
        self.store.adjust(batch, outcome, units)
    }

    fn remote(&self) -> bool {
        true
    }
}

pub struct Run {
    pub params: BucketParams,
    pub block: u64,
    /// µs since the start of every admitted request, sorted.
    pub admitted_us: Vec<u64>,
    pub offered: u64,
    /// The first local refusal: the opening full bucket is spent.
    pub first_refusal_us: Option<u64>,
    /// When the clients stopped sending, µs since the start.
    pub stop_us: u64,
    pub start: Instant,
    /// EVALSHA calls the server ran before the load (start-up probes), and while it ran.
    pub calls_before_load: u64,
    pub calls_during_load: u64,
    /// Tokens the clients held when the load stopped.
    pub held_at_stop: u64,
    pub clients: Vec<Arc<Leases>>,
    pub metrics: Vec<Arc<Metrics>>,
    /// Every call's (store time, units left), sorted by store time.
    log: Log,
    /// Store time minus our time since `start`, µs: read from a probe's answer on its arrival,
    /// so it is early by at most the probe's round trip, `align_us`.
    offset_us: i64,
    pub align_us: u64,
    /// How far the store's clock (Redis `TIME`, the wall clock) ran ahead of ours (monotonic)
    /// over the load, µs: the offset read again after the load, minus the first. A wall clock
    /// stepped forward refills the bucket for time our clock did not see; known to within
    /// `align_us + align_after_us`.
    pub drift_us: i64,
    pub align_after_us: u64,
    /// The longest a client went between two of its requests, µs: about 1 ms (the clients'
    /// tick) unless the process was descheduled on a busy machine.
    pub longest_stall_us: u64,
    /// When that stall ended, µs since the start.
    pub stall_end_us: u64,
    checks: Arc<(AtomicU64, AtomicU64)>,
}

impl Run {
    /// Requests checked in the store directly because no lease answer came in time.
    pub fn checked_in_store(&self) -> u64 {
        self.checks.0.load(Ordering::Relaxed)
    }

    /// Of those, the admitted ones: they spent no leased token.
    pub fn admitted_by_store(&self) -> u64 {
        self.checks.1.load(Ordering::Relaxed)
    }

    /// The store's answers so far, by store time.
    fn sorted_log(&self) -> Vec<(u64, u64)> {
        let mut log = self.log.lock().unwrap().clone();
        log.sort_unstable();
        log
    }

    /// Whole tokens in the shared bucket at `t_us` (our time since `start`).
    pub fn bucket_tokens_at(&self, t_us: u64) -> u64 {
        self.bucket_at(&self.sorted_log(), t_us)
    }

    /// Whole tokens in the shared bucket at `t_us` (our time since `start`), from the store's
    /// last answer before it (in `log`, sorted), refilled. A full bucket before any call.
    fn bucket_at(&self, log: &[(u64, u64)], t_us: u64) -> u64 {
        let at = (t_us as i64 + self.offset_us).max(0) as u64;
        // Two calls in one store microsecond: take the fuller state (the looser bound).
        let i = log.partition_point(|&(ts, _)| ts <= at);
        let Some(&(ts, _)) = log[..i].last() else {
            return self.params.burst;
        };
        let units = log[..i]
            .iter()
            .rev()
            .take_while(|&&(t, _)| t == ts)
            .map(|&(_, u)| u)
            .max()
            .unwrap_or(0);
        let state = BucketState {
            tokens: units,
            ts,
            scale: self.params.scale,
        };
        refill(&self.params, Some(state), at) / self.params.scale
    }

    /// The largest `admitted − (C(s) + r·t)` over intervals [s, e] that start at an admission
    /// while the load runs, where C(s) is what the shared bucket held at s: how far leasing
    /// went beyond one central bucket, which could have admitted C(s) + r·t. Linear, as
    /// [`Run::worst_excess_from`], with C(s) added to the start's term. Returns it with the
    /// interval and C(s).
    pub fn worst_beyond_central(&self) -> (f64, u64, u64, u64) {
        let r = self.rate_per_us();
        let a = &self.admitted_us;
        let log = self.sorted_log();
        let mut best = (f64::MIN, 0, 0, 0);
        let mut min_g: Option<(f64, usize, u64)> = None;
        for j in 0..a.len() {
            let fj = j as f64 - r * a[j] as f64;
            if a[j] < self.stop_us {
                let c = self.bucket_at(&log, a[j]);
                let g = fj + c as f64;
                if min_g.is_none_or(|(m, _, _)| g < m) {
                    min_g = Some((g, j, c));
                }
            }
            if let Some((m, i, c)) = min_g {
                let e = fj + 1.0 - m;
                if e > best.0 {
                    best = (e, a[i], a[j], c);
                }
            }
        }
        best
    }

    pub fn held(&self) -> u64 {
        self.clients.iter().map(|c| c.held()).sum()
    }

    pub fn calls_in_flight(&self) -> usize {
        self.clients.iter().map(|c| c.calls_in_flight()).sum()
    }

    pub fn sum(&self, f: impl Fn(&Metrics) -> u64) -> u64 {
        self.metrics.iter().map(|m| f(m)).sum()
    }

    pub fn grants(&self) -> u64 {
        self.sum(|m| m.lease_grants.get())
    }

    pub fn denials(&self) -> u64 {
        self.sum(|m| m.lease_denials.get())
    }

    pub fn tokens_granted(&self) -> u64 {
        self.sum(|m| m.lease_tokens_granted.get())
    }

    pub fn tokens_returned(&self) -> u64 {
        self.sum(|m| m.lease_tokens_returned.get())
    }

    pub fn failures(&self) -> u64 {
        self.sum(|m| {
            // One at a time: a family's guard held across a second get_or_create deadlocks.
            let leases = m.lease_failures.get_or_create(&Kind { kind: "lease" }).get();
            let gives = m.lease_failures.get_or_create(&Kind { kind: "give_back" }).get();
            leases + gives
        })
    }

    /// Waits (polling, at most `limit`) until every client holds nothing and has no call
    /// left; returns when that was, µs since the start.
    pub async fn wait_until_returned(&self, limit: Duration) -> Option<u64> {
        let deadline = Instant::now() + limit;
        loop {
            if self.held() == 0 && self.calls_in_flight() == 0 {
                return Some(self.start.elapsed().as_micros() as u64);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn rate_per_us(&self) -> f64 {
        self.params.rate.tokens as f64 / self.params.rate.period_us as f64
    }

    /// The most admitted in any window of `window_us`.
    pub fn max_in_window(&self, window_us: u64) -> usize {
        let a = &self.admitted_us;
        let mut best = 0;
        let mut i = 0;
        for j in 0..a.len() {
            while a[j] - a[i] >= window_us {
                i += 1;
            }
            best = best.max(j - i + 1);
        }
        best
    }

    /// The largest `admitted − r·t` over intervals that start at an admission at or after
    /// `from_us` (and before the load stopped) and end at any later admission, with where it
    /// starts and ends. Linear: with f(k) = k − r·t_k, an interval [i, j] admits
    /// f(j) − f(i) + 1 beyond r·t.
    pub fn worst_excess_from(&self, from_us: u64) -> (f64, u64, u64) {
        let r = self.rate_per_us();
        let a = &self.admitted_us;
        let f = |k: usize| k as f64 - r * a[k] as f64;
        let mut best = (f64::MIN, 0, 0);
        let mut min_f: Option<(f64, usize)> = None;
        for j in 0..a.len() {
            if a[j] >= from_us && a[j] < self.stop_us {
                let fj = f(j);
                if min_f.is_none_or(|(m, _)| fj < m) {
                    min_f = Some((fj, j));
                }
            }
            if let Some((m, i)) = min_f {
                let e = f(j) - m + 1.0;
                if e > best.0 {
                    best = (e, a[i], a[j]);
                }
            }
        }
        best
    }

    /// The largest `admitted in [0, e] − r·e` over every end e: the bound from an idle key
    /// with nothing held is the burst, b + r·t.
    pub fn worst_from_idle(&self) -> f64 {
        let r = self.rate_per_us();
        self.admitted_us
            .iter()
            .enumerate()
            .map(|(k, &t)| (k + 1) as f64 - r * t as f64)
            .fold(f64::MIN, f64::max)
    }
}

/// Runs the load: every client offers its share at even spacing (client k offset by k/N of
/// one step, so the fleet's arrivals interleave), catching up when it falls behind.
pub async fn run(redis_port: u16, load: &Load) -> Run {
    let params = BucketParams::new(Rate::parse(load.rate).unwrap(), load.burst).unwrap();
    let log: Log = Arc::new(Mutex::new(Vec::with_capacity(1 << 16)));
    let checks = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let (clients, metrics, probe) = connect_clients(redis_port, load, &log, &checks).await;
    let block = clients[0].block_for(load.block, &params);
    let item = hot_item(params, load.block);

    let total_us = (load.seconds * 1e6) as u64;
    let per_client = load.offered_per_s as f64 / load.clients as f64;
    let start = Instant::now();
    let (offset_us, align_us) = align(&probe, start).await;
    let calls_before = evalsha_calls(redis_port);
    let mut tasks = Vec::new();
    for (k, c) in clients.iter().enumerate() {
        let pace = Pace {
            start,
            total_us,
            per_client,
            offset_us: k as f64 * 1e6 / load.offered_per_s as f64,
        };
        tasks.push(tokio::spawn(drive(c.clone(), item.clone(), pace)));
    }
    let mut all = gather(tasks).await;
    let stop_us = start.elapsed().as_micros() as u64;
    let (offset_after_us, align_after_us) = align(&probe, start).await;
    let held_at_stop = clients.iter().map(|c| c.held()).sum();
    let calls_during_load = evalsha_calls(redis_port) - calls_before;
    all.admitted_us.sort_unstable();
    Run {
        log,
        checks,
        offset_us,
        align_us,
        drift_us: offset_after_us - offset_us,
        align_after_us,
        longest_stall_us: all.longest_stall_us,
        stall_end_us: all.stall_end_us,
        params,
        block,
        admitted_us: all.admitted_us,
        offered: all.offered,
        first_refusal_us: all.first_refusal_us,
        stop_us,
        start,
        calls_before_load: calls_before,
        calls_during_load,
        held_at_stop,
        clients,
        metrics,
    }
}

/// Connects `load.clients` lease clients, each on its own `RedisStore` connection as a
/// gateway has, all recording into `log` and `checks`; and one of those stores, to probe the
/// server's clock with.
async fn connect_clients(
    redis_port: u16,
    load: &Load,
    log: &Log,
    checks: &Arc<(AtomicU64, AtomicU64)>,
) -> (Vec<Arc<Leases>>, Vec<Arc<Metrics>>, Arc<RedisStore>) {
    let url = format!("redis://127.0.0.1:{redis_port}");
    let mut clients = Vec::new();
    let mut metrics = Vec::new();
    let mut probe = None;
    for _ in 0..load.clients {
        let store = Arc::new(
            RedisStore::connect(Target::node(&url), None)
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        );
        probe = Some(store.clone());
        let recorder = Arc::new(Recorder {
            store,
            log: log.clone(),
            checks: checks.clone(),
        });
        let m = Metrics::new();
        let fleet = Arc::new(FleetSize::fixed(load.clients as u32));
        clients.push(Leases::new(
            recorder.clone() as Arc<dyn Store>,
            recorder,
            fleet,
            m.clone(),
            load.wait,
        ));
        metrics.push(m);
    }
    (clients, metrics, probe.expect("at least one client"))
}

/// One request's check of the hot key: cost 1, enforced, leased in `block`s.
fn hot_item(params: BucketParams, block: LeaseBlock) -> CheckItem {
    let mut item = CheckItem::new(
        KEY.into(),
        Charge {
            params,
            cost: 1,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    );
    item.lease = Some(block);
    item
}

/// When one client sends: its share of the offered rate from its offset on, until the load's
/// end.
#[derive(Clone, Copy)]
struct Pace {
    start: Instant,
    total_us: u64,
    per_client: f64,
    offset_us: f64,
}

/// What one client saw, times in µs since the start.
struct Sent {
    sent: u64,
    admitted: Vec<u64>,
    first_refusal: Option<u64>,
    /// The longest gap between two of its requests, and when it ended.
    stall_us: u64,
    stall_end: u64,
}

/// One client's load: sends whatever is due by now, then sleeps a tick, so a client that fell
/// behind catches up rather than losing its share.
async fn drive(c: Arc<Leases>, item: CheckItem, pace: Pace) -> Sent {
    let Pace {
        start,
        total_us,
        per_client,
        offset_us,
    } = pace;
    let mut sent = 0u64;
    let mut admitted = Vec::with_capacity((per_client * load_seconds(total_us) / 4.0) as usize);
    let mut first_refusal = None;
    let (mut last_us, mut stall_us, mut stall_end) = (0u64, 0u64, 0u64);
    'load: loop {
        let now = start.elapsed().as_micros() as f64;
        if now >= total_us as f64 {
            break;
        }
        if sent > 0 && now as u64 - last_us > stall_us {
            stall_us = now as u64 - last_us;
            stall_end = now as u64;
        }
        let due = if now < offset_us {
            0
        } else {
            ((now - offset_us) * per_client / 1e6) as u64 + 1
        };
        while sent < due {
            let out = c
                .check(std::slice::from_ref(&item))
                .await
                .expect("a lease client's check");
            let t = start.elapsed().as_micros() as u64;
            last_us = t;
            sent += 1;
            if out.admitted {
                admitted.push(t);
            } else if first_refusal.is_none() {
                first_refusal = Some(t);
            }
            if t >= total_us {
                break 'load;
            }
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    Sent {
        sent,
        admitted,
        first_refusal,
        stall_us,
        stall_end,
    }
}

/// The whole fleet's load, merged from its clients'.
struct Gathered {
    offered: u64,
    /// In no order: sorting waits until the clock has been read after the load.
    admitted_us: Vec<u64>,
    first_refusal_us: Option<u64>,
    longest_stall_us: u64,
    stall_end_us: u64,
}

/// Waits for every client and merges what they saw.
async fn gather(tasks: Vec<tokio::task::JoinHandle<Sent>>) -> Gathered {
    let mut all = Gathered {
        offered: 0,
        admitted_us: Vec::new(),
        first_refusal_us: None,
        longest_stall_us: 0,
        stall_end_us: 0,
    };
    for t in tasks {
        let s = t.await.expect("client task");
        if s.stall_us > all.longest_stall_us {
            (all.longest_stall_us, all.stall_end_us) = (s.stall_us, s.stall_end);
        }
        all.offered += s.sent;
        all.admitted_us.extend(s.admitted);
        all.first_refusal_us = match (all.first_refusal_us, s.first_refusal) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    all
}

/// The store's clock minus ours since `start`, µs, from the fastest of a few probes, and that
/// probe's round trip: the offset is early by at most the round trip.
async fn align(probe: &RedisStore, start: Instant) -> (i64, u64) {
    let (mut offset_us, mut align_us) = (0i64, u64::MAX);
    for _ in 0..5 {
        let sent = start.elapsed().as_micros() as u64;
        let store_now = probe.now_us().await.expect("probe the store's clock");
        let back = start.elapsed().as_micros() as u64;
        if back - sent < align_us {
            align_us = back - sent;
            offset_us = store_now as i64 - back as i64;
        }
    }
    (offset_us, align_us)
}

fn load_seconds(total_us: u64) -> f64 {
    total_us as f64 / 1e6
}
