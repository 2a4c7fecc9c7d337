//! One conformance suite for every store: `MemoryStore`, `RedisStore` on one node (on the
//! store's clock, and on a manual gateway clock), and `RedisStore` on a 3-master Redis Cluster.
//!
//! Every expectation is computed from the `now` each check reports, never from a sleep: on a
//! manual clock the suite moves time itself; on the store's clock real microseconds pass
//! between checks and the formulas absorb them.

mod common;

use std::sync::Arc;

use tollgate_limit::bucket::{BucketParams, Charge, Rate, rescale};
use tollgate_limit::clock::ManualClock;
use tollgate_limit::decision::decide;
use tollgate_store::memory::MemoryStore;
use tollgate_store::redis::{RedisStore, Target};
use tollgate_store::{CheckItem, FailurePolicy, Outcome, Store};

/// A store under test, and its clock when the test can move it.
struct Subject<'a> {
    name: &'static str,
    store: &'a dyn Store,
    clock: Option<&'a ManualClock>,
    /// The hash tag every key of the suite shares, so a cluster takes each batch in one slot.
    tag: &'static str,
}

/// Time the suite moves a manual clock before each check: odd, so no refill lands on a round
/// number by luck.
const STEP_US: u64 = 1_337;

fn params(rate: &str, burst: u64) -> BucketParams {
    BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap()
}

impl Subject<'_> {
    fn key(&self, name: &str) -> String {
        format!("rl:{{{}}}:{name}", self.tag)
    }

    fn item(&self, name: &str, rate: &str, burst: u64, cost: u64, shadow: bool, limit: u16) -> CheckItem {
        CheckItem::new(
            self.key(name).into(),
            Charge {
                params: params(rate, burst),
                cost,
                shadow,
            },
            limit,
            FailurePolicy::Local,
        )
    }

    async fn check(&self, batch: &[CheckItem]) -> Outcome {
        if let Some(c) = self.clock {
            c.advance_us(STEP_US);
        }
        let o = self
            .store
            .check(batch)
            .await
            .unwrap_or_else(|e| panic!("{}: check failed: {e}", self.name));
        assert_eq!(
            o.buckets.len(),
            batch.len(),
            "{}: one verdict per bucket",
            self.name
        );
        if let Some(c) = self.clock {
            use tollgate_limit::clock::Clock;
            assert_eq!(
                o.now_us,
                c.now_us(),
                "{}: the check used the clock it was given",
                self.name
            );
        }
        o
    }

    /// Refunds an outcome; the clock does not move, so on a manual clock it is the check's now.
    async fn refund(&self, batch: &[CheckItem], o: &Outcome) {
        self.store
            .refund(batch, o)
            .await
            .unwrap_or_else(|e| panic!("{}: refund failed: {e}", self.name));
    }

    /// The batch's buckets as they are now, read by a check that costs nothing, without moving
    /// the clock.
    async fn peek(&self, batch: &[CheckItem]) -> Outcome {
        let free: Vec<CheckItem> = batch
            .iter()
            .map(|i| {
                let mut i = i.clone();
                i.charge.cost = 0;
                i.charge.shadow = false;
                i
            })
            .collect();
        let o = self
            .store
            .check(&free)
            .await
            .unwrap_or_else(|e| panic!("{}: peek failed: {e}", self.name));
        assert!(o.admitted, "{}: a check of cost 0 is allowed", self.name);
        o
    }
}

/// Burst 5 at 1 token a minute: five pass, the sixth waits for exactly the rest of its token.
async fn burst_then_refusal(s: &Subject<'_>) {
    let p = params("1/60s", 5);
    assert_eq!((p.scale, p.refill), (60_000_000, 1));
    let b = [s.item("burst", "1/60s", 5, 1, false, 0)];
    let first = s.check(&b).await;
    assert!(first.admitted, "{}: first of the burst", s.name);
    assert_eq!(first.buckets[0].tokens, 4 * p.scale, "{}", s.name);
    for j in 2..=5u64 {
        let o = s.check(&b).await;
        assert!(o.admitted, "{}: check {j} of a burst of 5", s.name);
        assert_eq!(
            o.buckets[0].tokens,
            (5 - j) * p.scale + (o.now_us - first.now_us),
            "{}",
            s.name
        );
        assert_eq!(decide(&b, &o).remaining, 5 - j, "{}", s.name);
    }
    let o = s.check(&b).await;
    let since = o.now_us - first.now_us;
    assert!(!o.admitted, "{}: the sixth of a burst of 5 is refused", s.name);
    assert_eq!(o.buckets[0].tokens, since, "{}: refused, not charged", s.name);
    assert_eq!(o.buckets[0].wait_us, Some(p.scale - since), "{}", s.name);
    let d = decide(&b, &o);
    assert_eq!(d.retry_after(), Some(60), "{}", s.name);
    assert_eq!(d.remaining, 0, "{}", s.name);
}

