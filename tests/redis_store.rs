//! `RedisStore` against a real `redis-server` started by each test on a free port: the race of
//! fifteen checks on five tokens, two gateway processes sharing one limit, key expiry and names,
//! NOSCRIPT recovery, start-up failures, and failed calls after start-up.

mod common;

use std::sync::Arc;

use common::{Http, K7, K8, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_limit::lease::Account;
use tollgate_rules::plan;
use tollgate_rules::{Fingerprint, Snapshot, hash_secret};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{Batch, CheckItem, FailurePolicy, Store, StoreError};

fn item(key: &str, rate: &str, burst: u64, cost: u64) -> CheckItem {
    let params = BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap();
    CheckItem::new(
        key.into(),
        Charge {
            params,
            cost,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    )
}

async fn connect(redis: &RedisServer) -> RedisStore {
    RedisStore::connect(Target::Node(&redis.url()), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A dashboard's burst after the storm: the bucket holds 5 tokens, 15 checks arrive at once over 15 connections, and
/// the atomic script lets exactly 5 through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifteen_connections_at_once_on_five_tokens_admit_exactly_five() {
    let redis = RedisServer::start();
    let mut stores = Vec::new();
    for _ in 0..15 {
        stores.push(Arc::new(connect(&redis).await));
    }
    let info = redis.cli(&["INFO", "clients"]);
    let connected: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no connected_clients in {info}"));
    assert!(
        connected >= 15,
        "15 stores should hold 15 connections, Redis counts {connected}"
    );

    // One token a minute, so nothing refills during the race; 20 - 15 leaves exactly 5.
    let key = "rl:{k7}:plan";
    let scale = BucketParams::new(Rate::parse("1/60s").unwrap(), 20)
        .unwrap()
        .scale;
    let o = stores[0].check(&[item(key, "1/60s", 20, 15)]).await.unwrap();
    assert!(o.admitted);
    assert_eq!(o.buckets[0].tokens, 5 * scale);

    let barrier = Arc::new(tokio::sync::Barrier::new(15));
    let mut tasks = Vec::new();
    for store in &stores {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.check(&[item(key, "1/60s", 20, 1)]).await.unwrap().admitted
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 5, "15 simultaneous checks on 5 tokens");
}

/// Two gateway processes on one Redis: 25 requests of k-7 alternating between them admit 20
/// (its burst), not 40.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateway_processes_enforce_one_limit() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    // k-7's burst of 20 as in the demo, at one token an hour: the store's clock can't be
    // stopped, and at the demo's 10/s a run slower than 100 ms would earn a 21st token.
    let demo = common::demo_rules_for(upstream);
    let rules = demo.replacen(
        r#""plan": { "rate": "600/60s", "burst": 20 }"#,
        r#""plan": { "rate": "1/1h", "burst": 20 }"#,
        1,
    );
    assert_ne!(rules, demo, "the demo's k-7 plan line moved; update this test");
    let (_dir, path) = common::rules_file(&rules);
    let path = path.to_str().unwrap();
    let url = redis.url();
    // A generous store timeout: the test is about one bucket shared, not about timeouts.
    let a = Tollgate::spawn(&["serve", "--rules", path, "--store", &url, "--store-timeout", "1s"]);
    let b = Tollgate::spawn(&["serve", "--rules", path, "--store", &url, "--store-timeout", "1s"]);
    let http = Http::new();
    for g in [&a, &b] {
        let ready = http.get(&g.admin_url("/readyz"), &[]).await;
        assert_eq!(ready.status, StatusCode::OK, "{:?}", ready.body);
        assert_eq!(ready.json()["store"], "redis");
    }
    let auth = format!("Bearer {K7}");
    let mut admitted = [0; 2];
    for i in 0..25 {
        let g = if i % 2 == 0 { &a } else { &b };
        let r = http
            .get(&g.url("/v1/orders"), &[("authorization", auth.as_str())])
            .await;
        match r.status {
            StatusCode::OK => admitted[i % 2] += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("request {i}: {other} {:?}", r.body),
        }
    }
    assert_eq!(
        admitted[0] + admitted[1],
        20,
        "admitted per gateway: {admitted:?}"
    );
    assert!(
        admitted[0] > 0 && admitted[1] > 0,
        "both gateways admitted some: {admitted:?}"
    );
}

/// The batch the gateway pays for one request, computed from the same snapshot.
fn expected_batch(
    snap: &Snapshot,
    method: &Method,
    path: &str,
    secret: Option<&str>,
    headers: &http::HeaderMap,
) -> Batch {
    let ip = "127.0.0.1".parse().unwrap();
    let route = &snap.routes[snap.route(method, path).expect("route")];
    let key = secret.map(|s| snap.key_by_hash(&hash_secret(s.as_bytes())).expect("known key"));
    if key.is_none() && route.key == tollgate_rules::KeyRequirement::Required {
        return plan::unauthenticated_only(snap, ip);
    }
    plan::build(snap, route, key, ip, Fingerprint::None, headers, None).expect("plan")
}

/// Every bucket the gateway writes has a TTL of at least b/r, its name carries the hash tag,
/// and no name carries the rules version: gateways on two versions share the same buckets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bucket_key_expires_and_names_no_version() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let demo = common::demo_rules_for(upstream);
    let requests: [(Method, &str, Option<&str>, Option<&str>); 5] = [
        (Method::GET, "/v1/orders", Some(K7), None),
        (Method::POST, "/v1/exports", Some(K8), None),
        (Method::GET, "/v1/orders", None, None),
        (Method::POST, "/login", None, Some("alice")),
        (Method::POST, "/login", Some(K7), Some("bob")),
    ];
    let http = Http::new();
    let mut key_sets = Vec::new();
    for version in ["7340291", "7340292"] {
        let rules = demo.replacen(r#""version": 1,"#, &format!(r#""version": {version},"#), 1);
        assert_ne!(rules, demo);
        let (running, _dir) = common::start_gateway_on(&rules, StoreUrl::Redis(redis.url())).await;
        let snap = running.rules.load_full();
        assert_eq!(snap.version.to_string(), version);
        let mut expected = std::collections::BTreeMap::new();
        for (method, path, secret, account) in &requests {
            let mut headers: Vec<(&str, String)> = Vec::new();
            let mut map = http::HeaderMap::new();
            if let Some(s) = secret {
                headers.push(("authorization", format!("Bearer {s}")));
            }
            if let Some(a) = account {
                headers.push(("x-account", a.to_string()));
                map.insert("x-account", a.parse().unwrap());
            }
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let url = format!("http://{}{path}", running.addr);
            let r = http.send(method.clone(), &url, &h, b"").await;
            assert_ne!(
                r.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{method} {path}: {:?}",
                r.body
            );
            for i in expected_batch(&snap, method, path, *secret, &map) {
                expected.insert(i.key.to_string(), i.charge.params);
            }
        }
        // Besides the buckets' pages, the store holds only the fleet's heartbeat set, which
        // expires too.
        let fleet = "tollgate:{fleet}:members";
        let pages: Vec<String> = redis
            .cli(&["--scan"])
            .lines()
            .filter(|k| *k != fleet)
            .map(String::from)
            .collect();
        if redis.cli(&["EXISTS", fleet]) == "1" {
            let pttl: i64 = redis.cli(&["PTTL", fleet]).parse().unwrap();
            assert!(pttl > 0, "the heartbeat set has no TTL");
        }
        let mut keys = std::collections::BTreeSet::new();
        for page in &pages {
            assert!(page.starts_with("rl:page:{"), "{page} is not a page");
            assert_eq!(redis.cli(&["TYPE", page]), "hash", "{page}");
            let pttl: i64 = redis.cli(&["PTTL", page]).parse().unwrap();
            assert!(pttl > 0, "{page} has no TTL (PTTL {pttl})");
            keys.extend(redis.cli(&["HKEYS", page]).lines().map(String::from));
        }
        assert_eq!(
            keys,
            expected.keys().cloned().collect(),
            "the store holds exactly the buckets the requests paid"
        );
        for (key, params) in &expected {
            let page = tollgate_store::page::page_of(key);
            assert!(pages.contains(&page), "{key} is not in its page {page}");
            assert_eq!(redis.bucket("HSTRLEN", key), "25", "{key}: one 25-byte value");
            // The field's own expiry, in the store's clock, is at least b/r away, and the
            // page lives at least as long: all read at one moment.
            const READ: &str = "local t = redis.call('TIME') \
                return {struct.unpack('<I7', redis.call('HGET', KEYS[1], ARGV[1]), 19), \
                tonumber(t[1]) * 1000000 + tonumber(t[2]), redis.call('PTTL', KEYS[1])}";
            let read = redis.cli(&["EVAL", READ, "1", &page, key]);
            let [expiry, now, pttl]: [u64; 3] = read
                .lines()
                .map(|l| l.parse().unwrap())
                .collect::<Vec<u64>>()
                .try_into()
                .unwrap_or_else(|_| panic!("{key}: {read}"));
            assert!(
                expiry >= now + params.fill_time_us(),
                "{key}: expires {} µs from now, under b/r = {} µs",
                expiry as i64 - now as i64,
                params.fill_time_us()
            );
            assert!(
                pttl * 1_000 + 1_000 >= expiry - now,
                "{key}: its page {page} dies {pttl} ms from now, before the field ({} µs)",
                expiry - now
            );
            assert!(
                key.starts_with("rl:{") && key.contains("}:"),
                "{key} has no hash tag"
            );
            assert!(!key.contains(version), "{key} names the rules version {version}");
        }
        key_sets.push(keys);
        running.shutdown().await;
    }
    assert_eq!(
        key_sets[0], key_sets[1],
        "a new rules version reuses the same buckets"
    );
    assert!(key_sets[0].contains("rl:{k7}:plan") && key_sets[0].contains("rl:{ip:127.0.0.1}:unauth"));
}

/// After SCRIPT FLUSH (as after a failover) the next check loads the script again and goes on
/// from the bucket's state.
#[tokio::test]
async fn a_flushed_script_is_loaded_again() {
    let redis = RedisServer::start();
    let store = connect(&redis).await;
    let b = [item("rl:{t}:flush", "1/60s", 3, 1)];
    let scale = b[0].charge.params.scale;
    let first = store.check(&b).await.unwrap();
    assert_eq!(first.buckets[0].tokens, 2 * scale);
    assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "0");
    let second = store
        .check(&b)
        .await
        .expect("the check after SCRIPT FLUSH succeeds");
    assert!(second.admitted);
    assert_eq!(second.buckets[0].tokens, scale + (second.now_us - first.now_us));
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.script_sha()]), "1");
}

