//! `--access-log-format json|combined`: a real gateway process, real requests on the express
//! lane, on hyper's path (`--no-express`) and over TLS with HTTP/2, and each line read back
//! field by field against what was sent and answered.

mod common;

use std::collections::HashMap;

use bytes::Bytes;
use common::{Http, K7, K8, Tollgate, repo};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A zone with a half-hour offset, so the line's offset can only be right if it was read.
const ZONE: &str = "Asia/Kolkata";
const UA: &str = "probe \"quoted\" \\ agent/1.0";
const REFERER: &str = "https://ref.example/page?x=1&y=\"2\"";

/// How requests reach the gateway.
enum Client {
    Plain(Box<Http>, std::net::SocketAddr),
    /// The connection's task too: the test's runtime blocks while the gateway stops, so the
    /// task could not answer its GOAWAY; it is ended first.
    H2(
        hyper::client::conn::http2::SendRequest<Full<Bytes>>,
        tokio::task::JoinHandle<()>,
    ),
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Client::H2(_, conn) = self {
            conn.abort();
        }
    }
}

impl Client {
    async fn h2(gw: &Tollgate) -> Client {
        let tls = common::tls::connect(gw.addr, &[b"h2"]).await;
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        Client::H2(send, conn)
    }

    /// One request; the status and the body's length as received.
    async fn send(
        &mut self,
        method: Method,
        target: &str,
        headers: &[(&str, &str)],
        body: &'static [u8],
    ) -> (StatusCode, usize) {
        match self {
            Client::Plain(http, addr) => {
                let a = http
                    .send(method, &format!("http://{addr}{target}"), headers, body)
                    .await;
                (a.status, a.body.len())
            }
            Client::H2(send, _) => {
                let mut req = Request::builder()
                    .method(method)
                    .uri(format!("https://localhost{target}"));
                for (k, v) in headers {
                    req = req.header(*k, *v);
                }
                send.ready().await.unwrap();
                let resp = send
                    .send_request(req.body(Full::new(Bytes::from_static(body))).unwrap())
                    .await
                    .unwrap();
                let status = resp.status();
                let body = resp.into_body().collect().await.unwrap().to_bytes();
                (status, body.len())
            }
        }
    }
}

/// What one request sent and got.
#[derive(Debug)]
struct Sent {
    method: Method,
    target: String,
    status: u16,
    body: usize,
    user_agent: Option<&'static str>,
    referer: Option<&'static str>,
    key: Option<&'static str>,
    route: Option<&'static str>,
    limit: Option<&'static str>,
    client_ip: Option<&'static str>,
}

