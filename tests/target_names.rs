//! Targets found by name, against real processes: a name with several addresses in a hosts
//! file is that many targets, followed as the file changes under load; a name the system
//! resolves is its addresses; a hosts file that doesn't parse stops start-up.

mod common;

use std::time::{Duration, Instant};

use common::instances::{Instance, gateway, get};
use common::{Http, K7, KBIG, Tollgate};
use http::StatusCode;
use serde_json::{Value, json};

/// A port free on 127.0.0.1, .2 and .3 alike, for three instances behind one name.
fn port_free_on_three_addresses() -> u16 {
    for _ in 0..20 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if (2..=3).all(|i| std::net::TcpListener::bind(format!("127.0.0.{i}:{port}")).is_ok()) {
            return port;
        }
    }
    panic!("no port free on 127.0.0.1 to 127.0.0.3");
}

/// Writes `text` to `path` in one step, as a configuration tool replaces a file.
fn replace(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// One name with two addresses, then three, then two again (a headless Service's pods as they
/// are scaled), under load: each address is a target, traffic follows the hosts file, and no
/// partner sees an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_name_with_several_addresses_is_followed_as_they_change() {
    let port = port_free_on_three_addresses();
    let a = Instance::spawn("a", &format!("127.0.0.1:{port}"), None);
    let b = Instance::spawn("b", &format!("127.0.0.2:{port}"), None);
    let c = Instance::spawn("c", &format!("127.0.0.3:{port}"), None);
    assert_eq!(
        (a.addr().port(), b.addr().port(), c.addr().port()),
        (port, port, port)
    );
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    let two = "127.0.0.1 orders.test\n127.0.0.2 orders.test # b\n";
    let three = format!("{two}127.0.0.3 Orders.Test\n");
    replace(&hosts, two);
    let mut rules: Value =
        serde_json::from_str(&common::demo_rules_for("127.0.0.1:9".parse().unwrap())).unwrap();
    rules["upstreams"]["orders"] = json!({
        "targets": [{"url": format!("http://orders.test:{port}")}],
        "balance": "round_robin",
        "dns_refresh_ms": 500,
    });
    let (_rules_dir, path) = common::rules_file(&rules.to_string());
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        "memory",
        "--hosts-file",
        hosts.to_str().unwrap(),
    ]);
    let http = Http::new();
    let listed = |v: &Value| -> Vec<(String, String)> {
        v["upstreams"][0]["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["target"].as_str().unwrap().to_string(),
                    t["name"].as_str().unwrap_or("-").to_string(),
                )
            })
            .collect()
    };
    let view = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
    let name = format!("orders.test:{port}");
    assert_eq!(
        listed(&view),
        vec![
            (format!("127.0.0.1:{port}"), name.clone()),
            (format!("127.0.0.2:{port}"), name.clone())
        ]
    );

    let start = Instant::now();
    let run = Duration::from_secs(6);
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (http, url) = (http.clone(), gw.url("/v1/orders"));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while start.elapsed() < run {
                    let asked = start.elapsed();
                    let r = http.get(&url, &[("x-api-key", KBIG)]).await;
                    let who = serde_json::from_slice::<Value>(&r.body)
                        .ok()
                        .and_then(|v| v["instance"].as_str().map(str::to_string));
                    seen.push((asked, r.status, who));
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    replace(&hosts, &three);
    let grown = start.elapsed();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let view = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
    assert_eq!(listed(&view).len(), 3, "{view}");
    replace(&hosts, two);
    let shrunk = start.elapsed();
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap());
    }
    let bad: Vec<_> = all.iter().filter(|(_, s, _)| *s != StatusCode::OK).collect();
    assert!(
        bad.is_empty(),
        "partners saw {} errors: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    let from = |who: &str, from: Duration, to: Duration| {
        all.iter()
            .filter(|(t, _, w)| *t >= from && *t < to && w.as_deref() == Some(who))
            .count()
    };
    // Each change is followed within the refresh plus a second.
    let follow = Duration::from_millis(1500);
    assert_eq!(
        from("c", Duration::ZERO, grown),
        0,
        "c before its address was listed"
    );
    assert!(
        from("c", grown + follow, shrunk) > 0,
        "c after its address was listed"
    );
    assert_eq!(from("c", shrunk + follow, run), 0, "c after its address was gone");
    for who in ["a", "b"] {
        assert!(from(who, shrunk + follow, run) > 0, "{who} served to the end");
    }
    eprintln!(
        "{} requests; c served {} while listed",
        all.len(),
        from("c", grown, shrunk + follow)
    );
}

/// A name the hosts file doesn't know goes to the system's resolver, and its address is the
/// target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_the_system_resolves_is_its_addresses() {
    let a = Instance::spawn("a", "127.0.0.1:0", None);
    let port = a.addr().port();
    let (gw, _dir) = gateway(json!({"url": format!("http://localhost:{port}")}));
    let http = Http::new();
    for _ in 0..5 {
        assert_eq!(
            get(&http, &gw, "/v1/orders", K7).await,
            (StatusCode::OK, Some("a".into()))
        );
    }
    let view = http.get(&gw.admin_url("/admin/upstreams"), &[]).await.json();
    let targets = view["upstreams"][0]["targets"].as_array().unwrap();
    assert!(
        targets
            .iter()
            .any(|t| t["target"] == format!("127.0.0.1:{port}") && t["name"] == format!("localhost:{port}")),
        "{view}"
    );
}

/// A hosts file that doesn't parse stops start-up, naming its line and why.
#[test]
fn a_broken_hosts_file_stops_start_up_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 orders.test\n10.0.0.300 orders.test\n").unwrap();
    let rules = common::demo_rules_for("127.0.0.1:9".parse().unwrap());
    let (_rules_dir, path) = common::rules_file(&rules);
    let o = common::cli::tollgate(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        "memory",
        "--listen",
        "127.0.0.1:0",
        "--meter-file",
        dir.path().join("usage.db").to_str().unwrap(),
        "--hosts-file",
        hosts.to_str().unwrap(),
    ]);
    let err = common::cli::fails(&o);
    assert!(
        err.contains(&format!(
            "{}:2: \"10.0.0.300\" is not an IP address",
            hosts.display()
        )),
        "{err}"
    );
}
