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
mod tests;