/// Several buckets, one answer: a refusal charges none of them, its retry time is the longest
/// wait, and an admission reports the fewest tokens left.
async fn all_or_nothing(s: &Subject<'_>) {
    let minute = params("1/60s", 1).scale;
    let plan = s.item("aon-plan", "1/60s", 10, 1, false, 0);
    let small = s.item("aon-small", "1/60s", 4, 1, false, 1);
    let o = s.check(&[plan.clone(), small.clone()]).await;
    assert!(o.admitted, "{}", s.name);
    let d = decide(&[plan.clone(), small.clone()], &o);
    assert_eq!(
        (d.remaining, d.deciding),
        (3, Some(1)),
        "{}: remaining is the smallest",
        s.name
    );

    let x = s.item("aon-x", "1/60s", 1, 1, false, 2);
    let y = s.item("aon-y", "1/120s", 1, 1, false, 3);
    let batch = [plan.clone(), x.clone(), y.clone()];
    let first = s.check(&batch).await;
    assert!(first.admitted, "{}", s.name);
    let plan_after_first = first.buckets[0].tokens;
    assert_eq!(
        plan_after_first,
        8 * minute + (first.now_us - o.now_us),
        "{}",
        s.name
    );

    let second = s.check(&batch).await;
    let dt = second.now_us - first.now_us;
    assert!(!second.admitted, "{}: x and y are empty", s.name);
    assert!(
        second.buckets[0].sufficient,
        "{}: the plan alone could pay",
        s.name
    );
    assert_eq!(
        second.buckets[0].tokens,
        plan_after_first + dt,
        "{}: the plan was not charged",
        s.name
    );
    assert_eq!(second.buckets[1].wait_us, Some(minute - dt), "{}", s.name);
    assert_eq!(second.buckets[2].wait_us, Some(2 * minute - dt), "{}", s.name);
    let d = decide(&batch, &second);
    assert_eq!(d.deciding, Some(2), "{}: the longest wait decides", s.name);
    assert_eq!(d.retry_after(), Some(120), "{}", s.name);

    let alone = s.check(std::slice::from_ref(&plan)).await;
    assert!(alone.admitted, "{}", s.name);
    assert_eq!(
        alone.buckets[0].tokens,
        plan_after_first + (alone.now_us - first.now_us) - minute,
        "{}: the refusal charged nothing",
        s.name
    );
}

/// A cost above the burst can never be paid: refused with no wait, and nothing is charged.
async fn cost_above_burst(s: &Subject<'_>) {
    let p = params("1/60s", 2);
    let too_big = [s.item("big", "1/60s", 2, 3, false, 0)];
    let o = s.check(&too_big).await;
    assert!(!o.admitted, "{}", s.name);
    assert_eq!(o.buckets[0].wait_us, None, "{}: no wait helps", s.name);
    assert_eq!(o.buckets[0].tokens, p.capacity, "{}", s.name);
    assert_eq!(decide(&too_big, &o).retry_after(), None, "{}", s.name);
    let fits = [s.item("big", "1/60s", 2, 2, false, 0)];
    let o = s.check(&fits).await;
    assert!(o.admitted, "{}: the refused request took nothing", s.name);
    assert_eq!(o.buckets[0].tokens, 0, "{}", s.name);
}

