//! The ledger in the embedded store's metering file: tables of the consumer's own beside
//! `usage_records` and `quota_flags` ([`crate::sqlite`]), and how far it has read. Reading a
//! batch, adding it up and moving the cursor are one write transaction, so consumers on one
//! file take turns and each record counts once; the rules are those of `lua/meter_apply.lua`,
//! so both ledgers answer alike.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};

use crate::flags::Flag;
use crate::ledger_types::{Calendar, Liveness, PassReport, PeriodLabel, Placed, RawEntry, Usage};
use crate::record::{Identity, Kind, Record};
use tollgate_rules::quota::Per;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meter_cursor (
    one         INTEGER PRIMARY KEY CHECK (one = 1),
    last_record INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meter_max (
    gateway TEXT NOT NULL, boot TEXT NOT NULL, key TEXT NOT NULL,
    total   INTEGER NOT NULL,
    PRIMARY KEY (gateway, boot, key)
);
CREATE TABLE IF NOT EXISTS meter_usage (
    per TEXT NOT NULL, period TEXT NOT NULL, key TEXT NOT NULL,
    admitted INTEGER NOT NULL,
    PRIMARY KEY (per, period, key)
);
CREATE TABLE IF NOT EXISTS meter_contributors (
    per TEXT NOT NULL, period TEXT NOT NULL, key TEXT NOT NULL,
    gateway TEXT NOT NULL, boot TEXT NOT NULL,
    PRIMARY KEY (per, period, key, gateway, boot)
);
CREATE TABLE IF NOT EXISTS meter_identities (
    gateway TEXT NOT NULL, boot TEXT NOT NULL,
    state   TEXT NOT NULL CHECK (state IN ('live', 'ended', 'unclean')),
    last_ms INTEGER NOT NULL,
    max_seq INTEGER NOT NULL,
    PRIMARY KEY (gateway, boot)
);
CREATE INDEX IF NOT EXISTS meter_identities_live ON meter_identities (state, last_ms);
CREATE TABLE IF NOT EXISTS meter_key_last (
    key   TEXT PRIMARY KEY,
    at_ms INTEGER NOT NULL
);
";

/// This machine's clock in milliseconds: the file's records are stamped with the gateway's.
pub(crate) fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub struct SqliteLedger {
    conn: Connection,
    path: PathBuf,
}

/// A column of `usage_records` as the text `Record::from_fields` reads, whatever type the
/// row holds, so a bad row is named by the same rules as a bad stream entry.
fn column_text(v: ValueRef<'_>) -> Option<String> {
    match v {
        ValueRef::Null => None,
        ValueRef::Integer(i) => Some(i.to_string()),
        ValueRef::Real(f) => Some(f.to_string()),
        ValueRef::Text(t) | ValueRef::Blob(t) => Some(String::from_utf8_lossy(t).into_owned()),
    }
}

fn apply_one(tx: &Transaction<'_>, p: &Placed) -> rusqlite::Result<(u64, Liveness)> {
    let r = &p.record;
    let (gw, boot) = (&r.identity.gateway, &r.identity.boot);
    let seq = r.seq as i64;
    let known: Option<(String, i64, i64)> = tx
        .query_row(
            "SELECT state, last_ms, max_seq FROM meter_identities WHERE gateway = ?1 AND boot = ?2",
            params![gw, boot],
            |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
        )
        .optional()?;
    // As lua/meter_apply.lua: only a record newer by seq says the identity is alive.
    let mut liveness = Liveness::Unchanged;
    let (state, last_ms, max_seq) = known.unwrap_or(("live".into(), i64::MIN, 0));
    let newer = seq > max_seq;
    let (state, last_ms) = match (state.as_str(), &r.kind) {
        ("ended", _) => (state, last_ms),
        (prior, Kind::End) => {
            if prior == "unclean" {
                liveness = Liveness::EndedAfterReport;
            }
            ("ended".to_string(), last_ms)
        }
        (prior, Kind::Usage { .. }) if newer => {
            if prior == "unclean" {
                liveness = Liveness::Resumed;
            }
            ("live".to_string(), last_ms.max(p.at_ms))
        }
        _ => (state, last_ms),
    };
    // An identity first seen by its end record never was live; its last_ms is only a mark.
    let last_ms = if last_ms == i64::MIN { p.at_ms } else { last_ms };
    tx.execute(
        "INSERT INTO meter_identities (gateway, boot, state, last_ms, max_seq) VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT (gateway, boot) DO UPDATE SET state = ?3, last_ms = ?4, max_seq = max(max_seq, ?5)",
        params![gw, boot, state, last_ms, seq],
    )?;

    let Kind::Usage { key, total } = &r.kind else {
        return Ok((0, liveness));
    };
    let total = *total as i64;
    let kept: i64 = tx
        .query_row(
            "SELECT total FROM meter_max WHERE gateway = ?1 AND boot = ?2 AND key = ?3",
            params![gw, boot, key],
            |row| row.get(0),
        )
        .optional()?
        .unwrap_or(0);
    let mut added = 0;
    if total > kept {
        added = total - kept;
        tx.execute(
            "INSERT INTO meter_max (gateway, boot, key, total) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (gateway, boot, key) DO UPDATE SET total = ?4",
            params![gw, boot, key, total],
        )?;
        for (per, label) in [(Per::Day, &p.day), (Per::Month, &p.month)] {
            tx.execute(
                "INSERT INTO meter_usage (per, period, key, admitted) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (per, period, key) DO UPDATE SET admitted = admitted + ?4",
                params![per.as_str(), label, key, added],
            )?;
            tx.execute(
                "INSERT OR IGNORE INTO meter_contributors (per, period, key, gateway, boot) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![per.as_str(), label, key, gw, boot],
            )?;
        }
    }
    tx.execute(
        "INSERT INTO meter_key_last (key, at_ms) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET at_ms = max(at_ms, ?2)",
        params![key, p.at_ms],
    )?;
    Ok((added as u64, liveness))
}

impl SqliteLedger {
    pub fn open(path: &Path) -> Result<SqliteLedger, String> {
        let conn = crate::sqlite::open(path).map_err(|e| format!("--meter-file {e}"))?;
        conn.execute_batch(SCHEMA).map_err(|e| {
            format!(
                "--meter-file {}: cannot add the meter's tables: {e}",
                path.display()
            )
        })?;
        Ok(SqliteLedger {
            conn,
            path: path.to_path_buf(),
        })
    }

    fn fail(&self, what: &str) -> impl Fn(rusqlite::Error) -> String + '_ {
        let what = what.to_string();
        move |e| format!("--meter-file {}: {what}: {e}", self.path.display())
    }

    pub fn pass(&mut self, max: usize, cal: &mut Calendar) -> Result<PassReport, String> {
        let path = self.path.display().to_string();
        let path = path.as_str();
        let fail = |what: &'static str| move |e: rusqlite::Error| format!("--meter-file {path}: {what}: {e}");
        // IMMEDIATE: take the write lock before reading, so two consumers never read the same
        // batch.
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(fail("begin"))?;
        let cursor: i64 = tx
            .query_row("SELECT last_record FROM meter_cursor WHERE one = 1", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(fail("read the cursor"))?
            .unwrap_or(0);
        let mut raw = Vec::new();
        let mut last = cursor;
        {
            let mut q = tx
                .prepare(
                    "SELECT id, at_ms, gateway, boot, seq, kind, key, total FROM usage_records
                     WHERE id > ?1 ORDER BY id LIMIT ?2",
                )
                .map_err(fail("read usage_records"))?;
            let mut rows = q
                .query(params![cursor, max as i64])
                .map_err(fail("read usage_records"))?;
            while let Some(row) = rows.next().map_err(fail("read usage_records"))? {
                let id: i64 = row.get(0).map_err(fail("read usage_records.id"))?;
                let at_ms = match row.get_ref(1).map_err(fail("read usage_records.at_ms"))? {
                    ValueRef::Integer(ms) => Ok(ms),
                    other => Err(format!("at_ms is {other:?}, not an integer")),
                };
                let mut fields = Vec::new();
                for (i, name) in ["gateway", "boot", "seq", "kind", "key", "total"]
                    .iter()
                    .enumerate()
                {
                    let v = row.get_ref(i + 2).map_err(fail("read usage_records"))?;
                    if let Some(t) = column_text(v) {
                        fields.push((*name, t));
                    }
                }
                let at = *at_ms.as_ref().unwrap_or(&0);
                let record = match at_ms {
                    Ok(_) => Record::from_fields(fields.iter().map(|(n, v)| (*n, v.as_str()))),
                    Err(reason) => Err(crate::record::RecordError {
                        field: "at_ms",
                        reason,
                    }),
                };
                raw.push(RawEntry {
                    id: format!("usage_records row {id}"),
                    at_ms: at,
                    record,
                });
                last = id;
            }
        }
        let mut report = PassReport::of(&raw);
        if raw.is_empty() {
            return Ok(report);
        }
        let (placed, malformed) = cal.place(raw);
        for p in &placed {
            let (added, liveness) = apply_one(&tx, p)
                .map_err(|e| format!("--meter-file {}: applying {}: {e}", self.path.display(), p.id))?;
            report.count(p, added, liveness);
        }
        report.malformed = malformed;
        tx.execute(
            "INSERT INTO meter_cursor (one, last_record) VALUES (1, ?1)
             ON CONFLICT (one) DO UPDATE SET last_record = ?1",
            params![last],
        )
        .map_err(fail("move the cursor"))?;
        tx.commit().map_err(fail("commit"))?;
        Ok(report)
    }

    pub(crate) fn oldest_pending_ms(&self) -> Result<Option<i64>, String> {
        self.conn
            .query_row(
                "SELECT at_ms FROM usage_records
                 WHERE id > coalesce((SELECT last_record FROM meter_cursor WHERE one = 1), 0)
                 ORDER BY id LIMIT 1",
                [],
                |r| r.get::<_, i64>(0),
            )
            .optional()
            .map_err(self.fail("read usage_records"))
    }

    pub(crate) fn take_silent(&mut self, before_ms: i64) -> Result<Vec<(Identity, i64)>, String> {
        let path = self.path.display().to_string();
        let fail = |e: rusqlite::Error| format!("--meter-file {path}: report silent identities: {e}");
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(fail)?;
        let found: Vec<(Identity, i64)> = {
            let mut q = tx
                .prepare(
                    "SELECT gateway, boot, last_ms FROM meter_identities
                     WHERE state = 'live' AND last_ms < ?1 ORDER BY last_ms",
                )
                .map_err(fail)?;
            let rows = q
                .query_map(params![before_ms], |r| {
                    Ok((
                        Identity {
                            gateway: r.get(0)?,
                            boot: r.get(1)?,
                        },
                        r.get(2)?,
                    ))
                })
                .map_err(fail)?;
            rows.collect::<rusqlite::Result<_>>().map_err(fail)?
        };
        tx.execute(
            "UPDATE meter_identities SET state = 'unclean' WHERE state = 'live' AND last_ms < ?1",
            params![before_ms],
        )
        .map_err(fail)?;
        tx.commit().map_err(fail)?;
        Ok(found)
    }

    pub(crate) fn key_last_ms(&self, keys: &[&str]) -> Result<Vec<Option<i64>>, String> {
        let mut q = self
            .conn
            .prepare_cached("SELECT at_ms FROM meter_key_last WHERE key = ?1")
            .map_err(self.fail("read meter_key_last"))?;
        keys.iter()
            .map(|k| {
                q.query_row(params![k], |r| r.get(0))
                    .optional()
                    .map_err(self.fail("read meter_key_last"))
            })
            .collect()
    }

    pub fn set_flag(&mut self, key: &str, flag: &Flag) -> Result<bool, String> {
        let path = self.path.display().to_string();
        let fail = |e: rusqlite::Error| format!("--meter-file {path}: set the flag of key {key}: {e}");
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(fail)?;
        let cur: Option<String> = tx
            .query_row("SELECT flag FROM quota_flags WHERE key = ?1", params![key], |r| {
                r.get(0)
            })
            .optional()
            .map_err(fail)?;
        // As lua/meter_flag.lua: never set back a flag another consumer made from more.
        if let Some(cur) = cur.and_then(|j| serde_json::from_str::<Flag>(&j).ok())
            && cur.quota == flag.quota
            && (cur.resets_at_ms > flag.resets_at_ms
                || (cur.resets_at_ms == flag.resets_at_ms && cur.used > flag.used))
        {
            return Ok(false);
        }
        crate::sqlite::write_flag(&tx, key, flag).map_err(fail)?;
        tx.commit().map_err(fail)?;
        Ok(true)
    }

    pub(crate) fn drop_flags_except(&self, keep: &HashSet<&str>) -> Result<Vec<String>, String> {
        let all = crate::sqlite::read_flags(&self.conn).map_err(self.fail("read quota_flags"))?;
        let mut stale = Vec::new();
        for (key, _) in all {
            if !keep.contains(key.as_str()) {
                self.conn
                    .execute("DELETE FROM quota_flags WHERE key = ?1", params![key])
                    .map_err(self.fail("delete from quota_flags"))?;
                stale.push(key);
            }
        }
        Ok(stale)
    }

    fn usage_of(&self, period: &PeriodLabel, key: &str, admitted: u64) -> Result<Usage, String> {
        let (identities, unclean_ends): (i64, i64) = self
            .conn
            .query_row(
                "SELECT count(*), count(CASE WHEN i.state = 'unclean' THEN 1 END)
                 FROM meter_contributors c
                 LEFT JOIN meter_identities i ON i.gateway = c.gateway AND i.boot = c.boot
                 WHERE c.per = ?1 AND c.period = ?2 AND c.key = ?3",
                params![period.per.as_str(), period.label, key],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(self.fail("read meter_contributors"))?;
        Ok(Usage {
            admitted,
            identities: identities as u64,
            unclean_ends: unclean_ends as u64,
        })
    }

    pub fn usage(&self, period: &PeriodLabel, key: &str) -> Result<Usage, String> {
        let admitted: i64 = self
            .conn
            .query_row(
                "SELECT admitted FROM meter_usage WHERE per = ?1 AND period = ?2 AND key = ?3",
                params![period.per.as_str(), period.label, key],
                |r| r.get(0),
            )
            .optional()
            .map_err(self.fail("read meter_usage"))?
            .unwrap_or(0);
        self.usage_of(period, key, admitted as u64)
    }

    pub(crate) fn period_rows(&self, period: &PeriodLabel) -> Result<Vec<(String, Usage)>, String> {
        let rows: Vec<(String, i64)> = {
            let mut q = self
                .conn
                .prepare(
                    "SELECT key, admitted FROM meter_usage WHERE per = ?1 AND period = ?2 AND admitted > 0
                     ORDER BY key",
                )
                .map_err(self.fail("read meter_usage"))?;
            q.query_map(params![period.per.as_str(), period.label], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(self.fail("read meter_usage"))?
            .collect::<rusqlite::Result<_>>()
            .map_err(self.fail("read meter_usage"))?
        };
        rows.into_iter()
            .map(|(key, admitted)| {
                let u = self.usage_of(period, &key, admitted as u64)?;
                Ok((key, u))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Identity;

    fn rules() -> tollgate_rules::Snapshot {
        let text = r#"{
          "version": 1,
          "upstreams": { "u": { "url": "http://127.0.0.1:1" } },
          "limits": { "plan": { "dimension": "key" } },
          "keys": [
            { "id": "k-7", "sha256": "80eb978e9718fd80febfebcc532e51df464a198ba85d15a9b9b6fb31acc1b3bc",
              "limits": { "plan": { "rate": "1/1s", "burst": 1 } } }
          ],
          "routes": [ { "name": "r", "method": "*", "path": "/", "upstream": "u", "cost": { "plan": 1 } } ]
        }"#;
        tollgate_rules::compile(text.as_bytes(), "test.json", Default::default()).unwrap()
    }

    fn usage(id: &Identity, seq: u64, total: u64) -> Record {
        Record {
            identity: id.clone(),
            seq,
            kind: Kind::Usage {
                key: "k-7".into(),
                total,
            },
        }
    }

    #[test]
    fn totals_count_once_whatever_is_written_twice() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.db");
        let mut file = crate::sqlite::open(&path).unwrap();
        let gw = Identity::new("gw-1");
        let day = 1_764_547_200_000; // 2025-12-01T00:00:00Z
        crate::sqlite::append(&mut file, day, &[usage(&gw, 1, 10)]).unwrap();
        crate::sqlite::append(&mut file, day + 5_000, &[usage(&gw, 2, 25)]).unwrap();
        // The same total again, and an older one: nothing to add.
        crate::sqlite::append(&mut file, day + 5_000, &[usage(&gw, 2, 25), usage(&gw, 1, 10)]).unwrap();
        let mut ledger = SqliteLedger::open(&path).unwrap();
        let mut cal = Calendar::new(&rules());
        let r = ledger.pass(2, &mut cal).unwrap();
        assert_eq!((r.read, r.raised, r.added), (2, 2, 25));
        let r = ledger.pass(100, &mut cal).unwrap();
        assert_eq!((r.read, r.raised, r.repeats), (2, 0, 2));
        assert_eq!(ledger.pass(100, &mut cal).unwrap().read, 0);
        let day = PeriodLabel::day("2025-12-01", "--day").unwrap();
        let u = ledger.usage(&day, "k-7").unwrap();
        assert_eq!((u.admitted, u.identities, u.unclean_ends), (25, 1, 0));
        // Silent since its last record, never ended: reported once.
        let silent = ledger.take_silent(i64::MAX).unwrap();
        assert_eq!(silent, vec![(gw.clone(), 1_764_547_205_000)]);
        assert!(ledger.take_silent(i64::MAX).unwrap().is_empty());
        assert_eq!(ledger.usage(&day, "k-7").unwrap().unclean_ends, 1);
    }

    #[test]
    fn a_bad_row_is_named_and_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.db");
        let file = crate::sqlite::open(&path).unwrap();
        file.execute(
            "INSERT INTO usage_records (at_ms, gateway, boot, seq, kind, key, total) VALUES (1, 'g', 'b', 1, 'usage', 'k-7', 'lots')",
            [],
        )
        .unwrap();
        let mut ledger = SqliteLedger::open(&path).unwrap();
        let r = ledger.pass(10, &mut Calendar::new(&rules())).unwrap();
        assert_eq!(r.read, 1);
        assert_eq!(r.malformed.len(), 1);
        assert!(r.malformed[0].id.contains("row 1"), "{:?}", r.malformed);
        assert!(r.malformed[0].reason.contains("field total"), "{:?}", r.malformed);
        assert_eq!(ledger.pass(10, &mut Calendar::new(&rules())).unwrap().read, 0);
    }
}
