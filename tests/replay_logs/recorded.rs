//! A real gateway's access log, replayed: a gateway process on the embedded store records mixed
//! traffic (bursts on three keys, exports, unknown keys, a post-paid route, a reload halfway)
//! in the JSON and the combined format; `tollgate replay` reads each log as it is, with the
//! gateway's other log lines, garbage and a cut last line among the access lines, and agrees
//! with every decision the gateway made. A tightened copy of the rules refuses more of exactly
//! the key it tightened, and `--max-newly-refused` holds such a change back with exit status 3.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;
use crate::common::{K7, K8, KBIG, Tollgate};

/// The demo rules at `version`, pointed at `upstream`.
fn rules_at(upstream: std::net::SocketAddr, version: u64) -> serde_json::Value {
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_rules_for(upstream)).unwrap();
    rules["version"] = serde_json::json!(version);
    rules
}

/// Requests of one kind: `n` of `method path` with `secret` (none when empty); the statuses.
async fn burst(
    http: &common::Http,
    gw: &Tollgate,
    method: &str,
    path: &str,
    secret: &str,
    n: usize,
) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    let auth = format!("Bearer {secret}");
    let headers: Vec<(&str, &str)> = if secret.is_empty() {
        vec![]
    } else {
        vec![("authorization", auth.as_str())]
    };
    for _ in 0..n {
        let m = http::Method::from_bytes(method.as_bytes()).unwrap();
        let body: &'static [u8] = if method == "POST" { b"{}" } else { b"" };
        let a = http.send(m, &gw.url(path), &headers, body).await;
        out.push(a.status.as_u16());
    }
    out
}

