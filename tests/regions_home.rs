//! A security limit with a home Region, in real gateway processes on two real redis-servers:
//! every Region's gateways check its buckets in the home Region's store, so an attacker spread
//! over Regions gets one allowance, not one per Region; the other limits of the same request
//! stay in each Region's own store.

mod common;

use common::{Http, RedisServer, Tollgate, rules_file};
use http::{Method, StatusCode};

/// The demo rules with the login limit (5 a minute per account) homed in Region A and closed
/// when that store can't answer.
fn rules() -> String {
    let text = common::demo_json();
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    rules["limits"]["login"]["home_region"] = "A".into();
    rules["limits"]["login"]["on_store_failure"] = "closed".into();
    rules.to_string()
}

fn gateway(region: &str, rules: &std::path::Path, a: &RedisServer, b: &RedisServer) -> Tollgate {
    let regions = format!("A={},B={}", a.url(), b.url());
    Tollgate::spawn(&[
        "demo",
        "--rules",
        rules.to_str().unwrap(),
        "--region",
        region,
        "--regions",
        &regions,
        "--instance",
        &format!("gw-{region}"),
        "--region-store-timeout",
        "500ms",
    ])
}

async fn login(http: &Http, gw: &Tollgate, account: &str) -> StatusCode {
    http.send(Method::POST, &gw.url("/login"), &[("x-account", account)], b"")
        .await
        .status
}

/// Bucket names in a store that mention `what`.
fn buckets(store: &RedisServer, what: &str) -> Vec<String> {
    store
        .bucket_names("rl:")
        .into_iter()
        .filter(|n| n.contains(what))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_gets_one_allowance_across_regions_from_its_home_store() {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let (_dir, path) = rules_file(&rules());
    let gw_a = gateway("A", &path, &a, &b);
    let gw_b = gateway("B", &path, &a, &b);
    let http = Http::new();

    // Five attempts a minute for the account, wherever they land.
    let mut answers = Vec::new();
    for gw in [&gw_b, &gw_a, &gw_b, &gw_b, &gw_a] {
        answers.push(login(&http, gw, "alice").await);
    }
    assert_eq!(answers, vec![StatusCode::OK; 5]);
    assert_eq!(login(&http, &gw_b, "alice").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(login(&http, &gw_a, "alice").await, StatusCode::TOO_MANY_REQUESTS);
    // Another account is untouched.
    assert_eq!(login(&http, &gw_b, "bob").await, StatusCode::OK);

    let in_a = buckets(&a, "login");
    assert!(
        in_a.iter().any(|k| k.contains("alice")),
        "login buckets in A's store: {in_a:?}"
    );
    assert_eq!(
        buckets(&b, "login"),
        Vec::<String>::new(),
        "B's store holds no login bucket"
    );

    // A key's own plan limit stays in each Region's store.
    let k7 = [("x-api-key", common::K7)];
    assert_eq!(
        http.get(&gw_b.url("/v1/orders"), &k7).await.status,
        StatusCode::OK
    );
    assert!(!buckets(&b, "plan").is_empty(), "B checks its own plan buckets");
    assert!(
        buckets(&a, "plan").is_empty(),
        "A saw no plan check: {:?}",
        buckets(&a, "plan")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_store_that_is_down_closes_the_security_limit_only() {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let (_dir, path) = rules_file(&rules());
    let gw_b = gateway("B", &path, &a, &b);
    let http = Http::new();
    assert_eq!(login(&http, &gw_b, "carol").await, StatusCode::OK);
    drop(a);
    let r = http
        .send(Method::POST, &gw_b.url("/login"), &[("x-account", "carol")], b"")
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
    // The rest of B's traffic is checked in B's own store and goes on.
    let k7 = [("x-api-key", common::K7)];
    assert_eq!(
        http.get(&gw_b.url("/v1/orders"), &k7).await.status,
        StatusCode::OK
    );
}
