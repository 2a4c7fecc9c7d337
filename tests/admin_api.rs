//! The admin listener against the requests a browser page could make: its pages and API answer
//! only to IP literals, `localhost` and the names given with `--admin-host`, while probes and
//! scrapers keep reaching `/metrics`, `/healthz` and `/readyz` by any name.

mod common;

use common::{Http, Tollgate};
use http::StatusCode;

#[tokio::test]
async fn the_admin_pages_refuse_a_foreign_host_and_probes_do_not() {
    let gw = Tollgate::spawn(&["demo", "--admin-host", "gateway-1.internal"]);
    let http = Http::new();
    let port = gw.admin.expect("admin listener").port();
    for path in [
        "/admin/",
        "/admin/rules",
        "/admin/api/overview",
        "/admin/usage?key=k-7",
    ] {
        let url = gw.admin_url(path);
        // As the browser sends it after a rebound name: the page's own host name.
        let foreign = http
            .get(&url, &[("host", &format!("attacker.example:{port}"))])
            .await;
        assert_eq!(foreign.status, StatusCode::MISDIRECTED_REQUEST, "{path}");
        assert_eq!(foreign.json()["error"], "misdirected_request", "{path}");
        for host in [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("gateway-1.internal:{port}"),
            format!("GATEWAY-1.internal:{port}"),
        ] {
            let ok = http.get(&url, &[("host", &host)]).await;
            assert_ne!(ok.status, StatusCode::MISDIRECTED_REQUEST, "{path} as {host}");
        }
    }
    for path in ["/metrics", "/healthz", "/readyz"] {
        let a = http
            .get(&gw.admin_url(path), &[("host", "tollgate-3.prod.example:9901")])
            .await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
    }
}

#[tokio::test]
async fn without_admin_hosts_only_ip_literals_and_localhost_pass() {
    let gw = Tollgate::spawn(&["demo"]);
    let http = Http::new();
    let url = gw.admin_url("/admin/rules");
    assert_eq!(http.get(&url, &[]).await.status, StatusCode::OK);
    let a = http.get(&url, &[("host", "gateway-1.internal")]).await;
    assert_eq!(a.status, StatusCode::MISDIRECTED_REQUEST);
    let a = http.get(&url, &[("host", "[::1]:1")]).await;
    assert_eq!(a.status, StatusCode::OK);
}

/// Sends `head` (a request head, blank line and all) on a fresh connection to `addr` and reads
/// the answer: its status and body.
async fn raw(addr: std::net::SocketAddr, head: String) -> (u16, serde_json::Value) {
    use tokio::io::AsyncWriteExt;
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let (status, body) = common::read_framed(&mut tcp, &mut buf).await.unwrap();
    (status, serde_json::from_slice(&buf[body]).unwrap())
}

#[tokio::test]
async fn two_host_or_two_authorization_headers_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "an-operator-token-for-the-admin-api\n").unwrap();
    let gw = Tollgate::spawn(&["demo", "--admin-token-file", token.to_str().unwrap()]);
    let admin = gw.admin.expect("admin listener");
    let good = "Authorization: Bearer an-operator-token-for-the-admin-api\r\n";
    for path in ["/admin/rules", "/metrics", "/admin/blocks"] {
        let (status, body) = raw(
            admin,
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n\r\n"),
        )
        .await;
        assert_eq!(status, 400, "{path}: {body}");
        assert_eq!(
            body,
            serde_json::json!({"error": "bad_request", "message": "more than one Host header"}),
            "{path}"
        );
    }
    // The right token first and a wrong one after, or the other way round: neither is chosen.
    for (first, second) in [
        (good, "Authorization: Bearer wrong\r\n"),
        ("Authorization: Bearer wrong\r\n", good),
    ] {
        let (status, body) = raw(
            admin,
            format!(
                "DELETE /admin/blocks?limit=guard&bucket=x HTTP/1.1\r\nHost: 127.0.0.1\r\n{first}{second}\r\n"
            ),
        )
        .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(
            body,
            serde_json::json!({"error": "bad_request", "message": "more than one Authorization header"})
        );
    }
}

#[tokio::test]
async fn a_refused_admin_token_is_logged_and_counted_without_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin.token");
    std::fs::write(&token, "an-operator-token-for-the-admin-api\n").unwrap();
    let gw = Tollgate::spawn(&["demo", "--admin-token-file", token.to_str().unwrap()]);
    let http = Http::new();
    let failures = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("tollgate_admin_auth_failures_total "))
            .map(|v| v.trim().to_string())
    };
    let m = http.get(&gw.admin_url("/metrics"), &[]).await;
    assert_eq!(failures(&String::from_utf8_lossy(&m.body)).as_deref(), Some("0"));

    let url = gw.admin_url("/admin/blocks?limit=guard&bucket=x");
    let none = http.send(http::Method::DELETE, &url, &[], b"").await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    let guess = "Bearer a-guessed-token-that-must-not-be-logged";
    let wrong = http
        .send(
            http::Method::DELETE,
            &gw.admin_url("/admin/keys"),
            &[("authorization", guess)],
            b"",
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    // The right token is not a failure.
    let right = http
        .send(
            http::Method::DELETE,
            &url,
            &[("authorization", "Bearer an-operator-token-for-the-admin-api")],
            b"",
        )
        .await;
    assert_ne!(right.status, StatusCode::UNAUTHORIZED);

    let m = http.get(&gw.admin_url("/metrics"), &[]).await;
    assert_eq!(failures(&String::from_utf8_lossy(&m.body)).as_deref(), Some("2"));
    let log = gw
        .stderr_when(|l| l.matches("admin request refused").count() >= 2)
        .await;
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("admin request refused"))
        .collect();
    assert_eq!(refused.len(), 2, "{log}");
    assert!(refused[0].contains("WARN"), "{}", refused[0]);
    assert!(
        refused[0].contains("/admin/blocks") && refused[0].contains("no token"),
        "{}",
        refused[0]
    );
    assert!(
        refused[1].contains("/admin/keys") && refused[1].contains("a wrong token"),
        "{}",
        refused[1]
    );
    for line in &refused {
        assert!(line.contains("127.0.0.1:"), "no peer address: {line}");
    }
    assert!(!log.contains("a-guessed-token"), "the token was logged:\n{log}");
}
