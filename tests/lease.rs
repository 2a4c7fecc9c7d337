//! Leased blocks for a key too hot for one shard, end to end against a real `redis-server`:
//! twenty lease clients holding a hot key (100,000 a second against 10,000) to its bound, a leased key answering 429
//! with Retry-After over HTTP, all-or-nothing with a non-leased bucket, every held token given
//! back on SIGTERM, and the rules that may not be leased.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Http, KBIG, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_gateway::app::{self, GatewayConfig, RulesSource};
use tollgate_gateway::config::StoreUrl;
use tollgate_limit::bucket::{BucketParams, BucketState, Rate};
use tollgate_limit::lease::give_back;
use tollgate_rules::{CompileOptions, LeaseBlock, compile};
use tollgate_testkit::lease_load::{self, BucketWatch, Load};

/// SHA-256 of `kbig-demo-key`, as in rules/demo.json.
const KBIG_SHA: &str = "3192d083bcbdda7385b5570eb52766ded7d5cbb554f1104918ddc5b2250cca03";

// ---- 20 lease clients, one Redis: a hot key for 10 s ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_lease_clients_hold_a_hot_key_to_its_bound_and_give_every_token_back() {
    let redis = RedisServer::start();
    let load = Load::hot_key(10.0);
    let watch = BucketWatch::start(redis.port);
    let run = lease_load::run(redis.port, &load).await;
    let n = load.clients as u64;
    let bound = (n * 12 * run.block).div_ceil(10);
    assert_eq!(run.block, 125, "auto block for 10,000/s over 20 gateways");
    assert_eq!(bound, 3_000);

    // The premise: the fleet really offered about 100,000 a second.
    let offered_per_s = run.offered as f64 * 1e6 / run.stop_us as f64;
    assert!(
        offered_per_s >= 90_000.0,
        "the clients offered only {offered_per_s:.0} a second (machine too busy?); the test needs 100,000"
    );
    let admitted = run.admitted_us.len() as u64;
    let per_admitted = run.calls_during_load as f64 / admitted as f64;
    let (steady, s_from, s_to) =
        run.worst_excess_from(run.first_refusal_us.expect("the key was never refused"));
    let (any, a_from, a_to) = run.worst_excess_from(0);
    let (beyond, c_from, c_to, c_at) = run.worst_beyond_central();
    let from_idle = run.worst_from_idle();
    eprintln!(
        "offered {} ({offered_per_s:.0}/s), admitted {admitted}, store calls {} ({per_admitted:.4} per admitted, {:.1}/s), \
         grants {}, denials {}, most in 1 s {}, first refusal at {} us, held at stop {}, longest client stall {} us\n\
         worst admitted − r·t: from the first refusal on {steady:.0} ({s_from}..{s_to} us), from any start {any:.0} \
         ({a_from}..{a_to} us), from idle {from_idle:.0}; worst beyond a central bucket (C(s) + r·t) {beyond:.0} \
         ({c_from}..{c_to} us, C(s) = {c_at}), clocks aligned within {} us, store clock ahead of ours by {} us more \
         after the load than before",
        run.offered,
        run.calls_during_load,
        run.calls_during_load as f64 * 1e6 / run.stop_us as f64,
        run.grants(),
        run.denials(),
        run.max_in_window(1_000_000),
        run.first_refusal_us.unwrap(),
        run.held_at_stop,
        run.longest_stall_us,
        run.align_us,
        run.drift_us,
    );

    // One store call per 50 admitted requests at most (worked out by hand: about 148 a
    // second for about 10,000 admitted).
    assert!(
        per_admitted <= 0.02,
        "{per_admitted} store calls per admitted request"
    );
    // The bound: leasing admits at most N × 1.2 × B beyond what one
    // central bucket would have admitted, which over [s, e] is C(s) + r·t with C(s) the
    // tokens in the shared bucket at s. While the load keeps the bucket drained C(s) is 0 and
    // this is admitted ≤ r·t + N × 1.2 × B. It is not 0 at t = 0: the key was idle, the bucket
    // holds its full burst of 20,000, and no interval starting there can stay under
    // r·t + 3,000 (from the idle start the bound is b + r·t, checked below). Nor is it 0 right
    // after the clients were descheduled for a while on a busy machine: the bucket refilled
    // meanwhile, and a central bucket would have admitted those tokens too. So every interval
    // starting while the load runs is checked against C(s) + r·t + N × 1.2 × B, C(s) taken
    // from the store's own answers. Slack: a client records an admission just after it made
    // it (at most one per client in flight), and our clock is aligned with the store's within
    // one probe round trip (r × that many tokens).
    // The bucket refills on the store's clock and t is ours: if the store's ran ahead during
    // the load (a wall clock stepped forward), the bucket gave r × that many tokens more than
    // our t accounts for.
    let ahead_us = run.drift_us.max(0) as u64 + run.align_us + run.align_after_us;
    let clock_slack = (run.rate_per_us() * ahead_us as f64).ceil();
    assert!(
        from_idle <= load.burst as f64 + clock_slack,
        "admitted − r·t from the idle start is {from_idle}, above the burst + {clock_slack} for the clocks"
    );
    let slack = n + (run.rate_per_us() * run.align_us as f64).ceil() as u64;
    assert!(
        beyond <= (bound + slack) as f64,
        "an interval starting at {c_from} us (bucket {c_at}), ending at {c_to} us, admitted {beyond:.0} beyond C(s) + r·t (bound {bound} + slack {slack})"
    );
    assert!(run.max_in_window(1_000_000) as u64 <= load.burst + 10_000 + bound);
    assert!(
        admitted as f64 >= 0.9 * (load.burst as f64 + 10_000.0 * run.stop_us as f64 / 1e6),
        "leasing admitted only {admitted}: far below what the bucket gives"
    );

    // Every held token goes back when its block expires: 10 s after it was granted, so by
    // 10 s after the load stopped, plus the last lease's round trip and the timer's tick.
    let back_at = run
        .wait_until_returned(Duration::from_secs(12))
        .await
        .unwrap_or_else(|| panic!("{} tokens still held 12 s after the load", run.held()));
    let after_stop_ms = (back_at - run.stop_us) as f64 / 1e3;
    eprintln!("every held token back {after_stop_ms:.0} ms after the load stopped");
    assert!(
        after_stop_ms <= 10_100.0,
        "the last tokens came back {after_stop_ms} ms after the load stopped"
    );
    // Every token leased was spent on an admitted request or given back to Redis. (A request
    // whose lease answer did not come within the wait was checked in Redis directly; those
    // admissions spent no leased token.)
    eprintln!(
        "{} requests checked in the store directly, {} of them admitted",
        run.checked_in_store(),
        run.admitted_by_store()
    );
    assert_eq!(run.failures(), 0, "lease or give-back calls failed");
    assert_eq!(
        run.tokens_granted(),
        admitted - run.admitted_by_store() + run.tokens_returned(),
        "granted tokens are not all accounted for"
    );
    assert!(run.tokens_returned() >= run.held_at_stop);
    // The bucket never held more than its burst (read every 20 ms through the whole run).
    let (max_units, samples) = watch.finish();
    assert!(samples > 100, "only {samples} reads of the bucket");
    assert!(
        max_units <= run.params.capacity,
        "the bucket held {max_units} units, above its capacity {}",
        run.params.capacity
    );
}

