//! Managed keys in a SQLite file (`--keys-file`, `tollgate-keys.db` by default), for a
//! gateway without Redis: one table, each row a key's record and the generation of its last
//! write, the store's generation being the largest of them.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::error::KeysError;
use crate::record::KeyRecord;

/// The file a gateway uses when it is given none.
pub const DEFAULT_FILE: &str = "tollgate-keys.db";

/// Keys are never deleted, so the largest generation only grows: no counter row to keep.
/// `UNIQUE` gives `changes_since` its index and holds every write to a generation of its own.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS api_keys (
    id         TEXT    PRIMARY KEY,
    record     TEXT    NOT NULL,
    generation INTEGER NOT NULL UNIQUE
);
";

pub struct SqliteKeys {
    conn: Arc<Mutex<Connection>>,
    file: String,
}

impl SqliteKeys {
    /// Opens the keys file at `path`, creating it when missing; the error names the file.
    pub fn open(path: &Path) -> Result<SqliteKeys, KeysError> {
        let file = path.display().to_string();
        let fail = |reason: String| KeysError::File {
            file: file.clone(),
            reason,
        };
        let conn = Connection::open(path).map_err(|e| fail(format!("cannot open the keys file: {e}")))?;
        // Another process on the same file (a second gateway, an operator's sqlite3) holds
        // the lock for moments; waiting beats failing an admin call.
        conn.busy_timeout(Duration::from_secs(5))
            .map_err(|e| fail(e.to_string()))?;
        // WAL: gateways polling for changes never block the writer, nor it them.
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(|e| fail(format!("not a keys file Tollgate can use: {e}")))?;
        conn.execute_batch(SCHEMA)
            .map_err(|e| fail(format!("not a keys file Tollgate can use: {e}")))?;
        Ok(SqliteKeys {
            conn: Arc::new(Mutex::new(conn)),
            file,
        })
    }

    pub fn place(&self) -> &str {
        &self.file
    }

    /// Runs `f` on the connection off the runtime's threads: SQLite's calls block.
    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, KeysError> + Send + 'static,
    ) -> Result<T, KeysError> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = conn.lock().unwrap_or_else(PoisonError::into_inner);
            f(&mut c)
        })
        .await
        .map_err(|e| KeysError::File {
            file: self.file.clone(),
            reason: format!("the keys file's task failed: {e}"),
        })?
    }

    pub async fn insert_new(&self, rec: &KeyRecord) -> Result<bool, KeysError> {
        let (id, json, file) = (rec.id.clone(), rec.to_json(), self.file.clone());
        self.with(move |c| write(c, &id, &json, false).map_err(|e| failed(&file, "writing", e)))
            .await
    }

    pub async fn put(&self, rec: &KeyRecord) -> Result<(), KeysError> {
        let (id, json, file) = (rec.id.clone(), rec.to_json(), self.file.clone());
        self.with(move |c| {
            write(c, &id, &json, true)
                .map(|_| ())
                .map_err(|e| failed(&file, "writing", e))
        })
        .await
    }

    pub async fn get(&self, id: &str) -> Result<Option<KeyRecord>, KeysError> {
        let (id, file) = (id.to_string(), self.file.clone());
        self.with(move |c| {
            let json: Option<String> = c
                .query_row("SELECT record FROM api_keys WHERE id = ?1", [&id], |r| r.get(0))
                .optional()
                .map_err(|e| failed(&file, "reading", e))?;
            json.map(|j| read(&file, &id, &j)).transpose()
        })
        .await
    }

    pub async fn load_all(&self) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        self.since(None).await
    }

    pub async fn changes_since(&self, since: u64) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        self.since(Some(since)).await
    }

    /// The generation and the rows after `since` (all rows for `None`), read in one
    /// transaction so they agree.
    async fn since(&self, since: Option<u64>) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        let file = self.file.clone();
        self.with(move |c| {
            let rows = (|| {
                let tx = c.transaction()?;
                let generation: i64 =
                    tx.query_row("SELECT COALESCE(MAX(generation), 0) FROM api_keys", [], |r| {
                        r.get(0)
                    })?;
                let after = since.map_or(0, |g| i64::try_from(g).unwrap_or(i64::MAX));
                let rows = tx
                    .prepare_cached(
                        "SELECT id, record FROM api_keys WHERE generation > ?1 ORDER BY generation",
                    )?
                    .query_map([after], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                tx.finish()?;
                Ok((generation.max(0) as u64, rows))
            })()
            .map_err(|e| failed(&file, "reading", e))?;
            let (generation, rows) = rows;
            let records = rows
                .iter()
                .map(|(id, json)| read(&file, id, json))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((generation, records))
        })
        .await
    }
}

