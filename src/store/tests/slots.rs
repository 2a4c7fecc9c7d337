//! A cluster request over several slots whose give-back is lost (`slots`, behind the guard):
//! the tokens stay taken and the failure is counted.

use std::sync::Arc;
use std::time::Duration;

use tollgate_limit::bucket::{BucketParams, Charge, Rate};
use tollgate_limit::clock::ManualClock;
use tollgate_store::guard::{FleetSize, Guard};
use tollgate_store::memory::MemoryStore;
use tollgate_store::slots::Slots;
use tollgate_store::{Batch, CheckItem, FailurePolicy, Store};
use tollgate_telemetry::metrics::{Kind, Metrics};
use tollgate_testkit::stores::LostChanges;

/// A test's slots: the first byte of the hash tag, so `rl:{a}:x` sorts before `rl:{b}:y`.
fn tag_slot(key: &[u8]) -> u16 {
    let open = key.iter().position(|b| *b == b'{').expect("a tagged key");
    u16::from(key[open + 1])
}

fn open(key: &str, burst: u64) -> CheckItem {
    let rate = Rate {
        tokens: 1,
        period_us: 1_000_000,
    };
    let charge = Charge {
        params: BucketParams::new(rate, burst).unwrap(),
        cost: 1,
        shadow: false,
    };
    CheckItem::new(key.into(), charge, 0, FailurePolicy::Open)
}

fn batch(items: &[CheckItem]) -> Batch {
    items.iter().cloned().collect()
}

/// The units a bucket holds at the store's now (full when never written).
fn held(m: &MemoryStore, i: &CheckItem) -> u64 {
    let now = m.clock().now_us();
    tollgate_limit::bucket::refill(&i.charge.params, m.peek(i.fp), now)
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

#[tokio::test]
async fn a_give_back_that_is_lost_leaves_the_tokens_taken_and_is_counted() {
    let clock = ManualClock::new(1_000_000);
    let lost = Arc::new(LostChanges(Arc::new(MemoryStore::new(clock.clone()))));
    let (s, metrics) = guarded(lost.clone(), clock);
    let (a, b) = (open("rl:{a}:plan", 5), open("rl:{b}:once", 1));
    let req = batch(&[a.clone(), b.clone()]);
    assert!(s.check(&req).await.unwrap().admitted);
    let out = s.check(&req).await.unwrap();
    assert!(!out.admitted, "the client still gets the refusal");
    let scale = a.charge.params.scale;
    assert_eq!(held(&lost.0, &a), 3 * scale, "both requests' tokens stay taken");
    assert_eq!(out.buckets[0].tokens, 3 * scale, "and the verdict says so");
    let failures = metrics
        .store_refund_failures
        .get_or_create(&Kind { kind: "error" })
        .get();
    assert_eq!(failures, 1);
}
