//! Limits charged on the upstream's answer (`charge_on`), in real gateway processes on the
//! embedded store and on a real redis-server, on the express lane and on hyper's path: only the
//! named statuses drain the bucket, and an empty bucket refuses the next attempt before it
//! reaches the upstream.

mod common;

use common::{Http, RedisServer, Tollgate, rules_file};
use http::{Method, StatusCode};

/// The demo rules with the login limit at 3 a minute per account, charged only on a 401.
fn rules() -> String {
    let text = common::demo_json();
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    let login = &mut rules["limits"]["login"];
    login["rate"] = "3/60s".into();
    login["burst"] = 3.into();
    login["charge_on"] = serde_json::json!({"status": [401]});
    rules.to_string()
}

async fn attempt(http: &Http, gw: &Tollgate, account: &str, status: u16) -> (StatusCode, serde_json::Value) {
    let r = http
        .send(
            Method::POST,
            &gw.url(&format!("/login?status={status}")),
            // A key, so the unauthenticated per-IP limit stays out of it.
            &[("x-account", account), ("x-api-key", common::K7)],
            b"",
        )
        .await;
    (r.status, r.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_named_statuses_drain_the_bucket() {
    let redis = RedisServer::start();
    let (_dir, path) = rules_file(&rules());
    let path = path.to_str().unwrap().to_string();
    let http = Http::new();
    for (store, lane) in [
        ("memory", true),
        ("memory", false),
        ("redis", true),
        ("redis", false),
    ] {
        let mut args = vec!["demo", "--rules", &path];
        let url = redis.url();
        if store == "redis" {
            // About what the store decides: a give-back lost to a 3 ms timeout on a loaded
            // host would be a different test (tests/store_failure.rs).
            args.extend(["--store", &url, "--store-timeout", "1s"]);
        }
        if !lane {
            args.push("--no-express");
        }
        let gw = Tollgate::spawn(&args);
        let case = format!("{store}, express lane {lane}");
        // Separate accounts per case: the Redis buckets outlive each gateway.
        let alice = format!("alice-{store}-{lane}");
        let bob = format!("bob-{store}-{lane}");

        for i in 0..4 {
            let (s, body) = attempt(&http, &gw, &alice, 200).await;
            assert_eq!(s, StatusCode::OK, "{case}: success {i} is not charged: {body}");
        }
        for _ in 0..2 {
            let (s, _) = attempt(&http, &gw, &alice, 403).await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{case}: a 403 is not in the list");
        }
        for i in 0..3 {
            let (s, body) = attempt(&http, &gw, &alice, 401).await;
            assert_eq!(
                s,
                StatusCode::UNAUTHORIZED,
                "{case}: failure {i} reaches the upstream: {body}"
            );
        }
        let (s, body) = attempt(&http, &gw, &alice, 200).await;
        assert_eq!(
            s,
            StatusCode::TOO_MANY_REQUESTS,
            "{case}: three failures spend the bucket: {body}"
        );
        assert!(
            body.get("service").is_none(),
            "{case}: refused before the upstream: {body}"
        );
        let (s, _) = attempt(&http, &gw, &bob, 401).await;
        assert_eq!(
            s,
            StatusCode::UNAUTHORIZED,
            "{case}: another account has its own bucket"
        );
    }
}
