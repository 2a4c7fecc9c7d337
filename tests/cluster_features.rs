//! Everything a gateway does on one Redis node, on a Redis Cluster of three primaries, against
//! real processes: checks over one slot and over several, leased blocks of a hot limit, seats
//! of a limit on requests in flight, post-paid debits, the usage route, a queue instead of a
//! refusal, blocks and their list, keys made through the admin API, and metering's records.

mod common;

use std::time::{Duration, Instant};

use common::{Http, RedisCluster, Tollgate};
use http::Method;

const TOKEN: &str = "cluster-features-admin-token";
const K8: (&str, &str) = ("authorization", "Bearer k8-demo-key");

/// The demo's rules with a feature on each path: `/v1/orders` spends a hot limit's leased blocks
/// and takes a seat of a limit on requests in flight; the rest of `/v1/` pays a guard that
/// blocks for a minute once it refuses; `/v1/queued` waits its turn rather than be refused.
fn every_feature_rules() -> (tempfile::TempDir, std::path::PathBuf) {
    let mut r: serde_json::Value = serde_json::from_str(&common::demo_json()).unwrap();
    r["limits"]["hot"] =
        serde_json::json!({"dimension": "key", "rate": "1000/1s", "burst": 1000, "lease": {"block": "auto"}});
    r["limits"]["inflight"] = serde_json::json!({"dimension": "key", "concurrent": 4});
    r["limits"]["guard"] =
        serde_json::json!({"dimension": "ip", "rate": "1/60s", "burst": 2, "block_for": "60s"});
    r["limits"]["queue"] =
        serde_json::json!({"dimension": "ip", "rate": "10/1s", "burst": 1, "delay": {"max_wait_ms": 2000}});
    let routes = r["routes"].as_array_mut().unwrap();
    for route in routes.iter_mut() {
        match route["name"].as_str() {
            Some("orders") => {
                route["cost"]["inflight"] = 1.into();
                route["cost"]["hot"] = 1.into();
            }
            Some("v1") => route["cost"]["guard"] = 1.into(),
            _ => {}
        }
    }
    routes.insert(
        0,
        serde_json::json!({"name": "queued", "method": "GET", "path": "/v1/queued",
            "upstream": "orders", "cost": {"plan": 1, "queue": 1}}),
    );
    common::rules_file(&r.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_feature_runs_on_a_cluster() {
    let cluster = RedisCluster::start();
    let (dir, rules) = every_feature_rules();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, TOKEN).unwrap();
    let args = [
        "demo",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        &cluster.url(),
        "--admin-token-file",
        token.to_str().unwrap(),
        "--meter-interval",
        "200ms",
    ];
    let gw = Tollgate::spawn(&args);
    let http = Http::new();
    let bearer = format!("Bearer {TOKEN}");
    let admin = [("authorization", bearer.as_str())];

    for _ in 0..5 {
        let r = http.get(&gw.url("/v1/orders"), &[K8]).await;
        assert_eq!(r.status, 200, "a check, a lease and a seat: {}", r.body_text());
    }
    let r = http
        .send(Method::POST, &gw.url("/v1/completions"), &[K8], b"{}")
        .await;
    assert_eq!(r.status, 200, "a post-paid debit: {}", r.body_text());
    let r = http.get(&gw.url("/v1/usage"), &[K8]).await;
    assert_eq!(r.status, 200, "the usage route: {}", r.body_text());
    assert!(r.body_text().contains("\"plan\""), "{}", r.body_text());
    let logins: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..7 {
            let r = http
                .send(Method::POST, &gw.url("/login"), &[("x-account", "a1")], b"")
                .await;
            v.push(r.status.as_u16());
        }
        v
    };
    assert_eq!(
        logins.iter().filter(|s| **s == 200).count(),
        5,
        "an account's and an address's buckets in two slots: {logins:?}"
    );

    // The queue: the second of two at once waits for its token rather than be refused.
    let started = Instant::now();
    let queued = gw.url("/v1/queued");
    let (a, b) = tokio::join!(http.get(&queued, &[K8]), http.get(&queued, &[K8]));
    assert_eq!(
        (a.status.as_u16(), b.status.as_u16()),
        (200, 200),
        "{}",
        b.body_text()
    );
    assert!(started.elapsed() >= Duration::from_millis(50), "nobody waited");

    let mut guarded = Vec::new();
    for _ in 0..4 {
        guarded.push(http.get(&gw.url("/v1/invoices"), &[K8]).await.status.as_u16());
    }
    assert_eq!(guarded, [200, 200, 429, 429], "the guard refuses, then blocks");
    let blocks = http.get(&gw.admin_url("/admin/blocks"), &admin).await;
    assert_eq!(blocks.status, 200, "{}", blocks.body_text());
    assert!(blocks.body_text().contains("guard"), "{}", blocks.body_text());

    let made = http
        .send(
            Method::POST,
            &gw.admin_url("/admin/keys"),
            &admin,
            br#"{"tenant": "acme", "limits": {"plan": {"rate": "10/1s", "burst": 10}, "hot": {"rate": "1000/1s", "burst": 1000}}}"#,
        )
        .await;
    assert_eq!(made.status, 201, "{}", made.body_text());
    let secret = made.json()["secret"].as_str().unwrap().to_string();
    let auth = format!("Bearer {secret}");
    let started = Instant::now();
    while http
        .get(&gw.url("/v1/orders"), &[("authorization", auth.as_str())])
        .await
        .status
        != 200
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the new key never served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Metering's records reach the cluster's stream.
    let started = Instant::now();
    let usage_len = || -> u64 {
        cluster
            .nodes
            .iter()
            .map(|n| n.cli(&["XLEN", "tollgate:usage"]).parse::<u64>().unwrap_or(0))
            .sum()
    };
    while usage_len() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no usage record was written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = http.get(&gw.admin_url("/metrics"), &[]).await.body_text();
    let sum = |family: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(family))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(sum("tollgate_store_errors_total"), 0.0, "{metrics}");
    assert_eq!(sum("tollgate_store_bypass_total"), 0.0, "{metrics}");
    let log = gw.stderr();
    assert!(!log.contains("CROSSSLOT"), "{log}");
    assert!(
        log.contains("(3 primaries: "),
        "the start-up line names the primaries: {log}"
    );

    // `check-store` says what it finds, and refuses a cluster whose slots are not all served.
    let check = || {
        let out = std::process::Command::new(common::gateway_bin())
            .args(["check-store", "--store", &cluster.url()])
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let (ok, out, err) = check();
    assert!(
        ok && out.contains("redis-cluster at redis-cluster://") && out.contains("3 primaries"),
        "{out}{err}"
    );
    for node in &cluster.nodes {
        node.cli(&["CLUSTER", "DELSLOTSRANGE", "0", "99"]);
    }
    let (ok, out, err) = check();
    assert!(!ok, "check-store passed a cluster with 100 slots unserved: {out}");
    assert!(
        err.contains("100 hash slots without a primary") && err.contains("full coverage"),
        "{err}"
    );
}
