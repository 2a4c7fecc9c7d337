//! Redis Cluster (3 masters started by the test): a request whose buckets lie in several hash
//! slots is checked slot by slot (`tollgate_store::slots`): admitted, it pays every slot; refused
//! in a later slot, the earlier slots get back what they gave, unless the give-back is lost,
//! which leaves the tokens taken and is counted. The demo rules, unchanged, serve every route
//! against the cluster, `/login` with its per-account and per-IP limits included. (The
//! conformance suite on the cluster is in tests/store_conformance.rs.)

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Http, K7, K8, KBIG, RedisCluster, RedisServer, Tollgate};
use http::{Method, StatusCode};
use tollgate_limit::batch::{CheckItem, FailurePolicy};
use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_limit::clock::ManualClock;
use tollgate_limit::decision::decide;
use tollgate_store::Store;
use tollgate_store::guard::{FleetSize, Guard};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::slots::{Slots, cluster_slot};
use tollgate_telemetry::metrics::{Kind, Metrics};
use tollgate_testkit::stores::LostChanges;

/// A keyed route that pays a tenant bucket and a per-IP bucket: two hash tags in one request.
const CROSS_SLOT_RULES: &str = r#"{
  "version": 3,
  "upstreams": { "orders": { "url": "http://127.0.0.1:9" } },
  "limits": {
    "plan": { "dimension": "key", "rate": "10/1s", "burst": 20 },
    "per-ip": { "dimension": "ip", "rate": "5/1s", "burst": 5 }
  },
  "keys": [
    { "id": "k-7", "tenant": "k7",
      "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc" }
  ],
  "routes": [
    { "name": "search", "method": "GET", "path": "/v1/search", "upstream": "orders",
      "cost": { "plan": 1, "per-ip": 1 } }
  ]
}"#;

/// Tags in slots 4369 and 8331, on two masters of a fresh 3-master cluster.
const LOW: &str = "conf";
const HIGH: &str = "k8";

fn item(tag: &str, name: &str, burst: u64, cost: u64) -> CheckItem {
    let rate = Rate::parse("1/60s").unwrap();
    let charge = Charge {
        params: BucketParams::new(rate, burst).unwrap(),
        cost,
        shadow: false,
    };
    CheckItem::new(
        format!("rl:{{{tag}}}:{name}").into(),
        charge,
        0,
        FailurePolicy::Closed,
    )
}

/// What a bucket holds now, read through the store: a check that costs nothing.
async fn units(store: &dyn Store, it: &CheckItem) -> u64 {
    let mut probe = it.clone();
    probe.charge.cost = 0;
    let o = store.check(&[probe]).await.expect("the store answers");
    o.buckets[0].tokens
}

/// The bucket's bytes in the cluster (its field of its page), as redis-cli prints them.
fn raw(cluster: &RedisCluster, it: &CheckItem) -> String {
    let page = tollgate_store::page::page_of(&it.key);
    cluster.cli(&["--no-raw", "HGET", &page, &it.key])
}

/// The cluster on a clock the test holds still, so a give-back restores a bucket to the unit.
async fn cluster_store(cluster: &RedisCluster) -> (Arc<RedisStore>, Arc<ManualClock>) {
    let clock = ManualClock::new(1_000_000_000);
    let nodes = cluster.node_list();
    let store = RedisStore::connect(Target::cluster(&nodes), Some(clock.clone()))
        .await
        .expect("connects");
    (Arc::new(store), clock)
}

