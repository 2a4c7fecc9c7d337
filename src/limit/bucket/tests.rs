//! Tests of `bucket`.

use super::*;

fn p(rate: &str, burst: u64) -> BucketParams {
    BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap()
}

#[test]
fn parses_rates() {
    assert_eq!(
        Rate::parse("600/60s").unwrap(),
        Rate {
            tokens: 600,
            period_us: 60 * US_PER_S
        }
    );
    assert_eq!(Rate::parse("1/5s").unwrap().period_us, 5 * US_PER_S);
    assert_eq!(Rate::parse("10/s").unwrap().period_us, US_PER_S);
    assert_eq!(Rate::parse("5/1m").unwrap().period_us, 60 * US_PER_S);
    assert_eq!(Rate::parse("5/250ms").unwrap().period_us, 250_000);
    for bad in ["", "10", "0/1s", "10/0s", "10/1x", "ten/1s", "10/s1", "-1/1s"] {
        assert!(Rate::parse(bad).is_err(), "{bad} should fail");
    }
}

#[test]
fn scale_makes_refill_integral() {
    let k7 = p("600/60s", 20);
    assert_eq!((k7.scale, k7.refill), (100_000, 1));
    let exports = p("1/5s", 1);
    assert_eq!((exports.scale, exports.refill), (5_000_000, 1));
    let big = p("10000/1s", 20_000);
    assert_eq!((big.scale, big.refill), (100, 1));
    assert!(BucketParams::new(Rate::parse("1/1h").unwrap(), 10_000_000).is_err());
    assert!(BucketParams::new(Rate::parse("1/2h").unwrap(), 1).is_err());
}

#[test]
fn storm_token_boundary_is_exact() {
    // k-7: the 20th storm request at 47.5 ms leaves 0.475 tokens; at 100 ms the bucket
    // holds exactly 1 token and must admit.
    let k7 = p("600/60s", 20);
    let mut state = None;
    let mut admitted = vec![];
    for i in 0..41u64 {
        let now = i * 2_500;
        let c = [Charge {
            params: k7,
            cost: 1,
            shadow: false,
        }];
        let mut s = [state];
        let mut v = [BucketVerdict {
            sufficient: false,
            tokens: 0,
            wait_us: None,
            blocked: false,
        }];
        if check_all(&c, &mut s, now, &mut v) {
            admitted.push(i);
        }
        state = s[0];
    }
    assert_eq!(admitted.len(), 21);
    assert_eq!(*admitted.last().unwrap(), 40);
}

#[test]
fn all_or_nothing_and_longest_wait() {
    // An export while its own bucket is spent: the plan holds 20, the export bucket is
    // empty; the export is limited and the plan is untouched.
    let plan = p("600/60s", 20);
    let exports = p("1/5s", 1);
    let charges = [
        Charge {
            params: plan,
            cost: 10,
            shadow: false,
        },
        Charge {
            params: exports,
            cost: 1,
            shadow: false,
        },
    ];
    let mut states = [None, None];
    let mut v = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }; 2];
    assert!(check_all(&charges, &mut states, 100_000, &mut v));
    assert_eq!(v[0].remaining(&plan), 10);
    assert!(!check_all(&charges, &mut states, 101_000, &mut v));
    // The plan refilled 1 ms (0.01 tokens) and was not charged.
    assert_eq!(v[0].tokens, 10 * plan.scale + 1_000);
    assert!(v[0].sufficient);
    assert_eq!(v[1].wait_us, Some(4_999_000));
    assert_eq!(retry_after_secs(v[1].wait_us.unwrap()), 5);
}

