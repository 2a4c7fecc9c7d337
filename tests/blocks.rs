//! Limits that block for a while once they refuse (`"block_for": "30s"`), end to end: two
//! gateways in this process on one redis-server reading one manual clock, two on a Redis
//! Cluster of three primaries, and one on the embedded store, on the express lane and on hyper's path. A refusal blocks the bucket on every
//! gateway, whatever refills meanwhile, until the block ends or an operator lifts it through
//! `/admin/blocks`; a shadow limit only counts what it would have blocked.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{Answer, Http, KBIG, RedisCluster, RedisServer};
use http::{Method, StatusCode};
use tollgate_gateway::admin_guard::AdminToken;
use tollgate_gateway::app::{self, Running};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::clock::ManualClock;

const TOKEN: &str = "an-operator-token-for-blocks";

/// The demo rules with "guard": 1 a second per client address, burst 2, blocked for 30 s once
/// it refuses, on `GET /v1/guarded`; and "watch", the same in shadow mode, on `GET /v1/watched`.
fn rules(upstream: SocketAddr) -> String {
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
    rules["limits"]["guard"] = serde_json::json!({
        "dimension": "ip", "rate": "1/1s", "burst": 2, "block_for": "30s"
    });
    rules["limits"]["watch"] = serde_json::json!({
        "dimension": "ip", "rate": "1/1s", "burst": 2, "block_for": "30s", "mode": "shadow"
    });
    let routes = rules["routes"].as_array_mut().unwrap();
    for (name, limit) in [("guarded", "guard"), ("watched", "watch")] {
        routes.insert(
            0,
            serde_json::json!({
                "name": name, "method": "GET", "path": format!("/v1/{name}"), "upstream": "orders",
                "cost": {"plan": 1, limit: 1}
            }),
        );
    }
    rules.to_string()
}

async fn gateway(
    rules: &str,
    store: StoreUrl,
    express: bool,
    clock: Arc<ManualClock>,
) -> (Running, tempfile::TempDir) {
    let (mut cfg, dir) = common::manual_config(rules, store, express, clock);
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.admin_token = Some(AdminToken::new(TOKEN));
    let running = app::start(cfg).await.expect("gateway starts");
    (running, dir)
}

async fn get(http: &Http, gw: &Running, path: &str) -> Answer {
    http.get(&format!("http://{}{path}", gw.addr), &[("x-api-key", KBIG)])
        .await
}

async fn admin(
    http: &Http,
    gw: &Running,
    method: Method,
    path_and_query: &str,
    token: Option<&str>,
) -> Answer {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = Vec::new();
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    let url = format!("http://{}{path_and_query}", gw.admin_addr.unwrap());
    http.send(method, &url, &headers, b"").await
}

fn metric(gw: &Running, name: &str) -> String {
    gw.metrics
        .render()
        .lines()
        .filter(|l| l.starts_with(name))
        .collect::<Vec<_>>()
        .join("\n")
}

