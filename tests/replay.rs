//! `tollgate replay` reproduces the figures worked out by hand on its generated traces: the
//! storm under every algorithm and design, the queue included, two exports 1 ms apart under the
//! demo rules, the hot key under leased blocks, and a WAF's rule per address in front of two apps
//! behind one NAT address; and it refuses bad input with errors that name the row and column.

use tollgate_limit::bucket::{Rate, US_PER_S};
use tollgate_replay::algorithms::Verdict;
use tollgate_replay::generate::{self, GenRow, HOT_START_US, STORM_END_US, STORM_START_US};
use tollgate_replay::report::Summary;
use tollgate_replay::{Algorithm, Design, Replay, Request, Settings};

mod common;

use common::cli::{fails, ok, p, tollgate};

fn settings(rate: &str, burst: Option<u64>, algorithm: Algorithm, design: Design) -> Settings {
    let mut s = Settings::single(Rate::parse(rate).unwrap(), burst);
    s.algorithm = algorithm;
    s.design = design;
    s.gateways = 20;
    s
}

/// Replays generated rows through the library; returns (time, verdict) per row and the summary.
fn run(s: Settings, rows: impl IntoIterator<Item = GenRow>) -> (Vec<(u64, Verdict)>, Summary, Replay) {
    let mut replay = Replay::new(s).expect("valid settings");
    let mut out = Vec::new();
    for r in rows {
        let v = replay
            .check(&Request {
                time_us: r.time_us,
                key: r.key,
                gateway: Some(r.gateway),
                ..Request::default()
            })
            .expect("valid row");
        out.push((r.time_us, v));
    }
    let summary = replay.summary();
    (out, summary, replay)
}

fn in_storm(t: u64) -> bool {
    (STORM_START_US..STORM_END_US).contains(&t)
}

fn admitted_between(d: &[(u64, Verdict)], from: u64, to_excl: u64) -> usize {
    d.iter()
        .filter(|(t, v)| (from..to_excl).contains(t) && v.admitted)
        .count()
}

fn storm(algorithm: Algorithm, design: Design) -> (Vec<(u64, Verdict)>, Summary, Replay) {
    let burst = matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra).then_some(20);
    run(settings("600/60s", burst, algorithm, design), generate::storm(20))
}

#[test]
fn central_token_bucket_admits_1219_in_the_storm_and_refuses_the_rest_with_retry_after_1() {
    let (d, summary, _) = storm(Algorithm::TokenBucket, Design::Central);
    assert_eq!(d.len(), 48_615);
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 1_219);
    let refused: Vec<_> = d.iter().filter(|(t, v)| in_storm(*t) && !v.admitted).collect();
    assert_eq!(refused.len(), 46_781);
    assert!(refused.iter().all(|(_, v)| v.retry_after == Some(1)));
    let k7 = &summary.keys["k-7"];
    // b + r·t is 30 and 620; intervals don't include their end, so one fewer each.
    assert_eq!((k7.max_admitted_1s, k7.max_admitted_60s), (29, 619));
    // The first 29: the burst of 20 spent in 47.5 ms, then one token every 100 ms.
    assert_eq!(
        admitted_between(&d, STORM_START_US, STORM_START_US + US_PER_S),
        29
    );
    assert_eq!(summary.store_calls, 48_615);
    // The page load leaves the bucket exactly full at the 08:59:33.000 arrival,
    // and the normal traffic before the storm is never refused.
    assert!(
        d.iter()
            .filter(|(t, _)| *t < STORM_START_US)
            .all(|(_, v)| v.admitted)
    );
}

#[test]
fn page_load_refills_to_exactly_full_at_08_59_33() {
    // Stop the trace at 08:59:33.000 and look at the bucket through a 21st-token probe: 20
    // requests at that instant pass, the 21st does not.
    let cut = (8 * 3600 + 59 * 60 + 33) * US_PER_S;
    let mut rows: Vec<GenRow> = generate::storm(20)
        .into_iter()
        .filter(|r| r.time_us < cut)
        .collect();
    rows.extend((0..21).map(|i| GenRow {
        time_us: cut,
        key: "k-7",
        gateway: i % 20,
    }));
    let (d, _, _) = run(
        settings("600/60s", Some(20), Algorithm::TokenBucket, Design::Central),
        rows,
    );
    let at_cut: Vec<bool> = d
        .iter()
        .filter(|(t, _)| *t == cut)
        .map(|(_, v)| v.admitted)
        .collect();
    assert_eq!(at_cut.iter().filter(|a| **a).count(), 20);
    assert!(!at_cut[20]);
    // One microsecond earlier the bucket is not yet full.
    let mut early: Vec<GenRow> = generate::storm(20)
        .into_iter()
        .filter(|r| r.time_us < cut)
        .collect();
    early.extend((0..20).map(|i| GenRow {
        time_us: cut - 1,
        key: "k-7",
        gateway: i,
    }));
    let (d, _, _) = run(
        settings("600/60s", Some(20), Algorithm::TokenBucket, Design::Central),
        early,
    );
    assert_eq!(d.iter().filter(|(t, v)| *t == cut - 1 && v.admitted).count(), 19);
}

