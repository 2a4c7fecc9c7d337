//! When the store fails, against a real redis-server and real gateway processes: killed mid-load,
//! hung (SIGSTOP), restarted, and each failure policy.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Http, K7, K8, RedisServer, Tollgate};
use http::StatusCode;
use serde_json::{Value, json};

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

async fn scrape(http: &Http, g: &Tollgate) -> String {
    String::from_utf8_lossy(&http.get(&g.admin_url("/metrics"), &[]).await.body).into_owned()
}

fn bypass(text: &str, limit: &str, policy: &str) -> f64 {
    metric(
        text,
        &format!(r#"tollgate_store_bypass_total{{limit="{limit}",policy="{policy}"}}"#),
    )
}

/// Demo rules pointed at `upstream`, with the plan's failure policy set.
fn rules(upstream: std::net::SocketAddr, plan_policy: &str) -> String {
    let mut r: Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
    r["limits"]["plan"]["on_store_failure"] = json!(plan_policy);
    r.to_string()
}

struct Fleet {
    gateways: Vec<Tollgate>,
    _dir: tempfile::TempDir,
}

async fn fleet(n: usize, redis: &RedisServer, plan_policy: &str, timeout: &str) -> Fleet {
    let upstream = common::start_demo_upstream().await;
    let (dir, path) = common::rules_file(&rules(upstream, plan_policy));
    let url = redis.url();
    let size = n.to_string();
    let gateways = (0..n)
        .map(|_| {
            Tollgate::spawn(&[
                "serve",
                "--rules",
                path.to_str().unwrap(),
                "--store",
                &url,
                "--fleet-size",
                &size,
                "--store-timeout",
                timeout,
            ])
        })
        .collect();
    Fleet { gateways, _dir: dir }
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
}

impl Tally {
    fn count(&self, s: StatusCode) {
        match s {
            StatusCode::OK => self.ok.fetch_add(1, Ordering::SeqCst),
            StatusCode::TOO_MANY_REQUESTS => self.limited.fetch_add(1, Ordering::SeqCst),
            _ => self.other.fetch_add(1, Ordering::SeqCst),
        };
    }
}

/// k-8 under its limit (a few a second over all gateways) and a storm of k-7, until `stop`.
fn load(
    f: &Fleet,
    stop: Arc<AtomicBool>,
    k7: Arc<Tally>,
    k8: Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let urls: Vec<String> = f.gateways.iter().map(|g| g.url("/v1/orders")).collect();
    let mut tasks = vec![];
    for w in 0..6 {
        let (urls, stop, k7) = (urls.clone(), stop.clone(), k7.clone());
        tasks.push(tokio::spawn(async move {
            let http = Http::new();
            let mut i = w;
            while !stop.load(Ordering::SeqCst) {
                let a = http.get(&urls[i % urls.len()], &[("x-api-key", K7)]).await;
                k7.count(a.status);
                i += 1;
            }
        }));
    }
    let (stop2, k8) = (stop, k8);
    tasks.push(tokio::spawn(async move {
        let http = Http::new();
        let mut i = 0;
        while !stop2.load(Ordering::SeqCst) {
            let a = http.get(&urls[i % urls.len()], &[("x-api-key", K8)]).await;
            k8.count(a.status);
            i += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }));
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_killed_mid_load_then_restarted() {
    let redis = RedisServer::start();
    let port = redis.port;
    let f = fleet(2, &redis, "local", "100ms").await;
    let http = Http::new();
    let stop = Arc::new(AtomicBool::new(false));
    let (k7, k8) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let tasks = load(&f, stop.clone(), k7.clone(), k8.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        k7.limited.load(Ordering::SeqCst) > 0,
        "the storm is not being limited"
    );

    // Kill the store; count k-7 admissions from here until it is back.
    let before = k7.ok.load(Ordering::SeqCst);
    let killed = Instant::now();
    drop(redis);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = scrape(&http, &f.gateways[0]).await;
    assert!(bypass(&m, "plan", "local") > 0.0, "no bypass was counted:\n{m}");
    assert_eq!(metric(&m, "tollgate_store_breaker_open"), 1.0);

    let redis = RedisServer::start_on(port);
    let outage = killed.elapsed().as_secs_f64();
    let during = k7.ok.load(Ordering::SeqCst) - before;
    // Each of N gateways holds a share of b/N = 10 and refills r/N = 5 a second:
    // N × (b/N + r/N × t) = 20 + 10·t. The first seconds after the restart (until the probe)
    // are still on shares, which the elapsed time covers.
    // The six storm workers' requests in flight at the kill were decided by the store.
    let in_flight = 6.0;
    let bound = 2.0 * (10.0 + 5.0 * outage) + in_flight;
    assert!(
        (during as f64) <= bound,
        "k-7 got {during} during a {outage:.2} s outage, above the local-share bound {bound:.1}"
    );
    assert!(during > 0, "local shares admitted nothing");

    // Within about a second of the next probe, decisions come from Redis again: the bypass
    // counters stop moving.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = scrape(&http, &f.gateways[0]).await;
        if metric(&m, "tollgate_store_breaker_open") == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the breaker never closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(
        &scrape(&http, &f.gateways[1]).await,
        "tollgate_store_breaker_open",
    ) != 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the second gateway's breaker never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A check that happens to take longer than the timeout on this shared machine is a real
    // bypass too, so allow a few; during the outage every request was one. Let reconnections
    // settle for a second first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let first: f64 = futures_bypass(&http, &f).await.iter().sum();
    let sent = k7.ok.load(Ordering::SeqCst) + k7.limited.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let moved = futures_bypass(&http, &f).await.iter().sum::<f64>() - first;
    let sent = (k7.ok.load(Ordering::SeqCst) + k7.limited.load(Ordering::SeqCst) - sent) as f64;
    assert!(sent > 100.0, "too little traffic to judge: {sent}");
    assert!(
        moved <= sent * 0.05,
        "bypass counters still move after the store came back: {moved} of {sent} requests"
    );
    assert_eq!(
        redis.bucket("HEXISTS", "rl:{k7}:plan"),
        "1",
        "decisions are not in Redis"
    );

    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(k8.other.load(Ordering::SeqCst), 0, "k-8 saw errors");
    assert_eq!(
        k8.limited.load(Ordering::SeqCst),
        0,
        "k-8, under its limit, was refused"
    );
    assert!(k8.ok.load(Ordering::SeqCst) > 30);
    assert_eq!(
        k7.other.load(Ordering::SeqCst),
        0,
        "k-7 saw errors other than 429"
    );
}

async fn futures_bypass(http: &Http, f: &Fleet) -> Vec<f64> {
    let mut out = vec![];
    for g in &f.gateways {
        out.push(bypass(&scrape(http, g).await, "plan", "local"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_store_costs_each_request_at_most_the_timeout() {
    let redis = RedisServer::start();
    let f = fleet(1, &redis, "local", "3ms").await;
    let g = &f.gateways[0];
    let http = Http::new();
    assert_eq!(
        http.get(&g.url("/v1/orders"), &[("x-api-key", K8)]).await.status,
        StatusCode::OK
    );
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &redis.pid().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let hung = Instant::now();
    let mut latencies = vec![];
    let mut breaker_open_after = None;
    for i in 0..300 {
        let t = Instant::now();
        let a = http.get(&g.url("/v1/orders"), &[("x-api-key", K8)]).await;
        latencies.push(t.elapsed());
        assert!(
            a.status == StatusCode::OK || a.status == StatusCode::TOO_MANY_REQUESTS,
            "{}",
            a.status
        );
        if breaker_open_after.is_none() && i % 5 == 4 {
            let m = scrape(&http, g).await;
            if metric(&m, "tollgate_store_breaker_open") == 1.0 {
                breaker_open_after = Some(hung.elapsed());
            }
        }
    }
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &redis.pid().to_string()])
        .status();
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    let max = *latencies.last().unwrap();
    let p50 = latencies[latencies.len() / 2];
    println!(
        "hung store, 300 requests through one gateway: p50 {p50:?}, p99 {p99:?}, max {max:?}; breaker open after {breaker_open_after:?}"
    );
    // The distribution is the figure; the bound is generous because the machine is shared.
    assert!(
        max < Duration::from_secs(1),
        "a request waited {max:?} on a hung store"
    );
    let opened = breaker_open_after.expect("the breaker never opened");
    assert!(
        opened < Duration::from_secs(2),
        "the breaker opened only after {opened:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_answers_503_and_open_admits_everything() {
    let redis = RedisServer::start();
    let closed = fleet(1, &redis, "closed", "20ms").await;
    let open = fleet(1, &redis, "open", "20ms").await;
    let http = Http::new();
    drop(redis);
    let a = http
        .get(&closed.gateways[0].url("/v1/orders"), &[("x-api-key", K7)])
        .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(a.header("retry-after"), Some("1"));
    assert_eq!(a.json(), json!({"error": "limiter_unavailable"}));

    // Open: far past k-7's burst of 20, everything passes and every pass is counted.
    let g = &open.gateways[0];
    for _ in 0..60 {
        let a = http.get(&g.url("/v1/orders"), &[("x-api-key", K7)]).await;
        assert_eq!(a.status, StatusCode::OK);
    }
    let m = scrape(&http, g).await;
    assert_eq!(bypass(&m, "plan", "open"), 60.0, "{m}");
    let m = scrape(&http, &closed.gateways[0]).await;
    assert_eq!(bypass(&m, "plan", "closed"), 1.0, "{m}");
    // The 503 is counted in the same words as the answer: unavailable, not limited.
    assert!(
        m.contains(r#"tollgate_limit_decisions_total{limit="plan",decision="unavailable"} 1"#),
        "{m}"
    );
    assert!(!m.contains(r#"decision="limited""#), "{m}");
}

#[test]
fn an_open_security_limit_fails_validation() {
    let mut r: Value = serde_json::from_str(&common::demo_json()).unwrap();
    r["limits"]["login"]["on_store_failure"] = json!("open");
    let err = tollgate_rules::compile(r.to_string().as_bytes(), "open-login.json", Default::default())
        .expect_err("an open security limit must be refused");
    assert_eq!(err.field, "limits.login.on_store_failure");
    assert!(err.reason.contains("may not fail open"), "{err}");
}

/// A moment of slowness times out every check in flight at once; on a busy gateway that is
/// many more than the five failures in a row that open the breaker, and an open breaker would
/// refuse (here, `closed`: 503) a second of requests the store then answers. Only the checks
/// that timed out get the failure policy's answer, and the breaker stays closed. A store that
/// stays hung still opens it within a few timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_moment_leaves_the_breaker_closed_and_a_hung_store_opens_it() {
    let redis = RedisServer::start();
    let f = fleet(1, &redis, "closed", "100ms").await;
    let g = &f.gateways[0];
    let http = Http::new();
    let orders = g.url("/v1/orders");
    let big = [("x-api-key", common::KBIG)];
    assert_eq!(http.get(&orders, &big).await.status, StatusCode::OK);

    // The store stops answering for half a second; twenty requests wait on it together.
    redis.cli(&["CLIENT", "PAUSE", "500", "ALL"]);
    let together: Vec<_> = (0..20)
        .map(|_| {
            let (http, orders) = (http.clone(), orders.clone());
            tokio::spawn(async move { http.get(&orders, &[("x-api-key", common::KBIG)]).await.status })
        })
        .collect();
    let mut unavailable = 0.0;
    for t in together {
        match t.await.unwrap() {
            StatusCode::OK => {}
            StatusCode::SERVICE_UNAVAILABLE => unavailable += 1.0,
            other => panic!("{other} during the pause"),
        }
    }
    // PING waits out the pause like any other command.
    assert_eq!(redis.cli(&["PING"]).trim(), "PONG");
    let m = scrape(&http, g).await;
    let timeouts = metric(&m, r#"tollgate_store_errors_total{kind="timeout"}"#);
    assert!(
        timeouts >= 5.0,
        "too few checks timed out together to have opened the old breaker: {timeouts}"
    );
    assert_eq!(
        unavailable, timeouts,
        "only the checks that timed out get the failure policy's answer"
    );
    assert_eq!(metric(&m, "tollgate_store_breaker_open"), 0.0, "{m}");
    for i in 0..20 {
        let a = http.get(&orders, &big).await;
        assert_eq!(
            a.status,
            StatusCode::OK,
            "request {i} after the pause: {:?}",
            a.body
        );
    }
    assert_eq!(
        metric(&scrape(&http, g).await, "tollgate_store_breaker_open"),
        0.0
    );
    assert!(!g.stderr().contains("breaker open"), "{}", g.stderr());

    // Hung for good: each request waits its timeout until five in a row open the breaker;
    // then none waits.
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &redis.pid().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let mut opened_after = None;
    for i in 0..10 {
        let a = http.get(&orders, &big).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "request {i}");
        if metric(&scrape(&http, g).await, "tollgate_store_breaker_open") == 1.0 {
            opened_after = Some(i + 1);
            break;
        }
    }
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &redis.pid().to_string()])
        .status();
    assert_eq!(
        opened_after,
        Some(5),
        "the breaker opens on the fifth timeout in a row"
    );
    // Back: the next request that is a probe (one a second) closes it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get(&orders, &big).await.status != StatusCode::OK {
        assert!(Instant::now() < deadline, "the breaker never closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        metric(&scrape(&http, g).await, "tollgate_store_breaker_open"),
        0.0
    );
}
