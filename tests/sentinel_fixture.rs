//! The fixture of `common::sentinel` against real processes: three sentinels name the primary
//! and know its replica; when the primary is killed they fail over to the replica, which then
//! answers ROLE as a master; and the old primary, started again, is made a replica of the new
//! one by the sentinels and gets its writes.

mod common;

use std::time::Duration;

use common::sentinel::RedisSentinels;

/// What a failover may take with `down-after-milliseconds 500`, `failover-timeout 2000`.
const FAILOVER_WITHIN: Duration = Duration::from_secs(10);

/// What a restarted old primary may take to become a replica: a sentinel leaves a data node
/// that says it is a primary alone for 8 s before it reconfigures it, and asks a replica for
/// INFO every 10 s.
const REJOIN_WITHIN: Duration = Duration::from_secs(40);

/// The ROLE of the node on `port`: `master` or `slave`.
fn role(sentinels: &RedisSentinels, port: u16) -> String {
    let out = sentinels.cli(port, &["ROLE"]);
    out.lines().next().unwrap_or_default().to_string()
}

/// A deployment that fails over after half a second of silence.
fn quick() -> RedisSentinels {
    RedisSentinels::start(500, 2_000)
}

/// Kills the primary, waits for the failover, and checks the replica took over; the old and
/// the new primary's ports.
fn fail_over(sentinels: &mut RedisSentinels) -> (u16, u16) {
    let [first, replica] = sentinels.data_ports();
    let old = sentinels.kill_primary();
    assert_eq!(old, first, "the first primary is the one killed");
    let took = sentinels.wait_failover(old, FAILOVER_WITHIN);
    println!("failover took {took:?}");
    assert!(took < FAILOVER_WITHIN, "failover took {took:?}");
    let new = sentinels.primary_port();
    assert_eq!(new, replica, "the replica is the new primary");
    assert_eq!(sentinels.named_primaries(), vec![Some(replica); 3]);
    assert_eq!(
        role(sentinels, new),
        "master",
        "the new primary answers ROLE as a master"
    );
    (old, new)
}

#[test]
fn the_sentinels_name_the_primary_and_know_the_replica() {
    let sentinels = RedisSentinels::start(5_000, 60_000);
    let [primary, replica] = sentinels.data_ports();
    let ports = sentinels.sentinel_ports();
    assert_eq!(ports.len(), 3);
    assert_eq!(
        sentinels.url(),
        format!(
            "redis-sentinel://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}/mymaster",
            ports[0], ports[1], ports[2]
        )
    );
    assert_eq!(sentinels.primary_port(), primary);
    assert_eq!(sentinels.named_primaries(), vec![Some(primary); 3]);
    assert_eq!(role(&sentinels, primary), "master");
    assert_eq!(role(&sentinels, replica), "slave");
    for port in ports {
        assert_eq!(sentinels.cli(port, &["PING"]), "PONG");
        let replicas = sentinels.cli(port, &["SENTINEL", "replicas", "mymaster"]);
        assert!(
            replicas.contains(&format!("127.0.0.1:{replica}")),
            "sentinel {port} knows the replica: {replicas}"
        );
    }
    // A write on the primary reaches the replica.
    assert_eq!(sentinels.cli(primary, &["SET", "fixture", "one"]), "OK");
    sentinels.wait_replica_of(replica, primary, Duration::from_secs(5));
    let mut seen = String::new();
    for _ in 0..100 {
        seen = sentinels.cli(replica, &["GET", "fixture"]);
        if seen == "one" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(seen, "one", "the replica has the primary's write");
}

#[test]
fn killing_the_primary_fails_over_to_the_replica() {
    let mut sentinels = quick();
    let (old, new) = fail_over(&mut sentinels);
    assert_ne!(old, new);
    assert_eq!(sentinels.cli(new, &["SET", "after", "failover"]), "OK");
    assert_eq!(sentinels.cli(new, &["GET", "after"]), "failover");
}

#[test]
fn the_old_primary_comes_back_as_a_replica_of_the_new_one() {
    let mut sentinels = quick();
    let (old, _new) = fail_over(&mut sentinels);
    let started = std::time::Instant::now();
    sentinels.restart(old);
    // Usually the old primary rejoins as the new one's replica; on a loaded machine the
    // sentinels may fail over once more meanwhile. Either way one primary and its replica.
    let (primary, replica) = sentinels.wait_settled(REJOIN_WITHIN);
    println!(
        "settled in {:?}: primary {primary}, replica {replica} (the old primary was {old})",
        started.elapsed()
    );
    assert_eq!(role(&sentinels, replica), "slave");
    assert_eq!(
        sentinels.primary_port(),
        primary,
        "the sentinels name the primary"
    );
    assert_eq!(sentinels.cli(primary, &["SET", "rejoined", "yes"]), "OK");
    let mut seen = String::new();
    for _ in 0..100 {
        seen = sentinels.cli(replica, &["GET", "rejoined"]);
        if seen == "yes" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(seen, "yes", "the replica gets the primary's writes");
}