// ---- rules ----

fn rules(limits: &str, key_limits: &str) -> String {
    format!(
        r#"{{"version": 1, "upstreams": {{"orders": {{"url": "http://127.0.0.1:9"}}}},
            "limits": {limits},
            "keys": [{{"id": "k-big", "tenant": "kbig", "sha256": "{KBIG_SHA}", "limits": {key_limits}}}],
            "routes": [{{"method": "GET", "path": "/v1/", "upstream": "orders", "cost": {{"plan": 1}}}}]}}"#
    )
}

fn compile_err(text: &str) -> String {
    compile(text.as_bytes(), "rules.json", CompileOptions::default())
        .map(|_| ())
        .expect_err("these rules must be refused")
        .to_string()
}

#[test]
fn a_security_limit_with_a_lease_is_refused() {
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "key", "rate": "10000/1s", "burst": 20000, "class": "security", "lease": {"block": "auto"}}}"#,
        "{}",
    ));
    assert!(
        err.contains("limits.plan.lease") && err.contains("security limit is never leased"),
        "{err}"
    );
}

#[test]
fn a_limit_under_500_a_second_with_a_lease_is_refused() {
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "key", "rate": "100/1s", "burst": 200, "lease": {"block": "auto"}}}"#,
        "{}",
    ));
    assert!(
        err.contains("limits.plan.lease") && err.contains("100/1s is under 500/s"),
        "{err}"
    );
    // The same when a key sets the numbers of a leased limit.
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "key", "lease": {"block": 50}}}"#,
        r#"{"plan": {"rate": "6000/60s", "burst": 200}}"#,
    ));
    assert!(
        err.contains("keys[0].limits.plan.lease") && err.contains("6000/60s is under 500/s"),
        "{err}"
    );
}

