//! Adaptive concurrency with real processes: `tollgate demo-upstream` with a pool of workers
//! plays a slow service, `tollgate serve` sheds what it can't serve with quick 503s, and the
//! limit follows the upstream's latency down and back up.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{DemoUpstreamProc, Http, Tollgate};

/// Rules with one upstream `orders` at `upstream`, adaptive between `min` and `max`.
fn rules(upstream: std::net::SocketAddr, min: u32, max: u32) -> String {
    format!(
        r#"{{"version": 1,
            "upstreams": {{"orders": {{"url": "http://{upstream}",
                "concurrency": {{"adaptive": true, "min": {min}, "max": {max}}}}}}},
            "routes": [{{"method": "GET", "path": "/v1/orders", "upstream": "orders", "key": "optional"}},
                       {{"method": "*", "path": "/v1/slow", "upstream": "orders", "key": "optional"}}]}}"#
    )
}

fn gateway(rules: &str) -> (Tollgate, tempfile::TempDir) {
    let (dir, path) = common::rules_file(rules);
    let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap(), "--store", "memory"]);
    (gw, dir)
}

/// One answer as the load loops see it.
#[derive(Debug, Clone)]
struct Seen {
    status: u16,
    took: Duration,
    retry_after: bool,
    overloaded: bool,
}

