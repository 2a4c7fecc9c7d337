//! `RedisStore` against a real `redis-server` started by each test on a free port: the race of
//! fifteen checks on five tokens, two gateway processes sharing one limit, key expiry and names,
//! NOSCRIPT recovery, start-up failures, failed calls after start-up, and calls shared behind a
//! busy store. The buckets' layout in Redis is `redis_layout.rs`.

mod common;

use std::sync::Arc;

use common::store::{connect, item};
use common::{Http, K7, K8, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::bucket::{BucketParams, Rate};
use tollgate_rules::plan;
use tollgate_rules::{Fingerprint, Snapshot, hash_secret};
use tollgate_store::{Batch, CheckItem, Store, StoreError};

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
    let (ok, stderr) = common::processes::serve_and_exit(&demo_rules(), &["--store", &url]);
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
        common::store::queue_all(&mut first[last..]).await;
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
    common::store::queue_all(&mut gone).await;
    drop(gone);
    let mut rest: Vec<_> = items[first.len()..]
        .iter()
        .map(|i| Box::pin(store.check(std::slice::from_ref(i))))
        .collect();
    common::store::queue_all(&mut rest).await;
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
