//! `tollgate meter`, run as a process against a real `redis-server` (and against the embedded
//! store's metering file), with this test playing the gateways: it writes usage records into
//! the stream (`XADD tollgate:usage <ms>-<n> …`, so the test sets each record's time) or into
//! `usage_records`. Every flow runs on both places and must give the same answers: totals per
//! key, day and month in the key's own zone across midnight; records replayed, read twice or
//! read by two consumers at once counting once; unclean ends reported once; flags; the CSV.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{RedisServer, require_binary};
use tollgate_meter::flags::{Flag, State};
use tollgate_meter::record::{Identity, Kind, Record};

/// Keys with a daily quota in Paris, a monthly one in New York, none (UTC), and a small one.
const RULES: &str = r#"{
  "version": 1,
  "upstreams": { "u": { "url": "http://127.0.0.1:1" } },
  "limits": { "plan": { "dimension": "key" } },
  "keys": [
    { "id": "k-paris", "tenant": "grocer",
      "sha256": "1670f2e42fefa5044d59a65349e47c566009488fc57d7b4376dd5787b59e3c57",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "day", "limit": 100, "timezone": "Europe/Paris" } },
    { "id": "k-month", "tenant": "acme",
      "sha256": "a5c7d1719e284f2c9485405d44f62d152cde9e6ede83e1a79a2442b65f6a8735",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "month", "limit": 1000, "timezone": "America/New_York" } },
    { "id": "k-plain", "tenant": "plain, inc",
      "sha256": "a116c9ed46d6207734a43317d30fd88f52ac8634c37d904bbf4e41d865f90475",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } } },
    { "id": "k-small", "tenant": "small",
      "sha256": "5fb6a47e368e12e5d8b19280796e6a3d146fe391ed2e967d5f95c55bfb0f9c2f",
      "limits": { "plan": { "rate": "10/1s", "burst": 20 } },
      "quota": { "per": "day", "limit": 10, "timezone": "Europe/Paris" } }
  ],
  "routes": [ { "name": "r", "method": "*", "path": "/", "upstream": "u", "cost": { "plan": 1 } } ]
}"#;

/// 2025-11-30T22:30:00Z: 23:30 on 30 November in Paris.
const BEFORE_MIDNIGHT: i64 = 1_764_541_800_000;
/// 2025-11-30T23:30:00Z: 00:30 on 1 December in Paris (a new day and a new month there), still
/// 30 November in UTC and in New York.
const AFTER_MIDNIGHT: i64 = 1_764_545_400_000;

fn id(gateway: &str, boot: &str) -> Identity {
    Identity {
        gateway: gateway.into(),
        boot: boot.into(),
    }
}

fn usage(who: &Identity, seq: u64, key: &str, total: u64) -> Record {
    Record {
        identity: who.clone(),
        seq,
        kind: Kind::Usage {
            key: key.into(),
            total,
        },
    }
}

fn end(who: &Identity, seq: u64) -> Record {
    Record {
        identity: who.clone(),
        seq,
        kind: Kind::End,
    }
}

/// Where the gateways write and the meter reads: the Redis stream, or the metering file.
enum Place {
    Redis { server: RedisServer, next: u64 },
    File { path: PathBuf },
}

struct World {
    place: Place,
    dir: tempfile::TempDir,
    rules: PathBuf,
}

impl World {
    fn redis() -> World {
        World::new(Place::Redis {
            server: RedisServer::start(),
            next: 0,
        })
    }

    fn file() -> World {
        World::new(Place::File { path: PathBuf::new() })
    }

    fn new(mut place: Place) -> World {
        let dir = tempfile::tempdir().unwrap();
        let rules = dir.path().join("rules.json");
        std::fs::write(&rules, RULES).unwrap();
        if let Place::File { path } = &mut place {
            *path = dir.path().join("usage.db");
        }
        World { place, dir, rules }
    }

    fn redis_server(&self) -> &RedisServer {
        match &self.place {
            Place::Redis { server, .. } => server,
            Place::File { .. } => panic!("not on Redis"),
        }
    }

    /// `--store URL` or `--meter-file PATH`, and `--rules PATH`.
    fn source(&self) -> Vec<String> {
        let mut a = match &self.place {
            Place::Redis { server, .. } => vec!["--store".to_string(), server.url()],
            Place::File { path } => vec!["--meter-file".to_string(), path.display().to_string()],
        };
        a.extend(["--rules".to_string(), self.rules.display().to_string()]);
        a
    }

    /// Appends records as gateways do, each stamped `at_ms`: the stream entry id's time, or
    /// the row's `at_ms`. Times must not go back (stream ids only grow).
    fn write(&mut self, at_ms: i64, records: &[Record]) {
        match &mut self.place {
            Place::Redis { server, next } => {
                let mut lines = String::new();
                for r in records {
                    *next += 1;
                    lines.push_str(&format!("XADD tollgate:usage {at_ms}-{next}"));
                    for (name, value) in r.fields() {
                        lines.push_str(&format!(" {name} {value}"));
                    }
                    lines.push('\n');
                }
                let out = redis_pipe(server, &lines);
                for (line, reply) in lines.lines().zip(out.lines()) {
                    assert!(reply.contains(&format!("{at_ms}-")), "{line} answered {reply:?}");
                }
            }
            Place::File { path } => {
                let mut conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::append(&mut conn, at_ms, records).unwrap();
            }
        }
    }

