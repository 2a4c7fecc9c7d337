//! A Region whose store is a Redis Cluster, beside one on a single node, against real
//! processes: each Region's agent is elected in its own store, commits its state, shares and
//! record in one call (on the cluster under the hash tag `{regions}`, so the call reaches one
//! slot), writes its record into the other Region's store under that store's names, and the
//! two Regions' shares of the global limit never add up past it.

mod common;

use std::time::{Duration, Instant};

use common::{Http, KBIG, RedisCluster, RedisServer, Tollgate};

fn gateway(region: &str, regions: &str, rules: &std::path::Path) -> Tollgate {
    Tollgate::spawn(&[
        "serve",
        "--rules",
        rules.to_str().unwrap(),
        "--region",
        region,
        "--regions",
        regions,
        "--rebalance-interval",
        "400ms",
        "--region-lease",
        "1200ms",
        "--instance",
        &format!("gw-{region}"),
        "--store-timeout",
        "200ms",
    ])
}

/// Polls `read` every 50 ms for up to 15 s until it gives a non-empty answer.
async fn until_some(what: &str, read: impl Fn() -> String) -> String {
    let start = Instant::now();
    loop {
        let v = read();
        if !v.is_empty() {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{what}: nothing in 15 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The share a store's `shares` hash gives the one global bucket.
fn share(hash: &str) -> f64 {
    hash.lines()
        .collect::<Vec<_>>()
        .chunks(2)
        .find_map(|kv| kv.get(1)?.parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_on_a_cluster_shares_a_limit_with_one_on_a_node() {
    let cluster = RedisCluster::start();
    let node = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (_dir, rules) = common::rules_file(&common::regions::rules(upstream));
    let regions = format!("A={},B={}", cluster.url(), node.url());
    let a = gateway("A", &regions, &rules);
    let b = gateway("B", &regions, &rules);
    let http = Http::new();
    for gw in [&a, &b] {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", KBIG)]).await;
        assert_eq!(r.status, 200, "{}", r.body_text());
    }

    // Each agent in its own store, under that store's names.
    let agent_a = until_some("A's agent on the cluster", || {
        cluster.cli(&["GET", "tollgate:{regions}:agent"])
    })
    .await;
    assert!(agent_a.contains("gw-A"), "{agent_a}");
    let agent_b = until_some("B's agent on the node", || {
        node.cli(&["GET", "tollgate:regions:agent"])
    })
    .await;
    assert!(agent_b.contains("gw-B"), "{agent_b}");
    // Each Region's record in the other's store.
    until_some("B's record on the cluster", || {
        cluster.cli(&["GET", "tollgate:{regions}:record:B"])
    })
    .await;
    until_some("A's record on the node", || {
        node.cli(&["GET", "tollgate:regions:record:A"])
    })
    .await;
    // Shares committed in both, never past the limit between them (300 a second).
    let (sa, sb) = (
        until_some("A's shares", || {
            cluster.cli(&["HGETALL", "tollgate:{regions}:shares"])
        })
        .await,
        until_some("B's shares", || node.cli(&["HGETALL", "tollgate:regions:shares"])).await,
    );
    let (sa, sb) = (share(&sa), share(&sb));
    assert!(sa > 0.0 && sb > 0.0, "A {sa}, B {sb}");
    assert!(sa + sb <= 300.0 + 1e-6, "A {sa} + B {sb} is past the limit");
    eprintln!("shares: A (cluster) {sa}, B (node) {sb}");

    for gw in [&a, &b] {
        let log = gw.stderr();
        assert!(!log.contains("CROSSSLOT"), "{log}");
        assert!(!log.contains("rebalance failed"), "{log}");
    }
}
