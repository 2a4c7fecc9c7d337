//! The gateway end to end in this process: real listeners on 127.0.0.1:0, a real upstream,
//! real HTTP clients, and the embedded store on a manual clock.

mod common;

use std::time::Duration;

use common::{Answer, Http, K7, demo_gateway};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

async fn orders(http: &Http, base: &str, key: &str) -> Answer {
    http.get(&format!("{base}/v1/orders"), &[("authorization", &bearer(key))])
        .await
}

#[tokio::test]
async fn burst_of_20_then_429_with_every_header() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    let mut statuses = vec![];
    let mut last = None;
    for _ in 0..25 {
        let a = orders(&http, &base, K7).await;
        statuses.push(a.status);
        last = Some(a);
    }
    assert!(
        statuses[..20].iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert!(
        statuses[20..].iter().all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    let a = last.unwrap();
    // The clock did not move: no token came back, the wait for one is 0.1 s, rounded up to 1.
    assert_eq!(a.header("retry-after"), Some("1"));
    assert_eq!(a.header("cache-control"), Some("no-store"));
    assert_eq!(
        a.header("ratelimit-policy"),
        Some(r#""plan-burst";q=20;w=2, "plan";q=600;w=60"#)
    );
    assert_eq!(a.header("ratelimit"), Some(r#""plan-burst";r=0;t=1"#));
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(
        a.json(),
        serde_json::json!({"error": "rate_limited", "limit": "plan", "retry_after_seconds": 1})
    );
}

#[tokio::test]
async fn allowed_answers_carry_the_budget() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let a = orders(&Http::new(), &base, K7).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.header("ratelimit-policy"),
        Some(r#""plan-burst";q=20;w=2, "plan";q=600;w=60"#)
    );
    // 19 whole tokens left; 0.1 s until full again, rounded up.
    assert_eq!(a.header("ratelimit"), Some(r#""plan-burst";r=19;t=1"#));
    assert_eq!(a.json()["path"], "/v1/orders");
}

#[tokio::test]
async fn refill_comes_from_the_injected_clock() {
    let (gw, clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    for _ in 0..20 {
        assert_eq!(orders(&http, &base, K7).await.status, StatusCode::OK);
    }
    assert_eq!(
        orders(&http, &base, K7).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // 99.999 ms refills 0.99999 tokens: still refused.
    clock.advance_us(99_999);
    assert_eq!(
        orders(&http, &base, K7).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Exactly one token at 100 ms: a bucket holding exactly the cost admits.
    clock.advance_us(1);
    assert_eq!(orders(&http, &base, K7).await.status, StatusCode::OK);
    assert_eq!(
        orders(&http, &base, K7).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Two exports 1 ms apart, each charged in the plan and in the exports bucket: the second,
/// refused by the exports bucket, leaves the plan bucket untouched, because both are checked in
/// one all-or-nothing call.
#[tokio::test]
async fn refused_export_leaves_the_plan_untouched() {
    let (gw, clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    let auth = bearer(K7);
    let url = format!("{base}/v1/exports");
    let hdrs = [("authorization", auth.as_str())];
    let export = || http.send(Method::POST, &url, &hdrs, b"{}");

    let first = export().await;
    assert_eq!(first.status, StatusCode::OK);
    clock.advance_us(1_000);
    let second = export().await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(second.header("retry-after"), Some("5"));
    assert_eq!(second.json()["limit"], "exports");
    assert_eq!(second.json()["retry_after_seconds"], 5);
    assert_eq!(
        second.header("ratelimit-policy"),
        Some(r#""exports-burst";q=1;w=5, "exports";q=1;w=5"#)
    );

    // The plan holds 10.01 tokens: ten orders pass and the eleventh is refused. Had the refused
    // export been charged in the plan, it would hold 0.01 and the first order would fail.
    for i in 0..10 {
        let a = orders(&http, &base, K7).await;
        assert_eq!(a.status, StatusCode::OK, "order {i}");
        assert_eq!(
            a.header("ratelimit"),
            Some(format!(r#""plan-burst";r={};t=2"#, 9 - i).as_str())
        );
    }
    assert_eq!(
        orders(&http, &base, K7).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn unknown_key_gets_401_and_pays_the_ip_bucket() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    let url = format!("{base}/v1/orders");
    // The unauthenticated bucket holds 5: five guesses get 401, the sixth 429.
    for i in 0..5 {
        let a = http.get(&url, &[("x-api-key", "not-a-key")]).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "guess {i}");
        assert_eq!(a.json()["error"], "unauthorized");
        assert_eq!(a.json()["message"], "unknown API key");
        assert_eq!(a.json()["reason"], "unknown_key");
    }
    let a = http.get(&url, &[("x-api-key", "another-guess")]).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.json()["limit"], "unauth");
    // A real key is unaffected.
    assert_eq!(orders(&http, &base, K7).await.status, StatusCode::OK);
}

#[tokio::test]
async fn keyed_route_without_a_key_is_401_and_unknown_route_404() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    let a = http.get(&format!("{base}/v1/orders"), &[]).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(a.json()["error"], "unauthorized");
    assert_eq!(a.json()["reason"], "missing_key");
    let a = http
        .get(&format!("{base}/nowhere"), &[("authorization", &bearer(K7))])
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.json()["error"], "not_found");
    // A prefix matches whole segments only.
    let a = http
        .get(&format!("{base}/v1/ordersX"), &[("authorization", &bearer(K7))])
        .await;
    assert_eq!(a.status, StatusCode::OK, "falls to the /v1/ catch-all route");
    let a = http
        .get(&format!("{base}/v1"), &[("authorization", &bearer(K7))])
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn login_is_limited_per_account_without_a_key() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let http = Http::new();
    let url = format!("{base}/login");
    let alice = [("x-account", "alice")];
    // The per-IP unauthenticated bucket (burst 5) and the per-account bucket (burst 5) both pay.
    for _ in 0..5 {
        assert_eq!(
            http.send(Method::POST, &url, &alice, b"{}").await.status,
            StatusCode::OK
        );
    }
    let a = http.send(Method::POST, &url, &alice, b"{}").await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    let a = http
        .send(Method::POST, &format!("{base}/login"), &[], b"{}")
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{:?}", a.json());
    assert!(a.json()["message"].as_str().unwrap().contains("x-account"));
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_and_forwarded_headers_added() {
    let (gw, _clock, _dir) = demo_gateway().await;
    let base = format!("http://{}", gw.addr);
    let a = Http::new()
        .get(
            &format!("{base}/v1/orders"),
            &[
                ("authorization", &bearer(K7)),
                ("connection", "x-private-hop"),
                ("x-private-hop", "secret"),
                ("keep-alive", "timeout=5"),
                ("te", "trailers"),
                ("proxy-authorization", "Basic Zm9vOmJhcg=="),
                ("x-tollgate-tenant", "spoofed"),
                ("x-end-to-end", "kept"),
            ],
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let seen = &a.json()["headers"];
    for gone in [
        "connection",
        "x-private-hop",
        "keep-alive",
        "te",
        "proxy-authorization",
        "authorization",
    ] {
        assert!(seen.get(gone).is_none(), "{gone} reached the upstream: {seen}");
    }
    assert_eq!(seen["x-end-to-end"], "kept");
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");
    assert_eq!(seen["x-forwarded-host"], gw.addr.to_string());
    assert_eq!(seen["x-tollgate-key-id"], "k-7");
    assert_eq!(seen["x-tollgate-tenant"], "k7");
}

/// An upstream written by hand, to misbehave in exact ways.
async fn raw_upstream(behaviour: &'static str) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let _ = s.read(&mut buf).await;
                match behaviour {
                    "reset" => {
                        let _ = s.set_zero_linger();
                        drop(s);
                    }
                    "hang" => {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    "answer-once" => {
                        // Answer the first request with keep-alive, then drop the connection
                        // as the next request arrives: a kept connection closed under a request.
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            .await;
                        let _ = s.read(&mut buf).await;
                        drop(s);
                    }
                    "hop" => {
                        let _ = s
                            .write_all(
                                b"HTTP/1.1 200 OK\r\nConnection: x-upstream-hop\r\nX-Upstream-Hop: 1\r\n\
                                  Keep-Alive: timeout=9\r\nX-Upstream-Kept: 1\r\nContent-Length: 2\r\n\r\nok",
                            )
                            .await;
                    }
                    _ => unreachable!(),
                }
            });
        }
    });
    addr
}

fn rules_with_upstream(addr: String, timeout_ms: u64) -> String {
    let text = common::demo_json();
    text.replace(
        r#""url": "http://127.0.0.1:8081", "timeout_ms": 30000"#,
        &format!(r#""url": "http://{addr}", "timeout_ms": {timeout_ms}"#),
    )
}

async fn gateway_for(
    upstream: String,
    timeout_ms: u64,
) -> (tollgate_gateway::app::Running, tempfile::TempDir) {
    let clock = tollgate_limit::clock::ManualClock::new(1_000_000);
    common::start_gateway(&rules_with_upstream(upstream, timeout_ms), clock).await
}

#[tokio::test]
async fn upstream_response_hop_by_hop_headers_are_stripped() {
    let up = raw_upstream("hop").await;
    let (gw, _dir) = gateway_for(up.to_string(), 30_000).await;
    let a = orders(&Http::new(), &format!("http://{}", gw.addr), K7).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(&a.body[..], b"ok");
    assert!(a.header("x-upstream-hop").is_none());
    assert!(a.header("keep-alive").is_none());
    assert_eq!(a.header("x-upstream-kept"), Some("1"));
}

#[tokio::test]
async fn refused_and_reset_upstreams_give_502_and_a_stalled_one_504() {
    // Nothing listens on a port we just released.
    let closed = format!("127.0.0.1:{}", common::free_port());
    let (gw, _d1) = gateway_for(closed, 30_000).await;
    let a = orders(&Http::new(), &format!("http://{}", gw.addr), K7).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(a.json()["error"], "bad_gateway");

    let reset = raw_upstream("reset").await;
    let (gw, _d2) = gateway_for(reset.to_string(), 30_000).await;
    let a = orders(&Http::new(), &format!("http://{}", gw.addr), K7).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(a.json()["error"], "bad_gateway");

    let hang = raw_upstream("hang").await;
    let (gw, _d3) = gateway_for(hang.to_string(), 200).await;
    let a = orders(&Http::new(), &format!("http://{}", gw.addr), K7).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(a.json()["error"], "gateway_timeout");
}

#[tokio::test]
async fn a_kept_connection_closed_under_a_request_is_retried_only_when_safe() {
    let up = raw_upstream("answer-once").await;
    let (gw, _dir) = gateway_for(up.to_string(), 30_000).await;
    let http = Http::new();
    let base = format!("http://{}", gw.addr);
    // The express lane (requests without a body). Two GETs: the second goes out on the kept
    // connection, which the upstream closes; a GET is sent again on a new connection.
    for i in 0..2 {
        let a = orders(&http, &base, common::K8).await;
        assert_eq!(a.status, StatusCode::OK, "GET {i}: {:?}", a.body);
        rest().await;
    }
    // A POST without a body, on the connection kept from the retry: not idempotent, so the
    // failure is the answer.
    let a = http
        .send(
            Method::POST,
            &format!("{base}/v1/things"),
            &[("x-api-key", common::K8)],
            b"",
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{:?}", a.body);
    // hyper's path (requests with a body) keeps its own connections: the first POST opens one
    // and is answered; the second goes out on it, the upstream closes it, and a POST with a
    // body is not sent twice.
    let things = format!("{base}/v1/things");
    let post = || http.send(Method::POST, &things, &[("x-api-key", common::K8)], b"{}");
    let a = post().await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    rest().await;
    let a = post().await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{:?}", a.body);
}

/// Longer than a kept upstream connection rests after its answer (2 ms) before it carries
/// another request, so the next request reuses it.
async fn rest() {
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
}
