//! One limit shared by three Regions, live: real gateway processes, one real redis-server per
//! Region, each Region's agent rebalancing every 400 ms. Owns the end-to-end claims of issue 18:
//! shares follow demand and never add up past the limit, a lost Region is reclaimed only on two
//! signals, a Region that is only cut off keeps its share, and a new agent carries on from the
//! old one's state. The Regions themselves are `common::regions`; the relay and health-server
//! fixtures are tested in `relay_health.rs`.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::Http;
use common::regions::{
    Counts, EPS, INTERVAL, L, LEASE, Load, NAMES, Sample, Sampler, StoreConn, World, age_ms,
    assert_sum_within_limit, health, index, is_agent, max_sum, mean_share, own_share, reclaimed,
    record_demand, record_share, secs, seq, view, wait_ready, wait_shares,
};
use common::relay::Relay;
use serde_json::Value;

/// Every test here runs three redis-servers and three or four gateways under load; on a
/// 2-core machine two of them at once would starve each other's agents and measure the box
/// instead of the gateway.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------------------------
// The tests.

/// Demand moves from A to C; the shares follow it, the gateways admit what the shares say, and
/// at no sample do the three shares add up past the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_follow_demand_and_never_add_up_past_the_limit() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    let begin = Instant::now();
    // 330/s against 300: someone is always short. Targets (5% floor, rest by demand) are
    // about A 170, B 92, C 38 first, then A 38, B 92, C 170.
    load.set_all([200, 100, 30]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let moved = Instant::now();
    load.set_all([30, 100, 200]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let end = Instant::now();
    load.stop().await;
    let samples = sampler.between(begin, end);
    let _ = sampler.stop().await;

    let all = [0, 1, 2];
    for s in &samples {
        assert!(
            s.shares.iter().all(Option::is_some),
            "a store lost its share under load: {s:?}"
        );
    }
    assert_sum_within_limit(&samples, &all, "under moving demand");

    // Steady before the move (its last 3 s) and at the end (the last 3 s): raises are at most
    // 10% of L per rebalance, so 5 s is room for the 130 C has to gain.
    let window = Duration::from_secs(3);
    let before: Vec<f64> = (0..3)
        .map(|i| mean_share(&samples, i, moved - window, moved))
        .collect();
    let after: Vec<f64> = (0..3)
        .map(|i| mean_share(&samples, i, end - window, end))
        .collect();
    eprintln!(
        "mean shares before the move {before:.1?}, after {after:.1?}; max sum {:.3} over {} samples",
        max_sum(&samples, &all),
        samples.len()
    );
    assert!(
        before[0] > 2.0 * before[2],
        "A asks 200/s and C 30/s, yet A's share {:.1} is not well above C's {:.1}",
        before[0],
        before[2]
    );
    assert!(
        after[2] > 2.0 * after[0],
        "after the move C asks 200/s and A 30/s, yet C's share {:.1} is not well above A's {:.1}",
        after[2],
        after[0]
    );

    // What the gateways admitted follows the shares, loosely: the Region asking more than its
    // share is held near it (a steady bucket has no burst left to spend), and the share that
    // moved to C lets C admit far more than A.
    let phases = [
        ("before the move", moved - window, moved, &before, 0usize, 2usize),
        ("after the move", end - window, end, &after, 2, 0),
    ];
    for (phase, from, to, shares, busy, quiet) in phases {
        let counts: Vec<Counts> = NAMES.iter().map(|n| load.counts(n, from, to)).collect();
        let per_s = |n: u64| n as f64 / secs(to - from);
        let ok: Vec<f64> = counts.iter().map(|c| per_s(c.ok)).collect();
        let sent: Vec<f64> = counts.iter().map(|c| per_s(c.sent())).collect();
        eprintln!("{phase}: sent/s {sent:.1?}, admitted/s {ok:.1?}, counts {counts:?}");
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                c.other, 0,
                "{phase}: {} answered neither 200 nor 429: {c:?}",
                NAMES[i]
            );
        }
        // The Region asking far more than its share has had its bucket empty for seconds:
        // it admits about its share and no more. (B, 100/s on about 90, is not held to this:
        // 10/s over its share takes longer than a phase to drain two seconds of burst.)
        assert!(
            ok[busy] <= shares[busy] + 0.05 * L,
            "{phase}: {} admitted {:.1}/s on a share of {:.1}/s",
            NAMES[busy],
            ok[busy],
            shares[busy]
        );
        for i in 0..3 {
            // Every gateway lets through most of what its share allows.
            assert!(
                ok[i] >= 0.8 * sent[i].min(shares[i]),
                "{phase}: {} admitted only {:.1}/s of {:.1}/s sent, on a share of {:.1}/s",
                NAMES[i],
                ok[i],
                sent[i],
                shares[i]
            );
        }
        assert!(
            ok[busy] > 2.0 * ok[quiet],
            "{phase}: {} admitted {:.1}/s, not well above {}'s {:.1}/s",
            NAMES[busy],
            ok[busy],
            NAMES[quiet],
            ok[quiet]
        );
    }
    eprintln!("took {:.1} s", secs(started.elapsed()));
}

