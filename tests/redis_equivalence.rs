//! `lua/check.lua` and `limit/bucket.rs` are one algorithm in two homes: thousands of random
//! checks (random rates and bursts, rule changes, costs up to far above the burst, batches of
//! several buckets, shadow flags, post-paid buckets that may owe, queueing buckets that admit a
//! request to wait for its tokens and owe them meanwhile, buckets that block for a while once
//! they refuse, checks of cost 0 that only
//! read a bucket, several requests in one script call) give the same decision, the same units
//! left and the same wait on every step. Now and then an admitted request is refunded, or
//! charged what its answer cost (`lua/refund.lua` against `bucket::adjust`), sometimes after
//! the clock moved, and both leave the same balance. The Rust side keeps its own copy of every
//! bucket and is fed the `now` the script reports.
//!
//! Set `TOLLGATE_EQ_SEED` to replay a failing seed; every failure prints its seed and step.

mod common;

use common::store::Stored;

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tollgate_limit::bucket::{
    BucketParams, BucketState, BucketVerdict, Charge, MAX_EXACT, Rate, adjust, check_blocking,
};
use tollgate_limit::clock::ManualClock;
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy, Outcome, Store, refund_units};

const STEPS: usize = 4_000;
const BUCKETS: usize = 12;

/// Rates people write: changing between them converts units between "round" scales, where a
/// double division is most likely to round (1/49 × 49 < 1), so both sides must round alike.
const USUAL_RATES: [&str; 14] = [
    "10/1s", "20/1s", "600/60s", "1/5s", "5/60s", "7/3s", "49/1s", "3/1s", "100/1s", "1000/1s", "10000/1s",
    "1/1s", "300/1m", "9/7s",
];

/// A third of the buckets are post-paid: they may owe up to a random debt; a sixth queue, with
/// a random longest wait; and a fifth of any kind block for a while once they refuse.
fn random_params(rng: &mut StdRng) -> BucketParams {
    let mut p = random_owing_params(rng);
    if rng.random_range(0..5) == 0 {
        p.block_us = rng.random_range(1..=5_000_000);
    }
    p
}

fn random_owing_params(rng: &mut StdRng) -> BucketParams {
    let p = random_plain_params(rng);
    if rng.random_range(0..6) == 0 {
        let max_wait_us = match rng.random_range(0..3) {
            0 => rng.random_range(1..=1_000),
            1 => rng.random_range(1..=p.fill_time_us().saturating_mul(2).max(1)),
            _ => rng.random_range(1..=60_000_000),
        };
        return p.with_delay(max_wait_us).unwrap_or(p);
    }
    if rng.random_range(0..3) == 0 {
        let max_debt = match rng.random_range(0..3) {
            0 => p.burst,
            1 => rng.random_range(1..=10),
            _ => rng.random_range(1..=p.burst.saturating_mul(3)),
        };
        return p.with_debt(max_debt).unwrap_or(p);
    }
    p
}

fn random_plain_params(rng: &mut StdRng) -> BucketParams {
    if rng.random_range(0..2) == 0 {
        let rate = Rate::parse(USUAL_RATES[rng.random_range(0..USUAL_RATES.len())]).unwrap();
        let burst = match rng.random_range(0..3) {
            0 => rng.random_range(1..=5),
            1 => rng.random_range(1..=100),
            _ => rng.random_range(1..=100_000),
        };
        return BucketParams::new(rate, burst).unwrap();
    }
    loop {
        let tokens = match rng.random_range(0..4) {
            0 => rng.random_range(1..=10),
            1 => rng.random_range(1..=1_000),
            2 => rng.random_range(1..=1_000_000),
            _ => rng.random_range(1..=100),
        };
        let period_us = match rng.random_range(0..5) {
            0 => 1_000_000,
            1 => 60_000_000,
            2 => rng.random_range(1..=10_000_000),
            3 => rng.random_range(1..=3_600_000_000),
            _ => rng.random_range(1..=1_000) * 1_000,
        };
        let burst = match rng.random_range(0..4) {
            0 => rng.random_range(1..=5),
            1 => rng.random_range(1..=100),
            2 => rng.random_range(1..=100_000),
            _ => rng.random_range(1..=10_000_000),
        };
        if let Ok(p) = BucketParams::new(Rate { tokens, period_us }, burst) {
            assert!(p.capacity < MAX_EXACT);
            return p;
        }
    }
}

