//! Tests of `guard`.

use super::*;
use std::sync::atomic::AtomicU8;
use tollgate_limit::bucket::Charge;
use tollgate_limit::clock::ManualClock;

/// A store that answers from memory, fails, or never answers, as told.
struct Faulty {
    mode: AtomicU8,
    calls: AtomicU64,
    refunds: AtomicU64,
    mem: MemoryStore,
}

const OK: u8 = 0;
const FAIL: u8 = 1;
const HANG: u8 = 2;

impl Store for Faulty {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.mode.load(Ordering::SeqCst) {
            OK => CheckFuture::ready(Ok(self.mem.check_now(batch))),
            FAIL => CheckFuture::ready(Err(StoreError::Unavailable("connection refused".into()))),
            _ => CheckFuture::Boxed(Box::pin(std::future::pending())),
        }
    }
    fn kind(&self) -> &'static str {
        "faulty"
    }
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        self.refunds.fetch_add(1, Ordering::SeqCst);
        match self.mode.load(Ordering::SeqCst) {
            OK => self.mem.adjust(batch, outcome, units),
            FAIL => Box::pin(std::future::ready(Err(StoreError::Unavailable(
                "connection refused".into(),
            )))),
            _ => Box::pin(std::future::pending()),
        }
    }
}

fn item(name: &str, limit: u16, rate: &str, burst: u64, policy: FailurePolicy) -> CheckItem {
    let params = BucketParams::new(Rate::parse(rate).unwrap(), burst).unwrap();
    CheckItem::new(
        name.into(),
        Charge {
            params,
            cost: 1,
            shadow: false,
        },
        limit,
        policy,
    )
}

fn guard(mode: u8, n: u32) -> (Arc<Guard>, Arc<Faulty>, Arc<Metrics>) {
    let clock = ManualClock::new(1_000_000);
    let faulty = Arc::new(Faulty {
        mode: AtomicU8::new(mode),
        calls: AtomicU64::new(0),
        refunds: AtomicU64::new(0),
        mem: MemoryStore::new(clock.clone()),
    });
    let metrics = Metrics::new();
    let g = Guard::new(
        faulty.clone(),
        Duration::from_millis(3),
        Arc::new(FleetSize::fixed(n)),
        clock,
        Arc::new(|li| Arc::from(["free", "login", "plan"].get(li as usize).copied().unwrap_or("?"))),
        metrics.clone(),
    );
    (Arc::new(g), faulty, metrics)
}

fn plan() -> CheckItem {
    // Limits compile in name order: free, login, plan.
    item("rl:{k7}:plan", 2, "10/1s", 20, FailurePolicy::Local)
}

