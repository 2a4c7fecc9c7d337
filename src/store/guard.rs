//! The guard in front of a remote store: a check timeout, a circuit breaker, and each limit's
//! failure policy for the requests the store can't decide. It is a `Store` itself.
//!
//! When the store fails (an error, or no answer within the timeout) the request is decided
//! without it, limit by limit, and the strictest answer wins: any `closed` limit refuses the
//! request with 503; otherwise every `local` limit must admit it from this gateway's own share of
//! the limit (rate r/N, burst max(1, b/N), full at the first failure); `open` limits admit. After
//! five failures in a row the breaker opens: no request waits on the store, and one probe a
//! second finds out when it is back; the first success closes it and forgets the local shares.
//! "In a row" counts moments, not checks: a failure counts only when its check began after the
//! last counted failure came. On a busy gateway dozens of checks are in flight together, and one
//! slow moment of the store times them all out at once; counted one by one they would open the
//! breaker and refuse a second of requests the store would have answered. A store that is down
//! fails check after check, each begun after the last failed, and still opens it within five
//! timeouts (or five immediate errors).
//!
//! On a cluster ([`Guard::per_slot`]) every hash slot has a breaker of its own, since one master
//! failing says nothing about the others: its slots open theirs while the rest keep deciding on
//! the store. Only timeouts open a slot's breaker (an error that comes at once costs no wait),
//! and an open one probes every [`SLOT_PROBE_EVERY`]. The local shares are forgotten when the
//! last open breaker closes.
//!
//! A refund ([`Store::refund`]) goes where the charge went: to the store when it decided the
//! check, within the same timeout and never while the breaker is open; into the local shares
//! for a `local` bypass (at the fleet size known now); nowhere for an `open` or `closed` one,
//! which charged nothing. A refund that fails is logged and counted, never retried: the request
//! stays charged, an undershoot and never an overshoot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use smallvec::SmallVec;

use super::memory::MemoryStore;
use super::slots::SlotOf;
use super::{
    Adjusted, BoxFuture, CheckFuture, CheckItem, FailurePolicy, Outcome, Source, Store, StoreError,
    units_mismatch,
};
use tollgate_limit::bucket::{BucketParams, BucketVerdict, Rate, rescale};
use tollgate_limit::clock::Clock;
use tollgate_telemetry::logsample::Sampler;
use tollgate_telemetry::metrics::{Kind, LimitPolicy, Metrics};

/// Failures in a row that open the breaker.
pub(crate) const FAILURES_TO_OPEN: u32 = 5;
/// How often an open breaker lets one check through to the store.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(1);
/// The same for one hash slot's breaker. A probe costs one request of that slot a wait of at
/// most the timeout, and a promoted replica's slots come back within one probe, so slots probe
/// ten times as often as a whole store does.
pub(crate) const SLOT_PROBE_EVERY: Duration = Duration::from_millis(100);

/// Whether a check may go to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// Closed breaker: go.
    Pass,
    /// Open breaker, and this check is the probe of this second.
    Probe,
    /// Open breaker: decide without the store.
    Skip,
}

/// Lock-free so the hot path never waits on a mutex: a failure count, an open flag, the time
/// the next probe may go, and when the last counted failure came (microseconds since the guard
/// started).
struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
    next_probe_us: AtomicU64,
    last_failure_us: AtomicU64,
}

/// Hash slots of a Redis Cluster, each with a breaker under [`Guard::per_slot`].
const CLUSTER_SLOTS: usize = 16_384;

impl Breaker {
    fn new() -> Breaker {
        Breaker {
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            next_probe_us: AtomicU64::new(0),
            last_failure_us: AtomicU64::new(0),
        }
    }

    fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    fn admit(&self, now: u64, every: Duration) -> Admit {
        if !self.open.load(Ordering::Acquire) {
            return Admit::Pass;
        }
        let due = self.next_probe_us.load(Ordering::Acquire);
        if now >= due
            && self
                .next_probe_us
                .compare_exchange(
                    due,
                    now + every.as_micros() as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            Admit::Probe
        } else {
            Admit::Skip
        }
    }

    /// Returns true when this success closed an open breaker.
    fn success(&self) -> bool {
        self.failures.store(0, Ordering::Release);
        self.open.swap(false, Ordering::AcqRel)
    }

    /// Returns true when this failure, of a check begun at `started`, opened the breaker. A check
    /// already in flight when the last counted failure came fails in the same moment of the
    /// store, and does not count again.
    fn failure(&self, started: u64, now: u64, every: Duration) -> bool {
        let mut last = self.last_failure_us.load(Ordering::Acquire);
        loop {
            if started < last {
                return false;
            }
            match self.last_failure_us.compare_exchange_weak(
                last,
                now.max(last),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(seen) => last = seen,
            }
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= FAILURES_TO_OPEN && !self.open.load(Ordering::Acquire) {
            self.next_probe_us
                .store(now + every.as_micros() as u64, Ordering::Release);
            return !self.open.swap(true, Ordering::AcqRel);
        }
        false
    }
}

/// How many gateways share the limits: fixed by `--fleet-size`, or learned from the store's
/// heartbeat while it is up (the last known number is kept through an outage).
pub struct FleetSize {
    n: AtomicU32,
    fixed: bool,
}

impl FleetSize {
    pub fn fixed(n: u32) -> FleetSize {
        FleetSize {
            n: AtomicU32::new(n.max(1)),
            fixed: true,
        }
    }

    pub fn learned() -> FleetSize {
        FleetSize {
            n: AtomicU32::new(1),
            fixed: false,
        }
    }

    pub fn get(&self) -> u32 {
        self.n.load(Ordering::Relaxed).max(1)
    }

    pub fn learn(&self, n: u32) {
        if !self.fixed && n >= 1 {
            self.n.store(n, Ordering::Relaxed);
        }
    }
}

/// One gateway's share of a limit: rate r/N and burst max(1, b/N).
pub fn share(p: &BucketParams, n: u32) -> Option<BucketParams> {
    let n = u64::from(n.max(1));
    let rate = Rate {
        tokens: p.rate.tokens,
        period_us: p.rate.period_us.checked_mul(n)?,
    };
    BucketParams::new(rate, (p.burst / n).max(1)).ok()
}

/// A limit's name by its index in the running rules, for the bypass metrics' labels. The guard
/// asks; it does not hold the rules.
pub type LimitNames = Arc<dyn Fn(u16) -> Arc<str> + Send + Sync>;

pub struct Guard {
    inner: Arc<dyn Store>,
    timeout: Duration,
    /// One for the store, or one per hash slot ([`Guard::per_slot`]).
    breakers: Box<[Breaker]>,
    slot_of: Option<SlotOf>,
    probe_every: Duration,
    /// Breakers open now: the `tollgate_store_breaker_open` gauge.
    open: AtomicU32,
    /// The breakers' time base (their probe times are microseconds since then).
    origin: Instant,
    breaker_warn: Sampler,
    local: MemoryStore,
    pub fleet: Arc<FleetSize>,
    names: LimitNames,
    metrics: Arc<Metrics>,
    warn: Sampler,
    refund_warn: Sampler,
}

impl Guard {
    pub fn new(
        inner: Arc<dyn Store>,
        timeout: Duration,
        fleet: Arc<FleetSize>,
        clock: Arc<dyn Clock>,
        names: LimitNames,
        metrics: Arc<Metrics>,
    ) -> Guard {
        Guard {
            inner,
            timeout,
            breakers: Box::new([Breaker::new()]),
            slot_of: None,
            probe_every: PROBE_EVERY,
            open: AtomicU32::new(0),
            origin: Instant::now(),
            breaker_warn: Sampler::new(Duration::from_secs(5)),
            local: MemoryStore::new(clock),
            fleet,
            names,
            metrics,
            warn: Sampler::new(Duration::from_secs(5)),
            refund_warn: Sampler::new(Duration::from_secs(5)),
        }
    }

