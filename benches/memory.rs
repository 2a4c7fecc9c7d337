//! Embedded store cost as the keys grow: bytes per bucket (RSS growth) and checks per second
//! over 1 to 10,000,000 distinct buckets. `cargo bench --bench memory`; figures in
//! benches/README.md "Embedded store memory per key".
//!
//! Each size runs in a child process of its own, so memory one size freed and the allocator
//! kept cannot hide the next size's growth.

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Instant;

use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_limit::clock::ManualClock;
use tollgate_store::memory::MemoryStore;
use tollgate_store::{CheckItem, FailurePolicy};

const SIZES: &[u64] = &[
    1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 3_000_000, 10_000_000,
];

fn rss_bytes() -> u64 {
    common::rss_kib(std::process::id()) * 1024
}

/// The fingerprint of bucket `i`. The product's fingerprints are keyed hashes, uniform over
/// 64 bits; splitmix64 of the index is as uniform and costs nothing to recompute, so the timed
/// loop measures the table, not string formatting.
fn fp_of(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One size: fill `keys` buckets, then time `checks` checks at keys drawn over all of them.
fn one(keys: u64, checks: u64) {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new(clock);
    // A burst large enough that no timed check is refused: the bench times the table.
    let params = BucketParams::new(Rate::parse("1000/1s").unwrap(), 1_000_000_000).unwrap();
    let mut item = CheckItem::new(
        "rl:{bench}:ip".into(),
        Charge {
            params,
            cost: 1,
            shadow: false,
        },
        0,
        FailurePolicy::Local,
    );
    let before = rss_bytes();
    for k in 0..keys {
        item.fp = fp_of(k);
        store.check_at(std::slice::from_ref(&item), 2_000_000);
    }
    let after = rss_bytes();
    assert_eq!(store.len() as u64, keys, "every bucket kept");

    // Keys in a fixed pseudo-random order (a multiplicative step coprime with any size), so
    // hardware prefetch cannot follow them.
    let step = 0x9e37_79b9_7f4a_7c15_u64 | 1;
    let mut idx = 0u64;
    let mut admitted = 0u64;
    let t = Instant::now();
    for n in 0..checks {
        idx = idx.wrapping_add(step);
        item.fp = fp_of(idx % keys);
        admitted += u64::from(
            store
                .check_at(std::slice::from_ref(&item), 3_000_000 + n)
                .admitted,
        );
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(admitted, checks, "no timed check refused");
    assert_eq!(store.len() as u64, keys, "the timed checks added no bucket");
    println!(
        "{keys}\t{}\t{:.1}\t{:.0}",
        after - before,
        (after - before) as f64 / keys as f64,
        checks as f64 / secs
    );
}

fn main() {
    // `cargo bench` passes --bench (`cargo test` does not); `--one N CHECKS` is this program
    // calling itself.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--one") {
        let keys = args[i + 1].parse().expect("--one KEYS");
        let checks = args[i + 2].parse().expect("--one KEYS CHECKS");
        one(keys, checks);
        return;
    }
    if !args.iter().any(|a| a == "--bench") {
        eprintln!("memory: a benchmark, not a test; run `cargo bench --bench memory`");
        return;
    }
    let max: u64 = args
        .iter()
        .position(|a| a == "--max-keys")
        .map(|i| args[i + 1].parse().expect("--max-keys N"))
        .unwrap_or(10_000_000);
    let rounds: usize = args
        .iter()
        .position(|a| a == "--rounds")
        .map(|i| args[i + 1].parse().expect("--rounds N"))
        .unwrap_or(3);
    let checks: u64 = 5_000_000;
    let me = std::env::current_exe().expect("current_exe");
    let sizes: Vec<u64> = SIZES.iter().copied().filter(|&s| s <= max).collect();
    // rows[size] = (bytes per key, checks/s) of each round.
    let mut rows: Vec<(u64, Vec<f64>, Vec<f64>)> = sizes.iter().map(|&s| (s, vec![], vec![])).collect();
    for round in 0..rounds {
        // Alternate the order, so a drift in the machine's load falls on both ends alike.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..sizes.len()).collect()
        } else {
            (0..sizes.len()).rev().collect()
        };
        for i in order {
            let out = Command::new(&me)
                .args(["--one", &sizes[i].to_string(), &checks.to_string()])
                .output()
                .expect("run one size");
            assert!(out.status.success(), "size {} failed: {out:?}", sizes[i]);
            let line = String::from_utf8(out.stdout).expect("utf-8");
            let f: Vec<&str> = line.trim().split('\t').collect();
            eprintln!(
                "round {} keys {}: {} B/key, {} checks/s",
                round + 1,
                f[0],
                f[2],
                f[3]
            );
            rows[i].1.push(f[2].parse().unwrap());
            rows[i].2.push(f[3].parse().unwrap());
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let one_key = median(&rows[0].2);
    println!("rounds: {rounds}, {checks} checks per size and round, one thread, medians\n");
    println!("| distinct buckets | bytes per bucket | checks/s | ÷ 1 bucket |");
    println!("|---:|---:|---:|---:|");
    for (keys, bytes, rate) in &rows {
        let b = if *keys >= 10_000 {
            format!("{:.1}", median(bytes))
        } else {
            "–".into()
        };
        let r = median(rate);
        println!("| {keys} | {b} | {r:.0} | {:.2} |", r / one_key);
    }
}
