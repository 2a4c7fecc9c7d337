//! Limits that queue instead of refusing (`"delay": {"max_wait_ms": N}`), end to end: a gateway
//! in this process on a manual clock, on the embedded store and on a real redis-server reading
//! the gateway's clock, on the express lane and on hyper's path, in front of an upstream that
//! counts what reaches it. A request short of tokens waits until they are due and is then
//! forwarded; one that would wait longer than N is refused at once; one whose client leaves
//! is neither forwarded nor billed, and its turn passes unused: the upstream never gets more
//! than the limit's bound, b + r·t, in any window, however many leave.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Http, KBIG, RedisServer};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate_gateway::app::{self, Running};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::clock::ManualClock;

/// An upstream that answers every request 200 and counts them, and with a clock, notes the
/// time of each.
struct Counting {
    addr: SocketAddr,
    hits: Arc<AtomicU64>,
    arrivals: Arc<std::sync::Mutex<Vec<u64>>>,
}

impl Counting {
    async fn start(clock: Option<Arc<ManualClock>>) -> Counting {
        use tollgate_limit::clock::Clock;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(AtomicU64::new(0));
        let arrivals = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (h, times) = (hits.clone(), arrivals.clone());
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = l.accept().await {
                let (h, times, clock) = (h.clone(), times.clone(), clock.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            if let Some(c) = &clock {
                                times.lock().unwrap().push(c.now_us());
                            }
                            h.fetch_add(1, Ordering::SeqCst);
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if tcp.write_all(ok).await.is_err() {
                                return;
                            }
                        }
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        Counting { addr, hits, arrivals }
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }

    /// The gateway clock's time of each request that arrived.
    fn arrivals(&self) -> Vec<u64> {
        self.arrivals.lock().unwrap().clone()
    }
}

/// The demo rules with "queue": 10 a second per client IP, burst 1, a wait of up to 2 s, on
/// `GET /v1/queued` (k-big's plan, 10,000 a second, never decides).
fn rules(upstream: SocketAddr) -> String {
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
    rules["limits"]["queue"] = serde_json::json!({
        "dimension": "ip", "rate": "10/1s", "burst": 1, "delay": {"max_wait_ms": 2000}
    });
    rules["routes"].as_array_mut().unwrap().insert(
        0,
        serde_json::json!({
            "name": "queued", "method": "GET", "path": "/v1/queued", "upstream": "orders",
            "cost": {"plan": 1, "queue": 1}
        }),
    );
    rules.to_string()
}

/// Polls `cond` every 5 ms for up to 5 s (real time, for the gateway's tasks to run; the
/// bucket's time is the manual clock's).
async fn until(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(5), "waited 5 s for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every case on its own buckets: a fresh gateway, and a flushed redis-server.
fn cases(redis: &RedisServer) -> Vec<(String, StoreUrl, bool)> {
    let mut out = Vec::new();
    for store in ["memory", "redis"] {
        for express in [true, false] {
            let url = match store {
                "memory" => StoreUrl::Memory,
                _ => StoreUrl::parse(&redis.url()).unwrap(),
            };
            out.push((format!("{store}, express lane {express}"), url, express));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_at_once_are_forwarded_a_tenth_of_a_second_apart_and_nine_refused() {
    let redis = RedisServer::start();
    let http = Http::new();
    for (case, store, express) in cases(&redis) {
        redis.cli(&["FLUSHALL"]);
        let up = Counting::start(None).await;
        let clock = ManualClock::new(1_700_000_000_000_000);
        let (gw, _dir) = common::start_manual(&rules(up.addr), store, express, clock.clone()).await;
        let url = format!("http://{}/v1/queued", gw.addr);
        let tasks: Vec<_> = (0..30)
            .map(|_| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move { http.get(&url, &[("x-api-key", KBIG)]).await })
            })
            .collect();

        // At the first instant: the one token's request goes on, twenty wait, nine are refused.
        until(&format!("{case}: the first request"), || up.hits() == 1).await;
        until(&format!("{case}: twenty waiting"), || {
            gw.metrics.queue_waiting.get() == 20
        })
        .await;
        assert_eq!(gw.metrics.queued.get(), 20, "{case}");
        // The first answered and nine refused; twenty still waiting.
        until(&format!("{case}: nine refusals"), || {
            tasks.iter().filter(|t| t.is_finished()).count() == 10
        })
        .await;

        // Then one every 100 ms of the clock, and none a microsecond before its turn.
        for k in 1..=20u64 {
            clock.advance_us(99_999);
            tokio::time::sleep(Duration::from_millis(60)).await;
            assert_eq!(up.hits(), k, "{case}: nothing before {k} × 100 ms");
            clock.advance_us(1);
            until(&format!("{case}: request {} at {k} × 100 ms", k + 1), || {
                up.hits() == k + 1
            })
            .await;
        }
        assert_eq!(gw.metrics.queue_waiting.get(), 0, "{case}");

        let mut statuses = Vec::new();
        for t in tasks {
            let a = t.await.unwrap();
            if a.status == StatusCode::TOO_MANY_REQUESTS {
                // The 22nd would wait 2.1 s, the 30th 2.9 s: each passes within a second.
                assert_eq!(a.header("retry-after"), Some("1"), "{case}");
                assert_eq!(a.json()["limit"], "queue", "{case}: {:?}", a.body);
            }
            statuses.push(a.status.as_u16());
        }
        statuses.sort();
        assert_eq!(statuses, [vec![200; 21], vec![429; 9]].concat(), "{case}");
        assert_eq!(up.hits(), 21, "{case}");
        gw.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_its_queue_is_neither_forwarded_nor_billed() {
    let redis = RedisServer::start();
    let http = Http::new();
    for (case, store, express) in cases(&redis) {
        redis.cli(&["FLUSHALL"]);
        let up = Counting::start(None).await;
        let clock = ManualClock::new(1_700_000_000_000_000);
        let (mut cfg, _dir) = common::manual_config(&rules(up.addr), store, express, clock.clone());
        let meter_dir = tempfile::tempdir().unwrap();
        cfg.meter = Some(tollgate_gateway::app::MeterConfig {
            instance: "queue".into(),
            interval: Duration::from_secs(60),
            file: meter_dir.path().join("usage.db"),
        });
        let gw = app::start(cfg).await.expect("gateway starts");
        let url = format!("http://{}/v1/queued", gw.addr);

        // The one token.
        assert_eq!(
            http.get(&url, &[("x-api-key", KBIG)]).await.status,
            StatusCode::OK,
            "{case}"
        );
        // A client that queues for the next one, 100 ms out, and leaves.
        let tcp = queue_raw(&gw, 1).await;
        drop(tcp);
        until(&format!("{case}: the client left its queue"), || {
            gw.metrics.queue_left.get() == 1
        })
        .await;
        assert_eq!(gw.metrics.queue_waiting.get(), 0, "{case}");
        // Its turn at 100 ms passes unused: the next request is due at 200 ms.
        let next = {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move { http.get(&url, &[("x-api-key", KBIG)]).await })
        };
        until(&format!("{case}: the next one queued"), || {
            gw.metrics.queue_waiting.get() == 1
        })
        .await;
        clock.advance_us(199_999);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(up.hits(), 1, "{case}: nothing before 200 ms");
        clock.advance_us(1);
        until(&format!("{case}: the next one forwarded at 200 ms"), || {
            up.hits() == 2
        })
        .await;
        assert_eq!(next.await.unwrap().status, StatusCode::OK, "{case}");
        assert_eq!(up.hits(), 2, "{case}: the client that left was never forwarded");
        // Billed for what reached the upstream: two, not the one that left.
        let totals = gw.meter.as_ref().expect("metering on").totals();
        let big = totals.iter().find(|(k, _)| &**k == "k-big").map(|(_, n)| *n);
        assert_eq!(big, Some(2), "{case}: {totals:?}");
        gw.shutdown().await;
    }
}

/// Opens a connection that sends one request to the queued route and waits until it is the
/// `waiting`-th in the queue; dropping it leaves the queue.
async fn queue_raw(gw: &Running, waiting: i64) -> tokio::net::TcpStream {
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!("GET /v1/queued HTTP/1.1\r\nHost: t\r\nx-api-key: {KBIG}\r\n\r\n");
    tcp.write_all(head.as_bytes()).await.unwrap();
    until(&format!("request {waiting} queued"), || {
        gw.metrics.queue_waiting.get() == waiting
    })
    .await;
    tcp
}

/// Clients that leave the queue while others wait and newcomers arrive: 5 queue behind the
/// one token, the 1st and 3rd leave, 2 newcomers queue. Every arrival at the upstream is timed
/// on the gateway's clock, and no window holds more than 1 + 10 a second × its length: the
/// newcomers take turns after the last one handed out, not the turns of those still waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leavers_never_let_the_upstream_see_more_than_the_bound() {
    let redis = RedisServer::start();
    let http = Http::new();
    for (case, store, express) in cases(&redis) {
        redis.cli(&["FLUSHALL"]);
        let clock = ManualClock::new(1_700_000_000_000_000);
        let up = Counting::start(Some(clock.clone())).await;
        let (gw, _dir) = common::start_manual(&rules(up.addr), store, express, clock.clone()).await;
        let url = format!("http://{}/v1/queued", gw.addr);
        assert_eq!(
            http.get(&url, &[("x-api-key", KBIG)]).await.status,
            StatusCode::OK,
            "{case}"
        );
        // Five waiting, due at 100, 200, 300, 400 and 500 ms.
        let mut waiting = Vec::new();
        for k in 1..=5 {
            waiting.push(Some(queue_raw(&gw, k).await));
        }
        // The ones due at 100 and 300 ms leave.
        waiting[0] = None;
        waiting[2] = None;
        until(&format!("{case}: two left"), || gw.metrics.queue_left.get() == 2).await;
        // Two newcomers.
        let newcomers: Vec<_> = (0..2)
            .map(|_| {
                let (http, url) = (http.clone(), url.clone());
                tokio::spawn(async move { http.get(&url, &[("x-api-key", KBIG)]).await })
            })
            .collect();
        until(&format!("{case}: five waiting again"), || {
            gw.metrics.queue_waiting.get() == 5
        })
        .await;
        // Time moves in steps of 25 ms until every waiting request is forwarded.
        for _ in 0..40 {
            if gw.metrics.queue_waiting.get() == 0 {
                break;
            }
            clock.advance_us(25_000);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        assert_eq!(gw.metrics.queue_waiting.get(), 0, "{case}: the queue drained");
        for n in newcomers {
            assert_eq!(n.await.unwrap().status, StatusCode::OK, "{case}");
        }
        let mut at = up.arrivals();
        at.sort_unstable();
        assert_eq!(at.len(), 6, "{case}: the token, three who stayed, two newcomers");
        // Every window [at[i], at[j]] holds j - i + 1 arrivals: at most b + r·t.
        for i in 0..at.len() {
            for j in i..at.len() {
                let bound = 1 + (at[j] - at[i]) * 10 / 1_000_000;
                assert!(
                    (j - i + 1) as u64 <= bound,
                    "{case}: {} arrivals within {} µs, above the bound {bound}: {:?}",
                    j - i + 1,
                    at[j] - at[i],
                    at.iter().map(|t| t - at[0]).collect::<Vec<_>>()
                );
            }
        }
        drop(waiting);
        gw.shutdown().await;
    }
}
