//! Serving shards (`--threads N`: N threads, each accepting on a listener of its own), on real
//! `tollgate serve` processes: the kernel spreads connections over the shards, the limits hold
//! over all of them as over one, on the embedded store and on a real redis-server, the
//! connection cap evicts across shards, a drain stops every shard, and one shard answers what
//! four answer.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{DemoUpstreamProc, Http, RedisServer, Tollgate};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SECRET: &str = "shard-test-key";
/// SHA-256 of `SECRET`.
fn secret_sha() -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(SECRET.as_bytes()))
}

/// One key with a burst of `burst` that refills one token an hour: within a test, exactly
/// `burst` requests are admitted, whatever the timing.
fn rules(upstream: SocketAddr, burst: u64) -> String {
    serde_json::json!({
        "version": 1,
        "upstreams": {"orders": {"url": format!("http://{upstream}")}},
        "limits": {"plan": {"dimension": "key"}},
        "routes": [{"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "orders", "cost": {"plan": 1}}],
        "keys": [{
            "id": "k-shard",
            "sha256": secret_sha(),
            "limits": {"plan": {"rate": "1/3600s", "burst": burst}}
        }]
    })
    .to_string()
}

/// A response's status and its `RateLimit` field.
async fn answer(tcp: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        if let Ok(httparse::Status::Complete(len)) = resp.parse(&buf) {
            let field = |name: &str| {
                resp.headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case(name))
                    .map(|h| String::from_utf8_lossy(h.value).into_owned())
            };
            let body: usize = field("content-length")
                .expect("a content-length")
                .parse()
                .unwrap();
            if buf.len() >= len + body {
                return (resp.code.unwrap(), field("ratelimit").unwrap_or_default());
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(20), tcp.read(&mut chunk))
            .await
            .expect("the gateway answers")
            .expect("read a response");
        assert!(n > 0, "the gateway closed a connection mid-request");
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn get(tcp: &mut TcpStream) -> (u16, String) {
    let head = format!("GET /v1/orders HTTP/1.1\r\nHost: gw\r\nX-API-Key: {SECRET}\r\n\r\n");
    tcp.write_all(head.as_bytes()).await.expect("write");
    answer(tcp).await
}

async fn metrics(http: &Http, gw: &Tollgate) -> String {
    String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned()
}

/// Connections accepted by each shard, from `tollgate_connections_accepted_total{shard="i"}`.
fn accepted_by_shard(metrics: &str) -> Vec<(u32, u64)> {
    let mut by: Vec<(u32, u64)> = metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("tollgate_connections_accepted_total{shard=\"")?;
            let (shard, value) = rest.split_once("\"} ")?;
            Some((shard.parse().ok()?, value.trim().parse().ok()?))
        })
        .collect();
    by.sort_unstable();
    by
}

/// The names of the process's threads.
fn thread_names(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc/PID/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect();
    names.sort();
    names
}

/// Sends `per_conn` requests on each of `conns` connections opened at once; the statuses.
async fn storm(addr: SocketAddr, conns: usize, per_conn: usize) -> Vec<u16> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        set.spawn(async move {
            let mut tcp = TcpStream::connect(addr).await.expect("connect");
            let mut got = Vec::new();
            for _ in 0..per_conn {
                got.push(get(&mut tcp).await.0);
            }
            got
        });
    }
    let mut all = Vec::new();
    while let Some(r) = set.join_next().await {
        all.extend(r.unwrap());
    }
    all
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

