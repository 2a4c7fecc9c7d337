//! The shared store: every bucket of a request checked by one `EVALSHA` of `lua/check.lua` in
//! Redis or Valkey (one node or a Cluster), on the store's clock.
//!
//! The script is the arithmetic of `limit/bucket.rs`; the gateway sends only numbers (ARGV) and
//! bucket names (KEYS) and reads back integers, so both sides agree to the unit. fred pipelines
//! the calls of every task over one connection per node.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::{
    Builder, ClientLike, Config, ConnectionConfig, Error as FredError, ErrorKind, Key, LuaInterface,
    PerformanceConfig, ReconnectPolicy, Server, ServerConfig, TcpConfig, Value,
};
use fred::types::config::ClusterDiscoveryPolicy;
use smallvec::SmallVec;

use super::lease::{GiveBackReply, LeaseReply, Lessor};
use super::{BoxFuture, CheckFuture, CheckItem, Outcome, Source, Store, StoreError};
use crate::limit::bucket::{BucketParams, BucketVerdict};
use crate::limit::clock::Clock;
use crate::limit::lease::Grant;

/// The check script. Its SHA-1 is what every call sends.
pub const SCRIPT: &str = include_str!("../../lua/check.lua");

/// The lease script (hot keys): LEASE and GIVE BACK on the same buckets, same encoding.
pub const LEASE_SCRIPT: &str = include_str!("../../lua/lease.lua");

/// ARGV per bucket: scale, refill, capacity, need, ttl, shadow.
pub const ARGS_PER_BUCKET: usize = 6;

/// ARGV[1] that tells the script to read the store's TIME.
pub const STORE_CLOCK: i64 = -1;

/// How long a new connection may take before start-up gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A bound on one call, so a store that stops answering gives a `StoreError::Timeout` rather
/// than a request that hangs. The failure guard sets the real, much shorter, budget.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the store is.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// `redis://[user:password@]host:port[/db]`.
    Node(&'a str),
    /// `HOST:PORT` of one or more cluster nodes; the rest are discovered.
    Cluster(&'a [String]),
}

impl std::fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Node(url) => f.write_str(url),
            Target::Cluster(nodes) => write!(f, "redis-cluster://{}", nodes.join(",")),
        }
    }
}

/// Why the store can't be used at start-up. Every message names the store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ConnectError {
    #[error("--store {store}: {reason}")]
    BadTarget { store: String, reason: String },
    #[error("cannot connect to the Redis store at {store}: {reason}")]
    Unreachable { store: String, reason: String },
    #[error("the Redis store at {store} refused to load lua/check.lua or lua/lease.lua: {reason}")]
    ScriptLoad { store: String, reason: String },
    #[error(
        "the Redis store at {store} cannot read its clock inside a script (TIME in lua/check.lua failed: {reason}). \
         Tollgate refills buckets on the store's clock so that gateways whose clocks differ cannot hand out extra \
         tokens. Use a store that allows TIME in scripts, or start with --clock gateway (TOLLGATE_CLOCK=gateway) \
         and accept the cost described in the README section \"Redis store\""
    )]
    TimeRefused { store: String, reason: String },
    #[error("the Redis store at {store} ran lua/check.lua but answered {answer}")]
    BadProbe { store: String, answer: String },
}

/// Buckets in Redis, checked by `lua/check.lua`.
pub struct RedisStore {
    client: fred::prelude::Client,
    sha: fred::bytes_utils::Str,
    lease_sha: fred::bytes_utils::Str,
    /// `None`: the script reads the store's TIME. `Some`: the gateway's clock (`--clock gateway`).
    clock: Option<Arc<dyn Clock>>,
    kind: &'static str,
    name: String,
}

