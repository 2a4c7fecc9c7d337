//! The shared store: every bucket of a request checked by one `EVALSHA` of `lua/check.lua` in
//! Redis or Valkey (one node or a Cluster), on the store's clock.
//!
//! The script is the arithmetic of `limit/bucket.rs`; the gateway sends only numbers (ARGV) and
//! bucket names followed by their pages (KEYS, [`page_of`](crate::page::page_of)) and reads
//! back integers, so both sides agree to the unit. A refund of an undelivered request is one
//! `EVALSHA` of `lua/refund.lua` on the buckets its check charged, sent at once (not through
//! the queue: refunds are rare) and, like every call, at most once.
//!
//! On one node every check waits in one queue, and the checks that queued meanwhile go together
//! in the next call (each still all-or-nothing on its own buckets), with at most
//! [`MAX_IN_FLIGHT`] calls out. (On a cluster a check is sent at once while fewer than
//! [`MAX_IN_FLIGHT_CLUSTER`] calls are out: checks of one hash slot rarely meet.)
//! The queue's task is woken by the first check and runs after the tasks the same readiness
//! woke, so the requests that arrived together share a call even while a call slot is free.
//! fred writes every command with its own socket write, so one call per check cost the gateway
//! about 12 µs of CPU per check on loopback, against 1.4 µs for `redis-benchmark -P 16`, and
//! the store a command dispatch and a script start per check; sharing calls pays those once per
//! call (benches/README.md "Row R").
//!
//! - `connect`: start-up, the connections to a node or a cluster's primaries, and the side
//!   client.
//! - `check`: a check's way to the store: the queue, the calls checks share, their encoding and
//!   the reading of their replies.
//! - `lease`: LEASE and GIVE BACK for the gateway's leased blocks (`lua/lease.lua`).
//! - `refund`: refunds and post-paid debits (`lua/refund.lua`).

mod blocks;
mod check;
mod connect;
mod lease;
mod refund;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fred::bytes_utils::Str;
use fred::prelude::{Error as FredError, ErrorKind, Key, Value};
use tokio::sync::{Semaphore, mpsc};

pub use connect::{Found, side_client};
pub use tollgate_access::{Access, Credentials, StoreTls, TlsFiles, redact};

use super::nodes::Script;
use super::{Adjusted, BoxFuture, CheckFuture, CheckItem, Outcome, Store, StoreError};
use check::Pending;
use connect::Conn;
use tollgate_limit::clock::Clock;

/// The check script. Its SHA-1 is what every call sends.
pub const SCRIPT: &str = concat!(
    include_str!("../../../lua/bucket.lua"),
    include_str!("../../../lua/check.lua")
);

/// The lease script (hot keys): LEASE and GIVE BACK on the same buckets, same encoding.
pub(crate) const LEASE_SCRIPT: &str = concat!(
    include_str!("../../../lua/bucket.lua"),
    include_str!("../../../lua/lease.lua")
);

/// The refund script: gives back what a check charged, for a request that was not delivered.
pub(crate) const REFUND_SCRIPT: &str = concat!(
    include_str!("../../../lua/bucket.lua"),
    include_str!("../../../lua/refund.lua")
);

/// Calls out at once; checks that queue while every slot is taken share the next call. A few
/// keep the connection busy without making a lone check wait for another's round trip.
pub const MAX_IN_FLIGHT: usize = 4;

/// Calls out at once on a Cluster. A script may touch one hash slot only, so checks of
/// different slots can never share a call, and a cap of four would only hold the rate to four
/// round trips at a time (benches/README.md "Redis Cluster: three masters beside one"); checks
/// of one slot still queue and share once this many are out.
pub const MAX_IN_FLIGHT_CLUSTER: usize = 64;

/// ARGV[1] that tells the script to read the store's TIME.
pub(crate) const STORE_CLOCK: i64 = -1;

/// Connections per node. With at most [`MAX_IN_FLIGHT`] calls out, one is enough: 1 and 2
/// measured the same (benches/README.md).
pub const DEFAULT_CONNECTIONS: usize = 1;

/// Where the store is, and how a connection reaches it.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub place: Place<'a>,
    pub access: &'a Access,
}

