//! Metering on a Redis Cluster, against real processes: two gateways on three primaries write
//! their usage records, `tollgate meter --once` adds them up into a ledger whose keys share one
//! hash tag, and `tollgate meter usage` bills each key exactly what the gateways admitted; a
//! second pass over the same records changes nothing.

mod common;

use std::process::{Command, Stdio};
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
    let cluster = RedisCluster::start();
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
    assert_eq!(holders.len(), 1, "the ledger on one primary: {holders:?}");
    for n in &cluster.nodes {
        assert_eq!(n.cli(&["KEYS", "tollgate:meter:*"]), "", "no untagged ledger key");
    }
}
