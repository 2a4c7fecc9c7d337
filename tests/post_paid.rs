//! Post-paid limits end to end: the demo's `tokens` limit (k-8: 10,000 a minute, burst 10,000)
//! charged from the `X-Usage-Tokens` the demo upstream answers `POST /v1/completions?tokens=N`
//! with. A gateway in this process on a manual clock, on the embedded store and on a real
//! redis-server reading the gateway's clock, on the express lane (which hands these requests to
//! hyper's path) and on hyper's path alone.

mod common;

use std::net::SocketAddr;

use common::{Answer, Http, K8, RedisServer};
use http::{Method, StatusCode};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::clock::ManualClock;

async fn completion(http: &Http, addr: SocketAddr, tokens: Option<u64>) -> Answer {
    let q = tokens.map(|t| format!("?tokens={t}")).unwrap_or_default();
    http.send(
        Method::POST,
        &format!("http://{addr}/v1/completions{q}"),
        &[("x-api-key", K8)],
        b"{}",
    )
    .await
}

fn ratelimit(a: &Answer) -> &str {
    a.header("ratelimit").unwrap_or("(none)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_owe_their_tokens_and_the_fifth_waits_for_the_debt() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let rules = common::demo_rules_for(upstream);
    let http = Http::new();
    for (store, express) in [
        ("memory", true),
        ("memory", false),
        ("redis", true),
        ("redis", false),
    ] {
        let case = format!("{store}, express lane {express}");
        let store_url = match store {
            "memory" => StoreUrl::Memory,
            _ => {
                // Each case its own buckets: they outlive a gateway in Redis.
                redis.cli(&["FLUSHALL"]);
                StoreUrl::parse(&redis.url()).unwrap()
            }
        };
        let clock = ManualClock::new(1_700_000_000_000_000);
        let (gw, _dir) = common::start_manual(&rules, store_url, express, clock.clone()).await;

        // No header: the reserve is the whole cost.
        let a = completion(&http, gw.addr, None).await;
        assert_eq!(a.status, StatusCode::OK, "{case}: {:?}", a.body);
        // 10,000 - 1: the plan's 39 of 40 is what RateLimit shows, the smaller remainder.
        assert_eq!(ratelimit(&a), "\"plan-burst\";r=39;t=1", "{case}");
        // The one token comes back in 6 ms; the clock moves on past it.
        clock.advance_us(6_000);
        let b = completion(&http, gw.addr, Some(0)).await;
        assert_eq!(b.status, StatusCode::OK, "{case}");

        // 3,000 tokens each: 1 up front, 2,999 when the answer reports them. The first three
        // leave 10,000 - 9,000 = 1,000 (the reserve of the zero-token one came back).
        for k in 1..=3 {
            let a = completion(&http, gw.addr, Some(3_000)).await;
            assert_eq!(a.status, StatusCode::OK, "{case}: completion {k}");
            assert_eq!(
                a.header("x-usage-tokens"),
                Some("3000"),
                "{case}: the upstream's header reaches the client"
            );
            if k == 3 {
                // 1,000 of 10,000 left: 9,000 tokens to refill at 6 ms each is 54 s.
                assert_eq!(ratelimit(&a), "\"plan-burst\";r=35;t=1", "{case}");
            }
        }
        // The fourth is admitted on its reserve and leaves the bucket 2,000 in debt; its
        // RateLimit is read after the debit: 12,000 tokens short of full, 72 s.
        let a = completion(&http, gw.addr, Some(3_000)).await;
        assert_eq!(a.status, StatusCode::OK, "{case}: the fourth is admitted");
        assert_eq!(ratelimit(&a), "\"tokens-burst\";r=0;t=72", "{case}");
        assert!(
            a.header("ratelimit-policy")
                .unwrap_or("")
                .contains("\"tokens\";q=10000;w=60"),
            "{case}: {:?}",
            a.header("ratelimit-policy")
        );

        // The fifth waits for 2,000 owed and 1 to pay: 2,001 × 6 ms = 12.006 s.
        let e = completion(&http, gw.addr, Some(3_000)).await;
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS, "{case}: {:?}", e.body);
        assert_eq!(e.header("retry-after"), Some("13"), "{case}");
        assert_eq!(e.json()["limit"], "tokens", "{case}: {:?}", e.body);
        assert!(
            e.header("x-usage-tokens").is_none(),
            "{case}: refused before the upstream"
        );

        clock.advance_us(12_005_999);
        let e = completion(&http, gw.addr, Some(1)).await;
        assert_eq!(
            e.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{case}: 1 µs short of the debt's repayment"
        );
        clock.advance_us(1);
        let a = completion(&http, gw.addr, Some(1)).await;
        assert_eq!(a.status, StatusCode::OK, "{case}: the debt is repaid");
        // It took its reserve and reported exactly that: the bucket is empty, not in debt.
        assert_eq!(ratelimit(&a), "\"tokens-burst\";r=0;t=60", "{case}");
        gw.shutdown().await;
    }
}

/// The demo rules with the completions route charging the tokens limit only, its reserve
/// `reserve`, so `RateLimit` shows that bucket.
fn tokens_only(upstream: SocketAddr, reserve: u64) -> String {
    let text = common::demo_rules_for(upstream);
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    rules["limits"]["tokens"]["reserve"] = reserve.into();
    let route = rules["routes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|r| r["name"] == "completions")
        .expect("the demo's completions route");
    route["cost"] = serde_json::json!({ "tokens": reserve });
    rules.to_string()
}

/// An upstream that answers every request with `X-Usage-Tokens: lots`.
async fn nonsense_upstream() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = s.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if got.len() < end + 4 + len {
                        continue;
                    }
                    got.drain(..end + 4 + len);
                    let answer = b"HTTP/1.1 200 OK\r\nx-usage-tokens: lots\r\ncontent-length: 2\r\n\r\n{}";
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_below_the_reserve_gives_the_rest_back() {
    let upstream = common::start_demo_upstream().await;
    let http = Http::new();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let (gw, _dir) =
        common::start_manual(&tokens_only(upstream, 500), StoreUrl::Memory, true, clock.clone()).await;
    // Reserve 500, report 100: 400 come back; 100 tokens refill in 0.6 s.
    let a = completion(&http, gw.addr, Some(100)).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(ratelimit(&a), "\"tokens-burst\";r=9900;t=1");
    let a = completion(&http, gw.addr, Some(9_800)).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(ratelimit(&a), "\"tokens-burst\";r=100;t=60");
    // 100 left, 500 to reserve: 400 more in 2.4 s.
    let e = completion(&http, gw.addr, Some(1)).await;
    assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(e.header("retry-after"), Some("3"));
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_that_is_not_a_count_costs_the_reserve() {
    let upstream = nonsense_upstream().await;
    let http = Http::new();
    let clock = ManualClock::new(1_700_000_000_000_000);
    for express in [true, false] {
        let (gw, _dir) = common::start_manual(
            &tokens_only(upstream, 500),
            StoreUrl::Memory,
            express,
            clock.clone(),
        )
        .await;
        let a = completion(&http, gw.addr, None).await;
        assert_eq!(a.status, StatusCode::OK, "express lane {express}");
        assert_eq!(a.header("x-usage-tokens"), Some("lots"));
        assert_eq!(
            ratelimit(&a),
            "\"tokens-burst\";r=9500;t=3",
            "express lane {express}"
        );
        gw.shutdown().await;
    }
}
