//! Tests of `logs`.

use super::*;
use crate::lines::MAX_LINE;

/// Dec 6 2026, 22:40:00 UTC, in µs.
const T: u64 = 1_765_060_800_000_000;
const S: u64 = 1_000_000;

fn rules(version: u64, k7_burst: u64) -> RulesFile {
    let text = format!(
        r#"{{"version": {version}, "upstreams": {{"u": {{"url": "http://127.0.0.1:9"}}}},
        "limits": {{"plan": {{"dimension": "key"}},
                   "exports": {{"dimension": "route", "rate": "1/5s", "burst": 1}},
                   "login": {{"dimension": {{"header": "X-Account"}}, "rate": "5/60s", "burst": 5}},
                   "unauth": {{"dimension": "ip", "rate": "1/1s", "burst": 2}}}},
        "keys": [{{"id": "k-7", "tenant": "k7",
                  "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc",
                  "limits": {{"plan": {{"rate": "600/60s", "burst": {k7_burst}}}}}}}],
        "routes": [{{"name": "orders", "method": "GET", "path": "/v1/orders", "upstream": "u", "cost": {{"plan": 1}}}},
                   {{"name": "exports", "method": "POST", "path": "/v1/exports", "upstream": "u", "cost": {{"plan": 10, "exports": 1}}}},
                   {{"name": "login", "method": "POST", "path": "/login", "upstream": "u", "key": "optional", "cost": {{"login": 1}}}}],
        "unauthenticated": {{"limit": "unauth"}}}}"#
    );
    RulesFile {
        name: "rules.json".into(),
        snap: Arc::new(
            tollgate_rules::compile(text.as_bytes(), "rules.json", CompileOptions::default()).unwrap(),
        ),
    }
}

/// A JSON access line; `check_us` `None` is a request no limit checked.
fn json(
    key: Option<&str>,
    method: &str,
    path: &str,
    status: u16,
    check_us: Option<u64>,
    version: u64,
) -> String {
    serde_json::json!({
        "time": "2026-12-06T22:40:01.123+00:00", "remote_addr": "127.0.0.1", "remote_user": key,
        "request_method": method, "request_uri": path, "server_protocol": "HTTP/1.1",
        "status": status, "body_bytes_sent": 2, "http_referer": null, "http_user_agent": "t",
        "request_id": "r", "route": null, "limit": null, "client_ip": null, "fingerprint": "none",
        "latency_us": 5, "check_us": check_us, "path": path, "instance": "gw-1",
        "rules_version": version, "cost_reported": null
    })
    .to_string()
}

fn combined(key: &str, method: &str, path: &str, status: u16, check_us: u64, client: &str) -> String {
    format!(
        "127.0.0.1 - {key} [06/Dec/2026:22:40:01 +0000] \"{method} {path} HTTP/1.1\" {status} 2 \"-\" \"t\" \
         request_id=r route=\"-\" limit=\"-\" client_ip={client} fingerprint=none latency_us=5 \
         check_us={check_us} path=\"{path}\" instance=gw-2 rules_version=4 cost_reported=-"
    )
}

fn input(name: &str, text: impl AsRef<[u8]>) -> Input {
    Input::new(
        name.into(),
        None,
        Box::new(io::Cursor::new(text.as_ref().to_vec())),
    )
    .unwrap()
}

fn lines(l: &[String]) -> String {
    l.iter().map(|l| format!("{l}\n")).collect()
}

fn gz(text: &str) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    io::Write::write_all(&mut e, text.as_bytes()).unwrap();
    e.finish().unwrap()
}

fn key<'a>(r: &'a LogsReport, k: &str) -> &'a KeyReport {
    r.keys
        .iter()
        .find(|x| x.key == k)
        .unwrap_or_else(|| panic!("{k}: {:?}", r.keys))
}

#[test]
fn the_format_comes_from_the_content() {
    let j = json(Some("k-7"), "GET", "/v1/orders", 200, Some(T), 4);
    let c = combined("k-7", "GET", "/v1/orders", 200, T, "-");
    assert_eq!(input("a", format!("\n{j}\n")).format, Format::Json);
    assert_eq!(input("a", format!("{c}\n")).format, Format::Combined);
    assert_eq!(input("a", "time,key,method\n1,k-7,GET\n").format, Format::Csv);
    assert_eq!(input("a", "\"Time\", KEY\n").format, Format::Csv);
    assert_eq!(input("a", "\n \n").format, Format::Empty);
    assert_eq!(input("a", "hello\nworld\n").format, Format::Unknown);
    // The gateway's own lines before its first access line.
    let mixed = format!("2026-12-06T22:40:00.000Z  INFO tollgate: listening, admin on :9\n{c}\n");
    assert_eq!(input("a", mixed).format, Format::Combined);
    let packed = input("a.log", gz(&format!("{j}\n")));
    assert!(packed.gzip);
    assert_eq!(packed.format, Format::Json);
    assert!(!input("a", format!("{j}\n")).gzip);
    let mut lines = packed.into_lines();
    let (mut buf, mut line) = (Vec::new(), Line::default());
    lines.next(&mut buf, &mut line).unwrap();
    assert_eq!(
        String::from_utf8(buf.clone()).unwrap(),
        format!("{j}\n"),
        "the lines that told the format are read again"
    );
    lines.next(&mut buf, &mut line).unwrap();
    assert_eq!(line.bytes, 0);
}