fn fred_config(target: Target<'_>) -> Result<Config, String> {
    match target {
        Target::Node(url) => {
            if url.starts_with("rediss://") {
                return Err(
                    "TLS to Redis (rediss://) is not built in; use redis:// on a trusted network".into(),
                );
            }
            Config::from_url_centralized(url)
                .map_err(|e| format!("not a usable redis:// URL: {}", e.details()))
        }
        Target::Cluster(nodes) => {
            let mut hosts = Vec::with_capacity(nodes.len());
            for n in nodes {
                let (host, port) = n
                    .rsplit_once(':')
                    .ok_or_else(|| format!("cluster node {n:?} must be HOST:PORT"))?;
                let port: u16 = port
                    .parse()
                    .map_err(|_| format!("cluster node {n:?}: {port:?} is not a port number"))?;
                if host.is_empty() {
                    return Err(format!("cluster node {n:?} has no host"));
                }
                hosts.push(Server::new(host, port));
            }
            Ok(Config {
                server: ServerConfig::Clustered {
                    hosts,
                    policy: ClusterDiscoveryPolicy::default(),
                },
                ..Config::default()
            })
        }
    }
}

fn is_noscript(e: &FredError) -> bool {
    e.details().starts_with("NOSCRIPT")
}

/// A failed call, for the caller. The script's own error replies and the store's (OOM, BUSY,
/// LOADING…) mean the store can't answer now; only a reply we can't read is a protocol error.
fn store_error(e: &FredError) -> StoreError {
    match e.kind() {
        ErrorKind::Timeout => StoreError::Timeout,
        ErrorKind::Parse | ErrorKind::Protocol => StoreError::Protocol(e.to_string()),
        _ => StoreError::Unavailable(e.details().to_string()),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        _ => None,
    }
}

