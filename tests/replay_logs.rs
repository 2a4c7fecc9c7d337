//! `tollgate replay` reads the gateway's own access logs: a JSON log and a combined one of two
//! gateways, one of them gzipped, merged by check time and replayed under the demo rules; the
//! agreement per key, what a tightened copy would newly refuse, and exit status 3 when that is
//! more than `--max-newly-refused` allows.

use std::io::Write;
use std::path::{Path, PathBuf};

mod common;
// A real gateway's logs, in this binary rather than one of its own: each test binary links
// the whole stack, most of a CI run.
#[path = "replay_logs/recorded.rs"]
mod recorded;
// Hostile files: lines too long and gzip bombs.
#[path = "replay_logs/bounds.rs"]
mod bounds;

use common::cli::{fails, ok, p, tollgate};

/// Dec 6 2026, 22:40:00 UTC, in µs.
const T: u64 = 1_765_060_800_000_000;
const MS: u64 = 1_000;

/// One request of the logs: who, what, what the gateway answered, and when it checked it.
struct Req {
    key: Option<&'static str>,
    method: &'static str,
    path: &'static str,
    status: u16,
    check_us: Option<u64>,
    cost_reported: Option<u64>,
}

fn req(key: Option<&'static str>, method: &'static str, path: &'static str, status: u16, at: u64) -> Req {
    Req {
        key,
        method,
        path,
        status,
        check_us: Some(at),
        cost_reported: None,
    }
}

fn json(r: &Req, version: u64) -> String {
    serde_json::json!({
        "time": "2026-12-06T22:40:01.123+00:00", "remote_addr": "127.0.0.1", "remote_user": r.key,
        "request_method": r.method, "request_uri": r.path, "server_protocol": "HTTP/1.1",
        "status": r.status, "body_bytes_sent": 12, "http_referer": null,
        "http_user_agent": "curl/7.88.1", "request_id": "abc", "route": null, "limit": null,
        "client_ip": null, "fingerprint": "none", "latency_us": 850, "check_us": r.check_us,
        "path": r.path, "instance": "gw-1", "rules_version": version,
        "cost_reported": r.cost_reported,
    })
    .to_string()
}

fn combined(r: &Req, version: u64) -> String {
    let dash = |n: Option<u64>| n.map_or("-".to_string(), |n| n.to_string());
    format!(
        "127.0.0.1 - {} [06/Dec/2026:22:40:01 +0000] \"{} {} HTTP/1.1\" {} 12 \"-\" \"curl/7.88.1\" \
         request_id=abc route=\"-\" limit=\"-\" client_ip=- fingerprint=none latency_us=850 \
         check_us={} path=\"{}\" instance=gw-2 rules_version={version} cost_reported={}",
        r.key.unwrap_or("-"),
        r.method,
        r.path,
        r.status,
        dash(r.check_us),
        r.path,
        dash(r.cost_reported),
    )
}

/// 25 reads of k-7 10 ms apart, as the demo rules decide them: its plan of 10 a second holds
/// B − 0.9·i tokens before read i while all pass, so burst 20 admits reads 0–21.
fn k7(i: u64) -> Req {
    req(
        Some("k-7"),
        "GET",
        "/v1/orders",
        if i <= 21 { 200 } else { 429 },
        T + i * 10 * MS,
    )
}

struct Logs {
    dir: tempfile::TempDir,
    running: PathBuf,
    tight: PathBuf,
    gw1: PathBuf,
    gw2: PathBuf,
}