/// Shadow buckets never block, and are charged on their own whenever they hold their cost.
async fn shadow_buckets(s: &Subject<'_>) {
    let minute = params("1/60s", 1).scale;
    let enforced = s.item("sh-enforced", "1/60s", 1, 1, false, 0);
    let shadow = s.item("sh-shadow", "1/60s", 1, 1, true, 1);
    let a = s.check(&[enforced.clone(), shadow.clone()]).await;
    assert!(a.admitted, "{}", s.name);
    assert_eq!(
        (a.buckets[0].tokens, a.buckets[1].tokens),
        (0, 0),
        "{}: both charged",
        s.name
    );

    // An empty shadow bucket does not block a request its enforced buckets admit.
    let fresh = s.item("sh-fresh", "1/60s", 5, 1, false, 2);
    let batch = [fresh.clone(), shadow.clone()];
    let b = s.check(&batch).await;
    assert!(b.admitted, "{}: a shadow refusal never blocks", s.name);
    assert!(!b.buckets[1].sufficient, "{}", s.name);
    assert_eq!(
        b.buckets[1].tokens,
        b.now_us - a.now_us,
        "{}: shadow not charged when short",
        s.name
    );
    assert_eq!(b.buckets[0].tokens, 4 * minute, "{}", s.name);
    assert_eq!(decide(&batch, &b).shadow_refusals.as_slice(), &[1], "{}", s.name);

    // A refused request still charges a shadow bucket that holds its cost.
    let shadow_full = s.item("sh-shadow-2", "1/60s", 5, 1, true, 3);
    let batch = [enforced.clone(), shadow_full];
    let c = s.check(&batch).await;
    assert!(!c.admitted, "{}: the enforced bucket is empty", s.name);
    assert_eq!(c.buckets[0].tokens, c.now_us - a.now_us, "{}", s.name);
    assert_eq!(
        c.buckets[1].tokens,
        4 * minute,
        "{}: the shadow bucket was charged alone",
        s.name
    );
    assert!(decide(&batch, &c).shadow_refusals.is_empty(), "{}", s.name);

    // Only shadow buckets: always admitted.
    let only = [shadow.clone()];
    assert!(s.check(&only).await.admitted, "{}", s.name);
}

/// Burst 20 -> 5 on a full bucket clamps it to 5 tokens; going back to 20 does not refill it.
async fn tightening(s: &Subject<'_>) {
    let p = params("10/1s", 20);
    assert_eq!((p.scale, p.refill), (100_000, 1));
    let wide = s.check(&[s.item("tight", "10/1s", 20, 1, false, 0)]).await;
    assert_eq!(wide.buckets[0].tokens, 19 * p.scale, "{}", s.name);
    let narrow = [s.item("tight", "10/1s", 5, 1, false, 0)];
    let o = s.check(&narrow).await;
    assert!(o.admitted, "{}", s.name);
    assert_eq!(
        o.buckets[0].tokens,
        4 * p.scale,
        "{}: clamped to 5, then charged 1",
        s.name
    );
    assert_eq!(decide(&narrow, &o).remaining, 4, "{}", s.name);
    let back = s.check(&[s.item("tight", "10/1s", 20, 0, false, 0)]).await;
    assert_eq!(
        back.buckets[0].tokens,
        4 * p.scale + (back.now_us - o.now_us),
        "{}: loosening again refills from 4 tokens, never resets to full",
        s.name
    );
}

/// 10/s -> 20/s on an empty bucket: it refills at 20 a second from where it was.
async fn loosening(s: &Subject<'_>) {
    let slow = params("10/1s", 10);
    let fast = params("20/1s", 10);
    assert_eq!((slow.scale, fast.scale, fast.refill), (100_000, 50_000, 1));
    let drained = s.check(&[s.item("loose", "10/1s", 10, 10, false, 0)]).await;
    assert!(drained.admitted, "{}", s.name);
    assert_eq!(drained.buckets[0].tokens, 0, "{}", s.name);
    if let Some(c) = s.clock {
        // 100 ms: one token at 10/s, two at 20/s.
        c.advance_us(100_000 - STEP_US);
    }
    let o = s.check(&[s.item("loose", "20/1s", 10, 0, false, 0)]).await;
    let elapsed = o.now_us - drained.now_us;
    assert_eq!(
        o.buckets[0].tokens,
        elapsed.min(fast.capacity),
        "{}: elapsed µs × 1 unit of 1/50,000 token: 20 tokens a second",
        s.name
    );
    if s.clock.is_some() {
        assert_eq!(
            decide(&[s.item("loose", "20/1s", 10, 0, false, 0)], &o).remaining,
            2
        );
    }
    // And back to 10/s: the units convert to the old scale (the fraction rounded down as
    // `rescale` does) and refill at 10/s from there.
    let back = s.check(&[s.item("loose", "10/1s", 10, 0, false, 0)]).await;
    let expected =
        (rescale(o.buckets[0].tokens, fast.scale, slow.scale) + (back.now_us - o.now_us)).min(slow.capacity);
    assert_eq!(back.buckets[0].tokens, expected, "{}", s.name);
}

