//! The client fingerprint dimension in real gateway processes: credential stuffing scaled
//! down (many addresses from many addresses, each under every per-address and
//! per-account limit, all from one TLS client configuration), one configuration naming one
//! fingerprint across connections and another naming another (access lines and Redis bucket
//! names), a hello the reader can't follow still served, and plain TCP's `none` alike on the
//! express lane and on hyper's path.

mod common;

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Http, RedisServer, Tollgate, repo, rules_file};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

/// The demo rules with the login guarded three ways: per account and per address (the limits
/// credential stuffing stays under), and per client fingerprint, `clients_per_hour` an hour. A slow
/// refill, so counts in a test are exact.
fn rules(clients_per_hour: u64) -> String {
    let text = common::demo_json();
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    let limits = rules["limits"].as_object_mut().unwrap();
    limits.insert(
        "login-ip".into(),
        serde_json::json!({"dimension": "ip", "rate": "5/60s", "burst": 5, "class": "security"}),
    );
    limits.insert(
        "clients".into(),
        serde_json::json!({
            "dimension": "fingerprint",
            "rate": format!("{clients_per_hour}/1h"),
            "burst": clients_per_hour,
            "class": "security"
        }),
    );
    let routes = rules["routes"].as_array_mut().unwrap();
    let login = routes.iter_mut().find(|r| r["name"] == "login").unwrap();
    login["cost"] = serde_json::json!({"login": 1, "login-ip": 1, "clients": 1});
    routes.push(serde_json::json!({
        "name": "open", "method": "GET", "path": "/open", "upstream": "orders", "key": "optional",
        "cost": {"clients": 1}
    }));
    // Every attempt comes from its own address; the per-address login limit stands for it.
    rules.as_object_mut().unwrap().remove("unauthenticated");
    rules.to_string()
}

fn tls_gateway(rules_path: &str, extra: &[&str]) -> Tollgate {
    let cert = repo().join("certs/demo-cert.pem");
    let key = repo().join("certs/demo-key.pem");
    let mut args = vec![
        "demo",
        "--rules",
        rules_path,
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--log-format",
        "json",
    ];
    args.extend_from_slice(extra);
    Tollgate::spawn(&args)
}

/// A client configuration: what a client library's ClientHello is made of.
fn client(
    versions: &[&'static rustls::SupportedProtocolVersion],
    suites: Option<&[rustls::SupportedCipherSuite]>,
    alpn: &[&[u8]],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(repo().join("certs/demo-cert.pem")).unwrap())
        .unwrap();
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    if let Some(s) = suites {
        provider.cipher_suites = s.to_vec();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

const BOTH: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13, &rustls::version::TLS12];

/// The attacker's one tool: rustls' defaults, HTTP/1.1.
fn attacker() -> Arc<rustls::ClientConfig> {
    client(BOTH, None, &[b"http/1.1"])
}

/// Honest clients, each another library or build: TLS 1.2 only, other cipher suites, no ALPN.
fn honest() -> Vec<(&'static str, Arc<rustls::ClientConfig>)> {
    use rustls::crypto::aws_lc_rs::cipher_suite as cs;
    vec![
        (
            "TLS 1.2 only",
            client(&[&rustls::version::TLS12], None, &[b"http/1.1"]),
        ),
        (
            "two cipher suites",
            client(
                BOTH,
                Some(&[
                    cs::TLS13_AES_128_GCM_SHA256,
                    cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
                ]),
                &[b"http/1.1"],
            ),
        ),
        ("no ALPN", client(BOTH, None, &[])),
    ]
}

/// One request on a new TLS connection from the address `from`.
async fn over_tls(
    gw: SocketAddr,
    from: Ipv4Addr,
    cfg: &Arc<rustls::ClientConfig>,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, serde_json::Value) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(IpAddr::V4(from), 0))
        .unwrap_or_else(|e| panic!("bind {from}: {e}"));
    let tcp = socket.connect(gw).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(cfg.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the demo certificate");
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = send
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&body)));
    (status, json)
}

async fn login(
    gw: &Tollgate,
    from: Ipv4Addr,
    cfg: &Arc<rustls::ClientConfig>,
    account: &str,
    status: u16,
) -> (StatusCode, serde_json::Value) {
    over_tls(
        gw.addr,
        from,
        cfg,
        Method::POST,
        &format!("/login?status={status}"),
        &[("x-account", account), ("content-length", "0")],
    )
    .await
}