/// Slots in front of a guard in front of `inner`, as the gateway builds them.
fn guarded(inner: Arc<dyn Store>, clock: Arc<ManualClock>) -> (Slots, Arc<Metrics>) {
    let metrics = Metrics::new();
    let guard = Guard::new(
        inner,
        Duration::from_secs(2),
        Arc::new(FleetSize::fixed(1)),
        clock,
        Arc::new(|_| Arc::from("limit")),
        metrics.clone(),
    );
    (Slots::new(Arc::new(guard)), metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_two_slots_pays_both_or_neither() {
    assert!(cluster_slot(b"rl:{conf}:x") < cluster_slot(b"rl:{k8}:x"));
    let cluster = RedisCluster::start();
    let (redis, clock) = cluster_store(&cluster).await;
    let (slots, metrics) = guarded(redis.clone(), clock);
    let (plan, once) = (item(LOW, "plan", 5, 1), item(HIGH, "once", 1, 1));
    let scale = plan.charge.params.scale;
    // The later slot first in the batch: the order checked is the slots', not the batch's.
    let req = [once.clone(), plan.clone()];

    // (a) Admitted: both slots pay.
    let out = slots.check(&req).await.unwrap();
    assert!(out.admitted, "{out:?}");
    assert_eq!(units(&*redis, &plan).await, 4 * scale);
    assert_eq!(units(&*redis, &once).await, 0);

    // (b) Refused in the later slot: the earlier slot's bucket is exactly as it was.
    let before = raw(&cluster, &plan);
    assert!(!before.is_empty() && before != "(nil)", "{before}");
    let out = slots.check(&req).await.unwrap();
    assert!(!out.admitted);
    assert_eq!(
        raw(&cluster, &plan),
        before,
        "the earlier slot got its token back"
    );
    assert_eq!(units(&*redis, &plan).await, 4 * scale);
    // And it reads as one call's refusal would: the short bucket decides, with its wait, and
    // the earlier bucket reports the tokens it holds after the give-back.
    assert!(
        out.buckets[1].sufficient && out.buckets[1].tokens == 4 * scale,
        "{out:?}"
    );
    let d = decide(&req, &out);
    assert_eq!(d.deciding, Some(0));
    assert_eq!(d.retry_after(), Some(60));
    let gave = metrics.store_refunds.get_or_create(&Kind { kind: "store" }).get();
    assert_eq!(gave, 1, "one give-back, to the store");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_that_cannot_reach_its_slot_leaves_the_tokens_taken_and_is_counted() {
    let cluster = RedisCluster::start();
    let (redis, clock) = cluster_store(&cluster).await;
    let (slots, metrics) = guarded(Arc::new(LostChanges(redis.clone())), clock);
    let (plan, once) = (item(LOW, "plan", 5, 1), item(HIGH, "once", 1, 1));
    let scale = plan.charge.params.scale;
    let req = [plan.clone(), once.clone()];
    assert!(slots.check(&req).await.unwrap().admitted);

    let out = slots.check(&req).await.unwrap();
    assert!(!out.admitted, "the client still gets the refusal");
    assert_eq!(decide(&req, &out).deciding, Some(1));
    assert_eq!(
        units(&*redis, &plan).await,
        3 * scale,
        "the refused request's token stays taken until refill: an undercount"
    );
    assert_eq!(out.buckets[0].tokens, 3 * scale, "and its verdict says so");
    let lost = metrics
        .store_refund_failures
        .get_or_create(&Kind { kind: "error" })
        .get();
    assert_eq!(lost, 1);
}

/// POST /login through the gateway as client `ip` (behind the trusted proxy 127.0.0.1).
async fn login(http: &Http, gw: &Tollgate, account: &str, ip: &str) -> common::Answer {
    http.send(
        Method::POST,
        &gw.url("/login"),
        &[("x-account", account), ("x-forwarded-for", ip)],
        b"",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_rules_serve_every_route_on_a_cluster() {
    let cluster = RedisCluster::start();
    let url = cluster.url();

    // A keyed route over two tags is no longer refused; it serves on one node as on a cluster.
    let node = RedisServer::start();
    for store in [url.clone(), node.url()] {
        let (_dir, path) = common::rules_file(CROSS_SLOT_RULES);
        let gw = Tollgate::spawn(&["serve", "--rules", path.to_str().unwrap(), "--store", &store]);
        drop(gw);
    }

    let upstream = common::start_demo_upstream().await;
    let (_dir, path) = common::rules_file(&common::demo_rules_for(upstream));
    let gw = Tollgate::spawn(&[
        "serve",
        "--rules",
        path.to_str().unwrap(),
        "--store",
        &url,
        // What is shown is how a cluster decides, not a slow call's failure policy: a check
        // that misses the default 3 ms decides by `login`'s local share, which may admit (the
        // sixth try was once answered other than 429 on a busy host).
        "--store-timeout",
        "1s",
        "--trusted-proxy",
        "127.0.0.1",
    ]);
    let http = Http::new();
    let bearer = |k: &str| format!("Bearer {k}");
    let ready = http.get(&gw.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["store"], "redis-cluster");

    // /login without a key pays the account's bucket and the client IP's: two slots.
    // Per account (5 a minute): five tries from five addresses pass, the sixth is refused.
    for i in 1..=5 {
        let r = login(&http, &gw, "ann", &format!("10.0.1.{i}")).await;
        assert_eq!(r.status, StatusCode::OK, "ann's try {i}: {:?}", r.body);
    }
    let r = login(&http, &gw, "ann", "10.0.1.6").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.body);
    assert_eq!(r.json()["limit"], "login");
    assert!(r.header("retry-after").is_some());

    // Per IP (burst 5, 1 a second): one address trying fresh accounts is refused by the IP's
    // bucket. Accounts whose bucket sorts in a slot before the IP's are charged first, so the
    // refusal gives their token back: that account then still has its whole burst.
    let ip = "10.0.2.1";
    let ip_slot = cluster_slot(format!("rl:{{ip:{ip}}}:unauth").as_bytes());
    let before_ip: Vec<String> = (0..2_000)
        .map(|n| format!("acct-{n}"))
        .filter(|a| cluster_slot(format!("rl:{{h:{a}}}:login").as_bytes()) < ip_slot)
        .take(40)
        .collect();
    assert_eq!(before_ip.len(), 40, "accounts in lower slots than {ip}'s");
    let mut passed = 0;
    let mut refused_account = None;
    for a in &before_ip {
        let r = login(&http, &gw, a, ip).await;
        if r.status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(r.json()["limit"], "unauth", "{:?}", r.body);
            refused_account = Some(a.clone());
            break;
        }
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        passed += 1;
    }
    assert!(passed >= 5, "the IP's burst of 5 passes first: {passed}");
    let account = refused_account.expect("the IP's bucket refuses within 40 quick tries");
    // The refused try's account token came back: five more tries from other addresses pass
    // (its bucket refills one token in 12 s, far slower than these requests).
    for i in 1..=5 {
        let r = login(&http, &gw, &account, &format!("10.0.3.{i}")).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{account} from 10.0.3.{i}: {:?}",
            r.body
        );
    }

    // The keyed routes: k-7's burst of 20.
    for i in 0..20 {
        let r = http
            .get(&gw.url("/v1/orders"), &[("authorization", &bearer(K7))])
            .await;
        assert_eq!(r.status, StatusCode::OK, "k-7 request {i}: {:?}", r.body);
    }
    // k-8's first export passes, the second (1 per 5 s) is refused by the export limit.
    let export = |k: &'static str| {
        let http = http.clone();
        let url = gw.url("/v1/exports");
        async move {
            http.send(Method::POST, &url, &[("authorization", &bearer(k))], b"")
                .await
        }
    };
    assert_eq!(export(K8).await.status, StatusCode::OK);
    let refused = export(K8).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.json()["limit"], "exports");
    // k-big on the catch-all route.
    let r = http
        .get(&gw.url("/v1/anything"), &[("authorization", &bearer(KBIG))])
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    // Without a key: 401 while the IP's unauthenticated bucket (burst 5) lasts.
    let r = http.get(&gw.url("/v1/orders"), &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{:?}", r.body);

    // Each node holds the pages of its slots; the buckets are their fields.
    let per_node: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| {
            let pages = n.cli(&["KEYS", "rl:*"]);
            let mut buckets = Vec::new();
            for page in pages.lines().filter(|p| !p.is_empty()) {
                assert!(page.starts_with("rl:page:{"), "{page} is not a page");
                buckets.push(n.cli(&["HKEYS", page]));
            }
            buckets.join("\n")
        })
        .collect();
    let keys = per_node.join("\n");
    for key in [
        "rl:{k7}:plan",
        "rl:{k8}:plan",
        "rl:{k8}:exports:exports",
        "rl:{kbig}:plan",
        "rl:{ip:127.0.0.1}:unauth",
        "rl:{h:ann}:login",
        "rl:{ip:10.0.2.1}:unauth",
    ] {
        assert!(keys.contains(key), "{key} missing from the cluster: {keys}");
    }
    let holding = per_node.iter().filter(|k| !k.is_empty()).count();
    assert!(
        holding >= 2,
        "the buckets should spread over the masters: {per_node:?}"
    );
}
