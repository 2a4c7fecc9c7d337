//! Metering on a Redis Cluster, against real processes: two gateways on three primaries (each
//! with a replica) write their usage records, `tollgate meter --once` adds them up into a
//! ledger whose keys share one hash tag, and `tollgate meter usage` bills each key exactly what
//! the gateways admitted; a second pass over the same records changes nothing. Then the primary
//! that holds the ledger is killed while a meter runs and the gateways admit: nothing is lost or
//! counted twice. Last, a key's quota, flagged by the meter in the cluster, is refused by a
//! gateway on it.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Http, K7, RedisCluster, Tollgate};
use http::StatusCode;

async fn send_k7(http: &Http, gw: &Tollgate, n: usize) -> u64 {
    let mut admitted = 0;
    for i in 0..n {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        match r.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("request {i}: {other} {}", r.body_text()),
        }
    }
    admitted
}

/// `tollgate meter [SUB] --store URL --rules RULES ARGS…`: its stdout, or the test fails with
/// its stderr.
fn meter(sub: Option<&str>, url: &str, rules: &std::path::Path, args: &[&str]) -> String {
    let mut cmd = Command::new(common::gateway_bin());
    cmd.arg("meter");
    if let Some(s) = sub {
        cmd.arg(s);
    }
    let out = cmd
        .args(["--store", url, "--rules", rules.to_str().unwrap()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("tollgate meter runs");
    assert!(
        out.status.success(),
        "tollgate meter {sub:?} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_a_cluster_are_billed_what_they_admitted() {
    let mut cluster = RedisCluster::with_replicas(500);
    let url = cluster.url();
    let upstream = common::start_demo_upstream().await;
    let (_dir, rules) = common::rules_file(&common::demo_rules_for(upstream));
    let spawn = |name: &str| {
        Tollgate::spawn(&[
            "serve",
            "--rules",
            rules.to_str().unwrap(),
            "--store",
            &url,
            "--instance",
            name,
            "--meter-interval",
            "100ms",
        ])
    };
    let (mut a, mut b) = (spawn("gw-a"), spawn("gw-b"));
    let http = Http::new();
    let admitted = send_k7(&http, &a, 12).await + send_k7(&http, &b, 12).await;
    assert!(admitted > 0);
    for gw in [&mut a, &mut b] {
        gw.stop();
    }

    meter(None, &url, &rules, &["--once"]);
    let usage = meter(Some("usage"), &url, &rules, &["--key", "k-7"]);
    let v: serde_json::Value = serde_json::from_str(&usage).unwrap_or_else(|e| panic!("{e}: {usage}"));
    assert_eq!(v["admitted"], admitted, "{v}");
    assert_eq!(v["unclean_ends"], 0, "both stopped cleanly: {v}");

    // The same records again (a second consumer's pass) change nothing.
    meter(None, &url, &rules, &["--once"]);
    let again: serde_json::Value =
        serde_json::from_str(&meter(Some("usage"), &url, &rules, &["--key", "k-7"])).unwrap();
    assert_eq!(again["admitted"], admitted, "{again}");

    // Every ledger key sits in the one slot of the tag `{meter}`, on one primary.
    let deadline = Instant::now() + Duration::from_secs(5);
    let holders: Vec<u16> = loop {
        let holders: Vec<u16> = cluster
            .nodes
            .iter()
            .filter(|n| !n.cli(&["KEYS", "tollgate:{meter}:*"]).is_empty())
            .map(|n| n.port)
            .collect();
        if !holders.is_empty() || Instant::now() > deadline {
            break holders;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!holders.is_empty(), "the ledger is on the cluster");
    let masters: Vec<u16> = holders
        .iter()
        .copied()
        .filter(|p| role(&cluster, *p) == "master")
        .collect();
    assert_eq!(
        masters.len(),
        1,
        "the ledger on one primary (and its replica): {holders:?}"
    );
    for n in &cluster.nodes {
        assert_eq!(n.cli(&["KEYS", "tollgate:meter:*"]), "", "no untagged ledger key");
    }

    // The ledger's primary killed while a meter adds up and two gateways admit.
    let mut consumer = spawn_meter(&url, &rules);
    let (c, d) = (spawn("gw-c"), spawn("gw-d"));
    let stop = Arc::new(AtomicBool::new(false));
    let load = |gw: &Tollgate| {
        let (url, stop) = (gw.url("/v1/orders"), stop.clone());
        tokio::spawn(async move {
            let http = Http::new();
            let mut admitted = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(r) = http
                    .try_send(http::Method::GET, &url, &[("x-api-key", common::KBIG)])
                    .await
                    && r.status == StatusCode::OK
                {
                    admitted += 1;
                }
            }
            admitted
        })
    };
    let (lc, ld) = (load(&c), load(&d));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let victim = masters[0];
    let idx = cluster.nodes.iter().position(|n| n.port == victim).unwrap();
    cluster.nodes[idx].kill();
    let killed = Instant::now();
    // Until a replica serves the ledger's slot again, then a while after.
    loop {
        let promoted = cluster.nodes.iter().filter(|n| n.port != victim).any(|n| {
            role(&cluster, n.port) == "master" && !n.cli(&["KEYS", "tollgate:{meter}:*"]).is_empty()
        });
        if promoted {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no replica took the ledger's slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the ledger's primary {victim} was replaced after {:?}",
        killed.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let big = lc.await.unwrap() + ld.await.unwrap();
    for mut gw in [c, d] {
        gw.stop();
    }
    // The running meter catches up, then a last pass makes sure nothing is left.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = consumer.kill();
    let _ = consumer.wait();
    meter(None, &url, &rules, &["--once", "--claim-idle", "100ms"]);
    let v: serde_json::Value =
        serde_json::from_str(&meter(Some("usage"), &url, &rules, &["--key", "k-big"])).unwrap();
    eprintln!("k-big: {big} admitted through the failover, billed {v}");
    assert_eq!(v["admitted"], big, "{v}");
    assert_eq!(v["unclean_ends"], 0, "{v}");

    // A quota: the meter's flag, in the cluster, reaches a gateway, which refuses the key.
    // k-7 is past 5 already today, so the first pass of the meter sets its flag.
    let (_qdir, quota_rules) = common::rules_file(&common::demo_rules_with_k7_quota(upstream, 5));
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        quota_rules.to_str().unwrap(),
        "--store",
        &url,
        "--instance",
        "gw-q",
    ]);
    let mut consumer = spawn_meter(&url, &quota_rules);
    let started = Instant::now();
    loop {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS && r.json()["error"] == "quota_exceeded" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "k-7 was never refused for its quota: {} {}",
            r.status,
            r.body_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "k-7 refused for its quota {:?} after the meter started",
        started.elapsed()
    );
    let _ = consumer.kill();
    let _ = consumer.wait();
}

/// `ROLE`'s first word on the node at `port`: `master` or `slave`.
fn role(cluster: &RedisCluster, port: u16) -> String {
    let node = cluster.nodes.iter().find(|n| n.port == port).unwrap();
    node.cli(&["ROLE"]).lines().next().unwrap_or_default().to_string()
}

/// `tollgate meter` running until killed, reading every 100 ms.
fn spawn_meter(url: &str, rules: &std::path::Path) -> Child {
    Command::new(common::gateway_bin())
        .args([
            "meter",
            "--store",
            url,
            "--rules",
            rules.to_str().unwrap(),
            "--poll",
            "100ms",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("tollgate meter runs")
}
