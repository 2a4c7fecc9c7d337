//! The vocabulary both ledgers speak, apart from the ledger that picks between them: a
//! record as read and as placed in its key's calendar, what a pass did, a key's usage in a
//! period and how a command names one, and how an identity is written as one string. The
//! Redis and SQLite ledgers import it; neither imports the other or the dispatcher.

use std::collections::{HashMap, HashSet};

use jiff::tz::TimeZone;
use tollgate_rules::Snapshot;
use tollgate_rules::quota::{self, Per};

use crate::record::{Identity, Kind, Record, RecordError};

/// The largest total the ledger adds exactly: Redis scripts count in doubles.
pub(crate) const MAX_TOTAL: u64 = 1 << 53;

/// One stream entry or file row as read, before it is trusted.
#[derive(Debug, Clone)]
pub struct RawEntry {
    /// The stream entry id (`1764547200000-0`) or the row id.
    pub id: String,
    /// The store's clock for a stream entry, the gateway's for a row (`at_ms`).
    pub at_ms: i64,
    pub record: Result<Record, RecordError>,
}

/// A record placed in its key's calendar.
#[derive(Debug, Clone)]
pub struct Placed {
    pub id: String,
    pub at_ms: i64,
    pub record: Record,
    /// The day and the month holding `at_ms` in the key's quota zone (UTC without a quota);
    /// empty for an end record.
    pub day: String,
    pub month: String,
}

/// An entry that is not a record this version can read: logged with its id and passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    pub id: String,
    pub reason: String,
}

/// What one pass over new records did.
#[derive(Debug, Default)]
pub struct PassReport {
    /// Entries taken from the stream or file, malformed ones included.
    pub read: usize,
    /// Usage records that raised a total, and by how much in all.
    pub raised: usize,
    pub added: u64,
    /// Usage records that changed nothing: repeats, replays, older totals.
    pub repeats: usize,
    pub ends: usize,
    pub malformed: Vec<Malformed>,
    /// Identities reported unclean that were heard from again with a newer record.
    pub resumed: Vec<Identity>,
    /// Identities reported unclean that then sent `end`.
    pub ended_after_report: Vec<Identity>,
    /// The time of the newest entry read, for the log.
    pub newest_ms: Option<i64>,
}

impl PassReport {
    /// A pass over `raw`, before any of it is applied.
    pub(crate) fn of(raw: &[RawEntry]) -> PassReport {
        PassReport {
            read: raw.len(),
            newest_ms: raw.iter().map(|e| e.at_ms).max(),
            ..PassReport::default()
        }
    }
}

/// What a record did, as both ledgers answer it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Liveness {
    Unchanged,
    Resumed,
    EndedAfterReport,
}

impl PassReport {
    pub(crate) fn count(&mut self, placed: &Placed, added: u64, liveness: Liveness) {
        match &placed.record.kind {
            Kind::End => self.ends += 1,
            Kind::Usage { .. } if added > 0 => {
                self.raised += 1;
                self.added += added;
            }
            Kind::Usage { .. } => self.repeats += 1,
        }
        match liveness {
            Liveness::Unchanged => {}
            Liveness::Resumed => self.resumed.push(placed.record.identity.clone()),
            Liveness::EndedAfterReport => self.ended_after_report.push(placed.record.identity.clone()),
        }
    }
}

/// Each key's calendar, from the rules: its quota's zone, UTC for keys without a quota and for
/// keys the rules don't name (a key removed from the rules still used what it used).
#[derive(Debug)]
pub struct Calendar {
    zones: HashMap<String, TimeZone>,
    warned: HashSet<String>,
}

impl Calendar {
    pub fn new(rules: &Snapshot) -> Calendar {
        let zones = rules
            .keys
            .iter()
            .map(|k| {
                let zone = k.quota.as_ref().map_or(TimeZone::UTC, |q| q.zone.clone());
                (k.id.to_string(), zone)
            })
            .collect();
        Calendar {
            zones,
            warned: HashSet::new(),
        }
    }