/// A refund of a multi-bucket request gives each bucket it charged, shadow ones included, its
/// cost back: every bucket then holds exactly what it would hold had the request never been
/// checked (on a manual clock, the same tokens at the same now). A shadow bucket the check could
/// not charge gets nothing.
async fn refund_restores_every_bucket(s: &Subject<'_>) {
    let minute = params("1/60s", 1).scale;
    let two_minutes = params("1/120s", 1).scale;
    let a = s.item("rf-a", "1/60s", 10, 3, false, 0);
    let b = s.item("rf-b", "1/120s", 4, 1, false, 1);
    let sh = s.item("rf-shadow", "1/60s", 5, 2, true, 2);
    let sh_empty = s.item("rf-shadow-empty", "1/60s", 1, 1, true, 3);
    // Partly spent buckets first, so a refund that merely fills a bucket is caught.
    let mut b2 = b.clone();
    b2.charge.cost = 2;
    let warm = s.check(&[a.clone(), b2, sh_empty.clone()]).await;
    assert!(warm.admitted, "{}", s.name);
    let batch = [a.clone(), b.clone(), sh.clone(), sh_empty.clone()];
    let o = s.check(&batch).await;
    let dt = o.now_us - warm.now_us;
    assert!(o.admitted, "{}", s.name);
    assert_eq!(o.buckets[0].tokens, 4 * minute + dt, "{}: a charged", s.name);
    assert_eq!(o.buckets[1].tokens, two_minutes + dt, "{}: b charged", s.name);
    assert_eq!(o.buckets[2].tokens, 3 * minute, "{}: shadow charged", s.name);
    assert!(
        !o.buckets[3].sufficient,
        "{}: the empty shadow bucket was short",
        s.name
    );
    s.refund(&batch, &o).await;
    let after = s.peek(&batch).await;
    let since = after.now_us - warm.now_us;
    let tokens: Vec<u64> = after.buckets.iter().map(|v| v.tokens).collect();
    assert_eq!(
        tokens,
        vec![7 * minute + since, 2 * two_minutes + since, 5 * minute, since],
        "{}: every bucket as if the request had never been checked",
        s.name
    );
    if s.clock.is_some() {
        assert_eq!(after.now_us, o.now_us, "{}: refunded at the check's now", s.name);
    }
}

/// A refund never takes a bucket above its burst: not after the bucket refilled meanwhile, and
/// not when the same outcome is refunded twice.
async fn refund_caps_at_burst(s: &Subject<'_>) {
    let p = params("1/60s", 2);
    let b = [s.item("rf-cap", "1/60s", 2, 1, false, 0)];
    let o = s.check(&b).await;
    assert!(o.admitted, "{}", s.name);
    assert_eq!(o.buckets[0].tokens, p.scale, "{}", s.name);
    if let Some(c) = s.clock {
        // A minute and a half: full again before the refund.
        c.advance_us(90_000_000);
    }
    s.refund(&b, &o).await;
    s.refund(&b, &o).await;
    // Read through a burst of 10: a bucket stored above 2 tokens would show it.
    let wide = s.peek(&[s.item("rf-cap", "1/60s", 10, 0, false, 0)]).await;
    let t = wide.buckets[0].tokens;
    assert!(
        t >= p.capacity && t <= p.capacity + (wide.now_us - o.now_us),
        "{}: {t} units after the refunds, the burst is {}",
        s.name,
        p.capacity
    );
    if s.clock.is_some() {
        assert_eq!(t, p.capacity, "{}", s.name);
    }
}

