//! Ten thousand idle keep-alive connections, two measurements in one run (benches/README.md
//! "Idle connections"):
//!
//! - **memory**: RSS growth per idle connection (one request each, then silent) of Tollgate
//!   (`--threads 1`, the express lane), of Tollgate on hyper's path (`--no-express`) and of
//!   nginx as a minimal keep-alive proxy (`benches/nginx/idle_proxy.conf`), all to one nginx
//!   `return 200` upstream, side by side;
//! - **p99**: the p99 latency of 32 active keep-alive clients on Tollgate (`--threads 1`)
//!   without and with the idle connections held open, alternating for `--rounds` rounds;
//! - **tls**: the memory measurement over TLS 1.3 (HTTP/1.1, the express lane), Tollgate with
//!   the demo certificate beside nginx with the same one (`benches/nginx/idle_tls_proxy.conf`).
//!
//! The harness raises its own descriptor limit (the gateways and nginx inherit it).
//!
//! Run: `cargo bench --bench idle_conns` (options after `--`: `--conns 10000 --active 32
//! --seconds 5 --rounds 2 --only memory|p99|tls`; `tls` runs only when asked for). Under `cargo test --all-targets` it only says
//! how to run it.

#[path = "../tests/common/mod.rs"]
mod common;

use common::bench::{Nginx, arg};

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Tollgate, repo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "bench-demo-key";

/// Resident memory of a process and its children (nginx's workers), in KiB.
fn tree_rss_kib(pid: u32) -> u64 {
    let own = common::rss_kib(pid);
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    own + children
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .map(tree_rss_kib)
        .sum::<u64>()
}

/// A client connection, plain or TLS: the harness measures the server, not its own side.
trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

/// How the harness connects: plain TCP, or TLS 1.3 trusting the demo certificate.
#[derive(Clone, Copy)]
enum Dial {
    Plain,
    Tls,
}

impl Dial {
    async fn connect(self, addr: SocketAddr) -> Box<dyn Conn> {
        match self {
            Dial::Plain => {
                let tcp = TcpStream::connect(addr).await.expect("connect");
                let _ = tcp.set_nodelay(true);
                Box::new(tcp)
            }
            // No ALPN, as wrk: HTTP/1.1.
            Dial::Tls => Box::new(common::tls::connect(addr, &[]).await),
        }
    }
}

/// Sends one GET on `conn` and reads its response (`Content-Length` framed); its status.
async fn request<S: Conn + ?Sized>(
    conn: &mut S,
    addr: SocketAddr,
    buf: &mut Vec<u8>,
) -> std::io::Result<u16> {
    let head = format!("GET /v1/orders HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {KEY}\r\n\r\n");
    conn.write_all(head.as_bytes()).await?;
    conn.flush().await?;
    Ok(common::read_framed(conn, buf).await?.0)
}

/// Opens `n` connections, 200 at a time, each after one request that got 200.
async fn open_idle(addr: SocketAddr, n: usize, dial: Dial) -> Vec<Box<dyn Conn>> {
    let mut conns = Vec::with_capacity(n);
    let mut set = tokio::task::JoinSet::new();
    let mut started = 0;
    while conns.len() < n {
        while started < n && set.len() < 200 {
            started += 1;
            set.spawn(async move {
                let mut tcp = dial.connect(addr).await;
                let status = request(&mut *tcp, addr, &mut Vec::new())
                    .await
                    .expect("first request");
                assert_eq!(status, 200, "an idle connection's first request");
                tcp
            });
        }
        conns.push(set.join_next().await.unwrap().unwrap());
    }
    conns
}