async fn one_limit_over_four_shards(store: &[&str]) {
    let upstream = DemoUpstreamProc::spawn(2, 0);
    let (_dir, path) = common::rules_file(&rules(upstream.addr, 60));
    let mut args = vec!["serve", "--rules", path.to_str().unwrap(), "--threads", "4"];
    args.extend_from_slice(store);
    let mut gw = Tollgate::spawn(&args);
    // A thread names itself once it runs, a moment after the gateway says it listens.
    let want: Vec<String> = (1..4).map(|i| format!("shard-{i}")).collect();
    let named = |names: &[String]| want.iter().all(|w| names.contains(w));
    let started = std::time::Instant::now();
    let mut names = thread_names(gw.child.id());
    while !named(&names) && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        names = thread_names(gw.child.id());
    }
    assert!(named(&names), "not every shard among the threads {names:?}");

    let statuses = storm(gw.addr, 64, 2).await;
    assert_eq!(
        count(&statuses, 200),
        60,
        "admitted across the shards: {statuses:?}"
    );
    assert_eq!(
        count(&statuses, 429),
        68,
        "refused across the shards: {statuses:?}"
    );

    let http = Http::new();
    let by = accepted_by_shard(&metrics(&http, &gw).await);
    let total: u64 = by.iter().map(|(_, n)| n).sum();
    assert_eq!(total, 64, "every connection counted once: {by:?}");
    let serving = by.iter().filter(|(_, n)| *n > 0).count();
    assert!(serving >= 2, "64 connections all on one shard: {by:?}");
    assert!(by.iter().all(|(s, _)| *s < 4), "a shard past --threads 4: {by:?}");

    let (_, stderr) = gw.stop();
    assert!(
        gw.child.wait().unwrap().success(),
        "did not drain cleanly: {stderr}"
    );
}

#[tokio::test]
async fn one_limit_holds_over_four_shards_on_the_embedded_store() {
    one_limit_over_four_shards(&[]).await;
}

#[tokio::test]
async fn one_limit_holds_over_four_shards_on_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    one_limit_over_four_shards(&["--store", &url, "--store-timeout", "500ms"]).await;
}

/// One shard and four answer a run of requests alike, status and `RateLimit` field: the
/// shards change which thread serves, not what is answered.
#[tokio::test]
async fn four_shards_answer_as_one() {
    let upstream = DemoUpstreamProc::spawn(2, 0);
    let (_dir, path) = common::rules_file(&rules(upstream.addr, 12));
    let mut runs = Vec::new();
    for threads in ["1", "4"] {
        let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap(), "--threads", threads]);
        let mut answers = Vec::new();
        // A new connection for each request, so that with four shards they land on several.
        for _ in 0..20 {
            let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
            let (status, ratelimit) = get(&mut tcp).await;
            // The remaining tokens (`r`); `t` counts seconds on the clock and may tick between
            // the two runs.
            let r = ratelimit
                .split(';')
                .find(|p| p.starts_with("r="))
                .unwrap_or("")
                .to_owned();
            answers.push((status, r));
        }
        runs.push(answers);
    }
    assert_eq!(runs[0], runs[1], "one shard and four answered differently");
    assert_eq!(runs[0].iter().filter(|(s, _)| *s == 200).count(), 12);
    assert_eq!(runs[0][11], (200, "r=0".to_owned()));
}

/// A full `--max-connections` closes the connection idle longest, whichever shard holds it.
#[tokio::test]
async fn the_connection_cap_evicts_across_shards() {
    let upstream = DemoUpstreamProc::spawn(2, 0);
    let (_dir, path) = common::rules_file(&rules(upstream.addr, 1000));
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--threads",
        "4",
        "--max-connections",
        "8",
    ]);
    let mut conns = Vec::new();
    for _ in 0..8 {
        let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
        assert_eq!(get(&mut tcp).await.0, 200);
        conns.push(tcp);
        // Each goes idle before the next opens, so the idle order is the opening order.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let by = accepted_by_shard(&metrics(&Http::new(), &gw).await);
    assert!(
        by.iter().filter(|(_, n)| *n > 0).count() >= 2,
        "eight connections all on one shard: {by:?}"
    );
    // Four newcomers: each closes the oldest idle one, wherever it is.
    for _ in 0..4 {
        let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
        assert_eq!(get(&mut tcp).await.0, 200, "a newcomer was refused");
        conns.push(tcp);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (i, tcp) in conns.iter_mut().enumerate() {
        let mut one = [0u8; 1];
        // The closed ones were closed before their newcomer was answered; the others get a
        // short look.
        let wait = Duration::from_millis(if i < 4 { 5000 } else { 200 });
        let closed = matches!(
            tokio::time::timeout(wait, tcp.read(&mut one)).await,
            Ok(Ok(0)) | Ok(Err(_))
        );
        assert_eq!(closed, i < 4, "connection {i}: closed {closed}");
    }
}
