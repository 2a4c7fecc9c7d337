//! `https://` upstreams against real gateway processes on both HTTP/1 paths (the express lane,
//! and hyper's with `--no-express`): requests with and without a body and chunked answers go
//! through over TLS, kept connections carry the next requests, and an upstream whose
//! certificate does not check out is a 502, never a plain-text fallback. A reload onto a bad CA
//! file keeps the running rules; one with the same settings keeps the connections.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Http, Tollgate, raw};
use http::{Method, StatusCode};
use serde_json::{Value, json};
use tollgate_gateway::reload::Reload;

struct TlsUpstream {
    addr: SocketAddr,
    /// Connections whose handshake completed.
    connections: Arc<AtomicUsize>,
}

/// An upstream on the demo certificate, a thread per connection, that answers every request
/// with its method, target, body and the connection's number; under `/chunked/` the answer is
/// chunked.
fn tls_upstream() -> TlsUpstream {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let config = common::tls::server_config();
    std::thread::spawn(move || {
        for tcp in l.incoming() {
            let Ok(tcp) = tcp else { continue };
            let (config, counted) = (config.clone(), counted.clone());
            std::thread::spawn(move || {
                let _ = tcp.set_nodelay(true);
                let mut s = common::tls::accept(tcp, &config);
                if s.conn.complete_io(&mut s.sock).is_err() {
                    return;
                }
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                serve(s, n);
            });
        }
    });
    TlsUpstream { addr, connections }
}

fn serve(mut s: common::tls::Accepted, conn: usize) {
    let mut buf = Vec::new();
    loop {
        let head = loop {
            if let Some(head) = raw::take_head(&mut buf) {
                break head;
            }
            if !fill(&mut s, &mut buf) {
                return;
            }
        };
        let len = raw::content_length(&head).unwrap_or(0);
        while buf.len() < len {
            if !fill(&mut s, &mut buf) {
                return;
            }
        }
        let body: Vec<u8> = buf.drain(..len).collect();
        let head = String::from_utf8_lossy(&head).to_string();
        let mut words = head.split(' ');
        let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let text = format!(
            "{method} {target} conn={conn} body={}",
            String::from_utf8_lossy(&body)
        );
        let answer = if target.starts_with("/chunked/") {
            let mut a = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            for piece in [&text[..5], &text[5..]] {
                a.extend_from_slice(format!("{:x}\r\n{piece}\r\n", piece.len()).as_bytes());
            }
            a.extend_from_slice(b"0\r\n\r\n");
            a
        } else {
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{text}", text.len()).into_bytes()
        };
        if s.write_all(&answer).and_then(|()| s.flush()).is_err() {
            return;
        }
    }
}

fn fill(s: &mut common::tls::Accepted, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 4096];
    match s.read(&mut chunk) {
        Ok(n) if n > 0 => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
        _ => false,
    }
}

/// Rules with one upstream at `url` with `tls` (none: no block), routes for GET and POST.
fn rules(version: u64, url: &str, tls: Option<Value>) -> String {
    let mut up = json!({ "url": url, "timeout_ms": 5000 });
    if let Some(tls) = tls {
        up["tls"] = tls;
    }
    json!({
        "version": version,
        "upstreams": { "secure": up },
        "routes": [
            { "method": "GET", "path": "/", "upstream": "secure", "key": "optional" },
            { "method": "POST", "path": "/", "upstream": "secure", "key": "optional" }
        ]
    })
    .to_string()
}

fn mode(express: bool) -> &'static str {
    if express { "express lane" } else { "--no-express" }
}

/// A gateway process on `rules`, in a directory that holds the demo certificate as `ca.pem`
/// so the rules can name it relative to themselves.
fn gateway(rules: &str, express: bool) -> (Tollgate, tempfile::TempDir) {
    let (dir, path) = common::rules_file(rules);
    std::fs::copy(
        common::repo().join("certs/demo-cert.pem"),
        dir.path().join("ca.pem"),
    )
    .unwrap();
    let mut args = vec!["serve", "--rules", path.to_str().unwrap()];
    if !express {
        args.push("--no-express");
    }
    (Tollgate::spawn(&args), dir)
}

