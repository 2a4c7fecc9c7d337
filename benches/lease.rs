//! A hot key on real parts: 20 lease clients (the gateway's own `Leases` layer, each
//! on its own connection, no HTTP) against one `redis-server` this program starts on a free
//! loopback port, k-big at 10,000/s burst 20,000, 100,000 offered a second for a minute, on a
//! real clock. It prints the figures that tell leasing works (store calls a second, the worst excess over
//! r·t for intervals that start while the batch job is sending, tokens held at the end) and
//! the rest of what it measured.
//!
//! Run: `cargo bench --bench lease` (options after `--`: `--seconds 60 --rounds 2`). Under
//! `cargo test --all-targets` it only says how to run it.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::RedisServer;
use tollgate_testkit::lease_load::{self, Load};

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} needs a number, got {v:?}"))
        })
        .unwrap_or(default)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        eprintln!("lease: a benchmark, not a test; run `cargo bench --bench lease`");
        return;
    }
    let seconds = arg("--seconds", 60.0);
    let rounds = arg("--rounds", 2.0) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "machine: {} cores, load average at start {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    for round in 1..=rounds {
        let redis = RedisServer::start();
        let load = Load::hot_key(seconds);
        let run = rt.block_on(lease_load::run(redis.port, &load));
        let secs = run.stop_us as f64 / 1e6;
        let admitted = run.admitted_us.len();
        let first = run.first_refusal_us.unwrap_or(0);
        let (steady, s_from, s_to) = run.worst_excess_from(first);
        let (any, _, _) = run.worst_excess_from(0);
        let (beyond, b_from, _, c_at) = run.worst_beyond_central();
        let back = rt.block_on(run.wait_until_returned(Duration::from_secs(15)));
        let calls_after = lease_load::evalsha_calls(redis.port);
        println!("round {round}: {secs:.2} s of load, block {}", run.block);
        println!(
            "  offered {} ({:.0}/s), admitted {admitted} ({:.1}% of b + r·t), most in any 1 s {}",
            run.offered,
            run.offered as f64 / secs,
            100.0 * admitted as f64 / (load.burst as f64 + 10_000.0 * secs),
            run.max_in_window(1_000_000)
        );
        println!(
            "  store calls {} = {:.1}/s ({:.4} per admitted); grants {} ({:.1}/s), denials {} ({:.1}/s); \
             {} requests checked in Redis directly (no lease answer within 3 ms)",
            run.calls_during_load,
            run.calls_during_load as f64 / secs,
            run.calls_during_load as f64 / admitted as f64,
            run.grants(),
            run.grants() as f64 / secs,
            run.denials(),
            run.denials() as f64 / secs,
            run.checked_in_store()
        );
        println!(
            "  worst admitted − r·t for intervals starting from the first refusal ({:.3} s) on: {steady:.0} \
             ({:.3} s .. {:.3} s, shared bucket at its start {}); from any start, the opening burst included: {any:.0}",
            first as f64 / 1e6,
            s_from as f64 / 1e6,
            s_to as f64 / 1e6,
            run.bucket_tokens_at(s_from)
        );
        println!(
            "  worst beyond one central bucket (admitted − C(s) − r·t): {beyond:.0} (from {:.3} s, C(s) = {c_at}); \
             longest client stall {:.1} ms, ending at {:.3} s",
            b_from as f64 / 1e6,
            run.longest_stall_us as f64 / 1e3,
            run.stall_end_us as f64 / 1e6
        );
        println!(
            "  held when the load stopped: {} tokens; all back {} after it; {} give-back calls after the load",
            run.held_at_stop,
            back.map(|t| format!("{:.3} s", (t - run.stop_us) as f64 / 1e6))
                .unwrap_or_else(|| "NOT within 15 s".into()),
            calls_after - run.calls_during_load - run.calls_before_load
        );
    }
}
