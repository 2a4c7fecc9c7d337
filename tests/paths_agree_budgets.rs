//! The express lane and hyper's general path (`--no-express`) tell a client its budget alike:
//! post-paid debits, an upstream's own `RateLimit` beside the gateway's and a quota's, a quota
//! key's answers as metering flags it, and the usage route. The pair of gateways is
//! `common::pair`.

mod common;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::pair::{Pair, QUOTA_KEY, at, error_of, key};
use http::{Method, StatusCode};
use tollgate_gateway::app::MeterConfig;

/// A post-paid limit of 1,000 tokens: 300 reported leave 700, 900 more leave it 200 in debt,
/// and the next is refused until the debt is repaid. `RateLimit` is read after each debit.
#[tokio::test]
async fn a_post_paid_debit_shows_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/completions?tokens=300", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header("x-usage-tokens"), Some("300"));
    let state = a.header("ratelimit").unwrap_or("");
    assert!(state.starts_with("\"tokens-burst\";r=700;"), "{state}");
    let a = p.both(Method::GET, "/v1/completions?tokens=900", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    let state = a.header("ratelimit").unwrap_or("");
    assert!(state.starts_with("\"tokens-burst\";r=0;"), "{state}");
    let a = p.both(Method::GET, "/v1/completions?tokens=1", &key()).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "rate_limited".into())
    );
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// An upstream that writes its own `RateLimit-Policy` and `RateLimit`: on a limited route the
/// gateway's budget is what the client gets; on a route without a limit, the upstream's.
#[tokio::test]
async fn an_upstreams_own_ratelimit_on_a_limited_route_answers_alike() {
    let mut p = Pair::start().await;
    for method in [Method::GET, Method::HEAD] {
        let a = p.both(method.clone(), "/v1/orders?own", &key()).await;
        assert_eq!(a.status, StatusCode::OK);
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.starts_with("\"plan-burst\";"), "{method}: {state}");
    }
    let a = p.both(Method::GET, "/v1/free?own", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// The same upstream for a key with a quota: on a route with no limit (the quota is its only
/// budget), and on a limited one (the bucket, then the quota).
#[tokio::test]
async fn an_upstreams_own_ratelimit_with_a_quota_answers_alike() {
    let mut p = Pair::start().await;
    let quota = [("x-api-key", QUOTA_KEY)];
    for path in ["/v1/free?own", "/v1/orders?own", "/v1/free"] {
        let a = p.both(Method::GET, path, &quota).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.contains("\"day\";r=100;t=1800"), "{path}: {state}");
    }
    let a = p.both(Method::HEAD, "/v1/free?own", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// A quota key as metering flags it: near its quota, every answer lists what is left; over
/// it, `429` `quota_exceeded` until the reset in Paris. The flags go into each gateway's
/// metering file, which it reads every second.
#[tokio::test]
async fn a_quota_keys_answers_follow_its_flags_alike() {
    use tollgate_meter::flags::{Flag, State};
    let mut p = Pair::start_with(|cfg, dir| {
        cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        cfg.meter = Some(MeterConfig {
            instance: "paths-agree".into(),
            interval: Duration::from_secs(5),
            file: dir.join("usage.db"),
        });
    })
    .await;
    let quota = [("x-api-key", QUOTA_KEY)];
    let flag = |state: State, used: u64| Flag {
        state,
        quota: tollgate_rules::quota::Per::Day,
        period: "2026-12-01".into(),
        used,
        limit: 100,
        resets_at_ms: at("2026-12-01T23:00:00Z") as i64 / 1000,
        resets_at: "2026-12-02T00:00:00+01:00".into(),
    };

    flag_both(&p, &flag(State::Near, 85), "near").await;
    for path in ["/v1/free", "/v1/orders"] {
        let a = p.both(Method::GET, path, &quota).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        let state = a.header("ratelimit").unwrap_or("");
        assert!(state.ends_with("\"day\";r=15;t=1800"), "{path}: {state}");
    }
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(
        (
            a.status,
            &a.json()["quota"]["used"],
            &a.json()["quota"]["remaining"]
        ),
        (StatusCode::OK, &serde_json::json!(85), &serde_json::json!(15))
    );

    flag_both(&p, &flag(State::Over, 100), "over").await;
    for method in [Method::GET, Method::HEAD, Method::DELETE] {
        let a = p.both(method.clone(), "/v1/orders", &quota).await;
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{method}");
        assert_eq!(a.header("retry-after"), Some("1800"), "{method}");
    }
    let a = p.both(Method::GET, "/v1/free", &quota).await;
    assert_eq!(
        (a.status, error_of(&a)),
        (StatusCode::TOO_MANY_REQUESTS, "quota_exceeded".into())
    );
    // Asking what is left is not billed, so a spent quota does not refuse it.
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["quota"]["remaining"], 0);
    // Another key is not held to k-q's quota.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.status, StatusCode::OK);
    p.assert_alike();
}

/// Writes `flag` for k-q into both gateways' metering files, and returns once each has read it
/// (its admin listener shows `state`). This waits for the once-a-second read of the flags, not
/// for any bucket: the clocks don't move.
async fn flag_both(p: &Pair, flag: &tollgate_meter::flags::Flag, state: &str) {
    let http = common::Http::new();
    for side in [&p.lane, &p.general] {
        let conn = tollgate_meter::sqlite::open(&side.dir.path().join("usage.db")).unwrap();
        tollgate_meter::sqlite::write_flag(&conn, "k-q", flag).unwrap();
        let url = format!("http://{}/admin/usage?key=k-q", side.gw.admin_addr.unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        while http.get(&url, &[]).await.json()["quota"]["state"] != state {
            assert!(Instant::now() < deadline, "the {state} flag was never read");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The caller's own budget, answered by the gateway on both wires alike: each bucket of the key
/// as a request paying it is told, the route's own limit charged (two asks, then `429`) and
/// nothing else; a quota key's quota; `401` without a usable key.
#[tokio::test]
async fn the_usage_route_answers_alike() {
    let mut p = Pair::start().await;
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.header("ratelimit"), Some("\"plan-burst\";r=99;t=1"));
    let limits = |asks: u64| {
        serde_json::json!([
            {"name": "asks", "rate": "1/3600s", "burst": 2, "remaining": asks, "reset_s": (2 - asks) * 3600},
            {"name": "plan", "rate": "100/1s", "burst": 100, "remaining": 99, "reset_s": 1},
            {"name": "small", "rate": "1/3600s", "burst": 2, "remaining": 2, "reset_s": 0},
            {"name": "tokens", "rate": "1000/60s", "burst": 1000, "remaining": 1000, "reset_s": 0}
        ])
    };
    for left in [1, 0] {
        let a = p.both(Method::GET, "/v1/usage", &key()).await;
        assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
        assert_eq!(a.header("content-type"), Some("application/json"));
        assert_eq!(a.header("cache-control"), Some("no-store"));
        assert_eq!(
            a.header("ratelimit"),
            Some(format!("\"asks-burst\";r={left};t={}", (2 - left) * 3600).as_str())
        );
        assert_eq!(
            a.json(),
            serde_json::json!({"key": "k-1", "tenant": "k-1", "limits": limits(left), "quota": null})
        );
        let body = String::from_utf8_lossy(&a.body).into_owned();
        assert!(body.starts_with("{\"key\":\"k-1\",\"tenant\":"), "{body}");
    }
    let a = p.both(Method::GET, "/v1/usage", &key()).await;
    assert_eq!(
        (a.status, a.json()["limit"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("asks"))
    );
    // Asking charged nothing but its own limit.
    let a = p.both(Method::GET, "/v1/orders", &key()).await;
    assert_eq!(a.header("ratelimit"), Some("\"plan-burst\";r=98;t=1"));
    let quota = [("x-api-key", QUOTA_KEY)];
    let a = p.both(Method::GET, "/v1/usage", &quota).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.json()["quota"],
        serde_json::json!({"per": "day", "limit": 100, "used": 0, "remaining": 100,
                           "resets_at": "2026-12-02T00:00:00+01:00"})
    );
    assert!(
        a.header("ratelimit")
            .is_some_and(|s| s.ends_with("\"day\";r=100;t=1800")),
        "{:?}",
        a.headers
    );
    for unusable in [&[("x-api-key", "not-a-key")][..], &[]] {
        let a = p.both(Method::GET, "/v1/usage", unusable).await;
        assert_eq!(
            (a.status, error_of(&a)),
            (StatusCode::UNAUTHORIZED, "unauthorized".into())
        );
    }
    p.assert_alike();
}
