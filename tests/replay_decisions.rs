//! `tollgate replay --decisions` row by row beside its generated trace: the queue releases one
//! request every 100 ms through the storm, and a WAF's rule per address blocks both apps behind
//! one NAT address 40 s into it.

use tollgate_limit::bucket::US_PER_S;

mod common;

use common::cli::{fails, ok, p, tollgate};
use common::replay::in_storm;

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