impl Logs {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// The demo rules as version 2 of `running.json`, and `tight.json` with k-7's plan burst
/// lowered to 10; gw-1's JSON log under version 1, gw-2's combined log under version 2.
fn logs() -> Logs {
    let dir = tempfile::tempdir().unwrap();
    let mut rules: serde_json::Value =
        serde_json::from_str(&common::demo_rules_for("127.0.0.1:9".parse().unwrap())).unwrap();
    rules["version"] = 2.into();
    let running = dir.path().join("running.json");
    std::fs::write(&running, rules.to_string()).unwrap();
    let k7_key = rules["keys"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|k| k["id"] == "k-7")
        .unwrap();
    k7_key["limits"]["plan"]["burst"] = 10.into();
    rules["version"] = 3.into();
    let tight = dir.path().join("tight.json");
    std::fs::write(&tight, rules.to_string()).unwrap();

    // gw-1: k-7's even reads, each pair written in the order its requests ended (the later
    // first); k-big; two callers without a key; a 404 no limit checked; a login, whose limit
    // is keyed on a header the log does not carry.
    let mut gw1 = vec!["2026-12-06T22:39:59.000Z  INFO tollgate: listening on 127.0.0.1:8080".to_string()];
    for pair in (0..=24).step_by(4) {
        for i in [pair + 2, pair] {
            if i <= 24 {
                gw1.push(json(&k7(i), 1));
            }
        }
    }
    for i in 0..3 {
        gw1.push(json(
            &req(Some("k-big"), "GET", "/v1/orders", 200, T + 2_000 * MS + i),
            1,
        ));
    }
    for _ in 0..2 {
        gw1.push(json(&req(None, "GET", "/v1/orders", 401, T + 3_000 * MS), 1));
    }
    let unrouted = Req {
        check_us: None,
        ..req(None, "GET", "/nope", 404, 0)
    };
    gw1.push(json(&unrouted, 1));
    gw1.push(json(&req(None, "POST", "/login", 200, T + 4_000 * MS), 1));
    let gw1_path = dir.path().join("gw-1.log");
    std::fs::write(
        &gw1_path,
        gw1.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();

    // gw-2: k-7's odd reads; six completions of k-8, the upstream reporting 100 tokens each, one
    // logged refused that its ample buckets admit; a JWT caller, and a caller without a token,
    // whom the gateway charged the address's bucket only; garbage; a last line cut off.
    let mut gw2: Vec<String> = (1..=23).step_by(2).map(|i| combined(&k7(i), 2)).collect();
    for j in 0..6 {
        let r = Req {
            cost_reported: (j != 5).then_some(100),
            ..req(
                Some("k-8"),
                "POST",
                "/v1/completions",
                if j == 5 { 429 } else { 200 },
                T + 1_000 * MS + j * 100 * MS,
            )
        };
        gw2.push(combined(&r, 2));
    }
    gw2.push(combined(
        &req(Some("alice"), "GET", "/v2/orders", 200, T + 5_000 * MS),
        2,
    ));
    gw2.push(combined(&req(None, "GET", "/v2/orders", 401, T + 5_000 * MS), 2));
    gw2.push("#!& not a log line".into());
    let mut text: String = gw2.iter().map(|l| format!("{l}\n")).collect();
    let cut = combined(&k7(3), 2);
    text.push_str(&cut[..cut.len() / 2]);
    let gw2_path = dir.path().join("gw-2.log");
    std::fs::write(&gw2_path, text).unwrap();
    Logs {
        dir,
        running,
        tight,
        gw1: gw1_path,
        gw2: gw2_path,
    }
}

fn gzip(from: &Path, to: &Path) {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(&std::fs::read(from).unwrap()).unwrap();
    std::fs::write(to, e.finish().unwrap()).unwrap();
}

fn replay_json(args: &[&str]) -> serde_json::Value {
    let out = ok(&tollgate(&[&["replay"][..], args, &["--json"]].concat()));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn key<'a>(v: &'a serde_json::Value, k: &str) -> &'a serde_json::Value {
    v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["key"] == k)
        .unwrap_or_else(|| panic!("no key {k}: {v}"))
}

