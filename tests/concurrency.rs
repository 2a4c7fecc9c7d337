//! Limits on requests in flight per key (`"concurrent": N`), in real gateway processes on the
//! embedded store and on a real redis-server, on the express lane and on hyper's path: at most
//! N of a key's requests reach the upstream at once, the rest get 429 at once, and the seats of
//! a gateway killed with -9 come back when their lease ends.

mod common;

use std::time::{Duration, Instant};

use common::{Http, KBIG, RedisServer, Tollgate, rules_file};
use http::StatusCode;

/// The demo rules with "inflight", 10 requests in flight per key, on every `/v1/` path.
fn rules() -> String {
    let text = common::demo_json();
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    rules["limits"]["inflight"] = serde_json::json!({"dimension": "key", "concurrent": 10});
    for r in rules["routes"].as_array_mut().unwrap() {
        if r["name"] == "v1" {
            r["cost"]["inflight"] = 1.into();
        }
    }
    rules.to_string()
}

/// Sends `n` slow requests at once; returns the statuses and, for the 429s, the longest any
/// took.
async fn burst(gw: &Tollgate, n: usize, ms: u64) -> (Vec<StatusCode>, Duration, Vec<serde_json::Value>) {
    let url = gw.url(&format!("/v1/slow?ms={ms}"));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let r = Http::new().get(&url, &[("x-api-key", KBIG)]).await;
            (r.status, started.elapsed(), r.json(), r.headers)
        }));
    }
    let mut statuses = Vec::new();
    let mut slowest_refusal = Duration::ZERO;
    let mut refusals = Vec::new();
    for t in tasks {
        let (status, took, body, headers) = t.await.unwrap();
        if status == StatusCode::TOO_MANY_REQUESTS {
            slowest_refusal = slowest_refusal.max(took);
            assert_eq!(headers["retry-after"], "1");
            assert_eq!(
                headers["ratelimit-policy"],
                r#""inflight";q=10;qu="concurrent-requests""#
            );
            refusals.push(body);
        }
        statuses.push(status);
    }
    (statuses, slowest_refusal, refusals)
}

fn count(statuses: &[StatusCode], s: StatusCode) -> usize {
    statuses.iter().filter(|x| **x == s).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_ten_of_a_keys_requests_are_in_flight() {
    let redis = RedisServer::start();
    let (_dir, path) = rules_file(&rules());
    let path = path.to_str().unwrap().to_string();
    for (store, lane) in [
        ("memory", true),
        ("memory", false),
        ("redis", true),
        ("redis", false),
    ] {
        let url = redis.url();
        let mut args = vec!["demo", "--rules", &path];
        if store == "redis" {
            args.extend(["--store", &url, "--store-timeout", "200ms"]);
        }
        if !lane {
            args.push("--no-express");
        }
        let gw = Tollgate::spawn(&args);
        let case = format!("{store}, express lane {lane}");
        let (statuses, slowest_refusal, refusals) = burst(&gw, 50, 1500).await;
        assert_eq!(count(&statuses, StatusCode::OK), 10, "{case}: {statuses:?}");
        assert_eq!(
            count(&statuses, StatusCode::TOO_MANY_REQUESTS),
            40,
            "{case}: {statuses:?}"
        );
        // Refused at once, not after a slow request ended.
        assert!(
            slowest_refusal < Duration::from_millis(1500),
            "{case}: {slowest_refusal:?}"
        );
        assert_eq!(refusals[0]["error"], "too_many_in_flight", "{case}");
        assert_eq!(refusals[0]["max_in_flight"], 10, "{case}");
        // Every seat comes back with its answer. A seat in Redis is given back by a call that
        // follows the answer, so a client quick enough may still find it held for a moment:
        // ask again until all ten pass, within a second.
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        loop {
            let (statuses, _, _) = burst(&gw, 10, 0).await;
            if count(&statuses, StatusCode::OK) == 10 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{case}: seats not back: {statuses:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A key's seats are its own: another key is not held up.
        let other = Http::new()
            .get(&gw.url("/v1/slow?ms=0"), &[("x-api-key", common::K8)])
            .await;
        assert_eq!(other.status, StatusCode::OK, "{case}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_seats_come_back_within_the_lease() {
    let redis = RedisServer::start();
    let (_dir, path) = rules_file(&rules());
    let path = path.to_str().unwrap();
    let url = redis.url();
    let spawn = || {
        Tollgate::spawn(&[
            "demo",
            "--rules",
            path,
            "--store",
            &url,
            "--store-timeout",
            "200ms",
            "--concurrency-lease",
            "1s",
        ])
    };
    let mut a = spawn();
    let b = spawn();
    // Ten requests that would last a minute hold every seat through gateway A.
    let slow = a.url("/v1/slow?ms=60000");
    let holders: Vec<_> = (0..10)
        .map(|_| {
            let slow = slow.clone();
            tokio::spawn(async move { Http::new().get(&slow, &[("x-api-key", KBIG)]).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seats = redis.cli(&["ZCARD", "seats:{kbig}:inflight"]);
        if seats == "10" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the ten seats were never taken: {seats}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Held across renewals: after two leases they are still A's.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let r = Http::new()
        .get(&b.url("/v1/orders"), &[("x-api-key", KBIG)])
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "a route without the limit is not held up"
    );
    let r = Http::new()
        .get(&b.url("/v1/slow?ms=0"), &[("x-api-key", KBIG)])
        .await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "A still holds every seat: {:?}",
        r.body
    );

    a.signal("KILL");
    let _ = a.child.wait();
    for h in holders {
        h.abort();
    }
    let killed = Instant::now();
    loop {
        let r = Http::new()
            .get(&b.url("/v1/slow?ms=0"), &[("x-api-key", KBIG)])
            .await;
        if r.status == StatusCode::OK {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(3),
            "the dead gateway's seats are still taken {:?} after the kill (lease 1 s)",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gives_its_seat_back() {
    let (_dir, path) = rules_file(&rules());
    let path = path.to_str().unwrap().to_string();
    for lane in [true, false] {
        let mut args = vec!["demo", "--rules", &path];
        if !lane {
            args.push("--no-express");
        }
        let gw = Tollgate::spawn(&args);
        // Ten clients take every seat with requests that would last a minute, then hang up. A
        // probe below may hold a seat for a moment: a holder refused meanwhile asks again.
        let slow = gw.url("/v1/slow?ms=60000");
        let holders: Vec<_> = (0..10)
            .map(|_| {
                let slow = slow.clone();
                tokio::spawn(async move {
                    while Http::new().get(&slow, &[("x-api-key", KBIG)]).await.status
                        == StatusCode::TOO_MANY_REQUESTS
                    {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
            })
            .collect();
        let quick = gw.url("/v1/slow?ms=0");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Http::new().get(&quick, &[("x-api-key", KBIG)]).await.status != StatusCode::TOO_MANY_REQUESTS {
            assert!(
                Instant::now() < deadline,
                "express lane {lane}: the ten seats were never all taken"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for h in holders {
            h.abort();
        }
        let gone = Instant::now();
        loop {
            if Http::new().get(&quick, &[("x-api-key", KBIG)]).await.status == StatusCode::OK {
                break;
            }
            assert!(
                gone.elapsed() < Duration::from_secs(5),
                "express lane {lane}: seats still held {:?} after their clients hung up",
                gone.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
