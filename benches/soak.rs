//! A long soak of one gateway on Redis under steady load, with rules reloads, redis-server
//! restarts and connection churn (benches/README.md "Soak").
//!
//! Real processes: one redis-server (restarted on the same port every `--restart-every`
//! seconds, losing its buckets), one `tollgate demo-upstream`, one `tollgate serve`. The harness
//! first measures the gateway's capacity with 32 closed-loop keep-alive clients for 5 s, then
//! drives `--fraction` of it (0.5) open loop for `--minutes` over `--keys` keys, a tenth of the
//! requests each on a connection of its own (opened, one request with `Connection: close`,
//! closed). Every `--reload-every` seconds it writes the next rules version (a rename over the
//! file, as `mv` does). Every `--sample-every` seconds it prints the gateway's resident memory,
//! its open descriptors, the rules version it runs and the answers so far.
//!
//! The plan limit fails `local` and the `guarded` route's limit fails `closed`, so while Redis
//! restarts the orders keep being decided from local shares and guarded requests get the 503
//! that policy prescribes. At the end it checks: resident memory over the last minute within 5%
//! of that over the second (medians of the samples), descriptors flat (within 16 of it), no 5xx but those `503
//! limiter_unavailable` answers on the guarded route, no connection error, and every reload
//! taken. It exits non-zero when one fails.
//!
//! The gateway allocates with jemalloc; `--arena-max N` sets `MALLOC_ARENA_MAX` for a gateway on
//! glibc's malloc (an older build through `TOLLGATE_BIN`; benches/README.md "Soak").
//!
//! Run: `cargo bench --bench soak -- --minutes 20` (CI does not: under `cargo test
//! --all-targets` it only says how to run it).

#[path = "../tests/common/mod.rs"]
mod common;

use common::bench::arg;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{DemoUpstreamProc, RedisServer, Tollgate};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn secret(i: usize) -> String {
    format!("soak-key-{i}")
}

/// The rules of version `version`: `keys` keys on a plan that fails `local`, and a `guarded`
/// route whose own limit fails `closed`.
fn rules(version: u64, upstream: SocketAddr, keys: usize) -> String {
    let keys: Vec<serde_json::Value> = (0..keys)
        .map(|i| {
            serde_json::json!({
                "id": format!("k-{i}"),
                "sha256": hex::encode(Sha256::digest(secret(i).as_bytes())),
            })
        })
        .collect();
    serde_json::json!({
        "version": version,
        "upstreams": {"orders": {"url": format!("http://{upstream}")}},
        "limits": {
            "plan": {"dimension": "key", "rate": "50/1s", "burst": 100, "on_store_failure": "local",
                     "description": format!("version {version}")},
            "guard": {"dimension": "route", "rate": "1000/1s", "burst": 1000, "on_store_failure": "closed"}
        },
        "keys": keys,
        "routes": [
            {"method": "GET", "path": "/v1/guarded", "upstream": "orders", "cost": {"plan": 1, "guard": 1}},
            {"method": "GET", "path": "/v1", "upstream": "orders", "cost": {"plan": 1}}
        ]
    })
    .to_string()
}