fn as_i64(v: u64) -> i64 {
    // Rule validation keeps every number sent to the script below 2^53.
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl RedisStore {
    /// Connects, loads the script and runs it once: start-up fails here, with a message that
    /// names the store, if the store is unreachable, refuses the script, or (on the store's
    /// clock) refuses TIME inside a script.
    pub async fn connect(
        target: Target<'_>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<RedisStore, ConnectError> {
        let name = target.to_string();
        let config = fred_config(target).map_err(|reason| ConnectError::BadTarget {
            store: name.clone(),
            reason,
        })?;
        let kind = match target {
            Target::Node(_) => "redis",
            Target::Cluster(_) => "redis-cluster",
        };
        let client = Builder::from_config(config)
            .with_connection_config(|c: &mut ConnectionConfig| {
                c.connection_timeout = CONNECT_TIMEOUT;
                c.internal_command_timeout = CONNECT_TIMEOUT;
                // At most once: a check whose reply was lost may have charged its buckets, so it
                // is never sent again behind the caller's back.
                c.max_command_attempts = 1;
                c.tcp = TcpConfig {
                    nodelay: Some(true),
                    ..TcpConfig::default()
                };
            })
            .with_performance_config(|p: &mut PerformanceConfig| {
                p.default_command_timeout = COMMAND_TIMEOUT;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 100, 2_000, 2))
            .build()
            .map_err(|e| ConnectError::BadTarget {
                store: name.clone(),
                reason: e.details().to_string(),
            })?;
        client.init().await.map_err(|e| ConnectError::Unreachable {
            store: name.clone(),
            reason: e.details().to_string(),
        })?;
        let sha = fred::util::sha1_hash(SCRIPT);
        let store = RedisStore {
            client,
            sha: sha.into(),
            lease_sha: fred::util::sha1_hash(LEASE_SCRIPT).into(),
            clock,
            kind,
            name,
        };
        store.load().await.map_err(|e| ConnectError::ScriptLoad {
            store: store.name.clone(),
            reason: e.details().to_string(),
        })?;
        let probe = store.probe_raw().await;
        let Err(e) = probe else {
            return Ok(store);
        };
        let _ = store.client.quit().await;
        let (store_name, reason) = (store.name.clone(), e.details().to_string());
        Err(match e.kind() {
            ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled => ConnectError::Unreachable {
                store: store_name,
                reason,
            },
            // On the store's clock the probe does nothing but read TIME.
            _ if store.clock.is_none() => ConnectError::TimeRefused {
                store: store_name,
                reason,
            },
            _ => ConnectError::BadProbe {
                store: store_name,
                answer: reason,
            },
        })
    }

    /// A store that is down at start-up: the client connects (and reconnects) in the background
    /// and the script is loaded at the first NOSCRIPT. Meanwhile every call fails, and the
    /// failure policies decide.
    pub fn connect_later(
        target: Target<'_>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<RedisStore, ConnectError> {
        let name = target.to_string();
        let mut config = fred_config(target).map_err(|reason| ConnectError::BadTarget {
            store: name.clone(),
            reason,
        })?;
        // Keep trying the first connection as if it had dropped.
        config.fail_fast = false;
        let kind = match target {
            Target::Node(_) => "redis",
            Target::Cluster(_) => "redis-cluster",
        };
        let client = Builder::from_config(config)
            .with_connection_config(|c: &mut ConnectionConfig| {
                c.connection_timeout = CONNECT_TIMEOUT;
                c.internal_command_timeout = CONNECT_TIMEOUT;
                c.max_command_attempts = 1;
                c.tcp = TcpConfig {
                    nodelay: Some(true),
                    ..TcpConfig::default()
                };
            })
            .with_performance_config(|p: &mut PerformanceConfig| {
                p.default_command_timeout = COMMAND_TIMEOUT;
            })
            .set_policy(ReconnectPolicy::new_constant(0, 500))
            .build()
            .map_err(|e| ConnectError::BadTarget {
                store: name.clone(),
                reason: e.details().to_string(),
            })?;
        // The connection task runs on its own; its handle is not needed.
        drop(client.connect());
        Ok(RedisStore {
            client,
            sha: fred::util::sha1_hash(SCRIPT).into(),
            lease_sha: fred::util::sha1_hash(LEASE_SCRIPT).into(),
            clock,
            kind,
            name,
        })
    }

    /// `SCRIPT LOAD` of both scripts on every primary.
    async fn load(&self) -> Result<(), FredError> {
        self.client.script_load_cluster::<(), _>(SCRIPT).await?;
        self.client.script_load_cluster::<(), _>(LEASE_SCRIPT).await
    }

    /// The script's SHA-1, as sent by `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        &self.sha
    }

    /// The store's name as given (`redis://…` or `redis-cluster://…`).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn clock_arg(&self) -> i64 {
        match &self.clock {
            None => STORE_CLOCK,
            Some(c) => as_i64(c.now_us()),
        }
    }

    /// EVALSHA of check.lua, and on NOSCRIPT (a failover or SCRIPT FLUSH emptied the cache) load
    /// the scripts again and retry once. `request` builds the call, so nothing is cloned for the
    /// retry.
    async fn eval(&self, request: impl Fn() -> (Vec<Key>, Vec<Value>)) -> Result<Value, FredError> {
        self.eval_script(&self.sha, request).await
    }

    async fn eval_script(
        &self,
        sha: &fred::bytes_utils::Str,
        request: impl Fn() -> (Vec<Key>, Vec<Value>),
    ) -> Result<Value, FredError> {
        let (keys, args) = request();
        match self
            .client
            .evalsha::<Value, _, _, _>(sha.clone(), keys, args)
            .await
        {
            Err(e) if is_noscript(&e) => {
                tracing::info!(store = %self.name, "the store lost its scripts (NOSCRIPT); loading them again");
                self.load().await?;
                let (keys, args) = request();
                self.client.evalsha(sha.clone(), keys, args).await
            }
            other => other,
        }
    }

    /// The script with no keys: `{1, now}`.
    async fn probe_raw(&self) -> Result<u64, FredError> {
        let v = self
            .eval(|| (Vec::new(), vec![Value::Integer(self.clock_arg())]))
            .await?;
        match v {
            Value::Array(items) if items.len() == 2 && int(&items[0]) == Some(1) => items
                .get(1)
                .and_then(int)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| FredError::new(ErrorKind::Parse, format!("probe answered {items:?}"))),
            other => Err(FredError::new(
                ErrorKind::Parse,
                format!("probe answered {other:?}"),
            )),
        }
    }

    /// The time the store's script reads now, in microseconds (or the gateway's, with
    /// `--clock gateway`).
    pub async fn now_us(&self) -> Result<u64, StoreError> {
        self.probe_raw().await.map_err(|e| store_error(&e))
    }

    fn request(&self, batch: &[CheckItem]) -> (Vec<Key>, Vec<Value>) {
        let keys: Vec<Key> = batch.iter().map(|i| Key::from(&*i.key)).collect();
        let mut args = Vec::with_capacity(1 + ARGS_PER_BUCKET * batch.len());
        args.push(Value::Integer(self.clock_arg()));
        for i in batch {
            let p = &i.charge.params;
            // Any need above the capacity answers the same ("never"), so cap it there and keep
            // every ARGV exact in a double.
            let need = p.units(i.charge.cost).min(p.capacity + 1);
            args.extend([
                Value::Integer(as_i64(p.scale)),
                Value::Integer(as_i64(p.refill)),
                Value::Integer(as_i64(p.capacity)),
                Value::Integer(as_i64(need)),
                Value::Integer(as_i64(p.ttl_ms())),
                Value::Integer(i64::from(i.charge.shadow)),
            ]);
        }
        (keys, args)
    }

    /// Checks one batch in the store.
    pub async fn check_batch(&self, batch: &[CheckItem]) -> Result<Outcome, StoreError> {
        if batch.is_empty() {
            let now_us = self.now_us().await?;
            return Ok(Outcome {
                allowed: true,
                now_us,
                buckets: SmallVec::new(),
                source: Source::Store,
            });
        }
        let reply = self
            .eval(|| self.request(batch))
            .await
            .map_err(|e| store_error(&e))?;
        parse_reply(batch.len(), reply)
    }
}

