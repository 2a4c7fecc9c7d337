//! Keys with a life cycle through the admin API, against real gateways: made, used, rotated,
//! revoked and changed on the embedded store (its keys file surviving a restart) and on one
//! Redis shared by two gateways, with the token and `Host` the API asks for and the answers
//! bad input gets.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Http, K7, Tollgate};
use http::{Method, StatusCode};
use serde_json::{Value, json};
use tollgate_gateway::admin_guard::AdminToken;
use tollgate_gateway::app::{self, GatewayConfig};
use tollgate_limit::clock::ManualClock;
use tollgate_rules::RulesSource;

const TOKEN: &str = "a-test-admin-token-0123456789";

fn token_file(dir: &std::path::Path) -> String {
    let path = dir.join("admin-token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    path.to_str().unwrap().to_string()
}

/// The admin API as an operator calls it.
struct Admin {
    http: Http,
    base: String,
}

impl Admin {
    fn new(admin: SocketAddr) -> Admin {
        Admin {
            http: Http::new(),
            base: format!("http://{admin}"),
        }
    }

    async fn call(&self, method: Method, path: &str, body: &'static str) -> common::Answer {
        let auth = format!("Bearer {TOKEN}");
        self.http
            .send(
                method,
                &format!("{}{path}", self.base),
                &[("authorization", &auth)],
                body.as_bytes(),
            )
            .await
    }

    async fn create(&self, body: &'static str) -> (String, String) {
        let a = self.call(Method::POST, "/admin/keys", body).await;
        assert_eq!(a.status, StatusCode::CREATED, "{:?}", a.body);
        let v = a.json();
        (
            v["id"].as_str().unwrap().into(),
            v["secret"].as_str().unwrap().into(),
        )
    }
}

/// A GET of the demo's `/v1/orders` with `secret`: the status and why (a 401's `reason`, a
/// 429's `limit`).
async fn orders(http: &Http, public: &str, secret: &str) -> (StatusCode, Value) {
    let a = http
        .get(&format!("{public}/v1/orders"), &[("x-api-key", secret)])
        .await;
    let why = match a.status {
        StatusCode::OK => Value::Null,
        StatusCode::TOO_MANY_REQUESTS => a.json()["limit"].clone(),
        _ => a.json()["reason"].clone(),
    };
    (a.status, why)
}

/// Leaks a static body for `Http::send`, which takes `&'static [u8]`.
fn leak(v: Value) -> &'static str {
    Box::leak(v.to_string().into_boxed_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_lives_through_the_admin_api_on_the_embedded_store() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path());
    let keys_file = dir.path().join("keys.db");
    let args = [
        "demo",
        "--admin-token-file",
        &token,
        "--keys-file",
        keys_file.to_str().unwrap(),
    ];
    let mut gw = Tollgate::spawn(&args);
    let admin = Admin::new(gw.admin.unwrap());
    let http = Http::new();
    let public = format!("http://{}", gw.addr);

    // Without the token, with a wrong one, on the public port, by a foreign name.
    let url = gw.admin_url("/admin/keys");
    let body = r#"{"tenant": "acme"}"#.as_bytes();
    let none = http.send(Method::POST, &url, &[], body).await;
    assert_eq!(none.status, StatusCode::UNAUTHORIZED);
    let wrong = http
        .send(
            Method::POST,
            &url,
            &[("authorization", "Bearer not-the-token-at-all")],
            body,
        )
        .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(wrong.json()["reason"], "admin_token");
    let auth = format!("Bearer {TOKEN}");
    let public_port = http
        .send(
            Method::POST,
            &format!("{public}/admin/keys"),
            &[("authorization", &auth)],
            body,
        )
        .await;
    assert_eq!(
        public_port.status,
        StatusCode::NOT_FOUND,
        "the public port has no admin API"
    );
    let foreign = http
        .send(
            Method::POST,
            &url,
            &[("authorization", &auth), ("host", "attacker.example")],
            body,
        )
        .await;
    assert_eq!(foreign.status, StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(
        admin.call(Method::GET, "/admin/keys", "").await.json()["keys"],
        json!([])
    );

    // Made, used up to its burst, and shown without secrets or hashes.
    let (id, secret) = admin
        .create(r#"{"tenant": "acme", "name": "Acme's sync", "limits": {"plan": {"rate": "600/60s", "burst": 12}}}"#)
        .await;
    assert!(secret.starts_with("tg_") && secret.len() == 41, "{secret}");
    for _ in 0..12 {
        assert_eq!(orders(&http, &public, &secret).await.0, StatusCode::OK);
    }
    assert_eq!(
        orders(&http, &public, &secret).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let shown = admin.call(Method::GET, &format!("/admin/keys/{id}"), "").await;
    assert_eq!(shown.status, StatusCode::OK);
    let v = shown.json();
    assert_eq!(
        (v["tenant"].as_str(), v["name"].as_str()),
        (Some("acme"), Some("Acme's sync"))
    );
    assert_eq!(v["limits"]["plan"], json!({"rate": "600/60s", "burst": 12}));
    assert_eq!(v["secrets"].as_array().unwrap().len(), 1);
    let text = String::from_utf8_lossy(&shown.body).to_string();
    let hash: String = tollgate_rules::hash_secret(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(!text.contains(&secret) && !text.contains(&hash[..16]), "{text}");
    let listed = admin
        .call(Method::GET, "/admin/keys?tenant=acme", "")
        .await
        .json();
    assert_eq!(listed["keys"].as_array().unwrap().len(), 1);
    let other = admin
        .call(Method::GET, "/admin/keys?tenant=nobody", "")
        .await
        .json();
    assert_eq!(other["keys"], json!([]));

    // A secret of our form with one character wrong is refused before any lookup.
    let mut typo = secret.clone().into_bytes();
    typo[10] = if typo[10] == b'a' { b'b' } else { b'a' };
    let typo = String::from_utf8(typo).unwrap();
    assert_eq!(
        orders(&http, &public, &typo).await,
        (StatusCode::UNAUTHORIZED, json!("unknown_key"))
    );

    // Bad input: 400 naming the field, and nothing changes.
    let big = "x".repeat(10 << 20);
    let cases: Vec<(&'static str, &str)> = vec![
        ("{\"tenant\": ", "(body)"),
        (r#"{"tenant": "acme", "colour": "red"}"#, "colour"),
        (
            r#"{"tenant": "acme", "limits": {"plan": {"rate": "0/60s", "burst": 5}}}"#,
            "limits.plan.rate",
        ),
        (
            r#"{"tenant": "acme", "limits": {"nope": {"rate": "1/60s", "burst": 5}}}"#,
            "limits.nope",
        ),
        (
            r#"{"tenant": "acme", "expires_at": "2001-01-01T00:00:00Z"}"#,
            "expires_at",
        ),
        (leak(json!({"tenant": "acme", "name": big})), "(body)"),
    ];
    for (body, field) in cases {
        let a = admin.call(Method::POST, "/admin/keys", body).await;
        assert_eq!(
            a.status,
            StatusCode::BAD_REQUEST,
            "{field}: {:?}",
            String::from_utf8_lossy(&a.body)
        );
        assert_eq!(a.json()["field"], field, "{:?}", String::from_utf8_lossy(&a.body));
    }
    let rate_patch = admin
        .call(
            Method::PATCH,
            &format!("/admin/keys/{id}"),
            r#"{"limits": {"plan": {"rate": "1/0s", "burst": 5}}}"#,
        )
        .await;
    assert_eq!(rate_patch.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        admin.call(Method::GET, "/admin/keys", "").await.json()["keys"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // Ids taken by the rules file or by an earlier key are conflicts.
    let a = admin
        .call(
            Method::POST,
            "/admin/keys",
            r#"{"id": "k-7", "tenant": "x", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#,
        )
        .await;
    assert_eq!(a.status, StatusCode::CONFLICT);
    let body = leak(json!({"id": id, "tenant": "x", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}));
    assert_eq!(
        admin.call(Method::POST, "/admin/keys", body).await.status,
        StatusCode::CONFLICT
    );

    // A patch of its numbers serves at once: a new burst of 20.
    let a = admin
        .call(
            Method::PATCH,
            &format!("/admin/keys/{id}"),
            r#"{"limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    assert_eq!(a.json()["limits"]["plan"]["burst"], 20);

    // Rotated with no grace: the old secret is expired at once, the new one works.
    let r = admin
        .call(
            Method::POST,
            &format!("/admin/keys/{id}/rotate"),
            r#"{"grace_s": 0}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let new_secret = r.json()["secret"].as_str().unwrap().to_string();
    assert_eq!(
        orders(&http, &public, &secret).await,
        (StatusCode::UNAUTHORIZED, json!("key_expired"))
    );
    let (status, _) = orders(&http, &public, &new_secret).await;
    assert!(
        status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
        "{status}"
    );

    // A second key, then the first revoked.
    let (_, kept) = admin
        .create(r#"{"tenant": "beta", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#)
        .await;
    assert_eq!(orders(&http, &public, &kept).await.0, StatusCode::OK);
    let a = admin
        .call(Method::POST, &format!("/admin/keys/{id}/revoke"), "")
        .await;
    assert_eq!(
        (a.status, a.json()["revoked"].clone()),
        (StatusCode::OK, json!(true))
    );
    assert_eq!(
        orders(&http, &public, &new_secret).await,
        (StatusCode::UNAUTHORIZED, json!("key_revoked"))
    );
    let again = admin
        .call(
            Method::POST,
            &format!("/admin/keys/{id}/rotate"),
            r#"{"grace_s": 0}"#,
        )
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "a revoked key stays revoked");
    assert_eq!(
        orders(&http, &public, K7).await.0,
        StatusCode::OK,
        "the file's keys are untouched"
    );

    // Counted and audited, one line a change.
    let metrics = http.get(&gw.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    for (action, n) in [("create", 2), ("patch", 1), ("rotate", 1), ("revoke", 1)] {
        let line = format!("tollgate_admin_changes_total{{action=\"{action}\"}} {n}");
        assert!(text.contains(&line), "{line} not in metrics");
    }
    let (_, stderr) = gw.stop();
    let audit: Vec<&str> = stderr.lines().filter(|l| l.contains("tollgate::audit")).collect();
    assert_eq!(audit.len(), 5, "{audit:?}");
    assert!(
        audit[0].contains("action=\"create\"")
            && audit[0].contains(&format!("key={id}"))
            && audit[0].contains("peer=127.0.0.1:")
    );

    // The keys file outlives the gateway.
    let gw = Tollgate::spawn(&args);
    let public = format!("http://{}", gw.addr);
    assert_eq!(orders(&http, &public, &kept).await.0, StatusCode::OK);
    assert_eq!(
        orders(&http, &public, &new_secret).await,
        (StatusCode::UNAUTHORIZED, json!("key_revoked"))
    );
}

#[tokio::test]
async fn without_a_token_the_key_api_is_not_there() {
    let gw = Tollgate::spawn(&["demo"]);
    let a = Http::new()
        .send(
            Method::GET,
            &gw.admin_url("/admin/keys"),
            &[("authorization", "Bearer anything-at-all-here")],
            b"",
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotations_grace_and_an_expiry_end_on_the_gateways_clock() {
    let upstream = common::start_demo_upstream().await;
    let (dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let clock = ManualClock::new(1_800_000_000_000_000);
    let mut cfg = GatewayConfig::new(RulesSource::File(path));
    cfg.clock = clock.clone();
    cfg.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.admin_token = Some(AdminToken::new(TOKEN));
    cfg.keys_file = Some(dir.path().join("keys.db"));
    let running = app::start(cfg).await.expect("gateway starts");
    let admin = Admin::new(running.admin_addr.unwrap());
    let http = Http::new();
    let public = format!("http://{}", running.addr);

    let (id, old) = admin.create(r#"{"tenant": "acme", "expires_at": "2027-01-15T08:05:00Z", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#).await;
    let r = admin
        .call(
            Method::POST,
            &format!("/admin/keys/{id}/rotate"),
            r#"{"grace_s": 60}"#,
        )
        .await;
    let new = r.json()["secret"].as_str().unwrap().to_string();
    assert_eq!(
        orders(&http, &public, &old).await.0,
        StatusCode::OK,
        "in its grace"
    );
    assert_eq!(orders(&http, &public, &new).await.0, StatusCode::OK);
    clock.advance_us(59_000_000);
    assert_eq!(
        orders(&http, &public, &old).await.0,
        StatusCode::OK,
        "a second of grace left"
    );
    clock.advance_us(1_000_000);
    assert_eq!(
        orders(&http, &public, &old).await,
        (StatusCode::UNAUTHORIZED, json!("key_expired"))
    );
    assert_eq!(orders(&http, &public, &new).await.0, StatusCode::OK);
    let shown = admin
        .call(Method::GET, &format!("/admin/keys/{id}"), "")
        .await
        .json();
    assert_eq!(
        shown["secrets"][0]["not_after"], "2027-01-15T08:01:00Z",
        "{shown}"
    );

    // 1_800_000_000 is 2027-01-15T08:00:00Z: the key ends at 08:05.
    clock.advance_us(239_000_000);
    assert_eq!(orders(&http, &public, &new).await.0, StatusCode::OK);
    clock.advance_us(1_000_000);
    assert_eq!(
        orders(&http, &public, &new).await,
        (StatusCode::UNAUTHORIZED, json!("key_expired"))
    );
    let past = admin
        .call(
            Method::PATCH,
            &format!("/admin/keys/{id}"),
            r#"{"expires_at": "2027-01-15T08:04:00Z"}"#,
        )
        .await;
    assert_eq!(
        (past.status, past.json()["field"].clone()),
        (StatusCode::BAD_REQUEST, json!("expires_at"))
    );
    let a = admin
        .call(
            Method::PATCH,
            &format!("/admin/keys/{id}"),
            r#"{"expires_at": null}"#,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        orders(&http, &public, &new).await.0,
        StatusCode::OK,
        "no expiry any more"
    );
    running.shutdown().await;
}

/// A revoked key's answer: 401 `key_revoked`, or 429 once the polling above has spent the
/// address's unauthenticated bucket (every refused key is charged to it, shared by the fleet).
fn refused_as_revoked((status, reason): (StatusCode, Value)) {
    assert!(
        (status, &reason) == (StatusCode::UNAUTHORIZED, &json!("key_revoked"))
            || (status, &reason) == (StatusCode::TOO_MANY_REQUESTS, &json!("unauth")),
        "{status} {reason}"
    );
}

/// Polls `check` every 20 ms for up to 10 s; returns how long it took to hold.
async fn until(what: &str, check: impl AsyncFn() -> bool) -> Duration {
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{what}: not within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_one_redis_follow_each_others_keys() {
    let redis = common::RedisServer::start();
    let url = redis.url();
    follow_each_others_keys(&url, move || drop(redis)).await;
}

/// The same on a Redis Cluster of three primaries: the keys share a hash tag, so a write is
/// one call to one primary, and every gateway follows it from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_one_cluster_follow_each_others_keys() {
    let cluster = common::RedisCluster::start();
    let url = cluster.url();
    follow_each_others_keys(&url, move || drop(cluster)).await;
}

/// Two gateways on the store at `url` see the keys each other makes and revokes within a
/// second, a third that starts later loads them all, and one that loses the store (`lose`)
/// keeps what it has.
async fn follow_each_others_keys(url: &str, lose: impl FnOnce()) {
    let url = url.to_string();
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path());
    let args = ["demo", "--store", &url, "--admin-token-file", &token];
    let (a, b) = (Tollgate::spawn(&args), Tollgate::spawn(&args));
    let (admin_a, admin_b) = (Admin::new(a.admin.unwrap()), Admin::new(b.admin.unwrap()));
    let http = Http::new();
    let (pa, pb) = (format!("http://{}", a.addr), format!("http://{}", b.addr));

    let (id, secret) = admin_a
        .create(r#"{"tenant": "acme", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#)
        .await;
    let seen = until("a key made on one gateway serves on the other", async || {
        orders(&http, &pb, &secret).await.0 == StatusCode::OK
    })
    .await;
    eprintln!("made on one gateway, serving on the other after {seen:?}");
    let shown = admin_b.call(Method::GET, &format!("/admin/keys/{id}"), "").await;
    assert_eq!(shown.status, StatusCode::OK);

    let r = admin_b
        .call(Method::POST, &format!("/admin/keys/{id}/revoke"), "")
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let seen = until(
        "a key revoked on the other gateway is refused on the first",
        async || orders(&http, &pa, &secret).await == (StatusCode::UNAUTHORIZED, json!("key_revoked")),
    )
    .await;
    eprintln!("revoked on one gateway, refused on the other after {seen:?}");

    // A gateway that starts later loads every key.
    let (_, later) = admin_a
        .create(r#"{"tenant": "beta", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#)
        .await;
    let c = Tollgate::spawn(&args);
    let pc = format!("http://{}", c.addr);
    assert_eq!(orders(&http, &pc, &later).await.0, StatusCode::OK);
    refused_as_revoked(orders(&http, &pc, &secret).await);

    // A gateway that loses the store keeps the keys it has: the key is still known (the
    // limit's failure policy decides the rest), the revoked one still refused.
    lose();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_ne!(orders(&http, &pc, &later).await.0, StatusCode::UNAUTHORIZED);
    refused_as_revoked(orders(&http, &pc, &secret).await);
}

/// Every id the API accepts is reachable through its paths: read, rotated, patched, revoked.
/// Ids that break the alphabet are refused naming the field, and a key stored before ids kept
/// to it (`a/b`, `../x`, `q?x`) is still reached, and revoked, through a percent-encoded path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_id_the_api_accepts_can_be_reached_and_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path());
    let keys_file = dir.path().join("keys.db");
    // Keys stored by an older gateway, whose API let any printable id through.
    let now = jiff::Timestamp::now();
    let mut old_secrets = Vec::new();
    {
        let store = tollgate_keys::sqlite::SqliteKeys::open(&keys_file).unwrap();
        for id in ["a/b", "../x", "q?x", "p%41"] {
            let body = r#"{"tenant": "old", "limits": {"plan": {"rate": "600/60s", "burst": 20}}}"#;
            let c = tollgate_keys::change::Create::parse(body.as_bytes(), now).unwrap();
            let (mut rec, secret) = tollgate_keys::change::create(c, now);
            rec.id = id.to_string();
            assert!(store.insert_new(&rec).await.unwrap());
            old_secrets.push((id, secret));
        }
    }
    let args = [
        "demo",
        "--admin-token-file",
        &token,
        "--keys-file",
        keys_file.to_str().unwrap(),
    ];
    let gw = Tollgate::spawn(&args);
    let admin = Admin::new(gw.admin.unwrap());
    let http = Http::new();
    let public = format!("http://{}", gw.addr);

    for (id, why) in [
        ("a/b", "only letters"),
        ("../x", "only letters"),
        ("q?x", "only letters"),
        ("k 7", "only letters"),
        ("..", "dot segment"),
        ("", "1 to 128"),
    ] {
        let a = admin
            .call(
                Method::POST,
                "/admin/keys",
                leak(json!({"tenant": "acme", "id": id})),
            )
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{id:?}: {:?}", a.body);
        assert_eq!(a.json()["field"], "id", "{id:?}");
        assert!(
            a.json()["reason"].as_str().unwrap().contains(why),
            "{id:?}: {:?}",
            a.json()
        );
    }

    let plan = json!({"plan": {"rate": "600/60s", "burst": 20}});
    let longest = "z".repeat(128);
    for id in ["k-7.v_2", "...a", "A", longest.as_str()] {
        let a = admin
            .call(
                Method::POST,
                "/admin/keys",
                leak(json!({"tenant": "acme", "id": id, "limits": plan})),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED, "{id:?}: {:?}", a.body);
        let shown = admin.call(Method::GET, &format!("/admin/keys/{id}"), "").await;
        assert_eq!(shown.status, StatusCode::OK, "{id:?}");
        assert_eq!(shown.json()["id"], id);
        let rotated = admin
            .call(
                Method::POST,
                &format!("/admin/keys/{id}/rotate"),
                r#"{"grace_s": 0}"#,
            )
            .await;
        assert_eq!(rotated.status, StatusCode::OK, "{id:?}: {:?}", rotated.body);
        let secret = rotated.json()["secret"].as_str().unwrap().to_string();
        let patched = admin
            .call(
                Method::PATCH,
                &format!("/admin/keys/{id}"),
                r#"{"name": "renamed"}"#,
            )
            .await;
        assert_eq!(patched.status, StatusCode::OK, "{id:?}: {:?}", patched.body);
        let revoked = admin
            .call(Method::POST, &format!("/admin/keys/{id}/revoke"), "")
            .await;
        assert_eq!(revoked.status, StatusCode::OK, "{id:?}");
        let _ = until("a revoked key is refused", async || {
            orders(&http, &public, &secret).await == (StatusCode::UNAUTHORIZED, json!("key_revoked"))
        })
        .await;
    }

    for (id, secret) in &old_secrets {
        assert_eq!(orders(&http, &public, secret).await.0, StatusCode::OK, "{id}");
        let path: String = id.bytes().map(|b| format!("%{b:02X}")).collect();
        let shown = admin.call(Method::GET, &format!("/admin/keys/{path}"), "").await;
        assert_eq!(shown.status, StatusCode::OK, "{id}: {:?}", shown.body);
        assert_eq!(shown.json()["id"], *id);
        let revoked = admin
            .call(Method::POST, &format!("/admin/keys/{path}/revoke"), "")
            .await;
        assert_eq!(revoked.status, StatusCode::OK, "{id}");
        let _ = until("an old key revoked by its encoded path is refused", async || {
            orders(&http, &public, secret).await == (StatusCode::UNAUTHORIZED, json!("key_revoked"))
        })
        .await;
    }
    let broken = admin.call(Method::GET, "/admin/keys/a%2", "").await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    assert_eq!(broken.json()["field"], "path");
}
