//! Route lookup as the rules grow from 10 to 10,000 routes (issue 24): `Snapshot::route` (the
//! matcher compiled with the snapshot) beside `Snapshot::route_by_scan` (the linear scan it
//! replaced), on a path deep in the rules and on one only the catch-all takes, plus the time
//! to compile each rules file. `cargo bench -p tollgate-rules --bench routes`; figures in
//! benches/README.md. `benches/routes.sh` serves rules of the same shape through real gateways
//! (its generator is a few lines of Python beside this one).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use http::Method;
use serde_json::json;
use tollgate_rules::{CompileOptions, Snapshot, compile};

const SIZES: [usize; 4] = [10, 100, 1_000, 10_000];

/// `n` routes: a `*` catch-all on `/` and `n - 1` routes under `/api/v1/`, eight per service,
/// their methods GET, POST and `*` in turn.
fn rules(n: usize) -> Vec<u8> {
    let mut routes =
        vec![json!({"name": "fallback", "method": "*", "path": "/", "upstream": "up", "key": "optional"})];
    for i in 0..n - 1 {
        let method = ["GET", "POST", "*"][i % 3];
        routes.push(json!({
            "method": method,
            "path": format!("/api/v1/s{}/r{}", i / 8, i % 8),
            "upstream": "up",
            "key": "optional",
        }));
    }
    json!({"version": 1, "upstreams": {"up": {"url": "http://127.0.0.1:9"}}, "routes": routes})
        .to_string()
        .into_bytes()
}

fn snapshot(bytes: &[u8]) -> Snapshot {
    compile(bytes, "routes.json", CompileOptions::default()).expect("generated rules compile")
}

fn lookups(c: &mut Criterion) {
    let get = Method::GET;
    let mut g = c.benchmark_group("routes");
    for n in SIZES {
        let snap = snapshot(&rules(n));
        // A route halfway through the services (one `*` route in every three takes GET).
        let mid = (n - 1) / 2 / 3 * 3 + 2;
        let deep = format!("/api/v1/s{}/r{}/items/42", mid / 8, mid % 8);
        let cases = [("deep", deep.as_str()), ("catch-all", "/health/live")];
        for (what, path) in cases {
            let want = snap.route_by_scan(&get, path);
            assert_eq!(snap.route(&get, path), want, "{n} routes, {path}");
            assert!(want.is_some(), "{n} routes: {path} takes no route");
            g.bench_with_input(BenchmarkId::new(format!("matcher {what}"), n), &path, |b, p| {
                b.iter(|| black_box(snap.route(black_box(&get), black_box(p))))
            });
            g.bench_with_input(BenchmarkId::new(format!("scan {what}"), n), &path, |b, p| {
                b.iter(|| black_box(snap.route_by_scan(black_box(&get), black_box(p))))
            });
        }
    }
    g.finish();
}

fn compile_time(c: &mut Criterion) {
    let mut g = c.benchmark_group("routes compile");
    g.sample_size(10);
    for n in SIZES {
        let bytes = rules(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &bytes, |b, bytes| {
            b.iter(|| black_box(snapshot(bytes)))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = lookups, compile_time
}
criterion_main!(benches);
