//! `tollgate meter`, run as a process against a real `redis-server` (and against the embedded
//! store's metering file), with this test playing the gateways: it writes usage records into
//! the stream (`XADD tollgate:usage <ms>-<n> …`, so the test sets each record's time) or into
//! `usage_records`. Every flow runs on both places and must give the same answers: totals per
//! key, day and month in the key's own zone across midnight; records replayed, read twice or
//! read by two consumers at once counting once; unclean ends reported once; malformed entries
//! named and passed over. Flags and the CSV are `meter_outputs.rs`; the world is `common::meter`.

mod common;

use std::process::Stdio;

use common::meter::{
    AFTER_MIDNIGHT, Place, World, end, id, meter_command, run_until, run_until_metrics, sample,
    two_gateways_across_midnight, usage,
};
use tollgate_meter::record::{Identity, Record};

fn totals_add_up_per_key_day_and_month_in_the_keys_zone(mut w: World) {
    two_gateways_across_midnight(&mut w);
    w.once(&[]);
    // Paris: 30 + 7 before midnight, (50 - 30) + (20 - 7) after, in a new month too.
    assert_eq!(w.admitted("k-paris", &["--day", "2025-11-30"]), (37, 0));
    assert_eq!(w.admitted("k-paris", &["--day", "2025-12-01"]), (33, 0));
    assert_eq!(w.admitted("k-paris", &["--month", "2025-11"]), (37, 0));
    assert_eq!(w.admitted("k-paris", &["--month", "2025-12"]), (33, 0));
    // k-plain has no quota: UTC, where 23:30 is still 30 November.
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]), (5, 0));
    assert_eq!(w.admitted("k-plain", &["--day", "2025-12-01"]), (0, 0));
    let v = w.usage("k-paris", &["--day", "2025-12-01"]);
    assert_eq!(
        v,
        serde_json::json!({"key": "k-paris", "period": "2025-12-01", "admitted": 33, "unclean_ends": 0})
    );
    // Without a period: today in the key's zone, where nothing was admitted.
    let today = w.usage("k-paris", &[]);
    assert_eq!(today["admitted"], 0);
    assert_eq!(today["period"].as_str().unwrap().len(), "2025-12-01".len());
}

#[test]
fn redis_totals_add_up_per_key_day_and_month_in_the_keys_zone() {
    totals_add_up_per_key_day_and_month_in_the_keys_zone(World::redis());
}

#[test]
fn file_totals_add_up_per_key_day_and_month_in_the_keys_zone() {
    totals_add_up_per_key_day_and_month_in_the_keys_zone(World::file());
}

fn replayed_and_reread_records_change_nothing(mut w: World) {
    two_gateways_across_midnight(&mut w);
    w.once(&[]);
    let before = (
        w.admitted("k-paris", &["--day", "2025-11-30"]),
        w.admitted("k-paris", &["--day", "2025-12-01"]),
        w.admitted("k-plain", &["--month", "2025-11"]),
    );
    // Records delivered again, later: the same totals, and an older one.
    let (a, b) = (id("gw-a", "a1"), id("gw-b", "b1"));
    w.write(
        AFTER_MIDNIGHT + 10_000,
        &[
            usage(&a, 2, "k-paris", 50),
            usage(&b, 1, "k-paris", 7),
            usage(&a, 3, "k-plain", 5),
        ],
    );
    let log = w.once(&[]);
    assert!(!log.contains("unclean end"), "{log}");
    let after = (
        w.admitted("k-paris", &["--day", "2025-11-30"]),
        w.admitted("k-paris", &["--day", "2025-12-01"]),
        w.admitted("k-plain", &["--month", "2025-11"]),
    );
    assert_eq!(after, before);
    assert_eq!(before, ((37, 0), (33, 0), (5, 0)));
}

#[test]
fn redis_a_replayed_record_changes_nothing() {
    replayed_and_reread_records_change_nothing(World::redis());
}

#[test]
fn file_a_replayed_record_changes_nothing() {
    replayed_and_reread_records_change_nothing(World::file());
}

/// The whole stream read a second time, by a new consumer (the group rewound to 0).
#[test]
fn redis_a_stream_read_again_by_another_consumer_changes_nothing() {
    let mut w = World::redis();
    two_gateways_across_midnight(&mut w);
    w.once(&[]);
    let reply = w
        .redis_server()
        .cli(&["XGROUP", "SETID", "tollgate:usage", "tollgate:meter", "0"]);
    assert_eq!(reply, "OK");
    let log = w.once(&[]);
    assert!(!log.contains("unclean end"), "{log}");
    assert_eq!(w.admitted("k-paris", &["--day", "2025-11-30"]), (37, 0));
    assert_eq!(w.admitted("k-paris", &["--day", "2025-12-01"]), (33, 0));
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]), (5, 0));
}