#[test]
fn local_buckets_admit_24380_in_the_storm() {
    let (d, summary, _) = storm(Algorithm::TokenBucket, Design::Local);
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 24_380);
    // Every gateway spends its burst in the same second.
    assert_eq!(summary.keys["k-7"].max_admitted_1s, 400);
    assert_eq!(summary.store_calls, 0);
}

#[test]
fn exact_shares_never_admit_too_much() {
    let (d, summary, _) = storm(Algorithm::TokenBucket, Design::Shares);
    // Each gateway sees k-7 every 50 ms and its share (0.5/s, burst 1) refills one token every
    // 2 s, exactly 40 of its arrivals: one admission per 2 s, 60 in the two minutes, 1,200 for
    // the fleet, inside the bound 20 × (1 + 0.5 × 120) = 1,220.
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 1_200);
    assert!(summary.keys["k-7"].max_admitted_60s <= 20 * (1 + 30));
    // A burst of 1 per gateway costs the page load: gateways that served a normal call less
    // than 2 s before refuse it.
    let page = (8 * 3600 + 59 * 60 + 30) * US_PER_S + 100_000;
    let page_refused = d.iter().filter(|(t, v)| *t == page && !v.admitted).count();
    assert!(page_refused > 0 && page_refused < 15, "{page_refused}");
}

#[test]
fn gateway_column_absent_means_round_robin_from_zero() {
    let rows = generate::storm(20);
    let (with, _, _) = run(
        settings("600/60s", Some(20), Algorithm::TokenBucket, Design::Local),
        rows.clone(),
    );
    let mut replay = Replay::new(settings(
        "600/60s",
        Some(20),
        Algorithm::TokenBucket,
        Design::Local,
    ))
    .unwrap();
    let without: Vec<(u64, Verdict)> = rows
        .iter()
        .map(|r| {
            let req = Request {
                time_us: r.time_us,
                key: r.key,
                ..Request::default()
            };
            (r.time_us, replay.check(&req).unwrap())
        })
        .collect();
    assert_eq!(with, without);
}

#[test]
fn fixed_window_spends_the_minute_in_one_and_a_half_seconds() {
    let (d, summary, _) = storm(Algorithm::FixedWindow, Design::Central);
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 1_200);
    // 600 by 09:00:01.4975, the last of them exactly then, and nothing until 09:01:00.
    let by = STORM_START_US + 1_497_500;
    assert_eq!(admitted_between(&d, STORM_START_US, by + 1), 600);
    assert!(d.iter().any(|(t, v)| *t == by && v.admitted));
    assert_eq!(admitted_between(&d, by + 1, STORM_START_US + 60 * US_PER_S), 0);
    assert_eq!(
        admitted_between(&d, STORM_START_US, STORM_START_US + US_PER_S),
        400
    );
    assert_eq!(summary.keys["k-7"].max_admitted_60s, 907);
}

#[test]
fn gcra_decides_every_row_exactly_as_the_token_bucket() {
    let (bucket, _, _) = storm(Algorithm::TokenBucket, Design::Central);
    let (gcra, _, _) = storm(Algorithm::Gcra, Design::Central);
    assert_eq!(bucket.len(), 48_615);
    let differ = bucket.iter().zip(&gcra).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "gcra and the token bucket differ on {differ} rows");
}

#[test]
fn sliding_log_holds_314_when_the_storm_begins_and_admits_290_in_its_first_second() {
    let mut replay = Replay::new(settings("600/60s", None, Algorithm::SlidingLog, Design::Central)).unwrap();
    let mut d = Vec::new();
    for r in generate::storm(20) {
        if r.time_us == STORM_START_US && d.last().is_some_and(|(t, _)| *t < STORM_START_US) {
            assert_eq!(replay.sliding_log_len("k-7", STORM_START_US), Some(314));
        }
        let req = Request {
            time_us: r.time_us,
            key: r.key,
            gateway: Some(r.gateway),
            ..Request::default()
        };
        d.push((r.time_us, replay.check(&req).unwrap()));
    }
    assert_eq!(
        admitted_between(&d, STORM_START_US, STORM_START_US + US_PER_S),
        290
    );
    assert_eq!(
        admitted_between(&d, STORM_START_US, STORM_START_US + 1_500_000),
        293
    );
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 1_200);
    assert_eq!(replay.summary().keys["k-7"].max_admitted_60s, 600);
}