/// B's store dies and its health check goes dark while B's gateway keeps running: B's records
/// stop (its gateway lost the lock with its store), both signals agree, and A and C reclaim
/// B's share between them, never holding more than the limit together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_region_is_reclaimed_on_two_signals() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let mut world = World::start().await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    // Targets about A 142, B 100, C 58; with B gone, A 218 and C 82: both must rise.
    load.set_all([90, 60, 30]);
    wait_shares(
        &sampler,
        Duration::from_secs(12),
        "A's and C's shares did not settle near their targets",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > 125.0 && *c < 75.0),
    )
    .await;
    let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
    for v in [&va, &vc] {
        assert_eq!(health(v, "B"), "up", "B's health check answers 200: {v}");
        assert_eq!(reclaimed(v, "B"), 0.0, "B reclaimed while it publishes: {v}");
    }
    let a_before = own_share(&va).expect("A's share in its view");
    let c_before = own_share(&vc).expect("C's share in its view");

    // Both signals at once: the store (and with it B's agent lock) and the health check.
    load.set("B", 0);
    let killed = Instant::now();
    drop(world.regions[index("B")].redis.take());
    world.region("B").health.stop().await;

    // Silence is 3 of the agent's rebalances with B's record unchanged; then the health
    // check, polled every interval, must also say down. 15 intervals leave room for a lease
    // to run out on B's side and for a loaded box.
    let limit = INTERVAL * 15;
    let mut b_seqs = Vec::new();
    let (va, vc) = loop {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        b_seqs.push((
            killed.elapsed().as_millis(),
            seq(&va, "B"),
            health(&va, "B").to_string(),
            seq(&va, "A"),
        ));
        if reclaimed(&va, "B") > 0.0 && reclaimed(&vc, "B") > 0.0 {
            break (va, vc);
        }
        assert!(
            killed.elapsed() < limit,
            "B not reclaimed by both A and C within {limit:?} of losing its store and health check;\n\
             (ms after the loss, B's seq, B's health, A's seq) as A saw them: {b_seqs:?}\nA: {va}\nC: {vc}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reclaimed_after = killed.elapsed();
    eprintln!("(ms after the loss, B's seq, B's health, A's seq) as A saw them: {b_seqs:?}");
    for v in [&va, &vc] {
        assert_eq!(
            health(v, "B"),
            "down",
            "B reclaimed, yet its health is not down: {v}"
        );
    }
    let b_seq_at_reclaim = seq(&va, "B");

    // The reclaimed room is raised into at most 10% of L per rebalance, after it lands in the pools.
    // A wait, not a bound: on a loaded machine the load falls behind its targets and the shares
    // follow demand more slowly (C at 64 of its 82 after 6 s was seen with both cores busy).
    wait_shares(
        &sampler,
        INTERVAL * 30,
        "A's and C's shares did not rise after reclaiming B",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > a_before + 5.0 && *c > c_before + 5.0),
    )
    .await;
    // A little longer at the new shares, so the sum is watched after the raises too.
    tokio::time::sleep(INTERVAL * 4).await;
    load.stop().await;
    let samples = sampler.stop().await;

    let va = view(&http, &a).await;
    assert_eq!(
        seq(&va, "B"),
        b_seq_at_reclaim,
        "B's gateway lost its store and its lock, yet B's record still changes in A's store"
    );
    let (before, after): (Vec<Sample>, Vec<Sample>) = samples.iter().partition(|s| s.at < killed);
    assert_sum_within_limit(&before, &[0, 1, 2], "before B was lost");
    assert_sum_within_limit(&after, &[0, 2], "after B was lost");
    let last = samples.last().unwrap().shares;
    eprintln!(
        "reclaimed {:.1} s after the loss; A {a_before:.1} -> {:?}, C {c_before:.1} -> {:?}; \
         reclaimed by A {:.1}, by C {:.1}; max A+C {:.3}; took {:.1} s",
        secs(reclaimed_after),
        last[0],
        last[2],
        reclaimed(&va, "B"),
        reclaimed(&view(&http, &c).await, "B"),
        max_sum(&after, &[0, 2]),
        secs(started.elapsed())
    );
}

