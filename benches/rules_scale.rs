//! Rules at scale (issue #24, benches/README.md "Rules at scale"): per size of a partner-like
//! rules file (1k to 1M keys) its bytes, compile time, the resident memory the compiled snapshot
//! keeps per key and the peak during compile; then a 100k-key file reloaded into a real gateway
//! under load: the time to swap, the gateway's memory around it and every failed request.
//!
//! Each size compiles in a fresh child process (this binary again, `--child FILE`), so its
//! `VmHWM` is the compile's own peak and its `VmRSS` growth is what the snapshot keeps once the
//! parse is over.
//!
//! Run: `cargo bench --bench rules_scale` (options after `--`: `--sizes 1000,10000,100000,1000000`,
//! `--swap-keys 100000`, `--reloads 3`, `--only memory|swap`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{DemoUpstreamProc, Tollgate};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn secret(i: usize) -> String {
    format!("rs-key-{i}")
}

/// Plan tiers a partner is on: (rate, burst), every burst at least the exports route's cost.
const TIERS: [(&str, u64); 4] = [
    ("600/60s", 20),
    ("20/1s", 40),
    ("100/1s", 200),
    ("10000/1s", 20000),
];

/// A rules file shaped like a partner file: every key with an id, a name, its SHA-256 and its
/// plan's numbers; one key in four is a second app of the tenant before it (same numbers), and
/// one tenant in ten has a contract of its own on `tokens` (numbers no other tenant shares).
fn write_rules(path: &Path, version: u64, upstream: &str, keys: usize) -> u64 {
    let tmp = path.with_extension("tmp");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp).unwrap());
    write!(
        out,
        r#"{{"version": {version},
"upstreams": {{"orders": {{"url": "http://{upstream}"}}}},
"limits": {{
 "plan": {{"dimension": "key"}},
 "tokens": {{"dimension": "key", "rate": "1000/60s", "burst": 1000}},
 "exports": {{"dimension": "route", "rate": "1/5s", "burst": 1}},
 "unauth": {{"dimension": "ip", "rate": "1/1s", "burst": 5}}
}},
"routes": [
 {{"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "orders", "cost": {{"plan": 1}}}},
 {{"name": "exports", "method": "POST", "path": "/v1/exports", "upstream": "orders", "cost": {{"plan": 10, "exports": 1}}}},
 {{"name": "v1", "method": "*", "path": "/v1/", "upstream": "orders", "cost": {{"plan": 1, "tokens": 1}}}}
],
"unauthenticated": {{"limit": "unauth"}},
"keys": ["#
    )
    .unwrap();
    for i in 0..keys {
        // Keys 4n+3 are the second app of tenant 4n+2.
        let tenant = if i % 4 == 3 { i - 1 } else { i };
        let (rate, burst) = TIERS[(tenant * 7 / 3) % TIERS.len()];
        let sha = hex::encode(Sha256::digest(secret(i).as_bytes()));
        let sep = if i + 1 < keys { "," } else { "" };
        write!(
            out,
            r#"
 {{"id": "k-{i}", "tenant": "partner-{tenant}", "name": "Partner {tenant} app {i}", "sha256": "{sha}", "limits": {{"plan": {{"rate": "{rate}", "burst": {burst}}}"#
        )
        .unwrap();
        if tenant % 10 == 0 {
            write!(
                out,
                r#", "tokens": {{"rate": "{}/60s", "burst": 10000}}"#,
                10_000 + tenant
            )
            .unwrap();
        }
        write!(out, "}}}}{sep}").unwrap();
    }
    writeln!(out, "\n]}}").unwrap();
    out.flush().unwrap();
    drop(out);
    std::fs::rename(&tmp, path).unwrap();
    std::fs::metadata(path).unwrap().len()
}

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("/proc/self/status")
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

/// The child: compiles one file and prints `keys micros rss_before rss_after hwm` (KiB).
fn child(path: &str) {
    // Warm the allocator and the code with a small file, so the measure starts from a process
    // that has compiled rules before.
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.json");
    write_rules(&small, 1, "127.0.0.1:9", 16);
    let warm = tollgate_rules::load(&small, tollgate_rules::CompileOptions::default()).expect("small rules");
    drop(warm);
    let before = status_kib("VmRSS:");
    let started = Instant::now();
    let snap = tollgate_rules::load(Path::new(path), tollgate_rules::CompileOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let took = started.elapsed();
    let after = status_kib("VmRSS:");
    let hwm = status_kib("VmHWM:");
    println!("{} {} {before} {after} {hwm}", snap.keys.len(), took.as_micros());
    drop(snap);
}

fn memory(sizes: &[usize]) {
    println!("| keys | file | compile | snapshot RSS | per key | peak RSS during compile (growth) |");
    println!("|---:|---:|---:|---:|---:|---:|");
    let dir = tempfile::tempdir().unwrap();
    for &n in sizes {
        let path = dir.path().join(format!("rules-{n}.json"));
        let bytes = write_rules(&path, 1, "127.0.0.1:9", n);
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--child", path.to_str().unwrap()])
            .output()
            .expect("the child");
        assert!(
            out.status.success(),
            "child for {n} keys: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<u64> = text.split_whitespace().map(|x| x.parse().unwrap()).collect();
        let [keys, micros, before, after, hwm] = v[..] else {
            panic!("child printed {text:?}");
        };
        assert_eq!(keys as usize, n, "the snapshot holds every key");
        let grown = after.saturating_sub(before) * 1024;
        println!(
            "| {n} | {:.1} MB | {:.3} s | {:.1} MiB | {:.0} B | {:.1} MiB ({:.1} MiB) |",
            bytes as f64 / 1e6,
            micros as f64 / 1e6,
            grown as f64 / 1048576.0,
            grown as f64 / n as f64,
            hwm as f64 / 1024.0,
            hwm.saturating_sub(before) as f64 / 1024.0,
        );
        let _ = std::fs::remove_file(&path);
    }
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
    errors: AtomicU64,
}

/// One closed-loop keep-alive client over random keys until `stop`.
async fn client(addr: SocketAddr, w: u64, keys: usize, stop: Arc<AtomicBool>, counts: Arc<Counts>) {
    let mut tcp: Option<TcpStream> = None;
    let mut buf = Vec::new();
    let mut n = w;
    while !stop.load(Ordering::Relaxed) {
        // Knuth's multiplicative hash spreads consecutive requests over the keys.
        let key = secret((n.wrapping_mul(2_654_435_761) % keys as u64) as usize);
        n += 64;
        let head = format!("GET /v1/orders HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {key}\r\n\r\n");
        if tcp.is_none() {
            match TcpStream::connect(addr).await {
                Ok(t) => {
                    let _ = t.set_nodelay(true);
                    tcp = Some(t);
                }
                Err(e) => {
                    eprintln!("rules_scale: connect: {e}");
                    counts.errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
        }
        let t = tcp.as_mut().unwrap();
        let answer = match t.write_all(head.as_bytes()).await {
            Ok(()) => common::read_framed(t, &mut buf).await.map(|(s, _)| s),
            Err(e) => Err(e),
        };
        let c = match answer {
            Ok(200) => &counts.ok,
            Ok(429) => &counts.limited,
            Ok(s) => {
                eprintln!("rules_scale: status {s}");
                &counts.other
            }
            Err(e) => {
                eprintln!("rules_scale: {e}");
                tcp = None;
                &counts.errors
            }
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

async fn running_version(http: &common::Http, gw: &Tollgate) -> u64 {
    http.get(&gw.admin_url("/admin/rules"), &[]).await.json()["version"]
        .as_u64()
        .unwrap_or(0)
}

async fn swap(keys: usize, reloads: u64) {
    let upstream = DemoUpstreamProc::spawn(2, 0);
    let dir = tempfile::tempdir().unwrap();
    let up = upstream.addr.to_string();
    // MALLOC_ARENA_MAX reaches only a gateway on glibc's malloc (an older build through
    // TOLLGATE_BIN), as the Dockerfile ran those; this tree's allocates with jemalloc.
    let env = [("TOLLGATE_LOG", "warn"), ("MALLOC_ARENA_MAX", "2")];

    // The same gateway with no keys, for the memory beside.
    let empty_path = dir.path().join("empty.json");
    write_rules(&empty_path, 1, &up, 0);
    let empty = Tollgate::spawn_with_env(&["serve", "--rules", empty_path.to_str().unwrap()], &env);

    let path = dir.path().join("rules.json");
    let bytes = write_rules(&path, 1, &up, keys);
    let started = Instant::now();
    let gw = Tollgate::spawn_with_env(&["serve", "--rules", path.to_str().unwrap()], &env);
    let start = started.elapsed();
    let pid = gw.child.id();
    let http = common::Http::new();
    let (rss_empty, rss_full) = (common::rss_kib(empty.child.id()), common::rss_kib(pid));
    println!(
        "{keys} keys ({:.1} MB): gateway up in {:.2} s; RSS {rss_full} KiB beside {rss_empty} KiB with no keys: {:.0} B per key",
        bytes as f64 / 1e6,
        start.as_secs_f64(),
        (rss_full.saturating_sub(rss_empty) * 1024) as f64 / keys as f64
    );

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let mut set = tokio::task::JoinSet::new();
    for w in 0..16 {
        set.spawn(client(gw.addr, w, keys, stop.clone(), counts.clone()));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let warm_rss = common::rss_kib(pid);
    println!("under load (16 keep-alive clients): RSS {warm_rss} KiB");
    println!(
        "| reload | written → running (incl. the watcher's 100 ms debounce) | RSS before | peak RSS | RSS 2 s after | RSS 12 s after |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for v in 2..2 + reloads {
        // Written beside and renamed over, as `mv` does.
        let next = dir.path().join("next.json");
        write_rules(&next, v, &up, keys);
        let rss_before = common::rss_kib(pid);
        let t0 = Instant::now();
        std::fs::rename(&next, &path).unwrap();
        let mut peak = rss_before;
        let took = loop {
            peak = peak.max(common::rss_kib(pid));
            if running_version(&http, &gw).await == v {
                break t0.elapsed();
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "version {v} never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        // Two seconds, then past the allocator's decay time (10 s), when what the old
        // snapshot freed has gone back to the system.
        let mut after = [0; 2];
        for (i, secs) in [2, 12].into_iter().enumerate() {
            let settle = t0 + took + Duration::from_secs(secs);
            while Instant::now() < settle {
                peak = peak.max(common::rss_kib(pid));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            after[i] = common::rss_kib(pid);
        }
        println!(
            "| v{v} | {:.3} s | {rss_before} KiB | {peak} KiB | {} KiB | {} KiB |",
            took.as_secs_f64(),
            after[0],
            after[1]
        );
    }
    stop.store(true, Ordering::Relaxed);
    while set.join_next().await.is_some() {}
    let (ok, limited, other, errors) = (
        counts.ok.load(Ordering::Relaxed),
        counts.limited.load(Ordering::Relaxed),
        counts.other.load(Ordering::Relaxed),
        counts.errors.load(Ordering::Relaxed),
    );
    println!("answers: 200 {ok} · 429 {limited} · other {other} · connection errors {errors}");
    assert_eq!(other + errors, 0, "a request failed across the reloads");
    drop(empty);
}

#[tokio::main]
async fn main() {
    if let Some(path) = arg("--child") {
        child(&path);
        return;
    }
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("rules_scale: a benchmark, not a test; run `cargo bench --bench rules_scale`");
        return;
    }
    println!("{}", tollgate_testkit::machine_line());
    let only = arg("--only");
    let sizes: Vec<usize> = arg("--sizes")
        .unwrap_or_else(|| "1000,10000,100000,1000000".into())
        .split(',')
        .map(|s| s.parse().expect("--sizes: numbers"))
        .collect();
    if only.as_deref() != Some("swap") {
        memory(&sizes);
    }
    if only.as_deref() != Some("memory") {
        let keys = arg("--swap-keys").map_or(100_000, |s| s.parse().expect("--swap-keys"));
        let reloads = arg("--reloads").map_or(3, |s| s.parse().expect("--reloads"));
        swap(keys, reloads).await;
    }
}