#[test]
fn sliding_counter_admits_1198_in_the_storm() {
    let (d, _, _) = storm(Algorithm::SlidingCounter, Design::Central);
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_END_US), 1_198);
    let minute = 60 * US_PER_S;
    assert_eq!(admitted_between(&d, STORM_START_US, STORM_START_US + minute), 599);
    assert_eq!(admitted_between(&d, STORM_START_US + minute, STORM_END_US), 599);
    assert_eq!(
        admitted_between(&d, STORM_START_US, STORM_START_US + US_PER_S),
        290
    );
}

#[test]
fn leased_blocks_keep_the_hot_key_off_the_store_within_their_bound() {
    let mut s = settings("10000/1s", Some(20_000), Algorithm::TokenBucket, Design::Lease);
    // The burst of 20,000 is an excess over r·t by design; the lease's overshoot is
    // measured on intervals that start once it is spent (20,000 at 90,000 a second net).
    s.excess_from_us = Some(HOT_START_US + 250_000);
    for seed in [1, 2] {
        s.seed = seed;
        let (_, summary, replay) = run(s.clone(), generate::hot(20));
        let kbig = &summary.keys["k-big"];
        let fleet = replay.lease_fleet().unwrap();
        assert_eq!(fleet.config().block, 125);
        let per_s = summary.store_calls_per_s().unwrap();
        let per_admitted = summary.store_calls as f64 / summary.admitted as f64;
        let excess = kbig.worst_excess.unwrap();
        eprintln!(
            "seed {seed}: {} store calls ({per_s:.1}/s, {per_admitted:.4} per admitted), {} grants, admitted {}, max 1 s {}, worst excess {excess}, held at end {:?}",
            summary.store_calls,
            summary.lease_grants.unwrap(),
            summary.admitted,
            kbig.max_admitted_1s,
            kbig.held_at_end
        );
        assert!(per_admitted <= 0.02, "{per_admitted}");
        // Worked out by hand: about 148 calls a second, about 83 of them grants.
        assert!((130.0..170.0).contains(&per_s), "{per_s}");
        assert!(excess <= 3_000.0, "worst excess {excess} above N × 1.2 × B");
        // b + r·t over the minute, and over any second.
        assert!(summary.admitted <= 20_000 + 10_000 * 60);
        assert!(kbig.max_admitted_1s <= 30_000);
        // Leasing admits nearly everything the bucket can give.
        assert!(summary.admitted >= 615_000, "{}", summary.admitted);
        assert!(kbig.held_at_end.unwrap() <= 3_000);
    }
}

// ---- the binary, end to end ----

#[test]
fn the_binary_generates_the_storm_and_replays_it_to_json_and_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("storm.csv");
    let decisions = dir.path().join("decisions.csv");
    ok(&tollgate(&[
        "replay",
        "--generate",
        "storm",
        "--gateways",
        "20",
        "-o",
        p(&trace),
    ]));
    let text = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(text.lines().count(), 48_616);
    assert!(text.starts_with("time,key,gateway\n32340.000000,k-7,0\n"));
    let out = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--json",
        "--decisions",
        p(&decisions),
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["requests"], 48_615);
    assert_eq!(json["limited"], 46_781);
    assert_eq!(json["admitted"], 48_615 - 46_781);
    assert_eq!(json["store_calls"], 48_615);
    let k7 = &json["keys"]["k-7"];
    for field in [
        "requests",
        "admitted",
        "limited",
        "max_admitted_1s",
        "max_admitted_60s",
        "worst_excess",
    ] {
        assert!(!k7[field].is_null(), "keys.k-7.{field} missing in {out}");
    }
    assert_eq!(k7["max_admitted_1s"], 29);
    assert_eq!(k7["max_admitted_60s"], 619);
    // The burst is the worst excess over r·t: 20 at once, then exactly the rate.
    assert_eq!(k7["worst_excess"], 20.0);
    let d = std::fs::read_to_string(&decisions).unwrap();
    let mut lines = d.lines();
    assert_eq!(lines.next(), Some("admitted,retry_after"));
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 48_615);
    assert!(rows.iter().all(|r| *r == "1,0" || *r == "0,1"));
    // In trace order: the 21st storm request (row 315 + 21) is the first refused.
    assert_eq!(rows[315 + 19], "1,0");
    assert_eq!(rows[315 + 20], "0,1");
    // The human table names the key and the totals.
    let table = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
    ]));
    assert!(table.contains("k-7") && table.contains("46,781"), "{table}");
}