/// A refund after SCRIPT FLUSH loads `lua/refund.lua` again and still gives the charge back; a
/// bucket holding something else refuses the whole refund and nothing is written.
#[tokio::test]
async fn a_refund_survives_a_flushed_script_and_is_all_or_nothing() {
    let redis = RedisServer::start();
    let store = connect(&redis).await;
    let b = [
        item("rl:{t}:refund-a", "1/60s", 3, 2),
        item("rl:{t}:refund-b", "1/60s", 3, 1),
    ];
    let scale = b[0].charge.params.scale;
    let o = store.check(&b).await.unwrap();
    assert!(o.admitted);
    assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.refund_script_sha()]), "0");
    let r = store
        .refund_batch(&b, &o)
        .await
        .expect("the refund after SCRIPT FLUSH succeeds")
        .expect("the check charged both buckets");
    assert_eq!(
        r.balances.as_slice(),
        &[Some(3 * scale as i64), Some(3 * scale as i64)]
    );
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.refund_script_sha()]), "1");

    let o = store.check(&b).await.unwrap();
    let before = redis.bucket("HGET", "rl:{t}:refund-a");
    assert_eq!(redis.bucket("HSTRLEN", "rl:{t}:refund-a"), "25");
    redis.bucket_with("HSET", "rl:{t}:refund-b", &["not a bucket"]);
    assert!(matches!(
        store.refund(&b, &o).await,
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(
        redis.bucket("HGET", "rl:{t}:refund-a"),
        before,
        "the good bucket was not refunded alone"
    );
}

fn demo_rules() -> String {
    common::demo_json()
}

/// No store at start-up: the gateway starts degraded under the failure policies, says so, and
/// takes its decisions from the store as soon as one listens there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_without_a_store_starts_degraded_and_recovers() {
    let port = common::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let upstream = common::start_demo_upstream().await;
    let (_dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let g = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &url,
        "--fleet-size",
        "1",
        "--store-timeout",
        "1s",
    ]);
    let http = Http::new();
    let ready = http.get(&g.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::OK, "{:?}", ready.body);
    assert_eq!(ready.json()["status"], "degraded");
    let stderr = g.stderr();
    assert!(
        stderr.contains(&url) && stderr.contains("starting degraded"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let auth = format!("Bearer {K7}");
    let r = http.get(&g.url("/v1/orders"), &[("authorization", &auth)]).await;
    assert_eq!(r.status, StatusCode::OK, "the local share admits: {:?}", r.body);

    let redis = RedisServer::start_on(port);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let r = http.get(&g.url("/v1/orders"), &[("authorization", &auth)]).await;
        assert_ne!(r.status, StatusCode::SERVICE_UNAVAILABLE);
        if redis.bucket("HEXISTS", "rl:{k7}:plan") == "1" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "decisions never moved to the store: {}",
            g.stderr()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let ready = http.get(&g.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.json()["status"], "ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_refuses_time_in_scripts_needs_the_gateway_clock() {
    // A store where scripts can't call TIME, as on some managed services.
    let redis = RedisServer::start_with(&["--rename-command", "TIME", ""]);
    let url = redis.url();
    let (ok, stderr) = common::serve_and_exit(&demo_rules(), &["--store", &url]);
    assert!(!ok, "tollgate started on a store whose scripts can't read TIME");
    assert!(stderr.contains(&url), "{stderr}");
    assert!(
        stderr.contains("TIME") && stderr.contains("--clock gateway"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    let upstream = common::start_demo_upstream().await;
    let (_dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let g = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &url,
        "--clock",
        "gateway",
        "--store-timeout",
        "1s",
    ]);
    let r = Http::new()
        .get(
            &g.url("/v1/orders"),
            &[("authorization", &format!("Bearer {K7}"))],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(redis.bucket("HEXISTS", "rl:{k7}:plan"), "1");
}

/// A store that goes away after start-up: checks fail as `StoreError`, and the gateway decides
/// by the failure policies and reports itself degraded; nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_call_is_a_store_error() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (running, _dir) =
        common::start_gateway_on(&common::demo_rules_for(upstream), StoreUrl::Redis(redis.url())).await;
    let store = connect(&redis).await;
    let http = Http::new();
    let admin = format!("http://{}/readyz", running.admin_addr.unwrap());
    let orders = format!("http://{}/v1/orders", running.addr);
    let auth = format!("Bearer {K7}");
    assert_eq!(http.get(&admin, &[]).await.status, StatusCode::OK);
    assert_eq!(
        http.get(&orders, &[("authorization", &auth)]).await.status,
        StatusCode::OK
    );

    drop(redis);
    let err = store
        .check(&[item("rl:{t}:gone", "1/1s", 1, 1)])
        .await
        .expect_err("a check against a stopped store");
    assert!(
        matches!(err, StoreError::Unavailable(_) | StoreError::Timeout),
        "{err:?}"
    );
    // The gateway still serves: the demo limits decide by their failure policy (local shares),
    // and readiness says degraded.
    let ready = http.get(&admin, &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["status"], "degraded");
    assert_eq!(ready.json()["store"], "redis");
    let r = http.get(&orders, &[("authorization", &auth)]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert!(
        running
            .metrics
            .render()
            .contains(r#"tollgate_store_bypass_total{limit="plan",policy="local"}"#)
    );
    running.shutdown().await;
}

/// A call whose requests and buckets `lua/check.lua` cannot make add up answers an error that
/// names the fault and changes nothing: a reference to no bucket before it, more buckets than
/// KEYS, values left over, a request short of its buckets. A reference to a bucket sent without flag 2 is read from its page.
#[test]
fn a_call_the_script_cannot_read_changes_nothing() {
    let redis = RedisServer::start();
    let script = tollgate_store::redis::SCRIPT;
    let page = tollgate_store::page::page_of("rl:{bad}:a");
    let eval = |keys: &[&str], argv: &[&str]| {
        let n = keys.len().to_string();
        let mut cmd = vec!["EVAL", script, &n];
        cmd.extend(keys);
        // The gateway's clock, so that no refill comes between calls.
        cmd.push("1000000");
        cmd.extend(argv);
        redis.cli(&cmd)
    };
    let one = ["rl:{bad}:a", page.as_str()];
    // scale, refill, capacity (10 tokens), need (1 token), ttl, flags, debt (no block: flag 8).
    let full = |flags: &'static str| ["1000", "1", "10000", "1000", "10000", flags, "0"];
    let call = |requests: &[&[&str]]| {
        let g = requests.len().to_string();
        let mut argv = vec![g.as_str()];
        for r in requests {
            argv.extend(*r);
        }
        eval(&one, &argv)
    };
    let first = |flags| {
        let mut r = vec!["1"];
        r.extend(full(flags));
        r
    };
    let (plain, keep) = (first("0"), first("2"));

    let out = eval(&[], &["1", "1", "-1", "1000"]);
    assert!(out.contains("names no bucket before it"), "{out}");
    let out = call(&[&plain, &plain]);
    assert!(out.contains("more buckets than KEYS holds"), "{out}");
    let out = call(&[&keep, &["1", "-1", "1000", "7"]]);
    assert!(out.contains("do not hold the same buckets"), "{out}");
    let out = call(&[&keep, &["2", "-1", "1000"]]);
    assert!(out.contains("a bucket is missing"), "{out}");
    let out = call(&[&plain, &["1", "-1", "1000"]]);
    assert!(out.contains("names no bucket before it with flag 2"), "{out}");
    let out = eval(&one, &["0"]);
    assert!(out.contains("a call of no requests names buckets"), "{out}");
    let mut twice = plain.clone();
    twice[0] = "2";
    twice.extend(["-1", "1000"]);
    let out = call(&[&twice]);
    assert!(out.contains("names no bucket before it with flag 2"), "{out}");
    let mut short = plain.clone();
    short.push("5");
    let out = call(&[&short]);
    assert!(out.contains("do not hold the same buckets"), "{out}");
    assert_eq!(redis.cli(&["HLEN", &page]), "0", "a refused call wrote");

    let answers = |out: &str| out.lines().skip(1).map(str::to_string).collect::<Vec<_>>();
    let out = call(&[&plain]);
    assert_eq!(answers(&out), ["1", "9000", "0"], "{out}");
    let out = call(&[&keep, &["1", "-1", "1000"], &["1", "-1", "2000"]]);
    assert_eq!(
        answers(&out),
        ["1", "8000", "0", "1", "7000", "0", "1", "5000", "0"],
        "{out}"
    );
    assert_eq!(redis.cli(&["HLEN", &page]), "1");
}

/// While the store is behind, queued checks share calls, each still checked on its own; a check
/// whose caller gave up while it waited is never sent, so it charges nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_queued_behind_a_busy_store_share_calls_and_abandoned_ones_charge_nothing() {
    let redis = RedisServer::start();
    let store = connect(&redis).await;
    let items: Vec<CheckItem> = (0..24)
        .map(|i| item(&format!("rl:{{q}}:b{i}"), "1/60s", 2, 1))
        .collect();
    let abandoned = item("rl:{q}:abandoned", "1/60s", 2, 1);
    let (calls0, checks0) = store.calls_and_checks();

    // Scripts that write wait while clients are paused for writes.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "60000", "WRITE"]), "OK");
    // One at a time, so each takes a call slot of its own, until every slot is taken.
    let mut first = Vec::new();
    for i in &items[..tollgate_store::redis::MAX_IN_FLIGHT] {
        first.push(Box::pin(store.check(std::slice::from_ref(i))));
        let last = first.len() - 1;
        common::queue_all(&mut first[last..]).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while store.calls_and_checks().0 - calls0 < first.len() as u64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue did not send check {}",
                first.len()
            );
            tokio::task::yield_now().await;
        }
    }
    let mut gone = [Box::pin(store.check(std::slice::from_ref(&abandoned)))];
    common::queue_all(&mut gone).await;
    drop(gone);
    let mut rest: Vec<_> = items[first.len()..]
        .iter()
        .map(|i| Box::pin(store.check(std::slice::from_ref(i))))
        .collect();
    common::queue_all(&mut rest).await;
    assert_eq!(redis.cli(&["CLIENT", "UNPAUSE"]), "OK");

    let scale = items[0].charge.params.scale;
    for f in first.into_iter().chain(rest) {
        let o = f.await.expect("a queued check succeeds");
        assert!(o.admitted);
        assert_eq!(
            o.buckets[0].tokens, scale,
            "each request charged its own bucket once"
        );
    }
    assert_eq!(
        redis.bucket("HEXISTS", "rl:{q}:abandoned"),
        "0",
        "an abandoned check was sent"
    );
    let (calls, checks) = store.calls_and_checks();
    assert_eq!(checks - checks0, 24);
    assert!(
        calls - calls0 < 24 / 2,
        "{} calls for 24 checks: queued checks should share calls",
        calls - calls0
    );
}

/// The scripts of the layout before pages (one 18-byte string per bucket, `SET ... PX`), kept
/// as they were in `tests/fixtures/lua_v1`: what a gateway of the previous release runs.
const OLD_CHECK: &str = concat!(
    include_str!("fixtures/lua_v1/bucket.lua"),
    include_str!("fixtures/lua_v1/check.lua")
);
const OLD_REFUND: &str = concat!(
    include_str!("fixtures/lua_v1/bucket.lua"),
    include_str!("fixtures/lua_v1/refund.lua")
);

/// A check of one bucket by the old script at the gateway's `now`: (admitted, tokens left).
fn old_check(redis: &RedisServer, key: &str, p: &BucketParams, cost: u64, now: u64) -> (String, u64) {
    let args = [
        p.scale,
        p.refill,
        p.capacity,
        p.units(cost),
        p.ttl_ms(),
        0,
        p.debt,
    ]
    .map(|n| n.to_string());
    let now_s = now.to_string();
    let mut cmd = vec!["EVAL", OLD_CHECK, "1", key, &now_s, "1", "1"];
    cmd.extend(args.iter().map(String::as_str));
    let out = redis.cli(&cmd);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "old check.lua answered {out}");
    (lines[1].to_string(), lines[2].parse().unwrap())
}

/// A debit of `units` by the old refund script at `now`: the balance after.
fn old_adjust(redis: &RedisServer, key: &str, p: &BucketParams, units: i64, now: u64) -> i64 {
    let args = [
        p.scale as i64,
        p.refill as i64,
        p.capacity as i64,
        units,
        p.ttl_ms() as i64,
        p.debt as i64,
    ]
    .map(|n| n.to_string());
    let now_s = now.to_string();
    let mut cmd = vec!["EVAL", OLD_REFUND, "1", key, &now_s];
    cmd.extend(args.iter().map(String::as_str));
    let out = redis.cli(&cmd);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "old refund.lua answered {out}");
    lines[1].parse().unwrap()
}

