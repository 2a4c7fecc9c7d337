//! An upstream's places for requests in flight: the adaptive limit that follows its latency
//! (`tollgate_limit::adaptive`, behind a lock), the static `max_in_flight` gate that stays its
//! ceiling, and the [`Place`] a forwarded request holds until its response body ends or its
//! client goes away.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tollgate_limit::adaptive::{Bounds, Gradient};
use tollgate_telemetry::metrics::{Metrics, UpstreamLabel};

/// One upstream's adaptive limit. Kept across reloads while its bounds stay, like the gate.
pub struct Adaptive {
    limiter: Mutex<Gradient>,
    /// The limiter's clock: microseconds since this, monotonic.
    epoch: Instant,
    pub bounds: Bounds,
    /// The static ceiling, for the limit the metrics report.
    cap: Option<u32>,
    limit_gauge: Gauge,
}

impl Adaptive {
    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gradient> {
        // The limiter's state is whole after every call (no call panics halfway), so a
        // poisoned lock still holds a usable limiter.
        self.limiter.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn show(&self, g: &Gradient) {
        let limit = self.cap.map_or(g.limit(), |c| c.min(g.limit()));
        self.limit_gauge.set(i64::from(limit));
    }

    fn try_acquire(&self) -> bool {
        let now = self.now_us();
        let mut g = self.lock();
        let ok = g.try_acquire(now);
        self.show(&g);
        ok
    }

    fn release(&self) {
        self.lock().release();
    }

    /// A request admitted `took` ago has its answer's head (or gave up waiting for it).
    pub fn sample(&self, took: Duration) {
        let now = self.now_us();
        let started = now.saturating_sub(took.as_micros() as u64);
        let mut g = self.lock();
        if g.sample(started, now).is_some() {
            self.show(&g);
        }
    }
}

/// Everything that decides whether a request may go to one upstream now.
pub struct Places {
    /// Places under `max_in_flight`: the same across reloads while the cap stays, so a reload
    /// never lets a slow upstream receive twice its cap.
    pub gate: Option<Arc<Semaphore>>,
    max_in_flight: Option<u32>,
    pub adaptive: Option<Arc<Adaptive>>,
    in_flight: Gauge,
    shed: Counter,
}

impl Places {
    /// This snapshot's places for `u` under `cap` (its `max_in_flight`, or its targets' sum),
    /// sharing the previous snapshot's gate and limiter when their numbers are unchanged.
    pub fn new(
        u: &tollgate_rules::Upstream,
        cap: Option<u32>,
        prev: Option<&Places>,
        metrics: &Metrics,
    ) -> Places {
        let label = UpstreamLabel {
            upstream: u.name.clone(),
        };
        let gate = match prev {
            Some(o) if o.max_in_flight == cap => o.gate.clone(),
            _ => cap.map(|n| Arc::new(Semaphore::new(n as usize))),
        };
        let limit_gauge = metrics.upstream_concurrency_limit.get_or_create(&label).clone();
        let adaptive = match (prev.and_then(|o| o.adaptive.as_ref()), u.adaptive) {
            (_, None) => None,
            (Some(a), Some(b)) if a.bounds == b && a.cap == cap => Some(a.clone()),
            (_, Some(bounds)) => {
                let epoch = Instant::now();
                Some(Arc::new(Adaptive {
                    limiter: Mutex::new(Gradient::new(bounds, 0, rand::random())),
                    epoch,
                    bounds,
                    cap,
                    limit_gauge: limit_gauge.clone(),
                }))
            }
        };
        match (&adaptive, cap) {
            (Some(a), _) => a.show(&a.lock()),
            (None, Some(cap)) => {
                limit_gauge.set(i64::from(cap));
            }
            (None, None) => {
                // No limit: the family keeps no stale number from an earlier snapshot.
                metrics.upstream_concurrency_limit.remove(&label);
            }
        }
        Places {
            gate,
            max_in_flight: cap,
            adaptive,
            in_flight: metrics.upstream_in_flight.get_or_create(&label).clone(),
            shed: metrics.upstream_shed.get_or_create(&label).clone(),
        }
    }

    /// Requests in flight and the limit they are held to, for the dashboard; `None` where
    /// this upstream has neither a static cap nor an adaptive limit (nothing counts them).
    pub fn now(&self) -> (Option<u32>, Option<u32>, bool) {
        if self.gate.is_none() && self.adaptive.is_none() {
            return (None, None, false);
        }
        let limit = match &self.adaptive {
            Some(a) => {
                let l = a.lock().limit();
                Some(a.cap.map_or(l, |c| c.min(l)))
            }
            None => self.max_in_flight,
        };
        (
            Some(self.in_flight.get().max(0) as u32),
            limit,
            self.adaptive.is_some(),
        )
    }