#[test]
fn replay_m_second_export_waits_5_s_and_leaves_the_plan_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("exports.csv");
    let decisions = dir.path().join("d.csv");
    // 09:03:00.100 and .101: two exports after the plan bucket is full; then eleven reads.
    let mut csv = String::from("time,key,method,path,ip\n");
    csv.push_str("32580.100000,k-7,POST,/v1/exports,203.0.113.9\n");
    csv.push_str("32580.101000,k-7,POST,/v1/exports,203.0.113.9\n");
    for _ in 0..11 {
        csv.push_str("32580.102000,k-7,GET,/v1/orders,203.0.113.9\n");
    }
    std::fs::write(&trace, csv).unwrap();
    let rules = common::repo().join("rules/demo.json");
    let out = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rules",
        p(&rules),
        "--json",
        "--decisions",
        p(&decisions),
    ]));
    let d = std::fs::read_to_string(&decisions).unwrap();
    let rows: Vec<&str> = d.lines().skip(1).collect();
    assert_eq!(rows[0], "1,0", "the first export passes");
    assert_eq!(
        rows[1], "0,5",
        "the second waits for the export bucket: (1 − 0.0002) / 0.2 s"
    );
    // The plan held 10.01 and was not charged: ten reads of 1 pass at .102, the eleventh
    // finds 0.02. Had the refused export been charged 10, the first read would fail.
    assert!(rows[2..12].iter().all(|r| *r == "1,0"), "{rows:?}");
    assert_eq!(rows[12], "0,1");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["keys"]["k-7"]["admitted"], 11);
    assert_eq!(json["store_calls"], 13);
    // The excess follows the plan in tokens: 10 for the export, then 10 reads.
    assert_eq!(json["keys"]["k-7"]["worst_excess"], 19.98);
}

#[test]
fn cost_after_replays_the_debits_of_post_paid_limits() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("completions.csv");
    let decisions = dir.path().join("d.csv");
    // k-8's tokens: 10,000 a minute, burst 10,000. A completion reporting nothing costs its
    // reserve, which comes back 6 ms later; then four of 3,000 leave the bucket 2,000 in debt.
    let mut csv = String::from("time,key,method,path,cost_after\n");
    csv.push_str("10.000000,k-8,POST,/v1/completions,\n");
    for _ in 0..5 {
        csv.push_str("10.006000,k-8,POST,/v1/completions,3000\n");
    }
    // 2,001 tokens at 6 ms each after the fourth: 12.006 s.
    csv.push_str("22.011999,k-8,POST,/v1/completions,1\n");
    csv.push_str("22.012000,k-8,POST,/v1/completions,1\n");
    std::fs::write(&trace, csv).unwrap();
    let rules = common::repo().join("rules/demo.json");
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rules",
        p(&rules),
        "--decisions",
        p(&decisions),
    ]));
    let d = std::fs::read_to_string(&decisions).unwrap();
    let rows: Vec<&str> = d.lines().skip(1).collect();
    assert_eq!(
        rows,
        ["1,0", "1,0", "1,0", "1,0", "1,0", "0,13", "0,1", "1,0"],
        "the fifth of 3,000 waits for the debt, repaid 12.006 s after the fourth"
    );

    // Without --rules nothing says which limit is post-paid.
    let plain = dir.path().join("plain.csv");
    std::fs::write(&plain, "time,key,cost_after\n1,k-8,5\n").unwrap();
    let err = fails(&tollgate(&[
        "replay",
        p(&plain),
        "--rate",
        "10/1s",
        "--burst",
        "20",
    ]));
    assert!(err.contains("the cost_after column needs --rules"), "{err}");
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "time,key,method,path,cost_after\n1,k-8,POST,/v1/completions,lots\n",
    )
    .unwrap();
    let err = fails(&tollgate(&["replay", p(&bad), "--rules", p(&rules)]));
    assert!(
        err.contains("line 2 (row 1), column cost_after") && err.contains("\"lots\" is not a whole number"),
        "{err}"
    );
}

#[test]
fn cost_above_the_burst_gets_an_empty_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.csv");
    let decisions = dir.path().join("d.csv");
    std::fs::write(&trace, "time,key,cost\n1,a,5\n1,a,25\n1,a,16\n").unwrap();
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "10/1s",
        "--burst",
        "20",
        "--decisions",
        p(&decisions),
    ]));
    assert_eq!(
        std::fs::read_to_string(&decisions).unwrap(),
        "admitted,retry_after\n1,0\n0,\n0,1\n"
    );
}

