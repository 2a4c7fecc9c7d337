//! JWT identity end to end, on real `tollgate` processes: tokens signed here with the keys in
//! tests/fixtures/jwt (made for these tests only) pass or get a 401 that says why; claims pick
//! the key id, tenant and plan; a reload brings a new JWKS in; `tollgate demo-token` passes
//! the demo gateway.

mod common;

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use common::{Http, Tollgate};
use http::StatusCode;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

const ISS: &str = "https://issuer.test";
const AUD: &str = "orders-api";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(common::repo().join("tests/fixtures/jwt").join(name)).unwrap()
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// Claims of a good token for `sub` in `org` on `plan`; tests change one thing at a time.
fn claims(sub: &str, org: &str, plan: &str) -> Value {
    json!({"sub": sub, "org": org, "plan": plan, "iss": ISS, "aud": AUD, "exp": now() + 600})
}

fn sign(alg: Algorithm, kid: Option<&str>, key: &EncodingKey, claims: &Value) -> String {
    let mut h = Header::new(alg);
    h.kid = kid.map(str::to_string);
    jsonwebtoken::encode(&h, claims, key).unwrap()
}

fn ed(name: &str) -> EncodingKey {
    EncodingKey::from_ed_pem(&fixture(name)).unwrap()
}

/// A token signed with the Ed25519 fixture key `ed-1`.
fn ed1(claims: &Value) -> String {
    sign(Algorithm::EdDSA, Some("ed-1"), &ed("ed.pem"), claims)
}

/// The rules of these tests: the JWKS named relative to the rules file, a plan limit, a limit
/// per `sub` claim, and a small unauthenticated allowance per IP.
fn rules(version: u64, jwks: &str, unauth_burst: u64) -> String {
    json!({
        "version": version,
        "upstreams": {"orders": {"url": "http://127.0.0.1:9"}},
        "limits": {
            "plan": {"dimension": "key", "plans": {
                "free": {"rate": "1/60s", "burst": 3},
                "pro": {"rate": "100/1s", "burst": 100}
            }},
            "per_user": {"dimension": {"claim": "sub"}, "rate": "1/60s", "burst": 5},
            "unauth": {"dimension": "ip", "rate": "1/60s", "burst": unauth_burst}
        },
        "routes": [
            {"name": "jwt", "method": "GET", "path": "/v2/orders", "upstream": "orders",
             "identity": "jwt", "cost": {"plan": 1, "per_user": 1}}
        ],
        "unauthenticated": {"limit": "unauth"},
        "jwt": {"jwks": jwks, "issuer": ISS, "audience": AUD, "leeway_s": 30,
                "key_claim": "sub", "tenant_claim": "org"}
    })
    .to_string()
}

fn write_atomically(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A rules directory with the fixture JWKS copied in as `keys.json`.
fn rules_dir(unauth_burst: u64) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.json"), fixture("jwks.json")).unwrap();
    let path = dir.path().join("rules.json");
    std::fs::write(&path, rules(1, "keys.json", unauth_burst)).unwrap();
    (dir, path.to_str().unwrap().to_string())
}

