//! The limiters a replay can run, each deciding one request at a given microsecond: the
//! gateway's own token bucket (through `MemoryStore::check_at`), and for comparison GCRA, the
//! fixed window, the sliding log, the sliding window counter and the queue, all in exact
//! integers.
//!
//! Window algorithms read `--rate N/P` as "N per window of P". Fixed windows (and the counter's
//! windows) are aligned on multiples of P from time 0, so with times in seconds since midnight a
//! 60 s window is a clock minute. The sliding log's window is `(now − P, now]`: an entry exactly
//! P old has left it.

use std::collections::VecDeque;

use tollgate_limit::bucket::{BucketParams, Charge, Rate, refill, retry_after_secs};
use tollgate_limit::clock::ManualClock;
use tollgate_limit::decision::decide;
use tollgate_store::memory::MemoryStore;
use tollgate_store::{CheckItem, FailurePolicy};

/// One row's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub admitted: bool,
    /// Whole seconds: 0 when admitted, at least 1 when limited, `None` when no wait helps (or,
    /// with `block` set, until the block's end is known).
    pub retry_after: Option<u64>,
    /// The queue: µs from arrival to release of an admitted request; `None` for every other
    /// limiter, and for a refused request.
    pub wait_us: Option<u64>,
    /// The edge design: the block that refused the request. A block's end is known only once
    /// it has lifted, later in the trace, and the Retry-After counts to it.
    pub block: Option<u32>,
}

impl Verdict {
    pub(crate) const ALLOW: Verdict = Verdict {
        admitted: true,
        retry_after: Some(0),
        wait_us: None,
        block: None,
    };

    /// A limited request whose wait is `wait_us` microseconds (`None`: never).
    pub fn refuse(wait_us: Option<u64>) -> Verdict {
        Verdict {
            admitted: false,
            retry_after: wait_us.map(retry_after_secs),
            wait_us: None,
            block: None,
        }
    }

    /// A request admitted after waiting `wait_us` in a queue.
    pub fn released_after(wait_us: u64) -> Verdict {
        Verdict {
            wait_us: Some(wait_us),
            ..Verdict::ALLOW
        }
    }
}

/// Per-instance state and the check of one comparison algorithm.
pub(crate) trait Meter {
    type State: Default;
    fn check(&self, s: &mut Self::State, now: u64, cost: u64) -> Verdict;
}

/// GCRA with the token bucket's numbers. Time is counted in units of `1 / N` µs, so the
/// emission interval `T = P / N` is exactly `P` units and nothing is ever rounded.
#[derive(Clone, Copy, Debug)]
pub struct Gcra {
    tokens: u128,
    period: u128,
    burst: u64,
}

impl Gcra {
    pub fn new(rate: Rate, burst: u64) -> Gcra {
        Gcra {
            tokens: rate.tokens as u128,
            period: rate.period_us as u128,
            burst,
        }
    }
}

impl Gcra {
    /// GCRA's one step, which the queue shares: `Ok(wait)`, the units of `1 / N` µs from now
    /// until the request's emission time (0 for a bucket with room; for a queue, its release),
    /// with `tat` moved on; `Err(Some(units))` to wait before it would be admitted; `Err(None)`
    /// when no wait helps (a cost above the burst).
    fn emit(&self, tat: &mut Option<u128>, now: u64, cost: u64) -> Result<u128, Option<u128>> {
        if cost > self.burst {
            return Err(None);
        }
        let now_u = now as u128 * self.tokens;
        let t = tat.map_or(now_u, |t| t.max(now_u));
        // "tat + T·cost − now ≤ τ + T" with τ = (b − 1)·T, rearranged to avoid negatives.
        let limit = (self.burst - cost) as u128 * self.period;
        if t - now_u <= limit {
            *tat = Some(t + cost as u128 * self.period);
            Ok(t - now_u)
        } else {
            Err(Some(t - now_u - limit))
        }
    }

    /// Units of `1 / N` µs as whole microseconds, rounded up.
    fn micros(&self, units: u128) -> u64 {
        units.div_ceil(self.tokens).min(u64::MAX as u128) as u64
    }
}

impl Meter for Gcra {
    /// The theoretical arrival time, in units of `1 / N` µs; `None` for a new key ("full").
    type State = Option<u128>;

