//! How `RedisStore` lays buckets out in a real `redis-server`, started by each test on a free
//! port: buckets of the previous release's layout (one key each) are read with their tokens and
//! moved into pages, and a page's fields expire as keys did and are swept only long after.

mod common;

use common::RedisServer;
use common::store::item;
use tollgate_limit::bucket::{BucketParams, Rate};
use tollgate_limit::lease::Account;
use tollgate_store::Store;
use tollgate_store::redis::{RedisStore, Target};

/// The scripts of the layout before pages (one 18-byte string per bucket, `SET ... PX`), kept
/// as they were in `tests/fixtures/lua_v1`: what a gateway of the previous release runs.
const OLD_CHECK: &str = concat!(
    include_str!("fixtures/lua_v1/bucket.lua"),
    include_str!("fixtures/lua_v1/check.lua")
);
const OLD_REFUND: &str = concat!(
    include_str!("fixtures/lua_v1/bucket.lua"),
    include_str!("fixtures/lua_v1/refund.lua")
);

/// A check of one bucket by the old script at the gateway's `now`: (admitted, tokens left).
fn old_check(redis: &RedisServer, key: &str, p: &BucketParams, cost: u64, now: u64) -> (String, u64) {
    let args = [
        p.scale,
        p.refill,
        p.capacity,
        p.units(cost),
        p.ttl_ms(),
        0,
        p.debt,
    ]
    .map(|n| n.to_string());
    let now_s = now.to_string();
    let mut cmd = vec!["EVAL", OLD_CHECK, "1", key, &now_s, "1", "1"];
    cmd.extend(args.iter().map(String::as_str));
    let out = redis.cli(&cmd);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "old check.lua answered {out}");
    (lines[1].to_string(), lines[2].parse().unwrap())
}

/// A debit of `units` by the old refund script at `now`: the balance after.
fn old_adjust(redis: &RedisServer, key: &str, p: &BucketParams, units: i64, now: u64) -> i64 {
    let args = [
        p.scale as i64,
        p.refill as i64,
        p.capacity as i64,
        units,
        p.ttl_ms() as i64,
        p.debt as i64,
    ]
    .map(|n| n.to_string());
    let now_s = now.to_string();
    let mut cmd = vec!["EVAL", OLD_REFUND, "1", key, &now_s];
    cmd.extend(args.iter().map(String::as_str));
    let out = redis.cli(&cmd);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "old refund.lua answered {out}");
    lines[1].parse().unwrap()
}

/// A rolling upgrade: buckets the previous release wrote (each its own 18-byte key) are read by
/// the check, lease and refund scripts with the very tokens they hold, debt included, and moved
/// into their pages on that first write, the old key deleted. Each is held to a twin bucket
/// that the current scripts wrote at the same moments.
#[tokio::test]
async fn buckets_of_the_old_layout_are_read_with_their_tokens_and_moved() {
    let redis = RedisServer::start();
    let t0 = 1_800_000_000_000_000u64;
    let clock = tollgate_limit::clock::ManualClock::new(t0);
    let store = RedisStore::connect(Target::node(&redis.url()), Some(clock.clone()))
        .await
        .unwrap();
    let p = BucketParams::new(Rate::parse("10/1s").unwrap(), 10).unwrap();
    let paid = p.with_debt(20).unwrap();
    let one = |key: &str, p: BucketParams, cost: u64| {
        let mut i = item(key, "10/1s", 10, cost);
        i.charge.params = p;
        i
    };

    // t0: the previous release charges 7 tokens from three buckets and puts a fourth 15 tokens
    // in debt; the twins get the same from the current scripts.
    for name in ["check", "lease", "refund"] {
        let old = format!("rl:{{up}}:old-{name}");
        let (admitted, left) = old_check(&redis, &old, &p, 7, t0);
        let o = store
            .check(&[one(&format!("rl:{{up}}:new-{name}"), p, 7)])
            .await
            .unwrap();
        assert_eq!((admitted.as_str(), left), ("1", o.buckets[0].tokens));
        assert_eq!(redis.cli(&["STRLEN", &old]), "18", "{old} is in the old layout");
    }
    let debit = -(paid.units(25) as i64);
    let owed = old_adjust(&redis, "rl:{up}:old-debt", &paid, debit, t0);
    let twin = store
        .adjust_batch(&[one("rl:{up}:new-debt", paid, 1)], &[debit])
        .await
        .unwrap();
    assert_eq!(twin.balances[0], Some(owed));
    assert_eq!(owed, -(paid.units(15) as i64), "25 taken from 10: 15 owed");

    // 250 ms later the current scripts read each old bucket as its twin.
    clock.advance_us(250_000);
    let moved = |key: &str| {
        assert_eq!(
            redis.cli(&["EXISTS", key]),
            "0",
            "{key}: the old key is still there"
        );
        assert_eq!(redis.bucket("HSTRLEN", key), "25", "{key} is not in its page");
    };
    let check = |name: &str, p: BucketParams, cost: u64| {
        let batch = [one(name, p, cost)];
        let store = &store;
        async move { store.check(&batch).await.unwrap().buckets[0] }
    };
    let (old, new) = (
        check("rl:{up}:old-check", p, 2).await,
        check("rl:{up}:new-check", p, 2).await,
    );
    assert_eq!(old, new);
    assert_eq!(old.tokens, p.units(7) / 2, "3 left, 2.5 refilled, 2 taken");
    moved("rl:{up}:old-check");

    let acct = Account {
        holder: "g1",
        spent: 0,
    };
    let (old, new) = (
        store
            .lease("rl:{up}:old-lease", &p, 4, 1_000_000, acct)
            .await
            .unwrap(),
        store
            .lease("rl:{up}:new-lease", &p, 4, 1_000_000, acct)
            .await
            .unwrap(),
    );
    assert_eq!((old.grant, old.units_left), (new.grant, new.units_left));
    moved("rl:{up}:old-lease");

    let refund = |name: &str| {
        let batch = [one(name, p, 1)];
        let store = &store;
        async move {
            store
                .adjust_batch(&batch, &[p.units(1) as i64])
                .await
                .unwrap()
                .balances[0]
        }
    };
    let (old, new) = (
        refund("rl:{up}:old-refund").await,
        refund("rl:{up}:new-refund").await,
    );
    assert_eq!(old, new);
    assert_eq!(
        old,
        Some(p.units(13) as i64 / 2),
        "3 left, 2.5 refilled, 1 given back"
    );
    moved("rl:{up}:old-refund");

    // Still owing 12.5 tokens: nothing admitted, the same wait.
    let (old, new) = (
        check("rl:{up}:old-debt", paid, 1).await,
        check("rl:{up}:new-debt", paid, 1).await,
    );
    assert_eq!(old, new);
    assert_eq!((old.sufficient, old.tokens), (false, 0));
    assert_eq!(old.wait_us, Some(1_250_000 + 100_000), "the debt, then one token");
    moved("rl:{up}:old-debt");
}