const BUCKET: &str = "rl:{ip:127.0.0.1}:guard";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_blocks_the_bucket_on_every_gateway_until_it_ends_or_is_lifted() {
    let redis = RedisServer::start();
    // The blocks of a cluster lie on each of its primaries: the list asks every one.
    let cluster = RedisCluster::start();
    let upstream = common::start_demo_upstream().await;
    let http = Http::new();
    for express in [true, false] {
        for store in ["redis", "cluster", "memory"] {
            let case = format!("{store}, express lane {express}");
            redis.cli(&["FLUSHALL"]);
            for node in &cluster.nodes {
                node.cli(&["FLUSHALL"]);
            }
            let url = || match store {
                "redis" => StoreUrl::parse(&redis.url()).unwrap(),
                "cluster" => StoreUrl::parse(&cluster.url()).unwrap(),
                _ => StoreUrl::Memory,
            };
            let clock = ManualClock::new(1_700_000_000_000_000);
            let (one, _d1) = gateway(&rules(upstream), url(), express, clock.clone()).await;
            // On the embedded store each gateway has its own buckets: the second is the first.
            let two_running = if store != "memory" {
                Some(gateway(&rules(upstream), url(), express, clock.clone()).await)
            } else {
                None
            };
            let two = two_running.as_ref().map_or(&one, |(r, _)| r);

            // The burst, then the refusal that starts a 30 s block.
            for _ in 0..2 {
                assert_eq!(
                    get(&http, &one, "/v1/guarded").await.status,
                    StatusCode::OK,
                    "{case}"
                );
            }
            let first = get(&http, &one, "/v1/guarded").await;
            assert_eq!(first.status, StatusCode::TOO_MANY_REQUESTS, "{case}");
            assert_eq!(first.json()["error"], "blocked", "{case}: {:?}", first.body);
            assert_eq!(first.header("retry-after"), Some("30"), "{case}");
            assert_eq!(
                metric(&one, "tollgate_blocks_started_total{limit=\"guard\"}"),
                "tollgate_blocks_started_total{limit=\"guard\"} 1",
                "{case}"
            );

            // 10 s on the bucket is full again, and still refused, on the other gateway too.
            clock.advance_us(10_000_000);
            let met = get(&http, two, "/v1/guarded").await;
            assert_eq!(met.status, StatusCode::TOO_MANY_REQUESTS, "{case}");
            assert_eq!(met.json()["error"], "blocked", "{case}");
            assert_eq!(met.header("retry-after"), Some("20"), "{case}");
            assert_eq!(
                metric(two, "tollgate_blocks_in_force{limit=\"guard\"}"),
                "tollgate_blocks_in_force{limit=\"guard\"} 1",
                "{case}"
            );

            // Listed on either gateway, with what is left.
            let listed = admin(&http, two, Method::GET, "/admin/blocks", None).await;
            assert_eq!(listed.status, StatusCode::OK, "{case}");
            let blocks = listed.json()["blocks"].as_array().unwrap().clone();
            assert_eq!(blocks.len(), 1, "{case}: {blocks:?}");
            assert_eq!(blocks[0]["limit"], "guard");
            assert_eq!(blocks[0]["bucket"], BUCKET);
            assert_eq!(blocks[0]["seconds_left"], 20);

            // 20 s more and it is over: the bucket, full, serves again.
            clock.advance_us(20_000_000);
            assert_eq!(
                get(&http, &one, "/v1/guarded").await.status,
                StatusCode::OK,
                "{case}"
            );
            let empty = admin(&http, &one, Method::GET, "/admin/blocks", None).await;
            assert_eq!(empty.json()["blocks"], serde_json::json!([]), "{case}");

            // Blocked again, then lifted by the operator on the other gateway.
            get(&http, &one, "/v1/guarded").await;
            assert_eq!(
                get(&http, &one, "/v1/guarded").await.json()["error"],
                "blocked",
                "{case}"
            );
            let q = format!(
                "/admin/blocks?limit=guard&bucket={}",
                BUCKET.replace('{', "%7B").replace('}', "%7D")
            );
            assert_eq!(
                admin(&http, two, Method::DELETE, &q, None).await.status,
                StatusCode::UNAUTHORIZED,
                "{case}: no token"
            );
            assert_eq!(
                admin(&http, two, Method::DELETE, &q, Some("wrong")).await.status,
                StatusCode::UNAUTHORIZED,
                "{case}: a wrong token"
            );
            let bad = admin(
                &http,
                two,
                Method::DELETE,
                "/admin/blocks?limit=plan&bucket=x",
                Some(TOKEN),
            )
            .await;
            assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{case}: {:?}", bad.body);
            let lifted = admin(&http, two, Method::DELETE, &q, Some(TOKEN)).await;
            assert_eq!(lifted.status, StatusCode::OK, "{case}: {:?}", lifted.body);
            assert_eq!(
                metric(two, "tollgate_blocks_in_force{limit=\"guard\"}"),
                "tollgate_blocks_in_force{limit=\"guard\"} 0",
                "{case}"
            );
            assert_eq!(
                admin(&http, two, Method::DELETE, &q, Some(TOKEN)).await.status,
                StatusCode::NOT_FOUND,
                "{case}: nothing left to lift"
            );
            // Lifted, the bucket is full again: the next request passes at once.
            assert_eq!(
                get(&http, &one, "/v1/guarded").await.status,
                StatusCode::OK,
                "{case}"
            );

            // In shadow mode nothing is refused; what it would have blocked is counted.
            for _ in 0..5 {
                assert_eq!(
                    get(&http, &one, "/v1/watched").await.status,
                    StatusCode::OK,
                    "{case}"
                );
            }
            assert_eq!(
                metric(&one, "tollgate_blocks_started_total{limit=\"watch\"}"),
                "tollgate_blocks_started_total{limit=\"watch\"} 1",
                "{case}"
            );
            let shadow = metric(&one, "tollgate_shadow_would_refuse_total{limit=\"watch\"}");
            assert_eq!(
                shadow, "tollgate_shadow_would_refuse_total{limit=\"watch\"} 3",
                "{case}"
            );

            if let Some((r, _)) = two_running {
                r.shutdown().await;
            }
            one.shutdown().await;
        }
    }
}