    fn check(&self, tat: &mut Option<u128>, now: u64, cost: u64) -> Verdict {
        match self.emit(tat, now, cost) {
            Ok(_) => Verdict::ALLOW,
            Err(wait) => Verdict::refuse(wait.map(|w| self.micros(w))),
        }
    }
}

/// One counter per window of `period` µs, aligned on multiples of `period` from time 0.
#[derive(Clone, Copy, Debug)]
pub struct FixedWindow {
    pub limit: u64,
    pub period: u64,
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FixedState {
    window: u64,
    count: u64,
}

impl Meter for FixedWindow {
    type State = FixedState;

    fn check(&self, s: &mut FixedState, now: u64, cost: u64) -> Verdict {
        let w = now / self.period;
        if w != s.window {
            s.window = w;
            s.count = 0;
        }
        if cost > self.limit {
            return Verdict::refuse(None);
        }
        if s.count + cost <= self.limit {
            s.count += cost;
            Verdict::ALLOW
        } else {
            Verdict::refuse(Some((w + 1) * self.period - now))
        }
    }
}

/// The time of every admitted request (with its cost) in `(now − period, now]`.
#[derive(Clone, Copy, Debug)]
pub struct SlidingLog {
    pub limit: u64,
    pub period: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct LogState {
    /// (admission time, running total of cost up to and including this entry), oldest first.
    entries: VecDeque<(u64, u64)>,
    /// Running total of every cost ever admitted.
    total: u64,
    /// Running total at the newest entry that has left the window.
    gone: u64,
}

impl LogState {
    /// Cost held in the log.
    pub fn len(&self) -> u64 {
        self.total - self.gone
    }

    /// Cost the log would hold at `now` (entries at least `period` old have left), without
    /// changing it.
    pub(crate) fn len_at(&self, now: u64, period: u64) -> u64 {
        let i = self.entries.partition_point(|&(t, _)| t + period <= now);
        let gone = if i == 0 { self.gone } else { self.entries[i - 1].1 };
        self.total - gone
    }
}

impl Meter for SlidingLog {
    type State = LogState;

    fn check(&self, s: &mut LogState, now: u64, cost: u64) -> Verdict {
        while let Some(&(t, cum)) = s.entries.front() {
            if t + self.period <= now {
                s.gone = cum;
                s.entries.pop_front();
            } else {
                break;
            }
        }
        if cost > self.limit {
            return Verdict::refuse(None);
        }
        if s.len() + cost <= self.limit {
            s.total += cost;
            s.entries.push_back((now, s.total));
            return Verdict::ALLOW;
        }
        // The request fits once every entry up to the first whose running total reaches
        // `total + cost − limit` has left.
        let need = s.total + cost - self.limit;
        let i = s.entries.partition_point(|&(_, cum)| cum < need);
        let wait = s.entries.get(i).map(|&(t, _)| t + self.period - now);
        Verdict::refuse(wait.or(Some(0)))
    }
}

/// This window's count plus the previous window's, weighted by how much of the trailing
/// `period` still lies in it. Compared exactly: `prev·(P − elapsed) + (cur + cost)·P ≤ L·P`.
#[derive(Clone, Copy, Debug)]
pub struct SlidingCounter {
    pub limit: u64,
    pub period: u64,
}

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CounterState {
    window: u64,
    cur: u64,
    prev: u64,
}

impl Meter for SlidingCounter {
    type State = CounterState;