/// A rolling upgrade: buckets the previous release wrote (each its own 18-byte key) are read by
/// the check, lease and refund scripts with the very tokens they hold, debt included, and moved
/// into their pages on that first write, the old key deleted. Each is held to a twin bucket
/// that the current scripts wrote at the same moments.
#[tokio::test]
async fn buckets_of_the_old_layout_are_read_with_their_tokens_and_moved() {
    let redis = RedisServer::start();
    let t0 = 1_800_000_000_000_000u64;
    let clock = tollgate_limit::clock::ManualClock::new(t0);
    let store = RedisStore::connect(Target::Node(&redis.url()), Some(clock.clone()))
        .await
        .unwrap();
    let p = BucketParams::new(Rate::parse("10/1s").unwrap(), 10).unwrap();
    let paid = p.with_debt(20).unwrap();
    let one = |key: &str, p: BucketParams, cost: u64| {
        let mut i = item(key, "10/1s", 10, cost);
        i.charge.params = p;
        i
    };

    // t0: the previous release charges 7 tokens from three buckets and puts a fourth 15 tokens
    // in debt; the twins get the same from the current scripts.
    for name in ["check", "lease", "refund"] {
        let old = format!("rl:{{up}}:old-{name}");
        let (admitted, left) = old_check(&redis, &old, &p, 7, t0);
        let o = store
            .check(&[one(&format!("rl:{{up}}:new-{name}"), p, 7)])
            .await
            .unwrap();
        assert_eq!((admitted.as_str(), left), ("1", o.buckets[0].tokens));
        assert_eq!(redis.cli(&["STRLEN", &old]), "18", "{old} is in the old layout");
    }
    let debit = -(paid.units(25) as i64);
    let owed = old_adjust(&redis, "rl:{up}:old-debt", &paid, debit, t0);
    let twin = store
        .adjust_batch(&[one("rl:{up}:new-debt", paid, 1)], &[debit])
        .await
        .unwrap();
    assert_eq!(twin.balances[0], Some(owed));
    assert_eq!(owed, -(paid.units(15) as i64), "25 taken from 10: 15 owed");

    // 250 ms later the current scripts read each old bucket as its twin.
    clock.advance_us(250_000);
    let moved = |key: &str| {
        assert_eq!(
            redis.cli(&["EXISTS", key]),
            "0",
            "{key}: the old key is still there"
        );
        assert_eq!(redis.bucket("HSTRLEN", key), "25", "{key} is not in its page");
    };
    let check = |name: &str, p: BucketParams, cost: u64| {
        let batch = [one(name, p, cost)];
        let store = &store;
        async move { store.check(&batch).await.unwrap().buckets[0] }
    };
    let (old, new) = (
        check("rl:{up}:old-check", p, 2).await,
        check("rl:{up}:new-check", p, 2).await,
    );
    assert_eq!(old, new);
    assert_eq!(old.tokens, p.units(7) / 2, "3 left, 2.5 refilled, 2 taken");
    moved("rl:{up}:old-check");

    let acct = Account {
        holder: "g1",
        spent: 0,
    };
    let (old, new) = (
        store
            .lease("rl:{up}:old-lease", &p, 4, 1_000_000, acct)
            .await
            .unwrap(),
        store
            .lease("rl:{up}:new-lease", &p, 4, 1_000_000, acct)
            .await
            .unwrap(),
    );
    assert_eq!((old.grant, old.units_left), (new.grant, new.units_left));
    moved("rl:{up}:old-lease");

    let refund = |name: &str| {
        let batch = [one(name, p, 1)];
        let store = &store;
        async move {
            store
                .adjust_batch(&batch, &[p.units(1) as i64])
                .await
                .unwrap()
                .balances[0]
        }
    };
    let (old, new) = (
        refund("rl:{up}:old-refund").await,
        refund("rl:{up}:new-refund").await,
    );
    assert_eq!(old, new);
    assert_eq!(
        old,
        Some(p.units(13) as i64 / 2),
        "3 left, 2.5 refilled, 1 given back"
    );
    moved("rl:{up}:old-refund");

    // Still owing 12.5 tokens: nothing admitted, the same wait.
    let (old, new) = (
        check("rl:{up}:old-debt", paid, 1).await,
        check("rl:{up}:new-debt", paid, 1).await,
    );
    assert_eq!(old, new);
    assert_eq!((old.sufficient, old.tokens), (false, 0));
    assert_eq!(old.wait_us, Some(1_250_000 + 100_000), "the debt, then one token");
    moved("rl:{up}:old-debt");
}