#[test]
fn bad_input_is_refused_naming_the_row_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let rate = ["--rate", "10/1s", "--burst", "20"];

    // Traces with one fault each, and what the error must say about it.
    let cases: [(&str, &str, &[&str]); 5] = [
        (
            "time.csv",
            "time,key\n1.5,k-7\n1.5x,k-7\n",
            &[
                "time.csv: line 3 (row 2), column time",
                "\"1.5x\" is not decimal seconds",
            ],
        ),
        (
            "dec.csv",
            "time,key\n1.1234567,k-7\n",
            &["column time", "at most 6 decimals"],
        ),
        (
            "nokey.csv",
            "time,gateway\n1,0\n",
            &["nokey.csv: header", "no \"key\" column"],
        ),
        (
            "order.csv",
            "time,key\n2,a\n1,a\n",
            &["line 3 (row 2), column time", "sort the trace"],
        ),
        (
            "gw.csv",
            "time,key,gateway\n1,a,20\n",
            &["column gateway", "--gateways 20"],
        ),
    ];
    for (name, text, expected) in cases {
        let trace = write(name, text);
        let err = fails(&tollgate(&[&["replay", p(&trace)][..], &rate].concat()));
        for e in expected {
            assert!(err.contains(e), "{name}: {err}");
        }
    }

    let rules = common::repo().join("rules/demo.json");
    let unknown = write(
        "unknown.csv",
        "time,key,method,path\n1,k-7,GET,/v1/orders\n2,k-99,GET,/v1/orders\n",
    );
    let err = fails(&tollgate(&["replay", p(&unknown), "--rules", p(&rules)]));
    assert!(
        err.contains("line 3 (row 2), column key")
            && err.contains("unknown key id \"k-99\"")
            && err.contains("k-7"),
        "{err}"
    );
    let secret = write(
        "secret.csv",
        "time,key,method,path\n1,k7-demo-key,GET,/v1/orders\n",
    );
    let err = fails(&tollgate(&["replay", p(&secret), "--rules", p(&rules)]));
    assert!(err.contains("unknown key id \"k7-demo-key\""), "{err}");

    let ok_trace = write("ok.csv", "time,key\n1,a\n");
    let err = fails(&tollgate(&[
        "replay",
        p(&ok_trace),
        "--rate",
        "10/1x",
        "--burst",
        "20",
    ]));
    assert!(
        err.contains("--rate") && err.contains("unknown unit \"x\""),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&ok_trace),
        "--rate",
        "0/1s",
        "--burst",
        "20",
    ]));
    assert!(err.contains("--rate") && err.contains("above zero"), "{err}");
    let err = fails(&tollgate(&["replay", p(&ok_trace), "--rate", "10/1s"]));
    assert!(err.contains("--burst") && err.contains("required"), "{err}");
    let err = fails(&tollgate(&[
        "replay",
        p(&ok_trace),
        "--rate",
        "10/1s",
        "--burst",
        "5",
        "--design",
        "lease",
        "--lease-block",
        "6",
    ]));
    assert!(
        err.contains("--lease-block") && err.contains("above the burst"),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&dir.path().join("missing.csv")),
        "--rate",
        "10/1s",
        "--burst",
        "1",
    ]));
    assert!(
        err.contains("cannot open the trace") && err.contains("missing.csv"),
        "{err}"
    );
}

/// A rules file with a fingerprint limit replays a trace whose rows carry the connection's
/// fingerprint as the access line has it: one bucket per fingerprint within the tenant. A
/// trace without the column is refused for such a route, naming it, and a bad value names the
/// row; the same trace without fingerprint limits needs no such column.
#[test]
fn fingerprint_column_replays_fingerprint_limits() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let text = common::demo_json();
    let mut r: serde_json::Value = serde_json::from_str(&text).unwrap();
    r["limits"]["clients"] = serde_json::json!({"dimension": "fingerprint", "rate": "3/1h", "burst": 3});
    let orders = r["routes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|x| x["name"] == "orders")
        .unwrap();
    orders["cost"]["clients"] = 1.into();
    let rules = write("rules.json", &r.to_string());

    let a = "0123456789abcdef";
    let mut csv = String::from("time,key,method,path,fingerprint\n");
    for i in 0..4 {
        csv.push_str(&format!("1.{i},k-7,GET,/v1/orders,{a}\n"));
    }
    csv.push_str("1.5,k-7,GET,/v1/orders,none\n");
    csv.push_str(&format!("1.6,k-8,GET,/v1/orders,{a}\n"));
    let trace = write("fp.csv", &csv);
    let decisions = dir.path().join("d.csv");
    ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rules",
        p(&rules),
        "--decisions",
        p(&decisions),
    ]));
    let d = std::fs::read_to_string(&decisions).unwrap();
    let admitted: Vec<&str> = d.lines().skip(1).map(|l| &l[..1]).collect();
    assert_eq!(
        admitted,
        ["1", "1", "1", "0", "1", "1"],
        "three for k-7's {a}, then another fingerprint, then another tenant"
    );

    let old = write("old.csv", "time,key,method,path\n1,k-7,GET,/v1/orders\n");
    let err = fails(&tollgate(&["replay", p(&old), "--rules", p(&rules)]));
    assert!(
        err.contains("column fingerprint") && err.contains("no fingerprint column"),
        "{err}"
    );
    let demo = common::repo().join("rules/demo.json");
    ok(&tollgate(&["replay", p(&old), "--rules", p(&demo)]));
    let bad = write(
        "bad.csv",
        "time,key,method,path,fingerprint\n1,k-7,GET,/v1/orders,0123456789ABCDEF\n",
    );
    let err = fails(&tollgate(&["replay", p(&bad), "--rules", p(&rules)]));
    assert!(
        err.contains("line 2 (row 1), column fingerprint") && err.contains("is not a client fingerprint"),
        "{err}"
    );
}