/// ARGV of one `lua/lease.lua` call: the clock, the operation, the bucket's numbers, the units
/// and, for a lease, one block cycle.
fn lease_args(clock: i64, op: &'static str, p: &BucketParams, units: u64, cycle_us: u64) -> Vec<Value> {
    vec![
        Value::Integer(clock),
        Value::from(op),
        Value::Integer(as_i64(p.scale)),
        Value::Integer(as_i64(p.refill)),
        Value::Integer(as_i64(p.capacity)),
        // Never more than the capacity: a block is at most the burst, and a give-back of more
        // than the capacity fills the bucket all the same.
        Value::Integer(as_i64(units.min(p.capacity))),
        Value::Integer(as_i64(p.ttl_ms())),
        Value::Integer(as_i64(cycle_us)),
    ]
}

/// Reads `{granted, now, tokens, until}`.
fn parse_lease_reply(reply: Value) -> Result<(bool, u64, u64, u64), StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/lease.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    if items.len() != 4 {
        return Err(bad(format!("{} values, not 4", items.len())));
    }
    let mut n = [0u64; 4];
    for (i, v) in items.iter().enumerate() {
        n[i] = int(v)
            .and_then(|x| u64::try_from(x).ok())
            .ok_or_else(|| bad(format!("{v:?} at {}, not a non-negative integer", i + 1)))?;
    }
    let granted = match n[0] {
        0 => false,
        1 => true,
        other => return Err(bad(format!("granted = {other}"))),
    };
    Ok((granted, n[1], n[2], n[3]))
}

impl RedisStore {
    /// LEASE: a whole block of `block` tokens from the bucket `key`, or nothing and the store
    /// time before which to ask again (`now + cycle_us`).
    pub async fn lease(
        &self,
        key: &str,
        p: &BucketParams,
        block: u64,
        cycle_us: u64,
    ) -> Result<LeaseReply, StoreError> {
        let reply = self
            .eval_script(&self.lease_sha, || {
                (
                    vec![Key::from(key)],
                    lease_args(self.clock_arg(), "lease", p, p.units(block), cycle_us),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let (granted, now_us, units_left, until_us) = parse_lease_reply(reply)?;
        let grant = if granted {
            Grant::Granted { tokens: block }
        } else {
            if until_us < now_us {
                return Err(StoreError::Protocol(format!(
                    "lua/lease.lua refused with until {until_us} before now {now_us}"
                )));
            }
            Grant::Denied { until_us }
        };
        Ok(LeaseReply {
            grant,
            now_us,
            units_left,
        })
    }

    /// GIVE BACK: `tokens` unused tokens added to the bucket `key`, capped at its burst.
    pub async fn give_back(
        &self,
        key: &str,
        p: &BucketParams,
        tokens: u64,
    ) -> Result<GiveBackReply, StoreError> {
        let reply = self
            .eval_script(&self.lease_sha, || {
                (
                    vec![Key::from(key)],
                    lease_args(self.clock_arg(), "give", p, p.units(tokens), 0),
                )
            })
            .await
            .map_err(|e| store_error(&e))?;
        let (_, now_us, units_left, _) = parse_lease_reply(reply)?;
        Ok(GiveBackReply { now_us, units_left })
    }

    /// The lease script's SHA-1.
    pub fn lease_script_sha(&self) -> &str {
        &self.lease_sha
    }
}

impl Lessor for RedisStore {
    fn lease<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        block: u64,
        cycle_us: u64,
    ) -> BoxFuture<'a, Result<LeaseReply, StoreError>> {
        Box::pin(RedisStore::lease(self, key, p, block, cycle_us))
    }

    fn give_back<'a>(
        &'a self,
        key: &'a str,
        p: &'a BucketParams,
        tokens: u64,
    ) -> BoxFuture<'a, Result<GiveBackReply, StoreError>> {
        Box::pin(RedisStore::give_back(self, key, p, tokens))
    }
}

