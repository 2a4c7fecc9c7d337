//! Redis Cluster faults under load, through real gateway processes and real HTTP clients: a
//! master killed with SIGKILL while its replica takes over, and slots moved between masters
//! with `redis-cli --cluster reshard`; each prints the figures benches/README.md quotes. And
//! one check through the store while its slot is half moved, answered `ASK` then `MOVED`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Http, RedisCluster, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_store::slots::cluster_slot;

/// One test at a time: each runs a cluster, two gateways and a load, and two of them at once on
/// a small machine would be measuring each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Short, so a test sees the whole failover; the recovery bound is this plus 2 s.
const NODE_TIMEOUT_MS: u32 = 500;

/// The policies, in the order of the routes and the figures.
const POLICIES: [&str; 3] = ["open", "closed", "local"];

/// One limit per failure policy, on the caller's account header, far above the load, so every
/// refusal or bypass seen is the store's failure and never the limit's.
fn failover_rules(upstream: std::net::SocketAddr) -> String {
    let limits: Vec<String> = POLICIES
        .iter()
        .map(|p| {
            format!(
                r#""{p}": {{ "dimension": {{ "header": "X-Account" }}, "rate": "100000/1s",
                   "burst": 100000, "on_store_failure": "{p}" }}"#
            )
        })
        .collect();
    let routes: Vec<String> = POLICIES
        .iter()
        .map(|p| {
            format!(
                r#"{{ "name": "{p}", "method": "GET", "path": "/{p}", "upstream": "up",
                     "key": "optional", "cost": {{ "{p}": 1 }} }}"#
            )
        })
        .collect();
    format!(
        r#"{{ "version": 1, "upstreams": {{ "up": {{ "url": "http://{upstream}" }} }},
             "limits": {{ {} }}, "routes": [ {} ] }}"#,
        limits.join(","),
        routes.join(",")
    )
}

/// The slot of an account's buckets: every limit on the header shares its hash tag.
fn account_slot(account: &str) -> u16 {
    cluster_slot(format!("rl:{{h:{account}}}:x").as_bytes())
}

/// A master as `CLUSTER NODES` lists it.
#[derive(Debug, Clone)]
struct Master {
    id: String,
    port: u16,
    slots: Vec<(u16, u16)>,
}

impl Master {
    fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(lo, hi)| lo <= slot && slot <= hi)
    }
}

/// The masters that `node` knows of and that are not failed.
fn masters(node: &RedisServer) -> Vec<Master> {
    node.cli(&["CLUSTER", "NODES"])
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 || !f[2].contains("master") || f[2].contains("fail") {
                return None;
            }
            let port = f[1].split(['@', ':']).nth(1)?.parse().ok()?;
            let slots = f[8..]
                .iter()
                .filter(|r| !r.starts_with('['))
                .filter_map(|r| match r.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => r.parse().ok().map(|s| (s, s)),
                })
                .collect();
            Some(Master {
                id: f[0].to_string(),
                port,
                slots,
            })
        })
        .collect()
}

/// One answer the load got: when (ms since the load started), which route and account, the
/// status (0: the exchange itself failed) and, when not 200, what the body said.
#[derive(Debug, Clone)]
struct Shot {
    at_ms: u64,
    route: usize,
    account: usize,
    status: u16,
    body: String,
}

/// Sends requests round the routes, accounts and gateways until `stop`, each worker its own
/// share, and returns every answer.
#[allow(clippy::too_many_arguments)]
async fn load(
    http: Http,
    gateways: Arc<Vec<String>>,
    routes: Arc<Vec<String>>,
    accounts: Arc<Vec<String>>,
    stop: Arc<AtomicBool>,
    start: Instant,
    worker: usize,
    workers: usize,
) -> Vec<Shot> {
    let mut shots = Vec::new();
    let per_round = routes.len() * accounts.len();
    let mut i = worker;
    while !stop.load(Ordering::Relaxed) {
        let (route, account) = ((i % per_round) % routes.len(), (i % per_round) / routes.len());
        let gw = &gateways[(i / per_round + worker) % gateways.len()];
        let url = format!("{gw}{}", routes[route]);
        let r = http
            .try_send(Method::GET, &url, &[("x-account", &accounts[account])])
            .await;
        let at_ms = start.elapsed().as_millis() as u64;
        let (status, body) = match r {
            Ok(a) if a.status == StatusCode::OK => (200, String::new()),
            Ok(a) => (a.status.as_u16(), String::from_utf8_lossy(&a.body).into_owned()),
            Err(e) => (0, e),
        };
        shots.push(Shot {
            at_ms,
            route,
            account,
            status,
            body,
        });
        i += workers;
    }
    shots
}

