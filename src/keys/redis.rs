//! Managed keys in Redis, shared by every gateway on one node: records in the hash
//! `tollgate:keys` (id → JSON), the generation in `tollgate:keys:gen`, and the sorted set
//! `tollgate:keys:changes` (id, scored by the generation of its last write). Every write is
//! one call of `lua/keys_put.lua`, so the record, the generation and the change land together.
//!
//! The three keys lie in different hash slots, so this needs one node, as the meter does.

use std::collections::HashMap;

use fred::prelude::{Client, ClientLike, Error as FredError, Value};
use fred::types::config::ServerConfig;
use fred::types::{ClusterHash, CustomCommand};

use crate::error::KeysError;
use crate::record::KeyRecord;

/// The hash of records: field = key id, value = [`KeyRecord::to_json`].
pub const KEYS: &str = "tollgate:keys";
/// The store's generation: the number of writes ever made.
pub const GEN: &str = "tollgate:keys:gen";
/// Each key id, scored by the generation of its last write.
pub const CHANGES: &str = "tollgate:keys:changes";

const PUT_SCRIPT: &str = include_str!("../../lua/keys_put.lua");

/// Where the keys live in one store. On one node, the names above, as earlier releases kept
/// them; on a cluster, the same under one hash tag, so the write script's three keys share a
/// slot.
#[derive(Debug, Clone, Copy)]
struct Names {
    keys: &'static str,
    generation: &'static str,
    changes: &'static str,
}

const ON_A_NODE: Names = Names {
    keys: KEYS,
    generation: GEN,
    changes: CHANGES,
};

const ON_A_CLUSTER: Names = Names {
    keys: "tollgate:{keys}",
    generation: "tollgate:{keys}:gen",
    changes: "tollgate:{keys}:changes",
};

pub struct RedisKeys {
    client: Client,
    server: String,
    put_sha: String,
    names: Names,
}

fn command(name: &'static str) -> CustomCommand {
    CustomCommand::new_static(name, ClusterHash::FirstKey, false)
}

/// `EVALSHA sha 3 KEY…` or `EVAL script 3 KEY…`: routed by its first key, the third word.
fn script_command(name: &'static str) -> CustomCommand {
    CustomCommand::new_static(name, ClusterHash::Offset(2), false)
}

impl RedisKeys {
    /// Uses `client` as it is: the gateway connects it (and keeps it connected) as it does
    /// its other Redis clients.
    pub fn new(client: Client) -> RedisKeys {
        let (server, names) = match &client.client_config().server {
            ServerConfig::Centralized { server } => {
                (format!("redis://{}:{}", server.host, server.port), ON_A_NODE)
            }
            ServerConfig::Clustered { hosts, .. } => {
                let hosts: Vec<String> = hosts.iter().map(|h| format!("{}:{}", h.host, h.port)).collect();
                (format!("redis-cluster://{}", hosts.join(",")), ON_A_CLUSTER)
            }
            other => (format!("{other:?}"), ON_A_NODE),
        };
        RedisKeys {
            client,
            server,
            put_sha: fred::util::sha1_hash(PUT_SCRIPT),
            names,
        }
    }

    pub fn place(&self) -> &str {
        &self.server
    }

    fn fail(&self, what: &str, reason: impl Into<String>) -> KeysError {
        KeysError::Redis {
            server: self.server.clone(),
            what: what.to_string(),
            reason: reason.into(),
        }
    }

    async fn call(&self, name: &'static str, args: Vec<Value>) -> Result<Value, KeysError> {
        self.client
            .custom::<Value, Value>(command(name), args)
            .await
            .map_err(|e| self.fail(name, e.details()))
    }

