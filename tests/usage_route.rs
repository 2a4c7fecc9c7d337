//! The demo's usage route, `GET /v1/usage` (`"serve": "usage"`), end to end: a gateway in this
//! process with the demo upstream, real HTTP, on the express lane and on hyper's path alone
//! (`--no-express`), on the embedded store and on a real redis-server. What it says of each
//! bucket agrees with the `RateLimit` field real requests get, before and after they charge it;
//! asking moves nothing but its own limit, which refuses after its burst; no usable key is 401.
//! The gateway's clock is a manual one that never moves, so nothing refills meanwhile; on Redis
//! the gateway hands it to the script (`--clock gateway`).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Answer, Http, K7, K8, RedisServer};
use http::{Method, StatusCode};
use serde_json::{Value, json};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource, Running};
use tollgate_gateway::config::{ClockSource, StoreUrl};
use tollgate_limit::clock::ManualClock;

async fn gateway(rules: &str, store: StoreUrl, express: bool) -> (Running, tempfile::TempDir) {
    let (dir, path) = common::rules_file(rules);
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.store = store;
    cfg.clock = ManualClock::new(1_700_000_000_000_000);
    cfg.clock_source = ClockSource::Gateway;
    // About what the store decides: a loaded host must not let a failure policy decide.
    cfg.store_timeout = Duration::from_secs(1);
    cfg.limits.express = express;
    let running = app::start(cfg).await.expect("gateway starts");
    (running, dir)
}

async fn get(http: &Http, addr: SocketAddr, path: &str, key: &str) -> Answer {
    let headers: &[(&str, &str)] = if key.is_empty() {
        &[]
    } else {
        &[("x-api-key", key)]
    };
    http.get(&format!("http://{addr}{path}"), headers).await
}

/// `r` and `t` of a `RateLimit` value naming `limit`'s burst policy.
fn state(a: &Answer, limit: &str) -> (u64, u64) {
    let v = a.header("ratelimit").unwrap_or("");
    let rest = v
        .strip_prefix(&format!("\"{limit}-burst\";r="))
        .unwrap_or_else(|| panic!("RateLimit {v:?} does not name {limit}"));
    let (r, t) = rest.split_once(";t=").expect("r and t");
    let t = t.split(',').next().unwrap_or(t);
    (r.parse().unwrap(), t.parse().unwrap())
}

/// One bucket of a usage answer, by its limit's name: `(remaining, reset_s)`.
fn bucket(usage: &Value, limit: &str) -> (u64, u64) {
    let l = usage["limits"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["name"] == limit))
        .unwrap_or_else(|| panic!("no {limit} in {usage}"));
    (l["remaining"].as_u64().unwrap(), l["reset_s"].as_u64().unwrap())
}

/// The usage answer for `key`, which must be a 200 whose `RateLimit` is its own `usage` bucket,
/// the same as the body says of it.
async fn usage(http: &Http, addr: SocketAddr, key: &str, case: &str) -> Value {
    let a = get(http, addr, "/v1/usage", key).await;
    assert_eq!(a.status, StatusCode::OK, "{case}: {:?}", a.body);
    assert_eq!(a.header("content-type"), Some("application/json"), "{case}");
    assert_eq!(a.header("cache-control"), Some("no-store"), "{case}");
    let body = a.json();
    assert_eq!(state(&a, "usage"), bucket(&body, "usage"), "{case}: {body}");
    body
}

