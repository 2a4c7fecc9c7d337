//! `lua/lease.lua` and `limit/lease.rs` are one algorithm in two homes: thousands of random
//! leases and give-backs, mixed with `lua/check.lua` checks of the same buckets (one bucket,
//! one encoding) and with rule changes under live buckets, give the same grant, the same
//! `denied_until` and the same units left on every step. The Rust side keeps its own copy of
//! every bucket and is fed the `now` the script reports.
//!
//! Every lease and give-back comes from one of a few gateways (holder ids) reporting random
//! spending, so the records of outstanding grants beside each bucket are held to
//! `lease_recorded`/`give_back_recorded` too: the tokens reclaimed from expired records and the
//! caller's record on every step, and the whole hash at the end. On the gateway clock the clock
//! jumps far past a record's 12 s, so silent gateways' records are reclaimed without a real wait.
//!
//! Set `TOLLGATE_EQ_SEED` to replay a failing seed; every failure prints its seed and step.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate_limit::bucket::{BucketParams, BucketState, BucketVerdict, Charge, Rate, check_all};
use tollgate_limit::clock::{Clock, ManualClock};
use tollgate_limit::lease::{
    Account, Grant, HolderRecord, HolderRecords, LeaseConfig, block_cycle_us, give_back_recorded,
    lease_recorded,
};
use tollgate_store::lease::held_key;
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy, Store};

const STEPS: usize = 3_000;
const BUCKETS: usize = 6;

/// Hot-key rates (what leasing is for) and a few slow ones, so rule changes convert units
/// between very different scales.
const RATES: [&str; 10] = [
    "500/1s",
    "10000/1s",
    "600/1s",
    "1000/1s",
    "7000/3s",
    "100000/60s",
    "999/1s",
    "10/1s",
    "600/60s",
    "9/7s",
];

fn random_params(rng: &mut StdRng) -> BucketParams {
    let rate = Rate::parse(RATES[rng.random_range(0..RATES.len())]).unwrap();
    let burst = match rng.random_range(0..3) {
        0 => rng.random_range(1..=20),
        1 => rng.random_range(1..=2_000),
        _ => rng.random_range(1..=200_000),
    };
    BucketParams::new(rate, burst).unwrap()
}

fn move_clock(rng: &mut StdRng, clock: &ManualClock) {
    let now = clock.now_us();
    let next = match rng.random_range(0..20) {
        0 => now.saturating_sub(rng.random_range(1..=2_000_000)),
        1 => now,
        2 => now + rng.random_range(1..=100_000_000),
        3..=10 => now + rng.random_range(1..=2_000),
        _ => now + rng.random_range(1..=300_000),
    };
    clock.set_us(next);
}

const HOLDERS: [&str; 3] = ["g0", "0123456789abcdef0123456789abcdef", "g2"];

/// Tokens a gateway reports spent: mostly a block's worth or less, sometimes more than its
/// record (which stops at 0).
fn random_spent(rng: &mut StdRng, p: &BucketParams) -> u64 {
    match rng.random_range(0..4) {
        0 => 0,
        1 => rng.random_range(1..=p.burst),
        2 => rng.random_range(1..=10 * p.burst),
        _ => rng.random_range(1..=50),
    }
}

/// The records hash as stored, parsed.
fn stored_records(redis: &common::RedisServer, key: &str) -> HolderRecords {
    let out = redis.cli(&["HGETALL", &held_key(key)]);
    let lines: Vec<&str> = out.lines().filter(|l| !l.is_empty()).collect();
    let mut recs = HolderRecords::new();
    for pair in lines.chunks(2) {
        let (tokens, expires) = pair[1].split_once(':').expect("tokens:expires");
        recs.insert(
            pair[0].to_string(),
            HolderRecord {
                tokens: tokens.parse().unwrap(),
                expires_us: expires.parse().unwrap(),
            },
        );
    }
    recs
}