    /// A place for one request: at once under the adaptive limit, then within `queue_timeout`
    /// under the static cap. `None`: shed (counted).
    pub(crate) async fn acquire(&self, queue_timeout: Duration) -> Option<Place> {
        let mut place = Place {
            permit: None,
            adaptive: None,
            in_flight: None,
        };
        if let Some(a) = &self.adaptive {
            if !a.try_acquire() {
                self.shed.inc();
                return None;
            }
            place.adaptive = Some(a.clone());
        }
        if let Some(gate) = &self.gate {
            match tokio::time::timeout(queue_timeout, gate.clone().acquire_owned()).await {
                Ok(Ok(p)) => place.permit = Some(p),
                // Dropping `place` gives the adaptive place back.
                _ => {
                    self.shed.inc();
                    return None;
                }
            }
        }
        self.in_flight.inc();
        place.in_flight = Some(self.in_flight.clone());
        Some(place)
    }
}

/// A request's place at its upstream, held until the response body is done or dropped (client
/// gone, request failed); dropping it gives every part back.
pub struct Place {
    permit: Option<OwnedSemaphorePermit>,
    adaptive: Option<Arc<Adaptive>>,
    in_flight: Option<Gauge>,
}

impl Place {
    /// Whether it holds anything back: a place under a static cap or an adaptive limit.
    pub fn limited(&self) -> bool {
        self.permit.is_some() || self.adaptive.is_some()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(a) = self.adaptive.take() {
            a.release();
        }
        if let Some(g) = self.in_flight.take() {
            g.dec();
        }
        self.permit = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(rules: &str) -> tollgate_rules::Snapshot {
        tollgate_rules::compile(
            rules.as_bytes(),
            "test.json",
            tollgate_rules::CompileOptions::default(),
        )
        .unwrap()
    }

    fn rules(extra: &str) -> String {
        format!(
            r#"{{"version": 1, "upstreams": {{"u": {{"url": "http://127.0.0.1:9"{extra}}}}},
                "routes": [{{"method": "GET", "path": "/", "upstream": "u", "key": "optional"}}]}}"#
        )
    }

    #[tokio::test]
    async fn the_adaptive_limit_sheds_at_once_and_a_dropped_place_comes_back() {
        let snap = upstream(&rules(
            r#", "concurrency": {"adaptive": true, "min": 2, "max": 10}"#,
        ));
        let metrics = Metrics::new();
        let places = Places::new(
            &snap.upstreams[0],
            snap.upstreams[0].max_in_flight,
            None,
            &metrics,
        );
        // A probe runs at min first.
        let a = places.acquire(Duration::from_secs(5)).await.expect("first");
        let b = places.acquire(Duration::from_secs(5)).await.expect("second");
        assert!(places.acquire(Duration::from_secs(5)).await.is_none(), "over min");
        drop(a);
        let c = places.acquire(Duration::from_secs(5)).await;
        assert!(c.is_some(), "a released place is free again");
        drop((b, c));
        let text = metrics.render();
        assert!(
            text.contains("tollgate_upstream_shed_total{upstream=\"u\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tollgate_upstream_in_flight{upstream=\"u\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("tollgate_upstream_concurrency_limit{upstream=\"u\"} 2"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn the_static_cap_still_bounds_an_adaptive_upstream() {
        let snap = upstream(&rules(
            r#", "max_in_flight": 1, "concurrency": {"adaptive": true, "min": 1, "max": 10}"#,
        ));
        let metrics = Metrics::new();
        let places = Places::new(
            &snap.upstreams[0],
            snap.upstreams[0].max_in_flight,
            None,
            &metrics,
        );
        let a = places.acquire(Duration::from_millis(10)).await.expect("first");
        assert!(places.acquire(Duration::from_millis(10)).await.is_none());
        drop(a);
        assert!(places.acquire(Duration::from_millis(10)).await.is_some());
    }

    #[test]
    fn a_reload_keeps_the_limiter_while_its_numbers_stay() {
        let metrics = Metrics::new();
        let one = upstream(&rules(
            r#", "concurrency": {"adaptive": true, "min": 2, "max": 10}"#,
        ));
        let first = Places::new(&one.upstreams[0], one.upstreams[0].max_in_flight, None, &metrics);
        let same = Places::new(
            &one.upstreams[0],
            one.upstreams[0].max_in_flight,
            Some(&first),
            &metrics,
        );
        assert!(Arc::ptr_eq(
            first.adaptive.as_ref().unwrap(),
            same.adaptive.as_ref().unwrap()
        ));
        let other = upstream(&rules(
            r#", "concurrency": {"adaptive": true, "min": 3, "max": 10}"#,
        ));
        let changed = Places::new(
            &other.upstreams[0],
            other.upstreams[0].max_in_flight,
            Some(&same),
            &metrics,
        );
        assert!(!Arc::ptr_eq(
            same.adaptive.as_ref().unwrap(),
            changed.adaptive.as_ref().unwrap()
        ));
        let off = upstream(&rules(r#", "concurrency": {"adaptive": false}"#));
        assert!(
            Places::new(
                &off.upstreams[0],
                off.upstreams[0].max_in_flight,
                Some(&changed),
                &metrics
            )
            .adaptive
            .is_none()
        );
    }
}