/// The requests every run makes, by request id: a query string, a user agent with a quote and
/// a backslash, a referer, `HEAD`, a 404, 401s up to the 429 of the IP's bucket, a body on
/// hyper's path and its 429, and a client behind a trusted proxy.
async fn exercise(client: &mut Client) -> HashMap<String, Sent> {
    let mut sent = HashMap::new();
    let mut one = async |id: &str,
                         method: Method,
                         target: &str,
                         headers: &[(&str, &str)],
                         body: &'static [u8]|
           -> u16 {
        let mut all = vec![("x-request-id", id), ("user-agent", UA)];
        all.extend_from_slice(headers);
        let (status, len) = client.send(method.clone(), target, &all, body).await;
        let referer = headers.iter().find(|h| h.0 == "referer").map(|_| REFERER);
        let key = headers
            .iter()
            .find(|h| h.0 == "x-api-key")
            .map(|h| if h.1 == K7 { "k-7" } else { "k-8" });
        sent.insert(
            id.to_string(),
            Sent {
                method,
                target: target.to_string(),
                status: status.as_u16(),
                body: len,
                user_agent: Some(UA),
                referer,
                key,
                route: None,
                limit: None,
                client_ip: None,
            },
        );
        status.as_u16()
    };
    let target = "/v1/orders?page=2&q=a%20b";
    let s = one(
        "al-ok",
        Method::GET,
        target,
        &[("x-api-key", K7), ("referer", REFERER)],
        b"",
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        one("al-head", Method::HEAD, "/v1/orders", &[("x-api-key", K7)], b"").await,
        200
    );
    assert_eq!(
        one("al-404", Method::GET, "/nowhere?x=1", &[("x-api-key", K7)], b"").await,
        404
    );
    let xff = [("x-api-key", K7), ("x-forwarded-for", "203.0.113.7")];
    assert_eq!(one("al-xff", Method::GET, "/v1/orders", &xff, b"").await, 200);
    // The IP's bucket without a key: a burst of 5, then 429 (a refill may admit one more).
    let mut refused = None;
    for n in 0..12 {
        let id = format!("al-unauth-{n}");
        match one(&id, Method::GET, "/v1/orders", &[], b"").await {
            401 => {}
            429 => {
                refused = Some(id);
                break;
            }
            s => panic!("{id}: {s}"),
        }
    }
    let refused = refused.expect("no 429 for the IP's bucket in 12 requests");
    // A body takes hyper's path even where the lane runs; one export per 5 s.
    let exports = [("x-api-key", K8), ("content-type", "application/json")];
    assert_eq!(
        one("al-export-1", Method::POST, "/v1/exports", &exports, b"{}").await,
        200
    );
    assert_eq!(
        one("al-export-2", Method::POST, "/v1/exports", &exports, b"{}").await,
        429
    );

    for (id, s) in sent.iter_mut() {
        s.route = match id.as_str() {
            "al-404" => None,
            // `orders` is GET only; the catch-all takes HEAD.
            "al-head" => Some("v1"),
            "al-export-1" | "al-export-2" => Some("exports"),
            _ => Some("orders"),
        };
        s.limit = match id.as_str() {
            "al-export-2" => Some("exports"),
            i if *i == refused => Some("unauth"),
            _ => s.limit,
        };
        s.client_ip = (id == "al-xff").then_some("203.0.113.7");
        // No route: the key is never looked at.
        if id == "al-404" {
            s.key = None;
        }
    }
    sent
}

