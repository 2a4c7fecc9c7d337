//! A store over TLS, as a managed Redis is: real `redis-server` processes listening with TLS only
//! (`common::redis_tls`), and real gateway processes with `--store rediss://…`. Two gateways
//! share one limit through it; a certificate that does not check out (a CA the gateway doesn't
//! trust, an expired certificate, a name it doesn't carry, no client certificate where the store
//! asks for one) stops start-up with the store and the reason, and never falls back to plain text.

mod common;

use std::process::Command;

use common::redis_tls::{ClientAuth, RedisTlsServer, ServerCert, TestPki};
use common::{Http, Tollgate};

/// The demo's rules with k-7's plan at a burst of 10 and one token a minute: two gateways that
/// share the bucket admit 10 of 40 between them, two that don't would admit 20.
fn tight_rules() -> (tempfile::TempDir, std::path::PathBuf) {
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_json()).unwrap();
    for k in rules["keys"].as_array_mut().unwrap() {
        if k["id"] == "k-7" {
            k["limits"]["plan"] = serde_json::json!({"rate": "1/60s", "burst": 10});
        }
    }
    common::rules_file(&rules.to_string())
}

/// `tollgate check-store` with `args`: (exit success, stdout, stderr).
fn check_store(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::gateway_bin())
        .arg("check-store")
        .args(args)
        .output()
        .expect("tollgate check-store runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn path(p: std::path::PathBuf) -> String {
    p.to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_limit_over_tls_with_a_client_certificate() {
    let pki = TestPki::new();
    let redis = RedisTlsServer::start_with(&pki, ServerCert::Good, ClientAuth::Yes, &[]);
    let (_dir, rules) = tight_rules();
    let (ca, cert, key) = (
        path(pki.ca_pem()),
        path(pki.client_cert_pem()),
        path(pki.client_key_pem()),
    );
    let url = redis.url();
    let args = [
        "demo",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        &url,
        "--store-ca",
        &ca,
        "--store-cert",
        &cert,
        "--store-key",
        &key,
    ];
    let mut a = Tollgate::spawn(&args);
    let mut b = Tollgate::spawn(&args);
    let http = Http::new();
    let mut admitted = 0;
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..40 {
        let gw = if i % 2 == 0 { &a } else { &b };
        let r = http
            .get(&gw.url("/v1/orders"), &[("authorization", "Bearer k7-demo-key")])
            .await;
        *statuses.entry(r.status.as_u16()).or_insert(0) += 1;
        if r.status == 200 {
            admitted += 1;
        }
    }
    // One token a minute: at most one more than the burst in any test's time.
    assert!(
        (10..=11).contains(&admitted),
        "two gateways on one TLS store admitted {admitted} of 40 ({statuses:?}); one bucket admits 10 or 11, two 20"
    );
    assert_eq!(statuses.len(), 2, "only 200s and 429s: {statuses:?}");
    assert!(statuses.contains_key(&429), "{statuses:?}");
    // The store's own count of TLS connections: every one of them came over TLS, since the
    // plain port is off (`port 0`).
    let clients = redis.cli(&["CLIENT", "LIST"]);
    assert!(
        clients.lines().count() >= 3,
        "the gateways hold connections: {clients}"
    );
    let log = a.stderr_when(|l| l.contains("store found")).await;
    let found = log
        .lines()
        .find(|l| l.contains("store found"))
        .unwrap_or_else(|| panic!("no start-up line about the store in {log}"));
    assert!(
        found.contains(&format!("redis at {url}")) && found.contains("; TLS;") && found.contains("Redis 7"),
        "{found}"
    );

    // The meter reads their usage records over TLS too, with the same flags.
    a.stop();
    b.stop();
    let meter = |sub: &[&str], extra: &[&str]| {
        let out = Command::new(common::gateway_bin())
            .arg("meter")
            .args(sub)
            .args([
                "--store",
                &url,
                "--store-ca",
                &ca,
                "--store-cert",
                &cert,
                "--store-key",
                &key,
            ])
            .args(["--rules", rules.to_str().unwrap()])
            .args(extra)
            .output()
            .expect("tollgate meter runs");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "tollgate meter {sub:?}: {err}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    meter(&[], &["--once"]);
    let usage: serde_json::Value = serde_json::from_str(&meter(&["usage"], &["--key", "k-7"])).unwrap();
    assert_eq!(usage["admitted"], admitted, "{usage}");
    // Without the CA the meter refuses to read, naming TLS.
    let out = Command::new(common::gateway_bin())
        .args([
            "meter",
            "--once",
            "--store",
            &url,
            "--rules",
            rules.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&url), "{err}");
}

#[test]
fn a_certificate_that_does_not_check_out_stops_start_up_with_its_reason() {
    let pki = TestPki::new();
    let good = RedisTlsServer::start(&pki);
    let expired = RedisTlsServer::start_with(&pki, ServerCert::Expired, ClientAuth::No, &[]);
    let other_name = RedisTlsServer::start_with(&pki, ServerCert::OtherName, ClientAuth::No, &[]);
    let wants_cert = RedisTlsServer::start_with(&pki, ServerCert::Good, ClientAuth::Yes, &[]);
    let (ca, other_ca) = (path(pki.ca_pem()), path(pki.other_ca_pem()));
    let cases: [(&str, String, Vec<&str>, &str); 5] = [
        (
            "the built-in roots don't hold the test CA",
            good.url(),
            vec![],
            "UnknownIssuer",
        ),
        (
            "a CA the store's certificate is not from",
            good.url(),
            vec!["--store-ca", &other_ca],
            "UnknownIssuer",
        ),
        (
            "an expired certificate",
            expired.url(),
            vec!["--store-ca", &ca],
            "Expired",
        ),
        (
            "a certificate for another name",
            other_name.url(),
            vec!["--store-ca", &ca],
            "NotValidForName",
        ),
        (
            "no client certificate where the store asks for one",
            wants_cert.url(),
            vec!["--store-ca", &ca],
            "",
        ),
    ];
    for (why, url, extra, reason) in &cases {
        let mut args = vec!["--store", url.as_str()];
        args.extend(extra.iter().copied());
        let (ok, out, err) = check_store(&args);
        assert!(!ok, "{why}: check-store passed: {out}");
        assert!(
            err.contains(&format!("TLS to the Redis store at {url} failed")) && err.contains(reason),
            "{why}: expected a TLS failure naming {url} and {reason:?}, got: {err}"
        );
    }
    // `serve` fails alike, before it listens.
    let (ok, err) = common::serve_and_exit(
        &common::demo_json(),
        &["--store", &expired.url(), "--store-ca", &ca],
    );
    assert!(
        !ok && err.contains("TLS to the Redis store") && err.contains("Expired"),
        "{err}"
    );

    // The name the certificate carries, given apart from the address, is taken.
    let (ok, out, err) = check_store(&[
        "--store",
        &other_name.url(),
        "--store-ca",
        &ca,
        "--store-server-name",
        "other.test",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("; TLS;") && out.contains("TIME in scripts allowed"),
        "{out}"
    );
}

#[test]
fn tls_settings_on_a_plain_store_and_bad_files_are_refused_by_name() {
    let pki = TestPki::new();
    let ca = path(pki.ca_pem());
    let (ok, _, err) = check_store(&["--store", "redis://127.0.0.1:1", "--store-ca", &ca]);
    assert!(!ok && err.contains("need a TLS store"), "{err}");
    let not_pem = path(pki.dir().join("not-a-ca.pem"));
    std::fs::write(&not_pem, "hello").unwrap();
    let (ok, _, err) = check_store(&["--store", "rediss://127.0.0.1:1", "--store-ca", &not_pem]);
    assert!(!ok && err.contains(&format!("--store-ca {not_pem}")), "{err}");
    let (ok, _, err) = check_store(&[
        "--store",
        "rediss://127.0.0.1:1",
        "--store-server-name",
        "not a name",
    ]);
    assert!(!ok && err.contains("--store-server-name"), "{err}");
}

#[test]
fn a_tls_store_down_at_start_is_never_tried_in_plain_text() {
    // A plain server on the port a TLS client is pointed at: the handshake fails, and the
    // gateway does not speak plain text to it instead.
    let plain = common::RedisServer::start();
    let pki = TestPki::new();
    let url = format!("rediss://127.0.0.1:{}", plain.port);
    let (ok, out, err) = check_store(&["--store", &url, "--store-ca", &path(pki.ca_pem())]);
    assert!(!ok, "check-store passed against a plain server: {out}");
    assert!(err.contains(&url), "{err}");
    // It is still the plain server's to answer; nothing the gateway sent reached its data.
    assert_eq!(plain.cli(&["DBSIZE"]), "0");
}