#[test]
fn two_gateways_logs_replay_as_they_ran() {
    let l = logs();
    let v = replay_json(&[p(&l.gw1), p(&l.gw2), "--rules", p(&l.running)]);
    assert_eq!(v["files"], 2);
    let lines = &v["lines"];
    let counts: Vec<u64> = [
        "read",
        "json",
        "combined",
        "access",
        "skipped",
        "truncated",
        "not_checked",
        "not_replayable",
        "replayed",
    ]
    .iter()
    .map(|f| lines[f].as_u64().unwrap_or_else(|| panic!("{f}: {lines}")))
    .collect();
    assert_eq!(counts, [43, 21, 22, 40, 3, 1, 1, 2, 37], "{lines}");
    assert_eq!(v["rules_versions"], serde_json::json!({"1": 20, "2": 20}));
    let running = p(&l.running);
    assert_eq!(
        v["versions_note"],
        format!("the log ran rules versions 1, 2; replayed under version 2 of {running}")
    );
    let reasons: Vec<&str> = v["not_replayable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        [
            format!(
                "{running}: route \"login\" charges limit \"login\", keyed on header x-account, which the log does not carry"
            ),
            format!(
                "{running}: route \"orders-jwt\" names its callers by JWT claims, which the log does not carry"
            ),
        ]
    );

    // Without a proposal: what the gateway logged beside what the rules decide.
    let fields = |k: &serde_json::Value| -> Vec<u64> {
        [
            "requests",
            "logged_admitted",
            "logged_refused",
            "replayed_admitted",
            "agree",
            "disagree",
        ]
        .iter()
        .map(|f| k[f].as_u64().unwrap())
        .collect()
    };
    assert_eq!(fields(key(&v, "k-7")), [25, 22, 3, 22, 25, 0]);
    assert_eq!(fields(key(&v, "k-8")), [6, 5, 1, 6, 5, 1]);
    assert_eq!(fields(key(&v, "k-big")), [3, 3, 0, 3, 3, 0]);
    assert_eq!(fields(key(&v, "-")), [3, 3, 0, 3, 3, 0]);
    assert_eq!(v["keys"][0]["key"], "k-8", "the most disagreements first");
    assert_eq!(v["keys"][0].as_object().unwrap().len(), 7);

    let text = ok(&tollgate(&[
        "replay",
        p(&l.gw1),
        p(&l.gw2),
        "--rules",
        p(&l.running),
    ]));
    for want in [
        "2 files: 43 lines (21 JSON, 22 combined)",
        "skipped: 3 that are not access lines, 1 of them truncated",
        "replayed: 37 of 40 access lines",
        "not checked: 1 ",
        "not replayable: 2",
        &format!("note: the log ran rules versions 1, 2; replayed under version 2 of {running}"),
        "instances: gw-1 (20), gw-2 (20)",
    ] {
        assert!(text.contains(want), "{want:?} in:\n{text}");
    }
    let k8 = text.lines().find(|l| l.starts_with("k-8 ")).unwrap();
    let cells: Vec<&str> = k8.split_whitespace().collect();
    assert_eq!(cells, ["k-8", "6", "5", "1", "6", "0", "5", "1"], "{text}");

    // The same log gzipped reads alike.
    let gz = l.path("gw-1.log.gz");
    gzip(&l.gw1, &gz);
    let packed = replay_json(&[p(&gz), p(&l.gw2), "--rules", p(&l.running)]);
    assert_eq!(packed["keys"], v["keys"]);
    assert_eq!(packed["lines"], v["lines"]);
    assert_eq!(packed["inputs"][0]["gzip"], true);
}