/// One write at the next generation. `IMMEDIATE` takes the write lock before the generation
/// is read, so two processes on the file can't both take the same one.
fn write(c: &mut Connection, id: &str, json: &str, overwrite: bool) -> rusqlite::Result<bool> {
    let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let next: i64 = tx.query_row("SELECT COALESCE(MAX(generation), 0) + 1 FROM api_keys", [], |r| {
        r.get(0)
    })?;
    let sql = if overwrite {
        "INSERT INTO api_keys (id, record, generation) VALUES (?1, ?2, ?3)
         ON CONFLICT(id) DO UPDATE SET record = excluded.record, generation = excluded.generation"
    } else {
        "INSERT INTO api_keys (id, record, generation) VALUES (?1, ?2, ?3) ON CONFLICT(id) DO NOTHING"
    };
    let written = tx.execute(sql, params![id, json, next])? == 1;
    tx.commit()?;
    Ok(written)
}

fn read(file: &str, id: &str, json: &str) -> Result<KeyRecord, KeysError> {
    let unreadable = |reason: String| KeysError::Unreadable {
        place: file.to_string(),
        id: id.to_string(),
        reason,
    };
    let rec = KeyRecord::from_json(json).map_err(unreadable)?;
    if rec.id != id {
        return Err(unreadable(format!("its record names another id, {:?}", rec.id)));
    }
    Ok(rec)
}

fn failed(file: &str, what: &str, e: rusqlite::Error) -> KeysError {
    KeysError::File {
        file: file.to_string(),
        reason: format!("{what} the keys: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change::{Create, create, revoke};
    use crate::store::KeyStore;

    fn key(id: &str) -> KeyRecord {
        let now: jiff::Timestamp = "2026-03-01T12:00:00Z".parse().unwrap();
        let body = format!(r#"{{"id": "{id}", "tenant": "acme"}}"#);
        create(Create::parse(body.as_bytes(), now).unwrap(), now).0
    }

    #[tokio::test]
    async fn keys_and_generations_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DEFAULT_FILE);
        let (a, b) = (key("k-a"), key("k-b"));
        {
            let s = KeyStore::Sqlite(SqliteKeys::open(&path).unwrap());
            assert_eq!(s.load_all().await.unwrap(), (0, vec![]));
            assert!(s.insert_new(&a).await.unwrap());
            assert!(s.insert_new(&b).await.unwrap());
            assert!(!s.insert_new(&key("k-a")).await.unwrap(), "the id is taken");
            assert_eq!(s.get("k-a").await.unwrap().as_ref(), Some(&a));
        }
        let s = KeyStore::Sqlite(SqliteKeys::open(&path).unwrap());
        let (g, all) = s.load_all().await.unwrap();
        assert_eq!((g, all), (2, vec![a.clone(), b.clone()]));
        let revoked = revoke(&a, "2026-03-02T00:00:00Z".parse().unwrap());
        s.put(&revoked).await.unwrap();
        assert_eq!(s.changes_since(2).await.unwrap(), (3, vec![revoked.clone()]));
        assert_eq!(s.changes_since(3).await.unwrap(), (3, vec![]));
        assert_eq!(s.changes_since(0).await.unwrap(), (3, vec![b, revoked.clone()]));
        assert_eq!(s.get("k-a").await.unwrap(), Some(revoked));
        assert_eq!(s.get("k-none").await.unwrap(), None);
    }

    #[tokio::test]
    async fn two_handles_on_one_file_see_each_others_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.db");
        let one = SqliteKeys::open(&path).unwrap();
        let two = SqliteKeys::open(&path).unwrap();
        one.insert_new(&key("k-1")).await.unwrap();
        two.insert_new(&key("k-2")).await.unwrap();
        let (g, seen) = one.changes_since(1).await.unwrap();
        assert_eq!(g, 2);
        assert_eq!(seen.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["k-2"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_processes_writing_at_once_each_take_a_generation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.db");
        let mut writers = Vec::new();
        for w in 0..2 {
            let s = SqliteKeys::open(&path).unwrap();
            writers.push(tokio::spawn(async move {
                for n in 0..50 {
                    assert!(s.insert_new(&key(&format!("k-{w}-{n}"))).await.unwrap());
                }
            }));
        }
        for w in writers {
            w.await.unwrap();
        }
        let s = SqliteKeys::open(&path).unwrap();
        let (g, all) = s.load_all().await.unwrap();
        assert_eq!((g, all.len()), (100, 100));
        assert_eq!(s.changes_since(90).await.unwrap().1.len(), 10);
    }

    #[tokio::test]
    async fn a_file_that_is_not_sqlite_or_a_bad_record_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.db");
        std::fs::write(
            &junk,
            b"this is not a database, just text long enough to be read as one....",
        )
        .unwrap();
        let e = SqliteKeys::open(&junk).err().unwrap();
        assert!(e.to_string().contains("junk.db"), "{e}");

        let path = dir.path().join("keys.db");
        let s = SqliteKeys::open(&path).unwrap();
        s.insert_new(&key("k-1")).await.unwrap();
        {
            let c = s.conn.lock().unwrap();
            c.execute("UPDATE api_keys SET record = '{\"id\": 7}' WHERE id = 'k-1'", [])
                .unwrap();
        }
        let e = s.load_all().await.unwrap_err();
        let text = e.to_string();
        assert!(text.contains("keys.db") && text.contains("\"k-1\""), "{text}");
        assert!(matches!(e, KeysError::Unreadable { .. }), "{e:?}");
    }
}