/// A field past its expiry reads as a full bucket, even under a rule slow enough that refill
/// alone would not have filled it; a page's TTL is only ever raised; and a write that adds a
/// field deletes the fields of its page expired for over a minute, never a fresher one.
#[tokio::test]
async fn fields_expire_as_keys_did_and_are_swept_only_long_after() {
    let redis = RedisServer::start();
    let t0 = 1_800_000_000_000_000u64;
    let clock = tollgate_limit::clock::ManualClock::new(t0);
    let store = RedisStore::connect(Target::Node(&redis.url()), Some(clock.clone()))
        .await
        .unwrap();
    let check = |key: &str, rate: &str, burst: u64, cost: u64| {
        let batch = [item(key, rate, burst, cost)];
        let store = &store;
        async move { store.check(&batch).await.unwrap().buckets[0].tokens }
    };
    let fast = BucketParams::new(Rate::parse("10/1s").unwrap(), 10).unwrap();
    let slow = BucketParams::new(Rate::parse("1/10s").unwrap(), 10).unwrap();
    assert_eq!(fast.ttl_ms(), 2_000, "b/r plus a second");

    // Expiry: half spent at t0, read 2.5 s later (past its 2 s) under the slow rule.
    check("rl:{exp}:a", "10/1s", 10, 5).await;
    clock.advance_us(2_500_000);
    assert_eq!(
        check("rl:{exp}:a", "1/10s", 10, 1).await,
        slow.units(9),
        "an expired field is a full bucket"
    );
    // Not yet expired (the slow rule's TTL is 101 s): 9 tokens and 1.5 s of refill.
    clock.advance_us(1_500_000);
    assert_eq!(
        check("rl:{exp}:a", "1/10s", 10, 0).await,
        slow.units(9) + 1_500_000 * slow.refill,
        "a live field is read as it is"
    );

    // The page's TTL: a long bucket's, not lowered by a short one written after it.
    let page = tollgate_store::page::page_of("rl:{ttl}:long");
    check("rl:{ttl}:long", "1/60s", 100, 1).await;
    check("rl:{ttl}:short", "10/1s", 10, 1).await;
    let pttl: u64 = redis.cli(&["PTTL", &page]).parse().unwrap();
    assert!(pttl > 6_000_000 - 60_000, "the page's TTL went down to {pttl} ms");

    // Sweeping: each page holds one old field, then a write adds a second, so both are seen.
    let (stale, fresh) = ("rl:{sweep}:stale", "rl:{keep}:fresh");
    check(stale, "10/1s", 10, 1).await;
    check(fresh, "10/1s", 10, 1).await;
    for key in [stale, fresh] {
        let page = tollgate_store::page::page_of(key);
        assert_eq!(redis.cli(&["HLEN", &page]), "1", "{key} is alone in {page}");
    }
    // 61 s past the stale field's expiry: swept. Then, on a gateway clock 31 s behind, the
    // fresh one is 30 s past its expiry: kept, and read as full.
    clock.advance_us(2_000_000 + 61_000_000);
    check("rl:{sweep}:new", "10/1s", 10, 1).await;
    assert_eq!(
        redis.bucket("HEXISTS", stale),
        "0",
        "a long-expired field was kept"
    );
    clock.set_us(clock_now(&clock) - 31_000_000);
    check("rl:{keep}:new", "10/1s", 10, 1).await;
    assert_eq!(
        redis.bucket("HEXISTS", fresh),
        "1",
        "a field expired under a minute was swept"
    );
    assert_eq!(
        check(fresh, "10/1s", 10, 0).await,
        fast.units(10),
        "and reads as full"
    );
}

fn clock_now(clock: &tollgate_limit::clock::ManualClock) -> u64 {
    use tollgate_limit::clock::Clock;
    clock.now_us()
}