#[test]
fn a_tightened_plan_newly_refuses_k7_only() {
    let l = logs();
    let v = replay_json(&[
        p(&l.gw1),
        p(&l.gw2),
        "--rules",
        p(&l.running),
        "--against",
        p(&l.tight),
    ]);
    // Burst 10 admits reads 0–10, then 20, once 0.1 a read has refilled a token: 12 of the 22.
    let k7 = key(&v, "k-7");
    assert_eq!(k7["admitted_running"], 22);
    assert_eq!(k7["admitted_proposed"], 12);
    assert_eq!(k7["newly_refused"], 10);
    assert_eq!(k7["newly_admitted"], 0);
    assert_eq!(k7["longest_retry_after_s"], 1);
    assert_eq!(k7["agree"], 25);
    assert_eq!(v["keys"][0]["key"], "k-7");
    for k in v["keys"].as_array().unwrap() {
        let mut fields: Vec<&str> = k.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            [
                "admitted_proposed",
                "admitted_running",
                "agree",
                "disagree",
                "key",
                "longest_retry_after_s",
                "newly_admitted",
                "newly_refused",
                "requests",
            ]
        );
        if k["key"] != "k-7" {
            assert_eq!(
                (&k["newly_refused"], &k["newly_admitted"]),
                (&0.into(), &0.into()),
                "{k}"
            );
            assert_eq!(k["admitted_running"], k["admitted_proposed"], "{k}");
        }
    }
    assert_eq!(v["against"]["version"], 3);

    // Held back: 10 of 22 is 45.45%.
    let held = tollgate(&[
        "replay",
        p(&l.gw1),
        p(&l.gw2),
        "--rules",
        p(&l.running),
        "--against",
        p(&l.tight),
        "--max-newly-refused",
        "0",
    ]);
    assert_eq!(held.status.code(), Some(3), "{held:?}");
    let err = String::from_utf8_lossy(&held.stderr);
    assert!(err.contains("k-7 (10 of 22 admitted, 45.45%)"), "{err}");
    assert!(!err.contains("k-8"), "{err}");
    let out = String::from_utf8_lossy(&held.stdout);
    assert!(
        out.contains("newly refused: above 0% of their admitted requests: k-7"),
        "{out}"
    );
    let passes = |pct: &str| {
        tollgate(&[
            "replay",
            p(&l.gw1),
            p(&l.gw2),
            "--rules",
            p(&l.running),
            "--against",
            p(&l.tight),
            "--max-newly-refused",
            pct,
        ])
        .status
        .code()
    };
    assert_eq!(passes("45.4"), Some(3));
    assert_eq!(passes("45.5"), Some(0));
    assert_eq!(passes("50"), Some(0));
}

#[test]
fn flags_that_mean_nothing_for_logs_are_refused() {
    let l = logs();
    let (gw1, running) = (p(&l.gw1), p(&l.running));
    let cases: [(&[&str], &[&str]); 6] = [
        (&["replay", gw1], &["--rules", "required with access logs"]),
        (
            &["replay", gw1, "--rules", running, "--design", "local"],
            &["--design"],
        ),
        (
            &["replay", gw1, "--rules", running, "--algorithm", "gcra"],
            &["--algorithm"],
        ),
        (
            &["replay", gw1, "--rate", "10/1s", "--burst", "5"],
            &["--rate", "--rules"],
        ),
        (
            &["replay", gw1, "--rules", running, "--decisions", "d.csv"],
            &["--decisions"],
        ),
        (
            &["replay", gw1, "--rules", running, "--plot", "a.svg"],
            &["--plot"],
        ),
    ];
    for (args, want) in cases {
        let o = tollgate(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        for w in want {
            assert!(err.contains(w), "{args:?}: {w:?} in {err}");
        }
    }
    let csv = l.path("t.csv");
    std::fs::write(&csv, "time,key\n1,k-7\n").unwrap();
    let err = fails(&tollgate(&["replay", gw1, p(&csv), "--rules", running]));
    assert!(
        err.contains("t.csv") && err.contains("only access logs can be merged"),
        "{err}"
    );
    let err = fails(&tollgate(&[
        "replay",
        p(&csv),
        "--rate",
        "10/1s",
        "--burst",
        "5",
        "--against",
        running,
    ]));
    assert!(err.contains("--against"), "{err}");
    let notes = l.path("notes.txt");
    std::fs::write(&notes, "remember the milk\n").unwrap();
    let err = fails(&tollgate(&["replay", gw1, p(&notes), "--rules", running]));
    assert!(
        err.contains("notes.txt: line 1 is neither an access line nor a CSV header"),
        "{err}"
    );
    let o = tollgate(&["replay", gw1, "--rules", running, "--max-newly-refused", "1"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "clap refuses it without --against: {o:?}"
    );
}
