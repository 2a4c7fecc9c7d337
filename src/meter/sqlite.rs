//! The embedded store's metering file: the records a gateway on `--store memory` writes, and
//! the flags the consumer sets, in one SQLite file, so one gateway's usage survives restarts.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, params};

use crate::flags::Flag;
use crate::record::{Kind, Record};

/// The tables both sides use. The consumer keeps its own state in tables it creates.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS usage_records (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms   INTEGER NOT NULL,
    gateway TEXT    NOT NULL,
    boot    TEXT    NOT NULL,
    seq     INTEGER NOT NULL,
    kind    TEXT    NOT NULL,
    key     TEXT,
    total   INTEGER
);
CREATE TABLE IF NOT EXISTS quota_flags (
    key  TEXT PRIMARY KEY,
    flag TEXT NOT NULL
);
";

/// Opens (creating when missing) the metering file at `path`; the error names the file.
pub fn open(path: &Path) -> Result<Connection, String> {
    let name = path.display();
    let conn = Connection::open(path).map_err(|e| format!("{name}: cannot open the metering file: {e}"))?;
    conn.busy_timeout(Duration::from_secs(5))
        .map_err(|e| format!("{name}: {e}"))?;
    // WAL lets the consumer read while a gateway writes.
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(|e| format!("{name}: {e}"))?;
    conn.execute_batch(SCHEMA)
        .map_err(|e| format!("{name}: not a metering file Tollgate can use: {e}"))?;
    Ok(conn)
}

/// Appends records, all or none, stamped `at_ms`.
pub fn append(conn: &mut Connection, at_ms: i64, records: &[Record]) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO usage_records (at_ms, gateway, boot, seq, kind, key, total) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?;
        for r in records {
            let (kind, key, total) = match &r.kind {
                Kind::Usage { key, total } => ("usage", Some(key.as_str()), Some(*total as i64)),
                Kind::End => ("end", None, None),
            };
            insert.execute(params![
                at_ms,
                r.identity.gateway,
                r.identity.boot,
                r.seq as i64,
                kind,
                key,
                total
            ])?;
        }
    }
    tx.commit()
}

/// Every record in the order written, with its `at_ms`.
pub fn read_records(conn: &Connection) -> rusqlite::Result<Vec<(i64, Record)>> {
    let mut q = conn.prepare_cached(
        "SELECT at_ms, gateway, boot, seq, kind, key, total FROM usage_records ORDER BY id",
    )?;
    let rows = q.query_map([], |r| {
        let identity = crate::record::Identity {
            gateway: r.get(1)?,
            boot: r.get(2)?,
        };
        let kind: String = r.get(4)?;
        let kind = match (
            kind.as_str(),
            r.get::<_, Option<String>>(5)?,
            r.get::<_, Option<i64>>(6)?,
        ) {
            ("usage", Some(key), Some(total)) => Kind::Usage {
                key,
                total: total as u64,
            },
            _ => Kind::End,
        };
        Ok((
            r.get(0)?,
            Record {
                identity,
                seq: r.get::<_, i64>(3)? as u64,
                kind,
            },
        ))
    })?;
    rows.collect()
}

/// Every flag as stored: key id → JSON.
pub fn read_flags(conn: &Connection) -> rusqlite::Result<Vec<(String, String)>> {
    let mut q = conn.prepare_cached("SELECT key, flag FROM quota_flags")?;
    let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    rows.collect()
}

/// Sets one key's flag.
pub fn write_flag(conn: &Connection, key: &str, flag: &Flag) -> rusqlite::Result<()> {
    let json = serde_json::to_string(flag).expect("a flag serializes");
    conn.execute(
        "INSERT INTO quota_flags (key, flag) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET flag = excluded.flag",
        params![key, json],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Identity;

    #[test]
    fn records_and_flags_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.db");
        let id = Identity::new("gw");
        {
            let mut c = open(&path).unwrap();
            let recs = [
                Record {
                    identity: id.clone(),
                    seq: 1,
                    kind: Kind::Usage {
                        key: "k-7".into(),
                        total: 5,
                    },
                },
                Record {
                    identity: id.clone(),
                    seq: 2,
                    kind: Kind::End,
                },
            ];
            append(&mut c, 1_000, &recs).unwrap();
        }
        let c = open(&path).unwrap();
        let n: i64 = c
            .query_row(
                "SELECT COUNT(*) FROM usage_records WHERE boot = ?1",
                [&id.boot],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, 2);
        assert!(read_flags(&c).unwrap().is_empty());
    }

    #[test]
    fn a_file_that_is_not_sqlite_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("junk.db");
        std::fs::write(
            &path,
            b"this is not a database, just text long enough to be read as one....",
        )
        .unwrap();
        let e = open(&path).unwrap_err();
        assert!(e.contains("junk.db"), "{e}");
    }
}
