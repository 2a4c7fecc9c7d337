//! Log lines that could come once per request (shadow refusals, store bypasses) go through a
//! sampler: at most one line per category per interval, reporting how many were suppressed, so
//! an outage or a storm never floods the log.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

pub struct Sampler {
    every: Duration,
    last: Mutex<HashMap<usize, (Instant, u64)>>,
}

impl Sampler {
    pub fn new(every: Duration) -> Sampler {
        Sampler {
            every,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(suppressed)` when a line for `category` may be logged now, with the number of
    /// lines suppressed since the last one; `None` otherwise.
    pub fn allow(&self, category: usize) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match last.get_mut(&category) {
            Some((at, suppressed)) if now.duration_since(*at) < self.every => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                let n = *suppressed;
                *at = now;
                *suppressed = 0;
                Some(n)
            }
            None => {
                last.insert(category, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_per_category() {
        let s = Sampler::new(Duration::from_secs(3600));
        assert_eq!(s.allow(1), Some(0));
        assert_eq!(s.allow(1), None);
        assert_eq!(s.allow(1), None);
        assert_eq!(s.allow(2), Some(0));
        let s = Sampler::new(Duration::ZERO);
        assert_eq!(s.allow(1), Some(0));
        assert_eq!(s.allow(1), Some(0));
    }
}
