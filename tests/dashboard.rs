//! The admin dashboard in a real headless Chromium against a real gateway process: it shows the
//! running rules and per-limit charts, follows a rules reload without a page reload, names a
//! rejected reload, shows each upstream target's state (a dead one ejected), logs no console
//! error, and never shows a presented secret or a key hash.

mod common;

use std::time::Duration;

use common::cdp::Browser;
use common::{Http, K7, Tollgate};
use http::StatusCode;

fn demo_rules(version: u64) -> String {
    let text = common::demo_json();
    let mut rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    rules["version"] = version.into();
    rules.to_string()
}

/// Every key hash of the demo rules, and the demo secrets.
fn secrets() -> Vec<String> {
    let text = common::demo_json();
    let rules: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out: Vec<String> = rules["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["sha256"].as_str().unwrap().to_string())
        .collect();
    out.extend(common::DEMO_KEYS.iter().map(|s| s.to_string()));
    out
}

fn assert_no_secret(what: &str, text: &str) {
    for s in secrets() {
        // A hash's first 16 hex digits are as good as a prefix an operator could search by.
        let part = &s[..s.len().min(16)];
        assert!(
            !text.contains(part),
            "{what} holds a secret or key hash ({}…)",
            &s[..6]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_follows_the_gateway_live() {
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.json");
    std::fs::write(&rules, demo_rules(1)).unwrap();
    let gw = Tollgate::spawn(&["demo", "--rules", rules.to_str().unwrap()]);
    let http = Http::new();
    // Traffic for the charts and the key tables: k-7's burst of 20, then refusals.
    for _ in 0..30 {
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        assert!(r.status == StatusCode::OK || r.status == StatusCode::TOO_MANY_REQUESTS);
    }

    let mut b = Browser::launch().await;
    b.navigate(&gw.admin_url("/admin/")).await;
    b.wait_for(
        "document.getElementById('rules-version').textContent === '1'",
        "the rules version",
        Duration::from_secs(15),
    )
    .await;
    b.wait_for(
        "document.querySelector('#chart-plan canvas') !== null",
        "the plan limit's chart",
        Duration::from_secs(15),
    )
    .await;
    b.wait_for(
        "document.getElementById('keys').textContent.includes('k-7')",
        "k-7 among the hottest keys",
        Duration::from_secs(15),
    )
    .await;

    // A new version on disk appears on the open page.
    std::fs::write(&rules, demo_rules(2)).unwrap();
    b.wait_for(
        "document.getElementById('rules-version').textContent === '2'",
        "the reloaded rules version, without a page reload",
        Duration::from_secs(15),
    )
    .await;
    // A broken file is named, and version 2 keeps running.
    std::fs::write(&rules, "{\"version\": 3, \"upstreams\": {}}").unwrap();
    b.wait_for(
        "document.getElementById('rules-rejected').textContent.includes('rejected')",
        "the rejected reload",
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(
        b.eval("document.getElementById('rules-version').textContent")
            .await,
        "2"
    );
    let shown = b.eval("document.body.innerText").await;
    assert_no_secret("the page", shown.as_str().unwrap());
    let png = b.screenshot().await;
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG screenshot");
    if let Ok(path) = std::env::var("TOLLGATE_DASHBOARD_SCREENSHOT") {
        std::fs::write(path, &png).unwrap();
    }
    assert!(b.errors.is_empty(), "console errors: {:?}", b.errors);

    for path in ["/admin/", "/admin/app.js", "/admin/api/overview"] {
        let r = http.get(&gw.admin_url(path), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        assert_no_secret(path, &String::from_utf8_lossy(&r.body));
    }
}

/// The state of `target` of `orders` in `GET /admin/upstreams`, if listed.
async fn target_state(http: &Http, gw: &Tollgate, target: &str) -> Option<String> {
    let r = http.get(&gw.admin_url("/admin/upstreams"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    r.json()["upstreams"]
        .as_array()?
        .iter()
        .find(|u| u["name"] == "orders")?["targets"]
        .as_array()?
        .iter()
        .find(|t| t["target"] == target)
        .and_then(|t| t["state"].as_str().map(str::to_string))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_each_target_and_a_dead_one_ejected() {
    let a = common::DemoUpstreamProc::spawn_with(&["--listen", "127.0.0.1:0"]);
    let b = common::DemoUpstreamProc::spawn_with(&["--listen", "127.0.0.1:0"]);
    // Bound and never listening: every connection to it is refused, as to a crashed instance.
    let dead = tokio::net::TcpSocket::new_v4().unwrap();
    dead.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let dead_addr = dead.local_addr().unwrap().to_string();
    let mut rules: serde_json::Value =
        serde_json::from_str(&common::demo_rules_for("127.0.0.1:9".parse().unwrap())).unwrap();
    let live = [a.addr.to_string(), b.addr.to_string()];
    rules["upstreams"]["orders"] = serde_json::json!({
        "targets": [{"url": format!("http://{}", live[0])}, {"url": format!("http://{dead_addr}"), "weight": 2},
                    {"url": format!("http://{}", live[1])}],
        // In turn, so the dead target is tried within the first few requests; out for a
        // minute, longer than the test.
        "balance": "round_robin",
        "eject": {"consecutive_failures": 1, "for_ms": 60000},
    });
    let (_dir, path) = common::rules_file(&rules.to_string());
    let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap(), "--store", "memory"]);
    let http = Http::new();

    let mut sent = 0;
    while target_state(&http, &gw, &dead_addr).await.as_deref() != Some("ejected") {
        assert!(sent < 10, "the dead target is not ejected after {sent} requests");
        let r = http.get(&gw.url("/v1/orders"), &[("x-api-key", K7)]).await;
        // A refused connection is retried on another target: no caller sees the dead one.
        assert_eq!(r.status, StatusCode::OK, "{:?}", String::from_utf8_lossy(&r.body));
        sent += 1;
    }

    let mut browser = Browser::launch().await;
    browser.navigate(&gw.admin_url("/admin/")).await;
    let row = |target: &str| {
        format!(
            "[...document.querySelectorAll('#targets tr')].find(tr => tr.dataset.upstream === 'orders' && tr.dataset.target === '{target}')"
        )
    };
    browser
        .wait_for(
            &format!(
                "{}.children[2].textContent.startsWith('ejected, ')",
                row(&dead_addr)
            ),
            "the dead target shown ejected, with the time it has left",
            Duration::from_secs(15),
        )
        .await;
    let dead_row = browser
        .eval(&format!(
            "Array.from({}.children, td => td.textContent)",
            row(&dead_addr)
        ))
        .await;
    let cells: Vec<&str> = dead_row
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    // upstream, target, state, weight, in flight, ejections, last failure.
    assert_eq!(&cells[..2], ["orders", dead_addr.as_str()], "{cells:?}");
    assert_eq!(&cells[3..6], ["2", "0", "1"], "{cells:?}");
    assert!(cells[6].contains("ago"), "the last failure: {cells:?}");
    for t in &live {
        let state = browser.eval(&format!("{}.children[2].textContent", row(t))).await;
        assert_eq!(state, "up", "{t}");
    }
    assert_eq!(
        browser
            .eval("document.querySelectorAll('#targets tr').length")
            .await,
        3
    );
    assert!(browser.errors.is_empty(), "console errors: {:?}", browser.errors);
}
