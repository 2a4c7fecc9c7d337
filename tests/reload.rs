//! Live rules: reloads under load never fail a request, never roll back, and keep the running
//! rules on a bad file; rule changes clamp or refill the same buckets; shadow limits refuse
//! nothing and charge nothing else.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Http, K7, KBIG};
use http::StatusCode;
use serde_json::{Value, json};
use tollgate_gateway::app::Running;
use tollgate_gateway::reload::Reload;
use tollgate_limit::clock::ManualClock;

fn demo_value(upstream: std::net::SocketAddr) -> Value {
    serde_json::from_str(&common::demo_rules_for(upstream)).unwrap()
}

/// Replaces the file in one step, as editors and config tools do.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn counter(metrics: &str, name: &str, labels: &str) -> u64 {
    let needle = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&needle))
        .map(|v| v.trim().parse::<f64>().unwrap() as u64)
        .unwrap_or(0)
}

/// Waits for an event the watcher reports asynchronously (a file event, then a debounce).
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn reloads(gw: &Running, result: &str) -> u64 {
    counter(
        &gw.metrics.render(),
        "tollgate_rules_reloads_total",
        &format!("result=\"{result}\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_requests_across_fifty_rewrites() {
    let upstream = common::start_demo_upstream().await;
    let mut rules = demo_value(upstream);
    let clock = ManualClock::new(1_000_000);
    let (gw, dir) = common::start_gateway(&rules.to_string(), clock.clone()).await;
    let path = dir.path().join("rules.json");
    let url = format!("http://{}/v1/orders", gw.addr);

    let mut clients = vec![];
    for _ in 0..20 {
        let url = url.clone();
        clients.push(tokio::spawn(async move {
            let http = Http::new();
            let mut statuses = vec![];
            for _ in 0..500 {
                statuses.push(http.get(&url, &[("x-api-key", KBIG)]).await.status);
            }
            statuses
        }));
    }

    for v in 2..=51u64 {
        rules["version"] = json!(v);
        write_atomically(&path, &rules.to_string());
        if v == 30 {
            wait_for("version 30", || gw.rules.load().version == 30).await;
            let failed = reloads(&gw, "failed");
            std::fs::write(
                &path,
                r#"{"version": 31, "upstreams": {}, "routes": [], "surprise": 1}"#,
            )
            .unwrap();
            wait_for("the invalid file to be rejected", || {
                reloads(&gw, "failed") > failed
            })
            .await;
            assert_eq!(
                gw.rules.load().version,
                30,
                "a bad file must leave the running rules in place"
            );
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    wait_for("version 51", || gw.rules.load().version == 51).await;

    // A late copy with a lower version never rolls back.
    let ignored = reloads(&gw, "ignored");
    rules["version"] = json!(10);
    write_atomically(&path, &rules.to_string());
    wait_for("the old version to be ignored", || {
        reloads(&gw, "ignored") > ignored
    })
    .await;
    assert_eq!(gw.rules.load().version, 51);

    let mut total = 0;
    for c in clients {
        for s in c.await.unwrap() {
            total += 1;
            assert!(
                s == StatusCode::OK || s == StatusCode::TOO_MANY_REQUESTS,
                "a request failed with {s} during reloads"
            );
        }
    }
    assert_eq!(total, 10_000);
    assert!(reloads(&gw, "ok") >= 1);
    let admin = Http::new()
        .get(&format!("http://{}/admin/rules", gw.admin_addr.unwrap()), &[])
        .await;
    assert_eq!(admin.json()["version"], 51);
    assert!(admin.json()["digest"].as_str().unwrap().starts_with("sha256:"));
}

async fn orders(http: &Http, gw: &Running, key: &str) -> StatusCode {
    http.get(&format!("http://{}/v1/orders", gw.addr), &[("x-api-key", key)])
        .await
        .status
}

/// The demo rules with k-7's plan set, and without the exports route (its cost of 10 would not
/// fit a burst of 5).
fn with_k7_plan(mut rules: Value, version: u64, rate: &str, burst: u64) -> String {
    rules["version"] = json!(version);
    rules["routes"]
        .as_array_mut()
        .unwrap()
        .retain(|r| r["name"] != "exports");
    rules["keys"][0]["limits"]["plan"] = json!({"rate": rate, "burst": burst});
    rules.to_string()
}

fn reload_now(gw: &Running, path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    match gw.reloader.reload() {
        Reload::Swapped { .. } | Reload::Ignored { .. } => {}
        Reload::Failed(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn tightening_clamps_a_full_bucket_to_the_new_burst() {
    let upstream = common::start_demo_upstream().await;
    let base = demo_value(upstream);
    let clock = ManualClock::new(1_000_000);
    let (gw, dir) = common::start_gateway(&with_k7_plan(base.clone(), 1, "600/60s", 20), clock.clone()).await;
    let http = Http::new();
    // Touch the bucket so it exists, full but for one token; let it refill to full.
    assert_eq!(orders(&http, &gw, K7).await, StatusCode::OK);
    clock.advance_us(200_000);
    reload_now(
        &gw,
        &dir.path().join("rules.json"),
        &with_k7_plan(base, 2, "600/60s", 5),
    );
    assert_eq!(gw.rules.load().version, 2);
    let statuses: Vec<_> = futures_collect(&http, &gw, K7, 8).await;
    assert_eq!(
        statuses,
        [
            [StatusCode::OK; 5].as_slice(),
            [StatusCode::TOO_MANY_REQUESTS; 3].as_slice()
        ]
        .concat(),
        "a full bucket of 20 must be clamped to the new burst 5, never reset or kept at 20"
    );
}

#[tokio::test]
async fn loosening_refills_at_the_new_rate_from_where_the_bucket_was() {
    let upstream = common::start_demo_upstream().await;
    let base = demo_value(upstream);
    let clock = ManualClock::new(1_000_000);
    let (gw, dir) = common::start_gateway(&with_k7_plan(base.clone(), 1, "10/1s", 20), clock.clone()).await;
    let http = Http::new();
    let spent = futures_collect(&http, &gw, K7, 21).await;
    assert_eq!(spent.iter().filter(|s| **s == StatusCode::OK).count(), 20);
    // 100 ms at 10/s: one token, spent at once, so the bucket is empty at the reload.
    clock.advance_us(100_000);
    assert_eq!(orders(&http, &gw, K7).await, StatusCode::OK);
    reload_now(
        &gw,
        &dir.path().join("rules.json"),
        &with_k7_plan(base, 2, "20/1s", 20),
    );
    // 100 ms at 20/s: two tokens, not one (the old rate) and not twenty (a fresh burst).
    clock.advance_us(100_000);
    let statuses = futures_collect(&http, &gw, K7, 4).await;
    assert_eq!(
        statuses,
        [
            [StatusCode::OK; 2].as_slice(),
            [StatusCode::TOO_MANY_REQUESTS; 2].as_slice()
        ]
        .concat()
    );
}

async fn futures_collect(http: &Http, gw: &Running, key: &str, n: usize) -> Vec<StatusCode> {
    let mut out = vec![];
    for _ in 0..n {
        out.push(orders(http, gw, key).await);
    }
    out
}

/// Statuses and RateLimit headers of `n` orders by k-7.
async fn run_sequence(gw: &Running, n: usize) -> Vec<(StatusCode, String)> {
    let http = Http::new();
    let mut out = vec![];
    for _ in 0..n {
        let a = http
            .get(&format!("http://{}/v1/orders", gw.addr), &[("x-api-key", K7)])
            .await;
        out.push((a.status, a.header("ratelimit").unwrap_or("").to_string()));
    }
    out
}

#[tokio::test]
async fn shadow_limits_refuse_nothing_and_charge_nothing_else() {
    let upstream = common::start_demo_upstream().await;
    let plain = demo_value(upstream);
    let mut shadowed = plain.clone();
    shadowed["limits"]["tighter"] = json!({
        "dimension": "key", "rate": "60/60s", "burst": 5, "mode": "shadow"
    });
    for r in shadowed["routes"].as_array_mut().unwrap() {
        if r["name"] == "orders" {
            r["cost"]["tighter"] = json!(1);
        }
    }
    let (with_shadow, _d1) = common::start_gateway(&shadowed.to_string(), ManualClock::new(1_000_000)).await;
    let (without, _d2) = common::start_gateway(&plain.to_string(), ManualClock::new(1_000_000)).await;

    let a = run_sequence(&with_shadow, 25).await;
    let b = run_sequence(&without, 25).await;
    assert_eq!(
        a, b,
        "the shadow limit changed what the enforced plan decided or reported"
    );
    assert_eq!(a.iter().filter(|(s, _)| *s == StatusCode::OK).count(), 20);

    // The shadow bucket (burst 5) would have refused requests 6 to 25: 20 of them.
    let m = with_shadow.metrics.render();
    assert_eq!(
        counter(&m, "tollgate_shadow_would_refuse_total", r#"limit="tighter""#),
        20,
        "{m}"
    );
    assert_eq!(
        counter(
            &m,
            "tollgate_limit_decisions_total",
            r#"limit="plan",decision="admitted""#
        ),
        20
    );
    assert_eq!(
        counter(
            &m,
            "tollgate_limit_decisions_total",
            r#"limit="plan",decision="limited""#
        ),
        5
    );
    assert_eq!(
        counter(
            &m,
            "tollgate_limit_decisions_total",
            r#"limit="tighter",decision="limited""#
        ),
        0,
        "a shadow limit must never refuse"
    );
}

#[tokio::test]
async fn demo_with_a_rules_file_hot_reloads() {
    let (_d, path) = common::rules_file(&common::demo_json());
    let gw = common::Tollgate::spawn(&["demo", "--rules", path.to_str().unwrap()]);
    let http = Http::new();
    let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
    assert_eq!(v["version"], 1);
    let a = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
    assert_eq!(a.status, StatusCode::OK);
    let mut rules: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    rules["version"] = json!(2);
    rules["keys"][0]["limits"]["plan"] = json!({"rate": "600/60s", "burst": 12});
    write_atomically(&path, &rules.to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
        if v["version"] == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "demo did not reload: {}", gw.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
    assert_eq!(
        a.header("ratelimit-policy"),
        Some(r#""plan-burst";q=12;w=2, "plan";q=600;w=60"#)
    );
    // SIGHUP reloads too: a bad file is logged and the rules stay at version 2.
    std::fs::write(&path, "{ not json").unwrap();
    gw.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.stderr().contains("rules reload failed") {
        assert!(
            Instant::now() < deadline,
            "no reload error logged: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gw.stderr().contains(path.to_str().unwrap()), "{}", gw.stderr());
    let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
    assert_eq!(v["version"], 2);
}

/// The demo rules at `version`.
fn demo_at(version: u64) -> String {
    let mut rules: Value = serde_json::from_str(&common::demo_json()).unwrap();
    rules["version"] = json!(version);
    rules.to_string()
}

/// What the kubelet does to update a mounted ConfigMap: the new files in a new timestamped
/// directory, a `..data_tmp` symlink to it renamed over `..data` in one step, the old
/// directory removed.
fn configmap_update(dir: &Path, old: &str, new: &str, text: &str) {
    std::fs::create_dir(dir.join(new)).unwrap();
    std::fs::write(dir.join(new).join("rules.json"), text).unwrap();
    std::os::unix::fs::symlink(new, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join(old)).unwrap();
}

async fn wait_for_version(http: &Http, gw: &common::Tollgate, version: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
        if v["version"] == version {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still on version {} after 10 s, not {version}: {}",
            v["version"],
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn reloads_of(http: &Http, gw: &common::Tollgate, result: &str) -> u64 {
    let m = http.get(&gw.admin_url("/metrics"), &[]).await;
    counter(
        std::str::from_utf8(&m.body).unwrap(),
        "tollgate_rules_reloads_total",
        &format!("result=\"{result}\""),
    )
}

#[tokio::test]
async fn a_configmap_mount_reloads_on_a_swap_a_rename_and_a_write_in_place() {
    let mount = tempfile::tempdir().unwrap();
    let dir = mount.path();
    // The layout of a mounted ConfigMap, as the kubelet makes it.
    std::fs::create_dir(dir.join("..2026_12_01_v1")).unwrap();
    std::fs::write(dir.join("..2026_12_01_v1/rules.json"), demo_at(1)).unwrap();
    std::os::unix::fs::symlink("..2026_12_01_v1", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.json", dir.join("rules.json")).unwrap();
    let rules = dir.join("rules.json");
    let gw = common::Tollgate::spawn(&["demo", "--rules", rules.to_str().unwrap()]);
    let http = Http::new();
    wait_for_version(&http, &gw, 1, "at start").await;

    configmap_update(dir, "..2026_12_01_v1", "..2026_12_01_v2", &demo_at(2));
    wait_for_version(&http, &gw, 2, "the ConfigMap's ..data swap").await;

    // A bad file in the next swap is refused and the running rules stay.
    let failed = reloads_of(&http, &gw, "failed").await;
    configmap_update(
        dir,
        "..2026_12_01_v2",
        "..2026_12_01_v3",
        r#"{"version": 3, "upstreams": {}, "routes": [], "surprise": 1}"#,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads_of(&http, &gw, "failed").await == failed {
        assert!(
            Instant::now() < deadline,
            "the bad swap was not seen: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
    assert_eq!(
        v["version"], 2,
        "a bad file must leave the running rules in place"
    );
    assert!(gw.stderr().contains("surprise"), "{}", gw.stderr());

    // A write in place through the symlinks, into the directory `..data` now points at.
    std::fs::write(&rules, demo_at(4)).unwrap();
    wait_for_version(&http, &gw, 4, "a write in place through the symlinks").await;
    assert!(dir.join("..2026_12_01_v3/rules.json").is_file());

    // A rename over the path (editors, `mv`): the symlink becomes a plain file.
    write_atomically(&rules, &demo_at(5));
    wait_for_version(&http, &gw, 5, "a rename over the symlink").await;
    assert!(
        !std::fs::symlink_metadata(&rules)
            .unwrap()
            .file_type()
            .is_symlink()
    );

    // A write in place into that plain file.
    std::fs::write(&rules, demo_at(6)).unwrap();
    wait_for_version(&http, &gw, 6, "a write in place into the renamed file").await;

    // SIGHUP still reloads: the same version again is read and ignored.
    let ignored = reloads_of(&http, &gw, "ignored").await;
    gw.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads_of(&http, &gw, "ignored").await == ignored {
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not reload: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
    assert_eq!(a.status, StatusCode::OK);
}

/// A version past 2^53 would leave every later file "not above" it, ignored until a restart,
/// and past what JSON tools keep exact: the reload is refused and the running rules stay.
#[tokio::test]
async fn a_version_above_2_53_is_refused_and_the_running_rules_stay() {
    let (_d, path) = common::rules_file(&demo_at(1));
    let gw = common::Tollgate::spawn(&["demo", "--rules", path.to_str().unwrap()]);
    let http = Http::new();
    wait_for_version(&http, &gw, 1, "at start").await;

    let failed = reloads_of(&http, &gw, "failed").await;
    let mut rules: Value = serde_json::from_str(&demo_at(1)).unwrap();
    rules["version"] = json!(1u64 << 63);
    write_atomically(&path, &rules.to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads_of(&http, &gw, "failed").await == failed {
        assert!(
            Instant::now() < deadline,
            "the version 2^63 file was not refused: {}",
            http.get(&gw.admin_url("/admin/rules"), &[]).await.json()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let v = http.get(&gw.admin_url("/admin/rules"), &[]).await.json();
    assert_eq!(
        v["version"], 1,
        "a refused file must leave the running rules in place"
    );
    let log = gw.stderr();
    assert!(
        log.contains(
            "field=version reason=must be at most 2^53 (9007199254740992), the largest integer JSON tools keep exact"
        ),
        "{log}"
    );
    assert!(log.contains(path.to_str().unwrap()), "{log}");

    // 2^53 itself is taken, and still leaves room for nothing above: it is the ceiling.
    write_atomically(&path, &demo_at(2));
    wait_for_version(&http, &gw, 2, "the next file").await;
    write_atomically(&path, &demo_at(1 << 53));
    wait_for_version(&http, &gw, 1 << 53, "version 2^53").await;
}
