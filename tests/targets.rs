//! An upstream of several targets, against real processes: demo upstream instances that each
//! answer with their own name behind one upstream of a real gateway. A target killed under load
//! costs partners nothing (requests that could not reach it go to another, and it is ejected
//! until it is back); least request keeps traffic off a slow target; a hash keeps each key to
//! one target; a retry budget bounds retries when every target fails; with every target down,
//! a 502 names the upstream and the charge goes back.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::instances::{Instance, gateway, get, metric, targets};
use common::{Http, K7, K8, KBIG, Tollgate};
use http::StatusCode;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_target_killed_under_load_costs_partners_nothing_and_comes_back() {
    let a = Instance::spawn("a", "127.0.0.1:0", None);
    let mut b = Instance::spawn("b", "127.0.0.1:0", None);
    let c = Instance::spawn("c", "127.0.0.1:0", None);
    let b_addr = b.addr();
    let (gw, _dir) = gateway(json!({
        "targets": targets(&[&a, &b, &c]),
        "health": {"path": "/healthz", "interval_ms": 500, "timeout_ms": 400},
        "eject": {"consecutive_failures": 3, "for_ms": 1000},
    }));
    let http = Http::new();
    let start = Instant::now();
    let run = Duration::from_secs(8);
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (http, url) = (http.clone(), gw.url("/v1/orders"));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < run {
                    let r = http.get(&url, &[("x-api-key", KBIG)]).await;
                    let who = serde_json::from_slice::<Value>(&r.body)
                        .ok()
                        .and_then(|v| v["instance"].as_str().map(str::to_string));
                    seen.push((start.elapsed(), r.status, who));
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.kill();
    let killed = start.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _b = Instance::spawn("b", &b_addr.to_string(), None);
    let back = start.elapsed();
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap());
    }
    let bad: Vec<_> = all
        .iter()
        .filter(|(_, s, _)| *s != StatusCode::OK && *s != StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert!(
        bad.is_empty(),
        "partners saw {} errors: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    let from_b = |from: Duration, to: Duration| {
        all.iter()
            .filter(|(t, _, who)| *t >= from && *t < to && who.as_deref() == Some("b"))
            .count()
    };
    assert!(
        from_b(Duration::ZERO, killed) > 0,
        "b served before it was killed"
    );
    assert_eq!(
        from_b(killed + Duration::from_millis(100), back),
        0,
        "b answered while dead"
    );
    // Back once its health checks pass twice, 500 ms apart, and within a second more.
    let first_after = all
        .iter()
        .filter(|(t, _, who)| *t >= back && who.as_deref() == Some("b"))
        .map(|(t, ..)| *t)
        .min()
        .expect("b takes traffic again after its return");
    eprintln!(
        "{} requests; b killed at {killed:?}, started again at {back:?}, serving again at {first_after:?}",
        all.len()
    );
    assert!(
        first_after - back < Duration::from_secs(2),
        "b came back after {:?}",
        first_after - back
    );
    // The dead target was tried only until it was ejected, and once each time it came back.
    let b_label = format!("target=\"{b_addr}\"");
    let text = String::from_utf8(http.get(&gw.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    let count = |outcome: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with("tollgate_upstream_requests_total")
                    && l.contains(&b_label)
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let ejections = metric(
        &http,
        &gw,
        &format!("tollgate_upstream_ejections_total{{upstream=\"orders\",{b_label}}}"),
    )
    .await;
    let failed = count("connect_failure") + count("reset");
    eprintln!("b: {failed} failed attempts, {ejections} ejections");
    assert!(ejections >= 1.0, "b was ejected");
    assert!(
        failed <= 3.0 + 8.0 + ejections,
        "b was tried {failed} times while dead, with {ejections} ejections"
    );
    let view = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
    let orders = view["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "orders")
        .unwrap()
        .clone();
    assert_eq!(orders["targets"].as_array().unwrap().len(), 3, "{orders}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn least_request_keeps_traffic_off_a_slow_target_and_round_robin_does_not() {
    let slow = Instance::spawn("slow", "127.0.0.1:0", Some(100));
    let fast1 = Instance::spawn("fast1", "127.0.0.1:0", Some(1));
    let fast2 = Instance::spawn("fast2", "127.0.0.1:0", Some(1));
    for (balance, low, high) in [("least_request", 0.0, 0.10), ("round_robin", 0.28, 0.39)] {
        let (gw, _dir) = gateway(json!({
            "targets": targets(&[&slow, &fast1, &fast2]),
            "balance": balance,
        }));
        let http = Http::new();
        let start = Instant::now();
        let clients: Vec<_> = (0..8)
            .map(|_| {
                let (http, gw_url) = (http.clone(), gw.url("/v1/orders"));
                tokio::spawn(async move {
                    let mut who = Vec::new();
                    while start.elapsed() < Duration::from_secs(3) {
                        let r = http.get(&gw_url, &[("x-api-key", KBIG)]).await;
                        assert_eq!(r.status, StatusCode::OK);
                        who.push(r.json()["instance"].as_str().unwrap().to_string());
                    }
                    who
                })
            })
            .collect();
        let mut all = Vec::new();
        for c in clients {
            all.extend(c.await.unwrap());
        }
        let share = all.iter().filter(|w| *w == "slow").count() as f64 / all.len() as f64;
        eprintln!(
            "{balance}: the slow target took {:.1}% of {} requests",
            share * 100.0,
            all.len()
        );
        assert!(
            (low..=high).contains(&share),
            "{balance}: the slow target took {share:.3} of {} requests",
            all.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_keeps_each_key_to_one_target_and_a_lost_one_moves_only_its_keys() {
    let a = Instance::spawn("a", "127.0.0.1:0", None);
    let b = Instance::spawn("b", "127.0.0.1:0", None);
    let c = Instance::spawn("c", "127.0.0.1:0", None);
    let mut instances = [Some(a), Some(b), Some(c)];
    let all: Vec<&Instance> = instances.iter().flatten().collect();
    let (gw, _dir) = gateway(json!({"targets": targets(&all), "balance": "hash"}));
    let http = Http::new();
    let mut home = std::collections::BTreeMap::new();
    for key in [K7, K8, KBIG] {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..10 {
            let (status, who) = get(&http, &gw, "/v1/orders", key).await;
            assert_eq!(status, StatusCode::OK);
            seen.insert(who.unwrap());
        }
        assert_eq!(seen.len(), 1, "{key} went to {seen:?}");
        home.insert(key, seen.into_iter().next().unwrap());
    }
    // The target of k-big is lost: k-big moves, the others stay where they were.
    let lost = home[KBIG].clone();
    let i = ["a", "b", "c"].iter().position(|n| *n == lost).unwrap();
    instances[i] = None;
    for _ in 0..5 {
        let (status, who) = get(&http, &gw, "/v1/orders", KBIG).await;
        assert_eq!(status, StatusCode::OK, "k-big after its target was lost");
        assert_ne!(who.as_deref(), Some(lost.as_str()));
    }
    for key in [K7, K8] {
        if home[key] != lost {
            let (status, who) = get(&http, &gw, "/v1/orders", key).await;
            assert_eq!(
                (status, who.unwrap()),
                (StatusCode::OK, home[key].clone()),
                "{key} moved"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_target_down_is_a_refunded_502_naming_the_upstream_then_one_back_serves() {
    let mut a = Instance::spawn("a", "127.0.0.1:0", None);
    let mut b = Instance::spawn("b", "127.0.0.1:0", None);
    let a_addr = a.addr();
    let (gw, _dir) = gateway(json!({"targets": targets(&[&a, &b]), "eject": {"for_ms": 60000}}));
    let http = Http::new();
    assert_eq!(get(&http, &gw, "/v1/orders", K7).await.0, StatusCode::OK);
    a.kill();
    b.kill();
    // k-7's burst is 20: were the 502s charged, the last of these would be refused.
    for _ in 0..25 {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        let message = r.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(message.contains("\"orders\""), "{message}");
    }
    // Both ejected now (panic mode still tries them); one comes back and serves.
    let _a = Instance::spawn("a", &a_addr.to_string(), None);
    let (status, who) = get(&http, &gw, "/v1/orders", K7).await;
    assert_eq!((status, who.as_deref()), (StatusCode::OK, Some("a")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_failing_answers_stay_within_the_budget() {
    let a = Instance::spawn("a", "127.0.0.1:0", None);
    let b = Instance::spawn("b", "127.0.0.1:0", None);
    let c = Instance::spawn("c", "127.0.0.1:0", None);
    // No ejection in the way: a failure in a row ejects only after a million.
    let (gw, _dir) = gateway(json!({
        "targets": targets(&[&a, &b, &c]),
        "eject": {"consecutive_failures": 1000000},
        "retries": {"attempts": 2, "budget_percent": 20},
    }));
    let http = Http::new();
    let n = 200;
    for _ in 0..n {
        let (status, _) = get(&http, &gw, "/v1/orders?status=503", KBIG).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let retries = metric(&http, &gw, "tollgate_upstream_retries_total{").await;
    let attempts = metric(&http, &gw, "tollgate_upstream_requests_total{").await;
    let exhausted = metric(&http, &gw, "tollgate_upstream_retry_budget_exhausted_total").await;
    eprintln!("{n} requests: {attempts} attempts, {retries} retries, {exhausted} refused by the budget");
    assert_eq!(attempts, n as f64 + retries, "every attempt reached a target");
    assert!(
        retries <= (n as f64 * 0.2).max(10.0) + 1.0,
        "{retries} retries of {n}"
    );
    assert!(retries >= 10.0, "retries were tried at all: {retries}");
    assert!(exhausted > 0.0);
}

/// `POST`s under a target's death: one without `Idempotency-Key` that may have reached a target
/// is never sent again (every attempt that reached a target is one request), and those that
/// failed are `502`s; with an `Idempotency-Key`, the ones a dead target
/// reset go to another, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_post_is_sent_twice_only_with_an_idempotency_key() {
    for keyed in [false, true] {
        let a = Instance::spawn("a", "127.0.0.1:0", None);
        let mut b = Instance::spawn("b", "127.0.0.1:0", None);
        let (gw, _dir) = gateway(json!({
            "targets": targets(&[&a, &b]),
            "eject": {"consecutive_failures": 2, "for_ms": 60000},
        }));
        let http = Http::new();
        let start = Instant::now();
        let clients: Vec<_> = (0..8)
            .map(|_| {
                let (http, url) = (http.clone(), gw.url("/v1/payments"));
                tokio::spawn(async move {
                    let mut statuses = Vec::new();
                    let mut n = 0u64;
                    while start.elapsed() < Duration::from_secs(3) {
                        n += 1;
                        let key = format!("pay-{n}-{:?}", std::thread::current().id());
                        let mut headers = vec![("x-api-key", KBIG)];
                        if keyed {
                            headers.push(("idempotency-key", key.as_str()));
                        }
                        let r = http.send(http::Method::POST, &url, &headers, b"").await;
                        statuses.push(r.status);
                    }
                    statuses
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        b.kill();
        let mut statuses = Vec::new();
        for c in clients {
            statuses.extend(c.await.unwrap());
        }
        let failed = statuses.iter().filter(|s| **s == StatusCode::BAD_GATEWAY).count();
        let other: Vec<_> = statuses
            .iter()
            .filter(|s| **s != StatusCode::OK && **s != StatusCode::BAD_GATEWAY)
            .collect();
        assert!(other.is_empty(), "keyed {keyed}: {other:?}");
        let attempts = metric(&http, &gw, "tollgate_upstream_requests_total{").await;
        let text = String::from_utf8(http.get(&gw.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
        let outcome = |o: &str| -> f64 {
            text.lines()
                .filter(|l| {
                    l.starts_with("tollgate_upstream_requests_total")
                        && l.contains(&format!("outcome=\"{o}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        let (connect, reset, ok) = (outcome("connect_failure"), outcome("reset"), outcome("ok"));
        eprintln!(
            "keyed {keyed}: {} POSTs, {failed} answered 502; attempts {attempts}: {ok} ok, {reset} reset, {connect} never connected",
            statuses.len()
        );
        if keyed {
            assert_eq!(failed, 0, "with an Idempotency-Key none fails");
        } else {
            // Each POST reached at most one target: attempts that connected are one a POST.
            assert_eq!(ok + reset, statuses.len() as f64, "a POST went to two targets");
            assert_eq!(failed as f64, reset, "every POST a target reset is a 502");
        }
    }
}

/// `tollgate demo --targets 3`: three instances behind the demo's upstream, each answering with
/// its name; one stopped through the admin listener is routed around with no error and taken
/// out by its health checks, and started again it serves within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_three_instances_and_routes_around_a_stopped_one() {
    let gw = Tollgate::spawn(&["demo", "--targets", "3"]);
    let http = Http::new();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..60 {
        let (status, who) = get(&http, &gw, "/v1/orders", KBIG).await;
        assert_eq!(status, StatusCode::OK);
        seen.insert(who.unwrap());
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["orders-1", "orders-2", "orders-3"]
    );
    let stop = http
        .send(
            http::Method::POST,
            &gw.admin_url("/admin/demo/instances/orders-2/stop"),
            &[],
            b"",
        )
        .await;
    assert_eq!(stop.json(), json!({"instance": "orders-2", "stopped": true}));
    let state = async || {
        let v = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
        v["upstreams"][0]["targets"][1]["state"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let start = Instant::now();
    while state().await == "up" {
        let (status, who) = get(&http, &gw, "/v1/orders", KBIG).await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(who.as_deref(), Some("orders-2"));
        assert!(start.elapsed() < Duration::from_secs(5), "orders-2 still up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..30 {
        let (status, who) = get(&http, &gw, "/v1/orders", KBIG).await;
        assert_eq!(status, StatusCode::OK);
        assert_ne!(who.as_deref(), Some("orders-2"));
    }
    let again = http
        .send(
            http::Method::POST,
            &gw.admin_url("/admin/demo/instances/orders-2/start"),
            &[],
            b"",
        )
        .await;
    assert_eq!(again.json(), json!({"instance": "orders-2", "started": true}));
    let start = Instant::now();
    loop {
        let (status, who) = get(&http, &gw, "/v1/orders", KBIG).await;
        assert_eq!(status, StatusCode::OK);
        if who.as_deref() == Some("orders-2") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "orders-2 not back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let unknown = http
        .send(
            http::Method::POST,
            &gw.admin_url("/admin/demo/instances/orders-9/stop"),
            &[],
            b"",
        )
        .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

/// A target that reads what it is sent and closes without answering, as an instance killed
/// mid-request does; says how many bytes each connection brought.
async fn swallower() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<usize>>>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut n = 0;
                while let Ok(Ok(k)) = tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await
                {
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                log.lock().unwrap().push(n);
            });
        }
    });
    (addr, seen)
}

/// An idempotent request's body of up to 64 KiB goes to another target when the first closed
/// without answering; a larger one, or a `POST` without `Idempotency-Key`, is never sent
/// twice. On both wires.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_body_goes_to_another_target_and_a_large_one_never_twice() {
    for wire in [&[][..], &["--no-express"][..]] {
        let a = Instance::spawn("a", "127.0.0.1:0", None);
        let (dead, seen) = swallower().await;
        let mut rules: Value =
            serde_json::from_str(&common::demo_rules_for("127.0.0.1:9".parse().unwrap())).unwrap();
        rules["upstreams"]["orders"] = json!({
            "targets": [{"url": format!("http://{dead}")}, {"url": format!("http://{}", a.addr())}],
            "balance": "round_robin",
            "eject": {"consecutive_failures": 1000000},
        });
        let (_dir, path) = common::rules_file(&rules.to_string());
        let mut args = vec!["serve", "--rules", path.to_str().unwrap(), "--store", "memory"];
        args.extend(wire);
        let gw = Tollgate::spawn(&args);
        let http = Http::new();
        let body = |n: usize| -> &'static [u8] { Box::leak(vec![b'x'; n].into_boxed_slice()) };
        let send = |method: http::Method, size: usize, keyed: bool| {
            let (http, url) = (http.clone(), gw.url("/v1/things"));
            async move {
                let mut headers = vec![("x-api-key", KBIG)];
                if keyed {
                    headers.push(("idempotency-key", "k-1"));
                }
                let r = http.send(method, &url, &headers, body(size)).await;
                let v = serde_json::from_slice::<Value>(&r.body).unwrap_or_default();
                (
                    r.status,
                    v["bytes"].as_u64(),
                    v["instance"].as_str().map(str::to_string),
                )
            }
        };
        let small = 20 * 1024;
        for _ in 0..6 {
            assert_eq!(
                send(http::Method::PUT, small, false).await,
                (StatusCode::OK, Some(small as u64), Some("a".to_string())),
                "{wire:?}"
            );
            assert_eq!(
                send(http::Method::POST, small, true).await,
                (StatusCode::OK, Some(small as u64), Some("a".to_string())),
                "{wire:?}"
            );
        }
        // The closing target logs a connection 200 ms after its last byte.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let reached = seen.lock().unwrap().len();
        assert!(reached >= 5, "{wire:?}: the closing target was tried: {reached}");
        // Past 64 KiB, or a POST without a key: the one that reached the closing target fails.
        let large = 100 * 1024;
        let mut failed = 0;
        for _ in 0..4 {
            let (status, ..) = send(http::Method::PUT, large, false).await;
            failed += usize::from(status == StatusCode::BAD_GATEWAY);
            let (status, ..) = send(http::Method::POST, small, false).await;
            failed += usize::from(status == StatusCode::BAD_GATEWAY);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = seen.lock().unwrap().len();
        assert!(failed >= 3, "{wire:?}: {failed} of 8 failed");
        assert_eq!(
            after - reached,
            failed,
            "{wire:?}: each failure reached the closing target once"
        );
    }
}

/// Targets with their own `max_in_flight`: each is held to its own, and the upstream to their
/// sum (requests past it wait their turn rather than pile on a target).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_target_keeps_to_its_own_cap_and_the_upstream_to_their_sum() {
    let a = Instance::spawn("a", "127.0.0.1:0", Some(300));
    let b = Instance::spawn("b", "127.0.0.1:0", Some(300));
    let (gw, _dir) = gateway(json!({
        "targets": [
            {"url": format!("http://{}", a.addr()), "max_in_flight": 2},
            {"url": format!("http://{}", b.addr()), "max_in_flight": 1},
        ],
        "queue_timeout_ms": 20000,
    }));
    let http = Http::new();
    let clients: Vec<_> = (0..9)
        .map(|_| {
            let (http, url) = (http.clone(), gw.url("/v1/orders"));
            tokio::spawn(async move { http.get(&url, &[("x-api-key", KBIG)]).await.status })
        })
        .collect();
    let mut most = [0u64; 2];
    let mut caps = vec![];
    while !clients.iter().all(|c| c.is_finished()) {
        let view = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
        let targets = view["upstreams"][0]["targets"].as_array().unwrap().clone();
        for (i, t) in targets.iter().enumerate() {
            most[i] = most[i].max(t["in_flight"].as_u64().unwrap());
        }
        caps = targets.iter().map(|t| t["max_in_flight"].clone()).collect();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for c in clients {
        assert_eq!(c.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(caps, vec![json!(2), json!(1)]);
    assert_eq!(most, [2, 1], "requests in flight at most, per target");
    let dash = http.get(&gw.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(&dash.body);
    assert!(
        text.lines()
            .any(|l| l.starts_with("tollgate_upstream_concurrency_limit{") && l.ends_with(" 3")),
        "the upstream's cap is the sum"
    );
}
