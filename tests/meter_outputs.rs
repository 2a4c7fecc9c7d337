//! What `tollgate meter` gives out, run as a process against a real `redis-server` and against
//! the embedded store's metering file: flags near and over a quota, the CSV export, refusals of
//! bad input that name the flag and the reason, and the whole loop with real gateways that read
//! the flags. The world it runs in is `common::meter`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::RedisServer;
use common::meter::{AFTER_MIDNIGHT, World, id, two_gateways_across_midnight, usage};
use tollgate_meter::flags::{Flag, State};

fn flags_say_near_and_over(mut w: World) {
    let a = id("gw-a", "a1");
    // A flag left for a key whose quota is gone must not stay to block it.
    let stale = Flag {
        state: State::Over,
        quota: tollgate_rules::quota::Per::Day,
        period: "2025-11-30".into(),
        used: 1,
        limit: 1,
        resets_at_ms: i64::MAX,
        resets_at: "never".into(),
    };
    w.set_flag("k-plain", &stale);
    w.write(
        AFTER_MIDNIGHT,
        &[
            usage(&a, 1, "k-paris", 85),
            usage(&a, 2, "k-small", 12),
            usage(&a, 3, "k-plain", 1_000),
        ],
    );
    w.once(&[]);
    let near = w.flag("k-paris").expect("k-paris has a flag");
    assert_eq!(near.state, State::Near);
    assert_eq!((near.used, near.limit), (85, 100));
    assert_eq!(near.period, "2025-12-01");
    assert_eq!(near.resets_at, "2025-12-02T00:00:00+01:00");
    let over = w.flag("k-small").expect("k-small has a flag");
    assert_eq!((over.state, over.used, over.limit), (State::Over, 12, 10));
    assert!(over.blocks(AFTER_MIDNIGHT + 60_000));
    assert!(!over.blocks(over.resets_at_ms));
    assert_eq!(w.flag("k-plain"), None, "a key without a quota has no flag");
    // A quota key with no usage yet: its flag for the current period, under.
    let idle = w.flag("k-month").expect("k-month has a flag");
    assert_eq!((idle.state, idle.used), (State::Under, 0));
    // Under 80%, then across it: the flag follows the new total.
    w.write(AFTER_MIDNIGHT + 5_000, &[usage(&a, 4, "k-paris", 100)]);
    w.once(&[]);
    let now_over = w.flag("k-paris").unwrap();
    assert_eq!((now_over.state, now_over.used), (State::Over, 100));
}

#[test]
fn redis_flags_say_near_and_over() {
    flags_say_near_and_over(World::redis());
}

#[test]
fn file_flags_say_near_and_over() {
    flags_say_near_and_over(World::file());
}