/// Many records from several identities, added up by two consumers at the same time in small
/// batches, then all of it again by two more: each key's day holds exactly what the
/// identities' last totals say.
fn two_consumers_at_once_add_each_record_once(mut w: World) {
    let ids: Vec<Identity> = (0..4).map(|i| id(&format!("gw-{i}"), "boot")).collect();
    let mut seq = [0u64; 4];
    let mut totals = [0u64; 4];
    let mut at = AFTER_MIDNIGHT;
    for round in 0..150u64 {
        let mut batch = Vec::new();
        for (i, who) in ids.iter().enumerate() {
            totals[i] += 1 + (round + i as u64) % 7;
            seq[i] += 1;
            batch.push(usage(who, seq[i], "k-month", totals[i]));
            // A repeat of the same record in the same flush.
            if round % 5 == 0 {
                batch.push(usage(who, seq[i], "k-month", totals[i]));
            }
        }
        w.write(at, &batch);
        at += 1_000;
    }
    let ends: Vec<Record> = ids
        .iter()
        .enumerate()
        .map(|(i, who)| end(who, seq[i] + 1))
        .collect();
    w.write(at, &ends);
    let expected: u64 = totals.iter().sum();

    let run_two = |w: &World| {
        let spawn = || {
            meter_command(w, &["--once", "--batch", "7"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let (first, second) = (spawn(), spawn());
        for child in [first, second] {
            let out = child.wait_with_output().unwrap();
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{log}");
            assert!(!log.contains("unclean end"), "{log}");
        }
    };
    run_two(&w);
    // New York: 23:30 UTC on 30 November is 18:30 there, still November.
    assert_eq!(w.admitted("k-month", &["--month", "2025-11"]), (expected, 0));
    if let Place::Redis { server, .. } = &w.place {
        assert_eq!(
            server.cli(&["XGROUP", "SETID", "tollgate:usage", "tollgate:meter", "0"]),
            "OK"
        );
    }
    run_two(&w);
    assert_eq!(w.admitted("k-month", &["--month", "2025-11"]), (expected, 0));
    assert_eq!(w.admitted("k-month", &["--day", "2025-11-30"]), (expected, 0));
}

#[test]
fn redis_two_consumers_at_once_add_each_record_once() {
    two_consumers_at_once_add_each_record_once(World::redis());
}

#[test]
fn file_two_consumers_at_once_add_each_record_once() {
    two_consumers_at_once_add_each_record_once(World::file());
}

/// Records a consumer took and never acknowledged (it died) are taken over and added up.
#[test]
fn redis_records_a_dead_consumer_left_pending_are_taken_over() {
    let mut w = World::redis();
    w.once(&[]); // makes the group
    let a = id("gw-a", "a1");
    w.write(
        AFTER_MIDNIGHT,
        &[usage(&a, 1, "k-plain", 4), usage(&a, 2, "k-plain", 9)],
    );
    let taken = w.redis_server().cli(&[
        "XREADGROUP",
        "GROUP",
        "tollgate:meter",
        "dead",
        "COUNT",
        "10",
        "STREAMS",
        "tollgate:usage",
        ">",
    ]);
    assert!(taken.contains("k-plain"), "{taken}");
    w.once(&["--claim-idle", "0ms"]);
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]).0, 9);
    let pending = w
        .redis_server()
        .cli(&["XPENDING", "tollgate:usage", "tollgate:meter"]);
    assert!(pending.starts_with('0'), "still pending: {pending}");
}

fn an_identity_without_end_is_an_unclean_end(mut w: World) {
    let (crashed, clean) = (id("gw-crash", "c1"), id("gw-clean", "k1"));
    w.write(AFTER_MIDNIGHT, &[usage(&crashed, 1, "k-paris", 10)]);
    w.write(AFTER_MIDNIGHT + 1, &[usage(&clean, 1, "k-paris", 5)]);
    w.write(AFTER_MIDNIGHT + 2, &[end(&clean, 2)]);
    // The records are a year old: gw-crash has been silent far longer than --silence.
    let (metrics, log) = run_until_metrics(&w, &["--silence", "2s"], "tollgate_meter_unclean_ends_total 1");
    assert!(metrics.contains("tollgate_meter_lag_seconds 0"), "{metrics}");
    let reports: Vec<&str> = log.lines().filter(|l| l.contains("unclean end")).collect();
    assert_eq!(reports.len(), 1, "{log}");
    assert!(reports[0].contains("gw-crash/c1"), "{log}");
    assert!(!log.contains("gw-clean/k1"), "{log}");
    assert_eq!(
        w.usage("k-paris", &["--day", "2025-12-01"]),
        serde_json::json!({"key": "k-paris", "period": "2025-12-01", "admitted": 15, "unclean_ends": 1})
    );
    // Reported once: another run has nothing more to say about it, even when its old record
    // is delivered again (a replay is not a sign of life).
    w.write(AFTER_MIDNIGHT + 3, &[usage(&crashed, 1, "k-paris", 10)]);
    let log = w.once(&[]);
    assert!(
        !log.contains("unclean end") && !log.contains("sending records again"),
        "{log}"
    );
    assert_eq!(w.admitted("k-paris", &["--day", "2025-12-01"]), (15, 1));
    // Its end record, late after all: no longer counted unclean.
    w.write(AFTER_MIDNIGHT + 4, &[end(&crashed, 2)]);
    let log = w.once(&[]);
    assert!(log.contains("sent its end record"), "{log}");
    assert_eq!(w.admitted("k-paris", &["--day", "2025-12-01"]), (15, 0));
}