/// Runs [`load`] on `workers` tasks; the handles give back the answers.
fn start_load(
    http: &Http,
    gateways: &[String],
    routes: &[String],
    accounts: &[String],
    workers: usize,
    start: Instant,
) -> (Arc<AtomicBool>, Vec<tokio::task::JoinHandle<Vec<Shot>>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (gateways, routes, accounts) = (
        Arc::new(gateways.to_vec()),
        Arc::new(routes.to_vec()),
        Arc::new(accounts.to_vec()),
    );
    let handles = (0..workers)
        .map(|w| {
            tokio::spawn(load(
                http.clone(),
                gateways.clone(),
                routes.clone(),
                accounts.clone(),
                stop.clone(),
                start,
                w,
                workers,
            ))
        })
        .collect();
    (stop, handles)
}

async fn stop_load(stop: Arc<AtomicBool>, handles: Vec<tokio::task::JoinHandle<Vec<Shot>>>) -> Vec<Shot> {
    stop.store(true, Ordering::Relaxed);
    let mut shots = Vec::new();
    for h in handles {
        shots.extend(h.await.expect("a load worker"));
    }
    shots.sort_by_key(|s| s.at_ms);
    shots
}

/// `tollgate_store_bypass_total` per policy, summed over its limits, in a `/metrics` page.
fn bypass_counts(text: &str) -> [u64; 3] {
    let mut out = [0; 3];
    for line in text
        .lines()
        .filter(|l| l.starts_with("tollgate_store_bypass_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        for (i, p) in POLICIES.iter().enumerate() {
            if labels.contains(&format!("policy=\"{p}\"")) {
                out[i] += value.parse::<f64>().expect("a counter value") as u64;
            }
        }
    }
    out
}

/// [`bypass_counts`] of one gateway.
async fn bypasses(http: &Http, admin_metrics: &str) -> [u64; 3] {
    let page = http.get(admin_metrics, &[]).await;
    bypass_counts(&String::from_utf8_lossy(&page.body))
}

async fn all_bypasses(http: &Http, gws: &[Tollgate]) -> [u64; 3] {
    let mut sum = [0; 3];
    for gw in gws {
        for (s, b) in sum
            .iter_mut()
            .zip(bypasses(http, &gw.admin_url("/metrics")).await)
        {
            *s += b;
        }
    }
    sum
}