#[tokio::test(start_paused = true)]
async fn failures_fall_back_to_a_local_share_then_open_the_breaker() {
    let (g, faulty, metrics) = guard(FAIL, 2);
    let batch = [plan()];
    // Share of 2 gateways: burst 10, rate 5/s. It starts full at the first failure.
    let mut admitted = 0;
    for _ in 0..12 {
        if g.check(&batch).await.unwrap().admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
    // Five failures opened the breaker; the other seven never reached the store.
    assert_eq!(faulty.calls.load(Ordering::SeqCst), FAILURES_TO_OPEN as u64);
    assert!(g.breaker_open());
    assert!(
        metrics
            .render()
            .contains(r#"tollgate_store_bypass_total{limit="plan",policy="local"} 12"#)
    );
    assert!(metrics.render().contains("tollgate_store_breaker_open 1"));
}

#[tokio::test(start_paused = true)]
async fn one_probe_a_second_and_the_first_success_closes() {
    let (g, faulty, metrics) = guard(FAIL, 1);
    let batch = [plan()];
    for _ in 0..5 {
        g.check(&batch).await.unwrap();
    }
    assert!(g.breaker_open());
    for _ in 0..50 {
        g.check(&batch).await.unwrap();
    }
    assert_eq!(
        faulty.calls.load(Ordering::SeqCst),
        5,
        "an open breaker sends nothing before the probe"
    );
    tokio::time::advance(PROBE_EVERY).await;
    for _ in 0..10 {
        g.check(&batch).await.unwrap();
    }
    assert_eq!(
        faulty.calls.load(Ordering::SeqCst),
        6,
        "exactly one probe after a second"
    );
    faulty.mode.store(OK, Ordering::SeqCst);
    tokio::time::advance(PROBE_EVERY).await;
    let out = g.check(&batch).await.unwrap();
    assert_eq!(out.source, Source::Store);
    assert!(!g.breaker_open());
    let bypass = |m: &Metrics| {
        m.render()
            .lines()
            .find(|l| l.starts_with("tollgate_store_bypass_total"))
            .map(str::to_string)
    };
    let before = bypass(&metrics);
    for _ in 0..10 {
        assert_eq!(g.check(&batch).await.unwrap().source, Source::Store);
    }
    assert_eq!(
        before,
        bypass(&metrics),
        "the bypass counter moved after the store came back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_store_costs_at_most_the_timeout() {
    let (g, _faulty, metrics) = guard(HANG, 1);
    let batch = [plan()];
    let started = Instant::now();
    let out = g.check(&batch).await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_millis(3));
    assert!(out.admitted);
    assert_eq!(out.source, Source::Bypass(FailurePolicy::Local));
    assert!(
        metrics
            .render()
            .contains(r#"tollgate_store_errors_total{kind="timeout"} 1"#)
    );
}

#[tokio::test(start_paused = true)]
async fn checks_that_time_out_together_count_as_one_failure() {
    let (g, faulty, _metrics) = guard(HANG, 1);
    let batch = [plan()];
    // Twenty checks in flight when the store stalls: one slow moment.
    let together: Vec<_> = (0..20).map(|_| g.check(&batch)).collect();
    for out in futures_util::future::join_all(together).await {
        assert_eq!(out.unwrap().source, Source::Bypass(FailurePolicy::Local));
    }
    assert!(!g.breaker_open(), "one slow moment opened the breaker");
    // A store that stays hung fails check after check: five in a row open it.
    for _ in 1..FAILURES_TO_OPEN {
        assert!(!g.breaker_open());
        g.check(&batch).await.unwrap();
    }
    assert!(g.breaker_open());
    assert_eq!(
        faulty.calls.load(Ordering::SeqCst),
        20 + u64::from(FAILURES_TO_OPEN) - 1
    );
    // A success between two slow moments starts the count again.
    tokio::time::advance(PROBE_EVERY).await;
    faulty.mode.store(OK, Ordering::SeqCst);
    g.check(&batch).await.unwrap();
    assert!(!g.breaker_open());
    faulty.mode.store(HANG, Ordering::SeqCst);
    for _ in 1..FAILURES_TO_OPEN {
        g.check(&batch).await.unwrap();
    }
    assert!(!g.breaker_open(), "four failures after a success opened it");
}

#[tokio::test(start_paused = true)]
async fn the_strictest_policy_decides() {
    let (g, _f, _m) = guard(FAIL, 1);
    let closed = item("rl:{ip:1.2.3.4}:login", 1, "5/60s", 5, FailurePolicy::Closed);
    let open = item("rl:{ip:1.2.3.4}:free", 0, "1/1s", 1, FailurePolicy::Open);
    let out = g.check(&[plan(), closed.clone(), open.clone()]).await.unwrap();
    assert!(!out.admitted);
    assert_eq!(out.source, Source::Bypass(FailurePolicy::Closed));
    // Open alone admits everything, even past its burst.
    for _ in 0..10 {
        let out = g.check(std::slice::from_ref(&open)).await.unwrap();
        assert!(out.admitted);
        assert_eq!(out.source, Source::Bypass(FailurePolicy::Open));
    }
    // Local and open together: the local share decides.
    let mut admitted = 0;
    for _ in 0..25 {
        if g.check(&[plan(), open.clone()]).await.unwrap().admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 20);
}

#[tokio::test(start_paused = true)]
async fn a_local_bypass_refunds_into_the_local_share() {
    let (g, faulty, metrics) = guard(FAIL, 2);
    let batch = [plan()];
    // Share of 2 gateways: burst 10, rate 5/s, on a clock that does not move.
    let mut last = None;
    for _ in 0..10 {
        let out = g.check(&batch).await.unwrap();
        assert!(out.admitted);
        assert_eq!(out.source, Source::Bypass(FailurePolicy::Local));
        last = Some(out);
    }
    let limited = g.check(&batch).await.unwrap();
    assert!(!limited.admitted);
    g.refund(&batch, &limited).await.unwrap();
    assert!(
        !g.check(&batch).await.unwrap().admitted,
        "a limited outcome's refund gave nothing back"
    );
    g.refund(&batch, &last.unwrap()).await.unwrap();
    assert!(
        g.check(&batch).await.unwrap().admitted,
        "the refund gave the share its token back"
    );
    assert!(!g.check(&batch).await.unwrap().admitted, "exactly one token");
    // An open bypass charged nothing, so it refunds nothing, anywhere.
    let open = item("rl:{ip:1.2.3.4}:free", 0, "1/1s", 1, FailurePolicy::Open);
    let out = g.check(std::slice::from_ref(&open)).await.unwrap();
    assert_eq!(out.source, Source::Bypass(FailurePolicy::Open));
    g.refund(std::slice::from_ref(&open), &out).await.unwrap();
    assert_eq!(
        faulty.refunds.load(Ordering::SeqCst),
        0,
        "a bypass never asks the store"
    );
    assert!(
        metrics
            .render()
            .contains(r#"tollgate_store_refunds_total{kind="local"} 1"#)
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_decided_refund_goes_to_the_store_and_a_lost_one_is_counted() {
    let (g, faulty, metrics) = guard(OK, 1);
    let batch = [plan()];
    let out = g.check(&batch).await.unwrap();
    assert_eq!(out.source, Source::Store);
    let p = batch[0].charge.params;
    assert_eq!(faulty.mem.peek(batch[0].fp).unwrap().tokens, p.capacity - p.scale);
    g.refund(&batch, &out).await.unwrap();
    assert_eq!(faulty.mem.peek(batch[0].fp).unwrap().tokens, p.capacity);
    faulty.mode.store(FAIL, Ordering::SeqCst);
    assert!(g.refund(&batch, &out).await.is_err());
    faulty.mode.store(HANG, Ordering::SeqCst);
    assert_eq!(g.refund(&batch, &out).await, Err(StoreError::Timeout));
    // An open breaker: the refund is not even sent.
    faulty.mode.store(FAIL, Ordering::SeqCst);
    for _ in 0..FAILURES_TO_OPEN {
        g.check(&batch).await.unwrap();
    }
    assert!(g.breaker_open());
    let sent = faulty.refunds.load(Ordering::SeqCst);
    assert_eq!(g.refund(&batch, &out).await, Err(StoreError::BreakerOpen));
    assert_eq!(faulty.refunds.load(Ordering::SeqCst), sent);
    let text = metrics.render();
    for line in [
        r#"tollgate_store_refunds_total{kind="store"} 1"#,
        r#"tollgate_store_refund_failures_total{kind="error"} 1"#,
        r#"tollgate_store_refund_failures_total{kind="timeout"} 1"#,
        r#"tollgate_store_refund_failures_total{kind="breaker_open"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
}

/// Hangs (or fails at once) on keys of the tag `down`, answers from memory on the others.
struct OneSlotDown {
    fail_fast: AtomicBool,
    up: AtomicBool,
    calls_down: AtomicU64,
    mem: MemoryStore,
}

impl Store for OneSlotDown {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        if batch[0].key.contains("{down}") && !self.up.load(Ordering::SeqCst) {
            self.calls_down.fetch_add(1, Ordering::SeqCst);
            if self.fail_fast.load(Ordering::SeqCst) {
                return CheckFuture::ready(Err(StoreError::Unavailable("not connected".into())));
            }
            return CheckFuture::Boxed(Box::pin(std::future::pending()));
        }
        CheckFuture::ready(Ok(self.mem.check_now(batch)))
    }
    fn kind(&self) -> &'static str {
        "one-slot-down"
    }
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        self.mem.adjust(batch, outcome, units)
    }
}

/// A test's slots: the tag's first letter.
fn slot_of(key: &[u8]) -> u16 {
    key.iter()
        .position(|b| *b == b'{')
        .map_or(0, |i| u16::from(key[i + 1]))
}

#[tokio::test(start_paused = true)]
async fn on_a_cluster_one_slot_timing_out_opens_only_its_own_breaker() {
    let clock = ManualClock::new(1_000_000);
    let store = Arc::new(OneSlotDown {
        fail_fast: AtomicBool::new(true),
        up: AtomicBool::new(false),
        calls_down: AtomicU64::new(0),
        mem: MemoryStore::new(clock.clone()),
    });
    let metrics = Metrics::new();
    let g = Guard::new(
        store.clone(),
        Duration::from_millis(3),
        Arc::new(FleetSize::fixed(1)),
        clock,
        Arc::new(|_| Arc::from("plan")),
        metrics.clone(),
    )
    .per_slot(slot_of);
    let down = [item("rl:{down}:plan", 0, "10/1s", 20, FailurePolicy::Closed)];
    let live = [item("rl:{live}:plan", 0, "10/1s", 20, FailurePolicy::Closed)];

    // Errors that come at once never open the breaker: every check still asks.
    for _ in 0..20 {
        assert_eq!(
            g.check(&down).await.unwrap().source,
            Source::Bypass(FailurePolicy::Closed)
        );
    }
    assert_eq!(store.calls_down.load(Ordering::SeqCst), 20);
    assert!(!g.breaker_open());

    // Timeouts do, for that slot alone.
    store.fail_fast.store(false, Ordering::SeqCst);
    for _ in 0..FAILURES_TO_OPEN + 10 {
        assert!(!g.check(&down).await.unwrap().admitted);
        let out = g.check(&live).await.unwrap();
        assert_eq!(out.source, Source::Store, "the live slot decides on the store");
        assert!(out.admitted || out.buckets[0].tokens == 0);
    }
    assert_eq!(
        store.calls_down.load(Ordering::SeqCst),
        20 + u64::from(FAILURES_TO_OPEN)
    );
    assert!(metrics.render().contains("tollgate_store_breaker_open 1"));

    // Its probe comes a slot's interval later, and the first success closes it.
    store.up.store(true, Ordering::SeqCst);
    tokio::time::advance(SLOT_PROBE_EVERY).await;
    assert_eq!(g.check(&down).await.unwrap().source, Source::Store);
    assert!(!g.breaker_open());
    assert!(metrics.render().contains("tollgate_store_breaker_open 0"));
}

#[test]
fn shares_divide_rate_and_burst() {
    let p = BucketParams::new(Rate::parse("600/60s").unwrap(), 20).unwrap();
    let s = share(&p, 20).unwrap();
    assert_eq!(s.burst, 1);
    assert_eq!(s.rate.per_second(), 0.5);
    let login = BucketParams::new(Rate::parse("5/60s").unwrap(), 5).unwrap();
    assert_eq!(share(&login, 20).unwrap().burst, 1, "never less than one");
}
