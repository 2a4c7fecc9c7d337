//! `tollgate check-rules`: every shipped rules file passes with a summary, and each broken file
//! (one fault each) fails with its own message naming the file, the field and the reason.

mod common;

use std::process::Command;

fn check(path: &std::path::Path) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("check-rules")
        .arg(path)
        .output()
        .expect("run tollgate check-rules");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_shipped_rules_file_passes() {
    let mut files: Vec<_> = std::fs::read_dir(common::repo().join("rules"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        // The schema and the JWKS the demo rules name are not rules files.
        .filter(|p| !p.ends_with("schema.json") && !p.to_string_lossy().ends_with("-jwks.json"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for f in files {
        let (ok, stdout, stderr) = check(&f);
        assert!(ok, "{}: {stderr}", f.display());
        assert!(stdout.contains("OK, version"), "{stdout}");
        assert!(
            stdout.contains("limits:") && stdout.contains("routes:"),
            "{stdout}"
        );
    }
}

#[test]
fn the_summary_lists_rates_bursts_and_costs() {
    let (ok, stdout, _) = check(&common::repo().join("rules/demo.json"));
    assert!(ok);
    assert!(stdout.contains("version 1"), "{stdout}");
    assert!(
        stdout.contains("key k-7      600/60s (10.000/s), burst 20"),
        "{stdout}"
    );
    assert!(
        stdout.contains("exports      1/5s (0.200/s), burst 1"),
        "{stdout}"
    );
    assert!(stdout.contains("costs: exports 1, plan 10"), "{stdout}");
    assert!(
        stdout.contains("usage        GET /v1/usage -> (the caller's usage); key Required; costs: usage 1"),
        "{stdout}"
    );
    assert!(
        stdout.contains("stream       GET /v1/stream -> orders; key Required; costs: plan 1, streams 1; upgrades to websocket, closed after 60000 ms idle"),
        "{stdout}"
    );
}

#[test]
fn the_summary_shows_the_prefixes_of_per_ip_limits() {
    let (ok, stdout, _) = check(&common::repo().join("rules/demo.json"));
    assert!(ok);
    assert!(
        stdout.contains("unauth       1/1s (1.000/s), burst 5; per client IP (IPv4 /32, IPv6 /64)"),
        "{stdout}"
    );
    let mut rules: serde_json::Value = serde_json::from_str(&common::demo_json()).unwrap();
    rules["limits"]["unauth"]["ipv6_prefix"] = serde_json::json!(56);
    rules["limits"]["unauth"]["ipv4_prefix"] = serde_json::json!(24);
    let (_dir, path) = common::rules_file(&rules.to_string());
    let (ok, stdout, stderr) = check(&path);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("burst 5; per client IP (IPv4 /24, IPv6 /56)"),
        "{stdout}"
    );
}

#[test]
fn each_broken_file_fails_with_its_own_message() {
    let dir = common::repo().join("tests/broken_rules");
    let cases = [
        ("unknown-field.json", "routes[0].costs: unknown field `costs`"),
        (
            "cost-over-burst.json",
            "routes[0].cost.exports: route \"POST /v1/exports\" costs 2 in limit \"exports\", above its burst 1",
        ),
        (
            "duplicate-key-hash.json",
            "keys[1].sha256: duplicate key hash: keys \"k-1\" and \"k-2\"",
        ),
        (
            "zero-rate.json",
            "limits.exports.rate: rate \"0/5s\": the rate must be above zero",
        ),
        (
            "upgrade-h2c.json",
            "routes[0].upgrade[1]: h2c is HTTP/2's own upgrade, which the gateway does not relay",
        ),
        (
            "upgrade-websocket-on-post.json",
            "routes[0].upgrade: a WebSocket opening handshake is a GET, so a route of POST never sees one",
        ),
        (
            "upgrade-not-a-token.json",
            "routes[0].upgrade[0]: \"web socket\" is not a protocol name",
        ),
        (
            "idle-timeout-without-upgrade.json",
            "routes[0].idle_timeout_ms: applies to upgraded connections only, and this route takes no upgrade",
        ),
        ("version-zero.json", "version: must be a positive integer"),
        ("version-negative.json", "version: must be a positive integer"),
        ("version-fraction.json", "version: must be a positive integer"),
        ("version-string.json", "version: must be a positive integer"),
        (
            "version-too-large.json",
            "version: must be at most 2^53 (9007199254740992), the largest integer JSON tools keep exact",
        ),
        (
            "missing-upstream.json",
            "routes[0].upstream: no upstream named \"billing\"",
        ),
        (
            "usage-with-upstream.json",
            "routes[0].upstream: a usage route (\"serve\": \"usage\") forwards nothing: it answers with the caller's budget itself, so it takes no upstream (remove \"upstream\": \"orders\")",
        ),
        (
            "route-path-not-canonical.json",
            "routes[0].path: \"/v1/./exports\" is not in canonical form; write \"/v1/exports\"",
        ),
        (
            "route-method-lowercase.json",
            "routes[0].method: methods are case-sensitive: write \"POST\", not \"post\"",
        ),
        (
            "route-method-connect.json",
            "routes[0].method: CONNECT is refused with 405",
        ),
        (
            "encoded-slashes-unknown.json",
            "upstreams.orders.encoded_slashes: unknown variant `decode`",
        ),
        (
            "quota-timezone-unknown.json",
            "keys[0].quota.timezone: key k-1: \"Europe/Pariss\" is not an IANA time zone name",
        ),
        (
            "charge-on-bad-status.json",
            "limits.exports.charge_on.status: 700 is not an HTTP status (100 to 599)",
        ),
        (
            "post-paid-cost-not-reserve.json",
            "routes[0].cost.tokens: limit \"tokens\" is post-paid: a request pays its reserve (5) up front and the rest when the answer reports it; write 5",
        ),
        (
            "post-paid-leased.json",
            "limits.tokens.lease: a post-paid limit (\"cost_from_response\") settles each charge after the answer",
        ),
        (
            "post-paid-bad-header.json",
            "limits.tokens.cost_from_response.header: \"X Usage\" is not a header name",
        ),
        (
            "reserve-without-cost-from-response.json",
            "limits.exports.reserve: only a post-paid limit (with \"cost_from_response\") takes a reserve or a debt",
        ),
        (
            "post-paid-debt-too-large.json",
            "limits.tokens.max_debt: a debt of 9007199254740000 tokens with this burst needs",
        ),
        (
            "block-for-bad-duration.json",
            "limits.exports.block_for: \"30 seconds\": unknown unit \" seconds\" (use ms, s, m or h)",
        ),
        (
            "block-for-too-short.json",
            "limits.exports.block_for: \"500ms\" is out of range: a block lasts 1s to 24h",
        ),
        (
            "delay-zero-wait.json",
            "limits.exports.delay.max_wait_ms: 0 is out of range: a request may wait 1 to 60000 ms for its tokens",
        ),
        (
            "delay-leased.json",
            "limits.plan.lease: a limit that queues (\"delay\") spends its shared bucket ahead of time",
        ),
        (
            "charge-on-leased.json",
            "limits.plan.charge_on: a limit charged on the answer gives charges back, so it is not leased",
        ),
        (
            "concurrent-with-rate.json",
            "limits.exports.rate: a limit on requests in flight (\"concurrent\") takes no other numbers or modes",
        ),
        (
            "concurrent-on-route.json",
            "limits.exports.concurrent: only key limits count requests in flight",
        ),
        (
            "concurrent-cost-two.json",
            "routes[0].cost.exports: a request takes one seat of a limit on requests in flight; write 1",
        ),
        (
            "global-route-limit.json",
            "limits.exports.scope: only key limits can be global: each key's number is what the Regions share",
        ),
        (
            "global-security-limit.json",
            "limits.plan.scope: a security limit is not shared out; give it a \"home_region\" instead",
        ),
        (
            "home-region-on-capacity.json",
            "limits.exports.home_region: only a security limit (\"class\": \"security\") has a home Region",
        ),
        (
            "home-region-bad-name.json",
            "limits.exports.home_region: \"eu west\" is not a Region name (letters, digits, - and _)",
        ),
        (
            "quota-on-route-limit.json",
            "limits.exports.quota: only a \"key\" limit may carry a quota",
        ),
        (
            "quota-on-two-limits.json",
            "limits.plan2.quota: limits \"plan\" and \"plan2\" both carry a quota; a key has one",
        ),
        (
            "quota-per-unknown.json",
            "keys[0].quota.per: unknown variant `week`, expected `day` or `month`",
        ),
        (
            "paths-unknown.json",
            "upstreams.orders.paths: unknown variant `insensitive`",
        ),
        (
            "dimension-unknown.json",
            "limits.exports.dimension: \"fingerprnt\" is not a dimension; use \"key\", \"route\", \"ip\", \"fingerprint\", {\"header\": NAME}, {\"body_field\": NAME} or {\"claim\": NAME}",
        ),
        (
            "jwt-route-without-settings.json",
            "routes[0].identity: a JWT route needs the top-level \"jwt\" settings (its JWKS, issuer and audience)",
        ),
        (
            "jwt-alg-confusion.json",
            "jwt.jwks: jwt-confused.jwks: keys[0]: alg HS256 does not fit the key's type, which verifies RS256 only",
        ),
        (
            "jwt-plans-on-route-limit.json",
            "limits.exports.plans: only key limits have plans: a plan is a tenant's numbers",
        ),
        (
            "ipv6-prefix-too-long.json",
            "limits.exports.ipv6_prefix: 129 is not a prefix length: use 0 to 128",
        ),
        (
            "ip-prefix-on-key-limit.json",
            "limits.plan.ipv4_prefix: only a limit with per-IP buckets takes a prefix",
        ),
        (
            "concurrency-min-zero.json",
            "upstreams.orders.concurrency.min: must be above zero",
        ),
        (
            "concurrency-min-negative.json",
            "upstreams.orders.concurrency.min: invalid value: integer `-1`, expected u32",
        ),
        (
            "concurrency-max-below-min.json",
            "upstreams.orders.concurrency.max: 5 is below min 10",
        ),
        (
            "concurrency-max-too-large.json",
            "upstreams.orders.concurrency.max: 5000000 is above 1000000, the most an adaptive limit may reach",
        ),
        (
            "concurrency-min-above-max-in-flight.json",
            "upstreams.orders.concurrency.min: 10 is above max_in_flight 8, the ceiling every limit stays under",
        ),
        (
            "concurrency-adaptive-string.json",
            "upstreams.orders.concurrency.adaptive: invalid type: string \"yes\", expected a boolean",
        ),
        (
            "concurrency-adaptive-missing.json",
            "upstreams.orders.concurrency: missing field `adaptive`",
        ),
        (
            "concurrency-unknown-field.json",
            "upstreams.orders.concurrency.window_ms: unknown field `window_ms`, expected one of `adaptive`, `min`, `max`",
        ),
        (
            "upstream-scheme-unsupported.json",
            "upstreams.orders.url: \"ftp://127.0.0.1:8081\": only http:// and https:// upstreams are supported",
        ),
        (
            "tls-on-http.json",
            "upstreams.orders.tls: \"http://127.0.0.1:8081\" is http://: only an https:// upstream takes TLS settings",
        ),
        ("tls-ca-missing.json", "upstreams.orders.tls.ca: cannot read "),
        (
            "tls-ca-not-pem.json",
            "upstreams.orders.tls.ca: tls-not-pem.pem: no CERTIFICATE block: expected PEM CA certificates",
        ),
        (
            "tls-bad-server-name.json",
            "upstreams.orders.tls.server_name: \"orders internal\" is not a DNS name or an IP address",
        ),
        (
            "tls-unknown-field.json",
            "upstreams.orders.tls.ca_file: unknown field `ca_file`, expected `ca` or `server_name`",
        ),
        (
            "targets-empty.json",
            "upstreams.orders.targets: must name at least one target",
        ),
        (
            "targets-weight-zero.json",
            "upstreams.orders.targets[0].weight: must be at least 1",
        ),
        (
            "targets-and-url.json",
            "upstreams.orders.targets: give `url` or `targets`, not both",
        ),
        (
            "balance-unknown.json",
            "upstreams.orders.balance: unknown variant `random`, expected one of `least_request`, `round_robin`, `hash`",
        ),
        (
            "balance-hash-without-key.json",
            "upstreams.orders.balance: \"hash\" keeps each caller to one target by its key id, and no route that requires a key (or a JWT) reaches this upstream, so every caller would be hashed by its address",
        ),
    ];
    let mut seen = std::collections::HashSet::new();
    for (file, expected) in cases {
        let path = dir.join(file);
        let (ok, _, stderr) = check(&path);
        assert!(!ok, "{file} passed");
        assert!(
            stderr.contains(&format!("{}: {expected}", path.display())),
            "{file}: {stderr}"
        );
        assert!(
            seen.insert(stderr.clone()),
            "{file} repeats another file's message"
        );
    }
    // The base the broken files come from is valid, so each fails for its one fault only.
    let base = std::fs::read_to_string(dir.join("valid-base.json.txt")).unwrap();
    let (_d, path) = common::rules_file(&base);
    let (ok, _, stderr) = check(&path);
    assert!(ok, "{stderr}");
}

#[test]
fn a_missing_file_is_named() {
    let (ok, _, stderr) = check(std::path::Path::new("/nonexistent/rules.json"));
    assert!(!ok);
    assert!(
        stderr.contains("/nonexistent/rules.json: (file): cannot read"),
        "{stderr}"
    );
}

#[test]
fn a_fingerprint_limit_is_summarised_as_such() {
    let text = common::demo_json();
    let mut r: serde_json::Value = serde_json::from_str(&text).unwrap();
    r["limits"]["clients"] = serde_json::json!({"dimension": "fingerprint", "rate": "20/60s", "burst": 20});
    let (_d, path) = common::rules_file(&r.to_string());
    let (ok, stdout, stderr) = check(&path);
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("clients      20/60s (0.333/s), burst 20; per client fingerprint;"),
        "{stdout}"
    );
}

#[test]
fn the_summary_shows_an_adaptive_upstream_with_its_defaults() {
    let base =
        std::fs::read_to_string(common::repo().join("tests/broken_rules/valid-base.json.txt")).unwrap();
    let mut rules: serde_json::Value = serde_json::from_str(&base).unwrap();
    rules["upstreams"]["orders"]["concurrency"] = serde_json::json!({"adaptive": true});
    let (_d, path) = common::rules_file(&rules.to_string());
    let (ok, stdout, stderr) = check(&path);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("adaptive concurrency 4 to 2000"), "{stdout}");
    rules["upstreams"]["orders"]["concurrency"] = serde_json::json!({"adaptive": false, "min": 2});
    let (_d, path) = common::rules_file(&rules.to_string());
    let (ok, stdout, stderr) = check(&path);
    assert!(ok, "{stderr}");
    assert!(!stdout.contains("adaptive"), "{stdout}");
}