/// `\xHH` back to bytes.
fn unescape(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            assert!(b.get(i + 1) == Some(&b'x'), "a backslash not escaped: {v}");
            out.push(u8::from_str_radix(&v[i + 2..i + 4], 16).unwrap());
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// A combined line in its fields: the nine of nginx's, then Tollgate's `name=value`s in order.
/// Panics on anything else.
fn combined_fields(line: &str) -> (Vec<String>, Vec<(String, String)>) {
    let mut fields = Vec::new();
    let mut rest = line;
    while !rest.is_empty() {
        let (field, after) = match rest.as_bytes()[0] {
            b'[' => {
                let end = rest.find(']').unwrap_or_else(|| panic!("no ]: {line}"));
                (&rest[1..end], &rest[end + 1..])
            }
            _ => {
                // Up to a space outside quotes: a quoted value holds no raw quote.
                let mut quoted = false;
                let end = rest
                    .char_indices()
                    .find(|&(_, c)| {
                        if c == '"' {
                            quoted = !quoted;
                        }
                        c == ' ' && !quoted
                    })
                    .map_or(rest.len(), |(i, _)| i);
                assert!(!quoted, "an unclosed quote: {line}");
                (&rest[..end], &rest[end..])
            }
        };
        fields.push(field.to_string());
        rest = after.strip_prefix(' ').unwrap_or(after);
        assert!(!after.starts_with("  "), "two spaces: {line}");
    }
    assert!(fields.len() == 22, "{} fields: {line}", fields.len());
    let extras = fields.split_off(9);
    let extras = extras
        .iter()
        .map(|f| {
            let (k, v) = f
                .split_once('=')
                .unwrap_or_else(|| panic!("not name=value: {f} in {line}"));
            (k.to_string(), v.to_string())
        })
        .collect();
    (fields, extras)
}

fn unquote(v: &str) -> Option<String> {
    let inner = v
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or_else(|| panic!("not quoted: {v}"));
    (inner != "-").then(|| unescape(inner))
}

fn dash(v: &str) -> Option<String> {
    (v != "-").then(|| unescape(v))
}

/// One access line as the values the test compares, from either format.
#[derive(Debug, PartialEq)]
struct Line {
    remote_addr: String,
    remote_user: Option<String>,
    time: jiff::Zoned,
    method: String,
    target: String,
    protocol: String,
    status: u16,
    body: Option<u64>,
    referer: Option<String>,
    user_agent: Option<String>,
    request_id: String,
    route: Option<String>,
    limit: Option<String>,
    client_ip: Option<String>,
    fingerprint: String,
    latency_us: u64,
    check_us: Option<u64>,
    path: Option<String>,
    instance: String,
    rules_version: u64,
    cost_reported: Option<u64>,
    /// The upstream target that answered, `host:port` (the line's `target`).
    upstream: Option<String>,
    attempts: u64,
}

fn parse_combined(line: &str) -> Line {
    let (f, extras) = combined_fields(line);
    assert_eq!(f[1], "-", "$ident: {line}");
    let names: Vec<&str> = extras.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "request_id",
            "route",
            "limit",
            "client_ip",
            "fingerprint",
            "latency_us",
            "check_us",
            "path",
            "instance",
            "rules_version",
            "cost_reported",
            "target",
            "attempts"
        ],
        "{line}"
    );
    let request = unquote(&f[4]).unwrap();
    let mut parts = request.splitn(3, ' ');
    let (method, target, protocol) = (
        parts.next().unwrap().to_string(),
        parts.next().unwrap().to_string(),
        parts.next().unwrap().to_string(),
    );
    Line {
        remote_addr: f[0].clone(),
        remote_user: dash(&f[2]),
        time: jiff::Zoned::strptime("%d/%b/%Y:%H:%M:%S %z", &f[3])
            .unwrap_or_else(|e| panic!("$time_local {}: {e}", f[3])),
        method,
        target,
        protocol,
        status: f[5].parse().unwrap(),
        body: dash(&f[6]).map(|b| b.parse().unwrap()),
        referer: unquote(&f[7]),
        user_agent: unquote(&f[8]),
        request_id: extras[0].1.clone(),
        route: unquote(&extras[1].1),
        limit: unquote(&extras[2].1),
        client_ip: dash(&extras[3].1),
        fingerprint: extras[4].1.clone(),
        latency_us: extras[5].1.parse().unwrap(),
        check_us: dash(&extras[6].1).map(|t| t.parse().unwrap()),
        path: unquote(&extras[7].1),
        instance: unescape(&extras[8].1),
        rules_version: extras[9].1.parse().unwrap(),
        cost_reported: dash(&extras[10].1).map(|n| n.parse().unwrap()),
        upstream: dash(&extras[11].1),
        attempts: extras[12].1.parse().unwrap(),
    }
}

fn parse_json(v: &serde_json::Value) -> Line {
    let s = |k: &str| v[k].as_str().map(String::from);
    let names: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(names.len(), 23, "{v}");
    Line {
        remote_addr: s("remote_addr").unwrap(),
        remote_user: s("remote_user"),
        time: jiff::Zoned::strptime("%Y-%m-%dT%H:%M:%S%.f%:z", s("time").unwrap())
            .unwrap_or_else(|e| panic!("time: {e}: {v}")),
        method: s("request_method").unwrap(),
        target: s("request_uri").unwrap(),
        protocol: s("server_protocol").unwrap(),
        status: v["status"].as_u64().unwrap() as u16,
        body: v["body_bytes_sent"].as_u64(),
        referer: s("http_referer"),
        user_agent: s("http_user_agent"),
        request_id: s("request_id").unwrap(),
        route: s("route"),
        limit: s("limit"),
        client_ip: s("client_ip"),
        fingerprint: s("fingerprint").unwrap(),
        latency_us: v["latency_us"].as_u64().unwrap(),
        check_us: v["check_us"].as_u64(),
        path: s("path"),
        instance: s("instance").unwrap(),
        rules_version: v["rules_version"].as_u64().unwrap(),
        cost_reported: v["cost_reported"].as_u64(),
        upstream: s("target"),
        attempts: v["attempts"].as_u64().unwrap(),
    }
}