/// Where the store is.
#[derive(Debug, Clone, Copy)]
pub enum Place<'a> {
    /// `redis[s]://[user:password@]host:port[/db]`.
    Node(&'a str),
    /// `HOST:PORT` of one or more cluster nodes, the rest discovered; over TLS or not.
    Cluster { nodes: &'a [String], tls: bool },
    /// A primary that `HOST:PORT` sentinels name for `service`, followed through failovers.
    Sentinel {
        sentinels: &'a [String],
        service: &'a str,
        tls: bool,
    },
}

impl<'a> Target<'a> {
    /// One node at `url`, plain or (`rediss://`) TLS on the built-in roots.
    pub fn node(url: &'a str) -> Target<'a> {
        Target {
            place: Place::Node(url),
            access: Access::none(),
        }
    }

    /// A plain cluster reached through `nodes`.
    pub fn cluster(nodes: &'a [String]) -> Target<'a> {
        Target {
            place: Place::Cluster { nodes, tls: false },
            access: Access::none(),
        }
    }

    /// The same place, reached with `access`'s TLS and credentials.
    pub fn with(self, access: &'a Access) -> Target<'a> {
        Target { access, ..self }
    }

    /// Whether connections to it speak TLS.
    pub fn tls(&self) -> bool {
        match self.place {
            Place::Node(url) => url.starts_with("rediss://"),
            Place::Cluster { tls, .. } | Place::Sentinel { tls, .. } => tls,
        }
    }
}

/// The URL with its password replaced: what logs, errors and the admin pages show.
impl std::fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.place {
            Place::Node(url) => f.write_str(&redact(url)),
            Place::Cluster { nodes, tls } => {
                let scheme = if tls { "rediss-cluster" } else { "redis-cluster" };
                write!(f, "{scheme}://{}", nodes.join(","))
            }
            Place::Sentinel {
                sentinels,
                service,
                tls,
            } => {
                let scheme = if tls { "rediss-sentinel" } else { "redis-sentinel" };
                write!(f, "{scheme}://{}/{service}", sentinels.join(","))
            }
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
    /// The store answered but its TLS did not check out: never retried in plain text.
    #[error("TLS to the Redis store at {store} failed: {reason}")]
    Tls { store: String, reason: String },
    #[error("the Redis store at {store} refused the credentials (auth): {reason}")]
    Auth { store: String, reason: String },
    #[error(
        "the Redis store at {store} does not let this user run what Tollgate needs (ACL): {reason}. The README's \"Redis users\" lists the commands and keys to allow"
    )]
    NoPermission { store: String, reason: String },
    #[error("the Redis store at {store} refused to load lua/check.lua: {reason}")]
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
    #[error(
        "the Redis store at {store} is {version}: Tollgate needs Redis 5.0 or later (or any Valkey), whose scripts may read TIME before they write"
    )]
    TooOld { store: String, version: String },
}

/// Buckets in Redis, checked by `lua/check.lua`.
pub struct RedisStore {
    shared: Arc<Shared>,
    queue: mpsc::UnboundedSender<Pending>,
    kind: &'static str,
    /// What start-up found; `None` for a store connected later.
    found: Option<Found>,
}

impl RedisStore {
    /// What start-up found of the store: `None` when it was down at start.
    pub fn found(&self) -> Option<&Found> {
        self.found.as_ref()
    }
}

/// What the queue's task and the callers share.
struct Shared {
    /// [`DEFAULT_CONNECTIONS`] per node unless told otherwise, used round-robin.
    client: Conn,
    sha: Str,
    lease_sha: Str,
    refund_sha: Str,
    /// `None`: the script reads the store's TIME. `Some`: the gateway's clock (`--clock gateway`).
    clock: Option<Arc<dyn Clock>>,
    cluster: bool,
    name: String,
    calls: AtomicU64,
    checks: AtomicU64,
    /// One per call out, at most [`MAX_IN_FLIGHT`] ([`MAX_IN_FLIGHT_CLUSTER`] on a Cluster).
    permits: Arc<Semaphore>,
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
    /// The script's SHA-1, as sent by `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        &self.shared.sha
    }

    /// The store's name as given (`redis://…` or `redis-cluster://…`).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Script calls made and request checks they carried, since connecting (checks per call
    /// above 1 means the store fell behind and requests shared calls).
    pub fn calls_and_checks(&self) -> (u64, u64) {
        (
            self.shared.calls.load(Ordering::Relaxed),
            self.shared.checks.load(Ordering::Relaxed),
        )
    }

    /// The time the store's script reads now, in microseconds (or the gateway's, with
    /// `--clock gateway`).
    pub async fn now_us(&self) -> Result<u64, StoreError> {
        self.shared.probe().await.map_err(|e| store_error(&e))
    }
}