    fn check(&self, s: &mut CounterState, now: u64, cost: u64) -> Verdict {
        let p = self.period as u128;
        let w = now / self.period;
        if w == s.window + 1 {
            s.prev = s.cur;
            s.cur = 0;
        } else if w != s.window {
            s.prev = 0;
            s.cur = 0;
        }
        s.window = w;
        if cost > self.limit {
            return Verdict::refuse(None);
        }
        let elapsed = (now - w * self.period) as u128;
        let (prev, cur, cost_, limit) = (s.prev as u128, s.cur as u128, cost as u128, self.limit as u128);
        if prev * (p - elapsed) + (cur + cost_) * p <= limit * p {
            s.cur += cost;
            return Verdict::ALLOW;
        }
        let wait = if cur + cost_ <= limit {
            // Later in this window, once enough of the previous window has slid out.
            let at = p - ((limit - cur - cost_) * p / prev);
            at - elapsed
        } else {
            // In the next window, where this window's count is the previous one.
            // cur ≥ 1 here, since cur + cost > limit ≥ cost.
            let at = ((limit - cost_) * p).checked_div(cur).map_or(0, |x| p - x);
            (p - elapsed) + at
        };
        Verdict::refuse(Some(wait.min(u64::MAX as u128) as u64))
    }
}

/// A leaky bucket used as a queue, as nginx's `limit_req` with a `burst` and no `nodelay`:
/// requests leave at the rate, one every `I = P / N`, and up to `queue` wait behind the one
/// being released; a request that would find more ahead of it is refused. Its admissions are
/// GCRA's with a burst of `queue + 1` (τ = `queue` intervals), and its release time is GCRA's
/// emission time, so it is [`Gcra`] that also says how long each admitted request waits.
///
/// A request of cost `c` takes `c` places: it is refused when its last place would wait more
/// than `queue` intervals, so a cost above `queue + 1` never fits.
#[derive(Clone, Copy, Debug)]
pub struct Queue(Gcra);

impl Queue {
    pub fn new(rate: Rate, queue: u64) -> Queue {
        Queue(Gcra::new(rate, queue.saturating_add(1)))
    }
}

impl Meter for Queue {
    /// The earliest time the next request may be released, in units of `1 / N` µs; `None`
    /// for a key that has been quiet ("release at once").
    type State = Option<u128>;

    fn check(&self, next: &mut Option<u128>, now: u64, cost: u64) -> Verdict {
        match self.0.emit(next, now, cost) {
            // Rounded up, so arrival + wait is never before the release.
            Ok(wait) => Verdict::released_after(self.0.micros(wait)),
            Err(retry) => Verdict::refuse(retry.map(|r| self.0.micros(r))),
        }
    }
}

/// A meter's state per instance (a key, or a key on one gateway).
pub(crate) struct Metered<M: Meter> {
    pub meter: M,
    states: Vec<M::State>,
}

impl<M: Meter> Metered<M> {
    pub fn new(meter: M) -> Metered<M> {
        Metered {
            meter,
            states: Vec::new(),
        }
    }

    #[inline]
    pub fn check(&mut self, instance: usize, now: u64, cost: u64) -> Verdict {
        if instance >= self.states.len() {
            self.states.resize_with(instance + 1, Default::default);
        }
        self.meter.check(&mut self.states[instance], now, cost)
    }

    pub fn state(&self, instance: usize) -> Option<&M::State> {
        self.states.get(instance)
    }
}

/// Token buckets in the gateway's own embedded store, one per instance, each checked with
/// `MemoryStore::check_at` and read with `decide`, exactly as the gateway does.
pub struct Buckets {
    store: MemoryStore,
    params: BucketParams,
    items: Vec<Option<CheckItem>>,
}

impl Buckets {
    pub fn new(params: BucketParams) -> Buckets {
        Buckets {
            store: MemoryStore::new(ManualClock::new(0)),
            params,
            items: Vec::new(),
        }
    }

    /// Checks one request; `name` names the instance's bucket the first time it is seen.
    #[inline]
    pub fn check(&mut self, instance: usize, name: impl FnOnce() -> String, now: u64, cost: u64) -> Verdict {
        if instance >= self.items.len() {
            self.items.resize_with(instance + 1, || None);
        }
        let params = self.params;
        let item = self.items[instance].get_or_insert_with(|| {
            CheckItem::new(
                name().into(),
                Charge {
                    params,
                    cost: 1,
                    shadow: false,
                },
                0,
                FailurePolicy::Local,
            )
        });
        item.charge.cost = cost;
        let batch = std::slice::from_ref(item);
        let outcome = self.store.check_at(batch, now);
        if outcome.admitted {
            Verdict::ALLOW
        } else {
            Verdict {
                retry_after: decide(batch, &outcome).retry_after(),
                ..Verdict::refuse(None)
            }
        }
    }

    pub fn params(&self) -> BucketParams {
        self.params
    }

