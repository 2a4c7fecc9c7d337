//! Embedded store memory per key, measured by RSS growth: a million distinct buckets checked
//! once each. `cargo bench --bench memory`; figure in benches/README.md.

use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_limit::clock::ManualClock;
use tollgate_store::memory::MemoryStore;
use tollgate_store::{CheckItem, FailurePolicy};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

fn main() {
    // `cargo bench` passes --bench; this program takes no flags of its own.
    let keys: u64 = 1_000_000;
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new(clock);
    let params = BucketParams::new(Rate::parse("10/1s").unwrap(), 20).unwrap();
    let before = rss_bytes();
    for k in 0..keys {
        let item = CheckItem::new(
            format!(
                "rl:{{ip:10.{}.{}.{}}}:unauth",
                k >> 16 & 255,
                k >> 8 & 255,
                k & 255
            )
            .into(),
            Charge {
                params,
                cost: 1,
                shadow: false,
            },
            0,
            FailurePolicy::Local,
        );
        store.check_at(std::slice::from_ref(&item), 2_000_000);
    }
    let after = rss_bytes();
    assert_eq!(store.len() as u64, keys);
    println!(
        "embedded store: {keys} keys, RSS {:.1} MiB -> {:.1} MiB: {:.1} bytes per key",
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
        (after - before) as f64 / keys as f64
    );
}
