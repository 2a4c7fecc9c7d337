//! The consumer's ledger: what it keeps from the records it adds up (the largest total per
//! identity and key, admitted per key and calendar period, who contributed, which identities
//! ended and how), and where: in Redis beside the stream ([`crate::ledger_redis`]) or in the
//! embedded store's SQLite file ([`crate::ledger_sqlite`]). Both follow the same rules; this
//! module opens one or the other and hands each question to it. What the two share, reading a
//! record into its key's calendar and the answers the commands get, is in
//! [`crate::ledger_types`].

use std::collections::HashSet;

use crate::flags::Flag;
use crate::ledger_redis::RedisLedger;
use crate::ledger_sqlite::SqliteLedger;
use crate::ledger_types::{Calendar, PassReport, PeriodLabel, Role, Usage};
use crate::record::Identity;

/// Where the ledger is.
#[derive(Debug, Clone)]
pub enum Place {
    /// `--store redis://HOST:PORT` (or a cluster's, or over TLS), reached with the
    /// `--store-*` flags' TLS and credentials.
    Redis {
        url: String,
        access: tollgate_access::Access,
    },
    /// `--meter-file PATH`.
    File(std::path::PathBuf),
}

/// The ledger, in Redis or in the metering file.
pub enum Ledger {
    Redis(Box<RedisLedger>),
    Sqlite(SqliteLedger),
}

impl Ledger {
    pub async fn open(place: &Place, role: Role) -> Result<Ledger, String> {
        match place {
            Place::Redis { url, access } => Ok(Ledger::Redis(Box::new(
                RedisLedger::connect(url, access, role).await?,
            ))),
            Place::File(path) => Ok(Ledger::Sqlite(SqliteLedger::open(path)?)),
        }
    }

    /// The ledger's clock: the store's `TIME`, or this machine's for the file.
    pub async fn now_ms(&self) -> Result<i64, String> {
        match self {
            Ledger::Redis(r) => r.now_ms().await,
            Ledger::Sqlite(_) => Ok(crate::ledger_sqlite::wall_ms()),
        }
    }

    /// Takes up to `max` new records, adds them up and marks them done.
    pub async fn pass(&mut self, max: usize, cal: &mut Calendar) -> Result<PassReport, String> {
        match self {
            Ledger::Redis(r) => r.pass(max, cal).await,
            Ledger::Sqlite(s) => s.pass(max, cal),
        }
    }

    /// The time of the oldest record not yet added up, if any.
    pub(crate) async fn oldest_pending_ms(&self) -> Result<Option<i64>, String> {
        match self {
            Ledger::Redis(r) => r.oldest_pending_ms().await,
            Ledger::Sqlite(s) => s.oldest_pending_ms(),
        }
    }

    /// Reports, once, every live identity whose newest record is older than `before_ms`: it
    /// ended without an `end` record. Returns them with their newest time.
    pub(crate) async fn take_silent(&mut self, before_ms: i64) -> Result<Vec<(Identity, i64)>, String> {
        match self {
            Ledger::Redis(r) => r.take_silent(before_ms).await,
            Ledger::Sqlite(s) => s.take_silent(before_ms),
        }
    }

    /// The time of each key's newest record.
    pub(crate) async fn key_last_ms(&self, keys: &[&str]) -> Result<Vec<Option<i64>>, String> {
        match self {
            Ledger::Redis(r) => r.key_last_ms(keys).await,
            Ledger::Sqlite(s) => s.key_last_ms(keys),
        }
    }

    /// Sets a key's flag unless a newer one is there; whether it was written.
    pub async fn set_flag(&mut self, key: &str, flag: &Flag) -> Result<bool, String> {
        match self {
            Ledger::Redis(r) => r.set_flag(key, flag).await,
            Ledger::Sqlite(s) => s.set_flag(key, flag),
        }
    }

    /// Removes the flags of keys not in `keep` (keys whose quota is gone): a stale `over` must
    /// not block a key that no longer has a quota. Returns the keys removed.
    pub(crate) async fn drop_flags_except(&self, keep: &HashSet<&str>) -> Result<Vec<String>, String> {
        match self {
            Ledger::Redis(r) => r.drop_flags_except(keep).await,
            Ledger::Sqlite(s) => s.drop_flags_except(keep),
        }
    }

    pub async fn usage(&self, period: &PeriodLabel, key: &str) -> Result<Usage, String> {
        match self {
            Ledger::Redis(r) => r.usage(period, key).await,
            Ledger::Sqlite(s) => s.usage(period, key),
        }
    }

    /// Every key with usage in the period, sorted by key.
    pub(crate) async fn period_rows(&self, period: &PeriodLabel) -> Result<Vec<(String, Usage)>, String> {
        match self {
            Ledger::Redis(r) => r.period_rows(period).await,
            Ledger::Sqlite(s) => s.period_rows(period),
        }
    }

    /// Leaves the consumer group when nothing is left pending for this consumer.
    pub async fn close(self) {
        if let Ledger::Redis(r) = self {
            r.close().await;
        }
    }
}