#[test]
fn redis_an_identity_without_end_is_an_unclean_end() {
    an_identity_without_end_is_an_unclean_end(World::redis());
}

#[test]
fn file_an_identity_without_end_is_an_unclean_end() {
    an_identity_without_end_is_an_unclean_end(World::file());
}

/// A record not yet added up (held by a consumer that stopped) shows as lag, and may be the
/// identity's next record or its end: silence is judged only up to it.
#[test]
fn redis_records_not_yet_added_up_are_lag_and_hold_back_silence() {
    let mut w = World::redis();
    let x = id("gw-x", "x1");
    w.write(AFTER_MIDNIGHT, &[usage(&x, 1, "k-plain", 3)]);
    // Added up while gw-x still counts as alive (its record is a year old).
    w.once(&["--silence", "100000h"]);
    // Its end, taken by a consumer that then stopped: pending, not added up.
    w.write(AFTER_MIDNIGHT + 5_000, &[end(&x, 2)]);
    let taken = w.redis_server().cli(&[
        "XREADGROUP",
        "GROUP",
        "tollgate:meter",
        "dead",
        "STREAMS",
        "tollgate:usage",
        ">",
    ]);
    assert!(taken.contains("end"), "{taken}");
    let (metrics, log) = run_until(&w, &[], "a lag of more than a day", |text| {
        sample(text, "tollgate_meter_lag_seconds").is_some_and(|lag| lag > 86_400.0)
    });
    assert!(!log.contains("unclean end"), "gw-x's end is pending: {log}");
    assert_eq!(sample(&metrics, "tollgate_meter_unclean_ends_total"), Some(0.0));
    // Taken over and added up: the end counts, nothing was unclean.
    let log = w.once(&["--claim-idle", "0ms"]);
    assert!(!log.contains("unclean end"), "{log}");
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]), (3, 0));
}

/// A malformed entry is named in the log with its id, marked done, and the rest still count.
#[test]
fn redis_a_malformed_entry_is_logged_with_its_id_and_acknowledged() {
    let mut w = World::redis();
    let a = id("gw-a", "a1");
    let bad = w.redis_server().cli(&[
        "XADD",
        "tollgate:usage",
        "1764545400000-0",
        "gateway",
        "gw-a",
        "boot",
        "a1",
        "seq",
        "x",
        "kind",
        "usage",
    ]);
    assert_eq!(bad, "1764545400000-0");
    w.write(AFTER_MIDNIGHT, &[usage(&a, 1, "k-plain", 6)]);
    let log = w.once(&[]);
    let line = log
        .lines()
        .find(|l| l.contains("malformed"))
        .unwrap_or_else(|| panic!("no malformed line: {log}"));
    assert!(
        line.contains("1764545400000-0") && line.contains("field seq"),
        "{line}"
    );
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]).0, 6);
    let pending = w
        .redis_server()
        .cli(&["XPENDING", "tollgate:usage", "tollgate:meter"]);
    assert!(pending.starts_with('0'), "still pending: {pending}");
}

#[test]
fn file_a_malformed_row_is_logged_with_its_id() {
    let mut w = World::file();
    let a = id("gw-a", "a1");
    w.write(AFTER_MIDNIGHT, &[usage(&a, 1, "k-plain", 6)]);
    let Place::File { path } = &w.place else {
        unreachable!()
    };
    let conn = tollgate_meter::sqlite::open(path).unwrap();
    conn.execute(
        "INSERT INTO usage_records (at_ms, gateway, boot, seq, kind) VALUES (1, 'gw-a', 'a1', 2, 'restart')",
        [],
    )
    .unwrap();
    let log = w.once(&[]);
    let line = log
        .lines()
        .find(|l| l.contains("malformed"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("row 2") && line.contains("field kind"), "{line}");
    assert_eq!(w.admitted("k-plain", &["--day", "2025-11-30"]).0, 6);
}
