//! Requests whose buckets fall into different Redis Cluster hash slots, checked slot by slot.
//!
//! A Lua script in a cluster reaches the keys of one slot only, so [`Slots`] splits such a
//! request by slot and checks the parts one after another in ascending slot order, one call per
//! slot, each all-or-nothing on its own buckets. The first part refused (by its buckets, or by a
//! failure policy) ends the check: what the parts before it took is given back through
//! [`Store::adjust`] (`lua/refund.lua`), and the later parts are not asked at all. The order is
//! fixed so that two requests that want the same last tokens of two slots can't each take one
//! slot and be refused in the other: the first to reach the lower slot decides both.
//!
//! The merged [`Outcome`] reads as one call's would: a refused request reports its short
//! buckets' verdicts as the refusing slot gave them, and the earlier slots' buckets as sufficient
//! with the tokens they hold once given back (as taken when the give-back failed: the tokens
//! stay taken until refill, counted by the guard in `tollgate_store_refund_failures_total`).
//! Buckets of the slots after the refusal were not asked, and report sufficient and full, as
//! [`Leases`](crate::lease::Leases) reports the buckets it doesn't ask; so a request short in two
//! slots gets the wait of the lower one.
//!
//! It sits in front of the guard, so each slot gets its own timeout and failure policies: a slot
//! whose master doesn't answer is decided by its limits' policies while the other slots decide
//! on the store. A request whose buckets share one slot (every request on one node, and most in a
//! cluster) goes straight through; the embedded store and a single Redis never have this layer.

use std::sync::Arc;

use futures_util::future::join_all;
use smallvec::SmallVec;

use super::{
    Adjusted, Batch, BoxFuture, CheckFuture, CheckItem, FailurePolicy, Outcome, Source, Store, StoreError,
};
use tollgate_limit::bucket::BucketVerdict;

/// The hash slot of a key: a cluster's, or a test's.
pub type SlotOf = fn(&[u8]) -> u16;

/// Redis Cluster's hash slot of a key (CRC16 of its hash tag, mod 16384).
pub fn cluster_slot(key: &[u8]) -> u16 {
    fred::util::redis_keyslot(key)
}

/// A store of many slots, in front of the guard; see the module's text.
pub struct Slots {
    inner: Arc<dyn Store>,
    slot_of: SlotOf,
}

/// The items of one slot, with their places in the whole batch.
struct Part {
    places: SmallVec<[usize; 4]>,
    batch: Batch,
}

impl Slots {
    /// Redis Cluster's slots.
    pub fn new(inner: Arc<dyn Store>) -> Slots {
        Slots::with_slots(inner, cluster_slot)
    }

    /// Slots as `slot_of` names them: tests put a store of one node behind slots of their own.
    pub fn with_slots(inner: Arc<dyn Store>, slot_of: SlotOf) -> Slots {
        Slots { inner, slot_of }
    }

    /// The batch's items grouped by slot, lowest slot first; `None`, without allocating, when
    /// they share one slot.
    fn split(&self, batch: &[CheckItem]) -> Option<SmallVec<[Part; 2]>> {
        let slots: SmallVec<[u16; 4]> = batch.iter().map(|i| (self.slot_of)(i.key.as_bytes())).collect();
        let first = *slots.first()?;
        if slots.iter().all(|s| *s == first) {
            return None;
        }
        let mut order: SmallVec<[u16; 4]> = slots.clone();
        order.sort_unstable();
        order.dedup();
        Some(
            order
                .iter()
                .map(|&slot| {
                    let places: SmallVec<[usize; 4]> =
                        (0..batch.len()).filter(|&i| slots[i] == slot).collect();
                    let batch = places.iter().map(|&i| batch[i].clone()).collect();
                    Part { places, batch }
                })
                .collect(),
        )
    }

    async fn check_parts(
        &self,
        batch: &[CheckItem],
        parts: SmallVec<[Part; 2]>,
    ) -> Result<Outcome, StoreError> {
        let mut outcomes: SmallVec<[Outcome; 2]> = SmallVec::new();
        for part in &parts {
            match self.inner.check(&part.batch).await {
                Ok(o) => {
                    let admitted = o.admitted;
                    outcomes.push(o);
                    if !admitted {
                        break;
                    }
                }
                Err(e) => {
                    // Only a store without a guard fails here; the request still pays nothing.
                    self.give_back(&parts, &mut outcomes).await;
                    return Err(e);
                }
            }
        }
        let refused = outcomes.last().is_some_and(|o| !o.admitted);
        if refused {
            let n = outcomes.len() - 1;
            self.give_back(&parts[..n], &mut outcomes[..n]).await;
        }
        Ok(merge(batch, &parts, &outcomes))
    }

