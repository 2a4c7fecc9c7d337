//! Property tests of the bucket math under a manual clock: for any arrivals, what is admitted in
//! any interval of length t is at most b + r·t; an idle bucket is full after b/r; and a refused
//! multi-bucket check charges nothing.

use proptest::prelude::*;
use tollgate_limit::bucket::{BucketParams, BucketState, BucketVerdict, Charge, Rate, check_all, refill};
use tollgate_limit::clock::{Clock, ManualClock};
use tollgate_store::memory::MemoryStore;
use tollgate_store::{CheckItem, FailurePolicy};

fn params() -> impl Strategy<Value = BucketParams> {
    (
        1u64..2_000,
        prop_oneof![
            Just(1_000u64),
            Just(250_000),
            Just(1_000_000),
            Just(5_000_000),
            Just(60_000_000)
        ],
        1u64..200,
    )
        .prop_map(|(tokens, period_us, burst)| BucketParams::new(Rate { tokens, period_us }, burst).unwrap())
}

fn verdict() -> BucketVerdict {
    BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Runs arrivals through the embedded store on a manual clock and checks the bound for
    /// every interval that starts and ends on an arrival.
    #[test]
    fn admitted_in_any_interval_is_at_most_b_plus_rt(
        p in params(),
        arrivals in prop::collection::vec((0u64..400_000, 1u64..4), 1..300),
    ) {
        let clock = ManualClock::new(10_000_000);
        let store = MemoryStore::new(clock.clone());
        let item = CheckItem::new("rl:{t}:plan".into(), Charge { params: p, cost: 1, shadow: false }, 0, FailurePolicy::Local);
        let mut admitted: Vec<(u64, u64)> = vec![];
        for (gap, cost) in arrivals {
            clock.advance_us(gap);
            let cost = cost.min(p.burst);
            let mut it = item.clone();
            it.charge.cost = cost;
            let out = store.check_now(std::slice::from_ref(&it));
            if out.admitted {
                admitted.push((clock.now_us(), cost));
            }
        }
        for i in 0..admitted.len() {
            let mut sum = 0u128;
            for j in i..admitted.len() {
                sum += admitted[j].1 as u128;
                let t = (admitted[j].0 - admitted[i].0) as u128;
                // In units: sum·scale ≤ capacity + t·refill, i.e. sum ≤ b + r·t exactly.
                prop_assert!(
                    sum * p.scale as u128 <= p.capacity as u128 + t * p.refill as u128,
                    "{} admitted in {} µs, above b + r·t for {:?}", sum, t, p.rate
                );
            }
        }
    }

    #[test]
    fn an_idle_bucket_is_full_after_b_over_r(p in params(), tokens_frac in 0u64..1_000, ts in 0u64..1_000_000_000) {
        let state = BucketState { tokens: p.capacity * tokens_frac / 1_000, ts, scale: p.scale };
        prop_assert_eq!(refill(&p, Some(state), ts + p.fill_time_us()), p.capacity);
        prop_assert_eq!(refill(&p, None, ts), p.capacity);
        // And TTL ≥ b / r, so expiry never hands out tokens the refill would not.
        prop_assert!(p.ttl_ms() * 1_000 >= p.fill_time_us());
    }

    #[test]
    fn a_refused_batch_charges_nothing(
        a in params(), b in params(), ca in 1u64..50, cb in 1u64..50,
        ta in 0u64..1_000, tb in 0u64..1_000, now in 0u64..10_000_000,
    ) {
        let charges = [
            Charge { params: a, cost: ca.min(a.burst), shadow: false },
            Charge { params: b, cost: cb.min(b.burst), shadow: false },
        ];
        let before = [
            Some(BucketState { tokens: a.capacity * ta / 1_000, ts: 0, scale: a.scale }),
            Some(BucketState { tokens: b.capacity * tb / 1_000, ts: 0, scale: b.scale }),
        ];
        let mut states = before;
        let mut out = [verdict(); 2];
        let admitted = check_all(&charges, &mut states, now, &mut out);
        for i in 0..2 {
            let refilled = refill(&charges[i].params, before[i], now);
            let after = states[i].unwrap().tokens;
            if admitted {
                prop_assert_eq!(after, refilled - charges[i].params.units(charges[i].cost));
            } else {
                prop_assert_eq!(after, refilled, "bucket {} was charged by a refused request", i);
            }
        }
        prop_assert_eq!(admitted, out.iter().all(|v| v.sufficient));
    }
}
