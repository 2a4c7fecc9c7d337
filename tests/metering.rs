//! Metering in real gateway processes: every admitted request is counted once per key, apart
//! from the limiter; the records land on a real redis-server's stream or in the embedded
//! store's SQLite file; a clean stop ends with an `end` record, and `kill -9` loses at most the
//! last interval: an under-bill, never an over-bill.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Http, K7, RedisServer, Tollgate};
use http::StatusCode;
use tollgate_meter::record::{Identity, Kind, Record};

/// Sends `n` requests of k-7 and returns how many were admitted (200); a 429 is the limit.
async fn send_k7(http: &Http, gw: &Tollgate, n: usize) -> u64 {
    let mut admitted = 0;
    for i in 0..n {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        match r.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("request {i}: {other} {:?}", r.body),
        }
    }
    admitted
}

/// Waits for a process to exit after a signal, without guessing how long it takes.
fn wait_exit(gw: &mut Tollgate) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while gw.child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "gateway still runs 30 s after the signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Per identity: the records in order.
fn by_identity(records: impl IntoIterator<Item = Record>) -> HashMap<Identity, Vec<Record>> {
    let mut m: HashMap<Identity, Vec<Record>> = HashMap::new();
    for r in records {
        m.entry(r.identity.clone()).or_default().push(r);
    }
    m
}

/// The largest total an identity reported for `key`, and whether it ended cleanly; its
/// sequence numbers must run 1, 2, 3… without a gap.
fn summary(records: &[Record], key: &str) -> (u64, bool) {
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r.seq, i as u64 + 1, "sequence of {}: {records:?}", r.identity);
    }
    totals(records, key)
}