fn random_cost(rng: &mut StdRng, p: &BucketParams) -> u64 {
    match rng.random_range(0..20) {
        // A peek: how the usage route reads a bucket it does not charge.
        0 => 0,
        1 => p.burst + rng.random_range(1..=p.burst),
        2 => u64::MAX / rng.random_range(1..=1_000),
        3..=6 => p.burst,
        _ => rng.random_range(1..=p.burst.min(5)),
    }
}

/// Moves the manual clock: mostly forward by anything from nothing to hours, sometimes back
/// (a gateway clock may step back; elapsed time is then clamped at zero on both sides).
fn move_clock(rng: &mut StdRng, clock: &ManualClock) {
    use tollgate_limit::clock::Clock;
    let now = clock.now_us();
    let next = match rng.random_range(0..20) {
        0 => now.saturating_sub(rng.random_range(1..=5_000_000)),
        1 => now,
        2 => now + rng.random_range(1..=4_000_000_000),
        3..=8 => now + rng.random_range(1..=1_000),
        _ => now + rng.random_range(1..=2_000_000),
    };
    clock.set_us(next);
}

/// One request: 1 to 4 distinct buckets of the pool, each with a random cost and shadow flag.
fn random_batch(rng: &mut StdRng, keys: &[String], rules: &[BucketParams]) -> Vec<CheckItem> {
    let n = rng.random_range(1..=4);
    let mut picked: Vec<usize> = (0..BUCKETS).collect();
    for i in 0..n {
        let j = rng.random_range(i..BUCKETS);
        picked.swap(i, j);
    }
    picked[..n]
        .iter()
        .map(|&i| {
            let params = rules[i];
            let charge = Charge {
                params,
                cost: random_cost(rng, &params),
                shadow: rng.random_range(0..5) == 0,
            };
            CheckItem::new(keys[i].as_str().into(), charge, i as u16, FailurePolicy::Local)
        })
        .collect()
}