/// A key's usage route reads its buckets at cost 0: a block on the key's plan refuses the key's
/// requests, never the question of what it has left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_key_still_reads_its_usage() {
    let upstream = common::start_demo_upstream().await;
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
    rules["limits"]["plan"]["block_for"] = "30s".into();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (gw, _dir) = gateway(&rules.to_string(), StoreUrl::Memory, true, clock).await;
    let http = Http::new();
    let k7 = [("x-api-key", common::K7)];
    let orders = format!("http://{}/v1/orders", gw.addr);
    // k-7's plan: burst 20, then the refusal that starts the block.
    for _ in 0..20 {
        assert_eq!(http.get(&orders, &k7).await.status, StatusCode::OK);
    }
    let refused = http.get(&orders, &k7).await;
    assert_eq!(refused.json()["error"], "blocked", "{:?}", refused.body);
    let usage = http.get(&format!("http://{}/v1/usage", gw.addr), &k7).await;
    assert_eq!(usage.status, StatusCode::OK, "{:?}", usage.body);
    assert_eq!(usage.json()["key"], "k-7");
    assert_eq!(http.get(&orders, &k7).await.json()["error"], "blocked");
    gw.shutdown().await;
}

/// A block lifted at once, before anything refilled: the bucket the refusal left empty is full
/// again, so the next requests pass (its whole burst) rather than start a new block, on the
/// embedded store and on Redis alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifted_block_refills_its_bucket_so_the_next_request_passes() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let http = Http::new();
    let q = format!(
        "/admin/blocks?limit=guard&bucket={}",
        BUCKET.replace('{', "%7B").replace('}', "%7D")
    );
    for store in ["redis", "memory"] {
        redis.cli(&["FLUSHALL"]);
        let url = match store {
            "redis" => StoreUrl::parse(&redis.url()).unwrap(),
            _ => StoreUrl::Memory,
        };
        // The clock never moves: nothing refills but the lift.
        let clock = ManualClock::new(1_700_000_000_000_000);
        let (gw, _dir) = gateway(&rules(upstream), url, true, clock).await;
        for round in 0..3 {
            let case = format!("{store}, round {round}");
            for _ in 0..2 {
                let a = get(&http, &gw, "/v1/guarded").await;
                assert_eq!(a.status, StatusCode::OK, "{case}: {:?}", a.body);
            }
            let refused = get(&http, &gw, "/v1/guarded").await;
            assert_eq!(refused.json()["error"], "blocked", "{case}: {:?}", refused.body);
            let lifted = admin(&http, &gw, Method::DELETE, &q, Some(TOKEN)).await;
            assert_eq!(lifted.status, StatusCode::OK, "{case}: {:?}", lifted.body);
        }
        let blocks = admin(&http, &gw, Method::GET, "/admin/blocks", None).await;
        assert_eq!(blocks.json()["blocks"], serde_json::json!([]), "{store}");
        assert_eq!(
            metric(&gw, "tollgate_blocks_started_total{limit=\"guard\"}"),
            "tollgate_blocks_started_total{limit=\"guard\"} 3",
            "{store}: one block a round, none after a lift"
        );
        gw.shutdown().await;
    }
}
