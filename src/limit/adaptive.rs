//! Adaptive concurrency: the gradient controller that sets how many requests may be in flight to
//! one upstream from the latency it measures. Pure: every call carries its time in microseconds
//! on any monotonic scale, so it is driven the same by the gateway and by tests.
//!
//! In the manner of Envoy's adaptive concurrency filter, with one guard from Netflix's
//! Gradient2 and TCP's slow start:
//! - the no-load latency (`min_rtt`) is measured, not guessed: the limit drops to `min` for a
//!   few requests, at the start, every [`PROBE_INTERVAL_US`] (jittered) and after the limit has
//!   sat at `min` for [`FLOOR_WINDOWS`] windows (the upstream's own service time may have
//!   changed, as when its database slows);
//! - between probes, each window's [`PERCENTILE`] latency is compared to `min_rtt` plus a
//!   [`BUFFER`]: `limit × clamp((1 + BUFFER) · min_rtt / latency, 0.5, 2) + √limit`;
//! - a window judges only requests admitted since the limit last changed, over one no-load
//!   round trip, so each change is judged on its own effect;
//! - from the floor the limit doubles each window until latency first passes its target;
//! - the limit grows only when the window used at least half of it (Gradient2's guard), so a
//!   quiet upstream does not earn a limit it never tested.

/// Latency above `min_rtt` that still counts as no-load: a window's latency at
/// `(1 + BUFFER) · min_rtt` keeps the limit where it is, apart from the headroom.
pub const BUFFER: f64 = 0.25;
/// The fastest fall and rise per window.
pub const MIN_GRADIENT: f64 = 0.5;
pub const MAX_GRADIENT: f64 = 2.0;
/// A window lasts at least this long and holds at least [`WINDOW_SAMPLES`] samples.
pub const WINDOW_US: u64 = 100_000;
pub const WINDOW_SAMPLES: usize = 5;
/// A window closes early when it holds this many samples, bounding its memory and sort.
pub const WINDOW_CAP: usize = 4096;
/// The percentile of a window's (and a probe's) latencies that is compared: requests admitted
/// together are answered in order, so the late ones of a window show the queue first.
pub const PERCENTILE: usize = 90;
/// Samples a probe takes; its `min_rtt` is their [`PERCENTILE`].
pub const PROBE_SAMPLES: usize = 8;
/// How often `min_rtt` is measured again, before jitter (up to a quarter more).
pub const PROBE_INTERVAL_US: u64 = 30_000_000;
/// Windows in a row at `min` after which `min_rtt` is measured again.
pub const FLOOR_WINDOWS: u32 = 5;

/// The bounds of one upstream's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The floor, and the concurrency a probe runs at; at least 1.
    pub min: u32,
    /// The ceiling; at least `min`.
    pub max: u32,
}

impl Bounds {
    /// Bounds that make sense: `1 ≤ min ≤ max`.
    pub fn new(min: u32, max: u32) -> Result<Bounds, String> {
        if min == 0 {
            return Err("min must be above zero".into());
        }
        if max < min {
            return Err(format!("max {max} is below min {min}"));
        }
        Ok(Bounds { min, max })
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Measuring `min_rtt` at `min`: samples of requests admitted since `since`; the limit
    /// to return to afterwards.
    Probe { since: u64, resume: f64 },
    /// Adjusting by gradient; the window began at `since`.
    Steady { since: u64 },
}

/// What a window or probe ended with, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Update {
    /// A probe ended: the measured no-load latency, in µs.
    Probed { min_rtt_us: u64 },
    /// A window ended: its [`PERCENTILE`] latency and the gradient applied.
    Adjusted { latency_us: u64, gradient: f64 },
    /// A probe began (the limit is `min` until it ends).
    ProbeStarted,
}

/// One upstream's adaptive limit and its requests in flight.
#[derive(Debug, Clone)]
pub struct Gradient {
    bounds: Bounds,
    limit: f64,
    in_flight: u32,
    /// The most in flight at an admission since the window began.
    peak: u32,
    min_rtt_us: Option<u64>,
    phase: Phase,
    samples: Vec<u64>,
    next_probe: u64,
    floor_windows: u32,
    /// Doubling each window until latency first passes its target.
    slow_start: bool,
    /// xorshift state for the probes' jitter, so gateways started together drift apart.
    jitter: u64,
}

impl Gradient {
    /// A limiter that starts by measuring `min_rtt` at `bounds.min`. `seed` jitters the probes.
    pub fn new(bounds: Bounds, now_us: u64, seed: u64) -> Gradient {
        let min = f64::from(bounds.min);
        Gradient {
            bounds,
            limit: min,
            in_flight: 0,
            peak: 0,
            min_rtt_us: None,
            phase: Phase::Probe {
                since: now_us,
                resume: min,
            },
            samples: Vec::new(),
            next_probe: u64::MAX,
            floor_windows: 0,
            slow_start: true,
            jitter: seed | 1,
        }
    }