    fn zone(&mut self, key: &str) -> TimeZone {
        if let Some(z) = self.zones.get(key) {
            return z.clone();
        }
        if self.warned.insert(key.to_string()) {
            tracing::warn!(
                key,
                "usage for a key the rules don't name: counted in UTC days and months"
            );
        }
        TimeZone::UTC
    }

    /// Places every readable record in its key's day and month; the rest come back as
    /// malformed, with their ids.
    pub fn place(&mut self, entries: Vec<RawEntry>) -> (Vec<Placed>, Vec<Malformed>) {
        let mut placed = Vec::with_capacity(entries.len());
        let mut bad = Vec::new();
        for e in entries {
            let record = match e.record {
                Ok(r) => r,
                Err(err) => {
                    bad.push(Malformed {
                        id: e.id,
                        reason: err.to_string(),
                    });
                    continue;
                }
            };
            let (day, month) = match &record.kind {
                Kind::Usage { total, .. } if *total >= MAX_TOTAL => {
                    bad.push(Malformed {
                        id: e.id,
                        reason: format!("usage record: field total: {total} is not below 2^53"),
                    });
                    continue;
                }
                Kind::Usage { key, .. } => {
                    let zone = self.zone(key);
                    (
                        quota::period(Per::Day, &zone, e.at_ms).label,
                        quota::period(Per::Month, &zone, e.at_ms).label,
                    )
                }
                Kind::End => (String::new(), String::new()),
            };
            placed.push(Placed {
                id: e.id,
                at_ms: e.at_ms,
                record,
                day,
                month,
            });
        }
        (placed, bad)
    }
}

/// One key's standing in one period.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    pub admitted: u64,
    /// Identities that added to it.
    pub identities: u64,
    /// Of those, how many ended without an `end` record.
    pub unclean_ends: u64,
}

/// A calendar period as the commands name it: `--day 2026-12-01` or `--month 2026-12`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeriodLabel {
    pub per: Per,
    pub label: String,
}

impl PeriodLabel {
    /// A `YYYY-MM-DD` that is a real date; `flag` names the option in the error.
    pub fn day(text: &str, flag: &str) -> Result<PeriodLabel, String> {
        let ok = jiff::civil::Date::strptime("%Y-%m-%d", text)
            .ok()
            .filter(|d| d.strftime("%Y-%m-%d").to_string() == text);
        match ok {
            Some(_) => Ok(PeriodLabel {
                per: Per::Day,
                label: text.to_string(),
            }),
            None => Err(format!("{flag} {text:?}: not a date of the form YYYY-MM-DD")),
        }
    }

    /// A `YYYY-MM`.
    pub fn month(text: &str, flag: &str) -> Result<PeriodLabel, String> {
        let ok = jiff::civil::Date::strptime("%Y-%m-%d", format!("{text}-01"))
            .ok()
            .filter(|d| d.strftime("%Y-%m").to_string() == text);
        match ok {
            Some(_) => Ok(PeriodLabel {
                per: Per::Month,
                label: text.to_string(),
            }),
            None => Err(format!("{flag} {text:?}: not a month of the form YYYY-MM")),
        }
    }
}

/// How an identity is written where the ledger needs one string: a JSON array, since a
/// gateway's name may hold any separator.
pub(crate) fn identity_code(id: &Identity) -> String {
    serde_json::to_string(&(&id.gateway, &id.boot)).expect("two strings serialize")
}

pub(crate) fn identity_from_code(code: &str) -> Result<Identity, String> {
    serde_json::from_str::<(String, String)>(code)
        .map(|(gateway, boot)| Identity { gateway, boot })
        .map_err(|e| format!("identity {code:?} in the ledger is not [gateway, boot]: {e}"))
}