/// B's gateway writes into A's and C's stores through relays, and the relays are cut: A and
/// C stop hearing from B, but B's health check still answers, so one signal is not enough
/// and B keeps its share. Restored, B's records arrive fresh again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_region_keeps_its_share() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let store = |name| SocketAddr::from(([127, 0, 0, 1], world.region(name).port));
    let to_a = Relay::start(store("A")).await;
    let to_c = Relay::start(store("C")).await;
    let a = world.gateway("A", "gw-a1", &[]).await;
    let b = world
        .gateway("B", "gw-b1", &[("A", to_a.addr()), ("C", to_c.addr())])
        .await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a, &b, &c], world.ports()).await;

    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &a), ("B", &b), ("C", &c)]);
    load.set_all([90, 60, 30]);
    wait_shares(
        &sampler,
        Duration::from_secs(12),
        "A's share did not settle well above C's",
        |s| matches!(s, [Some(a), _, Some(c)] if *a > *c + 50.0),
    )
    .await;
    let b_seq_before = seq(&view(&http, &a).await, "B").expect("B's record in A's view");

    to_a.cut();
    to_c.cut();
    let cut = Instant::now();
    let watch_for = INTERVAL * 15;
    let mut first_ages = None;
    let mut views = 0;
    while cut.elapsed() < watch_for {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        views += 1;
        for (who, v) in [("A", &va), ("C", &vc)] {
            assert_eq!(
                reclaimed(v, "B"),
                0.0,
                "{who} reclaimed B's share while B's health check answers 200, {:?} after the cut: {v}",
                cut.elapsed()
            );
            assert_eq!(health(v, "B"), "up", "{who}: B's health check answers 200: {v}");
            // The shares this Region counts on: its own, and the last the others published.
            let own = own_share(v).unwrap_or_else(|| panic!("{who}'s share in its view: {v}"));
            let others: f64 = NAMES
                .iter()
                .filter(|n| **n != who)
                .map(|n| record_share(v, n).unwrap_or_else(|| panic!("{n}'s record in {who}'s view: {v}")))
                .sum();
            assert!(
                own + others <= L + EPS,
                "{who}'s own share {own} and the others' last known shares {others} add up past {L}: {v}"
            );
        }
        let ages = (age_ms(&va, "B"), age_ms(&vc, "B"));
        first_ages.get_or_insert(ages);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
    let blocked = cut.elapsed();
    for (who, v) in [("A", &va), ("C", &vc)] {
        let age = age_ms(v, "B").unwrap_or_else(|| panic!("age of B's record in {who}'s view: {v}"));
        // The last record that got through was written before the cut (give or take one in
        // flight at the moment of the cut).
        assert!(
            age >= (blocked - INTERVAL).as_millis() as f64,
            "{who} shows B's record {age} ms old, {blocked:?} after the cut: the relay let records through: {v}"
        );
        let s = seq(v, "B").unwrap();
        assert!(
            s <= b_seq_before + 1,
            "B's record went from {b_seq_before} to {s} in {who}'s store through a cut relay"
        );
    }
    let b_view = view(&http, &b).await;
    eprintln!(
        "{views} views over {:?} of cut: B's record age in A and C first {first_ages:?}, then {:?}; \
         B's own seq {:?} (was {b_seq_before})",
        blocked,
        (age_ms(&va, "B"), age_ms(&vc, "B")),
        seq(&b_view, "B")
    );
    assert_sum_within_limit(&sampler.all(), &[0, 1, 2], "while B was cut off");

    // Restored: B's gateway makes its store connections again and its records land fresh.
    to_a.restore();
    to_c.restore();
    let restored = Instant::now();
    let limit = INTERVAL * 15;
    loop {
        let (va, vc) = (view(&http, &a).await, view(&http, &c).await);
        let fresh = |v: &Value| {
            seq(v, "B").is_some_and(|s| s > b_seq_before + 1)
                && age_ms(v, "B").is_some_and(|a| a < (INTERVAL * 3).as_millis() as f64)
        };
        if fresh(&va) && fresh(&vc) {
            for (who, v) in [("A", &va), ("C", &vc)] {
                assert_eq!(reclaimed(v, "B"), 0.0, "{who} reclaimed B after the restore: {v}");
            }
            break;
        }
        assert!(
            restored.elapsed() < limit,
            "B's records not fresh in A's and C's stores within {limit:?} of the restore:\nA: {va}\nC: {vc}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    load.stop().await;
    let samples = sampler.stop().await;
    assert_sum_within_limit(&samples, &[0, 1, 2], "through cut and restore");
    eprintln!(
        "fresh again {:.1} s after the restore; max sum {:.3}; took {:.1} s",
        secs(restored.elapsed()),
        max_sum(&samples, &[0, 1, 2]),
        secs(started.elapsed())
    );
}

/// Region A runs two gateways; its agent is killed with SIGKILL. The other gateway takes the
/// lock within two leases and carries on from the saved state: A's records keep counting up
/// and A's share does not jump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agent_carries_on_from_the_old_ones_state() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let world = World::start().await;
    let a1 = world.gateway("A", "gw-a1", &[]).await;
    let a2 = world.gateway("A", "gw-a2", &[]).await;
    let b = world.gateway("B", "gw-b1", &[]).await;
    let c = world.gateway("C", "gw-c1", &[]).await;
    let http = Http::new();
    wait_ready(&http, &[&a1, &a2, &b, &c], world.ports()).await;

    let (v1, v2) = (view(&http, &a1).await, view(&http, &a2).await);
    assert_eq!(
        v1["agent"], v2["agent"],
        "A's gateways disagree on the agent:\n{v1}\n{v2}"
    );
    assert!(
        is_agent(&v1) != is_agent(&v2),
        "exactly one of A's gateways is the agent:\n{v1}\n{v2}"
    );
    let (mut agent, survivor) = if is_agent(&v1) { (a1, a2) } else { (a2, a1) };
    let survivor_name = view(&http, &survivor).await["this_gateway"].clone();

    // All of A's demand goes to the gateway that stays, so the kill does not change it: a
    // share that moves then is the new agent's doing, not the load's. That also makes the
    // agent count requests another gateway of its Region received.
    let sampler = Sampler::start(world.ports());
    let mut load = Load::start([("A", &survivor), ("B", &b), ("C", &c)]);
    // Targets about A 185, B 58, C 58: far from an even third, so an agent that started over
    // would show.
    load.set_all([120, 30, 30]);
    let settle = Duration::from_secs(12);
    let settled = Instant::now();
    loop {
        let s = sampler.last().map(|s| s.shares);
        if matches!(s, Some([Some(a), _, _]) if a > 150.0) {
            break;
        }
        if settled.elapsed() > settle {
            let v = view(&http, &survivor).await;
            panic!(
                "A's share did not settle above 150 within {settle:?} (last shares {s:?}); \
                 A's demand in its record {:?}, with 120/s sent to the gateway that is not the agent: {v}",
                record_demand(&v, "A")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Steady a few intervals more.
    tokio::time::sleep(INTERVAL * 3).await;

    let v = view(&http, &survivor).await;
    let seq_before = seq(&v, "A").expect("A's record in its view");
    let share_before = sampler.latest(0).await.expect("A's share");
    agent.signal("KILL");
    let killed = Instant::now();
    let _ = agent.child.wait();

    // A lease of 1200 ms runs out at most one lease after the last renewal; the survivor then
    // takes the lock at its next try, within an interval.
    let limit = LEASE * 2 + INTERVAL;
    let mut seqs = vec![seq_before];
    loop {
        let v = view(&http, &survivor).await;
        if let Some(s) = seq(&v, "A") {
            seqs.push(s);
        }
        if is_agent(&v) {
            break;
        }
        assert!(
            killed.elapsed() <= limit + Duration::from_millis(100),
            "the surviving gateway is not A's agent {:?} after the agent was killed: {v}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took_over = killed.elapsed();
    let holder = StoreConn::new(world.region("A").port)
        .command(&["GET", "tollgate:regions:agent"])
        .await;
    assert_eq!(
        holder.as_deref(),
        survivor_name.as_str(),
        "the lock in A's store is not held by the new agent"
    );

    // The new agent's first record: its seq follows the old agent's, it does not start over.
    let old_last = *seqs.iter().max().unwrap();
    let first_new = loop {
        let v = view(&http, &survivor).await;
        let s = seq(&v, "A").expect("A's record");
        seqs.push(s);
        if s > old_last {
            break Instant::now();
        }
        assert!(
            killed.elapsed() < took_over + INTERVAL * 5,
            "A's record did not move past the old agent's seq {old_last} after the takeover: seqs seen {seqs:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // One more interval of the new agent's shares.
    tokio::time::sleep(INTERVAL * 2).await;
    let seq_after = seq(&view(&http, &survivor).await, "A").unwrap();
    seqs.push(seq_after);
    load.stop().await;
    let samples = sampler.stop().await;

    assert!(
        seqs.windows(2).all(|w| w[1] >= w[0]) && seq_after > seq_before,
        "A's record seq went back or stopped across the takeover (old agent's last {seq_before}): {seqs:?}"
    );
    let after: Vec<f64> = samples
        .iter()
        .filter(|s| s.at >= killed && s.at <= first_new + INTERVAL * 2)
        .filter_map(|s| s.shares[0])
        .collect();
    assert!(!after.is_empty(), "no share of A sampled after the kill");
    // The new agent's first decision measures demand across the gap the kill left, so the share
    // may dip (31 below on a loaded CI host); a fresh start would put it at the even split,
    // L / 3, which the test keeps farther away than the bound.
    let bound = 0.15 * L;
    assert!(
        (share_before - L / 3.0).abs() > bound + EPS,
        "A's share {share_before:.1} is too close to the even split for the test to tell a fresh start"
    );
    for s in &after {
        assert!(
            (s - share_before).abs() <= bound + EPS,
            "A's share moved from {share_before:.1} to {s:.1} across the takeover (all after: {after:.1?})"
        );
    }
    assert_sum_within_limit(&samples, &[0, 1, 2], "across the takeover");
    eprintln!(
        "took over {:.2} s after the kill; seq {seq_before} -> {seq_after}; share {share_before:.1} -> {:.1?}; \
         took {:.1} s",
        secs(took_over),
        after.last(),
        secs(started.elapsed())
    );
}
