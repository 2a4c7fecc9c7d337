//! Billing quotas and their periods: calendar days and months in the quota's own time zone, so a partner's day
//! resets at its midnight, with daylight-saving days 23 or 25 hours long.

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan, Zoned};

/// How long a quota's period is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Per {
    /// A calendar day in the quota's zone.
    Day,
    /// A calendar month in the quota's zone.
    Month,
}

impl Per {
    pub fn as_str(self) -> &'static str {
        match self {
            Per::Day => "day",
            Per::Month => "month",
        }
    }
}

/// A quota: at most `limit` admitted requests per calendar `per` in `zone`.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    pub per: Per,
    pub limit: u64,
    /// The IANA name, as written in the rules (`Europe/Paris`, `UTC`).
    pub zone_name: String,
    pub zone: TimeZone,
}

/// Why a quota can't be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    #[error("{0:?} is not an IANA time zone name (for example \"Europe/Paris\" or \"UTC\")")]
    Zone(String),
    #[error("limit must be at least 1")]
    Zero,
}

impl Quota {
    pub fn new(per: Per, limit: u64, zone_name: &str) -> Result<Quota, QuotaError> {
        if limit == 0 {
            return Err(QuotaError::Zero);
        }
        let zone = TimeZone::get(zone_name).map_err(|_| QuotaError::Zone(zone_name.into()))?;
        Ok(Quota {
            per,
            limit,
            zone_name: zone_name.into(),
            zone,
        })
    }

    /// The period that holds the instant `at_ms` (milliseconds since the Unix epoch).
    pub fn period(&self, at_ms: i64) -> Period {
        period(self.per, &self.zone, at_ms)
    }
}

/// One calendar period: its label, used as the name of its total, and its bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Period {
    /// `2026-12-01` for a day, `2026-12` for a month.
    pub label: String,
    pub start_ms: i64,
    /// The first instant of the next period, when the quota resets.
    pub resets_at_ms: i64,
    /// `resets_at_ms` in RFC 3339 with the zone's offset then.
    pub resets_at: String,
}

impl Period {
    /// The period's length in whole seconds (86,400 for most days).
    pub fn seconds(&self) -> u64 {
        ((self.resets_at_ms - self.start_ms) / 1000).max(0) as u64
    }

    /// Whole seconds from `now_ms` to the reset, at least 1 (for `Retry-After`).
    pub fn secs_to_reset(&self, now_ms: i64) -> u64 {
        let ms = (self.resets_at_ms - now_ms).max(0) as u64;
        ms.div_ceil(1000).max(1)
    }
}

/// The `per` period holding `at_ms` in `zone`.
pub fn period(per: Per, zone: &TimeZone, at_ms: i64) -> Period {
    let at = Timestamp::from_millisecond(at_ms).unwrap_or(Timestamp::UNIX_EPOCH);
    let day = at.to_zoned(zone.clone()).date();
    let (start, next, label) = match per {
        Per::Day => (
            day,
            day.tomorrow().unwrap_or(Date::MAX),
            day.strftime("%Y-%m-%d").to_string(),
        ),
        Per::Month => {
            let first = day.first_of_month();
            (
                first,
                first.checked_add(1.month()).unwrap_or(Date::MAX),
                first.strftime("%Y-%m").to_string(),
            )
        }
    };
    let start = midnight(start, zone);
    let next = midnight(next, zone);
    Period {
        label,
        start_ms: start.timestamp().as_millisecond(),
        resets_at_ms: next.timestamp().as_millisecond(),
        resets_at: next.strftime("%Y-%m-%dT%H:%M:%S%:z").to_string(),
    }
}

/// The first instant of `date` in `zone` (not always 00:00, where a DST gap swallows it).
fn midnight(date: Date, zone: &TimeZone) -> Zoned {
    date.to_zoned(zone.clone())
        .unwrap_or_else(|_| Timestamp::MAX.to_zoned(zone.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(s: &str) -> i64 {
        s.parse::<Timestamp>().unwrap().as_millisecond()
    }

    #[test]
    fn a_paris_day_resets_at_paris_midnight() {
        let q = Quota::new(Per::Day, 100, "Europe/Paris").unwrap();
        // 23:30 UTC on 30 November is 00:30 on 1 December in Paris.
        let p = q.period(ms("2026-11-30T23:30:00Z"));
        assert_eq!(p.label, "2026-12-01");
        assert_eq!(p.start_ms, ms("2026-11-30T23:00:00Z"));
        assert_eq!(p.resets_at, "2026-12-02T00:00:00+01:00");
        assert_eq!(p.seconds(), 86_400);
        assert_eq!(p.secs_to_reset(ms("2026-12-01T22:59:59.500Z")), 1);
    }

    #[test]
    fn daylight_saving_days_are_23_and_25_hours() {
        let q = Quota::new(Per::Day, 1, "Europe/Paris").unwrap();
        assert_eq!(q.period(ms("2026-03-29T12:00:00Z")).seconds(), 23 * 3600);
        assert_eq!(q.period(ms("2026-10-25T12:00:00Z")).seconds(), 25 * 3600);
    }

    #[test]
    fn a_month_runs_to_the_first_of_the_next() {
        let q = Quota::new(Per::Month, 1, "UTC").unwrap();
        let p = q.period(ms("2026-02-14T08:00:00Z"));
        assert_eq!(p.label, "2026-02");
        assert_eq!(p.seconds(), 28 * 86_400);
        assert_eq!(p.resets_at, "2026-03-01T00:00:00+00:00");
    }

    #[test]
    fn bad_quotas_say_why() {
        assert_eq!(
            Quota::new(Per::Day, 1, "Mars/Olympus").unwrap_err(),
            QuotaError::Zone("Mars/Olympus".into())
        );
        assert_eq!(Quota::new(Per::Day, 0, "UTC").unwrap_err(), QuotaError::Zero);
    }
}