/// Reads `{allowed, now, tokens_1, wait_1, …}`.
fn parse_reply(n: usize, reply: Value) -> Result<Outcome, StoreError> {
    let bad = |what: String| StoreError::Protocol(format!("lua/check.lua answered {what}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}, not an array")));
    };
    if items.len() != 2 + 2 * n {
        return Err(bad(format!("{} values for {n} buckets", items.len())));
    }
    let num = |i: usize| -> Result<i64, StoreError> {
        int(&items[i]).ok_or_else(|| bad(format!("{:?} at {}, not an integer", items[i], i + 1)))
    };
    let allowed = match num(0)? {
        0 => false,
        1 => true,
        other => return Err(bad(format!("allowed = {other}"))),
    };
    let now_us = u64::try_from(num(1)?).map_err(|_| bad("a negative now".into()))?;
    let mut buckets = SmallVec::with_capacity(n);
    for b in 0..n {
        let tokens = u64::try_from(num(2 + 2 * b)?).map_err(|_| bad("negative tokens".into()))?;
        let wait_us = match num(3 + 2 * b)? {
            -1 => None,
            w => Some(u64::try_from(w).map_err(|_| bad(format!("wait {w}")))?),
        };
        buckets.push(BucketVerdict {
            sufficient: wait_us == Some(0),
            tokens,
            wait_us,
        });
    }
    Ok(Outcome {
        allowed,
        now_us,
        buckets,
        source: Source::Store,
    })
}

impl Store for RedisStore {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        CheckFuture::Boxed(Box::pin(self.check_batch(batch)))
    }

    fn kind(&self) -> &'static str {
        self.kind
    }

    /// Runs the script with no keys: the store answers, still has the script (or takes it
    /// again), and can read its clock.
    fn ping(&self) -> CheckFuture<'_> {
        CheckFuture::Boxed(Box::pin(self.check_batch(&[])))
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        Box::pin(async move {
            let n: i64 = self
                .client
                .eval(
                    HEARTBEAT,
                    vec![Key::from(FLEET_KEY)],
                    vec![Value::from(instance), Value::Integer(FLEET_WINDOW_MS)],
                )
                .await
                .map_err(|e| store_error(&e))?;
            Ok(u32::try_from(n).ok().filter(|n| *n > 0))
        })
    }

    fn remote(&self) -> bool {
        true
    }
}

/// Who is alive: a sorted set of gateway instances scored by the store's clock (ms), pruned of
/// those silent for [`FLEET_WINDOW_MS`]. One key, so it works on a cluster too.
const FLEET_KEY: &str = "tollgate:{fleet}:members";
const FLEET_WINDOW_MS: i64 = 5_000;
const HEARTBEAT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_is_read_strictly() {
        let ok = Value::Array(vec![
            Value::Integer(0),
            Value::Integer(17),
            Value::Integer(5),
            Value::Integer(-1),
        ]);
        let o = parse_reply(1, ok).unwrap();
        assert!(!o.allowed);
        assert_eq!(o.now_us, 17);
        assert_eq!(o.buckets[0].wait_us, None);
        assert!(!o.buckets[0].sufficient);
        assert!(parse_reply(2, Value::Array(vec![Value::Integer(1), Value::Integer(1)])).is_err());
        assert!(parse_reply(0, Value::Array(vec![Value::Integer(2), Value::Integer(1)])).is_err());
        assert!(parse_reply(0, Value::Null).is_err());
    }
}