/// A check of cost 0 is how a bucket is read without spending it (the usage route's
/// peeks): it must take nothing, not even when the request's other buckets refuse it, and
/// the state it writes back (refilled to its now) must leave every later check, at that now
/// or after, as it would have been without it.
#[test]
fn a_check_of_cost_zero_takes_nothing_and_changes_no_later_answer() {
    let plain = p("600/60s", 20);
    let owing = p("10/1s", 10).with_debt(10).unwrap();
    let coarse = p("7/3s", 5);
    let states = |q: &BucketParams| {
        [
            None,
            Some(BucketState {
                tokens: q.capacity,
                ts: 1_000,
                scale: q.scale,
            }),
            Some(BucketState {
                tokens: 3 * q.scale + 17,
                ts: 1_000,
                scale: q.scale,
            }),
            // Stored under another rule's scale: the peek converts it, as any check does.
            Some(BucketState {
                tokens: 2 * plain.scale + 5,
                ts: 1_000,
                scale: plain.scale,
            }),
            // Empty and stamped ahead: in debt for a post-paid limit, a fast writer's clock
            // for the others.
            Some(BucketState {
                tokens: 0,
                ts: 400_000,
                scale: q.scale,
            }),
        ]
    };
    let verdict = || BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    };
    for q in [plain, owing, coarse] {
        for start in states(&q) {
            for peek_at in [1_000u64, 50_000, 2_000_000] {
                if q.debt == 0 && start.is_some_and(|s| s.ts > peek_at) {
                    // Stamped ahead by a faster clock: every check, a peek as any other,
                    // writes it back at its own now (README "--clock gateway").
                    continue;
                }
                let free = [Charge {
                    params: q,
                    cost: 0,
                    shadow: false,
                }];
                let mut peeked = [start];
                let mut v = [verdict()];
                assert!(check_all(&free, &mut peeked, peek_at, &mut v));
                assert_eq!(
                    v[0],
                    BucketVerdict {
                        sufficient: true,
                        tokens: refill(&q, start, peek_at),
                        wait_us: Some(0),
                        blocked: false,
                    },
                    "{q:?} from {start:?}"
                );
                assert_eq!(balance(&q, peeked[0], peek_at), balance(&q, start, peek_at));
                for later in [peek_at, peek_at + 1, peek_at + 99_999, peek_at + 10_000_000] {
                    for cost in [1, 3, q.burst, q.burst + 1] {
                        let c = [Charge {
                            params: q,
                            cost,
                            shadow: false,
                        }];
                        let (mut with, mut without) = ([peeked[0]], [start]);
                        let (mut vw, mut vo) = ([verdict()], [verdict()]);
                        let aw = check_all(&c, &mut with, later, &mut vw);
                        let ao = check_all(&c, &mut without, later, &mut vo);
                        assert_eq!(
                            (aw, vw, with),
                            (ao, vo, without),
                            "{q:?} from {start:?}, cost {cost} at {later}"
                        );
                    }
                }
            }
        }
    }
    // Beside a bucket that refuses the request, the peeked bucket is still not charged.
    let empty = p("1/5s", 1);
    let charges = [
        Charge {
            params: empty,
            cost: 1,
            shadow: false,
        },
        Charge {
            params: plain,
            cost: 0,
            shadow: false,
        },
    ];
    let mut s = [
        Some(BucketState {
            tokens: 0,
            ts: 0,
            scale: empty.scale,
        }),
        Some(BucketState {
            tokens: 7 * plain.scale,
            ts: 0,
            scale: plain.scale,
        }),
    ];
    let mut v = [verdict(), verdict()];
    assert!(!check_all(&charges, &mut s, 1_000, &mut v));
    assert!(v[1].sufficient);
    assert_eq!(v[1].tokens, 7 * plain.scale + 1_000);
    assert_eq!(s[1].unwrap().tokens, 7 * plain.scale + 1_000);
}

#[test]
fn tightening_clamps_and_loosening_refills_from_current() {
    let wide = p("10/1s", 20);
    let narrow = p("10/1s", 5);
    let full = BucketState {
        tokens: wide.capacity,
        ts: 0,
        scale: wide.scale,
    };
    assert_eq!(refill(&narrow, Some(full), 0), narrow.capacity);
    let fast = p("20/1s", 20);
    assert_ne!(fast.scale, wide.scale);
    let two = BucketState {
        tokens: 2 * wide.scale,
        ts: 0,
        scale: wide.scale,
    };
    // 100 ms at 20/s adds 2 tokens to the 2 already there.
    assert_eq!(refill(&fast, Some(two), 100_000), 4 * fast.scale);
    assert_eq!(rescale(7 * 3 + 2, 3, 5), 7 * 5 + 3);
}

#[test]
fn cost_above_burst_has_no_wait() {
    let b = p("1/5s", 1);
    assert_eq!(wait_us(&b, b.capacity, b.units(2)), None);
}

#[test]
fn a_refund_at_the_same_now_undoes_the_check_and_never_passes_the_burst() {
    let plan = p("600/60s", 20);
    let exports = p("1/5s", 1);
    let charges = [
        Charge {
            params: plan,
            cost: 3,
            shadow: false,
        },
        Charge {
            params: exports,
            cost: 1,
            shadow: false,
        },
        Charge {
            params: exports,
            cost: 1,
            shadow: true,
        },
    ];
    let start = [
        Some(BucketState {
            tokens: 7 * plan.scale,
            ts: 0,
            scale: plan.scale,
        }),
        None,
        Some(BucketState {
            tokens: 0,
            ts: 0,
            scale: exports.scale,
        }),
    ];
    let mut states = start;
    let mut v = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }; 3];
    assert!(check_all(&charges, &mut states, 1_000, &mut v));
    assert!(!v[2].sufficient, "the empty shadow bucket was not charged");
    let checked = states;
    refund_all(&charges, &v, true, &mut states, 1_000);
    let expected: Vec<_> = start
        .iter()
        .zip(&charges)
        .map(|(s, c)| refill(&c.params, *s, 1_000))
        .collect();
    assert_eq!(states[0].unwrap().tokens, expected[0]);
    assert_eq!(states[1].unwrap().tokens, expected[1]);
    assert_eq!(states[2], checked[2], "an uncharged bucket is left alone");
    // A second refund of the same check can't take a bucket past its burst.
    refund_all(&charges, &v, true, &mut states, 1_000);
    assert_eq!(states[1].unwrap().tokens, exports.capacity);
    assert_eq!(states[0].unwrap().tokens, expected[0] + 3 * plan.scale);
    // A limited check's refund changes nothing.
    let before = states;
    refund_all(&charges, &v, false, &mut states, 2_000);
    assert_eq!(states, before);
}