impl Shared {
    fn new(client: Conn, clock: Option<Arc<dyn Clock>>, cluster: bool, name: String) -> Arc<Shared> {
        Arc::new(Shared {
            client,
            sha: fred::util::sha1_hash(SCRIPT).into(),
            lease_sha: fred::util::sha1_hash(LEASE_SCRIPT).into(),
            refund_sha: fred::util::sha1_hash(REFUND_SCRIPT).into(),
            clock,
            cluster,
            name,
            calls: AtomicU64::new(0),
            checks: AtomicU64::new(0),
            permits: Arc::new(Semaphore::new(if cluster {
                MAX_IN_FLIGHT_CLUSTER
            } else {
                MAX_IN_FLIGHT
            })),
        })
    }

    /// `SCRIPT LOAD` of every script on every primary.
    async fn load(&self) -> Result<(), FredError> {
        self.client.load(SCRIPT).await?;
        self.client.load(LEASE_SCRIPT).await?;
        self.client.load(REFUND_SCRIPT).await
    }

    fn clock_arg(&self) -> i64 {
        match &self.clock {
            None => STORE_CLOCK,
            Some(c) => as_i64(c.now_us()),
        }
    }

    /// EVALSHA, and on NOSCRIPT (a failover or SCRIPT FLUSH emptied the cache) load the script
    /// again and retry once. `request` builds the call, so nothing is cloned for the retry.
    async fn eval(&self, request: impl Fn() -> (Vec<Key>, Vec<Value>)) -> Result<Value, FredError> {
        self.eval_script(&self.sha, request).await
    }

    /// [`Shared::eval`] for either script.
    async fn eval_script(
        &self,
        sha: &Str,
        request: impl Fn() -> (Vec<Key>, Vec<Value>),
    ) -> Result<Value, FredError> {
        let (keys, args) = request();
        match self.client.run(Script::Sha(sha), keys, args).await {
            Err(e) if is_noscript(&e) => {
                tracing::info!(store = %self.name, "the store lost its scripts (NOSCRIPT); loading them again");
                self.load().await?;
                let (keys, args) = request();
                self.client.run(Script::Sha(sha), keys, args).await
            }
            other => other,
        }
    }

    /// The script with no requests: `{now}`.
    async fn probe(&self) -> Result<u64, FredError> {
        let v = self
            .eval(|| {
                (
                    Vec::new(),
                    vec![Value::Integer(self.clock_arg()), Value::Integer(0)],
                )
            })
            .await?;
        match v {
            Value::Array(items) if items.len() == 1 => items
                .first()
                .and_then(int)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| FredError::new(ErrorKind::Parse, format!("probe answered {items:?}"))),
            other => Err(FredError::new(
                ErrorKind::Parse,
                format!("probe answered {other:?}"),
            )),
        }
    }
}

impl Store for RedisStore {
    fn check<'a>(&'a self, batch: &'a [CheckItem]) -> CheckFuture<'a> {
        CheckFuture::Boxed(Box::pin(self.check_batch(batch)))
    }

    fn kind(&self) -> &'static str {
        self.kind
    }

    fn adjust<'a>(
        &'a self,
        batch: &'a [CheckItem],
        outcome: &'a Outcome,
        units: &'a [i64],
    ) -> BoxFuture<'a, Result<Adjusted, StoreError>> {
        Box::pin(async move {
            if let Some(e) = crate::units_mismatch(batch, outcome, units) {
                return Err(e);
            }
            self.adjust_batch(batch, units).await
        })
    }

    /// Runs the script with no keys: the store answers, still has the script (or takes it
    /// again), and can read its clock.
    fn ping(&self) -> CheckFuture<'_> {
        CheckFuture::Boxed(Box::pin(self.check_batch(&[])))
    }

    fn blocks(&self) -> BoxFuture<'_, Result<crate::Blocks, StoreError>> {
        Box::pin(self.list_blocks())
    }

    fn lift<'a>(&'a self, bucket: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.lift_block(bucket))
    }

    fn heartbeat<'a>(&'a self, instance: &'a str) -> BoxFuture<'a, Result<Option<u32>, StoreError>> {
        Box::pin(async move {
            let n = self
                .shared
                .client
                .run(
                    Script::Text(HEARTBEAT),
                    vec![Key::from(FLEET_KEY)],
                    vec![Value::from(instance), Value::Integer(FLEET_WINDOW_MS)],
                )
                .await
                .map_err(|e| store_error(&e))?;
            let n = int(&n).ok_or_else(|| StoreError::Protocol(format!("the heartbeat answered {n:?}")))?;
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