async fn run(store: &RedisStore, clock: Option<&ManualClock>, tag: &str, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let keys: Vec<String> = (0..BUCKETS).map(|i| format!("rl:{{{tag}}}:b{i}")).collect();
    let mut rules: Vec<BucketParams> = (0..BUCKETS).map(|_| random_params(&mut rng)).collect();
    let mut states: HashMap<String, Stored> = HashMap::new();
    let (mut admitted, mut refused, mut changes, mut multi, mut refunds) = (0, 0, 0, 0, 0);
    let (mut debts, mut peeks_refused, mut queued, mut blocked) = (0, 0, 0, 0);
    // Each bucket's block end, as the script keeps it in the bucket's page.
    let mut blocks: HashMap<String, u64> = HashMap::new();
    for step in 0..STEPS {
        // A rule changes under a live bucket now and then.
        if rng.random_range(0..5) == 0 {
            let i = rng.random_range(0..BUCKETS);
            rules[i] = random_params(&mut rng);
            changes += 1;
        }
        // Mostly one request per call; sometimes several in one call, as the store's queue
        // sends them when the store falls behind: checked in order at one `now`, and they
        // may share buckets.
        let requests = if rng.random_range(0..3) == 0 {
            rng.random_range(2..=4)
        } else {
            1
        };
        // Now and then a rule changes between two requests of one call (a reload while they
        // queued): the call then names one bucket under two rules.
        let mut batches: Vec<Vec<CheckItem>> = Vec::with_capacity(requests);
        for r in 0..requests {
            if r > 0 && rng.random_range(0..4) == 0 {
                let i = rng.random_range(0..BUCKETS);
                rules[i] = random_params(&mut rng);
                changes += 1;
            }
            batches.push(random_batch(&mut rng, &keys, &rules));
        }
        if let Some(c) = clock {
            move_clock(&mut rng, c);
        }
        let outcomes: Vec<Outcome> = if requests == 1 {
            vec![
                store
                    .check(&batches[0])
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}")),
            ]
        } else {
            let refs: Vec<&[CheckItem]> = batches.iter().map(Vec::as_slice).collect();
            let out = store
                .check_together(&refs)
                .await
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            out.into_iter()
                .map(|o| o.unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}")))
                .collect()
        };
        multi += usize::from(requests > 1);

        for (r, (batch, outcome)) in batches.iter().zip(&outcomes).enumerate() {
            assert_eq!(outcome.now_us, outcomes[0].now_us, "one call, one now");
            let charges: Vec<Charge> = batch.iter().map(|i| i.charge).collect();
            let mut expected_states: Vec<Option<BucketState>> = batch
                .iter()
                .map(|i| Stored::read(states.get(&*i.key), outcome.now_us))
                .collect();
            let before = expected_states.clone();
            let mut verdicts = vec![
                BucketVerdict {
                    sufficient: false,
                    tokens: 0,
                    wait_us: None,
                    blocked: false,
                };
                batch.len()
            ];
            let mut ends: Vec<Option<u64>> = batch.iter().map(|i| blocks.get(&*i.key).copied()).collect();
            let expected_allowed = check_blocking(
                &charges,
                &mut expected_states,
                &mut ends,
                outcome.now_us,
                &mut verdicts,
            );
            for (item, end) in batch.iter().zip(&ends) {
                if let Some(e) = end {
                    blocks.insert(item.key.to_string(), *e);
                }
            }
            blocked += usize::from(outcome.buckets.iter().any(|v| v.blocked));
            let context = || {
                format!(
                    "seed {seed} step {step} request {r} of {requests} (replay with TOLLGATE_EQ_SEED={seed}), now {}:\n  charges {charges:#?}\n  states before {before:?}",
                    outcome.now_us
                )
            };
            assert_eq!(
                outcome.admitted,
                expected_allowed,
                "decision differs; {}",
                context()
            );
            assert_eq!(
                outcome.buckets.as_slice(),
                verdicts.as_slice(),
                "units left or waits differ; {}",
                context()
            );
            for (item, s) in batch.iter().zip(expected_states) {
                let s = s.expect("check_all writes every state");
                states.insert(
                    item.key.to_string(),
                    Stored::written(&item.charge.params, s, outcome.now_us),
                );
            }
            if outcome.admitted {
                admitted += 1;
                queued += usize::from(
                    outcome
                        .buckets
                        .iter()
                        .any(|v| v.sufficient && v.wait_us > Some(0)),
                );
            } else {
                refused += 1;
                peeks_refused += batch.iter().filter(|i| i.charge.cost == 0).count();
            }
        }

        // Now and then an admitted request is not delivered, sometimes noticed after the clock
        // moved, and after the later requests of its call were checked.
        for (r, (batch, outcome)) in batches.iter().zip(&outcomes).enumerate() {
            if !outcome.admitted || rng.random_range(0..3) != 0 {
                continue;
            }
            if let Some(c) = clock
                && rng.random_range(0..2) == 0
            {
                move_clock(&mut rng, c);
            }
            // A refund of what the check took, or what the answer cost beyond it: mostly taken
            // (a post-paid debit, which may run into debt), sometimes given back.
            let refund = rng.random_range(0..2) == 0;
            let units: Vec<i64> = if refund {
                refund_units(batch, outcome).to_vec()
            } else {
                batch
                    .iter()
                    .map(|i| {
                        let p = &i.charge.params;
                        match rng.random_range(0..4) {
                            0 => 0,
                            1 => p.units(rng.random_range(0..=p.burst)) as i64,
                            _ => -(p.units(rng.random_range(0..=p.burst.saturating_mul(2))) as i64),
                        }
                    })
                    .collect()
            };
            let got = store
                .adjust_batch(batch, &units)
                .await
                .unwrap_or_else(|e| panic!("seed {seed} step {step} change {r}: {e}"));
            let charges: Vec<Charge> = batch.iter().map(|i| i.charge).collect();
            let before: Vec<Option<BucketState>> = batch
                .iter()
                .map(|i| Stored::read(states.get(&*i.key), got.now_us))
                .collect();
            let mut want: Vec<Option<i64>> = vec![None; batch.len()];
            let mut after = before.clone();
            for (i, c) in charges.iter().enumerate() {
                if units[i] != 0 {
                    let (state, b) = adjust(&c.params, before[i], units[i], got.now_us);
                    after[i] = Some(state);
                    want[i] = Some(b);
                }
            }
            assert_eq!(
                got.balances.as_slice(),
                want.as_slice(),
                "{} differs; seed {seed} step {step} request {r} (replay with TOLLGATE_EQ_SEED={seed}), now {}:\n  charges {charges:#?}\n  units {units:?}\n  verdicts {:?}\n  states before {before:?}",
                if refund { "refund" } else { "post-paid charge" },
                got.now_us,
                outcome.buckets
            );
            for ((item, s), u) in batch.iter().zip(after).zip(&units) {
                if let Some(s) = s
                    && *u != 0
                {
                    states.insert(
                        item.key.to_string(),
                        Stored::written(&item.charge.params, s, got.now_us),
                    );
                }
            }
            debts += usize::from(got.balances.iter().any(|b| b.is_some_and(|b| b < 0)));
            refunds += 1;
        }
    }
    assert!(refunds > STEPS / 20, "seed {seed}: only {refunds} refunds");
    // A seed with only 29 owing changes of 4,000 steps was seen, so the floor sits below that
    // while still failing a run where debt never happens.
    assert!(
        debts > STEPS / 200,
        "seed {seed}: only {debts} changes left a bucket owing"
    );
    assert!(
        blocked > STEPS / 100,
        "seed {seed}: only {blocked} requests met a block"
    );
    assert!(
        queued > STEPS / 100,
        "seed {seed}: only {queued} requests were admitted to wait"
    );
    assert!(
        multi > STEPS / 5,
        "seed {seed}: only {multi} calls held several requests"
    );
    // The run must have exercised both answers and rule changes, or it proves little.
    assert!(
        admitted > STEPS / 20 && refused > STEPS / 20,
        "seed {seed}: {admitted} admitted, {refused} limited"
    );
    assert!(changes > 100, "seed {seed}: only {changes} rule changes");
    // Peeks beside a bucket that refused: what the usage route's own limit does.
    assert!(
        peeks_refused > STEPS / 100,
        "seed {seed}: only {peeks_refused} buckets of cost 0 in a refused request"
    );
}

#[tokio::test]
async fn script_and_bucket_rs_agree_on_the_store_clock() {
    let redis = common::RedisServer::start();
    let store = RedisStore::connect(Target::node(&redis.url()), None)
        .await
        .unwrap();
    let seed = common::eq_seed();
    eprintln!("TOLLGATE_EQ_SEED={seed}");
    run(&store, None, "eq", seed).await;
}

#[tokio::test]
async fn script_and_bucket_rs_agree_on_a_jumping_gateway_clock() {
    let redis = common::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = RedisStore::connect(Target::node(&redis.url()), Some(clock.clone() as Arc<_>))
        .await
        .unwrap();
    let seed = common::eq_seed();
    eprintln!("TOLLGATE_EQ_SEED={seed}");
    run(&store, Some(&clock), "eq", seed).await;
}