#[test]
fn one_csv_is_a_trace_and_several_files_must_be_logs() {
    let j = json(Some("k-7"), "GET", "/v1/orders", 200, Some(T), 4);
    let csv = || input("t.csv", "time,key\n1,k-7\n");
    assert!(matches!(classify(vec![csv()]), Ok(Inputs::Trace(_))));
    // A header the CSV reader explains better.
    assert!(matches!(
        classify(vec![input("t.csv", "time,gateway\n")]),
        Ok(Inputs::Trace(_))
    ));
    let err = classify(vec![input("a.log", format!("{j}\n")), csv()])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("t.csv") && err.contains("only access logs can be merged"),
        "{err}"
    );
    let err = classify(vec![input("x.log", "hello\n")])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.starts_with("x.log: line 1 is neither an access line nor a CSV header"),
        "{err}"
    );
    assert!(err.contains("json or combined"), "{err}");
    let two = classify(vec![input("a.log", format!("{j}\n")), input("b.log", "")]);
    assert!(matches!(two, Ok(Inputs::Logs(l)) if l.len() == 2));
}

#[test]
fn files_merge_in_the_order_of_their_checks() {
    // One export every 5 s for k-7. gw-1 wrote its later request first (requests end out of
    // order); gw-2's came before both. Replayed in file order, the first would pass and
    // the last (logged admitted) be refused.
    let a = lines(&[
        json(Some("k-7"), "POST", "/v1/exports", 200, Some(T + 6_500_000), 4),
        json(Some("k-7"), "POST", "/v1/exports", 429, Some(T + 2 * S), 4),
    ]);
    let b = format!("{}\n", combined("k-7", "POST", "/v1/exports", 200, T + S, "-"));
    let r = replay(
        vec![input("a.log", a), input("b.log", b)],
        rules(4, 20),
        None,
        false,
    )
    .unwrap();
    let k7 = key(&r, "k-7");
    assert_eq!((k7.requests, k7.agree, k7.disagree), (3, 3, 0), "{k7:?}");
    assert_eq!((k7.logged_admitted, k7.replayed_admitted), (2, 2));
    assert_eq!(
        (r.first_check_us, r.last_check_us),
        (Some(T + S), Some(T + 6_500_000))
    );
    assert_eq!((r.lines.json, r.lines.combined), (2, 1));
    assert_eq!(r.instances.get("gw-1"), Some(&2));
    assert_eq!(r.instances.get("gw-2"), Some(&1));
}

#[test]
fn lines_that_are_not_access_lines_are_skipped_and_counted() {
    let ok = json(Some("k-7"), "GET", "/v1/orders", 200, Some(T), 4);
    let mut text = lines(&[
        "2026-12-06T22:40:01.000Z  INFO tollgate: started".into(),
        ok.clone(),
        r#"{"level":"WARN","fields":{"message":"slow upstream"}}"#.into(),
        "%%% garbage".into(),
        json(None, "GET", "/nowhere", 404, None, 4),
        ok.replace("\"remote_addr\":\"127.0.0.1\"", "\"remote_addr\":\"not-an-ip\""),
        // A key id over its bound, and a line over the maximum.
        json(Some(&"k".repeat(2048)), "GET", "/v1/orders", 200, Some(T), 4),
        "x".repeat(MAX_LINE + 1),
    ]);
    text.push_str(&ok[..ok.len() - 1]);
    let r = replay(vec![input("a.log", text)], rules(4, 20), None, false).unwrap();
    let l = &r.lines;
    assert_eq!(
        (l.read, l.access, l.skipped, l.truncated, l.too_long),
        (9, 2, 7, 1, 2),
        "{l:?}"
    );
    assert_eq!((l.not_checked, l.replayed, l.not_replayable), (1, 1, 0));
    let i = &r.inputs[0];
    assert_eq!((i.skipped, i.truncated, i.too_long), (7, 1, 2));
    // Gzip cut short in its trailer: every line came whole. Cut inside its data: the last
    // line is truncated.
    let packed = gz(&lines(&[ok.clone(), ok.clone(), ok.clone()]));
    let r = replay(
        vec![input("a.log.gz", &packed[..packed.len() - 4])],
        rules(4, 20),
        None,
        false,
    )
    .unwrap();
    assert!(r.inputs[0].cut);
    assert_eq!((r.lines.replayed, r.lines.truncated), (3, 0), "{:?}", r.lines);
    let r = replay(
        vec![input("a.log.gz", &packed[..packed.len() - 12])],
        rules(4, 20),
        None,
        false,
    )
    .unwrap();
    assert!(r.inputs[0].cut);
    assert_eq!((r.lines.replayed, r.lines.truncated), (2, 1), "{:?}", r.lines);
}