/// Runs the random steps; returns how many calls reclaimed an expired record.
async fn run(
    redis: &common::RedisServer,
    store: &RedisStore,
    clock: Option<&ManualClock>,
    seed: u64,
) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let keys: Vec<String> = (0..BUCKETS).map(|i| format!("rl:{{eq}}:lease{i}")).collect();
    let mut rules: Vec<BucketParams> = (0..BUCKETS).map(|_| random_params(&mut rng)).collect();
    let mut states: HashMap<usize, common::store::Stored> = HashMap::new();
    let mut records: Vec<HolderRecords> = vec![HolderRecords::new(); BUCKETS];
    let (mut grants, mut denials, mut gives, mut checks, mut changes) = (0, 0, 0, 0, 0);
    let mut reclaims = 0;
    for step in 0..STEPS {
        if rng.random_range(0..12) == 0 {
            let i = rng.random_range(0..BUCKETS);
            rules[i] = random_params(&mut rng);
            changes += 1;
        }
        let i = rng.random_range(0..BUCKETS);
        let p = rules[i];
        if let Some(c) = clock {
            move_clock(&mut rng, c);
        }
        let stored = states.get(&i).copied();
        let before = stored;
        // The state the script reads at the call's now: none once its field has expired.
        let read = |now: u64| common::store::Stored::read(stored.as_ref(), now);
        let recs_before = records[i].clone();
        let acct = Account {
            holder: HOLDERS[rng.random_range(0..HOLDERS.len())],
            spent: random_spent(&mut rng, &p),
        };
        let context = |now: u64, what: &str| {
            format!(
                "seed {seed} step {step} (replay with TOLLGATE_EQ_SEED={seed}), now {now}, {what}:\n  params {p:?}\n  state before {before:?}\n  records before {recs_before:?}\n  {acct:?}"
            )
        };
        let (state, now): (Option<BucketState>, u64) = match rng.random_range(0..10) {
            // LEASE: a block from 1 token to the whole burst, for 1 to 50 gateways.
            0..=4 => {
                let block = match rng.random_range(0..4) {
                    0 => p.burst,
                    1 => rng.random_range(1..=p.burst),
                    _ => rng.random_range(1..=p.burst.min(200)),
                };
                let gateways = rng.random_range(1..=50);
                let cfg = LeaseConfig::new(p, block, gateways).unwrap();
                let cycle = block_cycle_us(&p, block, gateways);
                let reply = store
                    .lease(&keys[i], &p, block, cycle, acct)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
                let mut state = read(reply.now_us);
                let (expected, recorded) =
                    lease_recorded(&cfg, &mut state, &mut records[i], &acct, reply.now_us);
                let what = format!("lease of {block} for {gateways} gateways");
                assert_eq!(
                    reply.recorded,
                    recorded,
                    "records differ; {}",
                    context(reply.now_us, &what)
                );
                reclaims += usize::from(recorded.reclaimed > 0);
                assert_eq!(
                    reply.grant,
                    expected,
                    "grant differs; {}",
                    context(reply.now_us, &what)
                );
                assert_eq!(
                    Some(reply.units_left),
                    state.map(|s| s.tokens),
                    "units left differ; {}",
                    context(reply.now_us, &what)
                );
                match expected {
                    Grant::Granted { .. } => grants += 1,
                    Grant::Denied { .. } => denials += 1,
                }
                (state, reply.now_us)
            }
            // GIVE BACK: nothing, a few tokens, or more than the bucket can hold.
            5..=6 => {
                let tokens = match rng.random_range(0..4) {
                    0 => 0,
                    1 => p.burst + rng.random_range(0..=p.burst),
                    _ => rng.random_range(1..=p.burst),
                };
                let reply = store
                    .give_back(&keys[i], &p, tokens, acct)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
                let mut state = read(reply.now_us);
                let recorded =
                    give_back_recorded(&p, &mut state, &mut records[i], &acct, tokens, reply.now_us);
                assert_eq!(
                    reply.recorded,
                    recorded,
                    "records differ; {}",
                    context(reply.now_us, &format!("give-back of {tokens}"))
                );
                reclaims += usize::from(recorded.reclaimed > 0);
                assert_eq!(
                    Some(reply.units_left),
                    state.map(|s| s.tokens),
                    "units left differ; {}",
                    context(reply.now_us, &format!("give-back of {tokens}"))
                );
                assert!(reply.units_left <= p.capacity, "a give-back went above the burst");
                gives += 1;
                (state, reply.now_us)
            }
            // CHECK through lua/check.lua: the same bucket, read and written in one encoding.
            _ => {
                let cost = rng.random_range(1..=p.burst.min(50));
                let charge = Charge {
                    params: p,
                    cost,
                    shadow: false,
                };
                let item = CheckItem::new(keys[i].as_str().into(), charge, 0, FailurePolicy::Local);
                let out = store
                    .check(std::slice::from_ref(&item))
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
                let mut states_one = [read(out.now_us)];
                let mut v = [BucketVerdict {
                    sufficient: false,
                    tokens: 0,
                    wait_us: None,
                    blocked: false,
                }];
                let admitted = check_all(&[charge], &mut states_one, out.now_us, &mut v);
                let state = states_one[0];
                let what = format!("check of cost {cost}");
                assert_eq!(
                    out.admitted,
                    admitted,
                    "decision differs; {}",
                    context(out.now_us, &what)
                );
                assert_eq!(
                    out.buckets[0],
                    v[0],
                    "verdict differs; {}",
                    context(out.now_us, &what)
                );
                checks += 1;
                (state, out.now_us)
            }
        };
        let state = state.expect("every call writes its bucket");
        states.insert(i, common::store::Stored::written(&p, state, now));
    }
    // The run must have granted, denied, given back, checked and changed rules, or it proves
    // little.
    assert!(
        grants > 100 && denials > 100 && gives > 300 && checks > 300 && changes > 50,
        "seed {seed}: {grants} grants, {denials} denials, {gives} give-backs, {checks} checks, {changes} rule changes"
    );
    // The hashes hold exactly the records the Rust side kept.
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(
            stored_records(redis, key),
            records[i],
            "seed {seed}: records of {key}"
        );
    }
    reclaims
}

