//! The lease and give-back calls of `Leases` (`lease::calls`) on a fake lessor: blocks that
//! expire and go back, syncs before a record expires, failures and the drain.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tollgate_limit::lease::BLOCK_TTL_US;
use tollgate_store::Store;
use tollgate_store::lease::{RETRY_AFTER_FAILURE, SYNC_AFTER_US};
use tollgate_telemetry::metrics::Kind;
use tollgate_testkit::lease_fake::{Fake, item, leases, settle};

#[tokio::test(start_paused = true)]
async fn a_cold_key_waits_for_its_block_which_goes_back_ten_seconds_after_it_arrived() {
    let fake = Fake::new();
    let (l, m) = leases(&fake);
    let hot = [item("10000/1s", 20_000, 100, 1)];
    assert!(l.check(&hot).await.unwrap().admitted);
    assert_eq!(l.held(), 99);
    assert_eq!(
        fake.checks.load(Ordering::SeqCst),
        0,
        "the first request waited for the lease"
    );
    tokio::time::sleep(Duration::from_micros(BLOCK_TTL_US) - Duration::from_millis(1)).await;
    assert_eq!(l.held(), 99, "expired early");
    tokio::time::sleep(Duration::from_millis(2)).await;
    settle(&l).await;
    assert_eq!(l.held(), 0);
    assert_eq!(*fake.given.lock().unwrap(), vec![99]);
    assert_eq!(m.lease_tokens_returned.get(), 99);
    assert_eq!(m.lease_tokens_held.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_gateway_that_spent_its_block_and_fell_silent_syncs_before_its_record_expires() {
    let fake = Fake::new();
    let (l, _m) = leases(&fake);
    // Burst = block: the second lease, at 20 left, is denied, so the last call the store
    // saw reported 80 spent and the record says 20.
    let hot = [item("1000/1s", 100, 100, 1)];
    for _ in 0..100 {
        assert!(l.check(&hot).await.unwrap().admitted);
        settle(&l).await;
    }
    let record = |f: &Fake| f.records.lock().unwrap().get(l.holder_id()).map(|r| r.tokens);
    assert_eq!(record(&fake), Some(20));
    assert_eq!(l.held(), 0);
    // Nothing is left to give back at the block's expiry; 11 s after the last call a
    // give-back of nothing reports the 20 spent, 1 s before the store would reclaim them.
    tokio::time::sleep(Duration::from_micros(SYNC_AFTER_US) - Duration::from_millis(1)).await;
    assert_eq!(record(&fake), Some(20));
    tokio::time::sleep(Duration::from_millis(2)).await;
    settle(&l).await;
    assert_eq!(record(&fake), None);
    assert_eq!(*fake.given.lock().unwrap(), vec![0]);
    // Past the record's own expiry nothing more is sent and nothing is reclaimed.
    tokio::time::sleep(Duration::from_secs(30)).await;
    settle(&l).await;
    assert_eq!(fake.given.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn failed_leases_send_the_key_through_the_inner_store_then_leasing_resumes() {
    let fake = Fake::new();
    let (l, m) = leases(&fake);
    let hot = [item("10000/1s", 20_000, 100, 1)];
    fake.fail.store(true, Ordering::SeqCst);
    // The inner store (the guard, with its failure policy) decides meanwhile.
    for _ in 0..20 {
        assert!(l.check(&hot).await.unwrap().admitted);
    }
    assert_eq!(fake.checks.load(Ordering::SeqCst), 20);
    assert_eq!(
        fake.leases.load(Ordering::SeqCst),
        1,
        "one lease a second per key"
    );
    assert_eq!(m.lease_failures.get_or_create(&Kind { kind: "lease" }).get(), 1);
    fake.refuse_checks.store(true, Ordering::SeqCst);
    assert!(
        !l.check(&hot).await.unwrap().admitted,
        "the inner store's limit stands"
    );
    fake.fail.store(false, Ordering::SeqCst);
    fake.refuse_checks.store(false, Ordering::SeqCst);
    tokio::time::sleep(RETRY_AFTER_FAILURE).await;
    assert!(l.check(&hot).await.unwrap().admitted);
    assert_eq!(l.held(), 99);
    assert_eq!(fake.checks.load(Ordering::SeqCst), 21);
}

#[tokio::test(start_paused = true)]
async fn drain_gives_back_what_is_held_and_grants_still_on_their_way() {
    let fake = Fake::new();
    let (l, m) = leases(&fake);
    let a = item("10000/1s", 20_000, 100, 1);
    let mut b = item("10000/1s", 20_000, 100, 1);
    b.key = "rl:{other}:plan".into();
    b.fp = tollgate_store::fingerprint(&b.key);
    assert!(l.check(std::slice::from_ref(&a)).await.unwrap().admitted);
    // The next lease answers after 50 ms: the request is checked in the store meanwhile,
    // and the grant arrives after the drain began.
    fake.delay_ms.store(50, Ordering::SeqCst);
    assert!(l.check(std::slice::from_ref(&b)).await.unwrap().admitted);
    assert_eq!(fake.checks.load(Ordering::SeqCst), 1);
    assert_eq!(l.drain(Duration::from_secs(1)).await, 99);
    assert_eq!(l.held(), 0);
    assert_eq!(l.calls_in_flight(), 0);
    let mut given = fake.given.lock().unwrap().clone();
    given.sort_unstable();
    assert_eq!(given, vec![99, 100]);
    assert_eq!(m.lease_tokens_returned.get(), 199);
    assert!(
        fake.records.lock().unwrap().is_empty(),
        "a clean exit leaves a record: {:?}",
        fake.records.lock().unwrap()
    );
    // Drained: later requests go to the store, nothing more is leased.
    assert!(l.check(&[a]).await.unwrap().admitted);
    assert_eq!(fake.leases.load(Ordering::SeqCst), 2);
}