    /// The number of requests that may be in flight now.
    pub fn limit(&self) -> u32 {
        match self.phase {
            Phase::Probe { .. } => self.bounds.min,
            Phase::Steady { .. } => self.limit as u32,
        }
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The no-load latency last measured, in µs.
    pub fn min_rtt_us(&self) -> Option<u64> {
        self.min_rtt_us
    }

    pub fn probing(&self) -> bool {
        matches!(self.phase, Phase::Probe { .. })
    }

    /// Takes a place when one is free under the limit; the caller must [`Gradient::release`]
    /// it exactly once.
    pub fn try_acquire(&mut self, now_us: u64) -> bool {
        if now_us >= self.next_probe {
            self.start_probe(now_us);
        }
        // Demand, as this window saw it: a refusal means the limit was all used.
        let ok = self.in_flight < self.limit();
        if ok {
            self.in_flight += 1;
        }
        self.peak = self.peak.max(self.in_flight);
        ok
    }

    /// Gives a place back (response ended, client gone, request failed).
    pub fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// A latency sample: a request admitted at `started_us` was answered at `now_us` (for a
    /// timeout, when it gave up). Samples of requests admitted before the current window or
    /// probe began are ignored: they measure a limit no longer in force.
    pub fn sample(&mut self, started_us: u64, now_us: u64) -> Option<Update> {
        let since = match self.phase {
            Phase::Probe { since, .. } | Phase::Steady { since } => since,
        };
        if started_us < since {
            return None;
        }
        self.samples.push(now_us.saturating_sub(started_us));
        match self.phase {
            Phase::Probe { resume, .. } => {
                if self.samples.len() < PROBE_SAMPLES {
                    return None;
                }
                let min_rtt = percentile(&mut self.samples).max(1);
                self.min_rtt_us = Some(min_rtt);
                self.limit = resume.max(f64::from(self.bounds.min));
                self.floor_windows = 0;
                self.next_probe = now_us.saturating_add(self.probe_interval());
                self.begin_window(now_us);
                Some(Update::Probed { min_rtt_us: min_rtt })
            }
            Phase::Steady { since } => {
                // A window holds the requests admitted over one no-load round trip (at least
                // WINDOW_US): its first samples were admitted as the change took effect, before
                // the new limit filled up, and requests admitted together come back together,
                // so a shorter span sees a burst, not the upstream. In slow start nothing
                // queued yet, and half a round of the limit is enough.
                let n = self.samples.len();
                let span = self.min_rtt_us.unwrap_or(0).max(WINDOW_US);
                let long = n >= WINDOW_SAMPLES && started_us >= since.saturating_add(span);
                let round = self.slow_start && n as f64 >= self.limit / 2.0;
                if !(long || round || n >= WINDOW_CAP) {
                    return None;
                }
                let latency_us = percentile(&mut self.samples).max(1);
                let min_rtt = self.min_rtt_us.unwrap_or(latency_us) as f64;
                let mut gradient =
                    ((1.0 + BUFFER) * min_rtt / latency_us as f64).clamp(MIN_GRADIENT, MAX_GRADIENT);
                // Slow start, as TCP's: from the floor, double each window until latency first
                // passes its target, instead of creeping up by the buffer.
                if gradient < 1.0 {
                    self.slow_start = false;
                } else if self.slow_start {
                    gradient = MAX_GRADIENT;
                }
                let mut next = self.limit * gradient;
                next += next.sqrt();
                // A window that used less than half the limit says nothing about more.
                if next > self.limit && f64::from(self.peak) < self.limit / 2.0 {
                    next = self.limit;
                }
                let (min, max) = (f64::from(self.bounds.min), f64::from(self.bounds.max));
                self.limit = next.clamp(min, max);
                if self.limit <= min {
                    self.floor_windows += 1;
                } else {
                    self.floor_windows = 0;
                }
                if self.floor_windows >= FLOOR_WINDOWS {
                    self.start_probe(now_us);
                } else {
                    self.begin_window(now_us);
                }
                Some(Update::Adjusted { latency_us, gradient })
            }
        }
    }

    fn begin_window(&mut self, now_us: u64) {
        self.phase = Phase::Steady { since: now_us };
        self.samples.clear();
        // Requests still in flight were admitted under the old limit: not this window's demand.
        self.peak = 0;
    }

    fn start_probe(&mut self, now_us: u64) {
        let resume = if self.floor_windows >= FLOOR_WINDOWS {
            // The floor came from a stale `min_rtt`: start over from it, the probe will tell.
            self.slow_start = true;
            f64::from(self.bounds.min)
        } else {
            self.limit
        };
        self.phase = Phase::Probe {
            since: now_us,
            resume,
        };
        self.samples.clear();
        self.floor_windows = 0;
        self.next_probe = u64::MAX;
    }

    fn probe_interval(&mut self) -> u64 {
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        PROBE_INTERVAL_US + self.jitter % (PROBE_INTERVAL_US / 4)
    }
}

/// The [`PERCENTILE`] of `v`; `v` is reordered.
fn percentile(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let at = (v.len() * PERCENTILE / 100).min(v.len() - 1);
    *v.select_nth_unstable(at).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    const MS: u64 = 1000;

    fn bounds(min: u32, max: u32) -> Bounds {
        Bounds::new(min, max).unwrap()
    }

    /// Takes `n` places at `t` and answers them all `rtt` later; returns the updates.
    fn round(g: &mut Gradient, t: u64, n: u32, rtt: u64) -> Vec<Update> {
        let mut taken = 0;
        while taken < n && g.try_acquire(t) {
            taken += 1;
        }
        let mut updates = vec![];
        for _ in 0..taken {
            updates.extend(g.sample(t, t + rtt));
            g.release();
        }
        updates
    }

    #[test]
    fn bounds_refuse_zero_and_inverted() {
        assert_eq!(Bounds::new(0, 5).unwrap_err(), "min must be above zero");
        assert_eq!(Bounds::new(6, 5).unwrap_err(), "max 5 is below min 6");
        assert_eq!(Bounds::new(5, 5).unwrap(), bounds(5, 5));
    }

    #[test]
    fn it_starts_by_probing_at_min_and_learns_the_no_load_latency() {
        let mut g = Gradient::new(bounds(4, 100), 0, 7);
        assert!(g.probing());
        assert_eq!(g.limit(), 4);
        for _ in 0..4 {
            assert!(g.try_acquire(0));
        }
        assert!(!g.try_acquire(0), "a fifth place during the probe");
        for _ in 0..4 {
            assert_eq!(g.sample(0, 250 * MS), None);
            g.release();
        }
        let ups = round(&mut g, 250 * MS, 4, 250 * MS);
        assert_eq!(ups, vec![Update::Probed { min_rtt_us: 250 * MS }]);
        assert!(!g.probing());
        assert_eq!(g.min_rtt_us(), Some(250 * MS));
    }

    #[test]
    fn latency_near_no_load_raises_the_limit_and_growing_latency_lowers_it() {
        // A floor of 8: every round then fills a window.
        let mut g = Gradient::new(bounds(8, 1000), 0, 7);
        let mut t = 0;
        while g.probing() {
            round(&mut g, t, 8, 100 * MS);
            t += 100 * MS;
        }
        let mut limits = vec![g.limit()];
        for _ in 0..4 {
            let n = g.limit();
            round(&mut g, t, n, 100 * MS);
            t += 100 * MS;
            limits.push(g.limit());
        }
        assert!(limits.windows(2).all(|w| w[1] > w[0]), "{limits:?}");
        let high = g.limit();
        // The upstream queues: three times the no-load latency.
        let ups = round(&mut g, t, high, 300 * MS);
        t += 300 * MS;
        assert!(
            matches!(ups.last(), Some(Update::Adjusted { gradient, .. }) if *gradient == MIN_GRADIENT),
            "{ups:?}"
        );
        assert!(g.limit() < high, "{} after {high}", g.limit());
        let low = g.limit();
        // Out of slow start, a window spans the admissions of one no-load round trip.
        round(&mut g, t, low, 100 * MS);
        assert_eq!(g.limit(), low, "judged before a round trip of admissions");
        round(&mut g, t + 100 * MS, low, 100 * MS);
        assert!(g.limit() > low, "the limit rises back when latency recovers");
    }

    #[test]
    fn a_window_that_used_little_of_the_limit_does_not_raise_it() {
        // A floor of 8: every round then fills a window.
        let mut g = Gradient::new(bounds(8, 1000), 0, 7);
        let mut t = 0;
        while g.probing() {
            round(&mut g, t, 8, 100 * MS);
            t += 100 * MS;
        }
        for _ in 0..3 {
            let n = g.limit();
            round(&mut g, t, n, 100 * MS);
            t += 100 * MS;
        }
        let before = g.limit();
        for _ in 0..10 {
            round(&mut g, t, before / 2 - 1, 100 * MS);
            t += 100 * MS;
        }
        assert_eq!(g.limit(), before);
    }

    #[test]
    fn samples_from_before_the_window_are_not_counted() {
        let mut g = Gradient::new(bounds(2, 100), 1_000 * MS, 7);
        // Admitted before the probe began, answered during it.
        assert_eq!(g.sample(0, 1_100 * MS), None);
        assert!(g.probing());
        for _ in 0..PROBE_SAMPLES {
            g.sample(1_000 * MS, 1_050 * MS);
        }
        assert_eq!(g.min_rtt_us(), Some(50 * MS));
    }

    #[test]
    fn a_limit_stuck_at_the_floor_measures_the_no_load_latency_again() {
        // The database slows for good: 100 ms becomes 250 ms of service time.
        let mut g = Gradient::new(bounds(4, 1000), 0, 7);
        let mut t = 0;
        while g.probing() {
            round(&mut g, t, 4, 100 * MS);
            t += 100 * MS;
        }
        let mut probed_again = false;
        for _ in 0..40 {
            let n = g.limit();
            for u in round(&mut g, t, n, 250 * MS) {
                if u == (Update::Probed { min_rtt_us: 250 * MS }) {
                    probed_again = true;
                }
            }
            t += 250 * MS;
        }
        assert!(probed_again);
        assert!(g.limit() > 4, "it grows again from the new no-load latency");
    }

    #[test]
    fn it_probes_again_after_the_interval() {
        let mut g = Gradient::new(bounds(4, 1000), 0, 7);
        let mut t = 0;
        while g.probing() {
            round(&mut g, t, 4, 10 * MS);
            t += 10 * MS;
        }
        let probed_at = t;
        while t < probed_at + PROBE_INTERVAL_US {
            let n = g.limit();
            round(&mut g, t, n / 2 + 1, 10 * MS);
            t += 100 * MS;
            assert!(!g.probing(), "probing again after {} ms", (t - probed_at) / MS);
        }
        let late = probed_at + PROBE_INTERVAL_US + PROBE_INTERVAL_US / 4;
        g.try_acquire(late);
        assert!(g.probing());
        assert_eq!(g.limit(), 4);
    }

    #[test]
    fn the_limit_stays_within_its_bounds() {
        let mut g = Gradient::new(bounds(3, 20), 0, 7);
        let mut t = 0;
        for i in 0..200u64 {
            let n = g.limit();
            // Alternating fast and very slow windows.
            let rtt = if (i / 10) % 2 == 0 { 5 * MS } else { 500 * MS };
            round(&mut g, t, n, rtt);
            t += rtt;
            assert!((3..=20).contains(&g.limit()), "{}", g.limit());
        }
    }

    /// A slow backend as a discrete-event model: an upstream of `workers` that serves each
    /// request in `service` and queues the rest without bound, offered `rate` requests a second
    /// for `secs`. Returns (admitted, shed, served within the run, the admitted latencies).
    fn slow_backend(workers: usize, service: u64, rate: u64, secs: u64) -> (u64, u64, u64, Vec<u64>) {
        let mut g = Gradient::new(bounds(4, 2000), 0, 99);
        // When each worker is next free, and when each admitted request is answered.
        let mut free: BinaryHeap<Reverse<u64>> = (0..workers).map(|_| Reverse(0)).collect();
        let mut pending: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let (mut admitted, mut shed, mut served) = (0, 0, 0);
        let mut latencies = vec![];
        let gap = 1_000_000 / rate;
        let end = secs * 1_000_000;
        let mut t = 0;
        while t < end {
            while let Some(Reverse((done, started))) = pending.peek().copied() {
                if done > t {
                    break;
                }
                pending.pop();
                g.sample(started, done);
                g.release();
                served += 1;
                latencies.push(done - started);
            }
            if g.try_acquire(t) {
                admitted += 1;
                let Reverse(f) = free.pop().unwrap();
                let done = f.max(t) + service;
                free.push(Reverse(done));
                pending.push(Reverse((done, t)));
            } else {
                shed += 1;
            }
            t += gap;
        }
        (admitted, shed, served, latencies)
    }

    #[test]
    fn a_slow_backend_keeps_latency_bounded_and_the_upstream_busy() {
        // 80 workers whose database went from 100 to 250 ms a request, offered 700 a second.
        let (admitted, shed, served, mut lat) = slow_backend(80, 250 * MS, 700, 20);
        assert!(shed > 0 && admitted > 0);
        lat.sort_unstable();
        let p99 = lat[lat.len() * 99 / 100];
        assert!(p99 <= 500 * MS, "p99 {} ms", p99 / MS);
        // The upstream serves 320 a second at most.
        let goodput = served as f64 / 20.0;
        assert!(goodput >= 0.9 * 320.0, "goodput {goodput}/s");
    }
}