async fn get(http: &Http, gw: &Tollgate, token: Option<&str>) -> (StatusCode, Value) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let a = http.get(&gw.url("/v2/orders"), &headers).await;
    let mut body = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
    if let Some(w) = a.header("www-authenticate") {
        body["www-authenticate"] = w.into();
    }
    (a.status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_good_token_passes_and_each_refusal_says_why() {
    let (_dir, path) = rules_dir(1000);
    let hs_secret = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(String::from_utf8(fixture("hs.secret")).unwrap().trim())
        .unwrap();
    let rsa = EncodingKey::from_rsa_pem(&fixture("rsa.pem")).unwrap();
    let good = |sub: &str| claims(sub, "acme", "pro");
    let with = |change: Value| {
        let mut c = good("k-1");
        for (k, v) in change.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    };
    let alg_none = {
        let b64 = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
        format!(
            "{}.{}.",
            b64(&json!({"alg": "none", "typ": "JWT"})),
            b64(&good("k-1"))
        )
    };
    // The attack: the RSA public key, which anyone has, as an HMAC secret.
    let rsa_public = EncodingKey::from_secret(&fixture("rsa-public.pem")).unwrap();
    let tampered = {
        let t = ed1(&good("k-1"));
        let (head, _) = t.rsplit_once('.').unwrap();
        format!("{head}.{}", ed1(&good("k-2")).rsplit_once('.').unwrap().1)
    };
    let cases: Vec<(&str, Option<String>, Option<&str>)> = vec![
        (
            "RS256",
            Some(sign(Algorithm::RS256, Some("rsa-1"), &rsa, &good("k-rs"))),
            None,
        ),
        (
            "ES256",
            Some(sign(
                Algorithm::ES256,
                Some("ec-1"),
                &EncodingKey::from_ec_pem(&fixture("ec.pem")).unwrap(),
                &good("k-es"),
            )),
            None,
        ),
        ("EdDSA", Some(ed1(&good("k-ed"))), None),
        (
            "HS256 with the oct key",
            Some(sign(
                Algorithm::HS256,
                Some("hs-1"),
                &EncodingKey::from_secret(&hs_secret).unwrap(),
                &good("k-hs"),
            )),
            None,
        ),
        (
            "EdDSA without kid",
            Some(sign(Algorithm::EdDSA, None, &ed("ed.pem"), &good("k-nokid"))),
            None,
        ),
        ("no token", None, Some("token_missing")),
        ("not a JWT", Some("k7-demo-key".into()), Some("token_malformed")),
        (
            "expired beyond the leeway",
            Some(ed1(&with(json!({"exp": now() - 120})))),
            Some("token_expired"),
        ),
        (
            "not yet valid beyond the leeway",
            Some(ed1(&with(json!({"nbf": now() + 120})))),
            Some("token_not_yet_valid"),
        ),
        (
            "wrong issuer",
            Some(ed1(&with(json!({"iss": "https://evil.test"})))),
            Some("wrong_issuer"),
        ),
        (
            "wrong audience",
            Some(ed1(&with(json!({"aud": "another-api"})))),
            Some("wrong_audience"),
        ),
        (
            "signed by another key",
            Some(sign(Algorithm::EdDSA, Some("ed-1"), &ed("ed2.pem"), &good("k-1"))),
            Some("bad_signature"),
        ),
        (
            "claims swapped under a signature",
            Some(tampered),
            Some("bad_signature"),
        ),
        ("alg none", Some(alg_none), Some("alg_not_allowed")),
        (
            "HS256 with the RSA public key as secret, RSA kid",
            Some(sign(Algorithm::HS256, Some("rsa-1"), &rsa_public, &good("k-1"))),
            Some("alg_mismatch"),
        ),
        (
            "HS256 with the RSA public key as secret, no kid",
            Some(sign(Algorithm::HS256, None, &rsa_public, &good("k-1"))),
            Some("bad_signature"),
        ),
        (
            "unknown kid",
            Some(sign(Algorithm::EdDSA, Some("nope"), &ed("ed.pem"), &good("k-1"))),
            Some("unknown_kid"),
        ),
        (
            "no sub",
            Some(ed1(&with(json!({"sub": null})))),
            Some("missing_claim"),
        ),
        (
            "plan not in the rules",
            Some(ed1(&with(json!({"plan": "gold"})))),
            Some("unknown_plan"),
        ),
    ];
    let http = Http::new();
    for lane in [true, false] {
        let mut args = vec!["demo", "--rules", &path];
        if !lane {
            args.push("--no-express");
        }
        let gw = Tollgate::spawn(&args);
        for (what, token, refused) in &cases {
            let (status, body) = get(&http, &gw, token.as_deref()).await;
            match refused {
                None => {
                    assert_eq!(status, StatusCode::OK, "{what} (lane {lane}): {body}");
                    let sub = token
                        .as_deref()
                        .and_then(|t| jsonwebtoken::dangerous::insecure_decode::<Value>(t).ok())
                        .map(|d| d.claims["sub"].clone())
                        .unwrap();
                    assert_eq!(
                        body["headers"]["x-tollgate-key-id"], sub,
                        "{what}: the key id is the sub"
                    );
                    assert_eq!(
                        body["headers"]["x-tollgate-tenant"], "acme",
                        "{what}: the tenant is the org"
                    );
                    assert!(
                        body["headers"].get("authorization").is_none(),
                        "{what}: the token is not forwarded"
                    );
                }
                Some(reason) => {
                    assert_eq!(status, StatusCode::UNAUTHORIZED, "{what} (lane {lane}): {body}");
                    assert_eq!(body["error"], "unauthorized", "{what}");
                    assert_eq!(body["reason"], *reason, "{what}: {body}");
                    let challenge = if *reason == "token_missing" {
                        "Bearer".to_string()
                    } else {
                        format!("Bearer error=\"invalid_token\", error_description=\"{reason}\"")
                    };
                    assert_eq!(body["www-authenticate"], challenge.as_str(), "{what}");
                }
            }
        }
        // Logs name the caller by its key id, never by its token.
        let log = gw.stderr_when(|l| l.contains("k-rs")).await;
        assert!(log.contains("k-rs"), "access lines name the key id: {log}");
        for (what, token, _) in &cases {
            if let Some(t) = token {
                let sig = t.rsplit_once('.').map_or(t.as_str(), |(_, s)| s);
                assert!(
                    sig.is_empty() || !log.contains(sig),
                    "{what}: the token reached the log"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_pay_the_unauthenticated_bucket_of_their_ip() {
    let (_dir, path) = rules_dir(3);
    let gw = Tollgate::spawn(&["demo", "--rules", &path]);
    let http = Http::new();
    let expired = ed1(&{
        let mut c = claims("k-1", "acme", "pro");
        c["exp"] = json!(now() - 600);
        c
    });
    for i in 0..3 {
        let (s, body) = get(&http, &gw, Some(&expired)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "attempt {i}: {body}");
        assert_eq!(body["reason"], "token_expired");
    }
    let (s, body) = get(&http, &gw, Some(&expired)).await;
    assert_eq!(
        s,
        StatusCode::TOO_MANY_REQUESTS,
        "the IP's bucket is empty: {body}"
    );
    assert_eq!(body["limit"], "unauth");
    let (s, body) = get(&http, &gw, None).await;
    assert_eq!(
        s,
        StatusCode::TOO_MANY_REQUESTS,
        "a missing token pays it too: {body}"
    );
    let (s, body) = get(&http, &gw, Some(&ed1(&claims("k-1", "acme", "pro")))).await;
    assert_eq!(s, StatusCode::OK, "a good token does not pay it: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_pick_the_tenant_plan_and_claim_buckets() {
    let (_dir, path) = rules_dir(1000);
    let gw = Tollgate::spawn(&["demo", "--rules", &path]);
    let http = Http::new();
    let auth = |t: &str| format!("Bearer {t}");

    // free: burst 3 per tenant, shared by the tenant's users.
    let free_a = ed1(&claims("a-1", "org-free", "free"));
    let free_b = ed1(&claims("a-2", "org-free", "free"));
    for (i, t) in [&free_a, &free_b, &free_a].into_iter().enumerate() {
        let a = http
            .get(&gw.url("/v2/orders"), &[("authorization", &auth(t))])
            .await;
        assert_eq!(a.status, StatusCode::OK, "free request {i}");
        let policy = a.header("ratelimit-policy").unwrap_or_default();
        assert!(
            policy.contains("\"plan-burst\";q=3;"),
            "the free plan's numbers: {policy}"
        );
    }
    let a = http
        .get(&gw.url("/v2/orders"), &[("authorization", &auth(&free_b))])
        .await;
    assert_eq!(
        a.status,
        StatusCode::TOO_MANY_REQUESTS,
        "the tenant's plan bucket is empty"
    );
    assert_eq!(a.json()["limit"], "plan");

    // pro: the plan does not stop it; the per-`sub` claim limit (burst 5) does, per user.
    let pro_1 = ed1(&claims("p-1", "org-pro", "pro"));
    for i in 0..5 {
        let (s, body) = get(&http, &gw, Some(&pro_1)).await;
        assert_eq!(s, StatusCode::OK, "pro request {i}: {body}");
    }
    let (s, body) = get(&http, &gw, Some(&pro_1)).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(body["limit"], "per_user", "the sub's own bucket, not the plan's");
    let (s, body) = get(&http, &gw, Some(&ed1(&claims("p-2", "org-pro", "pro")))).await;
    assert_eq!(
        s,
        StatusCode::OK,
        "another user of the tenant has a bucket of its own: {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_with_a_new_jwks_takes_effect_without_a_restart() {
    let (dir, path) = rules_dir(1000);
    let gw = Tollgate::spawn(&["demo", "--rules", &path]);
    let http = Http::new();
    let old = ed1(&claims("k-1", "acme", "pro"));
    let new = sign(
        Algorithm::EdDSA,
        Some("ed-2"),
        &ed("ed2.pem"),
        &claims("k-1", "acme", "pro"),
    );
    assert_eq!(get(&http, &gw, Some(&old)).await.0, StatusCode::OK);
    let (s, body) = get(&http, &gw, Some(&new)).await;
    assert_eq!(
        (s, &body["reason"]),
        (StatusCode::UNAUTHORIZED, &json!("unknown_kid")),
        "{body}"
    );

    // The new JWKS first, then the rules that name it.
    std::fs::write(dir.path().join("keys-2.json"), fixture("jwks2.json")).unwrap();
    write_atomically(Path::new(&path), rules(2, "keys-2.json", 1000).as_bytes());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, _) = get(&http, &gw, Some(&new)).await;
        if s == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the new key's token never passed: {}",
            gw.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, body) = get(&http, &gw, Some(&old)).await;
    assert_eq!(
        (s, &body["reason"]),
        (StatusCode::UNAUTHORIZED, &json!("unknown_kid")),
        "the old key is gone: {body}"
    );

    // A rules version whose JWKS is missing is refused whole; the running rules stay.
    write_atomically(Path::new(&path), rules(3, "missing.json", 1000).as_bytes());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(get(&http, &gw, Some(&new)).await.0, StatusCode::OK);
    let log = gw.stderr();
    assert!(
        log.contains("jwt.jwks") && log.contains("missing.json"),
        "the refusal names the field and file: {log}"
    );
}

fn demo_token(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("demo-token")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "demo-token failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_tokens_pass_the_demo_gateway() {
    let gw = Tollgate::spawn(&["demo"]);
    let http = Http::new();
    let pro = demo_token(&["--sub", "k-7", "--plan", "pro"]);
    let a = http
        .get(
            &gw.url("/v2/orders"),
            &[("authorization", &format!("Bearer {pro}"))],
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{:?}", a.body);
    assert_eq!(a.json()["headers"]["x-tollgate-key-id"], "k-7");
    let policy = a.header("ratelimit-policy").unwrap_or_default();
    assert!(
        policy.contains("\"jwt_plan-burst\";q=200;"),
        "the pro plan's numbers: {policy}"
    );

    // free: burst 20 at 10 a second; 30 at once can't all pass.
    let free = demo_token(&["--sub", "k-9", "--exp-seconds", "60"]);
    let mut statuses = Vec::new();
    for _ in 0..30 {
        statuses.push(
            http.get(
                &gw.url("/v2/orders"),
                &[("authorization", &format!("Bearer {free}"))],
            )
            .await
            .status,
        );
    }
    assert!(
        statuses[..20].iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    assert!(statuses.contains(&StatusCode::TOO_MANY_REQUESTS), "{statuses:?}");

    // The API-key routes are as they were.
    let a = http
        .get(&gw.url("/v1/orders"), &[("authorization", "Bearer k7-demo-key")])
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let a = http
        .get(&gw.url("/v2/orders"), &[("authorization", "Bearer k7-demo-key")])
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "an API key is not a token");
    assert_eq!(a.json()["reason"], "token_malformed");
}