    /// Units in an instance's bucket at `now`; a bucket never checked is full.
    pub fn units_at(&self, instance: usize, now: u64) -> u64 {
        let state = self.item(instance).and_then(|i| self.store.peek(i.fp));
        refill(&self.params, state, now)
    }

    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    /// The stored bucket of an instance, if it was ever checked.
    pub fn item(&self, instance: usize) -> Option<&CheckItem> {
        self.items.get(instance).and_then(Option::as_ref)
    }
}

/// A share of a limit for one of `gateways`: rate `r / N` exactly (the period multiplied by
/// N) and burst `max(1, ⌊b / N⌋)`.
pub fn share(rate: Rate, burst: u64, gateways: u64) -> (Rate, u64) {
    (
        Rate {
            tokens: rate.tokens,
            period_us: rate.period_us.saturating_mul(gateways),
        },
        (burst / gateways).max(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gcra_admits_the_burst_then_waits_for_the_next_token() {
        let g = Gcra::new(Rate::parse("10/1s").unwrap(), 20);
        let mut s = None;
        for _ in 0..20 {
            assert!(g.check(&mut s, 0, 1).admitted);
        }
        let r = g.check(&mut s, 50_000, 1);
        // tat − now = 1.95 s > τ = 1.9 s: limited, 50 ms to wait.
        assert_eq!(r, Verdict::refuse(Some(50_000)));
        assert!(g.check(&mut s, 100_000, 1).admitted);
        assert_eq!(g.check(&mut s, 0, 21), Verdict::refuse(None));
    }

    #[test]
    fn fixed_window_resets_on_multiples_of_the_period() {
        let f = FixedWindow {
            limit: 2,
            period: 60_000_000,
        };
        let mut s = FixedState::default();
        assert!(f.check(&mut s, 59_000_000, 1).admitted);
        assert!(f.check(&mut s, 59_500_000, 1).admitted);
        assert_eq!(f.check(&mut s, 59_999_999, 1), Verdict::refuse(Some(1)));
        assert!(f.check(&mut s, 60_000_000, 1).admitted);
    }

    #[test]
    fn sliding_log_drops_an_entry_exactly_one_period_old() {
        let l = SlidingLog {
            limit: 2,
            period: 1_000_000,
        };
        let mut s = LogState::default();
        assert!(l.check(&mut s, 0, 1).admitted);
        assert!(l.check(&mut s, 400_000, 1).admitted);
        assert_eq!(l.check(&mut s, 999_999, 1), Verdict::refuse(Some(1)));
        assert_eq!(s.len(), 2);
        assert!(l.check(&mut s, 1_000_000, 1).admitted);
        // Needs the entry at 0.4 s gone: 0.4 s from 1.0 s.
        assert_eq!(l.check(&mut s, 1_000_000, 1).retry_after, Some(1));
    }

    #[test]
    fn sliding_counter_weights_the_previous_window() {
        let c = SlidingCounter {
            limit: 600,
            period: 60_000_000,
        };
        let mut s = CounterState {
            window: 0,
            cur: 315,
            prev: 0,
        };
        // 15 s into the next window: 315 × 45/60 = 236.25 of the previous minute.
        let now = 75_000_000;
        let mut admitted = 0;
        while c.check(&mut s, now, 1).admitted {
            admitted += 1;
        }
        assert_eq!(admitted, 363);
    }

    #[test]
    fn queue_releases_one_per_interval_and_refuses_past_its_length() {
        let q = Queue::new(Rate::parse("10/1s").unwrap(), 2);
        let mut s = None;
        let waits: Vec<Verdict> = (0..4).map(|_| q.check(&mut s, 0, 1)).collect();
        // One released at once, two behind it; the fourth would have three ahead.
        assert_eq!(waits[0], Verdict::released_after(0));
        assert_eq!(waits[1], Verdict::released_after(100_000));
        assert_eq!(waits[2], Verdict::released_after(200_000));
        assert_eq!(waits[3], Verdict::refuse(Some(100_000)));
        assert_eq!(waits[3].retry_after, Some(1));
        // At 100 ms the second is being released and a place is free again.
        assert_eq!(q.check(&mut s, 100_000, 1), Verdict::released_after(200_000));
        assert_eq!(q.check(&mut s, 100_000, 4), Verdict::refuse(None));
        // 3 a second: an interval of 333,333.3 µs, counted exactly, waits rounded up.
        let q = Queue::new(Rate::parse("3/1s").unwrap(), 5);
        let mut s = None;
        let w: Vec<Option<u64>> = (0..4).map(|_| q.check(&mut s, 0, 1).wait_us).collect();
        assert_eq!(w, [Some(0), Some(333_334), Some(666_667), Some(1_000_000)]);
    }
}