    /// Gives back what the admitted parts `outcomes` (of `parts`, in order) took from their
    /// enforced buckets, all at once, and shows it in their verdicts. Shadow charges stand, as
    /// in one call that refuses. A part whose give-back fails keeps its charge (the guard logs and
    /// counts it).
    async fn give_back(&self, parts: &[Part], outcomes: &mut [Outcome]) {
        let units: SmallVec<[SmallVec<[i64; 4]>; 2]> = parts
            .iter()
            .zip(outcomes.iter())
            .map(|(p, o)| enforced_units(&p.batch, o))
            .collect();
        let changes = parts
            .iter()
            .zip(outcomes.iter())
            .zip(&units)
            .map(|((p, o), u)| self.inner.adjust(&p.batch, o, u));
        let results = join_all(changes).await;
        for (((p, o), u), r) in parts.iter().zip(outcomes.iter_mut()).zip(&units).zip(results) {
            if r.is_err() {
                continue;
            }
            for ((item, v), &back) in p.batch.iter().zip(o.buckets.iter_mut()).zip(u) {
                if back > 0 {
                    v.tokens = (v.tokens + back as u64).min(item.charge.params.capacity);
                }
            }
        }
    }
}

/// What an admitted part took from each enforced bucket, in its units; 0 for shadow buckets.
fn enforced_units(batch: &[CheckItem], outcome: &Outcome) -> SmallVec<[i64; 4]> {
    let mut units = crate::refund_units(batch, outcome);
    for (u, item) in units.iter_mut().zip(batch) {
        if item.charge.shadow {
            *u = 0;
        }
    }
    units
}

/// One outcome for the whole batch from the parts that were asked, each verdict in its item's
/// place. Admitted only when every part was; who decided is the refusing part's source, or for
/// an admission the strictest failure policy that stood in for a part.
fn merge(batch: &[CheckItem], parts: &[Part], outcomes: &[Outcome]) -> Outcome {
    let mut buckets: SmallVec<[BucketVerdict; 4]> = batch
        .iter()
        .map(|i| BucketVerdict {
            sufficient: true,
            tokens: i.charge.params.capacity,
            wait_us: Some(0),
            blocked: false,
        })
        .collect();
    let mut leased = 0u64;
    let mut now_us = 0;
    for (part, o) in parts.iter().zip(outcomes) {
        for (j, &place) in part.places.iter().enumerate() {
            buckets[place] = o.buckets[j];
            if o.is_leased(j) && place < 64 {
                leased |= 1 << place;
            }
        }
        now_us = now_us.max(o.now_us);
    }
    let admitted = outcomes.len() == parts.len() && outcomes.iter().all(|o| o.admitted);
    let source = match outcomes.last() {
        Some(o) if !o.admitted => o.source,
        _ => outcomes
            .iter()
            .map(|o| o.source)
            .max_by_key(|s| match s {
                Source::Store => 0,
                Source::Bypass(FailurePolicy::Open) => 1,
                Source::Bypass(FailurePolicy::Local) => 2,
                Source::Bypass(FailurePolicy::Closed) => 3,
            })
            .unwrap_or(Source::Store),
    };
    Outcome {
        admitted,
        now_us,
        buckets,
        source,
        leased,
    }
}