/// The largest total for `key`, and whether the last record is the end.
fn totals(records: &[Record], key: &str) -> (u64, bool) {
    let total = records
        .iter()
        .filter_map(|r| match &r.kind {
            Kind::Usage { key: k, total } if k == key => Some(*total),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    (total, matches!(records.last().map(|r| &r.kind), Some(Kind::End)))
}

fn sqlite_records(file: &Path) -> Vec<Record> {
    let conn = tollgate_meter::sqlite::open(file).expect("the metering file opens");
    tollgate_meter::sqlite::read_records(&conn)
        .expect("records read")
        .into_iter()
        .map(|(_, r)| r)
        .collect()
}

/// `XRANGE tollgate:usage - +` through redis-cli, parsed back into records.
fn stream_records(redis: &RedisServer) -> Vec<Record> {
    let out = redis.cli(&["XRANGE", "tollgate:usage", "-", "+"]);
    let mut records = Vec::new();
    let mut fields: Vec<String> = Vec::new();
    let flush = |fields: &mut Vec<String>, records: &mut Vec<Record>| {
        if fields.is_empty() {
            return;
        }
        let pairs = fields.chunks(2).map(|p| (p[0].as_str(), p[1].as_str()));
        records.push(Record::from_fields(pairs).unwrap_or_else(|e| panic!("{e}: {fields:?}")));
        fields.clear();
    };
    for line in out.lines() {
        let is_id = line.split_once('-').is_some_and(|(a, b)| {
            !a.is_empty() && a.bytes().all(|c| c.is_ascii_digit()) && b.bytes().all(|c| c.is_ascii_digit())
        });
        if is_id && fields.len().is_multiple_of(2) {
            flush(&mut fields, &mut records);
        } else {
            fields.push(line.to_string());
        }
    }
    flush(&mut fields, &mut records);
    records
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_counts_admitted_requests_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("usage.db");
    let file_arg = file.to_str().unwrap();
    let http = Http::new();
    let mut admitted = 0;
    for run in 0..2 {
        let mut gw = Tollgate::spawn(&["demo", "--meter-file", file_arg, "--instance", "gw-embedded"]);
        // 25 at once on a burst of 20: some are limited, and those must not count.
        let ok = send_k7(&http, &gw, 25).await;
        assert!(
            ok < 25,
            "run {run}: every request admitted; the test needs some limited"
        );
        admitted += ok;
        gw.signal("TERM");
        wait_exit(&mut gw);
    }
    let ids = by_identity(sqlite_records(&file));
    assert_eq!(ids.len(), 2, "one identity per start: {ids:?}");
    let mut billed = 0;
    for (id, recs) in &ids {
        assert_eq!(id.gateway, "gw-embedded");
        let (total, ended) = summary(recs, "k-7");
        assert!(ended, "{id} stopped cleanly but has no end record: {recs:?}");
        billed += total;
    }
    assert_eq!(billed, admitted, "billed totals against admitted requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_redis_bill_what_they_admitted_and_a_killed_one_under_bills() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (_rules_dir, rules) = common::rules_file(&common::demo_rules_for(upstream));
    let url = redis.url();
    let args = |name: &'static str| {
        vec![
            "serve".to_string(),
            "--rules".into(),
            rules.to_str().unwrap().into(),
            "--store".into(),
            url.clone(),
            "--store-timeout".into(),
            "1s".into(),
            "--instance".into(),
            name.into(),
            "--meter-interval".into(),
            "100ms".into(),
        ]
    };
    let spawn = |name| {
        let a = args(name);
        Tollgate::spawn(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let mut a = spawn("gw-a");
    let mut b = spawn("gw-b");
    let http = Http::new();
    let a_ok = send_k7(&http, &a, 8).await;
    let b_first = send_k7(&http, &b, 8).await;

    // Both report their totals within a few intervals; polled, not slept for.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ids = by_identity(stream_records(&redis));
        let reported: HashMap<&str, u64> = ids
            .iter()
            .map(|(id, recs)| (id.gateway.as_str(), summary(recs, "k-7").0))
            .collect();
        if reported.get("gw-a") == Some(&a_ok) && reported.get("gw-b") == Some(&b_first) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "totals never reached the stream: {reported:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // b admits more, then dies before it can flush them all.
    let b_second = send_k7(&http, &b, 6).await;
    b.signal("KILL");
    wait_exit(&mut b);
    a.signal("TERM");
    wait_exit(&mut a);

    let ids = by_identity(stream_records(&redis));
    let find = |name: &str| {
        ids.iter()
            .find(|(id, _)| id.gateway == name)
            .unwrap_or_else(|| panic!("no records of {name}: {ids:?}"))
            .1
    };
    let (a_total, a_ended) = summary(find("gw-a"), "k-7");
    assert_eq!(
        a_total, a_ok,
        "gw-a stopped cleanly: billed exactly what it admitted"
    );
    assert!(a_ended, "gw-a has an end record");
    let (b_total, b_ended) = summary(find("gw-b"), "k-7");
    assert!(
        !b_ended,
        "gw-b was killed: no end record, so the meter can report it"
    );
    assert!(
        (b_first..=b_first + b_second).contains(&b_total),
        "gw-b billed {b_total}; it admitted {b_first} before its last flush and {b_second} after"
    );
}

fn at(rfc3339: &str) -> u64 {
    let ms = rfc3339.parse::<jiff::Timestamp>().unwrap().as_millisecond();
    ms as u64 * 1000
}

/// A key flagged over its daily quota gets 429 `quota_exceeded` until midnight in the quota's
/// zone, and every answer lists the quota; the clock is moved, not waited for. Both paths
/// answer alike: the express lane and hyper's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_quota_key_is_refused_until_its_midnight() {
    over_quota_until_midnight(true).await;
    over_quota_until_midnight(false).await;
}

async fn over_quota_until_midnight(express: bool) {
    use tollgate_gateway::app::{self, GatewayConfig, MeterConfig, RulesSource};
    use tollgate_limit::clock::ManualClock;
    use tollgate_meter::flags::{Flag, State};
    use tollgate_rules::quota::Per;

    let upstream = common::start_demo_upstream().await;
    let (dir, rules) = common::rules_file(&common::demo_rules_with_k7_quota(upstream, 100));
    let file = dir.path().join("usage.db");
    // 23:30 in Paris on 1 December: half an hour before the quota's day ends.
    let clock = ManualClock::new(at("2026-12-01T22:30:00Z"));
    let mut cfg = GatewayConfig::new(RulesSource::File(rules));
    cfg.clock = clock.clone();
    cfg.limits.express = express;
    cfg.admin_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.meter = Some(MeterConfig {
        instance: "gw-quota".into(),
        interval: Duration::from_secs(5),
        file: file.clone(),
    });
    let gw = app::start(cfg).await.expect("gateway starts");
    let url = format!("http://{}/v1/orders", gw.addr);
    let http = Http::new();

    // Under quota: the answer lists it, with all 100 left and 30 minutes to the reset.
    let r = http.get(&url, &[("x-api-key", K7)]).await;
    assert_eq!(r.status, StatusCode::OK);
    let mut k7_admitted = 1;
    let policy = r.header("ratelimit-policy").unwrap_or_default();
    assert!(policy.ends_with(", \"day\";q=100;w=86400"), "{policy}");
    let state = r.header("ratelimit").unwrap_or_default();
    assert!(state.ends_with(", \"day\";r=100;t=1800"), "{state}");

    // The metering side flags k-7 over for its Paris day.
    let flag = Flag {
        state: State::Over,
        quota: Per::Day,
        period: "2026-12-01".into(),
        used: 100,
        limit: 100,
        resets_at_ms: at("2026-12-01T23:00:00Z") as i64 / 1000,
        resets_at: "2026-12-02T00:00:00+01:00".into(),
    };
    let conn = tollgate_meter::sqlite::open(&file).unwrap();
    tollgate_meter::sqlite::write_flag(&conn, "k-7", &flag).unwrap();

    // Gateways read flags every second: poll the admin listener until this one has. Polling
    // with k-7's requests would spend its bucket, which the manual clock never refills.
    let usage_url = format!("http://{}/admin/usage?key=k-7", gw.admin_addr.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get(&usage_url, &[]).await.json()["quota"]["state"] != "over" {
        assert!(Instant::now() < deadline, "the over flag was never read");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = http.get(&url, &[("x-api-key", K7)]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.json(),
        serde_json::json!({"error": "quota_exceeded", "quota": "day", "resets_at": "2026-12-02T00:00:00+01:00"})
    );
    assert_eq!(refused.header("retry-after"), Some("1800"));
    assert!(
        refused
            .header("ratelimit")
            .is_some_and(|s| s.contains("\"day\";r=0;t=1800")),
        "{:?}",
        refused.headers
    );
    // Another key is not touched by k-7's quota.
    let other = http.get(&url, &[("x-api-key", common::K8)]).await;
    assert_eq!(other.status, StatusCode::OK);
    assert!(
        other
            .header("ratelimit-policy")
            .is_some_and(|p| !p.contains("\"day\""))
    );

    // One second before Paris midnight: still refused, for one second.
    clock.set_us(at("2026-12-01T22:59:59Z"));
    let r = http.get(&url, &[("x-api-key", K7)]).await;
    assert_eq!(
        (r.status, r.header("retry-after")),
        (StatusCode::TOO_MANY_REQUESTS, Some("1"))
    );
    // Midnight in Paris: a new day, the old flag says nothing, the full quota is back.
    clock.set_us(at("2026-12-01T23:00:00Z"));
    let r = http.get(&url, &[("x-api-key", K7)]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    k7_admitted += 1;
    assert!(
        r.header("ratelimit")
            .is_some_and(|s| s.ends_with("\"day\";r=100;t=86400")),
        "{:?}",
        r.headers
    );

    // The admin listener shows this gateway's count and the quota. A request is counted as it
    // ends, which can be a moment after its client has the answer.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let u = loop {
        let usage = http
            .get(
                &format!("http://{}/admin/usage?key=k-7", gw.admin_addr.unwrap()),
                &[],
            )
            .await;
        assert_eq!(usage.status, StatusCode::OK);
        let u = usage.json();
        if u["admitted_by_this_gateway"] == k7_admitted || std::time::Instant::now() > deadline {
            break u;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(u["key"], "k-7");
    assert_eq!(u["quota"]["period"], "2026-12-02");
    assert_eq!(u["quota"]["state"], "under");
    assert_eq!(
        u["admitted_by_this_gateway"], k7_admitted,
        "{u}: admitted requests count, the quota refusals must not"
    );
    let missing = http
        .get(
            &format!("http://{}/admin/usage?key=nope", gw.admin_addr.unwrap()),
            &[],
        )
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    gw.shutdown().await;
}

/// Metering counts what was admitted whatever decided it: with the store down, requests the
/// failure policy admits (open, or each gateway's local share) are billed once the store is
/// back, from the running totals of the final records; none of it is lost or counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_equal_admissions_under_each_failure_policy() {
    for policy in ["open", "local"] {
        let port = common::free_port();
        let redis = RedisServer::start_on(port);
        let upstream = common::start_demo_upstream().await;
        let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
        rules["limits"]["plan"]["on_store_failure"] = serde_json::json!(policy);
        let (_dir, path) = common::rules_file(&rules.to_string());
        let url = redis.url();
        let spawn = |name: &str| {
            Tollgate::spawn(&[
                "serve",
                "--rules",
                path.to_str().unwrap(),
                "--store",
                &url,
                "--fleet-size",
                "2",
                "--store-timeout",
                "200ms",
                "--instance",
                name,
                "--meter-interval",
                "100ms",
            ])
        };
        let mut gws = [spawn("gw-1"), spawn("gw-2")];
        let http = Http::new();
        let mut admitted = 0;
        for g in &gws {
            admitted += send_k7(&http, g, 4).await;
        }
        // The store goes away; the failure policy decides.
        drop(redis);
        let mut during = 0;
        for g in &gws {
            during += send_k7(&http, g, 12).await;
        }
        assert!(during > 0, "{policy}: nothing admitted while the store was down");
        admitted += during;
        // Back, empty (no persistence): only running totals can make the bill whole.
        let redis = RedisServer::start_on(port);
        for g in &mut gws {
            g.signal("TERM");
            wait_exit(g);
        }
        let ids = by_identity(stream_records(&redis));
        assert_eq!(ids.len(), 2, "{policy}: {ids:?}");
        let mut billed = 0;
        for (id, recs) in &ids {
            let (total, ended) = summary_tail(recs, "k-7");
            assert!(ended, "{policy}: {id} has no end record: {recs:?}");
            billed += total;
        }
        assert_eq!(billed, admitted, "{policy}: billed against admitted");
    }
}

/// As [`summary`], for a stream that lost its earlier records with the store: sequence
/// numbers only rise.
fn summary_tail(records: &[Record], key: &str) -> (u64, bool) {
    for w in records.windows(2) {
        assert!(w[0].seq < w[1].seq, "sequence goes back: {records:?}");
    }
    totals(records, key)
}

/// A quota crossed mid-day: with the default intervals (records every 5 s, flags read every 1 s)
/// and a meter consumer running, a key is refused within about 11 s of the request that took
/// it over its daily quota. The requests come at a steady pace, as a partner's would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crossed_quota_is_enforced_within_eleven_seconds() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (dir, rules) = common::rules_file(&common::demo_rules_with_k7_quota(upstream, 20));
    assert!(std::fs::read_to_string(&rules).unwrap().contains("\"limit\":20"));
    let url = redis.url();
    let mut gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        &url,
        "--store-timeout",
        "1s",
        "--instance",
        "gw-33",
    ]);
    let mut meter = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["meter", "--store", &url, "--rules", rules.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("meter.log")).unwrap())
        .spawn()
        .expect("tollgate meter starts");
    let http = Http::new();
    let mut admitted = 0;
    let mut crossed = None;
    let started = Instant::now();
    let (after_crossing, delay) = loop {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        match r.status {
            StatusCode::OK => {
                admitted += 1;
                if admitted == 20 {
                    crossed = Some(Instant::now());
                }
            }
            StatusCode::TOO_MANY_REQUESTS if r.json()["error"] == "quota_exceeded" => {
                let at = crossed.expect("refused for the quota before reaching it");
                break (admitted - 20, at.elapsed());
            }
            other => panic!("{other}: {:?}", r.body),
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never refused for the quota"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    };
    let _ = meter.kill();
    let _ = meter.wait();
    gw.signal("TERM");
    wait_exit(&mut gw);
    eprintln!("quota crossed; refused {delay:?} later, after {after_crossing} more admissions");
    assert!(
        delay <= Duration::from_secs(13),
        "refused {delay:?} after the crossing request: the bound is 5 s + 5 s + 1 s, about 11 s"
    );
}
