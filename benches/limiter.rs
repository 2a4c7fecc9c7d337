//! Criterion benches of the limiter's hot path: the bucket math, embedded-store checks (1 and
//! 3 buckets, 1 and 1,000,000 keys, 1 and 2 threads), rule matching and plan building, and
//! header rendering. `cargo bench --bench limiter`; figures in benches/README.md.

use std::hint::black_box;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, Method};
use tollgate_limit::bucket::{BucketParams, BucketState, BucketVerdict, Charge, Rate, check_all, refill};
use tollgate_limit::clock::{Clock, ManualClock};
use tollgate_limit::decision::decide;
use tollgate_rules::headers::{policy_value, state_value};
use tollgate_rules::plan;
use tollgate_rules::{CompileOptions, Fingerprint, compile};
use tollgate_store::memory::MemoryStore;
use tollgate_store::{CheckItem, FailurePolicy};

fn params(rate: &str, burst: u64) -> BucketParams {
    BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap()
}

fn item(key: String, p: BucketParams) -> CheckItem {
    CheckItem::new(
        key.into(),
        Charge {
            params: p,
            cost: 1,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    )
}

fn bucket_math(c: &mut Criterion) {
    let p = params("600/60s", 20);
    let state = Some(BucketState {
        tokens: 5 * p.scale,
        ts: 1_000_000,
        scale: p.scale,
    });
    c.bench_function("bucket/refill", |b| {
        let mut now = 1_000_000u64;
        b.iter(|| {
            now += 2_500;
            black_box(refill(black_box(&p), black_box(state), now))
        })
    });
    c.bench_function("bucket/check_all 1 bucket", |b| {
        let charges = [Charge {
            params: p,
            cost: 1,
            shadow: false,
        }];
        let mut states = [state];
        let mut out = [BucketVerdict {
            sufficient: false,
            tokens: 0,
            wait_us: None,
            blocked: false,
        }];
        let mut now = 1_000_000u64;
        b.iter(|| {
            now += 2_500;
            black_box(check_all(&charges, &mut states, now, &mut out))
        })
    });
}

/// A store with `keys` buckets already in it, and items naming them.
fn filled_store(keys: usize, per_item: usize) -> (Arc<MemoryStore>, Vec<Vec<CheckItem>>) {
    let clock = ManualClock::new(1_000_000);
    let store = Arc::new(MemoryStore::new(clock));
    let p = params("10000/1s", 20_000);
    let batches: Vec<Vec<CheckItem>> = (0..keys)
        .map(|k| {
            (0..per_item)
                .map(|i| item(format!("rl:{{t{k}}}:l{i}"), p))
                .collect()
        })
        .collect();
    for b in &batches {
        store.check_at(b, 1_000_000);
    }
    (store, batches)
}

fn memory_store(c: &mut Criterion) {
    for keys in [1usize, 1_000_000] {
        for per_item in [1usize, 3] {
            let (store, batches) = filled_store(keys, per_item);
            let name = format!("memory_store/{per_item} bucket(s), {keys} key(s), 1 thread");
            c.bench_function(&name, |b| {
                let mut i = 0usize;
                let mut now = 2_000_000u64;
                b.iter(|| {
                    i = (i + 7919) % batches.len();
                    now += 1;
                    black_box(store.check_at(&batches[i], now))
                })
            });
            // Two threads at once on the same store: each timing covers both threads' work.
            let name = format!("memory_store/{per_item} bucket(s), {keys} key(s), 2 threads");
            c.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    std::thread::scope(|s| {
                        for t in 0..2usize {
                            let store = &store;
                            let batches = &batches;
                            s.spawn(move || {
                                let mut i = t * 104_729;
                                for n in 0..iters {
                                    i = (i + 7919) % batches.len();
                                    black_box(store.check_at(&batches[i], 2_000_000 + n));
                                }
                            });
                        }
                    });
                    // Per check across both threads: wall time / (2 × iters) × 2 = wall / iters.
                    start.elapsed() / 2
                })
            });
        }
    }
}

fn rules_and_plans(c: &mut Criterion) {
    let snap = compile(
        include_bytes!("../rules/demo.json"),
        "rules/demo.json",
        CompileOptions::default(),
    )
    .unwrap();
    let get = Method::GET;
    let post = Method::POST;
    c.bench_function("rules/route match GET /v1/orders", |b| {
        b.iter(|| black_box(snap.route(black_box(&get), black_box("/v1/orders/123"))))
    });
    c.bench_function("rules/key lookup by SHA-256", |b| {
        b.iter(|| black_box(snap.key_by_hash(&tollgate_rules::hash_secret(black_box(b"k7-demo-key")))))
    });
    let headers = HeaderMap::new();
    let ip: IpAddr = "203.0.113.9".parse().unwrap();
    let orders = &snap.routes[snap.route(&get, "/v1/orders").unwrap()];
    let exports = &snap.routes[snap.route(&post, "/v1/exports").unwrap()];
    let k7 = snap.key_by_id("k-7");
    c.bench_function("plan/orders (1 key bucket)", |b| {
        b.iter(|| black_box(plan::build(&snap, orders, k7, ip, Fingerprint::None, &headers, None).unwrap()))
    });
    c.bench_function("plan/exports (2 buckets)", |b| {
        b.iter(|| black_box(plan::build(&snap, exports, k7, ip, Fingerprint::None, &headers, None).unwrap()))
    });
    c.bench_function("plan/unauthenticated (ip bucket)", |b| {
        b.iter(|| black_box(plan::unauthenticated_only(&snap, ip)))
    });
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new(clock.clone());
    c.bench_function("plan+check+decide/orders", |b| {
        b.iter(|| {
            clock.advance_us(100_000);
            let batch = plan::build(&snap, orders, k7, ip, Fingerprint::None, &headers, None).unwrap();
            let out = store.check_at(&batch, clock.now_us());
            black_box(decide(&batch, &out))
        })
    });
}

fn headers(c: &mut Criterion) {
    let p = params("600/60s", 20);
    c.bench_function("headers/RateLimit-Policy (at rule load)", |b| {
        b.iter(|| black_box(policy_value(black_box("plan"), &p).unwrap()))
    });
    c.bench_function("headers/RateLimit (per answer)", |b| {
        b.iter(|| black_box(state_value(black_box("plan"), black_box(17), black_box(1))))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = bucket_math, memory_store, rules_and_plans, headers
}
criterion_main!(benches);
