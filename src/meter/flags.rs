//! What the metering side tells gateways about quotas: per key, how much of its current
//! period it has used and whether that is near (≥ 80%) or over (≥ 100%) its quota. Gateways
//! read the flags every second; the limiter never counts quotas itself.

use std::collections::HashMap;

use tollgate_rules::quota::Per;

use crate::counter::BoxFuture;

/// The Redis hash of flags: field = key id, value = a [`Flag`] as JSON.
pub const FLAGS: &str = "tollgate:quota:flags";

/// The share of a quota from which a key is `near`, in percent.
pub(crate) const NEAR_PERCENT: u64 = 80;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Under,
    Near,
    Over,
}

impl State {
    pub fn of(used: u64, limit: u64) -> State {
        if used >= limit {
            State::Over
        } else if used.saturating_mul(100) >= limit.saturating_mul(NEAR_PERCENT) {
            State::Near
        } else {
            State::Under
        }
    }
}

/// One key's standing against its quota in one period.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Flag {
    pub state: State,
    pub quota: Per,
    /// The period's label (`2026-12-01`, `2026-12`).
    pub period: String,
    pub used: u64,
    pub limit: u64,
    pub resets_at_ms: i64,
    /// RFC 3339, in the quota's time zone.
    pub resets_at: String,
}

impl Flag {
    /// Whether the flag still speaks for `now_ms`: a flag of a period that has ended says
    /// nothing, so a key is never held over past its reset waiting for the next count.
    pub fn in_force(&self, now_ms: i64) -> bool {
        now_ms < self.resets_at_ms
    }

    /// Whether requests are refused: over, in its period.
    pub fn blocks(&self, now_ms: i64) -> bool {
        self.state == State::Over && self.in_force(now_ms)
    }
}

/// Where a gateway reads the quota flags the consumer sets.
pub trait FlagSource: Send + Sync {
    /// Every flag as stored: key id → JSON.
    fn read_flags(&self) -> BoxFuture<'_, Result<Vec<(String, String)>, String>>;
}

/// The flags a gateway last read, swapped whole every second.
pub type Flags = HashMap<String, Flag>;

/// Reads the flags from `source` every `every` into `into`, until the task is dropped. A read
/// that fails keeps the last flags: an outage of the store must not lift every quota.
pub async fn follow(
    source: std::sync::Arc<dyn FlagSource>,
    into: std::sync::Arc<arc_swap::ArcSwap<Flags>>,
    every: std::time::Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match source.read_flags().await {
            Ok(raw) => {
                let (flags, bad) = parse_all(raw);
                for b in &bad {
                    tracing::warn!(problem = %b, "quota flag ignored");
                }
                into.store(std::sync::Arc::new(flags));
                if failing {
                    tracing::info!("quota flags readable again");
                    failing = false;
                }
            }
            Err(e) if !failing => {
                tracing::warn!(error = %e, "quota flags not read; the last ones stay in force");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

/// Parses the flags as stored (key id → JSON); an entry that doesn't parse is reported, not
/// guessed at, and the others still count.
pub(crate) fn parse_all(
    raw: impl IntoIterator<Item = (String, String)>,
) -> (HashMap<String, Flag>, Vec<String>) {
    let mut flags = HashMap::new();
    let mut bad = Vec::new();
    for (key, json) in raw {
        match serde_json::from_str::<Flag>(&json) {
            Ok(f) => {
                flags.insert(key, f);
            }
            Err(e) => bad.push(format!("flag of key {key:?}: {e}")),
        }
    }
    (flags, bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_from_80_percent_over_from_100() {
        assert_eq!(State::of(79, 100), State::Under);
        assert_eq!(State::of(80, 100), State::Near);
        assert_eq!(State::of(99, 100), State::Near);
        assert_eq!(State::of(100, 100), State::Over);
        assert_eq!(State::of(u64::MAX, u64::MAX), State::Over);
    }

    #[test]
    fn an_over_flag_stops_blocking_at_its_reset() {
        let f = Flag {
            state: State::Over,
            quota: Per::Day,
            period: "2026-12-01".into(),
            used: 10,
            limit: 10,
            resets_at_ms: 1_000,
            resets_at: "x".into(),
        };
        assert!(f.blocks(999));
        assert!(!f.blocks(1_000));
        let (flags, bad) = parse_all([
            ("k-7".to_string(), serde_json::to_string(&f).unwrap()),
            ("k-8".to_string(), "{".to_string()),
        ]);
        assert_eq!(flags["k-7"], f);
        assert_eq!(bad.len(), 1);
    }
}