    /// One call of `lua/keys_put.lua`: the write's generation, or `None` when `mode` is
    /// `new` and the id is taken. A store that lost the script (a restart, SCRIPT FLUSH) is
    /// sent it whole, which loads it again.
    async fn write(&self, rec: &KeyRecord, mode: &'static str) -> Result<Option<u64>, KeysError> {
        let tail: [Value; 6] = [
            self.names.keys.into(),
            self.names.generation.into(),
            self.names.changes.into(),
            rec.id.as_str().into(),
            rec.to_json().into(),
            mode.into(),
        ];
        let mut args: Vec<Value> = vec![self.put_sha.as_str().into(), 3.into()];
        args.extend(tail.iter().cloned());
        let reply = match self
            .client
            .custom::<Value, Value>(script_command("EVALSHA"), args)
            .await
        {
            Err(e) if is_noscript(&e) => {
                let mut args: Vec<Value> = vec![PUT_SCRIPT.into(), 3.into()];
                args.extend(tail);
                self.client
                    .custom::<Value, Value>(script_command("EVAL"), args)
                    .await
                    .map_err(|e| self.fail("EVAL", e.details()))?
            }
            other => other.map_err(|e| self.fail("lua/keys_put.lua", e.details()))?,
        };
        match reply.as_i64() {
            Some(0) => Ok(None),
            Some(g) if g > 0 => Ok(Some(g as u64)),
            _ => Err(self.fail("lua/keys_put.lua", format!("answered {reply:?}"))),
        }
    }

    pub async fn insert_new(&self, rec: &KeyRecord) -> Result<bool, KeysError> {
        Ok(self.write(rec, "new").await?.is_some())
    }

    pub async fn put(&self, rec: &KeyRecord) -> Result<(), KeysError> {
        match self.write(rec, "put").await? {
            Some(_) => Ok(()),
            None => Err(self.fail("lua/keys_put.lua", "refused an overwrite")),
        }
    }

    pub async fn get(&self, id: &str) -> Result<Option<KeyRecord>, KeysError> {
        let v = self.call("HGET", vec![self.names.keys.into(), id.into()]).await?;
        match text(v) {
            Ok(None) => Ok(None),
            Ok(Some(json)) => self.read(id, &json).map(Some),
            Err(v) => Err(self.fail("HGET", format!("answered {v:?} for key {id:?}"))),
        }
    }