/// The access lines of a stopped gateway's stderr. Its other logs are JSON events (with a
/// `level`); every other line must be an access line, and parse.
fn access_lines(format: &str, stderr: &str) -> Vec<Line> {
    let mut lines = Vec::new();
    for l in stderr.lines() {
        let v = serde_json::from_str::<serde_json::Value>(l).ok();
        match (format, v) {
            (_, Some(v)) if v.get("level").is_some() => {
                assert_ne!(v["target"], "tollgate::access", "an access line as an event: {l}")
            }
            ("json", Some(v)) => lines.push(parse_json(&v)),
            ("combined", None) => lines.push(parse_combined(l)),
            _ => panic!("neither a log event nor a {format} access line: {l}"),
        }
    }
    lines
}

/// Runs every request against a gateway started with `args` and checks its lines.
async fn check(format: &str, extra: &[&str], h2: bool, protocol: &str) {
    let mut args = vec![
        "demo",
        "--access-log-format",
        format,
        "--log-format",
        "json",
        "--trusted-proxy",
        "127.0.0.1/32",
        "--instance",
        "access-test-gw",
    ];
    args.extend_from_slice(extra);
    let mut gw = Tollgate::spawn_with_env(&args, &[("TZ", ZONE)]);
    let mut client = if h2 {
        Client::h2(&gw).await
    } else {
        Client::Plain(Box::default(), gw.addr)
    };
    let sent = exercise(&mut client).await;
    drop(client);
    tokio::task::yield_now().await;
    // The last lines are written at exit.
    let (_, stderr) = gw.stop();
    for secret in [K7, K8, "Bearer"] {
        assert!(!stderr.contains(secret), "a secret in the log:\n{stderr}");
    }
    let lines = access_lines(format, &stderr);
    let mut by_id: HashMap<&str, &Line> = HashMap::new();
    for l in &lines {
        assert!(
            by_id.insert(&l.request_id, l).is_none(),
            "two lines for {}",
            l.request_id
        );
    }
    assert_eq!(lines.len(), sent.len(), "one line per request:\n{stderr}");
    let now = jiff::Timestamp::now();
    for (id, s) in &sent {
        let l = by_id
            .get(id.as_str())
            .unwrap_or_else(|| panic!("no line for {id}:\n{stderr}"));
        let want = Line {
            remote_addr: "127.0.0.1".into(),
            remote_user: s.key.map(String::from),
            time: l.time.clone(),
            method: s.method.to_string(),
            target: s.target.clone(),
            protocol: protocol.into(),
            status: s.status,
            body: Some(s.body as u64),
            referer: s.referer.map(String::from),
            user_agent: s.user_agent.map(String::from),
            request_id: id.clone(),
            route: s.route.map(String::from),
            limit: l.limit.clone(),
            client_ip: s.client_ip.map(String::from),
            fingerprint: l.fingerprint.clone(),
            latency_us: l.latency_us,
            check_us: l.check_us,
            // The path it was routed on: these targets are canonical already.
            path: s.route.map(|_| s.target.clone()),
            instance: "access-test-gw".into(),
            rules_version: 1,
            cost_reported: None,
            // The demo's one upstream answered every 200, at the first attempt; nothing else
            // went upstream.
            upstream: l.upstream.clone().filter(|_| s.status == 200),
            attempts: u64::from(s.status == 200),
        };
        assert_eq!(**l, want, "{id}");
        if s.status == 200 {
            let t = l.upstream.as_deref().unwrap_or_else(|| panic!("{id}: no target"));
            t.parse::<std::net::SocketAddr>()
                .unwrap_or_else(|e| panic!("{id}: target {t}: {e}"));
        }
        if let Some(limit) = s.limit {
            assert_eq!(l.limit.as_deref(), Some(limit), "{id}");
        }
        // Every routed request met the limiter, at a time of this run (µs since the epoch);
        // one with no route did not.
        match (s.route, l.check_us) {
            (Some(_), Some(t)) => {
                let off = (now.as_microsecond() - t as i64).abs();
                assert!(off < 600_000_000, "{id}: check_us {t} is not now ({now})");
            }
            (None, None) => {}
            (route, check) => panic!("{id}: route {route:?} but check_us {check:?}"),
        }
        // In the zone the process was given, and about now (the run takes seconds).
        assert_eq!(l.time.offset().seconds(), 5 * 3600 + 1800, "{id}: {}", l.time);
        let off = (now.as_second() - l.time.timestamp().as_second()).abs();
        assert!(off < 600, "{id}: {} is not now ({now})", l.time);
        assert_eq!(l.fingerprint == "none", !h2, "{id}: {}", l.fingerprint);
    }
}

