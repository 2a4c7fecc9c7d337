//! Checks per second through `RedisStore` on a Redis Cluster of three masters beside one of a
//! single master (all 16,384 slots on one node), measured in one run with rounds alternating,
//! and where the CPU went: the bench process (the client) and each redis-server.
//!
//! Run: `cargo bench --bench redis_cluster` (options after `--`: `--rounds 3 --seconds 5
//! --tasks 128 --keys 30000`). Needs redis-server and redis-cli. Figures in benches/README.md
//! "Redis Cluster: three masters beside one".

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{RedisCluster, cpu_secs};
use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy, Store};

struct Opts {
    rounds: usize,
    seconds: u64,
    tasks: usize,
    keys: usize,
}

fn opts() -> Opts {
    let mut o = Opts {
        rounds: 3,
        seconds: 5,
        tasks: 128,
        keys: 30_000,
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let value = || -> usize {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a whole number", args[i]))
        };
        match args[i].as_str() {
            "--rounds" => o.rounds = value(),
            "--seconds" => o.seconds = value() as u64,
            "--tasks" => o.tasks = value(),
            "--keys" => o.keys = value(),
            // `cargo bench` passes --bench.
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!("unknown option {other}"),
        }
        i += 2;
    }
    o
}

/// A key with its own hash tag each, so the buckets spread over every slot and master.
fn items(keys: usize) -> Vec<CheckItem> {
    // A rate no run can exhaust: the bench times the store, not refusals.
    let params = BucketParams::new(Rate::parse("1000000/1s").unwrap(), 1_000_000).unwrap();
    (0..keys)
        .map(|i| {
            CheckItem::new(
                format!("rl:{{t{i}}}:plan").into(),
                Charge {
                    params,
                    cost: 1,
                    shadow: false,
                },
                0,
                FailurePolicy::Closed,
            )
        })
        .collect()
}

struct Round {
    checks_per_s: f64,
    /// CPU cores used by this process (the client) and by all redis-servers together.
    client_cores: f64,
    redis_cores: f64,
}

async fn run(store: Arc<RedisStore>, items: Arc<Vec<CheckItem>>, cluster: &RedisCluster, o: &Opts) -> Round {
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let me = std::process::id();
    let redis_cpu = || cluster.nodes.iter().map(|n| cpu_secs(n.pid())).sum::<f64>();
    let (c0, r0) = (cpu_secs(me), redis_cpu());
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..o.tasks {
        let (store, items, stop, count, failed) = (
            store.clone(),
            items.clone(),
            stop.clone(),
            count.clone(),
            failed.clone(),
        );
        handles.push(tokio::spawn(async move {
            let mut x = (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut done = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let it = &items[(x % items.len() as u64) as usize];
                match store.check(std::slice::from_ref(it)).await {
                    Ok(o) if o.admitted => done += 1,
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            count.fetch_add(done, Ordering::Relaxed);
        }));
    }
    tokio::time::sleep(Duration::from_secs(o.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "every check answered and admitted"
    );
    Round {
        checks_per_s: count.load(Ordering::Relaxed) as f64 / secs,
        client_cores: (cpu_secs(me) - c0) / secs,
        redis_cores: (redis_cpu() - r0) / secs,
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("redis_cluster: a benchmark, not a test; run `cargo bench --bench redis_cluster`");
        return;
    }
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let one = RedisCluster::with_masters(1);
        let three = RedisCluster::with_masters(3);
        let items = Arc::new(items(o.keys));
        let connect = |c: &RedisCluster| {
            let nodes = c.node_list();
            async move {
                Arc::new(
                    RedisStore::connect(Target::cluster(&nodes), None)
                        .await
                        .expect("connect to the cluster"),
                )
            }
        };
        let s1 = connect(&one).await;
        let s3 = connect(&three).await;
        // Warm both: scripts loaded, connections open, every bucket written once.
        for (s, c) in [(&s1, &one), (&s3, &three)] {
            run(s.clone(), items.clone(), c, &Opts { seconds: 2, ..o }).await;
        }
        let (mut r1, mut r3) = (Vec::new(), Vec::new());
        for round in 0..o.rounds {
            // Alternate which goes first, so a drift in the machine's load falls on both.
            let first_one = round % 2 == 0;
            for which in [first_one, !first_one] {
                let (s, c, rows, name) = if which {
                    (&s1, &one, &mut r1, "1 master")
                } else {
                    (&s3, &three, &mut r3, "3 masters")
                };
                let r = run(s.clone(), items.clone(), c, &o).await;
                eprintln!(
                    "round {} {name}: {:.0} checks/s, client {:.2} cores, redis {:.2} cores",
                    round + 1,
                    r.checks_per_s,
                    r.client_cores,
                    r.redis_cores
                );
                rows.push(r);
            }
        }
        let per_round: Vec<String> = r1
            .iter()
            .zip(&r3)
            .map(|(a, b)| format!("{:.2}", b.checks_per_s / a.checks_per_s))
            .collect();
        println!(
            "rounds: {} × {} s, {} tasks, {} keys over all slots, {} cores on this machine\n",
            o.rounds,
            o.seconds,
            o.tasks,
            o.keys,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("| cluster | checks/s | client CPU (cores) | redis-server CPU (cores) |");
        println!("|---|---:|---:|---:|");
        for (name, rows) in [("1 master", &r1), ("3 masters", &r3)] {
            let pick = |f: fn(&Round) -> f64| median(&mut rows.iter().map(f).collect::<Vec<_>>());
            println!(
                "| {name} | {:.0} | {:.2} | {:.2} |",
                pick(|r| r.checks_per_s),
                pick(|r| r.client_cores),
                pick(|r| r.redis_cores)
            );
        }
        println!("\n3 masters ÷ 1 per round: {}", per_round.join(", "));
    });
}