/// A refused request charged no enforced bucket, and its refund changes nothing: not the bucket
/// that could have paid, not the empty one, and its shadow charge stands.
async fn refused_refund_changes_nothing(s: &Subject<'_>) {
    let minute = params("1/60s", 1).scale;
    let could = s.item("rf-could", "1/60s", 5, 1, false, 0);
    let empty = s.item("rf-empty", "1/60s", 1, 1, false, 1);
    let sh = s.item("rf-refused-shadow", "1/60s", 5, 1, true, 2);
    assert!(s.check(std::slice::from_ref(&empty)).await.admitted, "{}", s.name);
    let batch = [could, empty, sh];
    let o = s.check(&batch).await;
    assert!(!o.admitted, "{}", s.name);
    assert_eq!(o.buckets[2].tokens, 4 * minute, "{}: shadow charged", s.name);
    s.refund(&batch, &o).await;
    let after = s.peek(&batch).await;
    let dt = after.now_us - o.now_us;
    let tokens: Vec<u64> = after.buckets.iter().map(|v| v.tokens).collect();
    assert_eq!(
        tokens,
        vec![5 * minute, o.buckets[1].tokens + dt, 4 * minute + dt],
        "{}",
        s.name
    );
}

/// A refund after time passed adds the cost to the bucket as refilled to then.
async fn refund_after_time_passed(s: &Subject<'_>) {
    let minute = params("1/60s", 1).scale;
    let a = [s.item("rf-late", "1/60s", 10, 4, false, 0)];
    let warm = s.check(&a).await;
    let o = s.check(&a).await;
    assert!(o.admitted, "{}", s.name);
    assert_eq!(
        o.buckets[0].tokens,
        2 * minute + (o.now_us - warm.now_us),
        "{}",
        s.name
    );
    if let Some(c) = s.clock {
        // Half a token's refill between the check and the refund.
        c.advance_us(30_000_000);
    }
    s.refund(&a, &o).await;
    let after = s.peek(&a).await;
    if s.clock.is_some() {
        assert_eq!(after.now_us, o.now_us + 30_000_000, "{}", s.name);
    }
    assert_eq!(
        after.buckets[0].tokens,
        6 * minute + (after.now_us - warm.now_us),
        "{}: the refilled value plus the refund",
        s.name
    );
}

/// A post-paid bucket (10,000 tokens a minute, owing up to one burst): each completion reserves
/// 1 token at its check and is charged the 2,999 more its answer reported. The fourth is still
/// admitted; it leaves the bucket 2,000 tokens in debt, and the fifth waits for the debt and its
/// own token. Refill counts from each reported now: one unit a microsecond at this rate.
async fn post_paid_debt(s: &Subject<'_>) {
    let p = params("10000/60s", 10_000).with_debt(10_000).unwrap();
    assert_eq!((p.scale, p.refill), (6_000, 1));
    let mut item = s.item("post-paid", "10000/60s", 10_000, 1, false, 0);
    item.charge.params = p;
    let b = [item];
    let mut balance = p.capacity as i64;
    let mut at = 0u64;
    for k in 1..=4 {
        let o = s.check(&b).await;
        assert!(
            o.admitted,
            "{}: completion {k} is admitted on its reserve",
            s.name
        );
        let refilled = if k == 1 {
            p.capacity as i64
        } else {
            (balance + (o.now_us - at) as i64).min(p.capacity as i64)
        };
        assert_eq!(
            o.buckets[0].tokens as i64,
            refilled - 6_000,
            "{}: check {k}",
            s.name
        );
        let got = s
            .store
            .adjust(&b, &o, &[-(p.units(2_999) as i64)])
            .await
            .unwrap_or_else(|e| panic!("{}: post-paid charge failed: {e}", s.name));
        let since = if s.clock.is_some() {
            assert_eq!(got.now_us, o.now_us, "{}", s.name);
            0
        } else {
            got.now_us - o.now_us
        };
        balance = (o.buckets[0].tokens as i64 + since as i64).min(p.capacity as i64) - p.units(2_999) as i64;
        assert_eq!(
            got.balances.as_slice(),
            &[Some(balance)],
            "{}: charge {k}",
            s.name
        );
        at = got.now_us;
    }
    assert!(
        balance < -(p.units(1_990) as i64),
        "{}: about 2,000 tokens owed, got {balance} units",
        s.name
    );
    let o = s.check(&b).await;
    assert!(!o.admitted, "{}: the fifth waits for the debt", s.name);
    assert_eq!(
        o.buckets[0].tokens, 0,
        "{}: a bucket in debt holds nothing",
        s.name
    );
    let owed_until = at + balance.unsigned_abs();
    assert_eq!(
        o.buckets[0].wait_us,
        Some(owed_until - o.now_us + p.scale),
        "{}: the wait is the debt's repayment plus one token",
        s.name
    );
    let d = decide(&b, &o);
    assert_eq!(d.remaining, 0, "{}", s.name);
    assert!(
        (12..=13).contains(&d.retry_after().unwrap()),
        "{}: about 12 s, got {:?}",
        s.name,
        d.retry_after()
    );
    // A refusal leaves the debt as it was; on a manual clock the bucket admits again exactly
    // when the debt and one token are repaid.
    let again = s.check(&b).await;
    assert_eq!(
        again.buckets[0].wait_us,
        Some(owed_until - again.now_us + p.scale),
        "{}",
        s.name
    );
    if let Some(c) = s.clock {
        c.set_us(owed_until + p.scale - 1 - STEP_US);
        assert!(!s.check(&b).await.admitted, "{}: one microsecond early", s.name);
        assert!(s.check(&b).await.admitted, "{}: repaid", s.name);
    }
}

