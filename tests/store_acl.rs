//! The store's credentials on real processes: the ACL user the README's "Redis users" writes out
//! runs every feature a gateway has on one node (checks, leased blocks, seats, post-paid debits,
//! the usage route, blocks and their admin list, keys made through the admin API, metering), a
//! wrong password stops start-up naming auth, and a password rotated in its file and signalled
//! with SIGHUP keeps the gateway on the store while the old password is revoked.

mod common;

use common::redis_tls::RedisCli;
use common::{Http, RedisServer, Tollgate};
use http::Method;

const TOKEN: &str = "acl-test-admin-token";

/// The README's `ACL SETUSER tollgate …` line, with `password` for its placeholder: the words
/// `redis-cli` gets, one argument each.
fn readme_user(password: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(common::repo().join("README.md")).unwrap();
    let section = readme
        .split("### Redis users")
        .nth(1)
        .expect("the README has a \"Redis users\" section");
    let line = section
        .lines()
        .find(|l| l.starts_with("ACL SETUSER tollgate "))
        .expect("the section writes out `ACL SETUSER tollgate …`");
    assert!(line.contains(">CHANGE-ME"), "{line}");
    line.split_whitespace()
        .map(|w| {
            if w == ">CHANGE-ME" {
                format!(">{password}")
            } else {
                w.to_string()
            }
        })
        .collect()
}

fn make_user(redis: &RedisServer, password: &str) {
    let words = readme_user(password);
    let args: Vec<&str> = words.iter().map(String::as_str).collect();
    assert_eq!(redis.run(&args), "OK", "ACL SETUSER from the README");
}

/// The demo's rules with a feature on each path: `/v1/orders` spends a hot limit's leased blocks
/// and takes a seat of a limit on requests in flight, and the rest of `/v1/` pays a guard that
/// blocks for a minute once it refuses.
fn every_feature_rules() -> (tempfile::TempDir, std::path::PathBuf) {
    let mut r: serde_json::Value = serde_json::from_str(&common::demo_json()).unwrap();
    r["limits"]["hot"] =
        serde_json::json!({"dimension": "key", "rate": "1000/1s", "burst": 1000, "lease": {"block": "auto"}});
    r["limits"]["inflight"] = serde_json::json!({"dimension": "key", "concurrent": 4});
    r["limits"]["guard"] =
        serde_json::json!({"dimension": "ip", "rate": "1/60s", "burst": 2, "block_for": "60s"});
    for route in r["routes"].as_array_mut().unwrap() {
        match route["name"].as_str() {
            Some("orders") => {
                route["cost"]["inflight"] = 1.into();
                route["cost"]["hot"] = 1.into();
            }
            Some("v1") => route["cost"]["guard"] = 1.into(),
            _ => {}
        }
    }
    common::rules_file(&r.to_string())
}

/// A gateway on `redis` as the README's user, its password in a file.
fn gateway(redis: &RedisServer, rules: &std::path::Path, dir: &std::path::Path, password: &str) -> Tollgate {
    let (pw, token) = (dir.join("redis-password"), dir.join("admin-token"));
    std::fs::write(&pw, format!("{password}\n")).unwrap();
    std::fs::write(&token, TOKEN).unwrap();
    Tollgate::spawn(&[
        "demo",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        &redis.url(),
        "--store-username",
        "tollgate",
        "--store-password-file",
        pw.to_str().unwrap(),
        "--admin-token-file",
        token.to_str().unwrap(),
        "--meter-interval",
        "200ms",
    ])
}

