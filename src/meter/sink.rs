//! Where a gateway's usage records go and where its quota flags come from: the Redis stream
//! and hash, or the SQLite file of the embedded store.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use fred::clients::Client;
use fred::interfaces::{ClientLike, HashesInterface, StreamsInterface, TransactionInterface};

use crate::counter::{BoxFuture, Sink};
use crate::flags::FLAGS;
use crate::record::{Record, STREAM};

// The trait lives with the flags it reads; named here too, where the gateway has always
// found it beside the two sources.
pub use crate::flags::FlagSource;

/// Appends to `tollgate:usage` with `XADD` in one `MULTI`, so a flush lands whole.
pub struct RedisSink {
    client: Client,
}

impl RedisSink {
    /// Connects in the background: a store that is down now delays records, and every flush
    /// retries with the newest totals.
    pub fn start(client: Client) -> RedisSink {
        let _task = client.connect();
        RedisSink { client }
    }
}

impl FlagSource for RedisSink {
    fn read_flags(&self) -> BoxFuture<'_, Result<Vec<(String, String)>, String>> {
        Box::pin(async move {
            let all: std::collections::HashMap<String, String> = self
                .client
                .hgetall(FLAGS)
                .await
                .map_err(|e| e.details().to_string())?;
            Ok(all.into_iter().collect())
        })
    }
}

impl Sink for RedisSink {
    fn append<'a>(&'a self, records: &'a [Record]) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let tx = self.client.multi();
            for r in records {
                let fields: Vec<(&str, String)> = r.fields();
                tx.xadd::<(), _, _, _, _>(STREAM, false, None::<()>, "*", fields)
                    .await
                    .map_err(|e| e.details().to_string())?;
            }
            tx.exec::<()>(true).await.map_err(|e| e.details().to_string())
        })
    }
}

/// Appends to the metering file; SQLite's calls block, so they run off the runtime's threads.
pub struct SqliteSink {
    conn: Arc<Mutex<rusqlite::Connection>>,
}

impl SqliteSink {
    pub fn open(path: &Path) -> Result<SqliteSink, String> {
        Ok(SqliteSink {
            conn: Arc::new(Mutex::new(crate::sqlite::open(path)?)),
        })
    }
}

impl FlagSource for SqliteSink {
    fn read_flags(&self) -> BoxFuture<'_, Result<Vec<(String, String)>, String>> {
        let conn = self.conn.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let c = conn.lock().unwrap_or_else(PoisonError::into_inner);
                crate::sqlite::read_flags(&c).map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())?
        })
    }
}

impl Sink for SqliteSink {
    fn append<'a>(&'a self, records: &'a [Record]) -> BoxFuture<'a, Result<(), String>> {
        let conn = self.conn.clone();
        let records = records.to_vec();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let at_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64);
                let mut c = conn.lock().unwrap_or_else(PoisonError::into_inner);
                crate::sqlite::append(&mut c, at_ms, &records).map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())?
        })
    }
}
