//! Operating the gateway: metrics that count exactly, request ids, JSON logs without secrets, and
//! a graceful shutdown that finishes what is in flight and refuses what is new.

mod common;

use std::time::{Duration, Instant};

use common::{DEMO_KEYS, Http, K7, K8, Tollgate};
use http::StatusCode;

fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
}

/// Checks the exposition line by line: comments, or `name{labels} value`.
fn assert_parses_as_prometheus_text(text: &str) {
    assert!(text.ends_with("# EOF\n"), "no EOF marker");
    for line in text.lines() {
        if line.starts_with('#') {
            assert!(
                line.starts_with("# HELP ")
                    || line.starts_with("# TYPE ")
                    || line.starts_with("# UNIT ")
                    || line == "# EOF",
                "bad comment line: {line}"
            );
            continue;
        }
        let (series, v) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        assert!(
            v.parse::<f64>().is_ok() || v == "+Inf" || v == "NaN",
            "bad value in {line}"
        );
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name in {line}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "unclosed labels in {line}");
            for pair in series[name_end + 1..series.len() - 1].split("\",") {
                let (k, v) = pair
                    .split_once("=\"")
                    .unwrap_or_else(|| panic!("bad label {pair:?} in {line}"));
                assert!(
                    k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "bad label name in {line}"
                );
                assert!(!v.contains('\n'));
            }
        }
    }
}