/// A field past its expiry reads as a full bucket, even under a rule slow enough that refill
/// alone would not have filled it; a page's TTL is only ever raised; and a write that adds a
/// field deletes the fields of its page expired for over a minute, never a fresher one.
#[tokio::test]
async fn fields_expire_as_keys_did_and_are_swept_only_long_after() {
    let redis = RedisServer::start();
    let t0 = 1_800_000_000_000_000u64;
    let clock = tollgate_limit::clock::ManualClock::new(t0);
    let store = RedisStore::connect(Target::node(&redis.url()), Some(clock.clone()))
        .await
        .unwrap();
    let check = |key: &str, rate: &str, burst: u64, cost: u64| {
        let batch = [item(key, rate, burst, cost)];
        let store = &store;
        async move { store.check(&batch).await.unwrap().buckets[0].tokens }
    };
    let fast = BucketParams::new(Rate::parse("10/1s").unwrap(), 10).unwrap();
    let slow = BucketParams::new(Rate::parse("1/10s").unwrap(), 10).unwrap();
    assert_eq!(fast.ttl_ms(), 2_000, "b/r plus a second");

    // Expiry: half spent at t0, read 2.5 s later (past its 2 s) under the slow rule.
    check("rl:{exp}:a", "10/1s", 10, 5).await;
    clock.advance_us(2_500_000);
    assert_eq!(
        check("rl:{exp}:a", "1/10s", 10, 1).await,
        slow.units(9),
        "an expired field is a full bucket"
    );
    // Not yet expired (the slow rule's TTL is 101 s): 9 tokens and 1.5 s of refill.
    clock.advance_us(1_500_000);
    assert_eq!(
        check("rl:{exp}:a", "1/10s", 10, 0).await,
        slow.units(9) + 1_500_000 * slow.refill,
        "a live field is read as it is"
    );

    // The page's TTL: a long bucket's, not lowered by a short one written after it.
    let page = tollgate_store::page::page_of("rl:{ttl}:long");
    check("rl:{ttl}:long", "1/60s", 100, 1).await;
    check("rl:{ttl}:short", "10/1s", 10, 1).await;
    let pttl: u64 = redis.cli(&["PTTL", &page]).parse().unwrap();
    assert!(pttl > 6_000_000 - 60_000, "the page's TTL went down to {pttl} ms");

    // Sweeping: each page holds one old field, then a write adds a second, so both are seen.
    let (stale, fresh) = ("rl:{sweep}:stale", "rl:{keep}:fresh");
    check(stale, "10/1s", 10, 1).await;
    check(fresh, "10/1s", 10, 1).await;
    for key in [stale, fresh] {
        let page = tollgate_store::page::page_of(key);
        assert_eq!(redis.cli(&["HLEN", &page]), "1", "{key} is alone in {page}");
    }
    // 61 s past the stale field's expiry: swept. Then, on a gateway clock 31 s behind, the
    // fresh one is 30 s past its expiry: kept, and read as full.
    clock.advance_us(2_000_000 + 61_000_000);
    check("rl:{sweep}:new", "10/1s", 10, 1).await;
    assert_eq!(
        redis.bucket("HEXISTS", stale),
        "0",
        "a long-expired field was kept"
    );
    clock.set_us(clock_now(&clock) - 31_000_000);
    check("rl:{keep}:new", "10/1s", 10, 1).await;
    assert_eq!(
        redis.bucket("HEXISTS", fresh),
        "1",
        "a field expired under a minute was swept"
    );
    assert_eq!(
        check(fresh, "10/1s", 10, 0).await,
        fast.units(10),
        "and reads as full"
    );
}

fn clock_now(clock: &tollgate_limit::clock::ManualClock) -> u64 {
    use tollgate_limit::clock::Clock;
    clock.now_us()
}