/// A check of cost 0 is how the usage route reads a bucket it does not charge, in the same call
/// as the buckets it does: it takes nothing beside a bucket that is charged, nothing beside one
/// that refuses the request, and a bucket in debt keeps its debt. Every later answer is what it
/// would have been without the peeks.
async fn peeks_take_nothing(s: &Subject<'_>) {
    use tollgate_limit::bucket::BucketVerdict;
    let minute = params("1/60s", 1).scale;
    let plan = s.item("pk-plan", "1/60s", 5, 2, false, 0);
    let own = s.item("pk-own", "1/60s", 1, 1, false, 1);
    let mut peek = plan.clone();
    peek.charge.cost = 0;
    let warm = s.check(std::slice::from_ref(&plan)).await;
    assert_eq!(warm.buckets[0].tokens, 3 * minute, "{}", s.name);
    let batch = [own.clone(), peek.clone()];
    let read = |o: &Outcome| BucketVerdict {
        sufficient: true,
        tokens: 3 * minute + (o.now_us - warm.now_us),
        wait_us: Some(0),
        blocked: false,
    };
    let first = s.check(&batch).await;
    assert!(first.admitted, "{}", s.name);
    assert_eq!(first.buckets[0].tokens, 0, "{}: its own bucket paid", s.name);
    assert_eq!(
        first.buckets[1],
        read(&first),
        "{}: the peek took nothing",
        s.name
    );
    let second = s.check(&batch).await;
    assert!(!second.admitted, "{}: its own bucket is empty", s.name);
    assert_eq!(second.buckets[1], read(&second), "{}: nor when refused", s.name);
    let d = decide(&batch[..1], &second);
    assert_eq!((d.deciding, d.retry_after()), (Some(0), Some(60)), "{}", s.name);
    let after = s.check(std::slice::from_ref(&plan)).await;
    assert!(after.admitted, "{}", s.name);
    assert_eq!(
        after.buckets[0].tokens,
        minute + (after.now_us - warm.now_us),
        "{}: as if the peeks had never been",
        s.name
    );

    // A post-paid bucket at its debt floor: ten tokens owed at one a second.
    let p = params("1/1s", 10).with_debt(10).unwrap();
    let mut owing = s.item("pk-owing", "1/1s", 10, 1, false, 2);
    owing.charge.params = p;
    let o = s.check(std::slice::from_ref(&owing)).await;
    assert!(o.admitted, "{}", s.name);
    let got = s
        .store
        .adjust(std::slice::from_ref(&owing), &o, &[-(p.units(20) as i64)])
        .await
        .unwrap_or_else(|e| panic!("{}: post-paid charge failed: {e}", s.name));
    assert_eq!(got.balances.as_slice(), &[Some(-(p.debt as i64))], "{}", s.name);
    let owed_until = got.now_us + p.debt;
    let mut free = owing.clone();
    free.charge.cost = 0;
    let peeked = s.check(std::slice::from_ref(&free)).await;
    assert!(peeked.admitted, "{}: a peek never waits", s.name);
    assert_eq!(
        peeked.buckets[0],
        BucketVerdict {
            sufficient: true,
            tokens: 0,
            wait_us: Some(0),
            blocked: false,
        },
        "{}: a bucket in debt holds nothing",
        s.name
    );
    let next = s.check(std::slice::from_ref(&owing)).await;
    assert!(!next.admitted, "{}", s.name);
    assert_eq!(
        next.buckets[0].wait_us,
        Some(owed_until - next.now_us + p.scale),
        "{}: the peek left the debt where it was",
        s.name
    );
}