#[test]
fn several_designs_replay_in_one_pass_and_report_each() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("storm.csv");
    let decisions = dir.path().join("decisions.csv");
    ok(&tollgate(&["replay", "--generate", "storm", "-o", p(&trace)]));
    let limit = ["--rate", "600/60s", "--burst", "20"];
    let run = |extra: &[&str]| {
        let mut args = vec!["replay", p(&trace)];
        args.extend_from_slice(&limit);
        args.extend_from_slice(extra);
        tollgate(&args)
    };
    let out = ok(&run(&[
        "--design",
        "central,local,shares",
        "--json",
        "--decisions",
        p(&decisions),
    ]));
    // JSON: one object per design, in --design order, each what a one-design run prints.
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let all = json.as_array().expect("several designs print an array");
    let designs: Vec<&str> = all.iter().map(|s| s["design"].as_str().unwrap()).collect();
    assert_eq!(designs, ["central", "local", "shares"]);
    assert_eq!(all[0]["admitted"], 1_834);
    assert_eq!(all[1]["admitted"], 24_995);
    let alone: serde_json::Value =
        serde_json::from_str(&ok(&run(&["--design", "shares", "--json"]))).unwrap();
    assert!(alone.is_object(), "one design prints one object, as before");
    assert_eq!(all[2], alone);

    // Decisions: a pair of columns per design. The 21st storm request is central's first
    // refusal, while every local gateway still has its burst.
    let d = std::fs::read_to_string(&decisions).unwrap();
    let mut lines = d.lines();
    assert_eq!(
        lines.next(),
        Some(
            "central_admitted,central_retry_after,local_admitted,local_retry_after,shares_admitted,shares_retry_after"
        )
    );
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 48_615);
    assert!(rows[315 + 20].starts_with("0,1,1,0,"), "{}", rows[315 + 20]);

    // The table: one block per design.
    let table = ok(&run(&["--design", "central,local"]));
    assert!(
        table.contains("design central") && table.contains("design local"),
        "{table}"
    );
    assert!(table.contains("46,781") && table.contains("23,620"), "{table}");

    let e = fails(&run(&["--design", "central,local,central"]));
    assert!(
        e.contains("--design") && e.contains("central is listed twice"),
        "{e}"
    );
    let e = fails(&run(&["--design", "central,nowhere"]));
    assert!(e.contains("nowhere"), "{e}");
    // --lease-block still needs lease among the designs, and applies to it alone.
    let e = fails(&run(&["--design", "central,local", "--lease-block", "5"]));
    assert!(e.contains("--lease-block") && e.contains("--design lease"), "{e}");
    ok(&run(&["--design", "central,lease", "--lease-block", "5"]));
}

#[test]
fn a_second_app_joins_the_storm_behind_the_partners_address() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("two-apps.csv");
    ok(&tollgate(&[
        "replay",
        "--generate",
        "storm",
        "--second-app",
        "20/1s",
        "-o",
        p(&trace),
    ]));
    let text = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(text.lines().count(), 1 + 48_615 + 7_200);
    assert!(text.starts_with(
        "time,key,gateway,ip\n32340.000000,k-7,0,198.51.100.7\n32340.000000,k-8,1,198.51.100.7\n"
    ));
    assert_eq!(text.lines().filter(|l| l.contains(",k-8,")).count(), 7_200);
    assert!(text.ends_with("32699.950000,k-8,14,198.51.100.7\n"));
    let err = fails(&tollgate(&[
        "replay",
        "--generate",
        "hot",
        "--second-app",
        "20/1s",
    ]));
    assert!(
        err.contains("--second-app") && err.contains("--generate storm"),
        "{err}"
    );
}

/// The trace's rows (time in µs, key) beside the decisions CSV's fields, and its header.
fn beside(trace: &std::path::Path, decisions: &std::path::Path) -> (String, Vec<(u64, String, Vec<String>)>) {
    let t = std::fs::read_to_string(trace).unwrap();
    let d = std::fs::read_to_string(decisions).unwrap();
    let mut d = d.lines();
    let header = d.next().unwrap().to_string();
    let rows: Vec<_> = t
        .lines()
        .skip(1)
        .zip(d)
        .map(|(row, dec)| {
            let mut f = row.split(',');
            let (whole, frac) = f.next().unwrap().split_once('.').unwrap();
            let time = whole.parse::<u64>().unwrap() * US_PER_S + frac.parse::<u64>().unwrap();
            let key = f.next().unwrap().to_string();
            (time, key, dec.split(',').map(String::from).collect())
        })
        .collect();
    assert_eq!(rows.len(), t.lines().count() - 1, "a decision per trace row");
    (header, rows)
}