/// Records mixed traffic in `format`; returns the stderr file's copy (access lines and the
/// gateway's own log lines), the rules file of the second version, and the statuses sent.
async fn record(format: &str, dir: &Path) -> (PathBuf, PathBuf, Vec<u16>) {
    let upstream = common::start_demo_upstream().await;
    let rules_path = dir.join(format!("rules-{format}.json"));
    std::fs::write(&rules_path, rules_at(upstream, 1).to_string()).unwrap();
    let mut gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        rules_path.to_str().unwrap(),
        "--access-log-format",
        format,
        "--instance",
        "gw-a",
    ]);
    let http = common::Http::new();
    let mut statuses = Vec::new();
    // k-7: burst 20 of a 600/60s plan; 30 at once spend it.
    statuses.extend(burst(&http, &gw, "GET", "/v1/orders", K7, 30).await);
    // An export every 5 s per partner.
    statuses.extend(burst(&http, &gw, "POST", "/v1/exports", K8, 3).await);
    // Unknown keys pay their address's bucket (burst 5): 401, then 429.
    statuses.extend(burst(&http, &gw, "GET", "/v1/orders", "no-such-key", 8).await);
    // A reload halfway, limits unchanged: the log spans two versions.
    let reloaded = dir.join(format!("rules-{format}-v2.json"));
    std::fs::write(&reloaded, rules_at(upstream, 2).to_string()).unwrap();
    std::fs::copy(&reloaded, &rules_path).unwrap();
    let version = |gw: &Tollgate| {
        let http = http.clone();
        let url = gw.admin_url("/admin/rules");
        async move { http.get(&url, &[]).await.json()["version"].as_u64() }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while version(&gw).await != Some(2) {
        assert!(
            std::time::Instant::now() < deadline,
            "the reload to version 2 never came"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A post-paid route: k-8's tokens (burst 10,000, may owe one burst) reported by the
    // upstream, 6,000 a call: the third finds the bucket in debt.
    statuses.extend(burst(&http, &gw, "POST", "/v1/completions?tokens=6000", K8, 3).await);
    statuses.extend(burst(&http, &gw, "GET", "/v1/orders", KBIG, 25).await);
    statuses.extend(burst(&http, &gw, "GET", "/v1/orders", K8, 45).await);
    // No route: never checked.
    statuses.extend(burst(&http, &gw, "GET", "/nowhere", K7, 2).await);
    let (_, stderr) = gw.stop();
    let log = dir.join(format!("gateway-{format}.log"));
    // What a log cut mid-write leaves: garbage, and a last line without its end.
    let cut = match format {
        "json" => {
            r#"{"time":"2026-12-06T22:40:01.123+00:00","remote_addr":"127.0.0.1","remote_user":"k-7","request_me"#
        }
        _ => r#"127.0.0.1 - k-7 [06/Dec/2026:22:40:01 +0000] "GET /v1/orders HTTP/1.1" 200 312 "-" "cu"#,
    };
    std::fs::write(&log, format!("{stderr}\nnot an access line at all\n{cut}")).unwrap();
    (log, reloaded, statuses)
}

fn replay(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("replay")
        .args(args)
        .output()
        .expect("run tollgate replay");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn key<'a>(summary: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    summary["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["key"] == id)
        .unwrap_or_else(|| panic!("no key {id} in {summary}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_log_replays_to_the_gateways_own_decisions() {
    let dir = tempfile::tempdir().unwrap();
    for format in ["json", "combined"] {
        let (log, rules, statuses) = record(format, dir.path()).await;
        let refused = statuses.iter().filter(|s| **s == 429).count();
        assert!(
            refused >= 10,
            "{format}: too few refusals to judge by: {statuses:?}"
        );
        let (code, out, err) = replay(&[
            log.to_str().unwrap(),
            "--rules",
            rules.to_str().unwrap(),
            "--json",
        ]);
        assert_eq!(code, Some(0), "{format}: {err}");
        let summary: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        // Every request the gateway checked is replayed, and every decision agrees.
        let mut replayed = 0;
        let mut logged_refused = 0;
        for k in summary["keys"].as_array().unwrap() {
            assert_eq!(k["disagree"], 0, "{format}: {k}");
            assert_eq!(k["agree"], k["requests"], "{format}: {k}");
            replayed += k["requests"].as_u64().unwrap();
            logged_refused += k["logged_refused"].as_u64().unwrap();
        }
        // All but the two without a route.
        assert_eq!(replayed as usize, statuses.len() - 2, "{format}: {summary}");
        assert_eq!(logged_refused as usize, refused, "{format}: {summary}");
        // 30 at once on a burst of 20: how many the refill lets through depends on how fast
        // they arrive (the plan refills one every 100 ms), so only some must be refused; the
        // totals above hold the log to what the client saw.
        assert!(
            key(&summary, "k-7")["logged_refused"].as_u64().unwrap() >= 1,
            "{summary}"
        );
        assert!(
            key(&summary, "k-8")["logged_refused"].as_u64().unwrap() >= 2,
            "{summary}"
        );
        assert!(
            key(&summary, "-")["logged_refused"].as_u64().unwrap() >= 2,
            "{summary}"
        );
        assert_eq!(key(&summary, "k-big")["logged_refused"], 0, "{summary}");
        // The cut line and the garbage are counted, not fatal; so are the gateway's own lines.
        let lines = &summary["lines"];
        assert_eq!(lines["truncated"], 1, "{format}: {lines}");
        assert!(lines["skipped"].as_u64().unwrap() >= 2, "{format}: {lines}");
        assert_eq!(lines["not_checked"], 2, "{format}: {lines}");
        assert_eq!(lines["not_replayable"], 0, "{format}: {lines}");
        let versions = &summary["rules_versions"];
        assert!(
            versions["1"].as_u64().unwrap() > 0 && versions["2"].as_u64().unwrap() > 0,
            "{format}: {versions}"
        );
        let (code, table, err) = replay(&[log.to_str().unwrap(), "--rules", rules.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{err}");
        assert!(table.contains("versions 1, 2"), "{format}: {table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tightened_rule_shows_who_it_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let (log, rules, _) = record("json", dir.path()).await;
    let mut tight: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rules).unwrap()).unwrap();
    let k7 = tight["keys"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|k| k["id"] == "k-7")
        .unwrap();
    // The smallest burst the rules take: an export costs 10.
    k7["limits"]["plan"]["burst"] = serde_json::json!(10);
    let proposed = dir.path().join("tight.json");
    std::fs::write(&proposed, tight.to_string()).unwrap();
    let args = [
        log.to_str().unwrap(),
        "--rules",
        rules.to_str().unwrap(),
        "--against",
        proposed.to_str().unwrap(),
        "--json",
    ];
    let (code, out, err) = replay(&args);
    assert_eq!(code, Some(0), "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let k7 = key(&summary, "k-7");
    // 20 of k-7's 30 were admitted at burst 20; at burst 10 (and 10 a second) the same burst
    // gets 10 and what refills while it lasts.
    assert!(k7["newly_refused"].as_u64().unwrap() >= 5, "{k7}");
    assert_eq!(k7["newly_admitted"], 0, "{k7}");
    assert!(k7["longest_retry_after_s"].as_u64().unwrap() >= 1, "{k7}");
    for other in ["k-8", "k-big", "-"] {
        let k = key(&summary, other);
        assert_eq!(k["newly_refused"], 0, "{other}: {k}");
        assert_eq!(k["admitted_running"], k["admitted_proposed"], "{other}: {k}");
    }
    // Sorted by what they would lose: k-7 first.
    assert_eq!(summary["keys"][0]["key"], "k-7", "{summary}");

    // A pipeline's gate: any key losing more than the share it is allowed fails with 3.
    let mut gated: Vec<&str> = args.to_vec();
    gated.extend(["--max-newly-refused", "5"]);
    let (code, _, err) = replay(&gated);
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains("k-7"), "{err}");
    let mut lenient: Vec<&str> = args.to_vec();
    lenient.extend(["--max-newly-refused", "100"]);
    let (code, _, err) = replay(&lenient);
    assert_eq!(code, Some(0), "{err}");

    // A proposal that drops k-big: its requests would get 401, every one it was admitted.
    let mut dropped: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rules).unwrap()).unwrap();
    dropped["keys"]
        .as_array_mut()
        .unwrap()
        .retain(|k| k["id"] != "k-big");
    let proposed = dir.path().join("without-k-big.json");
    std::fs::write(&proposed, dropped.to_string()).unwrap();
    let (code, out, err) = replay(&[
        log.to_str().unwrap(),
        "--rules",
        rules.to_str().unwrap(),
        "--against",
        proposed.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let big = key(&summary, "k-big");
    assert_eq!(big["admitted_running"], 25, "{big}");
    assert_eq!(big["admitted_proposed"], 0, "{big}");
    assert_eq!(big["newly_refused"], 25, "{big}");
    assert_eq!(summary["keys"][0]["key"], "k-big", "{summary}");
}

/// Three gateway processes on one redis-server, their logs merged: every check reads the
/// store's one clock, and Redis runs the checks one at a time, so the merged order is the
/// order they ran in, but for checks in the same microsecond, whose order the log can't tell.
/// The bound: a disagreement needs such a tie on one key, and a swapped tie costs at most two
/// disagreements (one each way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_redis_replays_within_its_bound() {
    let redis = common::RedisServer::start();
    let upstream = common::start_demo_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.json");
    std::fs::write(&rules, rules_at(upstream, 1).to_string()).unwrap();
    let mut gateways: Vec<Tollgate> = (0..3)
        .map(|i| {
            Tollgate::spawn(&[
                "serve",
                "--rules",
                rules.to_str().unwrap(),
                "--store",
                &redis.url(),
                "--access-log-format",
                "json",
                "--instance",
                &format!("gw-{i}"),
            ])
        })
        .collect();
    // Four clients at once, each on its own gateway in turn: k-7 and k-8 spend their bursts
    // across the fleet.
    let mut tasks = Vec::new();
    for c in 0..4usize {
        let urls: Vec<String> = gateways.iter().map(|g| g.url("/v1/orders")).collect();
        tasks.push(tokio::spawn(async move {
            let http = common::Http::new();
            let mut statuses = Vec::new();
            for i in 0..60usize {
                let secret = if (i + c) % 2 == 0 { K7 } else { K8 };
                let auth = format!("Bearer {secret}");
                let url = &urls[(i + c) % urls.len()];
                let a = http.get(url, &[("authorization", auth.as_str())]).await;
                statuses.push(a.status.as_u16());
            }
            statuses
        }));
    }
    let mut refused = 0;
    for t in tasks {
        refused += t.await.unwrap().iter().filter(|s| **s == 429).count();
    }
    assert!(refused > 20, "too few refusals to judge by: {refused}");
    let mut logs = Vec::new();
    for (i, gw) in gateways.iter_mut().enumerate() {
        let (_, stderr) = gw.stop();
        let path = dir.path().join(format!("gw-{i}.log"));
        std::fs::write(&path, stderr).unwrap();
        logs.push(path);
    }
    // Ties: two checked lines of one key in the same microsecond.
    let mut seen = std::collections::HashMap::new();
    let mut ties = 0u64;
    for log in &logs {
        for line in std::fs::read_to_string(log).unwrap().lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if let (Some(t), Some(k)) = (v["check_us"].as_u64(), v["remote_user"].as_str()) {
                let n = seen.entry((k.to_string(), t)).or_insert(0u64);
                ties += *n;
                *n += 1;
            }
        }
    }
    let mut args: Vec<&str> = logs.iter().map(|p| p.to_str().unwrap()).collect();
    args.extend(["--rules", rules.to_str().unwrap(), "--json"]);
    let (code, out, err) = replay(&args);
    assert_eq!(code, Some(0), "{err}");
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let disagree: u64 = summary["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["disagree"].as_u64().unwrap())
        .sum();
    let requests: u64 = summary["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(requests, 240, "{summary}");
    assert!(
        disagree <= 2 * ties,
        "{disagree} disagreements with {ties} same-microsecond ties: {summary}"
    );
    eprintln!(
        "fleet of 3 on redis-server: {requests} requests, {refused} refused, {ties} ties, {disagree} disagreements"
    );
}
