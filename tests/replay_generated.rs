//! A generated trace replays under a rules file as the README shows: `replay --generate storm`
//! writes each request's method and path, so `replay storm.csv --rules rules/demo.json` finds
//! its route and decides every row.

mod common;

use common::cli::{ok, p, tollgate};

#[test]
fn a_generated_storm_replays_under_the_demo_rules() {
    let dir = tempfile::tempdir().unwrap();
    let storm = dir.path().join("storm.csv");
    let decisions = dir.path().join("decisions.csv");
    ok(&tollgate(&["replay", "--generate", "storm", "-o", p(&storm)]));
    let rules = common::repo().join("rules/demo.json");
    let out = ok(&tollgate(&[
        "replay",
        p(&storm),
        "--rules",
        p(&rules),
        "--json",
        "--decisions",
        p(&decisions),
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let requests = v["requests"].as_u64().unwrap();
    assert_eq!(requests, 48_615, "{v}");
    let admitted = v["keys"]["k-7"]["admitted"].as_u64().unwrap();
    // The demo's k-7 plan: 600 a minute, burst 20, over the storm's 240 s.
    assert!((20..=20 + 600 * 4 + 10).contains(&admitted), "{v}");
    let lines = std::fs::read_to_string(&decisions).unwrap();
    assert_eq!(lines.lines().count() as u64, requests + 1);
    let decided_admitted = lines.lines().skip(1).filter(|l| l.starts_with("1,")).count() as u64;
    assert_eq!(decided_admitted, admitted);
}