/// `clients` closed loops GETting `path` until `until`; a shed client waits 20 ms before its
/// next try, as a polite client would.
async fn load(http: &Http, url: String, clients: usize, until: Instant) -> Vec<Seen> {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = vec![];
    for _ in 0..clients {
        let (http, url, seen) = (http.clone(), url.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < until {
                let t = Instant::now();
                let a = http.get(&url, &[]).await;
                let s = Seen {
                    status: a.status.as_u16(),
                    took: t.elapsed(),
                    retry_after: a.header("retry-after").is_some(),
                    overloaded: a.status == 503 && a.json()["error"] == "upstream_overloaded",
                };
                let shed = s.status == 503;
                seen.lock().unwrap().push(s);
                if shed {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The limit the gateway reports for `orders` in its metrics.
async fn limit(http: &Http, gw: &Tollgate) -> u32 {
    let text = String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("tollgate_upstream_concurrency_limit{upstream=\"orders\"} "))
        .unwrap_or_else(|| panic!("no limit for orders in the metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_upstream_gets_quick_503s_while_admitted_latency_stays_bounded() {
    // 4 workers of 100 ms: 40 a second. 48 clients would queue 1.2 s deep without shedding.
    let up = DemoUpstreamProc::spawn(4, 100);
    let (gw, _dir) = gateway(&rules(up.addr, 2, 200));
    let http = Http::new();
    let seen = load(
        &http,
        gw.url("/v1/orders"),
        48,
        Instant::now() + Duration::from_secs(4),
    )
    .await;

    let shed: Vec<&Seen> = seen.iter().filter(|s| s.status == 503).collect();
    let admitted: Vec<&Seen> = seen.iter().filter(|s| s.status == 200).collect();
    assert_eq!(
        shed.len() + admitted.len(),
        seen.len(),
        "only 200 and 503: {:?}",
        seen.iter().find(|s| s.status != 200 && s.status != 503)
    );
    assert!(
        !shed.is_empty() && !admitted.is_empty(),
        "{} shed, {} admitted",
        shed.len(),
        admitted.len()
    );
    assert!(
        shed.iter().all(|s| s.overloaded && s.retry_after),
        "every shed answer is upstream_overloaded with Retry-After"
    );
    let unshed_queue = Duration::from_millis(48 / 4 * 100);
    let admitted_median = median(admitted.iter().map(|s| s.took).collect());
    assert!(
        admitted_median < unshed_queue / 2,
        "admitted requests waited {admitted_median:?}, as if queued ({unshed_queue:?})"
    );
    let shed_median = median(shed.iter().map(|s| s.took).collect());
    assert!(
        shed_median < admitted_median,
        "shed answers ({shed_median:?}) should come before the upstream's ({admitted_median:?})"
    );

    let text = String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned();
    let counted = metric(&text, "tollgate_upstream_shed_total{upstream=\"orders\"} ").unwrap_or(0.0);
    assert_eq!(counted as usize, shed.len(), "{text}");
    assert_eq!(
        metric(&text, "tollgate_upstream_in_flight{upstream=\"orders\"} "),
        Some(0.0),
        "{text}"
    );
    let l = limit(&http, &gw).await;
    assert!((2..=200).contains(&l), "limit {l}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limit_falls_when_latency_grows_and_rises_back_when_it_recovers() {
    // Enough workers that nothing queues: only the service time changes.
    let up = DemoUpstreamProc::spawn(64, 50);
    let (gw, _dir) = gateway(&rules(up.addr, 2, 500));
    let http = Http::new();
    let phase = |ms: u64, secs: u64| {
        load(
            &http,
            gw.url(&format!("/v1/slow?ms={ms}")),
            24,
            Instant::now() + Duration::from_secs(secs),
        )
    };
    phase(50, 3).await;
    let healthy = limit(&http, &gw).await;
    // The service slows eightfold.
    let slow = phase(400, 3).await;
    let slowed = limit(&http, &gw).await;
    assert!(
        slowed < healthy,
        "the limit stayed at {slowed} (was {healthy}) while latency grew"
    );
    assert!(
        slow.iter().any(|s| s.overloaded),
        "nothing was shed while the limit fell"
    );
    phase(50, 3).await;
    let recovered = limit(&http, &gw).await;
    assert!(
        recovered > slowed,
        "the limit stayed at {recovered} (was {slowed}) after latency recovered"
    );
}

/// Polls the gateway's in-flight count for `orders` until it is `n`; false after 5 s.
async fn in_flight_becomes(http: &Http, gw: &Tollgate, n: f64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let text = String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned();
        if metric(&text, "tollgate_upstream_in_flight{upstream=\"orders\"} ") == Some(n) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gives_its_place_back() {
    use tokio::io::AsyncWriteExt;
    let up = DemoUpstreamProc::spawn(8, 10);
    // min = max = 2: the limit is 2 whatever the latency.
    let (gw, _dir) = gateway(&rules(up.addr, 2, 2));
    let http = Http::new();
    // A GET without a body takes the express lane; a POST with one, hyper's path.
    for head in [
        "GET /v1/slow?ms=60000 HTTP/1.1\r\nHost: t\r\n\r\n",
        "POST /v1/slow?ms=60000 HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}",
    ] {
        let mut held = vec![];
        for _ in 0..2 {
            let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            held.push(s);
        }
        assert!(
            in_flight_becomes(&http, &gw, 2.0).await,
            "{head:?}: two never in flight"
        );
        let a = http.get(&gw.url("/v1/orders"), &[]).await;
        assert_eq!(a.status, 503, "{head:?}: a third place");
        // The clients hang up long before the upstream would answer.
        drop(held);
        assert!(
            in_flight_becomes(&http, &gw, 0.0).await,
            "{head:?}: the places of clients gone were not given back"
        );
        let a = http.get(&gw.url("/v1/orders"), &[]).await;
        assert_eq!(a.status, 200, "{head:?}");
    }
}

#[test]
fn bad_concurrency_fields_stop_the_gateway_with_their_message() {
    let base = rules("127.0.0.1:9".parse().unwrap(), 4, 2000);
    let bad = base.replace(r#""min": 4, "max": 2000"#, r#""min": 40, "max": 20"#);
    let (ok, stderr) = common::processes::serve_and_exit(&bad, &[]);
    assert!(!ok);
    assert!(
        stderr.contains("upstreams.orders.concurrency.max: 20 is below min 40"),
        "{stderr}"
    );
}

#[test]
fn demo_upstream_workers_must_be_at_least_one() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["demo-upstream", "--listen", "127.0.0.1:0", "--workers", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--workers must be at least 1"), "{stderr}");
}
