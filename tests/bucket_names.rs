//! Bucket names that can't collide: whatever a tenant, a header, a body field or a client is
//! called, no caller's bucket is another's. Generated names (tenants that spell another kind's
//! tag, `ip:203.0.113.9`, `h:x`, `fp:none`, values full of `{`, `}`, `:` and `%`) go through the
//! rules compiler and the request planner, and every bucket of three callers, each with a
//! burst of 1, is checked once on a fresh store: on the embedded store and in Lua on a real
//! redis-server. A shared bucket is a second charge, and the second caller's refusal.

mod common;

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::json;
use tollgate_limit::clock::ManualClock;
use tollgate_rules::plan::{Caller, build_for};
use tollgate_rules::{Fingerprint, Snapshot};
use tollgate_store::memory::MemoryStore;
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, Store};

/// One generated case: two API keys' tenants, and the values three callers send.
#[derive(Debug, Clone)]
struct Case {
    tenants: [String; 2],
    /// The `X-Account` header of the two keyed callers and the anonymous one.
    headers: [String; 3],
    /// Their body field `user`.
    bodies: [String; 3],
    /// The anonymous caller's address: the one a tenant may be named after.
    ip: IpAddr,
}

/// Text that leans towards what spells another kind's name: tag kinds, separators, escapes.
fn tricky() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("ip:".to_string()),
        Just("h:".to_string()),
        Just("fp:".to_string()),
        Just("none".to_string()),
        Just("203.0.113.9".to_string()),
        Just("127.0.0.1".to_string()),
        Just(":".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("%".to_string()),
        Just("%3A".to_string()),
        Just("sha256=".to_string()),
        Just("per-route".to_string()),
        Just("acct".to_string()),
        "[a-z0-9.]{1,3}",
    ];
    prop::collection::vec(piece, 1..5).prop_map(|p| p.concat())
}

/// A tenant the rules take: no braces, which they refuse.
fn tenant() -> impl Strategy<Value = String> {
    tricky().prop_map(|t| t.replace(['{', '}'], "%"))
}

fn case() -> impl Strategy<Value = Case> {
    (
        [tenant(), tenant()],
        [tricky(), tricky(), tricky()],
        [tricky(), tricky(), tricky()],
        prop_oneof![Just("203.0.113.9"), Just("127.0.0.1"), Just("2001:db8::1")],
    )
        .prop_filter("two tenants", |(t, ..)| t[0] != t[1])
        .prop_map(|(tenants, headers, bodies, ip)| Case {
            tenants,
            headers,
            bodies,
            ip: ip.parse().unwrap(),
        })
}