/// Every check of the demo's usage route on one gateway, fresh buckets.
async fn the_usage_route_tells_the_budget(http: &Http, gw: &Running, case: &str) {
    let addr = gw.addr;
    let first = usage(http, addr, K7, case).await;
    assert_eq!(
        first,
        json!({"key": "k-7", "tenant": "k7", "limits": [
            {"name": "plan", "rate": "600/60s", "burst": 20, "remaining": 20, "reset_s": 0},
            {"name": "tokens", "rate": "1000/60s", "burst": 1000, "remaining": 1000, "reset_s": 0},
            {"name": "usage", "rate": "1/1s", "burst": 5, "remaining": 4, "reset_s": 1}
        ], "quota": null}),
        "{case}"
    );

    // An order's RateLimit, then the usage route: the same r and t for the plan. Asking again
    // moves nothing; the next order drops it by one.
    let o = get(http, addr, "/v1/orders", K7).await;
    assert_eq!(o.status, StatusCode::OK, "{case}");
    let (r, t) = state(&o, "plan");
    assert_eq!((r, t), (19, 1), "{case}");
    assert_eq!(
        bucket(&usage(http, addr, K7, case).await, "plan"),
        (r, t),
        "{case}"
    );
    assert_eq!(
        bucket(&usage(http, addr, K7, case).await, "plan"),
        (r, t),
        "{case}: asking moved it"
    );
    let o = get(http, addr, "/v1/orders", K7).await;
    assert_eq!(state(&o, "plan"), (r - 1, 1), "{case}");
    assert_eq!(
        bucket(&usage(http, addr, K7, case).await, "plan"),
        (r - 1, 1),
        "{case}"
    );

    // A post-paid bucket: 300 tokens reported leave 700, full again in 18 s (60 ms each).
    let c = http
        .send(
            Method::POST,
            &format!("http://{addr}/v1/completions?tokens=300"),
            &[("x-api-key", K7)],
            b"{}",
        )
        .await;
    assert_eq!(c.status, StatusCode::OK, "{case}");
    let after = usage(http, addr, K7, case).await;
    assert_eq!(bucket(&after, "tokens"), (700, 18), "{case}");
    assert_eq!(bucket(&after, "plan"), (r - 2, 1), "{case}");
    // Five asks so far: the burst of the route's own limit is spent.
    assert_eq!(bucket(&after, "usage"), (0, 5), "{case}");
    let refused = get(http, addr, "/v1/usage", K7).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{case}");
    assert_eq!(
        refused.json(),
        json!({"error": "rate_limited", "limit": "usage", "retry_after_seconds": 1}),
        "{case}"
    );
    assert_eq!(refused.header("retry-after"), Some("1"), "{case}");
    assert_eq!(state(&refused, "usage"), (0, 1), "{case}");
    // The refused ask charged nothing it read either.
    let o = get(http, addr, "/v1/orders", K7).await;
    assert_eq!(state(&o, "plan"), (r - 3, 1), "{case}");

    let k8 = usage(http, addr, K8, case).await;
    assert_eq!(
        (
            &k8["key"],
            &k8["tenant"],
            bucket(&k8, "plan"),
            bucket(&k8, "tokens")
        ),
        (&json!("k-8"), &json!("k8"), (40, 0), (10_000, 0)),
        "{case}: another tenant's own buckets and numbers"
    );
    assert_eq!(k8["limits"][0]["rate"], "20/1s", "{case}");
    let o = get(http, addr, "/v1/orders", K8).await;
    assert_eq!(state(&o, "plan"), (39, 1), "{case}");

    for (secret, reason) in [("", "missing_key"), ("not-a-demo-key", "unknown_key")] {
        let a = get(http, addr, "/v1/usage", secret).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{case}: {reason}");
        assert_eq!(a.json()["reason"], reason, "{case}");
    }
}

/// One gateway per wire on `store`, each on fresh buckets.
async fn on_both_wires(store: &str, redis: Option<&RedisServer>) {
    let upstream = common::start_demo_upstream().await;
    let rules = common::demo_rules_for(upstream);
    let http = Http::new();
    for express in [true, false] {
        let case = format!("{store}, express lane {express}");
        let store_url = match redis {
            None => StoreUrl::Memory,
            Some(r) => {
                // They outlive a gateway in Redis.
                assert_eq!(r.cli(&["FLUSHALL"]), "OK", "{case}");
                StoreUrl::parse(&r.url()).unwrap()
            }
        };
        let (gw, _dir) = gateway(&rules, store_url, express).await;
        assert_eq!(gw.store.kind(), store, "{case}");
        the_usage_route_tells_the_budget(&http, &gw, &case).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_route_agrees_with_ratelimit_on_the_embedded_store() {
    on_both_wires("memory", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_route_agrees_with_ratelimit_on_redis() {
    // Without redis-server this fails, saying so: it is never skipped.
    let redis = RedisServer::start();
    on_both_wires("redis", Some(&redis)).await;
}