fn export_writes_one_row_per_key_with_usage(mut w: World) {
    two_gateways_across_midnight(&mut w);
    let crashed = id("gw-crash", "c1");
    w.write(AFTER_MIDNIGHT + 3, &[usage(&crashed, 1, "k-plain", 2)]);
    // A key no longer in the rules still used what it used.
    w.write(AFTER_MIDNIGHT + 4, &[usage(&crashed, 2, "k-gone", 3)]);
    w.once(&[]);
    let csv = w.dir.path().join("2025-11.csv");
    let out = w.meter(&["export", "--month", "2025-11", "-o", csv.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("k-gone"));
    let text = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(
        text,
        "key,tenant,period,admitted,identities,unclean_ends\n\
         k-gone,,2025-11,3,1,1\n\
         k-paris,grocer,2025-11,37,2,0\n\
         k-plain,\"plain, inc\",2025-11,7,2,1\n"
    );
    let dec = w.dir.path().join("2025-12.csv");
    let out = w.meter(&["export", "--month", "2025-12", "-o", dec.to_str().unwrap()]);
    assert!(out.status.success());
    assert_eq!(
        std::fs::read_to_string(&dec).unwrap(),
        "key,tenant,period,admitted,identities,unclean_ends\nk-paris,grocer,2025-12,33,2,0\n"
    );
}

#[test]
fn redis_export_writes_the_csv() {
    export_writes_one_row_per_key_with_usage(World::redis());
}

#[test]
fn file_export_writes_the_csv() {
    export_writes_one_row_per_key_with_usage(World::file());
}

/// Bad input is refused with the flag, file or field and the reason; nothing defaults.
#[test]
fn bad_input_names_the_flag_and_the_reason() {
    let mut w = World::file();
    w.write(AFTER_MIDNIGHT, &[usage(&id("g", "b"), 1, "k-plain", 1)]);
    let err = |args: &[&str]| {
        let out = w.meter(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = err(&["usage", "--key", "k-nope"]);
    assert!(e.contains("--key") && e.contains("k-nope"), "{e}");
    let e = err(&["usage", "--key", "k-plain", "--day", "2025-02-30"]);
    assert!(e.contains("--day") && e.contains("YYYY-MM-DD"), "{e}");
    let e = err(&["export", "--month", "2025-13", "-o", "/tmp/never.csv"]);
    assert!(e.contains("--month"), "{e}");
    let e = err(&["--once", "--silence", "15"]);
    assert!(e.contains("--silence") && e.contains("unit"), "{e}");

    let missing = w.dir.path().join("missing.db");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "meter",
            "usage",
            "--meter-file",
            missing.to_str().unwrap(),
            "--rules",
        ])
        .arg(&w.rules)
        .args(["--key", "k-plain"])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--meter-file") && e.contains("no such file"),
        "{e}"
    );

    let bad_rules = w.dir.path().join("bad.json");
    std::fs::write(&bad_rules, "{").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["meter", "--once", "--meter-file"])
        .arg(w.dir.path().join("usage.db"))
        .arg("--rules")
        .arg(&bad_rules)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--rules") && e.contains("bad.json"),
        "{e}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args([
            "meter",
            "--once",
            "--store",
            "redis-cluster://127.0.0.1:1",
            "--rules",
        ])
        .arg(&w.rules)
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && e.contains("cannot connect to the Redis store at redis-cluster://127.0.0.1:1"),
        "{e}"
    );
}

/// The whole loop with real gateways: two `tollgate serve` processes on one Redis count what
/// they admit, the meter adds it up and flags k-7 over its daily quota, and a gateway started
/// afterwards reads the flag and refuses k-7.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_meter_and_flags_close_the_loop_on_redis() {
    use common::{Http, K7, Tollgate};
    use http::StatusCode;

    let redis = RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let (_rules_dir, rules) = common::rules_file(&common::demo_rules_with_k7_quota(upstream, 12));
    let (rules, url) = (rules.to_str().unwrap().to_string(), redis.url());
    let spawn = |name: &str| {
        Tollgate::spawn(&[
            "serve",
            "--rules",
            &rules,
            "--store",
            &url,
            "--store-timeout",
            "1s",
            "--instance",
            name,
            "--meter-interval",
            "100ms",
        ])
    };
    let (mut a, mut b) = (spawn("gw-a"), spawn("gw-b"));
    let http = Http::new();
    for (gw, n) in [(&a, 8), (&b, 4)] {
        for i in 0..n {
            let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
            assert_eq!(r.status, StatusCode::OK, "request {i}: {:?}", r.body);
        }
    }
    // A clean stop writes the last totals and an end record.
    for gw in [&mut a, &mut b] {
        gw.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while gw.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "gateway still runs after SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    let meter = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .arg("meter")
            .args(args)
            .args(["--store", &url, "--rules", &rules])
            .output()
            .unwrap()
    };
    let out = meter(&["--once"]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(!log.contains("unclean end"), "both stopped cleanly: {log}");
    let json = redis.cli(&["HGET", tollgate_meter::flags::FLAGS, "k-7"]);
    let flag: Flag = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json:?}"));
    assert_eq!((flag.state, flag.used, flag.limit), (State::Over, 12, 12));
    let out = meter(&["usage", "--key", "k-7", "--day", &flag.period]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let usage: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (usage["admitted"].as_u64(), usage["unclean_ends"].as_u64()),
        (Some(12), Some(0))
    );

    // A gateway reads the flags every second: polled, not slept for.
    let c = spawn("gw-c");
    let deadline = Instant::now() + Duration::from_secs(15);
    let refused = loop {
        let r = http.get(&c.url("/v1/orders"), &[("x-api-key", K7)]).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            break r;
        }
        assert_eq!(r.status, StatusCode::OK);
        assert!(Instant::now() < deadline, "the over flag was never enforced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.json()["error"], "quota_exceeded");
    assert_eq!(refused.json()["resets_at"], flag.resets_at.as_str());
}