/// The access lines written so far, by request id: (fingerprint, status).
fn access_lines(gw: &Tollgate) -> HashMap<String, (String, u64)> {
    gw.stderr()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "tollgate::access")
        .map(|v| {
            let fp = v["fingerprint"]
                .as_str()
                .unwrap_or_else(|| panic!("access line without a fingerprint: {v}"));
            (
                v["request_id"].as_str().unwrap().to_string(),
                (fp.to_string(), v["status"].as_u64().unwrap()),
            )
        })
        .collect()
}

/// Waits for the access lines of `ids` (a line is written as its request ends).
async fn fingerprints_of(gw: &Tollgate, ids: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = access_lines(gw);
        if ids.iter().all(|id| lines.contains_key(*id)) {
            return ids.iter().map(|id| lines[*id].0.clone()).collect();
        }
        assert!(
            Instant::now() < deadline,
            "no access lines for {ids:?}:\n{}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn is_hex_fingerprint(s: &str) -> bool {
    s.len() == 16
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Credential stuffing, scaled down: 40 addresses, one attempt each with a different leaked account,
/// every one under the per-address and per-account limits, all from one client
/// configuration. The fingerprint limit (20) lets 20 through to the upstream's 401 and refuses
/// the rest; honest logins from other configurations still pass, while the attacker's
/// configuration stays refused from any new address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_stuffing_from_many_addresses_is_counted_on_its_one_client() {
    let (_dir, path) = rules_file(&rules(20));
    let gw = tls_gateway(path.to_str().unwrap(), &[]);
    let tool = attacker();
    let mut reached = 0;
    let mut refused = 0;
    for i in 0..40u8 {
        let from = Ipv4Addr::new(127, 0, 1, 10 + i);
        let (status, body) = login(&gw, from, &tool, &format!("victim-{i}@example.com"), 401).await;
        match status {
            StatusCode::UNAUTHORIZED => reached += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(
                    body["limit"], "clients",
                    "attempt {i}: refused by the fingerprint: {body}"
                );
                refused += 1;
            }
            other => panic!("attempt {i}: {other} {body}"),
        }
    }
    assert_eq!(
        (reached, refused),
        (20, 20),
        "the fingerprint limit counts every address together"
    );

    for (n, (what, cfg)) in honest().iter().enumerate() {
        for j in 0..3u8 {
            let from = Ipv4Addr::new(127, 0, 2, 10 * n as u8 + j + 1);
            let (status, body) = login(&gw, from, cfg, &format!("user-{n}-{j}"), 200).await;
            assert_eq!(status, StatusCode::OK, "{what}, login {j}: {body}");
        }
    }
    // The attacker's library from a fresh address and account is still refused.
    let (status, body) = login(&gw, Ipv4Addr::new(127, 0, 3, 1), &tool, "fresh@example.com", 200).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
}

/// One configuration names one fingerprint over two connections (the second resumes the
/// first's session); other configurations name others. The access line and the Redis bucket
/// say the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_configuration_is_one_fingerprint_and_others_differ() {
    let redis = RedisServer::start();
    let (_dir, path) = rules_file(&rules(1000));
    let url = redis.url();
    let gw = tls_gateway(path.to_str().unwrap(), &["--store", &url]);
    let mut configs = vec![("attacker", attacker())];
    configs.extend(honest());
    let mut ids = Vec::new();
    for (name, cfg) in &configs {
        for conn in 0..2 {
            let id = format!("{}-{conn}", name.replace(' ', "-"));
            let (status, body) = over_tls(
                gw.addr,
                Ipv4Addr::LOCALHOST,
                cfg,
                Method::GET,
                "/open",
                &[("x-request-id", &id)],
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{name}: {body}");
            ids.push(id);
        }
    }
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let fps = fingerprints_of(&gw, &ids).await;
    for (i, (name, _)) in configs.iter().enumerate() {
        let (a, b) = (&fps[2 * i], &fps[2 * i + 1]);
        assert!(is_hex_fingerprint(a), "{name}: {a}");
        assert_eq!(a, b, "{name}: two connections, one fingerprint");
        for (other, _) in &configs[i + 1..] {
            let j = configs.iter().position(|(n, _)| n == other).unwrap();
            assert_ne!(a, &fps[2 * j], "{name} and {other}");
        }
    }
    let buckets = redis.bucket_names("rl:{fp:");
    let mut expected: Vec<String> = fps
        .iter()
        .step_by(2)
        .map(|fp| format!("rl:{{fp:{fp}}}:clients"))
        .collect();
    expected.sort();
    assert_eq!(buckets, expected, "one bucket per configuration, named as logged");
}

