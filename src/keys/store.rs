//! Where managed keys are kept: one interface over the SQLite file of a single gateway and
//! the Redis store a fleet shares.
//!
//! Every write takes the next *generation* of the store, a counter that only grows; each
//! record is kept with the generation of its last write. A gateway loads everything once
//! ([`KeyStore::load_all`]) and then asks, every so often, for what changed since the
//! generation it holds ([`KeyStore::changes_since`]). A record may come back twice (written
//! while it was being read); applying a record is replacing the key by its id, so that does
//! no harm. Keys are never deleted, only revoked, so the changes are all there is to follow.

use crate::error::KeysError;
use crate::record::KeyRecord;
use crate::redis::RedisKeys;
use crate::sqlite::SqliteKeys;

/// The store of managed keys the gateway was started with.
pub enum KeyStore {
    Sqlite(SqliteKeys),
    Redis(RedisKeys),
}

impl KeyStore {
    /// Where the keys are, for logs: the file, or the Redis server.
    pub fn place(&self) -> &str {
        match self {
            KeyStore::Sqlite(s) => s.place(),
            KeyStore::Redis(r) => r.place(),
        }
    }

    /// Writes a new key; `false` (and nothing written) when its id is taken.
    pub async fn insert_new(&self, rec: &KeyRecord) -> Result<bool, KeysError> {
        match self {
            KeyStore::Sqlite(s) => s.insert_new(rec).await,
            KeyStore::Redis(r) => r.insert_new(rec).await,
        }
    }

    /// Writes a key over what is stored under its id: a rotation, revocation or patch of a
    /// record read with [`KeyStore::get`].
    pub async fn put(&self, rec: &KeyRecord) -> Result<(), KeysError> {
        match self {
            KeyStore::Sqlite(s) => s.put(rec).await,
            KeyStore::Redis(r) => r.put(rec).await,
        }
    }

    pub async fn get(&self, id: &str) -> Result<Option<KeyRecord>, KeysError> {
        match self {
            KeyStore::Sqlite(s) => s.get(id).await,
            KeyStore::Redis(r) => r.get(id).await,
        }
    }

    /// Every key, with the generation they are at least as new as.
    pub async fn load_all(&self) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        match self {
            KeyStore::Sqlite(s) => s.load_all().await,
            KeyStore::Redis(r) => r.load_all().await,
        }
    }

    /// The keys written after generation `since`, and the generation to ask from next time.
    /// A generation below `since` means the store was emptied or replaced (a Redis without
    /// persistence restarted, another file): call [`KeyStore::load_all`] again. One emptied
    /// and written past `since` before this is asked can't be told apart, so a gateway should
    /// also load everything now and then, minutes apart.
    pub async fn changes_since(&self, since: u64) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        match self {
            KeyStore::Sqlite(s) => s.changes_since(since).await,
            KeyStore::Redis(r) => r.changes_since(since).await,
        }
    }
}