    /// The generation first, then the records: a write between the two is in the records and
    /// after the generation, so it comes again from `changes_since`; none is missed.
    pub async fn load_all(&self) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        let generation = self.generation().await?;
        let all = self.call("HGETALL", vec![self.names.keys.into()]).await?;
        let pairs: HashMap<String, String> = all.convert().map_err(|e| self.fail("HGETALL", e.details()))?;
        let mut ids: Vec<&String> = pairs.keys().collect();
        ids.sort();
        let records = ids
            .into_iter()
            .map(|id| self.read(id, &pairs[id]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((generation, records))
    }

    /// The generation first, for the same reason as in `load_all`; then the ids written
    /// after `since` and their records.
    pub async fn changes_since(&self, since: u64) -> Result<(u64, Vec<KeyRecord>), KeysError> {
        let generation = self.generation().await?;
        if generation <= since {
            return Ok((generation, Vec::new()));
        }
        let ids = self
            .call(
                "ZRANGEBYSCORE",
                vec![
                    self.names.changes.into(),
                    format!("({since}").into(),
                    "+inf".into(),
                ],
            )
            .await?;
        let ids: Vec<String> = ids
            .convert()
            .map_err(|e| self.fail("ZRANGEBYSCORE", e.details()))?;
        if ids.is_empty() {
            return Ok((generation, Vec::new()));
        }
        let mut args: Vec<Value> = vec![self.names.keys.into()];
        args.extend(ids.iter().map(|id| Value::from(id.as_str())));
        let found = self.call("HMGET", args).await?.into_array();
        let mut records = Vec::with_capacity(ids.len());
        for (id, v) in ids.iter().zip(found) {
            match text(v) {
                Ok(Some(json)) => records.push(self.read(id, &json)?),
                // In the change log but not the hash: removed by hand. Nothing to apply.
                Ok(None) => {}
                Err(v) => return Err(self.fail("HMGET", format!("answered {v:?} for key {id:?}"))),
            }
        }
        Ok((generation, records))
    }

    async fn generation(&self) -> Result<u64, KeysError> {
        let generation = self.names.generation;
        let v = self.call("GET", vec![generation.into()]).await?;
        if v.is_null() {
            return Ok(0);
        }
        v.as_u64()
            .ok_or_else(|| self.fail("GET", format!("{generation} holds {v:?}, not a generation")))
    }

    fn read(&self, id: &str, json: &str) -> Result<KeyRecord, KeysError> {
        let unreadable = |reason: String| KeysError::Unreadable {
            place: format!("Redis store {} ({})", self.server, self.names.keys),
            id: id.to_string(),
            reason,
        };
        let rec = KeyRecord::from_json(json).map_err(unreadable)?;
        if rec.id != id {
            return Err(unreadable(format!("its record names another id, {:?}", rec.id)));
        }
        Ok(rec)
    }
}

fn is_noscript(e: &FredError) -> bool {
    e.details().starts_with("NOSCRIPT")
}

/// A bulk string as text, `None` for nil; anything else handed back for the error.
fn text(v: Value) -> Result<Option<String>, Value> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.to_string())),
        Value::Bytes(b) => String::from_utf8(b.to_vec())
            .map(Some)
            .map_err(|e| Value::Bytes(e.into_bytes().into())),
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use fred::prelude::{Builder, Config};
    use tollgate_testkit::Redis;

    use super::*;
    use crate::change::{Create, create, revoke};
    use crate::store::KeyStore;

    /// A redis-server of our own; none on this machine fails the test, since a skipped test
    /// would pass while nothing was tested.
    async fn server() -> (tempfile::TempDir, Redis) {
        let dir = tempfile::tempdir().unwrap();
        let redis = Redis::start(dir.path())
            .await
            .unwrap_or_else(|e| panic!("these tests need a redis-server: {e}"));
        (dir, redis)
    }

    async fn store(redis: &Redis) -> RedisKeys {
        let client = Builder::from_config(Config::from_url_centralized(&redis.url()).unwrap())
            .build()
            .unwrap();
        client.init().await.unwrap();
        RedisKeys::new(client)
    }

    fn key(id: &str) -> KeyRecord {
        let now: jiff::Timestamp = "2026-03-01T12:00:00Z".parse().unwrap();
        let body = format!(r#"{{"id": "{id}", "tenant": "acme"}}"#);
        create(Create::parse(body.as_bytes(), now).unwrap(), now).0
    }

    async fn raw(s: &RedisKeys, name: &'static str, args: Vec<Value>) -> Value {
        s.client
            .custom::<Value, Value>(command(name), args)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn one_gateways_write_reaches_the_others_changes() {
        let (_dir, redis) = server().await;
        let (one, two) = (
            KeyStore::Redis(store(&redis).await),
            KeyStore::Redis(store(&redis).await),
        );
        assert_eq!(one.load_all().await.unwrap(), (0, vec![]));
        assert!(one.place().starts_with("redis://127.0.0.1:"), "{}", one.place());

        let k = key("k-1");
        assert!(one.insert_new(&k).await.unwrap());
        assert_eq!(two.changes_since(0).await.unwrap(), (1, vec![k.clone()]));
        assert!(!two.insert_new(&key("k-1")).await.unwrap(), "the id is taken");
        assert_eq!(
            two.get("k-1").await.unwrap().as_ref(),
            Some(&k),
            "and kept as it was"
        );
        assert_eq!(
            two.changes_since(1).await.unwrap(),
            (1, vec![]),
            "a refused write is no change"
        );

        let revoked = revoke(&k, "2026-03-02T00:00:00Z".parse().unwrap());
        two.put(&revoked).await.unwrap();
        assert_eq!(one.changes_since(1).await.unwrap(), (2, vec![revoked.clone()]));
        assert_eq!(one.get("k-1").await.unwrap(), Some(revoked.clone()));
        assert_eq!(one.get("k-2").await.unwrap(), None);
        assert!(one.insert_new(&key("k-2")).await.unwrap());
        let (g, all) = two.load_all().await.unwrap();
        assert_eq!(g, 3);
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["k-1", "k-2"]
        );
        assert!(all[0].revoked);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_each_get_a_generation_and_a_follower_misses_none() {
        const EACH: usize = 200;
        let (_dir, redis) = server().await;
        let follower = store(&redis).await;
        let mut writers = Vec::new();
        for w in 0..2 {
            let s = store(&redis).await;
            writers.push(tokio::spawn(async move {
                for n in 0..EACH {
                    let k = key(&format!("k-{w}-{n}"));
                    assert!(s.insert_new(&k).await.unwrap());
                    // Written over once in a while, as a rotation would.
                    if n % 10 == 0 {
                        s.put(&k).await.unwrap();
                    }
                }
            }));
        }
        let follow = tokio::spawn(async move {
            // What a gateway holds: each key by id, and the generation to ask from next.
            let mut held = std::collections::BTreeMap::new();
            let mut generation = 0;
            let mut polls = 0;
            while held.len() < 2 * EACH {
                let (g, changed) = follower.changes_since(generation).await.unwrap();
                for k in changed {
                    held.insert(k.id.clone(), k);
                }
                generation = generation.max(g);
                polls += 1;
                assert!(
                    polls < 100_000,
                    "the follower never caught up: {} keys",
                    held.len()
                );
            }
            held
        });
        for w in writers {
            w.await.unwrap();
        }
        let ring = follow.await.unwrap();
        let writes = 2 * EACH + 2 * EACH / 10;
        let s = store(&redis).await;
        assert_eq!(s.generation().await.unwrap(), writes as u64);
        assert_eq!(ring.len(), 2 * EACH);

        // The change log holds each id once, at the generation of its last write; no two
        // writes shared one.
        let scored = raw(
            &s,
            "ZRANGE",
            vec![CHANGES.into(), 0.into(), (-1).into(), "WITHSCORES".into()],
        )
        .await
        .into_array();
        let scores: BTreeSet<u64> = scored
            .chunks(2)
            .map(|p| p[1].as_string().unwrap().parse::<u64>().unwrap())
            .collect();
        assert_eq!(scores.len(), 2 * EACH);
        assert!(scores.iter().all(|&g| (1..=writes as u64).contains(&g)));
        let (g, all) = s.changes_since(0).await.unwrap();
        assert_eq!((g, all.len()), (writes as u64, 2 * EACH));
        let (_, late) = s.changes_since(writes as u64 - 10).await.unwrap();
        assert_eq!(late.len(), 10);
    }

    #[tokio::test]
    async fn a_store_that_lost_the_script_is_sent_it_again() {
        let (_dir, redis) = server().await;
        let s = store(&redis).await;
        assert!(s.insert_new(&key("k-1")).await.unwrap());
        raw(&s, "SCRIPT", vec!["FLUSH".into()]).await;
        assert!(s.insert_new(&key("k-2")).await.unwrap());
        let exists = raw(&s, "SCRIPT", vec!["EXISTS".into(), s.put_sha.as_str().into()]).await;
        assert_eq!(exists.into_array()[0].as_i64(), Some(1));
        assert_eq!(s.changes_since(1).await.unwrap().0, 2);
    }

    #[tokio::test]
    async fn an_unreadable_record_is_named_with_its_server() {
        let (_dir, redis) = server().await;
        let s = store(&redis).await;
        s.insert_new(&key("k-1")).await.unwrap();
        raw(&s, "HSET", vec![KEYS.into(), "k-1".into(), "{not json".into()]).await;
        let e = s.load_all().await.unwrap_err().to_string();
        assert!(e.contains(&redis.url()) && e.contains("\"k-1\""), "{e}");
        let e = s.get("k-1").await.unwrap_err().to_string();
        assert!(e.contains("not a key record"), "{e}");
        raw(&s, "SET", vec![GEN.into(), "many".into()]).await;
        let e = s.changes_since(0).await.unwrap_err().to_string();
        assert!(e.contains(GEN), "{e}");
    }
}