/// The sum of a counter family's samples on the admin listener's `/metrics`.
async fn counter(http: &Http, gw: &Tollgate, family: &str) -> f64 {
    let text = http.get(&gw.admin_url("/metrics"), &[]).await.body_text();
    text.lines()
        .filter(|l| l.starts_with(family))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const K8: (&str, &str) = ("authorization", "Bearer k8-demo-key");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_user_runs_every_feature() {
    let redis = RedisServer::start();
    make_user(&redis, "pw-1");
    let (dir, rules) = every_feature_rules();
    let gw = gateway(&redis, &rules, dir.path(), "pw-1");
    let http = Http::new();
    let bearer = format!("Bearer {TOKEN}");
    let admin = [("authorization", bearer.as_str())];

    for _ in 0..5 {
        let r = http.get(&gw.url("/v1/orders"), &[K8]).await;
        assert_eq!(r.status, 200, "a check, a lease and a seat: {}", r.body_text());
    }
    let r = http
        .send(Method::POST, &gw.url("/v1/completions"), &[K8], b"{}")
        .await;
    assert_eq!(r.status, 200, "a post-paid debit: {}", r.body_text());
    let r = http.get(&gw.url("/v1/usage"), &[K8]).await;
    assert_eq!(r.status, 200, "the usage route: {}", r.body_text());
    let r = http
        .send(Method::POST, &gw.url("/login"), &[("x-account", "a1")], b"")
        .await;
    assert_eq!(
        r.status,
        200,
        "an address's and an account's buckets: {}",
        r.body_text()
    );
    let mut guarded = Vec::new();
    for _ in 0..4 {
        guarded.push(http.get(&gw.url("/v1/invoices"), &[K8]).await.status.as_u16());
    }
    assert_eq!(guarded, [200, 200, 429, 429], "the guard refuses, then blocks");
    let blocks = http.get(&gw.admin_url("/admin/blocks"), &admin).await;
    assert_eq!(blocks.status, 200, "{}", blocks.body_text());
    assert!(
        blocks.body_text().contains("guard"),
        "the block is listed: {}",
        blocks.body_text()
    );

    let made = http
        .send(
            Method::POST,
            &gw.admin_url("/admin/keys"),
            &admin,
            br#"{"tenant": "acme", "limits": {"plan": {"rate": "10/1s", "burst": 10}, "hot": {"rate": "1000/1s", "burst": 1000}}}"#,
        )
        .await;
    assert_eq!(made.status, 201, "{}", made.body_text());
    let secret = made.json()["secret"].as_str().unwrap().to_string();
    let auth = format!("Bearer {secret}");
    let started = std::time::Instant::now();
    loop {
        let r = http
            .get(&gw.url("/v1/orders"), &[("authorization", auth.as_str())])
            .await;
        if r.status == 200 {
            break;
        }
        assert!(
            started.elapsed().as_secs() < 5,
            "the new key never served: {}",
            r.body_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    // Metering writes the usage stream as the same user.
    let started = std::time::Instant::now();
    while redis.cli(&["XLEN", "tollgate:usage"]) == "0" {
        assert!(started.elapsed().as_secs() < 10, "no usage record was written");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(counter(&http, &gw, "tollgate_store_errors_total").await, 0.0);
    assert_eq!(counter(&http, &gw, "tollgate_store_bypass_total").await, 0.0);
    let log = gw.stderr();
    for refusal in ["NOPERM", "can't run this command", "no permissions"] {
        assert!(
            !log.contains(refusal),
            "the store refused the user something:\n{log}"
        );
    }
    let users: Vec<String> = redis
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter_map(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("user="))
                .map(String::from)
        })
        .collect();
    assert!(
        users.iter().filter(|u| *u == "tollgate").count() >= 3,
        "the gateway's connections are the README user's: {users:?}"
    );
}

#[test]
fn a_wrong_password_stops_start_up_naming_auth() {
    let redis = RedisServer::start();
    make_user(&redis, "right");
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "wrong\n").unwrap();
    let (ok, err) = common::serve_and_exit(
        &common::demo_json(),
        &[
            "--store",
            &redis.url(),
            "--store-username",
            "tollgate",
            "--store-password-file",
            pw.to_str().unwrap(),
        ],
    );
    assert!(!ok, "started with a wrong password");
    assert!(
        err.contains("refused the credentials (auth)") && err.contains("WRONGPASS"),
        "{err}"
    );
    assert!(!err.contains("wrong"), "the password shows in the error: {err}");
    // The password in the URL instead: never printed either.
    let url = format!("redis://tollgate:secret-in-url@127.0.0.1:{}", redis.port);
    let (ok, err) = common::serve_and_exit(&common::demo_json(), &["--store", &url]);
    assert!(!ok && err.contains("redis://tollgate:***@127.0.0.1"), "{err}");
    assert!(!err.contains("secret-in-url"), "{err}");
    // A password both ways is one too many.
    let (ok, err) = common::serve_and_exit(
        &common::demo_json(),
        &["--store", &url, "--store-password-file", pw.to_str().unwrap()],
    );
    assert!(!ok && err.contains("give it one way"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_file_and_sighup_keep_the_gateway_on_the_store() {
    let redis = RedisServer::start();
    make_user(&redis, "old-pw");
    let (dir, rules) = every_feature_rules();
    let gw = gateway(&redis, &rules, dir.path(), "old-pw");
    let http = Http::new();
    assert_eq!(http.get(&gw.url("/v1/orders"), &[K8]).await.status, 200);

    // The operator's rotation: the new password beside the old, the file, the signal, then the
    // old one revoked and its connections cut.
    assert_eq!(redis.run(&["ACL", "SETUSER", "tollgate", ">new-pw"]), "OK");
    std::fs::write(dir.path().join("redis-password"), "new-pw\n").unwrap();
    gw.signal("HUP");
    let log = gw
        .stderr_when(|l| l.contains("the store's password file changed"))
        .await;
    assert!(log.contains("the store's password file changed"), "{log}");
    assert_eq!(redis.run(&["ACL", "SETUSER", "tollgate", "<old-pw"]), "OK");
    assert!(redis.kill_user_clients("tollgate") >= 1);
    let old = redis.run(&["AUTH", "tollgate", "old-pw"]);
    assert!(old.contains("WRONGPASS"), "the old password is revoked: {old}");

    // Every connection comes back with the new password; checks are the store's again.
    let started = std::time::Instant::now();
    loop {
        let ready = http.get(&gw.admin_url("/readyz"), &[]).await;
        if ready.status == 200 && ready.body_text().contains("\"ready\"") {
            break;
        }
        assert!(
            started.elapsed().as_secs() < 10,
            "not back on the store: {}",
            ready.body_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let bypassed = counter(&http, &gw, "tollgate_store_bypass_total").await;
    for _ in 0..5 {
        assert_eq!(http.get(&gw.url("/v1/orders"), &[K8]).await.status, 200);
    }
    assert_eq!(
        counter(&http, &gw, "tollgate_store_bypass_total").await,
        bypassed,
        "checks after the rotation were decided by the store"
    );
    let users = redis.cli(&["CLIENT", "LIST"]);
    assert!(users.contains("user=tollgate"), "{users}");
}