/// A ClientHello split over more records than the reader follows: the fingerprint is
/// `unparsed`, and rustls, which joins any number, completes the handshake as before.
#[test]
fn a_hello_the_reader_cannot_follow_is_unparsed_and_still_served() {
    let (_dir, path) = rules_file(&rules(1000));
    let gw = tls_gateway(path.to_str().unwrap(), &[]);
    let mut conn =
        rustls::ClientConnection::new(attacker(), ServerName::try_from("localhost").unwrap()).unwrap();
    let mut first = Vec::new();
    conn.write_tls(&mut first).unwrap();
    // Records: 5-byte header, then the payload; resend the hello in 30 records.
    assert_eq!(first[0], 22, "the first flight is a handshake record");
    let len = u16::from_be_bytes([first[3], first[4]]) as usize;
    let hello = &first[5..5 + len];
    let mut split = Vec::new();
    let chunks = hello.chunks(hello.len().div_ceil(30));
    assert!(
        chunks.len() > tollgate_hello::parse::MAX_RECORDS,
        "more records than the reader's bound"
    );
    for chunk in chunks {
        split.extend_from_slice(&[22, 3, 1]);
        split.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        split.extend_from_slice(chunk);
    }
    split.extend_from_slice(&first[5 + len..]);
    let mut tcp = std::net::TcpStream::connect(gw.addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.write_all(&split).unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
    tls.write_all(
        b"GET /open HTTP/1.1\r\nhost: localhost\r\nx-request-id: split-hello\r\nconnection: close\r\n\r\n",
    )
    .unwrap();
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((fp, status)) = access_lines(&gw).get("split-hello") {
            assert_eq!((fp.as_str(), *status), ("unparsed", 200));
            break;
        }
        assert!(Instant::now() < deadline, "{}", gw.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Plain TCP is `none` on both paths: the express lane and hyper's path name the same bucket
/// (one count across both gateways on one store) and log the same fingerprint, and the
/// gateway says at start that a fingerprint limit without TLS is one bucket for all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tcp_is_none_on_the_express_lane_and_on_hyper_path() {
    let redis = RedisServer::start();
    let (_dir, path) = rules_file(&rules(3));
    let path = path.to_str().unwrap();
    let url = redis.url();
    // One bucket across both gateways is what this checks: a 3 ms store timeout on a loaded
    // host would let a gateway's local share decide instead.
    let common = [
        "demo",
        "--rules",
        path,
        "--store",
        &url,
        "--store-timeout",
        "1s",
        "--log-format",
        "json",
    ];
    let lane = Tollgate::spawn(&common);
    let mut no_lane_args = common.to_vec();
    no_lane_args.push("--no-express");
    let hyper_path = Tollgate::spawn(&no_lane_args);
    let http = Http::new();
    let open = |gw: &Tollgate, id: &str| {
        let (url, id) = (gw.url("/open"), id.to_string());
        let http = http.clone();
        async move { http.get(&url, &[("x-request-id", &id)]).await.status }
    };
    assert_eq!(open(&lane, "lane-1").await, StatusCode::OK);
    assert_eq!(open(&hyper_path, "hyper-1").await, StatusCode::OK);
    assert_eq!(open(&lane, "lane-2").await, StatusCode::OK);
    assert_eq!(
        open(&hyper_path, "hyper-2").await,
        StatusCode::TOO_MANY_REQUESTS,
        "both paths pay one bucket"
    );
    assert_eq!(open(&lane, "lane-3").await, StatusCode::TOO_MANY_REQUESTS);
    for (gw, ids) in [
        (&lane, &["lane-1", "lane-2", "lane-3"][..]),
        (&hyper_path, &["hyper-1", "hyper-2"][..]),
    ] {
        assert!(fingerprints_of(gw, ids).await.iter().all(|f| f == "none"));
        assert!(
            gw.stderr().contains("a fingerprint limit without --tls-cert"),
            "{}",
            gw.stderr()
        );
    }
    assert_eq!(redis.bucket_names("rl:{fp:"), ["rl:{fp:none}:clients"]);
}
