//! Redis Cluster (3 masters started by the test): a rule set whose request would span two hash
//! slots is refused when it loads, naming the limits; the demo rules without their cross-slot
//! login route serve every route against the cluster. (The conformance suite on the cluster is
//! in tests/store_conformance.rs.)

mod common;

use common::{Http, K7, K8, KBIG, RedisCluster, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_gateway::config::StoreUrl;

/// A keyed route that pays a tenant bucket and a per-IP bucket: two hash tags in one request.
const CROSS_SLOT_RULES: &str = r#"{
  "version": 3,
  "upstreams": { "orders": { "url": "http://127.0.0.1:9" } },
  "limits": {
    "plan": { "dimension": "key", "rate": "10/1s", "burst": 20 },
    "per-ip": { "dimension": "ip", "rate": "5/1s", "burst": 5 }
  },
  "keys": [
    { "id": "k-7", "tenant": "k7",
      "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc" }
  ],
  "routes": [
    { "name": "search", "method": "GET", "path": "/v1/search", "upstream": "orders",
      "cost": { "plan": 1, "per-ip": 1 } }
  ]
}"#;

/// The demo rules without the login route: its keyless requests pay the login bucket on the
/// X-Account tag and the unauthenticated bucket on the IP tag.
fn demo_without_login(upstream: std::net::SocketAddr) -> String {
    let demo = common::demo_rules_for(upstream);
    let login = r#",
    { "name": "login", "method": "POST", "path": "/login", "upstream": "orders", "key": "optional", "cost": { "login": 1 } }"#;
    let rules = demo.replacen(login, "", 1);
    assert_ne!(rules, demo, "the demo's login route moved; update this test");
    rules
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_slot_rules_are_refused_and_the_demo_without_login_runs() {
    let cluster = RedisCluster::start();
    let url = cluster.url();

    let (ok, stderr) = common::serve_and_exit(CROSS_SLOT_RULES, &["--store", &url]);
    assert!(!ok, "a cross-slot rule set was accepted on a cluster");
    assert!(stderr.contains("routes (search)"), "{stderr}");
    assert!(
        stderr.contains(r#"["plan"] on the tenant"#) && stderr.contains(r#"["per-ip"] on the client IP"#),
        "the refusal should name both limits and their tags: {stderr}"
    );
    // The same file serves on one node, where a script may touch any key.
    let node = RedisServer::start();
    let (_dir, path) = common::rules_file(CROSS_SLOT_RULES);
    let single = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &node.url(),
        "--store-timeout",
        "1s",
    ]);
    drop(single);

    let upstream = common::start_demo_upstream().await;
    let demo = common::demo_rules_for(upstream);
    let (ok, stderr) = common::serve_and_exit(&demo, &["--store", &url]);
    assert!(!ok, "the demo's login route spans two slots without a key");
    assert!(
        stderr.contains("routes (login)") && stderr.contains("unauth") && stderr.contains("login"),
        "{stderr}"
    );

    let (running, _dir) = common::start_gateway_on(
        &demo_without_login(upstream),
        StoreUrl::RedisCluster(cluster.node_list()),
    )
    .await;
    assert_eq!(running.store.kind(), "redis-cluster");
    let http = Http::new();
    let base = format!("http://{}", running.addr);
    let bearer = |k: &str| format!("Bearer {k}");
    let ready = http
        .get(&format!("http://{}/readyz", running.admin_addr.unwrap()), &[])
        .await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["store"], "redis-cluster");

    // k-7's burst of 20 all pass.
    for i in 0..20 {
        let r = http
            .get(&format!("{base}/v1/orders"), &[("authorization", &bearer(K7))])
            .await;
        assert_eq!(r.status, StatusCode::OK, "k-7 request {i}: {:?}", r.body);
    }
    // k-8's first export passes, the second (1 per 5 s) is refused by the export limit, and
    // the refusal charged the plan nothing.
    let export = |k: &'static str| {
        let http = http.clone();
        let url = format!("{base}/v1/exports");
        async move {
            http.send(Method::POST, &url, &[("authorization", &bearer(k))], b"")
                .await
        }
    };
    assert_eq!(export(K8).await.status, StatusCode::OK);
    let refused = export(K8).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["limit"], "exports");
    // k-big on the catch-all route.
    let r = http
        .get(
            &format!("{base}/v1/anything"),
            &[("authorization", &bearer(KBIG))],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    // Without a key: 401 while the IP's unauthenticated bucket (burst 5) lasts.
    let r = http.get(&format!("{base}/v1/orders"), &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{:?}", r.body);

    let per_node: Vec<String> = cluster.nodes.iter().map(|n| n.cli(&["KEYS", "rl:*"])).collect();
    let keys = per_node.join("\n");
    for key in [
        "rl:{k7}:plan",
        "rl:{k8}:plan",
        "rl:{k8}:exports:exports",
        "rl:{kbig}:plan",
        "rl:{ip:127.0.0.1}:unauth",
    ] {
        assert!(keys.contains(key), "{key} missing from the cluster: {keys}");
    }
    let holding = per_node.iter().filter(|k| !k.is_empty()).count();
    assert!(
        holding >= 2,
        "the buckets should spread over the masters: {per_node:?}"
    );
    running.shutdown().await;
}