/// The whole suite, in one order, on fresh keys under `s.tag`.
async fn conformance(s: Subject<'_>) {
    burst_then_refusal(&s).await;
    all_or_nothing(&s).await;
    cost_above_burst(&s).await;
    shadow_buckets(&s).await;
    tightening(&s).await;
    loosening(&s).await;
    refund_restores_every_bucket(&s).await;
    refund_caps_at_burst(&s).await;
    refused_refund_changes_nothing(&s).await;
    refund_after_time_passed(&s).await;
    post_paid_debt(&s).await;
    peeks_take_nothing(&s).await;
}

#[tokio::test]
async fn memory_store_conforms() {
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = MemoryStore::new(clock.clone());
    conformance(Subject {
        name: "memory",
        store: &store,
        clock: Some(&clock),
        tag: "conf",
    })
    .await;
}

#[tokio::test]
async fn redis_store_conforms_on_the_store_clock() {
    let redis = common::RedisServer::start();
    let store = RedisStore::connect(Target::node(&redis.url()), None)
        .await
        .expect("connects");
    conformance(Subject {
        name: "redis",
        store: &store,
        clock: None,
        tag: "conf",
    })
    .await;
}

#[tokio::test]
async fn redis_store_conforms_on_a_gateway_clock() {
    let redis = common::RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let store = RedisStore::connect(Target::node(&redis.url()), Some(clock.clone() as Arc<_>))
        .await
        .expect("connects");
    conformance(Subject {
        name: "redis --clock gateway",
        store: &store,
        clock: Some(&clock),
        tag: "conf",
    })
    .await;
}

#[tokio::test]
async fn redis_cluster_conforms() {
    let cluster = common::RedisCluster::start();
    let nodes = cluster.node_list();
    let store = RedisStore::connect(Target::cluster(&nodes), None)
        .await
        .expect("connects");
    assert_eq!(store.kind(), "redis-cluster");
    // Tags in slots 4369, 8331 and 15495: one on each master of a fresh 3-master cluster.
    for tag in ["conf", "k8", "a"] {
        conformance(Subject {
            name: "redis-cluster",
            store: &store,
            clock: None,
            tag,
        })
        .await;
    }
    // A failover empties a node's script cache: after SCRIPT FLUSH on every master, the next
    // check on each master loads the script again and succeeds.
    for n in &cluster.nodes {
        assert_eq!(n.cli(&["SCRIPT", "FLUSH"]), "OK");
    }
    for tag in ["conf", "k8", "a"] {
        let key = format!("rl:{{{tag}}}:after-flush");
        let params = params("1/60s", 2);
        let b = [CheckItem::new(
            key.into(),
            Charge {
                params,
                cost: 1,
                shadow: false,
            },
            0,
            FailurePolicy::Local,
        )];
        let o = store
            .check(&b)
            .await
            .expect("a check after SCRIPT FLUSH succeeds");
        assert_eq!(o.buckets[0].tokens, params.scale);
    }
    // Checks of three slots queued at once, interleaved: the queue shares calls only within a
    // slot, so every one of them succeeds.
    let params = params("1/60s", 100);
    let mixed: Vec<CheckItem> = (0..60)
        .map(|i| {
            let tag = ["conf", "k8", "a"][i % 3];
            CheckItem::new(
                format!("rl:{{{tag}}}:mixed").into(),
                Charge {
                    params,
                    cost: 1,
                    shadow: false,
                },
                0,
                FailurePolicy::Local,
            )
        })
        .collect();
    let mut futures: Vec<_> = mixed
        .iter()
        .map(|i| Box::pin(store.check(std::slice::from_ref(i))))
        .collect();
    common::store::queue_all(&mut futures).await;
    for f in futures {
        let o = f.await.expect("a queued check on the cluster succeeds");
        assert!(o.admitted);
    }
    let sizes: Vec<String> = cluster.nodes.iter().map(|n| n.cli(&["DBSIZE"])).collect();
    assert!(
        sizes.iter().all(|n| n != "0"),
        "every master should hold some of the suite's buckets, got DBSIZE {sizes:?}"
    );
}