    /// A breaker per Redis Cluster hash slot (`slot_of` names a key's), instead of one for the
    /// store: a master that fails opens only its own slots' breakers.
    pub fn per_slot(mut self, slot_of: SlotOf) -> Guard {
        self.breakers = (0..CLUSTER_SLOTS).map(|_| Breaker::new()).collect();
        self.slot_of = Some(slot_of);
        self.probe_every = SLOT_PROBE_EVERY;
        self
    }

    /// Whether any breaker is open.
    pub fn breaker_open(&self) -> bool {
        self.open.load(Ordering::Acquire) > 0
    }

    /// The breaker of the batch's slot (a batch in front of [`Slots`](crate::slots::Slots) lies
    /// in one), or the store's.
    fn breaker(&self, batch: &[CheckItem]) -> &Breaker {
        match (self.slot_of, batch.first()) {
            (Some(slot_of), Some(item)) => {
                &self.breakers[usize::from(slot_of(item.key.as_bytes())) % self.breakers.len()]
            }
            _ => &self.breakers[0],
        }
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    fn on_success(&self, breaker: &Breaker) {
        if breaker.success() {
            let left = self.open.fetch_sub(1, Ordering::AcqRel) - 1;
            self.metrics.breaker_open.set(i64::from(left));
            if left == 0 {
                // The next outage starts from full local shares again.
                self.local.clear();
            }
            if let Some(suppressed) = self.breaker_warn.allow(1) {
                tracing::info!(
                    store = self.inner.kind(),
                    open = left,
                    suppressed,
                    "limiter store answers again; breaker closed"
                );
            }
        }
    }

    fn on_failure(&self, breaker: &Breaker, started: u64, e: &StoreError) {
        let kind = if *e == StoreError::Timeout {
            "timeout"
        } else {
            "error"
        };
        self.metrics.store_errors.get_or_create(&Kind { kind }).inc();
        // A slot's breaker saves its checks the wait of a master that does not answer; an error
        // that comes at once (its master is not connected) costs nothing to meet again, and
        // leaving the breaker closed sends the slot's next check to a promoted replica as soon
        // as the store knows of it, with no probe to wait for.
        if self.slot_of.is_some() && *e != StoreError::Timeout {
            return;
        }
        if breaker.failure(started, self.now_us(), self.probe_every) {
            let open = self.open.fetch_add(1, Ordering::AcqRel) + 1;
            self.metrics.breaker_open.set(i64::from(open));
            if let Some(suppressed) = self.breaker_warn.allow(0) {
                tracing::warn!(
                    store = self.inner.kind(),
                    error = %e,
                    open,
                    suppressed,
                    "limiter store failed {FAILURES_TO_OPEN} times in a row; breaker open, deciding by failure policy"
                );
            }
        }
    }

    /// Decides a batch without the store: the strictest policy among its enforced limits wins.
    fn fallback(&self, batch: &[CheckItem]) -> Outcome {
        let name = |li: u16| (self.names)(li);
        let mut verdicts: SmallVec<[BucketVerdict; 4]> = batch
            .iter()
            .map(|i| BucketVerdict {
                sufficient: true,
                tokens: i.charge.params.capacity,
                wait_us: Some(0),
                blocked: false,
            })
            .collect();
        let enforced = || batch.iter().enumerate().filter(|(_, i)| !i.charge.shadow);
        let strictest = enforced().map(|(_, i)| i.policy).max_by_key(|p| match p {
            FailurePolicy::Open => 0,
            FailurePolicy::Local => 1,
            FailurePolicy::Closed => 2,
        });
        for (_, item) in enforced() {
            let policy = match item.policy {
                FailurePolicy::Open => "open",
                FailurePolicy::Local => "local",
                FailurePolicy::Closed => "closed",
            };
            self.metrics
                .store_bypass
                .get_or_create(&LimitPolicy {
                    limit: name(item.limit),
                    policy,
                })
                .inc();
            if let Some(suppressed) = self.warn.allow(item.limit as usize) {
                tracing::warn!(
                    limit = &*name(item.limit),
                    policy,
                    suppressed,
                    "deciding without the limiter store"
                );
            }
        }
        let now = self.local.clock().now_us();
        let admitted = match strictest {
            None => true,
            Some(FailurePolicy::Closed) => {
                for (i, item) in enforced() {
                    if item.policy == FailurePolicy::Closed {
                        verdicts[i] = BucketVerdict {
                            sufficient: false,
                            tokens: 0,
                            wait_us: None,
                            blocked: false,
                        };
                    }
                }
                false
            }
            Some(_) => {
                let n = self.fleet.get();
                let mut local: SmallVec<[(usize, CheckItem); 4]> = SmallVec::new();
                for (i, item) in enforced() {
                    if item.policy != FailurePolicy::Local {
                        continue;
                    }
                    // A share that can't be represented exactly falls back to one token a period.
                    let params = share(&item.charge.params, n).unwrap_or(item.charge.params);
                    let mut it = item.clone();
                    it.charge.params = params;
                    local.push((i, it));
                }
                let items: SmallVec<[CheckItem; 4]> = local.iter().map(|(_, it)| it.clone()).collect();
                let out = self.local.check_at(&items, now);
                for ((i, it), v) in local.iter().zip(out.buckets) {
                    // Report in the limit's own units, so headers read the same as from the store.
                    let orig = &batch[*i].charge.params;
                    verdicts[*i] = BucketVerdict {
                        sufficient: v.sufficient,
                        tokens: rescale(v.tokens, it.charge.params.scale, orig.scale),
                        wait_us: v.wait_us,
                        blocked: false,
                    };
                }
                out.admitted
            }
        };
        Outcome {
            admitted,
            now_us: now,
            buckets: verdicts,
            source: Source::Bypass(strictest.unwrap_or(FailurePolicy::Open)),
            leased: 0,
        }
    }

    /// Gives a `local` bypass's charge back to the local shares. Only its `local` limits were
    /// charged there: an `open` one admitted for free, and shadow limits are not kept.
    /// A change to a check the local share answered goes to the local share, scaled to it.
    fn adjust_local(&self, batch: &[CheckItem], units: &[i64]) -> Adjusted {
        let n = self.fleet.get();
        let mut items: SmallVec<[CheckItem; 4]> = SmallVec::new();
        let mut local_units: SmallVec<[i64; 4]> = SmallVec::new();
        let mut places: SmallVec<[usize; 4]> = SmallVec::new();
        for (i, item) in batch.iter().enumerate() {
            if item.charge.shadow || item.policy != FailurePolicy::Local || units[i] == 0 {
                continue;
            }
            // The share as `fallback` computes it: a fleet size learned since then gives a
            // slightly different share, which is as close as the share itself.
            let mut it = item.clone();
            let shared = share(&item.charge.params, n).unwrap_or(item.charge.params);
            // The share counts in its own units; the amount moves with it, whole tokens exact.
            local_units.push(
                (units[i].signum() as i128
                    * rescale(units[i].unsigned_abs(), item.charge.params.scale, shared.scale) as i128)
                    as i64,
            );
            it.charge.params = shared;
            items.push(it);
            places.push(i);
        }
        let got = self.local.adjust_now(&items, &local_units);
        let mut out = Adjusted::none(batch.len());
        out.now_us = got.now_us;
        for (j, &i) in places.iter().enumerate() {
            out.balances[i] = got.balances[j];
        }
        self.metrics
            .store_refunds
            .get_or_create(&Kind { kind: "local" })
            .inc();
        out
    }

    fn refund_lost(&self, e: &StoreError) {
        let kind = match e {
            StoreError::Timeout => "timeout",
            StoreError::BreakerOpen => "breaker_open",
            _ => "error",
        };
        self.metrics
            .store_refund_failures
            .get_or_create(&Kind { kind })
            .inc();
        if let Some(suppressed) = self.refund_warn.allow(0) {
            tracing::warn!(
                store = self.inner.kind(),
                error = %e,
                suppressed,
                "could not refund an undelivered request; it stays charged"
            );
        }
    }

    /// Keeps the fleet size learned from the store's heartbeat, every second, until the guard
    /// is dropped.
    pub fn spawn_heartbeat(self: &Arc<Self>, instance: String) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(g) = weak.upgrade() else { break };
                // A cluster's heartbeat key is in one slot; its own timeout bounds a beat there.
                if g.slot_of.is_none() && g.breaker_open() {
                    continue;
                }
                let beat =
                    tokio::time::timeout(Duration::from_millis(250), g.inner.heartbeat(&instance)).await;
                if let Ok(Ok(Some(n))) = beat {
                    g.fleet.learn(n);
                }
            }
        });
    }
}