#[tokio::test]
async fn combined_lines_on_the_express_lane() {
    check("combined", &[], false, "HTTP/1.1").await;
}

#[tokio::test]
async fn combined_lines_on_hypers_path() {
    check("combined", &["--no-express"], false, "HTTP/1.1").await;
}

#[tokio::test]
async fn json_lines_on_the_express_lane() {
    check("json", &[], false, "HTTP/1.1").await;
}

#[tokio::test]
async fn json_lines_on_hypers_path() {
    check("json", &["--no-express"], false, "HTTP/1.1").await;
}

#[tokio::test]
async fn combined_lines_over_tls_and_h2() {
    let cert = repo().join("certs/demo-cert.pem");
    let key = repo().join("certs/demo-key.pem");
    let tls = [
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ];
    check("combined", &tls, true, "HTTP/2.0").await;
}

#[test]
fn a_bad_format_is_refused_by_name() {
    let o = common::cli::tollgate(&["demo", "--access-log-format", "xml"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("invalid value 'xml' for '--access-log-format <ACCESS_LOG_FORMAT>'")
            && err.contains("json")
            && err.contains("combined"),
        "{err}"
    );
}

/// An upstream that answers every request with a chunked body of `CHUNKED_BODY`, in two
/// chunks, on a connection it keeps.
async fn chunked_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut piece = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\
                            transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
                        if tcp.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                    match tcp.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&piece[..n]),
                    }
                }
            });
        }
    });
    addr
}

const CHUNKED_BODY: &str = "hello world";

/// A chunked answer's bytes are counted as they are sent, without the chunk framing, on both
/// paths (hyper's writes the line when the body is done, not when its head goes out).
#[tokio::test]
async fn a_chunked_answer_is_counted_as_sent_on_both_paths() {
    let up = chunked_upstream().await;
    let (_dir, rules) = common::rules_file(&common::demo_rules_for(up));
    for extra in [&[][..], &["--no-express"][..]] {
        let mut args = vec![
            "serve",
            "--rules",
            rules.to_str().unwrap(),
            "--access-log-format",
            "json",
            "--log-format",
            "json",
        ];
        args.extend_from_slice(extra);
        let mut gw = Tollgate::spawn(&args);
        let http = Http::new();
        let headers = [("x-api-key", K7), ("x-request-id", "al-chunked")];
        let a = http.get(&gw.url("/v1/orders"), &headers).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.body, CHUNKED_BODY.as_bytes(), "{extra:?}");
        let (_, stderr) = gw.stop();
        let lines = access_lines("json", &stderr);
        assert_eq!(lines.len(), 1, "{extra:?}:\n{stderr}");
        assert_eq!(lines[0].request_id, "al-chunked");
        assert_eq!(lines[0].status, 200);
        assert_eq!(lines[0].body, Some(CHUNKED_BODY.len() as u64), "{extra:?}");
    }
}

/// One line's request id, status, `target` and `attempts`, in any of the three formats: the
/// `tollgate::access` event (`--log-format json`, where the target is `upstream_target`, `-`
/// when none), or a `json` or `combined` line.
fn tried(format: &str, stderr: &str) -> Vec<(String, u16, Option<String>, u64)> {
    if format != "event" {
        return access_lines(format, stderr)
            .into_iter()
            .map(|l| (l.request_id, l.status, l.upstream, l.attempts))
            .collect();
    }
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "tollgate::access")
        .map(|v| {
            let target = v["upstream_target"].as_str().unwrap_or_else(|| panic!("{v}"));
            (
                v["request_id"].as_str().unwrap().to_string(),
                v["status"].as_u64().unwrap() as u16,
                (target != "-").then(|| target.to_string()),
                v["attempts"].as_u64().unwrap_or_else(|| panic!("{v}")),
            )
        })
        .collect()
}