/// Growth of `pid`'s RSS per connection, in bytes, over `n` idle connections to `addr`.
async fn per_conn(addr: SocketAddr, pid: u32, n: usize, dial: Dial) -> (f64, u64) {
    // Warm-up: pools, allocator arenas and the upstream's connections, then let it settle.
    drop(open_idle(addr, 500, dial).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = tree_rss_kib(pid);
    let conns = open_idle(addr, n, dial).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = tree_rss_kib(pid);
    // They are still there and usable.
    let mut buf = Vec::new();
    for mut c in conns.into_iter().step_by((n / 50).max(1)) {
        assert_eq!(
            request(&mut *c, addr, &mut buf).await.expect("a sample request"),
            200
        );
    }
    ((after.saturating_sub(before) * 1024) as f64 / n as f64, after)
}

/// Measures [`per_conn`] on each of `servers` (name, address, pid) in turn and prints the
/// table, each ÷ the last server's figure (nginx's).
async fn memory_table(servers: &[(&str, SocketAddr, u32)], n: usize, dial: Dial) {
    let what = match dial {
        Dial::Plain => "idle connection",
        Dial::Tls => "idle TLS connection",
    };
    let mut rows = Vec::new();
    for &(name, addr, pid) in servers {
        let (bytes, rss) = per_conn(addr, pid, n, dial).await;
        println!("{name}: {bytes:.0} bytes per {what} (RSS {rss} KiB with them open)");
        rows.push((name, bytes, rss));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ngx = rows.last().expect("nginx is measured last").1;
    println!();
    println!("| server | RSS growth per {what} | RSS with {n} open | ÷ nginx |");
    println!("|---|---:|---:|---:|");
    for (name, bytes, rss) in &rows {
        println!(
            "| {name} | {bytes:.0} bytes | {:.1} MiB | {:.2} |",
            *rss as f64 / 1024.0,
            bytes / ngx
        );
    }
}

/// Runs `active` closed-loop keep-alive clients for `seconds`; every request's latency in µs.
async fn active_run(addr: SocketAddr, active: usize, seconds: f64) -> Vec<u64> {
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..active {
        set.spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            let _ = tcp.set_nodelay(true);
            let mut buf = Vec::new();
            let mut took = Vec::new();
            while Instant::now() < until {
                let t = Instant::now();
                let status = request(&mut tcp, addr, &mut buf)
                    .await
                    .expect("an active request");
                assert_eq!(status, 200, "an active client got {status}");
                took.push(t.elapsed().as_micros() as u64);
            }
            took
        });
    }
    let mut all = Vec::new();
    while let Some(r) = set.join_next().await {
        all.extend(r.unwrap());
    }
    all
}