#[test]
fn post_paid_debt_is_repaid_by_refill_before_admitting() {
    // 10,000 tokens a minute, burst 10,000, owing up to one burst; each completion reserves
    // 1 token and is then charged the 3,000 its answer reports.
    let p = p("10000/60s", 10_000).with_debt(10_000).unwrap();
    let c = [Charge {
        params: p,
        cost: 1,
        shadow: false,
    }];
    let mut s = [None];
    let mut out = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }];
    let now = 1_000_000;
    for _ in 0..4 {
        assert!(check_all(&c, &mut s, now, &mut out));
        let (state, _) = adjust(&p, s[0], -(p.units(2_999) as i64), now);
        s[0] = Some(state);
    }
    // 10,000 - 4 × 3,000: 2,000 tokens owed.
    assert_eq!(balance(&p, s[0], now), -(p.units(2_000) as i64));
    assert!(!check_all(&c, &mut s, now, &mut out));
    // The debt plus the next token, at 10,000 a minute: 2,001 × 6 ms.
    assert_eq!(out[0].wait_us, Some(12_006_000));
    assert_eq!(retry_after_secs(out[0].wait_us.unwrap()), 13);
    // A refusal leaves the debt as it was.
    assert_eq!(balance(&p, s[0], now), -(p.units(2_000) as i64));
    assert!(!check_all(&c, &mut s, now + 12_005_999, &mut out));
    assert_eq!(out[0].wait_us, Some(1));
    assert!(check_all(&c, &mut s, now + 12_006_000, &mut out));
    assert_eq!(out[0].tokens, 0);
}

#[test]
fn debt_stops_at_its_floor_and_refunds_pay_it_first() {
    let p = p("10/1s", 10).with_debt(5).unwrap();
    let (s, b) = adjust(&p, None, -(p.units(100) as i64), 0);
    assert_eq!(b, -(p.units(5) as i64));
    assert_eq!(s.tokens, 0);
    assert_eq!(s.ts, 500_000, "5 tokens at 10/s take 0.5 s to repay");
    assert_eq!(secs_to_full_from(&p, b), 2);
    // Half way, 2.5 tokens are still owed; a refund of 3 leaves half a token.
    let (_, b) = adjust(&p, Some(s), p.units(3) as i64, 250_000);
    assert_eq!(b, p.units(3) as i64 - p.units(5) as i64 / 2);
    // A limit without debt never goes below empty, and a bucket stamped ahead of now by a
    // fast clock owes nothing.
    let plain = BucketParams { debt: 0, ..p };
    let (s, b) = adjust(&plain, None, -(p.units(100) as i64), 0);
    assert_eq!((s.tokens, s.ts, b), (0, 0, 0));
    let ahead = Some(BucketState {
        tokens: 0,
        ts: 9_000,
        scale: p.scale,
    });
    assert_eq!(owed_us(&plain, ahead, 1_000), 0);
    assert_eq!(owed_us(&p, ahead, 1_000), 8_000);
}

#[test]
fn debt_must_stay_exact() {
    let p = p("1/1s", 1_000);
    assert!(matches!(
        p.with_debt(u64::MAX / 2),
        Err(ParamError::DebtTooLarge { .. })
    ));
    assert_eq!(p.with_debt(7).unwrap().debt, p.units(7));
}

fn check_one(c: Charge, s: &mut Option<BucketState>, now: u64) -> (bool, BucketVerdict) {
    let mut v = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }];
    let ok = check_all(&[c], std::slice::from_mut(s), now, &mut v);
    (ok, v[0])
}

