//! An upstream that writes a second response nobody asked for, half a millisecond after a real
//! one, against real gateway processes on both HTTP/1 paths (the express lane, and hyper's with
//! `--no-express`), over plain HTTP and over TLS. Every answer names the request it answers, so
//! a client that gets another request's answer, or the stray, is seen at once.
//!
//! HTTP/1.1 ties a response to its request only by order on the connection: a stray read as
//! the next request's answer puts every later answer on that connection one behind.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Tollgate, raw};

/// How long after a real response the upstream writes the stray one.
const STRAY_AFTER: Duration = Duration::from_micros(500);

/// One test at a time: the stray's half millisecond is only kept when the upstream's thread
/// gets a core, and two tests' gateways at once on two cores starve it.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

struct StrayUpstream {
    addr: SocketAddr,
    strays: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Drop for StrayUpstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// An upstream on a thread per connection (so the stray's half millisecond is kept to the
/// microsecond, not a timer wheel's millisecond) that answers every request with its target
/// and, after every `every`th answer, writes a stray response; over TLS on the demo
/// certificate when `tls`, where the stray is a record of application data like any answer.
fn stray_upstream(every: usize, tls: bool) -> StrayUpstream {
    let config = common::tls::server_config();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let strays = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let (s2, stop2) = (strays.clone(), stop.clone());
    std::thread::spawn(move || {
        for conn in l.incoming() {
            if stop2.load(Ordering::SeqCst) {
                return;
            }
            let Ok(conn) = conn else { continue };
            let (strays, answered, config) = (s2.clone(), answered.clone(), config.clone());
            let _ = conn.set_nodelay(true);
            std::thread::spawn(move || {
                if tls {
                    serve(common::tls::accept(conn, &config), every, &strays, &answered)
                } else {
                    serve(conn, every, &strays, &answered)
                }
            });
        }
    });
    StrayUpstream { addr, strays, stop }
}

fn serve(mut s: impl Read + Write, every: usize, strays: &AtomicUsize, answered: &AtomicUsize) {
    let mut buf = Vec::new();
    loop {
        let head = loop {
            if let Some(head) = raw::take_head(&mut buf) {
                break String::from_utf8_lossy(&head).to_string();
            }
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk) {
                Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return,
            }
        };
        let target = head.split(' ').nth(1).unwrap_or("").to_string();
        let body = format!("answer to {target}");
        let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        if s.write_all(answer.as_bytes()).and_then(|()| s.flush()).is_err() {
            return;
        }
        if (answered.fetch_add(1, Ordering::SeqCst) + 1).is_multiple_of(every) {
            std::thread::sleep(STRAY_AFTER);
            let stray = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Stray: 1\r\n\r\nSTRAY";
            if s.write_all(stray.as_bytes()).and_then(|()| s.flush()).is_err() {
                return;
            }
            strays.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Waits (up to 5 s) until the upstream has written its `n`th stray, so the next request
/// follows it by the gap asked: on a loaded machine the upstream's thread may wake well after
/// its half millisecond, and a stray written after the next request went out is, on the wire,
/// that request's answer to any proxy.
fn wait_for_stray(up: &StrayUpstream, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.strays.load(Ordering::SeqCst) < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn gateway(up: SocketAddr, express: bool, tls: bool) -> (Tollgate, tempfile::TempDir) {
    let mut upstream = serde_json::json!({ "url": format!("http://{up}"), "timeout_ms": 5000 });
    if tls {
        upstream["url"] = format!("https://{up}").into();
        upstream["tls"] = common::tls::demo_ca();
    }
    let rules = serde_json::json!({
        "version": 1,
        "upstreams": { "stray": upstream },
        "routes": [ { "method": "GET", "path": "/", "upstream": "stray", "key": "optional" } ]
    });
    let (dir, path) = common::rules_file(&rules.to_string());
    let mut args = vec!["serve", "--rules", path.to_str().unwrap()];
    if !express {
        args.push("--no-express");
    }
    (Tollgate::spawn(&args), dir)
}

fn mode(express: bool, tls: bool) -> String {
    let path = if express { "express lane" } else { "--no-express" };
    if tls {
        format!("{path}, TLS")
    } else {
        path.to_string()
    }
}

/// `tollgate_upstream_strays_total` for the test's upstream, from the admin listener's
/// `/metrics`.
fn strays_counted(gw: &Tollgate) -> u64 {
    let admin = gw.admin.expect("admin listener");
    let mut c = Client::connect(admin);
    let (status, body) = c.get("/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "/metrics: {body}");
    let series = "tollgate_upstream_strays_total{upstream=\"stray\"} ";
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("/metrics has no {series:?}:\n{body}"))
}

/// A keep-alive client that reads each answer by its `Content-Length`.
struct Client {
    tcp: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_nodelay(true).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Client { tcp, buf: Vec::new() }
    }

    /// Sends `GET path` and returns the status line and the body.
    fn get(&mut self, path: &str) -> (String, String) {
        let req = format!("GET {path} HTTP/1.1\r\nHost: tollgate.test\r\n\r\n");
        self.tcp.write_all(req.as_bytes()).unwrap();
        let head = loop {
            if let Some(head) = raw::take_head(&mut self.buf) {
                break head;
            }
            self.fill(path);
        };
        let head = String::from_utf8_lossy(&head).to_string();
        let length = raw::content_length(head.as_bytes())
            .unwrap_or_else(|| panic!("{path}: no content-length in {head:?}"));
        while self.buf.len() < length {
            self.fill(path);
        }
        let body = String::from_utf8_lossy(&self.buf[..length]).to_string();
        self.buf.drain(..length);
        (head.lines().next().unwrap_or("").to_string(), body)
    }

    fn fill(&mut self, path: &str) {
        let mut chunk = [0u8; 4096];
        match self.tcp.read(&mut chunk) {
            Ok(n) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
            other => panic!("{path}: the gateway closed or failed: {other:?}"),
        }
    }
}

/// One client, one request at a time, the next request 2 to 40 ms after an answer: by then the
/// stray has landed on the kept upstream connection, and the check before reuse must find it in
/// the socket. A fresh gateway for each gap, since the first stray found makes the gateway stop
/// keeping that upstream's connections.
#[test]
fn a_stray_response_never_answers_a_later_request() {
    stray_never_answers(false);
}

/// The same over TLS: the stray is encrypted, so only the TLS session can tell it from the
/// records an idle upstream may rightly send.
#[test]
fn a_stray_response_over_tls_never_answers_a_later_request() {
    stray_never_answers(true);
}

fn stray_never_answers(tls: bool) {
    let _alone = alone();
    for express in [true, false] {
        for gap_ms in [2u64, 5, 10, 20, 40] {
            let up = stray_upstream(1, tls);
            let (gw, _rules) = gateway(up.addr, express, tls);
            let mut c = Client::connect(gw.addr);
            for n in 0..4 {
                let path = format!("/gap-{gap_ms}/{n}");
                let (status, body) = c.get(&path);
                assert_eq!(
                    (status.as_str(), body.as_str()),
                    ("HTTP/1.1 200 OK", format!("answer to {path}").as_str()),
                    "{}, {gap_ms} ms between requests: request {n} got another's answer",
                    mode(express, tls)
                );
                wait_for_stray(&up, n + 1);
                std::thread::sleep(Duration::from_millis(gap_ms));
            }
            assert!(
                up.strays.load(Ordering::SeqCst) >= 3,
                "{}: the upstream wrote only {} strays",
                mode(express, tls),
                up.strays.load(Ordering::SeqCst)
            );
            let log = std::fs::read_to_string(&gw.stderr_path).unwrap_or_default();
            assert!(
                log.contains("upstream sent a response nobody asked for"),
                "{}, {gap_ms} ms: no warning names the straying upstream:\n{log}",
                mode(express, tls)
            );
            let caught = strays_counted(&gw);
            assert!(
                caught >= 1,
                "{}, {gap_ms} ms: /metrics counts {caught} strays from the upstream",
                mode(express, tls)
            );
        }
    }
}

/// Many clients at once for 20 s on each path against an upstream that strays after every
/// seventh answer: the gateway reuses connections as fast as it can, and each answer must
/// still be its own. The paths take turns, so the upstream's threads get the cores they need to
/// stray on time.
#[test]
fn many_clients_get_only_their_own_answers_from_a_straying_upstream() {
    many_clients(false);
}

/// The same over TLS, for as long.
#[test]
fn many_clients_get_only_their_own_answers_from_a_straying_tls_upstream() {
    many_clients(true);
}

fn many_clients(tls: bool) {
    const CLIENTS: usize = 8;
    const FOR: Duration = Duration::from_secs(20);
    let _alone = alone();
    for express in [true, false] {
        let up = stray_upstream(7, tls);
        let (gw, _rules) = gateway(up.addr, express, tls);
        let until = Instant::now() + FOR;
        let results: Vec<(usize, Vec<String>)> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..CLIENTS)
                .map(|w| {
                    let addr = gw.addr;
                    s.spawn(move || {
                        let mut c = Client::connect(addr);
                        let mut wrong = Vec::new();
                        let mut n = 0;
                        while Instant::now() < until {
                            let path = format!("/client-{w}/{n}");
                            let (status, body) = c.get(&path);
                            if status != "HTTP/1.1 200 OK" || body != format!("answer to {path}") {
                                wrong.push(format!("{path}: {status} {body:?}"));
                            }
                            n += 1;
                        }
                        (n, wrong)
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        let answered: usize = results.iter().map(|r| r.0).sum();
        let wrong: Vec<&String> = results.iter().flat_map(|r| &r.1).collect();
        let strays = up.strays.load(Ordering::SeqCst);
        assert!(
            wrong.is_empty(),
            "{}: {} of {answered} answers were not their request's; the first: {:?}",
            mode(express, tls),
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        );
        assert!(
            answered > 1000 && strays > 100,
            "{}: too little load to show anything: {answered} answers, {strays} strays",
            mode(express, tls)
        );
        eprintln!(
            "{}: {answered} answers, {strays} strays, none misplaced",
            mode(express, tls)
        );
    }
}