#[tokio::test]
async fn https_upstreams_answer_on_both_paths_over_kept_connections() {
    let http = Http::new();
    for express in [true, false] {
        let up = tls_upstream();
        let url = format!("https://{}", up.addr);
        let (gw, _dir) = gateway(&rules(1, &url, Some(json!({ "ca": "ca.pem" }))), express);
        let base = format!("http://{}", gw.addr);
        for n in 0..5 {
            let post: &'static [u8] = Box::leak(format!("payload {n}").into_bytes().into_boxed_slice());
            for (method, path, body, expected) in [
                (
                    Method::GET,
                    format!("/get/{n}"),
                    &b""[..],
                    format!("GET /get/{n} conn=1 body="),
                ),
                (
                    Method::POST,
                    format!("/post/{n}"),
                    post,
                    format!("POST /post/{n} conn=1 body=payload {n}"),
                ),
                (
                    Method::GET,
                    format!("/chunked/{n}"),
                    &b""[..],
                    format!("GET /chunked/{n} conn=1 body="),
                ),
            ] {
                let a = http.send(method, &format!("{base}{path}"), &[], body).await;
                assert_eq!(a.status, StatusCode::OK, "{}: {:?}", mode(express), a.body);
                assert_eq!(a.body, expected, "{}", mode(express));
                // Past the rest a kept connection takes before it carries another request.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(
            up.connections.load(Ordering::SeqCst),
            1,
            "{}: one kept TLS connection should carry every request",
            mode(express)
        );
    }
}

/// Each way a certificate fails to check out, on both paths: the request gets the gateway's
/// 502, and nothing reaches the upstream in plain text.
#[tokio::test]
async fn an_upstream_whose_certificate_does_not_check_out_is_a_502() {
    let http = Http::new();
    let up = tls_upstream();
    let ip = format!("https://{}", up.addr);
    let by_name = format!("https://localhost:{}", up.addr.port());
    let cases = [
        ("the built-in roots don't hold the demo certificate", &ip, None),
        (
            "the certificate does not carry the name",
            &ip,
            Some(json!({ "ca": "ca.pem", "server_name": "other.test" })),
        ),
    ];
    for express in [true, false] {
        for (why, url, tls) in &cases {
            let (gw, _dir) = gateway(&rules(1, url, tls.clone()), express);
            let a = http.get(&format!("http://{}/x", gw.addr), &[]).await;
            assert_eq!(
                a.status,
                StatusCode::BAD_GATEWAY,
                "{}, {why}: {:?}",
                mode(express),
                a.body
            );
            assert!(
                String::from_utf8_lossy(&a.body).contains("could not be reached"),
                "{}, {why}: {:?}",
                mode(express),
                a.body
            );
        }
        // A name the certificate does carry, set apart from the URL's host, and the host itself.
        for (url, tls) in [
            (&ip, json!({ "ca": "ca.pem", "server_name": "localhost" })),
            (&by_name, json!({ "ca": "ca.pem" })),
        ] {
            let (gw, _dir) = gateway(&rules(1, url, Some(tls.clone())), express);
            let a = http.get(&format!("http://{}/x", gw.addr), &[]).await;
            assert_eq!(
                a.status,
                StatusCode::OK,
                "{}, {url} {tls}: {:?}",
                mode(express),
                a.body
            );
        }
    }
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        4,
        "only the handshakes that checked out reached the upstream"
    );
}

/// Live rules: a reload onto a CA file that is not PEM fails and the running rules go on; one
/// with the same TLS settings keeps the kept connection; one with another name makes new ones.
#[tokio::test]
async fn reloads_check_tls_settings_and_keep_connections_that_stay_the_same() {
    let http = Http::new();
    let up = tls_upstream();
    let url = format!("https://{}", up.addr);
    let (gw, dir) = common::start_gateway(
        &rules(1, &url, Some(common::tls::demo_ca())),
        tollgate_limit::clock::ManualClock::new(0),
    )
    .await;
    let path = dir.path().join("rules.json");
    let get = async |n: u32| {
        let a = http.get(&format!("http://{}/r/{n}", gw.addr), &[]).await;
        assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
        tokio::time::sleep(Duration::from_millis(5)).await;
        String::from_utf8_lossy(&a.body).into_owned()
    };
    assert_eq!(get(1).await, "GET /r/1 conn=1 body=");

    std::fs::write(dir.path().join("bad.pem"), "not a certificate\n").unwrap();
    std::fs::write(&path, rules(2, &url, Some(json!({ "ca": "bad.pem" })))).unwrap();
    match gw.reloader.reload() {
        Reload::Failed(e) => {
            let e = e.to_string();
            assert!(
                e.contains("upstreams.secure.tls.ca: bad.pem: no CERTIFICATE block"),
                "{e}"
            );
        }
        other => panic!("a bad CA file was taken: {other:?}"),
    }
    assert_eq!(gw.rules.load().version, 1);
    assert_eq!(get(2).await, "GET /r/2 conn=1 body=", "the running rules changed");

    // The same CA by another path: the same settings.
    std::fs::copy(
        common::repo().join("certs/demo-cert.pem"),
        dir.path().join("ca.pem"),
    )
    .unwrap();
    std::fs::write(&path, rules(3, &url, Some(json!({ "ca": "ca.pem" })))).unwrap();
    assert!(matches!(gw.reloader.reload(), Reload::Swapped { to: 3, .. }));
    assert_eq!(
        get(3).await,
        "GET /r/3 conn=1 body=",
        "the kept connection was dropped"
    );

    let tls = json!({ "ca": "ca.pem", "server_name": "localhost" });
    std::fs::write(&path, rules(4, &url, Some(tls))).unwrap();
    assert!(matches!(gw.reloader.reload(), Reload::Swapped { to: 4, .. }));
    assert_eq!(
        get(4).await,
        "GET /r/4 conn=2 body=",
        "a connection made for the old name was kept"
    );
}