#[tokio::test]
async fn lease_script_and_lease_rs_agree_on_the_store_clock() {
    let redis = common::RedisServer::start();
    let store = RedisStore::connect(Target::node(&redis.url()), None)
        .await
        .unwrap();
    let seed = common::eq_seed();
    eprintln!("TOLLGATE_EQ_SEED={seed}");
    run(&redis, &store, None, seed).await;
}

#[tokio::test]
async fn lease_script_and_lease_rs_agree_on_a_jumping_gateway_clock() {
    let redis = common::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = RedisStore::connect(Target::node(&redis.url()), Some(clock.clone() as Arc<_>))
        .await
        .unwrap();
    let seed = common::eq_seed();
    eprintln!("TOLLGATE_EQ_SEED={seed}");
    let reclaims = run(&redis, &store, Some(&clock), seed).await;
    // The clock jumps past records' expiries: silent gateways' records must have been
    // reclaimed often, or the sweep went untested.
    assert!(
        reclaims > 50,
        "seed {seed}: only {reclaims} calls reclaimed a record"
    );
}

#[tokio::test]
async fn the_lease_script_comes_back_after_a_script_flush() {
    let redis = common::RedisServer::start();
    let store = RedisStore::connect(Target::node(&redis.url()), None)
        .await
        .unwrap();
    let p = BucketParams::new(Rate::parse("10000/1s").unwrap(), 20_000).unwrap();
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.lease_script_sha()]), "1");
    redis.cli(&["SCRIPT", "FLUSH"]);
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.lease_script_sha()]), "0");
    let acct = Account {
        holder: "g0",
        spent: 0,
    };
    let reply = store
        .lease("rl:{kbig}:plan", &p, 125, 250_000, acct)
        .await
        .unwrap();
    assert_eq!(reply.grant, Grant::Granted { tokens: 125 });
    assert_eq!(reply.units_left, (20_000 - 125) * p.scale);
    assert_eq!(redis.cli(&["SCRIPT", "EXISTS", store.lease_script_sha()]), "1");
    // The script refuses what it can't read rather than guess: in the bucket's field, or in the
    // key of the layout before pages.
    redis.bucket_with("HSET", "rl:{kbig}:plan", &["not a bucket"]);
    let err = store
        .lease("rl:{kbig}:plan", &p, 125, 250_000, acct)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not hold a bucket"), "{err}");
    redis.cli(&["SET", "rl:{kbig}:old", "not a bucket"]);
    let err = store
        .lease("rl:{kbig}:old", &p, 125, 250_000, acct)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not hold a bucket"), "{err}");
    // So does it a record it did not write, naming the hash and the field, and writes nothing.
    redis.cli(&["HSET", "rl:{kbig}:rec|held", "g9", "lots"]);
    let err = store
        .lease("rl:{kbig}:rec", &p, 125, 250_000, acct)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("rl:{kbig}:rec|held field g9"), "{err}");
    assert_eq!(redis.bucket_with("HEXISTS", "rl:{kbig}:rec", &[]), "0");
}