fn quantile_ms(v: &mut [u64], q: f64) -> f64 {
    v.sort_unstable();
    let i = ((v.len() as f64 * q) as usize).min(v.len() - 1);
    v[i] as f64 / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gateway(rules: &Path, extra: &[&str]) -> Tollgate {
    let mut args = vec![
        "serve",
        "--rules",
        rules.to_str().unwrap(),
        "--threads",
        "1",
        // Idle keep-alive connections are closed at the idle timeout; keep them for the run.
        "--idle-timeout",
        "600s",
    ];
    args.extend_from_slice(extra);
    Tollgate::spawn_with_env(&args, &[("TOLLGATE_LOG", "warn")])
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("idle_conns: a benchmark, not a test; run `cargo bench --bench idle_conns`");
        return;
    }
    let n: usize = arg("--conns", 10_000);
    let active: usize = arg("--active", 32);
    let seconds: f64 = arg("--seconds", 5.0);
    let rounds: usize = arg("--rounds", 2);
    let only: String = arg("--only", String::new());
    let limit = rlimit::increase_nofile_limit(u64::MAX).expect("raise the descriptor limit");
    assert!(
        limit as usize > n + 1000,
        "the descriptor limit is {limit}: {n} connections need more (raise the hard limit)"
    );
    println!("{}", tollgate_testkit::machine_line());
    println!("descriptor limit {limit}; {n} idle connections, one request each");

    let dir = tempfile::tempdir().unwrap();
    let upstream = Nginx::start("upstream.conf", dir.path(), &[]);
    let rules = std::fs::read_to_string(repo().join("rules/bench.json"))
        .unwrap()
        .replace("http://127.0.0.1:8081", &format!("http://{}", upstream.addr()));
    let rules_path = dir.path().join("rules.json");
    std::fs::write(&rules_path, rules).unwrap();

    if only.is_empty() || only == "memory" {
        let conns = (n + 1000).to_string();
        let nginx = Nginx::start(
            "idle_proxy.conf",
            dir.path(),
            &[
                ("__UPSTREAM__", upstream.addr().to_string()),
                ("__CONNS__", conns.clone()),
                ("__NOFILE__", (n + 2000).to_string()),
            ],
        );
        let lane = gateway(&rules_path, &[]);
        let general = gateway(&rules_path, &["--no-express"]);
        let servers = [
            ("Tollgate, express lane (--threads 1)", lane.addr, lane.child.id()),
            (
                "Tollgate, hyper's path (--no-express --threads 1)",
                general.addr,
                general.child.id(),
            ),
            (
                "nginx 1.22, one worker, keep-alive proxy",
                nginx.addr(),
                nginx.child.id(),
            ),
        ];
        memory_table(&servers, n, Dial::Plain).await;
        println!();
    }

    if only.is_empty() || only == "p99" {
        let gw = gateway(&rules_path, &[]);
        let mut without = Vec::new();
        let mut with = Vec::new();
        let mut rates = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let mut lat = active_run(gw.addr, active, seconds).await;
            rates.0.push(lat.len() as f64 / seconds);
            let p = (quantile_ms(&mut lat, 0.5), quantile_ms(&mut lat, 0.99));
            println!(
                "round {}: without idle: {} requests, p50 {:.3} ms, p99 {:.3} ms",
                round + 1,
                lat.len(),
                p.0,
                p.1
            );
            without.push(p);
            let mut idle = open_idle(gw.addr, n, Dial::Plain).await;
            let mut lat = active_run(gw.addr, active, seconds).await;
            rates.1.push(lat.len() as f64 / seconds);
            let p = (quantile_ms(&mut lat, 0.5), quantile_ms(&mut lat, 0.99));
            println!(
                "round {}: with {n} idle: {} requests, p50 {:.3} ms, p99 {:.3} ms",
                round + 1,
                lat.len(),
                p.0,
                p.1
            );
            with.push(p);
            // Every idle connection is still open: nothing to read, no end of stream (the read,
            // polled once, is still waiting).
            let mut one = [0u8; 1];
            let mut open = 0;
            for c in idle.iter_mut() {
                if tokio::time::timeout(Duration::ZERO, c.read(&mut one))
                    .await
                    .is_err()
                {
                    open += 1;
                }
            }
            assert_eq!(open, n, "idle connections were closed during the active run");
            drop(idle);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let p50 = |v: &[(f64, f64)]| median(v.iter().map(|p| p.0).collect());
        let p99 = |v: &[(f64, f64)]| median(v.iter().map(|p| p.1).collect());
        println!();
        println!("| {active} active clients, median of {rounds} rounds | req/s | p50 ms | p99 ms |");
        println!("|---|---:|---:|---:|");
        println!(
            "| without idle connections | {:.0} | {:.3} | {:.3} |",
            median(rates.0.clone()),
            p50(&without),
            p99(&without)
        );
        println!(
            "| with {n} idle connections | {:.0} | {:.3} | {:.3} |",
            median(rates.1.clone()),
            p50(&with),
            p99(&with)
        );
        println!("p99 with ÷ without: {:.2}", p99(&with) / p99(&without));
    }

    if only == "tls" {
        let cert = repo().join("certs/demo-cert.pem");
        let key = repo().join("certs/demo-key.pem");
        let nginx = Nginx::start(
            "idle_tls_proxy.conf",
            dir.path(),
            &[
                ("__UPSTREAM__", upstream.addr().to_string()),
                ("__CONNS__", (n + 1000).to_string()),
                ("__NOFILE__", (n + 2000).to_string()),
                ("__CERT__", cert.display().to_string()),
                ("__KEY__", key.display().to_string()),
            ],
        );
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        let lane = gateway(&rules_path, &["--tls-cert", &cert, "--tls-key", &key]);
        let servers = [
            (
                "Tollgate, TLS 1.3, express lane (--threads 1)",
                lane.addr,
                lane.child.id(),
            ),
            ("nginx 1.22, TLS 1.3, one worker", nginx.addr(), nginx.child.id()),
        ];
        memory_table(&servers, n, Dial::Tls).await;
    }
}
