//! A store under Redis Sentinel, on real processes (`common::sentinel`: a primary, a replica and
//! three sentinels): the gateway finds the primary through the sentinels, a primary killed with
//! SIGKILL under load is replaced, every check is back on the store within the sentinels'
//! failover time and a second, no request fails meanwhile beyond what the limits' failure
//! policies say, and the old primary, back as a replica, gets no write.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::sentinel::RedisSentinels;
use common::{Http, Tollgate};

/// How long the sentinels wait before they call a primary down, and the failover's timeout.
const DOWN_AFTER_MS: u64 = 500;
const FAILOVER_TIMEOUT_MS: u64 = 2000;

const KBIG: (&str, &str) = ("authorization", "Bearer kbig-demo-key");

/// The sum of `tollgate_store_bypass_total`'s samples: checks a failure policy decided.
async fn bypassed(http: &Http, gw: &Tollgate) -> f64 {
    let text = http.get(&gw.admin_url("/metrics"), &[]).await.body_text();
    text.lines()
        .filter(|l| l.starts_with("tollgate_store_bypass_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `INFO commandstats`'s calls of `command` on a data node.
fn calls(s: &RedisSentinels, port: u16, command: &str) -> u64 {
    s.cli(port, &["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_is_replaced_and_never_written_again() {
    let mut s = RedisSentinels::start(DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS);
    let first = s.primary_port();
    let gw = Tollgate::spawn_with_env(
        &["demo", "--store", &s.url()],
        // A check waits at most this long for a store that went away: the policy decides then.
        &[("TOLLGATE_STORE_TIMEOUT", "100ms")],
    );
    let http = Http::new();
    let log = gw.stderr_when(|l| l.contains("store found")).await;
    assert!(
        log.contains(&format!("redis-sentinel at {}", s.url()))
            && log.contains(&format!("(primary 127.0.0.1:{first})")),
        "the start-up line names the sentinels and the primary they gave:\n{log}"
    );

    // Load: four clients in a loop, each answer's time and status kept.
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (http, url, stop) = (Http::new(), gw.url("/v1/orders"), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = http.get(&url, &[KBIG]).await;
                seen.push((started.elapsed(), r.status.as_u16()));
            }
            seen
        }));
    }
    // The bypass counter, sampled: when a failure policy last decided a check.
    let sampler = {
        let (stop, gw_admin) = (stop.clone(), gw.admin_url("/metrics"));
        tokio::spawn(async move {
            let http = Http::new();
            let mut last = (0.0, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) {
                let text = http.get(&gw_admin, &[]).await.body_text();
                let n: f64 = text
                    .lines()
                    .filter(|l| l.starts_with("tollgate_store_bypass_total"))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum();
                if n > last.0 {
                    last = (n, started.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            last
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        bypassed(&http, &gw).await,
        0.0,
        "every check on the store before the kill"
    );

    let killed_at = started.elapsed();
    let old = s.kill_primary();
    assert_eq!(old, first);
    let failover = tokio::task::block_in_place(|| s.wait_failover(old, Duration::from_secs(30)));
    let new = s.primary_port();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for c in clients {
        answers.extend(c.await.unwrap());
    }
    let (bypasses, last_bypass) = sampler.await.unwrap();

    let failed: Vec<_> = answers.iter().filter(|(_, s)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "kbig's limits fail open: every answer is 200, but {} of {} were not: {:?}",
        failed.len(),
        answers.len(),
        &failed[..failed.len().min(10)]
    );
    assert!(
        bypasses > 0.0,
        "the outage was never seen: the test proves nothing"
    );
    let back = last_bypass.saturating_sub(killed_at);
    let bound = failover + Duration::from_secs(1);
    eprintln!(
        "primary {old} killed at {killed_at:?}; the sentinels named {new} {failover:?} later; \
         the last check a policy decided came {back:?} after the kill ({bypasses} in all); \
         {} answers, all 200",
        answers.len()
    );
    assert!(
        back <= bound,
        "checks were back on the store {back:?} after the kill, past the sentinels' {failover:?} + 1 s"
    );
    let on_new = calls(&s, new, "evalsha");
    assert!(
        on_new > 0,
        "the checks after the failover went to the new primary"
    );

    // The fence: the old primary comes back, the sentinels make it a replica (or, on a loaded
    // machine, fail over once more), and whichever node is the replica then gets no write.
    let (primary, replica) = tokio::task::block_in_place(|| {
        s.restart(old);
        s.wait_settled(Duration::from_secs(60))
    });
    for port in [primary, replica] {
        s.cli(port, &["CONFIG", "RESETSTAT"]);
    }
    // Until the gateway's connection follows the sentinels to the primary they name.
    let started = Instant::now();
    while calls(&s, primary, "evalsha") == 0 {
        let r = http.get(&gw.url("/v1/orders"), &[KBIG]).await;
        assert_eq!(r.status, 200, "{}", r.body_text());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no check reached the primary {primary}"
        );
    }
    for _ in 0..50 {
        assert_eq!(http.get(&gw.url("/v1/orders"), &[KBIG]).await.status, 200);
    }
    for command in ["evalsha", "eval"] {
        assert_eq!(
            calls(&s, replica, command),
            0,
            "the replica {replica} ran {command}"
        );
    }
    assert!(
        calls(&s, primary, "evalsha") >= 50,
        "the primary {primary} took the checks"
    );
}