#[test]
fn the_queue_releases_one_request_every_100_ms_through_the_storm() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("storm.csv");
    let decisions = dir.path().join("waits.csv");
    ok(&tollgate(&["replay", "--generate", "storm", "-o", p(&trace)]));
    let queue = ["--algorithm", "queue", "--rate", "10/1s", "--queue", "20"];
    let run = |extra: &[&str]| tollgate(&[&["replay", p(&trace)][..], &queue, extra].concat());
    let out = ok(&run(&["--json", "--decisions", p(&decisions)]));
    let (header, rows) = beside(&trace, &decisions);
    assert_eq!(header, "admitted,retry_after,wait_us");
    assert_eq!(rows.len(), 48_615);
    let wait = |d: &[String]| (d[0] == "1").then(|| d[2].parse::<u64>().unwrap());
    // Released (by release time, not arrival) in the storm's two minutes: one every 100 ms.
    let released = rows
        .iter()
        .filter_map(|(t, _, d)| wait(d).map(|w| t + w))
        .filter(|r| in_storm(*r))
        .count();
    assert_eq!(released, 1_200);
    let storm_waits: Vec<u64> = rows
        .iter()
        .filter(|(t, _, _)| in_storm(*t))
        .filter_map(|(_, _, d)| wait(d))
        .collect();
    assert_eq!(storm_waits.iter().max(), Some(&2_000_000));
    assert_eq!(storm_waits.iter().filter(|&&w| w == 2_000_000).count(), 1_199);
    // The page load: 15 calls at 08:59:30.100, one released every 100 ms, the last after 1.4 s.
    let page = (8 * 3600 + 59 * 60 + 30) * US_PER_S + 100_000;
    let page: Vec<&[String]> = rows
        .iter()
        .filter(|(t, _, _)| *t == page)
        .map(|(_, _, d)| &d[..])
        .collect();
    assert_eq!(page.len(), 15);
    assert_eq!(page[14], ["1", "0", "1400000"]);
    // Refused: a place frees within 100 ms, and the wait column is empty.
    assert!(
        rows.iter()
            .filter(|(_, _, d)| d[0] == "0")
            .all(|(_, _, d)| d[1..] == ["1", ""])
    );
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["algorithm"], "queue");
    assert_eq!(json["admitted"], 1_835);
    assert_eq!(json["released"], 1_835);
    assert_eq!(json["longest_wait_us"], 2_000_000);
    assert_eq!(json["keys"]["k-7"]["longest_wait_us"], 2_000_000);
    let table = ok(&run(&[]));
    assert!(
        table.contains("released 1,835  longest wait 2.000000 s"),
        "{table}"
    );

    // Several designs: the wait column follows each design's pair.
    ok(&run(&["--design", "central,local", "--decisions", p(&decisions)]));
    let d = std::fs::read_to_string(&decisions).unwrap();
    assert_eq!(
        d.lines().next(),
        Some(
            "central_admitted,central_retry_after,central_wait_us,local_admitted,local_retry_after,local_wait_us"
        )
    );

    let bare = ["replay", p(&trace), "--rate", "10/1s"];
    let e = fails(&tollgate(&[&bare[..], &["--algorithm", "queue"]].concat()));
    assert!(e.contains("--queue"), "{e}");
    let e = fails(&tollgate(
        &[&bare[..], &["--burst", "20", "--queue", "20"]].concat(),
    ));
    assert!(
        e.contains("--queue") && e.contains("only means something with --algorithm queue"),
        "{e}"
    );
    let e = fails(&run(&["--burst", "20"]));
    assert!(
        e.contains("--burst") && e.contains("the queue has no burst"),
        "{e}"
    );
}