#[test]
fn a_queue_admits_what_is_due_within_its_wait_and_owes_it() {
    // 10 a second, burst 1, a wait of up to 2 s: 30 at one instant.
    let q = Charge {
        params: p("10/1s", 1).with_delay(2_000_000).unwrap(),
        cost: 1,
        shadow: false,
    };
    let (mut s, now) = (None, 1_000_000_000);
    let mut waits = Vec::new();
    for _ in 0..30 {
        let (ok, v) = check_one(q, &mut s, now);
        assert_eq!(ok, v.sufficient);
        if ok {
            waits.push(v.wait_us.unwrap());
        } else {
            // The 22nd is due in 2.1 s: 0.1 s past the longest wait.
            assert!(v.wait_us.unwrap() > 2_000_000);
        }
    }
    assert_eq!(waits, (0..=20).map(|k| k * 100_000).collect::<Vec<_>>());
    // Owed until the last is due; then it refills as any bucket.
    assert_eq!(s.unwrap().tokens, 0);
    assert_eq!(s.unwrap().ts, now + 2_000_000);
    // 100 ms on, one more place in the queue has opened: its wait is the longest again.
    let (ok, v) = check_one(q, &mut s, now + 100_000);
    assert!(ok && v.wait_us == Some(2_000_000), "{v:?}");
    assert!(!check_one(q, &mut s, now + 100_000).0);
    let (ok, v) = check_one(q, &mut s, now + 2_000_000);
    assert!(ok && v.wait_us == Some(200_000), "{v:?}");

    // A request that leaves the queue gets nothing back while the bucket owes: its turn
    // passes unused, and the next newcomer's comes after the last one handed out, never on
    // top of it.
    let (mut s, now) = (None, 0);
    check_one(q, &mut s, now);
    let (_, queued) = check_one(q, &mut s, now);
    assert_eq!(queued.wait_us, Some(100_000));
    let (_, last) = check_one(q, &mut s, now);
    assert_eq!(last.wait_us, Some(200_000));
    s = Some(give_back(&q.params, s, q.params.units(1), now + 50_000));
    let (_, next) = check_one(q, &mut s, now + 50_000);
    assert_eq!(next.wait_us, Some(250_000), "due at 300 ms, after the last turn");
    // Once the queue has drained, a refund counts again, as any bucket's.
    s = Some(give_back(&q.params, s, q.params.units(1), now + 300_000));
    assert_eq!(s.unwrap().tokens, q.params.units(1));

    // A limit that refuses refuses the second.
    let plain = Charge {
        params: p("10/1s", 1),
        ..q
    };
    let mut s = None;
    assert!(check_one(plain, &mut s, 0).0);
    assert!(!check_one(plain, &mut s, 0).0);
    assert!(matches!(
        p("10/1s", 1).with_delay(u64::MAX / 4),
        Err(ParamError::WaitTooLong { .. })
    ));
}

#[test]
fn a_block_refuses_whatever_refills_until_it_ends() {
    let mut params = p("1/1s", 1);
    params.block_us = 30_000_000;
    let c = Charge {
        params,
        cost: 1,
        shadow: false,
    };
    let run = |s: &mut Option<BucketState>, b: &mut Option<u64>, now: u64| {
        let mut v = [BucketVerdict {
            sufficient: false,
            tokens: 0,
            wait_us: None,
            blocked: false,
        }];
        let ok = check_blocking(
            &[c],
            std::slice::from_mut(s),
            std::slice::from_mut(b),
            now,
            &mut v,
        );
        (ok, v[0])
    };
    let (mut s, mut b) = (None, None);
    assert!(run(&mut s, &mut b, 0).0);
    // The refusal starts the block; it is not itself blocked.
    let (ok, v) = run(&mut s, &mut b, 0);
    assert!(!ok && !v.blocked && b == Some(30_000_000));
    // 10 s on the bucket is full, and refused until the block ends.
    let (ok, v) = run(&mut s, &mut b, 10_000_000);
    assert!(!ok && v.blocked && v.wait_us == Some(20_000_000) && v.tokens == c.params.capacity);
    assert_eq!(b, Some(30_000_000), "a block met is not started again");
    // A read of cost 0 (the usage route's) charges nothing, and no block refuses it.
    let peek = Charge { cost: 0, ..c };
    let mut v = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }];
    let ok = check_blocking(
        &[peek],
        std::slice::from_mut(&mut s),
        std::slice::from_mut(&mut b),
        20_000_000,
        &mut v,
    );
    assert!(ok && !v[0].blocked && v[0].wait_us == Some(0));
    assert!(run(&mut s, &mut b, 30_000_000).0);
    // Without a block to read (`check_all`), the same bucket decides by its tokens alone.
    let mut s = None;
    let mut v = [BucketVerdict {
        sufficient: false,
        tokens: 0,
        wait_us: None,
        blocked: false,
    }];
    assert!(check_all(&[c], std::slice::from_mut(&mut s), 0, &mut v));
    assert!(!check_all(&[c], std::slice::from_mut(&mut s), 0, &mut v) && !v[0].blocked);
}