/// How a command uses the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Reads new records: joins the consumer group (creating it when missing).
    Consumer { claim_idle_ms: u64 },
    /// Only asks questions.
    Reader,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Snapshot {
        let text = r#"{
          "version": 1,
          "upstreams": { "u": { "url": "http://127.0.0.1:1" } },
          "limits": { "plan": { "dimension": "key" } },
          "keys": [
            { "id": "k-paris", "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc",
              "limits": { "plan": { "rate": "1/1s", "burst": 1 } },
              "quota": { "per": "day", "limit": 10, "timezone": "Europe/Paris" } },
            { "id": "k-utc", "sha256": "e8d82e1432937b5c94e45c3b48899d5d6a3a7618cdccbbbfc3e595360dd083f2",
              "limits": { "plan": { "rate": "1/1s", "burst": 1 } } }
          ],
          "routes": [ { "name": "r", "method": "*", "path": "/", "upstream": "u", "cost": { "plan": 1 } } ]
        }"#;
        tollgate_rules::compile(text.as_bytes(), "test.json", Default::default()).unwrap()
    }

    fn usage(key: &str, total: u64, at_ms: i64, id: &str) -> RawEntry {
        RawEntry {
            id: id.into(),
            at_ms,
            record: Ok(Record {
                identity: Identity {
                    gateway: "gw".into(),
                    boot: "b".into(),
                },
                seq: 1,
                kind: Kind::Usage {
                    key: key.into(),
                    total,
                },
            }),
        }
    }

    #[test]
    fn records_fall_in_the_keys_own_day() {
        let mut cal = Calendar::new(&rules());
        // 23:30 UTC on 30 November is already 1 December in Paris.
        let at = 1_764_545_400_000;
        let (placed, bad) = cal.place(vec![
            usage("k-paris", 5, at, "1-0"),
            usage("k-utc", 5, at, "2-0"),
            usage("k-gone", 5, at, "3-0"),
        ]);
        assert!(bad.is_empty());
        let labels: Vec<_> = placed
            .iter()
            .map(|p| (p.day.as_str(), p.month.as_str()))
            .collect();
        assert_eq!(
            labels,
            [
                ("2025-12-01", "2025-12"),
                ("2025-11-30", "2025-11"),
                ("2025-11-30", "2025-11")
            ]
        );
    }

    #[test]
    fn unreadable_and_huge_records_are_named_not_placed() {
        let mut cal = Calendar::new(&rules());
        let broken = RawEntry {
            id: "9-0".into(),
            at_ms: 0,
            record: Err(RecordError {
                field: "seq",
                reason: "missing".into(),
            }),
        };
        let (placed, bad) = cal.place(vec![broken, usage("k-utc", MAX_TOTAL, 0, "10-0")]);
        assert!(placed.is_empty());
        assert_eq!(bad[0].id, "9-0");
        assert!(bad[0].reason.contains("field seq"), "{:?}", bad[0]);
        assert!(bad[1].reason.contains("field total"), "{:?}", bad[1]);
    }

    #[test]
    fn period_labels_must_be_real_dates() {
        assert_eq!(PeriodLabel::day("2026-02-28", "--day").unwrap().per, Per::Day);
        for bad in ["2026-02-30", "2026-2-1", "26-02-01", "2026-02-01x", ""] {
            let e = PeriodLabel::day(bad, "--day").unwrap_err();
            assert!(e.starts_with("--day"), "{e}");
        }
        assert_eq!(PeriodLabel::month("2026-12", "--month").unwrap().label, "2026-12");
        for bad in ["2026-13", "2026-1", "2026-12-01", "December"] {
            assert!(PeriodLabel::month(bad, "--month").is_err(), "{bad}");
        }
    }

    #[test]
    fn identity_codes_read_back_whatever_the_name_holds() {
        let id = Identity {
            gateway: "eu/gw \"1\",".into(),
            boot: "00ff".into(),
        };
        assert_eq!(identity_from_code(&identity_code(&id)).unwrap(), id);
        assert!(identity_from_code("gw/boot").is_err());
    }
}