#[test]
fn callers_without_a_key_pay_their_address_bucket() {
    // /v1/orders needs a key: without one the gateway charges the address's bucket (burst
    // 2) and answers 401 or 429. Another address has a bucket of its own.
    let text = lines(&[
        combined("-", "GET", "/v1/orders", 401, T, "-"),
        combined("-", "GET", "/v1/orders", 401, T, "-"),
        combined("-", "GET", "/v1/orders", 429, T, "-"),
        combined("-", "GET", "/v1/orders", 401, T, "10.0.0.2"),
        // A key id these rules don't know is a caller without a key.
        combined("k-99", "GET", "/v1/orders", 200, T, "10.0.0.3"),
    ]);
    let r = replay(vec![input("a.log", text)], rules(4, 20), None, false).unwrap();
    let anon = key(&r, "-");
    assert_eq!(
        (anon.requests, anon.agree, anon.replayed_refused),
        (4, 4, 1),
        "{anon:?}"
    );
    assert_eq!(key(&r, "k-99").agree, 1);
    assert_eq!(r.rules.unknown_keys.get("k-99"), Some(&1));
}

#[test]
fn requests_the_log_cannot_replay_are_counted_by_reason() {
    let text = lines(&[
        json(None, "POST", "/login", 200, Some(T), 4),
        json(None, "POST", "/login", 200, Some(T + 1), 4),
        json(Some("k-7"), "GET", "/v9/nothing?x=1", 200, Some(T + 2), 4),
        json(Some("k-7"), "GET", "/v1/orders", 200, Some(T + 3), 3),
    ]);
    let r = replay(vec![input("a.log", text)], rules(4, 20), None, false).unwrap();
    assert_eq!((r.lines.not_replayable, r.lines.replayed), (3, 1));
    let reasons: Vec<(&str, u64, Option<&str>)> = r
        .not_replayable
        .iter()
        .map(|x| (x.reason.as_str(), x.lines, x.example.as_deref()))
        .collect();
    assert_eq!(
        reasons,
        [
            (
                "rules.json: route \"login\" charges limit \"login\", keyed on header x-account, which the log does not carry",
                2,
                None
            ),
            ("rules.json: no route matches", 1, Some("GET /v9/nothing")),
        ]
    );
    assert_eq!(r.rules_versions, BTreeMap::from([(3, 1), (4, 3)]));
    assert_eq!(
        r.versions_note.as_deref(),
        Some("the log ran rules versions 3, 4; replayed under version 4 of rules.json")
    );
    let one = replay(
        vec![input(
            "a.log",
            lines(&[json(None, "GET", "/v1/orders", 401, Some(T), 4)]),
        )],
        rules(4, 20),
        None,
        false,
    )
    .unwrap();
    assert_eq!(one.versions_note, None);
    let other = replay(
        vec![input(
            "a.log",
            lines(&[json(None, "GET", "/v1/orders", 401, Some(T), 3)]),
        )],
        rules(4, 20),
        None,
        false,
    )
    .unwrap();
    assert_eq!(
        other.versions_note.as_deref(),
        Some("the log ran rules version 3; replayed under version 4 of rules.json")
    );
}

#[test]
fn a_proposal_shows_what_it_would_newly_refuse() {
    // 25 reads of k-7, 10 ms apart, against a plan of 10 a second: before read i the
    // bucket holds B − 0.9·i tokens while all pass. Burst 20 admits reads 0–21; burst 10
    // admits 0–10, then 20, when the 0.1 a read has refilled one token.
    let text = lines(
        &(0..25)
            .map(|i| json(Some("k-7"), "GET", "/v1/orders", 200, Some(T + i * 10_000), 4))
            .chain(std::iter::once(json(None, "GET", "/v1/orders", 401, Some(T), 4)))
            .collect::<Vec<_>>(),
    );
    let mut tight = rules(5, 10);
    tight.name = "tight.json".into();
    let r = replay(vec![input("a.log", text)], rules(4, 20), Some(tight), false).unwrap();
    let k7 = key(&r, "k-7");
    assert_eq!(k7.replayed_admitted, 22);
    assert_eq!(k7.admitted_proposed, Some(12));
    assert_eq!((k7.newly_refused, k7.newly_admitted), (10, 0));
    assert_eq!(k7.longest_retry_after_s, Some(1));
    assert_eq!(r.keys[0].key, "k-7", "the most newly refused first");
    assert_eq!(key(&r, "-").newly_refused, 0);
    assert_eq!(r.over(45.4).len(), 1);
    assert!(r.over(45.5).is_empty(), "10 of 22 is 45.45%");
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    let fields: Vec<&str> = v["keys"][0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut want = [
        "key",
        "requests",
        "admitted_running",
        "admitted_proposed",
        "newly_refused",
        "newly_admitted",
        "longest_retry_after_s",
        "agree",
        "disagree",
    ];
    want.sort_unstable();
    let mut fields = fields;
    fields.sort_unstable();
    assert_eq!(fields, want);
    assert_eq!(v["against"]["file"], "tight.json");
}