/// Writes the file beside and renames it over `path`, as `mv` does: the watcher never reads
/// half a file.
fn write_rules(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// One GET; its status and whether it was a `limiter_unavailable` answer.
async fn request(tcp: &mut TcpStream, head: &str, buf: &mut Vec<u8>) -> std::io::Result<(u16, bool)> {
    tcp.write_all(head.as_bytes()).await?;
    let (status, body) = common::read_framed(tcp, buf).await?;
    let unavailable = buf[body].windows(19).any(|w| w == b"limiter_unavailable");
    Ok((status, unavailable))
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    limited: AtomicU64,
    /// 503 limiter_unavailable on the guarded route: what its `closed` policy prescribes.
    prescribed: AtomicU64,
    other: AtomicU64,
    errors: AtomicU64,
    fresh: AtomicU64,
}

impl Counts {
    fn add(&self, guarded: bool, answer: std::io::Result<(u16, bool)>) {
        let c = match answer {
            Ok((200, _)) => &self.ok,
            Ok((429, _)) => &self.limited,
            Ok((503, true)) if guarded => &self.prescribed,
            Ok((status, _)) => {
                eprintln!("soak: unexpected status {status}");
                &self.other
            }
            Err(e) => {
                eprintln!("soak: connection error: {e}");
                &self.errors
            }
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn line(&self) -> String {
        format!(
            "200 {} · 429 {} · 503 prescribed {} · other {} · errors {} · fresh connections {}",
            self.ok.load(Ordering::Relaxed),
            self.limited.load(Ordering::Relaxed),
            self.prescribed.load(Ordering::Relaxed),
            self.other.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.fresh.load(Ordering::Relaxed),
        )
    }
}

fn head(addr: SocketAddr, n: u64, keys: usize, close: bool) -> (String, bool) {
    let guarded = n % 10 == 3;
    let path = if guarded { "/v1/guarded" } else { "/v1/orders" };
    // Knuth's multiplicative hash spreads consecutive requests over the keys.
    let key = secret((n.wrapping_mul(2_654_435_761) % keys as u64) as usize);
    let conn = if close { "Connection: close\r\n" } else { "" };
    (
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {key}\r\n{conn}\r\n"),
        guarded,
    )
}

/// 32 closed-loop keep-alive clients for `seconds`: requests per second, every answer counted.
async fn capacity(addr: SocketAddr, keys: usize, seconds: f64) -> f64 {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let done = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for w in 0..32u64 {
        let done = done.clone();
        set.spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            let _ = tcp.set_nodelay(true);
            let mut buf = Vec::new();
            let mut n = w;
            while Instant::now() < until {
                let (h, _) = head(addr, n, keys, false);
                request(&mut tcp, &h, &mut buf).await.expect("a capacity request");
                done.fetch_add(1, Ordering::Relaxed);
                n += 32;
            }
        });
    }
    while set.join_next().await.is_some() {}
    done.load(Ordering::Relaxed) as f64 / seconds
}

/// One open-loop worker: `rate` requests a second until `until`, every tenth on a fresh
/// connection. A worker that falls behind skips the missed slots rather than bursting.
async fn worker(
    addr: SocketAddr,
    w: u64,
    workers: u64,
    rate: f64,
    keys: usize,
    until: Instant,
    counts: Arc<Counts>,
) {
    let every = Duration::from_secs_f64(1.0 / rate);
    let mut kept: Option<TcpStream> = None;
    let mut buf = Vec::new();
    let mut next = Instant::now() + every.mul_f64(w as f64 / workers as f64);
    let mut n = w;
    while next < until {
        tokio::time::sleep_until(next.into()).await;
        let fresh = (n / workers) % 10 == 7;
        let (h, guarded) = head(addr, n, keys, fresh);
        let answer = if fresh {
            counts.fresh.fetch_add(1, Ordering::Relaxed);
            match TcpStream::connect(addr).await {
                Ok(mut tcp) => request(&mut tcp, &h, &mut buf).await,
                Err(e) => Err(e),
            }
        } else {
            if kept.is_none() {
                kept = TcpStream::connect(addr).await.ok();
                if let Some(t) = &kept {
                    let _ = t.set_nodelay(true);
                }
            }
            match kept.as_mut() {
                Some(tcp) => {
                    let a = request(tcp, &h, &mut buf).await;
                    if a.is_err() {
                        kept = None;
                    }
                    a
                }
                None => Err(std::io::ErrorKind::ConnectionRefused.into()),
            }
        };
        counts.add(guarded, answer);
        n += workers;
        next += every;
        let now = Instant::now();
        while next < now {
            next += every;
        }
    }
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

async fn running_version(http: &common::Http, gw: &Tollgate) -> u64 {
    http.get(&gw.admin_url("/admin/rules"), &[]).await.json()["version"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("soak: a benchmark, not a test; run `cargo bench --bench soak -- --minutes 20`");
        return;
    }
    let minutes: f64 = arg("--minutes", 20.0);
    let fraction: f64 = arg("--fraction", 0.5);
    let keys: usize = arg("--keys", 1000);
    let reload_every = Duration::from_secs(arg("--reload-every", 10));
    let restart_every = Duration::from_secs(arg("--restart-every", 300));
    let sample_every = Duration::from_secs(arg("--sample-every", 10));
    let arena_max: u32 = arg("--arena-max", 0);
    println!("{}", tollgate_testkit::machine_line());

    let port = common::free_port();
    let mut redis = Some(RedisServer::start_on(port));
    let upstream = DemoUpstreamProc::spawn(2, 0);
    let dir = tempfile::tempdir().unwrap();
    let rules_path = dir.path().join("rules.json");
    let mut version = 1;
    write_rules(&rules_path, &rules(version, upstream.addr, keys));
    let store = format!("redis://127.0.0.1:{port}");
    let arena = arena_max.to_string();
    let mut env = vec![("TOLLGATE_LOG", "warn")];
    if arena_max > 0 {
        env.push(("MALLOC_ARENA_MAX", &arena));
    }
    let gw = Tollgate::spawn_with_env(
        &[
            "serve",
            "--rules",
            rules_path.to_str().unwrap(),
            "--store",
            &store,
        ],
        &env,
    );
    let pid = gw.child.id();
    let http = common::Http::new();

    capacity(gw.addr, keys, 2.0).await;
    let cap = capacity(gw.addr, keys, 5.0).await;
    let rate = cap * fraction;
    println!(
        "capacity {cap:.0} req/s (32 keep-alive clients, 5 s); soak at {rate:.0} req/s for {minutes} min over {keys} keys; \
         reload every {reload_every:?}, redis-server restart every {restart_every:?}; MALLOC_ARENA_MAX {}",
        if arena_max > 0 { arena.as_str() } else { "unset" }
    );

    let started = Instant::now();
    let until = started + Duration::from_secs_f64(minutes * 60.0);
    let counts = Arc::new(Counts::default());
    let workers = 64u64;
    let mut set = tokio::task::JoinSet::new();
    for w in 0..workers {
        set.spawn(worker(
            gw.addr,
            w,
            workers,
            rate / workers as f64,
            keys,
            until,
            counts.clone(),
        ));
    }

    let mut next_reload = started + reload_every;
    let mut next_restart = started + restart_every;
    let mut next_sample = started + sample_every;
    let mut samples: Vec<(f64, u64, usize)> = Vec::new();
    let mut restarts = 0;
    println!("| t (s) | RSS (KiB) | open fds | rules version | answers so far |");
    println!("|---:|---:|---:|---:|---|");
    while Instant::now() < until {
        let wake = next_reload.min(next_restart).min(next_sample).min(until);
        tokio::time::sleep_until(wake.into()).await;
        let now = Instant::now();
        if now >= next_reload {
            version += 1;
            write_rules(&rules_path, &rules(version, upstream.addr, keys));
            next_reload += reload_every;
        }
        if now >= next_restart {
            drop(redis.take());
            redis = Some(RedisServer::start_on(port));
            restarts += 1;
            next_restart += restart_every;
        }
        if now >= next_sample {
            let t = now.duration_since(started).as_secs_f64();
            let (rss, fd) = (common::rss_kib(pid), fds(pid));
            let v = running_version(&http, &gw).await;
            println!("| {t:.0} | {rss} | {fd} | {v} | {} |", counts.line());
            samples.push((t, rss, fd));
            next_sample += sample_every;
        }
    }
    while set.join_next().await.is_some() {}
    // The last reload a moment to land, then the final sample.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss, fd) = (common::rss_kib(pid), fds(pid));
    let v = running_version(&http, &gw).await;
    let t = started.elapsed().as_secs_f64();
    println!("| {t:.0} (end) | {rss} | {fd} | {v} | {} |", counts.line());
    drop(redis);

    let mut failed = Vec::new();
    let Some(&(t1, _, fd1)) = samples.iter().find(|s| s.0 >= 60.0).or(samples.first()) else {
        panic!("no sample taken: run for longer than --sample-every");
    };
    // Resident memory saws up and down by a megabyte or so as buffers come and go, so one
    // sample against another says more about the saw than the trend: compare the median of
    // the minute after the first with that of the last minute.
    let median = |from: f64, to: f64| {
        let mut v: Vec<u64> = samples
            .iter()
            .filter(|s| s.0 >= from && s.0 < to)
            .map(|s| s.1)
            .collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied()
    };
    let end = samples.last().map_or(0.0, |s| s.0);
    let (Some(rss1), Some(rss_end)) = (median(t1, t1 + 60.0), median(end - 60.0, end + 1.0)) else {
        panic!("too few samples: run for longer");
    };
    let growth = (rss_end as f64 - rss1 as f64) / rss1 as f64;
    println!(
        "RSS median {rss1} KiB over [{t1:.0}, {:.0}) s, {rss_end} KiB over the last minute: {:+.2}% \
         (last sample {rss} KiB); fds {fd1} -> {fd}; {restarts} redis-server restarts; rules version {v} of {version} written",
        t1 + 60.0,
        growth * 100.0
    );
    if growth.abs() > 0.05 {
        failed.push(format!(
            "resident memory moved {:+.2}% (medians of the second and the last minute)",
            growth * 100.0
        ));
    }
    if fd > fd1 + 16 {
        failed.push(format!("open descriptors grew from {fd1} to {fd}"));
    }
    for (what, c) in [
        ("other answers", &counts.other),
        ("connection errors", &counts.errors),
    ] {
        let c = c.load(Ordering::Relaxed);
        if c > 0 {
            failed.push(format!("{c} {what}"));
        }
    }
    if v != version {
        failed.push(format!(
            "the gateway runs rules version {v}, the file holds {version}"
        ));
    }
    if failed.is_empty() {
        println!("soak passed");
    } else {
        println!("soak FAILED: {}", failed.join("; "));
        // `exit` runs no destructors: stop the processes first, or they outlive the bench.
        drop((gw, upstream));
        std::process::exit(1);
    }
}
