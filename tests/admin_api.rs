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