#[test]
fn a_waf_rule_per_address_blocks_both_apps_behind_it_40_s_into_the_storm() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("two-apps.csv");
    let decisions = dir.path().join("d.csv");
    ok(&tollgate(&[
        "replay",
        "--generate",
        "storm",
        "--second-app",
        "20/1s",
        "-o",
        p(&trace),
    ]));
    let rule = [
        "--design",
        "edge",
        "--edge-rule",
        "3000/60s",
        "--edge-check",
        "10s",
    ];
    let edge = |extra: &[&str]| {
        let out = ok(&tollgate(
            &[&["replay", p(&trace)][..], &rule, extra, &["--json"]].concat(),
        ));
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        json["edge"].clone()
    };
    let e = edge(&[
        "--edge-delay",
        "30s",
        "--edge-count-blocked",
        "true",
        "--decisions",
        p(&decisions),
    ]);
    assert_eq!(e["ip"], "198.51.100.7");
    assert_eq!(e["first_over_check"], "09:00:10.000");
    assert_eq!(e["block_start"], "09:00:40.000");
    assert_eq!(e["first_under_check"], "09:03:00.000");
    assert_eq!(e["block_end"], "09:03:30.000");
    assert_eq!(e["flood_start"], "09:00:00.000");
    // 40 s of 400 + 20 a second passed before the block.
    assert_eq!(e["passed"], 16_800);
    // k-8's honest 20 a second for 170 s; k-7's storm from 09:00:40 (32,000) and all 300 of
    // its normal requests from 09:02:00 to 09:02:59.8.
    assert_eq!(e["blocked"], serde_json::json!({"k-7": 32_300, "k-8": 3_400}));
    assert_eq!(e["blocked_total"], 35_700);
    assert_eq!(e["passed_total"], 48_615 + 7_200 - 35_700);
    assert_eq!(e["blocks"].as_array().unwrap().len(), 1);
    assert_eq!(e["blocks"][0]["block_end"], "09:03:30.000");
    // The defaults are AWS WAF's: a 30 s delay, blocked requests counted.
    assert_eq!(edge(&[]), e);

    // Blocked rows say how long until the block lifts.
    let (header, rows) = beside(&trace, &decisions);
    assert_eq!(header, "admitted,retry_after");
    let (start, end) = ((9 * 3600 + 40) * US_PER_S, (9 * 3600 + 210) * US_PER_S);
    let blocked: Vec<_> = rows.iter().filter(|(_, _, d)| d[0] == "0").collect();
    assert_eq!(blocked.len(), 35_700);
    assert!(
        blocked
            .iter()
            .all(|(t, _, d)| (start..end).contains(t) && d[1] == (end - t).div_ceil(US_PER_S).to_string())
    );
    assert_eq!(blocked[0].2, ["0", "170"]);
    assert_eq!(blocked.last().unwrap().2, ["0", "1"]);

    let e = edge(&["--edge-delay", "50s"]);
    assert_eq!(e["block_start"], "09:01:00.000");
    assert_eq!(e["passed"], 25_200);
    let e = edge(&["--edge-delay", "30s", "--edge-count-blocked", "false"]);
    assert_eq!(e["block_start"], "09:00:40.000");
    assert_eq!(e["block_end"], "09:02:10.000");

    // Beside the gateway's per-key bucket: k-7 held to its limit as without k-8, and k-8
    // refused only for its own excess over 10 a second.
    let out = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--design",
        "edge,central",
        "--edge-rule",
        "3000/60s",
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--json",
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json[0]["edge"]["blocked"]["k-8"], 3_400);
    let central = &json[1]["keys"];
    assert_eq!(
        (
            central["k-7"]["admitted"].clone(),
            central["k-7"]["limited"].clone()
        ),
        (1_834.into(), 46_781.into())
    );
    assert_eq!(
        (
            central["k-8"]["admitted"].clone(),
            central["k-8"]["limited"].clone()
        ),
        (3_619.into(), 3_581.into())
    );
    let out = ok(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "1200/60s",
        "--burst",
        "20",
        "--json",
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json["keys"]["k-8"]["limited"], 0);

    // Mistakes, named.
    let plain = dir.path().join("storm.csv");
    ok(&tollgate(&["replay", "--generate", "storm", "-o", p(&plain)]));
    let err = fails(&tollgate(&[
        "replay",
        p(&plain),
        "--design",
        "edge",
        "--edge-rule",
        "3000/60s",
    ]));
    assert!(
        err.contains("storm.csv: header") && err.contains("needs an \"ip\" column"),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&trace),
        "--rate",
        "600/60s",
        "--burst",
        "20",
        "--edge-rule",
        "3000/60s",
    ]));
    assert!(
        err.contains("--edge-rule") && err.contains("only means something with --design edge"),
        "{err}"
    );
    let err = fails(&tollgate(&["replay", p(&trace), "--design", "edge"]));
    assert!(
        err.contains("--edge-rule") && err.contains("required with --design edge"),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&trace),
        "--design",
        "edge",
        "--edge-rule",
        "3000/60s",
        "--rate",
        "600/60s",
    ]));
    assert!(
        err.contains("--rate") && err.contains("--design edge,central"),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&trace),
        "--design",
        "edge",
        "--edge-rule",
        "3000/60s",
        "--edge-delay",
        "0",
    ]));
    assert!(
        err.contains("--edge-delay") && err.contains("above zero"),
        "{err}"
    );
}
