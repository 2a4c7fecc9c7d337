//! A request's leased items (`lease::spend`) on a fake lessor: paid from blocks, refused
//! locally, and the tokens put back when the request is refused or undelivered.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tollgate_limit::bucket::BucketVerdict;
use tollgate_limit::lease::BLOCK_TTL_US;
use tollgate_store::Store;
use tollgate_testkit::lease_fake::{Fake, item, leases, settle};

#[tokio::test(start_paused = true)]
async fn a_denied_key_is_refused_locally_until_denied_until_without_a_store_call() {
    let fake = Fake::new();
    let (l, m) = leases(&fake);
    // Burst = block: the first block empties the bucket, so the next lease is denied for
    // one cycle, 100 / 1,000 s = 100 ms (plus up to 50 ms of jitter).
    let hot = [item("1000/1s", 100, 100, 1)];
    for i in 0..100 {
        assert!(l.check(&hot).await.unwrap().admitted, "request {i}");
        settle(&l).await;
    }
    assert_eq!((m.lease_grants.get(), m.lease_denials.get()), (1, 1));
    let out = l.check(&hot).await.unwrap();
    assert!(!out.admitted);
    let wait = out.buckets[0].wait_us.unwrap();
    assert!((1..=150_000).contains(&wait), "{wait}");
    // Refusals cost nothing until then.
    for _ in 0..50 {
        assert!(!l.check(&hot).await.unwrap().admitted);
    }
    assert_eq!(fake.leases.load(Ordering::SeqCst), 2);
    assert_eq!(fake.checks.load(Ordering::SeqCst), 0);
    // After the denial the bucket has refilled a block.
    tokio::time::sleep(Duration::from_micros(wait)).await;
    assert!(l.check(&hot).await.unwrap().admitted);
    assert_eq!(m.lease_grants.get(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_refusal_elsewhere_puts_the_reserved_tokens_back() {
    let fake = Fake::new();
    let (l, _m) = leases(&fake);
    let mut other = item("1/1s", 1, 1, 1);
    other.lease = None;
    other.key = "rl:{kbig}:exports".into();
    let hot = item("10000/1s", 20_000, 100, 10);
    assert!(l.check(&[hot.clone(), other.clone()]).await.unwrap().admitted);
    assert_eq!(l.held(), 90);
    fake.refuse_checks.store(true, Ordering::SeqCst);
    let out = l.check(&[hot.clone(), other]).await.unwrap();
    assert!(!out.admitted);
    assert!(out.buckets[0].sufficient && !out.buckets[1].sufficient);
    assert_eq!(l.held(), 90, "the 10 reserved tokens went back to the block");
}

#[tokio::test(start_paused = true)]
async fn an_undelivered_request_puts_block_tokens_back_and_refunds_the_rest_in_the_store() {
    let fake = Fake::new();
    let (l, _m) = leases(&fake);
    let mut other = item("1/1s", 1, 1, 1);
    other.lease = None;
    other.key = "rl:{kbig}:exports".into();
    let hot = item("10000/1s", 20_000, 100, 10);
    let batch = [hot.clone(), other];
    let out = l.check(&batch).await.unwrap();
    assert!(out.admitted);
    assert!(out.is_leased(0) && !out.is_leased(1));
    assert_eq!(l.held(), 90);
    let paid = l.check(std::slice::from_ref(&hot)).await.unwrap();
    assert_eq!(l.held(), 80);
    l.refund(&batch, &out).await.unwrap();
    assert_eq!(l.held(), 90, "the block got its 10 tokens back");
    assert_eq!(
        *fake.refunded.lock().unwrap(),
        vec![vec!["rl:{kbig}:exports".to_string()]],
        "the store refunds only what it charged"
    );
    // A request a block paid alone never reaches the store's refund.
    l.refund(std::slice::from_ref(&hot), &paid).await.unwrap();
    assert_eq!(l.held(), 100);
    assert_eq!(fake.refunded.lock().unwrap().len(), 1);
    // A limited request's refund changes nothing.
    fake.refuse_checks.store(true, Ordering::SeqCst);
    let limited = l.check(&batch).await.unwrap();
    assert!(!limited.admitted);
    assert_eq!(l.held(), 100);
    l.refund(&batch, &limited).await.unwrap();
    assert_eq!(l.held(), 100);
}

#[tokio::test(start_paused = true)]
async fn a_check_of_cost_zero_neither_leases_nor_spends() {
    let fake = Fake::new();
    let (l, m) = leases(&fake);
    let peek = item("10000/1s", 20_000, 100, 0);
    let scale = peek.charge.params.scale;
    // Nothing held: the store reads the bucket, and no block is asked for.
    let out = l.check(std::slice::from_ref(&peek)).await.unwrap();
    assert!(out.admitted && out.leased == 0);
    settle(&l).await;
    assert_eq!(fake.leases.load(Ordering::SeqCst), 0);
    assert_eq!(fake.checks.load(Ordering::SeqCst), 1);
    // A block held: the peek reads what is left of it and takes none of it.
    let hot = item("10000/1s", 20_000, 100, 1);
    assert!(l.check(std::slice::from_ref(&hot)).await.unwrap().admitted);
    settle(&l).await;
    assert_eq!((l.held(), fake.leases.load(Ordering::SeqCst)), (99, 1));
    let out = l.check(std::slice::from_ref(&peek)).await.unwrap();
    assert!(out.admitted && out.leased == 0);
    assert_eq!(
        out.buckets[0],
        BucketVerdict {
            sufficient: true,
            tokens: 99 * scale,
            wait_us: Some(0),
            blocked: false,
        }
    );
    // Beside a bucket the store refuses, it still takes nothing, and nothing goes back.
    let mut other = item("1/1s", 1, 1, 1);
    other.lease = None;
    other.key = "rl:{kbig}:exports".into();
    fake.refuse_checks.store(true, Ordering::SeqCst);
    let out = l.check(&[peek.clone(), other]).await.unwrap();
    assert!(!out.admitted && out.leased == 0);
    settle(&l).await;
    assert_eq!(l.held(), 99);
    assert_eq!(fake.leases.load(Ordering::SeqCst), 1);
    assert!(fake.given.lock().unwrap().is_empty());
    assert_eq!(m.lease_tokens_held.get(), 99);
    // Past the block's expiry (its timer gave the rest back) a peek sees nothing held: the
    // store answers, and still no block is asked for.
    tokio::time::sleep(Duration::from_micros(BLOCK_TTL_US)).await;
    fake.refuse_checks.store(false, Ordering::SeqCst);
    let before = fake.checks.load(Ordering::SeqCst);
    assert!(l.check(std::slice::from_ref(&peek)).await.unwrap().admitted);
    assert_eq!(fake.checks.load(Ordering::SeqCst), before + 1);
    assert_eq!(fake.leases.load(Ordering::SeqCst), 1);
}