/// An upstream of three targets in turn (`round_robin`), one of which refuses connections: a
/// request sent first to that one is answered by another, and its line says 2 attempts and the
/// target that answered (the one whose name the answer carries); a request that went straight
/// to a live target says 1; one refused by a limit names no target and 0 attempts. In every
/// format, on both wires.
#[tokio::test]
async fn lines_name_the_target_that_answered_and_the_attempts() {
    let a = common::DemoUpstreamProc::spawn_with(&["--listen", "127.0.0.1:0", "--instance", "a"]);
    let b = common::DemoUpstreamProc::spawn_with(&["--listen", "127.0.0.1:0", "--instance", "b"]);
    // A port nothing listens on: bound, then let go.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(a.addr)).unwrap();
    let targets = [dead, a.addr, b.addr].map(|t| serde_json::json!({"url": format!("http://{t}")}));
    rules["upstreams"]["orders"] = serde_json::json!({"targets": targets, "balance": "round_robin"});
    let (_dir, path) = common::rules_file(&rules.to_string());
    let by_name = HashMap::from([("a", a.addr.to_string()), ("b", b.addr.to_string())]);
    for (format, wire) in [
        ("combined", None),
        ("json", Some("--no-express")),
        ("event", None),
        ("event", Some("--no-express")),
    ] {
        let mut args = vec!["serve", "--rules", path.to_str().unwrap(), "--store", "memory"];
        args.extend(["--log-format", "json"]);
        if format != "event" {
            args.extend(["--access-log-format", format]);
        }
        args.extend(wire);
        let mut gw = Tollgate::spawn(&args);
        let http = Http::new();
        // Six in turn over three targets: at least two go first to the dead one.
        let mut answered = HashMap::new();
        for n in 0..6 {
            let id = format!("at-{n}");
            let r = http
                .get(&gw.url("/v1/orders"), &[("x-api-key", K7), ("x-request-id", &id)])
                .await;
            assert_eq!(r.status, StatusCode::OK, "{format} {wire:?} {id}");
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            answered.insert(id, by_name[v["instance"].as_str().unwrap()].clone());
        }
        // The IP's bucket without a key: 401s, then a 429 that asks no upstream.
        let mut refused = None;
        for n in 0..12 {
            let id = format!("at-unauth-{n}");
            let r = http.get(&gw.url("/v1/orders"), &[("x-request-id", &id)]).await;
            if r.status == StatusCode::TOO_MANY_REQUESTS {
                refused = Some(id);
                break;
            }
        }
        let refused = refused.expect("no 429 for the IP's bucket in 12 requests");
        let (_, stderr) = gw.stop();
        let lines = tried(format, &stderr);
        let line = |id: &str| {
            lines
                .iter()
                .find(|l| l.0 == id)
                .unwrap_or_else(|| panic!("{format} {wire:?}: no line for {id}:\n{stderr}"))
        };
        let mut twice = 0;
        for (id, addr) in &answered {
            let (_, status, target, attempts) = line(id);
            assert_eq!(
                (*status, target.as_ref()),
                (200, Some(addr)),
                "{format} {wire:?} {id}"
            );
            assert!(matches!(attempts, 1 | 2), "{format} {wire:?} {id}: {attempts}");
            twice += usize::from(*attempts == 2);
        }
        assert!(
            (2..6).contains(&twice),
            "{format} {wire:?}: {twice} of 6 took two attempts:\n{stderr}"
        );
        let (_, status, target, attempts) = line(&refused);
        assert_eq!((*status, target, *attempts), (429, &None, 0), "{format} {wire:?}");
        // The 401s before it asked no upstream either.
        for (id, status, target, attempts) in lines.iter().filter(|l| l.0.starts_with("at-unauth-")) {
            assert_eq!(
                (target, *attempts),
                (&None, 0),
                "{format} {wire:?} {id} ({status})"
            );
        }
    }
}