#[test]
fn other_leases_that_cannot_work_are_refused_and_good_ones_compile() {
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "key", "rate": "10000/1s", "burst": 100, "lease": {"block": 125}}}"#,
        "{}",
    ));
    assert!(
        err.contains("limits.plan.lease.block") && err.contains("above the burst 100"),
        "{err}"
    );
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "ip", "rate": "10000/1s", "burst": 20000, "lease": {"block": "auto"}}}"#,
        "{}",
    ));
    assert!(err.contains("only key limits can be leased"), "{err}");
    let err = compile_err(&rules(
        r#"{"plan": {"dimension": "key", "rate": "10000/1s", "burst": 20000, "lease": {"block": "big"}}}"#,
        "{}",
    ));
    assert!(err.contains("neither \"auto\" nor a number"), "{err}");

    let snap = compile(
        rules(
            r#"{"plan": {"dimension": "key", "lease": {"block": "auto"}}}"#,
            r#"{"plan": {"rate": "10000/1s", "burst": 20000}}"#,
        )
        .as_bytes(),
        "rules.json",
        CompileOptions::default(),
    )
    .unwrap();
    assert_eq!(snap.limits[0].lease, Some(LeaseBlock::Auto));
    let snap = compile(
        rules(
            r#"{"plan": {"dimension": "key", "rate": "500/1s", "burst": 600, "lease": {"block": 600}}}"#,
            "{}",
        )
        .as_bytes(),
        "rules.json",
        CompileOptions::default(),
    )
    .unwrap();
    assert_eq!(snap.limits[0].lease, Some(LeaseBlock::Fixed(600)));
}

// ---- over HTTP ----

/// k-big at 500/s, burst 500, leased in blocks of 100, plus a non-leased export limit.
fn http_rules(upstream: SocketAddr) -> String {
    format!(
        r#"{{"version": 1, "upstreams": {{"orders": {{"url": "http://{upstream}"}}}},
            "limits": {{
              "plan": {{"dimension": "key", "lease": {{"block": 100}}}},
              "exports": {{"dimension": "route", "rate": "1/60s", "burst": 1}}
            }},
            "keys": [{{"id": "k-big", "tenant": "kbig", "sha256": "{KBIG_SHA}",
                      "limits": {{"plan": {{"rate": "500/1s", "burst": 500}}}}}}],
            "routes": [
              {{"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "orders", "cost": {{"plan": 1}}}},
              {{"name": "exports", "method": "POST", "path": "/v1/exports", "upstream": "orders", "cost": {{"plan": 10, "exports": 1}}}}
            ]}}"#
    )
}