/// Every dimension a route can charge without a token, each a burst of 1 an hour.
fn rules(c: &Case) -> Snapshot {
    let one = |dimension: serde_json::Value| json!({"dimension": dimension, "rate": "1/1h", "burst": 1});
    let rules = json!({
        "version": 1,
        "upstreams": {"u": {"url": "http://127.0.0.1:9"}},
        "limits": {
            "plan": one(json!("key")),
            "per-route": one(json!("route")),
            "per-ip": one(json!("ip")),
            "clients": one(json!("fingerprint")),
            "acct": one(json!({"header": "x-account"})),
            "user": one(json!({"body_field": "user"})),
        },
        "keys": [
            {"id": "k-1", "tenant": c.tenants[0], "sha256": "11".repeat(32)},
            {"id": "k-2", "tenant": c.tenants[1], "sha256": "22".repeat(32)},
        ],
        "routes": [{"method": "POST", "path": "/v1", "upstream": "u", "key": "optional",
                    "cost": {"plan": 1, "per-route": 1, "per-ip": 1, "clients": 1, "acct": 1, "user": 1}}]
    });
    tollgate_rules::compile(rules.to_string().as_bytes(), "rules.json", Default::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The batches of the two keyed callers and the anonymous one.
fn batches(snap: &Snapshot, c: &Case) -> Vec<Vec<CheckItem>> {
    let route = &snap.routes[0];
    let callers = [Caller::Key(0), Caller::Key(1), Caller::Anonymous];
    callers
        .iter()
        .enumerate()
        .map(|(i, caller)| {
            let mut headers = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&c.headers[i]) {
                headers.insert("x-account", v);
            }
            // The keyed callers from addresses of their own: the `ip` limit is per address
            // whoever calls.
            let ip = match i {
                0 => "198.51.100.1".parse().unwrap(),
                1 => "198.51.100.2".parse().unwrap(),
                _ => c.ip,
            };
            let batch = build_for(
                snap,
                route,
                *caller,
                ip,
                Fingerprint::None,
                &headers,
                Some(c.bodies[i].as_bytes()),
            )
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
            batch.to_vec()
        })
        .collect()
}

/// Checks each caller's batch once on `store`: all must be admitted, none sharing a bucket.
async fn all_admitted(store: &dyn Store, c: &Case) -> Result<(), TestCaseError> {
    let snap = rules(c);
    let batches = batches(&snap, c);
    let mut names: Vec<&str> = batches.iter().flatten().map(|i| i.key.as_ref()).collect();
    names.sort_unstable();
    let n = names.len();
    names.dedup();
    prop_assert_eq!(names.len(), n, "two callers share a bucket name: {:?}", names);
    for (i, b) in batches.iter().enumerate() {
        let o = store
            .check(b)
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(
            o.admitted,
            "caller {} was refused: a bucket it pays was already charged ({:?})",
            i,
            b.iter().map(|i| i.key.as_ref()).collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// Runs the [`known`] cases, then `cases` generated ones, on `rt`, each on the store `fresh`
/// gives, empty.
fn run(rt: &tokio::runtime::Runtime, cases: u32, fresh: impl Fn() -> Arc<dyn Store>) {
    for c in known() {
        let store = fresh();
        rt.block_on(all_admitted(&*store, &c))
            .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&case(), |c| {
            let store = fresh();
            rt.block_on(all_admitted(&*store, &c))
        })
        .unwrap();
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn names_never_collide_on_the_embedded_store() {
    run(&runtime(), 512, || {
        Arc::new(MemoryStore::new(ManualClock::new(1_000_000)))
    });
}

#[test]
fn names_never_collide_in_lua_on_redis() {
    let redis = common::RedisServer::start();
    let rt = runtime();
    let store: Arc<dyn Store> = Arc::new(
        rt.block_on(RedisStore::connect(Target::node(&redis.url()), None))
            .expect("connect to redis-server"),
    );
    run(&rt, 96, || {
        assert_eq!(redis.cli(&["FLUSHALL"]), "OK");
        store.clone()
    });
}

/// A caller with a key of `tenant`, another key's, and an anonymous caller from 203.0.113.9
/// sending `X-Account: x`.
fn named(tenant: &str, other: &str) -> Case {
    Case {
        tenants: [tenant.to_string(), other.to_string()],
        headers: ["a".into(), "b".into(), "x".into()],
        bodies: ["a".into(), "b".into(), "c".into()],
        ip: "203.0.113.9".parse().unwrap(),
    }
}

/// Tenants the rules once gave another kind's buckets: the anonymous address's, the anonymous
/// header value's, the connection fingerprint's, another tenant's escaped name.
fn known() -> Vec<Case> {
    vec![
        named("ip:203.0.113.9", "other"),
        named("h:x", "other"),
        named("fp:none", "other"),
        named("a%3Ab", "a:b"),
    ]
}

/// Each of the [`known`] cases names its buckets in its own tenant's tag.
#[test]
fn a_tenant_named_as_another_kinds_tag_keeps_to_its_own() {
    let c = |tenant: &str, _: &str| named(tenant, "other");
    for case in known() {
        let snap = rules(&case);
        let names: Vec<String> = batches(&snap, &case)[0]
            .iter()
            .map(|i| i.key.to_string())
            .collect();
        // The address's own `ip` limit aside, every bucket is in the tenant's tag.
        let others: Vec<&String> = names.iter().filter(|n| !n.ends_with(":per-ip")).collect();
        assert_eq!(others.len(), 5, "{names:?}");
        assert!(
            others
                .iter()
                .all(|n| !n.starts_with("rl:{ip:") && !n.starts_with("rl:{h:") && !n.starts_with("rl:{fp:")),
            "{names:?}"
        );
    }
    // A tenant of plain characters keeps the name it always had.
    let snap = rules(&c("acme", "x"));
    let names: Vec<String> = batches(&snap, &c("acme", "x"))[0]
        .iter()
        .map(|i| i.key.to_string())
        .collect();
    assert!(names.contains(&"rl:{acme}:plan".to_string()), "{names:?}");
}