    fn meter(&self, args: &[&str]) -> Output {
        meter_command(self, args).output().expect("tollgate runs")
    }

    /// `tollgate meter --once`, which must succeed; returns its log.
    fn once(&self, extra: &[&str]) -> String {
        let mut args = vec!["--once"];
        args.extend(extra);
        let out = self.meter(&args);
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "meter --once failed: {log}");
        log
    }

    /// `tollgate meter usage --key KEY PERIOD…` as JSON.
    fn usage(&self, key: &str, period: &[&str]) -> serde_json::Value {
        let mut args = vec!["usage", "--key", key];
        args.extend(period);
        let out = self.meter(&args);
        assert!(
            out.status.success(),
            "usage {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "usage printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// (admitted, unclean_ends) of a key in a period.
    fn admitted(&self, key: &str, period: &[&str]) -> (u64, u64) {
        let v = self.usage(key, period);
        (
            v["admitted"].as_u64().unwrap(),
            v["unclean_ends"].as_u64().unwrap(),
        )
    }

    fn flag(&self, key: &str) -> Option<Flag> {
        let json = match &self.place {
            Place::Redis { server, .. } => {
                let v = server.cli(&["HGET", tollgate_meter::flags::FLAGS, key]);
                (!v.is_empty()).then_some(v)
            }
            Place::File { path } => {
                let conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::read_flags(&conn)
                    .unwrap()
                    .into_iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, j)| j)
            }
        }?;
        Some(serde_json::from_str(&json).unwrap_or_else(|e| panic!("flag of {key}: {e}: {json}")))
    }

    fn set_flag(&self, key: &str, flag: &Flag) {
        match &self.place {
            Place::Redis { server, .. } => {
                let json = serde_json::to_string(flag).unwrap();
                server.cli(&["HSET", tollgate_meter::flags::FLAGS, key, &json]);
            }
            Place::File { path } => {
                let conn = tollgate_meter::sqlite::open(path).unwrap();
                tollgate_meter::sqlite::write_flag(&conn, key, flag).unwrap();
            }
        }
    }
}

fn meter_command(w: &World, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    // A subcommand's name comes first, then the place and the rules.
    let (sub, rest) = match args.first() {
        Some(&s) if s == "usage" || s == "export" => (Some(s), &args[1..]),
        _ => (None, args),
    };
    cmd.arg("meter");
    if let Some(s) = sub {
        cmd.arg(s);
    }
    cmd.args(w.source())
        .args(rest)
        .env("TOLLGATE_LOG", "info")
        .stdin(Stdio::null());
    cmd
}

/// Sends commands to redis-cli on its standard input, one a line; returns its replies.
fn redis_pipe(server: &RedisServer, lines: &str) -> String {
    let mut child = Command::new(require_binary("redis-cli"))
        .args(["-p", &server.port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("redis-cli runs");
    child.stdin.take().unwrap().write_all(lines.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Two gateways, each with a running total for k-paris on both sides of Paris midnight and
/// one for k-plain, both ending cleanly.
fn two_gateways_across_midnight(w: &mut World) {
    let (a, b) = (id("gw-a", "a1"), id("gw-b", "b1"));
    w.write(BEFORE_MIDNIGHT, &[usage(&a, 1, "k-paris", 30)]);
    w.write(BEFORE_MIDNIGHT + 1, &[usage(&b, 1, "k-paris", 7)]);
    w.write(
        AFTER_MIDNIGHT,
        &[usage(&a, 2, "k-paris", 50), usage(&a, 3, "k-plain", 5)],
    );
    w.write(AFTER_MIDNIGHT + 1, &[usage(&b, 2, "k-paris", 20)]);
    w.write(AFTER_MIDNIGHT + 2, &[end(&a, 4), end(&b, 3)]);
}

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

/// Runs the consumer with a metrics listener, waits until `/metrics` shows `want`, stops it
/// and returns (metrics text, log).
fn run_until_metrics(w: &World, extra: &[&str], want: &str) -> (String, String) {
    run_until(w, extra, want, |text| text.contains(want))
}

/// The value of a sample in a `/metrics` text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// As [`run_until_metrics`], until `ok` holds of the text.
fn run_until(w: &World, extra: &[&str], want: &str, ok: impl Fn(&str) -> bool) -> (String, String) {
    let mut args = vec!["--metrics-listen", "127.0.0.1:0", "--poll", "100ms"];
    args.extend(extra);
    let mut child: Child = meter_command(w, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("meter metrics on http://")
        .and_then(|s| s.strip_suffix("/metrics"))
        .unwrap_or_else(|| {
            let _ = child.kill();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("no metrics address printed: {line:?}; log: {err}")
        })
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut text = String::new();
    while Instant::now() < deadline {
        text = scrape(&addr);
        if ok(&text) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(ok(&text), "/metrics never showed {want}:\n{text}\nlog:\n{log}");
    (text, log)
}

/// GET /metrics over a plain socket.
fn scrape(addr: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ =
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes());
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
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
        !out.status.success() && e.contains("--store") && e.contains("one Redis node"),
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