#[tokio::test]
async fn counters_show_exactly_what_happened_and_no_secrets() {
    let (gw, _clock, _dir) = common::demo_gateway().await;
    let http = Http::new();
    let url = format!("http://{}/v1/orders", gw.addr);
    let (n, m, k) = (20, 3, 2);
    for _ in 0..n + m {
        http.get(&url, &[("x-api-key", K7)]).await;
    }
    for _ in 0..k {
        assert_eq!(
            http.get(&url, &[("x-api-key", "k7-demo-key-but-wrong")])
                .await
                .status,
            StatusCode::UNAUTHORIZED
        );
    }
    let scrape = http
        .get(&format!("http://{}/metrics", gw.admin_addr.unwrap()), &[])
        .await;
    assert_eq!(scrape.status, StatusCode::OK);
    assert!(
        scrape
            .header("content-type")
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = String::from_utf8(scrape.body.to_vec()).unwrap();
    assert_parses_as_prometheus_text(&text);

    let get = |s: &str| value(&text, s).unwrap_or_else(|| panic!("{s} missing from:\n{text}"));
    assert_eq!(
        get(r#"tollgate_limit_decisions_total{limit="plan",decision="admitted"}"#),
        n as f64
    );
    assert_eq!(
        get(r#"tollgate_limit_decisions_total{limit="plan",decision="limited"}"#),
        m as f64
    );
    assert_eq!(
        get(r#"tollgate_requests_total{route="orders",status="200"}"#),
        n as f64
    );
    assert_eq!(
        get(r#"tollgate_requests_total{route="orders",status="429"}"#),
        m as f64
    );
    assert_eq!(
        get(r#"tollgate_requests_total{route="orders",status="401"}"#),
        k as f64
    );
    assert_eq!(
        get(r#"tollgate_limit_decisions_total{limit="unauth",decision="admitted"}"#),
        k as f64
    );
    assert_eq!(get("tollgate_rules_version"), 1.0);
    assert_eq!(get("tollgate_in_flight_requests"), 0.0);
    assert!(get("tollgate_store_check_seconds_count") >= (n + m + k) as f64);
    assert!(get(r#"tollgate_upstream_seconds_count{upstream="orders"}"#) >= n as f64);
    for secret in DEMO_KEYS {
        assert!(!text.contains(secret), "the scrape holds an API key");
    }
    // Upstream targets are named by address (the operator's own); nothing else holds one.
    assert!(
        !text
            .lines()
            .filter(|l| !l.contains("target=\""))
            .any(|l| l.contains("127.0.0.1")),
        "the scrape holds a client address"
    );
}

#[tokio::test]
async fn request_ids_are_generated_or_passed_through() {
    let (gw, _clock, _dir) = common::demo_gateway().await;
    let http = Http::new();
    let url = format!("http://{}/v1/orders", gw.addr);

    let a = http.get(&url, &[("x-api-key", K8)]).await;
    let id = a.header("x-request-id").expect("an id is generated").to_string();
    assert_eq!(id.len(), 32);
    assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(
        a.json()["headers"]["x-request-id"],
        id.as_str(),
        "the upstream got the same id"
    );

    let b = http.get(&url, &[("x-api-key", K8)]).await;
    assert_ne!(b.header("x-request-id").unwrap(), id, "ids are unique");

    let mine = "client-trace.42:abc";
    let c = http.get(&url, &[("x-api-key", K8), ("x-request-id", mine)]).await;
    assert_eq!(c.header("x-request-id"), Some(mine));
    assert_eq!(c.json()["headers"]["x-request-id"], mine);

    // An invalid id (spaces, too long) is replaced, on refusals too.
    let d = http.get(&url, &[("x-request-id", "has spaces in it")]).await;
    assert_eq!(d.status, StatusCode::UNAUTHORIZED);
    let replaced = d.header("x-request-id").unwrap();
    assert_ne!(replaced, "has spaces in it");
    assert_eq!(replaced.len(), 32);
}

#[tokio::test]
async fn json_logs_parse_and_never_hold_a_key() {
    let mut gw = Tollgate::spawn(&["demo", "--log-format", "json"]);
    let http = Http::new();
    for key in DEMO_KEYS {
        http.get(
            &gw.url("/v1/orders"),
            &[("authorization", &format!("Bearer {key}"))],
        )
        .await;
        http.get(&gw.url("/v1/orders"), &[("x-api-key", key)]).await;
    }
    // A wrong key that contains a real one, a conflicting pair, and a refused export.
    http.get(&gw.url("/v1/orders"), &[("x-api-key", &format!("{K7}x"))])
        .await;
    http.get(
        &gw.url("/v1/orders"),
        &[("x-api-key", K7), ("authorization", &format!("Bearer {K8}"))],
    )
    .await;
    for _ in 0..2 {
        http.send(
            http::Method::POST,
            &gw.url("/v1/exports"),
            &[("x-api-key", K7)],
            b"{}",
        )
        .await;
    }
    // Access lines are written by a thread of their own; the last are written at exit.
    let (_, log) = gw.stop();
    let mut access = 0;
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if v["target"] == "tollgate::access" {
            access += 1;
            for field in ["method", "route", "status", "limit", "latency_us", "request_id"] {
                assert!(v.get(field).is_some(), "access line without {field}: {line}");
            }
        }
        for key in DEMO_KEYS {
            assert!(!line.contains(key), "a log line holds an API key: {line}");
        }
    }
    assert_eq!(access, 10, "one access line per request:\n{log}");
}

/// Each line of `text` as JSON, failing on the first that is not one object.
fn json_lines(stream: &str, text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("a line on {stream} is not JSON ({e}): {line}\n{text}"));
            assert!(v.is_object(), "a line on {stream} is not an object: {line}");
            v
        })
        .collect()
}

#[tokio::test]
async fn json_mode_prints_only_json_from_start_to_stop() {
    let mut gw = Tollgate::spawn(&["demo", "--log-format", "json"]);
    let http = Http::new();
    let admitted = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
    assert_eq!(admitted.status, StatusCode::OK);
    let unauthenticated = http.get(&gw.url("/v1/orders"), &[]).await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
    // The exports limit's burst is 1 export (cost 10): the second is refused.
    let mut exports = vec![];
    for _ in 0..2 {
        let a = http
            .send(
                http::Method::POST,
                &gw.url("/v1/exports"),
                &[("x-api-key", K8)],
                b"{}",
            )
            .await;
        exports.push(a.status);
    }
    assert_eq!(exports, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    // A request line that is not HTTP.
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut tcp, b"NOT HTTP AT ALL\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut tcp, &mut answer)
        .await
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&answer)
    );

    let (stdout, stderr) = gw.stop();
    let out = json_lines("stdout", &stdout);
    let err = json_lines("stderr", &stderr);
    let startup = out
        .iter()
        .find(|v| v["message"] == "tollgate listening")
        .unwrap_or_else(|| panic!("no startup line on stdout:\n{stdout}"));
    assert_eq!(startup["addr"], gw.addr.to_string(), "{startup}");
    assert_eq!(startup["url"], format!("http://{}", gw.addr), "{startup}");
    assert_eq!(startup["rules_version"], 1, "{startup}");
    let admin = out.iter().find(|v| v["message"] == "admin listening").unwrap();
    assert_eq!(admin["addr"], gw.admin.unwrap().to_string());
    let keys: Vec<_> = out
        .iter()
        .filter(|v| v["message"] == "demo key")
        .map(|v| v["id"].clone())
        .collect();
    assert_eq!(keys, ["k-7", "k-8", "k-big"], "{stdout}");
    for v in &out {
        assert!(v["timestamp"].is_string() && v["level"].is_string(), "{v}");
    }
    let statuses: Vec<_> = err
        .iter()
        .filter(|v| v["target"] == "tollgate::access")
        .map(|v| v["status"].as_u64().unwrap())
        .collect();
    for status in [200, 401, 429] {
        assert!(
            statuses.contains(&status),
            "no access line with {status}:\n{stderr}"
        );
    }
    assert!(
        err.iter().any(|v| v["message"] == "SIGTERM: shutting down"),
        "{stderr}"
    );
}

#[test]
fn json_mode_reports_a_failed_start_as_json() {
    let missing = tempfile::tempdir().unwrap().path().join("missing.json");
    let o = common::cli::tollgate(&[
        "serve",
        "--rules",
        missing.to_str().unwrap(),
        "--log-format",
        "json",
        "--listen",
        "127.0.0.1:0",
    ]);
    let stderr = common::cli::fails(&o);
    assert!(o.stdout.is_empty(), "{}", String::from_utf8_lossy(&o.stdout));
    let lines = json_lines("stderr", &stderr);
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(lines[0]["level"], "ERROR");
    let message = lines[0]["message"].as_str().unwrap();
    assert!(message.contains(missing.to_str().unwrap()), "{message}");
    assert!(message.contains("cannot read"), "{message}");

    // A flag clap refuses, asked for json with the environment variable.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["demo", "--no-such-flag"])
        .env("TOLLGATE_LOG_FORMAT", "json")
        .output()
        .unwrap();
    let stderr = common::cli::fails(&o);
    let lines = json_lines("stderr", &stderr);
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0]["message"].as_str().unwrap().contains("--no-such-flag"),
        "{stderr}"
    );

    // The default mode keeps plain text.
    let o = common::cli::tollgate(&[
        "serve",
        "--rules",
        missing.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    let stderr = common::cli::fails(&o);
    assert!(stderr.starts_with("Error: tollgate could not start"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_and_refuses_new_ones() {
    // Four shards, four listeners on one address: the address refuses connections once the
    // line says it stopped accepting, not once its first listener did.
    let mut gw = Tollgate::spawn(&["demo", "--drain-timeout", "10s", "--threads", "4"]);
    let url = gw.url("/v1/slow?ms=800");
    let slow = tokio::spawn(async move { Http::new().get(&url, &[("x-api-key", K8)]).await });
    // Signal only once the slow request is in flight.
    let http = Http::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = http.get(&gw.admin_url("/metrics"), &[]).await;
        if value(&String::from_utf8_lossy(&m.body), "tollgate_in_flight_requests") == Some(1.0) {
            break;
        }
        assert!(Instant::now() < deadline, "the slow request never got in flight");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gw.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    // The gateway's own listener, not the admin's, which may stop first.
    let stopped = |log: &str| {
        log.lines()
            .any(|l| l.contains("stopped accepting") && l.contains(&gw.addr.to_string()))
    };
    while !stopped(&gw.stderr()) {
        assert!(Instant::now() < deadline, "{}", gw.stderr());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        std::net::TcpStream::connect(gw.addr).is_err(),
        "a new connection was accepted after SIGTERM"
    );
    let a = slow.await.unwrap();
    assert_eq!(a.status, StatusCode::OK, "the in-flight request did not complete");
    assert_eq!(a.json()["path"], "/v1/slow");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the process did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "exit status {status:?}: {}", gw.stderr());
    let lines = gw
        .stderr()
        .lines()
        .filter(|l| l.contains("stopped accepting") && l.contains(&gw.addr.to_string()))
        .count();
    assert_eq!(lines, 1, "one line for the address: {}", gw.stderr());
}

/// A request whose client goes away mid-request is still counted and logged once, on both
/// paths; hyper's path, which learns of it at once, records nginx's 499.
#[tokio::test]
async fn a_client_gone_mid_request_is_recorded_once() {
    use tokio::io::AsyncWriteExt;
    for express in [true, false] {
        let mut args = vec!["demo"];
        if !express {
            args.push("--no-express");
        }
        let gw = Tollgate::spawn(&args);
        let http = Http::new();
        let metrics = || async {
            String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned()
        };
        let mut c = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        c.write_all(b"GET /v1/slow?ms=1500 HTTP/1.1\r\nHost: t\r\nX-API-Key: k8-demo-key\r\n\r\n")
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while value(&metrics().await, "tollgate_in_flight_requests") != Some(1.0) {
            assert!(Instant::now() < deadline, "the slow request never got in flight");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(5);
        let m = loop {
            let m = metrics().await;
            if value(&m, "tollgate_in_flight_requests") == Some(0.0) {
                break m;
            }
            assert!(Instant::now() < deadline, "the request never ended");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let recorded: f64 = m
            .lines()
            .filter(|l| l.starts_with("tollgate_requests_total{") && l.contains("route=\"v1\""))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum();
        assert_eq!(recorded, 1.0, "express {express}: {m}");
        if !express {
            assert_eq!(
                value(&m, r#"tollgate_requests_total{route="v1",status="499"}"#),
                Some(1.0),
                "{m}"
            );
            let log = gw
                .stderr_when(|l| l.contains("status=499") || l.contains("\"status\":499"))
                .await;
            assert!(
                log.contains("status=499") || log.contains("\"status\":499"),
                "{log}"
            );
        }
    }
}

/// The access log's writer falls behind (nobody reads the gateway's stderr, so the pipe fills
/// and the writer blocks on it): requests are still answered, the lines that don't fit the
/// buffer are dropped and counted, and at exit every line is either written or counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_access_log_never_holds_up_a_request_and_loses_nothing_uncounted() {
    let mut gw = Tollgate::spawn_with_stderr(
        &["demo", "--log-format", "json", "--access-log-buffer", "50"],
        &[],
        Some(std::process::Stdio::piped()),
    );
    let mut pipe = gw.child.stderr.take().expect("stderr is a pipe");
    let http = Http::new();
    // About 300 bytes a line: 2,000 lines are far more than the pipe (64 KiB), the writer's
    // own buffer (64 KiB) and 50 waiting lines hold.
    let sent = 2000u64;
    for _ in 0..sent {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        assert!(
            r.status == StatusCode::OK || r.status == StatusCode::TOO_MANY_REQUESTS,
            "{}",
            r.status
        );
    }
    let metrics = String::from_utf8_lossy(&http.get(&gw.admin_url("/metrics"), &[]).await.body).into_owned();
    let dropped = value(&metrics, "tollgate_access_lines_dropped_total")
        .expect("the dropped-lines counter is exported") as u64;
    assert!(
        dropped > 0 && dropped < sent,
        "a stalled writer drops some lines, not all: {dropped} of {sent}"
    );

    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut out).unwrap();
        out
    });
    gw.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    while gw.child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "tollgate still runs 30 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = reader.join().unwrap();
    let written = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "tollgate::access" && v["route"] == "orders")
        .count() as u64;
    assert_eq!(
        written + dropped,
        sent,
        "every access line is written or counted: {written} written, {dropped} dropped"
    );
}