impl Store for Slots {
    fn blocks(&self) -> BoxFuture<'_, Result<crate::Blocks, StoreError>> {
        self.inner.blocks()
    }

    fn lift<'a>(&'a self, bucket: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.lift(bucket)
    }

    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        match self.split(batch) {
            None => self.inner.check(batch),
            Some(parts) => CheckFuture::Boxed(Box::pin(self.check_parts(batch, parts))),
        }
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    /// Each slot's items go to their slot in one call, all slots at once. The outcome says only
    /// one source for the whole request, so a request decided partly by a failure policy is
    /// changed as that bypass: the slots the store decided keep their charge (an undercount).
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        if crate::units_mismatch(batch, outcome, units).is_some() {
            return self.inner.adjust(batch, outcome, units);
        }
        let Some(parts) = self.split(batch) else {
            return self.inner.adjust(batch, outcome, units);
        };
        Box::pin(async move {
            let asks: SmallVec<[(Outcome, SmallVec<[i64; 4]>); 2]> = parts
                .iter()
                .map(|p| {
                    (
                        outcome.part(&p.places),
                        p.places.iter().map(|&i| units[i]).collect(),
                    )
                })
                .collect();
            let changes = parts
                .iter()
                .zip(&asks)
                .map(|(p, (o, u))| self.inner.adjust(&p.batch, o, u));
            let mut out = Adjusted::none(batch.len());
            let mut lost = None;
            for (p, r) in parts.iter().zip(join_all(changes).await) {
                match r {
                    Ok(got) => {
                        out.now_us = out.now_us.max(got.now_us);
                        for (j, &i) in p.places.iter().enumerate() {
                            out.balances[i] = got.balances[j];
                        }
                    }
                    Err(e) => lost = lost.or(Some(e)),
                }
            }
            match lost {
                Some(e) => Err(e),
                None => Ok(out),
            }
        })
    }

    fn ping(&self) -> CheckFuture<'_> {
        self.inner.ping()
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        self.inner.heartbeat(instance)
    }

    fn remote(&self) -> bool {
        self.inner.remote()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guard::{FleetSize, Guard};
    use crate::memory::MemoryStore;
    use std::time::Duration;
    use tollgate_limit::bucket::{BucketParams, Charge, Rate};
    use tollgate_limit::clock::ManualClock;
    use tollgate_limit::decision::decide;
    use tollgate_telemetry::metrics::Metrics;

    /// A test's slots: the first byte of the hash tag, so `rl:{a}:x` sorts before `rl:{b}:y`.
    fn tag_slot(key: &[u8]) -> u16 {
        let open = key.iter().position(|b| *b == b'{').expect("a tagged key");
        u16::from(key[open + 1])
    }

    fn item(key: &str, burst: u64, cost: u64, policy: FailurePolicy) -> CheckItem {
        let rate = Rate {
            tokens: 1,
            period_us: 1_000_000,
        };
        let charge = Charge {
            params: BucketParams::new(rate, burst).unwrap(),
            cost,
            shadow: false,
        };
        CheckItem::new(key.into(), charge, 0, policy)
    }

    fn open(key: &str, burst: u64) -> CheckItem {
        item(key, burst, 1, FailurePolicy::Open)
    }

    fn batch(items: &[CheckItem]) -> Batch {
        items.iter().cloned().collect()
    }

    /// The units a bucket holds at the store's now (full when never written).
    fn held(m: &MemoryStore, i: &CheckItem) -> u64 {
        let now = m.clock().now_us();
        tollgate_limit::bucket::refill(&i.charge.params, m.peek(i.fp), now)
    }

    fn split_memory() -> (Slots, Arc<MemoryStore>, Arc<ManualClock>) {
        let clock = ManualClock::new(1_000_000);
        let mem = Arc::new(MemoryStore::new(clock.clone()));
        (Slots::with_slots(mem.clone(), tag_slot), mem, clock)
    }

    #[tokio::test]
    async fn a_request_over_two_slots_admitted_takes_from_both() {
        let (s, mem, _clock) = split_memory();
        let (b, a) = (open("rl:{b}:x", 3), open("rl:{a}:y", 2));
        let out = s.check(&batch(&[b.clone(), a.clone()])).await.unwrap();
        assert!(out.admitted);
        assert_eq!(out.source, Source::Store);
        let scale = b.charge.params.scale;
        assert_eq!(out.buckets[0].tokens, 2 * scale, "verdicts stay in batch order");
        assert_eq!(out.buckets[1].tokens, scale);
        assert_eq!(held(&mem, &b), 2 * scale);
        assert_eq!(held(&mem, &a), scale);
    }

    #[tokio::test]
    async fn a_refusal_in_the_later_slot_gives_the_earlier_one_back_and_reads_as_one_call() {
        let (s, mem, _clock) = split_memory();
        let clock = ManualClock::new(1_000_000);
        let twin = MemoryStore::new(clock);
        let (a, b) = (open("rl:{a}:plan", 5), open("rl:{b}:once", 1));
        let req = batch(&[b.clone(), a.clone()]);
        assert!(s.check(&req).await.unwrap().admitted);
        assert!(twin.check_now(&req).admitted);
        let before = mem.peek(a.fp);

        let out = s.check(&req).await.unwrap();
        let one_call = twin.check_now(&req);
        assert!(!out.admitted);
        assert_eq!(mem.peek(a.fp), before, "the earlier slot's bucket is as it was");
        assert_eq!(out, one_call, "the merged outcome is the one a single call gives");
        assert_eq!(decide(&req, &out), decide(&req, &one_call));
    }

    #[tokio::test]
    async fn a_refusal_in_the_earlier_slot_asks_no_later_slot() {
        let (s, mem, _clock) = split_memory();
        let (a, b) = (open("rl:{a}:once", 1), open("rl:{b}:plan", 5));
        let req = batch(&[b.clone(), a.clone()]);
        assert!(s.check(&req).await.unwrap().admitted);
        let before = mem.peek(b.fp);
        let out = s.check(&req).await.unwrap();
        assert!(!out.admitted);
        assert!(!out.buckets[1].sufficient);
        assert_eq!(mem.peek(b.fp), before, "the later slot was not asked");
        assert_eq!(decide(&req, &out).deciding, Some(1));
    }

    /// Random requests over three slots, one after another on a clock that moves: splitting
    /// admits exactly what one all-or-nothing call admits, leaves every bucket as it leaves it,
    /// and refuses with a bucket one call also finds short.
    #[tokio::test]
    async fn split_checks_admit_and_charge_as_one_call_does() {
        let (s, mem, clock) = split_memory();
        let twin_clock = ManualClock::new(1_000_000);
        let twin = MemoryStore::new(twin_clock.clone());
        let pool: Vec<CheckItem> = ["rl:{a}:1", "rl:{a}:2", "rl:{b}:1", "rl:{c}:1", "rl:{c}:2"]
            .iter()
            .zip([4, 2, 3, 5, 1])
            .map(|(k, burst)| open(k, burst))
            .collect();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut admitted, mut refused) = (0, 0);
        for _ in 0..2_000 {
            let mut req = Batch::new();
            for it in &pool {
                if next() % 2 == 0 {
                    let mut it = it.clone();
                    it.charge.cost = next() % 3;
                    req.push(it);
                }
            }
            if req.is_empty() {
                continue;
            }
            let step = next() % 400_000;
            clock.advance_us(step);
            twin_clock.advance_us(step);
            let out = s.check(&req).await.unwrap();
            let one = twin.check_now(&req);
            assert_eq!(out.admitted, one.admitted, "{req:?}");
            for it in &pool {
                assert_eq!(held(&mem, it), held(&twin, it), "{} after {req:?}", it.key);
            }
            if out.admitted {
                admitted += 1;
                assert_eq!(out, one);
            } else {
                refused += 1;
                let d = decide(&req, &out).deciding.expect("a short bucket decides");
                assert!(!one.buckets[d].sufficient, "{req:?}");
            }
        }
        assert!(
            admitted > 200 && refused > 200,
            "{admitted} admitted, {refused} refused"
        );
    }

    fn guarded(inner: Arc<dyn Store>, clock: Arc<ManualClock>) -> (Slots, Arc<Metrics>) {
        let metrics = Metrics::new();
        let guard = Guard::new(
            inner,
            Duration::from_secs(1),
            Arc::new(FleetSize::fixed(1)),
            clock,
            Arc::new(|_| Arc::from("limit")),
            metrics.clone(),
        );
        (Slots::with_slots(Arc::new(guard), tag_slot), metrics)
    }

    /// The memory store, with one slot whose master doesn't answer.
    struct DeadSlot {
        mem: MemoryStore,
        dead: u16,
    }

    impl Store for DeadSlot {
        fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
            if batch.iter().any(|i| tag_slot(i.key.as_bytes()) == self.dead) {
                return CheckFuture::ready(Err(StoreError::Unavailable("connection refused".into())));
            }
            self.mem.check(batch)
        }

        fn kind(&self) -> &'static str {
            "dead-slot"
        }

        fn adjust<'a>(
            &'a self,
            batch: &'a [CheckItem],
            outcome: &'a Outcome,
            units: &'a [i64],
        ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
            self.mem.adjust(batch, outcome, units)
        }

        fn remote(&self) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn a_dead_slot_follows_its_limits_policies_while_the_others_use_the_store() {
        let clock = ManualClock::new(1_000_000);
        let store = Arc::new(DeadSlot {
            mem: MemoryStore::new(clock.clone()),
            dead: u16::from(b'b'),
        });
        let (s, _metrics) = guarded(store.clone(), clock);
        let plan = open("rl:{a}:plan", 5);
        let scale = plan.charge.params.scale;

        // Open on the dead slot: admitted, and the live slot is charged in the store.
        let req = batch(&[plan.clone(), open("rl:{b}:free", 1)]);
        let out = s.check(&req).await.unwrap();
        assert!(out.admitted);
        assert_eq!(out.source, Source::Bypass(FailurePolicy::Open));
        assert_eq!(held(&store.mem, &plan), 4 * scale);

        // Closed on the dead slot: 503, and the live slot gets its token back.
        let req = batch(&[plan.clone(), item("rl:{b}:login", 5, 1, FailurePolicy::Closed)]);
        let out = s.check(&req).await.unwrap();
        assert!(!out.admitted);
        assert!(matches!(
            decide(&req, &out),
            tollgate_limit::decision::Decision::Unavailable(_)
        ));
        assert_eq!(held(&store.mem, &plan), 4 * scale);
        assert_eq!(out.buckets[0].tokens, 4 * scale);

        // The live slot refusing decides before the dead one is asked: a 429, not a 503.
        let spent = open("rl:{a}:spent", 1);
        assert!(s.check(std::slice::from_ref(&spent)).await.unwrap().admitted);
        let req = batch(&[spent.clone(), item("rl:{b}:login", 5, 1, FailurePolicy::Closed)]);
        let out = s.check(&req).await.unwrap();
        assert!(!out.admitted);
        assert_eq!(out.source, Source::Store);
        assert!(matches!(
            decide(&req, &out),
            tollgate_limit::decision::Decision::Limited(..)
        ));
    }
}