fn gateway(rules: &std::path::Path, store: &str, timeout: &str) -> Tollgate {
    Tollgate::spawn(&[
        "serve",
        "--rules",
        rules.to_str().unwrap(),
        "--store",
        store,
        "--store-timeout",
        timeout,
        "--fleet-size",
        "2",
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_and_every_slot_comes_back_to_the_store() {
    let _serial = SERIAL.lock().await;
    let mut cluster = RedisCluster::with_replicas(NODE_TIMEOUT_MS);
    let upstream = common::start_demo_upstream().await;
    let (_dir, rules) = common::rules_file(&failover_rules(upstream));
    let url = cluster.url();
    // 250 ms: on two busy shared cores a loaded gateway misses the default 3 ms now and then,
    // and a timeout would read as the store failing where it did not.
    let gws = [gateway(&rules, &url, "250ms"), gateway(&rules, &url, "250ms")];
    let http = Http::new();

    // The master on the lowest port: the one a call without keys would pick first.
    let victim_idx = (0..cluster.nodes.len())
        .filter(|&i| cluster.nodes[i].cli(&["ROLE"]).starts_with("master"))
        .min_by_key(|&i| cluster.nodes[i].port)
        .expect("a master");
    let victim = masters(&cluster.nodes[victim_idx])
        .into_iter()
        .find(|m| m.port == cluster.nodes[victim_idx].port)
        .expect("the victim lists itself");
    let accounts: Vec<String> = (0..240).map(|n| format!("acct-{n}")).collect();
    let on_victim: Vec<bool> = accounts.iter().map(|a| victim.owns(account_slot(a))).collect();
    let victims = on_victim.iter().filter(|v| **v).count();
    assert!(
        victims > 40 && victims < 200,
        "the accounts should spread over the masters: {victims} of 240 on the victim"
    );

    let urls: Vec<String> = gws.iter().map(|g| g.url("")).collect();
    let routes: Vec<String> = POLICIES.iter().map(|p| format!("/{p}")).collect();
    let start = Instant::now();
    let (stop, handles) = start_load(&http, &urls, &routes, &accounts, 8, start);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        all_bypasses(&http, &gws).await,
        [0; 3],
        "the store decided everything before the kill"
    );

    // Watch the counters every 100 ms, and the cluster until the replica serves the slots.
    let watching = Arc::new(AtomicBool::new(true));
    let watch = {
        let (http, watching) = (http.clone(), watching.clone());
        let admins: Vec<String> = gws.iter().map(|g| g.admin_url("/metrics")).collect();
        tokio::spawn(async move {
            let mut samples: Vec<(u64, [u64; 3])> = Vec::new();
            while watching.load(Ordering::Relaxed) {
                let mut sum = [0; 3];
                for a in &admins {
                    for (s, b) in sum.iter_mut().zip(bypasses(&http, a).await) {
                        *s += b;
                    }
                }
                samples.push((start.elapsed().as_millis() as u64, sum));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        })
    };
    let killed_at = start.elapsed().as_millis() as u64;
    cluster.nodes[victim_idx].kill();
    let survivors: Vec<u16> = cluster
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != victim_idx)
        .map(|(_, n)| n.port)
        .collect();
    let redis_cli = common::require_binary("redis-cli");
    let promotion = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let cli = |p: &u16, args: &[&str]| {
                let out = std::process::Command::new(&redis_cli)
                    .args(["-p", &p.to_string()])
                    .args(args)
                    .output()
                    .expect("redis-cli runs");
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            // Three masters among the survivors: the victim's replica was promoted.
            let promoted = survivors
                .iter()
                .filter(|p| cli(p, &["ROLE"]).starts_with("master"))
                .count()
                == 3;
            if promoted
                && survivors
                    .iter()
                    .all(|p| cli(p, &["CLUSTER", "INFO"]).contains("cluster_slots_ok:16384"))
            {
                return start.elapsed().as_millis() as u64;
            }
            assert!(Instant::now() < deadline, "no replica took over in 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    // With one master of three away and no replica promoted yet, the gateways still say they
    // are ready: the probe goes to a master that answers.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for gw in &gws {
        let ready = http.get(&gw.admin_url("/readyz"), &[]).await;
        assert_eq!(ready.json()["status"], "ready", "{:?}", ready.body);
    }
    let promoted_at = promotion.await.unwrap();
    let bound_ms = u64::from(NODE_TIMEOUT_MS) + 2_000;
    let until = Duration::from_millis(killed_at + bound_ms + 1_000);
    tokio::time::sleep(until.saturating_sub(start.elapsed())).await;
    let shots = stop_load(stop, handles).await;
    watching.store(false, Ordering::Relaxed);
    let samples = watch.await.unwrap();

    // Every answer is a 200, or a closed limit's own 503 for an account of the lost master.
    let unexpected: Vec<String> = shots
        .iter()
        .filter(|s| {
            let expected_503 = s.status == 503
                && POLICIES[s.route] == "closed"
                && on_victim[s.account]
                && s.at_ms >= killed_at
                && s.body.contains("limiter_unavailable");
            s.status != 200 && !expected_503
        })
        .map(|s| {
            format!(
                "{} on /{} for {} ({} master) at {} ms: {}",
                s.status,
                POLICIES[s.route],
                accounts[s.account],
                if on_victim[s.account] { "lost" } else { "live" },
                s.at_ms,
                s.body
            )
        })
        .collect();
    let last_failed = shots.iter().filter(|s| s.status != 200).map(|s| s.at_ms).max();
    let finals = samples.last().expect("samples").1;
    let settled = samples
        .iter()
        .find(|(_, b)| *b == finals)
        .map(|(t, _)| *t)
        .unwrap();
    let recovered_ms = last_failed.unwrap_or(killed_at).max(settled) - killed_at;
    let window = |s: &&Shot| s.at_ms >= killed_at && s.at_ms <= killed_at + recovered_ms;
    let mut figures = String::new();
    for (r, p) in POLICIES.iter().enumerate() {
        let during: Vec<&Shot> = shots.iter().filter(window).filter(|s| s.route == r).collect();
        let admitted = during.iter().filter(|s| s.status == 200).count();
        let lost = during.iter().filter(|s| on_victim[s.account]).count();
        figures += &format!(
            "  {p:6}: {} requests ({lost} on the lost master), {admitted} admitted, {} bypassed\n",
            during.len(),
            finals[r]
        );
    }
    // Per 500 ms from the kill: answers, and refusals on the lost master's accounts and others.
    for step in 0..(shots.last().unwrap().at_ms.saturating_sub(killed_at) / 500 + 1) {
        let (lo, hi) = (killed_at + step * 500, killed_at + step * 500 + 500);
        let now: Vec<&Shot> = shots.iter().filter(|s| s.at_ms >= lo && s.at_ms < hi).collect();
        let failed = |lost: bool| {
            now.iter()
                .filter(|s| s.status != 200 && on_victim[s.account] == lost)
                .count()
        };
        let bypassed = |t: u64| {
            samples
                .iter()
                .rev()
                .find(|(at, _)| *at <= t)
                .map_or([0; 3], |x| x.1)
        };
        let (b0, b1) = (bypassed(lo), bypassed(hi));
        let by: Vec<u64> = (0..3).map(|i| b1[i] - b0[i]).collect();
        println!(
            "  +{:>5} ms: {:>5} answers, refused: {:>4} lost-master {:>4} live; bypassed open/closed/local {by:?}",
            step * 500,
            now.len(),
            failed(true),
            failed(false)
        );
    }
    println!(
        "failover: master killed at {killed_at} ms, replica serving after {} ms, every key on \
         the store after {recovered_ms} ms (bound {bound_ms} ms); {} requests in all\n{figures}",
        promoted_at - killed_at,
        shots.len()
    );
    let mut errors = String::new();
    for gw in &gws {
        let page = http.get(&gw.admin_url("/metrics"), &[]).await;
        let page = String::from_utf8_lossy(&page.body).into_owned();
        for line in page
            .lines()
            .filter(|l| l.starts_with("tollgate_store_errors_total{"))
        {
            errors += &format!("  {line}\n");
        }
    }
    println!("store errors per gateway:\n{errors}");
    assert!(
        unexpected.is_empty(),
        "{} unexpected answers (killed at {killed_at} ms), the first: {:#?}",
        unexpected.len(),
        &unexpected[..unexpected.len().min(10)]
    );
    assert!(
        recovered_ms <= bound_ms,
        "keys still off the store {recovered_ms} ms after the kill (bound {bound_ms} ms)\n{figures}"
    );
    assert!(
        finals.iter().all(|b| *b > 0),
        "every policy stood in for the lost master: {finals:?}"
    );
    assert!(
        shots.iter().any(|s| s.status == 503),
        "the closed limit refused while its slots had no master"
    );

    // Every key of every route, on both gateways, is decided by the store again.
    for (i, gw) in gws.iter().enumerate() {
        for route in &routes {
            for a in &accounts {
                let r = http.get(&gw.url(route), &[("x-account", a)]).await;
                assert_eq!(r.status, StatusCode::OK, "gateway {i} {route} {a}: {:?}", r.body);
            }
        }
    }
    assert_eq!(
        all_bypasses(&http, &gws).await,
        finals,
        "a key was still decided without the store after the failover"
    );
    for mut gw in gws {
        assert!(gw.child.try_wait().unwrap().is_none(), "a gateway exited");
        let (_, stderr) = gw.stop();
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// Two limits on the account, so every check is a script over two keys of one slot: the case a
/// half-moved slot answers with `TRYAGAIN`. Closed, so any check the store fails is a 503.
fn migration_rules(upstream: std::net::SocketAddr) -> String {
    format!(
        r#"{{ "version": 1, "upstreams": {{ "up": {{ "url": "http://{upstream}" }} }},
             "limits": {{
               "a": {{ "dimension": {{ "header": "X-Account" }}, "rate": "1/3600s", "burst": {BURST},
                      "on_store_failure": "closed" }},
               "b": {{ "dimension": {{ "header": "X-Account" }}, "rate": "1/3600s", "burst": {BURST},
                      "on_store_failure": "closed" }} }},
             "routes": [ {{ "name": "pair", "method": "GET", "path": "/pair", "upstream": "up",
                            "key": "optional", "cost": {{ "a": 1, "b": 1 }} }} ] }}"#
    )
}

/// Far more than the test spends, refilling one token an hour: the tokens a bucket reports are
/// exactly the burst less what it was charged, unless it was reset.
const BURST: u64 = 100_000;

/// Slots `redis-cli --cluster reshard` moves: it takes the source's lowest slots first.
const MOVED_SLOTS: u16 = 400;

/// `r=` of the `RateLimit` field: the whole tokens left.
fn remaining(a: &common::Answer) -> u64 {
    let v = a.header("ratelimit").expect("a RateLimit field");
    v.split(";r=")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no r= in {v:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_slots_under_load_fails_nothing_and_resets_no_bucket() {
    let _serial = SERIAL.lock().await;
    let cluster = RedisCluster::start();
    let upstream = common::start_demo_upstream().await;
    let (_dir, rules) = common::rules_file(&migration_rules(upstream));
    let url = cluster.url();
    let gws = [gateway(&rules, &url, "200ms"), gateway(&rules, &url, "200ms")];
    let http = Http::new();

    let all = masters(&cluster.nodes[0]);
    let source = all.iter().find(|m| m.owns(0)).expect("slot 0's master").clone();
    let target = all
        .iter()
        .find(|m| m.id != source.id)
        .expect("another master")
        .clone();
    let candidates = (0..50_000).map(|n| format!("acct-{n}"));
    let moving: Vec<String> = candidates
        .clone()
        .filter(|a| account_slot(a) < MOVED_SLOTS)
        .take(56)
        .collect();
    assert_eq!(moving.len(), 56);
    // 40 accounts under load in the slots that move, 20 elsewhere; 16 left alone during the move.
    let (sentinels, mut busy) = (moving[40..].to_vec(), moving[..40].to_vec());
    busy.extend(candidates.filter(|a| account_slot(a) >= MOVED_SLOTS).take(20));

    let pair = |gw: &Tollgate, a: &str| {
        let (http, url, a) = (http.clone(), gw.url("/pair"), a.to_string());
        async move { http.get(&url, &[("x-account", &a)]).await }
    };
    let key = |a: &str, l: &str| format!("rl:{{h:{a}}}:{l}");
    let mut before = Vec::new();
    for (i, a) in sentinels.iter().enumerate() {
        for _ in 0..7 {
            assert_eq!(pair(&gws[i % 2], a).await.status, StatusCode::OK);
        }
        for l in ["a", "b"] {
            let (k, page) = (key(a, l), tollgate_store::page::page_of(&key(a, l)));
            let raw = cluster.cli(&["--no-raw", "HGET", &page, &k]);
            assert!(raw.starts_with('"'), "{a}'s bucket {l}: {raw}");
            before.push(raw);
        }
    }

    let urls: Vec<String> = gws.iter().map(|g| g.url("")).collect();
    let start = Instant::now();
    let (stop, handles) = start_load(&http, &urls, &["/pair".to_string()], &busy, 8, start);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seed = format!("127.0.0.1:{}", source.port);
    let (from, to) = (source.id.clone(), target.id.clone());
    let (began, ended, out) = tokio::task::spawn_blocking(move || {
        let began = start.elapsed().as_millis() as u64;
        let out = std::process::Command::new(common::require_binary("redis-cli"))
            .args(["--cluster", "reshard", &seed])
            .args(["--cluster-from", &from, "--cluster-to", &to])
            .args(["--cluster-slots", &MOVED_SLOTS.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster reshard runs");
        (began, start.elapsed().as_millis() as u64, out)
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "reshard failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shots = stop_load(stop, handles).await;

    let moved = masters(&cluster.nodes[0])
        .into_iter()
        .find(|m| m.id == target.id)
        .unwrap();
    assert!(
        (0..MOVED_SLOTS).all(|s| moved.owns(s)),
        "slots 0..{MOVED_SLOTS} should now be on the target: {:?}",
        moved.slots
    );
    let during = shots
        .iter()
        .filter(|s| s.at_ms >= began && s.at_ms <= ended)
        .count();
    println!(
        "migration: {MOVED_SLOTS} slots moved in {} ms under load; {} requests in all, {during} \
         during the move",
        ended - began,
        shots.len()
    );
    let failed: Vec<String> = shots
        .iter()
        .filter(|s| s.status != 200)
        .map(|s| {
            format!(
                "{} for {} at {} ms: {}",
                s.status, busy[s.account], s.at_ms, s.body
            )
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed (move {began}..{ended} ms), the first: {:#?}",
        failed.len(),
        shots.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(during > 0, "the move happened under load");

    // The left-alone buckets moved byte for byte, and now live on the target.
    let target_node = cluster.nodes.iter().find(|n| n.port == target.port).unwrap();
    let mut after = Vec::new();
    for a in &sentinels {
        for l in ["a", "b"] {
            let (k, page) = (key(a, l), tollgate_store::page::page_of(&key(a, l)));
            after.push(target_node.cli(&["--no-raw", "HGET", &page, &k]));
        }
    }
    assert_eq!(after, before, "a bucket changed as its slot moved");
    // Every bucket, busy or not, holds the burst less what it was charged: none was reset.
    let mut charged = std::collections::HashMap::new();
    for s in &shots {
        *charged.entry(s.account).or_insert(0u64) += 1;
    }
    for (i, a) in sentinels.iter().enumerate() {
        assert_eq!(remaining(&pair(&gws[i % 2], a).await), BURST - 8, "{a}");
    }
    for (i, a) in busy.iter().enumerate() {
        let n = charged.get(&i).copied().unwrap_or(0);
        assert_eq!(remaining(&pair(&gws[i % 2], a).await), BURST - n - 1, "{a}");
    }
    for mut gw in gws {
        assert!(gw.child.try_wait().unwrap().is_none(), "a gateway exited");
        gw.stop();
    }
}

/// One bucket, on a clock the test holds still.
fn bucket(tag: &str) -> tollgate_limit::batch::CheckItem {
    use tollgate_limit::bucket::{BucketParams, Charge, Rate};
    let charge = Charge {
        params: BucketParams::new(Rate::parse("1/60s").unwrap(), 10).unwrap(),
        cost: 1,
        shadow: false,
    };
    tollgate_limit::batch::CheckItem::new(
        format!("rl:{{{tag}}}:plan").into(),
        charge,
        0,
        tollgate_limit::batch::FailurePolicy::Closed,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_follows_ask_and_moved_while_its_slot_moves() {
    let _serial = SERIAL.lock().await;
    use tollgate_store::Store;
    use tollgate_store::redis::{RedisStore, Target};
    let cluster = RedisCluster::start();
    let clock = tollgate_limit::clock::ManualClock::new(1_000_000_000);
    let nodes = cluster.node_list();
    let store = RedisStore::connect(Target::cluster(&nodes), Some(clock))
        .await
        .expect("connects");
    let it = bucket("conf");
    let slot = cluster_slot(it.key.as_bytes());
    let tokens = |o: &tollgate_limit::batch::Outcome| o.buckets[0].tokens / it.charge.params.scale;
    let first = store
        .check(std::slice::from_ref(&it))
        .await
        .expect("the store answers");
    assert_eq!(tokens(&first), 9);

    let all = masters(&cluster.nodes[0]);
    let source = all.iter().find(|m| m.owns(slot)).unwrap().clone();
    let target = all.iter().find(|m| m.id != source.id).unwrap().clone();
    let node = |port: u16| cluster.nodes.iter().find(|n| n.port == port).unwrap();
    let (src, dst) = (node(source.port), node(target.port));
    let slot = slot.to_string();
    assert_eq!(
        dst.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source.id]),
        "OK"
    );
    assert_eq!(
        src.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target.id]),
        "OK"
    );
    let port = target.port.to_string();
    // The bucket is a field of its page (lua/bucket.lua): the page is the key that moves.
    let page = tollgate_store::page::page_of(&it.key);
    let moved = src.cli(&["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS", &page]);
    assert_eq!(moved, "OK");

    // The slot is the source's still, the page the target's: the source answers ASK, and the
    // target, asked, TRYAGAIN (a script also names the bucket's key of the layout before
    // pages, which is on neither node), until the slot is the target's. The check waits
    // through it and lands on the moved bucket.
    let store = std::sync::Arc::new(store);
    let waiting = {
        let (store, it) = (store.clone(), it.clone());
        tokio::spawn(async move { store.check(std::slice::from_ref(&it)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "a check in a half-moved slot waits");
    // The move is set on the source first: for the next 100 ms the source says MOVED to the
    // target and the target, still importing, MOVED back. The check waits through that too.
    assert_eq!(src.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &target.id]), "OK");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "a check between two MOVEDs waits");
    assert_eq!(dst.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &target.id]), "OK");
    let asked = waiting
        .await
        .unwrap()
        .expect("ASK, TRYAGAIN and MOVED are followed");
    assert_eq!(tokens(&asked), 8, "the moved bucket, not a new one");

    // Now the source answers MOVED.
    let after = store
        .check(std::slice::from_ref(&it))
        .await
        .expect("MOVED is followed");
    assert_eq!(tokens(&after), 7);
}
