//! Tests of `the replay crate`.

use super::*;
use crate::edge::EdgeConfig;
use crate::generate::{self, GenRow, PARTNER_IP, STORM_END_US, STORM_START_US};
use tollgate_limit::bucket::US_PER_S;

const fn hms(h: u64, m: u64, s: u64) -> u64 {
    (h * 3_600 + m * 60 + s) * US_PER_S
}

/// Every row's time, key and verdict, and the summary.
fn replay(
    s: Settings,
    rows: impl IntoIterator<Item = GenRow>,
) -> (Vec<(u64, &'static str, Verdict)>, Summary) {
    let mut r = Replay::new(s).unwrap();
    let out = rows
        .into_iter()
        .map(|row| {
            let req = Request {
                time_us: row.time_us,
                key: row.key,
                gateway: Some(row.gateway),
                ip: Some(PARTNER_IP.as_bytes()),
                ..Request::default()
            };
            (row.time_us, row.key, r.check(&req).unwrap())
        })
        .collect();
    (out, r.summary())
}

fn queue_storm() -> (Vec<(u64, &'static str, Verdict)>, Summary) {
    let mut s = Settings::single(Rate::parse("10/1s").unwrap(), None);
    s.algorithm = Algorithm::Queue;
    s.queue = Some(20);
    replay(s, generate::storm(20))
}

#[test]
fn the_queue_releases_1200_in_the_storm_none_waiting_over_2_s() {
    let (rows, summary) = queue_storm();
    let storm = STORM_START_US..STORM_END_US;
    // Released, by release time: one every 100 ms from 09:00:00.000 to 09:01:59.900.
    let released = rows
        .iter()
        .filter_map(|(t, _, v)| v.wait_us.map(|w| t + w))
        .filter(|r| storm.contains(r))
        .count();
    assert_eq!(released, 1_200);
    // Admitted by arrival: 21 in the first 50 ms, then the one arriving every 100 ms that
    // finds exactly 20 ahead of it, waiting 2 s.
    let waits: Vec<u64> = rows
        .iter()
        .filter(|(t, _, _)| storm.contains(t))
        .filter_map(|(_, _, v)| v.wait_us)
        .collect();
    assert_eq!(waits.len(), 1_220);
    assert_eq!(waits.iter().max(), Some(&2_000_000));
    assert_eq!(waits.iter().filter(|&&w| w == 2_000_000).count(), 1_199);
    // A refused request waits at most 100 ms for a place: Retry-After 1.
    assert!(
        rows.iter()
            .filter(|(_, _, v)| !v.admitted)
            .all(|(_, _, v)| v.retry_after == Some(1) && v.wait_us.is_none())
    );
    assert_eq!(summary.released, Some(summary.admitted));
    assert_eq!(summary.longest_wait_us, Some(2_000_000));
    assert_eq!(summary.keys["k-7"].longest_wait_us, Some(2_000_000));
}

#[test]
fn the_page_loads_last_call_waits_1_4_s() {
    let (rows, _) = queue_storm();
    let page = hms(8, 59, 30) + 100_000;
    let waits: Vec<Option<u64>> = rows
        .iter()
        .filter(|(t, _, _)| *t == page)
        .map(|(_, _, v)| v.wait_us)
        .collect();
    let expected: Vec<Option<u64>> = (0..15).map(|i| Some(i * 100_000)).collect();
    assert_eq!(waits, expected);
    // The normal traffic before it never waits.
    assert!(
        rows.iter()
            .filter(|(t, _, _)| *t < hms(8, 59, 30))
            .all(|(_, _, v)| v.wait_us == Some(0))
    );
}

fn edge(delay_s: u64, count_blocked: bool) -> (Vec<(u64, &'static str, Verdict)>, Summary) {
    let cfg = EdgeConfig {
        rule: Rate::parse("3000/60s").unwrap(),
        check_us: 10 * US_PER_S,
        delay_us: delay_s * US_PER_S,
        count_blocked,
    };
    let two_apps = generate::with_second_app(generate::storm(20), Rate::parse("20/1s").unwrap(), 20);
    replay(Settings::edge(cfg), two_apps)
}

#[test]
fn the_edge_rule_blocks_the_partners_address_40_s_into_the_flood_and_k8_with_it() {
    let (rows, summary) = edge(30, true);
    let e = summary.edge.as_ref().unwrap();
    let some = |s: &str| Some(s.to_string());
    assert_eq!(e.ip, some(PARTNER_IP));
    assert_eq!(e.first_over_check, some("09:00:10.000"));
    assert_eq!(e.block_start, some("09:00:40.000"));
    assert_eq!(e.first_under_check, some("09:03:00.000"));
    assert_eq!(e.block_end, some("09:03:30.000"));
    assert_eq!(e.flood_start, some("09:00:00.000"));
    // 40 s at 400 + 20 a second.
    assert_eq!(e.passed, Some(16_800));
    // k-8: 20 a second for 170 s. k-7: the storm's last 80 s, then its 300 normal
    // requests from 09:02:00 to 09:02:59.8, all before the lift.
    assert_eq!(e.blocked["k-8"], 3_400);
    assert_eq!(e.blocked["k-7"], 32_000 + 300);
    assert_eq!(e.blocked_total, 35_700);
    assert_eq!(e.passed_total, 48_615 + 7_200 - 35_700);
    assert_eq!(e.blocks.len(), 1);
    assert_eq!(summary.keys["k-8"].limited, 3_400);
    let blocked =
        |(t, _, v): &&(u64, &str, Verdict)| !v.admitted && (hms(9, 0, 40)..hms(9, 3, 30)).contains(t);
    assert_eq!(rows.iter().filter(blocked).count(), 35_700);
}

#[test]
fn a_longer_delay_lets_more_of_the_flood_through() {
    let (_, summary) = edge(50, true);
    let e = summary.edge.unwrap();
    assert_eq!(e.block_start.as_deref(), Some("09:01:00.000"));
    assert_eq!(e.passed, Some(25_200));
}

#[test]
fn uncounted_blocked_requests_end_the_block_at_09_02_10() {
    let (_, summary) = edge(30, false);
    let e = summary.edge.unwrap();
    assert_eq!(e.block_start.as_deref(), Some("09:00:40.000"));
    // Blocked from 09:00:40, nothing counts: the 09:01:40 check is the first under.
    assert_eq!(e.first_under_check.as_deref(), Some("09:01:40.000"));
    assert_eq!(e.block_end.as_deref(), Some("09:02:10.000"));
    assert_eq!(e.blocks.len(), 1);
}

#[test]
fn the_gateway_decides_k8_alike_with_or_without_k7s_storm() {
    let limit = || Settings::single(Rate::parse("600/60s").unwrap(), Some(20));
    let two_apps: Vec<GenRow> =
        generate::with_second_app(generate::storm(20), Rate::parse("20/1s").unwrap(), 20).collect();
    let (both, _) = replay(limit(), two_apps.iter().copied());
    let (alone, summary) = replay(limit(), two_apps.iter().copied().filter(|r| r.key == "k-8"));
    let k8: Vec<Verdict> = both.iter().filter(|r| r.1 == "k-8").map(|r| r.2).collect();
    assert_eq!(k8, alone.iter().map(|r| r.2).collect::<Vec<_>>());
    // 20 a second against 10: refused for its own excess only, from its burst's end on.
    assert_eq!(summary.keys["k-8"].limited, 3_581);
}
