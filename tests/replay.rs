//! `tollgate replay`, the binary end to end: it generates the storm and replays it to JSON and
//! decisions, replays two exports 1 ms apart under the demo rules, the debits of post-paid
//! limits, fingerprint limits, several designs in one pass and a second app behind the partner's
//! address; and it refuses bad input with errors that name the row and column.

mod common;

use common::cli::{fails, ok, p, tollgate};

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
    assert!(text.starts_with("time,key,gateway,method,path\n32340.000000,k-7,0,GET,/v1/orders\n"));
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
        "time,key,gateway,method,path,ip\n32340.000000,k-7,0,GET,/v1/orders,198.51.100.7\n32340.000000,k-8,1,GET,/v1/orders,198.51.100.7\n"
    ));
    assert_eq!(text.lines().filter(|l| l.contains(",k-8,")).count(), 7_200);
    assert!(text.ends_with("32699.950000,k-8,14,GET,/v1/orders,198.51.100.7\n"));
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
