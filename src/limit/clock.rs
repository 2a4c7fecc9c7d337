//! Where the gateway's own time comes from: a system clock for serving, a manual one for tests
//! and replay. Bucket math never reads a clock itself; the embedded store asks one of these.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Microseconds on a clock that never goes back.
pub trait Clock: Send + Sync + 'static {
    fn now_us(&self) -> u64;
}

/// Wall-clock microseconds at start-up, advanced by the monotonic clock: readable as Unix time,
/// immune to NTP steps while the process runs.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
    origin_us: u64,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        let origin_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        SystemClock {
            origin: Instant::now(),
            origin_us,
        }
    }

    pub fn shared() -> Arc<dyn Clock> {
        Arc::new(SystemClock::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.origin_us + self.origin.elapsed().as_micros() as u64
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(start_us: u64) -> Arc<ManualClock> {
        Arc::new(ManualClock {
            now: AtomicU64::new(start_us),
        })
    }

    pub fn advance_us(&self, us: u64) {
        self.now.fetch_add(us, Ordering::SeqCst);
    }

    pub fn set_us(&self, us: u64) {
        self.now.store(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// A duration as flags write it: a whole number and a unit, `ms`, `s`, `m` or `h` (`250ms`,
/// `15s`); anything else is an error that says what is wrong.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} needs a unit: ms, s, m or h"))?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{text:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => n,
        "s" => n.saturating_mul(1_000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Ok(Duration::from_millis(ms))
}