/// An in-process gateway on the Redis store, one gateway in the fleet, and a store timeout
/// long enough that a cold key's first request always waits for its lease.
async fn gateway_on(redis: &RedisServer) -> (app::Running, tempfile::TempDir) {
    let upstream = common::start_demo_upstream().await;
    let (dir, path) = common::rules_file(&http_rules(upstream));
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.store = StoreUrl::Redis(redis.url());
    cfg.fleet_size = Some(1);
    cfg.store_timeout = Duration::from_millis(500);
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    (app::start(cfg).await.unwrap_or_else(|e| panic!("{e}")), dir)
}

async fn settle(running: &app::Running) {
    let leases = running.leases.as_ref().expect("a Redis gateway leases");
    let deadline = Instant::now() + Duration::from_secs(5);
    while leases.calls_in_flight() > 0 {
        assert!(Instant::now() < deadline, "lease calls never finished");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_key_is_limited_and_answers_429_with_retry_after_when_blocks_are_denied() {
    let redis = RedisServer::start();
    let (running, _dir) = gateway_on(&redis).await;
    let http = Http::new();
    let url = format!("http://{}/v1/orders", running.addr);
    let bearer = format!("Bearer {KBIG}");
    let auth = [("authorization", bearer.as_str())];

    let calls_before = lease_load::evalsha_calls(redis.port);
    let started = Instant::now();
    let mut admitted = 0u64;
    let refusal = loop {
        let a = http.get(&url, &auth).await;
        match a.status {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => break a,
            other => panic!("unexpected {other}: {:?}", a.body),
        }
        assert!(admitted < 20_000, "never refused after {admitted} requests");
    };
    let secs = started.elapsed().as_secs_f64();
    let calls = lease_load::evalsha_calls(redis.port) - calls_before;
    eprintln!("admitted {admitted} in {secs:.2} s with {calls} store calls before the first 429");

    // A 429 like any other: Retry-After (the denial's wait, at least 1 s), the RateLimit
    // fields of the deciding limit, and the JSON body.
    let retry: u64 = refusal
        .header("retry-after")
        .expect("Retry-After on a local refusal")
        .parse()
        .unwrap();
    assert_eq!(retry, 1, "one block cycle is 100 / 500 s = 0.2 s, plus jitter");
    assert_eq!(
        refusal.header("ratelimit-policy"),
        Some(r#""plan-burst";q=500;w=1, "plan";q=500;w=1"#)
    );
    let state = refusal.header("ratelimit").expect("RateLimit");
    assert!(state.starts_with(r#""plan-burst";r=0;t=1"#), "{state}");
    assert_eq!(refusal.json()["limit"], "plan");
    // The bucket's bound over the run (b + r·t, plus what one gateway may hold), reached,
    // with about one store call per block rather than one per request.
    assert!(admitted >= 500, "{admitted}");
    assert!(
        admitted as f64 <= 500.0 + 500.0 * secs + 120.0,
        "{admitted} in {secs} s"
    );
    assert!(
        calls * 20 <= admitted,
        "{calls} store calls for {admitted} admitted"
    );

    // While the denial stands, refusals are local: no store call.
    let before = lease_load::evalsha_calls(redis.port);
    let mut refused = 0;
    for _ in 0..10 {
        if http.get(&url, &auth).await.status == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        }
    }
    let during = lease_load::evalsha_calls(redis.port) - before;
    assert!(
        refused >= 5 && during <= 2,
        "{refused} refused with {during} store calls"
    );
    let metrics = running.metrics.render();
    assert!(metrics.contains("tollgate_lease_denials_total"), "{metrics}");
    assert!(running.metrics.lease_denials.get() >= 1);
    assert!(running.metrics.lease_grants.get() >= 5);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_by_a_store_bucket_gives_its_leased_tokens_back_to_the_block() {
    let redis = RedisServer::start();
    let (running, _dir) = gateway_on(&redis).await;
    let leases = running.leases.clone().unwrap();
    let http = Http::new();
    let auth = [("x-api-key", KBIG)];
    let orders = format!("http://{}/v1/orders", running.addr);
    let exports = format!("http://{}/v1/exports", running.addr);

    // The cold key's first request waits for its block (100) and spends 1.
    assert_eq!(http.get(&orders, &auth).await.status, StatusCode::OK);
    settle(&running).await;
    assert_eq!(leases.held_for("rl:{kbig}:plan"), 99);
    // An export costs 10 of the leased plan and 1 of the export bucket, which is in Redis.
    let first = http.send(Method::POST, &exports, &auth, b"").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(leases.held_for("rl:{kbig}:plan"), 89);
    // The export bucket refuses the second: the 10 reserved plan tokens go back to the block.
    let second = http.send(Method::POST, &exports, &auth, b"").await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(second.json()["limit"], "exports");
    assert_eq!(second.header("retry-after"), Some("60"));
    assert_eq!(leases.held_for("rl:{kbig}:plan"), 89);
    settle(&running).await;
    assert_eq!(running.metrics.lease_grants.get(), 1, "no other lease was needed");
    // Shutdown gives the 89 back.
    let metrics = running.metrics.clone();
    running.shutdown().await;
    assert_eq!(leases.held(), 0);
    assert_eq!(
        leases.calls_in_flight(),
        0,
        "shutdown returned with calls in flight"
    );
    assert_eq!(metrics.lease_tokens_returned.get(), 89);
}

// ---- graceful shutdown of a real process ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_every_unused_leased_token_back_to_redis() {
    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    // 500/s (the least that may be leased) and a burst of 1,000,000: the bucket refills slowly
    // next to what a block holds, so the give-back is plain in the stored state.
    let text = format!(
        r#"{{"version": 1, "upstreams": {{"bulk": {{"url": "http://{upstream}"}}}},
            "limits": {{"plan": {{"dimension": "key", "lease": {{"block": 100000}}}}}},
            "keys": [{{"id": "k-big", "tenant": "kbig", "sha256": "{KBIG_SHA}",
                      "limits": {{"plan": {{"rate": "500/1s", "burst": 1000000}}}}}}],
            "routes": [{{"name": "bulk", "method": "GET", "path": "/v1/bulk", "upstream": "bulk", "cost": {{"plan": 10000}}}}]}}"#
    );
    let (_dir, path) = common::rules_file(&text);
    let mut gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &redis.url(),
        "--fleet-size",
        "1",
        "--store-timeout",
        "500ms",
    ]);
    {
        let http = Http::new();
        for _ in 0..5 {
            let a = http.get(&gw.url("/v1/bulk"), &[("x-api-key", KBIG)]).await;
            assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
        }
        let m = http.get(&gw.admin_url("/metrics"), &[]).await;
        let m = String::from_utf8_lossy(&m.body).into_owned();
        assert!(m.contains("tollgate_lease_tokens_held 50000"), "{m}");
        assert!(m.contains("tollgate_lease_grants_total 1"), "{m}");
    }
    let p = BucketParams::new(Rate::parse("500/1s").unwrap(), 1_000_000).unwrap();
    let (tokens, ts, scale) = lease_load::stored_bucket(redis.port, lease_load::KEY).expect("the bucket");
    // One block of 100,000 out of a full bucket.
    assert_eq!(tokens, (1_000_000 - 100_000) * p.scale);
    let before = BucketState { tokens, ts, scale };

    gw.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the process did not exit: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit status {status:?}: {}", gw.stderr());
    assert!(
        gw.stderr().contains("leased tokens given back"),
        "{}",
        gw.stderr()
    );

    // After: exactly the bucket refilled to the give-back's time plus the 50,000 unused tokens.
    let (tokens, ts, scale) = lease_load::stored_bucket(redis.port, lease_load::KEY).expect("the bucket");
    assert!(ts > before.ts);
    assert_eq!(scale, p.scale);
    let mut expected = Some(before);
    give_back(&p, &mut expected, 50_000, ts);
    assert_eq!(tokens, expected.unwrap().tokens);
    assert!(
        tokens < p.capacity,
        "the give-back is visible, not hidden by a full bucket"
    );
    let refilled = tollgate_limit::bucket::refill(&p, Some(before), ts);
    assert_eq!(tokens - refilled, 50_000 * p.scale);
}