impl Store for Guard {
    fn blocks(&self) -> BoxFuture<'_, Result<crate::Blocks, StoreError>> {
        self.inner.blocks()
    }

    fn lift<'a>(&'a self, bucket: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.lift(bucket)
    }

    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        let breaker = self.breaker(batch);
        if breaker.admit(self.now_us(), self.probe_every) == Admit::Skip {
            return CheckFuture::ready(Ok(self.fallback(batch)));
        }
        CheckFuture::Boxed(Box::pin(async move {
            let started = self.now_us();
            match tokio::time::timeout(self.timeout, self.inner.check(batch)).await {
                Ok(Ok(outcome)) => {
                    self.on_success(breaker);
                    Ok(outcome)
                }
                Ok(Err(e)) => {
                    self.on_failure(breaker, started, &e);
                    Ok(self.fallback(batch))
                }
                Err(_) => {
                    self.on_failure(breaker, started, &StoreError::Timeout);
                    Ok(self.fallback(batch))
                }
            }
        }))
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    /// Returns the store's error when the change was lost, after logging and counting it; the
    /// caller has nothing more to do with it.
    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        Box::pin(async move {
            if let Some(e) = units_mismatch(batch, outcome, units) {
                return Err(e);
            }
            if units.iter().all(|u| *u == 0) {
                return Ok(Adjusted::none(batch.len()));
            }
            match outcome.source {
                Source::Bypass(FailurePolicy::Local) => Ok(self.adjust_local(batch, units)),
                Source::Bypass(_) => Ok(Adjusted::none(batch.len())),
                Source::Store => {
                    // A store that fails checks would only make the change wait for its timeout.
                    let r = if self.breaker(batch).is_open() {
                        Err(StoreError::BreakerOpen)
                    } else {
                        match tokio::time::timeout(self.timeout, self.inner.adjust(batch, outcome, units))
                            .await
                        {
                            Ok(r) => r,
                            Err(_) => Err(StoreError::Timeout),
                        }
                    };
                    match &r {
                        Ok(_) => {
                            self.metrics
                                .store_refunds
                                .get_or_create(&Kind { kind: "store" })
                                .inc();
                        }
                        Err(e) => self.refund_lost(e),
                    }
                    r
                }
            }
        })
    }

    fn ping(&self) -> CheckFuture<'_> {
        CheckFuture::Boxed(Box::pin(async move {
            match tokio::time::timeout(Duration::from_millis(250), self.inner.ping()).await {
                Ok(r) => r,
                Err(_) => Err(StoreError::Timeout),
            }
        }))
    }

    fn remote(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
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
}
